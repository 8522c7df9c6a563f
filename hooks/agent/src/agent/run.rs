use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

use super::Agent;
use super::reports::{AuditReport, CycleReport};
use crate::sources::{Outcome, SourceStatus, unix};
use crate::status::{FindingLine, SiemLine, SourceLine, Status};

impl Agent {
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
