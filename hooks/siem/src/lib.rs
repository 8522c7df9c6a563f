//! `probity-siem`: carries Probity's audit records out of the process.
//!
//! The engine writes every decision that denies or carries obligations, every block,
//! verification, key event and finding to a durable, hash-chained log. This crate
//! takes them from there:
//!
//! * to a SIEM as RFC 5424 syslog, over TCP (RFC 6587 octet counting), TLS (RFC 5425)
//!   or RELP, **at least once**, in order, resuming from a durable cursor
//!   ([`Forwarder`]; what each transport guarantees is stated in [`forwarder`]);
//! * `alert` obligations to Prometheus Alertmanager's API v2 or a webhook, refreshed
//!   while they hold and resolved when they clear ([`Alerter`]).
//!
//! Its core does not depend on the engine: a log implements [`RecordSource`] and a
//! cursor [`CursorStore`], and both traits have in-memory and file-backed
//! implementations for tests and small programs. The `engine` feature adds the
//! engine's two hash-chained logs as sources (`engine`), which the server and the node
//! agent forward through the same [`SiemSettings`] table.
//!
//! Code map:
//! * `record` — [`Record`], [`RecordKind`], [`Severity`];
//! * `source` — the two traits and their implementations;
//! * `syslog` — record → RFC 5424 message ([`SyslogFormat`]) and a strict parser;
//! * `transport` — TCP/TLS links, octet counting, [`transport::relp`];
//! * `forwarder` — the forwarding thread, its cursor and counters;
//! * `alert` — the alerter and its HTTP sinks;
//! * `settings` — the `[siem]` table ([`SiemSettings`]) both binaries read;
//! * `engine` (feature `engine`) — the engine's logs as sources, a forwarder per log;
//! * `time`, `backoff` — RFC 3339 timestamps and retry delays.
//!
//! ```no_run
//! use std::sync::Arc;
//! use probity_siem::{FileCursor, FileSource, Forwarder, ForwarderConfig, TlsSettings, Transport};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let log = Arc::new(FileSource::open("/var/lib/probity/audit.jsonl".as_ref())?);
//! let cursor = FileCursor::new("/var/lib/probity/siem.cursor".as_ref());
//! let tls = TlsSettings::new("/etc/probity/siem-ca.pem");
//! let forwarder = Forwarder::start(
//!     ForwarderConfig::new("siem.example:6514", Transport::Tls(tls)),
//!     log,
//!     cursor,
//! )?;
//! let stats = forwarder.stats();
//! println!("forwarded {}, backlog {}, behind: {}", stats.forwarded, stats.backlog, stats.behind);
//! # Ok(()) }
//! ```

pub mod alert;
mod backoff;
#[cfg(feature = "engine")]
pub mod engine;
pub mod forwarder;
pub mod record;
pub mod settings;
pub mod source;
pub mod syslog;
pub mod time;
pub mod transport;

pub use alert::{
    Alert, AlertError, AlertSink, AlertSpec, Alerter, AlerterConfig, AlerterStats,
    AlertmanagerSink, HttpSettings, SinkError, WebhookSink,
};
pub use backoff::Backoff;
pub use forwarder::{Forwarder, ForwarderConfig, ForwarderError, ForwarderStats, Transport};
pub use record::{Digest, Record, RecordKind, Severity};
pub use settings::{SiemSettings, SiemTransport};
pub use source::{
    CursorError, CursorStore, FileCursor, FileSource, MemoryCursor, MemorySource, RecordSource,
    SourceError,
};
pub use syslog::{Facility, FormatError, SyslogConfig, SyslogFormat};
pub use transport::{ClientIdentity, TlsConfigError, TlsSettings, TransportError};

/// An error and its causes, joined by `: ` (for `last_error` in the counters).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The longest a configured duration is taken to be: adding more to a clock would
/// overflow it (which panics), and nothing here waits a year on purpose.
const YEAR: std::time::Duration = std::time::Duration::from_secs(365 * 86_400);

/// `t + d`, without overflow.
fn later(t: std::time::Instant, d: std::time::Duration) -> std::time::Instant {
    t.checked_add(d.min(YEAR)).unwrap_or(t)
}

/// Now plus `d`, without overflow.
fn after(d: std::time::Duration) -> std::time::Instant {
    later(std::time::Instant::now(), d)
}

/// `t + d` on the wall clock, without overflow.
fn later_system(t: std::time::SystemTime, d: std::time::Duration) -> std::time::SystemTime {
    t.checked_add(d.min(YEAR)).unwrap_or(t)
}
