//! The agent: one collection cycle after another, each ending in decisions, findings and
//! the obligations carried out; and the audit log read between cycles.
//!
//! A cycle, in order, bounded in time by each source's deadline and in work by the
//! configured caps:
//! 1. collect every source (each may be off, unavailable or failing: never a zero);
//! 2. build the node's facts (see [`crate::facts`]) and upsert them into the engine
//!    (without `blocked`: the blocklist owns it); a rejected upsert removes the node's
//!    entity, so the decisions that follow fail closed rather than judge old facts;
//! 3. decide `comply` for the node (as a fact reporter, with `powerReadingsW`) and
//!    `listen` for every listening socket and reachable port range (see
//!    [`crate::listen`]), in one batch;
//! 4. reconcile the findings: a raised finding is recorded (through the engine's state
//!    store when one is attached) with the facts that caused it and its obligations are
//!    carried out (`alert` to the sinks, the schema's block obligation, `block_node` by
//!    default, through [`Engine::block_node`]; `migrate` as a request to the controller
//!    in shared state, see `actions.rs`); an updated one updates its alert; a cleared
//!    one is recorded, its alert resolved and its requests withdrawn.
//!
//! With a state directory the active findings are saved after each cycle and taken up
//! by the next agent (see [`crate::findings::saved`]): a one-shot run reconciles against
//! the last run's findings as a running agent does against its last cycle's. A finding
//! taken up this way that still holds is not raised again; its alerts, which the last
//! process's alerter kept alive, are posted again by the first cycle (the same alert,
//! refreshed: same labels, same `since`), so they do not lapse while it holds.
//!
//! Between cycles the audit log is read; each successful elevation is decided (`elevate`,
//! as a reporter of its own time and login time) and a deny is a finding like any other,
//! whose alert is resolved after `alerts.elevation_hold_seconds`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use probity::state::StateStore;
use probity::{Engine, EntityUid};
use probity_collect::dcgm::DcgmReport;
use probity_collect::ipmi::DcmiPower;
use probity_collect::nvidia_smi::GpuQuery;
use probity_collect::rapl::RaplPower;
use probity_collect::sockets::ListeningSocket;
use probity_firewall::{Reachability, iptables, nft};
use probity_siem::ForwarderStats;
use probity_siem::engine::{Forwarders, Log};
use thiserror::Error;

use crate::alerts::{AlertSetupError, AlertSinks};
use crate::config::Config;
use crate::elevation::{AuditReader, AuditSetupError};
use crate::findings::{Finding, Findings};
use crate::listen::PortSets;
use crate::sources::{HostSources, SourceState, Sources, unix};

mod actions;
mod audit;
mod collect;
mod decide;
mod engine;
mod obligations;
mod reports;
mod run;
mod saved;

pub use engine::{MAX_ENTITIES_BYTES, build_engine, build_engine_with_state, load_entities};
pub use obligations::node_of_target;
pub use reports::{
    AuditReport, CycleReport, DecisionReport, EventRecord, FactsReport, ObligationReport,
};
pub use run::Progress;

use collect::{PowerHistory, Readings};
use decide::Reconciled;

/// Why the agent could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The policy set did not load.
    #[error("the policy set did not load")]
    Policies(#[source] Box<probity::LoadError>),
    /// The state directory could not be opened.
    #[error("cannot open the state directory {path}")]
    State {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: probity::state::StateError,
    },
    /// The engine refused the state store or an entities file.
    #[error("{what}")]
    Entities {
        /// What was being loaded.
        what: String,
        /// Why.
        #[source]
        source: probity::EntityError,
    },
    /// An entities file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An entities file is not JSON.
    #[error("{path}:{line}:{column}: not valid JSON")]
    Json {
        /// The file.
        path: std::path::PathBuf,
        /// Line.
        line: usize,
        /// Column.
        column: usize,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The alert sinks could not start.
    #[error(transparent)]
    Alerts(#[from] AlertSetupError),
    /// The audit reader could not start.
    #[error(transparent)]
    Audit(#[from] AuditSetupError),
    /// The SIEM forwarders (`[siem]`) could not start.
    #[error("cannot forward to the SIEM: {0}")]
    Siem(String),
}

/// The firewall tool a reading came from, for its state.
type Ruleset = Option<nft::Ruleset>;
type Dump = Option<iptables::Dump>;

/// The node agent.
pub struct Agent {
    config: Config,
    engine: Engine,
    sources: Box<dyn Sources>,
    smi: SourceState<Vec<GpuQuery>>,
    dcgm: SourceState<DcgmReport>,
    rapl: SourceState<RaplPower>,
    bmc: SourceState<DcmiPower>,
    sockets: SourceState<Vec<ListeningSocket>>,
    cpu: SourceState<u32>,
    nft: SourceState<Ruleset>,
    iptables: SourceState<Dump>,
    ip6tables: SourceState<Dump>,
    audit_state: SourceState<()>,
    reduced: Option<(Ruleset, Dump, Dump, Arc<Reachability>)>,
    power: PowerHistory,
    findings: Findings,
    /// The keys of the findings taken up from the state directory whose alerts this
    /// process has not posted yet: the first cycle refreshes them.
    inherited: BTreeSet<String>,
    /// Why the saved findings could not be taken up, for the first cycle's report.
    findings_problem: Option<String>,
    alerts: AlertSinks,
    audit: Option<AuditReader>,
    port_sets: Option<(String, PortSets)>,
    gpu_ids: BTreeSet<String>,
    events: VecDeque<EventRecord>,
    started_at: u64,
    cycles: u64,
    last_cycle_at: Option<u64>,
    last_cpu_ms: f64,
    last_phases: BTreeMap<String, f64>,
    last_unreadable: BTreeMap<String, String>,
    obligation_failures: u64,
    /// The keys of the dry-run `migrate` requests published for warn and audit
    /// findings, withdrawn once their finding is gone.
    dry_run_actions: BTreeSet<String>,
    event_failures: u64,
    forwarders: Option<Forwarders>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("node", &self.config.node)
            .field("cycles", &self.cycles)
            .field("findings", &self.findings.len())
            .finish_non_exhaustive()
    }
}

/// The CPU time this thread has used.
pub fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Agent {
    /// An agent on the real node, with the alert sinks and audit reader `config` names.
    pub fn new(config: Config, engine: Engine) -> Result<Self, AgentError> {
        let sources = Box::new(HostSources::new(&config));
        let alerts = AlertSinks::from_config(&config.alerts)?;
        Self::with_parts(config, engine, sources, alerts)
    }

    /// An agent with its sources and alert sinks given (tests, benchmarks).
    pub fn with_parts(
        config: Config,
        engine: Engine,
        mut sources: Box<dyn Sources>,
        alerts: AlertSinks,
    ) -> Result<Self, AgentError> {
        let audit = if config.audit.enabled {
            Some(AuditReader::new(
                &config.audit,
                config.state_dir.as_deref(),
            )?)
        } else {
            None
        };
        // RAPL reports power between two samples: take the first now, so the first
        // cycle has a reading.
        let mut rapl = SourceState::new("rapl", config.rapl.enabled);
        let now = engine.clock().now();
        if config.rapl.enabled {
            rapl.record(sources.rapl(), now);
        }
        let (findings, findings_problem) = saved::take_up(&config);
        Ok(Self {
            smi: SourceState::new("nvidia-smi", config.nvidia_smi.enabled),
            dcgm: SourceState::new("dcgm", config.dcgm.url.is_some()),
            rapl,
            bmc: SourceState::new("ipmi", config.ipmi.enabled),
            sockets: SourceState::new("sockets", true),
            cpu: SourceState::new("cpu", config.inventory.cpu_count.is_none()),
            nft: SourceState::new("nft", true),
            iptables: SourceState::new("iptables", config.firewall.read_iptables),
            ip6tables: SourceState::new("ip6tables", config.firewall.read_iptables),
            audit_state: SourceState::new("auditd", config.audit.enabled),
            reduced: None,
            power: PowerHistory::new(&config),
            inherited: findings.active().map(|f| f.key.clone()).collect(),
            findings,
            findings_problem,
            alerts,
            audit,
            port_sets: None,
            gpu_ids: BTreeSet::new(),
            events: VecDeque::new(),
            started_at: unix(now),
            cycles: 0,
            last_cycle_at: None,
            last_cpu_ms: 0.0,
            last_phases: BTreeMap::new(),
            last_unreadable: BTreeMap::new(),
            obligation_failures: 0,
            dry_run_actions: BTreeSet::new(),
            event_failures: 0,
            forwarders: None,
            config,
            engine,
            sources,
        })
    }

    /// Starts forwarding `store`'s decision and event logs to the SIEM `[siem]` names
    /// (nothing when it names none), one forwarder per log with its cursor in the state
    /// directory. They run until the agent is dropped; a SIEM that is down makes them
    /// fall behind, never the cycle.
    pub fn forward_to_siem(&mut self, store: &Arc<StateStore>) -> Result<(), AgentError> {
        let (Some(address), Some(dir)) = (&self.config.siem.address, &self.config.state_dir) else {
            return Ok(());
        };
        let forwarders =
            Forwarders::start(&self.config.siem, address, store, dir).map_err(AgentError::Siem)?;
        self.forwarders = Some(forwarders);
        Ok(())
    }

    /// Stops the SIEM forwarders (each confirms what it sent, within its timeout) and
    /// says where each stopped.
    pub fn stop_forwarding(&mut self) -> Vec<(Log, ForwarderStats)> {
        self.forwarders
            .take()
            .map(Forwarders::stop)
            .unwrap_or_default()
    }

    /// The SIEM forwarders' counters, one per log (none without `[siem]`).
    pub fn siem_stats(&self) -> Vec<(Log, ForwarderStats)> {
        self.forwarders
            .as_ref()
            .map(Forwarders::stats)
            .unwrap_or_default()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The active findings.
    pub fn findings(&self) -> impl Iterator<Item = &Finding> {
        self.findings.active()
    }

    /// The last events recorded (at most 256).
    pub fn events(&self) -> impl Iterator<Item = &EventRecord> {
        self.events.iter()
    }

    fn node_uid(&self) -> Option<EntityUid> {
        EntityUid::new("Node", &self.config.node).ok()
    }

    /// Runs one collection cycle (module docs).
    pub fn cycle(&mut self) -> CycleReport {
        let cpu_start = thread_cpu_time();
        let mut phases: BTreeMap<String, f64> = BTreeMap::new();
        let mut mark = {
            let mut last = cpu_start;
            move |name: &str, phases: &mut BTreeMap<String, f64>| {
                let t = thread_cpu_time();
                phases.insert(name.to_owned(), ms(t.saturating_sub(last)));
                last = t;
            }
        };
        let clock = Arc::clone(self.engine.clock());
        let now = clock.now();
        let at = unix(now);
        let stale = self.config.collect.stale_after;
        let mut errors: Vec<String> = self.findings_problem.take().into_iter().collect();

        // 1. Collect.
        self.collect(now);
        mark("collect", &mut phases);

        // 2. Facts.
        let mut readings = self.read_facts(now, stale);
        mark("facts", &mut phases);
        let reach = self.reachability();
        mark("reduce", &mut phases);
        let subjects = self.listen_subjects(reach.as_deref(), &mut readings.unreadable);
        mark("listen", &mut phases);
        let (node_entity, entities) = self.report_facts(&readings, at, stale, &mut errors);
        mark("upsert", &mut phases);

        // 3. Decide.
        let (asked, decisions) = self.decide(&node_entity, &readings, &subjects);
        mark("decide", &mut phases);

        // 4. Findings and obligations.
        let outcome = self.reconcile(asked, decisions, at);
        errors.extend(self.save_findings(at));
        mark("findings", &mut phases);

        let cpu_ms = ms(thread_cpu_time().saturating_sub(cpu_start));
        self.cycles += 1;
        self.last_cycle_at = Some(at);
        self.last_cpu_ms = cpu_ms;
        self.last_phases = phases.clone();
        self.last_unreadable = readings.unreadable.clone();
        let Readings {
            unreadable,
            statuses,
            gpus,
            power,
            ..
        } = readings;
        let Reconciled {
            reports,
            change,
            expired,
            obligations,
            events,
        } = outcome;
        CycleReport {
            node: self.config.node.clone(),
            facts: FactsReport {
                collected_at: at,
                entities,
                unreadable,
                gpus,
                power,
                sources: statuses,
                listen: subjects,
            },
            decisions: reports,
            raised: change.raised,
            cleared: change.cleared.into_iter().chain(expired).collect(),
            active: self.findings.active().cloned().collect(),
            obligations,
            events,
            errors,
            cpu_ms,
            phases_ms: phases,
        }
    }
}
