//! Bounded randomized tests: every parser is fed a few hundred mutations of each of its
//! fixtures (truncation, byte flips, inserted separators, duplicated, dropped and swapped
//! lines) from a fixed-seed generator. Each input must give a value or an error that says
//! where (a line, or a position for XML); a panic fails the test.

use probity_collect::dcgm::{self, DcgmError};
use probity_collect::ipmi::{self, IpmiError};
use probity_collect::nvidia_smi::{self, Columns, CsvError, QUERY_GPU_FIELDS, ReportError};
use probity_collect::sockets::{self, ProcNetError, ProcNetTable};

use crate::common::{XorShift, fixture, fixture_names};

const ROUNDS: usize = 300;
const NOISE: &[u8] = b"|,:\"{}\\\n[]<>= \t0x9.-#\xff\xc3";

fn mutate(rng: &mut XorShift, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..=rng.below(3) {
        let lines: Vec<&[u8]> = out.split_inclusive(|&b| b == b'\n').collect();
        out = match rng.below(6) {
            0 => out[..rng.below(out.len() + 1)].to_vec(),
            1 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] = rng.next() as u8;
                out
            }
            2 => {
                let i = rng.below(out.len() + 1);
                let mut v = out[..i].to_vec();
                for _ in 0..=rng.below(4) {
                    v.push(NOISE[rng.below(NOISE.len())]);
                }
                v.extend_from_slice(&out[i..]);
                v
            }
            3 if !lines.is_empty() => {
                let i = rng.below(lines.len());
                let mut v: Vec<&[u8]> = lines.clone();
                v.insert(i, lines[i]);
                v.concat()
            }
            4 if !lines.is_empty() => {
                let i = rng.below(lines.len());
                let mut v = lines.clone();
                v.remove(i);
                v.concat()
            }
            5 if lines.len() > 1 => {
                let mut v = lines.clone();
                let (a, b) = (rng.below(v.len()), rng.below(v.len()));
                v.swap(a, b);
                v.concat()
            }
            _ => out,
        };
    }
    out
}

/// Runs `check` on mutations of every fixture of `area` whose name passes `select`;
/// `check` returns `Ok(true)` for a value, `Ok(false)` for a located error, `Err` for an
/// error without a location.
fn run(
    seed: u64,
    area: &str,
    select: impl Fn(&str) -> bool,
    check: impl Fn(&[u8]) -> Result<bool, String>,
) {
    let mut rng = XorShift::new(seed);
    let (mut values, mut errors) = (0, 0);
    for name in fixture_names(area).into_iter().filter(|n| select(n)) {
        let original = fixture(area, &name);
        for round in 0..ROUNDS {
            let input = mutate(&mut rng, &original);
            match check(&input) {
                Ok(true) => values += 1,
                Ok(false) => errors += 1,
                Err(e) => panic!(
                    "{area}/{name} round {round}: unlocated error {e:?} for input {:?}",
                    String::from_utf8_lossy(&input)
                ),
            }
        }
    }
    assert!(
        values > 0 && errors > 0,
        "{area}: {values} values, {errors} errors"
    );
}

fn located(msg: String) -> Result<bool, String> {
    if msg.contains("line ") {
        Ok(false)
    } else {
        Err(msg)
    }
}

fn csv_outcome<T>(r: Result<T, CsvError>) -> Result<bool, String> {
    match r {
        Ok(_) => Ok(true),
        Err(CsvError::MissingHeader) => Ok(false),
        Err(e) => located(e.to_string()),
    }
}

#[test]
fn nvidia_smi_csv_mutations() {
    run(
        0x5eed_0001,
        "nvidia-smi",
        |n| n.ends_with(".csv"),
        |b| csv_outcome(nvidia_smi::parse_query_gpu(b, Columns::Header)),
    );
    run(
        0x5eed_0002,
        "nvidia-smi",
        |n| n == "own-8gpu-h100.query-gpu.csv",
        |b| {
            csv_outcome(nvidia_smi::parse_query_gpu(
                b,
                Columns::Given(QUERY_GPU_FIELDS),
            ))
        },
    );
}

fn report_outcome<T>(r: Result<T, ReportError>) -> Result<bool, String> {
    match r {
        Ok(_) => Ok(true),
        // roxmltree's error carries the position.
        Err(ReportError::Xml(e)) if e.pos().row >= 1 => Ok(false),
        Err(e) => located(e.to_string()),
    }
}

#[test]
fn nvidia_smi_report_mutations() {
    run(
        0x5eed_0003,
        "nvidia-smi",
        |n| n.ends_with(".q.xml"),
        |b| report_outcome(nvidia_smi::parse_query_xml(b)),
    );
    run(
        0x5eed_0004,
        "nvidia-smi",
        |n| n.ends_with(".idle.q.txt"),
        |b| report_outcome(nvidia_smi::parse_query_text(b)),
    );
}

#[test]
fn dcgm_mutations() {
    run(
        0x5eed_0005,
        "dcgm",
        |_| true,
        |b| match dcgm::parse_dcgm(b) {
            Ok(_) => Ok(true),
            Err(DcgmError::Exposition(e)) => located(e.to_string()),
            Err(e) => located(e.to_string()),
        },
    );
}

fn ipmi_outcome<T>(r: Result<T, IpmiError>) -> Result<bool, String> {
    match r {
        Ok(_) => Ok(true),
        Err(IpmiError::NoRows { .. } | IpmiError::NotAPowerReading) => Ok(false),
        Err(e) => located(e.to_string()),
    }
}

#[test]
fn ipmi_mutations() {
    run(
        0x5eed_0006,
        "ipmi",
        |n| n.contains("dcmi-power"),
        |b| ipmi_outcome(ipmi::parse_dcmi_power(b)),
    );
    run(
        0x5eed_0007,
        "ipmi",
        |n| n.contains("-sdr-") && !n.contains("elist"),
        |b| ipmi_outcome(ipmi::parse_sdr(b).map(|t| t.readings())),
    );
    run(
        0x5eed_0008,
        "ipmi",
        |n| n.contains("elist"),
        |b| ipmi_outcome(ipmi::parse_sdr_elist(b).map(|t| t.readings())),
    );
    run(
        0x5eed_0009,
        "ipmi",
        |n| n.contains("-sensor-"),
        |b| ipmi_outcome(ipmi::parse_sensor(b).map(|t| t.readings())),
    );
}

#[test]
fn proc_net_mutations() {
    for (seed, ext, table) in [
        (0x5eed_000a, ".tcp", ProcNetTable::Tcp),
        (0x5eed_000b, ".tcp6", ProcNetTable::Tcp6),
        (0x5eed_000c, ".udp", ProcNetTable::Udp),
        (0x5eed_000d, ".udp6", ProcNetTable::Udp6),
    ] {
        run(
            seed,
            "sockets",
            |n| n.ends_with(ext),
            |b| match sockets::parse_proc_net(b, table, false) {
                Ok(_) => Ok(true),
                Err(ProcNetError::MissingHeader) => Ok(false),
                Err(e) => located(e.to_string()),
            },
        );
    }
}
