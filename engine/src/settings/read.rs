//! Reading one configured entity: its attributes by type, conversions, port sets and ids,
//! each problem located in probity.toml or the schema.

use serde_json::{Map, Value as Json, json};
use toml::Spanned;
use toml::de::DeValue;

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

use super::*;

impl ConfigType {
    /// The attributes of one entity, read under `base` (a table at path `at`).
    pub(super) fn read_attrs(
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
    pub(super) fn convert_value(
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

    pub(super) fn typed(
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
                if let Some(allowed) = &self.one_of
                    && !allowed.iter().any(|a| a == s.as_ref())
                {
                    let why = self
                        .why
                        .as_deref()
                        .map(|w| format!(" ({w})"))
                        .unwrap_or_default();
                    return Err(source.at(
                        v.span(),
                        format!(
                            "{key} must be one of {}, found {:?}{why}",
                            allowed.join(", "),
                            s.as_ref()
                        ),
                    ));
                }
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

    pub(super) fn check_range(
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

pub(super) fn non_empty(
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
pub(super) fn ports(
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
pub(super) fn port_sources(
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
pub(super) fn is_prefix(s: &str) -> bool {
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
pub(super) fn check_id(id: &str) -> Result<(), &'static str> {
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

pub(super) fn lookup<'a, 'i>(
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
pub(super) fn unclaimed(
    value: &Spanned<DeValue<'_>>,
    at: &mut Vec<String>,
    claimed: &[Vec<String>],
    source: &SourceFile,
) -> Result<(), Box<SourceDiagnostic>> {
    let DeValue::Table(t) = value.get_ref() else {
        return Ok(());
    };
    for (key, child) in t.iter() {
        // Policy modes are read by `crate::modes`, not through the schema.
        if at.is_empty() && crate::modes::MODE_TABLES.contains(&key.get_ref().as_ref()) {
            continue;
        }
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

pub(super) fn entity_json(entity_type: &str, id: &str, attrs: Map<String, Json>) -> Json {
    json!({"uid": {"type": entity_type, "id": id}, "attrs": attrs, "parents": []})
}

pub(super) fn kind_of(v: &DeValue<'_>) -> &'static str {
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

pub(super) fn shown(v: &DeValue<'_>) -> String {
    match v {
        DeValue::String(s) => format!("{:?}", s.as_ref()),
        DeValue::Integer(i) => i.to_string(),
        DeValue::Float(f) => f.to_string(),
        DeValue::Boolean(b) => b.to_string(),
        other => kind_of(other).to_owned(),
    }
}

pub(super) fn annotation<'a>(decl: &'a Json, key: &str) -> Option<&'a str> {
    decl.get("annotations")?.get(key)?.as_str()
}

/// Where `needle` first appears in the schema, so a problem points at its annotation.
pub(super) fn locate_in_schema(
    file: &SourceFile,
    needle: Option<&str>,
    what: String,
) -> SourceDiagnostic {
    let offset = needle.and_then(|n| file.text.find(n)).unwrap_or(0);
    let len = needle.map_or(0, str::len);
    SourceDiagnostic::new(&file.name, &file.text, offset, len, what)
}

/// Resolves schema types in one namespace's JSON.
pub(super) struct TypeResolver<'a> {
    pub(super) namespace: &'a Json,
}

impl TypeResolver<'_> {
    pub(super) fn resolve(&self, decl: &Json) -> Option<AttrType> {
        self.resolve_depth(decl, 0)
    }

    pub(super) fn resolve_depth(&self, decl: &Json, depth: usize) -> Option<AttrType> {
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
