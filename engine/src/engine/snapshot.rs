//! The live snapshot and how writers replace it: one queue, one leader applying
//! every queued write in one new snapshot.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use cedar_policy_core::ast::{self, EntityUID};

use super::Engine;
use crate::block::BlockRecord;
use crate::bundle::Bundle;
use crate::error::EntityError;
use crate::plugin::PluginEntities;
use crate::slice::{BaseSlices, OwnedEntities, RequestEntities, SliceSource};
use crate::store::{self, Store};

pub(crate) struct Snapshot {
    pub bundle: Arc<Bundle>,
    pub store: Store,
    /// The entities the engine owns, materialized once (they change only with the
    /// configuration or the server's caller list).
    pub owned: Arc<OwnedEntities>,
    pub blocked: Arc<BTreeMap<String, BlockRecord>>,
    /// The same entities as plugins see them, with their JSON cached.
    pub plugin_entities: Arc<PluginEntities>,
    /// What the cluster supplied of each shared entity ([`ClusterFacts`]).
    pub cluster: Arc<ClusterFacts>,
    /// Slices' stored parts cut in this snapshot, for reuse.
    pub bases: BaseSlices,
}

/// The attributes the cluster supplied, per entity: the stored entity holds them too
/// (merged with its other sources' attributes); this map says which are the cluster's,
/// so that another write may not contradict them and the cluster's next write replaces
/// exactly these.
pub(crate) type ClusterFacts = HashMap<EntityUID, Box<[(store::AttrId, ast::Value)]>>;

impl Snapshot {
    pub(super) fn new(
        bundle: Arc<Bundle>,
        store: Store,
        owned: Arc<OwnedEntities>,
        blocked: Arc<BTreeMap<String, BlockRecord>>,
    ) -> Self {
        let plugin_entities = Arc::new(PluginEntities::new(
            store.clone(),
            Arc::clone(&blocked),
            bundle.blocklist_target(),
        ));
        Self {
            bundle,
            store,
            owned,
            blocked,
            plugin_entities,
            cluster: Arc::default(),
            bases: BaseSlices::default(),
        }
    }

    /// The slice source for a request with `extra` entities of its own.
    pub(super) fn slicer<'a>(&'a self, extra: &'a RequestEntities) -> SliceSource<'a> {
        SliceSource {
            store: &self.store,
            owned: &self.owned,
            extra,
            blocked: &self.blocked,
            blocklist: self.bundle.blocklist.as_ref().map(|(t, a)| (t, a)),
            actions: &self.bundle.action_entities,
            bases: Some(&self.bases),
        }
    }

    /// Whether `id` names a blocked entity of the blocklist's type.
    pub(super) fn blocked_view(&self, uid: &EntityUID) -> Option<(&smol_str::SmolStr, bool)> {
        let (ty, attr) = self.bundle.blocklist.as_ref()?;
        if uid.entity_type() != ty {
            return None;
        }
        let id: &str = uid.eid().as_ref();
        Some((attr, self.blocked.contains_key(id)))
    }
}

/// What a write works on: the next snapshot's parts.
#[derive(Clone)]
pub(super) struct Working {
    pub(super) bundle: Arc<Bundle>,
    pub(super) store: Store,
    pub(super) owned: Arc<OwnedEntities>,
    pub(super) blocked: Arc<BTreeMap<String, BlockRecord>>,
    pub(super) cluster: Arc<ClusterFacts>,
    pub(super) changed: bool,
}

pub(super) type WriteOp = Box<dyn FnOnce(&mut Working) -> Result<usize, EntityError> + Send>;

/// Writers queue here; one of them applies the queue in one snapshot.
#[derive(Default)]
pub(super) struct Writes {
    pub(super) state: Mutex<WriteState>,
    pub(super) done: Condvar,
}

#[derive(Default)]
pub(super) struct WriteState {
    pub(super) queue: Vec<(u64, WriteOp)>,
    pub(super) finished: HashMap<u64, Result<usize, EntityError>>,
    pub(super) next: u64,
    pub(super) busy: bool,
    /// Writers waiting on `done`: with none, a commit makes no wake-up call.
    pub(super) waiting: usize,
}

impl Engine {
    /// Applies `op` with every other queued write in one new snapshot.
    pub(super) fn write(&self, op: WriteOp) -> Result<usize, EntityError> {
        let writes = &self.shared.writes;
        let mut st = writes.state.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = st.next;
        st.next = st.next.wrapping_add(1);
        st.queue.push((ticket, op));
        loop {
            if let Some(result) = st.finished.remove(&ticket) {
                return result;
            }
            if st.busy {
                st.waiting += 1;
                st = writes.done.wait(st).unwrap_or_else(PoisonError::into_inner);
                st.waiting -= 1;
                continue;
            }
            st.busy = true;
            let batch = std::mem::take(&mut st.queue);
            drop(st);
            let results = {
                // Clears `busy` even if a write panics, and then answers the batch's other
                // writers, so none is stranded or left leading empty batches.
                let others = batch.iter().map(|(t, _)| *t).filter(|t| *t != ticket);
                let _busy = BusyGuard {
                    writes,
                    batch: others.collect(),
                };
                self.apply(batch)
            };
            st = writes.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.finished.extend(results);
            if st.waiting > 0 {
                writes.done.notify_all();
            }
        }
    }

    pub(super) fn apply(
        &self,
        batch: Vec<(u64, WriteOp)>,
    ) -> Vec<(u64, Result<usize, EntityError>)> {
        let current = self.shared.current.load_full();
        let mut w = Working {
            bundle: Arc::clone(&current.bundle),
            store: current.store.clone(),
            owned: Arc::clone(&current.owned),
            blocked: Arc::clone(&current.blocked),
            cluster: Arc::clone(&current.cluster),
            changed: false,
        };
        let mut results = Vec::with_capacity(batch.len());
        for (ticket, op) in batch {
            let before = w.clone();
            let result = op(&mut w);
            if result.is_err() {
                // A refused write changes nothing, whatever it did before failing.
                w = before;
            }
            results.push((ticket, result));
        }
        if w.changed {
            let mut next = Snapshot::new(w.bundle, w.store, w.owned, w.blocked);
            next.cluster = w.cluster;
            self.shared.current.store(Arc::new(next));
        }
        results
    }
}

/// The write queue's leader while it applies a batch.
pub(super) struct BusyGuard<'a> {
    pub(super) writes: &'a Writes,
    /// The other writers' tickets in the batch.
    pub(super) batch: Vec<u64>,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        let mut st = self
            .writes
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        st.busy = false;
        if std::thread::panicking() {
            // The batch's commit will not come: its writers get an error, not a wait.
            for ticket in self.batch.drain(..) {
                st.finished.insert(
                    ticket,
                    Err(EntityError::Invalid {
                        detail: "the engine failed while applying this write's batch; the live snapshot did not change".into(),
                    }),
                );
            }
            if st.waiting > 0 {
                self.writes.done.notify_all();
            }
        }
    }
}

/// The owned entities of `store`, materialized for slices.
pub(super) fn owned_cache(bundle: &Bundle, store: &Store) -> OwnedEntities {
    store
        .iter()
        .filter(|(u, _)| {
            bundle
                .origins
                .owner_of(&u.entity_type().to_string())
                .is_some()
        })
        .map(|(u, s)| {
            let ancestors = store.ancestors(&s.parents, &RequestEntities::default());
            let entity = Arc::new(store::materialize(&u, s, ancestors, None));
            (u, entity)
        })
        .collect()
}
