//! Privilege elevations from the Linux audit log, and where the reading stands.
//!
//! Why this module exists: the `elevate` rule needs, for each elevation, who did it, when
//! (the event's own time) and when that session logged in remotely; probity-collect's
//! `auditd` pipeline produces exactly that from the log file or the audisp stream. This
//! module owns the reader and its position: after each read the position (device, inode,
//! offset of the last complete line) is saved in the state directory, so a restarted
//! agent resumes where it stopped, neither reporting an elevation twice nor missing one
//! written while it was down (a rotated-away file is read from its start).

use std::path::{Path, PathBuf};
use std::time::Duration;

use probity_collect::auditd::{
    AudispSource, AuditConfig, Elevation, FollowConfig, LogFollower, Pipeline, Position, StartAt,
};
use probity_collect::{Clock, Collected};
use serde::Serialize;
use thiserror::Error;

use crate::config::{Audit, AuditSource, AuditStart};
use crate::sources::{Outcome, error_chain, unix};

/// The position file in the state directory.
pub const POSITION_FILE: &str = "audit.position";
/// Largest position file read.
const MAX_POSITION_BYTES: usize = 256;
/// Most lines taken from the audisp stream per read.
const MAX_STREAM_LINES: usize = 100_000;

/// A saved position that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PositionError {
    /// Over the size limit.
    #[error("{len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Not `DEV INODE OFFSET`.
    #[error("column {column}: {what}")]
    Syntax {
        /// 1-based column of the bad field.
        column: usize,
        /// What is wrong.
        what: String,
    },
}

/// Parses a position file: `DEV INODE OFFSET` in decimal, one line.
pub fn parse_position(input: &[u8]) -> Result<Position, PositionError> {
    if input.len() > MAX_POSITION_BYTES {
        return Err(PositionError::TooLarge {
            len: input.len(),
            limit: MAX_POSITION_BYTES,
        });
    }
    let text = std::str::from_utf8(input).map_err(|e| PositionError::Syntax {
        column: e.valid_up_to() + 1,
        what: "not UTF-8".into(),
    })?;
    let line = text.strip_suffix('\n').unwrap_or(text);
    let mut fields = Vec::new();
    let mut column = 1;
    for word in line.split(' ') {
        let n = word.parse::<u64>().map_err(|_| PositionError::Syntax {
            column,
            what: format!("{word:?} is not a decimal number"),
        })?;
        fields.push(n);
        column += word.chars().count() + 1;
    }
    match fields.as_slice() {
        [dev, inode, offset] => Ok(Position {
            dev: *dev,
            inode: *inode,
            offset: *offset,
        }),
        _ => Err(PositionError::Syntax {
            column: 1,
            what: format!("{} fields, expected DEV INODE OFFSET", fields.len()),
        }),
    }
}

/// Renders a position for [`parse_position`].
pub fn render_position(p: &Position) -> String {
    format!("{} {} {}\n", p.dev, p.inode, p.offset)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a reader sees the
/// old content or the new, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

enum Reader {
    File(LogFollower),
    Stream(AudispSource),
}

/// What a read of the audit source found.
#[derive(Debug, Default)]
pub struct AuditPoll {
    /// Successful elevations, in log order.
    pub elevations: Vec<Elevation>,
    /// Elevations that failed (not decided: nothing was elevated).
    pub failed: usize,
    /// Lines that were not records, located.
    pub line_errors: Vec<String>,
}

/// The audit reader's counters and state, for the status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditStatus {
    /// How the last read ended.
    pub last: Outcome,
    /// Lines read since start.
    pub lines: u64,
    /// Lines that were not records.
    pub line_errors: u64,
    /// Successful elevations seen.
    pub elevations: u64,
    /// Failed elevations seen (not decided).
    pub failed_elevations: u64,
    /// Where reading stands in the file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<String>,
    /// The stream ended (audisp closed the agent's stdin).
    pub ended: bool,
}

/// The audit reader.
pub struct AuditReader {
    reader: Reader,
    pipeline: Pipeline,
    position_file: Option<PathBuf>,
    saved: Option<Position>,
    status: AuditStatus,
}

impl std::fmt::Debug for AuditReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditReader")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

/// Why the audit reader could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AuditSetupError {
    /// The saved position does not parse.
    #[error("{path}")]
    Position {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: PositionError,
    },
    /// The stdin reader thread could not start.
    #[error("cannot read audit records from standard input")]
    Stream(#[source] std::io::Error),
}

impl AuditReader {
    /// A reader as `config` says, resuming from the position saved under `state_dir`.
    pub fn new(config: &Audit, state_dir: Option<&Path>) -> Result<Self, AuditSetupError> {
        let audit = AuditConfig::default();
        let pipeline = Pipeline::new(&audit);
        let position_file = state_dir.map(|d| d.join(POSITION_FILE));
        let saved =
            match &position_file {
                Some(path) => match std::fs::read(path) {
                    Ok(bytes) => Some(parse_position(&bytes).map_err(|source| {
                        AuditSetupError::Position {
                            path: path.clone(),
                            source,
                        }
                    })?),
                    Err(_) => None,
                },
                None => None,
            };
        let reader = match config.source {
            AuditSource::File => Reader::File(LogFollower::new(FollowConfig {
                path: config.path.clone(),
                start: match (saved, config.start) {
                    (Some(p), _) => StartAt::Position(p),
                    (None, AuditStart::End) => StartAt::End,
                    (None, AuditStart::Beginning) => StartAt::Beginning,
                },
                ..FollowConfig::default()
            })),
            AuditSource::Stdin => Reader::Stream(
                AudispSource::spawn(std::io::stdin(), "stdin", pipeline.max_line_bytes(), 4096)
                    .map_err(AuditSetupError::Stream)?,
            ),
        };
        Ok(Self {
            reader,
            pipeline,
            position_file,
            saved,
            status: AuditStatus {
                last: Outcome::Never,
                lines: 0,
                line_errors: 0,
                elevations: 0,
                failed_elevations: 0,
                position: None,
                ended: false,
            },
        })
    }

    /// Reads what is new, closing idle events by `clock`; saves the position.
    pub fn poll(&mut self, clock: &dyn Clock) -> AuditPoll {
        let now = clock.now();
        let at = unix(now);
        let mut out = AuditPoll::default();
        let poll = match &mut self.reader {
            Reader::File(f) => match f.collect(&mut self.pipeline, clock) {
                Collected::Ok(r) => Ok(r.value),
                Collected::Unavailable { reason, .. } => {
                    self.status.last = Outcome::Unavailable {
                        reason: reason.to_string(),
                        at,
                    };
                    return out;
                }
                Collected::Error { error, .. } => Err(error_chain(&error)),
            },
            Reader::Stream(s) => s
                .poll(&mut self.pipeline, clock, Duration::ZERO, MAX_STREAM_LINES)
                .map_err(|e| format!("stdin: {e}")),
        };
        let poll = match poll {
            Ok(p) => p,
            Err(error) => {
                self.status.last = Outcome::Error { error, at };
                return out;
            }
        };
        self.status.last = Outcome::Ok { at };
        self.status.lines += poll.lines;
        self.status.line_errors += poll.errors.len() as u64 + poll.errors_dropped;
        self.status.ended |= poll.ended;
        out.line_errors = poll.errors.iter().map(|e| error_chain(e)).collect();
        for e in poll.elevations {
            if e.succeeded {
                self.status.elevations += 1;
                out.elevations.push(e);
            } else {
                self.status.failed_elevations += 1;
                out.failed += 1;
            }
        }
        if let Reader::File(f) = &self.reader
            && let Some(p) = f.position()
        {
            self.status.position = Some(render_position(&p).trim_end().to_owned());
            if self.saved != Some(p)
                && let Some(path) = &self.position_file
            {
                match write_atomic(path, render_position(&p).as_bytes()) {
                    Ok(()) => self.saved = Some(p),
                    Err(e) => {
                        self.status.last = Outcome::Error {
                            error: format!("saving the position to {}: {e}", path.display()),
                            at,
                        };
                    }
                }
            }
        }
        out
    }

    /// The counters and the last outcome.
    pub fn status(&self) -> &AuditStatus {
        &self.status
    }
}

/// The facts of an elevation, as recorded with its finding (the command is already
/// redacted by the reader: program and argument count only).
pub fn elevation_facts(e: &Elevation) -> serde_json::Value {
    let ctx = e.context();
    serde_json::json!({
        "kind": e.kind.as_str(),
        "user": e.user,
        "auid": e.auid,
        "session": e.session,
        "command": e.command.as_ref().map(|c| c.as_str().to_owned()),
        "program": e.program,
        "target": e.target,
        "event": e.event.to_string(),
        "node": e.node,
        "now": ctx.now,
        "lastRemoteLoginAt": ctx.last_remote_login_at,
        "remoteLogin": e.remote_login.as_ref().map(|l| serde_json::json!({
            "at": l.at.to_string(),
            "addr": l.addr,
            "hostname": l.hostname,
            "program": l.program,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_round_trips_and_garbage_is_located() {
        let p = Position {
            dev: 2049,
            inode: 131_077,
            offset: 4096,
        };
        assert_eq!(parse_position(render_position(&p).as_bytes()), Ok(p));
        assert_eq!(
            parse_position(b"2049 x1 4096\n"),
            Err(PositionError::Syntax {
                column: 6,
                what: "\"x1\" is not a decimal number".into()
            })
        );
        assert!(matches!(
            parse_position(b"1 2\n"),
            Err(PositionError::Syntax { column: 1, .. })
        ));
        assert!(matches!(
            parse_position(&[b'1'; 300]),
            Err(PositionError::TooLarge { .. })
        ));
    }

    #[test]
    fn atomic_writes_leave_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
