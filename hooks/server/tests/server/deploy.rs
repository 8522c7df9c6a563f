//! Probity's Helm chart (hooks/chart/probity), as the real `helm template` renders it
//! (`$PROBITY_KUBE_BIN/helm`, built by scripts/build-control-plane.sh): the webhooks
//! fail closed quickly, without side effects, on v1 reviews, skipping the system
//! namespaces and Probity's own; the CA comes from cert-manager or from the operator;
//! the scheduler extender sees only pods that request a GPU and is not ignorable; every
//! ConfigMap and Secret a workload mounts is rendered or named by the operator; and a
//! missing required value fails the render with a message naming it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::root;

const RELEASE: &str = "probity";
const NAMESPACE: &str = "probity-system";

/// base64 of a PEM certificate block (the chart checks the form, not the certificate).
const CA_BUNDLE: &str =
    "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUJsaW50Ci0tLS0tRU5EIENFUlRJRklDQVRFLS0tLS0K";

/// The values every render must be given (provided-CA mode: `helm template` knows no
/// cert-manager API unless told).
fn required_values() -> String {
    format!(
        r#"
etcd:
  endpoints: ["https://etcd-0.etcd.example:2379", "https://etcd-1.etcd.example:2379"]
  clientSecret: probity-etcd-client
webhook:
  caBundle: "{CA_BUNDLE}"
trust:
  publicKey: "04a1b2c3"
sidecar:
  agent:
    inventory:
      gpu-001: {{zone: z1, rack: r1, role: gpu-worker, gpu_node: true, cuda_image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04", cpu_count: 64}}
"#
    )
}

/// etcd run by the chart: three members, with the operator's serving certificate.
const BUNDLED_ETCD: &str = "
etcd:
  mode: bundled
  endpoints: null
  bundled:
    tlsSecret: probity-etcd-server
";

fn helm() -> PathBuf {
    let dir = std::env::var_os("PROBITY_KUBE_BIN").unwrap_or_else(|| {
        panic!("PROBITY_KUBE_BIN is not set: run scripts/build-control-plane.sh, which prints the directory")
    });
    PathBuf::from(dir).join("helm")
}

fn chart() -> PathBuf {
    root().join("hooks/chart/probity")
}

/// Runs `helm <args>` with its configuration, cache and data in `home` (nothing of
/// the user's is read or written); Ok(stdout) on success, Err(stderr) otherwise.
fn run_helm(home: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(helm())
        .args(args)
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env_remove("KUBECONFIG")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", helm().display()));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(stderr)
    }
}

/// The chart's objects, as `helm template` renders them.
struct Render(Vec<Value>);

impl Render {
    fn all(&self, kind: &str) -> Vec<&Value> {
        self.0.iter().filter(|d| d["kind"] == kind).collect()
    }

    fn find(&self, kind: &str, name: &str) -> Option<&Value> {
        self.0
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
    }

    fn one(&self, kind: &str, name: &str) -> &Value {
        self.find(kind, name)
            .unwrap_or_else(|| panic!("no {kind} {name} in the render: {:?}", self.names()))
    }

    fn workload(&self, kind: &str) -> &Value {
        let all = self.all(kind);
        assert_eq!(all.len(), 1, "{kind}: {:?}", self.names());
        all[0]
    }

    /// The one workload of `kind` whose first container runs `probity serve` (the
    /// controller's Deployment runs `probity controller`).
    fn server(&self, kind: &str) -> &Value {
        let all: Vec<&Value> = self
            .all(kind)
            .into_iter()
            .filter(|w| w["spec"]["template"]["spec"]["containers"][0]["args"][0] == "serve")
            .collect();
        assert_eq!(all.len(), 1, "{kind} running serve: {:?}", self.names());
        all[0]
    }

    fn names(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]))
            .collect()
    }

    /// A ConfigMap's file, parsed as YAML.
    fn config_file(&self, map: &str, key: &str) -> Value {
        let text = self.one("ConfigMap", map)["data"][key]
            .as_str()
            .unwrap_or_else(|| panic!("ConfigMap {map} has no {key}"))
            .to_owned();
        serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{map} {key}: {e}"))
    }
}

/// `helm template` of the chart with the required values, then each of `values` (YAML)
/// over them, then `args`.
fn try_render(values: &[&str], args: &[&str]) -> Result<Render, String> {
    let text = run_chart("template", values, args)?;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("helm template: {e}\n{text}"));
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(Render(docs))
}

/// `helm <command> RELEASE CHART` in the release's namespace, with the required values,
/// then each of `values` (YAML) over them, then `args`.
fn run_chart(command: &str, values: &[&str], args: &[&str]) -> Result<String, String> {
    let home = tempfile::tempdir().unwrap();
    let chart = chart();
    let mut files = Vec::new();
    for (i, text) in std::iter::once(required_values().as_str())
        .chain(values.iter().copied())
        .enumerate()
    {
        let path = home.path().join(format!("values-{i}.yaml"));
        std::fs::write(&path, text).unwrap();
        files.push(path.to_str().unwrap().to_owned());
    }
    let mut argv = vec![
        command,
        RELEASE,
        chart.to_str().unwrap(),
        "--namespace",
        NAMESPACE,
    ];
    for f in &files {
        argv.extend(["--values", f.as_str()]);
    }
    argv.extend(args);
    run_helm(home.path(), &argv)
}

/// The NOTES `helm install` prints (a client-side dry run: no cluster is contacted).
fn notes(values: &[&str], args: &[&str]) -> String {
    let mut args = args.to_vec();
    args.push("--dry-run=client");
    let out = run_chart("install", values, &args)
        .unwrap_or_else(|e| panic!("helm install --dry-run=client: {e}"));
    out.split_once("NOTES:")
        .unwrap_or_else(|| panic!("no NOTES: {out}"))
        .1
        .to_owned()
}

fn render(values: &[&str], args: &[&str]) -> Render {
    try_render(values, args).unwrap_or_else(|e| panic!("helm template failed: {e}"))
}

fn default_render() -> Render {
    render(&[], &[])
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

fn webhook_configurations(r: &Render) -> Vec<&Value> {
    let mut all = r.all("ValidatingWebhookConfiguration");
    all.extend(r.all("MutatingWebhookConfiguration"));
    all
}

#[test]
fn helm_lint_strict_passes() {
    let home = tempfile::tempdir().unwrap();
    let values = home.path().join("values.yaml");
    std::fs::write(&values, required_values()).unwrap();
    let out = run_helm(
        home.path(),
        &[
            "lint",
            "--strict",
            chart().to_str().unwrap(),
            "--namespace",
            NAMESPACE,
            "--values",
            values.to_str().unwrap(),
        ],
    );
    assert!(out.is_ok(), "helm lint --strict: {out:?}");
}

#[test]
fn webhooks_fail_closed_quickly_without_side_effects_and_skip_system_namespaces() {
    let r = default_render();
    for want in [
        "DaemonSet",
        "Deployment",
        "MutatingWebhookConfiguration",
        "Service",
        "ValidatingWebhookConfiguration",
    ] {
        assert!(!r.all(want).is_empty(), "no {want}: {:?}", r.names());
    }
    let mut webhooks = 0;
    for doc in webhook_configurations(&r) {
        let kind = doc["kind"].as_str().unwrap();
        for hook in doc["webhooks"].as_array().unwrap() {
            webhooks += 1;
            let name = format!("{kind}: {}", hook["name"]);
            assert_eq!(hook["failurePolicy"], "Fail", "{name}");
            assert_eq!(hook["timeoutSeconds"], 5, "{name}");
            // The validating hook remembers admitted pods for their bindings.
            let side_effects = if name.contains("validate.probity.io") {
                "NoneOnDryRun"
            } else {
                "None"
            };
            assert_eq!(hook["sideEffects"], side_effects, "{name}");
            assert_eq!(hook["admissionReviewVersions"], json!(["v1"]), "{name}");
            let service = &hook["clientConfig"]["service"];
            assert_eq!(service["name"], "probity-webhook", "{name}");
            assert_eq!(service["namespace"], NAMESPACE, "{name}");
            let want = if kind.starts_with("Mutating") {
                "/v1/admission/mutate"
            } else {
                "/v1/admission/validate"
            };
            assert_eq!(service["path"], want, "{name}");
            let selector = &hook["namespaceSelector"]["matchExpressions"];
            assert_eq!(
                selector,
                &json!([{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                         "values": ["kube-system", NAMESPACE]}]),
                "{name}"
            );
        }
    }
    assert_eq!(webhooks, 2);
    // The values change them; the release's namespace stays excluded whatever the list.
    let r = render(
        &["webhook: {failurePolicy: Ignore, timeoutSeconds: 3, excludedNamespaces: [monitoring]}"],
        &[],
    );
    for doc in webhook_configurations(&r) {
        let hook = &doc["webhooks"][0];
        assert_eq!(hook["failurePolicy"], "Ignore");
        assert_eq!(hook["timeoutSeconds"], 3);
        assert_eq!(
            hook["namespaceSelector"]["matchExpressions"][0]["values"],
            json!(["monitoring", NAMESPACE])
        );
    }
}

/// Provided mode (the default while webhook.caBundle is set): the operator's CA in both
/// configurations, the operator's Secret mounted, no cert-manager object.
#[test]
fn a_provided_ca_goes_into_both_webhooks_and_the_deployment_mounts_the_existing_secret() {
    for (values, secret) in [
        ("{}", "probity-webhook-tls"),
        (
            "webhook: {tls: {mode: provided, existingSecret: my-tls}}",
            "my-tls",
        ),
    ] {
        let r = render(&[values], &[]);
        for doc in webhook_configurations(&r) {
            assert!(doc["metadata"]["annotations"].is_null(), "{doc}");
            assert_eq!(doc["webhooks"][0]["clientConfig"]["caBundle"], CA_BUNDLE);
        }
        assert!(r.all("Certificate").is_empty() && r.all("Issuer").is_empty());
        let deployment = r.one("Deployment", "probity-webhook");
        let mounted: Vec<&str> = deployment["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["secret"]["secretName"].as_str())
            .collect();
        assert!(mounted.contains(&secret), "{mounted:?} lacks {secret}");
    }
}

#[test]
fn cert_manager_mode_without_the_cert_manager_api_fails_naming_the_value() {
    for values in [
        "webhook: {caBundle: null}",
        "webhook: {tls: {mode: cert-manager}}",
    ] {
        let err = try_render(&[values], &[])
            .err()
            .unwrap_or_else(|| panic!("{values}: rendered without cert-manager.io/v1"));
        assert!(err.contains("webhook.tls.mode"), "{err}");
        assert!(err.contains("cert-manager.io/v1"), "{err}");
        assert!(err.contains("webhook.caBundle"), "{err}");
    }
}

/// cert-manager mode: the issuer chain and the serving certificate are rendered, its
/// Secret is what the Deployment mounts, it names the Service the webhooks call, and
/// both webhook configurations take their CA from it (no caBundle beside the injection).
#[test]
fn cert_manager_mode_renders_the_issuer_chain_whose_ca_the_webhooks_inject() {
    let r = render(
        &["webhook: {caBundle: null}"],
        &["--api-versions", "cert-manager.io/v1"],
    );
    let service = r.one("Service", "probity-webhook");
    let dns = format!(
        "probity-webhook.{}.svc",
        service["metadata"]["namespace"].as_str().unwrap()
    );
    let cert = r.one("Certificate", "probity-webhook-tls");
    let secret = cert["spec"]["secretName"].as_str().unwrap();
    let names = strings(&cert["spec"]["dnsNames"]);
    assert!(names.contains(&dns.as_str()), "{names:?} lacks {dns}");
    let deployment = r.one("Deployment", "probity-webhook");
    let mounted: Vec<&str> = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["secret"]["secretName"].as_str())
        .collect();
    assert!(
        mounted.contains(&secret),
        "the Deployment mounts {mounted:?}, not {secret}"
    );
    // The issuer chain: the serving certificate's CA issuer, its CA certificate, and
    // the self-signed root that issued that.
    let issuer = r.one(
        "Issuer",
        cert["spec"]["issuerRef"]["name"].as_str().unwrap(),
    );
    let ca_secret = issuer["spec"]["ca"]["secretName"].as_str().unwrap();
    let ca = r
        .all("Certificate")
        .into_iter()
        .find(|c| c["spec"]["secretName"] == ca_secret)
        .unwrap();
    assert_eq!(ca["spec"]["isCA"], true);
    let root_issuer = r.one("Issuer", ca["spec"]["issuerRef"]["name"].as_str().unwrap());
    assert!(root_issuer["spec"]["selfSigned"].is_object());
    let inject = format!("{NAMESPACE}/{}", cert["metadata"]["name"].as_str().unwrap());
    for doc in webhook_configurations(&r) {
        assert_eq!(
            doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"], inject,
            "{}",
            doc["kind"]
        );
        for hook in doc["webhooks"].as_array().unwrap() {
            assert!(
                hook["clientConfig"].get("caBundle").is_none(),
                "{} sets caBundle",
                hook["name"]
            );
        }
    }
}

/// webhook.url: the real apiserver of the tests calls a Probity on 127.0.0.1; both
/// configurations name the URL instead of the Service, and the extender follows.
#[test]
fn webhook_url_replaces_the_service_in_both_webhooks_and_the_extender() {
    let url = "https://127.0.0.1:18443";
    let r = render(&[&format!("webhook: {{url: \"{url}/\"}}")], &[]);
    for doc in webhook_configurations(&r) {
        let client = &doc["webhooks"][0]["clientConfig"];
        assert!(client.get("service").is_none(), "{client}");
        let path = if doc["kind"] == "MutatingWebhookConfiguration" {
            "mutate"
        } else {
            "validate"
        };
        assert_eq!(client["url"], format!("{url}/v1/admission/{path}"));
        assert_eq!(client["caBundle"], CA_BUNDLE);
    }
    let config = r.config_file("probity-scheduler-config", "scheduler-config.yaml");
    assert_eq!(
        config["extenders"][0]["urlPrefix"],
        format!("{url}/v1/scheduler")
    );
    let kubeconfig = r.config_file("probity-apiserver-admission", "webhook-kubeconfig.yaml");
    assert_eq!(kubeconfig["users"][0]["name"], "127.0.0.1:18443");
    // cert-manager cannot issue for a server outside the cluster.
    let err = try_render(
        &[&format!(
            "webhook: {{url: \"{url}\", tls: {{mode: cert-manager}}}}"
        )],
        &["--api-versions", "cert-manager.io/v1"],
    )
    .err()
    .unwrap();
    assert!(err.contains("webhook.caBundle"), "{err}");
    let err = try_render(&["webhook: {url: \"http://127.0.0.1:1\"}"], &[])
        .err()
        .unwrap();
    assert!(err.contains("webhook.url"), "{err}");
}

#[test]
fn rendering_without_a_required_value_fails_naming_it() {
    for (values, name) in [
        ("etcd: {endpoints: null}", "etcd.endpoints"),
        ("etcd: {clientSecret: null}", "etcd.clientSecret"),
        ("trust: {publicKey: null}", "trust.publicKey"),
        (
            "sidecar: {agent: {inventory: null}}",
            "sidecar.agent.inventory",
        ),
        (
            "webhook: {caBundle: null, tls: {mode: provided}}",
            "webhook.caBundle",
        ),
        (
            "webhook: {caBundle: \"bm90IGEgY2VydA==\"}",
            "webhook.caBundle",
        ),
        ("etcd: {mode: bundled}", "etcd.bundled.tlsSecret"),
        (
            "scheduler: {extender: {managedResources: []}}",
            "scheduler.extender.managedResources",
        ),
    ] {
        let err = try_render(&[values], &[])
            .err()
            .unwrap_or_else(|| panic!("{values}: rendered"));
        assert!(err.contains(name), "{values}: {err}");
    }
    // Without the sidecar, its trust key and inventory are not needed.
    let r = render(
        &["{sidecar: {enabled: false, agent: {inventory: null}}, trust: {publicKey: null}}"],
        &[],
    );
    assert!(r.all("DaemonSet").is_empty());
    // Every required value given: the render passes (the other renders rely on it).
    assert!(!default_render().all("Deployment").is_empty());
}

#[test]
fn the_sidecar_shares_its_socket_directory_through_a_volume() {
    let r = default_render();
    let spec = &r.workload("DaemonSet")["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let args = strings(&container["args"]);
    let socket = args
        .iter()
        .position(|a| *a == "--socket")
        .map(|i| args[i + 1])
        .unwrap();
    let dir = Path::new(socket).parent().unwrap();
    let volume = mounted_volume(spec, container, dir).unwrap();
    assert_eq!(volume["hostPath"]["path"], "/run/probity", "{volume}");
}

/// The node agent runs beside `probity serve` in the sidecar pod, with the host's view
/// it needs and no more: the host's network namespace (its firewall and sockets), the
/// host's /proc, powercap tree and audit log read-only, the GPUs through the NVIDIA
/// runtime, and CAP_NET_ADMIN as its only capability; the server gets none of these.
#[test]
fn the_agent_sees_the_host_read_only_with_net_admin_alone() {
    let r = default_render();
    let spec = &r.workload("DaemonSet")["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true, "the firewall is the host's");
    assert_ne!(spec["hostPID"], true, "the host's /proc is mounted instead");
    assert_eq!(spec["runtimeClassName"], "nvidia");
    let containers = spec["containers"].as_array().unwrap();
    let by_command = |cmd: &str| {
        containers
            .iter()
            .find(|c| c["args"][0] == cmd)
            .unwrap_or_else(|| panic!("no container runs `probity {cmd}`"))
    };
    let serve = by_command("serve");
    let agent = by_command("agent");
    let env = |c: &Value, name: &str| {
        c["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == name))
            .map(|v| v["value"].clone())
    };
    assert_eq!(
        env(agent, "NVIDIA_VISIBLE_DEVICES"),
        Some(Value::from("all"))
    );
    assert!(
        env(agent, "NODE_NAME").is_some(),
        "the agent names its node from the downward API"
    );
    // The server asks the NVIDIA runtime for no device.
    assert!(matches!(
        env(serve, "NVIDIA_VISIBLE_DEVICES")
            .as_ref()
            .and_then(Value::as_str),
        Some("void" | "none") | None
    ));
    for (c, adds) in [(agent, json!(["NET_ADMIN"])), (serve, Value::Null)] {
        let sc = &c["securityContext"];
        assert_ne!(sc["privileged"], true, "{}", c["name"]);
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{}", c["name"]);
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{}", c["name"]);
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{}", c["name"]);
        assert_eq!(sc["capabilities"]["add"], adds, "{}", c["name"]);
    }
    // Each host path the agent reads is mounted read-only; only its state is writable.
    let volumes = spec["volumes"].as_array().unwrap();
    let host_path_of = |mount: &Value| {
        volumes
            .iter()
            .find(|v| v["name"] == mount["name"])
            .and_then(|v| v["hostPath"]["path"].as_str())
            .map(str::to_owned)
    };
    let mounts = agent["volumeMounts"].as_array().unwrap();
    let mut read_only = Vec::new();
    for m in mounts {
        if let Some(path) = host_path_of(m) {
            if m["readOnly"] == true {
                read_only.push(path);
            } else {
                assert_eq!(path, "/var/lib/probity-agent", "{m} is writable");
            }
        }
    }
    for want in ["/proc", "/sys/class/powercap", "/var/log/audit"] {
        assert!(
            read_only.iter().any(|p| p == want),
            "{want} is not mounted read-only into the agent: {read_only:?}"
        );
    }
    // The server writes no host path but its socket and state directories; its data
    // roots are read-only.
    for m in serve["volumeMounts"].as_array().unwrap() {
        if let Some(path) = host_path_of(m)
            && m["readOnly"] != true
        {
            assert!(
                path == "/run/probity" || path == "/var/lib/probity",
                "{m} is writable"
            );
        }
    }
    // The agent's configuration is a mounted ConfigMap file: TOML that names the
    // inventory, /proc and the state directory as mounted.
    let args = strings(&agent["args"]);
    let config = Path::new(args[args.iter().position(|a| *a == "--config").unwrap() + 1]);
    let volume = mounted_volume(spec, agent, config.parent().unwrap())
        .unwrap_or_else(|| panic!("{} is in no volume", config.display()));
    let map = volume["configMap"]["name"].as_str().unwrap();
    let file = config.file_name().unwrap().to_str().unwrap();
    let text = r.one("ConfigMap", map)["data"][file].as_str().unwrap();
    let agent_config: toml::Table = toml::from_str(text).unwrap();
    for (path, dir) in [
        (&agent_config["proc"]["root"], "/host/proc"),
        (&agent_config["state"]["dir"], "/var/lib/probity/agent"),
    ] {
        assert_eq!(path.as_str(), Some(dir));
        assert!(
            mounted_volume(spec, agent, Path::new(dir)).is_some(),
            "{dir}"
        );
    }
    // Its inventory: one TOML file per node, in the mounted inventory ConfigMap.
    let inventory = agent_config["inventory"]["file"].as_str().unwrap();
    let inventory = Path::new(inventory);
    let volume = mounted_volume(spec, agent, inventory.parent().unwrap()).unwrap();
    let map = r.one("ConfigMap", volume["configMap"]["name"].as_str().unwrap());
    let node: toml::Table = toml::from_str(map["data"]["gpu-001.toml"].as_str().unwrap()).unwrap();
    assert_eq!(node["zone"].as_str(), Some("z1"));
    assert_eq!(node["gpu_node"].as_bool(), Some(true));
    assert_eq!(node["cpu_count"].as_integer(), Some(64));
}

/// The scheduler configuration, for `kube-scheduler --config`: only pods requesting a
/// GPU go through Probity (so kube-system's and Probity's own replacement pods schedule
/// while it is down), and for those the extender fails closed. Each verb is a route the
/// server answers.
#[tokio::test]
async fn only_pods_requesting_a_gpu_wait_on_the_scheduler_extender_which_fails_closed() {
    let r = default_render();
    let config = r.config_file("probity-scheduler-config", "scheduler-config.yaml");
    assert_eq!(config["apiVersion"], "kubescheduler.config.k8s.io/v1");
    assert_eq!(config["kind"], "KubeSchedulerConfiguration");
    assert_eq!(
        config["clientConnection"],
        json!({"kubeconfig": "/etc/kubernetes/scheduler.conf"})
    );
    assert_eq!(config["leaderElection"], json!({"leaderElect": true}));
    let extenders = config["extenders"].as_array().unwrap();
    assert_eq!(extenders.len(), 1);
    let e = &extenders[0];
    assert_eq!(
        e["managedResources"],
        json!([{"name": "nvidia.com/gpu", "ignoredByScheduler": false}])
    );
    assert_eq!(e["ignorable"], false, "the extender fails closed");
    let prefix = e["urlPrefix"].as_str().unwrap();
    assert_eq!(
        prefix,
        "https://probity-webhook.probity-system.svc:443/v1/scheduler"
    );
    assert_eq!(e["nodeCacheCapable"], true, "node names only");
    assert_eq!(e["enableHTTPS"], true);
    assert_eq!(e["weight"], 5);
    assert_eq!(e["httpTimeout"], "5s");
    assert_eq!(
        e["tlsConfig"],
        json!({"caFile": "/etc/kubernetes/probity/ca.crt",
               "certFile": "/etc/kubernetes/probity/scheduler-client.crt",
               "keyFile": "/etc/kubernetes/probity/scheduler-client.key"})
    );
    let path = prefix.split_once(".svc:443").unwrap().1;
    let s = crate::state();
    for verb in ["filterVerb", "prioritizeVerb"] {
        let uri = format!("{path}/{}", e[verb].as_str().unwrap());
        let (status, out) =
            crate::call(&s, axum::http::Method::POST, &uri, Some(&json!({})), None).await;
        assert_eq!(status, axum::http::StatusCode::BAD_REQUEST, "{uri}: {out}");
        assert!(
            out["Error"].as_str().unwrap().contains("ExtenderArgs"),
            "{uri}: {out}"
        );
    }
    // The validating webhook also sees bindings, the extender's backstop.
    let validating = r.workload("ValidatingWebhookConfiguration");
    assert!(
        validating.to_string().contains("pods/binding"),
        "the validating webhook does not check bindings"
    );
}

/// What the tests' real kube-scheduler is given: no leader election, its own client
/// settings, and TLS files left out when empty.
#[test]
fn scheduler_values_reach_the_kube_scheduler_configuration() {
    let r = render(
        &["
scheduler:
  leaderElect: false
  clientConnection: {kubeconfig: /tmp/kube/scheduler.kubeconfig, qps: 50, burst: 100}
  extender:
    urlPrefix: https://127.0.0.1:18443/v1/scheduler
    httpTimeout: 3s
    weight: 7
    managedResources: [{name: example.com/fpga, ignoredByScheduler: true}]
    tls: {certFile: '', keyFile: '', caFile: /tmp/ca.crt}
"],
        &[],
    );
    let config = r.config_file("probity-scheduler-config", "scheduler-config.yaml");
    assert_eq!(config["leaderElection"], json!({"leaderElect": false}));
    assert_eq!(
        config["clientConnection"],
        json!({"kubeconfig": "/tmp/kube/scheduler.kubeconfig", "qps": 50, "burst": 100})
    );
    let e = &config["extenders"][0];
    assert_eq!(e["urlPrefix"], "https://127.0.0.1:18443/v1/scheduler");
    assert_eq!(e["httpTimeout"], "3s");
    assert_eq!(e["weight"], 7);
    assert_eq!(
        e["managedResources"],
        json!([{"name": "example.com/fpga", "ignoredByScheduler": true}])
    );
    assert_eq!(e["tlsConfig"], json!({"caFile": "/tmp/ca.crt"}));
    assert_eq!(e["ignorable"], false);
}

/// A workload's pod spec, its first container, and the server configuration it reads
/// (`--config`, from a mounted ConfigMap), parsed as `probity serve` parses it.
fn served_config<'a>(r: &'a Render, kind: &str) -> (&'a Value, &'a Value, probity_server::Config) {
    let spec = &r.server(kind)["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let args: Vec<String> = strings(&container["args"])
        .into_iter()
        .flat_map(|a| match a.split_once('=') {
            Some((k, v)) if k.starts_with("--") => vec![k.to_owned(), v.to_owned()],
            _ => vec![a.to_owned()],
        })
        .collect();
    let path = args
        .iter()
        .position(|a| a == "--config")
        .map(|i| args[i + 1].clone())
        .unwrap_or_else(|| panic!("{kind}: no --config"));
    let path = Path::new(&path);
    let volume = mounted_volume(spec, container, path.parent().unwrap())
        .unwrap_or_else(|| panic!("{kind}: {} is not mounted", path.display()));
    let map = volume["configMap"]["name"]
        .as_str()
        .unwrap_or_else(|| panic!("{kind}: the configuration is not a ConfigMap: {volume}"));
    let file = path.file_name().unwrap().to_str().unwrap();
    let text = r.one("ConfigMap", map)["data"][file]
        .as_str()
        .unwrap_or_else(|| panic!("ConfigMap {map} has no {file}"));
    let config = probity_server::Config::from_toml(text)
        .unwrap_or_else(|e| panic!("ConfigMap {map} {file}: {e}\n{text}"));
    (spec, container, config)
}

/// The volume mounted at `dir` (exactly) in `container`.
fn mounted_volume<'a>(spec: &'a Value, container: &Value, dir: &Path) -> Option<&'a Value> {
    let mount = container["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["mountPath"].as_str().map(Path::new) == Some(dir))?;
    spec["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])
}

fn mount_is_read_only(container: &Value, dir: &Path) -> bool {
    container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str().map(Path::new) == Some(dir))
        .is_some_and(|m| m["readOnly"] == true)
}

#[test]
fn sidecars_and_webhooks_reach_etcd_with_client_certificates_from_a_secret() {
    use probity_server::{StateBackendKind, StateRole};
    let bundled_endpoints: Vec<String> = (0..3)
        .map(|i| format!("https://probity-etcd-{i}.probity-etcd.{NAMESPACE}.svc:2379"))
        .collect();
    for (values, endpoints) in [
        (
            "{}",
            vec![
                "https://etcd-0.etcd.example:2379".to_owned(),
                "https://etcd-1.etcd.example:2379".to_owned(),
            ],
        ),
        (BUNDLED_ETCD, bundled_endpoints),
    ] {
        let r = render(&[values], &[]);
        for (kind, role) in [
            ("DaemonSet", StateRole::Sidecar),
            ("Deployment", StateRole::Webhook),
        ] {
            let (spec, container, mut config) = served_config(&r, kind);
            let s = &config.state;
            assert_eq!(s.backend, StateBackendKind::Etcd, "{kind}");
            assert_eq!(s.role, role, "{kind}");
            assert_eq!(s.endpoints, endpoints, "{kind}");
            // CA, certificate and key: files of one Secret, mounted read-only, mode 0400.
            let files = [&s.ca_file, &s.cert_file, &s.key_file].map(|f| {
                f.clone()
                    .unwrap_or_else(|| panic!("{kind}: [state] lacks a TLS file"))
            });
            for file in &files {
                let dir = file.parent().unwrap();
                let volume = mounted_volume(spec, container, dir)
                    .unwrap_or_else(|| panic!("{kind}: {} is not mounted", dir.display()));
                assert_eq!(
                    volume["secret"]["secretName"], "probity-etcd-client",
                    "{kind}: {volume}"
                );
                assert_eq!(volume["secret"]["defaultMode"], 0o400, "{kind}");
                assert!(
                    mount_is_read_only(container, dir),
                    "{kind}: {}",
                    dir.display()
                );
            }
            match role {
                StateRole::Sidecar => {
                    // The node comes from the pod's node.
                    let env = container["env"]
                        .as_array()
                        .unwrap_or_else(|| panic!("{kind}: no env"))
                        .iter()
                        .find(|e| e["name"] == probity_server::NODE_NAME_ENV)
                        .unwrap_or_else(|| panic!("{kind}: no {}", probity_server::NODE_NAME_ENV));
                    assert_eq!(
                        env["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName",
                        "{kind}"
                    );
                    config.state.node = Some("lint-node".into());
                }
                StateRole::Webhook => {}
            }
            // A non-root server reads the 0400 Secrets (etcd's client key) through
            // fsGroup's group read: the sidecar's as well as the webhook's.
            let user = &container["securityContext"]["runAsUser"];
            if user.as_u64().is_some_and(|u| u != 0) {
                assert_eq!(&spec["securityContext"]["fsGroup"], user, "{kind}");
            }
            // Whatever the flags add, the file alone must be a configuration that starts.
            config.server.socket = PathBuf::from("/run/probity/lint.sock");
            config.validate().unwrap_or_else(|e| panic!("{kind}: {e}"));
            // The state directory is mounted writable.
            let dir = config.integrity.state_dir.clone().unwrap();
            let volume = mounted_volume(spec, container, &dir)
                .unwrap_or_else(|| panic!("{kind}: state_dir {} is not mounted", dir.display()));
            assert!(!mount_is_read_only(container, &dir), "{kind}: {volume}");
        }
    }
}

/// etcd.mode=bundled: an odd number of members behind a headless Service, each
/// advertising its own name, requiring client certificates from clients and peers.
#[test]
fn bundled_etcd_is_three_members_behind_a_headless_service_requiring_client_certificates() {
    let r = render(&[BUNDLED_ETCD], &[]);
    let service = r.one("Service", "probity-etcd");
    assert_eq!(service["spec"]["clusterIP"], "None");
    assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
    let set = r.one("StatefulSet", "probity-etcd");
    assert_eq!(set["spec"]["replicas"], 3);
    assert_eq!(set["spec"]["serviceName"], "probity-etcd");
    let container = &set["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "quay.io/coreos/etcd:v3.5.21");
    let command = strings(&container["command"]);
    let peers: Vec<String> = (0..3)
        .map(|i| {
            format!("probity-etcd-{i}=https://probity-etcd-{i}.probity-etcd.{NAMESPACE}.svc:2380")
        })
        .collect();
    for want in [
        format!("--initial-cluster={}", peers.join(",")),
        "--client-cert-auth".to_owned(),
        "--peer-client-cert-auth".to_owned(),
        "--listen-client-urls=https://0.0.0.0:2379".to_owned(),
        format!("--advertise-client-urls=https://$(POD_NAME).probity-etcd.{NAMESPACE}.svc:2379"),
    ] {
        assert!(
            command.contains(&want.as_str()),
            "{want} not in {command:?}"
        );
    }
    assert!(
        command
            .iter()
            .all(|a| !a.contains("http://") || a.starts_with("--listen-metrics-urls")),
        "{command:?}"
    );
    let err = try_render(&[BUNDLED_ETCD, "etcd: {bundled: {members: 2}}"], &[])
        .err()
        .unwrap();
    assert!(err.contains("etcd.bundled.members"), "{err}");
}

#[test]
fn the_sidecar_keeps_its_state_on_the_host_so_verify_works_out_of_the_box() {
    let r = default_render();
    let (spec, container, config) = served_config(&r, "DaemonSet");
    let i = &config.integrity;
    let dir = i
        .state_dir
        .clone()
        .expect("the sidecar has a state directory");
    let volume = mounted_volume(spec, container, &dir).unwrap();
    // Not an emptyDir: it would go with the pod, and with it unforwarded decision
    // records and blocks that have not reached etcd.
    assert_eq!(
        volume["hostPath"]["path"], "/var/lib/probity",
        "state volume: {volume}"
    );
    assert_eq!(volume["hostPath"]["type"], "DirectoryOrCreate");
    // POST /v1/verify also needs the pinned key and at least one data root, mounted.
    let key = i.public_key.clone().expect("a pinned public key");
    let trust = mounted_volume(spec, container, key.parent().unwrap()).unwrap();
    let map = r.one("ConfigMap", trust["configMap"]["name"].as_str().unwrap());
    let file = key.file_name().unwrap().to_str().unwrap();
    assert_eq!(map["data"][file], "04a1b2c3");
    assert!(!i.data_roots.is_empty(), "no data roots");
    for root in &i.data_roots {
        assert!(
            mounted_volume(spec, container, root).is_some(),
            "data root {} is not mounted",
            root.display()
        );
        assert!(mount_is_read_only(container, root), "{}", root.display());
    }
}

/// Issue 28 item 5: the webhook's apiserver was anonymous. The chart's
/// AdmissionConfiguration gives both webhook plugins one kubeconfig whose user is the
/// webhook Service's DNS name, with a client certificate.
#[test]
fn the_apiserver_presents_a_client_certificate_to_the_webhook_service() {
    let r = default_render();
    let admission = r.config_file("probity-apiserver-admission", "admission-config.yaml");
    assert_eq!(admission["kind"], "AdmissionConfiguration");
    let plugins = admission["plugins"].as_array().unwrap();
    let mut named: Vec<&str> = plugins
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    named.sort_unstable();
    assert_eq!(
        named,
        ["MutatingAdmissionWebhook", "ValidatingAdmissionWebhook"]
    );
    for p in plugins {
        assert_eq!(
            p["configuration"]["kubeConfigFile"],
            "/etc/kubernetes/probity/webhook-kubeconfig.yaml"
        );
    }
    let service = r.one("Service", "probity-webhook");
    let host = format!(
        "{}.{}.svc",
        service["metadata"]["name"].as_str().unwrap(),
        service["metadata"]["namespace"].as_str().unwrap()
    );
    let kubeconfig = r.config_file("probity-apiserver-admission", "webhook-kubeconfig.yaml");
    let user = &kubeconfig["users"][0];
    assert_eq!(user["name"], host.as_str());
    assert!(user["user"]["client-certificate"].is_string());
    assert!(user["user"]["client-key"].is_string());
    // The webhook knows that certificate's CA and names its holder.
    let (_, _, config) = served_config(&r, "Deployment");
    assert!(config.server.client_ca.is_some());
}

/// Every ConfigMap and Secret a workload mounts (volumes, projected sources) or reads
/// (envFrom, env valueFrom) is rendered by the chart, issued by a rendered cert-manager
/// Certificate, or a Secret the values name as the operator's, listed in the NOTES.
#[test]
fn every_configmap_and_secret_a_workload_references_is_rendered_or_the_operators() {
    // The Secrets the values name as the operator's in each render (etcd.clientSecret,
    // webhook.tls.existingSecret's default in provided mode, etcd.bundled.tlsSecret,
    // imagePullSecrets).
    for (values, args, operators) in [
        (
            "{}",
            &[][..],
            &["probity-etcd-client", "probity-webhook-tls"][..],
        ),
        (
            BUNDLED_ETCD,
            &[][..],
            &[
                "probity-etcd-client",
                "probity-webhook-tls",
                "probity-etcd-server",
            ][..],
        ),
        (
            "imagePullSecrets: [{name: regcred}]",
            &[][..],
            &["probity-etcd-client", "probity-webhook-tls", "regcred"][..],
        ),
        (
            "webhook: {caBundle: null}",
            &["--api-versions", "cert-manager.io/v1"][..],
            &["probity-etcd-client"][..],
        ),
    ] {
        let r = render(&[values], args);
        let mut workloads = 0;
        for kind in ["DaemonSet", "Deployment", "StatefulSet"] {
            for w in r.all(kind) {
                workloads += 1;
                let name = format!("{kind} {}", w["metadata"]["name"]);
                for (reference, what) in references(&w["spec"]["template"]["spec"]) {
                    let rendered = r.find(what, &reference).is_some()
                        || (what == "Secret"
                            && r.all("Certificate")
                                .iter()
                                .any(|c| c["spec"]["secretName"] == reference.as_str()));
                    // The operator's Secrets are named in the NOTES `helm install` prints
                    // (which cannot be told of an API: not in cert-manager mode).
                    if !rendered && args.is_empty() {
                        let notes = notes(&[values], args);
                        assert!(
                            notes.contains(&format!("- {reference}:")),
                            "{values}: {what} {reference} is not in the NOTES: {notes}"
                        );
                    }
                    assert!(
                        rendered || (what == "Secret" && operators.contains(&reference.as_str())),
                        "{values}: {name} references {what} {reference}, neither rendered nor \
                         named by the operator"
                    );
                }
            }
        }
        assert!(workloads >= 2, "{values}: {:?}", r.names());
    }
}

/// The (name, kind) of each ConfigMap and Secret a pod spec references.
fn references(spec: &Value) -> BTreeSet<(String, &'static str)> {
    let mut out = BTreeSet::new();
    let mut add = |name: &Value, kind: &'static str| {
        if let Some(name) = name.as_str() {
            out.insert((name.to_owned(), kind));
        }
    };
    for v in spec["volumes"].as_array().into_iter().flatten() {
        add(&v["configMap"]["name"], "ConfigMap");
        add(&v["secret"]["secretName"], "Secret");
        for source in v["projected"]["sources"].as_array().into_iter().flatten() {
            add(&source["configMap"]["name"], "ConfigMap");
            add(&source["secret"]["name"], "Secret");
        }
    }
    for pull in spec["imagePullSecrets"].as_array().into_iter().flatten() {
        add(&pull["name"], "Secret");
    }
    for list in ["containers", "initContainers"] {
        for c in spec[list].as_array().into_iter().flatten() {
            for from in c["envFrom"].as_array().into_iter().flatten() {
                add(&from["configMapRef"]["name"], "ConfigMap");
                add(&from["secretRef"]["name"], "Secret");
            }
            for e in c["env"].as_array().into_iter().flatten() {
                add(&e["valueFrom"]["configMapKeyRef"]["name"], "ConfigMap");
                add(&e["valueFrom"]["secretKeyRef"]["name"], "Secret");
            }
        }
    }
    out
}

/// The policies ConfigMap is the repository's policies/ tree: the schema, the
/// thresholds and every *.cedar file, byte for byte (a sealed set's digests must match).
#[test]
fn the_policies_configmap_holds_every_policy_file_byte_for_byte() {
    let r = default_render();
    let map = r.one("ConfigMap", "probity-policies");
    let data = map["data"].as_object().unwrap();
    let mut want = BTreeSet::new();
    let mut dirs = vec![root().join("policies")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            if path.is_dir() {
                dirs.push(path);
            } else if name == "probity.cedarschema"
                || name == "probity.toml"
                || name.ends_with(".cedar")
            {
                let text = std::fs::read_to_string(&path).unwrap();
                assert_eq!(
                    data.get(&name),
                    Some(&Value::from(text)),
                    "{}",
                    path.display()
                );
                want.insert(name);
            }
        }
    }
    let got: BTreeSet<String> = data.keys().cloned().collect();
    assert_eq!(got, want);
    // Both workloads mount it where --policies points.
    for kind in ["DaemonSet", "Deployment"] {
        let spec = &r.server(kind)["spec"]["template"]["spec"];
        let volume = mounted_volume(
            spec,
            &spec["containers"][0],
            Path::new("/etc/probity/policies"),
        )
        .unwrap();
        assert_eq!(volume["configMap"]["name"], "probity-policies", "{kind}");
    }
    // An operator's ConfigMap replaces it.
    let r = render(&["policies: {existingConfigMap: my-policies}"], &[]);
    assert!(r.find("ConfigMap", "probity-policies").is_none());
    let spec = &r.server("Deployment")["spec"]["template"]["spec"];
    let volume = mounted_volume(
        spec,
        &spec["containers"][0],
        Path::new("/etc/probity/policies"),
    )
    .unwrap();
    assert_eq!(volume["configMap"]["name"], "my-policies");
}

/// Probity's workloads but the controller never call the Kubernetes API: no token is
/// mounted, and every role the chart grants is bound to the controller's account alone.
#[test]
fn workloads_but_the_controller_have_no_token_and_no_role() {
    let r = render(&[BUNDLED_ETCD], &[]);
    for kind in ["DaemonSet", "Deployment", "StatefulSet"] {
        for w in r.all(kind) {
            let spec = &w["spec"]["template"]["spec"];
            let account = spec["serviceAccountName"].as_str().unwrap();
            let sa = r.one("ServiceAccount", account);
            // Every account leaves the token out; only the controller's pods ask for it.
            assert_eq!(sa["automountServiceAccountToken"], false, "{account}");
            let token = account == CONTROLLER;
            assert_eq!(
                spec["automountServiceAccountToken"], token,
                "{kind} {account}"
            );
        }
    }
    for kind in ["RoleBinding", "ClusterRoleBinding"] {
        for binding in r.all(kind) {
            assert_eq!(
                binding["subjects"],
                json!([{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": NAMESPACE}]),
                "{kind} {}",
                binding["metadata"]["name"]
            );
        }
    }
    // Every namespaced object is in the release's namespace.
    for doc in &r.0 {
        let kind = doc["kind"].as_str().unwrap();
        if kind.ends_with("WebhookConfiguration")
            || kind.starts_with("Cluster")
            || kind == "CustomResourceDefinition"
        {
            continue;
        }
        assert_eq!(doc["metadata"]["namespace"], NAMESPACE, "{kind}");
    }
}

/// The controller's Deployment, ServiceAccount, Lease and state names (release "probity").
const CONTROLLER: &str = "probity-controller";

/// The PEM `CA_BUNDLE` is the base64 of.
const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBlint\n-----END CERTIFICATE-----\n";

/// The value of `--flag=value` in `args`, if given.
fn flag<'a>(args: &[&'a str], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(name)?.strip_prefix('='))
}

/// The controller's pod spec, its container and its arguments.
fn controller(r: &Render) -> (&Value, &Value, Vec<&str>) {
    let spec = &r.one("Deployment", CONTROLLER)["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    (spec, container, strings(&container["args"]))
}

/// `probity controller run`, each flag from its value; the replica names itself from
/// the downward API, the probes call the metrics listener's /healthz, and the pod runs
/// as a non-root user with nothing to escalate to.
#[test]
fn the_controller_runs_with_the_flags_its_values_give() {
    let r = default_render();
    let deployment = r.one("Deployment", CONTROLLER);
    assert_eq!(deployment["spec"]["replicas"], 2);
    let (spec, container, args) = controller(&r);
    assert_eq!(args[..2], ["controller", "run"]);
    for (name, want) in [
        ("--namespace", NAMESPACE),
        ("--lease-name", CONTROLLER),
        ("--state-name", "probity-controller-state"),
        (
            "--probity-url",
            "https://probity-webhook.probity-system.svc:443",
        ),
        ("--lease-seconds", "15"),
        ("--interval-ms", "500"),
        ("--max-nodes", "10"),
        ("--max-percent", "10"),
        ("--window-seconds", "600"),
        ("--migrate-per-window", "2"),
        ("--migrate-window-seconds", "300"),
        ("--metrics-listen", "0.0.0.0:9102"),
        ("--log-format", "json"),
    ] {
        assert_eq!(flag(&args, name), Some(want), "{name} in {args:?}");
    }
    for absent in [
        "--dry-run",
        "--pool-label",
        "--kubeconfig",
        "--probity-cert",
        "--taint-key",
        "--taint-effect",
    ] {
        assert!(
            !args.iter().any(|a| a.starts_with(absent)),
            "{absent} in {args:?}"
        );
    }
    let env = &container["env"][0];
    assert_eq!(env["name"], "POD_NAME");
    assert_eq!(env["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    let port = &container["ports"][0];
    assert_eq!(port["containerPort"], 9102);
    for probe in ["livenessProbe", "readinessProbe"] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], "/healthz", "{probe}");
        assert_eq!(get["port"], port["name"], "{probe}");
    }
    let sc = &container["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"], json!({"drop": ["ALL"]}));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        container["resources"]["limits"]["memory"], "128Mi",
        "the controller stays under 100 MiB"
    );
    // The values reach the flags.
    let r = render(
        &["controller: {poolLabels: [example.com/pool, topology.kubernetes.io/zone]}"],
        &[
            "--set",
            "controller.maxNodes=3",
            "--set",
            "controller.dryRun=true",
            "--set",
            "controller.maxPercent=25",
            "--set",
            "controller.windowSeconds=120",
            "--set",
            "controller.migratePerWindow=5",
            "--set",
            "controller.migrateWindowSeconds=900",
            "--set",
            "controller.intervalMs=250",
            "--set",
            "controller.leaseSeconds=30",
            "--set",
            "controller.metricsPort=9200",
            "--set",
            "controller.replicas=3",
        ],
    );
    let (_, container, args) = controller(&r);
    for (name, want) in [
        ("--max-nodes", "3"),
        ("--max-percent", "25"),
        ("--window-seconds", "120"),
        ("--migrate-per-window", "5"),
        ("--migrate-window-seconds", "900"),
        ("--interval-ms", "250"),
        ("--lease-seconds", "30"),
        ("--metrics-listen", "0.0.0.0:9200"),
    ] {
        assert_eq!(flag(&args, name), Some(want), "{name} in {args:?}");
    }
    assert!(args.contains(&"--dry-run"), "{args:?}");
    let pools: Vec<&str> = args
        .iter()
        .filter_map(|a| a.strip_prefix("--pool-label="))
        .collect();
    assert_eq!(pools, ["example.com/pool", "topology.kubernetes.io/zone"]);
    assert_eq!(container["ports"][0]["containerPort"], 9200);
    assert_eq!(r.one("Deployment", CONTROLLER)["spec"]["replicas"], 3);
    // A value the controller would refuse fails the render, naming it.
    let err = try_render(&[], &["--set", "controller.maxPercent=0"])
        .err()
        .unwrap();
    assert!(err.contains("controller.maxPercent"), "{err}");
}

/// A blocked node must not starve the controller: its pods tolerate Probity's taint in
/// both effects, the replicas spread over nodes, and a drain takes one at a time.
#[test]
fn the_controller_tolerates_probitys_taint_and_its_replicas_spread_over_nodes() {
    let r = default_render();
    let (spec, _, _) = controller(&r);
    let tolerations = spec["tolerations"].as_array().unwrap();
    for effect in ["NoSchedule", "NoExecute"] {
        assert!(
            tolerations.iter().any(|t| t["key"] == "probity.io/blocked"
                && t["operator"] == "Exists"
                && t["effect"] == effect),
            "{effect}: {tolerations:?}"
        );
    }
    let labels = &r.one("Deployment", CONTROLLER)["spec"]["selector"]["matchLabels"];
    let spread = &spec["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(spread["maxSkew"], 1);
    assert_eq!(spread["whenUnsatisfiable"], "DoNotSchedule");
    assert_eq!(&spread["labelSelector"]["matchLabels"], labels);
    let budget = r.one("PodDisruptionBudget", CONTROLLER);
    assert_eq!(budget["spec"]["maxUnavailable"], 1);
    assert_eq!(&budget["spec"]["selector"]["matchLabels"], labels);
    // One replica: no budget (it would be the replica's alone to hold).
    let r = render(&["controller: {replicas: 1}"], &[]);
    assert!(r.find("PodDisruptionBudget", CONTROLLER).is_none());
}

/// One permission the controller's account holds: where ("cluster", or a namespace),
/// API group, resource, verb, and the names it is limited to ("" for any).
type Grant = (String, String, String, String, String);

/// Every permission bound to the controller's account, through the roles its bindings
/// name.
fn controller_grants(r: &Render) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for kind in ["ClusterRoleBinding", "RoleBinding"] {
        for binding in r.all(kind) {
            let subjects = binding["subjects"].as_array().unwrap();
            if !subjects.iter().any(|s| {
                s["kind"] == "ServiceAccount"
                    && s["name"] == CONTROLLER
                    && s["namespace"] == NAMESPACE
            }) {
                continue;
            }
            let role_ref = &binding["roleRef"];
            let (role, scope) = if role_ref["kind"] == "ClusterRole" {
                assert_eq!(
                    kind, "ClusterRoleBinding",
                    "a ClusterRole bound in a namespace"
                );
                (
                    r.one("ClusterRole", role_ref["name"].as_str().unwrap()),
                    "cluster".to_owned(),
                )
            } else {
                let ns = binding["metadata"]["namespace"].as_str().unwrap();
                let role = r
                    .all("Role")
                    .into_iter()
                    .find(|x| {
                        x["metadata"]["name"] == role_ref["name"]
                            && x["metadata"]["namespace"] == ns
                    })
                    .unwrap_or_else(|| panic!("no Role {} in {ns}", role_ref["name"]));
                (role, ns.to_owned())
            };
            for rule in role["rules"].as_array().unwrap() {
                let names = rule["resourceNames"]
                    .as_array()
                    .map(|n| strings(&Value::from(n.clone())).join(","))
                    .unwrap_or_default();
                for group in strings(&rule["apiGroups"]) {
                    for resource in strings(&rule["resources"]) {
                        for verb in strings(&rule["verbs"]) {
                            out.insert((
                                scope.clone(),
                                group.to_owned(),
                                resource.to_owned(),
                                verb.to_owned(),
                                names.clone(),
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

/// The controller's account may do exactly what it does (nodes, pods and evictions
/// cluster-wide, Events in "default", PolicyReports, its own Lease and state ConfigMap here) and
/// nothing else: no wildcard, no Secret, and updates only to the two objects it owns,
/// which are the ones its flags name.
#[test]
fn the_controller_is_bound_to_exactly_the_permissions_it_uses() {
    let r = default_render();
    let grants = controller_grants(&r);
    let grant = |scope: &str, group: &str, resource: &str, verb: &str, names: &str| {
        (
            scope.to_owned(),
            group.to_owned(),
            resource.to_owned(),
            verb.to_owned(),
            names.to_owned(),
        )
    };
    let mut want = BTreeSet::new();
    for verb in ["get", "list", "watch", "patch"] {
        want.insert(grant("cluster", "", "nodes", verb, ""));
    }
    for verb in ["get", "list", "watch"] {
        want.insert(grant("cluster", "", "pods", verb, ""));
    }
    want.insert(grant("cluster", "", "pods/eviction", "create", ""));
    // Events about Nodes (in "default") and about the Pods it evicts (anywhere).
    for verb in ["create", "patch"] {
        want.insert(grant("cluster", "events.k8s.io", "events", verb, ""));
    }
    // The PolicyReports of what warn and audit policies find: applied and listed, an
    // emptied one kept, never deleted.
    for resource in ["policyreports", "clusterpolicyreports"] {
        for verb in ["get", "list", "create", "patch"] {
            want.insert(grant("cluster", "wgpolicyk8s.io", resource, verb, ""));
        }
    }
    for (group, resource, name) in [
        ("coordination.k8s.io", "leases", CONTROLLER),
        ("", "configmaps", "probity-controller-state"),
    ] {
        want.insert(grant(NAMESPACE, group, resource, "create", ""));
        for verb in ["get", "update"] {
            want.insert(grant(NAMESPACE, group, resource, verb, name));
        }
    }
    assert_eq!(grants, want);
    for (scope, group, resource, verb, names) in &grants {
        let what = format!("{scope} {group}/{resource} {verb} {names}");
        assert!(
            ![group, resource, verb].iter().any(|x| x.contains('*')),
            "{what}"
        );
        assert!(!resource.starts_with("secrets"), "{what}");
        if verb == "update" || verb == "delete" {
            assert!(!names.is_empty(), "{what}: not limited to a name");
        }
    }
    // The names the rules allow are those the controller's flags use.
    let (_, _, args) = controller(&r);
    assert_eq!(flag(&args, "--lease-name"), Some(CONTROLLER));
    assert_eq!(
        flag(&args, "--state-name"),
        Some("probity-controller-state")
    );
    // The webhooks still never judge the release's namespace.
    for doc in webhook_configurations(&r) {
        let selected = &doc["webhooks"][0]["namespaceSelector"]["matchExpressions"][0];
        assert_eq!(selected["operator"], "NotIn");
        assert!(strings(&selected["values"]).contains(&NAMESPACE));
    }
}

#[test]
fn controller_enabled_false_renders_none_of_the_controller() {
    let r = render(&[], &["--set", "controller.enabled=false"]);
    let controllers: Vec<String> =
        r.0.iter()
            .filter(|d| {
                d["metadata"]["labels"]["app.kubernetes.io/component"] == "controller"
                    || d.to_string().contains(CONTROLLER)
            })
            .map(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]))
            .collect();
    assert!(controllers.is_empty(), "{controllers:?}");
    for kind in ["Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"] {
        assert!(r.all(kind).is_empty(), "{kind}: {:?}", r.names());
    }
    // The rest is unchanged.
    assert!(r.find("Deployment", "probity-webhook").is_some());
    assert!(!default_render().all("ClusterRole").is_empty());
}

/// The controller checks Probity's certificate against the CA that signed it: in
/// provided mode webhook.caBundle, decoded into a ConfigMap; in cert-manager mode the
/// ca.crt (alone, not the key) of the Secret cert-manager issues the serving
/// certificate into; controller.caBundle replaces either. --probity-ca is a file of
/// that volume.
#[test]
fn the_controllers_ca_file_is_the_webhooks_ca_in_both_tls_modes() {
    let ca_volume = |r: &Render| -> Value {
        let (spec, container, args) = controller(r);
        let path = Path::new(flag(&args, "--probity-ca").unwrap());
        let volume = mounted_volume(spec, container, path.parent().unwrap())
            .unwrap_or_else(|| panic!("{} is not mounted", path.display()))
            .clone();
        assert!(mount_is_read_only(container, path.parent().unwrap()));
        let file = path.file_name().unwrap().to_str().unwrap();
        let source = if volume["configMap"].is_object() {
            &volume["configMap"]
        } else {
            &volume["secret"]
        };
        assert_eq!(
            source["items"],
            json!([{"key": "ca.crt", "path": file}]),
            "{volume}"
        );
        volume
    };
    // Provided.
    let r = default_render();
    let volume = ca_volume(&r);
    let map = r.one("ConfigMap", volume["configMap"]["name"].as_str().unwrap());
    assert_eq!(map["data"]["ca.crt"], CA_PEM);
    // cert-manager: the serving certificate's Secret, which a rendered Certificate fills.
    let r = render(
        &["webhook: {caBundle: null}"],
        &["--api-versions", "cert-manager.io/v1"],
    );
    let volume = ca_volume(&r);
    let secret = volume["secret"]["secretName"].as_str().unwrap();
    let cert = r.one("Certificate", "probity-webhook-tls");
    assert_eq!(cert["spec"]["secretName"], secret);
    let host = "probity-webhook.probity-system.svc";
    assert!(strings(&cert["spec"]["dnsNames"]).contains(&host));
    let (_, _, args) = controller(&r);
    assert_eq!(
        flag(&args, "--probity-url"),
        Some(format!("https://{host}:443").as_str())
    );
    assert!(r.find("ConfigMap", "probity-controller-ca").is_none());
    // An operator's CA for an operator's URL, in either mode.
    let other =
        "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSU90aGVyCi0tLS0tRU5EIENFUlRJRklDQVRFLS0tLS0K";
    for (values, args) in [
        ("{}", &[][..]),
        (
            "webhook: {caBundle: null}",
            &["--api-versions", "cert-manager.io/v1"][..],
        ),
    ] {
        let over = format!(
            "controller: {{caBundle: \"{other}\", probityUrl: \"https://probity.example:8443/\"}}"
        );
        let r = render(&[values, &over], args);
        let volume = ca_volume(&r);
        let map = r.one("ConfigMap", volume["configMap"]["name"].as_str().unwrap());
        assert_eq!(
            map["data"]["ca.crt"],
            "-----BEGIN CERTIFICATE-----\nMIIOther\n-----END CERTIFICATE-----\n",
            "{values}"
        );
        // The CA is read at start: another CA rolls the replicas.
        let checksum = |r: &Render| {
            r.one("Deployment", CONTROLLER)["spec"]["template"]["metadata"]["annotations"]
                ["checksum/ca"]
                .clone()
        };
        assert!(checksum(&r).is_string());
        assert_ne!(checksum(&r), checksum(&default_render()));
        let (_, _, flags) = controller(&r);
        assert_eq!(
            flag(&flags, "--probity-url"),
            Some("https://probity.example:8443")
        );
    }
    // webhook.url: the controller calls the Probity the webhooks call.
    let r = render(&["webhook: {url: \"https://127.0.0.1:18443/\"}"], &[]);
    let (_, _, args) = controller(&r);
    assert_eq!(
        flag(&args, "--probity-url"),
        Some("https://127.0.0.1:18443")
    );
    // A client certificate of the operator's, mounted and named by both flags.
    let r = render(
        &["controller: {clientSecret: probity-controller-client}"],
        &[],
    );
    let (spec, container, args) = controller(&r);
    for name in ["--probity-cert", "--probity-key"] {
        let path = Path::new(flag(&args, name).unwrap());
        let volume = mounted_volume(spec, container, path.parent().unwrap()).unwrap();
        assert_eq!(
            volume["secret"]["secretName"], "probity-controller-client",
            "{name}"
        );
    }
    let notes = notes(
        &["controller: {clientSecret: probity-controller-client}"],
        &[],
    );
    assert!(notes.contains("- probity-controller-client:"), "{notes}");
    let err = try_render(&["controller: {caBundle: \"bm90IGEgY2VydA==\"}"], &[])
        .err()
        .unwrap();
    assert!(err.contains("controller.caBundle"), "{err}");
}

/// A CRD kind is rendered only when the cluster serves its API.
#[test]
fn the_prometheus_rule_renders_only_with_its_api() {
    assert!(default_render().all("PrometheusRule").is_empty());
    let r = render(&[], &["--api-versions", "monitoring.coreos.com/v1"]);
    let rule = r.workload("PrometheusRule");
    assert!(rule.to_string().contains("probity_state_connected"));
    // A tripped breaker is an alert (it stays tripped until an operator resets it).
    assert!(
        rule.to_string()
            .contains("probity_controller_breaker_tripped")
    );
    let r = render(
        &["controller: {enabled: false}"],
        &["--api-versions", "monitoring.coreos.com/v1"],
    );
    assert!(
        !r.workload("PrometheusRule")
            .to_string()
            .contains("probity_controller")
    );
}

/// The real kube-scheduler (`$PROBITY_KUBE_BIN/kube-scheduler`) loads the rendered
/// configuration, validates it and builds the extender from it (with the TLS files it
/// names), then writes back what it understood: the managed resource and the fail-closed
/// extender survive its defaulting.
#[test]
fn the_real_kube_scheduler_accepts_the_rendered_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["probity-webhook.probity-system.svc".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let ca = file("ca.crt", &cert.pem());
    let key = file("client.key", &key.serialize_pem());
    // Never contacted: the scheduler exits once it has written its configuration.
    let kubeconfig = file(
        "scheduler.conf",
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
         clusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n\
         users: [{name: u, user: {token: unused}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u}}]\n",
    );
    let r = render(
        &[&format!(
            "scheduler: {{leaderElect: false, clientConnection: {{kubeconfig: {kubeconfig}}}, \
             extender: {{tls: {{caFile: {ca}, certFile: {ca}, keyFile: {key}}}}}}}"
        )],
        &[],
    );
    let config = r.one("ConfigMap", "probity-scheduler-config")["data"]["scheduler-config.yaml"]
        .as_str()
        .unwrap();
    let config = file("scheduler-config.yaml", config);
    let written = dir.path().join("written.yaml");
    let scheduler = helm().with_file_name("kube-scheduler");
    // Waits for the scheduler's exit itself; coreutils' timeout bounds it (exit 124).
    let status = Command::new("timeout")
        .arg("120")
        .arg(&scheduler)
        .args(["--config", &config, "--write-config-to"])
        .arg(&written)
        .stdout(std::process::Stdio::null())
        // A file, not a pipe: a chatty scheduler cannot block on a full pipe.
        .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
        .status()
        .unwrap_or_else(|e| panic!("{}: {e}", scheduler.display()));
    assert_ne!(
        status.code(),
        Some(124),
        "kube-scheduler --write-config-to did not exit in 120 s"
    );
    let stderr = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    assert!(
        status.success(),
        "kube-scheduler refused the configuration: {stderr}"
    );
    let understood: Value =
        serde_norway::from_str(&std::fs::read_to_string(&written).unwrap()).unwrap();
    let e = &understood["extenders"][0];
    assert_eq!(e["managedResources"][0]["name"], "nvidia.com/gpu");
    // ignorable false is the default it leaves out; true would be written.
    assert_ne!(e["ignorable"], true, "{e}");
    assert_eq!(e["nodeCacheCapable"], true);
    assert_eq!(understood["leaderElection"]["leaderElect"], false);
}

/// For applying `helm template`'s output with kubectl: the namespace comes first, and
/// only when asked (helm install makes it with --create-namespace).
#[test]
fn the_namespace_is_rendered_first_and_only_when_asked() {
    assert!(default_render().all("Namespace").is_empty());
    let r = render(&["createNamespace: true"], &[]);
    let first = &r.0[0];
    assert_eq!(first["kind"], "Namespace");
    assert_eq!(first["metadata"]["name"], NAMESPACE);
    assert_eq!(
        first["metadata"]["labels"]["kubernetes.io/metadata.name"],
        NAMESPACE
    );
}

#[test]
fn the_mutating_webhook_and_the_extenders_ranking_can_each_be_turned_off() {
    let on = default_render();
    assert_eq!(on.all("MutatingWebhookConfiguration").len(), 1);
    let config = on.config_file("probity-scheduler-config", "scheduler-config.yaml");
    assert_eq!(config["extenders"][0]["prioritizeVerb"], "prioritize");

    let off = render(
        &["{webhook: {mutate: {enabled: false}}, scheduler: {extender: {prioritize: false}}}"],
        &[],
    );
    assert!(off.all("MutatingWebhookConfiguration").is_empty());
    assert_eq!(off.all("ValidatingWebhookConfiguration").len(), 1);
    let config = off.config_file("probity-scheduler-config", "scheduler-config.yaml");
    let extender = &config["extenders"][0];
    assert!(extender.get("prioritizeVerb").is_none(), "{extender}");
    assert_eq!(extender["filterVerb"], "filter");
    assert_eq!(extender["ignorable"], false);
}

/// With a client certificate, the controller's CN may append its actions to the
/// webhook's event log; without one, no such group is rendered.
#[test]
fn the_controllers_certificate_may_record_events_only_when_it_has_one() {
    let r = default_render();
    let (_, _, config) = served_config(&r, "Deployment");
    assert!(!config.auth.groups.contains_key("event-recorders"));
    let r = render(
        &["controller: {clientSecret: probity-controller-client}"],
        &[],
    );
    let (_, _, config) = served_config(&r, "Deployment");
    assert_eq!(
        config.auth.groups.get("event-recorders"),
        Some(&vec!["cn:probity-controller".to_owned()])
    );
    assert_eq!(
        config.auth.groups.get("cluster-reporters"),
        Some(&vec!["cn:probity-controller".to_owned()])
    );
    let r = render(
        &["controller: {clientSecret: probity-controller-client, clientCN: ops-controller}"],
        &[],
    );
    let (_, _, config) = served_config(&r, "Deployment");
    assert_eq!(
        config.auth.groups.get("event-recorders"),
        Some(&vec!["cn:ops-controller".to_owned()])
    );
}

/// The report kinds are installed with the chart unless told otherwise, and the
/// controller writes reports on the configured interval, or never.
#[test]
fn the_policy_report_crds_come_with_the_chart_and_can_be_left_to_another_engine() {
    let r = default_render();
    let crds: Vec<&str> = r
        .all("CustomResourceDefinition")
        .iter()
        .map(|c| c["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        crds,
        [
            "policyreports.wgpolicyk8s.io",
            "clusterpolicyreports.wgpolicyk8s.io"
        ]
    );
    let args = |r: &Render| -> Vec<String> {
        let d = r.one("Deployment", CONTROLLER);
        d["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    assert!(args(&r).contains(&"--report-interval-seconds=60".to_owned()));
    let r = render(&["controller: {reports: {installCRDs: false}}"], &[]);
    assert!(r.all("CustomResourceDefinition").is_empty());
    let r = render(&["controller: {reports: {enabled: false}}"], &[]);
    assert!(args(&r).contains(&"--report-interval-seconds=0".to_owned()));
}
