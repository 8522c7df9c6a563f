//! What went wrong talking to etcd, said so that an operator can act on it: which endpoint,
//! which operation on which key, and whether the write may have happened anyway.
//!
//! Why this module exists: etcd-client reports a bare gRPC status whose text rarely names the
//! member it came from, and a caller of a compare-and-swap must know whether a failed request
//! may still have been applied. Every failure here is classified once ([`Class`]) and that
//! class decides, in one place, whether the client retries on another endpoint.

use std::error::Error as _;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;
use tonic::Code;

/// The etcd operation that failed (for messages and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// Reading one key.
    Get,
    /// Reading a prefix, page by page.
    List,
    /// Writing one key.
    Put,
    /// Writing several keys in transactions.
    PutBatch,
    /// Deleting one key.
    Delete,
    /// A compare-and-swap transaction.
    Txn,
    /// Compacting the history.
    Compact,
    /// Granting a lease.
    LeaseGrant,
    /// Renewing a lease.
    LeaseKeepAlive,
    /// Revoking a lease.
    LeaseRevoke,
    /// Asking a lease's remaining time.
    LeaseTimeToLive,
    /// Watching a prefix.
    Watch,
    /// Asking a member's status.
    Status,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Get => "get",
            Self::List => "list",
            Self::Put => "put",
            Self::PutBatch => "batched put",
            Self::Delete => "delete",
            Self::Txn => "compare-and-swap",
            Self::Compact => "compact",
            Self::LeaseGrant => "lease grant",
            Self::LeaseKeepAlive => "lease keep-alive",
            Self::LeaseRevoke => "lease revoke",
            Self::LeaseTimeToLive => "lease time-to-live",
            Self::Watch => "watch",
            Self::Status => "status",
        })
    }
}

/// Why one attempt at one endpoint failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum AttemptError {
    /// etcd or the transport answered with an error.
    Etcd(etcd_client::Error),
    /// No answer within the request timeout.
    TimedOut(Duration),
}

impl fmt::Display for AttemptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Etcd(e) => f.write_str(&describe(e)),
            Self::TimedOut(d) => write!(f, "no answer within {d:?}"),
        }
    }
}

// The whole chain is flattened into Display (gRPC statuses carry their cause in an opaque
// source that renders badly), so there is no source here: a message never repeats its cause.
impl std::error::Error for AttemptError {}

impl AttemptError {
    /// The gRPC status code, when etcd or the transport produced one.
    pub fn code(&self) -> Option<Code> {
        match self {
            Self::Etcd(etcd_client::Error::GRpcStatus(s)) => Some(s.code()),
            _ => None,
        }
    }
}

/// The last failure seen at one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointFailure {
    /// The endpoint URL.
    pub endpoint: String,
    /// What failed there, flattened to text.
    pub reason: String,
}

/// Why an etcd operation failed or was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The configuration cannot work.
    #[error("invalid etcd configuration: {field}: {problem}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A TLS file could not be read.
    #[error("cannot read the etcd {what} {path}")]
    ReadFile {
        /// Which file (CA bundle, client certificate, client key).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A TLS file that others may write, which an attacker could swap.
    #[error("refusing the etcd {what} {path}: mode {mode:o} lets group or others write it")]
    InsecureFile {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// An endpoint URL tonic does not accept.
    #[error("invalid etcd endpoint {endpoint:?}")]
    Endpoint {
        /// The endpoint as configured.
        endpoint: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// etcd refused the request, or failed in a way retrying cannot fix (permission, TLS,
    /// invalid argument, database full).
    #[error("etcd {operation} of {key:?} failed at {endpoint}")]
    Request {
        /// The endpoint that answered.
        endpoint: String,
        /// The operation.
        operation: Operation,
        /// The key or prefix, relative to the configured prefix.
        key: String,
        /// What etcd said.
        #[source]
        source: AttemptError,
    },
    /// A write that may or may not have been applied (the connection broke or the request
    /// timed out after it was sent). Read the key again before deciding anything.
    #[error(
        "etcd {operation} of {key:?} at {endpoint} has an unknown outcome: it may have been applied; read the key again"
    )]
    OutcomeUnknown {
        /// The endpoint it was sent to.
        endpoint: String,
        /// The operation.
        operation: Operation,
        /// The key, relative to the configured prefix.
        key: String,
        /// What broke.
        #[source]
        source: AttemptError,
    },
    /// No endpoint answered within the retry budget.
    #[error("etcd unavailable for {operation} of {key:?} after {elapsed:?}: {}", render_failures(.failures))]
    Unavailable {
        /// The operation.
        operation: Operation,
        /// The key or prefix, relative to the configured prefix.
        key: String,
        /// How long the client tried.
        elapsed: Duration,
        /// The last failure at each endpoint tried.
        failures: Vec<EndpointFailure>,
    },
    /// etcd returned a key that is not under the configured prefix or not UTF-8. Nothing in
    /// Probity writes such a key: someone else did, and the state is not trusted.
    #[error("etcd returned a malformed key {key}")]
    MalformedKey {
        /// The key, escaped.
        key: String,
        /// Why it is malformed.
        #[source]
        source: crate::key::KeyError,
    },
    /// The revision asked for was compacted away.
    #[error(
        "etcd {operation} of {key:?} asked for revision {requested}, compacted away (history starts at {compact_revision})"
    )]
    Compacted {
        /// The operation.
        operation: Operation,
        /// The key or prefix, relative to the configured prefix.
        key: String,
        /// The revision asked for.
        requested: i64,
        /// The oldest revision etcd still has.
        compact_revision: i64,
    },
    /// A thread could not be started.
    #[error("cannot start the {what} thread")]
    Spawn {
        /// Which thread.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The lease does not exist (expired or revoked).
    #[error("etcd lease {id:x} does not exist (expired or revoked)")]
    LeaseNotFound {
        /// Lease id.
        id: i64,
    },
    /// etcd answered without a field the protocol promises.
    #[error("etcd {operation} of {key:?} at {endpoint}: response lacks {what}")]
    Protocol {
        /// The endpoint.
        endpoint: String,
        /// The operation.
        operation: Operation,
        /// The key.
        key: String,
        /// What is missing.
        what: &'static str,
    },
}

impl EtcdError {
    /// Whether the failure is about reaching etcd (retry later, report not ready) rather than
    /// about the request itself.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. } | Self::OutcomeUnknown { .. })
    }

    /// Whether a write may have been applied despite the error.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Self::OutcomeUnknown { .. })
    }
}

fn render_failures(failures: &[EndpointFailure]) -> String {
    if failures.is_empty() {
        return "no endpoint was tried".into();
    }
    failures
        .iter()
        .map(|f| format!("{}: {}", f.endpoint, f.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a failed attempt means for retrying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Certainly not applied (no connection, no leader, rate-limited): retry anywhere.
    NotApplied,
    /// Maybe applied (timeout, broken stream): retry only what is safe to repeat.
    Ambiguous,
    /// Retrying cannot help.
    Fatal,
}

/// Classifies an etcd-client error.
pub(crate) fn classify(e: &etcd_client::Error) -> Class {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) => classify_status(s),
        E::TransportError(_) | E::IoError(_) => Class::NotApplied,
        E::WatchError(_) | E::LeaseKeepAliveError(_) => Class::Ambiguous,
        _ => Class::Fatal,
    }
}

fn classify_status(s: &tonic::Status) -> Class {
    if is_tls_failure(s) {
        return Class::Fatal;
    }
    let message = s.message();
    match s.code() {
        Code::Unavailable => {
            if is_connect_failure(s)
                || message.contains("no leader")
                || message.contains("too many requests")
                || message.contains("not capable")
            {
                Class::NotApplied
            } else {
                Class::Ambiguous
            }
        }
        Code::ResourceExhausted if message.contains("too many requests") => Class::NotApplied,
        Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Unknown
        | Code::Aborted
        | Code::Internal => Class::Ambiguous,
        _ => Class::Fatal,
    }
}

/// The connection could not be made: nothing was sent.
fn is_connect_failure(s: &tonic::Status) -> bool {
    let mut source = s.source();
    while let Some(e) = source {
        if e.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        source = e.source();
    }
    false
}

/// A TLS handshake or certificate failure: retrying with the same credentials cannot help.
fn is_tls_failure(s: &tonic::Status) -> bool {
    let text = describe_status(s).to_ascii_lowercase();
    [
        "certificate",
        "tls handshake",
        "alert",
        "invalid peer",
        "unknownissuer",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// One line: the status code, its message and every distinct cause below it.
pub(crate) fn describe(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) => describe_status(s),
        other => chain(other),
    }
}

fn describe_status(s: &tonic::Status) -> String {
    let mut out = format!("{:?}", s.code());
    let mut seen = Vec::new();
    push_distinct(&mut out, &mut seen, s.message());
    let mut source = s.source();
    while let Some(e) = source {
        push_distinct(&mut out, &mut seen, &e.to_string());
        source = e.source();
    }
    out
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut out = String::new();
    let mut seen = Vec::new();
    push_distinct(&mut out, &mut seen, &e.to_string());
    let mut source = e.source();
    while let Some(e) = source {
        push_distinct(&mut out, &mut seen, &e.to_string());
        source = e.source();
    }
    out
}

/// Appends `part` unless an earlier part already says it (wrappers often repeat their cause).
fn push_distinct(out: &mut String, seen: &mut Vec<String>, part: &str) {
    let part = part.trim();
    if part.is_empty() || seen.iter().any(|s| s.contains(part)) {
        return;
    }
    if !out.is_empty() {
        out.push_str(": ");
    }
    out.push_str(part);
    seen.push(part.to_owned());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_loss_is_not_applied_and_a_timeout_is_ambiguous() {
        let no_leader = tonic::Status::unavailable("etcdserver: no leader");
        assert_eq!(classify_status(&no_leader), Class::NotApplied);
        let timed_out = tonic::Status::unavailable("etcdserver: request timed out");
        assert_eq!(classify_status(&timed_out), Class::Ambiguous);
        let exceeded = tonic::Status::deadline_exceeded("context deadline exceeded");
        assert_eq!(classify_status(&exceeded), Class::Ambiguous);
        let invalid = tonic::Status::invalid_argument("etcdserver: key is not provided");
        assert_eq!(classify_status(&invalid), Class::Fatal);
        let full = tonic::Status::resource_exhausted("etcdserver: mvcc: database space exceeded");
        assert_eq!(classify_status(&full), Class::Fatal);
    }

    #[test]
    fn describe_drops_repeated_causes() {
        let mut out = String::new();
        let mut seen = Vec::new();
        push_distinct(&mut out, &mut seen, "tcp connect error: Connection refused");
        push_distinct(&mut out, &mut seen, "Connection refused");
        push_distinct(&mut out, &mut seen, "");
        assert_eq!(out, "tcp connect error: Connection refused");
    }

    #[test]
    fn unavailable_lists_each_endpoint() {
        let e = EtcdError::Unavailable {
            operation: Operation::Put,
            key: "blocklist/n1".into(),
            elapsed: Duration::from_secs(1),
            failures: vec![
                EndpointFailure {
                    endpoint: "http://127.0.0.1:1".into(),
                    reason: "Unavailable: tcp connect error".into(),
                },
                EndpointFailure {
                    endpoint: "http://127.0.0.1:2".into(),
                    reason: "no answer within 1s".into(),
                },
            ],
        };
        assert_eq!(
            e.to_string(),
            "etcd unavailable for put of \"blocklist/n1\" after 1s: \
             http://127.0.0.1:1: Unavailable: tcp connect error; http://127.0.0.1:2: no answer within 1s"
        );
    }
}
