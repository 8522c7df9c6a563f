//! The circuit breaker: how many nodes the controller may newly block per window.
//!
//! The worst bugs of node-remediation tools came from acting at scale on one bad input
//! (a drain of every node after one misconfiguration). So a block is admitted only
//! while the window holds fewer than `max_nodes` new blocks in all and, in every pool
//! the node belongs to (a zone, a GPU model), fewer than `max_percent` of that pool's
//! nodes (at least one per pool, so a lone node can still be blocked). The first block
//! past a limit trips the breaker; a tripped breaker admits nothing until an operator
//! resets it (`probity controller reset`). Releases are never limited: they undo.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The breaker's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerLimits {
    /// Most nodes newly blocked per window, in all.
    pub max_nodes: usize,
    /// Most nodes newly blocked per window in one pool, as a percentage of its nodes.
    pub max_percent: u8,
    /// The window, in seconds.
    pub window_secs: u64,
}

impl Default for BreakerLimits {
    fn default() -> Self {
        Self {
            max_nodes: 10,
            max_percent: 10,
            window_secs: 600,
        }
    }
}

/// A pool a node belongs to: a label and its value on the node.
pub type Pool = (String, String);

/// One block the breaker admitted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admitted {
    /// The node.
    pub node: String,
    /// When, in Unix seconds.
    pub at: u64,
    /// The pools it belonged to then.
    #[serde(default)]
    pub pools: Vec<Pool>,
}

/// Why the breaker tripped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trip {
    /// When, in Unix seconds.
    pub at: u64,
    /// The limit that was reached, in words.
    pub reason: String,
    /// The block it refused.
    pub node: String,
}

/// What the breaker remembers (kept in shared state, so a failover keeps it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakerState {
    /// Set once a limit was reached; cleared only by a reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tripped: Option<Trip>,
    /// The blocks admitted within the last window.
    #[serde(default)]
    pub admitted: Vec<Admitted>,
}

impl BreakerState {
    /// Admits one more block of `node`, or trips. `pool_sizes` counts the cluster's
    /// nodes per pool.
    pub fn admit(
        &mut self,
        limits: &BreakerLimits,
        node: &str,
        pools: &[Pool],
        pool_sizes: &BTreeMap<Pool, usize>,
        now: u64,
    ) -> Result<(), Trip> {
        if let Some(trip) = &self.tripped {
            return Err(trip.clone());
        }
        let horizon = now.saturating_sub(limits.window_secs);
        self.admitted.retain(|a| a.at > horizon);
        // A node admitted in this window and asked again (its taint failed, or the node
        // cache has not seen it yet) is the same block, not a new one.
        if self.admitted.iter().any(|a| a.node == node) {
            return Ok(());
        }
        let refuse = |reason: String| Trip {
            at: now,
            reason,
            node: node.to_owned(),
        };
        let outcome = if self.admitted.len() >= limits.max_nodes {
            Err(refuse(format!(
                "{} nodes already blocked within {} s (limit {})",
                self.admitted.len(),
                limits.window_secs,
                limits.max_nodes
            )))
        } else {
            pools
                .iter()
                .find_map(|pool| {
                    let size = pool_sizes.get(pool).copied().unwrap_or(1);
                    let allowed = (size * usize::from(limits.max_percent) / 100).max(1);
                    let used = self
                        .admitted
                        .iter()
                        .filter(|a| a.pools.contains(pool))
                        .count();
                    (used >= allowed).then(|| {
                        refuse(format!(
                            "{used} of the {size} nodes with {}={} already blocked within {} s \
                             (limit {}%, {allowed} nodes)",
                            pool.0, pool.1, limits.window_secs, limits.max_percent
                        ))
                    })
                })
                .map_or(Ok(()), Err)
        };
        match outcome {
            Ok(()) => {
                self.admitted.push(Admitted {
                    node: node.to_owned(),
                    at: now,
                    pools: pools.to_vec(),
                });
                Ok(())
            }
            Err(trip) => {
                self.tripped = Some(trip.clone());
                Err(trip)
            }
        }
    }

    /// An operator's reset: untripped, and a fresh window.
    pub fn reset(&mut self) {
        *self = BreakerState::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zone(z: &str) -> Pool {
        ("zone".into(), z.into())
    }

    #[test]
    fn trips_at_the_node_limit_and_stays_tripped() {
        let limits = BreakerLimits {
            max_nodes: 2,
            max_percent: 100,
            window_secs: 60,
        };
        let mut state = BreakerState::default();
        let sizes = BTreeMap::new();
        assert!(state.admit(&limits, "a", &[], &sizes, 100).is_ok());
        assert!(state.admit(&limits, "b", &[], &sizes, 101).is_ok());
        let trip = state.admit(&limits, "c", &[], &sizes, 102).unwrap_err();
        assert_eq!(trip.node, "c");
        assert!(trip.reason.contains("limit 2"), "{}", trip.reason);
        // Past the window it stays tripped: only a reset clears it.
        assert_eq!(
            state.admit(&limits, "d", &[], &sizes, 10_000).unwrap_err(),
            trip
        );
        state.reset();
        assert!(state.admit(&limits, "d", &[], &sizes, 10_000).is_ok());
    }

    #[test]
    fn a_node_asked_again_within_the_window_is_counted_once() {
        let limits = BreakerLimits {
            max_nodes: 1,
            max_percent: 100,
            window_secs: 60,
        };
        let mut state = BreakerState::default();
        let sizes = BTreeMap::new();
        for at in 100..110 {
            assert!(state.admit(&limits, "a", &[], &sizes, at).is_ok());
        }
        assert_eq!(state.admitted.len(), 1);
        assert!(state.admit(&limits, "b", &[], &sizes, 111).is_err());
    }

    #[test]
    fn the_window_forgets_old_blocks() {
        let limits = BreakerLimits {
            max_nodes: 1,
            max_percent: 100,
            window_secs: 60,
        };
        let mut state = BreakerState::default();
        let sizes = BTreeMap::new();
        assert!(state.admit(&limits, "a", &[], &sizes, 100).is_ok());
        assert!(state.admit(&limits, "b", &[], &sizes, 161).is_ok());
        assert_eq!(state.admitted.len(), 1);
    }

    #[test]
    fn a_pool_limit_is_a_share_of_the_pool_but_at_least_one_node() {
        let limits = BreakerLimits {
            max_nodes: 100,
            max_percent: 20,
            window_secs: 60,
        };
        let sizes = BTreeMap::from([(zone("a"), 10), (zone("b"), 2)]);
        let mut state = BreakerState::default();
        assert!(state.admit(&limits, "a1", &[zone("a")], &sizes, 1).is_ok());
        assert!(state.admit(&limits, "a2", &[zone("a")], &sizes, 1).is_ok());
        // Zone b is another pool: its one allowed node is still free.
        assert!(state.admit(&limits, "b1", &[zone("b")], &sizes, 1).is_ok());
        let trip = state
            .admit(&limits, "a3", &[zone("a")], &sizes, 1)
            .unwrap_err();
        assert!(trip.reason.contains("zone=a"), "{}", trip.reason);
        assert!(trip.reason.contains("2 nodes"), "{}", trip.reason);
    }
}
