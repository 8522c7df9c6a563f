//! Real rulesets loaded with the real tools in a namespace per test, read back with the
//! real `nft -j` and `iptables-save`, reduced, and checked against real connections from
//! the root namespace, per family and protocol.
//!
//! `PROBITY_FW_WRITE_FIXTURES=1` saves the dumps read here under
//! testdata/fixtures/firewall/ (how the committed `netns-*` fixtures were made).

use std::net::SocketAddr;

use probity_firewall::apply::{
    self, ApplyError, ApplyOptions, ControlPlane, Lockout, Mode, Outcome,
};
use probity_firewall::baseline::{self, Allowance, Baseline, FamilyScope};
use probity_firewall::source;
use probity_firewall::{
    Family, Inputs, Note, PortRange, Protocol, Reachability, iptables, nft, reduce,
};

use super::fixture_dir;
use super::fixtures::show;
use super::netns::Netns;

const V4: Family = Family::Ipv4;
const V6: Family = Family::Ipv6;
const TCP: Protocol = Protocol::Tcp;
const UDP: Protocol = Protocol::Udp;

fn save(name: &str, bytes: &[u8]) {
    if std::env::var_os("PROBITY_FW_WRITE_FIXTURES").is_some() {
        std::fs::write(fixture_dir().join(name), bytes).unwrap();
    }
}

/// Every (family, protocol, port) combination of the given ports.
fn probes(tcp: &[u16], udp: &[u16]) -> Vec<(Family, Protocol, u16)> {
    let mut out = Vec::new();
    for family in Family::ALL {
        out.extend(tcp.iter().map(|&p| (family, TCP, p)));
        out.extend(udp.iter().map(|&p| (family, UDP, p)));
    }
    out
}

/// Asserts that the reduction admits exactly the connections that got through.
fn assert_matches_reality(ns: &Netns, reach: &Reachability, probes: &[(Family, Protocol, u16)]) {
    let actual = ns.probe_all(probes);
    let mut mismatches = Vec::new();
    for (&(family, protocol, port), &got) in probes.iter().zip(&actual) {
        let predicted = reach.admits(protocol, port, &ns.host_addr(family));
        if predicted != got {
            mismatches.push(format!(
                "{family} {protocol} {port}: reduction says {predicted}, connection {got}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn nft_ruleset_with_extra_open_ports_matches_real_connections() {
    let mut ns = Netns::new();
    let tcp = [2222, 2379, 2380, 8080, 9000, 10250, 11000];
    let udp = [53, 4789, 5000];
    ns.listen(&tcp, &udp);
    ns.nft_load(
        r#"table inet filter {
	set allowed_tcp {
		type inet_service
		elements = { 2222, 2379, 2380 }
	}
	chain input {
		type filter hook input priority filter; policy drop;
		ct state established,related accept
		iif "lo" accept
		ct state invalid drop
		meta l4proto ipv6-icmp accept
		tcp dport @allowed_tcp accept
		ip saddr 10.0.0.0/8 tcp dport 10250 accept
		ip saddr 192.0.2.0/24 tcp dport 9000 accept
		tcp dport 8080 accept
		udp dport 53 accept
		meta nfproto ipv6 udp dport 5000 accept
		tcp dport 11000 drop
		tcp dport 11000 accept
	}
}
"#,
    );
    let dump = ns.dump_nft();
    save("netns-nft-extra-ports.json", &dump);
    let rs = nft::parse(&dump).unwrap();
    let reach = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert_eq!(
        show(&reach, V4, TCP),
        "2222 any; 2379-2380 any; 8080 any; 9000 192.0.2.0/24; 10250 10.0.0.0/8"
    );
    assert_eq!(show(&reach, V6, TCP), "2222 any; 2379-2380 any; 8080 any");
    assert_eq!(show(&reach, V4, UDP), "53 any");
    assert_eq!(show(&reach, V6, UDP), "53 any; 5000 any");
    assert!(reach.uncertainties.is_empty(), "{:#?}", reach.uncertainties);
    assert_matches_reality(&ns, &reach, &probes(&tcp, &udp));

    // Against a baseline of 2222 and 2379-2380, 8080 and the rest are excess.
    let b = Baseline {
        role: "etcd".into(),
        allow: vec![
            Allowance::any(TCP, PortRange::single(2222)),
            Allowance::any(TCP, PortRange::new(2379, 2380).unwrap()),
        ],
    };
    let c = baseline::check(&reach, &b);
    let excess: Vec<String> = c
        .excess
        .iter()
        .map(|f| format!("{} {} {}", f.family, f.protocol, f.ports))
        .collect();
    assert_eq!(
        excess,
        [
            "IPv4 tcp 8080",
            "IPv4 tcp 9000",
            "IPv4 tcp 10250",
            "IPv4 udp 53",
            "IPv6 tcp 8080",
            "IPv6 udp 53",
            "IPv6 udp 5000"
        ]
    );
    assert!(c.missing.is_empty());
}

const IPTABLES_V4: &str = "*filter
:INPUT DROP [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:SERVICES - [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p tcp -m multiport --dports 2379,2380 -j ACCEPT
-A INPUT -s 10.0.0.0/8 -p tcp -m tcp --dport 10250 -m comment --comment \"kubelet from cluster\" -j ACCEPT
-A INPUT -p tcp -m conntrack --ctstate NEW -j SERVICES
-A INPUT -p udp -m multiport --dports 4000:4010 -j ACCEPT
-A SERVICES -p tcp -m tcp --dport 7001 -j RETURN
-A SERVICES -p tcp -m multiport --dports 7000:7002 -j ACCEPT
COMMIT
";

const IPTABLES_V6: &str = "*filter
:INPUT DROP [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p ipv6-icmp -j ACCEPT
-A INPUT -p tcp -m multiport --dports 2379,2380 -j ACCEPT
-A INPUT -p tcp -m tcp --dport 7000 -m limit --limit 100/sec -j ACCEPT
COMMIT
";

#[test]
fn iptables_nft_table_is_read_with_iptables_save() {
    let mut ns = Netns::new();
    let tcp = [2379, 2380, 7000, 7001, 7002, 8080, 10250];
    let udp = [4000, 4005, 4011];
    ns.listen(&tcp, &udp);
    ns.iptables_restore(V4, IPTABLES_V4);
    ns.iptables_restore(V6, IPTABLES_V6);
    let nft_dump = ns.dump_nft();
    let v4 = ns.dump_iptables(V4);
    let v6 = ns.dump_iptables(V6);
    save("netns-iptables-nft.json", &nft_dump);
    save("netns-iptables-save.txt", &v4);
    save("netns-ip6tables-save.txt", &v6);

    let rs = nft::parse(&nft_dump).unwrap();
    // nft shows the iptables-nft matches as opaque xt objects.
    assert!(rs.table_uses_xt(nft::TableFamily::Ip, "filter"));
    let nft_only = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert!(nft_only.notes.contains(&Note::XtWithoutIptablesView {
        family: "ip".into(),
        table: "filter".into()
    }));
    assert!(!nft_only.uncertainties.is_empty());

    // Through the library's own sources: nft, iptables-save and ip6tables-save.
    let snapshot = source::read(&ns.sources());
    let reach = snapshot.reduce();
    assert!(reach.notes.contains(&Note::TableFromIptables {
        family: "ip".into(),
        table: "filter".into()
    }));
    assert!(reach.notes.contains(&Note::TableFromIptables {
        family: "ip6".into(),
        table: "filter".into()
    }));
    assert_eq!(
        show(&reach, V4, TCP),
        "2379-2380 any; 7000 any; 7002 any; 10250 10.0.0.0/8"
    );
    assert_eq!(show(&reach, V4, UDP), "4000-4010 any");
    // The rate limit on 7000 is undecidable: counted as reachable, and said so.
    assert_eq!(show(&reach, V6, TCP), "2379-2380 any; 7000 any");
    let limit = reach.uncertainties.iter().find(|u| u.family == V6).unwrap();
    assert!(limit.reason.contains("--limit"), "{}", limit.reason);
    let rule = limit.rule.as_ref().unwrap();
    let line = String::from_utf8_lossy(&v6)
        .lines()
        .nth(rule.line.unwrap() - 1)
        .unwrap()
        .to_owned();
    assert_eq!(line, rule.text);
    assert!(line.contains("--dport 7000"), "{line}");
    assert_matches_reality(&ns, &reach, &probes(&tcp, &udp));

    // The same from the parsed dumps.
    let d4 = iptables::parse(&v4, V4).unwrap();
    let d6 = iptables::parse(&v6, V6).unwrap();
    let again = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![&d4, &d6],
    });
    assert_eq!(again.ports, reach.ports);
}

#[test]
fn native_nft_and_iptables_nft_tables_together() {
    let mut ns = Netns::new();
    let tcp = [2379, 2380, 8080, 9090, 9091];
    let udp = [53];
    ns.listen(&tcp, &udp);
    ns.iptables_restore(
        V4,
        "*filter
:INPUT DROP [0:0]
-A INPUT -p tcp -m multiport --dports 2379,2380,8080,9090 -j ACCEPT
-A INPUT -p udp -m udp --dport 53 -j ACCEPT
COMMIT
",
    );
    // A native table at a later priority that drops 8080 and accepts the rest.
    ns.nft_load(
        r#"table inet native {
	chain input {
		type filter hook input priority 10; policy accept;
		tcp dport 8080 drop
		tcp dport 9091 accept
	}
}
"#,
    );
    let dump = ns.dump_nft();
    save("netns-native-and-iptables-nft.json", &dump);
    let reach = source::read(&ns.sources()).reduce();
    let chains: Vec<String> = reach
        .filters
        .iter()
        .map(|f| format!("{} {} {}", f.source, f.family, f.table))
        .collect();
    assert_eq!(
        chains,
        ["iptables (nf_tables) ip filter", "nft inet native"]
    );
    // IPv4: iptables admits 2379, 2380, 8080, 9090; the native table then drops 8080.
    assert_eq!(show(&reach, V4, TCP), "2379-2380 any; 9090 any");
    assert_eq!(show(&reach, V4, UDP), "53 any");
    // IPv6: only the native table filters.
    assert_eq!(show(&reach, V6, TCP), "0-8079 any; 8081-65535 any");
    assert_matches_reality(&ns, &reach, &probes(&tcp, &udp));
}

fn node_baseline(ssh: u16) -> Baseline {
    Baseline {
        role: "gpu-worker".into(),
        allow: vec![
            Allowance::any(TCP, PortRange::single(ssh)),
            Allowance::any(TCP, PortRange::new(2379, 2380).unwrap()),
            Allowance {
                protocol: TCP,
                ports: PortRange::single(10250),
                sources: vec!["10.0.0.0/8".parse().unwrap()],
                family: FamilyScope::Ipv4,
            },
            Allowance {
                protocol: UDP,
                ports: PortRange::single(4789),
                sources: vec![],
                family: FamilyScope::Both,
            },
        ],
    }
}

#[test]
fn apply_makes_check_clean_keeps_ssh_and_reapplies_as_unchanged() {
    let mut ns = Netns::new();
    let ssh = 2222;
    ns.sshd(ssh);
    let tcp = [2379, 2380, 8080, 10250];
    let udp = [4789, 5353];
    ns.listen(&tcp, &udp);
    let b = node_baseline(ssh);
    let script = baseline::render(&b).unwrap();
    let host = ns.host_addr(V4);
    let options = ApplyOptions {
        mode: Mode::DryRun,
        ssh_ports: vec![ssh],
        control_plane: Some(ControlPlane::Outbound {
            remote: SocketAddr::new(host, 2379),
        }),
        sources: ns.sources(),
        ..ApplyOptions::default()
    };

    // Dry run: the change is reported, nothing is loaded.
    let dry = apply::apply(&script, &options).unwrap();
    assert_eq!(dry.outcome, Outcome::WouldApply);
    assert!(!dry.change.table_loaded);
    assert!(
        dry.change
            .added
            .iter()
            .any(|a| a.contains("tcp dport 2222 accept")),
        "{:?}",
        dry.change.added
    );
    assert!(dry.lockouts.is_empty(), "{:?}", dry.lockouts);
    assert!(nft::parse(&ns.dump_nft()).unwrap().tables.is_empty());

    let enforce = ApplyOptions {
        mode: Mode::Enforce,
        ..options.clone()
    };
    let applied = apply::apply(&script, &enforce).unwrap();
    assert_eq!(applied.outcome, Outcome::Applied);
    assert_eq!(applied.read_back_matches, Some(true));
    let dump = ns.dump_nft();
    save("netns-probity-baseline.json", &dump);

    let reach = source::read(&ns.sources()).reduce();
    let compliance = baseline::check(&reach, &b);
    assert!(compliance.is_clean(), "{compliance:#?}");
    assert_eq!(
        show(&reach, V4, TCP),
        "2222 any; 2379-2380 any; 10250 10.0.0.0/8"
    );
    assert_eq!(show(&reach, V6, TCP), "2222 any; 2379-2380 any");

    // Neighbour discovery must get through the table for IPv6 to work at all.
    ns.flush_neighbours();
    assert!(
        ns.ssh_banner(V4, ssh) && ns.ssh_banner(V6, ssh),
        "sshd not reachable after apply"
    );
    assert_matches_reality(&ns, &reach, &probes(&tcp, &udp));

    let again = apply::apply(&script, &enforce).unwrap();
    assert_eq!(again.outcome, Outcome::Unchanged);
    assert!(again.change.added.is_empty() && again.change.removed.is_empty());
    let dry_again = apply::apply(&script, &options).unwrap();
    assert_eq!(dry_again.outcome, Outcome::Unchanged);

    // A hand edit is a change, and the next apply replaces the table whole.
    ns.nft_load("add rule inet probity input tcp dport 8080 accept\n");
    let drifted = apply::apply(&script, &options).unwrap();
    assert_eq!(drifted.outcome, Outcome::WouldApply);
    assert_eq!(
        drifted.change.removed,
        ["rule in input: tcp dport 8080 accept"]
    );
    assert_eq!(
        apply::apply(&script, &enforce).unwrap().outcome,
        Outcome::Applied
    );
    assert!(
        !source::read(&ns.sources())
            .reduce()
            .is_reachable(V4, TCP, 8080)
    );
}

#[test]
fn apply_refuses_a_baseline_that_drops_the_ssh_port_or_the_control_plane() {
    let mut ns = Netns::new();
    let ssh = 2200;
    ns.sshd(ssh);
    // A baseline without the sshd port.
    let script = baseline::render(&Baseline {
        role: "locked".into(),
        allow: vec![Allowance::any(TCP, PortRange::single(22))],
    })
    .unwrap();
    let options = ApplyOptions {
        mode: Mode::Enforce,
        ssh_ports: vec![ssh],
        sources: ns.sources(),
        ..ApplyOptions::default()
    };
    let err = apply::apply(&script, &options).unwrap_err();
    let ApplyError::WouldLockOut { lockouts, .. } = &err else {
        panic!("expected a refusal, got {err}");
    };
    assert_eq!(lockouts.len(), 2);
    assert!(matches!(
        lockouts[0],
        Lockout::Ssh {
            port: 2200,
            family: Family::Ipv4,
            ..
        }
    ));
    assert!(
        err.to_string()
            .starts_with("refusing to apply: sshd port 2200 over IPv4"),
        "{err}"
    );
    // Nothing was loaded; sshd still answers.
    assert!(nft::parse(&ns.dump_nft()).unwrap().tables.is_empty());
    assert!(ns.ssh_banner(V4, ssh));

    // The control plane dialing in to the agent's port, which the baseline does not allow.
    let cp = ApplyOptions {
        ssh_ports: vec![],
        control_plane: Some(ControlPlane::Inbound {
            remote: ns.host_addr(V6),
            local_port: 9443,
        }),
        ..options.clone()
    };
    let err = apply::apply(&script, &cp).unwrap_err();
    assert!(
        matches!(&err, ApplyError::WouldLockOut { lockouts, .. } if matches!(lockouts[..], [Lockout::ControlPlane { .. }])),
        "{err}"
    );

    // A dry run lists the lock-outs without failing.
    let dry = apply::apply(
        &script,
        &ApplyOptions {
            mode: Mode::DryRun,
            ..options.clone()
        },
    )
    .unwrap();
    assert_eq!(dry.outcome, Outcome::WouldApply);
    assert_eq!(dry.lockouts.len(), 2);

    // Overridden explicitly, it applies, and sshd is indeed cut off.
    let forced = apply::apply(
        &script,
        &ApplyOptions {
            dangerously_allow_lockout: true,
            ..options
        },
    )
    .unwrap();
    assert_eq!(forced.outcome, Outcome::Applied);
    assert!(forced.lockout_overridden);
    assert!(!ns.ssh_banner(V4, ssh));
}
