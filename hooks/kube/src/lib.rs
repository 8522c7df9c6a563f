//! Probity's side of the Kubernetes API.
//!
//! Probity is called by Kubernetes (the admission webhook and the scheduler extender in
//! `probity-server`); this crate is where it calls Kubernetes back. Today that is:
//!
//! - [`Cluster::from_kubeconfig`]: a client from a kubeconfig file, never from the
//!   in-cluster Service address (clients reach the apiserver the way the kubeconfig says);
//! - [`Cluster::apply`]: server-side apply of rendered manifests (a Helm chart's output),
//!   so that the apiserver's own validation judges every object;
//! - [`mounted_objects`]: the ConfigMaps, Secrets and ServiceAccounts a workload cannot
//!   start without, so an install can be checked for what it forgot to create.
//!
//! Manifests are untrusted text: each error names the document (counted from 1) and the
//! object it was about.

pub mod controller;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiCapabilities, ApiResource, Scope};
use serde::Deserialize;
use serde_json::Value;

/// Who retries a request the apiserver answers 429, 503 or 504.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retries {
    /// The client, honouring `Retry-After`, up to 15 times: a call may wait minutes.
    Client,
    /// The caller: every answer comes back at once. The controller's choice, since an
    /// eviction a disruption budget refuses is answered 429 with `Retry-After`, and the
    /// controller must report it and go on, not stall its pass.
    Caller,
}

/// Who retries, and for a caller that retries itself a bound on each call: the kube
/// client waits for an answer without limit by default, and a controller's pass must not.
fn configure(config: &mut kube::Config, retries: Retries) {
    config.default_retry = retries == Retries::Client;
    if retries == Retries::Caller {
        config.read_timeout = Some(std::time::Duration::from_secs(30));
    }
}

/// What went wrong talking to Kubernetes or reading manifests.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig could not be read or used.
    #[error("kubeconfig {path}")]
    Kubeconfig {
        /// The file given.
        path: PathBuf,
        /// Why it was refused.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig was given and this is not a pod with a service account.
    #[error("no kubeconfig given, and no in-cluster service account to use")]
    InCluster {
        /// Why the in-cluster configuration was refused.
        #[source]
        source: kube::config::InClusterError,
    },
    /// A client could not be built from a readable kubeconfig.
    #[error("client from kubeconfig {path}")]
    Client {
        /// The file given.
        path: PathBuf,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// A manifest document is not an object Kubernetes could take.
    #[error("manifest document {document}: {reason}")]
    Manifest {
        /// The document's position in the text, from 1.
        document: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The apiserver does not serve the object's kind.
    #[error("manifest document {document}: the apiserver does not serve {api_version} {kind}")]
    Discovery {
        /// The document's position in the text, from 1.
        document: usize,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
        /// The apiserver's answer.
        #[source]
        source: kube::Error,
    },
    /// The apiserver refused the object.
    #[error("manifest document {document}: applying {kind} {name}")]
    Apply {
        /// The document's position in the text, from 1.
        document: usize,
        /// Its kind.
        kind: String,
        /// `namespace/name`, or the name of a cluster-scoped object.
        name: String,
        /// The apiserver's answer, with its reason.
        #[source]
        source: kube::Error,
    },
}

/// One Kubernetes object of a manifest: its document number and its JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// Position in the text, from 1 (empty documents count).
    pub document: usize,
    /// The object.
    pub object: Value,
}

impl Manifest {
    /// The object's kind, or "" when it has none.
    pub fn kind(&self) -> &str {
        at(&self.object, "/kind").as_str().unwrap_or_default()
    }

    /// The object's name, or "" when it has none.
    pub fn name(&self) -> &str {
        at(&self.object, "/metadata/name")
            .as_str()
            .unwrap_or_default()
    }

    /// The object's namespace, when the manifest gives one.
    pub fn namespace(&self) -> Option<&str> {
        at(&self.object, "/metadata/namespace").as_str()
    }
}

/// Splits multi-document YAML into objects, skipping empty documents (Helm renders some).
///
/// Every object must have `apiVersion`, `kind` and `metadata.name`.
pub fn parse_manifests(text: &str) -> Result<Vec<Manifest>, KubeError> {
    let mut out = Vec::new();
    for (index, document) in serde_norway::Deserializer::from_str(text).enumerate() {
        let document_number = index + 1;
        let object = Value::deserialize(document).map_err(|e| KubeError::Manifest {
            document: document_number,
            reason: e.to_string(),
        })?;
        if object.is_null() {
            continue;
        }
        let manifest = Manifest {
            document: document_number,
            object,
        };
        for (field, present) in [
            (
                "apiVersion",
                at(&manifest.object, "/apiVersion").is_string(),
            ),
            ("kind", !manifest.kind().is_empty()),
            ("metadata.name", !manifest.name().is_empty()),
        ] {
            if !present {
                return Err(KubeError::Manifest {
                    document: document_number,
                    reason: format!("no {field}"),
                });
            }
        }
        out.push(manifest);
    }
    Ok(out)
}

/// The value at a JSON pointer, or null: manifests are untrusted, a missing field is data.
fn at<'a>(value: &'a Value, pointer: &str) -> &'a Value {
    value.pointer(pointer).unwrap_or(&Value::Null)
}

/// The value of one key of an object, or null.
fn at_key<'a>(value: &'a Value, key: &str) -> &'a Value {
    value.get(key).unwrap_or(&Value::Null)
}

/// A client of one cluster's apiserver.
#[derive(Clone)]
pub struct Cluster {
    client: kube::Client,
}

impl Cluster {
    /// A client from the kubeconfig at `path`, retrying transient answers (429, 503,
    /// 504) itself, as the kube client does by default.
    pub async fn from_kubeconfig(path: &Path) -> Result<Cluster, KubeError> {
        Cluster::from_kubeconfig_with(path, Retries::Client).await
    }

    /// A client from the kubeconfig at `path`, with `retries` saying who retries.
    pub async fn from_kubeconfig_with(path: &Path, retries: Retries) -> Result<Cluster, KubeError> {
        let kubeconfig = Kubeconfig::read_from(path).map_err(|source| KubeError::Kubeconfig {
            path: path.to_owned(),
            source,
        })?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| KubeError::Kubeconfig {
                    path: path.to_owned(),
                    source,
                })?;
        configure(&mut config, retries);
        let client = kube::Client::try_from(config).map_err(|source| KubeError::Client {
            path: path.to_owned(),
            source,
        })?;
        Ok(Cluster { client })
    }

    /// A client from the pod's own service account (the controller in the cluster).
    pub fn in_cluster(retries: Retries) -> Result<Cluster, KubeError> {
        let path = PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount");
        let mut config =
            kube::Config::incluster().map_err(|source| KubeError::InCluster { source })?;
        configure(&mut config, retries);
        let client =
            kube::Client::try_from(config).map_err(|source| KubeError::Client { path, source })?;
        Ok(Cluster { client })
    }

    /// The underlying client, for typed calls (`kube::Api`).
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// Applies `manifests` server-side as `field_manager`, in order, taking ownership of
    /// conflicting fields (an install owns what it renders). Namespaced objects without a
    /// namespace go into `default_namespace`. Stops at the first refusal, which names the
    /// document and the object; returns `namespace/name` of each object applied.
    pub async fn apply(
        &self,
        manifests: &[Manifest],
        default_namespace: &str,
        field_manager: &str,
    ) -> Result<Vec<String>, KubeError> {
        let params = PatchParams::apply(field_manager).force();
        let mut applied = Vec::new();
        // One discovery call per kind, not per object: a chart renders many of a kind.
        let mut discovered: HashMap<(String, String), (ApiResource, ApiCapabilities)> =
            HashMap::new();
        for manifest in manifests {
            let api_version = at(&manifest.object, "/apiVersion")
                .as_str()
                .unwrap_or_default();
            let key = (api_version.to_owned(), manifest.kind().to_owned());
            let (resource, capabilities) = match discovered.get(&key) {
                Some(known) => known.clone(),
                None => {
                    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
                    let gvk = GroupVersionKind::gvk(group, version, manifest.kind());
                    let found = kube::discovery::pinned_kind(&self.client, &gvk)
                        .await
                        .map_err(|source| KubeError::Discovery {
                            document: manifest.document,
                            api_version: api_version.to_owned(),
                            kind: manifest.kind().to_owned(),
                            source,
                        })?;
                    discovered.insert(key, found.clone());
                    found
                }
            };
            let (api, shown): (Api<DynamicObject>, String) = match capabilities.scope {
                Scope::Namespaced => {
                    let namespace = manifest.namespace().unwrap_or(default_namespace);
                    (
                        Api::namespaced_with(self.client.clone(), namespace, &resource),
                        format!("{namespace}/{}", manifest.name()),
                    )
                }
                Scope::Cluster => (
                    Api::all_with(self.client.clone(), &resource),
                    manifest.name().to_owned(),
                ),
            };
            api.patch(manifest.name(), &params, &Patch::Apply(&manifest.object))
                .await
                .map_err(|source| KubeError::Apply {
                    document: manifest.document,
                    kind: manifest.kind().to_owned(),
                    name: shown.clone(),
                    source,
                })?;
            applied.push(shown);
        }
        Ok(applied)
    }
}

/// An object a workload needs before any of its pods can start.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MountedObject {
    /// `ConfigMap`, `Secret` or `ServiceAccount`.
    pub kind: &'static str,
    /// Its namespace (the workload's).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// `Kind/name` of the workload that needs it.
    pub needed_by: String,
}

/// The ConfigMaps, Secrets and ServiceAccounts that the workloads among `manifests`
/// (Pods, Deployments, DaemonSets, StatefulSets, ReplicaSets, Jobs, CronJobs) need and
/// do not mark `optional`: volumes (also projected), `env` and `envFrom`, and
/// `serviceAccountName`. A namespaced workload without a namespace is in
/// `default_namespace`.
pub fn mounted_objects(manifests: &[Manifest], default_namespace: &str) -> Vec<MountedObject> {
    let mut out = Vec::new();
    for manifest in manifests {
        let spec = at(&manifest.object, "/spec");
        let pod_spec = match manifest.kind() {
            "Pod" => spec,
            "Deployment" | "DaemonSet" | "StatefulSet" | "ReplicaSet" | "Job" => {
                at(spec, "/template/spec")
            }
            "CronJob" => at(spec, "/jobTemplate/spec/template/spec"),
            _ => continue,
        };
        let namespace = manifest.namespace().unwrap_or(default_namespace);
        let needed_by = format!("{}/{}", manifest.kind(), manifest.name());
        let mut need = |kind: &'static str, reference: &Value, name_field: &str| {
            if at(reference, "/optional").as_bool() == Some(true) {
                return;
            }
            if let Some(name) = at_key(reference, name_field).as_str() {
                out.push(MountedObject {
                    kind,
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    needed_by: needed_by.clone(),
                });
            }
        };
        if let Some(account) = pod_spec.get("serviceAccountName") {
            need(
                "ServiceAccount",
                &serde_json::json!({"name": account}),
                "name",
            );
        }
        for volume in at(pod_spec, "/volumes").as_array().into_iter().flatten() {
            need("ConfigMap", at(volume, "/configMap"), "name");
            need("Secret", at(volume, "/secret"), "secretName");
            for source in at(volume, "/projected/sources")
                .as_array()
                .into_iter()
                .flatten()
            {
                need("ConfigMap", at(source, "/configMap"), "name");
                need("Secret", at(source, "/secret"), "name");
            }
        }
        let containers = ["initContainers", "containers"]
            .into_iter()
            .flat_map(|field| at_key(pod_spec, field).as_array().into_iter().flatten());
        for container in containers {
            for env in at(container, "/env").as_array().into_iter().flatten() {
                need("ConfigMap", at(env, "/valueFrom/configMapKeyRef"), "name");
                need("Secret", at(env, "/valueFrom/secretKeyRef"), "name");
            }
            for from in at(container, "/envFrom").as_array().into_iter().flatten() {
                need("ConfigMap", at(from, "/configMapRef"), "name");
                need("Secret", at(from, "/secretRef"), "name");
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;

    #[test]
    fn manifests_skip_empty_documents_and_count_them() {
        let text =
            "---\n# only a comment\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n";
        let parsed = parse_manifests(text).unwrap();
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].document, 2);
        assert_eq!(parsed[0].kind(), "ConfigMap");
    }

    #[test]
    fn a_manifest_without_a_name_is_refused_naming_its_document() {
        let text = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Secret\nmetadata: {}\n";
        let err = parse_manifests(text).unwrap_err().to_string();
        assert_eq!(err, "manifest document 2: no metadata.name");
    }

    #[test]
    fn malformed_yaml_is_refused_naming_its_document() {
        let err = parse_manifests("a: [1, 2\n").unwrap_err().to_string();
        assert!(err.starts_with("manifest document 1: "), "{err}");
    }

    /// What `helm template` writes, cut at every byte: objects or an error, never a panic
    /// (the fuzz target `manifests` runs the same functions on arbitrary bytes).
    #[test]
    fn manifests_cut_anywhere_parse_or_name_the_document() {
        let text = "---\n# Source: probity/templates/a.yaml\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n  namespace: ns\ndata:\n  k: \"v: [1\"\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n    spec:\n      volumes: [{name: x, configMap: {name: a}}]\n";
        assert_eq!(parse_manifests(text).unwrap().len(), 2);
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            match parse_manifests(&text[..cut]) {
                Ok(manifests) => {
                    let _ = mounted_objects(&manifests, "default");
                }
                Err(KubeError::Manifest { document, .. }) => assert!(document >= 1),
                Err(other) => panic!("cut at {cut}: {other}"),
            }
        }
    }

    #[test]
    fn a_deployment_needs_its_volumes_env_and_account_but_not_optional_ones() {
        let text = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: ns}
spec:
  template:
    spec:
      serviceAccountName: web
      volumes:
        - {name: a, configMap: {name: cm-a}}
        - {name: b, secret: {secretName: sec-b}}
        - {name: c, secret: {secretName: sec-optional, optional: true}}
        - name: d
          projected: {sources: [{configMap: {name: cm-d}}, {secret: {name: sec-d}}]}
      containers:
        - name: c
          env: [{name: X, valueFrom: {secretKeyRef: {name: sec-env, key: k}}}]
          envFrom: [{configMapRef: {name: cm-env}}]
"#;
        let needed = mounted_objects(&parse_manifests(text).unwrap(), "default");
        let names: Vec<String> = needed
            .iter()
            .map(|m| format!("{} {}/{}", m.kind, m.namespace, m.name))
            .collect();
        assert_eq!(
            names,
            [
                "ConfigMap ns/cm-a",
                "ConfigMap ns/cm-d",
                "ConfigMap ns/cm-env",
                "Secret ns/sec-b",
                "Secret ns/sec-d",
                "Secret ns/sec-env",
                "ServiceAccount ns/web",
            ]
        );
        assert!(needed.iter().all(|m| m.needed_by == "Deployment/web"));
    }
}
