//! Readings both lowerings share: header implications, bit values, interface names, xt targets.

use crate::net::Ranges;
use crate::nft::Value;
use crate::reduce::ir::{Cond, Verdict, ct, l4, tcp};

/// iptables targets that change or log a packet and let it go on to the next rule.
const NON_TERMINAL_TARGETS: &[&str] = &[
    "LOG",
    "NFLOG",
    "ULOG",
    "MARK",
    "CONNMARK",
    "CT",
    "TRACE",
    "CLASSIFY",
    "DSCP",
    "TOS",
    "TCPMSS",
    "AUDIT",
    "NOTRACK",
    "CHECKSUM",
    "TTL",
    "HL",
    "TEE",
    "SECMARK",
    "CONNSECMARK",
    "IDLETIMER",
    "LED",
    "RATEEST",
    "SET",
    "HMARK",
    "TCPOPTSTRIP",
    "ECN",
];

/// What a header in a payload match implies for the packet; false when it cannot be a
/// TCP or UDP packet of a family the reduction follows.
pub(super) fn implied_by_header(protocol: &str, out: &mut Vec<Cond>) -> bool {
    match protocol {
        "tcp" => out.push(Cond::L4(l4::TCP)),
        "udp" => out.push(Cond::L4(l4::UDP)),
        "th" => out.push(Cond::L4(l4::BOTH)),
        "ip" => out.push(Cond::Family(1)),
        "ip6" => out.push(Cond::Family(2)),
        "icmp" | "igmp" => {
            out.push(Cond::Family(1));
            out.push(Cond::L4(0));
            return false;
        }
        "icmpv6" => {
            out.push(Cond::Family(2));
            out.push(Cond::L4(0));
            return false;
        }
        "sctp" | "dccp" | "udplite" | "esp" | "ah" | "comp" | "gre" => {
            out.push(Cond::L4(0));
            return false;
        }
        _ => {}
    }
    true
}

pub(super) fn negated_ports(ports: Ranges, negate: bool) -> Ranges {
    if negate {
        Ranges::from_range(0, u128::from(u16::MAX)).subtract(&ports)
    } else {
        ports
    }
}

pub(super) fn texts(v: &Value) -> Option<Vec<String>> {
    match v {
        Value::Text(t) => Some(vec![t.clone()]),
        Value::Set(items) | Value::List(items) => {
            let mut out = Vec::new();
            for i in items {
                out.extend(texts(i)?);
            }
            Some(out)
        }
        _ => None,
    }
}

pub(super) fn ct_bits(v: &Value) -> Option<u8> {
    texts(v)?
        .iter()
        .try_fold(0u8, |acc, t| Some(acc | ct::bit(t)?))
}

pub(super) fn flag_bits(v: &Value) -> Option<u8> {
    match v {
        Value::Number(n) => u8::try_from(*n).ok(),
        _ => texts(v)?
            .iter()
            .try_fold(0u8, |acc, t| Some(acc | tcp::bits(t)?)),
    }
}

/// `tcp flags syn,ack` with `in`: any of the bits set.
pub(super) fn push_any_flags(bits: u8, negate: bool, out: &mut Vec<Cond>) {
    // (flags & bits) != 0 is the negation of (flags & bits) == 0.
    out.push(Cond::TcpFlags {
        mask: bits,
        set: 0,
        negate: !negate,
    });
}

pub(super) fn family_bits(v: &Value) -> Option<u8> {
    texts(v)?.iter().try_fold(0u8, |acc, t| {
        Some(
            acc | match t.as_str() {
                "ipv4" | "ip" => 1,
                "ipv6" | "ip6" => 2,
                _ => return None,
            },
        )
    })
}

pub(super) enum IfaceMatch {
    /// Matches no remote packet (loopback only).
    Never,
    /// Matches every interface.
    Always,
    /// Depends on the interface.
    Depends,
}

/// How an interface match judges a packet that arrived on some interface other than
/// loopback. `wildcard` is nft's `*` or iptables' `+` at the end of a name.
pub(super) fn interface(v: &Value, wildcard: char) -> Option<IfaceMatch> {
    let names = texts(v)?;
    Some(iface_names(&names, wildcard))
}

pub(super) fn iface_names(names: &[String], wildcard: char) -> IfaceMatch {
    if names
        .iter()
        .any(|n| n.len() == 1 && n.starts_with(wildcard))
    {
        IfaceMatch::Always
    } else if !names.is_empty() && names.iter().all(|n| n == "lo") {
        IfaceMatch::Never
    } else {
        IfaceMatch::Depends
    }
}

pub(super) fn xt_target(name: &str) -> Option<Verdict> {
    match name {
        "ACCEPT" => Some(Verdict::Accept),
        "DROP" | "REJECT" | "TARPIT" => Some(Verdict::Drop),
        "RETURN" => Some(Verdict::Return),
        n if NON_TERMINAL_TARGETS.contains(&n) => None,
        other => Some(Verdict::MayAccept(format!("xt target {other}"))),
    }
}
