//! The cache's own work: entering a world, interning request texts, the doorkeeper,
//! lookups that check each dependency, stores within the byte budget, and evictions
//! that take from the caller holding the most.

use super::*;

impl DecisionCache {
    /// The default byte budget (32 MiB).
    pub const DEFAULT_BUDGET_BYTES: usize = DEFAULT_DECISION_CACHE_BYTES;

    /// A cache of at most about `bytes` of decisions (0: it keeps none).
    pub fn with_budget(bytes: usize) -> Self {
        Self {
            world: Mutex::new(None),
            generation: AtomicU64::new(0),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            budget: AtomicUsize::new(bytes),
            owners: (0..OWNER_BUCKETS).map(|_| AtomicUsize::new(0)).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
            requests: Mutex::new(Interned::default()),
            fanouts: Mutex::new(std::collections::VecDeque::new()),
            doorkeeper: (0..DOORKEEPER_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// Sets the byte budget: a lower one is reached as entries are next stored; 0
    /// keeps nothing more (and [`Engine::decide_with`] no longer asks the cache).
    pub fn set_budget(&self, bytes: usize) {
        self.budget.store(bytes, Ordering::Relaxed);
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget.load(Ordering::Relaxed)
    }

    /// Decisions reused so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Decisions made afresh so far (not found, or their facts changed).
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// What it has done and holds.
    pub fn stats(&self) -> DecisionCacheStats {
        let (entries, bytes) = self.shards.iter().fold((0, 0), |(n, b), s| {
            let s = s.lock().unwrap_or_else(PoisonError::into_inner);
            (n + s.map.len(), b + s.bytes)
        });
        DecisionCacheStats {
            hits: self.hits(),
            misses: self.misses(),
            evictions: self.evictions.load(Ordering::Relaxed),
            entries,
            bytes,
            budget: self.budget(),
        }
    }

    /// Decisions held now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).map.len())
            .sum()
    }

    /// Whether it holds no decision.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lets every decision go (the counters stay).
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for entry in shard.map.values() {
                self.release(entry);
            }
            *shard = Shard::default();
        }
        self.fanouts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// The bucket `caller` is counted in (the library's own callers name none).
    ///
    /// A fixed hash, the same in every process, so that which callers share a bucket
    /// does not change from run to run (the names are authenticated identities).
    pub(super) fn owner_of(&self, caller: Option<&str>) -> usize {
        caller.map_or(0, |c| {
            let hash = std::hash::BuildHasher::hash_one(&crate::hashing::FastHash::default(), c);
            (hash as usize) % OWNER_BUCKETS
        })
    }

    /// Empties the cache if `snapshot` was not what its entries were decided under.
    /// Returns the generation the caller's entries belong to.
    pub(super) fn enter(&self, snapshot: &Snapshot) -> u64 {
        let mut world = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        if world.as_ref().is_some_and(|w| w.is(snapshot)) {
            return self.generation.load(Ordering::Relaxed);
        }
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        self.clear();
        *world = Some(World::of(snapshot));
        generation
    }

    /// Uncounts `entry` from its caller's share.
    pub(super) fn release(&self, entry: &Entry) {
        if let Some(held) = self.owners.get(entry.owner) {
            let _ = held.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(entry.bytes))
            });
        }
    }

    /// The fan-out of `request` over `resources` if it was asked before; if not, it is
    /// remembered as asked (the newest), and `None`.
    pub(super) fn fanout(
        &self,
        request: &Arc<str>,
        resources: &[EntityUid],
    ) -> Option<Arc<Fanout>> {
        let resources_hash = {
            let mut h = self.hasher.build_hasher();
            for r in resources {
                std::hash::Hash::hash(r.0.as_ref(), &mut h);
            }
            std::hash::Hasher::finish(&h)
        };
        let resources_len = resources.len();
        let mut fanouts = self.fanouts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = fanouts
            .iter()
            .position(|f| f.is(request, resources_hash, resources_len))
        {
            let found = fanouts.remove(i)?;
            fanouts.push_front(Arc::clone(&found));
            return Some(found);
        }
        fanouts.truncate(MAX_FANOUTS.saturating_sub(1));
        fanouts.push_front(Arc::new(Fanout {
            request: Arc::clone(request),
            resources_hash,
            resources_len,
            answers: Mutex::new(None),
        }));
        None
    }

    /// The cache's `Arc` of `text`, if it has one.
    pub(super) fn interned(&self, text: &str) -> Option<Arc<str>> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .texts
            .get(text)
            .cloned()
    }

    /// Whether a question hashed to `h` was asked before (as far as a direct-mapped
    /// table of recent questions tells: a lost one only costs a later store);
    /// remembers it if not.
    pub(super) fn seen_before(&self, h: u64) -> bool {
        let Some(slot) = self.doorkeeper.get((h as usize) % DOORKEEPER_SLOTS) else {
            return false;
        };
        slot.swap(h, Ordering::Relaxed) == h
    }

    /// The cache's one `Arc` of `text` (kept if it is the first); `None` when the text
    /// is too large to keep (a sixteenth of a shard's budget: such a request is decided
    /// without the cache).
    pub(super) fn intern_arc(&self, text: Arc<str>) -> Option<Arc<str>> {
        if text.len() > self.budget() / SHARDS / 16 {
            return None;
        }
        let mut requests = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = requests.texts.get(&*text) {
            return Some(Arc::clone(known));
        }
        // A bounded set, in number and in bytes: an entry whose text was let go still
        // answers, by comparing the text.
        if requests.texts.len() >= MAX_INTERNED_REQUESTS
            || requests.bytes + text.len() > self.budget() / 8
        {
            requests.texts.clear();
            requests.bytes = 0;
        }
        requests.bytes += text.len();
        requests.texts.insert(Arc::clone(&text));
        Some(text)
    }

    pub(super) fn hash(&self, key: &Key<'_>) -> u64 {
        self.hasher.hash_one((key.request_hash, key.resource))
    }

    pub(super) fn shard(&self, hash: u64) -> Option<&Mutex<Shard>> {
        self.shards.get((hash >> 56) as usize % SHARDS)
    }

    pub(super) fn get(
        &self,
        key: &Key<'_>,
        hash: u64,
        snapshot: &Snapshot,
        mut memo: Option<&mut Memo>,
        reads: Option<&mut Vec<EntityUID>>,
    ) -> Option<Arc<Decision>> {
        let shard = self
            .shard(hash)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = shard.map.get(&hash).filter(|e| e.answers(key))?;
        let own_holds = entry.own.as_ref().is_none_or(|d| d.holds(&snapshot.store));
        (skipped(Invalidation::Facts)
            || own_holds
                && entry.shared.iter().all(|d| match &d.version {
                    // Many entries depend on the same version of a zone, the cluster or a
                    // namespace: its store lookup is made once per fan-out, not once per
                    // node. The address identifies the version: the memo holds it, so the
                    // address cannot be reused before the fan-out ends.
                    Some(version) => {
                        let Some(memo) = memo.as_deref_mut() else {
                            return d.holds(&snapshot.store);
                        };
                        let at = Arc::as_ptr(version) as *const () as usize;
                        match memo.get(&at) {
                            Some((_, uid, holds)) if *uid == d.uid => *holds,
                            _ => {
                                let holds = d.holds(&snapshot.store);
                                memo.insert(at, (Arc::clone(version), d.uid.clone(), holds));
                                holds
                            }
                        }
                    }
                    None => d.holds(&snapshot.store),
                }))
        .then(|| {
            if let Some(reads) = reads {
                reads.extend(
                    entry
                        .own
                        .iter()
                        .chain(entry.shared.iter())
                        .map(|d| d.uid.clone()),
                );
            }
            Arc::clone(&entry.decision)
        })
    }

    pub(super) fn put(
        &self,
        key: &Key<'_>,
        hash: u64,
        deps: Vec<Dependency>,
        decision: Arc<Decision>,
    ) {
        // An ancestor is often also reached through an attribute: check it once.
        let first: Vec<bool> = {
            // A keyed hash: the ids are anyone's choosing.
            let mut seen: std::collections::HashSet<&EntityUID, crate::hashing::KeyedHash> =
                std::collections::HashSet::with_capacity_and_hasher(
                    deps.len(),
                    crate::hashing::KeyedHash::default(),
                );
            deps.iter().map(|d| seen.insert(&d.uid)).collect()
        };
        let mut own = None;
        let mut shared = Vec::with_capacity(deps.len());
        for (d, first) in deps.into_iter().zip(first) {
            if !first {
                continue;
            }
            if d.uid == *key.resource {
                own = Some(d);
            } else {
                shared.push(d);
            }
        }
        let bytes = entry_bytes(key, shared.len() + usize::from(own.is_some()), &decision);
        let budget = self.budget();
        let per_shard = budget / SHARDS;
        if bytes > per_shard / 4 {
            return;
        }
        let Some(shard) = self.shard(hash) else {
            return;
        };
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = shard.map.remove(&hash) {
            shard.bytes = shard.bytes.saturating_sub(old.bytes);
            self.release(&old);
        }
        while shard.bytes + bytes > per_shard {
            let Some(victim) = self.victim(&mut shard) else {
                break;
            };
            shard.bytes = shard.bytes.saturating_sub(victim.bytes);
            self.release(&victim);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        let seq = shard.next_seq;
        shard.next_seq += 1;
        shard.order.push_back((hash, seq));
        shard.bytes += bytes;
        if let Some(held) = self.owners.get(key.owner) {
            held.fetch_add(bytes, Ordering::Relaxed);
        }
        shard.map.insert(
            hash,
            Entry {
                generation: key.generation,
                request: Arc::clone(key.request),
                resource: key.resource.clone(),
                own,
                shared: shared.into_boxed_slice(),
                decision,
                owner: key.owner,
                bytes,
                seq,
            },
        );
        // Replaced entries leave their old place behind: compact before it outgrows
        // the entries.
        if shard.order.len() > 2 * shard.map.len() + 64 {
            let Shard { map, order, .. } = &mut *shard;
            order.retain(|(h, seq)| map.get(h).is_some_and(|e| e.seq == *seq));
        }
    }

    /// Takes out the entry to evict from `shard`: among its oldest few, the first of
    /// the caller bucket holding the most bytes of the whole cache (so a caller flooding
    /// it pays for its own room before anyone else does, even while the cache as a
    /// whole has room and only this shard is full); with one caller, the oldest.
    pub(super) fn victim(&self, shard: &mut Shard) -> Option<Entry> {
        let Shard { map, order, .. } = shard;
        // Places of replaced entries first.
        while let Some((h, seq)) = order.front() {
            if map.get(h).is_some_and(|e| e.seq == *seq) {
                break;
            }
            order.pop_front();
        }
        let held = |owner: usize| {
            self.owners
                .get(owner)
                .map_or(0, |b| b.load(Ordering::Relaxed))
        };
        let mut chosen: Option<(usize, usize)> = None; // (position, bytes its owner holds)
        for (i, (h, seq)) in order.iter().take(VICTIM_SCAN).enumerate() {
            if let Some(e) = map.get(h).filter(|e| e.seq == *seq) {
                let bytes = held(e.owner);
                if chosen.is_none_or(|(_, most)| bytes > most) {
                    chosen = Some((i, bytes));
                }
            }
        }
        let (h, _) = order.remove(chosen.map_or(0, |(i, _)| i))?;
        map.remove(&h)
    }
}

/// About how many bytes an entry holds: itself, its request's text (shared by the
/// request's entries, counted for each: an upper bound), its dependencies, and the
/// decision's text; times [`OVERHEAD`] for what the count does not see (the maps'
/// spare capacity, the allocator's size classes, the interned texts).
pub(super) fn entry_bytes(key: &Key<'_>, deps: usize, decision: &Decision) -> usize {
    counted_bytes(key, deps, decision).saturating_mul(OVERHEAD.0) / OVERHEAD.1
}

/// The resident memory a full cache adds over what [`counted_bytes`] counts, measured
/// by `scripts/bench-decisions.sh soak` (57 MB resident for 33.5 MB counted: 1.7x).
const OVERHEAD: (usize, usize) = (7, 4);

fn counted_bytes(key: &Key<'_>, deps: usize, decision: &Decision) -> usize {
    use std::mem::size_of;
    let obligations = |o: &[crate::decision::Obligation]| -> usize {
        o.iter()
            .map(|o| {
                size_of::<crate::decision::Obligation>()
                    + o.kind.len()
                    + o.policy.len()
                    + o.target.as_ref().map_or(0, String::len)
                    + o.parameters
                        .iter()
                        .map(|(k, v)| k.len() + v.len() + 64)
                        .sum::<usize>()
            })
            .sum()
    };
    let notices = |n: &[crate::decision::Notice]| -> usize {
        n.iter()
            .map(|n| {
                size_of::<crate::decision::Notice>()
                    + n.policy.len()
                    + n.message.len()
                    + n.error.as_ref().map_or(0, String::len)
                    + obligations(&n.obligations)
            })
            .sum()
    };
    size_of::<Entry>()
        + 32 // its slot in the map and in the order
        + key.request.len()
        + 64 // the resource's name
        + deps * (size_of::<Dependency>() + 64)
        + size_of::<Decision>()
        + decision
            .reasons
            .iter()
            .map(|r| size_of::<crate::decision::Reason>() + r.policy.len() + r.message.len())
            .sum::<usize>()
        + obligations(&decision.obligations)
        + decision
            .errors
            .iter()
            .map(|e| 64 + e.message.len() + e.policy.as_ref().map_or(0, String::len))
            .sum::<usize>()
        + notices(&decision.warnings)
        + notices(&decision.audit)
}
