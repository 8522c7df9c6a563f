//! The tamper-evident audit trail: each way of tampering with the state file that
//! `probity::audit::verify` must catch, done to the redb file directly, and the chain
//! and checkpoints the engine's decision log writes.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use probity::audit::{self, AuditError, CheckpointPolicy, Log};
use probity::integrity::{Anchor as _, PublicKey, SoftwareAnchor};
use probity::state::{DecisionRecord, StateStore};
use probity::{Decision, Effect, Engine, Request};
use redb::{ReadableDatabase as _, ReadableTable as _, TableDefinition};
use serde_json::json;

const DECISIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("decisions");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const CHECKPOINTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("checkpoints");

fn record(i: u64) -> DecisionRecord {
    DecisionRecord {
        seq: 0,
        time_unix_ms: 1_700_000_000_000 + i,
        principal: format!("Workload::\"train-{i}\""),
        action: "Action::\"schedule\"".into(),
        resource: "Node::\"gpu-1\"".into(),
        caller: None,
        request: None,
        sampled: false,
        policy_digest: "0".repeat(64),
        decision: Decision::error("blocked"),
    }
}

/// A state directory holding 35 decisions (checkpoints at 9, 19 and 29, signed by a
/// software anchor) and 5 events; the anchor's public key.
fn chained_store(dir: &Path) -> PublicKey {
    let anchor = Arc::new(SoftwareAnchor::generate(&dir.join("anchor.key")).unwrap());
    let key = anchor.public_key().clone();
    let store = StateStore::open(&dir.join("state")).unwrap();
    store.set_checkpoint_policy(CheckpointPolicy {
        every_records: 10,
        every: Duration::from_secs(3600),
        anchor: Some(anchor),
    });
    for _ in 0..7 {
        let mut batch: Vec<DecisionRecord> = (0..5).map(record).collect();
        store.record_decisions(&mut batch).unwrap();
    }
    for i in 0..5 {
        store
            .record_event(
                "models/llama",
                Some("gpu-1"),
                "chunk-mismatch",
                &format!("chunk {i}"),
            )
            .unwrap();
    }
    let report = audit::verify(&store, Some(&key)).unwrap();
    assert_eq!(report.logs[0].last_checkpoint, Some(29));
    assert_eq!(report.logs[0].signed_checkpoints, 3);
    assert_eq!(report.logs[0].unwitnessed, 5);
    key
}

/// Opens the state file itself (the store must be closed), as an attacker would.
fn tamper(dir: &Path, f: impl FnOnce(&redb::WriteTransaction)) {
    let db = redb::Database::open(dir.join("state").join(StateStore::FILE)).unwrap();
    let txn = db.begin_write().unwrap();
    f(&txn);
    txn.commit().unwrap();
}

fn stored(dir: &Path, seq: u64) -> Vec<u8> {
    let db = redb::Database::open(dir.join("state").join(StateStore::FILE)).unwrap();
    let txn = db.begin_read().unwrap();
    let table = txn.open_table(DECISIONS).unwrap();
    table.get(seq).unwrap().unwrap().value().to_vec()
}

fn verify(dir: &Path, key: &PublicKey) -> Result<audit::VerifyReport, AuditError> {
    let store = StateStore::open(&dir.join("state")).unwrap();
    audit::verify(&store, Some(key))
}

/// Replaces the first occurrence of `from` in `value` by `to` (same length).
fn replaced(value: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = value.windows(from.len()).position(|w| w == from).unwrap();
    let mut v = value.to_vec();
    v[at..at + to.len()].copy_from_slice(to);
    v
}

#[test]
fn an_edited_record_is_named_by_its_sequence_number() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    let edited = replaced(&stored(tmp.path(), 13), b"blocked", b"allowed");
    tamper(tmp.path(), |txn| {
        txn.open_table(DECISIONS)
            .unwrap()
            .insert(13, edited.as_slice())
            .unwrap();
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Edited {
                log: Log::Decisions,
                seq: 13,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "decisions log: record 13 was edited (its contents do not match its hash)"
    );
}

#[test]
fn an_edited_event_is_named_in_the_event_log() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(EVENTS).unwrap();
        let value = table.get(2).unwrap().unwrap().value().to_vec();
        let edited = replaced(&value, b"chunk 2", b"chunk 9");
        table.insert(2, edited.as_slice()).unwrap();
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Edited {
                log: Log::Events,
                seq: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_deleted_record_is_named_by_its_sequence_number() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    tamper(tmp.path(), |txn| {
        txn.open_table(DECISIONS).unwrap().remove(13).unwrap();
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Deleted {
                log: Log::Decisions,
                seq: 13,
                through: 13
            }
        ),
        "{err}"
    );
    assert_eq!(err.to_string(), "decisions log: record 13 was deleted");
}

#[test]
fn records_deleted_from_the_start_short_of_a_checkpoint_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(DECISIONS).unwrap();
        for seq in 0..5 {
            table.remove(seq).unwrap();
        }
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Deleted {
                log: Log::Decisions,
                seq: 0,
                through: 4
            }
        ),
        "{err}"
    );
}

#[test]
fn reordered_records_are_named_by_the_first_moved() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    let (a, b) = (stored(tmp.path(), 13), stored(tmp.path(), 14));
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(DECISIONS).unwrap();
        table.insert(13, b.as_slice()).unwrap();
        table.insert(14, a.as_slice()).unwrap();
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Reordered {
                log: Log::Decisions,
                seq: 13,
                holds: 14
            }
        ),
        "{err}"
    );
}

#[test]
fn truncation_before_the_last_checkpoint_names_the_first_missing_record() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(DECISIONS).unwrap();
        for seq in 25..35 {
            table.remove(seq).unwrap();
        }
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Truncated {
                log: Log::Decisions,
                seq: 25,
                checkpoint: 29
            }
        ),
        "{err}"
    );
}

/// The documented limit: the records after the last checkpoint have no local witness
/// (the SIEM's forwarded copy is theirs). Verify passes, and says how many there are.
#[test]
fn truncation_after_the_last_checkpoint_cannot_be_seen_locally() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(DECISIONS).unwrap();
        for seq in 32..35 {
            table.remove(seq).unwrap();
        }
    });
    let report = verify(tmp.path(), &key).unwrap();
    assert_eq!(report.logs[0].last, Some(31));
    assert_eq!(report.logs[0].unwitnessed, 2);
}

/// An attacker who rewrites a record and every hash after it keeps the chain whole;
/// the signed checkpoint after the record does not match.
#[test]
fn a_chain_rewritten_with_its_hashes_is_caught_by_the_next_signed_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    let values: Vec<Vec<u8>> = (0..35).map(|s| stored(tmp.path(), s)).collect();
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(DECISIONS).unwrap();
        let mut prev: [u8; 32] = values[12][41..73].try_into().unwrap();
        for seq in 13..35u64 {
            let old = &values[seq as usize];
            let mut body = old[73..].to_vec();
            if seq == 13 {
                body = replaced(&body, b"blocked", b"allowed");
            }
            let hash = audit::record_hash(Log::Decisions, seq, &prev, &body);
            let mut v = vec![1u8];
            v.extend_from_slice(&seq.to_be_bytes());
            v.extend_from_slice(&prev);
            v.extend_from_slice(&hash);
            v.extend_from_slice(&body);
            table.insert(seq, v.as_slice()).unwrap();
            prev = hash;
        }
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Rewritten {
                log: Log::Decisions,
                seq: 19,
                since: Some(9)
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "decisions log: records after record 9 up to 19 were rewritten with their hashes: checkpoint 19 holds another head"
    );
}

#[test]
fn a_forged_or_missing_checkpoint_signature_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    tamper(tmp.path(), |txn| {
        let mut table = txn.open_table(CHECKPOINTS).unwrap();
        let mut v = table
            .get(("decisions", 19))
            .unwrap()
            .unwrap()
            .value()
            .to_vec();
        v[0] ^= 1; // the time
        table.insert(("decisions", 19), v.as_slice()).unwrap();
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(err, AuditError::Signature { seq: 19, .. }),
        "{err}"
    );
    // Unsigned checkpoints (no anchor) do not pass a check against a key.
    let plain = tempfile::tempdir().unwrap();
    let store = StateStore::open(plain.path()).unwrap();
    store.record_event("o", None, "k", "d").unwrap();
    store.checkpoint(true).unwrap();
    let err = audit::verify(&store, Some(&key)).unwrap_err();
    assert!(
        err.to_string().contains("checkpoint 0 is unsigned"),
        "{err}"
    );
    let report = audit::verify(&store, None).unwrap();
    assert_eq!(
        (report.logs[1].unsigned_checkpoints, report.key_id),
        (1, None)
    );
}

#[test]
fn the_engine_chains_what_it_records_and_checkpoints_a_quiet_log_by_time() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    store.set_checkpoint_policy(CheckpointPolicy {
        every_records: 1_000_000,
        every: Duration::from_millis(100),
        anchor: None,
    });
    let engine = Engine::builder(crate::root().join("policies"))
        .build()
        .unwrap();
    crate::load_cluster(&engine);
    engine.attach_state(store.clone()).unwrap();
    engine.block_node("gpu-a1", "test").unwrap();
    let request = Request::from_json_value(&json!({
        "principal": "Workload::\"train-1\"",
        "action": "schedule",
        "resource": "Node::\"gpu-a1\"",
    }))
    .unwrap();
    for _ in 0..3 {
        assert_eq!(engine.decide(&request).decision, Effect::Deny);
    }
    // The writer's tick checkpoints the quiet log.
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.checkpoints(Log::Decisions).unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no checkpoint was made");
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = audit::verify(&store, None).unwrap();
    assert_eq!(report.logs[0].records, 3);
    assert_eq!(report.logs[0].last_checkpoint, Some(2));
    assert_eq!(report.logs[0].unwitnessed, 0);
}

#[test]
fn after_pruning_at_a_checkpoint_the_rest_verifies_and_a_cut_into_it_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let key = chained_store(tmp.path());
    {
        let store = StateStore::open(&tmp.path().join("state")).unwrap();
        let retention = probity::state::Retention {
            max_bytes: 1,
            max_age_seconds: u64::MAX,
            keep_from: 25,
        };
        // Checkpoints at 9 and 19 come before keep_from; 29 does not.
        assert_eq!(store.prune_decisions(&retention, 0).unwrap(), 20);
        let report = audit::verify(&store, Some(&key)).unwrap();
        assert_eq!(report.logs[0].first, Some(20));
        assert_eq!(report.logs[0].signed_checkpoints, 2);
    }
    tamper(tmp.path(), |txn| {
        txn.open_table(DECISIONS).unwrap().remove(20).unwrap();
    });
    let err = verify(tmp.path(), &key).unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::Deleted {
                log: Log::Decisions,
                seq: 20,
                through: 20
            }
        ),
        "{err}"
    );
}
