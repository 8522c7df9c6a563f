//! The [`Engine`]: a policy set and an entity store behind one atomic pointer.
//!
//! Readers load the current [`Snapshot`] without locking; writers (entity updates,
//! reloads) build a new snapshot beside it and swap it in whole. A decision therefore
//! always sees one policy set with one store, never a mix, and never waits on a writer.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use arc_swap::{ArcSwap, ArcSwapOption};
use cedar_policy::{Authorizer, Context, Entities, Entity, EvalResult, RestrictedExpression};
use serde_json::Value;

use crate::bundle::{Bundle, PolicyMeta, TargetPath, TargetRoot};
use crate::decision::{Decision, DecisionError, Effect, Obligation, Reason};
use crate::decision_log::{self, DecisionLog, Settled};
use crate::error::{EntityError, LoadError};
use crate::plugin::{PluginEntities, PluginInfo};
use crate::request::{EntityUid, Request, kind};
use crate::source::Origin;
use crate::state::StateStore;

/// Entity types that only the configuration defines.
const RESERVED_TYPES: &[&str] = &["Settings", "GpuModel"];

/// Why a node is blocked, and since when.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockRecord {
    /// What blocked it (a policy id, an operator's note).
    pub reason: String,
    /// When, in Unix seconds.
    pub since: u64,
}

/// One consistent view: the policy set and the entities decisions read.
pub(crate) struct Snapshot {
    pub bundle: Arc<Bundle>,
    pub entities: Arc<Entities>,
    pub blocked: Arc<BTreeMap<String, BlockRecord>>,
    /// The same entities as plugins see them, with their JSON cached.
    pub plugin_entities: Arc<PluginEntities>,
}

impl Snapshot {
    fn new(
        bundle: Arc<Bundle>,
        entities: Entities,
        blocked: Arc<BTreeMap<String, BlockRecord>>,
    ) -> Self {
        let entities = Arc::new(entities);
        Self {
            bundle,
            plugin_entities: Arc::new(PluginEntities::new(Arc::clone(&entities))),
            entities,
            blocked,
        }
    }
}

struct Shared {
    origin: Origin,
    current: ArcSwap<Snapshot>,
    /// Serialises writers; readers never take it.
    writer: Mutex<()>,
    last_error: ArcSwapOption<LoadError>,
    reloads: AtomicU64,
    reload_errors: AtomicU64,
    authorizer: Authorizer,
    /// Where blocks are made durable, once attached.
    state: std::sync::OnceLock<Arc<StateStore>>,
    /// Records denies and obligations in the state store, once one is attached.
    decision_log: std::sync::OnceLock<DecisionLog>,
}

/// The policy engine. Cheap to clone: clones share one state.
///
/// ```
/// use probity::{Engine, Request};
///
/// let engine = Engine::from_embedded_defaults().unwrap();
/// let request = Request::from_json_slice(br#"{
///     "principal": "Node::\"gpu-001\"", "action": "listen", "resource": "Node::\"gpu-001\"",
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

/// Builds an [`Engine`] from a policy directory.
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    dir: PathBuf,
    schema: Option<PathBuf>,
    config: Option<PathBuf>,
    plugins: Option<PathBuf>,
}

impl EngineBuilder {
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

    /// Loads and validates the set. Fails if any file is invalid.
    pub fn build(self) -> Result<Engine, LoadError> {
        let origin = Origin::Dir {
            schema: self
                .schema
                .unwrap_or_else(|| self.dir.join("probity.cedarschema")),
            config: self.config.unwrap_or_else(|| self.dir.join("probity.toml")),
            plugins: self.plugins,
            dir: self.dir,
        };
        Engine::from_origin(origin)
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
    /// Number of entities in the store (including configuration entities).
    pub entities: usize,
    /// The plugins of the live set (from `plugins.toml`).
    pub plugins: Vec<PluginInfo>,
}

impl Engine {
    /// Starts building an engine from the policies under `dir`.
    pub fn builder(dir: impl Into<PathBuf>) -> EngineBuilder {
        EngineBuilder {
            dir: dir.into(),
            schema: None,
            config: None,
            plugins: None,
        }
    }

    /// An engine on the default policies, schema and configuration compiled into Probity.
    pub fn from_embedded_defaults() -> Result<Self, LoadError> {
        Self::from_origin(Origin::Embedded)
    }

    fn from_origin(origin: Origin) -> Result<Self, LoadError> {
        let bundle = Bundle::compile(&origin.read()?)?;
        let entities = Entities::empty()
            .add_entities(bundle.settings.iter().cloned(), Some(&bundle.schema))
            .map_err(|e| settings_error(&e))?;
        let snapshot = Snapshot::new(Arc::new(bundle), entities, Arc::new(BTreeMap::new()));
        Ok(Self {
            shared: Arc::new(Shared {
                origin,
                current: ArcSwap::from_pointee(snapshot),
                writer: Mutex::new(()),
                last_error: ArcSwapOption::empty(),
                reloads: AtomicU64::new(0),
                reload_errors: AtomicU64::new(0),
                authorizer: Authorizer::new(),
                state: std::sync::OnceLock::new(),
                decision_log: std::sync::OnceLock::new(),
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

    pub(crate) fn watched_paths(&self) -> Vec<PathBuf> {
        let mut paths = self.shared.origin.watched_paths();
        // Plugin components may live outside the policy directory.
        paths.extend(self.shared.current.load().bundle.plugins.paths());
        paths
    }

    fn write_lock(&self) -> MutexGuard<'_, ()> {
        // A writer that panicked left the snapshot untouched (it swaps only at the end).
        self.shared
            .writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
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

    /// [`Engine::decide`] without waiting for the record: the caller must
    /// [`Settled::settle`] before acknowledging the decision. For async servers, which
    /// wait for the commit off their event loop.
    pub fn decide_deferred(&self, request: &Request) -> Settled {
        let snapshot = self.shared.current.load();
        let decision = self.decide_in(&snapshot, request);
        self.record(&snapshot, &[request], vec![decision])
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
            asked,
            decisions,
        )
    }

    fn decide_in(&self, snapshot: &Snapshot, request: &Request) -> Decision {
        let bundle = &snapshot.bundle;
        let schema = &bundle.schema;
        let context = match &request.context {
            None => Context::empty(),
            Some(map) => match Context::from_json_value(
                Value::Object(map.clone()),
                Some((schema, &request.action.0)),
            ) {
                Ok(c) => c,
                Err(e) => return Decision::error(format!("invalid context: {e}")),
            },
        };
        let cedar_request = match cedar_policy::Request::new(
            request.principal.0.clone(),
            request.action.0.clone(),
            request.resource.0.clone(),
            context,
            Some(schema),
        ) {
            Ok(r) => r,
            Err(e) => return Decision::error(format!("invalid request: {e}")),
        };
        // Request-scoped entities make a merged store for this call alone (and a cache
        // for plugins that lives as long).
        let merged: Arc<PluginEntities>;
        let view: &Arc<PluginEntities> = if request.entities.is_empty() {
            &snapshot.plugin_entities
        } else {
            match parse_entities(&request.entities, schema).and_then(|extra| {
                Entities::clone(&snapshot.entities)
                    .upsert_entities(extra, Some(schema))
                    .map_err(invalid)
            }) {
                Ok(e) => {
                    merged = Arc::new(PluginEntities::new(Arc::new(e)));
                    &merged
                }
                Err(e) => return Decision::error(format!("request entities: {e}")),
            }
        };
        let entities = view.entities();
        let response = self.shared.authorizer.is_authorized(
            &cedar_request,
            bundle.policies_for(&request.action.0),
            entities,
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
        // It gives a reason but no obligation, since its condition was never established.
        let (decision, determining): (Effect, Vec<(Arc<PolicyMeta>, bool)>) =
            if response.decision() == cedar_policy::Decision::Allow && failed_forbids.is_empty() {
                (Effect::Allow, fired.map(|m| (m, true)).collect())
            } else {
                let forbids = fired.filter(|m| m.forbid).map(|m| (m, true));
                let failed = failed_forbids.into_iter().map(|m| (m, false));
                (Effect::Deny, forbids.chain(failed).collect())
            };
        let obligations = determining
            .iter()
            .filter(|(_, fired)| *fired)
            .filter_map(|(m, _)| {
                let spec = m.obligation.as_ref()?;
                Some(Obligation {
                    kind: spec.kind.clone(),
                    target: spec
                        .target
                        .as_ref()
                        .and_then(|t| resolve_target(t, request, entities)),
                    parameters: spec.parameters.clone(),
                    policy: m.id.clone(),
                })
            })
            .collect();
        let cedar = Decision {
            decision,
            reasons: determining
                .iter()
                .map(|(m, _)| Reason {
                    policy: m.id.clone(),
                    message: m.message.clone(),
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
            plugins => crate::plugin::combine(plugins, request, view, cedar),
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
        };
        Some(crate::plugin::combine(
            std::slice::from_ref(plugin),
            request,
            &snapshot.plugin_entities,
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

    /// Adds or replaces entities (Cedar entity JSON: an array of
    /// `{"uid": .., "attrs": .., "parents": ..}`), validated against the schema.
    /// All or nothing: on error the store is unchanged.
    pub fn upsert_entities(&self, json: &Value) -> Result<usize, EntityError> {
        let Value::Array(items) = json else {
            return Err(EntityError::Shape {
                found: kind(json).into(),
            });
        };
        let _guard = self.write_lock();
        let current = self.shared.current.load_full();
        let schema = &current.bundle.schema;
        let mut parsed = parse_entities(items, schema)?;
        for e in &mut parsed {
            let uid = e.uid();
            if RESERVED_TYPES.contains(&uid.type_name().to_string().as_str()) {
                return Err(EntityError::Reserved {
                    uid: uid.to_string(),
                });
            }
            // A block outlives telemetry: upserting a blocked node keeps it blocked.
            if is_blocked_node(&current.blocked, &uid) {
                *e = with_blocked(e.clone(), true)?;
            }
        }
        let count = parsed.len();
        let entities = Entities::clone(&current.entities)
            .upsert_entities(parsed, Some(schema))
            .map_err(invalid)?;
        self.swap_entities(&current, entities, Arc::clone(&current.blocked));
        Ok(count)
    }

    /// Removes entities by uid; unknown uids are ignored.
    pub fn remove_entities(&self, uids: &[EntityUid]) -> Result<(), EntityError> {
        let _guard = self.write_lock();
        let current = self.shared.current.load_full();
        for uid in uids {
            if RESERVED_TYPES.contains(&uid.type_name().as_str()) {
                return Err(EntityError::Reserved {
                    uid: uid.to_string(),
                });
            }
        }
        let present: Vec<_> = uids
            .iter()
            .filter(|u| current.entities.get(&u.0).is_some())
            .map(|u| u.0.clone())
            .collect();
        let entities = Entities::clone(&current.entities)
            .remove_entities(present)
            .map_err(invalid)?;
        self.swap_entities(&current, entities, Arc::clone(&current.blocked));
        Ok(())
    }

    /// One entity, as Cedar entity JSON.
    pub fn entity(&self, uid: &EntityUid) -> Option<Value> {
        let current = self.shared.current.load();
        current.entities.get(&uid.0)?.to_json_value().ok()
    }

    /// Every stored entity of type `type_name` (all types if `None`), as Cedar entity JSON,
    /// sorted by uid. Configuration entities (`Settings`, `GpuModel`) are included.
    pub fn entities_json(&self, type_name: Option<&str>) -> Vec<Value> {
        let current = self.shared.current.load();
        let mut found: Vec<(String, Value)> = current
            .entities
            .iter()
            .filter(|e| type_name.is_none_or(|t| e.uid().type_name().to_string() == t))
            .filter_map(|e| Some((e.uid().to_string(), e.to_json_value().ok()?)))
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found.into_iter().map(|(_, v)| v).collect()
    }

    /// Makes blocks durable in `state`: the nodes it holds as blocked are blocked in the
    /// engine now, and every later block and unblock is written there first. From now
    /// on, decisions that deny or carry obligations are recorded in its decision log
    /// ([`StateStore::decisions`]) before they are returned. Attach once; a second call
    /// is refused.
    pub fn attach_state(&self, state: Arc<StateStore>) -> Result<(), EntityError> {
        let blocked = state.blocked_nodes().map_err(EntityError::State)?;
        // The log starts before the store counts as attached, so no decision made with
        // the store attached goes unrecorded; a losing second call drops (and joins)
        // its own log.
        let log = DecisionLog::start(Arc::clone(&state)).map_err(EntityError::DecisionLog)?;
        if self.shared.decision_log.set(log).is_err()
            || self.shared.state.set(Arc::clone(&state)).is_err()
        {
            return Err(EntityError::StateAlreadyAttached);
        }
        for node in blocked {
            self.set_blocked_in_memory(&node.node, Some((&node.reason, node.since_unix)))?;
        }
        Ok(())
    }

    /// The attached state store, if any.
    pub fn state(&self) -> Option<&Arc<StateStore>> {
        self.shared.state.get()
    }

    /// Blocks a node: placement policies deny scheduling onto it, and a later upsert of
    /// the node keeps it blocked until [`Engine::unblock_node`]. The node need not be in
    /// the store yet. With a state store attached, the block is durable before this returns.
    pub fn block_node(&self, node_id: &str, reason: &str) -> Result<(), EntityError> {
        self.set_blocked(node_id, Some(reason))
    }

    /// Lifts a block set by [`Engine::block_node`].
    pub fn unblock_node(&self, node_id: &str) -> Result<(), EntityError> {
        self.set_blocked(node_id, None)
    }

    /// The blocked nodes and why.
    pub fn blocked_nodes(&self) -> BTreeMap<String, BlockRecord> {
        BTreeMap::clone(&self.shared.current.load().blocked)
    }

    fn set_blocked(&self, node_id: &str, reason: Option<&str>) -> Result<(), EntityError> {
        if let Some(state) = self.shared.state.get() {
            match reason {
                Some(r) => state.block_node(node_id, r),
                None => state.unblock_node(node_id).map(|_| ()),
            }
            .map_err(EntityError::State)?;
        }
        let since = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.set_blocked_in_memory(node_id, reason.map(|r| (r, since)))
    }

    fn set_blocked_in_memory(
        &self,
        node_id: &str,
        block: Option<(&str, u64)>,
    ) -> Result<(), EntityError> {
        let uid = EntityUid::new("Node", node_id).map_err(invalid)?;
        let _guard = self.write_lock();
        let current = self.shared.current.load_full();
        let mut blocked = BTreeMap::clone(&current.blocked);
        match block {
            Some((r, since)) => {
                blocked.insert(
                    node_id.to_owned(),
                    BlockRecord {
                        reason: r.to_owned(),
                        since,
                    },
                );
            }
            None => {
                blocked.remove(node_id);
            }
        }
        let entities = match current.entities.get(&uid.0) {
            Some(node) => {
                let node = with_blocked(node.clone(), block.is_some())?;
                Entities::clone(&current.entities)
                    .upsert_entities([node], Some(&current.bundle.schema))
                    .map_err(invalid)?
            }
            None => Entities::clone(&current.entities),
        };
        self.swap_entities(&current, entities, Arc::new(blocked));
        Ok(())
    }

    fn swap_entities(
        &self,
        current: &Snapshot,
        entities: Entities,
        blocked: Arc<BTreeMap<String, BlockRecord>>,
    ) {
        self.shared.current.store(Arc::new(Snapshot::new(
            Arc::clone(&current.bundle),
            entities,
            blocked,
        )));
    }

    /// Reads the policy directory again and, if the whole set is valid, swaps it in.
    /// On error the previous set keeps serving and the error stays in
    /// [`Engine::last_error`] until a good set loads.
    pub fn reload(&self) -> Result<(), Arc<LoadError>> {
        let result = self
            .shared
            .origin
            .read()
            .and_then(|sources| Bundle::compile(&sources));
        let _guard = self.write_lock();
        let outcome = result.and_then(|bundle| {
            let current = self.shared.current.load_full();
            if bundle.digest == current.bundle.digest {
                return Ok(());
            }
            let stale: Vec<_> = current
                .entities
                .iter()
                .map(Entity::uid)
                .filter(|u| RESERVED_TYPES.contains(&u.type_name().to_string().as_str()))
                .collect();
            let entities = Entities::clone(&current.entities)
                .remove_entities(stale)
                .map_err(|e| settings_error(&e))?
                .add_entities(bundle.settings.iter().cloned(), Some(&bundle.schema))
                .map_err(|e| settings_error(&e))?;
            self.shared.current.store(Arc::new(Snapshot::new(
                Arc::new(bundle),
                entities,
                Arc::clone(&current.blocked),
            )));
            Ok(())
        });
        match outcome {
            Ok(()) => {
                self.shared.last_error.store(None);
                self.shared.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                let e = Arc::new(e);
                self.shared.last_error.store(Some(Arc::clone(&e)));
                self.shared.reload_errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
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
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            reloads: self.shared.reloads.load(Ordering::Relaxed),
            reload_errors: self.shared.reload_errors.load(Ordering::Relaxed),
            last_error: self.last_error().map(|e| e.detail()),
            entities: current.entities.iter().count(),
            plugins: b.plugins.infos(),
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
}

fn is_blocked_node(blocked: &BTreeMap<String, BlockRecord>, uid: &cedar_policy::EntityUid) -> bool {
    uid.type_name().to_string() == "Node" && blocked.contains_key(uid.id().unescaped())
}

fn with_blocked(entity: Entity, blocked: bool) -> Result<Entity, EntityError> {
    let (uid, mut attrs, parents) = entity.into_inner();
    attrs.insert(
        "blocked".to_owned(),
        RestrictedExpression::new_bool(blocked),
    );
    Entity::new(uid, attrs, parents).map_err(invalid)
}

fn invalid(e: impl std::error::Error) -> EntityError {
    EntityError::Invalid {
        detail: crate::error::join_chain(e.to_string(), e.source()),
    }
}

fn parse_entities(
    items: &[Value],
    schema: &cedar_policy::Schema,
) -> Result<Vec<Entity>, EntityError> {
    // Later entries with the same uid replace earlier ones.
    let mut by_uid: HashMap<cedar_policy::EntityUid, usize> = HashMap::new();
    let mut out: Vec<Entity> = Vec::with_capacity(items.len());
    for item in items {
        let e = Entity::from_json_value(item.clone(), Some(schema)).map_err(invalid)?;
        match by_uid.get(&e.uid()) {
            Some(&i) => {
                if let Some(slot) = out.get_mut(i) {
                    *slot = e;
                }
            }
            None => {
                by_uid.insert(e.uid(), out.len());
                out.push(e);
            }
        }
    }
    Ok(out)
}

fn settings_error(e: &dyn std::error::Error) -> LoadError {
    LoadError::Invalid {
        problems: vec![crate::diagnostic::SourceDiagnostic::new(
            "probity.toml",
            &Arc::from(""),
            0,
            0,
            format!("configuration entities rejected: {e}"),
        )],
    }
}

/// Follows a `@target` path through entity-valued attributes.
fn resolve_target(path: &TargetPath, request: &Request, entities: &Entities) -> Option<String> {
    let mut uid = match path.root {
        TargetRoot::Principal => request.principal.0.clone(),
        TargetRoot::Resource => request.resource.0.clone(),
    };
    for attr in &path.attrs {
        match entities.get(&uid)?.attr(attr)? {
            Ok(EvalResult::EntityUid(next)) => uid = next,
            _ => return None,
        }
    }
    Some(uid.to_string())
}
