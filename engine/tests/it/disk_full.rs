//! A full disk under the state store: a deny that cannot be recorded is answered as
//! unrecorded (never as a plain deny with no record), the store says it fails, and it
//! recovers by itself when space returns, its hash chain continuing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use probity::audit;
use probity::state::StateStore;
use probity::{Effect, Engine};

use crate::decision_log::schedule;
use crate::root;

#[path = "../../../hooks/testsupport/small_disk.rs"]
mod small_disk;

/// Issue 28, item 2: one ENOSPC left redb refusing every write ("Previous I/O error
/// occurred") until a restart, and denies answered while the disk filled were never
/// recorded.
#[test]
fn a_full_disk_never_answers_an_unrecorded_deny_and_the_log_recovers_when_space_returns() {
    let disk = small_disk::SmallDisk::mount(8);
    let store = Arc::new(StateStore::open(&disk.path().join("state")).unwrap());
    let engine = Engine::builder(root().join("policies")).build().unwrap();
    crate::load_cluster(&engine);
    engine.attach_state(store.clone()).unwrap();
    assert!(store.storage_health().failure.is_none());

    disk.fill();
    // Denies until one cannot be recorded (redb first fills pages its file already
    // holds). Each answered deny must be either recorded or marked unrecorded.
    let mut answered_as_recorded = 0usize;
    let mut unrecorded = None;
    for _ in 0..20_000 {
        let d = engine.decide(&schedule("train-1", "gpu-blocked"));
        assert_eq!(d.decision, Effect::Deny);
        if d.unrecorded {
            unrecorded = Some(d);
            break;
        }
        answered_as_recorded += 1;
    }
    let unrecorded = unrecorded.expect("a full disk must make a record fail");
    assert!(
        unrecorded
            .errors
            .last()
            .unwrap()
            .message
            .starts_with("the decision could not be recorded: "),
        "{:?}",
        unrecorded.errors
    );
    let health = store.storage_health();
    let failure = health.failure.expect("the store must say it fails");
    assert!(
        failure.detail.contains("No space left on device"),
        "{failure:?}"
    );
    assert!(health.failures_total >= 1);
    // Allows need no record and are still answered.
    assert!(engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
    // Still full: still unrecorded.
    assert!(
        engine
            .decide(&schedule("train-1", "gpu-blocked"))
            .unrecorded
    );

    disk.free();
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.storage_health().failure.is_some() {
        assert!(Instant::now() < deadline, "the store never recovered");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(store.storage_health().recoveries_total, 1);
    let after = engine.decide(&schedule("train-1", "gpu-blocked"));
    assert_eq!(after.decision, Effect::Deny);
    assert!(!after.unrecorded, "{:?}", after.errors);

    // Every deny answered as recorded is in the log, and the chain runs on unbroken.
    let records = store.decisions(0, 100_000).unwrap();
    assert_eq!(records.len(), answered_as_recorded + 1);
    assert_eq!(records.last().unwrap().decision, after);
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    let report = audit::verify(&store, None).unwrap();
    let decisions = report
        .logs
        .iter()
        .find(|l| l.records == records.len() as u64)
        .expect("the decision log's report");
    assert_eq!(decisions.unchained, 0);
}
