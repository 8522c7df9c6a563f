//! The `probity` binary end to end: exit codes, output, diagnostics.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod agent;
mod audit;
mod forward;
mod image;
mod impact;
mod install;
mod keys;
mod operator;
#[path = "../../../testsupport/services.rs"]
mod services;
mod tour;
#[path = "../../../testsupport/unix_http.rs"]
mod unix_http;

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

/// The shared cluster fixture.
fn cluster_json() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(root().join("testdata/entities/cluster.json")).unwrap())
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

/// A copy of the policies whose probity.toml has `modes` as its `[modes]` table.
fn policies_with_modes(modes: &str) -> tempfile::TempDir {
    let dir = copy_policies();
    let config = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}\n[modes]\n{modes}")).unwrap();
    dir
}

#[test]
fn check_passes_on_the_shipped_policies() {
    // Every shipped policy carries an @id, so counting them counts the policies.
    let (mut files, mut policies) = (0, 0);
    let mut dirs = vec![root().join("policies")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "cedar") {
                files += 1;
                policies += std::fs::read_to_string(&path)
                    .unwrap()
                    .matches("@id(")
                    .count();
            }
        }
    }
    let out = probity(&["check", "policies"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let expected = format!("ok: {policies} policies in {files} files");
    assert!(
        text(&out.stdout).starts_with(&expected),
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
    for sub in ["api", "security", "placement", "thermal", "integrity"] {
        std::fs::remove_dir_all(dir.path().join(sub)).unwrap();
    }
    let out = probity(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    // The default schema declares the block policy, which an empty set lacks.
    assert!(
        text(&out.stderr).contains("security.blocked-node"),
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
fn serve_help_documents_its_flags() {
    let out = probity(&["serve", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    for flag in [
        "--config",
        "--policies",
        "--entities",
        "--socket",
        "--no-socket",
        "--listen",
        "--insecure",
        "--tls-cert",
        "--tls-key",
        "--client-ca",
        "--log-format",
    ] {
        assert!(
            help.contains(flag),
            "serve --help does not mention {flag}:\n{help}"
        );
    }
}

#[test]
fn serve_with_a_bad_config_file_exits_9_naming_the_file_and_the_option() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("probity-server.toml");
    std::fs::write(&config, "[server]\nsockett = \"/tmp/x.sock\"\n").unwrap();
    let out = probity(&["serve", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(9));
    let err = text(&out.stderr);
    assert!(
        err.contains("probity-server.toml") && err.contains("sockett"),
        "{err}"
    );
}

#[test]
fn serve_refuses_plain_http_off_loopback() {
    let out = probity(&[
        "serve",
        "--no-socket",
        "--listen",
        "0.0.0.0:0",
        "--insecure",
    ]);
    assert_eq!(out.status.code(), Some(9));
    assert!(
        text(&out.stderr).contains("only on loopback"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn serve_listens_on_its_socket_and_stops_cleanly_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("run/probity.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_probity"))
        .args([
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--log-format",
            "json",
        ])
        .current_dir(root())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !socket.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(socket.exists(), "the server never created its socket");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(!socket.exists(), "the socket outlived the server");
    let logs = text(&out.stderr);
    assert!(
        logs.lines()
            .any(|l| l.starts_with('{') && l.contains("\"shutting down")),
        "{logs}"
    );
}

fn probity_env(args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_probity"));
    cmd.args(args).current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The issue: `probity verify --reader-pod` names the pod that reads, and the block
/// of its failed read records it with what must stop; a malformed pod is refused
/// naming the field, before anything is read.
#[test]
fn verify_with_a_reader_pod_records_it_in_the_block() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("PROBITY_STATE_DIR", state.as_os_str())];
    let file = tmp.path().join("epoch-5.ckpt");
    std::fs::write(&file, vec![3u8; 70_000]).unwrap();
    let f = file.to_str().unwrap();
    let out = probity_env(&["seal", f, "--id", "llm/epoch-5"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    std::fs::write(&file, vec![4u8; 70_000]).unwrap();
    let verify = |pod: &str| {
        probity_env(
            &[
                "verify",
                f,
                "--id",
                "llm/epoch-5",
                "--node",
                "gpu-a1",
                "--reader-pod",
                pod,
                "--entities",
                "testdata/entities/cluster.json",
                "--policies",
                "policies",
            ],
            &env,
        )
    };
    let out = verify("train/LLM-0");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("reader.name: "),
        "{}",
        text(&out.stderr)
    );
    let uid = "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b";
    let out = verify(&format!("train/llm-0/{uid}"));
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    let out = probity_env(&["nodes", "list"], &env);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["node"], "gpu-a1");
    assert_eq!(
        list[0]["reader"],
        serde_json::json!({"namespace": "train", "name": "llm-0", "uid": uid}),
        "{list}"
    );
    assert_eq!(list[0]["stop"], "reader", "{list}");
    // Without --node the flag means nothing, and is refused.
    let out = probity_env(
        &[
            "verify",
            f,
            "--id",
            "llm/epoch-5",
            "--reader-pod",
            "train/llm-0",
        ],
        &env,
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

#[test]
fn seal_verify_and_a_flipped_byte_blocks_the_reading_node() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("PROBITY_STATE_DIR", state.as_os_str())];
    let file = tmp.path().join("epoch-3.ckpt");
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&file, &data).unwrap();
    let f = file.to_str().unwrap();

    let out = probity_env(
        &["seal", f, "--id", "llm/epoch-3", "--chunk-size", "65536"],
        &env,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["version"], 1);
    assert_eq!(sealed["chunks"], 5);
    assert_eq!(sealed["hsm"], false);
    assert!(text(&out.stderr).contains("not an HSM"));

    let out = probity_env(&["verify", f, "--id", "llm/epoch-3"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    // The manifest of another object does not pass for this one.
    let out = probity_env(&["verify", f, "--id", "llm/epoch-4"], &env);
    assert_eq!(out.status.code(), Some(5));

    let mut bad = data.clone();
    bad[3 * 65536 + 10] ^= 1;
    std::fs::write(&file, &bad).unwrap();
    let out = probity_env(
        &[
            "verify",
            f,
            "--id",
            "llm/epoch-3",
            "--node",
            "gpu-a1",
            "--entities",
            "testdata/entities/cluster.json",
            "--policies",
            "policies",
        ],
        &env,
    );
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["decision"], "deny");
    assert_eq!(d["reasons"][0]["policy"], "integrity.unverified-read");
    assert_eq!(d["obligations"][0]["kind"], "block_node");
    assert_eq!(d["obligations"][0]["target"], "Node::\"gpu-a1\"");

    let out = probity_env(&["nodes", "list"], &env);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["node"], "gpu-a1");
    assert!(
        list[0]["reason"]
            .as_str()
            .unwrap()
            .contains("chunk 3 at byte offset 196608"),
        "{list}"
    );

    // The block applies to placement decisions that read the same state directory.
    let req = tmp.path().join("schedule.json");
    std::fs::write(&req, r#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}"#).unwrap();
    let schedule = [
        "eval",
        "--request",
        req.to_str().unwrap(),
        "--entities",
        "testdata/entities/cluster.json",
    ];
    let out = probity_env(&schedule, &env);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("security.blocked-node"));

    let out = probity_env(&["nodes", "unblock", "gpu-a1"], &env);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout).trim(), "[]");
    assert_eq!(probity_env(&schedule, &env).status.code(), Some(0));

    // Both denies were recorded in the decision log; the allow after unblocking was not.
    let out = probity_env(&["audit"], &env);
    assert_eq!(out.status.code(), Some(0));
    let records: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 2, "{}", text(&out.stdout));
    assert_eq!(records[0]["seq"], 0);
    assert_eq!(records[0]["action"], "Action::\"read\"");
    assert_eq!(
        records[0]["decision"]["obligations"][0]["kind"],
        "block_node"
    );
    assert_eq!(records[1]["action"], "Action::\"schedule\"");
    assert_eq!(
        records[1]["decision"]["reasons"][0]["policy"],
        "security.blocked-node"
    );
    let out = probity_env(&["audit", "--from", "1"], &env);
    assert_eq!(text(&out.stdout).lines().count(), 1);
}

#[test]
fn a_corrupt_manifest_fails_verification_and_a_missing_one_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("PROBITY_STATE_DIR", state.as_os_str())];
    let file = tmp.path().join("obj");
    std::fs::write(&file, b"weights").unwrap();
    let f = file.to_str().unwrap();
    assert_eq!(
        probity_env(&["seal", f, "--id", "o"], &env).status.code(),
        Some(0)
    );
    let manifest = tmp.path().join("obj.manifest");
    let mut bytes = std::fs::read(&manifest).unwrap();
    bytes.truncate(bytes.len() - 3);
    std::fs::write(&manifest, &bytes).unwrap();
    let out = probity_env(&["verify", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(5));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verified"], false);
    std::fs::remove_file(&manifest).unwrap();
    let out = probity_env(&["verify", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("obj.manifest"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn seal_and_verify_against_a_softhsm2_token_with_the_pin_from_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("sh")
        .arg(root().join("scripts/softhsm-token.sh"))
        .arg(tmp.path().join("hsm"))
        .arg("probity-cli-test")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let vars: Vec<(String, String)> = text(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches('\'').to_owned()))
        .collect();
    assert_eq!(vars.len(), 4, "{vars:?}");
    let state = tmp.path().join("state");
    let mut env: Vec<(&str, &std::ffi::OsStr)> = vars
        .iter()
        .map(|(k, v)| (k.as_str(), std::ffi::OsStr::new(v.as_str())))
        .collect();
    env.push(("PROBITY_STATE_DIR", state.as_os_str()));
    let file = tmp.path().join("obj");
    std::fs::write(&file, vec![7u8; 100_000]).unwrap();
    let f = file.to_str().unwrap();
    let out = probity_env(&["seal", f, "--id", "hsm/obj"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["hsm"], true);
    assert!(
        sealed["anchor"]
            .as_str()
            .unwrap()
            .contains("probity-cli-test")
    );
    let out = probity_env(&["verify", f, "--id", "hsm/obj"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // A wrong PIN is a clear error, and nothing is sealed.
    let bad_pin = tmp.path().join("bad.pin");
    std::fs::write(&bad_pin, "000000\n").unwrap();
    let mut env_bad = env.clone();
    env_bad.retain(|(k, _)| *k != "PROBITY_HSM_PIN_FILE");
    env_bad.push(("PROBITY_HSM_PIN_FILE", bad_pin.as_os_str()));
    let out = probity_env(&["seal", f, "--id", "hsm/obj2"], &env_bad);
    assert_eq!(out.status.code(), Some(8));
    let err = text(&out.stderr);
    assert!(err.to_lowercase().contains("pin"), "{err}");
    assert!(!err.contains("000000"), "the PIN leaked: {err}");
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
        "--as-reporter",
        "--request",
        request.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let decision: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(decision["decision"], "deny");
    assert_eq!(decision["reasons"][0]["policy"], "plugin:power-spike/spike");
    assert_eq!(decision["obligations"][0]["kind"], "alert");
}

/// Issue: `probity eval` merged the request file's own `entities` over the loaded
/// ones, and took the caller's `now`: both are refused now (a `Key` comes from the
/// keyring only), and `--now` sets the engine's clock instead.
#[test]
fn eval_refuses_request_entities_that_override_stored_facts_and_takes_the_clock_from_now() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let state = state.to_str().unwrap();
    let out = probity(&[
        "keys",
        "create",
        "key-fresh",
        "--state-dir",
        state,
        "--now",
        "1764460800",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let request = dir.path().join("r.json");
    std::fs::write(
        &request,
        r#"{"principal": "Workload::\"train-1\"", "action": "encrypt", "resource": "Key::\"key-fresh\"",
            "entities": [{"uid": {"type": "Key", "id": "key-fresh"}, "attrs": {"createdAt": 1790000000, "state": "active"}, "parents": []}]}"#,
    )
    .unwrap();
    let args = |extra: &[&str]| {
        let mut a = vec![
            "eval",
            "--policies",
            "policies",
            "--entities",
            "testdata/entities/cluster.json",
            "--state-dir",
            state,
        ];
        a.extend_from_slice(extra);
        a.push("--request");
        a.push(request.to_str().unwrap());
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let out = probity(&args(&[]).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout)
            .contains("Key entities come from the engine (keyring), never from a request"),
        "{}",
        text(&out.stdout)
    );
    std::fs::write(
        &request,
        r#"{"principal": "Workload::\"train-1\"", "action": "encrypt", "resource": "Key::\"key-fresh\""}"#,
    )
    .unwrap();
    let out = probity(
        &args(&["--now", "1767139200"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    let out = probity(
        &args(&["--now", "1772400000"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains("security.key-too-old"),
        "{}",
        text(&out.stdout)
    );
}

// ------------------------------------------------------------------ hardening

/// A throwaway SoftHSM2 token (scripts/softhsm-token.sh): its environment.
fn softhsm_env(dir: &Path, label: &str) -> Vec<(String, String)> {
    let out = Command::new("sh")
        .arg(root().join("scripts/softhsm-token.sh"))
        .arg(dir)
        .arg(label)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let vars: Vec<(String, String)> = text(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches('\'').to_owned()))
        .collect();
    assert_eq!(vars.len(), 4, "{vars:?}");
    vars
}

fn env_of(vars: &[(String, String)]) -> Vec<(&str, &std::ffi::OsStr)> {
    vars.iter()
        .map(|(k, v)| (k.as_str(), std::ffi::OsStr::new(v.as_str())))
        .collect()
}

/// miette's rendering with its line wrapping and gutters undone, for `contains`.
fn unwrapped(rendered: &str) -> String {
    rendered
        .replace(['│', '×'], " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).unwrap().mode() & 0o7777
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `seal --version 18446744073709551615` panicked in a debug build and burnt the id in a
/// release one.
#[test]
fn bug_seal_refuses_the_last_version_and_the_id_stays_usable() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("PROBITY_STATE_DIR", state.as_os_str())];
    let file = tmp.path().join("obj");
    std::fs::write(&file, b"weights").unwrap();
    let f = file.to_str().unwrap();
    let out = probity_env(
        &["seal", f, "--id", "o", "--version", "18446744073709551615"],
        &env,
    );
    assert_eq!(out.status.code(), Some(8), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("last version"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let out = probity_env(&["seal", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["version"], 1);
    // One below the last is allowed; then the next default has nowhere to go.
    let out = probity_env(
        &["seal", f, "--id", "o", "--version", "18446744073709551614"],
        &env,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = probity_env(&["seal", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("last version the registry can hold"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bug_public_key_help_says_it_takes_a_file() {
    let out = probity(&["verify", "--help"]);
    let help = text(&out.stdout);
    assert!(
        help.contains("The file holding the pinned public key"),
        "{help}"
    );
    assert!(!help.contains("(hex, SEC1)"), "{help}");
}

/// `probity audit | head -3` panicked on EPIPE. The reader here takes one line and
/// closes the pipe while the writer still has far more than a pipe buffer to write.
#[test]
fn bug_a_closed_pipe_ends_audit_quietly_with_status_0() {
    use std::io::BufRead as _;
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    {
        let store = probity::state::StateStore::open(&state).unwrap();
        let mut records: Vec<probity::state::DecisionRecord> = (0..3000)
            .map(|i| probity::state::DecisionRecord {
                seq: 0,
                time_unix_ms: 1_700_000_000_000 + i,
                principal: format!("Workload::\"train-{i}\""),
                action: "Action::\"schedule\"".into(),
                resource: "Node::\"gpu-blocked\"".into(),
                caller: None,
                request: None,
                sampled: false,
                policy_digest: "0".repeat(64),
                decision: probity::Decision::error("a blocked node takes part in this request"),
            })
            .collect();
        probity::state::LocalLog::record_decisions(&store, &mut records).unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_probity"))
        .args(["audit", "--limit", "3000"])
        .env("PROBITY_STATE_DIR", &state)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut reader = std::io::BufReader::new(stdout);
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert!(first.contains("\"seq\":0"), "{first}");
    drop(reader);
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!err.contains("error"), "{err}");
}

/// Issue: under `umask 000` the state directory was 0777 and `trusted.pub` and
/// `state.redb` 0666.
#[test]
fn bug_seal_under_umask_000_creates_private_state() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let file = tmp.path().join("obj");
    std::fs::write(&file, b"weights").unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg("umask 000; exec \"$0\" seal \"$1\" --id o")
        .arg(env!("CARGO_BIN_EXE_probity"))
        .arg(&file)
        .env("PROBITY_STATE_DIR", &state)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("state.redb")), 0o600);
    assert_eq!(mode(&state.join("anchor.key")), 0o600);
    assert_eq!(mode(&state.join("trusted.pub")), 0o644);
}

/// Issue: another user replaced `trusted.pub`, and root then verified a forged object.
#[test]
fn bug_verify_refuses_a_pinned_key_others_can_write_or_own() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("PROBITY_STATE_DIR", state.as_os_str())];
    let file = tmp.path().join("obj");
    std::fs::write(&file, b"weights").unwrap();
    let f = file.to_str().unwrap();
    assert_eq!(
        probity_env(&["seal", f, "--id", "o"], &env).status.code(),
        Some(0)
    );
    let key = state.join("trusted.pub");
    set_mode(&key, 0o666);
    let out = probity_env(&["verify", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(8));
    let err = text(&out.stderr);
    assert!(
        err.contains("refusing to trust public key") && err.contains("0666"),
        "{err}"
    );
    set_mode(&key, 0o644);
    std::os::unix::fs::chown(&key, Some(65534), None).unwrap();
    let out = probity_env(&["verify", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("uid 65534"),
        "{}",
        text(&out.stderr)
    );
    std::os::unix::fs::chown(&key, Some(0), None).unwrap();
    assert_eq!(
        probity_env(&["verify", f, "--id", "o"], &env).status.code(),
        Some(0)
    );
}

#[test]
fn policy_seal_then_check_sealed_and_what_it_refuses() {
    let dir = copy_policies();
    let d = dir.path().to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("PROBITY_STATE_DIR", state.as_os_str())];
    let out = probity_env(&["policy", "seal", d, "--name", "prod"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["version"], 1);
    assert_eq!(sealed["hsm"], false);
    assert_eq!(sealed["hsm_key_protected"], false);
    assert!(
        sealed["files"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "security/blocklist.cedar")
    );
    assert_eq!(mode(&dir.path().join("policy.seal")), 0o644);
    // The next seal takes the next version.
    let out = probity_env(&["policy", "seal", d, "--name", "prod"], &env);
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["version"], 2);

    let key = state.join("trusted.pub");
    let k = key.to_str().unwrap();
    let out = probity(&["check", "--sealed", "--public-key", k, d]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("sealed: prod version 2"),
        "{}",
        text(&out.stdout)
    );
    // Unsealed check ignores the seal.
    assert_eq!(probity(&["check", d]).status.code(), Some(0));

    // --sealed needs the key.
    assert_eq!(probity(&["check", "--sealed", d]).status.code(), Some(2));

    // A file changed after sealing.
    let network = dir.path().join("security/network.cedar");
    let original = std::fs::read_to_string(&network).unwrap();
    std::fs::write(&network, format!("// edited\n{original}")).unwrap();
    let out = probity(&["check", "--sealed", "--public-key", k, d]);
    assert_eq!(out.status.code(), Some(3));
    let err = unwrapped(&text(&out.stderr));
    assert!(
        err.contains("security/network.cedar was changed after sealing"),
        "{err}"
    );
    std::fs::write(&network, &original).unwrap();
    // An added file.
    std::fs::write(dir.path().join("placement/more.cedar"), "").unwrap();
    let out = probity(&["check", "--sealed", "--public-key", k, d]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        unwrapped(&text(&out.stderr))
            .contains("placement/more.cedar is part of the policy set but not sealed"),
        "{}",
        text(&out.stderr)
    );
    std::fs::remove_file(dir.path().join("placement/more.cedar")).unwrap();
    // Another key.
    let other_state = tmp.path().join("other");
    let other_env = [("PROBITY_STATE_DIR", other_state.as_os_str())];
    let other = copy_policies();
    let o = other.path().to_str().unwrap();
    assert_eq!(
        probity_env(&["policy", "seal", o, "--name", "prod"], &other_env)
            .status
            .code(),
        Some(0)
    );
    let out = probity(&["check", "--sealed", "--public-key", k, o]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        unwrapped(&text(&out.stderr)).contains("not the pinned key"),
        "{}",
        text(&out.stderr)
    );
    // The last version is refused.
    let out = probity_env(
        &[
            "policy",
            "seal",
            d,
            "--name",
            "prod",
            "--version",
            "18446744073709551615",
        ],
        &env,
    );
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("last version"),
        "{}",
        text(&out.stderr)
    );
    // A broken set is not sealed.
    std::fs::write(&network, "permit (principal, action, resource) when { };\n").unwrap();
    let out = probity_env(&["policy", "seal", d, "--name", "prod"], &env);
    assert_eq!(out.status.code(), Some(3));
}

/// Issue: after the state directory was deleted, `verify` silently created an empty
/// registry and accepted version 1 again. With an HSM the token's digests rebuild it;
/// without, the CLI says loudly that rollback protection restarts from zero.
#[test]
fn bug_a_deleted_state_dir_does_not_reopen_the_rollback_with_an_hsm_and_says_so_without() {
    for with_hsm in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let vars = if with_hsm {
            softhsm_env(&tmp.path().join("hsm"), "probity-cli-rollback")
        } else {
            Vec::new()
        };
        let state = tmp.path().join("state");
        let mut env = env_of(&vars);
        env.push(("PROBITY_STATE_DIR", state.as_os_str()));
        let file = tmp.path().join("ckpt");
        let f = file.to_str().unwrap();
        std::fs::write(&file, b"version one").unwrap();
        let out = probity_env(&["seal", f, "--id", "ckpt"], &env);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let v1_manifest = tmp.path().join("ckpt.v1.manifest");
        std::fs::copy(tmp.path().join("ckpt.manifest"), &v1_manifest).unwrap();
        std::fs::write(&file, b"version two").unwrap();
        let out = probity_env(&["seal", f, "--id", "ckpt"], &env);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let key = tmp.path().join("pinned.pub");
        std::fs::copy(state.join("trusted.pub"), &key).unwrap();

        std::fs::remove_dir_all(&state).unwrap();
        std::fs::write(&file, b"version one").unwrap();
        let out = probity_env(
            &[
                "verify",
                f,
                "--id",
                "ckpt",
                "--manifest",
                v1_manifest.to_str().unwrap(),
                "--public-key",
                key.to_str().unwrap(),
            ],
            &env,
        );
        let err = text(&out.stderr);
        if with_hsm {
            assert_eq!(out.status.code(), Some(5), "{err}");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert!(
                v["failure"]
                    .as_str()
                    .unwrap()
                    .contains("refusing rollback of \"ckpt\" to version 1"),
                "{v}"
            );
            assert!(err.contains("rebuilt"), "{err}");
            assert!(!err.contains("restarts from zero"), "{err}");
        } else {
            assert_eq!(out.status.code(), Some(0), "{err}");
            assert!(
                err.lines()
                    .any(|l| l.starts_with("error: rollback protection restarts from zero")),
                "{err}"
            );
        }
    }
}

/// Issue: an imported, extractable key pair under Probity's label was used and `seal`
/// printed `"hsm": true`.
#[test]
fn bug_seal_refuses_an_extractable_key_under_our_label_unless_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let vars = softhsm_env(&tmp.path().join("hsm"), "probity-cli-unprotected");
    let get = |k: &str| vars.iter().find(|(n, _)| n == k).unwrap().1.clone();
    let pin = std::fs::read_to_string(get("PROBITY_HSM_PIN_FILE")).unwrap();
    let keygen = Command::new("pkcs11-tool")
        .args(["--module", &get("PROBITY_HSM_MODULE")])
        .args(["--token-label", &get("PROBITY_HSM_TOKEN")])
        .args(["--login", "--pin", pin.trim()])
        .args(["--keypairgen", "--key-type", "EC:prime256v1"])
        .args([
            "--label",
            "probity-manifest-signing",
            "--usage-sign",
            "--extractable",
        ])
        .env("SOFTHSM2_CONF", get("SOFTHSM2_CONF"))
        .output()
        .unwrap();
    assert!(keygen.status.success(), "{}", text(&keygen.stderr));
    let state = tmp.path().join("state");
    let mut env = env_of(&vars);
    env.push(("PROBITY_STATE_DIR", state.as_os_str()));
    let file = tmp.path().join("obj");
    std::fs::write(&file, b"weights").unwrap();
    let f = file.to_str().unwrap();
    let out = probity_env(&["seal", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(8));
    let err = text(&out.stderr);
    assert!(err.contains("CKA_EXTRACTABLE is true"), "{err}");
    assert!(!tmp.path().join("obj.manifest").exists());

    let allow = std::ffi::OsString::from("1");
    env.push(("PROBITY_HSM_ALLOW_UNPROTECTED_KEY", allow.as_os_str()));
    let out = probity_env(&["seal", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["hsm"], false);
    assert_eq!(sealed["hsm_key_protected"], false);
    assert!(
        sealed["anchor"]
            .as_str()
            .unwrap()
            .contains("NOT HSM-protected"),
        "{sealed}"
    );
    assert!(text(&out.stderr).contains("NOT HSM-protected"));
}

#[test]
fn a_pin_file_others_can_read_is_refused_unless_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let vars = softhsm_env(&tmp.path().join("hsm"), "probity-cli-pin");
    let pin_file = PathBuf::from(
        &vars
            .iter()
            .find(|(k, _)| k == "PROBITY_HSM_PIN_FILE")
            .unwrap()
            .1,
    );
    set_mode(&pin_file, 0o644);
    let state = tmp.path().join("state");
    let mut env = env_of(&vars);
    env.push(("PROBITY_STATE_DIR", state.as_os_str()));
    let file = tmp.path().join("obj");
    std::fs::write(&file, b"weights").unwrap();
    let f = file.to_str().unwrap();
    let out = probity_env(&["seal", f, "--id", "o"], &env);
    assert_eq!(out.status.code(), Some(8));
    let err = text(&out.stderr);
    assert!(err.contains("lets group and others read it"), "{err}");
    let out = probity_env(&["seal", f, "--id", "o", "--allow-readable-pin-file"], &env);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("warning: PIN file")
            && text(&out.stderr).contains("lets group and others read it"),
        "{}",
        text(&out.stderr)
    );
    let sealed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sealed["hsm"], true);
    assert_eq!(sealed["hsm_key_protected"], true);
}

/// The threshold overlay (testdata/threshold-overlay/README.md) applied to a copy of
/// the default policies: a new setting, zone fact and rule, and no Rust change.
#[test]
fn a_threshold_added_by_schema_toml_and_policy_is_honoured_by_eval_and_check() {
    let tmp = copy_policies();
    let overlay = root().join("testdata/threshold-overlay");
    let read = |f: &str| std::fs::read_to_string(overlay.join(f)).unwrap();
    let insert_after = |file: &Path, line: &str, add: &str| {
        let old = std::fs::read_to_string(file).unwrap();
        let at = old.find(line).unwrap() + line.len();
        std::fs::write(file, format!("{}\n{add}{}", &old[..at], &old[at..])).unwrap();
    };
    let schema = tmp.path().join("probity.cedarschema");
    insert_after(
        &schema,
        "entity Settings = {",
        &read("settings.cedarschema"),
    );
    insert_after(
        &schema,
        "entity Zone in [Cluster] = {",
        &read("zone.cedarschema"),
    );
    insert_after(
        &tmp.path().join("probity.toml"),
        "[placement]",
        &read("probity.toml"),
    );
    std::fs::write(
        tmp.path().join("placement/zone-max-gpus.cedar"),
        read("zone-max-gpus.cedar"),
    )
    .unwrap();
    let dir = tmp.path().to_str().unwrap();
    let out = probity(&["check", dir]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    // zone-a's jobs hold 61 GPUs: train-1 (4 GPUs) would take it past 64.
    let mut cluster: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root().join("testdata/entities/cluster.json")).unwrap(),
    )
    .unwrap();
    for e in cluster.as_array_mut().unwrap() {
        if e["uid"]["id"] == "zone-a" {
            e["attrs"]["gpusAllocated"] = serde_json::json!(61);
        }
    }
    let work = tempfile::tempdir().unwrap();
    let entities = work.path().join("cluster.json");
    std::fs::write(&entities, cluster.to_string()).unwrap();
    let req = work.path().join("req.json");
    std::fs::write(&req, r#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}"#).unwrap();
    let eval = |policies: Option<&str>| {
        let mut args = vec![
            "eval",
            "--request",
            req.to_str().unwrap(),
            "--entities",
            entities.to_str().unwrap(),
        ];
        if let Some(p) = policies {
            args.extend(["--policies", p]);
        }
        probity(&args)
    };
    let out = eval(Some(dir));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["reasons"][0]["policy"], "placement.zone-max-gpus", "{d}");

    // A value out of the declared range is refused where it stands.
    let toml = tmp.path().join("probity.toml");
    let t = std::fs::read_to_string(&toml).unwrap();
    std::fs::write(&toml, t.replace("zone_max_gpus = 64", "zone_max_gpus = 0")).unwrap();
    let out = probity(&["check", dir]);
    assert_eq!(out.status.code(), Some(3));
    let err = text(&out.stderr);
    assert!(err.contains("probity.toml:16:17"), "{err}");
    assert!(err.contains("placement.zone_max_gpus must be"), "{err}");
    assert!(
        err.contains("found 0 (0 would stop all scheduling)"),
        "{err}"
    );
}

#[test]
fn eval_shows_an_audit_policys_finding_and_allows_and_check_lists_the_mode() {
    let dir = policies_with_modes("\"thermal.zone-power-ceiling\" = \"audit\"\n");
    let tmp = tempfile::tempdir().unwrap();
    let req = tmp.path().join("req.json");
    std::fs::write(&req, r#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-hot1\""}"#).unwrap();
    let out = probity(&[
        "eval",
        "--request",
        req.to_str().unwrap(),
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["decision"], "allow");
    assert_eq!(d["obligations"], serde_json::json!([]));
    assert_eq!(d["audit"][0]["policy"], "thermal.zone-power-ceiling");
    assert_eq!(d["audit"][0]["obligations"][0]["kind"], "migrate");
    assert_eq!(
        d["audit"][0]["obligations"][0]["target"],
        "Zone::\"zone-hot\""
    );

    let out = probity(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    assert!(
        listed.lines().any(
            |l| l.starts_with("mode thermal.zone-power-ceiling: audit (")
                && l.ends_with("probity.toml)")
        ),
        "{listed}"
    );
}

#[test]
fn report_prints_what_warn_and_audit_policies_find_in_the_facts_now() {
    let dir = policies_with_modes(
        "\"placement.driver-drift\" = \"audit\"\n\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n",
    );
    let out = probity(&[
        "report",
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    assert!(
        listed.contains("Node::\"gpu-drift\": placement.driver-drift (audit, high): the GPU node does not run the pinned driver and CUDA image"),
        "{listed}"
    );
    assert!(
        listed.contains("Workload::\"infer-greedy\" in namespace inference: placement.inference-gpu-cpu-ratio (warn, medium)"),
        "{listed}"
    );
    let out = probity(&[
        "report",
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["nodes"].as_array().unwrap().len(), 2, "{report:#}");
    assert_eq!(
        report["workloads"]["inference"][0]["policy"],
        "placement.inference-gpu-cpu-ratio"
    );
    // All enforcing: nothing to report.
    let out = probity(&[
        "report",
        "--entities",
        "testdata/entities/cluster.json",
        "--policies",
        "policies",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains(": 0 warn/audit findings"));
}
