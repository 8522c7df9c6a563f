//! [`EtcdState`]: the engine's [`SharedState`] on etcd, so that a block, a facts update
//! or a sealed version made by one process reaches every sidecar and webhook.
//!
//! Why this module exists: DESIGN.md's "one truth per cluster". Everything shared lives in
//! etcd under the configured prefix (the layout is in [`records`]): the blocklist, the
//! manifest registry (versions only go up, by compare-and-swap), key metadata (CAS on the
//! key's mod revision), node facts under a lease per node, and the policy digest each
//! process serves under a lease per process. The decision and event logs are not part of
//! it ([`probity::state::LocalLog`]): an [`EtcdState`] holds a [`StateStore`] (redb in the
//! state directory) for its outbox, and [`EtcdState::attached`] pairs the two for an
//! engine.
//!
//! How changes reach an engine: [`SharedState::changes`] starts one resyncing watch per
//! prefix the process needs ([`Role`]): a sidecar follows the blocklist, the registry and
//! its own node's facts; a webhook (or scheduler extender) replica the blocklist and every
//! node's facts. The handlers ([`follow`]) translate etcd's events to
//! [`probity::state::StateChange`]s in revision order; a compaction or a long outage
//! becomes a full read (a `Resync` of the blocklist, `Facts`/`FactsGone` for facts).
//!
//! Read-your-writes: a block or unblock returns the revision etcd gave it
//! ([`SharedState::put_block_at`]), and the engine waits ([`SharedState::await_applied`],
//! bounded by [`EtcdStateOptions::read_your_writes`]) until its watch has applied the
//! blocklist up to that revision. So memory changes only through the watch, and every
//! process applies every write in etcd's order.
//!
//! Blocks that must not wait ([`SharedState::queue_block`]: a node that failed
//! verification): they go to an outbox, kept durably in the local store's blocklist table,
//! and a background task writes them to etcd, retrying every
//! [`EtcdStateOptions::outbox_retry`] until they land. They stay in
//! [`SharedState::unshared_blocks`], which the engine keeps in force, until the watch has
//! applied them. A restart re-sends what the outbox holds (so switching a node from the
//! redb backend to etcd pushes its local blocklist to etcd).
//!
//! Leases: [`SharedState::publish_facts`] puts `facts/<node>` under a lease of the facts'
//! `ttl_seconds`, kept alive while the publisher keeps publishing: when it has not
//! published for a TTL the lease is revoked (the facts go at once), and when the process
//! dies the lease expires after its TTL. Either way every watcher sees `FactsGone`.
//! `digests/<process>` lives under a lease of [`EtcdStateOptions::process_ttl`], renewed
//! while the process runs and granted again (with the last digest) if it ever expires, so
//! a replica that is gone drops out of the list.
//!
//! Every call is synchronous (the trait is): the async client runs on a runtime the
//! backend owns ([`EtcdState::open`]) or is given ([`EtcdState::with_client`]); a call
//! never runs on that runtime's own threads.

pub mod records;

mod actions;
mod admitted;
mod follow;
mod housekeeping;
mod lifecycle;
mod options;
mod shared;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use probity::BlockRecord;
#[cfg(doc)]
use probity::state::SharedState;
use probity::state::{ServedDigest, StateError, StateStore};
use thiserror::Error;
use tokio::runtime::Handle;

use crate::{EtcdClient, EtcdError, KeepAlive, Lease, ResyncWatch};
use lifecycle::OwnedRuntime;
pub use options::{EtcdStateOptions, Role};

/// Default bound on read-your-writes: how long a block or unblock waits for this
/// process's watch to apply it.
pub const DEFAULT_READ_YOUR_WRITES: Duration = Duration::from_secs(5);
/// Default TTL of the lease under which a process's served digest lives.
pub const DEFAULT_PROCESS_TTL: Duration = Duration::from_secs(30);
/// Default pause between attempts to write blocks that have not reached etcd yet.
pub const DEFAULT_OUTBOX_RETRY: Duration = Duration::from_secs(1);
/// Change batches buffered between the watches and the engine's follower; a full buffer
/// holds the watches back (nothing is dropped).
pub const CHANGES_CAPACITY: usize = 1024;
/// Lost compare-and-swap races a block tolerates before giving up.
const BLOCK_ROUNDS: u32 = 16;
/// How often leases and the outbox are looked after.
const HOUSEKEEPING: Duration = Duration::from_millis(250);

/// Why an [`EtcdState`] could not be set up.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BackendError {
    /// An option cannot work.
    #[error("invalid etcd state option {field}: {problem}")]
    Options {
        /// The option.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The runtime or a background task could not start.
    #[error("cannot start the etcd state backend's threads")]
    Runtime(#[source] std::io::Error),
    /// The etcd client refused its configuration.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The local store (decision and event logs, outbox) cannot be opened.
    #[error(transparent)]
    Local(#[from] StateError),
}

/// The engine's state in etcd; see the module docs.
pub struct EtcdState {
    core: Arc<Core>,
    watches: Mutex<Vec<ResyncWatch>>,
    started: AtomicBool,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    // Last: dropped after the watches and tasks are aborted.
    _runtime: OwnedRuntime,
}

impl std::fmt::Debug for EtcdState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdState")
            .field("backend", &self.core.describe)
            .field("role", &self.core.options.role)
            .finish()
    }
}

/// A block waiting to reach etcd.
#[derive(Debug, Clone)]
struct Queued {
    record: BlockRecord,
    /// The revision it landed at, once written; it leaves the queue once the watch has
    /// applied that revision.
    landed: Option<i64>,
}

/// A node's facts lease while its publisher publishes.
struct FactsLease {
    lease: Lease,
    _keep: KeepAlive,
    last_publish: Instant,
}

/// The process lease and the digest reported under it.
#[derive(Default)]
struct DigestLease {
    lease: Option<(Lease, KeepAlive)>,
    last: Option<ServedDigest>,
}

/// Object id -> (accepted version, digest): the registry as the registry watch last saw it.
pub(crate) type RegistryMirror = HashMap<String, (u64, [u8; 32])>;

/// What the tasks, the watch handlers and the calls share.
pub(crate) struct Core {
    client: EtcdClient,
    handle: Handle,
    local: Arc<StateStore>,
    options: EtcdStateOptions,
    describe: String,
    /// The blocklist revision the engine has applied, and its waiters.
    applied: Mutex<i64>,
    applied_changed: Condvar,
    /// Whether an engine follows the changes (then queued blocks wait for it).
    following: AtomicBool,
    /// Object id -> (version, digest), once the registry watch has read it.
    registry: RwLock<Option<RegistryMirror>>,
    facts: Mutex<HashMap<String, FactsLease>>,
    digest: Mutex<DigestLease>,
    /// Per lifetime asked (seconds: a pod's facts and a Slurm job's differ), the lease
    /// admitted facts are written under and when it was granted.
    admitted_lease: Mutex<HashMap<u64, (crate::lease::LeaseId, Instant)>>,
    outbox: Mutex<BTreeMap<String, Queued>>,
    outbox_wake: tokio::sync::Notify,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `fut` on `handle` and waits for it from this (non-runtime) thread.
fn run_on<T, F>(handle: &Handle, fut: F) -> Option<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().ok()
}

impl Core {
    fn err(
        &self,
        operation: &'static str,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> StateError {
        StateError::Shared {
            backend: self.describe.clone(),
            operation,
            source: Box::new(e),
        }
    }

    /// The engine applied the blocklist up to `revision`.
    pub(crate) fn applied_to(&self, revision: i64) {
        {
            let mut applied = lock(&self.applied);
            *applied = (*applied).max(revision);
        }
        self.applied_changed.notify_all();
        self.prune_outbox();
    }

    /// Drops queued blocks that landed and are applied (or landed, when no engine
    /// follows).
    fn prune_outbox(&self) {
        let applied = *lock(&self.applied);
        let following = self.following.load(Ordering::Relaxed);
        lock(&self.outbox).retain(|_, q| match q.landed {
            None => true,
            Some(rev) => following && rev > applied,
        });
    }

    pub(crate) fn set_registry_mirror(&self, mirror: RegistryMirror) {
        *self
            .registry
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(mirror);
    }

    /// Records an accepted version in the mirror (versions only go up).
    pub(crate) fn mirror_accepted(&self, id: String, head: (u64, [u8; 32])) {
        let mut guard = self
            .registry
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(mirror) = guard.as_mut() {
            let slot = mirror.entry(id).or_insert(head);
            if head.0 >= slot.0 {
                *slot = head;
            }
        }
    }

    pub(crate) fn mirror_removed(&self, id: &str) {
        if let Some(mirror) = self
            .registry
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            mirror.remove(id);
        }
    }
}
