//! Probity down: governed work fails closed (pods in selected namespaces refused, GPU pods
//! wait unscheduled) while the cluster itself keeps running: kube-system pods and
//! Probity's own replacement pods are recreated and scheduled.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchParams};
use serde_json::json;

use crate::cluster::watch_until;
use crate::install::{Installed, gpu_pod, refusal};

/// The first pod matching `selector` in `namespace` that is bound: its name and node.
async fn bound_pod(cluster: &Installed, namespace: &str, selector: &str, not: &str) -> String {
    let pods: Api<Pod> = cluster.pods(namespace);
    watch_until(
        &pods,
        &WatchParams::default().labels(selector),
        &format!("a bound pod {selector} in {namespace} other than {not:?}"),
        Duration::from_secs(60),
        |p: &Pod| {
            let name = p.metadata.name.clone()?;
            let bound = p.spec.as_ref()?.node_name.is_some();
            (bound && name != not).then_some(name)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_probity_down_governed_pods_wait_while_system_and_probitys_own_pods_schedule() {
    let mut cluster = Installed::start().await;
    // A kube-system workload beside Probity's own webhook Deployment (from the chart).
    let system = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "dns", "namespace": "kube-system"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "dns"}},
            "template": {"metadata": {"labels": {"app": "dns"}},
                "spec": {"containers": [{"name": "dns", "image": "coredns:1",
                    "resources": {"requests": {"cpu": "100m"}}}]}}}
    });
    cluster
        .plane
        .wait_for_default_service_account("kube-system")
        .await;
    let manifests = probity_kube::parse_manifests(&system.to_string()).unwrap();
    cluster
        .plane
        .cluster
        .apply(&manifests, "kube-system", "probity-test")
        .await
        .unwrap();
    let webhook_selector = "app.kubernetes.io/component=webhook";
    let webhook_pod = bound_pod(&cluster, "probity-system", webhook_selector, "").await;
    let dns_pod = bound_pod(&cluster, "kube-system", "app=dns", "").await;

    // gpu-h1, the one RL-HF node, is full: rlhf-2 waits for it.
    cluster
        .create_pod("training", &gpu_pod("rlhf-1", "rlhf", 8, "16"))
        .await
        .unwrap();
    assert_eq!(cluster.bound("training", "rlhf-1").await, "gpu-h1");
    cluster
        .create_pod("training", &gpu_pod("rlhf-2", "rlhf", 8, "16"))
        .await
        .unwrap();

    cluster.probity.stop();
    // failurePolicy Fail: a governed namespace admits nothing.
    let (_, message) = refusal(
        cluster
            .create_pod("training", &gpu_pod("while-down", "training", 1, "8"))
            .await,
    );
    assert!(message.contains("failed calling webhook"), "{message}");

    // Room for rlhf-2 appears, but only Probity may say where it goes.
    cluster.delete_pod("training", "rlhf-1").await;
    // The cluster's own pods are recreated and scheduled without Probity.
    cluster.delete_pod("probity-system", &webhook_pod).await;
    cluster.delete_pod("kube-system", &dns_pod).await;
    bound_pod(&cluster, "probity-system", webhook_selector, &webhook_pod).await;
    bound_pod(&cluster, "kube-system", "app=dns", &dns_pod).await;
    // The scheduler has asked the extender for rlhf-2 and failed: it waits.
    cluster
        .plane
        .event_about(
            "training",
            "rlhf-2",
            "the scheduler to report the extender unreachable for rlhf-2",
            |e| e.contains("extender") || e.contains("connection refused"),
        )
        .await;
    let waiting = cluster.pods("training").get("rlhf-2").await.unwrap();
    assert_eq!(
        waiting.spec.unwrap().node_name,
        None,
        "rlhf-2 bound without Probity"
    );

    cluster.probity.restart().await;
    assert_eq!(cluster.bound("training", "rlhf-2").await, "gpu-h1");
    // And admission is back.
    cluster
        .create_pod("training", &gpu_pod("after", "training", 1, "8"))
        .await
        .unwrap();
}
