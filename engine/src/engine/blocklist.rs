//! Blocking and unblocking nodes: durable first, then in memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::Engine;
use super::snapshot::Working;
use crate::block::{BlockRecord, ReaderPod};
use crate::error::EntityError;

impl Engine {
    /// Blocks a node: every decision about it is denied (the policies see its
    /// `blocked` attribute, even before any fact about it arrived), and only
    /// [`Engine::unblock_node`] lifts it. Blocking a blocked node keeps the first
    /// reason and time and adds this one to the record's history. With a state store
    /// attached, the block is durable before it takes effect in memory, and both
    /// happen in one write, so memory never disagrees with the store.
    ///
    /// With a shared store (etcd), the block is written there and takes effect here
    /// when this engine's watch applies it, in the store's order with every other
    /// process's writes; the call waits for that (the backend's read-your-writes bound,
    /// 5 s by default). If the write fails, nothing changes here and the error is
    /// returned. If the write lands but the watch lags past the bound, the block takes
    /// effect here at once (it is in the store; the watch delivers it again, in order).
    pub fn block_node(&self, node_id: &str, reason: &str) -> Result<(), EntityError> {
        self.block_node_for(node_id, BlockCause::plain(reason))
    }

    fn block_node_for(&self, node_id: &str, cause: BlockCause) -> Result<(), EntityError> {
        validate_node_id(node_id)?;
        if let Some(state) = self.shared_state() {
            let record = self.block_record(node_id, cause);
            let revision = state
                .put_block_at(node_id, &record)
                .map_err(EntityError::State)?;
            return match revision.map(|r| state.await_applied(r)) {
                Some(Ok(())) => Ok(()),
                Some(Err(crate::state::StateError::NotYetApplied { .. })) | None => {
                    self.set_blocked(node_id, Some(record))
                }
                Some(Err(e)) => Err(EntityError::State(e)),
            };
        }
        let node = node_id.to_owned();
        let state = self.shared.state.get().cloned();
        let now = u64::try_from(self.shared.clock.now_unix()).unwrap_or(0);
        self.write(Box::new(move |w: &mut Working| {
            let mut record = cause.record(w.blocked.get(&node), now);
            if let Some(state) = &state {
                record.revision = state
                    .put_block(&node, &record)
                    .map_err(EntityError::State)?;
            }
            let mut map = BTreeMap::clone(&w.blocked);
            map.insert(node, record);
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(1)
        }))
        .map(|_| ())
    }

    /// Blocks a node here at once, whatever the shared store can take now: for a node
    /// that failed verification, whose block must not wait for the network. With a
    /// shared store the block is in force in this engine before this returns, flagged
    /// as not yet shared ([`crate::state::SharedState::unshared_blocks`]), and the backend writes it
    /// in the background, retrying until it lands (it keeps the queue in its state
    /// directory, so a restart does not lose it); until then every change the watch
    /// applies leaves it in force. Without a shared store this is
    /// [`Engine::block_node`].
    pub fn block_node_now(&self, node_id: &str, reason: &str) -> Result<(), EntityError> {
        self.block_node_now_for(node_id, BlockCause::plain(reason))
    }

    /// [`Engine::block_node_now`] for a block with a known reader pod, stop scope and
    /// taint effect (a failed verified read's).
    pub(crate) fn block_node_now_for(
        &self,
        node_id: &str,
        cause: BlockCause,
    ) -> Result<(), EntityError> {
        validate_node_id(node_id)?;
        let Some(state) = self.shared_state() else {
            return self.block_node_for(node_id, cause);
        };
        let record = self.block_record(node_id, cause);
        // Queued first, so that a watch change applied between the two steps keeps it.
        let queued = state.queue_block(node_id, &record);
        self.set_blocked(node_id, Some(record))?;
        queued.map_err(EntityError::State)
    }

    /// Lifts a block set by [`Engine::block_node`]; durable first, like a block. With
    /// a shared store, the call waits until this engine's watch has applied the
    /// unblock; past the bound it returns [`crate::state::StateError::NotYetApplied`]
    /// and the node stays blocked here until the watch catches up (failing closed). A
    /// block that never reached the shared store is dropped from its queue.
    pub fn unblock_node(&self, node_id: &str) -> Result<(), EntityError> {
        validate_node_id(node_id)?;
        if let Some(state) = self.shared_state() {
            let (existed, revision) = state.unblock_node_at(node_id).map_err(EntityError::State)?;
            return match revision.filter(|_| existed) {
                Some(r) => state.await_applied(r).map_err(EntityError::State),
                // Not in the shared store: at most an unshared block of this process.
                None => self.set_blocked(node_id, None),
            };
        }
        let node = node_id.to_owned();
        let state = self.shared.state.get().cloned();
        self.write(Box::new(move |w: &mut Working| {
            if let Some(state) = &state {
                state.unblock_node(&node).map_err(EntityError::State)?;
            }
            let mut map = BTreeMap::clone(&w.blocked);
            map.remove(&node);
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(1)
        }))
        .map(|_| ())
    }

    /// The record a block of `node` gets now: a new one, or the node's current record
    /// with this block in its history.
    pub(super) fn block_record(&self, node: &str, cause: BlockCause) -> BlockRecord {
        let now = u64::try_from(self.shared.clock.now_unix()).unwrap_or(0);
        cause.record(self.shared.current.load().blocked.get(node), now)
    }

    /// Sets (`Some`) or lifts (`None`) a block in memory only.
    pub(super) fn set_blocked(
        &self,
        node: &str,
        record: Option<BlockRecord>,
    ) -> Result<(), EntityError> {
        let node = node.to_owned();
        self.write(Box::new(move |w: &mut Working| {
            let mut map = BTreeMap::clone(&w.blocked);
            match record {
                Some(r) => {
                    map.insert(node, r);
                }
                None => {
                    map.remove(&node);
                }
            }
            w.blocked = Arc::new(map);
            w.changed = true;
            Ok(1)
        }))
        .map(|_| ())
    }

    /// The blocked nodes and why.
    pub fn blocked_nodes(&self) -> BTreeMap<String, BlockRecord> {
        BTreeMap::clone(&self.shared.current.load().blocked)
    }

    /// Per node, the revision of its last unblock in the state store
    /// ([`crate::state::SharedState::block_tombstones`]); empty without a store.
    pub fn block_tombstones(&self) -> Result<BTreeMap<String, u64>, EntityError> {
        match self.shared.state.get() {
            Some(state) => state.block_tombstones().map_err(EntityError::State),
            None => Ok(BTreeMap::new()),
        }
    }

    /// The entity type the blocklist blocks (the schema's `@owned("blocklist")`
    /// attribute's type, `Node` by default), if the schema declares one.
    pub fn blocklist_type(&self) -> Option<String> {
        self.shared
            .current
            .load()
            .bundle
            .blocklist_target()
            .map(|(t, _)| t)
    }

    /// The names the engine acts on, as the live schema declares them.
    pub fn conventions(&self) -> Arc<crate::conventions::Conventions> {
        Arc::clone(&self.shared.current.load().bundle.conventions)
    }
}

/// What one block says: why, and for a failed read, who read and what must stop.
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockCause {
    pub reason: String,
    pub reader: Option<ReaderPod>,
    pub stop: Option<String>,
    pub taint_effect: Option<String>,
}

impl BlockCause {
    fn plain(reason: &str) -> Self {
        Self {
            reason: reason.to_owned(),
            ..Self::default()
        }
    }

    /// The record after this block: a new one, or `existing` (whose first block's
    /// fields stay) with this block in its history.
    fn record(self, existing: Option<&BlockRecord>, now: u64) -> BlockRecord {
        match existing {
            Some(existing) => existing
                .clone()
                .blocked_again_by(self.reason, now, self.reader),
            None => BlockRecord::new(self.reason, now).with_stop(
                self.reader,
                self.stop,
                self.taint_effect,
            ),
        }
    }
}

/// A node id: what Kubernetes allows in a node name (a DNS subdomain), plus `_` and
/// upper case, 1 to 253 bytes. Anything else (an empty id, a `Node::"x"` uid, quotes,
/// spaces, control characters) is refused, so a typo cannot block a node that does
/// not exist under that name.
pub(crate) fn validate_node_id(id: &str) -> Result<(), EntityError> {
    let ok = !id.is_empty()
        && id.len() <= 253
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && !id.starts_with(['-', '.'])
        && !id.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(EntityError::NodeId {
            id: truncate_id(id),
        })
    }
}

pub(super) fn truncate_id(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", s.get(..i).unwrap_or(s)),
        None => s.to_owned(),
    }
}
