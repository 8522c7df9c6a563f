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

use crate::engine::BlockRecord;
use crate::store::{Store, Stored, materialize};

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

impl SliceSource<'_> {
    fn blocked_view(&self, uid: &EntityUID) -> Option<(&SmolStr, bool)> {
        let (ty, attr) = self.blocklist?;
        if uid.entity_type() != ty {
            return None;
        }
        let id: &str = uid.eid().as_ref();
        Some((attr, self.blocked.contains_key(id)))
    }

    /// The slice for `roots`.
    pub fn cut(
        &self,
        roots: impl IntoIterator<Item = EntityUID>,
    ) -> Result<cedar_policy::Entities, SliceError> {
        let mut queue: Vec<EntityUID> = roots.into_iter().collect();
        let mut seen: HashSet<EntityUID> = HashSet::with_capacity(16);
        let mut out: Vec<Arc<ast::Entity>> = Vec::with_capacity(16);
        while let Some(uid) = queue.pop() {
            if seen.contains(&uid) {
                continue;
            }
            if out.len() >= MAX_SLICE_ENTITIES {
                return Err(SliceError::TooLarge);
            }
            let stored = self.extra.get(&uid).or_else(|| self.store.get(&uid));
            if let Some(s) = stored {
                queue.extend(s.refs().filter(|r| !seen.contains(*r)).cloned());
            }
            if let Some(e) = self.owned.get(&uid) {
                out.push(Arc::clone(e));
            } else if let Some(s) = stored {
                let ancestors = self.store.ancestors(&s.parents, self.extra);
                out.push(Arc::new(materialize(
                    &uid,
                    s,
                    ancestors,
                    self.blocked_view(&uid),
                )));
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
