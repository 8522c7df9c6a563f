//! A job description as `job_submit.lua` passes it (every value a string) read into
//! the schema's `Workload` attributes, the way `[slurm]` says a job maps onto them.
//!
//! What is read, and how:
//!
//! - **Unset.** An absent field, `null`, `""`, or one of Slurm's "no value" sentinels
//!   (`NO_VAL` 4294967294, `INFINITE` 4294967295, `NO_VAL16` 65534, `INFINITE16`
//!   65535, `NO_VAL64` and `INFINITE64`) is unset.
//! - **GPUs** are the count of `[slurm] gpu_gres` in the TRES lists (`gres/gpu:8`,
//!   `gres:gpu:8`, `gres/gpu:a100:2`, `gres/gpu=2`, comma-separated with other TRES,
//!   the counts of the named GRES summed; a count may carry Slurm's `k`/`m`/`g`/`t`/`p`
//!   suffix, powers of 1024). The total is `tres_per_job`'s, else `tres_per_node`'s (or
//!   the older `gres` field's, also per node) times `min_nodes` (at least 1), else
//!   `tres_per_task`'s times `num_tasks` (at least 1), else `tres_per_socket`'s times
//!   `min_nodes`: the job description does not say how many sockets a node has, so a
//!   per-socket count is taken as per node (an undercount on multi-socket nodes; the
//!   Prolog's `schedule` judges the node it lands on).
//! - **CPUs** are `max(min_cpus, num_tasks × cpus_per_task)` (an unset task count or
//!   CPUs per task is 1), as `cpuMillis` (× 1000).
//! - **Node features** (`nodeFeatures`) are the features the job's constraint
//!   (`features`) requires of every node: the constraint is cut into terms at `&` and
//!   `,` outside brackets; a term holding `|` offers alternatives, none of which is
//!   required, and adds nothing; brackets and `*N` counts are stripped.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::config::{JobSource, SlurmConfig, SlurmNamespace};

/// The fields a job description may carry.
pub(crate) const FIELDS: &[&str] = &[
    "partition",
    "account",
    "qos",
    "comment",
    "name",
    "user_id",
    "group_id",
    "tres_per_node",
    "tres_per_job",
    "tres_per_task",
    "tres_per_socket",
    "gres",
    "min_nodes",
    "num_tasks",
    "cpus_per_task",
    "min_cpus",
    "features",
    "req_nodes",
];

/// Longest value of one field (a comment is the longest Slurm allows in practice).
const MAX_FIELD_BYTES: usize = 64 * 1024;

/// Slurm's "no value" and "infinite" sentinels, in every width.
const UNSET: &[u64] = &[
    0xfffe,
    0xffff,
    0xffff_fffe,
    0xffff_ffff,
    0xffff_ffff_ffff_fffe,
    0xffff_ffff_ffff_ffff,
];

/// Why a job description cannot be read: a 400 naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum JobError {
    /// The body is not `{"job": {..}}`.
    #[error("expected {{\"job\": {{\"<field>\": \"<string>\", ..}}}}: {0}")]
    Shape(String),
    /// A field this endpoint does not know.
    #[error("job.{0}: unknown field (known: {known})", known = FIELDS.join(", "))]
    UnknownField(String),
    /// A value that is not a string.
    #[error("job.{0}: expected a string (Slurm's numbers as decimal strings)")]
    NotAString(String),
    /// A value over [`MAX_FIELD_BYTES`].
    #[error("job.{0}: over {MAX_FIELD_BYTES} bytes")]
    TooLong(String),
    /// A number that does not parse.
    #[error("job.{field}: {value:?} is not a whole number")]
    NotANumber {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
    },
    /// A TRES or GRES list whose count of the GPU GRES cannot be read.
    #[error("job.{field}: {value:?}: {why}")]
    Tres {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// A count so large that the totals overflow.
    #[error("job: the {0} requested overflow a 64-bit count")]
    Overflow(&'static str),
    /// The GPU memory source gives a value that is not a count of MiB.
    #[error("job.{from}: {value:?} is not a whole number of MiB (the [slurm] gpu_memory source)")]
    GpuMemory {
        /// The source, as configured.
        from: String,
        /// Its value.
        value: String,
    },
}

/// A job description: its known fields, each a non-empty string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct JobDescription {
    fields: BTreeMap<&'static str, String>,
}

/// The Workload one job is judged as: its namespace and attributes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct JobWorkload {
    /// The namespace's name.
    pub(crate) namespace: String,
    /// The entity's attributes, in Cedar's entity JSON.
    pub(crate) attrs: Value,
}

impl JobDescription {
    /// Reads `{"job": {..}}`.
    pub(crate) fn from_body(body: &Value) -> Result<Self, JobError> {
        let Some(top) = body.as_object() else {
            return Err(JobError::Shape("the body is not an object".into()));
        };
        if let Some(other) = top.keys().find(|k| *k != "job") {
            return Err(JobError::Shape(format!("unknown field {other:?}")));
        }
        let Some(job) = top.get("job").and_then(Value::as_object) else {
            return Err(JobError::Shape("job is missing or not an object".into()));
        };
        let mut fields = BTreeMap::new();
        for (key, value) in job {
            let Some(field) = FIELDS.iter().copied().find(|f| f == key) else {
                return Err(JobError::UnknownField(shorten(key)));
            };
            let text = match value {
                Value::Null => continue,
                Value::String(s) => s,
                _ => return Err(JobError::NotAString(field.to_owned())),
            };
            if text.len() > MAX_FIELD_BYTES {
                return Err(JobError::TooLong(field.to_owned()));
            }
            if !text.is_empty() {
                fields.insert(field, text.clone());
            }
        }
        let job = Self { fields };
        // Every number is checked, whether or not the configuration reads it.
        for field in [
            "user_id",
            "group_id",
            "min_nodes",
            "num_tasks",
            "cpus_per_task",
            "min_cpus",
        ] {
            job.number(field)?;
        }
        Ok(job)
    }

    /// A job of these fields (tests).
    #[cfg(test)]
    pub(crate) fn of(pairs: &[(&'static str, &str)]) -> Self {
        Self {
            fields: pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
        }
    }

    fn text(&self, field: &str) -> Option<&str> {
        self.fields.get(field).map(String::as_str)
    }

    /// A numeric field; `None` when unset.
    fn number(&self, field: &'static str) -> Result<Option<u64>, JobError> {
        let Some(text) = self.text(field) else {
            return Ok(None);
        };
        let n: u64 = text.trim().parse().map_err(|_| JobError::NotANumber {
            field,
            value: shorten(text),
        })?;
        Ok((!UNSET.contains(&n)).then_some(n))
    }

    /// The value `source` gives, when non-empty.
    fn value_of(&self, source: &JobSource) -> Option<String> {
        let value = match source {
            JobSource::Comment(key) => comment_value(self.text("comment")?, key),
            JobSource::Qos => self.text("qos"),
            JobSource::Account => self.text("account"),
            JobSource::Partition => self.text("partition"),
            JobSource::Name => self.text("name"),
        };
        value.filter(|v| !v.is_empty()).map(str::to_owned)
    }

    /// The namespaces the job may run in: its partitions (a job submitted to several
    /// may run in any), or its account. Empty when the field is unset.
    pub(crate) fn namespaces(&self, cfg: &SlurmConfig) -> Vec<String> {
        match cfg.namespace {
            SlurmNamespace::Partition => self
                .text("partition")
                .map(|p| {
                    p.split(',')
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            SlurmNamespace::Account => self
                .text("account")
                .map(str::to_owned)
                .into_iter()
                .collect(),
        }
    }

    /// The job's workload in `namespace` (one of [`Self::namespaces`]).
    pub(crate) fn workload(
        &self,
        cfg: &SlurmConfig,
        namespace: &str,
    ) -> Result<JobWorkload, JobError> {
        let class = cfg
            .class
            .iter()
            .find_map(|s| self.value_of(s))
            .unwrap_or_else(|| cfg.default_class.clone());
        let gpu_memory: u64 = match &cfg.gpu_memory {
            None => 0,
            Some(source) => match self.value_of(source) {
                None => 0,
                Some(v) => v
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|n| i64::try_from(*n).is_ok())
                    .ok_or_else(|| JobError::GpuMemory {
                        from: source.to_string(),
                        value: shorten(&v),
                    })?,
            },
        };
        let gpus = self.gpus(&cfg.gpu_gres)?;
        let cpu_millis = self.cpu_millis()?;
        let mut attrs = json!({
            "namespace": {"__entity": {"type": "Namespace", "id": namespace}},
            "namespaceMatches": crate::admission::namespace_matches(namespace),
            "class": class,
            "gpus": gpus,
            "cpuMillis": cpu_millis,
            "gpuMemoryMiB": gpu_memory,
            "image": "",
            "tolerations": [],
            "nodeFeatures": self.node_features(),
        });
        // The partition is the one this workload is judged in (a job submitted to
        // several is judged once in each); with `namespace = "account"`, the job's own.
        let partition = match cfg.namespace {
            SlurmNamespace::Partition => Some(namespace.to_owned()),
            SlurmNamespace::Account => self
                .text("partition")
                .filter(|p| !p.contains(','))
                .map(str::to_owned),
        };
        if let (Some(p), Some(obj)) = (partition, attrs.as_object_mut()) {
            obj.insert("partition".into(), Value::String(p));
        }
        Ok(JobWorkload {
            namespace: namespace.to_owned(),
            attrs,
        })
    }

    /// The job's GPUs in all (see the module documentation).
    fn gpus(&self, gres: &str) -> Result<i64, JobError> {
        let count = |field: &'static str, bare: bool| -> Result<Option<u64>, JobError> {
            let Some(value) = self.text(field) else {
                return Ok(None);
            };
            gres_count(value, gres, bare).map_err(|why| JobError::Tres {
                field,
                value: shorten(value),
                why,
            })
        };
        let nodes = self.number("min_nodes")?.unwrap_or(1).max(1);
        let tasks = self.number("num_tasks")?.unwrap_or(1).max(1);
        let per_job = count("tres_per_job", false)?;
        let per_node = match count("tres_per_node", false)? {
            Some(n) => Some(n),
            None => count("gres", true)?,
        };
        let per_task = count("tres_per_task", false)?;
        let per_socket = count("tres_per_socket", false)?;
        let total = match (per_job, per_node, per_task, per_socket) {
            (Some(n), ..) => Some(n),
            (None, Some(n), ..) => n.checked_mul(nodes),
            (None, None, Some(n), _) => n.checked_mul(tasks),
            (None, None, None, Some(n)) => n.checked_mul(nodes),
            (None, None, None, None) => Some(0),
        };
        total
            .and_then(|n| i64::try_from(n).ok())
            .ok_or(JobError::Overflow("GPUs"))
    }

    /// `max(min_cpus, num_tasks × cpus_per_task)` in millicores.
    fn cpu_millis(&self) -> Result<i64, JobError> {
        let tasks = self.number("num_tasks")?.unwrap_or(1).max(1);
        let per_task = self.number("cpus_per_task")?.unwrap_or(1).max(1);
        let min = self.number("min_cpus")?.unwrap_or(0);
        tasks
            .checked_mul(per_task)
            .map(|n| n.max(min))
            .and_then(|n| n.checked_mul(1000))
            .and_then(|n| i64::try_from(n).ok())
            .ok_or(JobError::Overflow("CPUs"))
    }

    fn node_features(&self) -> Vec<String> {
        self.text("features")
            .map(required_features)
            .unwrap_or_default()
            .into_iter()
            .collect()
    }
}

/// The value of the first `key=value` word of a job comment (words split on whitespace
/// and commas).
pub(crate) fn comment_value<'a>(comment: &'a str, key: &str) -> Option<&'a str> {
    comment
        .split(|c: char| c.is_whitespace() || c == ',')
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

/// The count of GRES `gres` in a TRES list (`gres/gpu:8,gres/nic:1`), summed over its
/// items (types included); `None` when no item names it. `bare`: the list is the job's
/// `gres` field, whose items may omit the `gres/` prefix (`gpu:2`); in a TRES list an
/// item without it is another kind of TRES (`cpu:4`, `mem:1G`, `license/x:1`).
pub(crate) fn gres_count(list: &str, gres: &str, bare: bool) -> Result<Option<u64>, String> {
    let mut total: Option<u64> = None;
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let rest = match item
            .strip_prefix("gres/")
            .or_else(|| item.strip_prefix("gres:"))
        {
            Some(rest) => rest,
            None if bare => item,
            None => continue,
        };
        // `gpu:a100=2` and `gpu=2` are written the way `gpu:a100:2` is.
        let normalized = rest.replace('=', ":");
        let mut parts = normalized.split(':');
        if parts.next() != Some(gres) {
            continue;
        }
        let parts: Vec<&str> = parts.collect();
        let count = match parts.as_slice() {
            [] => 1,
            // One part: a count, or a type (then one of it).
            [one] => match count_of(one) {
                Some(n) => n,
                None if is_type(one) && !one.bytes().all(|b| b.is_ascii_digit()) => 1,
                None => return Err(format!("{item:?} has no count Probity can read")),
            },
            [kind, n] if is_type(kind) => {
                count_of(n).ok_or_else(|| format!("{item:?}: {n:?} is not a count"))?
            }
            _ => return Err(format!("{item:?} is not NAME[:TYPE][:COUNT]")),
        };
        total = Some(
            total
                .unwrap_or(0)
                .checked_add(count)
                .ok_or_else(|| "the counts overflow".to_owned())?,
        );
    }
    Ok(total)
}

/// A GRES count: digits, with an optional suffix of a power of 1024 (as Slurm reads it).
fn count_of(text: &str) -> Option<u64> {
    let (digits, scale) = match text.char_indices().last() {
        Some((at, c)) if c.is_ascii_alphabetic() => {
            let power = match c.to_ascii_lowercase() {
                'k' => 1,
                'm' => 2,
                'g' => 3,
                't' => 4,
                'p' => 5,
                _ => return None,
            };
            (text.get(..at)?, 1024u64.checked_pow(power)?)
        }
        _ => (text, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// A GRES type name (`a100`, `h100_80g`, `1g.10gb`).
fn is_type(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// The features a constraint requires of every node (see the module documentation).
pub(crate) fn required_features(constraint: &str) -> BTreeSet<String> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut term = String::new();
    for c in constraint.chars() {
        match c {
            '[' | '(' => {
                depth += 1;
                term.push(c);
            }
            ']' | ')' => {
                depth = depth.saturating_sub(1);
                term.push(c);
            }
            '&' | ',' if depth == 0 => terms.push(std::mem::take(&mut term)),
            _ => term.push(c),
        }
    }
    terms.push(term);
    let mut out = BTreeSet::new();
    for term in terms.iter().filter(|t| !t.contains('|')) {
        for feature in term.split(['&', ',', '[', ']', '(', ')']) {
            let name = feature.split('*').next().unwrap_or("").trim();
            if !name.is_empty() {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

/// At most 64 characters of untrusted text, for a message.
fn shorten(text: &str) -> String {
    match text.char_indices().nth(64) {
        Some((at, _)) => format!("{}...", text.get(..at).unwrap_or("")),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn tres_lists_in_every_spelling_count_the_gpu_gres() {
        for (list, expected) in [
            ("gres/gpu:8", Some(8)),
            ("gres:gpu:8", Some(8)),
            ("gres/gpu:a100:2", Some(2)),
            ("gres/gpu=2", Some(2)),
            ("gres/gpu:a100=3", Some(3)),
            ("gres/gpu", Some(1)),
            ("gres/gpu:a100", Some(1)),
            ("gres/gpu:1g.10gb:2", Some(2)),
            ("gres/gpu:2,gres/nic:1", Some(2)),
            ("gres/nic:1,gres/gpu:a100:2,gres/gpu:h100:1", Some(3)),
            ("cpu:4,gres/gpu:1", Some(1)),
            ("gres/gpu:0", Some(0)),
            ("gres/gpu:1k", Some(1024)),
            ("gres/nic:4", None),
            ("cpu:4,mem:1G", None),
            ("", None),
            // Another GRES whose name begins like the GPU's.
            ("gres/gpuxl:4", None),
        ] {
            assert_eq!(gres_count(list, "gpu", false), Ok(expected), "{list}");
        }
        // The older `gres` field may omit the prefix; a TRES list may not.
        assert_eq!(gres_count("gpu:4", "gpu", true), Ok(Some(4)));
        assert_eq!(gres_count("gpu:tesla:2", "gpu", true), Ok(Some(2)));
        assert_eq!(gres_count("gpu:4", "gpu", false), Ok(None));
        // Unreadable counts are refused, not read as zero.
        for list in [
            "gres/gpu:a100:x",
            "gres/gpu:a100:2:3",
            "gres/gpu:99999999999999999999",
            "gres/gpu:a b",
        ] {
            assert!(gres_count(list, "gpu", false).is_err(), "{list}");
        }
        assert!(gres_count("gres/gpu:18446744073709551615,gres/gpu:1", "gpu", false).is_err());
    }

    #[test]
    fn constraints_give_the_features_every_node_must_have() {
        let set = |items: &[&str]| {
            items
                .iter()
                .map(|s| (*s).to_owned())
                .collect::<BTreeSet<_>>()
        };
        assert_eq!(required_features("rlhf"), set(&["rlhf"]));
        assert_eq!(required_features("rlhf&ib"), set(&["ib", "rlhf"]));
        assert_eq!(required_features("a100,nvlink"), set(&["a100", "nvlink"]));
        assert_eq!(required_features("rlhf*2&ib"), set(&["ib", "rlhf"]));
        // Alternatives require none of theirs.
        assert_eq!(required_features("rlhf|cpu"), set(&[]));
        assert_eq!(required_features("[rack1|rack2]&rlhf"), set(&["rlhf"]));
        assert_eq!(
            required_features("[rack1*2&rack2*4]"),
            set(&["rack1", "rack2"])
        );
        assert_eq!(required_features("(a|b)&c"), set(&["c"]));
        assert_eq!(required_features(""), set(&[]));
        assert_eq!(required_features("]]&&[["), set(&[]));
    }

    #[test]
    fn comments_give_the_first_key_value_word() {
        assert_eq!(comment_value("class=training", "class"), Some("training"));
        assert_eq!(
            comment_value("team=nlp, class=rlhf gpu_mem_mib=40000", "class"),
            Some("rlhf")
        );
        assert_eq!(comment_value("subclass=x class=y", "class"), Some("y"));
        assert_eq!(comment_value("class", "class"), None);
        assert_eq!(comment_value("class=", "class"), Some(""));
        assert_eq!(comment_value("a=1 class=x class=y", "class"), Some("x"));
    }

    #[test]
    fn gpus_and_cpus_follow_the_order_of_the_tres_fields() {
        let cfg = SlurmConfig::default();
        let attrs = |pairs: &[(&'static str, &str)]| {
            JobDescription::of(pairs)
                .workload(&cfg, "train")
                .unwrap()
                .attrs
        };
        let a = attrs(&[
            ("tres_per_job", "gres/gpu:3"),
            ("tres_per_node", "gres/gpu:8"),
            ("min_nodes", "2"),
        ]);
        assert_eq!(
            (a["gpus"].as_i64(), a["cpuMillis"].as_i64()),
            (Some(3), Some(1000))
        );
        let a = attrs(&[("tres_per_node", "gres/gpu:8"), ("min_nodes", "2")]);
        assert_eq!(a["gpus"], 16);
        let a = attrs(&[("gres", "gpu:2"), ("min_nodes", "4294967294")]);
        assert_eq!(a["gpus"], 2);
        let a = attrs(&[
            ("tres_per_task", "gres/gpu:1"),
            ("num_tasks", "4"),
            ("cpus_per_task", "8"),
        ]);
        assert_eq!(
            (a["gpus"].as_i64(), a["cpuMillis"].as_i64()),
            (Some(4), Some(32000))
        );
        let a = attrs(&[("tres_per_socket", "gres/gpu:2"), ("min_nodes", "3")]);
        assert_eq!(a["gpus"], 6);
        let a = attrs(&[
            ("min_cpus", "16"),
            ("num_tasks", "2"),
            ("cpus_per_task", "4"),
        ]);
        assert_eq!(
            (a["gpus"].as_i64(), a["cpuMillis"].as_i64()),
            (Some(0), Some(16000))
        );
        // Sentinels are unset: one task, one CPU.
        let a = attrs(&[
            ("num_tasks", "4294967294"),
            ("cpus_per_task", "65534"),
            ("min_cpus", "4294967295"),
        ]);
        assert_eq!(a["cpuMillis"], 1000);
        let err =
            JobDescription::of(&[("num_tasks", "4294967293"), ("cpus_per_task", "4294967293")])
                .workload(&cfg, "train")
                .unwrap_err();
        assert_eq!(err, JobError::Overflow("CPUs"));
    }
}
