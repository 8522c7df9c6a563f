use std::collections::BTreeMap;

use serde::Deserialize;

/// What admission does with a pod bound to a node the store holds no facts about.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownNodes {
    /// Decide anyway: the placement rules cannot be evaluated, so the pod is denied
    /// (unknown is a finding). The default.
    #[default]
    Deny,
    /// Decide anyway, and admit with a warning when the deny comes only from rules that
    /// cannot be evaluated without the node's facts: for clusters that admit pods
    /// before node agents have reported their nodes. A rule that does decide (a blocked
    /// node, a forbidden image) still denies.
    Warn,
}

/// What the scheduler extender does with a node the store holds no facts about.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownSchedulerNodes {
    /// Filter it out, with a reason in `FailedNodes` (the default: its rules cannot
    /// be evaluated). Seed node facts, or let agents report them, before relying on
    /// the extender.
    #[default]
    Filter,
    /// Let it through with score 0: for a cluster whose node agents have not reported
    /// yet. A blocked node is still filtered out.
    Allow,
}

/// The kube-scheduler extender endpoints.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Nodes absent from the store: `"filter"` (the default) or `"allow"`.
    pub unknown_nodes: UnknownSchedulerNodes,
    /// Most nodes one ExtenderArgs may name; more is a 413. Default 15,000 (three times
    /// the 5,000 nodes Kubernetes supports in one cluster).
    pub max_nodes: usize,
    /// Largest ExtenderArgs body in bytes; larger is a 413. Default 4 MiB.
    pub max_body_bytes: usize,
    /// A request naming more than this many nodes is large. Default 1,000.
    pub large_request_nodes: usize,
    /// Large requests judged at once; one more is a 503 the scheduler retries.
    /// Default 2.
    pub max_large_requests: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            unknown_nodes: UnknownSchedulerNodes::default(),
            max_nodes: 15_000,
            max_body_bytes: 4 * 1024 * 1024,
            large_request_nodes: 1_000,
            max_large_requests: 2,
        }
    }
}

/// What to do with an AdmissionReview for a kind that holds no pod spec.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownKinds {
    /// Allow it, with a warning (the default).
    #[default]
    Allow,
    /// Deny it.
    Deny,
}

/// The Kubernetes admission endpoints.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Kinds without a pod spec. Default `"allow"` (with a warning).
    pub unknown_kinds: UnknownKinds,
    /// A pod bound (`spec.nodeName`) to a node absent from the store: `"deny"` (the
    /// default: placement cannot be checked, so it fails closed) or `"warn"`.
    pub unknown_nodes: UnknownNodes,
    /// Pod label giving the workload class. Default `"probity.io/class"`.
    pub class_label: String,
    /// Class of a pod without that label. Default `"batch"`.
    pub default_class: String,
    /// Pod annotation giving the GPU memory requested per GPU, in MiB (default 0 when
    /// absent). Default `"probity.io/gpu-memory-mib"`.
    pub gpu_memory_annotation: String,
    /// Extended resource counted as GPUs. Default `"nvidia.com/gpu"`.
    pub gpu_resource: String,
    /// Extended resources that are GPUs, with how many GPUs one unit counts as; a name
    /// ending in `*` is a prefix (MIG profiles). Default
    /// `{"nvidia.com/gpu" = 1, "nvidia.com/mig-*" = 1}`; `gpu_resource`, when set, is
    /// added with a count of 1.
    pub gpu_resources: BTreeMap<String, u32>,
    /// Node label holding a node's name. Default `"kubernetes.io/hostname"`.
    pub hostname_label: String,
    /// Node label holding a node's Probity zone id. Default `"topology.probity.io/zone"`.
    pub zone_label: String,
    /// Most admitted pods whose facts are remembered for their binding (in the state
    /// backend: every replica sees them). Default 100,000.
    pub admitted_facts_max: usize,
    /// Seconds an admitted pod's facts are remembered; a binding later than that is
    /// judged with the node-level rules only. Default 86,400 (a day).
    pub admitted_facts_seconds: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            unknown_kinds: UnknownKinds::Allow,
            unknown_nodes: UnknownNodes::Deny,
            class_label: "probity.io/class".into(),
            default_class: "batch".into(),
            gpu_memory_annotation: "probity.io/gpu-memory-mib".into(),
            gpu_resource: "nvidia.com/gpu".into(),
            gpu_resources: BTreeMap::from([
                ("nvidia.com/gpu".to_owned(), 1),
                ("nvidia.com/mig-*".to_owned(), 1),
            ]),
            hostname_label: "kubernetes.io/hostname".into(),
            zone_label: "topology.probity.io/zone".into(),
            admitted_facts_max: 100_000,
            admitted_facts_seconds: 86_400,
        }
    }
}
