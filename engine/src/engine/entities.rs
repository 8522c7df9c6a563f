//! Entity writes (upsert, remove, replace what an owner supplies) and reads.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, PoisonError};

use cedar_policy_core::ast::EntityUID;
use serde_json::Value;

use super::Engine;
use super::snapshot::{Snapshot, Working, owned_cache};
use crate::bundle::Bundle;
use crate::error::EntityError;
use crate::facts::EntityOwner;
use crate::request::{EntityUid, kind};
use crate::store::{self, Converted, Converter, Stored};

pub(super) struct ByReferenceAnswer {
    pub(super) at: store::StoreVersion,
    pub(super) type_name: String,
    pub(super) attr: String,
    pub(super) answer: Arc<EntitiesByReference>,
}

/// The stored entities of one type, each with the entity one of its attributes refers
/// to ([`Engine::entities_by_reference`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EntitiesByReference {
    /// The entities, in id order.
    pub uids: Vec<EntityUid>,
    /// For each of `uids`, the id of the entity its attribute refers to (`None` when it
    /// has no such reference).
    pub targets: Vec<Option<String>>,
}

impl EntitiesByReference {
    /// Whether an entity with this id is among them.
    pub fn contains_id(&self, id: &str) -> bool {
        self.uids.binary_search_by(|u| u.id().cmp(id)).is_ok()
    }
}

impl Engine {
    /// Adds or replaces entities (Cedar entity JSON: an array of
    /// `{"uid": .., "attrs": .., "parents": ..}`), validated against the schema.
    /// All or nothing: on error the store is unchanged. Entities the engine owns
    /// (see [`Engine::owned_types`]) are refused; the blocklist attribute (`blocked`)
    /// may be omitted, and if given must agree with the blocklist.
    pub fn upsert_entities(&self, json: &Value) -> Result<usize, EntityError> {
        let Value::Array(items) = json else {
            return Err(EntityError::Shape {
                found: kind(json).into(),
            });
        };
        self.upsert_items(items)
    }

    pub(super) fn upsert_items(&self, items: &[Value]) -> Result<usize, EntityError> {
        // Converting is the dear part and runs outside the write queue; if a reload
        // changes the schema meanwhile, the write converts again.
        loop {
            let snapshot = self.shared.current.load_full();
            let bundle = Arc::clone(&snapshot.bundle);
            let converted = convert_all(&bundle, items)?;
            let result = self.write(Box::new(move |w: &mut Working| {
                if !Arc::ptr_eq(&w.bundle, &bundle) {
                    return Err(EntityError::SchemaChanged);
                }
                apply_upsert(w, converted)
            }));
            match result {
                Err(EntityError::SchemaChanged) => continue,
                other => return other,
            }
        }
    }

    /// Reads an entity JSON array from `reader` and upserts it, converting each entity
    /// as it is read (the whole document is never held as a JSON tree). All or
    /// nothing, like [`Engine::upsert_entities`].
    pub fn upsert_entities_from_reader(
        &self,
        reader: impl std::io::Read,
    ) -> Result<usize, EntityError> {
        let snapshot = self.shared.current.load_full();
        let bundle = Arc::clone(&snapshot.bundle);
        let converted = stream_convert(&bundle, reader)?;
        let count = converted.len();
        let result = self.write(Box::new(move |w: &mut Working| {
            if !Arc::ptr_eq(&w.bundle, &bundle) {
                return Err(EntityError::SchemaChanged);
            }
            apply_upsert(w, converted)
        }));
        match result {
            Err(EntityError::SchemaChanged) => Err(EntityError::Invalid {
                detail: "the policy set was reloaded while the entities were read; read them again"
                    .into(),
            }),
            other => other.map(|_| count),
        }
    }

    /// Removes entities by uid; unknown uids are ignored.
    pub fn remove_entities(&self, uids: &[EntityUid]) -> Result<(), EntityError> {
        let uids: Vec<EntityUID> = uids.iter().map(|u| u.0.as_ref().clone()).collect();
        self.write(Box::new(move |w: &mut Working| {
            for uid in &uids {
                if let Some(owner) = w.bundle.origins.owner_of(&uid.entity_type().to_string()) {
                    return Err(EntityError::Reserved {
                        uid: uid.to_string(),
                        owner: owner.as_str(),
                    });
                }
            }
            for uid in &uids {
                w.changed |= w.store.remove(uid);
                super::cluster::forget_cluster_facts(w, uid);
            }
            Ok(uids.len())
        }))
        .map(|_| ())
    }

    /// Replaces every stored entity of the types `owner` supplies with `json`: the
    /// server registers its API callers, groups and endpoints this way
    /// ([`EntityOwner::Api`]). The configuration's entities come from `probity.toml`
    /// only and are refused here.
    pub fn replace_owned_entities(
        &self,
        owner: EntityOwner,
        json: &Value,
    ) -> Result<usize, EntityError> {
        if owner == EntityOwner::Config {
            return Err(EntityError::Invalid {
                detail: "configuration entities come from probity.toml".into(),
            });
        }
        if owner == EntityOwner::Cluster {
            return Err(EntityError::Invalid {
                detail: "the cluster owns attributes, not entities (Engine::replace_cluster_facts)"
                    .into(),
            });
        }
        let Value::Array(items) = json else {
            return Err(EntityError::Shape {
                found: kind(json).into(),
            });
        };
        loop {
            let snapshot = self.shared.current.load_full();
            let bundle = Arc::clone(&snapshot.bundle);
            let converter = bundle.converter();
            let mut converted = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let c = converter
                    .entity(item)
                    .map_err(|(uid, e)| rejected(i, uid, e))?;
                if bundle.origins.owner_of(&c.uid.entity_type().to_string()) != Some(owner) {
                    return Err(rejected(
                        i,
                        Some(c.uid.to_string()),
                        format!(
                            "{} entities are not supplied by the {} owner",
                            c.uid.entity_type(),
                            owner.as_str()
                        ),
                    ));
                }
                converted.push(c);
            }
            let count = converted.len();
            let result = self.write(Box::new(move |w: &mut Working| {
                if !Arc::ptr_eq(&w.bundle, &bundle) {
                    return Err(EntityError::SchemaChanged);
                }
                let stale: Vec<EntityUID> = w
                    .store
                    .iter()
                    .filter(|(u, _)| {
                        w.bundle.origins.owner_of(&u.entity_type().to_string()) == Some(owner)
                    })
                    .map(|(u, _)| u.clone())
                    .collect();
                for u in &stale {
                    w.store.remove(u);
                }
                for c in converted {
                    w.store.insert(c.uid, Arc::new(c.stored));
                }
                w.owned = Arc::new(owned_cache(&w.bundle, &w.store));
                w.changed = true;
                Ok(count)
            }));
            match result {
                Err(EntityError::SchemaChanged) => continue,
                other => return other,
            }
        }
    }

    /// The entity types the engine owns, with who supplies them.
    pub fn owned_types(&self) -> BTreeMap<EntityOwner, std::collections::BTreeSet<String>> {
        self.shared
            .current
            .load()
            .bundle
            .origins
            .owned_types_by_owner()
    }

    /// One entity, as Cedar entity JSON.
    pub fn entity(&self, uid: &EntityUid) -> Option<Value> {
        let current = self.shared.current.load();
        let uid: &EntityUID = uid.0.as_ref();
        let stored = current.store.get(uid)?;
        Some(store::to_json(uid, stored, current.blocked_view(uid)))
    }

    /// Every stored entity of type `type_name` (all types if `None`), as Cedar entity JSON,
    /// sorted by uid. The entities the engine owns (`Settings`, `GpuModel`, ...) are included.
    pub fn entities_json(&self, type_name: Option<&str>) -> Vec<Value> {
        let current = self.shared.current.load();
        let json = |(uid, stored): (EntityUID, &Arc<Stored>)| {
            store::to_json(&uid, stored, current.blocked_view(&uid))
        };
        match type_name {
            None => current.store.iter().map(json).collect(),
            Some(t) => match store::entity_type(t) {
                Some(ty) => current.store.of_type(&ty).map(json).collect(),
                None => Vec::new(),
            },
        }
    }

    /// The stored entities of type `type_name`, in id order, each with the id of the
    /// entity its attribute `attr` refers to: how a host groups resources (nodes by
    /// zone) without materializing them. The answer is shared until the store changes.
    pub fn entities_by_reference(&self, type_name: &str, attr: &str) -> Arc<EntitiesByReference> {
        let current = self.shared.current.load();
        let at = current.store.version();
        let mut last = self
            .shared
            .by_reference
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = last
            .as_ref()
            .filter(|k| k.at == at && k.type_name == type_name && k.attr == attr)
        {
            return Arc::clone(&known.answer);
        }
        let (Some(ty), Some(name)) = (store::entity_type(type_name), store::AttrId::of(attr))
        else {
            return Arc::default();
        };
        let mut answer = EntitiesByReference::default();
        for (uid, stored) in current.store.of_type(&ty) {
            let target =
                stored
                    .attrs
                    .iter()
                    .find(|(id, _)| *id == name)
                    .and_then(|(_, v)| match &v.value {
                        cedar_policy_core::ast::ValueKind::Lit(
                            cedar_policy_core::ast::Literal::EntityUID(u),
                        ) => Some(<str as ToOwned>::to_owned(u.eid().as_ref())),
                        _ => None,
                    });
            answer
                .uids
                .push(EntityUid(cedar_policy::EntityUid::from(uid)));
            answer.targets.push(target);
        }
        let answer = Arc::new(answer);
        *last = Some(ByReferenceAnswer {
            at,
            type_name: type_name.to_owned(),
            attr: attr.to_owned(),
            answer: Arc::clone(&answer),
        });
        answer
    }

    /// Whether the store holds `uid` (without materializing it).
    pub fn contains_entity(&self, uid: &EntityUid) -> bool {
        let uid: &EntityUID = uid.0.as_ref();
        self.shared.current.load().store.contains(uid)
    }

    /// Number of entities in the store.
    pub fn entity_count(&self) -> usize {
        self.shared.current.load().store.len()
    }
}

pub(super) fn rejected(index: usize, uid: Option<String>, problem: String) -> EntityError {
    EntityError::Rejected {
        index,
        uid,
        problem,
    }
}

/// Entities converted from an update, each with its position in the update.
pub(super) type Positioned = Vec<(usize, Converted)>;

/// Converts entity JSON items; later items with the same uid replace earlier ones.
pub(super) fn convert_all(bundle: &Bundle, items: &[Value]) -> Result<Positioned, EntityError> {
    let converter = bundle.converter();
    let mut out: Positioned = Vec::with_capacity(items.len());
    let mut at: HashMap<EntityUID, usize> = HashMap::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if let Some(uid) = item.get("uid").and_then(|u| store::parse_uid(u).ok())
            && let Some(owner) = bundle.origins.owner_of(&uid.entity_type().to_string())
        {
            return Err(EntityError::Reserved {
                uid: uid.to_string(),
                owner: owner.as_str(),
            });
        }
        // The converter reads the same `uid` the check above did, so what it
        // returns is never an owned type's.
        let c = converter
            .entity(item)
            .map_err(|(uid, e)| rejected(i, uid, e))?;
        match at.get(&c.uid) {
            Some(&j) => {
                if let Some(slot) = out.get_mut(j) {
                    *slot = (i, c);
                }
            }
            None => {
                at.insert(c.uid.clone(), out.len());
                out.push((i, c));
            }
        }
    }
    Ok(out)
}

/// Reads a JSON array of entities from `reader`, converting each as it arrives.
pub(super) fn stream_convert(
    bundle: &Bundle,
    reader: impl std::io::Read,
) -> Result<Positioned, EntityError> {
    use serde::de::{Deserializer, SeqAccess, Visitor};
    struct Items<'a> {
        converter: Converter<'a>,
        bundle: &'a Bundle,
    }
    impl<'de> Visitor<'de> for Items<'_> {
        type Value = Result<Positioned, EntityError>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON array of entities")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out: Positioned = Vec::new();
            let mut at: HashMap<EntityUID, usize> = HashMap::new();
            let mut i = 0usize;
            while let Some(item) = seq.next_element::<Value>()? {
                let c = match self.converter.entity(&item) {
                    Ok(c) => c,
                    Err((uid, e)) => return Ok(Err(rejected(i, uid, e))),
                };
                if let Some(owner) = self
                    .bundle
                    .origins
                    .owner_of(&c.uid.entity_type().to_string())
                {
                    return Ok(Err(EntityError::Reserved {
                        uid: c.uid.to_string(),
                        owner: owner.as_str(),
                    }));
                }
                match at.get(&c.uid) {
                    Some(&j) => {
                        if let Some(slot) = out.get_mut(j) {
                            *slot = (i, c);
                        }
                    }
                    None => {
                        at.insert(c.uid.clone(), out.len());
                        out.push((i, c));
                    }
                }
                i += 1;
            }
            Ok(Ok(out))
        }
    }
    let mut de = serde_json::Deserializer::from_reader(reader);
    let converter = bundle.converter();
    let result = de
        .deserialize_seq(Items { converter, bundle })
        .map_err(|e| EntityError::Json {
            line: e.line(),
            column: e.column(),
            detail: e.to_string(),
        })?;
    de.end().map_err(|e| EntityError::Json {
        line: e.line(),
        column: e.column(),
        detail: e.to_string(),
    })?;
    result
}

pub(super) fn check_claimed_block(snapshot: &Snapshot, c: &Converted) -> Result<(), String> {
    let (Some(claimed), Some((attr, blocked))) = (c.claimed_block, snapshot.blocked_view(&c.uid))
    else {
        return Ok(());
    };
    if claimed != blocked {
        return Err(format!(
            "`{attr}: {claimed}` contradicts the blocklist, which owns it (block and unblock nodes through the blocklist)"
        ));
    }
    Ok(())
}

pub(super) fn apply_upsert(w: &mut Working, converted: Positioned) -> Result<usize, EntityError> {
    let count = converted.len();
    let (ty, attr) = match &w.bundle.blocklist {
        Some((t, a)) => (Some(t.clone()), Some(a.clone())),
        None => (None, None),
    };
    let mut pending: HashMap<EntityUID, Arc<Stored>> = HashMap::with_capacity(count);
    // The input order, so that a cycle is reported at the first entity, in that order,
    // whose new parents close it.
    let mut order: Vec<EntityUID> = Vec::with_capacity(count);
    for (index, c) in converted {
        if let (Some(claimed), Some(t)) = (c.claimed_block, &ty)
            && c.uid.entity_type() == t
        {
            let id: &str = c.uid.eid().as_ref();
            let blocked = w.blocked.contains_key(id);
            if claimed != blocked {
                return Err(EntityError::Rejected {
                    index,
                    uid: Some(c.uid.to_string()),
                    problem: format!(
                        "`{}: {claimed}` contradicts the blocklist, which owns it (block and unblock nodes through the blocklist)",
                        attr.as_deref().unwrap_or("blocked")
                    ),
                });
            }
        }
        let mut c = c;
        if !w.cluster.is_empty() {
            super::cluster::merge_cluster_facts(&w.cluster, &c.uid, &mut c.stored).map_err(
                |problem| EntityError::Rejected {
                    index,
                    uid: Some(c.uid.to_string()),
                    problem,
                },
            )?;
        }
        order.push(c.uid.clone());
        pending.insert(c.uid, Arc::new(c.stored));
    }
    for uid in &order {
        // An entity that keeps its stored parents is not walked: a cycle the upsert
        // would create has an edge the store lacks, so it passes through an entity
        // that is new or whose parents changed, and that entity's walk finds it.
        let closes = pending.get(uid).is_some_and(|s| {
            let kept = w
                .store
                .get(uid)
                .is_some_and(|old| same_parents(&old.parents, &s.parents));
            !kept && w.store.would_cycle(uid, &s.parents, &pending)
        });
        if closes {
            return Err(EntityError::Cycle {
                uid: uid.to_string(),
            });
        }
    }
    for (uid, stored) in pending {
        w.store.insert(uid, stored);
    }
    w.changed = true;
    Ok(count)
}

/// Whether two deduplicated parent lists hold the same parents, in any order: in the
/// same order (the common case, compared by address first), else by a set, so that a
/// long list costs no quadratic time inside the write queue.
pub(super) fn same_parents(a: &[Arc<EntityUID>], b: &[Arc<EntityUID>]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y) || x == y) {
        return true;
    }
    let theirs: HashSet<&EntityUID> = b.iter().map(AsRef::as_ref).collect();
    a.iter().all(|p| theirs.contains(p.as_ref()))
}
