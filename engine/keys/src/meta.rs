//! Key metadata: what the keyring persists about each key, and the store it persists through.
//!
//! Why this module exists: the keyring's truth (which versions exist, which is primary, which
//! are destroyed, who made them, whether the key was erased) must live in the engine's state
//! backend (redb on one machine, etcd in a cluster), not in this crate. [`KeyMetaStore`] is
//! the small, object-safe contract the engine implements there; [`MemoryMetaStore`] is the
//! in-memory implementation for tests and single-process use.
//!
//! Records are plain serde data. They hold data keys **only wrapped** by a KEK; a destroyed
//! version keeps its history (who, when) but not its wrapped key. Every write is a
//! compare-and-swap on the record's revision, so two writers that read the same revision
//! cannot both rotate: the second gets [`MetaStoreError::Conflict`].

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::time::Timestamp;

/// Longest key id accepted, in bytes.
pub const MAX_KEY_ID_LEN: usize = 255;
/// Longest data-subject id accepted, in bytes.
pub const MAX_SUBJECT_LEN: usize = 1024;

/// The name of a keyring key, e.g. `dataset/imagenet` or `subject/4711`: 1 to 255 bytes of
/// UTF-8 without control characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KeyId(String);

impl KeyId {
    /// Checks and wraps a key id.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidId> {
        let id = id.into();
        check_id("key id", &id, MAX_KEY_ID_LEN)?;
        Ok(Self(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for KeyId {
    type Error = InvalidId;
    fn try_from(s: String) -> Result<Self, InvalidId> {
        Self::new(s)
    }
}

impl From<KeyId> for String {
    fn from(k: KeyId) -> String {
        k.0
    }
}

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks an identifier: non-empty, at most `max` bytes, no control characters.
pub(crate) fn check_id(what: &'static str, id: &str, max: usize) -> Result<(), InvalidId> {
    let bad = |reason: &'static str| {
        Err(InvalidId {
            what,
            value: id.chars().take(64).collect(),
            reason,
        })
    };
    if id.is_empty() {
        return bad("it is empty");
    }
    if id.len() > max {
        return bad("it is too long");
    }
    if id.chars().any(char::is_control) {
        return bad("it contains a control character");
    }
    Ok(())
}

/// An identifier (key id, subject id, object id) was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{what} {value:?} is invalid: {reason}")]
pub struct InvalidId {
    /// Which kind of identifier.
    pub what: &'static str,
    /// The value (at most its first 64 characters).
    pub value: String,
    /// Why.
    pub reason: &'static str,
}

/// Whom a key's data belongs to, which decides its KEK.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "id")]
pub enum KeyScope {
    /// A dataset: wrapped under the keyring's dataset KEK.
    Dataset,
    /// An erasable data subject: wrapped under a KEK of the subject's own, which
    /// [`crate::Keyring::erase`] destroys.
    Subject(String),
}

impl KeyScope {
    /// The data subject, if this is a subject key.
    pub fn subject(&self) -> Option<&str> {
        match self {
            Self::Dataset => None,
            Self::Subject(s) => Some(s),
        }
    }
}

/// The state of one key version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VersionState {
    /// The primary version: encrypts new data and decrypts.
    Active,
    /// An older version: decrypts (at or above the minimum decryption version) until it is
    /// retired or its objects are rewrapped.
    DecryptOnly,
    /// Retired or erased: its wrapped data key is deleted; nothing under it decrypts.
    Destroyed,
}

impl std::fmt::Display for VersionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Active => "active",
            Self::DecryptOnly => "decrypt-only",
            Self::Destroyed => "destroyed",
        })
    }
}

/// One version of a key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRecord {
    /// Version number, from 1.
    pub version: u32,
    /// Its state.
    pub state: VersionState,
    /// When it was made.
    pub created_at: Timestamp,
    /// Who made it.
    pub created_by: String,
    /// The data key, wrapped under the key's KEK (RFC 5649); `None` once destroyed.
    #[serde(with = "hex_opt", default)]
    pub wrapped: Option<Vec<u8>>,
    /// When it was destroyed.
    #[serde(default)]
    pub destroyed_at: Option<Timestamp>,
    /// Who destroyed it.
    #[serde(default)]
    pub destroyed_by: Option<String>,
}

/// What is left of an erased key: who erased it and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    /// When.
    pub erased_at: Timestamp,
    /// Who.
    pub erased_by: String,
}

/// Everything the keyring persists about one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The key's id.
    pub id: KeyId,
    /// Dataset or data subject.
    pub scope: KeyScope,
    /// Label of the KEK its versions are wrapped under.
    pub kek_label: String,
    /// The primary version.
    pub primary: u32,
    /// Versions below this one refuse to decrypt.
    pub min_decrypt_version: u32,
    /// Every version ever made, in order.
    pub versions: Vec<VersionRecord>,
    /// Set when the key's data subject was erased.
    #[serde(default)]
    pub erased: Option<Tombstone>,
}

impl KeyRecord {
    /// The record of version `version`.
    pub fn version(&self, version: u32) -> Option<&VersionRecord> {
        self.versions.iter().find(|v| v.version == version)
    }

    pub(crate) fn version_mut(&mut self, version: u32) -> Option<&mut VersionRecord> {
        self.versions.iter_mut().find(|v| v.version == version)
    }
}

/// A stored value and the revision it was stored at (etcd's `mod_revision`, a counter in
/// redb); the revision is what a compare-and-swap compares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    /// The value.
    pub value: T,
    /// Its revision.
    pub revision: u64,
}

/// Where the keyring keeps key records. The engine implements it on its redb and etcd state
/// backends; [`MemoryMetaStore`] is the in-memory one.
pub trait KeyMetaStore: Send + Sync {
    /// The record of `key` and its revision, if the key exists.
    fn load(&self, key: &KeyId) -> Result<Option<Versioned<KeyRecord>>, MetaStoreError>;

    /// Stores `record` if the stored revision is still `expected` (`None`: only if the key
    /// does not exist yet), and returns the new revision. Otherwise fails with
    /// [`MetaStoreError::Conflict`] and stores nothing.
    fn store(&self, record: &KeyRecord, expected: Option<u64>) -> Result<u64, MetaStoreError>;

    /// The ids of every stored key (erased ones included), in any order.
    fn list(&self) -> Result<Vec<KeyId>, MetaStoreError>;
}

/// Why the metadata store failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MetaStoreError {
    /// The stored revision is not the expected one: another writer got there first.
    #[error(
        "key {key}: stored revision is {found:?}, expected {expected:?}; another writer changed it"
    )]
    Conflict {
        /// The key.
        key: KeyId,
        /// The revision the writer read.
        expected: Option<u64>,
        /// The revision found.
        found: Option<u64>,
    },
    /// A stored record does not decode.
    #[error("key {key}: stored record is corrupt")]
    Corrupt {
        /// The key.
        key: KeyId,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The backend failed.
    #[error("key metadata backend failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Key records in memory, serialized as JSON as a real backend would (so a record that does
/// not serialize fails here too). Revisions come from one counter, as in etcd.
#[derive(Debug, Default)]
pub struct MemoryMetaStore {
    inner: Mutex<MemoryInner>,
}

#[derive(Debug, Default)]
struct MemoryInner {
    records: BTreeMap<KeyId, (Vec<u8>, u64)>,
    revision: u64,
}

impl MemoryMetaStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The stored bytes of `key` (JSON), for inspection.
    pub fn raw(&self, key: &KeyId) -> Option<Vec<u8>> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.records.get(key).map(|(b, _)| b.clone())
    }
}

impl KeyMetaStore for MemoryMetaStore {
    fn load(&self, key: &KeyId) -> Result<Option<Versioned<KeyRecord>>, MetaStoreError> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((bytes, revision)) = inner.records.get(key) else {
            return Ok(None);
        };
        let value = serde_json::from_slice(bytes).map_err(|e| MetaStoreError::Corrupt {
            key: key.clone(),
            source: Box::new(e),
        })?;
        Ok(Some(Versioned {
            value,
            revision: *revision,
        }))
    }

    fn store(&self, record: &KeyRecord, expected: Option<u64>) -> Result<u64, MetaStoreError> {
        let bytes = serde_json::to_vec(record).map_err(|e| MetaStoreError::Backend(Box::new(e)))?;
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let found = inner.records.get(&record.id).map(|(_, r)| *r);
        if found != expected {
            return Err(MetaStoreError::Conflict {
                key: record.id.clone(),
                expected,
                found,
            });
        }
        inner.revision += 1;
        let revision = inner.revision;
        inner.records.insert(record.id.clone(), (bytes, revision));
        Ok(revision)
    }

    fn list(&self) -> Result<Vec<KeyId>, MetaStoreError> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(inner.records.keys().cloned().collect())
    }
}

/// Bytes as lowercase hex in serialized records (wrapped keys are opaque binary).
mod hex_opt {
    use serde::{Deserialize as _, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(bytes) => s.serialize_some(&hex::encode(bytes)),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        match hex::decode(&text) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(hex::FromHexError::OddLength) => {
                Err(serde::de::Error::custom("odd number of hex digits"))
            }
            Err(_) => Err(serde::de::Error::custom("invalid hex digit")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> KeyRecord {
        KeyRecord {
            id: KeyId::new(id).unwrap(),
            scope: KeyScope::Subject("alice".into()),
            kek_label: "l".into(),
            primary: 1,
            min_decrypt_version: 1,
            versions: vec![VersionRecord {
                version: 1,
                state: VersionState::Active,
                created_at: Timestamp::from_unix_seconds(5),
                created_by: "ops".into(),
                wrapped: Some(vec![0, 1, 0xfe]),
                destroyed_at: None,
                destroyed_by: None,
            }],
            erased: None,
        }
    }

    #[test]
    fn memory_store_round_trips_and_compares_revisions() {
        let store = MemoryMetaStore::new();
        let r = record("k");
        let rev = store.store(&r, None).unwrap();
        assert!(matches!(
            store.store(&r, None),
            Err(MetaStoreError::Conflict { found: Some(_), .. })
        ));
        let loaded = store.load(&r.id).unwrap().unwrap();
        assert_eq!((loaded.value.clone(), loaded.revision), (r.clone(), rev));
        let rev2 = store.store(&r, Some(rev)).unwrap();
        assert!(rev2 > rev);
        // A writer still holding the old revision loses.
        let err = store.store(&r, Some(rev)).unwrap_err();
        assert!(err.to_string().contains("another writer"), "{err}");
        assert_eq!(store.list().unwrap(), vec![r.id.clone()]);
        let json = String::from_utf8(store.raw(&r.id).unwrap()).unwrap();
        assert!(json.contains("\"wrapped\":\"0001fe\""), "{json}");
        assert!(
            json.contains("\"scope\":{\"kind\":\"subject\",\"id\":\"alice\"}"),
            "{json}"
        );
    }

    #[test]
    fn ids_are_checked() {
        assert!(KeyId::new("").is_err());
        assert!(KeyId::new("a\nb").is_err());
        assert!(KeyId::new("x".repeat(256)).is_err());
        assert_eq!(KeyId::new("dataset/a").unwrap().as_str(), "dataset/a");
        let bad: Result<KeyId, _> = serde_json::from_str("\"\"");
        assert!(bad.is_err());
    }
}
