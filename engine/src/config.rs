//! The thresholds file (`probity.toml`). Policies never hold numbers: the engine
//! turns this file into the `Settings::"active"` entity and one `GpuModel` entity
//! per configured model, which policies read.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};
use toml::Spanned;

use crate::diagnostic::SourceDiagnostic;

/// Thresholds for the default policies, as read from `probity.toml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Inbound TCP ports a node may listen on.
    pub inbound_port_baseline: Vec<u16>,
    /// Inbound UDP ports a node may listen on (default none).
    pub inbound_udp_port_baseline: Vec<u16>,
    /// Maximum age of a key that may encrypt, in days.
    pub key_max_age_days: u32,
    /// Window after a remote login in which elevation needs authorization, in minutes.
    pub elevation_window_minutes: u32,
    /// The driver version every GPU node runs.
    pub pinned_driver: String,
    /// The CUDA image every GPU node runs.
    pub pinned_cuda_image: String,
    /// The namespace held to the GPU:CPU ratio.
    pub inference_namespace: String,
    /// More namespaces held to it: names, or prefixes ending in `*` (default none).
    pub inference_namespaces: Vec<String>,
    /// CPUs a workload in the inference namespace keeps per GPU.
    pub inference_cpus_per_gpu: u32,
    /// The workload class that goes only to its dedicated zone.
    pub rlhf_class: String,
    /// The workload classes admission accepts.
    pub workload_classes: Vec<String>,
    /// Largest share (percent) of one GPU's memory a workload may request.
    pub gpu_memory_max_pct: u32,
    /// On-prem GPU occupancy (percent) at which placements carry burst_to_cloud.
    pub burst_occupancy_pct: u32,
    /// How far (percent) above its window mean a power reading is an anomaly.
    pub power_spike_pct: u32,
    /// Share (percent) of its fan-curve ceiling at which a zone takes no new work.
    pub zone_power_ceiling_pct: u32,
    /// Temperature target per GPU model, degrees C.
    pub gpu_temp_target_c: BTreeMap<String, u32>,
    /// Inbound ports per node role (`[roles.<name>]`).
    pub roles: BTreeMap<String, RoleBaseline>,
}

/// One node role's inbound baseline: the ports its nodes may listen on and the
/// firewall lets in, per protocol, with optional source restrictions.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RoleBaseline {
    /// TCP ports and ranges (inclusive).
    pub tcp: Vec<(u16, u16)>,
    /// UDP ports and ranges (inclusive).
    pub udp: Vec<(u16, u16)>,
    /// `"tcp/10250"` -> the source prefixes that port is reachable from (else any).
    pub from: BTreeMap<String, Vec<String>>,
}

impl RoleBaseline {
    /// Every port of `ranges`, expanded (for Cedar sets).
    fn expand(ranges: &[(u16, u16)]) -> Vec<u16> {
        let mut out: Vec<u16> = ranges.iter().flat_map(|(a, b)| *a..=*b).collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    security: RawSecurity,
    placement: RawPlacement,
    thermal: RawThermal,
    #[serde(default)]
    roles: BTreeMap<String, RawRole>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRole {
    #[serde(default)]
    tcp: Vec<Spanned<toml::Value>>,
    #[serde(default)]
    udp: Vec<Spanned<toml::Value>>,
    #[serde(default)]
    from: BTreeMap<String, Spanned<Vec<Spanned<String>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSecurity {
    inbound_port_baseline: Vec<Spanned<i64>>,
    #[serde(default)]
    inbound_udp_port_baseline: Vec<Spanned<i64>>,
    key_max_age_days: Spanned<i64>,
    elevation_window_minutes: Spanned<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlacement {
    pinned_driver: Spanned<String>,
    pinned_cuda_image: Spanned<String>,
    inference_namespace: Spanned<String>,
    #[serde(default)]
    inference_namespaces: Vec<Spanned<String>>,
    inference_cpus_per_gpu: Spanned<i64>,
    rlhf_class: Spanned<String>,
    #[serde(default)]
    workload_classes: Option<Spanned<Vec<Spanned<String>>>>,
    gpu_memory_max_pct: Spanned<i64>,
    burst_occupancy_pct: Spanned<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawThermal {
    power_spike_pct: Spanned<i64>,
    zone_power_ceiling_pct: Spanned<i64>,
    gpu_temp_target_c: BTreeMap<String, Spanned<i64>>,
}

/// Each threshold's allowed range, and why its ends are where they are: a value that
/// would switch its rule off is refused at file:line:column rather than silently
/// accepted (`elevation_window_minutes = 0` would never alert, `zone_power_ceiling_pct
/// = 0` would stop all scheduling, one over 100 would never stop any).
pub(crate) const RANGES: &[(&str, i64, i64, &str)] = &[
    ("inbound_port_baseline", 1, 65_535, "a TCP port"),
    ("inbound_udp_port_baseline", 1, 65_535, "a UDP port"),
    ("key_max_age_days", 1, 36_500, "0 would refuse every key"),
    (
        "elevation_window_minutes",
        1,
        10_080,
        "0 would switch the elevation rule off",
    ),
    (
        "inference_cpus_per_gpu",
        1,
        1_024,
        "0 would switch the GPU:CPU rule off",
    ),
    (
        "gpu_memory_max_pct",
        1,
        100,
        "0 refuses every GPU workload; over 100 switches the rule off",
    ),
    ("burst_occupancy_pct", 1, 100, "over 100 would never burst"),
    (
        "power_spike_pct",
        1,
        1_000,
        "0 would call every reading a spike",
    ),
    (
        "zone_power_ceiling_pct",
        1,
        100,
        "0 stops all scheduling; over 100 never stops any",
    ),
    ("gpu_temp_target_c", 1, 149, "degrees C"),
];

fn range_of(name: &str) -> Range<i64> {
    let key = name.split('.').next().unwrap_or(name);
    RANGES
        .iter()
        .find(|(n, ..)| *n == key)
        .map_or(i64::MIN..i64::MAX, |(_, lo, hi, _)| {
            *lo..hi.saturating_add(1)
        })
}

fn why_of(name: &str) -> &'static str {
    let key = name.split('.').next().unwrap_or(name);
    RANGES
        .iter()
        .find(|(n, ..)| *n == key)
        .map_or("", |(.., why)| why)
}

/// Checks numbers against their allowed range and reports the first that is out of it.
struct Checker<'a> {
    file: &'a str,
    text: &'a Arc<str>,
}

impl Checker<'_> {
    fn range<T: TryFrom<i64>>(
        &self,
        name: &str,
        value: &Spanned<i64>,
    ) -> Result<T, Box<SourceDiagnostic>> {
        let allowed = range_of(name);
        let v = *value.get_ref();
        if let (true, Ok(ok)) = (allowed.contains(&v), T::try_from(v)) {
            return Ok(ok);
        }
        let span = value.span();
        let why = why_of(name);
        Err(Box::new(SourceDiagnostic::new(
            self.file,
            self.text,
            span.start,
            span.len(),
            format!(
                "{name} must be between {} and {}, found {v}{}",
                allowed.start,
                allowed.end - 1,
                if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({why})")
                }
            ),
        )))
    }

    /// A port (`22`) or an inclusive range (`"30000-32767"`).
    fn port_range(
        &self,
        name: &str,
        value: &Spanned<toml::Value>,
    ) -> Result<(u16, u16), Box<SourceDiagnostic>> {
        let bad = || {
            let span = value.span();
            Box::new(SourceDiagnostic::new(
                self.file,
                self.text,
                span.start,
                span.len(),
                format!(
                    "{name}: expected a port (1-65535) or a range \"FROM-TO\", found {}",
                    value.get_ref()
                ),
            ))
        };
        let port = |n: i64| u16::try_from(n).ok().filter(|p| *p > 0);
        match value.get_ref() {
            toml::Value::Integer(n) => port(*n).map(|p| (p, p)).ok_or_else(bad),
            toml::Value::String(s) => {
                let (a, b) = s.split_once('-').ok_or_else(bad)?;
                let a = a
                    .trim()
                    .parse::<i64>()
                    .ok()
                    .and_then(port)
                    .ok_or_else(bad)?;
                let b = b
                    .trim()
                    .parse::<i64>()
                    .ok()
                    .and_then(port)
                    .ok_or_else(bad)?;
                if a > b {
                    return Err(bad());
                }
                Ok((a, b))
            }
            _ => Err(bad()),
        }
    }

    fn non_empty(
        &self,
        name: &str,
        value: &Spanned<String>,
    ) -> Result<String, Box<SourceDiagnostic>> {
        if value.get_ref().trim().is_empty() {
            let span = value.span();
            return Err(Box::new(SourceDiagnostic::new(
                self.file,
                self.text,
                span.start,
                span.len(),
                format!("{name} must not be empty"),
            )));
        }
        Ok(value.get_ref().clone())
    }
}

impl Config {
    /// Parses and checks `text`, the contents of `file`.
    pub fn parse(file: &str, text: &Arc<str>) -> Result<Self, Box<SourceDiagnostic>> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let (offset, len) = e.span().map_or((0, 0), |s| (s.start, s.len()));
            Box::new(SourceDiagnostic::new(
                file,
                text,
                offset,
                len,
                e.message().to_owned(),
            ))
        })?;
        let c = Checker { file, text };
        let s = &raw.security;
        let p = &raw.placement;
        let t = &raw.thermal;
        let ports = |name: &str, list: &[Spanned<i64>]| {
            list.iter()
                .map(|port| c.range(name, port))
                .collect::<Result<Vec<u16>, _>>()
        };
        let gpu_temp_target_c = t
            .gpu_temp_target_c
            .iter()
            .map(|(model, v)| {
                Ok((
                    model.clone(),
                    c.range(&format!("gpu_temp_target_c.{model}"), v)?,
                ))
            })
            .collect::<Result<BTreeMap<_, _>, Box<SourceDiagnostic>>>()?;
        let rlhf_class = c.non_empty("rlhf_class", &p.rlhf_class)?;
        // Without a list, the classes the default policies and admission know.
        let workload_classes = match &p.workload_classes {
            None => ["inference", "training", "batch", rlhf_class.as_str()]
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            Some(list) => {
                let names = list
                    .get_ref()
                    .iter()
                    .map(|n| c.non_empty("workload_classes", n))
                    .collect::<Result<Vec<String>, _>>()?;
                if !names.contains(&rlhf_class) {
                    let span = list.span();
                    return Err(Box::new(SourceDiagnostic::new(
                        file,
                        text,
                        span.start,
                        span.len(),
                        format!("workload_classes must include rlhf_class ({rlhf_class:?})"),
                    )));
                }
                names
            }
        };
        let mut roles = BTreeMap::new();
        for (name, raw) in &raw.roles {
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            {
                return Err(Box::new(SourceDiagnostic::new(
                    file,
                    text,
                    0,
                    0,
                    format!("roles.{name}: a role name is letters, digits, '-', '_' and '.'"),
                )));
            }
            let role = RoleBaseline {
                tcp: raw
                    .tcp
                    .iter()
                    .map(|v| c.port_range(&format!("roles.{name}.tcp"), v))
                    .collect::<Result<_, _>>()?,
                udp: raw
                    .udp
                    .iter()
                    .map(|v| c.port_range(&format!("roles.{name}.udp"), v))
                    .collect::<Result<_, _>>()?,
                from: raw
                    .from
                    .iter()
                    .map(|(key, prefixes)| {
                        let at = |message: String, span: Range<usize>| {
                            Box::new(SourceDiagnostic::new(file, text, span.start, span.len(), message))
                        };
                        let ok_key = key
                            .split_once('/')
                            .is_some_and(|(p, port)| matches!(p, "tcp" | "udp") && port.parse::<u16>().is_ok_and(|n| n > 0));
                        if !ok_key {
                            return Err(at(
                                format!("roles.{name}.from: {key:?} is not \"tcp/PORT\" or \"udp/PORT\""),
                                prefixes.span(),
                            ));
                        }
                        let list = prefixes
                            .get_ref()
                            .iter()
                            .map(|p| {
                                if is_prefix(p.get_ref()) {
                                    Ok(p.get_ref().clone())
                                } else {
                                    Err(at(
                                        format!("roles.{name}.from.{key}: {:?} is not an address prefix (10.0.0.0/8, fd00::/8)", p.get_ref()),
                                        p.span(),
                                    ))
                                }
                            })
                            .collect::<Result<Vec<_>, _>>()?;
                        Ok((key.clone(), list))
                    })
                    .collect::<Result<_, _>>()?,
            };
            roles.insert(name.clone(), role);
        }
        Ok(Self {
            roles,
            inbound_port_baseline: ports("inbound_port_baseline", &s.inbound_port_baseline)?,
            inbound_udp_port_baseline: ports(
                "inbound_udp_port_baseline",
                &s.inbound_udp_port_baseline,
            )?,
            key_max_age_days: c.range("key_max_age_days", &s.key_max_age_days)?,
            elevation_window_minutes: c
                .range("elevation_window_minutes", &s.elevation_window_minutes)?,
            pinned_driver: c.non_empty("pinned_driver", &p.pinned_driver)?,
            pinned_cuda_image: c.non_empty("pinned_cuda_image", &p.pinned_cuda_image)?,
            inference_namespace: c.non_empty("inference_namespace", &p.inference_namespace)?,
            inference_namespaces: p
                .inference_namespaces
                .iter()
                .map(|n| c.non_empty("inference_namespaces", n))
                .collect::<Result<_, _>>()?,
            inference_cpus_per_gpu: c.range("inference_cpus_per_gpu", &p.inference_cpus_per_gpu)?,
            rlhf_class,
            workload_classes,
            gpu_memory_max_pct: c.range("gpu_memory_max_pct", &p.gpu_memory_max_pct)?,
            burst_occupancy_pct: c.range("burst_occupancy_pct", &p.burst_occupancy_pct)?,
            power_spike_pct: c.range("power_spike_pct", &t.power_spike_pct)?,
            zone_power_ceiling_pct: c.range("zone_power_ceiling_pct", &t.zone_power_ceiling_pct)?,
            gpu_temp_target_c,
        })
    }

    /// The `Settings::"active"` and `GpuModel` entities, in Cedar's entity JSON format.
    pub fn entities_json(&self) -> Value {
        let mut entities = vec![json!({
            "uid": { "type": "Settings", "id": "active" },
            "attrs": {
                "inboundPortBaseline": self.inbound_port_baseline,
                "inboundUdpPortBaseline": self.inbound_udp_port_baseline,
                "workloadClasses": self.workload_classes,
                "keyMaxAgeSeconds": i64::from(self.key_max_age_days) * 86_400,
                "elevationWindowSeconds": i64::from(self.elevation_window_minutes) * 60,
                "pinnedDriver": self.pinned_driver,
                "pinnedCudaImage": self.pinned_cuda_image,
                "inferenceNamespace": { "__entity": { "type": "Namespace", "id": self.inference_namespace } },
                "inferenceNamespaces": self.inference_namespaces,
                "inferenceCpuMillisPerGpu": i64::from(self.inference_cpus_per_gpu) * 1000,
                "rlhfClass": self.rlhf_class,
                "gpuMemoryMaxPct": self.gpu_memory_max_pct,
                "burstOccupancyPct": self.burst_occupancy_pct,
                "powerSpikePct": self.power_spike_pct,
                "zonePowerCeilingPct": self.zone_power_ceiling_pct,
            },
            "parents": []
        })];
        for (name, role) in &self.roles {
            let restricted: Vec<String> = role
                .from
                .iter()
                .flat_map(|(k, prefixes)| prefixes.iter().map(move |p| format!("{k} {p}")))
                .collect();
            entities.push(json!({
                "uid": { "type": "NodeRole", "id": name },
                "attrs": {
                    "tcpPorts": RoleBaseline::expand(&role.tcp),
                    "udpPorts": RoleBaseline::expand(&role.udp),
                    "restricted": restricted,
                },
                "parents": []
            }));
        }
        for (model, target) in &self.gpu_temp_target_c {
            entities.push(json!({
                "uid": { "type": "GpuModel", "id": model },
                "attrs": { "tempTargetC": target },
                "parents": []
            }));
        }
        Value::Array(entities)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT: &str = include_str!("../../policies/probity.toml");

    fn parse(text: &str) -> Result<Config, Box<SourceDiagnostic>> {
        Config::parse("probity.toml", &Arc::from(text))
    }

    #[test]
    fn default_configuration_parses() {
        let c = parse(DEFAULT).unwrap();
        assert_eq!(c.inbound_port_baseline, vec![22, 2379, 2380]);
        assert_eq!(c.gpu_temp_target_c.get("A100"), Some(&65));
        assert_eq!(c.key_max_age_days, 90);
    }

    #[test]
    fn negative_threshold_is_rejected_with_its_location() {
        let text = DEFAULT.replace("key_max_age_days = 90", "key_max_age_days = -5");
        let err = parse(&text).unwrap_err();
        assert!(
            err.message
                .contains("key_max_age_days must be between 1 and 36500, found -5"),
            "{err}"
        );
        let line = text
            .lines()
            .position(|l| l.starts_with("key_max_age_days"))
            .unwrap()
            + 1;
        assert_eq!((err.line, err.column), (line, 20));
    }

    #[test]
    fn unknown_key_and_bad_syntax_are_located() {
        let err = parse(&DEFAULT.replace("[thermal]", "[thermal]\nfan_speed = 3")).unwrap_err();
        assert!(err.message.contains("unknown field `fan_speed`"), "{err}");
        let err = parse("[security\n").unwrap_err();
        assert_eq!(err.line, 1);
    }

    #[test]
    fn settings_entity_holds_derived_units() {
        let v = parse(DEFAULT).unwrap().entities_json();
        assert_eq!(v[0]["attrs"]["keyMaxAgeSeconds"], 90 * 86_400);
        assert_eq!(v[0]["attrs"]["inferenceCpuMillisPerGpu"], 8000);
    }
}

#[cfg(test)]
mod disabling_values {
    use super::*;

    const DEFAULT: &str = include_str!("../../policies/probity.toml");

    /// Each value that would switch its rule off, refused at its own line and column.
    #[test]
    fn thresholds_that_disable_their_rule_are_refused_where_they_stand() {
        for (from, to) in [
            (
                "elevation_window_minutes = 5",
                "elevation_window_minutes = 0",
            ),
            ("key_max_age_days = 90", "key_max_age_days = 0"),
            ("power_spike_pct = 25", "power_spike_pct = 0"),
            ("zone_power_ceiling_pct = 95", "zone_power_ceiling_pct = 0"),
            (
                "zone_power_ceiling_pct = 95",
                "zone_power_ceiling_pct = 101",
            ),
            ("burst_occupancy_pct = 90", "burst_occupancy_pct = 101"),
            ("inference_cpus_per_gpu = 8", "inference_cpus_per_gpu = 0"),
            ("gpu_memory_max_pct = 90", "gpu_memory_max_pct = 0"),
            ("gpu_memory_max_pct = 90", "gpu_memory_max_pct = 101"),
        ] {
            assert!(DEFAULT.contains(from), "{from}");
            let text = DEFAULT.replace(from, to);
            let err = Config::parse("probity.toml", &Arc::from(text.as_str())).unwrap_err();
            let name = to.split(' ').next().unwrap();
            assert!(
                err.message.starts_with(&format!("{name} must be between")),
                "{to}: {err}"
            );
            let line = text.lines().position(|l| l.starts_with(to)).unwrap() + 1;
            assert_eq!(
                (err.line, err.column),
                (line, to.len() - to.rsplit(' ').next().unwrap().len() + 1),
                "{to}"
            );
        }
    }
}

/// `ADDRESS/BITS` with an IPv4 or IPv6 address and a length that fits it.
fn is_prefix(s: &str) -> bool {
    let Some((addr, bits)) = s.split_once('/') else {
        return false;
    };
    let Ok(bits) = bits.parse::<u8>() else {
        return false;
    };
    match addr.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(_)) => bits <= 32,
        Ok(std::net::IpAddr::V6(_)) => bits <= 128,
        Err(_) => false,
    }
}

#[cfg(test)]
mod roles {
    use super::*;

    const DEFAULT: &str = include_str!("../../policies/probity.toml");

    #[test]
    fn roles_expand_into_node_role_entities() {
        let c = Config::parse("probity.toml", &Arc::from(DEFAULT)).unwrap();
        let worker = &c.roles["gpu-worker"];
        assert!(worker.tcp.contains(&(30000, 32767)));
        let json = c.entities_json();
        let role = json
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["uid"]["id"] == "gpu-worker")
            .unwrap();
        let tcp = role["attrs"]["tcpPorts"].as_array().unwrap();
        assert!(tcp.contains(&json!(10250)) && tcp.contains(&json!(32767)));
        assert_eq!(role["attrs"]["restricted"], json!(["tcp/10250 10.0.0.0/8"]));
    }

    #[test]
    fn a_bad_port_range_or_prefix_is_located() {
        for (from, to, what) in [
            (
                "tcp = [22, 10250, 179, \"30000-32767\"]",
                "tcp = [22, \"9-1\"]",
                "roles.gpu-worker.tcp: expected a port",
            ),
            (
                "tcp = [22, 10250, 179, \"30000-32767\"]",
                "tcp = [22, 70000]",
                "roles.gpu-worker.tcp: expected a port",
            ),
            (
                "\"tcp/10250\" = [\"10.0.0.0/8\"]",
                "\"tcp/10250\" = [\"10.0.0.0/33\"]",
                "is not an address prefix",
            ),
            (
                "\"tcp/10250\" = [\"10.0.0.0/8\"]",
                "\"sctp/1\" = [\"10.0.0.0/8\"]",
                "is not \"tcp/PORT\"",
            ),
        ] {
            assert!(DEFAULT.contains(from), "{from}");
            let text = DEFAULT.replace(from, to);
            let err = Config::parse("probity.toml", &Arc::from(text.as_str())).unwrap_err();
            assert!(err.message.contains(what), "{to}: {err}");
            assert!(err.line > 1, "{err}");
        }
    }
}
