//! The Prometheus text exposition format (version 0.0.4), as dcgm-exporter serves it.
//!
//! Written here rather than taken from a crate because the collector needs what the crates
//! do not give together: a hard size limit, an error with line and column for every
//! malformed byte, and no dependence on `# TYPE` lines (a grep of a scrape has none).
//! Accepted: `# HELP`/`# TYPE` and other comments anywhere (or nowhere); label values with
//! the `\\`, `\"` and `\n` escapes and any other UTF-8, spaces included; label sets that
//! differ between samples of one family, in any order; a trailing comma in a label set;
//! `NaN`, `+Inf`, `-Inf`; an optional integer timestamp in milliseconds.

use std::borrow::Cow;

use thiserror::Error;

use crate::source::InputError;
use crate::text;

/// Largest exposition accepted. A full dcgm-exporter scrape of 8 GPUs is about 100 KiB.
pub const MAX_EXPOSITION_BYTES: usize = 16 * 1024 * 1024;

/// One sample line, borrowing from the input.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// The 1-based line it came from.
    pub line: usize,
    /// Metric name.
    pub name: &'a str,
    /// Labels, in the order printed; a value is owned only when it had escapes.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value (may be NaN or infinite).
    pub value: f64,
    /// Milliseconds since the epoch, when printed.
    pub timestamp_ms: Option<i64>,
}

impl Sample<'_> {
    /// The value of a label.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Why an exposition does not parse: what, at which line and column (1-based, in
/// characters).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ExpositionError {
    /// Too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Malformed line.
    #[error("line {line}, column {column}: {problem}")]
    Syntax {
        /// Line.
        line: usize,
        /// Column.
        column: usize,
        /// What is wrong.
        problem: String,
    },
}

struct Cursor<'a> {
    s: &'a str,
    pos: usize,
    line: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, problem: impl Into<String>) -> ExpositionError {
        self.err_at(self.pos, problem)
    }

    fn err_at(&self, pos: usize, problem: impl Into<String>) -> ExpositionError {
        let column = self.s.get(..pos).map_or(1, |p| p.chars().count() + 1);
        ExpositionError::Syntax {
            line: self.line,
            column,
            problem: problem.into(),
        }
    }

    // Every byte the grammar matches is ASCII, so positions found by scanning bytes are
    // always char boundaries of the line.
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    fn bump(&mut self) {
        self.pos += 1;
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.pos += 1;
        }
    }

    fn at_end(&self) -> bool {
        self.pos >= self.s.len()
    }

    fn take_while(&mut self, f: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&f) {
            self.pos += 1;
        }
        self.s.get(start..self.pos).unwrap_or("")
    }

    fn name(&mut self, what: &str, colons: bool) -> Result<&'a str, ExpositionError> {
        let first_ok = |c: u8| c.is_ascii_alphabetic() || c == b'_' || (colons && c == b':');
        if !self.peek().is_some_and(first_ok) {
            return Err(self.err(format!("expected a {what}")));
        }
        Ok(self.take_while(|c| c.is_ascii_alphanumeric() || c == b'_' || (colons && c == b':')))
    }

    fn token(&mut self) -> &'a str {
        self.take_while(|c| c != b' ' && c != b'\t')
    }

    /// A label value after its opening quote, with escapes resolved; consumes the closing
    /// quote. Borrowed unless it had escapes.
    fn quoted(&mut self) -> Result<Cow<'a, str>, ExpositionError> {
        let bytes = self.s.as_bytes();
        let mut owned: Option<String> = None;
        loop {
            let rest = bytes.get(self.pos..).unwrap_or_default();
            let Some(stop) = rest.iter().position(|&b| b == b'"' || b == b'\\') else {
                self.pos = self.s.len();
                return Err(self.err("label value not closed"));
            };
            let piece = self.s.get(self.pos..self.pos + stop).unwrap_or("");
            self.pos += stop;
            if self.peek() == Some(b'"') {
                self.bump();
                return Ok(match owned {
                    None => Cow::Borrowed(piece),
                    Some(mut v) => {
                        v.push_str(piece);
                        Cow::Owned(v)
                    }
                });
            }
            let v = owned.get_or_insert_with(String::new);
            v.push_str(piece);
            self.bump(); // the backslash
            match self.peek() {
                Some(b'\\') => v.push('\\'),
                Some(b'"') => v.push('"'),
                Some(b'n') => v.push('\n'),
                _ => return Err(self.err("unknown escape in label value")),
            }
            self.bump();
        }
    }
}

fn parse_value(c: &Cursor<'_>, start: usize, s: &str) -> Result<f64, ExpositionError> {
    // Go's ParseFloat spellings that Rust's parser also takes; reject Rust-only ones
    // (`infinity`, `infx`…).
    let word = s.trim_start_matches(['+', '-']);
    if word.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("inf")) && word.len() != 3 {
        return Err(c.err_at(
            start,
            format!("{:?} is not a sample value", text::excerpt(s)),
        ));
    }
    s.parse::<f64>().map_err(|_| {
        c.err_at(
            start,
            format!("{:?} is not a sample value", text::excerpt(s)),
        )
    })
}

type Labels<'a> = Vec<(&'a str, Cow<'a, str>)>;

fn parse_labels<'a>(c: &mut Cursor<'a>) -> Result<Labels<'a>, ExpositionError> {
    let mut labels: Labels<'a> = Vec::with_capacity(12);
    loop {
        c.skip_blanks();
        if c.peek() == Some(b'}') {
            c.bump();
            return Ok(labels);
        }
        let name = c.name("label name", false)?;
        if labels.iter().any(|(k, _)| *k == name) {
            return Err(c.err(format!("label {name} repeated")));
        }
        c.skip_blanks();
        if c.peek() != Some(b'=') {
            return Err(c.err("expected '=' after the label name"));
        }
        c.bump();
        c.skip_blanks();
        if c.peek() != Some(b'"') {
            return Err(c.err("expected '\"' to open the label value"));
        }
        c.bump();
        let value = c.quoted()?;
        labels.push((name, value));
        c.skip_blanks();
        match c.peek() {
            Some(b',') => c.bump(),
            Some(b'}') => {
                c.bump();
                return Ok(labels);
            }
            _ => return Err(c.err("expected ',' or '}' after a label")),
        }
    }
}

fn parse_comment(c: &mut Cursor<'_>) -> Result<(), ExpositionError> {
    c.bump(); // '#'
    c.skip_blanks();
    let keyword = c.token();
    if keyword != "HELP" && keyword != "TYPE" {
        return Ok(()); // a plain comment
    }
    c.skip_blanks();
    c.name("metric name", true)?;
    if keyword == "TYPE" {
        c.skip_blanks();
        let kind = c.token();
        const KINDS: &[&str] = &["counter", "gauge", "histogram", "summary", "untyped"];
        if !KINDS.contains(&kind) {
            return Err(c.err(format!("{:?} is not a metric type", text::excerpt(kind))));
        }
        c.skip_blanks();
        if !c.at_end() {
            return Err(c.err("unexpected text after the metric type"));
        }
    }
    Ok(())
}

/// Parses a text exposition into its samples, in order.
pub fn parse_exposition(input: &[u8]) -> Result<Vec<Sample<'_>>, ExpositionError> {
    let text = text::decode(input, MAX_EXPOSITION_BYTES)?;
    let mut samples = Vec::new();
    for (line, l) in text::lines(text) {
        let mut c = Cursor { s: l, pos: 0, line };
        c.skip_blanks();
        match c.peek() {
            None => continue,
            Some(b'#') => {
                parse_comment(&mut c)?;
                continue;
            }
            Some(_) => {}
        }
        let name = c.name("metric name", true)?;
        c.skip_blanks();
        let labels = if c.peek() == Some(b'{') {
            c.bump();
            parse_labels(&mut c)?
        } else {
            Vec::new()
        };
        c.skip_blanks();
        if c.at_end() {
            return Err(c.err("missing sample value"));
        }
        let value_start = c.pos;
        let value_text = c.token();
        let value = parse_value(&c, value_start, value_text)?;
        c.skip_blanks();
        let timestamp_ms = if !c.at_end() {
            let ts_start = c.pos;
            let ts = c.token();
            Some(ts.parse::<i64>().map_err(|_| {
                c.err_at(
                    ts_start,
                    format!("{:?} is not a timestamp", text::excerpt(ts)),
                )
            })?)
        } else {
            None
        };
        c.skip_blanks();
        if !c.at_end() {
            return Err(c.err("unexpected text after the sample"));
        }
        samples.push(Sample {
            line,
            name,
            labels,
            value,
            timestamp_ms,
        });
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_spaces_nan_inf_and_timestamps() {
        let input = br#"# TYPE m gauge
m{a="x \"y\" \\ z\nw",b="H100 80GB HBM3",} NaN
m{b="2"} +Inf 1700000000000
m -Inf
m{  a = "1" , b="2" } 3.5e2
"#;
        let s = parse_exposition(input).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].label("a"), Some("x \"y\" \\ z\nw"));
        assert_eq!(s[0].label("b"), Some("H100 80GB HBM3"));
        assert!(s[0].value.is_nan());
        assert_eq!(s[1].value, f64::INFINITY);
        assert_eq!(s[1].timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(s[2].value, f64::NEG_INFINITY);
        assert!(s[2].labels.is_empty());
        assert_eq!(s[3].value, 350.0);
        assert_eq!(s[3].line, 5);
    }

    #[test]
    fn errors_have_line_and_column() {
        let err = parse_exposition(b"ok 1\nm{a=\"1\" 2\n").unwrap_err();
        assert_eq!(
            err,
            ExpositionError::Syntax {
                line: 2,
                column: 9,
                problem: "expected ',' or '}' after a label".into()
            }
        );
        let err = parse_exposition(b"m{gpu=\"0\"} hot\n").unwrap_err();
        assert!(
            matches!(
                err,
                ExpositionError::Syntax {
                    line: 1,
                    column: 12,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(parse_exposition(b"m 1 2 3\n").is_err());
        assert!(parse_exposition(b"m{a=\"1\",a=\"2\"} 1\n").is_err());
        assert!(parse_exposition(b"m{a=\"\\q\"} 1\n").is_err());
        assert!(parse_exposition(b"# TYPE m bogus\n").is_err());
        assert!(parse_exposition(b"m infinity\n").is_err());
    }
}
