//! A `pods/binding` CREATE, judged with the facts remembered at the pod's admission.

use serde_json::{Map, Value, json};

use super::Answer;
use super::validation::validate_workload;
use super::workload::{Workload, WorkloadId, workload};
use crate::AppState;
use crate::caller::Caller;

/// A `pods/binding` CREATE: the scheduler (or anyone allowed to bind) placing a pod on
/// a node. The Binding names only the pod and the node, and the webhook cannot fetch
/// the pod, so the pod is judged as an unknown workload of the default class asking
/// for nothing: the node-level rules (blocked, driver drift, temperature, zone
/// ceiling) apply; the pod's own facts were judged when it was admitted and filtered.
pub(super) fn validate_binding(
    state: &AppState,
    caller: &Caller,
    uid: &str,
    request: &Map<String, Value>,
    object: &Value,
    dry_run: bool,
) -> Answer {
    let Some(node) = object
        .pointer("/target/name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    else {
        return Answer::deny(uid, 400, "Binding has no target.name".into());
    };
    let meta = object.get("metadata");
    let namespace = text_at(request.get("namespace"))
        .or_else(|| text_at(meta.and_then(|m| m.get("namespace"))))
        .unwrap_or("default");
    let name = text_at(meta.and_then(|m| m.get("name"))).or_else(|| text_at(request.get("name")));
    // The scheduler's Binding carries the pod's uid.
    let pod_uid = text_at(meta.and_then(|m| m.get("uid")));
    let cfg = &state.config().admission;
    let remembered = match (state.engine().state(), name) {
        (Some(store), Some(name)) => store
            .admitted(namespace, name, cfg.admitted_facts_seconds)
            .unwrap_or_else(|e| {
                tracing::warn!(error = %crate::server::error_chain(&e), "cannot read admitted facts");
                None
            }),
        _ => None,
    };
    let pod_name = format!("{namespace}/{}", name.unwrap_or("(unnamed)"));
    let (workload, fallback) = match remembered {
        Some(f) if pod_uid.is_some_and(|u| u == f.uid) => {
            let id = format!("review/{uid}");
            let entity = json!({
                "uid": {"type": "Workload", "id": id},
                "attrs": f.attrs,
                "parents": [{"type": "Namespace", "id": namespace}],
            });
            let w = Workload {
                id,
                name: pod_name.clone(),
                namespace: namespace.to_owned(),
                node_name: Some(node.to_owned()),
                entity,
            };
            (w, None)
        }
        found => {
            let why = match (found, pod_uid) {
                (Some(f), Some(u)) => format!(
                    "the pod admitted as {pod_name} had uid {}, this binding names {u}",
                    f.uid
                ),
                (Some(_), None) => "this binding names no pod uid".to_owned(),
                (None, _) => format!("no facts of pod {pod_name} were remembered at its admission"),
            };
            // No tolerations either: a pod whose facts are unknown tolerates nothing,
            // so a blocked node refuses it (security.blocked-node).
            let pod = json!({
                "metadata": object.get("metadata").cloned().unwrap_or_else(|| json!({})),
                "spec": {"containers": [], "nodeName": node},
            });
            let spec = pod.get("spec").cloned().unwrap_or_default();
            match workload(state, request, &pod, &spec, "/metadata", WorkloadId::Review) {
                Ok(w) => (w, Some(why)),
                Err(message) => return Answer::deny(uid, 400, message),
            }
        }
    };
    let mut answer = validate_workload(state, caller, uid, &workload, dry_run, false);
    match fallback {
        Some(why) => answer.warnings.push(format!(
            "probity: {why}; the binding is checked with the node-level rules only"
        )),
        None if answer.allowed && !dry_run => {
            if let (Some(store), Some(name)) = (state.engine().state(), name)
                && let Err(e) = store.forget_admitted(namespace, name)
            {
                tracing::warn!(error = %crate::server::error_chain(&e), "cannot forget admitted facts");
            }
        }
        None => {}
    }
    answer
}

/// A non-empty string at `v`.
fn text_at(v: Option<&Value>) -> Option<&str> {
    v.and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// Remembers an admitted pod's facts in the state backend, for its binding (which
/// names only the pod). Without a state backend, a name or a uid, nothing is kept.
pub(super) fn remember_pod(
    state: &AppState,
    request: &Map<String, Value>,
    object: &Value,
    w: &Workload,
) {
    let Some(store) = state.engine().state() else {
        return;
    };
    let meta = object.get("metadata");
    let (Some(name), Some(uid)) = (
        text_at(meta.and_then(|m| m.get("name"))).or_else(|| text_at(request.get("name"))),
        text_at(meta.and_then(|m| m.get("uid"))),
    ) else {
        return;
    };
    let cfg = &state.config().admission;
    let facts = probity::state::AdmittedFacts {
        namespace: w.namespace.clone(),
        name: name.to_owned(),
        uid: uid.to_owned(),
        attrs: w.entity.get("attrs").cloned().unwrap_or_default(),
        admitted_at_ms: state.engine().clock().now_unix_ms(),
    };
    let limits = probity::state::AdmittedLimits {
        max: cfg.admitted_facts_max,
        seconds: cfg.admitted_facts_seconds,
    };
    if let Err(e) = store.remember_admitted(&facts, &limits) {
        tracing::warn!(error = %crate::server::error_chain(&e), pod = %format!("{}/{name}", w.namespace), "cannot remember the admitted pod's facts; its binding will be checked with the node-level rules only");
    }
}
