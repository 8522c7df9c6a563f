//! Policy modes through the server: a `warn` policy's finding reaches the API client
//! as an AdmissionReview warning, an `audit` one as an audit annotation; neither
//! refuses, neither filters a node out of the extender's answer; both are counted.

use axum::http::{Method, StatusCode};
use probity_server::{AppState, Config};
use serde_json::{Value, json};

use crate::admission::{gpu_pod, review, validate};
use crate::{call, root};

/// The server on a copy of the default policies whose probity.toml gains `modes`.
fn state_with_modes(modes: &str) -> (tempfile::TempDir, AppState) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    crate::placement::copy_dir(&root().join("policies"), &dir);
    let config = dir.join("probity.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[modes]\n");
    text.push_str(modes);
    std::fs::write(&config, text).unwrap();
    let engine = probity::Engine::builder(&dir).build().unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    (tmp, AppState::new(engine, Config::default()))
}

fn greedy() -> Value {
    review("Pod", "inference", gpu_pod("greedy", 2, "8000m"))
}

#[tokio::test]
async fn a_warn_policy_admits_and_the_client_is_warned() {
    let (_tmp, s) = state_with_modes("\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n");
    let r = validate(&s, &greedy()).await;
    assert_eq!(r["allowed"], true, "{r}");
    let warnings: Vec<&str> = r["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert_eq!(warnings.len(), 1, "{r}");
    assert!(
        warnings[0].starts_with(
            "probity: admit into namespace inference: the inference namespace keeps at most 1 GPU"
        ),
        "{r}"
    );
    assert!(
        warnings[0].ends_with("(placement.inference-gpu-cpu-ratio, warn mode)"),
        "{r}"
    );
    assert!(r.get("auditAnnotations").is_none(), "{r}");
}

#[tokio::test]
async fn an_audit_policy_admits_silently_and_annotates_the_apiservers_audit() {
    let (_tmp, s) = state_with_modes("\"placement.inference-gpu-cpu-ratio\" = \"audit\"\n");
    let r = validate(&s, &greedy()).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(r.get("warnings").is_none(), "{r}");
    let annotation = r["auditAnnotations"]["placement.inference-gpu-cpu-ratio"]
        .as_str()
        .unwrap();
    assert!(
        annotation.starts_with("admit into namespace inference: the inference namespace keeps"),
        "{annotation}"
    );
    // Counted by policy and mode; the mode itself is exported.
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    let text = metrics.as_str().unwrap();
    assert!(
        text.contains(
            "probity_policy_findings_total{mode=\"audit\",policy=\"placement.inference-gpu-cpu-ratio\"} 1"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "probity_policy_mode{mode=\"audit\",policy=\"placement.inference-gpu-cpu-ratio\",scoped=\"false\"} 1"
        ),
        "{text}"
    );
    let (status, policy) = call(&s, Method::GET, "/v1/policy/status", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        policy["modes"]["placement.inference-gpu-cpu-ratio"]["mode"], "audit",
        "{policy}"
    );
}

#[tokio::test]
async fn the_extender_does_not_filter_on_a_policy_that_does_not_enforce() {
    let pod = json!({
        "metadata": {"name": "t", "namespace": "training", "labels": {"probity.io/class": "batch"}},
        "spec": {"containers": [{"name": "c", "image": "trainer:1",
            "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "8"}}}]}
    });
    let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-a1", "gpu-hot1"]});
    let (_tmp, enforcing) = state_with_modes("");
    let (_, out) = call(
        &enforcing,
        Method::POST,
        "/v1/scheduler/filter",
        Some(&body),
        None,
    )
    .await;
    assert!(out["FailedNodes"]["gpu-hot1"].is_string(), "{out}");

    let (_tmp, s) = state_with_modes("\"thermal.zone-power-ceiling\" = \"warn\"\n");
    let (status, out) = call(&s, Method::POST, "/v1/scheduler/filter", Some(&body), None).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["NodeNames"], json!(["gpu-a1", "gpu-hot1"]), "{out}");
    assert_eq!(out["FailedNodes"], json!({}), "{out}");
}
