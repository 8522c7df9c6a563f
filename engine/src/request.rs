//! What callers ask: a [`Request`] naming principal, action and resource, with a
//! context and optional request-scoped entities.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use serde_json::{Map, Value};

use crate::error::RequestError;

mod parsed;
pub use parsed::{ParsedRequests, ParsedRequestsStats};

/// Largest request, in bytes, that [`Request::from_json_slice`] reads.
pub(crate) const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// A reference to an entity: `Type::"id"`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntityUid(pub(crate) cedar_policy::EntityUid);

impl EntityUid {
    /// The uid of type `type_name` and id `id`, e.g. `("Node", "gpu-001")`.
    pub fn new(type_name: &str, id: &str) -> Result<Self, RequestError> {
        let t = type_names::get(type_name).ok_or_else(|| RequestError::EntityUid {
            field: "type",
            value: truncate(type_name),
        })?;
        let eid = cedar_policy::EntityId::new(id);
        Ok(Self(cedar_policy::EntityUid::from_type_name_and_id(t, eid)))
    }

    /// The uid of an action: `Action::"id"`.
    pub fn action(id: &str) -> Result<Self, RequestError> {
        Self::new("Action", id)
    }

    /// The type name (`Node`).
    pub fn type_name(&self) -> String {
        self.0.type_name().to_string()
    }

    /// The id (`gpu-001`).
    pub fn id(&self) -> &str {
        self.0.id().unescaped()
    }

    /// Reads `"Type::\"id\""` or `{"type": "Type", "id": "id"}` (optionally wrapped in `__entity`).
    pub(crate) fn from_json(field: &'static str, v: &Value) -> Result<Self, RequestError> {
        let bad = || RequestError::EntityUid {
            field,
            value: truncate(&v.to_string()),
        };
        match v {
            Value::String(s) => s.parse().map_err(|_| bad()),
            Value::Object(o) => {
                let o = match o.get("__entity") {
                    Some(Value::Object(inner)) => inner,
                    _ => o,
                };
                match (o.get("type"), o.get("id")) {
                    (Some(Value::String(t)), Some(Value::String(id))) => {
                        Self::new(t, id).map_err(|_| bad())
                    }
                    _ => Err(bad()),
                }
            }
            _ => Err(bad()),
        }
    }
}

impl FromStr for EntityUid {
    type Err = RequestError;
    fn from_str(s: &str) -> Result<Self, RequestError> {
        if let Some(uid) = simple_uid(s) {
            return Ok(uid);
        }
        cedar_policy::EntityUid::from_str(s)
            .map(Self)
            .map_err(|_| RequestError::EntityUid {
                field: "uid",
                value: truncate(s),
            })
    }
}

/// `Type::"id"` read without Cedar's parser when it is plainly well formed: a type
/// of identifiers joined by `::`, an id in quotes with no escapes or control
/// characters, nothing else. Every request names three uids, and the general parser
/// costs more than the rest of reading the request; anything unusual (escapes,
/// spaces, comments) falls through to it, so the two always agree on what they
/// accept.
fn simple_uid(s: &str) -> Option<EntityUid> {
    let (type_name, rest) = s.rsplit_once("::\"")?;
    let id = rest.strip_suffix('"')?;
    if id.contains(['"', '\\'])
        || id.contains(char::is_control)
        || !type_name.split("::").all(is_plain_ident)
    {
        return None;
    }
    let t = type_names::get(type_name)?;
    Some(EntityUid(cedar_policy::EntityUid::from_type_name_and_id(
        t,
        cedar_policy::EntityId::new(id),
    )))
}

/// ASCII letters, digits and `_`, not starting with a digit. Only a pre-check: the
/// type name itself is still checked by Cedar's parser (once, then cached), which
/// also refuses reserved words.
fn is_plain_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Parsed entity type names, kept because a deployment uses a handful of types and
/// parsing one costs as much as the rest of the uid. Bounded: past the bound, names
/// are parsed each time.
mod type_names {
    use std::collections::HashMap;
    use std::str::FromStr;
    use std::sync::{PoisonError, RwLock};

    use crate::hashing::KeyedHash;

    const MAX_CACHED: usize = 256;

    type Names = HashMap<String, cedar_policy::EntityTypeName, KeyedHash>;

    static CACHE: RwLock<Option<Names>> = RwLock::new(None);

    pub(super) fn get(name: &str) -> Option<cedar_policy::EntityTypeName> {
        if let Some(t) = CACHE
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|m| m.get(name))
        {
            return Some(t.clone());
        }
        let t = cedar_policy::EntityTypeName::from_str(name).ok()?;
        let mut cache = CACHE.write().unwrap_or_else(PoisonError::into_inner);
        let map = cache.get_or_insert_with(Names::default);
        if map.len() < MAX_CACHED {
            map.insert(name.to_owned(), t.clone());
        }
        Some(t)
    }
}

impl fmt::Display for EntityUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A question for the engine: may `principal` do `action` to `resource`?
#[derive(Debug, Clone)]
pub struct Request {
    pub(crate) principal: EntityUid,
    pub(crate) action: EntityUid,
    pub(crate) resource: EntityUid,
    // Shared, not owned: a request remembered by [`ParsedRequests`] is handed out as a
    // clone for every repeat of its body, without copying its JSON.
    pub(crate) context: Option<Arc<Map<String, Value>>>,
    pub(crate) entities: Arc<[Value]>,
    /// Whether the asker may supply facts the engine owns (see
    /// [`Request::as_fact_reporter`]).
    pub(crate) reporter: bool,
    /// Who asked, as the host authenticated it (see [`Request::on_behalf_of`]).
    pub(crate) caller: Option<std::sync::Arc<str>>,
    /// The decision cache's fingerprint of this question, once made, shared by every
    /// clone a [`ParsedRequests`] hands out; `None` for a request built any other way.
    /// Principal, action, context and entities are set only where a request is made
    /// (or, for the context and entities, with this emptied), so a kept fingerprint
    /// is always of the request it is kept in.
    pub(crate) fingerprints: Option<Arc<Fingerprints>>,
}

/// The decision cache's fingerprint of a question and its hash, one per value of
/// [`Request::is_fact_reporter`] (which the fingerprint includes); made on first use.
pub(crate) type Fingerprints = [OnceLock<Option<(Arc<str>, u64)>>; 2];

impl Request {
    /// The largest request body [`Request::from_json_slice`] reads (1 MiB).
    pub const MAX_BYTES: usize = MAX_REQUEST_BYTES;

    /// A request with an empty context.
    pub fn new(principal: EntityUid, action: EntityUid, resource: EntityUid) -> Self {
        Self {
            principal,
            action,
            resource,
            context: None,
            entities: Arc::from([]),
            reporter: false,
            caller: None,
            fingerprints: None,
        }
    }

    /// Names who asked (a peer's uid, a certificate's subject), as the host
    /// authenticated it: the decision log records it with the decision, so a flood or
    /// a forged request can be traced. No policy reads it, and it is not part of the
    /// question (a cached answer serves every caller alike).
    pub fn on_behalf_of(mut self, caller: impl Into<std::sync::Arc<str>>) -> Self {
        self.caller = Some(caller.into());
        self
    }

    /// Marks the request as coming from a source allowed to report facts the engine
    /// owns: the context attributes the schema marks `@owned("clock")` or
    /// `@owned("reporter")` (a decision's time, whether a read verified, when a
    /// remote login happened, power readings), and actions marked
    /// `@owned("reporter")` (elevation). Without it such a request is a deny that
    /// names the fact. The engine's own sources (verification, collectors) set it;
    /// the server sets it only for callers the api policies allow to `report` on
    /// `Api::"facts"`; a program linking the library decides for itself.
    pub fn as_fact_reporter(mut self) -> Self {
        self.reporter = true;
        self
    }

    /// The same question about another resource.
    pub fn with_resource(mut self, resource: EntityUid) -> Self {
        self.resource = resource;
        self
    }

    /// Whether the request may carry facts the engine owns.
    pub fn is_fact_reporter(&self) -> bool {
        self.reporter
    }

    /// Sets the context, a JSON object whose shape the schema gives per action.
    pub fn with_context(mut self, context: Map<String, Value>) -> Self {
        self.context = if context.is_empty() {
            None
        } else {
            Some(Arc::new(context))
        };
        self.fingerprints = None;
        self
    }

    /// Adds entities (Cedar entity JSON) that exist for this request only. They may
    /// only add facts the store does not hold: an entity the store holds, or one of a
    /// type the engine owns, makes the decision a deny that names it.
    pub fn with_entities(mut self, entities: Vec<Value>) -> Self {
        self.entities = Arc::from(entities);
        self.fingerprints = None;
        self
    }

    /// Reads a request from JSON bytes:
    /// `{"principal": .., "action": .., "resource": .., "context": {..}, "entities": [..]}`.
    pub fn from_json_slice(bytes: &[u8]) -> Result<Self, RequestError> {
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(RequestError::TooLarge {
                size: bytes.len(),
                limit: MAX_REQUEST_BYTES,
            });
        }
        Self::from_json_any_size(bytes)
    }

    /// [`Request::from_json_slice`] without its size bound, for a caller that bounds
    /// the bytes itself.
    pub(crate) fn from_json_any_size(bytes: &[u8]) -> Result<Self, RequestError> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| RequestError::Json {
            line: e.line(),
            column: e.column(),
            source: e,
        })?;
        Self::from_json_owned(value)
    }

    /// Reads a request from a parsed JSON value. [`Request::from_json_owned`] takes the
    /// value instead, and saves copying its context and entities.
    pub fn from_json_value(value: &Value) -> Result<Self, RequestError> {
        Self::from_json_owned(value.clone())
    }

    /// Reads a request from a parsed JSON value it takes: its context and entities are
    /// moved into the request, not copied (a request's entities are most of its bytes).
    pub fn from_json_owned(value: Value) -> Result<Self, RequestError> {
        let mut body = match value {
            Value::Object(body) => body,
            other => {
                return Err(RequestError::Shape {
                    field: "body",
                    expected: "a JSON object",
                    found: kind(&other).into(),
                });
            }
        };
        let uid = |field: &'static str| match body.get(field) {
            Some(v) => EntityUid::from_json(field, v),
            None => Err(RequestError::Shape {
                field,
                expected: "an entity reference",
                found: "nothing".into(),
            }),
        };
        let principal = uid("principal")?;
        let resource = uid("resource")?;
        let action = match body.get("action") {
            // A bare action id is accepted: "schedule".
            Some(Value::String(s)) if !s.contains("::") => EntityUid::action(s)?,
            _ => uid("action")?,
        };
        let context = match body.remove("context") {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) if m.is_empty() => None,
            Some(Value::Object(m)) => Some(Arc::new(m)),
            Some(other) => {
                return Err(RequestError::Shape {
                    field: "context",
                    expected: "a JSON object",
                    found: kind(&other).into(),
                });
            }
        };
        let entities = match body.remove("entities") {
            None | Some(Value::Null) => Arc::from([]),
            Some(Value::Array(a)) => Arc::from(a),
            Some(other) => {
                return Err(RequestError::Shape {
                    field: "entities",
                    expected: "a JSON array",
                    found: kind(&other).into(),
                });
            }
        };
        Ok(Self {
            principal,
            action,
            resource,
            context,
            entities,
            reporter: false,
            caller: None,
            fingerprints: None,
        })
    }

    /// The principal.
    pub fn principal(&self) -> &EntityUid {
        &self.principal
    }

    /// The action, as `Action::"id"`.
    pub fn action(&self) -> &EntityUid {
        &self.action
    }

    /// The resource.
    pub fn resource(&self) -> &EntityUid {
        &self.resource
    }

    /// The context, as given.
    pub fn context(&self) -> Option<&Map<String, Value>> {
        self.context.as_deref()
    }

    /// The request-scoped entities, as given.
    pub fn entities(&self) -> &[Value] {
        &self.entities
    }
}

/// The JSON type of a value, for error messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn truncate(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", s.get(..i).unwrap_or(s)),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uid_fast_path_agrees_with_cedars_parser() {
        for text in [
            r#"Node::"gpu-001""#,
            r#"Node::"""#,
            r#"Probity::Node::"gpu 1""#,
            r#"Node::"gpu\"1""#,
            r#"Node::"gpu\\1""#,
            r#"Node :: "gpu""#,
            r#"Node::"a::"b""#,
            r#"if::"x""#,
            r#"true::"x""#,
            r#"1Node::"x""#,
            r#"Node::"é ✓""#,
            r#"Node::gpu"#,
            r#"Node::"x" "#,
            "Node::\"multi\nline\"",
            "Node::\"tab\there\"",
            "Node::\"nul\u{0}\"",
        ] {
            let fast = simple_uid(text).map(|u| u.0);
            let cedar = cedar_policy::EntityUid::from_str(text).ok();
            if let Some(f) = &fast {
                assert_eq!(Some(f), cedar.as_ref(), "{text}");
            }
            assert_eq!(text.parse::<EntityUid>().ok().map(|u| u.0), cedar, "{text}");
        }
    }

    #[test]
    fn reads_both_uid_forms_and_bare_actions() {
        let r = Request::from_json_slice(
            br#"{"principal": "Workload::\"w\"", "action": "schedule",
                 "resource": {"type": "Node", "id": "n1"}}"#,
        )
        .unwrap();
        assert_eq!(r.principal().to_string(), r#"Workload::"w""#);
        assert_eq!(r.action().to_string(), r#"Action::"schedule""#);
        assert_eq!(r.resource().id(), "n1");
    }

    #[test]
    fn non_object_body_is_named() {
        let err = Request::from_json_slice(b"[1, 2]").unwrap_err();
        assert_eq!(
            err.to_string(),
            "request body: expected a JSON object, found an array"
        );
    }

    #[test]
    fn bad_json_is_located() {
        let err = Request::from_json_slice(b"{\n  \"principal\": }").unwrap_err();
        assert_eq!(
            err.to_string(),
            "request is not valid JSON at line 2, column 16"
        );
    }

    #[test]
    fn oversized_request_is_refused_before_parsing() {
        let big = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert!(matches!(
            Request::from_json_slice(&big),
            Err(RequestError::TooLarge { .. })
        ));
    }

    #[test]
    fn context_must_be_an_object() {
        let err = Request::from_json_slice(
            br#"{"principal": "User::\"a\"", "action": "elevate", "resource": "Node::\"n\"", "context": 3}"#,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("context: expected a JSON object, found a number")
        );
    }
}
