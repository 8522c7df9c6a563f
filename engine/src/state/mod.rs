//! Durable state, one trait per kind: [`SharedState`] for what the cluster shares
//! (manifest registry, blocklist, key metadata, node facts, served policy digests,
//! admitted objects' facts) and [`LocalLog`] for what always stays on one machine (the
//! decision and event logs). [`StateStore`] implements both on redb under a state
//! directory; the cluster-wide [`SharedState`] on etcd (`probity_etcd::EtcdState`) lives
//! with the hooks, which know the network, and pairs with a local [`StateStore`] for the
//! logs ([`AttachedState`]). The engine sees both through these traits only.
//!
//! A shared backend ([`SharedState::is_shared`]) is written by many processes. Its
//! changes reach every engine through [`SharedState::changes`], in the backend's order,
//! and an engine's own writes reach its memory the same way (read-your-writes: it waits
//! until [`SharedState::await_applied`] says the watch has applied them), so memory
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

use serde::{Deserialize, Serialize};

use crate::block::BlockRecord;
use crate::decision::Decision;

mod actions;
mod backend;
mod embedded;
mod error;

pub use actions::{ActionRequest, MIGRATE, split_target};
pub use backend::{AttachedState, LocalLog, SharedState};
pub(crate) use embedded::RECOVERY_INTERVAL;
use embedded::check_against;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use embedded::decode_event;
#[cfg(test)]
pub(crate) use embedded::encode_event;
pub use embedded::{StateStore, StorageFailure, StorageHealth};
pub use error::StateError;

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
pub(crate) const STALE_FACTS_SOURCE: &str = "agent";

/// File name of the database inside the state directory.
pub(crate) const STATE_FILE: &str = "state.redb";

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
    /// The request as it was decided, so that it can be decided again under another
    /// policy set (`probity policy impact`); absent from records written before it was
    /// kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RecordedRequest>,
    /// An allow that needed no record, kept as one of the sampled allows
    /// ([`crate::Engine::sample_allows`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sampled: bool,
}

/// What a decision record keeps of its request beyond principal, action and resource:
/// the context and the request's own entities as the caller sent them, bounded in size
/// ([`RecordedRequest::MAX_BYTES`]), with the values of secret-looking attributes
/// redacted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedRequest {
    /// The request's context, as sent (the engine's clock facts are not in it: a replay
    /// fills them from the record's time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<serde_json::Map<String, serde_json::Value>>,
    /// The request's own entities (admission's workload), as sent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entities: Vec<serde_json::Value>,
    /// Whether it was asked by an authorized fact reporter.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reporter: bool,
    /// The paths whose values were redacted (`context.token`, `entities[0].attrs.key`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub redacted: Vec<String>,
    /// Why the context and entities were left out (over [`RecordedRequest::MAX_BYTES`]):
    /// such a record cannot be decided again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub omitted: Option<String>,
}

impl RecordedRequest {
    /// The most bytes of context and entities (as JSON) a record keeps.
    pub const MAX_BYTES: usize = 64 * 1024;

    /// Whether the request can be decided again as it was.
    pub fn replayable(&self) -> bool {
        self.omitted.is_none()
    }
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
    /// The cluster's facts as the shared store holds them now, whole (entity id to its
    /// Cedar entity JSON): what [`SharedState::publish_cluster_facts`] wrote, from
    /// whichever process the cluster manager reached. Applied as a full replace.
    ClusterFacts(std::collections::BTreeMap<String, serde_json::Value>),
    /// The backend lost track and read everything again: apply this whole blocklist.
    Resync(Vec<BlockedNode>),
}

/// Changes a shared backend delivers together, in its order. The follower applies them
/// and then calls [`ChangeBatch::acknowledge`], which is what
/// [`SharedState::await_applied`] waits for.
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
    /// Most entries kept; past it, expired ones are purged (each by the lifetime it
    /// was remembered with), then those nearest their end.
    pub max: usize,
    /// Seconds an entry is kept (the entry remembers it: another caller's limits do
    /// not shorten it).
    pub seconds: u64,
}
