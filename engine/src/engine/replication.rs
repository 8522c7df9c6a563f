//! Attaching a state backend: the durable blocklist, the decision log, and the
//! changes a shared backend reports, applied in its order.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cedar_policy_core::ast::{self, EntityUID};
use serde_json::Value;

use super::Engine;
use super::snapshot::Working;
use crate::decision_log::DecisionLog;
use crate::error::EntityError;
use crate::request::EntityUid;
use crate::state::{AttachedState, LocalLog, SharedState};
use crate::store::{self};

impl Engine {
    /// Makes blocks durable in `state`: the nodes it holds as blocked are blocked in the
    /// engine now, and every later block and unblock is written there first. From now
    /// on, decisions that deny or carry obligations are recorded in its decision log
    /// ([`LocalLog::decisions`]) before they are returned. Attach once; a second call
    /// is refused.
    ///
    /// In sealed mode ([`crate::EngineBuilder::sealed`]) the live set's seal version is checked
    /// against the one the store remembers first, and remembered: a set older than one
    /// this store saw loaded is refused ([`crate::state::StateError::Rollback`]) and
    /// nothing is attached.
    ///
    /// A shared backend ([`SharedState::is_shared`], etcd) is followed from then on:
    /// every change it reports ([`SharedState::changes`]: blocks and unblocks, this
    /// engine's own included, and node facts) is applied to the snapshot in the
    /// backend's order, on a thread of its own.
    ///
    /// `state` is what the cluster shares and this machine's logs
    /// ([`AttachedState`]); an `Arc<StateStore>` is both.
    pub fn attach_state(&self, state: impl Into<AttachedState>) -> Result<(), EntityError> {
        let AttachedState { shared: state, log } = state.into();
        if let Some(seal) = self.shared.current.load().bundle.seal.clone() {
            let id = seal.seal.registry_id();
            state
                .accept(&id, seal.seal.version(), &seal.digest, &seal.encoded)
                .map_err(EntityError::State)?;
        }
        let mut blocked = state.blocked_nodes().map_err(EntityError::State)?;
        // Blocks of an earlier run that never reached a shared store are in force.
        blocked.extend(state.unshared_blocks());
        // The log starts before the store counts as attached, so no decision made with
        // the store attached goes unrecorded; a losing second call drops (and joins)
        // its own log.
        let writer = DecisionLog::start(Arc::clone(&log)).map_err(EntityError::DecisionLog)?;
        if self.shared.decision_log.set(writer).is_err()
            || self.shared.state.set(Arc::clone(&state)).is_err()
            || self.shared.log.set(log).is_err()
        {
            return Err(EntityError::StateAlreadyAttached);
        }
        let changes = state.changes();
        let durable = Arc::clone(&state);
        self.write(Box::new(move |w: &mut Working| {
            // Blocks made before the store was attached become durable too, so memory
            // and the store agree from here on.
            let on_disk: std::collections::BTreeSet<&str> =
                blocked.iter().map(|b| b.node.as_str()).collect();
            let mut map = BTreeMap::clone(&w.blocked);
            for (node, record) in map.iter_mut() {
                if !on_disk.contains(node.as_str()) {
                    record.revision = durable
                        .put_block(node, record)
                        .map_err(EntityError::State)?;
                }
            }
            for node in blocked {
                map.insert(node.node.clone(), node.record);
            }
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(0)
        }))?;
        if let Some(rx) = changes {
            self.follow(rx).map_err(EntityError::DecisionLog)?;
        }
        Ok(())
    }

    /// Applies the changes a shared backend reports, batch by batch in its order, until
    /// the backend or the engine goes away.
    pub(super) fn follow(
        &self,
        rx: std::sync::mpsc::Receiver<crate::state::ChangeBatch>,
    ) -> std::io::Result<()> {
        let shared = Arc::downgrade(&self.shared);
        std::thread::Builder::new()
            .name("probity-state-changes".into())
            .spawn(move || {
                while let Ok(batch) = rx.recv() {
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    Engine { shared }.apply_changes(batch);
                }
            })
            .map(|_| ())
    }

    /// Applies one batch: its blocklist changes in one snapshot write (so decisions see
    /// the batch whole), then the last word on each node's facts; then tells the backend
    /// the batch is applied, which releases writers waiting to read their own writes.
    pub(super) fn apply_changes(&self, mut batch: crate::state::ChangeBatch) {
        use crate::state::StateChange;
        let mut blocklist = Vec::new();
        // The last whole set of the cluster's facts in the batch is the one in force.
        let mut cluster = None;
        // The last change per node wins: facts published then expired are gone.
        let mut facts: Vec<(String, Option<crate::state::NodeFacts>)> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        for change in std::mem::take(&mut batch.changes) {
            let (node, value) = match change {
                StateChange::Facts(f) => (f.node.clone(), Some(f)),
                StateChange::FactsGone(node) => (node, None),
                StateChange::ClusterFacts(all) => {
                    cluster = Some(all);
                    continue;
                }
                other => {
                    blocklist.push(other);
                    continue;
                }
            };
            match at.get(&node) {
                Some(&i) => {
                    if let Some(slot) = facts.get_mut(i) {
                        slot.1 = value;
                    }
                }
                None => {
                    at.insert(node.clone(), facts.len());
                    facts.push((node, value));
                }
            }
        }
        let mut problems = Vec::new();
        if !blocklist.is_empty() {
            let state = self.shared.state.get().cloned();
            let result = self.write(Box::new(move |w: &mut Working| {
                let mut map = BTreeMap::clone(&w.blocked);
                for change in blocklist {
                    match change {
                        StateChange::Blocked(b) => {
                            map.insert(b.node, b.record);
                        }
                        StateChange::Unblocked(node) => {
                            map.remove(&node);
                        }
                        StateChange::Resync(all) => {
                            map = all.into_iter().map(|b| (b.node, b.record)).collect();
                        }
                        StateChange::Facts(_)
                        | StateChange::FactsGone(_)
                        | StateChange::ClusterFacts(_) => {}
                    }
                }
                // A block not yet shared stays in force whatever the shared list says.
                // Read here, inside the write, so a block queued meanwhile is kept.
                for b in state.iter().flat_map(|s| s.unshared_blocks()) {
                    map.entry(b.node).or_insert(b.record);
                }
                w.blocked = Arc::new(map);
                w.changed = true;
                Ok(1)
            }));
            if let Err(e) = result {
                problems.push(format!("the blocklist: {e}"));
            }
        }
        if !facts.is_empty() {
            self.apply_facts(facts, &mut problems);
        }
        if let Some(all) = cluster {
            let entities = serde_json::Value::Array(all.into_values().collect());
            if let Err(e) = self.replace_cluster_facts(&entities) {
                problems.push(format!("the cluster's facts: {e}"));
            }
        }
        for p in problems {
            // The shared state is still right; this process's view of it lags until
            // the next change or resync. Say so where it is seen.
            eprintln!("probity: a change from the shared state could not be applied to {p}");
        }
        batch.acknowledge();
    }

    /// Upserts the nodes' published facts (one write for all of them, or node by node
    /// if one is refused, so one agent's bad facts hold back no other node's) and marks
    /// the nodes whose facts are gone.
    pub(super) fn apply_facts(
        &self,
        facts: Vec<(String, Option<crate::state::NodeFacts>)>,
        problems: &mut Vec<String>,
    ) {
        let node_type = self
            .shared
            .current
            .load()
            .bundle
            .blocklist
            .as_ref()
            .map(|(t, a)| (t.clone(), a.clone()));
        let mut published: Vec<(String, Vec<Value>)> = Vec::new();
        for (node, value) in facts {
            match value {
                Some(f) => match f.entities {
                    Value::Array(mut items) => {
                        // The blocklist owns `blocked`: an agent's claim is dropped, not
                        // allowed to hold back the node's other facts.
                        if let Some((ty, attr)) = &node_type {
                            for item in &mut items {
                                let of_type = item
                                    .get("uid")
                                    .and_then(|u| store::parse_uid(u).ok())
                                    .is_some_and(|u| u.entity_type() == ty);
                                if of_type
                                    && let Some(attrs) =
                                        item.get_mut("attrs").and_then(Value::as_object_mut)
                                {
                                    attrs.remove(attr.as_str());
                                }
                            }
                        }
                        published.push((node, items));
                    }
                    _ => {
                        problems.push(format!("the facts of {node}: not a JSON array"));
                        self.facts_refused(&node, problems);
                    }
                },
                None => {
                    if let Err(e) = self.mark_facts_gone(&node) {
                        problems.push(format!("the expiry of {node}'s facts: {e}"));
                    }
                }
            }
        }
        if published.is_empty() {
            return;
        }
        let all: Vec<Value> = published
            .iter()
            .flat_map(|(_, items)| items.iter().cloned())
            .collect();
        if self.upsert_items(&all).is_err() {
            for (node, items) in &published {
                if let Err(e) = self.upsert_items(items) {
                    problems.push(format!("the facts of {node}: {e}"));
                    self.facts_refused(node, problems);
                }
            }
        }
    }

    /// A node whose newest facts were refused (they contradict the cluster's, say): what
    /// the engine holds about it is no longer current, so it counts as stale, as if its
    /// agent had stopped publishing, rather than deciding on the facts before.
    fn facts_refused(&self, node: &str, problems: &mut Vec<String>) {
        if let Err(e) = self.mark_facts_gone(node) {
            problems.push(format!("the expiry of {node}'s refused facts: {e}"));
        }
    }

    /// A node's published facts expired (its agent stopped renewing them): what the
    /// store holds about it is no longer current. Unknown is a finding, so the node
    /// stays, with [`STALE_FACTS_SOURCE`](crate::state::STALE_FACTS_SOURCE) added to its `unreadable` sources: the
    /// policies then treat its telemetry as unreadable (`thermal.telemetry-unreadable`
    /// denies `comply` and `schedule`, with an alert), and every other rule still sees
    /// the node (its zone, its block). Removing it instead would make it merely absent,
    /// which admission can be configured to let through. A policy set whose node type
    /// has no `unreadable` attribute gets the node removed. Fresh facts replace the mark.
    pub(super) fn mark_facts_gone(&self, node: &str) -> Result<(), EntityError> {
        let snapshot = self.shared.current.load_full();
        let Some((ty, attr)) = snapshot.bundle.blocklist.clone() else {
            return Ok(());
        };
        let uid = EntityUID::from_components(ty, ast::Eid::new(node), None);
        let Some(stored) = snapshot.store.get(&uid) else {
            // Nothing is known about it: nothing claims to be current.
            return Ok(());
        };
        let mut json = store::to_json(&uid, stored, None);
        if let Some(attrs) = json.get_mut("attrs").and_then(Value::as_object_mut) {
            attrs.remove(attr.as_str());
            let mut sources = match attrs.get("unreadable") {
                Some(Value::Array(a)) => a.clone(),
                _ => Vec::new(),
            };
            if !sources
                .iter()
                .any(|s| s == crate::state::STALE_FACTS_SOURCE)
            {
                sources.push(Value::from(crate::state::STALE_FACTS_SOURCE));
            }
            attrs.insert("unreadable".into(), Value::Array(sources));
        }
        match self.upsert_items(std::slice::from_ref(&json)) {
            Ok(_) => Ok(()),
            Err(_) => self.remove_entities(&[EntityUid(uid.into())]),
        }
    }

    /// The attached shared state, if any.
    pub fn state(&self) -> Option<&Arc<dyn SharedState>> {
        self.shared.state.get()
    }

    /// This machine's decision and event logs, once state is attached.
    pub fn log(&self) -> Option<&Arc<dyn LocalLog>> {
        self.shared.log.get()
    }

    /// Both halves of the attached state, for what needs the two (verifying an object
    /// reads the shared registry and records failures in the local event log).
    pub fn attached(&self) -> Option<AttachedState> {
        Some(AttachedState::new(
            Arc::clone(self.shared.state.get()?),
            Arc::clone(self.shared.log.get()?),
        ))
    }

    /// The attached store, if it is shared between processes.
    pub(super) fn shared_state(&self) -> Option<Arc<dyn SharedState>> {
        self.shared.state.get().filter(|s| s.is_shared()).cloned()
    }
}
