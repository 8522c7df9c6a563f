//! The chart installed into a real apiserver: every object applied server-side (so the
//! apiserver's own validation judges it), and every ConfigMap, Secret and ServiceAccount
//! a workload needs exists afterwards, the operator's Secrets included. Without kubelets
//! no pod starts here, so a missing ConfigMap would otherwise go unnoticed.

use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use kube::api::{Api, PostParams};
use probity_kube::{Manifest, mounted_objects};
use serde_json::json;

use crate::cluster::{ControlPlane, render_chart};

/// What the workloads need that the apiserver does not have, as `Kind namespace/name`.
async fn missing(plane: &ControlPlane, manifests: &[Manifest]) -> Vec<String> {
    let mut out = Vec::new();
    for needed in mounted_objects(manifests, "probity-system") {
        let (client, ns, name) = (plane.client(), needed.namespace.as_str(), &needed.name);
        let exists = match needed.kind {
            "ConfigMap" => Api::<ConfigMap>::namespaced(client, ns)
                .get_opt(name)
                .await
                .unwrap()
                .is_some(),
            "Secret" => Api::<Secret>::namespaced(client, ns)
                .get_opt(name)
                .await
                .unwrap()
                .is_some(),
            _ => Api::<ServiceAccount>::namespaced(client, ns)
                .get_opt(name)
                .await
                .unwrap()
                .is_some(),
        };
        if !exists {
            out.push(format!("{} {ns}/{name}", needed.kind));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The Secrets an operator provides (NOTES.txt lists them), as `kubectl create secret`
/// would make them.
async fn create_operator_secret(plane: &ControlPlane, name: &str) {
    let secrets: Api<Secret> = Api::namespaced(plane.client(), "probity-system");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": name},
        "stringData": {"ca.crt": plane.pki.ca_pem, "tls.crt": "operator's", "tls.key": "operator's"}
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

fn values(plane: &ControlPlane, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut values: Vec<(String, String)> = [
        ("webhook.url", "https://127.0.0.1:9"),
        ("etcd.clientSecret", "probity-etcd-client"),
        ("trust.publicKey", "04d6429c7bf1122d66fdf92a95b997c162d5261546b65e470f96ace3fb9d073b688e64db3b2e91d631f3069e0a010d380195f1dd449bdad248ed7bb04e9f448335"),
        ("sidecar.agent.inventory.gpu-a1.zone", "zone-a"),
        ("sidecar.agent.inventory.gpu-a1.rack", "r1"),
        ("scheduler.leaderElect", "false"),
    ]
    .iter()
    .chain(extra)
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    values.push(("webhook.caBundle".into(), plane.pki.ca_bundle_base64()));
    values
}

async fn install_and_check(extra: &[(&str, &str)], operator_secrets: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let plane = ControlPlane::start(dir.path()).await;
    plane.namespace("probity-system").await;
    let manifests = render_chart(&values(&plane, extra));
    let applied = plane
        .cluster
        .apply(&manifests, "probity-system", "helm")
        .await
        .unwrap();
    assert_eq!(applied.len(), manifests.len());

    // Before the operator's part, exactly their Secrets are missing.
    let expected: Vec<String> = operator_secrets
        .iter()
        .map(|s| format!("Secret probity-system/{s}"))
        .collect();
    assert_eq!(missing(&plane, &manifests).await, expected);
    for name in operator_secrets {
        create_operator_secret(&plane, name).await;
    }
    assert_eq!(missing(&plane, &manifests).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_and_every_object_a_workload_needs_exists_but_the_operators_secrets() {
    install_and_check(
        &[("etcd.endpoints[0]", "https://etcd.example:2379")],
        &["probity-etcd-client", "probity-webhook-tls"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_with_bundled_etcd_installs_and_every_object_a_workload_needs_exists() {
    install_and_check(
        &[
            ("etcd.mode", "bundled"),
            ("etcd.bundled.tlsSecret", "probity-etcd-peer"),
        ],
        &[
            "probity-etcd-client",
            "probity-etcd-peer",
            "probity-webhook-tls",
        ],
    )
    .await;
}
