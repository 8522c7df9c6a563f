//! Durable state: the [`StateBackend`] trait that everything durable goes through
//! (manifest registry, blocklist, event and decision logs, key metadata, node facts,
//! served policy digests), and [`StateStore`], its embedded implementation on redb
//! under a state directory (one machine). The cluster-wide implementation on etcd
//! (`probity_etcd::EtcdState`) lives with the hooks, which know the network: the engine
//! sees it through this trait only.
//!
//! A shared backend ([`StateBackend::is_shared`]) is written by many processes. Its
//! changes reach every engine through [`StateBackend::changes`], in the backend's order,
//! and an engine's own writes reach its memory the same way (read-your-writes: it waits
//! until [`StateBackend::await_applied`] says the watch has applied them), so memory
//! never disagrees with the shared store and every process applies writes in one order.
//!
//! Invariants:
//! * the registry never goes back: a version lower than the accepted one is refused
//!   ([`StateError::Rollback`]), and so is a different digest for the accepted version
//!   ([`StateError::DigestConflict`]);
//! * every write is committed with immediate durability before the call returns;
//! * the event log is append-only: there is no API to change or delete an event;
//! * every record of the decision and event logs is hash-chained to its predecessor and
//!   the chains are checkpointed ([`crate::audit`]); the decision log is pruned only up
//!   to a checkpoint, so what is kept still verifies.
//!
//! The store is generic over what a node is (a string id) so servers can use the blocklist.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{
    Database, ReadableDatabase as _, ReadableTable as _, ReadableTableMetadata as _,
    TableDefinition,
};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::audit::{self, Checkpoint, CheckpointPolicy, GENESIS, Log};
use crate::block::BlockRecord;
use crate::decision::Decision;
use crate::trust::{self, Material, TrustError};

/// Object id -> registry record (version, digest, signed manifest).
const MANIFESTS: TableDefinition<&str, &[u8]> = TableDefinition::new("manifests");
/// Node id -> blocklist record (time, reason).
const BLOCKLIST: TableDefinition<&str, &[u8]> = TableDefinition::new("blocklist");
/// Sequence number -> event record.
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// Decision log: sequence number -> the record as JSON ([`DecisionRecord`]).
const DECISIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("decisions");
/// Key metadata: key id -> revision (8 bytes, big endian) then the record's bytes.
const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
/// Node facts: node id -> [`NodeFacts`] as JSON.
const FACTS: TableDefinition<&str, &[u8]> = TableDefinition::new("facts");
/// Served policy digests: process name -> [`ServedDigest`] as JSON.
const DIGESTS: TableDefinition<&str, &[u8]> = TableDefinition::new("digests");
/// Counters that must survive pruning: the decision log's next sequence number, its
/// bytes, where pruning stopped.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Each log's chain: log name -> [`ChainState`] (its head, last record, records not yet
/// checkpointed, time of the last checkpoint).
const CHAIN: TableDefinition<&str, &[u8]> = TableDefinition::new("chain");
/// Checkpoints (signed tree heads): (log name, the last record covered) -> the rest of
/// the [`Checkpoint`].
const CHECKPOINTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("checkpoints");
/// Facts of admitted objects (pods), by `namespace/name`: JSON [`AdmittedFacts`].
const ADMITTED: TableDefinition<&str, &[u8]> = TableDefinition::new("admitted");

/// How much of the decision log to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Prune oldest segments while the log holds more than this many bytes.
    pub max_bytes: u64,
    /// Prune segments whose newest record is older than this, in seconds.
    pub max_age_seconds: u64,
    /// Never prune a record at or after this sequence number (the first record not yet
    /// forwarded): retention never loses what has not left the machine.
    pub keep_from: u64,
}

/// What the decision log holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct LogUsage {
    /// Records held.
    pub records: u64,
    /// Bytes of records held (their encoded size).
    pub bytes: u64,
    /// The first sequence number held (everything before was pruned).
    pub first: u64,
    /// The next sequence number to be given.
    pub next: u64,
}

/// The source a node's `unreadable` attribute names once the facts its agent published
/// to a shared store expired ([`StateChange::FactsGone`]): the engine keeps the node and
/// marks its telemetry stale, so the policies fail closed on it.
pub const STALE_FACTS_SOURCE: &str = "agent";

/// File name of the database inside the state directory.
pub const STATE_FILE: &str = "state.redb";

/// Why the state store failed or refused a change.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StateError {
    /// The state directory could not be created.
    #[error("cannot create state directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The state directory or database could not be created tight, or others could
    /// change it: it is not trusted.
    #[error(transparent)]
    Untrusted(#[from] TrustError),
    /// The database failed.
    #[error("state database {path} failed while {operation}")]
    Database {
        /// Database file.
        path: PathBuf,
        /// What was being done.
        operation: &'static str,
        /// The database error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A record in the database is malformed.
    #[error("state database {path} holds a malformed {table} record for {key:?}")]
    Corrupt {
        /// Database file.
        path: PathBuf,
        /// Table name.
        table: &'static str,
        /// Record key.
        key: String,
    },
    /// A lower version than the accepted one.
    #[error(
        "refusing rollback of {object_id:?} to version {offered}: version {accepted} was already accepted"
    )]
    Rollback {
        /// Object id.
        object_id: String,
        /// Version offered.
        offered: u64,
        /// Highest version accepted.
        accepted: u64,
    },
    /// A compare-and-swap lost: the record changed since it was read.
    #[error(
        "{what} {key:?} changed since it was read (expected revision {expected:?}, found {found:?})"
    )]
    Conflict {
        /// What kind of record.
        what: &'static str,
        /// Its key.
        key: String,
        /// The revision the writer expected (`None`: absent).
        expected: Option<u64>,
        /// The revision found (`None`: absent).
        found: Option<u64>,
    },
    /// The accepted version with a different manifest digest.
    #[error(
        "refusing a different manifest for {object_id:?} version {version}: another digest was accepted for it"
    )]
    DigestConflict {
        /// Object id.
        object_id: String,
        /// Version.
        version: u64,
    },
    /// A shared backend (etcd) failed or could not be reached.
    #[error("shared state ({backend}) failed while {operation}")]
    Shared {
        /// What and where (`etcd http://10.0.0.5:2379 /probity/`).
        backend: String,
        /// What was being done.
        operation: &'static str,
        /// The backend's error (which endpoint, which key, whether it may have applied).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A change is durable in the shared backend, but this process's engine has not
    /// applied it within the read-your-writes bound: its watch lags or is cut off.
    #[error(
        "the change is durable in the shared state (revision {revision}) but this process has not applied it within {waited:?}; it will once its watch catches up"
    )]
    NotYetApplied {
        /// The backend's revision of the change.
        revision: u64,
        /// How long this process waited.
        waited: std::time::Duration,
    },
}

/// The registry entry of an object: the latest accepted version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryEntry {
    /// The highest accepted version.
    pub version: u64,
    /// Its manifest digest.
    pub digest: [u8; 32],
    /// Its encoded signed manifest.
    pub signed_manifest: Vec<u8>,
}

impl RegistryEntry {
    /// Checks that `version` with `digest` may be accepted over this entry: refuses a
    /// lower version ([`StateError::Rollback`]) and another digest for this version
    /// ([`StateError::DigestConflict`]).
    pub fn admits(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError> {
        check_against(object_id, version, digest, self)
    }
}

/// A blocked node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedNode {
    /// Node id.
    pub node: String,
    /// Why and since when, with later blocks in its history.
    pub record: BlockRecord,
}

/// An integrity failure, as recorded in the event log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Sequence number (assigned on append, increasing from 0).
    pub seq: u64,
    /// When, in seconds since the Unix epoch.
    pub time_unix: u64,
    /// Object id concerned.
    pub object_id: String,
    /// Node concerned, if known.
    pub node: Option<String>,
    /// Short machine-readable kind, e.g. `chunk-mismatch`.
    pub kind: String,
    /// Human-readable detail (the error message).
    pub detail: String,
}

/// A recorded decision: one that denied or carried obligations, with what was asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// Sequence number in the log (assigned on append, increasing from 0; stored as
    /// the key, not in the record).
    #[serde(skip)]
    pub seq: u64,
    /// When it was decided, in milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// The principal, `Type::"id"`.
    pub principal: String,
    /// The action, `Action::"id"`.
    pub action: String,
    /// The resource, `Type::"id"`.
    pub resource: String,
    /// Digest of the policy set that decided.
    pub policy_digest: String,
    /// The decision itself: outcome, reasons, obligations, errors.
    pub decision: Decision,
    /// Who asked, as the host authenticated it (`uid:1000`, a certificate's subject,
    /// `addr:10.0.0.7`); absent when the host named no caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
}

impl DecisionRecord {
    /// The record as listed to operators (`probity audit`, `GET /v1/decisions`): its
    /// fields with the sequence number, which storage keeps as the key.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("seq".into(), self.seq.into());
        }
        v
    }
}

/// The facts a node agent published about its node: Cedar entity JSON (the node and
/// its GPUs), when, and how long they stay fresh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFacts {
    /// The node id.
    pub node: String,
    /// The entities, as a JSON array.
    pub entities: serde_json::Value,
    /// When they were collected, in Unix seconds.
    pub collected_at: u64,
    /// How long after `collected_at` they are stale, in seconds.
    pub ttl_seconds: u64,
}

/// The policy-set digest a process serves, so an operator sees which replicas lag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedDigest {
    /// The process (its host name and role, as it names itself).
    pub process: String,
    /// The digest of the set it serves.
    pub digest: String,
    /// When it said so, in Unix seconds.
    pub at: u64,
}

/// A change to shared state, which a backend shared between processes reports so that
/// every engine applies it to its own snapshot, in order (its own writes included).
#[derive(Debug, Clone, PartialEq)]
pub enum StateChange {
    /// A node was blocked (or its record changed).
    Blocked(BlockedNode),
    /// A node was unblocked.
    Unblocked(String),
    /// A node's published facts changed.
    Facts(NodeFacts),
    /// A node's facts expired (its agent stopped renewing them) or were removed: what the
    /// engine holds about it is no longer current.
    FactsGone(String),
    /// The backend lost track and read everything again: apply this whole blocklist.
    Resync(Vec<BlockedNode>),
}

/// Changes a shared backend delivers together, in its order. The follower applies them
/// and then calls [`ChangeBatch::acknowledge`], which is what
/// [`StateBackend::await_applied`] waits for.
pub struct ChangeBatch {
    /// The changes, in order.
    pub changes: Vec<StateChange>,
    ack: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for ChangeBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeBatch")
            .field("changes", &self.changes)
            .field("acknowledged_by", &self.ack.is_some())
            .finish()
    }
}

impl ChangeBatch {
    /// Changes nobody waits for.
    pub fn new(changes: Vec<StateChange>) -> Self {
        Self { changes, ack: None }
    }

    /// Changes whose application `ack` is told of (the backend marks their revision
    /// applied, releasing writers that wait to read their own writes).
    pub fn with_ack(changes: Vec<StateChange>, ack: impl FnOnce() + Send + 'static) -> Self {
        Self {
            changes,
            ack: Some(Box::new(ack)),
        }
    }

    /// Says the changes are applied (visible to decisions). Call once, after applying,
    /// whether or not applying succeeded: a change that could not be applied is logged
    /// by the follower and will not be applied by waiting longer.
    pub fn acknowledge(self) {
        if let Some(ack) = self.ack {
            ack();
        }
    }
}

/// How current a shared backend's view is, for readiness and metrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SharedHealth {
    /// What and where (`etcd http://... /probity/`).
    pub backend: String,
    /// Whether every watch is connected and the last request succeeded.
    pub connected: bool,
    /// Time since the stalest watch last heard from the backend (an event or a
    /// progress notification); `None` before the first. Decisions are at most about
    /// this stale with respect to changes other processes make.
    pub since_last_heard: Option<std::time::Duration>,
    /// The backend revision the engine has applied (of the blocklist).
    pub applied_revision: u64,
    /// Full reads after the first (after compactions and long disconnections).
    pub resyncs: u64,
    /// Blocks in force here that have not reached the shared store yet (a verification
    /// failure while it was unreachable); retried until they land.
    pub unshared_blocks: usize,
    /// The last failure, if any (kept after recovery).
    pub last_error: Option<String>,
}

/// The facts of an object an admission webhook admitted, remembered so that a later
/// request about it (a pod's binding, which names only the pod) is judged with them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmittedFacts {
    /// The object's namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid: a later request naming another uid (a pod deleted and made again under
    /// the same name) does not get these facts.
    pub uid: String,
    /// The attributes of the request-scoped entity it was judged as (a `Workload`).
    pub attrs: serde_json::Value,
    /// When it was admitted, in Unix milliseconds.
    pub admitted_at_ms: u64,
}

impl AdmittedFacts {
    /// The key it is kept under.
    pub fn key(namespace: &str, name: &str) -> String {
        format!("{namespace}/{name}")
    }

    /// Whether it is older than `max_age_seconds` at `now_ms`.
    pub fn expired(&self, now_ms: u64, max_age_seconds: u64) -> bool {
        now_ms.saturating_sub(self.admitted_at_ms) > max_age_seconds.saturating_mul(1000)
    }
}

/// How many admitted objects' facts a backend keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmittedLimits {
    /// Most entries kept; past it, expired ones are purged, then the oldest.
    pub max: usize,
    /// Seconds an entry is kept.
    pub seconds: u64,
}

/// Everything durable goes through this trait, so that one machine (the embedded
/// [`StateStore`]) and a cluster (etcd, `probity_etcd::EtcdState`) are interchangeable.
/// A write returns once it is durable; a refusal (a rollback, a lost compare-and-swap)
/// is an error and changes nothing. The decision and event logs stay with the
/// process that wrote them (they are forwarded to the SIEM), whatever the backend.
pub trait StateBackend: Send + Sync + std::fmt::Debug {
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

    /// Stores `node`'s block record as it is (the engine computes it).
    fn put_block(&self, node: &str, record: &BlockRecord) -> Result<(), StateError>;

    /// Unblocks `node`; whether it was blocked.
    fn unblock_node(&self, node: &str) -> Result<bool, StateError>;

    /// Blocks `node` with `reason`: a node already blocked keeps its first reason and
    /// time, and this block joins its history. For programs that run no engine; an
    /// engine computes the record itself and calls [`StateBackend::put_block`].
    fn block_node(&self, node: &str, reason: &str) -> Result<(), StateError> {
        let now = now_unix();
        let record = match self.blocked_nodes()?.into_iter().find(|b| b.node == node) {
            Some(b) => b.record.blocked_again(reason, now),
            None => BlockRecord::new(reason, now),
        };
        self.put_block(node, &record)
    }

    /// Every blocked node.
    fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError>;

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
    /// log's writer calls it every [`StateBackend::checkpoint_interval`] while no record
    /// arrives (appends make the others). Default: the backend keeps no checkpoints.
    fn checkpoint_due(&self) -> Result<Vec<Checkpoint>, StateError> {
        Ok(Vec::new())
    }

    /// Whether the local store writes (see [`StateStore::storage_health`]); while it
    /// fails, asking tries to recover. Default: a backend that cannot fail this way.
    fn storage_health(&self) -> StorageHealth {
        StorageHealth::default()
    }

    /// How often [`StateBackend::checkpoint_due`] is worth calling; `None`: never.
    fn checkpoint_interval(&self) -> Option<Duration> {
        None
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
    /// forgotten or `limits.seconds` pass; at most `limits.max` are kept (the oldest
    /// go first). Default: a backend that remembers nothing.
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
    /// blocklist change, its own included, from [`StateBackend::changes`] (see the
    /// module docs); otherwise it writes its memory itself.
    fn is_shared(&self) -> bool {
        false
    }

    /// [`StateBackend::put_block`], returning the backend's revision of the write when
    /// it is shared (`None` otherwise), for [`StateBackend::await_applied`].
    fn put_block_at(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError> {
        self.put_block(node, record).map(|()| None)
    }

    /// [`StateBackend::unblock_node`], also returning the backend's revision of the
    /// write when it is shared.
    fn unblock_node_at(&self, node: &str) -> Result<(bool, Option<u64>), StateError> {
        self.unblock_node(node).map(|was| (was, None))
    }

    /// Waits, within the backend's read-your-writes bound, until the follower of
    /// [`StateBackend::changes`] has applied the blocklist up to `revision`;
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
        self.put_block(node, record)
    }

    /// Blocks queued by [`StateBackend::queue_block`] that have not landed yet. An
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
}

/// The durable state store under a state directory.
///
/// An I/O error (a full disk, say) leaves redb refusing every later operation until the
/// database is closed and opened again, so the store does that itself: the failure is
/// kept ([`StateStore::storage_health`]), and the next operation at least
/// [`RECOVERY_INTERVAL`] later reopens the file, which redb brings back to its last
/// durable commit (the chains' heads included: a failed commit changed nothing). The
/// failure clears with the first write that commits.
#[derive(Debug)]
pub struct StateStore {
    /// `None` while a reopen failed; every operation then fails until one succeeds.
    db: RwLock<Option<Database>>,
    health: Mutex<Health>,
    path: PathBuf,
    created: bool,
    checkpoints: RwLock<CheckpointPolicy>,
    /// Why the last checkpoint could not be signed (cleared by the next that is).
    checkpoint_failure: Mutex<Option<String>>,
}

/// How often a failing store tries again: reopening its database, or (when it is open)
/// a probe write to learn whether the disk takes writes again.
pub const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// Why the state store cannot write, and since when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StorageFailure {
    /// The database file.
    pub path: PathBuf,
    /// What was being done when the store first failed.
    pub operation: &'static str,
    /// The latest error, with its causes (`No space left on device`, say).
    pub detail: String,
    /// When the store began failing, in milliseconds since the Unix epoch.
    pub since_unix_ms: u64,
}

/// The state store's health: whether it writes, and its failure and recovery counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StorageHealth {
    /// Why writes fail now; `None` while the last write committed.
    pub failure: Option<StorageFailure>,
    /// Operations that failed with an I/O error since the store was opened.
    pub failures_total: u64,
    /// Times the store went from failing back to writing.
    pub recoveries_total: u64,
}

#[derive(Debug, Default)]
struct Health {
    failure: Option<StorageFailure>,
    /// redb refuses every operation after an I/O error until it is reopened.
    reopen: bool,
    last_reopen: Option<std::time::Instant>,
    last_probe: Option<std::time::Instant>,
    failures_total: u64,
    recoveries_total: u64,
}

fn due(last: Option<std::time::Instant>) -> bool {
    last.is_none_or(|t| t.elapsed() >= RECOVERY_INTERVAL)
}

/// Whether `e` came from the disk (and leaves redb wanting a reopen).
fn is_io(e: &redb::Error) -> bool {
    matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo)
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Where a log's chain stands, kept in [`CHAIN`] and updated in the transaction that
/// appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChainState {
    /// The last record's hash ([`GENESIS`] before the first).
    head: crate::integrity::Hash,
    /// The last record's sequence number.
    last: Option<u64>,
    /// Records since the last checkpoint.
    unchecked: u64,
    /// When the last checkpoint was made (or the chain started), in Unix milliseconds.
    last_checkpoint_ms: u64,
}

impl ChainState {
    fn encode(&self) -> [u8; 56] {
        let mut v = [0u8; 56];
        let last = self.last.map_or(0, |l| l.saturating_add(1));
        for (dst, src) in v.iter_mut().zip(
            self.head
                .iter()
                .chain(&last.to_be_bytes())
                .chain(&self.unchecked.to_be_bytes())
                .chain(&self.last_checkpoint_ms.to_be_bytes()),
        ) {
            *dst = *src;
        }
        v
    }

    fn decode(raw: &[u8]) -> Option<Self> {
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(
                raw.get(at..at.checked_add(8)?)?.try_into().ok()?,
            ))
        };
        let last = word(32)?;
        Some(Self {
            head: raw.get(..32)?.try_into().ok()?,
            last: last.checked_sub(1),
            unchecked: word(40)?,
            last_checkpoint_ms: word(48)?,
        })
    }
}

impl StateStore {
    /// Opens (creating if needed) the store in directory `dir` (file [`STATE_FILE`]).
    ///
    /// A new directory is created 0700 and a new database file 0600, whatever the umask.
    /// An existing database file is refused if group or others may write it, or if it
    /// belongs to another user than this one or root (symlinks followed; see
    /// [`crate::trust`]); so is a directory others can write. Whether this call created
    /// the database ([`StateStore::is_new`]) tells a caller that the registry remembers
    /// no version: see [`crate::integrity::restore_rollback_memory`].
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        trust::create_private_dir(dir)?;
        let path = dir.join(STATE_FILE);
        let created = match trust::create_private_file(&path) {
            Ok(_) => true,
            Err(e) if e.already_exists() => {
                trust::check_file(&path, Material::Registry)?;
                false
            }
            Err(e) => return Err(e.into()),
        };
        // redb initializes an empty file in place, keeping the mode it was created with.
        let db = Database::create(&path).map_err(|e| StateError::Database {
            path: path.clone(),
            operation: "opening",
            source: Box::new(e),
        })?;
        let store = Self {
            db: RwLock::new(Some(db)),
            health: Mutex::new(Health::default()),
            path,
            created,
            checkpoints: RwLock::new(CheckpointPolicy::default()),
            checkpoint_failure: Mutex::new(None),
        };
        // Create the tables so that read transactions find them.
        store.write("creating tables", |txn| {
            txn.open_table(MANIFESTS)?;
            txn.open_table(BLOCKLIST)?;
            txn.open_table(EVENTS)?;
            txn.open_table(DECISIONS)?;
            txn.open_table(KEYS)?;
            txn.open_table(FACTS)?;
            txn.open_table(DIGESTS)?;
            txn.open_table(META)?;
            txn.open_table(CHAIN)?;
            txn.open_table(CHECKPOINTS)?;
            txn.open_table(ADMITTED)?;
            Ok(())
        })?;
        Ok(store)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether [`StateStore::open`] created the database: its registry then remembers no
    /// accepted version, and rollback protection restarts from zero unless it is rebuilt
    /// ([`crate::integrity::restore_rollback_memory`]).
    pub fn is_new(&self) -> bool {
        self.created
    }

    fn db_err(&self, operation: &'static str) -> impl FnOnce(redb::Error) -> StateError + '_ {
        move |e| StateError::Database {
            path: self.path.clone(),
            operation,
            source: Box::new(e),
        }
    }

    /// Runs `f` in a write transaction committed durably before returning. A commit
    /// clears the store's failure; an I/O error sets it.
    fn write<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StateError> {
        let out = self.with_db(operation, |db| {
            let txn = db.begin_write()?;
            let out = f(&txn)?;
            txn.commit()?;
            Ok(out)
        })?;
        self.note_commit();
        Ok(out)
    }

    /// Runs `f` in a read transaction.
    fn read<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StateError> {
        self.with_db(operation, |db| f(&db.begin_read()?))
    }

    /// Runs `f` on the open database, reopening it first if an I/O error left it
    /// refusing and a reopen is due.
    fn with_db<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&Database) -> Result<T, redb::Error>,
    ) -> Result<T, StateError> {
        self.reopen_if_due();
        let db = self.db.read().unwrap_or_else(PoisonError::into_inner);
        let Some(open) = db.as_ref() else {
            let detail = self
                .lock_health()
                .failure
                .as_ref()
                .map(|f| f.detail.clone())
                .unwrap_or_default();
            return Err(StateError::Database {
                path: self.path.clone(),
                operation,
                source: format!("the database is closed after an I/O error ({detail}); it is opened again every {RECOVERY_INTERVAL:?}").into(),
            });
        };
        f(open).map_err(|e| {
            if is_io(&e) {
                self.note_failure(operation, &e);
            }
            self.db_err(operation)(e)
        })
    }

    fn lock_health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn note_failure(&self, operation: &'static str, e: &redb::Error) {
        let detail = crate::error::join_chain(e.to_string(), std::error::Error::source(e));
        let mut h = self.lock_health();
        h.failures_total = h.failures_total.saturating_add(1);
        h.reopen = true;
        match &mut h.failure {
            Some(f) => f.detail = detail,
            None => {
                h.failure = Some(StorageFailure {
                    path: self.path.clone(),
                    operation,
                    detail,
                    since_unix_ms: now_unix_ms(),
                });
            }
        }
    }

    fn note_commit(&self) {
        let mut h = self.lock_health();
        if h.failure.take().is_some() {
            h.recoveries_total = h.recoveries_total.saturating_add(1);
        }
    }

    /// Closes and opens the database again if an I/O error asked for it and the last
    /// attempt is [`RECOVERY_INTERVAL`] old. redb brings the file back to its last
    /// durable commit.
    fn reopen_if_due(&self) {
        {
            let mut h = self.lock_health();
            if !h.reopen || !due(h.last_reopen) {
                return;
            }
            h.last_reopen = Some(std::time::Instant::now());
        }
        let mut db = self.db.write().unwrap_or_else(PoisonError::into_inner);
        // The old handle holds the file's lock: it must be gone before the new open.
        drop(db.take());
        match Database::create(&self.path) {
            Ok(open) => {
                *db = Some(open);
                self.lock_health().reopen = false;
            }
            Err(e) => {
                let e = redb::Error::from(e);
                let detail = crate::error::join_chain(e.to_string(), std::error::Error::source(&e));
                let mut h = self.lock_health();
                h.failures_total = h.failures_total.saturating_add(1);
                if let Some(f) = &mut h.failure {
                    f.detail = detail;
                }
            }
        }
    }

    /// Whether the store writes. While it fails, this call itself tries to recover
    /// (at most every [`RECOVERY_INTERVAL`]): it reopens the database if need be, then
    /// probes with a small write, whose commit clears the failure. Readiness checks
    /// call it, so a store recovers when the disk does, with or without traffic.
    pub fn storage_health(&self) -> StorageHealth {
        self.reopen_if_due();
        let probe = {
            let mut h = self.lock_health();
            let probe = h.failure.is_some() && !h.reopen && due(h.last_probe);
            if probe {
                h.last_probe = Some(std::time::Instant::now());
            }
            probe
        };
        if probe {
            let now = now_unix_ms();
            // Its failure is kept in the health this returns.
            let _ = self.write("probing whether the disk takes writes", |txn| {
                txn.open_table(META)?.insert("health.probe_ms", now)?;
                Ok(())
            });
        }
        let h = self.lock_health();
        StorageHealth {
            failure: h.failure.clone(),
            failures_total: h.failures_total,
            recoveries_total: h.recoveries_total,
        }
    }

    fn corrupt(&self, table: &'static str, key: &str) -> StateError {
        StateError::Corrupt {
            path: self.path.clone(),
            table,
            key: key.to_owned(),
        }
    }

    /// The registry entry of `object_id`, if any version was accepted.
    pub fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Option<Vec<u8>>, redb::Error> {
            let table = txn.open_table(MANIFESTS)?;
            Ok(table.get(object_id)?.map(|g| g.value().to_vec()))
        };
        match self.read("reading the registry", read)? {
            None => Ok(None),
            Some(raw) => decode_entry(&raw)
                .map(Some)
                .ok_or_else(|| self.corrupt("manifests", object_id)),
        }
    }

    /// Checks, without changing anything, that `version` with `digest` may be accepted.
    pub fn check_version(
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

    /// Records `version` as accepted for `object_id`, atomically refusing a rollback or a
    /// different digest for the accepted version. Accepting the same version and digest again
    /// is a no-op.
    pub fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError> {
        // Ok(Some(refusal)) refuses, Ok(None) with `changed` false leaves the store as is.
        let mut changed = false;
        let outcome = self.with_db("accepting a manifest", |db| {
            let txn = db.begin_write()?;
            let outcome = (|| -> Result<Option<StateError>, redb::Error> {
                let mut table = txn.open_table(MANIFESTS)?;
                let existing = table.get(object_id)?.map(|g| g.value().to_vec());
                if let Some(raw) = existing {
                    let Some(entry) = decode_entry(&raw) else {
                        return Ok(Some(self.corrupt("manifests", object_id)));
                    };
                    if let Err(refusal) = check_against(object_id, version, digest, &entry) {
                        return Ok(Some(refusal));
                    }
                    if entry.version == version {
                        return Ok(None);
                    }
                }
                let record = encode_entry(version, digest, signed_manifest);
                table.insert(object_id, record.as_slice())?;
                changed = true;
                Ok(None)
            })()?;
            if outcome.is_none() && changed {
                txn.commit()?;
            } else {
                // Nothing to write (or refused): no commit, no fsync.
                let _ = txn.abort();
            }
            Ok(outcome)
        })?;
        match outcome {
            None => {
                if changed {
                    self.note_commit();
                }
                Ok(())
            }
            Some(refusal) => Err(refusal),
        }
    }

    /// Blocks `node` with `reason`: a node already blocked keeps its first reason and
    /// time, and this block joins its history.
    pub fn block_node(&self, node: &str, reason: &str) -> Result<(), StateError> {
        let now = now_unix();
        let record = match self.blocked(node)? {
            Some(b) => b.record.blocked_again(reason, now),
            None => BlockRecord::new(reason, now),
        };
        self.put_block(node, &record)
    }

    /// Stores `node`'s block record as it is (the engine computes it).
    pub fn put_block(&self, node: &str, record: &BlockRecord) -> Result<(), StateError> {
        let encoded = serde_json::to_vec(record).map_err(|e| StateError::Database {
            path: self.path.clone(),
            operation: "encoding a block record",
            source: Box::new(e),
        })?;
        self.write("blocking a node", |txn| {
            txn.open_table(BLOCKLIST)?
                .insert(node, encoded.as_slice())?;
            Ok(())
        })
    }

    /// Unblocks `node`; returns whether it was blocked.
    pub fn unblock_node(&self, node: &str) -> Result<bool, StateError> {
        self.write("unblocking a node", |txn| {
            Ok(txn.open_table(BLOCKLIST)?.remove(node)?.is_some())
        })
    }

    /// The block record of `node`, if blocked.
    pub fn blocked(&self, node: &str) -> Result<Option<BlockedNode>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Option<Vec<u8>>, redb::Error> {
            let table = txn.open_table(BLOCKLIST)?;
            Ok(table.get(node)?.map(|g| g.value().to_vec()))
        };
        match self.read("reading the blocklist", read)? {
            None => Ok(None),
            Some(raw) => decode_block(node, &raw)
                .map(Some)
                .ok_or_else(|| self.corrupt("blocklist", node)),
        }
    }

    /// All blocked nodes, by node id.
    pub fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(String, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(BLOCKLIST)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                out.push((k.value().to_owned(), v.value().to_vec()));
            }
            Ok(out)
        };
        self.read("reading the blocklist", read)?
            .into_iter()
            .map(|(node, raw)| {
                decode_block(&node, &raw).ok_or_else(|| self.corrupt("blocklist", &node))
            })
            .collect()
    }

    /// Appends an integrity failure to the event log, durably; returns its sequence number.
    pub fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError> {
        let time = now_unix();
        let now_ms = now_unix_ms();
        let record = encode_event(time, object_id, node, kind, detail);
        self.write("appending an event", |txn| {
            let mut table = txn.open_table(EVENTS)?;
            let chained = self.chain_state(txn, Log::Events, now_ms)?.last;
            let held = table.last()?.map(|(k, _)| k.value());
            // The chain remembers the last number even if the table lost it.
            let seq = next_seq(held.max(chained), 1)?;
            self.append_chained(
                txn,
                Log::Events,
                &mut table,
                seq,
                std::slice::from_ref(&record),
                now_ms,
            )?;
            Ok(seq)
        })
    }

    /// Appends decision records in one durable transaction (a group commit); returns
    /// the sequence number given to the first. Each record's `seq` is set on the way.
    pub fn record_decisions(&self, records: &mut [DecisionRecord]) -> Result<u64, StateError> {
        // The sequence number is the key, not part of the stored JSON.
        let encoded = records
            .iter()
            .map(serde_json::to_vec)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StateError::Database {
                path: self.path.clone(),
                operation: "encoding decision records",
                source: Box::new(e),
            })?;
        let now_ms = now_unix_ms();
        let first = self.write("appending decision records", |txn| {
            let mut table = txn.open_table(DECISIONS)?;
            let mut meta = txn.open_table(META)?;
            // The counter survives pruning, so sequence numbers never repeat.
            let after_last = next_seq(table.last()?.map(|(k, _)| k.value()), encoded.len())?;
            let counted = meta.get("decisions.next")?.map(|g| g.value()).unwrap_or(0);
            let first = after_last.max(counted);
            let end = first
                .checked_add(encoded.len() as u64)
                .ok_or_else(exhausted)?;
            // Hashed here, in the group commit, not per request.
            let added =
                self.append_chained(txn, Log::Decisions, &mut table, first, &encoded, now_ms)?;
            let bytes = meta.get("decisions.bytes")?.map(|g| g.value()).unwrap_or(0);
            meta.insert("decisions.bytes", bytes.saturating_add(added))?;
            meta.insert("decisions.next", end)?;
            Ok(first)
        })?;
        for (seq, record) in (first..).zip(records.iter_mut()) {
            record.seq = seq;
        }
        Ok(first)
    }

    /// How much the decision log holds.
    pub fn decision_log_usage(&self) -> Result<LogUsage, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<LogUsage, redb::Error> {
            let table = txn.open_table(DECISIONS)?;
            let meta = txn.open_table(META)?;
            let first = table.first()?.map(|(k, _)| k.value());
            let last = table.last()?.map(|(k, _)| k.value());
            let counted = meta.get("decisions.next")?.map(|g| g.value()).unwrap_or(0);
            let next = last.map_or(0, |l| l + 1).max(counted);
            Ok(LogUsage {
                records: table.len()?,
                bytes: meta.get("decisions.bytes")?.map(|g| g.value()).unwrap_or(0),
                first: first.unwrap_or(next),
                next,
            })
        };
        self.read("measuring the decision log", read)
    }

    /// Prunes the oldest records up to a checkpoint, one checkpoint span at a time, while
    /// the log is over `max_bytes` or the span's last record is older than
    /// `max_age_seconds`; never a record at or after `keep_from`, and never a span that no
    /// checkpoint ends (the first kept record chains from the checkpoint it was cut at, so
    /// [`crate::audit::verify`] still passes). Checkpoints older than the cut go with it.
    /// Returns the records pruned. `now_ms` is the judge of age.
    pub fn prune_decisions(&self, retention: &Retention, now_ms: u64) -> Result<u64, StateError> {
        let mut pruned = 0u64;
        loop {
            let usage = self.decision_log_usage()?;
            if usage.records == 0 {
                return Ok(pruned);
            }
            // The first checkpoint at or after the first record held.
            let Some(cut) = self
                .raw_checkpoints_from(Log::Decisions, usage.first, 1)?
                .first()
                .map(|(seq, _)| *seq)
            else {
                return Ok(pruned);
            };
            if cut >= retention.keep_from || cut >= usage.next {
                return Ok(pruned);
            }
            let newest_ms = self
                .decisions(cut, 1)?
                .first()
                .filter(|r| r.seq == cut)
                .map(|r| r.time_unix_ms);
            let too_old = newest_ms.is_some_and(|t| {
                now_ms.saturating_sub(t) > retention.max_age_seconds.saturating_mul(1000)
            });
            if usage.bytes <= retention.max_bytes && !too_old {
                return Ok(pruned);
            }
            let removed = self.write("pruning the decision log", |txn| {
                let mut table = txn.open_table(DECISIONS)?;
                let mut meta = txn.open_table(META)?;
                let mut bytes = 0u64;
                let mut count = 0u64;
                let seqs: Vec<u64> = table
                    .range(usage.first..=cut)?
                    .map(|row| row.map(|(k, _)| k.value()))
                    .collect::<Result<_, _>>()?;
                for seq in seqs {
                    if let Some(v) = table.remove(seq)? {
                        bytes += v.value().len() as u64;
                        count += 1;
                    }
                }
                // Older checkpoints vouch for records no longer held.
                let mut checkpoints = txn.open_table(CHECKPOINTS)?;
                let name = Log::Decisions.name();
                let older: Vec<u64> = checkpoints
                    .range((name, 0)..(name, cut))?
                    .map(|row| row.map(|(k, _)| k.value().1))
                    .collect::<Result<_, _>>()?;
                for seq in older {
                    checkpoints.remove((name, seq))?;
                }
                let held = meta.get("decisions.bytes")?.map(|g| g.value()).unwrap_or(0);
                meta.insert("decisions.bytes", held.saturating_sub(bytes))?;
                meta.insert("decisions.next", usage.next)?;
                Ok(count)
            })?;
            if removed == 0 {
                return Ok(pruned);
            }
            pruned += removed;
        }
    }

    /// Up to `limit` decision records with sequence number `from` or later, in order.
    pub fn decisions(&self, from: u64, limit: usize) -> Result<Vec<DecisionRecord>, StateError> {
        self.read_log(DECISIONS, from, limit, "reading decision records")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::body_of(&raw)
                    .and_then(|body| serde_json::from_slice::<DecisionRecord>(body).ok())
                    .map(|r| DecisionRecord { seq, ..r })
                    .ok_or_else(|| self.corrupt("decisions", &seq.to_string()))
            })
            .collect()
    }

    /// Up to `limit` decision records from sequence number `from`, each with its place in
    /// the chain (for forwarding).
    pub fn chained_decisions(
        &self,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(DecisionRecord, audit::ChainLink)>, StateError> {
        self.read_log(DECISIONS, from, limit, "reading decision records")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::ChainLink::of(seq, &raw)
                    .and_then(|(link, body)| {
                        serde_json::from_slice::<DecisionRecord>(body)
                            .ok()
                            .map(|r| (DecisionRecord { seq, ..r }, link))
                    })
                    .ok_or_else(|| self.corrupt("decisions", &seq.to_string()))
            })
            .collect()
    }

    /// Up to `limit` events from sequence number `from`, each with its place in the
    /// chain (for forwarding).
    pub fn chained_events(
        &self,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(Event, audit::ChainLink)>, StateError> {
        self.read_log(EVENTS, from, limit, "reading events")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::ChainLink::of(seq, &raw)
                    .and_then(|(link, body)| decode_event(seq, body).map(|e| (e, link)))
                    .ok_or_else(|| self.corrupt("events", &seq.to_string()))
            })
            .collect()
    }

    /// All events with sequence number `from` or later, in order.
    pub fn events(&self, from: u64) -> Result<Vec<Event>, StateError> {
        self.read_log(EVENTS, from, usize::MAX, "reading events")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::body_of(&raw)
                    .and_then(|body| decode_event(seq, body))
                    .ok_or_else(|| self.corrupt("events", &seq.to_string()))
            })
            .collect()
    }

    /// Sets when checkpoints are made and who signs them (the default: every
    /// [`audit::DEFAULT_CHECKPOINT_RECORDS`] records or
    /// [`audit::DEFAULT_CHECKPOINT_INTERVAL`], unsigned). Takes effect at the next append.
    pub fn set_checkpoint_policy(&self, policy: CheckpointPolicy) {
        match self.checkpoints.write() {
            Ok(mut p) => *p = policy,
            Err(poisoned) => *poisoned.into_inner() = policy,
        }
    }

    /// The checkpoint policy in force.
    pub fn checkpoint_policy(&self) -> CheckpointPolicy {
        match self.checkpoints.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Why the last checkpoint could not be signed, if it could not (the records were
    /// kept; the checkpoint is retried at the next append or tick).
    pub fn checkpoint_failure(&self) -> Option<String> {
        match self.checkpoint_failure.lock() {
            Ok(f) => f.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set_checkpoint_failure(&self, failure: Option<String>) {
        match self.checkpoint_failure.lock() {
            Ok(mut f) => *f = failure,
            Err(poisoned) => *poisoned.into_inner() = failure,
        }
    }

    /// Every checkpoint of `log`, oldest first.
    pub fn checkpoints(&self, log: Log) -> Result<Vec<Checkpoint>, StateError> {
        self.raw_checkpoints(log)?
            .into_iter()
            .map(|(seq, raw)| {
                Checkpoint::decode(log, seq, &raw)
                    .ok_or_else(|| self.corrupt("checkpoints", &format!("{log}/{seq}")))
            })
            .collect()
    }

    /// Checkpoints the logs whose records waited [`CheckpointPolicy::every`] (with
    /// `force`: every log with records not yet checkpointed); the checkpoints made. Writes
    /// nothing when none is due.
    pub fn checkpoint(&self, force: bool) -> Result<Vec<Checkpoint>, StateError> {
        let now_ms = now_unix_ms();
        let policy = self.checkpoint_policy();
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<Option<ChainState>>, redb::Error> {
            let table = txn.open_table(CHAIN)?;
            Log::ALL
                .iter()
                .map(|log| {
                    Ok(table
                        .get(log.name())?
                        .and_then(|g| ChainState::decode(g.value())))
                })
                .collect()
        };
        let states = self.read("reading the chains", read)?;
        let due = states.iter().flatten().any(|c| {
            if force {
                c.unchecked > 0
            } else {
                policy.due(c.unchecked, now_ms.saturating_sub(c.last_checkpoint_ms))
            }
        });
        if !due {
            return Ok(Vec::new());
        }
        self.write("checkpointing the logs", |txn| {
            let mut made = Vec::new();
            for log in Log::ALL {
                let mut chain = self.chain_state(txn, log, now_ms)?;
                if let Some(cp) = self.checkpoint_in(txn, log, &mut chain, now_ms, force)? {
                    txn.open_table(CHAIN)?
                        .insert(log.name(), chain.encode().as_slice())?;
                    made.push(cp);
                }
            }
            Ok(made)
        })
    }

    /// The chain state of `log` in a write transaction (a new chain starts now).
    fn chain_state(
        &self,
        txn: &redb::WriteTransaction,
        log: Log,
        now_ms: u64,
    ) -> Result<ChainState, redb::Error> {
        let table = txn.open_table(CHAIN)?;
        match table.get(log.name())? {
            None => Ok(ChainState {
                head: GENESIS,
                last: None,
                unchecked: 0,
                last_checkpoint_ms: now_ms,
            }),
            Some(g) => ChainState::decode(g.value()).ok_or_else(|| {
                redb::Error::Corrupted(format!("the chain state of the {log} log is malformed"))
            }),
        }
    }

    /// Appends `bodies` to `log` from sequence number `first`, each chained to the one
    /// before, and checkpoints if one is due; the bytes stored.
    fn append_chained(
        &self,
        txn: &redb::WriteTransaction,
        log: Log,
        table: &mut redb::Table<u64, &[u8]>,
        first: u64,
        bodies: &[Vec<u8>],
        now_ms: u64,
    ) -> Result<u64, redb::Error> {
        let mut chain = self.chain_state(txn, log, now_ms)?;
        let mut stored = 0u64;
        for (seq, body) in (first..).zip(bodies) {
            let hash = audit::record_hash(log, seq, &chain.head, body);
            let value = audit::encode_link(seq, &chain.head, &hash, body);
            stored = stored.saturating_add(value.len() as u64);
            table.insert(seq, value.as_slice())?;
            chain.head = hash;
            chain.last = Some(seq);
            chain.unchecked = chain.unchecked.saturating_add(1);
        }
        self.checkpoint_in(txn, log, &mut chain, now_ms, false)?;
        txn.open_table(CHAIN)?
            .insert(log.name(), chain.encode().as_slice())?;
        Ok(stored)
    }

    /// Makes the checkpoint of `log` at its last record if one is due (or, with `force`,
    /// if any record is not yet checkpointed). A signing failure keeps the records and is
    /// kept in [`StateStore::checkpoint_failure`]: the checkpoint stays due.
    fn checkpoint_in(
        &self,
        txn: &redb::WriteTransaction,
        log: Log,
        chain: &mut ChainState,
        now_ms: u64,
        force: bool,
    ) -> Result<Option<Checkpoint>, redb::Error> {
        let policy = self.checkpoint_policy();
        let Some(last) = chain.last else {
            return Ok(None);
        };
        let due = if force {
            chain.unchecked > 0
        } else {
            policy.due(
                chain.unchecked,
                now_ms.saturating_sub(chain.last_checkpoint_ms),
            )
        };
        if !due {
            return Ok(None);
        }
        match policy.make(log, last, chain.head, now_ms) {
            Ok(cp) => {
                txn.open_table(CHECKPOINTS)?
                    .insert((log.name(), last), cp.encode().as_slice())?;
                chain.unchecked = 0;
                chain.last_checkpoint_ms = now_ms;
                self.set_checkpoint_failure(None);
                Ok(Some(cp))
            }
            Err(e) => {
                self.set_checkpoint_failure(Some(crate::error::join_chain(
                    format!("cannot sign the checkpoint of the {log} log at record {last}: {e}"),
                    std::error::Error::source(&e),
                )));
                Ok(None)
            }
        }
    }

    /// The stored checkpoints of `log`, by the last record they cover.
    pub(crate) fn raw_checkpoints(&self, log: Log) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        self.raw_checkpoints_from(log, 0, usize::MAX)
    }

    fn raw_checkpoints_from(
        &self,
        log: Log,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(u64, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(CHECKPOINTS)?;
            let name = log.name();
            let mut out = Vec::new();
            for row in table.range((name, from)..=(name, u64::MAX))?.take(limit) {
                let (k, v) = row?;
                out.push((k.value().1, v.value().to_vec()));
            }
            Ok(out)
        };
        self.read("reading checkpoints", read)
    }

    /// Up to `limit` stored rows of `log` from sequence number `from`, as stored (for
    /// verification).
    pub(crate) fn raw_log(
        &self,
        log: Log,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        let table = match log {
            Log::Decisions => DECISIONS,
            Log::Events => EVENTS,
        };
        self.read_log(table, from, limit, "reading a log to verify it")
    }

    /// Up to `limit` raw rows of an append-only log table, from sequence number `from`.
    fn read_log(
        &self,
        table: TableDefinition<u64, &[u8]>,
        from: u64,
        limit: usize,
        operation: &'static str,
    ) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(u64, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in table.range(from..)?.take(limit) {
                let (k, v) = row?;
                out.push((k.value(), v.value().to_vec()));
            }
            Ok(out)
        };
        self.read(operation, read)
    }
}

fn check_against(
    object_id: &str,
    version: u64,
    digest: &[u8; 32],
    entry: &RegistryEntry,
) -> Result<(), StateError> {
    if version < entry.version {
        return Err(StateError::Rollback {
            object_id: object_id.to_owned(),
            offered: version,
            accepted: entry.version,
        });
    }
    if version == entry.version && digest != &entry.digest {
        return Err(StateError::DigestConflict {
            object_id: object_id.to_owned(),
            version,
        });
    }
    Ok(())
}

/// The sequence number after `last` (0 for an empty log), with room for `count` more:
/// a log whose numbers would overflow is reported as corrupt rather than wrap.
fn next_seq(last: Option<u64>, count: usize) -> Result<u64, redb::Error> {
    let first = match last {
        None => 0,
        Some(last) => last.checked_add(1).ok_or_else(exhausted)?,
    };
    first
        .checked_add(count as u64)
        .ok_or_else(exhausted)
        .map(|_| first)
}

fn exhausted() -> redb::Error {
    redb::Error::Corrupted("a log's sequence numbers are exhausted".into())
}

fn encode_entry(version: u64, digest: &[u8; 32], signed: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(40 + signed.len());
    v.extend_from_slice(&version.to_be_bytes());
    v.extend_from_slice(digest);
    v.extend_from_slice(signed);
    v
}

fn decode_entry(raw: &[u8]) -> Option<RegistryEntry> {
    let version = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
    let digest: [u8; 32] = raw.get(8..40)?.try_into().ok()?;
    Some(RegistryEntry {
        version,
        digest,
        signed_manifest: raw.get(40..)?.to_vec(),
    })
}

fn decode_block(node: &str, raw: &[u8]) -> Option<BlockedNode> {
    let record = if raw.first() == Some(&b'{') {
        serde_json::from_slice(raw).ok()?
    } else {
        // Stores written before block histories: 8 bytes of time, then the reason.
        let since = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
        BlockRecord::new(String::from_utf8(raw.get(8..)?.to_vec()).ok()?, since)
    };
    Some(BlockedNode {
        node: node.to_owned(),
        record,
    })
}

fn push_str(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(&(s.len() as u32).to_be_bytes());
    v.extend_from_slice(s.as_bytes());
}

pub(crate) fn encode_event(
    time: u64,
    object_id: &str,
    node: Option<&str>,
    kind: &str,
    detail: &str,
) -> Vec<u8> {
    let mut v = time.to_be_bytes().to_vec();
    push_str(&mut v, object_id);
    match node {
        Some(n) => {
            v.push(1);
            push_str(&mut v, n);
        }
        None => v.push(0),
    }
    push_str(&mut v, kind);
    push_str(&mut v, detail);
    v
}

pub(crate) fn decode_event(seq: u64, raw: &[u8]) -> Option<Event> {
    fn string(raw: &[u8], pos: &mut usize) -> Option<String> {
        let len = u32::from_be_bytes(raw.get(*pos..*pos + 4)?.try_into().ok()?) as usize;
        let start = *pos + 4;
        let s = String::from_utf8(raw.get(start..start.checked_add(len)?)?.to_vec()).ok()?;
        *pos = start + len;
        Some(s)
    }
    let time_unix = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
    let mut pos = 8;
    let object_id = string(raw, &mut pos)?;
    let has_node = *raw.get(pos)?;
    pos += 1;
    let node = if has_node == 1 {
        Some(string(raw, &mut pos)?)
    } else {
        None
    };
    let kind = string(raw, &mut pos)?;
    let detail = string(raw, &mut pos)?;
    Some(Event {
        seq,
        time_unix,
        object_id,
        node,
        kind,
        detail,
    })
}

impl StateBackend for StateStore {
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
    fn put_block(&self, node: &str, record: &BlockRecord) -> Result<(), StateError> {
        StateStore::put_block(self, node, record)
    }
    fn unblock_node(&self, node: &str) -> Result<bool, StateError> {
        StateStore::unblock_node(self, node)
    }
    fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError> {
        StateStore::blocked_nodes(self)
    }
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
        let bytes = self.encode("encoding admitted facts", facts)?;
        let key = AdmittedFacts::key(&facts.namespace, &facts.name);
        let now = facts.admitted_at_ms;
        self.write("remembering admitted facts", |txn| {
            let mut table = txn.open_table(ADMITTED)?;
            table.insert(key.as_str(), bytes.as_slice())?;
            if usize::try_from(table.len()?).unwrap_or(usize::MAX) <= limits.max {
                return Ok(());
            }
            // Over the bound: the expired go, then the oldest, down to 90% of it so
            // that this scan is not made on every admission.
            let mut entries: Vec<(u64, String)> = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                let at = serde_json::from_slice::<AdmittedFacts>(v.value())
                    .map_or(0, |f| f.admitted_at_ms);
                entries.push((at, k.value().to_owned()));
            }
            entries.sort();
            let keep = limits.max.saturating_mul(9) / 10;
            let excess = entries.len().saturating_sub(keep);
            for (i, (at, k)) in entries.iter().enumerate() {
                let expired = now.saturating_sub(*at) > limits.seconds.saturating_mul(1000);
                if (i < excess || expired) && k != &key {
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
        let facts: AdmittedFacts =
            serde_json::from_slice(&raw).map_err(|_| self.corrupt("admitted", &key))?;
        Ok((!facts.expired(now_unix_ms(), max_age_seconds)).then_some(facts))
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
}

impl StateStore {
    fn encode<T: Serialize>(
        &self,
        operation: &'static str,
        value: &T,
    ) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(value).map_err(|e| StateError::Database {
            path: self.path.clone(),
            operation,
            source: Box::new(e),
        })
    }

    fn keys_of(
        &self,
        table: TableDefinition<&str, &[u8]>,
        operation: &'static str,
    ) -> Result<Vec<String>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<String>, redb::Error> {
            let table = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, _) = row?;
                out.push(k.value().to_owned());
            }
            Ok(out)
        };
        self.read(operation, read)
    }

    fn values_of<T: serde::de::DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        name: &'static str,
        operation: &'static str,
    ) -> Result<Vec<T>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(String, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                out.push((k.value().to_owned(), v.value().to_vec()));
            }
            Ok(out)
        };
        self.read(operation, read)?
            .into_iter()
            .map(|(k, raw)| serde_json::from_slice(&raw).map_err(|_| self.corrupt(name, &k)))
            .collect()
    }
}

fn split_revision(raw: &[u8]) -> Option<(u64, &[u8])> {
    let rev = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
    Some((rev, raw.get(8..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admitted_facts_are_bounded_in_count_and_expire() {
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(tmp.path()).unwrap();
        let limits = AdmittedLimits {
            max: 10,
            seconds: 60,
        };
        let now = now_unix_ms();
        let facts = |i: u64, at: u64| AdmittedFacts {
            namespace: "ns".into(),
            name: format!("pod-{i}"),
            uid: format!("uid-{i}"),
            attrs: serde_json::json!({"gpus": i}),
            admitted_at_ms: at,
        };
        for i in 0..11 {
            store
                .remember_admitted(&facts(i, now - 1000 + i), &limits)
                .unwrap();
        }
        // Past the bound: the oldest went, down to 90% of it, the newest stayed.
        let kept: Vec<bool> = (0..11)
            .map(|i| {
                store
                    .admitted("ns", &format!("pod-{i}"), 60)
                    .unwrap()
                    .is_some()
            })
            .collect();
        assert_eq!(kept.iter().filter(|k| **k).count(), 9, "{kept:?}");
        assert!(!kept[0] && !kept[1] && kept[10], "{kept:?}");
        assert_eq!(
            store.admitted("ns", "pod-10", 60).unwrap().unwrap(),
            facts(10, now - 990)
        );
        // Older than the time: not returned.
        store
            .remember_admitted(&facts(20, now - 120_000), &limits)
            .unwrap();
        assert!(store.admitted("ns", "pod-20", 60).unwrap().is_none());
        store.forget_admitted("ns", "pod-10").unwrap();
        assert!(store.admitted("ns", "pod-10", 60).unwrap().is_none());
    }

    #[test]
    fn sequence_numbers_never_wrap() {
        assert_eq!(next_seq(None, 3).unwrap(), 0);
        assert_eq!(next_seq(Some(4), 1).unwrap(), 5);
        assert!(next_seq(Some(u64::MAX), 1).is_err());
        assert!(next_seq(Some(u64::MAX - 2), 5).is_err());
    }

    #[test]
    fn registry_refuses_rollback_and_conflicts() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        assert!(s.registry_entry("o").unwrap().is_none());
        s.accept("o", 2, &[1; 32], b"m2").unwrap();
        s.accept("o", 2, &[1; 32], b"m2").unwrap();
        assert!(matches!(
            s.accept("o", 1, &[1; 32], b"m1"),
            Err(StateError::Rollback {
                offered: 1,
                accepted: 2,
                ..
            })
        ));
        assert!(matches!(
            s.accept("o", 2, &[2; 32], b"x"),
            Err(StateError::DigestConflict { version: 2, .. })
        ));
        s.accept("o", 3, &[3; 32], b"m3").unwrap();
        drop(s);
        let s = StateStore::open(dir.path()).unwrap();
        let e = s.registry_entry("o").unwrap().unwrap();
        assert_eq!(
            (e.version, e.digest, e.signed_manifest.as_slice()),
            (3, [3; 32], &b"m3"[..])
        );
        assert!(s.check_version("o", 2, &[2; 32]).is_err());
        assert!(s.check_version("o", 4, &[2; 32]).is_ok());
    }

    /// The registry against a simple model: a map from object to (highest version, digest).
    #[test]
    fn registry_matches_model_on_random_operations() {
        use std::collections::HashMap;
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        let mut model: HashMap<String, (u64, [u8; 32])> = HashMap::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..300 {
            let id = format!("obj-{}", next(4));
            let version = next(6);
            let digest = [next(3) as u8; 32];
            let expected = match model.get(&id) {
                Some(&(v, _)) if version < v => Err("rollback"),
                Some(&(v, d)) if version == v && d != digest => Err("conflict"),
                _ => Ok(()),
            };
            let got = s.accept(&id, version, &digest, &digest);
            match (expected, &got) {
                (Ok(()), Ok(())) => {
                    let e = model.entry(id.clone()).or_insert((version, digest));
                    *e = (version, digest);
                }
                (Err("rollback"), Err(StateError::Rollback { .. }))
                | (Err("conflict"), Err(StateError::DigestConflict { .. })) => {}
                (e, g) => panic!("model {e:?}, store {g:?} for {id} v{version}"),
            }
            let entry = s
                .registry_entry(&id)
                .unwrap()
                .map(|e| (e.version, e.digest));
            assert_eq!(entry, model.get(&id).copied());
        }
    }

    fn record(time_unix_ms: u64) -> DecisionRecord {
        DecisionRecord {
            seq: 0,
            time_unix_ms,
            principal: "p".into(),
            action: "a".into(),
            resource: "r".into(),
            caller: None,
            policy_digest: "d".into(),
            decision: Decision::error("x"),
        }
    }

    fn every(records: u64) -> CheckpointPolicy {
        CheckpointPolicy {
            every_records: records,
            every: Duration::from_secs(3600),
            anchor: None,
        }
    }

    #[test]
    fn retention_prunes_only_at_checkpoints_and_never_what_is_kept_or_numbers_again() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        s.set_checkpoint_policy(every(100));
        // Checkpoints at 99, 199, 299 (one per group of 100), none over the last 10.
        for g in 0..3 {
            let mut batch: Vec<DecisionRecord> =
                (0..100).map(|i| record(1_000 + g * 100 + i)).collect();
            s.record_decisions(&mut batch).unwrap();
        }
        let mut tail: Vec<DecisionRecord> = (0..10).map(|i| record(2_000 + i)).collect();
        s.record_decisions(&mut tail).unwrap();
        let seqs: Vec<u64> = s
            .checkpoints(Log::Decisions)
            .unwrap()
            .iter()
            .map(|c| c.seq)
            .collect();
        assert_eq!(seqs, [99, 199, 299]);
        let full = s.decision_log_usage().unwrap();
        assert_eq!((full.records, full.first, full.next), (310, 0, 310));
        // Over the byte budget, but only up to checkpoint 99 may go (keep_from).
        let keep = Retention {
            max_bytes: 1,
            max_age_seconds: u64::MAX,
            keep_from: 150,
        };
        assert_eq!(s.prune_decisions(&keep, 0).unwrap(), 100);
        let after = s.decision_log_usage().unwrap();
        assert_eq!((after.first, after.records), (100, 210));
        assert!(after.bytes < full.bytes);
        crate::audit::verify(&s, None).unwrap();
        // By age: spans whose last record is too old go, the unchecked tail stays.
        let old = Retention {
            max_bytes: u64::MAX,
            max_age_seconds: 1,
            keep_from: u64::MAX,
        };
        assert_eq!(s.prune_decisions(&old, 1_000_000).unwrap(), 200);
        assert_eq!(s.decision_log_usage().unwrap().records, 10);
        // The checkpoint the log was cut at stays; older ones went.
        let seqs: Vec<u64> = s
            .checkpoints(Log::Decisions)
            .unwrap()
            .iter()
            .map(|c| c.seq)
            .collect();
        assert_eq!(seqs, [299]);
        let report = crate::audit::verify(&s, None).unwrap();
        assert_eq!(report.logs[0].first, Some(300));
        assert_eq!(report.logs[0].unwitnessed, 10);
        // Nothing without a checkpoint after it is pruned, however old.
        assert_eq!(s.prune_decisions(&old, u64::MAX).unwrap(), 0);
        // Sequence numbers go on after pruning.
        let mut more = vec![record(5)];
        assert_eq!(s.record_decisions(&mut more).unwrap(), 310);
        crate::audit::verify(&s, None).unwrap();
    }

    #[test]
    fn chained_reads_give_each_record_the_hash_its_successor_chains_from() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        let mut batch: Vec<DecisionRecord> = (0..3).map(record).collect();
        s.record_decisions(&mut batch).unwrap();
        let read = s.chained_decisions(0, 10).unwrap();
        assert_eq!(read.len(), 3);
        assert_eq!(read[0].1.prev, Some(GENESIS));
        assert_eq!(read[1].1.prev, read[0].1.hash);
        assert_eq!(read[2].1.prev, read[1].1.hash);
        assert_eq!((read[2].0.seq, read[2].1.seq), (2, 2));
        s.record_event("o", None, "k", "d").unwrap();
        let events = s.chained_events(0, 10).unwrap();
        assert_eq!(
            (events[0].0.kind.as_str(), events[0].1.prev),
            ("k", Some(GENESIS))
        );
    }

    #[test]
    fn a_quiet_log_is_checkpointed_by_time_and_by_force() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        s.set_checkpoint_policy(CheckpointPolicy {
            every: Duration::ZERO,
            ..every(1000)
        });
        // Due by time at once: the append itself checkpoints.
        s.record_event("o", None, "k", "d").unwrap();
        assert_eq!(s.checkpoints(Log::Events).unwrap().len(), 1);
        assert!(s.checkpoint(false).unwrap().is_empty(), "nothing new");
        s.set_checkpoint_policy(every(1000));
        s.record_event("o", None, "k", "d").unwrap();
        assert!(s.checkpoint(false).unwrap().is_empty(), "not due yet");
        let made = s.checkpoint(true).unwrap();
        assert_eq!((made.len(), made[0].seq, made[0].log), (1, 1, Log::Events));
        assert!(made[0].signature.is_none());
    }

    #[test]
    fn key_records_are_compare_and_swap() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        let b: &dyn StateBackend = &s;
        assert_eq!(b.key_record("k").unwrap(), None);
        let r1 = b.put_key_record("k", b"one", None).unwrap();
        assert!(matches!(
            b.put_key_record("k", b"again", None),
            Err(StateError::Conflict {
                expected: None,
                found: Some(1),
                ..
            })
        ));
        let r2 = b.put_key_record("k", b"two", Some(r1)).unwrap();
        assert!(b.put_key_record("k", b"stale", Some(r1)).is_err());
        assert_eq!(b.key_record("k").unwrap(), Some((b"two".to_vec(), r2)));
        assert_eq!(b.key_ids().unwrap(), ["k"]);
        assert!(b.delete_key_record("k", r1).is_err());
        b.delete_key_record("k", r2).unwrap();
        assert_eq!(b.key_record("k").unwrap(), None);
    }

    #[test]
    fn node_facts_and_digests_are_kept_per_node_and_process() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        let facts = NodeFacts {
            node: "n1".into(),
            entities: serde_json::json!([]),
            collected_at: 5,
            ttl_seconds: 30,
        };
        s.publish_facts(&facts).unwrap();
        s.publish_facts(&NodeFacts {
            collected_at: 9,
            ..facts.clone()
        })
        .unwrap();
        assert_eq!(s.node_facts().unwrap().len(), 1);
        assert_eq!(s.node_facts().unwrap()[0].collected_at, 9);
        s.report_digest(&ServedDigest {
            process: "a".into(),
            digest: "d1".into(),
            at: 1,
        })
        .unwrap();
        assert_eq!(s.served_digests().unwrap()[0].digest, "d1");
    }

    #[test]
    fn blocklist_and_events_persist() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = StateStore::open(dir.path()).unwrap();
            s.block_node("node-1", "chunk 3 mismatch").unwrap();
            assert_eq!(
                s.record_event("o", Some("node-1"), "chunk-mismatch", "d")
                    .unwrap(),
                0
            );
            assert_eq!(s.record_event("o", None, "rollback", "e").unwrap(), 1);
        }
        let s = StateStore::open(dir.path()).unwrap();
        assert_eq!(
            s.blocked("node-1").unwrap().unwrap().record.reason,
            "chunk 3 mismatch"
        );
        assert_eq!(s.blocked_nodes().unwrap().len(), 1);
        let ev = s.events(0).unwrap();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].node.as_deref(), Some("node-1"));
        assert_eq!(ev[1].kind, "rollback");
        assert_eq!(s.events(1).unwrap().len(), 1);
        assert!(s.unblock_node("node-1").unwrap());
        assert!(s.blocked("node-1").unwrap().is_none());
    }
}
