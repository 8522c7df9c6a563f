//! Shared plumbing for the line-oriented parsers: the size check, UTF-8 decoding with a
//! located error, and numbered lines.

use crate::source::InputError;

/// Checks the size limit and decodes `input` as UTF-8, locating the first bad byte.
pub(crate) fn decode(input: &[u8], limit: usize) -> Result<&str, InputError> {
    if input.len() > limit {
        return Err(InputError::TooLarge {
            len: input.len(),
            limit,
        });
    }
    std::str::from_utf8(input).map_err(|e| {
        let good = input.get(..e.valid_up_to()).unwrap_or_default();
        let line = good.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = good.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
        InputError::NotUtf8 {
            line,
            column: e.valid_up_to() - line_start + 1,
            offset: e.valid_up_to(),
        }
    })
}

/// Lines with their 1-based numbers; a trailing `\r` is dropped.
pub(crate) fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
}

/// A short, printable excerpt of an untrusted value for an error message.
pub(crate) fn excerpt(value: &str) -> String {
    const MAX: usize = 64;
    let mut out: String = value.chars().take(MAX).collect();
    if value.chars().count() > MAX {
        out.push('…');
    }
    out
}

/// Parses a finite decimal number the way the tools print them (`77.71`, `-8`, `1e3`).
/// Rejects `inf`/`nan` spellings: a reading that is not a number is no reading.
pub(crate) fn finite_f64(s: &str) -> Option<f64> {
    let first = s.as_bytes().first()?;
    if !(first.is_ascii_digit() || *first == b'-' || *first == b'+' || *first == b'.') {
        return None;
    }
    let v: f64 = s.parse().ok()?;
    v.is_finite().then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_utf8_is_located_by_line_and_column() {
        let err = decode(b"ok\nab\xffc\n", 100).unwrap_err();
        assert_eq!(
            err,
            InputError::NotUtf8 {
                line: 2,
                column: 3,
                offset: 5
            }
        );
    }

    #[test]
    fn oversized_input_is_refused() {
        assert_eq!(
            decode(b"12345", 4).unwrap_err(),
            InputError::TooLarge { len: 5, limit: 4 }
        );
    }

    #[test]
    fn finite_f64_refuses_nan_and_inf_words() {
        assert_eq!(finite_f64("77.71"), Some(77.71));
        assert_eq!(finite_f64("-8"), Some(-8.0));
        assert_eq!(finite_f64("NaN"), None);
        assert_eq!(finite_f64("inf"), None);
        assert_eq!(finite_f64("1e999"), None);
        assert_eq!(finite_f64(""), None);
    }
}
