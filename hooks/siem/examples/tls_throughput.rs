//! How fast the forwarder drains a backlog to rsyslog over TLS, against the simplest
//! possible sender on the same rsyslog in the same run.
//!
//! ```text
//! cargo run --release --example tls_throughput -- [RECORDS] [ROUNDS]
//! ```
//!
//! Starts `rsyslogd -n` (imtcp with the gtls driver, a throwaway CA made with rcgen)
//! on a free loopback port, then runs ROUNDS interleaved rounds (default 3) of:
//! * **minimal sender**: the same RECORDS (default 200,000) messages, formatted
//!   beforehand, octet-counted, written with `write_all` over one rustls connection,
//!   ended by close_notify, a half-close and the receiver's close;
//! * **forwarder**: a [`Forwarder`] with default settings over TLS, timed from start
//!   until its durable cursor holds the last record.
//!
//! Prints each round and the medians, and their ratio.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "a benchmark: any failure should stop it loudly"
)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use probity_siem::time::from_unix_micros;
use probity_siem::transport::write_octet_counted;
use probity_siem::{
    Forwarder, ForwarderConfig, MemoryCursor, MemorySource, Record, RecordKind, Severity,
    SyslogConfig, SyslogFormat, TlsSettings, Transport,
};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use sha2::{Digest as _, Sha256};

struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn records(n: u64) -> Vec<Record> {
    let mut prev = [0u8; 32];
    (1..=n)
        .map(|seq| {
            let message = format!("checkpoint ckpt-{seq} failed verification: chunk 17 at byte offset 71303168 does not match the signed manifest");
            let hash: [u8; 32] = Sha256::new()
                .chain_update(prev)
                .chain_update(seq.to_be_bytes())
                .chain_update(message.as_bytes())
                .finalize()
                .into();
            let r = Record {
                seq,
                hash,
                prev_hash: prev,
                time: from_unix_micros(1_796_075_233_000_000 + i64::try_from(seq).unwrap()),
                kind: RecordKind::Decision,
                severity: Severity::Critical,
                node: Some(format!("gpu-node-{}", seq % 64)),
                policy: Some("integrity.unverified-read".into()),
                message,
                fields: [
                    ("decision".to_owned(), "deny".to_owned()),
                    ("action".to_owned(), "Action::\"read\"".to_owned()),
                    ("resource".to_owned(), format!("Checkpoint::\"ckpt-{seq}\"")),
                ]
                .into(),
            };
            prev = hash;
            r
        })
        .collect()
}

fn start_rsyslog(dir: &Path, port: u16) -> Guard {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "bench CA");
    std::fs::write(dir.join("ca.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
    let mods = dir.join("modules");
    std::fs::create_dir_all(&mods).unwrap();
    std::fs::create_dir_all(dir.join("work")).unwrap();
    for e in std::fs::read_dir("/usr/lib/x86_64-linux-gnu/rsyslog").unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(e.path(), mods.join(e.file_name())).unwrap();
    }
    let d = dir.display();
    let conf = format!(
        "global(workDirectory=\"{d}/work\" defaultNetstreamDriverCAFile=\"{d}/ca.pem\" \
         defaultNetstreamDriverCertFile=\"{d}/server.pem\" defaultNetstreamDriverKeyFile=\"{d}/server.key\")\n\
         module(load=\"imtcp\" streamDriver.name=\"gtls\" streamDriver.mode=\"1\" streamDriver.authMode=\"anon\")\n\
         input(type=\"imtcp\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"bench\")\n\
         ruleset(name=\"bench\") {{ action(type=\"omfile\" file=\"{d}/received.log\" template=\"RSYSLOG_SyslogProtocol23Format\") }}\n"
    );
    std::fs::write(dir.join("rsyslog.conf"), conf).unwrap();
    let child = Command::new("rsyslogd")
        .arg("-n")
        .arg("-f")
        .arg(dir.join("rsyslog.conf"))
        .arg("-i")
        .arg(dir.join("rsyslog.pid"))
        .arg("-M")
        .arg(&mods)
        .stdin(Stdio::null())
        .spawn()
        .expect("rsyslogd");
    let guard = Guard(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "rsyslogd did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    guard
}

/// The simplest sender: one connection, pre-formatted frames, write_all, close.
fn minimal(port: u16, frames: &[u8], tls: &Arc<rustls::ClientConfig>) -> Duration {
    let t = Instant::now();
    let sock = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let conn =
        rustls::ClientConnection::new(Arc::clone(tls), "127.0.0.1".try_into().unwrap()).unwrap();
    let mut s = rustls::StreamOwned::new(conn, sock);
    for chunk in frames.chunks(64 * 1024) {
        s.write_all(chunk).unwrap();
    }
    s.conn.send_close_notify();
    s.flush().unwrap();
    s.sock.shutdown(Shutdown::Write).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => panic!("{e}"),
        }
    }
    t.elapsed()
}

fn forwarder(port: u16, records: &[Record], ca: &Path) -> Duration {
    let source = Arc::new(MemorySource::new());
    source.append(records.iter().cloned()).unwrap();
    let last = records.last().unwrap().seq;
    let mut cfg = ForwarderConfig::new(
        format!("127.0.0.1:{port}"),
        Transport::Tls(TlsSettings::new(ca)),
    );
    cfg.syslog = syslog();
    let cursor = MemoryCursor::new();
    let t = Instant::now();
    let fwd = Forwarder::start(cfg, source, cursor.clone()).unwrap();
    while cursor.value() < last {
        std::thread::sleep(Duration::from_millis(1));
    }
    let elapsed = t.elapsed();
    let stats = fwd.stop();
    assert_eq!(stats.failed_sends + stats.failed_connects, 0, "{stats:?}");
    elapsed
}

fn syslog() -> SyslogConfig {
    SyslogConfig {
        hostname: "bench-host".into(),
        ..SyslogConfig::default()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().map_or(200_000, |a| a.parse().unwrap());
    let rounds: usize = args.next().map_or(3, |a| a.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _rsyslog = start_rsyslog(dir.path(), port);

    let records = records(n);
    let format = SyslogFormat::new(&syslog()).unwrap();
    let mut frames = Vec::new();
    let mut msg = Vec::new();
    let t = Instant::now();
    for r in &records {
        msg.clear();
        format.format(r, &mut msg);
        write_octet_counted(&mut frames, &msg);
    }
    println!(
        "formatting alone: {:.0} records/s on one core",
        n as f64 / t.elapsed().as_secs_f64()
    );
    println!(
        "{n} records, {} bytes per message on average, {rounds} interleaved rounds",
        frames.len() as u64 / n
    );
    let tls = TlsSettings::new(dir.path().join("ca.pem"))
        .client_config()
        .unwrap();

    let (mut base, mut ours) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which goes first.
        let mut run = |which: bool| {
            if which {
                let d = minimal(port, &frames, &tls);
                base.push(n as f64 / d.as_secs_f64());
                println!(
                    "round {round}: minimal sender {:>9.0} records/s",
                    n as f64 / d.as_secs_f64()
                );
            } else {
                let d = forwarder(port, &records, &dir.path().join("ca.pem"));
                ours.push(n as f64 / d.as_secs_f64());
                println!(
                    "round {round}: forwarder      {:>9.0} records/s",
                    n as f64 / d.as_secs_f64()
                );
            }
        };
        run(round % 2 == 0);
        run(round % 2 == 1);
    }
    // Everything sent was written by rsyslog.
    let expected = n * 2 * rounds as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    let lines = loop {
        let lines = std::fs::read(dir.path().join("received.log"))
            .map(|b| b.iter().filter(|c| **c == b'\n').count() as u64)
            .unwrap_or(0);
        if lines >= expected || Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (b, o) = (median(base), median(ours));
    println!("rsyslog wrote {lines} lines of {expected} sent");
    println!(
        "median: minimal sender {b:.0} records/s, forwarder {o:.0} records/s, ratio {:.2}",
        o / b
    );
}
