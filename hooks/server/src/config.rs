//! The server's configuration: a TOML file (see `probity-server.toml` beside this crate,
//! which documents every option with its default) that command-line flags override.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Largest configuration file read.
const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// Where the sidecar socket lives unless configured otherwise.
pub const DEFAULT_SOCKET: &str = "/run/probity/probity.sock";

/// Everything `probity serve` can be told.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Listeners, TLS and limits.
    pub server: ServerConfig,
    /// The policy set.
    pub policies: PolicyConfig,
    /// Who may change state through the API.
    pub auth: AuthConfig,
    /// The Kubernetes admission endpoints.
    pub admission: AdmissionConfig,
    /// The kube-scheduler extender.
    pub scheduler: SchedulerConfig,
    /// Durable state and verify before read.
    pub integrity: IntegrityConfig,
    /// The keyring: where its KEKs live, automatic rotation.
    pub keys: KeysConfig,
    /// Where shared state (blocklist, registry, facts, digests) lives: redb or etcd.
    pub state: StateConfig,
    /// Per-caller limits on what callers share.
    pub limits: LimitsConfig,
    /// How much of the decision log is kept.
    pub decision_log: DecisionLogConfig,
    /// The audit trail's checkpoints: how often, signed by what.
    pub audit: AuditConfig,
    /// Logging.
    pub log: LogConfig,
    /// Forwarding the audit logs to a SIEM.
    pub siem: SiemConfig,
    /// Where `alert` obligations of the server's decisions go.
    pub alerts: AlertsConfig,
}

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

    fn validate(&self, state_dir: Option<&Path>) -> Result<(), ConfigError> {
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
fn validate_siem(siem: &SiemConfig, state_dir: Option<&Path>) -> Result<(), ConfigError> {
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
    fn validate(&self) -> Result<(), ConfigError> {
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

    fn validate(&self, state_dir: Option<&Path>) -> Result<(), ConfigError> {
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

/// Limits per caller identity on what callers share.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Decisions per second a caller may cause to be recorded (denies, obligations,
    /// refused API calls); past its budget a caller is answered 429 and nothing is
    /// recorded. 0 turns the limit off. Default 200.
    pub recorded_per_second: u32,
    /// Recorded decisions a caller may cause at once. Default 1000.
    pub recorded_burst: u32,
    /// Threads for callers' blocking I/O (verification reads), apart from everything
    /// else. Default 4.
    pub io_threads: usize,
    /// Verification jobs waiting for an I/O thread at most; more are answered 429.
    /// Default 64.
    pub io_queue: usize,
    /// Verification jobs one caller may have in flight. Default 2.
    pub io_per_caller: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            recorded_per_second: 200,
            recorded_burst: 1000,
            io_threads: 4,
            io_queue: 64,
            io_per_caller: 2,
        }
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
}

impl Default for DecisionLogConfig {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            max_age_days: 30,
            warn_pct: 90,
            prune_interval_seconds: 60,
        }
    }
}

/// Listeners, TLS and limits.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Unix socket path; empty to listen on no socket. Default [`DEFAULT_SOCKET`].
    pub socket: PathBuf,
    /// Permission bits of the socket, in octal. Default `"0660"`.
    pub socket_mode: String,
    /// TCP address to listen on (TLS unless `insecure`). Default: none.
    pub listen: Option<SocketAddr>,
    /// Serve plain HTTP on `listen`; refused unless the address is loopback. Default false.
    pub insecure: bool,
    /// PEM certificate chain for TLS. Required with `listen` unless `insecure`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: when set, TCP clients present a certificate it signed (mTLS).
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: `"required"` (the default: a client without a certificate is
    /// refused at the handshake) or `"optional"` (a client without one is served as
    /// `anonymous`, budgeted per network; one with a certificate must present a valid
    /// one). Optional lets the kubelet's probes in while the apiserver and the scheduler
    /// authenticate.
    pub client_auth: ClientAuth,
    /// Largest request body in bytes. Default 1 MiB.
    pub max_body_bytes: usize,
    /// Longest time one request may take, in milliseconds. Default 5000.
    pub request_timeout_ms: u64,
    /// Most requests handled at once; more wait. Default 1024.
    pub max_concurrency: usize,
    /// Longest wait for in-flight requests at shutdown, in milliseconds. Default 10000.
    pub shutdown_grace_ms: u64,
    /// Connections open at once, at most. Default 4096.
    pub max_connections: usize,
    /// Connections one caller identity (or, without one, one peer address) may have
    /// open. Default 256.
    pub max_connections_per_caller: usize,
    /// Longest time a connection may take to send a request's headers, in
    /// milliseconds (a slowloris is cut off after it). Default 10000.
    pub header_read_timeout_ms: u64,
    /// Fact streams (`POST /v1/entities/stream`) open at once, over all callers, at
    /// most. Default 64.
    pub max_fact_streams: usize,
    /// Fact streams one caller identity may have open at once, so that one writer
    /// cannot take every stream. Default 16.
    pub max_fact_streams_per_caller: usize,
    /// A fact stream that sends no byte, or reads no acknowledgement, for this long is
    /// ended, in milliseconds. Default 60000.
    pub fact_stream_idle_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            socket_mode: "0660".into(),
            listen: None,
            insecure: false,
            tls_cert: None,
            tls_key: None,
            client_ca: None,
            client_auth: ClientAuth::Required,
            max_body_bytes: 1024 * 1024,
            request_timeout_ms: 5000,
            max_concurrency: 1024,
            shutdown_grace_ms: 10_000,
            max_connections: 4096,
            max_connections_per_caller: 256,
            header_read_timeout_ms: 10_000,
            max_fact_streams: 64,
            max_fact_streams_per_caller: 16,
            fact_stream_idle_ms: 60_000,
        }
    }
}

impl ServerConfig {
    /// The request timeout as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

/// The policy set.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Policy directory (with probity.cedarschema and probity.toml), hot-reloaded on
    /// change. Default: the policies embedded in the binary.
    pub dir: Option<PathBuf>,
    /// Cedar entity JSON loaded into the store at start. Default: none.
    pub entities: Option<PathBuf>,
    /// Sealed mode: load only a set whose `policy.seal` (written by `probity policy
    /// seal`) is signed with the pinned key (`[integrity] public_key`, default
    /// `STATE_DIR/trusted.pub`), lists exactly the directory's files with their digests,
    /// and is not older than the set loaded before (across restarts, with a state
    /// directory). Needs `dir`. Default: false.
    pub sealed: bool,
    /// In sealed mode, the seal's name the set must carry (so that another set signed
    /// with the same key cannot stand in for it). Default: any, then the live set's.
    pub seal_name: Option<String>,
}

/// Who may change state through the API. Callers are `uid:<n>` on the Unix socket,
/// `cn:<subject CN>` with a client certificate, and `anonymous` otherwise.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Group name to member identities; the policies under policies/api read the groups.
    /// Default: `admins = ["uid:0"]`.
    pub groups: BTreeMap<String, Vec<String>>,
    /// Identity to the node whose sidecar it is, e.g. `"cn:sidecar-gpu-001" = "gpu-001"`.
    /// Default: none.
    pub nodes: BTreeMap<String, String>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            groups: BTreeMap::from([("admins".to_owned(), vec!["uid:0".to_owned()])]),
            nodes: BTreeMap::new(),
        }
    }
}

/// The endpoint families of the API, as `Api` entities.
pub(crate) const API_FAMILIES: &[&str] =
    &["decisions", "entities", "facts", "keys", "nodes", "verify"];

impl AuthConfig {
    /// The API's callers, groups and endpoint families as the engine-owned entities the
    /// `manage` policies read (`ApiCaller` in its `ApiGroup`s, with its `node`). A
    /// caller not named here has no groups: it exists only as a uid in its requests.
    pub fn api_entities(&self) -> serde_json::Value {
        use serde_json::json;
        let mut callers: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (group, members) in &self.groups {
            for m in members {
                callers.entry(m).or_default().push(group);
            }
        }
        for id in self.nodes.keys() {
            callers.entry(id).or_default();
        }
        let mut out = Vec::new();
        for (id, groups) in callers {
            let mut attrs = serde_json::Map::new();
            if let Some(n) = self.nodes.get(id) {
                attrs.insert("node".into(), json!(n));
            }
            out.push(json!({
                "uid": {"type": "ApiCaller", "id": id},
                "attrs": attrs,
                "parents": groups.iter().map(|g| json!({"type": "ApiGroup", "id": g})).collect::<Vec<_>>(),
            }));
        }
        for g in self.groups.keys() {
            out.push(json!({"uid": {"type": "ApiGroup", "id": g}, "attrs": {}, "parents": []}));
        }
        for f in API_FAMILIES {
            out.push(json!({"uid": {"type": "Api", "id": f}, "attrs": {}, "parents": []}));
        }
        serde_json::Value::Array(out)
    }
}

/// Whether TCP clients must present a certificate when `client_ca` is set.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// Every client presents a certificate `client_ca` signed. The default.
    #[default]
    Required,
    /// A client may present none and is then `anonymous`; a certificate it presents
    /// must verify.
    Optional,
}

/// What admission does with a pod bound to a node the store holds no facts about.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownNodes {
    /// Decide anyway: the placement rules cannot be evaluated, so the pod is denied
    /// (unknown is a finding). The default.
    #[default]
    Deny,
    /// Decide anyway, and admit with a warning when the deny comes only from rules that
    /// cannot be evaluated without the node's facts: for clusters that admit pods
    /// before node agents have reported their nodes. A rule that does decide (a blocked
    /// node, a forbidden image) still denies.
    Warn,
}

/// What the scheduler extender does with a node the store holds no facts about.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownSchedulerNodes {
    /// Filter it out, with a reason in `FailedNodes` (the default: its rules cannot
    /// be evaluated). Seed node facts, or let agents report them, before relying on
    /// the extender.
    #[default]
    Filter,
    /// Let it through with score 0: for a cluster whose node agents have not reported
    /// yet. A blocked node is still filtered out.
    Allow,
}

/// The kube-scheduler extender endpoints.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Nodes absent from the store: `"filter"` (the default) or `"allow"`.
    pub unknown_nodes: UnknownSchedulerNodes,
    /// Most nodes one ExtenderArgs may name; more is a 413. Default 15,000 (three times
    /// the 5,000 nodes Kubernetes supports in one cluster).
    pub max_nodes: usize,
    /// Largest ExtenderArgs body in bytes; larger is a 413. Default 4 MiB.
    pub max_body_bytes: usize,
    /// A request naming more than this many nodes is large. Default 1,000.
    pub large_request_nodes: usize,
    /// Large requests judged at once; one more is a 503 the scheduler retries.
    /// Default 2.
    pub max_large_requests: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            unknown_nodes: UnknownSchedulerNodes::default(),
            max_nodes: 15_000,
            max_body_bytes: 4 * 1024 * 1024,
            large_request_nodes: 1_000,
            max_large_requests: 2,
        }
    }
}

/// What to do with an AdmissionReview for a kind that holds no pod spec.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownKinds {
    /// Allow it, with a warning (the default).
    #[default]
    Allow,
    /// Deny it.
    Deny,
}

/// The Kubernetes admission endpoints.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Kinds without a pod spec. Default `"allow"` (with a warning).
    pub unknown_kinds: UnknownKinds,
    /// A pod bound (`spec.nodeName`) to a node absent from the store: `"deny"` (the
    /// default: placement cannot be checked, so it fails closed) or `"warn"`.
    pub unknown_nodes: UnknownNodes,
    /// Pod label giving the workload class. Default `"probity.io/class"`.
    pub class_label: String,
    /// Class of a pod without that label. Default `"batch"`.
    pub default_class: String,
    /// Pod annotation giving the GPU memory requested per GPU, in MiB (default 0 when
    /// absent). Default `"probity.io/gpu-memory-mib"`.
    pub gpu_memory_annotation: String,
    /// Extended resource counted as GPUs. Default `"nvidia.com/gpu"`.
    pub gpu_resource: String,
    /// Extended resources that are GPUs, with how many GPUs one unit counts as; a name
    /// ending in `*` is a prefix (MIG profiles). Default
    /// `{"nvidia.com/gpu" = 1, "nvidia.com/mig-*" = 1}`; `gpu_resource`, when set, is
    /// added with a count of 1.
    pub gpu_resources: BTreeMap<String, u32>,
    /// Node label holding a node's name. Default `"kubernetes.io/hostname"`.
    pub hostname_label: String,
    /// Node label holding a node's Probity zone id. Default `"topology.probity.io/zone"`.
    pub zone_label: String,
    /// Most admitted pods whose facts are remembered for their binding (in the state
    /// backend: every replica sees them). Default 100,000.
    pub admitted_facts_max: usize,
    /// Seconds an admitted pod's facts are remembered; a binding later than that is
    /// judged with the node-level rules only. Default 86,400 (a day).
    pub admitted_facts_seconds: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            unknown_kinds: UnknownKinds::Allow,
            unknown_nodes: UnknownNodes::Deny,
            class_label: "probity.io/class".into(),
            default_class: "batch".into(),
            gpu_memory_annotation: "probity.io/gpu-memory-mib".into(),
            gpu_resource: "nvidia.com/gpu".into(),
            gpu_resources: BTreeMap::from([
                ("nvidia.com/gpu".to_owned(), 1),
                ("nvidia.com/mig-*".to_owned(), 1),
            ]),
            hostname_label: "kubernetes.io/hostname".into(),
            zone_label: "topology.probity.io/zone".into(),
            admitted_facts_max: 100_000,
            admitted_facts_seconds: 86_400,
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Logging.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `"text"` or `"json"`. Default `"text"`.
    pub format: LogFormat,
    /// A tracing filter (`info`, `probity_server=debug`); `RUST_LOG` overrides it.
    /// Default `"info"`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is too large.
    #[error("{path} is over the limit of {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        limit: u64,
    },
    /// The file is not valid TOML for this configuration.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What and where (TOML's own message, with line and column).
        message: String,
    },
    /// The options contradict each other or a rule.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Reads a configuration file; absent options take their defaults.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let read = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let len = std::fs::metadata(path).map_err(read)?.len();
        if len > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge {
                path: path.to_owned(),
                limit: MAX_CONFIG_BYTES,
            });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        Self::from_toml(&text).map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses a configuration from TOML text.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        // A removed option gets a message saying where its job went, not "unknown field".
        if let Ok(table) = text.parse::<toml::Table>()
            && table
                .get("admission")
                .and_then(|a| a.get("zone_power_ceiling_pct"))
                .is_some()
        {
            return Err("admission.zone_power_ceiling_pct is no longer read: the zone power ceiling is the policy set's own setting (thermal.zone_power_ceiling_pct in the policy directory's probity.toml), which the webhook and the extender follow through the policies".into());
        }
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())
    }

    /// Checks the rules that no single option can: a listener exists, plain TCP only on
    /// loopback, TLS material present.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.policies.sealed && self.policies.dir.is_none() {
            return Err(ConfigError::Invalid(
                "policies.sealed needs policies.dir: the embedded policies carry no seal".into(),
            ));
        }
        if self.policies.sealed
            && self.integrity.public_key.is_none()
            && self.integrity.state_dir.is_none()
        {
            return Err(ConfigError::Invalid(
                "policies.sealed needs the pinned public key: set integrity.public_key or integrity.state_dir (STATE_DIR/trusted.pub)".into(),
            ));
        }
        self.audit.validate()?;
        let s = &self.server;
        if s.socket.as_os_str().is_empty() && s.listen.is_none() {
            return Err(ConfigError::Invalid(
                "no listener: set a Unix socket or a TCP address".into(),
            ));
        }
        self.socket_mode()?;
        if let Some(addr) = s.listen {
            if s.insecure {
                if !addr.ip().is_loopback() {
                    return Err(ConfigError::Invalid(format!(
                        "insecure (plain HTTP) is allowed only on loopback addresses, not {addr}"
                    )));
                }
            } else if s.tls_cert.is_none() || s.tls_key.is_none() {
                return Err(ConfigError::Invalid(format!(
                    "TCP listener {addr} needs tls_cert and tls_key (or insecure on loopback)"
                )));
            }
        } else if s.insecure {
            return Err(ConfigError::Invalid(
                "insecure needs a TCP listen address".into(),
            ));
        }
        if s.client_ca.is_some() && s.insecure {
            return Err(ConfigError::Invalid(
                "client_ca (mTLS) cannot be combined with insecure".into(),
            ));
        }
        if s.max_body_bytes == 0 || s.max_concurrency == 0 || s.request_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "max_body_bytes, max_concurrency and request_timeout_ms must be positive".into(),
            ));
        }
        // Zero streams would not disable them but refuse every writer with 429; a
        // caller who may not write is the policies' business.
        for (option, value) in [
            ("fact_stream_idle_ms", s.fact_stream_idle_ms),
            ("max_fact_streams", s.max_fact_streams as u64),
            (
                "max_fact_streams_per_caller",
                s.max_fact_streams_per_caller as u64,
            ),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid(format!(
                    "[server] {option} must be positive"
                )));
            }
        }
        self.state.validate(self.integrity.state_dir.as_deref())?;
        validate_siem(&self.siem, self.integrity.state_dir.as_deref())?;
        self.alerts.validate(self.integrity.state_dir.as_deref())
    }

    /// The socket permission bits.
    pub fn socket_mode(&self) -> Result<u32, ConfigError> {
        let m = self.server.socket_mode.trim_start_matches("0o");
        u32::from_str_radix(m, 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "socket_mode {:?} is not an octal mode like \"0660\"",
                    self.server.socket_mode
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_example_is_the_defaults() {
        let text = include_str!("../probity-server.toml");
        let parsed = Config::from_toml(text).unwrap();
        assert_eq!(parsed, Config::default());
    }

    #[test]
    fn audit_checkpoints_need_a_period_and_an_hsm_its_token() {
        let c = Config::from_toml("[audit]\ncheckpoint_records = 0\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("[audit] checkpoint_records"), "{err}");
        let c = Config::from_toml("[audit]\nsign = \"hsm\"\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("needs hsm_module and hsm_token"), "{err}");
        assert!(Config::from_toml("[audit]\nsign = \"tpm\"\n").is_err());
    }

    #[test]
    fn insecure_off_loopback_is_refused() {
        let c =
            Config::from_toml("[server]\nlisten = \"0.0.0.0:8181\"\ninsecure = true\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("only on loopback"), "{err}");
        let c =
            Config::from_toml("[server]\nlisten = \"127.0.0.1:8181\"\ninsecure = true\n").unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn fact_stream_bounds_must_be_positive() {
        for option in [
            "fact_stream_idle_ms",
            "max_fact_streams",
            "max_fact_streams_per_caller",
        ] {
            let c = Config::from_toml(&format!("[server]\n{option} = 0\n")).unwrap();
            let err = c.validate().unwrap_err().to_string();
            assert_eq!(
                err,
                format!("invalid configuration: [server] {option} must be positive")
            );
        }
    }

    #[test]
    fn tcp_without_tls_material_is_refused() {
        let c = Config::from_toml("[server]\nlisten = \"127.0.0.1:8443\"\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("tls_cert"));
    }

    #[test]
    fn etcd_needs_endpoints_a_state_dir_and_a_node() {
        let c = Config::from_toml("[state]\nbackend = \"etcd\"\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("needs endpoints"), "{err}");
        let c = Config::from_toml(
            "[state]\nbackend = \"etcd\"\nendpoints = [\"127.0.0.1:2379\"]\nrole = \"webhook\"\n",
        )
        .unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("state_dir"), "{err}");
        let c = Config::from_toml(
            "[integrity]\nstate_dir = \"/tmp/x\"\n[state]\nbackend = \"etcd\"\nendpoints = [\"127.0.0.1:2379\"]\nrole = \"sidecar\"\nnode = \"gpu-001\"\ncert_file = \"c\"\n",
        )
        .unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cert_file and key_file"), "{err}");
        let c = Config::from_toml(
            "[integrity]\nstate_dir = \"/tmp/x\"\n[state]\nbackend = \"etcd\"\nendpoints = [\"127.0.0.1:2379\"]\nnode = \"gpu-001\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.state.process_name(), "sidecar:gpu-001");
    }

    #[test]
    fn alerts_need_a_state_dir_and_a_refresh_inside_the_expiry() {
        let c =
            Config::from_toml("[alerts]\nalertmanager_url = \"http://127.0.0.1:9093\"\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("[alerts] needs integrity.state_dir"), "{err}");
        let c = Config::from_toml(
            "[integrity]\nstate_dir = \"/tmp/x\"\n[alerts]\nwebhook_url = \"http://127.0.0.1:1\"\nrefresh_seconds = 300\n",
        )
        .unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("shorter than expiry_seconds"), "{err}");
        // No sink named: nothing to check, nothing started.
        let c = Config::from_toml("[alerts]\nhold_seconds = 0\n").unwrap();
        c.validate().unwrap();
        assert!(!c.alerts.enabled());
    }

    #[test]
    fn siem_needs_a_state_dir_and_tls_material() {
        let c = Config::from_toml("[siem]\naddress = \"127.0.0.1:514\"\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("[siem] needs integrity.state_dir"), "{err}");
        let c = Config::from_toml(
            "[integrity]\nstate_dir = \"/tmp/x\"\n[siem]\naddress = \"siem:6514\"\ntransport = \"relp-tls\"\n",
        )
        .unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("needs ca_file"), "{err}");
        let c =
            Config::from_toml("[integrity]\nstate_dir = \"/tmp/x\"\n[siem]\naddress = \"siem\"\n")
                .unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("is not host:port"), "{err}");
        let c = Config::from_toml(
            "[integrity]\nstate_dir = \"/tmp/x\"\n[siem]\naddress = \"[::1]:6514\"\ntransport = \"tls\"\nca_file = \"ca.pem\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.siem.transport, SiemTransport::Tls);
        let err = Config::from_toml("[siem]\ntransport = \"udp\"\n").unwrap_err();
        assert!(err.contains("udp"), "{err}");
    }

    #[test]
    fn unknown_options_are_named() {
        let err = Config::from_toml("[server]\nsockett = \"/x\"\n").unwrap_err();
        assert!(err.contains("sockett"), "{err}");
    }
}
