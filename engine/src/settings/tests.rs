use super::*;
use serde_json::json;

const SCHEMA: &str = include_str!("../../../policies/probity.cedarschema");
const DEFAULT: &str = include_str!("../../../policies/probity.toml");

fn schema_of(text: &str) -> Result<SettingsSchema, Vec<SourceDiagnostic>> {
    SettingsSchema::from_cedarschema("probity.cedarschema", &Arc::from(text))
}

fn parse(text: &str) -> Result<Settings, Box<SourceDiagnostic>> {
    schema_of(SCHEMA)
        .unwrap()
        .read("probity.toml", &Arc::from(text))
}

fn line_of(text: &str, starts: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().starts_with(starts))
        .unwrap()
        + 1
}

#[test]
fn the_default_configuration_becomes_the_settings_entities() {
    let s = parse(DEFAULT).unwrap();
    let attr = |a: &str| s.attr("Settings", "active", a).cloned().unwrap();
    assert_eq!(attr("inboundPortBaseline"), json!([22, 2379, 2380]));
    assert_eq!(attr("inboundUdpPortBaseline"), json!([]));
    assert_eq!(attr("keyMaxAgeSeconds"), json!(90 * 86_400));
    assert_eq!(attr("elevationWindowSeconds"), json!(300));
    assert_eq!(attr("inferenceCpuMillisPerGpu"), json!(8000));
    assert_eq!(
        attr("inferenceNamespace"),
        json!({"__entity": {"type": "Namespace", "id": "inference"}})
    );
    assert_eq!(attr("preferHeadroomC"), json!(10));
    assert_eq!(s.attr("GpuModel", "A100", "tempTargetC"), Some(&json!(65)));
    let tcp = s.attr("NodeRole", "gpu-worker", "tcpPorts").unwrap();
    let tcp = tcp.as_array().unwrap();
    assert!(tcp.contains(&json!(10250)) && tcp.contains(&json!(32767)));
    assert_eq!(tcp.len(), 3 + 2768);
    assert_eq!(
        s.attr("NodeRole", "gpu-worker", "restricted"),
        Some(&json!(["tcp/10250 10.0.0.0/8"]))
    );
    assert_eq!(
        s.attr("NodeRole", "control-plane", "udpPorts"),
        Some(&json!([]))
    );
}

#[test]
fn a_negative_threshold_is_refused_at_its_value() {
    let text = DEFAULT.replace("key_max_age_days = 90", "key_max_age_days = -5");
    let err = parse(&text).unwrap_err();
    assert_eq!(
        err.message,
        "security.key_max_age_days must be between 1 and 36500, found -5 (0 would refuse every key)"
    );
    assert_eq!(
        (err.line, err.column),
        (line_of(&text, "key_max_age_days"), 20)
    );
}

#[test]
fn an_unknown_key_and_bad_syntax_are_located() {
    let text = DEFAULT.replace("[thermal]", "[thermal]\nfan_speed = 3");
    let err = parse(&text).unwrap_err();
    assert!(
        err.message.starts_with("unknown setting thermal.fan_speed"),
        "{err}"
    );
    assert_eq!((err.line, err.column), (line_of(&text, "fan_speed"), 1));
    let err = parse(&DEFAULT.replace("[roles.gpu-worker]\n", "[roles.gpu-worker]\ntccp = [1]\n"))
        .unwrap_err();
    assert!(
        err.message
            .starts_with("unknown setting roles.gpu-worker.tccp"),
        "{err}"
    );
    let err = parse("[security\n").unwrap_err();
    assert_eq!(err.line, 1);
}

#[test]
fn a_value_of_the_wrong_shape_names_what_was_expected() {
    for (from, to, message) in [
        (
            "key_max_age_days = 90",
            "key_max_age_days = \"90\"",
            "security.key_max_age_days: expected an integer, found a string",
        ),
        (
            "pinned_driver = \"590.48.01\"",
            "pinned_driver = 590",
            "placement.pinned_driver: expected a string, found an integer",
        ),
        (
            "pinned_driver = \"590.48.01\"",
            "pinned_driver = \" \"",
            "placement.pinned_driver must not be empty",
        ),
        (
            "inference_namespaces = [\"inference-*\"]",
            "inference_namespaces = [\"a\", 3]",
            "placement.inference_namespaces: expected a string, found an integer",
        ),
        (
            "A100 = 65",
            "A100 = 65.5",
            "thermal.gpu_temp_target_c.A100: expected an integer, found a float",
        ),
    ] {
        assert!(DEFAULT.contains(from), "{from}");
        let text = DEFAULT.replace(from, to);
        let err = parse(&text).unwrap_err();
        assert_eq!(err.message, message, "{to}");
        assert_eq!(err.line, line_of(&text, to), "{to}");
    }
}

#[test]
fn a_missing_setting_without_a_default_is_named() {
    let text = DEFAULT.replace("key_max_age_days = 90\n", "");
    let err = parse(&text).unwrap_err();
    assert_eq!(
        err.message,
        "missing setting security.key_max_age_days (the schema's Settings.keyMaxAgeSeconds)"
    );
    assert_eq!(err.line, line_of(&text, "[security]"));
}

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
        ("A100 = 65", "A100 = 150"),
    ] {
        assert!(DEFAULT.contains(from), "{from}");
        let text = DEFAULT.replace(from, to);
        let err = parse(&text).unwrap_err();
        let name = to.split(' ').next().unwrap();
        assert!(
            err.message.contains(&format!("{name} must be between")),
            "{to}: {err}"
        );
        let line = line_of(&text, to);
        assert_eq!(
            (err.line, err.column),
            (line, to.len() - to.rsplit(' ').next().unwrap().len() + 1),
            "{to}"
        );
    }
}

#[test]
fn a_bad_port_range_or_prefix_is_located() {
    for (from, to, what) in [
        (
            "tcp = [22, 10250, 179, \"30000-32767\"]",
            "tcp = [22, \"9-1\"]",
            "roles.gpu-worker.tcp: expected a port (1-65535) or a range \"FROM-TO\", found \"9-1\"",
        ),
        (
            "tcp = [22, 10250, 179, \"30000-32767\"]",
            "tcp = [22, 70000]",
            "roles.gpu-worker.tcp: expected a port (1-65535) or a range \"FROM-TO\", found 70000",
        ),
        (
            "\"tcp/10250\" = [\"10.0.0.0/8\"]",
            "\"tcp/10250\" = [\"10.0.0.0/33\"]",
            "roles.gpu-worker.from.tcp/10250: \"10.0.0.0/33\" is not an address prefix (10.0.0.0/8, fd00::/8)",
        ),
        (
            "\"tcp/10250\" = [\"10.0.0.0/8\"]",
            "\"sctp/1\" = [\"10.0.0.0/8\"]",
            "roles.gpu-worker.from: \"sctp/1\" is not \"tcp/PORT\" or \"udp/PORT\"",
        ),
        (
            "inbound_port_baseline = [22, 2379, 2380]",
            "inbound_port_baseline = [22, 0]",
            "security.inbound_port_baseline: expected a port (1-65535) or a range \"FROM-TO\", found 0",
        ),
    ] {
        assert!(DEFAULT.contains(from), "{from}");
        let text = DEFAULT.replace(from, to);
        let err = parse(&text).unwrap_err();
        assert_eq!(err.message, what, "{to}");
        assert_eq!(err.line, line_of(&text, to), "{to}");
    }
}

#[test]
fn workload_classes_hold_the_rlhf_class() {
    let text = DEFAULT.replace(
        "workload_classes = [\"inference\", \"training\", \"rlhf\", \"batch\"]",
        "workload_classes = [\"inference\", \"training\"]",
    );
    let err = parse(&text).unwrap_err();
    assert_eq!(
        err.message,
        "placement.workload_classes must include placement.rlhf_class (\"rlhf\")"
    );
    assert_eq!(err.line, line_of(&text, "workload_classes"));
    // Left out, the default list gets the configured class added.
    let text = DEFAULT
        .replace(
            "workload_classes = [\"inference\", \"training\", \"rlhf\", \"batch\"]\n",
            "",
        )
        .replace("rlhf_class = \"rlhf\"", "rlhf_class = \"rl\"");
    let s = parse(&text).unwrap();
    assert_eq!(
        s.attr("Settings", "active", "workloadClasses"),
        Some(&json!(["inference", "training", "batch", "rl"]))
    );
}

#[test]
fn a_threshold_added_to_the_schema_is_read_with_no_code() {
    let schema = SCHEMA.replace(
        "  zonePowerCeilingPct: Long,\n",
        "  zonePowerCeilingPct: Long,\n  @toml(\"placement.zone_max_gpus\") @min(\"1\") @max(\"100000\")\n  zoneMaxGpus: Long,\n",
    );
    let settings = schema_of(&schema).unwrap();
    let text = DEFAULT.replace("[thermal]", "zone_max_gpus = 64\n\n[thermal]");
    let s = settings
        .read("probity.toml", &Arc::from(text.as_str()))
        .unwrap();
    assert_eq!(
        s.attr("Settings", "active", "zoneMaxGpus"),
        Some(&json!(64))
    );
    let err = settings
        .read("probity.toml", &Arc::from(DEFAULT))
        .unwrap_err();
    assert!(
        err.message
            .starts_with("missing setting placement.zone_max_gpus"),
        "{err}"
    );
    let listed = settings.settings();
    let info = listed
        .iter()
        .find(|i| i.key == "placement.zone_max_gpus")
        .unwrap();
    assert_eq!(info.attribute, "Settings.zoneMaxGpus");
    assert_eq!(
        (info.min, info.max, info.required),
        (Some(1), Some(100_000), true)
    );
    assert!(listed.iter().any(
        |i| i.key == "thermal.gpu_temp_target_c.{id}" && i.attribute == "GpuModel.tempTargetC"
    ));
}

#[test]
fn a_bad_settings_annotation_is_located_in_the_schema() {
    for (from, to, message) in [
        (
            "@scale(\"86400\")",
            "@scale(\"a day\")",
            "entity Settings, attribute keyMaxAgeSeconds: @scale(\"a day\") is not an integer",
        ),
        (
            "@toml(\"roles.{id}.tcp\") @convert(\"ports\")",
            "@toml(\"roles.{id}.tcp\") @convert(\"portz\")",
            "entity NodeRole, attribute tcpPorts: @convert(\"portz\") is not a conversion (ports, port_sources)",
        ),
        (
            "@toml(\"placement.pinned_driver\")\n",
            "",
            "entity Settings, attribute pinnedDriver: a required attribute of a configuration type needs @toml(\"key\") to say where probity.toml sets it",
        ),
        (
            "@owned(\"config\")\n@id(\"active\")\n",
            "@owned(\"config\")\n",
            "entity Settings: a configuration type needs @id(\"...\") (its one entity's id) or {id} in its @toml keys",
        ),
        (
            "@toml(\"roles.{id}.udp\")",
            "@toml(\"role.{id}.udp\")",
            "entity NodeRole, attribute udpPorts: @toml(\"role.{id}.udp\") puts the ids under role, another attribute under roles",
        ),
        (
            "@default(\"10\")",
            "@default(\"0\")",
            "entity Settings, attribute preferHeadroomC: @default(\"0\"): @default must be between 1 and 100, found 0 (0 would prefer a node at its target)",
        ),
    ] {
        assert!(SCHEMA.contains(from), "{from}");
        let schema = SCHEMA.replacen(from, to, 1);
        let problems = schema_of(&schema).unwrap_err();
        assert_eq!(problems.len(), 1, "{to}: {problems:?}");
        assert_eq!(problems[0].message, message, "{to}");
        assert!(problems[0].line > 1, "{to}: {:?}", problems[0]);
    }
}

#[test]
fn any_text_gives_settings_or_a_located_error() {
    let settings = schema_of(SCHEMA).unwrap();
    let bytes = DEFAULT.as_bytes();
    let mut seed = 0x9e37_79b9_u64;
    for _ in 0..3000 {
        let mut v = bytes.to_vec();
        for _ in 0..3 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let at = (seed as usize) % v.len();
            v[at] = (seed >> 32) as u8;
        }
        let Ok(text) = std::str::from_utf8(&v) else {
            continue;
        };
        if let Err(e) = settings.read("probity.toml", &Arc::from(text)) {
            assert!(e.line >= 1 && e.column >= 1);
        }
    }
}

/// The block taint's effect: NoSchedule or NoExecute only (a typo would taint nothing
/// and exempt no pod), with its default when the key is absent.
#[test]
fn a_string_outside_its_one_of_list_is_refused_where_it_stands() {
    let s = parse(DEFAULT).unwrap();
    let attr = |s: &Settings, a: &str| s.attr("Settings", "active", a).cloned().unwrap();
    assert_eq!(attr(&s, "blockTaintKey"), json!("probity.io/blocked"));
    assert_eq!(attr(&s, "blockTaintEffect"), json!("NoSchedule"));
    let absent = DEFAULT.replace("block_taint_effect = \"NoSchedule\"\n", "");
    assert_ne!(absent, DEFAULT);
    assert_eq!(
        attr(&parse(&absent).unwrap(), "blockTaintEffect"),
        json!("NoSchedule")
    );
    let text = DEFAULT.replace(
        "block_taint_effect = \"NoSchedule\"",
        "block_taint_effect = \"PreferNoSchedule\"",
    );
    let err = parse(&text).unwrap_err();
    assert_eq!(
        err.message,
        "kubernetes.block_taint_effect must be one of NoSchedule, NoExecute, found \"PreferNoSchedule\" (a PreferNoSchedule taint would not keep Kubernetes from placing any pod there)"
    );
    assert_eq!(err.line, line_of(&text, "block_taint_effect"));
    let text = DEFAULT.replace(
        "block_taint_effect = \"NoSchedule\"",
        "block_taint_effect = \"NoExecute\"",
    );
    assert_eq!(
        attr(&parse(&text).unwrap(), "blockTaintEffect"),
        json!("NoExecute")
    );
    // @oneOf on a number is a schema problem, named.
    let bad = SCHEMA.replace(
        "  @toml(\"placement.prefer_headroom_c\")",
        "  @oneOf(\"1 2\") @toml(\"placement.prefer_headroom_c\")",
    );
    assert_ne!(bad, SCHEMA);
    let problems = schema_of(&bad).unwrap_err();
    assert!(
        problems.iter().any(|p| p
            .message
            .contains("@oneOf needs a String or Set<String> read as it stands")),
        "{problems:?}"
    );
}
