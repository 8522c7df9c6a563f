//! One request for its own resource through the cache: the path of
//! [`Engine::decide_with`].

use super::*;

impl Engine {
    /// Decides `request` for its own resource through `cache` (the path of
    /// [`Engine::decide_with`]): a remembered answer whose facts hold is reused, else it
    /// is decided and remembered. The caller has checked [`Engine::cacheable`].
    pub(crate) fn decide_through(
        &self,
        snapshot: &Snapshot,
        request: &Request,
        cache: &DecisionCache,
    ) -> Arc<Decision> {
        let decide = || match self.prepare(snapshot, request) {
            Ok(prepared) => Arc::new(self.decide_prepared(
                snapshot,
                request,
                &prepared,
                &request.resource,
                None,
            )),
            Err(denied) => Arc::new(*denied),
        };
        // A doorkeeper: a principal, action and resource not seen recently is decided
        // without the cache, and remembered as seen; the next time, the whole question
        // is looked up and, if missing, stored. So questions that never repeat (each
        // with a workload of its own) cost neither their fingerprint nor a store, and
        // push nothing out.
        if !cache.seen_before(cache.hasher.hash_one((
            request.principal.0.as_ref(),
            request.action.0.as_ref(),
            request.resource.0.as_ref(),
        ))) {
            cache.misses.fetch_add(1, Ordering::Relaxed);
            return decide();
        }
        let Some((text, request_hash)) = fingerprint_hashed(request) else {
            return decide();
        };
        // (An entry may outlive its interned text: looked up by the text then.)
        let (fp, interned) = match cache.interned(&text) {
            Some(fp) => (fp, true),
            None => (text, false),
        };
        let generation = cache.enter(snapshot);
        let owner = cache.owner_of(request.caller.as_deref());
        let key = Key::new(&fp, request_hash, &request.resource, generation, owner);
        let hash = cache.hash(&key);
        if let Some(hit) = cache.get(&key, hash, snapshot, None, None) {
            cache.hits.fetch_add(1, Ordering::Relaxed);
            return hit;
        }
        cache.misses.fetch_add(1, Ordering::Relaxed);
        let prepared = match self.prepare(snapshot, request) {
            Ok(p) => p,
            // A malformed request is not remembered: it is refused as fast as it
            // would be found.
            Err(denied) => return Arc::new(*denied),
        };
        let mut deps = absent(&prepared);
        let decision = Arc::new(self.decide_prepared(
            snapshot,
            request,
            &prepared,
            &request.resource,
            Some(&mut deps),
        ));
        let stored = if interned {
            Some(fp)
        } else {
            cache.intern_arc(fp)
        };
        if let Some(fp) = stored {
            let key = Key::new(&fp, request_hash, &request.resource, generation, owner);
            cache.put(&key, hash, deps, Arc::clone(&decision));
        }
        decision
    }
}

/// The request's own entities as dependencies on their absence from the store: a
/// request may only add what the store does not hold, so an answer stands only while
/// the store still holds none of them.
pub(super) fn absent(prepared: &crate::engine::Prepared) -> Vec<Dependency> {
    prepared
        .own_entities()
        .map(|uid| Dependency {
            uid: uid.clone(),
            version: None,
        })
        .collect()
}
