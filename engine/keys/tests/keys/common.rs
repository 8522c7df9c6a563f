//! Helpers shared by the test modules.

use std::collections::{HashMap, VecDeque};
use std::io::{Cursor, Read as _};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use probity_keys::{
    DataKey, DecryptingReader, KekDescription, KekError, KekOutcome, KekProvider, KeyError, KeyId,
    KeySource, Keyring, KeyringOptions, ManualClock, MemoryMetaStore, RandomError, RandomSource,
    SoftwareKek, StreamError, Timestamp,
};

/// 2026-01-01T00:00:00Z.
pub const START: Timestamp = Timestamp::from_unix_seconds(1_767_225_600);
pub const DAY: u64 = 86_400;

/// Deterministic content, distinct per position.
pub fn content(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn hex(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap()
}

/// Randomness that hands out fixed bytes in order (for known answers only).
pub struct FixedRandom(Mutex<VecDeque<u8>>);

impl FixedRandom {
    pub fn new(bytes: &[u8]) -> Self {
        Self(Mutex::new(bytes.iter().copied().collect()))
    }
}

impl RandomSource for FixedRandom {
    fn fill(&self, dest: &mut [u8]) -> Result<(), RandomError> {
        let mut q = self.0.lock().unwrap();
        for b in dest {
            *b = q.pop_front().ok_or(RandomError)?;
        }
        Ok(())
    }
}

/// Fixed data keys for one key id.
pub struct StaticKeys {
    pub key: KeyId,
    pub primary: u32,
    pub keys: HashMap<u32, Arc<DataKey>>,
}

impl KeySource for StaticKeys {
    fn encryption_key(&self, key: &KeyId) -> Result<(u32, Arc<DataKey>), KeyError> {
        Ok((self.primary, self.decryption_key(key, self.primary)?))
    }
    fn decryption_key(&self, key: &KeyId, version: u32) -> Result<Arc<DataKey>, KeyError> {
        if *key != self.key {
            return Err(KeyError::UnknownKey { key: key.clone() });
        }
        self.keys
            .get(&version)
            .cloned()
            .ok_or_else(|| KeyError::UnknownVersion {
                key: key.clone(),
                version,
                primary: self.primary,
            })
    }
    fn decryptable_versions(&self, _key: &KeyId) -> Result<Vec<u32>, KeyError> {
        let mut v: Vec<u32> = self.keys.keys().copied().collect();
        v.sort_unstable();
        Ok(v)
    }
}

/// A KEK provider that counts unwraps (HSM round trips).
pub struct CountingKek {
    pub inner: Arc<dyn KekProvider>,
    pub unwraps: AtomicUsize,
}

impl CountingKek {
    pub fn new(inner: Arc<dyn KekProvider>) -> Self {
        Self {
            inner,
            unwraps: AtomicUsize::new(0),
        }
    }
    pub fn unwraps(&self) -> usize {
        self.unwraps.load(Ordering::SeqCst)
    }
}

impl KekProvider for CountingKek {
    fn describe(&self) -> KekDescription {
        self.inner.describe()
    }
    fn generate_kek(&self, label: &str) -> Result<(), KekError> {
        self.inner.generate_kek(label)
    }
    fn ensure_kek(&self, label: &str) -> Result<KekOutcome, KekError> {
        self.inner.ensure_kek(label)
    }
    fn kek_exists(&self, label: &str) -> Result<bool, KekError> {
        self.inner.kek_exists(label)
    }
    fn wrap(&self, label: &str, key: &DataKey) -> Result<Vec<u8>, KekError> {
        self.inner.wrap(label, key)
    }
    fn unwrap(&self, label: &str, wrapped: &[u8]) -> Result<DataKey, KekError> {
        self.unwraps.fetch_add(1, Ordering::SeqCst);
        self.inner.unwrap(label, wrapped)
    }
    fn destroy_kek(&self, label: &str) -> Result<(), KekError> {
        self.inner.destroy_kek(label)
    }
}

/// A keyring over a memory store and a software KEK directory under `dir`, at [`START`].
pub struct Setup {
    pub store: Arc<MemoryMetaStore>,
    pub kek: Arc<dyn KekProvider>,
    pub clock: Arc<ManualClock>,
    pub keyring: Keyring,
}

impl Setup {
    pub fn software(dir: &Path) -> Self {
        let kek: Arc<dyn KekProvider> = Arc::new(SoftwareKek::open(&dir.join("kek")).unwrap());
        Self::with_kek(kek)
    }

    pub fn with_kek(kek: Arc<dyn KekProvider>) -> Self {
        let store = Arc::new(MemoryMetaStore::new());
        let clock = Arc::new(ManualClock::at(START.unix_seconds() as i64));
        let keyring = Keyring::new(
            store.clone(),
            kek.clone(),
            clock.clone(),
            KeyringOptions::default(),
        );
        Self {
            store,
            kek,
            clock,
            keyring,
        }
    }

    /// Another keyring over the same store and KEKs (another process, a cold cache).
    pub fn another(&self, kek: Arc<dyn KekProvider>) -> Keyring {
        Keyring::new(
            self.store.clone(),
            kek,
            self.clock.clone(),
            KeyringOptions::default(),
        )
    }
}

pub fn key(id: &str) -> KeyId {
    KeyId::new(id).unwrap()
}

/// Decrypts an encrypted object held in memory through [`DecryptingReader`].
pub fn decrypt(keys: &dyn KeySource, object: &str, sealed: &[u8]) -> Result<Vec<u8>, StreamError> {
    let mut r = DecryptingReader::open(keys, object, Cursor::new(sealed))?;
    let mut out = Vec::new();
    match r.read_to_end(&mut out) {
        Ok(_) => Ok(out),
        Err(e) => Err(*e.into_inner().unwrap().downcast::<StreamError>().unwrap()),
    }
}
