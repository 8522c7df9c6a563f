//! Every parser of the crate takes untrusted bytes: thousands of mutations of real inputs
//! (truncation, byte flips, duplicated lines, spliced bytes) must give a value or a
//! located error, never a panic.

use std::path::Path;

use probity_agent::config::ConfigError;
use probity_agent::elevation::parse_position;
use probity_agent::sources::parse_proc_stat_cpus;
use probity_agent::status::{Status, StatusError};

/// A fixed-seed xorshift64 generator.
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

const INTERESTING: &[&[u8]] = &[
    b"\"",
    b"[",
    b"]",
    b"=",
    b"\n",
    b"\xff",
    b"-1",
    b"99999999999999999999",
    b"0",
    b"#",
    b"{",
    b"}",
    b"\\",
    b"\x00",
    b"[[x]]",
    b"\"\"\"",
];

fn mutate(rng: &mut XorShift, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..=rng.below(3) {
        match rng.below(5) {
            0 => v.truncate(rng.below(v.len() + 1)),
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            2 => {
                let lines: Vec<&[u8]> = v.split(|&b| b == b'\n').collect();
                let i = rng.below(lines.len());
                let mut out = Vec::new();
                for (k, l) in lines.iter().enumerate() {
                    out.extend_from_slice(l);
                    out.push(b'\n');
                    if k == i {
                        out.extend_from_slice(l);
                        out.push(b'\n');
                    }
                }
                v = out;
            }
            3 => {
                let i = rng.below(v.len() + 1);
                let piece = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(i..i, piece.iter().copied());
            }
            _ if !v.is_empty() => {
                let i = rng.below(v.len());
                v.remove(i);
            }
            _ => {}
        }
    }
    v
}

#[test]
fn configurations_parse_or_fail_located() {
    let base =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("probity-agent.toml")).unwrap();
    let mut rng = XorShift(0x5eed_a9e7);
    let (mut ok, mut located) = (0, 0);
    for _ in 0..3000 {
        let m = mutate(&mut rng, &base);
        let Ok(text) = std::str::from_utf8(&m) else {
            continue;
        };
        match probity_agent::Config::parse("m.toml", text, Path::new("/nonexistent")) {
            Ok(_) => ok += 1,
            Err(ConfigError::Invalid(l)) => {
                located += 1;
                let lines = text.split('\n').count();
                if l.file == "m.toml" {
                    assert!(l.line >= 1 && l.line <= lines, "{l} of {lines} lines");
                    assert!(l.offset <= text.len(), "{l}");
                }
            }
            // An inventory.file that a mutation pointed somewhere.
            Err(ConfigError::Read { .. } | ConfigError::TooLarge { .. }) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(ok > 100 && located > 100, "ok {ok}, located {located}");
}

#[test]
fn proc_stat_counts_or_fails_located() {
    let base = b"cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 5 0 5 50 0 0 0 0 0 0\ncpu1 5 0 5 50 0 0 0 0 0 0\nintr 1 2 3\nctxt 99\nbtime 1700000000\n";
    let mut rng = XorShift(0x0bad_5eed);
    for _ in 0..5000 {
        let m = mutate(&mut rng, base);
        match parse_proc_stat_cpus(&m) {
            Ok(n) => assert!(n >= 1),
            Err(e) => {
                let text = e.to_string();
                assert!(!text.is_empty());
            }
        }
    }
    // This machine's own.
    let own = std::fs::read("/proc/stat").unwrap();
    assert!(parse_proc_stat_cpus(&own).unwrap() >= 1);
}

#[test]
fn positions_parse_or_fail_located() {
    let base = b"2049 131077 4096\n";
    let mut rng = XorShift(0xfeed_f00d);
    for _ in 0..5000 {
        let m = mutate(&mut rng, base);
        if let Err(probity_agent::elevation::PositionError::Syntax { column, .. }) =
            parse_position(&m)
        {
            assert!(column >= 1 && column <= m.len() + 1, "{column} in {m:?}");
        }
    }
}

#[test]
fn status_files_parse_or_fail_located() {
    let dir = tempfile::tempdir().unwrap();
    let node = crate::support::FakeNode::new();
    let config = node.config("", "");
    let (engine, _) = crate::support::engine(None, false);
    let mut agent = crate::support::agent(config, engine);
    agent.cycle();
    agent.status().write(dir.path()).unwrap();
    let base = std::fs::read(dir.path().join(probity_agent::status::STATUS_FILE)).unwrap();
    assert!(Status::parse(Path::new("s"), &base).is_ok());
    let mut rng = XorShift(0x5747_0001);
    for _ in 0..2000 {
        let m = mutate(&mut rng, &base);
        match Status::parse(Path::new("s"), &m) {
            Ok(_) => {}
            Err(StatusError::Parse { line, .. }) => {
                assert!(line >= 1 && line <= m.split(|&b| b == b'\n').count() + 1);
            }
            Err(e) => panic!("{e}"),
        }
    }
}
