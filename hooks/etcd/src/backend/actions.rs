//! Action requests in etcd (`actions/<kind>/<node>/<policy>/<target>`): each under the
//! publishing agent's facts lease, so a request ends with its agent's facts (the agent
//! died, or stopped publishing for a TTL) and nobody acts on a dead agent's word.

use probity::state::{ActionRequest, StateError};

use super::records::{ACTIONS, MAX_RECORD_LEN};
use super::{EtcdState, lock};

impl EtcdState {
    pub(super) fn publish_action_shared(&self, request: &ActionRequest) -> Result<(), StateError> {
        const WHAT: &str = "publishing an action request";
        let lease = lock(&self.core.facts)
            .get(&request.node)
            .map(|f| f.lease.id);
        let Some(lease) = lease else {
            return Err(self.core.err(
                WHAT,
                std::io::Error::other(format!(
                    "node {} published no facts from this process: an action request lives under its facts lease",
                    request.node
                )),
            ));
        };
        let bytes = self.encode("encoding an action request", request)?;
        let key = format!("{ACTIONS}{}", request.key());
        let client = self.core.client.clone();
        self.run(WHAT, async move {
            client.put_with_lease(&key, bytes, lease).await
        })
        .map(|_| ())
    }

    pub(super) fn withdraw_action_shared(&self, key: &str) -> Result<(), StateError> {
        let key = format!("{ACTIONS}{key}");
        let client = self.core.client.clone();
        self.run("withdrawing an action request", async move {
            client.delete(&key).await
        })
        .map(|_| ())
    }

    pub(super) fn action_requests_shared(&self) -> Result<Vec<ActionRequest>, StateError> {
        const WHAT: &str = "reading action requests";
        let client = self.core.client.clone();
        let listing = self.run(WHAT, async move { client.list(ACTIONS).await })?;
        listing
            .entries
            .iter()
            .map(|e| {
                let parsed = if e.value.len() > MAX_RECORD_LEN {
                    Err(format!("over {MAX_RECORD_LEN} bytes"))
                } else {
                    serde_json::from_slice::<ActionRequest>(&e.value).map_err(|err| err.to_string())
                };
                parsed.map_err(|reason| {
                    self.core.err(
                        WHAT,
                        std::io::Error::other(format!("malformed record at {:?}: {reason}", e.key)),
                    )
                })
            })
            .collect()
    }
}
