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
//!
//! The value's shape comes from the attribute's type: a `Long` from an integer, a
//! `String` from a non-empty string, a `Bool` from a boolean, an entity reference from
//! the entity's id as a string, a `Set` from an array. A key that no attribute claims
//! is refused, as is a value of the wrong shape or out of range, each at its own
//! file:line:column.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use serde_json::{Map, Value as Json, json};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

/// The placeholder in a `@toml` path that stands for an entity id.
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

impl ConfigType {
    /// The attributes of one entity, read under `base` (a table at path `at`).
    fn read_attrs(
        &self,
        base: &Spanned<DeValue<'_>>,
        at: &[String],
        source: &SourceFile,
        claimed: &mut Vec<Vec<String>>,
    ) -> Result<Map<String, Json>, Box<SourceDiagnostic>> {
        let mut attrs = Map::new();
        let mut spans: BTreeMap<&str, Range<usize>> = BTreeMap::new();
        let mut defaulted = Vec::new();
        for a in &self.attrs {
            let full: Vec<String> = at.iter().chain(a.path.iter()).cloned().collect();
            let key = full.join(".");
            match lookup(base, &a.path) {
                Some(v) => {
                    claimed.push(full);
                    attrs.insert(a.attr.clone(), a.convert_value(&key, v, source)?);
                    spans.insert(&a.attr, v.span());
                }
                None => match &a.default {
                    Some((_, v)) => {
                        attrs.insert(a.attr.clone(), v.clone());
                        defaulted.push(a.attr.as_str());
                    }
                    None if a.required => {
                        let parent = lookup(base, a.path.split_last().map_or(&[][..], |(_, p)| p));
                        let span = parent.map_or(0..0, |p| p.span().start..p.span().start);
                        return Err(source.at(
                            span,
                            format!(
                                "missing setting {key} (the schema's {}.{})",
                                self.name, a.attr
                            ),
                        ));
                    }
                    None => {}
                },
            }
        }
        for a in &self.attrs {
            let Some(other) = &a.includes else { continue };
            let Some(needed) = attrs.get(other).cloned() else {
                continue;
            };
            let Some(Json::Array(list)) = attrs.get_mut(&a.attr) else {
                continue;
            };
            if list.contains(&needed) {
                continue;
            }
            if defaulted.contains(&a.attr.as_str()) {
                list.push(needed);
                continue;
            }
            let key: Vec<String> = at.iter().chain(a.path.iter()).cloned().collect();
            let other_key = self
                .attrs
                .iter()
                .find(|b| &b.attr == other)
                .map(|b| {
                    at.iter()
                        .chain(b.path.iter())
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(".")
                })
                .unwrap_or_else(|| other.clone());
            return Err(source.at(
                spans.get(a.attr.as_str()).cloned().unwrap_or(0..0),
                format!("{} must include {other_key} ({needed})", key.join(".")),
            ));
        }
        Ok(attrs)
    }
}

impl SettingAttr {
    fn convert_value(
        &self,
        key: &str,
        v: &Spanned<DeValue<'_>>,
        source: &SourceFile,
    ) -> Result<Json, Box<SourceDiagnostic>> {
        match self.convert {
            Some(Conversion::Ports) => ports(key, v, source),
            Some(Conversion::PortSources) => port_sources(key, v, source),
            None => self.typed(key, &self.ty, v, source),
        }
    }

    fn typed(
        &self,
        key: &str,
        ty: &AttrType,
        v: &Spanned<DeValue<'_>>,
        source: &SourceFile,
    ) -> Result<Json, Box<SourceDiagnostic>> {
        let wrong = || {
            source.at(
                v.span(),
                format!(
                    "{key}: expected {}, found {}",
                    ty.expected(),
                    kind_of(v.get_ref())
                ),
            )
        };
        match (ty, v.get_ref()) {
            (AttrType::Long, DeValue::Integer(i)) => {
                let n = i64::from_str_radix(i.as_str(), i.radix()).map_err(|_| wrong())?;
                self.check_range(key, n, v.span(), source)?;
                let scaled = match self.scale {
                    None => n,
                    Some(s) => n.checked_mul(s).ok_or_else(|| {
                        source.at(
                            v.span(),
                            format!("{key}: {n} times {s} does not fit a Long"),
                        )
                    })?,
                };
                Ok(json!(scaled))
            }
            (AttrType::String, DeValue::String(s)) => {
                non_empty(key, s, v.span(), source)?;
                Ok(json!(s.as_ref()))
            }
            (AttrType::Bool, DeValue::Boolean(b)) => Ok(json!(b)),
            (AttrType::Entity(t), DeValue::String(s)) => {
                non_empty(key, s, v.span(), source)?;
                Ok(json!({"__entity": {"type": t, "id": s.as_ref()}}))
            }
            (AttrType::Set(element), DeValue::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items.iter() {
                    let value = self.typed(key, element, item, source)?;
                    if !out.contains(&value) {
                        out.push(value);
                    }
                }
                Ok(Json::Array(out))
            }
            _ => Err(wrong()),
        }
    }

    fn check_range(
        &self,
        key: &str,
        n: i64,
        span: Range<usize>,
        source: &SourceFile,
    ) -> Result<(), Box<SourceDiagnostic>> {
        let low = self.min.is_some_and(|m| n < m);
        let high = self.max.is_some_and(|m| n > m);
        if !low && !high {
            return Ok(());
        }
        let range = match (self.min, self.max) {
            (Some(lo), Some(hi)) => format!("between {lo} and {hi}"),
            (Some(lo), None) => format!("at least {lo}"),
            (None, Some(hi)) => format!("at most {hi}"),
            (None, None) => String::new(),
        };
        let why = self
            .why
            .as_deref()
            .map(|w| format!(" ({w})"))
            .unwrap_or_default();
        Err(source.at(span, format!("{key} must be {range}, found {n}{why}")))
    }
}

fn non_empty(
    key: &str,
    s: &str,
    span: Range<usize>,
    source: &SourceFile,
) -> Result<(), Box<SourceDiagnostic>> {
    if s.trim().is_empty() {
        return Err(source.at(span, format!("{key} must not be empty")));
    }
    Ok(())
}

/// A port (`22`) or an inclusive range (`"30000-32767"`), each expanded.
fn ports(
    key: &str,
    v: &Spanned<DeValue<'_>>,
    source: &SourceFile,
) -> Result<Json, Box<SourceDiagnostic>> {
    let DeValue::Array(items) = v.get_ref() else {
        return Err(source.at(
            v.span(),
            format!(
                "{key}: expected an array of ports and \"FROM-TO\" ranges, found {}",
                kind_of(v.get_ref())
            ),
        ));
    };
    let mut out: Vec<u16> = Vec::new();
    for item in items.iter() {
        let bad = || {
            source.at(
                item.span(),
                format!(
                    "{key}: expected a port (1-65535) or a range \"FROM-TO\", found {}",
                    shown(item.get_ref())
                ),
            )
        };
        let port = |n: i64| u16::try_from(n).ok().filter(|p| *p > 0);
        let (a, b) = match item.get_ref() {
            DeValue::Integer(i) => {
                let p = i64::from_str_radix(i.as_str(), i.radix())
                    .ok()
                    .and_then(port)
                    .ok_or_else(bad)?;
                (p, p)
            }
            DeValue::String(s) => {
                let (a, b) = s.split_once('-').ok_or_else(bad)?;
                let a = a
                    .trim()
                    .parse::<i64>()
                    .ok()
                    .and_then(port)
                    .ok_or_else(bad)?;
                let b = b
                    .trim()
                    .parse::<i64>()
                    .ok()
                    .and_then(port)
                    .ok_or_else(bad)?;
                if a > b {
                    return Err(bad());
                }
                (a, b)
            }
            _ => return Err(bad()),
        };
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(json!(out))
}

/// `"tcp/10250" = ["10.0.0.0/8"]` into `"tcp/10250 10.0.0.0/8"`.
fn port_sources(
    key: &str,
    v: &Spanned<DeValue<'_>>,
    source: &SourceFile,
) -> Result<Json, Box<SourceDiagnostic>> {
    let DeValue::Table(entries) = v.get_ref() else {
        return Err(source.at(
            v.span(),
            format!(
                "{key}: expected a table of \"tcp/PORT\" = [prefixes], found {}",
                kind_of(v.get_ref())
            ),
        ));
    };
    let mut out = Vec::new();
    for (port, prefixes) in entries.iter() {
        let port_key: &str = port.get_ref();
        let ok_key = port_key.split_once('/').is_some_and(|(p, n)| {
            matches!(p, "tcp" | "udp") && n.parse::<u16>().is_ok_and(|n| n > 0)
        });
        if !ok_key {
            return Err(source.at(
                port.span(),
                format!("{key}: {port_key:?} is not \"tcp/PORT\" or \"udp/PORT\""),
            ));
        }
        let DeValue::Array(list) = prefixes.get_ref() else {
            return Err(source.at(
                prefixes.span(),
                format!("{key}.{port_key}: expected an array of address prefixes"),
            ));
        };
        for p in list.iter() {
            match p.get_ref() {
                DeValue::String(s) if is_prefix(s) => out.push(format!("{port_key} {s}")),
                other => {
                    return Err(source.at(
                        p.span(),
                        format!(
                            "{key}.{port_key}: {} is not an address prefix (10.0.0.0/8, fd00::/8)",
                            shown(other)
                        ),
                    ));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(json!(out))
}

/// `ADDRESS/BITS` with an IPv4 or IPv6 address and a length that fits it.
fn is_prefix(s: &str) -> bool {
    let Some((addr, bits)) = s.split_once('/') else {
        return false;
    };
    let Ok(bits) = bits.parse::<u8>() else {
        return false;
    };
    match addr.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(_)) => bits <= 32,
        Ok(std::net::IpAddr::V6(_)) => bits <= 128,
        Err(_) => false,
    }
}

/// An entity id from a TOML key: not empty, no control characters, at most 253 bytes.
fn check_id(id: &str) -> Result<(), &'static str> {
    if id.trim().is_empty() {
        return Err("an id must not be empty");
    }
    if id.len() > 253 {
        return Err("an id is at most 253 bytes");
    }
    if id.chars().any(char::is_control) {
        return Err("an id holds no control characters");
    }
    Ok(())
}

fn lookup<'a, 'i>(
    base: &'a Spanned<DeValue<'i>>,
    path: &[String],
) -> Option<&'a Spanned<DeValue<'i>>> {
    let mut at = base;
    for segment in path {
        let DeValue::Table(t) = at.get_ref() else {
            return None;
        };
        at = t.get(segment.as_str())?;
    }
    Some(at)
}

/// Refuses the first key that no attribute claims.
fn unclaimed(
    value: &Spanned<DeValue<'_>>,
    at: &mut Vec<String>,
    claimed: &[Vec<String>],
    source: &SourceFile,
) -> Result<(), Box<SourceDiagnostic>> {
    let DeValue::Table(t) = value.get_ref() else {
        return Ok(());
    };
    for (key, child) in t.iter() {
        at.push(key.get_ref().to_string());
        if !claimed.iter().any(|c| c == at) {
            let is_prefix = claimed.iter().any(|c| c.starts_with(at));
            if !is_prefix || !matches!(child.get_ref(), DeValue::Table(_)) {
                return Err(source.at(
                    key.span(),
                    format!(
                        "unknown setting {}: no attribute of the schema is read from it (@toml)",
                        at.join(".")
                    ),
                ));
            }
            unclaimed(child, at, claimed, source)?;
        }
        at.pop();
    }
    Ok(())
}

fn entity_json(entity_type: &str, id: &str, attrs: Map<String, Json>) -> Json {
    json!({"uid": {"type": entity_type, "id": id}, "attrs": attrs, "parents": []})
}

fn kind_of(v: &DeValue<'_>) -> &'static str {
    match v {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date-time",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}

fn shown(v: &DeValue<'_>) -> String {
    match v {
        DeValue::String(s) => format!("{:?}", s.as_ref()),
        DeValue::Integer(i) => i.to_string(),
        DeValue::Float(f) => f.to_string(),
        DeValue::Boolean(b) => b.to_string(),
        other => kind_of(other).to_owned(),
    }
}

fn annotation<'a>(decl: &'a Json, key: &str) -> Option<&'a str> {
    decl.get("annotations")?.get(key)?.as_str()
}

/// Where `needle` first appears in the schema, so a problem points at its annotation.
fn locate_in_schema(file: &SourceFile, needle: Option<&str>, what: String) -> SourceDiagnostic {
    let offset = needle.and_then(|n| file.text.find(n)).unwrap_or(0);
    let len = needle.map_or(0, str::len);
    SourceDiagnostic::new(&file.name, &file.text, offset, len, what)
}

/// Resolves schema types in one namespace's JSON.
struct TypeResolver<'a> {
    namespace: &'a Json,
}

impl TypeResolver<'_> {
    fn resolve(&self, decl: &Json) -> Option<AttrType> {
        self.resolve_depth(decl, 0)
    }

    fn resolve_depth(&self, decl: &Json, depth: usize) -> Option<AttrType> {
        if depth > 8 {
            return None;
        }
        let name = decl.get("name").and_then(Json::as_str);
        match decl.get("type").and_then(Json::as_str)? {
            "Long" => Some(AttrType::Long),
            "String" => Some(AttrType::String),
            "Boolean" | "Bool" => Some(AttrType::Bool),
            "Set" => Some(AttrType::Set(Box::new(
                self.resolve_depth(decl.get("element")?, depth + 1)?,
            ))),
            "Entity" => Some(AttrType::Entity(name?.to_owned())),
            "EntityOrCommon" => {
                let name = name?;
                if let Some(common) = self.namespace.get("commonTypes").and_then(|c| c.get(name)) {
                    return self.resolve_depth(common, depth + 1);
                }
                if self
                    .namespace
                    .get("entityTypes")
                    .is_some_and(|e| e.get(name).is_some())
                {
                    return Some(AttrType::Entity(name.to_owned()));
                }
                match name.trim_start_matches("__cedar::") {
                    "Long" => Some(AttrType::Long),
                    "String" => Some(AttrType::String),
                    "Bool" => Some(AttrType::Bool),
                    _ => None,
                }
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
