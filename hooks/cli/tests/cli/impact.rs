//! `probity policy impact`: a recorded log replayed under a candidate set finds exactly
//! the decisions a differential computation finds by deciding each original request
//! under both sets.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use probity::state::StateStore;
use probity::{DecideOptions, Decision, Engine, Request};
use serde_json::{Value, json};

use crate::{copy_policies, probity, root, text};

/// The requests asked: every stored workload onto every node, and admissions of
/// request-scoped inference workloads of several shapes.
fn requests() -> Vec<Request> {
    let workloads = ["infer-ok", "infer-greedy", "train-1", "rlhf-1", "cpu-job"];
    let nodes = [
        "gpu-a1",
        "gpu-h1",
        "gpu-hot1",
        "gpu-blocked",
        "gpu-drift",
        "gpu-warm",
        "cpu-1",
    ];
    let mut out = Vec::new();
    for w in workloads {
        for n in nodes {
            out.push(
                Request::from_json_value(&json!({
                    "principal": format!("Workload::\"{w}\""),
                    "action": "schedule",
                    "resource": format!("Node::\"{n}\""),
                }))
                .unwrap(),
            );
        }
    }
    for (i, (gpus, cpu)) in [(1, 8000), (2, 8000), (2, 12000), (4, 16000), (8, 64000)]
        .into_iter()
        .enumerate()
    {
        out.push(
            Request::from_json_value(&json!({
                "principal": format!("Workload::\"req-{i}\""),
                "action": "admit",
                "resource": "Namespace::\"inference\"",
                "entities": [{
                    "uid": {"type": "Workload", "id": format!("req-{i}")},
                    "parents": [{"type": "Namespace", "id": "inference"}],
                    "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "inference"}},
                              "class": "inference", "gpus": gpus, "cpuMillis": cpu,
                              "gpuMemoryMiB": 1000, "image": "triton:1"}
                }]
            }))
            .unwrap(),
        );
    }
    out
}

/// An engine on `dir` with the test cluster and gpu-blocked blocked.
fn engine_on(dir: &std::path::Path) -> Engine {
    let engine = Engine::builder(dir).build().unwrap();
    engine.upsert_entities(&crate::cluster_json()).unwrap();
    engine
}

/// The candidate: the inference ratio halved, the zone ceiling only warning, and a new
/// audit rule on big schedules.
fn candidate() -> tempfile::TempDir {
    let dir = copy_policies();
    let config = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("inference_cpus_per_gpu = 8", "inference_cpus_per_gpu = 4");
    std::fs::write(
        &config,
        format!("{text}\n[modes]\n\"thermal.zone-power-ceiling\" = \"warn\"\n"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("placement/big.cedar"),
        r#"@id("placement.big-schedules")
@severity("low")
@message("more than 4 GPUs in one schedule")
@mode("audit")
forbid (principal, action == Action::"schedule", resource)
when { principal.gpus > 4 };
"#,
    )
    .unwrap();
    dir
}

fn changed(live: &Decision, candidate: &Decision) -> bool {
    let obligations = |d: &Decision| -> BTreeSet<String> {
        d.obligations
            .iter()
            .map(|o| format!("{}/{}/{:?}", o.policy, o.kind, o.target))
            .collect()
    };
    let findings = |d: &Decision| -> BTreeSet<String> {
        d.warnings
            .iter()
            .chain(&d.audit)
            .map(|n| n.policy.clone())
            .collect()
    };
    live.decision != candidate.decision
        || obligations(live) != obligations(candidate)
        || findings(live) != findings(candidate)
}

#[test]
fn impact_finds_exactly_the_decisions_a_differential_replay_finds() {
    let state = tempfile::tempdir().unwrap();
    let asked = requests();
    {
        let engine = engine_on(&root().join("policies"));
        engine
            .attach_state(Arc::new(StateStore::open(state.path()).unwrap()))
            .unwrap();
        engine.block_node("gpu-blocked", "fixture").unwrap();
        engine.sample_allows(1);
        for r in &asked {
            engine.decide(r);
        }
    }
    // Every decision recorded (allows sampled), each with its request.
    let store = StateStore::open(state.path()).unwrap();
    let records = store.decisions(0, 10_000).unwrap();
    assert_eq!(records.len(), asked.len(), "every decision recorded");
    let admitted = records.iter().find(|r| r.action.contains("admit")).unwrap();
    let kept = admitted.request.as_ref().unwrap();
    assert_eq!(kept.entities[0]["attrs"]["cpuMillis"], 8000);
    assert!(records.iter().any(|r| r.sampled && r.decision.is_allowed()));
    drop(store);

    // The differential: each original request decided under both sets.
    let candidate_dir = candidate();
    let live = engine_on(&root().join("policies"));
    let cand = engine_on(candidate_dir.path());
    let mut expected_changed = 0u64;
    let mut flips: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for r in &asked {
        let decide = |e: &Engine| {
            e.block_node("gpu-blocked", "fixture").unwrap();
            e.decide_with(std::slice::from_ref(r), DecideOptions::new().dry_run())
                .settle()
                .pop()
                .unwrap()
        };
        let (l, c) = (decide(&live), decide(&cand));
        if changed(&l, &c) {
            expected_changed += 1;
        }
        match (l.is_allowed(), c.is_allowed()) {
            (true, false) => {
                for p in c.reason_ids() {
                    flips.entry(p.to_owned()).or_default().0 += 1;
                }
            }
            (false, true) => {
                for p in l.reason_ids() {
                    flips.entry(p.to_owned()).or_default().1 += 1;
                }
            }
            _ => {}
        }
    }
    assert!(
        expected_changed > 0,
        "the candidate changes nothing: a test that cannot fail"
    );

    let out = probity(&[
        "policy",
        "impact",
        candidate_dir.path().to_str().unwrap(),
        "--state",
        state.path().to_str().unwrap(),
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        "policies",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["replayed"], asked.len(), "{report}");
    assert_eq!(report["not_replayable"], 0, "{report}");
    assert_eq!(report["changed"], expected_changed, "{report:#}");
    for (policy, (to_deny, to_allow)) in &flips {
        assert_eq!(
            report["policies"][policy]["allow_to_deny"], *to_deny,
            "{policy}: {report:#}"
        );
        assert_eq!(
            report["policies"][policy]["deny_to_allow"], *to_allow,
            "{policy}: {report:#}"
        );
    }
    // What the candidate changes, by name: the ratio refuses less, the ceiling no longer
    // denies or migrates, the new audit rule finds the 8-GPU schedules.
    let policies = &report["policies"];
    assert!(
        policies["placement.inference-gpu-cpu-ratio"]["deny_to_allow"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(
        policies["thermal.zone-power-ceiling"]["obligations_lost"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(
        policies["placement.big-schedules"]["findings_gained"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(!policies["thermal.zone-power-ceiling"]["examples"][0]["live"].is_null());

    // The same log exported by `probity audit` and replayed from the file.
    let exported = probity(&["audit", "--state-dir", state.path().to_str().unwrap()]);
    assert_eq!(
        exported.status.code(),
        Some(0),
        "{}",
        text(&exported.stderr)
    );
    let file = state.path().join("../exported.ndjson");
    std::fs::write(&file, &exported.stdout).unwrap();
    let out = probity(&[
        "policy",
        "impact",
        candidate_dir.path().to_str().unwrap(),
        "--records",
        file.to_str().unwrap(),
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        "policies",
        "--json",
    ]);
    let from_file: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Without the state's blocklist the blocked node is not blocked: only the counts
    // that do not involve it are compared.
    assert_eq!(from_file["replayed"], asked.len(), "{from_file}");
    let ratio = |r: &Value| {
        let p = &r["policies"]["placement.inference-gpu-cpu-ratio"];
        (p["allow_to_deny"].clone(), p["deny_to_allow"].clone())
    };
    assert_eq!(ratio(&from_file), ratio(&report), "{from_file:#}");

    // The same set as candidate: nothing changes, exit 0; the text report says so.
    let out = probity(&[
        "policy",
        "impact",
        "policies",
        "--state",
        state.path().to_str().unwrap(),
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        "policies",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with(&format!(
            "replayed {} decisions; 0 would change; 0 not replayable",
            asked.len()
        )),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn impact_reads_an_exported_log_and_names_a_bad_line() {
    let tmp = tempfile::tempdir().unwrap();
    let records = tmp.path().join("records.ndjson");
    std::fs::write(&records, "{\"seq\": 0}\n").unwrap();
    let out = probity(&[
        "policy",
        "impact",
        "policies",
        "--records",
        records.to_str().unwrap(),
        "--policies",
        "policies",
    ]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("records.ndjson:1: not a decision record"),
        "{}",
        text(&out.stderr)
    );
    let out = probity(&["policy", "impact", "policies", "--policies", "policies"]);
    assert!(
        text(&out.stderr).contains("nothing to replay"),
        "{}",
        text(&out.stderr)
    );
}
