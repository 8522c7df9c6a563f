//! Why the state store failed or refused a change.

use std::path::PathBuf;

use thiserror::Error;

use crate::trust::TrustError;

/// Why the state store failed or refused a change.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StateError {
    /// The state directory could not be created.
    #[error("cannot create state directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The state directory or database could not be created tight, or others could
    /// change it: it is not trusted.
    #[error(transparent)]
    Untrusted(#[from] TrustError),
    /// The database failed.
    #[error("state database {path} failed while {operation}")]
    Database {
        /// Database file.
        path: PathBuf,
        /// What was being done.
        operation: &'static str,
        /// The database error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A record in the database is malformed.
    #[error("state database {path} holds a malformed {table} record for {key:?}")]
    Corrupt {
        /// Database file.
        path: PathBuf,
        /// Table name.
        table: &'static str,
        /// Record key.
        key: String,
    },
    /// A lower version than the accepted one.
    #[error(
        "refusing rollback of {object_id:?} to version {offered}: version {accepted} was already accepted"
    )]
    Rollback {
        /// Object id.
        object_id: String,
        /// Version offered.
        offered: u64,
        /// Highest version accepted.
        accepted: u64,
    },
    /// A compare-and-swap lost: the record changed since it was read.
    #[error(
        "{what} {key:?} changed since it was read (expected revision {expected:?}, found {found:?})"
    )]
    Conflict {
        /// What kind of record.
        what: &'static str,
        /// Its key.
        key: String,
        /// The revision the writer expected (`None`: absent).
        expected: Option<u64>,
        /// The revision found (`None`: absent).
        found: Option<u64>,
    },
    /// The accepted version with a different manifest digest.
    #[error(
        "refusing a different manifest for {object_id:?} version {version}: another digest was accepted for it"
    )]
    DigestConflict {
        /// Object id.
        object_id: String,
        /// Version.
        version: u64,
    },
    /// A shared backend (etcd) failed or could not be reached.
    #[error("shared state ({backend}) failed while {operation}")]
    Shared {
        /// What and where (`etcd http://10.0.0.5:2379 /probity/`).
        backend: String,
        /// What was being done.
        operation: &'static str,
        /// The backend's error (which endpoint, which key, whether it may have applied).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A change is durable in the shared backend, but this process's engine has not
    /// applied it within the read-your-writes bound: its watch lags or is cut off.
    #[error(
        "the change is durable in the shared state (revision {revision}) but this process has not applied it within {waited:?}; it will once its watch catches up"
    )]
    NotYetApplied {
        /// The backend's revision of the change.
        revision: u64,
        /// How long this process waited.
        waited: std::time::Duration,
    },
}
