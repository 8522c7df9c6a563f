//! Measurements of the engine on etcd ([`probity_etcd::EtcdState`]) against a real etcd
//! 3.4 on loopback, started by the test harness (`tests/etcd/harness.rs`).
//!
//! ```text
//! cargo run --release --example backend_measure -- [propagation|watchers|decisions|all]
//! ```
//!
//! * propagation: an engine in this process blocks a node (`Engine::block_node`, which
//!   returns once its own watch applied it); another process, with an engine on etcd and,
//!   in the same process, a bare probity-etcd watch stream on the blocklist (the anchor),
//!   reports when each sees the block. 300 blocks, one at a time, over 3 rounds.
//! * watchers: 1,000 simulated sidecars in one process: 1,000 `EtcdState`s (each with the
//!   sidecar's three watches: blocklist, registry, its node's facts) sharing one client
//!   (one HTTP/2 connection) and one runtime; a block written by another client, and the
//!   time until each sidecar's change channel delivers it.
//! * decisions: decisions per second on one thread, with and without watch events
//!   arriving (facts of 1,000 nodes and blocks written by another client), interleaved
//!   rounds.
//!
//! Every loop is bounded in count and in time.

// A measurement binary: a failed setup step aborts the run with its message.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../tests/etcd/harness.rs"]
mod harness;

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use probity::state::{SharedState, StateChange, StateStore};
use probity::{Engine, Request};
use probity_etcd::{EtcdClient, EtcdConfig, EtcdState, EtcdStateOptions, Role, WatchMessage};
use serde_json::json;

use harness::Etcd;

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn summary(name: &str, mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let (p50, p99) = (percentile(&samples, 0.50), percentile(&samples, 0.99));
    println!(
        "{name:<52} n={:<6} p50={:>9.3} ms  p99={:>9.3} ms  max={:>9.3} ms",
        samples.len(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        samples.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    (p50, p99)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("follower") => follower(&args[2]),
        Some("propagation") => propagation(),
        Some("watchers") => watchers(),
        Some("decisions") => decisions(),
        None | Some("all") => {
            propagation();
            watchers();
            decisions();
        }
        Some(other) => panic!("unknown mode {other:?}"),
    }
}

// ---------------------------------------------------------------- propagation

/// The other process: an engine on etcd (webhook role) and a bare watch stream; prints
/// `engine <node> <ns>` and `raw <node> <ns>` as each sees a block.
fn follower(endpoint: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = EtcdConfig::new([endpoint]);
    let state = Arc::new(
        EtcdState::open(
            config.clone(),
            dir.path(),
            EtcdStateOptions::new(Role::Webhook, "bench:follower"),
        )
        .unwrap(),
    );
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.attached()).unwrap();
    let rt = runtime();
    let raw_client = rt.block_on(EtcdClient::connect(config)).unwrap();
    let (_, rev) = rt.block_on(raw_client.get("blocklist/")).unwrap();
    let mut stream = {
        let _e = rt.enter();
        raw_client.watch_prefix("blocklist/", rev + 1)
    };
    let done = Arc::new(AtomicBool::new(false));
    let raw = std::thread::spawn({
        let done = Arc::clone(&done);
        move || {
            while !done.load(Ordering::Relaxed) {
                let next = rt.block_on(async {
                    tokio::time::timeout(Duration::from_millis(200), stream.next()).await
                });
                if let Ok(Some(WatchMessage::Events { events, .. })) = next {
                    let t = now_ns();
                    let mut out = std::io::stdout().lock();
                    for e in events {
                        writeln!(out, "raw {} {t}", e.key().trim_start_matches("blocklist/"))
                            .unwrap();
                    }
                    out.flush().unwrap();
                }
            }
        }
    });
    println!("ready");
    std::io::stdout().flush().unwrap();
    // Stdin closes when the parent is done.
    let stdin_closed = Arc::new(AtomicBool::new(false));
    std::thread::spawn({
        let closed = Arc::clone(&stdin_closed);
        move || {
            let mut sink = String::new();
            while std::io::stdin()
                .read_line(&mut sink)
                .map(|n| n > 0)
                .unwrap_or(false)
            {}
            closed.store(true, Ordering::Relaxed);
        }
    });
    let mut seen = std::collections::BTreeSet::new();
    let end = Instant::now() + Duration::from_secs(300);
    while !stdin_closed.load(Ordering::Relaxed) && Instant::now() < end {
        let blocked = engine.blocked_nodes();
        if blocked.len() > seen.len() {
            let t = now_ns();
            let mut out = std::io::stdout().lock();
            for node in blocked.keys() {
                if seen.insert(node.clone()) {
                    writeln!(out, "engine {node} {t}").unwrap();
                }
            }
            out.flush().unwrap();
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    done.store(true, Ordering::Relaxed);
    let _ = raw.join();
}

fn propagation() {
    println!("\n== block propagation: Engine::block_node here -> engine in another process ==");
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let endpoint = etcd.endpoints()[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(
        EtcdState::open(
            EtcdConfig::new([endpoint.clone()]),
            dir.path(),
            EtcdStateOptions::new(
                Role::Sidecar {
                    node: "bench".into(),
                },
                "bench:writer",
            ),
        )
        .unwrap(),
    );
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.attached()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let (mut to_engine, mut to_raw, mut own) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..3 {
        let mut child = Command::new(&exe)
            .args(["follower", &endpoint])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap(), "ready");
        // Let its watches settle.
        std::thread::sleep(Duration::from_millis(500));
        for i in 0..100 {
            let node = format!("r{round}-n{i:03}");
            let sent = now_ns();
            let started = Instant::now();
            engine.block_node(&node, "bench").unwrap();
            own.push(started.elapsed());
            let (mut e, mut r) = (None, None);
            let deadline = Instant::now() + Duration::from_secs(10);
            while (e.is_none() || r.is_none()) && Instant::now() < deadline {
                let Ok(line) = rx.recv_timeout(Duration::from_secs(1)) else {
                    continue;
                };
                let mut parts = line.split_whitespace();
                let (kind, n, t) = (parts.next(), parts.next(), parts.next());
                if n != Some(node.as_str()) {
                    continue;
                }
                let t: u128 = t.unwrap().parse().unwrap();
                let d = Duration::from_nanos(u64::try_from(t.saturating_sub(sent)).unwrap());
                match kind {
                    Some("engine") => e = Some(d),
                    Some("raw") => r = Some(d),
                    _ => {}
                }
            }
            to_engine.push(e.expect("the other engine saw the block"));
            to_raw.push(r.expect("the bare watch saw the block"));
        }
        drop(child.stdin.take());
        let _ = child.wait();
        let _ = reader.join();
    }
    let (e50, e99) = summary("put here -> other process's engine (EtcdState)", to_engine);
    let (r50, r99) = summary("put here -> other process's bare watch (anchor)", to_raw);
    summary("Engine::block_node here (read-your-writes)", own);
    println!(
        "ratio engine/bare watch: p50 {:.2}x, p99 {:.2}x",
        e50.as_secs_f64() / r50.as_secs_f64().max(1e-9),
        e99.as_secs_f64() / r99.as_secs_f64().max(1e-9)
    );
}

// ---------------------------------------------------------------- watchers

fn watchers() {
    const SIDECARS: usize = 1000;
    const BLOCKS: usize = 20;
    println!("\n== {SIDECARS} sidecars (EtcdState, three watches each) on one connection ==");
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let endpoint = etcd.endpoints()[0].clone();
    let client = rt
        .block_on(EtcdClient::connect(EtcdConfig::new([endpoint.clone()])))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let local = Arc::new(StateStore::open(dir.path()).unwrap());
    // (block index, arrival) per sidecar.
    let arrivals: Arc<Mutex<Vec<(usize, u128)>>> = Arc::default();
    let ready = Arc::new(AtomicU64::new(0));
    let mut states = Vec::with_capacity(SIDECARS);
    let mut threads = Vec::with_capacity(SIDECARS);
    let started = Instant::now();
    for i in 0..SIDECARS {
        let state = EtcdState::with_client(
            client.clone(),
            rt.handle().clone(),
            Arc::clone(&local),
            EtcdStateOptions::new(
                Role::Sidecar {
                    node: format!("node-{i:04}"),
                },
                format!("sidecar:node-{i:04}"),
            ),
        )
        .unwrap();
        let rx = state.changes().unwrap();
        let arrivals = Arc::clone(&arrivals);
        let ready = Arc::clone(&ready);
        threads.push(
            std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn(move || {
                    while let Ok(batch) = rx.recv() {
                        let t = now_ns();
                        for change in &batch.changes {
                            match change {
                                StateChange::Resync(_) => {
                                    ready.fetch_add(1, Ordering::Relaxed);
                                }
                                StateChange::Blocked(b) => {
                                    if let Some(n) = b.node.strip_prefix("w") {
                                        arrivals.lock().unwrap().push((n.parse().unwrap(), t));
                                    }
                                }
                                _ => {}
                            }
                        }
                        batch.acknowledge();
                    }
                })
                .unwrap(),
        );
        states.push(state);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while ready.load(Ordering::Relaxed) < SIDECARS as u64 {
        assert!(Instant::now() < deadline, "sidecars not synced");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "{SIDECARS} sidecars synced in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let writer = rt
        .block_on(EtcdClient::connect(EtcdConfig::new([endpoint])))
        .unwrap();
    let mut sent = Vec::new();
    for b in 0..BLOCKS {
        let t = now_ns();
        rt.block_on(writer.put(
            &format!("blocklist/w{b}"),
            br#"{"reason":"bench","since":0}"#.to_vec(),
        ))
        .unwrap();
        sent.push(t);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let n = arrivals
                .lock()
                .unwrap()
                .iter()
                .filter(|(i, _)| *i == b)
                .count();
            if n >= SIDECARS || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let all: Vec<Duration> = arrivals
        .iter()
        .map(|(b, t)| Duration::from_nanos(u64::try_from(t.saturating_sub(sent[*b])).unwrap()))
        .collect();
    let last: Vec<Duration> = (0..BLOCKS)
        .map(|b| {
            arrivals
                .iter()
                .filter(|(i, _)| *i == b)
                .map(|(_, t)| {
                    Duration::from_nanos(u64::try_from(t.saturating_sub(sent[b])).unwrap())
                })
                .max()
                .unwrap_or(Duration::MAX)
        })
        .collect();
    println!("deliveries: {} of {}", arrivals.len(), SIDECARS * BLOCKS);
    summary("put -> each sidecar's change channel", all);
    summary("put -> the last of the sidecars", last);
    drop(states);
    for t in threads {
        let _ = t.join();
    }
}

// ---------------------------------------------------------------- decisions

fn node(id: &str, temp: u64) -> serde_json::Value {
    json!({"uid": {"type": "Node", "id": id}, "parents": [],
        "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z"}}, "rack": "r1", "driverVersion": "",
          "cudaImage": "", "gpuNode": false, "gpuCount": 0, "cpuCount": 64, "gpuMemoryMiB": 0,
          "hottestGpuTempC": temp, "powerDrawW": 300, "powerWindowMeanW": 300}})
}

fn decisions() {
    const ROUNDS: usize = 5;
    const ROUND: Duration = Duration::from_secs(2);
    const EVENTS_PER_SECOND: u64 = 500;
    println!(
        "\n== decisions/s on one thread, with and without watch events ({EVENTS_PER_SECOND}/s) =="
    );
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let endpoint = etcd.endpoints()[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(
        EtcdState::open(
            EtcdConfig::new([endpoint.clone()]),
            dir.path(),
            EtcdStateOptions::new(Role::Webhook, "bench:decider"),
        )
        .unwrap(),
    );
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.attached()).unwrap();
    engine
        .upsert_entities(&json!([
          {"uid": {"type": "Cluster", "id": "c"}, "attrs": {"gpusTotal": 8, "gpusAllocated": 0}, "parents": []},
          {"uid": {"type": "Zone", "id": "z"}, "parents": [],
           "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "c"}}, "powerDrawW": 0, "powerCeilingW": 9000}},
          node("cpu-001", 40)
        ]))
        .unwrap();
    let request = Request::from_json_slice(
        br#"{"principal": "Node::\"cpu-001\"", "action": "listen", "resource": "Node::\"cpu-001\"",
             "context": {"port": 22, "protocol": "tcp"}}"#,
    )
    .unwrap();
    let writer = rt
        .block_on(EtcdClient::connect(EtcdConfig::new([endpoint])))
        .unwrap();
    let written = Arc::new(AtomicU64::new(0));
    let (mut quiet, mut busy) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS * 2 {
        let with_events = round % 2 == 1;
        let stop = Arc::new(AtomicBool::new(false));
        let events = with_events.then(|| {
            let stop = Arc::clone(&stop);
            let writer = writer.clone();
            let written = Arc::clone(&written);
            rt.spawn(async move {
                let gap = Duration::from_nanos(1_000_000_000 / EVENTS_PER_SECOND);
                let mut next = tokio::time::Instant::now();
                let mut k: u64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    next += gap;
                    tokio::time::sleep_until(next).await;
                    k += 1;
                    let id = format!("n-{:04}", k % 1000);
                    let (key, value) = if k.is_multiple_of(50) {
                        (
                            format!("blocklist/{id}"),
                            br#"{"reason":"bench","since":0}"#.to_vec(),
                        )
                    } else {
                        let facts = json!({"node": id, "entities": [node(&id, 40 + k % 30)],
                            "collected_at": 1, "ttl_seconds": 60});
                        (format!("facts/{id}"), serde_json::to_vec(&facts).unwrap())
                    };
                    let w = writer.clone();
                    let written = Arc::clone(&written);
                    tokio::spawn(async move {
                        if w.put(&key, value).await.is_ok() {
                            written.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            })
        });
        let end = Instant::now() + ROUND;
        let mut n = 0u64;
        let t0 = Instant::now();
        while Instant::now() < end {
            for _ in 0..64 {
                std::hint::black_box(engine.decide(&request));
            }
            n += 64;
        }
        let rate = n as f64 / t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        if let Some(task) = events {
            rt.block_on(task).unwrap();
        }
        if with_events {
            busy.push(rate);
        } else {
            quiet.push(rate);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (q, b) = (median(&mut quiet), median(&mut busy));
    println!(
        "decisions/s without events: median {q:.0} ({quiet:.0?})\ndecisions/s with {EVENTS_PER_SECOND} events/s: median {b:.0} ({busy:.0?})\nratio with/without: {:.3}x; events written: {}; nodes in the store: {}",
        b / q,
        written.load(Ordering::Relaxed),
        engine.entities_json(Some("Node")).len()
    );
}
