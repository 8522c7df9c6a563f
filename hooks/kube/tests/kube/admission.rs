//! Admission through the real kube-apiserver: the chart's webhook configurations call
//! Probity over TLS with the test CA as caBundle, and what the API client sees is the
//! apiserver's answer.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::install::{Installed, gpu_pod, refusal};

const RATIO_MESSAGE: &str =
    "the inference namespace keeps at most 1 GPU per configured number of CPUs";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workloads_are_judged_at_creation_as_the_api_client_sees_it() {
    let cluster = Installed::start().await;

    // An inference pod breaking the 8:1 CPU:GPU rule: 2 GPUs need 16 CPUs.
    let (code, message) = refusal(
        cluster
            .create_pod("inference", &gpu_pod("infer", "inference", 2, "4"))
            .await,
    );
    assert!(
        message.contains("admission webhook \"validate.probity.io\" denied the request")
            && message.contains(RATIO_MESSAGE),
        "{code}: {message}"
    );
    // The same pod within the ratio is admitted, with the mutating webhook's patch applied
    // by the apiserver (a malformed patch would have refused the pod).
    let admitted = cluster
        .create_pod("inference", &gpu_pod("infer-ok", "inference", 2, "16"))
        .await
        .unwrap();
    let affinity = admitted.spec.as_ref().unwrap().affinity.clone();
    assert!(
        affinity.is_some_and(|a| a.node_affinity.is_some()),
        "the mutating webhook's node affinity is missing: {:?}",
        admitted.spec
    );

    // A Deployment whose pod template breaks a rule is refused at creation.
    let deployments: Api<Deployment> = Api::namespaced(cluster.plane.client(), "inference");
    let template = gpu_pod("", "inference", 4, "8");
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "infer-fleet"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "infer"}},
            "template": {"metadata": {"labels": {"app": "infer", "probity.io/class": "inference"}},
                "spec": template["spec"]}}
    }))
    .unwrap();
    let refused = deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains(RATIO_MESSAGE), "{refused}");
    assert!(deployments.get_opt("infer-fleet").await.unwrap().is_none());

    // A ConfigMap is not Probity's: created untouched.
    let maps: Api<ConfigMap> = Api::namespaced(cluster.plane.client(), "inference");
    let map: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "settings"}, "data": {"k": "v"}}))
            .unwrap();
    let created = maps.create(&PostParams::default(), &map).await.unwrap();
    assert_eq!(created.data, map.data);
    assert_eq!(created.metadata.labels, None);
}

/// The decisions in Probity's log (GET /v1/decisions).
async fn records(cluster: &Installed) -> Vec<Value> {
    let (status, body) = cluster
        .probity
        .call("GET", "/v1/decisions?limit=1000", &Value::Null)
        .await;
    assert_eq!(status, 200, "{body}");
    body["records"]
        .as_array()
        .unwrap_or_else(|| panic!("no records array: {body}"))
        .clone()
}

async fn recorded(cluster: &Installed) -> usize {
    records(cluster).await.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_create_is_judged_but_records_nothing() {
    let cluster = Installed::start().await;
    let before = recorded(&cluster).await;
    let pods: Api<Pod> = cluster.pods("inference");
    let pod: Pod = serde_json::from_value(gpu_pod("dry", "inference", 2, "4")).unwrap();
    let dry = pods
        .create(
            &PostParams {
                dry_run: true,
                field_manager: None,
            },
            &pod,
        )
        .await;
    let (_, message) = refusal(dry);
    assert!(message.contains(RATIO_MESSAGE), "{message}");
    assert_eq!(recorded(&cluster).await, before, "a dry run was recorded");
    // The same create for real is recorded: the count above can move.
    let (_, message) = refusal(pods.create(&PostParams::default(), &pod).await);
    assert!(message.contains(RATIO_MESSAGE), "{message}");
    let after = records(&cluster).await;
    assert!(after.len() > before);
    // The apiserver presented the client certificate of the chart's admission
    // configuration: the deny is recorded under its name, not as an anonymous address.
    let deny = after
        .iter()
        .rev()
        .find(|r| r["decision"]["decision"] == "deny")
        .unwrap_or_else(|| panic!("no deny recorded: {after:?}"));
    assert_eq!(deny["caller"], "cn:kube-apiserver-probity", "{deny}");
}

/// A loopback TCP proxy to `target` that holds each connection, forwarding nothing, until
/// the test releases it: a webhook slower than the apiserver's timeoutSeconds, however
/// long that is, with no clock in the test. Released, it forwards the late exchange.
async fn holding_proxy(target: u16) -> (u16, tokio::sync::watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (release, released) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        // Bounded: the apiserver retries a few times at most within one test.
        for _ in 0..64 {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let mut released = released.clone();
            tokio::spawn(async move {
                if released.wait_for(|r| *r).await.is_err() {
                    return;
                }
                if let Ok(mut outbound) =
                    tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
                let _ = inbound.shutdown().await;
            });
        }
    });
    (port, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_answer_slower_than_its_timeout_refuses_the_pod_and_an_unknown_kind_is_allowed() {
    let cluster = Installed::start().await;
    let (proxy, release) = holding_proxy(cluster.probity.port).await;
    let ca_bundle = cluster.plane.pki.ca_bundle_base64();
    let hooks = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "probity-e2e-extra"},
        "webhooks": [
            {
                "name": "slow.probity.io",
                "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                "failurePolicy": "Fail", "timeoutSeconds": 1,
                "clientConfig": {"url": format!("https://127.0.0.1:{proxy}/v1/admission/validate"),
                                 "caBundle": ca_bundle},
                "objectSelector": {"matchLabels": {"probity.io/e2e": "slow"}},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"],
                           "operations": ["CREATE"], "resources": ["pods"]}]
            },
            {
                "name": "unknown-kind.probity.io",
                "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                "failurePolicy": "Fail", "timeoutSeconds": 5,
                "clientConfig": {"url": format!("{}/v1/admission/validate", cluster.probity.url()),
                                 "caBundle": ca_bundle},
                "objectSelector": {"matchLabels": {"probity.io/e2e": "unknown-kind"}},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"],
                           "operations": ["CREATE"], "resources": ["configmaps"]}]
            }
        ]
    });
    let manifests = probity_kube::parse_manifests(&hooks.to_string()).unwrap();
    cluster
        .plane
        .cluster
        .apply(&manifests, "default", "probity-test")
        .await
        .unwrap();

    let mut slow = gpu_pod("slow", "training", 1, "8");
    slow["metadata"]["labels"]["probity.io/e2e"] = json!("slow");
    let (_, message) = refusal(cluster.create_pod("training", &slow).await);
    assert!(
        message.contains("slow.probity.io") && message.contains("failed calling webhook"),
        "{message}"
    );
    assert!(
        cluster
            .pods("training")
            .get_opt("slow")
            .await
            .unwrap()
            .is_none(),
        "a pod whose webhook timed out exists"
    );
    // The answer arrives after the apiserver gave up: it changes nothing.
    release.send(true).unwrap();

    // Probity has no rule for a ConfigMap: `unknown_kinds = "allow"` admits it.
    let maps: Api<ConfigMap> = Api::namespaced(cluster.plane.client(), "training");
    let map: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "odd", "labels": {"probity.io/e2e": "unknown-kind"}},
        "data": {"k": "v"}
    }))
    .unwrap();
    let reviewed = || async {
        let (_, metrics) = cluster.probity.call("GET", "/metrics", &Value::Null).await;
        let line = "probity_admission_reviews_total{endpoint=\"validate\",allowed=\"true\"} ";
        metrics
            .as_str()
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(line))
            .map_or(0, |n| n.trim().parse::<u64>().unwrap())
    };
    let before = reviewed().await;
    maps.create(&PostParams::default(), &map).await.unwrap();
    assert_eq!(
        reviewed().await,
        before + 1,
        "Probity did not review the ConfigMap"
    );
}

/// `kubectl create` of `pod` in `namespace`, as an operator runs it: its exit status and
/// standard error, where kubectl prints the apiserver's warnings ("Warning: ...").
fn kubectl_create(cluster: &Installed, namespace: &str, pod: &Value) -> (bool, String) {
    let mut object = pod.clone();
    object["apiVersion"] = json!("v1");
    object["kind"] = json!("Pod");
    let file = cluster.probity.state_dir.join("../pod.json");
    std::fs::write(&file, object.to_string()).unwrap();
    let out = std::process::Command::new(crate::cluster::kube_bin("kubectl"))
        .arg("--kubeconfig")
        .arg(&cluster.plane.kubeconfig)
        .args(["-n", namespace, "create", "-f"])
        .arg(&file)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until Probity serves `policy` in `mode` (GET /v1/policy/status).
async fn serving_mode(cluster: &Installed, policy: &str, mode: &str) {
    for _ in 0..200 {
        let (_, status) = cluster
            .probity
            .call("GET", "/v1/policy/status", &Value::Null)
            .await;
        let serving = &status["modes"][policy];
        // An enforcing policy is not listed among the modes.
        if (mode == "enforce" && serving.is_null()) || serving["mode"] == mode {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("probity never served {policy} in {mode} mode");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_rolled_out_in_warn_then_audit_mode_admits_and_the_client_sees_the_warning() {
    let mut cluster = Installed::start().await;
    let modes = cluster
        .probity
        .restart_with_modes("\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n")
        .await;
    serving_mode(&cluster, "placement.inference-gpu-cpu-ratio", "warn").await;

    // The pod the rule refuses when it enforces is created, and kubectl shows why it
    // would not have been.
    let (created, stderr) = kubectl_create(
        &cluster,
        "inference",
        &gpu_pod("infer-warned", "inference", 2, "4"),
    );
    assert!(created, "{stderr}");
    assert!(
        stderr.contains("Warning: probity: admit into namespace inference: ")
            && stderr.contains(RATIO_MESSAGE)
            && stderr.contains("(placement.inference-gpu-cpu-ratio, warn mode)"),
        "{stderr}"
    );

    // Lowered again, to audit, by editing the file the server watches: no warning, and
    // the finding is in the decision log.
    modes.set("\"placement.inference-gpu-cpu-ratio\" = \"audit\"\n");
    serving_mode(&cluster, "placement.inference-gpu-cpu-ratio", "audit").await;
    let (created, stderr) = kubectl_create(
        &cluster,
        "inference",
        &gpu_pod("infer-audited", "inference", 2, "4"),
    );
    assert!(created, "{stderr}");
    assert!(!stderr.contains("Warning"), "{stderr}");
    let audited = records(&cluster).await.into_iter().any(|r| {
        r["decision"]["decision"] == "allow"
            && r["decision"]["audit"][0]["policy"] == "placement.inference-gpu-cpu-ratio"
    });
    assert!(audited, "no audit finding recorded");
    // The rule enforcing again refuses the same pod.
    modes.restore();
    serving_mode(&cluster, "placement.inference-gpu-cpu-ratio", "enforce").await;
    let (created, stderr) = kubectl_create(
        &cluster,
        "inference",
        &gpu_pod("infer-refused", "inference", 2, "4"),
    );
    assert!(!created);
    assert!(stderr.contains(RATIO_MESSAGE), "{stderr}");
}
