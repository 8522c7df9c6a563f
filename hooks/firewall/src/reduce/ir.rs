//! The one program both rule languages lower to: chains of rules, each a conjunction of
//! conditions and a verdict. nft and iptables differ in spelling, not in meaning, so the
//! evaluation is written once, against this.

use crate::net::{Family, Protocol, Ranges};

/// Connection-tracking states, as bits.
pub(crate) mod ct {
    pub(crate) const NEW: u8 = 1;
    pub(crate) const ESTABLISHED: u8 = 2;
    pub(crate) const RELATED: u8 = 4;
    pub(crate) const INVALID: u8 = 8;
    pub(crate) const UNTRACKED: u8 = 16;

    /// A state's bit from its name in either language (`new`, `NEW`).
    pub(crate) fn bit(name: &str) -> Option<u8> {
        Some(match name.to_ascii_lowercase().as_str() {
            "new" => NEW,
            "established" => ESTABLISHED,
            "related" => RELATED,
            "invalid" => INVALID,
            "untracked" => UNTRACKED,
            _ => return None,
        })
    }
}

/// TCP flags, as bits.
pub(crate) mod tcp {
    pub(crate) const FIN: u8 = 0x01;
    pub(crate) const SYN: u8 = 0x02;
    pub(crate) const RST: u8 = 0x04;
    pub(crate) const PSH: u8 = 0x08;
    pub(crate) const ACK: u8 = 0x10;
    pub(crate) const URG: u8 = 0x20;
    pub(crate) const ECE: u8 = 0x40;
    pub(crate) const CWR: u8 = 0x80;

    /// A flag's bit from its name in either language (`syn`, `SYN`); `ALL` and `NONE` too.
    pub(crate) fn bits(name: &str) -> Option<u8> {
        Some(match name.to_ascii_lowercase().as_str() {
            "fin" => FIN,
            "syn" => SYN,
            "rst" => RST,
            "psh" => PSH,
            "ack" => ACK,
            "urg" => URG,
            "ece" => ECE,
            "cwr" => CWR,
            "all" => 0xff,
            "none" => 0,
            _ => return None,
        })
    }
}

/// The transport protocols the reduction reports, as bits (other protocols have none).
pub(crate) mod l4 {
    pub(crate) const TCP: u8 = 1;
    pub(crate) const UDP: u8 = 2;
    pub(crate) const BOTH: u8 = 3;

    /// A protocol's bit from its name or number (`tcp`, `6`); other protocols are 0.
    pub(crate) fn bit(name: &str) -> u8 {
        match name.to_ascii_lowercase().as_str() {
            "tcp" | "6" => TCP,
            "udp" | "17" => UDP,
            _ => 0,
        }
    }

    pub(crate) fn bit_of_number(n: u64) -> u8 {
        match n {
            6 => TCP,
            17 => UDP,
            _ => 0,
        }
    }
}

/// One condition of a rule, in terms of the packet the reduction follows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cond {
    /// The packet's family is one of these bits (1 IPv4, 2 IPv6).
    Family(u8),
    /// The transport protocol is one of these [`l4`] bits.
    L4(u8),
    /// The destination port is in the set (negation already applied).
    DPort(Ranges),
    /// The source port is (`negate` false) or is not in the set.
    SPort { ports: Ranges, negate: bool },
    /// The source address is (or, negated, is not) in the set of `family`.
    SAddr {
        family: Family,
        addrs: Ranges,
        negate: bool,
    },
    /// The connection state is one of these [`ct`] bits (negation already applied).
    CtState(u8),
    /// `(flags & mask) == set`, possibly negated.
    TcpFlags { mask: u8, set: u8, negate: bool },
    /// Always or never.
    Const(bool),
    /// Cannot be decided; the text says what it is.
    Unknown(String),
}

/// What a rule does with the packets it matches.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// No verdict: on to the next rule.
    Continue,
    Accept,
    /// Drop or reject.
    Drop,
    Return,
    /// Index of a chain in the same table.
    Jump(usize),
    Goto(usize),
    /// May accept or not, for the reason given (a queue, an unknown target).
    MayAccept(String),
}

#[derive(Debug, Clone)]
pub(crate) struct Rule {
    pub(crate) conds: Vec<Cond>,
    pub(crate) verdict: Verdict,
    /// Index into the program's rule references.
    pub(crate) origin: usize,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Chain {
    pub(crate) rules: Vec<Rule>,
}

/// The packets one analysis follows: a family, a protocol, and what the reduction knows of
/// the rest of the packet.
#[derive(Debug, Clone)]
pub(crate) struct Analysis {
    pub(crate) family: Family,
    pub(crate) protocol: Protocol,
    /// The connection state bit of the packet ([`ct::NEW`] for a new connection).
    pub(crate) state: u8,
    /// TCP flags of the packet.
    pub(crate) tcp_flags: u8,
    /// Flags the analysis cannot vouch for (ECN bits on a SYN, PSH on data).
    pub(crate) tcp_flags_unsure: u8,
    /// The source port, when the analysis knows it.
    pub(crate) sport: Option<u16>,
    /// Source addresses considered.
    pub(crate) universe: Ranges,
}

impl Analysis {
    /// A new connection from any remote host.
    pub(crate) fn new_connection(family: Family, protocol: Protocol) -> Self {
        Self {
            family,
            protocol,
            state: ct::NEW,
            tcp_flags: tcp::SYN,
            tcp_flags_unsure: tcp::ECE | tcp::CWR,
            sport: None,
            universe: family.remote_universe(),
        }
    }
}

/// A condition judged for one analysis.
pub(crate) enum Judged {
    True,
    False,
    Ports(Ranges),
    Addrs(Ranges),
    Unknown(String),
}

impl Cond {
    pub(crate) fn judge(&self, a: &Analysis) -> Judged {
        let fam_bit = match a.family {
            Family::Ipv4 => 1,
            Family::Ipv6 => 2,
        };
        let proto_bit = match a.protocol {
            Protocol::Tcp => l4::TCP,
            Protocol::Udp => l4::UDP,
        };
        let b = |x: bool| if x { Judged::True } else { Judged::False };
        match self {
            Cond::Family(bits) => b(bits & fam_bit != 0),
            Cond::L4(bits) => b(bits & proto_bit != 0),
            Cond::DPort(ports) => Judged::Ports(ports.clone()),
            Cond::SPort { ports, negate } => match a.sport {
                Some(p) => b(ports.contains(u128::from(p)) != *negate),
                None => Judged::Unknown(format!(
                    "source port {}{}",
                    if *negate { "not in " } else { "in " },
                    describe_ranges(ports)
                )),
            },
            Cond::SAddr {
                family,
                addrs,
                negate,
            } => {
                if *family != a.family {
                    Judged::False
                } else if *negate {
                    Judged::Addrs(Ranges::from_range(0, family.max_addr()).subtract(addrs))
                } else {
                    Judged::Addrs(addrs.clone())
                }
            }
            Cond::CtState(bits) => b(bits & a.state != 0),
            Cond::TcpFlags { mask, set, negate } => {
                if a.protocol != Protocol::Tcp {
                    Judged::False
                } else if mask & a.tcp_flags_unsure != 0 {
                    Judged::Unknown(format!("tcp flags & {mask:#04x} == {set:#04x}"))
                } else {
                    b(((a.tcp_flags & mask) == *set) != *negate)
                }
            }
            Cond::Const(x) => b(*x),
            Cond::Unknown(text) => Judged::Unknown(text.clone()),
        }
    }
}

fn describe_ranges(r: &Ranges) -> String {
    let parts: Vec<String> = r
        .intervals()
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    parts.join(",")
}
