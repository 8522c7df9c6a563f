//! Probity's firewall view of a node: which inbound ports a remote host can actually
//! reach, judged against a baseline, and the baseline enforced.
//!
//! Why this crate exists: a GPU node's exposure is decided by whatever nftables and
//! iptables rules are loaded, by any tool, in any table. The node agent reads them
//! ([`source`]), parses them as untrusted bytes ([`nft`], [`iptables`]), reduces them to
//! the ports a NEW connection from another host gets through to ([`reduce()`]), compares
//! that with the baseline of the node's role ([`baseline::check`]), and, in enforce mode
//! only, loads the baseline as an nftables table of its own ([`baseline::render`],
//! [`apply::apply`]) without ever cutting off SSH or the agent's control plane.
//!
//! The crate does not depend on the engine: the lead maps configuration to a
//! [`baseline::Baseline`] and findings to entities.
//!
//! Invariants:
//! - the reduction never reports less than is reachable: what it cannot decide counts as
//!   reachable and is listed as an [`Uncertainty`];
//! - parsers never panic, refuse input over their size limit, and locate their errors;
//! - [`apply::apply`] changes nothing unless told to enforce, and refuses a ruleset that
//!   would drop the given SSH ports or the control-plane connection unless the override
//!   [`apply::ApplyOptions::dangerously_allow_lockout`] is set;
//! - commands run without a shell, with a timeout and an output cap.

pub mod apply;
pub mod baseline;
pub mod iptables;
mod net;
pub mod nft;
mod reduce;
pub mod source;
mod space;

pub use net::{Family, PortRange, PortRangeError, Prefix, PrefixError, Protocol};
pub use reduce::{
    Effect, Exposure, Filter, Inputs, Note, Reachability, ReachablePorts, ReachableRange, RuleRef,
    Uncertainty, reduce,
};
