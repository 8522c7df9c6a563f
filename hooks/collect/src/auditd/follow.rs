//! Where records come from: the log file, followed across rotation, and the audisp plugin
//! protocol (the same text records, one per line, on a plugin's stdin).
//!
//! Why this module exists: `audit.log` grows while it is read, is renamed away and
//! replaced when auditd rotates it (`max_log_file_action = ROTATE`), may be truncated by
//! hand, and its last line may be half written. [`LogFollower`] reads what is new at each
//! poll and never reads a byte twice or skips one: at rotation it finishes the old file,
//! then reads the new one from its start; at truncation it starts again from 0; a partial
//! last line waits for its newline; a line longer than the cap is dropped (with a located
//! error) without holding more than the cap in memory.
//!
//! [`LineReader`] splits any [`Read`] the same way, and [`AudispSource`] runs one on a thread
//! so the agent can wait for records with a timeout and still close events by its clock
//! when the daemon is quiet.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, SystemTime};

use super::record::RecordError;
use super::session::Elevation;
use super::{LineAt, LineError, Pipeline};
use crate::source::{Clock, CollectError, Collected, FileError, Reading, Unavailable};

/// Where the follower starts in the file it first opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// From the first byte (sessions that logged in before the agent started are seen;
    /// their elevations are reported again).
    Beginning,
    /// From the end: only what is written after the first poll.
    End,
    /// From a byte offset of the file with this device and inode (a saved [`Position`]);
    /// from the beginning if the file at the path is another one.
    Position(Position),
}

/// Log follower settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowConfig {
    /// The log. Default `/var/log/audit/audit.log`.
    pub path: PathBuf,
    /// Where to start. Default [`StartAt::Beginning`].
    pub start: StartAt,
    /// Most bytes read per poll; the rest waits for the next ([`Poll::more`]). Default 16 MiB.
    pub max_bytes_per_poll: usize,
    /// Most line errors kept per poll; the rest are counted. Default 100.
    pub max_errors_per_poll: usize,
}

impl Default for FollowConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("/var/log/audit/audit.log"),
            start: StartAt::Beginning,
            max_bytes_per_poll: 16 * 1024 * 1024,
            max_errors_per_poll: 100,
        }
    }
}

/// How far a file has been read: a cursor the agent can store and resume from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Position {
    /// `st_dev` of the file.
    pub dev: u64,
    /// `st_ino` of the file.
    pub inode: u64,
    /// Where the first line not yet handed to the pipeline starts: the end of the last
    /// complete line. A partial line held in memory is read again on resumption.
    pub offset: u64,
}

/// What one poll read.
#[derive(Debug, Default)]
pub struct Poll {
    /// Lines handed to the pipeline.
    pub lines: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Lines that are not records, located (at most the configured number).
    pub errors: Vec<LineError>,
    /// Errors beyond that number.
    pub errors_dropped: u64,
    /// Rotations followed.
    pub rotations: u32,
    /// Truncations seen.
    pub truncations: u32,
    /// The read budget ran out before the end of the file: poll again soon.
    pub more: bool,
    /// The stream ended (an audisp source whose daemon closed its stdin).
    pub ended: bool,
    /// Elevations that events closed by this poll showed.
    pub elevations: Vec<Elevation>,
}

impl Poll {
    fn error(&mut self, e: LineError, max: usize) {
        if self.errors.len() < max {
            self.errors.push(e);
        } else {
            self.errors_dropped += 1;
        }
    }
}

/// One line cut by a [`LineSplitter`].
enum Cut<'a> {
    Line(&'a [u8], u64, u64),
    TooLong(usize, u64, u64),
}

/// Cuts a byte stream into lines of at most `max` bytes, holding a partial last line.
#[derive(Debug)]
struct LineSplitter {
    max: usize,
    partial: Vec<u8>,
    /// Length of the incomplete line so far (held or, when too long, discarded).
    pending: usize,
    /// Lines completed.
    line: u64,
    /// Offset of the incomplete line's first byte.
    offset: u64,
}

impl LineSplitter {
    fn new(max: usize, offset: u64) -> Self {
        Self {
            max,
            partial: Vec::new(),
            pending: 0,
            line: 0,
            offset,
        }
    }

    /// Bytes consumed so far.
    fn consumed(&self) -> u64 {
        self.offset + self.pending as u64
    }

    fn feed(&mut self, mut chunk: &[u8], mut sink: impl FnMut(Cut<'_>)) {
        while !chunk.is_empty() {
            let Some(nl) = chunk.iter().position(|&b| b == b'\n') else {
                self.hold(chunk);
                return;
            };
            let (seg, rest) = chunk.split_at(nl);
            let total = self.pending + seg.len();
            let number = self.line + 1;
            if total > self.max {
                sink(Cut::TooLong(total, number, self.offset));
            } else if self.partial.is_empty() {
                sink(Cut::Line(seg, number, self.offset));
            } else {
                self.partial.extend_from_slice(seg);
                sink(Cut::Line(&self.partial, number, self.offset));
            }
            self.line = number;
            self.offset += total as u64 + 1;
            self.pending = 0;
            self.partial.clear();
            chunk = rest.get(1..).unwrap_or_default();
        }
    }

    fn hold(&mut self, bytes: &[u8]) {
        self.pending += bytes.len();
        if self.pending > self.max {
            // Too long already: stop holding it (its error comes with its newline).
            self.partial = Vec::new();
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }

    /// Cuts the held partial line as a last line (the stream or the file ended).
    fn finish(&mut self, sink: impl FnMut(Cut<'_>)) {
        if self.pending > 0 {
            self.feed(b"\n", sink);
            // The newline was not in the input.
            self.offset -= 1;
        }
    }

    /// Forgets the partial line and restarts at `offset` (truncation).
    fn reset(&mut self, offset: u64) {
        *self = Self::new(self.max, offset);
    }
}

/// Hands cut lines to the pipeline, collecting errors in `poll`.
fn deliver(
    pipeline: &mut Pipeline,
    poll: &mut Poll,
    origin: &str,
    now: SystemTime,
    max_errors: usize,
) -> impl FnMut(Cut<'_>) {
    move |cut| match cut {
        Cut::Line(bytes, line, offset) => {
            poll.lines += 1;
            if let Err(e) = pipeline.push_line(
                bytes,
                LineAt {
                    origin,
                    line,
                    offset,
                },
                now,
            ) {
                poll.error(e, max_errors);
            }
        }
        Cut::TooLong(len, line, offset) => {
            poll.lines += 1;
            let error = RecordError::TooLong {
                len,
                limit: pipeline.max_line_bytes(),
            };
            poll.error(
                LineError {
                    origin: origin.to_owned(),
                    line,
                    offset,
                    error,
                },
                max_errors,
            );
        }
    }
}

#[derive(Debug)]
struct Current {
    file: File,
    dev: u64,
    inode: u64,
    splitter: LineSplitter,
}

/// Opens a regular file without blocking on a FIFO or device put in its place.
fn open_regular(path: &Path) -> Result<(File, std::fs::Metadata), FileError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(|e| FileError::from_io(path, e))?;
    let meta = file.metadata().map_err(|e| FileError::from_io(path, e))?;
    if !meta.file_type().is_file() {
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind: if meta.file_type().is_dir() {
                "directory"
            } else {
                "special file"
            },
        });
    }
    Ok((file, meta))
}

/// Most rotations and truncations followed in one poll (a log replaced in a loop must not
/// hold the agent).
const MAX_SWITCHES_PER_POLL: u32 = 8;

/// Follows the audit log file (module docs).
#[derive(Debug)]
pub struct LogFollower {
    config: FollowConfig,
    origin: String,
    current: Option<Current>,
    started: bool,
    buf: Vec<u8>,
}

impl LogFollower {
    /// A follower of `config.path`; nothing is opened until the first poll.
    pub fn new(config: FollowConfig) -> Self {
        Self {
            origin: config.path.display().to_string(),
            config,
            current: None,
            started: false,
            buf: vec![0; 64 * 1024],
        }
    }

    /// Where reading stands, once a file is open.
    pub fn position(&self) -> Option<Position> {
        self.current.as_ref().map(|c| Position {
            dev: c.dev,
            inode: c.inode,
            offset: c.splitter.offset,
        })
    }

    fn open(&mut self, max_line: usize) -> Result<Current, FileError> {
        let path = &self.config.path;
        let (mut file, meta) = open_regular(path)?;
        let start = if self.started {
            0
        } else {
            match self.config.start {
                StartAt::Beginning => 0,
                StartAt::End => meta.len(),
                StartAt::Position(p) if p.dev == meta.dev() && p.inode == meta.ino() => {
                    p.offset.min(meta.len())
                }
                StartAt::Position(_) => 0,
            }
        };
        self.started = true;
        if start > 0 {
            file.seek(SeekFrom::Start(start))
                .map_err(|e| FileError::from_io(path, e))?;
        }
        Ok(Current {
            file,
            dev: meta.dev(),
            inode: meta.ino(),
            splitter: LineSplitter::new(max_line, start),
        })
    }

    /// Reads the current file to its end (or the budget); false if the budget ran out.
    fn drain(
        &mut self,
        pipeline: &mut Pipeline,
        poll: &mut Poll,
        budget: &mut usize,
        now: SystemTime,
    ) -> Result<bool, FileError> {
        let max_errors = self.config.max_errors_per_poll;
        let Some(cur) = self.current.as_mut() else {
            return Ok(true);
        };
        loop {
            if *budget == 0 {
                return Ok(false);
            }
            let want = self.buf.len().min(*budget);
            let buf = self.buf.get_mut(..want).unwrap_or_default();
            let n = match cur.file.read(buf) {
                Ok(0) => return Ok(true),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(FileError::from_io(&self.config.path, e)),
            };
            *budget -= n;
            poll.bytes += n as u64;
            let chunk = buf.get(..n).unwrap_or_default();
            cur.splitter.feed(
                chunk,
                deliver(pipeline, poll, &self.origin, now, max_errors),
            );
        }
    }

    /// Reads what is new since the last poll into `pipeline`, follows a rotation or a
    /// truncation, closes idle events by `clock`, and returns the elevations found. A
    /// missing log is [`FileError::NotFound`].
    pub fn poll(&mut self, pipeline: &mut Pipeline, clock: &dyn Clock) -> Result<Poll, FileError> {
        let now = clock.now();
        let mut poll = Poll::default();
        let mut budget = self.config.max_bytes_per_poll.max(1);
        if self.current.is_none() {
            self.current = Some(self.open(pipeline.max_line_bytes())?);
        }
        let path = self.config.path.clone();
        let max_errors = self.config.max_errors_per_poll;
        for _ in 0..=MAX_SWITCHES_PER_POLL {
            if !self.drain(pipeline, &mut poll, &mut budget, now)? {
                poll.more = true;
                break;
            }
            let Some(cur) = self.current.as_mut() else {
                break;
            };
            let at_path = match std::fs::metadata(&path) {
                Ok(m) => m,
                // Renamed away and not yet replaced: keep the old file until it is.
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) => return Err(FileError::from_io(&path, e)),
            };
            if (at_path.dev(), at_path.ino()) != (cur.dev, cur.inode) {
                // Rotated: whatever reached the old file before the switch is read first.
                if !self.drain(pipeline, &mut poll, &mut budget, now)? {
                    poll.more = true;
                    break;
                }
                if let Some(mut old) = self.current.take() {
                    old.splitter.finish(deliver(
                        pipeline,
                        &mut poll,
                        &self.origin,
                        now,
                        max_errors,
                    ));
                }
                poll.rotations += 1;
                match self.open(pipeline.max_line_bytes()) {
                    Ok(c) => self.current = Some(c),
                    Err(FileError::NotFound { .. }) => break,
                    Err(e) => return Err(e),
                }
                continue;
            }
            let len = cur
                .file
                .metadata()
                .map_err(|e| FileError::from_io(&path, e))?
                .len();
            if len < cur.splitter.consumed() {
                cur.file
                    .seek(SeekFrom::Start(0))
                    .map_err(|e| FileError::from_io(&path, e))?;
                cur.splitter.reset(0);
                poll.truncations += 1;
                continue;
            }
            break;
        }
        pipeline.tick(now);
        poll.elevations = pipeline.take_elevations();
        Ok(poll)
    }

    /// [`LogFollower::poll`] as a [`Collected`]: a missing log is unavailable, a log this
    /// process may not read is unavailable with a hint, other failures are errors.
    pub fn collect(&mut self, pipeline: &mut Pipeline, clock: &dyn Clock) -> Collected<Poll> {
        let checked_at = clock.now();
        match self.poll(pipeline, clock) {
            Ok(p) => Collected::Ok(Reading::new(p, checked_at)),
            Err(FileError::NotFound { path }) => Collected::Unavailable {
                reason: Unavailable::Missing { path },
                checked_at,
            },
            Err(FileError::PermissionDenied { path }) => Collected::Unavailable {
                reason: Unavailable::PermissionDenied {
                    path,
                    hint: "auditd writes its log for root only (log_group, mode 0600)".into(),
                },
                checked_at,
            },
            Err(e) => Collected::Error {
                error: CollectError::File(e),
                checked_at,
            },
        }
    }
}

/// A line read from a stream, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLine {
    /// The line without its newline; empty when it was too long.
    pub bytes: Vec<u8>,
    /// 1-based line number in the stream.
    pub line: u64,
    /// Byte offset of its first byte.
    pub offset: u64,
    /// Its length when it was longer than the cap (and dropped).
    pub too_long: Option<usize>,
}

/// Splits any reader (an audisp plugin's stdin) into lines of at most a cap.
#[derive(Debug)]
pub struct LineReader<R> {
    reader: R,
    splitter: LineSplitter,
    buf: Vec<u8>,
    ready: VecDeque<StreamLine>,
    eof: bool,
}

impl<R: Read> LineReader<R> {
    /// A reader of lines of at most `max_line_bytes`.
    pub fn new(reader: R, max_line_bytes: usize) -> Self {
        Self {
            reader,
            splitter: LineSplitter::new(max_line_bytes, 0),
            buf: vec![0; 64 * 1024],
            ready: VecDeque::new(),
            eof: false,
        }
    }

    /// The next line, blocking in `read` as the reader does; `None` at the end of the
    /// stream (a partial last line is returned first).
    pub fn next_line(&mut self) -> io::Result<Option<StreamLine>> {
        loop {
            if let Some(l) = self.ready.pop_front() {
                return Ok(Some(l));
            }
            if self.eof {
                return Ok(None);
            }
            let n = match self.reader.read(&mut self.buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let ready = &mut self.ready;
            let sink = |cut: Cut<'_>| {
                ready.push_back(match cut {
                    Cut::Line(bytes, line, offset) => StreamLine {
                        bytes: bytes.to_vec(),
                        line,
                        offset,
                        too_long: None,
                    },
                    Cut::TooLong(len, line, offset) => StreamLine {
                        bytes: Vec::new(),
                        line,
                        offset,
                        too_long: Some(len),
                    },
                });
            };
            if n == 0 {
                self.eof = true;
                self.splitter.finish(sink);
            } else {
                self.splitter
                    .feed(self.buf.get(..n).unwrap_or_default(), sink);
            }
        }
    }

    /// Reads the whole stream into `pipeline`, then closes every open event.
    pub fn read_to_end(
        &mut self,
        pipeline: &mut Pipeline,
        origin: &str,
        clock: &dyn Clock,
    ) -> io::Result<Poll> {
        let mut poll = Poll::default();
        while let Some(line) = self.next_line()? {
            feed_stream_line(pipeline, &mut poll, origin, line, clock.now(), usize::MAX);
        }
        pipeline.finish();
        poll.ended = true;
        poll.elevations = pipeline.take_elevations();
        Ok(poll)
    }
}

fn feed_stream_line(
    pipeline: &mut Pipeline,
    poll: &mut Poll,
    origin: &str,
    line: StreamLine,
    now: SystemTime,
    max_errors: usize,
) {
    poll.bytes += line.bytes.len() as u64 + 1;
    let mut sink = deliver(pipeline, poll, origin, now, max_errors);
    match line.too_long {
        Some(len) => sink(Cut::TooLong(len, line.line, line.offset)),
        None => sink(Cut::Line(&line.bytes, line.line, line.offset)),
    }
}

/// The audisp plugin protocol: auditd (or audispd) writes each record as a text line to
/// the plugin's stdin. A thread reads the lines into a bounded channel (a slow agent makes
/// the daemon's queue fill, which auditd handles per its `q_depth` and `overflow_action`),
/// and [`AudispSource::poll`] waits for them with a timeout, so idle events still close.
#[derive(Debug)]
pub struct AudispSource {
    origin: String,
    lines: Receiver<io::Result<StreamLine>>,
    ended: bool,
}

impl AudispSource {
    /// Starts reading `reader` (normally stdin) on a thread. `capacity` lines may wait.
    pub fn spawn<R: Read + Send + 'static>(
        reader: R,
        origin: &str,
        max_line_bytes: usize,
        capacity: usize,
    ) -> io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(capacity.max(1));
        std::thread::Builder::new()
            .name("probity-audisp".into())
            .spawn(move || {
                let mut reader = LineReader::new(reader, max_line_bytes);
                loop {
                    let next = reader.next_line();
                    let stop = !matches!(next, Ok(Some(_)));
                    let item = match next {
                        Ok(Some(l)) => Ok(l),
                        Ok(None) => break,
                        Err(e) => Err(e),
                    };
                    if tx.send(item).is_err() || stop {
                        break;
                    }
                }
            })?;
        Ok(Self {
            origin: origin.to_owned(),
            lines: rx,
            ended: false,
        })
    }

    /// Waits up to `wait` for the first line, takes at most `max_lines`, closes idle
    /// events by `clock`, and returns the elevations found. When the stream has ended,
    /// every open event is closed and [`Poll::ended`] is set; a read error is returned
    /// once, after the lines before it.
    pub fn poll(
        &mut self,
        pipeline: &mut Pipeline,
        clock: &dyn Clock,
        wait: Duration,
        max_lines: usize,
    ) -> io::Result<Poll> {
        let mut poll = Poll::default();
        let mut failure = None;
        if !self.ended {
            let mut first = true;
            for _ in 0..max_lines.max(1) {
                let next = if first {
                    first = false;
                    self.lines.recv_timeout(wait).map_err(|e| match e {
                        RecvTimeoutError::Timeout => TryRecvError::Empty,
                        RecvTimeoutError::Disconnected => TryRecvError::Disconnected,
                    })
                } else {
                    self.lines.try_recv()
                };
                match next {
                    Ok(Ok(line)) => {
                        feed_stream_line(pipeline, &mut poll, &self.origin, line, clock.now(), 100);
                    }
                    Ok(Err(e)) => {
                        failure = Some(e);
                        self.ended = true;
                        break;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.ended = true;
                        break;
                    }
                }
            }
        }
        if self.ended {
            pipeline.finish();
            poll.ended = true;
        } else {
            pipeline.tick(clock.now());
        }
        poll.elevations = pipeline.take_elevations();
        match failure {
            Some(e) => Err(e),
            None => Ok(poll),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut_all(max: usize, chunks: &[&[u8]], finish: bool) -> Vec<(String, u64, u64, bool)> {
        let mut s = LineSplitter::new(max, 0);
        let mut out = Vec::new();
        let mut sink = |c: Cut<'_>| match c {
            Cut::Line(b, l, o) => out.push((String::from_utf8_lossy(b).into_owned(), l, o, false)),
            Cut::TooLong(n, l, o) => out.push((n.to_string(), l, o, true)),
        };
        for c in chunks {
            s.feed(c, &mut sink);
        }
        if finish {
            s.finish(&mut sink);
        }
        out
    }

    #[test]
    fn a_partial_line_waits_for_its_newline() {
        let out = cut_all(100, &[b"ab", b"c\nde", b"f\n", b"gh"], false);
        assert_eq!(
            out,
            [("abc".into(), 1, 0, false), ("def".into(), 2, 4, false)]
        );
        let out = cut_all(100, &[b"ab\ncd"], true);
        assert_eq!(out[1], ("cd".into(), 2, 3, false));
    }

    #[test]
    fn an_overlong_line_is_dropped_with_its_length_and_the_next_is_read() {
        let out = cut_all(4, &[b"12", b"345", b"67\nok\n"], false);
        assert_eq!(out, [("7".into(), 1, 0, true), ("ok".into(), 2, 8, false)]);
    }
}
