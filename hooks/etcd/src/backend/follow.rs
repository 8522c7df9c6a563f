//! The watch handlers: etcd's events under each prefix a process follows, translated to
//! the engine's [`StateChange`]s in revision order.
//!
//! Why this module exists: the engine knows nothing of etcd; it applies `StateChange`s. Each
//! handler runs on its watch's own thread (probity-etcd's [`crate::WatchHandler`]), turns
//! a snapshot into a resync (the whole blocklist, facts that appeared and facts that went)
//! and events into changes, and hands them to the engine's follower through one bounded
//! channel, so a slow follower holds the watch back instead of losing a change.
//!
//! Fail closed on what cannot be read: a `blocklist/<node>` key whose record does not
//! decode still blocks its node (with a reason that says so); facts that do not decode
//! count as gone (the node's telemetry becomes stale).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::mpsc::SyncSender;

use probity::BlockRecord;
use probity::state::{BlockedNode, ChangeBatch, StateChange};

use super::Core;
use super::records::{
    BLOCKLIST, CLUSTER, FACTS, REGISTRY, decode_block, decode_cluster_entity, decode_facts,
    decode_registry,
};
use crate::{Entry, Snapshot, WatchEvent, WatchHandler};

/// Follows `blocklist/`: every batch is acknowledged with its revision once the engine
/// applied it (read-your-writes).
pub(super) struct BlocklistHandler {
    pub(super) tx: SyncSender<ChangeBatch>,
    pub(super) core: Arc<Core>,
}

impl BlocklistHandler {
    fn send(&self, changes: Vec<StateChange>, revision: i64) {
        let core = Arc::clone(&self.core);
        let batch = ChangeBatch::with_ack(changes, move || core.applied_to(revision));
        if let Err(unsent) = self.tx.send(batch) {
            // Nobody follows any more: the writes it would have applied are not waited for.
            unsent.0.acknowledge();
        }
    }
}

impl WatchHandler for BlocklistHandler {
    fn reset(&mut self, snapshot: Snapshot) {
        let all = snapshot.entries.iter().filter_map(blocked_node).collect();
        self.send(vec![StateChange::Resync(all)], snapshot.revision);
    }

    fn apply(&mut self, events: Vec<WatchEvent>, revision: i64) {
        let changes = events
            .into_iter()
            .filter_map(|event| match event {
                WatchEvent::Put { entry, .. } => blocked_node(&entry).map(StateChange::Blocked),
                WatchEvent::Delete { key, .. } => key
                    .strip_prefix(BLOCKLIST)
                    .filter(|n| !n.is_empty())
                    .map(|n| StateChange::Unblocked(n.to_owned())),
            })
            .collect();
        self.send(changes, revision);
    }
}

/// The blocked node a `blocklist/` entry stands for. A record that does not decode still
/// blocks: the key's presence is the block.
pub(super) fn blocked_node(entry: &Entry) -> Option<BlockedNode> {
    let node = entry
        .key
        .strip_prefix(BLOCKLIST)
        .filter(|n| !n.is_empty())?;
    let record = decode_block(&entry.value).unwrap_or_else(|e| {
        tracing::error!(key = %entry.key, mod_revision = entry.mod_revision, error = %e,
            "unreadable block record in etcd; the node counts as blocked");
        BlockRecord::new(
            format!(
                "unreadable block record in etcd (mod revision {}): {e}",
                entry.mod_revision
            ),
            0,
        )
    });
    // etcd numbers the block, whatever the record says: a record copied from elsewhere
    // (a local store's outbox) carries that store's number.
    let record = BlockRecord {
        revision: u64::try_from(entry.create_revision).ok(),
        ..record
    };
    Some(BlockedNode {
        node: node.to_owned(),
        record,
    })
}

/// Follows `facts/` (a webhook: every node) or one node's `facts/<node>` (a sidecar).
pub(super) struct FactsHandler {
    pub(super) tx: SyncSender<ChangeBatch>,
    /// The one node followed, if any (a prefix watch on `facts/n1` also sees `facts/n10`).
    pub(super) only: Option<String>,
    /// Nodes whose facts the engine was last given, to report those a resync finds gone.
    pub(super) known: BTreeSet<String>,
}

impl FactsHandler {
    fn node_of<'k>(&self, key: &'k str) -> Option<&'k str> {
        let node = key.strip_prefix(FACTS).filter(|n| !n.is_empty())?;
        match &self.only {
            Some(only) if only != node => None,
            _ => Some(node),
        }
    }

    fn change(&mut self, node: &str, bytes: &[u8]) -> StateChange {
        match decode_facts(node, bytes) {
            Ok(facts) => {
                self.known.insert(node.to_owned());
                StateChange::Facts(facts)
            }
            Err(e) => {
                tracing::error!(node, error = %e, "unreadable node facts in etcd; the node's facts count as stale");
                self.known.remove(node);
                StateChange::FactsGone(node.to_owned())
            }
        }
    }

    fn send(&self, changes: Vec<StateChange>) {
        if !changes.is_empty() {
            let _ = self.tx.send(ChangeBatch::new(changes));
        }
    }
}

impl WatchHandler for FactsHandler {
    fn reset(&mut self, snapshot: Snapshot) {
        let before = std::mem::take(&mut self.known);
        let mut changes = Vec::new();
        let mut present = BTreeSet::new();
        for entry in &snapshot.entries {
            if let Some(node) = self.node_of(&entry.key) {
                present.insert(node.to_owned());
                changes.push(self.change(node, &entry.value));
            }
        }
        changes.extend(
            before
                .difference(&present)
                .map(|node| StateChange::FactsGone(node.clone())),
        );
        self.send(changes);
    }

    fn apply(&mut self, events: Vec<WatchEvent>, _revision: i64) {
        let mut changes = Vec::new();
        for event in events {
            match event {
                WatchEvent::Put { entry, .. } => {
                    if let Some(node) = self.node_of(&entry.key) {
                        changes.push(self.change(node, &entry.value));
                    }
                }
                WatchEvent::Delete { key, .. } => {
                    if let Some(node) = self.node_of(&key) {
                        self.known.remove(node);
                        changes.push(StateChange::FactsGone(node.to_owned()));
                    }
                }
            }
        }
        self.send(changes);
    }
}

/// Follows `cluster/`: the whole set of the cluster's facts is handed to the engine
/// whenever it changes (the engine applies it as a full replace). A record that does
/// not decode is left out: its node is then as unknown as before the cluster spoke of
/// it (closed: the extender filters an unknown node).
pub(super) struct ClusterHandler {
    pub(super) tx: SyncSender<ChangeBatch>,
    /// The set as last handed over, by entity id.
    pub(super) current: std::collections::BTreeMap<String, serde_json::Value>,
}

impl ClusterHandler {
    fn entity(entry: &Entry) -> Option<(String, serde_json::Value)> {
        let id = entry.key.strip_prefix(CLUSTER).filter(|n| !n.is_empty())?;
        match decode_cluster_entity(id, &entry.value) {
            Ok(entity) => Some((id.to_owned(), entity)),
            Err(e) => {
                tracing::error!(key = %entry.key, error = %e, "unreadable cluster facts in etcd; left out");
                None
            }
        }
    }

    fn send(&self) {
        let _ = self
            .tx
            .send(ChangeBatch::new(vec![StateChange::ClusterFacts(
                self.current.clone(),
            )]));
    }
}

impl WatchHandler for ClusterHandler {
    fn reset(&mut self, snapshot: Snapshot) {
        self.current = snapshot.entries.iter().filter_map(Self::entity).collect();
        self.send();
    }

    fn apply(&mut self, events: Vec<WatchEvent>, _revision: i64) {
        let before = self.current.clone();
        for event in events {
            match event {
                WatchEvent::Put { entry, .. } => {
                    let id = entry
                        .key
                        .strip_prefix(CLUSTER)
                        .unwrap_or_default()
                        .to_owned();
                    match Self::entity(&entry) {
                        Some((id, entity)) => {
                            self.current.insert(id, entity);
                        }
                        None => {
                            self.current.remove(&id);
                        }
                    }
                }
                WatchEvent::Delete { key, .. } => {
                    if let Some(id) = key.strip_prefix(CLUSTER) {
                        self.current.remove(id);
                    }
                }
            }
        }
        if self.current != before {
            self.send();
        }
    }
}

/// Follows `registry/` into the backend's mirror, which answers
/// [`probity::state::SharedState::check_version`] without a round trip.
pub(super) struct RegistryHandler {
    pub(super) core: Arc<Core>,
}

impl WatchHandler for RegistryHandler {
    fn reset(&mut self, snapshot: Snapshot) {
        let mut mirror = HashMap::new();
        for entry in &snapshot.entries {
            if let Some((id, head)) = registry_head(entry) {
                mirror.insert(id, head);
            }
        }
        self.core.set_registry_mirror(mirror);
    }

    fn apply(&mut self, events: Vec<WatchEvent>, _revision: i64) {
        for event in events {
            match event {
                WatchEvent::Put { entry, .. } => {
                    if let Some((id, head)) = registry_head(&entry) {
                        self.core.mirror_accepted(id, head);
                    }
                }
                WatchEvent::Delete { key, .. } => {
                    if let Some(id) = key.strip_prefix(REGISTRY) {
                        self.core.mirror_removed(id);
                    }
                }
            }
        }
    }
}

fn registry_head(entry: &Entry) -> Option<(String, (u64, [u8; 32]))> {
    let id = entry.key.strip_prefix(REGISTRY).filter(|i| !i.is_empty())?;
    match decode_registry(&entry.value) {
        Ok(e) => Some((id.to_owned(), (e.version, e.digest))),
        Err(e) => {
            // Left out of the mirror: the compare-and-swap that accepts a version reads
            // the record itself and refuses what it cannot read.
            tracing::error!(key = %entry.key, error = %e, "unreadable registry record in etcd");
            None
        }
    }
}
