//! The conventions' unit tests: schemas read, names refused where they stand.
use super::*;
use std::sync::Arc;

fn read(text: &str) -> Result<Conventions, Vec<SourceDiagnostic>> {
    let (fragment, _) = cedar_policy::SchemaFragment::from_cedarschema_str(text).unwrap();
    let json = fragment.to_json_value().unwrap();
    Conventions::read(
        &json,
        &SourceFile::inline("s.cedarschema", &Arc::from(text)),
    )
}

#[test]
fn the_default_schema_declares_the_defaults() {
    let c = read(include_str!("../../../policies/probity.cedarschema")).unwrap();
    let port_sets: Vec<PortSet> = [
        ("NodeRole", "tcpPorts", PortProtocol::Tcp),
        ("NodeRole", "udpPorts", PortProtocol::Udp),
        ("Settings", "inboundPortBaseline", PortProtocol::Tcp),
        ("Settings", "inboundUdpPortBaseline", PortProtocol::Udp),
    ]
    .map(|(t, a, protocol)| PortSet {
        entity_type: t.into(),
        attribute: a.into(),
        protocol,
    })
    .into();
    let defaults = Conventions {
        verified_read: Some(VerifiedRead {
            action: "read".into(),
            reader: "Node".into(),
            object: "Checkpoint".into(),
            reader_pod: true,
        }),
        block_policy: Some("security.blocked-node".into()),
        baseline_ports: port_sets.clone(),
        port_sets,
        baseline_restrictions: vec![Restrictions {
            entity_type: "NodeRole".into(),
            attribute: "restricted".into(),
        }],
        ..Conventions::default()
    };
    assert_eq!(c, defaults);
    // The declaration only states the defaults: without it the same is read.
    let bare: String = include_str!("../../../policies/probity.cedarschema")
        .lines()
        .filter(|l| {
            ![
                "@port_sets",
                "@baseline_ports",
                "@baseline_restrictions",
                "@alert_obligation",
                "@schedule_action",
                "@placement_group",
            ]
            .iter()
            .any(|a| l.starts_with(a))
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(read(&bare).unwrap(), c);
}

const ROLES: &str = r#"
    entity Zone; entity Room;
    entity NodeRole = { tcpPorts: Set<Long>, udpPorts: Set<Long>, gpuDirectPorts: Set<Long>, name: String, limited: Set<String> };
    entity Node = { zone: Zone, room: Room, rack: String };
    entity Workload;
    action place appliesTo { principal: Workload, resource: Node, context: {} };
"#;

#[test]
fn a_declared_port_set_is_honoured() {
    let c = read(&format!(
        r#"{ROLES} @conventions @port_sets("NodeRole.tcpPorts:tcp NodeRole.gpuDirectPorts:udp") entity C;"#
    ))
    .unwrap();
    let sets: Vec<(&str, &str, &str)> = c
        .port_sets()
        .iter()
        .map(|s| (&*s.entity_type, &*s.attribute, s.protocol.name()))
        .collect();
    assert_eq!(
        sets,
        [
            ("NodeRole", "tcpPorts", "tcp"),
            ("NodeRole", "gpuDirectPorts", "udp")
        ]
    );
    // Undeclared, the defaults the schema backs (it has no Settings).
    let c = read(ROLES).unwrap();
    let sets: Vec<&str> = c.port_sets().iter().map(|s| &*s.attribute).collect();
    assert_eq!(sets, ["tcpPorts", "udpPorts"]);
    assert!(read("entity A;").unwrap().port_sets().is_empty());
}

#[test]
fn the_baseline_follows_the_schema() {
    let c = read(&format!(
        r#"{ROLES} @conventions @port_sets("NodeRole.tcpPorts:tcp NodeRole.gpuDirectPorts:udp")
           @baseline_ports("NodeRole.gpuDirectPorts:udp") @baseline_restrictions("NodeRole.limited")
           entity C;"#
    ))
    .unwrap();
    let sets: Vec<&str> = c.baseline_ports().iter().map(|s| &*s.attribute).collect();
    assert_eq!(sets, ["gpuDirectPorts"]);
    let limits: Vec<&str> = c
        .baseline_restrictions()
        .iter()
        .map(|r| &*r.attribute)
        .collect();
    assert_eq!(limits, ["limited"]);
    // Undeclared: the default port sets that are port sets here, and no
    // restrictions (ROLES has no `restricted`).
    let c = read(&format!(
        r#"{ROLES} @conventions @port_sets("NodeRole.tcpPorts:tcp") entity C;"#
    ))
    .unwrap();
    let sets: Vec<&str> = c.baseline_ports().iter().map(|s| &*s.attribute).collect();
    assert_eq!(sets, ["tcpPorts"]);
    assert!(c.baseline_restrictions().is_empty());
}

#[test]
fn a_renamed_alert_obligation_is_the_one_that_alerts() {
    let c =
        read(r#"@conventions @obligations("page block_node") @alert_obligation("page") entity C;"#)
            .unwrap();
    assert_eq!(c.alert_obligation(), Some("page"));
    assert!(c.is_alert("page") && !c.is_alert("alert"));
    assert_eq!(read("entity A;").unwrap().alert_obligation(), Some("alert"));
    // Kinds without `alert` and no declaration: nothing alerts.
    let c = read(r#"@conventions @obligations("block_node") entity C;"#).unwrap();
    assert_eq!(c.alert_obligation(), None);
}

#[test]
fn placement_names_come_from_the_schema() {
    let c = read(&format!(
        r#"{ROLES} @conventions @schedule_action("place") @placement_group("room") entity C;"#
    ))
    .unwrap();
    assert_eq!(c.schedule_action(), "place");
    assert_eq!(c.placement_group(), "room");
    let c = read("entity A;").unwrap();
    assert_eq!(
        (c.schedule_action(), c.placement_group()),
        ("schedule", "zone")
    );
}

#[test]
fn a_declaration_the_schema_does_not_back_is_located() {
    for (text, message) in [
        (
            format!(r#"{ROLES} @conventions @port_sets("NodeRole.tcpPorts:sctp") entity C;"#),
            "entity C: @port_sets: \"NodeRole.tcpPorts:sctp\": unknown protocol \"sctp\" (known: tcp, udp)",
        ),
        (
            format!(r#"{ROLES} @conventions @port_sets("NodeRole.tcpPorts") entity C;"#),
            "entity C: @port_sets: \"NodeRole.tcpPorts\": not Type.attribute:protocol",
        ),
        (
            format!(r#"{ROLES} @conventions @port_sets("NodeRole.name:tcp") entity C;"#),
            "entity C: @port_sets: \"NodeRole.name:tcp\": NodeRole.name is not a Set<Long>",
        ),
        (
            format!(r#"{ROLES} @conventions @port_sets("NodeRole.sctpPorts:tcp") entity C;"#),
            "entity C: @port_sets: \"NodeRole.sctpPorts:tcp\": entity type NodeRole has no attribute sctpPorts",
        ),
        (
            format!(r#"{ROLES} @conventions @port_sets(" ") entity C;"#),
            "entity C: @port_sets: names no port set",
        ),
        (
            format!(
                r#"{ROLES} @conventions @port_sets("NodeRole.tcpPorts:tcp") @baseline_ports("NodeRole.udpPorts:udp") entity C;"#
            ),
            "entity C: @baseline_ports: NodeRole.udpPorts:udp is not one of the @port_sets, so `listen` would not tell its ports apart",
        ),
        (
            format!(r#"{ROLES} @conventions @baseline_ports("NodeRole.name:tcp") entity C;"#),
            "entity C: @baseline_ports: \"NodeRole.name:tcp\": NodeRole.name is not a Set<Long>",
        ),
        (
            format!(
                r#"{ROLES} @conventions @baseline_restrictions("NodeRole.tcpPorts") entity C;"#
            ),
            "entity C: @baseline_restrictions: \"NodeRole.tcpPorts\": NodeRole.tcpPorts is not a Set<String>",
        ),
        (
            format!(r#"{ROLES} @conventions @schedule_action("schedule") entity C;"#),
            "entity C: @schedule_action(\"schedule\"): the schema declares no such action",
        ),
        (
            format!(
                r#"{ROLES} @conventions @schedule_action("place") @placement_group("rack") entity C;"#
            ),
            "entity C: @placement_group(\"rack\"): Node.rack is not a reference to an entity",
        ),
        (
            format!(
                r#"{ROLES} @conventions @schedule_action("place") @placement_group("row") entity C;"#
            ),
            "entity C: @placement_group(\"row\"): entity type Node has no attribute row",
        ),
    ] {
        let problems = read(&text).unwrap_err();
        assert_eq!(problems[0].message, message, "{text}");
    }
}

#[test]
fn another_schema_names_its_own() {
    let c = read(
        r#"
        entity Host; entity Blob;
        action fetch appliesTo { principal: Host, resource: Blob,
                                 context: { verified: Bool, failure?: String } };
        @conventions @obligations("page quarantine") @block_obligation("quarantine")
        @verified_read("fetch")
        entity Conventions;"#,
    )
    .unwrap();
    assert!(c.knows_obligation("page") && !c.knows_obligation("alert"));
    assert_eq!(c.alert_obligation(), None);
    assert_eq!(c.block_obligation(), "quarantine");
    assert_eq!(
        c.verified_read().unwrap(),
        &VerifiedRead {
            action: "fetch".into(),
            reader: "Host".into(),
            object: "Blob".into(),
            reader_pod: false,
        }
    );
    // No `read` action and no declaration: no verified read at all.
    assert!(read("entity A;").unwrap().verified_read().is_none());
}

#[test]
fn a_verified_read_the_schema_does_not_back_is_located() {
    for (text, message) in [
        (
            r#"@conventions @verified_read("fetch") entity C;"#,
            "entity C: @verified_read(\"fetch\"): the schema declares no such action",
        ),
        (
            r#"entity A; action fetch appliesTo { principal: A, resource: A, context: { verified: Long } };
               @conventions @verified_read("fetch") entity C;"#,
            "entity C: @verified_read(\"fetch\"): its context needs a Bool `verified`",
        ),
        (
            r#"@conventions @obligations("alert") entity C;"#,
            "the block obligation \"block_node\" is not among the obligation kinds (alert)",
        ),
        (
            r#"@conventions @alert_obligation("page") entity C;"#,
            "the alert obligation \"page\" is not among the obligation kinds (alert, block_node, burst_to_cloud, migrate, rotate_key)",
        ),
        (
            r#"@conventions @obligations("Alert") entity C;"#,
            "entity C: obligation kind \"Alert\" is not lower_snake_case",
        ),
    ] {
        let problems = read(text).unwrap_err();
        assert_eq!(problems[0].message, message, "{text}");
    }
}
