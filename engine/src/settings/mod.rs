//! Settings from the schema: `probity.toml` is read against the entity types the schema
//! marks `@owned("config")`, so a new threshold is an edit to the schema, the TOML and a
//! policy, never to Rust.
//!
//! Each attribute of such a type names the TOML key it comes from, and how that value is
//! checked and turned into the attribute's value, with annotations beside it:
//!
//! | annotation | meaning |
//! | --- | --- |
//! | `@toml("security.key_max_age_days")` | the key (dotted path) the attribute is read from |
//! | `@toml("thermal.gpu_temp_target_c.{id}")` | every key of that table is an entity id (one `GpuModel` per model) |
//! | `@toml("roles.{id}.tcp")` | every key of `roles` is an entity id, and the attribute is read from its `tcp` |
//! | `@id("active")` (on the type) | the one entity's id, for a type without `{id}` |
//! | `@min("1")`, `@max("100")` | the allowed range of a number (of each number of a set), as written in the TOML |
//! | `@why("0 stops all scheduling")` | why the range ends where it does: a value that would switch its rule off is refused, and the error says why |
//! | `@scale("86400")` | the TOML holds friendly units (days) and the attribute `scale` times that (seconds) |
//! | `@default("[]")` | a TOML value used when the key is absent; without one a required attribute must be set |
//! | `@convert("ports")` | a list of ports and `"FROM-TO"` ranges, expanded into a `Set<Long>` |
//! | `@convert("port_sources")` | a table `"tcp/PORT" = ["10.0.0.0/8"]`, into a `Set<String>` of `"tcp/PORT 10.0.0.0/8"` |
//! | `@includes("rlhfClass")` | a set that must hold another attribute's value (a default gets it added) |
//! | `@oneOf("NoSchedule NoExecute")` | the only values a string (or each string of a set) may take, separated by spaces |
//!
//! The value's shape comes from the attribute's type: a `Long` from an integer, a
//! `String` from a non-empty string, a `Bool` from a boolean, an entity reference from
//! the entity's id as a string, a `Set` from an array. A key that no attribute claims
//! is refused, as is a value of the wrong shape or out of range, each at its own
//! file:line:column.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use serde_json::Value as Json;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

/// The placeholder in a `@toml` path that stands for an entity id.
mod read;

use read::*;
#[cfg(test)]
mod tests;

const ID_SEGMENT: &str = "{id}";

/// How a configuration type's settings are read: its types and attributes, as the
/// schema declares them. Built once per schema.
#[derive(Debug, Clone, Default)]
pub struct SettingsSchema {
    types: Vec<ConfigType>,
}

/// The entities `probity.toml` describes, ready for the store.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settings {
    entities: Vec<Json>,
}

impl Settings {
    /// The entities in Cedar's entity JSON format.
    pub fn entities_json(&self) -> Json {
        Json::Array(self.entities.clone())
    }

    /// The value of attribute `attr` of the entity `entity_type::"id"`, as Cedar JSON.
    pub fn attr(&self, entity_type: &str, id: &str, attr: &str) -> Option<&Json> {
        self.entities
            .iter()
            .find(|e| {
                e.pointer("/uid/type").and_then(Json::as_str) == Some(entity_type)
                    && e.pointer("/uid/id").and_then(Json::as_str) == Some(id)
            })
            .and_then(|e| e.get("attrs"))
            .and_then(|a| a.get(attr))
    }
}

/// One setting the schema declares: what `probity settings` lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingInfo {
    /// The TOML key, with `{id}` where an entity id goes.
    pub key: String,
    /// The entity type and attribute it sets (`Settings.keyMaxAgeSeconds`).
    pub attribute: String,
    /// The attribute's type as the schema writes it.
    pub type_name: String,
    /// The allowed range, when declared.
    pub min: Option<i64>,
    /// The allowed range, when declared.
    pub max: Option<i64>,
    /// The unit conversion, when declared.
    pub scale: Option<i64>,
    /// The value when absent, as TOML.
    pub default: Option<String>,
    /// Whether the key may be left out.
    pub required: bool,
    /// Why the range ends where it does.
    pub why: Option<String>,
}

#[derive(Debug, Clone)]
struct ConfigType {
    name: String,
    id: EntityIds,
    attrs: Vec<SettingAttr>,
}

#[derive(Debug, Clone)]
enum EntityIds {
    /// One entity with this id.
    Fixed(String),
    /// One entity per key of the table at this path.
    Keyed(Vec<String>),
}

#[derive(Debug, Clone)]
struct SettingAttr {
    attr: String,
    /// The path under the entity's table (keyed types) or from the top (fixed ones).
    path: Vec<String>,
    ty: AttrType,
    required: bool,
    min: Option<i64>,
    max: Option<i64>,
    why: Option<String>,
    scale: Option<i64>,
    convert: Option<Conversion>,
    includes: Option<String>,
    /// `@oneOf`: the values a string may take.
    one_of: Option<Vec<String>>,
    default: Option<(String, Json)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum AttrType {
    Long,
    String,
    Bool,
    Entity(String),
    Set(Box<AttrType>),
}

impl AttrType {
    fn describe(&self) -> String {
        match self {
            AttrType::Long => "Long".into(),
            AttrType::String => "String".into(),
            AttrType::Bool => "Bool".into(),
            AttrType::Entity(t) => t.clone(),
            AttrType::Set(e) => format!("Set<{}>", e.describe()),
        }
    }

    fn expected(&self) -> String {
        match self {
            AttrType::Long => "an integer".into(),
            AttrType::String => "a string".into(),
            AttrType::Bool => "true or false".into(),
            AttrType::Entity(t) => format!("the id of a {t} as a string"),
            AttrType::Set(e) => format!("an array of {}", e.expected_plural()),
        }
    }

    fn expected_plural(&self) -> String {
        match self {
            AttrType::Long => "integers".into(),
            AttrType::String => "strings".into(),
            AttrType::Bool => "booleans".into(),
            AttrType::Entity(t) => format!("{t} ids"),
            AttrType::Set(e) => format!("arrays of {}", e.expected_plural()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conversion {
    /// Ports and `"FROM-TO"` ranges, expanded.
    Ports,
    /// `"tcp/PORT" = [prefixes]` into `"tcp/PORT prefix"` strings.
    PortSources,
}

impl Conversion {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "ports" => Some(Self::Ports),
            "port_sources" => Some(Self::PortSources),
            _ => None,
        }
    }

    fn fits(self, ty: &AttrType) -> bool {
        match self {
            Self::Ports => *ty == AttrType::Set(Box::new(AttrType::Long)),
            Self::PortSources => *ty == AttrType::Set(Box::new(AttrType::String)),
        }
    }
}

impl SettingsSchema {
    /// Reads the settings the schema `text` (the contents of `file`) declares. Problems
    /// are located at the annotation they concern; the schema's own syntax errors are
    /// left to the policy compiler (this reads no settings from such a schema).
    pub fn from_cedarschema(file: &str, text: &Arc<str>) -> Result<Self, Vec<SourceDiagnostic>> {
        Self::from_source(&SourceFile::inline(file, text))
    }

    pub(crate) fn from_source(file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        match crate::facts::schema_json(&file.text) {
            Some(json) => Self::from_json(&json, file),
            // The schema's own errors are reported by the compiler.
            None => Ok(Self::default()),
        }
    }

    /// From the JSON form of the schema (the text of `file`).
    pub(crate) fn from_json(json: &Json, file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        let mut problems = Vec::new();
        let mut types = Vec::new();
        for (namespace, body) in json.as_object().into_iter().flatten() {
            let qualify = |name: &str| {
                if namespace.is_empty() {
                    name.to_owned()
                } else {
                    format!("{namespace}::{name}")
                }
            };
            let resolver = TypeResolver { namespace: body };
            for (name, decl) in body
                .get("entityTypes")
                .and_then(Json::as_object)
                .into_iter()
                .flatten()
            {
                if annotation(decl, crate::facts::OWNED_ANNOTATION) != Some("config") {
                    continue;
                }
                let entity_type = qualify(name);
                let mut problem = |needle: Option<&str>, what: String| {
                    problems.push(locate_in_schema(file, needle, what));
                };
                let mut attrs = Vec::new();
                let mut keyed: Option<Vec<String>> = None;
                let mut fixed_paths = false;
                for (attr, attr_decl) in decl
                    .pointer("/shape/attributes")
                    .and_then(Json::as_object)
                    .into_iter()
                    .flatten()
                {
                    let at = format!("entity {entity_type}, attribute {attr}");
                    let required = attr_decl.get("required").and_then(Json::as_bool) != Some(false);
                    let Some(path) = annotation(attr_decl, "toml") else {
                        if required {
                            problem(
                                Some(attr),
                                format!(
                                    "{at}: a required attribute of a configuration type needs @toml(\"key\") to say where probity.toml sets it"
                                ),
                            );
                        }
                        continue;
                    };
                    let needle = format!("@toml(\"{path}\")");
                    let segments: Vec<String> = path.split('.').map(str::to_owned).collect();
                    if segments.iter().any(|s| s.trim().is_empty()) {
                        problem(
                            Some(&needle),
                            format!("{at}: @toml(\"{path}\") has an empty key"),
                        );
                        continue;
                    }
                    let ids = segments.iter().filter(|s| *s == ID_SEGMENT).count();
                    let path = match (ids, segments.iter().position(|s| s == ID_SEGMENT)) {
                        (0, _) => {
                            fixed_paths = true;
                            segments
                        }
                        (1, Some(i)) => {
                            let prefix = segments.get(..i).unwrap_or_default().to_vec();
                            if prefix.is_empty() {
                                problem(
                                    Some(&needle),
                                    format!(
                                        "{at}: @toml(\"{path}\") needs a table before {ID_SEGMENT}"
                                    ),
                                );
                                continue;
                            }
                            match &keyed {
                                Some(p) if *p != prefix => {
                                    problem(
                                        Some(&needle),
                                        format!(
                                            "{at}: @toml(\"{path}\") puts the ids under {}, another attribute under {}",
                                            prefix.join("."),
                                            p.join(".")
                                        ),
                                    );
                                    continue;
                                }
                                _ => keyed = Some(prefix),
                            }
                            segments.get(i + 1..).unwrap_or_default().to_vec()
                        }
                        _ => {
                            problem(
                                Some(&needle),
                                format!(
                                    "{at}: @toml(\"{path}\") holds {ID_SEGMENT} more than once"
                                ),
                            );
                            continue;
                        }
                    };
                    let ty = match resolver.resolve(attr_decl) {
                        Some(t) => t,
                        None => {
                            problem(
                                Some(&needle),
                                format!(
                                    "{at}: its type cannot be set from probity.toml (Long, String, Bool, an entity, or a Set of them)"
                                ),
                            );
                            continue;
                        }
                    };
                    let number =
                        |key: &str| -> Result<Option<i64>, String> {
                            match annotation(attr_decl, key) {
                                None => Ok(None),
                                Some(v) => v.trim().parse::<i64>().map(Some).map_err(|_| {
                                    format!("{at}: @{key}(\"{v}\") is not an integer")
                                }),
                            }
                        };
                    let (min, max, scale) = match (number("min"), number("max"), number("scale")) {
                        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
                        (a, b, c) => {
                            for e in [a.err(), b.err(), c.err()].into_iter().flatten() {
                                problem(Some(attr), e);
                            }
                            continue;
                        }
                    };
                    let long_inside = matches!(&ty, AttrType::Long)
                        || matches!(&ty, AttrType::Set(e) if **e == AttrType::Long);
                    if (min.is_some() || max.is_some() || scale.is_some()) && !long_inside {
                        problem(
                            Some(attr),
                            format!("{at}: @min, @max and @scale apply to a Long or a Set<Long>"),
                        );
                        continue;
                    }
                    if let (Some(lo), Some(hi)) = (min, max)
                        && lo > hi
                    {
                        problem(Some(attr), format!("{at}: @min({lo}) is above @max({hi})"));
                        continue;
                    }
                    if scale.is_some_and(|s| s < 1) {
                        problem(Some(attr), format!("{at}: @scale must be at least 1"));
                        continue;
                    }
                    let convert = match annotation(attr_decl, "convert") {
                        None => None,
                        Some(name) => match Conversion::parse(name) {
                            Some(c) if c.fits(&ty) => Some(c),
                            Some(_) => {
                                problem(
                                    Some(&format!("@convert(\"{name}\")")),
                                    format!(
                                        "{at}: @convert(\"{name}\") makes a {}, not a {}",
                                        if name == "ports" {
                                            "Set<Long>"
                                        } else {
                                            "Set<String>"
                                        },
                                        ty.describe()
                                    ),
                                );
                                continue;
                            }
                            None => {
                                problem(
                                    Some(&format!("@convert(\"{name}\")")),
                                    format!(
                                        "{at}: @convert(\"{name}\") is not a conversion (ports, port_sources)"
                                    ),
                                );
                                continue;
                            }
                        },
                    };
                    let one_of = annotation(attr_decl, "oneOf").map(|list| {
                        list.split_whitespace()
                            .map(str::to_owned)
                            .collect::<Vec<_>>()
                    });
                    let strings = matches!(&ty, AttrType::String)
                        || matches!(&ty, AttrType::Set(e) if **e == AttrType::String);
                    if let Some(list) = &one_of
                        && (list.is_empty() || !strings || convert.is_some())
                    {
                        problem(
                            Some("@oneOf"),
                            format!(
                                "{at}: @oneOf needs a String or Set<String> read as it stands, and at least one value"
                            ),
                        );
                        continue;
                    }
                    let mut setting = SettingAttr {
                        attr: attr.clone(),
                        path,
                        ty,
                        required,
                        min,
                        max,
                        why: annotation(attr_decl, "why").map(str::to_owned),
                        scale,
                        convert,
                        includes: annotation(attr_decl, "includes").map(str::to_owned),
                        one_of,
                        default: None,
                    };
                    if let Some(text) = annotation(attr_decl, "default") {
                        let literal: Arc<str> = Arc::from(text);
                        let converted = DeValue::parse(text)
                            .map_err(|e| e.message().to_owned())
                            .and_then(|v| {
                                setting
                                    .convert_value(
                                        "@default",
                                        &v,
                                        &SourceFile::inline("@default", &literal),
                                    )
                                    .map_err(|d| d.message)
                            });
                        match converted {
                            Ok(v) => setting.default = Some((text.to_owned(), v)),
                            Err(e) => {
                                problem(
                                    Some(&format!("@default(\"{text}\")")),
                                    format!("{at}: @default(\"{text}\"): {e}"),
                                );
                                continue;
                            }
                        }
                    }
                    attrs.push(setting);
                }
                if let Some(includes) = attrs.iter().filter_map(|a| a.includes.as_ref().map(|i| (a, i))).find_map(|(a, i)| {
                    let target = attrs.iter().find(|b| &b.attr == i);
                    let ok = matches!((&a.ty, target), (AttrType::Set(e), Some(b)) if **e == b.ty);
                    (!ok).then(|| format!("entity {entity_type}, attribute {}: @includes(\"{i}\") needs a Set of what {i} holds, and {i} read from probity.toml", a.attr))
                }) {
                    problem(Some("@includes"), includes);
                    continue;
                }
                if attrs.is_empty() {
                    continue;
                }
                let id = match (keyed, fixed_paths, annotation(decl, "id")) {
                    (Some(_), true, _) => {
                        problem(
                            Some(name),
                            format!(
                                "entity {entity_type}: some attributes use {ID_SEGMENT} and some do not"
                            ),
                        );
                        continue;
                    }
                    (Some(prefix), false, _) => {
                        if attrs.iter().any(|a| a.path.is_empty()) && attrs.len() > 1 {
                            problem(
                                Some(name),
                                format!(
                                    "entity {entity_type}: an attribute read from the id's own value must be the type's only setting"
                                ),
                            );
                            continue;
                        }
                        EntityIds::Keyed(prefix)
                    }
                    (None, _, Some(id)) if !id.trim().is_empty() => EntityIds::Fixed(id.to_owned()),
                    (None, _, _) => {
                        problem(
                            Some(name),
                            format!(
                                "entity {entity_type}: a configuration type needs @id(\"...\") (its one entity's id) or {ID_SEGMENT} in its @toml keys"
                            ),
                        );
                        continue;
                    }
                };
                types.push(ConfigType {
                    name: entity_type,
                    id,
                    attrs,
                });
            }
        }
        if problems.is_empty() {
            Ok(Self { types })
        } else {
            Err(problems)
        }
    }

    /// Every setting the schema declares, in schema order.
    pub fn settings(&self) -> Vec<SettingInfo> {
        let mut out = Vec::new();
        for t in &self.types {
            for a in &t.attrs {
                let key = match &t.id {
                    EntityIds::Fixed(_) => a.path.join("."),
                    EntityIds::Keyed(prefix) => prefix
                        .iter()
                        .map(String::as_str)
                        .chain(std::iter::once(ID_SEGMENT))
                        .chain(a.path.iter().map(String::as_str))
                        .collect::<Vec<_>>()
                        .join("."),
                };
                out.push(SettingInfo {
                    key,
                    attribute: format!("{}.{}", t.name, a.attr),
                    type_name: a.ty.describe(),
                    min: a.min,
                    max: a.max,
                    scale: a.scale,
                    default: a.default.as_ref().map(|(t, _)| t.clone()),
                    required: a.required && a.default.is_none(),
                    why: a.why.clone(),
                });
            }
        }
        out
    }

    /// Reads `text`, the contents of `file`, into the configuration's entities.
    pub fn read(&self, file: &str, text: &Arc<str>) -> Result<Settings, Box<SourceDiagnostic>> {
        let source = SourceFile::inline(file, text);
        let doc = DeTable::parse(text).map_err(|e| {
            let span = e.span().unwrap_or(0..0);
            source.at(span, e.message().to_owned())
        })?;
        let doc_value = Spanned::new(doc.span(), DeValue::Table(doc.get_ref().clone()));
        let mut claimed: Vec<Vec<String>> = Vec::new();
        let mut entities = Vec::new();
        for t in &self.types {
            match &t.id {
                EntityIds::Fixed(id) => {
                    let attrs = t.read_attrs(&doc_value, &[], &source, &mut claimed)?;
                    entities.push(entity_json(&t.name, id, attrs));
                }
                EntityIds::Keyed(prefix) => {
                    let Some(table) = lookup(&doc_value, prefix) else {
                        continue;
                    };
                    let key = prefix.join(".");
                    let DeValue::Table(entries) = table.get_ref() else {
                        return Err(source.at(
                            table.span(),
                            format!("{key}: expected a table of {} ids", t.name),
                        ));
                    };
                    for (id, value) in entries.iter() {
                        let id_text: &str = id.get_ref();
                        check_id(id_text).map_err(|why| {
                            source.at(id.span(), format!("{key}.{id_text}: {why}"))
                        })?;
                        let mut at: Vec<String> = prefix.clone();
                        at.push(id_text.to_owned());
                        if t.attrs.iter().all(|a| !a.path.is_empty())
                            && !matches!(value.get_ref(), DeValue::Table(_))
                        {
                            return Err(source
                                .at(value.span(), format!("{}: expected a table", at.join("."))));
                        }
                        let attrs = t.read_attrs(value, &at, &source, &mut claimed)?;
                        entities.push(entity_json(&t.name, id_text, attrs));
                    }
                }
            }
        }
        unclaimed(&doc_value, &mut Vec::new(), &claimed, &source)?;
        Ok(Settings { entities })
    }
}
