//! Which `listen` questions a cycle asks: one per listening socket that is not
//! loopback-only, and one per range of ports the firewall lets a remote host reach.
//!
//! Why this module exists: a node without a firewall lets every one of 65,535 ports per
//! protocol in, and asking the engine 131,070 questions a cycle is neither bounded nor
//! useful (each would be its own finding). The answer of the `listen` policies depends
//! on the port only through the port sets the policy directory gives (the attributes
//! the schema's conventions name in `@port_sets`: by default each role's TCP and UDP
//! ports and `Settings`' baselines): two ports that lie on the same side
//! of every such set get the same answer. So reachable ports are cut into ranges at every
//! boundary of those sets (and around every listening port), and one question is asked
//! per range, with the range's first port. This keeps the judgement in the policies
//! (nothing here says which port is allowed) as long as policies read ports only through
//! sets of the policy data, which is what "thresholds are settings" asks of them.

use std::collections::BTreeSet;

use probity::{Engine, PortProtocol};
use probity_collect::sockets::{ListeningSocket, Protocol as SockProtocol, Scope};
use probity_firewall::{Family, PortRange, Protocol, Reachability};
use serde::Serialize;
use serde_json::Value;

/// One `listen` question: a protocol and a port range, with why it is asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListenSubject {
    /// `tcp` or `udp`.
    pub protocol: &'static str,
    /// The ports (one, or a range the policies cannot tell apart).
    pub ports: String,
    /// The port the engine is asked about (the range's first).
    pub port: u16,
    /// The last port of the range.
    pub last_port: u16,
    /// The addresses a socket listens on at this port (empty when none does).
    pub listening: Vec<String>,
    /// Who reaches the range through the firewall, per family; empty when nobody.
    pub reachable: Vec<String>,
}

impl ListenSubject {
    /// `tcp/22` or `tcp/23-178`: the finding's subject.
    pub fn key(&self) -> String {
        format!("{}/{}", self.protocol, self.ports)
    }
}

/// The boundaries of the policy data's port sets, per protocol: a port is a boundary
/// when its membership in some set differs from the port before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortSets {
    tcp: BTreeSet<u32>,
    udp: BTreeSet<u32>,
}

impl PortSets {
    /// Reads the port sets the schema names (`@port_sets`, see [`probity::Conventions`])
    /// from the engine's store.
    pub fn from_engine(engine: &Engine) -> Self {
        let mut sets = PortSets::default();
        for set in engine.conventions().port_sets() {
            let protocol = match set.protocol {
                PortProtocol::Tcp => Protocol::Tcp,
                PortProtocol::Udp => Protocol::Udp,
            };
            for entity in engine.entities_json(Some(&set.entity_type)) {
                if let Some(ports) = entity.get("attrs").and_then(|a| a.get(&set.attribute)) {
                    sets.add(protocol, ports);
                }
            }
        }
        sets
    }

    /// Adds the boundaries of a JSON array of ports.
    pub fn add(&mut self, protocol: Protocol, ports: &Value) {
        let Some(list) = ports.as_array() else {
            return;
        };
        let mut ports: Vec<u32> = list
            .iter()
            .filter_map(|v| v.as_u64())
            .filter_map(|p| u32::try_from(p).ok())
            .filter(|p| *p <= 65_535)
            .collect();
        ports.sort_unstable();
        ports.dedup();
        let target = match protocol {
            Protocol::Tcp => &mut self.tcp,
            Protocol::Udp => &mut self.udp,
        };
        let mut prev: Option<u32> = None;
        for p in ports {
            if prev.is_none_or(|q| q + 1 != p) {
                if let Some(q) = prev {
                    target.insert(q + 1);
                }
                target.insert(p);
            }
            prev = Some(p);
        }
        if let Some(q) = prev {
            target.insert(q + 1);
        }
    }

    fn of(&self, protocol: Protocol) -> &BTreeSet<u32> {
        match protocol {
            Protocol::Tcp => &self.tcp,
            Protocol::Udp => &self.udp,
        }
    }
}

/// The `listen` questions for a cycle, and whether some were left out to stay within
/// `max` (then the node's `unreadable` says so).
pub fn subjects(
    sockets: &[ListeningSocket],
    reach: Option<&Reachability>,
    sets: &PortSets,
    max: usize,
) -> (Vec<ListenSubject>, bool) {
    let mut out = Vec::new();
    let mut truncated = false;
    for protocol in Protocol::ALL {
        let proto_of_socket = match protocol {
            Protocol::Tcp => SockProtocol::Tcp,
            Protocol::Udp => SockProtocol::Udp,
        };
        let listening: Vec<&ListeningSocket> = sockets
            .iter()
            .filter(|s| s.protocol == proto_of_socket && s.scope != Scope::Loopback)
            .collect();
        // Reachable ranges over both families, merged.
        let mut reachable: Vec<(u32, u32)> = reach
            .map(|r| {
                Family::ALL
                    .iter()
                    .flat_map(|f| r.ranges(*f, protocol))
                    .map(|rr| (u32::from(rr.ports.start()), u32::from(rr.ports.end())))
                    .collect()
            })
            .unwrap_or_default();
        let listen_ports: BTreeSet<u32> = listening.iter().map(|s| u32::from(s.port)).collect();
        reachable.extend(listen_ports.iter().map(|p| (*p, *p)));
        let merged = merge(reachable);
        let mut cuts: BTreeSet<u32> = sets.of(protocol).clone();
        for p in &listen_ports {
            cuts.insert(*p);
            cuts.insert(p + 1);
        }
        for (start, end) in merged {
            let mut s = start;
            // BTreeSet::range panics on an empty range: a single port has no inner cut.
            let inner: Vec<u32> = if start < end {
                cuts.range(start + 1..=end).copied().collect()
            } else {
                Vec::new()
            };
            for c in inner.into_iter().chain(std::iter::once(end + 1)) {
                if out.len() >= max {
                    truncated = true;
                    break;
                }
                let e = c - 1;
                out.push(subject(protocol, s, e, &listening, reach));
                s = c;
            }
        }
    }
    (out, truncated)
}

fn subject(
    protocol: Protocol,
    start: u32,
    end: u32,
    listening: &[&ListeningSocket],
    reach: Option<&Reachability>,
) -> ListenSubject {
    let port = u16::try_from(start).unwrap_or(u16::MAX);
    let last_port = u16::try_from(end).unwrap_or(u16::MAX);
    let ports = PortRange::new(port, last_port).unwrap_or(PortRange::single(port));
    let mut addrs: Vec<String> = listening
        .iter()
        .filter(|s| u32::from(s.port) >= start && u32::from(s.port) <= end)
        .map(|s| s.address.to_string())
        .collect();
    addrs.sort();
    addrs.dedup();
    let reachable = reach
        .map(|r| {
            Family::ALL
                .iter()
                .filter_map(|f| r.exposure(*f, protocol, port).map(|e| format!("{f} {e}")))
                .collect()
        })
        .unwrap_or_default();
    ListenSubject {
        protocol: protocol.name(),
        ports: ports.to_string(),
        port,
        last_port,
        listening: addrs,
        reachable,
    }
}

/// Sorted, disjoint, non-adjacent intervals covering the same ports.
fn merge(mut v: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    v.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 + 1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use probity_collect::sockets::{Family as SockFamily, ServesIpv4};
    use serde_json::json;

    fn sock(port: u16, scope: Scope) -> ListeningSocket {
        ListeningSocket {
            protocol: SockProtocol::Tcp,
            family: SockFamily::V4,
            address: "0.0.0.0".parse().unwrap(),
            port,
            uid: 0,
            inode: 1,
            scope,
        }
    }

    fn sets() -> PortSets {
        let mut s = PortSets::default();
        s.add(Protocol::Tcp, &json!([22, 179, 10250, 30000, 30001, 30002]));
        s
    }

    #[test]
    fn boundaries_are_where_set_membership_changes() {
        let s = sets();
        let want: BTreeSet<u32> = [22, 23, 179, 180, 10250, 10251, 30000, 30003].into();
        assert_eq!(s.tcp, want);
    }

    #[test]
    fn each_listening_socket_is_its_own_question_and_loopback_is_none() {
        let sockets = [
            sock(
                22,
                Scope::Wildcard {
                    serves_ipv4: ServesIpv4::Yes,
                },
            ),
            sock(8080, Scope::Specific),
            sock(9090, Scope::Loopback),
        ];
        let (subjects, truncated) = subjects(&sockets, None, &sets(), 100);
        assert!(!truncated);
        let keys: Vec<String> = subjects.iter().map(ListenSubject::key).collect();
        assert_eq!(keys, ["tcp/22", "tcp/8080"]);
        assert_eq!(subjects[1].listening, ["0.0.0.0"]);
        assert!(subjects[1].reachable.is_empty());
    }

    #[test]
    fn a_wide_open_firewall_is_cut_at_the_set_boundaries_only() {
        let dump = br#"{"nftables": []}"#;
        let rs = probity_firewall::nft::parse(dump).unwrap();
        let reach = probity_firewall::reduce(&probity_firewall::Inputs {
            nft: Some(&rs),
            iptables: vec![],
        });
        let (subjects, _) = subjects(&[sock(8080, Scope::Specific)], Some(&reach), &sets(), 100);
        let tcp: Vec<String> = subjects
            .iter()
            .filter(|s| s.protocol == "tcp")
            .map(ListenSubject::key)
            .collect();
        assert_eq!(
            tcp,
            [
                "tcp/0-21",
                "tcp/22",
                "tcp/23-178",
                "tcp/179",
                "tcp/180-8079",
                "tcp/8080",
                "tcp/8081-10249",
                "tcp/10250",
                "tcp/10251-29999",
                "tcp/30000-30002",
                "tcp/30003-65535"
            ]
        );
        let udp: Vec<String> = subjects
            .iter()
            .filter(|s| s.protocol == "udp")
            .map(ListenSubject::key)
            .collect();
        assert_eq!(udp, ["udp/0-65535"]);
        assert!(subjects.iter().all(|s| !s.reachable.is_empty()));
    }

    #[test]
    fn the_number_of_questions_is_bounded() {
        let sockets: Vec<ListeningSocket> =
            (1000..1100).map(|p| sock(p, Scope::Specific)).collect();
        let (subjects, truncated) = subjects(&sockets, None, &PortSets::default(), 10);
        assert_eq!(subjects.len(), 10);
        assert!(truncated);
    }
}
