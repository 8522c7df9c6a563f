//! The file as written, and how it becomes a `Config` with every default applied.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use probity_siem::SiemSettings;
use serde::Deserialize;
use toml::Spanned;

use super::check::{Check, parse_toml, read_file, valid_id};
use super::{
    Alerts, Audit, AuditSource, AuditStart, Collect, Config, ConfigError, DEFAULT_GPU_MODELS,
    DcgmSource, EngineFiles, Firewall, FirewallMode, Inventory, Located, RaplSource, ToolSource,
};

// ---------------------------------------------------------------------------------------
// The file as written.

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct Raw {
    node: RawNode,
    inventory: RawInventory,
    collect: RawCollect,
    nvidia_smi: RawTool,
    dcgm: RawDcgm,
    rapl: RawRapl,
    ipmi: RawTool,
    proc: RawProc,
    firewall: RawFirewall,
    gpu_models: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    alerts: RawAlerts,
    audit: RawAudit,
    engine: RawEngine,
    state: RawState,
    siem: Option<Spanned<SiemSettings>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawNode {
    name: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawInventory {
    file: Option<Spanned<PathBuf>>,
    zone: Option<Spanned<String>>,
    rack: Option<Spanned<String>>,
    role: Option<Spanned<String>>,
    gpu_node: Option<Spanned<bool>>,
    cuda_image: Option<Spanned<String>>,
    cpu_count: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawCollect {
    interval_seconds: Option<Spanned<i64>>,
    stale_after_seconds: Option<Spanned<i64>>,
    power_window_seconds: Option<Spanned<i64>>,
    max_listen_decisions: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawTool {
    enabled: Option<bool>,
    binary: Option<PathBuf>,
    timeout_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawDcgm {
    url: Option<Spanned<String>>,
    timeout_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawRapl {
    enabled: Option<bool>,
    root: Option<PathBuf>,
    include_dram: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawProc {
    root: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawFirewall {
    mode: Option<FirewallMode>,
    nft: Option<PathBuf>,
    iptables_save: Option<PathBuf>,
    ip6tables_save: Option<PathBuf>,
    read_iptables: Option<bool>,
    timeout_ms: Option<Spanned<i64>>,
    control_plane: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawAlerts {
    alertmanager_url: Option<Spanned<String>>,
    webhook_url: Option<Spanned<String>>,
    refresh_seconds: Option<Spanned<i64>>,
    expiry_seconds: Option<Spanned<i64>>,
    timeout_ms: Option<Spanned<i64>>,
    ca_file: Option<PathBuf>,
    elevation_hold_seconds: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawAudit {
    enabled: Option<bool>,
    source: Option<AuditSource>,
    path: Option<PathBuf>,
    start: Option<AuditStart>,
    poll_interval_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawEngine {
    policies: Option<PathBuf>,
    entities: Option<PathBuf>,
    users: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawState {
    dir: Option<PathBuf>,
}

/// The inventory file: the `[inventory]` keys at its top level.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct RawInventoryFile {
    zone: Option<Spanned<String>>,
    rack: Option<Spanned<String>>,
    role: Option<Spanned<String>>,
    gpu_node: Option<Spanned<bool>>,
    cuda_image: Option<Spanned<String>>,
    cpu_count: Option<Spanned<i64>>,
}

impl Config {
    /// Reads and checks a configuration file; relative paths in it (the inventory file)
    /// are taken from the directory it is in.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read_file(path)?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::parse(&path.display().to_string(), &text, &base)
    }

    /// Parses configuration text named `file`; an inventory file it names is read
    /// relative to `base`.
    pub fn parse(file: &str, text: &str, base: &Path) -> Result<Self, ConfigError> {
        let raw: Raw = parse_toml(file, text)?;
        let c = Check { file, text };

        let node = match &raw.node.name {
            Some(n) => c.id(n, "node.name")?,
            None => default_node_name().ok_or_else(|| {
                c.err(
                    0..0,
                    "node.name is not set, NODE_NAME is not set, and the host name is not a valid node name",
                )
            })?,
        };

        let inventory = match &raw.inventory.file {
            Some(f) => {
                let i = &raw.inventory;
                let inline = [
                    i.zone.as_ref().map(Spanned::span),
                    i.rack.as_ref().map(Spanned::span),
                    i.role.as_ref().map(Spanned::span),
                    i.gpu_node.as_ref().map(Spanned::span),
                    i.cuda_image.as_ref().map(Spanned::span),
                    i.cpu_count.as_ref().map(Spanned::span),
                ];
                if let Some(span) = inline.into_iter().flatten().next() {
                    return Err(c
                        .err(
                            span,
                            "inventory.file is set: the inventory facts come from that file, not from here",
                        )
                        .into());
                }
                // `{node}` in the path stands for the node's name: one inventory file
                // per node in one directory (a ConfigMap with a key per node).
                let named = f.get_ref().to_string_lossy().replace("{node}", &node);
                let path = base.join(named);
                let ftext = read_file(&path)?;
                let fname = path.display().to_string();
                let r: RawInventoryFile = parse_toml(&fname, &ftext)?;
                let fc = Check {
                    file: &fname,
                    text: &ftext,
                };
                inventory(
                    &fc,
                    RawInventory {
                        file: None,
                        zone: r.zone,
                        rack: r.rack,
                        role: r.role,
                        gpu_node: r.gpu_node,
                        cuda_image: r.cuda_image,
                        cpu_count: r.cpu_count,
                    },
                    f.span(),
                )?
            }
            None => inventory(&c, raw.inventory, 0..0)?,
        };

        let interval = c.seconds(
            &raw.collect.interval_seconds,
            "collect.interval_seconds",
            15,
        )?;
        let stale_after = c.seconds(
            &raw.collect.stale_after_seconds,
            "collect.stale_after_seconds",
            60,
        )?;
        if stale_after < interval
            && let Some(s) = &raw.collect.stale_after_seconds
        {
            return Err(c
                .err(
                    s.span(),
                    format!(
                        "collect.stale_after_seconds ({}) must be at least collect.interval_seconds ({}): every reading would be stale before the next",
                        stale_after.as_secs(),
                        interval.as_secs()
                    ),
                )
                .into());
        }
        let power_window = c.seconds(
            &raw.collect.power_window_seconds,
            "collect.power_window_seconds",
            600,
        )?;
        let max_listen = c.int(
            &raw.collect.max_listen_decisions,
            "collect.max_listen_decisions",
            1,
            65_536,
            4096,
        )?;

        let tool = |r: &RawTool, name: &str, program: &str, default_on: bool| {
            Ok::<_, Located>(ToolSource {
                enabled: r.enabled.unwrap_or(default_on),
                binary: r.binary.clone().unwrap_or_else(|| PathBuf::from(program)),
                timeout: c.millis(&r.timeout_ms, &format!("{name}.timeout_ms"), 10_000)?,
            })
        };
        let nvidia_smi = tool(
            &raw.nvidia_smi,
            "nvidia_smi",
            "nvidia-smi",
            inventory.gpu_node,
        )?;
        let ipmi = tool(&raw.ipmi, "ipmi", "ipmitool", true)?;
        let dcgm = DcgmSource {
            url: c.url(&raw.dcgm.url, "dcgm.url", false)?,
            timeout: c.millis(&raw.dcgm.timeout_ms, "dcgm.timeout_ms", 2_000)?,
        };
        let rapl = RaplSource {
            enabled: raw.rapl.enabled.unwrap_or(true),
            root: raw
                .rapl
                .root
                .unwrap_or_else(|| PathBuf::from("/sys/class/powercap")),
            include_dram: raw.rapl.include_dram.unwrap_or(false),
        };
        let proc_root = raw.proc.root.unwrap_or_else(|| PathBuf::from("/proc"));

        let control_plane = match &raw.firewall.control_plane {
            None => None,
            Some(s) => Some(s.get_ref().parse::<SocketAddr>().map_err(|_| {
                c.err(
                    s.span(),
                    format!(
                        "firewall.control_plane must be an address and port like \"10.0.0.1:6443\" or \"[fd00::1]:6443\", not {:?}",
                        s.get_ref()
                    ),
                )
            })?),
        };
        let firewall = Firewall {
            mode: raw.firewall.mode.unwrap_or_default(),
            nft: raw
                .firewall
                .nft
                .unwrap_or_else(|| PathBuf::from("/usr/sbin/nft")),
            iptables_save: raw
                .firewall
                .iptables_save
                .unwrap_or_else(|| PathBuf::from("/usr/sbin/iptables-save")),
            ip6tables_save: raw
                .firewall
                .ip6tables_save
                .unwrap_or_else(|| PathBuf::from("/usr/sbin/ip6tables-save")),
            read_iptables: raw.firewall.read_iptables.unwrap_or(true),
            timeout: c.millis(&raw.firewall.timeout_ms, "firewall.timeout_ms", 10_000)?,
            control_plane,
        };

        let gpu_models = match &raw.gpu_models {
            None => DEFAULT_GPU_MODELS
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            Some(table) => {
                let mut out = BTreeMap::new();
                for (product, model) in table.get_ref() {
                    let m = model.get_ref().trim();
                    if m.is_empty() || m.len() > 128 || m.chars().any(char::is_control) {
                        return Err(c
                            .err(
                                model.span(),
                                format!(
                                    "gpu_models: the model id for {product:?} must be 1-128 printable characters"
                                ),
                            )
                            .into());
                    }
                    out.insert(product.clone(), m.to_owned());
                }
                out
            }
        };

        let refresh = c.seconds(&raw.alerts.refresh_seconds, "alerts.refresh_seconds", 60)?;
        let expiry = c.seconds(&raw.alerts.expiry_seconds, "alerts.expiry_seconds", 300)?;
        if refresh >= expiry {
            let span = raw
                .alerts
                .refresh_seconds
                .as_ref()
                .or(raw.alerts.expiry_seconds.as_ref())
                .map_or(0..0, Spanned::span);
            return Err(c
                .err(
                    span,
                    format!(
                        "alerts.refresh_seconds ({}) must be shorter than alerts.expiry_seconds ({}), or alerts expire between refreshes",
                        refresh.as_secs(),
                        expiry.as_secs()
                    ),
                )
                .into());
        }
        let alerts = Alerts {
            alertmanager_url: c.url(
                &raw.alerts.alertmanager_url,
                "alerts.alertmanager_url",
                true,
            )?,
            webhook_url: c.url(&raw.alerts.webhook_url, "alerts.webhook_url", true)?,
            refresh,
            expiry,
            timeout: c.millis(&raw.alerts.timeout_ms, "alerts.timeout_ms", 10_000)?,
            ca_file: raw.alerts.ca_file,
            elevation_hold: c.seconds(
                &raw.alerts.elevation_hold_seconds,
                "alerts.elevation_hold_seconds",
                3600,
            )?,
        };

        let audit = Audit {
            enabled: raw.audit.enabled.unwrap_or(false),
            source: raw.audit.source.unwrap_or_default(),
            path: raw
                .audit
                .path
                .unwrap_or_else(|| PathBuf::from("/var/log/audit/audit.log")),
            start: raw.audit.start.unwrap_or_default(),
            poll_interval: c.millis(&raw.audit.poll_interval_ms, "audit.poll_interval_ms", 1000)?,
        };

        let siem = match raw.siem {
            Some(table) => {
                let span = table.span();
                let siem = table.into_inner();
                siem.check()
                    .map_err(|m| c.err(span.clone(), format!("siem: {m}")))?;
                if siem.address.is_some() && raw.state.dir.is_none() {
                    return Err(c
                        .err(
                            span,
                            "siem needs [state] dir: the logs it forwards and its delivery cursors live there",
                        )
                        .into());
                }
                siem
            }
            None => SiemSettings::default(),
        };

        Ok(Config {
            origin: file.to_owned(),
            node,
            inventory,
            collect: Collect {
                interval,
                stale_after,
                power_window,
                max_listen_decisions: usize::try_from(max_listen).unwrap_or(4096),
            },
            nvidia_smi,
            dcgm,
            rapl,
            ipmi,
            proc_root,
            firewall,
            gpu_models,
            alerts,
            audit,
            engine: EngineFiles {
                policies: raw.engine.policies,
                entities: raw.engine.entities,
                users: raw.engine.users,
            },
            state_dir: raw.state.dir,
            siem,
        })
    }

    /// The `GpuModel` id of a product name: the mapped one, else the name itself (which
    /// the policies then find unknown: a finding, never a guess).
    pub fn gpu_model(&self, product: &str) -> String {
        self.gpu_models
            .get(product.trim())
            .cloned()
            .unwrap_or_else(|| product.trim().to_owned())
    }
}

/// Builds the inventory, requiring zone and rack; `missing_at` locates a missing key (the
/// `file` key when the facts came from a file).
fn inventory(
    c: &Check<'_>,
    r: RawInventory,
    missing_at: Range<usize>,
) -> Result<Inventory, Located> {
    let required = |v: &Option<Spanned<String>>, name: &str| -> Result<String, Located> {
        match v {
            Some(s) if !s.get_ref().trim().is_empty() => Ok(s.get_ref().trim().to_owned()),
            Some(s) => Err(c.err(s.span(), format!("inventory.{name} must not be empty"))),
            None => Err(c.err(
                missing_at.clone(),
                format!("inventory.{name} is required: the agent cannot read it from the node"),
            )),
        }
    };
    let zone = required(&r.zone, "zone")?;
    let rack = required(&r.rack, "rack")?;
    let role = match &r.role {
        None => None,
        Some(s) => {
            let v = s.get_ref();
            let ok = !v.is_empty()
                && v.len() <= 64
                && v.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'));
            if !ok {
                return Err(c.err(
                    s.span(),
                    format!("inventory.role {v:?} must be 1-64 of A-Z a-z 0-9 . _ -"),
                ));
            }
            Some(v.clone())
        }
    };
    let gpu_node = r.gpu_node.as_ref().is_some_and(|b| *b.get_ref());
    let cuda_image = match &r.cuda_image {
        Some(s) => s.get_ref().trim().to_owned(),
        None if gpu_node => {
            return Err(c.err(
                r.gpu_node.as_ref().map_or(missing_at, Spanned::span),
                "inventory.cuda_image is required on a GPU node: the drift rule compares it with the pinned image",
            ));
        }
        None => String::new(),
    };
    let cpu_count = match &r.cpu_count {
        None => None,
        Some(s) => {
            let n = *s.get_ref();
            Some(
                u32::try_from(n)
                    .ok()
                    .filter(|n| (1..=1_048_576).contains(n))
                    .ok_or_else(|| {
                        c.err(
                            s.span(),
                            format!("inventory.cpu_count must be between 1 and 1048576, not {n}"),
                        )
                    })?,
            )
        }
    };
    Ok(Inventory {
        zone,
        rack,
        role,
        gpu_node,
        cuda_image,
        cpu_count,
    })
}

/// `NODE_NAME` (set from `spec.nodeName` in the DaemonSet), else the host name.
fn default_node_name() -> Option<String> {
    let from_env = std::env::var("NODE_NAME").ok().filter(|n| valid_id(n));
    from_env.or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| valid_id(h))
    })
}
