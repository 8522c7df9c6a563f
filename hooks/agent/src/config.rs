//! `probity-agent.toml`: what the agent collects, from where, how often, what it does
//! with what it finds, and the facts about the node that no tool can read.
//!
//! Why this module exists: the agent runs unattended on every node, so a typo in its
//! configuration must stop it at start with the file, line and column of the mistake,
//! not make it collect the wrong thing quietly. Every option has a default (documented
//! in `hooks/agent/probity-agent.toml`, which is the reference) except the inventory
//! facts a node cannot know about itself (its zone and rack). Unknown keys are errors.
//!
//! The file is untrusted input like any other: it is read only up to
//! [`MAX_CONFIG_BYTES`], and every error is a [`ConfigError`] located in the file it
//! came from (the agent's file, or the inventory file it names).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use probity_siem::SiemSettings;
use serde::Deserialize;
use thiserror::Error;
use toml::Spanned;

/// Largest configuration (or inventory) file read.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// The product names nvidia-smi and DCGM print, mapped to the `GpuModel` ids of
/// `probity.toml`, used when the configuration has no `[gpu_models]` table.
pub const DEFAULT_GPU_MODELS: &[(&str, &str)] = &[
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),
    ("NVIDIA H100 NVL", "H100"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200"),
];

/// A configuration that cannot be used.
#[derive(Debug, Error)]
#[non_exhaustive]
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
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    #[error("{path} is over the limit of {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        limit: u64,
    },
    /// A value, key or syntax error at a place in the file.
    #[error(transparent)]
    Invalid(#[from] Located),
}

/// A problem at one place of a configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct Located {
    /// The file, as named when it was read.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// Byte offset of the problem.
    pub offset: usize,
    /// What is wrong.
    pub message: String,
}

impl Located {
    fn at(file: &str, text: &str, span: Range<usize>, message: impl Into<String>) -> Self {
        let offset = span.start.min(text.len());
        let (line, column) = line_column(text, offset);
        Self {
            file: file.to_owned(),
            line,
            column,
            offset,
            message: message.into(),
        }
    }
}

/// 1-based line and column (in characters) of byte `offset` of `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut line = 1;
    let mut column = 1;
    for (i, c) in text.char_indices() {
        if i >= offset {
            break;
        }
        if c == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    (line, column)
}

/// What the agent does about the firewall baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FirewallMode {
    /// Read, judge and report; never change a rule (the default).
    #[default]
    Check,
    /// `probity baseline apply --enforce` may load the baseline.
    Enforce,
}

/// Where audit records come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuditSource {
    /// The log file, followed across rotation (the default).
    #[default]
    File,
    /// The audisp plugin protocol on standard input.
    Stdin,
}

/// Where the log is first read from when no position was saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuditStart {
    /// Only what is written after the agent starts (the default).
    #[default]
    End,
    /// The whole file.
    Beginning,
}

/// The facts about the node that the agent cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// The node's zone (a `Zone` entity id).
    pub zone: String,
    /// Its rack.
    pub rack: String,
    /// Its role (a `NodeRole` id from `probity.toml`'s `[roles.*]`), if it has one.
    pub role: Option<String>,
    /// Whether it is meant to carry GPUs.
    pub gpu_node: bool,
    /// The CUDA image it runs.
    pub cuda_image: String,
    /// Its CPU count, when the operator states it; read from `/proc/stat` otherwise.
    pub cpu_count: Option<u32>,
}

/// How often and how long facts live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collect {
    /// Time between the starts of two cycles.
    pub interval: Duration,
    /// Age after which a source's last good reading is stale.
    pub stale_after: Duration,
    /// Length of the power window.
    pub power_window: Duration,
    /// Most `listen` decisions per cycle.
    pub max_listen_decisions: usize,
}

/// A program-backed source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolSource {
    /// Whether it is read.
    pub enabled: bool,
    /// The program.
    pub binary: PathBuf,
    /// Deadline of each run.
    pub timeout: Duration,
}

/// The DCGM exporter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcgmSource {
    /// Its metrics URL; `None` leaves the source off.
    pub url: Option<String>,
    /// Deadline of a scrape.
    pub timeout: Duration,
}

/// The powercap tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaplSource {
    /// Whether it is read.
    pub enabled: bool,
    /// The powercap directory.
    pub root: PathBuf,
    /// Whether DRAM zones are added to the packages.
    pub include_dram: bool,
}

/// The firewall sources and what the agent may do to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Firewall {
    /// Check (default) or enforce.
    pub mode: FirewallMode,
    /// `nft`.
    pub nft: PathBuf,
    /// `iptables-save`.
    pub iptables_save: PathBuf,
    /// `ip6tables-save`.
    pub ip6tables_save: PathBuf,
    /// Whether the iptables dumps are read beside `nft`.
    pub read_iptables: bool,
    /// Deadline of each command.
    pub timeout: Duration,
    /// The control plane the agent connects to, which `apply` must not cut off.
    pub control_plane: Option<SocketAddr>,
}

/// Where alerts go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alerts {
    /// Alertmanager's base URL (API v2).
    pub alertmanager_url: Option<String>,
    /// A webhook URL.
    pub webhook_url: Option<String>,
    /// How often a firing alert is posted again.
    pub refresh: Duration,
    /// How far ahead of each post a firing alert's `endsAt` is.
    pub expiry: Duration,
    /// Deadline of a post.
    pub timeout: Duration,
    /// PEM CAs for `https` URLs.
    pub ca_file: Option<PathBuf>,
    /// How long an elevation's alert stays active.
    pub elevation_hold: Duration,
}

/// The audit log reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Audit {
    /// Whether elevations are read at all.
    pub enabled: bool,
    /// File or stdin.
    pub source: AuditSource,
    /// The log file.
    pub path: PathBuf,
    /// Where a first read starts.
    pub start: AuditStart,
    /// Time between two reads of the log.
    pub poll_interval: Duration,
}

/// The engine the agent decides with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineFiles {
    /// Policy directory; the embedded defaults when `None`.
    pub policies: Option<PathBuf>,
    /// Cedar entity JSON loaded at start (zones, clusters...).
    pub entities: Option<PathBuf>,
    /// Cedar entity JSON of the `User` (and `Group`) entities, loaded at start.
    pub users: Option<PathBuf>,
}

/// The agent's configuration, every default applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The file it was read from (for messages).
    pub origin: String,
    /// The node's name: its `Node` entity id.
    pub node: String,
    /// Facts the agent cannot read.
    pub inventory: Inventory,
    /// Cycle timing.
    pub collect: Collect,
    /// `nvidia-smi`.
    pub nvidia_smi: ToolSource,
    /// DCGM exporter.
    pub dcgm: DcgmSource,
    /// RAPL.
    pub rapl: RaplSource,
    /// `ipmitool`.
    pub ipmi: ToolSource,
    /// The proc filesystem (`/proc/net`, `/proc/stat`, processes).
    pub proc_root: PathBuf,
    /// The firewall.
    pub firewall: Firewall,
    /// Product name → `GpuModel` id.
    pub gpu_models: BTreeMap<String, String>,
    /// Alert sinks.
    pub alerts: Alerts,
    /// The audit log.
    pub audit: Audit,
    /// The engine's files.
    pub engine: EngineFiles,
    /// State directory (events, decision log, status file, audit position).
    pub state_dir: Option<PathBuf>,
    /// Forwarding the decision and event logs to a SIEM (`[siem]`, the server's table).
    pub siem: SiemSettings,
}

// ---------------------------------------------------------------------------------------
// The file as written.

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct Raw {
    node: RawNode,
    inventory: RawInventory,
    collect: RawCollect,
    nvidia_smi: RawTool,
    dcgm: RawDcgm,
    rapl: RawRapl,
    ipmi: RawTool,
    proc: RawProc,
    firewall: RawFirewall,
    gpu_models: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    alerts: RawAlerts,
    audit: RawAudit,
    engine: RawEngine,
    state: RawState,
    siem: Option<Spanned<SiemSettings>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawNode {
    name: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawInventory {
    file: Option<Spanned<PathBuf>>,
    zone: Option<Spanned<String>>,
    rack: Option<Spanned<String>>,
    role: Option<Spanned<String>>,
    gpu_node: Option<Spanned<bool>>,
    cuda_image: Option<Spanned<String>>,
    cpu_count: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawCollect {
    interval_seconds: Option<Spanned<i64>>,
    stale_after_seconds: Option<Spanned<i64>>,
    power_window_seconds: Option<Spanned<i64>>,
    max_listen_decisions: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawTool {
    enabled: Option<bool>,
    binary: Option<PathBuf>,
    timeout_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawDcgm {
    url: Option<Spanned<String>>,
    timeout_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawRapl {
    enabled: Option<bool>,
    root: Option<PathBuf>,
    include_dram: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawProc {
    root: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawFirewall {
    mode: Option<FirewallMode>,
    nft: Option<PathBuf>,
    iptables_save: Option<PathBuf>,
    ip6tables_save: Option<PathBuf>,
    read_iptables: Option<bool>,
    timeout_ms: Option<Spanned<i64>>,
    control_plane: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawAlerts {
    alertmanager_url: Option<Spanned<String>>,
    webhook_url: Option<Spanned<String>>,
    refresh_seconds: Option<Spanned<i64>>,
    expiry_seconds: Option<Spanned<i64>>,
    timeout_ms: Option<Spanned<i64>>,
    ca_file: Option<PathBuf>,
    elevation_hold_seconds: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawAudit {
    enabled: Option<bool>,
    source: Option<AuditSource>,
    path: Option<PathBuf>,
    start: Option<AuditStart>,
    poll_interval_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawEngine {
    policies: Option<PathBuf>,
    entities: Option<PathBuf>,
    users: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawState {
    dir: Option<PathBuf>,
}

/// The inventory file: the `[inventory]` keys at its top level.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawInventoryFile {
    zone: Option<Spanned<String>>,
    rack: Option<Spanned<String>>,
    role: Option<Spanned<String>>,
    gpu_node: Option<Spanned<bool>>,
    cuda_image: Option<Spanned<String>>,
    cpu_count: Option<Spanned<i64>>,
}

/// Parses TOML text into `T`, locating a syntax or shape error.
fn parse_toml<T: serde::de::DeserializeOwned>(file: &str, text: &str) -> Result<T, Located> {
    toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        Located::at(file, text, span, e.message().trim_end().to_owned())
    })
}

/// Reads a configuration-sized file.
fn read_file(path: &Path) -> Result<String, ConfigError> {
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
    let bytes = std::fs::read(path).map_err(read)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge {
            path: path.to_owned(),
            limit: MAX_CONFIG_BYTES,
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        let text = String::from_utf8_lossy(e.as_bytes()).into_owned();
        ConfigError::Invalid(Located::at(
            &path.display().to_string(),
            &text,
            offset..offset,
            "not UTF-8",
        ))
    })
}

/// Checks values against the places they were written.
struct Check<'a> {
    file: &'a str,
    text: &'a str,
}

impl Check<'_> {
    fn err(&self, span: Range<usize>, message: impl Into<String>) -> Located {
        Located::at(self.file, self.text, span, message)
    }

    /// An integer within `lo..=hi`, or the default.
    fn int(
        &self,
        v: &Option<Spanned<i64>>,
        name: &str,
        lo: i64,
        hi: i64,
        default: i64,
    ) -> Result<u64, Located> {
        let n = match v {
            None => default,
            Some(s) => {
                let n = *s.get_ref();
                if n < lo || n > hi {
                    return Err(self.err(
                        s.span(),
                        format!("{name} must be between {lo} and {hi}, not {n}"),
                    ));
                }
                n
            }
        };
        u64::try_from(n).map_err(|_| self.err(0..0, format!("{name} is negative")))
    }

    fn millis(
        &self,
        v: &Option<Spanned<i64>>,
        name: &str,
        default_ms: i64,
    ) -> Result<Duration, Located> {
        self.int(v, name, 1, 3_600_000, default_ms)
            .map(Duration::from_millis)
    }

    fn seconds(
        &self,
        v: &Option<Spanned<i64>>,
        name: &str,
        default: i64,
    ) -> Result<Duration, Located> {
        self.int(v, name, 1, 7 * 86_400, default)
            .map(Duration::from_secs)
    }

    fn url(
        &self,
        v: &Option<Spanned<String>>,
        name: &str,
        https_ok: bool,
    ) -> Result<Option<String>, Located> {
        let Some(s) = v else {
            return Ok(None);
        };
        let u = s.get_ref().trim();
        let ok = u.starts_with("http://") || (https_ok && u.starts_with("https://"));
        if !ok || u.len() <= "http://".len() || u.chars().any(char::is_whitespace) {
            let want = if https_ok {
                "an http:// or https:// URL"
            } else {
                "an http:// URL (the DCGM scrape has no TLS)"
            };
            return Err(self.err(s.span(), format!("{name} must be {want}, not {u:?}")));
        }
        Ok(Some(u.to_owned()))
    }

    /// An id for Cedar and the engine: what a node name may be.
    fn id(&self, s: &Spanned<String>, name: &str) -> Result<String, Located> {
        let v = s.get_ref();
        if !valid_id(v) {
            return Err(self.err(
                s.span(),
                format!(
                    "{name} {v:?} must be 1-253 of A-Z a-z 0-9 - . _, not starting or ending with - or ."
                ),
            ));
        }
        Ok(v.clone())
    }
}

/// Whether `id` is acceptable as a node name (the engine's rule for node ids).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 253
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && !id.starts_with(['-', '.'])
        && !id.ends_with(['-', '.'])
}

impl Config {
    /// Reads and checks a configuration file; relative paths in it (the inventory file)
    /// are taken from the directory it is in.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read_file(path)?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::parse(&path.display().to_string(), &text, &base)
    }

    /// Parses configuration text named `file`; an inventory file it names is read
    /// relative to `base`.
    pub fn parse(file: &str, text: &str, base: &Path) -> Result<Self, ConfigError> {
        let raw: Raw = parse_toml(file, text)?;
        let c = Check { file, text };

        let node = match &raw.node.name {
            Some(n) => c.id(n, "node.name")?,
            None => default_node_name().ok_or_else(|| {
                c.err(
                    0..0,
                    "node.name is not set, NODE_NAME is not set, and the host name is not a valid node name",
                )
            })?,
        };

        let inventory = match &raw.inventory.file {
            Some(f) => {
                let i = &raw.inventory;
                let inline = [
                    i.zone.as_ref().map(Spanned::span),
                    i.rack.as_ref().map(Spanned::span),
                    i.role.as_ref().map(Spanned::span),
                    i.gpu_node.as_ref().map(Spanned::span),
                    i.cuda_image.as_ref().map(Spanned::span),
                    i.cpu_count.as_ref().map(Spanned::span),
                ];
                if let Some(span) = inline.into_iter().flatten().next() {
                    return Err(c
                        .err(
                            span,
                            "inventory.file is set: the inventory facts come from that file, not from here",
                        )
                        .into());
                }
                // `{node}` in the path stands for the node's name: one inventory file
                // per node in one directory (a ConfigMap with a key per node).
                let named = f.get_ref().to_string_lossy().replace("{node}", &node);
                let path = base.join(named);
                let ftext = read_file(&path)?;
                let fname = path.display().to_string();
                let r: RawInventoryFile = parse_toml(&fname, &ftext)?;
                let fc = Check {
                    file: &fname,
                    text: &ftext,
                };
                inventory(
                    &fc,
                    RawInventory {
                        file: None,
                        zone: r.zone,
                        rack: r.rack,
                        role: r.role,
                        gpu_node: r.gpu_node,
                        cuda_image: r.cuda_image,
                        cpu_count: r.cpu_count,
                    },
                    f.span(),
                )?
            }
            None => inventory(&c, raw.inventory, 0..0)?,
        };

        let interval = c.seconds(
            &raw.collect.interval_seconds,
            "collect.interval_seconds",
            15,
        )?;
        let stale_after = c.seconds(
            &raw.collect.stale_after_seconds,
            "collect.stale_after_seconds",
            60,
        )?;
        if stale_after < interval
            && let Some(s) = &raw.collect.stale_after_seconds
        {
            return Err(c
                .err(
                    s.span(),
                    format!(
                        "collect.stale_after_seconds ({}) must be at least collect.interval_seconds ({}): every reading would be stale before the next",
                        stale_after.as_secs(),
                        interval.as_secs()
                    ),
                )
                .into());
        }
        let power_window = c.seconds(
            &raw.collect.power_window_seconds,
            "collect.power_window_seconds",
            600,
        )?;
        let max_listen = c.int(
            &raw.collect.max_listen_decisions,
            "collect.max_listen_decisions",
            1,
            65_536,
            4096,
        )?;

        let tool = |r: &RawTool, name: &str, program: &str, default_on: bool| {
            Ok::<_, Located>(ToolSource {
                enabled: r.enabled.unwrap_or(default_on),
                binary: r.binary.clone().unwrap_or_else(|| PathBuf::from(program)),
                timeout: c.millis(&r.timeout_ms, &format!("{name}.timeout_ms"), 10_000)?,
            })
        };
        let nvidia_smi = tool(
            &raw.nvidia_smi,
            "nvidia_smi",
            "nvidia-smi",
            inventory.gpu_node,
        )?;
        let ipmi = tool(&raw.ipmi, "ipmi", "ipmitool", true)?;
        let dcgm = DcgmSource {
            url: c.url(&raw.dcgm.url, "dcgm.url", false)?,
            timeout: c.millis(&raw.dcgm.timeout_ms, "dcgm.timeout_ms", 2_000)?,
        };
        let rapl = RaplSource {
            enabled: raw.rapl.enabled.unwrap_or(true),
            root: raw
                .rapl
                .root
                .unwrap_or_else(|| PathBuf::from("/sys/class/powercap")),
            include_dram: raw.rapl.include_dram.unwrap_or(false),
        };
        let proc_root = raw.proc.root.unwrap_or_else(|| PathBuf::from("/proc"));

        let control_plane = match &raw.firewall.control_plane {
            None => None,
            Some(s) => Some(s.get_ref().parse::<SocketAddr>().map_err(|_| {
                c.err(
                    s.span(),
                    format!(
                        "firewall.control_plane must be an address and port like \"10.0.0.1:6443\" or \"[fd00::1]:6443\", not {:?}",
                        s.get_ref()
                    ),
                )
            })?),
        };
        let firewall = Firewall {
            mode: raw.firewall.mode.unwrap_or_default(),
            nft: raw
                .firewall
                .nft
                .unwrap_or_else(|| PathBuf::from("/usr/sbin/nft")),
            iptables_save: raw
                .firewall
                .iptables_save
                .unwrap_or_else(|| PathBuf::from("/usr/sbin/iptables-save")),
            ip6tables_save: raw
                .firewall
                .ip6tables_save
                .unwrap_or_else(|| PathBuf::from("/usr/sbin/ip6tables-save")),
            read_iptables: raw.firewall.read_iptables.unwrap_or(true),
            timeout: c.millis(&raw.firewall.timeout_ms, "firewall.timeout_ms", 10_000)?,
            control_plane,
        };

        let gpu_models = match &raw.gpu_models {
            None => DEFAULT_GPU_MODELS
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            Some(table) => {
                let mut out = BTreeMap::new();
                for (product, model) in table.get_ref() {
                    let m = model.get_ref().trim();
                    if m.is_empty() || m.len() > 128 || m.chars().any(char::is_control) {
                        return Err(c
                            .err(
                                model.span(),
                                format!(
                                    "gpu_models: the model id for {product:?} must be 1-128 printable characters"
                                ),
                            )
                            .into());
                    }
                    out.insert(product.clone(), m.to_owned());
                }
                out
            }
        };

        let refresh = c.seconds(&raw.alerts.refresh_seconds, "alerts.refresh_seconds", 60)?;
        let expiry = c.seconds(&raw.alerts.expiry_seconds, "alerts.expiry_seconds", 300)?;
        if refresh >= expiry {
            let span = raw
                .alerts
                .refresh_seconds
                .as_ref()
                .or(raw.alerts.expiry_seconds.as_ref())
                .map_or(0..0, Spanned::span);
            return Err(c
                .err(
                    span,
                    format!(
                        "alerts.refresh_seconds ({}) must be shorter than alerts.expiry_seconds ({}), or alerts expire between refreshes",
                        refresh.as_secs(),
                        expiry.as_secs()
                    ),
                )
                .into());
        }
        let alerts = Alerts {
            alertmanager_url: c.url(
                &raw.alerts.alertmanager_url,
                "alerts.alertmanager_url",
                true,
            )?,
            webhook_url: c.url(&raw.alerts.webhook_url, "alerts.webhook_url", true)?,
            refresh,
            expiry,
            timeout: c.millis(&raw.alerts.timeout_ms, "alerts.timeout_ms", 10_000)?,
            ca_file: raw.alerts.ca_file,
            elevation_hold: c.seconds(
                &raw.alerts.elevation_hold_seconds,
                "alerts.elevation_hold_seconds",
                3600,
            )?,
        };

        let audit = Audit {
            enabled: raw.audit.enabled.unwrap_or(false),
            source: raw.audit.source.unwrap_or_default(),
            path: raw
                .audit
                .path
                .unwrap_or_else(|| PathBuf::from("/var/log/audit/audit.log")),
            start: raw.audit.start.unwrap_or_default(),
            poll_interval: c.millis(&raw.audit.poll_interval_ms, "audit.poll_interval_ms", 1000)?,
        };

        let siem = match raw.siem {
            Some(table) => {
                let span = table.span();
                let siem = table.into_inner();
                siem.check()
                    .map_err(|m| c.err(span.clone(), format!("siem: {m}")))?;
                if siem.address.is_some() && raw.state.dir.is_none() {
                    return Err(c
                        .err(
                            span,
                            "siem needs [state] dir: the logs it forwards and its delivery cursors live there",
                        )
                        .into());
                }
                siem
            }
            None => SiemSettings::default(),
        };

        Ok(Config {
            origin: file.to_owned(),
            node,
            inventory,
            collect: Collect {
                interval,
                stale_after,
                power_window,
                max_listen_decisions: usize::try_from(max_listen).unwrap_or(4096),
            },
            nvidia_smi,
            dcgm,
            rapl,
            ipmi,
            proc_root,
            firewall,
            gpu_models,
            alerts,
            audit,
            engine: EngineFiles {
                policies: raw.engine.policies,
                entities: raw.engine.entities,
                users: raw.engine.users,
            },
            state_dir: raw.state.dir,
            siem,
        })
    }

    /// The `GpuModel` id of a product name: the mapped one, else the name itself (which
    /// the policies then find unknown: a finding, never a guess).
    pub fn gpu_model(&self, product: &str) -> String {
        self.gpu_models
            .get(product.trim())
            .cloned()
            .unwrap_or_else(|| product.trim().to_owned())
    }
}

/// Builds the inventory, requiring zone and rack; `missing_at` locates a missing key (the
/// `file` key when the facts came from a file).
fn inventory(
    c: &Check<'_>,
    r: RawInventory,
    missing_at: Range<usize>,
) -> Result<Inventory, Located> {
    let required = |v: &Option<Spanned<String>>, name: &str| -> Result<String, Located> {
        match v {
            Some(s) if !s.get_ref().trim().is_empty() => Ok(s.get_ref().trim().to_owned()),
            Some(s) => Err(c.err(s.span(), format!("inventory.{name} must not be empty"))),
            None => Err(c.err(
                missing_at.clone(),
                format!("inventory.{name} is required: the agent cannot read it from the node"),
            )),
        }
    };
    let zone = required(&r.zone, "zone")?;
    let rack = required(&r.rack, "rack")?;
    let role = match &r.role {
        None => None,
        Some(s) => {
            let v = s.get_ref();
            let ok = !v.is_empty()
                && v.len() <= 64
                && v.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'));
            if !ok {
                return Err(c.err(
                    s.span(),
                    format!("inventory.role {v:?} must be 1-64 of A-Z a-z 0-9 . _ -"),
                ));
            }
            Some(v.clone())
        }
    };
    let gpu_node = r.gpu_node.as_ref().is_some_and(|b| *b.get_ref());
    let cuda_image = match &r.cuda_image {
        Some(s) => s.get_ref().trim().to_owned(),
        None if gpu_node => {
            return Err(c.err(
                r.gpu_node.as_ref().map_or(missing_at, Spanned::span),
                "inventory.cuda_image is required on a GPU node: the drift rule compares it with the pinned image",
            ));
        }
        None => String::new(),
    };
    let cpu_count = match &r.cpu_count {
        None => None,
        Some(s) => {
            let n = *s.get_ref();
            Some(
                u32::try_from(n)
                    .ok()
                    .filter(|n| (1..=1_048_576).contains(n))
                    .ok_or_else(|| {
                        c.err(
                            s.span(),
                            format!("inventory.cpu_count must be between 1 and 1048576, not {n}"),
                        )
                    })?,
            )
        }
    };
    Ok(Inventory {
        zone,
        rack,
        role,
        gpu_node,
        cuda_image,
        cpu_count,
    })
}

/// `NODE_NAME` (set from `spec.nodeName` in the DaemonSet), else the host name.
fn default_node_name() -> Option<String> {
    let from_env = std::env::var("NODE_NAME").ok().filter(|n| valid_id(n));
    from_env.or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| valid_id(h))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[node]\nname = \"gpu-001\"\n[inventory]\nzone = \"z1\"\nrack = \"r1\"\n";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse("agent.toml", text, Path::new("."))
    }

    fn located(text: &str) -> Located {
        match parse(text) {
            Err(ConfigError::Invalid(l)) => l,
            other => panic!("expected a located error, got {other:?}"),
        }
    }

    #[test]
    fn a_minimal_file_takes_every_default() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.node, "gpu-001");
        assert_eq!(c.collect.interval, Duration::from_secs(15));
        assert_eq!(c.collect.stale_after, Duration::from_secs(60));
        assert_eq!(c.firewall.mode, FirewallMode::Check);
        assert!(!c.nvidia_smi.enabled, "not a GPU node");
        assert!(c.ipmi.enabled && c.rapl.enabled);
        assert_eq!(c.dcgm.url, None);
        assert!(!c.audit.enabled);
        assert_eq!(c.gpu_model("NVIDIA H100 80GB HBM3"), "H100");
        assert_eq!(c.gpu_model("NVIDIA L4"), "NVIDIA L4");
    }

    #[test]
    fn the_documented_file_parses_and_states_the_defaults() {
        let text = include_str!("../probity-agent.toml");
        let c = parse(text).unwrap();
        let d = parse(MINIMAL).unwrap();
        // The reference file shows the defaults: only what it must set differs.
        assert_eq!(c.collect, d.collect);
        assert_eq!(c.firewall, d.firewall);
        assert_eq!(c.alerts, d.alerts);
        assert_eq!(c.audit, d.audit);
        assert_eq!(c.gpu_models, d.gpu_models);
        assert_eq!(c.rapl, d.rapl);
        assert_eq!(c.ipmi, d.ipmi);
    }

    #[test]
    fn a_bad_value_is_located_at_its_line_and_column() {
        let text = format!("{MINIMAL}[collect]\ninterval_seconds = 0\n");
        let l = located(&text);
        assert_eq!((l.line, l.column), (7, 20), "{l}");
        assert!(l.message.contains("between 1 and"), "{l}");
        assert!(l.to_string().starts_with("agent.toml:7:20: "), "{l}");
    }

    #[test]
    fn unknown_keys_and_bad_enums_are_located() {
        let l = located(&format!("{MINIMAL}[firewall]\nmode = \"enforcing\"\n"));
        assert_eq!(l.line, 7, "{l}");
        let l = located(&format!("{MINIMAL}[collect]\nintervall_seconds = 3\n"));
        assert_eq!(l.line, 7, "{l}");
        assert!(l.message.contains("intervall_seconds"), "{l}");
    }

    #[test]
    fn missing_inventory_is_an_error_not_a_default() {
        let l = located("[node]\nname = \"n\"\n[inventory]\nrack = \"r\"\n");
        assert!(l.message.contains("inventory.zone is required"), "{l}");
        let l = located(&format!("{MINIMAL}gpu_node = true\n"));
        assert!(l.message.contains("cuda_image"), "{l}");
        assert_eq!(l.line, 6);
    }

    #[test]
    fn urls_and_addresses_are_checked_where_written() {
        let l = located(&format!(
            "{MINIMAL}[dcgm]\nurl = \"https://x:9400/metrics\"\n"
        ));
        assert_eq!((l.line, l.column), (7, 7), "{l}");
        let l = located(&format!(
            "{MINIMAL}[firewall]\ncontrol_plane = \"10.0.0.1\"\n"
        ));
        assert_eq!(l.line, 7);
        let c = parse(&format!(
            "{MINIMAL}[firewall]\ncontrol_plane = \"[fd00::1]:6443\"\n"
        ))
        .unwrap();
        assert_eq!(
            c.firewall.control_plane,
            Some("[fd00::1]:6443".parse().unwrap())
        );
    }

    #[test]
    fn the_node_name_follows_the_engines_rule() {
        let l = located("[node]\nname = \"-bad\"\n[inventory]\nzone = \"z\"\nrack = \"r\"\n");
        assert_eq!((l.line, l.column), (2, 8), "{l}");
    }

    #[test]
    fn an_inventory_file_replaces_the_inline_keys_and_its_errors_name_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("inv-n.toml"),
            "zone = \"z9\"\nrack = \"r9\"\nrole = \"gpu-worker\"\ngpu_node = true\ncuda_image = \"img\"\n",
        )
        .unwrap();
        let text = "[node]\nname = \"n\"\n[inventory]\nfile = \"inv-{node}.toml\"\n";
        std::fs::write(dir.path().join("agent.toml"), text).unwrap();
        let c = Config::from_file(&dir.path().join("agent.toml")).unwrap();
        assert_eq!(c.inventory.zone, "z9");
        assert_eq!(c.inventory.role.as_deref(), Some("gpu-worker"));
        assert!(
            c.nvidia_smi.enabled,
            "a GPU node reads nvidia-smi by default"
        );

        std::fs::write(dir.path().join("inv-n.toml"), "zone = \"z9\"\nrack = 7\n").unwrap();
        match Config::from_file(&dir.path().join("agent.toml")) {
            Err(ConfigError::Invalid(l)) => {
                assert!(l.file.ends_with("inv-n.toml"), "{l}");
                assert_eq!(l.line, 2, "{l}");
            }
            other => panic!("{other:?}"),
        }
        let both = "[node]\nname = \"n\"\n[inventory]\nfile = \"inv-{node}.toml\"\nzone = \"z\"\n";
        let l = located(both);
        assert_eq!(l.line, 5, "{l}");
    }

    #[test]
    fn refresh_must_be_shorter_than_expiry() {
        let l = located(&format!("{MINIMAL}[alerts]\nrefresh_seconds = 300\n"));
        assert_eq!(l.line, 7);
    }
}
