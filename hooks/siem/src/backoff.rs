//! Capped exponential backoff with jitter, so that many senders whose receiver comes
//! back do not all reconnect in the same instant.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Delay before the n-th retry: `initial × 2^(n-1)`, capped at `max`, then scaled by a
/// random factor in [0.5, 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay; default 100 ms.
    pub initial: Duration,
    /// The largest delay; default 30 s.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// The capped delay before retry number `failures` (1 for the first), before jitter.
    pub fn ceiling(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.initial
            .checked_mul(1u32 << doublings)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The delay to wait before retry number `failures`, with jitter.
    pub(crate) fn delay(&self, failures: u32, rng: &mut Jitter) -> Duration {
        let ceiling = self.ceiling(failures);
        // A factor in [0.5, 1) in 1/1024 steps.
        let steps = 512 + u32::try_from(rng.next() % 512).unwrap_or(0);
        ceiling / 1024 * steps
    }
}

/// A small xorshift generator for jitter (not for anything secret).
#[derive(Debug, Clone)]
pub(crate) struct Jitter(u64);

impl Jitter {
    /// Seeded from the clock and the process id.
    pub fn new() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Self(u64::from(nanos) ^ (u64::from(std::process::id()) << 32) | 1)
    }

    /// The next value.
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

impl Default for Jitter {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_jitters_below_it() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        let ceilings: Vec<u128> = (1..=6).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
        let mut j = Jitter::new();
        for n in 1..50 {
            let d = b.delay(n, &mut j);
            assert!(d < b.ceiling(n) && d >= b.ceiling(n) / 2 - Duration::from_millis(1));
        }
    }
}
