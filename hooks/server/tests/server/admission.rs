//! AdmissionReview v1 through `oneshot`: real captures, GPU pods in the inference
//! namespace, bound pods, dry runs, JSONPatch placement, and malformed reviews.

use axum::http::{Method, StatusCode};
use base64::Engine as _;
use probity_server::{Config, UnknownKinds};
use serde_json::{Value, json};

use crate::{call, call_raw, root, state, state_with};

fn fixture(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(root().join("testdata/k8s").join(name)).unwrap()).unwrap()
}

fn yaml_pod(name: &str) -> Value {
    serde_norway::from_slice(&std::fs::read(root().join("testdata/k8s").join(name)).unwrap())
        .unwrap()
}

/// An AdmissionReview CREATE of `object` (of `kind`) in `namespace`.
pub(crate) fn review(kind: &str, namespace: &str, object: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "admin"},
            "object": object,
            "oldObject": null,
            "dryRun": false
        }
    })
}

pub(crate) fn gpu_pod(name: &str, gpus: u32, cpu: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{
            "name": "main", "image": "nvcr.io/nvidia/tritonserver:25.01",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string(), "cpu": cpu}}
        }]}
    })
}

pub(crate) async fn validate(s: &probity_server::AppState, body: &Value) -> Value {
    let (status, out) = call(s, Method::POST, "/v1/admission/validate", Some(body), None).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(out["kind"], "AdmissionReview");
    out["response"].clone()
}

async fn mutate(s: &probity_server::AppState, body: &Value) -> Value {
    let (status, out) = call(s, Method::POST, "/v1/admission/mutate", Some(body), None).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    out["response"].clone()
}

fn patch_of(response: &Value) -> Vec<Value> {
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().unwrap())
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn a_controller_made_pod_with_only_generate_name_is_admitted_and_its_uid_echoed() {
    let s = state();
    let r = fixture("admissionreview-pod-create-replicaset.json");
    let response = validate(&s, &r).await;
    assert_eq!(response["uid"], "e94a7790-a4fc-11e9-a276-42010a3e0104");
    assert_eq!(response["allowed"], true, "{response}");
    let response = mutate(&s, &r).await;
    assert_eq!(response["uid"], "e94a7790-a4fc-11e9-a276-42010a3e0104");
    assert_eq!(response["allowed"], true);
}

#[tokio::test]
async fn the_api_machinery_sample_of_an_unknown_kind_is_allowed_with_a_warning_or_denied_by_config()
{
    let r = fixture("admissionreview-v1-apimachinery-testdata.json");
    // operationValue is no CREATE or UPDATE: nothing to check.
    let response = validate(&state(), &r).await;
    assert_eq!(
        (response["uid"].clone(), response["allowed"].clone()),
        (json!("uidValue"), json!(true))
    );
    let mut create = r.clone();
    create["request"]["operation"] = json!("CREATE");
    let response = validate(&state(), &create).await;
    assert_eq!(response["allowed"], true);
    assert!(
        response["warnings"][0]
            .as_str()
            .unwrap()
            .contains("kindValue"),
        "{response}"
    );
    let mut config = Config::default();
    config.admission.unknown_kinds = UnknownKinds::Deny;
    let response = validate(&state_with(config), &create).await;
    assert_eq!(response["allowed"], false);
    assert_eq!(response["status"]["code"], 403);
}

#[tokio::test]
async fn gpu_pods_in_inference_keep_one_gpu_per_eight_cpus() {
    let s = state();
    // 1 GPU with 8 CPUs keeps the ratio; 2 GPUs with 8 CPUs ("8000m") break it.
    let ok = validate(&s, &review("Pod", "inference", gpu_pod("ok", 1, "8"))).await;
    assert_eq!(ok["allowed"], true, "{ok}");
    let bad = validate(
        &s,
        &review("Pod", "inference", gpu_pod("greedy", 2, "8000m")),
    )
    .await;
    assert_eq!(bad["allowed"], false);
    assert_eq!(bad["status"]["code"], 403);
    let message = bad["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("placement.inference-gpu-cpu-ratio"),
        "{message}"
    );
    assert!(message.contains("inference/greedy"), "{message}");
    // The same pod outside inference is fine.
    let elsewhere = validate(&s, &review("Pod", "training", gpu_pod("greedy", 2, "8"))).await;
    assert_eq!(elsewhere["allowed"], true);
    // CPUs summed over containers: 1.5 + 6.5 = 8 CPUs for 1 GPU.
    let mut two = gpu_pod("two", 1, "1.5");
    two["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "side", "image": "x", "resources": {"requests": {"cpu": "6500m"}}}));
    let r = validate(&s, &review("Pod", "inference", two)).await;
    assert_eq!(r["allowed"], true, "{r}");
}

#[tokio::test]
async fn the_kyverno_gpu_pods_in_inference_are_denied_without_cpus() {
    let s = state();
    let pod = yaml_pod("kyverno-test-bad.yaml");
    let r = validate(&s, &review("Pod", "inference", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
    let pod = yaml_pod("kyverno-test-good01.yaml");
    let r = validate(&s, &review("Pod", "default", pod)).await;
    assert_eq!(r["allowed"], true, "{r}");
}

#[tokio::test]
async fn pod_templates_of_workload_kinds_are_checked() {
    let s = state();
    let template = |cpu: &str| json!({"metadata": {"labels": {"app": "x"}}, "spec": gpu_pod("t", 2, cpu)["spec"].clone()});
    for (kind, object) in [
        (
            "Deployment",
            json!({"metadata": {"name": "d"}, "spec": {"template": template("4")}}),
        ),
        (
            "StatefulSet",
            json!({"metadata": {"name": "s"}, "spec": {"template": template("4")}}),
        ),
        (
            "DaemonSet",
            json!({"metadata": {"name": "ds"}, "spec": {"template": template("4")}}),
        ),
        (
            "Job",
            json!({"metadata": {"name": "j"}, "spec": {"template": template("4")}}),
        ),
        (
            "CronJob",
            json!({"metadata": {"name": "c"}, "spec": {"jobTemplate": {"spec": {"template": template("4")}}}}),
        ),
    ] {
        let r = validate(&s, &review(kind, "inference", object.clone())).await;
        assert_eq!(r["allowed"], false, "{kind}: {r}");
        let mut fine = object;
        let text = fine.to_string().replace("\"cpu\":\"4\"", "\"cpu\":\"16\"");
        fine = serde_json::from_str(&text).unwrap();
        let r = validate(&s, &review(kind, "inference", fine)).await;
        assert_eq!(r["allowed"], true, "{kind}: {r}");
    }
}

#[tokio::test]
async fn a_pod_bound_for_a_blocked_node_is_denied() {
    let s = state();
    let mut pod = gpu_pod("bound", 1, "8");
    pod["spec"]["nodeName"] = json!("gpu-blocked");
    let r = validate(&s, &review("Pod", "training", pod.clone())).await;
    assert_eq!(r["allowed"], false);
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("security.blocked-node"),
        "{r}"
    );
    // Blocked through the engine, for a node not in the store.
    s.engine()
        .block_node("gpu-elsewhere", "integrity failure")
        .unwrap();
    pod["spec"]["nodeName"] = json!("gpu-elsewhere");
    let r = validate(&s, &review("Pod", "training", pod.clone())).await;
    assert_eq!(r["allowed"], false);
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("integrity failure"),
        "{r}"
    );
    // A healthy node is fine.
    pod["spec"]["nodeName"] = json!("gpu-a1");
    let r = validate(&s, &review("Pod", "training", pod.clone())).await;
    assert_eq!(r["allowed"], true, "{r}");
}

/// ARCHITECTURE said an unknown node fails closed; admission admitted the pod with a
/// warning ("placement not checked").
#[tokio::test]
async fn bug_a_pod_bound_to_a_node_absent_from_the_store_was_admitted() {
    let mut pod = gpu_pod("bound", 1, "8");
    pod["spec"]["nodeName"] = json!("gpu-unknown");
    let r = validate(&state(), &review("Pod", "training", pod.clone())).await;
    assert_eq!(r["allowed"], false, "{r}");
    let message = r["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("schedule onto node gpu-unknown"),
        "{message}"
    );
    assert!(
        message.contains("does not exist") || message.contains("evaluation error"),
        "{message}"
    );
    // The documented switch, for clusters that admit before agents report.
    let mut config = Config::default();
    config.admission.unknown_nodes = probity_server::UnknownNodes::Warn;
    let r = validate(
        &state_with(config.clone()),
        &review("Pod", "training", pod.clone()),
    )
    .await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(
        r["warnings"][0]
            .as_str()
            .unwrap()
            .contains("not in the entity store")
    );
    // Even then a blocked unknown node is denied.
    let s = state_with(config);
    s.engine()
        .block_node("gpu-unknown", "integrity failure")
        .unwrap();
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
}

/// With `admission.unknown_nodes = "warn"`, a pod bound to a node absent from the
/// store was admitted without asking the policies at all: a rule that needs no fact of
/// the node (here, an image refused everywhere) was skipped. Only the deny for want of
/// the node's facts is to become a warning.
#[tokio::test]
async fn bug_with_unknown_nodes_warn_a_pod_bound_to_an_unknown_node_skipped_the_policies() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    crate::placement::copy_dir(&root().join("policies"), &dir);
    std::fs::write(
        dir.join("placement/untrusted-images.cedar"),
        r#"@id("placement.untrusted-image")
@severity("high")
@message("images from untrusted.example are placed nowhere")
forbid (principal, action == Action::"schedule", resource)
when { principal.image like "untrusted.example/*" };
"#,
    )
    .unwrap();
    let engine = probity::Engine::builder(&dir).build().unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    let mut config = Config::default();
    config.admission.unknown_nodes = probity_server::UnknownNodes::Warn;
    let s = probity_server::AppState::new(engine, config);
    let mut pod = gpu_pod("bound", 1, "8");
    pod["spec"]["nodeName"] = json!("gpu-unknown");
    // A trusted image: the only deny is for want of facts, a warning under "warn".
    let r = validate(&s, &review("Pod", "training", pod.clone())).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(
        r["warnings"][0]
            .as_str()
            .unwrap()
            .contains("not in the entity store"),
        "{r}"
    );
    // An untrusted one is denied by the rule, unknown node or not.
    pod["spec"]["containers"][0]["image"] = json!("untrusted.example/miner:1");
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
    let message = r["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("schedule onto node gpu-unknown")
            && message.contains("placement.untrusted-image"),
        "{message}"
    );
    assert!(
        r["warnings"][0]
            .as_str()
            .unwrap()
            .contains("not in the entity store"),
        "{r}"
    );
}

#[tokio::test]
async fn a_dry_run_decides_alike_and_records_nothing() {
    let s = state();
    let mut r = review("Pod", "inference", gpu_pod("greedy", 2, "1"));
    r["request"]["dryRun"] = json!(true);
    let response = validate(&s, &r).await;
    assert_eq!(response["allowed"], false);
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    let text = metrics.as_str().unwrap();
    assert!(
        text.contains("probity_decisions_total{outcome=\"deny\"} 0"),
        "{text}"
    );
    assert!(!text.contains("placement.inference-gpu-cpu-ratio"));
    assert_eq!(
        s.engine()
            .entity(&"Workload::\"inference/greedy\"".parse().unwrap()),
        None
    );
}

#[tokio::test]
async fn mutation_keeps_pods_where_the_schedule_decisions_let_them_go() {
    let s = state();
    s.engine().block_node("gpu-a1", "maintenance").unwrap();
    let r = mutate(&s, &review("Pod", "training", gpu_pod("t", 1, "8"))).await;
    assert_eq!(r["allowed"], true);
    let patch = patch_of(&r);
    assert_eq!(patch.len(), 1);
    assert_eq!(patch[0]["op"], "add");
    assert_eq!(patch[0]["path"], "/spec/affinity");
    let exprs = &patch[0]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"][0]["matchExpressions"];
    // Exactly the nodes the policies refuse (blocked twice over, drifted driver, old
    // image, over temperature), and the zones no node of which may take the pod
    // (zone-hot over its power ceiling, zone-rlhf dedicated) left out.
    assert_eq!(
        exprs,
        &json!([
            {"key": "kubernetes.io/hostname", "operator": "NotIn",
             "values": ["gpu-a1", "gpu-blocked", "gpu-drift", "gpu-oldimage", "gpu-warm"]},
            {"key": "topology.probity.io/zone", "operator": "In", "values": ["zone-a"]}
        ])
    );
    // Each node named is one the validating webhook refuses when the pod is bound there.
    for node in exprs[0]["values"].as_array().unwrap() {
        let mut pod = gpu_pod("t", 1, "8");
        pod["spec"]["nodeName"] = node.clone();
        let v = validate(&s, &review("Pod", "training", pod)).await;
        assert_eq!(v["allowed"], false, "{node}: {v}");
    }
    // RL-HF work is pinned to its zone; an existing affinity is kept and replaced whole.
    let mut pod = gpu_pod("rl", 1, "8");
    pod["metadata"]["labels"] = json!({"probity.io/class": "rlhf"});
    pod["spec"]["affinity"] = json!({"podAntiAffinity": {}, "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}});
    let r = mutate(&s, &review("Pod", "training", pod)).await;
    let patch = patch_of(&r);
    assert_eq!(patch[0]["op"], "replace");
    let value = &patch[0]["value"];
    assert!(value.get("podAntiAffinity").is_some());
    let exprs = value["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"].as_array().unwrap();
    assert_eq!(exprs.len(), 2);
    assert_eq!(exprs[0]["key"], "gpu");
    assert_eq!(
        exprs[1],
        json!({"key": "topology.probity.io/zone", "operator": "In", "values": ["zone-rlhf"]})
    );
    // Templates are patched at their own path.
    let r = mutate(&s, &review("Deployment", "training", json!({"metadata": {"name": "d"}, "spec": {"template": {"spec": gpu_pod("t", 1, "8")["spec"].clone()}}}))).await;
    assert_eq!(patch_of(&r)[0]["path"], "/spec/template/spec/affinity");
}

/// The finding: the mutating webhook added its zone and host terms to a DaemonSet's
/// pods too, whose node the DaemonSet controller had already chosen, so a node agent's
/// pod on a node in a closed zone stayed Pending. A DaemonSet and its pods are left as
/// they are; the same pod under a ReplicaSet is constrained.
#[tokio::test]
async fn bug_the_mutating_webhook_constrained_a_daemonsets_pods_to_the_open_zones() {
    let s = state();
    let owned = |kind: &str| {
        let mut pod = gpu_pod("agent", 1, "8");
        pod["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": kind,
            "name": "agent", "uid": "7d0c4a52-8f0b-4f6e-9c1a-2b3c4d5e6f70", "controller": true}]);
        pod
    };
    let r = mutate(&s, &review("Pod", "kube-system", owned("DaemonSet"))).await;
    assert_eq!(r["allowed"], true);
    assert!(r.get("patch").is_none(), "{r}");
    let daemon_set = json!({"metadata": {"name": "agent"},
        "spec": {"template": {"spec": gpu_pod("t", 1, "8")["spec"].clone()}}});
    let r = mutate(&s, &review("DaemonSet", "kube-system", daemon_set)).await;
    assert!(r.get("patch").is_none(), "{r}");
    let r = mutate(&s, &review("Pod", "training", owned("ReplicaSet"))).await;
    assert_eq!(patch_of(&r)[0]["path"], "/spec/affinity");
}

#[tokio::test]
async fn mutation_without_constraints_sends_no_patch() {
    let engine = probity::Engine::from_embedded_defaults().unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let r = mutate(&s, &review("Pod", "training", gpu_pod("t", 1, "8"))).await;
    assert_eq!(r["allowed"], true);
    assert!(r.get("patch").is_none(), "{r}");
}

#[tokio::test]
async fn malformed_reviews_get_clear_errors() {
    let s = state();
    for endpoint in ["/v1/admission/validate", "/v1/admission/mutate"] {
        let (status, body) =
            call_raw(&s, Method::POST, endpoint, b"{not json".to_vec(), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(
            body["error"],
            "AdmissionReview is not valid JSON at line 1, column 2"
        );
        let (status, body) = call(
            &s,
            Method::POST,
            endpoint,
            Some(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"})),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(
            body,
            json!({"error": "AdmissionReview has no request", "code": 400})
        );
        // Wrong version, but a uid to answer: an AdmissionReview-shaped refusal.
        let mut r = review("Pod", "default", gpu_pod("p", 0, "1"));
        r["apiVersion"] = json!("admission.k8s.io/v1beta1");
        let (status, body) = call(&s, Method::POST, endpoint, Some(&r), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            body["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(body["response"]["allowed"], false);
        assert_eq!(body["response"]["status"]["code"], 400);
        assert!(
            body["response"]["status"]["message"]
                .as_str()
                .unwrap()
                .contains("admission.k8s.io/v1beta1")
        );
        // A pod whose quantities do not parse.
        let r = review("Pod", "default", gpu_pod("p", 1, "lots"));
        let (_, body) = call(&s, Method::POST, endpoint, Some(&r), None).await;
        assert_eq!(body["response"]["allowed"], false);
        assert!(
            body["response"]["status"]["message"]
                .as_str()
                .unwrap()
                .contains("cpu"),
            "{body}"
        );
    }
    let mut config = Config::default();
    config.server.max_body_bytes = 4096;
    let s = state_with(config);
    let big = review(
        "Pod",
        "default",
        json!({"metadata": {"annotations": {"pad": "x".repeat(8192)}}, "spec": {"containers": []}}),
    );
    let (status, body) = call(&s, Method::POST, "/v1/admission/validate", Some(&big), None).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["code"], 413);
}

#[tokio::test]
async fn delete_and_missing_objects_are_allowed() {
    let s = state();
    let mut r = review("Pod", "default", Value::Null);
    r["request"]["operation"] = json!("DELETE");
    assert_eq!(validate(&s, &r).await["allowed"], true);
    let mut r = review("Pod", "default", Value::Null);
    r["request"]["operation"] = json!("CREATE");
    let response = validate(&s, &r).await;
    assert_eq!(response["allowed"], true);
    assert!(response["warnings"].is_array());
    // A minimal pod: no labels, no resources, no image.
    let r = review(
        "Pod",
        "default",
        json!({"metadata": {}, "spec": {"containers": [{"name": "c"}]}}),
    );
    assert_eq!(validate(&s, &r).await["allowed"], true);
}

fn yaml_pods(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join("testdata/k8s").join(name)).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

#[tokio::test]
async fn the_chainsaw_pods_in_inference_are_denied_exactly_when_they_want_gpus_without_cpus() {
    let s = state();
    let good = yaml_pods("chainsaw-test-pods-good.yaml");
    let bad = yaml_pods("chainsaw-test-pods-bad.yaml");
    assert!(good.len() >= 3 && bad.len() >= 2);
    for (pods, allowed) in [(good, true), (bad, false)] {
        for pod in pods {
            let name = pod["metadata"]["name"].clone();
            let r = validate(&s, &review("Pod", "inference", pod.clone())).await;
            assert_eq!(r["allowed"], allowed, "{name}: {r}");
            // In their own namespace the ratio rule does not apply.
            let mut own = review("Pod", "", pod);
            own["request"].as_object_mut().unwrap().remove("namespace");
            let r = validate(&s, &own).await;
            assert_eq!(r["allowed"], true, "{name}: {r}");
        }
    }
}

#[tokio::test]
async fn every_prefix_and_retyping_of_a_real_review_gets_an_answer_not_a_crash() {
    let s = state();
    let text =
        std::fs::read(root().join("testdata/k8s/admissionreview-pod-create-replicaset.json"))
            .unwrap();
    // Truncations: bounded, one every 97 bytes.
    for end in (0..text.len()).step_by(97) {
        let (status, body) = call_raw(
            &s,
            Method::POST,
            "/v1/admission/validate",
            text[..end].to_vec(),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "prefix {end}: {body}");
        assert_eq!(body["code"], 400);
    }
    // Every field replaced by values of the wrong type.
    let review = fixture("admissionreview-pod-create-replicaset.json");
    let mut paths = Vec::new();
    fn walk(v: &Value, path: String, out: &mut Vec<String>) {
        out.push(path.clone());
        if let Value::Object(m) = v {
            for (k, c) in m {
                walk(
                    c,
                    format!("{path}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        } else if let Value::Array(a) = v {
            for (i, c) in a.iter().enumerate() {
                walk(c, format!("{path}/{i}"), out);
            }
        }
    }
    walk(&review, String::new(), &mut paths);
    for path in paths.iter().filter(|p| !p.is_empty()) {
        for replacement in [json!(null), json!(7), json!("x"), json!([]), json!({})] {
            let mut r = review.clone();
            *r.pointer_mut(path).unwrap() = replacement.clone();
            let (status, body) =
                call(&s, Method::POST, "/v1/admission/mutate", Some(&r), None).await;
            assert!(
                status == StatusCode::OK || status == StatusCode::BAD_REQUEST,
                "{path} = {replacement}: {status} {body}"
            );
            if status == StatusCode::OK {
                assert_eq!(body["response"]["uid"], r["request"]["uid"], "{path}");
            }
        }
    }
}

/// A pod whose containers and init containers ask for GPUs and CPUs.
fn pod_with(containers: Value, init: Value, overhead: Option<Value>) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": containers, "initContainers": init}
    });
    if let Some(o) = overhead {
        pod["spec"]["overhead"] = o;
    }
    pod
}

fn container(name: &str, gpus: &str, cpu: &str) -> Value {
    json!({"name": name, "image": "x", "resources": {"limits": {"nvidia.com/gpu": gpus, "cpu": cpu}}})
}

/// Issue: init containers were ignored, so a sidecar holding 4 GPUs beside a 1-CPU
/// container was admitted into `inference`.
#[tokio::test]
async fn bug_a_sidecar_init_container_holding_gpus_was_not_counted() {
    let s = state();
    let mut sidecar = container("proxy", "4", "0");
    sidecar["restartPolicy"] = json!("Always");
    let pod = pod_with(json!([container("main", "0", "1")]), json!([sidecar]), None);
    let r = validate(&s, &review("Pod", "inference", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("placement.inference-gpu-cpu-ratio"),
        "{r}"
    );
}

#[tokio::test]
async fn pod_requests_are_counted_as_kubernetes_counts_them() {
    let s = state();
    let admitted = |pod: Value| {
        let s = s.clone();
        async move { validate(&s, &review("Pod", "inference", pod)).await["allowed"] == true }
    };
    // An ordinary init container runs alone before the others: its 2 GPUs against 16
    // CPUs of its own fit; the pod's request is max(init, containers).
    let pod = pod_with(
        json!([container("main", "1", "8")]),
        json!([container("warmup", "2", "16")]),
        None,
    );
    assert!(admitted(pod).await);
    // The same init container with only 8 CPUs asks 2 GPUs : 8 CPUs at its peak.
    let pod = pod_with(
        json!([container("main", "1", "8")]),
        json!([container("warmup", "2", "8")]),
        None,
    );
    assert!(!admitted(pod).await);
    // A sidecar started before an ordinary init container runs beside it: 1 + 1 GPUs
    // against 8 + 8 CPUs fits, and the pod's peak is the sum.
    let mut sidecar = container("proxy", "1", "8");
    sidecar["restartPolicy"] = json!("Always");
    let pod = pod_with(
        json!([container("main", "1", "8")]),
        json!([sidecar.clone(), container("warmup", "1", "8")]),
        None,
    );
    assert!(admitted(pod).await);
    // The pod overhead's CPUs count too: 2 GPUs, 15 + 1 CPUs is exactly 1:8.
    let pod = pod_with(
        json!([container("main", "2", "15")]),
        json!([]),
        Some(json!({"cpu": "1"})),
    );
    assert!(admitted(pod).await);
    let pod = pod_with(
        json!([container("main", "2", "15")]),
        json!([]),
        Some(json!({"cpu": "500m"})),
    );
    assert!(!admitted(pod).await);
}

#[tokio::test]
async fn mig_slices_count_as_gpus_and_gpu_resource_names_are_configurable() {
    let s = state();
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mig"},
        "spec": {"containers": [{"name": "m", "image": "x", "resources": {"limits":
            {"nvidia.com/mig-1g.10gb": "2", "cpu": "8"}}}]}});
    let r = validate(&s, &review("Pod", "inference", pod.clone())).await;
    assert_eq!(r["allowed"], false, "{r}");
    // A site that weighs a MIG slice as nothing (or uses another name) says so.
    let mut config = Config::default();
    config.admission.gpu_resources = [("nvidia.com/gpu".to_owned(), 1)].into();
    let r = validate(&state_with(config), &review("Pod", "inference", pod)).await;
    assert_eq!(r["allowed"], true, "{r}");
    // A quantity that is not a whole number is named with its place.
    let bad = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "b"},
        "spec": {"containers": [{"name": "m", "image": "x"}], "initContainers": [{"name": "i",
            "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1.5"}}}]}});
    let r = validate(&s, &review("Pod", "inference", bad)).await;
    assert_eq!(r["status"]["code"], 400);
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("initContainers[0].resources.limits.nvidia.com/gpu"),
        "{r}"
    );
}

#[tokio::test]
async fn the_inference_rule_covers_the_configured_namespace_prefixes() {
    let s = state();
    let greedy = gpu_pod("g", 2, "1");
    for (namespace, held) in [
        ("inference", true),
        ("inference-team-a", true),
        ("inferencex", false),
        ("training", false),
    ] {
        let r = validate(&s, &review("Pod", namespace, greedy.clone())).await;
        assert_eq!(r["allowed"], !held, "{namespace}: {r}");
    }
}

/// The object under review is the webhook's translation, not a caller's claim: an
/// UPDATE of a workload whose facts the store holds is judged, not refused as a
/// request entity that overrides a stored one.
#[tokio::test]
async fn an_update_of_a_workload_the_store_holds_is_judged() {
    let s = state();
    s.engine()
        .upsert_entities(&json!([{"uid": {"type": "Workload", "id": "training/t"},
            "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "training"}},
                      "class": "training", "gpus": 1, "cpuMillis": 8000, "gpuMemoryMiB": 0, "image": "x"},
            "parents": [{"type": "Namespace", "id": "training"}]}]))
        .unwrap();
    let mut r = review("Pod", "training", gpu_pod("t", 1, "8"));
    r["request"]["operation"] = json!("UPDATE");
    let response = validate(&s, &r).await;
    assert_eq!(response["allowed"], true, "{response}");
}

#[tokio::test]
async fn a_workload_class_spelled_another_way_is_refused() {
    let s = state();
    let mut pod = gpu_pod("rl", 1, "8");
    pod["metadata"]["labels"] = json!({"probity.io/class": "RLHF"});
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("workload class \"RLHF\" is not one of the configured classes"),
        "{r}"
    );
}

/// An UPDATE review of `object` whose old object was `old`.
fn update(kind: &str, namespace: &str, object: Value, old: Value) -> Value {
    let mut r = review(kind, namespace, object);
    r["request"]["operation"] = json!("UPDATE");
    r["request"]["oldObject"] = old;
    r
}

/// Issue 28, item 4: a validating UPDATE of a bound pod decided `schedule` again, so
/// once its node was blocked every update was refused, the removal of a finalizer
/// included, and the pod stayed Terminating for good.
#[tokio::test]
async fn bug_a_pod_on_a_blocked_node_could_not_lose_its_finalizer() {
    let s = state();
    let mut old = gpu_pod("bound", 1, "8");
    old["spec"]["nodeName"] = json!("gpu-blocked");
    old["metadata"]["finalizers"] = json!(["example.com/cleanup"]);

    // Deleting: the finalizer goes.
    let mut deleting = old.clone();
    deleting["metadata"]["deletionTimestamp"] = json!("2026-12-04T10:00:00Z");
    let mut gone = deleting.clone();
    gone["metadata"]["finalizers"] = json!([]);
    let r = validate(&s, &update("Pod", "training", gone, deleting)).await;
    assert_eq!(r["allowed"], true, "{r}");

    // A metadata-only update (a label) of the same pod, not being deleted.
    let mut labelled = old.clone();
    labelled["metadata"]["labels"] = json!({"team": "a"});
    let r = validate(&s, &update("Pod", "training", labelled, old.clone())).await;
    assert_eq!(r["allowed"], true, "{r}");

    // An update that changes what the policies read (the image) is judged for
    // admission, but a bound pod's placement is never decided again.
    let mut new_image = old.clone();
    new_image["spec"]["containers"][0]["image"] = json!("nvcr.io/nvidia/tritonserver:25.02");
    let r = validate(&s, &update("Pod", "training", new_image, old.clone())).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(!r.to_string().contains("security.blocked-node"), "{r}");

    // A CREATE onto the blocked node is still refused.
    let r = validate(&s, &review("Pod", "training", old)).await;
    assert_eq!(r["allowed"], false, "{r}");
}

/// Issue 28, item 4, for workload templates: an UPDATE refuses only what it
/// introduces; a violation the old object already had is a warning.
#[tokio::test]
async fn a_template_update_refuses_only_the_violation_it_introduces() {
    let s = state();
    let deployment = |cpu: &str, replicas: u32| {
        json!({"metadata": {"name": "d"}, "spec": {"replicas": replicas, "template": {
            "metadata": {"labels": {"app": "x"}}, "spec": gpu_pod("t", 2, cpu)["spec"].clone()}}})
    };
    // 4 CPUs for 2 GPUs in inference is refused (see pod_templates_of_workload_kinds_are_checked).
    let r = validate(&s, &review("Deployment", "inference", deployment("4", 1))).await;
    assert_eq!(r["allowed"], false, "{r}");
    // An update that introduces it is refused.
    let r = validate(
        &s,
        &update(
            "Deployment",
            "inference",
            deployment("4", 1),
            deployment("16", 1),
        ),
    )
    .await;
    assert_eq!(r["allowed"], false, "{r}");
    // Scaling a deployment that already had it: the template is unchanged, allowed.
    let r = validate(
        &s,
        &update(
            "Deployment",
            "inference",
            deployment("4", 3),
            deployment("4", 1),
        ),
    )
    .await;
    assert_eq!(r["allowed"], true, "{r}");
    // A template change that leaves the old violation as it was: allowed, with the
    // violation as a warning.
    let mut relabelled = deployment("4", 1);
    relabelled["spec"]["template"]["spec"]["containers"][0]["image"] = json!("other:1");
    let r = validate(
        &s,
        &update("Deployment", "inference", relabelled, deployment("4", 1)),
    )
    .await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(
        r["warnings"]
            .to_string()
            .contains("already refused before this update"),
        "{r}"
    );
}

fn binding(namespace: &str, name: &str, pod_uid: &str, node: &str) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("bind-{name}-{node}"),
            "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "binding",
            "namespace": namespace,
            "name": name,
            "operation": "CREATE",
            "userInfo": {"username": "system:kube-scheduler"},
            "object": {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace, "uid": pod_uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
            "oldObject": null,
            "dryRun": false
        }
    })
}

/// Issue 28, item 3: a binding was judged as a workload of the default class, so
/// `placement.dedicated-zone` refused every binding of an RL-HF pod to the RL-HF nodes,
/// the only ones the extender lets it use: with the shipped webhooks RL-HF pods could
/// never bind. The pod's facts are now remembered at admission and the binding judged
/// with them.
#[tokio::test]
async fn bug_an_rlhf_pod_could_never_bind_to_its_dedicated_zone() {
    use probity::state::SharedState as _;
    let tmp = tempfile::tempdir().unwrap();
    let store =
        std::sync::Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, probity_server::Config::default());

    let mut pod = gpu_pod("rl-0", 1, "8");
    pod["metadata"]["labels"] = json!({"probity.io/class": "rlhf"});
    pod["metadata"]["uid"] = json!("pod-uid-1");
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert_eq!(
        store
            .admitted("training", "rl-0", 3600)
            .unwrap()
            .unwrap()
            .uid,
        "pod-uid-1"
    );

    // Bound into its dedicated zone: allowed, judged as the RL-HF pod it is.
    let r = validate(&s, &binding("training", "rl-0", "pod-uid-1", "gpu-h1")).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(!r.to_string().contains("node-level rules only"), "{r}");
    // Decided: forgotten.
    assert!(store.admitted("training", "rl-0", 3600).unwrap().is_none());

    // A binding after that (or of a pod never seen) falls back, and says so.
    let r = validate(&s, &binding("training", "rl-0", "pod-uid-1", "gpu-h1")).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["warnings"].to_string().contains(
            "no facts of pod training/rl-0 were remembered at its admission; the binding is checked with the node-level rules only"
        ),
        "{r}"
    );
    // The RL-HF pod's facts do not go to another pod under the same name.
    let mut pod = gpu_pod("rl-1", 1, "8");
    pod["metadata"]["labels"] = json!({"probity.io/class": "rlhf"});
    pod["metadata"]["uid"] = json!("pod-uid-2");
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], true, "{r}");
    let r = validate(&s, &binding("training", "rl-1", "pod-uid-3", "gpu-h1")).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["warnings"]
            .to_string()
            .contains("had uid pod-uid-2, this binding names pod-uid-3"),
        "{r}"
    );
    // A remembered batch pod is still refused the RL-HF zone, by its own facts.
    let mut pod = gpu_pod("batch-0", 1, "8");
    pod["metadata"]["uid"] = json!("pod-uid-4");
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], true, "{r}");
    let r = validate(&s, &binding("training", "batch-0", "pod-uid-4", "gpu-h1")).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(r.to_string().contains("placement.dedicated-zone"), "{r}");
    let r = validate(&s, &binding("training", "batch-0", "pod-uid-4", "gpu-a1")).await;
    assert_eq!(r["allowed"], true, "{r}");
}

/// A node the store knows only from the cluster (the controller's facts, no agent's
/// yet) is as unknown to admission's "warn" as an absent one, and the warning says
/// which: it has no telemetry yet.
#[tokio::test]
async fn with_unknown_nodes_warn_a_node_known_only_from_the_cluster_is_warned_about_as_without_telemetry()
 {
    let mut config = Config::default();
    config.admission.unknown_nodes = probity_server::UnknownNodes::Warn;
    let s = state_with(config);
    s.engine()
        .replace_cluster_facts(&json!([{
            "uid": {"type": "Node", "id": "cpu-new"},
            "attrs": {"zone": {"__entity": {"type": "Zone", "id": "zone-a"}},
                      "cpuAllocatableMillis": 64000},
        }]))
        .unwrap();
    let mut pod = gpu_pod("bound", 1, "8");
    pod["spec"]["nodeName"] = json!("cpu-new");
    let r = validate(&s, &review("Pod", "training", pod.clone())).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(
        r["warnings"][0]
            .as_str()
            .unwrap()
            .contains("node cpu-new has no telemetry yet"),
        "{r}"
    );
    // Under the default ("deny") it is refused: its rules cannot be evaluated.
    let s = state();
    s.engine()
        .replace_cluster_facts(&json!([{
            "uid": {"type": "Node", "id": "cpu-new"},
            "attrs": {"zone": {"__entity": {"type": "Zone", "id": "zone-a"}}},
        }]))
        .unwrap();
    let r = validate(&s, &review("Pod", "training", pod)).await;
    assert_eq!(r["allowed"], false, "{r}");
}
