//! The kinds of change that make a remembered answer stale, and, for the differential
//! tests only (`bench-hooks`), a switch that makes one thread's lookups ignore one.

/// What makes a remembered answer stale, for the differential test that must fail
/// when one is not checked ([`skip_invalidation`]).
#[cfg(feature = "bench-hooks")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalidation {
    /// A stored entity the decision read changed.
    Facts,
    /// The policy set (its policies, modes, scopes, settings) was reloaded.
    PolicySet,
    /// The engine's own entities (settings, API callers) were replaced.
    OwnedEntities,
    /// A node was blocked or unblocked.
    Blocklist,
}

#[cfg(feature = "bench-hooks")]
thread_local! {
    static SKIPPED: std::cell::Cell<Option<Invalidation>> = const { std::cell::Cell::new(None) };
}

/// Makes this thread's cache lookups ignore one kind of change (`None`: none): a
/// deliberate bug, for the test that shows the differential test catches it.
#[cfg(feature = "bench-hooks")]
pub fn skip_invalidation(which: Option<Invalidation>) {
    SKIPPED.set(which);
}

#[cfg(feature = "bench-hooks")]
pub(super) fn skipped(which: Invalidation) -> bool {
    SKIPPED.get() == Some(which)
}

#[cfg(not(feature = "bench-hooks"))]
#[derive(Clone, Copy)]
pub(super) enum Invalidation {
    Facts,
    PolicySet,
    OwnedEntities,
    Blocklist,
}

#[cfg(not(feature = "bench-hooks"))]
#[inline(always)]
pub(super) fn skipped(_: Invalidation) -> bool {
    false
}
