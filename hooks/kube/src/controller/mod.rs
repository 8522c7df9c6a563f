//! `probity controller`: Probity's hands in Kubernetes.
//!
//! Probity's blocklist is the truth of which nodes are blocked; the controller makes
//! the cluster show it: a blocked node gets Probity's taint and an annotation naming
//! the block record, and loses both when unblocked. It is level-triggered: every pass
//! compares the blocklist with the nodes as they are, so a restart, a missed event or a
//! manual edit converges to the same state, and a node already as asked is left alone.
//!
//! Code map:
//! - [`plan`] — one pass decided without I/O: steps, breaker admissions, tombstones;
//! - [`pass`] — a pass's bookkeeping every manager shares (refusals, records, the event log);
//! - [`breaker`] — the circuit breaker (nodes and pool shares per window);
//! - [`confirm`] — the blocklist as a pass may act on it (lagging answers confirmed);
//! - [`actuate`] — the [`Actuator`] trait, one implementation per cluster manager;
//! - [`kubernetes`] — Kubernetes' implementation (taint, annotation, Event, eviction);
//! - `stop.rs` — a block's work stopped: the reading pod, or what a drain stops;
//! - `labels.rs` — the zone label kept equal to the store's zones;
//! - [`migrate`] — work moved out of a zone its agents ask to `migrate`, bounded per window;
//! - [`nodes`] — each Node's labels and resources sent as the facts the cluster owns;
//! - [`lease`] — one active replica through a `coordination.k8s.io` Lease;
//! - [`shared`] — the pause, the dry run, the breaker and the report in a ConfigMap;
//! - [`source`] — Probity's API (`GET /v1/nodes/blocked`);
//! - [`metrics`] — counters and the `/metrics` endpoint.
//!
//! Safety rules (the anchors' worst bugs came from acting at scale or on stale state):
//! nothing is acted on unless this replica holds the lease; a pass that cannot read
//! Probity, the nodes or the shared state acts on nothing (an unreadable blocklist is
//! never an empty one); the breaker's admissions are written to the shared state
//! before the cluster is touched; a block record not newer than the node's last
//! release is stale; only what Probity set is ever removed.

pub mod actuate;
pub mod breaker;
pub mod confirm;
pub mod kubernetes;
mod labels;
pub mod lease;
pub mod metrics;
pub mod migrate;
pub mod nodes;
pub mod pass;
pub mod plan;
pub mod reports;
pub mod shared;
pub mod source;
pub mod stop;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use probity_base::error::chain as error_chain;

pub use actuate::{Actuator, Outcome, PodRef};
pub use breaker::BreakerLimits;
pub use kubernetes::{BLOCK_ANNOTATION, BlockTaint, KubeActuator};
pub use plan::{ActionRecord, BlockMark, ControlState, ReaderPod};
pub use shared::{SharedControl, StateStore};
pub use source::ProbityApi;

use plan::{NodeView, Step};

/// What went wrong in the controller.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A call to the apiserver failed.
    #[error("{what}")]
    Kube {
        /// What was being done.
        what: String,
        /// The apiserver's or the client's error.
        #[source]
        source: Box<kube::Error>,
    },
    /// Probity's API could not be read.
    #[error("{what} on Probity: {reason}")]
    Probity {
        /// The request.
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// The TLS material for Probity's API is unusable.
    #[error("TLS for Probity's API: {0}")]
    Tls(String),
    /// The shared state does not parse.
    #[error("the controller state in ConfigMap {name} is unreadable: {reason}")]
    State {
        /// The ConfigMap.
        name: String,
        /// Why.
        reason: String,
    },
    /// An object kept changing under every write.
    #[error("{0} changed under every attempt to write it")]
    Conflict(String),
    /// A cluster manager's command failed (Slurm's `scontrol`, `squeue`, `scancel`).
    #[error("{what}: {reason}")]
    Manager {
        /// What was being done.
        what: String,
        /// The command's error.
        reason: String,
    },
    /// An eviction was refused for now (a disruption budget): it is retried, never
    /// turned into a delete.
    #[error("{what}: refused for now: {message}")]
    Disrupted {
        /// The eviction.
        what: String,
        /// The apiserver's message.
        message: String,
    },
}

impl ControllerError {
    pub(crate) fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        ControllerError::Kube {
            what: what.into(),
            source: Box::new(source),
        }
    }
}

/// How a controller runs.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// The namespace of its Lease and its state ConfigMap.
    pub namespace: String,
    /// The Lease's name.
    pub lease_name: String,
    /// The state ConfigMap's name.
    pub state_name: String,
    /// This replica's name in the Lease and in Events.
    pub identity: String,
    /// How long a lease holds without renewal.
    pub lease_duration: Duration,
    /// Time between passes.
    pub interval: Duration,
    /// The circuit breaker's limits.
    pub limits: BreakerLimits,
    /// Node labels whose values make pools for the breaker (a zone, a GPU model).
    pub pool_labels: Vec<String>,
    /// Report only, whatever the shared state says.
    pub dry_run: bool,
    /// The node label the mutating webhook's affinity names for Probity's zones
    /// (`[admission] zone_label`): kept equal to each node's group in the store.
    pub zone_label: String,
    /// The Node attribute that groups nodes (the schema's `@placement_group`).
    pub zone_attribute: String,
    /// How often the zone labels are compared with the store (also whenever a node
    /// lacks the label).
    pub label_interval: Duration,
    /// Append every action to Probity's event log (`POST /v1/events`; the caller's
    /// certificate must be in a group the api policies let record events).
    pub record_events: bool,
    /// Send each Node's labels and resources as the facts the cluster owns
    /// (`PUT /v1/facts/cluster`, see [`nodes`]; the caller's certificate must be in a
    /// group the api policies let replace them).
    pub cluster_facts: bool,
    /// Delete a pod whose evictions were refused (a disruption budget) for this long;
    /// `None` (the default): never delete, keep retrying and reporting.
    pub evict_escalation: Option<Duration>,
    /// The `migrate` bound and window when the policy gives none.
    pub migrate: migrate::MigrateLimits,
    /// How often the PolicyReports of what warn and audit policies find are written
    /// (see [`reports`]); `None`: never.
    pub report_interval: Option<Duration>,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        Self {
            namespace: "probity-system".into(),
            lease_name: "probity-controller".into(),
            state_name: "probity-controller-state".into(),
            identity: "probity-controller".into(),
            lease_duration: Duration::from_secs(15),
            interval: Duration::from_millis(500),
            limits: BreakerLimits::default(),
            pool_labels: vec![
                "topology.probity.io/zone".into(),
                "topology.kubernetes.io/zone".into(),
                "nvidia.com/gpu.product".into(),
            ],
            dry_run: false,
            zone_label: "topology.probity.io/zone".into(),
            zone_attribute: "zone".into(),
            label_interval: Duration::from_secs(30),
            evict_escalation: None,
            record_events: false,
            migrate: migrate::MigrateLimits::default(),
            cluster_facts: false,
            report_interval: Some(Duration::from_secs(60)),
        }
    }
}

/// The controller: one per process, one active per cluster.
pub struct Controller {
    options: ControllerOptions,
    probity: ProbityApi,
    actuator: KubeActuator,
    lease: lease::LeaseLock,
    shared: SharedControl,
    nodes: Store<Node>,
    metrics: Arc<metrics::Metrics>,
    client: Client,
    labelled_at: std::sync::Mutex<Option<std::time::Instant>>,
    reported_at: std::sync::Mutex<Option<std::time::Instant>>,
    cluster_facts_sent: std::sync::Mutex<nodes::Sent>,
    /// Per node, the answers in a row without its block, and with a stale one.
    confirmations: std::sync::Mutex<confirm::Confirmations>,
}

/// The modes a pass found the shared state in.
#[derive(Debug, Clone, Copy)]
struct Modes {
    paused: bool,
    dry_run: bool,
}

impl Controller {
    /// A controller acting through `client` on what `probity` reports, with the taint
    /// Probity's settings name.
    pub fn new(client: Client, probity: ProbityApi, options: ControllerOptions) -> Self {
        let lease = lease::LeaseLock::new(
            Api::namespaced(client.clone(), &options.namespace),
            &options.lease_name,
            &options.identity,
            options.lease_duration,
        );
        let shared = SharedControl::new(
            Api::namespaced(client.clone(), &options.namespace),
            &options.state_name,
        );
        let (nodes, _writer) = reflector::store();
        Self {
            actuator: KubeActuator::new(client.clone(), BlockTaint::default(), &options.identity),
            options,
            probity,
            lease,
            shared,
            nodes,
            metrics: Arc::default(),
            client,
            labelled_at: std::sync::Mutex::new(None),
            reported_at: std::sync::Mutex::new(None),
            cluster_facts_sent: std::sync::Mutex::default(),
            confirmations: std::sync::Mutex::default(),
        }
    }

    /// Its metrics (served by [`metrics::serve`]).
    pub fn metrics(&self) -> Arc<metrics::Metrics> {
        self.metrics.clone()
    }

    /// Runs until `shutdown` completes, then gives the lease up.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let (store, writer) = reflector::store();
        self.nodes = store;
        let watch = reflector::reflector(
            writer,
            watcher(
                Api::<Node>::all(self.client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .applied_objects()
        .for_each(|_| futures::future::ready(()));
        let watch = tokio::spawn(watch);
        let mut ticks = tokio::time::interval(self.options.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = ticks.tick() => self.tick().await,
            }
        }
        watch.abort();
        self.lease.release().await;
        self.metrics.set_leader(false);
    }

    async fn tick(&self) {
        if self.lease.renewal_due() {
            match self.lease.try_hold().await {
                Ok(leads) => {
                    if leads && !self.metrics.is_leader() {
                        tracing::info!(
                            identity = self.lease.identity(),
                            "holding the lease: acting"
                        );
                    }
                }
                Err(error) => {
                    self.metrics.error();
                    tracing::warn!(error = %error_chain(&error), "the lease could not be renewed");
                }
            }
        }
        let leads = self.lease.leads();
        self.metrics.set_leader(leads);
        if !leads {
            return;
        }
        // The node cache fills from the first list; until then (or if listing nodes is
        // refused) a pass would plan from nothing, so it waits a little and skips.
        let ready =
            tokio::time::timeout(self.options.interval, self.nodes.wait_until_ready()).await;
        if !matches!(ready, Ok(Ok(()))) {
            tracing::warn!("the node cache is not ready: pass skipped");
            return;
        }
        match self.pass().await {
            // The labels are their own job, after the pass (its state write is at the
            // version it read), under the modes that pass read; failing them holds no
            // block back.
            Ok(modes) => {
                if !modes.paused
                    && self.lease.leads()
                    && let Err(error) = self.sync_zone_labels(modes.dry_run).await
                {
                    self.metrics.error();
                    tracing::warn!(error = %error_chain(&error), "the zone labels could not be brought in step");
                }
                if !modes.paused
                    && self.lease.leads()
                    && let Err(error) = self.migrate(modes.dry_run).await
                {
                    self.metrics.error();
                    tracing::warn!(error = %error_chain(&error), "migrate requests could not be carried out");
                }
            }
            Err(error) => {
                self.metrics.error();
                tracing::warn!(error = %error_chain(&error), "reconcile pass failed: nothing acted on");
            }
        }
        // Reports touch no node either: written whatever the modes.
        if self.lease.leads()
            && let Err(error) = self.sync_reports().await
        {
            self.metrics.error();
            tracing::warn!(error = %error_chain(&error), "the policy reports could not be written");
        }
        // The cluster's facts feed the store and touch no node: sent whatever the modes.
        if self.options.cluster_facts
            && self.lease.leads()
            && let Err(error) = self.sync_cluster_facts().await
        {
            self.metrics.error();
            tracing::warn!(error = %error_chain(&error), "the cluster's node facts could not be sent");
        }
    }

    /// One reconcile pass; the modes the shared state was in.
    async fn pass(&self) -> Result<Modes, ControllerError> {
        let answered = self.probity.blocks().await?;
        let settings_taint = self.probity.block_taint().await?;
        let read = self.shared.load().await?;
        let nodes = self.node_views(&read.state);
        let spec = plan::TaintSpec {
            key: settings_taint.key.clone(),
            effect: settings_taint.effect.clone(),
        };
        let now = unix_now();
        let mut state = read.state.clone();
        let blocks = self.confirmed(answered, &mut state);
        let dry_run = self.options.dry_run || state.dry_run;
        let modes = Modes {
            paused: state.paused,
            dry_run,
        };
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
            // Bounded: the state is one ConfigMap (1 MiB at most).
            let would: Vec<ActionRecord> = steps
                .iter()
                .take(plan::MAX_REPORT)
                .map(|step| record(step, now, "would", describe(step)))
                .collect();
            self.metrics
                .set_modes(state.breaker.tripped.is_some(), state.paused, true);
            if state
                .would
                .iter()
                .map(strip_time)
                .ne(would.iter().map(strip_time))
            {
                for step in &steps {
                    tracing::info!(
                        node = step.node(),
                        action = step.kind(),
                        detail = describe(step),
                        "dry run: would act"
                    );
                }
                state.would = would;
                if !self.shared.store(&read, &state).await? {
                    return Ok(modes);
                }
                // The stops it would make, asked of the apiserver as dry-run evictions
                // (`dryRun=All`): a disruption budget's refusal shows here too.
                let mut scratch = state.clone();
                let mut seen = Vec::new();
                for step in &steps {
                    if let Step::StopWork { node, block } = step {
                        let actuator = self.actuator.with_taint(settings_taint.clone());
                        let (_, records) = stop::stop_work(
                            &actuator,
                            node,
                            block,
                            &mut scratch,
                            now,
                            true,
                            self.options.evict_escalation,
                        )
                        .await;
                        seen.extend(records);
                    }
                }
                if !seen.is_empty() {
                    self.shared.update(|s| s.record(seen.clone())).await?;
                }
            }
            return Ok(modes);
        }
        let was_tripped = state.breaker.tripped.is_some();
        let steps = plan::plan(
            &blocks,
            &nodes,
            &mut state,
            &self.options.limits,
            &spec,
            now,
        );
        state.would.clear();
        let notes = pass::note_refusals(
            &steps,
            &mut state,
            was_tripped,
            now,
            &self.metrics,
            "probity controller reset",
        );
        self.metrics
            .set_modes(state.breaker.tripped.is_some(), state.paused, false);
        if state != read.state && !self.shared.store(&read, &state).await? {
            // Someone (an operator's command, another replica) wrote in between: plan
            // again on the next pass, from what they wrote.
            return Ok(modes);
        }
        let mut acted = pass::Acted::default();
        let mut stops = state.clone();
        let mut taint_failed: Vec<&str> = Vec::new();
        for step in &steps {
            // A pass may take longer than the lease: a replica that lost it stops here,
            // rather than acting from a plan another replica may be carrying out.
            if !self.lease.leads() {
                tracing::warn!(
                    "the lease was lost during the pass: the rest is left to the leader"
                );
                break;
            }
            let result = match step {
                Step::Block { mark, .. } | Step::Refresh { mark, .. } => {
                    let replaces = match step {
                        Step::Refresh { replaces, .. } => replaces.as_deref(),
                        _ => None,
                    };
                    let (key, effect) = mark.taint(&spec);
                    let taint = BlockTaint { key, effect };
                    match taint.check() {
                        Ok(()) => {
                            self.actuator
                                .with_taint(taint)
                                .block_node(step.node(), mark, replaces)
                                .await
                        }
                        Err(reason) => Err(ControllerError::Probity {
                            what: format!("the block record of {}", step.node()),
                            reason,
                        }),
                    }
                }
                Step::Release { node, applied } => {
                    let (key, effect) = applied.taint(&spec);
                    self.actuator
                        .with_taint(BlockTaint { key, effect })
                        .release_node(node, applied.taint_added)
                        .await
                }
                Step::StopWork { node, block } => {
                    // Pods evicted from a node whose taint failed could land on it again.
                    if taint_failed.contains(&node.as_str()) {
                        continue;
                    }
                    let actuator = self.actuator.with_taint(settings_taint.clone());
                    let (complete, records) = stop::stop_work(
                        &actuator,
                        node,
                        block,
                        &mut stops,
                        now,
                        false,
                        self.options.evict_escalation,
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
                        taint_failed.push(step.node());
                    }
                    // A taint move that failed: the old mark stays what Probity set, so
                    // the next pass moves it again rather than leave the old taint.
                    if let Step::Refresh {
                        node,
                        replaces: Some(old),
                        ..
                    } = step
                    {
                        acted.unmoved.push((node.clone(), old.as_ref().clone()));
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
            .finish(&self.shared, log, &notes, &state, &read.state)
            .await?;
        Ok(modes)
    }

    fn confirmed(
        &self,
        answered: source::Blocklist,
        state: &mut ControlState,
    ) -> BTreeMap<String, plan::BlockMark> {
        let mut seen = self.confirmations.lock().unwrap_or_else(|p| p.into_inner());
        seen.confirm(answered, state)
    }

    fn node_views(&self, state: &ControlState) -> Vec<NodeView> {
        let mut views: Vec<NodeView> = self
            .nodes
            .state()
            .iter()
            .filter_map(|node| {
                let name = node.metadata.name.clone()?;
                let labels = node.metadata.labels.as_ref();
                let pools = self
                    .options
                    .pool_labels
                    .iter()
                    .filter_map(|label| {
                        let value = labels?.get(label)?;
                        Some((label.clone(), value.clone()))
                    })
                    .collect();
                let taints = node
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .map(|t| {
                        t.iter()
                            .map(|t| (t.key.clone(), t.effect.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                Some(NodeView {
                    applied: state.applied.get(&name).cloned(),
                    name,
                    taints,
                    pools,
                })
            })
            .collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
    }
}

/// The report's record of one step.
pub fn record(step: &Step, at: u64, outcome: &str, detail: String) -> ActionRecord {
    ActionRecord {
        at,
        node: step.node().to_owned(),
        action: step.kind().to_owned(),
        outcome: outcome.to_owned(),
        detail,
    }
}

fn strip_time(record: &ActionRecord) -> (&str, &str, &str, &str) {
    (
        &record.node,
        &record.action,
        &record.outcome,
        &record.detail,
    )
}

/// What a report says about one step.
pub fn describe(step: &Step) -> String {
    match step {
        Step::Block { block, .. } | Step::Refresh { block, .. } => {
            format!("{} ({})", block.reason, record_name(block))
        }
        Step::Release { applied, .. } => format!(
            "unblocked; was {} ({})",
            applied.block.reason,
            record_name(&applied.block)
        ),
        Step::Refused { trip, .. } => format!(
            "circuit breaker (tripped at {} by {}): {}",
            trip.at, trip.node, trip.reason
        ),
        Step::StopWork { block, .. } => format!(
            "stop {} (block {})",
            block.stop.as_deref().unwrap_or(""),
            record_name(block)
        ),
        Step::Stale {
            block, released, ..
        } => format!(
            "block {} is not newer than the node's last release (number {released})",
            record_name(block)
        ),
    }
}

/// A block record as a report names it: its store revision and time.
fn record_name(block: &plan::BlockMark) -> String {
    match block.revision {
        Some(revision) => format!("revision {revision}, since {}", block.since),
        None => format!("since {}", block.since),
    }
}

/// Now, in Unix seconds (0 before 1970).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What an operator sees of the controller: its state as the cluster holds it.
pub async fn status(
    client: Client,
    options: &ControllerOptions,
) -> Result<ControlState, ControllerError> {
    let shared = SharedControl::new(
        Api::namespaced(client, &options.namespace),
        &options.state_name,
    );
    Ok(shared.load().await?.state)
}

/// Changes the controller's shared state as an operator asked (pause, resume, reset,
/// dry run on or off); the active replica follows from its next pass.
pub async fn command(
    client: Client,
    options: &ControllerOptions,
    change: impl Fn(&mut ControlState) + Send,
) -> Result<ControlState, ControllerError> {
    let shared = SharedControl::new(
        Api::namespaced(client, &options.namespace),
        &options.state_name,
    );
    shared.update(change).await
}
