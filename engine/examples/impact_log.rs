//! Writes a decision log of N records (default 1,000,000) into a state directory, for
//! the `probity policy impact` figure of BENCHMARKS.md: schedules of the test cluster's
//! workloads onto its nodes and inference admissions with a request-scoped workload,
//! each record keeping its request, as the server writes them.
//!
//! ```sh
//! cargo run --release -p probity --example impact_log STATE_DIR [N]
//! ```

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use probity::Decision;
use probity::state::{DecisionRecord, RecordedRequest, StateStore};
use serde_json::json;

/// Records per commit.
const BATCH: usize = 10_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("usage: impact_log STATE_DIR [N]");
    let total: usize = args
        .next()
        .map_or(1_000_000, |n| n.parse().expect("N is a number"));
    let store = StateStore::open(std::path::Path::new(&dir)).unwrap();
    let workloads = ["infer-ok", "infer-greedy", "train-1", "rlhf-1", "cpu-job"];
    let nodes = [
        "gpu-a1",
        "gpu-h1",
        "gpu-hot1",
        "gpu-blocked",
        "gpu-drift",
        "gpu-warm",
        "cpu-1",
    ];
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let allow = serde_json::from_value::<Decision>(
        json!({"decision": "allow", "reasons": [], "obligations": [], "errors": []}),
    )
    .unwrap();
    let start = Instant::now();
    let mut written = 0;
    while written < total {
        let n = BATCH.min(total - written);
        let mut batch: Vec<DecisionRecord> = (0..n)
            .map(|k| {
                let i = written + k;
                let (principal, action, resource, request) = if i % 4 == 3 {
                    let gpus = 1 + (i / 4) % 4;
                    (
                        "Workload::\"inference/pod\"".to_owned(),
                        "Action::\"admit\"".to_owned(),
                        "Namespace::\"inference\"".to_owned(),
                        RecordedRequest {
                            entities: vec![json!({
                                "uid": {"type": "Workload", "id": "inference/pod"},
                                "parents": [{"type": "Namespace", "id": "inference"}],
                                "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "inference"}},
                                          "class": "inference", "gpus": gpus, "cpuMillis": 8000,
                                          "gpuMemoryMiB": 1000, "image": "nvcr.io/nvidia/tritonserver:25.01"}
                            })],
                            ..RecordedRequest::default()
                        },
                    )
                } else {
                    (
                        format!("Workload::\"{}\"", workloads[i % workloads.len()]),
                        "Action::\"schedule\"".to_owned(),
                        format!("Node::\"{}\"", nodes[(i / workloads.len()) % nodes.len()]),
                        RecordedRequest::default(),
                    )
                };
                DecisionRecord {
                    seq: 0,
                    time_unix_ms: now,
                    principal,
                    action,
                    resource,
                    policy_digest: "bench".into(),
                    decision: allow.clone(),
                    caller: None,
                    request: Some(request),
                    sampled: true,
                }
            })
            .collect();
        store.record_decisions(&mut batch).unwrap();
        written += n;
    }
    println!(
        "wrote {written} records in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}
