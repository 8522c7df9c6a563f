//! The `probity` binary end to end: exit codes, output, diagnostics.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn probity(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_probity"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn copy_policies() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .arg(root().join("policies/."))
        .arg(tmp.path())
        .status()
        .unwrap();
    assert!(status.success());
    tmp
}

#[test]
fn check_passes_on_the_shipped_policies() {
    let out = probity(&["check", "policies"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("ok: 22 policies in 7 files"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn check_names_file_line_and_column_of_a_broken_file() {
    let dir = copy_policies();
    std::fs::write(
        dir.path().join("placement/broken.cedar"),
        "permit (principal, action, resource)\nwhen { principal.gpus >> 2 };\n",
    )
    .unwrap();
    let out = probity(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    let err = text(&out.stderr);
    assert!(err.contains("placement/broken.cedar:2:"), "{err}");
}

#[test]
fn check_refuses_an_empty_directory() {
    let dir = copy_policies();
    for sub in ["security", "placement", "thermal", "integrity"] {
        std::fs::remove_dir_all(dir.path().join(sub)).unwrap();
    }
    let out = probity(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("no policies"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn eval_exit_codes_say_allow_deny_and_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let req = tmp.path().join("req.json");
    let entities = "testdata/entities/cluster.json";

    std::fs::write(&req, r#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}"#).unwrap();
    let out = probity(&[
        "eval",
        "--request",
        req.to_str().unwrap(),
        "--entities",
        entities,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["decision"], "allow");

    std::fs::write(&req, r#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-hot1\""}"#).unwrap();
    let out = probity(&[
        "eval",
        "--request",
        req.to_str().unwrap(),
        "--entities",
        entities,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["reasons"][0]["policy"], "thermal.zone-power-ceiling");
    assert_eq!(d["obligations"][0]["kind"], "migrate");
    assert_eq!(d["obligations"][0]["target"], "Zone::\"zone-hot\"");

    std::fs::write(&req, "[]").unwrap();
    let out = probity(&["eval", "--request", req.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("expected a JSON object, found an array"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn eval_refuses_a_100_mb_request_without_reading_it() {
    let tmp = tempfile::tempdir().unwrap();
    let req = tmp.path().join("huge.json");
    std::fs::File::create(&req)
        .unwrap()
        .set_len(100 * 1024 * 1024)
        .unwrap();
    let out = probity(&["eval", "--request", req.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("104857600 bytes, over the limit"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn eval_reports_entities_that_do_not_fit_the_schema() {
    let tmp = tempfile::tempdir().unwrap();
    let ents = tmp.path().join("e.json");
    std::fs::write(
        &ents,
        r#"[{"uid": {"type": "Zone", "id": "z"}, "attrs": {}, "parents": []}]"#,
    )
    .unwrap();
    let out = probity(&[
        "eval",
        "--request",
        "-",
        "--entities",
        ents.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(8));
    let err = text(&out.stderr);
    assert!(
        err.contains("e.json") && err.contains("Zone::\"z\""),
        "{err}"
    );
}

#[test]
fn test_runs_every_scenario_and_summarises() {
    let out = probity(&["test"]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let last = stdout.lines().last().unwrap();
    assert!(last.ends_with(" passed, 0 failed"), "{last}");
    assert!(stdout.contains("ok      testdata/scenarios/integrity/unverified-read.json"));
}

#[test]
fn test_fails_with_its_own_exit_code_when_a_case_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("wrong.json");
    std::fs::write(
        &file,
        r#"{"cases": [{"name": "port 22 denied?", "request": {"principal": "Node::\"n\"",
        "action": "listen", "resource": "Node::\"n\"", "context": {"port": 22, "protocol": "tcp"}},
        "expect": {"decision": "deny"}}]}"#,
    )
    .unwrap();
    let out = probity(&["test", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(4));
    assert!(text(&out.stdout).ends_with("0 passed, 1 failed\n"));
}

#[test]
fn serve_is_not_built_yet_and_says_so() {
    let out = probity(&["serve"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("serve"), "{}", text(&out.stderr));
}

/// The example manifest's components, built by scripts/build-plugins.sh.
fn require_example_plugins() {
    for name in ["power-spike", "thermal-headroom"] {
        let path = root().join("target/plugins").join(format!("{name}.wasm"));
        assert!(
            path.is_file(),
            "{} is missing: run scripts/build-plugins.sh before cargo test",
            path.display()
        );
    }
}

#[test]
fn plugin_scenarios_pass_and_check_lists_the_plugins() {
    require_example_plugins();
    let manifest = "testdata/plugins/manifests/examples.toml";
    let out = probity(&[
        "test",
        "testdata/scenarios-plugins",
        "--policies",
        "policies",
        "--plugins",
        manifest,
    ]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout
            .lines()
            .last()
            .unwrap()
            .ends_with(" passed, 0 failed")
    );

    let out = probity(&["check", "policies", "--plugins", manifest]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        stdout.contains("plugin power-spike 0.1.0 for comply"),
        "{stdout}"
    );
    assert!(
        stdout.contains("plugin thermal-headroom 0.1.0 for schedule"),
        "{stdout}"
    );
}

#[test]
fn eval_combines_a_plugin_deny_with_cedar() {
    require_example_plugins();
    let tmp = tempfile::tempdir().unwrap();
    let request = tmp.path().join("request.json");
    std::fs::write(
        &request,
        r#"{"principal": "Node::\"gpu-a1\"", "action": "comply", "resource": "Node::\"gpu-a1\"",
            "context": {"powerReadingsW": [3000, 3000, 3100, 4200]}}"#,
    )
    .unwrap();
    let out = probity(&[
        "eval",
        "--policies",
        "policies",
        "--plugins",
        "testdata/plugins/manifests/examples.toml",
        "--entities",
        "testdata/entities/cluster.json",
        "--request",
        request.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let decision: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(decision["decision"], "deny");
    assert_eq!(decision["reasons"][0]["policy"], "plugin:power-spike/spike");
    assert_eq!(decision["obligations"][0]["kind"], "alert");
}
