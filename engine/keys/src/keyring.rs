//! The keyring: data keys with versions, wrapped by KEKs, rotated, retired and erased.
//!
//! Why this module exists: every encrypted object names a key and a key version; the keyring
//! is what turns that name into a data key, and refuses when policy or erasure says no. It
//! holds no state of its own beyond a cache: records live in a [`KeyMetaStore`], KEKs in a
//! [`KekProvider`], time comes from a [`Clock`].
//!
//! Invariants:
//! * A data key is persisted only wrapped under its key's KEK; the plaintext exists in memory
//!   only in the bounded [`cache`](crate::CacheStats), zeroized when evicted.
//! * Exactly one version is [`VersionState::Active`]: the primary. [`Keyring::rotate`] makes
//!   a new primary and turns the old one [`VersionState::DecryptOnly`].
//! * Decryption with a version requires: the key not erased, the version not destroyed, and
//!   the version at or above the minimum decryption version. The record is read on every
//!   lookup (so a retirement or erasure by another process takes effect at once); the KEK is
//!   asked only on a cache miss, once per key version.
//! * Every change is a compare-and-swap on the record's revision: of two writers that read
//!   the same revision, one wins and the other gets [`KeyError::Conflict`] (so two processes
//!   cannot both rotate). Only [`Keyring::erase`] retries, because erasing twice is harmless.
//! * The keyring decides nothing about *when* to rotate: it reports the primary version's
//!   age ([`KeyStatus::age`]) for the engine's policies to judge against the engine's clock.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;

use crate::cache::{CacheStats, KeyCache};
use crate::kek::{KekDescription, KekError, KekProvider, subject_kek_label};
use crate::meta::{
    InvalidId, KeyId, KeyMetaStore, KeyRecord, KeyScope, MAX_SUBJECT_LEN, MetaStoreError,
    Tombstone, VersionRecord, VersionState, Versioned, check_id,
};
use crate::secret::{DataKey, RandomError, RandomSource, SystemRandom};
use crate::time::{Clock, Timestamp};

/// Default label of the KEK that wraps dataset keys.
pub const DEFAULT_DATASET_KEK_LABEL: &str = "probity-dataset-kek";
/// Default bound on cached unwrapped data keys.
pub const DEFAULT_CACHE_CAPACITY: usize = 1024;
/// How often [`Keyring::erase`] retries a record that another writer changed meanwhile.
const ERASE_ATTEMPTS: usize = 8;

/// Settings of a [`Keyring`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyringOptions {
    /// Label of the KEK that wraps dataset keys. Default: [`DEFAULT_DATASET_KEK_LABEL`].
    pub dataset_kek_label: String,
    /// Most unwrapped data keys kept in memory. Default: [`DEFAULT_CACHE_CAPACITY`].
    pub cache_capacity: usize,
}

impl Default for KeyringOptions {
    fn default() -> Self {
        Self {
            dataset_kek_label: DEFAULT_DATASET_KEK_LABEL.to_owned(),
            cache_capacity: DEFAULT_CACHE_CAPACITY,
        }
    }
}

/// What encrypting and decrypting objects needs from a keyring. [`Keyring`] implements it;
/// known-answer tests implement it with fixed keys.
pub trait KeySource: Send + Sync {
    /// The primary version of `key` and its data key, for encrypting.
    fn encryption_key(&self, key: &KeyId) -> Result<(u32, Arc<DataKey>), KeyError>;
    /// The data key of `key` version `version`, if it may decrypt.
    fn decryption_key(&self, key: &KeyId, version: u32) -> Result<Arc<DataKey>, KeyError>;
    /// The versions of `key` that may decrypt now (to diagnose a header whose key version
    /// was substituted). Default: none.
    fn decryptable_versions(&self, key: &KeyId) -> Result<Vec<u32>, KeyError> {
        let _ = key;
        Ok(Vec::new())
    }
}

/// Data keys, their versions and their KEKs.
pub struct Keyring {
    store: Arc<dyn KeyMetaStore>,
    kek: Arc<dyn KekProvider>,
    clock: Arc<dyn Clock>,
    random: Arc<dyn RandomSource>,
    options: KeyringOptions,
    cache: KeyCache,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("kek", &self.kek.describe().summary)
            .field("options", &self.options)
            .field("cache", &self.cache.stats())
            .finish_non_exhaustive()
    }
}

/// The result of a rotation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rotation {
    /// The key.
    pub key: KeyId,
    /// The primary before (now decrypt-only).
    pub previous: u32,
    /// The new primary.
    pub primary: u32,
    /// When the new version was made.
    pub created_at: Timestamp,
}

/// One version, as [`Keyring::status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionStatus {
    /// Version number.
    pub version: u32,
    /// Its state.
    pub state: VersionState,
    /// When it was made.
    pub created_at: Timestamp,
    /// Who made it.
    pub created_by: String,
    /// Seconds since it was made, by the keyring's clock at the time of the report.
    pub age_seconds: u64,
    /// Whether it may decrypt now (not destroyed, not below the minimum, key not erased).
    pub decrypts: bool,
    /// When it was destroyed, if it was.
    pub destroyed_at: Option<Timestamp>,
}

/// One key, as [`Keyring::status`] reports it: what the engine's rotation policy reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyStatus {
    /// The key.
    pub id: KeyId,
    /// Dataset or data subject.
    pub scope: KeyScope,
    /// Label of its KEK.
    pub kek_label: String,
    /// The primary version.
    pub primary: u32,
    /// When the primary version was made (what a rotation rule ages).
    pub primary_created_at: Timestamp,
    /// The primary version's state (`active`, or `destroyed` once erased).
    pub primary_state: VersionState,
    /// Versions below this one refuse to decrypt.
    pub min_decrypt_version: u32,
    /// Every version.
    pub versions: Vec<VersionStatus>,
    /// Set if the key was erased.
    pub erased: Option<Tombstone>,
    /// The record's revision in the metadata store.
    pub revision: u64,
}

impl KeyStatus {
    /// How old the primary version is at `now` (zero if `now` is earlier).
    pub fn age(&self, now: Timestamp) -> Duration {
        self.primary_created_at.elapsed_until(now)
    }

    fn new(record: &Versioned<KeyRecord>, now: Timestamp) -> Self {
        let r = &record.value;
        let primary = r.version(r.primary);
        let versions = r
            .versions
            .iter()
            .map(|v| VersionStatus {
                version: v.version,
                state: v.state,
                created_at: v.created_at,
                created_by: v.created_by.clone(),
                age_seconds: v.created_at.elapsed_until(now).as_secs(),
                decrypts: r.erased.is_none()
                    && v.state != VersionState::Destroyed
                    && v.version >= r.min_decrypt_version,
                destroyed_at: v.destroyed_at,
            })
            .collect();
        Self {
            id: r.id.clone(),
            scope: r.scope.clone(),
            kek_label: r.kek_label.clone(),
            primary: r.primary,
            primary_created_at: primary.map_or(Timestamp::from_unix_seconds(0), |v| v.created_at),
            primary_state: primary.map_or(VersionState::Destroyed, |v| v.state),
            min_decrypt_version: r.min_decrypt_version,
            versions,
            erased: r.erased.clone(),
            revision: record.revision,
        }
    }
}

/// Every key, as [`Keyring::status`] reports them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyringStatus {
    /// Where the KEKs live (says "software KEK: not an HSM" when they are not in an HSM).
    pub kek: KekDescription,
    /// The keyring clock's time when the report was made; ages are counted to it.
    pub now: Timestamp,
    /// The keys, by id.
    pub keys: Vec<KeyStatus>,
}

/// One erased key in an [`ErasureRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErasedKey {
    /// The key.
    pub key: KeyId,
    /// Its versions, all destroyed by the erasure.
    pub versions: Vec<u32>,
}

/// What [`Keyring::erase`] did, for the engine's audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErasureRecord {
    /// The data subject.
    pub subject: String,
    /// When.
    pub erased_at: Timestamp,
    /// Who.
    pub erased_by: String,
    /// The subject's KEK label(s), destroyed.
    pub kek_labels: Vec<String>,
    /// Where the KEK lived.
    pub kek: KekDescription,
    /// The subject's keys and their versions.
    pub keys: Vec<ErasedKey>,
    /// The objects that were encrypted under those keys, as the caller tracked them.
    pub objects: Vec<String>,
}

/// Why a keyring operation failed, or why a key may not be used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KeyError {
    /// An identifier was refused.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// No such key.
    #[error("no key \"{key}\" in the keyring")]
    UnknownKey {
        /// The key.
        key: KeyId,
    },
    /// The key exists already.
    #[error("key \"{key}\" already exists")]
    KeyExists {
        /// The key.
        key: KeyId,
    },
    /// No such version.
    #[error("key \"{key}\" has no version {version} (primary is {primary})")]
    UnknownVersion {
        /// The key.
        key: KeyId,
        /// The version asked for.
        version: u32,
        /// The primary version.
        primary: u32,
    },
    /// The version was destroyed (retired): its data key is gone.
    #[error(
        "key \"{key}\" version {version} was destroyed on {} by {by}: data encrypted under it cannot be decrypted",
        at.date()
    )]
    VersionDestroyed {
        /// The key.
        key: KeyId,
        /// The version.
        version: u32,
        /// When.
        at: Timestamp,
        /// By whom.
        by: String,
    },
    /// The version is below the key's minimum decryption version.
    #[error(
        "key \"{key}\" version {version} is below the minimum decryption version {min}: it may no longer decrypt"
    )]
    BelowMinimum {
        /// The key.
        key: KeyId,
        /// The version.
        version: u32,
        /// The minimum.
        min: u32,
    },
    /// The key's data subject was erased (crypto-shredded).
    #[error(
        "key \"{key}\" of data subject {subject:?} was erased on {} by {by} (its KEK was destroyed): data encrypted under it cannot be decrypted",
        at.date()
    )]
    Erased {
        /// The key.
        key: KeyId,
        /// The data subject.
        subject: String,
        /// When.
        at: Timestamp,
        /// By whom.
        by: String,
    },
    /// The primary version cannot be retired; rotate first.
    #[error("key \"{key}\" version {version} is the primary: rotate before retiring it")]
    RetirePrimary {
        /// The key.
        key: KeyId,
        /// The version.
        version: u32,
    },
    /// The minimum decryption version may only rise, and not above the primary.
    #[error(
        "key \"{key}\": minimum decryption version {requested} refused: it is {current} now and the primary is {primary}"
    )]
    MinimumRefused {
        /// The key.
        key: KeyId,
        /// The requested minimum.
        requested: u32,
        /// The current minimum.
        current: u32,
        /// The primary version.
        primary: u32,
    },
    /// Another writer changed the key's record since it was read; nothing was written.
    #[error("key \"{key}\" was changed by another writer; nothing was written, re-read and retry")]
    Conflict {
        /// The key.
        key: KeyId,
        /// The store's report.
        #[source]
        source: MetaStoreError,
    },
    /// No key belongs to this data subject.
    #[error("no key belongs to data subject {subject:?}")]
    UnknownSubject {
        /// The data subject.
        subject: String,
    },
    /// The subject was erased already and its KEK is gone.
    #[error("data subject {subject:?} was already erased on {}", at.date())]
    AlreadyErased {
        /// The data subject.
        subject: String,
        /// When.
        at: Timestamp,
    },
    /// A version that should have a wrapped data key has none (the record is inconsistent).
    #[error("key \"{key}\" version {version} is {state} but its record holds no wrapped data key")]
    MissingWrappedKey {
        /// The key.
        key: KeyId,
        /// The version.
        version: u32,
        /// Its state.
        state: VersionState,
    },
    /// The version numbers are exhausted.
    #[error("key \"{key}\" cannot have more than {max} versions", max = u32::MAX)]
    TooManyVersions {
        /// The key.
        key: KeyId,
    },
    /// The KEK provider failed for this key.
    #[error("KEK {kek_label:?} could not {operation} the data key of \"{key}\" version {version}")]
    Kek {
        /// The key.
        key: KeyId,
        /// The version.
        version: u32,
        /// The KEK label.
        kek_label: String,
        /// `wrap`, `unwrap`, `create the KEK for`, `destroy the KEK of`.
        operation: &'static str,
        /// Why.
        #[source]
        source: Box<KekError>,
    },
    /// The metadata store failed.
    #[error("key metadata store failed for \"{key}\"")]
    Store {
        /// The key (empty for a listing).
        key: String,
        /// Why.
        #[source]
        source: MetaStoreError,
    },
    /// The random generator failed.
    #[error(transparent)]
    Random(#[from] RandomError),
}

impl KeyError {
    /// Whether the key or version may never decrypt again (erased or destroyed), as opposed
    /// to a refusal that policy could lift or a failure of the environment.
    pub fn is_shredded(&self) -> bool {
        matches!(self, Self::Erased { .. } | Self::VersionDestroyed { .. })
    }
}

fn store_err(key: &KeyId) -> impl FnOnce(MetaStoreError) -> KeyError {
    let key = key.clone();
    move |source| match source {
        MetaStoreError::Conflict { .. } => KeyError::Conflict { key, source },
        source => KeyError::Store {
            key: key.to_string(),
            source,
        },
    }
}

fn check_actor(actor: &str) -> Result<(), KeyError> {
    Ok(check_id("actor", actor, 256)?)
}

impl Keyring {
    /// A keyring over `store`, with KEKs from `kek` and time from `clock`.
    pub fn new(
        store: Arc<dyn KeyMetaStore>,
        kek: Arc<dyn KekProvider>,
        clock: Arc<dyn Clock>,
        options: KeyringOptions,
    ) -> Self {
        let cache = KeyCache::new(options.cache_capacity);
        Self {
            store,
            kek,
            clock,
            random: Arc::new(SystemRandom::new()),
            options,
            cache,
        }
    }

    /// Replaces the random source (the operating system's by default) that makes data keys.
    pub fn with_random(mut self, random: Arc<dyn RandomSource>) -> Self {
        self.random = random;
        self
    }

    /// Where the KEKs live.
    pub fn describe_kek(&self) -> KekDescription {
        self.kek.describe()
    }

    /// Counters of the unwrapped-key cache: `unwraps` counts KEK round trips.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Drops every cached data key (they are zeroized once no object in flight holds one).
    pub fn clear_cache(&self) {
        self.cache.clear();
    }

    fn load(&self, key: &KeyId) -> Result<Versioned<KeyRecord>, KeyError> {
        self.store
            .load(key)
            .map_err(store_err(key))?
            .ok_or_else(|| KeyError::UnknownKey { key: key.clone() })
    }

    fn erased_err(record: &KeyRecord) -> Option<KeyError> {
        record.erased.as_ref().map(|t| KeyError::Erased {
            key: record.id.clone(),
            subject: record.scope.subject().unwrap_or_default().to_owned(),
            at: t.erased_at,
            by: t.erased_by.clone(),
        })
    }

    fn wrap_new(
        &self,
        key: &KeyId,
        version: u32,
        kek_label: &str,
    ) -> Result<(DataKey, Vec<u8>), KeyError> {
        let data_key = DataKey::generate(self.random.as_ref())?;
        let wrapped = self
            .kek
            .wrap(kek_label, &data_key)
            .map_err(|source| KeyError::Kek {
                key: key.clone(),
                version,
                kek_label: kek_label.to_owned(),
                operation: "wrap",
                source: Box::new(source),
            })?;
        Ok((data_key, wrapped))
    }

    /// Creates `key` with version 1 as its primary, made by `actor`. A dataset key is wrapped
    /// under the dataset KEK, a subject key under the subject's own KEK; either KEK is found
    /// (and checked) or generated.
    pub fn create(&self, key: &KeyId, scope: KeyScope, actor: &str) -> Result<KeyStatus, KeyError> {
        check_actor(actor)?;
        let kek_label = match &scope {
            KeyScope::Dataset => self.options.dataset_kek_label.clone(),
            KeyScope::Subject(subject) => {
                check_id("data subject id", subject, MAX_SUBJECT_LEN)?;
                subject_kek_label(subject)
            }
        };
        if self.store.load(key).map_err(store_err(key))?.is_some() {
            return Err(KeyError::KeyExists { key: key.clone() });
        }
        self.kek
            .ensure_kek(&kek_label)
            .map_err(|source| KeyError::Kek {
                key: key.clone(),
                version: 1,
                kek_label: kek_label.clone(),
                operation: "create the KEK for",
                source: Box::new(source),
            })?;
        let (data_key, wrapped) = self.wrap_new(key, 1, &kek_label)?;
        let now = Timestamp::now(&*self.clock);
        let record = KeyRecord {
            id: key.clone(),
            scope,
            kek_label,
            primary: 1,
            min_decrypt_version: 1,
            versions: vec![VersionRecord {
                version: 1,
                state: VersionState::Active,
                created_at: now,
                created_by: actor.to_owned(),
                wrapped: Some(wrapped),
                destroyed_at: None,
                destroyed_by: None,
            }],
            erased: None,
        };
        let revision = self.store.store(&record, None).map_err(|e| match e {
            MetaStoreError::Conflict { .. } => KeyError::KeyExists { key: key.clone() },
            e => store_err(key)(e),
        })?;
        self.cache.insert(key, 1, Arc::new(data_key));
        Ok(KeyStatus::new(
            &Versioned {
                value: record,
                revision,
            },
            now,
        ))
    }

    /// Makes a new version of `key` the primary; the old primary becomes decrypt-only and
    /// keeps decrypting until it is retired or its objects are rewrapped.
    pub fn rotate(&self, key: &KeyId, actor: &str) -> Result<Rotation, KeyError> {
        check_actor(actor)?;
        let Versioned {
            value: mut record,
            revision,
        } = self.load(key)?;
        if let Some(e) = Self::erased_err(&record) {
            return Err(e);
        }
        let previous = record.primary;
        let next = record
            .versions
            .iter()
            .map(|v| v.version)
            .max()
            .unwrap_or(0)
            .checked_add(1)
            .ok_or_else(|| KeyError::TooManyVersions { key: key.clone() })?;
        let (data_key, wrapped) = self.wrap_new(key, next, &record.kek_label)?;
        let now = Timestamp::now(&*self.clock);
        if let Some(old) = record.version_mut(previous)
            && old.state == VersionState::Active
        {
            old.state = VersionState::DecryptOnly;
        }
        record.versions.push(VersionRecord {
            version: next,
            state: VersionState::Active,
            created_at: now,
            created_by: actor.to_owned(),
            wrapped: Some(wrapped),
            destroyed_at: None,
            destroyed_by: None,
        });
        record.primary = next;
        self.store
            .store(&record, Some(revision))
            .map_err(store_err(key))?;
        self.cache.insert(key, next, Arc::new(data_key));
        Ok(Rotation {
            key: key.clone(),
            previous,
            primary: next,
            created_at: now,
        })
    }

    /// Destroys version `version` of `key`: its wrapped data key is deleted from the record,
    /// and nothing encrypted under it decrypts any more (rewrap first what must survive).
    pub fn retire(&self, key: &KeyId, version: u32, actor: &str) -> Result<KeyStatus, KeyError> {
        check_actor(actor)?;
        let Versioned {
            value: mut record,
            revision,
        } = self.load(key)?;
        if let Some(e) = Self::erased_err(&record) {
            return Err(e);
        }
        if version == record.primary {
            return Err(KeyError::RetirePrimary {
                key: key.clone(),
                version,
            });
        }
        let primary = record.primary;
        let now = Timestamp::now(&*self.clock);
        let v = record
            .version_mut(version)
            .ok_or_else(|| KeyError::UnknownVersion {
                key: key.clone(),
                version,
                primary,
            })?;
        if v.state == VersionState::Destroyed {
            return Err(KeyError::VersionDestroyed {
                key: key.clone(),
                version,
                at: v.destroyed_at.unwrap_or(now),
                by: v.destroyed_by.clone().unwrap_or_default(),
            });
        }
        v.state = VersionState::Destroyed;
        v.wrapped = None;
        v.destroyed_at = Some(now);
        v.destroyed_by = Some(actor.to_owned());
        let revision = self
            .store
            .store(&record, Some(revision))
            .map_err(store_err(key))?;
        self.cache.evict(key, |v| v == version);
        Ok(KeyStatus::new(
            &Versioned {
                value: record,
                revision,
            },
            now,
        ))
    }

    /// Raises the minimum decryption version of `key` to `version` (at most the primary):
    /// older versions refuse to decrypt from now on.
    pub fn set_min_decrypt_version(
        &self,
        key: &KeyId,
        version: u32,
        actor: &str,
    ) -> Result<KeyStatus, KeyError> {
        check_actor(actor)?;
        let Versioned {
            value: mut record,
            revision,
        } = self.load(key)?;
        if let Some(e) = Self::erased_err(&record) {
            return Err(e);
        }
        if version < record.min_decrypt_version || version > record.primary {
            return Err(KeyError::MinimumRefused {
                key: key.clone(),
                requested: version,
                current: record.min_decrypt_version,
                primary: record.primary,
            });
        }
        record.min_decrypt_version = version;
        let revision = self
            .store
            .store(&record, Some(revision))
            .map_err(store_err(key))?;
        self.cache.evict(key, |v| v < version);
        Ok(KeyStatus::new(
            &Versioned {
                value: record,
                revision,
            },
            Timestamp::now(&*self.clock),
        ))
    }

    /// The status of `key`.
    pub fn key_status(&self, key: &KeyId) -> Result<KeyStatus, KeyError> {
        Ok(KeyStatus::new(
            &self.load(key)?,
            Timestamp::now(&*self.clock),
        ))
    }

    /// Every key with its versions, states and ages, and where the KEKs live.
    pub fn status(&self) -> Result<KeyringStatus, KeyError> {
        let now = Timestamp::now(&*self.clock);
        let mut ids = self.store.list().map_err(|source| KeyError::Store {
            key: String::new(),
            source,
        })?;
        ids.sort();
        let mut keys = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(record) = self.store.load(&id).map_err(store_err(&id))? {
                keys.push(KeyStatus::new(&record, now));
            }
        }
        Ok(KeyringStatus {
            kek: self.kek.describe(),
            now,
            keys,
        })
    }

    /// Erases data subject `subject` (right to erasure): destroys the subject's KEK (in the
    /// HSM: `C_DestroyObject`; software: the file is overwritten and deleted), deletes the
    /// wrapped data keys from every key record of the subject and leaves a tombstone, so
    /// every later decryption fails with [`KeyError::Erased`] naming the date. `objects` are
    /// the objects the caller knows were encrypted under the subject's keys; they are only
    /// recorded.
    ///
    /// Idempotent until it has fully succeeded: if the KEK could not be destroyed, running it
    /// again finishes the job. Finds the subject's keys by listing every key (O(keys)); the
    /// tombstone keeps the subject id, so later failures can say whose data was erased.
    pub fn erase(
        &self,
        subject: &str,
        actor: &str,
        objects: Vec<String>,
    ) -> Result<ErasureRecord, KeyError> {
        check_actor(actor)?;
        check_id("data subject id", subject, MAX_SUBJECT_LEN)?;
        let now = Timestamp::now(&*self.clock);
        let ids = self.store.list().map_err(|source| KeyError::Store {
            key: String::new(),
            source,
        })?;
        let mut keys = Vec::new();
        let mut labels: Vec<String> = Vec::new();
        let mut earlier: Option<Timestamp> = None;
        let mut newly_erased = 0usize;
        for id in ids {
            let Some(first) = self.store.load(&id).map_err(store_err(&id))? else {
                continue;
            };
            if first.value.scope.subject() != Some(subject) {
                continue;
            }
            let mut current = first;
            let mut attempts = 0;
            let record = loop {
                attempts += 1;
                let mut record = current.value.clone();
                if let Some(t) = &record.erased {
                    earlier = Some(earlier.map_or(t.erased_at, |e| e.min(t.erased_at)));
                    break record;
                }
                for v in &mut record.versions {
                    if v.state != VersionState::Destroyed {
                        v.state = VersionState::Destroyed;
                        v.destroyed_at = Some(now);
                        v.destroyed_by = Some(actor.to_owned());
                    }
                    v.wrapped = None;
                }
                record.erased = Some(Tombstone {
                    erased_at: now,
                    erased_by: actor.to_owned(),
                });
                match self.store.store(&record, Some(current.revision)) {
                    Ok(_) => {
                        newly_erased += 1;
                        break record;
                    }
                    Err(MetaStoreError::Conflict { .. }) if attempts < ERASE_ATTEMPTS => {
                        current = self.load(&id)?;
                    }
                    Err(e) => return Err(store_err(&id)(e)),
                }
            };
            self.cache.evict(&id, |_| true);
            if !labels.contains(&record.kek_label) {
                labels.push(record.kek_label.clone());
            }
            keys.push(ErasedKey {
                key: id,
                versions: record.versions.iter().map(|v| v.version).collect(),
            });
        }
        if keys.is_empty() {
            return Err(KeyError::UnknownSubject {
                subject: subject.to_owned(),
            });
        }
        let mut destroyed_any = false;
        if let Some(first) = keys.first() {
            for label in &labels {
                let kek_err = |source| KeyError::Kek {
                    key: first.key.clone(),
                    version: 0,
                    kek_label: label.clone(),
                    operation: "destroy the KEK of",
                    source: Box::new(source),
                };
                if self.kek.kek_exists(label).map_err(kek_err)? {
                    self.kek.destroy_kek(label).map_err(kek_err)?;
                    destroyed_any = true;
                }
            }
        }
        if let Some(at) = earlier
            && newly_erased == 0
            && !destroyed_any
        {
            return Err(KeyError::AlreadyErased {
                subject: subject.to_owned(),
                at,
            });
        }
        Ok(ErasureRecord {
            subject: subject.to_owned(),
            erased_at: now,
            erased_by: actor.to_owned(),
            kek_labels: labels,
            kek: self.kek.describe(),
            keys,
            objects,
        })
    }

    /// The data key of `record` version `version`, checked for use in decryption.
    fn usable_key(&self, record: &KeyRecord, version: u32) -> Result<Arc<DataKey>, KeyError> {
        if let Some(e) = Self::erased_err(record) {
            return Err(e);
        }
        let key = &record.id;
        let v = record
            .version(version)
            .ok_or_else(|| KeyError::UnknownVersion {
                key: key.clone(),
                version,
                primary: record.primary,
            })?;
        if v.state == VersionState::Destroyed {
            return Err(KeyError::VersionDestroyed {
                key: key.clone(),
                version,
                at: v.destroyed_at.unwrap_or(Timestamp::from_unix_seconds(0)),
                by: v.destroyed_by.clone().unwrap_or_default(),
            });
        }
        if version < record.min_decrypt_version {
            return Err(KeyError::BelowMinimum {
                key: key.clone(),
                version,
                min: record.min_decrypt_version,
            });
        }
        self.cache.get_or_unwrap(key, version, || {
            let wrapped = v.wrapped.as_deref().ok_or(KeyError::MissingWrappedKey {
                key: key.clone(),
                version,
                state: v.state,
            })?;
            self.kek
                .unwrap(&record.kek_label, wrapped)
                .map_err(|source| KeyError::Kek {
                    key: key.clone(),
                    version,
                    kek_label: record.kek_label.clone(),
                    operation: "unwrap",
                    source: Box::new(source),
                })
        })
    }
}

impl KeySource for Keyring {
    fn encryption_key(&self, key: &KeyId) -> Result<(u32, Arc<DataKey>), KeyError> {
        let record = self.load(key)?.value;
        let primary = record.primary;
        Ok((primary, self.usable_key(&record, primary)?))
    }

    fn decryption_key(&self, key: &KeyId, version: u32) -> Result<Arc<DataKey>, KeyError> {
        let record = self.load(key)?.value;
        self.usable_key(&record, version)
    }

    fn decryptable_versions(&self, key: &KeyId) -> Result<Vec<u32>, KeyError> {
        let record = self.load(key)?.value;
        if record.erased.is_some() {
            return Ok(Vec::new());
        }
        Ok(record
            .versions
            .iter()
            .filter(|v| {
                v.state != VersionState::Destroyed && v.version >= record.min_decrypt_version
            })
            .map(|v| v.version)
            .collect())
    }
}
