//! The cluster's facts: each Kubernetes Node translated to the `Node` attributes the
//! schema marks `@owned("cluster")`, sent to Probity as a full replace
//! (`PUT /v1/facts/cluster`), so the store knows every node of the cluster without
//! anyone seeding it (README, "Where each fact comes from").
//!
//! What is read, per Node:
//! - `zone` from the label `topology.kubernetes.io/zone` (never Probity's own zone
//!   label, which [`super::labels`] writes *from* this fact);
//! - `role` from the label `node-role.kubernetes.io/<role>`, when there is exactly one;
//! - `gpuNode` (true only) when the Node has `nvidia.com/gpu` capacity or GPU feature
//!   discovery's `nvidia.com/gpu.count` label above 0;
//! - `gpusAllocatable` and `cpuAllocatableMillis` from its allocatable `nvidia.com/gpu`
//!   and `cpu`, and `gpuProduct` from the `nvidia.com/gpu.product` label.
//!
//! Labels are written by whoever may label a node, so each value is checked here (its
//! characters and length as a label value, a count as a whole number in range); a bad
//! one is left out of that node's facts and counted
//! (`probity_controller_actions_total{kind="cluster-fact",outcome="refused"}`), and
//! the node's other facts and every other node still go. The set is sent when it
//! changes (a Node added, relabelled or deleted: a deleted Node is simply absent, so
//! Probity drops its facts) and every `label_interval` otherwise; a failed send is
//! tried again at the next change or after `label_interval`. Sending needs the
//! controller's client certificate in the api policies' `cluster-reporters` group.

use std::collections::BTreeMap;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use serde_json::{Map, Value, json};

use super::{Controller, ControllerError};

/// The zone label Kubernetes defines (well-known labels).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// A node role label's prefix; the role is the rest of the key.
pub const ROLE_LABEL_PREFIX: &str = "node-role.kubernetes.io/";
/// The GPU resource the NVIDIA device plugin advertises.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// GPU feature discovery's count of GPUs.
pub const GPU_COUNT_LABEL: &str = "nvidia.com/gpu.count";
/// GPU feature discovery's product name.
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";

/// More GPUs than any one node carries: a count past it is a bad label, not a node.
const MAX_GPUS: i64 = 1024;
/// More CPU than any one node carries, in millicores.
const MAX_CPU_MILLIS: i64 = 100_000_000;
/// A label value's longest (Kubernetes' own bound).
const MAX_LABEL_VALUE: usize = 63;
/// A node name's longest (a DNS subdomain).
const MAX_NODE_NAME: usize = 253;

/// One Node's facts, and the values that were refused.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFacts {
    /// The Cedar entity (`{"uid", "attrs"}`), or `None` when nothing could be read.
    pub entity: Option<Value>,
    /// Each refused value: `field: why`.
    pub refused: Vec<String>,
}

/// What was last sent, and when.
#[derive(Default)]
pub(super) struct Sent {
    body: Option<String>,
    at: Option<Instant>,
}

/// A Kubernetes label value: up to 63 letters, digits, `-`, `_`, `.`, beginning and
/// ending with a letter or digit.
fn check_label_value(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("empty".into());
    }
    if value.len() > MAX_LABEL_VALUE {
        return Err(format!(
            "{} bytes, over Kubernetes' {MAX_LABEL_VALUE}",
            value.len()
        ));
    }
    if let Some(bad) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!("{bad:?} is not a label value's character"));
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !alnum(value.chars().next()) || !alnum(value.chars().last()) {
        return Err("must begin and end with a letter or digit".into());
    }
    Ok(())
}

/// A node name: a DNS subdomain (lower-case letters, digits, `-`, `.`).
fn check_node_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NODE_NAME {
        return Err(format!("{} bytes (1 to {MAX_NODE_NAME})", name.len()));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.')))
    {
        return Err(format!("{bad:?} is not a node name's character"));
    }
    Ok(())
}

/// A whole count from a label or an integer quantity ("8"), within `0..=max`.
fn count(text: &str, max: i64) -> Result<i64, String> {
    let n: i64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number"))?;
    if n < 0 {
        return Err(format!("{n} is negative"));
    }
    if n > max {
        return Err(format!("{n} is over {max}"));
    }
    Ok(n)
}

/// A CPU quantity ("64", "63500m", "1.5") in millicores, within range.
fn cpu_millis(text: &str) -> Result<i64, String> {
    let bad = || format!("{text:?} is not a CPU quantity");
    let millis = if let Some(m) = text.strip_suffix('m') {
        m.parse::<i64>().map_err(|_| bad())?
    } else if let Some((whole, fraction)) = text.split_once('.') {
        if fraction.is_empty()
            || fraction.len() > 3
            || !fraction.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        let whole: i64 = whole.parse().map_err(|_| bad())?;
        let padded = format!("{fraction:0<3}");
        let fraction: i64 = padded.parse().map_err(|_| bad())?;
        whole
            .checked_mul(1000)
            .and_then(|w| w.checked_add(fraction))
            .ok_or_else(bad)?
    } else {
        text.parse::<i64>()
            .map_err(|_| bad())?
            .checked_mul(1000)
            .ok_or_else(bad)?
    };
    if !(0..=MAX_CPU_MILLIS).contains(&millis) {
        return Err(format!(
            "{millis}m is out of range (0 to {MAX_CPU_MILLIS}m)"
        ));
    }
    Ok(millis)
}

/// Translates one Node; `None` when it has no name at all.
pub fn node_facts(node: &Node) -> Option<(String, NodeFacts)> {
    let name = node.metadata.name.clone()?;
    let mut refused = Vec::new();
    if let Err(why) = check_node_name(&name) {
        refused.push(format!("name: {why}"));
        return Some((
            name,
            NodeFacts {
                entity: None,
                refused,
            },
        ));
    }
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let status = node.status.as_ref();
    let capacity = status.and_then(|s| s.capacity.as_ref());
    let allocatable = status.and_then(|s| s.allocatable.as_ref());
    let mut attrs = Map::new();

    if let Some(zone) = labels.get(ZONE_LABEL) {
        match check_label_value(zone) {
            Ok(()) => {
                attrs.insert(
                    "zone".into(),
                    json!({"__entity": {"type": "Zone", "id": zone}}),
                );
            }
            Err(why) => refused.push(format!("zone (label {ZONE_LABEL}): {why}")),
        }
    }

    let roles: Vec<&str> = labels
        .keys()
        .filter_map(|k| k.strip_prefix(ROLE_LABEL_PREFIX))
        .collect();
    match roles.as_slice() {
        [] => {}
        [role] => match check_label_value(role) {
            Ok(()) => {
                attrs.insert(
                    "role".into(),
                    json!({"__entity": {"type": "NodeRole", "id": role}}),
                );
            }
            Err(why) => refused.push(format!("role (label {ROLE_LABEL_PREFIX}{role}): {why}")),
        },
        several => refused.push(format!(
            "role: {} node-role labels ({}); one role's baseline applies, so none is taken",
            several.len(),
            several.join(", ")
        )),
    }

    let gpu_capacity = match capacity.and_then(|c| c.get(GPU_RESOURCE)) {
        None => None,
        Some(q) => match count(&q.0, MAX_GPUS) {
            Ok(n) => Some(n),
            Err(why) => {
                refused.push(format!("gpuNode (capacity {GPU_RESOURCE}): {why}"));
                None
            }
        },
    };
    let gpu_label = match labels.get(GPU_COUNT_LABEL) {
        None => None,
        Some(v) => match count(v, MAX_GPUS) {
            Ok(n) => Some(n),
            Err(why) => {
                refused.push(format!("gpuNode (label {GPU_COUNT_LABEL}): {why}"));
                None
            }
        },
    };
    // Only ever true: a node whose device plugin has not started yet is not declared
    // GPU-less by the cluster (that would exempt it from the GPU rules).
    if gpu_capacity.unwrap_or(0) > 0 || gpu_label.unwrap_or(0) > 0 {
        attrs.insert("gpuNode".into(), json!(true));
    }
    if let Some(q) = allocatable.and_then(|a| a.get(GPU_RESOURCE)) {
        match count(&q.0, MAX_GPUS) {
            Ok(n) => {
                attrs.insert("gpusAllocatable".into(), json!(n));
            }
            Err(why) => refused.push(format!(
                "gpusAllocatable (allocatable {GPU_RESOURCE}): {why}"
            )),
        }
    }
    if let Some(q) = allocatable.and_then(|a| a.get("cpu")) {
        match cpu_millis(&q.0) {
            Ok(n) => {
                attrs.insert("cpuAllocatableMillis".into(), json!(n));
            }
            Err(why) => refused.push(format!("cpuAllocatableMillis (allocatable cpu): {why}")),
        }
    }
    if let Some(product) = labels.get(GPU_PRODUCT_LABEL) {
        match check_label_value(product) {
            Ok(()) => {
                attrs.insert("gpuProduct".into(), json!(product));
            }
            Err(why) => refused.push(format!("gpuProduct (label {GPU_PRODUCT_LABEL}): {why}")),
        }
    }
    let entity = (!attrs.is_empty())
        .then(|| json!({"uid": {"type": "Node", "id": name}, "attrs": Value::Object(attrs)}));
    Some((name, NodeFacts { entity, refused }))
}

/// The facts of every node, in name order, and every refusal as `node: field: why`.
pub fn cluster_facts(nodes: &[impl AsRef<Node>]) -> (Vec<Value>, Vec<String>) {
    let mut by_name = BTreeMap::new();
    let mut refused = Vec::new();
    for node in nodes {
        let Some((name, facts)) = node_facts(node.as_ref()) else {
            continue;
        };
        refused.extend(facts.refused.iter().map(|r| format!("node {name:?}: {r}")));
        if let Some(entity) = facts.entity {
            by_name.insert(name, entity);
        }
    }
    (by_name.into_values().collect(), refused)
}

impl Controller {
    /// Sends the cluster's facts when they changed since the last send, or when the
    /// last is `label_interval` old. A failure is logged and tried again next tick.
    pub(super) async fn sync_cluster_facts(&self) -> Result<(), ControllerError> {
        let nodes = self.nodes.state();
        let (entities, refused) = cluster_facts(&nodes);
        let body = json!({ "entities": entities }).to_string();
        let due = {
            let sent = self
                .cluster_facts_sent
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            sent.body.as_deref() != Some(body.as_str())
                || sent
                    .at
                    .is_none_or(|at| at.elapsed() >= self.options.label_interval)
        };
        if !due {
            return Ok(());
        }
        for why in &refused {
            self.metrics.action("cluster-fact", "refused");
            tracing::warn!(refused = %why, "a Node's label or resource was left out of its facts");
        }
        let result = self.probity.replace_cluster_facts(body.clone()).await;
        self.metrics.action(
            "cluster-facts",
            if result.is_ok() { "sent" } else { "failed" },
        );
        // A failed send is tried again at the next change or after label_interval, not
        // every tick (a server that refuses the controller says so once per interval).
        let mut sent = self
            .cluster_facts_sent
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *sent = Sent {
            body: Some(body),
            at: Some(Instant::now()),
        };
        result
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn node(name: &str, labels: Value, status: Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn a_gpu_node_with_feature_discovery_labels_becomes_its_cluster_facts() {
        let n = node(
            "gpu-1",
            json!({ZONE_LABEL: "zone-a", "node-role.kubernetes.io/gpu-worker": "",
                   GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3", GPU_COUNT_LABEL: "8"}),
            json!({"capacity": {"nvidia.com/gpu": "8", "cpu": "64"},
                   "allocatable": {"nvidia.com/gpu": "8", "cpu": "63500m"}}),
        );
        let (name, facts) = node_facts(&n).unwrap();
        assert_eq!(name, "gpu-1");
        assert!(facts.refused.is_empty(), "{:?}", facts.refused);
        assert_eq!(
            facts.entity.unwrap(),
            json!({"uid": {"type": "Node", "id": "gpu-1"}, "attrs": {
                "zone": {"__entity": {"type": "Zone", "id": "zone-a"}},
                "role": {"__entity": {"type": "NodeRole", "id": "gpu-worker"}},
                "gpuNode": true, "gpusAllocatable": 8, "cpuAllocatableMillis": 63500,
                "gpuProduct": "NVIDIA-H100-80GB-HBM3",
            }})
        );
    }

    #[test]
    fn bad_label_values_are_left_out_and_named_and_the_rest_still_goes() {
        let n = node(
            "gpu-2",
            json!({ZONE_LABEL: "zone-a", GPU_PRODUCT_LABEL: "-bad-",
                   GPU_COUNT_LABEL: "-3"}),
            json!({"allocatable": {"nvidia.com/gpu": "9999", "cpu": "lots"}}),
        );
        let (_, facts) = node_facts(&n).unwrap();
        let refused = facts.refused.join("\n");
        assert!(
            refused.contains("gpuProduct (label nvidia.com/gpu.product): must begin and end"),
            "{refused}"
        );
        assert!(
            refused.contains("gpuNode (label nvidia.com/gpu.count): -3 is negative"),
            "{refused}"
        );
        assert!(
            refused.contains("gpusAllocatable (allocatable nvidia.com/gpu): 9999 is over 1024"),
            "{refused}"
        );
        assert!(
            refused.contains("cpuAllocatableMillis (allocatable cpu): \"lots\""),
            "{refused}"
        );
        assert_eq!(
            facts.entity.unwrap()["attrs"],
            json!({"zone": {"__entity": {"type": "Zone", "id": "zone-a"}}})
        );
    }

    #[test]
    fn several_roles_give_none_and_a_gpu_less_node_is_not_declared_gpu_less() {
        let n = node(
            "cp-1",
            json!({"node-role.kubernetes.io/control-plane": "", "node-role.kubernetes.io/master": ""}),
            json!({"allocatable": {"cpu": "4"}}),
        );
        let (_, facts) = node_facts(&n).unwrap();
        assert!(
            facts.refused[0].starts_with("role: 2 node-role labels"),
            "{:?}",
            facts.refused
        );
        let attrs = &facts.entity.unwrap()["attrs"];
        assert_eq!(attrs, &json!({"cpuAllocatableMillis": 4000}));
    }

    #[test]
    fn a_node_with_a_bad_name_or_nothing_to_say_sends_no_entity() {
        let (_, facts) = node_facts(&node("Bad Name", json!({}), json!({}))).unwrap();
        assert!(facts.entity.is_none());
        assert!(facts.refused[0].starts_with("name:"), "{:?}", facts.refused);
        let (_, facts) = node_facts(&node("plain", json!({}), json!({}))).unwrap();
        assert!(facts.entity.is_none() && facts.refused.is_empty());
    }

    #[test]
    fn cpu_quantities_read_as_millicores() {
        assert_eq!(cpu_millis("2"), Ok(2000));
        assert_eq!(cpu_millis("1.5"), Ok(1500));
        assert_eq!(cpu_millis("250m"), Ok(250));
        assert!(cpu_millis("1.2345").is_err());
        assert!(cpu_millis("-1").is_err());
        assert!(cpu_millis("9223372036854775807").is_err());
    }

    #[test]
    fn the_set_is_in_name_order_and_refusals_name_the_node() {
        let a = Arc::new(node("b-node", json!({ZONE_LABEL: "z"}), json!({})));
        let b = Arc::new(node(
            "a-node",
            json!({ZONE_LABEL: "z z"}),
            json!({"allocatable": {"cpu": "1"}}),
        ));
        let (entities, refused) = cluster_facts(&[a, b]);
        let ids: Vec<_> = entities.iter().map(|e| e["uid"]["id"].clone()).collect();
        assert_eq!(ids, vec![json!("a-node"), json!("b-node")]);
        assert_eq!(refused.len(), 1);
        assert!(
            refused[0].starts_with("node \"a-node\": zone"),
            "{refused:?}"
        );
    }

    use std::sync::Arc;
}
