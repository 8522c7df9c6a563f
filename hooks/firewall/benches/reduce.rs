//! The reduction of a generated 10,000-rule ruleset (target: median under 100 ms), and
//! for scale the parse of the same dump.
//!
//! The ruleset mixes what real ones hold: single ports, ranges, anonymous and named sets,
//! IPv4 and IPv6 source restrictions, jumps into regular chains with returns, and
//! undecidable matches. Run: `cargo bench --bench reduce`.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use probity_firewall::{Inputs, nft, reduce};

const RULES: usize = 10_000;
const SUBCHAINS: usize = 20;

fn dport(proto: &str, right: &str) -> String {
    format!(
        r#"{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "{proto}", "field": "dport"}}}}, "right": {right}}}}}"#
    )
}

fn saddr(hdr: &str, addr: &str, len: u8) -> String {
    format!(
        r#"{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "{hdr}", "field": "saddr"}}}}, "right": {{"prefix": {{"addr": "{addr}", "len": {len}}}}}}}}}"#
    )
}

/// An `nft -j` dump with `RULES` rules.
pub fn generate() -> String {
    let mut items: Vec<String> = vec![
        r#"{"table": {"family": "inet", "name": "big", "handle": 1}}"#.into(),
        r#"{"chain": {"family": "inet", "table": "big", "name": "input", "handle": 1, "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}}"#.into(),
    ];
    for s in 0..10 {
        let elems: Vec<String> = (0..20)
            .map(|k| (45000 + s * 100 + k * 3).to_string())
            .collect();
        items.push(format!(
            r#"{{"set": {{"family": "inet", "name": "ports{s}", "table": "big", "type": "inet_service", "handle": {}, "elem": [{}]}}}}"#,
            100 + s,
            elems.join(", ")
        ));
    }
    for c in 0..SUBCHAINS {
        items.push(format!(
            r#"{{"chain": {{"family": "inet", "table": "big", "name": "sub{c}", "handle": {}}}}}"#,
            200 + c
        ));
    }
    let mut rule = |chain: &str, exprs: Vec<String>, handle: usize| {
        items.push(format!(
            r#"{{"rule": {{"family": "inet", "table": "big", "chain": "{chain}", "handle": {handle}, "expr": [{}]}}}}"#,
            exprs.join(", ")
        ));
    };
    let accept = || r#"{"accept": null}"#.to_owned();
    let drop = || r#"{"drop": null}"#.to_owned();
    rule(
        "input",
        vec![
            r#"{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}}"#.into(),
            accept(),
        ],
        1000,
    );
    let per_sub = 10;
    let mut n = 1;
    for c in 0..SUBCHAINS {
        for k in 0..per_sub {
            let port = 45000 + c * 10 + k;
            let v = if k % 3 == 0 {
                r#"{"return": null}"#.to_owned()
            } else {
                accept()
            };
            rule(
                &format!("sub{c}"),
                vec![dport("tcp", &port.to_string()), v],
                2000 + n,
            );
            n += 1;
        }
    }
    let mut i = 0;
    while n < RULES {
        let h = 10_000 + i;
        let exprs = match i % 10 {
            0..=4 => vec![dport("tcp", &(1000 + i).to_string()), accept()],
            5 => vec![
                dport(
                    "udp",
                    &format!(r#"{{"range": [{}, {}]}}"#, 20000 + i, 20005 + i),
                ),
                drop(),
            ],
            6 => vec![
                saddr("ip", &format!("10.{}.{}.0", (i >> 8) & 255, i & 255), 24),
                dport("tcp", &(30000 + i % 1000).to_string()),
                accept(),
            ],
            7 => vec![
                saddr("ip6", &format!("fd00:{:x}::", i), 32),
                dport("tcp", &(40000 + i % 500).to_string()),
                accept(),
            ],
            8 => vec![
                dport("tcp", &format!(r#""@ports{}""#, i % 10)),
                format!(r#"{{"jump": {{"target": "sub{}"}}}}"#, i % SUBCHAINS),
            ],
            _ => {
                if i % 100 == 9 {
                    vec![
                        r#"{"xt": {"type": "match", "name": "multiport"}}"#.into(),
                        dport("udp", &(50000 + i % 1000).to_string()),
                        accept(),
                    ]
                } else {
                    vec![
                        dport(
                            "th",
                            &format!(
                                r#"{{"set": [{}, {}, {}]}}"#,
                                50000 + i % 1000,
                                51000 + i % 1000,
                                52000 + i % 1000
                            ),
                        ),
                        accept(),
                    ]
                }
            }
        };
        rule("input", exprs, h);
        i += 1;
        n += 1;
    }
    let mut doc = String::from("{\"nftables\": [");
    for (k, item) in items.iter().enumerate() {
        if k > 0 {
            doc.push(',');
        }
        let _ = write!(doc, "{item}");
    }
    doc.push_str("]}");
    doc
}

fn bench(c: &mut Criterion) {
    let doc = generate();
    let rs = nft::parse(doc.as_bytes()).unwrap();
    assert_eq!(rs.rules.len(), RULES);
    let reach = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert!(reach.is_reachable(
        probity_firewall::Family::Ipv4,
        probity_firewall::Protocol::Tcp,
        1000
    ));
    // On a shared machine wall time counts the waits for a core; the thread's own
    // on-CPU time (schedstat, ns) does not. Printed beside criterion's figures.
    let mut cpu: Vec<u64> = (0..21)
        .map(|_| {
            let before = on_cpu_ns();
            black_box(reduce(&Inputs {
                nft: Some(&rs),
                iptables: vec![],
            }));
            on_cpu_ns().saturating_sub(before)
        })
        .collect();
    cpu.sort_unstable();
    if let Some(median) = cpu.get(cpu.len() / 2) {
        println!(
            "reduce_10k_rules on-CPU median over 21 runs: {:.1} ms",
            *median as f64 / 1e6
        );
    }
    let mut g = c.benchmark_group("firewall");
    g.sample_size(30);
    g.bench_function("reduce_10k_rules", |b| {
        b.iter(|| {
            reduce(black_box(&Inputs {
                nft: Some(&rs),
                iptables: vec![],
            }))
        })
    });
    g.bench_function("parse_10k_rules", |b| {
        b.iter(|| nft::parse(black_box(doc.as_bytes())).unwrap())
    });
    g.finish();
}

/// This thread's time on a CPU, from /proc/thread-self/schedstat.
fn on_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

criterion_group!(benches, bench);
criterion_main!(benches);
