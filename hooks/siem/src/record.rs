//! The audit record as this crate sees it: what the engine's hash-chained log holds,
//! reduced to what a SIEM or an alert needs.
//!
//! The engine owns the log and its hashing; this crate never recomputes a hash. It
//! carries `hash` and `prev_hash` so that a SIEM can drop duplicates (at-least-once
//! delivery resends) and check the chain's links without access to the log.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::SystemTime;

use thiserror::Error;

/// A SHA-256 digest: a record's hash or its predecessor's.
pub type Digest = [u8; 32];

/// What a record is about. The syslog MSGID is derived from it ([`RecordKind::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RecordKind {
    /// A decision that denied or carried obligations.
    Decision,
    /// A node was blocked.
    Block,
    /// A node was unblocked.
    Unblock,
    /// An object was verified (or failed verification).
    Verification,
    /// A key was created, rotated, rewrapped or destroyed.
    KeyEvent,
    /// A compliance finding started to hold.
    Finding,
    /// A finding stopped holding.
    FindingCleared,
    /// A signed tree head over the log.
    Checkpoint,
}

impl RecordKind {
    /// Every kind, in declaration order.
    pub const ALL: [RecordKind; 8] = [
        RecordKind::Decision,
        RecordKind::Block,
        RecordKind::Unblock,
        RecordKind::Verification,
        RecordKind::KeyEvent,
        RecordKind::Finding,
        RecordKind::FindingCleared,
        RecordKind::Checkpoint,
    ];

    /// The kind's name (`decision`, `key-event`, `finding-cleared`, …), also its MSGID.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordKind::Decision => "decision",
            RecordKind::Block => "block",
            RecordKind::Unblock => "unblock",
            RecordKind::Verification => "verification",
            RecordKind::KeyEvent => "key-event",
            RecordKind::Finding => "finding",
            RecordKind::FindingCleared => "finding-cleared",
            RecordKind::Checkpoint => "checkpoint",
        }
    }
}

impl fmt::Display for RecordKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not a record kind or severity.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown {what} {value:?}")]
pub struct UnknownName {
    /// `kind` or `severity`.
    pub what: &'static str,
    /// The name given.
    pub value: String,
}

impl FromStr for RecordKind {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RecordKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownName {
                what: "kind",
                value: s.to_owned(),
            })
    }
}

/// How serious a record is, as the policies' `@severity` annotation says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// Informational.
    Info,
    /// Low.
    Low,
    /// Medium.
    Medium,
    /// High.
    High,
    /// Critical.
    Critical,
}

impl Severity {
    /// Every severity, lowest first.
    pub const ALL: [Severity; 5] = [
        Severity::Info,
        Severity::Low,
        Severity::Medium,
        Severity::High,
        Severity::Critical,
    ];

    /// The severity's name (`info` … `critical`).
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Low => "low",
            Severity::Medium => "medium",
            Severity::High => "high",
            Severity::Critical => "critical",
        }
    }

    /// The RFC 5424 severity (0 emergency … 7 debug). Critical is 2 (critical), high 3
    /// (error), medium 4 (warning), low 5 (notice), info 6 (informational). Nothing maps
    /// to 0 or 1: those mean the sending system itself is unusable or needs immediate
    /// action, which an audit record about another component does not say.
    pub fn syslog_severity(self) -> u8 {
        match self {
            Severity::Critical => 2,
            Severity::High => 3,
            Severity::Medium => 4,
            Severity::Low => 5,
            Severity::Info => 6,
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Severity {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Severity::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownName {
                what: "severity",
                value: s.to_owned(),
            })
    }
}

/// One audit record. Sequence numbers start at 1 and are contiguous in a log; the
/// forwarder's cursor is the highest one delivered (0 before the first).
///
/// Decision records carry their decision in `fields` by convention: `decision`
/// (`allow`/`deny`), `principal`, `action`, `resource`, and `obligations`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Position in the log, from 1.
    pub seq: u64,
    /// The record's hash in the chain.
    pub hash: Digest,
    /// The predecessor's hash (all zero for the first record).
    pub prev_hash: Digest,
    /// When the record was written.
    pub time: SystemTime,
    /// What it is about.
    pub kind: RecordKind,
    /// How serious.
    pub severity: Severity,
    /// The node concerned, if any.
    pub node: Option<String>,
    /// The policy id that caused it, if any.
    pub policy: Option<String>,
    /// Human-readable text.
    pub message: String,
    /// Further fields, flat.
    pub fields: BTreeMap<String, String>,
}

/// Lower-case hexadecimal of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// Parses 64 hexadecimal digits (either case) into a digest.
pub fn parse_digest(s: &str) -> Option<Digest> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in RecordKind::ALL {
            assert_eq!(k.as_str().parse::<RecordKind>(), Ok(k));
        }
        for s in Severity::ALL {
            assert_eq!(s.as_str().parse::<Severity>(), Ok(s));
        }
        assert_eq!(
            "fatal".parse::<Severity>().unwrap_err().to_string(),
            "unknown severity \"fatal\""
        );
    }

    #[test]
    fn digests_round_trip_through_hex() {
        let d: Digest = core::array::from_fn(|i| u8::try_from(i * 7).unwrap());
        assert_eq!(parse_digest(&hex(&d)), Some(d));
        assert_eq!(parse_digest(&hex(&d).to_uppercase()), Some(d));
        assert_eq!(parse_digest("00"), None);
        assert_eq!(parse_digest(&"g".repeat(64)), None);
    }
}
