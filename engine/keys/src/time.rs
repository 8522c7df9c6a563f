//! Time as the keyring sees it: whole seconds since the Unix epoch, read from the
//! [`Clock`] the caller injects (the one clock of `probity_base`, the engine's).
//!
//! Why this module exists: key age drives rotation, and the decision *when* to rotate belongs
//! to the engine's policies and the engine's clock. The keyring therefore never reads the
//! system time itself; it asks the [`Clock`] it was given, so tests (and the engine's
//! simulations) can move time forward by 90 days without waiting.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use probity_base::clock::{Clock, ManualClock, SystemClock};

use serde::{Deserialize, Serialize};

/// A point in time: whole seconds since 1970-01-01T00:00:00Z (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The instant `seconds` after the Unix epoch.
    pub const fn from_unix_seconds(seconds: u64) -> Self {
        Self(seconds)
    }

    /// Seconds since the Unix epoch.
    pub const fn unix_seconds(self) -> u64 {
        self.0
    }

    /// The time elapsed from `self` to `later`; zero if `later` is earlier (a clock that
    /// stepped back never yields a negative age).
    pub fn elapsed_until(self, later: Timestamp) -> Duration {
        Duration::from_secs(later.0.saturating_sub(self.0))
    }

    /// The instant `duration` after `self` (saturating).
    pub fn plus(self, duration: Duration) -> Self {
        Self(self.0.saturating_add(duration.as_secs()))
    }

    /// The calendar date in UTC, as `YYYY-MM-DD`.
    pub fn date(self) -> String {
        probity_base::time::date(self.signed() / 86_400)
    }

    /// Now by `clock`, in whole seconds (the epoch for an instant before it): the
    /// keyring counts ages in seconds.
    pub fn now(clock: &dyn Clock) -> Self {
        Self::from_system_time(clock.now())
    }

    /// The instant `t` in whole seconds (the epoch for an instant before it).
    pub fn from_system_time(t: SystemTime) -> Self {
        Self(t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
    }

    /// Seconds as the shared RFC 3339 writer takes them (saturating: a `u64` beyond
    /// `i64::MAX` is some 292 billion years out).
    fn signed(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

/// RFC 3339 in UTC, e.g. `2026-03-01T09:30:00Z`.
impl std::fmt::Display for Timestamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        probity_base::time::Rfc3339::seconds(self.signed()).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates_in_utc() {
        assert_eq!(Timestamp(0).to_string(), "1970-01-01T00:00:00Z");
        // 2026-03-01T09:30:05Z, checked with `date -u -d @1772357405`.
        assert_eq!(Timestamp(1_772_357_405).to_string(), "2026-03-01T09:30:05Z");
        // A leap day.
        assert_eq!(Timestamp(951_782_400).date(), "2000-02-29");
        assert_eq!(Timestamp(4_102_444_799).to_string(), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn manual_clock_moves_only_when_told_and_ages_never_go_negative() {
        let clock = ManualClock::at(1000);
        assert_eq!(Timestamp::now(&clock), Timestamp(1000));
        clock.advance(90 * 86_400);
        assert_eq!(Timestamp::now(&clock), Timestamp(1000 + 90 * 86_400));
        assert_eq!(
            Timestamp(1000).elapsed_until(Timestamp::now(&clock)),
            Duration::from_secs(90 * 86_400)
        );
        assert_eq!(
            Timestamp::now(&clock).elapsed_until(Timestamp(5)),
            Duration::ZERO
        );
    }
}
