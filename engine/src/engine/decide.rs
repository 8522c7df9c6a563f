//! Deciding: the request's effective context and entities, evaluation against the
//! policy set, combination, and the reasons and obligations a decision carries.

use std::sync::Arc;
use std::time::Instant;

use cedar_policy::{Context, Entities, EvalResult};
use cedar_policy_core::ast::EntityUID;
use serde_json::{Map, Value};

use super::Engine;
use super::entities::check_claimed_block;
use super::snapshot::Snapshot;
use crate::bundle::{MessagePart, MessageTemplate, PolicyMeta, TargetPath, TargetRoot};
use crate::decision::{Decision, DecisionError, Effect, Notice, Obligation, Reason};
use crate::decision_log::{self, Settled};
use crate::facts::ContextOwner;
use crate::hashing::KeyedHash;
use crate::modes::Mode;
use crate::plugin::PluginEntities;
use crate::request::{EntityUid, Request};
use crate::slice::RequestEntities;
use crate::store;

/// How [`Engine::decide_with`] decides: by default each decision that needs a
/// record is recorded, with no budget.
#[derive(Default)]
pub struct DecideOptions<'a> {
    dry_run: bool,
    budget: Option<&'a mut dyn FnMut(usize) -> bool>,
    deadline: Option<Instant>,
    fresh: bool,
}

impl std::fmt::Debug for DecideOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecideOptions")
            .field("dry_run", &self.dry_run)
            .field("budget", &self.budget.is_some())
            .field("deadline", &self.deadline)
            .field("fresh", &self.fresh)
            .finish()
    }
}

impl<'a> DecideOptions<'a> {
    /// Record what needs recording, with no budget.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record nothing: for dry runs and what-if tools, whose answers are not acted on.
    pub fn dry_run(mut self) -> Self {
        self.dry_run = true;
        self
    }

    /// Record only within a budget: when decisions must be recorded (they deny or
    /// carry obligations, and a state store is attached), `admit` is told how many
    /// and may refuse. Refused, nothing is recorded and [`Settled::is_over_budget`] says
    /// so, so that a server answers "too many requests" rather than a deny it could
    /// not record. `admit` is not asked when nothing would be recorded.
    pub fn within(mut self, admit: &'a mut dyn FnMut(usize) -> bool) -> Self {
        self.budget = Some(admit);
        self
    }

    /// Decide by `deadline`: WebAssembly plugins, the only part of a decision that can
    /// run long, get no more than the time left (less than their manifest's
    /// `timeout_ms` when it is shorter), and a plugin whose turn comes after the
    /// deadline is not called. A plugin cut short fails as a timeout does: the
    /// decision denies, naming it. For a server whose caller stops waiting: the work
    /// stops with it.
    pub fn deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Decide afresh: neither reuse an answer from the engine's decision cache nor
    /// remember this one (see [`Engine::decision_cache`]). The answer is the same
    /// either way; this is for measuring and for checking that it is.
    pub fn fresh(mut self) -> Self {
        self.fresh = true;
        self
    }
}

impl Engine {
    /// Decides one request. Never panics and never fails: problems become a deny
    /// whose `errors` say what went wrong.
    ///
    /// With a state store attached ([`Engine::attach_state`]), a decision that denies
    /// or carries obligations is recorded in its decision log before this returns; if
    /// it cannot be, the answer is a deny saying so. [`Engine::decide_with`] decides
    /// many requests at once, without recording, without waiting, or within a budget.
    pub fn decide(&self, request: &Request) -> Decision {
        self.decide_with(std::slice::from_ref(request), DecideOptions::new())
            .settle()
            .pop()
            .unwrap_or_else(|| Decision::error("no decision"))
    }

    /// Decides `requests` against one policy set and store, as `options` say. The
    /// decisions' records (see [`Engine::decide`]) share one durable commit, which
    /// the caller waits for with [`Settled::settle`] (or awaits, from async code,
    /// with [`Settled::awaitable`]) before acknowledging any of them.
    ///
    /// The request itself says who asks: [`Request::as_fact_reporter`] and
    /// [`Request::on_behalf_of`].
    pub fn decide_with(&self, requests: &[Request], options: DecideOptions<'_>) -> Settled {
        let snapshot = self.shared.current.load();
        let cache = Some(&self.shared.decisions).filter(|c| !options.fresh && c.budget() > 0);
        let decisions: Vec<Decision> = requests
            .iter()
            .map(|r| match cache {
                // Never a plugin's or a clocked action's (not cacheable), so no deadline.
                Some(cache) if self.cacheable(&snapshot, r) => {
                    Arc::unwrap_or_clone(self.decide_through(&snapshot, r, cache))
                }
                _ => self.decide_in(&snapshot, r, options.deadline),
            })
            .collect();
        if options.dry_run {
            return Settled::done(decisions);
        }
        if let Some(admit) = options.budget
            && self.shared.decision_log.get().is_some()
        {
            let recorded = decisions
                .iter()
                .filter(|d| decision_log::needs_record(d))
                .count();
            if recorded > 0 && !admit(recorded) {
                return Settled::over_budget(decisions);
            }
        }
        decision_log::submit(
            self.shared.decision_log.get(),
            &self.shared.record_options,
            &snapshot.bundle.digest,
            self.shared.clock.now_unix_ms(),
            requests,
            decisions,
        )
    }

    /// The engine's decision cache, which every [`Engine::decide_with`] (and so
    /// [`Engine::decide`]) asks first: an answer is reused only while every stored
    /// fact it read, the policy set (with its modes, scopes and settings), the
    /// engine's own entities and the blocklist are unchanged, and never for an action
    /// that reads the clock or runs plugins. Its byte budget is 32 MiB by default
    /// ([`DecisionCache::set_budget`]; 0 turns it off). A question is stored the second
    /// time it is asked, not the first. A reused decision is recorded
    /// as a fresh one would be. Pass it to [`Engine::decide_each`] to share it.
    pub fn decision_cache(&self) -> &crate::DecisionCache {
        &self.shared.decisions
    }

    /// Keeps one allow in `every` in the decision log (0, the default: none), with its
    /// request, so that `probity policy impact` can replay allows a candidate set
    /// might refuse. Denies, obligations and warn or audit findings are kept whatever
    /// this says; a sampled allow's record that cannot be written fails nothing.
    pub fn sample_allows(&self, every: u32) {
        self.shared.record_options.sample_allows(every);
    }

    /// Whether decision records keep their requests (context and request entities,
    /// see [`crate::state::RecordedRequest`]); true by default. Without them a record
    /// cannot be replayed (`probity policy impact` counts it as not replayable).
    pub fn keep_requests(&self, keep: bool) {
        self.shared.record_options.keep_requests(keep);
    }

    /// Decides again the request `record` keeps, under the live set and store, as a
    /// dry run (nothing recorded): what `probity policy impact` compares. The engine's
    /// clock facts are those of the record's time. `Err` says why the record cannot be
    /// replayed (written before requests were kept, or kept without its context).
    pub fn decide_recorded(
        &self,
        record: &crate::state::DecisionRecord,
    ) -> Result<Decision, String> {
        let kept = record
            .request
            .as_ref()
            .ok_or("the record keeps no request (written before requests were recorded)")?;
        if let Some(why) = &kept.omitted {
            return Err(format!("the record's request was not kept whole: {why}"));
        }
        let uid = |text: &str, what: &str| {
            text.parse::<EntityUid>()
                .map_err(|e| format!("the record's {what} {text:?}: {e}"))
        };
        let snapshot = self.shared.current.load();
        let mut request = Request {
            principal: uid(&record.principal, "principal")?,
            action: uid(&record.action, "action")?,
            resource: uid(&record.resource, "resource")?,
            context: kept.context.clone().map(Arc::new),
            entities: Arc::from(kept.entities.as_slice()),
            reporter: kept.reporter,
            caller: None,
            fingerprints: None,
        };
        // The clock's facts as they were: supplied from the record's time, which only
        // a reporter may do.
        if let Some(facts) = snapshot.bundle.origins.action(request.action.id()) {
            let attrs: Vec<String> = facts.clock_attrs().map(|a| a.to_string()).collect();
            if !attrs.is_empty() {
                let context = Arc::make_mut(request.context.get_or_insert_with(Default::default));
                for attr in attrs {
                    context
                        .entry(attr)
                        .or_insert_with(|| Value::from(record.time_unix_ms / 1000));
                }
                request.reporter = true;
            }
        }
        Ok(self.decide_in(&snapshot, &request, None))
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
    pub(super) fn effective_context(
        &self,
        snapshot: &Snapshot,
        request: &Request,
    ) -> Result<Option<Map<String, Value>>, String> {
        let action = request.action.id();
        let Some(facts) = snapshot.bundle.origins.action(action) else {
            return Ok(request.context.as_deref().cloned());
        };
        if facts.reporter_only && !request.reporter {
            return Err(format!(
                "only a caller authorized to report facts may ask `{action}`: its context is facts the engine owns"
            ));
        }
        let mut context = request.context.as_deref().cloned().unwrap_or_default();
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
    pub(super) fn request_entities(
        snapshot: &Snapshot,
        items: &[Value],
    ) -> Result<RequestEntities, String> {
        let bundle = &snapshot.bundle;
        let converter = bundle.converter();
        let mut out = RequestEntities::with_capacity_and_hasher(items.len(), KeyedHash::default());
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

    pub(super) fn decide_in(
        &self,
        snapshot: &Snapshot,
        request: &Request,
        deadline: Option<Instant>,
    ) -> Decision {
        match self.prepare(snapshot, request) {
            Ok(mut prepared) => {
                prepared.deadline = deadline;
                self.decide_prepared(snapshot, request, &prepared, &request.resource, None)
            }
            Err(denied) => *denied,
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
    ) -> Result<Prepared, Box<Decision>> {
        let schema = &snapshot.bundle.schema;
        let context_json = self
            .effective_context(snapshot, request)
            .map_err(|e| Box::new(Decision::error(e)))?;
        let context = match &context_json {
            None => Context::empty(),
            Some(map) => Context::from_json_value(
                Value::Object(map.clone()),
                Some((schema, &request.action.0)),
            )
            .map_err(|e| Box::new(Decision::error(format!("invalid context: {e}"))))?,
        };
        let extra = if request.entities.is_empty() {
            RequestEntities::default()
        } else {
            Self::request_entities(snapshot, &request.entities)
                .map_err(|e| Box::new(Decision::error(e)))?
        };
        Ok(Prepared {
            context_json,
            context,
            extra,
            deadline: None,
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
        let principal: &EntityUID = request.principal.0.as_ref();
        let resource: &EntityUID = resource_uid.0.as_ref();
        let action: &EntityUID = request.action.0.as_ref();
        // With no context, a shape the schema accepted before is accepted again.
        let known_shape =
            context_json.is_none() && bundle.valid_shapes.accepted(principal, action, resource);
        let cedar_request = match cedar_policy::Request::new(
            request.principal.0.clone(),
            request.action.0.clone(),
            resource_uid.0.clone(),
            prepared.context.clone(),
            (!known_shape).then_some(schema),
        ) {
            Ok(r) => r,
            Err(e) => return Decision::error(format!("invalid request: {e}")),
        };
        if context_json.is_none() && !known_shape {
            bundle.valid_shapes.accept(principal, action, resource);
        }
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
            .filter_map(|(m, _)| facts.obligation(m))
            .collect();
        let score = if decision == Effect::Allow {
            determining
                .iter()
                .filter(|(m, fired)| *fired && !m.forbid)
                .fold(0i64, |sum, (m, _)| sum.saturating_add(m.score))
        } else {
            0
        };
        let (warnings, audit) = match bundle.watched_for(&request.action.0) {
            None => (Vec::new(), Vec::new()),
            Some(watched) => self.notices(bundle, watched, &cedar_request, &entities, &facts),
        };
        let cedar = Decision {
            warnings,
            audit,
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
                    prepared.deadline,
                )
            }
        }
    }

    /// The watched forbids (`warn` and `audit` mode) that fire on the request a
    /// decision was made for, with the same entities: each becomes a [`Notice`] in the
    /// list of its mode, with the obligations it would have imposed. A watched forbid
    /// that cannot be evaluated is a notice saying so (an enforcing one would deny).
    fn notices(
        &self,
        bundle: &crate::bundle::Bundle,
        watched: &cedar_policy::PolicySet,
        cedar_request: &cedar_policy::Request,
        entities: &Entities,
        facts: &Facts<'_>,
    ) -> (Vec<Notice>, Vec<Notice>) {
        let response = self
            .shared
            .authorizer
            .is_authorized(cedar_request, watched, entities);
        let mut warnings = Vec::new();
        let mut audit = Vec::new();
        // A fired policy's notice carries the obligation it would have imposed; a
        // failed one's, the error instead (its condition was never established).
        let mut push = |m: &PolicyMeta, error: Option<String>| {
            let notice = Notice {
                policy: m.id.clone(),
                message: facts.render(&m.message),
                severity: m.severity,
                obligations: if error.is_none() {
                    facts.obligation(m).into_iter().collect()
                } else {
                    Vec::new()
                },
                error,
            };
            match m.mode {
                Mode::Warn => warnings.push(notice),
                Mode::Audit => audit.push(notice),
                Mode::Enforce => {}
            }
        };
        for id in response.diagnostics().reason() {
            if let Some(m) = bundle.meta.get(id) {
                push(m, None);
            }
        }
        for err in response.diagnostics().errors() {
            let cedar_policy::AuthorizationError::PolicyEvaluationError(err) = err;
            if let Some(m) = bundle.meta.get(err.policy_id()) {
                push(m, Some(err.inner().to_string()));
            }
        }
        let order = |a: &Notice, b: &Notice| {
            b.severity
                .cmp(&a.severity)
                .then_with(|| a.policy.cmp(&b.policy))
        };
        warnings.sort_by(order);
        audit.sort_by(order);
        (warnings, audit)
    }

    /// Runs one plugin of the live set alone on `request`, as `decide` would call it,
    /// without Cedar: `None` if no plugin has that name. For benchmarks and debugging;
    /// not a stable API.
    #[cfg(feature = "bench-hooks")]
    pub fn decide_plugin_only(&self, name: &str, request: &Request) -> Option<Decision> {
        let snapshot = self.shared.current.load();
        let plugin = snapshot.bundle.plugins.by_name(name)?;
        let neutral = Decision {
            decision: Effect::Allow,
            reasons: Vec::new(),
            obligations: Vec::new(),
            errors: Vec::new(),
            score: 0,
            warnings: Vec::new(),
            audit: Vec::new(),
            unrecorded: false,
        };
        Some(crate::plugin::combine(
            std::slice::from_ref(plugin),
            request,
            request.context.as_deref(),
            &snapshot.plugin_entities,
            &snapshot.bundle.conventions,
            neutral,
            None,
        ))
    }

    /// Calls one plugin's `describe` in a fresh sandbox: the fixed cost of a call
    /// (store, instantiation). For benchmarks; not a stable API.
    #[cfg(feature = "bench-hooks")]
    pub fn describe_plugin(&self, name: &str) -> Option<bool> {
        let snapshot = self.shared.current.load();
        Some(snapshot.bundle.plugins.by_name(name)?.describe_ok())
    }
}

/// Entity values in a context: `{"__entity": ..}` or `{"type", "id"}` objects.
pub(super) fn context_refs(v: &Value, out: &mut Vec<EntityUID>, depth: usize) {
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
    pub(super) context_json: Option<Map<String, Value>>,
    pub(super) context: Context,
    pub(super) extra: RequestEntities,
    /// When plugin calls must have ended ([`DecideOptions::deadline`]).
    pub(super) deadline: Option<Instant>,
}

impl Prepared {
    /// The request's own entities (checked absent from the store when prepared).
    pub(crate) fn own_entities(&self) -> impl Iterator<Item = &EntityUID> {
        self.extra.keys()
    }
}

/// What a decision's reasons and obligations may name: the request, its slice and
/// its context.
pub(super) struct Facts<'a> {
    pub(super) principal: &'a cedar_policy::EntityUid,
    pub(super) resource: &'a cedar_policy::EntityUid,
    pub(super) entities: &'a Entities,
    pub(super) context: Option<&'a Map<String, Value>>,
}

impl Facts<'_> {
    /// The obligation `policy` imposes on this request, if it has one.
    pub(super) fn obligation(&self, policy: &PolicyMeta) -> Option<Obligation> {
        let spec = policy.obligation.as_ref()?;
        Some(Obligation {
            kind: spec.kind.clone(),
            target: spec.target.as_ref().and_then(|t| self.target(t)),
            parameters: spec
                .parameters
                .iter()
                .map(|(k, v)| (k.clone(), self.render(v)))
                .collect(),
            policy: policy.id.clone(),
        })
    }

    /// Follows a `@target` path through entity-valued attributes.
    pub(super) fn target(&self, path: &TargetPath) -> Option<String> {
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
    pub(super) fn render(&self, template: &MessageTemplate) -> String {
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

    pub(super) fn show(&self, path: &TargetPath) -> String {
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
