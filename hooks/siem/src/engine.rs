//! The engine's two hash-chained logs as record sources, and a forwarder per log
//! (feature `engine`).
//!
//! Why behind a feature: the rest of this crate knows nothing of the engine, so any
//! program can forward its own records; the server and the node agent forward the
//! engine's, the same way, through this module. The forwarders only read the logs, so
//! a SIEM that is down makes them fall behind, never the decisions.
//!
//! Numbering: the engine numbers each log from 0, this crate from 1, so a record's
//! syslog `seq` is the engine's plus one; its `hash` and `prev_hash` are the chain's, so
//! a SIEM can drop the duplicates that at-least-once delivery resends and check the
//! chain's links.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, UNIX_EPOCH};

use crate::{
    FileCursor, Forwarder, ForwarderStats, Record, RecordKind, RecordSource, Severity,
    SiemSettings, SourceError,
};
use probity::audit::ChainLink;
use probity::state::{DecisionRecord, Event, StateStore};

/// How often `wait_for` looks at the store again: the engine's logs have no
/// notification, and a few milliseconds of delay costs a SIEM nothing.
const POLL: Duration = Duration::from_millis(20);

/// The cursor file of the decision log's forwarder, in the state directory.
pub const DECISIONS_CURSOR: &str = "siem-decisions.cursor";
/// The cursor file of the event log's forwarder, in the state directory.
pub const EVENTS_CURSOR: &str = "siem-events.cursor";

/// Which of the engine's two logs a source reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Log {
    /// Decisions that denied or carried obligations.
    Decisions,
    /// Blocks, verifications, key events, findings.
    Events,
}

impl Log {
    /// The log's name, as the metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Log::Decisions => "decisions",
            Log::Events => "events",
        }
    }
}

/// One of the engine's logs as a [`RecordSource`].
pub struct ChainSource {
    store: Arc<StateStore>,
    log: Log,
    /// The event log has no usage figure: the highest engine seq seen, found by
    /// reading forward from here.
    newest_event: Mutex<Option<u64>>,
}

impl ChainSource {
    /// The decision log of `store`.
    pub fn decisions(store: Arc<StateStore>) -> Self {
        Self {
            store,
            log: Log::Decisions,
            newest_event: Mutex::new(None),
        }
    }

    /// The event log of `store`.
    pub fn events(store: Arc<StateStore>) -> Self {
        Self {
            store,
            log: Log::Events,
            newest_event: Mutex::new(None),
        }
    }

    fn fail(e: impl std::fmt::Display) -> SourceError {
        SourceError::Other(e.to_string())
    }

    /// The highest engine sequence number in the event log, if any.
    fn newest_event(&self) -> Result<Option<u64>, SourceError> {
        let mut known = self
            .newest_event
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            let from = known.map_or(0, |n| n.saturating_add(1));
            let batch = self.store.chained_events(from, 1024).map_err(Self::fail)?;
            match batch.last() {
                Some((e, _)) => *known = Some(e.seq),
                None => return Ok(*known),
            }
        }
    }
}

impl RecordSource for ChainSource {
    fn read(&self, from_seq: u64, limit: usize) -> Result<Vec<Record>, SourceError> {
        let from = from_seq.saturating_sub(1);
        match self.log {
            Log::Decisions => Ok(self
                .store
                .chained_decisions(from, limit)
                .map_err(Self::fail)?
                .iter()
                .map(|(r, link)| decision_record(r, link))
                .collect()),
            Log::Events => Ok(self
                .store
                .chained_events(from, limit)
                .map_err(Self::fail)?
                .iter()
                .map(|(e, link)| event_record(e, link))
                .collect()),
        }
    }

    fn newest_seq(&self) -> Result<u64, SourceError> {
        match self.log {
            // `next` is one past the engine's newest: the siem's newest.
            Log::Decisions => Ok(self.store.decision_log_usage().map_err(Self::fail)?.next),
            Log::Events => Ok(self.newest_event()?.map_or(0, |n| n.saturating_add(1))),
        }
    }

    fn wait_for(&self, seq: u64, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if self.newest_seq().is_ok_and(|n| n >= seq) {
                return true;
            }
            let now = Instant::now();
            let left = deadline.map_or(POLL, |d| d.saturating_duration_since(now));
            if left.is_zero() {
                return false;
            }
            std::thread::sleep(left.min(POLL));
        }
    }
}

fn link_digests(link: &ChainLink) -> ([u8; 32], [u8; 32]) {
    (link.hash.unwrap_or_default(), link.prev.unwrap_or_default())
}

fn severity(s: probity::Severity) -> Severity {
    match s {
        probity::Severity::Info => Severity::Info,
        probity::Severity::Low => Severity::Low,
        probity::Severity::Medium => Severity::Medium,
        probity::Severity::High => Severity::High,
        probity::Severity::Critical => Severity::Critical,
    }
}

/// A decision as a record: its seq and chain link, and what was asked and answered in
/// the structured data.
pub fn decision_record(r: &DecisionRecord, link: &ChainLink) -> Record {
    let (hash, prev_hash) = link_digests(link);
    let d = &r.decision;
    let outcome = d.decision.to_string();
    let first = d.reasons.first();
    let sev = d
        .reasons
        .iter()
        .map(|x| severity(x.severity))
        .max()
        .unwrap_or(match d.decision {
            probity::Effect::Deny => Severity::Medium,
            probity::Effect::Allow => Severity::Info,
        });
    let mut fields = BTreeMap::new();
    fields.insert("decision".into(), outcome.clone());
    fields.insert("principal".into(), r.principal.clone());
    fields.insert("action".into(), r.action.clone());
    fields.insert("resource".into(), r.resource.clone());
    fields.insert("policy_digest".into(), r.policy_digest.clone());
    let policies: Vec<&str> = d.reasons.iter().map(|x| x.policy.as_str()).collect();
    fields.insert("policies".into(), policies.join(","));
    if !d.reasons.is_empty() {
        let reasons: Vec<&str> = d.reasons.iter().map(|x| x.message.as_str()).collect();
        fields.insert("reasons".into(), reasons.join("; "));
    }
    if !d.obligations.is_empty() {
        let obligations: Vec<String> = d
            .obligations
            .iter()
            .map(|o| match &o.target {
                Some(t) => format!("{}:{t}", o.kind),
                None => o.kind.clone(),
            })
            .collect();
        fields.insert("obligations".into(), obligations.join(","));
    }
    if !d.errors.is_empty() {
        let errors: Vec<&str> = d.errors.iter().map(|x| x.message.as_str()).collect();
        fields.insert("errors".into(), errors.join("; "));
    }
    let message = match first {
        Some(reason) => format!(
            "{outcome} {} {} {}: {}",
            r.principal, r.action, r.resource, reason.message
        ),
        None => format!("{outcome} {} {} {}", r.principal, r.action, r.resource),
    };
    Record {
        seq: r.seq.saturating_add(1),
        hash,
        prev_hash,
        time: UNIX_EPOCH + Duration::from_millis(r.time_unix_ms),
        kind: RecordKind::Decision,
        severity: sev,
        node: None,
        policy: first.map(|x| x.policy.clone()),
        message,
        fields,
    }
}

/// What an event's kind is, for a SIEM: the engine's kinds are open-ended strings.
pub fn event_kind(kind: &str) -> (RecordKind, Severity) {
    match kind {
        "block" | "blocked" | "node-blocked" => (RecordKind::Block, Severity::High),
        "unblock" | "unblocked" | "node-unblocked" => (RecordKind::Unblock, Severity::Info),
        "checkpoint" => (RecordKind::Checkpoint, Severity::Info),
        "finding-cleared" => (RecordKind::FindingCleared, Severity::Info),
        k if k.starts_with("key-") => (RecordKind::KeyEvent, Severity::Info),
        k if k.starts_with("finding") => (RecordKind::Finding, Severity::Medium),
        "verified" => (RecordKind::Verification, Severity::Info),
        // The integrity errors (chunk-mismatch, rollback, read-denied, …): a failed
        // verification.
        _ => (RecordKind::Verification, Severity::High),
    }
}

/// An event as a record.
pub fn event_record(e: &Event, link: &ChainLink) -> Record {
    let (hash, prev_hash) = link_digests(link);
    let (kind, severity) = event_kind(&e.kind);
    let mut fields = BTreeMap::new();
    fields.insert("event".into(), e.kind.clone());
    fields.insert("object".into(), e.object_id.clone());
    Record {
        seq: e.seq.saturating_add(1),
        hash,
        prev_hash,
        time: UNIX_EPOCH + Duration::from_secs(e.time_unix),
        kind,
        severity,
        node: e.node.clone(),
        policy: None,
        message: format!("{} {}: {}", e.kind, e.object_id, e.detail),
        fields,
    }
}

/// The running forwarders, one per log.
pub struct Forwarders {
    running: Vec<(Log, Forwarder)>,
}

impl Forwarders {
    /// Starts a forwarder per log of `store`, cursors in `state_dir`.
    pub fn start(
        c: &SiemSettings,
        address: &str,
        store: &Arc<StateStore>,
        state_dir: &Path,
    ) -> Result<Self, String> {
        let mut running = Vec::new();
        for (log, cursor) in [
            (Log::Decisions, DECISIONS_CURSOR),
            (Log::Events, EVENTS_CURSOR),
        ] {
            let source: Arc<dyn RecordSource> = Arc::new(match log {
                Log::Decisions => ChainSource::decisions(Arc::clone(store)),
                Log::Events => ChainSource::events(Arc::clone(store)),
            });
            let f = Forwarder::start(
                c.forwarder_config(address),
                source,
                FileCursor::new(&state_dir.join(cursor)),
            )
            .map_err(|e| format!("the {} forwarder: {}", log.as_str(), crate::error_chain(&e)))?;
            running.push((log, f));
        }
        Ok(Self { running })
    }

    /// Each log's counters.
    pub fn stats(&self) -> Vec<(Log, ForwarderStats)> {
        self.running.iter().map(|(l, f)| (*l, f.stats())).collect()
    }

    /// The lowest engine sequence number some forwarder has not delivered yet: the
    /// decision log's retention keeps it (and what follows).
    pub fn decisions_undelivered(&self) -> Option<u64> {
        self.running
            .iter()
            .find(|(l, _)| *l == Log::Decisions)
            .map(|(_, f)| f.stats().cursor)
    }

    /// Stops every forwarder (each confirms what it sent, within its timeout), and
    /// says where each stopped.
    pub fn stop(self) -> Vec<(Log, ForwarderStats)> {
        self.running
            .into_iter()
            .map(|(log, f)| (log, f.stop()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siem_seq_is_engine_seq_plus_one_with_the_chain_link() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(StateStore::open(dir.path()).unwrap());
        store
            .record_event("obj-1", Some("gpu-001"), "chunk-mismatch", "chunk 3")
            .unwrap();
        store
            .record_event("key:k1", None, "key-rotated", "1 -> 2")
            .unwrap();
        let source = ChainSource::events(Arc::clone(&store));
        assert_eq!(source.newest_seq().unwrap(), 2);
        let records = source.read(1, 10).unwrap();
        assert_eq!(records.len(), 2);
        let chained = store.chained_events(0, 10).unwrap();
        assert_eq!(records[0].seq, 1);
        assert_eq!(records[0].hash, chained[0].1.hash.unwrap());
        assert_eq!(records[1].prev_hash, records[0].hash);
        assert_eq!(records[0].kind, RecordKind::Verification);
        assert_eq!(records[0].node.as_deref(), Some("gpu-001"));
        assert_eq!(records[1].kind, RecordKind::KeyEvent);
        assert_eq!(source.read(2, 10).unwrap().len(), 1);
        assert!(source.wait_for(2, Duration::ZERO));
        assert!(!source.wait_for(3, Duration::from_millis(1)));
        let decisions = ChainSource::decisions(store);
        assert_eq!(decisions.newest_seq().unwrap(), 0);
        assert!(decisions.read(1, 10).unwrap().is_empty());
    }

    #[test]
    fn event_kinds_map_to_record_kinds() {
        assert_eq!(event_kind("key-destroyed").0, RecordKind::KeyEvent);
        assert_eq!(event_kind("rollback").0, RecordKind::Verification);
        assert_eq!(event_kind("finding-cleared").0, RecordKind::FindingCleared);
        assert_eq!(event_kind("finding").0, RecordKind::Finding);
    }
}
