//! Loading a rendered baseline, safely: dry run by default, atomic when enforced, a no-op
//! when nothing changed, and never a lock-out.
//!
//! Why this module exists: enforcing a firewall on a remote node is the one action that can
//! make the node unreachable for good. So [`apply`] first reads what is loaded now, shows
//! the change, and computes what the node would accept *after* the change (every other
//! table stays as it is; the `inet probity` table is replaced by the rendered one). It
//! refuses, unless [`ApplyOptions::dangerously_allow_lockout`] is set, when a port sshd
//! listens on (the caller says which: nothing assumes 22) or the agent's control-plane
//! connection is admitted now and would not be after.

use std::net::{IpAddr, SocketAddr};

use serde::Serialize;
use thiserror::Error;

use crate::baseline::{Script, TABLE_FAMILY, TABLE_NAME, TableView};
use crate::net::{Family, PortRange, Protocol};
use crate::nft::{self, TableFamily};
use crate::reduce::{Exposure, Inputs, admits_established, reduce};
use crate::source::{self, Reading, SourceConfig, SourceError};

/// Ephemeral ports the agent's outbound connection may use locally.
const EPHEMERAL: (u16, u16) = (1024, u16::MAX);

/// Whether [`apply`] may change anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Read and report only (the default).
    #[default]
    DryRun,
    /// Load the script when it changes something and nothing would lock the node out.
    Enforce,
}

/// The agent's own connection to its control plane, which the baseline must not cut.
/// TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlPlane {
    /// The agent connected out to `remote`: its packets come back as an established
    /// connection from that address and port.
    Outbound {
        /// The control plane's address and port.
        remote: SocketAddr,
    },
    /// The control plane connects in from `remote` to the agent's `local_port`.
    Inbound {
        /// The control plane's address.
        remote: IpAddr,
        /// The port the agent listens on.
        local_port: u16,
    },
}

/// How [`apply`] behaves.
#[derive(Debug, Clone, Default)]
pub struct ApplyOptions {
    /// Dry run (default) or enforce.
    pub mode: Mode,
    /// The TCP ports sshd actually listens on (from the node's sockets). Empty means the
    /// node runs no sshd, and then none is protected.
    pub ssh_ports: Vec<u16>,
    /// The agent's control-plane connection, when it has one.
    pub control_plane: Option<ControlPlane>,
    /// Apply even when SSH or the control plane would be dropped. Off by default; an
    /// operator sets it only when the lock-out is intended (console access at hand).
    pub dangerously_allow_lockout: bool,
    /// Where `nft`, `iptables-save` and `ip6tables-save` are.
    pub sources: SourceConfig,
}

/// What [`apply`] did or would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The loaded table is already the rendered one: nothing was run.
    Unchanged,
    /// Dry run: the script would change the table (see the change and lock-outs).
    WouldApply,
    /// The script was loaded.
    Applied,
}

/// A connection the new ruleset would drop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Lockout {
    /// An sshd port reachable now (from `now`) that no remote host would reach after.
    Ssh {
        /// The port.
        port: u16,
        /// The family.
        family: Family,
        /// Who reaches it now.
        now: Exposure,
    },
    /// The control-plane connection, admitted now, dropped after.
    ControlPlane {
        /// The connection.
        connection: ControlPlane,
    },
}

impl std::fmt::Display for Lockout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lockout::Ssh { port, family, now } => write!(
                f,
                "sshd port {port} over {family}, reachable now {now}, would be dropped"
            ),
            Lockout::ControlPlane { connection } => match connection {
                ControlPlane::Outbound { remote } => write!(
                    f,
                    "the control-plane connection to {remote} would be dropped"
                ),
                ControlPlane::Inbound { remote, local_port } => write!(
                    f,
                    "the control plane connecting from {remote} to port {local_port} would be dropped"
                ),
            },
        }
    }
}

/// The difference between the loaded `inet probity` table and the rendered one.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Change {
    /// Whether a table `inet probity` is loaded now.
    pub table_loaded: bool,
    /// Chains and rules loaded now that the script removes.
    pub removed: Vec<String>,
    /// Chains and rules the script adds.
    pub added: Vec<String>,
}

/// The report of [`apply`].
#[derive(Debug, Clone, Serialize)]
pub struct ApplyReport {
    /// What happened.
    pub outcome: Outcome,
    /// The script.
    pub script: String,
    /// Its change against what was loaded.
    pub change: Change,
    /// Connections it would drop (refused unless overridden; a dry run lists them).
    pub lockouts: Vec<Lockout>,
    /// Whether the lock-out check was overridden.
    pub lockout_overridden: bool,
    /// sshd ports that stay reachable, but from fewer sources than now.
    pub narrowed: Vec<String>,
    /// Anything else the operator should know (no sshd port given, a source unreadable).
    pub warnings: Vec<String>,
    /// After enforcing: whether nft printed back exactly the rendered table.
    pub read_back_matches: Option<bool>,
}

/// Why [`apply`] did not apply.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ApplyError {
    /// nft is not installed, so nothing can be applied.
    #[error("nft is not installed at {program}", program = program.display())]
    NftUnavailable {
        /// Where it was looked for.
        program: std::path::PathBuf,
    },
    /// The loaded ruleset could not be read.
    #[error("cannot read the loaded ruleset")]
    Read(#[source] SourceError),
    /// The script would drop SSH or the control plane.
    #[error("refusing to apply: {}", lockouts.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    WouldLockOut {
        /// What would be dropped.
        lockouts: Vec<Lockout>,
        /// The report as a dry run would give it.
        report: Box<ApplyReport>,
    },
    /// `nft -f` refused the script or failed.
    #[error("nft -f failed to load the baseline")]
    Load(#[source] SourceError),
}

/// Applies `script` as `options` say: see the module documentation.
pub fn apply(script: &Script, options: &ApplyOptions) -> Result<ApplyReport, ApplyError> {
    let src = &options.sources;
    let snapshot = match source::read(src) {
        source::Snapshot {
            nft: Reading::Failed(e),
            ..
        } => return Err(ApplyError::Read(e)),
        s => s,
    };
    let Some(current) = snapshot.nft.value() else {
        return Err(ApplyError::NftUnavailable {
            program: src.nft.program.clone(),
        });
    };
    let desired_rs = script.expected_ruleset().unwrap_or_default();
    let desired = TableView::of(&desired_rs);
    let loaded = TableView::of(current);
    let change = Change {
        table_loaded: loaded.is_some(),
        removed: loaded
            .as_ref()
            .map(|l| l.missing_from(desired.as_ref()))
            .unwrap_or_default(),
        added: desired
            .as_ref()
            .map(|d| d.missing_from(loaded.as_ref()))
            .unwrap_or_default(),
    };
    let mut report = ApplyReport {
        outcome: Outcome::WouldApply,
        script: script.text().to_owned(),
        change,
        lockouts: Vec::new(),
        lockout_overridden: false,
        narrowed: Vec::new(),
        warnings: Vec::new(),
        read_back_matches: None,
    };
    if loaded.is_some() && loaded == desired {
        report.outcome = Outcome::Unchanged;
        return Ok(report);
    }
    for u in snapshot.unread() {
        let w = format!(
            "{} ({} {}): {}",
            "source unread", u.family, u.protocol, u.reason
        );
        if !report.warnings.contains(&w) {
            report.warnings.push(w);
        }
    }
    if options.ssh_ports.is_empty() {
        report
            .warnings
            .push("no sshd port given: SSH access is not protected by the lock-out check".into());
    }
    let after_rs = replace_table(current, &desired_rs);
    let before_inputs = snapshot.inputs();
    let after_inputs = Inputs {
        nft: Some(&after_rs),
        iptables: before_inputs.iptables.clone(),
    };
    let before = reduce(&before_inputs);
    let after = reduce(&after_inputs);
    for &port in &options.ssh_ports {
        for family in Family::ALL {
            let Some(now) = before.exposure(family, Protocol::Tcp, port) else {
                continue;
            };
            match after.exposure(family, Protocol::Tcp, port) {
                None => report.lockouts.push(Lockout::Ssh {
                    port,
                    family,
                    now: now.clone(),
                }),
                Some(then) if then != now => report.narrowed.push(format!(
                    "sshd port {port} over {family}: reachable {now} now, {then} after"
                )),
                Some(_) => {}
            }
        }
    }
    if let Some(cp) = options.control_plane {
        let (ok_now, ok_after) = match cp {
            ControlPlane::Inbound { remote, local_port } => (
                before.admits(Protocol::Tcp, local_port, &remote),
                after.admits(Protocol::Tcp, local_port, &remote),
            ),
            ControlPlane::Outbound { remote } => {
                let ports = PortRange::new(EPHEMERAL.0, EPHEMERAL.1).unwrap_or(PortRange::ALL);
                (
                    admits_established(&before_inputs, remote, ports).0,
                    admits_established(&after_inputs, remote, ports).0,
                )
            }
        };
        if ok_now && !ok_after {
            report
                .lockouts
                .push(Lockout::ControlPlane { connection: cp });
        } else if !ok_now {
            report.warnings.push(format!(
                "the control-plane connection {cp:?} is not admitted by the rules loaded now"
            ));
        }
    }
    if options.mode == Mode::DryRun {
        return Ok(report);
    }
    if !report.lockouts.is_empty() {
        if !options.dangerously_allow_lockout {
            return Err(ApplyError::WouldLockOut {
                lockouts: report.lockouts.clone(),
                report: Box::new(report),
            });
        }
        report.lockout_overridden = true;
    }
    source::run(
        &src.nft,
        &["-f", "-"],
        Some(script.text().as_bytes()),
        src.timeout,
        src.max_output,
    )
    .map_err(ApplyError::Load)?;
    report.outcome = Outcome::Applied;
    report.read_back_matches = Some(
        source::read_nft(src)
            .ok()
            .is_some_and(|rs| TableView::of(&rs) == desired),
    );
    Ok(report)
}

/// `current` with table `inet probity` replaced by the one in `desired`.
fn replace_table(current: &nft::Ruleset, desired: &nft::Ruleset) -> nft::Ruleset {
    let ours =
        |family: TableFamily, table: &str| family.name() == TABLE_FAMILY && table == TABLE_NAME;
    let mut out = current.clone();
    out.tables.retain(|t| !ours(t.family, &t.name));
    out.chains.retain(|c| !ours(c.family, &c.table));
    out.rules.retain(|r| !ours(r.family, &r.table));
    out.sets.retain(|s| !ours(s.family, &s.table));
    out.tables.extend(desired.tables.iter().cloned());
    out.chains.extend(desired.chains.iter().cloned());
    out.rules.extend(desired.rules.iter().cloned());
    out.sets.extend(desired.sets.iter().cloned());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baseline::{Allowance, Baseline, render};
    use crate::source::Tool;

    #[test]
    fn without_nft_nothing_is_applied() {
        let script = render(&Baseline {
            role: "r".into(),
            allow: vec![Allowance::any(Protocol::Tcp, PortRange::single(22))],
        })
        .unwrap();
        let options = ApplyOptions {
            mode: Mode::Enforce,
            sources: SourceConfig {
                nft: Tool::new("/nonexistent/nft"),
                ..SourceConfig::default()
            },
            ..ApplyOptions::default()
        };
        assert!(matches!(
            apply(&script, &options),
            Err(ApplyError::NftUnavailable { .. })
        ));
    }

    #[test]
    fn replace_table_keeps_other_tables() {
        let cur = nft::parse(
            br#"{"nftables": [{"table": {"family": "inet", "name": "probity"}},
            {"chain": {"family": "inet", "table": "probity", "name": "old"}},
            {"table": {"family": "ip", "name": "filter"}}]}"#,
        )
        .unwrap();
        let script = render(&Baseline {
            role: "r".into(),
            allow: vec![],
        })
        .unwrap();
        let out = replace_table(&cur, &script.expected_ruleset().unwrap());
        let names: Vec<String> = out.chains.iter().map(|c| c.name.clone()).collect();
        assert_eq!(names, ["input"]);
        assert_eq!(out.tables.len(), 2);
    }
}
