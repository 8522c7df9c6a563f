//! What the agent last did, for `probity agent status` and for Prometheus.
//!
//! Why this module exists: an agent runs in the background on every node, and an
//! operator needs to see, without attaching to it, which sources answer, which findings
//! are active and how much CPU a cycle costs. A running agent writes [`Status`] after
//! every cycle to `agent-status.json` in its state directory (through a temporary file
//! and a rename, so a reader never sees half of it), with the same figures as Prometheus
//! text lines in its `metrics` field and in `agent.prom` beside it.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::Path;

use probity_base::prometheus::{Kind, Writer};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::elevation::write_atomic;

/// The status file in the state directory.
pub const STATUS_FILE: &str = "agent-status.json";
/// The metrics file in the state directory.
pub const METRICS_FILE: &str = "agent.prom";
/// Largest status file read back.
pub const MAX_STATUS_BYTES: usize = 16 * 1024 * 1024;

/// One source's state, as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceLine {
    /// `ok`, `unavailable`, `error`, `disabled` or `never`.
    pub state: String,
    /// The reason (unavailable) or the located error (error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was last collected, in Unix seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked_at: Option<u64>,
    /// When its last good reading was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_ok_at: Option<u64>,
    /// Whether it is in the node's `unreadable` set (no reading, or a stale one).
    pub unreadable: bool,
    /// Whether its last good reading is older than `stale_after_seconds`.
    #[serde(default)]
    pub stale: bool,
    /// Why it is unreadable, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_unreadable: Option<String>,
}

/// An active finding, as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FindingLine {
    /// The policy.
    pub policy: String,
    /// The action it came from.
    pub action: String,
    /// What it is about.
    pub subject: String,
    /// `info` … `critical`.
    pub severity: String,
    /// The message.
    pub message: String,
    /// Since when, in Unix seconds.
    pub since: u64,
}

/// One SIEM forwarder's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiemLine {
    /// `decisions` or `events`.
    pub log: String,
    /// Records the receiver has confirmed.
    pub forwarded: u64,
    /// Records written but not yet confirmed or not yet sent.
    pub backlog: u64,
    /// Whether the backlog is over its warning mark.
    pub behind: bool,
    /// Sends and connections that failed (retried).
    pub failures: u64,
    /// The last failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// What the agent writes after each cycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// The node.
    pub node: String,
    /// When this was written, in Unix seconds.
    pub written_at: u64,
    /// When the agent started.
    pub started_at: u64,
    /// Cycles run.
    pub cycles: u64,
    /// When the last cycle ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_cycle_at: Option<u64>,
    /// CPU time of the last cycle on the agent's thread, in milliseconds.
    pub last_cycle_cpu_ms: f64,
    /// CPU time of its phases, in milliseconds.
    #[serde(default)]
    pub last_cycle_phases_ms: BTreeMap<String, f64>,
    /// Per source.
    pub sources: BTreeMap<String, SourceLine>,
    /// The node's `unreadable` set, with why.
    pub unreadable: BTreeMap<String, String>,
    /// Active findings.
    pub findings: Vec<FindingLine>,
    /// Obligations the agent could not carry out since start.
    pub obligation_failures: u64,
    /// Events that could not be recorded since start.
    pub event_failures: u64,
    /// Alert sinks.
    #[serde(default)]
    pub alerts: Vec<crate::alerts::AlertStatus>,
    /// The audit reader, when on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<serde_json::Value>,
    /// The SIEM forwarders, one per log (empty without `[siem]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub siem: Vec<SiemLine>,
    /// The policy set's digest.
    pub policy_digest: String,
    /// The same figures as Prometheus text lines.
    #[serde(default)]
    pub metrics: String,
}

/// A status file that could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StatusError {
    /// No such file, or unreadable.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Over [`MAX_STATUS_BYTES`].
    #[error("{path} is over the limit of {limit} bytes")]
    TooLarge {
        /// The file.
        path: std::path::PathBuf,
        /// The limit.
        limit: usize,
    },
    /// Not a status.
    #[error("{path}:{line}:{column}: not an agent status")]
    Parse {
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
}

impl Status {
    /// Parses a status file's bytes.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, StatusError> {
        if bytes.len() > MAX_STATUS_BYTES {
            return Err(StatusError::TooLarge {
                path: path.to_owned(),
                limit: MAX_STATUS_BYTES,
            });
        }
        serde_json::from_slice(bytes).map_err(|source| StatusError::Parse {
            path: path.to_owned(),
            line: source.line(),
            column: source.column(),
            source,
        })
    }

    /// Reads `agent-status.json` from a state directory.
    pub fn read(state_dir: &Path) -> Result<Self, StatusError> {
        let path = state_dir.join(STATUS_FILE);
        let bytes =
            probity_collect::source::read_regular_file(&path, MAX_STATUS_BYTES).map_err(|e| {
                StatusError::Read {
                    path: path.clone(),
                    source: std::io::Error::other(crate::sources::error_chain(&e)),
                }
            })?;
        Self::parse(&path, &bytes)
    }

    /// Writes the status and the metrics file, each atomically.
    pub fn write(&self, state_dir: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        write_atomic(&state_dir.join(STATUS_FILE), &json)?;
        write_atomic(&state_dir.join(METRICS_FILE), self.metrics.as_bytes())
    }

    /// The figures as Prometheus text exposition lines.
    pub fn render_metrics(&self) -> String {
        let mut m = String::new();
        let mut w = Writer::new(&mut m);
        let node = ("node", self.node.as_str());
        let single = |w: &mut Writer<'_>, name: &str, kind: Kind, help: &str, v: &dyn Display| {
            w.family(name, kind, help);
            w.sample(name, &[node], v);
        };
        single(
            &mut w,
            "probity_agent_cycles_total",
            Kind::Counter,
            "Collection cycles run since the agent started.",
            &self.cycles,
        );
        single(
            &mut w,
            "probity_agent_last_cycle_cpu_seconds",
            Kind::Gauge,
            "CPU time of the last cycle on the agent's thread.",
            &(self.last_cycle_cpu_ms / 1000.0),
        );
        single(
            &mut w,
            "probity_agent_last_cycle_timestamp_seconds",
            Kind::Gauge,
            "When the last cycle ran.",
            &self.last_cycle_at.unwrap_or(0),
        );
        w.family(
            "probity_agent_source_up",
            Kind::Gauge,
            "Whether a source's last collection gave a reading (1), or not (0).",
        );
        for (name, s) in &self.sources {
            w.sample(
                "probity_agent_source_up",
                &[node, ("source", name), ("state", &s.state)],
                u8::from(s.state == "ok"),
            );
        }
        w.family(
            "probity_agent_source_unreadable",
            Kind::Gauge,
            "Whether a source is in the node's unreadable set (no reading, or a stale one).",
        );
        for (name, s) in &self.sources {
            w.sample(
                "probity_agent_source_unreadable",
                &[node, ("source", name)],
                u8::from(s.unreadable),
            );
        }
        w.family(
            "probity_agent_source_last_ok_timestamp_seconds",
            Kind::Gauge,
            "When a source last gave a reading.",
        );
        for (name, s) in &self.sources {
            if let Some(t) = s.last_ok_at {
                w.sample(
                    "probity_agent_source_last_ok_timestamp_seconds",
                    &[node, ("source", name)],
                    t,
                );
            }
        }
        w.family(
            "probity_agent_findings_active",
            Kind::Gauge,
            "Active findings, per policy.",
        );
        let mut per_policy: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for f in &self.findings {
            *per_policy
                .entry((f.policy.as_str(), f.severity.as_str()))
                .or_default() += 1;
        }
        for ((policy, severity), n) in per_policy {
            w.sample(
                "probity_agent_findings_active",
                &[node, ("policy", policy), ("severity", severity)],
                n,
            );
        }
        single(
            &mut w,
            "probity_agent_obligation_failures_total",
            Kind::Counter,
            "Obligations the agent could not carry out.",
            &self.obligation_failures,
        );
        single(
            &mut w,
            "probity_agent_event_failures_total",
            Kind::Counter,
            "Findings or clearings that could not be recorded.",
            &self.event_failures,
        );
        w.family(
            "probity_agent_alerts_posted_total",
            Kind::Counter,
            "Alert posts that succeeded, per sink.",
        );
        for a in &self.alerts {
            w.sample(
                "probity_agent_alerts_posted_total",
                &[node, ("sink", &a.sink)],
                a.posted,
            );
        }
        w.family(
            "probity_agent_alerts_failed_posts_total",
            Kind::Counter,
            "Alert posts that failed (retried), per sink.",
        );
        for a in &self.alerts {
            w.sample(
                "probity_agent_alerts_failed_posts_total",
                &[node, ("sink", &a.sink)],
                a.failed_posts,
            );
        }
        if !self.siem.is_empty() {
            w.family(
                "probity_agent_siem_forwarded_total",
                Kind::Counter,
                "Records the SIEM confirmed, per log.",
            );
            for l in &self.siem {
                w.sample(
                    "probity_agent_siem_forwarded_total",
                    &[node, ("log", &l.log)],
                    l.forwarded,
                );
            }
            w.family(
                "probity_agent_siem_backlog",
                Kind::Gauge,
                "Records not yet confirmed by the SIEM, per log.",
            );
            for l in &self.siem {
                w.sample(
                    "probity_agent_siem_backlog",
                    &[node, ("log", &l.log)],
                    l.backlog,
                );
            }
            w.family(
                "probity_agent_siem_failures_total",
                Kind::Counter,
                "Failed sends and connections to the SIEM (retried), per log.",
            );
            for l in &self.siem {
                w.sample(
                    "probity_agent_siem_failures_total",
                    &[node, ("log", &l.log)],
                    l.failures,
                );
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Status {
        let mut sources = BTreeMap::new();
        sources.insert(
            "ipmi".into(),
            SourceLine {
                state: "unavailable".into(),
                reason: Some("no BMC".into()),
                checked_at: Some(5),
                last_ok_at: None,
                unreadable: true,
                stale: false,
                why_unreadable: Some("unavailable: no BMC".into()),
            },
        );
        let mut s = Status {
            node: "n\"1".into(),
            written_at: 10,
            started_at: 1,
            cycles: 3,
            last_cycle_at: Some(9),
            last_cycle_cpu_ms: 2.5,
            last_cycle_phases_ms: BTreeMap::new(),
            sources,
            unreadable: BTreeMap::new(),
            findings: vec![FindingLine {
                policy: "thermal.telemetry-unreadable".into(),
                action: "comply".into(),
                subject: "Node::\"n\"".into(),
                severity: "high".into(),
                message: "m".into(),
                since: 4,
            }],
            obligation_failures: 0,
            event_failures: 0,
            alerts: vec![],
            siem: vec![],
            audit: None,
            policy_digest: "d".into(),
            metrics: String::new(),
        };
        s.metrics = s.render_metrics();
        s
    }

    #[test]
    fn the_status_round_trips_through_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = sample();
        s.write(dir.path()).unwrap();
        assert_eq!(Status::read(dir.path()).unwrap(), s);
        let prom = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        assert_eq!(prom, s.metrics);
    }

    #[test]
    fn metrics_are_valid_exposition_lines() {
        let m = sample().metrics;
        assert!(
            m.contains("probity_agent_cycles_total{node=\"n\\\"1\"} 3\n"),
            "{m}"
        );
        assert!(m.contains(
            "probity_agent_source_up{node=\"n\\\"1\",source=\"ipmi\",state=\"unavailable\"} 0\n"
        ));
        assert!(m.contains("probity_agent_source_unreadable{node=\"n\\\"1\",source=\"ipmi\"} 1\n"));
        assert!(m.contains(
            "probity_agent_findings_active{node=\"n\\\"1\",policy=\"thermal.telemetry-unreadable\",severity=\"high\"} 1\n"
        ));
        // Every sample line is `name{labels} value`.
        for line in m.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<f64>().unwrap();
        }
        // What the siem crate's exposition parser accepts, the DCGM parser does too.
        probity_collect::dcgm::parse_exposition(m.as_bytes()).unwrap();
        probity_base::prometheus::check(&m).unwrap();
    }

    #[test]
    fn a_broken_status_file_is_located() {
        match Status::parse(Path::new("s.json"), b"{\n  \"node\": 7\n}") {
            Err(StatusError::Parse { line, .. }) => assert_eq!(line, 2),
            other => panic!("{other:?}"),
        }
    }
}
