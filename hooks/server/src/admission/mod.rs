//! Kubernetes admission: AdmissionReview v1 in, AdmissionReview v1 out.
//!
//! A Pod, or the pod template of a Deployment, ReplicaSet, StatefulSet, DaemonSet, Job,
//! ReplicationController or CronJob, becomes a request-scoped `Workload` entity and the
//! Cedar requests `admit` (into its Namespace) and, when `spec.nodeName` binds it,
//! `schedule` (onto that Node). The validating endpoint denies when any decision denies;
//! a `pods/binding` CREATE is checked against the node-level rules. The mutating
//! endpoint answers with a JSONPatch adding a required node affinity derived from the
//! policies' `schedule` decisions over every node Probity knows (see
//! [`crate::placement`]): no placement rule is restated here.

mod affinity;
mod binding;
mod quantity;
mod requests;
mod tolerations;
mod update;
mod validation;
mod workload;

pub(crate) use workload::{Workload, namespace_matches, pod_workload};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::api::json_body;
use crate::caller::Caller;
use crate::config::UnknownKinds;
use crate::error::ApiError;
use affinity::placement_patch;
use binding::{remember_pod, validate_binding};
use update::judge_update;
use validation::validate_workload;
use workload::{WorkloadId, pod_paths, workload};

const API_VERSION: &str = "admission.k8s.io/v1";

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Validate,
    Mutate,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Validate => "validate",
            Mode::Mutate => "mutate",
        }
    }
}

pub(crate) async fn validate(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    review_off_loop(state, caller_of(&ext), body, Mode::Validate).await
}

pub(crate) async fn mutate(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    review_off_loop(state, caller_of(&ext), body, Mode::Mutate).await
}

fn caller_of(ext: &Extensions) -> Caller {
    ext.get::<Caller>()
        .cloned()
        .unwrap_or_else(Caller::anonymous)
}

/// With a state store attached, a denying review waits for its decision records to
/// be committed, and a mutating review decides placement over every node, so those
/// run on the blocking pool rather than stalling an async worker; a validating review
/// without a state store runs in place.
async fn review_off_loop(
    state: AppState,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
    mode: Mode,
) -> Response {
    // The mutating review decides every node (placement), which can take milliseconds
    // when the decision cache is cold: never on an async worker either.
    if state.engine().state().is_none() && mode == Mode::Validate {
        return review(&state, &caller, body, mode);
    }
    tokio::task::spawn_blocking(move || review(&state, &caller, body, mode))
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "admission review task failed");
            ApiError::Internal.into_response()
        })
}

/// The response part of an AdmissionReview being built.
struct Answer {
    uid: String,
    allowed: bool,
    message: Option<String>,
    code: u16,
    warnings: Vec<String>,
    /// What `audit` policies found, by policy: the apiserver keeps these in its audit
    /// log under the webhook's name (`<webhook>/<policy id>`).
    audit_annotations: std::collections::BTreeMap<String, String>,
    patch: Option<Vec<Value>>,
    /// What the policies refused, one entry per decision (for comparing an UPDATE's
    /// object with its old object).
    denials: Vec<String>,
}

impl Answer {
    /// Adds what `decision`'s `warn` and `audit` policies found about `what` (one of
    /// the review's decisions): a warning each, and an audit annotation per policy.
    fn notices(&mut self, decision: &probity::Decision, what: &str) {
        for n in &decision.warnings {
            self.warnings.push(format!(
                "probity: {what}: {} ({}, warn mode)",
                n.message, n.policy
            ));
        }
        for n in &decision.audit {
            let value = format!("{what}: {}", n.message);
            self.audit_annotations
                .entry(audit_key(&n.policy))
                .and_modify(|v| {
                    v.push_str(" | ");
                    v.push_str(&value);
                })
                .or_insert(value);
        }
    }

    fn allow(uid: &str) -> Self {
        Self {
            uid: uid.to_owned(),
            allowed: true,
            message: None,
            code: 200,
            warnings: Vec::new(),
            audit_annotations: std::collections::BTreeMap::new(),
            patch: None,
            denials: Vec::new(),
        }
    }

    fn deny(uid: &str, code: u16, message: String) -> Self {
        Self {
            allowed: false,
            message: Some(message),
            code,
            ..Self::allow(uid)
        }
    }

    fn into_review(self) -> Value {
        let mut response = Map::new();
        response.insert("uid".into(), Value::String(self.uid));
        response.insert("allowed".into(), Value::Bool(self.allowed));
        if let Some(message) = self.message {
            response.insert(
                "status".into(),
                json!({"code": self.code, "message": message,
                       "reason": match self.code { 403 => "Forbidden", 429 => "TooManyRequests", 503 => "ServiceUnavailable", _ => "BadRequest" }}),
            );
        }
        if !self.warnings.is_empty() {
            response.insert("warnings".into(), json!(self.warnings));
        }
        if !self.audit_annotations.is_empty() {
            response.insert("auditAnnotations".into(), json!(self.audit_annotations));
        }
        if let Some(patch) = self.patch.filter(|p| !p.is_empty()) {
            let bytes = serde_json::to_vec(&patch).unwrap_or_default();
            response.insert("patchType".into(), Value::String("JSONPatch".into()));
            response.insert(
                "patch".into(),
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes)),
            );
        }
        json!({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response})
    }
}

/// A policy id as an audit annotation key: the apiserver prefixes it with the webhook's
/// name, and the result must be a qualified name (at most 63 characters of letters,
/// digits, `-`, `_` and `.`, beginning and ending with a letter or digit).
pub(crate) fn audit_key(policy: &str) -> String {
    let mapped: String = policy
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let trimmed = mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if trimmed.is_empty() {
        "policy".to_owned()
    } else {
        trimmed.to_owned()
    }
}

pub(crate) fn review(
    state: &AppState,
    caller: &Caller,
    body: Result<Bytes, BytesRejection>,
    mode: Mode,
) -> Response {
    let value = match json_body(state, body, "AdmissionReview") {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    // Without a uid no AdmissionReview answer is possible: a plain JSON error.
    let Some(uid) = value
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
    else {
        let why = if value.get("request").is_none_or(Value::is_null) {
            "AdmissionReview has no request"
        } else {
            "AdmissionReview request has no uid"
        };
        return ApiError::BadRequest(why.into()).into_response();
    };
    let answer = match (value.get("apiVersion"), value.get("kind")) {
        (Some(Value::String(v)), Some(Value::String(k)))
            if v == API_VERSION && k == "AdmissionReview" =>
        {
            match value.get("request") {
                Some(Value::Object(request)) => admit(state, caller, uid, request, mode),
                _ => Answer::deny(uid, 400, "AdmissionReview request is not an object".into()),
            }
        }
        (v, k) => Answer::deny(
            uid,
            400,
            format!(
                "expected apiVersion {API_VERSION} and kind AdmissionReview, found {} and {}",
                show(v),
                show(k)
            ),
        ),
    };
    state.metrics().record_review(mode.name(), answer.allowed);
    if !answer.allowed {
        tracing::info!(
            uid,
            endpoint = mode.name(),
            message = answer.message.as_deref().unwrap_or(""),
            "admission denied"
        );
    }
    Json(answer.into_review()).into_response()
}

fn show(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => format!("{s:?}"),
        Some(other) => other.to_string(),
        None => "nothing".into(),
    }
}

fn admit(
    state: &AppState,
    caller: &Caller,
    uid: &str,
    request: &Map<String, Value>,
    mode: Mode,
) -> Answer {
    let operation = request
        .get("operation")
        .and_then(Value::as_str)
        .unwrap_or("");
    let dry_run = request
        .get("dryRun")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let kind = request
        .get("kind")
        .and_then(|k| k.get("kind"))
        .and_then(Value::as_str)
        .unwrap_or("");
    if !matches!(operation, "CREATE" | "UPDATE") {
        return Answer::allow(uid);
    }
    let Some(object) = request.get("object").filter(|o| o.is_object()) else {
        let mut a = Answer::allow(uid);
        a.warnings.push(format!(
            "probity: {operation} of {kind} without an object; nothing checked"
        ));
        return a;
    };
    if kind == "Binding" {
        return match mode {
            Mode::Validate => validate_binding(state, caller, uid, request, object, dry_run),
            Mode::Mutate => Answer::allow(uid),
        };
    }
    let Some((spec_path, meta_path)) = pod_paths(kind) else {
        let message = format!("probity: kind {kind:?} holds no pod spec; not checked");
        return match (mode, state.config().admission.unknown_kinds) {
            (Mode::Validate, UnknownKinds::Deny) => Answer::deny(uid, 403, message),
            _ => {
                let mut a = Answer::allow(uid);
                a.warnings.push(message);
                a
            }
        };
    };
    let Some(spec) = object.pointer(spec_path).filter(|s| s.is_object()) else {
        return Answer::deny(uid, 400, format!("{kind} has no pod spec at {spec_path}"));
    };
    // A CREATE is named after its facts, so that the replicas of one template ask the
    // same question and all but the first are answered from the decision cache; an
    // UPDATE, judged for what it introduces, after its review.
    let naming = match (mode, operation) {
        (Mode::Validate, "UPDATE") => WorkloadId::Review,
        _ => WorkloadId::Content,
    };
    let mut workload = match workload(state, request, object, spec, meta_path, naming) {
        Ok(w) => w,
        Err(message) => return Answer::deny(uid, 400, message),
    };
    if mode == Mode::Validate && operation == "UPDATE" {
        // A bound pod is past scheduling: its placement was decided when it was
        // created (and bound); an update never decides it again.
        if kind == "Pod" {
            workload.node_name = None;
        }
        if let Some(answer) =
            judge_update(state, uid, request, object, spec_path, meta_path, &workload)
        {
            return answer;
        }
    }
    match mode {
        Mode::Validate => {
            let answer = validate_workload(state, caller, uid, &workload, dry_run, true);
            if answer.allowed && !dry_run && kind == "Pod" && operation == "CREATE" {
                remember_pod(state, request, object, &workload);
            }
            answer
        }
        Mode::Mutate => {
            let mut a = Answer::allow(uid);
            // A bound pod is past scheduling, and a pod's affinity cannot change after create.
            let pod_update = kind == "Pod" && operation == "UPDATE";
            // A DaemonSet's pod belongs on the one node its controller chose (its own
            // node affinity names it): a zone or host term on top could only leave it
            // Pending there. The validating webhook still judges its binding.
            let daemon = kind == "DaemonSet" || (kind == "Pod" && owned_by_daemon_set(object));
            if workload.node_name.is_none() && !pod_update && !daemon {
                match placement_patch(state, spec, spec_path, &workload) {
                    Ok((patch, warnings)) => {
                        a.patch = Some(patch);
                        a.warnings = warnings;
                    }
                    Err(message) => return Answer::deny(uid, 400, message),
                }
            }
            a
        }
    }
}

/// Whether a pod's controlling owner is a DaemonSet.
fn owned_by_daemon_set(pod: &Value) -> bool {
    pod.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .is_some_and(|owners| {
            owners.iter().any(|o| {
                o.get("kind").and_then(Value::as_str) == Some("DaemonSet")
                    && o.get("controller").and_then(Value::as_bool) == Some(true)
            })
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::audit_key;

    #[test]
    fn audit_keys_are_qualified_names_whatever_the_policy_id() {
        assert_eq!(
            audit_key("placement.driver-drift"),
            "placement.driver-drift"
        );
        assert_eq!(audit_key("a b/c"), "a-b-c");
        assert_eq!(audit_key("-x-"), "x");
        assert_eq!(audit_key("/"), "policy");
        let long = audit_key(&"p".repeat(100));
        assert_eq!(long.len(), 63);
    }
}
