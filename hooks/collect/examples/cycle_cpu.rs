//! CPU time of parsing one collection cycle of an 8-GPU node (nvidia-smi CSV, DCGM text,
//! /proc/net/tcp, ipmitool sdr), per cycle, as the thread's CPU clock sees it: on a shared,
//! noisy machine this is steadier than wall-clock time, and the agent's budget is stated
//! in CPU time (20 ms per cycle, decisions included).
//!
//! `cargo run --release --example cycle_cpu` prints the median and p99 over 10,000 cycles,
//! and the same for `-q -x` XML of 8 GPUs (parsed only when asked, not every cycle).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use probity_collect::nvidia_smi::{self, Columns};
use probity_collect::sockets::{self, ProcNetTable};
use probity_collect::{dcgm, ipmi};
use rustix::time::{ClockId, clock_gettime};

fn fixture(area: &str, name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(area)
        .join(name);
    std::fs::read(&p).expect("fixture")
}

fn cpu_now() -> Duration {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn measure(name: &str, rounds: usize, per_round: usize, mut f: impl FnMut() -> usize) {
    for _ in 0..per_round {
        black_box(f());
    }
    let mut samples = Vec::with_capacity(rounds * per_round);
    for _ in 0..rounds {
        for _ in 0..per_round {
            let start = cpu_now();
            black_box(f());
            samples.push(cpu_now() - start);
        }
    }
    samples.sort();
    let median = samples[samples.len() / 2];
    let p99 = samples[samples.len() * 99 / 100];
    println!(
        "{name}: median {:.1} µs, p99 {:.1} µs of CPU over {} runs",
        median.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        samples.len()
    );
}

fn main() {
    let csv = fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv");
    let prom = fixture("dcgm", "own-8gpu-mig-mixed-labels.prom");
    let tcp = fixture("sockets", "own-8gpu-node.tcp");
    let sdr = fixture("ipmi", "own-ipmitool-sdr-8gpu-node.txt");
    let xml = fixture("nvidia-smi", "own-8gpu-h100.q.xml");
    measure("cycle (csv + dcgm + tcp + sdr)", 20, 500, || {
        let gpus = nvidia_smi::parse_query_gpu(&csv, Columns::Header).unwrap();
        let d = dcgm::parse_dcgm(&prom).unwrap();
        let t = sockets::parse_proc_net(&tcp, ProcNetTable::Tcp, false).unwrap();
        let b = ipmi::parse_sdr(&sdr).unwrap().readings();
        gpus.len() + d.gpus.len() + t.len() + b.temperatures_c.len()
    });
    measure("nvidia-smi csv", 20, 500, || {
        nvidia_smi::parse_query_gpu(&csv, Columns::Header)
            .unwrap()
            .len()
    });
    measure("dcgm text", 20, 500, || {
        dcgm::parse_dcgm(&prom).unwrap().gpus.len()
    });
    measure("/proc/net/tcp", 20, 500, || {
        sockets::parse_proc_net(&tcp, ProcNetTable::Tcp, false)
            .unwrap()
            .len()
    });
    measure("ipmitool sdr", 20, 500, || {
        ipmi::parse_sdr(&sdr).unwrap().readings().fans_rpm.len()
    });
    measure("nvidia-smi -q -x (8 GPUs)", 10, 200, || {
        nvidia_smi::parse_query_xml(&xml).unwrap().gpus.len()
    });
}
