//! The cluster's facts: attributes of shared entities that the cluster manager owns.
//!
//! Why this module exists: a `Node` is known to two sources. The Kubernetes Node says
//! where it stands and what it is meant to be (its zone label, its role label, its GPU
//! capacity); the node's agent measures the rest. The schema marks the first kind
//! `@owned("cluster")` ([`crate::facts`]), and ownership is then per attribute:
//!
//! * the cluster's write ([`Engine::replace_cluster_facts`]) replaces only the
//!   attributes it supplied before, keeping every other source's attributes and the
//!   entity's parents; an entity left with no attribute at all is removed;
//! * any other write of the entity (an agent's upsert, `POST /v1/entities`) may leave
//!   the cluster's attributes out (they are kept) or repeat them, but one that
//!   contradicts a value the cluster supplied is refused, naming the attribute and its
//!   owner: two sources disagreeing about where a node stands is a finding, not a race
//!   that the last writer wins. An attribute the cluster owns but did not supply for
//!   that entity (a node with no role label) is the other source's to give.
//!
//! Invariant: for every entity in [`ClusterFacts`], the stored entity holds each of
//! those attributes with exactly that value.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use cedar_policy_core::ast::{self, EntityUID};
use serde_json::Value;

use super::Engine;
use super::entities::rejected;
use super::snapshot::{ClusterFacts, Working};
use crate::error::EntityError;
use crate::request::{EntityUid, kind};
use crate::store::{self, AttrId, Stored};

/// Attributes as the store keeps them, sorted by name id.
type Attrs = Box<[(AttrId, ast::Value)]>;

impl Engine {
    /// Replaces everything the cluster supplies (the Kubernetes controller's view of its
    /// Nodes): `json` is a Cedar entity JSON array of `{"uid", "attrs"}`, each entity of
    /// a type with `@owned("cluster")` attributes and giving only those. A full
    /// replace: an entity the cluster supplied before and `json` lacks loses the
    /// cluster's attributes (and is removed if it has no other). Each entity's other
    /// attributes and its parents are kept. All or nothing; returns the number of
    /// entities given. Writes nothing when nothing changed, so a periodic resend is
    /// cheap and keeps every cache.
    pub fn replace_cluster_facts(&self, json: &Value) -> Result<usize, EntityError> {
        let Value::Array(items) = json else {
            return Err(EntityError::Shape {
                found: kind(json).into(),
            });
        };
        loop {
            let snapshot = self.shared.current.load_full();
            let bundle = Arc::clone(&snapshot.bundle);
            let converter = bundle.converter();
            let mut supplied: ClusterFacts = HashMap::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let uid_text = || {
                    item.get("uid")
                        .and_then(|u| store::parse_uid(u).ok())
                        .map(|u| u.to_string())
                };
                for field in ["parents", "tags"] {
                    let given = item.get(field).is_some_and(|v| match v {
                        Value::Null => false,
                        Value::Array(a) => !a.is_empty(),
                        Value::Object(o) => !o.is_empty(),
                        _ => true,
                    });
                    if given {
                        return Err(rejected(
                            i,
                            uid_text(),
                            format!(
                                "{field}: the cluster supplies attributes only (an entity's {field} are its other sources')"
                            ),
                        ));
                    }
                }
                // The type first: an entity the cluster cannot supply is refused for
                // that, not for its shape.
                if let Some(uid) = item.get("uid").and_then(|u| store::parse_uid(u).ok()) {
                    let type_name = uid.entity_type().to_string();
                    if bundle.origins.cluster_attrs_of(&type_name).is_none() {
                        return Err(rejected(
                            i,
                            Some(uid.to_string()),
                            format!("{type_name} has no attributes the cluster owns"),
                        ));
                    }
                }
                let c = converter
                    .entity(item)
                    .map_err(|(uid, e)| rejected(i, uid, e))?;
                let type_name = c.uid.entity_type().to_string();
                let Some(owned) = bundle.origins.cluster_attrs_of(&type_name) else {
                    return Err(rejected(
                        i,
                        Some(c.uid.to_string()),
                        format!("{type_name} has no attributes the cluster owns"),
                    ));
                };
                if c.claimed_block.is_some() {
                    return Err(rejected(
                        i,
                        Some(c.uid.to_string()),
                        "the blocklist owns the block attribute, not the cluster".into(),
                    ));
                }
                if let Some((id, _)) = c
                    .stored
                    .attrs
                    .iter()
                    .find(|(id, _)| !owned.contains(&id.name()))
                {
                    return Err(rejected(
                        i,
                        Some(c.uid.to_string()),
                        format!(
                            "attrs.{}: not an attribute the cluster owns ({type_name}'s are {})",
                            id.name(),
                            owned
                                .iter()
                                .map(|a| a.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
                if supplied.contains_key(&c.uid) {
                    return Err(rejected(i, Some(c.uid.to_string()), "given twice".into()));
                }
                supplied.insert(c.uid, c.stored.attrs);
            }
            let count = supplied.len();
            let result = self.write(Box::new(move |w: &mut Working| {
                if !Arc::ptr_eq(&w.bundle, &bundle) {
                    return Err(EntityError::SchemaChanged);
                }
                apply_cluster_facts(w, supplied);
                Ok(count)
            }));
            match result {
                Err(EntityError::SchemaChanged) => continue,
                other => return other,
            }
        }
    }

    /// Whether the store knows `uid` only from the cluster: every attribute it holds is
    /// one the cluster supplied (a node whose agent has not reported yet).
    pub fn known_only_from_cluster(&self, uid: &EntityUid) -> bool {
        let current = self.shared.current.load();
        let uid: &EntityUID = uid.0.as_ref();
        let (Some(theirs), Some(stored)) = (current.cluster.get(uid), current.store.get(uid))
        else {
            return false;
        };
        stored
            .attrs
            .iter()
            .all(|(id, _)| theirs.iter().any(|(t, _)| t == id))
    }

    /// How many entities hold attributes the cluster supplied.
    pub fn cluster_entity_count(&self) -> usize {
        self.shared.current.load().cluster.len()
    }
}

/// Puts `supplied` in place of what the cluster supplied before.
fn apply_cluster_facts(w: &mut Working, supplied: ClusterFacts) {
    let before = Arc::clone(&w.cluster);
    let uids: BTreeSet<&EntityUID> = before.keys().chain(supplied.keys()).collect();
    let mut changed = false;
    for uid in uids {
        let old = before.get(uid);
        let new = supplied.get(uid);
        if old == new {
            continue;
        }
        changed = true;
        let names = |a: Option<&Attrs>| -> Vec<AttrId> {
            a.map(|a| a.iter().map(|(id, _)| *id).collect())
                .unwrap_or_default()
        };
        let (old_names, new_names) = (names(old), names(new));
        let current = w.store.get(uid).cloned();
        let mut attrs: Vec<(AttrId, ast::Value)> = current
            .as_ref()
            .map(|s| {
                s.attrs
                    .iter()
                    .filter(|(id, _)| !old_names.contains(id) && !new_names.contains(id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        attrs.extend(new.into_iter().flat_map(|a| a.iter().cloned()));
        if attrs.is_empty() {
            w.store.remove(uid);
            continue;
        }
        attrs.sort_by_key(|a| a.0);
        let stored = Stored::new(
            attrs.into_boxed_slice(),
            current.as_ref().map(|s| s.tags.clone()).unwrap_or_default(),
            current
                .as_ref()
                .map(|s| s.parents.clone())
                .unwrap_or_default(),
        );
        w.store.insert(uid.clone(), Arc::new(stored));
    }
    if changed {
        w.cluster = Arc::new(supplied);
        w.changed = true;
    }
}

/// Adds the cluster's attributes of `uid` to `stored` (another source's write of it),
/// or says which one `stored` contradicts.
pub(super) fn merge_cluster_facts(
    cluster: &ClusterFacts,
    uid: &EntityUID,
    stored: &mut Stored,
) -> Result<(), String> {
    let Some(theirs) = cluster.get(uid) else {
        return Ok(());
    };
    let mut attrs = stored.attrs.to_vec();
    for (id, value) in theirs.iter() {
        match attrs.iter().find(|(a, _)| a == id) {
            Some((_, mine)) if mine != value => {
                return Err(format!(
                    "attrs.{}: owned by the cluster, which says {} (from the Kubernetes Node); this write says {} (leave it out, or fix the Node's labels)",
                    id.name(),
                    store::value_json(value),
                    store::value_json(mine)
                ));
            }
            Some(_) => {}
            None => attrs.push((*id, value.clone())),
        }
    }
    attrs.sort_by_key(|a| a.0);
    stored.attrs = attrs.into_boxed_slice();
    Ok(())
}

/// Forgets what the cluster supplied of `uid` (the entity was removed).
pub(super) fn forget_cluster_facts(w: &mut Working, uid: &EntityUID) {
    if w.cluster.contains_key(uid) {
        Arc::make_mut(&mut w.cluster).remove(uid);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use serde_json::json;

    fn engine() -> Engine {
        let policies = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
        Engine::builder(policies).build().unwrap()
    }

    fn node_uid(id: &str) -> EntityUid {
        EntityUid::new("Node", id).unwrap()
    }

    fn cluster_node(id: &str, zone: &str) -> Value {
        json!({
            "uid": {"type": "Node", "id": id},
            "attrs": {
                "zone": {"__entity": {"type": "Zone", "id": zone}},
                "gpuNode": true,
                "gpusAllocatable": 8,
                "gpuProduct": "NVIDIA-H100-80GB-HBM3",
            },
        })
    }

    fn agent_node(id: &str, zone: &str) -> Value {
        json!({
            "uid": {"type": "Node", "id": id},
            "attrs": {
                "zone": {"__entity": {"type": "Zone", "id": zone}},
                "rack": "r1", "driverVersion": "550.54.15", "cudaImage": "cuda:12.4",
                "gpuNode": true, "gpuCount": 8, "cpuCount": 64, "gpuMemoryMiB": 81920,
                "hottestGpuTempC": 50, "powerDrawW": 3000, "powerWindowMeanW": 2900,
            },
            "parents": [{"type": "Zone", "id": zone}],
        })
    }

    fn attrs(engine: &Engine, id: &str) -> serde_json::Map<String, Value> {
        engine.entity(&node_uid(id)).unwrap()["attrs"]
            .as_object()
            .unwrap()
            .clone()
    }

    #[test]
    fn a_node_with_only_cluster_facts_is_stored_and_known_only_from_the_cluster() {
        let e = engine();
        assert_eq!(
            e.replace_cluster_facts(&json!([cluster_node("n1", "a")]))
                .unwrap(),
            1
        );
        let a = attrs(&e, "n1");
        assert_eq!(a["gpusAllocatable"], json!(8));
        assert!(a.get("hottestGpuTempC").is_none());
        assert!(e.known_only_from_cluster(&node_uid("n1")));
    }

    #[test]
    fn an_agent_write_keeps_the_cluster_attributes_and_the_cluster_write_keeps_the_agents() {
        let e = engine();
        e.replace_cluster_facts(&json!([cluster_node("n1", "a")]))
            .unwrap();
        let mut agent = agent_node("n1", "a");
        agent["attrs"].as_object_mut().unwrap().remove("zone");
        e.upsert_entities(&json!([agent])).unwrap();
        let a = attrs(&e, "n1");
        assert_eq!(a["zone"], json!({"__entity": {"type": "Zone", "id": "a"}}));
        assert_eq!(a["gpuProduct"], json!("NVIDIA-H100-80GB-HBM3"));
        assert_eq!(a["hottestGpuTempC"], json!(50));
        assert!(!e.known_only_from_cluster(&node_uid("n1")));
        // The cluster's next write replaces its own attributes only.
        let mut next = cluster_node("n1", "a");
        next["attrs"].as_object_mut().unwrap().remove("gpuProduct");
        e.replace_cluster_facts(&json!([next])).unwrap();
        let a = attrs(&e, "n1");
        assert!(a.get("gpuProduct").is_none());
        assert_eq!(a["hottestGpuTempC"], json!(50));
        let parents = &e.entity(&node_uid("n1")).unwrap()["parents"];
        assert_eq!(parents, &json!([{"type": "Zone", "id": "a"}]));
    }

    #[test]
    fn a_write_that_contradicts_the_cluster_is_refused_naming_the_attribute_and_owner() {
        let e = engine();
        e.replace_cluster_facts(&json!([cluster_node("n1", "a")]))
            .unwrap();
        let err = e
            .upsert_entities(&json!([agent_node("n1", "b")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("attrs.zone: owned by the cluster"), "{err}");
        // Nothing changed.
        assert!(e.known_only_from_cluster(&node_uid("n1")));
        // Agreeing with the cluster is fine.
        e.upsert_entities(&json!([agent_node("n1", "a")])).unwrap();
    }

    #[test]
    fn a_node_absent_from_the_cluster_set_loses_its_cluster_attributes_and_goes_if_nothing_is_left()
    {
        let e = engine();
        e.replace_cluster_facts(&json!([cluster_node("n1", "a"), cluster_node("n2", "a")]))
            .unwrap();
        e.upsert_entities(&json!([agent_node("n2", "a")])).unwrap();
        e.replace_cluster_facts(&json!([])).unwrap();
        assert!(!e.contains_entity(&node_uid("n1")));
        let a = attrs(&e, "n2");
        assert!(a.get("gpusAllocatable").is_none());
        assert!(a.get("zone").is_none());
        assert_eq!(a["rack"], json!("r1"));
        assert_eq!(e.cluster_entity_count(), 0);
        // With the cluster gone, the agent may say where the node stands again.
        e.upsert_entities(&json!([agent_node("n2", "b")])).unwrap();
    }

    #[test]
    fn the_cluster_may_give_only_the_attributes_it_owns() {
        let e = engine();
        let mut bad = cluster_node("n1", "a");
        bad["attrs"]["hottestGpuTempC"] = json!(40);
        let err = e
            .replace_cluster_facts(&json!([bad]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("attrs.hottestGpuTempC: not an attribute the cluster owns"),
            "{err}"
        );
        let mut bad = cluster_node("n1", "a");
        bad["parents"] = json!([{"type": "Zone", "id": "a"}]);
        let err = e
            .replace_cluster_facts(&json!([bad]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("parents: the cluster supplies attributes only"),
            "{err}"
        );
        let err = e
            .replace_cluster_facts(&json!([{"uid": {"type": "Zone", "id": "a"}, "attrs": {}}]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Zone has no attributes the cluster owns"),
            "{err}"
        );
        let mut bad = cluster_node("n1", "a");
        bad["attrs"]["gpusAllocatable"] = json!("eight");
        let err = e
            .replace_cluster_facts(&json!([bad]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpusAllocatable"), "{err}");
        assert_eq!(e.entity_count(), e.entities_json(None).len());
        assert!(!e.contains_entity(&node_uid("n1")));
    }

    #[test]
    fn a_rule_that_reads_telemetry_a_cluster_only_node_lacks_denies() {
        let e = engine();
        e.replace_cluster_facts(&json!([cluster_node("n1", "a")]))
            .unwrap();
        let request = crate::Request::new(
            EntityUid::new("Workload", "w").unwrap(),
            EntityUid::action("schedule").unwrap(),
            node_uid("n1"),
        )
        .with_entities(vec![json!({
            "uid": {"type": "Workload", "id": "w"},
            "attrs": {"namespace": {"__entity": {"type": "Namespace", "id": "ml"}},
                      "class": "training", "gpus": 1, "cpuMillis": 1000,
                      "gpuMemoryMiB": 1024, "image": "cuda:12.4"},
        })]);
        let d = e.decide(&request);
        assert!(!d.is_allowed(), "{d:?}");
    }

    #[test]
    fn removing_a_node_forgets_what_the_cluster_supplied() {
        let e = engine();
        e.replace_cluster_facts(&json!([cluster_node("n1", "a")]))
            .unwrap();
        e.remove_entities(&[node_uid("n1")]).unwrap();
        assert_eq!(e.cluster_entity_count(), 0);
        e.upsert_entities(&json!([agent_node("n1", "b")])).unwrap();
    }
}
