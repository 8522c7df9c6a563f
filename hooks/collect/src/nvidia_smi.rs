//! `nvidia-smi`: per-GPU temperature, power, memory, MIG mode and driver.
//!
//! Why this module exists: `nvidia-smi` is on every NVIDIA node, but what it prints depends on
//! the `--format` flags, the driver generation and the board. `[N/A]` and `[Not Supported]`
//! stand where numbers would be (SXM boards have no fan speed), `power.draw` is a 1-second
//! average on Ampere and newer while `power.draw.instant` is the instantaneous reading, and the
//! XML report grew a second power section (`gpu_power_readings` beside
//! `module_power_readings`). The parsers here turn all of it into one set of typed values in
//! which a placeholder is [`Value::Absent`], never 0.
//!
//! Three inputs are parsed:
//! * `--query-gpu=<fields> --format=csv[,noheader][,nounits]` ([`parse_query_gpu`], on top of
//!   the generic [`parse_table`] that also reads `--query-compute-apps` and friends);
//! * `-q -x` XML ([`parse_query_xml`], with `roxmltree`);
//! * `-q` text ([`parse_query_text`]), the same report for humans, which is what the real
//!   captures in testdata hold.
//!
//! [`NvidiaSmi`] runs the tool through the command runner.

use std::path::PathBuf;
use std::time::Duration;

use crate::Collected;
use crate::source::{self, Absent, CommandError, CommandSpec, Failure, Unavailable, Value};

mod csv;
mod report;

pub use csv::{Columns, CsvError, Row, Table, parse_query_gpu, parse_table};
pub use report::{ReportError, parse_query_text, parse_query_xml};

/// Largest CSV output accepted (an 8-GPU node prints about 2 KiB with the default fields).
pub const MAX_CSV_BYTES: usize = 1024 * 1024;
/// Largest `-q` / `-q -x` report accepted (about 25 KiB per GPU).
pub const MAX_REPORT_BYTES: usize = 8 * 1024 * 1024;

/// The fields [`NvidiaSmi::query_gpu`] asks for.
pub const QUERY_GPU_FIELDS: &[&str] = &[
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "driver_version",
    "temperature.gpu",
    "power.draw",
    "power.draw.instant",
    "power.limit",
    "memory.total",
    "memory.used",
    "mig.mode.current",
    "fan.speed",
];

/// Fields a driver older than the R530 branch does not know; dropped on a retry.
const OPTIONAL_FIELDS: &[&str] = &["power.draw.instant"];

/// One GPU as `--query-gpu` reports it. A field that was not queried is
/// [`Absent::NotQueried`].
#[derive(Debug, Clone, PartialEq)]
pub struct GpuQuery {
    /// The CSV line this GPU came from.
    pub line: usize,
    /// `index`.
    pub index: Value<u32>,
    /// `uuid`.
    pub uuid: Value<String>,
    /// `name` (product name).
    pub name: Value<String>,
    /// `pci.bus_id`.
    pub pci_bus_id: Value<String>,
    /// `driver_version`.
    pub driver_version: Value<String>,
    /// `temperature.gpu`, degrees C.
    pub temperature_c: Value<f64>,
    /// The power reading: `power.draw.instant` when printed, else `power.draw`.
    pub power: Value<PowerDraw>,
    /// `power.limit`, watts.
    pub power_limit_w: Value<f64>,
    /// `memory.total`, MiB.
    pub memory_total_mib: Value<u64>,
    /// `memory.used`, MiB.
    pub memory_used_mib: Value<u64>,
    /// `mig.mode.current`.
    pub mig_mode: Value<MigMode>,
    /// `fan.speed`, percent (`[N/A]` on SXM boards: fan RPM comes from IPMI).
    pub fan_speed_pct: Value<f64>,
}

/// A power reading and which reading it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerDraw {
    /// Watts.
    pub watts: f64,
    /// Which of the tool's readings this is.
    pub kind: PowerKind,
}

/// Which power reading a value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerKind {
    /// Instantaneous (`power.draw.instant`, `instant_power_draw`).
    Instant,
    /// `power.draw` / `power_draw`: a 1-second average on Ampere and newer, instantaneous on
    /// older boards.
    Draw,
    /// The averaged reading (`power.draw.average`, `average_power_draw`).
    Average,
}

/// MIG mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigMode {
    /// MIG is on.
    Enabled,
    /// MIG is off.
    Disabled,
}

impl MigMode {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "Enabled" => Some(Self::Enabled),
            "Disabled" => Some(Self::Disabled),
            _ => None,
        }
    }
}

/// The whole `-q` / `-q -x` report.
#[derive(Debug, Clone, PartialEq)]
pub struct QueryReport {
    /// Driver version.
    pub driver_version: Value<String>,
    /// CUDA version the driver supports.
    pub cuda_version: Value<String>,
    /// One entry per GPU, in the tool's order.
    pub gpus: Vec<GpuReport>,
}

/// One GPU of the `-q` / `-q -x` report.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReport {
    /// PCI bus id (the `id` attribute, or the `GPU <id>` heading).
    pub pci_bus_id: String,
    /// Product name.
    pub product_name: Value<String>,
    /// UUID.
    pub uuid: Value<String>,
    /// Minor number (`/dev/nvidiaN`).
    pub minor_number: Value<u32>,
    /// GPU temperature, degrees C.
    pub temperature_c: Value<f64>,
    /// GPU power reading (from the GPU section, never the module section): instant when
    /// printed, else the plain or average draw.
    pub power: Value<PowerDraw>,
    /// Current power limit, watts.
    pub power_limit_w: Value<f64>,
    /// Frame buffer total, MiB.
    pub memory_total_mib: Value<u64>,
    /// Frame buffer used, MiB.
    pub memory_used_mib: Value<u64>,
    /// Fan speed, percent.
    pub fan_speed_pct: Value<f64>,
    /// MIG mode now.
    pub mig_current: Value<MigMode>,
    /// MIG mode after the next reset.
    pub mig_pending: Value<MigMode>,
    /// MIG devices, when MIG is on and instances exist.
    pub mig_devices: Vec<MigDevice>,
}

/// One MIG device of a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct MigDevice {
    /// MIG device index.
    pub index: u32,
    /// GPU instance id.
    pub gpu_instance_id: u32,
    /// Compute instance id.
    pub compute_instance_id: u32,
    /// Its share of the frame buffer, MiB.
    pub memory_total_mib: Value<u64>,
    /// Used, MiB.
    pub memory_used_mib: Value<u64>,
}

/// Recognises the tool's placeholders, bracketed (CSV) or bare (`-q`, XML).
pub(crate) fn placeholder(raw: &str) -> Option<Absent> {
    let (inner, bracketed) = match raw.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        Some(inner) => (inner, true),
        None => (raw, false),
    };
    let absent = match inner {
        "" | "N/A" => Absent::NotAvailable,
        "Not Supported" | "Not supported" => Absent::NotSupported,
        "Unknown Error" | "GPU is lost" | "GPU requires reset" => Absent::Failed(inner.to_owned()),
        "Requested functionality has been deprecated" | "Insufficient Permissions" => {
            Absent::Other(inner.to_owned())
        }
        _ if bracketed => Absent::Other(inner.to_owned()),
        _ => return None,
    };
    Some(absent)
}

/// Splits `"77.71 W"` into the number text and its unit.
pub(crate) fn split_unit(raw: &str) -> (&str, Option<&str>) {
    match raw.split_once(' ') {
        Some((n, u)) => (n, Some(u.trim())),
        None => (raw, None),
    }
}

/// Runs `nvidia-smi` through the command runner.
#[derive(Debug, Clone)]
pub struct NvidiaSmi {
    binary: PathBuf,
    timeout: Duration,
    output_limit: usize,
    fields: Vec<String>,
}

impl Default for NvidiaSmi {
    fn default() -> Self {
        Self::new()
    }
}

impl NvidiaSmi {
    /// `nvidia-smi` from the path, a 10 s deadline, [`QUERY_GPU_FIELDS`].
    pub fn new() -> Self {
        Self {
            binary: PathBuf::from("nvidia-smi"),
            timeout: CommandSpec::DEFAULT_TIMEOUT,
            output_limit: MAX_REPORT_BYTES,
            fields: QUERY_GPU_FIELDS.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// Uses another binary (an absolute path, or a test double).
    pub fn binary(mut self, binary: impl Into<PathBuf>) -> Self {
        self.binary = binary.into();
        self
    }

    /// Sets the deadline of each run.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Queries other fields than [`QUERY_GPU_FIELDS`].
    pub fn fields<I: IntoIterator<Item = S>, S: Into<String>>(mut self, fields: I) -> Self {
        self.fields = fields.into_iter().map(Into::into).collect();
        self
    }

    /// Runs `nvidia-smi --query-gpu=<fields> --format=csv,nounits` and parses it.
    ///
    /// A driver that does not know an optional field (`power.draw.instant` before R530) is
    /// asked again without it. `No devices were found` is unavailable.
    pub fn query_gpu(&self) -> Collected<Vec<GpuQuery>> {
        source::stamp(self.try_query_gpu())
    }

    /// Runs `nvidia-smi -q -x` and parses it.
    pub fn query_report(&self) -> Collected<QueryReport> {
        source::stamp((|| {
            let out = self.run(["-q".to_owned(), "-x".to_owned()])?;
            let report = parse_query_xml(&out)?;
            if report.gpus.is_empty() {
                return Err(no_gpu());
            }
            Ok(report)
        })())
    }

    fn try_query_gpu(&self) -> Result<Vec<GpuQuery>, Failure> {
        let mut fields = self.fields.clone();
        let out = match self.run_query(&fields) {
            Err(Failure::Error(crate::CollectError::Command(CommandError::Exit {
                message,
                ..
            }))) if message.contains("is not a valid field to query")
                && fields.iter().any(|f| OPTIONAL_FIELDS.contains(&f.as_str())) =>
            {
                fields.retain(|f| !OPTIONAL_FIELDS.contains(&f.as_str()));
                self.run_query(&fields)?
            }
            other => other?,
        };
        let gpus = parse_query_gpu(&out, Columns::Header)?;
        if gpus.is_empty() {
            return Err(no_gpu());
        }
        Ok(gpus)
    }

    fn run_query(&self, fields: &[String]) -> Result<Vec<u8>, Failure> {
        self.run([
            format!("--query-gpu={}", fields.join(",")),
            "--format=csv,nounits".to_owned(),
        ])
    }

    fn run<const N: usize>(&self, args: [String; N]) -> Result<Vec<u8>, Failure> {
        let spec = CommandSpec::new(&self.binary)
            .args(args)
            .timeout(self.timeout)
            .output_limit(self.output_limit);
        match source::run_command(&spec) {
            Err(Failure::Error(crate::CollectError::Command(CommandError::Exit {
                message,
                ..
            }))) if message.contains("No devices were found") => {
                Err(Failure::Unavailable(Unavailable::NoDevice {
                    program: self.binary.display().to_string(),
                    message,
                }))
            }
            other => other.map(|o| o.stdout),
        }
    }
}

fn no_gpu() -> Failure {
    Failure::Unavailable(Unavailable::Empty {
        what: "nvidia-smi listed no GPU".to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_classified() {
        assert_eq!(placeholder("[N/A]"), Some(Absent::NotAvailable));
        assert_eq!(placeholder("N/A"), Some(Absent::NotAvailable));
        assert_eq!(placeholder("[Not Supported]"), Some(Absent::NotSupported));
        assert_eq!(
            placeholder("[GPU is lost]"),
            Some(Absent::Failed("GPU is lost".into()))
        );
        assert_eq!(
            placeholder("[Unknown Error]"),
            Some(Absent::Failed("Unknown Error".into()))
        );
        assert_eq!(
            placeholder("[Something New]"),
            Some(Absent::Other("Something New".into()))
        );
        assert_eq!(placeholder("42"), None);
        assert_eq!(placeholder("Something New"), None);
    }
}
