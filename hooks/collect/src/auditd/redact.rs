//! Redaction of command lines: the program is kept, its arguments are withheld.
//!
//! Why this module exists: the audit log records what people typed. `EXECVE` arguments,
//! `PROCTITLE` and sudo's `cmd=` carry passwords (`echo Pass | sudo -S …`, `mysql -pPass`,
//! `curl -u user:pass`) and `TTY`/`USER_TTY` carry keystrokes. The parser redacts these
//! values while it decodes them, so no secret-bearing value is ever stored in a
//! [`Record`](super::Record): a [`RedactedCommand`] can only be built here, from a program
//! name and an argument count.

use std::fmt;

/// The marker that stands for a withheld value unless configured otherwise.
pub const DEFAULT_MARKER: &str = "<redacted>";

/// Longest program name kept (longer ones are cut, with `…`).
pub const MAX_PROGRAM_CHARS: usize = 256;

/// How withheld values are shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redaction {
    /// What replaces each withheld value. Default [`DEFAULT_MARKER`] (`<redacted>`).
    pub marker: String,
    /// Whether a command keeps its argument count (one marker per argument) or shows a
    /// single marker for all of them. Default `true`.
    pub keep_argument_count: bool,
}

impl Default for Redaction {
    fn default() -> Self {
        Self {
            marker: DEFAULT_MARKER.to_owned(),
            keep_argument_count: true,
        }
    }
}

/// A command line whose arguments were withheld: the program name as the log gave it
/// (argv\[0\], or the first word of sudo's `cmd=`) and, if configured, how many arguments
/// followed it. **Never holds an argument**: there is no way to build one from them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedactedCommand {
    program: String,
    argument_count: Option<usize>,
    text: String,
}

impl RedactedCommand {
    /// A command of `program` with `arguments` arguments, shown per `redaction`.
    pub(crate) fn new(program: &str, arguments: usize, redaction: &Redaction) -> Self {
        let program = cap_program(program);
        let mut text = program.clone();
        let markers = match (arguments, redaction.keep_argument_count) {
            (0, _) => 0,
            (n, true) => n,
            (_, false) => 1,
        };
        for _ in 0..markers {
            text.push(' ');
            text.push_str(&redaction.marker);
        }
        Self {
            program,
            argument_count: redaction.keep_argument_count.then_some(arguments),
            text,
        }
    }

    /// From NUL-separated argv bytes (`proctitle=`, decoded).
    pub(crate) fn from_nul_separated(argv: &[u8], redaction: &Redaction) -> Self {
        // The kernel cuts proctitle at 128 bytes and a trailing NUL may remain.
        let argv = argv.strip_suffix(b"\0").unwrap_or(argv);
        let mut parts = argv.split(|&b| b == 0);
        let program = String::from_utf8_lossy(parts.next().unwrap_or_default());
        Self::new(&program, parts.count(), redaction)
    }

    /// From a command line whose words are separated by spaces (sudo's `cmd=`).
    pub(crate) fn from_words(line: &str, redaction: &Redaction) -> Self {
        let mut words = line.split_ascii_whitespace();
        let program = words.next().unwrap_or_default();
        Self::new(program, words.count(), redaction)
    }

    /// The program: argv\[0\] or the first word of the command line.
    pub fn program(&self) -> &str {
        &self.program
    }

    /// How many arguments followed the program, if the count is kept.
    pub fn argument_count(&self) -> Option<usize> {
        self.argument_count
    }

    /// The program followed by one marker per withheld argument, e.g. `ls <redacted>
    /// <redacted>`.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for RedactedCommand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn cap_program(program: &str) -> String {
    if program.chars().count() <= MAX_PROGRAM_CHARS {
        return program.to_owned();
    }
    let mut out: String = program.chars().take(MAX_PROGRAM_CHARS).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_become_markers_and_the_program_stays() {
        let r = Redaction::default();
        let c = RedactedCommand::from_words("ls -la /root", &r);
        assert_eq!(c.as_str(), "ls <redacted> <redacted>");
        assert_eq!(c.program(), "ls");
        assert_eq!(c.argument_count(), Some(2));
        let c = RedactedCommand::from_nul_separated(b"sh\0-c\0echo secret\0", &r);
        assert_eq!(c.to_string(), "sh <redacted> <redacted>");
    }

    #[test]
    fn without_the_count_one_marker_stands_for_all_arguments() {
        let r = Redaction {
            marker: "***".into(),
            keep_argument_count: false,
        };
        let c = RedactedCommand::from_words("mysql -u root -pSecret", &r);
        assert_eq!(c.as_str(), "mysql ***");
        assert_eq!(c.argument_count(), None);
        assert_eq!(RedactedCommand::from_words("true", &r).as_str(), "true");
    }

    #[test]
    fn a_huge_program_name_is_cut() {
        let long = "x".repeat(1000);
        let c = RedactedCommand::from_words(&long, &Redaction::default());
        assert_eq!(c.program().chars().count(), MAX_PROGRAM_CHARS + 1);
    }
}
