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
            assert_eq!(hook["sideEffects"], "None", "{name}");
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
