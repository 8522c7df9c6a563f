//! Reading the rulesets from the tools that print them: `nft -j list ruleset`,
//! `iptables-save` and `ip6tables-save`.
//!
//! Why this module exists: the agent must gather its own facts, and a command is a source
//! that can be missing, hang, or print without end. Each command runs without a shell,
//! with configurable paths, a timeout and an output cap; a tool that is not installed is
//! [`Reading::Unavailable`] (not a failure: a node without iptables has no iptables
//! rules), and any other problem is [`Reading::Failed`], which the reduction reports as an
//! uncertainty rather than a silent pass.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::iptables::{self, IptablesParseError};
use crate::net::{Family, PortRange, Protocol};
use crate::nft::{self, NftParseError};
use crate::reduce::{Effect, Inputs, Reachability, Uncertainty, reduce};

/// Default time a command may take: 10 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default output cap: 32 MiB, the parsers' limit.
pub const DEFAULT_MAX_OUTPUT: usize = 32 << 20;

/// A program to run, with arguments that come before the command's own (to run it through
/// `ip netns exec NS` or `nsenter`, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tool {
    /// The program; a bare name is looked up in `PATH`.
    pub program: PathBuf,
    /// Arguments before the command's own.
    pub leading_args: Vec<String>,
}

impl Tool {
    /// `program` with no leading arguments.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            leading_args: Vec::new(),
        }
    }

    fn display(&self, args: &[&str]) -> String {
        let mut parts = vec![self.program.display().to_string()];
        parts.extend(self.leading_args.iter().cloned());
        parts.extend(args.iter().map(|a| (*a).to_owned()));
        parts.join(" ")
    }
}

/// Where the tools are and how long and how much they may print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceConfig {
    /// `nft`; default `/usr/sbin/nft`.
    pub nft: Tool,
    /// `iptables-save`; default `/usr/sbin/iptables-save`.
    pub iptables_save: Tool,
    /// `ip6tables-save`; default `/usr/sbin/ip6tables-save`.
    pub ip6tables_save: Tool,
    /// Time each command may take; default [`DEFAULT_TIMEOUT`].
    pub timeout: Duration,
    /// Bytes each command may print; default [`DEFAULT_MAX_OUTPUT`].
    pub max_output: usize,
}

impl Default for SourceConfig {
    fn default() -> Self {
        Self {
            nft: Tool::new("/usr/sbin/nft"),
            iptables_save: Tool::new("/usr/sbin/iptables-save"),
            ip6tables_save: Tool::new("/usr/sbin/ip6tables-save"),
            timeout: DEFAULT_TIMEOUT,
            max_output: DEFAULT_MAX_OUTPUT,
        }
    }
}

impl SourceConfig {
    /// The default tools, run inside network namespace `ns` through `ip netns exec`
    /// (`ip` is the program at `ip`, e.g. `/usr/sbin/ip`).
    pub fn in_network_namespace(ip: impl Into<PathBuf>, ns: &str) -> Self {
        let ip = ip.into();
        let wrap = |t: Tool| Tool {
            program: ip.clone(),
            leading_args: vec![
                "netns".into(),
                "exec".into(),
                ns.to_owned(),
                t.program.display().to_string(),
            ],
        };
        let d = Self::default();
        Self {
            nft: wrap(d.nft),
            iptables_save: wrap(d.iptables_save),
            ip6tables_save: wrap(d.ip6tables_save),
            ..d
        }
    }
}

/// Why a source could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The program does not exist.
    #[error("{program} is not installed")]
    NotInstalled {
        /// The program.
        program: PathBuf,
    },
    /// The program could not be started.
    #[error("cannot run {command}")]
    Spawn {
        /// The command line.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It took longer than the timeout and was killed.
    #[error("{command} did not finish within {timeout:?} and was killed")]
    Timeout {
        /// The command line.
        command: String,
        /// The timeout.
        timeout: Duration,
    },
    /// It printed more than the cap and was killed.
    #[error("{command} printed more than {limit} bytes and was killed")]
    TooLarge {
        /// The command line.
        command: String,
        /// The cap.
        limit: usize,
    },
    /// It exited with a failure.
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        /// The command line.
        command: String,
        /// Exit status as printed.
        status: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// Its output did not parse as nft JSON.
    #[error("{command} printed what is not nft JSON")]
    Nft {
        /// The command line.
        command: String,
        /// Why.
        #[source]
        source: NftParseError,
    },
    /// Its output did not parse as iptables-save output.
    #[error("{command} printed what is not iptables-save output")]
    Iptables {
        /// The command line.
        command: String,
        /// Why.
        #[source]
        source: IptablesParseError,
    },
}

/// What a command printed.
#[derive(Debug, Clone)]
pub struct Output {
    /// Standard output.
    pub stdout: Vec<u8>,
    /// Standard error.
    pub stderr: Vec<u8>,
}

/// Runs `tool` with `args` (no shell), feeding `stdin` if given, within `timeout` and
/// `max_output` bytes on each of stdout and stderr. A non-zero exit is an error.
pub fn run(
    tool: &Tool,
    args: &[&str],
    stdin: Option<&[u8]>,
    timeout: Duration,
    max_output: usize,
) -> Result<Output, SourceError> {
    let command = tool.display(args);
    let mut child = Command::new(&tool.program)
        .args(&tool.leading_args)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => SourceError::NotInstalled {
                program: tool.program.clone(),
            },
            _ => SourceError::Spawn {
                command: command.clone(),
                source,
            },
        })?;
    let over = Arc::new(AtomicBool::new(false));
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        let over = Arc::clone(&over);
        thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let mut chunk = [0u8; 64 * 1024];
                loop {
                    match p.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            buf.extend_from_slice(chunk.get(..n).unwrap_or(&[]));
                            if buf.len() > max_output {
                                over.store(true, Ordering::SeqCst);
                                break;
                            }
                        }
                    }
                }
            }
            buf
        })
    };
    let out = reader(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = reader(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let writer = match (stdin, child.stdin.take()) {
        (Some(bytes), Some(mut pipe)) => {
            let bytes = bytes.to_vec();
            // A writer thread, so a child that prints before reading cannot deadlock us.
            Some(thread::spawn(move || {
                let _ = pipe.write_all(&bytes);
            }))
        }
        _ => None,
    };
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SourceError::Spawn { command, source });
            }
        }
        if over.load(Ordering::SeqCst) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(SourceError::TooLarge {
                command,
                limit: max_output,
            });
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(SourceError::Timeout { command, timeout });
        }
        thread::sleep(Duration::from_millis(2));
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if over.load(Ordering::SeqCst) {
        return Err(SourceError::TooLarge {
            command,
            limit: max_output,
        });
    }
    if !status.success() {
        return Err(SourceError::Failed {
            command,
            status: status.to_string(),
            stderr: String::from_utf8_lossy(&stderr).trim().to_owned(),
        });
    }
    Ok(Output { stdout, stderr })
}

/// The outcome of reading one source.
#[derive(Debug)]
pub enum Reading<T> {
    /// Read and parsed.
    Read(T),
    /// The tool is not installed: there is nothing of its kind to read.
    Unavailable {
        /// The program looked for.
        program: PathBuf,
    },
    /// The tool is there but reading failed.
    Failed(SourceError),
}

impl<T> Reading<T> {
    /// The value, when read.
    pub fn value(&self) -> Option<&T> {
        match self {
            Reading::Read(v) => Some(v),
            _ => None,
        }
    }

    fn from_result(r: Result<T, SourceError>) -> Self {
        match r {
            Ok(v) => Reading::Read(v),
            Err(SourceError::NotInstalled { program }) => Reading::Unavailable { program },
            Err(e) => Reading::Failed(e),
        }
    }
}

/// Everything read at one moment.
#[derive(Debug)]
pub struct Snapshot {
    /// `nft -j list ruleset`.
    pub nft: Reading<nft::Ruleset>,
    /// `iptables-save`.
    pub iptables: Reading<iptables::Dump>,
    /// `ip6tables-save`.
    pub ip6tables: Reading<iptables::Dump>,
}

/// Reads `nft -j list ruleset`.
pub fn read_nft(config: &SourceConfig) -> Result<nft::Ruleset, SourceError> {
    let args = ["-j", "list", "ruleset"];
    let out = run(&config.nft, &args, None, config.timeout, config.max_output)?;
    nft::parse_with_limit(&out.stdout, config.max_output).map_err(|source| SourceError::Nft {
        command: config.nft.display(&args),
        source,
    })
}

/// Reads `iptables-save` (IPv4) or `ip6tables-save` (IPv6).
pub fn read_iptables(config: &SourceConfig, family: Family) -> Result<iptables::Dump, SourceError> {
    let tool = match family {
        Family::Ipv4 => &config.iptables_save,
        Family::Ipv6 => &config.ip6tables_save,
    };
    let out = run(tool, &[], None, config.timeout, config.max_output)?;
    iptables::parse_with_limit(&out.stdout, family, config.max_output).map_err(|source| {
        SourceError::Iptables {
            command: tool.display(&[]),
            source,
        }
    })
}

/// Reads all three sources.
pub fn read(config: &SourceConfig) -> Snapshot {
    Snapshot {
        nft: Reading::from_result(read_nft(config)),
        iptables: Reading::from_result(read_iptables(config, Family::Ipv4)),
        ip6tables: Reading::from_result(read_iptables(config, Family::Ipv6)),
    }
}

impl Snapshot {
    /// What was read, as the reduction's input.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            nft: self.nft.value(),
            iptables: [self.iptables.value(), self.ip6tables.value()]
                .into_iter()
                .flatten()
                .collect(),
        }
    }

    /// The reduction of what was read, with each source that failed as an uncertainty
    /// (its tables are missing from the answer; they could only have narrowed it).
    pub fn reduce(&self) -> Reachability {
        let mut r = reduce(&self.inputs());
        r.uncertainties.extend(self.unread());
        r
    }

    /// An uncertainty per family and protocol a failed source could have filtered.
    pub(crate) fn unread(&self) -> Vec<Uncertainty> {
        let mut out = Vec::new();
        let mut add = |e: &SourceError, families: &[Family]| {
            for &family in families {
                for protocol in Protocol::ALL {
                    out.push(Uncertainty {
                        rule: None,
                        reason: error_chain(e),
                        effect: Effect::SourceUnread,
                        family,
                        protocol,
                        ports: vec![PortRange::ALL],
                    });
                }
            }
        };
        if let Reading::Failed(e) = &self.nft {
            add(e, &Family::ALL);
        }
        if let Reading::Failed(e) = &self.iptables {
            add(e, &[Family::Ipv4]);
        }
        if let Reading::Failed(e) = &self.ip6tables {
            add(e, &[Family::Ipv6]);
        }
        out
    }
}

/// An error and its causes on one line.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_is_unavailable() {
        let config = SourceConfig {
            nft: Tool::new("/nonexistent/nft"),
            iptables_save: Tool::new("/nonexistent/iptables-save"),
            ip6tables_save: Tool::new("/nonexistent/ip6tables-save"),
            ..SourceConfig::default()
        };
        let snap = read(&config);
        assert!(matches!(snap.nft, Reading::Unavailable { .. }));
        assert!(matches!(snap.ip6tables, Reading::Unavailable { .. }));
        let r = snap.reduce();
        assert!(r.uncertainties.is_empty());
        assert!(r.is_reachable(Family::Ipv4, Protocol::Tcp, 1));
    }

    #[test]
    fn timeout_kills_and_cap_kills() {
        let e = run(
            &Tool::new("/bin/sleep"),
            &["5"],
            None,
            Duration::from_millis(50),
            100,
        )
        .unwrap_err();
        assert!(matches!(e, SourceError::Timeout { .. }), "{e}");
        let e = run(
            &Tool::new("/usr/bin/yes"),
            &[],
            None,
            Duration::from_secs(10),
            10_000,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "/usr/bin/yes printed more than 10000 bytes and was killed"
        );
    }

    #[test]
    fn stdin_is_fed_and_failures_keep_stderr() {
        let out = run(
            &Tool::new("/bin/cat"),
            &[],
            Some(b"hello"),
            DEFAULT_TIMEOUT,
            100,
        )
        .unwrap();
        assert_eq!(out.stdout, b"hello");
        let e = run(
            &Tool::new("/bin/ls"),
            &["/nonexistent-dir"],
            None,
            DEFAULT_TIMEOUT,
            10_000,
        )
        .unwrap_err();
        assert!(matches!(e, SourceError::Failed { .. }));
        assert!(e.to_string().contains("No such file"), "{e}");
    }

    #[test]
    fn a_failed_source_is_an_uncertainty() {
        let config = SourceConfig {
            nft: Tool::new("/bin/false"),
            iptables_save: Tool::new("/nonexistent/iptables-save"),
            ip6tables_save: Tool::new("/nonexistent/ip6tables-save"),
            ..SourceConfig::default()
        };
        let r = read(&config).reduce();
        assert_eq!(r.uncertainties.len(), 4);
        assert!(
            r.uncertainties
                .iter()
                .all(|u| u.effect == Effect::SourceUnread)
        );
    }
}
