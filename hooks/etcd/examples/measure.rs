//! Measurements of probity-etcd against a real etcd 3.4 on loopback, started by the test
//! harness (`tests/etcd/harness.rs`).
//!
//! ```text
//! cargo run --release --example measure -- [propagation|watchers|facts|all]
//! ```
//!
//! * propagation: one process puts a key, another process's watch handler receives it;
//!   latency from before the put to the handler's call, over 1,000 writes, against the same
//!   measured with etcd-client's bare watch stream in the same run (interleaved rounds);
//! * watchers: 1,000 watch streams on one prefix in one process, multiplexed over one
//!   HTTP/2 connection; latency from the put to the last watcher's delivery;
//! * facts: 10,000 nodes publishing ~1 KB of facts every 10 s under a lease each = 1,000
//!   puts/s, open loop, single puts against transactions of 10 puts (interleaved rounds);
//!   write latency from the scheduled send time, and etcd's CPU from /proc/<pid>/stat.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use probity_etcd::{EtcdClient, LeaseId, Snapshot, WatchEvent, WatchHandler, WatchMessage};

use harness::{Etcd, cpu_ticks};

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
        "{name:<44} n={:<6} p50={:>9.3} ms  p99={:>9.3} ms  max={:>9.3} ms",
        samples.len(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        samples.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    (p50, p99)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    match args.get(1).map(String::as_str) {
        Some("watch-child") => runtime.block_on(watch_child(&args[2], &args[3])),
        Some("propagation") => runtime.block_on(propagation()),
        Some("watchers") => runtime.block_on(watchers()),
        Some("facts") => runtime.block_on(facts()),
        None | Some("all") => runtime.block_on(async {
            propagation().await;
            watchers().await;
            facts().await;
        }),
        Some(other) => panic!("unknown mode {other:?}"),
    }
}

// ---------------------------------------------------------------- (a) propagation

/// Prints `key unix_nanos` for each event the watcher receives, after `ready`.
struct LinePrinter;

impl WatchHandler for LinePrinter {
    fn reset(&mut self, _snapshot: Snapshot) {
        println!("ready");
    }

    fn apply(&mut self, events: Vec<WatchEvent>, _revision: i64) {
        let t = now_ns();
        let mut out = std::io::stdout().lock();
        for e in events {
            writeln!(out, "{} {t}", e.key()).unwrap();
        }
        out.flush().unwrap();
    }
}

/// The watching process: `ours` (watch_with_resync) or `raw` (etcd-client's stream).
async fn watch_child(mode: &str, endpoint: &str) {
    let limit = Duration::from_secs(120);
    match mode {
        "ours" => {
            let client = EtcdClient::connect(
                probity_etcd::EtcdConfig::new([endpoint]).with_prefix("/bench/"),
            )
            .await
            .unwrap();
            let _watch = client.watch_with_resync("prop/", LinePrinter).unwrap();
            wait_for_stdin_close(limit).await;
        }
        "raw" => {
            let mut client = etcd_client::Client::connect([endpoint], None)
                .await
                .unwrap();
            let mut stream = client
                .watch(
                    "/bench/prop/",
                    Some(etcd_client::WatchOptions::new().with_prefix()),
                )
                .await
                .unwrap();
            // The created response.
            stream.message().await.unwrap();
            println!("ready");
            let end = Instant::now() + limit;
            while Instant::now() < end {
                let Ok(Ok(Some(resp))) =
                    tokio::time::timeout(Duration::from_secs(1), stream.message()).await
                else {
                    continue;
                };
                let t = now_ns();
                let mut out = std::io::stdout().lock();
                for e in resp.events() {
                    let key = e.kv().unwrap().key_str().unwrap();
                    writeln!(out, "{} {t}", key.trim_start_matches("/bench/")).unwrap();
                }
                out.flush().unwrap();
            }
        }
        other => panic!("unknown child mode {other:?}"),
    }
}

async fn wait_for_stdin_close(limit: Duration) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut sink = String::new();
        while std::io::stdin()
            .read_line(&mut sink)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
        let _ = tx.send(());
    });
    let _ = tokio::time::timeout(limit, rx).await;
}

async fn propagation() {
    println!("\n== (a) block propagation: put in this process -> watch handler in another ==");
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let endpoint = etcd.endpoints()[0].clone();
    let writer = etcd.client("/bench/").await;
    let exe = std::env::current_exe().unwrap();
    const ROUNDS: usize = 4;
    const PER_ROUND: usize = 300;
    let mut ours = Vec::new();
    let mut raw = Vec::new();
    let mut acks = Vec::new();
    for round in 0..ROUNDS {
        for mode in ["ours", "raw"] {
            let mut child = Command::new(&exe)
                .args(["watch-child", mode, &endpoint])
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
            let ready = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(ready, "ready");
            for i in 0..PER_ROUND {
                let key = format!("prop/r{round}-{mode}-{i:04}");
                let sent = now_ns();
                let started = Instant::now();
                writer.put(&key, b"blocked".to_vec()).await.unwrap();
                acks.push(started.elapsed());
                let line = rx.recv_timeout(Duration::from_secs(5)).unwrap();
                let (got, t) = line.split_once(' ').unwrap();
                assert_eq!(got, key);
                let t: u128 = t.parse().unwrap();
                let latency = Duration::from_nanos((t.saturating_sub(sent)) as u64);
                if mode == "ours" {
                    ours.push(latency);
                } else {
                    raw.push(latency);
                }
            }
            drop(child.stdin.take());
            let _ = child.wait();
            let _ = reader.join();
        }
    }
    let (o50, o99) = summary("probity-etcd watch_with_resync handler", ours);
    let (r50, r99) = summary("anchor: etcd-client bare watch stream", raw);
    summary("put acknowledged (writer)", acks);
    println!(
        "ratio ours/anchor: p50 {:.2}x  p99 {:.2}x",
        o50.as_secs_f64() / r50.as_secs_f64(),
        o99.as_secs_f64() / r99.as_secs_f64()
    );
}

// ---------------------------------------------------------------- (b) 1,000 watchers

async fn watchers() {
    println!("\n== (b) 1,000 watch streams on one prefix, one process, one HTTP/2 connection ==");
    const WATCHERS: usize = 1000;
    const WRITES: usize = 200;
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let writer = etcd.client("/bench/").await;
    let watch_client = etcd.client("/bench/").await;
    let started = Instant::now();
    // (write index, watcher, arrival)
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let mut streams = Vec::with_capacity(WATCHERS);
    for _ in 0..WATCHERS {
        streams.push(watch_client.watch_prefix("fan/", 0));
    }
    // Each stream is live once etcd has answered it (its created response).
    let deadline = Instant::now() + Duration::from_secs(60);
    while streams
        .iter()
        .any(|s| s.status().since_last_heard.is_none())
    {
        assert!(Instant::now() < deadline, "watchers not created in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "{WATCHERS} watch streams created in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let mut tasks = Vec::new();
    for mut stream in streams {
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(WatchMessage::Events { events, .. }) = stream.next().await {
                let t = Instant::now();
                for e in events {
                    let index: usize = e.key().trim_start_matches("fan/k").parse().unwrap();
                    let _ = tx.send((index, t));
                }
            }
        }));
    }
    drop(tx);
    let mut to_last = Vec::new();
    let mut every = Vec::new();
    for i in 0..WRITES {
        let sent = Instant::now();
        writer
            .put(&format!("fan/k{i}"), b"blocked".to_vec())
            .await
            .unwrap();
        let mut got = 0;
        let mut last = sent;
        while got < WATCHERS {
            let (index, t) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("every watcher in time")
                .unwrap();
            assert_eq!(index, i);
            got += 1;
            every.push(t - sent);
            last = last.max(t);
        }
        to_last.push(last - sent);
    }
    summary("put -> last of 1,000 watchers", to_last);
    summary("put -> each watcher (all deliveries)", every);
    for t in tasks {
        t.abort();
    }
}

// ---------------------------------------------------------------- (c) facts

/// A ~1 KB facts document for `node`.
fn facts_json(node: usize, seq: u64) -> Vec<u8> {
    let mut doc = format!(
        r#"{{"node":"node-{node:05}","seq":{seq},"zone":"z{}","driver":"550.54.15","cuda":"12.4","gpus":["#,
        node % 16
    );
    for g in 0..8 {
        doc.push_str(&format!(
            r#"{{"index":{g},"model":"A100-SXM4-80GB","temp_c":{},"power_w":{},"mem_used_mib":{}}},"#,
            40 + (node + g) % 30,
            250 + (node * 7 + g) % 150,
            (node * 13 + g) % 81920
        ));
    }
    doc.pop();
    doc.push_str(r#"],"pad":""#);
    while doc.len() < 1020 {
        doc.push('x');
    }
    doc.push_str("\"}");
    doc.into_bytes()
}

struct Phase {
    latencies: Vec<Duration>,
    done: usize,
    errors: usize,
    wall: Duration,
    cpu_ticks: u64,
}

async fn facts() {
    println!(
        "\n== (c) facts: 10,000 nodes x ~1 KB every 10 s = 1,000 puts/s under a lease each =="
    );
    const NODES: usize = 10_000;
    const RATE: u64 = 1000;
    const PHASE: Duration = Duration::from_secs(10);
    const ROUNDS: usize = 2;
    const BATCH: usize = 10;
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let pid = etcd.pid(0).unwrap();
    let client = etcd.client("/probity/").await;
    println!("document size: {} bytes", facts_json(1, 1).len());

    // One lease per node, as each agent would hold.
    let started = Instant::now();
    let leases: Arc<Vec<LeaseId>> = {
        let mut set = tokio::task::JoinSet::new();
        let per = NODES / 32;
        for t in 0..32 {
            let client = client.clone();
            set.spawn(async move {
                let mut out = Vec::new();
                for i in 0..per {
                    let lease = client.grant_lease(Duration::from_secs(300)).await.unwrap();
                    out.push((t * per + i, lease.id));
                }
                out
            });
        }
        let mut all = vec![LeaseId(0); NODES];
        while let Some(part) = set.join_next().await {
            for (i, id) in part.unwrap() {
                all[i] = id;
            }
        }
        Arc::new(all)
    };
    println!(
        "granted {NODES} leases in {:.2} s",
        started.elapsed().as_secs_f64()
    );

    let seq = Arc::new(AtomicU64::new(0));
    let mut single = Vec::new();
    let mut batched = Vec::new();
    for _ in 0..ROUNDS {
        single.push(run_phase(&client, &leases, &seq, pid, RATE, PHASE, 1).await);
        batched.push(run_phase(&client, &leases, &seq, pid, RATE, PHASE, BATCH).await);
    }
    let tck = 100.0; // getconf CLK_TCK on Linux
    for (name, phases) in [
        ("single put per fact document", single),
        ("10 puts per transaction", batched),
    ] {
        let done: usize = phases.iter().map(|p| p.done).sum();
        let errors: usize = phases.iter().map(|p| p.errors).sum();
        let wall: f64 = phases.iter().map(|p| p.wall.as_secs_f64()).sum();
        let cpu: u64 = phases.iter().map(|p| p.cpu_ticks).sum();
        let latencies = phases.into_iter().flat_map(|p| p.latencies).collect();
        summary(&format!("{name}: put latency"), latencies);
        println!(
            "    {done} puts in {wall:.1} s = {:.0} puts/s, {errors} errors, etcd CPU {:.0}% of one core",
            done as f64 / wall,
            cpu as f64 / tck / wall * 100.0
        );
    }

    // The ceiling: closed loop, 64 writers, 5 s each way.
    for batch in [1, BATCH] {
        let done = Arc::new(AtomicU64::new(0));
        let end = Instant::now() + Duration::from_secs(5);
        let before = cpu_ticks(pid).unwrap();
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for w in 0..64 {
            let (client, leases, done, seq) =
                (client.clone(), leases.clone(), done.clone(), seq.clone());
            set.spawn(async move {
                let mut n = w;
                while Instant::now() < end {
                    publish(&client, &leases, &seq, n, batch).await.unwrap();
                    done.fetch_add(batch as u64, Ordering::Relaxed);
                    n += 64 * batch;
                }
            });
        }
        while set.join_next().await.is_some() {}
        let wall = t0.elapsed().as_secs_f64();
        let cpu = (cpu_ticks(pid).unwrap() - before) as f64 / tck / wall * 100.0;
        println!(
            "ceiling, 64 writers, {batch} put(s) per request: {:.0} puts/s, etcd CPU {cpu:.0}%",
            done.load(Ordering::Relaxed) as f64 / wall
        );
    }
}

/// Publishes the facts of nodes `first..first + batch` (wrapping) in one request.
async fn publish(
    client: &EtcdClient,
    leases: &[LeaseId],
    seq: &AtomicU64,
    first: usize,
    batch: usize,
) -> Result<i64, probity_etcd::EtcdError> {
    let items: Vec<(String, Vec<u8>, Option<LeaseId>)> = (0..batch)
        .map(|k| {
            let node = (first + k) % leases.len();
            (
                format!("facts/node-{node:05}"),
                facts_json(node, seq.fetch_add(1, Ordering::Relaxed)),
                Some(leases[node]),
            )
        })
        .collect();
    if batch == 1 {
        let (key, value, lease) = items.into_iter().next().unwrap();
        client.put_with_lease(&key, value, lease.unwrap()).await
    } else {
        client.put_many(&items).await
    }
}

/// Open loop: `rate` puts per second for `length`, in requests of `batch` puts, each
/// scheduled at its own time; latency from the scheduled time (no coordinated omission).
async fn run_phase(
    client: &EtcdClient,
    leases: &Arc<Vec<LeaseId>>,
    seq: &Arc<AtomicU64>,
    pid: u32,
    rate: u64,
    length: Duration,
    batch: usize,
) -> Phase {
    let requests = (rate * length.as_secs()) as usize / batch;
    let spacing = Duration::from_secs_f64(batch as f64 / rate as f64);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(512));
    let before = cpu_ticks(pid).unwrap();
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for r in 0..requests {
        let at = t0 + spacing * r as u32;
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        let permit = in_flight.clone().acquire_owned().await.unwrap();
        let (client, leases, seq) = (client.clone(), leases.clone(), seq.clone());
        set.spawn(async move {
            let result = publish(&client, &leases, &seq, r * batch, batch).await;
            drop(permit);
            (at.elapsed(), result.is_ok())
        });
    }
    let mut latencies = Vec::with_capacity(requests);
    let mut errors = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Ok(Some(joined)) = tokio::time::timeout(
        deadline.saturating_duration_since(Instant::now()),
        set.join_next(),
    )
    .await
    {
        let (latency, ok) = joined.unwrap();
        if ok {
            latencies.push(latency);
        } else {
            errors += 1;
        }
    }
    let wall = t0.elapsed();
    let cpu_ticks = cpu_ticks(pid).unwrap() - before;
    Phase {
        done: latencies.len() * batch,
        latencies,
        errors,
        wall,
        cpu_ticks,
    }
}
