//! A node role's firewall baseline, as the policy directory defines it.
//!
//! Why this module exists: the ports a role may expose are policy data (`probity.toml`'s
//! `[roles.<name>]`, which the engine turns into `NodeRole` entities with every port of
//! a range expanded, and restrictions such as `"tcp/10250 10.0.0.0/8"`). The
//! firewall wants the same thing as a [`Baseline`] of port ranges and source prefixes.
//! This module converts one into the other and states nothing of its own: which
//! attributes hold the allowed ports and their restrictions is the schema's to name
//! (`@baseline_ports`, `@baseline_restrictions`, see [`probity::Conventions`]), a node
//! without a role gets `Settings`' global baseline, as the `listen` policy does, and a
//! role the policy directory does not define is an error rather than an empty baseline.

use std::collections::BTreeMap;

use probity::{Conventions, Engine, PortProtocol};
use probity_firewall::baseline::{Allowance, Baseline, FamilyScope};
use probity_firewall::{PortRange, Prefix, Protocol};
use serde_json::Value;
use thiserror::Error;

/// The role name a baseline without a role renders under.
pub const DEFAULT_ROLE: &str = "default";

/// The entity type of a node's role.
const ROLE_TYPE: &str = "NodeRole";
/// The entity type of the global settings, whose baseline a node without a role gets.
const SETTINGS_TYPE: &str = "Settings";

/// Why a role's baseline could not be built.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RoleError {
    /// The policy directory defines no such role.
    #[error("role {role:?} is not defined in probity.toml ([roles.{role}]); defined: {defined}")]
    UnknownRole {
        /// The role asked for.
        role: String,
        /// The roles that exist, comma-separated.
        defined: String,
    },
    /// There is no `Settings::"active"` entity (the engine always builds one).
    #[error("the engine has no Settings::\"active\" entity")]
    NoSettings,
    /// A restriction entry (`@baseline_restrictions`) that is not `PROTO/PORT PREFIX`.
    #[error("role {role:?}: restriction {entry:?} is not \"tcp/PORT PREFIX\"")]
    BadRestriction {
        /// The role.
        role: String,
        /// The entry.
        entry: String,
    },
}

/// The baseline of `role` (or the global one when `None`) from the engine's store.
pub fn role_baseline(engine: &Engine, role: Option<&str>) -> Result<Baseline, RoleError> {
    let conventions = engine.conventions();
    match role {
        Some(role) => {
            let roles = engine.entities_json(Some(ROLE_TYPE));
            let Some(entity) = roles
                .iter()
                .find(|e| e.pointer("/uid/id").and_then(Value::as_str) == Some(role))
            else {
                let defined: Vec<&str> = roles
                    .iter()
                    .filter_map(|e| e.pointer("/uid/id").and_then(Value::as_str))
                    .collect();
                return Err(RoleError::UnknownRole {
                    role: role.to_owned(),
                    defined: if defined.is_empty() {
                        "none".to_owned()
                    } else {
                        defined.join(", ")
                    },
                });
            };
            let restricted: Vec<String> = conventions
                .baseline_restrictions()
                .iter()
                .filter(|r| r.entity_type == ROLE_TYPE)
                .flat_map(|r| strings(attribute(entity, &r.attribute)))
                .collect();
            from_sets(
                role,
                &allowed(&conventions, ROLE_TYPE, entity, PortProtocol::Tcp),
                &allowed(&conventions, ROLE_TYPE, entity, PortProtocol::Udp),
                &restricted,
            )
        }
        None => {
            let settings = engine.entities_json(Some(SETTINGS_TYPE));
            let Some(s) = settings
                .iter()
                .find(|e| e.pointer("/uid/id").and_then(Value::as_str) == Some("active"))
            else {
                return Err(RoleError::NoSettings);
            };
            from_sets(
                DEFAULT_ROLE,
                &allowed(&conventions, SETTINGS_TYPE, s, PortProtocol::Tcp),
                &allowed(&conventions, SETTINGS_TYPE, s, PortProtocol::Udp),
                &[],
            )
        }
    }
}

/// Attribute `name` of the JSON `entity`.
fn attribute<'a>(entity: &'a Value, name: &str) -> Option<&'a Value> {
    entity.get("attrs").and_then(|a| a.get(name))
}

/// The ports of `protocol` that `entity` (of type `ty`) allows: the union of its
/// baseline port sets of that protocol.
fn allowed(
    conventions: &Conventions,
    ty: &str,
    entity: &Value,
    protocol: PortProtocol,
) -> Vec<u16> {
    let mut out: Vec<u16> = conventions
        .baseline_ports()
        .iter()
        .filter(|s| s.entity_type == ty && s.protocol == protocol)
        .filter_map(|s| attribute(entity, &s.attribute).and_then(Value::as_array))
        .flatten()
        .filter_map(Value::as_u64)
        .filter_map(|p| u16::try_from(p).ok())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Consecutive ports merged back into ranges.
pub fn merge_ports(ports: &[u16]) -> Vec<PortRange> {
    let mut sorted = ports.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<PortRange> = Vec::new();
    let mut run: Option<(u16, u16)> = None;
    for p in sorted {
        run = match run {
            Some((s, e)) if e.checked_add(1) == Some(p) => Some((s, p)),
            Some((s, e)) => {
                out.extend(PortRange::new(s, e));
                Some((p, p))
            }
            None => Some((p, p)),
        };
    }
    if let Some((s, e)) = run {
        out.extend(PortRange::new(s, e));
    }
    out
}

/// A baseline from a role's port sets and restrictions: a restricted port is allowed
/// only from its prefixes; every other port of the sets from anywhere.
pub fn from_sets(
    role: &str,
    tcp: &[u16],
    udp: &[u16],
    restricted: &[String],
) -> Result<Baseline, RoleError> {
    let bad = |entry: &str| RoleError::BadRestriction {
        role: role.to_owned(),
        entry: entry.to_owned(),
    };
    let mut limited: BTreeMap<(Protocol, u16), Vec<Prefix>> = BTreeMap::new();
    for entry in restricted {
        let (key, prefix) = entry.split_once(' ').ok_or_else(|| bad(entry))?;
        let (proto, port) = key.split_once('/').ok_or_else(|| bad(entry))?;
        let protocol = match proto {
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            _ => return Err(bad(entry)),
        };
        let port: u16 = port.parse().map_err(|_| bad(entry))?;
        let prefix: Prefix = prefix.trim().parse().map_err(|_| bad(entry))?;
        limited.entry((protocol, port)).or_default().push(prefix);
    }
    let mut allow = Vec::new();
    for (protocol, set) in [(Protocol::Tcp, tcp), (Protocol::Udp, udp)] {
        let open: Vec<u16> = set
            .iter()
            .copied()
            .filter(|p| !limited.contains_key(&(protocol, *p)))
            .collect();
        allow.extend(
            merge_ports(&open)
                .into_iter()
                .map(|r| Allowance::any(protocol, r)),
        );
        for ((proto, port), sources) in &limited {
            // A restriction on a port the role does not allow at all allows nothing.
            if *proto == protocol && set.contains(port) {
                allow.push(Allowance {
                    protocol,
                    ports: PortRange::single(*port),
                    sources: sources.clone(),
                    family: FamilyScope::Both,
                });
            }
        }
    }
    Ok(Baseline {
        role: role.to_owned(),
        allow,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_ports_merge_into_ranges() {
        let r: Vec<String> = merge_ports(&[22, 179, 30000, 30001, 30002, 21, 65535])
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(r, ["21-22", "179", "30000-30002", "65535"]);
        assert!(merge_ports(&[]).is_empty());
    }

    #[test]
    fn the_default_gpu_worker_role_becomes_its_baseline() {
        let engine = Engine::from_embedded_defaults().unwrap();
        let b = role_baseline(&engine, Some("gpu-worker")).unwrap();
        let text = probity_firewall::baseline::render(&b).unwrap();
        let t = text.text();
        assert!(t.contains("tcp dport 30000-32767 accept"), "{t}");
        assert!(
            t.contains("ip saddr 10.0.0.0/8 tcp dport 10250 accept"),
            "{t}"
        );
        assert!(!t.contains("\ttcp dport 10250 accept"), "restricted: {t}");
        assert!(t.contains("udp dport 8472 accept"), "{t}");
        let none = role_baseline(&engine, None).unwrap();
        assert_eq!(none.role, DEFAULT_ROLE);
        let ports: Vec<String> = none.allow.iter().map(|a| a.ports.to_string()).collect();
        assert_eq!(ports, ["22", "2379-2380"]);
    }

    #[test]
    fn an_undefined_role_is_an_error_not_an_empty_baseline() {
        let engine = Engine::from_embedded_defaults().unwrap();
        let e = role_baseline(&engine, Some("storage")).unwrap_err();
        assert!(e.to_string().contains("control-plane, gpu-worker"), "{e}");
    }

    #[test]
    fn a_malformed_restriction_is_refused() {
        assert!(matches!(
            from_sets("r", &[22], &[], &["tcp/22".into()]),
            Err(RoleError::BadRestriction { .. })
        ));
    }
}
