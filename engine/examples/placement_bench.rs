//! The placement figures of BENCHMARKS.md (issue "one home for domain logic"): a
//! scheduler-extender filter of one pod over 1,000 nodes of the large store (10,000
//! nodes, 100,000 workloads), against the same number of single decides.
//!
//! ```sh
//! cargo run --release -p probity --example placement_bench [ROUNDS]
//! ```
//!
//! * `single`: 1,000 dry-run `decide_with` calls, one per node, on one thread (the anchor);
//! * `cold`: `decide_each` over the 1,000 nodes without a cache, on every core: the
//!   target is at most 1.1 x single / cores;
//! * `warm`: `decide_each` with a `DecisionCache` while a writer upserts 100 node-fact
//!   updates per second into those nodes: the target is a median under 2 ms.
//!
//! Medians over ROUNDS (default 30) interleaved rounds.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../benches/large/mod.rs"]
mod large;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use probity::{DecideOptions, DecisionCache, Engine, EntityUid, Request};
use serde_json::json;

const CANDIDATES: usize = 1_000;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(30, |a| a.parse().expect("ROUNDS is a number"));
    let engine = Arc::new(Engine::builder(large::policies_dir()).build().unwrap());
    engine.upsert_entities(&large::store()).unwrap();
    // The pod under review, as the extender translates it: a request entity.
    let pod = json!({"uid": {"type": "Workload", "id": "pod-bench"}, "attrs": {
        "namespace": {"__entity": {"type": "Namespace", "id": "training"}},
        "namespaceMatches": ["training"], "class": "batch", "gpus": 1,
        "cpuMillis": 8000, "gpuMemoryMiB": 0, "image": "trainer:1"},
        "parents": [{"type": "Namespace", "id": "training"}]});
    let nodes: Vec<EntityUid> = (0..CANDIDATES)
        .map(|n| EntityUid::new("Node", &large::node_id(n)).unwrap())
        .collect();
    let request = Request::new(
        EntityUid::new("Workload", "pod-bench").unwrap(),
        EntityUid::action("schedule").unwrap(),
        nodes[0].clone(),
    )
    .with_entities(vec![pod]);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let allowed = engine
        .decide_each(&request, &nodes, None)
        .iter()
        .filter(|d| d.is_allowed())
        .count();
    println!("{CANDIDATES} candidate nodes, {allowed} allowed; {cores} cores");

    // `WARM_ONLY=1` skips the cold rounds, for a profile of the warm path alone.
    let warm_only = std::env::var_os("WARM_ONLY").is_some();
    let (mut single, mut cold) = (Vec::new(), Vec::new());
    for _ in 0..if warm_only { 0 } else { rounds } {
        let t = Instant::now();
        for n in &nodes {
            let one = [request.clone().with_resource(n.clone())];
            std::hint::black_box(
                engine
                    .decide_with(&one, DecideOptions::new().dry_run())
                    .settle(),
            );
        }
        single.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(engine.decide_each(&request, &nodes, None));
        cold.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let single = median(&mut single);
    let cold = median(&mut cold);
    println!(
        "single: {single:.2} ms for {CANDIDATES} decides ({:.1} us each)",
        single * 1e3 / CANDIDATES as f64
    );
    println!(
        "cold decide_each: {cold:.2} ms; ratio to single / {cores} cores: {:.2}",
        cold / (single / cores as f64)
    );

    // Warm: a writer changes 100 nodes' facts per second among the candidates.
    let cache = DecisionCache::with_budget(probity::DecisionCache::DEFAULT_BUDGET_BYTES);
    engine.decide_each(&request, &nodes, Some(&cache));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (engine, stop) = (Arc::clone(&engine), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut i: i64 = 0;
            while !stop.load(Ordering::Relaxed) {
                let n = (i as usize * 7919) % CANDIDATES;
                engine.upsert_entities(&large::node_update(n, i)).unwrap();
                i += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            i
        })
    };
    let mut warm = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while warm.len() < rounds * 10 && Instant::now() < deadline {
        let t = Instant::now();
        std::hint::black_box(engine.decide_each(&request, &nodes, Some(&cache)));
        warm.push(t.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    let updates = writer.join().unwrap();
    let calls = warm.len();
    let warm = median(&mut warm);
    println!(
        "warm decide_each (cache, {updates} updates during {calls} calls): median {warm:.3} ms; hits {} misses {}",
        cache.hits(),
        cache.misses()
    );
}
