//! The cost of the audit trail's hash chain (issue 15): recorded denies per second
//! through the engine's decision log (group commit, one writer thread), with the chain
//! and without it, in the same run.
//!
//! ```sh
//! cargo run --release -p probity --example audit_chain_bench -- [THREADS] [DENIES] [ROUNDS]
//! ```
//!
//! Four set-ups, measured in interleaved rounds (default 8 threads, 40,000 denies a
//! round, 3 rounds), each printing its median:
//! * `unrecorded`: no state attached, nothing recorded (the issue's reference rate);
//! * `unchained`: the decision log as it was before the chain (JSON records, same redb
//!   table, same group commit), a `LocalLog` written here for the baseline;
//! * `chained`: today's `StateStore` with unsigned checkpoints every 1024 records;
//! * `chained+signed`: the same with checkpoints signed by the software anchor.
//!
//! After each `chained+signed` round, `probity::audit::verify` re-checks that store
//! (records verified per second, signatures included). `ONLY=chained` (or another
//! set-up's name) runs that set-up alone, for a profile.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use probity::audit::CheckpointPolicy;
use probity::integrity::SoftwareAnchor;
use probity::state::{
    AttachedState, DecisionRecord, Event, LocalLog, LogUsage, Retention, SharedState, StateError,
    StateStore,
};
use probity::{Effect, Engine, Request};
use redb::{ReadableTable as _, TableDefinition};

const DECISIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("decisions");

/// The decision log before the chain: JSON records keyed by sequence number, one
/// durable transaction per group. Everything else goes to a real store.
#[derive(Debug)]
struct Unchained {
    db: redb::Database,
    rest: Arc<StateStore>,
}

impl Unchained {
    fn open(dir: &Path) -> Self {
        let rest = Arc::new(StateStore::open(&dir.join("rest")).unwrap());
        let db = redb::Database::create(dir.join("log.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(DECISIONS).unwrap();
        txn.commit().unwrap();
        Self { db, rest }
    }
}

fn failed(e: impl std::error::Error + Send + Sync + 'static) -> StateError {
    StateError::Shared {
        backend: "bench".into(),
        operation: "appending",
        source: Box::new(e),
    }
}

impl LocalLog for Unchained {
    fn record_event(&self, o: &str, n: Option<&str>, k: &str, d: &str) -> Result<u64, StateError> {
        self.rest.record_event(o, n, k, d)
    }
    fn events(&self, from: u64) -> Result<Vec<Event>, StateError> {
        self.rest.events(from)
    }
    fn record_decisions(&self, records: &mut [DecisionRecord]) -> Result<u64, StateError> {
        let encoded: Vec<Vec<u8>> = records
            .iter()
            .map(|r| serde_json::to_vec(r).unwrap())
            .collect();
        let txn = self.db.begin_write().map_err(failed)?;
        let first = {
            let mut table = txn.open_table(DECISIONS).map_err(failed)?;
            let first = table
                .last()
                .map_err(failed)?
                .map_or(0, |(k, _)| k.value() + 1);
            for (seq, bytes) in (first..).zip(&encoded) {
                table.insert(seq, bytes.as_slice()).map_err(failed)?;
            }
            first
        };
        txn.commit().map_err(failed)?;
        Ok(first)
    }
    fn decisions(&self, _: u64, _: usize) -> Result<Vec<DecisionRecord>, StateError> {
        Ok(Vec::new())
    }
    fn decision_log_usage(&self) -> Result<LogUsage, StateError> {
        Ok(LogUsage::default())
    }
    fn prune_decisions(&self, _: &Retention, _: u64) -> Result<u64, StateError> {
        Ok(0)
    }
}

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Recorded denies per second with `store` attached: `threads` threads deciding
/// `denies` denies in all, each waiting for its record's commit.
fn run(store: Option<AttachedState>, threads: usize, denies: usize) -> f64 {
    let engine = Engine::builder(root().join("policies")).build().unwrap();
    let text = std::fs::read_to_string(root().join("testdata/entities/cluster.json")).unwrap();
    engine
        .upsert_entities(&serde_json::from_str(&text).unwrap())
        .unwrap();
    if let Some(store) = store {
        engine.attach_state(store).unwrap();
    }
    engine.block_node("gpu-a1", "bench").unwrap();
    let request = Request::from_json_value(&serde_json::json!({
        "principal": "Workload::\"train-1\"",
        "action": "schedule",
        "resource": "Node::\"gpu-a1\"",
    }))
    .unwrap();
    assert_eq!(engine.decide(&request).decision, Effect::Deny);
    let per_thread = denies / threads;
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..per_thread {
                    assert_eq!(engine.decide(&request).decision, Effect::Deny);
                }
            });
        }
    });
    (per_thread * threads) as f64 / start.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(8, |a| a.parse().unwrap());
    let denies: usize = args.get(2).map_or(40_000, |a| a.parse().unwrap());
    let rounds: usize = args.get(3).map_or(3, |a| a.parse().unwrap());
    let names = ["unrecorded", "unchained", "chained", "chained+signed"];
    let mut rates = vec![Vec::new(); names.len()];
    let mut verified = Vec::new();
    for round in 1..=rounds {
        for (i, name) in names.iter().enumerate() {
            // ONLY=NAME runs one set-up (for a profile of it alone).
            if std::env::var("ONLY").is_ok_and(|only| only != *name) {
                continue;
            }
            let tmp = tempfile::tempdir().unwrap();
            let mut chained = None;
            let store: Option<AttachedState> = match i {
                0 => None,
                1 => {
                    let unchained = Unchained::open(tmp.path());
                    let shared = Arc::clone(&unchained.rest) as Arc<dyn SharedState>;
                    Some(AttachedState::new(shared, Arc::new(unchained)))
                }
                _ => {
                    let s = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
                    if i == 3 {
                        let anchor = SoftwareAnchor::generate(&tmp.path().join("a.key")).unwrap();
                        s.set_checkpoint_policy(CheckpointPolicy {
                            anchor: Some(Arc::new(anchor)),
                            ..CheckpointPolicy::default()
                        });
                        chained = Some(s.clone());
                    }
                    Some(s.into())
                }
            };
            let rate = run(store, threads, denies);
            println!("round {round} {name:>15}: {rate:>9.0} denies/s");
            rates[i].push(rate);
            if let Some(s) = chained {
                let key = s.checkpoint_policy().anchor.unwrap().public_key().clone();
                let start = Instant::now();
                let report = probity::audit::verify(&s, Some(&key)).unwrap();
                let n = report.logs[0].records as f64;
                let per_s = n / start.elapsed().as_secs_f64();
                println!(
                    "round {round} verify: {n} records, {} signed checkpoints, {per_s:.0} records/s",
                    report.logs[0].signed_checkpoints
                );
                verified.push(per_s);
            }
        }
    }
    println!("median verify: {:.0} records/s", median(&mut verified));
    let unrecorded = median(&mut rates[0].clone());
    let base = median(&mut rates[1].clone());
    for (name, r) in names.iter().zip(&mut rates) {
        let m = median(r);
        println!(
            "median {name:>15}: {m:>9.0} denies/s ({:.2}x unchained, {:.2}x unrecorded)",
            m / base,
            m / unrecorded
        );
    }
}
