//! Where the agent's readings come from, and what it remembers of each source.
//!
//! Why this module exists: a cycle must tell, for every source, a reading from a source
//! that does not exist here from one that failed, and must keep using a reading for a
//! while after its source stops answering without ever passing it off as current. The
//! [`Sources`] trait is the one seam between the agent and the node (the real one,
//! [`HostSources`], runs the probity-collect and probity-firewall sources; benchmarks and
//! tests may bring their own), and [`SourceState`] is the memory: the last good reading
//! with the agent's time it was taken, the last outcome, and whether the reading is
//! stale.
//!
//! Invariant: a source is *unreadable* when it is enabled and has no good reading, or its
//! last good reading is older than the configured age (or stamped after the agent's
//! clock). A failure while the last reading is still fresh is reported, not yet a finding.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use probity_collect::dcgm::{DcgmReport, DcgmScrape};
use probity_collect::ipmi::{DcmiPower, Ipmitool};
use probity_collect::nvidia_smi::{GpuQuery, NvidiaSmi};
use probity_collect::rapl::{Rapl, RaplConfig, RaplPower};
use probity_collect::sockets::{ListeningSocket, ProcNet};
use probity_collect::source::{FileError, read_regular_file};
use probity_collect::{Collected, Freshness};
use probity_firewall::source::{SourceConfig, Tool};
use serde::Serialize;
use thiserror::Error;

use crate::config::Config;

/// Largest `/proc/stat` read (the `intr` line of a large machine is long).
pub const MAX_PROC_STAT_BYTES: usize = 16 * 1024 * 1024;

/// The agent's view of the node: one method per source. A method that returns `None`
/// says the source is turned off in the configuration.
pub trait Sources: Send {
    /// `nvidia-smi --query-gpu`.
    fn gpus(&mut self) -> Option<Collected<Vec<GpuQuery>>>;
    /// The DCGM exporter.
    fn dcgm(&mut self) -> Option<Collected<DcgmReport>>;
    /// RAPL package power since the previous call.
    fn rapl(&mut self) -> Option<Collected<RaplPower>>;
    /// The BMC's DCMI power reading.
    fn bmc_power(&mut self) -> Option<Collected<DcmiPower>>;
    /// Listening sockets.
    fn sockets(&mut self) -> Collected<Vec<ListeningSocket>>;
    /// The CPU count; `None` when the inventory states it.
    fn cpu_count(&mut self) -> Option<Result<u32, CpuCountError>>;
    /// The firewall rulesets.
    fn firewall(&mut self) -> probity_firewall::source::Snapshot;
}

/// The node itself, through probity-collect and probity-firewall, as configured.
pub struct HostSources {
    nvidia_smi: Option<NvidiaSmi>,
    dcgm: Option<DcgmScrape>,
    rapl: Option<Rapl>,
    ipmi: Option<Ipmitool>,
    proc_net: ProcNet,
    proc_root: PathBuf,
    cpu_count_known: bool,
    firewall: SourceConfig,
}

impl std::fmt::Debug for HostSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSources")
            .field("proc_root", &self.proc_root)
            .finish_non_exhaustive()
    }
}

/// The firewall sources of a configuration (`nft`, and the iptables dumps unless off).
pub fn firewall_sources(config: &Config) -> SourceConfig {
    let fw = &config.firewall;
    // A tool that is not installed is no rules; a path that cannot exist turns one off.
    let off = || Tool::new("/nonexistent/probity-disabled");
    SourceConfig {
        nft: Tool::new(&fw.nft),
        iptables_save: if fw.read_iptables {
            Tool::new(&fw.iptables_save)
        } else {
            off()
        },
        ip6tables_save: if fw.read_iptables {
            Tool::new(&fw.ip6tables_save)
        } else {
            off()
        },
        timeout: fw.timeout,
        ..SourceConfig::default()
    }
}

impl HostSources {
    /// The sources `config` turns on.
    pub fn new(config: &Config) -> Self {
        Self {
            nvidia_smi: config.nvidia_smi.enabled.then(|| {
                NvidiaSmi::new()
                    .binary(&config.nvidia_smi.binary)
                    .timeout(config.nvidia_smi.timeout)
            }),
            dcgm: config
                .dcgm
                .url
                .as_ref()
                .map(|u| DcgmScrape::new(u.clone()).timeout(config.dcgm.timeout)),
            rapl: config.rapl.enabled.then(|| {
                Rapl::new(RaplConfig {
                    root: config.rapl.root.clone(),
                    include_dram: config.rapl.include_dram,
                    ..RaplConfig::default()
                })
            }),
            ipmi: config.ipmi.enabled.then(|| {
                Ipmitool::new()
                    .binary(&config.ipmi.binary)
                    .timeout(config.ipmi.timeout)
            }),
            proc_net: ProcNet::new(&config.proc_root),
            proc_root: config.proc_root.clone(),
            cpu_count_known: config.inventory.cpu_count.is_some(),
            firewall: firewall_sources(config),
        }
    }
}

impl Sources for HostSources {
    fn gpus(&mut self) -> Option<Collected<Vec<GpuQuery>>> {
        self.nvidia_smi.as_ref().map(NvidiaSmi::query_gpu)
    }

    fn dcgm(&mut self) -> Option<Collected<DcgmReport>> {
        self.dcgm.as_ref().map(DcgmScrape::scrape)
    }

    fn rapl(&mut self) -> Option<Collected<RaplPower>> {
        self.rapl.as_mut().map(Rapl::collect)
    }

    fn bmc_power(&mut self) -> Option<Collected<DcmiPower>> {
        self.ipmi.as_ref().map(Ipmitool::power_reading)
    }

    fn sockets(&mut self) -> Collected<Vec<ListeningSocket>> {
        self.proc_net.listening()
    }

    fn cpu_count(&mut self) -> Option<Result<u32, CpuCountError>> {
        if self.cpu_count_known {
            return None;
        }
        Some(read_cpu_count(&self.proc_root))
    }

    fn firewall(&mut self) -> probity_firewall::source::Snapshot {
        probity_firewall::source::read(&self.firewall)
    }
}

/// Why the CPU count could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CpuCountError {
    /// `/proc/stat` could not be read.
    #[error(transparent)]
    File(#[from] FileError),
    /// It does not hold what it should.
    #[error("{path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        #[source]
        source: ProcStatError,
    },
}

/// A `/proc/stat` that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProcStatError {
    /// Larger than [`MAX_PROC_STAT_BYTES`].
    #[error("{len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Input length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A `cpuN` line whose number is not a CPU number.
    #[error("line {line}, column {column}: {text:?} is not a cpuN line")]
    BadCpuLine {
        /// 1-based line.
        line: usize,
        /// 1-based column of the bad part.
        column: usize,
        /// The start of the line.
        text: String,
    },
    /// No `cpuN` line at all.
    #[error("no cpuN line: not a /proc/stat")]
    NoCpu,
}

/// Counts the `cpuN` lines of `/proc/stat` (one per online CPU).
pub fn parse_proc_stat_cpus(input: &[u8]) -> Result<u32, ProcStatError> {
    if input.len() > MAX_PROC_STAT_BYTES {
        return Err(ProcStatError::TooLarge {
            len: input.len(),
            limit: MAX_PROC_STAT_BYTES,
        });
    }
    let mut count: u32 = 0;
    for (i, line) in input.split(|&b| b == b'\n').enumerate() {
        let Some(rest) = line.strip_prefix(b"cpu") else {
            continue;
        };
        // The aggregate line is "cpu " followed by the totals.
        if rest.first().is_none_or(|b| !b.is_ascii_digit()) {
            continue;
        }
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let after = rest.get(digits).copied();
        let ok = digits <= 7 && matches!(after, Some(b' ') | None);
        if !ok {
            let shown: String = String::from_utf8_lossy(line).chars().take(40).collect();
            return Err(ProcStatError::BadCpuLine {
                line: i + 1,
                column: 4 + digits,
                text: shown,
            });
        }
        count = count.saturating_add(1);
    }
    if count == 0 {
        return Err(ProcStatError::NoCpu);
    }
    Ok(count)
}

/// Reads the CPU count from `<proc_root>/stat`.
pub fn read_cpu_count(proc_root: &Path) -> Result<u32, CpuCountError> {
    let path = proc_root.join("stat");
    let bytes = read_regular_file(&path, MAX_PROC_STAT_BYTES)?;
    parse_proc_stat_cpus(&bytes).map_err(|source| CpuCountError::Parse { path, source })
}

/// An error and its causes, joined by `: `.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        // Transparent wrappers repeat their cause's text.
        if !s.ends_with(&next) {
            s.push_str(": ");
            s.push_str(&next);
        }
        cause = c.source();
    }
    s
}

/// How the last collection from a source ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Outcome {
    /// Turned off in the configuration.
    Disabled,
    /// Not collected yet.
    Never,
    /// A reading.
    Ok {
        /// When, in Unix seconds.
        at: u64,
    },
    /// The source does not exist on this node.
    Unavailable {
        /// Why.
        reason: String,
        /// When, in Unix seconds.
        at: u64,
    },
    /// The source exists and failed; the located error.
    Error {
        /// The error and its causes.
        error: String,
        /// When, in Unix seconds.
        at: u64,
    },
}

impl Outcome {
    /// `ok`, `unavailable`, `error`, `disabled` or `never`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::Never => "never",
            Self::Ok { .. } => "ok",
            Self::Unavailable { .. } => "unavailable",
            Self::Error { .. } => "error",
        }
    }
}

/// Seconds since the Unix epoch (0 before it).
pub fn unix(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What the agent remembers of one source.
#[derive(Debug, Clone)]
pub struct SourceState<T> {
    name: &'static str,
    enabled: bool,
    last_good: Option<(SystemTime, T)>,
    outcome: Outcome,
    /// Whether the last collection (this cycle's) gave a reading.
    fresh: bool,
}

/// One source's line in the status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourceStatus {
    /// How its last collection ended.
    pub last: Outcome,
    /// When its last good reading was taken, in Unix seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_ok_at: Option<u64>,
    /// Whether it is in the node's `unreadable` set.
    pub unreadable: bool,
    /// Why, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why_unreadable: Option<String>,
}

impl<T> SourceState<T> {
    /// A source named `name` (as it appears in `unreadable`), on or off.
    pub fn new(name: &'static str, enabled: bool) -> Self {
        Self {
            name,
            enabled,
            last_good: None,
            outcome: if enabled {
                Outcome::Never
            } else {
                Outcome::Disabled
            },
            fresh: false,
        }
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether it is read at all.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Takes this cycle's collection, stamped with the agent's `now`. `None` means the
    /// source was off.
    pub fn record(&mut self, collected: Option<Collected<T>>, now: SystemTime) {
        self.fresh = false;
        let Some(c) = collected else {
            self.enabled = false;
            self.outcome = Outcome::Disabled;
            return;
        };
        self.enabled = true;
        let at = unix(now);
        match c {
            Collected::Ok(r) => {
                self.last_good = Some((now, r.value));
                self.outcome = Outcome::Ok { at };
                self.fresh = true;
            }
            Collected::Unavailable { reason, .. } => {
                self.outcome = Outcome::Unavailable {
                    reason: reason.to_string(),
                    at,
                };
            }
            Collected::Error { error, .. } => {
                self.outcome = Outcome::Error {
                    error: error_chain(&error),
                    at,
                };
            }
        }
    }

    /// Takes a result of a source that is not a probity-collect one.
    pub fn record_result<E: std::error::Error>(
        &mut self,
        result: Option<Result<T, E>>,
        now: SystemTime,
    ) {
        match result {
            None => self.record(None, now),
            Some(Ok(v)) => self.record(
                Some(Collected::Ok(probity_collect::Reading::new(v, now))),
                now,
            ),
            Some(Err(e)) => {
                self.fresh = false;
                self.enabled = true;
                self.outcome = Outcome::Error {
                    error: error_chain(&e),
                    at: unix(now),
                };
            }
        }
    }

    /// Takes a reading that is not a probity-collect collection.
    pub fn record_ok(&mut self, value: T, now: SystemTime) {
        self.record(
            Some(Collected::Ok(probity_collect::Reading::new(value, now))),
            now,
        );
    }

    /// Takes "the source does not exist here", with why.
    pub fn record_unavailable(&mut self, reason: String, now: SystemTime) {
        self.fresh = false;
        self.enabled = true;
        self.outcome = Outcome::Unavailable {
            reason,
            at: unix(now),
        };
    }

    /// Takes a failure, with its located error.
    pub fn record_failure(&mut self, error: String, now: SystemTime) {
        self.fresh = false;
        self.enabled = true;
        self.outcome = Outcome::Error {
            error,
            at: unix(now),
        };
    }

    /// The last good reading, stale or not, and when it was taken.
    pub fn last_good(&self) -> Option<(SystemTime, &T)> {
        self.last_good.as_ref().map(|(t, v)| (*t, v))
    }

    /// The last good reading's value.
    pub fn value(&self) -> Option<&T> {
        self.last_good.as_ref().map(|(_, v)| v)
    }

    /// Whether this cycle's collection gave a reading.
    pub fn is_fresh(&self) -> bool {
        self.fresh
    }

    /// The last outcome.
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// Why the source is unreadable at `now`, if it is (module docs).
    pub fn unreadable(&self, now: SystemTime, stale_after: Duration) -> Option<String> {
        if !self.enabled {
            return None;
        }
        let Some((at, _)) = &self.last_good else {
            return Some(match &self.outcome {
                Outcome::Unavailable { reason, .. } => format!("unavailable: {reason}"),
                Outcome::Error { error, .. } => format!("error: {error}"),
                _ => "no reading yet".to_owned(),
            });
        };
        match probity_collect::source::freshness(*at, stale_after, now) {
            Freshness::Fresh => None,
            Freshness::Stale { age } => Some(format!(
                "last reading {}s old, over {}s ({})",
                age.as_secs(),
                stale_after.as_secs(),
                match &self.outcome {
                    Outcome::Unavailable { reason, .. } => format!("now unavailable: {reason}"),
                    Outcome::Error { error, .. } => format!("now failing: {error}"),
                    _ => "not collected since".to_owned(),
                }
            )),
            Freshness::FromFuture { ahead } => Some(format!(
                "last reading stamped {}s after the agent's clock",
                ahead.as_secs()
            )),
        }
    }

    /// Its status line at `now`.
    pub fn status(&self, now: SystemTime, stale_after: Duration) -> SourceStatus {
        let why = self.unreadable(now, stale_after);
        SourceStatus {
            last: self.outcome.clone(),
            last_ok_at: self.last_good.as_ref().map(|(t, _)| unix(*t)),
            unreadable: why.is_some(),
            why_unreadable: why,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use probity_collect::{Reading, Unavailable};

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    #[test]
    fn cpu_lines_are_counted_and_the_aggregate_is_not() {
        let stat = b"cpu  1 2 3\ncpu0 1 2 3\ncpu1 4 5 6\nintr 1 2\nctxt 5\n";
        assert_eq!(parse_proc_stat_cpus(stat), Ok(2));
        assert_eq!(parse_proc_stat_cpus(b"intr 1\n"), Err(ProcStatError::NoCpu));
        assert!(matches!(
            parse_proc_stat_cpus(b"cpu  1\ncpu0x 1\n"),
            Err(ProcStatError::BadCpuLine {
                line: 2,
                column: 5,
                ..
            })
        ));
    }

    #[test]
    fn a_source_without_a_reading_is_unreadable_with_its_reason() {
        let mut s: SourceState<u8> = SourceState::new("ipmi", true);
        assert_eq!(
            s.unreadable(t(0), Duration::from_secs(60)).as_deref(),
            Some("no reading yet")
        );
        s.record(
            Some(Collected::Unavailable {
                reason: Unavailable::Missing {
                    path: "/dev/ipmi0".into(),
                },
                checked_at: t(0),
            }),
            t(0),
        );
        let why = s.unreadable(t(0), Duration::from_secs(60)).unwrap();
        assert!(why.contains("/dev/ipmi0 does not exist"), "{why}");
        assert_eq!(s.value(), None, "never a zero reading");
    }

    #[test]
    fn a_failure_keeps_a_fresh_reading_until_it_goes_stale() {
        let mut s: SourceState<u8> = SourceState::new("nvidia-smi", true);
        s.record(Some(Collected::Ok(Reading::new(7, t(0)))), t(0));
        assert!(s.is_fresh());
        s.record(
            Some(Collected::Unavailable {
                reason: Unavailable::Empty { what: "x".into() },
                checked_at: t(30),
            }),
            t(30),
        );
        assert!(!s.is_fresh());
        assert_eq!(s.value(), Some(&7));
        assert_eq!(s.unreadable(t(30), Duration::from_secs(60)), None);
        let why = s.unreadable(t(61), Duration::from_secs(60)).unwrap();
        assert!(why.contains("61s old"), "{why}");
        // A disabled source is never unreadable.
        s.record(None, t(62));
        assert_eq!(s.unreadable(t(1000), Duration::from_secs(60)), None);
    }

    #[test]
    fn a_reading_from_the_future_is_not_fresh() {
        let mut s: SourceState<u8> = SourceState::new("rapl", true);
        s.record(Some(Collected::Ok(Reading::new(1, t(100)))), t(100));
        assert!(s.unreadable(t(50), Duration::from_secs(60)).is_some());
    }
}
