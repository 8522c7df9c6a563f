//! The node agent's telemetry collectors.
//!
//! Why this crate exists: the engine judges facts about each node (GPU temperatures, power
//! draw, driver versions, listening sockets), and those facts come from tools and files that
//! differ between drivers, vendors and kernels. Each collector here pairs a **source** (runs
//! a program or reads a file, bounded in time and bytes) with a **parser** of untrusted bytes
//! (bounded in size, never panicking, failing with an error that says where). It returns plain
//! Rust values: the agent loop turns them into engine facts, so this crate does not depend
//! on the engine.
//!
//! Every collection ends in a [`Collected`]: a [`Reading`] stamped with its collection time,
//! or [`Collected::Unavailable`] (the source does not exist on this node: no `nvidia-smi`, no
//! BMC, no powercap tree), or [`Collected::Error`] (it exists but failed or printed garbage).
//! A missing source or field is never a zero reading: fields that a tool prints as `[N/A]`
//! become [`Value::Absent`].
//!
//! Code map:
//! * [`source`] — the common frame: [`Reading`], [`Collected`], the command runner, the
//!   capped regular-file reader, the power window and staleness;
//! * [`nvidia_smi`] — `--query-gpu` CSV, `-q -x` XML and `-q` text;
//! * [`dcgm`] — Prometheus text exposition and the DCGM exporter's per-GPU mapping, scraped
//!   over plain HTTP;
//! * [`rapl`] — the powercap sysfs tree and an energy-counter sampler;
//! * [`ipmi`] — `ipmitool` (and FreeIPMI) power readings and sensor tables;
//! * [`sockets`] — listening sockets from `/proc/net/{tcp,tcp6,udp,udp6}`.
//!
//! ```
//! use probity_collect::nvidia_smi::{self, Columns};
//! let csv = b"index, uuid, temperature.gpu, power.draw [W]\n0, GPU-1, 41, [N/A]\n";
//! let gpus = nvidia_smi::parse_query_gpu(csv, Columns::Header).unwrap();
//! assert_eq!(gpus[0].temperature_c.value(), Some(41.0));
//! assert!(gpus[0].power.is_absent()); // [N/A] is no reading, not 0 W
//! ```

pub mod auditd;
pub mod dcgm;
pub mod ipmi;
pub mod nvidia_smi;
pub mod rapl;
pub mod sockets;
pub mod source;
mod text;

pub use source::{
    Absent, Clock, CollectError, Collected, Freshness, Reading, SystemClock, Unavailable, Value,
};
