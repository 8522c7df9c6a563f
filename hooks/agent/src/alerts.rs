//! Where `alert` obligations go: Alertmanager and/or a webhook, each through an
//! [`Alerter`] of its own (so a slow webhook never delays Alertmanager).
//!
//! Why this module exists: the agent fires an alert when a finding is raised, updates it
//! when its message changes, and resolves it when the finding clears; the alerters keep
//! it alive in between (each refresh moves `endsAt`), so nothing here posts on a timer.

use probity_siem::{
    AlertSpec, Alerter, AlerterConfig, AlertmanagerSink, Backoff, HttpSettings, WebhookSink,
};
use serde::Serialize;

use crate::config::Alerts;
use crate::findings::Finding;
use probity::Obligation;

/// Why the alert sinks could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AlertSetupError {
    /// A sink could not be built (its CA file, say).
    #[error("alert sink {name}")]
    Sink {
        /// `alertmanager` or `webhook`.
        name: &'static str,
        /// Why.
        #[source]
        source: probity_siem::SinkError,
    },
    /// The alerter thread could not start.
    #[error("alert sink {name}")]
    Alerter {
        /// `alertmanager` or `webhook`.
        name: &'static str,
        /// Why.
        #[source]
        source: probity_siem::AlertError,
    },
}

/// The configured alerters.
#[derive(Debug, Default)]
pub struct AlertSinks {
    alerters: Vec<(&'static str, Alerter)>,
}

/// One sink's counters, for the status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct AlertStatus {
    /// `alertmanager` or `webhook`.
    pub sink: String,
    /// Successful posts.
    pub posted: u64,
    /// Failed posts (retried).
    pub failed_posts: u64,
    /// Alerts the receiver refused as malformed.
    pub rejected: u64,
    /// Alerts not taken because the queue was full.
    pub dropped_when_full: u64,
    /// Alerts resolved.
    pub resolved: u64,
    /// Alerts held now.
    pub active: u64,
    /// The latest error since the last success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl AlertSinks {
    /// No sink: findings are only recorded.
    pub fn none() -> Self {
        Self::default()
    }

    /// The sinks `config` names, with its timings.
    pub fn from_config(config: &Alerts) -> Result<Self, AlertSetupError> {
        let alerter = AlerterConfig {
            refresh_interval: config.refresh,
            expiry: config.expiry,
            backoff: Backoff {
                initial: std::time::Duration::from_secs(1),
                max: std::time::Duration::from_secs(60),
            },
            ..AlerterConfig::default()
        };
        Self::with_alerter_config(config, &alerter)
    }

    /// The sinks `config` names, with explicit alerter settings (tests shorten them).
    pub fn with_alerter_config(
        config: &Alerts,
        alerter: &AlerterConfig,
    ) -> Result<Self, AlertSetupError> {
        let http = HttpSettings {
            timeout: config.timeout,
            ca_file: config.ca_file.clone(),
        };
        let mut alerters = Vec::new();
        if let Some(url) = &config.alertmanager_url {
            let name = "alertmanager";
            let sink = AlertmanagerSink::new(url, &http)
                .map_err(|source| AlertSetupError::Sink { name, source })?;
            let a = Alerter::start(alerter.clone(), Box::new(sink))
                .map_err(|source| AlertSetupError::Alerter { name, source })?;
            alerters.push((name, a));
        }
        if let Some(url) = &config.webhook_url {
            let name = "webhook";
            let sink = WebhookSink::new(url, &http)
                .map_err(|source| AlertSetupError::Sink { name, source })?;
            let a = Alerter::start(alerter.clone(), Box::new(sink))
                .map_err(|source| AlertSetupError::Alerter { name, source })?;
            alerters.push((name, a));
        }
        Ok(Self { alerters })
    }

    /// Whether any sink is configured.
    pub fn is_empty(&self) -> bool {
        self.alerters.is_empty()
    }

    /// Raises (or updates) an alert on every sink; the sinks that refused it, with why.
    pub fn fire(&self, spec: &AlertSpec) -> Vec<String> {
        self.alerters
            .iter()
            .filter_map(|(name, a)| a.fire(spec.clone()).err().map(|e| format!("{name}: {e}")))
            .collect()
    }

    /// Resolves an alert on every sink; the sinks that refused, with why.
    pub fn resolve(&self, spec: &AlertSpec) -> Vec<String> {
        self.alerters
            .iter()
            .filter_map(|(name, a)| {
                a.resolve(spec.clone())
                    .err()
                    .map(|e| format!("{name}: {e}"))
            })
            .collect()
    }

    /// Every sink's counters.
    pub fn status(&self) -> Vec<AlertStatus> {
        self.alerters
            .iter()
            .map(|(name, a)| {
                let s = a.stats();
                AlertStatus {
                    sink: (*name).to_owned(),
                    posted: s.posted,
                    failed_posts: s.failed_posts,
                    rejected: s.rejected,
                    dropped_when_full: s.dropped_when_full,
                    resolved: s.resolved,
                    active: s.active,
                    last_error: s.last_error,
                }
            })
            .collect()
    }
}

/// The siem crate's severity for the engine's.
pub fn severity(s: probity::Severity) -> probity_siem::Severity {
    match s {
        probity::Severity::Info => probity_siem::Severity::Info,
        probity::Severity::Low => probity_siem::Severity::Low,
        probity::Severity::Medium => probity_siem::Severity::Medium,
        probity::Severity::High => probity_siem::Severity::High,
        probity::Severity::Critical => probity_siem::Severity::Critical,
    }
}

/// The alert of an `alert` obligation of `finding`: named after the policy, on the
/// obligation's target, with the finding's severity and message; labelled with the
/// agent's node, the action and the subject (so one policy's findings on two port ranges
/// are two alerts) and the obligation's parameters.
pub fn alert_spec(node: &str, finding: &Finding, obligation: &Obligation) -> AlertSpec {
    let mut spec = AlertSpec::new(
        finding.policy.clone(),
        obligation.target.clone(),
        severity(finding.severity),
        finding.message.clone(),
    );
    for (k, v) in &obligation.parameters {
        spec.labels.insert(k.clone(), v.clone());
    }
    spec.labels.insert("probity_node".into(), node.to_owned());
    spec.labels.insert("action".into(), finding.action.clone());
    spec.labels
        .insert("subject".into(), finding.subject.clone());
    spec.annotations
        .insert("since".into(), finding.since.to_string());
    spec
}
