//! Plugin calls with a fresh sandbox (Store) per call, beside the same logic as plain
//! Rust; compile-and-load time per plugin; and `decide` with and without plugins.
//!
//! Needs the components: `scripts/build-plugins.sh` first. Run:
//! `cargo bench -p probity --bench plugins` (prints median and p99 of a manual loop
//! of 10,000 calls per plugin before criterion's own figures).

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
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use probity::{Engine, Request};
use probity_plugin_sdk::{MockHost, Plugin};
use serde_json::{Value, json};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn wasm(name: &str) -> PathBuf {
    let p = root().join("target/plugins").join(format!("{name}.wasm"));
    assert!(
        p.is_file(),
        "{} is missing: run scripts/build-plugins.sh first",
        p.display()
    );
    p
}

fn cluster() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(root().join("testdata/entities/cluster.json")).unwrap(),
    )
    .unwrap()
}

fn engine(with_plugins: bool) -> Engine {
    let mut b = Engine::builder(root().join("policies"));
    if with_plugins {
        wasm("power-spike");
        wasm("thermal-headroom");
        b = b.plugins(root().join("testdata/plugins/manifests/examples.toml"));
    }
    let e = b.build().unwrap();
    e.upsert_entities(&cluster()).unwrap();
    e
}

fn readings() -> Value {
    json!([2900, 3010, 2950, 3100, 2990, 3050, 3000, 2980, 3020, 4200])
}

/// As the node agent asks it: power readings are a fact only a reporter supplies.
fn spike_request() -> Request {
    Request::from_json_value(&json!({"principal": "Node::\"gpu-a1\"", "action": "comply",
        "resource": "Node::\"gpu-a1\"", "context": {"powerReadingsW": readings()}}))
    .unwrap()
    .as_fact_reporter()
}

fn headroom_request() -> Request {
    Request::from_json_value(
        &json!({"principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": "Node::\"gpu-hot1\""}),
    )
    .unwrap()
}

/// The same inputs as the plugin sees them, for the native baseline: the request's
/// JSON strings are parsed as the guest SDK parses them.
fn native_spike() -> probity_plugin_sdk::Verdict {
    let context = json!({"powerReadingsW": readings()}).to_string();
    let settings = r#"{"spike_pct":25}"#;
    let r = probity_plugin_sdk::Request::new(r#"Node::"gpu-a1""#, "comply", r#"Node::"gpu-a1""#)
        .with_context(serde_json::from_str(&context).unwrap())
        .with_settings(serde_json::from_str(settings).unwrap());
    power_spike::PowerSpike::evaluate(&r, &MockHost::default())
}

fn native_headroom(entities_json: &str, zones: &MockHost) -> probity_plugin_sdk::Verdict {
    let r = probity_plugin_sdk::Request::new(
        r#"Workload::"train-1""#,
        "schedule",
        r#"Node::"gpu-hot1""#,
    )
    .with_entities(&serde_json::from_str(entities_json).unwrap())
    .with_settings(json!({"watts_per_gpu": 700, "ceiling_pct": 95, "celsius_per_kw": 1}));
    thermal_headroom::ThermalHeadroom::evaluate(&r, zones)
}

/// Median and p99 of `n` timed calls.
fn percentiles(n: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..n / 10 {
        f();
    }
    let mut samples: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    samples.sort();
    (samples[n / 2], samples[n * 99 / 100])
}

fn bench(c: &mut Criterion) {
    let with = engine(true);
    let without = engine(false);
    let spike = spike_request();
    let headroom = headroom_request();
    assert!(
        with.decide_plugin_only("power-spike", &spike)
            .unwrap()
            .reason_ids()
            .any(|r| r == "plugin:power-spike/spike")
    );
    assert!(
        with.decide_plugin_only("thermal-headroom", &headroom)
            .unwrap()
            .reason_ids()
            .any(|r| r == "plugin:thermal-headroom/zone-ceiling")
    );
    assert!(native_spike().is_deny());

    let entities: Vec<Value> = cluster().as_array().unwrap().clone();
    let pick = |ids: &[&str]| -> Value {
        Value::Array(
            entities
                .iter()
                .filter(|e| ids.contains(&e["uid"]["id"].as_str().unwrap()))
                .cloned()
                .collect(),
        )
    };
    let headroom_entities = pick(&["train-1", "gpu-hot1", "zone-hot", "training"]).to_string();
    let zones = MockHost::with_entities(&Value::Array(
        entities
            .iter()
            .filter(|e| e["uid"]["type"] == "Zone")
            .cloned()
            .collect(),
    ));
    assert!(native_headroom(&headroom_entities, &zones).is_deny());

    // Manual loop: median and p99 of 10,000 calls each.
    let n = 10_000;
    // PLUGIN_BENCH_NO_LOOP=1 skips the manual loop (for profiling one criterion bench).
    let manual = std::env::var_os("PLUGIN_BENCH_NO_LOOP").is_none();
    let rows: Vec<(&str, (Duration, Duration))> = if !manual {
        Vec::new()
    } else {
        vec![
            (
                "power-spike, wasm, fresh store",
                percentiles(n, || {
                    black_box(with.decide_plugin_only("power-spike", black_box(&spike)));
                }),
            ),
            (
                "power-spike, wasm, describe only (store + instantiate)",
                percentiles(n, || {
                    black_box(with.describe_plugin("power-spike"));
                }),
            ),
            (
                "power-spike, native",
                percentiles(n, || {
                    black_box(native_spike());
                }),
            ),
            (
                "thermal-headroom, wasm, fresh store",
                percentiles(n, || {
                    black_box(with.decide_plugin_only("thermal-headroom", black_box(&headroom)));
                }),
            ),
            (
                "thermal-headroom, native",
                percentiles(n, || {
                    black_box(native_headroom(&headroom_entities, &zones));
                }),
            ),
            (
                "decide comply, no plugins",
                percentiles(n, || {
                    black_box(without.decide(black_box(&spike)));
                }),
            ),
            (
                "decide comply, with power-spike",
                percentiles(n, || {
                    black_box(with.decide(black_box(&spike)));
                }),
            ),
            (
                "decide listen, plugins on other actions",
                percentiles(n, || {
                    black_box(with.decide(black_box(&listen())));
                }),
            ),
            (
                "decide listen, no plugins",
                percentiles(n, || {
                    black_box(without.decide(black_box(&listen())));
                }),
            ),
        ]
    };
    println!("\nmanual loop, {n} calls each:");
    println!("{:<44} {:>12} {:>12}", "what", "median", "p99");
    for (what, (median, p99)) in &rows {
        println!(
            "{what:<44} {:>10.2}us {:>10.2}us",
            median.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6
        );
    }
    println!();

    let mut g = c.benchmark_group("plugin_call");
    g.bench_function("power-spike/wasm", |b| {
        b.iter(|| with.decide_plugin_only("power-spike", black_box(&spike)))
    });
    g.bench_function("power-spike/native", |b| b.iter(native_spike));
    g.bench_function("thermal-headroom/wasm", |b| {
        b.iter(|| with.decide_plugin_only("thermal-headroom", black_box(&headroom)))
    });
    g.bench_function("thermal-headroom/native", |b| {
        b.iter(|| native_headroom(&headroom_entities, &zones))
    });
    g.finish();

    let mut g = c.benchmark_group("decide");
    let listen = listen();
    g.bench_function("listen/no-plugins", |b| {
        b.iter(|| without.decide(black_box(&listen)))
    });
    g.bench_function("listen/plugins-on-other-actions", |b| {
        b.iter(|| with.decide(black_box(&listen)))
    });
    g.bench_function("comply/no-plugins", |b| {
        b.iter(|| without.decide(black_box(&spike)))
    });
    g.bench_function("comply/power-spike", |b| {
        b.iter(|| with.decide(black_box(&spike)))
    });
    g.finish();

    let mut g = c.benchmark_group("compile_and_load");
    g.sample_size(10);
    for name in ["power-spike", "thermal-headroom"] {
        let bytes = std::fs::read(wasm(name)).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| probity::__compile_plugin_uncached(black_box(&bytes)).unwrap())
        });
    }
    g.finish();
}

fn listen() -> Request {
    Request::from_json_value(&json!({"principal": "Node::\"gpu-a1\"", "action": "listen",
        "resource": "Node::\"gpu-a1\"", "context": {"port": 22, "protocol": "tcp"}}))
    .unwrap()
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
