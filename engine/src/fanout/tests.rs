use super::*;

#[test]
fn a_decision_stored_under_the_previous_world_is_never_served_under_the_new_one() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let cache = DecisionCache::default();
    let before = engine.snapshot_now();
    let old = cache.enter(&before);
    // A block changes the world: the cache empties and moves to a new generation.
    engine.block_node("gpu-a1", "test").unwrap();
    let after = engine.snapshot_now();
    let new = cache.enter(&after);
    assert_ne!(old, new);
    // A caller still deciding under the old world stores its answer late...
    let request: Arc<str> = Arc::from("train-1 onto a node");
    let node = EntityUid::new("Node", "gpu-a1").unwrap();
    let stale = Key::new(&request, 7, &node, old, 0);
    let hash = cache.hash(&stale);
    cache.put(
        &stale,
        hash,
        Vec::new(),
        Arc::new(Decision::error("decided before the block")),
    );
    // ...and a caller of the new world does not get it; one of the old world does.
    let current = Key::new(&request, 7, &node, new, 0);
    assert_eq!(cache.hash(&current), hash);
    let mut memo = Memo::default();
    assert!(
        cache
            .get(&current, hash, &after, Some(&mut memo), None)
            .is_none()
    );
    assert!(
        cache
            .get(&stale, hash, &before, Some(&mut memo), None)
            .is_some()
    );
}
