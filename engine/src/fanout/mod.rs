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
//!
//! A whole fan-out asked again (the mutating webhook asks the same pod spec over every
//! node, the extender the same candidates) is cheaper still: the cache keeps its answers
//! with, for each stored entity they read, which answers read it, and the store's change
//! log (`Store::changed_since`) names what changed since. Only the answers that read a
//! changed entity are decided again; a fan-out the log cannot bring up to date (too old,
//! another policy set or blocklist, a quarter of it touched) is decided in full.

mod cache;
mod invalidation;
mod single;

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cedar_policy_core::ast::EntityUID;

use crate::block::BlockRecord;
use crate::bundle::Bundle;
use crate::decision::Decision;
use crate::engine::{Engine, Snapshot};

use crate::request::{EntityUid, Request};
use crate::slice::Dependency;
use crate::store::{StoreVersion, Stored};
#[cfg(not(feature = "bench-hooks"))]
use invalidation::Invalidation;
use invalidation::skipped;
#[cfg(feature = "bench-hooks")]
pub use invalidation::{Invalidation, skip_invalidation};
use single::absent;

/// How many bytes of decisions a [`DecisionCache`] holds by default.
pub(crate) const DEFAULT_DECISION_CACHE_BYTES: usize = 32 << 20;

/// Fewest resources a thread of [`Engine::decide_each`] takes: below this, spreading
/// the work costs more than it saves.
const MIN_PER_THREAD: usize = 64;

const SHARDS: usize = 16;

/// Most request texts a [`DecisionCache`] keeps one `Arc` of.
const MAX_INTERNED_REQUESTS: usize = 4_096;

/// Most entities a remembered fan-out lists per resource before it is rebuilt.
const MAX_READERS_PER_RESOURCE: usize = 8;

/// Most whole fan-outs a [`DecisionCache`] remembers (the last ones asked).
const MAX_FANOUTS: usize = 16;

/// Callers are counted in this many buckets (by a hash of their name): an eviction
/// takes from the bucket holding the most.
const OWNER_BUCKETS: usize = 64;

/// How many of a shard's oldest entries an eviction looks through for one of a caller
/// over its share.
const VICTIM_SCAN: usize = 8;

/// Recent questions the doorkeeper remembers (8 bytes each).
const DOORKEEPER_SLOTS: usize = 32_768;

/// Decisions kept for reuse while their facts hold: the engine's own (every
/// [`Engine::decide_with`] asks it, see [`Engine::decision_cache`]) and those
/// [`Engine::decide_each`] is given.
///
/// A single question (the path of [`Engine::decide_with`]) is remembered the second
/// time it is asked, not the first: questions that never repeat cost no store and push
/// nothing out.
///
/// Its memory is a byte budget (an estimate of each entry's size), shared fairly: when
/// an entry must be evicted to make room, the oldest entries of the caller holding the
/// most go first, so that one caller's flood of questions cannot push out everyone
/// else's.
pub struct DecisionCache {
    /// What every entry was decided under; a different policy set, owned entities or
    /// blocklist empties the cache. Held (not just compared) so that an address is
    /// never reused while an entry names it.
    world: Mutex<Option<World>>,
    /// Counts the changes of `world`: an entry answers only callers that entered the
    /// same one (a caller still deciding under the previous world may store a decision
    /// after the change; it is never served under the new one).
    generation: AtomicU64,
    shards: Box<[Mutex<Shard>]>,
    /// The byte budget; 0 keeps nothing.
    budget: AtomicUsize,
    /// Bytes held per bucket of callers.
    owners: Box<[AtomicUsize]>,
    hasher: std::collections::hash_map::RandomState,
    /// One `Arc` per request text, so that a hit compares requests by address rather
    /// than by their text (a few hundred bytes, once per node otherwise).
    requests: Mutex<Interned>,
    /// The last fan-outs asked, newest first: a fan-out asked again is brought up to
    /// date from the store's change log rather than looked up node by node.
    fanouts: Mutex<std::collections::VecDeque<Arc<Fanout>>>,
    /// The hashes of recent single questions' principal, action and resource, by slot:
    /// a single question is looked up and stored only when they were seen before
    /// ([`Engine::decide_with`]'s path).
    doorkeeper: Box<[AtomicU64]>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

/// What a [`DecisionCache`] has done and holds, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecisionCacheStats {
    /// Decisions reused.
    pub hits: u64,
    /// Decisions made afresh with the cache asked (not found, or a fact they read
    /// changed).
    pub misses: u64,
    /// Entries let go to stay within the budget.
    pub evictions: u64,
    /// Entries held now.
    pub entries: usize,
    /// Bytes held now (an estimate of each entry's size).
    pub bytes: usize,
    /// The byte budget.
    pub budget: usize,
}

/// The interned request texts, bounded in number and in bytes.
#[derive(Default)]
struct Interned {
    texts: std::collections::HashSet<Arc<str>>,
    bytes: usize,
}

/// One part of the cache: its entries by hash, in the order they came.
#[derive(Default)]
struct Shard {
    map: ShardMap,
    /// `(hash, seq)` of the entries, oldest first; an item whose entry was since
    /// replaced (another `seq`) is skipped.
    order: std::collections::VecDeque<(u64, u64)>,
    bytes: usize,
    next_seq: u64,
}

/// A fan-out asked before: the request and a keyed hash of its resources, and, once it
/// has been asked twice, its answers (most fan-outs are asked once: each pod is its own
/// question, so what is kept of them is small).
struct Fanout {
    request: Arc<str>,
    resources_hash: u64,
    resources_len: usize,
    answers: Mutex<Option<Answers>>,
}

/// A fan-out's answers at one version of the store, with, for each stored entity a
/// decision read, the positions of the decisions that read it: a later fan-out decides
/// again only the resources whose decisions read an entity changed since.
struct Answers {
    world: World,
    /// The resources exactly: answers are used only for this very list.
    resources: Box<[EntityUID]>,
    at: StoreVersion,
    decisions: Vec<Arc<Decision>>,
    readers: HashMap<EntityUID, Vec<u32>>,
}

impl Fanout {
    fn is(&self, request: &Arc<str>, resources_hash: u64, resources_len: usize) -> bool {
        self.resources_hash == resources_hash
            && self.resources_len == resources_len
            && (Arc::ptr_eq(&self.request, request) || self.request == *request)
    }
}

impl Answers {
    fn are_for(&self, resources: &[EntityUid]) -> bool {
        self.resources.len() == resources.len()
            && self
                .resources
                .iter()
                .zip(resources)
                .all(|(a, b)| a == b.0.as_ref())
    }
}

struct World {
    bundle: Arc<Bundle>,
    owned: Arc<crate::slice::OwnedEntities>,
    blocked: Arc<std::collections::BTreeMap<String, BlockRecord>>,
}

impl World {
    fn of(snapshot: &Snapshot) -> Self {
        Self {
            bundle: Arc::clone(&snapshot.bundle),
            owned: Arc::clone(&snapshot.owned),
            blocked: Arc::clone(&snapshot.blocked),
        }
    }

    fn is(&self, snapshot: &Snapshot) -> bool {
        (Arc::ptr_eq(&self.bundle, &snapshot.bundle) || skipped(Invalidation::PolicySet))
            && (Arc::ptr_eq(&self.owned, &snapshot.owned)
                || skipped(Invalidation::OwnedEntities)
                // A reload replaces the settings entities too.
                || skipped(Invalidation::PolicySet))
            && (Arc::ptr_eq(&self.blocked, &snapshot.blocked) || skipped(Invalidation::Blocklist))
    }
}

/// A question to the cache: the request without its resource (canonical text:
/// principal, action, context and the request's own entities, with its hash made once
/// per fan-out) and the resource. Borrowed, so a hit clones nothing.
struct Key<'a> {
    request: &'a Arc<str>,
    request_hash: u64,
    resource: &'a EntityUID,
    /// The generation the caller entered (see [`DecisionCache::generation`]).
    generation: u64,
    /// The bucket of the caller asking: who an entry it stores is counted against.
    owner: usize,
}

struct Entry {
    /// The cache's generation when the decision was made.
    generation: u64,
    request: Arc<str>,
    resource: EntityUID,
    /// The resource's own stored entity, checked directly: no other entry shares it.
    own: Option<Dependency>,
    /// The other entities the decision read (a zone, the cluster, a namespace): many
    /// entries share their versions, so a fan-out checks each version once.
    shared: Box<[Dependency]>,
    decision: Arc<Decision>,
    /// The caller bucket it is counted against, and how much.
    owner: usize,
    bytes: usize,
    /// Its place in the shard's order.
    seq: u64,
}

impl<'a> Key<'a> {
    fn new(
        request: &'a Arc<str>,
        request_hash: u64,
        resource: &'a EntityUid,
        generation: u64,
        owner: usize,
    ) -> Self {
        Self {
            request,
            request_hash,
            resource: resource.0.as_ref(),
            generation,
            owner,
        }
    }
}

impl Entry {
    fn answers(&self, key: &Key<'_>) -> bool {
        self.generation == key.generation
            && self.resource == *key.resource
            && (Arc::ptr_eq(&self.request, key.request) || self.request == *key.request)
    }
}

/// A shard's map, keyed by the entry's hash, made once per lookup with the cache's
/// keyed hasher (so the scheduler's node names cannot aim at one bucket). Two keys
/// with the same 64-bit hash take turns in the slot: [`Entry::answers`] tells them
/// apart, and a lost entry is only a miss.
type ShardMap = HashMap<u64, Entry, std::hash::BuildHasherDefault<Prehashed>>;

/// A [`std::hash::Hasher`] for keys that are already hashes.
#[derive(Default)]
struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn write_usize(&mut self, n: usize) {
        // Addresses (the memo's keys): their low bits are alignment, mix them up.
        self.0 = (n as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(32);
    }
}

impl Default for DecisionCache {
    fn default() -> Self {
        Self::with_budget(DEFAULT_DECISION_CACHE_BYTES)
    }
}

impl std::fmt::Debug for DecisionCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionCache")
            .field("stats", &self.stats())
            .finish()
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
    /// reused (see the module documentation); the answers are shared with the cache,
    /// hence the `Arc`. A repeated fan-out that a concurrent caller has already
    /// brought to a later store version is answered at that version: all answers are
    /// still of one snapshot, one current after the call began.
    pub fn decide_each(
        &self,
        request: &Request,
        resources: &[EntityUid],
        cache: Option<&DecisionCache>,
    ) -> Vec<Arc<Decision>> {
        let snapshot = self.snapshot_now();
        let cacheable = cache.filter(|c| c.budget() > 0 && self.cacheable(&snapshot, request));
        let generation = cacheable.map_or(0, |c| c.enter(&snapshot));
        let owner = cacheable.map_or(0, |c| c.owner_of(request.caller.as_deref()));
        let interned = cacheable.and_then(|c| {
            let (text, hash) = fingerprint_hashed(request)?;
            Some((c.intern_arc(text)?, hash))
        });
        let request_hash = interned.as_ref().map_or(0, |(_, hash)| *hash);
        let fingerprint: Option<Arc<str>> = interned.map(|(fp, _)| fp);
        // One resource remembered: answered before the request is prepared (parsing its
        // context and entities against the schema costs more than the lookup). The rest
        // of preparing depends on the request (the fingerprint), the policy set and the
        // blocklist (the generation), and on the store's holding none of the request's
        // own entities (dependencies of every entry: see `absent`).
        if let ([resource], Some(cache), Some(fp)) = (resources, cacheable, &fingerprint) {
            let key = Key::new(fp, request_hash, resource, generation, owner);
            let hash = cache.hash(&key);
            if let Some(hit) = cache.get(&key, hash, &snapshot, None, None) {
                cache.hits.fetch_add(1, Ordering::Relaxed);
                return vec![hit];
            }
        }
        let prepared = match self.prepare(&snapshot, request) {
            Ok(p) => p,
            Err(denied) => {
                // One deny for all: the same request was malformed for every resource.
                let denied = Arc::new(*denied);
                return resources.iter().map(|_| Arc::clone(&denied)).collect();
            }
        };
        let absent = absent(&prepared);
        // One resource's decision, and, when `reads` is asked for, the stored entities
        // it read (a fan-out asked before remembers them).
        let decide_one = |resource: &EntityUid, memo: &mut Memo, reads: bool| -> Decided {
            let (Some(cache), Some(fp)) = (cacheable, &fingerprint) else {
                let decision = self.decide_prepared(&snapshot, request, &prepared, resource, None);
                return (Arc::new(decision), Vec::new());
            };
            let key = Key::new(fp, request_hash, resource, generation, owner);
            let hash = cache.hash(&key);
            let mut read = Vec::new();
            if let Some(hit) = cache.get(
                &key,
                hash,
                &snapshot,
                Some(memo),
                reads.then_some(&mut read),
            ) {
                cache.hits.fetch_add(1, Ordering::Relaxed);
                return (hit, read);
            }
            cache.misses.fetch_add(1, Ordering::Relaxed);
            let mut deps = absent.clone();
            let decision = Arc::new(self.decide_prepared(
                &snapshot,
                request,
                &prepared,
                resource,
                Some(&mut deps),
            ));
            if reads {
                read.extend(deps.iter().map(|d| d.uid.clone()));
            }
            cache.put(&key, hash, deps, Arc::clone(&decision));
            (decision, read)
        };
        // A question about one resource is its own entry: there is no fan-out to
        // remember, and remembering it would push real fan-outs out.
        let fanout = cacheable
            .zip(fingerprint.as_ref())
            .filter(|_| resources.len() > 1)
            .and_then(|(cache, fp)| cache.fanout(fp, resources).map(|f| (cache, f)));
        if let Some((cache, fanout)) = &fanout {
            let mut answers = fanout
                .answers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(known) = answers.as_mut() {
                let updated = bring_up_to_date(known, &snapshot, resources, |r, memo| {
                    decide_one(r, memo, true)
                });
                if let Some(decided) = updated {
                    let reused = resources.len().saturating_sub(decided) as u64;
                    cache.hits.fetch_add(reused, Ordering::Relaxed);
                    return known.decisions.clone();
                }
                // Cannot be told from the log, or too much changed: decided in full
                // below, and remembered again.
                *answers = None;
            }
        }
        let reads = fanout.is_some();
        let threads = crate::available_cores()
            .get()
            .min(resources.len() / MIN_PER_THREAD)
            .max(1);
        let chunk = resources.len().div_ceil(threads).max(1);
        let mut parts = resources.chunks(chunk);
        // The calling thread decides the first part itself: one thread fewer to start.
        let first = parts.next().unwrap_or_default();
        let failed = std::sync::atomic::AtomicBool::new(false);
        let decided: Vec<Decided> = std::thread::scope(|scope| {
            let decide_one = &decide_one;
            let handles: Vec<_> = parts
                .map(|part| {
                    scope.spawn(move || {
                        let mut memo = Memo::default();
                        part.iter()
                            .map(|r| decide_one(r, &mut memo, reads))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let mut memo = Memo::default();
            let mut out: Vec<Decided> = Vec::with_capacity(resources.len());
            out.extend(first.iter().map(|r| decide_one(r, &mut memo, reads)));
            for (h, part) in handles.into_iter().zip(resources.chunks(chunk).skip(1)) {
                match h.join() {
                    Ok(part_decided) => out.extend(part_decided),
                    Err(_) => out.extend(part.iter().map(|_| {
                        failed.store(true, Ordering::Relaxed);
                        (
                            Arc::new(Decision::error("a decision thread failed")),
                            Vec::new(),
                        )
                    })),
                }
            }
            out
        });
        let mut decisions = Vec::with_capacity(decided.len());
        let mut readers: HashMap<EntityUID, Vec<u32>> = HashMap::new();
        for ((decision, read), p) in decided.into_iter().zip(0u32..) {
            for uid in read {
                let at = readers.entry(uid).or_default();
                if at.last() != Some(&p) {
                    at.push(p);
                }
            }
            decisions.push(decision);
        }
        // Asked before: remember the answers with what each read, to bring them up to
        // date next time (not answers a failed thread left: they read nothing, so
        // nothing would ever decide them again).
        if let Some((_, fanout)) = fanout.as_ref().filter(|_| !failed.load(Ordering::Relaxed)) {
            *fanout
                .answers
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(Answers {
                world: World::of(&snapshot),
                resources: resources.iter().map(|r| r.0.as_ref().clone()).collect(),
                at: snapshot.store.version(),
                decisions: decisions.clone(),
                readers,
            });
        }
        decisions
    }
}

/// A decision, with the stored entities it read when they were asked for.
type Decided = (Arc<Decision>, Vec<EntityUID>);

/// Brings `known` up to date with `snapshot`: the resources whose decisions read an
/// entity changed since are decided again by `decide` (which says what the new decision
/// read); how many were is returned. `None` when the change cannot be told (another
/// policy set or blocklist, the log does not reach back, another list of resources
/// with the same hash) or when so much
/// changed that a full fan-out over the cores is cheaper; `known` is then unusable.
fn bring_up_to_date(
    known: &mut Answers,
    snapshot: &Snapshot,
    resources: &[EntityUid],
    mut decide: impl FnMut(&EntityUid, &mut Memo) -> Decided,
) -> Option<usize> {
    if !known.world.is(snapshot) || !known.are_for(resources) {
        return None;
    }
    if known.at.is_later_than(snapshot.store.version()) {
        // A caller that started later brought them further: answers of a state that
        // was current after this question was asked.
        return Some(0);
    }
    let changed = snapshot.store.changed_since(known.at)?;
    let mut positions: Vec<u32> = changed
        .iter()
        .filter_map(|uid| known.readers.get(uid))
        .flatten()
        .copied()
        .collect();
    positions.sort_unstable();
    positions.dedup();
    if positions.len() > resources.len() / 4 {
        return None;
    }
    let mut memo = Memo::default();
    let decided = positions.len();
    for p in positions {
        let resource = resources.get(p as usize)?;
        let (decision, read) = decide(resource, &mut memo);
        for uid in read {
            let readers = known.readers.entry(uid).or_default();
            if let Err(at) = readers.binary_search(&p) {
                readers.insert(at, p);
            }
        }
        *known.decisions.get_mut(p as usize)? = decision;
    }
    known.at = snapshot.store.version();
    // Entities an answer no longer reads stay listed (a harmless extra check); when they
    // outgrow the answers, the next call decides in full and lists them afresh.
    if known.readers.len() > MAX_READERS_PER_RESOURCE * resources.len().max(1) {
        return None;
    }
    Some(decided)
}

/// Dependency checks already made in one fan-out, by the address of the version they
/// checked (held, so the address stays its own), with the entity it was checked for:
/// whether it is still the store's.
type Memo =
    HashMap<usize, (Arc<Stored>, EntityUID, bool), std::hash::BuildHasherDefault<Prehashed>>;

/// Hashes request fingerprints (in process only: the cache is never persisted).
const FINGERPRINT_HASHER: std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher> =
    std::hash::BuildHasherDefault::new();

/// The request's [`fingerprint`] and its hash: kept in the request when a
/// [`crate::ParsedRequests`] handed it out (made once per remembered body), else made
/// now.
pub(super) fn fingerprint_hashed(request: &Request) -> Option<(Arc<str>, u64)> {
    let make = || {
        let text = fingerprint(request)?;
        let hash = std::hash::BuildHasher::hash_one(&FINGERPRINT_HASHER, text.as_str());
        Some((Arc::<str>::from(text), hash))
    };
    let kept = request
        .fingerprints
        .as_deref()
        .and_then(|cells| cells.get(usize::from(request.reporter)));
    match kept {
        Some(cell) => cell.get_or_init(make).clone(),
        None => make(),
    }
}

/// The request without its resource, as canonical text: two requests with the same
/// fingerprint decide the same for every resource. `None` if a part cannot be written
/// (never for JSON values; such a request is decided without the cache).
fn fingerprint(request: &Request) -> Option<String> {
    use std::fmt::Write;
    let mut out = String::with_capacity(256);
    write!(out, "{}\n{}\n", request.principal, request.action).ok()?;
    if let Some(c) = &request.context {
        out.push_str(&serde_json::to_string(c).ok()?);
    }
    out.push('\n');
    out.push_str(if request.reporter {
        "reporter"
    } else {
        "caller"
    });
    for e in request.entities.iter() {
        write!(out, "\n{e}").ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests;
