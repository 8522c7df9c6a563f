//! The server's configuration: a TOML file (see `probity-server.toml` beside this crate,
//! which documents every option with its default) that command-line flags override.

use std::path::{Path, PathBuf};

use serde::Deserialize;

mod kubernetes;
mod serving;
mod sinks;
mod slurm;
mod state;

pub use kubernetes::{
    AdmissionConfig, SchedulerConfig, UnknownKinds, UnknownNodes, UnknownSchedulerNodes,
};
pub use serving::{AuthConfig, ClientAuth, LimitsConfig, ServerConfig};
pub use sinks::{AlertsConfig, SiemConfig, SiemTransport};
pub use slurm::{JobSource, SlurmConfig, SlurmNamespace, UnknownJobs};
pub use state::{
    AuditConfig, CheckpointSigner, DecisionLogConfig, IntegrityConfig, KeysConfig, NODE_NAME_ENV,
    StateBackendKind, StateConfig, StateRole,
};

use sinks::validate_siem;

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
    /// Slurm jobs as workloads: `job_submit`, the Prolog, jobs as readers.
    pub slurm: SlurmConfig,
}

/// The policy set.
#[derive(Debug, Clone, Deserialize, PartialEq)]
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
    /// A candidate policy directory decided beside the live set on sampled requests,
    /// off the hot path, its disagreements counted (`GET /v1/policy/shadow`, metrics).
    /// Its schema must be the live set's. It never answers. Default: none.
    pub shadow: Option<PathBuf>,
    /// One decision in this many is decided again under the shadow set. Default 100.
    pub shadow_sample_every: u32,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            dir: None,
            entities: None,
            sealed: false,
            seal_name: None,
            shadow: None,
            shadow_sample_every: 100,
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
        self.slurm.validate()?;
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
        let text = include_str!("../../probity-server.toml");
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
    fn slurm_values_are_checked_naming_the_key() {
        let c = Config::from_toml("[slurm]\nclass = [\"comment:class\", \"account\"]\nnamespace = \"account\"\ngpu_memory = \"comment:gpu_mem_mib\"\nunknown_job = \"allow\"\n").unwrap();
        c.validate().unwrap();
        assert_eq!(c.slurm.namespace, SlurmNamespace::Account);
        assert_eq!(
            c.slurm.gpu_memory,
            Some(JobSource::Comment("gpu_mem_mib".into()))
        );
        assert_eq!(c.slurm.unknown_job, UnknownJobs::Allow);
        for (text, expected) in [
            (
                "[slurm]\nclass = [\"features\"]\n",
                "\"features\" is not a job source",
            ),
            (
                "[slurm]\nclass = [\"comment:\"]\n",
                "the comment key must be",
            ),
            ("[slurm]\nnamespace = \"qos\"\n", "qos"),
            ("[slurm]\nunknown_job = \"warn\"\n", "warn"),
            ("[slurm]\nclas = []\n", "clas"),
        ] {
            let err = Config::from_toml(text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
        for (text, expected) in [
            (
                "[slurm]\ngpu_gres = \"gpu:a100\"\n",
                "[slurm] gpu_gres: \"gpu:a100\" is not a GRES name",
            ),
            (
                "[slurm]\nreader_namespace = \"Slurm\"\n",
                "[slurm] reader_namespace: \"Slurm\" is not a namespace name",
            ),
            (
                "[slurm]\nremember_seconds = 0\n",
                "[slurm] remember_seconds: must be positive",
            ),
            (
                "[slurm]\nclass = []\n",
                "[slurm] class: no source and no default_class",
            ),
        ] {
            let err = Config::from_toml(text)
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
        // No source but a default: every job is of that class.
        Config::from_toml("[slurm]\nclass = []\ndefault_class = \"batch\"\n")
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn unknown_options_are_named() {
        let err = Config::from_toml("[server]\nsockett = \"/x\"\n").unwrap_err();
        assert!(err.contains("sockett"), "{err}");
    }
}
