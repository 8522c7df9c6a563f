use super::convert::displays_as;
use super::*;
use serde_json::json;

fn uid(t: &str, id: &str) -> EntityUID {
    EntityUID::from_components(entity_type(t).unwrap(), ast::Eid::new(id), None)
}

fn stored(parents: &[EntityUID]) -> Arc<Stored> {
    Arc::new(Stored::new(
        Box::new([]),
        Box::new([]),
        parents.iter().cloned().map(Arc::new).collect(),
    ))
}

fn arcs(uids: &[EntityUID]) -> Vec<Arc<EntityUID>> {
    uids.iter().cloned().map(Arc::new).collect()
}

#[test]
fn ancestors_follow_the_stored_hierarchy_and_cycles_are_seen() {
    let mut s = Store::default();
    s.insert(uid("Cluster", "c"), stored(&[]));
    s.insert(uid("Zone", "z"), stored(&[uid("Cluster", "c")]));
    s.insert(uid("Node", "n"), stored(&[uid("Zone", "z")]));
    let a = s.ancestors(
        &arcs(&[uid("Zone", "z")]),
        &crate::slice::RequestEntities::default(),
    );
    assert_eq!(a, HashSet::from([uid("Zone", "z"), uid("Cluster", "c")]));
    assert!(s.would_cycle(
        &uid("Cluster", "c"),
        &arcs(&[uid("Node", "n")]),
        &HashMap::new()
    ));
    assert!(!s.would_cycle(
        &uid("Node", "m"),
        &arcs(&[uid("Zone", "z")]),
        &HashMap::new()
    ));
}

#[test]
fn the_change_log_names_what_changed_since_a_version_within_its_reach() {
    let mut s = Store::default();
    s.insert(uid("Node", "a"), stored(&[]));
    let then = s.version();
    assert_eq!(s.changed_since(then), Some(vec![]));
    let mut later = s.clone();
    later.insert(uid("Node", "b"), stored(&[]));
    assert!(later.remove(&uid("Node", "a")));
    assert!(!later.remove(&uid("Node", "never")));
    assert_eq!(
        later.changed_since(then),
        Some(vec![uid("Node", "b"), uid("Node", "a")])
    );
    // The older store cannot tell about a later version, nor another lineage.
    assert_eq!(s.changed_since(later.version()), None);
    assert_eq!(Store::default().changed_since(then), None);
    // Beyond the log's reach it says so rather than naming a part.
    for i in 0..2 * CHANGE_LOG_LEN {
        later.insert(uid("Node", &format!("n{i}")), stored(&[]));
    }
    assert_eq!(later.changed_since(then), None);
    // It reaches at least the last CHANGE_LOG_LEN changes, named in order.
    let back = later.changed_since(StoreVersion {
        lineage: later.lineage,
        version: later.version - CHANGE_LOG_LEN as u64,
    });
    let back = back.expect("the last CHANGE_LOG_LEN changes are logged");
    assert_eq!(back.len(), CHANGE_LOG_LEN);
    assert_eq!(
        back.last(),
        Some(&uid("Node", &format!("n{}", 2 * CHANGE_LOG_LEN - 1)))
    );
    let recent = later.version();
    later.insert(uid("Node", "last"), stored(&[]));
    assert_eq!(later.changed_since(recent), Some(vec![uid("Node", "last")]));
}

#[test]
fn displays_as_compares_the_whole_text() {
    let ty = entity_type("k8s::Node").unwrap();
    assert!(displays_as(&ty, "k8s::Node"));
    assert!(!displays_as(&ty, "k8s::Nod"));
    assert!(!displays_as(&ty, "k8s::Node2"));
    assert!(!displays_as(&ty, "Node"));
    assert!(!displays_as(&ty, ""));
}

#[test]
fn entities_of_a_type_are_a_range() {
    let mut s = Store::default();
    for id in ["b", "a", "c"] {
        s.insert(uid("Zone", id), stored(&[]));
    }
    s.insert(uid("Node", "a"), stored(&[]));
    s.insert(uid("ZoneX", "a"), stored(&[]));
    let zone = entity_type("Zone").unwrap();
    let ids: Vec<String> = s
        .of_type(&zone)
        .map(|(u, _)| u.eid().escaped().to_string())
        .collect();
    assert_eq!(ids, ["a", "b", "c"]);
}

#[test]
fn uids_are_read_in_every_form() {
    for j in [
        json!({"type": "Node", "id": "n1"}),
        json!({"__entity": {"type": "Node", "id": "n1"}}),
        json!("Node::\"n1\""),
    ] {
        assert_eq!(parse_uid(&j).unwrap(), uid("Node", "n1"));
    }
    assert!(parse_uid(&json!({"type": "no such", "id": "x"})).is_err());
    assert!(parse_uid(&json!(3)).is_err());
}

#[test]
fn json_round_trips_ids_that_need_escaping() {
    let u = uid("Node", "a \"b\" \\c");
    let j = uid_json(&u);
    assert_eq!(j["id"], "a \"b\" \\c");
    assert_eq!(parse_uid(&j).unwrap(), u);
}
