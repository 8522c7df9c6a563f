//! iptables-save rules lowered to the shared program, one table at a time.

use std::collections::HashMap;
use std::net::IpAddr;

use super::terms::{IfaceMatch, iface_names, negated_ports, xt_target};
use super::{LoweredTable, Origin};
use crate::iptables::{self, MatchKind, Target};
use crate::net::{Family, Ranges, to_int};
use crate::reduce::ir::{Chain, Cond, Rule, Verdict, ct, l4, tcp};

/// Lowers one table of an iptables dump.
pub(crate) fn iptables_table<'a>(
    dump: &iptables::Dump,
    table: &'a iptables::Table,
    origins: &mut Vec<Origin<'a>>,
) -> LoweredTable {
    let names: Vec<String> = table.chains.iter().map(|c| c.name.clone()).collect();
    let index: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let mut chains: Vec<Chain> = vec![Chain::default(); names.len()];
    for rule in &table.rules {
        let Some(&ci) = index.get(rule.chain.as_str()) else {
            continue;
        };
        let origin = origins.len();
        origins.push(Origin::Iptables(rule));
        let mut conds = Vec::new();
        for m in &rule.matches {
            iptables_match(dump.family, m, &mut conds);
        }
        let verdict = match &rule.target {
            None => Verdict::Continue,
            Some(Target::Goto(name)) => match index.get(name.as_str()) {
                Some(&i) => Verdict::Goto(i),
                None => Verdict::MayAccept(format!("goto missing chain {name:?}")),
            },
            Some(Target::Jump { name, .. }) => match index.get(name.as_str()) {
                Some(&i) => Verdict::Jump(i),
                None => match name.as_str() {
                    "QUEUE" | "NFQUEUE" => {
                        Verdict::MayAccept(format!("{name}: a user-space program decides"))
                    }
                    n => xt_target(n).unwrap_or(Verdict::Continue),
                },
            },
        };
        if let Some(chain) = chains.get_mut(ci) {
            chain.rules.push(Rule {
                conds,
                verdict,
                origin,
            });
        }
    }
    LoweredTable { names, chains }
}

fn iptables_match(family: Family, m: &iptables::Match, out: &mut Vec<Cond>) {
    let neg = m.negated;
    let unknown = |out: &mut Vec<Cond>, what: String| out.push(Cond::Unknown(what));
    let bang = if neg { "! " } else { "" };
    match &m.kind {
        MatchKind::Protocol(p) => match p.as_str() {
            "all" | "0" => out.push(Cond::Const(!neg)),
            p => {
                let bits = l4::bit(p);
                out.push(Cond::L4(if neg { !bits & l4::BOTH } else { bits }));
            }
        },
        MatchKind::Source(prefix) => {
            if prefix.prefix_len() == 0 {
                out.push(Cond::Const(!neg));
            } else if prefix.family() != family {
                unknown(out, format!("{bang}-s {prefix} (another family)"));
            } else {
                let (lo, hi) = prefix.bounds();
                out.push(Cond::SAddr {
                    family,
                    addrs: Ranges::from_range(lo, hi),
                    negate: neg,
                });
            }
        }
        MatchKind::Destination(prefix) => {
            if prefix.prefix_len() == 0 {
                out.push(Cond::Const(!neg));
            } else {
                unknown(
                    out,
                    format!("{bang}-d {prefix} (which node address is not known)"),
                );
            }
        }
        MatchKind::InInterface(name) => match iface_names(std::slice::from_ref(name), '+') {
            IfaceMatch::Never => out.push(Cond::Const(neg)),
            IfaceMatch::Always => out.push(Cond::Const(!neg)),
            IfaceMatch::Depends => unknown(
                out,
                format!("{bang}-i {name} (which interface remote traffic arrives on is not known)"),
            ),
        },
        MatchKind::OutInterface(name) => unknown(out, format!("{bang}-o {name}")),
        MatchKind::Fragment => unknown(out, format!("{bang}-f")),
        MatchKind::DestinationPorts(ports) => {
            let r = Ranges::from_unsorted(
                ports
                    .iter()
                    .map(|p| (u128::from(p.start()), u128::from(p.end())))
                    .collect(),
            );
            out.push(Cond::DPort(negated_ports(r, neg)));
        }
        MatchKind::SourcePorts(ports) => out.push(Cond::SPort {
            ports: Ranges::from_unsorted(
                ports
                    .iter()
                    .map(|p| (u128::from(p.start()), u128::from(p.end())))
                    .collect(),
            ),
            negate: neg,
        }),
        MatchKind::ConnState(states) => {
            match states
                .iter()
                .try_fold(0u8, |acc, s| Some(acc | ct::bit(s)?))
            {
                Some(bits) => out.push(Cond::CtState(if neg { !bits & 0x1f } else { bits })),
                None => unknown(out, format!("{bang}--ctstate {}", states.join(","))),
            }
        }
        MatchKind::TcpFlags { mask, set } => {
            let bits = |v: &[String]| v.iter().try_fold(0u8, |acc, f| Some(acc | tcp::bits(f)?));
            match (bits(mask), bits(set)) {
                (Some(mask), Some(set)) => {
                    out.push(Cond::L4(l4::TCP));
                    out.push(Cond::TcpFlags {
                        mask,
                        set,
                        negate: neg,
                    });
                }
                _ => unknown(
                    out,
                    format!("{bang}--tcp-flags {} {}", mask.join(","), set.join(",")),
                ),
            }
        }
        MatchKind::Comment(_) => {}
        MatchKind::Opaque {
            module,
            option,
            args,
        } => {
            let module = module.as_deref().unwrap_or("");
            let first = args.first().map(|a| a.to_ascii_uppercase());
            match (module, option.as_str(), first.as_deref()) {
                // The input hook sees packets for this host: their destination is local.
                ("addrtype", "--dst-type", Some("LOCAL")) => out.push(Cond::Const(!neg)),
                // A remote host's source address is not one of this host's.
                ("addrtype", "--src-type", Some("LOCAL")) => out.push(Cond::Const(neg)),
                ("pkttype", "--pkt-type", Some(t)) => {
                    out.push(Cond::Const((t == "UNICAST" || t == "HOST") != neg))
                }
                ("iprange", "--src-range", Some(_)) => match args.first().and_then(|r| {
                    let (a, b) = r.split_once('-')?;
                    let a: IpAddr = a.parse().ok()?;
                    let b: IpAddr = b.parse().ok()?;
                    (Family::of(&a) == family && Family::of(&b) == family)
                        .then(|| Ranges::from_range(to_int(&a), to_int(&b)))
                }) {
                    Some(addrs) => out.push(Cond::SAddr {
                        family,
                        addrs,
                        negate: neg,
                    }),
                    None => unknown(out, format!("{bang}--src-range {}", args.join(" "))),
                },
                ("icmp", _, _) | ("icmp6", _, _) | ("icmpv6", _, _) => out.push(Cond::L4(0)),
                _ => {
                    let m = if module.is_empty() {
                        String::new()
                    } else {
                        format!("-m {module} ")
                    };
                    unknown(
                        out,
                        format!("{m}{bang}{option} {}", args.join(" "))
                            .trim()
                            .to_owned(),
                    )
                }
            }
        }
    }
}
