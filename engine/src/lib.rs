//! Probity: a policy, compliance and data-integrity engine for GPU clusters.
//!
//! Callers ask an [`Engine`] "may this happen?" with a [`Request`] and get a
//! [`Decision`]: allow or deny, the [`Reason`]s (policy id, message, severity), the
//! [`Obligation`]s the caller must carry out (block a node, alert, migrate...) and any
//! errors. Policies are Cedar files under a directory with a schema
//! (`probity.cedarschema`) and a thresholds file (`probity.toml`); the engine
//! validates them strictly, keeps an entity store of cluster facts, and hot-reloads
//! the set when files change ([`Engine::watch`]).
//!
//! A tour:
//!
//! ```
//! use probity::{Engine, Request};
//! use serde_json::json;
//!
//! let engine = Engine::from_embedded_defaults()?;
//! // Cluster facts: a zone and a node whose hottest A100 runs at 71 C.
//! engine.upsert_entities(&json!([
//!   {"uid": {"type": "Cluster", "id": "onprem"}, "attrs": {"gpusTotal": 64, "gpusAllocated": 10}, "parents": []},
//!   {"uid": {"type": "Zone", "id": "z1"}, "parents": [],
//!    "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}}, "powerDrawW": 1000, "powerCeilingW": 10000}},
//!   {"uid": {"type": "Node", "id": "gpu-001"}, "parents": [],
//!    "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z1"}}, "rack": "r1",
//!      "driverVersion": "590.48.01", "cudaImage": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
//!      "gpuNode": true, "gpuModel": {"__entity": {"type": "GpuModel", "id": "A100"}}, "gpuCount": 8,
//!      "cpuCount": 64, "gpuMemoryMiB": 81920, "hottestGpuTempC": 71,
//!      "powerDrawW": 3000, "powerWindowMeanW": 2900}}
//! ]))?;
//! let request = Request::from_json_slice(
//!     br#"{"principal": "Node::\"gpu-001\"", "action": "comply", "resource": "Node::\"gpu-001\""}"#)?;
//! let decision = engine.decide(&request);
//! assert!(!decision.is_allowed());
//! assert_eq!(decision.reasons[0].policy, "thermal.gpu-over-temperature");
//! assert_eq!(decision.obligations[0].kind, "alert");
//! assert_eq!(decision.obligations[0].target.as_deref(), Some(r#"Node::"gpu-001""#));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

pub mod audit;
mod block;
mod bundle;
mod clock;
mod conformance;
mod conventions;
mod decision;
mod decision_log;
mod diagnostic;
mod engine;
mod error;
mod facts;
mod fanout;
mod guard;
mod hashing;
pub mod integrity;
pub mod keys;
mod modes;
/// For the fuzz target `mode_tables`; not part of the API.
#[cfg(feature = "fuzzing")]
pub use modes::fuzzing as modes_fuzzing;
mod plugin;
mod recorded;
/// For the fuzz target `plugins_toml`; not part of the API.
#[cfg(feature = "fuzzing")]
pub use plugin::fuzzing as plugin_fuzzing;
pub mod policy_seal;
mod request;
pub mod scenario;
mod settings;
mod slice;
mod source;
pub mod state;
mod store;
#[cfg(test)]
mod testing;
mod trust;
mod watch;

pub use clock::{Clock, ManualClock, SystemClock};

/// The cores this process may use, asked once: `available_parallelism` reads the
/// cgroup's files on every call, which cost a fan-out of one resource (every cached
/// authorization) more than the decision itself. A CPU quota changed while the
/// process runs is seen after a restart.
pub(crate) fn available_cores() -> std::num::NonZeroUsize {
    static CORES: std::sync::OnceLock<std::num::NonZeroUsize> = std::sync::OnceLock::new();
    *CORES
        .get_or_init(|| std::thread::available_parallelism().unwrap_or(std::num::NonZeroUsize::MIN))
}
pub use block::{
    BlockEvent, BlockRecord, ReaderPod, ReaderPodError, STOP_NODE, STOP_READER, TAINT_EFFECTS,
};
pub use conventions::{Conventions, PortProtocol, PortSet, Restrictions, VerifiedRead};
pub use decision::{Decision, DecisionError, Effect, Notice, Obligation, Reason, Severity};
pub use decision_log::Settled;
pub use diagnostic::SourceDiagnostic;
pub use engine::{
    DecideOptions, Engine, EngineBuilder, EntitiesByReference, PolicyStatus, ShadowSet,
};
pub use error::{EntityError, LoadError, RequestError, WatchError};
pub use facts::EntityOwner;
pub use fanout::{DecisionCache, DecisionCacheStats};
/// For the decision cache's differential test, which must be seen failing; not an API.
#[cfg(feature = "bench-hooks")]
pub use fanout::{Invalidation as __Invalidation, skip_invalidation as __skip_invalidation};
pub use modes::{Mode, ModeChange, PolicyModes, ScopedMode};
pub use plugin::PluginInfo;
/// For the plugin benchmark; not an API.
#[cfg(feature = "bench-hooks")]
pub use plugin::compile_uncached as __compile_plugin_uncached;
pub use request::{EntityUid, ParsedRequests, ParsedRequestsStats, Request};
pub use settings::{SettingInfo, Settings, SettingsSchema};
pub use watch::{ReloadEvent, ReloadOutcome, ReloadTrigger, ReloadWatcher, Settle, Sleeper};
