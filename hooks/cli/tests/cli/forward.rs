//! `probity serve` with `[siem]`: the decision log reaches a real rsyslog on loopback
//! at least once, across a `kill -9` of the server.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const RSYSLOG_MODULES: &str = "/usr/lib/x86_64-linux-gnu/rsyslog";

/// A child killed (SIGKILL, by its PID) and reaped when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `f` every 20 ms until it gives a value; panics after `limit`.
fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_running(p: &mut Proc, name: &str, log: &Path) {
    if let Ok(Some(status)) = p.0.try_wait() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        panic!("{name} exited with {status}:\n{text}");
    }
}

/// rsyslogd -n on 127.0.0.1:`port` (imtcp or imrelp), writing RFC 5424 lines with
/// their structured data to `out`.
fn start_rsyslog(dir: &Path, port: u16, relp: bool, out: &Path) -> Proc {
    let work = dir.join("rsyslog-work");
    let mods = dir.join("rsyslog-modules");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::create_dir_all(&mods).unwrap();
    // Modules (and their helpers) load from -M: point it into the test's directory.
    for entry in std::fs::read_dir(RSYSLOG_MODULES).unwrap() {
        let entry = entry.unwrap();
        let link = mods.join(entry.file_name());
        if !link.exists() {
            std::os::unix::fs::symlink(entry.path(), link).unwrap();
        }
    }
    let input = if relp { "imrelp" } else { "imtcp" };
    let conf = format!(
        "global(workDirectory=\"{work}\" maxMessageSize=\"64k\")\n\
         module(load=\"{input}\")\n\
         input(type=\"{input}\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"probity\")\n\
         template(name=\"out\" type=\"string\" string=\"<%PRI%>1 %TIMESTAMP:::date-rfc3339% %HOSTNAME% %APP-NAME% %PROCID% %MSGID% %STRUCTURED-DATA% %msg%\\n\")\n\
         ruleset(name=\"probity\") {{ action(type=\"omfile\" file=\"{out}\" template=\"out\") }}\n",
        work = work.display(),
        out = out.display(),
    );
    let conf_path = dir.join("rsyslog.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let log = dir.join("rsyslog.stderr");
    let mut p = Proc(
        Command::new("rsyslogd")
            .arg("-n")
            .arg("-f")
            .arg(&conf_path)
            .arg("-i")
            .arg(dir.join("rsyslog.pid"))
            .arg("-M")
            .arg(&mods)
            .stdin(Stdio::null())
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("rsyslogd to listen", Duration::from_secs(20), || {
        assert_running(&mut p, "rsyslogd", &log);
        TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
    });
    p
}

/// `probity serve --config <config>`, its standard error in `log` (appended).
fn start_server(config: &Path, log: &Path, port: u16) -> Proc {
    let err = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .unwrap();
    let mut p = Proc(
        Command::new(env!("CARGO_BIN_EXE_probity"))
            .args(["serve", "--config"])
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap(),
    );
    eventually("probity serve to be ready", Duration::from_secs(60), || {
        assert_running(&mut p, "probity serve", log);
        http(port, "GET", "/readyz", "").filter(|(status, _)| *status == 200)
    });
    p
}

/// One HTTP/1.1 exchange on a fresh connection: the status and body, or `None` when
/// the connection failed.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let status = resp.split(' ').nth(1)?.parse().ok()?;
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
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

/// The `seq` of every line of rsyslog's file, and the lines.
fn received(out: &Path) -> (Vec<u64>, String) {
    let text = std::fs::read_to_string(out).unwrap_or_default();
    let seqs = text
        .lines()
        .filter_map(|l| {
            let rest = l.split_once(" seq=\"")?.1;
            rest.split('"').next()?.parse().ok()
        })
        .collect();
    (seqs, text)
}

fn config(dir: &Path, port: u16, siem_port: u16, transport: &str) -> PathBuf {
    let path = dir.join("probity-server.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nsocket = \"\"\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\n\
             [integrity]\nstate_dir = \"{}\"\n\
             [limits]\nrecorded_per_second = 100000\nrecorded_burst = 100000\n\
             [siem]\naddress = \"127.0.0.1:{siem_port}\"\ntransport = \"{transport}\"\n",
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
    let out = dir.join("received.log");
    let _rsyslog = start_rsyslog(dir, siem_port, transport == "relp", &out);
    let port = free_port();
    let cfg = config(dir, port, siem_port, transport);
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
        || (received(&out).0.len() >= 5).then_some(()),
    );
    server.0.kill().unwrap();
    server.0.wait().unwrap();
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
            let (seqs, text) = received(&out);
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
    if !Path::new(RSYSLOG_MODULES).join("imrelp.so").exists() {
        eprintln!("imrelp is not installed (Debian package rsyslog-relp): skipped");
        return;
    }
    every_acknowledged_decision_reaches_the_siem_across_a_kill_9("relp");
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
    probity::integrity::pin_public_key(&pinned, probity::integrity::Anchor::public_key(&anchor))
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
