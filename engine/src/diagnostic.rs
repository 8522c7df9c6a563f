//! A located message about a source file: the shape every policy, schema and
//! configuration error takes, so that the CLI, the status endpoint and logs all
//! say `file:line:column: message` and miette can draw the span.

use std::fmt;
use std::sync::Arc;

use miette::{Diagnostic, NamedSource, SourceSpan};

/// One problem at one place in one source file.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct SourceDiagnostic {
    /// The file's name as the engine loaded it (a path, or `embedded:...`).
    pub file: String,
    /// 1-based line of the problem.
    pub line: usize,
    /// 1-based column (in characters) of the problem.
    pub column: usize,
    /// What is wrong, without the location.
    pub message: String,
    /// How to fix it, when known.
    pub help: Option<String>,
    source_code: NamedSource<Arc<str>>,
    span: SourceSpan,
}

impl SourceDiagnostic {
    /// A diagnostic at byte `offset` (length `len`) of `text`, the contents of `file`.
    pub(crate) fn new(
        file: &str,
        text: &Arc<str>,
        offset: usize,
        len: usize,
        message: impl Into<String>,
    ) -> Self {
        let offset = offset.min(text.len());
        let (line, column) = line_column(text, offset);
        Self {
            file: file.to_owned(),
            line,
            column,
            message: message.into(),
            help: None,
            source_code: NamedSource::new(file, Arc::clone(text)),
            span: SourceSpan::new(offset.into(), len.min(text.len() - offset)),
        }
    }

    /// Adds advice on how to fix the problem.
    pub(crate) fn with_help(mut self, help: Option<String>) -> Self {
        self.help = help;
        self
    }

    /// Converts a diagnostic from a parser (cedar, toml) whose labels point into `text`.
    pub(crate) fn from_diagnostic(file: &str, text: &Arc<str>, diag: &dyn Diagnostic) -> Self {
        let (offset, len) = diag
            .labels()
            .and_then(|mut labels| labels.next())
            .map(|label| (label.offset(), label.len()))
            .unwrap_or((0, 0));
        // Cedar puts the useful detail of some errors in their sources.
        let message = join_chain(diag.to_string(), std::error::Error::source(diag));
        Self::new(file, text, offset, len, message).with_help(diag.help().map(|h| h.to_string()))
    }

    /// Byte offset and length of the span in the file.
    pub fn span(&self) -> (usize, usize) {
        (self.span.offset(), self.span.len())
    }
}

impl Diagnostic for SourceDiagnostic {
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(&self.source_code)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = miette::LabeledSpan> + '_>> {
        Some(Box::new(std::iter::once(
            miette::LabeledSpan::new_with_span(Some("here".to_owned()), self.span),
        )))
    }
}

/// 1-based line and character column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
    (line, column)
}

/// `text` followed by each cause in `cause`'s chain that it does not already contain,
/// joined with ": ". For messages that cross an API boundary as plain text (HTTP, the
/// status endpoint), where the caller cannot walk `source()` itself.
pub(crate) fn join_chain(
    mut text: String,
    mut cause: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    while let Some(inner) = cause {
        let inner_text = inner.to_string();
        if !text.contains(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        cause = inner.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_column_count_from_one() {
        let text: Arc<str> = Arc::from("ab\ncdé\nx");
        assert_eq!(line_column(&text, 0), (1, 1));
        assert_eq!(line_column(&text, 3), (2, 1));
        // 'x' is after a two-byte character: columns count characters.
        assert_eq!(line_column(&text, 8), (3, 1));
        assert_eq!(line_column(&text, 7), (2, 4));
        let d = SourceDiagnostic::new("p.cedar", &text, 4, 1, "bad");
        assert_eq!(d.to_string(), "p.cedar:2:2: bad");
    }

    #[test]
    fn offset_past_the_end_is_clamped() {
        let text: Arc<str> = Arc::from("abc");
        let d = SourceDiagnostic::new("f", &text, 99, 5, "m");
        assert_eq!(d.span(), (3, 0));
    }
}
