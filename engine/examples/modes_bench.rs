//! The policy-modes figures of BENCHMARKS.md (issue "rolling out a policy safely"):
//!
//! * `enforcing` against `mixed`: the same requests decided by the default set all
//!   enforcing, and by the same set with three forbids in `audit` mode (each action's
//!   watched forbids evaluated after the decision): the target is at most 1.05x;
//! * `recording`: denies decided and recorded in an on-disk decision log, with each
//!   record keeping its request (context and request entities) against the same without
//!   (`Engine::keep_requests(false)`, the records of before).
//!
//! ```sh
//! cargo run --release -p probity --example modes_bench [ROUNDS]
//! ```
//!
//! Medians over ROUNDS (default 30) interleaved rounds.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use probity::state::StateStore;
use probity::{DecideOptions, Engine, Request};
use serde_json::json;

/// Decisions per round of the decide comparison.
const DECISIONS: usize = 20_000;
/// Recorded decisions per round of the recording comparison.
const RECORDED: usize = 2_000;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn engine(dir: &Path) -> Engine {
    let engine = Engine::builder(dir).build().unwrap();
    let cluster: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root().join("testdata/entities/cluster.json")).unwrap(),
    )
    .unwrap();
    engine.upsert_entities(&cluster).unwrap();
    engine.block_node("gpu-blocked", "bench").unwrap();
    engine
}

/// Schedules of every stored workload onto every node, and inference admissions with a
/// request-scoped workload: what a webhook and an extender ask.
fn requests() -> Vec<Request> {
    let mut out = Vec::new();
    for w in ["infer-ok", "infer-greedy", "train-1", "rlhf-1", "cpu-job"] {
        for n in [
            "gpu-a1",
            "gpu-h1",
            "gpu-hot1",
            "gpu-blocked",
            "gpu-drift",
            "gpu-warm",
            "cpu-1",
        ] {
            out.push(
                Request::from_json_value(&json!({
                    "principal": format!("Workload::\"{w}\""), "action": "schedule",
                    "resource": format!("Node::\"{n}\"")}))
                .unwrap(),
            );
        }
    }
    for gpus in 1..=4 {
        out.push(admission(gpus));
    }
    out
}

fn admission(gpus: u32) -> Request {
    Request::from_json_value(&json!({
        "principal": "Workload::\"inference/pod\"", "action": "admit",
        "resource": "Namespace::\"inference\"",
        "entities": [{"uid": {"type": "Workload", "id": "inference/pod"},
            "parents": [{"type": "Namespace", "id": "inference"}],
            "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "inference"}},
                      "class": "inference", "gpus": gpus, "cpuMillis": 8000,
                      "gpuMemoryMiB": 1000, "image": "nvcr.io/nvidia/tritonserver:25.01"}}]
    }))
    .unwrap()
}

/// Seconds for `DECISIONS` dry-run decisions of `requests`, round robin.
fn decide_round(engine: &Engine, requests: &[Request]) -> f64 {
    let start = Instant::now();
    for i in 0..DECISIONS {
        let r = &requests[i % requests.len()];
        let d = engine
            .decide_with(std::slice::from_ref(r), DecideOptions::new().dry_run())
            .settle();
        std::hint::black_box(d);
    }
    start.elapsed().as_secs_f64()
}

/// Recorded denies per second: `RECORDED` admissions (each a deny with its workload
/// entity) decided and committed, 16 per group.
fn record_round(engine: &Engine) -> f64 {
    let batch: Vec<Request> = (0..16).map(|_| admission(4)).collect();
    let start = Instant::now();
    for _ in 0..RECORDED / batch.len() {
        let d = engine.decide_with(&batch, DecideOptions::new()).settle();
        assert!(d.iter().all(|d| !d.is_allowed() && !d.unrecorded));
    }
    RECORDED as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(30, |a| a.parse().expect("ROUNDS is a number"));
    let tmp = tempfile::tempdir().unwrap();
    let mixed_dir = tmp.path().join("mixed");
    copy_dir(&root().join("policies"), &mixed_dir);
    let config = mixed_dir.join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!(
            "{text}\n[modes]\n\"placement.driver-drift\" = \"audit\"\n\"thermal.zone-power-ceiling\" = \"audit\"\n\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n"
        ),
    )
    .unwrap();
    let enforcing = engine(&root().join("policies"));
    let mixed = engine(&mixed_dir);
    let asked = requests();
    // Warm both.
    decide_round(&enforcing, &asked);
    decide_round(&mixed, &asked);
    let (mut e, mut m, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // Interleaved, the order alternating, so drift in the machine's load hits both.
        let (a, b) = if round % 2 == 0 {
            let a = decide_round(&enforcing, &asked);
            (a, decide_round(&mixed, &asked))
        } else {
            let b = decide_round(&mixed, &asked);
            (decide_round(&enforcing, &asked), b)
        };
        e.push(a * 1e9 / DECISIONS as f64);
        m.push(b * 1e9 / DECISIONS as f64);
        ratio.push(b / a);
    }
    println!(
        "decide: enforcing median {:.0} ns, mixed modes median {:.0} ns, ratio median {:.3}x ({} rounds of {DECISIONS})",
        median(&mut e),
        median(&mut m),
        median(&mut ratio),
        rounds
    );

    let state = tmp.path().join("state");
    let recording = engine(&root().join("policies"));
    recording
        .attach_state(Arc::new(StateStore::open(&state).unwrap()))
        .unwrap();
    let (mut with, mut without, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    let record_rounds = rounds.min(10);
    for round in 0..record_rounds {
        let run = |keep: bool| {
            recording.keep_requests(keep);
            record_round(&recording)
        };
        let (w, o) = if round % 2 == 0 {
            let w = run(true);
            (w, run(false))
        } else {
            let o = run(false);
            (run(true), o)
        };
        with.push(w);
        without.push(o);
        ratio.push(w / o);
    }
    println!(
        "recording: with requests median {:.0} denies/s, without {:.0} denies/s, ratio median {:.3}x ({record_rounds} rounds of {RECORDED})",
        median(&mut with),
        median(&mut without),
        median(&mut ratio)
    );
}
