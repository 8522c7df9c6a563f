//! Slurm: `POST /v1/slurm/submit` (job admission), `POST /v1/slurm/prolog` (placement
//! where the job starts), and a Slurm job as the reader of `POST /v1/verify`.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use probity::state::{SharedState, StateStore};
use probity_server::{AppState, Caller, Config, PeerProcess, UnknownJobs, app};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::{call, call_raw};

/// A server over the test cluster with a state store attached (facts are remembered,
/// events appended), as `Config` says.
fn slurm_state(tmp: &std::path::Path, config: Config) -> (AppState, Arc<StateStore>) {
    let store = Arc::new(StateStore::open(&tmp.join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    (AppState::new(engine, config), store)
}

async fn submit(s: &AppState, job: Value) -> (StatusCode, Value) {
    call(
        s,
        Method::POST,
        "/v1/slurm/submit",
        Some(&json!({ "job": job })),
        Some("uid:64030"),
    )
    .await
}

async fn prolog(s: &AppState, body: Value) -> (StatusCode, Value) {
    call(
        s,
        Method::POST,
        "/v1/slurm/prolog",
        Some(&body),
        Some("uid:0"),
    )
    .await
}

/// A submitted job's token (it must be admitted).
async fn admitted(s: &AppState, job: Value) -> String {
    let (status, out) = submit(s, job).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["allowed"], true, "{out}");
    out["submission"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn an_inference_job_keeps_eight_cpus_per_gpu_and_an_admitted_one_gets_a_token() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, store) = slurm_state(tmp.path(), Config::default());
    let job = json!({"partition": "inference", "comment": "class=inference", "tres_per_node": "gres/gpu:1",
                     "min_cpus": "4", "min_nodes": "1", "user_id": "1000", "name": "serve"});
    let (status, out) = submit(&s, job).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["allowed"], false, "{out}");
    assert_eq!(out["submission"], Value::Null);
    assert_eq!(
        out["message"],
        "Probity: placement.inference-gpu-cpu-ratio: the inference namespace keeps at most 1 GPU per configured number of CPUs"
    );
    assert_eq!(
        out["reasons"],
        json!([{"policy": "placement.inference-gpu-cpu-ratio",
                "message": "the inference namespace keeps at most 1 GPU per configured number of CPUs"}])
    );
    assert_eq!(out["workload"]["gpus"], 1);
    assert_eq!(out["workload"]["cpuMillis"], 4000);
    // The refusal was recorded, as admission's are.
    let records = store.decisions(0, 10).unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].action, r#"Action::"admit""#);

    let job = json!({"partition": "inference", "comment": "class=inference", "tres_per_node": "gres/gpu:1",
                     "num_tasks": "1", "cpus_per_task": "8"});
    let (status, out) = submit(&s, job).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["allowed"], true, "{out}");
    assert!(out.get("message").is_none(), "{out}");
    assert_eq!(out["reasons"], json!([]));
    let token = out["submission"].as_str().unwrap();
    assert_eq!(token.len(), 32, "{token}");
    assert!(
        token
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(
        out["workload"],
        json!({
            "namespace": {"__entity": {"type": "Namespace", "id": "inference"}},
            "namespaceMatches": ["inference", "i*", "in*", "inf*", "infe*", "infer*", "infere*",
                                  "inferen*", "inferenc*", "inference*"],
            "class": "inference", "gpus": 1, "cpuMillis": 8000, "gpuMemoryMiB": 0,
            "image": "", "tolerations": [], "nodeFeatures": [], "partition": "inference",
        })
    );
    let facts = store
        .admitted("slurm-submission", token, 3600)
        .unwrap()
        .unwrap();
    assert_eq!(
        (facts.uid.as_str(), &facts.attrs),
        (token, &out["workload"])
    );
}

#[tokio::test]
async fn the_class_comes_from_the_comment_then_the_qos_and_an_unknown_one_is_named() {
    let s = crate::state();
    let base = json!({"partition": "training", "qos": "training", "tres_per_job": "gres/gpu:2"});
    let (_, out) = submit(&s, base.clone()).await;
    assert_eq!(
        (out["allowed"].clone(), out["workload"]["class"].clone()),
        (json!(true), json!("training")),
        "{out}"
    );
    let mut job = base.clone();
    job["comment"] = json!("team=nlp, class=batch");
    let (_, out) = submit(&s, job).await;
    assert_eq!(out["workload"]["class"], "batch", "{out}");
    // The qos names no class the policies know.
    let mut job = base.clone();
    job["qos"] = json!("normal");
    let (_, out) = submit(&s, job).await;
    assert_eq!(out["allowed"], false, "{out}");
    assert_eq!(
        out["message"],
        "Probity: placement.unknown-workload-class: workload class \"normal\" is not one of the configured classes"
    );
    // Nothing names one, and there is no default class.
    let (_, out) = submit(&s, json!({"partition": "training"})).await;
    assert_eq!(
        out["message"],
        "Probity: placement.unknown-workload-class: workload class \"\" is not one of the configured classes",
        "{out}"
    );
    // Without a state backend an admitted job has no token, and a warning says why.
    let (_, out) = submit(&s, base).await;
    assert_eq!(out["submission"], Value::Null);
    assert_eq!(
        out["warnings"][0]["policy"], "slurm.facts-not-remembered",
        "{out}"
    );
}

#[tokio::test]
async fn rlhf_work_is_submitted_only_to_its_partition_or_node_set() {
    let s = crate::state();
    let job = |partition: &str, features: &str| {
        json!({"partition": partition, "comment": "class=rlhf", "tres_per_node": "gres/gpu:a100:8",
               "min_nodes": "2", "num_tasks": "16", "cpus_per_task": "8", "features": features})
    };
    let (_, out) = submit(&s, job("train", "")).await;
    assert_eq!(out["allowed"], false, "{out}");
    assert_eq!(out["reasons"][0]["policy"], "placement.rlhf-partition");
    assert!(
        out["message"]
            .as_str()
            .unwrap()
            .starts_with("Probity: placement.rlhf-partition: RL-HF work is submitted only to its partitions or node set"),
        "{out}"
    );
    assert!(
        out["message"]
            .as_str()
            .unwrap()
            .contains("partition train is neither"),
        "{out}"
    );
    let (_, out) = submit(&s, job("rlhf", "")).await;
    assert_eq!(out["allowed"], true, "{out}");
    assert_eq!(
        (
            out["workload"]["gpus"].as_i64(),
            out["workload"]["cpuMillis"].as_i64()
        ),
        (Some(16), Some(128_000))
    );
    let (_, out) = submit(&s, job("train", "rlhf&ib")).await;
    assert_eq!(out["allowed"], true, "{out}");
    assert_eq!(out["workload"]["nodeFeatures"], json!(["ib", "rlhf"]));
    // An alternative is no requirement.
    let (_, out) = submit(&s, job("train", "rlhf|ib")).await;
    assert_eq!(out["allowed"], false, "{out}");
    // A job that may run in several partitions is admitted only if each admits it.
    let (_, out) = submit(&s, job("rlhf,train", "")).await;
    assert_eq!(out["allowed"], false, "{out}");
    assert_eq!(out["reasons"][0]["policy"], "placement.rlhf-partition");
    // One that names no partition has no namespace to be judged in.
    let (_, out) = submit(&s, json!({"comment": "class=training"})).await;
    assert_eq!(out["allowed"], false, "{out}");
    assert_eq!(out["reasons"][0]["policy"], "slurm.no-namespace");
}

#[tokio::test]
async fn malformed_jobs_are_400s_naming_the_field_and_sentinels_are_unset() {
    let s = crate::state();
    let (status, out) = submit(&s, json!({"partition": "training", "mem_per_cpu": "100"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .starts_with("job.mem_per_cpu: unknown field"),
        "{out}"
    );
    let (status, out) = submit(&s, json!({"partition": "training", "num_tasks": "four"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        out["error"],
        "job.num_tasks: \"four\" is not a whole number"
    );
    let (status, out) = submit(&s, json!({"partition": "training", "min_cpus": 4})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .starts_with("job.min_cpus: expected a string"),
        "{out}"
    );
    let (status, out) = submit(
        &s,
        json!({"partition": "training", "tres_per_node": "gres/gpu:a100:x"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .starts_with("job.tres_per_node: \"gres/gpu:a100:x\""),
        "{out}"
    );
    let (status, _) = call(
        &s,
        Method::POST,
        "/v1/slurm/submit",
        Some(&json!({"job": {}, "x": 1})),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, out) = call_raw(
        &s,
        Method::POST,
        "/v1/slurm/submit",
        b"{\"job\": ".to_vec(),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        out["error"].as_str().unwrap().contains("not valid JSON"),
        "{out}"
    );
    let (status, _) = call_raw(
        &s,
        Method::POST,
        "/v1/slurm/submit",
        vec![b' '; 2 * 1024 * 1024],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    // NO_VAL, NO_VAL16, INFINITE and NO_VAL64 are unset: one node, one task, one CPU.
    let (status, out) = submit(
        &s,
        json!({"partition": "training", "comment": "class=training", "tres_per_node": "gres/gpu:2",
               "min_nodes": "4294967294", "num_tasks": "4294967295", "cpus_per_task": "65534",
               "min_cpus": "18446744073709551614", "user_id": "4294967294", "gres": "", "qos": null}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(
        (
            out["workload"]["gpus"].as_i64(),
            out["workload"]["cpuMillis"].as_i64()
        ),
        (Some(2), Some(1000))
    );
}

#[tokio::test]
async fn the_prolog_copies_the_facts_to_each_job_of_a_submission_and_finds_them_again_by_its_id() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, store) = slurm_state(tmp.path(), Config::default());
    let token = admitted(
        &s,
        json!({"partition": "training", "comment": "class=training", "tres_per_job": "gres/gpu:4", "num_tasks": "4", "cpus_per_task": "8"}),
    )
    .await;
    let (status, out) = prolog(
        &s,
        json!({"job": "4101", "node": "gpu-a1", "submission": token}),
    )
    .await;
    assert_eq!(
        (status, &out),
        (StatusCode::OK, &json!({"verdict": "allow"}))
    );
    // The token keeps its facts: every task of a job array carries the same one.
    assert!(
        store
            .admitted("slurm-submission", &token, 3600)
            .unwrap()
            .is_some()
    );
    let (_, out) = prolog(
        &s,
        json!({"job": "4102", "node": "gpu-a1", "submission": token}),
    )
    .await;
    assert_eq!(out, json!({"verdict": "allow"}), "a second array task");
    assert!(store.admitted("slurm-job", "4102", 3600).unwrap().is_some());
    let moved = store.admitted("slurm-job", "4101", 3600).unwrap().unwrap();
    assert_eq!(
        (moved.uid.as_str(), moved.attrs["gpus"].as_i64()),
        ("4101", Some(4))
    );
    // Requeued and started again: by its id alone, or with the spent token.
    let (_, out) = prolog(&s, json!({"job": "4101", "node": "gpu-a1"})).await;
    assert_eq!(out, json!({"verdict": "allow"}));
    let (_, out) = prolog(
        &s,
        json!({"job": "4101", "node": "gpu-a1", "submission": token}),
    )
    .await;
    assert_eq!(out, json!({"verdict": "allow"}));
    assert!(store.events(0).unwrap().is_empty());
}

#[tokio::test]
async fn a_refused_node_is_the_nodes_fault_and_a_refused_job_the_jobs_and_each_is_an_event() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, store) = slurm_state(tmp.path(), Config::default());
    let training = json!({"partition": "training", "comment": "class=training", "tres_per_job": "gres/gpu:4", "min_cpus": "32"});
    // A blocked node.
    let token = admitted(&s, training.clone()).await;
    let (_, out) = prolog(
        &s,
        json!({"job": "7", "node": "gpu-blocked", "submission": token}),
    )
    .await;
    assert_eq!(
        out,
        json!({"verdict": "node", "policy": "security.blocked-node",
               "message": "Probity: security.blocked-node: a blocked node takes part in this request (blocked: fixture: blocked since the cluster was set up)"})
    );
    // Refused, the job's facts stay: it starts elsewhere.
    let (_, out) = prolog(&s, json!({"job": "7", "node": "gpu-a1"})).await;
    assert_eq!(out["verdict"], "allow", "{out}");
    // A node failing its own compliance (driver drift) is at fault too.
    let (_, out) = prolog(&s, json!({"job": "7", "node": "gpu-drift"})).await;
    assert_eq!(
        (out["verdict"].as_str(), out["policy"].as_str()),
        (Some("node"), Some("placement.driver-drift")),
        "{out}"
    );
    // And one Probity knows nothing about.
    let (_, out) = prolog(&s, json!({"job": "7", "node": "gpu-nowhere"})).await;
    assert_eq!(
        (out["verdict"].as_str(), out["policy"].as_str()),
        (Some("node"), Some("slurm.unknown-node")),
        "{out}"
    );
    // An RL-HF job on a node outside its dedicated zone: the job is at fault.
    let token = admitted(
        &s,
        json!({"partition": "rlhf", "comment": "class=rlhf", "tres_per_node": "gres/gpu:8", "min_cpus": "64"}),
    )
    .await;
    let (_, out) = prolog(
        &s,
        json!({"job": "8", "node": "gpu-a1", "submission": token}),
    )
    .await;
    assert_eq!(
        out,
        json!({"verdict": "job", "policy": "placement.rlhf-dedicated-zone",
               "message": "Probity: placement.rlhf-dedicated-zone: RL-HF work goes only to its dedicated zone"})
    );
    let (_, out) = prolog(&s, json!({"job": "8", "node": "gpu-h1"})).await;
    assert_eq!(out["verdict"], "allow", "{out}");

    let events = store.events(0).unwrap();
    let summary: Vec<(&str, Option<&str>, &str)> = events
        .iter()
        .map(|e| (e.object_id.as_str(), e.node.as_deref(), e.kind.as_str()))
        .collect();
    assert_eq!(
        summary,
        [
            ("slurm-job/7", Some("gpu-blocked"), "slurm-prolog-refused"),
            ("slurm-job/7", Some("gpu-drift"), "slurm-prolog-refused"),
            ("slurm-job/7", Some("gpu-nowhere"), "slurm-prolog-refused"),
            ("slurm-job/8", Some("gpu-a1"), "slurm-prolog-refused"),
        ]
    );
    assert_eq!(
        events[0].detail,
        "verdict node by security.blocked-node: Probity: security.blocked-node: a blocked node takes part in this request (blocked: fixture: blocked since the cluster was set up); node drained and job requeued"
    );
    assert!(
        events[3].detail.ends_with("; job requeued held"),
        "{}",
        events[3].detail
    );
}

#[tokio::test]
async fn a_job_without_facts_is_refused_or_allowed_as_configured() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, store) = slurm_state(tmp.path(), Config::default());
    let (_, out) = prolog(&s, json!({"job": "99", "node": "gpu-a1"})).await;
    assert_eq!(
        out,
        json!({"verdict": "job", "policy": "slurm.unknown-job",
               "message": "Probity: slurm.unknown-job: no facts are remembered for job 99 (submitted before Probity answered, or over remember_seconds ago)"})
    );
    // A token that holds nothing is no better.
    let (_, out) = prolog(
        &s,
        json!({"job": "99", "node": "gpu-a1", "submission": "0123456789abcdef0123456789abcdef"}),
    )
    .await;
    assert_eq!(out["policy"], "slurm.unknown-job", "{out}");
    let events = store.events(0).unwrap();
    assert_eq!(events.len(), 2);
    assert!(
        events[0]
            .detail
            .starts_with("verdict job by slurm.unknown-job: "),
        "{}",
        events[0].detail
    );

    let tmp = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.slurm.unknown_job = UnknownJobs::Allow;
    let (s, store) = slurm_state(tmp.path(), config);
    let (_, out) = prolog(&s, json!({"job": "99", "node": "gpu-a1"})).await;
    assert_eq!(out, json!({"verdict": "allow"}));
    assert!(store.events(0).unwrap().is_empty());
}

#[tokio::test]
async fn malformed_prolog_requests_are_400s() {
    let s = crate::state();
    for (body, starts) in [
        (
            json!({"job": "12a", "node": "gpu-a1"}),
            "job: \"12a\" is not a Slurm job id",
        ),
        (
            json!({"job": "", "node": "gpu-a1"}),
            "job: \"\" is not a Slurm job id",
        ),
        (
            json!({"job": "12", "node": "gpu a1"}),
            "node: \"gpu a1\" is not a node name",
        ),
        (
            json!({"job": "12", "node": "gpu-a1", "submission": "XYZ"}),
            "submission: not a token",
        ),
        (json!({"job": 12, "node": "gpu-a1"}), "expected {\"job\""),
        (
            json!({"job": "12", "node": "gpu-a1", "extra": 1}),
            "expected {\"job\"",
        ),
    ] {
        let (status, out) = prolog(&s, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {out}");
        assert!(
            out["error"].as_str().unwrap().starts_with(starts),
            "{body}: {out}"
        );
    }
}

/// Sends `body` to `/v1/verify` as root on the Unix socket, from process `pid`.
async fn verify_from(s: &AppState, pid: i32, body: &Value) -> (StatusCode, Value) {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri("/v1/verify")
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    req.extensions_mut().insert(Caller("uid:0".into()));
    req.extensions_mut().insert(PeerProcess { pid });
    let response = app(s.clone()).oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// A sealed checkpoint under a data root, with the state that verifies it.
struct Sealed {
    _tmp: tempfile::TempDir,
    state: AppState,
    store: Arc<StateStore>,
    file: std::path::PathBuf,
}

fn sealed() -> Sealed {
    use probity::integrity::{self, Anchor, HashOptions, SoftwareAnchor};
    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("state");
    let store = Arc::new(StateStore::open(&state_dir).unwrap());
    let anchor = SoftwareAnchor::load_or_generate(&tmp.path().join("anchor.key")).unwrap();
    std::fs::write(state_dir.join("trusted.pub"), anchor.public_key().to_hex()).unwrap();
    let file = tmp.path().join("epoch-4.ckpt");
    std::fs::write(&file, vec![7u8; 10_000]).unwrap();
    let options = HashOptions {
        chunk_size: 4096,
        ..HashOptions::default()
    };
    let signed =
        integrity::SignedManifest::seal(&file, "llm/epoch-4", 1, &anchor, store.as_ref(), &options)
            .unwrap();
    std::fs::write(tmp.path().join("epoch-4.ckpt.manifest"), signed.encode()).unwrap();
    let mut config = Config::default();
    config.integrity.state_dir = Some(state_dir);
    config.integrity.data_roots = vec![tmp.path().to_owned()];
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    Sealed {
        state: AppState::new(engine, config),
        store,
        file,
        _tmp: tmp,
    }
}

#[tokio::test]
async fn a_local_reader_may_name_only_the_slurm_job_it_runs_in() {
    let t = sealed();
    let s = &t.state;
    // A process outside any Slurm job (this test's own child).
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    let body = |reader: Value| json!({"path": t.file, "id": "llm/epoch-4", "node": "gpu-a1", "reader": reader});
    let (status, out) = verify_from(
        s,
        pid,
        &body(json!({"namespace": "slurm", "name": "job-12"})),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{out}");
    assert_eq!(
        out["error"],
        "reader slurm/job-12: reader.name: the calling process runs in no Slurm job, so it cannot read as job 12"
    );
    // A Slurm reader is job-<id>, without a uid, whoever asks.
    for (reader, starts) in [
        (
            json!({"namespace": "slurm", "name": "job-x"}),
            "reader.name: \"job-x\" is not job-<id>",
        ),
        (
            json!({"namespace": "slurm", "name": "job-12", "uid": "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b"}),
            "reader.uid: a Slurm job reader",
        ),
    ] {
        let (status, out) = verify_from(s, pid, &body(reader)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
        assert!(out["error"].as_str().unwrap().starts_with(starts), "{out}");
    }
    // The pod claim is unchanged: this process is in no pod either.
    let (status, out) = verify_from(
        s,
        pid,
        &body(json!({"namespace": "train", "name": "llm-0"})),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("in no pod's cgroup"),
        "{out}"
    );
    // No reader named and no job found: read as before, without a reader.
    let plain = json!({"path": t.file, "id": "llm/epoch-4", "node": "gpu-a1"});
    let (status, out) = verify_from(s, pid, &plain).await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["verified"], true, "{out}");
    assert!(t.store.blocked("gpu-a1").unwrap().is_none());
}

/// A process tree as Slurm makes it: a root process whose executable is named
/// `slurmstepd` and whose title is `slurmstepd: [12.batch]`, with the job's process
/// under it. Needs root (the slurmstepd must run as uid 0); skipped otherwise.
#[tokio::test]
async fn a_reader_under_a_slurmstepd_reads_as_its_job_and_a_failed_read_names_it() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    if std::fs::metadata("/proc/self").unwrap().uid() != 0 {
        eprintln!("skipped: a slurmstepd runs as root, and this test does not");
        return;
    }
    let t = sealed();
    let bin = t._tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let stepd = bin.join("slurmstepd");
    // bash under another name, titled as a batch step: it starts the job's process and
    // says its pid.
    std::fs::copy("/bin/bash", &stepd).unwrap();
    let mut step = std::process::Command::new(&stepd)
        .arg0("slurmstepd: [12.batch]")
        .args(["-c", "sleep 60 & echo $!; wait"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(step.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let task: i32 = line.trim().parse().unwrap();
    let body = |reader: Option<Value>| {
        let mut b = json!({"path": t.file, "id": "llm/epoch-4", "node": "gpu-a1"});
        if let Some(r) = reader {
            b["reader"] = r;
        }
        b
    };
    let (status, out) = verify_from(
        &t.state,
        task,
        &body(Some(json!({"namespace": "slurm", "name": "job-13"}))),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{out}");
    assert_eq!(
        out["error"],
        "reader slurm/job-13: reader.name: the calling process runs in Slurm job 12, not the claimed job 13"
    );
    let (status, out) = verify_from(
        &t.state,
        task,
        &body(Some(json!({"namespace": "slurm", "name": "job-12"}))),
    )
    .await;
    assert_eq!(
        (status, out["verified"].clone()),
        (StatusCode::OK, json!(true)),
        "{out}"
    );
    // A flipped byte, read by a process that names no reader: the block names its job.
    let mut data = std::fs::read(&t.file).unwrap();
    data[5000] ^= 1;
    std::fs::write(&t.file, &data).unwrap();
    let (status, out) = verify_from(&t.state, task, &body(None)).await;
    let _ = std::process::Command::new("kill")
        .arg(task.to_string())
        .status();
    step.kill().unwrap();
    step.wait().unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["verified"], false, "{out}");
    let record = t.store.blocked("gpu-a1").unwrap().unwrap().record;
    assert_eq!(
        record.reader,
        Some(probity::ReaderPod::new("slurm", "job-12", None).unwrap())
    );
}
