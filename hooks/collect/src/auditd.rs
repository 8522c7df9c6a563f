//! Privilege elevations and the remote logins before them, from the Linux audit log.
//!
//! Why this module exists: Probity denies (and alerts on) a privilege elevation within 5
//! minutes of a remote login by a user not authorized for it. The engine decides; this
//! module produces the facts: for each elevation, who, when (the event's own time), in
//! which session, and when that session logged in remotely, if it did.
//!
//! The path from bytes to facts, each step bounded:
//! * [`record`]: one line → a [`Record`] (type, `audit(SECONDS.MILLIS:SERIAL)`, the kernel's
//!   fields, the sender's `msg='…'` fields, the ENRICHED translations; hex decoded where
//!   auditd encodes; lines capped; errors located by column);
//! * [`event`]: records → [`Event`]s by node, time and serial, closed by `EOE`, by a
//!   complete record set, or by `end_of_event_timeout` in log time or by the reader's
//!   (injected) clock;
//! * [`session`]: events → remote logins per `(auid, ses)` and [`Elevation`]s;
//! * [`follow`]: the sources: the log file followed across rotation and truncation
//!   ([`LogFollower`]) and the audisp plugin protocol on stdin ([`AudispSource`]).
//!
//! **Secrets never leave this module.** EXECVE arguments after argv\[0\], PROCTITLE
//! arguments, sudo's `cmd=` arguments and TTY keystrokes are replaced by a marker while the
//! line is parsed (see [`redact`]); what remains is the program name and, by default, the
//! argument count.
//!
//! ```
//! use std::time::SystemTime;
//! use probity_collect::auditd::{AuditConfig, LineAt, Pipeline};
//!
//! let log = "\
//! type=USER_ACCT msg=audit(1700000000.100:10): pid=42 uid=0 auid=4294967295 ses=4294967295 msg='op=PAM:accounting acct=\"bob\" exe=\"/usr/sbin/sshd\" hostname=10.1.2.3 addr=10.1.2.3 terminal=ssh res=success'
//! type=LOGIN msg=audit(1700000000.200:11): pid=42 uid=0 old-auid=4294967295 auid=1002 tty=(none) old-ses=4294967295 ses=7 res=1
//! type=USER_CMD msg=audit(1700000100.000:12): pid=50 uid=1002 auid=1002 ses=7 msg='cwd=\"/\" cmd=636174202F6574632F736861646F77 exe=\"/usr/bin/sudo\" terminal=pts/0 res=success'\u{1d}UID=\"bob\" AUID=\"bob\"
//! ";
//! let mut pipeline = Pipeline::new(&AuditConfig::default());
//! for (i, line) in log.lines().enumerate() {
//!     let at = LineAt { origin: "example", line: i as u64 + 1, offset: 0 };
//!     pipeline.push_line(line.as_bytes(), at, SystemTime::now()).unwrap();
//! }
//! pipeline.finish();
//! let elevations = pipeline.take_elevations();
//! assert_eq!(elevations.len(), 1);
//! let e = &elevations[0];
//! assert_eq!(e.user, "bob");
//! assert_eq!(e.command.as_ref().unwrap().as_str(), "cat <redacted>");
//! let ctx = e.context();
//! assert_eq!((ctx.now, ctx.last_remote_login_at), (1700000100, Some(1700000000)));
//! ```

use std::time::SystemTime;

use thiserror::Error;

pub mod event;
pub mod follow;
pub mod record;
mod record_type;
pub mod redact;
pub mod session;

pub use event::{Assembler, AssemblyConfig, AssemblyStats, Closure, Event};
pub use follow::{
    AudispSource, FollowConfig, LineReader, LogFollower, Poll, Position, StartAt, StreamLine,
};
pub use record::{
    AuditTime, DEFAULT_MAX_LINE_BYTES, EventId, Field, ParseOptions, Part, Record, RecordError,
    ValueKind, parse_record,
};
pub use record_type::RecordType;
pub use redact::{RedactedCommand, Redaction};
pub use session::{
    Correlator, CorrelatorStats, ElevateContext, Elevation, ElevationKind, LoginEvidence,
    RemoteLogin, Session, SessionConfig,
};

/// Everything the audit collector can be told.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditConfig {
    /// Line cap and redaction ([`ParseOptions`] defaults).
    pub parse: ParseOptions,
    /// Event assembly ([`AssemblyConfig`] defaults).
    pub assembly: AssemblyConfig,
    /// Session correlation ([`SessionConfig`] defaults).
    pub sessions: SessionConfig,
}

/// Where a line came from, for its error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineAt<'a> {
    /// The source: the log's path, or a name for a stream (`stdin`).
    pub origin: &'a str,
    /// 1-based line number (counted from where reading started).
    pub line: u64,
    /// Byte offset of the line's first byte in the source.
    pub offset: u64,
}

/// A line that is not an audit record, located. The rest of the stream is still read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{origin}: line {line} (byte offset {offset})")]
pub struct LineError {
    /// The source.
    pub origin: String,
    /// 1-based line number.
    pub line: u64,
    /// Byte offset of the line.
    pub offset: u64,
    /// What is wrong with it (with the column).
    #[source]
    pub error: RecordError,
}

/// Counters of a [`Pipeline`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Lines taken (blank ones included).
    pub lines: u64,
    /// Lines that parsed.
    pub records: u64,
    /// Lines that did not.
    pub errors: u64,
}

/// Parser, assembler and correlator in one: lines in, elevations out. Both sources feed
/// one of these.
#[derive(Debug)]
pub struct Pipeline {
    options: ParseOptions,
    assembler: Assembler,
    correlator: Correlator,
    elevations: Vec<Elevation>,
    stats: PipelineStats,
}

impl Pipeline {
    /// A pipeline with no session known and no event open.
    pub fn new(config: &AuditConfig) -> Self {
        Self {
            options: config.parse.clone(),
            assembler: Assembler::new(config.assembly.clone()),
            correlator: Correlator::new(config.sessions.clone(), config.parse.redaction.clone()),
            elevations: Vec::new(),
            stats: PipelineStats::default(),
        }
    }

    /// The line cap.
    pub fn max_line_bytes(&self) -> usize {
        self.options.max_line_bytes
    }

    /// Takes one line that arrived at `now` by the reader's clock. A blank line is
    /// skipped; a line that is not a record is an error and changes nothing.
    pub fn push_line(
        &mut self,
        line: &[u8],
        at: LineAt<'_>,
        now: SystemTime,
    ) -> Result<(), LineError> {
        self.stats.lines += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        match parse_record(line, &self.options) {
            Ok(record) => {
                self.stats.records += 1;
                self.push_record(record, now);
                Ok(())
            }
            Err(error) => {
                self.stats.errors += 1;
                Err(LineError {
                    origin: at.origin.to_owned(),
                    line: at.line,
                    offset: at.offset,
                    error,
                })
            }
        }
    }

    /// Takes one parsed record.
    pub fn push_record(&mut self, record: Record, now: SystemTime) {
        self.assembler.push(record, now);
        self.correlate();
    }

    /// Closes events idle for the end-of-event timeout by the reader's clock.
    pub fn tick(&mut self, now: SystemTime) {
        self.assembler.expire(now);
        self.correlate();
    }

    /// Closes every open event (the input ended).
    pub fn finish(&mut self) {
        self.assembler.flush();
        self.correlate();
    }

    fn correlate(&mut self) {
        while let Some(event) = self.assembler.next_event() {
            self.correlator.process(&event, &mut self.elevations);
        }
    }

    /// The elevations found since the last call, in the order their events closed.
    pub fn take_elevations(&mut self) -> Vec<Elevation> {
        std::mem::take(&mut self.elevations)
    }

    /// The session state.
    pub fn correlator(&self) -> &Correlator {
        &self.correlator
    }

    /// The event assembler (for its counters and open events).
    pub fn assembler(&self) -> &Assembler {
        &self.assembler
    }

    /// Counters.
    pub fn stats(&self) -> PipelineStats {
        self.stats
    }
}
