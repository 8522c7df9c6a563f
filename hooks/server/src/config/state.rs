use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// Durable state (blocklist, manifest registry, event log, decision log) and
/// `POST /v1/verify`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct IntegrityConfig {
    /// State directory: blocks made through the API or by failed verifications survive
    /// restarts there, `/v1/verify` keeps its registry there, and denies and
    /// obligations are recorded there before they are answered. Default: none (blocks
    /// live in memory only, nothing is recorded, and `/v1/verify` answers 503).
    pub state_dir: Option<PathBuf>,
    /// Pinned public key (hex SEC1) that signs manifests. Default: `STATE_DIR/trusted.pub`.
    pub public_key: Option<PathBuf>,
    /// Directories under which `/v1/verify` may read objects and their manifests. A
    /// path outside them (after symlinks are resolved), absent, or not a regular file
    /// or block device is answered "not permitted", whatever the reason, so errors say
    /// nothing about files a caller may not read. Default: none (`/v1/verify` reads
    /// nothing).
    pub data_roots: Vec<PathBuf>,
}

impl IntegrityConfig {
    /// The pinned public key's file: `public_key`, else `STATE_DIR/trusted.pub`.
    pub fn pinned_key_path(&self) -> Option<PathBuf> {
        self.public_key
            .clone()
            .or_else(|| self.state_dir.as_ref().map(|d| d.join("trusted.pub")))
    }
}

/// The keyring (`[keys]`): its metadata lives in the state backend, its KEKs in the HSM
/// named here or, without one, in a software KEK under the state directory ("not an
/// HSM", logged at start). Active whenever the server has a state directory.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KeysConfig {
    /// PKCS#11 module of the HSM holding the KEKs. Default: none (software KEK).
    pub hsm_module: Option<PathBuf>,
    /// Label of its token.
    pub hsm_token: Option<String>,
    /// File holding the user PIN (first line), readable by its owner only. Default: the
    /// PIN comes from PROBITY_HSM_PIN.
    pub hsm_pin_file: Option<PathBuf>,
    /// How often the policies are asked which keys to rotate (each key's `encrypt`
    /// decision, as `User::"probity"`), and those are rotated; 0 turns it off.
    /// Default: 3600.
    pub rotation_check_seconds: u64,
}

impl Default for KeysConfig {
    fn default() -> Self {
        Self {
            hsm_module: None,
            hsm_token: None,
            hsm_pin_file: None,
            rotation_check_seconds: 3600,
        }
    }
}

/// What signs the audit trail's checkpoints (`[audit] sign`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointSigner {
    /// Unsigned checkpoints: they catch accidents and truncation, not a forger who can
    /// write the state directory (the default).
    #[default]
    None,
    /// The software anchor `STATE_DIR/anchor.key` (the one `probity seal` uses): not an
    /// HSM.
    Software,
    /// A signing key in the HSM of `hsm_module`/`hsm_token`.
    Hsm,
}

/// The audit trail's checkpoints (`[audit]`): a signed tree head over each log every
/// `checkpoint_records` records or `checkpoint_seconds` seconds (README, "The audit
/// trail").
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// Records between checkpoints. Default: 1024.
    pub checkpoint_records: u64,
    /// Longest a record waits for its checkpoint, in seconds. Default: 60.
    pub checkpoint_seconds: u64,
    /// What signs them. Default: none.
    pub sign: CheckpointSigner,
    /// With `sign = "hsm"`: the PKCS#11 module.
    pub hsm_module: Option<PathBuf>,
    /// Its token's label.
    pub hsm_token: Option<String>,
    /// File holding the user PIN; default: PROBITY_HSM_PIN.
    pub hsm_pin_file: Option<PathBuf>,
    /// Label of the signing key (generated in the token if missing). Default:
    /// `probity-audit-signing`.
    pub hsm_key: String,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            checkpoint_records: probity::audit::CheckpointPolicy::DEFAULT_RECORDS,
            checkpoint_seconds: probity::audit::CheckpointPolicy::DEFAULT_INTERVAL.as_secs(),
            sign: CheckpointSigner::None,
            hsm_module: None,
            hsm_token: None,
            hsm_pin_file: None,
            hsm_key: "probity-audit-signing".into(),
        }
    }
}

impl AuditConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(format!("[audit] {m}")));
        if self.checkpoint_records == 0 || self.checkpoint_seconds == 0 {
            return bad("checkpoint_records and checkpoint_seconds must be at least 1");
        }
        if self.sign == CheckpointSigner::Hsm
            && (self.hsm_module.is_none() || self.hsm_token.is_none())
        {
            return bad("sign = \"hsm\" needs hsm_module and hsm_token");
        }
        Ok(())
    }
}

/// Which implementation holds the state that processes share.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StateBackendKind {
    /// The embedded redb store in the state directory: one machine (the default).
    #[default]
    Redb,
    /// etcd v3: one truth for the cluster.
    Etcd,
}

/// What this process follows in etcd.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StateRole {
    /// A node's sidecar: the blocklist, the registry and its own node's facts (the
    /// default).
    #[default]
    Sidecar,
    /// An admission webhook or scheduler extender replica: the blocklist and every
    /// node's facts.
    Webhook,
}

impl StateRole {
    fn as_str(self) -> &'static str {
        match self {
            Self::Sidecar => "sidecar",
            Self::Webhook => "webhook",
        }
    }
}

/// The environment variable a sidecar reads its node's name from when `[state] node`
/// is not set (the DaemonSet sets it from the pod's `spec.nodeName`).
pub const NODE_NAME_ENV: &str = "PROBITY_NODE_NAME";

/// Where shared state lives, and how to reach etcd (see `probity-server.toml`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StateConfig {
    /// `"redb"` (default) or `"etcd"`. With etcd, `[integrity] state_dir` still holds
    /// the decision and event logs (and blocks waiting to reach etcd).
    pub backend: StateBackendKind,
    /// etcd client URLs (`https://host:2379`; a bare `host:port` takes https when a CA is
    /// set). Default: none (required with etcd).
    pub endpoints: Vec<String>,
    /// Key prefix of every Probity key. Default `"/probity/"`.
    pub prefix: String,
    /// PEM CA bundle that signed etcd's certificates; enables TLS. Default: none.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate for etcd's `--client-cert-auth`. Default: none.
    pub cert_file: Option<PathBuf>,
    /// Its private key. Default: none.
    pub key_file: Option<PathBuf>,
    /// Name to check etcd's certificates against instead of the endpoint's host.
    /// Default: none.
    pub server_name: Option<String>,
    /// Time to connect to one endpoint, in milliseconds. Default 2000.
    pub connect_timeout_ms: u64,
    /// Time one request may take at one endpoint, in milliseconds. Default 3000.
    pub request_timeout_ms: u64,
    /// Time an operation keeps retrying across endpoints, in milliseconds. Default 10000.
    pub retry_budget_ms: u64,
    /// Idle watches ask etcd for progress this often, in milliseconds: it bounds how
    /// stale a quiet watch looks. Default 1000.
    pub progress_interval_ms: u64,
    /// A watch disconnected this long reads everything again, in milliseconds.
    /// Default 30000.
    pub resync_after_disconnect_ms: u64,
    /// `"sidecar"` (default) or `"webhook"`.
    pub role: StateRole,
    /// The sidecar's node. Default: the environment variable `PROBITY_NODE_NAME`.
    pub node: Option<String>,
    /// The name this process reports its served policy digest under. Default
    /// `sidecar:<node>` or `webhook:<host name>`.
    pub process: Option<String>,
    /// How long a block or unblock waits for this process's watch to apply it, in
    /// milliseconds. Default 5000.
    pub read_your_writes_ms: u64,
    /// Readiness warns when the shared state was last heard from longer ago than
    /// this, in milliseconds. Default 5000.
    pub stale_after_ms: u64,
    /// TTL of the lease under which this process's served digest lives, in seconds.
    /// Default 30.
    pub process_ttl_seconds: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            backend: StateBackendKind::Redb,
            endpoints: Vec::new(),
            prefix: "/probity/".into(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            connect_timeout_ms: 2000,
            request_timeout_ms: 3000,
            retry_budget_ms: 10_000,
            progress_interval_ms: 1000,
            resync_after_disconnect_ms: 30_000,
            role: StateRole::Sidecar,
            node: None,
            process: None,
            read_your_writes_ms: 5000,
            stale_after_ms: 5000,
            process_ttl_seconds: 30,
        }
    }
}

impl StateConfig {
    /// The sidecar's node: `node`, else `PROBITY_NODE_NAME`.
    pub fn node_name(&self) -> Option<String> {
        self.node
            .clone()
            .or_else(|| std::env::var(NODE_NAME_ENV).ok())
            .filter(|n| !n.is_empty())
    }

    /// The name this process reports its served digest under.
    pub fn process_name(&self) -> String {
        if let Some(p) = &self.process {
            return p.clone();
        }
        let who = match self.role {
            StateRole::Sidecar => self.node_name(),
            StateRole::Webhook => None,
        }
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into());
        format!("{}:{who}", self.role.as_str())
    }

    /// The read-your-writes bound.
    pub fn read_your_writes(&self) -> Duration {
        Duration::from_millis(self.read_your_writes_ms)
    }

    /// The staleness readiness warns at.
    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }

    pub(super) fn validate(&self, state_dir: Option<&Path>) -> Result<(), ConfigError> {
        if self.backend != StateBackendKind::Etcd {
            return Ok(());
        }
        let bad = |m: &str| Err(ConfigError::Invalid(format!("[state] {m}")));
        if self.endpoints.is_empty() {
            return bad("backend = \"etcd\" needs endpoints");
        }
        if state_dir.is_none() {
            return bad(
                "backend = \"etcd\" needs [integrity] state_dir, which keeps the decision and event logs",
            );
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return bad("cert_file and key_file go together");
        }
        if self.cert_file.is_some() && self.ca_file.is_none() {
            return bad("a client certificate needs ca_file (TLS)");
        }
        for (name, v) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("retry_budget_ms", self.retry_budget_ms),
            ("progress_interval_ms", self.progress_interval_ms),
            (
                "resync_after_disconnect_ms",
                self.resync_after_disconnect_ms,
            ),
            ("read_your_writes_ms", self.read_your_writes_ms),
            ("stale_after_ms", self.stale_after_ms),
            ("process_ttl_seconds", self.process_ttl_seconds),
        ] {
            if v == 0 {
                return bad(&format!("{name} must be positive"));
            }
        }
        if self.role == StateRole::Sidecar && self.node_name().is_none() {
            return bad(&format!(
                "role = \"sidecar\" needs its node: set node, or the environment variable {NODE_NAME_ENV}"
            ));
        }
        Ok(())
    }
}

/// How much of the decision log (state directory) is kept.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DecisionLogConfig {
    /// Bytes of records kept at most; the oldest whole segments (4,096 records) are
    /// pruned past it. Default 1 GiB.
    pub max_bytes: u64,
    /// Days a record is kept at most. Default 30.
    pub max_age_days: u64,
    /// Readiness reports a warning (and the metric shows) when the log holds this share
    /// of `max_bytes`, in percent. Default 90.
    pub warn_pct: u8,
    /// How often retention runs, in seconds. Default 60.
    pub prune_interval_seconds: u64,
    /// One allow in this many is kept with its request, so that `probity policy
    /// impact` can find allows a candidate set would refuse (0: none). None are kept
    /// while the log holds `warn_pct` of `max_bytes`. Default 1000.
    pub sample_allows_every: u32,
    /// Whether records keep their requests (context and request-scoped entities,
    /// secret-named values redacted, at most 64 KiB), which `probity policy impact`
    /// replays. Default true.
    pub keep_requests: bool,
}

impl Default for DecisionLogConfig {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            max_age_days: 30,
            warn_pct: 90,
            prune_interval_seconds: 60,
            sample_allows_every: 1000,
            keep_requests: true,
        }
    }
}
