//! Pods bound per second through the real kube-scheduler, with and without Probity.
//!
//! Three runs on fresh control planes (scripts/build-control-plane.sh; `PROBITY_KUBE_BIN`
//! names its directory), each binding the same pods onto the same nodes:
//!
//! 1. the scheduler alone (no webhooks, no extender);
//! 2. the chart's install with its defaults: the validating and mutating webhooks and the
//!    extender (filter and prioritize), all calling one `probity serve` (`$PROBITY_BIN`,
//!    else the `probity` of the same profile as this example) holding every node's facts;
//! 3. the same without the mutating webhook and without prioritize.
//!
//! Throughput is pods from the first create to the last bind, per second; a pod's latency
//! is from its create returning to its bind being seen (polled every 50 ms). Probity's
//! share is the time its HTTP routes spent (its own histogram sums) per pod, over the
//! median pod latency. The scheduler's and this client's rate limits are raised so that
//! they are not what is measured.
//!
//! ```sh
//! cargo build --release -p probity-cli && cargo build --release -p probity-kube --example scheduling_load
//! PROBITY_KUBE_BIN=$(bash scripts/build-control-plane.sh) \
//!   target/release/examples/scheduling_load 1000 1000
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

/// CPU seconds (user + system) each of these processes has used, by command name.
const PROCESSES: [&str; 5] = [
    "kube-apiserver",
    "kube-scheduler",
    "etcd",
    "probity",
    "kube-controller",
];

fn cpu_seconds() -> Vec<f64> {
    let ticks = 100.0; // USER_HZ on Linux
    let mut out = vec![0.0; PROCESSES.len()];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ... utime stime: fields 14 and 15, counted after the comm.
        let Some((comm, rest)) = stat.split_once('(').and_then(|(_, r)| r.rsplit_once(')')) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if let Some(i) = PROCESSES.iter().position(|p| comm.starts_with(p)) {
            let utime: f64 = fields[11].parse().unwrap_or(0.0);
            let stime: f64 = fields[12].parse().unwrap_or(0.0);
            out[i] += (utime + stime) / ticks;
        }
    }
    out
}

struct Run {
    cpu_per_pod: Vec<f64>,
    pods_per_second: f64,
    median_latency: Duration,
    p99_latency: Duration,
    probity_seconds_per_pod: Vec<(String, f64)>,
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

fn summarize(
    pods: usize,
    total: Duration,
    latencies: &[Duration],
    probity: Vec<(String, f64)>,
    cpu: (Vec<f64>, Vec<f64>),
) -> Run {
    Run {
        cpu_per_pod: cpu
            .1
            .iter()
            .zip(&cpu.0)
            .map(|(a, b)| (a - b) / pods as f64)
            .collect(),
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

/// Seconds each of Probity's Kubernetes routes spent in all (its histogram sums).
async fn probity_busy_seconds(probity: &Probity) -> Vec<(String, f64)> {
    let (_, metrics) = probity.call("GET", "/metrics", &Value::Null).await;
    metrics
        .as_str()
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("probity_http_request_duration_seconds_sum{"))
        .filter(|l| l.contains("/v1/scheduler") || l.contains("/v1/admission"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once(' ')?;
            let route = labels.split('"').nth(1)?.to_owned();
            Some((route, value.parse::<f64>().ok()?))
        })
        .collect()
}

/// Seconds per pod each route spent between two readings.
fn per_pod(before: &[(String, f64)], after: &[(String, f64)], pods: usize) -> Vec<(String, f64)> {
    after
        .iter()
        .map(|(route, total)| {
            let earlier = before
                .iter()
                .find(|(r, _)| r == route)
                .map_or(0.0, |(_, t)| *t);
            (route.clone(), (total - earlier) / pods as f64)
        })
        .collect()
}

async fn run(
    pods: usize,
    nodes: usize,
    with_probity: bool,
    probity_values: &[(&str, &str)],
) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::start(dir.path()).await;
    plane.namespace("training").await;
    plane.namespace("probity-system").await;
    let names = node_names(nodes);
    add_nodes(&plane, &names).await;
    let (_probity, _scheduler, busy_before) = if with_probity {
        let probity =
            Probity::start_on(&plane, &entities(&names, dir.path()), services::free_port()).await;
        let no_nodes: Vec<(String, String, u32, String)> = Vec::new();
        let mut values = test_values(&plane.pki, &plane.kubeconfig, &probity.url(), &no_nodes);
        values.push(("sidecar.enabled".into(), "false".into()));
        values.extend(
            probity_values
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        let manifests = cluster::render_chart(&values);
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
        (None, scheduler, Vec::new())
    };
    let cpu_before = cpu_seconds();
    let (total, latencies) = schedule(&plane, pods).await;
    let cpu_after = cpu_seconds();
    let share = match &_probity {
        Some(p) => {
            let (_, metrics) = p.call("GET", "/metrics", &Value::Null).await;
            for line in metrics.as_str().unwrap().lines() {
                if line.starts_with("probity_decision_cache_")
                    || line.starts_with("probity_connections")
                    || line.starts_with("probity_http_responses_total")
                {
                    eprintln!("{line}");
                }
            }
            per_pod(&busy_before, &probity_busy_seconds(p).await, pods)
        }
        None => Vec::new(),
    };
    summarize(pods, total, &latencies, share, (cpu_before, cpu_after))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("usage: scheduling_load [PODS] [NODES]"))
        .collect();
    let pods = args.first().copied().unwrap_or(1000);
    let nodes = args.get(1).copied().unwrap_or(1000);
    let alone = run(pods, nodes, false, &[]).await;
    let probity = run(pods, nodes, true, &[]).await;
    // What an operator can trade: no mutating webhook, no ranking by Probity.
    let filter_only = run(
        pods,
        nodes,
        true,
        &[
            ("webhook.mutate.enabled", "false"),
            ("scheduler.extender.prioritize", "false"),
        ],
    )
    .await;
    let runs = [
        ("scheduler alone", &alone),
        ("with Probity", &probity),
        ("filter only", &filter_only),
    ];
    println!("{pods} pods onto {nodes} nodes through kube-scheduler v1.36.3");
    for (label, r) in runs {
        println!(
            "{label:>16}: {:7.1} pods/s  latency median {:?}  p99 {:?}",
            r.pods_per_second, r.median_latency, r.p99_latency
        );
    }
    for (label, r) in runs {
        let cpu: Vec<String> = PROCESSES
            .iter()
            .zip(&r.cpu_per_pod)
            .map(|(p, s)| format!("{p} {:.2}", s * 1000.0))
            .collect();
        println!("{label:>16}: CPU ms per pod: {}", cpu.join(", "));
    }
    println!(
        "ratio (with Probity / alone): {:.2}x; filter only / alone: {:.2}x",
        probity.pods_per_second / alone.pods_per_second,
        filter_only.pods_per_second / alone.pods_per_second
    );
    for (label, r) in [("with Probity", &probity), ("filter only", &filter_only)] {
        let total: f64 = r.probity_seconds_per_pod.iter().map(|(_, s)| s).sum();
        println!(
            "{label}: Probity's routes per pod: {:.2} ms in all = {:.1}% of the median pod latency",
            total * 1000.0,
            100.0 * total / r.median_latency.as_secs_f64()
        );
        for (route, seconds) in &r.probity_seconds_per_pod {
            println!("  {route:<28} {:7.2} ms", seconds * 1000.0);
        }
    }
}
