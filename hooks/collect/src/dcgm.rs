//! DCGM exporter: per-GPU telemetry from its Prometheus text, scraped over plain HTTP.
//!
//! Why this module exists: dcgm-exporter is what GPU Operator nodes already run, and its
//! series disagree with each other in ways that break naive keying: a GPU with a pod
//! attached carries `container`, `namespace`, `pod`, `pod_uid` labels that its neighbours
//! lack, label order is not fixed, and MIG series add `GPU_I_PROFILE`/`GPU_I_ID` while `gpu`
//! stays the parent's index. Series are therefore keyed on `(Hostname, gpu)`, or on `UUID`
//! when those are missing, never on the whole label set; MIG series attach to their parent
//! GPU as [`DcgmMigInstance`]s.
//!
//! Values: `DCGM_FI_DEV_GPU_TEMP` (C), `DCGM_FI_DEV_POWER_USAGE` (W), `DCGM_FI_DEV_FB_USED`
//! and `_FREE` (MiB), `DCGM_FI_DEV_GPU_UTIL` (0–100). A `NaN` is no value, not 0.

use std::time::Duration;

use thiserror::Error;

use crate::Collected;
use crate::source::{self, Absent, Failure, Unavailable, Value};

mod exposition;

pub use exposition::{ExpositionError, MAX_EXPOSITION_BYTES, Sample, parse_exposition};

/// GPU temperature, C.
pub const GPU_TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
/// Power draw, W.
pub const POWER_USAGE: &str = "DCGM_FI_DEV_POWER_USAGE";
/// Frame buffer used, MiB.
pub const FB_USED: &str = "DCGM_FI_DEV_FB_USED";
/// Frame buffer free, MiB.
pub const FB_FREE: &str = "DCGM_FI_DEV_FB_FREE";
/// GPU utilisation, percent.
pub const GPU_UTIL: &str = "DCGM_FI_DEV_GPU_UTIL";

/// How a GPU is identified across series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuKey {
    /// The exporter's host name and the GPU index.
    HostGpu {
        /// `Hostname` label.
        hostname: String,
        /// `gpu` label.
        gpu: u32,
    },
    /// Only a `UUID` label.
    Uuid(String),
}

impl std::fmt::Display for GpuKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::HostGpu { hostname, gpu } => write!(f, "{hostname}/gpu {gpu}"),
            Self::Uuid(u) => f.write_str(u),
        }
    }
}

/// One GPU as the exporter reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct DcgmGpu {
    /// How its series were keyed.
    pub key: GpuKey,
    /// `UUID` label.
    pub uuid: Option<String>,
    /// `modelName` label (`NVIDIA H100 80GB HBM3`).
    pub model_name: Option<String>,
    /// `DCGM_FI_DRIVER_VERSION` label, when the exporter adds it.
    pub driver_version: Option<String>,
    /// `pci_bus_id` label (upper-case hex, 8-digit domain).
    pub pci_bus_id: Option<String>,
    /// GPU temperature, C.
    pub temperature_c: Value<f64>,
    /// Power draw, W.
    pub power_w: Value<f64>,
    /// Frame buffer used, MiB.
    pub fb_used_mib: Value<f64>,
    /// Frame buffer free, MiB.
    pub fb_free_mib: Value<f64>,
    /// Utilisation, percent.
    pub gpu_util_pct: Value<f64>,
    /// MIG instances, by `GPU_I_ID`, in order of appearance.
    pub mig_instances: Vec<DcgmMigInstance>,
}

/// One MIG GPU instance of a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct DcgmMigInstance {
    /// `GPU_I_ID`.
    pub gpu_instance_id: String,
    /// `GPU_I_PROFILE` (`1g.10gb`).
    pub profile: Option<String>,
    /// Frame buffer used, MiB.
    pub fb_used_mib: Value<f64>,
    /// Frame buffer free, MiB.
    pub fb_free_mib: Value<f64>,
    /// Utilisation, percent.
    pub gpu_util_pct: Value<f64>,
}

/// What the exporter said about this node's GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct DcgmReport {
    /// GPUs in order of first appearance.
    pub gpus: Vec<DcgmGpu>,
}

/// Why a DCGM scrape failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DcgmError {
    /// The text does not parse.
    #[error("DCGM exporter text")]
    Exposition(#[from] ExpositionError),
    /// A mapped series has neither `Hostname` and `gpu` nor `UUID`.
    #[error("line {line}: {metric} has no Hostname+gpu and no UUID label")]
    MissingKey {
        /// Line.
        line: usize,
        /// Metric.
        metric: String,
    },
    /// A label that must be a number is not.
    #[error("line {line}: label {label}={value:?} is not a GPU index")]
    BadLabel {
        /// Line.
        line: usize,
        /// Label.
        label: &'static str,
        /// Value.
        value: String,
    },
    /// Two series for the same GPU and metric disagree.
    #[error("line {line}: {metric} for {key} is {value}, but an earlier series said {earlier}")]
    ConflictingSeries {
        /// Line of the second series.
        line: usize,
        /// Metric.
        metric: String,
        /// GPU.
        key: String,
        /// This value.
        value: f64,
        /// The earlier value.
        earlier: f64,
    },
    /// One GPU key with two UUIDs.
    #[error("line {line}: {key} has UUID {found}, but an earlier series said {earlier}")]
    ConflictingUuid {
        /// Line.
        line: usize,
        /// GPU.
        key: String,
        /// This UUID.
        found: String,
        /// Earlier UUID.
        earlier: String,
    },
    /// The HTTP request failed.
    #[error("GET {url}")]
    Http {
        /// URL.
        url: String,
        /// Why.
        #[source]
        source: Box<ureq::Error>,
    },
    /// The exporter answered with a status other than 200.
    #[error("GET {url}: HTTP status {status}")]
    HttpStatus {
        /// URL.
        url: String,
        /// Status.
        status: u16,
    },
    /// The body is larger than the cap.
    #[error("GET {url}: body larger than {limit} bytes")]
    BodyTooLarge {
        /// URL.
        url: String,
        /// Cap.
        limit: u64,
    },
}

fn reading(v: f64) -> Value<f64> {
    if v.is_nan() {
        Value::Absent(Absent::NotAvailable)
    } else if v.is_infinite() {
        Value::Absent(Absent::Other(v.to_string()))
    } else {
        Value::Present(v)
    }
}

/// Sets a slot, refusing a second, different value (NaN-aware).
fn set(
    slot: &mut Value<f64>,
    s: &Sample<'_>,
    key: &GpuKey,
    value: Value<f64>,
) -> Result<(), DcgmError> {
    match (&*slot, &value) {
        (Value::Absent(Absent::NotQueried), _) => *slot = value,
        (Value::Present(a), Value::Present(b)) if a != b => {
            return Err(DcgmError::ConflictingSeries {
                line: s.line,
                metric: s.name.to_owned(),
                key: key.to_string(),
                value: *b,
                earlier: *a,
            });
        }
        _ => {}
    }
    Ok(())
}

/// A GPU key borrowed from a sample, so that finding a known GPU allocates nothing.
enum KeyRef<'a> {
    HostGpu(&'a str, u32),
    Uuid(&'a str),
}

impl KeyRef<'_> {
    fn matches(&self, key: &GpuKey) -> bool {
        match (self, key) {
            (Self::HostGpu(h, g), GpuKey::HostGpu { hostname, gpu }) => h == hostname && g == gpu,
            (Self::Uuid(u), GpuKey::Uuid(v)) => u == v,
            _ => false,
        }
    }

    fn to_key(&self) -> GpuKey {
        match self {
            Self::HostGpu(h, g) => GpuKey::HostGpu {
                hostname: (*h).to_owned(),
                gpu: *g,
            },
            Self::Uuid(u) => GpuKey::Uuid((*u).to_owned()),
        }
    }
}

fn key_of<'a>(s: &'a Sample<'_>) -> Result<KeyRef<'a>, DcgmError> {
    match (s.label("Hostname"), s.label("gpu"), s.label("UUID")) {
        (Some(h), Some(g), _) => {
            let gpu = g.parse::<u32>().map_err(|_| DcgmError::BadLabel {
                line: s.line,
                label: "gpu",
                value: crate::text::excerpt(g),
            })?;
            Ok(KeyRef::HostGpu(h, gpu))
        }
        (_, _, Some(u)) if !u.is_empty() => Ok(KeyRef::Uuid(u)),
        _ => Err(DcgmError::MissingKey {
            line: s.line,
            metric: s.name.to_owned(),
        }),
    }
}

/// Maps parsed samples to GPUs. Series of other metrics are ignored.
pub fn map_samples(samples: &[Sample<'_>]) -> Result<DcgmReport, DcgmError> {
    const MAPPED: &[&str] = &[GPU_TEMP, POWER_USAGE, FB_USED, FB_FREE, GPU_UTIL];
    let mut gpus: Vec<DcgmGpu> = Vec::new();
    for s in samples.iter().filter(|s| MAPPED.contains(&s.name)) {
        let key_ref = key_of(s)?;
        let idx = match gpus.iter().position(|g| key_ref.matches(&g.key)) {
            Some(i) => i,
            None => {
                gpus.push(DcgmGpu {
                    key: key_ref.to_key(),
                    uuid: None,
                    model_name: None,
                    driver_version: None,
                    pci_bus_id: None,
                    temperature_c: Value::not_queried(),
                    power_w: Value::not_queried(),
                    fb_used_mib: Value::not_queried(),
                    fb_free_mib: Value::not_queried(),
                    gpu_util_pct: Value::not_queried(),
                    mig_instances: Vec::new(),
                });
                gpus.len() - 1
            }
        };
        let Some(gpu) = gpus.get_mut(idx) else {
            continue;
        };
        let key = &gpu.key;
        if let Some(u) = s.label("UUID").filter(|u| !u.is_empty()) {
            match &gpu.uuid {
                Some(earlier) if earlier != u => {
                    return Err(DcgmError::ConflictingUuid {
                        line: s.line,
                        key: key.to_string(),
                        found: u.to_owned(),
                        earlier: earlier.clone(),
                    });
                }
                Some(_) => {}
                None => gpu.uuid = Some(u.to_owned()),
            }
        }
        for (label, slot) in [
            ("modelName", &mut gpu.model_name),
            ("DCGM_FI_DRIVER_VERSION", &mut gpu.driver_version),
            ("pci_bus_id", &mut gpu.pci_bus_id),
        ] {
            if slot.is_none() {
                *slot = s.label(label).map(str::to_owned);
            }
        }
        let value = reading(s.value);
        if let Some(instance) = s.label("GPU_I_ID") {
            let mig = match gpu
                .mig_instances
                .iter()
                .position(|m| m.gpu_instance_id == instance)
            {
                Some(i) => i,
                None => {
                    gpu.mig_instances.push(DcgmMigInstance {
                        gpu_instance_id: instance.to_owned(),
                        profile: s.label("GPU_I_PROFILE").map(str::to_owned),
                        fb_used_mib: Value::not_queried(),
                        fb_free_mib: Value::not_queried(),
                        gpu_util_pct: Value::not_queried(),
                    });
                    gpu.mig_instances.len() - 1
                }
            };
            let Some(m) = gpu.mig_instances.get_mut(mig) else {
                continue;
            };
            let slot = match s.name {
                FB_USED => &mut m.fb_used_mib,
                FB_FREE => &mut m.fb_free_mib,
                GPU_UTIL => &mut m.gpu_util_pct,
                // Temperature and power belong to the whole GPU, whatever series carries them.
                GPU_TEMP => &mut gpu.temperature_c,
                _ => &mut gpu.power_w,
            };
            set(slot, s, key, value)?;
        } else {
            let slot = match s.name {
                GPU_TEMP => &mut gpu.temperature_c,
                POWER_USAGE => &mut gpu.power_w,
                FB_USED => &mut gpu.fb_used_mib,
                FB_FREE => &mut gpu.fb_free_mib,
                _ => &mut gpu.gpu_util_pct,
            };
            set(slot, s, key, value)?;
        }
    }
    Ok(DcgmReport { gpus })
}

/// Parses an exposition and maps it to GPUs.
pub fn parse_dcgm(input: &[u8]) -> Result<DcgmReport, DcgmError> {
    map_samples(&parse_exposition(input)?)
}

/// Scrapes a dcgm-exporter endpoint over plain HTTP.
#[derive(Debug, Clone)]
pub struct DcgmScrape {
    url: String,
    timeout: Duration,
    body_limit: u64,
}

impl DcgmScrape {
    /// The exporter's default endpoint on this node.
    pub const DEFAULT_URL: &str = "http://127.0.0.1:9400/metrics";

    /// A scrape of `url` with a 5 s deadline and a body cap of
    /// [`MAX_EXPOSITION_BYTES`].
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            timeout: Duration::from_secs(5),
            body_limit: MAX_EXPOSITION_BYTES as u64,
        }
    }

    /// Sets the deadline of the whole request.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the body cap.
    pub fn body_limit(mut self, limit: u64) -> Self {
        self.body_limit = limit;
        self
    }

    /// Fetches and parses. Nothing listening is unavailable (no exporter on this node).
    pub fn scrape(&self) -> Collected<DcgmReport> {
        source::stamp(self.try_scrape())
    }

    fn try_scrape(&self) -> Result<DcgmReport, Failure> {
        let body = self.fetch()?;
        let report = parse_dcgm(&body)?;
        if report.gpus.is_empty() {
            return Err(Failure::Unavailable(Unavailable::Empty {
                what: format!("{} reported no GPU", self.url),
            }));
        }
        Ok(report)
    }

    fn fetch(&self) -> Result<Vec<u8>, Failure> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(self.timeout))
            .http_status_as_error(false)
            .proxy(None)
            .max_redirects(0)
            .build()
            .into();
        let http = |source: ureq::Error| -> Failure {
            let refused = match &source {
                ureq::Error::Io(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
                ureq::Error::ConnectionFailed => true,
                _ => false,
            };
            if refused {
                Failure::Unavailable(Unavailable::NotListening {
                    endpoint: self.url.clone(),
                })
            } else {
                Failure::Error(
                    DcgmError::Http {
                        url: self.url.clone(),
                        source: Box::new(source),
                    }
                    .into(),
                )
            }
        };
        let response = agent.get(&self.url).call().map_err(http)?;
        let status = response.status().as_u16();
        if status != 200 {
            return Err(DcgmError::HttpStatus {
                url: self.url.clone(),
                status,
            }
            .into());
        }
        response
            .into_body()
            .with_config()
            .limit(self.body_limit)
            .read_to_vec()
            .map_err(|e| match e {
                ureq::Error::BodyExceedsLimit(_) => DcgmError::BodyTooLarge {
                    url: self.url.clone(),
                    limit: self.body_limit,
                }
                .into(),
                other => http(other),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_keyed_on_host_and_gpu_not_on_the_label_set() {
        let text =
            br#"DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",Hostname="n1",pod="p",pod_uid=""} 30
DCGM_FI_DEV_POWER_USAGE{Hostname="n1",UUID="GPU-a",gpu="0"} 113.611000
DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n1",UUID="GPU-a",GPU_I_PROFILE="1g.10gb",GPU_I_ID="7"} 512
DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n1",UUID="GPU-a"} 2048
DCGM_FI_DEV_GPU_UTIL{gpu="1",Hostname="n1",UUID="GPU-b"} NaN
"#;
        let r = parse_dcgm(text).unwrap();
        assert_eq!(r.gpus.len(), 2);
        let g0 = &r.gpus[0];
        assert_eq!(g0.temperature_c.value(), Some(30.0));
        assert_eq!(g0.power_w.value(), Some(113.611));
        assert_eq!(g0.fb_used_mib.value(), Some(2048.0));
        assert_eq!(g0.mig_instances.len(), 1);
        assert_eq!(g0.mig_instances[0].gpu_instance_id, "7");
        assert_eq!(g0.mig_instances[0].profile.as_deref(), Some("1g.10gb"));
        assert_eq!(g0.mig_instances[0].fb_used_mib.value(), Some(512.0));
        assert_eq!(r.gpus[1].gpu_util_pct, Value::Absent(Absent::NotAvailable));
    }

    #[test]
    fn disagreeing_duplicates_are_an_error() {
        let text = b"DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",Hostname=\"n\"} 30\nDCGM_FI_DEV_GPU_TEMP{gpu=\"0\",Hostname=\"n\",pod=\"x\"} 31\n";
        assert!(matches!(
            parse_dcgm(text),
            Err(DcgmError::ConflictingSeries { line: 2, .. })
        ));
        let same = b"DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",Hostname=\"n\"} 30\nDCGM_FI_DEV_GPU_TEMP{gpu=\"0\",Hostname=\"n\",pod=\"x\"} 30\n";
        assert_eq!(parse_dcgm(same).unwrap().gpus.len(), 1);
    }

    #[test]
    fn a_series_without_identity_is_an_error() {
        assert!(matches!(
            parse_dcgm(b"DCGM_FI_DEV_GPU_TEMP{modelName=\"x\"} 30\n"),
            Err(DcgmError::MissingKey { line: 1, .. })
        ));
        assert!(matches!(
            parse_dcgm(b"DCGM_FI_DEV_GPU_TEMP{gpu=\"zero\",Hostname=\"n\"} 30\n"),
            Err(DcgmError::BadLabel { .. })
        ));
    }
}
