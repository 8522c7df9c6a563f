//! Loading, deciding and the entity store, through the public API only.

use probity::{DecideOptions, Effect, Engine, EntityError, LoadError, Request, RequestError};
use serde_json::json;

use crate::{cluster, policy_copy};

fn request(json: serde_json::Value) -> Request {
    Request::from_json_value(&json).unwrap()
}

fn schedule(workload: &str, node: &str) -> Request {
    request(
        json!({"principal": format!("Workload::\"{workload}\""), "action": "schedule",
                   "resource": format!("Node::\"{node}\"")}),
    )
}

fn loaded() -> Engine {
    let engine = Engine::from_embedded_defaults().unwrap();
    crate::load_cluster(&engine);
    engine
}

fn build_err(dir: &std::path::Path) -> LoadError {
    match Engine::builder(dir).build() {
        Ok(_) => panic!("expected the policy set to be rejected"),
        Err(e) => e,
    }
}

#[test]
fn malformed_cedar_is_located_by_file_line_and_column() {
    let dir = policy_copy();
    let file = dir.path().join("security/keys.cedar");
    let mut text = std::fs::read_to_string(&file).unwrap();
    text.push_str("\npermit (principal, action, resource) when { context.now > };\n");
    std::fs::write(&file, &text).unwrap();
    let err = build_err(dir.path());
    let problems = err.problems();
    assert_eq!(problems.len(), 1, "{}", err.detail());
    let p = &problems[0];
    assert!(p.file.ends_with("security/keys.cedar"), "{}", p.file);
    assert_eq!(p.line, text.lines().count());
    assert_eq!(p.column, 59);
    assert!(p.to_string().contains("keys.cedar:"), "{p}");
}

#[test]
fn schema_violation_names_the_attribute_and_place() {
    let dir = policy_copy();
    std::fs::write(
        dir.path().join("thermal/extra.cedar"),
        "\n\n@id(\"t.x\") @severity(\"low\") @message(\"m\")\nforbid (principal, action == Action::\"comply\", resource)\nwhen { resource.fanRpm > 3 };\n",
    )
    .unwrap();
    let err = build_err(dir.path());
    let p = &err.problems()[0];
    assert!(p.message.contains("attribute `fanRpm`"), "{p}");
    assert_eq!((p.line, p.column), (5, 8));
}

#[test]
fn forbid_without_required_annotations_is_rejected() {
    let dir = policy_copy();
    std::fs::write(
        dir.path().join("placement/bare.cedar"),
        "// no annotations\nforbid (principal, action == Action::\"schedule\", resource);\n",
    )
    .unwrap();
    let err = build_err(dir.path());
    let p = &err.problems()[0];
    assert!(p.message.contains("no @id annotation"), "{p}");
    assert_eq!((p.line, p.column), (2, 1));
}

#[test]
fn unknown_obligation_kind_is_rejected() {
    let dir = policy_copy();
    std::fs::write(
        dir.path().join("placement/typo.cedar"),
        "@id(\"p.t\") @severity(\"low\") @message(\"m\") @obligation(\"migrte\")\nforbid (principal, action == Action::\"schedule\", resource);\n",
    )
    .unwrap();
    let err = build_err(dir.path());
    assert!(
        err.problems()[0]
            .message
            .contains("@obligation(\"migrte\") is not a known kind")
    );
}

/// A block obligation's stop scope and taint effect are what the controller acts on: a
/// typo is a load error, never a block that stops the wrong pods.
#[test]
fn a_block_obligation_with_an_unknown_stop_or_taint_effect_is_rejected() {
    for (param, message) in [
        (
            "@param_stop(\"pod\")",
            "@param_stop(\"pod\") is not \"reader\"",
        ),
        (
            "@param_taint_effect(\"PreferNoSchedule\")",
            "@param_taint_effect(\"PreferNoSchedule\") is not one of NoSchedule, NoExecute",
        ),
        (
            "@param_stop(\"{principal.zone}\")",
            "@param_stop of a block obligation must be plain text",
        ),
    ] {
        let dir = policy_copy();
        std::fs::write(
            dir.path().join("integrity/typo.cedar"),
            format!("@id(\"i.t\") @severity(\"high\") @message(\"m\") @obligation(\"block_node\") @target(\"principal\") {param}\nforbid (principal, action == Action::\"read\", resource);\n"),
        )
        .unwrap();
        let err = build_err(dir.path());
        assert!(err.problems()[0].message.contains(message), "{err}");
    }
    let dir = policy_copy();
    std::fs::write(
        dir.path().join("integrity/strict.cedar"),
        "@id(\"i.s\") @severity(\"high\") @message(\"m\") @obligation(\"block_node\") @target(\"principal\") @param_stop(\"node\") @param_taint_effect(\"NoExecute\")\nforbid (principal, action == Action::\"read\", resource) unless { context.verified };\n",
    )
    .unwrap();
    assert!(Engine::builder(dir.path()).build().is_ok());
}

#[test]
fn negative_threshold_is_rejected_with_its_location() {
    let dir = policy_copy();
    let path = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("power_spike_pct = 25", "power_spike_pct = -25");
    std::fs::write(&path, &text).unwrap();
    let err = build_err(dir.path());
    let p = &err.problems()[0];
    assert!(p.file.ends_with("probity.toml"));
    assert!(
        p.message
            .contains("power_spike_pct must be between 1 and 1000, found -25"),
        "{p}"
    );
    let line = text.lines().position(|l| l.contains("= -25")).unwrap() + 1;
    assert_eq!(p.line, line);
}

#[test]
fn an_empty_policy_directory_is_refused_and_the_block_rule_alone_denies_everything_else() {
    let dir = policy_copy();
    for sub in ["api", "placement", "thermal", "integrity"] {
        std::fs::remove_dir_all(dir.path().join(sub)).unwrap();
    }
    for f in std::fs::read_dir(dir.path().join("security")).unwrap() {
        let f = f.unwrap().path();
        if !f.ends_with("blocklist.cedar") {
            std::fs::remove_file(f).unwrap();
        }
    }
    let engine = Engine::builder(dir.path()).build().unwrap();
    assert_eq!(engine.status().policies, 1);
    crate::load_cluster(&engine);
    let d = engine.decide(&schedule("train-1", "gpu-a1"));
    assert_eq!(d.decision, Effect::Deny);
    assert!(d.reasons.is_empty());

    // Without even the block rule, the schema's @block_policy refuses the set.
    std::fs::remove_file(dir.path().join("security/blocklist.cedar")).unwrap();
    let e = Engine::builder(dir.path()).build().err().unwrap().detail();
    assert!(e.contains("(@block_policy) is not in the set"), "{e}");
}

#[test]
fn unknown_action_is_a_deny_that_says_why() {
    let d = loaded().decide(&request(
        json!({"principal": "Node::\"gpu-a1\"", "action": "reboot",
        "resource": "Node::\"gpu-a1\""}),
    ));
    assert_eq!(d.decision, Effect::Deny);
    assert!(
        d.errors[0].message.contains("Action::\"reboot\""),
        "{:?}",
        d.errors
    );
}

#[test]
fn context_of_the_wrong_type_is_a_deny_that_says_why() {
    let d = loaded().decide(&request(
        json!({"principal": "Node::\"gpu-a1\"", "action": "listen",
        "resource": "Node::\"gpu-a1\"", "context": {"port": "ssh", "protocol": "tcp"}}),
    ));
    assert_eq!(d.decision, Effect::Deny);
    let message = &d.errors[0].message;
    assert!(
        message.contains("is not valid for `Action::\"listen\"`"),
        "{message}"
    );
}

#[test]
fn request_that_is_not_an_object_is_refused() {
    let err = Request::from_json_slice(b"\"schedule\"").unwrap_err();
    assert!(matches!(err, RequestError::Shape { field: "body", .. }));
}

#[test]
fn entity_missing_an_attribute_is_refused_and_the_store_is_unchanged() {
    let engine = loaded();
    let before = engine.status().entities;
    let err = engine
        .upsert_entities(&json!([
            {"uid": {"type": "Zone", "id": "z-new"}, "attrs": {"powerDrawW": 1, "powerCeilingW": 2,
              "cluster": {"__entity": {"type": "Cluster", "id": "onprem"}}}, "parents": []},
            // A Node may lack attributes (it is shared with the cluster, see
            // engine::cluster); a Gpu may not.
            {"uid": {"type": "Gpu", "id": "g-broken"}, "attrs": {"index": 0}, "parents": []}
        ]))
        .unwrap_err();
    let chain = err.to_string();
    assert!(chain.contains("Gpu::\"g-broken\""), "{chain}");
    assert!(chain.contains("to have attribute `"), "{chain}");
    assert_eq!(engine.status().entities, before);
}

/// Entity types whose instances may be each other's parents (the default schema's
/// hierarchy cannot loop; a custom one can).
#[test]
fn parents_that_close_a_cycle_are_refused_whether_or_not_the_batch_keeps_other_parents() {
    let dir = policy_copy();
    let schema = dir.path().join("probity.cedarschema");
    let mut text = std::fs::read_to_string(&schema).unwrap();
    text.push_str("\nentity Team in [Team];\n");
    std::fs::write(&schema, text).unwrap();
    let engine = Engine::builder(dir.path()).build().unwrap();
    let team = |id: &str, parents: &[&str]| {
        json!({"uid": {"type": "Team", "id": id}, "attrs": {},
               "parents": parents.iter().map(|p| json!({"type": "Team", "id": p})).collect::<Vec<_>>()})
    };
    // a -> b -> c
    engine
        .upsert_entities(&json!([
            team("a", &["b"]),
            team("b", &["c"]),
            team("c", &[])
        ]))
        .unwrap();
    let before = engine.status().entities;
    let cycle = |batch: serde_json::Value| match engine.upsert_entities(&batch) {
        Err(EntityError::Cycle { uid }) => uid,
        other => panic!("{batch}: {other:?}"),
    };
    // c -> a alone, after entities that keep their parents, and before them.
    assert_eq!(cycle(json!([team("c", &["a"])])), "Team::\"c\"");
    assert_eq!(
        cycle(json!([
            team("a", &["b"]),
            team("b", &["c"]),
            team("c", &["a"])
        ])),
        "Team::\"c\""
    );
    assert_eq!(
        cycle(json!([team("c", &["a"]), team("a", &["b"])])),
        "Team::\"c\""
    );
    // A loop on itself, and one through an entity new to the store.
    assert_eq!(cycle(json!([team("b", &["b"])])), "Team::\"b\"");
    assert_eq!(
        cycle(json!([team("c", &["d"]), team("d", &["a"])])),
        "Team::\"c\""
    );
    assert_eq!(engine.status().entities, before);
    // Parents kept (in another order), or changed without a loop, are taken; the same
    // number of parents with one of them new is walked.
    engine
        .upsert_entities(&json!([team("p", &["a", "c"])]))
        .unwrap();
    engine
        .upsert_entities(&json!([team("p", &["c", "a"]), team("a", &["b"])]))
        .unwrap();
    assert_eq!(cycle(json!([team("p", &["c", "p"])])), "Team::\"p\"");
    engine
        .upsert_entities(&json!([
            team("a", &["b"]),
            team("c", &["d"]),
            team("d", &[])
        ]))
        .unwrap();
}

#[test]
fn configuration_entities_cannot_be_overwritten_by_callers() {
    let err = loaded()
        .upsert_entities(&json!([{"uid": {"type": "GpuModel", "id": "A100"},
            "attrs": {"tempTargetC": 99}, "parents": []}]))
        .unwrap_err();
    assert!(matches!(err, EntityError::Reserved { .. }));
}

#[test]
fn blocking_a_node_outlives_telemetry_until_unblocked() {
    let engine = loaded();
    assert!(engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
    engine
        .block_node("gpu-a1", "integrity.unverified-read")
        .unwrap();
    let d = engine.decide(&schedule("train-1", "gpu-a1"));
    assert_eq!(
        d.reason_ids().collect::<Vec<_>>(),
        ["security.blocked-node"]
    );
    // A sidecar's routine telemetry upsert, without the blocklist's attribute: the
    // block stands.
    let mut node = cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .cloned()
        .unwrap();
    engine.upsert_entities(&json!([node.clone()])).unwrap();
    assert!(!engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
    // One that says blocked=false contradicts the blocklist and is refused whole.
    node["attrs"]["blocked"] = json!(false);
    let err = engine.upsert_entities(&json!([node])).unwrap_err();
    assert!(
        err.to_string().contains("contradicts the blocklist"),
        "{err}"
    );
    assert!(!engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
    // The stored entity shows the blocklist's view.
    let uid = "Node::\"gpu-a1\"".parse().unwrap();
    assert_eq!(engine.entity(&uid).unwrap()["attrs"]["blocked"], true);
    assert_eq!(
        engine.blocked_nodes()["gpu-a1"].reason,
        "integrity.unverified-read"
    );
    engine.unblock_node("gpu-a1").unwrap();
    assert!(engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
    assert!(!engine.blocked_nodes().contains_key("gpu-a1"));
}

#[test]
fn bug_a_blocklist_contradiction_was_reported_at_entities_0() {
    let engine = loaded();
    engine.block_node("gpu-a1", "operator").unwrap();
    let nodes = crate::cluster_nodes();
    let mut blocked = nodes
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .cloned()
        .unwrap();
    blocked["attrs"]["blocked"] = json!(false);
    let other = nodes
        .iter()
        .find(|e| e["uid"]["id"] != "gpu-a1")
        .cloned()
        .unwrap();
    let err = engine
        .upsert_entities(&json!([other.clone(), other, blocked]))
        .unwrap_err();
    assert!(
        err.to_string().starts_with(
            "entities[2] (Node::\"gpu-a1\"): `blocked: false` contradicts the blocklist"
        ),
        "{err}"
    );
}

#[test]
fn batch_decides_each_request() {
    let engine = loaded();
    let ds = engine
        .decide_with(
            &[
                schedule("train-1", "gpu-a1"),
                schedule("train-1", "gpu-blocked"),
            ],
            DecideOptions::new(),
        )
        .settle();
    assert_eq!(
        ds.iter().map(|d| d.decision).collect::<Vec<_>>(),
        [Effect::Allow, Effect::Deny]
    );
}

#[test]
fn evaluation_error_in_a_forbid_fails_closed_without_obligations() {
    // Overflow in the zone-power policy: the forbid cannot be evaluated, so it denies.
    let engine = loaded();
    engine
        .upsert_entities(
            &json!([{"uid": {"type": "Zone", "id": "zone-a"}, "parents": [],
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": i64::MAX, "powerCeilingW": 40000}}]),
        )
        .unwrap();
    let d = engine.decide(&schedule("train-1", "gpu-a1"));
    assert_eq!(d.decision, Effect::Deny);
    assert_eq!(
        d.reason_ids().collect::<Vec<_>>(),
        ["thermal.zone-power-ceiling"]
    );
    assert!(d.obligations.is_empty());
    assert_eq!(
        d.errors[0].policy.as_deref(),
        Some("thermal.zone-power-ceiling")
    );
}

#[test]
fn entity_lookup_returns_the_stored_json() {
    let engine = loaded();
    let uid = "Node::\"gpu-a1\"".parse().unwrap();
    assert_eq!(engine.entity(&uid).unwrap()["attrs"]["rack"], "r-gpu-a1");
    let zones = engine.entities_json(Some("Zone"));
    assert_eq!(zones.len(), 3);
    assert_eq!(zones[0]["uid"]["id"], "zone-a");
    engine.remove_entities(std::slice::from_ref(&uid)).unwrap();
    assert!(engine.entity(&uid).is_none());
}

#[test]
fn readers_never_see_a_torn_store_while_writers_upsert_batches() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    const PAIRS: usize = 4;
    // Two versions of a zone and its node, always written in one batch: either the zone
    // is at its power ceiling (migrate) or the node runs hot (over temperature). A torn
    // store would give both reasons or neither. Four writers, one pair each, race;
    // their batches are coalesced into shared snapshots, each still whole.
    let version = |k: usize, hot_zone: bool| {
        let (draw, temp) = if hot_zone { (39_000, 58) } else { (10_000, 71) };
        json!([
            {"uid": {"type": "Zone", "id": format!("zone-x{k}")}, "parents": [],
             "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                       "powerDrawW": draw, "powerCeilingW": 40000}},
            {"uid": {"type": "Node", "id": format!("gpu-x{k}")}, "parents": [],
             "attrs": {"zone": {"__entity": {"type": "Zone", "id": format!("zone-x{k}")}}, "rack": "r",
               "driverVersion": "590.48.01", "cudaImage": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
               "gpuModel": {"__entity": {"type": "GpuModel", "id": "A100"}}, "gpuCount": 8,
               "gpuNode": true, "cpuCount": 64, "gpuMemoryMiB": 81920, "hottestGpuTempC": temp,
               "powerDrawW": 3000, "powerWindowMeanW": 2900}}
        ])
    };
    let engine = loaded();
    for k in 0..PAIRS {
        engine.upsert_entities(&version(k, true)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let engine = engine.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut seen = [0u64; 2];
                let mut i = r;
                while !stop.load(Ordering::Relaxed) {
                    let d = engine.decide(&schedule("train-1", &format!("gpu-x{}", i % PAIRS)));
                    let ids: Vec<_> = d.reason_ids().collect();
                    match ids.as_slice() {
                        ["thermal.zone-power-ceiling"] => seen[0] += 1,
                        ["thermal.gpu-over-temperature"] => seen[1] += 1,
                        other => panic!("torn store: {other:?}"),
                    }
                    i += 1;
                }
                seen
            })
        })
        .collect();
    let writers: Vec<_> = (0..PAIRS)
        .map(|k| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for i in 0..150 {
                    engine.upsert_entities(&version(k, i % 2 == 1)).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let seen = readers
        .into_iter()
        .map(|r| r.join().unwrap())
        .fold([0, 0], |a, b| [a[0] + b[0], a[1] + b[1]]);
    assert!(seen[0] + seen[1] > 0, "{seen:?}");
    // Every writer's last batch (i = 149: the hot zone) is what the store holds.
    for k in 0..PAIRS {
        let uid = format!("Node::\"gpu-x{k}\"").parse().unwrap();
        assert_eq!(engine.entity(&uid).unwrap()["attrs"]["hottestGpuTempC"], 58);
        let zone = format!("Zone::\"zone-x{k}\"").parse().unwrap();
        assert_eq!(engine.entity(&zone).unwrap()["attrs"]["powerDrawW"], 39_000);
    }
}

/// Deterministic byte mutations (xorshift): flips, truncations, insertions.
fn mutations(seed: &[u8], count: usize) -> Vec<Vec<u8>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|_| {
            let mut v = seed.to_vec();
            for _ in 0..(1 + next() % 4) {
                let at = (next() as usize) % (v.len() + 1);
                match next() % 4 {
                    0 if at < v.len() => v[at] ^= 1 << (next() % 8),
                    1 => v.truncate(at),
                    2 => {
                        let alphabet = b"{}[]\",:\\09e-\xff";
                        v.insert(at, alphabet[(next() as usize) % alphabet.len()]);
                    }
                    _ if at < v.len() => {
                        v.remove(at);
                    }
                    _ => {}
                }
            }
            v
        })
        .collect()
}

#[test]
fn parsers_and_decide_never_panic_on_mutated_input() {
    let engine = loaded();
    let request = br#"{"principal": "Node::\"gpu-a1\"", "action": "read", "resource": "Checkpoint::\"ckpt-epoch-7\"", "context": {"verified": true}, "entities": []}"#;
    let mut decided = 0;
    for bytes in mutations(request, 3000) {
        if let Ok(r) = Request::from_json_slice(&bytes) {
            let _ = engine.decide(&r);
            decided += 1;
        }
    }
    assert!(decided > 0);
    let config = std::fs::read(crate::root().join("policies/probity.toml")).unwrap();
    let schema_text =
        std::fs::read_to_string(crate::root().join("policies/probity.cedarschema")).unwrap();
    let settings = probity::SettingsSchema::from_cedarschema(
        "probity.cedarschema",
        &std::sync::Arc::from(schema_text),
    )
    .unwrap();
    for bytes in mutations(&config, 3000) {
        let Ok(text) = std::str::from_utf8(&bytes) else {
            continue;
        };
        if let Err(e) = settings.read("probity.toml", &std::sync::Arc::from(text)) {
            assert!(e.line >= 1 && e.column >= 1);
        }
    }
}
