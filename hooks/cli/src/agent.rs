//! `probity agent` (the node agent: run, one cycle, status) and `probity baseline`
//! (check, render and apply the node role's firewall baseline), over `probity-agent`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use probity_agent::baseline::role_baseline;
use probity_agent::lockout::{Applied, ApplyRefusal, apply_baseline, apply_mode};
use probity_agent::sources::firewall_sources;
use probity_agent::{Agent, AgentError, Config, Progress, Status};
use probity_firewall::apply::{Mode, Outcome};
use serde_json::json;

use crate::{Exit, exit};

/// Where the agent's configuration is unless `--config` says otherwise.
const DEFAULT_CONFIG: &str = "/etc/probity/agent.toml";

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AgentArgs {
    #[command(subcommand)]
    command: Option<AgentCommand>,
    /// The agent's configuration (see hooks/agent/probity-agent.toml for every option).
    #[arg(long, default_value = DEFAULT_CONFIG)]
    config: PathBuf,
    /// Run one cycle (and one read of the audit log), print the facts, decisions and
    /// findings as JSON, and exit: 0 when no finding is active, 6 when one is.
    #[arg(long)]
    once: bool,
}

#[derive(Subcommand)]
enum AgentCommand {
    /// Print the status a running agent last wrote in its state directory.
    Status {
        /// The agent's configuration (for its state directory).
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// The state directory, instead of the configuration's.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Print the status file as JSON.
        #[arg(long, conflicts_with = "metrics")]
        json: bool,
        /// Print the Prometheus text lines.
        #[arg(long)]
        metrics: bool,
    },
}

/// `probity baseline ...`.
#[derive(Subcommand)]
pub enum BaselineCommand {
    /// What a remote host can reach beyond the role's baseline, and what of it is
    /// missing (exit 6 when either is not empty, or something could not be decided).
    Check {
        #[command(flatten)]
        target: BaselineTarget,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print the nftables script of the role's baseline (table `inet probity`).
    Render {
        #[command(flatten)]
        target: BaselineTarget,
    },
    /// Load the role's baseline: a dry run unless --enforce and the agent's
    /// configuration says mode = "enforce". Refuses (exit 7) a ruleset that would drop
    /// a port sshd listens on or the control-plane connection.
    Apply {
        #[command(flatten)]
        target: BaselineTarget,
        /// Load it (only with mode = "enforce" in the configuration).
        #[arg(long)]
        enforce: bool,
        /// Load it even when it cuts off SSH or the control plane.
        #[arg(long)]
        dangerously_allow_lockout: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub struct BaselineTarget {
    /// The agent's configuration (role, tools, control plane, policies).
    #[arg(long, default_value = DEFAULT_CONFIG)]
    config: PathBuf,
    /// The role, instead of the configuration's inventory.role.
    #[arg(long)]
    role: Option<String>,
}

/// Reads the agent's configuration; a bad one is reported located (exit 8).
fn config(path: &Path) -> Result<Config> {
    Config::from_file(path).map_err(|e| {
        eprintln!("error: {}", probity_agent::sources::error_chain(&e));
        Exit(exit::BAD_INPUT).into()
    })
}

fn engine(
    config: &Config,
    attach_state: bool,
) -> Result<(
    probity::Engine,
    Option<std::sync::Arc<probity::state::StateStore>>,
)> {
    probity_agent::build_engine_with_state(config, None, attach_state).map_err(|e| match e {
        AgentError::Policies(load) => crate::report(*load),
        other => {
            eprintln!("error: {}", probity_agent::sources::error_chain(&other));
            Exit(exit::BAD_INPUT).into()
        }
    })
}

pub fn agent(args: AgentArgs) -> Result<u8> {
    match args.command {
        Some(AgentCommand::Status {
            config: path,
            state_dir,
            json,
            metrics,
        }) => status(&path, state_dir, json, metrics),
        None if args.once => once(&args.config),
        None => run(&args.config),
    }
}

/// The agent `path` configures, its engine on its state; forwarding to the SIEM when
/// `forward`.
pub fn start(path: &Path, forward: bool) -> Result<Agent> {
    let config = config(path)?;
    let (engine, store) = engine(&config, true)?;
    let fail = |e: AgentError| -> anyhow::Error {
        eprintln!("error: {}", probity_agent::sources::error_chain(&e));
        Exit(exit::BAD_INPUT).into()
    };
    let mut agent = Agent::new(config, engine).map_err(fail)?;
    if forward && let Some(store) = &store {
        agent.forward_to_siem(store).map_err(fail)?;
    }
    Ok(agent)
}

fn once(path: &Path) -> Result<u8> {
    // One cycle forwards nothing: the running agent forwards what it recorded.
    let mut agent = start(path, false)?;
    let audit = agent.config().audit.enabled.then(|| agent.poll_audit());
    let report = agent.cycle();
    if let Err(e) = agent.write_status() {
        eprintln!("probity agent: cannot write the status file: {e}");
    }
    let mut out = serde_json::to_value(&report)?;
    if let (Some(a), Some(o)) = (audit, out.as_object_mut()) {
        o.insert("audit".into(), serde_json::to_value(a)?);
        o.insert(
            "active".into(),
            serde_json::to_value(agent.findings().collect::<Vec<_>>())?,
        );
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(if agent.findings().next().is_some() {
        exit::VIOLATION
    } else {
        exit::ALLOW
    })
}

/// SIGTERM and SIGINT, as a channel; the handlers are in place when this returns.
fn stop_signal() -> Result<mpsc::Receiver<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the signal handler")?;
    let (mut term, mut int) = rt
        .block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            ))
        })
        .context("cannot handle SIGTERM and SIGINT")?;
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("probity-signals".into())
        .spawn(move || {
            rt.block_on(async {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = int.recv() => {},
                }
            });
            let _ = tx.send(());
        })
        .context("cannot start the signal thread")?;
    Ok(rx)
}

/// SIGHUP (`systemctl reload`) reloads the policy directory, as the watcher does on a
/// change; a set that fails to load is refused and the previous one keeps deciding.
fn reload_on_hangup(
    engine: probity::Engine,
    notifier: probity_base::systemd::Notifier,
) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the SIGHUP handler")?;
    let mut hangup = rt
        .block_on(async { signal(SignalKind::hangup()) })
        .context("cannot handle SIGHUP")?;
    std::thread::Builder::new()
        .name("probity-reload".into())
        .spawn(move || {
            while rt.block_on(hangup.recv()).is_some() {
                let _ = notifier.reloading();
                let outcome = if engine.policy_dir().is_none() {
                    "embedded policies, nothing to reload".to_owned()
                } else {
                    match engine.reload() {
                        Ok(()) => "policies reloaded".to_owned(),
                        Err(e) => format!(
                            "reload refused, the previous policies keep deciding: {}",
                            e.detail()
                        ),
                    }
                };
                eprintln!("{}", json!({"event": "reload", "outcome": outcome}));
                let _ = notifier.ready(&outcome);
            }
        })
        .context("cannot start the reload thread")?;
    Ok(())
}

fn run(path: &Path) -> Result<u8> {
    let stop = stop_signal()?;
    let mut agent = start(path, true)?;
    let _watcher = match agent.config().engine.policies {
        Some(_) => Some(
            agent
                .engine()
                .watch()
                .context("cannot watch the policy directory")?,
        ),
        None => None,
    };
    let c = agent.config();
    eprintln!(
        "probity agent: node {}, a cycle every {}s, firewall mode {:?}, state {}",
        c.node,
        c.collect.interval.as_secs(),
        c.firewall.mode,
        c.state_dir
            .as_ref()
            .map_or("in memory".to_owned(), |d| d.display().to_string())
    );
    if let Some(address) = &c.siem.address {
        eprintln!(
            "probity agent: forwarding the decision and event logs to {address} over {:?}",
            c.siem.transport
        );
    }
    // One JSON line on standard error per finding raised or cleared.
    let mut log = |p: Progress<'_>| {
        let (raised, cleared, errors) = match p {
            Progress::Cycle(r) => (&r.raised, r.cleared.as_slice(), &r.errors),
            Progress::Audit(r) => (&r.raised, &[][..], &r.errors),
        };
        let mut err = std::io::stderr().lock();
        for (event, list) in [("finding", raised.as_slice()), ("finding-cleared", cleared)] {
            for f in list {
                let line = json!({"event": event, "policy": f.policy, "action": f.action,
                    "subject": f.subject, "severity": f.severity, "message": f.message});
                let _ = writeln!(err, "{line}");
            }
        }
        for e in errors {
            let _ = writeln!(err, "{}", json!({"event": "error", "message": e}));
        }
    };
    // Under systemd (`Type=notify`): configured, policies loaded, the loop starts now.
    let notifier = probity_base::systemd::Notifier::from_env();
    reload_on_hangup(agent.engine().clone(), notifier.clone())?;
    let _ = notifier.ready(&format!("node {}, collecting", agent.config().node));
    agent.run(&stop, &mut log);
    let _ = notifier.stopping();
    for (log, s) in agent.stop_forwarding() {
        eprintln!(
            "probity agent: the {} forwarder stopped, {} records confirmed by the SIEM",
            log.as_str(),
            s.forwarded
        );
    }
    eprintln!("probity agent: stopped");
    Ok(exit::ALLOW)
}

fn status(path: &Path, state_dir: Option<PathBuf>, json: bool, metrics: bool) -> Result<u8> {
    let dir = match state_dir {
        Some(d) => d,
        None => config(path)?.state_dir.ok_or_else(|| {
            eprintln!(
                "error: {} sets no [state] dir, so no agent writes a status: give --state-dir",
                path.display()
            );
            Exit(exit::BAD_INPUT)
        })?,
    };
    let status = Status::read(&dir).map_err(|e| {
        eprintln!("error: {}", probity_agent::sources::error_chain(&e));
        Exit(exit::BAD_INPUT)
    })?;
    if metrics {
        print!("{}", status.metrics);
    } else if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        println!(
            "node {}: {} cycles, last at {}, {:.2} ms CPU; status written at {}",
            status.node,
            status.cycles,
            status.last_cycle_at.unwrap_or(0),
            status.last_cycle_cpu_ms,
            status.written_at
        );
        println!("sources:");
        for (name, s) in &status.sources {
            let flag = match (s.unreadable, s.stale) {
                (true, true) => "STALE ",
                (true, false) => "UNREADABLE ",
                _ => "",
            };
            println!(
                "  {name:<10} {:<11} {flag}{}",
                s.state,
                s.why_unreadable
                    .as_deref()
                    .or(s.reason.as_deref())
                    .unwrap_or("")
            );
        }
        println!("findings: {}", status.findings.len());
        for f in &status.findings {
            println!(
                "  {:<8} {:<40} {:<24} {}",
                f.severity, f.policy, f.subject, f.message
            );
        }
    }
    Ok(if status.findings.is_empty() {
        exit::ALLOW
    } else {
        exit::VIOLATION
    })
}

pub fn baseline(command: BaselineCommand) -> Result<u8> {
    match command {
        BaselineCommand::Check { target, json } => check(&target, json),
        BaselineCommand::Render { target } => {
            let (_, script) = script(&target)?;
            print!("{}", script.text());
            Ok(exit::ALLOW)
        }
        BaselineCommand::Apply {
            target,
            enforce,
            dangerously_allow_lockout,
            json,
        } => apply(&target, enforce, dangerously_allow_lockout, json),
    }
}

fn role_of(
    target: &BaselineTarget,
    config: &Config,
) -> Result<probity_firewall::baseline::Baseline> {
    let (engine, _) = engine(config, false)?;
    let role = target.role.clone().or(config.inventory.role.clone());
    role_baseline(&engine, role.as_deref()).map_err(|e| {
        eprintln!("error: {e}");
        Exit(exit::BAD_INPUT).into()
    })
}

fn script(target: &BaselineTarget) -> Result<(Config, probity_firewall::baseline::Script)> {
    let config = config(&target.config)?;
    let baseline = role_of(target, &config)?;
    let script = probity_firewall::baseline::render(&baseline).map_err(|e| {
        eprintln!("error: {e}");
        Exit(exit::BAD_INPUT)
    })?;
    Ok((config, script))
}

fn check(target: &BaselineTarget, as_json: bool) -> Result<u8> {
    let config = config(&target.config)?;
    let baseline = role_of(target, &config)?;
    let snapshot = probity_firewall::source::read(&firewall_sources(&config));
    let reach = snapshot.reduce();
    let compliance = probity_firewall::baseline::check(&reach, &baseline);
    let clean = compliance.is_clean();
    if as_json {
        let out = json!({
            "role": baseline.role,
            "clean": clean,
            "excess": compliance.excess,
            "missing": compliance.missing,
            "uncertainties": compliance.uncertainties,
            "baseline": baseline,
            "reachable": reach.ports,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "role {}: {} reachable beyond the baseline, {} of it missing, {} undecided",
            baseline.role,
            compliance.excess.len(),
            compliance.missing.len(),
            compliance.uncertainties.len()
        );
        if !clean {
            println!(
                "{:<8} {:<6} {:<6} {:<13} FROM",
                "WHAT", "FAMILY", "PROTO", "PORTS"
            );
        }
        for (what, list) in [
            ("beyond", &compliance.excess),
            ("missing", &compliance.missing),
        ] {
            for f in list {
                println!(
                    "{what:<8} {:<6} {:<6} {:<13} {}",
                    f.family.to_string(),
                    f.protocol.to_string(),
                    f.ports.to_string(),
                    f.exposure
                );
            }
        }
        for u in &compliance.uncertainties {
            println!(
                "undecided {} {} {}: {}",
                u.family,
                u.protocol,
                u.ports
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                u.reason
            );
        }
    }
    Ok(if clean { exit::ALLOW } else { exit::VIOLATION })
}

fn apply(
    target: &BaselineTarget,
    enforce: bool,
    dangerously_allow_lockout: bool,
    as_json: bool,
) -> Result<u8> {
    let (config, script) = script(target)?;
    let mode = apply_mode(&config, enforce);
    if enforce && mode == Mode::DryRun {
        eprintln!(
            "probity baseline apply: --enforce has no effect: {} says mode = \"check\"; this is a dry run",
            config.origin
        );
    }
    let Applied { report, sshd: ssh } =
        match apply_baseline(&config, &script, mode, dangerously_allow_lockout) {
            Ok(applied) => applied,
            Err(refused @ ApplyRefusal::Unprotected { .. }) => {
                eprintln!("error: {refused}");
                return Ok(exit::REFUSED);
            }
            Err(ApplyRefusal::WouldLockOut { lockouts, report }) => {
                if as_json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(
                            &json!({"refused": true, "lockouts": lockouts, "report": report})
                        )?
                    );
                }
                for l in &lockouts {
                    eprintln!("error: refusing to apply: {l}");
                }
                return Ok(exit::REFUSED);
            }
            Err(ApplyRefusal::Apply(e)) => {
                eprintln!("error: {}", probity_agent::sources::error_chain(&e));
                return Ok(exit::BAD_INPUT);
            }
            Err(e) => {
                eprintln!("error: {}", probity_agent::sources::error_chain(&e));
                return Ok(exit::BAD_INPUT);
            }
        };
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"report": report, "sshd": ssh, "mode": mode}))?
        );
    } else {
        let what = match report.outcome {
            Outcome::Unchanged => "unchanged: the loaded table is already the baseline",
            Outcome::WouldApply => "dry run: would apply",
            Outcome::Applied => "applied",
        };
        println!("role {}: {what}", script.baseline().role);
        println!(
            "sshd listens on {}",
            if ssh.ports.is_empty() {
                "no port found".to_owned()
            } else {
                ssh.ports
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        for a in &report.change.added {
            println!("  + {a}");
        }
        for r in &report.change.removed {
            println!("  - {r}");
        }
        for l in &report.lockouts {
            println!(
                "  lock-out{}: {l}",
                if report.lockout_overridden {
                    " (overridden)"
                } else {
                    ""
                }
            );
        }
        for n in &report.narrowed {
            println!("  narrowed: {n}");
        }
        for w in &report.warnings {
            println!("  warning: {w}");
        }
        if let Some(ok) = report.read_back_matches {
            println!("  read back: {}", if ok { "matches" } else { "DIFFERS" });
        }
    }
    Ok(exit::ALLOW)
}
