//! The engine's decision cache through the server: over random interleavings of fact
//! updates and removals, blocks and unblocks through the API, reloads that edit
//! settings and modes, and clock moves, every route that decides answers exactly what
//! it answers with the cache off.

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use probity::{Engine, ManualClock};
use probity_server::{AppState, Config};
use serde_json::{Value, json};

use crate::admission::{gpu_pod, review};
use crate::rng::Rng;
use crate::{call, cluster, root};

/// One question to the server: a route, a body, a caller.
struct Probe {
    uri: &'static str,
    body: Value,
    caller: Option<&'static str>,
}

fn probes() -> Vec<Probe> {
    let decide = |body: Value| Probe {
        uri: "/v1/decide",
        body,
        caller: Some("uid:1000"),
    };
    let mut out = Vec::new();
    for workload in ["train-1", "rlhf-1", "infer-ok", "infer-greedy", "cpu-job"] {
        for node in ["gpu-a1", "gpu-hot1", "gpu-blocked", "gpu-drift", "cpu-1"] {
            out.push(decide(json!({
                "principal": format!("Workload::\"{workload}\""),
                "action": "schedule", "resource": format!("Node::\"{node}\"")})));
        }
    }
    // A request-scoped workload of its own.
    out.push(decide(json!({
        "principal": "Workload::\"scoped\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\"",
        "entities": [{"uid": {"type": "Workload", "id": "scoped"},
            "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "training"}},
                "class": "training", "gpus": 2, "cpuMillis": 16000, "gpuMemoryMiB": 20000,
                "image": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"},
            "parents": [{"type": "Namespace", "id": "training"}]}]})));
    out.push(Probe {
        uri: "/v1/decide/batch",
        body: json!({"requests": [
            {"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-h1\""},
            {"principal": "Node::\"gpu-a1\"", "action": "listen", "resource": "Node::\"gpu-a1\"",
             "context": {"port": 8080, "protocol": "tcp"}},
            {"principal": "Node::\"gpu-a1\"", "action": "listen", "resource": "Node::\"gpu-a1\"",
             "context": {"port": 22, "protocol": "tcp"}}]}),
        caller: Some("uid:1000"),
    });
    for (name, gpus) in [("p1", 1), ("p8", 8)] {
        let pod = gpu_pod(name, gpus, "8");
        out.push(Probe {
            uri: "/v1/admission/validate",
            body: review("Pod", "training", pod.clone()),
            caller: None,
        });
        out.push(Probe {
            uri: "/v1/admission/mutate",
            body: review("Pod", "training", pod.clone()),
            caller: None,
        });
        out.push(Probe {
            uri: "/v1/scheduler/filter",
            body: json!({"Pod": pod, "Nodes": null,
                "NodeNames": ["gpu-a1", "gpu-h1", "gpu-hot1", "gpu-blocked", "gpu-drift", "gpu-warm"]}),
            caller: None,
        });
    }
    out
}

#[tokio::test]
async fn every_deciding_route_answers_the_same_with_the_cache_and_without() {
    let dir = tempfile::tempdir().unwrap();
    crate::placement::copy_dir(&root().join("policies"), dir.path());
    let config_text = std::fs::read_to_string(dir.path().join("probity.toml")).unwrap();
    let clock = Arc::new(ManualClock::at(1_780_000_000));
    let engine = Engine::builder(dir.path())
        .clock(clock.clone())
        .build()
        .unwrap();
    engine.upsert_entities(&cluster()).unwrap();
    let state = AppState::new(engine.clone(), Config::default());
    let cache = engine.decision_cache();
    let budget = cache.budget();
    let nodes: Vec<Value> = cluster()
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["uid"]["type"] == "Node")
        .cloned()
        .collect();
    let probes = probes();
    let mut rng = Rng::new(0x5eed);
    for step in 0..120 {
        let node = nodes[rng.below(nodes.len())].clone();
        let id = node["uid"]["id"].as_str().unwrap().to_string();
        let admin = |method: Method, uri: String, body: Option<Value>| {
            let state = state.clone();
            async move { call(&state, method, &uri, body.as_ref(), Some("uid:0")).await }
        };
        let what = match rng.below(7) {
            0 | 1 => {
                let mut node = node;
                node["attrs"]["hottestGpuTempC"] = json!(40 + rng.below(60));
                node["attrs"]["powerDrawW"] = json!(200 + rng.below(9000));
                let (s, b) = admin(Method::POST, "/v1/entities".into(), Some(json!([node]))).await;
                assert_eq!(s, StatusCode::OK, "{b}");
                format!("update {id}")
            }
            2 => {
                let uids = json!({"uids": [format!("Node::\"{id}\"")]});
                let (s, b) = admin(Method::DELETE, "/v1/entities".into(), Some(uids)).await;
                assert_eq!(s, StatusCode::OK, "{b}");
                let (s, b) = admin(Method::POST, "/v1/entities".into(), Some(json!([node]))).await;
                assert_eq!(s, StatusCode::OK, "{b}");
                format!("remove and restore {id}")
            }
            3 => {
                let reason = json!({"reason": "differential"});
                let (s, b) =
                    admin(Method::POST, format!("/v1/nodes/{id}/block"), Some(reason)).await;
                assert!(s.is_success(), "{s} {b}");
                format!("block {id}")
            }
            4 => {
                let (s, b) = admin(Method::POST, format!("/v1/nodes/{id}/unblock"), None).await;
                assert!(s.is_success() || s == StatusCode::NOT_FOUND, "{s} {b}");
                format!("unblock {id}")
            }
            5 => {
                let pct = 20 + rng.below(80);
                let mut text = config_text.replace(
                    "zone_power_ceiling_pct = 95",
                    &format!("zone_power_ceiling_pct = {pct}"),
                );
                if rng.below(2) == 0 {
                    text.push_str("\n[modes]\n\"placement.driver-drift\" = \"warn\"\n");
                }
                std::fs::write(dir.path().join("probity.toml"), text).unwrap();
                engine.reload().unwrap();
                format!("reload with zone_power_ceiling_pct = {pct}")
            }
            _ => {
                clock.advance(rng.below(86_400 * 30) as i64);
                "clock".to_string()
            }
        };
        for _ in 0..4 {
            let probe = &probes[rng.below(probes.len())];
            let ask = || {
                call(
                    &state,
                    Method::POST,
                    probe.uri,
                    Some(&probe.body),
                    probe.caller,
                )
            };
            let first = ask().await;
            let again = ask().await;
            cache.set_budget(0);
            let fresh = ask().await;
            cache.set_budget(budget);
            assert_eq!(fresh.0, StatusCode::OK, "{}: {}", probe.uri, fresh.1);
            assert_eq!(
                first, fresh,
                "step {step} ({what}), {} {}",
                probe.uri, probe.body
            );
            assert_eq!(
                again, fresh,
                "step {step} ({what}), {} {}",
                probe.uri, probe.body
            );
        }
    }
    let stats = cache.stats();
    assert!(stats.hits > 200, "{stats:?}");
    // And the metrics say so.
    let (_, metrics) = call(&state, Method::GET, "/metrics", None, None).await;
    let text = metrics.as_str().unwrap();
    for family in [
        "probity_decision_cache_hits_total",
        "probity_decision_cache_misses_total",
        "probity_decision_cache_evictions_total",
        "probity_decision_cache_bytes",
        "probity_decision_cache_budget_bytes 33554432",
    ] {
        assert!(text.contains(family), "{family} missing");
    }
}
