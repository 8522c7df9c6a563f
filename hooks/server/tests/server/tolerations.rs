//! Who may still run on a blocked node: a pod that tolerates Probity's block taint
//! (`probity.io/blocked`, empty value, `NoSchedule` by default), as Kubernetes lets it
//! through that taint. The webhook (a bound pod, a `pods/binding`), the extender and
//! the mutating webhook's affinity answer alike, from `security.blocked-node`.

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use probity::state::{AdmittedFacts, AdmittedLimits, SharedState as _, StateStore};
use probity_server::{AppState, Config};
use serde_json::{Value, json};

use crate::admission::{review, validate};
use crate::{call, root};

/// The tolerations a node agent's DaemonSet carries (the DaemonSet controller's own,
/// plus Probity's taint).
fn agent_tolerations() -> Value {
    json!([
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "probity.io/blocked", "operator": "Exists", "effect": "NoSchedule"}
    ])
}

/// A DaemonSet-made pod (CPU only) with these tolerations.
fn agent_pod(name: &str, uid: &str, tolerations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "kube-system", "uid": uid,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                "name": "probity-sidecar", "uid": "ds-1", "controller": true}]},
        "spec": {
            "containers": [{"name": "sidecar", "image": "registry.example/probity:1",
                "resources": {"requests": {"cpu": "100m"}}}],
            "tolerations": tolerations
        }
    })
}

fn binding(name: &str, pod_uid: &str, node: &str) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("bind-{name}-{node}"),
            "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "binding",
            "namespace": "kube-system",
            "name": name,
            "operation": "CREATE",
            "userInfo": {"username": "system:kube-scheduler"},
            "object": {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": "kube-system", "uid": pod_uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
            "oldObject": null,
            "dryRun": false
        }
    })
}

/// The test cluster (gpu-blocked blocked) with a state store, so that admitted pods'
/// facts are remembered for their bindings.
fn state_with_store(tmp: &tempfile::TempDir) -> (AppState, Arc<StateStore>) {
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    (AppState::new(engine, Config::default()), store)
}

fn message(r: &Value) -> String {
    r["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn a_binding_of_a_pod_tolerating_the_block_taint_to_a_blocked_node_is_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, store) = state_with_store(&tmp);
    let admitted = |name: &str, uid: &str, tolerations: Value| {
        review("Pod", "kube-system", agent_pod(name, uid, tolerations))
    };

    let r = validate(&s, &admitted("agent-x1", "uid-1", agent_tolerations())).await;
    assert_eq!(r["allowed"], true, "{r}");
    let r = validate(&s, &binding("agent-x1", "uid-1", "gpu-blocked")).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(!r.to_string().contains("node-level rules only"), "{r}");

    // Tolerating every taint (Exists, no key) is tolerating Probity's.
    let r = validate(
        &s,
        &admitted("cni-x1", "uid-2", json!([{"operator": "Exists"}])),
    )
    .await;
    assert_eq!(r["allowed"], true, "{r}");
    let r = validate(&s, &binding("cni-x1", "uid-2", "gpu-blocked")).await;
    assert_eq!(r["allowed"], true, "{r}");

    // Without Probity's toleration, or with one for another effect or value: denied.
    for (name, tolerations) in [
        ("plain", json!([])),
        (
            "noexecute-only",
            json!([{"key": "probity.io/blocked", "operator": "Exists", "effect": "NoExecute"}]),
        ),
        (
            "other-value",
            json!([{"key": "probity.io/blocked", "operator": "Equal", "value": "true"}]),
        ),
    ] {
        let uid = format!("uid-{name}");
        let r = validate(&s, &admitted(name, &uid, tolerations)).await;
        assert_eq!(r["allowed"], true, "{name}: {r}");
        let r = validate(&s, &binding(name, &uid, "gpu-blocked")).await;
        assert_eq!(r["allowed"], false, "{name}: {r}");
        assert!(message(&r).contains("security.blocked-node"), "{name}: {r}");
        // Still remembered: the same pod may bind elsewhere.
        assert!(store.admitted("kube-system", name, 3600).unwrap().is_some());
        let r = validate(&s, &binding(name, &uid, "gpu-a1")).await;
        assert_eq!(r["allowed"], true, "{name}: {r}");
    }

    // A pod no facts were remembered of is judged as tolerating nothing.
    let r = validate(&s, &binding("never-seen", "uid-9", "gpu-blocked")).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(message(&r).contains("security.blocked-node"), "{r}");
}

/// Facts remembered before the Workload had `tolerations` still read, and fail
/// closed: the pod tolerates nothing, so a blocked node refuses it.
#[tokio::test]
async fn facts_remembered_without_tolerations_still_bind_but_not_to_a_blocked_node() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, store) = state_with_store(&tmp);
    let facts = AdmittedFacts {
        namespace: "kube-system".into(),
        name: "old-agent".into(),
        uid: "uid-old".into(),
        attrs: json!({
            "namespace": {"__entity": {"type": "Namespace", "id": "kube-system"}},
            "namespaceMatches": ["kube-system"],
            "class": "batch", "gpus": 0, "cpuMillis": 100, "gpuMemoryMiB": 0,
            "image": "registry.example/probity:1"
        }),
        admitted_at_ms: s.engine().clock().now_unix_ms(),
    };
    let limits = AdmittedLimits {
        max: 100,
        seconds: 3600,
    };
    store.remember_admitted(&facts, &limits).unwrap();
    let r = validate(&s, &binding("old-agent", "uid-old", "gpu-blocked")).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(message(&r).contains("security.blocked-node"), "{r}");
    assert!(!r.to_string().contains("node-level rules only"), "{r}");
    let r = validate(&s, &binding("old-agent", "uid-old", "gpu-a1")).await;
    assert_eq!(r["allowed"], true, "{r}");
}

#[tokio::test]
async fn a_pod_bound_to_a_blocked_node_is_admitted_only_when_it_tolerates_the_block_taint() {
    let s = crate::state();
    let mut pod = agent_pod("agent-x1", "uid-1", agent_tolerations());
    pod["spec"]["nodeName"] = json!("gpu-blocked");
    let r = validate(&s, &review("Pod", "kube-system", pod.clone())).await;
    assert_eq!(r["allowed"], true, "{r}");
    pod["spec"]["tolerations"] = json!([
        {"key": "probity.io/blocked", "operator": "Exists", "effect": "NoExecute"}
    ]);
    let r = validate(&s, &review("Pod", "kube-system", pod.clone())).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(message(&r).contains("security.blocked-node"), "{r}");
    // A malformed toleration is refused, naming it, whatever the node.
    pod["spec"]["tolerations"] = json!([{"operator": "Exists"}, {"key": "a", "operator": "In"}]);
    pod["spec"]["nodeName"] = json!("gpu-a1");
    let r = validate(&s, &review("Pod", "kube-system", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(r["status"]["code"], 400, "{r}");
    assert_eq!(
        message(&r),
        "tolerations[1]: operator \"In\" is not Exists or Equal"
    );
}

#[tokio::test]
async fn the_extender_and_the_affinity_let_a_tolerating_pod_onto_a_blocked_node() {
    let s = crate::state();
    let filter = |pod: Value| {
        let s = s.clone();
        async move {
            let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-a1", "gpu-blocked"]});
            call(&s, Method::POST, "/v1/scheduler/filter", Some(&body), None).await
        }
    };
    let (status, out) = filter(agent_pod("a", "u", agent_tolerations())).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["NodeNames"], json!(["gpu-a1", "gpu-blocked"]), "{out}");
    let (_, out) = filter(agent_pod("b", "u", json!([]))).await;
    assert_eq!(out["NodeNames"], json!(["gpu-a1"]), "{out}");
    assert!(
        out["FailedNodes"]["gpu-blocked"]
            .as_str()
            .unwrap()
            .contains("security.blocked-node"),
        "{out}"
    );
    let (status, out) = filter(agent_pod("c", "u", json!({"key": "x"}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
    assert!(
        out.to_string().contains("tolerations is not a list"),
        "{out}"
    );

    // The mutating webhook's affinity names the blocked node only for the pod that
    // does not tolerate it (pods of no DaemonSet: a DaemonSet's pods get no affinity).
    let unowned = |mut pod: Value| {
        pod["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("ownerReferences");
        pod
    };
    let affinity = |pod: Value| {
        let s = s.clone();
        async move {
            let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": "m-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "namespace": "kube-system", "operation": "CREATE", "object": pod}});
            let (_, out) = call(&s, Method::POST, "/v1/admission/mutate", Some(&body), None).await;
            out["response"].to_string()
        }
    };
    let patch = |r: String| {
        use base64::Engine as _;
        let r: Value = serde_json::from_str(&r).unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(r["patch"].as_str().unwrap_or_default())
            .unwrap();
        String::from_utf8(bytes).unwrap()
    };
    let tolerating = patch(affinity(unowned(agent_pod("a", "u", agent_tolerations()))).await);
    assert!(!tolerating.contains("gpu-blocked"), "{tolerating}");
    let plain = patch(affinity(unowned(agent_pod("b", "u", json!([])))).await);
    assert!(plain.contains("gpu-blocked"), "{plain}");
    assert!(patch(affinity(agent_pod("b", "u", json!([]))).await).is_empty());
}

/// The taint's effect is a setting, not Rust: with `block_taint_effect = "NoExecute"`
/// a NoSchedule-only toleration no longer tolerates it, a NoExecute one does.
#[tokio::test]
async fn the_block_taint_effect_is_read_from_probity_toml() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    crate::placement::copy_dir(&root().join("policies"), &dir);
    let toml = dir.join("probity.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    let edited = text.replace(
        "block_taint_effect = \"NoSchedule\"",
        "block_taint_effect = \"NoExecute\"",
    );
    assert_ne!(text, edited);
    std::fs::write(&toml, edited).unwrap();
    let engine = probity::Engine::builder(&dir).build().unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    engine.block_node("gpu-blocked", "test").unwrap();
    let s = AppState::new(engine, Config::default());
    let bound = |effect: &str| {
        let mut pod = agent_pod(
            "agent",
            "uid",
            json!([{"key": "probity.io/blocked", "operator": "Exists", "effect": effect}]),
        );
        pod["spec"]["nodeName"] = json!("gpu-blocked");
        review("Pod", "kube-system", pod)
    };
    let r = validate(&s, &bound("NoSchedule")).await;
    assert_eq!(r["allowed"], false, "{r}");
    let r = validate(&s, &bound("NoExecute")).await;
    assert_eq!(r["allowed"], true, "{r}");
}
