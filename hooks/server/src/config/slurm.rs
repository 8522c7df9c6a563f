//! `[slurm]`: how a Slurm job reads as the schema's `Workload`, declared here rather
//! than in Rust, and what the Prolog does with a job Probity has no facts for.

use serde::Deserialize;

use super::ConfigError;

/// The job field that names a Slurm job's `Namespace`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SlurmNamespace {
    /// The job's partition (the default). A job submitted to several partitions is
    /// admitted only if every one of them admits it.
    #[default]
    Partition,
    /// The job's account.
    Account,
}

/// A place a job's value is read from (`[slurm] class`, `gpu_memory`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum JobSource {
    /// `comment:<key>`: the value of a `<key>=<value>` word of the job's comment (words
    /// are split on whitespace and commas; the first such word wins).
    Comment(String),
    /// The job's QOS.
    Qos,
    /// The job's account.
    Account,
    /// The job's partition.
    Partition,
    /// The job's name.
    Name,
}

impl TryFrom<String> for JobSource {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        Ok(match text.as_str() {
            "qos" => Self::Qos,
            "account" => Self::Account,
            "partition" => Self::Partition,
            "name" => Self::Name,
            _ => match text.strip_prefix("comment:") {
                Some(key) if valid_comment_key(key) => Self::Comment(key.to_owned()),
                Some(key) => {
                    return Err(format!(
                        "\"comment:{key}\": the comment key must be letters, digits, '_', '-' or '.'"
                    ));
                }
                None => {
                    return Err(format!(
                        "{text:?} is not a job source: expected \"comment:<key>\", \"qos\", \"account\", \"partition\" or \"name\""
                    ));
                }
            },
        })
    }
}

impl std::fmt::Display for JobSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Comment(key) => write!(f, "comment:{key}"),
            Self::Qos => f.write_str("qos"),
            Self::Account => f.write_str("account"),
            Self::Partition => f.write_str("partition"),
            Self::Name => f.write_str("name"),
        }
    }
}

fn valid_comment_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// What the Prolog answers for a job Probity holds no facts about.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownJobs {
    /// Refuse it (verdict `job`: requeued and held): unknown is a finding. The default.
    #[default]
    Refuse,
    /// Let it start: for a cluster where jobs were queued before Probity answered
    /// `job_submit`.
    Allow,
}

/// Slurm (`POST /v1/slurm/submit`, `POST /v1/slurm/prolog`, and Slurm jobs as readers
/// in `POST /v1/verify`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SlurmConfig {
    /// The job field naming the Workload's Namespace: `"partition"` (the default) or
    /// `"account"`.
    pub namespace: SlurmNamespace,
    /// Where the workload class comes from, tried in order; the first that gives a
    /// non-empty value wins. Default `["comment:class", "qos"]`.
    pub class: Vec<JobSource>,
    /// The class when no source names one; `""` (the default) is none, which the
    /// policies refuse as an unknown class.
    pub default_class: String,
    /// The GRES (or TRES `gres/<name>`) whose count is the job's GPUs. Default `"gpu"`.
    pub gpu_gres: String,
    /// Where the requested GPU memory per GPU (MiB) comes from, e.g.
    /// `"comment:gpu_mem_mib"`. Default: none (0).
    pub gpu_memory: Option<JobSource>,
    /// The reader namespace that names a Slurm job as a reader in `POST /v1/verify`
    /// (`{"namespace": "slurm", "name": "job-<id>"}`). Default `"slurm"`.
    pub reader_namespace: String,
    /// A Prolog asking about a job Probity has no facts for: `"refuse"` (the default)
    /// or `"allow"`.
    pub unknown_job: UnknownJobs,
    /// Seconds a job's facts are remembered, from its admission and again from its
    /// first Prolog. Default 1,209,600 (14 days).
    pub remember_seconds: u64,
}

impl Default for SlurmConfig {
    fn default() -> Self {
        Self {
            namespace: SlurmNamespace::Partition,
            class: vec![JobSource::Comment("class".into()), JobSource::Qos],
            default_class: String::new(),
            gpu_gres: "gpu".into(),
            gpu_memory: None,
            reader_namespace: "slurm".into(),
            unknown_job: UnknownJobs::Refuse,
            remember_seconds: 1_209_600,
        }
    }
}

impl SlurmConfig {
    /// Checks what the types cannot: names Slurm and Kubernetes would accept, a period.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &str, why: String| Err(ConfigError::Invalid(format!("[slurm] {key}: {why}")));
        if self.class.is_empty() && self.default_class.is_empty() {
            return invalid(
                "class",
                "no source and no default_class: every job would be of the class \"\"".into(),
            );
        }
        let gres = &self.gpu_gres;
        if gres.is_empty()
            || !gres
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        {
            return invalid(
                "gpu_gres",
                format!("{gres:?} is not a GRES name (letters, digits, '_', '-', '.')"),
            );
        }
        if let Err(e) = probity::ReaderPod::new(self.reader_namespace.clone(), "job-1", None) {
            return invalid(
                "reader_namespace",
                format!(
                    "{:?} is not a namespace name: {}",
                    self.reader_namespace, e.problem
                ),
            );
        }
        if self.remember_seconds == 0 {
            return invalid(
                "remember_seconds",
                "must be positive: 0 would forget every job before it starts".into(),
            );
        }
        Ok(())
    }
}
