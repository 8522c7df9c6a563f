//! Helpers for the engine's unit tests. A leaf: it imports nothing of the engine.

/// A xorshift generator from `seed` (not 0): each call gives a number below `m` (0 when
/// `m` is 0 or 1). Random tests stay reproducible: the same seed, the same cases.
pub(crate) fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed;
    move |m| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m.max(1)
    }
}
