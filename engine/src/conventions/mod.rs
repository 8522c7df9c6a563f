//! What the engine itself relies on about a schema, declared in one place.
//!
//! The engine is a policy engine for clusters, not for one schema: the few names it
//! and its hooks act on (which obligation kinds policies may carry, which of them blocks
//! an entity, which action a verify-before-read decides, which attributes hold ports,
//! which action placement asks and how it groups nodes) are read from an entity type the
//! schema marks `@conventions`, each with a documented default that matches the default
//! schema. A hook asks [`Engine::conventions`](crate::Engine::conventions) rather than
//! typing a schema name:
//!
//! ```cedarschema
//! @conventions
//! @obligations("alert block_node burst_to_cloud migrate rotate_key")
//! @block_obligation("block_node")
//! @alert_obligation("alert")
//! @verified_read("read")
//! @block_policy("security.blocked-node")
//! @port_sets("NodeRole.tcpPorts:tcp NodeRole.udpPorts:udp Settings.inboundPortBaseline:tcp Settings.inboundUdpPortBaseline:udp")
//! @baseline_ports("NodeRole.tcpPorts:tcp NodeRole.udpPorts:udp Settings.inboundPortBaseline:tcp Settings.inboundUdpPortBaseline:udp")
//! @baseline_restrictions("NodeRole.restricted")
//! @schedule_action("schedule")
//! @placement_group("zone")
//! entity Conventions;
//! ```
//!
//! | annotation | default | meaning |
//! | --- | --- | --- |
//! | `@obligations` | `alert block_node burst_to_cloud migrate rotate_key` | the obligation kinds a policy's `@obligation` may name; another is a load error, so a typo cannot drop an obligation |
//! | `@block_obligation` | `block_node` | the kind whose target the engine blocks when it carries out a decision (its type must be the blocklist's, `@owned("blocklist")`) |
//! | `@alert_obligation` | `alert` | the kind a hook carries out by raising an alert (the node agent's sinks, the server's decision-log follower); declared, it must be one of the obligation kinds (a load error otherwise); the default where the kinds lack it means no kind alerts |
//! | `@verified_read` | `read` | the action [`Engine::decide_read`](crate::Engine::decide_read) asks: its principal is the reader, its resource the object, and its context holds a Bool `verified` and an optional String `failure` |
//! | `@port_sets` | `NodeRole.tcpPorts:tcp NodeRole.udpPorts:udp Settings.inboundPortBaseline:tcp Settings.inboundUdpPortBaseline:udp` | the `Set<Long>` attributes (`Type.attribute:protocol`) that hold ports of a protocol (`tcp` or `udp`; another is a load error): the node agent asks one `listen` question per range of ports that lie on the same side of every such set, so a set left out here would be ignored. A default entry the schema does not declare is left out |
//! | `@baseline_ports` | as `@port_sets` | the port sets that are a node's *allowed* ports, which the node agent turns into its firewall baseline: those of the role type (`NodeRole`) for a node with a role, those of `Settings` for one without. Each must be one of the `@port_sets` (so `listen` tells its ports apart); a default entry that is not is left out |
//! | `@baseline_restrictions` | `NodeRole.restricted` | the `Set<String>` attributes (`Type.attribute`) of `"tcp/PORT PREFIX"` entries that limit an allowed port to sources; a default the schema does not declare is left out |
//! | `@schedule_action` | `schedule` | the action placement asks (admission, the scheduler extender, the mutating webhook's affinity): its principal is the workload, its resource the node |
//! | `@placement_group` | `zone` | the attribute of the schedule action's resource (an entity reference) by which the mutating webhook groups nodes into the zones of its affinity; declared, it must be one on every resource type of the schedule action |
//! | `@block_policy` | none | the id of the forbid policy that enforces the blocklist: a set without it, or with it as a permit, is refused (naming it), and no reload can drop it. The default schema declares `security.blocked-node` |
//!
//! A policy annotated `@required` is protected the same way: a reload whose set lacks a
//! policy the live set marks `@required` (or has it as a permit where it was a forbid)
//! is refused, naming it, and the live set keeps serving. To retire such a policy,
//! remove its `@required` in one reload, then the policy in the next.
//!
//! A schema without the declaration gets the defaults. A declared name the schema does
//! not back (a verified-read action it lacks) is a load error; a default one is simply
//! unavailable, and asking for it is a deny that says why (fail closed).

use std::collections::BTreeSet;

use serde_json::Value as Json;

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

/// The obligation kinds a schema without `@obligations` allows.
pub const DEFAULT_OBLIGATION_KINDS: &[&str] = &[
    "alert",
    "block_node",
    "burst_to_cloud",
    "migrate",
    "rotate_key",
];

/// The annotation that marks the entity type holding the conventions.
pub const CONVENTIONS_ANNOTATION: &str = "conventions";

/// The names the engine acts on, as the schema declares them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conventions {
    obligation_kinds: BTreeSet<String>,
    block_obligation: String,
    alert_obligation: Option<String>,
    verified_read: Option<VerifiedRead>,
    block_policy: Option<String>,
    port_sets: Vec<PortSet>,
    baseline_ports: Vec<PortSet>,
    baseline_restrictions: Vec<Restrictions>,
    schedule_action: String,
    placement_group: String,
}

/// The port sets a schema without `@port_sets` declares (each where the schema backs it).
pub const DEFAULT_PORT_SETS: &str = "NodeRole.tcpPorts:tcp NodeRole.udpPorts:udp Settings.inboundPortBaseline:tcp Settings.inboundUdpPortBaseline:udp";

/// The restriction attributes a schema without `@baseline_restrictions` declares (where
/// the schema backs them).
const DEFAULT_BASELINE_RESTRICTIONS: &str = "NodeRole.restricted";

/// A `Set<String>` attribute of `"tcp/PORT PREFIX"` entries (`NodeRole.restricted`): an
/// allowed port reachable only from these sources.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Restrictions {
    /// The entity type holding it (`NodeRole`).
    pub entity_type: String,
    /// The attribute (`restricted`).
    pub attribute: String,
}

/// A protocol whose ports a [`PortSet`] holds. Exhaustive on purpose: a protocol added
/// here must be handled by every host that reads port sets, not skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PortProtocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl PortProtocol {
    /// Every protocol, in order.
    pub const ALL: [PortProtocol; 2] = [PortProtocol::Tcp, PortProtocol::Udp];

    /// Its name in `@port_sets` (`tcp`, `udp`).
    pub fn name(self) -> &'static str {
        match self {
            PortProtocol::Tcp => "tcp",
            PortProtocol::Udp => "udp",
        }
    }

    fn of(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// An attribute holding a set of ports of one protocol (`NodeRole.tcpPorts`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortSet {
    /// The entity type holding it (`NodeRole`).
    pub entity_type: String,
    /// The attribute (`tcpPorts`), a `Set<Long>`.
    pub attribute: String,
    /// The protocol of its ports.
    pub protocol: PortProtocol,
}

/// The action a verify-before-read decides, and the types it relates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedRead {
    /// The action's id (`read`).
    pub action: String,
    /// The reader's entity type (`Node`).
    pub reader: String,
    /// The read object's entity type (`Checkpoint`).
    pub object: String,
    /// Whether the context declares `readerPod`, the pod that reads.
    pub reader_pod: bool,
}

/// The context attribute holding the verification's outcome.
pub(crate) const VERIFIED_ATTR: &str = "verified";
/// The context attribute holding why verification failed.
pub(crate) const FAILURE_ATTR: &str = "failure";
/// The optional context attribute naming the pod that reads (`{namespace, name, uid?}`).
pub(crate) const READER_POD_ATTR: &str = "readerPod";

impl Default for Conventions {
    fn default() -> Self {
        Self {
            obligation_kinds: DEFAULT_OBLIGATION_KINDS
                .iter()
                .map(|k| (*k).to_owned())
                .collect(),
            block_obligation: "block_node".into(),
            alert_obligation: Some("alert".into()),
            verified_read: None,
            block_policy: None,
            port_sets: Vec::new(),
            baseline_ports: Vec::new(),
            baseline_restrictions: Vec::new(),
            schedule_action: "schedule".into(),
            placement_group: "zone".into(),
        }
    }
}

impl Conventions {
    /// The obligation kinds policies may carry.
    pub fn obligation_kinds(&self) -> impl Iterator<Item = &str> {
        self.obligation_kinds.iter().map(String::as_str)
    }

    /// Whether policies may carry obligation `kind`.
    pub fn knows_obligation(&self, kind: &str) -> bool {
        self.obligation_kinds.contains(kind)
    }

    /// The obligation kind whose target the engine blocks.
    pub fn block_obligation(&self) -> &str {
        &self.block_obligation
    }

    /// The obligation kind a hook carries out by raising an alert, if the schema has one.
    pub fn alert_obligation(&self) -> Option<&str> {
        self.alert_obligation.as_deref()
    }

    /// Whether `kind` is the alert obligation.
    pub fn is_alert(&self, kind: &str) -> bool {
        self.alert_obligation() == Some(kind)
    }

    /// The id of the policy that enforces the blocklist, if the schema names one.
    pub fn block_policy(&self) -> Option<&str> {
        self.block_policy.as_deref()
    }

    /// The verify-before-read action, if the schema has one.
    pub fn verified_read(&self) -> Option<&VerifiedRead> {
        self.verified_read.as_ref()
    }

    /// The attributes that hold sets of ports, with their protocols.
    pub fn port_sets(&self) -> &[PortSet] {
        &self.port_sets
    }

    /// The port sets that hold a node's allowed ports (its firewall baseline), each one
    /// of [`port_sets`](Self::port_sets).
    pub fn baseline_ports(&self) -> &[PortSet] {
        &self.baseline_ports
    }

    /// The attributes that limit allowed ports to sources.
    pub fn baseline_restrictions(&self) -> &[Restrictions] {
        &self.baseline_restrictions
    }

    /// The action placement asks (`schedule`).
    pub fn schedule_action(&self) -> &str {
        &self.schedule_action
    }

    /// The attribute of a node that names its placement group (`zone`).
    pub fn placement_group(&self) -> &str {
        &self.placement_group
    }

    /// Reads the conventions from the JSON form of the schema `file`.
    pub(crate) fn read(json: &Json, file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        let mut out = Self::default();
        let mut problems = Vec::new();
        let problem = |needle: &str, what: String| {
            let offset = file.text.find(needle).unwrap_or(0);
            SourceDiagnostic::new(&file.name, &file.text, offset, needle.len(), what)
        };
        let mut declared = None;
        let mut port_sets_declared = false;
        let mut alert_declared = false;
        let mut baseline_declared = None;
        let mut restrictions_declared = false;
        for (namespace, body) in json.as_object().into_iter().flatten() {
            for (name, decl) in body
                .get("entityTypes")
                .and_then(Json::as_object)
                .into_iter()
                .flatten()
            {
                let Some(annotations) = decl.get("annotations").and_then(Json::as_object) else {
                    continue;
                };
                if !annotations.contains_key(CONVENTIONS_ANNOTATION) {
                    continue;
                }
                let qualified = if namespace.is_empty() {
                    name.clone()
                } else {
                    format!("{namespace}::{name}")
                };
                if let Some(first) = &declared {
                    problems.push(problem(
                        "@conventions",
                        format!(
                            "entity {qualified}: @conventions is declared twice (first on {first})"
                        ),
                    ));
                    continue;
                }
                declared = Some(qualified.clone());
                let get = |k: &str| annotations.get(k).and_then(Json::as_str);
                if let Some(list) = get("obligations") {
                    let kinds: BTreeSet<String> =
                        list.split_whitespace().map(str::to_owned).collect();
                    let bad = kinds.iter().find(|k| {
                        !k.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                    });
                    if let Some(bad) = bad {
                        problems.push(problem(
                            "@obligations",
                            format!("entity {qualified}: obligation kind {bad:?} is not lower_snake_case"),
                        ));
                    } else if kinds.is_empty() {
                        problems.push(problem(
                            "@obligations",
                            format!("entity {qualified}: @obligations names no kind"),
                        ));
                    } else {
                        out.obligation_kinds = kinds;
                    }
                }
                if let Some(kind) = get("block_obligation") {
                    out.block_obligation = kind.to_owned();
                }
                if let Some(kind) = get("alert_obligation") {
                    alert_declared = true;
                    out.alert_obligation = Some(kind.to_owned());
                }
                if let Some(list) = get("baseline_ports") {
                    // Checked once the port sets are known, which it must be among.
                    baseline_declared = Some((qualified.clone(), list.to_owned()));
                }
                if let Some(list) = get("baseline_restrictions") {
                    restrictions_declared = true;
                    match restrictions(json, list) {
                        Ok(r) => out.baseline_restrictions = r,
                        Err(why) => problems.push(problem(
                            "@baseline_restrictions",
                            format!("entity {qualified}: @baseline_restrictions: {why}"),
                        )),
                    }
                }
                match get("block_policy") {
                    Some(id) if id.trim().is_empty() => problems.push(problem(
                        "@block_policy",
                        format!("entity {qualified}: @block_policy names no policy"),
                    )),
                    Some(id) => out.block_policy = Some(id.to_owned()),
                    None => {}
                }
                if let Some(list) = get("port_sets") {
                    port_sets_declared = true;
                    match port_sets(json, list) {
                        Ok(sets) => out.port_sets = sets,
                        Err(why) => problems.push(problem(
                            "@port_sets",
                            format!("entity {qualified}: @port_sets: {why}"),
                        )),
                    }
                }
                if let Some(action) = get("schedule_action") {
                    if action_decl(json, action).is_some() {
                        out.schedule_action = action.to_owned();
                    } else {
                        problems.push(problem(
                            "@schedule_action",
                            format!("entity {qualified}: @schedule_action(\"{action}\"): the schema declares no such action"),
                        ));
                    }
                }
                if let Some(attr) = get("placement_group") {
                    out.placement_group = attr.to_owned();
                    if let Err(why) = placement_group(json, &out.schedule_action, attr) {
                        problems.push(problem(
                            "@placement_group",
                            format!("entity {qualified}: @placement_group(\"{attr}\"): {why}"),
                        ));
                    }
                }
                if let Some(action) = get("verified_read") {
                    match verified_read(json, action) {
                        Ok(v) => out.verified_read = Some(v),
                        Err(why) => problems.push(problem(
                            "@verified_read",
                            format!("entity {qualified}: @verified_read(\"{action}\"): {why}"),
                        )),
                    }
                }
            }
        }
        if !out.obligation_kinds.contains(&out.block_obligation) {
            problems.push(problem(
                "@block_obligation",
                format!(
                    "the block obligation {:?} is not among the obligation kinds ({})",
                    out.block_obligation,
                    out.obligation_kinds
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if let Some(kind) = out.alert_obligation.clone()
            && !out.obligation_kinds.contains(&kind)
        {
            if alert_declared {
                problems.push(problem(
                    "@alert_obligation",
                    format!(
                        "the alert obligation {kind:?} is not among the obligation kinds ({})",
                        out.obligation_kinds
                            .iter()
                            .map(String::as_str)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            } else {
                // The default, where the schema's kinds lack it: nothing alerts.
                out.alert_obligation = None;
            }
        }
        if !port_sets_declared {
            // The defaults the schema backs: a schema without a `NodeRole` has no role
            // port sets to cut at.
            out.port_sets = DEFAULT_PORT_SETS
                .split_whitespace()
                .filter_map(|entry| port_set(json, entry).ok())
                .collect();
        }
        match baseline_declared {
            Some((qualified, list)) => {
                match port_sets(json, &list).and_then(|sets| {
                    match sets.iter().find(|s| !out.port_sets.contains(s)) {
                        Some(s) => Err(format!(
                            "{}.{}:{} is not one of the @port_sets, so `listen` would not tell its ports apart",
                            s.entity_type,
                            s.attribute,
                            s.protocol.name()
                        )),
                        None => Ok(sets),
                    }
                }) {
                    Ok(sets) => out.baseline_ports = sets,
                    Err(why) => problems.push(problem(
                        "@baseline_ports",
                        format!("entity {qualified}: @baseline_ports: {why}"),
                    )),
                }
            }
            None => {
                out.baseline_ports = DEFAULT_PORT_SETS
                    .split_whitespace()
                    .filter_map(|entry| port_set(json, entry).ok())
                    .filter(|s| out.port_sets.contains(s))
                    .collect();
            }
        }
        if !restrictions_declared {
            out.baseline_restrictions = DEFAULT_BASELINE_RESTRICTIONS
                .split_whitespace()
                .filter_map(|entry| restriction(json, entry).ok())
                .collect();
        }
        if out.verified_read.is_none() && problems.is_empty() {
            // The default: the schema's `read` action, when it has the right shape.
            out.verified_read = verified_read(json, "read").ok();
        }
        if problems.is_empty() {
            Ok(out)
        } else {
            Err(problems)
        }
    }
}

/// The declaration of action `name` in the schema's default namespace.
fn action_decl<'a>(json: &'a Json, name: &str) -> Option<&'a Json> {
    json.get("")
        .and_then(|ns| ns.get("actions"))
        .and_then(|a| a.get(name))
}

/// The declaration of entity type `ty` (`Type` or `ns::Type`).
fn entity_type_decl<'a>(json: &'a Json, ty: &str) -> Option<&'a Json> {
    let (namespace, name) = ty.rsplit_once("::").unwrap_or(("", ty));
    json.get(namespace)
        .and_then(|ns| ns.get("entityTypes"))
        .and_then(|e| e.get(name))
}

/// The declaration of attribute `attr` of entity type `ty`.
fn attribute_decl<'a>(json: &'a Json, ty: &str, attr: &str) -> Result<&'a Json, String> {
    let decl =
        entity_type_decl(json, ty).ok_or(format!("the schema declares no entity type {ty}"))?;
    decl.pointer("/shape/attributes")
        .and_then(|a| a.get(attr))
        .ok_or(format!("entity type {ty} has no attribute {attr}"))
}

/// Whether `decl` is the type `primitive` (`Long`), in either JSON spelling.
fn is_primitive(decl: &Json, primitive: &str) -> bool {
    let name = decl.get("name").and_then(Json::as_str);
    match decl.get("type").and_then(Json::as_str) {
        Some("EntityOrCommon") => {
            name.map(|n| n.trim_start_matches("__cedar::")) == Some(primitive)
        }
        Some(t) => t == primitive || (primitive == "Bool" && t == "Boolean"),
        None => false,
    }
}

/// The entries of `@port_sets`: `Type.attribute:protocol`, each a `Set<Long>`.
fn port_sets(json: &Json, list: &str) -> Result<Vec<PortSet>, String> {
    let sets = list
        .split_whitespace()
        .map(|entry| port_set(json, entry).map_err(|why| format!("{entry:?}: {why}")))
        .collect::<Result<Vec<_>, _>>()?;
    if sets.is_empty() {
        return Err("names no port set".into());
    }
    Ok(sets)
}

fn port_set(json: &Json, entry: &str) -> Result<PortSet, String> {
    // `ns::Type.attribute:protocol`: the protocol is after the last colon.
    let (place, protocol) = entry
        .rsplit_once(':')
        .filter(|(_, p)| !p.contains('.'))
        .ok_or("not Type.attribute:protocol")?;
    let protocol = PortProtocol::of(protocol).ok_or(format!(
        "unknown protocol {protocol:?} (known: {})",
        PortProtocol::ALL.map(PortProtocol::name).join(", ")
    ))?;
    let (entity_type, attribute) = place
        .rsplit_once('.')
        .filter(|(t, a)| !t.is_empty() && !a.is_empty())
        .ok_or("not Type.attribute:protocol")?;
    let decl = attribute_decl(json, entity_type, attribute)?;
    let is_set_of_long = decl.get("type").and_then(Json::as_str) == Some("Set")
        && decl.get("element").is_some_and(|e| is_primitive(e, "Long"));
    if !is_set_of_long {
        return Err(format!("{entity_type}.{attribute} is not a Set<Long>"));
    }
    Ok(PortSet {
        entity_type: entity_type.to_owned(),
        attribute: attribute.to_owned(),
        protocol,
    })
}

/// The entries of `@baseline_restrictions`: `Type.attribute`, each a `Set<String>`.
fn restrictions(json: &Json, list: &str) -> Result<Vec<Restrictions>, String> {
    let found = list
        .split_whitespace()
        .map(|entry| restriction(json, entry).map_err(|why| format!("{entry:?}: {why}")))
        .collect::<Result<Vec<_>, _>>()?;
    if found.is_empty() {
        return Err("names no attribute".into());
    }
    Ok(found)
}

fn restriction(json: &Json, entry: &str) -> Result<Restrictions, String> {
    let (entity_type, attribute) = entry
        .rsplit_once('.')
        .filter(|(t, a)| !t.is_empty() && !a.is_empty())
        .ok_or("not Type.attribute")?;
    let decl = attribute_decl(json, entity_type, attribute)?;
    let is_set_of_string = decl.get("type").and_then(Json::as_str) == Some("Set")
        && decl
            .get("element")
            .is_some_and(|e| is_primitive(e, "String"));
    if !is_set_of_string {
        return Err(format!("{entity_type}.{attribute} is not a Set<String>"));
    }
    Ok(Restrictions {
        entity_type: entity_type.to_owned(),
        attribute: attribute.to_owned(),
    })
}

/// Checks that `attr` is an entity reference on every resource type of `action`.
fn placement_group(json: &Json, action: &str, attr: &str) -> Result<(), String> {
    let resources = action_decl(json, action)
        .and_then(|d| d.pointer("/appliesTo/resourceTypes"))
        .and_then(Json::as_array)
        .filter(|r| !r.is_empty())
        .ok_or(format!(
            "the schedule action {action:?} has no resource type"
        ))?;
    for ty in resources.iter().filter_map(Json::as_str) {
        let decl = attribute_decl(json, ty, attr)?;
        let is_reference = match decl.get("type").and_then(Json::as_str) {
            Some("Entity") => true,
            Some("EntityOrCommon") => decl
                .get("name")
                .and_then(Json::as_str)
                .is_some_and(|n| entity_type_decl(json, n).is_some()),
            _ => false,
        };
        if !is_reference {
            return Err(format!("{ty}.{attr} is not a reference to an entity"));
        }
    }
    Ok(())
}

/// The action `name` (in the schema's default namespace) as a verify-before-read: one
/// principal type, one resource type, a Bool `verified` and an optional String `failure`.
fn verified_read(json: &Json, name: &str) -> Result<VerifiedRead, String> {
    let decl = json
        .get("")
        .and_then(|ns| ns.get("actions"))
        .and_then(|a| a.get(name))
        .ok_or("the schema declares no such action")?;
    let one = |key: &str| -> Result<String, String> {
        let list = decl
            .pointer(&format!("/appliesTo/{key}"))
            .and_then(Json::as_array)
            .ok_or(format!("the action has no {key} type"))?;
        match list.as_slice() {
            [Json::String(t)] => Ok(t.clone()),
            _ => Err(format!("the action needs exactly one {key} type")),
        }
    };
    let reader = one("principalTypes")?;
    let object = one("resourceTypes")?;
    let context = decl.pointer("/appliesTo/context/attributes");
    let type_of = |attr: &str| {
        context
            .and_then(|c| c.get(attr))
            .and_then(|a| a.get("name").or_else(|| a.get("type")))
            .and_then(Json::as_str)
    };
    if !matches!(type_of(VERIFIED_ATTR), Some("Bool" | "Boolean")) {
        return Err(format!("its context needs a Bool `{VERIFIED_ATTR}`"));
    }
    if !matches!(type_of(FAILURE_ATTR), None | Some("String")) {
        return Err(format!("its context's `{FAILURE_ATTR}` must be a String"));
    }
    Ok(VerifiedRead {
        action: name.to_owned(),
        reader,
        object,
        reader_pod: context.and_then(|c| c.get(READER_POD_ATTR)).is_some(),
    })
}

#[cfg(test)]
mod tests;
