//! Action requests in the embedded store ([`crate::state::ActionRequest`]): one table,
//! by key; a request past its TTL is removed by the next publish, so a dead agent's
//! requests neither count (readers keep live ones) nor pile up.

use redb::ReadableTable as _;

use super::{ACTIONS, StateStore};
use crate::state::{ActionRequest, StateError};

impl StateStore {
    pub(super) fn put_action(&self, request: &ActionRequest) -> Result<(), StateError> {
        let bytes = self.encode("encoding an action request", request)?;
        let key = request.key();
        let now = self.now_unix();
        self.write("publishing an action request", |txn| {
            let mut table = txn.open_table(ACTIONS)?;
            let mut expired = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                let live = serde_json::from_slice::<ActionRequest>(v.value())
                    .is_ok_and(|r| r.is_live(now));
                if !live {
                    expired.push(k.value().to_owned());
                }
            }
            for k in expired {
                table.remove(k.as_str())?;
            }
            table.insert(key.as_str(), bytes.as_slice())?;
            Ok(())
        })
    }

    pub(super) fn remove_action(&self, key: &str) -> Result<(), StateError> {
        self.write("withdrawing an action request", |txn| {
            txn.open_table(ACTIONS)?.remove(key)?;
            Ok(())
        })
    }

    pub(super) fn list_actions(&self) -> Result<Vec<ActionRequest>, StateError> {
        self.values_of(ACTIONS, "actions", "reading action requests")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use crate::state::{ActionRequest, MIGRATE, SharedState as _, StateStore};

    fn request(node: &str, at: u64) -> ActionRequest {
        ActionRequest {
            kind: MIGRATE.into(),
            target: "zone-a".into(),
            target_type: "Zone".into(),
            policy: "thermal.zone-power-ceiling".into(),
            reason: "at its ceiling".into(),
            node: node.into(),
            at,
            ttl_seconds: 30,
            parameters: BTreeMap::from([("per_window".into(), "2".into())]),
            dry_run: false,
        }
    }

    #[test]
    fn an_action_request_is_replaced_by_its_agent_and_withdrawn_when_its_finding_clears() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(crate::clock::ManualClock::at(20));
        let s = StateStore::open_with_clock(dir.path(), clock).unwrap();
        s.publish_action(&request("gpu-1", 10)).unwrap();
        s.publish_action(&request("gpu-1", 20)).unwrap();
        s.publish_action(&request("gpu-2", 20)).unwrap();
        let mut got = s.action_requests().unwrap();
        got.sort_by(|a, b| a.node.cmp(&b.node));
        assert_eq!(got, [request("gpu-1", 20), request("gpu-2", 20)]);
        s.withdraw_action(&request("gpu-1", 0).key()).unwrap();
        assert_eq!(s.action_requests().unwrap(), [request("gpu-2", 20)]);
        s.withdraw_action("migrate/none/p/z").unwrap();
    }

    #[test]
    fn a_dead_agents_action_request_is_removed_by_the_next_publish() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(crate::clock::ManualClock::at(1_000));
        let s = StateStore::open_with_clock(dir.path(), clock.clone()).unwrap();
        s.publish_action(&request("dead", 1_000)).unwrap();
        clock.advance(31);
        s.publish_action(&request("alive", 1_031)).unwrap();
        assert_eq!(s.action_requests().unwrap(), [request("alive", 1_031)]);
    }
}
