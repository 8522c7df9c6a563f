//! Receivers that go away, stall, or outlive a forwarder killed with SIGKILL.

use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use probity_siem::{
    CursorStore, FileCursor, FileSource, Forwarder, MemoryCursor, MemorySource, Transport,
};

use crate::support::{
    Chain, Input, Pki, Proc, Rsyslog, check_delivery, eventually, fast, free_port,
};

fn down_then_back(transport: impl Fn(&Pki) -> Transport, input: impl Fn(&Pki) -> Input<'_>) {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let port = free_port();
    let source = Arc::new(MemorySource::new());
    let mut chain = Chain::new();
    let mut records = chain.take(300);
    source.append(records.clone()).unwrap();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), transport(&pki)),
        source.clone(),
        MemoryCursor::new(),
    )
    .unwrap();
    // Nobody listens: attempts fail, records wait.
    let stats = eventually(
        "failed connection attempts",
        Duration::from_secs(30),
        || {
            let s = fwd.stats();
            (s.failed_connects >= 3 && s.reconnects >= 2).then_some(s)
        },
    );
    assert_eq!(
        (stats.forwarded, stats.cursor, stats.backlog, stats.behind),
        (0, 0, 300, true)
    );
    assert!(stats.last_error.unwrap().starts_with(&format!(
        "cannot connect to 127.0.0.1:{port}: Connection refused"
    )));
    // More arrive while it is down.
    let more = chain.take(200);
    source.append(more.clone()).unwrap();
    records.extend(more);
    assert_eq!(fwd.stats().backlog, 500);

    let mut rsyslog = Rsyslog::start(dir.path(), port, &input(&pki));
    let msgs = rsyslog.wait_for_seq(500, Duration::from_secs(60));
    check_delivery(&msgs, &records);
    let stats = eventually("the cursor to reach 500", Duration::from_secs(30), || {
        let s = fwd.stats();
        (s.cursor == 500).then_some(s)
    });
    assert_eq!(
        (stats.backlog, stats.behind, stats.last_error),
        (0, false, None)
    );
}

#[test]
fn records_appended_while_a_relp_receiver_is_down_arrive_in_order_when_it_returns() {
    down_then_back(|_| Transport::Relp, |_| Input::Relp);
}

#[test]
fn records_appended_while_a_tls_receiver_is_down_arrive_in_order_when_it_returns() {
    down_then_back(
        |pki| Transport::Tls(pki.tls()),
        |pki| Input::Tls {
            server: &pki.server,
            ca: &pki.ca.pem_path,
            client_auth: false,
        },
    );
}

/// A listener that accepts connections and never reads from them.
struct Staller {
    stop: Arc<AtomicBool>,
    held: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Staller {
    fn start(port: u16) -> Staller {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, held) = (Arc::clone(&stop), Arc::clone(&held));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, _)) => held.lock().unwrap().push(s),
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        Staller {
            stop,
            held,
            thread: Some(thread),
        }
    }

    fn connections(&self) -> usize {
        self.held.lock().unwrap().len()
    }
}

impl Drop for Staller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.held.lock().unwrap().clear();
    }
}

#[test]
fn a_receiver_that_never_reads_stalls_the_forwarder_not_the_appender_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let staller = Staller::start(port);
    let source = Arc::new(MemorySource::new());
    let mut chain = Chain::new();
    // About 20 MB of messages: more than the socket buffers hold.
    let mut records = chain.take(60_000);
    source.append(records.clone()).unwrap();
    let cursor = MemoryCursor::new();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), Transport::Tcp),
        source.clone(),
        cursor.clone(),
    )
    .unwrap();
    let stats = eventually("a write to time out", Duration::from_secs(60), || {
        let s = fwd.stats();
        (s.failed_sends >= 2).then_some(s)
    });
    assert!(staller.connections() >= 2);
    assert!(stats.sent > 0);
    assert_eq!(
        (stats.forwarded, stats.cursor, stats.backlog, stats.behind),
        (0, 0, 60_000, true)
    );
    let error = stats.last_error.unwrap();
    assert!(
        error.starts_with(&format!(
            "sending syslog frames on 127.0.0.1:{port} timed out after"
        )) || error.starts_with(&format!(
            "confirming delivery by an orderly close on 127.0.0.1:{port} timed out"
        )),
        "{error}"
    );

    // The appender is not held up: 20,000 more records go in while the forwarder is
    // stuck, and it is still stuck afterwards.
    let t = Instant::now();
    for _ in 0..100 {
        let batch = chain.take(200);
        source.append(batch.clone()).unwrap();
        records.extend(batch);
    }
    let elapsed = t.elapsed();
    let stats = fwd.stats();
    assert_eq!((stats.cursor, stats.backlog), (0, 80_000));
    eprintln!(
        "appended 20,000 records in {elapsed:?} ({:.0}/s) while the forwarder was stalled",
        20_000.0 / elapsed.as_secs_f64()
    );

    // A real receiver takes over the port: everything arrives, in order.
    drop(staller);
    let mut rsyslog = Rsyslog::start(dir.path(), port, &Input::Tcp);
    let msgs = rsyslog.wait_for_seq(80_000, Duration::from_secs(180));
    check_delivery(&msgs, &records);
    eventually(
        "the cursor to reach 80,000",
        Duration::from_secs(60),
        || (cursor.value() == 80_000).then_some(()),
    );
    assert!(!fwd.stats().behind);
}

/// The example binary: `cargo test` builds it beside the test binary; when only this
/// test binary was built (`cargo test --test siem`), build it now.
fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join(name);
    if !path.exists() {
        let release = profile_dir.ends_with("release").then_some("--release");
        let status = Command::new(env!("CARGO"))
            .args(["build", "--example", name])
            .args(release)
            .arg("--manifest-path")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
            .env("CARGO_TARGET_DIR", profile_dir.parent().unwrap())
            .status()
            .unwrap();
        assert!(status.success(), "cargo build --example {name} failed");
    }
    path
}

#[test]
fn a_forwarder_killed_mid_stream_resumes_from_its_cursor_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let rsyslog = Rsyslog::start(dir.path(), port, &Input::Tcp);
    let log_path = dir.path().join("audit.jsonl");
    let cursor_path = dir.path().join("siem.cursor");
    let log = Arc::new(FileSource::open(&log_path).unwrap().with_sync(false));
    let spawn = || {
        Proc::spawn(
            "forward_file",
            Command::new(example("forward_file"))
                .args(["--source", log_path.to_str().unwrap()])
                .args(["--cursor", cursor_path.to_str().unwrap()])
                .args(["--to", &format!("127.0.0.1:{port}")])
                .stdout(std::process::Stdio::null()),
        )
    };
    let mut forwarder = spawn();

    // Append in bursts from another thread while the forwarder runs.
    let total = 30_000u64;
    let appended = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let appender = {
        let (log, appended) = (Arc::clone(&log), Arc::clone(&appended));
        std::thread::spawn(move || {
            let mut chain = Chain::new();
            let mut all = Vec::new();
            while appended.load(Ordering::Relaxed) < total {
                let batch = chain.take(250);
                log.append(&batch).unwrap();
                appended.fetch_add(250, Ordering::Relaxed);
                all.extend(batch);
                std::thread::sleep(Duration::from_millis(5));
            }
            all
        })
    };
    // Kill it once it has confirmed something and while records keep coming.
    let cursor = FileCursor::new(&cursor_path);
    // Preferably while rsyslog holds records not yet confirmed (they are sent again
    // after the restart); after 10 s, any confirmed progress will do.
    let prefer_until = Instant::now() + Duration::from_secs(10);
    eventually("a first confirmation", Duration::from_secs(60), || {
        let confirmed = cursor.load().unwrap();
        let unconfirmed_received = rsyslog.highest() > confirmed;
        (confirmed > 0 && (unconfirmed_received || Instant::now() > prefer_until)).then_some(())
    });
    let appended_at_kill = appended.load(Ordering::Relaxed);
    forwarder.child.kill().unwrap(); // SIGKILL, by PID
    forwarder.child.wait().unwrap();
    let cursor_at_kill = cursor.load().unwrap();
    assert!(
        cursor_at_kill < appended_at_kill,
        "killed mid-stream: {cursor_at_kill} < {appended_at_kill}"
    );
    let (before_restart, _) = rsyslog.received();

    let records = appender.join().unwrap();
    let _forwarder = spawn();
    let log_err = rsyslog.log.clone();
    eventually(
        "every record after the restart",
        Duration::from_secs(120),
        || (rsyslog.highest() >= total).then_some(()),
    );
    let (msgs, bad) = rsyslog.received();
    // A frame cut by the kill may reach rsyslog as a truncated line; its record is
    // resent whole after the restart.
    assert!(
        bad.len() <= 1,
        "{bad:#?} (rsyslog log {})",
        log_err.display()
    );
    let duplicates = check_delivery(&msgs, &records);
    eventually(
        "the cursor file to reach the end",
        Duration::from_secs(30),
        || (cursor.load().unwrap() == total).then_some(()),
    );
    eprintln!(
        "killed at cursor {cursor_at_kill} with {appended_at_kill} appended and {} received; \
         {duplicates} duplicates after the restart",
        before_restart.len()
    );
}

/// A RELP receiver that refuses one frame: the records acknowledged before it are
/// delivered, it and everything after are sent again on the next connection.
#[test]
fn a_relp_refusal_resends_from_the_refused_record() {
    use probity_siem::transport::relp::{parse_frame, write_frame};
    use std::io::{Read, Write};

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Per connection: the seqs received, in order.
    let sessions: Arc<Mutex<Vec<Vec<u64>>>> = Arc::default();
    let seen = Arc::clone(&sessions);
    std::thread::spawn(move || {
        for (n, conn) in listener.incoming().enumerate() {
            let Ok(mut conn) = conn else { return };
            seen.lock().unwrap().push(Vec::new());
            let mut buf = Vec::new();
            let mut chunk = [0u8; 65536];
            'conn: while let Ok(got) = conn.read(&mut chunk) {
                if got == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..got]);
                let mut out = Vec::new();
                while let Some((f, used)) = parse_frame(&buf, 1 << 20).unwrap() {
                    let (txnr, command) = (f.txnr, f.command.to_owned());
                    let seq = crate::support::seq_of(f.data);
                    buf.drain(..used);
                    match command.as_str() {
                        "open" => write_frame(
                            &mut out,
                            txnr,
                            "rsp",
                            b"200 OK\nrelp_version=0\ncommands=syslog",
                        ),
                        "syslog" => {
                            let seq = seq.unwrap();
                            seen.lock().unwrap()[n].push(seq);
                            // The first connection refuses record 5.
                            if n == 0 && seq == 5 {
                                write_frame(&mut out, txnr, "rsp", b"500 queue full");
                                let _ = conn.write_all(&out);
                                break 'conn;
                            }
                            write_frame(&mut out, txnr, "rsp", b"200 OK");
                        }
                        "close" => write_frame(&mut out, txnr, "rsp", b""),
                        _ => {}
                    }
                }
                if conn.write_all(&out).is_err() {
                    break;
                }
            }
        }
    });
    let source = Arc::new(MemorySource::new());
    source.append(Chain::new().take(50)).unwrap();
    let cursor = MemoryCursor::new();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), Transport::Relp),
        source.clone(),
        cursor.clone(),
    )
    .unwrap();
    let stats = eventually("all 50 acknowledged", Duration::from_secs(30), || {
        let s = fwd.stats();
        (s.cursor == 50).then_some(s)
    });
    assert_eq!(stats.failed_sends, 1, "{stats:?}");
    assert_eq!(stats.last_error, None, "cleared by the later success");
    let sessions = sessions.lock().unwrap().clone();
    assert_eq!(&sessions[0][..5], &[1, 2, 3, 4, 5]);
    assert_eq!(
        sessions[1][0], 5,
        "the refused record is the first one sent again"
    );
    assert_eq!(*sessions[1].last().unwrap(), 50);
}

/// A receiver that reads a little and then closes on its own has not shown that it
/// read what followed: its end of stream must not count as a confirmation.
#[test]
fn a_receiver_that_closes_on_its_own_confirms_nothing() {
    use std::io::Read;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            // Reads what comes until 100 ms pass without more, then closes: an end
            // of stream that is not an answer to ours.
            conn.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let mut buf = [0u8; 65536];
            while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
        }
    });
    let source = Arc::new(MemorySource::new());
    source.append(Chain::new().take(5)).unwrap();
    let mut cfg = fast(format!("127.0.0.1:{port}"), Transport::Tcp);
    // Linger long enough for the receiver to close first.
    cfg.confirm_linger = Duration::from_millis(500);
    cfg.confirm_interval = Duration::from_secs(1);
    let cursor = MemoryCursor::new();
    let fwd = Forwarder::start(cfg, source.clone(), cursor.clone()).unwrap();
    let stats = eventually("failed confirmations", Duration::from_secs(30), || {
        let s = fwd.stats();
        (s.failed_sends >= 3).then_some(s)
    });
    assert_eq!(
        (stats.confirmations, stats.forwarded, stats.cursor),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(cursor.value(), 0);
}
