use super::*;

/// The fuzz target's function over cuts and flips of real stored forms: a decision
/// record, an event and a checkpoint.
#[test]
fn the_fuzz_target_holds_on_cut_and_flipped_stored_forms() {
    let decision = br#"{"time_unix_ms":1,"principal":"User::\"a\"","action":"Action::\"x\"","resource":"Node::\"n\"","policy_digest":"d","decision":{"decision":"deny","reasons":[],"obligations":[],"errors":[]}}"#;
    let event = crate::state::encode_event(5, "obj", Some("n1"), "finding", "d");
    let checkpoint = Checkpoint {
        log: Log::Decisions,
        seq: 3,
        head: [1; 32],
        time_unix_ms: 9,
        signature: Some((KeyId([2; 32]), Signature([3; 64]))),
    }
    .encode();
    for body in [decision.as_slice(), event.as_slice()] {
        let raw = encode_link(4, &[5; 32], &[6; 32], body);
        for form in [raw.as_slice(), body, checkpoint.as_slice()] {
            fuzzing::stored(form);
            for cut in 0..form.len() {
                fuzzing::stored(&form[..cut]);
            }
            for i in 0..form.len() {
                let mut flipped = form.to_vec();
                flipped[i] ^= 0x41;
                fuzzing::stored(&flipped);
            }
        }
    }
}

#[test]
fn stored_values_never_panic_and_round_trip() {
    let prev = [7; 32];
    let hash = record_hash(Log::Events, 9, &prev, b"body");
    let raw = encode_link(9, &prev, &hash, b"body");
    assert_eq!(
        decode_stored(&raw),
        Stored::Chained(Link {
            seq: 9,
            prev,
            hash,
            body: b"body"
        })
    );
    for cut in 0..raw.len() {
        let _ = decode_stored(raw.get(..cut).unwrap());
        let _ = Checkpoint::decode(Log::Decisions, 1, raw.get(..cut).unwrap());
    }
    assert_eq!(decode_stored(&raw[..10]), Stored::Malformed);
    assert_eq!(decode_stored(b"{\"a\":1}"), Stored::Unchained(b"{\"a\":1}"));
}

/// Stored values and checkpoints are read from a file others may have changed:
/// mutated ones (cut, flipped, grown) never panic, and a chained value that still
/// decodes hashes to its stored hash only if it is the original.
#[test]
fn mutated_stored_values_never_panic_and_never_pass_as_the_original() {
    let mut next = crate::testing::xorshift(0x9e37_79b9_7f4a_7c15);
    let prev = [3; 32];
    let body = br#"{"principal":"Workload::\"a\"","decision":"deny"}"#;
    let hash = record_hash(Log::Decisions, 7, &prev, body);
    let original = encode_link(7, &prev, &hash, body);
    let cp = Checkpoint {
        log: Log::Decisions,
        seq: 7,
        head: hash,
        time_unix_ms: 9,
        signature: Some((KeyId([1; 32]), Signature([2; 64]))),
    }
    .encode();
    for _ in 0..5000 {
        for fixture in [&original, &cp] {
            let mut v = fixture.clone();
            match next(3) {
                0 => v.truncate(next(v.len() as u64) as usize),
                1 => {
                    let at = next(v.len() as u64) as usize;
                    v[at] ^= 1 << next(8);
                }
                _ => {
                    let at = next(v.len() as u64) as usize;
                    let piece = v[at..].to_vec();
                    v.extend_from_slice(&piece);
                }
            }
            let _ = Checkpoint::decode(Log::Decisions, 7, &v);
            if let Stored::Chained(link) = decode_stored(&v)
                && v != original
                && link.seq == 7
            {
                assert_ne!(
                    record_hash(Log::Decisions, 7, &link.prev, link.body),
                    link.hash
                );
            }
        }
    }
}

#[test]
fn the_hash_covers_log_seq_prev_and_body() {
    let h = record_hash(Log::Decisions, 1, &GENESIS, b"x");
    assert_ne!(h, record_hash(Log::Events, 1, &GENESIS, b"x"));
    assert_ne!(h, record_hash(Log::Decisions, 2, &GENESIS, b"x"));
    assert_ne!(h, record_hash(Log::Decisions, 1, &[1; 32], b"x"));
    assert_ne!(h, record_hash(Log::Decisions, 1, &GENESIS, b"y"));
}

#[test]
fn checkpoints_round_trip_signed_and_unsigned() {
    let cp = Checkpoint {
        log: Log::Events,
        seq: 3,
        head: [2; 32],
        time_unix_ms: 5,
        signature: None,
    };
    assert_eq!(
        Checkpoint::decode(Log::Events, 3, &cp.encode()),
        Some(cp.clone())
    );
    let signed = Checkpoint {
        signature: Some((KeyId([4; 32]), Signature([5; 64]))),
        ..cp
    };
    assert_eq!(
        Checkpoint::decode(Log::Events, 3, &signed.encode()),
        Some(signed)
    );
}

#[test]
fn checkpoints_are_due_by_count_or_by_time_never_for_nothing() {
    let p = CheckpointPolicy {
        every_records: 10,
        every: Duration::from_secs(1),
        anchor: None,
    };
    assert!(!p.due(0, 10_000));
    assert!(!p.due(9, 999));
    assert!(p.due(10, 0));
    assert!(p.due(1, 1000));
}
