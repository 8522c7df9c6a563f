//! The bounded cache of unwrapped data keys.
//!
//! Why this module exists: unwrapping a data key is a round trip to the HSM, and a dataset of
//! a million objects under one key version must not pay it a million times. Each key version
//! is unwrapped once and kept here, zeroized when evicted (the last `Arc` drops the
//! [`DataKey`]). The cache is bounded (least recently used out first) so a keyring with many
//! subjects does not keep every key in memory; retiring or erasing a key evicts it at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::meta::KeyId;
use crate::secret::DataKey;

/// Counters of the unwrapped-key cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct CacheStats {
    /// Lookups served from the cache.
    pub hits: u64,
    /// Data keys unwrapped through the KEK provider (cache misses).
    pub unwraps: u64,
    /// Entries held now.
    pub entries: usize,
    /// The bound on entries.
    pub capacity: usize,
}

#[derive(Debug)]
pub(crate) struct KeyCache {
    capacity: usize,
    inner: Mutex<Inner>,
    /// Held while unwrapping, so concurrent misses on one version unwrap it once.
    unwrapping: Mutex<()>,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<(KeyId, u32), (Arc<DataKey>, u64)>,
    tick: u64,
    hits: u64,
    unwraps: u64,
}

impl KeyCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
            unwrapping: Mutex::new(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached key, counting a hit.
    pub(crate) fn get(&self, key: &KeyId, version: u32) -> Option<Arc<DataKey>> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let found = inner.map.get_mut(&(key.clone(), version)).map(|(k, used)| {
            *used = tick;
            Arc::clone(k)
        });
        if found.is_some() {
            inner.hits += 1;
        }
        found
    }

    /// Looks `key`/`version` up, or runs `unwrap` once (serialized with other misses) and
    /// caches its result.
    pub(crate) fn get_or_unwrap<E>(
        &self,
        key: &KeyId,
        version: u32,
        unwrap: impl FnOnce() -> Result<DataKey, E>,
    ) -> Result<Arc<DataKey>, E> {
        if let Some(k) = self.get(key, version) {
            return Ok(k);
        }
        let _one_at_a_time = self
            .unwrapping
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = self.get(key, version) {
            return Ok(k);
        }
        let data_key = Arc::new(unwrap()?);
        self.lock().unwraps += 1;
        self.insert(key, version, Arc::clone(&data_key));
        Ok(data_key)
    }

    pub(crate) fn insert(&self, key: &KeyId, version: u32, data_key: Arc<DataKey>) {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if inner.map.len() >= self.capacity && !inner.map.contains_key(&(key.clone(), version)) {
            let oldest = inner
                .map
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                inner.map.remove(&oldest);
            }
        }
        inner.map.insert((key.clone(), version), (data_key, tick));
    }

    /// Evicts the versions of `key` for which `which` is true.
    pub(crate) fn evict(&self, key: &KeyId, which: impl Fn(u32) -> bool) {
        self.lock().map.retain(|(k, v), _| !(k == key && which(*v)));
    }

    pub(crate) fn clear(&self) {
        self.lock().map.clear();
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            hits: inner.hits,
            unwraps: inner.unwraps,
            entries: inner.map.len(),
            capacity: self.capacity,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_least_recently_used_and_unwraps_once() {
        let cache = KeyCache::new(2);
        let a = KeyId::new("a").unwrap();
        let b = KeyId::new("b").unwrap();
        let mut calls = 0;
        for _ in 0..3 {
            cache
                .get_or_unwrap::<()>(&a, 1, || {
                    calls += 1;
                    Ok(DataKey::from_bytes([1; 32]))
                })
                .unwrap();
        }
        assert_eq!(calls, 1);
        cache
            .get_or_unwrap::<()>(&b, 1, || Ok(DataKey::from_bytes([2; 32])))
            .unwrap();
        // a@1 was used more recently than b@1? No: b@1 was inserted last. Touch a@1.
        assert!(cache.get(&a, 1).is_some());
        cache
            .get_or_unwrap::<()>(&a, 2, || Ok(DataKey::from_bytes([3; 32])))
            .unwrap();
        assert!(cache.get(&b, 1).is_none(), "b@1 was least recently used");
        assert!(cache.get(&a, 1).is_some());
        let s = cache.stats();
        assert_eq!((s.unwraps, s.entries, s.capacity), (3, 2, 2));
        cache.evict(&a, |v| v < 2);
        assert!(cache.get(&a, 1).is_none());
        assert!(cache.get(&a, 2).is_some());
        // A failed unwrap caches nothing.
        assert!(cache.get_or_unwrap(&b, 9, || Err("no")).is_err());
        assert!(cache.get(&b, 9).is_none());
    }
}
