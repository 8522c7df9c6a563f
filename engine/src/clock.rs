//! The engine's clock: the time of a decision is a fact the engine owns.
//!
//! Rules such as "a key older than 90 days may not encrypt" judge time; if the caller
//! said what time it was, a caller could make any key young. So the schema marks such
//! context attributes `@owned("clock")` and the engine fills them from its [`Clock`].
//! Tests inject a [`ManualClock`] instead of sleeping. The clock itself is
//! `probity-base`'s, the one every Probity crate reads.

pub use probity_base::clock::{Clock, ManualClock, SystemClock};
