//! The lock-out check of `baseline apply`: a baseline is loaded only when it keeps SSH
//! and the control plane, unless the operator says otherwise.
//!
//! Why this module exists: a ruleset that drops the port sshd really listens on, or the
//! agent's connection to its control plane, cuts the node off from the people and the
//! service that could undo it. Which connections a script would drop is decided by
//! [`probity_firewall::apply`] from the ports given here; this module establishes those
//! ports from the node itself ([`crate::sshd`]), refuses to enforce when they cannot be
//! established (SSH could not be protected), and turns the firewall's verdict into one
//! [`ApplyRefusal`]. `dangerously_allow_lockout` lifts both refusals. The CLI only
//! parses the flags and prints.

use std::path::Path;

use probity_collect::sockets::{ListeningSocket, ProcNet};
use probity_firewall::apply::{ApplyError, ApplyOptions, ApplyReport, ControlPlane, Lockout, Mode};
use probity_firewall::baseline::Script;
use thiserror::Error;

use crate::config::{Config, FirewallMode};
use crate::sources::firewall_sources;
use crate::sshd::{SshdPorts, sshd_ports};

/// The mode `baseline apply` runs in: it enforces only when asked to (`enforce`) and
/// when the configuration's `firewall.mode` is `enforce`; otherwise it is a dry run.
pub fn apply_mode(config: &Config, enforce: bool) -> Mode {
    if enforce && config.firewall.mode == FirewallMode::Enforce {
        Mode::Enforce
    } else {
        Mode::DryRun
    }
}

/// What protects SSH: the ports sshd listens on, and why they could not all be read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SshGuard {
    /// The ports sshd was found on.
    pub sshd: SshdPorts,
    /// Why SSH cannot be protected (the listening sockets or sshd's descriptors could
    /// not be read, and no port was found); empty when it can.
    pub unprotected: Vec<String>,
}

impl SshGuard {
    /// Reads sshd's ports under `proc_root` (the node's `/proc`).
    pub fn read(proc_root: &Path) -> Self {
        let sockets = ProcNet::new(proc_root).listening();
        Self::from_sockets(proc_root, sockets.reading().map(|r| r.value.as_slice()))
    }

    /// sshd's ports among `sockets`, the listening sockets read from `proc_root` (`None`
    /// when they could not be read).
    pub fn from_sockets(proc_root: &Path, sockets: Option<&[ListeningSocket]>) -> Self {
        let mut unprotected = Vec::new();
        let sshd = match sockets {
            Some(sockets) => {
                let found = sshd_ports(proc_root, sockets);
                if found.ports.is_empty() && !found.unreadable.is_empty() {
                    unprotected.push(format!(
                        "the ports sshd listens on cannot be read ({})",
                        found.unreadable.join("; ")
                    ));
                }
                found
            }
            None => {
                unprotected.push(format!(
                    "the listening sockets cannot be read from {}/net",
                    proc_root.display()
                ));
                SshdPorts::default()
            }
        };
        Self { sshd, unprotected }
    }

    /// Whether loading in `mode` must be refused: only an enforced load is, when SSH
    /// cannot be protected and the lock-out is not allowed.
    pub fn refusal(&self, mode: Mode, dangerously_allow_lockout: bool) -> Option<ApplyRefusal> {
        (mode == Mode::Enforce && !self.unprotected.is_empty() && !dangerously_allow_lockout).then(
            || ApplyRefusal::Unprotected {
                reasons: self.unprotected.clone(),
            },
        )
    }
}

/// Why a baseline was not applied.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ApplyRefusal {
    /// The ports sshd listens on could not be established, so no ruleset is enforced.
    #[error("refusing to apply: {}; SSH could not be protected", reasons.join("; "))]
    Unprotected {
        /// Why, one per unreadable source.
        reasons: Vec<String>,
    },
    /// The script would drop SSH or the control plane.
    #[error("refusing to apply: {}", lockouts.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    WouldLockOut {
        /// What would be dropped.
        lockouts: Vec<Lockout>,
        /// The report as a dry run would give it.
        report: Box<ApplyReport>,
    },
    /// The firewall could not be read or loaded.
    #[error(transparent)]
    Apply(ApplyError),
}

/// A baseline applied (or, in a dry run, what would be), with the sshd ports it kept.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The firewall's report.
    pub report: ApplyReport,
    /// The sshd ports that were protected.
    pub sshd: SshdPorts,
}

/// Applies `script` in `mode` on the node `config` describes, keeping SSH (the ports
/// [`SshGuard`] finds) and the configured control plane, unless
/// `dangerously_allow_lockout`.
pub fn apply_baseline(
    config: &Config,
    script: &Script,
    mode: Mode,
    dangerously_allow_lockout: bool,
) -> Result<Applied, ApplyRefusal> {
    let guard = SshGuard::read(&config.proc_root);
    if let Some(refused) = guard.refusal(mode, dangerously_allow_lockout) {
        return Err(refused);
    }
    let options = ApplyOptions {
        mode,
        ssh_ports: guard.sshd.ports.clone(),
        control_plane: config
            .firewall
            .control_plane
            .map(|remote| ControlPlane::Outbound { remote }),
        dangerously_allow_lockout,
        sources: firewall_sources(config),
    };
    match probity_firewall::apply::apply(script, &options) {
        Ok(report) => Ok(Applied {
            report,
            sshd: guard.sshd,
        }),
        Err(ApplyError::WouldLockOut { lockouts, report }) => {
            Err(ApplyRefusal::WouldLockOut { lockouts, report })
        }
        Err(e) => Err(ApplyRefusal::Apply(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use probity_collect::sockets::{Family, Protocol, Scope, ServesIpv4};

    fn socket(port: u16, inode: u64) -> ListeningSocket {
        ListeningSocket {
            protocol: Protocol::Tcp,
            family: Family::V4,
            address: "0.0.0.0".parse().unwrap(),
            port,
            uid: 0,
            inode,
            scope: Scope::Wildcard {
                serves_ipv4: ServesIpv4::Yes,
            },
        }
    }

    /// A proc root with one sshd (pid 7) holding socket `inode`.
    fn proc_with_sshd(inode: u64) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let pid = root.path().join("7");
        std::fs::create_dir_all(pid.join("fd")).unwrap();
        std::fs::write(pid.join("comm"), "sshd\n").unwrap();
        std::os::unix::fs::symlink(format!("socket:[{inode}]"), pid.join("fd/3")).unwrap();
        root
    }

    #[test]
    fn sshd_found_protects_ssh_in_every_mode() {
        let root = proc_with_sshd(41);
        let guard = SshGuard::from_sockets(root.path(), Some(&[socket(2222, 41), socket(80, 9)]));
        assert_eq!(guard.sshd.ports, [2222]);
        assert!(guard.unprotected.is_empty());
        assert!(guard.refusal(Mode::Enforce, false).is_none());
    }

    #[test]
    fn unreadable_sockets_refuse_an_enforced_load_unless_allowed() {
        let root = tempfile::tempdir().unwrap();
        let guard = SshGuard::from_sockets(root.path(), None);
        let refused = guard.refusal(Mode::Enforce, false).unwrap();
        assert_eq!(
            refused.to_string(),
            format!(
                "refusing to apply: the listening sockets cannot be read from {}/net; SSH could not be protected",
                root.path().display()
            )
        );
        // A dry run loads nothing, and the operator may lift the refusal.
        assert!(guard.refusal(Mode::DryRun, false).is_none());
        assert!(guard.refusal(Mode::Enforce, true).is_none());
    }

    #[test]
    fn an_sshd_whose_descriptors_cannot_be_read_leaves_ssh_unprotected() {
        let root = tempfile::tempdir().unwrap();
        let pid = root.path().join("7");
        std::fs::create_dir_all(&pid).unwrap();
        std::fs::write(pid.join("comm"), "sshd\n").unwrap();
        let guard = SshGuard::from_sockets(root.path(), Some(&[socket(22, 41)]));
        assert!(guard.sshd.ports.is_empty());
        assert_eq!(guard.unprotected.len(), 1);
        assert!(
            guard.unprotected[0].starts_with("the ports sshd listens on cannot be read ("),
            "{:?}",
            guard.unprotected
        );
        assert!(matches!(
            guard.refusal(Mode::Enforce, false),
            Some(ApplyRefusal::Unprotected { .. })
        ));
    }

    #[test]
    fn no_sshd_at_all_is_nothing_to_protect() {
        let root = tempfile::tempdir().unwrap();
        let guard = SshGuard::from_sockets(root.path(), Some(&[socket(22, 41)]));
        assert_eq!(guard, SshGuard::default());
        assert!(guard.refusal(Mode::Enforce, false).is_none());
    }

    #[test]
    fn only_an_enforced_mode_in_the_configuration_enforces() {
        let parse = |mode: &str| {
            Config::parse(
                "agent.toml",
                &format!("[node]\nname = \"n\"\n[inventory]\nzone = \"z\"\nrack = \"r\"\n[firewall]\nmode = \"{mode}\"\n"),
                Path::new("."),
            )
            .unwrap()
        };
        assert_eq!(apply_mode(&parse("enforce"), true), Mode::Enforce);
        assert_eq!(apply_mode(&parse("enforce"), false), Mode::DryRun);
        assert_eq!(apply_mode(&parse("check"), true), Mode::DryRun);
    }
}
