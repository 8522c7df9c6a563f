//! Malformed input, made by mutating the fixtures with a fixed-seed generator: the
//! parsers never panic, and either return a value (which the reduction takes) or an error
//! that says where.

use probity_firewall::{Family, Inputs, iptables, nft, reduce};

use super::{fixture, fixture_dir};

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn mutate(rng: &mut XorShift, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    match rng.below(5) {
        0 => v.truncate(rng.below(v.len() + 1)),
        1 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(v.len());
                if let Some(b) = v.get_mut(i) {
                    *b ^= 1 << rng.below(8);
                }
            }
        }
        2 | 3 => {
            // Duplicate or drop a line.
            let lines: Vec<&[u8]> = input.split(|&b| b == b'\n').collect();
            let i = rng.below(lines.len());
            let mut out = Vec::new();
            for (j, l) in lines.iter().enumerate() {
                if j == i && rng.below(2) == 0 {
                    continue;
                }
                out.extend_from_slice(l);
                out.push(b'\n');
                if j == i {
                    out.extend_from_slice(l);
                    out.push(b'\n');
                }
            }
            v = out;
        }
        _ => {
            let i = rng.below(v.len() + 1);
            let junk: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
            v.splice(i..i, junk);
        }
    }
    v
}

fn corpus(ext: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .map(|p| {
            let name = p.file_name().unwrap().to_str().unwrap().to_owned();
            (name.clone(), fixture(&name))
        })
        .collect();
    out.sort();
    out
}

#[test]
fn mutated_nft_json_never_panics_and_errors_are_located() {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let (mut ok, mut err) = (0, 0);
    for (name, bytes) in corpus("json") {
        for _ in 0..600 {
            let input = mutate(&mut rng, &bytes);
            match nft::parse(&input) {
                Ok(rs) => {
                    ok += 1;
                    let _ = reduce(&Inputs {
                        nft: Some(&rs),
                        iptables: vec![],
                    });
                }
                Err(e) => {
                    err += 1;
                    let msg = e.to_string();
                    assert!(
                        msg.contains("line ") || msg.contains(" at /"),
                        "{name}: unlocated error {msg:?}"
                    );
                }
            }
        }
    }
    assert!(ok > 0 && err > 0, "ok {ok}, err {err}");
}

#[test]
fn mutated_iptables_save_never_panics_and_errors_are_located() {
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let (mut ok, mut err) = (0, 0);
    for (name, bytes) in corpus("txt") {
        let family = super::fixtures::iptables_family(&name);
        for _ in 0..1500 {
            let input = mutate(&mut rng, &bytes);
            match iptables::parse(&input, family) {
                Ok(d) => {
                    ok += 1;
                    let _ = reduce(&Inputs {
                        nft: None,
                        iptables: vec![&d],
                    });
                }
                Err(e) => {
                    err += 1;
                    assert!(
                        e.to_string().starts_with("line "),
                        "{name}: unlocated error {e}"
                    );
                }
            }
        }
    }
    assert!(ok > 0 && err > 0, "ok {ok}, err {err}");
}

#[test]
fn a_ten_megabyte_dump_is_handled_and_a_larger_one_refused() {
    // 10 MB of rules: parsed within the default limit.
    let mut doc = String::from(
        r#"{"nftables": [{"table": {"family": "inet", "name": "f"}},
        {"chain": {"family": "inet", "table": "f", "name": "in", "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}}"#,
    );
    let mut i = 0u32;
    while doc.len() < 10_000_000 {
        doc.push_str(&format!(
            r#",{{"rule": {{"family": "inet", "table": "f", "chain": "in", "handle": {i}, "expr": [{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "tcp", "field": "dport"}}}}, "right": {}}}}}, {{"accept": null}}]}}}}"#,
            i % 65536
        ));
        i += 1;
    }
    doc.push_str("]}");
    let rs = nft::parse(doc.as_bytes()).unwrap();
    assert_eq!(rs.rules.len(), i as usize);
    let r = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert!(r.is_reachable(Family::Ipv4, probity_firewall::Protocol::Tcp, 100));
    let e = nft::parse_with_limit(doc.as_bytes(), 1 << 20).unwrap_err();
    assert!(
        e.to_string().contains("more than the limit of 1048576"),
        "{e}"
    );
    let text = "x".repeat(2 << 20);
    let e = iptables::parse_with_limit(text.as_bytes(), Family::Ipv4, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("more than the limit"), "{e}");
}
