//! A real control plane with Probity in it, to try by hand: the same etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler the tests run (built by
//! scripts/build-control-plane.sh), nine nodes as API objects (testdata/entities), the
//! chart's webhooks and scheduler configuration pointed at a `probity serve` over TLS on
//! loopback, and gpu-blocked on its blocklist. It prints a kubeconfig to use with the
//! built kubectl, and stops everything by PID at Ctrl-C.
//!
//! ```sh
//! export PROBITY_KUBE_BIN=$(bash scripts/build-control-plane.sh)
//! cargo build -p probity-cli && cargo run -p probity-kube --example try_control_plane
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cluster = install::Installed::start().await;
    let kubeconfig = cluster.plane.kubeconfig.display().to_string();
    let kubectl = cluster::kube_bin("kubectl").display().to_string();
    println!(
        "A control plane is up on loopback, with Probity at {url}.\n\
         In another shell:\n\n  \
         export KUBECONFIG={kubeconfig}\n  \
         alias kubectl={kubectl}\n  \
         kubectl get nodes -L topology.probity.io/zone\n  \
         kubectl -n training run train --image=trainer:1 --labels=probity.io/class=training \\\n    \
         --overrides='{{\"spec\":{{\"containers\":[{{\"name\":\"train\",\"image\":\"trainer:1\",\
         \"resources\":{{\"limits\":{{\"nvidia.com/gpu\":\"8\",\"cpu\":\"16\"}}}}}}]}}}}'\n  \
         kubectl -n training get pod train -o wide     # bound to gpu-a1 or gpu-spike\n  \
         kubectl -n inference run infer --image=server:1 --labels=probity.io/class=inference \\\n    \
         --overrides='{{\"spec\":{{\"containers\":[{{\"name\":\"infer\",\"image\":\"server:1\",\
         \"resources\":{{\"limits\":{{\"nvidia.com/gpu\":\"2\",\"cpu\":\"4\"}}}}}}]}}}}'\n                                                  \
         # refused: 8 CPUs per GPU\n\n\
         Logs: {dir}. Ctrl-C stops every process.",
        url = cluster.probity.url(),
        dir = cluster.plane.dir.display(),
    );
    tokio::signal::ctrl_c().await.unwrap();
    drop(cluster);
}
