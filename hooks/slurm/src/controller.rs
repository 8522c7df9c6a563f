//! The controller's Slurm side: Probity's blocklist mirrored onto Slurm's nodes.
//!
//! The same pass as Kubernetes' (`probity_kube::controller`): Probity's answer is
//! confirmed ([`Confirmations`]), planned without I/O ([`plan::plan`], with the same
//! breaker, pause and dry run), the plan's admissions written to the shared state
//! before anything acts, then carried out through [`SlurmActuator`]: a block drains
//! the node with Probity's reason, a release resumes it only if the reason is still
//! Probity's, a failed read's reader job is requeued held (or cancelled).
//!
//! Where Kubernetes keeps the state in a ConfigMap and elects through a Lease, here
//! both live in etcd: the state under `slurm-controller/state`, written only at the
//! revision read, and one active process holds `slurm-controller/leader` under an etcd
//! lease.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use probity_base::error::chain as error_chain;
use probity_etcd::{EtcdClient, KeepAlive, Swap};
use probity_kube::controller::breaker::BreakerLimits;
use probity_kube::controller::confirm::Confirmations;
use probity_kube::controller::metrics::Metrics;
use probity_kube::controller::pass;
use probity_kube::controller::plan::{self, ActionRecord, ControlState, NodeView, Step, TaintSpec};
use probity_kube::controller::shared::StateStore;
use probity_kube::controller::stop::stop_work;
use probity_kube::controller::{
    Actuator, ControllerError, Outcome, ProbityApi, describe, record, unix_now,
};

use crate::actuator::SlurmActuator;
use crate::nodes::SlurmNode;

/// The shared state's key (under the etcd prefix).
pub const STATE_KEY: &str = "slurm-controller/state";
/// The leader's key.
pub const LEADER_KEY: &str = "slurm-controller/leader";

/// What a drain looks like to the plan: one "taint" every drained node carries.
fn drain_spec() -> TaintSpec {
    TaintSpec {
        key: "slurm/drain".into(),
        effect: "DRAIN".into(),
    }
}

/// How the Slurm controller runs.
#[derive(Debug, Clone)]
pub struct SlurmControllerOptions {
    /// This process's name in the leader key and in reports.
    pub identity: String,
    /// How long leadership holds without renewal.
    pub lease_ttl: Duration,
    /// Time between passes.
    pub interval: Duration,
    /// The circuit breaker's limits (pools: each partition).
    pub limits: BreakerLimits,
    /// Report only, whatever the shared state says.
    pub dry_run: bool,
    /// Append every action to Probity's event log (`POST /v1/events`).
    pub record_events: bool,
    /// Cancel a job whose stop was refused for this long; `None`: never.
    pub escalation: Option<Duration>,
}

impl Default for SlurmControllerOptions {
    fn default() -> Self {
        Self {
            identity: "probity-slurm-controller".into(),
            lease_ttl: Duration::from_secs(15),
            interval: Duration::from_millis(500),
            limits: BreakerLimits::default(),
            dry_run: false,
            record_events: true,
            escalation: None,
        }
    }
}

/// The state as read, with the revision a write must match (`None`: absent).
pub struct Versioned {
    state: ControlState,
    revision: Option<i64>,
}

/// The controller's state in etcd.
#[derive(Clone)]
pub struct EtcdControl {
    etcd: EtcdClient,
}

impl EtcdControl {
    /// The state kept through `etcd`.
    pub fn new(etcd: EtcdClient) -> Self {
        Self { etcd }
    }

    fn etcd_error(what: &str, error: impl std::error::Error) -> ControllerError {
        ControllerError::Manager {
            what: what.into(),
            reason: error_chain(&error),
        }
    }

    /// The state now.
    pub async fn state(&self) -> Result<ControlState, ControllerError> {
        Ok(self.load().await?.state)
    }
}

impl StateStore for EtcdControl {
    type Read = Versioned;

    fn location(&self) -> String {
        format!("etcd key {STATE_KEY}")
    }

    fn state_of(read: &Versioned) -> &ControlState {
        &read.state
    }

    async fn load(&self) -> Result<Versioned, ControllerError> {
        let (entry, _) = self
            .etcd
            .get(STATE_KEY)
            .await
            .map_err(|e| Self::etcd_error("reading the controller state from etcd", e))?;
        let Some(entry) = entry else {
            return Ok(Versioned {
                state: ControlState::default(),
                revision: None,
            });
        };
        // A state that does not parse is an error, never a default: acting on a
        // forgotten breaker or pause would be acting by mistake.
        let state = serde_json::from_slice(&entry.value).map_err(|e| ControllerError::State {
            name: format!("etcd key {STATE_KEY}"),
            reason: e.to_string(),
        })?;
        Ok(Versioned {
            state,
            revision: Some(entry.mod_revision),
        })
    }

    async fn store(&self, read: &Versioned, state: &ControlState) -> Result<bool, ControllerError> {
        let bytes = serde_json::to_vec(state).map_err(|e| ControllerError::State {
            name: format!("etcd key {STATE_KEY}"),
            reason: e.to_string(),
        })?;
        let swap = match read.revision {
            None => self.etcd.create(STATE_KEY, bytes).await,
            Some(revision) => self.etcd.update_if(STATE_KEY, bytes, revision).await,
        }
        .map_err(|e| Self::etcd_error("writing the controller state to etcd", e))?;
        Ok(swap.is_applied())
    }
}

/// Leadership: the leader key under a lease this process keeps alive.
struct Leadership {
    keep: Option<(KeepAlive, Instant)>,
    /// Whether "standing by" was logged since this process last led (once, not on
    /// every pass).
    standing_by: bool,
}

/// The Slurm controller: one per process, one active per cluster.
pub struct SlurmController {
    options: SlurmControllerOptions,
    probity: ProbityApi,
    actuator: SlurmActuator,
    etcd: EtcdClient,
    control: EtcdControl,
    leadership: tokio::sync::Mutex<Leadership>,
    confirmations: std::sync::Mutex<Confirmations>,
    metrics: Arc<Metrics>,
}

impl SlurmController {
    /// A controller acting through `actuator` on what `probity` reports, its lease and
    /// state in `etcd`.
    pub fn new(
        etcd: EtcdClient,
        probity: ProbityApi,
        actuator: SlurmActuator,
        options: SlurmControllerOptions,
    ) -> Self {
        Self {
            control: EtcdControl::new(etcd.clone()),
            etcd,
            probity,
            actuator,
            options,
            leadership: tokio::sync::Mutex::new(Leadership {
                keep: None,
                standing_by: false,
            }),
            confirmations: std::sync::Mutex::default(),
            metrics: Arc::default(),
        }
    }

    /// Its metrics (served by `probity_kube::controller::metrics::serve`).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Runs until `shutdown` completes, then gives leadership up.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut ticks = tokio::time::interval(self.options.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = ticks.tick() => self.tick().await,
            }
        }
        let mut leadership = self.leadership.lock().await;
        if let Some((keep, _)) = leadership.keep.take() {
            let lease = keep.lease().id;
            drop(keep);
            let _ = self.etcd.revoke_lease(lease).await;
        }
        self.metrics.set_leader(false);
    }

    /// Whether this process leads now: it holds the leader key under a lease that is
    /// alive and was renewed within its TTL, or it just took the key.
    async fn leads(&self) -> bool {
        let mut leadership = self.leadership.lock().await;
        if let Some((keep, granted)) = &leadership.keep {
            let state = keep.state();
            let renewed = state.last_renewed.unwrap_or(*granted);
            if !state.expired && renewed.elapsed() < keep.lease().ttl {
                return true;
            }
            tracing::warn!("the leader lease lapsed: not acting until it is taken again");
            leadership.keep = None;
        }
        let lease = match self.etcd.grant_lease(self.options.lease_ttl).await {
            Ok(lease) => lease,
            Err(error) => {
                self.metrics.error();
                tracing::warn!(error = %error_chain(&error), "no lease from etcd");
                return false;
            }
        };
        match self
            .etcd
            .create_with_lease(LEADER_KEY, self.options.identity.clone(), lease.id)
            .await
        {
            Ok(Swap::Applied { .. }) => {
                tracing::info!(
                    identity = self.options.identity,
                    "holding the leader key: acting"
                );
                leadership.keep = Some((self.etcd.keep_alive(lease), Instant::now()));
                leadership.standing_by = false;
                true
            }
            Ok(Swap::Refused { .. }) => {
                let _ = self.etcd.revoke_lease(lease.id).await;
                if !leadership.standing_by {
                    tracing::info!(
                        identity = self.options.identity,
                        "the leader key is another replica's: standing by"
                    );
                    leadership.standing_by = true;
                }
                false
            }
            Err(error) => {
                self.metrics.error();
                let _ = self.etcd.revoke_lease(lease.id).await;
                tracing::warn!(error = %error_chain(&error), "the leader key could not be taken");
                false
            }
        }
    }

    async fn tick(&self) {
        let leads = self.leads().await;
        self.metrics.set_leader(leads);
        if !leads {
            return;
        }
        if let Err(error) = self.pass().await {
            self.metrics.error();
            tracing::warn!(error = %error_chain(&error), "reconcile pass failed: nothing acted on");
        }
    }

    async fn slurm_nodes(&self) -> Result<Vec<SlurmNode>, ControllerError> {
        let commands = self.actuator.commands().clone();
        tokio::task::spawn_blocking(move || commands.nodes(None))
            .await
            .map_err(|e| ControllerError::Manager {
                what: "reading Slurm's nodes".into(),
                reason: e.to_string(),
            })?
            .map_err(|e| ControllerError::Manager {
                what: "reading Slurm's nodes".into(),
                reason: error_chain(&e),
            })
    }

    /// One reconcile pass.
    async fn pass(&self) -> Result<(), ControllerError> {
        let answered = self.probity.blocks().await?;
        let read = self.control.load().await?;
        let slurm = self.slurm_nodes().await?;
        let nodes = node_views(&slurm, &read.state);
        let spec = drain_spec();
        let now = unix_now();
        let mut state = read.state.clone();
        let mut blocks = {
            let mut seen = self.confirmations.lock().unwrap_or_else(|p| p.into_inner());
            seen.confirm(answered, &mut state)
        };
        // Slurm has one way to keep work off a node: a record's taint effect is
        // Kubernetes' business.
        for block in blocks.values_mut() {
            block.taint_effect = None;
        }
        let dry_run = self.options.dry_run || state.dry_run;
        self.metrics.pass();
        if dry_run {
            let mut simulated = state.clone();
            let steps = plan::plan(
                &blocks,
                &nodes,
                &mut simulated,
                &self.options.limits,
                &spec,
                now,
            );
            let would: Vec<ActionRecord> = steps
                .iter()
                .take(plan::MAX_REPORT)
                .map(|step| record(step, now, "would", describe(step)))
                .collect();
            self.metrics
                .set_modes(state.breaker.tripped.is_some(), state.paused, true);
            let unchanged = state.would.len() == would.len()
                && state.would.iter().zip(&would).all(|(a, b)| {
                    (&a.node, &a.action, &a.outcome, &a.detail)
                        == (&b.node, &b.action, &b.outcome, &b.detail)
                });
            if !unchanged {
                for step in &steps {
                    tracing::info!(
                        node = step.node(),
                        action = step.kind(),
                        detail = describe(step),
                        "dry run: would act"
                    );
                }
                state.would = would;
                self.control.store(&read, &state).await?;
            }
            return Ok(());
        }
        let was_tripped = state.breaker.tripped.is_some();
        let mut steps = plan::plan(
            &blocks,
            &nodes,
            &mut state,
            &self.options.limits,
            &spec,
            now,
        );
        // A drain in Probity's words (the Prolog's, the health check's) is Probity's to
        // undo, whichever of its parts wrote it.
        for step in &mut steps {
            if let Step::Block { node, mark, .. } = step
                && !mark.taint_added
                && slurm
                    .iter()
                    .any(|n| &n.name == node && n.drained_by_probity())
            {
                mark.taint_added = true;
                state.applied.insert(node.clone(), mark.clone());
            }
        }
        state.would.clear();
        let notes = pass::note_refusals(
            &steps,
            &mut state,
            was_tripped,
            now,
            &self.metrics,
            "probity slurm controller reset",
        );
        self.metrics
            .set_modes(state.breaker.tripped.is_some(), state.paused, false);
        if state != read.state && !self.control.store(&read, &state).await? {
            return Ok(());
        }
        let mut acted = pass::Acted::default();
        let mut stops = state.clone();
        let mut drain_failed: Vec<String> = Vec::new();
        for step in &steps {
            let result = match step {
                Step::Block { node, mark, .. } | Step::Refresh { node, mark, .. } => {
                    self.actuator.block_node(node, mark, None).await
                }
                Step::Release { node, applied } if applied.taint_added => {
                    let expected = crate::reason::one_line(&applied.block.reason);
                    self.actuator.release_drain(node, &expected).await
                }
                Step::Release { .. } => Ok(Outcome::Unchanged),
                Step::StopWork { node, block } => {
                    // Jobs requeued off a node whose drain failed could start there again.
                    if drain_failed.contains(node) {
                        continue;
                    }
                    let (complete, records) = stop_work(
                        &self.actuator,
                        node,
                        block,
                        &mut stops,
                        now,
                        false,
                        self.options.escalation,
                    )
                    .await;
                    for record in &records {
                        self.metrics.action(&record.action, &record.outcome);
                    }
                    acted.done.extend(records);
                    if complete {
                        let readers = block.readers().map(plan::ReaderPod::key).collect();
                        acted
                            .stopped
                            .push((node.clone(), plan::StoppedBlock::of(block, readers)));
                    }
                    continue;
                }
                Step::Refused { .. } | Step::Stale { .. } => continue,
            };
            match pass::acted(step, now, result, &self.metrics) {
                Ok(note) => {
                    if let Step::Release { node, .. } = step {
                        acted.released.push(node.clone());
                    }
                    acted.done.push(note);
                }
                Err(note) => {
                    if matches!(step, Step::Block { .. } | Step::Refresh { .. }) {
                        drain_failed.push(step.node().to_owned());
                    }
                    acted.done.push(note);
                }
            }
        }
        acted.stopping = stops.stopping.clone();
        let log = self
            .options
            .record_events
            .then_some((&self.probity, self.metrics.as_ref()));
        acted
            .finish(&self.control, log, &notes, &state, &read.state)
            .await?;
        Ok(())
    }
}

/// Slurm's nodes as the plan sees them: a drained node carries the drain, whoever set
/// it; each partition is a pool for the breaker.
fn node_views(slurm: &[SlurmNode], state: &ControlState) -> Vec<NodeView> {
    let spec = drain_spec();
    let mut views: Vec<NodeView> = slurm
        .iter()
        .map(|node| NodeView {
            name: node.name.clone(),
            applied: state.applied.get(&node.name).cloned(),
            taints: if node.drained() {
                vec![(spec.key.clone(), spec.effect.clone())]
            } else {
                Vec::new()
            },
            pools: node
                .partitions
                .iter()
                .map(|p| ("partition".to_owned(), p.clone()))
                .collect(),
        })
        .collect();
    views.sort_by(|a, b| a.name.cmp(&b.name));
    views.dedup_by(|a, b| a.name == b.name);
    views
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::parse_nodes;
    use std::collections::BTreeMap;

    #[test]
    fn drained_nodes_carry_the_drain_and_partitions_are_pools() {
        let slurm = parse_nodes(
            "NodeName=b\n   State=IDLE+DRAIN\n   Partitions=train\n   Reason=disk\nNodeName=a\n   State=IDLE\n   Partitions=train,rlhf\n",
        )
        .unwrap();
        let views = node_views(&slurm, &ControlState::default());
        assert_eq!(views[0].name, "a");
        assert!(views[0].taints.is_empty());
        assert_eq!(views[0].pools.len(), 2);
        assert_eq!(
            views[1].taints,
            [("slurm/drain".to_owned(), "DRAIN".to_owned())]
        );
    }

    #[test]
    fn at_scale_the_breaker_drains_a_partitions_share_then_holds_every_other_block() {
        // 1,000 nodes of partition train (and 100 of them also in rlhf); 300 blocked.
        let text: String = (0..1000)
            .map(|i| {
                let partitions = if i < 100 { "train,rlhf" } else { "train" };
                format!("NodeName=gpu-{i:04}\n   State=IDLE\n   Partitions={partitions}\n")
            })
            .collect();
        let slurm = parse_nodes(&text).unwrap();
        let mut state = ControlState::default();
        let nodes = node_views(&slurm, &state);
        let blocks: BTreeMap<String, plan::BlockMark> = (0..300)
            .map(|i| {
                (
                    format!("gpu-{:04}", i * 3),
                    plan::BlockMark::new("operator: bad batch", 100),
                )
            })
            .collect();
        let limits = BreakerLimits {
            max_nodes: 10_000,
            max_percent: 10,
            window_secs: 600,
        };
        let steps = plan::plan(&blocks, &nodes, &mut state, &limits, &drain_spec(), 1_000);
        let drained: Vec<&str> = steps
            .iter()
            .filter(|s| matches!(s, Step::Block { .. }))
            .map(Step::node)
            .collect();
        let refused = steps
            .iter()
            .filter(|s| matches!(s, Step::Refused { .. }))
            .count();
        // Nodes are planned in name order, so rlhf's (gpu-0000..0099) come first: 10% of
        // its 100 nodes is 10 drains, and the 11th trips the breaker, which then holds
        // every other block, train's included, until an operator resets it.
        let first_ten: Vec<String> = (0..10).map(|i| format!("gpu-{:04}", i * 3)).collect();
        assert_eq!(drained, first_ten);
        assert_eq!(refused, 290);
        assert!(state.breaker.tripped.is_some());
    }
}
