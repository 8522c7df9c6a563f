//! The entities a plugin sees, in the contract's flattened form (`types.entities`),
//! cached per snapshot.
//!
//! Turning a Cedar entity into the contract's form is the dearest part of a plugin
//! call on the host side. A snapshot's entities never change, so each entity's batch
//! of one (and the list of entities it points to) is made once per snapshot, on first
//! use, and later calls append copies of it: text and plain numbers, no parsing. A new snapshot (an entity update,
//! a reload) comes with a new, empty cache, so nothing stale is ever served.
//!
//! Invariant: the cache holds at most one entry per stored entity and at most
//! `MAX_CACHED_TYPES` type names, so it stays bounded whatever uids and type names
//! callers and plugins ask for; `entities-of-type` hands out at most
//! [`MAX_ENTITIES_OF_TYPE`] entities and traps the call beyond that.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use cedar_policy_core::ast::EntityUID;
use serde_json::Value;
use smol_str::SmolStr;

use crate::block::BlockRecord;
use crate::store::{self, Store};

/// Most entities `entities-of-type` returns; a plugin that asks for more traps (a deny
/// naming the bound) rather than deciding on a partial list.
pub const MAX_ENTITIES_OF_TYPE: usize = 10_000;

use super::bindings::probity::plugin::types::{
    Attr, EntitiesParam, EntitiesResult, Parent, Span, Uid, Value as AttrValue,
};

/// Entities in the contract's flattened form (`types.entities`), built on the host:
/// all text in one string, spans into it, attributes and parents in one list each.
#[derive(Debug, Clone, Default)]
pub(crate) struct Batch {
    text: String,
    uids: Vec<Uid>,
    attrs: Vec<Attr>,
    parents: Vec<Parent>,
}

impl Batch {
    /// Appends `s` to the text. `None` once the text would outgrow the contract's u32
    /// offsets (a batch of 4 GiB: never in practice).
    fn span(&mut self, s: &str) -> Option<Span> {
        let offset = u32::try_from(self.text.len()).ok()?;
        let len = u32::try_from(s.len()).ok()?;
        offset.checked_add(len)?;
        self.text.push_str(s);
        Some(Span { offset, len })
    }

    fn uid(&mut self, type_name: &str, id: &str) -> Option<Uid> {
        Some(Uid {
            type_name: self.span(type_name)?,
            id: self.span(id)?,
        })
    }

    fn uid_json(&mut self, v: &Value) -> Option<Uid> {
        let v = v.get("__entity").unwrap_or(v);
        self.uid(v.get("type")?.as_str()?, v.get("id")?.as_str()?)
    }

    fn value(&mut self, v: &Value) -> Option<AttrValue> {
        Some(match v {
            Value::Bool(b) => AttrValue::Boolean(*b),
            Value::String(s) => AttrValue::String(self.span(s)?),
            Value::Number(n) => match n.as_i64() {
                Some(n) => AttrValue::Long(n),
                None => AttrValue::Json(self.span(&v.to_string())?),
            },
            Value::Object(o) if o.len() == 1 && o.contains_key("__entity") => {
                match self.uid_json(v) {
                    Some(u) => AttrValue::Entity(u),
                    None => AttrValue::Json(self.span(&v.to_string())?),
                }
            }
            _ => AttrValue::Json(self.span(&v.to_string())?),
        })
    }

    /// Adds one Cedar entity JSON object; `None` (and nothing usable added) if it has
    /// no uid or the batch is full.
    fn push_json(&mut self, json: &Value) -> Option<()> {
        let index = u32::try_from(self.uids.len()).ok()?;
        let uid = self.uid_json(json.get("uid")?)?;
        self.uids.push(uid);
        for (name, v) in json
            .get("attrs")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let name = self.span(name)?;
            let value = self.value(v)?;
            self.attrs.push(Attr {
                entity: index,
                name,
                value,
            });
        }
        for p in json
            .get("parents")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(uid) = self.uid_json(p) {
                self.parents.push(Parent { entity: index, uid });
            }
        }
        Some(())
    }

    /// Appends every entity of `other`, moving its spans and entity numbers.
    fn append(&mut self, other: &Batch) -> Option<()> {
        let base = u32::try_from(self.text.len()).ok()?;
        let first = u32::try_from(self.uids.len()).ok()?;
        u32::try_from(self.text.len() + other.text.len()).ok()?;
        u32::try_from(self.uids.len() + other.uids.len()).ok()?;
        let span = |s: Span| Span {
            offset: s.offset + base,
            len: s.len,
        };
        let uid = |u: Uid| Uid {
            type_name: span(u.type_name),
            id: span(u.id),
        };
        self.text.push_str(&other.text);
        self.uids.extend(other.uids.iter().map(|u| uid(*u)));
        self.attrs.extend(other.attrs.iter().map(|a| Attr {
            entity: a.entity + first,
            name: span(a.name),
            value: match a.value {
                AttrValue::String(s) => AttrValue::String(span(s)),
                AttrValue::Entity(u) => AttrValue::Entity(uid(u)),
                AttrValue::Json(s) => AttrValue::Json(span(s)),
                v @ (AttrValue::Boolean(_) | AttrValue::Long(_)) => v,
            },
        }));
        self.parents.extend(other.parents.iter().map(|p| Parent {
            entity: p.entity + first,
            uid: uid(p.uid),
        }));
        Some(())
    }

    /// Entity number `i`'s type and id ("" for a number out of range).
    fn uid_text(&self, i: usize) -> (&str, &str) {
        self.uids.get(i).map_or(("", ""), |u| {
            (self.text_of(u.type_name), self.text_of(u.id))
        })
    }

    /// Whether the batch holds the entity `type_name`, `id`.
    fn contains(&self, type_name: &str, id: &str) -> bool {
        (0..self.uids.len()).any(|i| self.uid_text(i) == (type_name, id))
    }

    /// The text a span points to ("" if it points outside).
    fn text_of(&self, s: Span) -> &str {
        let start = s.offset as usize;
        self.text
            .get(start..start.saturating_add(s.len as usize))
            .unwrap_or_default()
    }

    /// The batch lent to a call.
    pub fn param(&self) -> EntitiesParam<'_> {
        EntitiesParam {
            text: &self.text,
            uids: &self.uids,
            attrs: &self.attrs,
            parents: &self.parents,
        }
    }

    /// The batch returned from a host function.
    pub fn result(&self) -> EntitiesResult {
        EntitiesResult {
            text: self.text.clone(),
            uids: self.uids.clone(),
            attrs: self.attrs.clone(),
            parents: self.parents.clone(),
        }
    }
}

/// One stored entity as a batch of one, and the uids its attributes reference.
pub(crate) struct Cached {
    batch: Batch,
    refs: Vec<EntityUID>,
}

impl Cached {
    fn from_json(json: &Value) -> Option<Self> {
        let mut batch = Batch::default();
        batch.push_json(json)?;
        let refs = batch
            .attrs
            .iter()
            .filter_map(|a| match a.value {
                AttrValue::Entity(u) => {
                    let type_name = store::entity_type(batch.text_of(u.type_name))?;
                    Some(EntityUID::from_components(
                        type_name,
                        cedar_policy_core::ast::Eid::new(batch.text_of(u.id)),
                        None,
                    ))
                }
                _ => None,
            })
            .collect();
        Some(Self { batch, refs })
    }
}

/// Most entity type names one snapshot's cache remembers (a schema has a few dozen).
const MAX_CACHED_TYPES: usize = 256;

/// A snapshot's entities with their batch cache.
pub(crate) struct PluginEntities {
    store: Store,
    blocked: Arc<BTreeMap<String, BlockRecord>>,
    /// The blocklist's type and attribute, whose value the blocklist supplies.
    blocklist: Option<(String, SmolStr)>,
    by_uid: RwLock<HashMap<EntityUID, Arc<Cached>>>,
    by_type: RwLock<HashMap<String, Arc<Result<Batch, usize>>>>,
}

impl PluginEntities {
    /// An empty cache over `store`.
    pub fn new(
        store: Store,
        blocked: Arc<BTreeMap<String, BlockRecord>>,
        blocklist: Option<(String, SmolStr)>,
    ) -> Self {
        Self {
            store,
            blocked,
            blocklist,
            by_uid: RwLock::new(HashMap::new()),
            by_type: RwLock::new(HashMap::new()),
        }
    }

    fn json(&self, uid: &EntityUID, stored: &store::Stored) -> Value {
        let view = self.blocklist.as_ref().and_then(|(t, attr)| {
            (uid.entity_type().to_string() == *t).then(|| {
                let id: &str = uid.eid().as_ref();
                (attr, self.blocked.contains_key(id))
            })
        });
        store::to_json(uid, stored, view)
    }

    fn entity(&self, uid: &EntityUID) -> Option<Arc<Cached>> {
        if let Some(hit) = self
            .by_uid
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
        {
            return Some(Arc::clone(hit));
        }
        let made = self
            .store
            .get(uid)
            .map(|s| self.json(uid, s))
            .and_then(|json| Cached::from_json(&json))
            .map(Arc::new)?;
        // Only stored entities are cached: uids come from callers, and caching misses
        // would let them grow the cache without bound.
        self.by_uid
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uid.clone(), Arc::clone(&made));
        Some(made)
    }

    /// The stored entities of one type (none for an unknown type), or, when there are
    /// more than [`MAX_ENTITIES_OF_TYPE`], how many there are.
    pub fn of_type(&self, type_name: &str) -> Arc<Result<Batch, usize>> {
        if let Some(hit) = self
            .by_type
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(type_name)
        {
            return Arc::clone(hit);
        }
        let made = Arc::new(self.list_type(type_name));
        // Type names come from plugins, so the cache is bounded; an absent type is
        // cached too, since finding it absent costs a scan of the whole store.
        let mut by_type = self.by_type.write().unwrap_or_else(|p| p.into_inner());
        if by_type.len() < MAX_CACHED_TYPES {
            by_type.insert(type_name.to_owned(), Arc::clone(&made));
        }
        made
    }

    fn list_type(&self, type_name: &str) -> Result<Batch, usize> {
        let mut batch = Batch::default();
        let Some(ty) = store::entity_type(type_name) else {
            return Ok(batch);
        };
        let count = self
            .store
            .of_type(&ty)
            .take(MAX_ENTITIES_OF_TYPE + 1)
            .count();
        if count > MAX_ENTITIES_OF_TYPE {
            return Err(self.store.of_type(&ty).count());
        }
        for (uid, stored) in self.store.of_type(&ty) {
            let mut one = Batch::default();
            if one.push_json(&self.json(&uid, stored)).is_some() {
                batch.append(&one);
            }
        }
        Ok(batch)
    }

    /// The entities a request carries to a plugin, as one batch: the request-scoped
    /// `extra` ones, then the stored principal and resource and the entities their
    /// attributes point to, one level deep (a node's zone), each once.
    pub fn closure(&self, extra: &[Value], roots: [&EntityUID; 2]) -> Batch {
        let mut out = Batch::default();
        for json in extra {
            let mut one = Batch::default();
            if one.push_json(json).is_some() {
                out.append(&one);
            }
        }
        for root in roots {
            let Some(cached) = self.entity(root) else {
                continue;
            };
            let refs = cached.refs.iter().filter_map(|r| self.entity(r));
            for c in std::iter::once(Arc::clone(&cached)).chain(refs) {
                // A linear check: a closure holds a handful of entities. An entity
                // already there (request-scoped, or reached twice) keeps its place.
                let (type_name, id) = c.batch.uid_text(0);
                if !out.contains(type_name, id) {
                    out.append(&c.batch);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cache() -> PluginEntities {
        let items = json!([
            {"uid": {"type": "Node", "id": "n1"}, "parents": [{"type": "Zone", "id": "z1"}],
             "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z1"}}, "watts": 5,
                       "up": true, "rack": "r1", "tags": ["a"]}},
            {"uid": {"type": "Zone", "id": "z1"}, "attrs": {"ceiling": 10}, "parents": []},
            {"uid": {"type": "Zone", "id": "z2"}, "attrs": {"ceiling": 20}, "parents": []},
            {"uid": {"type": "Workload", "id": "w"}, "attrs": {}, "parents": []},
        ]);
        let schema = cedar_policy::Schema::from_cedarschema_str(
            "entity Zone = {ceiling: Long}; entity Node in [Zone] = {zone: Zone, watts: Long, up: Bool, rack: String, tags: Set<String>}; entity Workload;",
        )
        .unwrap()
        .0;
        let origins = crate::facts::FactOrigins::default();
        let descriptions = crate::conformance::TypeDescriptions::new(schema.as_ref());
        let converter = store::Converter::new(schema.as_ref(), &origins, &descriptions);
        let mut s = Store::default();
        for item in items.as_array().unwrap() {
            let c = converter.entity(item).map_err(|e| e.1).unwrap();
            s.insert(c.uid, Arc::new(c.stored));
        }
        PluginEntities::new(s, Arc::new(BTreeMap::new()), None)
    }

    fn cedar(t: &str, id: &str) -> EntityUID {
        EntityUID::from_components(
            store::entity_type(t).unwrap(),
            cedar_policy_core::ast::Eid::new(id),
            None,
        )
    }

    fn uid_text(b: &Batch, u: Uid) -> String {
        format!("{}/{}", b.text_of(u.type_name), b.text_of(u.id))
    }

    fn ids(b: &Batch) -> Vec<String> {
        b.uids.iter().map(|u| uid_text(b, *u)).collect()
    }

    /// Entity `i`'s attributes as "name=value" text, in order.
    fn attrs(b: &Batch, i: u32) -> Vec<String> {
        b.attrs
            .iter()
            .filter(|a| a.entity == i)
            .map(|a| {
                let v = match a.value {
                    AttrValue::Boolean(x) => format!("bool {x}"),
                    AttrValue::Long(n) => format!("long {n}"),
                    AttrValue::String(s) => format!("string {}", b.text_of(s)),
                    AttrValue::Entity(u) => format!("entity {}", uid_text(b, u)),
                    AttrValue::Json(s) => format!("json {}", b.text_of(s)),
                };
                format!("{}={v}", b.text_of(a.name))
            })
            .collect()
    }

    #[test]
    fn the_closure_follows_references_one_level_and_names_each_entity_once() {
        let cache = cache();
        let node = cedar("Node", "n1");
        let batch = cache.closure(&[], [&cedar("Workload", "w"), &node]);
        assert_eq!(ids(&batch), ["Workload/w", "Node/n1", "Zone/z1"]);
        // the same entity as principal and resource appears once
        assert_eq!(
            ids(&cache.closure(&[], [&node, &node])),
            ["Node/n1", "Zone/z1"]
        );
    }

    #[test]
    fn attribute_values_keep_their_types_and_spans_survive_appending() {
        let cache = cache();
        // the node is the second entity, so its spans and number were moved
        let batch = cache.closure(&[], [&cedar("Workload", "w"), &cedar("Node", "n1")]);
        let mut node = attrs(&batch, 1);
        node.sort();
        assert_eq!(
            node,
            [
                "rack=string r1",
                "tags=json [\"a\"]",
                "up=bool true",
                "watts=long 5",
                "zone=entity Zone/z1",
            ]
        );
        assert!(attrs(&batch, 0).is_empty());
        assert_eq!(attrs(&batch, 2), ["ceiling=long 10"]);
        let parents: Vec<_> = batch
            .parents
            .iter()
            .map(|p| (p.entity, uid_text(&batch, p.uid)))
            .collect();
        assert_eq!(parents, [(1, "Zone/z1".to_owned())]);
    }

    #[test]
    fn request_entities_come_first_and_shadow_stored_ones() {
        let cache = cache();
        let extra =
            [json!({"uid": {"type": "Zone", "id": "z1"}, "attrs": {"ceiling": 99}, "parents": []})];
        let batch = cache.closure(&extra, [&cedar("Node", "n1"), &cedar("Node", "gone")]);
        assert_eq!(ids(&batch), ["Zone/z1", "Node/n1"]);
        assert_eq!(attrs(&batch, 0), ["ceiling=long 99"]);
    }

    #[test]
    fn entities_of_a_type_are_listed_and_an_unknown_type_is_empty() {
        let cache = cache();
        let zones = cache.of_type("Zone");
        let zones = zones.as_ref().as_ref().unwrap();
        let mut listed = ids(zones);
        listed.sort();
        assert_eq!(listed, ["Zone/z1", "Zone/z2"]);
        let z2 = zones
            .uids
            .iter()
            .position(|u| zones.text_of(u.id) == "z2")
            .unwrap();
        assert_eq!(attrs(zones, z2 as u32), ["ceiling=long 20"]);
        assert!(
            cache
                .of_type("Nothing")
                .as_ref()
                .as_ref()
                .unwrap()
                .uids
                .is_empty()
        );
    }

    #[test]
    fn unknown_uids_are_not_cached_and_type_names_are_bounded() {
        let cache = cache();
        for i in 0..50 {
            let gone = cedar("Node", &format!("gone-{i}"));
            cache.closure(&[], [&gone, &cedar("Node", "n1")]);
        }
        // n1 and the zone it points to; none of the 50 misses
        assert_eq!(cache.by_uid.read().unwrap().len(), 2);
        for i in 0..MAX_CACHED_TYPES + 50 {
            assert!(
                cache
                    .of_type(&format!("Nothing{i}"))
                    .as_ref()
                    .as_ref()
                    .unwrap()
                    .uids
                    .is_empty()
            );
        }
        assert_eq!(cache.by_type.read().unwrap().len(), MAX_CACHED_TYPES);
    }

    #[test]
    fn a_request_entity_written_as_an_entity_reference_still_shadows_the_stored_one() {
        let cache = cache();
        let extra = [json!({"uid": {"__entity": {"type": "Node", "id": "n1"}},
                            "attrs": {"watts": 9}, "parents": []})];
        let batch = cache.closure(&extra, [&cedar("Node", "n1"), &cedar("Node", "n1")]);
        assert_eq!(ids(&batch), ["Node/n1", "Zone/z1"]);
        assert_eq!(attrs(&batch, 0), ["watts=long 9"]);
    }

    #[test]
    fn a_span_outside_the_text_reads_as_empty() {
        let b = Batch::default();
        assert_eq!(b.text_of(Span { offset: 7, len: 3 }), "");
        assert_eq!(
            b.text_of(Span {
                offset: u32::MAX,
                len: u32::MAX
            }),
            ""
        );
    }
}
