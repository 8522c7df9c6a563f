//! One test per reduction rule, on small hand-written rulesets in the JSON nft 1.0.6 prints.

use super::*;
use crate::iptables;

/// Builds an `nft -j` document.
#[derive(Default)]
struct B {
    items: Vec<String>,
}

impl B {
    fn table(mut self, fam: &str, name: &str) -> Self {
        self.items.push(format!(
            r#"{{"table": {{"family": "{fam}", "name": "{name}", "handle": 1}}}}"#
        ));
        self
    }
    fn base(mut self, fam: &str, table: &str, chain: &str, prio: i64, policy: &str) -> Self {
        self.items.push(format!(
            r#"{{"chain": {{"family": "{fam}", "table": "{table}", "name": "{chain}", "handle": 1, "type": "filter", "hook": "input", "prio": {prio}, "policy": "{policy}"}}}}"#
        ));
        self
    }
    fn chain(mut self, fam: &str, table: &str, chain: &str) -> Self {
        self.items.push(format!(
            r#"{{"chain": {{"family": "{fam}", "table": "{table}", "name": "{chain}", "handle": 2}}}}"#
        ));
        self
    }
    fn rule(mut self, fam: &str, table: &str, chain: &str, exprs: &[&str]) -> Self {
        let handle = self.items.len();
        self.items.push(format!(
            r#"{{"rule": {{"family": "{fam}", "table": "{table}", "chain": "{chain}", "handle": {handle}, "expr": [{}]}}}}"#,
            exprs.join(", ")
        ));
        self
    }
    fn raw(mut self, json: &str) -> Self {
        self.items.push(json.to_owned());
        self
    }
    fn parse(self) -> nft::Ruleset {
        let doc = format!(r#"{{"nftables": [{}]}}"#, self.items.join(",\n"));
        nft::parse(doc.as_bytes()).unwrap()
    }
}

/// A one-table `inet f` ruleset with base chain `in`.
fn inet(policy: &str) -> B {
    B::default()
        .table("inet", "f")
        .base("inet", "f", "in", 0, policy)
}

fn dport(proto: &str, right: &str) -> String {
    format!(
        r#"{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "{proto}", "field": "dport"}}}}, "right": {right}}}}}"#
    )
}

fn m(op: &str, left: &str, right: &str) -> String {
    format!(r#"{{"match": {{"op": "{op}", "left": {left}, "right": {right}}}}}"#)
}

const ACCEPT: &str = r#"{"accept": null}"#;
const DROP: &str = r#"{"drop": null}"#;
const RETURN: &str = r#"{"return": null}"#;

fn reach(rs: &nft::Ruleset) -> Reachability {
    reduce(&Inputs {
        nft: Some(rs),
        iptables: vec![],
    })
}

/// The reachable ranges of a family and protocol as text: "22 any; 10250 10.0.0.0/8".
fn show(r: &Reachability, family: Family, protocol: Protocol) -> String {
    r.ranges(family, protocol)
        .iter()
        .map(|x| {
            let e = match &x.exposure {
                Exposure::Any => "any".to_owned(),
                Exposure::Sources(p) => p
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                Exposure::AnyExcept(p) => format!(
                    "any-except {}",
                    p.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            };
            format!("{} {e}", x.ports)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

const V4: Family = Family::Ipv4;
const V6: Family = Family::Ipv6;
const TCP: Protocol = Protocol::Tcp;
const UDP: Protocol = Protocol::Udp;

#[test]
fn policy_accept_with_a_drop_rule() {
    let rs = inet("accept")
        .rule("inet", "f", "in", &[&dport("tcp", "22"), DROP])
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "0-21 any; 23-65535 any");
    assert_eq!(show(&r, V6, TCP), "0-21 any; 23-65535 any");
    assert_eq!(show(&r, V4, UDP), "0-65535 any");
    assert!(r.uncertainties.is_empty());
}

#[test]
fn jump_and_return() {
    let rs = inet("drop")
        .chain("inet", "f", "sub")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &dport("tcp", r#"{"range": [1000, 2000]}"#),
                r#"{"jump": {"target": "sub"}}"#,
            ],
        )
        .rule("inet", "f", "in", &[&dport("tcp", "1501"), ACCEPT])
        .rule("inet", "f", "sub", &[&dport("tcp", "1500"), RETURN])
        .rule("inet", "f", "sub", &[&dport("tcp", "1501"), RETURN])
        .rule("inet", "f", "sub", &[ACCEPT])
        .parse();
    let r = reach(&rs);
    // 1500 returns and meets the policy; 1501 returns and meets the accept after the jump.
    assert_eq!(show(&r, V4, TCP), "1000-1499 any; 1501-2000 any");
}

#[test]
fn goto_returns_to_the_caller_of_the_chain() {
    let build = |verdict: &str| {
        inet("drop")
            .chain("inet", "f", "sub")
            .rule("inet", "f", "in", &[&dport("tcp", "80"), verdict])
            .rule("inet", "f", "in", &[&dport("tcp", "80"), ACCEPT])
            .rule("inet", "f", "sub", &[&dport("tcp", "80"), RETURN])
            .parse()
    };
    let with_goto = reach(&build(r#"{"goto": {"target": "sub"}}"#));
    assert_eq!(show(&with_goto, V4, TCP), "");
    let with_jump = reach(&build(r#"{"jump": {"target": "sub"}}"#));
    assert_eq!(show(&with_jump, V4, TCP), "80 any");
}

#[test]
fn named_interval_set() {
    let rs = inet("drop")
        .raw(r#"{"set": {"family": "inet", "name": "iv", "table": "f", "type": "inet_service", "handle": 4, "flags": ["interval"], "elem": [{"range": [8000, 8100]}, 9000]}}"#)
        .rule("inet", "f", "in", &[&dport("tcp", r#""@iv""#), ACCEPT])
        .rule("inet", "f", "in", &[&dport("udp", r#"{"set": [53, {"range": [60000, 60010]}]}"#), ACCEPT])
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "8000-8100 any; 9000 any");
    assert_eq!(show(&r, V6, UDP), "53 any; 60000-60010 any");
}

#[test]
fn established_only_accept_admits_no_new_connection() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "in",
                    r#"{"ct": {"key": "state"}}"#,
                    r#"["established", "related"]"#,
                ),
                ACCEPT,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "");
    assert_eq!(show(&r, V6, UDP), "");
}

#[test]
fn new_state_and_negated_state() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("in", r#"{"ct": {"key": "state"}}"#, r#""new""#),
                &dport("tcp", "1"),
                ACCEPT,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("!=", r#"{"ct": {"key": "state"}}"#, r#""established""#),
                &dport("tcp", "2"),
                ACCEPT,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "==",
                    r#"{"ct": {"key": "state"}}"#,
                    r#"{"set": ["invalid", "untracked"]}"#,
                ),
                &dport("tcp", "3"),
                ACCEPT,
            ],
        )
        .parse();
    assert_eq!(show(&reach(&rs), V4, TCP), "1-2 any");
}

#[test]
fn loopback_only_accept_admits_no_remote_host() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[&m("==", r#"{"meta": {"key": "iif"}}"#, r#""lo""#), ACCEPT],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("==", r#"{"meta": {"key": "iifname"}}"#, r#""lo""#),
                ACCEPT,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("!=", r#"{"meta": {"key": "iifname"}}"#, r#""lo""#),
                &dport("tcp", "5"),
                ACCEPT,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "5 any");
    assert!(r.uncertainties.is_empty());
}

#[test]
fn source_restricted_accept_reports_the_prefixes() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "==",
                    r#"{"payload": {"protocol": "ip", "field": "saddr"}}"#,
                    r#"{"prefix": {"addr": "10.0.0.0", "len": 8}}"#,
                ),
                &dport("tcp", "10250"),
                ACCEPT,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "==",
                    r#"{"payload": {"protocol": "ip6", "field": "saddr"}}"#,
                    r#"{"set": [{"prefix": {"addr": "fd00::", "len": 8}}, "2001:db8::1"]}"#,
                ),
                &dport("tcp", "10250"),
                ACCEPT,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "10250 10.0.0.0/8");
    assert_eq!(show(&r, V6, TCP), "10250 2001:db8::1/128,fd00::/8");
    assert!(r.admits(TCP, 10250, &"10.1.2.3".parse().unwrap()));
    assert!(!r.admits(TCP, 10250, &"192.0.2.1".parse().unwrap()));
}

#[test]
fn a_drop_for_some_sources_leaves_the_rest() {
    let rs = inet("accept")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "==",
                    r#"{"payload": {"protocol": "ip", "field": "saddr"}}"#,
                    r#""192.0.2.7""#,
                ),
                DROP,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "!=",
                    r#"{"payload": {"protocol": "ip", "field": "saddr"}}"#,
                    r#"{"prefix": {"addr": "10.0.0.0", "len": 8}}"#,
                ),
                &dport("udp", "6000"),
                DROP,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "0-65535 any-except 192.0.2.7/32");
    assert_eq!(
        r.exposure(V4, UDP, 6000),
        Some(&Exposure::Sources(vec!["10.0.0.0/8".parse().unwrap()]))
    );
    assert_eq!(show(&r, V6, TCP), "0-65535 any");
}

#[test]
fn rule_order_a_drop_before_an_accept_wins() {
    let drop_first = inet("drop")
        .rule("inet", "f", "in", &[&dport("tcp", "22"), DROP])
        .rule("inet", "f", "in", &[&dport("tcp", "22"), ACCEPT])
        .parse();
    assert_eq!(show(&reach(&drop_first), V4, TCP), "");
    let accept_first = inet("drop")
        .rule("inet", "f", "in", &[&dport("tcp", "22"), ACCEPT])
        .rule("inet", "f", "in", &[&dport("tcp", "22"), DROP])
        .parse();
    assert_eq!(show(&reach(&accept_first), V4, TCP), "22 any");
}

#[test]
fn two_base_chains_must_both_accept() {
    let rs = B::default()
        .table("inet", "a")
        .base("inet", "a", "early", -10, "accept")
        .rule("inet", "a", "early", &[&dport("tcp", "22"), ACCEPT])
        .table("inet", "b")
        .base("inet", "b", "late", 10, "drop")
        .rule("inet", "b", "late", &[&dport("tcp", "80"), ACCEPT])
        .parse();
    let r = reach(&rs);
    // The early chain's accept ends only that chain; the late chain drops 22.
    assert_eq!(show(&r, V4, TCP), "80 any");
    let order: Vec<i64> = r.filters.iter().map(|f| f.priority).collect();
    assert_eq!(order, [-10, 10]);
}

#[test]
fn families_ip_ip6_and_inet() {
    let rs = B::default()
        .table("ip", "v4")
        .base("ip", "v4", "in", 0, "drop")
        .rule("ip", "v4", "in", &[&dport("tcp", "22"), ACCEPT])
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "22 any");
    assert_eq!(show(&r, V6, TCP), "0-65535 any");
    assert!(r.notes.contains(&Note::NoInputHook { family: V6 }));

    let rs = B::default()
        .table("ip6", "v6")
        .base("ip6", "v6", "in", 0, "drop")
        .table("inet", "both")
        .base("inet", "both", "in", 5, "accept")
        .rule(
            "inet",
            "both",
            "in",
            &[
                &m("==", r#"{"meta": {"key": "nfproto"}}"#, r#""ipv4""#),
                &dport("tcp", "443"),
                DROP,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V6, TCP), "");
    assert_eq!(show(&r, V4, TCP), "0-442 any; 444-65535 any");
}

#[test]
fn protocol_match_without_port() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("==", r#"{"meta": {"key": "l4proto"}}"#, r#""udp""#),
                ACCEPT,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "==",
                    r#"{"payload": {"protocol": "ip", "field": "protocol"}}"#,
                    r#""tcp""#,
                ),
                ACCEPT,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "==",
                    r#"{"payload": {"protocol": "icmpv6", "field": "type"}}"#,
                    r#""echo-request""#,
                ),
                ACCEPT,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, UDP), "0-65535 any");
    assert_eq!(show(&r, V6, UDP), "0-65535 any");
    assert_eq!(show(&r, V4, TCP), "0-65535 any");
    assert_eq!(show(&r, V6, TCP), "");
}

#[test]
fn no_table_on_the_input_hook_means_everything() {
    let rs = B::default()
        .table("inet", "f")
        .raw(r#"{"chain": {"family": "inet", "table": "f", "name": "out", "type": "filter", "hook": "output", "prio": 0, "policy": "drop"}}"#)
        .table("netdev", "nd")
        .parse();
    let r = reach(&rs);
    for f in Family::ALL {
        for p in Protocol::ALL {
            assert_eq!(show(&r, f, p), "0-65535 any");
        }
    }
    assert!(r.notes.contains(&Note::SetAside {
        family: "netdev".into(),
        table: "nd".into()
    }));
    let none = reduce(&Inputs::default());
    assert_eq!(show(&none, V6, UDP), "0-65535 any");
}

#[test]
fn opaque_on_accept_may_accept_and_on_drop_may_not_drop() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("==", r#"{"meta": {"key": "l4proto"}}"#, r#""tcp""#),
                r#"{"xt": {"type": "match", "name": "multiport"}}"#,
                ACCEPT,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "0-65535 any");
    assert_eq!(show(&r, V4, UDP), "");
    let u = r
        .uncertainties
        .iter()
        .find(|u| u.family == V4 && u.protocol == TCP)
        .unwrap();
    assert_eq!(u.effect, Effect::MayAccept);
    assert!(u.reason.contains("xt match multiport"), "{}", u.reason);
    let rule = u.rule.as_ref().unwrap();
    assert_eq!(
        (rule.table.as_str(), rule.chain.as_str(), rule.handle),
        ("f", "in", Some(2))
    );

    let rs = inet("accept")
        .rule(
            "inet",
            "f",
            "in",
            &[
                r#"{"limit": {"rate": 10, "per": "second"}}"#,
                &dport("tcp", "8080"),
                DROP,
            ],
        )
        .rule(
            "inet",
            "f",
            "in",
            &[r#"{"frob": {"x": 1}}"#, &dport("tcp", "8081"), DROP],
        )
        .parse();
    let r = reach(&rs);
    assert!(r.is_reachable(V4, TCP, 8080) && r.is_reachable(V4, TCP, 8081));
    let effects: Vec<(Effect, Vec<PortRange>)> = r
        .uncertainties
        .iter()
        .filter(|u| u.family == V4 && u.protocol == TCP)
        .map(|u| (u.effect, u.ports.clone()))
        .collect();
    assert_eq!(
        effects,
        [
            (Effect::MayNotDrop, vec![PortRange::single(8080)]),
            (Effect::MayNotDrop, vec![PortRange::single(8081)])
        ]
    );
}

#[test]
fn unknown_interface_on_accept_is_an_uncertainty() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m("==", r#"{"meta": {"key": "iifname"}}"#, r#""eth0""#),
                &dport("tcp", "22"),
                ACCEPT,
            ],
        )
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "22 any");
    assert!(
        r.uncertainties[0].reason.contains("meta iifname eth0"),
        "{}",
        r.uncertainties[0].reason
    );
}

#[test]
fn verdict_map_is_a_rule_per_element() {
    let rs = inet("accept")
        .rule("inet", "f", "in", &[r#"{"vmap": {"key": {"payload": {"protocol": "tcp", "field": "dport"}}, "data": {"set": [[22, {"accept": null}], [{"range": [80, 90]}, {"drop": null}]]}}}"#])
        .parse();
    assert_eq!(show(&reach(&rs), V4, TCP), "0-79 any; 91-65535 any");
}

#[test]
fn a_jump_loop_ends_and_is_reported() {
    let rs = inet("drop")
        .chain("inet", "f", "a")
        .chain("inet", "f", "b")
        .rule(
            "inet",
            "f",
            "in",
            &[&dport("tcp", "7"), r#"{"jump": {"target": "a"}}"#],
        )
        .rule("inet", "f", "a", &[r#"{"jump": {"target": "b"}}"#])
        .rule("inet", "f", "b", &[r#"{"jump": {"target": "a"}}"#])
        .parse();
    let r = reach(&rs);
    assert_eq!(show(&r, V4, TCP), "7 any");
    assert!(
        r.uncertainties
            .iter()
            .any(|u| u.reason.contains("(a loop)"))
    );
}

#[test]
fn iptables_rules_reduce_like_nft() {
    let dump = iptables::parse(
        b"*filter
:INPUT DROP [0:0]
:SUB - [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p tcp -m multiport --dports 2379,2380 -j ACCEPT
-A INPUT -s 10.0.0.0/8 -p tcp -m tcp --dport 10250 -j ACCEPT
-A INPUT -p udp -m udp ! --dport 53 -j DROP
-A INPUT -p udp -j SUB
-A SUB -p udp --dport 53 -j RETURN
-A SUB -j ACCEPT
-A INPUT -p udp -m udp --dport 53 -j ACCEPT
-A INPUT -p tcp -m limit --limit 5/min -j DROP
COMMIT
",
        V4,
    )
    .unwrap();
    let r = reduce(&Inputs {
        nft: None,
        iptables: vec![&dump],
    });
    assert_eq!(show(&r, V4, TCP), "2379-2380 any; 10250 10.0.0.0/8");
    assert_eq!(show(&r, V4, UDP), "53 any");
    assert_eq!(show(&r, V6, TCP), "0-65535 any");
    assert_eq!(r.filters[0].source, "iptables (unknown)");
}

#[test]
fn an_iptables_nft_table_is_read_from_iptables_save() {
    let rs = B::default()
        .table("ip", "filter")
        .base("ip", "filter", "INPUT", 0, "drop")
        .rule(
            "ip",
            "filter",
            "INPUT",
            &[
                &m("==", r#"{"meta": {"key": "l4proto"}}"#, r#""tcp""#),
                r#"{"xt": {"type": "match", "name": "multiport"}}"#,
                ACCEPT,
            ],
        )
        .parse();
    let dump = iptables::parse(
        b"# Generated by iptables-save v1.8.9 (nf_tables) on Mon Nov 30 02:19:44 2026
*filter
:INPUT DROP [0:0]
-A INPUT -p tcp -m multiport --dports 2379,2380 -j ACCEPT
COMMIT
",
        V4,
    )
    .unwrap();
    let alone = reach(&rs);
    assert_eq!(show(&alone, V4, TCP), "0-65535 any");
    assert!(alone.notes.contains(&Note::XtWithoutIptablesView {
        family: "ip".into(),
        table: "filter".into()
    }));
    let both = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![&dump],
    });
    assert_eq!(show(&both, V4, TCP), "2379-2380 any");
    assert!(both.notes.contains(&Note::TableFromIptables {
        family: "ip".into(),
        table: "filter".into()
    }));
    assert!(both.uncertainties.is_empty());
    assert_eq!(both.filters.len(), 1);
}

#[test]
fn tcp_syn_flag_matches_a_new_connection() {
    let dump = iptables::parse(
        b"*filter\n:INPUT DROP [0:0]\n-A INPUT -p tcp --syn --dport 22 -j ACCEPT\n-A INPUT -p tcp ! --syn --dport 23 -j ACCEPT\nCOMMIT\n",
        V4,
    )
    .unwrap();
    let r = reduce(&Inputs {
        nft: None,
        iptables: vec![&dump],
    });
    assert_eq!(show(&r, V4, TCP), "22 any");
}

#[test]
fn established_packets_of_a_control_plane_connection() {
    let rs = inet("drop")
        .rule(
            "inet",
            "f",
            "in",
            &[
                &m(
                    "in",
                    r#"{"ct": {"key": "state"}}"#,
                    r#"["established", "related"]"#,
                ),
                ACCEPT,
            ],
        )
        .parse();
    let inputs = Inputs {
        nft: Some(&rs),
        iptables: vec![],
    };
    let remote = "192.0.2.9:2379".parse().unwrap();
    let (ok, _) = admits_established(&inputs, remote, PortRange::new(1024, 65535).unwrap());
    assert!(ok);
    let closed = inet("drop").parse();
    let (ok, _) = admits_established(
        &Inputs {
            nft: Some(&closed),
            iptables: vec![],
        },
        remote,
        PortRange::new(1024, 65535).unwrap(),
    );
    assert!(!ok);
}

#[test]
fn uncertainties_name_the_rule_of_their_own_table() {
    let rs = B::default()
        .table("inet", "a")
        .base("inet", "a", "in", 0, "accept")
        .rule("inet", "a", "in", &[&dport("tcp", "1"), ACCEPT])
        .table("inet", "b")
        .base("inet", "b", "in", 5, "drop")
        .rule(
            "inet",
            "b",
            "in",
            &[r#"{"xt": {"type": "match", "name": "conntrack"}}"#, ACCEPT],
        )
        .parse();
    let r = reach(&rs);
    let rule = r.uncertainties[0].rule.as_ref().unwrap();
    assert_eq!((rule.table.as_str(), rule.handle), ("b", Some(5)));
    assert_eq!(rule.text, "xt match conntrack accept");
}

/// Regression: found by fuzzing iptables-save. Chains that each jump twice to the next
/// made the evaluation take time exponential in their number.
#[test]
fn a_chain_graph_with_many_paths_is_evaluated_within_a_budget() {
    let mut b = inet("drop").rule("inet", "f", "in", &[r#"{"jump": {"target": "c0"}}"#]);
    for k in 0..40 {
        b = b.chain("inet", "f", &format!("c{k}"));
    }
    for k in 0..39 {
        let jump = format!(r#"{{"jump": {{"target": "c{}"}}}}"#, k + 1);
        b = b
            .rule("inet", "f", &format!("c{k}"), &[&dport("tcp", "1"), &jump])
            .rule("inet", "f", &format!("c{k}"), &[&jump]);
    }
    b = b.rule("inet", "f", "c39", &[&dport("tcp", "2"), ACCEPT]);
    let r = reach(&b.parse());
    assert!(r.is_reachable(V4, TCP, 2));
    assert!(
        r.uncertainties
            .iter()
            .any(|u| u.reason.contains("too many rule visits"))
    );

    let dump = iptables::parse(
        b"*filter\n:INPUT DROP [0:0]\n-A INPUT -p tcp --dport 5 -j INPUT\n-A INPUT -j INPUT\n-A INPUT -p tcp --dport 6 -j ACCEPT\nCOMMIT\n",
        V4,
    )
    .unwrap();
    let r = reduce(&Inputs {
        nft: None,
        iptables: vec![&dump],
    });
    assert!(r.is_reachable(V4, TCP, 6));
}
