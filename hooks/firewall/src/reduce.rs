//! From rulesets to "which inbound ports can a remote host reach", per family and protocol.
//!
//! Why this module exists: an operator's question is not "what rules are loaded" but "what
//! is exposed". A NEW connection from a non-loopback source, arriving on a non-loopback
//! interface, gets in only if every base chain on the input hook accepts it: nftables runs
//! each base chain of every table whose family sees the packet (`inet` both, `ip` IPv4,
//! `ip6` IPv6) in priority order, an accept ends only that chain, and a drop ends
//! everything. So the reachable set is the intersection of what each base chain accepts,
//! and this module computes it exactly where it can.
//!
//! Where it cannot (an `xt` match, an interface other than `lo`, a rate limit, a
//! concatenation), it stays on the side that cannot hide an exposure: an unknown condition
//! on an accept may accept, on a drop may not drop, on a jump may go either way, and each
//! such rule is reported as an [`Uncertainty`] with the ports it touches. The reachable set
//! is therefore never smaller than the truth.
//!
//! For a table iptables-nft manages (its rules show `xt` objects in `nft -j`) the iptables
//! view of the same table is used instead when given, and a [`Note`] says so. Tables of
//! the legacy backend are base chains of their own and are added.
//!
//! ```
//! use probity_firewall::{nft, reduce, Family, Protocol, Inputs};
//! let rs = nft::parse(br#"{"nftables": [
//!   {"table": {"family": "inet", "name": "f"}},
//!   {"chain": {"family": "inet", "table": "f", "name": "in", "type": "filter",
//!              "hook": "input", "prio": 0, "policy": "drop"}},
//!   {"rule": {"family": "inet", "table": "f", "chain": "in", "expr": [
//!     {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}},
//!                "right": 22}}, {"accept": null}]}}
//! ]}"#).unwrap();
//! let reach = reduce(&Inputs { nft: Some(&rs), iptables: vec![] });
//! assert!(reach.is_reachable(Family::Ipv6, Protocol::Tcp, 22));
//! assert!(!reach.is_reachable(Family::Ipv4, Protocol::Tcp, 80));
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;

use serde::Serialize;

use crate::iptables::{self, Backend};
use crate::net::{Family, PortRange, Prefix, Protocol, Ranges, range_to_prefixes, to_int};
use crate::nft::{self, Policy, TableFamily};
use crate::space::{Pieces, Space};

mod ir;
mod lower;

use ir::{Analysis, Judged, Verdict};
pub(crate) use lower::describe_rule as describe_nft_rule;
use lower::{LoweredTable, Origin};

/// Deepest chain nesting followed; nft itself allows 16 levels.
const MAX_DEPTH: u32 = 64;
/// Rule visits per analysis before jumps stop being followed: this many, plus
/// [`VISITS_PER_RULE`] per rule. A real ruleset stays far below (a rule is visited once
/// per path to it); a hostile chain graph where every level jumps twice to the next would
/// otherwise take time exponential in its depth.
const VISIT_BUDGET: usize = 100_000;
/// See [`VISIT_BUDGET`].
const VISITS_PER_RULE: usize = 16;

/// The rulesets to reduce. Any may be absent; the reduction says what it used.
#[derive(Debug, Clone, Default)]
pub struct Inputs<'a> {
    /// `nft -j list ruleset`.
    pub nft: Option<&'a nft::Ruleset>,
    /// `iptables-save` and `ip6tables-save` dumps (each knows its family).
    pub iptables: Vec<&'a iptables::Dump>,
}

/// From which sources a port is reachable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "prefixes", rename_all = "snake_case")]
pub enum Exposure {
    /// Any non-loopback source.
    Any,
    /// Only sources in these prefixes.
    Sources(Vec<Prefix>),
    /// Any non-loopback source except these prefixes.
    AnyExcept(Vec<Prefix>),
}

impl Exposure {
    /// Whether a connection from `source` gets in.
    pub fn admits(&self, source: &IpAddr) -> bool {
        match self {
            Exposure::Any => true,
            Exposure::Sources(p) => p.iter().any(|p| p.contains(source)),
            Exposure::AnyExcept(p) => !p.iter().any(|p| p.contains(source)),
        }
    }

    /// The source addresses, as integer intervals of `family`.
    pub(crate) fn addrs(&self, family: Family) -> Ranges {
        let set = |p: &[Prefix]| {
            Ranges::from_unsorted(
                p.iter()
                    .filter(|p| p.family() == family)
                    .map(Prefix::bounds)
                    .collect(),
            )
        };
        let universe = family.remote_universe();
        match self {
            Exposure::Any => universe,
            Exposure::Sources(p) => set(p).intersect(&universe),
            Exposure::AnyExcept(p) => universe.subtract(&set(p)),
        }
    }

    /// Describes `addrs` of `family`, whichever of the three forms is shortest.
    pub(crate) fn from_addrs(family: Family, addrs: &Ranges) -> Exposure {
        let universe = family.remote_universe();
        if universe.subtract(addrs).is_empty() {
            return Exposure::Any;
        }
        let prefixes = |r: &Ranges| -> Vec<Prefix> {
            r.intervals()
                .iter()
                .flat_map(|&(a, b)| range_to_prefixes(family, a, b))
                .collect()
        };
        let sources = prefixes(addrs);
        // The complement within the remote universe, ignoring loopback, which is excluded
        // from both forms alike.
        let loopback = Ranges::from_range(0, family.max_addr()).subtract(&universe);
        let except = prefixes(&universe.subtract(addrs).subtract(&loopback));
        if except.len() < sources.len() {
            Exposure::AnyExcept(except)
        } else {
            Exposure::Sources(sources)
        }
    }
}

impl fmt::Display for Exposure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |p: &[Prefix]| {
            p.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Exposure::Any => f.write_str("from any source"),
            Exposure::Sources(p) => write!(f, "from {}", list(p)),
            Exposure::AnyExcept(p) => write!(f, "from any source except {}", list(p)),
        }
    }
}

/// A range of ports reachable with one exposure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReachableRange {
    /// The ports.
    pub ports: PortRange,
    /// From where.
    pub exposure: Exposure,
}

/// The reachable ports of one family and protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReachablePorts {
    /// Family.
    pub family: Family,
    /// Protocol.
    pub protocol: Protocol,
    /// Ranges in port order, disjoint.
    pub ranges: Vec<ReachableRange>,
}

/// Where a rule came from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RuleRef {
    /// `nft` or `iptables (nf_tables)`, `iptables (legacy)`, ...
    pub source: String,
    /// nft family (`inet`, `ip`, `ip6`), or `ip`/`ip6` for iptables/ip6tables.
    pub family: String,
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// nft rule handle.
    pub handle: Option<u64>,
    /// Line in the iptables-save output.
    pub line: Option<usize>,
    /// The rule as text.
    pub text: String,
}

impl fmt::Display for RuleRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} chain {}",
            self.source, self.family, self.table, self.chain
        )?;
        if let Some(h) = self.handle {
            write!(f, " handle {h}")?;
        }
        if let Some(l) = self.line {
            write!(f, " line {l}")?;
        }
        write!(f, ": {}", self.text)
    }
}

/// Which way the reduction resolved something it could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// An accept that may not apply, or a verdict that may accept: counted as accepting.
    MayAccept,
    /// A drop or reject that may not apply: counted as not dropping.
    MayNotDrop,
    /// A jump or goto that may not apply: both ways followed.
    MayJump,
    /// A return that may not apply: both ways followed.
    MayReturn,
    /// A source that could not be read: its tables are missing from the answer, which can
    /// only make it larger.
    SourceUnread,
}

/// Something the reduction could not decide, and the ports it touches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Uncertainty {
    /// The rule it came from (none for an unread source).
    pub rule: Option<RuleRef>,
    /// What could not be decided.
    pub reason: String,
    /// How it was resolved.
    pub effect: Effect,
    /// Family of the packets affected.
    pub family: Family,
    /// Protocol of the packets affected.
    pub protocol: Protocol,
    /// Ports affected.
    pub ports: Vec<PortRange>,
}

/// What the reduction did besides computing, for the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Note {
    /// A table iptables-nft manages was read from iptables-save instead of `nft -j`.
    TableFromIptables {
        /// `ip` or `ip6`.
        family: String,
        /// Table name.
        table: String,
    },
    /// A table shows `xt` objects but no iptables-save view of it was given: its iptables
    /// matches are uncertainties.
    XtWithoutIptablesView {
        /// `ip` or `ip6`.
        family: String,
        /// Table name.
        table: String,
    },
    /// A table of a family that does not filter the input hook (netdev, bridge, arp) was
    /// set aside. Its drops can only shrink the answer.
    SetAside {
        /// Family.
        family: String,
        /// Table name.
        table: String,
    },
    /// iptables-nft said legacy tables also exist; unless their dump is given they are not
    /// in the answer (their drops can only shrink it).
    LegacyTablesPresent {
        /// The family of the dump that said so.
        family: Family,
    },
    /// No base chain on the input hook sees this family: every port is reachable.
    NoInputHook {
        /// Family.
        family: Family,
    },
}

/// A base chain on the input hook that the reduction evaluated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Filter {
    /// `nft`, `iptables (nf_tables)`, `iptables (legacy)`...
    pub source: String,
    /// nft family or `ip`/`ip6`.
    pub family: String,
    /// Table.
    pub table: String,
    /// Base chain.
    pub chain: String,
    /// Priority.
    pub priority: i64,
    /// Whether its policy drops.
    pub policy_drop: bool,
}

/// The inbound ports a remote host can reach, per family and protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reachability {
    /// One entry per (family, protocol), IPv4/TCP first.
    pub ports: Vec<ReachablePorts>,
    /// What could not be decided, with the rule it came from.
    pub uncertainties: Vec<Uncertainty>,
    /// What was used, replaced or set aside.
    pub notes: Vec<Note>,
    /// The base chains evaluated, in priority order.
    pub filters: Vec<Filter>,
}

impl Reachability {
    /// The reachable ranges of one family and protocol.
    pub fn ranges(&self, family: Family, protocol: Protocol) -> &[ReachableRange] {
        self.ports
            .iter()
            .find(|p| p.family == family && p.protocol == protocol)
            .map(|p| p.ranges.as_slice())
            .unwrap_or(&[])
    }

    /// The exposure of one port, or `None` when no remote host reaches it.
    pub fn exposure(&self, family: Family, protocol: Protocol, port: u16) -> Option<&Exposure> {
        self.ranges(family, protocol)
            .iter()
            .find(|r| r.ports.contains(port))
            .map(|r| &r.exposure)
    }

    /// Whether some remote host reaches the port.
    pub fn is_reachable(&self, family: Family, protocol: Protocol, port: u16) -> bool {
        self.exposure(family, protocol, port).is_some()
    }

    /// Whether a connection from `source` reaches the port.
    pub fn admits(&self, protocol: Protocol, port: u16, source: &IpAddr) -> bool {
        self.exposure(Family::of(source), protocol, port)
            .is_some_and(|e| e.admits(source))
    }

    /// The reachable set of one family and protocol as a packet space.
    pub(crate) fn space(&self, family: Family, protocol: Protocol) -> Space {
        let mut s = Space::empty();
        for r in self.ranges(family, protocol) {
            s.union_with(&Space::from_box(
                &Ranges::from_range(u128::from(r.ports.start()), u128::from(r.ports.end())),
                &r.exposure.addrs(family),
            ));
        }
        s
    }
}

/// The ports a remote host can reach through the given rulesets.
pub fn reduce(inputs: &Inputs<'_>) -> Reachability {
    let program = Program::build(inputs);
    let mut out = Reachability {
        ports: Vec::new(),
        uncertainties: Vec::new(),
        notes: program.notes.clone(),
        filters: program.filters.iter().map(|f| f.public.clone()).collect(),
    };
    for family in Family::ALL {
        if !program.filters.iter().any(|f| f.sees(family)) {
            out.notes.push(Note::NoInputHook { family });
        }
        for protocol in Protocol::ALL {
            let analysis = Analysis::new_connection(family, protocol);
            let (space, uncertain) = program.evaluate(&analysis);
            out.ports.push(ReachablePorts {
                family,
                protocol,
                ranges: ranges_of(family, &space),
            });
            out.uncertainties.extend(uncertain);
        }
    }
    out
}

/// Whether packets of an established TCP connection with `remote` (its address and port)
/// get through every base chain, for every local port in `local_ports`; the uncertainties
/// met say why not when they do not.
pub(crate) fn admits_established(
    inputs: &Inputs<'_>,
    remote: std::net::SocketAddr,
    local_ports: PortRange,
) -> (bool, Vec<Uncertainty>) {
    let program = Program::build(inputs);
    let family = Family::of(&remote.ip());
    let ip = to_int(&remote.ip());
    let analysis = Analysis {
        family,
        protocol: Protocol::Tcp,
        state: ir::ct::ESTABLISHED,
        tcp_flags: ir::tcp::ACK,
        tcp_flags_unsure: ir::tcp::PSH | ir::tcp::ECE | ir::tcp::CWR | ir::tcp::URG,
        sport: Some(remote.port()),
        universe: Ranges::from_range(ip, ip),
    };
    let (space, uncertain) = program.evaluate(&analysis);
    let want = Ranges::from_range(
        u128::from(local_ports.start()),
        u128::from(local_ports.end()),
    );
    (space.ports().covers(&want), uncertain)
}

fn ranges_of(family: Family, space: &Space) -> Vec<ReachableRange> {
    space
        .segments()
        .into_iter()
        .filter_map(|(s, e, addrs)| {
            Some(ReachableRange {
                ports: PortRange::new(s, e)?,
                exposure: Exposure::from_addrs(family, &addrs),
            })
        })
        .collect()
}

struct ProgramFilter {
    public: Filter,
    /// Family bits: 1 IPv4, 2 IPv6.
    families: u8,
    table: usize,
    chain: usize,
    policy_accepts: bool,
}

impl ProgramFilter {
    fn sees(&self, family: Family) -> bool {
        self.families & family_bit(family) != 0
    }
}

fn family_bit(f: Family) -> u8 {
    match f {
        Family::Ipv4 => 1,
        Family::Ipv6 => 2,
    }
}

/// Every base chain on the input hook, lowered.
struct Program<'a> {
    tables: Vec<LoweredTable>,
    /// For each table: source, family and table name, for rule references.
    table_names: Vec<(String, String, String)>,
    /// Per table, the rules' origins (a rule's `origin` indexes its table's list).
    origins: Vec<Vec<Origin<'a>>>,
    filters: Vec<ProgramFilter>,
    notes: Vec<Note>,
}

fn iptables_source(b: Backend) -> String {
    format!("iptables ({b})")
}

fn iptables_family(f: Family) -> &'static str {
    match f {
        Family::Ipv4 => "ip",
        Family::Ipv6 => "ip6",
    }
}

/// The chain of an iptables table on the input hook, and its priority.
fn iptables_input_priority(table: &str) -> Option<i64> {
    match table {
        "mangle" => Some(-150),
        "filter" => Some(0),
        "security" => Some(50),
        "nat" => Some(100),
        _ => None,
    }
}

impl<'a> Program<'a> {
    fn build(inputs: &Inputs<'a>) -> Program<'a> {
        let mut p = Program {
            tables: Vec::new(),
            table_names: Vec::new(),
            origins: Vec::new(),
            filters: Vec::new(),
            notes: Vec::new(),
        };
        // iptables tables chosen to stand in for nft tables: (dump index, table index).
        let mut replaced: Vec<(usize, usize)> = Vec::new();
        let find_iptables = |family: Family, name: &str| -> Option<(usize, usize)> {
            inputs.iptables.iter().enumerate().find_map(|(di, d)| {
                if d.family != family || d.backend == Backend::Legacy {
                    return None;
                }
                d.tables
                    .iter()
                    .position(|t| t.name == name)
                    .map(|ti| (di, ti))
            })
        };
        if let Some(rs) = inputs.nft {
            let mut by_chain: HashMap<(TableFamily, &str), HashMap<&str, Vec<&nft::Rule>>> =
                HashMap::new();
            for r in &rs.rules {
                by_chain
                    .entry((r.family, r.table.as_str()))
                    .or_default()
                    .entry(r.chain.as_str())
                    .or_default()
                    .push(r);
            }
            let empty = HashMap::new();
            for t in &rs.tables {
                let families = match t.family {
                    TableFamily::Ip => 1,
                    TableFamily::Ip6 => 2,
                    TableFamily::Inet => 3,
                    TableFamily::Arp | TableFamily::Bridge | TableFamily::Netdev => {
                        p.notes.push(Note::SetAside {
                            family: t.family.name().to_owned(),
                            table: t.name.clone(),
                        });
                        continue;
                    }
                };
                let input_chains: Vec<&nft::Chain> = rs
                    .chains
                    .iter()
                    .filter(|c| c.family == t.family && c.table == t.name)
                    .filter(|c| c.base.as_ref().is_some_and(|b| b.hook == "input"))
                    .collect();
                if input_chains.is_empty() {
                    continue;
                }
                if rs.table_uses_xt(t.family, &t.name) {
                    let family = if t.family == TableFamily::Ip6 {
                        Family::Ipv6
                    } else {
                        Family::Ipv4
                    };
                    let view = (t.family != TableFamily::Inet)
                        .then(|| find_iptables(family, &t.name))
                        .flatten();
                    if let Some(found) = view {
                        replaced.push(found);
                        p.notes.push(Note::TableFromIptables {
                            family: t.family.name().to_owned(),
                            table: t.name.clone(),
                        });
                        continue;
                    }
                    p.notes.push(Note::XtWithoutIptablesView {
                        family: t.family.name().to_owned(),
                        table: t.name.clone(),
                    });
                }
                let table_index = p.tables.len();
                let mut origins = Vec::new();
                let lowered = lower::nft_table(
                    rs,
                    t.family,
                    &t.name,
                    by_chain.get(&(t.family, t.name.as_str())).unwrap_or(&empty),
                    &mut origins,
                );
                for c in input_chains {
                    let (Some(base), Some(ci)) = (&c.base, lowered.index(&c.name)) else {
                        continue;
                    };
                    p.filters.push(ProgramFilter {
                        public: Filter {
                            source: "nft".into(),
                            family: t.family.name().to_owned(),
                            table: t.name.clone(),
                            chain: c.name.clone(),
                            priority: base.priority,
                            policy_drop: base.policy == Policy::Drop,
                        },
                        families,
                        table: table_index,
                        chain: ci,
                        policy_accepts: base.policy == Policy::Accept,
                    });
                }
                p.origins.push(origins);
                p.tables.push(lowered);
                p.table_names
                    .push(("nft".into(), t.family.name().to_owned(), t.name.clone()));
            }
        }
        for (di, dump) in inputs.iptables.iter().enumerate() {
            if dump.legacy_tables_present {
                p.notes.push(Note::LegacyTablesPresent {
                    family: dump.family,
                });
            }
            for (ti, table) in dump.tables.iter().enumerate() {
                let Some(priority) = iptables_input_priority(&table.name) else {
                    continue;
                };
                let nft_family = if dump.family == Family::Ipv4 {
                    TableFamily::Ip
                } else {
                    TableFamily::Ip6
                };
                // With nf_tables, the same table is in `nft -j`: read it there unless it
                // was replaced above, or it is missing there (read at another moment).
                let in_nft = inputs.nft.is_some_and(|rs| {
                    rs.tables
                        .iter()
                        .any(|t| t.family == nft_family && t.name == table.name)
                });
                let use_it =
                    dump.backend == Backend::Legacy || replaced.contains(&(di, ti)) || !in_nft;
                if !use_it {
                    continue;
                }
                let Some(input) = table.chains.iter().find(|c| c.name == "INPUT") else {
                    continue;
                };
                let table_index = p.tables.len();
                let mut origins = Vec::new();
                let lowered = lower::iptables_table(dump, table, &mut origins);
                let Some(ci) = lowered.index("INPUT") else {
                    continue;
                };
                let source = iptables_source(dump.backend);
                let policy_accepts = input.policy != Some(iptables::Verdict::Drop);
                p.filters.push(ProgramFilter {
                    public: Filter {
                        source: source.clone(),
                        family: iptables_family(dump.family).to_owned(),
                        table: table.name.clone(),
                        chain: "INPUT".into(),
                        priority,
                        policy_drop: !policy_accepts,
                    },
                    families: family_bit(dump.family),
                    table: table_index,
                    chain: ci,
                    policy_accepts,
                });
                p.origins.push(origins);
                p.tables.push(lowered);
                p.table_names.push((
                    source,
                    iptables_family(dump.family).to_owned(),
                    table.name.clone(),
                ));
            }
        }
        p.filters.sort_by_key(|f| f.public.priority);
        p
    }

    fn rule_ref(&self, table: usize, origin: usize) -> Option<RuleRef> {
        let o = self.origins.get(table)?.get(origin)?;
        let (source, family, name) = self.table_names.get(table)?;
        Some(RuleRef {
            source: source.clone(),
            family: family.clone(),
            table: name.clone(),
            chain: o.chain().to_owned(),
            handle: o.handle(),
            line: o.line(),
            text: o.text(),
        })
    }

    /// The packets of `a` that every base chain accepts, and the uncertainties met.
    fn evaluate(&self, a: &Analysis) -> (Space, Vec<Uncertainty>) {
        let universe = Space::full(&a.universe);
        // `None` until the first base chain: everything.
        let mut reachable: Option<Space> = None;
        let mut collector = Collector::default();
        let rules: usize = self
            .tables
            .iter()
            .flat_map(|t| &t.chains)
            .map(|c| c.rules.len())
            .sum();
        let mut budget = VISIT_BUDGET.saturating_add(rules.saturating_mul(VISITS_PER_RULE));
        // Judge every rule once for this analysis.
        let all_ports = Ranges::from_range(0, u128::from(u16::MAX));
        let judged: Vec<Vec<Vec<RuleBox>>> = self
            .tables
            .iter()
            .map(|t| {
                t.chains
                    .iter()
                    .map(|c| c.rules.iter().map(|r| judge(r, a, &all_ports)).collect())
                    .collect()
            })
            .collect();
        for f in self.filters.iter().filter(|f| f.sees(a.family)) {
            let (Some(table), Some(boxes)) = (self.tables.get(f.table), judged.get(f.table)) else {
                continue;
            };
            let mut ev = Eval {
                table,
                boxes,
                collector: &mut collector,
                table_index: f.table,
                stack: Vec::new(),
                budget: &mut budget,
            };
            let out = ev.chain(f.chain, universe.clone(), 0);
            let mut accepted = out.accepted;
            if f.policy_accepts {
                accepted.extend(out.returned);
            }
            let accepted = accepted.into_space();
            reachable = Some(match reachable {
                None => accepted,
                Some(r) => r.intersect(&accepted),
            });
        }
        let uncertainties = collector
            .found
            .into_iter()
            .map(|((table, origin, reason, effect), ports)| Uncertainty {
                rule: self.rule_ref(table, origin),
                reason,
                effect,
                family: a.family,
                protocol: a.protocol,
                ports: ports
                    .intervals()
                    .iter()
                    .filter_map(|&(s, e)| {
                        PortRange::new(u16::try_from(s).ok()?, u16::try_from(e).ok()?)
                    })
                    .collect(),
            })
            .collect();
        (reachable.unwrap_or(universe), uncertainties)
    }
}

/// A rule judged for one analysis: the box of packets it matches, and whether that is
/// certain.
struct RuleBox {
    never: bool,
    ports: Ranges,
    addrs: Option<Ranges>,
    unknown: Vec<String>,
}

fn judge(rule: &ir::Rule, a: &Analysis, all_ports: &Ranges) -> RuleBox {
    let mut ports: Option<Ranges> = None;
    let mut b = RuleBox {
        never: false,
        ports: Ranges::empty(),
        addrs: None,
        unknown: Vec::new(),
    };
    for c in &rule.conds {
        match c.judge(a) {
            Judged::True => {}
            Judged::False => {
                b.never = true;
                return b;
            }
            Judged::Ports(p) => {
                ports = Some(match ports.take() {
                    Some(prev) => prev.intersect(&p),
                    None => p,
                })
            }
            Judged::Addrs(r) => {
                b.addrs = Some(match b.addrs.take() {
                    Some(prev) => prev.intersect(&r),
                    None => r,
                })
            }
            Judged::Unknown(text) => b.unknown.push(text),
        }
    }
    b.ports = ports.unwrap_or_else(|| all_ports.clone());
    if b.ports.is_empty() || b.addrs.as_ref().is_some_and(Ranges::is_empty) {
        b.never = true;
    }
    b
}

#[derive(Default)]
struct Collector {
    /// (table, origin, reason, effect) → ports.
    found: BTreeMap<(usize, usize, String, Effect), Ranges>,
}

impl Collector {
    fn record(
        &mut self,
        table: usize,
        origin: usize,
        reason: String,
        effect: Effect,
        ports: Ranges,
    ) {
        let entry = self
            .found
            .entry((table, origin, reason, effect))
            .or_default();
        *entry = entry.union(&ports);
    }
}

struct Outcome {
    accepted: Pieces,
    /// Packets that return to the caller (or reach the end of the chain).
    returned: Pieces,
}

struct Eval<'a> {
    table: &'a LoweredTable,
    boxes: &'a [Vec<RuleBox>],
    collector: &'a mut Collector,
    table_index: usize,
    /// Chains being evaluated, outermost first: a jump to one of them is a loop.
    stack: Vec<usize>,
    /// Rule visits left before jumps stop being followed.
    budget: &'a mut usize,
}

impl Eval<'_> {
    fn chain(&mut self, chain: usize, input: Space, depth: u32) -> Outcome {
        let mut remaining = input;
        let mut accepted = Pieces::default();
        let mut returned = Pieces::default();
        let (Some(c), Some(boxes)) = (self.table.chains.get(chain), self.boxes.get(chain)) else {
            return Outcome {
                accepted,
                returned: remaining.into_pieces(),
            };
        };
        self.stack.push(chain);
        *self.budget = self.budget.saturating_sub(c.rules.len());
        for (rule, b) in c.rules.iter().zip(boxes) {
            if remaining.is_empty() {
                break;
            }
            if b.never || rule.verdict == Verdict::Continue {
                continue;
            }
            let certain = b.unknown.is_empty();
            let addrs = b.addrs.as_ref();
            // A definite rule takes its packets out of the chain; an uncertain one lets
            // them go on as well.
            let hit = if certain && !matches!(rule.verdict, Verdict::MayAccept(_)) {
                remaining.take_box(&b.ports, addrs)
            } else {
                remaining.intersect_box(&b.ports, addrs)
            };
            if hit.is_empty() {
                continue;
            }
            let reason = || b.unknown.join("; ");
            match &rule.verdict {
                Verdict::Continue => {}
                Verdict::Accept => {
                    if !certain {
                        self.note(rule.origin, reason(), Effect::MayAccept, &hit);
                    }
                    accepted.extend(hit);
                }
                Verdict::Drop => {
                    if !certain {
                        self.note(rule.origin, reason(), Effect::MayNotDrop, &hit);
                    }
                }
                Verdict::Return => {
                    if !certain {
                        self.note(rule.origin, reason(), Effect::MayReturn, &hit);
                    }
                    returned.extend(hit);
                }
                Verdict::MayAccept(why) => {
                    let mut r = reason();
                    if !r.is_empty() {
                        r.push_str("; ");
                    }
                    r.push_str(why);
                    self.note(rule.origin, r, Effect::MayAccept, &hit);
                    accepted.extend(hit);
                }
                Verdict::Jump(target) | Verdict::Goto(target) => {
                    let is_goto = matches!(rule.verdict, Verdict::Goto(_));
                    let stop = if self.stack.contains(target) {
                        Some("a jump into a chain already being evaluated (a loop)".to_owned())
                    } else if depth >= MAX_DEPTH {
                        Some(format!("chains nest deeper than {MAX_DEPTH}"))
                    } else if *self.budget == 0 {
                        Some("too many rule visits (many paths through the chains): jumps no longer followed".to_owned())
                    } else {
                        None
                    };
                    if let Some(why) = stop {
                        self.note(rule.origin, why, Effect::MayAccept, &hit);
                        if certain {
                            // Taken out above: let them go on as well, both ways counted.
                            remaining.add_pieces(hit.clone());
                        }
                        accepted.extend(hit);
                        continue;
                    }
                    if !certain {
                        self.note(rule.origin, reason(), Effect::MayJump, &hit);
                    }
                    let sub = self.chain(*target, hit.into_space(), depth + 1);
                    accepted.extend(sub.accepted);
                    if is_goto {
                        returned.extend(sub.returned);
                    } else {
                        remaining.add_pieces(sub.returned);
                    }
                }
            }
        }
        self.stack.pop();
        returned.extend(remaining.into_pieces());
        Outcome { accepted, returned }
    }

    fn note(&mut self, origin: usize, reason: String, effect: Effect, hit: &Pieces) {
        self.collector
            .record(self.table_index, origin, reason, effect, hit.ports());
    }
}

#[cfg(test)]
mod tests;
