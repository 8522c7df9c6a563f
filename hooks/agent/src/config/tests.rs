//! Tests of parsing, defaults and located errors on small configuration texts.

use std::path::Path;

use super::*;

const MINIMAL: &str = "[node]\nname = \"gpu-001\"\n[inventory]\nzone = \"z1\"\nrack = \"r1\"\n";

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse("agent.toml", text, Path::new("."))
}

fn located(text: &str) -> Located {
    match parse(text) {
        Err(ConfigError::Invalid(l)) => l,
        other => panic!("expected a located error, got {other:?}"),
    }
}

#[test]
fn a_minimal_file_takes_every_default() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.node, "gpu-001");
    assert_eq!(c.collect.interval, Duration::from_secs(15));
    assert_eq!(c.collect.stale_after, Duration::from_secs(60));
    assert_eq!(c.firewall.mode, FirewallMode::Check);
    assert!(!c.nvidia_smi.enabled, "not a GPU node");
    assert!(c.ipmi.enabled && c.rapl.enabled);
    assert_eq!(c.dcgm.url, None);
    assert!(!c.audit.enabled);
    assert_eq!(c.gpu_model("NVIDIA H100 80GB HBM3"), "H100");
    assert_eq!(c.gpu_model("NVIDIA L4"), "NVIDIA L4");
}

#[test]
fn the_documented_file_parses_and_states_the_defaults() {
    let text = include_str!("../../probity-agent.toml");
    let c = parse(text).unwrap();
    let d = parse(MINIMAL).unwrap();
    // The reference file shows the defaults: only what it must set differs.
    assert_eq!(c.collect, d.collect);
    assert_eq!(c.firewall, d.firewall);
    assert_eq!(c.alerts, d.alerts);
    assert_eq!(c.audit, d.audit);
    assert_eq!(c.gpu_models, d.gpu_models);
    assert_eq!(c.rapl, d.rapl);
    assert_eq!(c.ipmi, d.ipmi);
}

#[test]
fn a_bad_value_is_located_at_its_line_and_column() {
    let text = format!("{MINIMAL}[collect]\ninterval_seconds = 0\n");
    let l = located(&text);
    assert_eq!((l.line, l.column), (7, 20), "{l}");
    assert!(l.message.contains("between 1 and"), "{l}");
    assert!(l.to_string().starts_with("agent.toml:7:20: "), "{l}");
}

#[test]
fn unknown_keys_and_bad_enums_are_located() {
    let l = located(&format!("{MINIMAL}[firewall]\nmode = \"enforcing\"\n"));
    assert_eq!(l.line, 7, "{l}");
    let l = located(&format!("{MINIMAL}[collect]\nintervall_seconds = 3\n"));
    assert_eq!(l.line, 7, "{l}");
    assert!(l.message.contains("intervall_seconds"), "{l}");
}

#[test]
fn missing_inventory_is_an_error_not_a_default() {
    let l = located("[node]\nname = \"n\"\n[inventory]\nrack = \"r\"\n");
    assert!(l.message.contains("inventory.zone is required"), "{l}");
    let l = located(&format!("{MINIMAL}gpu_node = true\n"));
    assert!(l.message.contains("cuda_image"), "{l}");
    assert_eq!(l.line, 6);
}

#[test]
fn urls_and_addresses_are_checked_where_written() {
    let l = located(&format!(
        "{MINIMAL}[dcgm]\nurl = \"https://x:9400/metrics\"\n"
    ));
    assert_eq!((l.line, l.column), (7, 7), "{l}");
    let l = located(&format!(
        "{MINIMAL}[firewall]\ncontrol_plane = \"10.0.0.1\"\n"
    ));
    assert_eq!(l.line, 7);
    let c = parse(&format!(
        "{MINIMAL}[firewall]\ncontrol_plane = \"[fd00::1]:6443\"\n"
    ))
    .unwrap();
    assert_eq!(
        c.firewall.control_plane,
        Some("[fd00::1]:6443".parse().unwrap())
    );
}

#[test]
fn the_node_name_follows_the_engines_rule() {
    let l = located("[node]\nname = \"-bad\"\n[inventory]\nzone = \"z\"\nrack = \"r\"\n");
    assert_eq!((l.line, l.column), (2, 8), "{l}");
}

#[test]
fn an_inventory_file_replaces_the_inline_keys_and_its_errors_name_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("inv-n.toml"),
        "zone = \"z9\"\nrack = \"r9\"\nrole = \"gpu-worker\"\ngpu_node = true\ncuda_image = \"img\"\n",
    )
    .unwrap();
    let text = "[node]\nname = \"n\"\n[inventory]\nfile = \"inv-{node}.toml\"\n";
    std::fs::write(dir.path().join("agent.toml"), text).unwrap();
    let c = Config::from_file(&dir.path().join("agent.toml")).unwrap();
    assert_eq!(c.inventory.zone, "z9");
    assert_eq!(c.inventory.role.as_deref(), Some("gpu-worker"));
    assert!(
        c.nvidia_smi.enabled,
        "a GPU node reads nvidia-smi by default"
    );

    std::fs::write(dir.path().join("inv-n.toml"), "zone = \"z9\"\nrack = 7\n").unwrap();
    match Config::from_file(&dir.path().join("agent.toml")) {
        Err(ConfigError::Invalid(l)) => {
            assert!(l.file.ends_with("inv-n.toml"), "{l}");
            assert_eq!(l.line, 2, "{l}");
        }
        other => panic!("{other:?}"),
    }
    let both = "[node]\nname = \"n\"\n[inventory]\nfile = \"inv-{node}.toml\"\nzone = \"z\"\n";
    let l = located(both);
    assert_eq!(l.line, 5, "{l}");
}

#[test]
fn refresh_must_be_shorter_than_expiry() {
    let l = located(&format!("{MINIMAL}[alerts]\nrefresh_seconds = 300\n"));
    assert_eq!(l.line, 7);
}
