//! Compare-and-swap: create if absent, update or delete if unchanged since read, and records
//! whose version only goes up.
//!
//! Why this module exists: several Probity processes write the same keys (two nodes sealing
//! the same object id, two servers rotating the same key). etcd's transactions make each
//! write conditional on what the writer saw; this module turns them into three plain
//! contracts, plus the registry's: a record's `version` never goes down, and a version, once
//! accepted, never changes its content.
//!
//! Invariants of [`EtcdClient::put_versioned`]:
//! * the stored version never decreases, whatever the interleaving of writers (each write is
//!   one transaction conditioned on the `mod_revision` its decision was based on);
//! * of several writers offering different records for the same version, exactly one wins;
//!   the others get [`VersionedError::Conflict`] (or [`VersionedError::Rollback`] once a
//!   higher version is in);
//! * offering the accepted version with the same digest again is a no-op
//!   ([`VersionedWrite::Unchanged`]), which also makes the call safe to retry.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use etcd_client::{TxnOp, TxnOpResponse};

use crate::client::{EtcdClient, Retry, absent, at_mod_revision};
use crate::error::EtcdError;
use crate::{Entry, client::Inner};

/// Largest versioned record parsed, in bytes (etcd refuses requests over 1.5 MiB by default).
pub const MAX_VERSIONED_LEN: usize = 2 * 1024 * 1024;

/// Lost races [`EtcdClient::put_versioned`] tolerates before giving up. Each lost race means
/// another writer's transaction committed, so this is only reached under a storm of writers.
pub const MAX_VERSIONED_ROUNDS: u32 = 64;

/// The outcome of a compare-and-swap.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Swap {
    /// The write happened at this store revision.
    Applied {
        /// Revision of the write.
        revision: i64,
    },
    /// The condition did not hold: the key as it is now (`None`: absent).
    Refused {
        /// The current entry.
        current: Option<Entry>,
    },
}

impl Swap {
    /// Whether the write happened.
    pub fn is_applied(&self) -> bool {
        matches!(self, Self::Applied { .. })
    }
}

/// The part of a versioned record this crate reads: a JSON object with a numeric `version`
/// and, optionally, a `digest` string naming its content. Other fields are the caller's.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VersionHead {
    /// The record's version.
    pub version: u64,
    /// Its content digest, if it carries one.
    #[serde(default)]
    pub digest: Option<String>,
}

/// Why bytes are not a versioned record.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VersionHeadError {
    /// Longer than [`MAX_VERSIONED_LEN`].
    #[error("{len} bytes, more than the {limit} allowed")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The bytes do not start with a JSON object (serde would read an array as a record).
    #[error("not a JSON object: byte {offset} is {found:?}")]
    NotObject {
        /// Offset of the first byte that is not white space (the length if there is none).
        offset: usize,
        /// That byte, if any.
        found: Option<char>,
    },
    /// Not a JSON object with a `version` that is a non-negative integer.
    #[error("not a JSON object with a numeric `version` (line {line}, column {column})")]
    Invalid {
        /// Line of the problem, from 1.
        line: usize,
        /// Column of the problem, from 1.
        column: usize,
        /// What the JSON parser found.
        #[source]
        source: serde_json::Error,
    },
}

impl VersionHead {
    /// Reads the version and digest of `bytes` (untrusted: any byte string is an error or a
    /// head, never a panic).
    pub fn parse(bytes: &[u8]) -> Result<Self, VersionHeadError> {
        if bytes.len() > MAX_VERSIONED_LEN {
            return Err(VersionHeadError::TooLarge {
                len: bytes.len(),
                limit: MAX_VERSIONED_LEN,
            });
        }
        let first = bytes.iter().position(|b| !b.is_ascii_whitespace());
        let found = first.and_then(|i| bytes.get(i)).copied();
        if found != Some(b'{') {
            return Err(VersionHeadError::NotObject {
                offset: first.unwrap_or(bytes.len()),
                found: found.map(char::from),
            });
        }
        serde_json::from_slice(bytes).map_err(|source| VersionHeadError::Invalid {
            line: source.line(),
            column: source.column(),
            source,
        })
    }

    /// Whether two records of the same version have the same content: their digests when both
    /// carry one, else their bytes.
    fn same_content(&self, bytes: &[u8], other: &Self, other_bytes: &[u8]) -> bool {
        match (&self.digest, &other.digest) {
            (Some(a), Some(b)) => a == b,
            (None, None) => bytes == other_bytes,
            _ => false,
        }
    }
}

/// What [`EtcdClient::put_versioned`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionedWrite {
    /// The key was absent; the record was written at `revision`.
    Created {
        /// Revision of the write.
        revision: i64,
    },
    /// A lower version was replaced.
    Updated {
        /// The version replaced.
        previous: u64,
        /// Revision of the write.
        revision: i64,
    },
    /// The same version with the same content was already stored: nothing written. (Also the
    /// answer when this very call's first attempt was applied but its answer lost.)
    Unchanged {
        /// `mod_revision` of the stored record.
        mod_revision: i64,
    },
}

/// Why [`EtcdClient::put_versioned`] refused or failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VersionedError {
    /// A version lower than the accepted one.
    #[error(
        "refusing rollback of {key:?} to version {offered}: version {accepted} was already accepted"
    )]
    Rollback {
        /// The key, relative to the prefix.
        key: String,
        /// Version offered.
        offered: u64,
        /// Version stored.
        accepted: u64,
    },
    /// The accepted version with different content.
    #[error(
        "refusing a different record for {key:?} version {version}: another digest was accepted for it"
    )]
    Conflict {
        /// The key, relative to the prefix.
        key: String,
        /// The version.
        version: u64,
    },
    /// The record offered is not versioned.
    #[error("the record offered for {key:?} is not a versioned record")]
    InvalidOffered {
        /// The key.
        key: String,
        /// Why.
        #[source]
        source: VersionHeadError,
    },
    /// The record stored is not versioned: someone else wrote the key. Fails closed.
    #[error("the record stored at {key:?} (mod revision {mod_revision}) is not a versioned record")]
    InvalidStored {
        /// The key.
        key: String,
        /// Its mod revision.
        mod_revision: i64,
        /// Why.
        #[source]
        source: VersionHeadError,
    },
    /// The value does not serialize.
    #[error("cannot encode the record for {key:?}")]
    Encode {
        /// The key.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Lost [`MAX_VERSIONED_ROUNDS`] races in a row.
    #[error("gave up writing {key:?} after losing {rounds} races to other writers")]
    Contended {
        /// The key.
        key: String,
        /// Races lost.
        rounds: u32,
    },
    /// etcd failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
}

impl EtcdClient {
    /// Writes `value` at `key` only if the key is absent. Retries only failures that certainly
    /// did not apply the write; otherwise [`EtcdError::OutcomeUnknown`]: read the key again.
    pub async fn create(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<Swap, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let put = TxnOp::put(full.clone(), value.into(), None);
        self.swap(key, vec![absent(&full)], vec![put], &full).await
    }

    /// Writes `value` at `key` attached to `lease`, only if the key is absent: how one of
    /// several processes takes a role (the key goes when its lease ends). Same retry rule
    /// as [`EtcdClient::create`].
    pub async fn create_with_lease(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
        lease: crate::LeaseId,
    ) -> Result<Swap, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let options = etcd_client::PutOptions::new().with_lease(lease.0);
        let put = TxnOp::put(full.clone(), value.into(), Some(options));
        self.swap(key, vec![absent(&full)], vec![put], &full).await
    }

    /// Writes `value` at `key` only if the key's `mod_revision` is still `mod_revision` (as
    /// read before). Same retry rule as [`EtcdClient::create`].
    pub async fn update_if(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
        mod_revision: i64,
    ) -> Result<Swap, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let put = TxnOp::put(full.clone(), value.into(), None);
        self.swap(
            key,
            vec![at_mod_revision(&full, mod_revision)],
            vec![put],
            &full,
        )
        .await
    }

    /// Deletes `key` only if its `mod_revision` is still `mod_revision`.
    pub async fn delete_if(&self, key: &str, mod_revision: i64) -> Result<Swap, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let delete = TxnOp::delete(full.clone(), None);
        self.swap(
            key,
            vec![at_mod_revision(&full, mod_revision)],
            vec![delete],
            &full,
        )
        .await
    }

    /// Deletes `key` and, in the same transaction, puts `marker` (with `value`), only if
    /// `key` exists: a delete that leaves a tombstone whose mod revision is the delete's.
    /// `existed` says whether it did; a retry after a lost answer finds the key gone and
    /// leaves the tombstone the first attempt wrote.
    pub async fn delete_leaving(
        &self,
        key: &str,
        marker: &str,
        value: impl Into<Vec<u8>>,
    ) -> Result<crate::client::Deleted, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let exists =
            etcd_client::Compare::version(full.clone(), etcd_client::CompareOp::Greater, 0);
        let ops = vec![
            TxnOp::delete(full, None),
            TxnOp::put(self.inner.keyspace.full(marker), value.into(), None),
        ];
        let resp = self
            .txn(key, Retry::Always, vec![exists], ops, Vec::new())
            .await?;
        Ok(crate::client::Deleted {
            revision: resp.header().map(|h| h.revision()).unwrap_or(0),
            existed: resp.succeeded(),
        })
    }

    async fn swap(
        &self,
        key: &str,
        compares: Vec<etcd_client::Compare>,
        success: Vec<TxnOp>,
        full: &[u8],
    ) -> Result<Swap, EtcdError> {
        let read_back = vec![TxnOp::get(full.to_vec(), None)];
        let resp = self
            .txn(key, Retry::IfNotApplied, compares, success, read_back)
            .await?;
        settle(&self.inner, &resp)
    }

    /// Writes the versioned record `value` (serialized to JSON; it must have a numeric
    /// `version` and may have a `digest` string) at `key`, if its version is higher than the
    /// stored one, in one transaction conditioned on the record read. Returns a typed refusal
    /// for a lower version ([`VersionedError::Rollback`]) or for the same version with other
    /// content ([`VersionedError::Conflict`]); the same version and content is a no-op. A lost
    /// race re-decides against the winner's record (returned by the same transaction), up to
    /// [`MAX_VERSIONED_ROUNDS`] times. Safe to retry after any error.
    pub async fn put_versioned<T: Serialize + ?Sized>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<VersionedWrite, VersionedError> {
        let bytes = serde_json::to_vec(value).map_err(|source| VersionedError::Encode {
            key: key.to_owned(),
            source,
        })?;
        self.put_versioned_bytes(key, bytes).await
    }

    /// [`EtcdClient::put_versioned`] for a record already encoded as JSON.
    pub async fn put_versioned_bytes(
        &self,
        key: &str,
        bytes: impl Into<Vec<u8>>,
    ) -> Result<VersionedWrite, VersionedError> {
        let bytes = bytes.into();
        let offered =
            VersionHead::parse(&bytes).map_err(|source| VersionedError::InvalidOffered {
                key: key.to_owned(),
                source,
            })?;
        let full = self.inner.keyspace.full(key);
        let (mut stored, _) = self.get(key).await?;
        for _ in 0..MAX_VERSIONED_ROUNDS {
            let compare = match &stored {
                None => absent(&full),
                Some(entry) => {
                    let head = VersionHead::parse(&entry.value).map_err(|source| {
                        VersionedError::InvalidStored {
                            key: key.to_owned(),
                            mod_revision: entry.mod_revision,
                            source,
                        }
                    })?;
                    if offered.version < head.version {
                        return Err(VersionedError::Rollback {
                            key: key.to_owned(),
                            offered: offered.version,
                            accepted: head.version,
                        });
                    }
                    if offered.version == head.version {
                        if offered.same_content(&bytes, &head, &entry.value) {
                            return Ok(VersionedWrite::Unchanged {
                                mod_revision: entry.mod_revision,
                            });
                        }
                        return Err(VersionedError::Conflict {
                            key: key.to_owned(),
                            version: offered.version,
                        });
                    }
                    at_mod_revision(&full, entry.mod_revision)
                }
            };
            let put = TxnOp::put(full.clone(), bytes.clone(), None);
            let read_back = TxnOp::get(full.clone(), None);
            // Retrying the same transaction is safe: if an attempt whose answer was lost had
            // applied it, the retry's compare fails and reads our own record back.
            let resp = self
                .txn(
                    key,
                    Retry::Always,
                    vec![compare],
                    vec![put],
                    vec![read_back],
                )
                .await?;
            match settle(&self.inner, &resp)? {
                Swap::Applied { revision } => {
                    return Ok(match &stored {
                        None => VersionedWrite::Created { revision },
                        Some(entry) => VersionedWrite::Updated {
                            previous: VersionHead::parse(&entry.value)
                                .map(|h| h.version)
                                .unwrap_or_default(),
                            revision,
                        },
                    });
                }
                Swap::Refused { current } => stored = current,
            }
        }
        Err(VersionedError::Contended {
            key: key.to_owned(),
            rounds: MAX_VERSIONED_ROUNDS,
        })
    }
}

/// Reads a CAS transaction's answer: applied at its revision, or refused with the entry the
/// failure branch read back.
fn settle(inner: &Inner, resp: &etcd_client::TxnResponse) -> Result<Swap, EtcdError> {
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    if resp.succeeded() {
        return Ok(Swap::Applied { revision });
    }
    let mut current = None;
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(get) = op
            && let Some(kv) = get.kvs().first()
        {
            current = Some(Entry::from_kv(&inner.keyspace, kv)?);
        }
    }
    Ok(Swap::Refused { current })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_reads_version_and_digest_and_ignores_the_rest() {
        let head =
            VersionHead::parse(br#"{"object":"m","version":7,"digest":"ab","x":[1]}"#).unwrap();
        assert_eq!(head.version, 7);
        assert_eq!(head.digest.as_deref(), Some("ab"));
        let bare = VersionHead::parse(br#"{"version":0}"#).unwrap();
        assert_eq!(bare.digest, None);
    }

    #[test]
    fn head_errors_say_where() {
        for (input, line, column) in [
            (&b"{\"version\": -1}"[..], 1, 14),
            (b"{\n\"digest\": \"a\"}", 2, 14),
            (b"{\"version\": 1", 1, 13),
        ] {
            match VersionHead::parse(input) {
                Err(VersionHeadError::Invalid {
                    line: l, column: c, ..
                }) => assert_eq!((l, c), (line, column), "{input:?}"),
                other => panic!("{input:?}: {other:?}"),
            }
        }
        assert!(matches!(
            VersionHead::parse(b" [1]"),
            Err(VersionHeadError::NotObject {
                offset: 1,
                found: Some('[')
            })
        ));
        assert!(matches!(
            VersionHead::parse(b""),
            Err(VersionHeadError::NotObject {
                offset: 0,
                found: None
            })
        ));
        let big = vec![b' '; MAX_VERSIONED_LEN + 1];
        assert!(matches!(
            VersionHead::parse(&big),
            Err(VersionHeadError::TooLarge { .. })
        ));
    }

    #[test]
    fn same_content_compares_digests_or_bytes() {
        let a = VersionHead {
            version: 1,
            digest: Some("d".into()),
        };
        let b = VersionHead {
            version: 1,
            digest: None,
        };
        assert!(a.same_content(b"x", &a, b"y"));
        assert!(!a.same_content(b"x", &b, b"x"));
        assert!(b.same_content(b"x", &b, b"x"));
        assert!(!b.same_content(b"x", &b, b"y"));
    }

    /// Mutated records from a fixed-seed generator: never a panic, always a head or a
    /// located error.
    #[test]
    fn head_survives_mutated_records() {
        let seeds: [&[u8]; 3] = [
            br#"{"object_id":"models/llama","version":12,"digest":"9f86d081884c7d65"}"#,
            br#"{"version":18446744073709551615}"#,
            b"{\n  \"version\": 3,\n  \"digest\": null\n}\n",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut parsed = 0;
        for i in 0..5000_u64 {
            let mut record = seeds[(i % 3) as usize].to_vec();
            for _ in 0..=(next() % 3) {
                match next() % 4 {
                    0 => record.truncate((next() as usize) % (record.len() + 1)),
                    1 => {
                        if !record.is_empty() {
                            let at = (next() as usize) % record.len();
                            record[at] ^= 1 << (next() % 8);
                        }
                    }
                    2 => {
                        let copy = record.clone();
                        record.extend_from_slice(&copy);
                    }
                    _ => {
                        let at = (next() as usize) % (record.len() + 1);
                        record.insert(at, (next() & 0xff) as u8);
                    }
                }
            }
            match VersionHead::parse(&record) {
                Ok(_) => parsed += 1,
                Err(VersionHeadError::Invalid { line, column, .. }) => {
                    assert!(line >= 1, "{record:?}");
                    let lines = record.split(|b| *b == b'\n').count();
                    assert!(line <= lines.max(1), "{record:?}: line {line}");
                    let _ = column;
                }
                Err(VersionHeadError::NotObject { offset, .. }) => assert!(offset <= record.len()),
                Err(VersionHeadError::TooLarge { .. }) => panic!("seeds are small"),
            }
        }
        assert!(parsed > 0, "some mutations keep the record valid");
    }
}
