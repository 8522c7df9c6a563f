//! The [`SharedState`] trait: everything durable goes through it.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::audit::Checkpoint;
use crate::block::BlockRecord;

/// What the cluster shares (the manifest registry, blocks, key records, node facts,
/// served digests, admitted objects' facts), so that one machine (the embedded
/// [`StateStore`]) and a cluster (etcd, `probity_etcd::EtcdState`) are interchangeable.
/// A write returns once it is durable; a refusal (a rollback, a lost compare-and-swap)
/// is an error and changes nothing. The decision and event logs are not here: they
/// always stay on the machine that wrote them ([`LocalLog`]).
pub trait SharedState: Send + Sync + std::fmt::Debug {
    /// What it is and where, for status lines (`redb /var/lib/probity/state.redb`).
    fn describe(&self) -> String;

    /// The registry entry of `object_id`, if any version was accepted.
    fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError>;

    /// Checks, without changing anything, that `version` with `digest` may be accepted.
    fn check_version(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError> {
        match self.registry_entry(object_id)? {
            Some(entry) => check_against(object_id, version, digest, &entry),
            None => Ok(()),
        }
    }

    /// Records `version` as accepted for `object_id`, atomically refusing a rollback or
    /// a different digest for the accepted version; accepting it again is a no-op.
    fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError>;

    /// Stores `node`'s block record as it is (the engine computes it), except for its
    /// revision, which the store gives ([`BlockRecord::revision`]). Returns that
    /// revision when the store numbers the block in this write (the local store), `None`
    /// when it numbers it otherwise (etcd: the key's create revision, which its watch
    /// delivers).
    fn put_block(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError>;

    /// Unblocks `node`; whether it was blocked.
    fn unblock_node(&self, node: &str) -> Result<bool, StateError>;

    /// Blocks `node` with `reason` at `now` (Unix seconds, from the caller's clock): a
    /// node already blocked keeps its first reason and time, and this block joins its
    /// history. For programs that run no engine; an engine computes the record itself
    /// and calls [`SharedState::put_block`].
    fn block_node(&self, node: &str, reason: &str, now: u64) -> Result<(), StateError> {
        let record = match self.blocked_nodes()?.into_iter().find(|b| b.node == node) {
            Some(b) => b.record.blocked_again(reason, now),
            None => BlockRecord::new(reason, now),
        };
        self.put_block(node, &record).map(|_| ())
    }

    /// Every blocked node.
    fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError>;

    /// Shares the cluster's facts (Cedar entity JSON, each with its `uid`, as
    /// [`crate::Engine::replace_cluster_facts`] took them) with every process that
    /// follows this store, as a full replace: an entity absent from `entities` is
    /// withdrawn. A store no other process reads keeps nothing: the engine that took
    /// them holds them.
    fn publish_cluster_facts(&self, entities: &[serde_json::Value]) -> Result<(), StateError> {
        let _ = entities;
        Ok(())
    }

    /// Per node, the revision of its last unblock, numbered like
    /// [`BlockRecord::revision`]: a block record whose revision is not above its
    /// node's tombstone is one that unblock lifted (a lagging replica's, a replayed
    /// event's), and a cluster manager must not act on it. Empty for a store that
    /// numbers nothing.
    fn block_tombstones(&self) -> Result<std::collections::BTreeMap<String, u64>, StateError> {
        Ok(std::collections::BTreeMap::new())
    }

    /// A key's metadata record and its revision.
    fn key_record(&self, id: &str) -> Result<Option<(Vec<u8>, u64)>, StateError>;

    /// Writes a key's metadata if its revision is still `expected` (`None`: it must not
    /// exist yet); the new revision. A lost race is [`StateError::Conflict`].
    fn put_key_record(
        &self,
        id: &str,
        record: &[u8],
        expected: Option<u64>,
    ) -> Result<u64, StateError>;

    /// Deletes a key's metadata if its revision is still `expected`.
    fn delete_key_record(&self, id: &str, expected: u64) -> Result<(), StateError>;

    /// Every key id with metadata.
    fn key_ids(&self) -> Result<Vec<String>, StateError>;

    /// Remembers the facts of an admitted object (a pod, at admission) until it is
    /// forgotten or `limits.seconds` pass; at most `limits.max` are kept (the expired
    /// go first, then those nearest their end). Each entry keeps the lifetime it was
    /// remembered with: callers keep facts for different times (a pod's for a day, a
    /// Slurm job's for weeks), and one caller's write never purges another's facts
    /// before their own time. Default: a backend that remembers nothing.
    fn remember_admitted(
        &self,
        facts: &AdmittedFacts,
        limits: &AdmittedLimits,
    ) -> Result<(), StateError> {
        let _ = (facts, limits);
        Ok(())
    }

    /// The facts remembered for `namespace/name`, unless expired (`max_age_seconds`).
    fn admitted(
        &self,
        namespace: &str,
        name: &str,
        max_age_seconds: u64,
    ) -> Result<Option<AdmittedFacts>, StateError> {
        let _ = (namespace, name, max_age_seconds);
        Ok(None)
    }

    /// Forgets the facts of `namespace/name` (its binding was decided).
    fn forget_admitted(&self, namespace: &str, name: &str) -> Result<(), StateError> {
        let _ = (namespace, name);
        Ok(())
    }

    /// Publishes a node agent's facts (replacing the node's earlier ones).
    fn publish_facts(&self, facts: &NodeFacts) -> Result<(), StateError>;

    /// Every node's published facts (stale ones included: the reader judges).
    fn node_facts(&self) -> Result<Vec<NodeFacts>, StateError>;

    /// Says which policy set this process serves.
    fn report_digest(&self, served: &ServedDigest) -> Result<(), StateError>;

    /// What every process said it serves.
    fn served_digests(&self) -> Result<Vec<ServedDigest>, StateError>;

    /// Whether other processes write this backend too. An engine then applies every
    /// blocklist change, its own included, from [`SharedState::changes`] (see the
    /// module docs); otherwise it writes its memory itself.
    fn is_shared(&self) -> bool {
        false
    }

    /// [`SharedState::put_block`], returning the backend's revision of the write when
    /// it is shared (`None` otherwise), for [`SharedState::await_applied`].
    fn put_block_at(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError> {
        self.put_block(node, record).map(|_| None)
    }

    /// [`SharedState::unblock_node`], also returning the backend's revision of the
    /// write when it is shared.
    fn unblock_node_at(&self, node: &str) -> Result<(bool, Option<u64>), StateError> {
        self.unblock_node(node).map(|was| (was, None))
    }

    /// Waits, within the backend's read-your-writes bound, until the follower of
    /// [`SharedState::changes`] has applied the blocklist up to `revision`;
    /// [`StateError::NotYetApplied`] when the bound passes first.
    fn await_applied(&self, revision: u64) -> Result<(), StateError> {
        let _ = revision;
        Ok(())
    }

    /// Makes a block that is already in force in this process durable as soon as the
    /// backend can take it: queued (durably, where the backend can) and retried in the
    /// background until it lands. For a block that must not wait for the network: a
    /// node that failed verification is blocked here at once. A backend that is not
    /// shared writes it at once.
    fn queue_block(&self, node: &str, record: &BlockRecord) -> Result<(), StateError> {
        self.put_block(node, record).map(|_| ())
    }

    /// Blocks queued by [`SharedState::queue_block`] that have not landed yet. An
    /// engine keeps them in force whatever the shared blocklist says until they land.
    fn unshared_blocks(&self) -> Vec<BlockedNode> {
        Vec::new()
    }

    /// How current a shared backend's view is; `None` for one only this process writes.
    fn shared_health(&self) -> Option<SharedHealth> {
        None
    }

    /// Changes to shared state, in order, for a backend shared between processes;
    /// `None` for a backend only this process writes. A backend feeds one follower:
    /// the first call starts the watches, later calls return `None`.
    fn changes(&self) -> Option<std::sync::mpsc::Receiver<ChangeBatch>> {
        None
    }

    /// Publishes an agent's request that the cluster manager carry out an obligation
    /// (replacing the same agent's earlier one, [`ActionRequest::key`]); it expires with
    /// the agent (see [`crate::state::ActionRequest`]). Default: a backend that keeps
    /// none, so no action is ever asked through it.
    fn publish_action(&self, request: &ActionRequest) -> Result<(), StateError> {
        let _ = request;
        Ok(())
    }

    /// Withdraws the request [`ActionRequest::key_of`] names (its finding cleared);
    /// withdrawing one not there is a no-op.
    fn withdraw_action(&self, key: &str) -> Result<(), StateError> {
        let _ = key;
        Ok(())
    }

    /// Every published request, expired ones included (the reader judges, with
    /// [`ActionRequest::is_live`]).
    fn action_requests(&self) -> Result<Vec<ActionRequest>, StateError> {
        Ok(Vec::new())
    }
}

/// What always stays on the machine that wrote it: the decision and event logs,
/// hash-chained and checkpointed ([`crate::audit`]), and forwarded to the SIEM from
/// there. The embedded [`StateStore`] keeps them, whichever [`SharedState`] the
/// cluster uses.
pub trait LocalLog: Send + Sync + std::fmt::Debug {
    /// Appends an event to the event log; its sequence number.
    fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError>;

    /// Events with sequence number `from` or later, in order.
    fn events(&self, from: u64) -> Result<Vec<Event>, StateError>;

    /// Appends decision records in one durable transaction; the first's sequence number.
    fn record_decisions(&self, records: &mut [DecisionRecord]) -> Result<u64, StateError>;

    /// Up to `limit` decision records from sequence number `from`, in order.
    fn decisions(&self, from: u64, limit: usize) -> Result<Vec<DecisionRecord>, StateError>;

    /// How much the decision log holds.
    fn decision_log_usage(&self) -> Result<LogUsage, StateError>;

    /// Prunes the decision log up to checkpoints (see [`StateStore::prune_decisions`]).
    fn prune_decisions(&self, retention: &Retention, now_ms: u64) -> Result<u64, StateError>;

    /// Makes the checkpoints that are due by time (see [`crate::audit`]): the decision
    /// log's writer calls it every [`LocalLog::checkpoint_interval`] while no record
    /// arrives (appends make the others). Default: the backend keeps no checkpoints.
    fn checkpoint_due(&self) -> Result<Vec<Checkpoint>, StateError> {
        Ok(Vec::new())
    }

    /// Whether the local store writes (see [`StateStore::storage_health`]); while it
    /// fails, asking tries to recover. Default: a backend that cannot fail this way.
    fn storage_health(&self) -> StorageHealth {
        StorageHealth::default()
    }

    /// How often [`LocalLog::checkpoint_due`] is worth calling; `None`: never.
    fn checkpoint_interval(&self) -> Option<Duration> {
        None
    }
}

/// The state an engine is attached to ([`crate::Engine::attach_state`]): what the
/// cluster shares, and this machine's logs. On one machine both are the same
/// [`StateStore`] (`From<Arc<StateStore>>`).
#[derive(Debug, Clone)]
pub struct AttachedState {
    /// The registry, blocks, key records and facts.
    pub shared: Arc<dyn SharedState>,
    /// The decision and event logs.
    pub log: Arc<dyn LocalLog>,
}

impl AttachedState {
    /// `shared` for what the cluster shares, `log` for this machine's logs.
    pub fn new(shared: Arc<dyn SharedState>, log: Arc<dyn LocalLog>) -> Self {
        Self { shared, log }
    }
}

impl From<Arc<StateStore>> for AttachedState {
    fn from(store: Arc<StateStore>) -> Self {
        Self {
            shared: Arc::clone(&store) as Arc<dyn SharedState>,
            log: store,
        }
    }
}

/// The embedded store is the whole registry: versions, blocks and events in one file.
impl<T: SharedState + LocalLog + ?Sized> crate::integrity::Registry for T {
    fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError> {
        SharedState::registry_entry(self, object_id)
    }
    fn check_version(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError> {
        SharedState::check_version(self, object_id, version, digest)
    }
    fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError> {
        SharedState::accept(self, object_id, version, digest, signed_manifest)
    }
    fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError> {
        LocalLog::record_event(self, object_id, node, kind, detail)
    }
    fn block_node(&self, node: &str, reason: &str, now: u64) -> Result<(), StateError> {
        SharedState::block_node(self, node, reason, now)
    }
}

/// An engine's state: the registry and blocks shared, the events on this machine.
impl crate::integrity::Registry for AttachedState {
    fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError> {
        self.shared.registry_entry(object_id)
    }
    fn check_version(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError> {
        self.shared.check_version(object_id, version, digest)
    }
    fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError> {
        self.shared
            .accept(object_id, version, digest, signed_manifest)
    }
    fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError> {
        self.log.record_event(object_id, node, kind, detail)
    }
    fn block_node(&self, node: &str, reason: &str, now: u64) -> Result<(), StateError> {
        self.shared.block_node(node, reason, now)
    }
}
