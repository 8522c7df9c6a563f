//! The dump read item by item into a `Ruleset`, each error naming its JSON path.

use serde_json::{Map, Value as Json};

use super::expr::{expr, value};
use super::{
    BaseChain, Chain, DEFAULT_MAX_BYTES, Expr, Metainfo, NftParseError, Policy, Rule, Ruleset, Set,
    Table, TableFamily, Value,
};

/// Parses `nft -j` output, refusing more than [`DEFAULT_MAX_BYTES`].
pub fn parse(bytes: &[u8]) -> Result<Ruleset, NftParseError> {
    parse_with_limit(bytes, DEFAULT_MAX_BYTES)
}

/// Parses `nft -j` output, refusing more than `limit` bytes.
pub fn parse_with_limit(bytes: &[u8], limit: usize) -> Result<Ruleset, NftParseError> {
    if bytes.len() > limit {
        return Err(NftParseError::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    let doc: Json = serde_json::from_slice(bytes).map_err(|source| NftParseError::Json {
        line: source.line(),
        column: source.column(),
        source,
    })?;
    let Some(items) = doc.get("nftables").and_then(Json::as_array) else {
        return Err(shape("", "expected an object with an \"nftables\" array"));
    };
    let mut rs = Ruleset::default();
    for (i, item) in items.iter().enumerate() {
        let path = format!("/nftables/{i}");
        let Some((kind, body)) = single_key(item) else {
            return Err(shape(&path, "expected an object with one key"));
        };
        let path = format!("{path}/{kind}");
        match kind {
            "metainfo" => {
                rs.metainfo = Some(Metainfo {
                    version: body
                        .get("version")
                        .and_then(Json::as_str)
                        .map(str::to_owned),
                    json_schema_version: body.get("json_schema_version").and_then(Json::as_u64),
                })
            }
            "table" => rs.tables.push(Table {
                family: family(body, &path)?,
                name: string(body, "name", &path)?,
                handle: body.get("handle").and_then(Json::as_u64),
            }),
            "chain" => rs.chains.push(chain(body, &path)?),
            "rule" => rs.rules.push(rule(body, &path)?),
            "set" | "map" => rs.sets.push(set(body, kind == "map", &path)?),
            other => rs.others.push((other.to_owned(), compact(body))),
        }
    }
    Ok(rs)
}

pub(super) fn shape(path: &str, problem: &str) -> NftParseError {
    NftParseError::Shape {
        path: if path.is_empty() {
            "/".to_owned()
        } else {
            path.to_owned()
        },
        problem: problem.to_owned(),
    }
}

pub(super) fn single_key(v: &Json) -> Option<(&str, &Json)> {
    let obj = v.as_object()?;
    if obj.len() != 1 {
        return None;
    }
    obj.iter().next().map(|(k, v)| (k.as_str(), v))
}

pub(super) fn compact(v: &Json) -> String {
    v.to_string()
}

fn obj<'a>(v: &'a Json, path: &str) -> Result<&'a Map<String, Json>, NftParseError> {
    v.as_object()
        .ok_or_else(|| shape(path, "expected an object"))
}

fn string(v: &Json, key: &str, path: &str) -> Result<String, NftParseError> {
    match v.get(key) {
        Some(Json::String(s)) => Ok(s.clone()),
        Some(_) => Err(shape(&format!("{path}/{key}"), "expected a string")),
        None => Err(shape(path, &format!("missing \"{key}\""))),
    }
}

fn family(v: &Json, path: &str) -> Result<TableFamily, NftParseError> {
    let name = string(v, "family", path)?;
    TableFamily::from_name(&name).ok_or_else(|| {
        shape(
            &format!("{path}/family"),
            &format!("unknown family {name:?} (ip, ip6, inet, arp, bridge, netdev)"),
        )
    })
}

fn chain(body: &Json, path: &str) -> Result<Chain, NftParseError> {
    obj(body, path)?;
    let base = match body.get("hook") {
        None => None,
        Some(h) => {
            let hook = h
                .as_str()
                .ok_or_else(|| shape(&format!("{path}/hook"), "expected a string"))?
                .to_owned();
            let policy = match body.get("policy").and_then(Json::as_str) {
                None | Some("accept") => Policy::Accept,
                Some("drop") => Policy::Drop,
                Some(other) => {
                    return Err(shape(
                        &format!("{path}/policy"),
                        &format!("unknown policy {other:?} (accept, drop)"),
                    ));
                }
            };
            Some(BaseChain {
                kind: body
                    .get("type")
                    .and_then(Json::as_str)
                    .unwrap_or("filter")
                    .to_owned(),
                hook,
                priority: priority(body.get("prio")),
                policy,
            })
        }
    };
    Ok(Chain {
        family: family(body, path)?,
        table: string(body, "table", path)?,
        name: string(body, "name", path)?,
        handle: body.get("handle").and_then(Json::as_u64),
        base,
    })
}

/// A chain priority: a number, or one of nft's standard names (which only order the
/// report: the reduction's answer does not depend on priorities).
fn priority(v: Option<&Json>) -> i64 {
    match v {
        Some(Json::Number(n)) => n.as_i64().unwrap_or(0),
        Some(Json::String(s)) => match s.as_str() {
            "raw" => -300,
            "mangle" => -150,
            "dstnat" => -100,
            "security" => 50,
            "srcnat" => 100,
            _ => 0,
        },
        _ => 0,
    }
}

fn rule(body: &Json, path: &str) -> Result<Rule, NftParseError> {
    obj(body, path)?;
    let exprs = match body.get("expr") {
        Some(Json::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, e)| expr(e, &|| format!("{path}/expr/{i}")))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(shape(&format!("{path}/expr"), "expected an array")),
        None => Vec::new(),
    };
    Ok(Rule {
        family: family(body, path)?,
        table: string(body, "table", path)?,
        chain: string(body, "chain", path)?,
        handle: body.get("handle").and_then(Json::as_u64),
        comment: body
            .get("comment")
            .and_then(Json::as_str)
            .map(str::to_owned),
        exprs,
    })
}

fn set(body: &Json, is_map: bool, path: &str) -> Result<Set, NftParseError> {
    obj(body, path)?;
    let key_type = match body.get("type") {
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(str::to_owned).unwrap_or_else(|| compact(t)))
            .collect(),
        Some(other) => vec![compact(other)],
        None => Vec::new(),
    };
    let flags = match body.get("flags") {
        Some(Json::Array(a)) => a
            .iter()
            .map(|f| f.as_str().map(str::to_owned).unwrap_or_else(|| compact(f)))
            .collect(),
        Some(Json::String(s)) => vec![s.clone()],
        _ => Vec::new(),
    };
    let map = if is_map {
        Some(
            body.get("map")
                .map(|m| m.as_str().map(str::to_owned).unwrap_or_else(|| compact(m)))
                .unwrap_or_default(),
        )
    } else {
        None
    };
    let mut elements = Vec::new();
    let mut verdicts = Vec::new();
    let elems: Vec<&Json> = match body.get("elem") {
        Some(Json::Array(a)) => a.iter().collect(),
        Some(single) => vec![single],
        None => Vec::new(),
    };
    for (i, e) in elems.into_iter().enumerate() {
        let epath = format!("{path}/elem/{i}");
        match (is_map, e) {
            (true, Json::Array(pair)) if pair.len() == 2 => {
                let (Some(k), Some(d)) = (pair.first(), pair.get(1)) else {
                    continue;
                };
                elements.push(value(k));
                verdicts.push(expr(d, &|| format!("{epath}/1"))?);
            }
            (true, other) => {
                elements.push(Value::Opaque(compact(other)));
                verdicts.push(Expr::Opaque(compact(other)));
            }
            (false, e) => elements.push(value(e)),
        }
    }
    Ok(Set {
        family: family(body, path)?,
        table: string(body, "table", path)?,
        name: string(body, "name", path)?,
        key_type,
        flags,
        map,
        elements,
        verdicts,
    })
}
