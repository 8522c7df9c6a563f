use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use probity::state::{ChangeBatch, SharedState, StateError, StateStore};
use tokio::runtime::{Handle, Runtime};

use super::housekeeping::{look_after_leases, send_outbox};
use super::records::{self, BLOCKLIST, CLUSTER, FACTS, REGISTRY};
use super::{
    BackendError, CHANGES_CAPACITY, Core, DigestLease, EtcdState, EtcdStateOptions, Queued, Role,
    follow, lock, run_on,
};
use crate::{EtcdClient, EtcdConfig, EtcdError};

/// A runtime shut down when dropped: waiting (briefly) for its tasks to end, so that the
/// local store they hold is closed when the backend is gone and the state directory can
/// be opened again; without waiting inside another runtime's async context, where
/// blocking would panic.
pub(super) struct OwnedRuntime(Option<Runtime>);

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
        let local = Arc::new(StateStore::open_with_clock(
            state_dir,
            Arc::clone(&options.clock),
        )?);
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
            admitted_lease: Mutex::new(HashMap::new()),
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

    pub(super) fn start_watches(
        &self,
    ) -> Result<std::sync::mpsc::Receiver<ChangeBatch>, EtcdError> {
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
                        tx: tx.clone(),
                        only: None,
                        known: Default::default(),
                    },
                    resync.clone(),
                )?);
                // The cluster's facts, sent by its controller to any one replica: every
                // replica's extender knows every node.
                watches.push(client.watch_with_resync_options(
                    CLUSTER,
                    follow::ClusterHandler {
                        tx,
                        current: Default::default(),
                    },
                    resync,
                )?);
            }
        }
        *lock(&self.watches) = watches;
        Ok(rx)
    }

    pub(super) fn run<T, F>(&self, operation: &'static str, fut: F) -> Result<T, StateError>
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

    pub(super) fn encode<T: serde::Serialize>(
        &self,
        operation: &'static str,
        value: &T,
    ) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(value).map_err(|e| self.core.err(operation, e))
    }

    pub(super) fn corrupt(
        &self,
        table: &'static str,
        key: &str,
        e: records::RecordError,
    ) -> StateError {
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
