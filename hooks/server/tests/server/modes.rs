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

/// A server on the default policies whose `[policies] shadow` is `shadow`, deciding
/// every request again under it.
fn state_with_shadow(shadow: &std::path::Path) -> AppState {
    let engine = crate::engine();
    let mut config = Config::default();
    config.policies.shadow = Some(shadow.to_owned());
    config.policies.shadow_sample_every = 1;
    AppState::new(engine, config)
}

#[tokio::test]
async fn a_shadow_set_never_changes_an_answer_and_counts_its_disagreements() {
    // The candidate: the zone ceiling only warns, so a hot zone takes work.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("next");
    crate::placement::copy_dir(&root().join("policies"), &dir);
    let config = dir.join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!("{text}\n[modes]\n\"thermal.zone-power-ceiling\" = \"warn\"\n"),
    )
    .unwrap();
    let shadowed = state_with_shadow(&dir);
    let plain = crate::state();
    let nodes = [
        "gpu-a1",
        "gpu-hot1",
        "gpu-blocked",
        "gpu-drift",
        "gpu-hot1",
        "gpu-a1",
    ];
    for node in nodes {
        let request = json!({"principal": "Workload::\"train-1\"", "action": "schedule",
                             "resource": format!("Node::\"{node}\"")});
        let (_, with) = call(&shadowed, Method::POST, "/v1/decide", Some(&request), None).await;
        let (_, without) = call(&plain, Method::POST, "/v1/decide", Some(&request), None).await;
        assert_eq!(with, without, "the shadow changed the answer for {node}");
    }
    // The shadow thread decides off the hot path: wait for it, boundedly.
    let mut report = Value::Null;
    for _ in 0..200 {
        let (status, r) = call(&shadowed, Method::GET, "/v1/policy/shadow", None, None).await;
        assert_eq!(status, StatusCode::OK, "{r}");
        report = r;
        let done = report["agreed"].as_u64().unwrap() + report["disagreed"].as_u64().unwrap();
        if done == nodes.len() as u64 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(report["disagreed"], 2, "{report:#}");
    assert_eq!(report["agreed"], 4, "{report:#}");
    assert_eq!(report["dropped"], 0);
    assert_eq!(
        report["by_policy"]["thermal.zone-power-ceiling"], 2,
        "{report:#}"
    );
    let recent = &report["recent"][0];
    assert_eq!(recent["request"]["resource"], "Node::\"gpu-hot1\"");
    assert_eq!(recent["live"]["decision"], "deny");
    assert_eq!(recent["shadow"]["decision"], "allow");
    let (_, metrics) = call(&shadowed, Method::GET, "/metrics", None, None).await;
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("probity_shadow_decisions_total{outcome=\"disagreed\"} 2"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_shadow_set_with_another_schema_is_refused_and_none_is_not_found() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("next");
    crate::placement::copy_dir(&root().join("policies"), &dir);
    let schema = dir.join("probity.cedarschema");
    let text = std::fs::read_to_string(&schema).unwrap();
    std::fs::write(&schema, format!("{text}\nentity Extra;\n")).unwrap();
    let s = state_with_shadow(&dir);
    let (status, body) = call(&s, Method::GET, "/v1/policy/shadow", None, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body.to_string()
            .contains("its schema must be the live set's"),
        "{body}"
    );
    // The live answers are unaffected.
    let request = json!({"principal": "Workload::\"train-1\"", "action": "schedule",
                         "resource": "Node::\"gpu-a1\""});
    let (status, d) = call(&s, Method::POST, "/v1/decide", Some(&request), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(d["decision"], "allow");
    let (status, _) = call(
        &crate::state(),
        Method::GET,
        "/v1/policy/shadow",
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn reports_list_what_warn_and_audit_policies_find_in_the_store() {
    let (_tmp, s) = state_with_modes(
        "\"placement.driver-drift\" = \"audit\"\n\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n",
    );
    let (status, report) = call(&s, Method::GET, "/v1/reports", None, None).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    let nodes = report["nodes"].as_array().unwrap();
    let mut drifted: Vec<&str> = nodes.iter().map(|n| n["name"].as_str().unwrap()).collect();
    drifted.sort_unstable();
    // The drifted driver and the old CUDA image, as the enforcing rule refuses them.
    assert_eq!(drifted, ["gpu-drift", "gpu-oldimage"], "{report:#}");
    assert!(
        nodes
            .iter()
            .all(|n| n["mode"] == "audit" && n["policy"] == "placement.driver-drift")
    );
    let inference = report["workloads"]["inference"].as_array().unwrap();
    assert_eq!(inference.len(), 1, "{report:#}");
    assert_eq!(inference[0]["name"], "infer-greedy");
    assert_eq!(inference[0]["mode"], "warn");
    // Judging the store records nothing and changes nothing.
    let (_, again) = call(&s, Method::GET, "/v1/reports", None, None).await;
    assert_eq!(again, report);
}
