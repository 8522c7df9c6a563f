//! What the tests share: processes stopped by PID, rsyslog and Alertmanager on
//! loopback, a test PKI, hash-chained records and the delivery check.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use probity_siem::syslog::{SyslogMessage, parse};
use probity_siem::time::from_unix_micros;
use probity_siem::{
    Backoff, ClientIdentity, Digest, ForwarderConfig, Record, RecordKind, Severity, SyslogConfig,
    TlsSettings, Transport,
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use sha2::{Digest as _, Sha256};

/// The SD-ID our messages carry.
pub const SD: &str = "probity@32473";

/// The repository's fixtures directory.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures")
}

/// A child process killed (SIGKILL, by its PID) and reaped when dropped.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
}

impl Proc {
    pub fn spawn(name: &'static str, cmd: &mut Command) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc { child, name }
    }

    /// Panics if the process has exited (with what it left in `log`).
    pub fn assert_running(&mut self, log: &Path) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            panic!("{} exited with {status}:\n{text}", self.name);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 20 ms until it gives a value; panics after `limit`.
pub fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[path = "../../../testsupport/ports.rs"]
mod ports;
pub use ports::free_port;

pub fn wait_listening(port: u16, proc: &mut Proc, log: &Path) {
    eventually(
        &format!("{} to listen on {port}", proc.name),
        Duration::from_secs(20),
        || {
            proc.assert_running(log);
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        },
    );
}

// ---------------------------------------------------------------- PKI

pub struct Ca {
    pub pem_path: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    dir: PathBuf,
}

pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Ca {
    pub fn new(dir: &Path, name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        let pem_path = dir.join(format!("{name}.pem"));
        std::fs::write(&pem_path, cert.pem()).unwrap();
        Ca {
            pem_path,
            issuer: Issuer::new(params, key),
            dir: dir.to_owned(),
        }
    }

    /// A leaf for `sans` (IP addresses or DNS names), for servers or clients.
    pub fn leaf(&self, file: &str, cn: &str, sans: &[&str], client: bool) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let leaf = Leaf {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).unwrap();
        std::fs::write(&leaf.key, key.serialize_pem()).unwrap();
        leaf
    }
}

/// Server certificate for 127.0.0.1, CA, and a client identity.
pub struct Pki {
    pub ca: Ca,
    pub server: Leaf,
    pub client: Leaf,
}

impl Pki {
    pub fn new(dir: &Path) -> Pki {
        let ca = Ca::new(dir, "probity-test-ca");
        let server = ca.leaf("server", "rsyslog", &["127.0.0.1"], false);
        let client = ca.leaf(
            "client",
            "probity-forwarder",
            &["probity-forwarder.test"],
            true,
        );
        Pki { ca, server, client }
    }

    pub fn tls(&self) -> TlsSettings {
        TlsSettings::new(&self.ca.pem_path)
    }

    pub fn tls_with_client(&self) -> TlsSettings {
        self.tls().with_client_identity(ClientIdentity {
            cert_file: self.client.cert.clone(),
            key_file: self.client.key.clone(),
        })
    }
}

// ---------------------------------------------------------------- rsyslog

/// What rsyslog listens with.
pub enum Input<'a> {
    /// imtcp, plain, octet counting.
    Tcp,
    /// imtcp with the gtls driver; `client_auth` makes it demand a client certificate.
    Tls {
        server: &'a Leaf,
        ca: &'a Path,
        client_auth: bool,
    },
    /// imrelp, plain.
    Relp,
    /// imrelp with TLS (librelp demands a client certificate).
    RelpTls { server: &'a Leaf, ca: &'a Path },
}

/// rsyslogd -n on loopback writing what it receives to `out`, RFC 5424 lines with the
/// structured data kept. Everything it touches is under `dir`.
pub struct Rsyslog {
    pub proc: Proc,
    pub out: PathBuf,
    pub log: PathBuf,
    seen: std::sync::Mutex<Seen>,
}

impl Rsyslog {
    pub fn start(dir: &Path, port: u16, input: &Input<'_>) -> Rsyslog {
        Self::start_with(dir, port, input, "")
    }

    /// Like [`Rsyslog::start`], with `extra` configuration (modules, templates) and an
    /// output template named `out` if `extra` defines one.
    pub fn start_with(dir: &Path, port: u16, input: &Input<'_>, extra: &str) -> Rsyslog {
        let work = dir.join("work");
        let mods = dir.join("modules");
        std::fs::create_dir_all(&work).unwrap();
        std::fs::create_dir_all(&mods).unwrap();
        // rsyslog loads its modules (and their helpers: lmtcpsrv, lmnsd_gtls…) from
        // the -M directory: point it into the test's directory.
        for entry in std::fs::read_dir("/usr/lib/x86_64-linux-gnu/rsyslog").unwrap() {
            let entry = entry.unwrap();
            let link = mods.join(entry.file_name());
            if !link.exists() {
                std::os::unix::fs::symlink(entry.path(), link).unwrap();
            }
        }
        let out = dir.join(format!("received-{port}.log"));
        let d = |p: &Path| p.display().to_string();
        let mut global = format!(r#"workDirectory="{}" maxMessageSize="64k""#, d(&work));
        let inputs = match input {
            Input::Tcp => format!(
                "module(load=\"imtcp\")\ninput(type=\"imtcp\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"probity\")"
            ),
            Input::Tls {
                server,
                ca,
                client_auth,
            } => {
                global.push_str(&format!(
                    r#" defaultNetstreamDriverCAFile="{}" defaultNetstreamDriverCertFile="{}" defaultNetstreamDriverKeyFile="{}""#,
                    d(ca),
                    d(&server.cert),
                    d(&server.key)
                ));
                let auth = if *client_auth {
                    "x509/certvalid"
                } else {
                    "anon"
                };
                format!(
                    "module(load=\"imtcp\" streamDriver.name=\"gtls\" streamDriver.mode=\"1\" streamDriver.authMode=\"{auth}\")\n\
                     input(type=\"imtcp\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"probity\")"
                )
            }
            Input::Relp => format!(
                "module(load=\"imrelp\")\ninput(type=\"imrelp\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"probity\")"
            ),
            Input::RelpTls { server, ca } => format!(
                "module(load=\"imrelp\")\ninput(type=\"imrelp\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"probity\" \
                 tls=\"on\" tls.cacert=\"{}\" tls.mycert=\"{}\" tls.myprivkey=\"{}\" tls.authmode=\"certvalid\")",
                d(ca),
                d(&server.cert),
                d(&server.key)
            ),
        };
        let ruleset = if extra.is_empty() {
            format!(
                "template(name=\"out\" type=\"string\" string=\"<%PRI%>1 %TIMESTAMP:::date-rfc3339% %HOSTNAME% %APP-NAME% %PROCID% %MSGID% %STRUCTURED-DATA% %msg%\\n\")\n\
                 ruleset(name=\"probity\") {{ action(type=\"omfile\" file=\"{}\" template=\"out\") }}",
                d(&out)
            )
        } else {
            extra.replace("OUT", &d(&out))
        };
        let conf = format!("global({global})\n{inputs}\n{ruleset}\n");
        let conf_path = dir.join(format!("rsyslog-{port}.conf"));
        std::fs::write(&conf_path, conf).unwrap();
        let log = dir.join(format!("rsyslog-{port}.stderr"));
        let mut proc = Proc::spawn(
            "rsyslogd",
            Command::new("rsyslogd")
                .arg("-n")
                .arg("-f")
                .arg(&conf_path)
                .arg("-i")
                .arg(dir.join(format!("rsyslog-{port}.pid")))
                .arg("-M")
                .arg(&mods)
                .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
                .stderr(Stdio::from(
                    std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(&log)
                        .unwrap(),
                )),
        );
        wait_listening(port, &mut proc, &log);
        Rsyslog {
            proc,
            out,
            log,
            seen: Default::default(),
        }
    }

    /// Reads the lines added since the last look.
    fn update(&self) -> std::sync::MutexGuard<'_, Seen> {
        let mut seen = self.seen.lock().unwrap();
        let mut bytes = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.out) {
            use std::io::Seek;
            f.seek(std::io::SeekFrom::Start(seen.offset as u64))
                .unwrap();
            f.read_to_end(&mut bytes).unwrap();
        }
        let complete = match bytes.iter().rposition(|b| *b == b'\n') {
            Some(i) => &bytes[..=i],
            None => &[][..],
        };
        seen.offset += complete.len();
        for line in complete.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            match parse(line) {
                Ok(m) => {
                    if let Some(seq) = m.param(SD, "seq").and_then(|s| s.parse::<u64>().ok()) {
                        seen.highest = seen.highest.max(seq);
                    }
                    seen.good.push(m);
                }
                Err(e) => seen
                    .bad
                    .push(format!("{e}: {}", String::from_utf8_lossy(line))),
            }
        }
        seen
    }

    /// The lines received so far: parsed, and those that did not parse.
    pub fn received(&self) -> (Vec<SyslogMessage>, Vec<String>) {
        let seen = self.update();
        (seen.good.clone(), seen.bad.clone())
    }

    /// The highest seq received so far.
    pub fn highest(&self) -> u64 {
        self.update().highest
    }

    /// Waits until the highest seq received is `last`; returns the messages.
    pub fn wait_for_seq(&mut self, last: u64, limit: Duration) -> Vec<SyslogMessage> {
        let log = self.log.clone();
        eventually(&format!("rsyslog to receive record {last}"), limit, || {
            self.proc.assert_running(&log);
            (self.highest() >= last).then_some(())
        });
        let (good, bad) = self.received();
        assert!(bad.is_empty(), "unparsable lines: {bad:#?}");
        good
    }
}

#[derive(Default)]
struct Seen {
    offset: usize,
    good: Vec<SyslogMessage>,
    bad: Vec<String>,
    highest: u64,
}

// ---------------------------------------------------------------- records

/// Hash-chained records as the engine would write them (the hash here is the test's
/// own: SHA-256 over prev, seq and message).
pub struct Chain {
    prev: Digest,
    next: u64,
}

impl Chain {
    pub fn new() -> Chain {
        Chain {
            prev: [0; 32],
            next: 1,
        }
    }

    pub fn take(&mut self, n: u64) -> Vec<Record> {
        (0..n).map(|_| self.one()).collect()
    }

    pub fn one(&mut self) -> Record {
        let seq = self.next;
        let kind = RecordKind::ALL[usize::try_from(seq).unwrap() % RecordKind::ALL.len()];
        let severity = Severity::ALL[usize::try_from(seq).unwrap() % Severity::ALL.len()];
        let message = format!("record {seq}: “{}” on gpu-node-{}", kind, seq % 7);
        let mut h = Sha256::new();
        h.update(self.prev);
        h.update(seq.to_be_bytes());
        h.update(message.as_bytes());
        let hash: Digest = h.finalize().into();
        let mut fields = BTreeMap::new();
        if kind == RecordKind::Decision {
            fields.insert("decision".to_owned(), "deny".to_owned());
            fields.insert("action".to_owned(), "Action::\"read\"".to_owned());
            fields.insert("resource".to_owned(), format!("Checkpoint::\"ckpt-{seq}\""));
        }
        let r = Record {
            seq,
            hash,
            prev_hash: self.prev,
            time: from_unix_micros(1_796_075_233_000_000 + i64::try_from(seq).unwrap()),
            kind,
            severity,
            node: Some(format!("gpu-node-{}", seq % 7)),
            policy: Some("integrity.unverified-read".to_owned()),
            message,
            fields,
        };
        self.prev = hash;
        self.next += 1;
        r
    }
}

/// Checks what a receiver got against the records: each message matches its record
/// (seq, hash, prev, kind, node, policy, MSG); sequence numbers never jump ahead (a
/// resend may go back: duplicates are accepted, gaps are not); the last one is seen.
/// Returns the number of duplicates.
pub fn check_delivery(msgs: &[SyslogMessage], records: &[Record]) -> usize {
    let by_seq: BTreeMap<u64, &Record> = records.iter().map(|r| (r.seq, r)).collect();
    let mut highest = 0u64;
    let mut seen = std::collections::BTreeSet::new();
    let mut duplicates = 0;
    for (i, m) in msgs.iter().enumerate() {
        let seq: u64 = m.param(SD, "seq").expect("seq").parse().unwrap();
        let r = by_seq
            .get(&seq)
            .unwrap_or_else(|| panic!("message {i} carries unknown seq {seq}"));
        assert_eq!(
            m.param(SD, "hash"),
            Some(probity_siem::record::hex(&r.hash).as_str()),
            "hash of {seq}"
        );
        assert_eq!(
            m.param(SD, "prev"),
            Some(probity_siem::record::hex(&r.prev_hash).as_str()),
            "prev of {seq}"
        );
        assert_eq!(m.param(SD, "kind"), Some(r.kind.as_str()));
        assert_eq!(m.msgid.as_deref(), Some(r.kind.as_str()));
        assert_eq!(m.param(SD, "node"), r.node.as_deref());
        assert_eq!(m.param(SD, "policy"), r.policy.as_deref());
        for (k, v) in &r.fields {
            assert_eq!(m.param(SD, k), Some(v.as_str()), "field {k} of {seq}");
        }
        assert!(m.msg_bom, "MSG of {seq} starts with a BOM");
        assert_eq!(m.msg_text(), r.message);
        assert_eq!(
            u32::from(m.severity),
            u32::from(r.severity.syslog_severity())
        );
        assert_eq!(m.facility, 13);
        assert!(
            seq <= highest + 1,
            "gap: message {i} carries seq {seq} after seq {highest} was the highest"
        );
        highest = highest.max(seq);
        if !seen.insert(seq) {
            duplicates += 1;
        }
    }
    assert_eq!(
        highest,
        records.last().map_or(0, |r| r.seq),
        "the last record arrived"
    );
    duplicates
}

/// Settings that react fast, for tests.
pub fn fast(addr: String, transport: Transport) -> ForwarderConfig {
    let mut c = ForwarderConfig::new(addr, transport);
    c.syslog = SyslogConfig {
        hostname: "test-host".into(),
        procid: "4242".into(),
        ..SyslogConfig::default()
    };
    c.connect_timeout = Duration::from_secs(2);
    c.write_timeout = Duration::from_millis(800);
    c.ack_timeout = Duration::from_secs(3);
    c.backoff = Backoff {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(300),
    };
    c.confirm_interval = Duration::from_millis(300);
    c.confirm_linger = Duration::from_millis(50);
    c.idle_wait = Duration::from_millis(50);
    c.behind_threshold = 100;
    c
}

/// Reads an HTTP request (headers and a Content-Length body) from `s`.
pub fn read_http_request(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = s.read(&mut chunk).ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some((head, buf[end + 4..end + 4 + len].to_vec()));
        }
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The seq a syslog message carries (for fake receivers).
pub fn seq_of(msg: &[u8]) -> Option<u64> {
    parse(msg).ok()?.param(SD, "seq")?.parse().ok()
}
