//! The entities one decision can touch, and only those.
//!
//! Cedar evaluates against an `Entities` value. Building one from the whole store per
//! request (or keeping one up to date) costs time in the store's size; a decision
//! needs a handful of entities. So each decision gets a **slice**: the entities
//! reachable from its roots through entity-valued attributes, with their ancestors.
//!
//! ## Why the slice is complete
//!
//! A Cedar expression reaches an entity's data only by dereferencing an entity value
//! (`e.attr`, `e has attr`, `e.getTag(..)`, `e hasTag ..`); it reaches hierarchy only
//! through `in`, which reads the ancestor set of the entity on its left. Entity values
//! in a policy come from five places: `principal`, `resource`, `action`, the context,
//! and entity literals in the policy text; every other entity value is an attribute
//! or tag value of one of those, or of an entity reached that way. The slice therefore
//! holds the closure of the roots (principal, resource, every entity value in the
//! context, and every entity literal of the policies that can apply to the action)
//! under "follow every entity value in attributes and tags, at any nesting", and gives
//! each entity its full ancestor set (computed from the store's direct parents). An
//! entity outside the slice is one no policy can read, so slicing never changes a
//! decision; a differential test in the suite checks this against whole-store
//! decisions on the scenarios and on random stores.
//!
//! What a custom schema must respect: nothing for correctness. For speed, the closure
//! should stay small: an attribute holding a set of many entities (a zone listing its
//! nodes) pulls them all in. A slice over [`MAX_SLICE_ENTITIES`] is refused, and the
//! decision is a deny naming the bound (fail closed).
//!
//! The slice is handed to Cedar as already closed (no hierarchy computation), through
//! `cedar-policy-core` (pinned to the exact version `cedar-policy` uses): the public
//! API recomputes the closure for every `Entities` it builds, which cost more than the
//! decision.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cedar_policy_core::ast::{self, EntityType, EntityUID, PartialValue};
use cedar_policy_core::entities::{Entities as CoreEntities, NoEntitiesSchema, TCComputation};
use cedar_policy_core::extensions::Extensions;
use smol_str::SmolStr;

use crate::block::BlockRecord;
use crate::store::{Store, Stored};

/// Most entities one decision's slice may hold.
pub const MAX_SLICE_ENTITIES: usize = 4096;

/// What a slice is cut from.
pub(crate) struct SliceSource<'a> {
    /// The stored entities.
    pub store: &'a Store,
    /// Entities the engine owns, already materialized (they change only with the
    /// configuration).
    pub owned: &'a HashMap<EntityUID, Arc<ast::Entity>>,
    /// This request's own entities (never ones the store holds).
    pub extra: &'a HashMap<EntityUID, Arc<Stored>>,
    /// The blocklist, by id of the blocked entity.
    pub blocked: &'a BTreeMap<String, BlockRecord>,
    /// The blocklist's entity type and attribute.
    pub blocklist: Option<(&'a EntityType, &'a SmolStr)>,
    /// Action entities, when the schema has action groups (else `in` on actions needs
    /// no entity).
    pub actions: &'a [Arc<ast::Entity>],
}

/// A stored entity a slice was cut from, as it was then (`None`: not stored).
#[derive(Debug, Clone)]
pub(crate) struct Dependency {
    pub uid: EntityUID,
    pub version: Option<Arc<Stored>>,
}

impl Dependency {
    /// Whether `store` still holds this entity as it was (stored entities are
    /// immutable: a change is a new `Arc`).
    pub fn holds(&self, store: &Store) -> bool {
        match (&self.version, store.get(&self.uid)) {
            (None, None) => true,
            (Some(then), Some(now)) => Arc::ptr_eq(then, now),
            _ => false,
        }
    }
}

/// Why no slice could be cut.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SliceError {
    /// The closure is larger than [`MAX_SLICE_ENTITIES`].
    #[error(
        "the request reaches more than {MAX_SLICE_ENTITIES} entities through attribute references (the slice bound)"
    )]
    TooLarge,
    /// Cedar refused the slice (cannot happen for a store the engine built).
    #[error("the entities of this request are inconsistent: {0}")]
    Inconsistent(String),
}

/// A fast hasher (the Fx hash of rustc) for keys nobody outside chooses: the store's
/// entity types (the schema's), the decision cache's caller buckets. Unkeyed, so never
/// for entity ids or other names a caller picks (those keep SipHash).
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl std::hash::Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            self.add(u64::from_le_bytes(word));
        }
        for &b in chunks.remainder() {
            self.add(u64::from(b));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

/// [`FxHasher`] for `HashMap` and `HashSet`.
pub(crate) type FastHash = std::hash::BuildHasherDefault<FxHasher>;

/// A fast hash keyed per process (foldhash, hashbrown's default), for sets of entity
/// ids, which callers choose.
pub(crate) type KeyedHash = foldhash::fast::RandomState;

impl<'a> SliceSource<'a> {
    /// Every ancestor of `stored` (through the request's entities first, then the
    /// store), each once, in the order met, with the store's version of it (none when
    /// absent, or a request's own); in `out`, emptied first.
    fn ancestors_of(
        &self,
        stored: &'a Stored,
        out: &mut Vec<(EntityUID, Option<&'a Arc<Stored>>)>,
    ) {
        out.clear();
        let mut stack: Vec<&EntityUID> = stored.parents.iter().map(AsRef::as_ref).collect();
        // Most entities have a handful of ancestors, where a scan beats a hash; past
        // `SCAN` a set takes over, so that a wide hierarchy is not quadratic.
        const SCAN: usize = 16;
        let mut index: Option<HashSet<EntityUID, KeyedHash>> = None;
        while let Some(next) = stack.pop() {
            let known = match &index {
                Some(set) => set.contains(next),
                None => out.iter().any(|(a, _)| a == next),
            };
            if known {
                continue;
            }
            let (found, version) = match self.extra.get(next) {
                Some(e) => (Some(e), None),
                None => {
                    let v = self.store.get(next);
                    (v, v)
                }
            };
            out.push((next.clone(), version));
            match &mut index {
                Some(set) => {
                    set.insert(next.clone());
                }
                None if out.len() > SCAN => {
                    index = Some(out.iter().map(|(a, _)| a.clone()).collect());
                }
                None => {}
            }
            if let Some(s) = found {
                stack.extend(s.parents.iter().map(AsRef::as_ref));
            }
        }
    }

    fn blocked_view(&self, uid: &EntityUID) -> Option<(&SmolStr, bool)> {
        let (ty, attr) = self.blocklist?;
        if uid.entity_type() != ty {
            return None;
        }
        let id: &str = uid.eid().as_ref();
        Some((attr, self.blocked.contains_key(id)))
    }

    /// The slice for `roots`. With `deps`, every stored entity the slice was cut from
    /// (or looked for and did not find) is pushed there, with the version it had: a
    /// decision over this slice holds while each of them is unchanged, the request's
    /// own entities, the owned ones and the blocklist are the same.
    pub fn cut(
        &self,
        roots: impl IntoIterator<Item = EntityUID>,
        mut deps: Option<&mut Vec<Dependency>>,
    ) -> Result<cedar_policy::Entities, SliceError> {
        let mut queue: Vec<EntityUID> = roots.into_iter().collect();
        // A keyed hash: entity ids are anyone's choosing (a request brings its own), and
        // an unkeyed one would let crafted ids collide.
        let mut seen: HashSet<EntityUID, KeyedHash> =
            HashSet::with_capacity_and_hasher(32, KeyedHash::default());
        let mut out: Vec<Arc<ast::Entity>> = Vec::with_capacity(32);
        let mut ancestors: Vec<(EntityUID, Option<&Arc<Stored>>)> = Vec::new();
        while let Some(uid) = queue.pop() {
            if seen.contains(&uid) {
                continue;
            }
            if out.len() >= MAX_SLICE_ENTITIES {
                return Err(SliceError::TooLarge);
            }
            let extra = self.extra.get(&uid);
            let stored = extra.or_else(|| self.store.get(&uid));
            let owned = self.owned.get(&uid);
            if let Some(deps) = deps.as_deref_mut()
                && extra.is_none()
                && owned.is_none()
            {
                // Not a request's own entity: `stored` is the store's version, or none.
                deps.push(Dependency {
                    uid: uid.clone(),
                    version: stored.cloned(),
                });
            }
            if let Some(s) = stored {
                queue.extend(s.refs().filter(|r| !seen.contains(*r)).cloned());
            }
            if let Some(e) = owned {
                out.push(Arc::clone(e));
            } else if let Some(s) = stored {
                self.ancestors_of(s, &mut ancestors);
                if let Some(deps) = deps.as_deref_mut() {
                    deps.extend(
                        ancestors
                            .iter()
                            .filter(|(a, _)| !self.extra.contains_key(a))
                            .map(|(a, version)| Dependency {
                                uid: a.clone(),
                                version: version.cloned(),
                            }),
                    );
                }
                out.push(s.materialized(
                    &uid,
                    ancestors.iter().map(|(a, _)| a),
                    self.blocked_view(&uid),
                ));
            } else if let Some((attr, blocked)) = self.blocked_view(&uid) {
                // The blocklist decides for an entity no fact describes yet: it exists
                // with its block, and any other attribute a policy reads is an error,
                // hence a deny (fail closed).
                out.push(Arc::new(ast::Entity::new_with_attr_partial_value(
                    uid.clone(),
                    [(attr.clone(), PartialValue::Value(blocked.into()))],
                    HashSet::new(),
                    HashSet::new(),
                    [],
                )));
            }
            seen.insert(uid);
        }
        out.extend(self.actions.iter().cloned());
        CoreEntities::new()
            .add_entities(
                out,
                None::<&NoEntitiesSchema>,
                TCComputation::AssumeAlreadyComputed,
                Extensions::all_available(),
            )
            .map(cedar_policy::Entities::from)
            .map_err(|e| SliceError::Inconsistent(e.to_string()))
    }
}

/// The whole store as Cedar sees it, for the differential test: every stored entity
/// (with its ancestors and the blocklist's view), this request's entities, and the
/// blocklist's stub for every entity of its type that is named anywhere (in the
/// store's attributes or among the roots) but not stored.
#[cfg(test)]
pub(crate) mod reference {
    use super::*;
    use crate::store::materialize;
    use std::cell::Cell;

    thread_local! {
        static WHOLE: Cell<bool> = const { Cell::new(false) };
    }

    /// Whether decisions on this thread use the whole store instead of a slice.
    pub fn whole_store() -> bool {
        WHOLE.with(Cell::get)
    }

    /// Runs `f` with decisions on this thread using the whole store.
    pub fn with_whole_store<T>(f: impl FnOnce() -> T) -> T {
        WHOLE.with(|w| w.set(true));
        let out = f();
        WHOLE.with(|w| w.set(false));
        out
    }

    pub fn whole(
        source: &SliceSource<'_>,
        roots: impl IntoIterator<Item = EntityUID>,
    ) -> cedar_policy::Entities {
        let mut named: Vec<EntityUID> = roots.into_iter().collect();
        let mut out: HashMap<EntityUID, Arc<ast::Entity>> = HashMap::new();
        let stored = source
            .store
            .iter()
            .chain(source.extra.iter().map(|(u, s)| (u.clone(), s)));
        for (uid, s) in stored {
            named.extend(s.refs().cloned());
            named.extend(s.parents.iter().map(|p| (**p).clone()));
            let e = match source.owned.get(&uid) {
                Some(e) => Arc::clone(e),
                None => Arc::new(materialize(
                    &uid,
                    s,
                    source.store.ancestors(&s.parents, source.extra),
                    source.blocked_view(&uid),
                )),
            };
            out.insert(uid, e);
        }
        for uid in named {
            if out.contains_key(&uid) {
                continue;
            }
            if let Some((attr, blocked)) = source.blocked_view(&uid) {
                out.insert(
                    uid.clone(),
                    Arc::new(ast::Entity::new_with_attr_partial_value(
                        uid,
                        [(attr.clone(), PartialValue::Value(blocked.into()))],
                        HashSet::new(),
                        HashSet::new(),
                        [],
                    )),
                );
            }
        }
        let all: Vec<Arc<ast::Entity>> = out
            .into_values()
            .chain(source.actions.iter().cloned())
            .collect();
        CoreEntities::new()
            .add_entities(
                all,
                None::<&NoEntitiesSchema>,
                TCComputation::AssumeAlreadyComputed,
                Extensions::all_available(),
            )
            .map(cedar_policy::Entities::from)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::reference::with_whole_store;
    use crate::decision::Decision;
    use crate::engine::Engine;
    use crate::request::Request;
    use serde_json::{Value, json};
    use std::collections::BTreeSet;

    /// What must not change between a slice and the whole store.
    fn essence(
        d: &Decision,
    ) -> (
        String,
        BTreeSet<String>,
        Vec<String>,
        BTreeSet<Option<String>>,
    ) {
        let mut obligations: Vec<String> = d
            .obligations
            .iter()
            .map(|o| format!("{}|{:?}|{}|{:?}", o.kind, o.target, o.policy, o.parameters))
            .collect();
        obligations.sort();
        (
            format!("{}", d.decision),
            d.reasons
                .iter()
                .map(|r| format!("{}|{}", r.policy, r.message))
                .collect(),
            obligations,
            d.errors.iter().map(|e| e.policy.clone()).collect(),
        )
    }

    fn compare(engine: &Engine, request: &Request) {
        let dry_run = |r: &Request| {
            engine
                .decide_with(
                    std::slice::from_ref(r),
                    crate::DecideOptions::new().dry_run(),
                )
                .settle()
                .remove(0)
        };
        let sliced = dry_run(request);
        let whole = with_whole_store(|| dry_run(request));
        assert_eq!(
            essence(&sliced),
            essence(&whole),
            "{request:?}\nsliced {sliced:?}\nwhole {whole:?}"
        );
    }

    /// The scenario suite's every case, decided on its slice and on the whole store.
    #[test]
    fn slicing_never_changes_a_scenario_decision() {
        let engine = Engine::from_embedded_defaults().unwrap();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/scenarios");
        let files = crate::scenario::discover(&root).unwrap();
        assert!(files.len() > 10);
        let mut cases = 0;
        for file in files {
            let sliced = crate::scenario::run_file(&engine, &file).unwrap();
            let whole = with_whole_store(|| crate::scenario::run_file(&engine, &file).unwrap());
            for (s, w) in sliced.iter().zip(&whole) {
                assert_eq!(s.failure, w.failure, "{}: {}", file.display(), s.name);
                assert!(s.passed(), "{s}");
                cases += 1;
            }
        }
        assert!(cases > 80, "{cases} cases");
    }

    /// Random clusters and requests: the slice decides as the whole store does.
    #[test]
    fn slicing_never_changes_a_decision_on_random_stores() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m.max(1)
        };
        for _store in 0..4 {
            let engine = Engine::from_embedded_defaults().unwrap();
            let mut entities: Vec<Value> = vec![json!({"uid": {"type": "Cluster", "id": "c"},
                "attrs": {"gpusTotal": 64, "gpusAllocated": next(70)}, "parents": []})];
            let zones = 1 + next(4);
            for z in 0..zones {
                let mut attrs = json!({"cluster": {"__entity": {"type": "Cluster", "id": "c"}},
                    "powerDrawW": next(50_000), "powerCeilingW": 40_000});
                if next(3) == 0 {
                    attrs["dedicatedClass"] = json!((["rlhf", "training"][next(2) as usize]));
                }
                entities.push(
                    json!({"uid": {"type": "Zone", "id": format!("z{z}")}, "attrs": attrs,
                    "parents": [{"type": "Cluster", "id": "c"}]}),
                );
            }
            for n in 0..12 {
                let mut attrs = json!({"zone": {"__entity": {"type": "Zone", "id": format!("z{}", next(zones))}},
                    "rack": "r", "driverVersion": (["590.48.01", "580.1"][next(2) as usize]),
                    "cudaImage": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
                    "gpuNode": next(4) != 0, "gpuCount": next(9), "cpuCount": 64,
                    "gpuMemoryMiB": 81920, "hottestGpuTempC": 40 + next(40),
                    "powerDrawW": 2000 + next(3000), "powerWindowMeanW": next(4000)});
                match next(4) {
                    0 => {}
                    1 => {
                        attrs["gpuModel"] = json!({"__entity": {"type": "GpuModel", "id": "H999"}})
                    }
                    _ => {
                        attrs["gpuModel"] = json!({"__entity": {"type": "GpuModel", "id": (["A100", "H100"][next(2) as usize])}})
                    }
                }
                entities.push(
                    json!({"uid": {"type": "Node", "id": format!("n{n}")}, "attrs": attrs,
                    "parents": [{"type": "Zone", "id": format!("z{}", next(zones))}]}),
                );
            }
            for ns in ["inference", "training"] {
                entities.push(
                    json!({"uid": {"type": "Namespace", "id": ns}, "attrs": {}, "parents": []}),
                );
            }
            for w in 0..10 {
                let ns = ["inference", "training"][next(2) as usize];
                entities.push(json!({"uid": {"type": "Workload", "id": format!("w{w}")},
                    "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": ns}},
                        "class": (["inference", "training", "rlhf", "batch", "RLHF"][next(5) as usize]),
                        "gpus": next(9), "cpuMillis": next(80_000), "gpuMemoryMiB": next(90_000), "image": "i"},
                    "parents": [{"type": "Namespace", "id": ns}]}));
            }
            // Keys come from the keyring, the one owner that may supply them.
            let mut keys = Vec::new();
            for k in 0..3 {
                keys.push(json!({"uid": {"type": "Key", "id": format!("k{k}")},
                    "attrs": {"createdAt": 1_760_000_000 + next(20_000_000), "state": (["active", "retired"][next(2) as usize])},
                    "parents": []}));
            }
            entities.push(json!({"uid": {"type": "User", "id": "u"}, "attrs": {"elevationAuthorized": next(2) == 0}, "parents": []}));
            engine.upsert_entities(&Value::Array(entities)).unwrap();
            engine
                .replace_owned_entities(crate::EntityOwner::Keyring, &Value::Array(keys))
                .unwrap();
            for n in 0..12 {
                if next(5) == 0 {
                    engine.block_node(&format!("n{n}"), "random").unwrap();
                }
            }
            engine
                .block_node("ghost", "blocked before any fact")
                .unwrap();
            let node = |next: &mut dyn FnMut(u64) -> u64| {
                if next(10) == 0 {
                    "ghost".to_owned()
                } else if next(10) == 0 {
                    "nobody".to_owned()
                } else {
                    format!("n{}", next(12))
                }
            };
            for _ in 0..150 {
                let n = node(&mut next);
                let request = match next(7) {
                    0 => {
                        json!({"principal": format!("Workload::\"w{}\"", next(11)), "action": "schedule",
                                "resource": format!("Node::\"{n}\"")})
                    }
                    1 => {
                        json!({"principal": format!("Node::\"{n}\""), "action": "comply", "resource": format!("Node::\"{n}\"")})
                    }
                    2 => {
                        json!({"principal": format!("Workload::\"w{}\"", next(10)), "action": "admit",
                                "resource": format!("Namespace::\"{}\"", (["inference", "training", "other"][next(3) as usize]))})
                    }
                    3 => {
                        json!({"principal": format!("Node::\"{n}\""), "action": "read", "resource": "Checkpoint::\"c\"",
                                "context": {"verified": next(2) == 0}})
                    }
                    4 => {
                        json!({"principal": format!("Node::\"{n}\""), "action": "listen", "resource": format!("Node::\"{n}\""),
                                "context": {"port": ([22, 2379, 8080, 8472][next(4) as usize]), "protocol": (["tcp", "udp"][next(2) as usize])}})
                    }
                    5 => {
                        json!({"principal": "Workload::\"w1\"", "action": "encrypt", "resource": format!("Key::\"k{}\"", next(4)),
                                "context": {"now": 1_770_000_000 + next(10_000_000)}})
                    }
                    _ => {
                        json!({"principal": "User::\"u\"", "action": "elevate", "resource": format!("Node::\"{n}\""),
                                "context": {"now": 1_770_000_000, "lastRemoteLoginAt": 1_770_000_000 - next(600)}})
                    }
                };
                let request = Request::from_json_value(&request)
                    .unwrap()
                    .as_fact_reporter();
                compare(&engine, &request);
            }
        }
    }
}
