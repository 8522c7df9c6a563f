//! A slice's base: what the roots the store answers for reach, cut once per snapshot
//! and kept in it (`Snapshot::bases`), bounded by count and by entries.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cedar_policy_core::ast::EntityUID;
use cedar_policy_core::entities::Entities as CoreEntities;

use super::Dependency;
use crate::hashing::KeyedHash;

/// The part of a slice the store alone decides: everything reached from roots that
/// are not a request's own entities.
pub(crate) struct BaseSlice {
    pub(super) entities: CoreEntities,
    /// Entities walked (in `entities`, or looked for and absent).
    pub(super) walked: HashSet<EntityUID, KeyedHash>,
    /// What the base was cut from, for the decision cache: every uid it walked or looked
    /// up as an ancestor, but the owned entities (which no request may bring).
    pub(super) deps: Vec<Dependency>,
    /// Those uids as a set, past [`SCAN_DEPS`] of them.
    pub(super) looked_up_index: Option<HashSet<EntityUID, KeyedHash>>,
    /// Entities in the base, not counting the actions.
    pub(super) len: usize,
}

/// Dependencies a base scans for a request's entity before it keeps them as a set.
const SCAN_DEPS: usize = 32;

impl BaseSlice {
    /// A base of `len` entities (`entities` holds them and the actions), cut by
    /// walking `walked`, from `deps`.
    pub(super) fn new(
        entities: CoreEntities,
        walked: HashSet<EntityUID, KeyedHash>,
        deps: Vec<Dependency>,
        len: usize,
    ) -> Self {
        let looked_up_index =
            (deps.len() > SCAN_DEPS).then(|| deps.iter().map(|d| d.uid.clone()).collect());
        Self {
            entities,
            walked,
            deps,
            looked_up_index,
            len,
        }
    }

    /// Whether the base looked up `uid`, as a node or an ancestor: a request bringing
    /// it would have changed the base.
    pub(super) fn looked_up(&self, uid: &EntityUID) -> bool {
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

    pub(super) fn get(&self, roots: &[EntityUID]) -> Option<Arc<BaseSlice>> {
        self.lock().by_roots.get(roots).cloned()
    }

    /// Keeps `base` for `roots` while both bounds allow.
    pub(super) fn offer(&self, roots: Vec<EntityUID>, base: &Arc<BaseSlice>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bases whose entries together would pass the bound are not kept: a flood of
    /// questions on resources with large slices cannot grow a snapshot's memory.
    #[test]
    fn bases_stop_being_kept_at_their_entry_bound() {
        use std::str::FromStr;
        let uid = |i: usize| EntityUID::from_str(&format!("Node::\"n{i}\"")).unwrap();
        let big = |i: usize| {
            Arc::new(BaseSlice::new(
                CoreEntities::new(),
                HashSet::default(),
                (0..1000)
                    .map(|d| Dependency {
                        uid: uid(i * 1000 + d),
                        version: None,
                    })
                    .collect(),
                1000,
            ))
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
}
