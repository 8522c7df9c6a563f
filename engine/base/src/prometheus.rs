//! The Prometheus text exposition format (version 0.0.4), written.
//!
//! Why this module exists: the server, the key service and the node agent each wrote
//! `# HELP`/`# TYPE` lines and label values by hand, with three copies of the label escaper
//! and a label that was not escaped at all. [`Writer`] is the one way Probity writes the
//! format: a family header, then samples whose label values it escapes; [`check`] is what a
//! test asks of any exporter's output.
//!
//! The format, as Prometheus reads it
//! (<https://prometheus.io/docs/instrumenting/exposition_formats/>): metric and label names
//! match `[a-zA-Z_:][a-zA-Z0-9_:]*` (labels without `:`), label values escape backslash,
//! double quote and line feed, `HELP` text escapes backslash and line feed, and a metric
//! family has at most one `TYPE` line, before its first sample.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt::{Display, Write as _};

/// The type of a metric family, as its `TYPE` line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value that only goes up (resets on restart).
    Counter,
    /// A value that goes up and down.
    Gauge,
    /// Cumulative buckets plus `_sum` and `_count`.
    Histogram,
}

impl Kind {
    /// The word of the `TYPE` line.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Writes exposition text into a `String` the caller owns (several writers may append
/// to one response in turn).
#[derive(Debug)]
pub struct Writer<'a> {
    out: &'a mut String,
}

impl<'a> Writer<'a> {
    /// A writer appending to `out`.
    pub fn new(out: &'a mut String) -> Self {
        Self { out }
    }

    /// Starts a family: its `HELP` and `TYPE` lines.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let _ = writeln!(
            self.out,
            "# HELP {name} {}\n# TYPE {name} {}",
            escape_help(help),
            kind.as_str()
        );
    }

    /// One sample: `name{labels} value`, the label values escaped. No braces without
    /// labels.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.labels(labels);
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// A family of one unlabelled sample: `HELP`, `TYPE` and the value.
    pub fn single(&mut self, name: &str, kind: Kind, help: &str, value: impl Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }

    /// The samples of one histogram series: cumulative `buckets` (upper bound, count up to
    /// it), the `+Inf` bucket (`count`), `_sum` and `_count`, each with `labels` (and `le`
    /// on the buckets). `_sum` and `_count` keep their braces even without labels
    /// (`name_sum{} 0`), as the server always wrote them; Prometheus reads both forms.
    pub fn histogram(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        buckets: impl IntoIterator<Item = (f64, u64)>,
        sum: f64,
        count: u64,
    ) {
        let bucket = format!("{name}_bucket");
        fn le<'l>(labels: &[(&'l str, &'l str)], bound: &'l str) -> Vec<(&'l str, &'l str)> {
            labels.iter().copied().chain([("le", bound)]).collect()
        }
        for (bound, cumulative) in buckets {
            let bound = bound.to_string();
            self.sample(&bucket, &le(labels, &bound), cumulative);
        }
        self.sample(&bucket, &le(labels, "+Inf"), count);
        for (suffix, value) in [("_sum", sum.to_string()), ("_count", count.to_string())] {
            self.out.push_str(name);
            self.out.push_str(suffix);
            self.labels(labels);
            let _ = writeln!(self.out, " {value}");
        }
    }

    fn labels(&mut self, labels: &[(&str, &str)]) {
        self.out.push('{');
        for (i, (name, value)) in labels.iter().enumerate() {
            if i > 0 {
                self.out.push(',');
            }
            let _ = write!(self.out, "{name}=\"{}\"", escape_label(value));
        }
        self.out.push('}');
    }
}

/// A label value escaped for the text format: backslash, double quote and line feed.
pub fn escape_label(value: &str) -> Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return Cow::Borrowed(value);
    }
    let mut s = String::with_capacity(value.len() + 2);
    for c in value.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    Cow::Owned(s)
}

/// `HELP` text escaped for the text format: backslash and line feed.
fn escape_help(help: &str) -> Cow<'_, str> {
    if !help.contains(['\\', '\n']) {
        return Cow::Borrowed(help);
    }
    Cow::Owned(help.replace('\\', "\\\\").replace('\n', "\\n"))
}

/// Why exposition text is not valid: the line (1-based) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {problem}")]
pub struct ExpositionError {
    /// The line, counted from 1.
    pub line: usize,
    /// What is wrong.
    pub problem: String,
}

/// Checks `text` line by line against the text format: metric and label names, escapes
/// in label values, values that are numbers, one `HELP` and one `TYPE` per family, the
/// `TYPE` before the family's first sample, and a line feed at the end. For the
/// exporters' tests.
pub fn check(text: &str) -> Result<(), ExpositionError> {
    if !text.is_empty() && !text.ends_with('\n') {
        return Err(ExpositionError {
            line: text.lines().count(),
            problem: "the text does not end with a line feed".into(),
        });
    }
    let mut typed: Vec<(String, String)> = Vec::new();
    let mut helped = HashSet::new();
    let mut sampled = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let fail = |problem: String| ExpositionError {
            line: i + 1,
            problem,
        };
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (keyword, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let tail = parts.next().unwrap_or("");
            if !matches!(keyword, "HELP" | "TYPE") {
                continue; // A comment.
            }
            if !is_metric_name(name) {
                return Err(fail(format!("{name:?} is not a metric name")));
            }
            if keyword == "HELP" {
                if !helped.insert(name.to_owned()) {
                    return Err(fail(format!("a second HELP for {name}")));
                }
                check_escapes(tail, &['\\', 'n']).map_err(fail)?;
                continue;
            }
            if !matches!(
                tail,
                "counter" | "gauge" | "histogram" | "summary" | "untyped"
            ) {
                return Err(fail(format!("{tail:?} is not a metric type")));
            }
            if typed.iter().any(|(n, _)| n == name) {
                return Err(fail(format!("a second TYPE for {name}")));
            }
            if sampled.contains(name) {
                return Err(fail(format!("the TYPE of {name} after its samples")));
            }
            typed.push((name.to_owned(), tail.to_owned()));
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = line.get(..name_end).unwrap_or("");
        if !is_metric_name(name) {
            return Err(fail(format!("{name:?} is not a metric name")));
        }
        let mut rest = line.get(name_end..).unwrap_or("");
        if let Some(labels) = rest.strip_prefix('{') {
            rest = check_labels(labels).map_err(fail)?;
        }
        let mut fields = rest.split(' ').skip(1);
        let value = fields.next().unwrap_or("");
        if !rest.starts_with(' ') || !is_number(value) {
            return Err(fail(format!("{value:?} is not a sample value")));
        }
        if let Some(ts) = fields.next()
            && ts.parse::<i64>().is_err()
        {
            return Err(fail(format!("{ts:?} is not a timestamp")));
        }
        sampled.insert(family_of(name, &typed).to_owned());
    }
    Ok(())
}

/// The family a sample belongs to: a histogram's `_bucket`, `_sum` and `_count` are its
/// own.
fn family_of<'n>(name: &'n str, typed: &[(String, String)]) -> &'n str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && typed
                .iter()
                .any(|(n, k)| n == base && matches!(k.as_str(), "histogram" | "summary"))
        {
            return base;
        }
    }
    name
}

/// Checks `name="value",...}` and returns what follows the closing brace.
fn check_labels(mut s: &str) -> Result<&str, String> {
    loop {
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest);
        }
        let eq = s.find('=').ok_or("a label without '='")?;
        let name = s.get(..eq).unwrap_or("");
        if !is_label_name(name) {
            return Err(format!("{name:?} is not a label name"));
        }
        let value = s
            .get(eq + 1..)
            .and_then(|v| v.strip_prefix('"'))
            .ok_or_else(|| format!("the value of label {name} is not quoted"))?;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in value.char_indices() {
            match (escaped, c) {
                (true, '\\' | '"' | 'n') => escaped = false,
                (true, c) => return Err(format!("label {name}: unknown escape \\{c}")),
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i);
                    break;
                }
                (false, _) => {}
            }
        }
        let end = end.ok_or_else(|| format!("the value of label {name} is not closed"))?;
        s = value.get(end + 1..).unwrap_or("");
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

/// Refuses a backslash not followed by one of `allowed`.
fn check_escapes(text: &str, allowed: &[char]) -> Result<(), String> {
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some(e) if allowed.contains(&e) => {}
                other => return Err(format!("unknown escape in HELP: \\{other:?}")),
            }
        }
    }
    Ok(())
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_number(s: &str) -> bool {
    matches!(s, "+Inf" | "-Inf" | "NaN") || (!s.is_empty() && s.parse::<f64>().is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_families_samples_and_escaped_labels() {
        let mut out = String::new();
        let mut w = Writer::new(&mut out);
        w.single("up", Kind::Gauge, "1 when up.", 1);
        w.family("hits_total", Kind::Counter, "Hits, per path.");
        w.sample("hits_total", &[("path", "a\"b\\c\nd"), ("code", "200")], 7);
        w.family("latency_seconds", Kind::Histogram, "Latency.");
        w.histogram("latency_seconds", &[], [(0.5, 1), (1.0, 2)], 1.25, 3);
        w.histogram("latency_seconds", &[("route", "/x")], [(0.5, 0)], 0.0, 0);
        assert_eq!(
            out,
            "# HELP up 1 when up.\n# TYPE up gauge\nup 1\n\
             # HELP hits_total Hits, per path.\n# TYPE hits_total counter\n\
             hits_total{path=\"a\\\"b\\\\c\\nd\",code=\"200\"} 7\n\
             # HELP latency_seconds Latency.\n# TYPE latency_seconds histogram\n\
             latency_seconds_bucket{le=\"0.5\"} 1\nlatency_seconds_bucket{le=\"1\"} 2\n\
             latency_seconds_bucket{le=\"+Inf\"} 3\nlatency_seconds_sum{} 1.25\n\
             latency_seconds_count{} 3\n\
             latency_seconds_bucket{route=\"/x\",le=\"0.5\"} 0\n\
             latency_seconds_bucket{route=\"/x\",le=\"+Inf\"} 0\n\
             latency_seconds_sum{route=\"/x\"} 0\nlatency_seconds_count{route=\"/x\"} 0\n"
        );
        check(&out).unwrap();
    }

    #[test]
    fn the_check_refuses_what_prometheus_would() {
        for (text, line) in [
            ("# TYPE a counter\n# TYPE a counter\n", 2),
            ("a 1\n# TYPE a counter\n", 2),
            ("a{l=\"x\"y\"} 1\n", 1),
            ("a{l=\"x\\q\"} 1\n", 1),
            ("a{1l=\"x\"} 1\n", 1),
            ("1a 1\n", 1),
            ("a one\n", 1),
            ("# TYPE a countr\n", 1),
            ("a 1", 1),
        ] {
            assert_eq!(check(text).map_err(|e| e.line), Err(line), "{text:?}");
        }
        check("# HELP a x\n# TYPE a gauge\na{l=\"\\\\\\\"\\n\"} +Inf\na 1 1700000000\n").unwrap();
    }
}
