//! Two `probity serve` processes (the `probity` binary this workspace builds, started and
//! stopped by PID) sharing one etcd: a block made through one's API is in force in the
//! other's; readiness reports how stale the shared state is and warns, without failing,
//! while etcd is down; every process's served digest is listed.
//!
//! The binary is looked for beside this test's own (`<target>/debug/probity`):
//! `cargo test --workspace` builds it; with `-p probity-etcd` alone, build it first
//! (`cargo build -p probity-cli`).

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};
use serde_json::Value;

use crate::backend::{runtime, wait_for};
use crate::harness::Etcd;

const WAIT: Duration = Duration::from_secs(30);

fn probity_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("probity"))
        .unwrap();
    assert!(
        bin.exists(),
        "{} is missing: build it first (cargo build -p probity-cli), as `cargo test --workspace` does",
        bin.display()
    );
    bin
}

/// A `probity serve` child, killed by PID when dropped.
struct Serve {
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Serve {
    fn start(endpoints: &[String], role: &str, node: &str, process: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("probity.sock");
        let config = dir.path().join("probity-server.toml");
        let endpoints = endpoints
            .iter()
            .map(|e| format!("{e:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        std::fs::write(
            &config,
            format!(
                r#"[server]
socket = {socket:?}
[integrity]
state_dir = {state:?}
[state]
backend = "etcd"
endpoints = [{endpoints}]
role = "{role}"
node = "{node}"
process = "{process}"
progress_interval_ms = 200
request_timeout_ms = 1000
retry_budget_ms = 2000
stale_after_ms = 2000
"#,
                state = dir.path().join("state"),
            ),
        )
        .unwrap();
        let log = dir.path().join("serve.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(probity_binary())
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let serve = Self {
            child: Some(child),
            socket,
            log,
            _dir: dir,
        };
        wait_for(WAIT, "probity serve answers", || {
            serve.try_request("GET", "/healthz", "").ok().map(|_| ())
        });
        serve
    }

    fn try_request(&self, method: &str, path: &str, body: &str) -> std::io::Result<(u16, Value)> {
        let mut stream = UnixStream::connect(&self.socket)?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: probity\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let value = if body.trim_start().starts_with(['{', '[']) {
            serde_json::from_str(body).unwrap_or(Value::Null)
        } else {
            Value::String(body.to_owned())
        };
        Ok((status, value))
    }

    fn request(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        self.try_request(method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log_tail()))
    }

    fn blocked(&self) -> Vec<String> {
        let (status, v) = self.request("GET", "/v1/nodes/blocked", "");
        assert_eq!(status, 200, "{v}");
        v["nodes"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(3000);
        text.get(start..).unwrap_or_default().to_owned()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill_process(Pid::from_child(&child), Signal::TERM);
            let end = Instant::now() + Duration::from_secs(10);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => return,
                    Ok(None) if Instant::now() < end => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return;
                    }
                }
            }
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[test]
fn blocks_made_through_one_servers_api_are_in_force_in_the_other() {
    let rt = runtime();
    let mut etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let endpoints = etcd.endpoints();
    let a = Serve::start(&endpoints, "sidecar", "gpu-001", "sidecar:gpu-001");
    let b = Serve::start(&endpoints, "webhook", "", "webhook:b");

    // Both processes report the digest they serve.
    let listed = wait_for(WAIT, "both processes are listed", || {
        let (status, v) = b.request("GET", "/v1/cluster/digests", "");
        (status == 200 && v["processes"].as_array()?.len() == 2).then_some(v)
    });
    assert_eq!(listed["lagging"], serde_json::json!([]), "{listed}");
    assert_eq!(listed["newest"], listed["digest"], "{listed}");

    // A block through A's API (root on its socket is an administrator): in force in B.
    let mut end_to_end = Vec::new();
    let mut answered = Vec::new();
    for i in 0..200 {
        let node = format!("node-{i:03}");
        let started = Instant::now();
        let (status, v) = a.request(
            "POST",
            &format!("/v1/nodes/{node}/block"),
            r#"{"reason": "propagation test"}"#,
        );
        assert_eq!(status, 200, "{v}");
        answered.push(started.elapsed());
        loop {
            let (_, v) = b.request("GET", "/v1/nodes/blocked", "");
            if v["nodes"].get(&node).is_some() {
                break;
            }
            assert!(started.elapsed() < WAIT, "{node} never reached b");
        }
        end_to_end.push(started.elapsed());
    }
    end_to_end.sort();
    answered.sort();
    eprintln!(
        "block via A's API until in force in B (process to process, 200 blocks): p50 {:.2} ms, p99 {:.2} ms; A's answer (read-your-writes) p50 {:.2} ms, p99 {:.2} ms",
        percentile(&end_to_end, 0.5).as_secs_f64() * 1e3,
        percentile(&end_to_end, 0.99).as_secs_f64() * 1e3,
        percentile(&answered, 0.5).as_secs_f64() * 1e3,
        percentile(&answered, 0.99).as_secs_f64() * 1e3,
    );
    // And back: an unblock through B reaches A.
    let (status, v) = b.request("POST", "/v1/nodes/node-000/unblock", "");
    assert_eq!(status, 200, "{v}");
    wait_for(WAIT, "the unblock reaches A", || {
        (!a.blocked().contains(&"node-000".to_owned())).then_some(())
    });
    assert_eq!(a.blocked(), b.blocked());

    // Readiness says how fresh the shared state is.
    let (status, ready) = b.request("GET", "/readyz", "");
    assert_eq!(status, 200);
    assert_eq!(ready["state"]["connected"], true, "{ready}");
    assert_eq!(ready["warnings"], serde_json::json!([]), "{ready}");

    // etcd stopped: readiness warns and stays ready; decisions still serve.
    etcd.stop(0, Signal::TERM);
    // The warning comes at once (disconnected); the age it reports keeps growing.
    let stale = wait_for(WAIT, "readiness warns that the state is stale", || {
        let (status, v) = b.request("GET", "/readyz", "");
        assert_eq!(status, 200, "{v}");
        let warned = v["warnings"].as_array()?.iter().any(|w| {
            w.as_str()
                .is_some_and(|w| w.contains("unreachable or stale"))
        });
        let aged = v["state"]["since_last_heard_seconds"].as_f64()? > 2.0;
        (warned && aged).then_some(v)
    });
    assert_eq!(stale["state"]["connected"], false, "{stale}");
    let (_, metrics) = b.request("GET", "/metrics", "");
    let metrics = metrics.as_str().unwrap_or_default().to_owned();
    assert!(metrics.contains("probity_state_connected 0"), "{metrics}");
    assert!(metrics.contains("probity_state_since_last_heard_seconds "));
    let (status, d) = b.request(
        "POST",
        "/v1/decide",
        r#"{"principal": "Node::\"node-001\"", "action": "listen", "resource": "Node::\"node-001\"", "context": {"port": 22, "protocol": "tcp"}}"#,
    );
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["decision"], "deny", "a blocked node stays blocked: {d}");
    // A block cannot be written: 503, not a local-only success.
    let (status, v) = a.request("POST", "/v1/nodes/node-new/block", "");
    assert_eq!(status, 503, "{v}");
    assert!(!a.blocked().contains(&"node-new".to_owned()));

    etcd.start(0);
    rt.block_on(etcd.wait_healthy(None));
    wait_for(WAIT, "readiness is clean again", || {
        let (_, v) = b.request("GET", "/readyz", "");
        (v["warnings"] == serde_json::json!([]) && v["state"]["connected"] == true).then_some(())
    });
    let (status, _) = a.request("POST", "/v1/nodes/node-new/block", "");
    assert_eq!(status, 200);
    wait_for(WAIT, "and blocks flow again", || {
        b.blocked().contains(&"node-new".to_owned()).then_some(())
    });
}
