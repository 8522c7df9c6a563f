use super::reference::with_whole_store;
use crate::decision::Decision;
use crate::engine::Engine;
use crate::request::Request;
use serde_json::{Value, json};
use std::collections::BTreeSet;

/// The map every slice starts from is empty: the placeholders that sized it are
/// gone, so none can appear in a decision.
#[test]
fn the_presized_map_every_slice_starts_from_holds_no_entity() {
    let base = super::presized_entities();
    assert!(base.is_empty());
    assert_eq!(base.iter().count(), 0);
}

/// What must not change between a slice and the whole store.
fn essence(
    d: &Decision,
) -> (
    String,
    BTreeSet<String>,
    Vec<String>,
    BTreeSet<Option<String>>,
) {
    let mut obligations: Vec<String> = d
        .obligations
        .iter()
        .map(|o| format!("{}|{:?}|{}|{:?}", o.kind, o.target, o.policy, o.parameters))
        .collect();
    obligations.sort();
    (
        format!("{}", d.decision),
        d.reasons
            .iter()
            .map(|r| format!("{}|{}", r.policy, r.message))
            .collect(),
        obligations,
        d.errors.iter().map(|e| e.policy.clone()).collect(),
    )
}

fn compare(engine: &Engine, request: &Request) {
    let dry_run = |r: &Request| {
        engine
            .decide_with(
                std::slice::from_ref(r),
                crate::DecideOptions::new().dry_run(),
            )
            .settle()
            .remove(0)
    };
    let sliced = dry_run(request);
    let whole = with_whole_store(|| dry_run(request));
    assert_eq!(
        essence(&sliced),
        essence(&whole),
        "{request:?}\nsliced {sliced:?}\nwhole {whole:?}"
    );
}

/// The scenario suite's every case, decided on its slice and on the whole store.
#[test]
fn slicing_never_changes_a_scenario_decision() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/scenarios");
    let files = crate::scenario::discover(&root).unwrap();
    assert!(files.len() > 10);
    let mut cases = 0;
    for file in files {
        let sliced = crate::scenario::run_file(&engine, &file).unwrap();
        let whole = with_whole_store(|| crate::scenario::run_file(&engine, &file).unwrap());
        for (s, w) in sliced.iter().zip(&whole) {
            assert_eq!(s.failure, w.failure, "{}: {}", file.display(), s.name);
            assert!(s.passed(), "{s}");
            cases += 1;
        }
    }
    assert!(cases > 80, "{cases} cases");
}

/// Random clusters and requests: the slice decides as the whole store does.
#[test]
fn slicing_never_changes_a_decision_on_random_stores() {
    let mut next = crate::testing::xorshift(0x9e37_79b9_7f4a_7c15);
    for _store in 0..4 {
        let engine = Engine::from_embedded_defaults().unwrap();
        let mut entities: Vec<Value> = vec![json!({"uid": {"type": "Cluster", "id": "c"},
            "attrs": {"gpusTotal": 64, "gpusAllocated": next(70)}, "parents": []})];
        let zones = 1 + next(4);
        for z in 0..zones {
            let mut attrs = json!({"cluster": {"__entity": {"type": "Cluster", "id": "c"}},
                "powerDrawW": next(50_000), "powerCeilingW": 40_000});
            if next(3) == 0 {
                attrs["dedicatedClass"] = json!((["rlhf", "training"][next(2) as usize]));
            }
            entities.push(
                json!({"uid": {"type": "Zone", "id": format!("z{z}")}, "attrs": attrs,
                "parents": [{"type": "Cluster", "id": "c"}]}),
            );
        }
        for n in 0..12 {
            let mut attrs = json!({"zone": {"__entity": {"type": "Zone", "id": format!("z{}", next(zones))}},
                "rack": "r", "driverVersion": (["590.48.01", "580.1"][next(2) as usize]),
                "cudaImage": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
                "gpuNode": next(4) != 0, "gpuCount": next(9), "cpuCount": 64,
                "gpuMemoryMiB": 81920, "hottestGpuTempC": 40 + next(40),
                "powerDrawW": 2000 + next(3000), "powerWindowMeanW": next(4000)});
            match next(4) {
                0 => {}
                1 => attrs["gpuModel"] = json!({"__entity": {"type": "GpuModel", "id": "H999"}}),
                _ => {
                    attrs["gpuModel"] = json!({"__entity": {"type": "GpuModel", "id": (["A100", "H100"][next(2) as usize])}})
                }
            }
            entities.push(
                json!({"uid": {"type": "Node", "id": format!("n{n}")}, "attrs": attrs,
                "parents": [{"type": "Zone", "id": format!("z{}", next(zones))}]}),
            );
        }
        for ns in ["inference", "training"] {
            entities
                .push(json!({"uid": {"type": "Namespace", "id": ns}, "attrs": {}, "parents": []}));
        }
        for w in 0..10 {
            let ns = ["inference", "training"][next(2) as usize];
            entities.push(json!({"uid": {"type": "Workload", "id": format!("w{w}")},
                "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": ns}},
                    "class": (["inference", "training", "rlhf", "batch", "RLHF"][next(5) as usize]),
                    "gpus": next(9), "cpuMillis": next(80_000), "gpuMemoryMiB": next(90_000), "image": "i"},
                "parents": [{"type": "Namespace", "id": ns}]}));
        }
        // Keys come from the keyring, the one owner that may supply them.
        let mut keys = Vec::new();
        for k in 0..3 {
            keys.push(json!({"uid": {"type": "Key", "id": format!("k{k}")},
                "attrs": {"createdAt": 1_760_000_000 + next(20_000_000), "state": (["active", "retired"][next(2) as usize])},
                "parents": []}));
        }
        entities.push(json!({"uid": {"type": "User", "id": "u"}, "attrs": {"elevationAuthorized": next(2) == 0}, "parents": []}));
        engine.upsert_entities(&Value::Array(entities)).unwrap();
        engine
            .replace_owned_entities(crate::EntityOwner::Keyring, &Value::Array(keys))
            .unwrap();
        for n in 0..12 {
            if next(5) == 0 {
                engine.block_node(&format!("n{n}"), "random").unwrap();
            }
        }
        engine
            .block_node("ghost", "blocked before any fact")
            .unwrap();
        let node = |next: &mut dyn FnMut(u64) -> u64| {
            if next(10) == 0 {
                "ghost".to_owned()
            } else if next(10) == 0 {
                "nobody".to_owned()
            } else {
                format!("n{}", next(12))
            }
        };
        // A node whose zone no fact describes: a request may bring that zone, which
        // the node's ancestors then pass through (such a request is cut whole).
        entities_with_missing_zone(&engine);
        for _ in 0..150 {
            let n = node(&mut next);
            if next(3) == 0 {
                compare(&engine, &with_own_entities(&mut next, &n));
                continue;
            }
            let request = match next(7) {
                0 => {
                    json!({"principal": format!("Workload::\"w{}\"", next(11)), "action": "schedule",
                            "resource": format!("Node::\"{n}\"")})
                }
                1 => {
                    json!({"principal": format!("Node::\"{n}\""), "action": "comply", "resource": format!("Node::\"{n}\"")})
                }
                2 => {
                    json!({"principal": format!("Workload::\"w{}\"", next(10)), "action": "admit",
                            "resource": format!("Namespace::\"{}\"", (["inference", "training", "other"][next(3) as usize]))})
                }
                3 => {
                    json!({"principal": format!("Node::\"{n}\""), "action": "read", "resource": "Checkpoint::\"c\"",
                            "context": {"verified": next(2) == 0}})
                }
                4 => {
                    json!({"principal": format!("Node::\"{n}\""), "action": "listen", "resource": format!("Node::\"{n}\""),
                            "context": {"port": ([22, 2379, 8080, 8472][next(4) as usize]), "protocol": (["tcp", "udp"][next(2) as usize])}})
                }
                5 => {
                    json!({"principal": "Workload::\"w1\"", "action": "encrypt", "resource": format!("Key::\"k{}\"", next(4)),
                            "context": {"now": 1_770_000_000 + next(10_000_000)}})
                }
                _ => {
                    json!({"principal": "User::\"u\"", "action": "elevate", "resource": format!("Node::\"{n}\""),
                            "context": {"now": 1_770_000_000, "lastRemoteLoginAt": 1_770_000_000 - next(600)}})
                }
            };
            let request = Request::from_json_value(&request)
                .unwrap()
                .as_fact_reporter();
            compare(&engine, &request);
        }
    }
}

fn entities_with_missing_zone(engine: &Engine) {
    engine
        .upsert_entities(&json!([{"uid": {"type": "Node", "id": "orphan"},
            "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z-missing"}}, "rack": "r",
                "driverVersion": "590.48.01", "cudaImage": "i", "gpuNode": true, "gpuCount": 8,
                "cpuCount": 64, "gpuMemoryMiB": 81920, "hottestGpuTempC": 50,
                "powerDrawW": 2000, "powerWindowMeanW": 1000},
            "parents": [{"type": "Zone", "id": "z-missing"}]}]))
        .unwrap();
}

/// A request that brings entities of its own: a new workload (in a namespace the
/// store may not hold, brought too), and sometimes the zone a stored node names
/// but no fact describes.
fn with_own_entities(next: &mut impl FnMut(u64) -> u64, node: &str) -> Request {
    let ns = ["inference", "training", "brought"][next(3) as usize];
    let mut own = vec![json!({"uid": {"type": "Workload", "id": "own"},
        "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": ns}},
            "class": (["inference", "training", "rlhf"][next(3) as usize]),
            "gpus": next(9), "cpuMillis": next(80_000), "gpuMemoryMiB": next(90_000), "image": "i"},
        "parents": [{"type": "Namespace", "id": ns}]})];
    if ns == "brought" {
        own.push(
            json!({"uid": {"type": "Namespace", "id": "brought"}, "attrs": {}, "parents": []}),
        );
    }
    let resource = if next(3) == 0 {
        own.push(json!({"uid": {"type": "Zone", "id": "z-missing"},
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "c"}},
                "powerDrawW": next(50_000), "powerCeilingW": 40_000},
            "parents": [{"type": "Cluster", "id": "c"}]}));
        "orphan"
    } else {
        node
    };
    Request::from_json_value(
        &json!({"principal": "Workload::\"own\"", "action": "schedule",
        "resource": format!("Node::\"{resource}\""), "entities": own}),
    )
    .unwrap()
}

/// Requests on the same node with workloads of their own share one base: the
/// node's part of the slice is cut once per snapshot.
#[test]
fn requests_with_their_own_workloads_share_the_nodes_base() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let cluster = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/entities/cluster.json"),
    )
    .unwrap();
    engine
        .upsert_entities(&serde_json::from_str(&cluster).unwrap())
        .unwrap();
    let mut x = 7;
    let mut next = |m: u64| {
        x = (x * 48_271) % 2_147_483_647;
        x % m
    };
    for _ in 0..20 {
        let request = with_own_entities(&mut next, "gpu-a1");
        if request.entities().len() == 3 {
            continue; // the orphan node, not in this store
        }
        compare(&engine, &request);
    }
    let snapshot = engine.snapshot_now();
    // One base per set of stored roots: gpu-a1 with the action's literals, and the
    // namespace's when the workload's is stored.
    assert!(snapshot.bases.len() >= 1);
    assert!(snapshot.bases.len() <= 2, "{}", snapshot.bases.len());
}
