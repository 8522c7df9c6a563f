//! Converting entity JSON into store records, directed by the schema.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::Arc;

use cedar_policy_core::ast::{self, EntityType, EntityUID, Literal, Name, RestrictedExpr, Value};
use cedar_policy_core::evaluator::RestrictedEvaluator;
use cedar_policy_core::extensions::Extensions;
use cedar_policy_core::validator::ValidatorSchema;
use cedar_policy_core::validator::types::{EntityKind, Type};
use serde_json::Value as Json;
use smol_str::SmolStr;

use crate::conformance::TypeDescriptions;
use crate::facts::FactOrigins;

use super::*;

/// Whether `value` displays as exactly `text`, without building the string.
pub(super) fn displays_as(value: &impl std::fmt::Display, text: &str) -> bool {
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
        let stored = Stored::new(
            attrs.into_boxed_slice(),
            tags.into_boxed_slice(),
            parents.into_boxed_slice(),
        );
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
    pub(super) fn value(
        &self,
        json: &Json,
        ty: Option<&Type>,
        depth: usize,
    ) -> Result<Value, String> {
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
pub(super) fn extension(function: &str, arg: &str) -> Result<Value, String> {
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

pub(super) fn kind(v: &Json) -> &'static str {
    crate::request::kind(v)
}

pub(super) fn truncate(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{:?}...", s.get(..i).unwrap_or(s)),
        None => format!("{s:?}"),
    }
}
