//! `probity serve` with `[siem]`: the decision log reaches a real rsyslog on loopback
//! at least once, across a `kill -9` of the server.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::services::{Proc, Rsyslog, SyslogInput, eventually, free_port, http};

/// `probity serve --config <config>`, its standard error in `log` (appended).
fn start_server(config: &Path, log: &Path, port: u16) -> Proc {
    let mut p = Proc::spawn(
        "probity serve",
        Command::new(env!("CARGO_BIN_EXE_probity"))
            .args(["serve", "--config"])
            .arg(config),
        log,
    );
    eventually("probity serve to be ready", Duration::from_secs(60), || {
        p.assert_running();
        http(port, "GET", "/readyz", "").filter(|(status, _)| *status == 200)
    });
    p
}

/// A CA and a certificate for 127.0.0.1 and `localhost` it signed, made with
/// openssl in `dir`: (ca, cert, key).
fn loopback_certificate(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=probity test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "siem.key",
        "-out",
        "siem.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        dir.join("siem.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "siem.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "siem.pem",
        "-days",
        "2",
        "-extfile",
        "siem.ext",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("siem.pem"),
        dir.join("siem.key"),
    )
}

/// Asks for workload `i`'s placement: an unknown workload, so a recorded deny. True
/// when answered 200 with a deny (the answer comes after the record is durable).
fn decide(port: u16, i: usize) -> bool {
    let body = format!(
        r#"{{"principal": "Workload::\"w-{i}\"", "action": "schedule", "resource": "Node::\"gpu-x\""}}"#
    );
    match http(port, "POST", "/v1/decide", &body) {
        Some((200, b)) => {
            let v: serde_json::Value = serde_json::from_str(&b).unwrap();
            assert_eq!(v["decision"], "deny", "{b}");
            true
        }
        _ => false,
    }
}

fn config(dir: &Path, port: u16, siem_port: u16, transport: &str, extra: &str) -> PathBuf {
    let path = dir.join("probity-server.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nsocket = \"\"\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\n\
             [integrity]\nstate_dir = \"{}\"\n\
             [limits]\nrecorded_per_second = 100000\nrecorded_burst = 100000\n\
             [siem]\naddress = \"127.0.0.1:{siem_port}\"\ntransport = \"{transport}\"\n{extra}",
            dir.join("state").display()
        ),
    )
    .unwrap();
    path
}

/// Denies sent while the server is killed, then more after its restart: rsyslog ends
/// up with every acknowledged one, in seqs without a gap (duplicates allowed).
fn every_acknowledged_decision_reaches_the_siem_across_a_kill_9(transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let siem_port = free_port();
    let (ca, cert, key) = loopback_certificate(dir);
    let (input, extra) = match transport {
        "tls" => (
            SyslogInput::Tls {
                ca: &ca,
                cert: &cert,
                key: &key,
            },
            format!("ca_file = \"{}\"\n", ca.display()),
        ),
        "relp" => (SyslogInput::Relp, String::new()),
        _ => (SyslogInput::Tcp, String::new()),
    };
    let rsyslog = Rsyslog::start(dir, siem_port, input);
    let port = free_port();
    let cfg = config(dir, port, siem_port, transport, &extra);
    let log = dir.join("probity.stderr");

    // First run: a sender streams denies; the server is killed -9 under it.
    let mut server = start_server(&cfg, &log, port);
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut acked = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(60);
            for i in 0..2000 {
                if stop.load(Ordering::Relaxed) || Instant::now() > deadline || !decide(port, i) {
                    break;
                }
                acked.push(i);
            }
            acked
        })
    };
    // Kill once some are acknowledged and some of them forwarded (mid-stream).
    eventually(
        "some decisions forwarded before the kill",
        Duration::from_secs(60),
        || (rsyslog.received().0.len() >= 5).then_some(()),
    );
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    let mut acked = sender.join().unwrap();
    assert!(!acked.is_empty());
    drop(server);

    // Second run: it resumes from its cursor; a few more denies.
    let _server = start_server(&cfg, &log, port);
    let first = acked.len();
    for i in 10_000..10_010 {
        assert!(decide(port, i), "decision {i} after the restart");
        acked.push(i);
    }
    let total = acked.len() as u64;
    let (seqs, text) = eventually(
        "rsyslog to hold every acknowledged decision",
        Duration::from_secs(90),
        || {
            let (seqs, text) = rsyslog.received();
            let all = acked.iter().all(|i| text.contains(&format!("w-{i}\\\"")));
            (all && seqs.iter().max().is_some_and(|m| *m >= total)).then_some((seqs, text))
        },
    );
    // No gap: every seq from 1 to the highest is there (some may be twice).
    let highest = *seqs.iter().max().unwrap();
    let mut seen = vec![false; highest as usize + 1];
    for s in &seqs {
        seen[*s as usize] = true;
    }
    let missing: Vec<usize> = (1..=highest as usize).filter(|s| !seen[*s]).collect();
    assert!(
        missing.is_empty(),
        "seqs missing {missing:?} ({first} acknowledged before the kill):\n{text}"
    );
    eprintln!(
        "{transport}: {first} acknowledged before the kill, {total} in all; rsyslog holds {} messages up to seq {highest}",
        seqs.len()
    );
    // The metrics count what this run forwarded and what is left, per log.
    let metrics = eventually("the forwarder's counters", Duration::from_secs(30), || {
        http(port, "GET", "/metrics", "")
            .map(|(_, body)| body)
            .filter(|b| b.contains("probity_siem_backlog{log=\"decisions\"} 0"))
    });
    assert!(
        metrics.contains("probity_siem_forwarded_total{log=\"decisions\"}")
            && metrics.contains("probity_siem_backlog{log=\"events\"} 0"),
        "{metrics}"
    );
    // Each message carries its chain link for the SIEM to drop duplicates.
    let line = text.lines().next().unwrap();
    assert!(
        line.contains(" hash=\"") && line.contains(" prev=\"") && line.contains("principal="),
        "{line}"
    );
}

#[test]
fn every_acknowledged_decision_reaches_rsyslog_over_tcp_across_a_kill_9() {
    every_acknowledged_decision_reaches_the_siem_across_a_kill_9("tcp");
}

#[test]
fn every_acknowledged_decision_reaches_rsyslog_over_relp_across_a_kill_9() {
    every_acknowledged_decision_reaches_the_siem_across_a_kill_9("relp");
}

/// RFC 5425: rsyslog's gtls driver with a certificate for 127.0.0.1 from a test CA,
/// which `ca_file` pins.
#[test]
fn every_acknowledged_decision_reaches_rsyslog_over_tls_across_a_kill_9() {
    every_acknowledged_decision_reaches_the_siem_across_a_kill_9("tls");
}

/// `[audit] sign = "software"`: the server's checkpoints are signed by the state
/// directory's software anchor, every `checkpoint_records`, and `probity audit verify`
/// checks them against its public key.
#[test]
fn the_server_signs_audit_checkpoints_as_audit_configures() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let state = tmp.path().join("state");
    let path = tmp.path().join("probity-server.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nsocket = \"\"\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\n\
             [integrity]\nstate_dir = \"{}\"\n\
             [audit]\ncheckpoint_records = 2\nsign = \"software\"\n",
            state.display()
        ),
    )
    .unwrap();
    let log = tmp.path().join("server.log");
    let server = start_server(&path, &log, port);
    for i in 0..5 {
        assert!(decide(port, i), "deny {i} was not answered");
    }
    drop(server); // killed: the store is released, and nothing is lost (each deny was durable)
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("audit checkpoints are signed"), "{text}");

    let anchor =
        probity::integrity::SoftwareAnchor::load_or_generate(&state.join("anchor.key")).unwrap();
    let pinned = tmp.path().join("audit.pub");
    (probity::integrity::Anchor::public_key(&anchor))
        .pin(&pinned)
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_probity"))
        .args(["audit", "verify", "--state-dir"])
        .arg(&state)
        .arg("--public-key")
        .arg(&pinned)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let decisions = &report["report"]["logs"][0];
    assert_eq!(decisions["records"], 5, "{report}");
    assert_eq!(decisions["signed_checkpoints"], 2, "{report}");
    assert_eq!(decisions["unwitnessed"], 1, "{report}");
}

/// `[alerts]`: a recorded deny whose policy carries `alert` (driver drift) reaches a
/// real Alertmanager, named after the policy, on the node the policy targets.
#[test]
fn an_alert_obligation_of_a_server_decision_reaches_alertmanager() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut alertmanager = crate::services::Alertmanager::start(dir);
    let port = free_port();
    let path = dir.join("probity-server.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nsocket = \"\"\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\n\
             [policies]\nentities = \"{entities}\"\n\
             [integrity]\nstate_dir = \"{state}\"\n\
             [alerts]\nalertmanager_url = \"{am}\"\nhold_seconds = 600\n",
            entities = crate::root()
                .join("testdata/entities/cluster.json")
                .display(),
            state = dir.join("state").display(),
            am = alertmanager.url,
        ),
    )
    .unwrap();
    let mut server = start_server(&path, &dir.join("server.log"), port);
    let (status, body) = http(
        port,
        "POST",
        "/v1/decide",
        r#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-drift\""}"#,
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["decision"], "deny", "{body}");
    let alert = eventually("the alert at Alertmanager", Duration::from_secs(60), || {
        server.assert_running();
        alertmanager
            .alerts()
            .into_iter()
            .find(|a| a["labels"]["alertname"] == "placement.driver-drift")
    });
    assert_eq!(alert["labels"]["node"], "Node::\"gpu-drift\"", "{alert}");
    assert_eq!(alert["labels"]["severity"], "high", "{alert}");
    assert_eq!(
        alert["labels"]["principal"], "Workload::\"train-1\"",
        "{alert}"
    );
    assert_eq!(alert["status"]["state"], "active", "{alert}");
    let metrics = eventually("the alert counters", Duration::from_secs(30), || {
        http(port, "GET", "/metrics", "")
            .map(|(_, b)| b)
            .filter(|b| b.contains("probity_alerts_posted_total{sink=\"alertmanager\"} 1"))
    });
    assert!(
        metrics.contains("probity_alerts_fired_total 1"),
        "{metrics}"
    );
    // A restart resumes from the cursor: the same record does not fire again.
    drop(server);
    let _server = start_server(&path, &dir.join("server.log"), port);
    let metrics = eventually(
        "the restarted server's metrics",
        Duration::from_secs(30),
        || {
            http(port, "GET", "/metrics", "")
                .map(|(_, b)| b)
                .filter(|b| b.contains("probity_alerts_fired_total"))
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    let metrics_later = http(port, "GET", "/metrics", "").unwrap().1;
    assert!(
        metrics.contains("probity_alerts_fired_total 0"),
        "{metrics}"
    );
    assert!(
        metrics_later.contains("probity_alerts_fired_total 0"),
        "{metrics_later}"
    );
}
