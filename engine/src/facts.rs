//! Where each fact comes from, as the schema declares it.
//!
//! A decision is only as good as its facts, and a caller must not be able to decide with
//! facts of its own making (DESIGN.md: "the store is the truth"). The schema marks what
//! the engine owns with `@owned("...")` annotations, and this module reads them once per
//! policy set, so the rules that keep callers out live next to the types they protect:
//!
//! | annotation | on | meaning |
//! | --- | --- | --- |
//! | `@owned("config")` | an entity type | built from `probity.toml` (`Settings`, `GpuModel`) |
//! | `@owned("api")` | an entity type | built from the server's caller configuration (`ApiCaller`, `ApiGroup`, `Api`) |
//! | `@owned("keyring")` | an entity type | the keyring's metadata of its keys (`Key`: creation time of the primary version, state), see [`crate::keys`] |
//! | `@owned("blocklist")` | a Bool attribute of an entity type | the blocklist's view of that entity; its type is the one the blocklist blocks (`Node`) |
//! | `@owned("cluster")` | an attribute of an entity type | the cluster manager's view of that entity (the controller reads it from the Kubernetes Node), see [`crate::Engine::replace_cluster_facts`] |
//! | `@owned("clock")` | a context attribute | the engine fills it with its clock (the decision time) |
//! | `@owned("reporter")` | a context attribute | only a caller authorized to report facts may supply it |
//! | `@owned("reporter")` | an action | only such a caller may ask it at all (its whole context is facts) |
//!
//! Nothing else is hard-wired: a schema without these annotations gives an engine that
//! owns nothing but what it is told.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use cedar_policy::SchemaFragment;
use serde_json::Value;
use smol_str::SmolStr;

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

/// The annotation that marks a fact the engine owns.
pub const OWNED_ANNOTATION: &str = "owned";

/// Who supplies the entities of an owned type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntityOwner {
    /// `probity.toml` (the `Settings` and `GpuModel` entities).
    Config,
    /// The server's caller configuration (`ApiCaller`, `ApiGroup`, `Api`).
    Api,
    /// The keyring's metadata (`Key`), published by [`crate::keys::PolicyKeys::publish`].
    Keyring,
    /// The cluster manager (the Kubernetes controller): it owns *attributes*, not
    /// entity types, and shares its entities with other sources; see
    /// [`crate::Engine::replace_cluster_facts`].
    Cluster,
}

impl EntityOwner {
    /// The annotation value.
    pub fn as_str(self) -> &'static str {
        match self {
            EntityOwner::Config => "config",
            EntityOwner::Api => "api",
            EntityOwner::Keyring => "keyring",
            EntityOwner::Cluster => "cluster",
        }
    }
}

/// How a context attribute the engine owns gets its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContextOwner {
    /// The engine's clock, in Unix seconds, unless a reporter supplies it.
    Clock,
    /// Only an authorized reporter supplies it.
    Reporter,
}

/// The owned facts of one action's context.
#[derive(Debug, Clone, Default)]
pub(crate) struct ActionFacts {
    /// Owned context attributes and who owns them.
    pub context: BTreeMap<SmolStr, ContextOwner>,
    /// Only a reporter may ask this action.
    pub reporter_only: bool,
}

impl ActionFacts {
    /// The attributes the clock fills.
    pub fn clock_attrs(&self) -> impl Iterator<Item = &SmolStr> {
        self.context
            .iter()
            .filter(|(_, o)| **o == ContextOwner::Clock)
            .map(|(a, _)| a)
    }
}

/// The blocklist's entity type and the attribute that shows a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlocklistTarget {
    /// The type of what is blocked, e.g. `Node`.
    pub entity_type: String,
    /// Its Bool attribute that the engine sets, e.g. `blocked`.
    pub attr: SmolStr,
}

/// Every fact the schema says the engine owns.
#[derive(Debug, Clone, Default)]
pub(crate) struct FactOrigins {
    /// Entity type (as written in Cedar, with its namespace) -> its owner.
    pub owned_types: HashMap<String, EntityOwner>,
    /// What the blocklist blocks, if the schema declares it.
    pub blocklist: Option<BlocklistTarget>,
    /// Action id (without `Action::`) -> its owned context.
    pub actions: HashMap<String, ActionFacts>,
    /// Entity type -> its attributes the cluster owns (`@owned("cluster")`). An entity
    /// of such a type is shared: the cluster supplies these attributes, other callers
    /// the rest.
    pub cluster_attrs: HashMap<String, BTreeSet<SmolStr>>,
}

impl FactOrigins {
    /// Reads the `@owned` annotations of `schema` (the text of `file`). Problems name
    /// the declaration they are on: the JSON form of a schema keeps no source spans.
    #[cfg(test)]
    pub fn read(file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        match schema_json(&file.text) {
            Some(json) => Self::from_json(&json, file),
            // The schema's own errors are reported by the compiler.
            None => Ok(Self::default()),
        }
    }

    /// From the JSON form of the schema (the text of `file`).
    pub fn from_json(json: &Value, file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        let mut problems = Vec::new();
        let mut out = Self::default();
        let problem = |what: String| SourceDiagnostic::new(&file.name, &file.text, 0, 0, what);
        for (namespace, body) in json.as_object().into_iter().flatten() {
            let qualify = |name: &str| {
                if namespace.is_empty() {
                    name.to_owned()
                } else {
                    format!("{namespace}::{name}")
                }
            };
            for (name, decl) in body
                .get("entityTypes")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
            {
                let entity_type = qualify(name);
                match owned(decl) {
                    None => {}
                    Some("config") => {
                        out.owned_types.insert(entity_type.clone(), EntityOwner::Config);
                    }
                    Some("api") => {
                        out.owned_types.insert(entity_type.clone(), EntityOwner::Api);
                    }
                    Some("keyring") => {
                        out.owned_types
                            .insert(entity_type.clone(), EntityOwner::Keyring);
                    }
                    Some("cluster") => problems.push(problem(format!(
                        "entity {entity_type}: @owned(\"cluster\") marks attributes, not entity types (the cluster shares its entities with other sources)"
                    ))),
                    Some(other) => problems.push(problem(format!(
                        "entity {entity_type}: @owned(\"{other}\") is not an owner of entities (config, api, keyring)"
                    ))),
                }
                let attrs = decl.pointer("/shape/attributes").and_then(Value::as_object);
                for (attr, attr_decl) in attrs.into_iter().flatten() {
                    match owned(attr_decl) {
                        None => {}
                        Some("blocklist") => {
                            let is_bool = attr_decl.get("name").and_then(Value::as_str)
                                == Some("Bool")
                                || attr_decl.get("type").and_then(Value::as_str) == Some("Boolean");
                            if !is_bool {
                                problems.push(problem(format!(
                                    "entity {entity_type}, attribute {attr}: @owned(\"blocklist\") needs a Bool attribute"
                                )));
                            } else if let Some(previous) = &out.blocklist {
                                problems.push(problem(format!(
                                    "entity {entity_type}, attribute {attr}: a second @owned(\"blocklist\") attribute (the first is {}.{})",
                                    previous.entity_type, previous.attr
                                )));
                            } else {
                                out.blocklist = Some(BlocklistTarget {
                                    entity_type: entity_type.clone(),
                                    attr: SmolStr::new(attr),
                                });
                            }
                        }
                        Some("cluster") => {
                            out.cluster_attrs
                                .entry(entity_type.clone())
                                .or_default()
                                .insert(SmolStr::new(attr));
                        }
                        Some(other) => problems.push(problem(format!(
                            "entity {entity_type}, attribute {attr}: @owned(\"{other}\") is not an owner of entity attributes (blocklist, cluster)"
                        ))),
                    }
                }
            }
            for (action, decl) in body
                .get("actions")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
            {
                let mut facts = ActionFacts::default();
                match owned(decl) {
                    None => {}
                    Some("reporter") => facts.reporter_only = true,
                    Some(other) => problems.push(problem(format!(
                        "action {action}: @owned(\"{other}\") is not an owner of actions (reporter)"
                    ))),
                }
                let attrs = decl
                    .pointer("/appliesTo/context/attributes")
                    .and_then(Value::as_object);
                for (attr, attr_decl) in attrs.into_iter().flatten() {
                    let owner = match owned(attr_decl) {
                        None => continue,
                        Some("clock") => ContextOwner::Clock,
                        Some("reporter") => ContextOwner::Reporter,
                        Some(other) => {
                            problems.push(problem(format!(
                                "action {action}, context attribute {attr}: @owned(\"{other}\") is not an owner of context attributes (clock, reporter)"
                            )));
                            continue;
                        }
                    };
                    if owner == ContextOwner::Clock
                        && attr_decl.get("name").and_then(Value::as_str) != Some("Long")
                        && attr_decl.get("type").and_then(Value::as_str) != Some("Long")
                    {
                        problems.push(problem(format!(
                            "action {action}, context attribute {attr}: @owned(\"clock\") needs a Long (Unix seconds)"
                        )));
                        continue;
                    }
                    facts.context.insert(SmolStr::new(attr), owner);
                }
                if facts.reporter_only || !facts.context.is_empty() {
                    out.actions.insert(action.clone(), facts);
                }
            }
        }
        if problems.is_empty() {
            Ok(out)
        } else {
            Err(problems)
        }
    }

    /// The owner of `entity_type`'s entities, if the engine owns them.
    pub fn owner_of(&self, entity_type: &str) -> Option<EntityOwner> {
        self.owned_types.get(entity_type).copied()
    }

    /// The attributes of `entity_type` the cluster owns, if any.
    pub fn cluster_attrs_of(&self, entity_type: &str) -> Option<&BTreeSet<SmolStr>> {
        self.cluster_attrs.get(entity_type)
    }

    /// The owned facts of `action` (its id, without `Action::`).
    pub fn action(&self, action: &str) -> Option<&ActionFacts> {
        self.actions.get(action)
    }

    /// The entity types each owner supplies, for documentation and status.
    pub fn owned_types_by_owner(&self) -> BTreeMap<EntityOwner, BTreeSet<String>> {
        let mut out: BTreeMap<EntityOwner, BTreeSet<String>> = BTreeMap::new();
        for (t, o) in &self.owned_types {
            out.entry(*o).or_default().insert(t.clone());
        }
        out
    }
}

/// The JSON form of a schema text, where annotations are easy to read; `None` if the
/// text is not a schema (the compiler reports why).
pub(crate) fn schema_json(text: &str) -> Option<Value> {
    SchemaFragment::from_cedarschema_str(text)
        .ok()
        .and_then(|(f, _)| f.to_json_value().ok())
}

fn owned(decl: &Value) -> Option<&str> {
    decl.get("annotations")?.get(OWNED_ANNOTATION)?.as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn read(text: &str) -> Result<FactOrigins, Vec<SourceDiagnostic>> {
        FactOrigins::read(&SourceFile {
            name: "s.cedarschema".into(),
            text: Arc::from(text),
            path: None,
        })
    }

    #[test]
    fn the_default_schema_declares_what_the_engine_owns() {
        let o = read(include_str!("../../policies/probity.cedarschema")).unwrap();
        assert_eq!(o.owner_of("Settings"), Some(EntityOwner::Config));
        assert_eq!(o.owner_of("GpuModel"), Some(EntityOwner::Config));
        assert_eq!(o.owner_of("ApiCaller"), Some(EntityOwner::Api));
        assert_eq!(o.owner_of("Node"), None);
        let cluster: Vec<&str> = o
            .cluster_attrs_of("Node")
            .unwrap()
            .iter()
            .map(SmolStr::as_str)
            .collect();
        assert_eq!(
            cluster,
            [
                "cpuAllocatableMillis",
                "gpuNode",
                "gpuProduct",
                "gpusAllocatable",
                "role",
                "zone"
            ]
        );
        assert_eq!(
            o.blocklist,
            Some(BlocklistTarget {
                entity_type: "Node".into(),
                attr: "blocked".into()
            })
        );
        let encrypt = o.action("encrypt").unwrap();
        assert_eq!(encrypt.context.get("now"), Some(&ContextOwner::Clock));
        assert!(!encrypt.reporter_only);
        assert!(o.action("elevate").unwrap().reporter_only);
        assert_eq!(
            o.action("read").unwrap().context.get("verified"),
            Some(&ContextOwner::Reporter)
        );
        assert!(o.action("schedule").is_none());
    }

    #[test]
    fn an_unknown_owner_is_refused_and_named() {
        let err = read("@owned(\"me\") entity A;").unwrap_err();
        assert!(
            err[0].message.contains("entity A: @owned(\"me\")"),
            "{}",
            err[0]
        );
        let err = read("@owned(\"cluster\") entity A;").unwrap_err();
        assert!(
            err[0]
                .message
                .contains("marks attributes, not entity types"),
            "{}",
            err[0]
        );
        let err = read("entity A = { @owned(\"blocklist\") b: Long };").unwrap_err();
        assert!(err[0].message.contains("needs a Bool"), "{}", err[0]);
        let err = read(
            "entity A; action a appliesTo { principal: A, resource: A, context: { @owned(\"clock\") t: String } };",
        )
        .unwrap_err();
        assert!(err[0].message.contains("needs a Long"), "{}", err[0]);
    }

    #[test]
    fn namespaced_types_are_qualified() {
        let o = read("namespace Acme { @owned(\"config\") entity Limits; }").unwrap();
        assert_eq!(o.owner_of("Acme::Limits"), Some(EntityOwner::Config));
    }
}
