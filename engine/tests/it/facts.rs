//! Where facts come from: the store is the truth, a request only adds what the store
//! lacks, and the facts the engine owns (configuration, API callers, the blocklist,
//! the clock, reported context) come only from their owners.

use std::sync::Arc;

use probity::{Effect, Engine, EntityError, EntityOwner, ManualClock, Request};
use serde_json::{Value, json};

use crate::{cluster, load_cluster, load_keys, stored};

fn request(v: Value) -> Request {
    Request::from_json_value(&v).unwrap()
}

fn error_text(d: &probity::Decision) -> String {
    assert_eq!(d.decision, Effect::Deny, "{d:?}");
    d.errors
        .iter()
        .map(|e| e.message.clone())
        .collect::<Vec<_>>()
        .join("; ")
}

#[test]
fn bug_a_request_entity_could_unblock_a_node_blocked_through_the_api() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    engine.block_node("gpu-a1", "operator").unwrap();
    let mut node = stored("gpu-a1");
    node["attrs"]["blocked"] = json!(false);
    let d = engine.decide(&request(json!({
        "principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\"", "entities": [node]})));
    let why = error_text(&d);
    assert!(
        why.contains("request entities[0] (Node::\"gpu-a1\")"),
        "{why}"
    );
    assert!(why.contains("the store holds this entity"), "{why}");
}

#[test]
fn bug_request_scoped_settings_widened_the_port_baseline() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let d = engine.decide(&request(json!({
        "principal": "Node::\"gpu-a1\"", "action": "listen", "resource": "Node::\"gpu-a1\"",
        "context": {"port": 8080, "protocol": "tcp"},
        "entities": [{"uid": {"type": "Settings", "id": "active"},
                      "attrs": {"inboundPortBaseline": [22, 8080]}, "parents": []}]})));
    let why = error_text(&d);
    assert!(
        why.contains("Settings entities come from the engine (config)"),
        "{why}"
    );
}

#[test]
fn bug_request_entities_could_override_a_key_a_zone_and_a_user() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    load_keys(&engine);
    // A key is the keyring's: refused for what it is, whatever it says.
    let d = engine.decide(&request(json!({
        "principal": "Workload::\"train-1\"", "action": "encrypt", "resource": "Key::\"key-old\"",
        "entities": [{"uid": {"type": "Key", "id": "key-old"},
                      "attrs": {"createdAt": 1_790_000_000, "state": "active"}, "parents": []}]})));
    assert!(
        error_text(&d)
            .contains("Key entities come from the engine (keyring), never from a request"),
        "{d:?}"
    );
    // A zone the store holds, claimed cooler by the request.
    let mut zone = stored("zone-hot");
    zone["attrs"]["powerDrawW"] = json!(0);
    let d = engine.decide(&request(json!({
        "principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": "Node::\"gpu-hot1\"", "entities": [zone]})));
    assert!(
        error_text(&d).contains("the store holds this entity"),
        "{d:?}"
    );
    let mut bob = stored("bob");
    bob["attrs"]["elevationAuthorized"] = json!(true);
    let d = engine.decide(
        &request(json!({"principal": "User::\"bob\"", "action": "elevate",
            "resource": "Node::\"gpu-a1\"", "context": {"lastRemoteLoginAt": 1},
            "entities": [bob]}))
        .as_fact_reporter(),
    );
    assert!(
        error_text(&d).contains("the store holds this entity"),
        "{d:?}"
    );
}

#[test]
fn a_request_may_add_a_fact_the_store_does_not_hold() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let mut w = stored("train-1");
    w["uid"]["id"] = json!("review/abc");
    let d = engine.decide(&request(json!({
        "principal": "Workload::\"review/abc\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\"", "entities": [w]})));
    assert!(d.is_allowed(), "{d:?}");
}

#[test]
fn a_request_entity_the_store_gained_after_its_answer_was_cached_is_refused() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let cache = probity::DecisionCache::default();
    let mut w = stored("train-1");
    w["uid"]["id"] = json!("review/abc");
    let asked = request(json!({
        "principal": "Workload::\"review/abc\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\"", "entities": [w.clone()]}));
    let decide =
        || engine.decide_each(&asked, std::slice::from_ref(asked.resource()), Some(&cache));
    assert!(decide()[0].is_allowed());
    assert!(decide()[0].is_allowed(), "asked twice, and remembered");
    // Now the store holds the workload: the same request may no longer supply it, even
    // though its answer is remembered.
    engine.upsert_entities(&json!([w])).unwrap();
    assert!(
        error_text(&decide()[0]).contains("the store holds this entity"),
        "{:?}",
        decide()
    );
}

#[test]
fn entity_writers_cannot_make_themselves_administrators() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let err = engine
        .upsert_entities(&json!([{"uid": {"type": "ApiCaller", "id": "uid:1000"},
            "attrs": {}, "parents": [{"type": "ApiGroup", "id": "admins"}]}]))
        .unwrap_err();
    assert!(
        matches!(&err, EntityError::Reserved { owner: "api", .. }),
        "{err}"
    );
    // The server's own registration is the one way in.
    engine
        .replace_owned_entities(
            EntityOwner::Api,
            &json!([{"uid": {"type": "ApiCaller", "id": "uid:0"}, "attrs": {},
                     "parents": [{"type": "ApiGroup", "id": "admins"}]},
                    {"uid": {"type": "ApiGroup", "id": "admins"}, "attrs": {}, "parents": []}]),
        )
        .unwrap();
    let manage = |caller: &str| {
        engine.decide(&request(
            json!({"principal": format!("ApiCaller::\"{caller}\""),
            "action": "manage", "resource": "Api::\"entities\"",
            "context": {"operation": "upsert"}}),
        ))
    };
    assert!(manage("uid:0").is_allowed());
    assert!(!manage("uid:1000").is_allowed());
    // And it refuses anything but the types it owns.
    assert!(
        engine
            .replace_owned_entities(EntityOwner::Api, &json!([stored("gpu-a1")]))
            .is_err()
    );
    assert!(
        engine
            .replace_owned_entities(EntityOwner::Config, &json!([]))
            .is_err()
    );
}

#[test]
fn the_decision_time_comes_from_the_engines_clock() {
    let clock = Arc::new(ManualClock::at(1_767_139_200));
    let engine = Engine::defaults().clock(clock.clone()).build().unwrap();
    load_cluster(&engine);
    load_keys(&engine);
    let encrypt = |key: &str| {
        request(
            json!({"principal": "Workload::\"train-1\"", "action": "encrypt",
            "resource": format!("Key::\"{key}\"")}),
        )
    };
    // key-fresh was made 2025-11-30: 31 days old at the clock, 91 a minute past 90 days.
    assert!(engine.decide(&encrypt("key-fresh")).is_allowed());
    clock.advance(60 * 86_400);
    let d = engine.decide(&encrypt("key-fresh"));
    assert_eq!(d.reason_ids().collect::<Vec<_>>(), ["security.key-too-old"]);
    assert_eq!(d.obligations[0].kind, "rotate_key");
    // A caller that names the time is refused, even a time that would allow.
    let d = engine.decide(&request(json!({"principal": "Workload::\"train-1\"",
        "action": "encrypt", "resource": "Key::\"key-fresh\"",
        "context": {"now": 1_767_139_200}})));
    let why = error_text(&d);
    assert!(
        why.contains("context.now is a fact the engine owns"),
        "{why}"
    );
    // An authorized reporter may (the auditd reader judges a sudo at its own time).
    let d = engine.decide(
        &request(json!({"principal": "Workload::\"train-1\"",
            "action": "encrypt", "resource": "Key::\"key-fresh\"",
            "context": {"now": 1_767_139_200}}))
        .as_fact_reporter(),
    );
    assert!(d.is_allowed(), "{d:?}");
}

#[test]
fn reported_facts_and_reporter_only_actions_are_named() {
    let engine = Engine::from_embedded_defaults().unwrap();
    load_cluster(&engine);
    let read = request(json!({"principal": "Node::\"gpu-a1\"", "action": "read",
        "resource": "Checkpoint::\"c\"", "context": {"verified": true}}));
    assert!(engine.needs_reporter(&read));
    assert!(error_text(&engine.decide(&read)).contains("context.verified"));
    let elevate = request(json!({"principal": "User::\"bob\"", "action": "elevate",
        "resource": "Node::\"gpu-a1\""}));
    assert!(engine.needs_reporter(&elevate));
    assert!(error_text(&engine.decide(&elevate)).contains("may ask `elevate`"));
    let schedule = request(
        json!({"principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": "Node::\"gpu-a1\""}),
    );
    assert!(!engine.needs_reporter(&schedule));
}

#[test]
fn messages_name_the_facts_that_caused_them() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let mut node = stored("gpu-a1");
    node["attrs"]["gpuModel"] = json!({"__entity": {"type": "GpuModel", "id": "H999"}});
    let mut entities = cluster().as_array().unwrap().clone();
    entities.retain(|e| e["uid"]["id"] != "gpu-a1");
    entities.push(node);
    engine.upsert_entities(&Value::Array(entities)).unwrap();
    let d = engine.decide(&request(json!({"principal": "Node::\"gpu-a1\"",
        "action": "comply", "resource": "Node::\"gpu-a1\""})));
    assert_eq!(
        d.reasons[0].message,
        "GPU model H999 of node gpu-a1 has no temperature target in probity.toml"
    );
    assert_eq!(d.obligations[0].parameters["model"], "H999");
}

#[test]
fn node_ids_that_are_not_node_names_are_refused() {
    let engine = Engine::from_embedded_defaults().unwrap();
    for bad in ["", "Node::\"x\"", "a b", "-x", "x.", "tab\tx"] {
        let err = engine.block_node(bad, "typo").unwrap_err();
        assert!(matches!(err, EntityError::NodeId { .. }), "{bad:?}: {err}");
    }
    assert!(engine.blocked_nodes().is_empty());
    engine.block_node("gpu-a1.rack-2_b", "ok").unwrap();
}

#[test]
fn a_second_block_keeps_the_first_reason_and_time_in_a_history() {
    let clock = Arc::new(ManualClock::at(1_000));
    let engine = Engine::defaults().clock(clock.clone()).build().unwrap();
    engine.block_node("gpu-a1", "first").unwrap();
    clock.advance(60);
    engine.block_node("gpu-a1", "second").unwrap();
    let record = &engine.blocked_nodes()["gpu-a1"];
    assert_eq!((record.reason.as_str(), record.since), ("first", 1_000));
    assert_eq!(record.history.len(), 1);
    assert_eq!(
        (record.history[0].reason.as_str(), record.history[0].at),
        ("second", 1_060)
    );
}

#[test]
fn entity_errors_name_the_entity_and_the_attribute() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let mut node = stored("gpu-a1");
    node["attrs"]["gpuCount"] = json!("eight");
    let err = engine
        .upsert_entities(&json!([stored("zone-a"), node]))
        .unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("entities[1] (Node::\"gpu-a1\")"), "{text}");
    assert!(text.contains("gpuCount"), "{text}");
    assert_eq!(
        engine.entity_count(),
        Engine::from_embedded_defaults().unwrap().entity_count()
    );
}
