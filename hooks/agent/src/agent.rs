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
//!    default, through [`Engine::block_node`]); an updated one updates its alert; a
//!    cleared one is recorded and its alert resolved.
//!
//! Between cycles the audit log is read; each successful elevation is decided (`elevate`,
//! as a reporter of its own time and login time) and a deny is a finding like any other,
//! whose alert is resolved after `alerts.elevation_hold_seconds`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime};

use probity::state::{NodeFacts, StateStore};
use probity::{DecideOptions, Decision, Engine, EntityUid, Request};
use probity_collect::dcgm::DcgmReport;
use probity_collect::ipmi::DcmiPower;
use probity_collect::nvidia_smi::GpuQuery;
use probity_collect::rapl::RaplPower;
use probity_collect::sockets::ListeningSocket;
use probity_firewall::source::Reading as FwReading;
use probity_firewall::{Inputs, Reachability, iptables, nft};
use probity_siem::ForwarderStats;
use probity_siem::engine::{Forwarders, Log};
use serde::Serialize;
use serde_json::{Map, Value, json};
use thiserror::Error;

use crate::alerts::{AlertSetupError, AlertSinks, alert_spec};
use crate::config::Config;
use crate::elevation::{AuditReader, AuditSetupError, elevation_facts};
use crate::facts::{self, GpuFact, NodeNumbers, PowerFact};
use crate::findings::{Finding, Findings, Scope, findings_of};
use crate::listen::{self, ListenSubject, PortSets};
use crate::sources::{HostSources, Outcome, SourceState, SourceStatus, Sources, unix};
use crate::status::{FindingLine, SiemLine, SourceLine, Status};

/// Largest entities file loaded at start.
pub const MAX_ENTITIES_BYTES: u64 = 64 * 1024 * 1024;
/// Events kept in memory (the last ones), for `--once` and when no state store is
/// attached.
const EVENTS_KEPT: usize = 256;

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

/// Builds the engine `config` names: its policies (or the embedded ones), the state
/// store of its state directory when `attach_state`, and its entities and users files.
pub fn build_engine(
    config: &Config,
    clock: Option<Arc<dyn probity::Clock>>,
    attach_state: bool,
) -> Result<Engine, AgentError> {
    build_engine_with_state(config, clock, attach_state).map(|(engine, _)| engine)
}

/// [`build_engine`], and the state store it attached (which the SIEM forwarders read:
/// [`Agent::forward_to_siem`]).
pub fn build_engine_with_state(
    config: &Config,
    clock: Option<Arc<dyn probity::Clock>>,
    attach_state: bool,
) -> Result<(Engine, Option<Arc<StateStore>>), AgentError> {
    let mut builder = match &config.engine.policies {
        Some(dir) => Engine::builder(dir),
        None => Engine::defaults(),
    };
    if let Some(c) = clock {
        builder = builder.clock(c);
    }
    let engine = builder
        .build()
        .map_err(|e| AgentError::Policies(Box::new(e)))?;
    let mut attached = None;
    if attach_state && let Some(dir) = &config.state_dir {
        let store = Arc::new(
            StateStore::open_with_clock(dir, engine.clock().clone()).map_err(|source| {
                AgentError::State {
                    path: dir.clone(),
                    source,
                }
            })?,
        );
        attached = Some(Arc::clone(&store));
        engine
            .attach_state(store)
            .map_err(|source| AgentError::Entities {
                what: format!("attaching the state store in {}", dir.display()),
                source,
            })?;
    }
    for path in [&config.engine.entities, &config.engine.users]
        .into_iter()
        .flatten()
    {
        load_entities(&engine, path)?;
    }
    Ok((engine, attached))
}

/// Upserts a Cedar entity JSON file.
pub fn load_entities(engine: &Engine, path: &Path) -> Result<usize, AgentError> {
    let read = |source| AgentError::Read {
        path: path.to_owned(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read)?.len();
    if len > MAX_ENTITIES_BYTES {
        return Err(read(std::io::Error::other(format!(
            "{len} bytes, over the limit of {MAX_ENTITIES_BYTES}"
        ))));
    }
    let bytes = std::fs::read(path).map_err(read)?;
    let json: Value = serde_json::from_slice(&bytes).map_err(|source| AgentError::Json {
        path: path.to_owned(),
        line: source.line(),
        column: source.column(),
        source,
    })?;
    engine
        .upsert_entities(&json)
        .map_err(|source| AgentError::Entities {
            what: format!("loading {}", path.display()),
            source,
        })
}

/// The power readings of the window, oldest first, with their times (probity-collect's
/// `PowerWindow` computes the mean; this keeps the readings the plugins are given).
#[derive(Debug)]
struct PowerHistory {
    window: probity_collect::source::PowerWindow,
    readings: VecDeque<(SystemTime, f64)>,
    capacity: usize,
    max_age: Duration,
}

impl PowerHistory {
    fn new(config: &Config) -> Self {
        let interval = config.collect.interval.as_secs().max(1);
        let n = config.collect.power_window.as_secs() / interval + 2;
        let capacity = usize::try_from(n).unwrap_or(4096).clamp(2, 4096);
        Self {
            window: probity_collect::source::PowerWindow::new(
                capacity,
                config.collect.power_window,
            ),
            readings: VecDeque::with_capacity(capacity),
            capacity,
            max_age: config.collect.power_window,
        }
    }

    fn push(&mut self, at: SystemTime, watts: f64) -> Result<(), String> {
        self.window.push(at, watts).map_err(|e| e.to_string())?;
        if self.readings.len() == self.capacity {
            self.readings.pop_front();
        }
        self.readings.push_back((at, watts));
        Ok(())
    }

    fn mean(&self, now: SystemTime) -> Option<f64> {
        self.window.baseline(now).watts()
    }

    fn readings(&self, now: SystemTime) -> Vec<i64> {
        self.readings
            .iter()
            .filter(|(at, _)| now.duration_since(*at).is_ok_and(|age| age <= self.max_age))
            .map(|(_, w)| facts::long(*w))
            .collect()
    }
}

/// A decision of a cycle, with what it was about.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionReport {
    /// `comply`, `listen` or `elevate`.
    pub action: String,
    /// The node, a port range, or a user's elevation.
    pub subject: String,
    /// The engine's answer.
    pub decision: Decision,
}

/// What became of one obligation.
#[derive(Debug, Clone, Serialize)]
pub struct ObligationReport {
    /// The finding's key.
    pub finding: String,
    /// The obligation's kind.
    pub kind: String,
    /// Its target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// What the agent did: `alerted`, `resolved`, `blocked`, or why it did not.
    pub outcome: String,
}

/// An event as recorded.
#[derive(Debug, Clone, Serialize)]
pub struct EventRecord {
    /// Its sequence number in the state store's event log, when one is attached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// `finding` or `finding-cleared`.
    pub kind: String,
    /// The finding's key.
    pub key: String,
    /// When, in Unix seconds.
    pub at: u64,
    /// The finding, with its facts and what was done.
    pub detail: Value,
}

/// The facts of a cycle.
#[derive(Debug, Clone, Serialize)]
pub struct FactsReport {
    /// When they were collected, in Unix seconds.
    pub collected_at: u64,
    /// The entities upserted: the node, then each complete GPU.
    pub entities: Vec<Value>,
    /// The `unreadable` set with why.
    pub unreadable: BTreeMap<String, String>,
    /// Every GPU as understood, complete or not.
    pub gpus: Vec<GpuFact>,
    /// The node's power.
    pub power: PowerFact,
    /// Each source's state.
    pub sources: BTreeMap<String, SourceStatus>,
    /// The `listen` questions.
    pub listen: Vec<ListenSubject>,
}

/// What a cycle did: what `probity agent --once` prints.
#[derive(Debug, Clone, Serialize)]
pub struct CycleReport {
    /// The node.
    pub node: String,
    /// The facts.
    pub facts: FactsReport,
    /// Every decision.
    pub decisions: Vec<DecisionReport>,
    /// Findings raised by this cycle.
    pub raised: Vec<Finding>,
    /// Findings cleared by this cycle.
    pub cleared: Vec<Finding>,
    /// Findings active after it.
    pub active: Vec<Finding>,
    /// What became of the obligations.
    pub obligations: Vec<ObligationReport>,
    /// The events recorded.
    pub events: Vec<EventRecord>,
    /// Problems that are not findings (a rejected upsert, a failed record).
    pub errors: Vec<String>,
    /// CPU time of the cycle on the agent's thread, in milliseconds.
    pub cpu_ms: f64,
    /// CPU time per phase, in milliseconds.
    pub phases_ms: BTreeMap<String, f64>,
}

/// What a read of the audit log did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AuditReport {
    /// The `elevate` decisions.
    pub decisions: Vec<DecisionReport>,
    /// Findings raised.
    pub raised: Vec<Finding>,
    /// What became of their obligations.
    pub obligations: Vec<ObligationReport>,
    /// Events recorded.
    pub events: Vec<EventRecord>,
    /// Failed elevations seen (nothing was elevated, so nothing is decided).
    pub failed_elevations: usize,
    /// Lines that were not audit records.
    pub line_errors: Vec<String>,
    /// Problems that are not findings.
    pub errors: Vec<String>,
}

/// What the facts step of a cycle read: the node's facts before they become entities.
struct Readings {
    unreadable: BTreeMap<String, String>,
    statuses: BTreeMap<String, SourceStatus>,
    gpus: Vec<GpuFact>,
    power: PowerFact,
    driver_version: String,
    gpu_model: Option<String>,
    gpu_count: i64,
    gpu_memory_mib: i64,
    hottest: i64,
    cpu_count: i64,
}

/// What the findings step of a cycle did.
struct Reconciled {
    reports: Vec<DecisionReport>,
    change: crate::findings::Change,
    expired: Vec<Finding>,
    obligations: Vec<ObligationReport>,
    events: Vec<EventRecord>,
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
            findings: Findings::new(),
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

    fn firewall_state<T>(state: &mut SourceState<Option<T>>, r: FwReading<T>, now: SystemTime) {
        use probity_collect::{Collected, Reading};
        let collected = match r {
            FwReading::Read(v) => Collected::Ok(Reading::new(Some(v), now)),
            // Not installed: no rules of this kind, which is a reading.
            FwReading::Unavailable { .. } => Collected::Ok(Reading::new(None, now)),
            FwReading::Failed(e) => {
                state.record_failure(crate::sources::error_chain(&e), now);
                return;
            }
        };
        if state.enabled() {
            state.record(Some(collected), now);
        }
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
        let mut errors = Vec::new();

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

    /// Step 1 of a cycle: reads every source into its state.
    fn collect(&mut self, now: SystemTime) {
        self.smi.record(self.sources.gpus(), now);
        self.dcgm.record(self.sources.dcgm(), now);
        let rapl = self.sources.rapl();
        self.rapl.record(rapl, now);
        self.bmc.record(self.sources.bmc_power(), now);
        self.sockets.record(Some(self.sources.sockets()), now);
        self.cpu.record_result(self.sources.cpu_count(), now);
        let snapshot = self.sources.firewall();
        Self::firewall_state(&mut self.nft, snapshot.nft, now);
        Self::firewall_state(&mut self.iptables, snapshot.iptables, now);
        Self::firewall_state(&mut self.ip6tables, snapshot.ip6tables, now);
    }

    /// Step 2 of a cycle: the sources' states and readings as the node's facts, with
    /// what could not be read.
    fn read_facts(&mut self, now: SystemTime, stale: Duration) -> Readings {
        let mut unreadable: BTreeMap<String, String> = BTreeMap::new();
        let mut statuses: BTreeMap<String, SourceStatus> = BTreeMap::new();
        {
            let mut note = |name: &'static str, status: SourceStatus| {
                if let Some(why) = &status.why_unreadable {
                    unreadable.insert(name.to_owned(), why.clone());
                }
                statuses.insert(name.to_owned(), status);
            };
            note(self.smi.name(), self.smi.status(now, stale));
            note(self.dcgm.name(), self.dcgm.status(now, stale));
            note(self.rapl.name(), self.rapl.status(now, stale));
            note(self.bmc.name(), self.bmc.status(now, stale));
            note(self.sockets.name(), self.sockets.status(now, stale));
            note(self.cpu.name(), self.cpu.status(now, stale));
            note(self.nft.name(), self.nft.status(now, stale));
            note(self.iptables.name(), self.iptables.status(now, stale));
            note(self.ip6tables.name(), self.ip6tables.status(now, stale));
            note(self.audit_state.name(), self.audit_state.status(now, stale));
        }
        let smi_gpus = self
            .smi
            .value()
            .map(|rows| facts::gpus_from_smi(&self.config, rows));
        let dcgm_gpus = self
            .dcgm
            .value()
            .map(|r| facts::gpus_from_dcgm(&self.config, r));
        let temperatures: Vec<f64> = smi_gpus
            .iter()
            .chain(dcgm_gpus.iter())
            .flatten()
            .filter_map(|g| g.temperature_c)
            .collect();
        let gpus: Vec<GpuFact> = smi_gpus.clone().or(dcgm_gpus.clone()).unwrap_or_default();
        for (source, why) in facts::gaps(&gpus) {
            unreadable.entry(source.to_owned()).or_insert(why);
        }
        if self.config.inventory.gpu_node && !self.smi.enabled() && !self.dcgm.enabled() {
            unreadable.insert(
                "gpu".into(),
                "inventory.gpu_node is set, but nvidia-smi and dcgm are both off".into(),
            );
        }
        let (driver_version, gpu_model, gpu_count, gpu_memory_mib, hottest) =
            facts::gpu_numbers(&gpus, &temperatures);

        // The GPUs stand for the node from nvidia-smi when it has a reading, else DCGM.
        let gpus_fresh = if smi_gpus.is_some() {
            self.smi.is_fresh()
        } else {
            self.dcgm.is_fresh()
        };
        let power = self.node_power(&gpus, gpus_fresh, now);
        if power.draw_w.is_none() {
            unreadable.insert(
                "power".into(),
                "no BMC reading and no RAPL reading: the node's draw is unknown".into(),
            );
        }
        let cpu_count = self
            .config
            .inventory
            .cpu_count
            .or_else(|| self.cpu.value().copied())
            .map_or(0, i64::from);
        Readings {
            unreadable,
            statuses,
            gpus,
            power,
            driver_version,
            gpu_model,
            gpu_count,
            gpu_memory_mib,
            hottest,
            cpu_count,
        }
    }

    /// Step 2 of a cycle, continued: the `listen` questions, with a note in
    /// `unreadable` when some were left out.
    fn listen_subjects(
        &mut self,
        reach: Option<&Reachability>,
        unreadable: &mut BTreeMap<String, String>,
    ) -> Vec<ListenSubject> {
        let sets = self.port_sets();
        let sockets: &[ListeningSocket] = self.sockets.value().map_or(&[], Vec::as_slice);
        let (subjects, truncated) = listen::subjects(
            sockets,
            reach,
            &sets,
            self.config.collect.max_listen_decisions,
        );
        if truncated {
            unreadable.insert(
                "listen".into(),
                format!(
                    "more than {} ports to decide: the rest were not",
                    self.config.collect.max_listen_decisions
                ),
            );
        }
        subjects
    }

    /// Step 2 of a cycle, ended: the node's and its GPUs' entities upserted into the
    /// engine (and published to the state store), GPUs no longer reported removed. The
    /// node's entity and every entity upserted.
    fn report_facts(
        &mut self,
        readings: &Readings,
        at: u64,
        stale: Duration,
        errors: &mut Vec<String>,
    ) -> (Value, Vec<Value>) {
        let Readings {
            unreadable,
            gpus,
            power,
            ..
        } = readings;
        let numbers = NodeNumbers {
            driver_version: readings.driver_version.clone(),
            gpu_model: readings.gpu_model.clone(),
            gpu_count: readings.gpu_count,
            cpu_count: readings.cpu_count,
            gpu_memory_mib: readings.gpu_memory_mib,
            hottest_gpu_temp_c: readings.hottest,
            power_draw_w: power.draw_w.map_or(0, facts::long),
            power_window_mean_w: power.window_mean_w.map_or(0, facts::long),
            unreadable: unreadable.keys().cloned().collect(),
        };
        let node_entity = facts::node_entity(&self.config, &numbers);
        let mut entities = vec![node_entity.clone()];
        let mut ids = BTreeSet::new();
        for g in gpus {
            if let Some(e) = facts::gpu_entity(&self.config.node, g) {
                ids.insert(g.id.clone());
                entities.push(e);
            }
        }
        let facts_json = Value::Array(entities.clone());
        match self.engine.upsert_entities(&facts_json) {
            Ok(_) => {
                if let Some(state) = self.engine.state() {
                    let published = state.publish_facts(&NodeFacts {
                        node: self.config.node.clone(),
                        entities: facts_json.clone(),
                        collected_at: at,
                        ttl_seconds: stale.as_secs(),
                    });
                    if let Err(e) = published {
                        errors.push(format!("publishing the facts: {e}"));
                    }
                }
            }
            Err(e) => {
                errors.push(format!(
                    "the engine rejected the node's facts (its entity is removed, so decisions about it fail closed): {e}"
                ));
                ids.clear();
                if let Some(uid) = self.node_uid()
                    && let Err(e) = self.engine.remove_entities(&[uid])
                {
                    errors.push(format!("removing the node's entity: {e}"));
                }
            }
        }
        let gone: Vec<EntityUid> = self
            .gpu_ids
            .difference(&ids)
            .filter_map(|id| EntityUid::new("Gpu", id).ok())
            .collect();
        if !gone.is_empty()
            && let Err(e) = self.engine.remove_entities(&gone)
        {
            errors.push(format!("removing GPUs no longer reported: {e}"));
        }
        self.gpu_ids = ids;
        (node_entity, entities)
    }

    /// Step 3 of a cycle: `comply` for the node and `listen` for each subject, in one
    /// batch; what each question was about, and its decision.
    fn decide(
        &self,
        node_entity: &Value,
        readings: &Readings,
        subjects: &[ListenSubject],
    ) -> (Vec<(String, String, Value)>, Vec<Decision>) {
        let Readings {
            unreadable,
            gpus,
            power,
            ..
        } = readings;
        let mut asked: Vec<(String, String, Value)> = Vec::new();
        let mut requests = Vec::new();
        if let (Some(node), Ok(comply), Ok(listen_action)) = (
            self.node_uid(),
            EntityUid::action("comply"),
            EntityUid::action("listen"),
        ) {
            let mut ctx = Map::new();
            if !power.readings_w.is_empty() {
                ctx.insert("powerReadingsW".into(), json!(power.readings_w));
            }
            requests.push(
                Request::new(node.clone(), comply, node.clone())
                    .with_context(ctx)
                    .as_fact_reporter(),
            );
            asked.push((
                "comply".into(),
                node.to_string(),
                json!({
                    "node": node_entity,
                    "unreadable": unreadable,
                    "power": power,
                    "gpus": gpus,
                }),
            ));
            for s in subjects {
                let mut ctx = Map::new();
                ctx.insert("port".into(), json!(s.port));
                ctx.insert("protocol".into(), json!(s.protocol));
                requests.push(
                    Request::new(node.clone(), listen_action.clone(), node.clone())
                        .with_context(ctx),
                );
                asked.push((
                    "listen".into(),
                    s.key(),
                    serde_json::to_value(s).unwrap_or_default(),
                ));
            }
        }
        let decisions = self
            .engine
            .decide_with(&requests, DecideOptions::new())
            .settle();
        (asked, decisions)
    }

    /// Step 4 of a cycle: the decisions' findings reconciled with the active ones; a
    /// raised finding's obligations carried out and recorded, an updated one's alerts
    /// updated, a cleared or expired one's resolved and recorded.
    fn reconcile(
        &mut self,
        asked: Vec<(String, String, Value)>,
        decisions: Vec<Decision>,
        at: u64,
    ) -> Reconciled {
        let mut current = Vec::new();
        let mut reports = Vec::new();
        for ((action, subject, facts), decision) in asked.into_iter().zip(decisions) {
            current.extend(findings_of(
                Scope::Telemetry,
                &action,
                &subject,
                &decision,
                &facts,
                at,
            ));
            reports.push(DecisionReport {
                action,
                subject,
                decision,
            });
        }
        let change = self.findings.reconcile(Scope::Telemetry, current);
        let mut obligations = Vec::new();
        let mut events = Vec::new();
        for f in &change.raised {
            let done = self.carry_out(f, &mut obligations);
            events.extend(self.record("finding", f, at, done));
        }
        for (before, after) in &change.updated {
            self.update_alerts(before, after, &mut obligations);
        }
        for f in &change.cleared {
            let done = self.resolve(f, &mut obligations);
            events.extend(self.record("finding-cleared", f, at, done));
        }
        let hold = self.config.alerts.elevation_hold.as_secs();
        let expired = self
            .findings
            .expire(Scope::Elevation, at.saturating_sub(hold));
        for f in &expired {
            let done = self.resolve(f, &mut obligations);
            events.extend(self.record("finding-cleared", f, at, done));
        }
        Reconciled {
            reports,
            change,
            expired,
            obligations,
            events,
        }
    }

    /// The node's power this cycle (see [`crate::facts`]), pushed into the window when
    /// it was read now (`gpus_fresh`: the GPUs' source answered this cycle).
    fn node_power(&mut self, gpus: &[GpuFact], gpus_fresh: bool, now: SystemTime) -> PowerFact {
        let dcmi = self.bmc.value().and_then(|p| p.instantaneous_w.value());
        let (draw, from, fresh) = if let Some(w) = dcmi {
            (Some(w), "bmc-dcmi", self.bmc.is_fresh())
        } else if let Some(cpu) = self.rapl.value().and_then(|r| r.total_watts.value()) {
            let gpu: f64 = gpus.iter().filter_map(|g| g.power_w).sum();
            let gpus_ok = gpus.is_empty() || gpus_fresh;
            (
                Some(cpu + gpu),
                "rapl+gpus",
                self.rapl.is_fresh() && gpus_ok,
            )
        } else {
            (None, "none", false)
        };
        if fresh && let Some(w) = draw {
            // A refused reading (out of order after a clock step) leaves the window as is.
            let _ = self.power.push(now, w);
        }
        PowerFact {
            draw_w: draw,
            from,
            fresh,
            window_mean_w: self.power.mean(now),
            readings_w: self.power.readings(now),
        }
    }

    /// The reduction of the last good rulesets, computed again only when they changed.
    fn reachability(&mut self) -> Option<Arc<Reachability>> {
        if self.nft.value().is_none()
            && self.iptables.value().is_none()
            && self.ip6tables.value().is_none()
        {
            // Nothing was ever read: the firewall is unknown ("nft" is unreadable); the
            // listening sockets are still decided.
            return None;
        }
        let nft = self.nft.value().cloned().flatten();
        let v4 = self.iptables.value().cloned().flatten();
        let v6 = self.ip6tables.value().cloned().flatten();
        if let Some((a, b, c, r)) = &self.reduced
            && *a == nft
            && *b == v4
            && *c == v6
        {
            return Some(Arc::clone(r));
        }
        let reach = Arc::new(probity_firewall::reduce(&Inputs {
            nft: nft.as_ref(),
            iptables: [v4.as_ref(), v6.as_ref()].into_iter().flatten().collect(),
        }));
        self.reduced = Some((nft, v4, v6, Arc::clone(&reach)));
        Some(reach)
    }

    fn port_sets(&mut self) -> PortSets {
        let digest = self.engine.status().digest;
        match &self.port_sets {
            Some((d, s)) if *d == digest => s.clone(),
            _ => {
                let s = PortSets::from_engine(&self.engine);
                self.port_sets = Some((digest, s.clone()));
                s
            }
        }
    }

    /// Carries out a raised finding's obligations; what was done, per obligation.
    fn carry_out(&mut self, f: &Finding, out: &mut Vec<ObligationReport>) -> Vec<Value> {
        let mut done = Vec::new();
        // The kinds that alert and block are the schema's to name, not the agent's.
        let conventions = self.engine.conventions();
        for o in &f.obligations {
            let outcome = match o.kind.as_str() {
                kind if conventions.is_alert(kind) => {
                    if self.alerts.is_empty() {
                        "no alert sink configured: recorded only".to_owned()
                    } else {
                        let failed = self.alerts.fire(&alert_spec(&self.config.node, f, o));
                        if failed.is_empty() {
                            "alerted".to_owned()
                        } else {
                            self.obligation_failures += 1;
                            format!("alert not taken: {}", failed.join("; "))
                        }
                    }
                }
                kind if kind == conventions.block_obligation() => {
                    match o.target.as_deref().and_then(node_of_target) {
                        Some(node) => match self.engine.block_node(&node, &f.policy) {
                            Ok(()) => format!("blocked node {node}"),
                            Err(e) => {
                                self.obligation_failures += 1;
                                format!("block of {node} failed: {e}")
                            }
                        },
                        None => {
                            self.obligation_failures += 1;
                            format!("{kind} target {:?} is not a node", o.target)
                        }
                    }
                }
                other => format!("{other}: not carried out by the node agent"),
            };
            done.push(json!({"kind": o.kind, "target": o.target, "outcome": outcome}));
            out.push(ObligationReport {
                finding: f.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
        done
    }

    /// Resolves a cleared finding's alerts.
    fn resolve(&mut self, f: &Finding, out: &mut Vec<ObligationReport>) -> Vec<Value> {
        let mut done = Vec::new();
        let conventions = self.engine.conventions();
        for o in f
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            if self.alerts.is_empty() {
                continue;
            }
            let failed = self.alerts.resolve(&alert_spec(&self.config.node, f, o));
            let outcome = if failed.is_empty() {
                "resolved".to_owned()
            } else {
                self.obligation_failures += 1;
                format!("resolve not taken: {}", failed.join("; "))
            };
            done.push(json!({"kind": o.kind, "target": o.target, "outcome": outcome}));
            out.push(ObligationReport {
                finding: f.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
        done
    }

    /// Updates the alerts of a finding whose message or severity changed: an alert whose
    /// labels changed (a new severity) is resolved and raised under its new labels.
    fn update_alerts(
        &mut self,
        before: &Finding,
        after: &Finding,
        out: &mut Vec<ObligationReport>,
    ) {
        if self.alerts.is_empty() {
            return;
        }
        let conventions = self.engine.conventions();
        for o in before
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            let old = alert_spec(&self.config.node, before, o);
            let still = after.obligations.iter().any(|n| {
                conventions.is_alert(&n.kind)
                    && alert_spec(&self.config.node, after, n).label_set() == old.label_set()
            });
            if !still {
                let _ = self.alerts.resolve(&old);
            }
        }
        for o in after
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            let failed = self.alerts.fire(&alert_spec(&self.config.node, after, o));
            let outcome = if failed.is_empty() {
                "alert updated".to_owned()
            } else {
                self.obligation_failures += 1;
                format!("alert update not taken: {}", failed.join("; "))
            };
            out.push(ObligationReport {
                finding: after.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
    }

    /// Records a finding or its clearing with its facts and what was done.
    fn record(
        &mut self,
        kind: &str,
        f: &Finding,
        at: u64,
        done: Vec<Value>,
    ) -> Option<EventRecord> {
        let mut detail = serde_json::to_value(f).unwrap_or_default();
        if let Some(o) = detail.as_object_mut() {
            o.insert("carried_out".into(), Value::Array(done));
            o.insert("node".into(), json!(self.config.node));
            if kind == "finding-cleared" {
                o.insert("cleared_at".into(), json!(at));
            }
        }
        let mut seq = None;
        if let Some(log) = self.engine.log() {
            match log.record_event(&f.key, Some(&self.config.node), kind, &detail.to_string()) {
                Ok(s) => seq = Some(s),
                Err(e) => {
                    self.event_failures += 1;
                    if let Some(o) = detail.as_object_mut() {
                        o.insert("record_error".into(), json!(e.to_string()));
                    }
                }
            }
        }
        let event = EventRecord {
            seq,
            kind: kind.to_owned(),
            key: f.key.clone(),
            at,
            detail,
        };
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(event.clone());
        Some(event)
    }

    /// Reads what is new in the audit log and decides each successful elevation.
    pub fn poll_audit(&mut self) -> AuditReport {
        let mut report = AuditReport::default();
        let clock = Arc::clone(self.engine.clock());
        let now = clock.now();
        let at = unix(now);
        let Some(reader) = self.audit.as_mut() else {
            return report;
        };
        let poll = reader.poll(&*clock);
        match &reader.status().last {
            Outcome::Ok { .. } => self.audit_state.record_ok((), now),
            Outcome::Unavailable { reason, .. } => {
                self.audit_state.record_unavailable(reason.clone(), now);
            }
            Outcome::Error { error, .. } => self.audit_state.record_failure(error.clone(), now),
            Outcome::Never | Outcome::Disabled => {}
        }
        report.failed_elevations = poll.failed;
        report.line_errors = poll.line_errors;
        let (Some(node), Ok(elevate)) = (self.node_uid(), EntityUid::action("elevate")) else {
            return report;
        };
        let mut requests = Vec::new();
        let mut asked = Vec::new();
        for e in &poll.elevations {
            let user = match EntityUid::new("User", &e.user) {
                Ok(u) => u,
                Err(err) => {
                    report
                        .errors
                        .push(format!("elevation {} by {:?}: {err}", e.event, e.user));
                    continue;
                }
            };
            let ctx = e.context();
            let mut c = Map::new();
            c.insert("now".into(), json!(ctx.now));
            if let Some(login) = ctx.last_remote_login_at {
                c.insert("lastRemoteLoginAt".into(), json!(login));
            }
            asked.push((format!("{user} at {}", e.event), elevation_facts(e)));
            requests.push(
                Request::new(user, elevate.clone(), node.clone())
                    .with_context(c)
                    .as_fact_reporter(),
            );
        }
        let decisions = self
            .engine
            .decide_with(&requests, DecideOptions::new())
            .settle();
        for ((subject, facts), decision) in asked.into_iter().zip(decisions) {
            for f in findings_of(Scope::Elevation, "elevate", &subject, &decision, &facts, at) {
                if let Some(f) = self.findings.raise(f) {
                    let done = self.carry_out(&f, &mut report.obligations);
                    report.events.extend(self.record("finding", &f, at, done));
                    report.raised.push(f);
                }
            }
            report.decisions.push(DecisionReport {
                action: "elevate".into(),
                subject,
                decision,
            });
        }
        report
    }

    /// The status as of now.
    pub fn status(&self) -> Status {
        let now = self.engine.clock().now();
        let stale = self.config.collect.stale_after;
        let mut sources = BTreeMap::new();
        let mut line = |name: &str, s: SourceStatus| {
            let (state, reason, checked_at) = match &s.last {
                Outcome::Disabled => ("disabled", None, None),
                Outcome::Never => ("never", None, None),
                Outcome::Ok { at } => ("ok", None, Some(*at)),
                Outcome::Unavailable { reason, at } => {
                    ("unavailable", Some(reason.clone()), Some(*at))
                }
                Outcome::Error { error, at } => ("error", Some(error.clone()), Some(*at)),
            };
            sources.insert(
                name.to_owned(),
                SourceLine {
                    state: state.to_owned(),
                    reason,
                    checked_at,
                    last_ok_at: s.last_ok_at,
                    unreadable: s.unreadable,
                    stale: s.unreadable && s.last_ok_at.is_some(),
                    why_unreadable: s.why_unreadable,
                },
            );
        };
        line(self.smi.name(), self.smi.status(now, stale));
        line(self.dcgm.name(), self.dcgm.status(now, stale));
        line(self.rapl.name(), self.rapl.status(now, stale));
        line(self.bmc.name(), self.bmc.status(now, stale));
        line(self.sockets.name(), self.sockets.status(now, stale));
        line(self.cpu.name(), self.cpu.status(now, stale));
        line(self.nft.name(), self.nft.status(now, stale));
        line(self.iptables.name(), self.iptables.status(now, stale));
        line(self.ip6tables.name(), self.ip6tables.status(now, stale));
        line(self.audit_state.name(), self.audit_state.status(now, stale));
        let mut status = Status {
            node: self.config.node.clone(),
            written_at: unix(now),
            started_at: self.started_at,
            cycles: self.cycles,
            last_cycle_at: self.last_cycle_at,
            last_cycle_cpu_ms: self.last_cpu_ms,
            last_cycle_phases_ms: self.last_phases.clone(),
            sources,
            unreadable: self.last_unreadable.clone(),
            findings: self
                .findings
                .active()
                .map(|f| FindingLine {
                    policy: f.policy.clone(),
                    action: f.action.clone(),
                    subject: f.subject.clone(),
                    severity: serde_json::to_value(f.severity)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    message: f.message.clone(),
                    since: f.since,
                })
                .collect(),
            obligation_failures: self.obligation_failures,
            event_failures: self.event_failures,
            alerts: self.alerts.status(),
            audit: self
                .audit
                .as_ref()
                .and_then(|a| serde_json::to_value(a.status()).ok()),
            siem: self
                .siem_stats()
                .into_iter()
                .map(|(log, s)| SiemLine {
                    log: log.as_str().to_owned(),
                    forwarded: s.forwarded,
                    backlog: s.backlog,
                    behind: s.behind,
                    failures: s.failed_sends.saturating_add(s.failed_connects),
                    last_error: s.last_error,
                })
                .collect(),
            policy_digest: self.engine.status().digest,
            metrics: String::new(),
        };
        status.metrics = status.render_metrics();
        status
    }

    /// Writes the status into the state directory, if there is one.
    pub fn write_status(&self) -> std::io::Result<()> {
        match &self.config.state_dir {
            Some(dir) => self.status().write(dir),
            None => Ok(()),
        }
    }

    /// Runs cycles every `collect.interval` (and reads the audit log every
    /// `audit.poll_interval`) until `stop` receives or its sender is gone. One cycle at a
    /// time; a cycle that overruns delays the next rather than overlapping it. After each
    /// cycle the status is written; `progress` sees every cycle and every audit read that
    /// decided something.
    pub fn run(&mut self, stop: &Receiver<()>, progress: &mut dyn FnMut(Progress<'_>)) {
        let interval = self.config.collect.interval;
        let audit_every = self.config.audit.poll_interval;
        let mut next_cycle = Instant::now();
        let mut next_audit = Instant::now();
        loop {
            let now = Instant::now();
            if self.audit.is_some() && now >= next_audit {
                let report = self.poll_audit();
                next_audit = Instant::now() + audit_every;
                if !report.decisions.is_empty() || !report.errors.is_empty() {
                    progress(Progress::Audit(&report));
                }
            }
            if now >= next_cycle {
                let report = self.cycle();
                if let Err(e) = self.write_status() {
                    eprintln!("probity agent: cannot write the status file: {e}");
                }
                progress(Progress::Cycle(&report));
                next_cycle = (next_cycle + interval).max(Instant::now());
            }
            let wake = if self.audit.is_some() {
                next_cycle.min(next_audit)
            } else {
                next_cycle
            };
            match stop.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if let Err(e) = self.write_status() {
            eprintln!("probity agent: cannot write the status file: {e}");
        }
    }
}

/// What [`Agent::run`] reports as it goes.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// A collection cycle ended.
    Cycle(&'a CycleReport),
    /// A read of the audit log decided elevations.
    Audit(&'a AuditReport),
}

/// The node id of an obligation target `Node::"id"`.
pub fn node_of_target(target: &str) -> Option<String> {
    let id = target.strip_prefix("Node::\"")?.strip_suffix('"')?;
    let unescaped = id.replace("\\\"", "\"").replace("\\\\", "\\");
    crate::config::valid_id(&unescaped).then_some(unescaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_target_names_a_node_or_nothing() {
        assert_eq!(node_of_target("Node::\"gpu-1\"").as_deref(), Some("gpu-1"));
        assert_eq!(node_of_target("Zone::\"z\""), None);
        assert_eq!(node_of_target("Node::\"bad id\""), None);
    }
}
