//! The validating decision: a workload's `admit` and `schedule` requests as an answer.

use probity::{DecideOptions, Decision, EntityUid, Request};

use super::Answer;
use super::workload::Workload;
use crate::AppState;
use crate::caller::Caller;
use crate::config::UnknownNodes;
use crate::error::ApiError;

pub(super) fn validate_workload(
    state: &AppState,
    caller: &Caller,
    uid: &str,
    w: &Workload,
    dry_run: bool,
    check_admit: bool,
) -> Answer {
    let request = |action: &str, resource: EntityUid| -> Result<Request, String> {
        Ok(Request::new(
            EntityUid::new("Workload", &w.id).map_err(|e| e.to_string())?,
            EntityUid::action(action).map_err(|e| e.to_string())?,
            resource,
        )
        .with_entities(vec![w.entity.clone()])
        .on_behalf_of(caller.0.as_str()))
    };
    let decide = |r: &Request| {
        // A dry run leaves no trace: no metrics, no records.
        if dry_run {
            Ok(state
                .engine()
                .decide_with(std::slice::from_ref(r), DecideOptions::new().dry_run())
                .settle()
                .pop()
                .unwrap_or_else(|| Decision::error("no decision")))
        } else {
            state.decide(caller, r)
        }
    };
    let mut warnings = Vec::new();
    let mut denials: Vec<String> = Vec::new();
    // What `warn` and `audit` policies found, whatever the decision.
    let mut found = Answer::allow(uid);
    let mut note = |d: &Decision, what: &str, warnings: &mut Vec<String>| {
        found.notices(d, what);
        if d.is_allowed() {
            for o in &d.obligations {
                warnings.push(format!(
                    "probity: {what}: obligation {}{} ({})",
                    o.kind,
                    o.target
                        .as_deref()
                        .map(|t| format!(" on {t}"))
                        .unwrap_or_default(),
                    o.policy
                ));
            }
        } else {
            denials.push(format!("{what}: {}", crate::placement::why_denied(d)));
        }
    };
    let namespace = match EntityUid::new("Namespace", &w.namespace) {
        Ok(n) => n,
        Err(e) => return Answer::deny(uid, 400, e.to_string()),
    };
    // Over the caller's budget of recorded decisions (429), or a decision the log
    // could not record (503): a refusal the apiserver can tell from a policy's deny,
    // never an unrecorded one.
    let over_budget = |e: ApiError| Answer::deny(uid, e.status().as_u16(), format!("probity: {e}"));
    match request("admit", namespace) {
        Ok(_) if !check_admit => {}
        Ok(r) => match decide(&r) {
            Ok(d) => note(
                &d,
                &format!("admit into namespace {}", w.namespace),
                &mut warnings,
            ),
            Err(e) => return over_budget(e),
        },
        Err(e) => return Answer::deny(uid, 400, e),
    }
    if let Some(node) = &w.node_name {
        let what = format!("schedule onto node {node}");
        let node_uid = match EntityUid::new("Node", node) {
            Ok(n) => n,
            Err(e) => return Answer::deny(uid, 400, e.to_string()),
        };
        // A node known only from the cluster (no telemetry yet) is as unknown to the
        // placement rules as one the store lacks.
        let absent = state.engine().entity(&node_uid).is_none();
        let unknown = (absent || state.engine().known_only_from_cluster(&node_uid))
            && !state.engine().blocked_nodes().contains_key(node);
        let warn_unknown = unknown && state.config().admission.unknown_nodes == UnknownNodes::Warn;
        if warn_unknown {
            let why = if absent {
                "is not in the entity store"
            } else {
                "has no telemetry yet (the store knows it only from the cluster)"
            };
            warnings.push(format!(
                "probity: node {node} {why}; the placement rules that read its facts were not checked (admission.unknown_nodes = \"warn\")"
            ));
        }
        // An unknown node is decided too: its placement rules cannot be evaluated, so
        // the decision is a deny that says so; under "warn" that deny alone becomes the
        // warning above, and any rule that does decide still does. A block's own
        // reason (from the blocklist) is added to the answer.
        let what = match state.engine().blocked_nodes().get(node) {
            Some(b) => format!("{what} (blocked: {})", b.reason),
            None => what,
        };
        match request(state.engine().conventions().schedule_action(), node_uid) {
            Ok(r) => match decide(&r) {
                Ok(d) if warn_unknown && denied_only_for_want_of_facts(&d) => {}
                Ok(d) => note(&d, &what, &mut warnings),
                Err(e) => return over_budget(e),
            },
            Err(e) => return Answer::deny(uid, 400, e),
        }
    }
    warnings.append(&mut found.warnings);
    let audit_annotations = found.audit_annotations;
    if denials.is_empty() {
        let mut a = Answer::allow(uid);
        a.warnings = warnings;
        a.audit_annotations = audit_annotations;
        a
    } else {
        let mut a = Answer::deny(
            uid,
            403,
            format!("probity denied {}: {}", w.name, denials.join(" | ")),
        );
        a.warnings = warnings;
        a.audit_annotations = audit_annotations;
        a.denials = denials;
        a
    }
}

/// Whether `d` is a deny only because rules could not be evaluated (what a node the
/// store holds no facts about gets): every reason is a rule that failed, and none fired.
fn denied_only_for_want_of_facts(d: &Decision) -> bool {
    let failed = |policy: &str| d.errors.iter().any(|e| e.policy.as_deref() == Some(policy));
    !d.is_allowed() && !d.errors.is_empty() && d.reasons.iter().all(|r| failed(&r.policy))
}
