//! The real services integration tests start on loopback and stop by PID: rsyslog,
//! Alertmanager, auditd, sshd, and a throwaway login user.
//!
//! Why a file and not a crate: it is test code only, shared by the `cli` and `agent`
//! test binaries through `#[path]`, so that each service is started one way. It uses
//! the standard library, `serde_json` and `tempfile` alone (both binaries have them).
//! Every process is stopped when its handle drops: SIGKILL, or SIGTERM for auditd,
//! which must unregister from the kernel's one audit socket.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A child process stopped (SIGKILL unless `terminate`, by its PID) and reaped when
/// dropped; its standard output and error go to `log`.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
    pub log: PathBuf,
    /// Stop with SIGTERM (and wait up to 10 s) instead of SIGKILL.
    pub terminate: bool,
}

impl Proc {
    /// Spawns `command` with its output appended to `log`.
    pub fn spawn(name: &'static str, command: &mut Command, log: &Path) -> Proc {
        let file = || {
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(log)
                .unwrap()
        };
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::from(file()))
            .stderr(Stdio::from(file()))
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        Proc {
            child,
            name,
            log: log.to_owned(),
            terminate: false,
        }
    }

    /// Panics with its log when it has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            panic!("{} exited with {status}:\n{text}", self.name);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.terminate {
            let _ = Command::new("kill")
                .arg(self.child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[path = "ports.rs"]
mod ports;
pub use ports::free_port;

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

/// One HTTP/1.1 exchange on a fresh loopback connection: the status and body, or
/// `None` when the connection failed.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
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
    let (head, body) = resp.split_once("\r\n\r\n")?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Some((status, body))
}

/// A chunked body's bytes.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size + 2..)?;
    }
}

const RSYSLOG_MODULES: &str = "/usr/lib/x86_64-linux-gnu/rsyslog";

/// How rsyslog listens.
pub enum SyslogInput<'a> {
    /// `imtcp`, octet-counted or LF-framed syslog.
    Tcp,
    /// `imrelp`.
    Relp,
    /// `imtcp` over TLS (RFC 5425, gtls driver), with this CA, certificate and key.
    Tls {
        ca: &'a Path,
        cert: &'a Path,
        key: &'a Path,
    },
}

/// `rsyslogd -n` on 127.0.0.1, writing every message as an RFC 5424 line (with its
/// structured data) to `out`.
pub struct Rsyslog {
    pub proc: Proc,
    pub port: u16,
    pub out: PathBuf,
}

impl Rsyslog {
    pub fn start(dir: &Path, port: u16, input: SyslogInput<'_>) -> Rsyslog {
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
        let out = dir.join("rsyslog.out");
        let (global, module, params) = match input {
            SyslogInput::Tcp => (String::new(), "imtcp", String::new()),
            SyslogInput::Relp => (String::new(), "imrelp", String::new()),
            SyslogInput::Tls { ca, cert, key } => (
                format!(
                    " defaultNetstreamDriver=\"gtls\" defaultNetstreamDriverCAFile=\"{}\" defaultNetstreamDriverCertFile=\"{}\" defaultNetstreamDriverKeyFile=\"{}\"",
                    ca.display(),
                    cert.display(),
                    key.display()
                ),
                "imtcp",
                " streamDriver.name=\"gtls\" streamDriver.mode=\"1\" streamDriver.authMode=\"anon\""
                    .to_owned(),
            ),
        };
        let conf = format!(
            "global(workDirectory=\"{work}\" maxMessageSize=\"64k\"{global})\n\
             module(load=\"{module}\")\n\
             input(type=\"{module}\" port=\"{port}\" address=\"127.0.0.1\" ruleset=\"probity\"{params})\n\
             template(name=\"out\" type=\"string\" string=\"<%PRI%>1 %TIMESTAMP:::date-rfc3339% %HOSTNAME% %APP-NAME% %PROCID% %MSGID% %STRUCTURED-DATA% %msg%\\n\")\n\
             ruleset(name=\"probity\") {{ action(type=\"omfile\" file=\"{out}\" template=\"out\") }}\n",
            work = work.display(),
            out = out.display(),
        );
        let conf_path = dir.join("rsyslog.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let mut proc = Proc::spawn(
            "rsyslogd",
            Command::new("rsyslogd")
                .arg("-n")
                .arg("-f")
                .arg(&conf_path)
                .arg("-i")
                .arg(dir.join("rsyslog.pid"))
                .arg("-M")
                .arg(&mods),
            &dir.join("rsyslog.log"),
        );
        eventually("rsyslogd to listen", Duration::from_secs(20), || {
            proc.assert_running();
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        });
        Rsyslog { proc, port, out }
    }

    /// The `seq` of every line written, and the lines.
    pub fn received(&self) -> (Vec<u64>, String) {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let seqs = text
            .lines()
            .filter_map(|l| {
                let rest = l.split_once(" seq=\"")?.1;
                rest.split('"').next()?.parse().ok()
            })
            .collect();
        (seqs, text)
    }
}

/// prometheus-alertmanager on loopback, clustering off, state under `dir`.
pub struct Alertmanager {
    proc: Proc,
    pub port: u16,
    pub url: String,
}

impl Alertmanager {
    pub fn start(dir: &Path) -> Alertmanager {
        let port = free_port();
        let config = dir.join("alertmanager.yml");
        std::fs::write(
            &config,
            "route:\n  receiver: none\nreceivers:\n  - name: none\n",
        )
        .unwrap();
        let storage = dir.join("alertmanager-data");
        std::fs::create_dir_all(&storage).unwrap();
        let mut proc = Proc::spawn(
            "prometheus-alertmanager",
            Command::new("prometheus-alertmanager")
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.path={}", storage.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--cluster.listen-address="),
            &dir.join("alertmanager.log"),
        );
        eventually("alertmanager to be ready", Duration::from_secs(30), || {
            proc.assert_running();
            http(port, "GET", "/-/ready", "").filter(|(status, _)| *status == 200)
        });
        Alertmanager {
            proc,
            port,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    /// GET /api/v2/alerts: the alerts it holds.
    pub fn alerts(&mut self) -> Vec<Value> {
        self.proc.assert_running();
        let (status, body) = http(self.port, "GET", "/api/v2/alerts", "").unwrap();
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

/// The kernel's audit `enabled` flag now (`auditctl -s`).
fn audit_enabled() -> Option<String> {
    let out = Command::new("auditctl").arg("-s").output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("enabled ").map(str::to_owned))
}

/// `auditd -n` with its log in `dir` and no plugins. The kernel has one audit daemon:
/// run one such test at a time. Dropping it stops the daemon with SIGTERM, deletes
/// every audit rule and puts the kernel's `enabled` flag back as it was.
pub struct Auditd {
    proc: Option<Proc>,
    pub log: PathBuf,
    enabled_before: Option<String>,
}

impl Auditd {
    pub fn start(dir: &Path) -> Auditd {
        let conf_dir = dir.join("auditd");
        std::fs::create_dir_all(conf_dir.join("plugins.d")).unwrap();
        let log = dir.join("audit.log");
        let conf = format!(
            "local_events = yes\nwrite_logs = yes\nlog_file = {log}\nlog_format = ENRICHED\n\
             flush = INCREMENTAL_ASYNC\nfreq = 1\nmax_log_file = 8\nnum_logs = 2\n\
             max_log_file_action = ROTATE\nspace_left = 2\nspace_left_action = IGNORE\n\
             admin_space_left = 1\nadmin_space_left_action = IGNORE\n\
             disk_full_action = IGNORE\ndisk_error_action = IGNORE\nq_depth = 2000\n\
             overflow_action = IGNORE\nplugin_dir = {plugins}\nend_of_event_timeout = 2\n",
            log = log.display(),
            plugins = conf_dir.join("plugins.d").display(),
        );
        let conf_path = conf_dir.join("auditd.conf");
        std::fs::write(&conf_path, conf).unwrap();
        // auditd refuses a configuration others can write.
        std::fs::set_permissions(
            &conf_path,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        let enabled_before = audit_enabled();
        let mut proc = Proc::spawn(
            "auditd",
            Command::new("/usr/sbin/auditd")
                .arg("-n")
                .arg("-c")
                .arg(&conf_dir),
            &dir.join("auditd.stderr"),
        );
        proc.terminate = true;
        eventually("auditd to start its log", Duration::from_secs(20), || {
            proc.assert_running();
            std::fs::read_to_string(&log)
                .ok()
                .filter(|t| t.contains("type=DAEMON_START"))
                .map(|_| ())
        });
        Auditd {
            proc: Some(proc),
            log,
            enabled_before,
        }
    }

    /// The log so far.
    pub fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Auditd {
    fn drop(&mut self) {
        drop(self.proc.take());
        let _ = Command::new("auditctl").arg("-D").output();
        if let Some(e) = &self.enabled_before {
            let _ = Command::new("auditctl").args(["-e", e]).output();
        }
    }
}

/// `sshd -D` on 127.0.0.1 with a host key of its own, PAM on, keys only.
pub struct Sshd {
    proc: Proc,
    pub port: u16,
}

impl Sshd {
    pub fn start(dir: &Path) -> Sshd {
        let port = free_port();
        let host_key = dir.join("ssh_host_ed25519_key");
        keygen(&host_key);
        // Privilege separation needs its empty directory.
        std::fs::create_dir_all("/run/sshd").unwrap();
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nUsePAM yes\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PubkeyAuthentication yes\nAuthorizedKeysFile .ssh/authorized_keys\n\
                 PidFile {}\n",
                host_key.display(),
                dir.join("sshd.pid").display()
            ),
        )
        .unwrap();
        let mut proc = Proc::spawn(
            "sshd",
            Command::new("/usr/sbin/sshd")
                .args(["-D", "-e", "-f"])
                .arg(&config),
            &dir.join("sshd.log"),
        );
        eventually("sshd to listen", Duration::from_secs(20), || {
            proc.assert_running();
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        });
        Sshd { proc, port }
    }
}

/// An ed25519 key pair without a passphrase at `path` (and `path`.pub).
fn keygen(path: &Path) {
    let status = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// A local user that logs in with a key and may sudo `sudo_command` without a
/// password; removed (home, sudoers line) when dropped.
pub struct ThrowawayUser {
    pub name: String,
    key: PathBuf,
    sudoers: PathBuf,
}

impl ThrowawayUser {
    pub fn create(dir: &Path, name: &str, sudo_command: &str) -> ThrowawayUser {
        // A leftover from a killed run goes first.
        let _ = Command::new("userdel").args(["-r", name]).output();
        let out = Command::new("useradd")
            .args(["-m", "-s", "/bin/sh", name])
            .output()
            .unwrap();
        assert!(out.status.success(), "useradd: {out:?}");
        let home = PathBuf::from(format!("/home/{name}"));
        let key = dir.join(format!("{name}-key"));
        keygen(&key);
        std::fs::create_dir_all(home.join(".ssh")).unwrap();
        std::fs::copy(key.with_extension("pub"), home.join(".ssh/authorized_keys")).unwrap();
        let chown = Command::new("chown")
            .args(["-R", &format!("{name}:{name}")])
            .arg(home.join(".ssh"))
            .status()
            .unwrap();
        assert!(chown.success());
        let sudoers = PathBuf::from(format!("/etc/sudoers.d/{name}"));
        std::fs::write(
            &sudoers,
            format!("{name} ALL=(root) NOPASSWD: {sudo_command}\n"),
        )
        .unwrap();
        std::fs::set_permissions(
            &sudoers,
            std::os::unix::fs::PermissionsExt::from_mode(0o440),
        )
        .unwrap();
        ThrowawayUser {
            name: name.to_owned(),
            key,
            sudoers,
        }
    }

    /// `ssh -p port name@127.0.0.1 command`, with the user's key, trusting any host key.
    pub fn ssh(&self, port: u16, command: &str) -> Output {
        Command::new("ssh")
            .arg("-i")
            .arg(&self.key)
            .args([
                "-p",
                &port.to_string(),
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=10",
                &format!("{}@127.0.0.1", self.name),
                command,
            ])
            .output()
            .unwrap()
    }
}

impl Drop for ThrowawayUser {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.sudoers);
        let _ = Command::new("userdel").args(["-r", &self.name]).output();
    }
}
