//! A compiled policy set: policies, schema and settings, checked together and
//! swapped in as one value. Everything a decision needs that does not change per
//! request is prepared here, at load time, not on the hot path.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::SystemTime;

use cedar_policy::{
    ActionConstraint, Effect, EntityUid, PolicyId, PolicySet, Schema, ValidationMode, Validator,
};
use cedar_policy_core::ast::{self, EntityType};
use cedar_policy_core::validator::ValidatorSchema;
use serde_json::Value;
use sha2::{Digest, Sha256};
use smol_str::SmolStr;

use crate::conformance::TypeDescriptions;
use crate::conventions::Conventions;
use crate::decision::Severity;
use crate::diagnostic::SourceDiagnostic;
use crate::error::LoadError;
use crate::facts::FactOrigins;
use crate::modes::{Mode, ModeConfig, PolicyModes};

mod arrange;
mod shapes;
use crate::plugin::PluginSet;
use crate::settings::SettingsSchema;
use crate::source::{Origin, SourceFile, Sources};
use crate::store::{Converter, Stored};
use arrange::{Arranged, apply_mode_overrides, arrange_modes};
pub(crate) use shapes::ValidShapes;

/// Where an obligation points: the principal or resource, optionally followed
/// through entity-valued attributes (`resource.zone`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetPath {
    pub root: TargetRoot,
    pub attrs: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TargetRoot {
    Principal,
    Resource,
    /// Only in message placeholders: a context attribute.
    Context,
}

/// A message or obligation parameter: plain text, or text with `{path}` placeholders
/// (`{resource.gpuModel}`, `{context.port}`) filled from the decision's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MessageTemplate {
    Plain(String),
    Parts(Vec<MessagePart>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MessagePart {
    Text(String),
    Path(TargetPath),
}

impl MessageTemplate {
    /// Reads `text`; `{` and `}` are written `{{` and `}}`.
    fn parse(text: &str) -> Result<Self, String> {
        if !text.contains(['{', '}']) {
            return Ok(Self::Plain(text.to_owned()));
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let mut path = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => path.push(c),
                            None => return Err(format!("\"{text}\": a `{{` is never closed")),
                        }
                    }
                    if !literal.is_empty() {
                        parts.push(MessagePart::Text(std::mem::take(&mut literal)));
                    }
                    parts.push(MessagePart::Path(parse_path(path.trim(), true)?));
                }
                '}' => return Err(format!("\"{text}\": a `}}` has no `{{` (write `}}}}`)")),
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(MessagePart::Text(literal));
        }
        Ok(Self::Parts(parts))
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ObligationSpec {
    pub kind: String,
    pub target: Option<TargetPath>,
    pub parameters: BTreeMap<String, MessageTemplate>,
}

/// What the annotations of one policy say, read once at load time.
#[derive(Debug, Clone)]
pub(crate) struct PolicyMeta {
    pub id: String,
    pub forbid: bool,
    pub severity: Severity,
    pub message: MessageTemplate,
    pub obligation: Option<ObligationSpec>,
    /// `@score("N")` of a permit policy: what its allow adds to the decision's score.
    pub score: i64,
    /// `@required`, or the schema's `@block_policy`: no reload may drop it, and it
    /// always enforces.
    pub required: bool,
    /// What its firing does (`@mode`, `[modes]` or a `[[mode_scope]]` of probity.toml).
    pub mode: Mode,
    /// The file that declared `mode` (a policy file, probity.toml), or `default`.
    pub declared_in: String,
    /// That file's path, when it has one (for its owner, when a reload lowers a mode).
    pub declared_path: Option<std::path::PathBuf>,
}

/// A loaded, validated policy set.
pub(crate) struct Bundle {
    /// The policies that decide: every permit and the forbids that enforce.
    pub policies: PolicySet,
    /// For each action in the schema, only the policies whose action scope can match it.
    /// Cedar skips a policy whose scope fails anyway; slicing at load time spares every
    /// decision the walk over the other actions' policies.
    pub by_action: HashMap<EntityUid, PolicySet>,
    /// The forbids in `warn` or `audit` mode: evaluated after the decision, with the
    /// same entities, into its `warnings` and `audit`; empty in an all-enforcing set.
    pub watched: PolicySet,
    /// `watched` sliced per action, as `by_action`.
    pub watched_by_action: HashMap<EntityUid, PolicySet>,
    /// Each policy id's modes (its own and its scopes').
    pub modes: BTreeMap<String, PolicyModes>,
    pub schema: Schema,
    pub meta: HashMap<PolicyId, Arc<PolicyMeta>>,
    /// Which facts the engine owns, from the schema's `@owned` annotations.
    pub origins: FactOrigins,
    /// Each entity type's description for the conformance check, made once.
    pub descriptions: TypeDescriptions,
    /// The names the engine acts on (obligation kinds, the verified read).
    pub conventions: Arc<Conventions>,
    /// The blocklist's entity type and attribute, parsed.
    pub blocklist: Option<(EntityType, SmolStr)>,
    /// `Settings::"active"` and the `GpuModel`s, from the configuration.
    pub settings: Vec<(ast::EntityUID, Arc<Stored>)>,
    /// Entity literals of the policies that can apply to each action: slice roots.
    pub literals: HashMap<EntityUid, Vec<ast::EntityUID>>,
    /// Entity literals of every policy, for actions the schema does not know.
    pub all_literals: Vec<ast::EntityUID>,
    /// The schema's action entities, when it has action groups (slices need them for
    /// `action in ...`); else empty.
    pub action_entities: Vec<Arc<ast::Entity>>,
    /// The plugins of `plugins.toml`, if any, loaded and pre-instantiated.
    pub plugins: PluginSet,
    pub digest: String,
    pub files: Vec<String>,
    pub loaded_at: SystemTime,
    /// The seal the set was checked against, in sealed mode.
    pub seal: Option<Arc<crate::policy_seal::LoadedSeal>>,
    /// Request shapes with no context that the schema accepted.
    pub valid_shapes: ValidShapes,
}

impl Bundle {
    /// Parses, checks and validates every source; reports every problem found, located.
    pub fn compile(sources: &Sources) -> Result<Self, LoadError> {
        let mut problems = Vec::new();
        // The schema's annotations, read from its JSON form; a schema that does not
        // parse declares nothing (the compiler below says why).
        let schema_json = crate::facts::schema_json(&sources.schema.text);
        let json = schema_json.as_ref();
        let origins = json
            .map(|j| FactOrigins::from_json(j, &sources.schema))
            .transpose()
            .map_err(|found| problems.extend(found))
            .ok()
            .flatten()
            .unwrap_or_default();
        let conventions = json
            .map(|j| Conventions::read(j, &sources.schema))
            .transpose()
            .map_err(|found| problems.extend(found))
            .ok()
            .flatten()
            .unwrap_or_default();
        // The configuration is read against the schema's configuration types; with a
        // schema that does not parse there is nothing to read it against.
        let config = json
            .map(|j| SettingsSchema::from_json(j, &sources.schema))
            .transpose()
            .map_err(|found| problems.extend(found))
            .ok()
            .flatten()
            .and_then(|settings| {
                settings
                    .read(&sources.config.name, &sources.config.text)
                    .map_err(|d| problems.push(*d))
                    .ok()
            });
        let schema = match Schema::from_cedarschema_str(&sources.schema.text) {
            Ok((schema, _warnings)) => Some(schema),
            Err(e) => {
                problems.push(SourceDiagnostic::from_diagnostic(
                    &sources.schema.name,
                    &sources.schema.text,
                    &e,
                ));
                None
            }
        };

        let mut policies = PolicySet::new();
        let mut meta = HashMap::new();
        // Policy id -> (file, span) so that validation errors can be located.
        let mut origin: HashMap<PolicyId, (usize, (usize, usize))> = HashMap::new();
        for (file_index, file) in sources.policies.iter().enumerate() {
            let parsed = match PolicySet::from_str(&file.text) {
                Ok(p) => p,
                Err(errors) => {
                    problems.extend(
                        errors
                            .iter()
                            .map(|e| SourceDiagnostic::from_diagnostic(&file.name, &file.text, e)),
                    );
                    continue;
                }
            };
            let spans = policy_spans(&file.text);
            let count = parsed.policies().count();
            for index in 0..count {
                let span = spans.get(index).copied().unwrap_or((0, 0));
                let locate = |message: String| {
                    SourceDiagnostic::new(&file.name, &file.text, span.0, span.1, message)
                };
                let Some(policy) = parsed.policy(&PolicyId::new(format!("policy{index}"))) else {
                    continue;
                };
                let m = match read_meta(policy, file, index, &conventions) {
                    Ok(m) => m,
                    Err(message) => {
                        problems.push(locate(message));
                        continue;
                    }
                };
                let id = PolicyId::new(&m.id);
                if meta.contains_key(&id) {
                    problems.push(locate(format!("policy id {} is used twice", m.id)));
                    continue;
                }
                if let Err(e) = policies.add(policy.new_id(id.clone())) {
                    problems.push(locate(e.to_string()));
                    continue;
                }
                origin.insert(id.clone(), (file_index, span));
                meta.insert(id, Arc::new(m));
            }
        }

        // `[modes]` and `[[mode_scope]]` of probity.toml: checked against the set here,
        // applied once it validates.
        let mode_config = ModeConfig::read(&sources.config)
            .map_err(|found| problems.extend(found))
            .unwrap_or_default();
        apply_mode_overrides(&mode_config, &mut meta, &sources.config, &mut problems);

        // The blocklist's enforcement is not left to the files: the schema names its
        // policy, and a set without it (or with it as a permit) never loads.
        if let Some(block) = conventions.block_policy()
            && problems.is_empty()
        {
            let why = match meta.get(&PolicyId::new(block)) {
                None => Some("is not in the set"),
                Some(m) if !m.forbid => Some("is a permit, not a forbid"),
                Some(_) => None,
            };
            if let Some(why) = why {
                let needle = "@block_policy";
                let offset = sources.schema.text.find(needle).unwrap_or(0);
                problems.push(SourceDiagnostic::new(
                    &sources.schema.name,
                    &sources.schema.text,
                    offset,
                    needle.len(),
                    format!(
                        "the block policy {block:?} (@block_policy) {why}: without it a blocked node could take part in any request"
                    ),
                ));
            }
        }

        let mut settings = Vec::new();
        // Entity types with attributes the cluster owns are shared between sources, so
        // the store holds them with whatever attributes they have.
        let partial: HashSet<String> = origins.cluster_attrs.keys().cloned().collect();
        let descriptions = schema
            .as_ref()
            .map(|s| TypeDescriptions::with_partial(s.as_ref(), &partial));
        if let (Some(schema), Some(descriptions), true) =
            (&schema, &descriptions, problems.is_empty())
        {
            let result = Validator::new(schema.clone()).validate(&policies, ValidationMode::Strict);
            for err in result.validation_errors() {
                let Some((file_index, span)) = origin.get(err.policy_id()) else {
                    continue;
                };
                let Some(file) = sources.policies.get(*file_index) else {
                    continue;
                };
                let mut d = SourceDiagnostic::from_diagnostic(&file.name, &file.text, err);
                if d.span() == (0, 0) {
                    d = SourceDiagnostic::new(
                        &file.name,
                        &file.text,
                        span.0,
                        span.1,
                        d.message.clone(),
                    )
                    .with_help(d.help.clone());
                }
                problems.push(d);
            }
            if let Some(config) = &config {
                let converter = Converter::new(schema.as_ref(), &origins, descriptions);
                for item in config.entities_json().as_array().into_iter().flatten() {
                    match converter.entity(item) {
                        Ok(c) => settings.push((c.uid, Arc::new(c.stored))),
                        Err((uid, e)) => problems.push(SourceDiagnostic::new(
                            &sources.config.name,
                            &sources.config.text,
                            0,
                            0,
                            format!(
                                "the configuration does not fit the schema's {} entity: {e}",
                                uid.as_deref().unwrap_or("configuration")
                            ),
                        )),
                    }
                }
            }
        }

        let mut plugins = PluginSet::default();
        if let (Some(schema), Some(manifest)) = (&schema, &sources.plugins) {
            match PluginSet::load(manifest, schema) {
                Ok(set) => plugins = set,
                Err(found) => problems.extend(found),
            }
        }

        let arranged = match (&schema, problems.is_empty()) {
            (Some(schema), true) => {
                match arrange_modes(
                    &policies,
                    &meta,
                    &mode_config.scopes,
                    schema,
                    &sources.config,
                ) {
                    Ok(arranged) => Some(arranged),
                    Err(found) => {
                        problems.extend(found);
                        None
                    }
                }
            }
            _ => None,
        };

        match (schema, descriptions, arranged, problems.is_empty()) {
            (Some(schema), Some(descriptions), Some(arranged), true) => {
                let Arranged {
                    enforcing,
                    watched,
                    meta,
                    modes,
                } = arranged;
                let by_action = slice_by_action(&enforcing, &schema);
                let watched_by_action = slice_by_action(&watched, &schema);
                // A decision's slice holds what every policy it evaluates may name.
                let mut all = enforcing.clone();
                for p in watched.policies() {
                    let _ = all.add(p.clone());
                }
                let all_by_action = slice_by_action(&all, &schema);
                Ok(Self {
                    literals: literals_by_action(&all, &all_by_action),
                    by_action,
                    watched,
                    watched_by_action,
                    modes,
                    all_literals: literals_of(&all),
                    action_entities: action_entities(&schema),
                    blocklist: origins.blocklist.as_ref().and_then(|b| {
                        Some((crate::store::entity_type(&b.entity_type)?, b.attr.clone()))
                    }),
                    origins,
                    descriptions,
                    conventions: Arc::new(conventions),
                    policies: enforcing,
                    schema,
                    meta,
                    settings,
                    digest: digest(sources, &plugins),
                    plugins,
                    files: sources.policies.iter().map(|f| f.name.clone()).collect(),
                    loaded_at: SystemTime::now(),
                    seal: None,
                    valid_shapes: ValidShapes::default(),
                })
            }
            _ => Err(LoadError::Invalid { problems }),
        }
    }

    pub fn policy_count(&self) -> usize {
        self.modes.len()
    }

    /// The forbids in `warn` or `audit` mode that can apply to `action`, if any.
    pub fn watched_for(&self, action: &EntityUid) -> Option<&PolicySet> {
        if self.watched.is_empty() {
            return None;
        }
        let set = if self.watched_by_action.is_empty() {
            &self.watched
        } else {
            self.watched_by_action.get(action)?
        };
        (!set.is_empty()).then_some(set)
    }

    /// The policies that can apply to `action`: its slice, or the whole set for an
    /// action the schema does not know (validation then rejects the request anyway).
    pub fn policies_for(&self, action: &EntityUid) -> &PolicySet {
        self.by_action.get(action).unwrap_or(&self.policies)
    }

    /// The entity literals of the policies that can apply to `action`.
    pub fn literals_for(&self, action: &EntityUid) -> &[ast::EntityUID] {
        self.literals.get(action).unwrap_or(&self.all_literals)
    }

    /// The store's converter for entities under this policy set.
    pub fn converter(&self) -> Converter<'_> {
        Converter::new(self.validator_schema(), &self.origins, &self.descriptions)
    }

    /// The schema in Cedar's internal form, for the store's converter.
    pub fn validator_schema(&self) -> &ValidatorSchema {
        self.schema.as_ref()
    }

    /// The blocklist's type (as written) and attribute, for plugin entity JSON.
    pub fn blocklist_target(&self) -> Option<(String, SmolStr)> {
        self.origins
            .blocklist
            .as_ref()
            .map(|b| (b.entity_type.clone(), b.attr.clone()))
    }
}

/// Every entity literal in `policies` (scope constraints and conditions): the
/// entities a policy can name without reaching them through the request.
fn literals_of(policies: &PolicySet) -> Vec<ast::EntityUID> {
    let mut out: Vec<ast::EntityUID> = Vec::new();
    for p in policies.policies() {
        if let Ok(json) = p.to_json() {
            collect_literals(&json, &mut out, 0);
        }
    }
    out.sort();
    out.dedup();
    out
}

fn collect_literals(v: &Value, out: &mut Vec<ast::EntityUID>, depth: usize) {
    if depth > 256 {
        return;
    }
    match v {
        Value::Object(o) => {
            let is_uid = o.contains_key("__entity")
                || (o.len() == 2
                    && o.get("type").is_some_and(Value::is_string)
                    && o.get("id").is_some_and(Value::is_string));
            if is_uid {
                if let Ok(u) = crate::store::parse_uid(v) {
                    out.push(u);
                }
                return;
            }
            for x in o.values() {
                collect_literals(x, out, depth + 1);
            }
        }
        Value::Array(a) => {
            for x in a {
                collect_literals(x, out, depth + 1);
            }
        }
        _ => {}
    }
}

/// The literals of each action's slice, from each policy's literals read once.
fn literals_by_action(
    policies: &PolicySet,
    by_action: &HashMap<EntityUid, PolicySet>,
) -> HashMap<EntityUid, Vec<ast::EntityUID>> {
    let per_policy: HashMap<PolicyId, Vec<ast::EntityUID>> = policies
        .policies()
        .map(|p| {
            let mut found = Vec::new();
            if let Ok(json) = p.to_json() {
                collect_literals(&json, &mut found, 0);
            }
            (p.id().clone(), found)
        })
        .collect();
    by_action
        .iter()
        .map(|(action, set)| {
            let mut all: Vec<ast::EntityUID> = set
                .policies()
                .filter_map(|p| per_policy.get(p.id()))
                .flatten()
                .cloned()
                .collect();
            all.sort();
            all.dedup();
            (action.clone(), all)
        })
        .collect()
}

fn action_entities(schema: &Schema) -> Vec<Arc<ast::Entity>> {
    if schema.action_groups().next().is_none() {
        return Vec::new();
    }
    match schema.action_entities() {
        Ok(entities) => entities
            .iter()
            .map(|e| Arc::new(<cedar_policy::Entity as AsRef<ast::Entity>>::as_ref(e).clone()))
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn slice_by_action(policies: &PolicySet, schema: &Schema) -> HashMap<EntityUid, PolicySet> {
    // With action groups, `action in [group]` matches members; slicing would need the
    // hierarchy. Keep it exact and simple: no slicing when the schema has groups.
    if schema.action_groups().next().is_some() {
        return HashMap::new();
    }
    // Within an action's slice every policy's action constraint holds (it was put
    // there for matching), so each goes in with its constraint dropped: Cedar rebuilds
    // and evaluates a policy's whole scope on every request, and `action in [..]`
    // makes a set each time. A policy whose copy cannot be made goes in as it is.
    let any_action: HashMap<&PolicyId, cedar_policy::Policy> = policies
        .policies()
        .filter(|p| !matches!(p.action_constraint(), ActionConstraint::Any))
        .filter_map(|p| Some((p.id(), without_action_constraint(p)?)))
        .collect();
    let mut out = HashMap::new();
    for action in schema.actions() {
        let mut slice = PolicySet::new();
        for p in policies.policies() {
            let applies = match p.action_constraint() {
                ActionConstraint::Any => true,
                ActionConstraint::Eq(a) => &a == action,
                ActionConstraint::In(list) => list.contains(action),
            };
            let p = any_action.get(p.id()).unwrap_or(p);
            if applies && slice.add(p.clone()).is_err() {
                // Cannot happen (ids are unique in the source set); fall back to the whole set.
                return HashMap::new();
            }
        }
        out.insert(action.clone(), slice);
    }
    out
}

/// `policy` with `action` for its action constraint, the rest (id, annotations,
/// conditions) the same.
fn without_action_constraint(policy: &cedar_policy::Policy) -> Option<cedar_policy::Policy> {
    let mut json = policy.to_json().ok()?;
    json.as_object_mut()?
        .insert("action".into(), serde_json::json!({"op": "All"}));
    cedar_policy::Policy::from_json(Some(policy.id().clone()), json).ok()
}

fn read_meta(
    policy: &cedar_policy::Policy,
    file: &SourceFile,
    index: usize,
    conventions: &Conventions,
) -> Result<PolicyMeta, String> {
    let forbid = policy.effect() == Effect::Forbid;
    let annotation = |key: &str| policy.annotation(key).map(str::to_owned);
    let require = |key: &str| {
        annotation(key).ok_or_else(|| format!("forbid policy has no @{key} annotation; every forbid needs @id, @severity and @message"))
    };
    let id = if forbid {
        require("id")?
    } else {
        annotation("id").unwrap_or_else(|| format!("{}#{index}", file.name))
    };
    if id.trim().is_empty() {
        return Err("@id must not be empty".into());
    }
    let severity = match if forbid {
        Some(require("severity")?)
    } else {
        annotation("severity")
    } {
        Some(s) => Severity::from_str(&s).map_err(|()| {
            format!("@severity(\"{s}\") is not one of info, low, medium, high, critical")
        })?,
        None => Severity::Info,
    };
    let message = MessageTemplate::parse(&if forbid {
        require("message")?
    } else {
        annotation("message").unwrap_or_default()
    })?;
    let obligation = match annotation("obligation") {
        None => {
            if annotation("target").is_some() {
                return Err("@target without @obligation".into());
            }
            None
        }
        Some(kind) => {
            if !conventions.knows_obligation(&kind) {
                return Err(format!(
                    "@obligation(\"{kind}\") is not a known kind ({})",
                    conventions
                        .obligation_kinds()
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            let target = annotation("target").map(|t| parse_target(&t)).transpose()?;
            let parameters = policy
                .annotations()
                .filter_map(|(k, v)| {
                    k.strip_prefix("param_")
                        .map(|k| MessageTemplate::parse(v).map(|t| (k.to_owned(), t)))
                })
                .collect::<Result<_, _>>()?;
            if kind == conventions.block_obligation() {
                check_block_parameters(&parameters)?;
            }
            Some(ObligationSpec {
                kind,
                target,
                parameters,
            })
        }
    };
    let score = match annotation("score") {
        None => 0,
        Some(_) if forbid => {
            return Err("@score is for permit policies: a forbid's deny has no rank".into());
        }
        Some(text) => text
            .trim()
            .parse::<i64>()
            .ok()
            .filter(|n| n.unsigned_abs() <= 1_000_000)
            .ok_or_else(|| {
                format!("@score(\"{text}\") is not a whole number between -1000000 and 1000000")
            })?,
    };
    let required =
        annotation("required").is_some() || conventions.block_policy() == Some(id.as_str());
    let mut meta = PolicyMeta {
        id,
        forbid,
        severity,
        message,
        obligation,
        score,
        required,
        mode: Mode::Enforce,
        declared_in: if required { "required" } else { "default" }.to_owned(),
        declared_path: None,
    };
    if let Some(text) = annotation("mode") {
        let mode = text
            .parse::<Mode>()
            .map_err(|why| format!("@mode(\"{text}\"): {why}"))?;
        meta.check_mode(mode)
            .map_err(|why| format!("@mode(\"{text}\"): {why}"))?;
        meta.mode = mode;
        meta.declared_in = file.name.clone();
        meta.declared_path = file.path.clone();
    }
    Ok(meta)
}

/// A block obligation's `@param_stop` and `@param_taint_effect` say what the cluster
/// manager does to the node's work: only the values it knows, so that a typo is a load
/// error, not a block that stops the wrong pods (or evicts when no one opted in).
fn check_block_parameters(parameters: &BTreeMap<String, MessageTemplate>) -> Result<(), String> {
    use crate::block::{STOP_NODE, STOP_READER, TAINT_EFFECTS};
    let literal = |key: &str| match parameters.get(key) {
        None => Ok(None),
        Some(MessageTemplate::Plain(text)) => Ok(Some(text.clone())),
        Some(MessageTemplate::Parts(_)) => Err(format!(
            "@param_{key} of a block obligation must be plain text, not a placeholder"
        )),
    };
    if let Some(stop) = literal("stop")?
        && stop != STOP_READER
        && stop != STOP_NODE
    {
        return Err(format!(
            "@param_stop(\"{stop}\") is not \"{STOP_READER}\" (the reading workload's pods) or \"{STOP_NODE}\" (every pod on the node)"
        ));
    }
    if let Some(effect) = literal("taint_effect")?
        && !TAINT_EFFECTS.contains(&effect.as_str())
    {
        return Err(format!(
            "@param_taint_effect(\"{effect}\") is not one of {}",
            TAINT_EFFECTS.join(", ")
        ));
    }
    Ok(())
}

fn parse_target(text: &str) -> Result<TargetPath, String> {
    parse_path(text, false).map_err(|e| format!("@target(\"{text}\") {e}"))
}

/// `principal`, `resource` (or, in messages, `context`) followed by `.attr`s.
fn parse_path(text: &str, in_message: bool) -> Result<TargetPath, String> {
    let mut parts = text.split('.');
    let root = match parts.next() {
        Some("principal") => TargetRoot::Principal,
        Some("resource") => TargetRoot::Resource,
        Some("context") if in_message => TargetRoot::Context,
        _ if in_message => {
            return Err(format!(
                "placeholder {{{text}}} must start with principal, resource or context"
            ));
        }
        _ => return Err("must start with principal or resource".into()),
    };
    let attrs: Vec<String> = parts.map(str::to_owned).collect();
    if attrs.iter().any(|a| a.is_empty()) {
        return Err(if in_message {
            format!("placeholder {{{text}}} has an empty attribute name")
        } else {
            "has an empty attribute name".into()
        });
    }
    Ok(TargetPath { root, attrs })
}

/// SHA-256 over every source, named and length-prefixed, in load order, then over
/// every plugin component's name and hash.
fn digest(sources: &Sources, plugins: &PluginSet) -> String {
    let mut h = Sha256::new();
    let files = std::iter::once(&sources.schema)
        .chain(std::iter::once(&sources.config))
        .chain(sources.policies.iter())
        .chain(sources.plugins.iter().map(|m| &m.file));
    for f in files {
        h.update((f.name.len() as u64).to_be_bytes());
        h.update(f.name.as_bytes());
        h.update((f.text.len() as u64).to_be_bytes());
        h.update(f.text.as_bytes());
    }
    plugins.digest_into(&mut h);
    hex::encode(h.finalize())
}

/// Byte span of each policy in a file, in order: from its first token (an
/// annotation or the effect) to its closing `;`. Skips comments and strings so
/// that a `;` inside them does not count. Used only to locate problems.
pub(crate) fn policy_spans(text: &str) -> Vec<(usize, usize)> {
    let bytes = text.as_bytes();
    let mut spans = Vec::new();
    let mut depth = 0i32;
    let mut start: Option<usize> = None;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while bytes.get(i).is_some_and(|&c| c != b'\n') {
                    i += 1;
                }
                continue;
            }
            b'"' => {
                start.get_or_insert(i);
                i += 1;
                while let Some(&c) = bytes.get(i) {
                    i += if c == b'\\' { 2 } else { 1 };
                    if c == b'"' {
                        break;
                    }
                }
                continue;
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            b';' if depth == 0 => {
                if let Some(s) = start.take() {
                    spans.push((s, i + 1 - s));
                }
            }
            c if c.is_ascii_whitespace() => {}
            _ => {}
        }
        if !b.is_ascii_whitespace() && b != b';' {
            start.get_or_insert(i);
        }
        i += 1;
    }
    spans
}

/// Every file the set from `origin` is built from, plugin components included (see
/// [`Origin::set_files`]).
pub(crate) fn set_files(origin: &Origin) -> Result<Vec<std::path::PathBuf>, LoadError> {
    origin.set_files(crate::plugin::component_paths)
}

/// The bytes of a file of a policy set: a source or a plugin component (whichever limit
/// is larger).
pub(crate) fn read_set_file(path: &std::path::Path) -> Result<Vec<u8>, LoadError> {
    crate::source::read_limited_bytes(
        path,
        crate::source::MAX_SOURCE_BYTES.max(crate::plugin::MAX_PLUGIN_BYTES),
    )
}

#[cfg(test)]
mod tests;
