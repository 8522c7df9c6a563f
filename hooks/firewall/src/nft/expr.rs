//! A rule's expressions, match operands and values, read from their JSON.

use serde_json::Value as Json;

use super::read::{compact, shape, single_key};
use super::{Expr, Match, MatchOp, NftParseError, Operand, Value, VmapData};

fn target(body: &Json, path: &dyn Fn() -> String) -> Result<String, NftParseError> {
    match body.get("target") {
        Some(Json::String(s)) => Ok(s.clone()),
        _ => Err(shape(&path(), "missing \"target\" or not a string")),
    }
}

/// `path` is built only when an error needs it: most dumps have none.
pub(super) fn expr(v: &Json, path: &dyn Fn() -> String) -> Result<Expr, NftParseError> {
    let Some((key, body)) = single_key(v) else {
        return Ok(Expr::Opaque(compact(v)));
    };
    let path = || format!("{}/{key}", path());
    Ok(match key {
        "match" => {
            let op = match body.get("op").and_then(Json::as_str) {
                Some("==") => MatchOp::Eq,
                Some("!=") => MatchOp::Ne,
                Some("in") => MatchOp::In,
                Some("<") => MatchOp::Lt,
                Some(">") => MatchOp::Gt,
                Some("<=") => MatchOp::Le,
                Some(">=") => MatchOp::Ge,
                Some(other) => MatchOp::Other(other.to_owned()),
                None => return Err(shape(&path(), "missing \"op\"")),
            };
            let (Some(left), Some(right)) = (body.get("left"), body.get("right")) else {
                return Err(shape(&path(), "missing \"left\" or \"right\""));
            };
            Expr::Match(Match {
                op,
                left: operand(left),
                right: value(right),
            })
        }
        "accept" => Expr::Accept,
        "drop" => Expr::Drop,
        "continue" => Expr::Continue,
        "return" => Expr::Return,
        "jump" => Expr::Jump {
            target: target(body, &path)?,
        },
        "goto" => Expr::Goto {
            target: target(body, &path)?,
        },
        "reject" => Expr::Reject {
            kind: body.get("type").and_then(Json::as_str).map(str::to_owned),
        },
        "queue" => Expr::Queue,
        "counter" => Expr::Counter,
        "log" => Expr::Log {
            prefix: body.get("prefix").and_then(Json::as_str).map(str::to_owned),
        },
        "limit" | "quota" | "ct count" | "meter" | "connlimit" => Expr::Stateful {
            name: key.to_owned(),
        },
        "snat" | "dnat" | "masquerade" | "redirect" => Expr::Nat {
            kind: key.to_owned(),
        },
        "vmap" => {
            let key_op = body
                .get("key")
                .map(operand)
                .ok_or_else(|| shape(&path(), "missing \"key\""))?;
            let data = match body.get("data") {
                Some(Json::String(s)) if s.starts_with('@') => {
                    VmapData::Named(s.trim_start_matches('@').to_owned())
                }
                Some(d) => match d.get("set").and_then(Json::as_array) {
                    Some(pairs) => {
                        let mut out = Vec::with_capacity(pairs.len());
                        for (i, p) in pairs.iter().enumerate() {
                            match p.as_array().map(Vec::as_slice) {
                                Some([k, verdict]) => out.push((
                                    value(k),
                                    expr(verdict, &|| format!("{}/data/set/{i}/1", path()))?,
                                )),
                                _ => {
                                    out.push((Value::Opaque(compact(p)), Expr::Opaque(compact(p))))
                                }
                            }
                        }
                        VmapData::Elements(out)
                    }
                    None => VmapData::Opaque(compact(d)),
                },
                None => return Err(shape(&path(), "missing \"data\"")),
            };
            Expr::Vmap { key: key_op, data }
        }
        "xt" => Expr::Xt {
            kind: body
                .get("type")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_owned(),
            name: body
                .get("name")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_owned(),
        },
        "mangle" | "notrack" | "set" | "dup" | "fwd" | "secmark" | "flow" | "ct helper"
        | "ct timeout" | "ct expectation" | "tproxy" => Expr::Statement {
            name: key.to_owned(),
        },
        _ => Expr::Opaque(compact(v)),
    })
}

fn operand(v: &Json) -> Operand {
    let Some((key, body)) = single_key(v) else {
        return Operand::Opaque(compact(v));
    };
    let text = |k: &str| body.get(k).and_then(Json::as_str).map(str::to_owned);
    match key {
        "payload" => match (text("protocol"), text("field")) {
            (Some(protocol), Some(field)) => Operand::Payload { protocol, field },
            _ => Operand::Opaque(compact(v)),
        },
        "meta" => match text("key") {
            Some(key) => Operand::Meta { key },
            None => Operand::Opaque(compact(v)),
        },
        // A directional ct key (`ct original saddr`) is not the connection state.
        "ct" if body.get("dir").is_none() => match text("key") {
            Some(key) => Operand::Ct { key },
            None => Operand::Opaque(compact(v)),
        },
        "fib" => Operand::Fib {
            result: text("result").unwrap_or_default(),
            flags: match body.get("flags") {
                Some(Json::Array(a)) => a
                    .iter()
                    .filter_map(Json::as_str)
                    .map(str::to_owned)
                    .collect(),
                Some(Json::String(s)) => vec![s.clone()],
                _ => Vec::new(),
            },
        },
        "&" | "|" | "^" | "<<" | ">>" => match body.as_array().map(Vec::as_slice) {
            Some([l, r]) => Operand::Bitwise {
                op: key.to_owned(),
                left: Box::new(operand(l)),
                right: value(r),
            },
            _ => Operand::Opaque(compact(v)),
        },
        "concat" => match body.as_array() {
            Some(parts) => Operand::Concat(parts.iter().map(operand).collect()),
            None => Operand::Opaque(compact(v)),
        },
        _ => Operand::Opaque(compact(v)),
    }
}

pub(super) fn value(v: &Json) -> Value {
    match v {
        Json::Number(n) => n
            .as_u64()
            .map(Value::Number)
            .unwrap_or_else(|| Value::Opaque(compact(v))),
        Json::String(s) => match s.strip_prefix('@') {
            Some(name) => Value::SetRef(name.to_owned()),
            None => Value::Text(s.clone()),
        },
        Json::Array(a) => Value::List(a.iter().map(value).collect()),
        Json::Object(_) => {
            let Some((key, body)) = single_key(v) else {
                return Value::Opaque(compact(v));
            };
            match key {
                "set" => match body {
                    Json::Array(a) => Value::Set(a.iter().map(value).collect()),
                    single => Value::Set(vec![value(single)]),
                },
                "range" => match body.as_array().map(Vec::as_slice) {
                    Some([a, b]) => Value::Range(Box::new(value(a)), Box::new(value(b))),
                    _ => Value::Opaque(compact(v)),
                },
                "prefix" => match (
                    body.get("addr").and_then(Json::as_str),
                    body.get("len")
                        .and_then(Json::as_u64)
                        .and_then(|l| u8::try_from(l).ok()),
                ) {
                    (Some(addr), Some(len)) => Value::Prefix {
                        addr: addr.to_owned(),
                        len,
                    },
                    _ => Value::Opaque(compact(v)),
                },
                "concat" => match body.as_array() {
                    Some(parts) => Value::Concat(parts.iter().map(value).collect()),
                    None => Value::Opaque(compact(v)),
                },
                // A set element with a timeout or comment: `{"elem": {"val": ..}}`.
                "elem" => match body.get("val") {
                    Some(inner) => value(inner),
                    None => Value::Opaque(compact(v)),
                },
                _ => Value::Opaque(compact(v)),
            }
        }
        Json::Null | Json::Bool(_) => Value::Opaque(compact(v)),
    }
}
