//! Real etcd for tests: one member or a cluster of three on loopback ports picked by binding
//! port 0, data in a temporary directory, every process killed by PID when the guard drops.
//! Also a TCP proxy that can cut a client off from etcd, and a small PKI for mutual TLS.
//!
//! Self-contained (it uses only std, tokio, rustix, rcgen, tempfile and the crate's public
//! API) so the measurement example includes it with `#[path]`.

#![allow(dead_code)]

use std::io::Read as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use probity_etcd::{EtcdClient, EtcdConfig, TlsConfig};
use rustix::process::{Pid, Signal, kill_process};

/// The etcd server binary (Debian's etcd-server).
pub const ETCD: &str = "/usr/bin/etcd";

/// How long a cluster may take to become healthy.
const HEALTH_DEADLINE: Duration = Duration::from_secs(30);
/// How long a member may take to exit after a signal before it is killed.
const EXIT_DEADLINE: Duration = Duration::from_secs(10);
/// Pause between polls.
pub const POLL: Duration = Duration::from_millis(20);

static TOKEN: AtomicU64 = AtomicU64::new(0);

/// Polls `f` every [`POLL`] until it returns `Some`, or panics with `what` after `deadline`.
pub async fn eventually<T, F, Fut>(deadline: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < end, "not within {deadline:?}: {what}");
        tokio::time::sleep(POLL).await;
    }
}

/// Server-side TLS files for etcd's client listener.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// One etcd member.
#[derive(Debug)]
pub struct Member {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    child: Option<Child>,
}

impl Member {
    /// Its client URL.
    pub fn url(&self, tls: bool) -> String {
        let scheme = if tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Its PID while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The last `n` bytes of its log, for failure messages.
    pub fn log_tail(&self, n: u64) -> String {
        let Ok(mut f) = std::fs::File::open(&self.log) else {
            return String::new();
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(len.saturating_sub(n)));
        let mut s = String::new();
        let _ = f.read_to_string(&mut s);
        s
    }
}

/// A running etcd: one member or a cluster. Dropping it kills every member by PID and
/// removes the data.
pub struct Etcd {
    pub members: Vec<Member>,
    pub token: String,
    pub tls: Option<ServerTls>,
    dir: tempfile::TempDir,
}

impl Etcd {
    /// One member.
    pub fn single() -> Self {
        Self::start_new(1, None)
    }

    /// Three members.
    pub fn cluster() -> Self {
        Self::start_new(3, None)
    }

    /// One member whose client listener demands a client certificate signed by `tls.ca`.
    pub fn single_tls(tls: ServerTls) -> Self {
        Self::start_new(1, Some(tls))
    }

    fn start_new(count: usize, tls: Option<ServerTls>) -> Self {
        // In memory where there is one: on a disk that the rest of the machine keeps
        // busy, etcd's fsync outlasted the tests' 2 s request timeout, and the retried
        // put (puts are retried by design) was then applied twice.
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .expect("temp dir");
        let token = format!(
            "probity-etcd-test-{}-{}",
            std::process::id(),
            TOKEN.fetch_add(1, Ordering::Relaxed)
        );
        // Bind every port first, then release them together, so no two members get the
        // same one.
        let listeners: Vec<TcpListener> = (0..count * 2)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind port 0"))
            .collect();
        let ports: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().expect("local addr").port())
            .collect();
        drop(listeners);
        let members = (0..count)
            .map(|i| {
                let name = format!("m{i}");
                Member {
                    data_dir: dir.path().join(format!("{name}.etcd")),
                    log: dir.path().join(format!("{name}.log")),
                    name,
                    client_port: ports[2 * i],
                    peer_port: ports[2 * i + 1],
                    child: None,
                }
            })
            .collect();
        let mut etcd = Self {
            members,
            token,
            tls,
            dir,
        };
        for i in 0..count {
            etcd.start(i);
        }
        etcd
    }

    /// The directory holding data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts (or restarts, with its data) member `i`.
    pub fn start(&mut self, i: usize) {
        let initial_cluster = self.initial_cluster();
        let tls = self.tls.clone();
        let token = self.token.clone();
        let m = &mut self.members[i];
        assert!(m.child.is_none(), "{} is already running", m.name);
        let client_url = m.url(tls.is_some());
        let peer_url = format!("http://127.0.0.1:{}", m.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("log file");
        let mut cmd = Command::new(ETCD);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-token", &token])
            .args(["--initial-cluster-state", "new"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log clone"))
            .stderr(log);
        if let Some(tls) = &tls {
            cmd.arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth");
        }
        m.child = Some(cmd.spawn().expect("spawn /usr/bin/etcd"));
    }

    /// Stops member `i` with `signal` (SIGTERM: graceful; SIGKILL: crash) and waits for it
    /// to exit; a member that ignores SIGTERM past the deadline is killed.
    pub fn stop(&mut self, i: usize, signal: Signal) {
        let m = &mut self.members[i];
        let Some(mut child) = m.child.take() else {
            return;
        };
        let _ = kill_process(Pid::from_child(&child), signal);
        let end = Instant::now() + EXIT_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < end => std::thread::sleep(POLL),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
            }
        }
    }

    /// Whether member `i` runs.
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].child.is_some()
    }

    /// Client URLs of every member.
    pub fn endpoints(&self) -> Vec<String> {
        let tls = self.tls.is_some();
        self.members.iter().map(|m| m.url(tls)).collect()
    }

    /// A configuration for every member, with timeouts suited to tests on loopback.
    pub fn config(&self) -> EtcdConfig {
        EtcdConfig::new(self.endpoints())
            .with_connect_timeout(Duration::from_millis(500))
            .with_request_timeout(Duration::from_secs(2))
            .with_retry_budget(Duration::from_secs(10))
            .with_progress_interval(Duration::from_millis(200))
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1))
    }

    /// A client for every member, under `prefix`.
    pub async fn client(&self, prefix: &str) -> EtcdClient {
        EtcdClient::connect(self.config().with_prefix(prefix))
            .await
            .expect("client")
    }

    /// A client for member `i` alone.
    pub async fn member_client(&self, i: usize, tls: Option<TlsConfig>) -> EtcdClient {
        let mut config = self.config();
        config.endpoints = vec![self.members[i].url(self.tls.is_some())];
        if let Some(tls) = tls {
            config = config.with_tls(tls);
        }
        EtcdClient::connect(config).await.expect("client")
    }

    /// Waits until every running member answers and all agree on one leader; returns the
    /// leader's index.
    pub async fn wait_healthy(&self, tls: Option<TlsConfig>) -> usize {
        let mut clients = Vec::new();
        for (i, _) in self.members.iter().enumerate() {
            if self.is_running(i) {
                clients.push((i, self.member_client(i, tls.clone()).await));
            }
        }
        let end = Instant::now() + HEALTH_DEADLINE;
        loop {
            let mut leaders = Vec::new();
            let mut ids = Vec::new();
            for (i, c) in &clients {
                let url = self.members[*i].url(self.tls.is_some());
                if let Ok(s) = c.member_status(&url).await {
                    leaders.push(s.leader);
                    ids.push((*i, s.member_id));
                }
            }
            if leaders.len() == clients.len()
                && leaders[0] != 0
                && leaders.iter().all(|l| *l == leaders[0])
                && let Some((i, _)) = ids.iter().find(|(_, id)| *id == leaders[0])
            {
                return *i;
            }
            if Instant::now() >= end {
                let logs: Vec<String> = self
                    .members
                    .iter()
                    .map(|m| format!("--- {} ---\n{}", m.name, m.log_tail(3000)))
                    .collect();
                panic!(
                    "etcd not healthy within {HEALTH_DEADLINE:?}\n{}",
                    logs.join("\n")
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The PID of member `i`'s process, read from /proc for CPU accounting.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].pid()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i, Signal::KILL);
        }
    }
}

/// CPU time (user + system) a process has used, from /proc/<pid>/stat, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

// ---------------------------------------------------------------- proxy

/// A TCP proxy in front of one etcd member, which a test can cut and restore to simulate a
/// network partition between a client and etcd.
pub struct Proxy {
    pub addr: SocketAddr,
    cut: Arc<tokio::sync::watch::Sender<bool>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `target` on a free loopback port.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (cut, _) = tokio::sync::watch::channel(false);
        let cut = Arc::new(cut);
        let accept_cut = cut.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                if *accept_cut.borrow() {
                    // Cut: accept and drop at once, as a partitioned peer would reset.
                    drop(inbound);
                    continue;
                }
                let mut cut_rx = accept_cut.subscribe();
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let forward = async {
                        tokio::select! {
                            _ = tokio::io::copy(&mut ri, &mut wo) => {}
                            _ = tokio::io::copy(&mut ro, &mut wi) => {}
                        }
                    };
                    tokio::select! {
                        () = forward => {}
                        _ = cut_rx.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Self { addr, cut, task }
    }

    /// The proxy's URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

// ---------------------------------------------------------------- PKI

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as files.
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A client certificate from another CA.
    pub stranger_cert: PathBuf,
    pub stranger_key: PathBuf,
}

impl Pki {
    pub fn new(dir: &Path) -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair,
        };
        let ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let cert = params.self_signed(&key).unwrap();
            (cert.pem(), Issuer::new(params, key))
        };
        let leaf = |issuer: &Issuer<'static, KeyPair>, cn: &str, sans: &[&str], usage| {
            let key = KeyPair::generate().unwrap();
            let mut params =
                CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                    .unwrap();
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let write = |name: &str, pem: &str| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let (ca_pem, issuer) = ca("probity-etcd-test-ca");
        let (server_pem, server_key) = leaf(
            &issuer,
            "etcd",
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_pem, client_key) = leaf(
            &issuer,
            "probity",
            &["probity.test"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let (_, other) = ca("someone-else");
        let (stranger_pem, stranger_key) = leaf(
            &other,
            "stranger",
            &["stranger.test"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        Self {
            ca: write("ca.pem", &ca_pem),
            server_cert: write("server.pem", &server_pem),
            server_key: write("server.key", &server_key),
            client_cert: write("client.pem", &client_pem),
            client_key: write("client.key", &client_key),
            stranger_cert: write("stranger.pem", &stranger_pem),
            stranger_key: write("stranger.key", &stranger_key),
        }
    }

    /// The server side, for [`Etcd::single_tls`].
    pub fn server(&self) -> ServerTls {
        ServerTls {
            ca: self.ca.clone(),
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
        }
    }

    /// A client configuration with the client certificate.
    pub fn client(&self) -> TlsConfig {
        TlsConfig::from_ca_file(&self.ca)
            .unwrap()
            .with_client_identity_files(&self.client_cert, &self.client_key)
            .unwrap()
    }
}
