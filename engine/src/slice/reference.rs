//! The whole store as Cedar sees it, for the differential test: every stored entity
//! (with its ancestors and the blocklist's view), this request's entities, and the
//! blocklist's stub for every entity of its type that is named anywhere (in the
//! store's attributes or among the roots) but not stored.

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
