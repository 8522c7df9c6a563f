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

mod quantity;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use probity::{DecideOptions, Decision, EntityUid, Request};
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::api::json_body;
use crate::caller::Caller;
use crate::config::{UnknownKinds, UnknownNodes};
use crate::error::ApiError;

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
    patch: Option<Vec<Value>>,
    /// What the policies refused, one entry per decision (for comparing an UPDATE's
    /// object with its old object).
    denials: Vec<String>,
}

impl Answer {
    fn allow(uid: &str) -> Self {
        Self {
            uid: uid.to_owned(),
            allowed: true,
            message: None,
            code: 200,
            warnings: Vec::new(),
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

/// Where a kind keeps its pod spec (and the metadata carrying its labels).
fn pod_paths(kind: &str) -> Option<(&'static str, &'static str)> {
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
    name: String,
    namespace: String,
    node_name: Option<String>,
    /// The request-scoped `Workload` entity.
    pub(crate) entity: Value,
}

/// How a translated workload is named.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WorkloadId {
    /// `review/<uid>`: one per review, for decisions that are recorded.
    Review,
    /// `pod-<hash of its facts>`: the same for every pod that reads the same, so
    /// placement decisions are reused across pods of one shape.
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
    let naming = match mode {
        Mode::Validate => WorkloadId::Review,
        Mode::Mutate => WorkloadId::Content,
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
            if workload.node_name.is_none() && !pod_update {
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

/// An UPDATE refuses only what it introduces. `Some(allow)` when it introduces
/// nothing to judge: the object is being deleted (`deletionTimestamp`: finalizers
/// must be removable whatever the node's state), or its judged facts (the workload the
/// policies read, and a template's node) read as the old object's did (a
/// metadata-only update, a finalizer, a status or replica change); or when every
/// refusal of the new object already applied to the old one (then the refusals are
/// warnings). `None`: judge the object as a CREATE.
fn judge_update(
    state: &AppState,
    uid: &str,
    request: &Map<String, Value>,
    object: &Value,
    spec_path: &str,
    meta_path: &str,
    new: &Workload,
) -> Option<Answer> {
    if object
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
    {
        let mut a = Answer::allow(uid);
        a.warnings
            .push("probity: the object is being deleted; its update is not judged".into());
        return Some(a);
    }
    let old_object = request.get("oldObject").filter(|o| o.is_object())?;
    let old_spec = old_object.pointer(spec_path).filter(|s| s.is_object())?;
    let mut old = workload(
        state,
        request,
        old_object,
        old_spec,
        meta_path,
        WorkloadId::Review,
    )
    .ok()?;
    if new.node_name.is_none() {
        old.node_name = None;
    }
    if old.entity == new.entity && old.node_name == new.node_name {
        return Some(Answer::allow(uid));
    }
    // Both judged without a trace (dry runs): only a refusal that stands is recorded,
    // by the caller's full judgement.
    let caller = Caller::anonymous();
    let now = validate_workload(state, &caller, uid, new, true, true);
    if now.allowed || now.denials.is_empty() {
        return None;
    }
    let before = validate_workload(state, &caller, uid, &old, true, true);
    if now.denials.iter().all(|d| before.denials.contains(d)) {
        let mut a = Answer::allow(uid);
        a.warnings = now.warnings;
        a.warnings.extend(now.denials.iter().map(|d| {
            format!("probity: already refused before this update, not introduced by it: {d}")
        }));
        return Some(a);
    }
    None
}

fn workload(
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
fn namespace_matches(namespace: &str) -> Vec<String> {
    let mut out = vec![namespace.to_owned()];
    out.extend(
        namespace
            .char_indices()
            .map(|(i, c)| format!("{}*", namespace.get(..i + c.len_utf8()).unwrap_or(""))),
    );
    out
}

/// What a pod asks for, counted as the scheduler counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Amounts {
    gpus: i64,
    cpu_millis: i64,
}

impl Amounts {
    fn plus(self, o: Amounts) -> Amounts {
        Amounts {
            gpus: self.gpus.saturating_add(o.gpus),
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
        }
    }

    fn max(self, o: Amounts) -> Amounts {
        Amounts {
            gpus: self.gpus.max(o.gpus),
            cpu_millis: self.cpu_millis.max(o.cpu_millis),
        }
    }
}

/// The pod's effective request, as Kubernetes computes it: the larger of (a) its
/// containers plus its restartable init containers (sidecars, `restartPolicy:
/// Always`, which run beside them) and (b) each ordinary init container plus the
/// sidecars started before it; then `spec.overhead` on top. Per resource.
fn pod_requests(spec: &Value, cfg: &crate::config::AdmissionConfig) -> Result<Amounts, String> {
    let list = |field: &str| spec.get(field).and_then(Value::as_array);
    let mut regular = Amounts::default();
    for (i, c) in list("containers").into_iter().flatten().enumerate() {
        regular = regular.plus(container_requests(c, &format!("containers[{i}]"), cfg)?);
    }
    let mut sidecars = Amounts::default();
    let mut init_peak = Amounts::default();
    for (i, c) in list("initContainers").into_iter().flatten().enumerate() {
        let a = container_requests(c, &format!("initContainers[{i}]"), cfg)?;
        if c.get("restartPolicy").and_then(Value::as_str) == Some("Always") {
            sidecars = sidecars.plus(a);
        } else {
            init_peak = init_peak.max(a.plus(sidecars));
        }
    }
    let overhead = match spec.get("overhead") {
        None | Some(Value::Null) => Amounts::default(),
        Some(o) => resource_list(o, "overhead", cfg, true)?,
    };
    Ok(regular.plus(sidecars).max(init_peak).plus(overhead))
}

/// One container's request: GPUs from limits (extended resources must have equal
/// requests and limits), CPU from requests (defaulted to the limit when unset).
fn container_requests(
    c: &Value,
    at: &str,
    cfg: &crate::config::AdmissionConfig,
) -> Result<Amounts, String> {
    let resources = c.get("resources");
    let limits = resources.and_then(|r| r.get("limits"));
    let requests = resources.and_then(|r| r.get("requests"));
    let from_limits = match limits {
        Some(l) => resource_list(l, &format!("{at}.resources.limits"), cfg, false)?,
        None => Amounts::default(),
    };
    let from_requests = match requests {
        Some(r) => resource_list(r, &format!("{at}.resources.requests"), cfg, false)?,
        None => Amounts::default(),
    };
    let has_cpu_request = requests.and_then(|r| r.get("cpu")).is_some();
    Ok(Amounts {
        gpus: from_limits.gpus.max(from_requests.gpus),
        cpu_millis: if has_cpu_request {
            from_requests.cpu_millis
        } else {
            from_limits.cpu_millis
        },
    })
}

/// GPUs and CPU millicores in one resource list (`limits`, `requests`, `overhead`).
fn resource_list(
    list: &Value,
    at: &str,
    cfg: &crate::config::AdmissionConfig,
    overhead: bool,
) -> Result<Amounts, String> {
    let Some(map) = list.as_object() else {
        return Err(format!("{at} is not an object"));
    };
    let mut out = Amounts::default();
    for (name, q) in map {
        if name == "cpu" {
            let m = quantity::cpu_millis(q)
                .ok_or_else(|| format!("{at}.cpu: {q} is not a CPU quantity"))?;
            out.cpu_millis = out.cpu_millis.saturating_add(m);
        } else if let Some(weight) = gpu_weight(name, cfg) {
            let n = quantity::count(q)
                .ok_or_else(|| format!("{at}.{name}: {q} is not a whole number"))?;
            if overhead && n > 0 {
                return Err(format!("{at}.{name}: a pod's overhead cannot hold GPUs"));
            }
            out.gpus = out.gpus.saturating_add(n.saturating_mul(i64::from(weight)));
        }
    }
    Ok(out)
}

/// How many GPUs one unit of resource `name` is, if it is a GPU resource.
fn gpu_weight(name: &str, cfg: &crate::config::AdmissionConfig) -> Option<u32> {
    if name == cfg.gpu_resource {
        return Some(1);
    }
    cfg.gpu_resources.iter().find_map(|(pattern, w)| {
        let hit = match pattern.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == pattern,
        };
        hit.then_some(*w)
    })
}

/// A `pods/binding` CREATE: the scheduler (or anyone allowed to bind) placing a pod on
/// a node. The Binding names only the pod and the node, and the webhook cannot fetch
/// the pod, so the pod is judged as an unknown workload of the default class asking
/// for nothing: the node-level rules (blocked, driver drift, temperature, zone
/// ceiling) apply; the pod's own facts were judged when it was admitted and filtered.
fn validate_binding(
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
fn remember_pod(state: &AppState, request: &Map<String, Value>, object: &Value, w: &Workload) {
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

fn validate_workload(
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
    let mut note = |d: &Decision, what: &str, warnings: &mut Vec<String>| {
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
            let mut why: Vec<String> = d
                .reasons
                .iter()
                .map(|r| format!("{} ({})", r.message, r.policy))
                .collect();
            why.extend(
                d.errors
                    .iter()
                    .map(|e| format!("evaluation error: {}", e.message)),
            );
            if why.is_empty() {
                why.push("no policy permits it".into());
            }
            denials.push(format!("{what}: {}", why.join("; ")));
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
        let unknown = state.engine().entity(&node_uid).is_none()
            && !state.engine().blocked_nodes().contains_key(node);
        let warn_unknown = unknown && state.config().admission.unknown_nodes == UnknownNodes::Warn;
        if warn_unknown {
            warnings.push(format!(
                "probity: node {node} is not in the entity store; the placement rules that read its facts were not checked (admission.unknown_nodes = \"warn\")"
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
    if denials.is_empty() {
        let mut a = Answer::allow(uid);
        a.warnings = warnings;
        a
    } else {
        let mut a = Answer::deny(
            uid,
            403,
            format!("probity denied {}: {}", w.name, denials.join(" | ")),
        );
        a.warnings = warnings;
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

/// The JSONPatch that adds Probity's placement constraints (from the policies'
/// `schedule` decisions, see [`crate::placement`]) to the pod spec at `base`.
fn placement_patch(
    state: &AppState,
    spec: &Value,
    base: &str,
    workload: &Workload,
) -> Result<(Vec<Value>, Vec<String>), String> {
    let (exprs, warnings) = crate::placement::affinity_expressions(state, workload)?;
    if exprs.is_empty() {
        return Ok((Vec::new(), warnings));
    }
    let existing = spec.get("affinity").filter(|a| a.is_object());
    let mut affinity = existing.cloned().unwrap_or_else(|| json!({}));
    let merged = merge_required(affinity.get("nodeAffinity"), &exprs);
    if let Some(obj) = affinity.as_object_mut() {
        obj.insert("nodeAffinity".into(), merged);
    }
    let op = if existing.is_some() { "replace" } else { "add" };
    Ok((
        vec![json!({"op": op, "path": format!("{base}/affinity"), "value": affinity})],
        warnings,
    ))
}

/// Node affinity whose required terms all also carry `exprs` (terms are ORed, the
/// expressions within one are ANDed, so each term needs them).
fn merge_required(node_affinity: Option<&Value>, exprs: &[Value]) -> Value {
    let mut na = node_affinity
        .filter(|v| v.is_object())
        .cloned()
        .unwrap_or_else(|| json!({}));
    let terms: Vec<Value> = na
        .pointer("/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .cloned()
        .unwrap_or_else(|| vec![json!({})]);
    let terms: Vec<Value> = terms
        .into_iter()
        .map(|mut t| {
            let mut list = t
                .get("matchExpressions")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            list.extend(exprs.iter().cloned());
            if let Some(o) = t.as_object_mut() {
                o.insert("matchExpressions".into(), Value::Array(list));
            }
            t
        })
        .collect();
    if let Some(o) = na.as_object_mut() {
        o.insert(
            "requiredDuringSchedulingIgnoredDuringExecution".into(),
            json!({"nodeSelectorTerms": terms}),
        );
    }
    na
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_terms_each_get_the_expressions() {
        let na = json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}
        ]}, "preferredDuringSchedulingIgnoredDuringExecution": []});
        let e = json!({"key": "k", "operator": "NotIn", "values": ["x"]});
        let merged = merge_required(Some(&na), std::slice::from_ref(&e));
        let terms = merged
            .pointer("/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
            .unwrap();
        assert_eq!(terms[0]["matchExpressions"].as_array().unwrap().len(), 2);
        assert_eq!(terms[1]["matchExpressions"], json!([e]));
        assert!(
            merged
                .get("preferredDuringSchedulingIgnoredDuringExecution")
                .is_some()
        );
    }
}
