//! Policy modes applied to a compiled set: `[modes]` checked against the policies,
//! and the set split into what decides and what is watched, a scoped policy made one
//! policy per scope (see [`crate::modes`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cedar_policy::{PolicyId, PolicySet, Schema, ValidationMode, Validator};
use serde_json::Value;

use super::PolicyMeta;
use crate::diagnostic::SourceDiagnostic;
use crate::modes::{Mode, ModeConfig, ModeScope, PolicyModes, ScopedMode};
use crate::source::SourceFile;

impl PolicyMeta {
    /// Whether this policy may take `mode`: a permit grants, so only a forbid has a
    /// mode other than `enforce`; a required policy always enforces.
    pub(super) fn check_mode(&self, mode: Mode) -> Result<(), String> {
        if mode == Mode::Enforce {
            return Ok(());
        }
        if !self.forbid {
            return Err(format!(
                "{} is a permit: a mode says what a forbid's firing does, and a permit only grants",
                self.id
            ));
        }
        if self.required {
            return Err(format!(
                "{} is required (@required, or the schema's @block_policy): it always enforces",
                self.id
            ));
        }
        Ok(())
    }
}

/// `[modes]` and the policies `[[mode_scope]]` names, checked against the set; the
/// overrides applied to `meta`.
pub(super) fn apply_mode_overrides(
    config: &ModeConfig,
    meta: &mut HashMap<PolicyId, Arc<PolicyMeta>>,
    file: &SourceFile,
    problems: &mut Vec<SourceDiagnostic>,
) {
    for o in &config.overrides {
        let Some(m) = meta.get_mut(&PolicyId::new(&o.policy)) else {
            problems.push(*file.at(
                o.span.clone(),
                format!("modes.{}: the set has no policy with this @id", o.policy),
            ));
            continue;
        };
        if let Err(why) = m.check_mode(o.mode) {
            problems.push(*file.at(o.span.clone(), format!("modes.{}: {why}", o.policy)));
            continue;
        }
        let m = Arc::make_mut(m);
        m.mode = o.mode;
        m.declared_in = file.name.clone();
        m.declared_path = file.path.clone();
    }
    for (i, scope) in config.scopes.iter().enumerate() {
        let name = format!("mode_scope[{i}]");
        let why = match meta.get(&PolicyId::new(&scope.policy)) {
            None => Some(format!(
                "the set has no policy with the @id {}",
                scope.policy
            )),
            Some(m) if m.required => Some(format!(
                "{} is required (@required, or the schema's @block_policy): it enforces everywhere, so it takes no scope",
                m.id
            )),
            Some(m) => m.check_mode(scope.mode).err(),
        };
        if let Some(why) = why {
            problems.push(*file.at(scope.span.clone(), format!("{name}: {why}")));
        }
    }
}

/// The set split by mode, scoped modes made policies of their own.
pub(super) struct Arranged {
    pub enforcing: PolicySet,
    pub watched: PolicySet,
    pub meta: HashMap<PolicyId, Arc<PolicyMeta>>,
    pub modes: BTreeMap<String, PolicyModes>,
}

/// Splits `policies` into the enforcing and the watched set; a policy with scopes
/// becomes one policy per scope and one for the rest (see [`crate::modes`]), each
/// validated strictly, a problem located at the scope's `when` in probity.toml.
pub(super) fn arrange_modes(
    policies: &PolicySet,
    meta: &HashMap<PolicyId, Arc<PolicyMeta>>,
    scopes: &[ModeScope],
    schema: &Schema,
    config: &SourceFile,
) -> Result<Arranged, Vec<SourceDiagnostic>> {
    let mut problems = Vec::new();
    let mut out = Arranged {
        enforcing: PolicySet::new(),
        watched: PolicySet::new(),
        meta: HashMap::with_capacity(meta.len()),
        modes: BTreeMap::new(),
    };
    // The conditions, parsed once: index in `scopes` -> the expression's JSON.
    let mut conditions: Vec<Option<Value>> = Vec::with_capacity(scopes.len());
    for (i, scope) in scopes.iter().enumerate() {
        match scope_condition(&scope.when) {
            Ok(c) => conditions.push(Some(c)),
            Err(why) => {
                problems.push(*config.at(
                    scope.when_span.clone(),
                    format!("mode_scope[{i}].when: {why}"),
                ));
                conditions.push(None);
            }
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let mut scoped_set = PolicySet::new();
    // A scoped policy's id -> the index of the scope whose condition it holds last.
    let mut scope_of: HashMap<PolicyId, usize> = HashMap::new();
    let place = |out: &mut Arranged, policy: cedar_policy::Policy, m: Arc<PolicyMeta>| {
        let set = if m.forbid && m.mode != Mode::Enforce {
            &mut out.watched
        } else {
            &mut out.enforcing
        };
        let id = policy.id().clone();
        // Ids are unique: the set's own, or the original's with a `#` suffix no @id has.
        let _ = set.add(policy);
        out.meta.insert(id, m);
    };
    for policy in policies.policies() {
        let Some(m) = meta.get(policy.id()) else {
            continue;
        };
        let mine: Vec<(usize, &ModeScope)> = scopes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.policy == m.id)
            .collect();
        out.modes.insert(
            m.id.clone(),
            PolicyModes {
                mode: m.mode,
                declared_in: m.declared_in.clone(),
                scoped: mine
                    .iter()
                    .map(|(_, s)| ScopedMode {
                        when: s.when.clone(),
                        mode: s.mode,
                    })
                    .collect(),
            },
        );
        if mine.is_empty() {
            place(&mut out, policy.clone(), Arc::clone(m));
            continue;
        }
        let Ok(json) = policy.to_json() else {
            continue;
        };
        let base: Vec<Value> = json
            .get("conditions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut unless: Vec<Value> = Vec::new();
        let variants = mine
            .iter()
            .map(|(i, s)| (Some(*i), Some(*s)))
            .chain(std::iter::once((None, None)));
        for (index, scope) in variants {
            let mut conds = base.clone();
            conds.extend(unless.iter().cloned());
            let (suffix, mode) = match (index, scope) {
                (Some(i), Some(s)) => {
                    let body = conditions.get(i).cloned().flatten().unwrap_or(Value::Null);
                    conds.push(serde_json::json!({"kind": "when", "body": body.clone()}));
                    unless.push(serde_json::json!({"kind": "unless", "body": body}));
                    (format!("#scope{i}"), s.mode)
                }
                _ => ("#unscoped".to_owned(), m.mode),
            };
            let mut variant = json.clone();
            if let Some(o) = variant.as_object_mut() {
                o.insert("conditions".into(), Value::Array(conds));
            }
            let id = PolicyId::new(format!("{}{suffix}", m.id));
            let at = index.or_else(|| mine.first().map(|(i, _)| *i)).unwrap_or(0);
            match cedar_policy::Policy::from_json(Some(id.clone()), variant) {
                Ok(p) => {
                    let _ = scoped_set.add(p.clone());
                    scope_of.insert(id, at);
                    let mut vm = PolicyMeta::clone(m);
                    vm.mode = mode;
                    if index.is_some() {
                        vm.declared_in = config.name.clone();
                        vm.declared_path = config.path.clone();
                    }
                    place(&mut out, p, Arc::new(vm));
                }
                Err(e) => {
                    if let Some(s) = scopes.get(at) {
                        problems.push(
                            *config.at(s.when_span.clone(), format!("mode_scope[{at}].when: {e}")),
                        );
                    }
                }
            }
        }
    }
    if !scoped_set.is_empty() {
        let result = Validator::new(schema.clone()).validate(&scoped_set, ValidationMode::Strict);
        for err in result.validation_errors() {
            let at = scope_of.get(err.policy_id()).copied().unwrap_or(0);
            if let Some(s) = scopes.get(at) {
                problems
                    .push(*config.at(s.when_span.clone(), format!("mode_scope[{at}].when: {err}")));
            }
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        problems.dedup_by(|a, b| a.message == b.message);
        Err(problems)
    }
}

/// A scope's `when` as the JSON of one Cedar expression.
fn scope_condition(text: &str) -> Result<Value, String> {
    let policy = cedar_policy::Policy::parse(
        None,
        format!("permit (principal, action, resource) when {{ {text} }};"),
    )
    .map_err(|e| format!("not a Cedar expression: {e}"))?;
    let json = policy.to_json().map_err(|e| e.to_string())?;
    match json
        .get("conditions")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    {
        Some([only]) if only.get("kind").and_then(Value::as_str) == Some("when") => only
            .get("body")
            .cloned()
            .ok_or_else(|| "not a Cedar expression".to_owned()),
        _ => Err(
            "not one Cedar expression (write the condition alone, as `when { ... }` holds it)"
                .into(),
        ),
    }
}
