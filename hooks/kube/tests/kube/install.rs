//! One installed cluster: the control plane, the test cluster's nodes as API objects,
//! `probity serve` holding the same nodes' facts, the chart's objects applied
//! server-side (its webhook configurations pointed at that Probity over TLS, with the test
//! CA as caBundle), and kube-scheduler started with the chart's scheduler configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use probity_kube::Manifest;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::cluster::{ControlPlane, Pki, Probity, Scheduler, render_chart, root};
use crate::services::free_port;

/// Namespaces the tests put workloads in (the webhooks select all but kube-system and
/// probity-system).
pub const NAMESPACES: [&str; 3] = ["probity-system", "training", "inference"];

pub struct Installed {
    pub plane: ControlPlane,
    pub probity: Probity,
    pub scheduler: Option<Scheduler>,
    pub manifests: Vec<Manifest>,
    // Last: the directory outlives every process in it.
    _dir: TempDir,
}

/// The values an install on the test control plane sets: Probity at `probity_url` for
/// both the webhooks and the extender, the test CA, the scheduler and the apiserver with
/// client certificates of the names the chart expects, no leader election.
pub fn test_values(
    pki: &Pki,
    kubeconfig: &Path,
    probity_url: &str,
    nodes: &[(String, String, u32, String)],
) -> Vec<(String, String)> {
    let (scheduler_crt, scheduler_key) =
        pki.issue("scheduler-client", "kube-scheduler-probity", None, &[]);
    let (apiserver_crt, apiserver_key) = pki.issue(
        "apiserver-webhook-client",
        "kube-apiserver-probity",
        None,
        &[],
    );
    let mut values: Vec<(String, String)> = vec![
        ("webhook.url".into(), probity_url.to_owned()),
        ("webhook.caBundle".into(), pki.ca_bundle_base64()),
        ("apiserver.configDir".into(), pki.dir.display().to_string()),
        (
            "apiserver.clientCert".into(),
            apiserver_crt.display().to_string(),
        ),
        (
            "apiserver.clientKey".into(),
            apiserver_key.display().to_string(),
        ),
        ("webhook.tls.mode".into(), "provided".into()),
        (
            "scheduler.extender.urlPrefix".into(),
            format!("{probity_url}/v1/scheduler"),
        ),
        (
            "scheduler.extender.tls.caFile".into(),
            pki.ca_file().display().to_string(),
        ),
        (
            "scheduler.extender.tls.certFile".into(),
            scheduler_crt.display().to_string(),
        ),
        (
            "scheduler.extender.tls.keyFile".into(),
            scheduler_key.display().to_string(),
        ),
        (
            "scheduler.clientConnection.kubeconfig".into(),
            kubeconfig.display().to_string(),
        ),
        ("scheduler.clientConnection.qps".into(), "500".into()),
        ("scheduler.clientConnection.burst".into(), "1000".into()),
        ("scheduler.leaderElect".into(), "false".into()),
        // Probity's own etcd in a real install; these tests give Probity its facts from a
        // file, and no pod of the chart starts without a kubelet.
        ("etcd.endpoints[0]".into(), "https://127.0.0.1:2379".into()),
        ("etcd.clientSecret".into(), "probity-etcd-client".into()),
        // The key the sidecars pin (the integrity fixtures' signer).
        (
            "trust.publicKey".into(),
            std::fs::read_to_string(root().join("testdata/integrity/signer-public-key.hex"))
                .unwrap()
                .trim()
                .to_owned(),
        ),
    ];
    // The sidecar's inventory: each node's zone and rack, as the agent reports them.
    for (node, zone, _, _) in nodes {
        values.push((format!("sidecar.agent.inventory.{node}.zone"), zone.clone()));
        values.push((
            format!("sidecar.agent.inventory.{node}.rack"),
            format!("r-{node}"),
        ));
    }
    values
}

/// The test cluster's facts (testdata/entities/cluster.json) as `(node, zone, gpus,
/// model)`.
pub fn test_nodes() -> Vec<(String, String, u32, String)> {
    let text = std::fs::read_to_string(root().join("testdata/entities/cluster.json")).unwrap();
    let entities: Vec<Value> = serde_json::from_str(&text).unwrap();
    entities
        .iter()
        .filter(|e| e["uid"]["type"] == "Node")
        .map(|e| {
            let attrs = &e["attrs"];
            (
                e["uid"]["id"].as_str().unwrap().to_owned(),
                attrs["zone"]["__entity"]["id"].as_str().unwrap().to_owned(),
                attrs["gpuCount"].as_u64().unwrap() as u32,
                attrs["gpuModel"]["__entity"]["id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect()
}

impl Installed {
    /// Everything up, with `entities` as Probity's facts and the nodes of `nodes`.
    pub async fn start_with(
        entities: PathBuf,
        nodes: &[(String, String, u32, String)],
        extra_values: &[(String, String)],
    ) -> Installed {
        let dir = tempfile::tempdir().unwrap();
        // Rendered before the apiserver starts: it reads the chart's admission
        // configuration, which gives it a client certificate for Probity's webhook.
        let pki = Pki::new(dir.path());
        let probity_port = free_port();
        let kubeconfig = dir.path().join("admin.kubeconfig");
        let url = format!("https://127.0.0.1:{probity_port}");
        let mut values = test_values(&pki, &kubeconfig, &url, nodes);
        values.extend_from_slice(extra_values);
        let manifests = render_chart(&values);
        let admission = manifests
            .iter()
            .find(|m| m.kind() == "ConfigMap" && m.name().ends_with("-apiserver-admission"))
            .expect("the chart renders the apiserver's admission configuration");
        for (file, text) in admission.object["data"].as_object().unwrap() {
            std::fs::write(dir.path().join(file), text.as_str().unwrap()).unwrap();
        }
        let admission_config = dir.path().join("admission-config.yaml");
        let plane = ControlPlane::start_with(
            dir.path(),
            pki,
            &[format!(
                "--admission-control-config-file={}",
                admission_config.display()
            )],
        )
        .await;
        assert_eq!(plane.kubeconfig, kubeconfig);
        for namespace in NAMESPACES {
            plane.namespace(namespace).await;
        }
        for (name, zone, gpus, model) in nodes {
            plane.add_node(name, zone, *gpus, model).await;
        }
        let probity = Probity::start_on(&plane, &entities, probity_port).await;
        plane
            .cluster
            .apply(&manifests, "probity-system", "probity-test")
            .await
            .unwrap();
        let config = scheduler_config(&manifests);
        let scheduler = Some(Scheduler::start(&plane, &config).await);
        Installed {
            plane,
            probity,
            scheduler,
            manifests,
            _dir: dir,
        }
    }

    /// The test cluster: testdata/entities/cluster.json, as facts and as nodes, with
    /// gpu-blocked on Probity's blocklist (blocks live in its state, not in the facts).
    pub async fn start() -> Installed {
        let cluster = Installed::start_with(
            root().join("testdata/entities/cluster.json"),
            &test_nodes(),
            &[],
        )
        .await;
        cluster
            .block("gpu-blocked", "failed checkpoint verification")
            .await;
        cluster
    }

    /// Blocks `node` through Probity's API, as an operator would; returns once blocked.
    pub async fn block(&self, node: &str, reason: &str) {
        let (status, body) = self
            .probity
            .call(
                "POST",
                &format!("/v1/nodes/{node}/block"),
                &json!({ "reason": reason }),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }

    /// Stops kube-scheduler by PID: pods created now wait, unscheduled.
    pub fn stop_scheduler(&mut self) {
        self.scheduler = None;
    }

    /// Starts kube-scheduler again with the chart's configuration.
    pub async fn start_scheduler(&mut self) {
        assert!(self.scheduler.is_none(), "kube-scheduler is running");
        let config = scheduler_config(&self.manifests);
        self.scheduler = Some(Scheduler::start(&self.plane, &config).await);
    }

    /// Waits for a FailedScheduling event about `pod` containing `text`: the events.
    pub async fn failed_scheduling(&self, namespace: &str, pod: &str, text: &str) -> Vec<String> {
        self.plane
            .event_about(
                namespace,
                pod,
                &format!("an event about {namespace}/{pod} saying {text:?}"),
                |m| m.contains(text),
            )
            .await;
        self.plane.events_about(namespace, pod).await
    }

    pub fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.plane.client(), namespace)
    }

    /// Creates `pod` in `namespace`: the apiserver's answer.
    pub async fn create_pod(&self, namespace: &str, pod: &Value) -> Result<Pod, kube::Error> {
        let pod: Pod = serde_json::from_value(pod.clone()).unwrap();
        self.pods(namespace)
            .create(&PostParams::default(), &pod)
            .await
    }

    pub async fn delete_pod(&self, namespace: &str, name: &str) {
        self.pods(namespace)
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    /// Where `pod` is bound, waiting up to a minute.
    pub async fn bound(&self, namespace: &str, pod: &str) -> String {
        self.plane
            .bound_node(namespace, pod, Duration::from_secs(60))
            .await
    }
}

/// The KubeSchedulerConfiguration in the chart's scheduler ConfigMap.
pub fn scheduler_config(manifests: &[Manifest]) -> String {
    let map = manifests
        .iter()
        .find(|m| m.kind() == "ConfigMap" && m.name().ends_with("scheduler-config"))
        .expect("the chart renders a scheduler-config ConfigMap");
    map.object["data"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .as_str()
        .unwrap()
        .to_owned()
}

/// A pod asking for `gpus` GPUs and `cpu` CPUs, of workload class `class`.
pub fn gpu_pod(name: &str, class: &str, gpus: u32, cpu: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"probity.io/class": class}},
        "spec": {"containers": [{"name": "main", "image": "trainer:1",
            "resources": {
                "requests": {"nvidia.com/gpu": gpus.to_string(), "cpu": cpu},
                "limits": {"nvidia.com/gpu": gpus.to_string(), "cpu": cpu}}}]}
    })
}

/// The apiserver's refusal: its status code and message.
pub fn refusal(result: Result<Pod, kube::Error>) -> (u16, String) {
    match result {
        Ok(pod) => panic!(
            "the apiserver admitted pod {:?}",
            pod.metadata.name.unwrap_or_default()
        ),
        Err(kube::Error::Api(status)) => (status.code, status.message),
        Err(other) => panic!("not an API refusal: {other}"),
    }
}
