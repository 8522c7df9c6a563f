//! A network namespace per test, joined to the root namespace by a veth pair with an IPv4
//! /30 and an IPv6 ULA /64, with listeners inside and real connections from outside.
//! Everything the guard starts it stops by PID, and the namespace is deleted on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use probity_firewall::source::SourceConfig;
use probity_firewall::{Family, Protocol};

static NEXT: AtomicU32 = AtomicU32::new(0);

const IP: &str = "/usr/sbin/ip";
const PYTHON: &str = "/usr/bin/python3";
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1500);

/// Binds TCP and UDP ports on both families; TCP connections get "ok", UDP datagrams
/// are echoed. Prints "ready" once every socket is bound.
const LISTENER: &str = r#"
import selectors, socket, sys
tcp = [int(p) for p in sys.argv[1].split(",") if p]
udp = [int(p) for p in sys.argv[2].split(",") if p]
sel = selectors.DefaultSelector()
for fam, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    for p in tcp:
        s = socket.socket(fam, socket.SOCK_STREAM)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, p)); s.listen(64); sel.register(s, selectors.EVENT_READ, "tcp")
    for p in udp:
        s = socket.socket(fam, socket.SOCK_DGRAM)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((host, p)); sel.register(s, selectors.EVENT_READ, "udp")
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        s = key.fileobj
        if key.data == "tcp":
            c, _ = s.accept(); c.sendall(b"ok"); c.close()
        else:
            data, addr = s.recvfrom(2048); s.sendto(data, addr)
"#;

pub struct Netns {
    pub name: String,
    pub host_if: String,
    pub ns_if: String,
    pub host_v4: Ipv4Addr,
    pub ns_v4: Ipv4Addr,
    pub host_v6: Ipv6Addr,
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

fn run_stdin(cmd: &mut Command, input: &[u8]) -> Vec<u8> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\ninput:\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(input)
    );
    out.stdout
}

impl Netns {
    pub fn new() -> Netns {
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        assert!(n < 32, "more namespaces than address slots");
        let k = (pid % 2048) * 32 + n;
        let name = format!("probity-fw-{pid}-{n}");
        let tag = pid % 100_000;
        let host_if = format!("pfw{n}h{tag}");
        let ns_if = format!("pfw{n}n{tag}");
        let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + k * 4;
        let host_v4 = Ipv4Addr::from(base + 1);
        let ns_v4 = Ipv4Addr::from(base + 2);
        let group = u16::try_from(k).unwrap();
        let host_v6 = Ipv6Addr::new(0xfd70, 0x726f, 0x6269, group, 0, 0, 0, 1);
        let ns_v6 = Ipv6Addr::new(0xfd70, 0x726f, 0x6269, group, 0, 0, 0, 2);
        // Remove leftovers of a crashed run with the same pid.
        let _ = Command::new(IP).args(["netns", "del", &name]).output();
        let _ = Command::new(IP).args(["link", "del", &host_if]).output();
        run(Command::new(IP).args(["netns", "add", &name]));
        let ns = Netns {
            name,
            host_if,
            ns_if,
            host_v4,
            ns_v4,
            host_v6,
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
        // `nodad`: the addresses are usable at once, no duplicate detection to wait for.
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

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(IP);
        c.args(["netns", "exec", &self.name]).args(args);
        c
    }

    /// Runs a command inside the namespace; it must succeed.
    pub fn exec(&self, args: &[&str]) -> Vec<u8> {
        run(&mut self.cmd(args))
    }

    pub fn exec_stdin(&self, args: &[&str], input: &str) -> Vec<u8> {
        run_stdin(&mut self.cmd(args), input.as_bytes())
    }

    pub fn nft_load(&self, script: &str) {
        self.exec_stdin(&["/usr/sbin/nft", "-f", "-"], script);
    }

    pub fn iptables_restore(&self, family: Family, text: &str) {
        let prog = match family {
            Family::Ipv4 => "/usr/sbin/iptables-restore",
            Family::Ipv6 => "/usr/sbin/ip6tables-restore",
        };
        self.exec_stdin(&[prog], text);
    }

    /// `nft -j list ruleset` as the real tool prints it.
    pub fn dump_nft(&self) -> Vec<u8> {
        self.exec(&["/usr/sbin/nft", "-j", "list", "ruleset"])
    }

    pub fn dump_iptables(&self, family: Family) -> Vec<u8> {
        let prog = match family {
            Family::Ipv4 => "/usr/sbin/iptables-save",
            Family::Ipv6 => "/usr/sbin/ip6tables-save",
        };
        self.exec(&[prog])
    }

    pub fn sources(&self) -> SourceConfig {
        SourceConfig::in_network_namespace(IP, &self.name)
    }

    pub fn host_addr(&self, family: Family) -> IpAddr {
        match family {
            Family::Ipv4 => IpAddr::V4(self.host_v4),
            Family::Ipv6 => IpAddr::V6(self.host_v6),
        }
    }

    pub fn ns_addr(&self, family: Family) -> IpAddr {
        match family {
            Family::Ipv4 => IpAddr::V4(self.ns_v4),
            Family::Ipv6 => IpAddr::V6(self.ns_v6),
        }
    }

    /// Starts the listener inside the namespace and waits until it has bound every port.
    pub fn listen(&mut self, tcp: &[u16], udp: &[u16]) {
        let join = |p: &[u16]| {
            p.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut child = self
            .cmd(&[PYTHON, "-u", "-c", LISTENER, &join(tcp), &join(udp)])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        self.children.push(child);
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("listener did not start");
        assert_eq!(line.trim(), "ready");
    }

    /// Starts sshd inside the namespace on `port`, with a throwaway host key, and waits
    /// until it sends its banner.
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
        while !self.ssh_banner(Family::Ipv4, port) {
            assert!(
                Instant::now() < deadline,
                "sshd did not come up on port {port}"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether sshd answers on `port` with its banner.
    pub fn ssh_banner(&self, family: Family, port: u16) -> bool {
        let addr = SocketAddr::new(self.ns_addr(family), port);
        let Ok(mut s) = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(CONNECT_TIMEOUT));
        let mut buf = [0u8; 8];
        s.read_exact(&mut buf).is_ok() && buf.starts_with(b"SSH-2.0")
    }

    /// Forgets neighbours on both ends, so the next connection resolves them again
    /// (through whatever firewall is loaded).
    pub fn flush_neighbours(&self) {
        run(Command::new(IP).args(["neigh", "flush", "dev", &self.host_if]));
        self.exec(&[IP, "neigh", "flush", "dev", &self.ns_if]);
    }

    /// Whether a real connection from the root namespace gets through, for each probe.
    pub fn probe_all(&self, probes: &[(Family, Protocol, u16)]) -> Vec<bool> {
        let handles: Vec<_> = probes
            .iter()
            .map(|&(family, protocol, port)| {
                let dst = SocketAddr::new(self.ns_addr(family), port);
                let src = SocketAddr::new(self.host_addr(family), 0);
                thread::spawn(move || match protocol {
                    Protocol::Tcp => probe_tcp(dst),
                    Protocol::Udp => probe_udp(src, dst),
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }
}

fn probe_tcp(dst: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&dst, CONNECT_TIMEOUT) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(CONNECT_TIMEOUT));
    let mut buf = [0u8; 2];
    s.read_exact(&mut buf).is_ok() && &buf == b"ok"
}

fn probe_udp(src: SocketAddr, dst: SocketAddr) -> bool {
    let s = UdpSocket::bind(src).unwrap();
    s.connect(dst).unwrap();
    s.set_read_timeout(Some(CONNECT_TIMEOUT)).unwrap();
    // Two tries: the first datagram may wait on neighbour resolution.
    for _ in 0..2 {
        if s.send(b"probe").is_err() {
            return false;
        }
        let mut buf = [0u8; 16];
        match s.recv(&mut buf) {
            Ok(5) if buf.starts_with(b"probe") => return true,
            Ok(_) => return false,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return false,
            Err(_) => {}
        }
    }
    false
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
