//! The JSON API through `oneshot`: every route, its errors, and the Cedar authorization
//! of mutating calls.

use axum::http::{Method, StatusCode};
use probity_server::Config;
use serde_json::json;

use crate::{call, call_raw, metric, state, state_with};

fn decide_body() -> serde_json::Value {
    json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-blocked\""})
}

#[tokio::test]
async fn decide_answers_with_the_decision_and_its_reasons() {
    let s = state();
    let (status, body) = call(&s, Method::POST, "/v1/decide", Some(&decide_body()), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["decision"], "deny");
    assert_eq!(body["reasons"][0]["policy"], "security.blocked-node");
    let ok = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""});
    let (_, body) = call(&s, Method::POST, "/v1/decide", Some(&ok), None).await;
    assert_eq!(body["decision"], "allow");
}

#[tokio::test]
async fn decide_rejects_bad_requests_with_a_json_error() {
    let s = state();
    let (status, body) = call_raw(
        &s,
        Method::POST,
        "/v1/decide",
        b"{\n \"principal\": }".to_vec(),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], 400);
    assert_eq!(
        body["error"],
        "request is not valid JSON at line 2, column 15"
    );
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/decide",
        Some(&json!({"action": "schedule"})),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"].as_str().unwrap().contains("principal"),
        "{body}"
    );
}

#[tokio::test]
async fn batch_decides_every_request_in_order() {
    let s = state();
    let ok = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""});
    let mut requests = vec![ok.clone(), decide_body()];
    // Large enough to run on the blocking pool.
    requests.extend(std::iter::repeat_n(ok, 40));
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&json!({"requests": requests})),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let d = body["decisions"].as_array().unwrap();
    assert_eq!(d.len(), 42);
    assert_eq!(d[0]["decision"], "allow");
    assert_eq!(d[1]["decision"], "deny");
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&json!({"requests": [1]})),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"].as_str().unwrap().starts_with("requests[0]"),
        "{body}"
    );
}

fn zone(id: &str) -> serde_json::Value {
    json!([{"uid": {"type": "Zone", "id": id}, "parents": [],
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": 1, "powerCeilingW": 100}}])
}

#[tokio::test]
async fn entities_are_upserted_read_and_removed_by_an_admin() {
    let s = state();
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&zone("zone-new")),
        Some("uid:0"),
    )
    .await;
    assert_eq!((status, body), (StatusCode::OK, json!({"upserted": 1})));
    let (status, body) = call(&s, Method::GET, "/v1/entities/Zone/zone-new", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["attrs"]["powerCeilingW"], 100);
    let (status, _) = call(
        &s,
        Method::DELETE,
        "/v1/entities",
        Some(&json!({"uids": ["Zone::\"zone-new\""]})),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = call(&s, Method::GET, "/v1/entities/Zone/zone-new", None, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"], "no entity Zone::\"zone-new\"");
}

#[tokio::test]
async fn every_entity_of_a_type_is_read_in_one_request_sorted_by_id() {
    let s = state();
    for id in ["zone-b", "zone-a"] {
        let (status, _) = call(
            &s,
            Method::POST,
            "/v1/entities",
            Some(&zone(id)),
            Some("uid:0"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, body) = call(&s, Method::GET, "/v1/entities/Zone", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let ids: Vec<&str> = body["entities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["uid"]["id"].as_str().unwrap())
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert!(
        ids.contains(&"zone-a") && ids.contains(&"zone-b"),
        "{ids:?}"
    );
    let (status, body) = call(&s, Method::GET, "/v1/entities/Not%20a%20type", None, None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

#[tokio::test]
async fn entity_writes_need_a_permitted_caller() {
    let s = state();
    for caller in [None, Some("uid:1000"), Some("cn:somebody")] {
        let (status, body) = call(&s, Method::POST, "/v1/entities", Some(&zone("z")), caller).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{caller:?}");
        assert_eq!(body["code"], 403);
    }
    let (_, body) = call(&s, Method::POST, "/v1/entities", Some(&zone("z")), None).await;
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("api.anonymous-read-only"),
        "{body}"
    );
    // A configured entity writer may.
    let mut config = Config::default();
    config
        .auth
        .groups
        .insert("entity-writers".into(), vec!["cn:inventory".into()]);
    let s = state_with(config);
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&zone("z")),
        Some("cn:inventory"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn invalid_entities_are_422_and_leave_the_store_alone() {
    let s = state();
    let bad = json!([{"uid": {"type": "Zone", "id": "z"}, "attrs": {"powerDrawW": "lots"}, "parents": []}]);
    let (status, body) = call(&s, Method::POST, "/v1/entities", Some(&bad), Some("uid:0")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("entities[0] (Zone::\"z\"): "),
        "{body}"
    );
    let (status, _) = call(&s, Method::GET, "/v1/entities/Zone/z", None, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = call(
        &s,
        Method::DELETE,
        "/v1/entities",
        Some(&json!({"uids": [3]})),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn nodes_are_blocked_and_unblocked_under_policy() {
    let mut config = Config::default();
    config
        .auth
        .nodes
        .insert("cn:sidecar-gpu-a1".into(), "gpu-a1".into());
    let s = state_with(config);
    // A node's own sidecar blocks its node.
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/nodes/gpu-a1/block",
        Some(&json!({"reason": "checkpoint failed verification"})),
        Some("cn:sidecar-gpu-a1"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, body) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    assert_eq!(
        body["nodes"]["gpu-a1"]["reason"],
        "checkpoint failed verification"
    );
    let (_, d) = call(
        &s,
        Method::POST,
        "/v1/decide",
        Some(&json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""})),
        None,
    )
    .await;
    assert_eq!(d["decision"], "deny");
    // ...but not another node, and it may not unblock itself.
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/nodes/gpu-h1/block",
        None,
        Some("cn:sidecar-gpu-a1"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/nodes/gpu-a1/unblock",
        None,
        Some("cn:sidecar-gpu-a1"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("api.unblock-needs-admin"),
        "{body}"
    );
    // An admin may.
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/nodes/gpu-a1/unblock",
        None,
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, body) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    assert!(body["nodes"].get("gpu-a1").is_none(), "{body}");
}

#[tokio::test]
async fn the_blocklist_numbers_each_block_and_shows_the_tombstone_of_each_unblock() {
    let tmp = tempfile::tempdir().unwrap();
    let store =
        std::sync::Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store).unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let post = |path: &'static str| {
        let s = s.clone();
        async move {
            let (status, body) = call(&s, Method::POST, path, None, Some("uid:0")).await;
            assert_eq!(status, StatusCode::OK, "{path}: {body}");
        }
    };
    // The fixture's block, made before the store was attached, took the first number.
    let (_, body) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    assert_eq!(body["nodes"]["gpu-blocked"]["revision"], 1, "{body}");
    post("/v1/nodes/gpu-a1/block").await;
    let (_, body) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    assert_eq!(body["nodes"]["gpu-a1"]["revision"], 2, "{body}");
    assert_eq!(body["tombstones"], json!({}), "{body}");
    post("/v1/nodes/gpu-a1/unblock").await;
    post("/v1/nodes/gpu-a1/block").await;
    let (_, body) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    // The new block is numbered after the unblock that lifted the first one (3),
    // whose tombstone it replaces.
    assert_eq!(body["nodes"]["gpu-a1"]["revision"], 4, "{body}");
    assert_eq!(body["tombstones"], json!({}), "{body}");
    post("/v1/nodes/gpu-a1/unblock").await;
    let (_, body) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    assert_eq!(body["tombstones"], json!({"gpu-a1": 5}), "{body}");
}

#[tokio::test]
async fn status_health_readiness_and_metrics() {
    let s = state();
    let (status, body) = call(&s, Method::GET, "/v1/policy/status", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["digest"].as_str().unwrap().len(), 64);
    assert_eq!(body["last_error"], serde_json::Value::Null);
    let (status, _) = call(&s, Method::GET, "/healthz", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = call(&s, Method::GET, "/readyz", None, None).await;
    assert_eq!((status, &body["status"]), (StatusCode::OK, &json!("ready")));
    call(&s, Method::POST, "/v1/decide", Some(&decide_body()), None).await;
    let (status, body) = call(&s, Method::GET, "/metrics", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let text = body.as_str().unwrap();
    assert!(
        text.contains("probity_decisions_total{outcome=\"deny\"} 1"),
        "{text}"
    );
    assert!(text.contains(
        "probity_decision_reasons_total{outcome=\"deny\",policy=\"security.blocked-node\"} 1"
    ));
    assert!(text.contains(
        "probity_http_request_duration_seconds_bucket{route=\"/v1/decide\",le=\"+Inf\"} 1"
    ));
    assert!(text.contains("probity_policy_reload_errors_total 0"));
    s.set_ready(false);
    let (status, body) = call(&s, Method::GET, "/readyz", None, None).await;
    assert_eq!(
        (status, &body["code"]),
        (StatusCode::SERVICE_UNAVAILABLE, &json!(503))
    );
}

#[tokio::test]
async fn unknown_routes_methods_and_oversized_bodies_are_json_errors() {
    let s = state();
    let (status, body) = call(&s, Method::GET, "/v2/nothing", None, None).await;
    assert_eq!(
        (status, body["code"].clone()),
        (StatusCode::NOT_FOUND, json!(404))
    );
    let (status, body) = call(&s, Method::GET, "/v1/decide", None, None).await;
    assert_eq!(
        (status, body["code"].clone()),
        (StatusCode::METHOD_NOT_ALLOWED, json!(405))
    );
    let mut config = Config::default();
    config.server.max_body_bytes = 1024;
    let s = state_with(config);
    let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(2048)).into_bytes();
    let (status, body) = call_raw(&s, Method::POST, "/v1/decide", big, None).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        body,
        json!({"error": "request body is over the limit of 1024 bytes", "code": 413})
    );
}

/// A request body that never arrives.
struct Never;

impl hyper::body::Body for Never {
    type Data = hyper::body::Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

#[tokio::test]
async fn a_stalled_request_times_out_with_a_json_error() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let mut config = Config::default();
    config.server.request_timeout_ms = 100;
    let router = probity_server::app(state_with(config));
    let stalled = axum::http::Request::post("/v1/decide")
        .body(axum::body::Body::new(Never))
        .unwrap();
    let response = router.oneshot(stalled).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body, json!({"error": "request timed out", "code": 503}));
}

#[tokio::test]
async fn verify_passes_an_intact_checkpoint_and_blocks_the_node_on_a_flipped_byte() {
    use probity::integrity::{self, Anchor, HashOptions, SoftwareAnchor};
    use probity::state::StateStore;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("state");
    let store = Arc::new(StateStore::open(&state_dir).unwrap());
    let anchor = SoftwareAnchor::load_or_generate(&tmp.path().join("anchor.key")).unwrap();
    std::fs::write(state_dir.join("trusted.pub"), anchor.public_key().to_hex()).unwrap();
    let file = tmp.path().join("epoch-9.ckpt");
    let data: Vec<u8> = (0..50_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(&file, &data).unwrap();
    let options = HashOptions {
        chunk_size: 4096,
        ..HashOptions::default()
    };
    let signed =
        integrity::SignedManifest::seal(&file, "llm/epoch-9", 1, &anchor, store.as_ref(), &options)
            .unwrap();
    std::fs::write(tmp.path().join("epoch-9.ckpt.manifest"), signed.encode()).unwrap();

    let mut config = Config::default();
    config.integrity.state_dir = Some(state_dir.clone());
    config.integrity.data_roots = vec![tmp.path().to_owned()];
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, config);
    let body = json!({"path": file, "id": "llm/epoch-9", "node": "gpu-a1"});

    // Anonymous callers may not verify (a failure blocks a node).
    let (status, _) = call(&s, Method::POST, "/v1/verify", Some(&body), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["verified"], true);
    assert_eq!(out["decision"]["decision"], "allow");

    let mut bad = data.clone();
    bad[9000] ^= 0x10;
    std::fs::write(&file, &bad).unwrap();
    let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["verified"], false);
    assert!(
        out["failure"].as_str().unwrap().contains("chunk 2"),
        "{out}"
    );
    assert_eq!(out["decision"]["decision"], "deny");
    assert_eq!(out["decision"]["obligations"][0]["kind"], "block_node");
    let (_, blocked) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    assert!(blocked.to_string().contains("gpu-a1"), "{blocked}");
    assert!(store.blocked("gpu-a1").unwrap().is_some());
    let sched = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""});
    let (_, d) = call(&s, Method::POST, "/v1/decide", Some(&sched), None).await;
    assert_eq!(d["reasons"][0]["policy"], "security.blocked-node");

    // Every deny was recorded before it was answered: the forbidden anonymous
    // verify, the failed read, and the schedule onto the blocked node.
    let records = store.decisions(0, 100).unwrap();
    let summary: Vec<(String, String, String)> = records
        .iter()
        .map(|r| {
            (
                r.action.clone(),
                r.resource.clone(),
                r.decision.reasons[0].policy.clone(),
            )
        })
        .collect();
    assert_eq!(records.len(), 3, "{summary:?}");
    assert_eq!(summary[1].0, r#"Action::"read""#, "{summary:?}");
    assert_eq!(
        summary[2],
        (
            r#"Action::"schedule""#.to_owned(),
            r#"Node::"gpu-a1""#.to_owned(),
            "security.blocked-node".to_owned()
        )
    );
}

/// Issue 28, item 1: `POST /v1/verify` read the pinned key on each request without the
/// trust check the CLI and sealed mode make: a user who could write the key and the data
/// sealed tampered bytes under a key of their own, and the server answered verified.
#[tokio::test]
async fn verify_refuses_a_pinned_key_that_others_can_write_and_readiness_says_why() {
    use probity::integrity::{self, Anchor, HashOptions, SoftwareAnchor};
    use probity::state::StateStore;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("state");
    let store = Arc::new(StateStore::open(&state_dir).unwrap());
    // The attacker's own anchor, its key written where the server pins it.
    let forger = SoftwareAnchor::load_or_generate(&tmp.path().join("forger.key")).unwrap();
    let key_path = state_dir.join("trusted.pub");
    std::fs::write(&key_path, forger.public_key().to_hex()).unwrap();
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let file = tmp.path().join("epoch-9.ckpt");
    std::fs::write(&file, b"tampered weights").unwrap();
    let signed = integrity::SignedManifest::seal(
        &file,
        "llm/epoch-9",
        1,
        &forger,
        store.as_ref(),
        &HashOptions::default(),
    )
    .unwrap();
    std::fs::write(tmp.path().join("epoch-9.ckpt.manifest"), signed.encode()).unwrap();

    let mut config = Config::default();
    config.integrity.state_dir = Some(state_dir.clone());
    config.integrity.data_roots = vec![tmp.path().to_owned()];
    let engine = crate::engine();
    engine.attach_state(store).unwrap();
    let s = probity_server::AppState::new(engine, config);
    let body = json!({"path": file, "id": "llm/epoch-9", "node": "gpu-a1"});
    let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{out}");
    let message = out["error"].as_str().unwrap();
    assert!(
        message.starts_with("the pinned public key is not trusted: ")
            && message.contains(&key_path.display().to_string())
            && message.contains("lets group and others write it"),
        "{out}"
    );
    let (status, ready) = call(&s, Method::GET, "/readyz", None, None).await;
    assert_eq!(status, StatusCode::OK, "{ready}");
    assert_eq!(ready["status"], "degraded", "{ready}");
    assert!(
        ready["warnings"]
            .to_string()
            .contains("POST /v1/verify answers 503"),
        "{ready}"
    );
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("probity_verify_key_trusted 0"),
        "{metrics}"
    );

    // The operator fixes the mode: verification is served again, at once.
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let (_, ready) = call(&s, Method::GET, "/readyz", None, None).await;
    assert_eq!(ready["status"], "ready", "{ready}");
}

#[tokio::test]
async fn verify_without_a_state_directory_is_unavailable() {
    let s = state();
    let body = json!({"path": "/nonexistent", "id": "x", "node": "gpu-a1"});
    let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{out}");
    assert!(
        out["error"].as_str().unwrap().contains("state directory"),
        "{out}"
    );
}

/// Issue 28, item 10: decision records did not name who asked, so a flood or a forged
/// request could not be traced from the log.
#[tokio::test]
async fn decision_records_name_the_caller_who_asked() {
    use probity::state::StateStore;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let deny = json!({"principal": "Workload::\"train-1\"", "action": "schedule",
                      "resource": "Node::\"gpu-blocked\""});
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/decide",
        Some(&deny),
        Some("cn:scheduler"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let batch = json!({"requests": [deny.clone()]});
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&batch),
        Some("uid:1001"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call(&s, Method::POST, "/v1/decide", Some(&deny), None).await;
    assert_eq!(status, StatusCode::OK);
    let mut pod = crate::admission::gpu_pod("on-blocked", 1, "4");
    pod["spec"]["nodeName"] = json!("gpu-blocked");
    let review = crate::admission::review("Pod", "ml-train", pod);
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/admission/validate",
        Some(&review),
        Some("cn:kube-apiserver"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    let callers: Vec<Option<String>> = store
        .decisions(0, 100)
        .unwrap()
        .into_iter()
        .map(|r| r.caller)
        .collect();
    assert_eq!(
        callers,
        [
            Some("cn:scheduler".to_owned()),
            Some("uid:1001".to_owned()),
            Some("anonymous".to_owned()),
            Some("cn:kube-apiserver".to_owned()),
        ]
    );
}

#[tokio::test]
async fn the_decision_log_is_read_by_auditors_and_admins_only() {
    use probity::state::StateStore;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let mut config = Config::default();
    config
        .auth
        .groups
        .insert("auditors".into(), vec!["cn:audit-export".into()]);
    let engine = crate::engine();
    engine.attach_state(store).unwrap();
    let s = probity_server::AppState::new(engine, config);

    // Two denies and an allow: the denies are recorded before they are answered.
    for node in ["gpu-blocked", "gpu-a1", "gpu-blocked"] {
        let req = json!({"principal": "Workload::\"train-1\"", "action": "schedule",
                         "resource": format!("Node::\"{node}\"")});
        let (status, _) = call(&s, Method::POST, "/v1/decide", Some(&req), None).await;
        assert_eq!(status, StatusCode::OK);
    }

    let (status, out) = call(
        &s,
        Method::GET,
        "/v1/decisions",
        None,
        Some("cn:audit-export"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let records = out["records"].as_array().unwrap();
    assert_eq!(records.len(), 2, "{out}");
    assert_eq!(records[0]["seq"], 0);
    assert_eq!(records[1]["seq"], 1);
    assert_eq!(records[0]["resource"], "Node::\"gpu-blocked\"");
    assert_eq!(records[0]["decision"]["decision"], "deny");
    assert_eq!(out["next"], 2);

    let (_, out) = call(
        &s,
        Method::GET,
        "/v1/decisions?from=1&limit=5",
        None,
        Some("uid:0"),
    )
    .await;
    assert_eq!(out["records"].as_array().unwrap().len(), 1, "{out}");

    // Anyone else is refused, and the refusal is itself a recorded deny.
    let (status, _) = call(&s, Method::GET, "/v1/decisions", None, Some("cn:sidecar")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = call(&s, Method::GET, "/v1/decisions", None, None).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (_, out) = call(&s, Method::GET, "/v1/decisions?from=2", None, Some("uid:0")).await;
    let refusals = out["records"].as_array().unwrap();
    assert_eq!(refusals.len(), 2, "{out}");
    assert_eq!(refusals[0]["principal"], "ApiCaller::\"cn:sidecar\"");
    assert_eq!(refusals[0]["resource"], "Api::\"decisions\"");

    let (status, out) = call(
        &s,
        Method::GET,
        "/v1/decisions?limit=x",
        None,
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
}

#[tokio::test]
async fn without_a_state_directory_the_decision_log_is_unavailable() {
    let s = probity_server::AppState::new(crate::engine(), Config::default());
    let (status, out) = call(&s, Method::GET, "/v1/decisions", None, Some("uid:0")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("no state directory"),
        "{out}"
    );
}

/// Issue: `POST /v1/decide` merged request entities over the stored ones, so a caller
/// scheduled onto a node blocked through the API by sending the node with
/// `"blocked": false`.
#[tokio::test]
async fn bug_a_request_entity_unblocked_a_node_blocked_through_the_api() {
    let s = state();
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/nodes/gpu-a1/block",
        Some(&json!({"reason": "r"})),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let mut node = crate::cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .cloned()
        .unwrap();
    node["attrs"]["blocked"] = json!(false);
    let body = json!({"principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\"", "entities": [node]});
    let (status, d) = call(&s, Method::POST, "/v1/decide", Some(&body), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(d["decision"], "deny", "{d}");
    assert!(
        d["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("the store holds this entity"),
        "{d}"
    );
}

/// A server whose `fact-reporters` group is `cn:auditd-reader` alone.
fn with_auditd_reporter() -> probity_server::AppState {
    let mut config = Config::default();
    config
        .auth
        .groups
        .insert("fact-reporters".into(), vec!["cn:auditd-reader".into()]);
    state_with(config)
}

#[tokio::test]
async fn only_authorized_reporters_supply_the_facts_the_engine_owns() {
    let s = with_auditd_reporter();
    let body = json!({"principal": "User::\"bob\"", "action": "elevate",
        "resource": "Node::\"gpu-a1\"", "context": {"now": 1_767_139_200, "lastRemoteLoginAt": 1_767_139_100}});
    // Anyone else is refused, whatever the facts say.
    let (_, d) = call(
        &s,
        Method::POST,
        "/v1/decide",
        Some(&body),
        Some("cn:someone"),
    )
    .await;
    assert_eq!(d["decision"], "deny");
    assert!(
        d["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("may ask `elevate`"),
        "{d}"
    );
    // The reporter is judged on its facts: bob, 100 s after a remote login.
    let (_, d) = call(
        &s,
        Method::POST,
        "/v1/decide",
        Some(&body),
        Some("cn:auditd-reader"),
    )
    .await;
    assert_eq!(d["decision"], "deny", "{d}");
    assert_eq!(
        d["reasons"][0]["policy"], "security.elevation-after-remote-login",
        "{d}"
    );
    assert!(d["errors"].as_array().unwrap().is_empty(), "{d}");
    // A batch is authorized once, for every request in it.
    let batch = json!({"requests": [body.clone(), body]});
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&batch),
        Some("cn:auditd-reader"),
    )
    .await;
    assert_eq!(
        out["decisions"][1]["reasons"][0]["policy"],
        "security.elevation-after-remote-login"
    );
}

/// The same bytes from a reporter and from anyone else: the memo of parsed bodies
/// hands both the same request, and each is still judged as its caller may ask
/// (its remembered fingerprint is kept per reporter, so the decision cache never
/// serves one caller's answer to the other).
#[tokio::test]
async fn a_remembered_body_is_judged_by_who_sends_it() {
    let s = with_auditd_reporter();
    let body = json!({"principal": "Node::\"gpu-a1\"", "action": "read",
        "resource": "Checkpoint::\"ckpt-1\"", "context": {"verified": false, "failure": "digest mismatch"}});
    let owned = |d: &serde_json::Value| {
        d["errors"].as_array().unwrap().iter().any(|e| {
            e["message"]
                .as_str()
                .unwrap()
                .contains("is a fact the engine owns")
        })
    };
    for round in 0..4 {
        for (caller, refused) in [("cn:someone", true), ("cn:auditd-reader", false)] {
            let (status, d) = call(&s, Method::POST, "/v1/decide", Some(&body), Some(caller)).await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(d["decision"], "deny", "round {round}, {caller}: {d}");
            assert_eq!(owned(&d), refused, "round {round}, {caller}: {d}");
        }
    }
    // Eight asks of one body: the first two parse it (the second keeps it).
    assert_eq!(metric(&s, "probity_parsed_requests_hits_total").await, 6.0);
}

/// `[limits] parsed_request_bytes = 0` turns the memo off: every body is parsed, and
/// answered the same.
#[tokio::test]
async fn a_zero_parsed_request_budget_parses_every_body() {
    let mut config = Config::default();
    config.limits.parsed_request_bytes = 0;
    let s = state_with(config);
    for _ in 0..3 {
        let (status, d) = call(&s, Method::POST, "/v1/decide", Some(&decide_body()), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(d["reasons"][0]["policy"], "security.blocked-node", "{d}");
    }
    assert_eq!(metric(&s, "probity_parsed_requests_hits_total").await, 0.0);
    assert_eq!(
        metric(&s, "probity_parsed_requests_misses_total").await,
        3.0
    );
    assert_eq!(metric(&s, "probity_parsed_requests_bytes").await, 0.0);
}

/// Issue: an entity writer could upsert `ApiCaller::"<itself>"` into the admins group.
#[tokio::test]
async fn bug_an_entity_writer_could_make_itself_an_administrator() {
    let mut config = Config::default();
    config
        .auth
        .groups
        .insert("entity-writers".into(), vec!["cn:inventory".into()]);
    let s = state_with(config);
    let me = json!([{"uid": {"type": "ApiCaller", "id": "cn:inventory"}, "attrs": {},
        "parents": [{"type": "ApiGroup", "id": "admins"}]}]);
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&me),
        Some("cn:inventory"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("supplied by the engine (api)"),
        "{body}"
    );
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/nodes/gpu-a1/unblock",
        None,
        Some("cn:inventory"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

/// A state directory and data root for verification tests, with the software anchor's
/// key pinned; the state is attached to a fresh engine.
fn verifying_state(tmp: &std::path::Path) -> probity_server::AppState {
    use probity::integrity::{Anchor, SoftwareAnchor};
    use probity::state::StateStore;
    let state_dir = tmp.join("state");
    let store = std::sync::Arc::new(StateStore::open(&state_dir).unwrap());
    let anchor = SoftwareAnchor::load_or_generate(&tmp.join("anchor.key")).unwrap();
    std::fs::write(state_dir.join("trusted.pub"), anchor.public_key().to_hex()).unwrap();
    std::fs::create_dir_all(tmp.join("data")).unwrap();
    let mut config = Config::default();
    config.integrity.state_dir = Some(state_dir);
    config.integrity.data_roots = vec![tmp.join("data")];
    config.auth.nodes.insert("uid:1000".into(), "gpu-a1".into());
    let engine = crate::engine();
    engine.attach_state(store).unwrap();
    probity_server::AppState::new(engine, config)
}

/// Issue: a sidecar learned "/etc/shadow ... 813 bytes" and whether root-only paths
/// exist, through /v1/verify's errors.
#[tokio::test]
async fn bug_verify_answered_questions_about_files_outside_its_data_roots() {
    let tmp = tempfile::tempdir().unwrap();
    let s = verifying_state(tmp.path());
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, b"root only").unwrap();
    let mut answers = Vec::new();
    for path in [
        secret.to_str().unwrap().to_owned(),
        "/etc/shadow".to_owned(),
        "/nonexistent/file".to_owned(),
        tmp.path().join("data/absent").to_str().unwrap().to_owned(),
        // A symlink inside the root that leads out of it.
        {
            let link = tmp.path().join("data/escape");
            std::os::unix::fs::symlink(&secret, &link).unwrap();
            link.to_str().unwrap().to_owned()
        },
        tmp.path()
            .join("data/../secret")
            .to_str()
            .unwrap()
            .to_owned(),
    ] {
        let body = json!({"path": path, "id": "x", "node": "gpu-a1"});
        let (status, out) = call(
            &s,
            Method::POST,
            "/v1/verify",
            Some(&body),
            Some("uid:1000"),
        )
        .await;
        answers.push((status, out));
    }
    for (status, out) in &answers {
        assert_eq!(*status, StatusCode::FORBIDDEN, "{out}");
        assert_eq!(out["error"], "not permitted", "{out}");
    }
}

/// Issue: naming a FIFO 530 times filled the blocking pool, after which every deny
/// answered 503 until someone wrote to the FIFO.
#[tokio::test]
async fn bug_fifos_named_to_verify_stalled_every_deny() {
    let tmp = tempfile::tempdir().unwrap();
    let s = verifying_state(tmp.path());
    let fifo = tmp.path().join("data/pipe");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let mut refused = 0;
    for _ in 0..40 {
        let body = json!({"path": fifo, "id": "x", "node": "gpu-a1", "manifest": fifo});
        let (status, out) = call(
            &s,
            Method::POST,
            "/v1/verify",
            Some(&body),
            Some("uid:1000"),
        )
        .await;
        assert!(
            status == StatusCode::FORBIDDEN || status == StatusCode::TOO_MANY_REQUESTS,
            "{status} {out}"
        );
        refused += 1;
    }
    assert_eq!(refused, 40);
    // Denies are still answered, at once.
    let deny = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-blocked\""});
    let (status, d) = call(&s, Method::POST, "/v1/decide", Some(&deny), None).await;
    assert_eq!(status, StatusCode::OK, "{d}");
    assert_eq!(d["decision"], "deny");
}

/// A server recording its decisions in a fresh store, each caller allowed `burst`
/// recorded decisions at once and one more per second.
fn recording_with_budget(
    burst: u32,
) -> (
    probity_server::AppState,
    std::sync::Arc<probity::state::StateStore>,
    tempfile::TempDir,
) {
    let tmp = tempfile::tempdir().unwrap();
    let store =
        std::sync::Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    let mut config = Config::default();
    config.limits.recorded_per_second = 1;
    config.limits.recorded_burst = burst;
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    (probity_server::AppState::new(engine, config), store, tmp)
}

/// Issue: anonymous callers' denies were recorded forever, 27,313 in 10 s: past its
/// budget a caller gets 429 and nothing is recorded, while another caller is served.
#[tokio::test]
async fn bug_a_deny_flood_was_recorded_without_bound() {
    let (s, store, _tmp) = recording_with_budget(5);
    let deny = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-blocked\""});
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let (status, _) = call(&s, Method::POST, "/v1/decide", Some(&deny), None).await;
        statuses.push(status);
    }
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert!((5..=6).contains(&ok), "{statuses:?}");
    assert_eq!(ok + limited, 20);
    assert_eq!(store.decisions(0, 100).unwrap().len(), ok);
    // Another caller has a budget of its own.
    let (status, d) = call(
        &s,
        Method::POST,
        "/v1/decide",
        Some(&deny),
        Some("uid:1000"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(d["decision"], "deny");
    // Allows cost no budget.
    let allow = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""});
    let (status, _) = call(&s, Method::POST, "/v1/decide", Some(&allow), None).await;
    assert_eq!(status, StatusCode::OK);
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains(&format!("probity_recorded_budget_refused_total {limited}"))
    );
}

/// A batch asks the budget once for all the records it needs: a batch that needs more
/// than the caller has left is refused whole (429, nothing recorded, no tokens taken),
/// one that fits is recorded whole, and a batch of plain allows costs nothing.
#[tokio::test]
async fn a_batch_over_the_budget_of_recorded_decisions_is_refused_whole() {
    let (s, store, _tmp) = recording_with_budget(5);
    let deny = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-blocked\""});
    let allow = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""});
    let batch = |n: usize, r: &serde_json::Value| json!({"requests": vec![r.clone(); n]});

    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&batch(8, &deny)),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(store.decisions(0, 100).unwrap().len(), 0);

    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&batch(4, &deny)),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["decisions"].as_array().unwrap().len(), 4);
    assert_eq!(store.decisions(0, 100).unwrap().len(), 4);

    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/decide/batch",
        Some(&batch(50, &allow)),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        body["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["decision"] == "allow")
    );
    assert_eq!(store.decisions(0, 100).unwrap().len(), 4);
}

/// An engine on the default policies with the `looping` plugin (it never returns) on
/// `comply`, its manifest allowing it `timeout_ms`.
fn looping_engine(timeout_ms: u64) -> (tempfile::TempDir, probity::Engine) {
    let wasm = crate::root().join("target/plugins/looping.wasm");
    assert!(
        wasm.is_file(),
        "{} is missing: run scripts/build-plugins.sh",
        wasm.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let manifest = tmp.path().join("plugins.toml");
    std::fs::write(
        &manifest,
        format!(
            "[[plugin]]\nname = \"looping\"\npath = {:?}\nactions = [\"comply\"]\ntimeout_ms = {timeout_ms}\n",
            wasm.display().to_string()
        ),
    )
    .unwrap();
    let engine = probity::Engine::builder(crate::root().join("policies"))
        .plugins(&manifest)
        .build()
        .unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    (tmp, engine)
}

/// A decision whose request timed out stops running its plugins: the plugin is given
/// no more than the request timeout (here 150 ms of its manifest's 5 s), as the
/// decision's record says, instead of running on after the caller was answered.
#[test]
fn a_plugin_runs_no_longer_than_the_request_that_asked_for_it() {
    let (tmp, engine) = looping_engine(5000);
    let store =
        std::sync::Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    engine.attach_state(store.clone()).unwrap();
    let mut config = Config::default();
    config.server.request_timeout_ms = 150;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let comply = json!({"principal": "Node::\"gpu-a1\"", "action": "comply", "resource": "Node::\"gpu-a1\""});
    let (status, _) = runtime.block_on(async {
        let s = probity_server::AppState::new(engine, config);
        call(&s, Method::POST, "/v1/decide", Some(&comply), None).await
    });
    assert_ne!(status, StatusCode::OK);
    // Dropping the runtime waits for its blocking pool, where the decision still runs
    // and settles its record: the event this test waits for.
    drop(runtime);
    let records = store.decisions(0, 10).unwrap();
    let record = records
        .first()
        .expect("the timed-out decision was recorded");
    let message = &record
        .decision
        .errors
        .iter()
        .find(|e| e.policy.as_deref() == Some("plugin:looping"))
        .unwrap_or_else(|| panic!("{record:?}"))
        .message;
    let given: u64 = message
        .strip_prefix("plugin looping: timeout after ")
        .and_then(|rest| rest.strip_suffix(" ms"))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("not a timeout: {message}"));
    assert!(given <= 150, "{message}");
}

/// Issue: decisions that ran plugins (deadlines up to 10 s) ran on tokio's async
/// workers: four slow `comply` decisions held both workers, and `/healthz` and an
/// unrelated `admit` waited for them. Now a slow plugin stalls neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bug_a_slow_plugin_stalled_healthz_and_other_decisions() {
    let (_tmp, engine) = looping_engine(2000);
    let s = probity_server::AppState::new(engine, Config::default());
    let comply = json!({"principal": "Node::\"gpu-a1\"", "action": "comply", "resource": "Node::\"gpu-a1\""});
    let slow: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            let body = comply.clone();
            tokio::spawn(
                async move { call(&s, Method::POST, "/v1/decide", Some(&body), None).await },
            )
        })
        .collect();
    tokio::task::yield_now().await;
    let (status, _) = call(&s, Method::GET, "/healthz", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let admit = json!({"principal": "Workload::\"infer-ok\"", "action": "admit", "resource": "Namespace::\"inference\""});
    let (status, d) = call(&s, Method::POST, "/v1/decide", Some(&admit), None).await;
    assert_eq!(
        (status, d["decision"].as_str()),
        (StatusCode::OK, Some("allow"))
    );
    // Both answered while every plugin decision was still running.
    assert!(
        slow.iter().all(|h| !h.is_finished()),
        "a slow decision finished first: the others waited for the plugins"
    );
    for h in slow {
        let (status, d) = h.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(d["decision"], "deny");
        assert!(
            d["errors"][0]["message"]
                .as_str()
                .unwrap()
                .contains("timeout"),
            "{d}"
        );
    }
}

/// Issue: `block`/`unblock` wrote the state store before taking the writer lock, so
/// racing calls could leave memory disagreeing with the store. After 50 concurrent
/// blocks and unblocks of a few nodes, memory, disk and the API agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_blocks_and_unblocks_leave_memory_disk_and_api_in_agreement() {
    let tmp = tempfile::tempdir().unwrap();
    let store =
        std::sync::Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let calls: Vec<_> = (0..50)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                let node = format!("gpu-race-{}", i % 5);
                let verb = if i % 3 == 0 { "unblock" } else { "block" };
                let uri = format!("/v1/nodes/{node}/{verb}");
                call(
                    &s,
                    Method::POST,
                    &uri,
                    Some(&json!({"reason": format!("r{i}")})),
                    Some("uid:0"),
                )
                .await
            })
        })
        .collect();
    for c in calls {
        let (status, out) = c.await.unwrap();
        assert!(
            status == StatusCode::OK || status == StatusCode::BAD_REQUEST,
            "{out}"
        );
    }
    let memory: std::collections::BTreeMap<String, String> = s
        .engine()
        .blocked_nodes()
        .into_iter()
        .map(|(n, r)| (n, r.reason))
        .collect();
    let disk: std::collections::BTreeMap<String, String> = store
        .blocked_nodes()
        .unwrap()
        .into_iter()
        .map(|b| (b.node, b.record.reason))
        .collect();
    assert_eq!(memory, disk);
    let (_, api) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    let listed: Vec<&String> = api["nodes"].as_object().unwrap().keys().collect();
    assert_eq!(listed, memory.keys().collect::<Vec<_>>());
}

#[tokio::test]
async fn a_permission_answered_from_the_cache_ends_when_the_caller_leaves_its_group() {
    let s = state();
    let metric = |text: &str, name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap()
    };
    for id in ["z1", "z2", "z3"] {
        let (status, _) = call(
            &s,
            Method::POST,
            "/v1/entities",
            Some(&zone(id)),
            Some("uid:0"),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    // The same permission, asked three times while zones changed: decided once, in a
    // cache of its own (the scheduler's is untouched).
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    let text = metrics.as_str().unwrap();
    assert_eq!(
        metric(text, "probity_authorization_cache_hits_total"),
        2,
        "{text}"
    );
    assert_eq!(
        metric(text, "probity_authorization_cache_misses_total"),
        1,
        "{text}"
    );
    assert_eq!(
        metric(text, "probity_decision_cache_misses_total"),
        0,
        "{text}"
    );
    // uid:0 leaves the admins: the cached allow must not outlive it.
    let without = json!([
        {"uid": {"type": "ApiCaller", "id": "uid:0"}, "attrs": {}, "parents": []},
        {"uid": {"type": "ApiGroup", "id": "admins"}, "attrs": {}, "parents": []},
        {"uid": {"type": "Api", "id": "entities"}, "attrs": {}, "parents": []},
    ]);
    s.engine()
        .replace_owned_entities(probity::EntityOwner::Api, &without)
        .unwrap();
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&zone("z4")),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let (status, _) = call(&s, Method::GET, "/v1/entities/Zone/z4", None, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// Issue 28 item 5: every anonymous caller shared one budget of recorded decisions, so
/// one client flooding denies over TCP made another's denies come back 429. Anonymous
/// callers are now counted by their network.
#[tokio::test]
async fn bug_one_anonymous_client_spent_every_anonymous_clients_budget() {
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;
    let tmp = tempfile::tempdir().unwrap();
    let store =
        std::sync::Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    let mut config = Config::default();
    config.limits.recorded_per_second = 1;
    config.limits.recorded_burst = 3;
    let engine = crate::engine();
    engine.attach_state(store).unwrap();
    let s = probity_server::AppState::new(engine, config);
    let deny = json!({"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-blocked\""});
    let send = |from: &'static str| {
        let s = s.clone();
        let body = serde_json::to_vec(&deny).unwrap();
        async move {
            let mut req = axum::http::Request::post("/v1/decide")
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body))
                .unwrap();
            req.extensions_mut()
                .insert(probity_server::Caller::anonymous_at(from.parse().unwrap()));
            let response = probity_server::app(s).oneshot(req).await.unwrap();
            let status = response.status();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&bytes).into_owned())
        }
    };
    let mut flood = Vec::new();
    for _ in 0..10 {
        flood.push(send("2001:db8:0:1::66").await.0);
    }
    assert!(
        flood.contains(&StatusCode::TOO_MANY_REQUESTS),
        "the flooder is limited: {flood:?}"
    );
    // Another address of the flooder's /64 is the same client.
    let (status, _) = send("2001:db8:0:1::67").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // Another network's anonymous client still gets its deny.
    for other in ["192.0.2.10", "2001:db8:0:2::1"] {
        let (status, body) = send(other).await;
        assert_eq!(status, StatusCode::OK, "{other}: {body}");
        assert!(body.contains("\"deny\""), "{body}");
    }
}

#[tokio::test]
async fn events_posted_by_a_permitted_caller_are_appended_to_the_event_log() {
    use probity::state::StateStore;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let body = json!({"events": [
        {"object": "node/gpu-1", "node": "gpu-1", "kind": "controller-block-done",
         "detail": "tainted: bad read"}]});

    // Anonymous callers may record nothing.
    let (status, _) = call(&s, Method::POST, "/v1/events", Some(&body), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(store.events(0).unwrap().is_empty());

    let (status, out) = call(&s, Method::POST, "/v1/events", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["recorded"], 1);
    let events = store.events(0).unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, "controller-block-done");
    assert_eq!(events[0].node.as_deref(), Some("gpu-1"));
    assert_eq!(events[0].detail, "tainted: bad read (recorded by uid:0)");

    // Malformed or oversized bodies are refused naming what, and append nothing.
    let unknown = json!({"events": [{"object": "o", "kind": "k", "detail": "d", "x": 1}]});
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/events",
        Some(&unknown),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        out["error"].as_str().unwrap().contains("unknown field"),
        "{out}"
    );
    let huge = json!({"events": [{"object": "o", "kind": "k", "detail": "d".repeat(5000)}]});
    let (status, out) = call(&s, Method::POST, "/v1/events", Some(&huge), Some("uid:0")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        out["error"].as_str().unwrap().contains("events[0].detail"),
        "{out}"
    );
    let many: Vec<_> = (0..257)
        .map(|_| json!({"object": "o", "kind": "k", "detail": "d"}))
        .collect();
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/events",
        Some(&json!({ "events": many })),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(store.events(0).unwrap().len(), 1);
}

/// The issue: a failed verified read names its pod, and the block record says so, with
/// what the cluster manager must stop; a malformed pod is a 400 naming the field.
#[tokio::test]
async fn verify_by_a_named_pod_puts_the_reader_and_stop_in_the_block_record() {
    use probity::integrity::{self, Anchor, HashOptions, SoftwareAnchor};
    use probity::state::StateStore;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("state");
    let store = Arc::new(StateStore::open(&state_dir).unwrap());
    let anchor = SoftwareAnchor::load_or_generate(&tmp.path().join("anchor.key")).unwrap();
    std::fs::write(state_dir.join("trusted.pub"), anchor.public_key().to_hex()).unwrap();
    let file = tmp.path().join("epoch-3.ckpt");
    let data: Vec<u8> = (0..20_000u32).map(|i| (i % 249) as u8).collect();
    std::fs::write(&file, &data).unwrap();
    let options = HashOptions {
        chunk_size: 4096,
        ..HashOptions::default()
    };
    let signed =
        integrity::SignedManifest::seal(&file, "llm/epoch-3", 1, &anchor, store.as_ref(), &options)
            .unwrap();
    std::fs::write(tmp.path().join("epoch-3.ckpt.manifest"), signed.encode()).unwrap();
    let mut config = Config::default();
    config.integrity.state_dir = Some(state_dir.clone());
    config.integrity.data_roots = vec![tmp.path().to_owned()];
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, config);
    let uid = "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b";

    // Bad pods are refused before anything is read, naming the field.
    for (reader, field) in [
        (
            json!({"namespace": "Train", "name": "llm-0"}),
            "reader.namespace",
        ),
        (
            json!({"namespace": "train", "name": "llm 0"}),
            "reader.name",
        ),
        (
            json!({"namespace": "train", "name": "llm-0", "uid": "x"}),
            "reader.uid",
        ),
    ] {
        let body = json!({"path": file, "id": "llm/epoch-3", "node": "gpu-a1", "reader": reader});
        let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
        assert!(
            out["error"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{field}: ")),
            "{out}"
        );
    }
    let body = json!({"path": file, "id": "llm/epoch-3", "node": "gpu-a1", "reader": {"namespace": "train"}});
    let (status, _) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(store.blocked("gpu-a1").unwrap().is_none());

    let mut bad = data.clone();
    bad[5000] ^= 0x02;
    std::fs::write(&file, &bad).unwrap();
    let body = json!({"path": file, "id": "llm/epoch-3", "node": "gpu-a1",
                      "reader": {"namespace": "train", "name": "llm-0", "uid": uid}});
    let (status, out) = call(&s, Method::POST, "/v1/verify", Some(&body), Some("uid:0")).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["decision"]["decision"], "deny");
    let (_, blocked) = call(&s, Method::GET, "/v1/nodes/blocked", None, None).await;
    let record = &blocked["nodes"]["gpu-a1"];
    assert_eq!(
        record["reader"],
        json!({"namespace": "train", "name": "llm-0", "uid": uid}),
        "{blocked}"
    );
    assert_eq!(record["stop"], "reader", "{blocked}");
    assert!(record.get("taintEffect").is_none(), "{blocked}");
    assert_eq!(
        store
            .blocked("gpu-a1")
            .unwrap()
            .unwrap()
            .record
            .reader
            .unwrap()
            .name,
        "llm-0"
    );
}
