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

use thiserror::Error;

/// Largest dump [`parse`] accepts: 32 MiB, three times the largest ruleset seen in practice.
pub const DEFAULT_MAX_BYTES: usize = 32 << 20;

mod expr;
mod read;
#[cfg(test)]
mod tests;

pub use read::{parse, parse_with_limit};

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
