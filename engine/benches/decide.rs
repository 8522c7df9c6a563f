//! `decide` on the default policies with 1,000 nodes, 50 zones and 200 workloads in
//! the store, beside raw `cedar_policy::Authorizer::is_authorized` on the same inputs;
//! and hot-reload latency from a file write to the new set being live.
//!
//! Run: `cargo bench -p probity --bench decide`

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use std::hint::black_box;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cedar_policy as cedar;
use criterion::{Criterion, criterion_group};
use probity::{DecideOptions, Engine, Request, SettingsSchema};
use serde_json::{Value, json};

const DRIVER: &str = "590.48.01";
const IMAGE: &str = "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04";

fn e(t: &str, id: &str) -> Value {
    json!({"__entity": {"type": t, "id": id}})
}

/// 1 cluster, 50 zones, 1,000 nodes (every 97th blocked), 2 namespaces, 200
/// workloads. For the engine the blocklist owns `blocked`, so it is left out
/// (`with_blocked` false) and the nodes are blocked through it; raw Cedar gets it as
/// an attribute.
fn cluster(with_blocked: bool) -> Value {
    let mut v = vec![json!({"uid": {"type": "Cluster", "id": "onprem"},
        "attrs": {"gpusTotal": 8000, "gpusAllocated": 4000}, "parents": []})];
    for z in 0..50 {
        v.push(json!({"uid": {"type": "Zone", "id": format!("zone-{z}")},
            "attrs": {"cluster": e("Cluster", "onprem"), "powerDrawW": 20_000, "powerCeilingW": 40_000},
            "parents": [{"type": "Cluster", "id": "onprem"}]}));
    }
    for n in 0..1000 {
        let zone = format!("zone-{}", n % 50);
        v.push(json!({"uid": {"type": "Node", "id": format!("gpu-{n:04}")},
            "attrs": {"zone": e("Zone", &zone), "rack": format!("r{}", n / 20), "driverVersion": DRIVER,
              "cudaImage": IMAGE, "gpuNode": true, "gpuModel": e("GpuModel", "A100"), "gpuCount": 8, "cpuCount": 64,
              "gpuMemoryMiB": 81920, "hottestGpuTempC": 55 + (n % 9) as i64,
              "powerDrawW": 3000, "powerWindowMeanW": 2900},
            "parents": [{"type": "Zone", "id": zone}]}));
        if with_blocked && let Some(attrs) = v.last_mut().and_then(|n| n["attrs"].as_object_mut()) {
            attrs.insert("blocked".into(), json!(n % 97 == 0));
        }
    }
    for ns in ["inference", "training"] {
        v.push(json!({"uid": {"type": "Namespace", "id": ns}, "attrs": {}, "parents": []}));
    }
    for w in 0..200 {
        let ns = if w % 2 == 0 { "inference" } else { "training" };
        v.push(
            json!({"uid": {"type": "Workload", "id": format!("wl-{w:03}")},
            "attrs": {"namespace": e("Namespace", ns), "class": "training", "gpus": 1 + w % 4,
              "cpuMillis": 32_000, "gpuMemoryMiB": 40_000, "image": IMAGE},
            "parents": [{"type": "Namespace", "id": ns}]}),
        );
    }
    Value::Array(v)
}

fn policies_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies")
}

/// The same policy set and entities, loaded with nothing but Cedar.
fn raw_cedar(entities: &Value) -> (cedar::PolicySet, cedar::Schema, cedar::Entities) {
    let dir = policies_dir();
    let schema_text = std::fs::read_to_string(dir.join("probity.cedarschema")).unwrap();
    let (schema, _) = cedar::Schema::from_cedarschema_str(&schema_text).unwrap();
    let mut pset = cedar::PolicySet::new();
    let mut n = 0;
    for sub in ["security", "placement", "thermal", "integrity"] {
        for entry in std::fs::read_dir(dir.join(sub)).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            for p in cedar::PolicySet::from_str(&text).unwrap().policies() {
                pset.add(p.new_id(cedar::PolicyId::new(format!("p{n}"))))
                    .unwrap();
                n += 1;
            }
        }
    }
    let config_text: Arc<str> = std::fs::read_to_string(dir.join("probity.toml"))
        .unwrap()
        .into();
    let schema_text: Arc<str> = std::fs::read_to_string(dir.join("probity.cedarschema"))
        .unwrap()
        .into();
    let config = SettingsSchema::from_cedarschema("probity.cedarschema", &schema_text)
        .unwrap()
        .read("probity.toml", &config_text)
        .unwrap();
    let mut all = entities.as_array().unwrap().clone();
    all.extend(config.entities_json().as_array().unwrap().iter().cloned());
    let entities = cedar::Entities::from_json_value(Value::Array(all), Some(&schema)).unwrap();
    (pset, schema, entities)
}

fn decide(c: &mut Criterion) {
    let engine = Engine::builder(policies_dir()).build().unwrap();
    engine.upsert_entities(&cluster(false)).unwrap();
    for n in (0..1000).filter(|n| n % 97 == 0) {
        engine.block_node(&format!("gpu-{n:04}"), "bench").unwrap();
    }
    let (pset, schema, cedar_entities) = raw_cedar(&cluster(true));

    let mut group = c.benchmark_group("decide");
    for (name, workload, node) in [
        ("schedule_allow", "wl-001", "gpu-0001"),
        ("schedule_deny_blocked", "wl-001", "gpu-0097"),
    ] {
        let request = Request::from_json_value(&json!({
            "principal": {"type": "Workload", "id": workload}, "action": "schedule",
            "resource": {"type": "Node", "id": node}}))
        .unwrap();
        let expect_allow = name.ends_with("allow");
        assert_eq!(engine.decide(&request).is_allowed(), expect_allow);

        let p = cedar::EntityUid::from_str(&format!("Workload::\"{workload}\"")).unwrap();
        let a = cedar::EntityUid::from_str("Action::\"schedule\"").unwrap();
        let r = cedar::EntityUid::from_str(&format!("Node::\"{node}\"")).unwrap();
        let raw_request = cedar::Request::new(
            p.clone(),
            a.clone(),
            r.clone(),
            cedar::Context::empty(),
            Some(&schema),
        )
        .unwrap();
        let authorizer = cedar::Authorizer::new();
        assert_eq!(
            authorizer
                .is_authorized(&raw_request, &pset, &cedar_entities)
                .decision()
                == cedar::Decision::Allow,
            expect_allow
        );

        group.bench_function(format!("{name}/raw_cedar"), |b| {
            b.iter(|| {
                black_box(authorizer.is_authorized(black_box(&raw_request), &pset, &cedar_entities))
            })
        });
        group.bench_function(format!("{name}/raw_cedar_with_request_validation"), |b| {
            b.iter(|| {
                let req = cedar::Request::new(
                    p.clone(),
                    a.clone(),
                    r.clone(),
                    cedar::Context::empty(),
                    Some(&schema),
                )
                .unwrap();
                black_box(authorizer.is_authorized(&req, &pset, &cedar_entities))
            })
        });
        let fresh = || {
            engine
                .decide_with(std::slice::from_ref(&request), DecideOptions::new().fresh())
                .settle()
        };
        group.bench_function(format!("{name}/probity_fresh"), |b| {
            b.iter(|| black_box(fresh()))
        });
        // A miss: looked up, not found, decided, remembered.
        group.bench_function(format!("{name}/probity_miss"), |b| {
            b.iter(|| {
                engine.decision_cache().clear();
                black_box(engine.decide(black_box(&request)))
            })
        });
        group.bench_function(format!("{name}/probity_hit"), |b| {
            b.iter(|| black_box(engine.decide(black_box(&request))))
        });
    }
    // The admission path: the workload under review is a request-scoped entity.
    let workload = json!({"uid": {"type": "Workload", "id": "review/1"},
        "attrs": {"namespace": e("Namespace", "training"), "class": "training", "gpus": 2,
          "cpuMillis": 32_000, "gpuMemoryMiB": 40_000, "image": IMAGE},
        "parents": [{"type": "Namespace", "id": "training"}]});
    let with_entity = Request::from_json_value(&json!({
        "principal": {"type": "Workload", "id": "review/1"}, "action": "schedule",
        "resource": {"type": "Node", "id": "gpu-0001"}, "entities": [workload]}))
    .unwrap();
    assert!(engine.decide(&with_entity).is_allowed());
    group.bench_function(
        "schedule_allow/probity_with_one_request_entity_fresh",
        |b| {
            b.iter(|| {
                black_box(
                    engine
                        .decide_with(
                            std::slice::from_ref(&with_entity),
                            DecideOptions::new().fresh(),
                        )
                        .settle(),
                )
            })
        },
    );
    group.bench_function("schedule_allow/probity_with_one_request_entity_hit", |b| {
        b.iter(|| black_box(engine.decide(black_box(&with_entity))))
    });
    // Nine questions in ten asked before (admission's replicas, agents' repeats), one
    // never seen (a workload of its own).
    let repeated: Vec<Request> = (0..50)
        .map(|i| {
            Request::from_json_value(&json!({
                "principal": {"type": "Workload", "id": format!("wl-{:03}", i % 200)},
                "action": "schedule", "resource": {"type": "Node", "id": format!("gpu-{:04}", (i * 7) % 1000)}}))
            .unwrap()
        })
        .collect();
    let mut n = 0u64;
    group.bench_function("mix_90_percent_repeats/probity", |b| {
        b.iter(|| {
            n += 1;
            if n.is_multiple_of(10) {
                let mut unique = workload.clone();
                unique["uid"]["id"] = json!(format!("review/{n}"));
                let request = Request::from_json_value(&json!({
                    "principal": {"type": "Workload", "id": format!("review/{n}")},
                    "action": "schedule", "resource": {"type": "Node", "id": "gpu-0001"},
                    "entities": [unique]}))
                .unwrap();
                black_box(engine.decide(&request))
            } else {
                black_box(engine.decide(&repeated[(n % 50) as usize]))
            }
        })
    });
    group.finish();
}

/// From the write of a changed probity.toml to the new threshold deciding requests.
fn reload(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(policies_dir().join("."))
        .arg(tmp.path())
        .status()
        .unwrap();
    assert!(status.success());
    let engine = Engine::builder(tmp.path()).build().unwrap();
    let _watcher = engine.watch().unwrap();
    let config_path = tmp.path().join("probity.toml");
    let original = std::fs::read_to_string(&config_path).unwrap();
    let listen = |port: u16| {
        Request::from_json_value(&json!({"principal": "Node::\"n\"", "action": "listen",
            "resource": "Node::\"n\"", "context": {"port": port, "protocol": "tcp"}}))
        .unwrap()
    };
    let mut group = c.benchmark_group("reload");
    group.sample_size(10);
    group.bench_function("write_to_live", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                let port = 10_000 + (i % 2) as u16;
                let text =
                    original.replace("[22, 2379, 2380]", &format!("[22, 2379, 2380, {port}]"));
                let tmp_file = tmp.path().join(".probity.toml.tmp");
                let start = Instant::now();
                std::fs::write(&tmp_file, text).unwrap();
                std::fs::rename(&tmp_file, &config_path).unwrap();
                let deadline = start + Duration::from_secs(10);
                while !engine.decide(&listen(port)).is_allowed() {
                    assert!(Instant::now() < deadline, "reload never went live");
                    std::thread::sleep(Duration::from_micros(200));
                }
                total += start.elapsed();
            }
            total
        })
    });
    group.finish();
}

criterion_group!(benches, decide, reload);

/// `PROBITY_COUNT=<mode>:<n>` runs one way of deciding `n` times and exits, for
/// instruction counts under callgrind (the count at `n` less the count at 0, over `n`):
/// `raw` (`Authorizer::is_authorized`), `fresh`, `miss`, `hit`, `unique` (a workload of
/// its own each time), `write` (an unrelated upsert) and `after_write` (that upsert, then
/// a fresh decision on the new snapshot).
fn count(spec: &str) {
    let (mode, n) = spec.split_once(':').expect("PROBITY_COUNT=<mode>:<n>");
    let n: u64 = n.parse().expect("a count");
    let engine = Engine::builder(policies_dir()).build().unwrap();
    engine.upsert_entities(&cluster(false)).unwrap();
    let (pset, schema, cedar_entities) = raw_cedar(&cluster(true));
    let request = Request::from_json_value(&json!({
        "principal": {"type": "Workload", "id": "wl-001"}, "action": "schedule",
        "resource": {"type": "Node", "id": "gpu-0001"}}))
    .unwrap();
    let raw_request = cedar::Request::new(
        cedar::EntityUid::from_str("Workload::\"wl-001\"").unwrap(),
        cedar::EntityUid::from_str("Action::\"schedule\"").unwrap(),
        cedar::EntityUid::from_str("Node::\"gpu-0001\"").unwrap(),
        cedar::Context::empty(),
        Some(&schema),
    )
    .unwrap();
    let authorizer = cedar::Authorizer::new();
    // Requests with a workload of their own, each different (the admission of a pod
    // never seen), built before counting.
    let unique: Vec<Request> = (0..if mode == "unique" { n } else { 0 })
        .map(|i| {
            Request::from_json_value(&json!({
                "principal": {"type": "Workload", "id": format!("review/{i}")}, "action": "schedule",
                "resource": {"type": "Node", "id": "gpu-0001"},
                "entities": [{"uid": {"type": "Workload", "id": format!("review/{i}")},
                    "attrs": {"namespace": e("Namespace", "training"), "class": "training", "gpus": 1 + i % 4,
                      "cpuMillis": 32_000, "gpuMemoryMiB": 40_000, "image": IMAGE},
                    "parents": [{"type": "Namespace", "id": "training"}]}]}))
            .unwrap()
        })
        .collect();
    let next = std::cell::Cell::new(0usize);
    // Warm: the first decision of each kind pays one-time costs in both.
    black_box(authorizer.is_authorized(&raw_request, &pset, &cedar_entities));
    black_box(engine.decide(&request));
    counted(mode, n, &|| match mode {
        "raw" => {
            black_box(authorizer.is_authorized(black_box(&raw_request), &pset, &cedar_entities));
        }
        "fresh" => {
            black_box(
                engine
                    .decide_with(std::slice::from_ref(&request), DecideOptions::new().fresh())
                    .settle(),
            );
        }
        "miss" => {
            engine.decision_cache().clear();
            black_box(engine.decide(black_box(&request)));
        }
        "hit" => {
            black_box(engine.decide(black_box(&request)));
        }
        // A write (an unrelated entity) makes a new snapshot, with no slice bases:
        // `after_write` less `write` is a fresh decision that cuts its slice whole.
        "write" | "after_write" => {
            let i = next.get();
            next.set(i + 1);
            engine
                .upsert_entities(
                    &json!([{"uid": {"type": "Namespace", "id": format!("churn-{i}")},
                    "attrs": {}, "parents": []}]),
                )
                .expect("an unrelated namespace");
            if mode == "after_write" {
                black_box(
                    engine
                        .decide_with(std::slice::from_ref(&request), DecideOptions::new().fresh())
                        .settle(),
                );
            }
        }
        "unique" => {
            let i = next.get();
            next.set(i + 1);
            black_box(engine.decide(&unique[i % unique.len().max(1)]));
        }
        other => panic!("unknown mode {other}"),
    });
}

/// The counted loop, apart so that callgrind can count it alone
/// (`--toggle-collect='*counted*'`).
#[inline(never)]
fn counted(mode: &str, n: u64, once: &dyn Fn()) {
    assert!(
        [
            "raw",
            "fresh",
            "miss",
            "hit",
            "unique",
            "write",
            "after_write"
        ]
        .contains(&mode),
        "unknown mode {mode}"
    );
    for _ in 0..n {
        once();
    }
}

fn main() {
    if let Ok(spec) = std::env::var("PROBITY_COUNT") {
        count(&spec);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
