//! Slurm's implementation of the controller's [`Actuator`]: a block drains the node
//! with Probity's reason, a release resumes it only if the reason is still Probity's,
//! and a piece of work is a job (`job-<id>` in the readers' namespace), stopped by
//! `scontrol requeuehold` or `scancel`.

use std::sync::Arc;

use probity_kube::controller::migrate::Candidate;
use probity_kube::controller::plan::AppliedMark;
use probity_kube::controller::{Actuator, ControllerError, Outcome, PodRef};

use crate::SlurmError;
use crate::commands::{JobStop, SlurmCommands, is_job_id};
use crate::reason;

/// The reader namespace a Slurm job is named in by default (`[slurm] reader_namespace`).
pub const JOB_NAMESPACE: &str = "slurm";

/// The job id a reader name (`job-<id>`) stands for.
pub fn job_of(name: &str) -> Option<&str> {
    name.strip_prefix("job-").filter(|id| is_job_id(id))
}

/// Drains, resumes and stops jobs through Slurm's commands.
#[derive(Debug, Clone)]
pub struct SlurmActuator {
    commands: Arc<SlurmCommands>,
    /// The namespace its jobs are named in.
    namespace: String,
    /// What a stopped job gets.
    stop: JobStop,
}

impl SlurmActuator {
    /// An actuator running `commands`, naming jobs in `namespace`, stopping them `stop`.
    pub fn new(commands: SlurmCommands, namespace: &str, stop: JobStop) -> Self {
        Self {
            commands: Arc::new(commands),
            namespace: namespace.to_owned(),
            stop,
        }
    }

    /// The commands it runs.
    pub fn commands(&self) -> &SlurmCommands {
        &self.commands
    }

    /// Resumes `node` only if its drain reason is still `expected` (the one this
    /// controller set): a drain another part of Probity made since (the health check,
    /// a Prolog) is theirs to undo, an operator's is never touched.
    pub async fn release_drain(
        &self,
        node: &str,
        expected: &str,
    ) -> Result<Outcome, ControllerError> {
        let name = node.to_owned();
        let expected = expected.to_owned();
        self.blocking(format!("resuming node {node}"), move |c| {
            let current = c.node(&name)?;
            if !current.drained() || current.reason.as_deref() != Some(expected.as_str()) {
                return Ok(Outcome::Unchanged);
            }
            c.resume(&name)?;
            Ok(Outcome::Done)
        })
        .await
    }

    async fn blocking<T: Send + 'static>(
        &self,
        what: String,
        f: impl FnOnce(&SlurmCommands) -> Result<T, SlurmError> + Send + 'static,
    ) -> Result<T, ControllerError> {
        let commands = self.commands.clone();
        match tokio::task::spawn_blocking(move || f(&commands)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(ControllerError::Manager {
                what,
                reason: probity_base::error::chain(&error),
            }),
            Err(join) => Err(ControllerError::Manager {
                what,
                reason: format!("the command's thread failed: {join}"),
            }),
        }
    }

    fn job<'a>(&self, pod: &'a PodRef) -> Result<&'a str, ControllerError> {
        if pod.namespace != self.namespace {
            return Err(ControllerError::Manager {
                what: format!("stopping {}/{}", pod.namespace, pod.name),
                reason: format!(
                    "not a Slurm job: Slurm jobs are named job-<id> in namespace {}",
                    self.namespace
                ),
            });
        }
        job_of(&pod.name).ok_or_else(|| ControllerError::Manager {
            what: format!("stopping {}/{}", pod.namespace, pod.name),
            reason: "a Slurm job is named job-<digits>".into(),
        })
    }
}

impl Actuator for SlurmActuator {
    type Error = ControllerError;

    fn stopped_word(&self) -> &'static str {
        match self.stop {
            JobStop::RequeueHold => "requeued held",
            JobStop::Cancel => "cancelled",
        }
    }

    async fn block_node(
        &self,
        node: &str,
        mark: &AppliedMark,
        _replaces: Option<&AppliedMark>,
    ) -> Result<Outcome, ControllerError> {
        let name = node.to_owned();
        let wanted = reason::one_line(&mark.block.reason);
        self.blocking(format!("draining node {node}"), move |c| {
            let current = c.node(&name)?;
            if current.drained() {
                // An operator's drain stays as they wrote it; Probity's own is brought
                // up to date when the record changed.
                if !current.drained_by_probity() || current.reason.as_deref() == Some(&wanted) {
                    return Ok(Outcome::Unchanged);
                }
            }
            c.drain(&name, &wanted)?;
            Ok(Outcome::Done)
        })
        .await
    }

    async fn release_node(
        &self,
        node: &str,
        taint_added: bool,
    ) -> Result<Outcome, ControllerError> {
        if !taint_added {
            return Ok(Outcome::Unchanged);
        }
        let name = node.to_owned();
        self.blocking(format!("resuming node {node}"), move |c| {
            let current = c.node(&name)?;
            // Never resume a node whose reason is not Probity's (an operator drained
            // it again since, for their own reason).
            if !current.drained_by_probity() {
                return Ok(Outcome::Unchanged);
            }
            c.resume(&name)?;
            Ok(Outcome::Done)
        })
        .await
    }

    async fn node_pods(&self, node: &str) -> Result<Vec<PodRef>, ControllerError> {
        let name = node.to_owned();
        let namespace = self.namespace.clone();
        let ids = self
            .blocking(format!("listing the jobs on {node}"), move |c| {
                c.jobs_on(&name)
            })
            .await?;
        Ok(ids
            .into_iter()
            .map(|id| PodRef {
                namespace: namespace.clone(),
                name: format!("job-{id}"),
                uid: None,
                node: None,
            })
            .collect())
    }

    async fn delete_pod(&self, pod: &PodRef, _reason: &str) -> Result<Outcome, ControllerError> {
        let id = self.job(pod)?.to_owned();
        self.blocking(format!("cancelling job {id}"), move |c| {
            c.stop_job(&id, JobStop::Cancel)?;
            Ok(Outcome::Done)
        })
        .await
    }

    async fn stop_pod(
        &self,
        pod: &PodRef,
        _reason: &str,
        dry_run: bool,
    ) -> Result<Outcome, ControllerError> {
        let id = self.job(pod)?.to_owned();
        let node = pod.node.clone();
        let how = self.stop;
        self.blocking(format!("stopping job {id} ({})", how.as_str()), move |c| {
            let state = match c.run("squeue", &["--noheader", "--jobs", &id, "--format", "%T"]) {
                Ok(text) => text.trim().to_owned(),
                // A job Slurm has forgotten (finished and purged) is gone already.
                Err(SlurmError::Command { problem, .. }) if problem.contains("Invalid job id") => {
                    return Ok(Outcome::Unchanged);
                }
                Err(other) => return Err(other),
            };
            if !matches!(state.as_str(), "RUNNING" | "CONFIGURING" | "SUSPENDED") {
                return Ok(Outcome::Unchanged);
            }
            if let Some(node) = &node {
                let here = c.run(
                    "squeue",
                    &[
                        "--noheader",
                        "--jobs",
                        &id,
                        "--nodelist",
                        node,
                        "--format",
                        "%A",
                    ],
                )?;
                if here.trim().is_empty() {
                    return Ok(Outcome::NotThere);
                }
            }
            if dry_run {
                return Ok(Outcome::Done);
            }
            c.stop_job(&id, how)?;
            Ok(Outcome::Done)
        })
        .await
    }

    async fn movable_work(
        &self,
        nodes: &[String],
        _order_key: &str,
    ) -> Result<Vec<Candidate>, ControllerError> {
        let mut out = Vec::new();
        for node in nodes {
            for pod in self.node_pods(node).await? {
                out.push(Candidate {
                    pod,
                    node: node.clone(),
                    priority: None,
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_names_map_to_job_ids() {
        assert_eq!(job_of("job-12"), Some("12"));
        for bad in ["12", "job-", "job-1x", "job--1", "pod-1"] {
            assert_eq!(job_of(bad), None, "{bad}");
        }
    }
}
