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

mod admitted;
mod follow;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use probity::BlockRecord;
use probity::state::{
    BlockedNode, ChangeBatch, NodeFacts, RegistryEntry, ServedDigest, SharedHealth, SharedState,
    StateError, StateStore,
};
use thiserror::Error;
use tokio::runtime::{Handle, Runtime};

use crate::{
    EtcdClient, EtcdConfig, EtcdError, KeepAlive, Lease, LeaseId, ResyncOptions, ResyncWatch, Swap,
    VersionedError,
};
use records::{BLOCKLIST, DIGESTS, FACTS, KEYS, REGISTRY, RegistryRecord};

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

/// What a process follows in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A node's sidecar: the blocklist, the manifest registry and its own node's facts.
    Sidecar {
        /// The node it serves.
        node: String,
    },
    /// An admission webhook or scheduler extender replica: the blocklist and every
    /// node's facts.
    Webhook,
}

/// How an [`EtcdState`] behaves. Build with [`EtcdStateOptions::new`] and the `with_*`
/// methods; every setting not given keeps the default named in its doc.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdStateOptions {
    /// What the process follows. No default.
    pub role: Role,
    /// The name this process reports its served digest under (`digests/<process>`): its
    /// host (pod) name and role, e.g. `probity-webhook-7d9f-x2/webhook`. No default.
    pub process: String,
    /// See [`DEFAULT_READ_YOUR_WRITES`].
    pub read_your_writes: Duration,
    /// When a disconnected watch reads everything again instead of resuming.
    pub resync: ResyncOptions,
    /// See [`DEFAULT_PROCESS_TTL`].
    pub process_ttl: Duration,
    /// See [`DEFAULT_OUTBOX_RETRY`].
    pub outbox_retry: Duration,
}

impl EtcdStateOptions {
    /// Options for `role`, reporting as `process`, everything else at its default.
    pub fn new(role: Role, process: impl Into<String>) -> Self {
        Self {
            role,
            process: process.into(),
            read_your_writes: DEFAULT_READ_YOUR_WRITES,
            resync: ResyncOptions::default(),
            process_ttl: DEFAULT_PROCESS_TTL,
            outbox_retry: DEFAULT_OUTBOX_RETRY,
        }
    }

    /// Sets the read-your-writes bound.
    pub fn with_read_your_writes(mut self, bound: Duration) -> Self {
        self.read_your_writes = bound;
        self
    }

    /// Sets the watches' resync options.
    pub fn with_resync(mut self, resync: ResyncOptions) -> Self {
        self.resync = resync;
        self
    }

    /// Sets the TTL of the process lease.
    pub fn with_process_ttl(mut self, ttl: Duration) -> Self {
        self.process_ttl = ttl;
        self
    }

    /// Sets the outbox retry pause.
    pub fn with_outbox_retry(mut self, pause: Duration) -> Self {
        self.outbox_retry = pause;
        self
    }

    fn validate(&self) -> Result<(), BackendError> {
        let bad = |field, problem: &str| BackendError::Options {
            field,
            problem: problem.to_owned(),
        };
        let name_ok = |s: &str| !s.is_empty() && s.len() <= 253 && !s.contains(['/', '\0']);
        if let Role::Sidecar { node } = &self.role
            && !name_ok(node)
        {
            return Err(bad(
                "node",
                "a sidecar needs its node's name (1-253 bytes, no '/')",
            ));
        }
        if !name_ok(&self.process) {
            return Err(bad("process", "must be 1-253 bytes without '/'"));
        }
        for (field, d) in [
            ("read_your_writes", self.read_your_writes),
            ("process_ttl", self.process_ttl),
            ("outbox_retry", self.outbox_retry),
        ] {
            if d.is_zero() {
                return Err(bad(field, "must be more than zero"));
            }
        }
        Ok(())
    }
}

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

/// A runtime shut down when dropped: waiting (briefly) for its tasks to end, so that the
/// local store they hold is closed when the backend is gone and the state directory can
/// be opened again; without waiting inside another runtime's async context, where
/// blocking would panic.
struct OwnedRuntime(Option<Runtime>);

/// How long dropping a backend waits for its tasks to end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            if Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(SHUTDOWN_GRACE);
            }
        }
    }
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
    /// The lease admitted facts are written under, and when it was granted.
    admitted_lease: Mutex<Option<(crate::lease::LeaseId, Instant)>>,
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

impl EtcdState {
    /// Connects to etcd with `config` on a runtime of its own (two threads), keeping the
    /// local logs and the outbox in `state_dir`. Succeeds while etcd is down (the client
    /// connects lazily); fails on options or a configuration that cannot work.
    pub fn open(
        config: EtcdConfig,
        state_dir: &Path,
        options: EtcdStateOptions,
    ) -> Result<Self, BackendError> {
        options.validate()?;
        let local = Arc::new(StateStore::open(state_dir)?);
        let runtime = OwnedRuntime(Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("probity-etcd")
                .enable_all()
                .build()
                .map_err(BackendError::Runtime)?,
        ));
        let handle = match &runtime.0 {
            Some(rt) => rt.handle().clone(),
            None => return Err(BackendError::Runtime(std::io::ErrorKind::Other.into())),
        };
        let client = run_on(&handle, EtcdClient::connect(config))
            .ok_or_else(|| BackendError::Runtime(std::io::ErrorKind::Interrupted.into()))??;
        Self::build(client, handle, local, options, runtime)
    }

    /// An [`EtcdState`] on an existing client and runtime (several backends may share
    /// them, as a test of many sidecars does). Its calls must not be made from that
    /// runtime's own threads.
    pub fn with_client(
        client: EtcdClient,
        runtime: Handle,
        local: Arc<StateStore>,
        options: EtcdStateOptions,
    ) -> Result<Self, BackendError> {
        options.validate()?;
        Self::build(client, runtime, local, options, OwnedRuntime(None))
    }

    fn build(
        client: EtcdClient,
        handle: Handle,
        local: Arc<StateStore>,
        options: EtcdStateOptions,
        runtime: OwnedRuntime,
    ) -> Result<Self, BackendError> {
        let describe = format!(
            "etcd {} {}",
            client.endpoints().join(","),
            client.keyspace().prefix()
        );
        // The outbox of an earlier run (or the blocklist of a redb store this directory
        // held before) is sent again.
        let outbox = local
            .blocked_nodes()?
            .into_iter()
            .map(|b| {
                (
                    b.node,
                    Queued {
                        record: b.record,
                        landed: None,
                    },
                )
            })
            .collect();
        let core = Arc::new(Core {
            client,
            handle: handle.clone(),
            local,
            options,
            describe,
            applied: Mutex::new(0),
            applied_changed: Condvar::new(),
            following: AtomicBool::new(false),
            registry: RwLock::new(None),
            facts: Mutex::new(HashMap::new()),
            digest: Mutex::new(DigestLease::default()),
            admitted_lease: Mutex::new(None),
            outbox: Mutex::new(outbox),
            outbox_wake: tokio::sync::Notify::new(),
        });
        let tasks = vec![
            handle.spawn(send_outbox(Arc::clone(&core))),
            handle.spawn(look_after_leases(Arc::clone(&core))),
        ];
        Ok(Self {
            core,
            watches: Mutex::new(Vec::new()),
            started: AtomicBool::new(false),
            tasks,
            _runtime: runtime,
        })
    }

    /// The etcd client (for status probes and tests).
    pub fn client(&self) -> &EtcdClient {
        &self.core.client
    }

    /// The options it runs with.
    pub fn options(&self) -> &EtcdStateOptions {
        &self.core.options
    }

    /// The local store that holds the decision and event logs.
    pub fn local(&self) -> &Arc<StateStore> {
        &self.core.local
    }

    /// This backend for what the cluster shares, with its local store for the logs:
    /// what [`probity::Engine::attach_state`] takes.
    pub fn attached(self: &Arc<Self>) -> probity::state::AttachedState {
        probity::state::AttachedState::new(
            Arc::clone(self) as Arc<dyn SharedState>,
            Arc::clone(&self.core.local) as Arc<dyn probity::state::LocalLog>,
        )
    }

    /// The status of each running watch, by prefix.
    pub fn watch_status(&self) -> Vec<(String, crate::WatchStatus)> {
        let prefixes = self.prefixes();
        lock(&self.watches)
            .iter()
            .zip(prefixes)
            .map(|(w, p)| (p, w.status()))
            .collect()
    }

    /// The prefixes this role watches, in the order the watches start.
    fn prefixes(&self) -> Vec<String> {
        match &self.core.options.role {
            Role::Sidecar { node } => vec![
                BLOCKLIST.to_owned(),
                REGISTRY.to_owned(),
                format!("{FACTS}{node}"),
            ],
            Role::Webhook => vec![BLOCKLIST.to_owned(), FACTS.to_owned()],
        }
    }

    fn start_watches(&self) -> Result<std::sync::mpsc::Receiver<ChangeBatch>, EtcdError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(CHANGES_CAPACITY);
        let core = &self.core;
        let client = &core.client;
        let resync = core.options.resync.clone();
        // Watches spawn their tasks on the backend's runtime.
        let _entered = core.handle.enter();
        let mut watches = Vec::new();
        watches.push(client.watch_with_resync_options(
            BLOCKLIST,
            follow::BlocklistHandler {
                tx: tx.clone(),
                core: Arc::clone(core),
            },
            resync.clone(),
        )?);
        match &core.options.role {
            Role::Sidecar { node } => {
                watches.push(client.watch_with_resync_options(
                    REGISTRY,
                    follow::RegistryHandler {
                        core: Arc::clone(core),
                    },
                    resync.clone(),
                )?);
                watches.push(client.watch_with_resync_options(
                    &format!("{FACTS}{node}"),
                    follow::FactsHandler {
                        tx,
                        only: Some(node.clone()),
                        known: Default::default(),
                    },
                    resync,
                )?);
            }
            Role::Webhook => {
                watches.push(client.watch_with_resync_options(
                    FACTS,
                    follow::FactsHandler {
                        tx,
                        only: None,
                        known: Default::default(),
                    },
                    resync,
                )?);
            }
        }
        *lock(&self.watches) = watches;
        Ok(rx)
    }

    fn run<T, F>(&self, operation: &'static str, fut: F) -> Result<T, StateError>
    where
        F: std::future::Future<Output = Result<T, EtcdError>> + Send + 'static,
        T: Send + 'static,
    {
        match run_on(&self.core.handle, fut) {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(self.core.err(operation, e)),
            None => Err(self.core.err(
                operation,
                std::io::Error::other("the state backend's runtime stopped"),
            )),
        }
    }

    fn encode<T: serde::Serialize>(
        &self,
        operation: &'static str,
        value: &T,
    ) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(value).map_err(|e| self.core.err(operation, e))
    }

    fn corrupt(&self, table: &'static str, key: &str, e: records::RecordError) -> StateError {
        self.core.err(
            table,
            std::io::Error::other(format!("malformed record at {key:?}: {e}")),
        )
    }
}

impl Drop for EtcdState {
    fn drop(&mut self) {
        lock(&self.watches).clear();
        for task in &self.tasks {
            task.abort();
        }
        // Renewals stop: the leases expire after their TTL, as when the process dies.
        lock(&self.core.facts).clear();
        lock(&self.core.digest).lease = None;
    }
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

/// Writes queued blocks to etcd until each lands.
async fn send_outbox(core: Arc<Core>) {
    loop {
        let pending: Vec<(String, BlockRecord)> = lock(&core.outbox)
            .iter()
            .filter(|(_, q)| q.landed.is_none())
            .map(|(n, q)| (n.clone(), q.record.clone()))
            .collect();
        for (node, record) in pending {
            let Ok(bytes) = serde_json::to_vec(&record) else {
                continue;
            };
            match core.client.put(&format!("{BLOCKLIST}{node}"), bytes).await {
                Ok(revision) => {
                    tracing::info!(%node, revision, "queued block reached etcd");
                    if let Some(q) = lock(&core.outbox).get_mut(&node)
                        && q.record == record
                    {
                        q.landed = Some(revision);
                    }
                    let local = Arc::clone(&core.local);
                    let done = node.clone();
                    let _ = tokio::task::spawn_blocking(move || local.unblock_node(&done)).await;
                }
                Err(e) => {
                    tracing::warn!(%node, error = %e, "queued block has not reached etcd yet; retrying");
                }
            }
        }
        core.prune_outbox();
        tokio::select! {
            () = core.outbox_wake.notified() => {}
            () = tokio::time::sleep(core.options.outbox_retry) => {}
        }
    }
}

/// Revokes the facts leases of publishers that stopped publishing, and grants the process
/// lease again if it expired.
async fn look_after_leases(core: Arc<Core>) {
    loop {
        tokio::time::sleep(HOUSEKEEPING).await;
        let silent: Vec<(String, LeaseId)> = {
            let mut facts = lock(&core.facts);
            let silent: Vec<(String, LeaseId)> = facts
                .iter()
                .filter(|(_, f)| f.last_publish.elapsed() > f.lease.ttl)
                .map(|(n, f)| (n.clone(), f.lease.id))
                .collect();
            for (node, _) in &silent {
                facts.remove(node);
            }
            silent
        };
        for (node, lease) in silent {
            tracing::warn!(%node, "no facts published within their TTL; revoking them");
            if let Err(e) = core.client.revoke_lease(lease).await {
                tracing::warn!(%node, error = %e, "revoking stale facts failed; they expire with their lease");
            }
        }
        let regrant = {
            let digest = lock(&core.digest);
            let expired = digest
                .lease
                .as_ref()
                .is_some_and(|(_, keep)| keep.state().expired);
            expired.then(|| digest.last.clone()).flatten()
        };
        if let Some(last) = regrant {
            tracing::warn!(process = %last.process, "the process lease expired; reporting the served digest again");
            if let Ok(bytes) = serde_json::to_vec(&last) {
                match put_digest(&core, &last.process, bytes).await {
                    Ok(lease) => lock(&core.digest).lease = Some(lease),
                    Err(e) => tracing::warn!(error = %e, "reporting the served digest failed"),
                }
            }
        }
    }
}

/// Puts `digests/<process>` under a new process lease, kept alive from now on.
async fn put_digest(
    core: &Core,
    process: &str,
    bytes: Vec<u8>,
) -> Result<(Lease, KeepAlive), EtcdError> {
    let key = format!("{DIGESTS}{process}");
    let lease = core.client.grant_lease(core.options.process_ttl).await?;
    core.client.put_with_lease(&key, bytes, lease.id).await?;
    Ok((lease, core.client.keep_alive(lease)))
}

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

    fn put_block(&self, node: &str, record: &BlockRecord) -> Result<(), StateError> {
        self.put_block_at(node, record).map(|_| ())
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

    fn put_block_at(&self, node: &str, record: &BlockRecord) -> Result<Option<u64>, StateError> {
        let bytes = self.encode("encoding a block record", record)?;
        let client = self.core.client.clone();
        let key = format!("{BLOCKLIST}{node}");
        let revision = self.run(
            "blocking a node",
            async move { client.put(&key, bytes).await },
        )?;
        Ok(Some(u64::try_from(revision).unwrap_or(0)))
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
        let deleted = self.run(
            "unblocking a node",
            async move { client.delete(&key).await },
        )?;
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
        kept
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
}
