//! Pods bound per second through the real kube-scheduler, with and without Probity.
//!
//! Two runs on fresh control planes (scripts/build-control-plane.sh; `PROBITY_KUBE_BIN`
//! names its directory), each binding the same pods onto the same nodes:
//!
//! 1. the scheduler alone (no webhooks, no extender);
//! 2. the chart's install: the validating and mutating webhooks and the extender, all
//!    calling one `probity serve` (target/debug or target/release `probity`, beside this
//!    example's binary) that holds every node's facts.
//!
//! Throughput is pods from the first create to the last bind, per second; a pod's latency
//! is from its create returning to its bind being seen (polled every 50 ms). Probity's
//! share is the time its HTTP routes spent (its own histogram sums) per pod, over the
//! median pod latency. The scheduler's and this client's rate limits are raised so that
//! they are not what is measured.
//!
//! ```sh
//! PROBITY_KUBE_BIN=$(bash scripts/build-control-plane.sh) \
//!   cargo run --release -p probity-kube --example scheduling_load -- 1000 1000
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
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use crate::cluster::{ControlPlane, Probity, Scheduler, root};
use crate::install::{gpu_pod, scheduler_config, test_values};

struct Run {
    pods_per_second: f64,
    median_latency: Duration,
    p99_latency: Duration,
    probity_seconds_per_pod: Option<f64>,
}

fn node_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("load-{i:04}")).collect()
}

/// The test cluster's entities without its nodes, plus `names` as healthy A100 nodes in
/// zone-a.
fn entities(names: &[String], dir: &std::path::Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(root().join("testdata/entities/cluster.json")).unwrap();
    let mut all: Vec<Value> = serde_json::from_str(&text).unwrap();
    let template = all
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .unwrap()
        .clone();
    all.retain(|e| e["uid"]["type"] != "Node");
    for name in names {
        let mut node = template.clone();
        node["uid"]["id"] = json!(name);
        node["attrs"]["rack"] = json!(format!("r-{name}"));
        all.push(node);
    }
    let path = dir.join("load-entities.json");
    std::fs::write(&path, serde_json::to_vec(&all).unwrap()).unwrap();
    path
}

async fn add_nodes(plane: &ControlPlane, names: &[String]) {
    let plane_nodes = Arc::new(names.to_vec());
    let mut tasks = Vec::new();
    for worker in 0..16 {
        let names = plane_nodes.clone();
        let kubeconfig = plane.kubeconfig.clone();
        tasks.push(tokio::spawn(async move {
            let cluster = probity_kube::Cluster::from_kubeconfig(&kubeconfig)
                .await
                .unwrap();
            for name in names.iter().skip(worker).step_by(16) {
                cluster::add_node_with(cluster.client(), name, "zone-a", 8, "A100").await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Creates `pods` one-GPU pods from 32 concurrent clients and waits for every bind.
async fn schedule(plane: &ControlPlane, pods: usize) -> (Duration, Vec<Duration>) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..32 {
        let kubeconfig = plane.kubeconfig.clone();
        tasks.push(tokio::spawn(async move {
            let cluster = probity_kube::Cluster::from_kubeconfig(&kubeconfig)
                .await
                .unwrap();
            let api: Api<Pod> = Api::namespaced(cluster.client().clone(), "training");
            let mut created = Vec::new();
            for i in (worker..pods).step_by(32) {
                let name = format!("load-{i:05}");
                let pod: Pod = serde_json::from_value(gpu_pod(&name, "batch", 1, "1")).unwrap();
                api.create(&PostParams::default(), &pod).await.unwrap();
                created.push((name, Instant::now()));
            }
            created
        }));
    }
    let api: Api<Pod> = Api::namespaced(plane.client(), "training");
    let mut created: HashMap<String, Instant> = HashMap::new();
    let mut bound: HashMap<String, Instant> = HashMap::new();
    let mut tasks: Vec<_> = tasks.into_iter().map(Some).collect();
    let deadline = Instant::now() + Duration::from_secs(900);
    while bound.len() < pods {
        assert!(
            Instant::now() < deadline,
            "{} of {pods} bound after 15 minutes",
            bound.len()
        );
        for slot in tasks.iter_mut() {
            if slot.as_ref().is_some_and(|t| t.is_finished()) {
                let t = slot.take().unwrap();
                created.extend(t.await.unwrap());
            }
        }
        let list = api.list(&ListParams::default()).await.unwrap();
        let now = Instant::now();
        for pod in list.items {
            let name = pod.metadata.name.unwrap_or_default();
            if pod.spec.and_then(|s| s.node_name).is_some() {
                bound.entry(name).or_insert(now);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in tasks.into_iter().flatten() {
        created.extend(t.await.unwrap());
    }
    let last = bound.values().max().copied().unwrap();
    let mut latencies: Vec<Duration> = bound
        .iter()
        .map(|(name, at)| at.saturating_duration_since(created[name]))
        .collect();
    latencies.sort();
    (last - started, latencies)
}

fn summarize(pods: usize, total: Duration, latencies: &[Duration], probity: Option<f64>) -> Run {
    Run {
        pods_per_second: pods as f64 / total.as_secs_f64(),
        median_latency: latencies[latencies.len() / 2],
        p99_latency: latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)],
        probity_seconds_per_pod: probity,
    }
}

fn scheduler_alone(plane: &ControlPlane) -> String {
    json!({
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": plane.kubeconfig, "qps": 500, "burst": 1000},
        "leaderElection": {"leaderElect": false},
    })
    .to_string()
}

/// Seconds Probity's HTTP routes spent in all, from its histogram sums.
async fn probity_busy_seconds(probity: &Probity) -> f64 {
    let (_, metrics) = probity.call("GET", "/metrics", &Value::Null).await;
    metrics
        .as_str()
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("probity_http_request_duration_seconds_sum{"))
        .filter(|l| l.contains("/v1/scheduler") || l.contains("/v1/admission"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn run(pods: usize, nodes: usize, with_probity: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::start(dir.path()).await;
    plane.namespace("training").await;
    plane.namespace("probity-system").await;
    let names = node_names(nodes);
    add_nodes(&plane, &names).await;
    let (_probity, _scheduler, busy_before) = if with_probity {
        let probity = Probity::start(&plane, &entities(&names, dir.path())).await;
        let no_nodes: Vec<(String, String, u32, String)> = Vec::new();
        let mut values = test_values(&plane, &probity, &no_nodes);
        values.push(("sidecar.enabled".into(), "false".into()));
        let manifests = plane.render_chart(&values);
        plane
            .cluster
            .apply(&manifests, "probity-system", "probity-load")
            .await
            .unwrap();
        let scheduler = Scheduler::start(&plane, &scheduler_config(&manifests)).await;
        let before = probity_busy_seconds(&probity).await;
        (Some(probity), scheduler, before)
    } else {
        let scheduler = Scheduler::start(&plane, &scheduler_alone(&plane)).await;
        (None, scheduler, 0.0)
    };
    let (total, latencies) = schedule(&plane, pods).await;
    let share = match &_probity {
        Some(p) => Some((probity_busy_seconds(p).await - busy_before) / pods as f64),
        None => None,
    };
    summarize(pods, total, &latencies, share)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("usage: scheduling_load [PODS] [NODES]"))
        .collect();
    let pods = args.first().copied().unwrap_or(1000);
    let nodes = args.get(1).copied().unwrap_or(1000);
    let alone = run(pods, nodes, false).await;
    let probity = run(pods, nodes, true).await;
    println!("{pods} pods onto {nodes} nodes through kube-scheduler v1.36.3");
    for (label, r) in [("scheduler alone", &alone), ("with Probity", &probity)] {
        println!(
            "{label:>16}: {:7.1} pods/s  latency median {:?}  p99 {:?}",
            r.pods_per_second, r.median_latency, r.p99_latency
        );
    }
    println!(
        "ratio (with Probity / alone): {:.2}x",
        probity.pods_per_second / alone.pods_per_second
    );
    if let Some(per_pod) = probity.probity_seconds_per_pod {
        println!(
            "Probity's routes per pod (webhooks + extender): {:.2} ms = {:.1}% of the median pod latency",
            per_pod * 1000.0,
            100.0 * per_pod / probity.median_latency.as_secs_f64()
        );
    }
}
