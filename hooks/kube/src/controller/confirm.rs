//! The blocklist as a pass may act on it: Probity's answer can lag (a replica behind, a
//! process just restarted), so an absence and a stale record are believed only once
//! several answers in a row agree. Shared by every cluster manager's controller.

use std::collections::BTreeMap;

use super::plan::{BlockMark, ControlState, drop_lifted};
use super::source::Blocklist;

/// Answers in a row that confirm an absence (before a release) or a stale block (before
/// it is taken as the truth).
pub const CONFIRM_PASSES: u32 = 3;

/// Per node, the answers in a row without its block, and with a stale one.
#[derive(Debug, Default)]
pub struct Confirmations {
    absent: BTreeMap<String, u32>,
    stale: BTreeMap<String, u32>,
}

impl Confirmations {
    /// The blocklist as the plan may act on it. Probity's answer can lag (a replica
    /// behind, a process just restarted): a node Probity set a taint on is released only
    /// once its block has been absent from [`CONFIRM_PASSES`] answers in a row, and a
    /// block not newer than the node's last release (stale, for a tombstone) is never
    /// acted on if Probity's store numbered it, and is taken as the truth once it has
    /// been in that many answers in a row if it is ordered by its time only.
    ///
    /// A block Probity's own store has lifted since (its revision not above the
    /// node's tombstone in the same answer: Probity's memory lags its store) counts as
    /// absent.
    pub fn confirm(
        &mut self,
        answered: Blocklist,
        state: &mut ControlState,
    ) -> BTreeMap<String, BlockMark> {
        let Blocklist {
            mut blocks,
            tombstones,
        } = answered;
        for node in drop_lifted(&mut blocks, &tombstones) {
            tracing::info!(%node, "a block record Probity's store has since lifted is not acted on");
        }
        let Confirmations { absent, stale } = self;
        // Counters of nodes Probity's answer holds again, or that are no longer
        // Probity's, start over.
        absent.retain(|node, _| state.applied.contains_key(node) && !blocks.contains_key(node));
        let mut held = Vec::new();
        for (node, mark) in &state.applied {
            if blocks.contains_key(node) {
                continue;
            }
            let count = absent.entry(node.clone()).or_default();
            *count += 1;
            if *count < CONFIRM_PASSES {
                held.push((node.clone(), mark.block.clone()));
            }
        }
        blocks.extend(held);
        for (node, block) in &blocks {
            let Some(&released) = state.tombstones.get(node) else {
                continue;
            };
            // A block Probity's store numbered is ordered exactly: one not above the
            // last release is a replay (a restored backup, a lagging answer), however
            // often it is answered. Only a block ordered by its time is believed after
            // enough answers (clocks disagree).
            if block.since > released || block.revision.is_some() {
                continue;
            }
            let count = stale.entry(node.clone()).or_default();
            *count += 1;
            if *count >= CONFIRM_PASSES {
                state.tombstones.remove(node);
            }
        }
        stale.retain(|node, _| state.tombstones.contains_key(node) && blocks.contains_key(node));
        blocks
    }
}
