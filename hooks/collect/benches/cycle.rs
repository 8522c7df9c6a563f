//! Parsing cost of one collection cycle of an 8-GPU node: `nvidia-smi --query-gpu` CSV,
//! the DCGM exporter's text, `/proc/net/tcp` and `ipmitool sdr`, from the repository's
//! fixtures. The agent's budget is 20 ms of CPU per cycle including its decisions; parsing
//! should stay well under 1 ms.
//!
//! `cargo bench --bench cycle` (standalone: add `--manifest-path hooks/collect/Cargo.toml`).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use probity_collect::nvidia_smi::{self, Columns};
use probity_collect::sockets::{self, ProcNetTable};
use probity_collect::{dcgm, ipmi};

fn fixture(area: &str, name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(area)
        .join(name);
    std::fs::read(&p).expect("fixture")
}

struct Cycle {
    csv: Vec<u8>,
    dcgm: Vec<u8>,
    tcp: Vec<u8>,
    sdr: Vec<u8>,
}

impl Cycle {
    fn load() -> Self {
        Self {
            csv: fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"),
            dcgm: fixture("dcgm", "own-8gpu-mig-mixed-labels.prom"),
            tcp: fixture("sockets", "own-8gpu-node.tcp"),
            sdr: fixture("ipmi", "own-ipmitool-sdr-8gpu-node.txt"),
        }
    }

    fn parse(&self) -> usize {
        let gpus = nvidia_smi::parse_query_gpu(&self.csv, Columns::Header).unwrap();
        let dcgm = dcgm::parse_dcgm(&self.dcgm).unwrap();
        let tcp = sockets::parse_proc_net(&self.tcp, ProcNetTable::Tcp, false).unwrap();
        let bmc = ipmi::parse_sdr(&self.sdr).unwrap().readings();
        gpus.len() + dcgm.gpus.len() + tcp.len() + bmc.temperatures_c.len()
    }
}

fn bench(c: &mut Criterion) {
    let cycle = Cycle::load();
    assert_eq!(cycle.parse(), 8 + 8 + 9 + 16);
    c.bench_function("cycle_8gpu_parse_all", |b| {
        b.iter(|| black_box(&cycle).parse())
    });
    c.bench_function("nvidia_smi_csv_8gpu", |b| {
        b.iter(|| nvidia_smi::parse_query_gpu(black_box(&cycle.csv), Columns::Header).unwrap())
    });
    c.bench_function("dcgm_text_8gpu", |b| {
        b.iter(|| dcgm::parse_dcgm(black_box(&cycle.dcgm)).unwrap())
    });
    c.bench_function("proc_net_tcp_49_rows", |b| {
        b.iter(|| sockets::parse_proc_net(black_box(&cycle.tcp), ProcNetTable::Tcp, false).unwrap())
    });
    c.bench_function("ipmi_sdr_39_rows", |b| {
        b.iter(|| ipmi::parse_sdr(black_box(&cycle.sdr)).unwrap().readings())
    });
    let xml = fixture("nvidia-smi", "own-8gpu-h100.q.xml");
    c.bench_function("nvidia_smi_xml_8gpu", |b| {
        b.iter(|| nvidia_smi::parse_query_xml(black_box(&xml)).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
