//! The [`Actuator`] for Kubernetes: a Probity-owned taint and annotation on the Node,
//! an Event for each change, evictions through `policy/v1`.
//!
//! Taints are a list the apiserver merges as a whole, so every change is a merge patch
//! carrying the `resourceVersion` it was computed from: a node someone else changed in
//! between is read again, and their taints and cordon are written back exactly as found.

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod, Taint};
use kube::api::{
    Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams, Preconditions,
};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use serde_json::json;

use super::ControllerError;
use super::actuate::{Actuator, Outcome, PodRef};
use super::plan::AppliedMark;

/// The annotation naming the block record a node's taint stands for.
pub const BLOCK_ANNOTATION: &str = "probity.io/block";

/// Most times a node change is computed again after a conflicting write.
const CONFLICT_RETRIES: usize = 5;

/// Probity's taint: its key and effect (the settings `block_taint_key` and
/// `block_taint_effect`; the default policies exempt pods that tolerate it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTaint {
    /// The taint's key.
    pub key: String,
    /// `NoSchedule` (the default) or `NoExecute` (deletes running pods without asking
    /// their disruption budgets: an explicit opt-in).
    pub effect: String,
}

impl Default for BlockTaint {
    fn default() -> Self {
        Self {
            key: "probity.io/blocked".into(),
            effect: "NoSchedule".into(),
        }
    }
}

impl BlockTaint {
    /// Refuses a taint Kubernetes would refuse or that would keep nothing off the node.
    pub fn check(&self) -> Result<(), String> {
        let (prefix, name) = self.key.rsplit_once('/').unwrap_or(("", &self.key));
        let name_ok = !name.is_empty()
            && name.len() <= 63
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name.ends_with(|c: char| c.is_ascii_alphanumeric());
        let prefix_ok = prefix.len() <= 253
            && prefix
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'));
        if !(name_ok && prefix_ok) || (self.key.contains('/') && prefix.is_empty()) {
            return Err(format!("{:?} is not a taint key", self.key));
        }
        if !matches!(self.effect.as_str(), "NoSchedule" | "NoExecute") {
            return Err(format!(
                "taint effect {:?}: only NoSchedule or NoExecute keep work off a blocked node",
                self.effect
            ));
        }
        Ok(())
    }

    fn matches(&self, taint: &Taint) -> bool {
        taint.key == self.key && taint.effect == self.effect
    }
}

/// A change of a node: Probity's annotation (None removes it) and, when they change,
/// the whole list of its taints.
struct NodeChange {
    annotation: Option<String>,
    taints: Option<Vec<Taint>>,
}

#[cfg(test)]
mod tests {
    use super::BlockTaint;

    #[test]
    fn a_taint_kubernetes_would_refuse_or_that_keeps_nothing_off_is_refused() {
        let taint = |key: &str, effect: &str| BlockTaint {
            key: key.into(),
            effect: effect.into(),
        };
        assert!(taint("probity.io/blocked", "NoSchedule").check().is_ok());
        assert!(taint("blocked", "NoExecute").check().is_ok());
        for key in [
            "",
            "/blocked",
            "probity.io/",
            "Probity.IO/x",
            "a b",
            "x/-y",
            &"k".repeat(64),
        ] {
            let err = taint(key, "NoSchedule").check().unwrap_err();
            assert!(err.contains("not a taint key"), "{key}: {err}");
        }
        let err = taint("probity.io/blocked", "PreferNoSchedule")
            .check()
            .unwrap_err();
        assert!(err.contains("only NoSchedule or NoExecute"), "{err}");
    }
}

/// A node's taints as they are (none: an empty list).
fn node_taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// The delete precondition that makes sure the pod meant is the pod stopped: a pod
/// recreated under the same name has another uid.
fn same_pod(pod: &PodRef) -> Option<Preconditions> {
    pod.uid.clone().map(|uid| Preconditions {
        uid: Some(uid),
        resource_version: None,
    })
}

/// Kubernetes' levers.
#[derive(Clone)]
pub struct KubeActuator {
    client: Client,
    taint: BlockTaint,
    recorder: Recorder,
}

impl KubeActuator {
    /// An actuator over `client`, reporting Events as `instance` of `probity-controller`.
    pub fn new(client: Client, taint: BlockTaint, instance: &str) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "probity-controller".into(),
                instance: Some(instance.to_owned()),
            },
        );
        Self {
            client,
            taint,
            recorder,
        }
    }

    /// The same actuator setting `taint` (Probity's settings name it, and may change).
    pub fn with_taint(&self, taint: BlockTaint) -> KubeActuator {
        KubeActuator {
            taint,
            ..self.clone()
        }
    }

    async fn event(&self, node: &Node, type_: EventType, reason: &str, action: &str, note: String) {
        self.publish(&node.object_ref(&()), type_, reason, action, note)
            .await;
    }

    /// An Event on the pod a stop evicted or deleted, in its namespace: whoever looks at
    /// the pod (or its owner, recreating it) sees why it went.
    async fn pod_event(&self, pod: &PodRef, reason: &str, action: &str, note: String) {
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid: pod.uid.clone(),
            ..ObjectReference::default()
        };
        self.publish(&regarding, EventType::Warning, reason, action, note)
            .await;
    }

    async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        // An Event is a courtesy to whoever looks at the object; the taint and the
        // controller's report are the record, so a refused Event is only logged.
        if let Err(error) = self.recorder.publish(&event, regarding).await {
            tracing::warn!(object = regarding.name.as_deref().unwrap_or(""), %error, "publishing an Event failed");
        }
    }

    /// Reads the node, computes its change and writes it with the read's
    /// `resourceVersion`, again after a conflict.
    async fn change_node(
        &self,
        name: &str,
        change: impl Fn(&Node) -> Option<NodeChange>,
    ) -> Result<Option<Node>, ControllerError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        for _ in 0..CONFLICT_RETRIES {
            let node = nodes
                .get(name)
                .await
                .map_err(|source| ControllerError::kube(format!("reading node {name}"), source))?;
            let Some(change) = change(&node) else {
                return Ok(None);
            };
            let mut spec = serde_json::Map::new();
            if let Some(taints) = change.taints {
                spec.insert("taints".into(), json!(taints));
            }
            let patch = json!({
                "metadata": {
                    "resourceVersion": node.metadata.resource_version,
                    "annotations": {BLOCK_ANNOTATION: change.annotation},
                },
                "spec": spec,
            });
            match nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(node) => return Ok(Some(node)),
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(source) => {
                    return Err(ControllerError::kube(
                        format!("changing node {name}"),
                        source,
                    ));
                }
            }
        }
        Err(ControllerError::Conflict(name.to_owned()))
    }
}

impl KubeActuator {
    /// Sets one label of a node (Probity owns that label alone; every other label is
    /// left as it is, by a merge patch at the read `resourceVersion`).
    pub async fn set_label(
        &self,
        name: &str,
        key: &str,
        value: &str,
    ) -> Result<Outcome, ControllerError> {
        if !is_label_value(value) {
            return Err(ControllerError::Probity {
                what: format!("label {key} of node {name}"),
                reason: format!("{value:?} cannot be a label value"),
            });
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        for _ in 0..CONFLICT_RETRIES {
            let node = nodes
                .get(name)
                .await
                .map_err(|e| ControllerError::kube(format!("reading node {name}"), e))?;
            let current = node.metadata.labels.as_ref().and_then(|l| l.get(key));
            if current.map(String::as_str) == Some(value) {
                return Ok(Outcome::Unchanged);
            }
            let patch = json!({"metadata": {
                "resourceVersion": node.metadata.resource_version,
                "labels": {key: value},
            }});
            match nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(Outcome::Done),
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(e) => return Err(ControllerError::kube(format!("labelling node {name}"), e)),
            }
        }
        Err(ControllerError::Conflict(name.to_owned()))
    }
}

/// Whether Kubernetes takes `value` as a label value (at most 63 characters of
/// alphanumerics, `-`, `_` and `.`, beginning and ending with an alphanumeric).
fn is_label_value(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric())
}

impl Actuator for KubeActuator {
    type Error = ControllerError;

    async fn node_pods(&self, node: &str) -> Result<Vec<PodRef>, ControllerError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let list = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|e| ControllerError::kube(format!("listing the pods on node {node}"), e))?;
        Ok(list
            .items
            .into_iter()
            .filter(|pod| {
                let meta = &pod.metadata;
                // As a drain does: a DaemonSet's pod belongs to its node (and tolerates
                // what it must), a mirror pod is the kubelet's, a terminating one is going.
                let daemon = meta
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.kind == "DaemonSet");
                let mirror = meta
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
                !daemon && !mirror && meta.deletion_timestamp.is_none()
            })
            .filter_map(|pod| {
                Some(PodRef {
                    namespace: pod.metadata.namespace?,
                    name: pod.metadata.name?,
                    uid: pod.metadata.uid,
                    node: None,
                })
            })
            .collect())
    }

    async fn delete_pod(&self, pod: &PodRef, reason: &str) -> Result<Outcome, ControllerError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        let params = DeleteParams {
            preconditions: same_pod(pod),
            ..DeleteParams::default()
        };
        match pods.delete(&pod.name, &params).await {
            Ok(_) => {
                self.pod_event(pod, "ProbityDeleted", "Delete", reason.to_owned())
                    .await;
                Ok(Outcome::Done)
            }
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {
                Ok(Outcome::Unchanged)
            }
            Err(e) => Err(ControllerError::kube(
                format!("deleting pod {}/{} ({reason})", pod.namespace, pod.name),
                e,
            )),
        }
    }

    async fn block_node(
        &self,
        name: &str,
        mark: &AppliedMark,
        replaces: Option<&AppliedMark>,
    ) -> Result<Outcome, ControllerError> {
        let taint = self.taint.clone();
        // The taint Probity set before under other settings, if it added it.
        let old = replaces
            .filter(|r| r.taint_added)
            .and_then(|r| {
                Some(BlockTaint {
                    key: r.key.clone()?,
                    effect: r.effect.clone()?,
                })
            })
            .filter(|old| *old != taint);
        let text = serde_json::to_string(mark).unwrap_or_default();
        let changed = self
            .change_node(name, |node| {
                let mut taints = node_taints(node);
                let had_old = old
                    .as_ref()
                    .is_some_and(|old| taints.iter().any(|t| old.matches(t)));
                if let Some(old) = &old {
                    taints.retain(|t| !old.matches(t));
                }
                let has_taint = taints.iter().any(|t| taint.matches(t));
                let marked = node
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(BLOCK_ANNOTATION))
                    == Some(&text);
                if has_taint && marked && !had_old {
                    return None;
                }
                if !has_taint {
                    taints.push(Taint {
                        key: taint.key.clone(),
                        effect: taint.effect.clone(),
                        value: None,
                        time_added: None,
                    });
                }
                Some(NodeChange {
                    annotation: Some(text.clone()),
                    taints: Some(taints),
                })
            })
            .await?;
        let Some(node) = changed else {
            return Ok(Outcome::Unchanged);
        };
        self.event(
            &node,
            EventType::Warning,
            "ProbityBlocked",
            "Taint",
            format!(
                "blocked by Probity ({}), block record {}since {}; taint {}:{}",
                mark.block.reason,
                mark.block
                    .revision
                    .map(|r| format!("revision {r}, "))
                    .unwrap_or_default(),
                mark.block.since,
                self.taint.key,
                self.taint.effect
            ),
        )
        .await;
        Ok(Outcome::Done)
    }

    async fn release_node(
        &self,
        name: &str,
        taint_added: bool,
    ) -> Result<Outcome, ControllerError> {
        let taint = self.taint.clone();
        let changed = self
            .change_node(name, |node| {
                let taints = node_taints(node);
                let has_mark = node
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(BLOCK_ANNOTATION));
                let has_taint = taints.iter().any(|t| taint.matches(t));
                let remove_taint = taint_added && has_taint;
                if !has_mark && !remove_taint {
                    return None;
                }
                Some(NodeChange {
                    annotation: None,
                    taints: remove_taint.then(|| {
                        taints
                            .iter()
                            .filter(|t| !taint.matches(t))
                            .cloned()
                            .collect()
                    }),
                })
            })
            .await?;
        let Some(node) = changed else {
            return Ok(Outcome::Unchanged);
        };
        self.event(
            &node,
            EventType::Normal,
            "ProbityReleased",
            "Untaint",
            "released by Probity: the node is no longer blocked".into(),
        )
        .await;
        Ok(Outcome::Done)
    }

    async fn stop_pod(
        &self,
        pod: &PodRef,
        reason: &str,
        dry_run: bool,
    ) -> Result<Outcome, ControllerError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        // The reader's name is its own claim: only a pod that is on the blocked node
        // (and has the uid claimed, when one was) is stopped.
        if let Some(node) = &pod.node {
            let found = pods.get_opt(&pod.name).await.map_err(|e| {
                ControllerError::kube(format!("reading pod {}/{}", pod.namespace, pod.name), e)
            })?;
            let Some(found) = found else {
                return Ok(Outcome::Unchanged);
            };
            let on_node = found.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node);
            let same = pod.uid.is_none() || found.metadata.uid == pod.uid;
            if !(on_node && same) {
                return Ok(Outcome::NotThere);
            }
            // Evicted already (by an earlier pass, or a controller before a restart): a
            // second eviction would be a second action for one stop.
            if found.metadata.deletion_timestamp.is_some() {
                return Ok(Outcome::Stopping);
            }
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        let params = EvictParams {
            delete_options: Some(DeleteParams {
                dry_run,
                preconditions: same_pod(pod),
                ..DeleteParams::default()
            }),
            post_options: PostParams {
                dry_run,
                field_manager: None,
            },
        };
        let what = format!("evicting pod {}/{} ({reason})", pod.namespace, pod.name);
        match pods.evict(&pod.name, &params).await {
            Ok(_) => {
                if !dry_run {
                    self.pod_event(pod, "ProbityEvicted", "Evict", reason.to_owned())
                        .await;
                }
                Ok(Outcome::Done)
            }
            // Gone, or another pod now has the name (the uid precondition failed): the
            // pod that read is not running any more.
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {
                Ok(Outcome::Unchanged)
            }
            Err(kube::Error::Api(status)) if status.code == 429 => {
                Err(ControllerError::Disrupted {
                    what,
                    message: status.message.clone(),
                })
            }
            Err(source) => Err(ControllerError::kube(what, source)),
        }
    }

    async fn movable_work(
        &self,
        nodes: &[String],
        order_key: &str,
    ) -> Result<Vec<super::migrate::Candidate>, ControllerError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let mut out = Vec::new();
        for node in nodes {
            let list = pods
                .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
                .await
                .map_err(|e| {
                    ControllerError::kube(format!("listing the pods on node {node}"), e)
                })?;
            out.extend(
                list.items
                    .into_iter()
                    .filter_map(|pod| super::migrate::candidate(pod, node, order_key)),
            );
        }
        Ok(out)
    }
}
