//! Running a collector's program: no shell, a deadline, capped output.
//!
//! The child runs in a process group of its own, so that on a deadline or an output flood the
//! whole group (the tool and anything it started) is killed, not just the direct child. Each
//! output stream is read by its own thread into a buffer that stops at the cap; the calling
//! thread waits on a channel with the deadline, so no poll loop and no sleep is involved.

use std::ffi::OsString;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdout, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use thiserror::Error;

/// How long the runner waits for the killed group's pipes to close before giving up on them.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// Most bytes of a failed command's own message kept in [`CommandError::Exit`].
const MESSAGE_EXCERPT: usize = 512;

/// One of the child's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
        })
    }
}

/// A program to run and the bounds it runs within.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    program: PathBuf,
    args: Vec<OsString>,
    timeout: Duration,
    output_limit: usize,
}

/// What a program that exited with status 0 printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    /// Standard output.
    pub stdout: Vec<u8>,
    /// Standard error (tools print warnings there even on success).
    pub stderr: Vec<u8>,
}

/// Why running a program failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The program does not exist. Sources report this as unavailable, not as an error.
    #[error("{program}: not found")]
    NotFound {
        /// The program.
        program: PathBuf,
    },
    /// The program exists but could not be started.
    #[error("{program}: cannot start")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The deadline passed; the process group was killed.
    #[error("{program}: no answer within {timeout:?}; its process group was killed")]
    Timeout {
        /// The program.
        program: PathBuf,
        /// The deadline.
        timeout: Duration,
    },
    /// A stream went past the cap; the process group was killed.
    #[error("{program}: {stream} exceeded {limit} bytes; its process group was killed")]
    OutputTooLarge {
        /// The program.
        program: PathBuf,
        /// Which stream.
        stream: Stream,
        /// The cap.
        limit: usize,
    },
    /// The program exited with a failure status.
    #[error("{program}: {status}: {message}")]
    Exit {
        /// The program.
        program: PathBuf,
        /// How it ended.
        status: ExitStatus,
        /// The start of what it printed (stderr, or stdout when stderr was empty).
        message: String,
    },
    /// Reading the program's output failed.
    #[error("{program}: reading {stream}")]
    Read {
        /// The program.
        program: PathBuf,
        /// Which stream.
        stream: Stream,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

enum Event {
    Done(Stream, Vec<u8>),
    Overflow(Stream),
    Failed(Stream, std::io::Error),
    Exited(std::io::Result<ExitStatus>),
}

impl CommandSpec {
    /// Default deadline.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
    /// Default cap per output stream.
    pub const DEFAULT_OUTPUT_LIMIT: usize = 4 * 1024 * 1024;

    /// A program with no arguments, the default deadline (10 s) and cap (4 MiB per stream).
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            timeout: Self::DEFAULT_TIMEOUT,
            output_limit: Self::DEFAULT_OUTPUT_LIMIT,
        }
    }

    /// Adds arguments, passed as they are (no shell).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets the deadline.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the cap, in bytes, on each of stdout and stderr.
    pub fn output_limit(mut self, limit: usize) -> Self {
        self.output_limit = limit;
        self
    }

    /// The program.
    pub fn program(&self) -> &std::path::Path {
        &self.program
    }

    fn spawn(&self) -> Result<Child, CommandError> {
        use std::os::unix::process::CommandExt;

        let mut attempt = 0;
        loop {
            let spawned = std::process::Command::new(&self.program)
                .args(&self.args)
                .env("LC_ALL", "C")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .spawn();
            match spawned {
                Ok(child) => return Ok(child),
                // ETXTBSY: the program file is still open for writing somewhere (it is being
                // installed, or a concurrent fork inherited a write descriptor): try again.
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && attempt < 5 => {
                    attempt += 1;
                    std::thread::yield_now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CommandError::NotFound {
                        program: self.program.clone(),
                    });
                }
                Err(source) => {
                    return Err(CommandError::Spawn {
                        program: self.program.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Runs the program and waits for it, within the deadline and the cap.
    ///
    /// The environment is inherited, with `LC_ALL=C` so that tools print the words the
    /// parsers know. Standard input is closed.
    pub fn run(&self) -> Result<CommandOutput, CommandError> {
        let program = self.program.clone();
        let started = Instant::now();
        let mut child = self.spawn()?;
        let pid = child.id();
        let (tx, rx) = channel();
        spawn_readers(&mut child, self.output_limit, &tx);
        let waiter_tx = tx.clone();
        drop(tx);
        // The waiter owns the child so that it is reaped whatever happens here.
        std::thread::spawn(move || {
            let _ = waiter_tx.send(Event::Exited(child.wait()));
        });

        let deadline = started + self.timeout;
        let mut status = None;
        let mut stdout = None;
        let mut stderr = None;
        let mut failure = None;
        while failure.is_none() && !(status.is_some() && stdout.is_some() && stderr.is_some()) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Event::Exited(Ok(s))) => status = Some(s),
                Ok(Event::Exited(Err(source))) => {
                    failure = Some(CommandError::Spawn {
                        program: program.clone(),
                        source,
                    });
                }
                Ok(Event::Done(Stream::Stdout, bytes)) => stdout = Some(bytes),
                Ok(Event::Done(Stream::Stderr, bytes)) => stderr = Some(bytes),
                Ok(Event::Overflow(stream)) => {
                    failure = Some(CommandError::OutputTooLarge {
                        program: program.clone(),
                        stream,
                        limit: self.output_limit,
                    });
                }
                Ok(Event::Failed(stream, source)) => {
                    failure = Some(CommandError::Read {
                        program: program.clone(),
                        stream,
                        source,
                    });
                }
                Err(RecvTimeoutError::Timeout) => {
                    failure = Some(CommandError::Timeout {
                        program: program.clone(),
                        timeout: self.timeout,
                    });
                }
                // Every sender is gone: the waiter and readers ended without reporting all.
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if let Some(err) = failure {
            kill_group(pid);
            drain_after_kill(&rx, status.is_some());
            return Err(err);
        }
        let (Some(status), Some(stdout), Some(stderr)) = (status, stdout, stderr) else {
            kill_group(pid);
            return Err(CommandError::Timeout {
                program,
                timeout: self.timeout,
            });
        };
        if !status.success() {
            let shown = if stderr.iter().any(|b| !b.is_ascii_whitespace()) {
                &stderr
            } else {
                &stdout
            };
            let message = String::from_utf8_lossy(shown.get(..MESSAGE_EXCERPT).unwrap_or(shown))
                .trim()
                .to_owned();
            return Err(CommandError::Exit {
                program,
                status,
                message,
            });
        }
        Ok(CommandOutput { stdout, stderr })
    }
}

fn spawn_readers(child: &mut Child, limit: usize, tx: &Sender<Event>) {
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        std::thread::spawn(move || read_capped::<ChildStdout>(out, Stream::Stdout, limit, &tx));
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        std::thread::spawn(move || read_capped::<ChildStderr>(err, Stream::Stderr, limit, &tx));
    }
}

fn read_capped<R: Read>(mut pipe: R, stream: Stream, limit: usize, tx: &Sender<Event>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk) {
            Ok(0) => {
                let _ = tx.send(Event::Done(stream, buf));
                return;
            }
            Ok(n) => {
                let got = chunk.get(..n).unwrap_or_default();
                if buf.len() + got.len() > limit {
                    let _ = tx.send(Event::Overflow(stream));
                    return;
                }
                buf.extend_from_slice(got);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = tx.send(Event::Failed(stream, e));
                return;
            }
        }
    }
}

/// Kills the child's process group (its pid is the group id: `process_group(0)`).
fn kill_group(pid: u32) {
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    // ESRCH (the group is already gone) is what we want anyway.
    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
}

/// After a kill, waits a bounded time for the child to be reaped, so no zombie outlives
/// the call in the common case. Readers blocked on a pipe that a stray process still holds
/// are left to finish on their own.
fn drain_after_kill(rx: &Receiver<Event>, already_exited: bool) {
    if already_exited {
        return;
    }
    let deadline = Instant::now() + KILL_GRACE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Event::Exited(_)) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_successful_command_returns_its_output() {
        let out = CommandSpec::new("printf")
            .args(["a%sb", "-"])
            .run()
            .unwrap();
        assert_eq!(out.stdout, b"a-b");
    }

    #[test]
    fn a_failing_command_reports_status_and_stderr() {
        let err = CommandSpec::new("sh")
            .args(["-c", "echo oops >&2; exit 3"])
            .run()
            .unwrap_err();
        match err {
            CommandError::Exit {
                status, message, ..
            } => {
                assert_eq!(status.code(), Some(3));
                assert_eq!(message, "oops");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
