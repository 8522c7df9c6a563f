//! The entity store at scale: 110,110 entities (10,000 nodes, 100,000 workloads; see
//! `benches/large/mod.rs`). A one-entity upsert into the large store, and `decide` on
//! the large store beside the same request on the small test store.
//!
//! Run: `cargo bench -p probity --bench store`. The p99 figures and the mixed
//! read/write load come from `cargo run --release -p probity --example large_store`.

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

mod large;

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use probity::{Engine, Request};
use serde_json::json;

fn store(c: &mut Criterion) {
    let big = Engine::builder(large::policies_dir()).build().unwrap();
    big.upsert_entities(&large::store()).unwrap();
    for id in large::blocked_nodes() {
        big.block_node(&id, "bench").unwrap();
    }
    let small = Engine::builder(large::policies_dir()).build().unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(large::policies_dir().join("../testdata/entities/cluster.json"))
            .unwrap(),
    )
    .unwrap();
    small.upsert_entities(&fixture).unwrap();

    let mut group = c.benchmark_group("store");
    let mut i = 0usize;
    group.bench_function("upsert_one_node/large", |b| {
        b.iter(|| {
            i += 1;
            big.upsert_entities(&large::node_update(i % large::NODES, i as i64))
                .unwrap()
        })
    });
    let request = |node: &str| {
        Request::from_json_value(&json!({"principal": {"type": "Workload", "id": "train-1"},
            "action": "schedule", "resource": {"type": "Node", "id": node}}))
        .unwrap()
    };
    let on_small = request("gpu-a1");
    assert!(small.decide(&on_small).is_allowed());
    let on_large = Request::from_json_value(
        &json!({"principal": {"type": "Workload", "id": "wl-000001"},
        "action": "schedule", "resource": {"type": "Node", "id": "gpu-00001"}}),
    )
    .unwrap();
    assert!(
        big.decide(&on_large).is_allowed(),
        "{:?}",
        big.decide(&on_large)
    );
    group.bench_function("decide/small", |b| {
        b.iter(|| black_box(small.decide(black_box(&on_small))))
    });
    group.bench_function("decide/large", |b| {
        b.iter(|| black_box(big.decide(black_box(&on_large))))
    });
    group.finish();
}

criterion_group!(benches, store);
criterion_main!(benches);
