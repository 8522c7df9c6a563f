//! The [`Engine`]: a policy set and an entity store behind one atomic pointer.
//!
//! Readers load the current [`Snapshot`] without locking; writers (entity updates,
//! blocks, reloads) build a new snapshot beside it and swap it in whole. A decision
//! therefore always sees one policy set with one store, never a mix, and never waits on
//! a writer. Concurrent writers are coalesced: whoever finds no write in progress
//! applies every queued change in one new snapshot (a group commit of facts).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};
use cedar_policy::Authorizer;

use crate::clock::{Clock, SystemClock};
use crate::decision_log::DecisionLog;
use crate::error::LoadError;
use crate::integrity::Verifier;
use crate::policy_seal::Sealing;
use crate::source::Origin;
use crate::state::{LocalLog, SharedState};
use crate::store::Store;
use crate::watch::ReloadSubscribers;

mod blocklist;
mod cluster;
mod decide;
mod entities;
mod reload;
mod replication;
mod shadow;
mod snapshot;
mod world;

pub(crate) use blocklist::BlockCause;
pub use decide::DecideOptions;
pub(crate) use decide::Prepared;
use entities::ByReferenceAnswer;
pub use entities::EntitiesByReference;
pub use reload::PolicyStatus;
use reload::load_bundle;
pub use shadow::ShadowSet;
pub(crate) use snapshot::Snapshot;
use snapshot::{Writes, owned_cache};

struct Shared {
    origin: Origin,
    current: ArcSwap<Snapshot>,
    writes: Writes,
    last_error: ArcSwapOption<LoadError>,
    reloads: AtomicU64,
    reload_errors: AtomicU64,
    authorizer: Authorizer,
    clock: Arc<dyn Clock>,
    /// Where blocks are made durable, once attached.
    state: std::sync::OnceLock<Arc<dyn SharedState>>,
    /// This machine's decision and event logs, once attached.
    log: std::sync::OnceLock<Arc<dyn LocalLog>>,
    /// Records denies and obligations in the state store, once one is attached.
    decision_log: std::sync::OnceLock<DecisionLog>,
    /// What the decision log keeps beyond what it must ([`Engine::sample_allows`],
    /// [`Engine::keep_requests`]).
    record_options: crate::decision_log::RecordOptions,
    /// Sealed mode: load only sets whose `policy.seal` verifies.
    sealing: Option<Sealing>,
    /// Who hears of reloads ([`Engine::reload_events`]).
    reload_events: ReloadSubscribers,
    /// The last answer of [`Engine::entities_by_reference`], for the store version it
    /// was read from: the mutating webhook asks it for every pod.
    by_reference: Mutex<Option<ByReferenceAnswer>>,
    /// Decisions reused while their facts hold ([`Engine::decision_cache`]).
    decisions: crate::DecisionCache,
}

/// The policy engine. Cheap to clone: clones share one state.
///
/// ```
/// use probity::{Engine, Request};
///
/// let engine = Engine::from_embedded_defaults().unwrap();
/// engine.upsert_entities(&serde_json::json!([
///   {"uid": {"type": "Cluster", "id": "c"}, "attrs": {"gpusTotal": 8, "gpusAllocated": 0}, "parents": []},
///   {"uid": {"type": "Zone", "id": "z"}, "parents": [],
///    "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "c"}}, "powerDrawW": 0, "powerCeilingW": 9000}},
///   {"uid": {"type": "Node", "id": "cpu-001"}, "parents": [],
///    "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z"}}, "rack": "r1", "driverVersion": "",
///      "cudaImage": "", "gpuNode": false, "gpuCount": 0, "cpuCount": 64, "gpuMemoryMiB": 0,
///      "hottestGpuTempC": 0, "powerDrawW": 300, "powerWindowMeanW": 300}}
/// ])).unwrap();
/// let request = Request::from_json_slice(br#"{
///     "principal": "Node::\"cpu-001\"", "action": "listen", "resource": "Node::\"cpu-001\"",
///     "context": {"port": 8080, "protocol": "tcp"}
/// }"#).unwrap();
/// let decision = engine.decide(&request);
/// assert!(!decision.is_allowed());
/// assert_eq!(decision.reasons[0].policy, "security.inbound-port-beyond-baseline");
/// assert_eq!(decision.obligations[0].kind, "alert");
/// ```
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

/// Builds an [`Engine`] from a policy directory or the embedded defaults.
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    dir: Option<PathBuf>,
    schema: Option<PathBuf>,
    config: Option<PathBuf>,
    plugins: Option<PathBuf>,
    clock: Option<Arc<dyn Clock>>,
    sealing: Option<Sealing>,
}

impl EngineBuilder {
    /// Sealed mode: the engine loads a set (at build and at every reload) only if its
    /// `policy.seal` verifies under `verifier`'s pinned key, lists every file of the set
    /// with the digest of the bytes compiled, no other policy file is present, and its
    /// version is not lower than the live set's nor than the one the attached state
    /// store remembers ([`Engine::attach_state`]). Anything else is a rejected reload,
    /// located in the seal; the previous set keeps serving. See
    /// [`crate::policy_seal`]. Default: off (any valid set loads).
    pub fn sealed(mut self, verifier: Verifier) -> Self {
        self.sealing = Some(Sealing {
            verifier,
            name: self.sealing.and_then(|s| s.name),
        });
        self
    }

    /// In sealed mode, also requires the seal's name to be `name`, so that another
    /// set signed with the same key (a staging set, with its own versions) cannot
    /// stand in for this one. Default: any name at build; a reload keeps the live name.
    pub fn sealed_name(mut self, name: impl Into<String>) -> Self {
        if let Some(s) = &mut self.sealing {
            s.name = Some(name.into());
        }
        self
    }

    /// Uses `path` as the schema instead of `<dir>/probity.cedarschema`.
    pub fn schema(mut self, path: impl Into<PathBuf>) -> Self {
        self.schema = Some(path.into());
        self
    }

    /// Uses `path` as the configuration instead of `<dir>/probity.toml`.
    pub fn config(mut self, path: impl Into<PathBuf>) -> Self {
        self.config = Some(path.into());
        self
    }

    /// Uses `path` as the plugin manifest instead of `<dir>/plugins.toml` (which is
    /// optional; an explicit manifest must exist). Component paths in it are relative
    /// to the manifest's directory.
    pub fn plugins(mut self, path: impl Into<PathBuf>) -> Self {
        self.plugins = Some(path.into());
        self
    }

    /// Uses `clock` for the time of decisions, blocks and records instead of the
    /// system clock (tests, replays).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Loads and validates the set. Fails if any file is invalid.
    pub fn build(self) -> Result<Engine, LoadError> {
        let origin = match self.dir {
            None => Origin::Embedded,
            Some(dir) => Origin::Dir {
                schema: self
                    .schema
                    .unwrap_or_else(|| dir.join("probity.cedarschema")),
                config: self.config.unwrap_or_else(|| dir.join("probity.toml")),
                plugins: self.plugins,
                dir,
            },
        };
        Engine::from_origin(
            origin,
            self.clock.unwrap_or_else(|| Arc::new(SystemClock)),
            self.sealing,
        )
    }
}

impl Engine {
    /// Starts building an engine from the policies under `dir`.
    pub fn builder(dir: impl Into<PathBuf>) -> EngineBuilder {
        EngineBuilder {
            dir: Some(dir.into()),
            schema: None,
            config: None,
            plugins: None,
            clock: None,
            sealing: None,
        }
    }

    /// Starts building an engine on the default policies compiled into Probity.
    pub fn defaults() -> EngineBuilder {
        EngineBuilder {
            dir: None,
            schema: None,
            config: None,
            plugins: None,
            clock: None,
            sealing: None,
        }
    }

    /// An engine on the default policies, schema and configuration compiled into Probity.
    pub fn from_embedded_defaults() -> Result<Self, LoadError> {
        Self::defaults().build()
    }

    fn from_origin(
        origin: Origin,
        clock: Arc<dyn Clock>,
        sealing: Option<Sealing>,
    ) -> Result<Self, LoadError> {
        let bundle = Arc::new(load_bundle(&origin, sealing.as_ref(), None, None)?);
        let mut store = Store::default();
        for (uid, stored) in &bundle.settings {
            store.insert(uid.clone(), Arc::clone(stored));
        }
        let owned = Arc::new(owned_cache(&bundle, &store));
        let snapshot = Snapshot::new(bundle, store, owned, Arc::new(BTreeMap::new()));
        Ok(Self {
            shared: Arc::new(Shared {
                origin,
                current: ArcSwap::from_pointee(snapshot),
                writes: Writes::default(),
                last_error: ArcSwapOption::empty(),
                reloads: AtomicU64::new(0),
                reload_errors: AtomicU64::new(0),
                authorizer: Authorizer::new(),
                clock,
                state: std::sync::OnceLock::new(),
                log: std::sync::OnceLock::new(),
                decision_log: std::sync::OnceLock::new(),
                record_options: crate::decision_log::RecordOptions::default(),
                sealing,
                reload_events: ReloadSubscribers::default(),
                by_reference: Mutex::new(None),
                decisions: crate::DecisionCache::default(),
            }),
        })
    }

    /// The directory the engine loads from, if it is not on embedded defaults.
    pub fn policy_dir(&self) -> Option<&Path> {
        match &self.shared.origin {
            Origin::Dir { dir, .. } => Some(dir),
            Origin::Embedded => None,
        }
    }

    /// The engine's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.shared.clock
    }

    pub(crate) fn watched_paths(&self) -> Vec<PathBuf> {
        let mut paths = self.shared.origin.watched_paths();
        // Plugin components may live outside the policy directory.
        paths.extend(self.shared.current.load().bundle.plugins.paths());
        paths
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    #[test]
    fn a_write_that_panics_leaves_no_other_writer_of_its_batch_waiting() {
        let policies = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
        let engine = Engine::builder(policies).build().unwrap();
        let (started, has_started) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let (done, finished) = mpsc::channel();
        // The first writer leads and holds the queue until released.
        let e = engine.clone();
        let d = done.clone();
        std::thread::spawn(move || {
            let r = e.write(Box::new(move |_| {
                started.send(()).unwrap();
                released.recv().ok();
                Ok(0)
            }));
            d.send(("first", r.map_err(|e| e.to_string()))).unwrap();
        });
        has_started.recv().unwrap();
        // Two more queue behind it, so the next leader takes both in one batch, and one
        // of them panics. The leader (either) runs that write and panics; the other must
        // get an error, not wait for ever.
        let e = engine.clone();
        let d = done.clone();
        std::thread::spawn(move || {
            let r = e.write(Box::new(|_| panic!("a write that panics")));
            d.send(("panicking", r.map_err(|e| e.to_string()))).unwrap();
        });
        let e = engine.clone();
        let d = done.clone();
        std::thread::spawn(move || {
            let r = e.write(Box::new(|_| Ok(7)));
            d.send(("fine", r.map_err(|e| e.to_string()))).unwrap();
        });
        drop(done);
        let queued = Instant::now();
        while engine.shared.writes.state.lock().unwrap().queue.len() < 2 {
            assert!(queued.elapsed() < Duration::from_secs(30), "never queued");
            std::thread::sleep(Duration::from_millis(1));
        }
        release.send(()).unwrap();
        let first = finished.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(first, ("first", Ok(0)));
        let (_, answer) = finished
            .recv_timeout(Duration::from_secs(30))
            .expect("the batch's other writer was stranded");
        assert_eq!(
            answer,
            Err("entities rejected: the engine failed while applying this write's batch; the live snapshot did not change".to_owned())
        );
        // The leader panicked and sends nothing.
        assert_eq!(
            finished.recv_timeout(Duration::from_secs(30)),
            Err(mpsc::RecvTimeoutError::Disconnected)
        );
        // The queue still works.
        assert_eq!(engine.write(Box::new(|_| Ok(3))).unwrap(), 3);
    }
}
