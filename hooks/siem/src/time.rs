//! RFC 3339 timestamps, written and read without a date library: syslog (RFC 5424
//! §6.2.3) and Alertmanager both want UTC with a fraction, and a parser of untrusted
//! bytes must check every field's range itself anyway. The writer and the calendar
//! arithmetic are `probity-base`'s ([`probity_base::time`]); the RFC 5424 reader is here.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use probity_base::time::{Rfc3339, days_from_civil, is_leap};

/// Microseconds from 1970-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z, the last
/// instant a four-digit year can hold.
const MAX_MICROS: i64 = 253_402_300_799_999_999;

/// Microseconds since the Unix epoch, clamped to 0 ..= year 9999 (RFC 5424 has room for
/// four year digits only).
pub fn unix_micros(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).map_or(MAX_MICROS, |m| m.min(MAX_MICROS)),
        Err(_) => 0,
    }
}

/// The instant `micros` after the epoch (negative values clamp to the epoch).
pub fn from_unix_micros(micros: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// Appends `t` as `YYYY-MM-DDThh:mm:ss.ffffffZ` (UTC, microseconds) to `out`.
pub fn write_rfc3339_micros(t: SystemTime, out: &mut Vec<u8>) {
    Rfc3339::micros(unix_micros(t)).write_to(out);
}

/// `t` as an RFC 3339 string (UTC, microseconds).
pub fn rfc3339_micros(t: SystemTime) -> String {
    Rfc3339::micros(unix_micros(t)).to_string()
}

/// Why a timestamp did not parse: the byte offset (within the timestamp) and what was
/// expected there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimestampError {
    /// Offset of the offending byte within the timestamp.
    pub offset: usize,
    /// What was expected.
    pub expected: &'static str,
}

/// Parses an RFC 5424 TIMESTAMP (RFC 3339 with a four-digit year, at most six fraction
/// digits, `Z` or `±hh:mm`, no leap second) into microseconds since the epoch (UTC).
pub fn parse_rfc3339(s: &[u8]) -> Result<i64, TimestampError> {
    let mut p = Cursor { s, at: 0 };
    let year = p.digits(4, "a four-digit year")?;
    p.byte(b'-', "'-' after the year")?;
    let month = p.digits(2, "a two-digit month")?;
    p.range(month, 1, 12, 2, "a month 01-12")?;
    p.byte(b'-', "'-' after the month")?;
    let day = p.digits(2, "a two-digit day")?;
    p.range(
        day,
        1,
        days_in_month(year, month),
        2,
        "a day that exists in that month",
    )?;
    p.byte(b'T', "'T' between date and time")?;
    let hour = p.digits(2, "a two-digit hour")?;
    p.range(hour, 0, 23, 2, "an hour 00-23")?;
    p.byte(b':', "':' after the hour")?;
    let minute = p.digits(2, "two-digit minutes")?;
    p.range(minute, 0, 59, 2, "minutes 00-59")?;
    p.byte(b':', "':' after the minutes")?;
    let second = p.digits(2, "two-digit seconds")?;
    p.range(second, 0, 59, 2, "seconds 00-59")?;
    let mut micros = 0i64;
    if p.peek() == Some(b'.') {
        p.at += 1;
        let start = p.at;
        while let Some(c) = p.peek().filter(u8::is_ascii_digit) {
            if p.at - start == 6 {
                return Err(p.error("at most six fraction digits"));
            }
            micros = micros * 10 + i64::from(c - b'0');
            p.at += 1;
        }
        let n = p.at - start;
        if n == 0 {
            return Err(p.error("a digit after '.'"));
        }
        for _ in n..6 {
            micros *= 10;
        }
    }
    let offset_secs = match p.peek() {
        Some(b'Z') => {
            p.at += 1;
            0
        }
        Some(sign @ (b'+' | b'-')) => {
            p.at += 1;
            let oh = p.digits(2, "a two-digit offset hour")?;
            p.range(oh, 0, 23, 2, "an offset hour 00-23")?;
            p.byte(b':', "':' in the offset")?;
            let om = p.digits(2, "two-digit offset minutes")?;
            p.range(om, 0, 59, 2, "offset minutes 00-59")?;
            let o = oh * 3600 + om * 60;
            if sign == b'+' { o } else { -o }
        }
        _ => return Err(p.error("'Z' or a '+hh:mm'/'-hh:mm' offset")),
    };
    if p.at != s.len() {
        return Err(p.error("the end of the timestamp"));
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_secs;
    Ok(secs * 1_000_000 + micros)
}

struct Cursor<'a> {
    s: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }
    fn error(&self, expected: &'static str) -> TimestampError {
        TimestampError {
            offset: self.at,
            expected,
        }
    }
    fn byte(&mut self, b: u8, expected: &'static str) -> Result<(), TimestampError> {
        if self.peek() == Some(b) {
            self.at += 1;
            Ok(())
        } else {
            Err(self.error(expected))
        }
    }
    fn digits(&mut self, n: usize, expected: &'static str) -> Result<i64, TimestampError> {
        let mut v = 0i64;
        for _ in 0..n {
            match self.peek() {
                Some(c) if c.is_ascii_digit() => {
                    v = v * 10 + i64::from(c - b'0');
                    self.at += 1;
                }
                _ => return Err(self.error(expected)),
            }
        }
        Ok(v)
    }
    fn range(
        &self,
        v: i64,
        lo: i64,
        hi: i64,
        width: usize,
        expected: &'static str,
    ) -> Result<(), TimestampError> {
        if (lo..=hi).contains(&v) {
            Ok(())
        } else {
            Err(TimestampError {
                offset: self.at.saturating_sub(width),
                expected,
            })
        }
    }
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_microseconds() {
        let t = UNIX_EPOCH + Duration::from_micros(1_796_075_233_385_181);
        assert_eq!(rfc3339_micros(t), "2026-11-30T21:47:13.385181Z");
        assert_eq!(rfc3339_micros(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let before = UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(rfc3339_micros(before), "1970-01-01T00:00:00.000000Z");
        let far = UNIX_EPOCH + Duration::from_secs(400_000_000_000);
        assert_eq!(rfc3339_micros(far), "9999-12-31T23:59:59.999999Z");
    }

    #[test]
    fn parses_what_it_formats_and_offsets() {
        for m in [
            0i64,
            1,
            951_782_400_000_000,
            1_796_075_233_385_181,
            MAX_MICROS,
        ] {
            let s = rfc3339_micros(from_unix_micros(m));
            assert_eq!(parse_rfc3339(s.as_bytes()), Ok(m), "{s}");
        }
        // RFC 5424's own example: 2003-08-24T05:14:15.000003-07:00 is 12:14:15 UTC.
        let utc = parse_rfc3339(b"2003-08-24T12:14:15.000003Z").unwrap();
        assert_eq!(parse_rfc3339(b"2003-08-24T05:14:15.000003-07:00"), Ok(utc));
        assert_eq!(
            parse_rfc3339(b"2003-10-11T22:14:15.003Z").unwrap() % 1_000_000,
            3000
        );
    }

    #[test]
    fn rejects_with_the_offset_of_the_problem() {
        let e = parse_rfc3339(b"203-10-11T22:14:15.003Z").unwrap_err();
        assert_eq!((e.offset, e.expected), (3, "a four-digit year"));
        assert_eq!(
            parse_rfc3339(b"2023-02-29T00:00:00Z").unwrap_err().offset,
            8
        );
        assert_eq!(
            parse_rfc3339(b"2024-02-29T00:00:60Z").unwrap_err().offset,
            17
        );
        assert_eq!(
            parse_rfc3339(b"2024-02-29T00:00:00.1234567Z")
                .unwrap_err()
                .offset,
            26
        );
        assert_eq!(
            parse_rfc3339(b"2024-02-29T00:00:00").unwrap_err().offset,
            19
        );
        assert_eq!(
            parse_rfc3339(b"2024-02-29T00:00:00Zx").unwrap_err().offset,
            20
        );
    }
}
