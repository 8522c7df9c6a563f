//! One request decided for many resources, and the decisions reused while their facts
//! hold.

use probity::{DecideOptions, DecisionCache, Effect, Engine, EntityUid, Request};
use serde_json::{Value, json};

use crate::{cluster, load_cluster};

fn loaded() -> Engine {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    engine
}

/// A node like `gpu-a1` (A100, 58 C, zone-a) named `id`, with `changes` applied.
fn node(id: &str, changes: Value) -> Value {
    let mut n = cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .unwrap()
        .clone();
    n["uid"]["id"] = json!(id);
    for (k, v) in changes.as_object().unwrap() {
        n["attrs"][k] = v.clone();
    }
    n
}

fn schedule(workload: &str) -> Request {
    Request::from_json_value(&json!({"principal": format!("Workload::\"{workload}\""),
        "action": "schedule", "resource": "Node::\"unused\""}))
    .unwrap()
}

fn uids(ids: &[String]) -> Vec<EntityUid> {
    ids.iter()
        .map(|id| EntityUid::new("Node", id).unwrap())
        .collect()
}

#[test]
fn each_answer_is_the_single_decision_in_order_on_one_thread_or_many() {
    let engine = loaded();
    // 200 nodes: every third one too hot, plus the fixture's own.
    let nodes: Vec<Value> = (0..200)
        .map(|i| {
            node(
                &format!("n{i:03}"),
                json!({"hottestGpuTempC": if i % 3 == 0 { 80 } else { 50 }}),
            )
        })
        .collect();
    engine.upsert_entities(&Value::Array(nodes)).unwrap();
    let mut ids: Vec<String> = (0..200).map(|i| format!("n{i:03}")).collect();
    ids.extend(["gpu-blocked", "gpu-hot1", "gpu-h1", "never-heard-of"].map(String::from));
    for few in [&ids[..5], &ids[..]] {
        let request = schedule("train-1");
        let each = engine.decide_each(&request, &uids(few), None);
        assert_eq!(each.len(), few.len());
        for (id, got) in few.iter().zip(&each) {
            let one = request
                .clone()
                .with_resource(EntityUid::new("Node", id).unwrap());
            let dry = engine
                .decide_with(&[one], DecideOptions::new().dry_run())
                .settle();
            assert_eq!(**got, dry[0], "{id}");
        }
    }
    let each = engine.decide_each(&schedule("train-1"), &uids(&ids), None);
    assert_eq!(each[0].decision, Effect::Deny);
    assert_eq!(each[1].decision, Effect::Allow);
    assert_eq!(each[1].score, 5);
    assert_eq!(each[200].reasons[0].policy, "security.blocked-node");
    assert_eq!(each[201].reasons[0].policy, "thermal.zone-power-ceiling");
    assert_eq!(each[203].decision, Effect::Deny);
}

#[test]
fn a_cached_decision_is_reused_until_a_fact_it_read_changes() {
    let engine = loaded();
    let nodes: Vec<Value> = (0..100)
        .map(|i| node(&format!("n{i:03}"), json!({})))
        .collect();
    engine.upsert_entities(&Value::Array(nodes)).unwrap();
    let ids: Vec<String> = (0..100).map(|i| format!("n{i:03}")).collect();
    let resources = uids(&ids);
    let cache = DecisionCache::default();
    let request = schedule("train-1");
    let first = engine.decide_each(&request, &resources, Some(&cache));
    assert_eq!((cache.hits(), cache.misses()), (0, 100));
    let again = engine.decide_each(&request, &resources, Some(&cache));
    assert_eq!(first, again);
    assert_eq!((cache.hits(), cache.misses()), (100, 100));

    // One node heats up: only its decision is made again, and it changes.
    engine
        .upsert_entities(&json!([node("n007", json!({"hottestGpuTempC": 90}))]))
        .unwrap();
    let third = engine.decide_each(&request, &resources, Some(&cache));
    assert_eq!((cache.hits(), cache.misses()), (199, 101));
    assert_eq!(third[7].reasons[0].policy, "thermal.gpu-over-temperature");
    assert_eq!(third[8], first[8]);

    // The zone every node is in (a fact each decision read) heats up: all again.
    engine
        .upsert_entities(
            &json!([{"uid": {"type": "Zone", "id": "zone-a"}, "parents": [],
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": 39_000, "powerCeilingW": 40_000}}]),
        )
        .unwrap();
    let fourth = engine.decide_each(&request, &resources, Some(&cache));
    assert_eq!(cache.misses(), 201);
    assert!(
        fourth
            .iter()
            .all(|d| d.reason_ids().any(|r| r == "thermal.zone-power-ceiling"))
    );

    // A block empties the cache: the blocklist is part of every decision's world.
    engine.block_node("n003", "test").unwrap();
    let fifth = engine.decide_each(&request, &resources, Some(&cache));
    assert_eq!(cache.misses(), 301);
    assert_eq!(fifth[3].reasons[0].policy, "security.blocked-node");

    // Another workload is another question.
    engine.decide_each(&schedule("rlhf-1"), &resources, Some(&cache));
    assert_eq!(cache.misses(), 401);
}

#[test]
fn the_request_entities_are_part_of_the_question() {
    let engine = loaded();
    let cache = DecisionCache::default();
    let pod = |gpus: i64| {
        schedule("pod-x").with_entities(vec![json!({"uid": {"type": "Workload", "id": "pod-x"},
            "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "training"}},
                      "class": "training", "gpus": gpus, "cpuMillis": 8000,
                      "gpuMemoryMiB": if gpus > 1 { 80_000 } else { 1000 }, "image": "x"},
            "parents": [{"type": "Namespace", "id": "training"}]})])
    };
    let nodes = uids(&["gpu-a1".to_owned()]);
    let small = engine.decide_each(&pod(1), &nodes, Some(&cache));
    let big = engine.decide_each(&pod(2), &nodes, Some(&cache));
    assert_eq!(small[0].decision, Effect::Allow);
    assert_eq!(big[0].reasons[0].policy, "placement.gpu-memory-headroom");
    assert_eq!(cache.hits(), 0);
}

#[test]
fn a_bad_request_is_one_deny_per_resource() {
    let engine = loaded();
    let bad = schedule("w").with_entities(vec![
        json!({"uid": {"type": "Settings", "id": "active"}, "attrs": {}, "parents": []}),
    ]);
    let out = engine.decide_each(&bad, &uids(&["a".into(), "b".into()]), None);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|d| {
        d.decision == Effect::Deny
            && d.errors[0]
                .message
                .contains("Settings entities come from the engine")
    }));
    assert!(engine.decide_each(&bad, &[], None).is_empty());
}

#[test]
fn cached_answers_keep_their_order_when_the_fan_out_is_split_over_threads() {
    let engine = loaded();
    // Enough nodes for every core to take a part; every third one too hot.
    let nodes: Vec<Value> = (0..400)
        .map(|i| {
            node(
                &format!("m{i:03}"),
                json!({"hottestGpuTempC": if i % 3 == 0 { 85 } else { 50 }}),
            )
        })
        .collect();
    engine.upsert_entities(&Value::Array(nodes)).unwrap();
    let ids: Vec<String> = (0..400).map(|i| format!("m{i:03}")).collect();
    let resources = uids(&ids);
    let request = schedule("train-1");
    let uncached = engine.decide_each(&request, &resources, None);
    let cache = DecisionCache::default();
    let cold = engine.decide_each(&request, &resources, Some(&cache));
    let warm = engine.decide_each(&request, &resources, Some(&cache));
    assert_eq!(uncached, cold);
    assert_eq!(uncached, warm);
    assert_eq!((cache.hits(), cache.misses()), (400, 400));
    for (i, d) in warm.iter().enumerate() {
        assert_eq!(d.is_allowed(), i % 3 != 0, "m{i:03}");
    }
}

#[test]
fn a_fan_out_brought_up_to_date_from_the_change_log_answers_as_one_decided_afresh() {
    let engine = loaded();
    let zones = ["zone-a", "zone-rlhf", "zone-hot"];
    let make = |i: usize, temp: i64| {
        let mut n = node(&format!("c{i:03}"), json!({"hottestGpuTempC": temp}));
        n["attrs"]["zone"] = json!({"__entity": {"type": "Zone", "id": zones[i % 3]}});
        n["parents"] = json!([{"type": "Zone", "id": zones[i % 3]}]);
        n
    };
    engine
        .upsert_entities(&Value::Array((0..150).map(|i| make(i, 50)).collect()))
        .unwrap();
    // 160 resources: the last ten are not stored yet.
    let ids: Vec<String> = (0..160).map(|i| format!("c{i:03}")).collect();
    let resources = uids(&ids);
    let reversed: Vec<EntityUid> = resources.iter().rev().cloned().collect();
    let cache = DecisionCache::default();
    let request = schedule("train-1");
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |bound: usize| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 33) as usize % bound
    };
    for round in 0..40 {
        // A few changes a round: temperatures, a node appearing or going, a zone's power.
        for _ in 0..1 + next(3) {
            match next(6) {
                0 => engine
                    .remove_entities(&uids(&[format!("c{:03}", next(160))]))
                    .unwrap(),
                1 => {
                    let z = zones[next(3)];
                    let draw = if next(2) == 0 { 39_500 } else { 20_000 };
                    engine
                        .upsert_entities(&json!([{"uid": {"type": "Zone", "id": z},
                            "parents": [{"type": "Cluster", "id": "onprem"}],
                            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                                      "powerDrawW": draw, "powerCeilingW": 40_000}}]))
                        .unwrap();
                }
                _ => {
                    let temp = if next(3) == 0 {
                        88
                    } else {
                        50 + next(20) as i64
                    };
                    engine
                        .upsert_entities(&json!([make(next(160), temp)]))
                        .unwrap();
                }
            }
        }
        // Two lists of the same nodes take turns: each is its own fan-out.
        let asked = if round % 3 == 2 {
            &reversed
        } else {
            &resources
        };
        let cached = engine.decide_each(&request, asked, Some(&cache));
        let afresh = engine.decide_each(&request, asked, None);
        assert_eq!(cached, afresh, "round {round}");
    }
    // Most answers were reused, not decided again.
    assert!(cache.hits() > cache.misses(), "{cache:?}");
}

#[test]
fn nodes_by_zone_are_shared_until_the_store_changes() {
    let engine = loaded();
    let first = engine.entities_by_reference("Node", "zone");
    let again = engine.entities_by_reference("Node", "zone");
    assert!(std::sync::Arc::ptr_eq(&first, &again));
    let at = |answer: &probity::EntitiesByReference, id: &str| {
        let i = answer.uids.iter().position(|u| u.id() == id).unwrap();
        answer.targets[i].clone()
    };
    assert_eq!(at(&first, "gpu-a1").as_deref(), Some("zone-a"));
    assert!(first.contains_id("gpu-a1") && !first.contains_id("gpu-zz"));
    // Another question is answered afresh, not from the last answer.
    let zones = engine.entities_by_reference("Zone", "cluster");
    assert_eq!(at(&zones, "zone-a").as_deref(), Some("onprem"));
    // A node moves: the next answer sees it.
    let mut moved = node("gpu-a1", json!({}));
    moved["attrs"]["zone"] = json!({"__entity": {"type": "Zone", "id": "zone-hot"}});
    moved["parents"] = json!([{"type": "Zone", "id": "zone-hot"}]);
    engine.upsert_entities(&json!([moved])).unwrap();
    let after = engine.entities_by_reference("Node", "zone");
    assert_eq!(at(&after, "gpu-a1").as_deref(), Some("zone-hot"));
    assert!(
        engine
            .entities_by_reference("NoSuchType", "zone")
            .uids
            .is_empty()
    );
}
