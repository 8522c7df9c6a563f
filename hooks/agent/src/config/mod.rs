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
use std::path::PathBuf;
use std::time::Duration;

use probity_siem::SiemSettings;
use serde::Deserialize;

mod check;
mod error;
mod parse;
#[cfg(test)]
mod tests;

pub use check::valid_id;
pub use error::{ConfigError, Located};

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
