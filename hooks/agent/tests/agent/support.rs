//! What the tests share: a fake node (tool doubles printing fixture files, a powercap
//! tree, a proc root, a DCGM exporter on loopback), Alertmanager and a webhook recorder on
//! loopback, and processes stopped by PID.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use probity::{Engine, ManualClock};
use probity_agent::alerts::AlertSinks;
use probity_agent::{Agent, Config, HostSources};
use serde_json::{Value, json};

/// The repository's testdata/fixtures/<area>/<name>.
pub fn fixture_path(area: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(area)
        .join(name)
}

pub fn fixture(area: &str, name: &str) -> Vec<u8> {
    let p = fixture_path(area, name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Writes an executable shell script and returns its path.
pub fn script(path: &Path, body: &str) {
    // Write to a new inode and rename, so a running copy never sees a half-written file
    // (and exec never meets ETXTBSY).
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Extracts a ttar archive (prometheus/procfs's fixture format) under `dest`.
pub fn extract_ttar(archive: &[u8], dest: &Path) {
    let text = std::str::from_utf8(archive).unwrap();
    let mut lines = text.lines();
    let mut current: Option<PathBuf> = None;
    while let Some(line) = lines.next() {
        if let Some(dir) = line.strip_prefix("Directory: ") {
            std::fs::create_dir_all(dest.join(dir)).unwrap();
            current = Some(dest.join(dir));
        } else if let Some(path) = line.strip_prefix("Path: ") {
            let count: usize = lines
                .next()
                .and_then(|l| l.strip_prefix("Lines: "))
                .unwrap()
                .parse()
                .unwrap();
            let mut content = String::new();
            for _ in 0..count {
                content.push_str(lines.next().unwrap());
                content.push('\n');
            }
            let p = dest.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, content).unwrap();
            current = Some(p);
        } else if let Some(mode) = line.strip_prefix("Mode: ") {
            let mode = u32::from_str_radix(mode, 8).unwrap();
            if let Some(p) = &current {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
            }
        }
    }
}

pub use crate::services::{Alertmanager, eventually};

/// What the tests ask Alertmanager.
pub trait ActiveNames {
    /// The alert names active now, sorted (`listen` ones with their subject).
    fn active_names(&mut self) -> Vec<String>;
}

impl ActiveNames for Alertmanager {
    fn active_names(&mut self) -> Vec<String> {
        let mut names: Vec<String> = self
            .alerts()
            .iter()
            .filter(|a| a["status"]["state"] == "active")
            .map(|a| {
                let l = &a["labels"];
                match l.get("subject").and_then(Value::as_str) {
                    Some(s) if l["action"] == "listen" => {
                        format!("{} {s}", l["alertname"].as_str().unwrap())
                    }
                    _ => l["alertname"].as_str().unwrap().to_owned(),
                }
            })
            .collect();
        names.sort();
        names
    }
}

/// Reads one HTTP/1.1 request (head and a Content-Length body) from `conn`.
fn read_request(conn: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut reader = BufReader::new(conn.try_clone().ok()?);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// An HTTP server on loopback: answers every GET with the current `body` and records
/// every POSTed body. It stops with the test process.
pub struct HttpStub {
    pub url: String,
    body: Arc<Mutex<Vec<u8>>>,
    posted: Arc<Mutex<Vec<Value>>>,
}

impl HttpStub {
    pub fn start(body: Vec<u8>) -> HttpStub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let body = Arc::new(Mutex::new(body));
        let posted = Arc::new(Mutex::new(Vec::new()));
        let (b, p) = (Arc::clone(&body), Arc::clone(&posted));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                while let Some((head, req)) = read_request(&mut conn) {
                    let reply = if head.starts_with("POST") {
                        if let Ok(v) = serde_json::from_slice(&req) {
                            p.lock().unwrap().push(v);
                        }
                        Vec::new()
                    } else {
                        b.lock().unwrap().clone()
                    };
                    let mut out = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
                        reply.len()
                    )
                    .into_bytes();
                    out.extend(reply);
                    if conn.write_all(&out).is_err() {
                        break;
                    }
                }
            }
        });
        HttpStub { url, body, posted }
    }

    pub fn set_body(&self, body: Vec<u8>) {
        *self.body.lock().unwrap() = body;
    }

    pub fn posted(&self) -> Vec<Value> {
        self.posted.lock().unwrap().clone()
    }
}

/// A fake 8-GPU node under a temporary directory: tool doubles that print files the
/// test rewrites, a powercap tree, a proc root, a DCGM exporter.
pub struct FakeNode {
    pub dir: tempfile::TempDir,
    pub dcgm: HttpStub,
}

pub const NODE: &str = "gpu-node-07";
/// The engine's (and so the agent's) clock at the start of each test.
pub const T0: i64 = 1_800_000_000;

/// A TCP table line for a listener on `addr:port` (x86 word order).
pub fn tcp_listener(slot: usize, addr: [u8; 4], port: u16, inode: u64) -> String {
    let a = u32::from_le_bytes(addr);
    format!(
        "{slot:>4}: {a:08X}:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )
}

pub const TCP_HEADER: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";

impl FakeNode {
    pub fn new() -> FakeNode {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir_all(p.join("bin")).unwrap();
        std::fs::create_dir_all(p.join("data")).unwrap();
        std::fs::create_dir_all(p.join("proc/net")).unwrap();
        extract_ttar(
            &fixture("rapl", "own-2socket-dram-psys-mmio.ttar"),
            &p.join("rapl"),
        );
        let dcgm = HttpStub::start(fixture("dcgm", "own-8gpu-mig-mixed-labels.prom"));
        let node = FakeNode { dir, dcgm };
        node.write(
            "data/smi.csv",
            &fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"),
        );
        node.set_dcmi_watts(3000);
        node.write(
            "proc/stat",
            b"cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 5 0 5 50 0 0 0 0 0 0\ncpu1 5 0 5 50 0 0 0 0 0 0\nintr 1\n",
        );
        node.set_listeners(&[
            ([0, 0, 0, 0], 22),
            ([0, 0, 0, 0], 10250),
            ([127, 0, 0, 1], 9400),
        ]);
        node.set_nft_open(&[22]);
        for tool in ["nvidia-smi", "ipmitool", "nft"] {
            node.tool_prints(tool);
        }
        node
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn write(&self, rel: &str, bytes: &[u8]) {
        let p = self.path(rel);
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    }

    /// The tool prints its data file (whatever its arguments).
    pub fn tool_prints(&self, tool: &str) {
        let data = self.path(&format!("data/{tool}.out"));
        let body = match tool {
            "nvidia-smi" => format!("exec cat {}", self.path("data/smi.csv").display()),
            _ => format!("exec cat {}", data.display()),
        };
        script(&self.path(&format!("bin/{tool}")), &body);
    }

    /// The tool fails with `message` on stderr and status 1.
    pub fn tool_fails(&self, tool: &str, message: &str) {
        script(
            &self.path(&format!("bin/{tool}")),
            &format!("echo '{message}' >&2\nexit 1"),
        );
    }

    pub fn set_dcmi_watts(&self, watts: u32) {
        let text = format!(
            "\n    Instantaneous power reading:                  {watts} Watts\n    Minimum during sampling period:                 62 Watts\n    Maximum during sampling period:               {watts} Watts\n    Average power reading over sample period:     {watts} Watts\n    IPMI timestamp:                           07/26/26 16:57:12 CDT    Sampling period:                          00000005 Seconds.\n    Power reading state is:                   activated\n\n"
        );
        self.write("data/ipmitool.out", text.as_bytes());
    }

    /// `/proc/net/tcp` with these listeners.
    pub fn set_listeners(&self, listeners: &[([u8; 4], u16)]) {
        let mut t = TCP_HEADER.to_owned();
        for (i, (addr, port)) in listeners.iter().enumerate() {
            t.push_str(&tcp_listener(i, *addr, *port, 20_000 + i as u64));
        }
        self.write("proc/net/tcp", t.as_bytes());
    }

    /// An `nft -j list ruleset` with an input chain that drops all but established
    /// traffic, the given TCP ports from anywhere, kubelet from 10.0.0.0/8 and VXLAN.
    pub fn set_nft_open(&self, tcp: &[u16]) {
        let rule = |handle: u32, expr: Value| json!({"rule": {"family": "inet", "table": "filter", "chain": "input", "handle": handle, "expr": expr}});
        let dport = |proto: &str, right: Value| json!({"match": {"op": "==", "left": {"payload": {"protocol": proto, "field": "dport"}}, "right": right}});
        let mut items = vec![
            json!({"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}),
            json!({"table": {"family": "inet", "name": "filter", "handle": 1}}),
            json!({"chain": {"family": "inet", "table": "filter", "name": "input", "handle": 1, "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}}),
            rule(
                2,
                json!([{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}}, {"accept": null}]),
            ),
            rule(
                3,
                json!([{"match": {"op": "==", "left": {"meta": {"key": "iif"}}, "right": "lo"}}, {"accept": null}]),
            ),
            rule(
                4,
                json!([{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.0.0.0", "len": 8}}}}, dport("tcp", json!(10250)), {"accept": null}]),
            ),
            rule(5, json!([dport("udp", json!(8472)), {"accept": null}])),
        ];
        if !tcp.is_empty() {
            items.push(rule(
                6,
                json!([dport("tcp", json!({"set": tcp})), {"accept": null}]),
            ));
        }
        let doc = json!({"nftables": items});
        self.write("data/nft.out", doc.to_string().as_bytes());
    }

    /// The agent's configuration for this node, with `extra` appended.
    pub fn config(&self, alerts: &str, extra: &str) -> Config {
        let p = |rel: &str| self.path(rel).display().to_string();
        let text = format!(
            r#"
[node]
name = "{NODE}"
[inventory]
zone = "z1"
rack = "r7"
role = "gpu-worker"
gpu_node = true
cuda_image = "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"
[nvidia_smi]
binary = "{smi}"
timeout_ms = 5000
[dcgm]
url = "{dcgm}/metrics"
[rapl]
root = "{rapl}"
[ipmi]
binary = "{ipmi}"
timeout_ms = 5000
[proc]
root = "{proc}"
[firewall]
nft = "{nft}"
read_iptables = false
[alerts]
{alerts}
{extra}
"#,
            smi = p("bin/nvidia-smi"),
            dcgm = self.dcgm.url,
            rapl = p("rapl/fixtures/sys/class/powercap"),
            ipmi = p("bin/ipmitool"),
            proc = p("proc"),
            nft = p("bin/nft"),
        );
        Config::parse("test-agent.toml", &text, self.dir.path()).unwrap()
    }
}

/// The cluster the node belongs to, and two users.
pub fn cluster_entities(alice_authorized: bool) -> Value {
    json!([
        {"uid": {"type": "Cluster", "id": "onprem"}, "attrs": {"gpusTotal": 64, "gpusAllocated": 8}, "parents": []},
        {"uid": {"type": "Zone", "id": "z1"}, "parents": [{"type": "Cluster", "id": "onprem"}],
         "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}}, "powerDrawW": 20000, "powerCeilingW": 100000}},
        {"uid": {"type": "User", "id": "alice"}, "attrs": {"elevationAuthorized": alice_authorized}, "parents": []},
        {"uid": {"type": "User", "id": "bob"}, "attrs": {"elevationAuthorized": true}, "parents": []},
    ])
}

/// An engine with the embedded policies, a manual clock at [`T0`], the cluster loaded,
/// and the state store of `state` attached when given.
pub fn engine(state: Option<&Path>, alice_authorized: bool) -> (Engine, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::at(T0));
    let engine = Engine::defaults()
        .clock(Arc::clone(&clock) as Arc<dyn probity::Clock>)
        .build()
        .unwrap();
    if let Some(dir) = state {
        let store = probity::state::StateStore::open(dir).unwrap();
        engine.attach_state(Arc::new(store)).unwrap();
    }
    engine
        .upsert_entities(&cluster_entities(alice_authorized))
        .unwrap();
    (engine, clock)
}

/// An agent on the fake node with the real sources, the alert sinks the config names.
pub fn agent(config: Config, engine: Engine) -> Agent {
    let sources = Box::new(HostSources::new(&config));
    let alerts = AlertSinks::from_config(&config.alerts).unwrap();
    Agent::with_parts(config, engine, sources, alerts).unwrap()
}
