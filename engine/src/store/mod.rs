//! The entity store: the cluster facts decisions read, kept so that one fact update costs
//! microseconds whatever the store holds.
//!
//! Cedar's own `Entities` has no structural sharing and recomputes the hierarchy's
//! closure over everything on each change, so a store of 110,000 entities cost half a
//! second per update. Here every entity is an immutable [`Stored`] record in a persistent
//! ordered map ([`imbl::OrdMap`]): an update copies one path of the tree, a snapshot is a
//! pointer, and readers never see a half-applied change. Records keep only direct
//! parents; ancestors are followed at slice time ([`Store::ancestors`]), so a change
//! high in the hierarchy never rewrites its descendants.
//!
//! Entity JSON is converted here, directed by the schema's attribute types (Cedar's
//! generic JSON reader tries every value shape in turn and costs ten times more), and
//! every converted entity is then checked by Cedar's own schema-conformance checker, so
//! what the store accepts is exactly what Cedar accepts.
//!
//! Decisions never read the map directly: they get a slice ([`crate::slice`]).

use std::collections::{HashMap, HashSet};
use std::ops::Bound;
use std::sync::Arc;

use cedar_policy_core::ast::{
    self, EntityType, EntityUID, Literal, PartialValue, Value, ValueKind,
};
use cedar_policy_core::entities::json::CedarValueJson;
use imbl::OrdMap;
use serde_json::{Map, Value as Json};
use smol_str::SmolStr;

mod convert;
#[cfg(test)]
mod tests;

pub(crate) use convert::{Converted, Converter, entity_type, parse_uid};

/// Most nesting of sets and records in one attribute value.
const MAX_VALUE_DEPTH: usize = 32;

/// One stored entity: attributes, tags and direct parents, immutable once stored.
///
/// Kept small because a cluster has a hundred thousand of them: attribute names are
/// interned ids, entity references and parents are shared `Arc`s (a hundred thousand
/// workloads point at one namespace), long strings are interned.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    /// Attributes, sorted by name id; the blocklist attribute is never stored (the
    /// blocklist owns it).
    pub attrs: Box<[(AttrId, Value)]>,
    /// Tags (RFC 82), by name.
    pub tags: Box<[(SmolStr, Value)]>,
    /// Direct parents.
    pub parents: Box<[Arc<EntityUID>]>,
    /// This version as Cedar's entity, made the first time a decision reads it (see
    /// [`Stored::materialized`]): a decision then shares it instead of building and
    /// dropping its own copy of every attribute.
    pub memo: std::sync::OnceLock<Box<Materialized>>,
}

/// A stored entity as Cedar's entity, with what it was made with besides the stored
/// version itself (its ancestors, the blocklist's view): valid only while they are
/// the same.
#[derive(Debug, Clone)]
pub(crate) struct Materialized {
    /// In the order the slice met them.
    ancestors: Box<[EntityUID]>,
    blocked: Option<(SmolStr, bool)>,
    entity: Arc<ast::Entity>,
}

impl Stored {
    /// A stored entity with no memo yet.
    pub fn new(
        attrs: Box<[(AttrId, Value)]>,
        tags: Box<[(SmolStr, Value)]>,
        parents: Box<[Arc<EntityUID>]>,
    ) -> Self {
        Self {
            attrs,
            tags,
            parents,
            memo: std::sync::OnceLock::new(),
        }
    }

    /// This version as Cedar's entity with `ancestors` and the blocklist's view: the
    /// one made before when they are the same (the first one made is kept), else a new
    /// one.
    pub fn materialized<'u>(
        &self,
        uid: &EntityUID,
        ancestors: impl Iterator<Item = &'u EntityUID> + Clone,
        blocklist: Option<(&SmolStr, bool)>,
    ) -> Arc<ast::Entity> {
        let same = |m: &Materialized| {
            m.ancestors.iter().eq(ancestors.clone())
                && m.blocked.as_ref().map(|(a, b)| (a, *b)) == blocklist
                && m.entity.uid() == uid
        };
        if let Some(m) = self.memo.get()
            && same(m)
        {
            return Arc::clone(&m.entity);
        }
        let blocked = blocklist.map(|(a, b)| (a.clone(), b));
        let entity = Arc::new(materialize(
            uid,
            self,
            ancestors.clone().cloned().collect(),
            blocklist,
        ));
        let _ = self.memo.set(Box::new(Materialized {
            ancestors: ancestors.cloned().collect(),
            blocked,
            entity: Arc::clone(&entity),
        }));
        entity
    }

    /// The uids its attribute and tag values reference, in any nesting.
    pub fn refs(&self) -> impl Iterator<Item = &EntityUID> {
        let mut out = Vec::new();
        for v in self
            .attrs
            .iter()
            .map(|(_, v)| v)
            .chain(self.tags.iter().map(|(_, v)| v))
        {
            collect_refs(v, &mut out, 0);
        }
        out.into_iter()
    }

    /// Its attributes with their names.
    pub fn named_attrs(&self) -> impl Iterator<Item = (SmolStr, &Value)> {
        self.attrs.iter().map(|(id, v)| (id.name(), v))
    }
}

/// An interned attribute name. Names come from schema-checked entities, so there are
/// as many as the schema declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct AttrId(u16);

/// Interning tables shared by every store in the process: attribute names, entity
/// types, entity uids that are referenced or are parents, and long strings. They only
/// grow; each is bounded, and past its bound values are simply not shared.
mod intern {
    use std::collections::HashMap;
    use std::sync::{Arc, PoisonError, RwLock};

    use cedar_policy_core::ast::{EntityType, EntityUID};
    use smol_str::SmolStr;

    const MAX_NAMES: usize = u16::MAX as usize;
    const MAX_TYPES: usize = 65_536;
    const MAX_UIDS: usize = 1 << 20;
    const MAX_STRINGS: usize = 1 << 16;

    #[derive(Default)]
    pub struct Names {
        by_id: Vec<SmolStr>,
        by_name: HashMap<SmolStr, u16>,
    }

    static NAMES: RwLock<Option<Names>> = RwLock::new(None);
    /// At most `MAX_TYPES` names, all from the schema: a fast hash (every store lookup
    /// asks it).
    type TypeTable = (
        Vec<EntityType>,
        HashMap<EntityType, u32, crate::hashing::FastHash>,
    );

    static TYPES: RwLock<Option<TypeTable>> = RwLock::new(None);
    static UIDS: RwLock<Option<HashMap<EntityUID, Arc<EntityUID>>>> = RwLock::new(None);
    static STRINGS: RwLock<Option<HashMap<SmolStr, ()>>> = RwLock::new(None);

    pub fn name_id(name: &str) -> Option<u16> {
        if let Some(id) = NAMES
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|n| n.by_name.get(name))
        {
            return Some(*id);
        }
        let mut guard = NAMES.write().unwrap_or_else(PoisonError::into_inner);
        let names = guard.get_or_insert_with(Names::default);
        if let Some(id) = names.by_name.get(name) {
            return Some(*id);
        }
        if names.by_id.len() >= MAX_NAMES {
            return None;
        }
        let id = u16::try_from(names.by_id.len()).ok()?;
        names.by_id.push(SmolStr::new(name));
        names.by_name.insert(SmolStr::new(name), id);
        Some(id)
    }

    pub fn name(id: u16) -> SmolStr {
        NAMES
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|n| n.by_id.get(usize::from(id)).cloned())
            .unwrap_or_default()
    }

    /// The id of `ty`, interning it when `insert`.
    pub fn type_id(ty: &EntityType, insert: bool) -> Option<u32> {
        if let Some(id) = TYPES
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|(_, m)| m.get(ty))
        {
            return Some(*id);
        }
        if !insert {
            return None;
        }
        let mut guard = TYPES.write().unwrap_or_else(PoisonError::into_inner);
        let (list, map) = guard.get_or_insert_with(Default::default);
        if let Some(id) = map.get(ty) {
            return Some(*id);
        }
        if list.len() >= MAX_TYPES {
            return None;
        }
        let id = u32::try_from(list.len()).ok()?;
        list.push(ty.clone());
        map.insert(ty.clone(), id);
        Some(id)
    }

    pub fn type_of(id: u32) -> Option<EntityType> {
        TYPES
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|(list, _)| list.get(usize::try_from(id).ok()?).cloned())
    }

    /// One shared `Arc` per distinct uid.
    pub fn uid(uid: EntityUID) -> Arc<EntityUID> {
        if let Some(hit) = UIDS
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|m| m.get(&uid))
        {
            return Arc::clone(hit);
        }
        let mut guard = UIDS.write().unwrap_or_else(PoisonError::into_inner);
        let map = guard.get_or_insert_with(HashMap::new);
        if let Some(hit) = map.get(&uid) {
            return Arc::clone(hit);
        }
        let shared = Arc::new(uid.clone());
        if map.len() < MAX_UIDS {
            map.insert(uid, Arc::clone(&shared));
        }
        shared
    }

    /// One shared allocation per distinct long string (short ones live inline anyway).
    pub fn string(s: &str) -> SmolStr {
        if s.len() <= 23 {
            return SmolStr::new(s);
        }
        if let Some((hit, ())) = STRINGS
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|m| m.get_key_value(s))
        {
            return hit.clone();
        }
        let mut guard = STRINGS.write().unwrap_or_else(PoisonError::into_inner);
        let map = guard.get_or_insert_with(HashMap::new);
        if let Some((hit, ())) = map.get_key_value(s) {
            return hit.clone();
        }
        let made = SmolStr::new(s);
        if map.len() < MAX_STRINGS {
            map.insert(made.clone(), ());
        }
        made
    }
}

impl AttrId {
    /// The id of `name`, or `None` when the table is full (65,535 names).
    pub fn of(name: &str) -> Option<Self> {
        intern::name_id(name).map(Self)
    }

    /// The name.
    pub fn name(self) -> SmolStr {
        intern::name(self.0)
    }

    /// The number standing for the name in this process.
    pub fn index(self) -> u16 {
        self.0
    }
}

/// A stored entity's key: its interned type and its id. A third of the size of a
/// Cedar uid, and ordered by type first, so one type's entities are a range.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Key {
    ty: u32,
    id: SmolStr,
}

impl Key {
    /// The key of `uid`, interning its type (for writes).
    fn make(uid: &EntityUID) -> Option<Self> {
        Some(Self {
            ty: intern::type_id(uid.entity_type(), true)?,
            id: SmolStr::new(<ast::Eid as AsRef<str>>::as_ref(uid.eid())),
        })
    }

    /// The key of `uid` if its type was ever stored (for reads).
    fn find(uid: &EntityUID) -> Option<Self> {
        Some(Self {
            ty: intern::type_id(uid.entity_type(), false)?,
            id: SmolStr::new(<ast::Eid as AsRef<str>>::as_ref(uid.eid())),
        })
    }

    fn uid(&self) -> Option<EntityUID> {
        Some(EntityUID::from_components(
            intern::type_of(self.ty)?,
            ast::Eid::new(self.id.clone()),
            None,
        ))
    }
}

fn collect_refs<'a>(v: &'a Value, out: &mut Vec<&'a EntityUID>, depth: usize) {
    if depth > MAX_VALUE_DEPTH {
        return;
    }
    match &v.value {
        ValueKind::Lit(Literal::EntityUID(u)) => out.push(u),
        ValueKind::Set(set) => {
            for e in set.iter() {
                collect_refs(e, out, depth + 1);
            }
        }
        ValueKind::Record(r) => {
            for e in r.values() {
                collect_refs(e, out, depth + 1);
            }
        }
        ValueKind::Lit(_) | ValueKind::ExtensionValue(_) => {}
    }
}

/// The store itself: cheap to clone (a snapshot is a pointer to a shared tree).
///
/// It also keeps a short log of what changed: each insert or remove is a new version,
/// and at least the last [`CHANGE_LOG_LEN`] of them (at most twice as many) name the
/// entity they changed, so a reader
/// that saw one version can learn what is different in a later one without comparing
/// every entity ([`Store::changed_since`]). A store made afresh starts a new lineage:
/// versions are comparable only within one.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    entities: OrdMap<Key, Arc<Stored>>,
    lineage: u64,
    version: u64,
    changes: imbl::Vector<(u64, Key)>,
}

/// Changes a [`Store`] remembers.
pub(crate) const CHANGE_LOG_LEN: usize = 4_096;

impl Default for Store {
    fn default() -> Self {
        static LINEAGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            entities: OrdMap::new(),
            lineage: LINEAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            version: 0,
            changes: imbl::Vector::new(),
        }
    }
}

/// Where a [`Store`] stood: its lineage and version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreVersion {
    lineage: u64,
    version: u64,
}

impl StoreVersion {
    /// Whether this is a later version of the same store as `other`.
    pub fn is_later_than(self, other: Self) -> bool {
        self.lineage == other.lineage && self.version > other.version
    }
}

impl Store {
    /// Where this store stands now.
    pub fn version(&self) -> StoreVersion {
        StoreVersion {
            lineage: self.lineage,
            version: self.version,
        }
    }

    /// The entities changed (inserted, replaced or removed) since `then`, a version of
    /// this store's lineage no later than this one; `None` when that cannot be told
    /// (another lineage, or further back than the log reaches). An entity changed
    /// twice may be named twice.
    pub fn changed_since(&self, then: StoreVersion) -> Option<Vec<EntityUID>> {
        if then.lineage != self.lineage || then.version > self.version {
            return None;
        }
        let missing = self.version - then.version;
        if missing > self.changes.len() as u64 {
            return None;
        }
        let first = self.changes.len() - missing as usize;
        self.changes
            .iter()
            .skip(first)
            .map(|(_, k)| k.uid())
            .collect()
    }

    fn log(&mut self, key: Key) {
        self.version += 1;
        // Trimmed in one cut when twice as long: one pop per insert copied the
        // log's shared front chunk on every write.
        if self.changes.len() >= 2 * CHANGE_LOG_LEN {
            self.changes = self.changes.skip(self.changes.len() - CHANGE_LOG_LEN);
        }
        self.changes.push_back((self.version, key));
    }

    /// Number of entities.
    pub fn len(&self) -> usize {
        self.entities.len()
    }

    /// One entity.
    pub fn get(&self, uid: &EntityUID) -> Option<&Arc<Stored>> {
        self.entities.get(&Key::find(uid)?)
    }

    /// Whether `uid` is stored.
    pub fn contains(&self, uid: &EntityUID) -> bool {
        self.get(uid).is_some()
    }

    /// Adds or replaces one entity. (An entity of a type beyond the type table's bound
    /// is not stored; schemas declare a few dozen types.)
    pub fn insert(&mut self, uid: EntityUID, stored: Arc<Stored>) {
        if let Some(key) = Key::make(&uid) {
            self.entities.insert(key.clone(), stored);
            self.log(key);
        }
    }

    /// Removes one entity; whether it was there.
    pub fn remove(&mut self, uid: &EntityUID) -> bool {
        let Some(key) = Key::find(uid) else {
            return false;
        };
        let removed = self.entities.remove(&key).is_some();
        if removed {
            self.log(key);
        }
        removed
    }

    /// Every entity, by type (in the order types were first stored), then id.
    pub fn iter(&self) -> impl Iterator<Item = (EntityUID, &Arc<Stored>)> {
        self.entities
            .iter()
            .filter_map(|(k, s)| Some((k.uid()?, s)))
    }

    /// The entities of one type, in id order: a range of the map, not a scan.
    pub fn of_type<'a>(
        &'a self,
        entity_type: &'a EntityType,
    ) -> impl Iterator<Item = (EntityUID, &'a Arc<Stored>)> + 'a {
        let ty = intern::type_id(entity_type, false);
        ty.into_iter().flat_map(move |ty| {
            // The smallest key of a type has the empty id.
            let first = Key {
                ty,
                id: SmolStr::default(),
            };
            self.entities
                .range((Bound::Included(first), Bound::Unbounded))
                .take_while(move |(k, _)| k.ty == ty)
                .filter_map(|(k, s)| Some((k.uid()?, s)))
        })
    }

    /// Whether making `uid`'s parents `parents` would close a cycle in the hierarchy
    /// (given the stored entities and `pending`, entities about to be stored with it).
    pub fn would_cycle(
        &self,
        uid: &EntityUID,
        parents: &[Arc<EntityUID>],
        pending: &HashMap<EntityUID, Arc<Stored>>,
    ) -> bool {
        let mut seen: HashSet<&EntityUID> = HashSet::new();
        let mut stack: Vec<&EntityUID> = parents.iter().map(AsRef::as_ref).collect();
        while let Some(next) = stack.pop() {
            if next == uid {
                return true;
            }
            if !seen.insert(next) {
                continue;
            }
            let found = pending.get(next).or_else(|| self.get(next));
            if let Some(s) = found {
                stack.extend(s.parents.iter().map(AsRef::as_ref));
            }
        }
        false
    }

    /// Every ancestor of an entity whose direct parents are `parents`, following the
    /// stored hierarchy (and `extra`, request-scoped entities, first).
    pub fn ancestors(
        &self,
        parents: &[Arc<EntityUID>],
        extra: &crate::slice::RequestEntities,
    ) -> HashSet<EntityUID> {
        let mut out: HashSet<EntityUID> = HashSet::with_capacity(parents.len() * 2);
        let mut stack: Vec<&EntityUID> = parents.iter().map(AsRef::as_ref).collect();
        while let Some(next) = stack.pop() {
            if out.contains(next) {
                continue;
            }
            out.insert(next.clone());
            let found = extra.get(next).or_else(|| self.get(next));
            if let Some(s) = found {
                stack.extend(s.parents.iter().map(AsRef::as_ref));
            }
        }
        out
    }
}

/// Turns a stored record into the entity Cedar evaluates: all ancestors as parents
/// (the slice is handed to Cedar as already closed), and the blocklist's view set.
pub(crate) fn materialize(
    uid: &EntityUID,
    stored: &Stored,
    ancestors: HashSet<EntityUID>,
    blocklist: Option<(&SmolStr, bool)>,
) -> ast::Entity {
    let attrs = stored
        .named_attrs()
        .map(|(k, v)| (k, PartialValue::Value(v.clone())))
        .chain(
            blocklist.map(|(attr, blocked)| (attr.clone(), PartialValue::Value(blocked.into()))),
        );
    ast::Entity::new_with_attr_partial_value(
        uid.clone(),
        attrs,
        HashSet::new(),
        ancestors,
        stored
            .tags
            .iter()
            .map(|(k, v)| (k.clone(), PartialValue::Value(v.clone()))),
    )
}

/// A stored entity as Cedar entity JSON (`{"uid", "attrs", "parents"[, "tags"]}`), with
/// the blocklist's view added where it applies.
pub(crate) fn to_json(
    uid: &EntityUID,
    stored: &Stored,
    blocklist: Option<(&SmolStr, bool)>,
) -> Json {
    let mut attrs = Map::new();
    for (k, v) in stored.named_attrs() {
        attrs.insert(k.to_string(), value_json(v));
    }
    if let Some((attr, blocked)) = blocklist {
        attrs.insert(attr.to_string(), Json::Bool(blocked));
    }
    let mut out = Map::new();
    out.insert("uid".into(), uid_json(uid));
    out.insert("attrs".into(), Json::Object(attrs));
    out.insert(
        "parents".into(),
        Json::Array(stored.parents.iter().map(|p| uid_json(p)).collect()),
    );
    if !stored.tags.is_empty() {
        let tags = stored
            .tags
            .iter()
            .map(|(k, v)| (k.to_string(), value_json(v)))
            .collect();
        out.insert("tags".into(), Json::Object(tags));
    }
    Json::Object(out)
}

/// `{"type": .., "id": ..}`.
pub(crate) fn uid_json(uid: &EntityUID) -> Json {
    let mut m = Map::new();
    m.insert("type".into(), Json::String(uid.entity_type().to_string()));
    m.insert("id".into(), Json::String(uid.eid().escaped().to_string()));
    // `escaped` quotes nothing for plain ids; the raw id is what JSON needs.
    m.insert(
        "id".into(),
        Json::String(<ast::Eid as AsRef<str>>::as_ref(uid.eid()).to_owned()),
    );
    Json::Object(m)
}

/// A value in Cedar's JSON value form.
pub(crate) fn value_json(v: &Value) -> Json {
    CedarValueJson::from_value(v.clone())
        .ok()
        .and_then(|j| serde_json::to_value(j).ok())
        .unwrap_or(Json::Null)
}
