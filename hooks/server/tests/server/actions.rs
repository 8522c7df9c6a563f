//! `/v1/actions/migrate`: a reporter's node decided by the server from its own facts,
//! its `migrate` requests published while its zone is at its ceiling and withdrawn once
//! it cools; the controller reads the live ones.

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use probity::state::StateStore;
use probity_server::Config;
use serde_json::{Value, json};

use crate::call;

fn zone_hot(watts: u64) -> Value {
    json!([{"uid": {"type": "Zone", "id": "zone-hot"}, "parents": [],
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": watts, "powerCeilingW": 40000}}])
}

#[tokio::test]
async fn a_reported_node_in_a_zone_at_its_ceiling_asks_to_migrate_until_the_zone_cools() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store).unwrap();
    let mut config = Config::default();
    config
        .auth
        .nodes
        .insert("cn:sidecar-gpu-hot1".into(), "gpu-hot1".into());
    let s = probity_server::AppState::new(engine, config);
    let report = json!({"node": "gpu-hot1"});

    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/actions/migrate",
        Some(&report),
        Some("cn:sidecar-gpu-hot1"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["published"][0]["target"], "zone-hot", "{body}");
    let (status, body) = call(&s, Method::GET, "/v1/actions/migrate", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let requests = body["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 1, "{body}");
    let request = &requests[0];
    assert_eq!(
        (&request["kind"], &request["target"], &request["node"]),
        (&json!("migrate"), &json!("zone-hot"), &json!("gpu-hot1"))
    );
    assert_eq!(request["policy"], "thermal.zone-power-ceiling");
    assert_eq!(request["ttlSeconds"], 60);
    assert_eq!(request["parameters"]["pods_per_window"], "2");

    // A reporter speaks for its own node only; anonymous callers not at all.
    for (node, caller) in [("gpu-a1", Some("cn:sidecar-gpu-hot1")), ("gpu-hot1", None)] {
        let (status, body) = call(
            &s,
            Method::POST,
            "/v1/actions/migrate",
            Some(&json!({"node": node})),
            caller,
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{node} {caller:?}: {body}");
    }

    // The zone cools: the next report withdraws the request.
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&zone_hot(10_000)),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/actions/migrate",
        Some(&report),
        Some("cn:sidecar-gpu-hot1"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["withdrawn"],
        json!(["migrate/gpu-hot1/thermal.zone-power-ceiling/zone-hot"])
    );
    let (_, body) = call(&s, Method::GET, "/v1/actions/migrate", None, None).await;
    assert_eq!(body["requests"], json!([]));
}

#[tokio::test]
async fn a_report_with_a_ttl_past_the_bound_is_refused() {
    let s = crate::state();
    let (status, body) = call(
        &s,
        Method::POST,
        "/v1/actions/migrate",
        Some(&json!({"node": "gpu-hot1", "ttl_seconds": 86_400})),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"], "ttl_seconds: 86400 is not within 1..=600");
}
