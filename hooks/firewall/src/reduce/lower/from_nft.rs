//! nft rules lowered to the shared program, one table at a time.

use std::collections::HashMap;
use std::net::IpAddr;

use super::describe::{describe_match, describe_value};
use super::terms::{
    IfaceMatch, ct_bits, family_bits, flag_bits, implied_by_header, interface, negated_ports,
    push_any_flags, texts, xt_target,
};
use super::{LoweredTable, Origin};
use crate::net::{Family, Prefix, Ranges, to_int};
use crate::nft::{self, Expr, MatchOp, Operand, TableFamily, Value, VmapData};
use crate::reduce::ir::{Chain, Cond, Rule, Verdict, l4};

/// Lowers table `family table` of `rs`; `rules` are that table's rules, grouped by chain.
pub(crate) fn nft_table<'a>(
    rs: &'a nft::Ruleset,
    family: TableFamily,
    table: &str,
    rules_by_chain: &HashMap<&str, Vec<&'a nft::Rule>>,
    origins: &mut Vec<Origin<'a>>,
) -> LoweredTable {
    let names: Vec<String> = rs
        .chains
        .iter()
        .filter(|c| c.family == family && c.table == table)
        .map(|c| c.name.clone())
        .collect();
    let index: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let ctx = NftCtx {
        rs,
        family,
        table,
        index: &index,
    };
    let mut chains = Vec::with_capacity(names.len());
    for name in &names {
        let mut chain = Chain::default();
        for rule in rules_by_chain
            .get(name.as_str())
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let origin = origins.len();
            origins.push(Origin::Nft(rule));
            ctx.lower_rule(rule, origin, &mut chain.rules);
        }
        chains.push(chain);
    }
    LoweredTable { names, chains }
}

struct NftCtx<'a> {
    rs: &'a nft::Ruleset,
    family: TableFamily,
    table: &'a str,
    index: &'a HashMap<&'a str, usize>,
}

impl NftCtx<'_> {
    fn lower_rule(&self, rule: &nft::Rule, origin: usize, out: &mut Vec<Rule>) {
        let mut conds = Vec::new();
        let mut opaque = false;
        for e in &rule.exprs {
            let verdict = match e {
                Expr::Match(m) => {
                    self.lower_match(m, &mut conds);
                    continue;
                }
                Expr::Counter | Expr::Log { .. } | Expr::Statement { .. } => continue,
                Expr::Stateful { name } => {
                    conds.push(Cond::Unknown(format!("{name} (depends on traffic)")));
                    continue;
                }
                Expr::Xt { kind, name } if kind == "match" => {
                    conds.push(Cond::Unknown(format!(
                        "xt match {name} (an iptables-nft match nft cannot show)"
                    )));
                    continue;
                }
                Expr::Xt { name, .. } => match xt_target(name) {
                    Some(v) => v,
                    None => continue,
                },
                Expr::Opaque(json) => {
                    conds.push(Cond::Unknown(format!("expression {json}")));
                    opaque = true;
                    continue;
                }
                Expr::Vmap { key, data } => {
                    self.lower_vmap(key, data, &conds, origin, out);
                    return;
                }
                other => self.verdict(other),
            };
            out.push(Rule {
                conds,
                verdict,
                origin,
            });
            return;
        }
        // No verdict: the rule only counts or logs, unless something opaque might have been
        // a verdict.
        let verdict = if opaque {
            Verdict::MayAccept("an expression not understood may be a verdict".into())
        } else {
            Verdict::Continue
        };
        out.push(Rule {
            conds,
            verdict,
            origin,
        });
    }

    fn verdict(&self, e: &Expr) -> Verdict {
        match e {
            Expr::Accept | Expr::Nat { .. } => Verdict::Accept,
            Expr::Drop | Expr::Reject { .. } => Verdict::Drop,
            Expr::Return => Verdict::Return,
            Expr::Continue => Verdict::Continue,
            Expr::Jump { target } => match self.index.get(target.as_str()) {
                Some(&i) => Verdict::Jump(i),
                None => Verdict::MayAccept(format!("jump to missing chain {target:?}")),
            },
            Expr::Goto { target } => match self.index.get(target.as_str()) {
                Some(&i) => Verdict::Goto(i),
                None => Verdict::MayAccept(format!("goto missing chain {target:?}")),
            },
            Expr::Queue => Verdict::MayAccept("queue: a user-space program decides".into()),
            Expr::Xt { name, .. } => xt_target(name).unwrap_or(Verdict::Continue),
            other => Verdict::MayAccept(format!("verdict not understood: {other:?}")),
        }
    }

    fn lower_vmap(
        &self,
        key: &Operand,
        data: &VmapData,
        conds: &[Cond],
        origin: usize,
        out: &mut Vec<Rule>,
    ) {
        let elements: Vec<(Value, Expr)> = match data {
            VmapData::Elements(e) => e.clone(),
            VmapData::Named(name) => match self.rs.set(self.family, self.table, name) {
                Some(set) if !set.is_dynamic() && set.elements.len() == set.verdicts.len() => set
                    .elements
                    .iter()
                    .cloned()
                    .zip(set.verdicts.iter().cloned())
                    .collect(),
                _ => {
                    let mut c = conds.to_vec();
                    c.push(Cond::Unknown(format!("verdict map @{name}")));
                    out.push(Rule {
                        conds: c,
                        verdict: Verdict::MayAccept(format!("verdict map @{name} not readable")),
                        origin,
                    });
                    return;
                }
            },
            VmapData::Opaque(json) => {
                let mut c = conds.to_vec();
                c.push(Cond::Unknown(format!("verdict map {json}")));
                out.push(Rule {
                    conds: c,
                    verdict: Verdict::MayAccept("verdict map not understood".into()),
                    origin,
                });
                return;
            }
        };
        // Keys of a verdict map do not overlap, so each element is a rule of its own.
        for (k, v) in elements {
            let mut c = conds.to_vec();
            self.lower_match(
                &nft::Match {
                    op: MatchOp::Eq,
                    left: key.clone(),
                    right: k,
                },
                &mut c,
            );
            out.push(Rule {
                conds: c,
                verdict: self.verdict(&v),
                origin,
            });
        }
    }

    fn lower_match(&self, m: &nft::Match, out: &mut Vec<Cond>) {
        let unknown = |out: &mut Vec<Cond>| out.push(Cond::Unknown(describe_match(m)));
        let negate = match m.op {
            MatchOp::Eq | MatchOp::In => false,
            MatchOp::Ne => true,
            MatchOp::Lt | MatchOp::Gt | MatchOp::Le | MatchOp::Ge => false,
            MatchOp::Other(_) => {
                // Still keep what the left side implies (family, protocol).
                if let Operand::Payload { protocol, .. } = &m.left {
                    implied_by_header(protocol, out);
                }
                return unknown(out);
            }
        };
        let ordered = matches!(m.op, MatchOp::Lt | MatchOp::Gt | MatchOp::Le | MatchOp::Ge);
        match &m.left {
            Operand::Payload { protocol, field } => {
                let p = protocol.as_str();
                if !implied_by_header(p, out) {
                    return;
                }
                let transport = matches!(p, "tcp" | "udp" | "th" | "udplite" | "sctp" | "dccp");
                match (p, field.as_str()) {
                    (_, "dport") if transport => match self.ports(&m.op, &m.right) {
                        Ok(ports) => out.push(Cond::DPort(negated_ports(ports, negate))),
                        Err(why) => {
                            out.push(Cond::Unknown(format!("{} ({why})", describe_match(m))))
                        }
                    },
                    (_, "sport") if transport => match self.ports(&m.op, &m.right) {
                        Ok(ports) => out.push(Cond::SPort { ports, negate }),
                        Err(why) => {
                            out.push(Cond::Unknown(format!("{} ({why})", describe_match(m))))
                        }
                    },
                    ("ip" | "ip6", "saddr") if !ordered => {
                        let family = if p == "ip" {
                            Family::Ipv4
                        } else {
                            Family::Ipv6
                        };
                        match self.addrs(family, &m.right) {
                            Ok(addrs) => out.push(Cond::SAddr {
                                family,
                                addrs,
                                negate,
                            }),
                            Err(why) => {
                                out.push(Cond::Unknown(format!("{} ({why})", describe_match(m))))
                            }
                        }
                    }
                    ("ip", "protocol") | ("ip6", "nexthdr") if !ordered => {
                        match self.protocols(&m.right) {
                            Ok(bits) => {
                                out.push(Cond::L4(if negate { !bits & l4::BOTH } else { bits }))
                            }
                            Err(_) => unknown(out),
                        }
                    }
                    ("ip" | "ip6", "version") if !ordered => {
                        let want = if p == "ip" { 4 } else { 6 };
                        match m.right {
                            Value::Number(n) => out.push(Cond::Const((n == want) != negate)),
                            _ => unknown(out),
                        }
                    }
                    ("tcp", "flags") if !ordered => match flag_bits(&m.right) {
                        // `in` tests for any of the flags; `==` for exactly these.
                        Some(bits) if m.op == MatchOp::In => push_any_flags(bits, negate, out),
                        Some(bits) => out.push(Cond::TcpFlags {
                            mask: 0xff,
                            set: bits,
                            negate,
                        }),
                        None => unknown(out),
                    },
                    // A field the reduction does not model (`ip ttl`, `tcp window`...).
                    _ => unknown(out),
                }
            }
            Operand::Meta { key } if !ordered => match key.as_str() {
                "l4proto" => match self.protocols(&m.right) {
                    Ok(bits) => out.push(Cond::L4(if negate { !bits & l4::BOTH } else { bits })),
                    Err(_) => unknown(out),
                },
                "nfproto" | "protocol" => {
                    let bits = family_bits(&m.right);
                    match bits {
                        Some(bits) => out.push(Cond::Family(if negate { !bits & 3 } else { bits })),
                        None => unknown(out),
                    }
                }
                "iif" | "iifname" => match interface(&m.right, '*') {
                    Some(IfaceMatch::Never) => out.push(Cond::Const(negate)),
                    Some(IfaceMatch::Always) => out.push(Cond::Const(!negate)),
                    _ => out.push(Cond::Unknown(format!(
                        "{} (which interface remote traffic arrives on is not known)",
                        describe_match(m)
                    ))),
                },
                "iiftype" => match &m.right {
                    Value::Text(t) if t == "loopback" => out.push(Cond::Const(negate)),
                    _ => unknown(out),
                },
                "pkttype" => match &m.right {
                    Value::Text(t) => {
                        out.push(Cond::Const((t == "host" || t == "unicast") != negate))
                    }
                    _ => unknown(out),
                },
                _ => unknown(out),
            },
            Operand::Ct { key } if key == "state" && !ordered => match ct_bits(&m.right) {
                Some(bits) => out.push(Cond::CtState(if negate { !bits & 0x1f } else { bits })),
                None => unknown(out),
            },
            Operand::Fib { result, flags }
                if result == "type" && flags.iter().any(|f| f == "daddr") && !ordered =>
            {
                // On the input hook the destination is this host: its type is `local`.
                match texts(&m.right) {
                    Some(types) => {
                        out.push(Cond::Const(types.iter().any(|t| t == "local") != negate))
                    }
                    None => unknown(out),
                }
            }
            Operand::Bitwise { op, left, right } if op == "&" && !ordered => {
                match (left.as_ref(), flag_bits(right), flag_bits(&m.right)) {
                    (Operand::Payload { protocol, field }, Some(mask), Some(set))
                        if protocol == "tcp" && field == "flags" =>
                    {
                        out.push(Cond::L4(l4::TCP));
                        out.push(Cond::TcpFlags { mask, set, negate });
                    }
                    _ => unknown(out),
                }
            }
            _ => unknown(out),
        }
    }

    fn ports(&self, op: &MatchOp, v: &Value) -> Result<Ranges, String> {
        let max = u128::from(u16::MAX);
        let bound = |v: &Value| match v {
            Value::Number(n) if *n <= 65535 => Ok(u128::from(*n)),
            Value::Text(t) => t
                .parse::<u16>()
                .map(u128::from)
                .map_err(|_| format!("port {t:?}")),
            other => Err(format!("port value {}", describe_value(other))),
        };
        match op {
            MatchOp::Lt => Ok(match bound(v)? {
                0 => Ranges::empty(),
                n => Ranges::from_range(0, n - 1),
            }),
            MatchOp::Le => Ok(Ranges::from_range(0, bound(v)?)),
            MatchOp::Gt => Ok(Ranges::from_range(bound(v)?.saturating_add(1), max)),
            MatchOp::Ge => Ok(Ranges::from_range(bound(v)?, max)),
            _ => {
                let mut out = Vec::new();
                for leaf in self.leaves(v)? {
                    match leaf {
                        Value::Range(a, b) => out.push((bound(a)?, bound(b)?)),
                        other => {
                            let n = bound(other)?;
                            out.push((n, n));
                        }
                    }
                }
                Ok(Ranges::from_unsorted(out))
            }
        }
    }

    fn addrs(&self, family: Family, v: &Value) -> Result<Ranges, String> {
        let addr = |t: &str| -> Result<u128, String> {
            let a: IpAddr = t.parse().map_err(|_| format!("address {t:?}"))?;
            if Family::of(&a) != family {
                return Err(format!("{t} is not an {family} address"));
            }
            Ok(to_int(&a))
        };
        let mut out = Vec::new();
        for leaf in self.leaves(v)? {
            match leaf {
                Value::Text(t) => {
                    let n = addr(t)?;
                    out.push((n, n));
                }
                Value::Prefix { addr: a, len } => {
                    let ip: IpAddr = a.parse().map_err(|_| format!("address {a:?}"))?;
                    if Family::of(&ip) != family {
                        return Err(format!("{a}/{len} is not an {family} prefix"));
                    }
                    out.push(Prefix::masked(ip, *len).bounds());
                }
                Value::Range(a, b) => match (a.as_ref(), b.as_ref()) {
                    (Value::Text(a), Value::Text(b)) => out.push((addr(a)?, addr(b)?)),
                    _ => return Err("address range".into()),
                },
                other => return Err(format!("address value {}", describe_value(other))),
            }
        }
        Ok(Ranges::from_unsorted(out))
    }

    /// The [`l4`] bits of a protocol value or set of them.
    fn protocols(&self, v: &Value) -> Result<u8, String> {
        let mut bits = 0u8;
        for leaf in self.leaves(v)? {
            bits |= match leaf {
                Value::Text(t) => l4::bit(t),
                Value::Number(n) => l4::bit_of_number(*n),
                Value::Range(a, b) => match (a.as_ref(), b.as_ref()) {
                    (Value::Number(a), Value::Number(b)) => {
                        let r = *a..=*b;
                        (if r.contains(&6) { l4::TCP } else { 0 })
                            | (if r.contains(&17) { l4::UDP } else { 0 })
                    }
                    _ => return Err("protocol range".into()),
                },
                other => return Err(format!("protocol value {}", describe_value(other))),
            };
        }
        Ok(bits)
    }

    /// The elements of a value: itself, the members of a set or flag list, or the elements
    /// of a named set (which must be static and not a concatenation).
    fn leaves<'v>(&'v self, v: &'v Value) -> Result<Vec<&'v Value>, String> {
        let mut out = Vec::new();
        self.collect(v, &mut out, 0)?;
        Ok(out)
    }

    fn collect<'v>(
        &'v self,
        v: &'v Value,
        out: &mut Vec<&'v Value>,
        depth: u8,
    ) -> Result<(), String> {
        if depth > 4 {
            return Err("sets nested too deep".into());
        }
        match v {
            Value::Set(items) | Value::List(items) => {
                for i in items {
                    self.collect(i, out, depth + 1)?;
                }
                Ok(())
            }
            Value::SetRef(name) => {
                let set = self
                    .rs
                    .set(self.family, self.table, name)
                    .ok_or_else(|| format!("named set @{name} is not in the dump"))?;
                if set.is_dynamic() {
                    return Err(format!("named set @{name} changes at run time"));
                }
                if set.key_type.len() > 1 {
                    return Err(format!("named set @{name} is a concatenation"));
                }
                for e in &set.elements {
                    self.collect(e, out, depth + 1)?;
                }
                Ok(())
            }
            Value::Concat(_) => Err("a concatenation".into()),
            other => {
                out.push(other);
                Ok(())
            }
        }
    }
}
