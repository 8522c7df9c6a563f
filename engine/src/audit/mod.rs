//! The tamper-evident audit trail: the hash chain over the decision and event logs, the
//! checkpoints (tree heads) that pin it, and [`verify`], which re-checks both.
//!
//! Why it exists: the logs are the evidence of what the engine decided and saw. Anyone
//! who can write the state file could edit, delete, reorder or cut records; the chain
//! makes every such change visible to [`verify`], and a checkpoint signed by an
//! [`crate::integrity::Anchor`] (an HSM, or the software anchor) makes the
//! chain's head up to that record unforgeable without the key.
//!
//! # The chain
//!
//! There is **one chain per log** (decisions, events), not one over both: the two logs
//! are written by different writers (the decision log's group-commit thread; events one
//! at a time, from wherever an integrity failure is seen) and pruned differently (only
//! the decision log has retention). One chain over both would serialize both writers on
//! one head and make pruning the decision log cut the event log's chain.
//!
//! Each record is stored as `0x01 || seq (8, big endian) || prev (32) || hash (32) ||
//! body`, where `body` is the record's bytes as the log always stored them (JSON for
//! decisions, the binary event encoding for events) and
//! `hash = SHA-256("probity-audit-record-v1" 0x00 log 0x00 seq prev body)`. The first
//! record's `prev` is `GENESIS` (32 zero bytes); after pruning, the first kept record's
//! `prev` is the head of the checkpoint pruning stopped at. The chain is hashed by the
//! writer inside the transaction that appends (for decisions, the group commit), never
//! per request. Records written before the chain existed (their first byte is not `0x01`)
//! are read as they are and reported as unchained; they can only precede chained ones.
//!
//! # Checkpoints
//!
//! Every [`CheckpointPolicy::every_records`] records, or once
//! [`CheckpointPolicy::every`] has passed with records not yet checkpointed, the writer
//! stores a [`Checkpoint`] `{log, seq, head, time}` in the `checkpoints` table, signed
//! (one signature per checkpoint, never per record) by the policy's anchor if it has
//! one. **Without an anchor, checkpoints are unsigned**: they still pin the chain
//! against truncation and accidents, and retention still cuts at them, but anyone who
//! can write the state file can forge them; [`verify`] says so.
//!
//! # What verification can and cannot see
//!
//! An edited, deleted or reordered record breaks the chain at that record; a log cut
//! short before its last checkpoint misses records the checkpoint covers. A log cut short
//! **after** its last checkpoint cannot be seen locally: the records the SIEM received
//! (with their sequence numbers and hashes) are the witness for that tail.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;

use crate::integrity::{Anchor, Hash, KeyId, PublicKey, Signature, Verifier, hex, sha256};
use crate::state::{StateError, StateStore};

/// The `prev` of a log's first record: 32 zero bytes.
pub(crate) const GENESIS: Hash = [0; 32];

/// The tag byte of a chained record (older, unchained records start otherwise).
const CHAINED: u8 = 1;
/// Tag, seq, prev, hash.
const LINK_HEADER: usize = 1 + 8 + 32 + 32;
/// Records read per page while verifying.
const PAGE: usize = 4096;

/// Records between checkpoints by default.
pub(crate) const DEFAULT_CHECKPOINT_RECORDS: u64 = 1024;
/// Longest time records wait for a checkpoint by default.
pub(crate) const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(60);

/// Which log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Log {
    /// The decision log (denies and decisions with obligations).
    Decisions,
    /// The event log (integrity failures and other events).
    Events,
}

impl Log {
    /// Both logs.
    pub const ALL: [Log; 2] = [Log::Decisions, Log::Events];

    /// The log's name in hashes, tables and output.
    pub fn name(self) -> &'static str {
        match self {
            Log::Decisions => "decisions",
            Log::Events => "events",
        }
    }
}

impl std::fmt::Display for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The hash of a record: what its successor's `prev` holds.
pub fn record_hash(log: Log, seq: u64, prev: &Hash, body: &[u8]) -> Hash {
    let mut m = Vec::with_capacity(32 + log.name().len() + 8 + 32 + body.len());
    m.extend_from_slice(b"probity-audit-record-v1\0");
    m.extend_from_slice(log.name().as_bytes());
    m.push(0);
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend_from_slice(prev);
    m.extend_from_slice(body);
    sha256(&m)
}

/// One stored record of a chained log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link<'a> {
    /// The sequence number the record was written at.
    pub seq: u64,
    /// Its predecessor's hash.
    pub prev: Hash,
    /// Its own hash, as written.
    pub hash: Hash,
    /// The record's bytes.
    pub body: &'a [u8],
}

/// How a stored value reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored<'a> {
    /// A chained record.
    Chained(Link<'a>),
    /// A record written before the chain existed: its bytes as they are.
    Unchained(&'a [u8]),
    /// Tagged as chained but too short to be one.
    Malformed,
}

/// The stored form of a chained record.
pub(crate) fn encode_link(seq: u64, prev: &Hash, hash: &Hash, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(LINK_HEADER + body.len());
    v.push(CHAINED);
    v.extend_from_slice(&seq.to_be_bytes());
    v.extend_from_slice(prev);
    v.extend_from_slice(hash);
    v.extend_from_slice(body);
    v
}

/// Reads a stored value (never panics, whatever the bytes).
pub(crate) fn decode_stored(raw: &[u8]) -> Stored<'_> {
    if raw.first() != Some(&CHAINED) {
        return Stored::Unchained(raw);
    }
    let link = || -> Option<Link<'_>> {
        Some(Link {
            seq: u64::from_be_bytes(raw.get(1..9)?.try_into().ok()?),
            prev: raw.get(9..41)?.try_into().ok()?,
            hash: raw.get(41..73)?.try_into().ok()?,
            body: raw.get(LINK_HEADER..)?,
        })
    };
    link().map_or(Stored::Malformed, Stored::Chained)
}

/// The record's bytes, chained or not (`None`: malformed).
pub(crate) fn body_of(raw: &[u8]) -> Option<&[u8]> {
    match decode_stored(raw) {
        Stored::Chained(link) => Some(link.body),
        Stored::Unchained(body) => Some(body),
        Stored::Malformed => None,
    }
}

/// A record's place in its log's chain, as forwarded with it: a SIEM drops duplicates
/// by sequence number and hash, and checks the links without the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainLink {
    /// The record's sequence number.
    pub seq: u64,
    /// Its predecessor's hash (`None`: written before the chain existed).
    pub prev: Option<Hash>,
    /// Its own hash (`None`: written before the chain existed).
    pub hash: Option<Hash>,
}

impl ChainLink {
    /// The link of a stored value at `seq` (`None`: malformed).
    pub(crate) fn of(seq: u64, raw: &[u8]) -> Option<(Self, &[u8])> {
        match decode_stored(raw) {
            Stored::Chained(link) => Some((
                Self {
                    seq,
                    prev: Some(link.prev),
                    hash: Some(link.hash),
                },
                link.body,
            )),
            Stored::Unchained(body) => Some((
                Self {
                    seq,
                    prev: None,
                    hash: None,
                },
                body,
            )),
            Stored::Malformed => None,
        }
    }
}

/// A signed tree head: the chain of `log` up to record `seq` ends in `head`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Which log.
    pub log: Log,
    /// The last record it covers.
    pub seq: u64,
    /// That record's hash.
    pub head: Hash,
    /// When it was made, in milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    /// The anchor's key id and signature over [`Checkpoint::message`]; `None` when no
    /// anchor was configured (an unsigned checkpoint anyone with write access could forge).
    pub signature: Option<(KeyId, Signature)>,
}

impl Checkpoint {
    /// What the anchor signs: SHA-256 over the checkpoint's fields.
    pub fn message(&self) -> Hash {
        let mut m = Vec::with_capacity(96);
        m.extend_from_slice(b"probity-audit-checkpoint-v1\0");
        m.extend_from_slice(self.log.name().as_bytes());
        m.push(0);
        m.extend_from_slice(&self.seq.to_be_bytes());
        m.extend_from_slice(&self.head);
        m.extend_from_slice(&self.time_unix_ms.to_be_bytes());
        sha256(&m)
    }

    /// The stored form (the log and seq are the key): time, head, then `0`, or `1`,
    /// the key id and the signature.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + 32 + 1 + 32 + 64);
        v.extend_from_slice(&self.time_unix_ms.to_be_bytes());
        v.extend_from_slice(&self.head);
        match &self.signature {
            None => v.push(0),
            Some((key, sig)) => {
                v.push(1);
                v.extend_from_slice(&key.0);
                v.extend_from_slice(&sig.0);
            }
        }
        v
    }

    /// Reads a stored checkpoint (`None`: malformed; never panics).
    pub(crate) fn decode(log: Log, seq: u64, raw: &[u8]) -> Option<Self> {
        let time_unix_ms = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
        let head: Hash = raw.get(8..40)?.try_into().ok()?;
        let signature = match (raw.get(40)?, raw.len()) {
            (0, 41) => None,
            (1, 137) => Some((
                KeyId(raw.get(41..73)?.try_into().ok()?),
                Signature(raw.get(73..137)?.try_into().ok()?),
            )),
            _ => return None,
        };
        Some(Self {
            log,
            seq,
            head,
            time_unix_ms,
            signature,
        })
    }

    /// The checkpoint as listed to operators.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "log": self.log,
            "seq": self.seq,
            "head": hex(&self.head),
            "time_unix_ms": self.time_unix_ms,
            "signed_by": self.signature.as_ref().map(|(k, _)| k.to_string()),
        })
    }
}

/// When the writer checkpoints, and who signs.
#[derive(Clone)]
pub struct CheckpointPolicy {
    /// Checkpoint after this many records (at least 1). Default
    /// [`CheckpointPolicy::DEFAULT_RECORDS`].
    pub every_records: u64,
    /// Checkpoint records that waited this long. Default [`CheckpointPolicy::DEFAULT_INTERVAL`].
    pub every: Duration,
    /// The anchor that signs checkpoints; `None`: checkpoints are unsigned.
    pub anchor: Option<Arc<dyn Anchor>>,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        Self {
            every_records: DEFAULT_CHECKPOINT_RECORDS,
            every: DEFAULT_CHECKPOINT_INTERVAL,
            anchor: None,
        }
    }
}

impl std::fmt::Debug for CheckpointPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointPolicy")
            .field("every_records", &self.every_records)
            .field("every", &self.every)
            .field(
                "anchor",
                &self.anchor.as_ref().map(|a| a.describe().summary),
            )
            .finish()
    }
}

impl CheckpointPolicy {
    /// Records between checkpoints unless told otherwise.
    pub const DEFAULT_RECORDS: u64 = DEFAULT_CHECKPOINT_RECORDS;
    /// Time between checkpoints unless told otherwise.
    pub const DEFAULT_INTERVAL: Duration = DEFAULT_CHECKPOINT_INTERVAL;

    /// Whether `unchecked` records, the oldest checkpoint `waited_ms` ago, are due.
    pub(crate) fn due(&self, unchecked: u64, waited_ms: u64) -> bool {
        let every_ms = u64::try_from(self.every.as_millis()).unwrap_or(u64::MAX);
        unchecked > 0 && (unchecked >= self.every_records.max(1) || waited_ms >= every_ms)
    }

    /// Makes (and signs, with an anchor) the checkpoint of `log` at `seq`.
    pub(crate) fn make(
        &self,
        log: Log,
        seq: u64,
        head: Hash,
        time_unix_ms: u64,
    ) -> Result<Checkpoint, crate::integrity::AnchorError> {
        let mut cp = Checkpoint {
            log,
            seq,
            head,
            time_unix_ms,
            signature: None,
        };
        if let Some(anchor) = &self.anchor {
            let sig = anchor.sign(&cp.message())?;
            cp.signature = Some((anchor.public_key().key_id(), sig));
        }
        Ok(cp)
    }
}

/// What [`verify`] found in one log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogReport {
    /// Which log.
    pub log: Log,
    /// Records held.
    pub records: u64,
    /// The first and last sequence numbers held.
    pub first: Option<u64>,
    /// The last sequence number held.
    pub last: Option<u64>,
    /// Records written before the chain existed (read, not verifiable).
    pub unchained: u64,
    /// Checkpoints held.
    pub checkpoints: u64,
    /// Of which signed, with a signature that verified under the given key.
    pub signed_checkpoints: u64,
    /// Checkpoints without a signature.
    pub unsigned_checkpoints: u64,
    /// The last checkpoint's sequence number.
    pub last_checkpoint: Option<u64>,
    /// Records after the last checkpoint: a cut among them cannot be seen here (the
    /// SIEM's copy is their witness).
    pub unwitnessed: u64,
    /// The hash of the last record (or of the checkpoint pruning stopped at), hex.
    pub head: String,
}

/// What [`verify`] found: the chain of every log holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Per log.
    pub logs: Vec<LogReport>,
    /// The key signatures were checked against; `None`: no key was given, so signatures
    /// were not checked and a checkpoint proves nothing against someone who can write
    /// the state file.
    pub key_id: Option<String>,
}

/// Why the audit trail does not verify: the first problem found, by log and record.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AuditError {
    /// The logs could not be read.
    #[error("cannot read the audit logs")]
    Read(#[source] StateError),
    /// A record was changed after it was written.
    #[error("{log} log: record {seq} was edited ({why})")]
    Edited {
        /// Which log.
        log: Log,
        /// The record.
        seq: u64,
        /// What gave it away.
        why: String,
    },
    /// Records are missing from inside the log.
    #[error("{log} log: record {seq} was deleted{}", through_text(*seq, *through))]
    Deleted {
        /// Which log.
        log: Log,
        /// The first missing record.
        seq: u64,
        /// The last missing record.
        through: u64,
    },
    /// A record sits at another sequence number than it was written at.
    #[error("{log} log: record {seq} was reordered (it holds the record written as {holds})")]
    Reordered {
        /// Which log.
        log: Log,
        /// Where it sits.
        seq: u64,
        /// The sequence number it was written at.
        holds: u64,
    },
    /// The log ends before its last checkpoint.
    #[error(
        "{log} log: truncated from record {seq}: checkpoint {checkpoint} covers records the log no longer holds"
    )]
    Truncated {
        /// Which log.
        log: Log,
        /// The first missing record.
        seq: u64,
        /// The checkpoint that covers it.
        checkpoint: u64,
    },
    /// The chain is whole, but a checkpoint pinned another head: records up to it were
    /// rewritten together with their hashes.
    #[error(
        "{log} log: records after {} up to {seq} were rewritten with their hashes: checkpoint {seq} holds another head",
        since_text(*since)
    )]
    Rewritten {
        /// Which log.
        log: Log,
        /// The checkpoint's record.
        seq: u64,
        /// The last record a checkpoint still vouches for, if any.
        since: Option<u64>,
    },
    /// A checkpoint's signature does not verify, or it is unsigned while a key is given.
    #[error("{log} log: checkpoint {seq} {why}")]
    Signature {
        /// Which log.
        log: Log,
        /// The checkpoint's record.
        seq: u64,
        /// What is wrong.
        why: String,
    },
    /// A stored checkpoint is malformed.
    #[error("{log} log: checkpoint {seq} is malformed")]
    CheckpointMalformed {
        /// Which log.
        log: Log,
        /// The checkpoint's key.
        seq: u64,
    },
}

fn since_text(since: Option<u64>) -> String {
    since.map_or_else(
        || "the start of the log".to_owned(),
        |s| format!("record {s}"),
    )
}

fn through_text(seq: u64, through: u64) -> String {
    if through > seq {
        format!(" (records {seq} to {through} are missing)")
    } else {
        String::new()
    }
}

impl AuditError {
    /// The record the problem was found at, if it names one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            AuditError::Read(_) => None,
            AuditError::Edited { seq, .. }
            | AuditError::Deleted { seq, .. }
            | AuditError::Reordered { seq, .. }
            | AuditError::Truncated { seq, .. }
            | AuditError::Rewritten { seq, .. }
            | AuditError::Signature { seq, .. }
            | AuditError::CheckpointMalformed { seq, .. } => Some(*seq),
        }
    }
}

/// Re-checks the chain of both logs and every checkpoint (its signature under `key`
/// when given, and the head it pins), and names the first record that was edited,
/// deleted, reordered or cut before the last checkpoint.
///
/// Without `key`, signatures are not checked ([`VerifyReport::key_id`] is `None`). A
/// cut after the last checkpoint cannot be seen here ([`LogReport::unwitnessed`]).
pub fn verify(store: &StateStore, key: Option<&PublicKey>) -> Result<VerifyReport, AuditError> {
    let verifier = key.map(|k| Verifier::new(k.clone()));
    let logs = Log::ALL
        .into_iter()
        .map(|log| verify_log(store, log, verifier.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(VerifyReport {
        logs,
        key_id: key.map(|k| k.key_id().to_string()),
    })
}

fn verify_log(
    store: &StateStore,
    log: Log,
    verifier: Option<&Verifier>,
) -> Result<LogReport, AuditError> {
    let checkpoints = store
        .raw_checkpoints(log)
        .map_err(AuditError::Read)?
        .into_iter()
        .map(|(seq, raw)| {
            Checkpoint::decode(log, seq, &raw).ok_or(AuditError::CheckpointMalformed { log, seq })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut report = LogReport {
        log,
        records: 0,
        first: None,
        last: None,
        unchained: 0,
        checkpoints: u64::try_from(checkpoints.len()).unwrap_or(u64::MAX),
        signed_checkpoints: 0,
        unsigned_checkpoints: 0,
        last_checkpoint: checkpoints.last().map(|c| c.seq),
        unwitnessed: 0,
        head: hex(&GENESIS),
    };
    for cp in &checkpoints {
        match (&cp.signature, verifier) {
            (None, Some(v)) => {
                return Err(AuditError::Signature {
                    log,
                    seq: cp.seq,
                    why: format!(
                        "is unsigned, but checkpoints must be signed by key {}",
                        v.key_id()
                    ),
                });
            }
            (None, None) => report.unsigned_checkpoints += 1,
            (Some((key, sig)), Some(v)) => {
                if *key != v.key_id() {
                    return Err(AuditError::Signature {
                        log,
                        seq: cp.seq,
                        why: format!("is signed by key {key}, not by key {}", v.key_id()),
                    });
                }
                if !v.verify(&cp.message(), sig) {
                    return Err(AuditError::Signature {
                        log,
                        seq: cp.seq,
                        why: format!("has a signature key {key} did not make"),
                    });
                }
                report.signed_checkpoints += 1;
            }
            // Signed, but no key to check it with: counted as neither.
            (Some(_), None) => {}
        }
    }
    let mut walk = Walk {
        log,
        checkpoints: &checkpoints,
        next_checkpoint: 0,
        vouched: None,
        expected: None,
        prev: None,
    };
    let mut from = 0u64;
    loop {
        let page = store.raw_log(log, from, PAGE).map_err(AuditError::Read)?;
        let Some((last_key, _)) = page.last() else {
            break;
        };
        let next_from = last_key.checked_add(1);
        for (key, raw) in &page {
            walk.step(*key, raw, &mut report)?;
        }
        match next_from {
            Some(n) if page.len() == PAGE => from = n,
            _ => break,
        }
    }
    walk.finish(&mut report)?;
    Ok(report)
}

/// The state of a walk along one log.
struct Walk<'a> {
    log: Log,
    checkpoints: &'a [Checkpoint],
    /// Index of the first checkpoint not yet reached.
    next_checkpoint: usize,
    /// The last checkpoint that matched the chain.
    vouched: Option<u64>,
    /// The sequence number the next record must have (`None`: before the first).
    expected: Option<u64>,
    /// The hash the next chained record must chain from (`None`: no chained record yet).
    prev: Option<Hash>,
}

impl Walk<'_> {
    fn step(&mut self, key: u64, raw: &[u8], report: &mut LogReport) -> Result<(), AuditError> {
        let log = self.log;
        report.records += 1;
        report.first.get_or_insert(key);
        report.last = Some(key);
        if let Some(expected) = self.expected
            && key != expected
        {
            return Err(AuditError::Deleted {
                log,
                seq: expected,
                through: key.saturating_sub(1),
            });
        }
        self.expected = key.checked_add(1);
        let link = match decode_stored(raw) {
            Stored::Chained(link) => link,
            Stored::Malformed => {
                return Err(AuditError::Edited {
                    log,
                    seq: key,
                    why: "it is too short to be a chained record".into(),
                });
            }
            Stored::Unchained(_) if self.prev.is_none() => {
                // Written before the chain existed: nothing to check it against.
                report.unchained += 1;
                return Ok(());
            }
            Stored::Unchained(_) => {
                return Err(AuditError::Edited {
                    log,
                    seq: key,
                    why: "it is unchained, after chained records".into(),
                });
            }
        };
        if link.seq != key {
            return Err(AuditError::Reordered {
                log,
                seq: key,
                holds: link.seq,
            });
        }
        if record_hash(log, key, &link.prev, link.body) != link.hash {
            return Err(AuditError::Edited {
                log,
                seq: key,
                why: "its contents do not match its hash".into(),
            });
        }
        let expected_prev = match self.prev {
            Some(prev) => prev,
            None => self.start_of_chain(key, report.unchained > 0)?,
        };
        if link.prev != expected_prev {
            return Err(match key.checked_sub(1) {
                // The record before is not the one this record was chained to.
                Some(before) if self.prev.is_some() => AuditError::Edited {
                    log,
                    seq: before,
                    why: format!("record {key} was chained to another record {before}"),
                },
                _ => AuditError::Edited {
                    log,
                    seq: key,
                    why: "it does not chain from the start of the log".into(),
                },
            });
        }
        self.prev = Some(link.hash);
        report.head = hex(&link.hash);
        // Checkpoints at or before this record (those before the first record are the
        // one pruning stopped at, or older).
        while let Some(cp) = self.checkpoints.get(self.next_checkpoint) {
            if cp.seq > key {
                break;
            }
            self.next_checkpoint += 1;
            if cp.seq == key {
                if cp.head != link.hash {
                    return Err(AuditError::Rewritten {
                        log,
                        seq: key,
                        since: self.vouched,
                    });
                }
                self.vouched = Some(key);
            }
        }
        Ok(())
    }

    /// What the first chained record at `key` must chain from: the genesis (the log's
    /// start, or its first record after unchained ones), or the checkpoint pruning
    /// stopped at. Anything else means records before it were deleted.
    fn start_of_chain(&self, key: u64, after_unchained: bool) -> Result<Hash, AuditError> {
        if key == 0 || after_unchained {
            return Ok(GENESIS);
        }
        let before = key - 1;
        if let Some(cp) = self.checkpoints.iter().find(|c| c.seq == before) {
            return Ok(cp.head);
        }
        // Deleted back to the last checkpoint before it (or the log's start).
        let from = self
            .checkpoints
            .iter()
            .map(|c| c.seq)
            .filter(|&s| s < before)
            .max()
            .map_or(0, |s| s.saturating_add(1));
        Err(AuditError::Deleted {
            log: self.log,
            seq: from,
            through: before,
        })
    }

    fn finish(&mut self, report: &mut LogReport) -> Result<(), AuditError> {
        let log = self.log;
        let Some(last_cp) = self.checkpoints.last() else {
            report.unwitnessed = report.records.saturating_sub(report.unchained);
            return Ok(());
        };
        match report.last {
            Some(last) if last >= last_cp.seq => {
                report.unwitnessed = last - last_cp.seq;
                Ok(())
            }
            Some(last) => Err(AuditError::Truncated {
                log,
                seq: last.saturating_add(1),
                checkpoint: last_cp.seq,
            }),
            None => {
                // An empty log is whole if pruning stopped at its only checkpoint.
                let base = self.checkpoints.first().map_or(last_cp.seq, |c| c.seq);
                report.head = hex(&last_cp.head);
                if base == last_cp.seq {
                    Ok(())
                } else {
                    Err(AuditError::Truncated {
                        log,
                        seq: base.saturating_add(1),
                        checkpoint: last_cp.seq,
                    })
                }
            }
        }
    }
}

/// The stored forms' decoders over any bytes, for the fuzz targets (the redb file is
/// only as trustworthy as the disk it is on): never a panic, and what decodes
/// re-encodes to exactly the input.
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing {
    use super::{Checkpoint, Log, Stored, decode_stored, encode_link};

    /// Decodes `raw` as a stored log value, then its body as a decision record and as
    /// an event, and as a checkpoint; panics only when a decoded form does not
    /// re-encode to its input.
    pub fn stored(raw: &[u8]) {
        match decode_stored(raw) {
            Stored::Chained(link) => {
                assert_eq!(
                    encode_link(link.seq, &link.prev, &link.hash, link.body),
                    raw
                );
                decode_bodies(link.body);
            }
            Stored::Unchained(body) => decode_bodies(body),
            Stored::Malformed => assert!(raw.len() < super::LINK_HEADER),
        }
        if let Some(c) = Checkpoint::decode(Log::Events, 0, raw) {
            assert_eq!(c.encode(), raw);
        }
    }

    fn decode_bodies(body: &[u8]) {
        let _ = serde_json::from_slice::<crate::state::DecisionRecord>(body);
        let _ = crate::state::decode_event(0, body);
    }
}

#[cfg(test)]
mod tests;
