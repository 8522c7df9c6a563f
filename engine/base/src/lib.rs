//! The small utilities every Probity crate shares, written once.
//!
//! Why this crate exists: the engine, the keyring, the collectors, the SIEM forwarder and
//! the servers each needed a clock, an RFC 3339 timestamp, a check of trust files and a
//! Prometheus text writer, and each had grown its own (issue 29). They live here, in a leaf
//! crate that depends on no other Probity crate, so that a crate which must not depend on
//! the engine (`probity-collect`, `probity-keys`) can still share them.
//!
//! Code map:
//! * [`clock`] — the [`Clock`] trait, the [`SystemClock`] and the [`ManualClock`] of tests;
//! * [`time`] — RFC 3339 in UTC and the proleptic Gregorian calendar arithmetic under it;
//! * [`trust`] — trust material on disk: created tight, refused when others can change it;
//! * [`error`] — an error and its causes on one line (`error::chain`).
//! * [`prometheus`] — the Prometheus text exposition format, written.
//! * [`systemd`] — readiness for `Type=notify` services (`$NOTIFY_SOCKET`).
//!
//! Invariant: nothing here knows about policies, keys or wire protocols.
//!
//! ```
//! use probity_base::{Clock, ManualClock};
//! let clock = ManualClock::at(1_772_357_405);
//! assert_eq!(probity_base::time::Rfc3339::seconds(clock.now_unix()).to_string(), "2026-03-01T09:30:05Z");
//! ```

pub mod clock;
pub mod error;
pub mod prometheus;
pub mod systemd;
pub mod time;
pub mod trust;

pub use clock::{Clock, ManualClock, SystemClock};
