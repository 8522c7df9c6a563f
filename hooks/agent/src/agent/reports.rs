use std::collections::BTreeMap;

use probity::Decision;
use serde::Serialize;
use serde_json::Value;

use crate::facts::{GpuFact, PowerFact};
use crate::findings::Finding;
use crate::listen::ListenSubject;
use crate::sources::SourceStatus;

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
    /// What the agent did: `alerted`, `alert refreshed`, `resolved`, `blocked`, or why it
    /// did not.
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
