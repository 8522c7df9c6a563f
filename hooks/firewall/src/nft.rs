//! `nft -j list ruleset` as nftables 1.0.6 prints it: tables, chains, rules and named sets.
//!
//! Why this module exists: nftables is what decides which packets a node accepts, and its
//! JSON output is the only form of the ruleset meant for programs. The bytes come from a
//! command whose output a hostile or broken host controls, so the parser has a size limit,
//! never panics, and says where the input went wrong (a JSON path like
//! `/nftables/7/rule/expr/1`).
//!
//! The model covers what the reduction needs and keeps everything else explicitly opaque
//! rather than failing: an expression, operand or value this module does not understand
//! becomes an `Opaque` holding its compact JSON, so the reduction can count it as an
//! uncertainty and the rule it came from stays visible. Tables of the families `netdev`,
//! `bridge` and `arp` are recognised and set aside by the reduction.

use std::fmt;

use serde_json::{Map, Value as Json};
use thiserror::Error;

/// Largest dump [`parse`] accepts: 32 MiB, three times the largest ruleset seen in practice.
pub const DEFAULT_MAX_BYTES: usize = 32 << 20;

/// Why an `nft -j` dump was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NftParseError {
    /// More bytes than the limit.
    #[error("nft JSON is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Bytes given.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// Not JSON.
    #[error("nft JSON does not parse at line {line}, column {column}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// JSON, but not the shape `nft -j` prints.
    #[error("nft JSON at {path}: {problem}")]
    Shape {
        /// Where, as a JSON pointer (`/nftables/3/chain/family`).
        path: String,
        /// What is wrong.
        problem: String,
    },
}

/// An nftables address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TableFamily {
    /// `ip`: IPv4 only.
    Ip,
    /// `ip6`: IPv6 only.
    Ip6,
    /// `inet`: both.
    Inet,
    /// `arp`: set aside.
    Arp,
    /// `bridge`: set aside.
    Bridge,
    /// `netdev`: set aside.
    Netdev,
}

impl TableFamily {
    /// The name nft uses.
    pub fn name(self) -> &'static str {
        match self {
            TableFamily::Ip => "ip",
            TableFamily::Ip6 => "ip6",
            TableFamily::Inet => "inet",
            TableFamily::Arp => "arp",
            TableFamily::Bridge => "bridge",
            TableFamily::Netdev => "netdev",
        }
    }

    fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "ip" => TableFamily::Ip,
            "ip6" => TableFamily::Ip6,
            "inet" => TableFamily::Inet,
            "arp" => TableFamily::Arp,
            "bridge" => TableFamily::Bridge,
            "netdev" => TableFamily::Netdev,
            _ => return None,
        })
    }
}

impl fmt::Display for TableFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A parsed `nft -j list ruleset` (or `list table`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ruleset {
    /// The `metainfo` object, when present.
    pub metainfo: Option<Metainfo>,
    /// Tables in dump order.
    pub tables: Vec<Table>,
    /// Chains in dump order.
    pub chains: Vec<Chain>,
    /// Rules in dump order (which is chain order within a chain).
    pub rules: Vec<Rule>,
    /// Named sets and maps.
    pub sets: Vec<Set>,
    /// Top-level objects of other kinds (flowtables, named counters, ct helpers...), as
    /// their kind and compact JSON.
    pub others: Vec<(String, String)>,
}

/// Which nft printed the dump.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metainfo {
    /// `version`, e.g. `1.0.6`.
    pub version: Option<String>,
    /// `json_schema_version`.
    pub json_schema_version: Option<u64>,
}

/// A table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Family.
    pub family: TableFamily,
    /// Name.
    pub name: String,
    /// Kernel handle.
    pub handle: Option<u64>,
}

/// A chain; base chains carry their hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Family of its table.
    pub family: TableFamily,
    /// Its table.
    pub table: String,
    /// Name.
    pub name: String,
    /// Kernel handle.
    pub handle: Option<u64>,
    /// Present for base chains.
    pub base: Option<BaseChain>,
}

/// What makes a chain a base chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseChain {
    /// `filter`, `nat` or `route`.
    pub kind: String,
    /// `input`, `prerouting`, `ingress`, ...
    pub hook: String,
    /// Priority; lower runs first.
    pub priority: i64,
    /// What happens to packets that reach the end.
    pub policy: Policy,
}

/// A base chain's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Accept (nft's default).
    Accept,
    /// Drop.
    Drop,
}

/// A rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Family of its table.
    pub family: TableFamily,
    /// Its table.
    pub table: String,
    /// Its chain.
    pub chain: String,
    /// Kernel handle.
    pub handle: Option<u64>,
    /// `comment`, when set.
    pub comment: Option<String>,
    /// Expressions and statements, in order.
    pub exprs: Vec<Expr>,
}

/// One expression or statement of a rule.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// `match`: a comparison that must hold for the rule to go on.
    Match(Match),
    /// `accept`.
    Accept,
    /// `drop`.
    Drop,
    /// `reject`, with its type (`tcp reset`, `icmpx`...).
    Reject {
        /// The reject type, when given.
        kind: Option<String>,
    },
    /// `jump`.
    Jump {
        /// Target chain.
        target: String,
    },
    /// `goto`.
    Goto {
        /// Target chain.
        target: String,
    },
    /// `return`.
    Return,
    /// `continue`.
    Continue,
    /// `queue`: the verdict is left to a user-space program.
    Queue,
    /// `counter`.
    Counter,
    /// `log`.
    Log {
        /// Log prefix, when set.
        prefix: Option<String>,
    },
    /// A stateful matcher whose outcome depends on traffic (`limit`, `quota`, `ct count`,
    /// `meter`), by its key.
    Stateful {
        /// The JSON key.
        name: String,
    },
    /// A NAT statement (`snat`, `dnat`, `masquerade`, `redirect`): ends the chain like an
    /// accept.
    Nat {
        /// The JSON key.
        kind: String,
    },
    /// A verdict map: the key selects the verdict.
    Vmap {
        /// What is looked up.
        key: Operand,
        /// The map.
        data: VmapData,
    },
    /// An iptables-nft extension (`xt`): nft cannot show what it matches or does.
    Xt {
        /// `match` or `target`.
        kind: String,
        /// Extension name (`multiport`, `conntrack`, `comment`, `REJECT`, `LOG`, ...).
        name: String,
    },
    /// A statement with effects but no verdict and no condition (`mangle`, `notrack`,
    /// `set` updates, `dup`, ...), by its key.
    Statement {
        /// The JSON key.
        name: String,
    },
    /// Anything else, as compact JSON.
    Opaque(String),
}

/// A `match` expression.
#[derive(Debug, Clone, PartialEq)]
pub struct Match {
    /// The comparison.
    pub op: MatchOp,
    /// What is compared.
    pub left: Operand,
    /// What it is compared with.
    pub right: Value,
}

/// A comparison operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchOp {
    /// `==` (also set membership when the right side is a set).
    Eq,
    /// `!=`.
    Ne,
    /// `in`: any of the given flags (bitmask match).
    In,
    /// `<`.
    Lt,
    /// `>`.
    Gt,
    /// `<=`.
    Le,
    /// `>=`.
    Ge,
    /// Another operator.
    Other(String),
}

/// The left side of a match: a packet or metadata field.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    /// A header field: `tcp dport`, `ip saddr`, `th dport`...
    Payload {
        /// Header (`tcp`, `udp`, `th`, `ip`, `ip6`, `icmpv6`...).
        protocol: String,
        /// Field (`dport`, `saddr`...).
        field: String,
    },
    /// `meta` key: `iif`, `iifname`, `l4proto`, `nfproto`...
    Meta {
        /// The key.
        key: String,
    },
    /// Conntrack key: `state`, `status`, `mark`...
    Ct {
        /// The key.
        key: String,
    },
    /// FIB lookup: `fib daddr type`.
    Fib {
        /// `type`, `oif`, `oifname`.
        result: String,
        /// `saddr`, `daddr`, `iif`, ...
        flags: Vec<String>,
    },
    /// A bitwise operation on an operand, e.g. `tcp flags & (syn | ack)`.
    Bitwise {
        /// `&`, `|`, `^`, `<<`, `>>`.
        op: String,
        /// The operand.
        left: Box<Operand>,
        /// The mask or shift.
        right: Value,
    },
    /// A concatenation: `ip saddr . tcp dport`.
    Concat(Vec<Operand>),
    /// Anything else, as compact JSON.
    Opaque(String),
}

/// A value on the right of a match, in a set, or a map key.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A number.
    Number(u64),
    /// A string: an address, an interface, a symbolic constant (`established`, `tcp`).
    Text(String),
    /// `@name`: a named set.
    SetRef(String),
    /// `{"range": [a, b]}`.
    Range(Box<Value>, Box<Value>),
    /// `{"prefix": {"addr": .., "len": ..}}`.
    Prefix {
        /// Network address as printed.
        addr: String,
        /// Length.
        len: u8,
    },
    /// An anonymous set: `{"set": [...]}`.
    Set(Vec<Value>),
    /// A plain JSON list: flags OR-ed together (`["established", "related"]`).
    List(Vec<Value>),
    /// A concatenation of values.
    Concat(Vec<Value>),
    /// Anything else, as compact JSON.
    Opaque(String),
}

/// A verdict map's contents.
#[derive(Debug, Clone, PartialEq)]
pub enum VmapData {
    /// Anonymous: key → verdict.
    Elements(Vec<(Value, Expr)>),
    /// `@name`: a named map.
    Named(String),
    /// Anything else, as compact JSON.
    Opaque(String),
}

/// A named set or map.
#[derive(Debug, Clone, PartialEq)]
pub struct Set {
    /// Family of its table.
    pub family: TableFamily,
    /// Its table.
    pub table: String,
    /// Name.
    pub name: String,
    /// Key type; several for a concatenation (`ipv4_addr . inet_service`).
    pub key_type: Vec<String>,
    /// Flags: `interval`, `constant`, `dynamic`, `timeout`...
    pub flags: Vec<String>,
    /// For a map, its data type (`verdict`, ...).
    pub map: Option<String>,
    /// Elements (keys).
    pub elements: Vec<Value>,
    /// For a verdict map, the verdict of each element, in the same order.
    pub verdicts: Vec<Expr>,
}

impl Set {
    /// Whether the kernel may add or drop elements at run time (so the dump is a moment's
    /// view): flags `dynamic` or `timeout`.
    pub fn is_dynamic(&self) -> bool {
        self.flags.iter().any(|f| f == "dynamic" || f == "timeout")
    }
}

impl Ruleset {
    /// The named set or map `name` of table `family table`.
    pub fn set(&self, family: TableFamily, table: &str, name: &str) -> Option<&Set> {
        self.sets
            .iter()
            .find(|s| s.family == family && s.table == table && s.name == name)
    }

    /// Whether a rule of table `family table` holds an `xt` expression, the sign of a
    /// table managed by iptables-nft.
    pub fn table_uses_xt(&self, family: TableFamily, table: &str) -> bool {
        self.rules
            .iter()
            .filter(|r| r.family == family && r.table == table)
            .any(|r| r.exprs.iter().any(|e| matches!(e, Expr::Xt { .. })))
    }
}

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

fn shape(path: &str, problem: &str) -> NftParseError {
    NftParseError::Shape {
        path: if path.is_empty() {
            "/".to_owned()
        } else {
            path.to_owned()
        },
        problem: problem.to_owned(),
    }
}

fn single_key(v: &Json) -> Option<(&str, &Json)> {
    let obj = v.as_object()?;
    if obj.len() != 1 {
        return None;
    }
    obj.iter().next().map(|(k, v)| (k.as_str(), v))
}

fn compact(v: &Json) -> String {
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

fn target(body: &Json, path: &dyn Fn() -> String) -> Result<String, NftParseError> {
    match body.get("target") {
        Some(Json::String(s)) => Ok(s.clone()),
        _ => Err(shape(&path(), "missing \"target\" or not a string")),
    }
}

/// `path` is built only when an error needs it: most dumps have none.
fn expr(v: &Json, path: &dyn Fn() -> String) -> Result<Expr, NftParseError> {
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

fn value(v: &Json) -> Value {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tables_chains_rules_and_sets() {
        let json = br#"{"nftables": [
            {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
            {"table": {"family": "inet", "name": "f", "handle": 1}},
            {"set": {"family": "inet", "name": "iv", "table": "f", "type": "inet_service",
                     "flags": ["interval"], "elem": [{"range": [8000, 8100]}, 9000]}},
            {"chain": {"family": "inet", "table": "f", "name": "input", "handle": 1,
                       "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}},
            {"chain": {"family": "inet", "table": "f", "name": "sub", "handle": 2}},
            {"rule": {"family": "inet", "table": "f", "chain": "input", "handle": 3,
                      "comment": "ssh",
                      "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": "@iv"}},
                               {"counter": {"packets": 0, "bytes": 0}},
                               {"xt": {"type": "match", "name": "multiport"}},
                               {"frobnicate": {"x": 1}},
                               {"jump": {"target": "sub"}}]}},
            {"flowtable": {"family": "inet", "name": "ft", "table": "f"}}
        ]}"#;
        let rs = parse(json).unwrap();
        assert_eq!(
            rs.metainfo.as_ref().unwrap().version.as_deref(),
            Some("1.0.6")
        );
        assert_eq!(rs.chains[0].base.as_ref().unwrap().policy, Policy::Drop);
        assert!(rs.chains[1].base.is_none());
        let r = &rs.rules[0];
        assert_eq!(r.comment.as_deref(), Some("ssh"));
        assert!(matches!(&r.exprs[0], Expr::Match(m) if m.right == Value::SetRef("iv".into())));
        assert_eq!(r.exprs[1], Expr::Counter);
        assert!(matches!(&r.exprs[2], Expr::Xt { name, .. } if name == "multiport"));
        assert_eq!(r.exprs[3], Expr::Opaque(r#"{"frobnicate":{"x":1}}"#.into()));
        assert_eq!(
            r.exprs[4],
            Expr::Jump {
                target: "sub".into()
            }
        );
        let s = rs.set(TableFamily::Inet, "f", "iv").unwrap();
        assert_eq!(s.elements.len(), 2);
        assert!(rs.table_uses_xt(TableFamily::Inet, "f"));
        assert_eq!(rs.others[0].0, "flowtable");
    }

    #[test]
    fn errors_say_where() {
        let e = parse(br#"{"nftables": [{"table": {"family": "inet"}}]}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "nft JSON at /nftables/0/table: missing \"name\""
        );
        let e =
            parse(br#"{"nftables": [{"chain": {"family": "ipx", "table": "t", "name": "c"}}]}"#)
                .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("nft JSON at /nftables/0/chain/family: unknown family")
        );
        let e = parse(b"{\"nftables\": [\n  {\"table\": }]}").unwrap_err();
        assert!(matches!(e, NftParseError::Json { line: 2, .. }), "{e}");
        let e = parse_with_limit(&[b' '; 100], 10).unwrap_err();
        assert_eq!(
            e.to_string(),
            "nft JSON is 100 bytes, more than the limit of 10"
        );
    }
}
