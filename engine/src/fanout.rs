//! One request decided for many resources: "may this pod go to each of these nodes?"
//!
//! The scheduler extender and the mutating webhook ask `schedule` for one workload on
//! every candidate node. [`Engine::decide_each`] prepares what the decisions share
//! once (the context, the request's own entities), then decides each resource against
//! the same snapshot, spread over the machine's cores, recording nothing: these are
//! what-if answers that filter and rank, not acts.
//!
//! A [`DecisionCache`] makes a repeated question cheap. A decision depends only on its
//! slice (see `slice.rs`): the request's own entities, the policy set, the entities
//! the engine owns, the blocklist, and the stored entities the slice was cut from. The
//! cache keeps each decision with the stored entities it read, as they were (stored
//! entities are immutable, so "unchanged" is "the same `Arc`"); a later question with
//! the same request and resource reuses it while each of them is unchanged and the
//! rest is the same. A node whose facts were updated is decided afresh; the other
//! nine hundred and ninety-nine are not. Decisions that read the clock or run plugins
//! (which can look beyond the slice) are never cached.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cedar_policy_core::ast::{self, EntityUID};

use crate::bundle::Bundle;
use crate::decision::Decision;
use crate::engine::{BlockRecord, Engine, Snapshot};

use crate::request::{EntityUid, Request};
use crate::slice::Dependency;

/// How many decisions a [`DecisionCache`] holds by default.
pub const DEFAULT_DECISION_CACHE_ENTRIES: usize = 65_536;

/// Fewest resources a thread of [`Engine::decide_each`] takes: below this, spreading
/// the work costs more than it saves.
const MIN_PER_THREAD: usize = 64;

const SHARDS: usize = 16;

/// Decisions of [`Engine::decide_each`] kept for reuse while their facts hold.
pub struct DecisionCache {
    /// What every entry was decided under; a different policy set, owned entities or
    /// blocklist empties the cache. Held (not just compared) so that an address is
    /// never reused while an entry names it.
    world: Mutex<Option<World>>,
    shards: Box<[Mutex<HashMap<Key, Entry>>]>,
    per_shard: usize,
    hasher: std::collections::hash_map::RandomState,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct World {
    bundle: Arc<Bundle>,
    owned: Arc<HashMap<EntityUID, Arc<ast::Entity>>>,
    blocked: Arc<std::collections::BTreeMap<String, BlockRecord>>,
}

impl World {
    fn is(&self, snapshot: &Snapshot) -> bool {
        Arc::ptr_eq(&self.bundle, &snapshot.bundle)
            && Arc::ptr_eq(&self.owned, &snapshot.owned)
            && Arc::ptr_eq(&self.blocked, &snapshot.blocked)
    }
}

#[derive(Clone)]
struct Key {
    /// The request without its resource, canonical: principal, action, context and
    /// the request's own entities.
    request: Arc<str>,
    /// `request`'s hash, computed once per fan-out: a lookup then hashes only the
    /// resource, not the whole request text again for every node.
    request_hash: u64,
    resource: EntityUID,
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.request_hash == other.request_hash
            && self.resource == other.resource
            && (Arc::ptr_eq(&self.request, &other.request) || self.request == other.request)
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.request_hash.hash(state);
        self.resource.hash(state);
    }
}

struct Entry {
    deps: Box<[Dependency]>,
    decision: Decision,
}

impl Default for DecisionCache {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_DECISION_CACHE_ENTRIES)
    }
}

impl std::fmt::Debug for DecisionCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionCache")
            .field("entries", &self.len())
            .field("hits", &self.hits())
            .field("misses", &self.misses())
            .finish()
    }
}

impl DecisionCache {
    /// A cache of at most about `entries` decisions (a full part of it is emptied).
    pub fn with_capacity(entries: usize) -> Self {
        Self {
            world: Mutex::new(None),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: entries.div_ceil(SHARDS).max(1),
            hasher: std::collections::hash_map::RandomState::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Decisions reused so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Decisions made afresh so far (not found, or their facts changed).
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// Decisions held now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether it holds no decision.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Empties the cache if `snapshot` was not what its entries were decided under.
    fn enter(&self, snapshot: &Snapshot) {
        let mut world = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        if world.as_ref().is_some_and(|w| w.is(snapshot)) {
            return;
        }
        for shard in self.shards.iter() {
            shard.lock().unwrap_or_else(PoisonError::into_inner).clear();
        }
        *world = Some(World {
            bundle: Arc::clone(&snapshot.bundle),
            owned: Arc::clone(&snapshot.owned),
            blocked: Arc::clone(&snapshot.blocked),
        });
    }

    fn shard(&self, key: &Key) -> Option<&Mutex<HashMap<Key, Entry>>> {
        let h = self.hasher.hash_one(&key.resource);
        self.shards.get((h as usize) % SHARDS)
    }

    fn get(&self, key: &Key, snapshot: &Snapshot, memo: &mut Memo) -> Option<Decision> {
        let shard = self
            .shard(key)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = shard.get(key)?;
        entry
            .deps
            .iter()
            .all(|d| match &d.version {
                // Many entries depend on the same version of a zone, the cluster or a
                // namespace: its store lookup is made once per fan-out, not once per
                // node. The address identifies the version while the entry holds it.
                Some(version) => {
                    let at = Arc::as_ptr(version) as *const () as usize;
                    match memo.get(&at) {
                        Some((uid, holds)) if *uid == d.uid => *holds,
                        _ => {
                            let holds = d.holds(&snapshot.store);
                            memo.insert(at, (d.uid.clone(), holds));
                            holds
                        }
                    }
                }
                None => d.holds(&snapshot.store),
            })
            .then(|| entry.decision.clone())
    }

    fn put(&self, key: Key, mut deps: Vec<Dependency>, decision: Decision) {
        // An ancestor is often also reached through an attribute: check it once.
        let mut seen = std::collections::HashSet::with_capacity(deps.len());
        deps.retain(|d| seen.insert(d.uid.clone()));
        let Some(shard) = self.shard(&key) else {
            return;
        };
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        if shard.len() >= self.per_shard && !shard.contains_key(&key) {
            shard.clear();
        }
        shard.insert(
            key,
            Entry {
                deps: deps.into_boxed_slice(),
                decision,
            },
        );
    }
}

impl Engine {
    /// Decides `request` once for each of `resources`, as if it had been asked with
    /// each in place of its own resource: one policy set and one store snapshot for
    /// all, spread over the machine's cores, and nothing recorded (these answers
    /// filter and rank; the act they lead to is decided on its own). The answers
    /// are in the order of `resources`.
    ///
    /// With `cache`, a decision whose facts did not change since it was made is
    /// reused (see the module documentation).
    pub fn decide_each(
        &self,
        request: &Request,
        resources: &[EntityUid],
        cache: Option<&DecisionCache>,
    ) -> Vec<Decision> {
        let snapshot = self.snapshot_now();
        let prepared = match self.prepare(&snapshot, request) {
            Ok(p) => p,
            Err(denied) => return vec![denied; resources.len()],
        };
        let cacheable = cache.filter(|_| self.cacheable(&snapshot, request));
        let fingerprint: Option<Arc<str>> = cacheable.map(|c| {
            c.enter(&snapshot);
            Arc::from(fingerprint(request))
        });
        let request_hash = fingerprint.as_deref().map_or(0, |fp| {
            std::hash::BuildHasher::hash_one(&FINGERPRINT_HASHER, fp)
        });
        let decide_one = |resource: &EntityUid, memo: &mut Memo| -> Decision {
            let (Some(cache), Some(fp)) = (cacheable, &fingerprint) else {
                return self.decide_prepared(&snapshot, request, &prepared, resource, None);
            };
            let key = Key {
                request: Arc::clone(fp),
                request_hash,
                resource: resource.0.as_ref().clone(),
            };
            if let Some(hit) = cache.get(&key, &snapshot, memo) {
                cache.hits.fetch_add(1, Ordering::Relaxed);
                return hit;
            }
            cache.misses.fetch_add(1, Ordering::Relaxed);
            let mut deps = Vec::new();
            let decision =
                self.decide_prepared(&snapshot, request, &prepared, resource, Some(&mut deps));
            cache.put(key, deps, decision.clone());
            decision
        };
        let threads = std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .min(resources.len() / MIN_PER_THREAD)
            .max(1);
        if threads == 1 {
            let mut memo = Memo::default();
            return resources.iter().map(|r| decide_one(r, &mut memo)).collect();
        }
        let chunk = resources.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let decide_one = &decide_one;
            let handles: Vec<_> = resources
                .chunks(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        let mut memo = Memo::default();
                        part.iter()
                            .map(|r| decide_one(r, &mut memo))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| {
                    h.join().unwrap_or_else(|_| {
                        vec![Decision::error("a decision thread failed"); chunk]
                    })
                })
                .take(resources.len())
                .collect()
        })
    }
}

/// Dependency checks already made in one fan-out, by the address of the version they
/// checked (with the entity it was checked for): whether it is still the store's.
type Memo = HashMap<usize, (EntityUID, bool)>;

/// Hashes request fingerprints (in process only: the cache is never persisted).
const FINGERPRINT_HASHER: std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher> =
    std::hash::BuildHasherDefault::new();

/// The request without its resource, as canonical text: two requests with the same
/// fingerprint decide the same for every resource.
fn fingerprint(request: &Request) -> String {
    let mut out = String::with_capacity(256);
    out.push_str(&request.principal.to_string());
    out.push('\n');
    out.push_str(&request.action.to_string());
    out.push('\n');
    if let Some(c) = &request.context {
        out.push_str(&serde_json::Value::Object(c.clone()).to_string());
    }
    out.push('\n');
    out.push_str(if request.reporter {
        "reporter"
    } else {
        "caller"
    });
    for e in &request.entities {
        out.push('\n');
        out.push_str(&e.to_string());
    }
    out
}
