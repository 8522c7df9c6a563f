//! Cedar's entity conformance check, with each entity type's description built once
//! per policy set.
//!
//! Cedar's own `CoreSchema` builds a fresh description of an entity type for every
//! entity it checks: it clones the type's attribute map and walks every type of the
//! schema for the allowed parents. For a node agent's one-entity update that was half
//! the conversion's cost. [`TypeDescriptions`] asks Cedar's description once per type
//! and keeps the answers, so the checker (still Cedar's) sees exactly what it would
//! have seen, at the cost of a map lookup.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cedar_policy_core::ast::{Eid, Entity, EntityType, EntityUID, UnreservedId};
use cedar_policy_core::entities::conformance::EntitySchemaConformanceChecker;
use cedar_policy_core::entities::{EntityTypeDescription as _, Schema, SchemaType};
use cedar_policy_core::extensions::Extensions;
use cedar_policy_core::validator::{CoreSchema, EntityTypeDescription, ValidatorSchema};
use nonempty::NonEmpty;
use smol_str::SmolStr;

/// Every entity type's description, asked of Cedar once.
#[derive(Clone)]
pub(crate) struct TypeDescriptions {
    types: HashMap<EntityType, Described>,
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
}

impl TypeDescriptions {
    /// Describes every entity type `schema` declares.
    pub fn new(schema: &ValidatorSchema) -> Self {
        let mut types = HashMap::new();
        for declared in schema.entity_types() {
            let name = declared.name();
            let Some(cedar) = EntityTypeDescription::new(schema, name) else {
                continue;
            };
            let attrs = declared
                .attributes()
                .iter()
                .filter_map(|(attr, _)| Some((attr.clone(), cedar.attr_type(attr)?)))
                .collect();
            let facts = Facts {
                attrs,
                tags: cedar.tag_type(),
                required: cedar.required_attrs().collect(),
                parents: cedar.allowed_parent_types(),
                cedar,
            };
            types.insert(name.clone(), Described(Arc::new(facts)));
        }
        Self { types }
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
    "#;

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
