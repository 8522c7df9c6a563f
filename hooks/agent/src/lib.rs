//! `probity-agent`: Probity sees the node itself, and enforces the firewall baseline.
//!
//! Why this crate exists: the policies judge facts about each node (its GPUs' heat and
//! driver, its power, the ports it exposes, who elevated privileges after logging in),
//! and those facts must come from the node, be current, and say so when they are not.
//! The agent gathers them with probity-collect and probity-firewall, hands them to the
//! engine, asks the engine, and carries out what the engine answers. It decides nothing
//! itself: every threshold and rule is in the policy directory; the agent only
//! translates readings into entities and obligations into alerts and blocks.
//!
//! Code map:
//! * [`config`] — `probity-agent.toml` (documented in `hooks/agent/probity-agent.toml`),
//!   errors located at file:line:column;
//! * [`sources`] — the [`Sources`] seam (the real node: [`HostSources`]) and what is
//!   remembered per source (last good reading, staleness, `unreadable`);
//! * [`facts`] — readings to the `Node` and `Gpu` entities, attribute by attribute;
//! * [`listen`] — which `listen` questions a cycle asks;
//! * [`findings`] — a deny's reasons as findings, raised, updated, cleared; the active
//!   ones saved in the state directory for the next process ([`findings::saved`]);
//! * [`alerts`] — the Alertmanager and webhook sinks;
//! * [`elevation`] — the audit log reader and its saved position;
//! * [`baseline`] — a role's firewall baseline from the engine's `NodeRole` entities;
//! * [`sshd`] — the ports sshd really listens on (for `baseline apply`);
//! * [`lockout`] — `baseline apply`'s lock-out check: sshd's ports established or the
//!   load refused, and the firewall's verdict on what a script would drop;
//! * [`status`] — the status file and its Prometheus lines;
//! * [`agent`] — [`Agent`]: the cycle, the audit reads, the run loop.
//!
//! Invariants:
//! * a source that is missing, failing or stale is never a zero: its name is in the
//!   node's `unreadable` set (a finding through `thermal.telemetry-unreadable`);
//! * facts the engine owns are never supplied: `blocked` is left out of the node's
//!   entity, and owned context (`powerReadingsW`, `now`, `lastRemoteLoginAt`) is sent
//!   only with [`probity::Request::as_fact_reporter`];
//! * a finding alerts once, is refreshed by the alerter while it holds, and is resolved
//!   when it clears; raising and clearing are recorded with the facts that caused them;
//! * the compliance loop never changes a firewall rule; only `probity baseline apply
//!   --enforce` under `mode = "enforce"` does, and never one that locks out SSH or the
//!   control plane (unless told so explicitly).
//!
//! ```
//! use probity_agent::Config;
//! let config = Config::parse(
//!     "agent.toml",
//!     "[node]\nname = \"gpu-001\"\n[inventory]\nzone = \"z1\"\nrack = \"r1\"\n[collect]\ninterval_seconds = 0\n",
//!     std::path::Path::new("."),
//! );
//! let err = config.unwrap_err().to_string();
//! assert!(err.starts_with("agent.toml:7:20: collect.interval_seconds must be between 1 and"), "{err}");
//! ```

pub mod agent;
pub mod alerts;
pub mod baseline;
pub mod config;
pub mod elevation;
pub mod facts;
pub mod findings;
pub mod listen;
pub mod lockout;
pub mod sources;
pub mod sshd;
pub mod status;

pub use agent::{
    Agent, AgentError, AuditReport, CycleReport, DecisionReport, Progress, build_engine,
    build_engine_with_state, load_entities, thread_cpu_time,
};
pub use config::{Config, ConfigError, FirewallMode, Located};
pub use findings::Finding;
pub use sources::{HostSources, Sources};
pub use status::Status;
