//! A pod spec (of a Pod or a pod template) as the request-scoped `Workload` entity.

use serde_json::{Map, Value, json};

use super::requests::pod_requests;
use super::tolerations::tolerations;
use crate::AppState;

/// Where a kind keeps its pod spec (and the metadata carrying its labels).
pub(super) fn pod_paths(kind: &str) -> Option<(&'static str, &'static str)> {
    Some(match kind {
        "Pod" => ("/spec", "/metadata"),
        "Deployment"
        | "ReplicaSet"
        | "StatefulSet"
        | "DaemonSet"
        | "Job"
        | "ReplicationController" => ("/spec/template/spec", "/spec/template/metadata"),
        "CronJob" => (
            "/spec/jobTemplate/spec/template/spec",
            "/spec/jobTemplate/spec/template/metadata",
        ),
        _ => return None,
    })
}

/// The facts of one pod spec that the policies read.
pub(crate) struct Workload {
    /// The Workload entity's id: derived from the review (or from the pod's facts, for
    /// placement), never a stored id.
    pub(crate) id: String,
    /// `namespace/name`, for messages.
    pub(crate) name: String,
    pub(crate) namespace: String,
    pub(crate) node_name: Option<String>,
    /// The request-scoped `Workload` entity.
    pub(crate) entity: Value,
}

/// How a translated workload is named.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum WorkloadId {
    /// `review/<uid>`: one per review (an UPDATE, a binding).
    Review,
    /// `pod-<hash of its facts>`: the same for every pod that reads the same (the
    /// replicas of one template), so decisions are reused across pods of one shape.
    Content,
}

/// A Pod object (as the scheduler extender receives it) as a request-scoped workload.
pub(crate) fn pod_workload(state: &AppState, pod: &Value) -> Result<Workload, String> {
    let spec = pod
        .get("spec")
        .filter(|s| s.is_object())
        .ok_or("the Pod has no spec object")?;
    workload(
        state,
        &Map::new(),
        pod,
        spec,
        "/metadata",
        WorkloadId::Content,
    )
}

pub(super) fn workload(
    state: &AppState,
    request: &Map<String, Value>,
    object: &Value,
    spec: &Value,
    meta_path: &str,
    naming: WorkloadId,
) -> Result<Workload, String> {
    let cfg = &state.config().admission;
    let meta = object.get("metadata");
    let text = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    let namespace = text(request.get("namespace"))
        .or_else(|| text(meta.and_then(|m| m.get("namespace"))))
        .unwrap_or_else(|| "default".into());
    // Controller-made pods have no name yet, only generateName.
    let name = text(meta.and_then(|m| m.get("name")))
        .or_else(|| text(request.get("name")))
        .or_else(|| text(meta.and_then(|m| m.get("generateName"))))
        .or_else(|| text(request.get("uid")))
        .unwrap_or_else(|| "unnamed".into());
    let template_meta = object.pointer(meta_path);
    let label = |m: Option<&Value>, field: &str, key: &str| {
        text(m.and_then(|m| m.get(field)).and_then(|l| l.get(key)))
    };
    let class = label(template_meta, "labels", &cfg.class_label)
        .or_else(|| label(meta, "labels", &cfg.class_label))
        .unwrap_or_else(|| cfg.default_class.clone());
    let gpu_memory = match label(template_meta, "annotations", &cfg.gpu_memory_annotation)
        .or_else(|| label(meta, "annotations", &cfg.gpu_memory_annotation))
    {
        None => 0,
        Some(s) => s
            .trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| {
                format!(
                    "annotation {}: {s:?} is not a whole number of MiB",
                    cfg.gpu_memory_annotation
                )
            })?,
    };
    let containers = spec.get("containers").and_then(Value::as_array);
    let total = pod_requests(spec, cfg)?;
    let tolerations = tolerations(spec).map_err(|e| e.to_string())?;
    let image = containers
        .and_then(|c| c.first())
        .and_then(|c| c.get("image"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    // The object under review is the webhook's own translation, not a caller's claim:
    // its id comes from the review, so it never collides with a workload the store
    // holds (an UPDATE of a stored workload is judged as the object now reads).
    let attrs = json!({
        "namespace": {"__entity": {"type": "Namespace", "id": namespace}},
        "namespaceMatches": namespace_matches(&namespace),
        "class": class,
        "gpus": total.gpus,
        "cpuMillis": total.cpu_millis,
        "gpuMemoryMiB": gpu_memory,
        "image": image,
        // Always set (empty when none), so that only a workload no webhook
        // translated lacks it.
        "tolerations": tolerations,
    });
    let id = match naming {
        WorkloadId::Review => {
            let review_uid = text(request.get("uid")).unwrap_or_else(|| "unknown".into());
            format!("review/{review_uid}")
        }
        WorkloadId::Content => content_id(&attrs),
    };
    let entity = json!({
        "uid": {"type": "Workload", "id": id},
        "attrs": attrs,
        "parents": [{"type": "Namespace", "id": namespace}],
    });
    let node_name = text(spec.get("nodeName"));
    Ok(Workload {
        id,
        name: format!("{namespace}/{name}"),
        namespace,
        node_name,
        entity,
    })
}

/// `pod-<hash>` of a workload's facts. Only a name: the decision cache keys on the
/// whole request entity, so two shapes that hashed alike would still be told apart.
fn content_id(attrs: &Value) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    attrs.to_string().hash(&mut h);
    format!("pod-{:016x}", h.finish())
}

/// A namespace's name and each of its prefixes followed by `*`: what the settings'
/// `inferenceNamespaces` entries (a name, or a prefix ending in `*`) are matched
/// against in Cedar, which has no string prefix test of its own.
pub(crate) fn namespace_matches(namespace: &str) -> Vec<String> {
    let mut out = vec![namespace.to_owned()];
    out.extend(
        namespace
            .char_indices()
            .map(|(i, c)| format!("{}*", namespace.get(..i + c.len_utf8()).unwrap_or(""))),
    );
    out
}
