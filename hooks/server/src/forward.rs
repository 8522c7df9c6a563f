//! Forwarding the hash-chained audit logs to a SIEM (`[siem]`), at least once.
//!
//! The sources over the engine's logs and the forwarder per log are
//! `probity_siem::engine`'s, shared with the node agent; the server starts them in
//! `server.rs` (cursors in the state directory), reports their counters in `/metrics`
//! and `/readyz`, and keeps undelivered decisions from retention.

pub use probity_siem::engine::{DECISIONS_CURSOR, EVENTS_CURSOR, Forwarders, Log};
