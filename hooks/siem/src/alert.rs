//! `alert` obligations to Prometheus Alertmanager (API v2) or a generic webhook.
//!
//! Why a thread and a queue: an alert is raised from decision paths that must not
//! wait for HTTP. [`Alerter::fire`] and [`Alerter::resolve`] only enqueue (a bounded
//! queue; when it is full the call says so and a counter grows). The alerter's thread
//! keeps every firing alert and posts it again before it expires: each post carries
//! `endsAt = now + expiry`, so Alertmanager keeps the alert active while Probity keeps
//! refreshing it and lets it resolve by itself if Probity stops; a cleared finding is
//! posted once more with `endsAt = now`, which resolves it at once.
//!
//! Delivery: a post that fails (unreachable, timeout, 5xx, 429) is retried with
//! capped exponential backoff and counted; the alert stays in the set meanwhile, so
//! nothing that should fire is dropped silently. Only a schema rejection (400 or 422,
//! which Alertmanager sends for a malformed alert) drops that alert, counted as
//! `rejected`, with the receiver's message in `last_error`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::backoff::{Backoff, Jitter};
use crate::record::{Record, RecordKind, Severity};
use crate::time::rfc3339_micros;

mod sink;

pub use sink::{AlertSink, AlertmanagerSink, HttpSettings, SinkError, WebhookSink};

/// Label names Alertmanager accepts: `[a-zA-Z_][a-zA-Z0-9_]*`.
pub fn label_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// What should fire: the parts of an `alert` obligation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertSpec {
    /// The policy id; becomes the `alertname` label.
    pub policy: String,
    /// The node or other target; becomes the `node` label when set.
    pub target: Option<String>,
    /// Becomes the `severity` label.
    pub severity: Severity,
    /// Becomes the `message` annotation (and `summary`).
    pub message: String,
    /// Further labels (names made valid by [`label_name`]). They identify the alert:
    /// the same labels are the same alert.
    pub labels: BTreeMap<String, String>,
    /// Further annotations.
    pub annotations: BTreeMap<String, String>,
    /// Link back to the source, if any.
    pub generator_url: Option<String>,
}

impl AlertSpec {
    /// An alert for `policy` on `target`.
    pub fn new(
        policy: impl Into<String>,
        target: Option<String>,
        severity: Severity,
        message: impl Into<String>,
    ) -> Self {
        Self {
            policy: policy.into(),
            target,
            severity,
            message: message.into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            generator_url: None,
        }
    }

    /// The alert a finding record raises (or, for `finding-cleared`, resolves), keyed by
    /// policy and node; `None` for other kinds or without a policy.
    pub fn from_finding(record: &Record) -> Option<(Self, bool)> {
        let firing = match record.kind {
            RecordKind::Finding => true,
            RecordKind::FindingCleared => false,
            _ => return None,
        };
        let policy = record.policy.clone()?;
        Some((
            Self::new(
                policy,
                record.node.clone(),
                record.severity,
                record.message.clone(),
            ),
            firing,
        ))
    }

    /// The alert's labels: `alertname`, `node` (if a target), `severity`, then the
    /// extra ones (which never override these three).
    pub fn label_set(&self) -> BTreeMap<String, String> {
        let mut l: BTreeMap<String, String> = self
            .labels
            .iter()
            .map(|(k, v)| (label_name(k), v.clone()))
            .collect();
        l.insert("alertname".into(), self.policy.clone());
        if let Some(t) = &self.target {
            l.insert("node".into(), t.clone());
        }
        l.insert("severity".into(), self.severity.as_str().into());
        l
    }

    fn annotation_set(&self) -> BTreeMap<String, String> {
        let mut a = self.annotations.clone();
        a.insert("message".into(), self.message.clone());
        a.entry("summary".into())
            .or_insert_with(|| self.message.clone());
        a
    }
}

/// An alert as posted: Alertmanager's `postableAlert`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alert {
    /// Identifying labels.
    pub labels: BTreeMap<String, String>,
    /// Annotations.
    pub annotations: BTreeMap<String, String>,
    /// RFC 3339 start.
    #[serde(rename = "startsAt")]
    pub starts_at: String,
    /// RFC 3339 end: in the future while firing, now when resolved.
    #[serde(rename = "endsAt")]
    pub ends_at: String,
    /// Link back to the source.
    #[serde(
        rename = "generatorURL",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub generator_url: Option<String>,
}

/// Alerter settings. Every field states its default ([`AlerterConfig::default`]).
#[derive(Debug, Clone)]
pub struct AlerterConfig {
    /// A firing alert is posted again this often; default 60 s. Must be shorter than
    /// `expiry`.
    pub refresh_interval: Duration,
    /// `endsAt` of a firing alert is this far ahead of each post; default 5 min.
    pub expiry: Duration,
    /// Commands waiting for the thread; beyond this `fire`/`resolve` fail; default 1024.
    pub queue_capacity: usize,
    /// Alerts held at once (firing or being resolved); default 10,000.
    pub max_alerts: usize,
    /// Delay between failed posts of an alert; default 1 s doubling to 60 s.
    pub backoff: Backoff,
}

impl Default for AlerterConfig {
    fn default() -> Self {
        Self {
            refresh_interval: Duration::from_secs(60),
            expiry: Duration::from_secs(300),
            queue_capacity: 1024,
            max_alerts: 10_000,
            backoff: Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
        }
    }
}

/// An alert that was not taken.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AlertError {
    /// The queue (or the set of held alerts) is full; counted in `dropped_when_full`.
    #[error("alert queue full ({capacity}): alert {alertname:?} dropped")]
    Full {
        /// The alert's name.
        alertname: String,
        /// The limit reached.
        capacity: usize,
    },
    /// The alerter's thread has stopped.
    #[error("the alerter has stopped")]
    Stopped,
    /// The settings are inconsistent.
    #[error("alerter setting {0}")]
    Setting(&'static str),
    /// The thread could not start.
    #[error("cannot start the alerter thread: {0}")]
    Spawn(String),
}

/// A snapshot of the alerter's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AlerterStats {
    /// Successful posts.
    pub posted: u64,
    /// Failed posts (each retried).
    pub failed_posts: u64,
    /// Alerts the receiver refused as malformed (dropped).
    pub rejected: u64,
    /// Alerts not taken because the queue or the set was full.
    pub dropped_when_full: u64,
    /// Alerts resolved (their final post succeeded).
    pub resolved: u64,
    /// Alerts held now (firing or being resolved).
    pub active: u64,
    /// The latest error, if any since the last success.
    pub last_error: Option<String>,
}

#[derive(Default)]
struct Counters {
    posted: AtomicU64,
    failed_posts: AtomicU64,
    rejected: AtomicU64,
    dropped_when_full: AtomicU64,
    resolved: AtomicU64,
    active: AtomicU64,
}

struct Shared {
    c: Counters,
    last_error: Mutex<Option<String>>,
}

enum Command {
    Fire(AlertSpec),
    Resolve(AlertSpec),
}

/// A running alerter. Dropping it stops the thread (held alerts are not posted again;
/// Alertmanager resolves them at their `endsAt`).
pub struct Alerter {
    tx: Option<SyncSender<Command>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    capacity: usize,
}

impl std::fmt::Debug for Alerter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerter")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Alerter {
    /// Starts the alerter's thread, posting to `sink`.
    pub fn start(config: AlerterConfig, sink: Box<dyn AlertSink>) -> Result<Self, AlertError> {
        if config.refresh_interval >= config.expiry {
            return Err(AlertError::Setting(
                "refresh_interval must be shorter than expiry",
            ));
        }
        if config.queue_capacity == 0 || config.max_alerts == 0 {
            return Err(AlertError::Setting(
                "queue_capacity and max_alerts must be at least 1",
            ));
        }
        let (tx, rx) = sync_channel(config.queue_capacity);
        let shared = Arc::new(Shared {
            c: Counters::default(),
            last_error: Mutex::new(None),
        });
        let capacity = config.queue_capacity;
        let worker = AlertWorker {
            cfg: config,
            sink,
            shared: Arc::clone(&shared),
            held: BTreeMap::new(),
            jitter: Jitter::new(),
        };
        let thread = std::thread::Builder::new()
            .name("probity-siem-alerter".into())
            .spawn(move || worker.run(&rx))
            .map_err(|e| AlertError::Spawn(e.to_string()))?;
        Ok(Self {
            tx: Some(tx),
            shared,
            thread: Some(thread),
            capacity,
        })
    }

    fn send(&self, cmd: Command, alertname: &str) -> Result<(), AlertError> {
        let Some(tx) = &self.tx else {
            return Err(AlertError::Stopped);
        };
        match tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.shared
                    .c
                    .dropped_when_full
                    .fetch_add(1, Ordering::Relaxed);
                Err(AlertError::Full {
                    alertname: alertname.to_owned(),
                    capacity: self.capacity,
                })
            }
            Err(TrySendError::Disconnected(_)) => Err(AlertError::Stopped),
        }
    }

    /// Raises (or refreshes) an alert. Never blocks.
    pub fn fire(&self, spec: AlertSpec) -> Result<(), AlertError> {
        let name = spec.policy.clone();
        self.send(Command::Fire(spec), &name)
    }

    /// Resolves the alert with the same labels. Never blocks.
    pub fn resolve(&self, spec: AlertSpec) -> Result<(), AlertError> {
        let name = spec.policy.clone();
        self.send(Command::Resolve(spec), &name)
    }

    /// The counters now.
    pub fn stats(&self) -> AlerterStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.shared.c;
        AlerterStats {
            posted: g(&c.posted),
            failed_posts: g(&c.failed_posts),
            rejected: g(&c.rejected),
            dropped_when_full: g(&c.dropped_when_full),
            resolved: g(&c.resolved),
            active: g(&c.active),
            last_error: self
                .shared
                .last_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

impl Drop for Alerter {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An alert the thread holds.
struct Held {
    spec: AlertSpec,
    starts_at: SystemTime,
    /// Set once resolved: the post still to make carries this end.
    resolved_at: Option<SystemTime>,
    due: Instant,
    failures: u32,
}

struct AlertWorker {
    cfg: AlerterConfig,
    sink: Box<dyn AlertSink>,
    shared: Arc<Shared>,
    held: BTreeMap<BTreeMap<String, String>, Held>,
    jitter: Jitter,
}

impl AlertWorker {
    fn run(mut self, rx: &Receiver<Command>) {
        loop {
            let wait = self
                .held
                .values()
                .map(|h| h.due)
                .min()
                .map_or(Duration::from_secs(3600), |due| {
                    due.saturating_duration_since(Instant::now())
                });
            match rx.recv_timeout(wait) {
                Ok(cmd) => {
                    self.apply(cmd);
                    // Take what else is queued before posting.
                    while let Ok(cmd) = rx.try_recv() {
                        self.apply(cmd);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            self.post_due();
            self.shared.c.active.store(
                u64::try_from(self.held.len()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
    }

    fn apply(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
            Command::Fire(spec) => {
                let key = spec.label_set();
                if let Some(h) = self.held.get_mut(&key) {
                    // Firing again (or again before its resolve went out): post now
                    // only if something shown changed.
                    let changed = h.resolved_at.is_some() || h.spec != spec;
                    if h.resolved_at.is_some() {
                        h.starts_at = SystemTime::now();
                    }
                    h.resolved_at = None;
                    h.spec = spec;
                    if changed {
                        h.due = now;
                    }
                    return;
                }
                if self.held.len() >= self.cfg.max_alerts {
                    self.shared
                        .c
                        .dropped_when_full
                        .fetch_add(1, Ordering::Relaxed);
                    self.set_error(format!(
                        "{} alerts held: alert {:?} dropped",
                        self.cfg.max_alerts, spec.policy
                    ));
                    return;
                }
                self.held.insert(
                    key,
                    Held {
                        spec,
                        starts_at: SystemTime::now(),
                        resolved_at: None,
                        due: now,
                        failures: 0,
                    },
                );
            }
            Command::Resolve(spec) => {
                let key = spec.label_set();
                let at = SystemTime::now();
                let room = self.held.len() < self.cfg.max_alerts;
                match self.held.get_mut(&key) {
                    Some(h) => {
                        h.resolved_at = Some(at);
                        h.due = now;
                    }
                    // Not held (fired before a restart, say): post the resolve anyway.
                    None if room => {
                        self.held.insert(
                            key,
                            Held {
                                spec,
                                starts_at: at,
                                resolved_at: Some(at),
                                due: now,
                                failures: 0,
                            },
                        );
                    }
                    None => {
                        self.shared
                            .c
                            .dropped_when_full
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    fn set_error(&self, e: String) {
        *self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(e);
    }

    fn post_due(&mut self) {
        let now = Instant::now();
        let due: Vec<BTreeMap<String, String>> = self
            .held
            .iter()
            .filter(|(_, h)| h.due <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            let Some(h) = self.held.get_mut(&key) else {
                continue;
            };
            let ends = h
                .resolved_at
                .unwrap_or_else(|| crate::later_system(SystemTime::now(), self.cfg.expiry));
            let alert = Alert {
                labels: key.clone(),
                annotations: h.spec.annotation_set(),
                starts_at: rfc3339_micros(h.starts_at),
                ends_at: rfc3339_micros(ends),
                generator_url: h.spec.generator_url.clone(),
            };
            let c = &self.shared.c;
            match self.sink.post(&alert) {
                Ok(()) => {
                    c.posted.fetch_add(1, Ordering::Relaxed);
                    *self
                        .shared
                        .last_error
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = None;
                    if h.resolved_at.is_some() {
                        c.resolved.fetch_add(1, Ordering::Relaxed);
                        self.held.remove(&key);
                    } else {
                        h.failures = 0;
                        h.due = crate::after(self.cfg.refresh_interval);
                    }
                }
                Err(e) if e.is_rejection() => {
                    c.rejected.fetch_add(1, Ordering::Relaxed);
                    self.set_error(crate::error_chain(&e));
                    self.held.remove(&key);
                }
                Err(e) => {
                    c.failed_posts.fetch_add(1, Ordering::Relaxed);
                    h.failures = h.failures.saturating_add(1);
                    h.due = crate::after(self.cfg.backoff.delay(h.failures, &mut self.jitter));
                    let text = crate::error_chain(&e);
                    self.set_error(text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_made_valid_and_never_override_the_identity() {
        let mut spec = AlertSpec::new(
            "thermal.gpu-over-target",
            Some("gpu-node-1".into()),
            Severity::High,
            "hot",
        );
        spec.labels.insert("gpu index".into(), "3".into());
        spec.labels.insert("9lives".into(), "x".into());
        spec.labels.insert("severity".into(), "low".into());
        let l = spec.label_set();
        assert_eq!(
            l.get("alertname").map(String::as_str),
            Some("thermal.gpu-over-target")
        );
        assert_eq!(l.get("node").map(String::as_str), Some("gpu-node-1"));
        assert_eq!(l.get("severity").map(String::as_str), Some("high"));
        assert_eq!(l.get("gpu_index").map(String::as_str), Some("3"));
        assert_eq!(l.get("_9lives").map(String::as_str), Some("x"));
    }

    #[test]
    fn the_json_is_alertmanagers_postable_alert() {
        let a = Alert {
            labels: [("alertname".to_owned(), "p".to_owned())].into(),
            annotations: BTreeMap::new(),
            starts_at: "2026-11-30T21:47:13.385181Z".into(),
            ends_at: "2026-11-30T21:52:13.385181Z".into(),
            generator_url: None,
        };
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#"{"labels":{"alertname":"p"},"annotations":{},"startsAt":"2026-11-30T21:47:13.385181Z","endsAt":"2026-11-30T21:52:13.385181Z"}"#
        );
    }

    #[test]
    fn refresh_must_come_before_expiry() {
        struct Never;
        impl AlertSink for Never {
            fn post(&self, _: &Alert) -> Result<(), SinkError> {
                Ok(())
            }
        }
        let cfg = AlerterConfig {
            refresh_interval: Duration::from_secs(300),
            ..AlerterConfig::default()
        };
        assert_eq!(
            Alerter::start(cfg, Box::new(Never)).unwrap_err(),
            AlertError::Setting("refresh_interval must be shorter than expiry")
        );
    }
}
