use super::*;
use crate::audit::{GENESIS, Log};

#[test]
fn admitted_facts_are_bounded_in_count_and_expire() {
    let tmp = tempfile::tempdir().unwrap();
    let store = StateStore::open(tmp.path()).unwrap();
    let limits = AdmittedLimits {
        max: 10,
        seconds: 60,
    };
    let now = crate::clock::Clock::now_unix_ms(&crate::clock::SystemClock);
    let facts = |i: u64, at: u64| AdmittedFacts {
        namespace: "ns".into(),
        name: format!("pod-{i}"),
        uid: format!("uid-{i}"),
        attrs: serde_json::json!({"gpus": i}),
        admitted_at_ms: at,
    };
    for i in 0..11 {
        store
            .remember_admitted(&facts(i, now - 1000 + i), &limits)
            .unwrap();
    }
    // Past the bound: the oldest went, down to 90% of it, the newest stayed.
    let kept: Vec<bool> = (0..11)
        .map(|i| {
            store
                .admitted("ns", &format!("pod-{i}"), 60)
                .unwrap()
                .is_some()
        })
        .collect();
    assert_eq!(kept.iter().filter(|k| **k).count(), 9, "{kept:?}");
    assert!(!kept[0] && !kept[1] && kept[10], "{kept:?}");
    assert_eq!(
        store.admitted("ns", "pod-10", 60).unwrap().unwrap(),
        facts(10, now - 990)
    );
    // Older than the time: not returned.
    store
        .remember_admitted(&facts(20, now - 120_000), &limits)
        .unwrap();
    assert!(store.admitted("ns", "pod-20", 60).unwrap().is_none());
    store.forget_admitted("ns", "pod-10").unwrap();
    assert!(store.admitted("ns", "pod-10", 60).unwrap().is_none());
}

/// Two callers keep facts for different times (Slurm jobs 14 days, pods a day): when a
/// pod's admission goes over the bound, the purge judges each entry by the lifetime it
/// was remembered with, so the Slurm facts, two days old, stay; the expired and the
/// pods nearest their end go.
#[test]
fn admitted_facts_purge_by_each_entrys_own_lifetime() {
    const DAY: u64 = 86_400;
    const T0: u64 = 1_000_000_000;
    let tmp = tempfile::tempdir().unwrap();
    let clock = Arc::new(crate::clock::ManualClock::at(1_000_000_000));
    let store = StateStore::open_with_clock(tmp.path(), clock.clone()).unwrap();
    let long = AdmittedLimits {
        max: 10,
        seconds: 14 * DAY,
    };
    let short = AdmittedLimits {
        max: 10,
        seconds: DAY,
    };
    let facts = |ns: &str, i: u64, at: u64| AdmittedFacts {
        namespace: ns.into(),
        name: format!("n-{i}"),
        uid: format!("uid-{ns}-{i}"),
        attrs: serde_json::json!({"i": i}),
        admitted_at_ms: at,
    };
    let has = |ns: &str, i: u64| {
        store
            .admitted(ns, &format!("n-{i}"), 14 * DAY)
            .unwrap()
            .is_some()
    };
    // At T0: four Slurm jobs kept 14 days, one pod kept a day.
    for i in 0..4 {
        store
            .remember_admitted(&facts("slurm-job", i, T0 * 1000 + i), &long)
            .unwrap();
    }
    store
        .remember_admitted(&facts("stale", 0, T0 * 1000), &short)
        .unwrap();
    // And one record written before entries kept their lifetime: it still parses.
    let legacy = facts("legacy", 0, T0 * 1000);
    let raw = serde_json::to_vec(&legacy).unwrap();
    assert!(!String::from_utf8_lossy(&raw).contains("keep_seconds"));
    store
        .write("test", |txn| {
            txn.open_table(ADMITTED)?
                .insert("legacy/n-0", raw.as_slice())?;
            Ok(())
        })
        .unwrap();
    assert_eq!(
        store.admitted("legacy", "n-0", 14 * DAY).unwrap(),
        Some(legacy)
    );

    // Two days later, pods kept a day, past the bound (max 10, purged down to 9).
    clock.advance(2 * 86_400);
    let now_ms = (T0 + 2 * DAY) * 1000;
    for i in 0..5 {
        store
            .remember_admitted(&facts("pod", i, now_ms + i), &short)
            .unwrap();
    }
    // The fifth pod made 11: the expired pod and the legacy record (judged by the
    // purging caller's day) went; the Slurm jobs, two days into their 14, stayed.
    assert!(!has("stale", 0) && !has("legacy", 0));
    assert!((0..4).all(|i| has("slurm-job", i)));
    assert!((0..5).all(|i| has("pod", i)));
    // Two more pods: over again, and nothing expired: the pods nearest their end go
    // (the oldest), not the Slurm jobs, which are older but have 12 days left.
    for i in 5..7 {
        store
            .remember_admitted(&facts("pod", i, now_ms + i), &short)
            .unwrap();
    }
    let pods: Vec<bool> = (0..7).map(|i| has("pod", i)).collect();
    assert_eq!(pods, [false, false, true, true, true, true, true]);
    assert!((0..4).all(|i| has("slurm-job", i)));
    // What is read back is what was remembered.
    assert_eq!(
        store.admitted("slurm-job", "n-3", 14 * DAY).unwrap(),
        Some(facts("slurm-job", 3, T0 * 1000 + 3))
    );
}

/// The stored record is the facts' JSON object with the lifetime beside its fields: a
/// record without it parses (no lifetime: the caller's), and a reader of plain
/// [`AdmittedFacts`] (another version, a tool) ignores it.
#[test]
fn stored_admitted_facts_keep_their_lifetime_and_old_records_parse() {
    use super::backend::StoredAdmitted;
    let facts = AdmittedFacts {
        namespace: "slurm-job".into(),
        name: "42".into(),
        uid: "u".into(),
        attrs: serde_json::json!({"gpus": 2, "tags": ["a"]}),
        admitted_at_ms: 5_000,
    };
    let stored = StoredAdmitted {
        facts: facts.clone(),
        keep_seconds: Some(10),
    };
    let bytes = serde_json::to_vec(&stored).unwrap();
    let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(value["keep_seconds"], 10);
    assert_eq!(value["admitted_at_ms"], 5_000);
    assert_eq!(
        serde_json::from_slice::<StoredAdmitted>(&bytes).unwrap(),
        stored
    );
    assert_eq!(
        serde_json::from_slice::<AdmittedFacts>(&bytes).unwrap(),
        facts
    );
    // Its own lifetime, whatever the caller's.
    assert_eq!(stored.deadline_ms(1_000), 15_000);
    assert!(!stored.expired(15_000, 1) && stored.expired(15_001, 1_000));
    // An old record: no lifetime, the caller's.
    let old = br#"{"namespace":"ns","name":"p","uid":"u","attrs":{},"admitted_at_ms":5000}"#;
    let old: StoredAdmitted = serde_json::from_slice(old).unwrap();
    assert_eq!(old.keep_seconds, None);
    assert_eq!(old.deadline_ms(3), 8_000);
    assert!(!old.expired(8_000, 3) && old.expired(8_001, 3));
}

#[test]
fn sequence_numbers_never_wrap() {
    assert_eq!(next_seq(None, 3).unwrap(), 0);
    assert_eq!(next_seq(Some(4), 1).unwrap(), 5);
    assert!(next_seq(Some(u64::MAX), 1).is_err());
    assert!(next_seq(Some(u64::MAX - 2), 5).is_err());
}

#[test]
fn registry_refuses_rollback_and_conflicts() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    assert!(s.registry_entry("o").unwrap().is_none());
    s.accept("o", 2, &[1; 32], b"m2").unwrap();
    s.accept("o", 2, &[1; 32], b"m2").unwrap();
    assert!(matches!(
        s.accept("o", 1, &[1; 32], b"m1"),
        Err(StateError::Rollback {
            offered: 1,
            accepted: 2,
            ..
        })
    ));
    assert!(matches!(
        s.accept("o", 2, &[2; 32], b"x"),
        Err(StateError::DigestConflict { version: 2, .. })
    ));
    s.accept("o", 3, &[3; 32], b"m3").unwrap();
    drop(s);
    let s = StateStore::open(dir.path()).unwrap();
    let e = s.registry_entry("o").unwrap().unwrap();
    assert_eq!(
        (e.version, e.digest, e.signed_manifest.as_slice()),
        (3, [3; 32], &b"m3"[..])
    );
    assert!(s.check_version("o", 2, &[2; 32]).is_err());
    assert!(s.check_version("o", 4, &[2; 32]).is_ok());
}

/// The registry against a simple model: a map from object to (highest version, digest).
#[test]
fn registry_matches_model_on_random_operations() {
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut model: HashMap<String, (u64, [u8; 32])> = HashMap::new();
    let mut next = crate::testing::xorshift(0x2545_f491_4f6c_dd1d);
    for _ in 0..300 {
        let id = format!("obj-{}", next(4));
        let version = next(6);
        let digest = [next(3) as u8; 32];
        let expected = match model.get(&id) {
            Some(&(v, _)) if version < v => Err("rollback"),
            Some(&(v, d)) if version == v && d != digest => Err("conflict"),
            _ => Ok(()),
        };
        let got = s.accept(&id, version, &digest, &digest);
        match (expected, &got) {
            (Ok(()), Ok(())) => {
                let e = model.entry(id.clone()).or_insert((version, digest));
                *e = (version, digest);
            }
            (Err("rollback"), Err(StateError::Rollback { .. }))
            | (Err("conflict"), Err(StateError::DigestConflict { .. })) => {}
            (e, g) => panic!("model {e:?}, store {g:?} for {id} v{version}"),
        }
        let entry = s
            .registry_entry(&id)
            .unwrap()
            .map(|e| (e.version, e.digest));
        assert_eq!(entry, model.get(&id).copied());
    }
}

fn record(time_unix_ms: u64) -> DecisionRecord {
    DecisionRecord {
        seq: 0,
        time_unix_ms,
        principal: "p".into(),
        action: "a".into(),
        resource: "r".into(),
        caller: None,
        request: None,
        sampled: false,
        policy_digest: "d".into(),
        decision: Decision::error("x"),
    }
}

fn every(records: u64) -> CheckpointPolicy {
    CheckpointPolicy {
        every_records: records,
        every: Duration::from_secs(3600),
        anchor: None,
    }
}

#[test]
fn retention_prunes_only_at_checkpoints_and_never_what_is_kept_or_numbers_again() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    s.set_checkpoint_policy(every(100));
    // Checkpoints at 99, 199, 299 (one per group of 100), none over the last 10.
    for g in 0..3 {
        let mut batch: Vec<DecisionRecord> =
            (0..100).map(|i| record(1_000 + g * 100 + i)).collect();
        s.record_decisions(&mut batch).unwrap();
    }
    let mut tail: Vec<DecisionRecord> = (0..10).map(|i| record(2_000 + i)).collect();
    s.record_decisions(&mut tail).unwrap();
    let seqs: Vec<u64> = s
        .checkpoints(Log::Decisions)
        .unwrap()
        .iter()
        .map(|c| c.seq)
        .collect();
    assert_eq!(seqs, [99, 199, 299]);
    let full = s.decision_log_usage().unwrap();
    assert_eq!((full.records, full.first, full.next), (310, 0, 310));
    // Over the byte budget, but only up to checkpoint 99 may go (keep_from).
    let keep = Retention {
        max_bytes: 1,
        max_age_seconds: u64::MAX,
        keep_from: 150,
    };
    assert_eq!(s.prune_decisions(&keep, 0).unwrap(), 100);
    let after = s.decision_log_usage().unwrap();
    assert_eq!((after.first, after.records), (100, 210));
    assert!(after.bytes < full.bytes);
    crate::audit::verify(&s, None).unwrap();
    // By age: spans whose last record is too old go, the unchecked tail stays.
    let old = Retention {
        max_bytes: u64::MAX,
        max_age_seconds: 1,
        keep_from: u64::MAX,
    };
    assert_eq!(s.prune_decisions(&old, 1_000_000).unwrap(), 200);
    assert_eq!(s.decision_log_usage().unwrap().records, 10);
    // The checkpoint the log was cut at stays; older ones went.
    let seqs: Vec<u64> = s
        .checkpoints(Log::Decisions)
        .unwrap()
        .iter()
        .map(|c| c.seq)
        .collect();
    assert_eq!(seqs, [299]);
    let report = crate::audit::verify(&s, None).unwrap();
    assert_eq!(report.logs[0].first, Some(300));
    assert_eq!(report.logs[0].unwitnessed, 10);
    // Nothing without a checkpoint after it is pruned, however old.
    assert_eq!(s.prune_decisions(&old, u64::MAX).unwrap(), 0);
    // Sequence numbers go on after pruning.
    let mut more = vec![record(5)];
    assert_eq!(s.record_decisions(&mut more).unwrap(), 310);
    crate::audit::verify(&s, None).unwrap();
}

#[test]
fn chained_reads_give_each_record_the_hash_its_successor_chains_from() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut batch: Vec<DecisionRecord> = (0..3).map(record).collect();
    s.record_decisions(&mut batch).unwrap();
    let read = s.chained_decisions(0, 10).unwrap();
    assert_eq!(read.len(), 3);
    assert_eq!(read[0].1.prev, Some(GENESIS));
    assert_eq!(read[1].1.prev, read[0].1.hash);
    assert_eq!(read[2].1.prev, read[1].1.hash);
    assert_eq!((read[2].0.seq, read[2].1.seq), (2, 2));
    s.record_event("o", None, "k", "d").unwrap();
    let events = s.chained_events(0, 10).unwrap();
    assert_eq!(
        (events[0].0.kind.as_str(), events[0].1.prev),
        ("k", Some(GENESIS))
    );
}

#[test]
fn a_quiet_log_is_checkpointed_by_time_and_by_force() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    s.set_checkpoint_policy(CheckpointPolicy {
        every: Duration::ZERO,
        ..every(1000)
    });
    // Due by time at once: the append itself checkpoints.
    s.record_event("o", None, "k", "d").unwrap();
    assert_eq!(s.checkpoints(Log::Events).unwrap().len(), 1);
    assert!(s.checkpoint(false).unwrap().is_empty(), "nothing new");
    s.set_checkpoint_policy(every(1000));
    s.record_event("o", None, "k", "d").unwrap();
    assert!(s.checkpoint(false).unwrap().is_empty(), "not due yet");
    let made = s.checkpoint(true).unwrap();
    assert_eq!((made.len(), made[0].seq, made[0].log), (1, 1, Log::Events));
    assert!(made[0].signature.is_none());
}

#[test]
fn key_records_are_compare_and_swap() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let b: &dyn SharedState = &s;
    assert_eq!(b.key_record("k").unwrap(), None);
    let r1 = b.put_key_record("k", b"one", None).unwrap();
    assert!(matches!(
        b.put_key_record("k", b"again", None),
        Err(StateError::Conflict {
            expected: None,
            found: Some(1),
            ..
        })
    ));
    let r2 = b.put_key_record("k", b"two", Some(r1)).unwrap();
    assert!(b.put_key_record("k", b"stale", Some(r1)).is_err());
    assert_eq!(b.key_record("k").unwrap(), Some((b"two".to_vec(), r2)));
    assert_eq!(b.key_ids().unwrap(), ["k"]);
    assert!(b.delete_key_record("k", r1).is_err());
    b.delete_key_record("k", r2).unwrap();
    assert_eq!(b.key_record("k").unwrap(), None);
}

#[test]
fn node_facts_and_digests_are_kept_per_node_and_process() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let facts = NodeFacts {
        node: "n1".into(),
        entities: serde_json::json!([]),
        collected_at: 5,
        ttl_seconds: 30,
    };
    s.publish_facts(&facts).unwrap();
    s.publish_facts(&NodeFacts {
        collected_at: 9,
        ..facts.clone()
    })
    .unwrap();
    assert_eq!(s.node_facts().unwrap().len(), 1);
    assert_eq!(s.node_facts().unwrap()[0].collected_at, 9);
    s.report_digest(&ServedDigest {
        process: "a".into(),
        digest: "d1".into(),
        at: 1,
    })
    .unwrap();
    assert_eq!(s.served_digests().unwrap()[0].digest, "d1");
}

#[test]
fn blocklist_and_events_persist() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = StateStore::open(dir.path()).unwrap();
        s.block_node("node-1", "chunk 3 mismatch", 1_700_000_000)
            .unwrap();
        assert_eq!(
            s.record_event("o", Some("node-1"), "chunk-mismatch", "d")
                .unwrap(),
            0
        );
        assert_eq!(s.record_event("o", None, "rollback", "e").unwrap(), 1);
    }
    let s = StateStore::open(dir.path()).unwrap();
    assert_eq!(
        s.blocked("node-1").unwrap().unwrap().record.reason,
        "chunk 3 mismatch"
    );
    assert_eq!(s.blocked_nodes().unwrap().len(), 1);
    let ev = s.events(0).unwrap();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0].node.as_deref(), Some("node-1"));
    assert_eq!(ev[1].kind, "rollback");
    assert_eq!(s.events(1).unwrap().len(), 1);
    assert!(s.unblock_node("node-1").unwrap());
    assert!(s.blocked("node-1").unwrap().is_none());
}

#[test]
fn blocks_are_numbered_after_every_earlier_unblock_and_the_numbers_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let revision = |s: &StateStore, node: &str| s.blocked(node).unwrap().unwrap().record.revision;
    {
        let s = StateStore::open(dir.path()).unwrap();
        assert_eq!(
            s.put_block("n1", &BlockRecord::new("first", 10)).unwrap(),
            1
        );
        // Blocked again while blocked: the same block, the same number.
        let again = BlockRecord::new("first", 10).blocked_again("second", 11);
        assert_eq!(s.put_block("n1", &again).unwrap(), 1);
        assert_eq!(revision(&s, "n1"), Some(1));
        assert_eq!(
            s.put_block("n2", &BlockRecord::new("other", 12)).unwrap(),
            2
        );
        assert!(s.unblock_node("n1").unwrap());
        // An unblock of a node not blocked leaves no tombstone and takes no number.
        assert!(!s.unblock_node("n9").unwrap());
        assert_eq!(
            s.block_tombstones().unwrap(),
            BTreeMap::from([("n1".to_owned(), 3)])
        );
    }
    let s = StateStore::open(dir.path()).unwrap();
    // A record offered with a number of its own (copied from elsewhere) gets the
    // store's, which is above the tombstone of the node's last unblock.
    let offered = BlockRecord {
        revision: Some(1),
        ..BlockRecord::new("re-blocked", 20)
    };
    assert_eq!(s.put_block("n1", &offered).unwrap(), 4);
    assert_eq!(revision(&s, "n1"), Some(4));
    // Its tombstone has nothing left to tell apart: dropped with the new block.
    assert!(s.block_tombstones().unwrap().is_empty());
}

#[test]
fn bug_the_store_stamped_its_records_with_the_machines_time_not_its_clocks() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(crate::clock::ManualClock::at(1_000_000));
    let s = StateStore::open_with_clock(dir.path(), clock.clone()).unwrap();
    s.record_event("o", None, "rollback", "d").unwrap();
    clock.advance(5);
    s.record_event("o", None, "rollback", "e").unwrap();
    let times: Vec<u64> = s.events(0).unwrap().iter().map(|e| e.time_unix).collect();
    assert_eq!(times, [1_000_000, 1_000_005]);
}
