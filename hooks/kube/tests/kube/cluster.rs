//! A real control plane on loopback, started and stopped by PID: etcd (Debian's
//! etcd-server), kube-apiserver, kube-controller-manager and kube-scheduler built by
//! scripts/build-control-plane.sh, and `probity serve` (the binary `cargo build` made)
//! as their webhook and scheduler extender over TLS. No kubelet runs: nodes are API
//! objects, pods bind and stay Pending, which is all placement and admission need.
//!
//! Every client reaches the apiserver at 127.0.0.1 through a kubeconfig; every wait
//! polls for the state it needs and gives up after a bound.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use probity_kube::{Cluster, Manifest, parse_manifests};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::ServerName;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::services::{Proc, free_port};
use crate::tls_client::tls_client;

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory with kube-apiserver, kube-scheduler, kube-controller-manager, kubectl and
/// helm: `$PROBITY_KUBE_BIN` (scripts/test.sh sets it from scripts/build-control-plane.sh).
pub fn kube_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("PROBITY_KUBE_BIN").unwrap_or_else(|| {
        panic!(
            "PROBITY_KUBE_BIN is not set: run scripts/build-control-plane.sh, which prints the directory"
        )
    });
    let path = Path::new(&dir).join(name);
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// The `probity` binary: `$PROBITY_BIN`, else the one of this build (`cargo build
/// --workspace` made it beside the test).
pub fn probity_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("PROBITY_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("probity");
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build -p probity-cli)",
        path.display()
    );
    path
}

/// Polls a readiness probe `f` every 50 ms until it gives a value; panics naming `what`
/// after `limit`. Only for a process's readiness, which has no event to watch; state in
/// the apiserver is waited for with `watch_until`.
pub async fn poll_ready<T, F: Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the first object of `api` matching `params` for which `ready` gives a value:
/// a list (it may be there already), then a watch from that list's resourceVersion, so
/// each change is seen as the apiserver makes it. Panics naming `what` after `limit`.
pub async fn watch_until<K, T>(
    api: &Api<K>,
    params: &WatchParams,
    what: &str,
    limit: Duration,
    mut ready: impl FnMut(&K) -> Option<T>,
) -> T
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let wait = async {
        loop {
            let list_params = ListParams {
                label_selector: params.label_selector.clone(),
                field_selector: params.field_selector.clone(),
                ..ListParams::default()
            };
            let list = api.list(&list_params).await.unwrap();
            if let Some(v) = list.items.iter().find_map(&mut ready) {
                return v;
            }
            let version = list.metadata.resource_version.unwrap_or_default();
            let mut events = api.watch(params, &version).await.unwrap().boxed();
            // A watch the apiserver ends (expired, compacted, a connection reset under
            // load) is followed by a new list: nothing between the two is missed.
            while let Some(Ok(event)) = events.next().await {
                match event {
                    WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                        if let Some(v) = ready(&o) {
                            return v;
                        }
                    }
                    WatchEvent::Error(_) => break,
                    WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => {}
                }
            }
        }
    };
    tokio::time::timeout(limit, wait)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?} waiting for {what}"))
}

/// The test CA and the certificates it signed, as PEM files in the test's directory.
pub struct Pki {
    pub dir: PathBuf,
    pub ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(dir: &Path) -> Pki {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "probity kube test CA");
        let ca_pem = params.self_signed(&key).unwrap().pem();
        std::fs::write(dir.join("ca.crt"), &ca_pem).unwrap();
        Pki {
            dir: dir.to_owned(),
            ca_pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// Writes `<name>.crt` and `<name>.key`: a certificate for `cn` (organisation `org`
    /// when given: Kubernetes reads it as the group), valid for `sans`.
    pub fn issue(
        &self,
        name: &str,
        cn: &str,
        org: Option<&str>,
        sans: &[&str],
    ) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        if let Some(org) = org {
            params
                .distinguished_name
                .push(DnType::OrganizationName, org);
        }
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (crt, key_path) = (
            self.dir.join(format!("{name}.crt")),
            self.dir.join(format!("{name}.key")),
        );
        std::fs::write(&crt, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (crt, key_path)
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    pub fn ca_bundle_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(&self.ca_pem)
    }
}

/// etcd, kube-apiserver and kube-controller-manager; the scheduler and Probity are
/// started by the test, since their configuration comes from the chart.
pub struct ControlPlane {
    pub dir: PathBuf,
    pub pki: Pki,
    pub kubeconfig: PathBuf,
    pub cluster: Cluster,
    // Dropped (killed) in reverse order of start: fields drop in declaration order.
    _controller_manager: Proc,
    _apiserver: Proc,
    _etcd: Proc,
}

impl ControlPlane {
    pub async fn start(dir: &Path) -> ControlPlane {
        ControlPlane::start_with(dir, Pki::new(dir), &[]).await
    }

    /// With `pki` made beforehand (so that files the apiserver reads can be signed by it)
    /// and `extra_apiserver_args`.
    pub async fn start_with(dir: &Path, pki: Pki, extra_apiserver_args: &[String]) -> ControlPlane {
        let (api_crt, api_key) = pki.issue(
            "apiserver",
            "kube-apiserver",
            None,
            &["127.0.0.1", "localhost", "kubernetes.default.svc"],
        );
        let (admin_crt, admin_key) =
            pki.issue("admin", "probity-test-admin", Some("system:masters"), &[]);
        let sa_key = KeyPair::generate().unwrap();
        std::fs::write(dir.join("sa.key"), sa_key.serialize_pem()).unwrap();
        std::fs::write(dir.join("sa.pub"), sa_key.public_key_pem()).unwrap();

        let (etcd_client, etcd_peer) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let etcd = Proc::spawn(
            "etcd",
            Command::new("etcd")
                .args(["--name", "kube", "--data-dir"])
                .arg(dir.join("etcd"))
                .args(["--listen-client-urls", &etcd_url])
                .args(["--advertise-client-urls", &etcd_url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("kube={peer_url}")])
                .args(["--logger", "zap", "--log-outputs", "stderr"]),
            &dir.join("etcd.log"),
        );

        let api_port = free_port();
        let mut apiserver = Proc::spawn(
            "kube-apiserver",
            Command::new(kube_bin("kube-apiserver"))
                .args(["--etcd-servers", &etcd_url])
                .args([
                    "--bind-address",
                    "127.0.0.1",
                    "--advertise-address",
                    "127.0.0.1",
                ])
                .arg(format!("--secure-port={api_port}"))
                .arg("--tls-cert-file")
                .arg(&api_crt)
                .arg("--tls-private-key-file")
                .arg(&api_key)
                .arg("--client-ca-file")
                .arg(pki.ca_file())
                .args(["--authorization-mode", "Node,RBAC"])
                .args(["--service-account-issuer", "https://kubernetes.default.svc"])
                .arg("--service-account-key-file")
                .arg(dir.join("sa.pub"))
                .arg("--service-account-signing-key-file")
                .arg(dir.join("sa.key"))
                .args(["--service-cluster-ip-range", "10.96.0.0/16"])
                // Loopback is the only address here: nothing may point the `kubernetes`
                // Service's endpoints at it.
                .args(["--endpoint-reconciler-type", "none"])
                .args(["--profiling=false", "--v=1"])
                .args(extra_apiserver_args),
            &dir.join("kube-apiserver.log"),
        );

        let kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(&kubeconfig, api_port, &pki, &admin_crt, &admin_key);
        let cluster = Cluster::from_kubeconfig(&kubeconfig).await.unwrap();
        let client = cluster.client().clone();
        poll_ready("kube-apiserver /readyz", Duration::from_secs(120), || {
            let client = client.clone();
            apiserver.assert_running();
            async move {
                let request = http_get("/readyz");
                client
                    .request_text(request)
                    .await
                    .ok()
                    .filter(|t| t == "ok")
            }
        })
        .await;

        let controller_manager = Proc::spawn(
            "kube-controller-manager",
            Command::new(kube_bin("kube-controller-manager"))
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["--bind-address", "127.0.0.1", "--secure-port=0"])
                .args(["--leader-elect=false", "--v=1"])
                // No kubelet reports here: the node lifecycle controller would taint every
                // node NotReady. On: service accounts (and their tokens), the owners that
                // recreate pods, the garbage collector, disruption budgets, namespaces,
                // DaemonSets (which read taints to choose their nodes).
                .args([
                    "--controllers",
                    "serviceaccount-token-controller,serviceaccount-controller,\
                     replicaset-controller,deployment-controller,job-controller,\
                     daemonset-controller,\
                     garbage-collector-controller,disruption-controller,namespace-controller",
                ])
                .arg("--service-account-private-key-file")
                .arg(dir.join("sa.key"))
                .arg("--root-ca-file")
                .arg(pki.ca_file())
                .arg("--use-service-account-credentials=false"),
            &dir.join("kube-controller-manager.log"),
        );

        let plane = ControlPlane {
            dir: dir.to_owned(),
            pki,
            kubeconfig,
            cluster,
            _controller_manager: controller_manager,
            _apiserver: apiserver,
            _etcd: etcd,
        };
        // Ready for pods: the controller manager gave `default` its ServiceAccount.
        plane.wait_for_default_service_account("default").await;
        plane
    }

    pub fn client(&self) -> kube::Client {
        self.cluster.client().clone()
    }

    pub async fn wait_for_default_service_account(&self, namespace: &str) {
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.client(), namespace);
        watch_until(
            &accounts,
            &WatchParams::default().fields("metadata.name=default"),
            &format!("the default ServiceAccount of {namespace}"),
            Duration::from_secs(60),
            |_| Some(()),
        )
        .await;
    }

    /// Creates namespace `name` and waits for its default ServiceAccount.
    pub async fn namespace(&self, name: &str) {
        let namespaces: Api<Namespace> = Api::all(self.client());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
            )
            .await
            .unwrap();
        self.wait_for_default_service_account(name).await;
    }

    /// A node object as a kubelet would register it: capacity, allocatable, labels, Ready.
    pub async fn add_node(&self, name: &str, zone: &str, gpus: u32, gpu_model: &str) {
        add_node_with(self.cluster.client(), name, zone, gpus, gpu_model).await;
    }

    /// Where a pod is bound (`spec.nodeName`), once it is.
    pub async fn bound_node(&self, namespace: &str, pod: &str, limit: Duration) -> String {
        let pods: Api<Pod> = Api::namespaced(self.client(), namespace);
        watch_until(
            &pods,
            &WatchParams::default().fields(&format!("metadata.name={pod}")),
            &format!("pod {namespace}/{pod} to be bound"),
            limit,
            |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone()),
        )
        .await
    }

    /// Waits for an event about `object` in `namespace` whose message `matches`: the
    /// message.
    pub async fn event_about(
        &self,
        namespace: &str,
        object: &str,
        what: &str,
        matches: impl Fn(&str) -> bool,
    ) -> String {
        let events: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(self.client(), namespace);
        watch_until(
            &events,
            &WatchParams::default().fields(&format!("involvedObject.name={object}")),
            what,
            Duration::from_secs(60),
            |e: &k8s_openapi::api::core::v1::Event| e.message.clone().filter(|m| matches(m)),
        )
        .await
    }

    /// The messages of the events about `object` in `namespace`.
    pub async fn events_about(&self, namespace: &str, object: &str) -> Vec<String> {
        let events: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(self.client(), namespace);
        let params = ListParams::default().fields(&format!("involvedObject.name={object}"));
        events
            .list(&params)
            .await
            .map(|list| {
                list.items
                    .into_iter()
                    .filter_map(|e| e.message)
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    }
}

/// `helm template` of the chart with `values` (`--set` pairs), parsed.
pub fn render_chart(values: &[(String, String)]) -> Vec<Manifest> {
    let mut helm = Command::new(kube_bin("helm"));
    helm.args(["template", "probity"])
        .arg(root().join("hooks/chart/probity"))
        .args(["--namespace", "probity-system"]);
    for (key, value) in values {
        helm.arg("--set").arg(format!("{key}={value}"));
    }
    let out = helm.output().unwrap();
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_manifests(&String::from_utf8(out.stdout).unwrap()).unwrap()
}

/// A node object as a kubelet would register it: capacity, allocatable, labels, Ready.
pub async fn add_node_with(
    client: &kube::Client,
    name: &str,
    zone: &str,
    gpus: u32,
    gpu_model: &str,
) {
    let nodes: Api<Node> = Api::all(client.clone());
    let resources = json!({"cpu": "64", "memory": "512Gi", "pods": "110",
        "nvidia.com/gpu": gpus.to_string()});
    let mut labels = json!({
        "kubernetes.io/hostname": name,
        "topology.kubernetes.io/zone": zone,
        "topology.probity.io/zone": zone,
    });
    if gpus > 0 {
        labels["nvidia.com/gpu.product"] = json!(gpu_model);
        labels["nvidia.com/gpu.count"] = json!(gpus.to_string());
    }
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "a test node: no kubelet runs"}]
        }
    }))
    .unwrap();
    let created = nodes.create(&PostParams::default(), &node).await.unwrap();
    // The apiserver's TaintNodesByCondition admission taints a new node not-ready; the
    // node lifecycle controller, off here, would lift it when the kubelet reports.
    if created
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some()
    {
        let untaint = json!({"spec": {"taints": null}});
        nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&untaint))
            .await
            .unwrap();
    }
    // The create kept the status only if the apiserver took it; else set it.
    if created
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .is_none()
    {
        let status = json!({"status": node.status});
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }
}

impl Drop for ControlPlane {
    /// A failing test shows the end of every process's log.
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log_tails(&self.dir);
        }
    }
}

/// `probity controller run` as `identity` against `plane` and `probity`, with `extra`
/// flags, and unless they set them a short lease, a pass every 100 ms, and the breaker's
/// pool share is opened to 100% (its default, 10%
/// of a pool but at least a node, would stop the second block in these small pools); the
/// breaker's own test sets its limits.
pub fn start_controller(
    plane: &ControlPlane,
    probity: &Probity,
    identity: &str,
    extra: &[&str],
) -> Proc {
    let (crt, key) = plane.pki.issue(
        &format!("controller-{identity}"),
        "probity-controller",
        None,
        &[],
    );
    let mut command = Command::new(probity_bin());
    command
        .args(["controller", "run", "--kubeconfig"])
        .arg(&plane.kubeconfig)
        .args(["--probity-url", &probity.url(), "--probity-ca"])
        .arg(plane.pki.ca_file())
        .arg("--probity-cert")
        .arg(crt)
        .arg("--probity-key")
        .arg(key)
        .args(["--namespace", "probity-system", "--identity", identity])
        .args(extra);
    for (flag, value) in [
        ("--lease-seconds", "2"),
        ("--interval-ms", "100"),
        ("--max-percent", "100"),
    ] {
        if !extra.contains(&flag) {
            command.args([flag, value]);
        }
    }
    Proc::spawn(
        "probity controller",
        &mut command,
        &plane.dir.join(format!("controller-{identity}.log")),
    )
}

/// The last 30 lines of each `*.log` under `dir` (one level of subdirectories too).
pub fn print_log_tails(dir: &Path) {
    let mut logs = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            for inner in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                logs.push(inner.path());
            }
        } else {
            logs.push(path);
        }
    }
    logs.retain(|p| p.extension().is_some_and(|e| e == "log"));
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        eprintln!("--- {} ---\n{tail}", log.display());
    }
}

fn http_get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path).body(Vec::new()).unwrap()
}

fn write_kubeconfig(path: &Path, port: u16, pki: &Pki, crt: &Path, key: &Path) {
    let b64 =
        |p: &Path| base64::engine::general_purpose::STANDARD.encode(std::fs::read(p).unwrap());
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "test", "cluster": {
            "server": format!("https://127.0.0.1:{port}"),
            "certificate-authority-data": pki.ca_bundle_base64()}}],
        "users": [{"name": "admin", "user": {
            "client-certificate-data": b64(crt), "client-key-data": b64(key)}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    });
    // JSON is YAML: every kubeconfig reader takes it.
    std::fs::write(path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

/// kube-scheduler with the chart's KubeSchedulerConfiguration, its extender pointed at
/// `extender_url` (or none, for the run without Probity).
pub struct Scheduler {
    proc: Proc,
}

impl Scheduler {
    pub async fn start(plane: &ControlPlane, config_yaml: &str) -> Scheduler {
        let config = plane.dir.join("scheduler-config.yaml");
        std::fs::write(&config, config_yaml).unwrap();
        let (crt, key) =
            plane
                .pki
                .issue("scheduler-serving", "kube-scheduler", None, &["127.0.0.1"]);
        let port = free_port();
        let proc = Proc::spawn(
            "kube-scheduler",
            Command::new(kube_bin("kube-scheduler"))
                .arg("--config")
                .arg(&config)
                .args(["--bind-address", "127.0.0.1"])
                .arg(format!("--secure-port={port}"))
                .arg("--tls-cert-file")
                .arg(&crt)
                .arg("--tls-private-key-file")
                .arg(&key)
                .arg("--v=2"),
            &plane.dir.join("kube-scheduler.log"),
        );
        let mut scheduler = Scheduler { proc };
        let connector = tls_client(&plane.pki.ca_pem, None);
        // /readyz is open to anyone (the scheduler's always-allowed paths).
        poll_ready("kube-scheduler /readyz", Duration::from_secs(60), || {
            scheduler.proc.assert_running();
            let connector = connector.clone();
            async move {
                let (status, body) = https(port, &connector, "GET", "/readyz", "").await.ok()?;
                (status == 200 && body == "ok").then_some(())
            }
        })
        .await;
        scheduler
    }
}

/// `probity serve` over TLS on loopback with the test CA's certificate, the default
/// policies and the test cluster's facts, mTLS optional (the apiserver and scheduler
/// call as anonymous; the test calls as `cn:probity-test-admin`, an admin).
pub struct Probity {
    pub port: u16,
    pub state_dir: PathBuf,
    /// The policy set served (the repository's `policies/`; a test may point it at an
    /// edited copy before a restart).
    pub policies: PathBuf,
    /// The data root verified reads are allowed under.
    pub data_dir: PathBuf,
    config: PathBuf,
    entities: PathBuf,
    dir: PathBuf,
    /// Trusts the test CA, with no client certificate (probes) and as the admin.
    anonymous: tokio_rustls::TlsConnector,
    admin: tokio_rustls::TlsConnector,
    proc: Option<Proc>,
}

impl Probity {
    /// On loopback port `port`, chosen beforehand (the chart names it).
    pub async fn start_on(plane: &ControlPlane, entities: &Path, port: u16) -> Probity {
        let dir = plane.dir.join("probity");
        std::fs::create_dir_all(&dir).unwrap();
        let (crt, key) = plane.pki.issue(
            "probity",
            "probity-webhook",
            None,
            &["127.0.0.1", "localhost"],
        );
        let (admin_crt, admin_key) =
            plane
                .pki
                .issue("probity-admin", "probity-test-admin", None, &[]);
        let state_dir = dir.join("state");
        std::fs::create_dir_all(&state_dir).unwrap();
        std::fs::set_permissions(
            &state_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        // Verified reads: objects under `data/`, manifests signed by the integrity
        // fixtures' signer (testdata/integrity), whose key the state directory pins.
        let data = dir.join("data");
        std::fs::create_dir_all(&data).unwrap();
        std::fs::copy(
            root().join("testdata/integrity/signer-public-key.hex"),
            state_dir.join("trusted.pub"),
        )
        .unwrap();
        let config = dir.join("probity-server.toml");
        std::fs::write(
            &config,
            format!(
                "[integrity]\ndata_roots = [{data:?}]\n\
                 [server]\nsocket = \"\"\nlisten = \"127.0.0.1:{port}\"\ntls_cert = {crt:?}\n\
                 tls_key = {key:?}\nclient_ca = {ca:?}\nclient_auth = \"optional\"\n\
                 [auth.groups]\nadmins = [\"cn:probity-test-admin\"]\n\
                 event-recorders = [\"cn:probity-controller\"]\n\
                 cluster-reporters = [\"cn:probity-controller\"]\n",
                ca = plane.pki.ca_file(),
            ),
        )
        .unwrap();
        let mut probity = Probity {
            port,
            state_dir,
            policies: root().join("policies"),
            data_dir: data,
            config,
            entities: entities.to_owned(),
            dir,
            anonymous: tls_client(&plane.pki.ca_pem, None),
            admin: tls_client(
                &plane.pki.ca_pem,
                Some(&(
                    std::fs::read_to_string(admin_crt).unwrap(),
                    std::fs::read_to_string(admin_key).unwrap(),
                )),
            ),
            proc: None,
        };
        probity.restart().await;
        probity
    }

    /// Starts the server again (after `stop`), on the same port and state.
    pub async fn restart(&mut self) {
        assert!(self.proc.is_none(), "probity is running");
        let proc = Proc::spawn(
            "probity serve",
            Command::new(probity_bin())
                .arg("serve")
                .arg("--config")
                .arg(&self.config)
                .arg("--policies")
                .arg(&self.policies)
                .arg("--entities")
                .arg(&self.entities)
                .arg("--state-dir")
                .arg(&self.state_dir)
                .args(["--log-format", "json"]),
            &self.dir.join("probity.log"),
        );
        self.proc = Some(proc);
        poll_ready("probity /readyz", Duration::from_secs(60), || {
            if let Some(p) = self.proc.as_mut() {
                p.assert_running();
            }
            let (port, connector) = (self.port, self.anonymous.clone());
            async move {
                let (status, _) = https(port, &connector, "GET", "/readyz", "").await.ok()?;
                (status == 200).then_some(())
            }
        })
        .await;
    }

    /// Stops the server by PID (SIGKILL: as a crash or an evicted pod would).
    pub fn stop(&mut self) {
        self.proc = None;
    }

    /// Restarts the server on a copy of its policies whose probity.toml gains the
    /// `[modes]` lines `modes`; the copy, which the server watches (edit it with
    /// [`PolicyModes::set`] and [`PolicyModes::restore`]).
    pub async fn restart_with_modes(&mut self, modes: &str) -> PolicyModes {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&self.policies, dir.path());
        let config = dir.path().join("probity.toml");
        let original = std::fs::read_to_string(&config).unwrap();
        let copy = PolicyModes {
            _dir: dir,
            config,
            original,
        };
        copy.set(modes);
        self.stop();
        self.policies = copy._dir.path().to_owned();
        self.restart().await;
        copy
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// One call to Probity's API as the test's admin; the status and the JSON body.
    pub async fn call(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = https(self.port, &self.admin, method, path, &body.to_string())
            .await
            .unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
}

/// One HTTP/1.1 request over TLS to 127.0.0.1:`port` through `connector` (made once per
/// client by `tls_client`): the status and the body.
pub async fn https(
    port: u16,
    connector: &tokio_rustls::TlsConnector,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let mut tls = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap().to_owned(), tcp)
        .await?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    // A server may close without TLS close_notify; what arrived is still the answer.
    let _ = tls.read_to_end(&mut response).await;
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP status in {head:?}")))?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Ok((status, body))
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// A served copy of the policy set whose `[modes]` a test changes.
pub struct PolicyModes {
    _dir: tempfile::TempDir,
    config: PathBuf,
    original: String,
}

impl PolicyModes {
    /// probity.toml as it was, with `modes` as its `[modes]` table.
    pub fn set(&self, modes: &str) {
        std::fs::write(&self.config, format!("{}\n[modes]\n{modes}", self.original)).unwrap();
    }

    /// probity.toml as it was: every policy in its own mode.
    pub fn restore(&self) {
        std::fs::write(&self.config, &self.original).unwrap();
    }
}

/// Copies a directory (files and subdirectories), owner-only.
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o700)).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}
