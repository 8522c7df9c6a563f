//! The [`Engine`]: a policy set and an entity store behind one atomic pointer.
//!
//! Readers load the current [`Snapshot`] without locking; writers (entity updates,
//! blocks, reloads) build a new snapshot beside it and swap it in whole. A decision
//! therefore always sees one policy set with one store, never a mix, and never waits on
//! a writer. Concurrent writers are coalesced: whoever finds no write in progress
//! applies every queued change in one new snapshot (a group commit of facts).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use arc_swap::{ArcSwap, ArcSwapOption};
use cedar_policy::{Authorizer, Context, Entities, EvalResult};
use cedar_policy_core::ast::{self, EntityUID};
use serde_json::{Map, Value};

use crate::bundle::{Bundle, MessagePart, MessageTemplate, PolicyMeta, TargetPath, TargetRoot};
use crate::clock::{Clock, SystemClock};
use crate::decision::{Decision, DecisionError, Effect, Obligation, Reason};
use crate::decision_log::{self, DecisionLog, Settled};
use crate::error::{EntityError, LoadError};
use crate::facts::{ContextOwner, EntityOwner};
use crate::integrity::Verifier;
use crate::plugin::{PluginEntities, PluginInfo};
use crate::policy_seal::{self, LoadedSeal, SealInfo, Sealing};
use crate::request::{EntityUid, Request, kind};
use crate::slice::SliceSource;
use crate::source::Origin;
use crate::state::StateBackend;
use crate::store::{self, Converted, Converter, Store, Stored};
use crate::watch::{ReloadEvent, ReloadOutcome, ReloadSubscribers};

/// Most earlier blocks a block record remembers.
const MAX_BLOCK_HISTORY: usize = 32;

/// Why a node is blocked, and since when.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockRecord {
    /// What blocked it first (a policy id, an operator's note).
    pub reason: String,
    /// When it was first blocked, in Unix seconds.
    pub since: u64,
    /// Later blocks of the node while it stayed blocked, oldest first (at most 32).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<BlockEvent>,
}

/// A block of an already blocked node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockEvent {
    /// Why.
    pub reason: String,
    /// When, in Unix seconds.
    pub at: u64,
}

impl BlockRecord {
    /// A new block.
    pub fn new(reason: impl Into<String>, since: u64) -> Self {
        Self {
            reason: reason.into(),
            since,
            history: Vec::new(),
        }
    }

    /// This record after another block: the first reason and time stay, the new one
    /// joins the history.
    pub fn blocked_again(mut self, reason: impl Into<String>, at: u64) -> Self {
        if self.history.len() >= MAX_BLOCK_HISTORY {
            self.history.remove(0);
        }
        self.history.push(BlockEvent {
            reason: reason.into(),
            at,
        });
        self
    }
}

/// One consistent view: the policy set and the facts decisions read.
pub(crate) struct Snapshot {
    pub bundle: Arc<Bundle>,
    pub store: Store,
    /// The entities the engine owns, materialized once (they change only with the
    /// configuration or the server's caller list).
    pub owned: Arc<HashMap<EntityUID, Arc<ast::Entity>>>,
    pub blocked: Arc<BTreeMap<String, BlockRecord>>,
    /// The same entities as plugins see them, with their JSON cached.
    pub plugin_entities: Arc<PluginEntities>,
}

impl Snapshot {
    fn new(
        bundle: Arc<Bundle>,
        store: Store,
        owned: Arc<HashMap<EntityUID, Arc<ast::Entity>>>,
        blocked: Arc<BTreeMap<String, BlockRecord>>,
    ) -> Self {
        let plugin_entities = Arc::new(PluginEntities::new(
            store.clone(),
            Arc::clone(&blocked),
            bundle.blocklist_target(),
        ));
        Self {
            bundle,
            store,
            owned,
            blocked,
            plugin_entities,
        }
    }

    /// The slice source for a request with `extra` entities of its own.
    fn slicer<'a>(&'a self, extra: &'a HashMap<EntityUID, Arc<Stored>>) -> SliceSource<'a> {
        SliceSource {
            store: &self.store,
            owned: &self.owned,
            extra,
            blocked: &self.blocked,
            blocklist: self.bundle.blocklist.as_ref().map(|(t, a)| (t, a)),
            actions: &self.bundle.action_entities,
        }
    }

    /// Whether `id` names a blocked entity of the blocklist's type.
    fn blocked_view(&self, uid: &EntityUID) -> Option<(&smol_str::SmolStr, bool)> {
        let (ty, attr) = self.bundle.blocklist.as_ref()?;
        if uid.entity_type() != ty {
            return None;
        }
        let id: &str = uid.eid().as_ref();
        Some((attr, self.blocked.contains_key(id)))
    }
}

/// What a write works on: the next snapshot's parts.
#[derive(Clone)]
struct Working {
    bundle: Arc<Bundle>,
    store: Store,
    owned: Arc<HashMap<EntityUID, Arc<ast::Entity>>>,
    blocked: Arc<BTreeMap<String, BlockRecord>>,
    changed: bool,
}

type WriteOp = Box<dyn FnOnce(&mut Working) -> Result<usize, EntityError> + Send>;

/// Writers queue here; one of them applies the queue in one snapshot.
#[derive(Default)]
struct Writes {
    state: Mutex<WriteState>,
    done: Condvar,
}

#[derive(Default)]
struct WriteState {
    queue: Vec<(u64, WriteOp)>,
    finished: HashMap<u64, Result<usize, EntityError>>,
    next: u64,
    busy: bool,
    /// Writers waiting on `done`: with none, a commit makes no wake-up call.
    waiting: usize,
}

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
    state: std::sync::OnceLock<Arc<dyn StateBackend>>,
    /// Records denies and obligations in the state store, once one is attached.
    decision_log: std::sync::OnceLock<DecisionLog>,
    /// Sealed mode: load only sets whose `policy.seal` verifies.
    sealing: Option<Sealing>,
    /// Who hears of reloads ([`Engine::reload_events`]).
    reload_events: ReloadSubscribers,
    /// The last answer of [`Engine::entities_by_reference`], for the store version it
    /// was read from: the mutating webhook asks it for every pod.
    by_reference: Mutex<Option<ByReferenceAnswer>>,
}

struct ByReferenceAnswer {
    at: store::StoreVersion,
    type_name: String,
    attr: String,
    answer: Arc<EntitiesByReference>,
}

/// The stored entities of one type, each with the entity one of its attributes refers
/// to ([`Engine::entities_by_reference`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EntitiesByReference {
    /// The entities, in id order.
    pub uids: Vec<EntityUid>,
    /// For each of `uids`, the id of the entity its attribute refers to (`None` when it
    /// has no such reference).
    pub targets: Vec<Option<String>>,
}

impl EntitiesByReference {
    /// Whether an entity with this id is among them.
    pub fn contains_id(&self, id: &str) -> bool {
        self.uids.binary_search_by(|u| u.id().cmp(id)).is_ok()
    }
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

/// The state of the loaded policy set, for status endpoints and `probity check`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyStatus {
    /// SHA-256 over the schema, configuration and policy files of the live set.
    pub digest: String,
    /// The policy files of the live set.
    pub files: Vec<String>,
    /// Number of policies in the live set.
    pub policies: usize,
    /// When the live set was loaded, in Unix seconds.
    pub loaded_at: u64,
    /// Successful reloads since start.
    pub reloads: u64,
    /// Rejected reloads since start.
    pub reload_errors: u64,
    /// The last rejected reload's error, until a good set loads.
    pub last_error: Option<String>,
    /// Number of entities in the store (including the ones the engine owns).
    pub entities: usize,
    /// The plugins of the live set (from `plugins.toml`).
    pub plugins: Vec<PluginInfo>,
    /// The seal the live set was checked against, in sealed mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seal: Option<SealInfo>,
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
                decision_log: std::sync::OnceLock::new(),
                sealing,
                reload_events: ReloadSubscribers::default(),
                by_reference: Mutex::new(None),
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

    /// Decides one request. Never panics and never fails: problems become a deny
    /// whose `errors` say what went wrong.
    ///
    /// With a state store attached ([`Engine::attach_state`]), a decision that denies
    /// or carries obligations is recorded in its decision log before this returns; if
    /// it cannot be, the answer is a deny saying so.
    pub fn decide(&self, request: &Request) -> Decision {
        self.decide_deferred(request)
            .settle()
            .pop()
            .unwrap_or_else(|| Decision::error("no decision"))
    }

    /// Decides many requests against one policy set and store. Their records (see
    /// [`Engine::decide`]) share one durable commit.
    pub fn decide_batch(&self, requests: &[Request]) -> Vec<Decision> {
        self.decide_batch_deferred(requests).settle()
    }

    /// Decides without recording anything: for dry runs and what-if tools, whose
    /// answers are not acted on.
    pub fn decide_dry_run(&self, request: &Request) -> Decision {
        let snapshot = self.shared.current.load();
        self.decide_in(&snapshot, request)
    }

    /// The live snapshot, held.
    pub(crate) fn snapshot_now(&self) -> Arc<Snapshot> {
        self.shared.current.load_full()
    }

    /// Whether `request`'s decisions depend only on their slice: no fact from the
    /// clock, no plugin (which may look beyond it).
    ///
    /// The decision cache relies on more: for a cacheable request without entities of
    /// its own, [`Engine::prepare`] reads only the request and the policy set, so a
    /// remembered one-resource answer is served before preparing. A fact `prepare`
    /// comes to read elsewhere (the store, the blocklist, the clock for an action this
    /// does not refuse) must be refused here or keyed by the cache.
    pub(crate) fn cacheable(&self, snapshot: &Snapshot, request: &Request) -> bool {
        let action = request.action.id();
        let clocked = snapshot
            .bundle
            .origins
            .action(action)
            .is_some_and(|f| f.clock_attrs().next().is_some());
        !clocked && snapshot.bundle.plugins.for_action(action).is_empty()
    }

    /// [`Engine::decide`] without waiting for the record: the caller must
    /// [`Settled::settle`] before acknowledging the decision. For async servers, which
    /// wait for the commit off their event loop.
    pub fn decide_deferred(&self, request: &Request) -> Settled {
        let snapshot = self.shared.current.load();
        let decision = self.decide_in(&snapshot, request);
        self.record(&snapshot, &[request], vec![decision])
    }

    /// [`Engine::decide_deferred`] under a budget for recorded decisions: when the
    /// decision must be recorded (it denies or carries obligations, and a state store
    /// is attached) and `admit` says no, nothing is recorded and `None` is returned,
    /// so the caller answers "too many requests" rather than a deny it could not
    /// record. `admit` is asked only for decisions that would be recorded.
    pub fn decide_deferred_within(
        &self,
        request: &Request,
        admit: impl FnOnce() -> bool,
    ) -> Option<Settled> {
        let snapshot = self.shared.current.load();
        let decision = self.decide_in(&snapshot, request);
        if self.shared.decision_log.get().is_some()
            && decision_log::needs_record(&decision)
            && !admit()
        {
            return None;
        }
        Some(self.record(&snapshot, &[request], vec![decision]))
    }

    /// [`Engine::decide_batch_deferred`] under a budget: `admit` is told how many of the
    /// batch's decisions would be recorded, and when it says no, nothing is recorded
    /// and `None` is returned.
    pub fn decide_batch_deferred_within(
        &self,
        requests: &[Request],
        admit: impl FnOnce(usize) -> bool,
    ) -> Option<Settled> {
        let snapshot = self.shared.current.load();
        let decisions: Vec<Decision> = requests
            .iter()
            .map(|r| self.decide_in(&snapshot, r))
            .collect();
        let recorded = decisions
            .iter()
            .filter(|d| decision_log::needs_record(d))
            .count();
        if self.shared.decision_log.get().is_some() && recorded > 0 && !admit(recorded) {
            return None;
        }
        let asked: Vec<&Request> = requests.iter().collect();
        Some(self.record(&snapshot, &asked, decisions))
    }

    /// Whether deciding `request` runs WebAssembly plugins (whose deadlines can reach
    /// seconds), so that an async server decides it off its event loop.
    pub fn runs_plugins(&self, request: &Request) -> bool {
        !self
            .shared
            .current
            .load()
            .bundle
            .plugins
            .for_action(request.action.id())
            .is_empty()
    }

    /// [`Engine::decide_batch`] without waiting for the records.
    pub fn decide_batch_deferred(&self, requests: &[Request]) -> Settled {
        let snapshot = self.shared.current.load();
        let decisions = requests
            .iter()
            .map(|r| self.decide_in(&snapshot, r))
            .collect();
        let asked: Vec<&Request> = requests.iter().collect();
        self.record(&snapshot, &asked, decisions)
    }

    fn record(&self, snapshot: &Snapshot, asked: &[&Request], decisions: Vec<Decision>) -> Settled {
        decision_log::submit(
            self.shared.decision_log.get(),
            &snapshot.bundle.digest,
            self.shared.clock.now_unix_ms(),
            asked,
            decisions,
        )
    }

    /// Whether `request` carries facts only an authorized reporter may supply (an
    /// owned context attribute, or an action only reporters may ask), so that a server
    /// knows to authorize its caller before marking it
    /// [`Request::as_fact_reporter`].
    pub fn needs_reporter(&self, request: &Request) -> bool {
        let snapshot = self.shared.current.load();
        let Some(facts) = snapshot.bundle.origins.action(request.action.id()) else {
            return false;
        };
        facts.reporter_only
            || request.context.as_ref().is_some_and(|c| {
                facts.context.iter().any(|(attr, owner)| {
                    c.contains_key(attr.as_str())
                        && matches!(owner, ContextOwner::Reporter | ContextOwner::Clock)
                })
            })
    }

    /// The context a decision sees: the request's, checked against what the engine
    /// owns, with the clock's attributes filled.
    fn effective_context(
        &self,
        snapshot: &Snapshot,
        request: &Request,
    ) -> Result<Option<Map<String, Value>>, String> {
        let action = request.action.id();
        let Some(facts) = snapshot.bundle.origins.action(action) else {
            return Ok(request.context.clone());
        };
        if facts.reporter_only && !request.reporter {
            return Err(format!(
                "only a caller authorized to report facts may ask `{action}`: its context is facts the engine owns"
            ));
        }
        let mut context = request.context.clone().unwrap_or_default();
        if !request.reporter {
            for (attr, owner) in &facts.context {
                if context.contains_key(attr.as_str()) {
                    let source = match owner {
                        ContextOwner::Clock => "the engine's clock",
                        ContextOwner::Reporter => "an authorized reporter",
                    };
                    return Err(format!(
                        "context.{attr} is a fact the engine owns (it comes from {source}); this caller may not supply it"
                    ));
                }
            }
        }
        for attr in facts.clock_attrs() {
            if !context.contains_key(attr.as_str()) {
                context.insert(attr.to_string(), Value::from(self.shared.clock.now_unix()));
            }
        }
        Ok(if context.is_empty() {
            None
        } else {
            Some(context)
        })
    }

    /// Converts and checks a request's own entities: they only add what the store
    /// does not hold, and never an entity or attribute the engine owns.
    fn request_entities(
        snapshot: &Snapshot,
        items: &[Value],
    ) -> Result<HashMap<EntityUID, Arc<Stored>>, String> {
        let bundle = &snapshot.bundle;
        let converter = bundle.converter();
        let mut out: HashMap<EntityUID, Arc<Stored>> = HashMap::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let at = |uid: &EntityUID| format!("request entities[{i}] ({uid})");
            // Ownership first: an owned entity is refused for what it is, not for how
            // it is written.
            if let Some(uid) = item.get("uid").and_then(|u| store::parse_uid(u).ok())
                && let Some(owner) = bundle.origins.owner_of(&uid.entity_type().to_string())
            {
                return Err(format!(
                    "{}: {} entities come from the engine ({}), never from a request",
                    at(&uid),
                    uid.entity_type(),
                    owner.as_str()
                ));
            }
            let c = converter.entity(item).map_err(|(uid, e)| match uid {
                Some(u) => format!("request entities[{i}] ({u}): {e}"),
                None => format!("request entities[{i}]: {e}"),
            })?;
            if let Some(owner) = bundle.origins.owner_of(&c.uid.entity_type().to_string()) {
                return Err(format!(
                    "{}: {} entities come from the engine ({}), never from a request",
                    at(&c.uid),
                    c.uid.entity_type(),
                    owner.as_str()
                ));
            }
            if snapshot.store.contains(&c.uid) {
                return Err(format!(
                    "{}: the store holds this entity, and a request may only add facts the store does not hold",
                    at(&c.uid)
                ));
            }
            check_claimed_block(snapshot, &c).map_err(|e| format!("{}: {e}", at(&c.uid)))?;
            out.insert(c.uid, Arc::new(c.stored));
        }
        Ok(out)
    }

    fn decide_in(&self, snapshot: &Snapshot, request: &Request) -> Decision {
        match self.prepare(snapshot, request) {
            Ok(prepared) => {
                self.decide_prepared(snapshot, request, &prepared, &request.resource, None)
            }
            Err(denied) => denied,
        }
    }

    /// What every decision of one request shares, whatever its resource: the
    /// effective context and the request's own entities, checked. Without request
    /// entities it reads only the request, the policy set and, for clocked actions,
    /// the clock (see [`Engine::cacheable`], which the decision cache relies on).
    pub(crate) fn prepare(
        &self,
        snapshot: &Snapshot,
        request: &Request,
    ) -> Result<Prepared, Decision> {
        let schema = &snapshot.bundle.schema;
        let context_json = self
            .effective_context(snapshot, request)
            .map_err(Decision::error)?;
        let context = match &context_json {
            None => Context::empty(),
            Some(map) => Context::from_json_value(
                Value::Object(map.clone()),
                Some((schema, &request.action.0)),
            )
            .map_err(|e| Decision::error(format!("invalid context: {e}")))?,
        };
        let extra = if request.entities.is_empty() {
            HashMap::new()
        } else {
            Self::request_entities(snapshot, &request.entities).map_err(Decision::error)?
        };
        Ok(Prepared {
            context_json,
            context,
            extra,
        })
    }

    /// Decides `request` with `resource` in place of its own. With `deps`, the stored
    /// entities the decision read are pushed there (for [`DecisionCache`]).
    pub(crate) fn decide_prepared(
        &self,
        snapshot: &Snapshot,
        request: &Request,
        prepared: &Prepared,
        resource_uid: &EntityUid,
        deps: Option<&mut Vec<crate::slice::Dependency>>,
    ) -> Decision {
        let bundle = &snapshot.bundle;
        let schema = &bundle.schema;
        let context_json = &prepared.context_json;
        let extra = &prepared.extra;
        let cedar_request = match cedar_policy::Request::new(
            request.principal.0.clone(),
            request.action.0.clone(),
            resource_uid.0.clone(),
            prepared.context.clone(),
            Some(schema),
        ) {
            Ok(r) => r,
            Err(e) => return Decision::error(format!("invalid request: {e}")),
        };
        let principal: &EntityUID = request.principal.0.as_ref();
        let resource: &EntityUID = resource_uid.0.as_ref();
        let mut roots: Vec<EntityUID> = vec![principal.clone(), resource.clone()];
        if let Some(c) = &context_json {
            for v in c.values() {
                context_refs(v, &mut roots, 0);
            }
        }
        roots.extend(bundle.literals_for(&request.action.0).iter().cloned());
        #[cfg(test)]
        let entities = if crate::slice::reference::whole_store() {
            Ok(crate::slice::reference::whole(
                &snapshot.slicer(extra),
                roots,
            ))
        } else {
            snapshot.slicer(extra).cut(roots, deps)
        };
        #[cfg(not(test))]
        let entities = snapshot.slicer(extra).cut(roots, deps);
        let entities = match entities {
            Ok(e) => e,
            Err(e) => return Decision::error(e.to_string()),
        };
        let response = self.shared.authorizer.is_authorized(
            &cedar_request,
            bundle.policies_for(&request.action.0),
            &entities,
        );
        let mut errors = Vec::new();
        let mut failed_forbids = Vec::new();
        for err in response.diagnostics().errors() {
            let cedar_policy::AuthorizationError::PolicyEvaluationError(err) = err;
            let meta = bundle.meta.get(err.policy_id());
            if let Some(m) = meta.filter(|m| m.forbid) {
                failed_forbids.push(Arc::clone(m));
            }
            errors.push(DecisionError {
                policy: meta.map(|m| m.id.clone()),
                message: err.inner().to_string(),
            });
        }
        let fired = response
            .diagnostics()
            .reason()
            .filter_map(|id| bundle.meta.get(id).cloned());
        // A forbid that could not be evaluated counts as fired: deciding fails closed.
        // It gives a reason but no obligation, since its condition was never
        // established; and only when no forbid fired outright (then the failures are
        // errors, not the explanation of the deny).
        let (decision, determining): (Effect, Vec<(Arc<PolicyMeta>, bool)>) =
            if response.decision() == cedar_policy::Decision::Allow && failed_forbids.is_empty() {
                (Effect::Allow, fired.map(|m| (m, true)).collect())
            } else {
                let forbids: Vec<_> = fired.filter(|m| m.forbid).map(|m| (m, true)).collect();
                if forbids.is_empty() {
                    (
                        Effect::Deny,
                        failed_forbids.into_iter().map(|m| (m, false)).collect(),
                    )
                } else {
                    (Effect::Deny, forbids)
                }
            };
        // Cedar reports the determining policies as a set; the most severe first, then
        // by id, so that the same question always gets the same answer.
        let mut determining = determining;
        determining
            .sort_by(|(a, _), (b, _)| b.severity.cmp(&a.severity).then_with(|| a.id.cmp(&b.id)));
        let facts = Facts {
            principal: &request.principal.0,
            resource: &resource_uid.0,
            entities: &entities,
            context: context_json.as_ref(),
        };
        let obligations = determining
            .iter()
            .filter(|(_, fired)| *fired)
            .filter_map(|(m, _)| {
                let spec = m.obligation.as_ref()?;
                Some(Obligation {
                    kind: spec.kind.clone(),
                    target: spec.target.as_ref().and_then(|t| facts.target(t)),
                    parameters: spec
                        .parameters
                        .iter()
                        .map(|(k, v)| (k.clone(), facts.render(v)))
                        .collect(),
                    policy: m.id.clone(),
                })
            })
            .collect();
        let score = if decision == Effect::Allow {
            determining
                .iter()
                .filter(|(m, fired)| *fired && !m.forbid)
                .fold(0i64, |sum, (m, _)| sum.saturating_add(m.score))
        } else {
            0
        };
        let cedar = Decision {
            score,
            unrecorded: false,
            decision,
            reasons: determining
                .iter()
                .map(|(m, _)| Reason {
                    policy: m.id.clone(),
                    message: facts.render(&m.message),
                    severity: m.severity,
                })
                .collect(),
            obligations,
            errors,
        };
        if bundle.plugins.is_empty() {
            return cedar;
        }
        match bundle.plugins.for_action(request.action.id()) {
            [] => cedar,
            plugins => {
                let view = if extra.is_empty() {
                    Arc::clone(&snapshot.plugin_entities)
                } else {
                    // Request-scoped entities get a cache of their own for this call.
                    Arc::new(PluginEntities::new(
                        snapshot.store.clone(),
                        Arc::clone(&snapshot.blocked),
                        bundle.blocklist_target(),
                    ))
                };
                // Plugins see the request as decided, with this resource.
                let asked;
                let request = if &request.resource == resource_uid {
                    request
                } else {
                    asked = Request {
                        resource: resource_uid.clone(),
                        ..request.clone()
                    };
                    &asked
                };
                crate::plugin::combine(
                    plugins,
                    request,
                    context_json.as_ref(),
                    &view,
                    &bundle.conventions,
                    cedar,
                )
            }
        }
    }

    /// Runs one plugin of the live set alone on `request`, as `decide` would call it,
    /// without Cedar: `None` if no plugin has that name. For benchmarks and debugging;
    /// not a stable API.
    #[doc(hidden)]
    pub fn decide_plugin_only(&self, name: &str, request: &Request) -> Option<Decision> {
        let snapshot = self.shared.current.load();
        let plugin = snapshot.bundle.plugins.by_name(name)?;
        let neutral = Decision {
            decision: Effect::Allow,
            reasons: Vec::new(),
            obligations: Vec::new(),
            errors: Vec::new(),
            score: 0,
            unrecorded: false,
        };
        Some(crate::plugin::combine(
            std::slice::from_ref(plugin),
            request,
            request.context.as_ref(),
            &snapshot.plugin_entities,
            &snapshot.bundle.conventions,
            neutral,
        ))
    }

    /// Calls one plugin's `describe` in a fresh sandbox: the fixed cost of a call
    /// (store, instantiation). For benchmarks; not a stable API.
    #[doc(hidden)]
    pub fn describe_plugin(&self, name: &str) -> Option<bool> {
        let snapshot = self.shared.current.load();
        Some(snapshot.bundle.plugins.by_name(name)?.describe_ok())
    }

    /// Applies `op` with every other queued write in one new snapshot.
    fn write(&self, op: WriteOp) -> Result<usize, EntityError> {
        let writes = &self.shared.writes;
        let mut st = writes.state.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = st.next;
        st.next = st.next.wrapping_add(1);
        st.queue.push((ticket, op));
        loop {
            if let Some(result) = st.finished.remove(&ticket) {
                return result;
            }
            if st.busy {
                st.waiting += 1;
                st = writes.done.wait(st).unwrap_or_else(PoisonError::into_inner);
                st.waiting -= 1;
                continue;
            }
            st.busy = true;
            let batch = std::mem::take(&mut st.queue);
            drop(st);
            let results = {
                // Clears `busy` even if a write panics, and then answers the batch's other
                // writers, so none is stranded or left leading empty batches.
                let others = batch.iter().map(|(t, _)| *t).filter(|t| *t != ticket);
                let _busy = BusyGuard {
                    writes,
                    batch: others.collect(),
                };
                self.apply(batch)
            };
            st = writes.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.finished.extend(results);
            if st.waiting > 0 {
                writes.done.notify_all();
            }
        }
    }

    fn apply(&self, batch: Vec<(u64, WriteOp)>) -> Vec<(u64, Result<usize, EntityError>)> {
        let current = self.shared.current.load_full();
        let mut w = Working {
            bundle: Arc::clone(&current.bundle),
            store: current.store.clone(),
            owned: Arc::clone(&current.owned),
            blocked: Arc::clone(&current.blocked),
            changed: false,
        };
        let mut results = Vec::with_capacity(batch.len());
        for (ticket, op) in batch {
            let before = w.clone();
            let result = op(&mut w);
            if result.is_err() {
                // A refused write changes nothing, whatever it did before failing.
                w = before;
            }
            results.push((ticket, result));
        }
        if w.changed {
            self.shared.current.store(Arc::new(Snapshot::new(
                w.bundle, w.store, w.owned, w.blocked,
            )));
        }
        results
    }

    /// Adds or replaces entities (Cedar entity JSON: an array of
    /// `{"uid": .., "attrs": .., "parents": ..}`), validated against the schema.
    /// All or nothing: on error the store is unchanged. Entities the engine owns
    /// (see [`Engine::owned_types`]) are refused; the blocklist attribute (`blocked`)
    /// may be omitted, and if given must agree with the blocklist.
    pub fn upsert_entities(&self, json: &Value) -> Result<usize, EntityError> {
        let Value::Array(items) = json else {
            return Err(EntityError::Shape {
                found: kind(json).into(),
            });
        };
        self.upsert_items(items)
    }

    fn upsert_items(&self, items: &[Value]) -> Result<usize, EntityError> {
        // Converting is the dear part and runs outside the write queue; if a reload
        // changes the schema meanwhile, the write converts again.
        loop {
            let snapshot = self.shared.current.load_full();
            let bundle = Arc::clone(&snapshot.bundle);
            let converted = convert_all(&bundle, items)?;
            let result = self.write(Box::new(move |w: &mut Working| {
                if !Arc::ptr_eq(&w.bundle, &bundle) {
                    return Err(EntityError::SchemaChanged);
                }
                apply_upsert(w, converted)
            }));
            match result {
                Err(EntityError::SchemaChanged) => continue,
                other => return other,
            }
        }
    }

    /// Reads an entity JSON array from `reader` and upserts it, converting each entity
    /// as it is read (the whole document is never held as a JSON tree). All or
    /// nothing, like [`Engine::upsert_entities`].
    pub fn upsert_entities_from_reader(
        &self,
        reader: impl std::io::Read,
    ) -> Result<usize, EntityError> {
        let snapshot = self.shared.current.load_full();
        let bundle = Arc::clone(&snapshot.bundle);
        let converted = stream_convert(&bundle, reader)?;
        let count = converted.len();
        let result = self.write(Box::new(move |w: &mut Working| {
            if !Arc::ptr_eq(&w.bundle, &bundle) {
                return Err(EntityError::SchemaChanged);
            }
            apply_upsert(w, converted)
        }));
        match result {
            Err(EntityError::SchemaChanged) => Err(EntityError::Invalid {
                detail: "the policy set was reloaded while the entities were read; read them again"
                    .into(),
            }),
            other => other.map(|_| count),
        }
    }

    /// Removes entities by uid; unknown uids are ignored.
    pub fn remove_entities(&self, uids: &[EntityUid]) -> Result<(), EntityError> {
        let uids: Vec<EntityUID> = uids.iter().map(|u| u.0.as_ref().clone()).collect();
        self.write(Box::new(move |w: &mut Working| {
            for uid in &uids {
                if let Some(owner) = w.bundle.origins.owner_of(&uid.entity_type().to_string()) {
                    return Err(EntityError::Reserved {
                        uid: uid.to_string(),
                        owner: owner.as_str(),
                    });
                }
            }
            for uid in &uids {
                w.changed |= w.store.remove(uid);
            }
            Ok(uids.len())
        }))
        .map(|_| ())
    }

    /// Replaces every stored entity of the types `owner` supplies with `json`: the
    /// server registers its API callers, groups and endpoints this way
    /// ([`EntityOwner::Api`]). The configuration's entities come from `probity.toml`
    /// only and are refused here.
    pub fn replace_owned_entities(
        &self,
        owner: EntityOwner,
        json: &Value,
    ) -> Result<usize, EntityError> {
        if owner == EntityOwner::Config {
            return Err(EntityError::Invalid {
                detail: "configuration entities come from probity.toml".into(),
            });
        }
        let Value::Array(items) = json else {
            return Err(EntityError::Shape {
                found: kind(json).into(),
            });
        };
        loop {
            let snapshot = self.shared.current.load_full();
            let bundle = Arc::clone(&snapshot.bundle);
            let converter = bundle.converter();
            let mut converted = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let c = converter
                    .entity(item)
                    .map_err(|(uid, e)| rejected(i, uid, e))?;
                if bundle.origins.owner_of(&c.uid.entity_type().to_string()) != Some(owner) {
                    return Err(rejected(
                        i,
                        Some(c.uid.to_string()),
                        format!(
                            "{} entities are not supplied by the {} owner",
                            c.uid.entity_type(),
                            owner.as_str()
                        ),
                    ));
                }
                converted.push(c);
            }
            let count = converted.len();
            let result = self.write(Box::new(move |w: &mut Working| {
                if !Arc::ptr_eq(&w.bundle, &bundle) {
                    return Err(EntityError::SchemaChanged);
                }
                let stale: Vec<EntityUID> = w
                    .store
                    .iter()
                    .filter(|(u, _)| {
                        w.bundle.origins.owner_of(&u.entity_type().to_string()) == Some(owner)
                    })
                    .map(|(u, _)| u.clone())
                    .collect();
                for u in &stale {
                    w.store.remove(u);
                }
                for c in converted {
                    w.store.insert(c.uid, Arc::new(c.stored));
                }
                w.owned = Arc::new(owned_cache(&w.bundle, &w.store));
                w.changed = true;
                Ok(count)
            }));
            match result {
                Err(EntityError::SchemaChanged) => continue,
                other => return other,
            }
        }
    }

    /// The entity types the engine owns, with who supplies them.
    pub fn owned_types(&self) -> BTreeMap<EntityOwner, std::collections::BTreeSet<String>> {
        self.shared
            .current
            .load()
            .bundle
            .origins
            .owned_types_by_owner()
    }

    /// One entity, as Cedar entity JSON.
    pub fn entity(&self, uid: &EntityUid) -> Option<Value> {
        let current = self.shared.current.load();
        let uid: &EntityUID = uid.0.as_ref();
        let stored = current.store.get(uid)?;
        Some(store::to_json(uid, stored, current.blocked_view(uid)))
    }

    /// Every stored entity of type `type_name` (all types if `None`), as Cedar entity JSON,
    /// sorted by uid. The entities the engine owns (`Settings`, `GpuModel`, ...) are included.
    pub fn entities_json(&self, type_name: Option<&str>) -> Vec<Value> {
        let current = self.shared.current.load();
        let json = |(uid, stored): (EntityUID, &Arc<Stored>)| {
            store::to_json(&uid, stored, current.blocked_view(&uid))
        };
        match type_name {
            None => current.store.iter().map(json).collect(),
            Some(t) => match store::entity_type(t) {
                Some(ty) => current.store.of_type(&ty).map(json).collect(),
                None => Vec::new(),
            },
        }
    }

    /// The stored entities of type `type_name`, in id order, each with the id of the
    /// entity its attribute `attr` refers to: how a host groups resources (nodes by
    /// zone) without materializing them. The answer is shared until the store changes.
    pub fn entities_by_reference(&self, type_name: &str, attr: &str) -> Arc<EntitiesByReference> {
        let current = self.shared.current.load();
        let at = current.store.version();
        let mut last = self
            .shared
            .by_reference
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = last
            .as_ref()
            .filter(|k| k.at == at && k.type_name == type_name && k.attr == attr)
        {
            return Arc::clone(&known.answer);
        }
        let (Some(ty), Some(name)) = (store::entity_type(type_name), store::AttrId::of(attr))
        else {
            return Arc::default();
        };
        let mut answer = EntitiesByReference::default();
        for (uid, stored) in current.store.of_type(&ty) {
            let target =
                stored
                    .attrs
                    .iter()
                    .find(|(id, _)| *id == name)
                    .and_then(|(_, v)| match &v.value {
                        cedar_policy_core::ast::ValueKind::Lit(
                            cedar_policy_core::ast::Literal::EntityUID(u),
                        ) => Some(<str as ToOwned>::to_owned(u.eid().as_ref())),
                        _ => None,
                    });
            answer
                .uids
                .push(EntityUid(cedar_policy::EntityUid::from(uid)));
            answer.targets.push(target);
        }
        let answer = Arc::new(answer);
        *last = Some(ByReferenceAnswer {
            at,
            type_name: type_name.to_owned(),
            attr: attr.to_owned(),
            answer: Arc::clone(&answer),
        });
        answer
    }

    /// Whether the store holds `uid` (without materializing it).
    pub fn contains_entity(&self, uid: &EntityUid) -> bool {
        let uid: &EntityUID = uid.0.as_ref();
        self.shared.current.load().store.contains(uid)
    }

    /// Number of entities in the store.
    pub fn entity_count(&self) -> usize {
        self.shared.current.load().store.len()
    }

    /// Makes blocks durable in `state`: the nodes it holds as blocked are blocked in the
    /// engine now, and every later block and unblock is written there first. From now
    /// on, decisions that deny or carry obligations are recorded in its decision log
    /// ([`StateBackend::decisions`]) before they are returned. Attach once; a second call
    /// is refused.
    ///
    /// In sealed mode ([`EngineBuilder::sealed`]) the live set's seal version is checked
    /// against the one the store remembers first, and remembered: a set older than one
    /// this store saw loaded is refused ([`crate::state::StateError::Rollback`]) and
    /// nothing is attached.
    ///
    /// A shared backend ([`StateBackend::is_shared`], etcd) is followed from then on:
    /// every change it reports ([`StateBackend::changes`]: blocks and unblocks, this
    /// engine's own included, and node facts) is applied to the snapshot in the
    /// backend's order, on a thread of its own.
    pub fn attach_state(&self, state: Arc<dyn StateBackend>) -> Result<(), EntityError> {
        if let Some(seal) = self.shared.current.load().bundle.seal.clone() {
            let id = seal.seal.registry_id();
            state
                .accept(&id, seal.seal.version(), &seal.digest, &seal.encoded)
                .map_err(EntityError::State)?;
        }
        let mut blocked = state.blocked_nodes().map_err(EntityError::State)?;
        // Blocks of an earlier run that never reached a shared store are in force.
        blocked.extend(state.unshared_blocks());
        // The log starts before the store counts as attached, so no decision made with
        // the store attached goes unrecorded; a losing second call drops (and joins)
        // its own log.
        let log = DecisionLog::start(Arc::clone(&state)).map_err(EntityError::DecisionLog)?;
        if self.shared.decision_log.set(log).is_err()
            || self.shared.state.set(Arc::clone(&state)).is_err()
        {
            return Err(EntityError::StateAlreadyAttached);
        }
        let changes = state.changes();
        let durable = Arc::clone(&state);
        self.write(Box::new(move |w: &mut Working| {
            // Blocks made before the store was attached become durable too, so memory
            // and the store agree from here on.
            let on_disk: std::collections::BTreeSet<&str> =
                blocked.iter().map(|b| b.node.as_str()).collect();
            for (node, record) in w.blocked.iter() {
                if !on_disk.contains(node.as_str()) {
                    durable
                        .put_block(node, record)
                        .map_err(EntityError::State)?;
                }
            }
            let mut map = BTreeMap::clone(&w.blocked);
            for node in blocked {
                map.insert(node.node.clone(), node.record);
            }
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(0)
        }))?;
        if let Some(rx) = changes {
            self.follow(rx).map_err(EntityError::DecisionLog)?;
        }
        Ok(())
    }

    /// Applies the changes a shared backend reports, batch by batch in its order, until
    /// the backend or the engine goes away.
    fn follow(
        &self,
        rx: std::sync::mpsc::Receiver<crate::state::ChangeBatch>,
    ) -> std::io::Result<()> {
        let shared = Arc::downgrade(&self.shared);
        std::thread::Builder::new()
            .name("probity-state-changes".into())
            .spawn(move || {
                while let Ok(batch) = rx.recv() {
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    Engine { shared }.apply_changes(batch);
                }
            })
            .map(|_| ())
    }

    /// Applies one batch: its blocklist changes in one snapshot write (so decisions see
    /// the batch whole), then the last word on each node's facts; then tells the backend
    /// the batch is applied, which releases writers waiting to read their own writes.
    fn apply_changes(&self, mut batch: crate::state::ChangeBatch) {
        use crate::state::StateChange;
        let mut blocklist = Vec::new();
        // The last change per node wins: facts published then expired are gone.
        let mut facts: Vec<(String, Option<crate::state::NodeFacts>)> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        for change in std::mem::take(&mut batch.changes) {
            let (node, value) = match change {
                StateChange::Facts(f) => (f.node.clone(), Some(f)),
                StateChange::FactsGone(node) => (node, None),
                other => {
                    blocklist.push(other);
                    continue;
                }
            };
            match at.get(&node) {
                Some(&i) => {
                    if let Some(slot) = facts.get_mut(i) {
                        slot.1 = value;
                    }
                }
                None => {
                    at.insert(node.clone(), facts.len());
                    facts.push((node, value));
                }
            }
        }
        let mut problems = Vec::new();
        if !blocklist.is_empty() {
            let state = self.shared.state.get().cloned();
            let result = self.write(Box::new(move |w: &mut Working| {
                let mut map = BTreeMap::clone(&w.blocked);
                for change in blocklist {
                    match change {
                        StateChange::Blocked(b) => {
                            map.insert(b.node, b.record);
                        }
                        StateChange::Unblocked(node) => {
                            map.remove(&node);
                        }
                        StateChange::Resync(all) => {
                            map = all.into_iter().map(|b| (b.node, b.record)).collect();
                        }
                        StateChange::Facts(_) | StateChange::FactsGone(_) => {}
                    }
                }
                // A block not yet shared stays in force whatever the shared list says.
                // Read here, inside the write, so a block queued meanwhile is kept.
                for b in state.iter().flat_map(|s| s.unshared_blocks()) {
                    map.entry(b.node).or_insert(b.record);
                }
                w.blocked = Arc::new(map);
                w.changed = true;
                Ok(1)
            }));
            if let Err(e) = result {
                problems.push(format!("the blocklist: {e}"));
            }
        }
        if !facts.is_empty() {
            self.apply_facts(facts, &mut problems);
        }
        for p in problems {
            // The shared state is still right; this process's view of it lags until
            // the next change or resync. Say so where it is seen.
            eprintln!("probity: a change from the shared state could not be applied to {p}");
        }
        batch.acknowledge();
    }

    /// Upserts the nodes' published facts (one write for all of them, or node by node
    /// if one is refused, so one agent's bad facts hold back no other node's) and marks
    /// the nodes whose facts are gone.
    fn apply_facts(
        &self,
        facts: Vec<(String, Option<crate::state::NodeFacts>)>,
        problems: &mut Vec<String>,
    ) {
        let node_type = self
            .shared
            .current
            .load()
            .bundle
            .blocklist
            .as_ref()
            .map(|(t, a)| (t.clone(), a.clone()));
        let mut published: Vec<(String, Vec<Value>)> = Vec::new();
        for (node, value) in facts {
            match value {
                Some(f) => match f.entities {
                    Value::Array(mut items) => {
                        // The blocklist owns `blocked`: an agent's claim is dropped, not
                        // allowed to hold back the node's other facts.
                        if let Some((ty, attr)) = &node_type {
                            for item in &mut items {
                                let of_type = item
                                    .get("uid")
                                    .and_then(|u| store::parse_uid(u).ok())
                                    .is_some_and(|u| u.entity_type() == ty);
                                if of_type
                                    && let Some(attrs) =
                                        item.get_mut("attrs").and_then(Value::as_object_mut)
                                {
                                    attrs.remove(attr.as_str());
                                }
                            }
                        }
                        published.push((node, items));
                    }
                    _ => problems.push(format!("the facts of {node}: not a JSON array")),
                },
                None => {
                    if let Err(e) = self.mark_facts_gone(&node) {
                        problems.push(format!("the expiry of {node}'s facts: {e}"));
                    }
                }
            }
        }
        if published.is_empty() {
            return;
        }
        let all: Vec<Value> = published
            .iter()
            .flat_map(|(_, items)| items.iter().cloned())
            .collect();
        if self.upsert_items(&all).is_err() {
            for (node, items) in &published {
                if let Err(e) = self.upsert_items(items) {
                    problems.push(format!("the facts of {node}: {e}"));
                }
            }
        }
    }

    /// A node's published facts expired (its agent stopped renewing them): what the
    /// store holds about it is no longer current. Unknown is a finding, so the node
    /// stays, with [`STALE_FACTS_SOURCE`](crate::state::STALE_FACTS_SOURCE) added to its `unreadable` sources: the
    /// policies then treat its telemetry as unreadable (`thermal.telemetry-unreadable`
    /// denies `comply` and `schedule`, with an alert), and every other rule still sees
    /// the node (its zone, its block). Removing it instead would make it merely absent,
    /// which admission can be configured to let through. A policy set whose node type
    /// has no `unreadable` attribute gets the node removed. Fresh facts replace the mark.
    fn mark_facts_gone(&self, node: &str) -> Result<(), EntityError> {
        let snapshot = self.shared.current.load_full();
        let Some((ty, attr)) = snapshot.bundle.blocklist.clone() else {
            return Ok(());
        };
        let uid = EntityUID::from_components(ty, ast::Eid::new(node), None);
        let Some(stored) = snapshot.store.get(&uid) else {
            // Nothing is known about it: nothing claims to be current.
            return Ok(());
        };
        let mut json = store::to_json(&uid, stored, None);
        if let Some(attrs) = json.get_mut("attrs").and_then(Value::as_object_mut) {
            attrs.remove(attr.as_str());
            let mut sources = match attrs.get("unreadable") {
                Some(Value::Array(a)) => a.clone(),
                _ => Vec::new(),
            };
            if !sources
                .iter()
                .any(|s| s == crate::state::STALE_FACTS_SOURCE)
            {
                sources.push(Value::from(crate::state::STALE_FACTS_SOURCE));
            }
            attrs.insert("unreadable".into(), Value::Array(sources));
        }
        match self.upsert_items(std::slice::from_ref(&json)) {
            Ok(_) => Ok(()),
            Err(_) => self.remove_entities(&[EntityUid(uid.into())]),
        }
    }

    /// The attached state store, if any.
    pub fn state(&self) -> Option<&Arc<dyn StateBackend>> {
        self.shared.state.get()
    }

    /// The attached store, if it is shared between processes.
    fn shared_state(&self) -> Option<Arc<dyn StateBackend>> {
        self.shared.state.get().filter(|s| s.is_shared()).cloned()
    }

    /// Blocks a node: every decision about it is denied (the policies see its
    /// `blocked` attribute, even before any fact about it arrived), and only
    /// [`Engine::unblock_node`] lifts it. Blocking a blocked node keeps the first
    /// reason and time and adds this one to the record's history. With a state store
    /// attached, the block is durable before it takes effect in memory, and both
    /// happen in one write, so memory never disagrees with the store.
    ///
    /// With a shared store (etcd), the block is written there and takes effect here
    /// when this engine's watch applies it, in the store's order with every other
    /// process's writes; the call waits for that (the backend's read-your-writes bound,
    /// 5 s by default). If the write fails, nothing changes here and the error is
    /// returned. If the write lands but the watch lags past the bound, the block takes
    /// effect here at once (it is in the store; the watch delivers it again, in order).
    pub fn block_node(&self, node_id: &str, reason: &str) -> Result<(), EntityError> {
        validate_node_id(node_id)?;
        if let Some(state) = self.shared_state() {
            let record = self.block_record(node_id, reason);
            let revision = state
                .put_block_at(node_id, &record)
                .map_err(EntityError::State)?;
            return match revision.map(|r| state.await_applied(r)) {
                Some(Ok(())) => Ok(()),
                Some(Err(crate::state::StateError::NotYetApplied { .. })) | None => {
                    self.set_blocked(node_id, Some(record))
                }
                Some(Err(e)) => Err(EntityError::State(e)),
            };
        }
        let node = node_id.to_owned();
        let reason = reason.to_owned();
        let state = self.shared.state.get().cloned();
        let now = u64::try_from(self.shared.clock.now_unix()).unwrap_or(0);
        self.write(Box::new(move |w: &mut Working| {
            let record = match w.blocked.get(&node) {
                Some(existing) => existing.clone().blocked_again(reason, now),
                None => BlockRecord::new(reason, now),
            };
            if let Some(state) = &state {
                state
                    .put_block(&node, &record)
                    .map_err(EntityError::State)?;
            }
            let mut map = BTreeMap::clone(&w.blocked);
            map.insert(node, record);
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(1)
        }))
        .map(|_| ())
    }

    /// Blocks a node here at once, whatever the shared store can take now: for a node
    /// that failed verification, whose block must not wait for the network. With a
    /// shared store the block is in force in this engine before this returns, flagged
    /// as not yet shared ([`StateBackend::unshared_blocks`]), and the backend writes it
    /// in the background, retrying until it lands (it keeps the queue in its state
    /// directory, so a restart does not lose it); until then every change the watch
    /// applies leaves it in force. Without a shared store this is
    /// [`Engine::block_node`].
    pub fn block_node_now(&self, node_id: &str, reason: &str) -> Result<(), EntityError> {
        validate_node_id(node_id)?;
        let Some(state) = self.shared_state() else {
            return self.block_node(node_id, reason);
        };
        let record = self.block_record(node_id, reason);
        // Queued first, so that a watch change applied between the two steps keeps it.
        let queued = state.queue_block(node_id, &record);
        self.set_blocked(node_id, Some(record))?;
        queued.map_err(EntityError::State)
    }

    /// Lifts a block set by [`Engine::block_node`]; durable first, like a block. With
    /// a shared store, the call waits until this engine's watch has applied the
    /// unblock; past the bound it returns [`crate::state::StateError::NotYetApplied`]
    /// and the node stays blocked here until the watch catches up (failing closed). A
    /// block that never reached the shared store is dropped from its queue.
    pub fn unblock_node(&self, node_id: &str) -> Result<(), EntityError> {
        validate_node_id(node_id)?;
        if let Some(state) = self.shared_state() {
            let (existed, revision) = state.unblock_node_at(node_id).map_err(EntityError::State)?;
            return match revision.filter(|_| existed) {
                Some(r) => state.await_applied(r).map_err(EntityError::State),
                // Not in the shared store: at most an unshared block of this process.
                None => self.set_blocked(node_id, None),
            };
        }
        let node = node_id.to_owned();
        let state = self.shared.state.get().cloned();
        self.write(Box::new(move |w: &mut Working| {
            if let Some(state) = &state {
                state.unblock_node(&node).map_err(EntityError::State)?;
            }
            let mut map = BTreeMap::clone(&w.blocked);
            map.remove(&node);
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(1)
        }))
        .map(|_| ())
    }

    /// The record a block of `node` gets now: a new one, or the node's current record
    /// with this block in its history.
    fn block_record(&self, node: &str, reason: &str) -> BlockRecord {
        let now = u64::try_from(self.shared.clock.now_unix()).unwrap_or(0);
        match self.shared.current.load().blocked.get(node) {
            Some(existing) => existing.clone().blocked_again(reason, now),
            None => BlockRecord::new(reason, now),
        }
    }

    /// Sets (`Some`) or lifts (`None`) a block in memory only.
    fn set_blocked(&self, node: &str, record: Option<BlockRecord>) -> Result<(), EntityError> {
        let node = node.to_owned();
        self.write(Box::new(move |w: &mut Working| {
            let mut map = BTreeMap::clone(&w.blocked);
            match record {
                Some(r) => {
                    map.insert(node, r);
                }
                None => {
                    map.remove(&node);
                }
            }
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(1)
        }))
        .map(|_| ())
    }

    /// The blocked nodes and why.
    pub fn blocked_nodes(&self) -> BTreeMap<String, BlockRecord> {
        BTreeMap::clone(&self.shared.current.load().blocked)
    }

    /// The entity type the blocklist blocks (the schema's `@owned("blocklist")`
    /// attribute's type, `Node` by default), if the schema declares one.
    pub fn blocklist_type(&self) -> Option<String> {
        self.shared
            .current
            .load()
            .bundle
            .blocklist_target()
            .map(|(t, _)| t)
    }

    /// The names the engine acts on, as the live schema declares them.
    pub fn conventions(&self) -> Arc<crate::conventions::Conventions> {
        Arc::clone(&self.shared.current.load().bundle.conventions)
    }

    /// Reads the policy directory again and, if the whole set is valid (and, in sealed
    /// mode, matches its seal), swaps it in. On error the previous set keeps serving and
    /// the error stays in [`Engine::last_error`] until a good set loads. Either way the
    /// attempt is reported to [`Engine::reload_events`].
    ///
    /// The files are read as they are: a reload triggered while a file is being written
    /// may read half of it. The watcher ([`Engine::watch`]) reloads only once the files
    /// have settled ([`Engine::reload_when_settled`]); deploy files by atomic rename
    /// (see [`crate::watch`]).
    pub fn reload(&self) -> Result<(), Arc<LoadError>> {
        let started = std::time::Instant::now();
        let before = self.live_digest();
        let result = self
            .prepare_reload()
            .and_then(|bundle| self.commit_reload(bundle));
        self.finish_reload(started, before, 1, result)
    }

    /// Subscribes to reloads: every reload attempt from now on (by the watcher or
    /// [`Engine::reload`]), loaded, unchanged or rejected, with the digests before and
    /// after, the error and the duration. Each call returns a new receiver. A receiver
    /// that falls more than [`crate::RELOAD_EVENT_BACKLOG`] events behind misses the
    /// newest ones (it sees a gap in [`ReloadEvent::seq`]); a dropped receiver is
    /// forgotten. Hosts log these: the CLI prints nothing for them.
    pub fn reload_events(&self) -> std::sync::mpsc::Receiver<ReloadEvent> {
        self.shared.reload_events.subscribe()
    }

    /// The digest of the live set.
    pub(crate) fn live_digest(&self) -> String {
        self.shared.current.load().bundle.digest.clone()
    }

    /// The origin the engine reads.
    pub(crate) fn origin(&self) -> &Origin {
        &self.shared.origin
    }

    /// Reads, checks and compiles the set: a bundle ready to be swapped in.
    pub(crate) fn prepare_reload(&self) -> Result<Arc<Bundle>, LoadError> {
        let live = self.shared.current.load_full();
        let registry = self.shared.state.get().map(|s| s.as_ref());
        load_bundle(
            &self.shared.origin,
            self.shared.sealing.as_ref(),
            live.bundle.seal.as_deref(),
            registry,
        )
        .map(Arc::new)
    }

    /// Swaps `bundle` in; whether it differed from the live set. In sealed mode the seal
    /// is judged again against the live one (another reload may have won the race) and
    /// made durable in the attached state store before the set goes live.
    pub(crate) fn commit_reload(&self, bundle: Arc<Bundle>) -> Result<bool, LoadError> {
        let refusal: Arc<Mutex<Option<LoadError>>> = Arc::new(Mutex::new(None));
        let stash = Arc::clone(&refusal);
        let state = self.shared.state.get().cloned();
        let dir = self
            .shared
            .origin
            .dir()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let result = self.write(Box::new(move |w: &mut Working| {
            let seal_digest = |b: &Bundle| b.seal.as_ref().map(|s| s.digest);
            if bundle.digest == w.bundle.digest && seal_digest(&bundle) == seal_digest(&w.bundle) {
                return Ok(0);
            }
            // What the live set marks required stays, as a forbid where it was one.
            let mut dropped: Vec<String> = w
                .bundle
                .meta
                .values()
                .filter(|m| m.required)
                .filter(|m| {
                    bundle
                        .meta
                        .get(&cedar_policy::PolicyId::new(&m.id))
                        .is_none_or(|n| m.forbid && !n.forbid)
                })
                .map(|m| m.id.clone())
                .collect();
            if !dropped.is_empty() {
                dropped.sort();
                *stash.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(LoadError::RequiredDropped { ids: dropped });
                return Err(EntityError::Invalid {
                    detail: "required policies dropped".into(),
                });
            }
            if let Some(seal) = &bundle.seal {
                let problem = match &w.bundle.seal {
                    Some(live) => policy_seal::compare_live(seal, live),
                    None => None,
                }
                .or_else(|| {
                    let state = state.as_ref()?;
                    state
                        .accept(
                            &seal.seal.registry_id(),
                            seal.seal.version(),
                            &seal.digest,
                            &seal.encoded,
                        )
                        .err()
                        .map(|e| policy_seal::registry_problem(&e))
                });
                if let Some(message) = problem {
                    *stash.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(policy_seal::late_problem(&dir, seal, message));
                    return Err(EntityError::Invalid {
                        detail: "sealed set refused".into(),
                    });
                }
            }
            // The configuration's entities go with the set that made them.
            let stale: Vec<EntityUID> = w
                .store
                .iter()
                .filter(|(u, _)| {
                    w.bundle.origins.owner_of(&u.entity_type().to_string())
                        == Some(EntityOwner::Config)
                })
                .map(|(u, _)| u.clone())
                .collect();
            for u in &stale {
                w.store.remove(u);
            }
            for (uid, stored) in &bundle.settings {
                w.store.insert(uid.clone(), Arc::clone(stored));
            }
            w.owned = Arc::new(owned_cache(&bundle, &w.store));
            w.bundle = bundle;
            w.changed = true;
            Ok(1)
        }));
        match result {
            Ok(n) => Ok(n == 1),
            Err(e) => Err(refusal
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .unwrap_or_else(|| LoadError::Invalid {
                    problems: vec![crate::diagnostic::SourceDiagnostic::new(
                        "probity.toml",
                        &Arc::from(""),
                        0,
                        0,
                        format!("the new set could not be swapped in: {e}"),
                    )],
                })),
        }
    }

    /// Counts the attempt, keeps or clears the last error, and tells subscribers.
    pub(crate) fn finish_reload(
        &self,
        started: std::time::Instant,
        before: String,
        rounds: u32,
        result: Result<bool, LoadError>,
    ) -> Result<(), Arc<LoadError>> {
        let (outcome, error, returned) = match result {
            Ok(changed) => {
                self.shared.last_error.store(None);
                self.shared.reloads.fetch_add(1, Ordering::Relaxed);
                let outcome = if changed {
                    ReloadOutcome::Loaded
                } else {
                    ReloadOutcome::Unchanged
                };
                (outcome, None, Ok(()))
            }
            Err(e) => {
                let e = Arc::new(e);
                self.shared.last_error.store(Some(Arc::clone(&e)));
                self.shared.reload_errors.fetch_add(1, Ordering::Relaxed);
                (ReloadOutcome::Rejected, Some(Arc::clone(&e)), Err(e))
            }
        };
        let live = self.shared.current.load();
        self.shared.reload_events.publish(ReloadEvent {
            seq: 0,
            outcome,
            digest_before: before,
            digest_after: live.bundle.digest.clone(),
            seal: live.bundle.seal.as_ref().map(|s| s.info.clone()),
            error,
            duration: started.elapsed(),
            rounds,
            at_unix_ms: self.shared.clock.now_unix_ms(),
        });
        returned
    }

    /// The error of the last rejected reload, until a good set loads.
    pub fn last_error(&self) -> Option<Arc<LoadError>> {
        self.shared.last_error.load_full()
    }

    /// Digest, files, counts and the last reload error of the live set.
    pub fn status(&self) -> PolicyStatus {
        let current = self.shared.current.load();
        let b = &current.bundle;
        PolicyStatus {
            digest: b.digest.clone(),
            files: b.files.clone(),
            policies: b.policy_count(),
            loaded_at: b
                .loaded_at
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            reloads: self.shared.reloads.load(Ordering::Relaxed),
            reload_errors: self.shared.reload_errors.load(Ordering::Relaxed),
            last_error: self.last_error().map(|e| e.detail()),
            entities: current.store.len(),
            plugins: b.plugins.infos(),
            seal: b.seal.as_ref().map(|s| s.info.clone()),
        }
    }

    /// Policy ids of the live set, with whether each is a forbid.
    pub fn policy_ids(&self) -> Vec<(String, bool)> {
        let current = self.shared.current.load();
        let mut ids: Vec<_> = current
            .bundle
            .meta
            .values()
            .map(|m| (m.id.clone(), m.forbid))
            .collect();
        ids.sort();
        ids
    }

    /// Decides `request` in a world of its own: `entities` stored (not request-scoped),
    /// `blocked` the blocklist, the engine's clock replaced by `now`. The engine's own
    /// store and blocklist are neither read nor changed. For policy test cases
    /// ([`crate::scenario`]); not a stable API.
    #[doc(hidden)]
    pub fn decide_in_world(
        &self,
        request: &Request,
        entities: &[Value],
        blocked: &[String],
        now: Option<i64>,
    ) -> Result<Decision, EntityError> {
        let current = self.shared.current.load_full();
        let bundle = Arc::clone(&current.bundle);
        let mut store = Store::default();
        for (uid, stored) in &bundle.settings {
            store.insert(uid.clone(), Arc::clone(stored));
        }
        for (uid, stored) in current.store.iter() {
            if bundle.origins.owner_of(&uid.entity_type().to_string()) == Some(EntityOwner::Api) {
                store.insert(uid.clone(), Arc::clone(stored));
            }
        }
        let mut map = BTreeMap::new();
        for b in blocked {
            map.insert(b.clone(), BlockRecord::new("scenario", 0));
        }
        let mut w = Working {
            owned: Arc::new(owned_cache(&bundle, &store)),
            bundle: Arc::clone(&bundle),
            store,
            blocked: Arc::new(map),
            changed: false,
        };
        // The world's API callers and groups stand for the server's configuration, and
        // its keys for the keyring.
        let (api, facts): (Vec<Value>, Vec<Value>) = entities.iter().cloned().partition(|e| {
            matches!(
                store::parse_uid(e.get("uid").unwrap_or(&Value::Null))
                    .ok()
                    .and_then(|u| bundle.origins.owner_of(&u.entity_type().to_string())),
                Some(EntityOwner::Api | EntityOwner::Keyring)
            )
        });
        let converter = bundle.converter();
        for (i, item) in api.iter().enumerate() {
            let c = converter
                .entity(item)
                .map_err(|(uid, e)| rejected(i, uid, e))?;
            w.store.insert(c.uid, Arc::new(c.stored));
        }
        w.owned = Arc::new(owned_cache(&bundle, &w.store));
        let converted = convert_all(&bundle, &facts)?;
        apply_upsert(&mut w, converted)?;
        let snapshot = Snapshot::new(w.bundle, w.store, w.owned, w.blocked);
        let world = match now {
            None => self.clone(),
            Some(t) => Engine {
                shared: Arc::new(Shared {
                    origin: self.shared.origin.clone(),
                    current: ArcSwap::from_pointee(Snapshot::new(
                        Arc::clone(&snapshot.bundle),
                        snapshot.store.clone(),
                        Arc::clone(&snapshot.owned),
                        Arc::clone(&snapshot.blocked),
                    )),
                    writes: Writes::default(),
                    last_error: ArcSwapOption::empty(),
                    reloads: AtomicU64::new(0),
                    reload_errors: AtomicU64::new(0),
                    authorizer: Authorizer::new(),
                    clock: Arc::new(crate::clock::ManualClock::at(t)),
                    state: std::sync::OnceLock::new(),
                    decision_log: std::sync::OnceLock::new(),
                    sealing: None,
                    reload_events: ReloadSubscribers::default(),
                    by_reference: Mutex::new(None),
                }),
            },
        };
        Ok(world.decide_in(&snapshot, request))
    }
}

/// Reads the set from `origin`, checks it against its seal in sealed mode (before
/// compiling: an unsealed plugin is never compiled), compiles it, and checks that the
/// components compiled are the ones the seal covers.
fn load_bundle(
    origin: &Origin,
    sealing: Option<&Sealing>,
    live: Option<&LoadedSeal>,
    registry: Option<&dyn StateBackend>,
) -> Result<Bundle, LoadError> {
    let sources = origin.read()?;
    let checked = match sealing {
        None => None,
        Some(sealing) => {
            let Some(dir) = origin.dir() else {
                return Err(LoadError::Sealed {
                    seal: PathBuf::from(policy_seal::SEAL_FILE),
                    problems: vec![crate::diagnostic::SourceDiagnostic::new(
                        policy_seal::SEAL_FILE,
                        &Arc::from(""),
                        0,
                        0,
                        "sealed mode needs a policy directory: the embedded defaults carry no seal",
                    )],
                });
            };
            let texts: Vec<(PathBuf, crate::integrity::Hash)> = std::iter::once(&sources.schema)
                .chain(std::iter::once(&sources.config))
                .chain(sources.policies.iter())
                .chain(sources.plugins.iter().map(|m| &m.file))
                .filter_map(|f| {
                    Some((f.path.clone()?, crate::integrity::sha256(f.text.as_bytes())))
                })
                .collect();
            let mut components = Vec::new();
            if let Some(manifest) = &sources.plugins {
                for path in crate::plugin::component_paths(manifest) {
                    let bytes = crate::source::read_bytes(&path)?;
                    components.push((path, crate::integrity::sha256(&bytes)));
                }
            }
            Some(policy_seal::check(
                sealing,
                dir,
                &texts,
                &components,
                live,
                registry,
            )?)
        }
    };
    let mut bundle = Bundle::compile(&sources)?;
    if let Some(checked) = checked {
        for (path, hash) in bundle.plugins.components() {
            if !checked.components.contains(&(path.clone(), hash)) {
                let dir = origin.dir().unwrap_or(Path::new("."));
                return Err(policy_seal::late_problem(
                    dir,
                    &checked.seal,
                    format!(
                        "{} changed while it was loaded: it no longer matches the seal",
                        path.display()
                    ),
                ));
            }
        }
        bundle.seal = Some(checked.seal);
    }
    Ok(bundle)
}

/// The write queue's leader while it applies a batch.
struct BusyGuard<'a> {
    writes: &'a Writes,
    /// The other writers' tickets in the batch.
    batch: Vec<u64>,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        let mut st = self
            .writes
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        st.busy = false;
        if std::thread::panicking() {
            // The batch's commit will not come: its writers get an error, not a wait.
            for ticket in self.batch.drain(..) {
                st.finished.insert(
                    ticket,
                    Err(EntityError::Invalid {
                        detail: "the engine failed while applying this write's batch; the live snapshot did not change".into(),
                    }),
                );
            }
            if st.waiting > 0 {
                self.writes.done.notify_all();
            }
        }
    }
}

/// The owned entities of `store`, materialized for slices.
fn owned_cache(bundle: &Bundle, store: &Store) -> HashMap<EntityUID, Arc<ast::Entity>> {
    store
        .iter()
        .filter(|(u, _)| {
            bundle
                .origins
                .owner_of(&u.entity_type().to_string())
                .is_some()
        })
        .map(|(u, s)| {
            let ancestors = store.ancestors(&s.parents, &HashMap::new());
            let entity = Arc::new(store::materialize(&u, s, ancestors, None));
            (u, entity)
        })
        .collect()
}

fn rejected(index: usize, uid: Option<String>, problem: String) -> EntityError {
    EntityError::Rejected {
        index,
        uid,
        problem,
    }
}

/// Entities converted from an update, each with its position in the update.
type Positioned = Vec<(usize, Converted)>;

/// Converts entity JSON items; later items with the same uid replace earlier ones.
fn convert_all(bundle: &Bundle, items: &[Value]) -> Result<Positioned, EntityError> {
    let converter = bundle.converter();
    let mut out: Positioned = Vec::with_capacity(items.len());
    let mut at: HashMap<EntityUID, usize> = HashMap::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if let Some(uid) = item.get("uid").and_then(|u| store::parse_uid(u).ok())
            && let Some(owner) = bundle.origins.owner_of(&uid.entity_type().to_string())
        {
            return Err(EntityError::Reserved {
                uid: uid.to_string(),
                owner: owner.as_str(),
            });
        }
        // The converter reads the same `uid` the check above did, so what it
        // returns is never an owned type's.
        let c = converter
            .entity(item)
            .map_err(|(uid, e)| rejected(i, uid, e))?;
        match at.get(&c.uid) {
            Some(&j) => {
                if let Some(slot) = out.get_mut(j) {
                    *slot = (i, c);
                }
            }
            None => {
                at.insert(c.uid.clone(), out.len());
                out.push((i, c));
            }
        }
    }
    Ok(out)
}

/// Reads a JSON array of entities from `reader`, converting each as it arrives.
fn stream_convert(bundle: &Bundle, reader: impl std::io::Read) -> Result<Positioned, EntityError> {
    use serde::de::{Deserializer, SeqAccess, Visitor};
    struct Items<'a> {
        converter: Converter<'a>,
        bundle: &'a Bundle,
    }
    impl<'de> Visitor<'de> for Items<'_> {
        type Value = Result<Positioned, EntityError>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON array of entities")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out: Positioned = Vec::new();
            let mut at: HashMap<EntityUID, usize> = HashMap::new();
            let mut i = 0usize;
            while let Some(item) = seq.next_element::<Value>()? {
                let c = match self.converter.entity(&item) {
                    Ok(c) => c,
                    Err((uid, e)) => return Ok(Err(rejected(i, uid, e))),
                };
                if let Some(owner) = self
                    .bundle
                    .origins
                    .owner_of(&c.uid.entity_type().to_string())
                {
                    return Ok(Err(EntityError::Reserved {
                        uid: c.uid.to_string(),
                        owner: owner.as_str(),
                    }));
                }
                match at.get(&c.uid) {
                    Some(&j) => {
                        if let Some(slot) = out.get_mut(j) {
                            *slot = (i, c);
                        }
                    }
                    None => {
                        at.insert(c.uid.clone(), out.len());
                        out.push((i, c));
                    }
                }
                i += 1;
            }
            Ok(Ok(out))
        }
    }
    let mut de = serde_json::Deserializer::from_reader(reader);
    let converter = bundle.converter();
    let result = de
        .deserialize_seq(Items { converter, bundle })
        .map_err(|e| EntityError::Json {
            line: e.line(),
            column: e.column(),
            detail: e.to_string(),
        })?;
    de.end().map_err(|e| EntityError::Json {
        line: e.line(),
        column: e.column(),
        detail: e.to_string(),
    })?;
    result
}

fn check_claimed_block(snapshot: &Snapshot, c: &Converted) -> Result<(), String> {
    let (Some(claimed), Some((attr, blocked))) = (c.claimed_block, snapshot.blocked_view(&c.uid))
    else {
        return Ok(());
    };
    if claimed != blocked {
        return Err(format!(
            "`{attr}: {claimed}` contradicts the blocklist, which owns it (block and unblock nodes through the blocklist)"
        ));
    }
    Ok(())
}

fn apply_upsert(w: &mut Working, converted: Positioned) -> Result<usize, EntityError> {
    let count = converted.len();
    let (ty, attr) = match &w.bundle.blocklist {
        Some((t, a)) => (Some(t.clone()), Some(a.clone())),
        None => (None, None),
    };
    let mut pending: HashMap<EntityUID, Arc<Stored>> = HashMap::with_capacity(count);
    // The input order, so that a cycle is reported at the first entity, in that order,
    // whose new parents close it.
    let mut order: Vec<EntityUID> = Vec::with_capacity(count);
    for (index, c) in converted {
        if let (Some(claimed), Some(t)) = (c.claimed_block, &ty)
            && c.uid.entity_type() == t
        {
            let id: &str = c.uid.eid().as_ref();
            let blocked = w.blocked.contains_key(id);
            if claimed != blocked {
                return Err(EntityError::Rejected {
                    index,
                    uid: Some(c.uid.to_string()),
                    problem: format!(
                        "`{}: {claimed}` contradicts the blocklist, which owns it (block and unblock nodes through the blocklist)",
                        attr.as_deref().unwrap_or("blocked")
                    ),
                });
            }
        }
        order.push(c.uid.clone());
        pending.insert(c.uid, Arc::new(c.stored));
    }
    for uid in &order {
        // An entity that keeps its stored parents is not walked: a cycle the upsert
        // would create has an edge the store lacks, so it passes through an entity
        // that is new or whose parents changed, and that entity's walk finds it.
        let closes = pending.get(uid).is_some_and(|s| {
            let kept = w
                .store
                .get(uid)
                .is_some_and(|old| same_parents(&old.parents, &s.parents));
            !kept && w.store.would_cycle(uid, &s.parents, &pending)
        });
        if closes {
            return Err(EntityError::Cycle {
                uid: uid.to_string(),
            });
        }
    }
    for (uid, stored) in pending {
        w.store.insert(uid, stored);
    }
    w.changed = true;
    Ok(count)
}

/// Whether two deduplicated parent lists hold the same parents, in any order: in the
/// same order (the common case, compared by address first), else by a set, so that a
/// long list costs no quadratic time inside the write queue.
fn same_parents(a: &[Arc<EntityUID>], b: &[Arc<EntityUID>]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y) || x == y) {
        return true;
    }
    let theirs: HashSet<&EntityUID> = b.iter().map(AsRef::as_ref).collect();
    a.iter().all(|p| theirs.contains(p.as_ref()))
}

/// A node id: what Kubernetes allows in a node name (a DNS subdomain), plus `_` and
/// upper case, 1 to 253 bytes. Anything else (an empty id, a `Node::"x"` uid, quotes,
/// spaces, control characters) is refused, so a typo cannot block a node that does
/// not exist under that name.
pub(crate) fn validate_node_id(id: &str) -> Result<(), EntityError> {
    let ok = !id.is_empty()
        && id.len() <= 253
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && !id.starts_with(['-', '.'])
        && !id.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(EntityError::NodeId {
            id: truncate_id(id),
        })
    }
}

fn truncate_id(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", s.get(..i).unwrap_or(s)),
        None => s.to_owned(),
    }
}

/// Entity values in a context: `{"__entity": ..}` or `{"type", "id"}` objects.
fn context_refs(v: &Value, out: &mut Vec<EntityUID>, depth: usize) {
    if depth > 32 {
        return;
    }
    match v {
        Value::Object(o) => {
            if (o.contains_key("__entity")
                || (o.len() == 2 && o.contains_key("type") && o.contains_key("id")))
                && let Ok(u) = store::parse_uid(v)
            {
                out.push(u);
                return;
            }
            for x in o.values() {
                context_refs(x, out, depth + 1);
            }
        }
        Value::Array(a) => {
            for x in a {
                context_refs(x, out, depth + 1);
            }
        }
        _ => {}
    }
}

/// What every decision of one request shares (see [`Engine::prepare`]).
pub(crate) struct Prepared {
    context_json: Option<Map<String, Value>>,
    context: Context,
    extra: HashMap<EntityUID, Arc<Stored>>,
}

/// What a decision's reasons and obligations may name: the request, its slice and
/// its context.
struct Facts<'a> {
    principal: &'a cedar_policy::EntityUid,
    resource: &'a cedar_policy::EntityUid,
    entities: &'a Entities,
    context: Option<&'a Map<String, Value>>,
}

impl Facts<'_> {
    /// Follows a `@target` path through entity-valued attributes.
    fn target(&self, path: &TargetPath) -> Option<String> {
        let mut uid = match path.root {
            TargetRoot::Principal => self.principal.clone(),
            TargetRoot::Resource => self.resource.clone(),
            TargetRoot::Context => return None,
        };
        for attr in &path.attrs {
            match self.entities.get(&uid)?.attr(attr)? {
                Ok(EvalResult::EntityUid(next)) => uid = next,
                _ => return None,
            }
        }
        Some(uid.to_string())
    }

    /// A message or parameter with its `{path}` placeholders filled.
    fn render(&self, template: &MessageTemplate) -> String {
        let parts = match template {
            MessageTemplate::Plain(s) => return s.clone(),
            MessageTemplate::Parts(parts) => parts,
        };
        let mut out = String::new();
        for part in parts {
            match part {
                MessagePart::Text(t) => out.push_str(t),
                MessagePart::Path(p) => out.push_str(&self.show(p)),
            }
        }
        out
    }

    fn show(&self, path: &TargetPath) -> String {
        const UNKNOWN: &str = "(unknown)";
        let mut value: EvalResult = match path.root {
            TargetRoot::Principal => EvalResult::EntityUid(self.principal.clone()),
            TargetRoot::Resource => EvalResult::EntityUid(self.resource.clone()),
            TargetRoot::Context => {
                let mut v = match self.context {
                    Some(c) => Value::Object(c.clone()),
                    None => return UNKNOWN.into(),
                };
                for a in &path.attrs {
                    v = match v.get(a) {
                        Some(x) => x.clone(),
                        None => return UNKNOWN.into(),
                    };
                }
                return match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
            }
        };
        for attr in &path.attrs {
            let EvalResult::EntityUid(uid) = &value else {
                return UNKNOWN.into();
            };
            value = match self.entities.get(uid).and_then(|e| e.attr(attr)) {
                Some(Ok(v)) => v,
                _ => return UNKNOWN.into(),
            };
        }
        match value {
            EvalResult::EntityUid(u) => u.id().unescaped().to_owned(),
            EvalResult::String(s) => s,
            EvalResult::Long(n) => n.to_string(),
            EvalResult::Bool(b) => b.to_string(),
            other => other.to_string(),
        }
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
