//! RFC 5424 messages: the test parser checked against the captured samples, records
//! round-tripped through formatter and parser, and every parser fed mutated input.

use std::collections::BTreeMap;

use probity_siem::source::{parse_cursor, parse_line};
use probity_siem::syslog::{ParseError, parse};
use probity_siem::time::{from_unix_micros, parse_rfc3339};
use probity_siem::transport::relp::{MAX_RESPONSE_DATA, parse_frame, response_status};
use probity_siem::{Record, RecordKind, Severity, SyslogConfig, SyslogFormat};

use crate::support::{Chain, SD, fixtures};

/// A fixed-seed xorshift generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % u64::try_from(n.max(1)).unwrap()).unwrap()
    }
    fn string(&mut self, max: usize) -> String {
        const PIECES: &[&str] = &[
            "a", "Z", "0", " ", "\"", "\\", "]", "[", "=", "é", "€", "😀", "\n", "\t", "\u{feff}",
            "-", "\u{0}", "@", "'", "~",
        ];
        (0..self.below(max + 1))
            .map(|_| PIECES[self.below(PIECES.len())])
            .collect()
    }
}

#[test]
fn the_captured_samples_that_are_rfc5424_parse_and_the_malformed_ones_are_rejected() {
    let text = std::fs::read(fixtures().join("syslog/rfc5424-samples.txt")).unwrap();
    let lines: Vec<&[u8]> = text.split(|b| *b == b'\n').collect();
    let outcome = |n: usize| parse(lines[n - 1]);

    let first = outcome(1).unwrap();
    assert_eq!((first.facility, first.severity), (20, 5));
    assert_eq!(first.hostname.as_deref(), Some("192.0.2.1"));
    assert_eq!(first.procid.as_deref(), Some("8710"));
    assert_eq!(first.msg_text(), "%% It's time to make the do-nuts.");
    // -07:00: 05:14:15 local is 12:14:15 UTC.
    assert_eq!(
        first.timestamp,
        Some(parse_rfc3339(b"2003-08-24T12:14:15.000003Z").unwrap())
    );
    assert_eq!(outcome(5).unwrap(), first);

    let su = outcome(3).unwrap();
    assert_eq!(
        (su.facility, su.severity, su.msgid.as_deref()),
        (4, 2, Some("ID47"))
    );
    assert_eq!(
        su.msg_text(),
        "BOM'su root' failed for lonvick on /dev/pts/8"
    );
    assert!(!su.msg_bom, "the capture spells the BOM out as text");

    let event = outcome(7).unwrap();
    assert_eq!(event.param("exampleSDID@32473", "eventID"), Some("10] 11"));
    assert_eq!(
        event.param("exampleSDID@32473", "eventSource"),
        Some("Application")
    );
    assert_eq!(
        event.msg_text(),
        "BOMAn application event log entry..[ ] sadasd"
    );

    let rejected: [(usize, usize, &str); 5] = [
        (2, 9, "a four-digit year"),
        (6, 0, "'<' opening the PRI"),
        (9, 4, "'>' closing the PRI"),
        (10, 0, "'<' opening the PRI"),
        // VERSION 12 is not RFC 5424's version 1.
        (11, 4, "a space after VERSION 1"),
    ];
    for (line, offset, expected) in rejected {
        assert_eq!(
            outcome(line),
            Err(ParseError { offset, expected }),
            "line {line}"
        );
    }
    // Every non-blank line is accounted for.
    let blank: Vec<usize> = (1..=lines.len())
        .filter(|n| lines[n - 1].is_empty())
        .collect();
    assert_eq!(4 + rejected.len() + blank.len(), lines.len());
}

#[test]
fn relp_responses_captured_from_librelp_parse() {
    let bytes = std::fs::read(fixtures().join("syslog/relp-librelp-1.11.0-responses.bin")).unwrap();
    let mut rest = &bytes[..];
    let mut frames = Vec::new();
    while let Some((f, n)) = parse_frame(rest, MAX_RESPONSE_DATA).unwrap() {
        frames.push((
            f.txnr,
            f.command.to_owned(),
            response_status(f.data).map(|(c, _)| c),
        ));
        rest = &rest[n..];
    }
    assert!(rest.is_empty());
    assert_eq!(
        frames,
        [
            (1, "rsp".to_owned(), Some(200)),
            (2, "rsp".to_owned(), Some(200)),
            (3, "rsp".to_owned(), Some(200)),
            (4, "rsp".to_owned(), None),
            (0, "serverclose".to_owned(), None),
        ]
    );
    let (open, _) = parse_frame(&bytes, MAX_RESPONSE_DATA).unwrap().unwrap();
    assert!(open.data.ends_with(b"\ncommands=syslog"));
}

fn random_record(rng: &mut Rng, seq: u64) -> Record {
    let mut fields = BTreeMap::new();
    for _ in 0..rng.below(6) {
        fields.insert(rng.string(40), rng.string(200));
    }
    Record {
        seq,
        hash: std::array::from_fn(|_| u8::try_from(rng.next() & 0xff).unwrap()),
        prev_hash: std::array::from_fn(|_| u8::try_from(rng.next() & 0xff).unwrap()),
        time: from_unix_micros(i64::try_from(rng.next() % 253_402_300_799_999_999).unwrap()),
        kind: RecordKind::ALL[rng.below(RecordKind::ALL.len())],
        severity: Severity::ALL[rng.below(Severity::ALL.len())],
        node: (rng.below(3) > 0).then(|| rng.string(300)),
        policy: (rng.below(3) > 0).then(|| rng.string(40)),
        message: rng.string(3000),
        fields,
    }
}

#[test]
fn random_records_format_within_the_limit_and_parse_back_field_for_field() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for i in 0..2000u64 {
        let max = 2048 + rng.below(8000);
        let format = SyslogFormat::new(&SyslogConfig {
            hostname: "host".into(),
            procid: "1".into(),
            max_message_size: max,
            ..SyslogConfig::default()
        })
        .unwrap();
        let r = random_record(&mut rng, i + 1);
        let mut out = Vec::new();
        let info = format.format(&r, &mut out);
        assert!(out.len() <= max, "{} > {max}", out.len());
        let m = parse(&out).unwrap_or_else(|e| panic!("{e} in {}", String::from_utf8_lossy(&out)));
        assert_eq!(m.param(SD, "seq"), Some(r.seq.to_string().as_str()));
        assert_eq!(
            m.param(SD, "hash"),
            Some(probity_siem::record::hex(&r.hash).as_str())
        );
        assert_eq!(
            m.param(SD, "prev"),
            Some(probity_siem::record::hex(&r.prev_hash).as_str())
        );
        assert_eq!(m.param(SD, "kind"), Some(r.kind.as_str()));
        assert_eq!(m.param(SD, "severity"), Some(r.severity.as_str()));
        assert_eq!(m.timestamp, Some(probity_siem::time::unix_micros(r.time)));
        let truncated = m.param(SD, "truncated").unwrap_or("");
        for (name, value) in [("node", &r.node), ("policy", &r.policy)] {
            match (value, m.param(SD, name)) {
                (None, got) => assert_eq!(got, None),
                (Some(v), Some(got)) if truncated.contains(name) => assert!(v.starts_with(got)),
                (Some(v), got) => assert_eq!(got, Some(v.as_str())),
            }
        }
        let msg = m.msg_text();
        if info.msg_truncated {
            assert!(truncated.split(',').any(|t| t == "msg"));
            assert!(r.message.starts_with(&msg));
            assert!(msg.len() < r.message.len());
        } else {
            assert_eq!(msg, r.message);
        }
        // Every extra field is there under its own name (or a valid replacement),
        // unless counted as omitted.
        let extras = m.structured_data[0].params.len()
            - 5
            - usize::from(r.node.is_some())
            - usize::from(r.policy.is_some())
            - usize::from(!truncated.is_empty())
            - usize::from(m.param(SD, "omitted").is_some());
        assert_eq!(extras + info.fields_omitted, r.fields.len());
        const OURS: [&str; 9] = [
            "seq",
            "hash",
            "prev",
            "kind",
            "severity",
            "node",
            "policy",
            "truncated",
            "omitted",
        ];
        for (k, v) in &r.fields {
            if let Some(got) = m.param(SD, k)
                && !OURS.contains(&k.as_str())
            {
                assert_eq!(got, v);
            }
        }
    }
}

/// Mutations of `seed`: cut, flipped bytes, a duplicated slice, inserted bytes.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    match rng.below(4) {
        0 => v.truncate(rng.below(v.len() + 1)),
        1 => {
            for _ in 0..1 + rng.below(4) {
                if !v.is_empty() {
                    let i = rng.below(v.len());
                    v[i] ^= u8::try_from(1 + rng.below(255)).unwrap();
                }
            }
        }
        2 => {
            let a = rng.below(v.len() + 1);
            let b = a + rng.below(v.len() - a + 1);
            let slice = v[a..b].to_vec();
            let at = rng.below(v.len() + 1);
            v.splice(at..at, slice);
        }
        _ => {
            const NASTY: &[u8] = b" []\"\\=<>-\n0123456789\xEF\xBB\xBF\xff";
            let at = rng.below(v.len() + 1);
            for _ in 0..1 + rng.below(4) {
                v.insert(at, NASTY[rng.below(NASTY.len())]);
            }
        }
    }
    v
}

#[test]
fn mutated_inputs_never_panic_a_parser_and_every_error_is_located() {
    let mut seeds: Vec<Vec<u8>> = std::fs::read(fixtures().join("syslog/rfc5424-samples.txt"))
        .unwrap()
        .split(|b| *b == b'\n')
        .map(<[u8]>::to_vec)
        .collect();
    let format = SyslogFormat::new(&SyslogConfig::default()).unwrap();
    let mut chain = Chain::new();
    for r in chain.take(20) {
        let mut out = Vec::new();
        format.format(&r, &mut out);
        seeds.push(out);
    }
    let relp = std::fs::read(fixtures().join("syslog/relp-librelp-1.11.0-responses.bin")).unwrap();
    seeds.push(relp);
    seeds.push(b"18446744073709551615\n".to_vec());
    seeds.push(
        br#"{"seq":1,"hash":"00000000000000000000000000000000000000000000000000000000000000ab","prev":"0000000000000000000000000000000000000000000000000000000000000000","time_us":1,"kind":"decision","severity":"high","message":"m"}"#
            .to_vec(),
    );
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut located = 0;
    for i in 0..6000 {
        let seed = &seeds[i % seeds.len()];
        let input = mutate(&mut rng, seed);
        match parse(&input) {
            Ok(_) => {}
            Err(e) => {
                assert!(e.offset <= input.len(), "{e} beyond {} bytes", input.len());
                located += 1;
            }
        }
        match parse_frame(&input, MAX_RESPONSE_DATA) {
            Ok(Some((_, n))) => assert!(n <= input.len()),
            Ok(None) => {}
            Err(e) => assert!(e.offset <= input.len(), "{e}"),
        }
        if let Err((offset, _)) = parse_cursor(&input) {
            assert!(offset <= input.len().max(64));
        }
        let _ = parse_line(&input);
        if let Err(e) = parse_rfc3339(&input) {
            assert!(e.offset <= input.len());
        }
    }
    assert!(located > 1000, "mutations mostly break messages: {located}");
}
