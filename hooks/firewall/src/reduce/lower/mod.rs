//! nft rules and iptables rules, lowered to the shared program ([`super::ir`]).
//!
//! Every condition that cannot be judged becomes [`Cond::Unknown`] with a text that says
//! what it was, never an error: the evaluation decides which way an unknown may go.

mod describe;
mod from_iptables;
mod from_nft;
mod terms;

use super::ir::Chain;
#[cfg(doc)]
use super::ir::Cond;
use crate::iptables;
use crate::nft;

pub(crate) use describe::describe_rule;
pub(crate) use from_iptables::iptables_table;
pub(crate) use from_nft::nft_table;

/// Chains lowered for one table; `names[i]` is chain `i`.
pub(crate) struct LoweredTable {
    pub(crate) names: Vec<String>,
    pub(crate) chains: Vec<Chain>,
}

impl LoweredTable {
    pub(crate) fn index(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }
}

/// The rule an IR rule came from, described only when a report needs it.
#[derive(Clone, Copy)]
pub(crate) enum Origin<'a> {
    Nft(&'a nft::Rule),
    Iptables(&'a iptables::Rule),
}

impl Origin<'_> {
    pub(crate) fn chain(&self) -> &str {
        match self {
            Origin::Nft(r) => &r.chain,
            Origin::Iptables(r) => &r.chain,
        }
    }

    pub(crate) fn handle(&self) -> Option<u64> {
        match self {
            Origin::Nft(r) => r.handle,
            Origin::Iptables(_) => None,
        }
    }

    pub(crate) fn line(&self) -> Option<usize> {
        match self {
            Origin::Nft(_) => None,
            Origin::Iptables(r) => Some(r.line),
        }
    }

    pub(crate) fn text(&self) -> String {
        match self {
            Origin::Nft(r) => describe_rule(r),
            Origin::Iptables(r) => r.text.clone(),
        }
    }
}
