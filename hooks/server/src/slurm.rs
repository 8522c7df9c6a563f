//! Slurm: a job judged at submission (`POST /v1/slurm/submit`, which `probity slurm
//! submit` calls from `job_submit.lua`) and again where it starts (`POST
//! /v1/slurm/prolog`, from the node's Prolog).
//!
//! A job becomes the schema's request-scoped `Workload` as `[slurm]` declares (see
//! [`job`]): the same attributes Kubernetes admission gives a pod (`namespace`,
//! `namespaceMatches`, `class`, `gpus`, `cpuMillis`, `gpuMemoryMiB`, `image` `""`,
//! `tolerations` `[]`), plus `partition` and `nodeFeatures`. Submission asks `admit`
//! into its Namespace, as admission does; an admitted job's facts are remembered in the
//! state backend (beside admitted pods') under a random token the submission answers,
//! and the Prolog finds them by that token (moving them under the job's id) or by the
//! job's id, and asks `schedule` onto its node. A refusal there says whether the node
//! is at fault (blocked, unknown, or failing its own `comply`: Slurm drains it and
//! requeues the job) or the job is (requeued and held), and is appended to the event
//! log. No rule is restated here: every verdict is the policies'.

pub(crate) mod job;
mod prolog;
mod submit;

pub(crate) use prolog::prolog;
pub(crate) use submit::submit;

use probity::Decision;
use serde_json::{Value, json};

/// Where a submitted job's facts are kept until its Prolog: `slurm-submission/<token>`.
const SUBMISSION: &str = "slurm-submission";
/// Where a started job's facts are kept: `slurm-job/<job id>`.
const JOB: &str = "slurm-job";

/// One reason a decision refused, as the routes answer it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    policy: String,
    message: String,
}

impl Refusal {
    fn new(policy: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            policy: policy.into(),
            message: message.into(),
        }
    }

    /// `Probity: <policy>: <message>`: what Slurm shows the user.
    fn line(&self) -> String {
        format!("Probity: {}: {}", self.policy, self.message)
    }

    fn json(&self) -> Value {
        json!({"policy": self.policy, "message": self.message})
    }
}

/// Why `d` refuses: its reasons; else its evaluation errors (a deny that no policy
/// made, failing closed); else that nothing permits it.
fn refusals(d: &Decision) -> Vec<Refusal> {
    if d.is_allowed() {
        return Vec::new();
    }
    let mut out: Vec<Refusal> = d
        .reasons
        .iter()
        .map(|r| Refusal::new(&r.policy, &r.message))
        .collect();
    if out.is_empty() {
        out.extend(d.errors.iter().map(|e| {
            Refusal::new(
                e.policy.as_deref().unwrap_or("probity.error"),
                format!("evaluation error: {}", e.message),
            )
        }));
    }
    if out.is_empty() {
        out.push(Refusal::new("probity.no-permit", "no policy permits it"));
    }
    out
}

/// The request-scoped `Workload` entity `id` with `attrs`, in the Namespace they name.
fn workload_entity(id: &str, attrs: &Value) -> crate::admission::Workload {
    let namespace = attrs
        .pointer("/namespace/__entity/id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    crate::admission::Workload {
        id: id.to_owned(),
        name: id.to_owned(),
        namespace: namespace.clone(),
        node_name: None,
        entity: json!({
            "uid": {"type": "Workload", "id": id},
            "attrs": attrs,
            "parents": [{"type": "Namespace", "id": namespace}],
        }),
    }
}
