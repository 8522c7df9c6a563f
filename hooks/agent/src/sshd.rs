//! The ports sshd actually listens on, read from its own sockets.
//!
//! Why this module exists: `baseline apply` must never load a ruleset that drops SSH,
//! and "SSH is port 22" is an assumption a hardened node breaks on purpose. So the ports
//! come from the sshd processes themselves: each process whose `comm` is `sshd` (the
//! listener keeps that name; sessions are `sshd-session` or `sshd: user@pts` on newer
//! OpenSSH), its `fd/*` links `socket:[INODE]`, matched against the listening TCP
//! sockets of this network namespace (so an sshd of another namespace, whose inodes are
//! not in this `/proc/net/tcp`, does not count). Reading another process's `fd`
//! directory needs the same uid (root, as sshd) and, in a container, the host's PID
//! namespace.

use std::collections::BTreeSet;
use std::path::Path;

use probity_collect::sockets::{ListeningSocket, Protocol, Scope};
use probity_collect::source::read_regular_file;
use serde::Serialize;

/// Most processes looked at.
const MAX_PROCESSES: usize = 1 << 22;
/// Most descriptors looked at per process.
const MAX_FDS: usize = 1 << 16;

/// What was found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SshdPorts {
    /// The sshd processes seen.
    pub pids: Vec<u32>,
    /// The TCP ports they listen on, reachable from other hosts (not loopback-only).
    pub ports: Vec<u16>,
    /// sshd processes whose descriptors could not be read, with why.
    pub unreadable: Vec<String>,
}

/// Finds the ports the sshd processes under `proc_root` listen on among `sockets`.
pub fn sshd_ports(proc_root: &Path, sockets: &[ListeningSocket]) -> SshdPorts {
    let mut out = SshdPorts::default();
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        out.unreadable
            .push(format!("{}: cannot list processes", proc_root.display()));
        return out;
    };
    let mut inodes: BTreeSet<u64> = BTreeSet::new();
    for entry in entries.take(MAX_PROCESSES).flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let dir = entry.path();
        let Ok(comm) = read_regular_file(&dir.join("comm"), 64) else {
            continue;
        };
        if String::from_utf8_lossy(&comm).trim_end() != "sshd" {
            continue;
        }
        out.pids.push(pid);
        match std::fs::read_dir(dir.join("fd")) {
            Ok(fds) => {
                for fd in fds.take(MAX_FDS).flatten() {
                    let Ok(target) = std::fs::read_link(fd.path()) else {
                        continue;
                    };
                    if let Some(inode) = target
                        .to_str()
                        .and_then(|t| t.strip_prefix("socket:["))
                        .and_then(|t| t.strip_suffix(']'))
                        .and_then(|t| t.parse::<u64>().ok())
                    {
                        inodes.insert(inode);
                    }
                }
            }
            Err(e) => out.unreadable.push(format!("sshd pid {pid}: fd: {e}")),
        }
    }
    out.pids.sort_unstable();
    let mut ports: Vec<u16> = sockets
        .iter()
        .filter(|s| {
            s.protocol == Protocol::Tcp && s.scope != Scope::Loopback && inodes.contains(&s.inode)
        })
        .map(|s| s.port)
        .collect();
    ports.sort_unstable();
    ports.dedup();
    out.ports = ports;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_not_sshd_and_a_missing_root_says_so() {
        let found = sshd_ports(Path::new("/nonexistent/proc"), &[]);
        assert!(found.ports.is_empty());
        assert_eq!(found.unreadable.len(), 1);
    }

    #[test]
    fn a_fake_proc_tree_maps_sshd_sockets_to_ports() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("4242");
        std::fs::create_dir_all(p.join("fd")).unwrap();
        std::fs::write(p.join("comm"), "sshd\n").unwrap();
        std::os::unix::fs::symlink("socket:[777]", p.join("fd/3")).unwrap();
        std::os::unix::fs::symlink("/dev/null", p.join("fd/0")).unwrap();
        let other = dir.path().join("99");
        std::fs::create_dir_all(other.join("fd")).unwrap();
        std::fs::write(other.join("comm"), "nginx\n").unwrap();
        std::os::unix::fs::symlink("socket:[778]", other.join("fd/3")).unwrap();
        let sock = |port, inode| ListeningSocket {
            protocol: Protocol::Tcp,
            family: probity_collect::sockets::Family::V4,
            address: "0.0.0.0".parse().unwrap(),
            port,
            uid: 0,
            inode,
            scope: Scope::Wildcard {
                serves_ipv4: probity_collect::sockets::ServesIpv4::Yes,
            },
        };
        let found = sshd_ports(dir.path(), &[sock(2222, 777), sock(80, 778)]);
        assert_eq!(found.pids, [4242]);
        assert_eq!(found.ports, [2222]);
    }
}
