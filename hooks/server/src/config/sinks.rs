use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ConfigError;

/// `[alerts]`: `alert` obligations of recorded decisions to Alertmanager (API v2)
/// and/or a webhook, taken from the decision log (see `probity-server.toml`). Off
/// while neither URL is set.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AlertsConfig {
    /// Alertmanager's base URL (`http://host:9093`).
    pub alertmanager_url: Option<String>,
    /// A URL that receives each alert as Alertmanager's JSON, one object per post.
    pub webhook_url: Option<String>,
    /// How long a decision's alert stays active (seconds): a decision is an event,
    /// not a state that clears. Default 3600.
    pub hold_seconds: u64,
    /// A firing alert is posted again this often (seconds). Default 60.
    pub refresh_seconds: u64,
    /// `endsAt` = now + this (seconds), so Alertmanager drops an alert nobody
    /// refreshes. Default 300.
    pub expiry_seconds: u64,
    /// Deadline of a post, in milliseconds. Default 10000.
    pub timeout_ms: u64,
    /// PEM CAs for https URLs. Default: Mozilla's roots.
    pub ca_file: Option<PathBuf>,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            alertmanager_url: None,
            webhook_url: None,
            hold_seconds: 3600,
            refresh_seconds: 60,
            expiry_seconds: 300,
            timeout_ms: 10_000,
            ca_file: None,
        }
    }
}

impl AlertsConfig {
    /// Whether a sink is named.
    pub fn enabled(&self) -> bool {
        self.alertmanager_url.is_some() || self.webhook_url.is_some()
    }

    pub(super) fn validate(&self, state_dir: Option<&Path>) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("[alerts] {m}")));
        if !self.enabled() {
            return Ok(());
        }
        if state_dir.is_none() {
            return bad(
                "needs integrity.state_dir: alerts are taken from the decision log kept there",
            );
        }
        if self.hold_seconds == 0 || self.refresh_seconds == 0 || self.timeout_ms == 0 {
            return bad("hold_seconds, refresh_seconds and timeout_ms must be at least 1");
        }
        if self.refresh_seconds >= self.expiry_seconds {
            return bad(
                "refresh_seconds must be shorter than expiry_seconds, or alerts expire between refreshes",
            );
        }
        Ok(())
    }
}

/// Forwarding the decision and event logs to a SIEM, at least once (see
/// `probity-server.toml`); the table the node agent reads too.
pub use probity_siem::{SiemSettings as SiemConfig, SiemTransport};

/// `[siem]`: the table's own checks, and the state directory its logs and cursors
/// live in.
pub(super) fn validate_siem(
    siem: &SiemConfig,
    state_dir: Option<&Path>,
) -> Result<(), ConfigError> {
    let bad = |m: String| Err(ConfigError::Invalid(format!("[siem] {m}")));
    if let Err(m) = siem.check() {
        return bad(m);
    }
    if siem.address.is_some() && state_dir.is_none() {
        return bad(
            "needs integrity.state_dir: the logs it forwards and its delivery cursors live there"
                .into(),
        );
    }
    Ok(())
}
