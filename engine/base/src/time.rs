//! RFC 3339 timestamps in UTC, written without a date library, and the calendar arithmetic
//! under them.
//!
//! Why this module exists: syslog (RFC 5424 §6.2.3), Alertmanager and the keyring's reports
//! all print UTC instants, and each had its own copy of Howard Hinnant's day algorithms.
//! One [`Rfc3339`] writes them all, with whole seconds (`2026-03-01T09:30:05Z`) or six
//! fraction digits (`2026-03-01T09:30:05.000000Z`).

use std::fmt;

/// An instant to print as RFC 3339 in UTC: `YYYY-MM-DDThh:mm:ss[.ffffff]Z`.
///
/// The year has at least four digits (more after year 9999, a sign before year 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rfc3339 {
    seconds: i64,
    /// Microseconds within the second, when the fraction is printed.
    micros: Option<u32>,
}

impl Rfc3339 {
    /// `unix_seconds` after the epoch, printed in whole seconds.
    pub const fn seconds(unix_seconds: i64) -> Self {
        Self {
            seconds: unix_seconds,
            micros: None,
        }
    }

    /// `unix_micros` after the epoch, printed with six fraction digits.
    pub const fn micros(unix_micros: i64) -> Self {
        Self {
            seconds: unix_micros.div_euclid(1_000_000),
            // rem_euclid by 10^6 is in 0..10^6, which fits.
            micros: Some(unix_micros.rem_euclid(1_000_000) as u32),
        }
    }

    /// Appends the timestamp to `out` (no allocation: the syslog writer calls it per record).
    pub fn write_to(&self, out: &mut Vec<u8>) {
        let days = self.seconds.div_euclid(86_400);
        let sod = self.seconds.rem_euclid(86_400);
        write_date(out, days);
        out.push(b'T');
        push_digits(out, sod / 3600, 2);
        out.push(b':');
        push_digits(out, (sod / 60) % 60, 2);
        out.push(b':');
        push_digits(out, sod % 60, 2);
        if let Some(micros) = self.micros {
            out.push(b'.');
            push_digits(out, i64::from(micros), 6);
        }
        out.push(b'Z');
    }
}

impl fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Vec::with_capacity(27);
        self.write_to(&mut out);
        f.write_str(&String::from_utf8_lossy(&out))
    }
}

/// The calendar date of `days` since 1970-01-01, as `YYYY-MM-DD`.
pub fn date(days: i64) -> String {
    let mut out = Vec::with_capacity(10);
    write_date(&mut out, days);
    String::from_utf8_lossy(&out).into_owned()
}

fn write_date(out: &mut Vec<u8>, days: i64) {
    let (y, m, d) = civil_from_days(days);
    push_digits(out, y, 4);
    out.push(b'-');
    push_digits(out, m, 2);
    out.push(b'-');
    push_digits(out, d, 2);
}

/// Appends `v` in decimal, zero-padded to at least `width` digits.
fn push_digits(out: &mut Vec<u8>, v: i64, width: usize) {
    if v < 0 {
        out.push(b'-');
    }
    let mut n = v.unsigned_abs();
    let mut digits = [b'0'; 20];
    let mut len = 0;
    for slot in digits.iter_mut().rev() {
        // n % 10 < 10, so the cast cannot truncate.
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
        len += 1;
        if n == 0 {
            break;
        }
    }
    for _ in len..width {
        out.push(b'0');
    }
    out.extend_from_slice(digits.get(digits.len() - len..).unwrap_or_default());
}

/// Whether `y` is a leap year of the proleptic Gregorian calendar.
pub fn is_leap(y: i64) -> bool {
    y % 4 == 0 && (y % 100 != 0 || y % 400 == 0)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`,
/// public domain).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The (year, month, day) of a day number since 1970-01-01 (inverse of
/// [`days_from_civil`]).
pub fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_seconds_and_microseconds_in_utc() {
        assert_eq!(Rfc3339::seconds(0).to_string(), "1970-01-01T00:00:00Z");
        // Checked with `date -u -d @1772357405`.
        assert_eq!(
            Rfc3339::seconds(1_772_357_405).to_string(),
            "2026-03-01T09:30:05Z"
        );
        assert_eq!(
            Rfc3339::seconds(4_102_444_799).to_string(),
            "2099-12-31T23:59:59Z"
        );
        assert_eq!(
            Rfc3339::micros(1_796_075_233_385_181).to_string(),
            "2026-11-30T21:47:13.385181Z"
        );
        assert_eq!(
            Rfc3339::micros(253_402_300_799_999_999).to_string(),
            "9999-12-31T23:59:59.999999Z"
        );
        assert_eq!(
            Rfc3339::seconds(253_402_300_800).to_string(),
            "10000-01-01T00:00:00Z"
        );
        assert_eq!(date(11_016), "2000-02-29");
    }

    #[test]
    fn day_numbers_round_trip() {
        for days in [-719_468, -1, 0, 1, 11_016, 20_513, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert!(is_leap(2000) && !is_leap(1900) && is_leap(2024) && !is_leap(2023));
    }
}
