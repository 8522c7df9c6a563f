//! Placement through the real kube-scheduler and its extender call to Probity, and the
//! Binding backstop through the real apiserver's admission.

use k8s_openapi::api::core::v1::{Binding, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::install::{Installed, gpu_pod};

/// Nodes Probity refuses for placement in the test cluster, and why.
const REFUSED: [&str; 5] = [
    "gpu-blocked",  // on the blocklist
    "gpu-hot1",     // its zone is at the power ceiling
    "gpu-warm",     // a GPU over the A100's temperature limit
    "gpu-h1",       // the RL-HF zone takes only RL-HF work
    "gpu-oldimage", // a CUDA image below the floor
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eight_gpu_training_pod_binds_only_to_a_node_probity_allows() {
    let cluster = Installed::start().await;
    for i in 0..3 {
        let name = format!("train-{i}");
        cluster
            .create_pod("training", &gpu_pod(&name, "training", 8, "16"))
            .await
            .unwrap();
    }
    let mut bound = vec![
        cluster.bound("training", "train-0").await,
        cluster.bound("training", "train-1").await,
    ];
    bound.sort();
    // Of nine nodes, two take 8-GPU training work: the rest are blocked, in a zone at its
    // power ceiling, over temperature, dedicated to RL-HF, below the CUDA floor, drifted
    // or without GPUs. Eight GPUs each: no node took two.
    assert_eq!(bound, ["gpu-a1", "gpu-spike"]);
    for node in &bound {
        assert!(!REFUSED.contains(&node.as_str()), "{node}");
    }
    // The third has nowhere to go and waits.
    cluster
        .failed_scheduling("training", "train-2", "0/9 nodes are available")
        .await;
    let waiting = cluster.pods("training").get("train-2").await.unwrap();
    assert_eq!(waiting.spec.unwrap().node_name, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rlhf_pod_binds_only_in_the_rlhf_zone_and_waits_with_probitys_reason_when_none_is_free()
{
    let mut cluster = Installed::start().await;
    cluster
        .create_pod("training", &gpu_pod("rlhf-1", "rlhf", 4, "8"))
        .await
        .unwrap();
    assert_eq!(cluster.bound("training", "rlhf-1").await, "gpu-h1");

    // Admitted while gpu-h1 is fine (its affinity allows the RL-HF zone), then gpu-h1 is
    // blocked before the scheduler sees the pod: only the extender's answer stops it.
    cluster.stop_scheduler();
    cluster
        .create_pod("training", &gpu_pod("rlhf-2", "rlhf", 4, "8"))
        .await
        .unwrap();
    cluster.block("gpu-h1", "kube e2e: NVLink errors").await;
    cluster.start_scheduler().await;
    let events = cluster
        .failed_scheduling(
            "training",
            "rlhf-2",
            "a blocked node takes part in this request (security.blocked-node)",
        )
        .await;
    let pod = cluster.pods("training").get("rlhf-2").await.unwrap();
    assert_eq!(
        pod.spec.unwrap().node_name,
        None,
        "rlhf-2 was bound: {events:?}"
    );
}

/// A pod the scheduler leaves alone (its scheduler does not exist), for direct Bindings.
fn unscheduled_pod(name: &str) -> serde_json::Value {
    let mut pod = gpu_pod(name, "training", 8, "16");
    pod["spec"]["schedulerName"] = json!("nobody");
    pod
}

async fn bind(cluster: &Installed, pod: &str, node: &str) -> Result<(), kube::Error> {
    let pods: Api<Pod> = cluster.pods("training");
    let binding: Binding = serde_json::from_value(json!({
        "metadata": {"name": pod},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}
    }))
    .unwrap();
    pods.create_subresource::<Binding, serde_json::Value>(
        "binding",
        pod,
        &PostParams::default(),
        &binding,
    )
    .await
    .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_created_directly_to_a_blocked_node_is_refused_and_to_an_allowed_node_taken() {
    let cluster = Installed::start().await;
    for name in ["direct-1", "direct-2"] {
        cluster
            .create_pod("training", &unscheduled_pod(name))
            .await
            .unwrap();
    }
    let refused = bind(&cluster, "direct-1", "gpu-blocked").await;
    let Err(kube::Error::Api(status)) = refused else {
        panic!("a Binding to gpu-blocked was not refused: {refused:?}");
    };
    assert!(
        status.message.contains("validate.probity.io") && status.message.contains("blocked"),
        "{}",
        status.message
    );
    let pod = cluster.pods("training").get("direct-1").await.unwrap();
    assert_eq!(pod.spec.unwrap().node_name, None);

    bind(&cluster, "direct-2", "gpu-a1").await.unwrap();
    assert_eq!(cluster.bound("training", "direct-2").await, "gpu-a1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_blocked_through_probitys_api_gets_no_new_pod_once_the_block_returns() {
    let cluster = Installed::start().await;
    // Pods are being scheduled while the block is made.
    for i in 0..3 {
        cluster
            .create_pod(
                "training",
                &gpu_pod(&format!("before-{i}"), "batch", 1, "2"),
            )
            .await
            .unwrap();
    }
    cluster.block("gpu-a1", "kube e2e: drain gpu-a1").await;
    // Every pod created after the block returned.
    for i in 0..6 {
        cluster
            .create_pod("training", &gpu_pod(&format!("after-{i}"), "batch", 1, "2"))
            .await
            .unwrap();
    }
    for i in 0..6 {
        let node = cluster.bound("training", &format!("after-{i}")).await;
        assert_ne!(node, "gpu-a1", "after-{i} went to the blocked node");
        assert!(
            !["gpu-blocked", "gpu-hot1"].contains(&node.as_str()),
            "{node}"
        );
    }
}
