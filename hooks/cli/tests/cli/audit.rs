//! `probity audit`: its filters, `--follow`, `verify` and `checkpoint`, through the binary.

use std::io::BufReader;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use probity::state::{DecisionRecord, StateStore};
use probity::{Decision, Effect, Obligation, Reason, Severity};

fn decision(effect: Effect, policy: &str, target: Option<&str>) -> Decision {
    Decision {
        decision: effect,
        reasons: vec![Reason {
            policy: policy.into(),
            message: "m".into(),
            severity: Severity::High,
        }],
        obligations: target
            .map(|t| Obligation {
                kind: "alert".into(),
                target: Some(t.into()),
                parameters: Default::default(),
                policy: policy.into(),
            })
            .into_iter()
            .collect(),
        errors: Vec::new(),
        score: 0,
        warnings: Vec::new(),
        audit: Vec::new(),
        unrecorded: false,
    }
}

fn record(principal: &str, resource: &str, decision: Decision) -> DecisionRecord {
    DecisionRecord {
        seq: 0,
        time_unix_ms: 1_700_000_000_000,
        principal: principal.into(),
        action: "Action::\"schedule\"".into(),
        resource: resource.into(),
        caller: None,
        request: None,
        sampled: false,
        policy_digest: "0".repeat(64),
        decision,
    }
}

/// Appends `records`, retrying while a `--follow` holds the state for a moment.
fn append(state: &Path, mut records: Vec<DecisionRecord>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match StateStore::open(state) {
            Ok(store) => {
                store.record_decisions(&mut records).unwrap();
                return;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot open the state: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Six records: seq 0 deny on gpu-1 (thermal), 1 deny on gpu-2 (placement), 2 allow
/// with an alert on gpu-1 (power), 3 deny by gpu-1 as principal (placement), 4 allow
/// with an alert targeting gpu-3 (thermal), 5 deny on gpu-10 (thermal).
fn sample(state: &Path) {
    append(
        state,
        vec![
            record(
                "Workload::\"a\"",
                "Node::\"gpu-1\"",
                decision(Effect::Deny, "thermal.hot", None),
            ),
            record(
                "Workload::\"b\"",
                "Node::\"gpu-2\"",
                decision(Effect::Deny, "placement.full", None),
            ),
            record(
                "Workload::\"c\"",
                "Node::\"gpu-1\"",
                decision(Effect::Allow, "power.spike", Some("Node::\"gpu-1\"")),
            ),
            record(
                "Node::\"gpu-1\"",
                "Model::\"m\"",
                decision(Effect::Deny, "placement.full", None),
            ),
            record(
                "Workload::\"d\"",
                "Zone::\"z\"",
                decision(Effect::Allow, "thermal.hot", Some("Node::\"gpu-3\"")),
            ),
            record(
                "Workload::\"e\"",
                "Node::\"gpu-10\"",
                decision(Effect::Deny, "thermal.hot", None),
            ),
        ],
    );
}

fn audit(state: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_probity"))
        .arg("audit")
        .args(args)
        .env("PROBITY_STATE_DIR", state)
        .output()
        .unwrap()
}

fn seqs(out: &Output) -> Vec<u64> {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

#[test]
fn audit_filters_by_node_policy_and_decision() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    sample(&state);
    assert_eq!(seqs(&audit(&state, &[])), [0, 1, 2, 3, 4, 5]);
    // Principal, resource or an obligation's target; gpu-1 is not gpu-10.
    assert_eq!(seqs(&audit(&state, &["--node", "gpu-1"])), [0, 2, 3]);
    assert_eq!(seqs(&audit(&state, &["--node", "gpu-3"])), [4]);
    assert_eq!(
        seqs(&audit(&state, &["--policy", "thermal.hot"])),
        [0, 4, 5]
    );
    assert_eq!(seqs(&audit(&state, &["--decision", "allow"])), [2, 4]);
    assert_eq!(seqs(&audit(&state, &["--decision", "deny"])), [0, 1, 3, 5]);
    assert_eq!(
        seqs(&audit(
            &state,
            &[
                "--node",
                "gpu-1",
                "--decision",
                "deny",
                "--policy",
                "placement.full"
            ]
        )),
        [3]
    );
    // --limit counts printed records, --from where to start.
    assert_eq!(
        seqs(&audit(
            &state,
            &["--decision", "deny", "--limit", "2", "--from", "1"]
        )),
        [1, 3]
    );
    let bad = audit(&state, &["--decision", "maybe"]);
    assert_eq!(bad.status.code(), Some(2));
}

struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn follow(state: &Path, args: &[&str]) -> Guard {
    follow_every(state, "50", args)
}

fn follow_every(state: &Path, poll_ms: &str, args: &[&str]) -> Guard {
    Guard(
        Command::new(env!("CARGO_BIN_EXE_probity"))
            .args(["audit", "--follow", "--poll-ms", poll_ms])
            .args(args)
            .env("PROBITY_STATE_DIR", state)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

fn line_seq(reader: &mut impl std::io::BufRead) -> u64 {
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    serde_json::from_str::<serde_json::Value>(&line).unwrap()["seq"]
        .as_u64()
        .unwrap()
}

/// Waits, within a bound, for the child to exit; its exit code.
fn exit_code(child: &mut Child) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        assert!(Instant::now() < deadline, "the follower did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn audit_follow_prints_new_records_through_its_filters_and_exits_0_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    sample(&state);
    let mut child = follow(&state, &["--node", "gpu-1"]);
    let mut reader = BufReader::new(child.0.stdout.take().unwrap());
    assert_eq!(
        [0, 0, 0].map(|_| line_seq(&mut reader)),
        [0, 2, 3],
        "what is there first"
    );
    append(
        &state,
        vec![
            record(
                "Workload::\"f\"",
                "Node::\"gpu-2\"",
                decision(Effect::Deny, "thermal.hot", None),
            ),
            record(
                "Workload::\"g\"",
                "Node::\"gpu-1\"",
                decision(Effect::Deny, "thermal.hot", None),
            ),
        ],
    );
    assert_eq!(line_seq(&mut reader), 7);
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(exit_code(&mut child.0), Some(0));
}

#[test]
fn audit_follow_exits_0_on_sigint() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    sample(&state);
    let mut child = follow(&state, &[]);
    let mut reader = BufReader::new(child.0.stdout.take().unwrap());
    assert_eq!(line_seq(&mut reader), 0);
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(exit_code(&mut child.0), Some(0));
}

#[test]
fn audit_follow_ends_quietly_when_its_reader_goes_away() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    sample(&state);
    let mut child = follow(&state, &[]);
    let mut reader = BufReader::new(child.0.stdout.take().unwrap());
    assert_eq!(line_seq(&mut reader), 0);
    drop(reader);
    // The next record it writes finds the pipe closed.
    append(
        &state,
        vec![record(
            "Workload::\"f\"",
            "Node::\"gpu-2\"",
            decision(Effect::Deny, "thermal.hot", None),
        )],
    );
    assert_eq!(exit_code(&mut child.0), Some(0));
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!err.contains("error"), "{err}");
}

#[test]
fn audit_follow_ends_quietly_when_its_reader_goes_away_with_no_record_coming() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    sample(&state);
    // No poll comes within the test's bound: the watch on the pipe ends it.
    let mut child = follow_every(&state, "600000", &[]);
    let mut reader = BufReader::new(child.0.stdout.take().unwrap());
    assert_eq!(line_seq(&mut reader), 0);
    drop(reader);
    assert_eq!(exit_code(&mut child.0), Some(0));
}

#[test]
fn audit_verify_reports_what_it_cannot_vouch_for_and_checks_signed_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    sample(&state);
    let out = audit(&state, &["verify"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verified"], true);
    assert_eq!(report["report"]["logs"][0]["records"], 6);
    assert_eq!(report["report"]["logs"][0]["unwitnessed"], 6);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("note: checkpoint signatures were not checked"),
        "{err}"
    );
    assert!(
        err.contains("decisions: the last 6 records come after the last checkpoint"),
        "{err}"
    );
    assert!(
        err.contains("the SIEM's forwarded copy is their witness"),
        "{err}"
    );

    // Signed by the software anchor, checked against its key.
    let out = audit(&state, &["checkpoint"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cp: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (cp["log"].as_str(), cp["seq"].as_u64()),
        (Some("decisions"), Some(5))
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("software anchor (not an HSM)"));
    let anchor =
        probity::integrity::SoftwareAnchor::load_or_generate(&state.join("anchor.key")).unwrap();
    let pinned = tmp.path().join("audit.pub");
    (probity::integrity::Anchor::public_key(&anchor))
        .pin(&pinned)
        .unwrap();
    let out = audit(
        &state,
        &["verify", "--public-key", pinned.to_str().unwrap()],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["report"]["logs"][0]["signed_checkpoints"], 1);
    assert_eq!(report["report"]["logs"][0]["unwitnessed"], 0);

    // An unsigned checkpoint where a key is required: exit 5, naming it.
    let plain = tmp.path().join("plain");
    sample(&plain);
    StateStore::open(&plain).unwrap().checkpoint(true).unwrap();
    let out = audit(
        &plain,
        &["verify", "--public-key", pinned.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(5));
    let failure: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(failure["seq"], 5);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "error: the audit trail was tampered with: decisions log: checkpoint 5 is unsigned"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
