//! Where records come from and where delivery progress is kept: the two small traits
//! through which this crate reads the engine's audit log without depending on it.
//!
//! [`RecordSource`] is the log, read by sequence number; [`CursorStore`] keeps the
//! highest sequence number a receiver is known to hold. Both have an in-memory
//! implementation and a simple file-backed one (for tests, the example binaries and
//! programs without the engine); the engine implements them over its own store.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::record::Record;

mod file;
mod memory;

pub use file::{FileCursor, FileSource, MAX_LINE, parse_cursor, parse_line};
pub use memory::{MemoryCursor, MemorySource};

/// The audit log, read in order. Implementations must be cheap to read concurrently
/// with appends: the forwarder reads from its own thread and must never hold up the
/// code that appends.
pub trait RecordSource: Send + Sync {
    /// Up to `limit` records with `seq >= from_seq`, in ascending order of `seq`.
    /// Returns an empty vector when there is none yet.
    fn read(&self, from_seq: u64, limit: usize) -> Result<Vec<Record>, SourceError>;

    /// The highest sequence number in the log (0 when empty).
    fn newest_seq(&self) -> Result<u64, SourceError>;

    /// Blocks until a record with `seq >= seq` exists or `timeout` passes, without
    /// spinning; returns whether one exists. Spurious early returns are allowed.
    fn wait_for(&self, seq: u64, timeout: Duration) -> bool;
}

/// The durable delivery cursor: the highest sequence number delivered (0 = none).
pub trait CursorStore: Send {
    /// The stored cursor (0 if none was ever stored).
    fn load(&self) -> Result<u64, CursorError>;
    /// Stores `seq` durably before returning.
    fn store(&mut self, seq: u64) -> Result<(), CursorError>;
}

impl<T: CursorStore + ?Sized> CursorStore for Box<T> {
    fn load(&self) -> Result<u64, CursorError> {
        (**self).load()
    }
    fn store(&mut self, seq: u64) -> Result<(), CursorError> {
        (**self).store(seq)
    }
}

/// A record source failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The log file could not be read or written.
    #[error("cannot access the record log {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line of the log file does not hold a record.
    #[error("{path}:{line}: byte offset {offset}: {problem}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// Byte offset of the line's start.
        offset: u64,
        /// What is wrong.
        problem: String,
    },
    /// Records must be appended with increasing sequence numbers.
    #[error("record {seq} appended after record {last}: sequence numbers must increase")]
    OutOfOrder {
        /// The record offered.
        seq: u64,
        /// The last record in the log.
        last: u64,
    },
    /// Another implementation's failure.
    #[error("{0}")]
    Other(String),
}

/// A cursor store failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CursorError {
    /// The cursor file could not be read or written.
    #[error("cannot access the cursor file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The cursor file does not hold a cursor.
    #[error("{path}: byte offset {offset}: {problem}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Where the problem is.
        offset: usize,
        /// What is wrong.
        problem: &'static str,
    },
    /// Another implementation's failure.
    #[error("{0}")]
    Other(String),
}
