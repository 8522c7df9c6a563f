//! The control plane itself, before Probity is in it.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::cluster::{ControlPlane, Scheduler};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_pod_binds_to_a_node_object_through_the_real_scheduler() {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::start(dir.path()).await;
    plane.add_node("cpu-1", "zone-a", 0, "").await;
    let config = json!({
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": plane.kubeconfig},
        "leaderElection": {"leaderElect": false},
    });
    let _scheduler = Scheduler::start(&plane, &config.to_string()).await;
    let pods: Api<Pod> = Api::namespaced(plane.client(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"containers": [{"name": "c", "image": "nginx:1",
            "resources": {"requests": {"cpu": "1"}}}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let node = plane
        .bound_node("default", "web", Duration::from_secs(60))
        .await;
    assert_eq!(node, "cpu-1");
}
