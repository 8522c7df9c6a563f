//! The baseline of a node role: what may be reachable, how to judge what is, and the
//! nftables table that enforces it.
//!
//! Why this module exists: "inbound ports beyond the baseline are violations" needs the
//! baseline as data (the lead maps configuration to a [`Baseline`]), a comparison that
//! names both directions ([`check`]: reachable beyond the baseline, and in the baseline but
//! not reachable), and a rendering that an operator can read and nft loads atomically
//! ([`render`]).
//!
//! The rendered table is `inet probity`, a table of its own, so it neither edits nor
//! depends on anyone else's rules: nftables runs every base chain on the input hook, so
//! this table narrows what the others allow and never widens it. The script creates the
//! table if missing, deletes it and creates it anew in one `nft -f` transaction, so a
//! re-apply replaces it whole or not at all.
//!
//! ```
//! use probity_firewall::baseline::{Allowance, Baseline, FamilyScope, render};
//! use probity_firewall::{PortRange, Protocol};
//! let baseline = Baseline {
//!     role: "gpu-worker".into(),
//!     allow: vec![
//!         Allowance::any(Protocol::Tcp, PortRange::single(22)),
//!         Allowance {
//!             protocol: Protocol::Tcp,
//!             ports: PortRange::single(10250),
//!             sources: vec!["10.0.0.0/8".parse().unwrap()],
//!             family: FamilyScope::Both,
//!         },
//!     ],
//! };
//! let script = render(&baseline).unwrap();
//! assert!(script.text().contains("ip saddr 10.0.0.0/8 tcp dport 10250 accept"));
//! ```

use std::fmt::Write as _;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};
use thiserror::Error;

use crate::net::{Family, PortRange, Prefix, Protocol, Ranges};
use crate::nft::{self, Expr, TableFamily, Value};
use crate::reduce::{Exposure, Reachability, Uncertainty};
use crate::space::Space;

/// The family of the table the baseline renders to.
pub const TABLE_FAMILY: &str = "inet";
/// The name of the table the baseline renders to.
pub const TABLE_NAME: &str = "probity";

/// ICMPv6 types IPv6 cannot work without (RFC 4890: errors, neighbour and router
/// discovery, multicast listener discovery) plus echo.
pub const ICMPV6_TYPES: &[&str] = &[
    "destination-unreachable",
    "packet-too-big",
    "time-exceeded",
    "parameter-problem",
    "echo-request",
    "echo-reply",
    "nd-router-solicit",
    "nd-router-advert",
    "nd-neighbor-solicit",
    "nd-neighbor-advert",
    "mld-listener-query",
    "mld-listener-report",
    "mld-listener-done",
    "mld2-listener-report",
];

/// ICMP types accepted: echo and the errors path MTU discovery and diagnostics need.
pub const ICMP_TYPES: &[&str] = &[
    "echo-request",
    "echo-reply",
    "destination-unreachable",
    "time-exceeded",
    "parameter-problem",
];

/// Which families an allowance covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FamilyScope {
    /// IPv4 and IPv6 (the default).
    #[default]
    Both,
    /// IPv4 only.
    Ipv4,
    /// IPv6 only.
    Ipv6,
}

impl FamilyScope {
    /// Whether the scope covers `family`.
    pub fn covers(self, family: Family) -> bool {
        matches!(
            (self, family),
            (FamilyScope::Both, _)
                | (FamilyScope::Ipv4, Family::Ipv4)
                | (FamilyScope::Ipv6, Family::Ipv6)
        )
    }
}

/// One thing the baseline allows: a protocol, ports, and optionally who from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allowance {
    /// `tcp` or `udp`.
    pub protocol: Protocol,
    /// A port (`22`) or a range (`"2379-2380"`).
    pub ports: PortRange,
    /// Source prefixes; empty (the default) means any source.
    #[serde(default)]
    pub sources: Vec<Prefix>,
    /// Families covered; both by default. With sources, each family gets the sources of
    /// its own family (none of its family: none allowed in it).
    #[serde(default)]
    pub family: FamilyScope,
}

impl Allowance {
    /// From any source, over both families.
    pub fn any(protocol: Protocol, ports: PortRange) -> Self {
        Self {
            protocol,
            ports,
            sources: Vec::new(),
            family: FamilyScope::Both,
        }
    }

    /// The source addresses allowed in `family` (empty when the allowance does not
    /// cover it).
    fn addrs(&self, family: Family) -> Ranges {
        if !self.family.covers(family) {
            return Ranges::empty();
        }
        let universe = family.remote_universe();
        if self.sources.is_empty() {
            return universe;
        }
        Ranges::from_unsorted(
            self.sources
                .iter()
                .filter(|p| p.family() == family)
                .map(Prefix::bounds)
                .collect(),
        )
        .intersect(&universe)
    }
}

/// What a node role may expose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    /// The role's name, e.g. `gpu-worker`: 1-64 of `A-Z a-z 0-9 . _ -`.
    pub role: String,
    /// What is allowed; nothing else is.
    #[serde(default)]
    pub allow: Vec<Allowance>,
}

/// Why a baseline cannot be rendered.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum BaselineError {
    /// The role name would not be safe in a comment of the script.
    #[error("role {role:?} must be 1-64 characters of A-Z a-z 0-9 . _ -")]
    Role {
        /// The role given.
        role: String,
    },
    /// A source prefix of a family the allowance does not cover.
    #[error(
        "allowance {index} ({protocol} {ports}): source {prefix} is not in its family scope {scope:?}"
    )]
    SourceOutsideScope {
        /// Position in `allow`.
        index: usize,
        /// Protocol.
        protocol: Protocol,
        /// Ports.
        ports: PortRange,
        /// The prefix.
        prefix: Prefix,
        /// The scope.
        scope: FamilyScope,
    },
}

impl Baseline {
    /// Checks what [`render`] needs: a safe role name, and sources within each scope.
    pub fn validate(&self) -> Result<(), BaselineError> {
        let ok = !self.role.is_empty()
            && self.role.len() <= 64
            && self
                .role
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !ok {
            return Err(BaselineError::Role {
                role: self.role.clone(),
            });
        }
        for (index, a) in self.allow.iter().enumerate() {
            if let Some(prefix) = a.sources.iter().find(|p| !a.family.covers(p.family())) {
                return Err(BaselineError::SourceOutsideScope {
                    index,
                    protocol: a.protocol,
                    ports: a.ports,
                    prefix: *prefix,
                    scope: a.family,
                });
            }
        }
        Ok(())
    }

    /// What the baseline allows for one family and protocol, as a packet space.
    fn space(&self, family: Family, protocol: Protocol) -> Space {
        let mut s = Space::empty();
        for a in self.allow.iter().filter(|a| a.protocol == protocol) {
            let ports = Ranges::from_range(u128::from(a.ports.start()), u128::from(a.ports.end()));
            s.union_with(&Space::from_box(&ports, &a.addrs(family)));
        }
        s
    }
}

/// Ports of one family and protocol, and from where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Family.
    pub family: Family,
    /// Protocol.
    pub protocol: Protocol,
    /// Ports.
    pub ports: PortRange,
    /// Sources concerned.
    pub exposure: Exposure,
}

/// The reachable ports judged against a baseline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Compliance {
    /// Reachable, but not allowed.
    pub excess: Vec<Finding>,
    /// Allowed, but not reachable.
    pub missing: Vec<Finding>,
    /// What the reduction could not decide (each may hide an excess).
    pub uncertainties: Vec<Uncertainty>,
}

impl Compliance {
    /// Nothing beyond the baseline, nothing of it missing, nothing undecided.
    pub fn is_clean(&self) -> bool {
        self.excess.is_empty() && self.missing.is_empty() && self.uncertainties.is_empty()
    }
}

/// What is reachable beyond `baseline`, and what in it is not reachable.
pub fn check(reachable: &Reachability, baseline: &Baseline) -> Compliance {
    let mut excess = Vec::new();
    let mut missing = Vec::new();
    for family in Family::ALL {
        for protocol in Protocol::ALL {
            let have = reachable.space(family, protocol);
            let allowed = baseline.space(family, protocol);
            let mut beyond = have.clone();
            beyond.subtract(&allowed);
            let mut absent = allowed;
            absent.subtract(&have);
            excess.extend(findings(family, protocol, &beyond));
            missing.extend(findings(family, protocol, &absent));
        }
    }
    Compliance {
        excess,
        missing,
        uncertainties: reachable.uncertainties.clone(),
    }
}

fn findings(family: Family, protocol: Protocol, space: &Space) -> Vec<Finding> {
    space
        .segments()
        .into_iter()
        .filter_map(|(s, e, addrs)| {
            Some(Finding {
                family,
                protocol,
                ports: PortRange::new(s, e)?,
                exposure: Exposure::from_addrs(family, &addrs),
            })
        })
        .collect()
}

/// A rendered baseline: the `nft -f` script, and what nft will print for the table once
/// it is loaded (to tell whether a re-apply would change anything).
#[derive(Debug, Clone)]
pub struct Script {
    text: String,
    baseline: Baseline,
    expected: Json,
}

impl Script {
    /// The script for `nft -f`.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The baseline it renders.
    pub fn baseline(&self) -> &Baseline {
        &self.baseline
    }

    /// The table as `nft -j list table inet probity` prints it once loaded (without
    /// handles).
    pub fn expected_json(&self) -> &Json {
        &self.expected
    }

    /// The loaded table as the reduction's input.
    pub(crate) fn expected_ruleset(&self) -> Option<nft::Ruleset> {
        nft::parse(self.expected.to_string().as_bytes()).ok()
    }
}

/// Renders `baseline` as an `nft -f` script for the table `inet probity`.
pub fn render(baseline: &Baseline) -> Result<Script, BaselineError> {
    baseline.validate()?;
    let mut lines: Vec<(String, Json)> = vec![
        (
            "iif \"lo\" accept".into(),
            json!([m("==", json!({"meta": {"key": "iif"}}), json!("lo")), {"accept": null}]),
        ),
        (
            "ct state established,related accept".into(),
            json!([m("in", json!({"ct": {"key": "state"}}), json!(["established", "related"])), {"accept": null}]),
        ),
        (
            "ct state invalid drop".into(),
            json!([m("in", json!({"ct": {"key": "state"}}), json!("invalid")), {"drop": null}]),
        ),
        (
            format!("icmpv6 type {{ {} }} accept", ICMPV6_TYPES.join(", ")),
            json!([m("==", payload("icmpv6", "type"), json!({"set": ICMPV6_TYPES})), {"accept": null}]),
        ),
        (
            format!("icmp type {{ {} }} accept", ICMP_TYPES.join(", ")),
            json!([m("==", payload("icmp", "type"), json!({"set": ICMP_TYPES})), {"accept": null}]),
        ),
    ];
    for a in &baseline.allow {
        let proto = a.protocol.name();
        let (port_text, port_json) = if a.ports.start() == a.ports.end() {
            (a.ports.start().to_string(), json!(a.ports.start()))
        } else {
            (
                format!("{}-{}", a.ports.start(), a.ports.end()),
                json!({"range": [a.ports.start(), a.ports.end()]}),
            )
        };
        let dport = m("==", payload(proto, "dport"), port_json);
        if a.sources.is_empty() {
            match a.family {
                FamilyScope::Both => lines.push((
                    format!("{proto} dport {port_text} accept"),
                    json!([dport, {"accept": null}]),
                )),
                FamilyScope::Ipv4 | FamilyScope::Ipv6 => {
                    let nfproto = if a.family == FamilyScope::Ipv4 {
                        "ipv4"
                    } else {
                        "ipv6"
                    };
                    lines.push((
                        format!("meta nfproto {nfproto} {proto} dport {port_text} accept"),
                        json!([m("==", json!({"meta": {"key": "nfproto"}}), json!(nfproto)), dport, {"accept": null}]),
                    ));
                }
            }
            continue;
        }
        for p in &a.sources {
            let (hdr, nfproto) = match p.family() {
                Family::Ipv4 => ("ip", "ipv4"),
                Family::Ipv6 => ("ip6", "ipv6"),
            };
            if p.prefix_len() == 0 {
                lines.push((
                    format!("meta nfproto {nfproto} {proto} dport {port_text} accept"),
                    json!([m("==", json!({"meta": {"key": "nfproto"}}), json!(nfproto)), dport, {"accept": null}]),
                ));
                continue;
            }
            let bits = p.family().bits();
            let src_json = if p.prefix_len() == bits {
                json!(p.addr().to_string())
            } else {
                json!({"prefix": {"addr": p.addr().to_string(), "len": p.prefix_len()}})
            };
            lines.push((
                format!("{hdr} saddr {p} {proto} dport {port_text} accept"),
                json!([m("==", payload(hdr, "saddr"), src_json), dport, {"accept": null}]),
            ));
        }
    }
    let mut text = String::new();
    let _ = writeln!(text, "#!/usr/sbin/nft -f");
    let _ = writeln!(
        text,
        "# Probity firewall baseline for role {}. Generated: applied whole, edits are replaced.",
        baseline.role
    );
    let _ = writeln!(text, "add table {TABLE_FAMILY} {TABLE_NAME}");
    let _ = writeln!(text, "delete table {TABLE_FAMILY} {TABLE_NAME}");
    let _ = writeln!(text, "table {TABLE_FAMILY} {TABLE_NAME} {{");
    let _ = writeln!(text, "\tchain input {{");
    let _ = writeln!(
        text,
        "\t\ttype filter hook input priority filter; policy drop;"
    );
    for (line, _) in &lines {
        let _ = writeln!(text, "\t\t{line}");
    }
    let _ = writeln!(text, "\t}}");
    let _ = writeln!(text, "}}");
    let mut objects = vec![
        json!({"table": {"family": TABLE_FAMILY, "name": TABLE_NAME}}),
        json!({"chain": {"family": TABLE_FAMILY, "table": TABLE_NAME, "name": "input",
                         "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}}),
    ];
    for (_, expr) in lines {
        objects.push(json!({"rule": {"family": TABLE_FAMILY, "table": TABLE_NAME, "chain": "input", "expr": expr}}));
    }
    Ok(Script {
        text,
        baseline: baseline.clone(),
        expected: json!({"nftables": objects}),
    })
}

fn m(op: &str, left: Json, right: Json) -> Json {
    json!({"match": {"op": op, "left": left, "right": right}})
}

fn payload(protocol: &str, field: &str) -> Json {
    json!({"payload": {"protocol": protocol, "field": field}})
}

/// The `inet probity` table of a ruleset, in a form where two loads of the same script
/// compare equal: no handles, no counter values, set members sorted, addresses in one
/// spelling.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TableView {
    pub(crate) chains: Vec<(String, Option<nft::BaseChain>)>,
    pub(crate) rules: Vec<(String, Vec<Expr>, Option<String>)>,
    pub(crate) sets: Vec<nft::Set>,
}

impl TableView {
    /// The table `inet probity` of `rs`, if loaded.
    pub(crate) fn of(rs: &nft::Ruleset) -> Option<TableView> {
        let ours =
            |family: TableFamily, table: &str| family == TableFamily::Inet && table == TABLE_NAME;
        rs.tables.iter().find(|t| ours(t.family, &t.name))?;
        Some(TableView {
            chains: rs
                .chains
                .iter()
                .filter(|c| ours(c.family, &c.table))
                .map(|c| (c.name.clone(), c.base.clone()))
                .collect(),
            rules: rs
                .rules
                .iter()
                .filter(|r| ours(r.family, &r.table))
                .map(|r| {
                    (
                        r.chain.clone(),
                        r.exprs.iter().map(normal_expr).collect(),
                        r.comment.clone(),
                    )
                })
                .collect(),
            sets: rs
                .sets
                .iter()
                .filter(|s| ours(s.family, &s.table))
                .cloned()
                .map(|mut s| {
                    s.elements = s.elements.iter().map(normal_value).collect();
                    s.elements.sort_by_key(|v| format!("{v:?}"));
                    s
                })
                .collect(),
        })
    }

    /// Rules and chains of `self` missing from `other`, as text.
    pub(crate) fn missing_from(&self, other: Option<&TableView>) -> Vec<String> {
        let mut out = Vec::new();
        for c in &self.chains {
            if !other.is_some_and(|o| o.chains.contains(c)) {
                out.push(match &c.1 {
                    Some(b) => format!(
                        "chain {}: type {} hook {} priority {} policy {:?}",
                        c.0, b.kind, b.hook, b.priority, b.policy
                    ),
                    None => format!("chain {}", c.0),
                });
            }
        }
        for r in &self.rules {
            if !other.is_some_and(|o| o.rules.contains(r)) {
                let rule = nft::Rule {
                    family: TableFamily::Inet,
                    table: TABLE_NAME.into(),
                    chain: r.0.clone(),
                    handle: None,
                    comment: r.2.clone(),
                    exprs: r.1.clone(),
                };
                out.push(format!(
                    "rule in {}: {}",
                    r.0,
                    crate::reduce::describe_nft_rule(&rule)
                ));
            }
        }
        for s in &self.sets {
            if !other.is_some_and(|o| o.sets.contains(s)) {
                out.push(format!("set {}", s.name));
            }
        }
        out
    }
}

fn normal_expr(e: &Expr) -> Expr {
    match e {
        Expr::Match(mt) => Expr::Match(nft::Match {
            op: mt.op.clone(),
            left: mt.left.clone(),
            right: normal_value(&mt.right),
        }),
        other => other.clone(),
    }
}

fn normal_value(v: &Value) -> Value {
    match v {
        Value::Set(items) | Value::List(items) => {
            let mut items: Vec<Value> = items.iter().map(normal_value).collect();
            items.sort_by_key(|v| format!("{v:?}"));
            if matches!(v, Value::Set(_)) {
                Value::Set(items)
            } else {
                Value::List(items)
            }
        }
        Value::Text(t) => match t.parse::<IpAddr>() {
            Ok(a) => Value::Text(a.to_string()),
            Err(_) => v.clone(),
        },
        Value::Prefix { addr, len } => match addr.parse::<IpAddr>() {
            Ok(a) => Value::Prefix {
                addr: a.to_string(),
                len: *len,
            },
            Err(_) => v.clone(),
        },
        Value::Range(a, b) => Value::Range(Box::new(normal_value(a)), Box::new(normal_value(b))),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::{Inputs, reduce};

    fn sample() -> Baseline {
        Baseline {
            role: "etcd".into(),
            allow: vec![
                Allowance::any(Protocol::Tcp, PortRange::single(22)),
                Allowance::any(Protocol::Tcp, PortRange::new(2379, 2380).unwrap()),
                Allowance {
                    protocol: Protocol::Tcp,
                    ports: PortRange::single(10250),
                    sources: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
                    family: FamilyScope::Both,
                },
                Allowance {
                    protocol: Protocol::Udp,
                    ports: PortRange::single(4789),
                    sources: vec![],
                    family: FamilyScope::Ipv4,
                },
            ],
        }
    }

    #[test]
    fn render_writes_one_atomic_script() {
        let s = render(&sample()).unwrap();
        let text = s.text();
        let add = text.find("add table inet probity").unwrap();
        let del = text.find("delete table inet probity").unwrap();
        let body = text.find("table inet probity {").unwrap();
        assert!(add < del && del < body);
        for line in [
            "type filter hook input priority filter; policy drop;",
            "iif \"lo\" accept",
            "ct state established,related accept",
            "ct state invalid drop",
            "nd-neighbor-solicit",
            "packet-too-big",
            "tcp dport 22 accept",
            "tcp dport 2379-2380 accept",
            "ip saddr 10.0.0.0/8 tcp dport 10250 accept",
            "ip6 saddr fd00::/8 tcp dport 10250 accept",
            "meta nfproto ipv4 udp dport 4789 accept",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn the_rendered_table_reduces_to_the_baseline() {
        let b = sample();
        let rs = render(&b).unwrap().expected_ruleset().unwrap();
        let r = reduce(&Inputs {
            nft: Some(&rs),
            iptables: vec![],
        });
        let c = check(&r, &b);
        assert!(c.is_clean(), "{c:#?}");
    }

    #[test]
    fn check_names_excess_and_missing() {
        let b = sample();
        let rs = nft::parse(
            br#"{"nftables": [{"table": {"family": "inet", "name": "f"}},
            {"chain": {"family": "inet", "table": "f", "name": "in", "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}},
            {"rule": {"family": "inet", "table": "f", "chain": "in", "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": {"set": [22, 2379, 8080, 10250]}}}, {"accept": null}]}}]}"#,
        )
        .unwrap();
        let r = reduce(&Inputs {
            nft: Some(&rs),
            iptables: vec![],
        });
        let c = check(&r, &b);
        let excess: Vec<String> = c
            .excess
            .iter()
            .map(|f| format!("{} {} {} {}", f.family, f.protocol, f.ports, f.exposure))
            .collect();
        assert_eq!(
            excess,
            [
                "IPv4 tcp 8080 from any source",
                "IPv4 tcp 10250 from any source except 10.0.0.0/8",
                "IPv6 tcp 8080 from any source",
                "IPv6 tcp 10250 from any source except fd00::/8",
            ]
        );
        let missing: Vec<String> = c
            .missing
            .iter()
            .map(|f| format!("{} {} {}", f.family, f.protocol, f.ports))
            .collect();
        assert_eq!(missing, ["IPv4 tcp 2380", "IPv4 udp 4789", "IPv6 tcp 2380"]);
    }

    #[test]
    fn validation_refuses_unsafe_roles_and_scopes() {
        let mut b = sample();
        b.role = "x\ndelete table inet filter".into();
        assert!(matches!(render(&b), Err(BaselineError::Role { .. })));
        let mut b = sample();
        b.allow.push(Allowance {
            protocol: Protocol::Tcp,
            ports: PortRange::single(1),
            sources: vec!["fd00::/8".parse().unwrap()],
            family: FamilyScope::Ipv4,
        });
        assert_eq!(
            render(&b).unwrap_err().to_string(),
            "allowance 4 (tcp 1): source fd00::/8 is not in its family scope Ipv4"
        );
    }

    #[test]
    fn baseline_reads_from_json_config() {
        let b: Baseline = serde_json::from_str(
            r#"{"role": "gpu-worker", "allow": [
                {"protocol": "tcp", "ports": 22},
                {"protocol": "tcp", "ports": "2379-2380", "sources": ["10.0.0.0/8"], "family": "ipv4"}]}"#,
        )
        .unwrap();
        assert_eq!(b.allow[1].ports, PortRange::new(2379, 2380).unwrap());
        assert_eq!(b.allow[1].family, FamilyScope::Ipv4);
        assert!(
            serde_json::from_str::<Baseline>(
                r#"{"role": "x", "allow": [{"protocol": "tcp", "ports": 22, "port": 1}]}"#
            )
            .is_err()
        );
    }
}
