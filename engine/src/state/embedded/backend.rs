//! [`SharedState`] for the embedded store.

use std::time::Duration;

use redb::{ReadableTable as _, ReadableTableMetadata as _};

use crate::audit::Checkpoint;
use crate::block::BlockRecord;

use super::*;

impl SharedState for StateStore {
    fn describe(&self) -> String {
        format!("redb {}", self.path.display())
    }
    fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError> {
        StateStore::registry_entry(self, object_id)
    }
    fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError> {
        StateStore::accept(self, object_id, version, digest, signed_manifest)
    }
    fn put_block(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError> {
        StateStore::put_block(self, node, record).map(Some)
    }
    fn unblock_node(&self, node: &str) -> Result<bool, StateError> {
        StateStore::unblock_node(self, node)
    }
    fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError> {
        StateStore::blocked_nodes(self)
    }
    fn block_tombstones(&self) -> Result<std::collections::BTreeMap<String, u64>, StateError> {
        StateStore::block_tombstones(self)
    }
    fn key_record(&self, id: &str) -> Result<Option<(Vec<u8>, u64)>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Option<Vec<u8>>, redb::Error> {
            let table = txn.open_table(KEYS)?;
            Ok(table.get(id)?.map(|g| g.value().to_vec()))
        };
        match self.read("reading key metadata", read)? {
            None => Ok(None),
            Some(raw) => {
                let (rev, body) = split_revision(&raw).ok_or_else(|| self.corrupt("keys", id))?;
                Ok(Some((body.to_vec(), rev)))
            }
        }
    }
    fn put_key_record(
        &self,
        id: &str,
        record: &[u8],
        expected: Option<u64>,
    ) -> Result<u64, StateError> {
        let mut refusal = None;
        let revision = self.write("writing key metadata", |txn| {
            let mut table = txn.open_table(KEYS)?;
            let found = table
                .get(id)?
                .and_then(|g| split_revision(g.value()).map(|(r, _)| r));
            if found != expected {
                refusal = Some(found);
                return Ok(0);
            }
            let next = found.map_or(1, |r| r.saturating_add(1));
            let mut value = next.to_be_bytes().to_vec();
            value.extend_from_slice(record);
            table.insert(id, value.as_slice())?;
            Ok(next)
        })?;
        match refusal {
            Some(found) => Err(StateError::Conflict {
                what: "key",
                key: id.to_owned(),
                expected,
                found,
            }),
            None => Ok(revision),
        }
    }
    fn delete_key_record(&self, id: &str, expected: u64) -> Result<(), StateError> {
        let mut refusal = None;
        self.write("deleting key metadata", |txn| {
            let mut table = txn.open_table(KEYS)?;
            let found = table
                .get(id)?
                .and_then(|g| split_revision(g.value()).map(|(r, _)| r));
            if found != Some(expected) {
                refusal = Some(found);
                return Ok(());
            }
            table.remove(id)?;
            Ok(())
        })?;
        match refusal {
            Some(found) => Err(StateError::Conflict {
                what: "key",
                key: id.to_owned(),
                expected: Some(expected),
                found,
            }),
            None => Ok(()),
        }
    }
    fn key_ids(&self) -> Result<Vec<String>, StateError> {
        self.keys_of(KEYS, "listing key metadata")
    }
    fn remember_admitted(
        &self,
        facts: &AdmittedFacts,
        limits: &AdmittedLimits,
    ) -> Result<(), StateError> {
        // Each entry carries its own lifetime: callers keep facts for different times
        // (a pod's for a day, a Slurm job's for weeks), and one's purge must not cut
        // the other's short.
        let stored = StoredAdmitted {
            facts: facts.clone(),
            keep_seconds: Some(limits.seconds),
        };
        let bytes = self.encode("encoding admitted facts", &stored)?;
        let key = AdmittedFacts::key(&facts.namespace, &facts.name);
        let now = facts.admitted_at_ms;
        self.write("remembering admitted facts", |txn| {
            let mut table = txn.open_table(ADMITTED)?;
            table.insert(key.as_str(), bytes.as_slice())?;
            if usize::try_from(table.len()?).unwrap_or(usize::MAX) <= limits.max {
                return Ok(());
            }
            // Over the bound: the expired go (each by its own lifetime), then those
            // nearest their end, down to 90% of it so that this scan is not made on
            // every admission. An unreadable entry counts as expired long ago.
            let mut entries: Vec<(u64, bool, String)> = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                if k.value() == key {
                    continue;
                }
                let (deadline, expired) = match serde_json::from_slice::<StoredAdmitted>(v.value())
                {
                    Ok(f) => (
                        f.deadline_ms(limits.seconds),
                        f.expired(now, limits.seconds),
                    ),
                    Err(_) => (0, true),
                };
                entries.push((deadline, expired, k.value().to_owned()));
            }
            entries.sort();
            // The entry just written stays: it is one of the kept.
            let keep = (limits.max.saturating_mul(9) / 10).saturating_sub(1);
            let excess = entries.len().saturating_sub(keep);
            for (i, (_, expired, k)) in entries.iter().enumerate() {
                if i < excess || *expired {
                    table.remove(k.as_str())?;
                }
            }
            Ok(())
        })
    }
    fn admitted(
        &self,
        namespace: &str,
        name: &str,
        max_age_seconds: u64,
    ) -> Result<Option<AdmittedFacts>, StateError> {
        let key = AdmittedFacts::key(namespace, name);
        let read = |txn: &redb::ReadTransaction| -> Result<Option<Vec<u8>>, redb::Error> {
            let table = txn.open_table(ADMITTED)?;
            Ok(table.get(key.as_str())?.map(|g| g.value().to_vec()))
        };
        let Some(raw) = self.read("reading admitted facts", read)? else {
            return Ok(None);
        };
        let stored: StoredAdmitted =
            serde_json::from_slice(&raw).map_err(|_| self.corrupt("admitted", &key))?;
        let facts = stored.facts;
        Ok((!facts.expired(self.now_unix_ms(), max_age_seconds)).then_some(facts))
    }
    fn forget_admitted(&self, namespace: &str, name: &str) -> Result<(), StateError> {
        let key = AdmittedFacts::key(namespace, name);
        self.write("forgetting admitted facts", |txn| {
            txn.open_table(ADMITTED)?.remove(key.as_str())?;
            Ok(())
        })
    }
    fn publish_facts(&self, facts: &NodeFacts) -> Result<(), StateError> {
        let bytes = self.encode("encoding node facts", facts)?;
        self.write("publishing node facts", |txn| {
            txn.open_table(FACTS)?
                .insert(facts.node.as_str(), bytes.as_slice())?;
            Ok(())
        })
    }
    fn node_facts(&self) -> Result<Vec<NodeFacts>, StateError> {
        self.values_of(FACTS, "facts", "reading node facts")
    }
    fn report_digest(&self, served: &ServedDigest) -> Result<(), StateError> {
        let bytes = self.encode("encoding a served digest", served)?;
        self.write("reporting a served digest", |txn| {
            txn.open_table(DIGESTS)?
                .insert(served.process.as_str(), bytes.as_slice())?;
            Ok(())
        })
    }
    fn served_digests(&self) -> Result<Vec<ServedDigest>, StateError> {
        self.values_of(DIGESTS, "digests", "reading served digests")
    }
    fn publish_action(&self, request: &ActionRequest) -> Result<(), StateError> {
        self.put_action(request)
    }
    fn withdraw_action(&self, key: &str) -> Result<(), StateError> {
        self.remove_action(key)
    }
    fn action_requests(&self) -> Result<Vec<ActionRequest>, StateError> {
        self.list_actions()
    }
}

impl LocalLog for StateStore {
    fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError> {
        StateStore::record_event(self, object_id, node, kind, detail)
    }
    fn events(&self, from: u64) -> Result<Vec<Event>, StateError> {
        StateStore::events(self, from)
    }
    fn record_decisions(&self, records: &mut [DecisionRecord]) -> Result<u64, StateError> {
        StateStore::record_decisions(self, records)
    }
    fn decisions(&self, from: u64, limit: usize) -> Result<Vec<DecisionRecord>, StateError> {
        StateStore::decisions(self, from, limit)
    }
    fn decision_log_usage(&self) -> Result<LogUsage, StateError> {
        StateStore::decision_log_usage(self)
    }
    fn prune_decisions(&self, retention: &Retention, now_ms: u64) -> Result<u64, StateError> {
        StateStore::prune_decisions(self, retention, now_ms)
    }
    fn checkpoint_due(&self) -> Result<Vec<Checkpoint>, StateError> {
        self.checkpoint(false)
    }
    fn storage_health(&self) -> StorageHealth {
        StateStore::storage_health(self)
    }
    fn checkpoint_interval(&self) -> Option<Duration> {
        Some(self.checkpoint_policy().every)
    }
}

/// An [`AdmittedFacts`] as the embedded store keeps it (table `admitted`): the facts, and
/// the lifetime the caller that remembered them gave them ([`AdmittedLimits::seconds`]),
/// so that a purge made by another caller, which keeps its own facts for another time,
/// judges each entry by its own. The lifetime sits beside the facts' fields in one JSON
/// object: a record written before lifetimes were kept has none and still parses (it is
/// judged by the purging caller's time, as it was), and a reader of plain
/// [`AdmittedFacts`] ignores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredAdmitted {
    #[serde(flatten)]
    pub(super) facts: AdmittedFacts,
    /// Seconds it is kept; absent from records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) keep_seconds: Option<u64>,
}

impl StoredAdmitted {
    /// Its lifetime: its own, or `default_seconds` when it has none recorded.
    fn lifetime(&self, default_seconds: u64) -> u64 {
        self.keep_seconds.unwrap_or(default_seconds)
    }

    /// When it expires, in Unix milliseconds, by its own lifetime (else
    /// `default_seconds`).
    pub(super) fn deadline_ms(&self, default_seconds: u64) -> u64 {
        self.facts
            .admitted_at_ms
            .saturating_add(self.lifetime(default_seconds).saturating_mul(1000))
    }

    /// [`AdmittedFacts::expired`] by its own lifetime when it has one, else by
    /// `default_seconds`.
    pub(super) fn expired(&self, now_ms: u64, default_seconds: u64) -> bool {
        self.facts.expired(now_ms, self.lifetime(default_seconds))
    }
}
