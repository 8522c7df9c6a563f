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
use crate::hashing::KeyedHash;
use crate::store::{Store, Stored};

/// Most entities one decision's slice may hold.
pub const MAX_SLICE_ENTITIES: usize = 4096;

/// The entities the engine owns, materialized, by uid.
pub(crate) type OwnedEntities = HashMap<EntityUID, Arc<ast::Entity>, KeyedHash>;

/// One request's own entities, by uid.
pub(crate) type RequestEntities = HashMap<EntityUID, Arc<Stored>, KeyedHash>;

/// What a slice is cut from.
pub(crate) struct SliceSource<'a> {
    /// The stored entities.
    pub store: &'a Store,
    /// Entities the engine owns, already materialized (they change only with the
    /// configuration).
    pub owned: &'a OwnedEntities,
    /// This request's own entities (never ones the store holds).
    pub extra: &'a RequestEntities,
    /// The blocklist, by id of the blocked entity.
    pub blocked: &'a BTreeMap<String, BlockRecord>,
    /// The blocklist's entity type and attribute.
    pub blocklist: Option<(&'a EntityType, &'a SmolStr)>,
    /// Action entities, when the schema has action groups (else `in` on actions needs
    /// no entity).
    pub actions: &'a [Arc<ast::Entity>],
    /// The snapshot's bases, when slices are cut over them.
    pub bases: Option<&'a BaseSlices>,
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
    ///
    /// With [`SliceSource::bases`], the part of the slice reached from the roots the
    /// store answers for is cut once per snapshot and reused; only what the request's
    /// own entities reach is walked each time.
    pub fn cut(
        &self,
        roots: impl IntoIterator<Item = EntityUID>,
        deps: Option<&mut Vec<Dependency>>,
    ) -> Result<cedar_policy::Entities, SliceError> {
        let roots: Vec<EntityUID> = roots.into_iter().collect();
        match self.bases {
            Some(bases) => self.cut_over_base(bases, roots, deps),
            None => self.cut_whole(roots, deps),
        }
    }

    /// The slice walked from every root, with no base.
    fn cut_whole(
        &self,
        roots: Vec<EntityUID>,
        deps: Option<&mut Vec<Dependency>>,
    ) -> Result<cedar_policy::Entities, SliceError> {
        let mut walk = Walk::new();
        self.walk(roots, &mut walk, None, deps)?;
        walk.out.extend(self.actions.iter().cloned());
        into_entities(presized_entities().clone(), walk.out)
    }

    /// The base for the roots the store answers for, then the request's own entities'
    /// part on top of it.
    fn cut_over_base(
        &self,
        bases: &BaseSlices,
        roots: Vec<EntityUID>,
        mut deps: Option<&mut Vec<Dependency>>,
    ) -> Result<cedar_policy::Entities, SliceError> {
        let (own, stored): (Vec<EntityUID>, Vec<EntityUID>) =
            roots.into_iter().partition(|r| self.extra.contains_key(r));
        let base = match bases.get(&stored) {
            Some(base) => base,
            None => {
                let base = Arc::new(self.base(stored.clone())?);
                bases.offer(stored.clone(), &base);
                base
            }
        };
        // A request's entity the base looked for (as a node or an ancestor) would have
        // changed what the base holds: such a request is cut whole.
        if self.extra.keys().any(|u| base.looked_up(u)) {
            let mut roots = stored;
            roots.extend(own);
            return self.cut_whole(roots, deps);
        }
        if let Some(deps) = deps.as_deref_mut() {
            deps.extend(base.deps.iter().cloned());
        }
        if own.is_empty() {
            return Ok(cedar_policy::Entities::from(base.entities.clone()));
        }
        let mut walk = Walk::new();
        walk.reached = base.len;
        self.walk(own, &mut walk, Some(&base.walked), deps)?;
        into_entities(base.entities.clone(), walk.out)
    }

    /// The slice of `roots` with no request entities, with everything it looked up.
    fn base(&self, roots: Vec<EntityUID>) -> Result<BaseSlice, SliceError> {
        let alone = RequestEntities::default();
        let source = SliceSource {
            extra: &alone,
            bases: None,
            ..*self
        };
        let mut walk = Walk::new();
        let mut deps = Vec::new();
        source.walk(roots, &mut walk, None, Some(&mut deps))?;
        let len = walk.out.len();
        walk.out.extend(self.actions.iter().cloned());
        Ok(BaseSlice {
            entities: add_closed(presized_entities().clone(), walk.out)?,
            walked: walk.seen,
            looked_up_index: (deps.len() > SCAN_DEPS)
                .then(|| deps.iter().map(|d| d.uid.clone()).collect()),
            deps,
            len,
        })
    }

    /// Walks from `queue`: every entity reached through attribute and tag values, with
    /// its ancestors, into `walk.out` (except those in `skip`, already had).
    fn walk(
        &self,
        mut queue: Vec<EntityUID>,
        walk: &mut Walk<'a>,
        skip: Option<&HashSet<EntityUID, KeyedHash>>,
        mut deps: Option<&mut Vec<Dependency>>,
    ) -> Result<(), SliceError> {
        let had = |uid: &EntityUID, seen: &HashSet<EntityUID, KeyedHash>| {
            seen.contains(uid) || skip.is_some_and(|s| s.contains(uid))
        };
        while let Some(uid) = queue.pop() {
            if had(&uid, &walk.seen) {
                continue;
            }
            if walk.reached >= MAX_SLICE_ENTITIES {
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
                queue.extend(s.refs().filter(|r| !had(r, &walk.seen)).cloned());
            }
            let before = walk.out.len();
            if let Some(e) = owned {
                walk.out.push(Arc::clone(e));
            } else if let Some(s) = stored {
                self.ancestors_of(s, &mut walk.ancestors);
                if let Some(deps) = deps.as_deref_mut() {
                    deps.extend(
                        walk.ancestors
                            .iter()
                            .filter(|(a, _)| !self.extra.contains_key(a))
                            .map(|(a, version)| Dependency {
                                uid: a.clone(),
                                version: version.cloned(),
                            }),
                    );
                }
                walk.out.push(s.materialized(
                    &uid,
                    walk.ancestors.iter().map(|(a, _)| a),
                    self.blocked_view(&uid),
                ));
            } else if let Some((attr, blocked)) = self.blocked_view(&uid) {
                // The blocklist decides for an entity no fact describes yet: it exists
                // with its block, and any other attribute a policy reads is an error,
                // hence a deny (fail closed).
                walk.out
                    .push(Arc::new(ast::Entity::new_with_attr_partial_value(
                        uid.clone(),
                        [(attr.clone(), PartialValue::Value(blocked.into()))],
                        HashSet::new(),
                        HashSet::new(),
                        [],
                    )));
            }
            walk.reached += walk.out.len() - before;
            walk.seen.insert(uid);
        }
        Ok(())
    }
}

/// One walk's state.
struct Walk<'a> {
    /// Entities walked.
    seen: HashSet<EntityUID, KeyedHash>,
    /// What the slice holds from this walk.
    out: Vec<Arc<ast::Entity>>,
    /// Entities the slice holds, this walk's and any base's: the bound applies to both.
    reached: usize,
    /// Scratch for [`SliceSource::ancestors_of`].
    ancestors: Vec<(EntityUID, Option<&'a Arc<Stored>>)>,
}

impl Walk<'_> {
    fn new() -> Self {
        Self {
            seen: HashSet::with_capacity_and_hasher(32, KeyedHash::default()),
            out: Vec::with_capacity(32),
            reached: 0,
            ancestors: Vec::new(),
        }
    }
}

/// `base` with `more` added, as the public type (already closed: no hierarchy work).
fn into_entities(
    base: CoreEntities,
    more: Vec<Arc<ast::Entity>>,
) -> Result<cedar_policy::Entities, SliceError> {
    add_closed(base, more).map(cedar_policy::Entities::from)
}

/// `base` with `more` added, already closed.
fn add_closed(base: CoreEntities, more: Vec<Arc<ast::Entity>>) -> Result<CoreEntities, SliceError> {
    base.add_entities(
        more,
        None::<&NoEntitiesSchema>,
        TCComputation::AssumeAlreadyComputed,
        Extensions::all_available(),
    )
    .map_err(|e| SliceError::Inconsistent(e.to_string()))
}

/// The part of a slice the store alone decides: everything reached from roots that
/// are not a request's own entities.
pub(crate) struct BaseSlice {
    entities: CoreEntities,
    /// Entities walked (in `entities`, or looked for and absent).
    walked: HashSet<EntityUID, KeyedHash>,
    /// What the base was cut from, for the decision cache: every uid it walked or looked
    /// up as an ancestor, but the owned entities (which no request may bring).
    deps: Vec<Dependency>,
    /// Those uids as a set, past [`SCAN_DEPS`] of them.
    looked_up_index: Option<HashSet<EntityUID, KeyedHash>>,
    /// Entities in the base, not counting the actions.
    len: usize,
}

/// Dependencies a base scans for a request's entity before it keeps them as a set.
const SCAN_DEPS: usize = 32;

impl BaseSlice {
    /// Whether the base looked up `uid`, as a node or an ancestor: a request bringing
    /// it would have changed the base.
    fn looked_up(&self, uid: &EntityUID) -> bool {
        match &self.looked_up_index {
            Some(set) => set.contains(uid),
            None => self.deps.iter().any(|d| &d.uid == uid),
        }
    }
}

/// Most bases one snapshot keeps: past it, slices are cut whole. A base is a few
/// kilobytes (its `Entities` map shares the entities with the store).
pub(crate) const MAX_BASES: usize = 4096;

/// Most entries (roots, entities and dependencies, about 100 bytes each) all of one
/// snapshot's bases hold together: a caller asking about resources whose slices are
/// large (a schema whose attributes list many entities) cannot make the bases grow
/// past a few megabytes. Past it, slices are cut whole.
pub(crate) const MAX_BASE_ENTRIES: usize = 1 << 16;

/// The bases of one snapshot, by the roots they were cut from. A snapshot never
/// changes, so a base never goes stale: a write makes a new snapshot with none.
#[derive(Default)]
pub(crate) struct BaseSlices {
    held: std::sync::Mutex<HeldBases>,
}

#[derive(Default)]
struct HeldBases {
    by_roots: HashMap<Vec<EntityUID>, Arc<BaseSlice>, KeyedHash>,
    /// Entries the bases hold, against [`MAX_BASE_ENTRIES`].
    entries: usize,
}

impl BaseSlices {
    fn lock(&self) -> std::sync::MutexGuard<'_, HeldBases> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn get(&self, roots: &[EntityUID]) -> Option<Arc<BaseSlice>> {
        self.lock().by_roots.get(roots).cloned()
    }

    /// Keeps `base` for `roots` while both bounds allow.
    fn offer(&self, roots: Vec<EntityUID>, base: &Arc<BaseSlice>) {
        let entries = roots.len() + base.len + base.deps.len();
        let mut held = self.lock();
        if held.by_roots.len() >= MAX_BASES
            || held.entries.saturating_add(entries) > MAX_BASE_ENTRIES
            || held.by_roots.contains_key(&roots)
        {
            return;
        }
        held.entries += entries;
        held.by_roots.insert(roots, Arc::clone(base));
    }

    /// How many bases are kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().by_roots.len()
    }
}

/// Entities a slice usually holds at most, which its map is sized for at once.
const TYPICAL_SLICE: usize = 32;

/// An empty `Entities` whose map already has room for [`TYPICAL_SLICE`] entities, to
/// clone for each slice: Cedar's constructor starts from an empty map, which then
/// grows (and rehashes every entry with SipHash) two or three times per slice. A
/// clone of a map keeps its capacity.
fn presized_entities() -> &'static CoreEntities {
    static PRESIZED: std::sync::OnceLock<CoreEntities> = std::sync::OnceLock::new();
    PRESIZED.get_or_init(|| {
        let Ok(placeholder) = EntityType::from_normalized_str("Placeholder") else {
            return CoreEntities::new();
        };
        let uids: Vec<EntityUID> = (0..TYPICAL_SLICE)
            .map(|i| {
                EntityUID::from_components(placeholder.clone(), ast::Eid::new(i.to_string()), None)
            })
            .collect();
        let filled = CoreEntities::new().add_entities(
            uids.iter().map(|u| {
                Arc::new(ast::Entity::new_with_attr_partial_value(
                    u.clone(),
                    [],
                    HashSet::new(),
                    HashSet::new(),
                    [],
                ))
            }),
            None::<&NoEntitiesSchema>,
            TCComputation::AssumeAlreadyComputed,
            Extensions::all_available(),
        );
        // Removing keeps the map's capacity; if anything failed, an unsized map is
        // still correct.
        filled
            .ok()
            .and_then(|f| {
                f.remove_entities(uids, TCComputation::AssumeAlreadyComputed)
                    .ok()
            })
            .filter(CoreEntities::is_empty)
            .unwrap_or_default()
    })
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

    /// The map every slice starts from is empty: the placeholders that sized it are
    /// gone, so none can appear in a decision.
    #[test]
    fn the_presized_map_every_slice_starts_from_holds_no_entity() {
        let base = super::presized_entities();
        assert!(base.is_empty());
        assert_eq!(base.iter().count(), 0);
    }

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
            // A node whose zone no fact describes: a request may bring that zone, which
            // the node's ancestors then pass through (such a request is cut whole).
            entities_with_missing_zone(&engine);
            for _ in 0..150 {
                let n = node(&mut next);
                if next(3) == 0 {
                    compare(&engine, &with_own_entities(&mut next, &n));
                    continue;
                }
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

    fn entities_with_missing_zone(engine: &Engine) {
        engine
            .upsert_entities(&json!([{"uid": {"type": "Node", "id": "orphan"},
                "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z-missing"}}, "rack": "r",
                    "driverVersion": "590.48.01", "cudaImage": "i", "gpuNode": true, "gpuCount": 8,
                    "cpuCount": 64, "gpuMemoryMiB": 81920, "hottestGpuTempC": 50,
                    "powerDrawW": 2000, "powerWindowMeanW": 1000},
                "parents": [{"type": "Zone", "id": "z-missing"}]}]))
            .unwrap();
    }

    /// A request that brings entities of its own: a new workload (in a namespace the
    /// store may not hold, brought too), and sometimes the zone a stored node names
    /// but no fact describes.
    fn with_own_entities(next: &mut impl FnMut(u64) -> u64, node: &str) -> Request {
        let ns = ["inference", "training", "brought"][next(3) as usize];
        let mut own = vec![json!({"uid": {"type": "Workload", "id": "own"},
            "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": ns}},
                "class": (["inference", "training", "rlhf"][next(3) as usize]),
                "gpus": next(9), "cpuMillis": next(80_000), "gpuMemoryMiB": next(90_000), "image": "i"},
            "parents": [{"type": "Namespace", "id": ns}]})];
        if ns == "brought" {
            own.push(
                json!({"uid": {"type": "Namespace", "id": "brought"}, "attrs": {}, "parents": []}),
            );
        }
        let resource = if next(3) == 0 {
            own.push(json!({"uid": {"type": "Zone", "id": "z-missing"},
                "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "c"}},
                    "powerDrawW": next(50_000), "powerCeilingW": 40_000},
                "parents": [{"type": "Cluster", "id": "c"}]}));
            "orphan"
        } else {
            node
        };
        Request::from_json_value(
            &json!({"principal": "Workload::\"own\"", "action": "schedule",
            "resource": format!("Node::\"{resource}\""), "entities": own}),
        )
        .unwrap()
    }

    /// Bases whose entries together would pass the bound are not kept: a flood of
    /// questions on resources with large slices cannot grow a snapshot's memory.
    #[test]
    fn bases_stop_being_kept_at_their_entry_bound() {
        use super::{BaseSlice, BaseSlices, Dependency, MAX_BASE_ENTRIES};
        use cedar_policy_core::ast::EntityUID;
        use std::str::FromStr;
        use std::sync::Arc;
        let uid = |i: usize| EntityUID::from_str(&format!("Node::\"n{i}\"")).unwrap();
        let big = |i: usize| {
            Arc::new(BaseSlice {
                entities: super::presized_entities().clone(),
                walked: Default::default(),
                deps: (0..1000)
                    .map(|d| Dependency {
                        uid: uid(i * 1000 + d),
                        version: None,
                    })
                    .collect(),
                looked_up_index: None,
                len: 1000,
            })
        };
        let bases = BaseSlices::default();
        for i in 0..100 {
            bases.offer(vec![uid(i)], &big(i));
        }
        // 2,001 entries each: 32 fit under 65,536.
        assert_eq!(bases.len(), MAX_BASE_ENTRIES / 2001);
        assert!(bases.get(&[uid(0)]).is_some());
        assert!(bases.get(&[uid(99)]).is_none());
    }

    /// Requests on the same node with workloads of their own share one base: the
    /// node's part of the slice is cut once per snapshot.
    #[test]
    fn requests_with_their_own_workloads_share_the_nodes_base() {
        let engine = Engine::from_embedded_defaults().unwrap();
        let cluster = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../testdata/entities/cluster.json"),
        )
        .unwrap();
        engine
            .upsert_entities(&serde_json::from_str(&cluster).unwrap())
            .unwrap();
        let mut x = 7;
        let mut next = |m: u64| {
            x = (x * 48_271) % 2_147_483_647;
            x % m
        };
        for _ in 0..20 {
            let request = with_own_entities(&mut next, "gpu-a1");
            if request.entities().len() == 3 {
                continue; // the orphan node, not in this store
            }
            compare(&engine, &request);
        }
        let snapshot = engine.snapshot_now();
        // One base per set of stored roots: gpu-a1 with the action's literals, and the
        // namespace's when the workload's is stored.
        assert!(snapshot.bases.len() >= 1);
        assert!(snapshot.bases.len() <= 2, "{}", snapshot.bases.len());
    }
}
