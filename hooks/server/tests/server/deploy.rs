//! The Kubernetes manifests in hooks/deploy follow the webhook rules: failurePolicy Fail,
//! a short timeout, no side effects, v1 reviews, and Probity's own and the system
//! namespaces excluded; and the webhook CA is injected from the certificate the
//! webhook serves with.

use serde::Deserialize;
use serde_json::Value;

use crate::root;

fn documents() -> Vec<(String, Value)> {
    let dir = root().join("hooks/deploy");
    let mut docs = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for path in files
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
    {
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_norway::Deserializer::from_str(&text) {
            let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if !v.is_null() {
                docs.push((path.file_name().unwrap().to_string_lossy().into_owned(), v));
            }
        }
    }
    docs
}

#[test]
fn webhooks_fail_closed_quickly_without_side_effects_and_skip_system_namespaces() {
    let docs = documents();
    let mut kinds: Vec<&str> = docs
        .iter()
        .map(|(_, d)| d["kind"].as_str().unwrap())
        .collect();
    kinds.sort_unstable();
    for want in [
        "DaemonSet",
        "Deployment",
        "MutatingWebhookConfiguration",
        "Service",
        "ValidatingWebhookConfiguration",
    ] {
        assert!(
            kinds.contains(&want),
            "no {want} in hooks/deploy: {kinds:?}"
        );
    }
    let mut webhooks = 0;
    for (file, doc) in &docs {
        let kind = doc["kind"].as_str().unwrap();
        if !kind.ends_with("WebhookConfiguration") {
            continue;
        }
        for hook in doc["webhooks"].as_array().unwrap() {
            webhooks += 1;
            let name = format!("{file}: {}", hook["name"]);
            assert_eq!(hook["failurePolicy"], "Fail", "{name}");
            let timeout = hook["timeoutSeconds"].as_u64().unwrap();
            assert!(
                (1..=10).contains(&timeout),
                "{name}: timeoutSeconds {timeout}"
            );
            // The validating hook remembers admitted pods for their bindings.
            let side_effects = if name.contains("validate.probity.io") {
                "NoneOnDryRun"
            } else {
                "None"
            };
            assert_eq!(hook["sideEffects"], side_effects, "{name}");
            assert_eq!(
                hook["admissionReviewVersions"],
                serde_json::json!(["v1"]),
                "{name}"
            );
            let path = hook["clientConfig"]["service"]["path"].as_str().unwrap();
            let want = if kind.starts_with("Mutating") {
                "/v1/admission/mutate"
            } else {
                "/v1/admission/validate"
            };
            assert_eq!(path, want, "{name}");
            let excluded: Vec<&str> = hook["namespaceSelector"]["matchExpressions"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["key"] == "kubernetes.io/metadata.name" && e["operator"] == "NotIn")
                .flat_map(|e| {
                    e["values"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_str().unwrap())
                })
                .collect();
            for ns in ["kube-system", "probity-system"] {
                assert!(excluded.contains(&ns), "{name} does not exclude {ns}");
            }
        }
    }
    assert_eq!(webhooks, 2);
}

#[test]
fn the_sidecar_shares_its_socket_directory_through_a_volume() {
    let docs = documents();
    let (_, ds) = docs.iter().find(|(_, d)| d["kind"] == "DaemonSet").unwrap();
    let spec = &ds["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let socket = args
        .iter()
        .position(|a| *a == "--socket")
        .map(|i| args[i + 1])
        .unwrap();
    let dir = std::path::Path::new(socket)
        .parent()
        .unwrap()
        .to_str()
        .unwrap();
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir)
        .unwrap();
    let volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert!(
        volume.get("hostPath").is_some() || volume.get("emptyDir").is_some(),
        "{volume}"
    );
}

#[test]
fn the_webhook_ca_comes_from_the_certificate_the_deployment_serves_with() {
    let docs = documents();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .map(|(_, d)| d)
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in hooks/deploy"))
    };
    // The serving certificate: its Secret is what the webhook Deployment mounts, and
    // it names the Service the webhook configurations call.
    let service = find("Service", "probity-webhook");
    let dns = format!(
        "probity-webhook.{}.svc",
        service["metadata"]["namespace"].as_str().unwrap()
    );
    let cert = find("Certificate", "probity-webhook-tls");
    let secret = cert["spec"]["secretName"].as_str().unwrap();
    let names: Vec<&str> = cert["spec"]["dnsNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(names.contains(&dns.as_str()), "{names:?} lacks {dns}");
    let deployment = docs
        .iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == "Deployment")
        .unwrap();
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
    // Its issuer chain is defined here too.
    let issuer = cert["spec"]["issuerRef"]["name"].as_str().unwrap();
    find("Issuer", issuer);
    // Both webhook configurations take their CA from it, and none carries a stale or
    // empty caBundle beside the injection.
    let inject = format!(
        "{}/{}",
        cert["metadata"]["namespace"].as_str().unwrap(),
        "probity-webhook-tls"
    );
    for (file, doc) in &docs {
        if !doc["kind"]
            .as_str()
            .unwrap()
            .ends_with("WebhookConfiguration")
        {
            continue;
        }
        assert_eq!(
            doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"], inject,
            "{file}"
        );
        for hook in doc["webhooks"].as_array().unwrap() {
            assert!(
                hook["clientConfig"].get("caBundle").is_none(),
                "{file}: {} sets caBundle",
                hook["name"]
            );
        }
    }
}

/// The node agent runs beside `probity serve` in the sidecar pod, with the host's view
/// it needs and no more: the host's network namespace (its firewall and sockets), the
/// host's /proc, powercap tree and audit log read-only, the GPUs through the NVIDIA
/// runtime, and CAP_NET_ADMIN as its only capability; the server gets none of these.
#[test]
fn the_agent_sees_the_host_read_only_with_net_admin_alone() {
    let docs = documents();
    let (_, ds) = docs.iter().find(|(_, d)| d["kind"] == "DaemonSet").unwrap();
    let spec = &ds["spec"]["template"]["spec"];
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
    for (c, adds) in [
        (agent, serde_json::json!(["NET_ADMIN"])),
        (serve, Value::Null),
    ] {
        let sc = &c["securityContext"];
        assert_ne!(sc["privileged"], true, "{}", c["name"]);
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{}", c["name"]);
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{}", c["name"]);
        assert_eq!(
            sc["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{}",
            c["name"]
        );
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
    // The agent's configuration is in a mounted volume.
    let args: Vec<&str> = agent["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let config = args[args.iter().position(|a| *a == "--config").unwrap() + 1];
    assert!(
        mounts
            .iter()
            .any(|m| config.starts_with(m["mountPath"].as_str().unwrap())),
        "{config} is in no volume"
    );
}

#[tokio::test]
async fn the_scheduler_configuration_wires_the_extender_to_routes_that_exist() {
    let docs = documents();
    let (_, config) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "KubeSchedulerConfiguration")
        .expect("hooks/deploy has a KubeSchedulerConfiguration");
    assert_eq!(config["apiVersion"], "kubescheduler.config.k8s.io/v1");
    let extenders = config["extenders"].as_array().unwrap();
    assert_eq!(extenders.len(), 1);
    let e = &extenders[0];
    let prefix = e["urlPrefix"].as_str().unwrap();
    assert!(
        prefix.starts_with("https://probity-webhook.probity-system.svc"),
        "{prefix}"
    );
    assert_eq!(e["nodeCacheCapable"], true, "node names only");
    assert_eq!(e["ignorable"], false, "the extender fails closed");
    assert_eq!(e["enableHTTPS"], true);
    let weight = e["weight"].as_i64().unwrap();
    assert!((1..=100).contains(&weight), "weight {weight}");
    let timeout = e["httpTimeout"].as_str().unwrap();
    let secs: u64 = timeout.trim_end_matches('s').parse().unwrap();
    assert!((1..=10).contains(&secs), "httpTimeout {timeout}");
    // Each verb is a route the server answers (a bad body gets the extender's error,
    // not "no such route").
    let path = prefix.split_once(".svc:443").unwrap().1;
    let s = crate::state();
    for verb in ["filterVerb", "prioritizeVerb"] {
        let uri = format!("{path}/{}", e[verb].as_str().unwrap());
        let (status, out) = crate::call(
            &s,
            axum::http::Method::POST,
            &uri,
            Some(&serde_json::json!({})),
            None,
        )
        .await;
        assert_eq!(status, axum::http::StatusCode::BAD_REQUEST, "{uri}: {out}");
        assert!(
            out["Error"].as_str().unwrap().contains("ExtenderArgs"),
            "{uri}: {out}"
        );
    }
    // The validating webhook also sees bindings, the extender's backstop.
    let validating = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ValidatingWebhookConfiguration")
        .unwrap();
    assert!(
        validating.1.to_string().contains("pods/binding"),
        "the validating webhook does not check bindings"
    );
}

/// A workload's pod spec, its first container, and the server configuration it reads
/// (`--config`, from a mounted ConfigMap), parsed as `probity serve` parses it.
fn served_config<'a>(
    docs: &'a [(String, Value)],
    kind: &str,
) -> (&'a Value, &'a Value, probity_server::Config) {
    let (_, workload) = docs
        .iter()
        .find(|(_, d)| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in hooks/deploy"));
    let spec = &workload["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|a| {
            let a = a.as_str().unwrap();
            match a.split_once('=') {
                Some((k, v)) if k.starts_with("--") => vec![k.to_owned(), v.to_owned()],
                _ => vec![a.to_owned()],
            }
        })
        .collect();
    let path = args
        .iter()
        .position(|a| a == "--config")
        .map(|i| args[i + 1].clone())
        .unwrap_or_else(|| panic!("{kind}: no --config"));
    let path = std::path::Path::new(&path);
    let volume = mounted_volume(spec, container, path.parent().unwrap())
        .unwrap_or_else(|| panic!("{kind}: {} is not mounted", path.display()));
    let map = volume["configMap"]["name"]
        .as_str()
        .unwrap_or_else(|| panic!("{kind}: the configuration is not a ConfigMap: {volume}"));
    let (_, config_map) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ConfigMap" && d["metadata"]["name"] == map)
        .unwrap_or_else(|| panic!("no ConfigMap {map} in hooks/deploy"));
    let file = path.file_name().unwrap().to_str().unwrap();
    let text = config_map["data"][file]
        .as_str()
        .unwrap_or_else(|| panic!("ConfigMap {map} has no {file}"));
    let config = probity_server::Config::from_toml(text)
        .unwrap_or_else(|e| panic!("ConfigMap {map} {file}: {e}"));
    (spec, container, config)
}

/// The volume mounted at `dir` (exactly) in `container`, and whether it is read-only.
fn mounted_volume<'a>(
    spec: &'a Value,
    container: &Value,
    dir: &std::path::Path,
) -> Option<&'a Value> {
    let mount = container["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["mountPath"].as_str().map(std::path::Path::new) == Some(dir))?;
    spec["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])
}

fn mount_is_read_only(container: &Value, dir: &std::path::Path) -> bool {
    container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str().map(std::path::Path::new) == Some(dir))
        .is_some_and(|m| m["readOnly"] == true)
}

#[test]
fn sidecars_and_webhooks_reach_etcd_with_client_certificates_from_a_secret() {
    use probity_server::{StateBackendKind, StateRole};
    let docs = documents();
    for (kind, role) in [
        ("DaemonSet", StateRole::Sidecar),
        ("Deployment", StateRole::Webhook),
    ] {
        let (spec, container, mut config) = served_config(&docs, kind);
        let s = &config.state;
        assert_eq!(s.backend, StateBackendKind::Etcd, "{kind}");
        assert_eq!(s.role, role, "{kind}");
        assert!(!s.endpoints.is_empty(), "{kind}: no etcd endpoints");
        for e in &s.endpoints {
            assert!(!e.starts_with("http://"), "{kind}: plain-text endpoint {e}");
        }
        // CA, certificate and key: files of one Secret, mounted read-only, mode 0400.
        let files = [&s.ca_file, &s.cert_file, &s.key_file].map(|f| {
            f.clone()
                .unwrap_or_else(|| panic!("{kind}: [state] lacks a TLS file"))
        });
        for file in &files {
            let dir = file.parent().unwrap();
            let volume = mounted_volume(spec, container, dir)
                .unwrap_or_else(|| panic!("{kind}: {} is not mounted", dir.display()));
            assert!(
                volume["secret"]["secretName"].is_string(),
                "{kind}: {} does not come from a Secret: {volume}",
                file.display()
            );
            assert_eq!(
                volume["secret"]["defaultMode"],
                0o400,
                "{kind}: {} is not mode 0400",
                file.display()
            );
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
            StateRole::Webhook => {
                // A non-root user reads the 0400 files through fsGroup's group read.
                let user = &container["securityContext"]["runAsUser"];
                if user.as_u64().is_some_and(|u| u != 0) {
                    assert_eq!(&spec["securityContext"]["fsGroup"], user, "{kind}");
                }
            }
        }
        // Whatever the flags add, the file alone must be a configuration that starts.
        config.server.socket = std::path::PathBuf::from("/run/probity/lint.sock");
        config.validate().unwrap_or_else(|e| panic!("{kind}: {e}"));
        // The state directory is mounted writable.
        let dir = config.integrity.state_dir.clone().unwrap();
        let volume = mounted_volume(spec, container, &dir)
            .unwrap_or_else(|| panic!("{kind}: state_dir {} is not mounted", dir.display()));
        assert!(!mount_is_read_only(container, &dir), "{kind}: {volume}");
    }
}

#[test]
fn the_sidecar_keeps_its_state_on_the_host_so_verify_works_out_of_the_box() {
    let docs = documents();
    let (spec, container, config) = served_config(&docs, "DaemonSet");
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
    assert!(mounted_volume(spec, container, key.parent().unwrap()).is_some());
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

/// Issue 28 item 5: the webhook's apiserver was anonymous. The shipped
/// AdmissionConfiguration gives both webhook plugins one kubeconfig whose user is the
/// webhook Service's DNS name, with a client certificate.
#[test]
fn the_apiserver_presents_a_client_certificate_to_the_webhook_service() {
    let docs = documents();
    let of = |kind: &str| -> Vec<&Value> {
        docs.iter()
            .filter(|(f, v)| f == "apiserver-admission-config.yaml" && v["kind"] == kind)
            .map(|(_, v)| v)
            .collect()
    };
    let admission = of("AdmissionConfiguration");
    let plugins = admission[0]["plugins"].as_array().unwrap();
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
        assert!(
            p["configuration"]["kubeConfigFile"]
                .as_str()
                .unwrap()
                .ends_with(".yaml")
        );
    }
    let service = docs
        .iter()
        .find(|(_, v)| v["kind"] == "Service" && v["metadata"]["name"] == "probity-webhook")
        .map(|(_, v)| v)
        .unwrap();
    let host = format!(
        "{}.{}.svc",
        service["metadata"]["name"].as_str().unwrap(),
        service["metadata"]["namespace"].as_str().unwrap()
    );
    let kubeconfig = of("Config");
    let user = &kubeconfig[0]["users"][0];
    assert_eq!(user["name"], host.as_str());
    assert!(user["user"]["client-certificate"].is_string());
    assert!(user["user"]["client-key"].is_string());
}
