//! Write Probity policy plugins in plain Rust.
//!
//! A plugin is a type that implements [`Plugin`]: [`Plugin::describe`] says what it is
//! and which actions it applies to, [`Plugin::evaluate`] turns a typed [`Request`]
//! into a [`Verdict`]. [`export_plugin!`] wires it to the WIT contract
//! (`plugins/wit/plugin.wit`, package `probity:plugin@0.2.0`); the generated bindings
//! stay inside this crate.
//!
//! The logic never touches the bindings, so it is tested natively with `cargo test`,
//! with a [`MockHost`] standing in for the engine:
//!
//! ```
//! use probity_plugin_sdk::{Description, Host, MockHost, Plugin, Reason, Request, Severity, Verdict};
//!
//! struct NoRoot;
//! impl Plugin for NoRoot {
//!     fn describe() -> Description {
//!         Description::new("no-root", "0.1.0", ["schedule"])
//!     }
//!     fn evaluate(request: &Request, _host: &dyn Host) -> Verdict {
//!         if request.principal == r#"Workload::"root""# {
//!             Verdict::deny(Reason::new("root", "root may not run", Severity::High))
//!         } else {
//!             Verdict::Abstain
//!         }
//!     }
//! }
//!
//! let request = Request::new(r#"Workload::"root""#, "schedule", r#"Node::"n1""#);
//! assert!(NoRoot::evaluate(&request, &MockHost::default()).is_deny());
//! ```

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Map, Value};

mod arena;
mod wasm;

#[doc(hidden)]
pub mod __private {
    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    pub use crate::arena::CallArena;
    pub use crate::wasm::{bindings, describe, evaluate};
}

/// A Probity policy plugin.
pub trait Plugin {
    /// Name, version and the actions the plugin applies to; read once at load.
    fn describe() -> Description;

    /// Decides one request. Must be total: return [`Verdict::Abstain`] rather than
    /// panic when the request is not for this plugin (a panic is a trap, which the
    /// engine turns into a deny naming the plugin).
    fn evaluate(request: &Request, host: &dyn Host) -> Verdict;
}

/// What the engine offers a plugin during a call.
pub trait Host {
    /// Writes a line to the engine's log, tagged with the plugin's name.
    fn log(&self, level: Level, message: &str);
    /// Wall-clock time in milliseconds since the Unix epoch (fixed for one call).
    fn now_ms(&self) -> u64;
    /// The stored entities of one Cedar type (e.g. `Zone`), read-only.
    fn entities_of_type(&self, type_name: &str) -> Vec<Entity>;
}

/// Log levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Debug.
    Debug,
    /// Info.
    Info,
    /// Warning.
    Warn,
    /// Error.
    Error,
}

/// A [`Host`] for native tests: a fixed clock, fixed entities, and the log kept.
#[derive(Debug, Default)]
pub struct MockHost {
    /// What [`Host::now_ms`] returns.
    pub now_ms: u64,
    /// What [`Host::entities_of_type`] searches.
    pub entities: Vec<Entity>,
    /// Lines logged so far.
    pub log: std::cell::RefCell<Vec<(Level, String)>>,
}

impl MockHost {
    /// A mock host holding `entities` (Cedar entity JSON objects).
    pub fn with_entities(entities: &Value) -> Self {
        Self {
            entities: Entity::list_from_json(entities),
            ..Self::default()
        }
    }
}

impl Host for MockHost {
    fn log(&self, level: Level, message: &str) {
        self.log.borrow_mut().push((level, message.to_owned()));
    }
    fn now_ms(&self) -> u64 {
        self.now_ms
    }
    fn entities_of_type(&self, type_name: &str) -> Vec<Entity> {
        self.entities
            .iter()
            .filter(|e| e.uid.type_name == type_name)
            .cloned()
            .collect()
    }
}

/// What a plugin says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Description {
    /// The plugin's name.
    pub name: String,
    /// Its version.
    pub version: String,
    /// The actions (ids without `Action::`) it applies to.
    pub actions: Vec<String>,
}

impl Description {
    /// A description.
    pub fn new<I, S>(name: &str, version: &str, actions: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            name: name.to_owned(),
            version: version.to_owned(),
            actions: actions.into_iter().map(Into::into).collect(),
        }
    }
}

/// An entity reference: type and id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uid {
    /// `Node`.
    pub type_name: String,
    /// `gpu-001`.
    pub id: String,
}

impl Uid {
    /// A uid.
    pub fn new(type_name: &str, id: &str) -> Self {
        Self {
            type_name: type_name.to_owned(),
            id: id.to_owned(),
        }
    }

    /// Reads `{"type": .., "id": ..}`, optionally wrapped in `{"__entity": ..}`.
    pub fn from_json(v: &Value) -> Option<Self> {
        let o = v.as_object()?;
        let o = o.get("__entity").and_then(Value::as_object).unwrap_or(o);
        Some(Self::new(o.get("type")?.as_str()?, o.get("id")?.as_str()?))
    }

    /// Reads `Type::"id"` (ids without escapes).
    pub fn parse(text: &str) -> Option<Self> {
        let (t, rest) = text.split_once("::")?;
        let id = rest.strip_prefix('"')?.strip_suffix('"')?;
        Some(Self::new(t, id))
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Cedar's own syntax; the id is escaped only when it has to be (Debug
        // formatting walks every character, which a plugin pays on every message).
        if self.id.contains(['"', '\\']) || self.id.contains(char::is_control) {
            write!(f, "{}::{:?}", self.type_name, self.id)
        } else {
            write!(f, "{}::\"{}\"", self.type_name, self.id)
        }
    }
}

/// One attribute value, as the engine hands it over.
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    /// A boolean.
    Bool(bool),
    /// A Cedar long.
    Long(i64),
    /// A string.
    String(String),
    /// A reference to another entity.
    Entity(Uid),
    /// A set, a record or an extension value, as Cedar entity JSON.
    Json(String),
}

impl AttrValue {
    /// Reads one attribute value in Cedar entity JSON.
    pub fn from_json(v: &Value) -> Self {
        match v {
            Value::Bool(b) => AttrValue::Bool(*b),
            Value::String(s) => AttrValue::String(s.clone()),
            Value::Number(n) => n
                .as_i64()
                .map_or_else(|| AttrValue::Json(v.to_string()), AttrValue::Long),
            Value::Object(o) if o.len() == 1 && o.contains_key("__entity") => {
                Uid::from_json(v).map_or_else(|| AttrValue::Json(v.to_string()), AttrValue::Entity)
            }
            _ => AttrValue::Json(v.to_string()),
        }
    }
}

/// A Cedar entity: uid, attributes, parents.
#[derive(Debug, Clone, PartialEq)]
pub struct Entity {
    /// Its uid.
    pub uid: Uid,
    /// Its attributes, in the order the engine sent them.
    pub attrs: Vec<(String, AttrValue)>,
    /// Its parents.
    pub parents: Vec<Uid>,
}

impl Entity {
    /// Reads one Cedar entity JSON object (for tests and [`MockHost`]).
    pub fn from_json(v: &Value) -> Option<Self> {
        let o = v.as_object()?;
        Some(Self {
            uid: Uid::from_json(o.get("uid")?)?,
            attrs: o
                .get("attrs")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), AttrValue::from_json(v)))
                .collect(),
            parents: o
                .get("parents")
                .and_then(Value::as_array)
                .map(|ps| ps.iter().filter_map(Uid::from_json).collect())
                .unwrap_or_default(),
        })
    }

    /// Reads a JSON array of Cedar entities, skipping malformed items.
    pub fn list_from_json(v: &Value) -> Vec<Self> {
        v.as_array()
            .map(|items| items.iter().filter_map(Self::from_json).collect())
            .unwrap_or_default()
    }

    /// An attribute's value.
    pub fn attr(&self, name: &str) -> Option<&AttrValue> {
        // A linear search: entities carry a handful of attributes, and building an
        // index would cost more than it saves in a call that reads a few.
        self.attrs.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    /// An integer attribute.
    pub fn long(&self, attr: &str) -> Option<i64> {
        match self.attr(attr)? {
            AttrValue::Long(n) => Some(*n),
            _ => None,
        }
    }

    /// A string attribute.
    pub fn string(&self, attr: &str) -> Option<&str> {
        match self.attr(attr)? {
            AttrValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// A boolean attribute.
    pub fn bool(&self, attr: &str) -> Option<bool> {
        match self.attr(attr)? {
            AttrValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// An entity-valued attribute.
    pub fn entity_ref(&self, attr: &str) -> Option<Uid> {
        match self.attr(attr)? {
            AttrValue::Entity(u) => Some(u.clone()),
            _ => None,
        }
    }
}

/// One question, typed.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// `Type::"id"`.
    pub principal: String,
    /// The action id (`schedule`).
    pub action: String,
    /// `Type::"id"`.
    pub resource: String,
    /// The context object.
    pub context: Map<String, Value>,
    /// The principal, the resource, the entities they reference, and any
    /// request-scoped entities.
    pub entities: Vec<Entity>,
    /// The plugin's `settings` table from the manifest.
    pub settings: Map<String, Value>,
}

impl Request {
    /// A request with empty context, entities and settings (for tests).
    pub fn new(principal: &str, action: &str, resource: &str) -> Self {
        Self {
            principal: principal.to_owned(),
            action: action.to_owned(),
            resource: resource.to_owned(),
            context: Map::new(),
            entities: Vec::new(),
            settings: Map::new(),
        }
    }

    /// Sets the context (a JSON object; anything else leaves it empty).
    pub fn with_context(mut self, context: Value) -> Self {
        self.context = into_object(context);
        self
    }

    /// Sets the entities (a JSON array of Cedar entities).
    pub fn with_entities(mut self, entities: &Value) -> Self {
        self.entities = Entity::list_from_json(entities);
        self
    }

    /// Sets the settings (a JSON object).
    pub fn with_settings(mut self, settings: Value) -> Self {
        self.settings = into_object(settings);
        self
    }

    /// The entity with this uid, if the request carries it.
    pub fn entity(&self, uid: &Uid) -> Option<&Entity> {
        self.entities.iter().find(|e| &e.uid == uid)
    }

    /// The principal's entity, if carried.
    pub fn principal_entity(&self) -> Option<&Entity> {
        self.entity(&Uid::parse(&self.principal)?)
    }

    /// The resource's entity, if carried.
    pub fn resource_entity(&self) -> Option<&Entity> {
        self.entity(&Uid::parse(&self.resource)?)
    }

    /// A numeric setting, or `default`.
    pub fn setting_f64(&self, key: &str, default: f64) -> f64 {
        self.settings
            .get(key)
            .and_then(Value::as_f64)
            .unwrap_or(default)
    }
}

/// A JSON object from text ("{}" for anything else).
pub(crate) fn object_from_str(text: &str) -> Map<String, Value> {
    if text == "{}" || text.is_empty() {
        return Map::new();
    }
    serde_json::from_str(text).unwrap_or_default()
}

fn into_object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// How serious a reason is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Info.
    Info,
    /// Low.
    Low,
    /// Medium.
    Medium,
    /// High.
    High,
    /// Critical.
    Critical,
}

/// Why a plugin decided as it did; reported as `plugin:<name>/<id>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason {
    /// Unique within the plugin.
    pub id: String,
    /// For people.
    pub message: String,
    /// How serious.
    pub severity: Severity,
}

impl Reason {
    /// A reason.
    pub fn new(id: &str, message: impl Into<String>, severity: Severity) -> Self {
        Self {
            id: id.to_owned(),
            message: message.into(),
            severity,
        }
    }
}

/// Something the caller must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Obligation {
    /// `alert`, `block_node`, `burst_to_cloud`, `migrate` or `rotate_key`.
    pub kind: String,
    /// The entity it applies to, `Type::"id"`.
    pub target: Option<String>,
    /// Extra parameters.
    pub parameters: BTreeMap<String, String>,
}

impl Obligation {
    /// An obligation of this kind with no target or parameters.
    pub fn new(kind: &str) -> Self {
        Self {
            kind: kind.to_owned(),
            target: None,
            parameters: BTreeMap::new(),
        }
    }

    /// Sets the target.
    pub fn target(mut self, target: impl Into<String>) -> Self {
        self.target = Some(target.into());
        self
    }

    /// Adds a parameter.
    pub fn param(mut self, key: &str, value: impl fmt::Display) -> Self {
        self.parameters.insert(key.to_owned(), value.to_string());
        self
    }
}

/// Reasons and obligations behind an allow or a deny.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Reasons.
    pub reasons: Vec<Reason>,
    /// Obligations.
    pub obligations: Vec<Obligation>,
}

/// A plugin's vote. Deny wins across Cedar and every plugin; abstain does not count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The plugin allows (and may still carry obligations, e.g. an alert).
    Allow(Outcome),
    /// The plugin denies.
    Deny(Outcome),
    /// The plugin has no opinion on this request.
    Abstain,
}

impl Verdict {
    /// An allow with no reasons.
    pub fn allow() -> Self {
        Verdict::Allow(Outcome::default())
    }

    /// A deny with one reason.
    pub fn deny(reason: Reason) -> Self {
        Verdict::Deny(Outcome {
            reasons: vec![reason],
            obligations: Vec::new(),
        })
    }

    /// Adds an obligation (no effect on [`Verdict::Abstain`]).
    pub fn with_obligation(mut self, obligation: Obligation) -> Self {
        if let Verdict::Allow(o) | Verdict::Deny(o) = &mut self {
            o.obligations.push(obligation);
        }
        self
    }

    /// Adds a reason (no effect on [`Verdict::Abstain`]).
    pub fn with_reason(mut self, reason: Reason) -> Self {
        if let Verdict::Allow(o) | Verdict::Deny(o) = &mut self {
            o.reasons.push(reason);
        }
        self
    }

    /// True for a deny.
    pub fn is_deny(&self) -> bool {
        matches!(self, Verdict::Deny(_))
    }

    /// The reasons and obligations, if not an abstain.
    pub fn outcome(&self) -> Option<&Outcome> {
        match self {
            Verdict::Allow(o) | Verdict::Deny(o) => Some(o),
            Verdict::Abstain => None,
        }
    }
}

/// Exports a [`Plugin`] as the component's `probity:plugin/evaluator`.
///
/// ```text
/// struct PowerSpike;
/// impl probity_plugin_sdk::Plugin for PowerSpike { /* ... */ }
/// probity_plugin_sdk::export_plugin!(PowerSpike);
/// ```
///
/// In the wasm build it also installs the call arena as the global allocator: a
/// bump allocator that never frees, since the engine discards a plugin's memory after
/// every call (the SDK's `arena` module explains the trade). A plugin that allocates
/// and frees in long loops keeps the system allocator instead:
/// `export_plugin!(MyPlugin, allocator = system)`.
#[macro_export]
macro_rules! export_plugin {
    (@export $plugin:ty) => {
        // Only a wasm build exports anything: a native build (unit tests) links the
        // crate's cdylib too, and the contract's export names are not valid symbols there.
        #[cfg(target_arch = "wasm32")]
        #[allow(
            unsafe_code,
            reason = "wit-bindgen's export glue: extern \"C\" functions the host calls"
        )]
        const _: () = {
            struct __ProbityPluginExport;

            impl $crate::__private::bindings::exports::probity::plugin::evaluator::Guest
                for __ProbityPluginExport
            {
                fn describe()
                -> $crate::__private::bindings::exports::probity::plugin::evaluator::Description
                {
                    $crate::__private::describe::<$plugin>()
                }

                fn evaluate(
                    request: $crate::__private::bindings::exports::probity::plugin::evaluator::Request,
                ) -> $crate::__private::bindings::exports::probity::plugin::evaluator::Verdict {
                    $crate::__private::evaluate::<$plugin>(request)
                }
            }

            $crate::__private::bindings::export!(
                __ProbityPluginExport with_types_in $crate::__private::bindings
            );
        };
    };
    ($plugin:ty) => {
        $crate::export_plugin!($plugin, allocator = arena);
    };
    ($plugin:ty, allocator = arena) => {
        #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
        #[global_allocator]
        static __PROBITY_CALL_ARENA: $crate::__private::CallArena =
            $crate::__private::CallArena::new();
        $crate::export_plugin!(@export $plugin);
    };
    ($plugin:ty, allocator = system) => {
        $crate::export_plugin!(@export $plugin);
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn uids_parse_and_print() {
        let uid = Uid::parse(r#"Node::"gpu-001""#).unwrap();
        assert_eq!(uid.type_name, "Node");
        assert_eq!(uid.id, "gpu-001");
        assert_eq!(uid.to_string(), r#"Node::"gpu-001""#);
        assert_eq!(Uid::parse("Node"), None);
    }

    #[test]
    fn request_finds_its_entities() {
        let r = Request::new(r#"Workload::"w""#, "schedule", r#"Node::"n""#).with_entities(
            &json!([{"uid": {"type": "Node", "id": "n"}, "attrs": {"zone": {"__entity": {"type": "Zone", "id": "z"}}, "powerDrawW": 5}, "parents": []}]),
        );
        let node = r.resource_entity().unwrap();
        assert_eq!(node.long("powerDrawW"), Some(5));
        assert_eq!(node.entity_ref("zone").unwrap().id, "z");
        assert!(r.principal_entity().is_none());
    }

    #[test]
    fn abstain_ignores_obligations() {
        let v = Verdict::Abstain.with_obligation(Obligation::new("alert"));
        assert_eq!(v, Verdict::Abstain);
        assert!(v.outcome().is_none());
    }
}
