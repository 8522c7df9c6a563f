//! Carrying out the alert obligations of the server's decisions (`[alerts]`): to
//! Alertmanager's API v2 and/or a webhook. Which kind alerts is the schema's to name
//! (`@alert_obligation`, see [`probity::Conventions`]), asked of the engine per batch so
//! that a reload renaming it is followed.
//!
//! Why from the decision log and not from the request: a decision that carries an
//! obligation is recorded durably before it is answered, so alerting from the log
//! costs the hot path nothing, and a crash between the answer and the post loses no
//! alert (the follower resumes from its cursor, `alerts.cursor` in the state
//! directory). A decision is an event, not a state that clears: its alert is held for
//! `hold_seconds` (refreshed by the alerter meanwhile) and then resolved; the same
//! policy, action, principal, resource and target again extends it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use probity::Conventions;
use probity::state::{DecisionRecord, StateStore};
use probity_siem::{
    AlertSpec, Alerter, AlerterConfig, AlerterStats, AlertmanagerSink, Backoff, CursorStore,
    FileCursor, HttpSettings, Severity, WebhookSink,
};

use crate::config::AlertsConfig;

/// The follower's cursor file in the state directory: the next decision-log seq to
/// look at.
pub const ALERTS_CURSOR: &str = "alerts.cursor";
/// Records read at a time.
const BATCH: usize = 512;
/// How long the follower waits when the log has nothing new.
const IDLE: Duration = Duration::from_millis(100);

/// What the follower has done, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FollowerStats {
    /// Alerts fired from the decision log since start.
    pub fired: u64,
    /// Alerts resolved after their hold.
    pub resolved: u64,
    /// Alerts an alerter refused (its queue was full).
    pub dropped: u64,
    /// Failures reading the log or storing the cursor.
    pub errors: u64,
    /// The next decision-log seq to look at.
    pub cursor: u64,
}

/// The alert sinks and the thread that feeds them from the decision log.
pub struct DecisionAlerts {
    sinks: Arc<Vec<(&'static str, Alerter)>>,
    stats: Arc<Mutex<FollowerStats>>,
    stop: mpsc::Sender<()>,
    thread: Option<JoinHandle<()>>,
}

/// Where the follower reads the conventions (an engine's, which a reload may change).
pub type ConventionsSource = Box<dyn Fn() -> Arc<Conventions> + Send>;

/// The alerts the alert obligations (`conventions`' kind) of `record` raise.
pub fn alert_specs(record: &DecisionRecord, conventions: &Conventions) -> Vec<AlertSpec> {
    let d = &record.decision;
    d.obligations
        .iter()
        .filter(|o| conventions.is_alert(&o.kind))
        .map(|o| {
            let reason = d.reasons.iter().find(|r| r.policy == o.policy);
            let severity = reason.map_or(Severity::Medium, |r| severity(r.severity));
            let message = reason.map_or_else(|| o.policy.clone(), |r| r.message.clone());
            let mut spec = AlertSpec::new(o.policy.clone(), o.target.clone(), severity, message);
            for (k, v) in &o.parameters {
                spec.labels.insert(k.clone(), v.clone());
            }
            spec.labels.insert("action".into(), record.action.clone());
            spec.labels
                .insert("principal".into(), record.principal.clone());
            spec.labels
                .insert("resource".into(), record.resource.clone());
            spec.annotations
                .insert("decision".into(), d.decision.to_string());
            spec.annotations
                .insert("decided_at_ms".into(), record.time_unix_ms.to_string());
            spec.annotations
                .insert("decision_seq".into(), record.seq.to_string());
            spec
        })
        .collect()
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

impl DecisionAlerts {
    /// The sinks `config` names, fed from `store`'s decision log from the cursor in
    /// `state_dir`, alerting on the kind `conventions` names (e.g.
    /// `Box::new(move || engine.conventions())`). `None` when `config` names no sink.
    pub fn start(
        config: &AlertsConfig,
        store: Arc<StateStore>,
        state_dir: &Path,
        conventions: ConventionsSource,
    ) -> Result<Option<Self>, String> {
        let http = HttpSettings {
            timeout: Duration::from_millis(config.timeout_ms),
            ca_file: config.ca_file.clone(),
        };
        let alerter = AlerterConfig {
            refresh_interval: Duration::from_secs(config.refresh_seconds),
            expiry: Duration::from_secs(config.expiry_seconds),
            backoff: Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            ..AlerterConfig::default()
        };
        let mut sinks = Vec::new();
        if let Some(url) = &config.alertmanager_url {
            let sink = AlertmanagerSink::new(url, &http)
                .map_err(|e| format!("alertmanager_url {url}: {}", chain(&e)))?;
            let a = Alerter::start(alerter.clone(), Box::new(sink))
                .map_err(|e| format!("the Alertmanager alerter: {}", chain(&e)))?;
            sinks.push(("alertmanager", a));
        }
        if let Some(url) = &config.webhook_url {
            let sink = WebhookSink::new(url, &http)
                .map_err(|e| format!("webhook_url {url}: {}", chain(&e)))?;
            let a = Alerter::start(alerter, Box::new(sink))
                .map_err(|e| format!("the webhook alerter: {}", chain(&e)))?;
            sinks.push(("webhook", a));
        }
        if sinks.is_empty() {
            return Ok(None);
        }
        let sinks = Arc::new(sinks);
        let mut cursor = FileCursor::new(&state_dir.join(ALERTS_CURSOR));
        let start = cursor
            .load()
            .map_err(|e| format!("{ALERTS_CURSOR}: {}", chain(&e)))?;
        let stats = Arc::new(Mutex::new(FollowerStats {
            cursor: start,
            ..FollowerStats::default()
        }));
        let (stop, stopped) = mpsc::channel();
        let hold = Duration::from_secs(config.hold_seconds);
        let thread = {
            let sinks = Arc::clone(&sinks);
            let stats = Arc::clone(&stats);
            std::thread::Builder::new()
                .name("probity-alerts".into())
                .spawn(move || {
                    follow(
                        &store,
                        &conventions,
                        &mut cursor,
                        &sinks,
                        &stats,
                        hold,
                        &stopped,
                    );
                })
                .map_err(|e| format!("cannot start the alert follower: {e}"))?
        };
        Ok(Some(Self {
            sinks,
            stats,
            stop,
            thread: Some(thread),
        }))
    }

    /// The follower's counters and each sink's.
    pub fn stats(&self) -> (FollowerStats, Vec<(&'static str, AlerterStats)>) {
        let f = self
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        (f, self.sinks.iter().map(|(n, a)| (*n, a.stats())).collect())
    }
}

impl Drop for DecisionAlerts {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The follower: read, fire, store the cursor, resolve what was held long enough.
fn follow(
    store: &StateStore,
    conventions: &ConventionsSource,
    cursor: &mut FileCursor,
    sinks: &[(&'static str, Alerter)],
    stats: &Mutex<FollowerStats>,
    hold: Duration,
    stop: &mpsc::Receiver<()>,
) {
    let mut next = stats.lock().unwrap_or_else(PoisonError::into_inner).cursor;
    let mut held: BTreeMap<BTreeMap<String, String>, (AlertSpec, Instant)> = BTreeMap::new();
    let mut cursor_failing = false;
    loop {
        let mut wait = IDLE;
        match store.chained_decisions(next, BATCH) {
            Ok(batch) => {
                let (mut fired, mut dropped) = (0, 0);
                let conventions = conventions();
                for (record, _) in &batch {
                    for spec in alert_specs(record, &conventions) {
                        for (_, a) in sinks {
                            match a.fire(spec.clone()) {
                                Ok(()) => fired += 1,
                                Err(_) => dropped += 1,
                            }
                        }
                        held.insert(spec.label_set(), (spec, Instant::now()));
                    }
                    next = record.seq.saturating_add(1);
                }
                let stored = batch.is_empty()
                    || match cursor.store(next) {
                        Ok(()) => true,
                        Err(e) => {
                            // Once per failing spell: a full disk would repeat it.
                            if !cursor_failing {
                                tracing::error!(
                                    error = %crate::server::error_chain(&e),
                                    cursor = ALERTS_CURSOR,
                                    "cannot store the alert cursor; alerts since the last stored one will fire again after a restart"
                                );
                            }
                            false
                        }
                    };
                if stored && cursor_failing {
                    tracing::info!(cursor = ALERTS_CURSOR, "the alert cursor is stored again");
                }
                cursor_failing = !stored;
                let mut s = stats.lock().unwrap_or_else(PoisonError::into_inner);
                s.fired += fired;
                s.dropped += dropped;
                s.cursor = next;
                s.errors += u64::from(!stored);
                if batch.len() == BATCH {
                    wait = Duration::ZERO;
                }
            }
            Err(_) => {
                stats.lock().unwrap_or_else(PoisonError::into_inner).errors += 1;
                wait = Duration::from_secs(1);
            }
        }
        let now = Instant::now();
        let expired: Vec<_> = held
            .iter()
            .filter(|(_, (_, at))| now.saturating_duration_since(*at) >= hold)
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            if let Some((spec, _)) = held.remove(&key) {
                for (_, a) in sinks {
                    let _ = a.resolve(spec.clone());
                }
                stats
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .resolved += 1;
            }
        }
        match stop.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use probity::{Decision, Effect, Obligation, Reason};

    fn record(obligations: Vec<Obligation>) -> DecisionRecord {
        DecisionRecord {
            seq: 7,
            time_unix_ms: 1_000,
            principal: "Workload::\"w\"".into(),
            action: "Action::\"schedule\"".into(),
            resource: "Node::\"gpu-1\"".into(),
            caller: None,
            request: None,
            sampled: false,
            policy_digest: "d".into(),
            decision: Decision {
                decision: Effect::Deny,
                reasons: vec![Reason {
                    policy: "placement.hot".into(),
                    message: "too hot".into(),
                    severity: probity::Severity::High,
                }],
                obligations,
                errors: vec![],
                score: 0,
                warnings: Vec::new(),
                audit: Vec::new(),
                unrecorded: false,
            },
        }
    }

    #[test]
    fn an_alert_obligation_becomes_an_alert_named_after_its_policy() {
        let r = record(vec![
            Obligation {
                kind: "alert".into(),
                target: Some("Node::\"gpu-1\"".into()),
                parameters: BTreeMap::new(),
                policy: "placement.hot".into(),
            },
            Obligation {
                kind: probity::Conventions::default().block_obligation().into(),
                target: Some("Node::\"gpu-1\"".into()),
                parameters: BTreeMap::new(),
                policy: "placement.hot".into(),
            },
        ]);
        let defaults = Conventions::default();
        let specs = alert_specs(&r, &defaults);
        assert_eq!(specs.len(), 1);
        let labels = specs[0].label_set();
        assert_eq!(labels["alertname"], "placement.hot");
        assert_eq!(labels["node"], "Node::\"gpu-1\"");
        assert_eq!(labels["severity"], "high");
        assert_eq!(labels["principal"], "Workload::\"w\"");
        assert_eq!(specs[0].message, "too hot");
        assert!(alert_specs(&record(vec![]), &defaults).is_empty());
    }

    /// A schema that renames the alert kind: its kind alerts, `alert` no longer does.
    #[test]
    fn the_alert_kind_the_schema_names_is_the_one_that_alerts() {
        let schema = include_str!("../../../policies/probity.cedarschema")
            .replace(
                "@obligations(\"alert block_node",
                "@obligations(\"page alert block_node",
            )
            .replace(
                "@alert_obligation(\"alert\")",
                "@alert_obligation(\"page\")",
            );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("renamed.cedarschema");
        std::fs::write(&path, schema).unwrap();
        let engine =
            probity::Engine::builder(concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies"))
                .schema(path)
                .build()
                .unwrap();
        // Each kind on its own node, to tell which one alerted.
        let obligation = |kind: &str, node: &str| Obligation {
            kind: kind.into(),
            target: Some(format!("Node::\"{node}\"")),
            parameters: BTreeMap::new(),
            policy: "placement.hot".into(),
        };
        let r = record(vec![
            obligation("page", "paged"),
            obligation("alert", "alerted"),
        ]);
        let nodes = |conventions: &Conventions| -> Vec<String> {
            alert_specs(&r, conventions)
                .iter()
                .map(|s| s.label_set()["node"].clone())
                .collect()
        };
        assert_eq!(nodes(&engine.conventions()), ["Node::\"paged\""]);
        assert_eq!(nodes(&Conventions::default()), ["Node::\"alerted\""]);
    }
}
