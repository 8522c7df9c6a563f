//! From readings to the engine's facts: the `Node` entity and one `Gpu` entity per GPU.
//!
//! Why this module exists: the schema's attributes are numbers the policies compare, and
//! each has a rule for where it comes from that an operator must be able to look up:
//!
//! * `hottestGpuTempC`: the hottest GPU temperature that nvidia-smi or the DCGM exporter
//!   reported (both are read when both are on: the hotter reading counts), rounded up;
//! * `powerDrawW`: the BMC's DCMI instantaneous reading when the BMC has one; otherwise
//!   the RAPL package power plus every GPU's draw; rounded to the watt. With neither the
//!   power is unknown: "power" goes into `unreadable`;
//! * `powerWindowMeanW`: the mean of the earlier readings of the power window (the newest
//!   reading is never part of its own mean), 0 while there is none, which the power rule
//!   reads as "no window yet";
//! * `gpuCount`, `gpuMemoryMiB` (the smallest GPU's memory), `gpuModel` (the product name
//!   mapped through `[gpu_models]`; absent when the GPUs disagree), `driverVersion`: from
//!   nvidia-smi, or the DCGM exporter when nvidia-smi has no reading;
//! * `zone`, `rack`, `role`, `gpuNode`, `cudaImage`: the inventory; `cpuCount`: the
//!   inventory or `/proc/stat`;
//! * `unreadable`: the sources with no reading or a stale one, and "power", "gpu" or
//!   "listen" when no source could give those facts (see the agent's docs).
//!
//! A required attribute whose source never answered takes 0 (or "") *and* the source is
//! in `unreadable`, which the `thermal.telemetry-unreadable` policy turns into a finding:
//! the zero is never a reading the policies judge as one. A GPU whose reading lacks a
//! number is not upserted at all (an entity the store does not hold fails closed).

use std::collections::BTreeMap;

use probity_collect::dcgm::{DcgmReport, GpuKey};
use probity_collect::nvidia_smi::GpuQuery;
use serde::Serialize;
use serde_json::{Value, json};

use crate::config::Config;

/// One GPU as the agent understood it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuFact {
    /// Its index.
    pub index: u32,
    /// Its `Gpu` entity id: `<node>/<index>`.
    pub id: String,
    /// The source it came from: `nvidia-smi` or `dcgm`.
    pub source: &'static str,
    /// Product name as printed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// The `GpuModel` id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Temperature, C.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    /// Power draw, W.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// Memory, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Driver version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// The fields it lacks, with what the source printed instead.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
}

impl GpuFact {
    /// Whether it has every number its entity needs.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

/// GPUs from `nvidia-smi --query-gpu`.
pub fn gpus_from_smi(config: &Config, rows: &[GpuQuery]) -> Vec<GpuFact> {
    let mut out = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let mut missing = Vec::new();
        let mut need = |field: &str, absence: Option<&probity_collect::Absent>| {
            if let Some(a) = absence {
                missing.push(format!("{field}: {}", absent_text(a)));
            }
        };
        need("index", row.index.absence());
        need("temperature.gpu", row.temperature_c.absence());
        need("power.draw", row.power.absence());
        need("memory.total", row.memory_total_mib.absence());
        need("name", row.name.absence());
        let index = row
            .index
            .value()
            .unwrap_or_else(|| u32::try_from(i).unwrap_or(u32::MAX));
        let product = row.name.get().cloned();
        out.push(GpuFact {
            index,
            id: format!("{}/{index}", config.node),
            source: "nvidia-smi",
            model: product.as_deref().map(|p| config.gpu_model(p)),
            product,
            temperature_c: row.temperature_c.value(),
            power_w: row.power.value().map(|p| p.watts),
            memory_mib: row.memory_total_mib.value(),
            driver: row.driver_version.get().cloned(),
            missing,
        });
    }
    out
}

/// GPUs from the DCGM exporter. Memory is `FB_USED + FB_FREE` (the frame buffer the
/// driver hands out, without its reserve); for a GPU in MIG mode, a value the GPU does
/// not report itself is the sum over its GPU instances.
pub fn gpus_from_dcgm(config: &Config, report: &DcgmReport) -> Vec<GpuFact> {
    let mut out = Vec::new();
    for g in &report.gpus {
        let mut missing = Vec::new();
        let index = match &g.key {
            GpuKey::HostGpu { gpu, .. } => *gpu,
            GpuKey::Uuid(u) => {
                missing.push(format!("gpu index: only UUID {u}"));
                u32::MAX
            }
        };
        if let Some(a) = g.temperature_c.absence() {
            missing.push(format!("DCGM_FI_DEV_GPU_TEMP: {}", absent_text(a)));
        }
        if let Some(a) = g.power_w.absence() {
            missing.push(format!("DCGM_FI_DEV_POWER_USAGE: {}", absent_text(a)));
        }
        // A GPU in MIG mode may report its frame buffer per GPU instance only.
        let sum = |values: Vec<Option<f64>>| -> Option<f64> {
            if values.is_empty() || values.iter().any(Option::is_none) {
                None
            } else {
                Some(values.into_iter().flatten().sum())
            }
        };
        let used = g.fb_used_mib.value().or_else(|| {
            sum(g
                .mig_instances
                .iter()
                .map(|m| m.fb_used_mib.value())
                .collect())
        });
        let free = g.fb_free_mib.value().or_else(|| {
            sum(g
                .mig_instances
                .iter()
                .map(|m| m.fb_free_mib.value())
                .collect())
        });
        let memory = match (used, free) {
            (Some(u), Some(f)) if u >= 0.0 && f >= 0.0 => Some((u + f).round() as u64),
            _ => {
                missing.push("DCGM_FI_DEV_FB_USED/FREE: no value".into());
                None
            }
        };
        if g.model_name.is_none() {
            missing.push("modelName: no label".into());
        }
        out.push(GpuFact {
            index,
            id: format!("{}/{index}", config.node),
            source: "dcgm",
            model: g.model_name.as_deref().map(|p| config.gpu_model(p)),
            product: g.model_name.clone(),
            temperature_c: g.temperature_c.value(),
            power_w: g.power_w.value(),
            memory_mib: memory,
            driver: g.driver_version.clone(),
            missing,
        });
    }
    out
}

fn absent_text(a: &probity_collect::Absent) -> String {
    use probity_collect::Absent;
    match a {
        Absent::NotQueried => "not printed".into(),
        Absent::NotAvailable => "[N/A]".into(),
        Absent::NotSupported => "[Not Supported]".into(),
        Absent::Failed(t) | Absent::Other(t) => format!("[{t}]"),
    }
}

/// Where the node's power came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PowerFact {
    /// The node's draw, W, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draw_w: Option<f64>,
    /// `bmc-dcmi`, `rapl+gpus` or `none`.
    pub from: &'static str,
    /// Whether it was read this cycle (only then does it enter the window).
    pub fresh: bool,
    /// The window's mean of the earlier readings, W.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_mean_w: Option<f64>,
    /// The window's readings, oldest first, W (the plugins' `powerReadingsW`).
    pub readings_w: Vec<i64>,
}

/// A number for Cedar, rounded to nearest, clamped.
pub fn long(v: f64) -> i64 {
    if v.is_nan() {
        0
    } else {
        v.round().clamp(i64::MIN as f64, i64::MAX as f64) as i64
    }
}

/// The schema's `Node` attributes that are not the inventory.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeNumbers {
    /// nvidia-smi's (or DCGM's) driver version; "" when none.
    pub driver_version: String,
    /// The GPUs' model, when they agree.
    pub gpu_model: Option<String>,
    /// GPUs seen.
    pub gpu_count: i64,
    /// CPUs.
    pub cpu_count: i64,
    /// The smallest GPU's memory.
    pub gpu_memory_mib: i64,
    /// Hottest temperature, rounded up.
    pub hottest_gpu_temp_c: i64,
    /// The node's draw.
    pub power_draw_w: i64,
    /// The window's mean.
    pub power_window_mean_w: i64,
    /// The `unreadable` set.
    pub unreadable: Vec<String>,
}

/// The node's numbers from its GPUs (`gpus` the ones standing for the node,
/// `temperatures` every temperature read by any source).
pub fn gpu_numbers(
    gpus: &[GpuFact],
    temperatures: &[f64],
) -> (String, Option<String>, i64, i64, i64) {
    let driver = gpus
        .iter()
        .find_map(|g| g.driver.clone())
        .unwrap_or_default();
    let mut models: Vec<&str> = gpus.iter().filter_map(|g| g.model.as_deref()).collect();
    models.sort_unstable();
    models.dedup();
    let model = match models.as_slice() {
        [one] => Some((*one).to_owned()),
        _ => None,
    };
    let count = i64::try_from(gpus.len()).unwrap_or(i64::MAX);
    let memory = gpus
        .iter()
        .filter_map(|g| g.memory_mib)
        .min()
        .map_or(0, |m| i64::try_from(m).unwrap_or(i64::MAX));
    let hottest = temperatures
        .iter()
        .copied()
        .filter(|t| t.is_finite())
        .fold(None, |acc: Option<f64>, t| {
            Some(acc.map_or(t, |a| a.max(t)))
        })
        .map_or(0, |t| long(t.ceil()));
    (driver, model, count, memory, hottest)
}

/// The `Node` entity.
pub fn node_entity(config: &Config, n: &NodeNumbers) -> Value {
    let inv = &config.inventory;
    let mut attrs = serde_json::Map::new();
    attrs.insert(
        "zone".into(),
        json!({"__entity": {"type": "Zone", "id": inv.zone}}),
    );
    attrs.insert("rack".into(), json!(inv.rack));
    attrs.insert("driverVersion".into(), json!(n.driver_version));
    attrs.insert("cudaImage".into(), json!(inv.cuda_image));
    if let Some(role) = &inv.role {
        attrs.insert(
            "role".into(),
            json!({"__entity": {"type": "NodeRole", "id": role}}),
        );
    }
    attrs.insert("gpuNode".into(), json!(inv.gpu_node));
    if let Some(model) = &n.gpu_model {
        attrs.insert(
            "gpuModel".into(),
            json!({"__entity": {"type": "GpuModel", "id": model}}),
        );
    }
    attrs.insert("gpuCount".into(), json!(n.gpu_count));
    attrs.insert("cpuCount".into(), json!(n.cpu_count));
    attrs.insert("gpuMemoryMiB".into(), json!(n.gpu_memory_mib));
    attrs.insert("hottestGpuTempC".into(), json!(n.hottest_gpu_temp_c));
    attrs.insert("powerDrawW".into(), json!(n.power_draw_w));
    attrs.insert("powerWindowMeanW".into(), json!(n.power_window_mean_w));
    attrs.insert("unreadable".into(), json!(n.unreadable));
    json!({
        "uid": {"type": "Node", "id": config.node},
        "attrs": attrs,
        "parents": [{"type": "Zone", "id": inv.zone}],
    })
}

/// A `Gpu` entity, when the GPU's reading is complete.
pub fn gpu_entity(node: &str, g: &GpuFact) -> Option<Value> {
    if !g.is_complete() {
        return None;
    }
    Some(json!({
        "uid": {"type": "Gpu", "id": g.id},
        "attrs": {
            "node": {"__entity": {"type": "Node", "id": node}},
            "model": {"__entity": {"type": "GpuModel", "id": g.model.as_deref()?}},
            "index": g.index,
            "temperatureC": long(g.temperature_c?.ceil()),
            "powerDrawW": long(g.power_w?),
            "memoryMiB": g.memory_mib?,
        },
        "parents": [{"type": "Node", "id": node}],
    }))
}

/// Per-GPU gaps, as `unreadable` reasons keyed by source.
pub fn gaps(gpus: &[GpuFact]) -> BTreeMap<&'static str, String> {
    let mut out: BTreeMap<&'static str, String> = BTreeMap::new();
    for g in gpus.iter().filter(|g| !g.is_complete()) {
        let entry = out.entry(g.source).or_default();
        if !entry.is_empty() {
            entry.push_str("; ");
        }
        entry.push_str(&format!("gpu {}: {}", g.index, g.missing.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use probity_collect::nvidia_smi::{Columns, parse_query_gpu};

    fn config() -> Config {
        Config::parse(
            "t.toml",
            "[node]\nname = \"n1\"\n[inventory]\nzone = \"z\"\nrack = \"r\"\ngpu_node = true\ncuda_image = \"img\"\n",
            std::path::Path::new("."),
        )
        .unwrap()
    }

    #[test]
    fn a_placeholder_is_a_gap_not_a_zero() {
        let csv = b"index, name, temperature.gpu, power.draw, memory.total\n0, NVIDIA H100 80GB HBM3, 40, 100, 81559\n1, NVIDIA H100 80GB HBM3, [GPU is lost], 90, 81559\n";
        let rows = parse_query_gpu(csv, Columns::Header).unwrap();
        let gpus = gpus_from_smi(&config(), &rows);
        assert!(gpus[0].is_complete());
        assert_eq!(gpus[0].model.as_deref(), Some("H100"));
        assert_eq!(gpus[1].temperature_c, None);
        assert_eq!(gpus[1].missing, ["temperature.gpu: [GPU is lost]"]);
        assert!(gpu_entity("n1", &gpus[1]).is_none());
        let g = gpu_entity("n1", &gpus[0]).unwrap();
        assert_eq!(g["uid"]["id"], "n1/0");
        assert_eq!(g["attrs"]["model"]["__entity"]["id"], "H100");
        let gaps = gaps(&gpus);
        assert_eq!(gaps["nvidia-smi"], "gpu 1: temperature.gpu: [GPU is lost]");
    }

    #[test]
    fn the_hottest_temperature_rounds_up_and_mixed_models_are_no_model() {
        let mut a = gpus_from_smi(
            &config(),
            &parse_query_gpu(
                b"index, name, temperature.gpu\n0, NVIDIA H100 80GB HBM3, 70.2\n1, NVIDIA H200, 30\n",
                Columns::Header,
            )
            .unwrap(),
        );
        let (_, model, count, _, hottest) = gpu_numbers(&a, &[70.2, 30.0]);
        assert_eq!((model, count, hottest), (None, 2, 71));
        a.truncate(1);
        let (_, model, ..) = gpu_numbers(&a, &[]);
        assert_eq!(model.as_deref(), Some("H100"));
        assert_eq!(gpu_numbers(&[], &[]).4, 0);
    }
}
