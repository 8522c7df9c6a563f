//! The decision cache is never wrong: over random interleavings of fact updates and
//! removals, blocks and unblocks, reloads that edit settings and modes, API callers
//! replaced and clock moves, every request decided through the cache gets the answer a
//! fresh decision gives. And the check has teeth: with one invalidation skipped on
//! purpose, it finds the difference.

use std::path::Path;
use std::sync::Arc;

use probity::{DecideOptions, Decision, Engine, EntityUid, ManualClock, Request};
use serde_json::{Value, json};

use crate::rng::Rng;
use crate::{cluster, cluster_nodes, load_cluster, policy_copy, root, stored};

/// Every request the policy scenarios ask (each action, with their contexts and
/// request-scoped entities), and request-scoped workloads of their own.
pub fn requests() -> Vec<Request> {
    let mut out = Vec::new();
    let mut dirs = vec![root().join("testdata/scenarios")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let scenario: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for case in scenario["cases"].as_array().into_iter().flatten() {
                if let Ok(r) = Request::from_json_value(&case["request"]) {
                    out.push(r);
                }
            }
        }
    }
    for (i, gpus) in [(1, 1), (2, 4), (3, 8)] {
        out.push(
            Request::from_json_value(&json!({
                "principal": format!("Workload::\"scoped-{i}\""),
                "action": "schedule",
                "resource": "Node::\"gpu-a1\"",
                "entities": [scoped_workload(&format!("scoped-{i}"), gpus)],
            }))
            .unwrap(),
        );
    }
    assert!(out.len() > 50, "{} requests", out.len());
    out
}

/// A request-scoped workload in the shape of the cluster's `train-1`.
pub fn scoped_workload(id: &str, gpus: i64) -> Value {
    let mut w = stored("train-1");
    w["uid"]["id"] = json!(id);
    w["attrs"]["gpus"] = json!(gpus);
    w
}

/// What differs between a cached and a fresh answer: the step and request, if any.
pub type Mismatch = Option<String>;

/// Runs `steps` random changes on an engine over a copy of the default policies in
/// `dir`, deciding a sample of `requests` after each, through the cache (twice: the
/// second is a hit) and afresh, and returns the first difference.
fn differential(dir: &Path, seed: u64, steps: usize) -> (Mismatch, probity::DecisionCacheStats) {
    let clock = Arc::new(ManualClock::at(1_780_000_000));
    let engine = Engine::builder(dir).clock(clock.clone()).build().unwrap();
    load_cluster(&engine);
    let requests = requests();
    let original = cluster();
    let nodes = cluster_nodes();
    let removable: Vec<Value> = original
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| ["Node", "Workload", "Zone"].contains(&e["uid"]["type"].as_str().unwrap()))
        .cloned()
        .collect();
    let config = std::fs::read_to_string(dir.join("probity.toml")).unwrap();
    let mut rng = Rng::new(seed);
    for step in 0..steps {
        let what = match rng.below(9) {
            0 | 1 => {
                let mut node = rng.pick(&nodes).clone();
                node["attrs"]["hottestGpuTempC"] = json!(40 + rng.below(60));
                node["attrs"]["powerDrawW"] = json!(200 + rng.below(9000));
                node["attrs"]["driverVersion"] = json!(*rng.pick(&["590.48.01", "535.104.05"]));
                engine.upsert_entities(&json!([node])).unwrap();
                format!("update {}", node["uid"]["id"])
            }
            2 => {
                let e = rng.pick(&removable);
                let uid: EntityUid =
                    format!("{}::{}", e["uid"]["type"].as_str().unwrap(), e["uid"]["id"])
                        .parse()
                        .unwrap();
                // A removal another entity still refers to may be refused: the store
                // keeps its truth, and so must the cache.
                let _ = engine.remove_entities(&[uid]);
                format!("remove {}", e["uid"]["id"])
            }
            3 => {
                // Whatever was removed comes back (a node re-registers).
                engine.upsert_entities(&original).unwrap();
                "restore the cluster".to_string()
            }
            4 => {
                let node = rng.pick(&nodes)["uid"]["id"].as_str().unwrap().to_string();
                let _ = engine.block_node(&node, "differential");
                format!("block {node}")
            }
            5 => {
                let node = rng.pick(&nodes)["uid"]["id"].as_str().unwrap().to_string();
                let _ = engine.unblock_node(&node);
                format!("unblock {node}")
            }
            6 => {
                // A settings edit, and sometimes a mode lowered, then a reload.
                let pct = 20 + rng.below(80);
                let mut text = config.replace(
                    "burst_occupancy_pct = 90",
                    &format!("burst_occupancy_pct = {pct}"),
                );
                text = text.replace(
                    "zone_power_ceiling_pct = 95",
                    &format!("zone_power_ceiling_pct = {}", 50 + rng.below(50)),
                );
                if rng.below(2) == 0 {
                    text.push_str(&format!(
                        "\n[modes]\n\"{}\" = \"{}\"\n",
                        rng.pick(&["placement.driver-drift", "thermal.zone-power-ceiling"]),
                        rng.pick(&["warn", "audit"])
                    ));
                }
                std::fs::write(dir.join("probity.toml"), text).unwrap();
                engine.reload().unwrap();
                format!("reload with burst_occupancy_pct = {pct}")
            }
            7 => {
                let mut c = stored("onprem");
                c["attrs"]["gpusAllocated"] = json!(rng.below(64));
                engine.upsert_entities(&json!([c])).unwrap();
                format!("occupancy {}", c["attrs"]["gpusAllocated"])
            }
            _ => {
                let seconds = rng.below(200 * 86_400) as i64;
                clock.advance(seconds);
                format!("clock +{seconds} s")
            }
        };
        for _ in 0..8 {
            let request = rng.pick(&requests);
            let fresh = decide(&engine, request, DecideOptions::new().dry_run().fresh());
            let first = decide(&engine, request, DecideOptions::new().dry_run());
            let again = decide(&engine, request, DecideOptions::new().dry_run());
            for (how, cached) in [("first", first), ("again", again)] {
                if cached != fresh {
                    return (
                        Some(format!(
                            "seed {seed}, step {step} ({what}): {how} cached answer to {request:?} differs:\ncached {cached:?}\nfresh  {fresh:?}"
                        )),
                        engine.decision_cache().stats(),
                    );
                }
            }
        }
    }
    (None, engine.decision_cache().stats())
}

fn decide(engine: &Engine, request: &Request, options: DecideOptions<'_>) -> Decision {
    engine
        .decide_with(std::slice::from_ref(request), options)
        .settle()
        .pop()
        .unwrap()
}

#[test]
fn cached_and_fresh_decisions_agree_over_random_interleavings() {
    for seed in [1, 2, 3, 0x5eed] {
        let dir = policy_copy();
        let (mismatch, stats) = differential(dir.path(), seed, 150);
        assert_eq!(mismatch, None);
        // The comparison means something only if the cache answered.
        assert!(stats.hits > 500, "{stats:?}");
        assert!(stats.misses > 50, "{stats:?}");
    }
}

#[test]
fn the_differential_test_fails_when_an_invalidation_is_skipped() {
    use probity::__Invalidation as Invalidation;
    for skipped in [
        Invalidation::Facts,
        Invalidation::PolicySet,
        Invalidation::Blocklist,
    ] {
        probity::__skip_invalidation(Some(skipped));
        let found = [1, 2, 3, 4, 5]
            .iter()
            .find_map(|&seed| differential(policy_copy().path(), seed, 150).0);
        probity::__skip_invalidation(None);
        assert!(
            found.is_some(),
            "skipping the {skipped:?} invalidation went unnoticed"
        );
    }
}

/// The engine's own entities (the API's callers and groups, as the server registers
/// them) change no store version: the cache must see their replacement itself.
/// Returns whether the caller was allowed after being removed from its group.
fn recorder_after_leaving_its_group(engine: &Engine) -> bool {
    let callers = |groups: Value| {
        json!([
            {"uid": {"type": "ApiGroup", "id": "event-recorders"}, "attrs": {}, "parents": []},
            {"uid": {"type": "ApiCaller", "id": "cn:controller"}, "attrs": {}, "parents": groups},
        ])
    };
    let ask = Request::from_json_value(&json!({
        "principal": "ApiCaller::\"cn:controller\"", "action": "manage",
        "resource": "Api::\"events\"", "context": {"operation": "record"}
    }))
    .unwrap();
    engine
        .replace_owned_entities(
            probity::EntityOwner::Api,
            &callers(json!([{"type": "ApiGroup", "id": "event-recorders"}])),
        )
        .unwrap();
    assert!(engine.decide(&ask).is_allowed());
    assert!(engine.decide(&ask).is_allowed());
    engine
        .replace_owned_entities(probity::EntityOwner::Api, &callers(json!([])))
        .unwrap();
    let fresh = decide(engine, &ask, DecideOptions::new().dry_run().fresh());
    assert!(!fresh.is_allowed(), "{fresh:?}");
    engine.decide(&ask).is_allowed()
}

#[test]
fn replaced_api_callers_invalidate_answers_that_read_them() {
    let engine = Engine::from_embedded_defaults().unwrap();
    assert!(!recorder_after_leaving_its_group(&engine));
    // And the check has teeth: with that invalidation skipped, the stale allow is
    // served.
    let engine = Engine::from_embedded_defaults().unwrap();
    probity::__skip_invalidation(Some(probity::__Invalidation::OwnedEntities));
    let stale = recorder_after_leaving_its_group(&engine);
    probity::__skip_invalidation(None);
    assert!(stale);
}

#[test]
fn a_request_entity_the_store_comes_to_hold_is_refused_though_its_answer_was_cached() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let request = Request::from_json_value(&json!({
        "principal": "Workload::\"scoped-9\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\"", "entities": [scoped_workload("scoped-9", 1)],
    }))
    .unwrap();
    let before = engine.decide(&request);
    assert!(before.is_allowed(), "{before:?}");
    assert!(engine.decide(&request).is_allowed());
    // The store now holds the workload: a request may no longer bring it.
    engine
        .upsert_entities(&json!([scoped_workload("scoped-9", 1)]))
        .unwrap();
    let after = engine.decide(&request);
    assert!(!after.is_allowed(), "{after:?}");
    assert!(
        after.errors[0]
            .message
            .contains("the store holds this entity"),
        "{after:?}"
    );
}

#[test]
fn a_flood_of_unique_requests_stays_within_the_budget_and_spares_other_callers() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let cache = engine.decision_cache();
    cache.set_budget(1 << 20);
    let ask = |caller: &str, id: &str| {
        Request::from_json_value(&json!({
            "principal": format!("Workload::\"{id}\""), "action": "schedule",
            "resource": "Node::\"gpu-a1\"", "entities": [scoped_workload(id, 1)],
        }))
        .unwrap()
        .on_behalf_of(caller)
    };
    // A steady caller's few questions, remembered (the second time they are asked).
    for i in 0..20 {
        engine.decide(&ask("scheduler", &format!("steady-{i}")));
        engine.decide(&ask("scheduler", &format!("steady-{i}")));
    }
    // Another caller asks thousands of questions, each twice and never again.
    for i in 0..5_000 {
        engine.decide(&ask("flooder", &format!("unique-{i}")));
        engine.decide(&ask("flooder", &format!("unique-{i}")));
        assert!(cache.stats().bytes <= 1 << 20, "{:?}", cache.stats());
    }
    let stats = cache.stats();
    assert!(stats.evictions > 1_000, "{stats:?}");
    // The steady caller's answers were spared. Asked again, the first time some may be
    // decided afresh (the doorkeeper's memory of recent questions is finite, and the
    // flood went through it); the second time every one is a hit, none was evicted.
    for i in 0..20 {
        engine.decide(&ask("scheduler", &format!("steady-{i}")));
    }
    let hits = cache.hits();
    for i in 0..20 {
        engine.decide(&ask("scheduler", &format!("steady-{i}")));
    }
    assert_eq!(cache.hits() - hits, 20, "{:?}", cache.stats());
}

#[test]
fn questions_asked_once_are_never_stored() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let cache = engine.decision_cache();
    let ask = |id: &str| {
        Request::from_json_value(&json!({
            "principal": format!("Workload::\"{id}\""), "action": "schedule",
            "resource": "Node::\"gpu-a1\"", "entities": [scoped_workload(id, 1)],
        }))
        .unwrap()
    };
    for i in 0..2_000 {
        assert!(engine.decide(&ask(&format!("once-{i}"))).is_allowed());
    }
    let stats = cache.stats();
    assert_eq!(
        (stats.entries, stats.evictions, stats.hits),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.misses, 2_000);
    // Asked a second time (at once: the doorkeeper remembers recent questions), a
    // question is stored; the third time it is a hit.
    engine.decide(&ask("twice"));
    engine.decide(&ask("twice"));
    assert_eq!(cache.stats().entries, 1);
    engine.decide(&ask("twice"));
    assert_eq!(cache.hits(), 1);
}

#[test]
fn a_deny_answered_from_the_cache_is_recorded_each_time_it_is_answered() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(probity::state::StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = Engine::builder(root().join("policies")).build().unwrap();
    load_cluster(&engine);
    engine.attach_state(store.clone()).unwrap();
    let denied = crate::decision_log::schedule("train-1", "gpu-blocked");
    for _ in 0..5 {
        assert!(!engine.decide(&denied).is_allowed());
    }
    // Asked five times: decided twice (the doorkeeper, then the store), reused three
    // times, and recorded five times, each with its decision.
    assert_eq!(engine.decision_cache().hits(), 3);
    let records = store.decisions(0, 100).unwrap();
    assert_eq!(records.len(), 5);
    assert!(
        records.iter().all(|r| r
            .decision
            .reason_ids()
            .any(|p| p == "security.blocked-node")),
        "{records:?}"
    );
}
