use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use probity::BlockRecord;
use probity::state::{
    ActionRequest, BlockedNode, ChangeBatch, NodeFacts, RegistryEntry, ServedDigest, SharedHealth,
    SharedState, StateError,
};

use super::housekeeping::put_digest;
use super::records::{
    self, BLOCKLIST, CLUSTER, DIGESTS, FACTS, KEYS, REGISTRY, RegistryRecord, TOMBSTONES,
};
use super::{BLOCK_ROUNDS, EtcdState, FactsLease, Queued, follow, lock, run_on};
use crate::{EtcdError, Swap, VersionedError};

impl SharedState for EtcdState {
    fn describe(&self) -> String {
        format!(
            "{} (logs: {})",
            self.core.describe,
            self.core.local.describe()
        )
    }

    fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError> {
        let key = format!("{REGISTRY}{object_id}");
        let client = self.core.client.clone();
        let k = key.clone();
        let (entry, _) = self.run("reading the registry", async move { client.get(&k).await })?;
        match entry {
            None => Ok(None),
            Some(e) => records::decode_registry(&e.value)
                .map(Some)
                .map_err(|err| self.corrupt("reading the registry", &key, err)),
        }
    }

    /// From the registry mirror when the registry is watched (a sidecar): a refusal is
    /// certain (versions only go up), and an admission is confirmed by the
    /// compare-and-swap of [`SharedState::accept`]. Otherwise a linearizable read.
    fn check_version(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError> {
        let mirrored = {
            let guard = self
                .core
                .registry
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            guard.as_ref().map(|m| m.get(object_id).copied())
        };
        let entry = match mirrored {
            Some(head) => head.map(|(v, d)| RegistryEntry {
                version: v,
                digest: d,
                signed_manifest: Vec::new(),
            }),
            None => self.registry_entry(object_id)?,
        };
        match entry {
            Some(e) => e.admits(object_id, version, digest),
            None => Ok(()),
        }
    }

    fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError> {
        let record = RegistryRecord::new(version, digest, signed_manifest);
        let client = self.core.client.clone();
        let key = format!("{REGISTRY}{object_id}");
        let outcome = run_on(&self.core.handle, async move {
            client.put_versioned(&key, &record).await
        });
        match outcome {
            Some(Ok(_)) => {
                self.core
                    .mirror_accepted(object_id.to_owned(), (version, *digest));
                Ok(())
            }
            Some(Err(VersionedError::Rollback {
                offered, accepted, ..
            })) => Err(StateError::Rollback {
                object_id: object_id.to_owned(),
                offered,
                accepted,
            }),
            Some(Err(VersionedError::Conflict { version, .. })) => {
                Err(StateError::DigestConflict {
                    object_id: object_id.to_owned(),
                    version,
                })
            }
            Some(Err(e)) => Err(self.core.err("accepting a manifest", e)),
            None => Err(self.core.err(
                "accepting a manifest",
                std::io::Error::other("the state backend's runtime stopped"),
            )),
        }
    }

    /// etcd numbers the block with its key's create revision, which the watch (and
    /// [`SharedState::blocked_nodes`]) report; nothing to return here.
    fn put_block(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError> {
        self.put_block_at(node, record).map(|_| None)
    }

    fn unblock_node(&self, node: &str) -> Result<bool, StateError> {
        self.unblock_node_at(node).map(|(existed, _)| existed)
    }

    /// A compare-and-swap on the node's key, so two processes blocking the same node at
    /// once both land in its history.
    fn block_node(&self, node: &str, reason: &str, now: u64) -> Result<(), StateError> {
        let key = format!("{BLOCKLIST}{node}");
        let client = self.core.client.clone();
        let reason = reason.to_owned();
        let k = key.clone();
        let outcome: Result<bool, StateError> = self.run("blocking a node", async move {
            let (mut current, _) = client.get(&k).await?;
            for _ in 0..BLOCK_ROUNDS {
                let record = match &current {
                    Some(e) => records::decode_block(&e.value)
                        .map(|r| r.blocked_again(reason.clone(), now))
                        .unwrap_or_else(|_| BlockRecord::new(reason.clone(), now)),
                    None => BlockRecord::new(reason.clone(), now),
                };
                let bytes = serde_json::to_vec(&record).unwrap_or_default();
                let swap = match &current {
                    None => client.create(&k, bytes).await?,
                    Some(e) => client.update_if(&k, bytes, e.mod_revision).await?,
                };
                match swap {
                    Swap::Applied { .. } => return Ok(true),
                    Swap::Refused { current: now_there } => current = now_there,
                }
            }
            Ok(false)
        });
        match outcome {
            Ok(true) => Ok(()),
            Ok(false) => Err(StateError::Conflict {
                what: "block record",
                key,
                expected: None,
                found: None,
            }),
            Err(e) => Err(e),
        }
    }

    fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError> {
        let client = self.core.client.clone();
        let listing = self.run("reading the blocklist", async move {
            client.list(BLOCKLIST).await
        })?;
        Ok(listing
            .entries
            .iter()
            .filter_map(follow::blocked_node)
            .collect())
    }

    /// One key per entity (`cluster/<id>`): what changed is put (in batched
    /// transactions), what is gone deleted; an unchanged set writes nothing.
    fn publish_cluster_facts(&self, entities: &[serde_json::Value]) -> Result<(), StateError> {
        let mut wanted: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for entity in entities {
            let Some(id) = entity
                .pointer("/uid/id")
                .and_then(serde_json::Value::as_str)
            else {
                continue;
            };
            wanted.insert(
                format!("{CLUSTER}{id}"),
                self.encode("encoding the cluster's facts", entity)?,
            );
        }
        let client = self.core.client.clone();
        self.run("sharing the cluster's facts", async move {
            let listing = client.list(CLUSTER).await?;
            let stored: BTreeMap<&str, &[u8]> = listing
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_slice()))
                .collect();
            let changed: Vec<(&String, &Vec<u8>)> = wanted
                .iter()
                .filter(|(k, v)| stored.get(k.as_str()) != Some(&v.as_slice()))
                .collect();
            if !changed.is_empty() {
                client.put_batch(&changed, None).await?;
            }
            for key in stored.keys().filter(|k| !wanted.contains_key(**k)) {
                client.delete(key).await?;
            }
            Ok(())
        })
    }

    fn block_tombstones(&self) -> Result<BTreeMap<String, u64>, StateError> {
        let client = self.core.client.clone();
        let listing = self.run("reading the blocklist's tombstones", async move {
            client.list(TOMBSTONES).await
        })?;
        Ok(listing
            .entries
            .iter()
            .filter_map(|e| {
                let node = e.key.strip_prefix(TOMBSTONES).filter(|n| !n.is_empty())?;
                Some((node.to_owned(), u64::try_from(e.mod_revision).ok()?))
            })
            .collect())
    }

    fn remember_admitted(
        &self,
        facts: &probity::state::AdmittedFacts,
        limits: &probity::state::AdmittedLimits,
    ) -> Result<(), StateError> {
        self.remember_admitted_shared(facts, limits)
    }

    fn admitted(
        &self,
        namespace: &str,
        name: &str,
        max_age_seconds: u64,
    ) -> Result<Option<probity::state::AdmittedFacts>, StateError> {
        self.admitted_shared(namespace, name, max_age_seconds)
    }

    fn forget_admitted(&self, namespace: &str, name: &str) -> Result<(), StateError> {
        self.forget_admitted_shared(namespace, name)
    }

    fn key_record(&self, id: &str) -> Result<Option<(Vec<u8>, u64)>, StateError> {
        let client = self.core.client.clone();
        let key = format!("{KEYS}{id}");
        let (entry, _) = self.run(
            "reading key metadata",
            async move { client.get(&key).await },
        )?;
        Ok(entry.map(|e| (e.value, u64::try_from(e.mod_revision).unwrap_or(0))))
    }

    fn put_key_record(
        &self,
        id: &str,
        record: &[u8],
        expected: Option<u64>,
    ) -> Result<u64, StateError> {
        let client = self.core.client.clone();
        let key = format!("{KEYS}{id}");
        let value = record.to_vec();
        let swap = self.run("writing key metadata", async move {
            match expected {
                None => client.create(&key, value).await,
                Some(rev) => {
                    client
                        .update_if(&key, value, i64::try_from(rev).unwrap_or(i64::MAX))
                        .await
                }
            }
        })?;
        match swap {
            Swap::Applied { revision } => Ok(u64::try_from(revision).unwrap_or(0)),
            Swap::Refused { current } => Err(StateError::Conflict {
                what: "key",
                key: id.to_owned(),
                expected,
                found: current.map(|e| u64::try_from(e.mod_revision).unwrap_or(0)),
            }),
        }
    }

    fn delete_key_record(&self, id: &str, expected: u64) -> Result<(), StateError> {
        let client = self.core.client.clone();
        let key = format!("{KEYS}{id}");
        let swap = self.run("deleting key metadata", async move {
            client
                .delete_if(&key, i64::try_from(expected).unwrap_or(i64::MAX))
                .await
        })?;
        match swap {
            Swap::Applied { .. } => Ok(()),
            Swap::Refused { current } => Err(StateError::Conflict {
                what: "key",
                key: id.to_owned(),
                expected: Some(expected),
                found: current.map(|e| u64::try_from(e.mod_revision).unwrap_or(0)),
            }),
        }
    }

    fn key_ids(&self) -> Result<Vec<String>, StateError> {
        let client = self.core.client.clone();
        let listing = self.run(
            "listing key metadata",
            async move { client.list(KEYS).await },
        )?;
        Ok(listing
            .entries
            .into_iter()
            .filter_map(|e| e.key.strip_prefix(KEYS).map(str::to_owned))
            .collect())
    }

    /// Puts `facts/<node>` under the node's lease (granted on the first publish, or when
    /// the TTL changes or the lease is gone), which stays alive while the facts keep
    /// coming; see the module docs.
    fn publish_facts(&self, facts: &NodeFacts) -> Result<(), StateError> {
        let ttl = Duration::from_secs(facts.ttl_seconds.max(1));
        let bytes = self.encode("encoding node facts", facts)?;
        let key = format!("{FACTS}{}", facts.node);
        let reuse = lock(&self.core.facts)
            .get(&facts.node)
            .filter(|f| f.lease.ttl == ttl)
            .map(|f| f.lease.id);
        let client = self.core.client.clone();
        let granted = self.run("publishing node facts", async move {
            if let Some(id) = reuse {
                match client.put_with_lease(&key, bytes.clone(), id).await {
                    Ok(_) => return Ok(None),
                    Err(EtcdError::LeaseNotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            let lease = client.grant_lease(ttl).await?;
            if let Err(e) = client.put_with_lease(&key, bytes, lease.id).await {
                let _ = client.revoke_lease(lease.id).await;
                return Err(e);
            }
            Ok(Some((lease, client.keep_alive(lease))))
        })?;
        let mut leases = lock(&self.core.facts);
        match granted {
            Some((lease, keep)) => {
                let replaced = leases.insert(
                    facts.node.clone(),
                    FactsLease {
                        lease,
                        _keep: keep,
                        last_publish: Instant::now(),
                    },
                );
                if let Some(old) = replaced.filter(|o| o.lease.id != lease.id) {
                    let client = self.core.client.clone();
                    self.core.handle.spawn(async move {
                        let _ = client.revoke_lease(old.lease.id).await;
                    });
                }
            }
            None => {
                if let Some(f) = leases.get_mut(&facts.node) {
                    f.last_publish = Instant::now();
                }
            }
        }
        Ok(())
    }

    fn node_facts(&self) -> Result<Vec<NodeFacts>, StateError> {
        let client = self.core.client.clone();
        let listing = self.run(
            "reading node facts",
            async move { client.list(FACTS).await },
        )?;
        listing
            .entries
            .iter()
            .map(|e| {
                let node = e.key.strip_prefix(FACTS).unwrap_or(&e.key);
                records::decode_facts(node, &e.value)
                    .map_err(|err| self.corrupt("reading node facts", &e.key, err))
            })
            .collect()
    }

    fn report_digest(&self, served: &ServedDigest) -> Result<(), StateError> {
        let bytes = self.encode("encoding a served digest", served)?;
        let reuse = {
            let mut digest = lock(&self.core.digest);
            digest.last = Some(served.clone());
            digest
                .lease
                .as_ref()
                .filter(|(_, keep)| !keep.state().expired)
                .map(|(l, _)| l.id)
        };
        let core = Arc::clone(&self.core);
        let process = served.process.clone();
        let granted = self.run("reporting a served digest", async move {
            if let Some(id) = reuse {
                let key = format!("{DIGESTS}{process}");
                match core.client.put_with_lease(&key, bytes.clone(), id).await {
                    Ok(_) => return Ok(None),
                    Err(EtcdError::LeaseNotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            put_digest(&core, &process, bytes).await.map(Some)
        })?;
        if let Some(lease) = granted {
            lock(&self.core.digest).lease = Some(lease);
        }
        Ok(())
    }

    fn served_digests(&self) -> Result<Vec<ServedDigest>, StateError> {
        let client = self.core.client.clone();
        let listing = self.run("reading served digests", async move {
            client.list(DIGESTS).await
        })?;
        listing
            .entries
            .iter()
            .map(|e| {
                records::decode_digest(&e.value)
                    .map_err(|err| self.corrupt("reading served digests", &e.key, err))
            })
            .collect()
    }

    fn is_shared(&self) -> bool {
        true
    }

    /// Merged into the record etcd holds (compare-and-swap): a record computed from this
    /// process's view, which may lag, never overwrites another process's block.
    fn put_block_at(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError> {
        let client = self.core.client.clone();
        let key = format!("{BLOCKLIST}{node}");
        let record = record.clone();
        let k = key.clone();
        let revision = self.run("blocking a node", async move {
            merge_block(&client, &k, &record).await
        })?;
        match revision {
            Some(revision) => Ok(Some(u64::try_from(revision).unwrap_or(0))),
            None => Err(StateError::Conflict {
                what: "block record",
                key,
                expected: None,
                found: None,
            }),
        }
    }

    /// Also drops the node from the outbox: an operator's unblock cancels a block that
    /// never reached etcd.
    fn unblock_node_at(&self, node: &str) -> Result<(bool, Option<u64>), StateError> {
        let queued = lock(&self.core.outbox).remove(node).is_some();
        if queued {
            self.core.local.unblock_node(node)?;
        }
        let client = self.core.client.clone();
        let key = format!("{BLOCKLIST}{node}");
        let tombstone = format!("{TOMBSTONES}{node}");
        let name = node.to_owned();
        let deleted = self.run("unblocking a node", async move {
            client.delete_leaving(&key, &tombstone, name).await
        })?;
        Ok((
            deleted.existed,
            Some(u64::try_from(deleted.revision).unwrap_or(0)),
        ))
    }

    fn await_applied(&self, revision: u64) -> Result<(), StateError> {
        let bound = self.core.options.read_your_writes;
        let target = i64::try_from(revision).unwrap_or(i64::MAX);
        let deadline = Instant::now() + bound;
        let mut applied = lock(&self.core.applied);
        while *applied < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StateError::NotYetApplied {
                    revision,
                    waited: bound,
                });
            }
            applied = self
                .core
                .applied_changed
                .wait_timeout(applied, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    fn queue_block(&self, node: &str, record: &BlockRecord) -> Result<(), StateError> {
        lock(&self.core.outbox).insert(
            node.to_owned(),
            Queued {
                record: record.clone(),
                landed: None,
            },
        );
        // Durable after being in force: a full disk must not delay the block.
        let kept = self.core.local.put_block(node, record);
        self.core.outbox_wake.notify_one();
        kept.map(|_| ())
    }

    fn unshared_blocks(&self) -> Vec<BlockedNode> {
        lock(&self.core.outbox)
            .iter()
            .map(|(node, q)| BlockedNode {
                node: node.clone(),
                record: q.record.clone(),
            })
            .collect()
    }

    fn shared_health(&self) -> Option<SharedHealth> {
        let client = self.core.client.health();
        let watches = self.watch_status();
        let (connected, since_last_heard, resyncs, watch_error) = if watches.is_empty() {
            (client.connected, client.since_last_heard, 0, None)
        } else {
            let stalest = watches
                .iter()
                .map(|(_, s)| s.since_last_heard)
                .try_fold(Duration::ZERO, |acc, s| s.map(|s| acc.max(s)));
            (
                watches.iter().all(|(_, s)| s.connected),
                stalest,
                watches.iter().map(|(_, s)| s.resyncs).sum(),
                watches
                    .iter()
                    .find(|(_, s)| !s.connected)
                    .and_then(|(p, s)| s.last_error.as_ref().map(|e| format!("watch {p}: {e}"))),
            )
        };
        Some(SharedHealth {
            backend: self.core.describe.clone(),
            connected,
            since_last_heard,
            applied_revision: u64::try_from(*lock(&self.core.applied)).unwrap_or(0),
            resyncs,
            unshared_blocks: lock(&self.core.outbox)
                .values()
                .filter(|q| q.landed.is_none())
                .count(),
            last_error: watch_error.or(client.last_error),
        })
    }

    fn changes(&self) -> Option<std::sync::mpsc::Receiver<ChangeBatch>> {
        if self.started.swap(true, Ordering::SeqCst) {
            return None;
        }
        self.core.following.store(true, Ordering::Relaxed);
        match self.start_watches() {
            Ok(rx) => Some(rx),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the etcd watches: this process will not see shared changes");
                None
            }
        }
    }

    fn publish_action(&self, request: &ActionRequest) -> Result<(), StateError> {
        self.publish_action_shared(request)
    }

    fn withdraw_action(&self, key: &str) -> Result<(), StateError> {
        self.withdraw_action_shared(key)
    }

    fn action_requests(&self) -> Result<Vec<ActionRequest>, StateError> {
        self.action_requests_shared()
    }
}

/// Writes `record` at `key`, merged into the record already there
/// ([`BlockRecord::merged_into`]), by compare-and-swap on what was read; the revision of
/// the write, or `None` after [`BLOCK_ROUNDS`] lost races. A record there that does not
/// decode is replaced (the key's presence blocked the node all along).
pub(super) async fn merge_block(
    client: &crate::EtcdClient,
    key: &str,
    record: &BlockRecord,
) -> Result<Option<i64>, EtcdError> {
    let (mut current, _) = client.get(key).await?;
    for _ in 0..BLOCK_ROUNDS {
        let merged = match current
            .as_ref()
            .and_then(|e| records::decode_block(&e.value).ok())
        {
            Some(stored) => record.clone().merged_into(stored),
            None => record.clone(),
        };
        // A block record is plain strings and numbers: it always encodes.
        let bytes = serde_json::to_vec(&merged).unwrap_or_default();
        let swap = match &current {
            None => client.create(key, bytes).await?,
            Some(e) => client.update_if(key, bytes, e.mod_revision).await?,
        };
        match swap {
            Swap::Applied { revision } => {
                // A new block is numbered above the node's tombstone, which then has
                // nothing left to tell apart: dropped, so tombstones stay one per node
                // unblocked and not blocked since (a failure leaves one key behind).
                if current.is_none()
                    && let Some(node) = key.strip_prefix(BLOCKLIST)
                {
                    let _ = client.delete(&format!("{TOMBSTONES}{node}")).await;
                }
                return Ok(Some(revision));
            }
            Swap::Refused { current: now_there } => current = now_there,
        }
    }
    Ok(None)
}
