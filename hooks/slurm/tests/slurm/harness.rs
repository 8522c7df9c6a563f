//! What every Slurm test stands on besides Slurm: Probity's sidecar (its Unix socket
//! for the hooks, TLS for the controller) on the test's policies and facts, etcd for
//! the controller's lease and state, and the hooks' wrappers with the test's paths.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use serde_json::Value;

use crate::slurm_cluster::{Proc, eventually, free_port};

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `probity` binary: `$PROBITY_BIN`, else the one this build made beside the test.
pub fn probity_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("PROBITY_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("probity");
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build -p probity-cli)",
        path.display()
    );
    path
}

/// Writes an executable script.
pub fn script(path: &Path, body: &str) -> PathBuf {
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_owned()
}

/// The test CA and the certificates it signed.
pub struct Pki {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(dir: &Path) -> Pki {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "probity slurm test CA");
        let pem = params.self_signed(&key).unwrap().pem();
        std::fs::write(dir.join("ca.crt"), pem).unwrap();
        Pki {
            dir: dir.to_owned(),
            issuer: Issuer::new(params, key),
        }
    }

    /// `<name>.crt` and `<name>.key` for `cn`, valid for `sans`.
    pub fn issue(&self, name: &str, cn: &str, sans: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (crt, key_path) = (
            self.dir.join(format!("{name}.crt")),
            self.dir.join(format!("{name}.key")),
        );
        std::fs::write(&crt, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (crt, key_path)
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
}

/// Probity's sidecar on the repository's policies and `testdata/entities/slurm-cluster.json`
/// (node1 and node2 in zone-a, node3 in zone-rlhf), on a Unix socket where `uid:0` (the
/// test, the hooks) is an admin, and on TLS for the controller.
pub struct Sidecar {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub port: u16,
    pub state_dir: PathBuf,
    pub data_dir: PathBuf,
    pub pki: Pki,
    config: PathBuf,
    /// The policy set it serves.
    pub policies: PathBuf,
    proc: Option<Proc>,
}

impl Sidecar {
    /// Started in `dir`, its `[slurm]` section `slurm` (TOML lines).
    pub fn start(dir: &Path, slurm: &str) -> Sidecar {
        let dir = dir.join("probity");
        std::fs::create_dir_all(&dir).unwrap();
        let pki = Pki::new(&dir);
        let (crt, key) = pki.issue("server", "probity", &["127.0.0.1", "localhost"]);
        let state_dir = dir.join("state");
        let data_dir = dir.join("data");
        std::fs::create_dir_all(&state_dir).unwrap();
        std::fs::set_permissions(&state_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::create_dir_all(&data_dir).unwrap();
        std::fs::copy(
            root().join("testdata/integrity/signer-public-key.hex"),
            state_dir.join("trusted.pub"),
        )
        .unwrap();
        let socket = dir.join("probity.sock");
        let port = free_port();
        let config = dir.join("probity-server.toml");
        std::fs::write(
            &config,
            format!(
                "[integrity]\ndata_roots = [{data_dir:?}]\n\
                 [server]\nsocket = {socket:?}\nlisten = \"127.0.0.1:{port}\"\n\
                 tls_cert = {crt:?}\ntls_key = {key:?}\nclient_ca = {ca:?}\n\
                 client_auth = \"optional\"\n\
                 [auth.groups]\nadmins = [\"uid:0\"]\n\
                 event-recorders = [\"cn:probity-controller\"]\n\
                 [slurm]\n{slurm}\n",
                ca = pki.ca_file(),
            ),
        )
        .unwrap();
        let mut sidecar = Sidecar {
            dir,
            socket,
            port,
            state_dir,
            data_dir,
            pki,
            config,
            policies: root().join("policies"),
            proc: None,
        };
        sidecar.restart();
        sidecar
    }

    /// Starts it again (after `stop`) on the same socket and state.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "the sidecar is running");
        let _ = std::fs::remove_file(&self.socket);
        let mut proc = Proc::spawn(
            "probity serve",
            Command::new(probity_bin())
                .arg("serve")
                .arg("--config")
                .arg(&self.config)
                .arg("--policies")
                .arg(&self.policies)
                .arg("--entities")
                .arg(root().join("testdata/entities/slurm-cluster.json"))
                .arg("--state-dir")
                .arg(&self.state_dir),
            &self.dir.join("probity.log"),
        );
        proc.grace = Duration::from_secs(5);
        self.proc = Some(proc);
        eventually("the sidecar's /readyz", Duration::from_secs(60), || {
            if let Some(p) = self.proc.as_mut() {
                p.assert_running();
            }
            let (status, _) = self.call("GET", "/readyz", "").ok()?;
            (status == 200).then_some(())
        });
    }

    /// Restarts it on a copy of the policies whose probity.toml gains `lines` (a
    /// `[modes]` table); the copy lives in the sidecar's directory.
    pub fn restart_with_policy_lines(&mut self, lines: &str) {
        let copy = self.dir.join("policies");
        copy_dir(&root().join("policies"), &copy);
        let toml = copy.join("probity.toml");
        let mut text = std::fs::read_to_string(&toml).unwrap();
        text.push_str(lines);
        std::fs::write(&toml, text).unwrap();
        self.stop();
        self.policies = copy;
        self.restart();
    }

    /// Stops it by PID.
    pub fn stop(&mut self) {
        self.proc = None;
    }

    /// One request on the Unix socket (as uid 0, an admin): the status and the body.
    pub fn call(&self, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
        crate::unix_http::unix_http(&self.socket, method, path, body)
    }

    /// A JSON call that must answer 200. A GET sends no body: the server answers a GET
    /// without reading one and closes, and unread bytes make the kernel reset the
    /// connection, sometimes before the answer is read (seen in CI as "Connection reset").
    pub fn json(&self, method: &str, path: &str, body: &Value) -> Value {
        let body = if method == "GET" {
            String::new()
        } else {
            body.to_string()
        };
        let (status, text) = self.call(method, path, &body).unwrap();
        assert_eq!(status, 200, "{method} {path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    /// Blocks `node` through the API, as an operator would.
    pub fn block(&self, node: &str, reason: &str) {
        self.json(
            "POST",
            &format!("/v1/nodes/{node}/block"),
            &serde_json::json!({ "reason": reason }),
        );
    }

    /// Unblocks `node` (a request without a body: the route reads none, and a body
    /// left unread when the server closes resets the connection).
    pub fn unblock(&self, node: &str) {
        let (status, text) = self
            .call("POST", &format!("/v1/nodes/{node}/unblock"), "")
            .unwrap();
        assert_eq!(status, 200, "unblock {node}: {text}");
    }

    /// Stops the sidecar and reads its event log: `(kind, object, node, detail)`,
    /// oldest first.
    pub fn stop_and_read_events(&mut self) -> Vec<(String, String, String, String)> {
        self.stop();
        let store = probity::state::StateStore::open(&self.state_dir).unwrap();
        probity::state::LocalLog::events(&store, 0)
            .unwrap()
            .into_iter()
            .map(|e| (e.kind, e.object_id, e.node.unwrap_or_default(), e.detail))
            .collect()
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Real etcd (Debian's etcd-server) on loopback ports, in `dir`.
pub struct Etcd {
    pub endpoint: String,
    _proc: Proc,
}

impl Etcd {
    pub fn start(dir: &Path) -> Etcd {
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut proc = Proc::spawn(
            "etcd",
            Command::new("/usr/bin/etcd")
                .arg("--data-dir")
                .arg(dir.join("etcd"))
                .args(["--name", "default"])
                .args(["--listen-client-urls", &endpoint])
                .args(["--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("default={peer_url}")])
                .args(["--unsafe-no-fsync"]),
            &dir.join("etcd.log"),
        );
        proc.grace = Duration::from_secs(5);
        let port = client;
        let mut etcd = Etcd {
            endpoint,
            _proc: proc,
        };
        eventually("etcd /health", Duration::from_secs(30), || {
            etcd._proc.assert_running();
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).ok()?;
            text.contains("\"health\":\"true\"").then_some(())
        });
        etcd
    }
}

/// The Prolog Slurm runs: the shipped `dist/prolog` with the test's binary, socket and
/// `SLURM_CONF` (Slurm gives a Prolog no PATH), its own time appended to `timing`.
pub fn prolog_wrapper(dir: &Path, sidecar: &Sidecar, conf: &Path, timing: &Path) -> PathBuf {
    script(
        &dir.join("prolog"),
        &format!(
            "export SLURM_CONF={conf}\nexec {probity} slurm prolog --socket {socket} \
             --timeout-ms 5000 --job-refusal requeue-hold --on-error drain \
             --slurm-bin /usr/bin --timing-log {timing}",
            conf = conf.display(),
            probity = probity_bin().display(),
            socket = sidecar.socket.display(),
            timing = timing.display(),
        ),
    )
}

/// The shipped job_submit.lua, as slurmctld loads it.
pub fn job_submit_lua() -> String {
    std::fs::read_to_string(root().join("hooks/slurm/dist/job_submit.lua")).unwrap()
}

/// slurmctld's environment for job_submit.lua: the test's binary and socket.
pub fn lua_env(sidecar: &Sidecar, timeout_ms: u32) -> Vec<(String, String)> {
    vec![
        ("PROBITY_BIN".into(), probity_bin().display().to_string()),
        (
            "PROBITY_SOCKET".into(),
            sidecar.socket.display().to_string(),
        ),
        ("PROBITY_TIMEOUT_MS".into(), timeout_ms.to_string()),
    ]
}
