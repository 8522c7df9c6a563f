//! RAPL: CPU package (and optionally DRAM) power from the powercap sysfs tree.
//!
//! Why this module exists: the power rules want the whole node's draw, and on bare metal the
//! CPUs' share is only visible as RAPL energy counters. They are counters, not gauges: power
//! is the difference of two readings over the time between them, and the counter wraps at
//! `max_energy_range_uj` (about 20 minutes at 200 W), so the difference is taken modulo
//! `max + 1`. A counter that seems to go backwards by more than a wrap could explain (the
//! wrapped difference would mean an impossible power) is an error, not a huge reading.
//!
//! Zones are identified by their `name` file, not their index: `intel-rapl:N` directories
//! are top level (`package-N`, sometimes `psys` or `dram`), `intel-rapl:N:M` are subzones
//! (`core`, `uncore`, `dram`) already counted in their package. Only top-level package zones
//! are summed, plus `dram` zones when configured; `intel-rapl-mmio:*` count a package a second
//! time and are skipped.
//!
//! Since Linux 5.10 `energy_uj` is readable by root only (CVE-2020-8694): EACCES makes the
//! source unavailable, with that reason. Reads go through the [`Sysfs`] trait so that tests
//! (which run as root) can inject EACCES, ENODATA and EIO.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::Collected;
use crate::source::{self, Failure, FileError, Unavailable, Value, read_regular_file};

/// Largest sysfs attribute read.
const MAX_ATTRIBUTE_BYTES: usize = 4096;
/// Most zones looked at (a 8-socket server with subzones has about 40).
const MAX_ZONES: usize = 1024;

/// Reads sysfs. The real one is [`RealSysfs`]; tests inject errors.
pub trait Sysfs {
    /// Reads a small attribute file.
    fn read(&self, path: &Path) -> Result<Vec<u8>, FileError>;
    /// The names of a directory's entries.
    fn list(&self, dir: &Path) -> Result<Vec<String>, FileError>;
}

/// The real sysfs, through the capped regular-file reader.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealSysfs;

impl Sysfs for RealSysfs {
    fn read(&self, path: &Path) -> Result<Vec<u8>, FileError> {
        read_regular_file(path, MAX_ATTRIBUTE_BYTES)
    }

    fn list(&self, dir: &Path) -> Result<Vec<String>, FileError> {
        let entries = std::fs::read_dir(dir).map_err(|e| FileError::from_io(dir, e))?;
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| FileError::from_io(dir, e))?;
            if let Some(name) = entry.file_name().to_str() {
                names.push(name.to_owned());
            }
            if names.len() > MAX_ZONES {
                break;
            }
        }
        Ok(names)
    }
}

/// Where and what to read.
#[derive(Debug, Clone)]
pub struct RaplConfig {
    /// The powercap directory. Default `/sys/class/powercap`.
    pub root: PathBuf,
    /// Whether `dram` zones are added to the packages. Default false.
    pub include_dram: bool,
    /// The most a zone can draw, watts; a difference implying more is an error (a counter
    /// that went backwards, or more than one wrap between samples). Default 1000.
    pub max_zone_watts: f64,
}

impl Default for RaplConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/sys/class/powercap"),
            include_dram: false,
            max_zone_watts: 1000.0,
        }
    }
}

/// What a zone measures, from its `name` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZoneKind {
    /// `package-N`.
    Package(u32),
    /// `dram`.
    Dram,
    /// `core`.
    Core,
    /// `uncore`.
    Uncore,
    /// `psys` (the platform; includes the packages).
    Psys,
    /// Anything else.
    Other,
}

impl ZoneKind {
    fn from_name(name: &str) -> Self {
        match name {
            "dram" => Self::Dram,
            "core" => Self::Core,
            "uncore" => Self::Uncore,
            "psys" => Self::Psys,
            _ => match name.strip_prefix("package-").map(str::parse) {
                Some(Ok(n)) => Self::Package(n),
                _ => Self::Other,
            },
        }
    }
}

/// A zone that is summed.
#[derive(Debug, Clone, PartialEq)]
pub struct Zone {
    /// Directory name (`intel-rapl:0`).
    pub id: String,
    /// Its `name` (`package-0`).
    pub name: String,
    /// What it measures.
    pub kind: ZoneKind,
    /// Directory.
    pub dir: PathBuf,
    /// Where `energy_uj` wraps.
    pub max_energy_range_uj: u64,
}

/// One zone's power over the last interval.
#[derive(Debug, Clone, PartialEq)]
pub struct ZonePower {
    /// Directory name.
    pub id: String,
    /// Its `name`.
    pub name: String,
    /// Watts; absent on the first sample.
    pub watts: Value<f64>,
}

/// Power over the last interval.
#[derive(Debug, Clone, PartialEq)]
pub struct RaplPower {
    /// Sum of the summed zones, watts; absent on the first sample (a counter needs two).
    pub total_watts: Value<f64>,
    /// Per zone.
    pub zones: Vec<ZonePower>,
    /// The interval the power is averaged over; `None` on the first sample.
    pub interval: Option<Duration>,
}

/// Why reading the powercap tree failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RaplError {
    /// A file could not be read (ENODATA, EIO…).
    #[error(transparent)]
    File(#[from] FileError),
    /// A file does not hold what it should.
    #[error("{path}: {value:?} is not {expected}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it held.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The counter is above its own wrap point.
    #[error("{path}: {value} is above max_energy_range_uj {max}")]
    AboveRange {
        /// The `energy_uj` file.
        path: PathBuf,
        /// The reading.
        value: u64,
        /// The wrap point.
        max: u64,
    },
    /// The counter went backwards by more than a wrap explains.
    #[error(
        "{path}: energy went from {old} to {new} µJ in {interval:?}; as a wrap that would be {watts:.0} W, so the counter went backwards"
    )]
    Backwards {
        /// The `energy_uj` file.
        path: PathBuf,
        /// Previous reading.
        old: u64,
        /// This reading.
        new: u64,
        /// Time between them.
        interval: Duration,
        /// The power a wrap would imply.
        watts: f64,
    },
    /// The counter rose faster than any zone draws: a reset, or more than one wrap.
    #[error(
        "{path}: energy went from {old} to {new} µJ in {interval:?}, {watts:.0} W, above the {limit} W a zone can draw"
    )]
    Implausible {
        /// The `energy_uj` file.
        path: PathBuf,
        /// Previous reading.
        old: u64,
        /// This reading.
        new: u64,
        /// Time between them.
        interval: Duration,
        /// The implied power.
        watts: f64,
        /// The configured limit.
        limit: f64,
    },
    /// Two samples at the same instant, or the second before the first.
    #[error("no time passed between two samples")]
    NoInterval,
}

const EACCES_HINT: &str =
    "energy_uj is readable by root only since Linux 5.10 (CVE-2020-8694); run the agent as root";

fn read_u64(sysfs: &dyn Sysfs, path: &Path) -> Result<u64, Failure> {
    let bytes = sysfs.read(path).map_err(|e| match e {
        FileError::PermissionDenied { path } => {
            Failure::Unavailable(Unavailable::PermissionDenied {
                path,
                hint: EACCES_HINT.to_owned(),
            })
        }
        other => Failure::Error(RaplError::File(other).into()),
    })?;
    let text = String::from_utf8_lossy(&bytes);
    text.trim().parse::<u64>().map_err(|_| {
        RaplError::Parse {
            path: path.to_path_buf(),
            value: crate::text::excerpt(text.trim()),
            expected: "an unsigned integer",
        }
        .into()
    })
}

/// Finds the zones to sum.
pub fn discover(sysfs: &dyn Sysfs, config: &RaplConfig) -> Result<Vec<Zone>, Failure> {
    let entries = match sysfs.list(&config.root) {
        Ok(e) => e,
        Err(FileError::NotFound { path }) => {
            return Err(Failure::Unavailable(Unavailable::Missing { path }));
        }
        Err(e) => return Err(RaplError::File(e).into()),
    };
    let mut zones = Vec::new();
    for id in entries.into_iter().take(MAX_ZONES) {
        // `intel-rapl-mmio:*` measure a package that `intel-rapl:*` already measures.
        let Some(index) = id.strip_prefix("intel-rapl:") else {
            continue;
        };
        let top_level = !index.contains(':');
        let dir = config.root.join(&id);
        let name_path = dir.join("name");
        let name = match sysfs.read(&name_path) {
            Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
            Err(FileError::PermissionDenied { path }) => {
                return Err(Failure::Unavailable(Unavailable::PermissionDenied {
                    path,
                    hint: EACCES_HINT.to_owned(),
                }));
            }
            Err(e) => return Err(RaplError::File(e).into()),
        };
        let kind = ZoneKind::from_name(&name);
        let wanted = match kind {
            ZoneKind::Package(_) => top_level,
            ZoneKind::Dram => config.include_dram,
            _ => false,
        };
        if !wanted {
            continue;
        }
        let max_energy_range_uj = read_u64(sysfs, &dir.join("max_energy_range_uj"))?;
        zones.push(Zone {
            id,
            name,
            kind,
            dir,
            max_energy_range_uj,
        });
    }
    if zones.is_empty() {
        return Err(Failure::Unavailable(Unavailable::Empty {
            what: format!("{} has no RAPL package zone", config.root.display()),
        }));
    }
    zones.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(zones)
}

/// The energy used between two counter readings, in µJ, allowing one wrap.
pub fn energy_delta(old: u64, new: u64, max_energy_range_uj: u64) -> u64 {
    if new >= old {
        new - old
    } else {
        // (new - old) mod (max + 1), in u128 so that max = u64::MAX cannot overflow.
        let modulus = u128::from(max_energy_range_uj) + 1;
        let d = (u128::from(new) + modulus - u128::from(old)) % modulus;
        u64::try_from(d).unwrap_or(u64::MAX)
    }
}

/// Turns `energy_uj` readings into watts.
#[derive(Debug, Clone)]
pub struct RaplSampler {
    config: RaplConfig,
    zones: Vec<Zone>,
    last: Option<(Instant, Vec<u64>)>,
}

impl RaplSampler {
    /// A sampler over the zones found under the configured root.
    pub fn discover(sysfs: &dyn Sysfs, config: RaplConfig) -> Result<Self, Failure> {
        let zones = discover(sysfs, &config)?;
        Ok(Self {
            config,
            zones,
            last: None,
        })
    }

    /// The zones summed.
    pub fn zones(&self) -> &[Zone] {
        &self.zones
    }

    /// Reads every zone's counter at `at` and returns the power since the previous sample.
    /// The first sample has no power (two readings are needed). After an error the next
    /// sample starts from this one's readings.
    pub fn sample(&mut self, sysfs: &dyn Sysfs, at: Instant) -> Result<RaplPower, Failure> {
        let mut now = Vec::with_capacity(self.zones.len());
        for z in &self.zones {
            let path = z.dir.join("energy_uj");
            let v = read_u64(sysfs, &path)?;
            if v > z.max_energy_range_uj {
                return Err(RaplError::AboveRange {
                    path,
                    value: v,
                    max: z.max_energy_range_uj,
                }
                .into());
            }
            now.push(v);
        }
        let previous = self.last.replace((at, now.clone()));
        let Some((then, old)) = previous else {
            return Ok(RaplPower {
                total_watts: Value::Absent(source::Absent::NotAvailable),
                zones: self
                    .zones
                    .iter()
                    .map(|z| ZonePower {
                        id: z.id.clone(),
                        name: z.name.clone(),
                        watts: Value::Absent(source::Absent::NotAvailable),
                    })
                    .collect(),
                interval: None,
            });
        };
        let interval = at.checked_duration_since(then).unwrap_or_default();
        if interval.is_zero() {
            return Err(RaplError::NoInterval.into());
        }
        let micros = interval.as_secs_f64() * 1e6;
        let mut zones = Vec::with_capacity(self.zones.len());
        let mut total = 0.0;
        for ((z, &o), &n) in self.zones.iter().zip(&old).zip(&now) {
            let delta = energy_delta(o, n, z.max_energy_range_uj);
            let watts = delta as f64 / micros;
            if watts > self.config.max_zone_watts {
                let path = z.dir.join("energy_uj");
                return Err(if n < o {
                    RaplError::Backwards {
                        path,
                        old: o,
                        new: n,
                        interval,
                        watts,
                    }
                } else {
                    RaplError::Implausible {
                        path,
                        old: o,
                        new: n,
                        interval,
                        watts,
                        limit: self.config.max_zone_watts,
                    }
                }
                .into());
            }
            total += watts;
            zones.push(ZonePower {
                id: z.id.clone(),
                name: z.name.clone(),
                watts: Value::Present(watts),
            });
        }
        Ok(RaplPower {
            total_watts: Value::Present(total),
            zones,
            interval: Some(interval),
        })
    }
}

/// The RAPL source: discovers zones on first use, then samples.
pub struct Rapl<S: Sysfs = RealSysfs> {
    sysfs: S,
    config: RaplConfig,
    sampler: Option<RaplSampler>,
}

impl Rapl<RealSysfs> {
    /// The real sysfs with `config`.
    pub fn new(config: RaplConfig) -> Self {
        Self::with_sysfs(RealSysfs, config)
    }
}

impl<S: Sysfs> Rapl<S> {
    /// Another sysfs (a test double).
    pub fn with_sysfs(sysfs: S, config: RaplConfig) -> Self {
        Self {
            sysfs,
            config,
            sampler: None,
        }
    }

    /// Samples now.
    pub fn collect(&mut self) -> Collected<RaplPower> {
        self.collect_at(Instant::now())
    }

    /// Samples at `at` (tests pass their own instants).
    pub fn collect_at(&mut self, at: Instant) -> Collected<RaplPower> {
        source::stamp(self.try_collect(at))
    }

    fn try_collect(&mut self, at: Instant) -> Result<RaplPower, Failure> {
        let sampler = match &mut self.sampler {
            Some(s) => s,
            None => self
                .sampler
                .insert(RaplSampler::discover(&self.sysfs, self.config.clone())?),
        };
        sampler.sample(&self.sysfs, at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_wraps_modulo_max_plus_one() {
        assert_eq!(energy_delta(10, 25, 100), 15);
        assert_eq!(energy_delta(95, 5, 100), 11);
        assert_eq!(energy_delta(100, 0, 100), 1);
        assert_eq!(energy_delta(u64::MAX, 0, u64::MAX), 1);
    }

    #[test]
    fn zone_kinds_come_from_names() {
        assert_eq!(ZoneKind::from_name("package-10"), ZoneKind::Package(10));
        assert_eq!(ZoneKind::from_name("dram"), ZoneKind::Dram);
        assert_eq!(ZoneKind::from_name("package-x"), ZoneKind::Other);
    }
}
