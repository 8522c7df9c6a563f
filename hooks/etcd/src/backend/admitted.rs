//! Admitted objects' facts in etcd, shared by every webhook replica: a pod admitted by
//! one replica is bound (its `pods/binding` judged) by whichever replica the apiserver
//! calls next.
//!
//! Each entry is written under a lease whose TTL is the configured time plus a quarter
//! of it; one lease serves every entry written in a quarter of that time, so writing
//! costs one lease grant per quarter, not one per pod, and etcd removes the entries by
//! itself. The count is bounded by the admission rate over that time (etcd keeps no
//! cheap count to bound it by); a read checks the entry's age as well.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use probity::state::{AdmittedFacts, AdmittedLimits, StateError};

use super::records::ADMITTED;
use super::{EtcdState, lock};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl EtcdState {
    pub(super) fn remember_admitted_shared(
        &self,
        facts: &AdmittedFacts,
        limits: &AdmittedLimits,
    ) -> Result<(), StateError> {
        let value = self.encode("encoding admitted facts", facts)?;
        let key = format!(
            "{ADMITTED}{}",
            AdmittedFacts::key(&facts.namespace, &facts.name)
        );
        let keep = Duration::from_secs(limits.seconds.max(1));
        let quarter = keep / 4;
        // One lease per lifetime: facts kept 14 days must not ride a 1-day lease
        // granted for another caller's.
        let seconds = keep.as_secs();
        let current = lock(&self.core.admitted_lease).get(&seconds).copied();
        let lease = match current {
            Some((id, granted)) if granted.elapsed() < quarter => id,
            _ => {
                let client = self.core.client.clone();
                let lease = self.run("granting the admitted facts' lease", async move {
                    client.grant_lease(keep + quarter).await
                })?;
                let mut leases = lock(&self.core.admitted_lease);
                // Bounded: only a handful of lifetimes are ever configured.
                if leases.len() >= 16 {
                    leases.clear();
                }
                leases.insert(seconds, (lease.id, Instant::now()));
                lease.id
            }
        };
        let client = self.core.client.clone();
        self.run("remembering admitted facts", async move {
            client.put_with_lease(&key, value, lease).await
        })
        .map(|_| ())
    }

    pub(super) fn admitted_shared(
        &self,
        namespace: &str,
        name: &str,
        max_age_seconds: u64,
    ) -> Result<Option<AdmittedFacts>, StateError> {
        let client = self.core.client.clone();
        let key = format!("{ADMITTED}{}", AdmittedFacts::key(namespace, name));
        let k = key.clone();
        let (entry, _) = self.run(
            "reading admitted facts",
            async move { client.get(&k).await },
        )?;
        let Some(entry) = entry else {
            return Ok(None);
        };
        let facts: AdmittedFacts = serde_json::from_slice(&entry.value).map_err(|e| {
            self.core.err(
                "reading admitted facts",
                std::io::Error::other(format!("malformed record at {key:?}: {e}")),
            )
        })?;
        Ok((!facts.expired(now_ms(), max_age_seconds)).then_some(facts))
    }

    pub(super) fn forget_admitted_shared(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<(), StateError> {
        let client = self.core.client.clone();
        let key = format!("{ADMITTED}{}", AdmittedFacts::key(namespace, name));
        self.run("forgetting admitted facts", async move {
            client.delete(&key).await
        })
        .map(|_| ())
    }
}
