//! How a cluster manager carries out what Probity decided: one trait, one
//! implementation per manager: Kubernetes ([`super::KubeActuator`]) and Slurm (crate
//! `probity-slurm`). A "pod" here is a manager's unit of work: a Kubernetes pod, or a
//! Slurm job (named `job-<id>` in the namespace the Slurm settings give readers).

use std::future::Future;

use super::plan::AppliedMark;

/// What an action changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The cluster changed.
    Done,
    /// It already was as asked (an action already taken is not taken twice).
    Unchanged,
    /// The pod named is not on the node named (or has another uid): not stopped.
    NotThere,
    /// The pod is stopping already (an earlier eviction or delete was accepted): it is
    /// not asked again.
    Stopping,
}

impl Outcome {
    /// The outcome's name in reports and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Unchanged => "unchanged",
            Outcome::NotThere => "not-there",
            Outcome::Stopping => "stopping",
        }
    }
}

/// A workload's pod, as a reader names itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid, so a pod recreated under the same name is not the one meant.
    pub uid: Option<String>,
    /// The node it must be on (a reader's claim is checked against it); `None` for a
    /// pod the cluster listed on the node itself.
    pub node: Option<String>,
}

/// The levers a cluster manager gives Probity.
///
/// Each call is idempotent: asked again for a state already reached it answers
/// [`Outcome::Unchanged`] and changes nothing. An implementation only ever removes what
/// it set itself.
pub trait Actuator {
    /// The manager's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// How a report says a piece of work was stopped ("evicted", "requeued held").
    fn stopped_word(&self) -> &'static str {
        "evicted"
    }

    /// Keeps new work off a node and marks it with `mark` (the block record acted on,
    /// and whether the taint is Probity's to remove later). `replaces`, when given, is
    /// the mark set before whose taint Probity added and no longer wants (the taint's
    /// settings changed): it goes in the same change.
    fn block_node(
        &self,
        node: &str,
        mark: &AppliedMark,
        replaces: Option<&AppliedMark>,
    ) -> impl Future<Output = Result<Outcome, Self::Error>> + Send;

    /// Undoes [`Actuator::block_node`]: removes what it set, nothing else.
    /// `taint_added` says whether the block added the node's taint.
    fn release_node(
        &self,
        node: &str,
        taint_added: bool,
    ) -> impl Future<Output = Result<Outcome, Self::Error>> + Send;

    /// The pods a drain of `node` stops (not a DaemonSet's, not a mirror pod, not one
    /// already terminating).
    fn node_pods(
        &self,
        node: &str,
    ) -> impl Future<Output = Result<Vec<PodRef>, Self::Error>> + Send;

    /// Deletes a pod outright: only as the operator's escalation after evictions were
    /// refused past a timeout.
    fn delete_pod(
        &self,
        pod: &PodRef,
        reason: &str,
    ) -> impl Future<Output = Result<Outcome, Self::Error>> + Send;

    /// Stops one workload's pod the way the manager allows (Kubernetes: an eviction, so
    /// disruption budgets hold). `dry_run` asks the manager to check without acting.
    fn stop_pod(
        &self,
        pod: &PodRef,
        reason: &str,
        dry_run: bool,
    ) -> impl Future<Output = Result<Outcome, Self::Error>> + Send;

    /// The work that may be moved off `nodes` (a zone asked to `migrate`), each piece
    /// with its rank in the policy's order, `order_key` (Kubernetes: the pod annotation
    /// of that name); none a drain would leave (a DaemonSet's, a mirror pod, one
    /// stopping). Moving a piece is [`Actuator::stop_pod`]: its owner starts it again
    /// elsewhere, and the zone's facts decide where.
    fn movable_work(
        &self,
        nodes: &[String],
        order_key: &str,
    ) -> impl Future<Output = Result<Vec<super::migrate::Candidate>, Self::Error>> + Send;
}
