//! `probity controller` at cluster scale: block-to-taint latency, taint throughput,
//! evictions per second, and the controller's CPU and memory.
//!
//! One fresh control plane (scripts/build-control-plane.sh; `PROBITY_KUBE_BIN` names its
//! directory) with NODES nodes in 10 zones and PODS pods bound to them (no kubelet: they
//! stay Pending, which is all an eviction needs), `probity serve` and `probity
//! controller run` with its defaults (a pass every 500 ms) but the breaker opened, both
//! `$PROBITY_BIN` else the `probity` of this example's profile. Then:
//!
//! 1. BLOCKS nodes blocked one after another through Probity's API: each block's latency
//!    is from the API's answer to the node's taint seen on a watch of all nodes;
//! 2. 200 nodes blocked at once: the time until every one is tainted;
//! 3. 1,000 pods evicted through `policy/v1` by the controller's own actuator, 8 at a
//!    time: evictions per second against the apiserver's limits;
//! 4. the controller process's CPU seconds and its peak resident memory (VmHWM).
//!
//! ```sh
//! cargo build --release -p probity-cli && cargo build --release -p probity-kube --example controller_load
//! PROBITY_KUBE_BIN=$(bash scripts/build-control-plane.sh) \
//!   target/release/examples/controller_load 1000 10000 100
//! ```

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

#[path = "../../testsupport/services.rs"]
mod services;
#[path = "../../testsupport/tls_client.rs"]
mod tls_client;

#[path = "../tests/kube/cluster.rs"]
mod cluster;
#[path = "../tests/kube/install.rs"]
mod install;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use probity_kube::controller::{Actuator, BlockTaint, KubeActuator, PodRef};
use serde_json::json;

use crate::cluster::{ControlPlane, Probity, root};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// CPU seconds and peak resident KiB of process `pid`.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = stat.rsplit_once(')').unwrap().1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let cpu = (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (cpu, hwm)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let nodes = args.first().copied().unwrap_or(1000);
    let pods = args.get(1).copied().unwrap_or(10_000);
    let blocks = args
        .get(2)
        .copied()
        .unwrap_or(100)
        .min(nodes.saturating_sub(200));
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::start(dir.path()).await;
    plane.namespace("probity-system").await;
    plane.namespace("load").await;
    let started = Instant::now();
    let names: Vec<String> = (0..nodes).map(|i| format!("node-{i:05}")).collect();
    futures::stream::iter(names.iter().enumerate())
        .for_each_concurrent(8, |(i, name)| {
            let client = plane.client();
            async move {
                cluster::add_node_with(
                    &client,
                    name,
                    &format!("zone-{}", i % 10),
                    8,
                    "NVIDIA-A100-SXM4-80GB",
                )
                .await;
            }
        })
        .await;
    eprintln!("{nodes} nodes in {:.1} s", started.elapsed().as_secs_f64());
    let started = Instant::now();
    let pod_api: Api<Pod> = Api::namespaced(plane.client(), "load");
    futures::stream::iter(0..pods)
        .for_each_concurrent(8, |i| {
            let pod_api = pod_api.clone();
            let node = names[i % nodes].clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("p-{i:06}"), "labels": {"app": "load"}},
                    "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x:1"}]}
                }))
                .unwrap();
                pod_api.create(&PostParams::default(), &pod).await.unwrap();
            }
        })
        .await;
    eprintln!("{pods} pods in {:.1} s", started.elapsed().as_secs_f64());

    let probity = Probity::start_on(
        &plane,
        &root().join("testdata/entities/cluster.json"),
        services::free_port(),
    )
    .await;
    let controller = cluster::start_controller(
        &plane,
        &probity,
        "load",
        &[
            "--max-nodes",
            "100000",
            "--interval-ms",
            "500",
            "--lease-seconds",
            "15",
        ],
    );
    let pid = controller.child.id();

    // Every node's first tainted sighting, from one watch of all nodes.
    let tainted: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let node_api: Api<Node> = Api::all(plane.client());
    let version = node_api
        .list(&ListParams::default().limit(1))
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    {
        let tainted = tainted.clone();
        let node_api = node_api.clone();
        tokio::spawn(async move {
            let mut events = node_api
                .watch(&WatchParams::default(), &version)
                .await
                .unwrap()
                .boxed();
            while let Some(Ok(event)) = events.next().await {
                if let WatchEvent::Modified(n) = event {
                    let has = n
                        .spec
                        .as_ref()
                        .and_then(|s| s.taints.as_ref())
                        .is_some_and(|t| t.iter().any(|t| t.key == "probity.io/blocked"));
                    if has {
                        tainted
                            .lock()
                            .unwrap()
                            .entry(n.metadata.name.unwrap())
                            .or_insert_with(Instant::now);
                    }
                }
            }
        });
    }
    let wait_tainted = |name: String| {
        let tainted = tainted.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                if let Some(at) = tainted.lock().unwrap().get(&name) {
                    return *at;
                }
                assert!(Instant::now() < deadline, "{name} never tainted");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    // Warm-up: the controller holds its lease and has listed the nodes.
    probity
        .call(
            "POST",
            "/v1/nodes/node-00000/block",
            &json!({"reason": "warm-up"}),
        )
        .await;
    wait_tainted("node-00000".into()).await;

    let mut latencies = Vec::new();
    for name in names.iter().skip(1).take(blocks) {
        let (status, _) = probity
            .call(
                "POST",
                &format!("/v1/nodes/{name}/block"),
                &json!({"reason": "load"}),
            )
            .await;
        assert_eq!(status, 200);
        let answered = Instant::now();
        let at = wait_tainted(name.clone()).await;
        latencies.push(at.saturating_duration_since(answered).as_secs_f64());
    }
    latencies.sort_by(f64::total_cmp);
    println!(
        "block to taint, {blocks} blocks one at a time, {nodes} nodes, {pods} pods: median {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        percentile(&latencies, 0.5) * 1000.0,
        percentile(&latencies, 0.99) * 1000.0,
        latencies.last().unwrap() * 1000.0
    );

    let burst: Vec<String> = names.iter().skip(1 + blocks).take(200).cloned().collect();
    let started = Instant::now();
    futures::stream::iter(burst.iter())
        .for_each_concurrent(8, |name| {
            let probity = &probity;
            async move {
                probity
                    .call(
                        "POST",
                        &format!("/v1/nodes/{name}/block"),
                        &json!({"reason": "burst"}),
                    )
                    .await;
            }
        })
        .await;
    for name in &burst {
        wait_tainted(name.clone()).await;
    }
    let burst_secs = started.elapsed().as_secs_f64();
    println!(
        "200 nodes blocked at once: all tainted in {burst_secs:.2} s ({:.0} taints/s)",
        200.0 / burst_secs
    );

    let actuator = KubeActuator::new(plane.client(), BlockTaint::default(), "load");
    let evict = pods.min(1000);
    let started = Instant::now();
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    futures::stream::iter(0..evict)
        .for_each_concurrent(8, |i| {
            let actuator = actuator.clone();
            let refused = refused.clone();
            async move {
                let pod = PodRef {
                    namespace: "load".into(),
                    name: format!("p-{i:06}"),
                    uid: None,
                    node: None,
                };
                if actuator.stop_pod(&pod, "load", false).await.is_err() {
                    refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
        .await;
    let evict_secs = started.elapsed().as_secs_f64();
    println!(
        "{evict} evictions, 8 at a time: {:.0} per second ({} refused)",
        evict as f64 / evict_secs,
        refused.load(std::sync::atomic::Ordering::Relaxed)
    );

    let (cpu, hwm) = usage(pid);
    println!(
        "controller: {cpu:.1} CPU seconds over the run, peak resident memory {:.1} MiB",
        hwm as f64 / 1024.0
    );
    drop(controller);
}
