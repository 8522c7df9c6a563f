//! The decision log: denies and obligations recorded durably before they are
//! returned; allows and dry runs leave no record.

use std::sync::Arc;

use probity::state::StateStore;
use probity::{DecideOptions, Effect, Engine, Request};
use serde_json::json;

use crate::root;

/// `workload` asking to be scheduled onto `node`.
pub fn schedule(workload: &str, node: &str) -> Request {
    Request::from_json_value(&json!({
        "principal": format!("Workload::\"{workload}\""),
        "action": "schedule",
        "resource": format!("Node::\"{node}\""),
    }))
    .unwrap()
}

#[test]
fn denies_and_obligations_are_recorded_durably_and_allows_and_dry_runs_are_not() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let digest;
    {
        let store = Arc::new(StateStore::open(&dir).unwrap());
        let engine = Engine::builder(root().join("policies")).build().unwrap();
        crate::load_cluster(&engine);
        engine.attach_state(store.clone()).unwrap();
        digest = engine.status().digest;

        // An allow without obligations: no record.
        assert!(engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
        assert!(store.decisions(0, 100).unwrap().is_empty());

        // A deny: recorded before decide returns.
        engine.block_node("gpu-a1", "test").unwrap();
        let denied = engine.decide(&schedule("train-1", "gpu-a1"));
        assert_eq!(denied.decision, Effect::Deny);
        let records = store.decisions(0, 100).unwrap();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].seq, 0);
        assert_eq!(records[0].principal, r#"Workload::"train-1""#);
        assert_eq!(records[0].action, r#"Action::"schedule""#);
        assert_eq!(records[0].resource, r#"Node::"gpu-a1""#);
        assert_eq!(records[0].policy_digest, digest);
        assert_eq!(records[0].decision, denied);

        // A dry run of the same deny leaves no record.
        let dry = engine
            .decide_with(
                &[schedule("train-1", "gpu-a1")],
                DecideOptions::new().dry_run(),
            )
            .settle();
        assert_eq!(dry[0].decision, Effect::Deny);
        assert_eq!(store.decisions(0, 100).unwrap().len(), 1);

        // A budget that refuses: nothing recorded, the deny not given, and the
        // budget told how many records the batch needed.
        let mut asked_for = Vec::new();
        let mut refuse = |n: usize| {
            asked_for.push(n);
            false
        };
        let refused = engine.decide_with(
            &[schedule("train-1", "gpu-a1"), schedule("train-1", "gpu-a1")],
            DecideOptions::new().within(&mut refuse),
        );
        assert!(refused.is_over_budget());
        let refused = refused.settle();
        assert!(refused[0].unrecorded, "{refused:?}");
        assert!(
            refused[0].errors[0]
                .message
                .contains("over the caller's budget of recorded decisions"),
            "{refused:?}"
        );
        assert_eq!(asked_for, [2]);
        assert_eq!(store.decisions(0, 100).unwrap().len(), 1);

        // An allow that carries an obligation (94% on-prem occupancy: burst to cloud)
        // is recorded; a batch's records share one commit with consecutive numbers.
        engine
            .upsert_entities(&json!([{"uid": {"type": "Cluster", "id": "onprem"},
                "attrs": {"gpusTotal": 64, "gpusAllocated": 60}, "parents": []}]))
            .unwrap();
        engine.unblock_node("gpu-a1").unwrap();
        // A budget that admits is asked once, for both records of the batch.
        let mut asked_for = Vec::new();
        let mut admit = |n: usize| {
            asked_for.push(n);
            true
        };
        let batch = engine
            .decide_with(
                &[
                    schedule("train-1", "gpu-blocked"),
                    schedule("train-1", "gpu-a1"),
                ],
                DecideOptions::new().within(&mut admit),
            )
            .settle();
        assert_eq!(asked_for, [2]);
        assert_eq!(batch[0].decision, Effect::Deny);
        assert_eq!(batch[1].decision, Effect::Allow);
        assert_eq!(batch[1].obligations[0].kind, "burst_to_cloud");
        let records = store.decisions(0, 100).unwrap();
        let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [0, 1, 2]);
        assert_eq!(records[1].resource, r#"Node::"gpu-blocked""#);
        assert_eq!(records[2].resource, r#"Node::"gpu-a1""#);
        assert_eq!(records[2].decision, batch[1]);
        // Reading from a later sequence number skips the earlier records.
        assert_eq!(store.decisions(2, 100).unwrap().len(), 1);
    }
    // Durable: a fresh open of the directory finds every record.
    let reopened = StateStore::open(&dir).unwrap();
    let records = reopened.decisions(0, 100).unwrap();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.policy_digest == digest));
}

#[test]
fn concurrent_denies_are_all_recorded_with_distinct_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = Engine::builder(root().join("policies")).build().unwrap();
    crate::load_cluster(&engine);
    engine.attach_state(store.clone()).unwrap();
    engine.block_node("gpu-a1", "test").unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for _ in 0..25 {
                    let d = engine.decide(&schedule("train-1", "gpu-a1"));
                    assert_eq!(d.decision, Effect::Deny);
                    assert!(d.errors.is_empty(), "{:?}", d.errors);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let seqs: Vec<u64> = store
        .decisions(0, 1000)
        .unwrap()
        .iter()
        .map(|r| r.seq)
        .collect();
    assert_eq!(seqs, (0..100).collect::<Vec<u64>>());
}
