//! The one clock: where every Probity crate reads the time.
//!
//! Why this module exists: decisions judge time (key ages, stale telemetry, alert
//! windows), so time must come from a source the owner of the decision injects, never from
//! the system clock read deep inside. The engine, the keyring and the collectors all take a
//! [`Clock`]; tests inject a [`ManualClock`] instead of sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now, as a `SystemTime`.
    fn now(&self) -> SystemTime;

    /// Now, in whole seconds since the Unix epoch (negative before it).
    fn now_unix(&self) -> i64 {
        match self.now().duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            Err(e) => i64::try_from(e.duration().as_secs()).map_or(i64::MIN, |s| -s),
        }
    }

    /// Now, in milliseconds since the Unix epoch (0 before it).
    fn now_unix_ms(&self) -> u64 {
        self.now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// The system's wall clock: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that stands still until told otherwise: for tests, scenarios and replays.
#[derive(Debug, Default)]
pub struct ManualClock {
    unix_ms: AtomicI64,
}

impl ManualClock {
    /// A clock at `unix_seconds`.
    pub fn at(unix_seconds: i64) -> Self {
        Self {
            unix_ms: AtomicI64::new(unix_seconds.saturating_mul(1000)),
        }
    }

    /// Sets the time.
    pub fn set(&self, unix_seconds: i64) {
        self.unix_ms
            .store(unix_seconds.saturating_mul(1000), Ordering::SeqCst);
    }

    /// Moves the time forward (or back, for a negative `seconds`).
    pub fn advance(&self, seconds: i64) {
        self.unix_ms
            .fetch_add(seconds.saturating_mul(1000), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        let ms = self.unix_ms.load(Ordering::SeqCst);
        match u64::try_from(ms) {
            Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
            Err(_) => UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let c = ManualClock::at(1_000);
        assert_eq!(c.now_unix(), 1_000);
        c.advance(86_400 * 91);
        assert_eq!(c.now_unix(), 1_000 + 86_400 * 91);
        c.set(-5);
        assert_eq!(c.now_unix(), -5);
        assert_eq!(c.now_unix_ms(), 0);
    }
}
