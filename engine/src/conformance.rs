//! Cedar's entity conformance check, with each entity type's description built once
//! per policy set.
//!
//! Cedar's own `CoreSchema` builds a fresh description of an entity type for every
//! entity it checks: it clones the type's attribute map and walks every type of the
//! schema for the allowed parents. For a node agent's one-entity update that was half
//! the conversion's cost. [`TypeDescriptions`] asks Cedar's description once per type
//! and keeps the answers, so the checker (still Cedar's) sees exactly what it would
//! have seen, at the cost of a map lookup.
//!
//! Whether an entity conforms depends only on its *shape* (see [`Shape`]): its type,
//! which attributes it has and the kind of each value (and of its tags' values, and
//! of what sets and records hold), the types of the entities it references and of
//! its parents, and the ids of enumerated entities among them. Numbers and strings never matter. A node agent sends the same shape
//! with new numbers every time, so the shapes Cedar accepted are remembered (per
//! policy set, bounded), and an entity of a remembered shape is not checked again.
//! A refusal is never remembered: it always comes from Cedar's checker, with its
//! message.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use cedar_policy_core::ast::{
    Eid, Entity, EntityType, EntityUID, Literal, UnreservedId, Value, ValueKind,
};
use cedar_policy_core::entities::conformance::EntitySchemaConformanceChecker;
use cedar_policy_core::entities::{EntityTypeDescription as _, Schema, SchemaType};
use cedar_policy_core::extensions::Extensions;
use cedar_policy_core::validator::{CoreSchema, EntityTypeDescription, ValidatorSchema};
use nonempty::NonEmpty;
use smol_str::SmolStr;

use crate::store::{Stored, materialize};

/// Most shapes remembered as conforming, per policy set; past it the memory starts
/// afresh (the shapes in use come back at the next entity of each).
const MAX_SHAPES: usize = 4_096;

/// The longest shape remembered, in bytes: a larger entity (a long set) is checked
/// every time rather than held in memory.
const MAX_SHAPE_BYTES: usize = 1_024;

/// Deepest nesting of sets and records a shape follows (the store's own bound).
const MAX_SHAPE_DEPTH: usize = 32;

/// Every entity type's description, asked of Cedar once, and the entity shapes that
/// Cedar's check accepted against them.
#[derive(Clone)]
pub(crate) struct TypeDescriptions {
    types: HashMap<EntityType, Described>,
    /// Shapes (see [`Shape`]) of entities that conformed. Shared by clones: they
    /// describe the same schema.
    conforming: Arc<Mutex<HashSet<Box<[u8]>>>>,
}

/// One entity type's description: Cedar's, with the answers it would compute per
/// call already computed.
#[derive(Clone)]
pub(crate) struct Described(Arc<Facts>);

struct Facts {
    cedar: EntityTypeDescription,
    attrs: HashMap<SmolStr, SchemaType>,
    tags: Option<SchemaType>,
    required: Box<[SmolStr]>,
    parents: Arc<HashSet<EntityType>>,
    /// The type's number in a shape.
    index: u32,
    /// Whether the type is enumerated: then an entity's id matters to conformance.
    enumerated: bool,
}

impl TypeDescriptions {
    /// Describes every entity type `schema` declares.
    #[cfg(test)]
    pub fn new(schema: &ValidatorSchema) -> Self {
        Self::with_partial(schema, &HashSet::new())
    }

    /// Like [`TypeDescriptions::new`], but an entity of a type in `partial` (named as
    /// in Cedar) may lack any attribute: such a type's entities are shared by sources
    /// that each supply part of them (the cluster's attributes and the agent's), so the
    /// store holds what it has and a rule that reads a missing one fails closed.
    pub fn with_partial(schema: &ValidatorSchema, partial: &HashSet<String>) -> Self {
        let mut types = HashMap::new();
        for declared in schema.entity_types() {
            let name = declared.name();
            let Some(cedar) = EntityTypeDescription::new(schema, name) else {
                continue;
            };
            let Ok(index) = u32::try_from(types.len()) else {
                break;
            };
            let attrs = declared
                .attributes()
                .iter()
                .filter_map(|(attr, _)| Some((attr.clone(), cedar.attr_type(attr)?)))
                .collect();
            let facts = Facts {
                attrs,
                tags: cedar.tag_type(),
                required: if partial.contains(&name.to_string()) {
                    Box::default()
                } else {
                    cedar.required_attrs().collect()
                },
                parents: cedar.allowed_parent_types(),
                index,
                enumerated: cedar.enum_entity_eids().is_some(),
                cedar,
            };
            types.insert(name.clone(), Described(Arc::new(facts)));
        }
        Self {
            types,
            conforming: Arc::default(),
        }
    }

    /// Whether a stored entity conforms, as Cedar's check of its materialized form
    /// (direct parents, and the blocklist attribute with its value when given) would
    /// say: at once when an entity of the same shape conformed before, else by
    /// Cedar's check, whose acceptance is then remembered.
    pub fn check_stored(
        &self,
        schema: &ValidatorSchema,
        uid: &EntityUID,
        stored: &Stored,
        blocklist: Option<(&SmolStr, bool)>,
    ) -> Result<(), String> {
        let shape = Shape::of(self, uid, stored, blocklist.map(|(attr, _)| attr));
        if let Some(shape) = &shape
            && self.remembered().contains(shape.as_slice())
        {
            return Ok(());
        }
        let probe = materialize(
            uid,
            stored,
            stored.parents.iter().map(|p| (**p).clone()).collect(),
            blocklist,
        );
        self.check(schema, &probe)?;
        if let Some(shape) = shape {
            let mut remembered = self.remembered();
            if remembered.len() >= MAX_SHAPES {
                remembered.clear();
            }
            remembered.insert(shape.into_boxed_slice());
        }
        Ok(())
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashSet<Box<[u8]>>> {
        self.conforming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Cedar's conformance check of `entity` against `schema` (which these
    /// descriptions were made from); an error is Cedar's message.
    pub fn check(&self, schema: &ValidatorSchema, entity: &Entity) -> Result<(), String> {
        let described = DescribedSchema {
            core: CoreSchema::new(schema),
            types: self,
        };
        EntitySchemaConformanceChecker::new(&described, Extensions::all_available())
            .validate_entity(entity)
            .map_err(|e| e.to_string())
    }
}

/// The bytes of an entity that Cedar's conformance check reads, and nothing more, so
/// that two entities with the same shape get the same answer under one schema:
///
/// * its type, and its id if the type is enumerated (`validate_euid`);
/// * each attribute's name and its value's shape, and the blocklist attribute's name
///   (its value is always a boolean): required and unexpected attributes, and each
///   value's type;
/// * each tag value's shape (tag names are not checked);
/// * each parent's type, and its id if enumerated (allowed parent types,
///   `validate_euid`).
///
/// A value's shape is its kind (boolean, long, string, extension type), and for an
/// entity reference its type and, if enumerated, its id; sets and records list their
/// elements' shapes (records with their keys). An entity of an undeclared type,
/// referencing one, or naming an action has no shape and is always checked.
struct Shape<'a> {
    types: &'a TypeDescriptions,
    bytes: Vec<u8>,
}

impl<'a> Shape<'a> {
    fn of(
        types: &'a TypeDescriptions,
        uid: &EntityUID,
        stored: &Stored,
        blocklist: Option<&SmolStr>,
    ) -> Option<Vec<u8>> {
        let mut shape = Shape {
            types,
            bytes: Vec::with_capacity(128),
        };
        shape.entity(uid)?;
        match blocklist {
            Some(attr) => {
                shape.bytes.push(b'B');
                shape.text(attr)?;
            }
            None => shape.bytes.push(b'-'),
        }
        shape.count(stored.attrs.len())?;
        for (id, value) in &stored.attrs {
            shape.bytes.extend(id.index().to_le_bytes());
            shape.value(value, 0)?;
        }
        shape.count(stored.tags.len())?;
        for (_, value) in &stored.tags {
            shape.value(value, 0)?;
        }
        shape.count(stored.parents.len())?;
        for parent in &stored.parents {
            shape.entity(parent)?;
        }
        (shape.bytes.len() <= MAX_SHAPE_BYTES).then_some(shape.bytes)
    }

    fn entity(&mut self, uid: &EntityUID) -> Option<()> {
        let ty = uid.entity_type();
        if ty.is_action() {
            return None;
        }
        let facts = &self.types.types.get(ty)?.0;
        self.bytes.extend(facts.index.to_le_bytes());
        if facts.enumerated {
            self.text(uid.eid().as_ref())?;
        }
        Some(())
    }

    fn value(&mut self, value: &Value, depth: usize) -> Option<()> {
        if depth > MAX_SHAPE_DEPTH || self.bytes.len() > MAX_SHAPE_BYTES {
            return None;
        }
        match &value.value {
            ValueKind::Lit(Literal::Bool(_)) => self.bytes.push(b'b'),
            ValueKind::Lit(Literal::Long(_)) => self.bytes.push(b'l'),
            ValueKind::Lit(Literal::String(_)) => self.bytes.push(b's'),
            ValueKind::Lit(Literal::EntityUID(uid)) => {
                self.bytes.push(b'e');
                self.entity(uid)?;
            }
            ValueKind::Set(set) => {
                self.bytes.push(b'S');
                self.count(set.len())?;
                for element in set.iter() {
                    self.value(element, depth + 1)?;
                }
            }
            ValueKind::Record(record) => {
                self.bytes.push(b'R');
                self.count(record.len())?;
                for (key, element) in record.iter() {
                    self.text(key)?;
                    self.value(element, depth + 1)?;
                }
            }
            ValueKind::ExtensionValue(extension) => {
                self.bytes.push(b'x');
                self.text(&extension.typename().to_string())?;
            }
        }
        Some(())
    }

    /// A length, so that concatenated parts cannot be read two ways.
    fn count(&mut self, n: usize) -> Option<()> {
        self.bytes.extend(u32::try_from(n).ok()?.to_le_bytes());
        Some(())
    }

    /// A text with its length; none when the shape would grow past what is
    /// remembered (an entity with a long id is checked rather than copied).
    fn text(&mut self, text: &str) -> Option<()> {
        if self.bytes.len() + text.len() > MAX_SHAPE_BYTES {
            return None;
        }
        self.bytes
            .extend(u32::try_from(text.len()).ok()?.to_le_bytes());
        self.bytes.extend_from_slice(text.as_bytes());
        Some(())
    }
}

/// Cedar's schema view, with entity types answered from [`TypeDescriptions`].
struct DescribedSchema<'a> {
    core: CoreSchema<'a>,
    types: &'a TypeDescriptions,
}

impl<'a> Schema for DescribedSchema<'a> {
    type EntityTypeDescription = Described;
    type ActionEntityIterator = <CoreSchema<'a> as Schema>::ActionEntityIterator;

    fn entity_type(&self, entity_type: &EntityType) -> Option<Described> {
        self.types.types.get(entity_type).cloned()
    }

    fn action(&self, action: &EntityUID) -> Option<Arc<Entity>> {
        self.core.action(action)
    }

    fn entity_types_with_basename<'b>(
        &'b self,
        basename: &'b UnreservedId,
    ) -> Box<dyn Iterator<Item = EntityType> + 'b> {
        self.core.entity_types_with_basename(basename)
    }

    fn action_entities(&self) -> Self::ActionEntityIterator {
        self.core.action_entities()
    }
}

impl cedar_policy_core::entities::EntityTypeDescription for Described {
    fn entity_type(&self) -> EntityType {
        self.0.cedar.entity_type()
    }

    fn attr_type(&self, attr: &str) -> Option<SchemaType> {
        self.0.attrs.get(attr).cloned()
    }

    fn tag_type(&self) -> Option<SchemaType> {
        self.0.tags.clone()
    }

    fn required_attrs<'s>(&'s self) -> Box<dyn Iterator<Item = SmolStr> + 's> {
        Box::new(self.0.required.iter().cloned())
    }

    fn allowed_parent_types(&self) -> Arc<HashSet<EntityType>> {
        Arc::clone(&self.0.parents)
    }

    fn open_attributes(&self) -> bool {
        self.0.cedar.open_attributes()
    }

    fn enum_entity_eids(&self) -> Option<&NonEmpty<Eid>> {
        self.0.cedar.enum_entity_eids()
    }

    fn is_external(&self) -> bool {
        self.0.cedar.is_external()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use serde_json::json;

    const SCHEMA: &str = r#"
        entity Zone;
        entity Rack in [Zone];
        entity Color enum ["red", "blue"];
        entity Node in [Rack] = {
            zone: Zone,
            temp: Long,
            "label"?: String,
            tags: Set<String>,
            limits: { watts: Long, "soft"?: Bool },
        } tags Long;
        entity Loose = { n: Long };
        entity Pixel in [Color] = {
            "shade"?: Color,
            "hues"?: Set<Color>,
            "ip"?: ipaddr,
            "spec"?: { "name": String, "on"?: Bool },
        };
    "#;

    fn schema() -> cedar_policy::Schema {
        cedar_policy::Schema::from_cedarschema_str(SCHEMA)
            .unwrap()
            .0
    }

    /// What the store's converter says of `json` with `described`: `Ok` or the
    /// message.
    fn converted(
        schema: &ValidatorSchema,
        described: &TypeDescriptions,
        json: &serde_json::Value,
    ) -> Result<(), String> {
        let origins = crate::facts::FactOrigins::default();
        crate::store::Converter::new(schema, &origins, described)
            .entity(json)
            .map(|_| ())
            .map_err(|(_, e)| e)
    }

    #[test]
    fn an_enumerated_id_is_part_of_the_shape_so_a_remembered_one_vouches_for_no_other() {
        let schema = schema();
        let schema: &ValidatorSchema = schema.as_ref();
        let described = TypeDescriptions::new(schema);
        let pixel = |shade: &str, parent: &str| {
            json!({"uid": {"type": "Pixel", "id": "p"},
                   "attrs": {"shade": {"__entity": {"type": "Color", "id": shade}}},
                   "parents": [{"type": "Color", "id": parent}]})
        };
        let color =
            |id: &str| json!({"uid": {"type": "Color", "id": id}, "attrs": {}, "parents": []});
        for _ in 0..2 {
            assert_eq!(converted(schema, &described, &pixel("red", "blue")), Ok(()));
            assert_eq!(converted(schema, &described, &color("red")), Ok(()));
        }
        for bad in [
            pixel("green", "blue"),
            pixel("red", "green"),
            color("green"),
        ] {
            let err = converted(schema, &described, &bad).unwrap_err();
            assert!(err.contains("green"), "{bad}: {err}");
            assert_eq!(
                Err(err),
                converted(schema, &TypeDescriptions::new(schema), &bad)
            );
        }
    }

    #[test]
    fn a_remembered_shape_vouches_for_no_other_element_reference_or_extension_type() {
        let schema = schema();
        let schema: &ValidatorSchema = schema.as_ref();
        let described = TypeDescriptions::new(schema);
        let pixel = |attrs: serde_json::Value| json!({"uid": {"type": "Pixel", "id": "p"}, "attrs": attrs, "parents": []});
        let node = |tags: serde_json::Value| {
            json!({"uid": {"type": "Node", "id": "n"}, "parents": [],
                   "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z"}}, "temp": 1,
                             "tags": tags, "limits": {"watts": 3}}})
        };
        let red = json!({"__entity": {"type": "Color", "id": "red"}});
        let zone = json!({"__entity": {"type": "Zone", "id": "z"}});
        let pairs = [
            (
                pixel(json!({"hues": [red]})),
                pixel(json!({"hues": [zone]})),
            ),
            (node(json!(["a"])), node(json!([1]))),
            (pixel(json!({"shade": red})), pixel(json!({"shade": zone}))),
            (
                pixel(json!({"ip": {"__extn": {"fn": "ip", "arg": "10.0.0.1"}}})),
                pixel(json!({"ip": {"__extn": {"fn": "decimal", "arg": "1.5"}}})),
            ),
            (
                pixel(json!({"spec": {"name": "s", "on": true}})),
                pixel(json!({"spec": {"name": "s", "zz": true}})),
            ),
        ];
        for (good, bad) in pairs {
            assert_eq!(converted(schema, &described, &good), Ok(()), "{good}");
            let err = converted(schema, &described, &bad).unwrap_err();
            assert_eq!(
                Err(err),
                converted(schema, &TypeDescriptions::new(schema), &bad),
                "{bad}"
            );
        }
    }

    #[test]
    fn an_empty_set_does_not_vouch_for_a_full_one() {
        let schema = schema();
        let schema: &ValidatorSchema = schema.as_ref();
        let described = TypeDescriptions::new(schema);
        let pixel = |hues: serde_json::Value| json!({"uid": {"type": "Pixel", "id": "p"}, "attrs": {"hues": hues}, "parents": []});
        assert_eq!(converted(schema, &described, &pixel(json!([]))), Ok(()));
        let wrong = pixel(json!([{"__entity": {"type": "Zone", "id": "z"}}]));
        let err = converted(schema, &described, &wrong).unwrap_err();
        assert_eq!(
            Err(err),
            converted(schema, &TypeDescriptions::new(schema), &wrong)
        );
    }

    /// Attributes by name, in a test case.
    type Attrs = Vec<(&'static str, serde_json::Value)>;

    /// xorshift: enough randomness for test cases, and the same cases every run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, m: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % m.max(1)
        }

        fn pick(&mut self, options: &[serde_json::Value]) -> serde_json::Value {
            let i = self.below(options.len() as u64) as usize;
            options.get(i).cloned().unwrap_or_default()
        }
    }

    /// Random entities, valid and not: the converter with the shapes it remembered
    /// answers each exactly as a converter that remembers nothing.
    #[test]
    fn remembered_shapes_never_change_an_answer_on_random_entities() {
        let schema = schema();
        let schema: &ValidatorSchema = schema.as_ref();
        let warm = TypeDescriptions::new(schema);
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let colors = [json!("red"), json!("blue"), json!("green")];
        let (mut accepted, mut refused) = (0, 0);
        for _ in 0..3_000 {
            let color = rng.pick(&colors);
            let other = rng.pick(&[
                json!("a"),
                json!(1),
                json!({"__entity": {"type": "Color", "id": color}}),
            ]);
            let entity_ref =
                |ty: &str, id: serde_json::Value| json!({"__entity": {"type": ty, "id": id}});
            let scalar = rng.pick(&[
                json!(7),
                json!("seven"),
                json!(true),
                entity_ref("Zone", json!("z")),
                entity_ref("Rack", json!("r")),
                entity_ref("Color", color.clone()),
                json!({"__extn": {"fn": "ip", "arg": "10.0.0.1"}}),
                json!({"__extn": {"fn": "decimal", "arg": "1.5"}}),
            ]);
            let value = rng.pick(&[
                scalar.clone(),
                json!([]),
                json!([scalar.clone()]),
                json!([scalar.clone(), other]),
                json!({"watts": scalar.clone()}),
                json!({"watts": 5, "soft": scalar.clone()}),
                json!({"name": "n", "on": scalar.clone()}),
                json!({"name": scalar.clone(), "extra": 1}),
            ]);
            let ty = rng.pick(&[
                json!("Node"),
                json!("Pixel"),
                json!("Color"),
                json!("Loose"),
                json!("Zone"),
                json!("Rack"),
            ]);
            // The type's attributes (required, then optional) and parent, fitting.
            let (required, optional, parent): (Attrs, Attrs, serde_json::Value) =
                match ty.as_str().unwrap_or_default() {
                    "Node" => (
                        vec![
                            ("zone", entity_ref("Zone", json!("z"))),
                            ("temp", json!(rng.below(100))),
                            ("tags", json!(["a"])),
                            ("limits", json!({"watts": 3})),
                        ],
                        vec![("label", json!("l"))],
                        json!({"type": "Rack", "id": "r"}),
                    ),
                    "Pixel" => (
                        vec![],
                        vec![
                            ("shade", entity_ref("Color", color.clone())),
                            ("hues", json!([entity_ref("Color", color.clone())])),
                            ("ip", json!({"__extn": {"fn": "ip", "arg": "10.0.0.1"}})),
                            ("spec", json!({"name": "s"})),
                        ],
                        json!({"type": "Color", "id": color.clone()}),
                    ),
                    "Loose" => (vec![("n", json!(rng.below(9)))], vec![], json!(null)),
                    "Rack" => (vec![], vec![], json!({"type": "Zone", "id": "z"})),
                    _ => (vec![], vec![], json!(null)),
                };
            let mut attrs = serde_json::Map::new();
            for (name, v) in required {
                attrs.insert(name.into(), v);
            }
            for (name, v) in optional {
                if rng.below(2) == 0 {
                    attrs.insert(name.into(), v);
                }
            }
            // Most entities fit; the rest lose, gain or change one attribute.
            let names = [
                "zone", "temp", "label", "tags", "limits", "n", "shade", "hues", "ip", "spec",
                "extra",
            ];
            let name = names
                .get(rng.below(names.len() as u64) as usize)
                .copied()
                .unwrap_or("n");
            match rng.below(6) {
                0 => {
                    attrs.remove(name);
                }
                1 => {
                    attrs.insert(name.into(), value.clone());
                }
                _ => {}
            }
            let id = if ty == "Color" {
                color.clone()
            } else {
                json!(format!("e{}", rng.below(3)))
            };
            let mut parents = Vec::new();
            if !parent.is_null() && rng.below(3) != 0 {
                parents.push(parent);
            }
            if rng.below(4) == 0 {
                parents.push(rng.pick(&[
                    json!({"type": "Rack", "id": "r"}),
                    json!({"type": "Zone", "id": "z"}),
                    json!({"type": "Color", "id": color.clone()}),
                    json!({"type": "Nope", "id": "n"}),
                ]));
            }
            let mut entity =
                json!({"uid": {"type": ty, "id": id}, "attrs": attrs, "parents": parents});
            if rng.below(4) == 0 {
                entity["tags"] = json!({"t": rng.pick(&[json!(1), json!("one")])});
            }
            let theirs = converted(schema, &TypeDescriptions::new(schema), &entity);
            assert_eq!(converted(schema, &warm, &entity), theirs, "for {entity}");
            if theirs.is_ok() {
                accepted += 1;
            } else {
                refused += 1;
            }
        }
        let shapes = warm.remembered().len();
        // Both answers are exercised, and most accepted entities were answered from a
        // remembered shape.
        assert!(
            refused > 300 && accepted > 300,
            "{accepted} accepted, {refused} refused"
        );
        assert!(
            shapes > 10 && accepted > 3 * shapes,
            "{accepted} accepted, {shapes} shapes"
        );
    }

    /// What Cedar's own checker says of `entity`: `Ok` or its message.
    fn cedar_says(schema: &ValidatorSchema, entity: &Entity) -> Result<(), String> {
        let core = CoreSchema::new(schema);
        EntitySchemaConformanceChecker::new(&core, Extensions::all_available())
            .validate_entity(entity)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_described_check_agrees_with_cedars_own_on_every_kind_of_entity() {
        let schema = cedar_policy::Schema::from_cedarschema_str(SCHEMA)
            .unwrap()
            .0;
        let schema: &ValidatorSchema = schema.as_ref();
        let described = TypeDescriptions::new(schema);
        let node = |attrs: serde_json::Value, parents: serde_json::Value, tags| json!({"uid": {"type": "Node", "id": "n"}, "attrs": attrs, "parents": parents, "tags": tags});
        let good = json!({"zone": {"__entity": {"type": "Zone", "id": "z"}}, "temp": 40,
                          "tags": ["a"], "limits": {"watts": 10}});
        let rack = json!([{"type": "Rack", "id": "r"}]);
        let mut cases = vec![
            node(good.clone(), rack.clone(), json!({"x": 1})),
            node(good.clone(), json!([]), json!({})),
            // An ancestor's type as a parent (allowed: Cedar checks ancestor types),
            // a type that is no ancestor's, and an undeclared one.
            node(
                good.clone(),
                json!([{"type": "Zone", "id": "z"}]),
                json!({}),
            ),
            node(
                good.clone(),
                json!([{"type": "Color", "id": "red"}]),
                json!({}),
            ),
            node(
                good.clone(),
                json!([{"type": "Nope", "id": "z"}]),
                json!({}),
            ),
            // A tag of the wrong type.
            node(good.clone(), rack.clone(), json!({"x": "hot"})),
            // Attributes: missing, unexpected, of the wrong type, a record's.
            node(json!({"temp": 40}), rack.clone(), json!({})),
            node(
                json!({"zone": {"__entity": {"type": "Zone", "id": "z"}}, "temp": 40,
                       "tags": [], "limits": {"watts": 1}, "extra": 1}),
                rack.clone(),
                json!({}),
            ),
            node(
                json!({"zone": {"__entity": {"type": "Zone", "id": "z"}}, "temp": "40",
                       "tags": [], "limits": {"watts": 1}}),
                rack.clone(),
                json!({}),
            ),
            node(
                json!({"zone": {"__entity": {"type": "Zone", "id": "z"}}, "temp": 40,
                       "tags": [], "limits": {"watts": 1, "soft": 3}}),
                rack.clone(),
                json!({}),
            ),
            node(
                json!({"zone": {"__entity": {"type": "Rack", "id": "z"}}, "temp": 40,
                       "tags": [], "limits": {"watts": 1}, "label": "x"}),
                rack.clone(),
                json!({}),
            ),
        ];
        cases.extend([
            json!({"uid": {"type": "Color", "id": "red"}, "attrs": {}, "parents": []}),
            json!({"uid": {"type": "Color", "id": "green"}, "attrs": {}, "parents": []}),
            json!({"uid": {"type": "Loose", "id": "l"}, "attrs": {"n": 1}, "parents": []}),
            json!({"uid": {"type": "Undeclared", "id": "u"}, "attrs": {}, "parents": []}),
        ]);
        let mut refused = 0;
        for case in &cases {
            let entity = cedar_policy::Entity::from_json_value(case.clone(), None).unwrap();
            let entity: &Entity = entity.as_ref();
            let theirs = cedar_says(schema, entity);
            let ours = described.check(schema, entity);
            assert_eq!(ours, theirs, "for {case}");
            refused += usize::from(theirs.is_err());
        }
        // The cases exercise both answers.
        assert_eq!(refused, 10, "{} cases", cases.len());
    }
}
