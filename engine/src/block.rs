//! A blocked node's record: why, since when, and its later blocks.

/// Most earlier blocks a block record remembers.
const MAX_BLOCK_HISTORY: usize = 32;

/// Why a node is blocked, and since when.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockRecord {
    /// What blocked it first (a policy id, an operator's note).
    pub reason: String,
    /// When it was first blocked, in Unix seconds.
    pub since: u64,
    /// Later blocks of the node while it stayed blocked, oldest first (at most 32).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<BlockEvent>,
}

/// A block of an already blocked node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockEvent {
    /// Why.
    pub reason: String,
    /// When, in Unix seconds.
    pub at: u64,
}

impl BlockRecord {
    /// A new block.
    pub fn new(reason: impl Into<String>, since: u64) -> Self {
        Self {
            reason: reason.into(),
            since,
            history: Vec::new(),
        }
    }

    /// This record after another block: the first reason and time stay, the new one
    /// joins the history.
    pub fn blocked_again(mut self, reason: impl Into<String>, at: u64) -> Self {
        if self.history.len() >= MAX_BLOCK_HISTORY {
            self.history.remove(0);
        }
        self.history.push(BlockEvent {
            reason: reason.into(),
            at,
        });
        self
    }
}
