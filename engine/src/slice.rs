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

mod base;
#[cfg(test)]
pub(crate) mod reference;
#[cfg(test)]
mod tests;

use base::BaseSlice;
pub(crate) use base::BaseSlices;

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
        Ok(BaseSlice::new(
            add_closed(presized_entities().clone(), walk.out)?,
            walk.seen,
            deps,
            len,
        ))
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
