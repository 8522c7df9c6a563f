//! CPU time of the agent's cycle on an 8-GPU node from fixtures: every source's bytes
//! parsed in process (nvidia-smi CSV, DCGM text, DCMI reading, /proc/net/tcp, /proc/stat,
//! an `nft -j` ruleset, RAPL counters from an in-memory sysfs), the facts built and
//! upserted, `comply` and `listen` decided, findings reconciled: everything a cycle does
//! but running the tools. Measured with the thread's CPU clock (what the agent reports
//! as `cpu_ms`), which a shared, noisy machine disturbs less than wall time.
//!
//! Then the same cycle with a 10,000-rule ruleset: once unchanged between cycles (the
//! reduction is reused), once alternating between two rulesets (reduced every cycle).
//!
//! `cargo run --release -p probity-agent --example agent_cycle_cpu`
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use probity::{Engine, ManualClock};
use probity_agent::alerts::AlertSinks;
use probity_agent::sources::{CpuCountError, Sources, parse_proc_stat_cpus};
use probity_agent::{Agent, Config};
use probity_collect::Collected;
use probity_collect::dcgm::{self, DcgmReport};
use probity_collect::ipmi::{self, DcmiPower};
use probity_collect::nvidia_smi::{self, Columns, GpuQuery};
use probity_collect::rapl::{Rapl, RaplConfig, RaplPower, Sysfs};
use probity_collect::sockets::{self, ListeningSocket, ProcNetTable};
use probity_collect::source::{self, FileError};
use probity_firewall::nft;
use probity_firewall::source::{Reading, Snapshot};

fn fixture(area: &str, name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(area)
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Two RAPL packages whose counters advance 1 J at each read.
struct MemSysfs {
    energy: AtomicU64,
}

impl Sysfs for MemSysfs {
    fn read(&self, path: &Path) -> Result<Vec<u8>, FileError> {
        let name = path.file_name().unwrap().to_str().unwrap();
        let zone = path
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap();
        Ok(match name {
            "name" => format!("package-{}\n", &zone[zone.len() - 1..]).into_bytes(),
            "max_energy_range_uj" => b"262143328850\n".to_vec(),
            "energy_uj" => {
                let e = self.energy.fetch_add(1_000_000, Ordering::Relaxed) % 262_143_328_850;
                format!("{e}\n").into_bytes()
            }
            _ => {
                return Err(FileError::NotFound {
                    path: path.to_owned(),
                });
            }
        })
    }

    fn list(&self, _dir: &Path) -> Result<Vec<String>, FileError> {
        Ok(vec!["intel-rapl:0".into(), "intel-rapl:1".into()])
    }
}

struct FixtureSources {
    csv: Vec<u8>,
    prom: Vec<u8>,
    dcmi: Vec<u8>,
    tcp: Vec<u8>,
    stat: Vec<u8>,
    rulesets: Vec<Vec<u8>>,
    next: usize,
    rapl: Rapl<MemSysfs>,
}

impl Sources for FixtureSources {
    fn gpus(&mut self) -> Option<Collected<Vec<GpuQuery>>> {
        Some(source::stamp(
            nvidia_smi::parse_query_gpu(&self.csv, Columns::Header).map_err(Into::into),
        ))
    }

    fn dcgm(&mut self) -> Option<Collected<DcgmReport>> {
        Some(source::stamp(
            dcgm::parse_dcgm(&self.prom).map_err(Into::into),
        ))
    }

    fn rapl(&mut self) -> Option<Collected<RaplPower>> {
        Some(self.rapl.collect())
    }

    fn bmc_power(&mut self) -> Option<Collected<DcmiPower>> {
        Some(source::stamp(
            ipmi::parse_dcmi_power(&self.dcmi).map_err(Into::into),
        ))
    }

    fn sockets(&mut self) -> Collected<Vec<ListeningSocket>> {
        Collected::ok_now(sockets::parse_proc_net(&self.tcp, ProcNetTable::Tcp, false).unwrap())
    }

    fn cpu_count(&mut self) -> Option<Result<u32, CpuCountError>> {
        Some(Ok(parse_proc_stat_cpus(&self.stat).unwrap()))
    }

    fn firewall(&mut self) -> Snapshot {
        let doc = &self.rulesets[self.next % self.rulesets.len()];
        self.next += 1;
        Snapshot {
            nft: Reading::Read(nft::parse(doc).unwrap()),
            iptables: Reading::Unavailable {
                program: "iptables-save".into(),
            },
            ip6tables: Reading::Unavailable {
                program: "ip6tables-save".into(),
            },
        }
    }
}

/// An `nft -j` dump with `rules` rules: single ports, ranges, sets, source prefixes and
/// jumps, as probity-firewall's own benchmark generates (smaller, same mix); `salt`
/// changes one port so that two dumps differ.
fn generate(rules: usize, salt: u16) -> String {
    let mut items: Vec<String> = vec![
        r#"{"table": {"family": "inet", "name": "big", "handle": 1}}"#.into(),
        r#"{"chain": {"family": "inet", "table": "big", "name": "input", "handle": 1, "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}}"#.into(),
        r#"{"chain": {"family": "inet", "table": "big", "name": "sub", "handle": 2}}"#.into(),
    ];
    let dport = |proto: &str, right: String| {
        format!(
            r#"{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "{proto}", "field": "dport"}}}}, "right": {right}}}}}"#
        )
    };
    for i in 0..rules {
        let exprs = match i % 5 {
            0 | 1 => vec![
                dport("tcp", (1000 + i + usize::from(salt)).to_string()),
                r#"{"accept": null}"#.into(),
            ],
            2 => vec![
                dport(
                    "udp",
                    format!(r#"{{"range": [{}, {}]}}"#, 20000 + i, 20005 + i),
                ),
                r#"{"drop": null}"#.into(),
            ],
            3 => vec![
                format!(
                    r#"{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "ip", "field": "saddr"}}}}, "right": {{"prefix": {{"addr": "10.{}.{}.0", "len": 24}}}}}}}}"#,
                    (i >> 8) & 255,
                    i & 255
                ),
                dport("tcp", (30000 + i % 1000).to_string()),
                r#"{"accept": null}"#.into(),
            ],
            _ => vec![
                dport(
                    "tcp",
                    format!(
                        r#"{{"set": [{}, {}, {}]}}"#,
                        50000 + i % 1000,
                        51000 + i % 1000,
                        52000 + i % 1000
                    ),
                ),
                r#"{"jump": {"target": "sub"}}"#.into(),
            ],
        };
        items.push(format!(
            r#"{{"rule": {{"family": "inet", "table": "big", "chain": "input", "handle": {}, "expr": [{}]}}}}"#,
            10 + i,
            exprs.join(", ")
        ));
    }
    let mut doc = String::from("{\"nftables\": [");
    for (k, item) in items.iter().enumerate() {
        if k > 0 {
            doc.push(',');
        }
        let _ = write!(doc, "{item}");
    }
    doc.push_str("]}");
    doc
}

fn agent(rulesets: Vec<Vec<u8>>) -> Agent {
    let config = Config::parse(
        "bench.toml",
        "[node]\nname = \"gpu-node-07\"\n[inventory]\nzone = \"z1\"\nrack = \"r7\"\nrole = \"gpu-worker\"\ngpu_node = true\ncuda_image = \"nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04\"\n[dcgm]\nurl = \"http://127.0.0.1:9400/metrics\"\n",
        Path::new("."),
    )
    .unwrap();
    let clock = Arc::new(ManualClock::at(1_800_000_000));
    let engine = Engine::defaults()
        .clock(Arc::clone(&clock) as Arc<dyn probity::Clock>)
        .build()
        .unwrap();
    engine
        .upsert_entities(&serde_json::json!([
            {"uid": {"type": "Cluster", "id": "onprem"}, "attrs": {"gpusTotal": 64, "gpusAllocated": 8}, "parents": []},
            {"uid": {"type": "Zone", "id": "z1"}, "parents": [],
             "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}}, "powerDrawW": 20000, "powerCeilingW": 100000}},
        ]))
        .unwrap();
    let sources = FixtureSources {
        csv: fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"),
        prom: fixture("dcgm", "own-8gpu-mig-mixed-labels.prom"),
        dcmi: fixture("ipmi", "own-ipmitool-dcmi-power-reading-1.8.19-oneline.txt"),
        tcp: fixture("sockets", "own-8gpu-node.tcp"),
        stat: std::fs::read("/proc/stat").unwrap(),
        rulesets,
        next: 0,
        rapl: Rapl::with_sysfs(
            MemSysfs {
                energy: AtomicU64::new(1),
            },
            RaplConfig::default(),
        ),
    };
    Agent::with_parts(config, engine, Box::new(sources), AlertSinks::none()).unwrap()
}

fn percentile(sorted: &[f64], p: usize) -> f64 {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn measure(name: &str, agent: &mut Agent, cycles: usize) {
    for _ in 0..20 {
        agent.cycle();
    }
    let mut total = Vec::with_capacity(cycles);
    let mut phases: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut decisions = 0;
    for _ in 0..cycles {
        let r = agent.cycle();
        decisions = r.decisions.len();
        total.push(r.cpu_ms);
        for (k, v) in r.phases_ms {
            phases.entry(k).or_default().push(v);
        }
    }
    total.sort_by(f64::total_cmp);
    println!(
        "{name}: {decisions} decisions per cycle; CPU per cycle median {:.3} ms, p99 {:.3} ms over {cycles} cycles",
        percentile(&total, 50),
        percentile(&total, 99)
    );
    for (k, mut v) in phases {
        v.sort_by(f64::total_cmp);
        println!(
            "  {k:<9} median {:.3} ms, p99 {:.3} ms",
            percentile(&v, 50),
            percentile(&v, 99)
        );
    }
}

fn main() {
    let small = fixture("firewall", "nft-j-netns.json");
    let mut a = agent(vec![small]);
    measure("8-GPU node from fixtures", &mut a, 2000);

    let big = generate(10_000, 0).into_bytes();
    let mut b = agent(vec![big.clone()]);
    measure(
        "same, 10,000-rule ruleset unchanged between cycles",
        &mut b,
        40,
    );
    let mut c = agent(vec![big, generate(10_000, 1).into_bytes()]);
    measure("same, 10,000-rule ruleset changed every cycle", &mut c, 40);
}
