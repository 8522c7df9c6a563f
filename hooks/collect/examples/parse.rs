//! Parses a captured tool output with one of the collectors' parsers and prints the result,
//! to check a capture from a new driver, BMC or kernel before it reaches an agent.
//!
//! ```text
//! cargo run --example parse -- FORMAT FILE
//! FORMAT: nvidia-csv | nvidia-xml | nvidia-text | dcgm | dcmi | sdr | elist | sensor
//!         | tcp | tcp6 | udp | udp6
//! ```

use std::process::ExitCode;

use probity_collect::nvidia_smi::{self, Columns};
use probity_collect::sockets::{self, ProcNetTable};
use probity_collect::{dcgm, ipmi};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [format, file] = args.as_slice() else {
        eprintln!("usage: parse FORMAT FILE");
        return ExitCode::from(2);
    };
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{file}: {e}");
            return ExitCode::from(2);
        }
    };
    let table = |t| sockets::parse_proc_net(&bytes, t, false).map(|v| format!("{v:#?}"));
    let result: Result<String, Box<dyn std::error::Error>> = match format.as_str() {
        "nvidia-csv" => nvidia_smi::parse_query_gpu(&bytes, Columns::Header)
            .map(|v| format!("{v:#?}"))
            .map_err(Into::into),
        "nvidia-xml" => nvidia_smi::parse_query_xml(&bytes)
            .map(|v| format!("{v:#?}"))
            .map_err(Into::into),
        "nvidia-text" => nvidia_smi::parse_query_text(&bytes)
            .map(|v| format!("{v:#?}"))
            .map_err(Into::into),
        "dcgm" => dcgm::parse_dcgm(&bytes)
            .map(|v| format!("{v:#?}"))
            .map_err(Into::into),
        "dcmi" => ipmi::parse_dcmi_power(&bytes)
            .map(|v| format!("{v:#?}"))
            .map_err(Into::into),
        "sdr" => ipmi::parse_sdr(&bytes)
            .map(|t| format!("{:#?}", t.readings()))
            .map_err(Into::into),
        "elist" => ipmi::parse_sdr_elist(&bytes)
            .map(|t| format!("{:#?}", t.readings()))
            .map_err(Into::into),
        "sensor" => ipmi::parse_sensor(&bytes)
            .map(|t| format!("{:#?}", t.readings()))
            .map_err(Into::into),
        "tcp" => table(ProcNetTable::Tcp).map_err(Into::into),
        "tcp6" => table(ProcNetTable::Tcp6).map_err(Into::into),
        "udp" => table(ProcNetTable::Udp).map_err(Into::into),
        "udp6" => table(ProcNetTable::Udp6).map_err(Into::into),
        other => {
            eprintln!("unknown format {other}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            let mut msg = e.to_string();
            let mut cause = e.source();
            while let Some(c) = cause {
                msg.push_str(&format!(": {c}"));
                cause = c.source();
            }
            eprintln!("{file}: {msg}");
            ExitCode::FAILURE
        }
    }
}
