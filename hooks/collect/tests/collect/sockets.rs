//! /proc/net: captured tables, our own node's table, and this machine's live tables while
//! the test holds listeners on 127.0.0.1, ::1, 0.0.0.0 and ::.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, UdpSocket};
use std::time::Duration;

use probity_collect::sockets::{
    Family, ListeningSocket, ProcNet, ProcNetError, ProcNetTable, Protocol, Scope, ServesIpv4,
    parse_proc_net,
};
use probity_collect::{CollectError, Collected, Unavailable};

use crate::common::fixture;

const AREA: &str = "sockets";

fn find(
    sockets: &[ListeningSocket],
    protocol: Protocol,
    address: IpAddr,
    port: u16,
) -> Option<&ListeningSocket> {
    sockets
        .iter()
        .find(|s| s.protocol == protocol && s.address == address && s.port == port)
}

#[test]
fn captured_tables_of_this_vm_decode() {
    let tcp = parse_proc_net(
        &fixture(AREA, "debian12-vm-listeners.tcp"),
        ProcNetTable::Tcp,
        false,
    )
    .unwrap();
    let lo = find(&tcp, Protocol::Tcp, IpAddr::V4(Ipv4Addr::LOCALHOST), 18080).unwrap();
    assert_eq!(lo.scope, Scope::Loopback);
    let any = find(&tcp, Protocol::Tcp, IpAddr::V4(Ipv4Addr::UNSPECIFIED), 2379).unwrap();
    assert_eq!(
        any.scope,
        Scope::Wildcard {
            serves_ipv4: ServesIpv4::Yes
        }
    );
    // The established client connection to 2379 is not listed.
    assert!(
        tcp.iter()
            .all(|s| s.port != 0 && s.protocol == Protocol::Tcp)
    );

    let tcp6 = parse_proc_net(
        &fixture(AREA, "debian12-vm-listeners.tcp6"),
        ProcNetTable::Tcp6,
        false,
    )
    .unwrap();
    assert_eq!(tcp6.len(), 2);
    let v6lo = find(&tcp6, Protocol::Tcp, IpAddr::V6(Ipv6Addr::LOCALHOST), 18081).unwrap();
    assert_eq!(v6lo.scope, Scope::Loopback);
    assert_eq!(v6lo.inode, 43425);
    let v6any = find(
        &tcp6,
        Protocol::Tcp,
        IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        10250,
    )
    .unwrap();
    assert_eq!(
        v6any.scope,
        Scope::Wildcard {
            serves_ipv4: ServesIpv4::AssumedYes
        }
    );
    assert_eq!(v6any.family, Family::V6);

    let udp = parse_proc_net(
        &fixture(AREA, "debian12-vm-listeners.udp"),
        ProcNetTable::Udp,
        false,
    )
    .unwrap();
    // The connected UDP socket (state 01, a peer) does not listen.
    assert_eq!(udp.len(), 1);
    assert_eq!(udp[0].port, 18125);
    let udp6 = parse_proc_net(
        &fixture(AREA, "debian12-vm-listeners.udp6"),
        ProcNetTable::Udp6,
        false,
    )
    .unwrap();
    assert_eq!(udp6.len(), 1);
    assert_eq!(udp6[0].address, IpAddr::V6(Ipv6Addr::LOCALHOST));
    assert_eq!(udp6[0].port, 18126);
}

#[test]
fn own_node_table_classifies_listeners() {
    let tcp = parse_proc_net(
        &fixture(AREA, "own-8gpu-node.tcp"),
        ProcNetTable::Tcp,
        false,
    )
    .unwrap();
    assert_eq!(tcp.len(), 9);
    let etcd = find(&tcp, Protocol::Tcp, "10.20.0.7".parse().unwrap(), 2379).unwrap();
    assert_eq!(etcd.scope, Scope::Specific);
    assert_eq!(etcd.uid, 107);
    let ssh = find(&tcp, Protocol::Tcp, IpAddr::V4(Ipv4Addr::UNSPECIFIED), 22).unwrap();
    assert_eq!(ssh.inode, 20000);
}

#[test]
fn live_proc_net_shows_the_test_listeners() {
    let tcp4_lo = TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp6_lo = TcpListener::bind("[::1]:0").unwrap();
    let tcp4_any = TcpListener::bind("0.0.0.0:0").unwrap();
    let tcp6_any = TcpListener::bind("[::]:0").unwrap();
    let udp4_any = UdpSocket::bind("0.0.0.0:0").unwrap();
    let udp6_lo = UdpSocket::bind("[::1]:0").unwrap();
    let bindv6only = std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only")
        .map(|s| s.trim() == "1")
        .unwrap_or(false);

    let c = ProcNet::default().listening();
    let sockets = &c.reading().unwrap_or_else(|| panic!("{c:?}")).value;

    let s = find(
        sockets,
        Protocol::Tcp,
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        tcp4_lo.local_addr().unwrap().port(),
    )
    .unwrap();
    assert_eq!((s.family, s.scope), (Family::V4, Scope::Loopback));
    assert_eq!(s.uid, rustix_uid());
    assert_ne!(s.inode, 0);

    let s = find(
        sockets,
        Protocol::Tcp,
        IpAddr::V6(Ipv6Addr::LOCALHOST),
        tcp6_lo.local_addr().unwrap().port(),
    )
    .unwrap();
    assert_eq!((s.family, s.scope), (Family::V6, Scope::Loopback));

    let s = find(
        sockets,
        Protocol::Tcp,
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        tcp4_any.local_addr().unwrap().port(),
    )
    .unwrap();
    assert_eq!(
        s.scope,
        Scope::Wildcard {
            serves_ipv4: ServesIpv4::Yes
        }
    );

    let s = find(
        sockets,
        Protocol::Tcp,
        IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        tcp6_any.local_addr().unwrap().port(),
    )
    .unwrap();
    let expected = if bindv6only {
        ServesIpv4::AssumedNo
    } else {
        ServesIpv4::AssumedYes
    };
    assert_eq!(
        s.scope,
        Scope::Wildcard {
            serves_ipv4: expected
        }
    );

    let s = find(
        sockets,
        Protocol::Udp,
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        udp4_any.local_addr().unwrap().port(),
    )
    .unwrap();
    assert_eq!(s.family, Family::V4);
    let s = find(
        sockets,
        Protocol::Udp,
        IpAddr::V6(Ipv6Addr::LOCALHOST),
        udp6_lo.local_addr().unwrap().port(),
    )
    .unwrap();
    assert_eq!(s.scope, Scope::Loopback);

    // A connected UDP socket is not listening.
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    client.connect(udp4_any.local_addr().unwrap()).unwrap();
    let c = ProcNet::default().listening();
    let sockets = &c.reading().unwrap().value;
    assert!(
        find(
            sockets,
            Protocol::Udp,
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            client.local_addr().unwrap().port()
        )
        .is_none()
    );
}

fn rustix_uid() -> u32 {
    // Tests run as root, but read the uid rather than assume it.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_root_without_net_tables_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let c = ProcNet::new(dir.path()).listening();
    assert!(
        matches!(
            c,
            Collected::Unavailable {
                reason: Unavailable::Missing { .. },
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn a_fifo_in_place_of_a_table_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("net")).unwrap();
    let fifo = dir.path().join("net/tcp");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let root = dir.path().to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(ProcNet::new(root).listening());
    });
    let c = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a FIFO blocked the collector");
    assert!(
        matches!(
            c,
            Collected::Error {
                error: CollectError::File(_),
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn a_garbled_table_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("net")).unwrap();
    let mut tcp = fixture(AREA, "own-8gpu-node.tcp");
    tcp.extend_from_slice(b"  50: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000   abc        0 1 1\n");
    std::fs::write(dir.path().join("net/tcp"), tcp).unwrap();
    let c = ProcNet::new(dir.path()).listening();
    match c {
        Collected::Error {
            error: CollectError::ProcNet { path, source },
            ..
        } => {
            assert!(path.ends_with("net/tcp"));
            assert_eq!(
                source,
                ProcNetError::Field {
                    line: 51,
                    field: "uid",
                    value: "abc".into(),
                    expected: "a decimal uid"
                }
            );
        }
        other => panic!("{other:?}"),
    }
}
