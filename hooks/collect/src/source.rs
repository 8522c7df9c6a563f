//! The frame every collector shares: what a collection returns, how programs are run and
//! files read without trusting them, the power window, and staleness.
//!
//! Why this module exists: the agent must tell three things apart for every source and every
//! cycle — a reading (with the time it was taken), a source that does not exist on this node,
//! and a source that exists but failed. Confusing the last two with a zero reading is how a
//! thermal or power rule silently passes, so each has its own variant here and nothing in the
//! crate turns an absence into `0`.
//!
//! Invariants:
//! * a [`Reading`] always carries its collection time, and [`Reading::freshness`] judges it
//!   against an injected [`Clock`];
//! * a program is run without a shell, with a deadline after which its whole process group
//!   is killed, and with a cap on each output stream ([`CommandSpec`]);
//! * a file is read only if it is a regular file, and only up to a cap
//!   ([`read_regular_file`]): a FIFO or device under a configured root never blocks the agent.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use thiserror::Error;

mod command;
mod file;
mod window;

pub use command::{CommandError, CommandOutput, CommandSpec, Stream};
pub use file::{FileError, read_regular_file};
pub use window::{Baseline, PowerWindow, WindowError};

/// A value that a source printed, or the reason it printed none.
///
/// `[N/A]` is not `0`: a rule that reads a temperature must see that there is none.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<T> {
    /// The source printed a value.
    Present(T),
    /// The source printed a placeholder, or was not asked.
    Absent(Absent),
}

impl<T> Value<T> {
    /// The value, if present.
    pub fn get(&self) -> Option<&T> {
        match self {
            Self::Present(v) => Some(v),
            Self::Absent(_) => None,
        }
    }

    /// Whether there is no value.
    pub fn is_absent(&self) -> bool {
        matches!(self, Self::Absent(_))
    }

    /// The reason for an absent value.
    pub fn absence(&self) -> Option<&Absent> {
        match self {
            Self::Present(_) => None,
            Self::Absent(a) => Some(a),
        }
    }

    pub(crate) fn not_queried() -> Self {
        Self::Absent(Absent::NotQueried)
    }
}

impl<T: Copy> Value<T> {
    /// The value, if present, by copy.
    pub fn value(&self) -> Option<T> {
        self.get().copied()
    }
}

/// Why a field has no value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Absent {
    /// The field was not part of what was asked or printed.
    NotQueried,
    /// The source says there is no value (`[N/A]`, `N/A`, `na`, `no reading`, `NaN`).
    NotAvailable,
    /// The device does not support the field (`[Not Supported]`).
    NotSupported,
    /// The source printed a failure where the value should be (`[Unknown Error]`,
    /// `[GPU is lost]`): the text, verbatim. This is a finding, not just a gap.
    Failed(String),
    /// Another placeholder, verbatim (`[Requested functionality has been deprecated]`,
    /// `[Insufficient Permissions]`).
    Other(String),
}

/// A value and the time it was collected.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading<T> {
    /// What was collected.
    pub value: T,
    /// When the collection finished.
    pub collected_at: SystemTime,
}

impl<T> Reading<T> {
    /// A reading collected at `collected_at`.
    pub fn new(value: T, collected_at: SystemTime) -> Self {
        Self {
            value,
            collected_at,
        }
    }

    /// How fresh this reading is at the clock's `now`, given the largest acceptable age.
    pub fn freshness(&self, max_age: Duration, clock: &dyn Clock) -> Freshness {
        freshness(self.collected_at, max_age, clock.now())
    }

    /// Whether the reading may no longer stand for the present: older than `max_age`, or
    /// stamped in the future (a clock that jumped is not evidence of freshness).
    pub fn is_stale(&self, max_age: Duration, clock: &dyn Clock) -> bool {
        self.freshness(max_age, clock) != Freshness::Fresh
    }
}

/// The result of judging a collection time against a clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// At most the maximum age.
    Fresh,
    /// Older than the maximum age.
    Stale {
        /// How old it is.
        age: Duration,
    },
    /// Stamped after the clock's `now`: a clock moved backwards or the stamp is wrong.
    FromFuture {
        /// How far ahead of `now`.
        ahead: Duration,
    },
}

/// Judges a collection time against `now`.
pub fn freshness(collected_at: SystemTime, max_age: Duration, now: SystemTime) -> Freshness {
    match now.duration_since(collected_at) {
        Ok(age) if age <= max_age => Freshness::Fresh,
        Ok(age) => Freshness::Stale { age },
        Err(e) => Freshness::FromFuture {
            ahead: e.duration(),
        },
    }
}

/// The time source for staleness decisions (tests inject a fixed one): the one clock every
/// Probity crate reads, from `probity-base`.
pub use probity_base::clock::{Clock, SystemClock};

/// Why a source does not exist on this node. Not an error: the node simply lacks it (a CPU
/// node has no `nvidia-smi`, a VM has no BMC and no powercap tree). The agent records it as a
/// finding, never as a zero reading.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// The program is not installed (not found on the path or at the configured path).
    #[error("{program} is not installed")]
    ProgramNotFound {
        /// The program that was looked for.
        program: PathBuf,
    },
    /// A file or directory the source reads does not exist.
    #[error("{path} does not exist")]
    Missing {
        /// The missing path.
        path: PathBuf,
    },
    /// The source exists but this process may not read it.
    #[error("permission denied reading {path}: {hint}")]
    PermissionDenied {
        /// The path that was refused.
        path: PathBuf,
        /// What usually causes it.
        hint: String,
    },
    /// The program runs but the device behind it is absent.
    #[error("{program} has no device: {message}")]
    NoDevice {
        /// The program.
        program: String,
        /// What it said.
        message: String,
    },
    /// Nothing listens at the configured endpoint.
    #[error("nothing answers at {endpoint}")]
    NotListening {
        /// The endpoint.
        endpoint: String,
    },
    /// The source exists but holds nothing to collect (no RAPL package zone, no GPU).
    #[error("{what}")]
    Empty {
        /// What was missing.
        what: String,
    },
}

/// A problem with the bytes themselves, shared by every parser.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InputError {
    /// The input is larger than the parser accepts.
    #[error("input is {len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Input length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The input is not UTF-8.
    #[error("line {line}, column {column} (byte offset {offset}): not UTF-8")]
    NotUtf8 {
        /// 1-based line.
        line: usize,
        /// 1-based byte column.
        column: usize,
        /// Byte offset of the first bad byte.
        offset: usize,
    },
}

/// Why a source that exists failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CollectError {
    /// Running the program failed.
    #[error(transparent)]
    Command(#[from] CommandError),
    /// Reading a file failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// `nvidia-smi --query-gpu` printed something that does not parse.
    #[error("nvidia-smi CSV")]
    NvidiaSmiCsv(#[from] crate::nvidia_smi::CsvError),
    /// `nvidia-smi -q` or `-q -x` printed something that does not parse.
    #[error("nvidia-smi query report")]
    NvidiaSmiReport(#[from] crate::nvidia_smi::ReportError),
    /// The DCGM exporter answered with something that does not parse or map.
    #[error(transparent)]
    Dcgm(#[from] crate::dcgm::DcgmError),
    /// The powercap tree failed.
    #[error(transparent)]
    Rapl(#[from] crate::rapl::RaplError),
    /// `ipmitool` printed something that does not parse.
    #[error("ipmitool output")]
    Ipmi(#[from] crate::ipmi::IpmiError),
    /// A `/proc/net` table does not parse.
    #[error("{path}")]
    ProcNet {
        /// The table.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::sockets::ProcNetError,
    },
}

/// What one collection from one source came to.
#[derive(Debug)]
pub enum Collected<T> {
    /// The source answered.
    Ok(Reading<T>),
    /// The source does not exist on this node.
    Unavailable {
        /// Why.
        reason: Unavailable,
        /// When this was found.
        checked_at: SystemTime,
    },
    /// The source exists but failed or printed garbage.
    Error {
        /// The located error.
        error: CollectError,
        /// When this was found.
        checked_at: SystemTime,
    },
}

/// The status of a collection without its payload, e.g. for a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// A reading.
    Ok,
    /// The source does not exist here.
    Unavailable,
    /// The source failed.
    Error,
}

impl Status {
    /// `ok`, `unavailable` or `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Unavailable => "unavailable",
            Self::Error => "error",
        }
    }
}

impl<T> Collected<T> {
    /// A reading taken now.
    pub fn ok_now(value: T) -> Self {
        Self::Ok(Reading::new(value, SystemTime::now()))
    }

    /// An unavailable source, found now.
    pub fn unavailable_now(reason: Unavailable) -> Self {
        Self::Unavailable {
            reason,
            checked_at: SystemTime::now(),
        }
    }

    /// A failed source, found now.
    pub fn error_now(error: impl Into<CollectError>) -> Self {
        Self::Error {
            error: error.into(),
            checked_at: SystemTime::now(),
        }
    }

    /// The reading, if the source answered.
    pub fn reading(&self) -> Option<&Reading<T>> {
        match self {
            Self::Ok(r) => Some(r),
            _ => None,
        }
    }

    /// The reading by value, if the source answered.
    pub fn into_reading(self) -> Option<Reading<T>> {
        match self {
            Self::Ok(r) => Some(r),
            _ => None,
        }
    }

    /// Ok, unavailable or error.
    pub fn status(&self) -> Status {
        match self {
            Self::Ok(_) => Status::Ok,
            Self::Unavailable { .. } => Status::Unavailable,
            Self::Error { .. } => Status::Error,
        }
    }

    /// When the collection ended, whatever its outcome.
    pub fn at(&self) -> SystemTime {
        match self {
            Self::Ok(r) => r.collected_at,
            Self::Unavailable { checked_at, .. } | Self::Error { checked_at, .. } => *checked_at,
        }
    }

    /// Transforms the payload of a reading, keeping its time.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Collected<U> {
        match self {
            Self::Ok(r) => Collected::Ok(Reading::new(f(r.value), r.collected_at)),
            Self::Unavailable { reason, checked_at } => {
                Collected::Unavailable { reason, checked_at }
            }
            Self::Error { error, checked_at } => Collected::Error { error, checked_at },
        }
    }
}

/// Why a step of a collection gave no value: the source does not exist here, or it failed.
/// [`stamp`] turns it into a [`Collected`].
#[derive(Debug)]
pub enum Failure {
    /// The source does not exist on this node.
    Unavailable(Unavailable),
    /// The source exists and failed.
    Error(CollectError),
}

impl<E: Into<CollectError>> From<E> for Failure {
    fn from(e: E) -> Self {
        Self::Error(e.into())
    }
}

/// Stamps an outcome with the current time.
pub fn stamp<T>(outcome: Result<T, Failure>) -> Collected<T> {
    match outcome {
        Ok(v) => Collected::ok_now(v),
        Err(Failure::Unavailable(reason)) => Collected::unavailable_now(reason),
        Err(Failure::Error(error)) => Collected::error_now(error),
    }
}

/// Runs a command, turning "not installed" into [`Unavailable::ProgramNotFound`].
pub(crate) fn run_command(spec: &CommandSpec) -> Result<CommandOutput, Failure> {
    match spec.run() {
        Ok(out) => Ok(out),
        Err(CommandError::NotFound { program }) => {
            Err(Failure::Unavailable(Unavailable::ProgramNotFound {
                program,
            }))
        }
        Err(e) => Err(Failure::Error(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(SystemTime);
    impl Clock for Fixed {
        fn now(&self) -> SystemTime {
            self.0
        }
    }

    #[test]
    fn staleness_uses_the_injected_clock() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let r = Reading::new(1u8, t0);
        let max = Duration::from_secs(30);
        assert_eq!(
            r.freshness(max, &Fixed(t0 + Duration::from_secs(30))),
            Freshness::Fresh
        );
        assert!(!r.is_stale(max, &Fixed(t0 + Duration::from_secs(30))));
        assert_eq!(
            r.freshness(max, &Fixed(t0 + Duration::from_secs(31))),
            Freshness::Stale {
                age: Duration::from_secs(31)
            }
        );
        assert!(r.is_stale(max, &Fixed(t0 + Duration::from_secs(31))));
    }

    #[test]
    fn a_reading_from_the_future_is_stale() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let r = Reading::new((), t0 + Duration::from_secs(5));
        assert_eq!(
            r.freshness(Duration::from_secs(60), &Fixed(t0)),
            Freshness::FromFuture {
                ahead: Duration::from_secs(5)
            }
        );
        assert!(r.is_stale(Duration::from_secs(60), &Fixed(t0)));
    }

    #[test]
    fn absent_values_have_no_number() {
        let v: Value<f64> = Value::Absent(Absent::NotSupported);
        assert_eq!(v.value(), None);
        assert!(v.is_absent());
        assert_eq!(v.absence(), Some(&Absent::NotSupported));
        assert_eq!(Value::Present(3.5).value(), Some(3.5));
    }

    #[test]
    fn collected_map_keeps_the_time_and_status() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(7);
        let c = Collected::Ok(Reading::new(2, t)).map(|v| v * 10);
        assert_eq!(c.status(), Status::Ok);
        assert_eq!(c.at(), t);
        assert_eq!(c.reading().map(|r| r.value), Some(20));
        let u: Collected<u8> = Collected::Unavailable {
            reason: Unavailable::Missing { path: "/x".into() },
            checked_at: t,
        };
        assert_eq!(u.map(|v| v + 1).status().as_str(), "unavailable");
    }
}
