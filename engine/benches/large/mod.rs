//! The large store shared by the store bench and the `large_store` example: copies of
//! `testdata/entities/cluster.json`'s `gpu-a1` (10,000 nodes in 100 zones) and
//! `train-1` (100,000 workloads in 2 namespaces), with new ids. Deterministic.

#![allow(dead_code, reason = "each user takes what it needs")]

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// Nodes in the large store.
pub const NODES: usize = 10_000;
/// Zones.
pub const ZONES: usize = 100;
/// Workloads.
pub const WORKLOADS: usize = 100_000;
/// Every stored entity: the cluster, zones, nodes, 2 namespaces, workloads, and the
/// fixture's users, group and checkpoint (110,107; its 3 keys, counted in the 110,110
/// of earlier runs, now come from the keyring and are not in the store's JSON).
pub const ENTITIES: usize = 1 + ZONES + NODES + 2 + WORKLOADS + 4;

pub fn policies_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies")
}

fn fixture() -> &'static [Value] {
    static FIXTURE: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    FIXTURE.get_or_init(|| {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/entities/cluster.json"),
        )
        .unwrap();
        serde_json::from_str(&text).unwrap()
    })
}

fn template(id: &str) -> Value {
    fixture()
        .iter()
        .find(|e| e["uid"]["id"] == id)
        .unwrap()
        .clone()
}

fn zone_id(n: usize) -> String {
    format!("zone-{:03}", n % ZONES)
}

pub fn node_id(n: usize) -> String {
    format!("gpu-{n:05}")
}

/// Node `n`, as gpu-a1 with a new id, zone and temperature.
pub fn node(n: usize, temp: i64) -> Value {
    let mut v = template("gpu-a1");
    let zone = zone_id(n);
    v["uid"]["id"] = json!(node_id(n));
    v["attrs"]["zone"] = json!({"__entity": {"type": "Zone", "id": zone}});
    v["attrs"]["rack"] = json!(format!("r-{:04}", n / 20));
    v["attrs"]["hottestGpuTempC"] = json!(temp);
    v["parents"] = json!([{"type": "Zone", "id": zone}]);
    v
}

/// One node's changed temperature: the update a node agent sends.
pub fn node_update(n: usize, i: i64) -> Value {
    Value::Array(vec![node(n, 40 + i.rem_euclid(20))])
}

/// Workload `w`, as train-1 with a new id.
pub fn workload(w: usize) -> Value {
    let mut v = template("train-1");
    v["uid"]["id"] = json!(format!("wl-{w:06}"));
    v
}

/// Every 97th node is blocked (through the blocklist).
pub fn blocked_nodes() -> Vec<String> {
    (0..NODES).filter(|n| n % 97 == 0).map(node_id).collect()
}

/// The whole store, as one JSON array.
pub fn store() -> Value {
    let mut out = Vec::with_capacity(ENTITIES);
    for e in fixture().iter().cloned() {
        let keep = matches!(e["uid"]["type"].as_str(), Some("Cluster" | "Namespace"))
            || matches!(
                e["uid"]["id"].as_str(),
                Some("alice" | "bob" | "sre" | "ckpt-epoch-7")
            );
        if keep {
            out.push(e);
        }
    }
    for z in 0..ZONES {
        out.push(json!({"uid": {"type": "Zone", "id": zone_id(z)},
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": 20_000, "powerCeilingW": 40_000},
            "parents": [{"type": "Cluster", "id": "onprem"}]}));
    }
    for n in 0..NODES {
        out.push(node(n, 55 + (n % 9) as i64));
    }
    for w in 0..WORKLOADS {
        out.push(workload(w));
    }
    Value::Array(out)
}

/// A `schedule` of a varying workload onto a varying node.
pub fn schedule_request(i: usize) -> Value {
    json!({"principal": {"type": "Workload", "id": format!("wl-{:06}", (i * 7) % WORKLOADS)},
           "action": "schedule",
           "resource": {"type": "Node", "id": node_id((i * 13) % NODES)}})
}
