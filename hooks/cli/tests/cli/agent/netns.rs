//! A network namespace per test (copied, trimmed, from probity-firewall's test harness):
//! joined to the root namespace by a veth pair with an IPv4 /30 and an IPv6 ULA /64,
//! with listeners and sshd inside. Everything it starts it stops by PID, and the
//! namespace is deleted on drop.

use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

static NEXT: AtomicU32 = AtomicU32::new(0);

pub const IP: &str = "/usr/sbin/ip";
const PYTHON: &str = "/usr/bin/python3";
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1500);

/// Binds TCP ports on both families and answers "ok"; prints "ready" once bound.
const LISTENER: &str = r#"
import selectors, socket, sys
tcp = [int(p) for p in sys.argv[1].split(",") if p]
sel = selectors.DefaultSelector()
for fam, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    for p in tcp:
        s = socket.socket(fam, socket.SOCK_STREAM)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, p)); s.listen(64); sel.register(s, selectors.EVENT_READ)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        c, _ = key.fileobj.accept(); c.sendall(b"ok"); c.close()
"#;

pub struct Netns {
    pub name: String,
    host_if: String,
    ns_if: String,
    pub ns_v4: Ipv4Addr,
    pub ns_v6: Ipv6Addr,
    children: Vec<Child>,
    _keys: Option<tempfile::TempDir>,
}

fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

impl Netns {
    pub fn new() -> Netns {
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        assert!(n < 32, "more namespaces than address slots");
        // Another slice of 10.128.0.0/9 than probity-firewall's tests use.
        let k = (pid % 2048) * 32 + n;
        let name = format!("probity-agent-{pid}-{n}");
        let tag = pid % 100_000;
        let host_if = format!("pag{n}h{tag}");
        let ns_if = format!("pag{n}n{tag}");
        let base = u32::from(Ipv4Addr::new(10, 192, 0, 0)) + k * 4;
        let host_v4 = Ipv4Addr::from(base + 1);
        let ns_v4 = Ipv4Addr::from(base + 2);
        let group = u16::try_from(k).unwrap();
        let host_v6 = Ipv6Addr::new(0xfd70, 0x6167, 0x656e, group, 0, 0, 0, 1);
        let ns_v6 = Ipv6Addr::new(0xfd70, 0x6167, 0x656e, group, 0, 0, 0, 2);
        let _ = Command::new(IP).args(["netns", "del", &name]).output();
        let _ = Command::new(IP).args(["link", "del", &host_if]).output();
        run(Command::new(IP).args(["netns", "add", &name]));
        let ns = Netns {
            name,
            host_if,
            ns_if,
            ns_v4,
            ns_v6,
            children: Vec::new(),
            _keys: None,
        };
        run(Command::new(IP).args([
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &ns.ns_if,
            "netns",
            &ns.name,
        ]));
        run(Command::new(IP).args(["addr", "add", &format!("{host_v4}/30"), "dev", &ns.host_if]));
        run(Command::new(IP).args([
            "-6",
            "addr",
            "add",
            &format!("{host_v6}/64"),
            "dev",
            &ns.host_if,
            "nodad",
        ]));
        run(Command::new(IP).args(["link", "set", &ns.host_if, "up"]));
        ns.exec(&[IP, "addr", "add", &format!("{ns_v4}/30"), "dev", &ns.ns_if]);
        ns.exec(&[
            IP,
            "-6",
            "addr",
            "add",
            &format!("{ns_v6}/64"),
            "dev",
            &ns.ns_if,
            "nodad",
        ]);
        ns.exec(&[IP, "link", "set", &ns.ns_if, "up"]);
        ns.exec(&[IP, "link", "set", "lo", "up"]);
        ns
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(IP);
        c.args(["netns", "exec", &self.name]).args(args);
        c
    }

    pub fn exec(&self, args: &[&str]) -> Vec<u8> {
        run(&mut self.cmd(args))
    }

    /// Runs `probity` inside the namespace.
    pub fn probity(&self, args: &[&str]) -> Output {
        self.cmd(&[env!("CARGO_BIN_EXE_probity")])
            .args(args)
            .output()
            .unwrap()
    }

    pub fn listen(&mut self, tcp: &[u16]) {
        let ports: Vec<String> = tcp.iter().map(ToString::to_string).collect();
        let mut child = self
            .cmd(&[PYTHON, "-u", "-c", LISTENER, &ports.join(",")])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        self.children.push(child);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("listener did not start");
        assert_eq!(line.trim(), "ready");
    }

    /// sshd on `port` inside the namespace, with a throwaway host key.
    pub fn sshd(&mut self, port: u16) {
        let keys = tempfile::tempdir().unwrap();
        let key: PathBuf = keys.path().join("host_ed25519");
        run(Command::new("/usr/bin/ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(&key));
        std::fs::create_dir_all("/run/sshd").unwrap();
        let child = self
            .cmd(&[
                "/usr/sbin/sshd",
                "-D",
                "-e",
                "-f",
                "/dev/null",
                "-h",
                key.to_str().unwrap(),
                "-p",
                &port.to_string(),
                "-o",
                "PidFile=none",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.children.push(child);
        self._keys = Some(keys);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.ssh_banner(IpAddr::V4(self.ns_v4), port) {
            assert!(Instant::now() < deadline, "sshd did not come up on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether sshd answers on `addr:port` with its banner, from the root namespace.
    pub fn ssh_banner(&self, addr: IpAddr, port: u16) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(&SocketAddr::new(addr, port), CONNECT_TIMEOUT)
        else {
            return false;
        };
        let _ = s.set_read_timeout(Some(CONNECT_TIMEOUT));
        let mut buf = [0u8; 8];
        s.read_exact(&mut buf).is_ok() && buf.starts_with(b"SSH-2.0")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new(IP).args(["netns", "del", &self.name]).output();
        let _ = Command::new(IP)
            .args(["link", "del", &self.host_if])
            .output();
    }
}
