//! The large store of BENCHMARKS.md (issue "a store that takes a stream of facts"):
//! 10,000 nodes in 100 zones and 100,000 workloads, 110,110 entities in all, made by
//! copying `testdata/entities/cluster.json`'s `gpu-a1` and `train-1` with new ids.
//!
//! ```sh
//! cargo run --release -p probity --example large_store -- write FILE   # the JSON
//! cargo run --release -p probity --example large_store -- lines DIR    # request bodies
//! cargo run --release -p probity --example large_store -- load FILE    # load time, memory
//! cargo run --release -p probity --example large_store -- upserts FILE [N]
//! cargo run --release -p probity --example large_store -- mixed FILE [SECONDS] [ROUNDS] [DECIDERS]
//! cargo run --release -p probity --example large_store -- compare FILE [ROUNDS]
//! ```
//!
//! `upserts` times N one-entity upserts (median, p99); `mixed` measures decisions per
//! second and their p99 on DECIDERS threads (default 2), alone and beside 8 writers
//! pushing 5,000 fact updates per second (each at 625/s, their schedules 200 us apart),
//! in interleaved rounds; with `WAKE_ONLY=1` the writers wake on the same schedule and
//! write nothing, the floor the scheduler alone sets. `compare` times the same decision
//! on the 32-entity test store and on the large one, and the large one's varied mix.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../benches/large/mod.rs"]
mod large;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use probity::{Engine, Request};

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn load(path: &str) -> (Engine, Duration) {
    let engine = Engine::builder(large::policies_dir()).build().unwrap();
    let start = Instant::now();
    let file = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).unwrap());
    let n = engine.upsert_entities_from_reader(file).unwrap();
    let took = start.elapsed();
    assert_eq!(n, large::ENTITIES);
    for id in large::blocked_nodes() {
        engine.block_node(&id, "benchmark").unwrap();
    }
    (engine, took)
}

/// The same decision on the 32-entity test store and on the large one (a copy of the
/// same workload onto a copy of the same node), interleaved: microseconds per decide,
/// medians over the rounds, and their ratio.
fn compare(path: &str, rounds: usize) {
    const CALLS: usize = 20_000;
    let small = Engine::builder(large::policies_dir()).build().unwrap();
    let cluster: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(large::policies_dir().join("../testdata/entities/cluster.json"))
            .unwrap(),
    )
    .unwrap();
    small.upsert_entities(&cluster).unwrap();
    let (big, _) = load(path);
    let request = |principal: &str, node: &str| {
        probity::Request::new(
            probity::EntityUid::new("Workload", principal).unwrap(),
            probity::EntityUid::action("schedule").unwrap(),
            probity::EntityUid::new("Node", node).unwrap(),
        )
    };
    let cases = [
        ("small", &small, request("train-1", "gpu-a1")),
        ("large", &big, request("wl-000007", &large::node_id(13))),
    ];
    for (name, engine, r) in &cases {
        let d = engine.decide(r);
        assert!(d.is_allowed(), "{name}: {d:?}");
    }
    // The mix `mixed` decides: a different workload and node each call, so each
    // decision reads entities that are not in the CPU's caches.
    let varied: Vec<Request> = (0..4096)
        .map(|i| Request::from_json_value(&large::schedule_request(i)).unwrap())
        .collect();
    let names = ["small", "large", "large, 4,096 different requests"];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..rounds {
        for (i, (_, engine, r)) in cases.iter().enumerate() {
            let start = Instant::now();
            for _ in 0..CALLS {
                std::hint::black_box(engine.decide(r));
            }
            times[i].push(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
        }
        let start = Instant::now();
        for r in varied.iter().cycle().take(CALLS) {
            std::hint::black_box(big.decide(r));
        }
        times[2].push(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
    }
    let mut medians = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let t = &mut times[i];
        t.sort_by(f64::total_cmp);
        let m = t[t.len() / 2];
        medians.push(m);
        println!("{name}: {m:.2} us per decide (rounds {t:.2?})");
    }
    println!(
        "large / small: {:.2}; varied / small: {:.2}",
        medians[1] / medians[0],
        medians[2] / medians[0]
    );
}

/// Writer `w`'s updates: each of its 1,000 nodes at two temperatures, so every write
/// changes a fact.
fn writer_updates(w: usize) -> Vec<serde_json::Value> {
    (0..2000usize)
        .map(|i| {
            let node = (w * 1000 + i % 1000) % large::NODES;
            large::node_update(node, (i / 1000) as i64)
        })
        .collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("lines"), Some(dir)) => {
            // For the server's writers benchmark (scripts/bench-writers.sh): the same
            // decisions and node updates `mixed` makes, one JSON body per line.
            let dir = std::path::Path::new(dir);
            let decide: Vec<String> = (0..4096)
                .map(|i| large::schedule_request(i).to_string())
                .collect();
            std::fs::write(dir.join("decide.jsonl"), decide.join("\n")).unwrap();
            let updates: Vec<String> = (0..8usize)
                .flat_map(writer_updates)
                .map(|u| u.to_string())
                .collect();
            std::fs::write(dir.join("updates.jsonl"), updates.join("\n")).unwrap();
            println!("wrote decide.jsonl and updates.jsonl to {}", dir.display());
        }
        (Some("write"), Some(path)) => {
            let text = serde_json::to_vec(&large::store()).unwrap();
            std::fs::write(path, &text).unwrap();
            println!(
                "wrote {} entities, {} bytes, to {path}",
                large::ENTITIES,
                text.len()
            );
        }
        (Some("load"), Some(path)) => {
            let before = status_kb("VmRSS");
            let (engine, took) = load(path);
            // Let the allocator settle, as a server's steady state would.
            std::thread::sleep(Duration::from_millis(500));
            let steady = status_kb("VmRSS");
            let peak = status_kb("VmHWM");
            let per = (steady.saturating_sub(before)) * 1024 / large::ENTITIES as u64;
            println!(
                "load {:.2} s; RSS before {before} KB, steady {steady} KB, peak {peak} KB; {per} B per entity; peak/steady {:.2}",
                took.as_secs_f64(),
                peak as f64 / steady as f64
            );
            assert!(engine.entity_count() >= large::ENTITIES);
        }
        (Some("upserts"), Some(path)) => {
            let n: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10_000);
            let (engine, _) = load(path);
            let mut times = Vec::with_capacity(n);
            for i in 0..n {
                let update = large::node_update(i % large::NODES, i as i64);
                let start = Instant::now();
                engine.upsert_entities(&update).unwrap();
                times.push(start.elapsed());
            }
            times.sort();
            println!(
                "{n} one-entity upserts: median {:?}, p99 {:?}, max {:?}",
                percentile(&times, 0.5),
                percentile(&times, 0.99),
                times.last().unwrap()
            );
        }
        (Some("mixed"), Some(path)) => {
            let seconds: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
            let rounds: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(3);
            let deciders: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(2);
            let (engine, _) = load(path);
            for round in 0..rounds {
                for writers in [false, true] {
                    let span = Duration::from_secs(seconds);
                    let (rate, p99) = mixed(&engine, deciders, writers, span);
                    println!("round {round} writers={writers}: {rate:.0} decisions/s, p99 {p99:?}");
                }
            }
        }
        (Some("compare"), Some(path)) => {
            let rounds: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
            compare(path, rounds);
        }
        _ => {
            eprintln!("usage: large_store write|lines|load|upserts|mixed|compare FILE [...]");
            std::process::exit(2);
        }
    }
}

/// Decisions on `deciders` threads for `span`, with or without 8 writers at 5,000
/// updates/s.
fn mixed(engine: &Engine, deciders: usize, writers: bool, span: Duration) -> (f64, Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let mut writer_threads = Vec::new();
    if writers {
        for w in 0..8usize {
            let engine = engine.clone();
            let stop = Arc::clone(&stop);
            let written = Arc::clone(&written);
            // Made before the clock starts, so the writers' threads spend their CPU on
            // the engine's work, not on building JSON.
            let updates = writer_updates(w);
            let wake_only = std::env::var_os("WAKE_ONLY").is_some();
            let named = std::thread::Builder::new().name(format!("writer-{w}"));
            writer_threads.push(
                named
                    .spawn(move || {
                        // 625 updates/s each: one every 1.6 ms, paced from a schedule that starts
                        // 200 us after the previous writer's, so the 5,000/s arrive evenly, not in
                        // bursts of eight.
                        let start = Instant::now();
                        let mut i = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            let due = start + Duration::from_micros(200 * w as u64 + 1600 * i);
                            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                            if !wake_only {
                                engine
                                    .upsert_entities(&updates[i as usize % updates.len()])
                                    .unwrap();
                            } else {
                                std::hint::black_box(&updates[i as usize % updates.len()]);
                            }
                            written.fetch_add(1, Ordering::Relaxed);
                            i += 1;
                        }
                    })
                    .unwrap(),
            );
        }
    }
    let deciders: Vec<_> = (0..deciders)
        .map(|t| {
            let engine = engine.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut times = Vec::new();
                let mut i = t * 7919;
                while !stop.load(Ordering::Relaxed) {
                    let request = Request::from_json_value(&large::schedule_request(i)).unwrap();
                    let start = Instant::now();
                    std::hint::black_box(engine.decide(&request));
                    times.push(start.elapsed());
                    i += 1;
                }
                times
            })
        })
        .collect();
    std::thread::sleep(span);
    stop.store(true, Ordering::Relaxed);
    let mut times: Vec<Duration> = deciders
        .into_iter()
        .flat_map(|d| d.join().unwrap())
        .collect();
    for w in writer_threads {
        w.join().unwrap();
    }
    if writers {
        let rate = written.load(Ordering::Relaxed) as f64 / span.as_secs_f64();
        eprintln!("  (writers: {rate:.0} updates/s)");
    }
    times.sort();
    (
        times.len() as f64 / span.as_secs_f64(),
        percentile(&times, 0.99),
    )
}
