//! IPMI: the node's power draw, temperatures and fan speeds from the BMC.
//!
//! Why this module exists: the BMC sees what the OS cannot (the whole chassis' power, fan RPM
//! on SXM boards where `nvidia-smi` prints `[N/A]`), but `ipmitool` prints it in tables meant
//! for people, with stderr lines interleaved, `na` and `no reading` where values would be,
//! and `0 Watts` with a 1970 timestamp when the BMC has no DCMI power reading. The parsers
//! here accept each real layout and turn a missing reading into [`Value::Absent`], never 0.
//!
//! Inputs:
//! * `ipmitool dcmi power reading` and FreeIPMI's `ipmi-dcmi --get-system-power-statistics`
//!   ([`parse_dcmi_power`]): indented `key: value` lines; the timestamp may share its line
//!   with `Sampling period:`; `deactivated`, or `0 Watts` stamped 1970, is no reading;
//! * `ipmitool sdr` (3 columns), `sdr elist` (5) and `sensor` (10) ([`parse_sdr`],
//!   [`parse_sdr_elist`], [`parse_sensor`]) into a [`SensorTable`], summarised by
//!   [`SensorTable::readings`].
//!
//! [`Ipmitool`] runs the tool; "Could not open device at /dev/ipmi0 …" is unavailable.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::Collected;
use crate::source::{
    self, Absent, CommandError, CommandSpec, Failure, InputError, Unavailable, Value,
};
use crate::text;

/// Largest output accepted (a full `sensor` listing is about 20 KiB).
pub const MAX_IPMI_BYTES: usize = 1024 * 1024;

/// Why `ipmitool` output does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum IpmiError {
    /// Too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] InputError),
    /// A line that is neither a row nor a known diagnostic.
    #[error("line {line}: {text:?} is not a sensor row")]
    Garbage {
        /// Line.
        line: usize,
        /// The line.
        text: String,
    },
    /// A row with the wrong number of `|` columns.
    #[error("line {line}: {found} columns, expected {expected}")]
    ColumnCount {
        /// Line.
        line: usize,
        /// Expected.
        expected: usize,
        /// Found.
        found: usize,
    },
    /// A reading that starts like a number but is not one.
    #[error("line {line}, column {column}: {value:?} is not a number")]
    NotANumber {
        /// Line.
        line: usize,
        /// 1-based `|` column.
        column: usize,
        /// The cell.
        value: String,
    },
    /// The output has no sensor row.
    #[error("no sensor row in the output{}", first.as_ref().map(|f| format!(" (first line: {f:?})")).unwrap_or_default())]
    NoRows {
        /// The first non-empty line, if any.
        first: Option<String>,
    },
    /// Not a DCMI power reading.
    #[error("not a DCMI power reading: no instantaneous or current power line")]
    NotAPowerReading,
}

// ---------------------------------------------------------------------------------------
// DCMI power reading

/// Whether the BMC's power measurement is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PowerState {
    /// `activated` / `Active`.
    Active,
    /// `deactivated` / `Not Available`.
    Inactive,
    /// Not printed.
    Unknown,
}

/// A DCMI power reading. When the BMC has no reading (`deactivated`, or `0 Watts` stamped
/// 1970) every wattage is absent, with the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct DcmiPower {
    /// Instantaneous (ipmitool) or current (FreeIPMI) power, watts.
    pub instantaneous_w: Value<f64>,
    /// Minimum over the sampling period.
    pub minimum_w: Value<f64>,
    /// Maximum over the sampling period.
    pub maximum_w: Value<f64>,
    /// Average over the sampling period.
    pub average_w: Value<f64>,
    /// The BMC's timestamp, verbatim.
    pub timestamp: Option<String>,
    /// The sampling period, verbatim (`00000005 Seconds.`, `1000 milliseconds`).
    pub sampling_period: Option<String>,
    /// Measurement state.
    pub state: PowerState,
}

fn watts(line: usize, raw: &str) -> Result<Value<f64>, IpmiError> {
    let raw = raw.trim();
    if matches!(
        raw.to_ascii_lowercase().as_str(),
        "n/a" | "na" | "not available" | ""
    ) {
        return Ok(Value::Absent(Absent::NotAvailable));
    }
    let (num, unit) = raw.split_once(' ').unwrap_or((raw, ""));
    if !unit.trim().eq_ignore_ascii_case("watts") {
        return Err(IpmiError::NotANumber {
            line,
            column: 2,
            value: text::excerpt(raw),
        });
    }
    text::finite_f64(num)
        .map(Value::Present)
        .ok_or_else(|| IpmiError::NotANumber {
            line,
            column: 2,
            value: text::excerpt(raw),
        })
}

/// Splits a DCMI line into `key: value` pairs; newer ipmitool puts `Sampling period:` on the
/// timestamp's line.
fn dcmi_pairs(line: &str) -> Vec<(String, &str)> {
    let mut out = Vec::new();
    let (first, second) = match line.find("Sampling period:") {
        Some(p) if p > 0 && !line.get(..p).unwrap_or("").trim().is_empty() => {
            (line.get(..p).unwrap_or(""), line.get(p..))
        }
        _ => (line, None),
    };
    for part in [Some(first), second].into_iter().flatten() {
        if let Some((k, v)) = part.split_once(':') {
            out.push((k.trim().to_ascii_lowercase(), v.trim()));
        }
    }
    out
}

/// Parses `ipmitool dcmi power reading` or `ipmi-dcmi --get-system-power-statistics`.
pub fn parse_dcmi_power(input: &[u8]) -> Result<DcmiPower, IpmiError> {
    let text = text::decode(input, MAX_IPMI_BYTES)?;
    let mut p = DcmiPower {
        instantaneous_w: Value::not_queried(),
        minimum_w: Value::not_queried(),
        maximum_w: Value::not_queried(),
        average_w: Value::not_queried(),
        timestamp: None,
        sampling_period: None,
        state: PowerState::Unknown,
    };
    let mut seen_power = false;
    for (line, l) in text::lines(text) {
        if l.trim().is_empty() {
            continue;
        }
        let pairs = dcmi_pairs(l);
        if pairs.is_empty() {
            return Err(IpmiError::Garbage {
                line,
                text: text::excerpt(l.trim()),
            });
        }
        for (key, value) in pairs {
            match key.as_str() {
                "instantaneous power reading" | "current power" => {
                    p.instantaneous_w = watts(line, value)?;
                    seen_power = true;
                }
                "minimum during sampling period" | "minimum power over sampling duration" => {
                    p.minimum_w = watts(line, value)?;
                }
                "maximum during sampling period" | "maximum power over sampling duration" => {
                    p.maximum_w = watts(line, value)?;
                }
                "average power reading over sample period"
                | "average power over sampling duration" => p.average_w = watts(line, value)?,
                "ipmi timestamp" | "time stamp" => p.timestamp = Some(value.to_owned()),
                "sampling period" | "statistics reporting time period" => {
                    p.sampling_period = Some(value.to_owned());
                }
                "power reading state is" | "power measurement" => {
                    p.state = match value.to_ascii_lowercase().as_str() {
                        "activated" | "active" => PowerState::Active,
                        _ => PowerState::Inactive,
                    };
                }
                _ => {} // other lines (newer tools add some) carry nothing we use
            }
        }
    }
    if !seen_power {
        return Err(IpmiError::NotAPowerReading);
    }
    let epoch = p
        .timestamp
        .as_deref()
        .is_some_and(|t| t.contains("1970") || t.starts_with("01/01/70"));
    let reason = if p.state == PowerState::Inactive {
        Some("power measurement deactivated")
    } else if epoch && p.instantaneous_w.value() == Some(0.0) {
        Some("0 W stamped 1970: the BMC has no power reading")
    } else {
        None
    };
    if let Some(reason) = reason {
        for v in [
            &mut p.instantaneous_w,
            &mut p.minimum_w,
            &mut p.maximum_w,
            &mut p.average_w,
        ] {
            *v = Value::Absent(Absent::Other(reason.to_owned()));
        }
    }
    Ok(p)
}

// ---------------------------------------------------------------------------------------
// Sensor tables

/// A sensor's reading.
#[derive(Debug, Clone, PartialEq)]
pub enum SensorReading {
    /// A number and its unit (`degrees C`, `RPM`, `Watts`; may be empty).
    Numeric {
        /// Value.
        value: f64,
        /// Unit, verbatim.
        unit: String,
    },
    /// A discrete sensor's raw state (`0x00`).
    Discrete(String),
    /// A state text (`Presence detected`, `Connected`).
    State(String),
    /// No reading (`na`, `no reading`, `Not Readable`, empty).
    Missing(String),
}

/// One sensor row.
#[derive(Debug, Clone, PartialEq)]
pub struct SensorRow {
    /// The 1-based line.
    pub line: usize,
    /// Sensor name (names can repeat).
    pub name: String,
    /// Reading.
    pub reading: SensorReading,
    /// Status column (`ok`, `ns`, `cr`, `0x0100`…), verbatim.
    pub status: String,
}

/// A parsed sensor listing.
#[derive(Debug, Clone, PartialEq)]
pub struct SensorTable {
    /// Rows, in order.
    pub rows: Vec<SensorRow>,
    /// Interleaved diagnostics (`Unable to send command: Invalid argument`), with lines.
    pub diagnostics: Vec<(usize, String)>,
}

/// What the agent uses from a sensor listing.
#[derive(Debug, Clone, PartialEq)]
pub struct BmcReadings {
    /// The node's power draw, watts: a whole-system sensor if there is one, else the sum
    /// of the power supplies, else the only power sensor. Absent when there is no power
    /// sensor or no way to tell which one is the node's.
    pub power_w: Value<f64>,
    /// Temperatures, C (Fahrenheit sensors converted), by sensor name, in order.
    pub temperatures_c: Vec<(String, f64)>,
    /// Fan speeds, RPM, by sensor name, in order.
    pub fans_rpm: Vec<(String, f64)>,
    /// Sensors that printed no reading.
    pub unread: Vec<String>,
}

/// Lines ipmitool prints on stderr that end up between the rows when both are read.
const DIAGNOSTIC_PREFIXES: &[&str] = &[
    "Unable to",
    "Could not",
    "Error",
    "Warning",
    "Invalid",
    "Failed",
    "Get ",
    "Set ",
    "Close Session",
    "Activate Session",
    "Insufficient",
    "Received a response",
];

fn reading_of(line: usize, column: usize, raw: &str) -> Result<SensorReading, IpmiError> {
    let raw = raw.trim();
    let lower = raw.to_ascii_lowercase();
    if matches!(
        lower.as_str(),
        "" | "na" | "n/a" | "no reading" | "not readable" | "disabled" | "unavailable"
    ) {
        return Ok(SensorReading::Missing(raw.to_owned()));
    }
    if let Some(hex) = lower.strip_prefix("0x")
        && !hex.is_empty()
        && hex.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Ok(SensorReading::Discrete(raw.to_owned()));
    }
    if raw
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_digit() || b == b'-' || b == b'+')
    {
        // `110 Watts, Presence detected`: the number, its unit, and a state after the comma.
        let main = raw.split(',').next().unwrap_or(raw);
        let (num, unit) = main.split_once(' ').unwrap_or((main, ""));
        return text::finite_f64(num)
            .map(|value| SensorReading::Numeric {
                value,
                unit: unit.trim().to_owned(),
            })
            .ok_or_else(|| IpmiError::NotANumber {
                line,
                column,
                value: text::excerpt(raw),
            });
    }
    Ok(SensorReading::State(raw.to_owned()))
}

enum Layout {
    Sdr,
    Elist,
    Sensor,
}

fn parse_rows(input: &[u8], layout: Layout) -> Result<SensorTable, IpmiError> {
    let text = text::decode(input, MAX_IPMI_BYTES)?;
    let expected = match layout {
        Layout::Sdr => 3,
        Layout::Elist => 5,
        Layout::Sensor => 10,
    };
    let mut table = SensorTable {
        rows: Vec::new(),
        diagnostics: Vec::new(),
    };
    let mut first = None;
    for (line, l) in text::lines(text) {
        if l.trim().is_empty() {
            continue;
        }
        first.get_or_insert_with(|| text::excerpt(l.trim()));
        if !l.contains('|') {
            let t = l.trim();
            if DIAGNOSTIC_PREFIXES.iter().any(|p| t.starts_with(p)) {
                table.diagnostics.push((line, t.to_owned()));
                continue;
            }
            return Err(IpmiError::Garbage {
                line,
                text: text::excerpt(t),
            });
        }
        let cells: Vec<&str> = l.split('|').map(str::trim).collect();
        if cells.len() != expected {
            return Err(IpmiError::ColumnCount {
                line,
                expected,
                found: cells.len(),
            });
        }
        let cell = |i: usize| cells.get(i).copied().unwrap_or("");
        let name = cell(0);
        if name.is_empty() {
            return Err(IpmiError::Garbage {
                line,
                text: text::excerpt(l.trim()),
            });
        }
        let (reading, status) = match layout {
            Layout::Sdr => (reading_of(line, 2, cell(1))?, cell(2)),
            Layout::Elist => (reading_of(line, 5, cell(4))?, cell(2)),
            Layout::Sensor => {
                let value = cell(1);
                let reading = match reading_of(line, 2, value)? {
                    SensorReading::Numeric { value, .. } => SensorReading::Numeric {
                        value,
                        unit: cell(2).to_owned(),
                    },
                    // The value column holds a number, a hex state or `na`; nothing else.
                    SensorReading::State(s) => {
                        return Err(IpmiError::NotANumber {
                            line,
                            column: 2,
                            value: text::excerpt(&s),
                        });
                    }
                    other => other,
                };
                (reading, cell(3))
            }
        };
        table.rows.push(SensorRow {
            line,
            name: name.to_owned(),
            reading,
            status: status.to_owned(),
        });
    }
    if table.rows.is_empty() {
        return Err(IpmiError::NoRows { first });
    }
    Ok(table)
}

/// Parses `ipmitool sdr` (name | reading | status).
pub fn parse_sdr(input: &[u8]) -> Result<SensorTable, IpmiError> {
    parse_rows(input, Layout::Sdr)
}

/// Parses `ipmitool sdr elist` (name | id | status | entity | reading).
pub fn parse_sdr_elist(input: &[u8]) -> Result<SensorTable, IpmiError> {
    parse_rows(input, Layout::Elist)
}

/// Parses `ipmitool sensor` (name | value | unit | status | six thresholds).
pub fn parse_sensor(input: &[u8]) -> Result<SensorTable, IpmiError> {
    parse_rows(input, Layout::Sensor)
}

/// Names of sensors that measure the whole node rather than one supply.
const SYSTEM_POWER_NAMES: &[&str] = &[
    "pwr consumption",
    "power consumption",
    "total power",
    "system power",
    "sys power",
    "avg power",
    "power meter",
    "node power",
];

impl SensorTable {
    /// Power, temperatures and fans.
    pub fn readings(&self) -> BmcReadings {
        let mut temperatures_c = Vec::new();
        let mut fans_rpm = Vec::new();
        let mut unread = Vec::new();
        let mut power: Vec<(&str, f64)> = Vec::new();
        for r in &self.rows {
            match &r.reading {
                SensorReading::Numeric { value, unit } => {
                    let unit = unit.to_ascii_lowercase();
                    match unit.as_str() {
                        "degrees c" => temperatures_c.push((r.name.clone(), *value)),
                        "degrees f" => {
                            temperatures_c.push((r.name.clone(), (*value - 32.0) * 5.0 / 9.0));
                        }
                        "rpm" => fans_rpm.push((r.name.clone(), *value)),
                        "watts" => power.push((r.name.as_str(), *value)),
                        _ => {}
                    }
                }
                SensorReading::Missing(_) => unread.push(r.name.clone()),
                _ => {}
            }
        }
        let lower = |s: &str| s.to_ascii_lowercase();
        let is_supply = |name: &str| {
            let n = lower(name);
            n.starts_with("ps") || n.contains("power supply") || n.contains("psu")
        };
        let power_w = if let Some((_, w)) = power
            .iter()
            .find(|(n, _)| SYSTEM_POWER_NAMES.iter().any(|s| lower(n).contains(s)))
        {
            Value::Present(*w)
        } else if !power.is_empty() && power.iter().all(|(n, _)| is_supply(n)) {
            Value::Present(power.iter().map(|(_, w)| w).sum())
        } else if let [(_, w)] = power.as_slice() {
            Value::Present(*w)
        } else if power.is_empty() {
            Value::Absent(Absent::NotAvailable)
        } else {
            Value::Absent(Absent::Other(format!(
                "{} power sensors and none is the whole node's",
                power.len()
            )))
        };
        BmcReadings {
            power_w,
            temperatures_c,
            fans_rpm,
            unread,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Source

/// Runs `ipmitool` through the command runner.
#[derive(Debug, Clone)]
pub struct Ipmitool {
    binary: PathBuf,
    timeout: Duration,
}

impl Default for Ipmitool {
    fn default() -> Self {
        Self::new()
    }
}

impl Ipmitool {
    /// `ipmitool` from the path with a 10 s deadline (a BMC can be slow).
    pub fn new() -> Self {
        Self {
            binary: PathBuf::from("ipmitool"),
            timeout: CommandSpec::DEFAULT_TIMEOUT,
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

    /// Runs `ipmitool dcmi power reading`.
    pub fn power_reading(&self) -> Collected<DcmiPower> {
        source::stamp(
            self.run(&["dcmi", "power", "reading"])
                .and_then(|out| Ok(parse_dcmi_power(&out)?)),
        )
    }

    /// Runs `ipmitool sdr elist` and summarises it.
    pub fn sensors(&self) -> Collected<BmcReadings> {
        source::stamp(
            self.run(&["sdr", "elist"])
                .and_then(|out| Ok(parse_sdr_elist(&out)?.readings())),
        )
    }

    fn run(&self, args: &[&str]) -> Result<Vec<u8>, Failure> {
        let spec = CommandSpec::new(&self.binary)
            .args(args)
            .timeout(self.timeout)
            .output_limit(MAX_IPMI_BYTES);
        match source::run_command(&spec) {
            Err(Failure::Error(crate::CollectError::Command(CommandError::Exit {
                message,
                ..
            }))) if message.contains("Could not open device") => {
                Err(Failure::Unavailable(Unavailable::NoDevice {
                    program: self.binary.display().to_string(),
                    message,
                }))
            }
            other => other.map(|o| o.stdout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_and_sampling_period_on_one_line() {
        let input = b"
    Instantaneous power reading:                   220 Watts
    Minimum during sampling period:                 52 Watts
    Maximum during sampling period:                331 Watts
    Average power reading over sample period:      104 Watts
    IPMI timestamp:                           07/26/26 16:57:12 CDT    Sampling period:                          00000005 Seconds.
    Power reading state is:                   activated
";
        let p = parse_dcmi_power(input).unwrap();
        assert_eq!(p.instantaneous_w.value(), Some(220.0));
        assert_eq!(p.timestamp.as_deref(), Some("07/26/26 16:57:12 CDT"));
        assert_eq!(p.sampling_period.as_deref(), Some("00000005 Seconds."));
        assert_eq!(p.state, PowerState::Active);
    }

    #[test]
    fn readings_split_number_unit_and_state() {
        assert_eq!(
            reading_of(1, 5, "110 Watts, Presence detected").unwrap(),
            SensorReading::Numeric {
                value: 110.0,
                unit: "Watts".into()
            }
        );
        assert_eq!(
            reading_of(1, 5, "0x00").unwrap(),
            SensorReading::Discrete("0x00".into())
        );
        assert_eq!(
            reading_of(1, 5, "Not Readable").unwrap(),
            SensorReading::Missing("Not Readable".into())
        );
        assert!(matches!(
            reading_of(3, 2, "12.3.4 Volts"),
            Err(IpmiError::NotANumber { line: 3, .. })
        ));
    }

    #[test]
    fn several_supplies_are_summed() {
        let t =
            parse_sdr(b"PS1 Input Power  | 200 Watts | ok\nPS2 Input Power  | 150 Watts | ok\n")
                .unwrap();
        assert_eq!(t.readings().power_w.value(), Some(350.0));
        let t = parse_sdr(b"CPU Power | 100 Watts | ok\nGPU Power | 300 Watts | ok\n").unwrap();
        assert!(t.readings().power_w.is_absent());
    }
}
