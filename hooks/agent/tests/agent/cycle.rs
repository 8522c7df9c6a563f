//! The agent's cycle end to end on a fake node: readings become facts, facts become
//! decisions, denies become findings with alerts in a real Alertmanager, and findings
//! clear (alert resolved, clearing recorded) when the facts do.

use std::collections::BTreeSet;
use std::time::Duration;

use probity_agent::CycleReport;
use serde_json::Value;

use crate::support::{
    ActiveNames, Alertmanager, FakeNode, NODE, agent, engine, eventually, fixture,
};

fn policies(list: &[probity_agent::Finding]) -> BTreeSet<String> {
    list.iter()
        .map(|f| match f.action.as_str() {
            "listen" => format!("{} {}", f.policy, f.subject),
            _ => f.policy.clone(),
        })
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn node_attr<'a>(r: &'a CycleReport, name: &str) -> &'a Value {
    &r.facts.entities[0]["attrs"][name]
}

#[test]
fn power_spike_heat_driver_drift_and_an_extra_port_alert_and_then_clear() {
    let node = FakeNode::new();
    let am_dir = tempfile::tempdir().unwrap();
    let mut am = Alertmanager::start(am_dir.path());
    let state = tempfile::tempdir().unwrap();
    let config = node.config(&format!("alertmanager_url = \"{}\"", am.url), "");
    let (engine, clock) = engine(Some(state.path()), false);
    let mut agent = agent(config, engine.clone());

    // The fixture's node: driver 570.133.20 (pinned: 590.48.01) and GPU 5 at 71 C (H100
    // target: 70); port 8080 listens and the firewall lets it in.
    node.set_listeners(&[
        ([0, 0, 0, 0], 22),
        ([0, 0, 0, 0], 8080),
        ([127, 0, 0, 1], 9400),
    ]);
    node.set_nft_open(&[22, 8080]);
    let r = agent.cycle();
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.facts.unreadable.is_empty(), "{:?}", r.facts.unreadable);
    assert_eq!(node_attr(&r, "hottestGpuTempC"), 71);
    assert_eq!(node_attr(&r, "gpuCount"), 8);
    assert_eq!(node_attr(&r, "gpuModel")["__entity"]["id"], "H100");
    assert_eq!(node_attr(&r, "driverVersion"), "570.133.20");
    assert_eq!(node_attr(&r, "powerDrawW"), 3000);
    assert_eq!(node_attr(&r, "powerWindowMeanW"), 0, "no window yet");
    assert_eq!(node_attr(&r, "cpuCount"), 2);
    assert!(node_attr(&r, "blocked").is_null(), "the blocklist owns it");
    assert_eq!(r.facts.entities.len(), 9, "the node and 8 GPUs");
    assert_eq!(r.facts.power.from, "bmc-dcmi");
    assert_eq!(
        policies(&r.raised),
        set(&[
            "placement.driver-drift",
            "security.inbound-port-beyond-baseline tcp/8080",
            "thermal.gpu-over-temperature",
        ])
    );
    // The loopback-only listener is not asked about; port 22 is, and is allowed.
    let listen: Vec<&str> = r
        .decisions
        .iter()
        .filter(|d| d.action == "listen")
        .map(|d| d.subject.as_str())
        .collect();
    assert!(
        listen.contains(&"tcp/22") && listen.contains(&"tcp/8080"),
        "{listen:?}"
    );
    assert!(!listen.iter().any(|s| s.contains("9400")), "{listen:?}");
    assert!(
        r.obligations.iter().all(|o| o.outcome == "alerted"),
        "{:?}",
        r.obligations
    );
    let want = [
        "placement.driver-drift",
        "security.inbound-port-beyond-baseline tcp/8080",
        "thermal.gpu-over-temperature",
    ];
    eventually(
        "three alerts in Alertmanager",
        Duration::from_secs(20),
        || (am.active_names() == want).then_some(()),
    );
    let over = am
        .alerts()
        .into_iter()
        .find(|a| a["labels"]["alertname"] == "thermal.gpu-over-temperature")
        .unwrap();
    assert_eq!(over["labels"]["node"], format!("Node::\"{NODE}\""));
    assert_eq!(over["labels"]["severity"], "high");
    assert_eq!(
        over["annotations"]["message"],
        "a GPU runs above its model's temperature target"
    );

    // Steady power builds the window; the same findings are not raised again.
    for _ in 0..3 {
        clock.advance(15);
        let r = agent.cycle();
        assert!(
            r.raised.is_empty() && r.cleared.is_empty(),
            "{:?}",
            r.raised
        );
    }
    // 4000 W is 33% over the 3000 W mean: a spike.
    clock.advance(15);
    node.set_dcmi_watts(4000);
    let r = agent.cycle();
    assert_eq!(node_attr(&r, "powerWindowMeanW"), 3000);
    assert_eq!(r.facts.power.readings_w, [3000, 3000, 3000, 3000, 4000]);
    assert_eq!(policies(&r.raised), set(&["thermal.power-spike"]));
    eventually("the spike alert", Duration::from_secs(20), || {
        am.active_names()
            .contains(&"thermal.power-spike".to_owned())
            .then_some(())
    });

    // Everything clears: pinned driver, cool GPUs, steady power, port 8080 closed.
    let csv = String::from_utf8(fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"))
        .unwrap()
        .replace("570.133.20", "590.48.01")
        .replace(", 71, ", ", 61, ");
    node.write("data/smi.csv", csv.as_bytes());
    node.dcgm.set_body(
        String::from_utf8(fixture("dcgm", "own-8gpu-mig-mixed-labels.prom"))
            .unwrap()
            .replace("} 71\n", "} 61\n")
            .into_bytes(),
    );
    node.set_dcmi_watts(3000);
    node.set_listeners(&[([0, 0, 0, 0], 22), ([127, 0, 0, 1], 9400)]);
    node.set_nft_open(&[22]);
    clock.advance(15);
    let r = agent.cycle();
    assert!(r.raised.is_empty(), "{:?}", r.raised);
    assert!(r.active.is_empty(), "{:?}", r.active);
    assert_eq!(
        policies(&r.cleared),
        set(&[
            "placement.driver-drift",
            "security.inbound-port-beyond-baseline tcp/8080",
            "thermal.gpu-over-temperature",
            "thermal.power-spike",
        ])
    );
    assert_eq!(
        r.obligations
            .iter()
            .filter(|o| o.outcome == "resolved")
            .count(),
        4
    );
    eventually("every alert resolved", Duration::from_secs(20), || {
        am.active_names().is_empty().then_some(())
    });

    // Each finding and its clearing is in the state store's event log, with its facts.
    let events = engine.log().unwrap().events(0).unwrap();
    let kinds: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e.kind.as_str(), e.object_id.as_str()))
        .collect();
    assert_eq!(kinds.iter().filter(|(k, _)| *k == "finding").count(), 4);
    assert_eq!(
        kinds
            .iter()
            .filter(|(k, _)| *k == "finding-cleared")
            .count(),
        4
    );
    let heat = events
        .iter()
        .find(|e| e.kind == "finding" && e.object_id.ends_with("thermal.gpu-over-temperature"))
        .unwrap();
    assert_eq!(heat.node.as_deref(), Some(NODE));
    let detail: Value = serde_json::from_str(&heat.detail).unwrap();
    assert_eq!(detail["facts"]["node"]["attrs"]["hottestGpuTempC"], 71);
    assert_eq!(detail["carried_out"][0]["outcome"], "alerted");
    let port = events
        .iter()
        .find(|e| e.kind == "finding-cleared" && e.object_id.contains("tcp/8080"))
        .unwrap();
    let detail: Value = serde_json::from_str(&port.detail).unwrap();
    assert_eq!(detail["facts"]["listening"][0], "0.0.0.0");
    assert!(detail["cleared_at"].as_u64().is_some());
}

#[test]
fn missing_and_failing_sources_are_unreadable_never_zero() {
    let node = FakeNode::new();
    let webhook = crate::support::HttpStub::start(Vec::new());
    let config = node.config(&format!("webhook_url = \"{}/hook\"", webhook.url), "");
    let (engine, clock) = engine(None, false);
    // No nvidia-smi at all, and a node without a BMC.
    std::fs::remove_file(node.path("bin/nvidia-smi")).unwrap();
    node.tool_fails(
        "ipmitool",
        "Could not open device at /dev/ipmi0 or /dev/ipmi/0 or /dev/ipmidev/0: No such file or directory",
    );
    let mut agent = agent(config, engine.clone());
    let r = agent.cycle();
    let unreadable: Vec<&String> = r.facts.unreadable.keys().collect();
    assert_eq!(
        unreadable,
        ["ipmi", "nvidia-smi"],
        "{:?}",
        r.facts.unreadable
    );
    assert!(r.facts.unreadable["nvidia-smi"].contains("is not installed"));
    assert!(r.facts.unreadable["ipmi"].contains("has no device"));
    assert_eq!(
        node_attr(&r, "unreadable"),
        &serde_json::json!(["ipmi", "nvidia-smi"])
    );
    // The GPUs stand in from DCGM; the power is the packages plus the GPUs.
    assert_eq!(r.facts.gpus[0].source, "dcgm");
    assert_eq!(r.facts.power.from, "rapl+gpus");
    let raised = policies(&r.raised);
    assert!(
        raised.contains("thermal.telemetry-unreadable"),
        "{raised:?}"
    );
    let f = r
        .raised
        .iter()
        .find(|f| f.policy == "thermal.telemetry-unreadable")
        .unwrap();
    assert!(
        f.message.contains("ipmi") && f.message.contains("nvidia-smi"),
        "{}",
        f.message
    );
    eventually(
        "the unreadable alert at the webhook",
        Duration::from_secs(20),
        || {
            webhook
                .posted()
                .iter()
                .any(|a| a["labels"]["alertname"] == "thermal.telemetry-unreadable")
                .then_some(())
        },
    );

    // nvidia-smi comes back; then prints garbage: its reading stays until it is stale.
    node.tool_prints("nvidia-smi");
    node.tool_prints("ipmitool");
    clock.advance(15);
    let r = agent.cycle();
    assert!(r.facts.unreadable.is_empty(), "{:?}", r.facts.unreadable);
    assert!(policies(&r.cleared).contains("thermal.telemetry-unreadable"));
    node.write(
        "data/smi.csv",
        &fixture("nvidia-smi", "own-bad-non-numeric.query-gpu.csv"),
    );
    clock.advance(15);
    let r = agent.cycle();
    assert!(
        r.facts.unreadable.is_empty(),
        "fresh for 60 s: {:?}",
        r.facts.unreadable
    );
    let smi = &r.facts.sources["nvidia-smi"];
    match &smi.last {
        probity_agent::sources::Outcome::Error { error, .. } => {
            assert!(
                error.contains("line 3, column 2 (temperature.gpu)"),
                "{error}"
            );
        }
        other => panic!("{other:?}"),
    }
    clock.advance(60);
    let r = agent.cycle();
    assert!(
        r.facts.unreadable["nvidia-smi"].contains("75s old"),
        "{:?}",
        r.facts.unreadable
    );
    assert!(policies(&r.raised).contains("thermal.telemetry-unreadable"));
    // The last good reading still stands for its facts, and is not a zero.
    assert_eq!(node_attr(&r, "gpuCount"), 8);
    assert_eq!(node_attr(&r, "hottestGpuTempC"), 71);

    // A GPU that prints a placeholder is no entity, and its source is unreadable.
    let csv = String::from_utf8(fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"))
        .unwrap()
        .replace(", 71, ", ", [GPU is lost], ");
    node.write("data/smi.csv", csv.as_bytes());
    clock.advance(15);
    let r = agent.cycle();
    assert_eq!(r.facts.entities.len(), 8, "the node and 7 complete GPUs");
    assert!(
        r.facts.unreadable["nvidia-smi"].contains("gpu 5: temperature.gpu: [GPU is lost]"),
        "{:?}",
        r.facts.unreadable
    );
    let gpu5 = probity::EntityUid::new("Gpu", &format!("{NODE}/5")).unwrap();
    assert!(engine.entity(&gpu5).is_none(), "removed from the store");
}

#[test]
fn without_a_bmc_or_rapl_the_power_is_unknown_not_zero() {
    let node = FakeNode::new();
    let mut config = node.config("", "");
    config.rapl.enabled = false;
    config.ipmi.enabled = false;
    let (engine, _clock) = engine(None, false);
    let mut agent = agent(config, engine);
    let r = agent.cycle();
    assert_eq!(r.facts.power.draw_w, None);
    assert!(
        r.facts.unreadable.contains_key("power"),
        "{:?}",
        r.facts.unreadable
    );
    assert!(policies(&r.raised).contains("thermal.telemetry-unreadable"));
}

#[test]
fn a_block_node_obligation_blocks_through_the_engine() {
    blocks_through_the_engine("block_node");
}

/// The agent blocks on the kind the schema's conventions name, not on a name of its own.
#[test]
fn a_block_obligation_the_schema_renames_blocks_too() {
    blocks_through_the_engine("quarantine");
}

/// A policy directory whose comply rule carries `kind`, the schema's block obligation,
/// on a node with unreadable telemetry: the agent blocks the node.
fn blocks_through_the_engine(kind: &str) {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies");
    copy_dir(&root, dir.path());
    let schema = dir.path().join("probity.cedarschema");
    let text = std::fs::read_to_string(&schema).unwrap().replace(
        "@obligations(\"alert block_node burst_to_cloud migrate rotate_key\")\n@block_obligation(\"block_node\")",
        &format!("@obligations(\"alert block_node burst_to_cloud migrate rotate_key {kind}\")\n@block_obligation(\"{kind}\")"),
    );
    assert!(text.contains(&format!("@block_obligation(\"{kind}\")")));
    std::fs::write(&schema, text).unwrap();
    let thermal = dir.path().join("thermal/thermal.cedar");
    let text = std::fs::read_to_string(&thermal).unwrap().replace(
        "@id(\"thermal.telemetry-unreadable\")\n@severity(\"high\")\n@message(\"node {resource} has telemetry that could not be read or is stale: {resource.unreadable}\")\n@obligation(\"alert\")",
        &format!("@id(\"thermal.telemetry-unreadable\")\n@severity(\"high\")\n@message(\"node {{resource}} has telemetry that could not be read or is stale: {{resource.unreadable}}\")\n@obligation(\"{kind}\")"),
    );
    assert!(text.contains(&format!("@obligation(\"{kind}\")")));
    std::fs::write(&thermal, text).unwrap();
    let node = FakeNode::new();
    node.tool_fails("ipmitool", "Could not open device at /dev/ipmi0");
    let config = node.config("", "");
    let engine = probity::Engine::builder(dir.path()).build().unwrap();
    engine
        .upsert_entities(&crate::support::cluster_entities(false))
        .unwrap();
    let mut agent = agent(config, engine.clone());
    let r = agent.cycle();
    let blocked = r.obligations.iter().find(|o| o.kind == kind).unwrap();
    assert_eq!(blocked.outcome, format!("blocked node {NODE}"));
    let blocks = engine.blocked_nodes();
    assert_eq!(blocks[NODE].reason, "thermal.telemetry-unreadable");
}

/// The default policy directory in a temporary one, with `schema` applied to its
/// schema text.
fn policy_dir(schema: impl Fn(String) -> String) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies");
    copy_dir(&root, dir.path());
    let path = dir.path().join("probity.cedarschema");
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = schema(text.clone());
    assert_ne!(edited, text, "the edit applies");
    std::fs::write(&path, edited).unwrap();
    dir
}

/// A port set of the role's RDMA ports, read from probity.toml and named `:protocol`.
fn with_rdma_ports(protocol: &str) -> impl Fn(String) -> String {
    let protocol = protocol.to_owned();
    move |text| {
        text.replace(
            "  restricted: Set<String>,\n",
            "  restricted: Set<String>,\n  @toml(\"roles.{id}.rdma\") @convert(\"ports\") @default(\"[]\")\n  rdmaPorts: Set<Long>,\n",
        )
        .replace(
            "Settings.inboundUdpPortBaseline:udp\")",
            &format!("Settings.inboundUdpPortBaseline:udp NodeRole.rdmaPorts:{protocol}\")"),
        )
    }
}

/// A port set the schema adds is cut at like the others: RoCE's UDP 4791 on a role.
#[test]
fn a_port_set_the_schema_declares_is_honoured() {
    use probity_agent::listen::PortSets;
    use probity_firewall::Protocol;
    let dir = policy_dir(with_rdma_ports("udp"));
    let toml = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&toml)
        .unwrap()
        .replace("udp = [8472]\n", "udp = [8472]\nrdma = [4791]\n");
    std::fs::write(&toml, text).unwrap();
    let engine = probity::Engine::builder(dir.path()).build().unwrap();
    let defaults = probity::Engine::defaults().build().unwrap();
    let mut want = PortSets::from_engine(&defaults);
    assert_ne!(PortSets::from_engine(&engine), want);
    want.add(Protocol::Udp, &serde_json::json!([4791]));
    assert_eq!(PortSets::from_engine(&engine), want);
}

#[test]
fn a_port_set_of_an_unknown_protocol_does_not_load() {
    let dir = policy_dir(with_rdma_ports("roce"));
    let Err(err) = probity::Engine::builder(dir.path()).build() else {
        panic!("a port set of protocol roce loaded");
    };
    let text = err.detail();
    assert!(
        text.contains(
            r#"@port_sets: "NodeRole.rdmaPorts:roce": unknown protocol "roce" (known: tcp, udp)"#
        ),
        "{text}"
    );
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The agent alerts on the kind the schema's conventions name (`@alert_obligation`),
/// and a kind it does not name is only recorded.
#[test]
fn an_alert_obligation_the_schema_renames_alerts() {
    let dir = policy_dir(|text| {
        text.replace(
            "@obligations(\"alert block_node burst_to_cloud migrate rotate_key\")",
            "@obligations(\"alert block_node burst_to_cloud migrate rotate_key page\")",
        )
        .replace(
            "@alert_obligation(\"alert\")",
            "@alert_obligation(\"page\")",
        )
    });
    let thermal = dir.path().join("thermal/thermal.cedar");
    let text = std::fs::read_to_string(&thermal).unwrap().replace(
        "@message(\"node {resource} has telemetry that could not be read or is stale: {resource.unreadable}\")\n@obligation(\"alert\")",
        "@message(\"node {resource} has telemetry that could not be read or is stale: {resource.unreadable}\")\n@obligation(\"page\")",
    );
    assert!(text.contains("@obligation(\"page\")"));
    std::fs::write(&thermal, text).unwrap();
    let node = FakeNode::new();
    node.tool_fails("ipmitool", "Could not open device at /dev/ipmi0");
    let engine = probity::Engine::builder(dir.path()).build().unwrap();
    assert_eq!(engine.conventions().alert_obligation(), Some("page"));
    engine
        .upsert_entities(&crate::support::cluster_entities(false))
        .unwrap();
    let mut agent = agent(node.config("", ""), engine);
    let r = agent.cycle();
    let page = r.obligations.iter().find(|o| o.kind == "page").unwrap();
    assert_eq!(page.outcome, "no alert sink configured: recorded only");
    // `alert` is an ordinary kind here: the agent does not alert on it.
    for o in r.obligations.iter().filter(|o| o.kind == "alert") {
        assert_eq!(o.outcome, "alert: not carried out by the node agent");
    }
}

/// A role's firewall baseline is read from the attributes the schema names
/// (`@baseline_ports`, `@baseline_restrictions`), not from names of the agent's.
#[test]
fn a_baseline_the_schema_renames_is_followed() {
    use probity_agent::baseline::role_baseline;
    let rdma = with_rdma_ports("udp");
    let dir = policy_dir(|text| {
        // The RDMA set instead of udpPorts, in an order `rdma` does not edit.
        let text = text.replace(
            "@baseline_ports(\"NodeRole.tcpPorts:tcp NodeRole.udpPorts:udp Settings.inboundPortBaseline:tcp Settings.inboundUdpPortBaseline:udp\")",
            "@baseline_ports(\"NodeRole.rdmaPorts:udp NodeRole.tcpPorts:tcp Settings.inboundUdpPortBaseline:udp Settings.inboundPortBaseline:tcp\")",
        );
        assert!(text.contains("NodeRole.rdmaPorts:udp NodeRole.tcpPorts:tcp"));
        rdma(text)
            .replace(
                "  restricted: Set<String>,",
                "  reachableFrom: Set<String>,",
            )
            .replace(
                "@baseline_restrictions(\"NodeRole.restricted\")",
                "@baseline_restrictions(\"NodeRole.reachableFrom\")",
            )
    });
    let toml = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&toml)
        .unwrap()
        .replace("udp = [8472]\n", "udp = [8472]\nrdma = [4791]\n");
    std::fs::write(&toml, text).unwrap();
    let engine = probity::Engine::builder(dir.path()).build().unwrap();
    let b = role_baseline(&engine, Some("gpu-worker")).unwrap();
    let t = probity_firewall::baseline::render(&b).unwrap();
    let t = t.text();
    // The RDMA set is the role's UDP baseline now; udpPorts is not.
    assert!(t.contains("udp dport 4791 accept"), "{t}");
    assert!(!t.contains("udp dport 8472 accept"), "{t}");
    // The renamed restriction still limits the kubelet's port.
    assert!(
        t.contains("ip saddr 10.0.0.0/8 tcp dport 10250 accept"),
        "{t}"
    );
    assert!(!t.contains("\ttcp dport 10250 accept"), "restricted: {t}");
}

/// The zone `z1` of [`crate::support::cluster_entities`] drawing `watts` of its 100 kW.
fn zone_drawing(watts: u64) -> Value {
    serde_json::json!([{"uid": {"type": "Zone", "id": "z1"},
        "parents": [{"type": "Cluster", "id": "onprem"}],
        "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                  "powerDrawW": watts, "powerCeilingW": 100_000}}])
}

/// `migrate` targets a zone, which the agent cannot act on: it asks the controller
/// through shared state, again every cycle the zone stays hot, and withdraws the
/// request once the zone cools.
#[test]
fn a_zone_at_its_ceiling_asks_the_controller_to_migrate_until_it_cools() {
    let state = tempfile::tempdir().unwrap();
    let (engine, clock) = crate::support::engine(Some(state.path()), false);
    engine.upsert_entities(&zone_drawing(100_000)).unwrap();
    let node = FakeNode::new();
    let mut agent = agent(node.config("", ""), engine.clone());
    let r = agent.cycle();
    let asked = r.obligations.iter().find(|o| o.kind == "migrate").unwrap();
    assert_eq!(
        asked.outcome,
        "asked the controller to migrate out of Zone z1"
    );
    let shared = engine.state().unwrap().clone();
    let requests = shared.action_requests().unwrap();
    assert_eq!(requests.len(), 1, "{requests:?}");
    let request = &requests[0];
    assert_eq!(
        (request.target.as_str(), request.node.as_str()),
        ("z1", NODE)
    );
    assert_eq!(request.policy, "thermal.zone-power-ceiling");
    assert_eq!(request.ttl_seconds, 60);
    assert_eq!(request.parameters["pods_per_window"], "2");
    assert_eq!(
        request.parameters["order_annotation"],
        "probity.io/migrate-priority"
    );
    let first = request.at;

    // Still hot: published again, so it outlives its TTL only while the agent runs.
    clock.advance(30);
    agent.cycle();
    let requests = shared.action_requests().unwrap();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert_eq!(requests[0].at, first + 30);

    engine.upsert_entities(&zone_drawing(20_000)).unwrap();
    clock.advance(15);
    let r = agent.cycle();
    let withdrawn = r.obligations.iter().find(|o| o.kind == "migrate").unwrap();
    assert_eq!(withdrawn.outcome, "withdrawn");
    assert!(shared.action_requests().unwrap().is_empty());
}

/// The same hot zone under the ceiling rule in audit mode: the controller is asked only
/// for a dry run and nothing is alerted, and the decision log keeps what would have been.
#[test]
fn a_zone_at_its_ceiling_under_an_audit_rule_asks_only_a_dry_run_and_is_recorded() {
    let policies = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies");
    let copied = std::process::Command::new("cp")
        .arg("-r")
        .arg(root.join("."))
        .arg(policies.path())
        .status()
        .unwrap();
    assert!(copied.success());
    let config = policies.path().join("probity.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[modes]\n\"thermal.zone-power-ceiling\" = \"audit\"\n");
    std::fs::write(&config, text).unwrap();
    let state = tempfile::tempdir().unwrap();
    let clock = std::sync::Arc::new(probity::ManualClock::at(crate::support::T0));
    let engine = probity::Engine::builder(policies.path())
        .clock(std::sync::Arc::clone(&clock) as std::sync::Arc<dyn probity::Clock>)
        .build()
        .unwrap();
    let store = std::sync::Arc::new(probity::state::StateStore::open(state.path()).unwrap());
    engine.attach_state(store.clone()).unwrap();
    engine
        .upsert_entities(&crate::support::cluster_entities(false))
        .unwrap();
    engine.upsert_entities(&zone_drawing(100_000)).unwrap();
    let node = FakeNode::new();
    let mut agent = agent(node.config("", ""), engine.clone());
    let r = agent.cycle();
    assert!(
        r.obligations.iter().all(|o| o.kind != "migrate"),
        "{:?}",
        r.obligations
    );
    // Asked only as a dry run: the controller reports what it would move.
    let requests = engine.state().unwrap().action_requests().unwrap();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert!(requests[0].dry_run, "{requests:?}");
    assert_eq!(requests[0].target, "z1");
    let recorded = probity::state::LocalLog::decisions(store.as_ref(), 0, 1000).unwrap();
    let audited = recorded
        .iter()
        .flat_map(|r| &r.decision.audit)
        .find(|n| n.policy == "thermal.zone-power-ceiling")
        .unwrap_or_else(|| panic!("no audit finding recorded: {recorded:?}"));
    assert_eq!(audited.obligations[0].kind, "migrate");
    assert_eq!(
        audited.obligations[0].target.as_deref(),
        Some("Zone::\"z1\"")
    );
}
