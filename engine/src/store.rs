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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Bound;
use std::str::FromStr;
use std::sync::Arc;

use cedar_policy_core::ast::{
    self, EntityType, EntityUID, Literal, Name, PartialValue, RestrictedExpr, Value, ValueKind,
};
use cedar_policy_core::entities::json::CedarValueJson;
use cedar_policy_core::evaluator::RestrictedEvaluator;
use cedar_policy_core::extensions::Extensions;
use cedar_policy_core::validator::ValidatorSchema;
use cedar_policy_core::validator::types::{EntityKind, Type};
use imbl::OrdMap;
use serde_json::{Map, Value as Json};
use smol_str::SmolStr;

use crate::conformance::TypeDescriptions;
use crate::facts::FactOrigins;

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
}

impl Stored {
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
    type TypeTable = (Vec<EntityType>, HashMap<EntityType, u32>);

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
        extra: &HashMap<EntityUID, Arc<Stored>>,
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

/// Whether `value` displays as exactly `text`, without building the string.
fn displays_as(value: &impl std::fmt::Display, text: &str) -> bool {
    struct Prefix<'t>(&'t str);
    impl std::fmt::Write for Prefix<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            match self.0.strip_prefix(s) {
                Some(rest) => {
                    self.0 = rest;
                    Ok(())
                }
                None => Err(std::fmt::Error),
            }
        }
    }
    let mut rest = Prefix(text);
    std::fmt::write(&mut rest, format_args!("{value}")).is_ok() && rest.0.is_empty()
}

/// Converts entity JSON into store records, directed by the schema.
pub(crate) struct Converter<'a> {
    schema: &'a ValidatorSchema,
    origins: &'a FactOrigins,
    descriptions: &'a TypeDescriptions,
}

/// One converted entity.
pub(crate) struct Converted {
    pub uid: EntityUID,
    pub stored: Stored,
    /// The blocklist attribute's value, if the JSON gave one (the caller checks it
    /// against the blocklist).
    pub claimed_block: Option<bool>,
}

impl<'a> Converter<'a> {
    pub fn new(
        schema: &'a ValidatorSchema,
        origins: &'a FactOrigins,
        descriptions: &'a TypeDescriptions,
    ) -> Self {
        Self {
            schema,
            origins,
            descriptions,
        }
    }

    /// Reads one Cedar entity JSON object. The error says what is wrong and where
    /// (`attrs.zone`, `parents[1]`), without the entity's own name (the caller adds it).
    pub fn entity(&self, json: &Json) -> Result<Converted, (Option<String>, String)> {
        let Json::Object(obj) = json else {
            return Err((
                None,
                format!("expected an entity object, found {}", kind(json)),
            ));
        };
        for key in obj.keys() {
            if !matches!(key.as_str(), "uid" | "attrs" | "parents" | "tags") {
                return Err((
                    None,
                    format!("unknown field `{key}` (expected uid, attrs, parents, tags)"),
                ));
            }
        }
        let uid = match obj.get("uid") {
            Some(u) => parse_uid(u).map_err(|e| (None, format!("uid: {e}")))?,
            None => return Err((None, "no `uid`".into())),
        };
        let named = |e: String| (Some(uid.to_string()), e);
        let entity_type = uid.entity_type();
        let decl = self.schema.get_entity_type(entity_type);
        let blocklist_attr = self
            .origins
            .blocklist
            .as_ref()
            .filter(|b| displays_as(entity_type, &b.entity_type))
            .map(|b| b.attr.clone());
        let mut claimed_block = None;
        let mut attrs: Vec<(AttrId, Value)> = Vec::new();
        match obj.get("attrs") {
            None | Some(Json::Null) => {}
            Some(Json::Object(map)) => {
                attrs.reserve_exact(map.len());
                for (name, v) in map {
                    if blocklist_attr.as_deref() == Some(name.as_str()) {
                        match v {
                            Json::Bool(b) => claimed_block = Some(*b),
                            other => {
                                return Err(named(format!(
                                    "attrs.{name}: expected a boolean, found {}",
                                    kind(other)
                                )));
                            }
                        }
                        continue;
                    }
                    let ty = decl
                        .and_then(|d| d.attr(name))
                        .map(|a| a.attr_type.as_ref());
                    let value = self
                        .value(v, ty, 0)
                        .map_err(|e| named(format!("attrs.{name}{e}")))?;
                    let id = AttrId::of(name).ok_or_else(|| {
                        named(format!("attrs.{name}: too many distinct attribute names"))
                    })?;
                    attrs.push((id, value));
                }
            }
            Some(other) => {
                return Err(named(format!(
                    "attrs: expected an object, found {}",
                    kind(other)
                )));
            }
        }
        let mut tags: Vec<(SmolStr, Value)> = Vec::new();
        match obj.get("tags") {
            None | Some(Json::Null) => {}
            Some(Json::Object(map)) => {
                let ty = decl.and_then(|d| d.tag_type());
                for (name, v) in map {
                    let value = self
                        .value(v, ty, 0)
                        .map_err(|e| named(format!("tags.{name}{e}")))?;
                    tags.push((SmolStr::new(name), value));
                }
            }
            Some(other) => {
                return Err(named(format!(
                    "tags: expected an object, found {}",
                    kind(other)
                )));
            }
        }
        let mut parents: Vec<Arc<EntityUID>> = Vec::new();
        match obj.get("parents") {
            None | Some(Json::Null) => {}
            Some(Json::Array(list)) => {
                for (i, p) in list.iter().enumerate() {
                    let parent = parse_uid(p).map_err(|e| named(format!("parents[{i}]: {e}")))?;
                    if !parents.iter().any(|q| **q == parent) {
                        parents.push(intern::uid(parent));
                    }
                }
            }
            Some(other) => {
                return Err(named(format!(
                    "parents: expected an array, found {}",
                    kind(other)
                )));
            }
        }
        attrs.sort_by_key(|a| a.0);
        tags.sort_by(|a, b| a.0.cmp(&b.0));
        let stored = Stored {
            attrs: attrs.into_boxed_slice(),
            tags: tags.into_boxed_slice(),
            parents: parents.into_boxed_slice(),
        };
        // Cedar's own checker decides conformance (required and unknown attributes,
        // types, parent types, enumerated ids), so the store accepts exactly what
        // Cedar would (an entity of a shape it accepted before is not asked again). The
        // blocklist attribute, which the store does not keep, is checked with a
        // placeholder.
        self.descriptions
            .check_stored(
                self.schema,
                &uid,
                &stored,
                blocklist_attr
                    .as_ref()
                    .map(|a| (a, claimed_block.unwrap_or(false))),
            )
            .map_err(named)?;
        Ok(Converted {
            uid,
            stored,
            claimed_block,
        })
    }

    /// One attribute value. `ty` is the schema's type for it, when known; without one
    /// only explicit JSON forms are read. Errors start with the path below the
    /// attribute (`[2].name: ...`) or with `: ` for the attribute itself.
    fn value(&self, json: &Json, ty: Option<&Type>, depth: usize) -> Result<Value, String> {
        if depth > MAX_VALUE_DEPTH {
            return Err(format!(": nested deeper than {MAX_VALUE_DEPTH} levels"));
        }
        let mismatch = |expected: &str| format!(": expected {expected}, found {}", kind(json));
        match (json, ty) {
            (Json::Bool(b), _) => Ok((*b).into()),
            (Json::Number(n), _) => match n.as_i64() {
                Some(i) => Ok(i.into()),
                None => Err(format!(": {n} is not a whole number that fits in 64 bits")),
            },
            (Json::String(s), Some(Type::ExtensionType { name })) => {
                let constructor = match name.to_string().as_str() {
                    "ipaddr" => "ip",
                    "decimal" => "decimal",
                    "datetime" => "datetime",
                    "duration" => "duration",
                    other => {
                        return Err(format!(": no implicit form for the extension type {other}"));
                    }
                };
                extension(constructor, s)
            }
            (Json::String(s), _) => Ok(intern::string(s).into()),
            (Json::Array(items), ty) => {
                let element = match ty {
                    Some(Type::Set { element_type }) => element_type.as_deref(),
                    Some(_) => return Err(mismatch("a set")),
                    None => None,
                };
                let values = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        self.value(v, element, depth + 1)
                            .map_err(|e| format!("[{i}]{e}"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Value::set(values, None))
            }
            (Json::Object(obj), ty) => {
                if let Some(inner) = obj.get("__entity") {
                    return parse_uid(inner)
                        .map(|u| Value::from(Literal::from(intern::uid(u))))
                        .map_err(|e| format!(": {e}"));
                }
                if let Some(inner) = obj.get("__extn") {
                    let (Some(f), Some(arg)) = (
                        inner.get("fn").and_then(Json::as_str),
                        inner.get("arg").and_then(Json::as_str),
                    ) else {
                        return Err(": __extn needs a string `fn` and a string `arg`".into());
                    };
                    return extension(f, arg);
                }
                match ty {
                    Some(Type::Entity(EntityKind::Entity(_) | EntityKind::AnyEntity)) => {
                        parse_uid(json)
                            .map(|u| Value::from(Literal::from(intern::uid(u))))
                            .map_err(|e| format!(": {e}"))
                    }
                    Some(Type::Record { attrs, .. }) => {
                        let mut pairs = BTreeMap::new();
                        for (k, v) in obj {
                            let t = attrs.get_attr(k).map(|a| a.attr_type.as_ref());
                            let value = self
                                .value(v, t, depth + 1)
                                .map_err(|e| format!(".{k}{e}"))?;
                            pairs.insert(SmolStr::new(k), value);
                        }
                        Ok(Value::record_arc(Arc::new(pairs), None))
                    }
                    Some(_) => Err(mismatch("a value of another type")),
                    None => {
                        let mut pairs = BTreeMap::new();
                        for (k, v) in obj {
                            let value = self
                                .value(v, None, depth + 1)
                                .map_err(|e| format!(".{k}{e}"))?;
                            pairs.insert(SmolStr::new(k), value);
                        }
                        Ok(Value::record_arc(Arc::new(pairs), None))
                    }
                }
            }
            (Json::Null, _) => Err(": null is not a Cedar value".into()),
        }
    }
}

/// An extension value: `fn(arg)`, evaluated by Cedar.
fn extension(function: &str, arg: &str) -> Result<Value, String> {
    let name = Name::parse_unqualified_name(function)
        .map_err(|_| format!(": {function:?} is not an extension function"))?;
    let expr = RestrictedExpr::call_extension_fn(name, [RestrictedExpr::val(arg)]);
    RestrictedEvaluator::new(Extensions::all_available())
        .interpret(expr.as_borrowed())
        .map_err(|e| format!(": {function}({arg:?}): {e}"))
}

/// Reads `{"type": .., "id": ..}`, `{"__entity": {..}}` or `"Type::\"id\""`.
pub(crate) fn parse_uid(json: &Json) -> Result<EntityUID, String> {
    match json {
        Json::String(s) => crate::request::EntityUid::from_str(s)
            .map(|u| u.0.as_ref().clone())
            .map_err(|_| format!("{} is not an entity reference", truncate(s))),
        Json::Object(o) => {
            let o = match o.get("__entity") {
                Some(Json::Object(inner)) => inner,
                _ => o,
            };
            match (o.get("type"), o.get("id")) {
                (Some(Json::String(t)), Some(Json::String(id))) => {
                    let ty = entity_type(t)
                        .ok_or_else(|| format!("{} is not an entity type", truncate(t)))?;
                    Ok(EntityUID::from_components(
                        ty,
                        ast::Eid::new(id.as_str()),
                        None,
                    ))
                }
                _ => Err("expected {\"type\": .., \"id\": ..}".into()),
            }
        }
        other => Err(format!(
            "expected an entity reference, found {}",
            kind(other)
        )),
    }
}

/// A parsed entity type name, cached (a deployment uses a few dozen).
pub(crate) fn entity_type(name: &str) -> Option<EntityType> {
    use std::sync::{PoisonError, RwLock};
    const MAX_CACHED: usize = 256;
    static CACHE: RwLock<Option<HashMap<String, EntityType>>> = RwLock::new(None);
    if let Some(t) = CACHE
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .and_then(|m| m.get(name))
    {
        return Some(t.clone());
    }
    let t = EntityType::from_normalized_str(name).ok()?;
    let mut cache = CACHE.write().unwrap_or_else(PoisonError::into_inner);
    let map = cache.get_or_insert_with(HashMap::new);
    if map.len() < MAX_CACHED {
        map.insert(name.to_owned(), t.clone());
    }
    Some(t)
}

fn kind(v: &Json) -> &'static str {
    crate::request::kind(v)
}

fn truncate(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{:?}...", s.get(..i).unwrap_or(s)),
        None => format!("{s:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn uid(t: &str, id: &str) -> EntityUID {
        EntityUID::from_components(entity_type(t).unwrap(), ast::Eid::new(id), None)
    }

    fn stored(parents: &[EntityUID]) -> Arc<Stored> {
        Arc::new(Stored {
            attrs: Box::new([]),
            tags: Box::new([]),
            parents: parents.iter().cloned().map(Arc::new).collect(),
        })
    }

    fn arcs(uids: &[EntityUID]) -> Vec<Arc<EntityUID>> {
        uids.iter().cloned().map(Arc::new).collect()
    }

    #[test]
    fn ancestors_follow_the_stored_hierarchy_and_cycles_are_seen() {
        let mut s = Store::default();
        s.insert(uid("Cluster", "c"), stored(&[]));
        s.insert(uid("Zone", "z"), stored(&[uid("Cluster", "c")]));
        s.insert(uid("Node", "n"), stored(&[uid("Zone", "z")]));
        let a = s.ancestors(&arcs(&[uid("Zone", "z")]), &HashMap::new());
        assert_eq!(a, HashSet::from([uid("Zone", "z"), uid("Cluster", "c")]));
        assert!(s.would_cycle(
            &uid("Cluster", "c"),
            &arcs(&[uid("Node", "n")]),
            &HashMap::new()
        ));
        assert!(!s.would_cycle(
            &uid("Node", "m"),
            &arcs(&[uid("Zone", "z")]),
            &HashMap::new()
        ));
    }

    #[test]
    fn the_change_log_names_what_changed_since_a_version_within_its_reach() {
        let mut s = Store::default();
        s.insert(uid("Node", "a"), stored(&[]));
        let then = s.version();
        assert_eq!(s.changed_since(then), Some(vec![]));
        let mut later = s.clone();
        later.insert(uid("Node", "b"), stored(&[]));
        assert!(later.remove(&uid("Node", "a")));
        assert!(!later.remove(&uid("Node", "never")));
        assert_eq!(
            later.changed_since(then),
            Some(vec![uid("Node", "b"), uid("Node", "a")])
        );
        // The older store cannot tell about a later version, nor another lineage.
        assert_eq!(s.changed_since(later.version()), None);
        assert_eq!(Store::default().changed_since(then), None);
        // Beyond the log's reach it says so rather than naming a part.
        for i in 0..2 * CHANGE_LOG_LEN {
            later.insert(uid("Node", &format!("n{i}")), stored(&[]));
        }
        assert_eq!(later.changed_since(then), None);
        // It reaches at least the last CHANGE_LOG_LEN changes, named in order.
        let back = later.changed_since(StoreVersion {
            lineage: later.lineage,
            version: later.version - CHANGE_LOG_LEN as u64,
        });
        let back = back.expect("the last CHANGE_LOG_LEN changes are logged");
        assert_eq!(back.len(), CHANGE_LOG_LEN);
        assert_eq!(
            back.last(),
            Some(&uid("Node", &format!("n{}", 2 * CHANGE_LOG_LEN - 1)))
        );
        let recent = later.version();
        later.insert(uid("Node", "last"), stored(&[]));
        assert_eq!(later.changed_since(recent), Some(vec![uid("Node", "last")]));
    }

    #[test]
    fn displays_as_compares_the_whole_text() {
        let ty = entity_type("k8s::Node").unwrap();
        assert!(displays_as(&ty, "k8s::Node"));
        assert!(!displays_as(&ty, "k8s::Nod"));
        assert!(!displays_as(&ty, "k8s::Node2"));
        assert!(!displays_as(&ty, "Node"));
        assert!(!displays_as(&ty, ""));
    }

    #[test]
    fn entities_of_a_type_are_a_range() {
        let mut s = Store::default();
        for id in ["b", "a", "c"] {
            s.insert(uid("Zone", id), stored(&[]));
        }
        s.insert(uid("Node", "a"), stored(&[]));
        s.insert(uid("ZoneX", "a"), stored(&[]));
        let zone = entity_type("Zone").unwrap();
        let ids: Vec<String> = s
            .of_type(&zone)
            .map(|(u, _)| u.eid().escaped().to_string())
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn uids_are_read_in_every_form() {
        for j in [
            json!({"type": "Node", "id": "n1"}),
            json!({"__entity": {"type": "Node", "id": "n1"}}),
            json!("Node::\"n1\""),
        ] {
            assert_eq!(parse_uid(&j).unwrap(), uid("Node", "n1"));
        }
        assert!(parse_uid(&json!({"type": "no such", "id": "x"})).is_err());
        assert!(parse_uid(&json!(3)).is_err());
    }

    #[test]
    fn json_round_trips_ids_that_need_escaping() {
        let u = uid("Node", "a \"b\" \\c");
        let j = uid_json(&u);
        assert_eq!(j["id"], "a \"b\" \\c");
        assert_eq!(parse_uid(&j).unwrap(), u);
    }
}
