//! A file-backed source and cursor: one JSON record per line, and a cursor file
//! replaced atomically. Simple by design, for tests, the example binaries and small
//! deployments; the engine's own log implements [`RecordSource`] over its store.
//!
//! One process appends; any number read, in the same process or others. A reader
//! ignores a last line without its newline (an append in progress). Within one
//! process [`FileSource::append`] wakes waiting readers at once; a reader in another
//! process notices new lines by checking the file's length every
//! [`FileSource::POLL`], a sleep, not a spin.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{CursorError, CursorStore, RecordSource, SourceError};
use crate::record::{Record, hex, parse_digest};
use crate::time::{from_unix_micros, unix_micros};

/// Longest line accepted, in bytes.
pub const MAX_LINE: usize = 1 << 20;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    seq: u64,
    hash: String,
    prev: String,
    time_us: i64,
    kind: String,
    severity: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    policy: Option<String>,
    message: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    fields: BTreeMap<String, String>,
}

impl Line {
    fn from_record(r: &Record) -> Self {
        Self {
            seq: r.seq,
            hash: hex(&r.hash),
            prev: hex(&r.prev_hash),
            time_us: unix_micros(r.time),
            kind: r.kind.as_str().to_owned(),
            severity: r.severity.as_str().to_owned(),
            node: r.node.clone(),
            policy: r.policy.clone(),
            message: r.message.clone(),
            fields: r.fields.clone(),
        }
    }

    fn into_record(self) -> Result<Record, String> {
        Ok(Record {
            seq: self.seq,
            hash: parse_digest(&self.hash).ok_or("hash is not 64 hex digits")?,
            prev_hash: parse_digest(&self.prev).ok_or("prev is not 64 hex digits")?,
            time: from_unix_micros(self.time_us),
            kind: self.kind.parse().map_err(|e| format!("{e}"))?,
            severity: self.severity.parse().map_err(|e| format!("{e}"))?,
            node: self.node,
            policy: self.policy,
            message: self.message,
            fields: self.fields,
        })
    }
}

/// Parses one line (without its newline) of a record log.
pub fn parse_line(line: &[u8]) -> Result<Record, String> {
    if line.len() > MAX_LINE {
        return Err(format!("line longer than {MAX_LINE} bytes"));
    }
    let l: Line = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    l.into_record()
}

#[derive(Debug, Default)]
struct Index {
    /// Bytes of the file indexed so far (always at a line boundary).
    scanned: u64,
    /// Lines indexed so far.
    lines: u64,
    /// (seq, byte offset of its line), ascending.
    entries: Vec<(u64, u64)>,
}

/// A record log in a file of JSON lines.
#[derive(Debug)]
pub struct FileSource {
    path: PathBuf,
    sync: bool,
    index: Mutex<Index>,
    grew: Condvar,
}

impl FileSource {
    /// How often a waiting reader checks the file's length.
    pub const POLL: Duration = Duration::from_millis(10);

    /// Opens (creating if absent) the log at `path`. Appends are flushed to disk
    /// (`fdatasync`) before [`FileSource::append`] returns.
    pub fn open(path: &Path) -> Result<Self, SourceError> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| SourceError::Io {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            path: path.to_owned(),
            sync: true,
            index: Mutex::new(Index::default()),
            grew: Condvar::new(),
        })
    }

    /// Whether appends wait for the disk (default true). Benchmarks turn it off.
    pub fn with_sync(mut self, sync: bool) -> Self {
        self.sync = sync;
        self
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, source: std::io::Error) -> SourceError {
        SourceError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends records whose sequence numbers increase past the newest one.
    pub fn append(&self, records: &[Record]) -> Result<(), SourceError> {
        let mut index = self.lock();
        self.refresh(&mut index)?;
        let mut last = index.entries.last().map_or(0, |e| e.0);
        let mut buf = Vec::new();
        for r in records {
            if r.seq <= last {
                return Err(SourceError::OutOfOrder { seq: r.seq, last });
            }
            last = r.seq;
            serde_json::to_writer(&mut buf, &Line::from_record(r))
                .map_err(|e| SourceError::Other(e.to_string()))?;
            buf.push(b'\n');
        }
        let mut f = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|e| self.io(e))?;
        f.write_all(&buf).map_err(|e| self.io(e))?;
        if self.sync {
            f.sync_data().map_err(|e| self.io(e))?;
        }
        drop(index);
        self.grew.notify_all();
        Ok(())
    }

    /// Indexes complete lines added since the last call.
    fn refresh(&self, index: &mut Index) -> Result<(), SourceError> {
        let mut f = File::open(&self.path).map_err(|e| self.io(e))?;
        let len = f.metadata().map_err(|e| self.io(e))?.len();
        if len <= index.scanned {
            return Ok(());
        }
        f.seek(SeekFrom::Start(index.scanned))
            .map_err(|e| self.io(e))?;
        let mut reader = BufReader::new(f.take(len - index.scanned));
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = reader
                .by_ref()
                .take(u64::try_from(MAX_LINE + 1).unwrap_or(u64::MAX))
                .read_until(b'\n', &mut line)
                .map_err(|e| self.io(e))?;
            let offset = index.scanned;
            let malformed = |problem: String| SourceError::Malformed {
                path: self.path.clone(),
                line: index.lines + 1,
                offset,
                problem,
            };
            match line.split_last() {
                Some((b'\n', body)) => {
                    let record = parse_line(body).map_err(malformed)?;
                    let last = index.entries.last().map_or(0, |e| e.0);
                    if record.seq <= last {
                        return Err(malformed(format!(
                            "record {} follows record {last}: sequence numbers must increase",
                            record.seq
                        )));
                    }
                    index.entries.push((record.seq, offset));
                    index.lines += 1;
                    index.scanned += u64::try_from(n).unwrap_or(u64::MAX);
                }
                // A line still being written; or one too long to be a record.
                _ if n > MAX_LINE => {
                    return Err(malformed(format!("line longer than {MAX_LINE} bytes")));
                }
                _ => return Ok(()),
            }
        }
    }
}

impl RecordSource for FileSource {
    fn read(&self, from_seq: u64, limit: usize) -> Result<Vec<Record>, SourceError> {
        let mut index = self.lock();
        self.refresh(&mut index)?;
        let start = index.entries.partition_point(|e| e.0 < from_seq);
        let Some(&(_, offset)) = index.entries.get(start) else {
            return Ok(Vec::new());
        };
        let count = index.entries.len().saturating_sub(start).min(limit);
        let first_line = index.lines - u64::try_from(index.entries.len() - start).unwrap_or(0) + 1;
        drop(index);
        let mut f = File::open(&self.path).map_err(|e| self.io(e))?;
        f.seek(SeekFrom::Start(offset)).map_err(|e| self.io(e))?;
        let mut reader = BufReader::new(f);
        let mut out = Vec::with_capacity(count);
        let mut line = Vec::new();
        let mut at = offset;
        for i in 0..count {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|e| self.io(e))?;
            let body = line.strip_suffix(b"\n").unwrap_or(&line);
            let record = parse_line(body).map_err(|problem| SourceError::Malformed {
                path: self.path.clone(),
                line: first_line + u64::try_from(i).unwrap_or(0),
                offset: at,
                problem,
            })?;
            at += u64::try_from(n).unwrap_or(0);
            out.push(record);
        }
        Ok(out)
    }

    fn newest_seq(&self) -> Result<u64, SourceError> {
        let mut index = self.lock();
        self.refresh(&mut index)?;
        Ok(index.entries.last().map_or(0, |e| e.0))
    }

    fn wait_for(&self, seq: u64, timeout: Duration) -> bool {
        let deadline = crate::after(timeout);
        let mut index = self.lock();
        loop {
            // An unreadable file counts as "nothing new": the next read reports it.
            let _ = self.refresh(&mut index);
            if index.entries.last().is_some_and(|e| e.0 >= seq) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            index = self
                .grew
                .wait_timeout(index, (deadline - now).min(Self::POLL))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// The longest cursor file accepted.
const MAX_CURSOR_FILE: usize = 64;

/// Parses a cursor file: decimal digits (at most 20, the value within `u64`) and a
/// newline.
pub fn parse_cursor(bytes: &[u8]) -> Result<u64, (usize, &'static str)> {
    if bytes.len() > MAX_CURSOR_FILE {
        return Err((MAX_CURSOR_FILE, "a cursor file of at most 64 bytes"));
    }
    let digits = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return Err((0, "a decimal sequence number"));
    }
    if digits > 20 {
        return Err((20, "at most 20 digits"));
    }
    if bytes.get(digits) != Some(&b'\n') {
        return Err((digits, "a newline after the digits"));
    }
    if bytes.len() != digits + 1 {
        return Err((digits + 1, "the end of the file after the newline"));
    }
    let mut v: u64 = 0;
    for b in bytes.iter().take(digits) {
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(b - b'0')))
            .ok_or((0, "a sequence number that fits in 64 bits"))?;
    }
    Ok(v)
}

/// A cursor in a file, replaced atomically (write a temporary file, sync it, rename
/// it over the old one, sync the directory): after a crash the file holds either the
/// old or the new value, never a mix.
#[derive(Debug)]
pub struct FileCursor {
    path: PathBuf,
}

impl FileCursor {
    /// A cursor kept at `path` (created on the first store).
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
        }
    }

    fn io(&self, source: std::io::Error) -> CursorError {
        CursorError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

impl CursorStore for FileCursor {
    fn load(&self) -> Result<u64, CursorError> {
        let f = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(self.io(e)),
        };
        let mut bytes = Vec::new();
        f.take(u64::try_from(MAX_CURSOR_FILE + 1).unwrap_or(u64::MAX))
            .read_to_end(&mut bytes)
            .map_err(|e| self.io(e))?;
        parse_cursor(&bytes).map_err(|(offset, problem)| CursorError::Malformed {
            path: self.path.clone(),
            offset,
            problem,
        })
    }

    fn store(&mut self, seq: u64) -> Result<(), CursorError> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut f = File::create(&tmp).map_err(|e| self.io(e))?;
        f.write_all(format!("{seq}\n").as_bytes())
            .map_err(|e| self.io(e))?;
        f.sync_all().map_err(|e| self.io(e))?;
        drop(f);
        fs::rename(&tmp, &self.path).map_err(|e| self.io(e))?;
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| self.io(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RecordKind, Severity};

    fn record(seq: u64) -> Record {
        Record {
            seq,
            hash: [u8::try_from(seq % 256).unwrap(); 32],
            prev_hash: [7; 32],
            time: from_unix_micros(1_796_075_233_385_181),
            kind: RecordKind::FindingCleared,
            severity: Severity::Low,
            node: Some("gpu-node-1".into()),
            policy: None,
            message: "line \"one\"\nand two".into(),
            fields: [("k".to_owned(), "v".to_owned())].into(),
        }
    }

    #[test]
    fn records_round_trip_through_the_file_and_a_partial_line_waits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        let src = FileSource::open(&path).unwrap().with_sync(false);
        src.append(&(1..=5).map(record).collect::<Vec<_>>())
            .unwrap();
        let got = src.read(2, 2).unwrap();
        assert_eq!(got, vec![record(2), record(3)]);
        // A second reader (as another process would be) sees the same.
        let other = FileSource::open(&path).unwrap();
        assert_eq!(other.newest_seq().unwrap(), 5);
        // Half a line is not a record yet.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"seq\":6").unwrap();
        assert_eq!(other.newest_seq().unwrap(), 5);
        assert!(!other.wait_for(6, Duration::from_millis(1)));
    }

    #[test]
    fn a_malformed_line_is_located() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        let src = FileSource::open(&path).unwrap();
        src.append(&[record(1)]).unwrap();
        let first_len = fs::metadata(&path).unwrap().len();
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"seq\":2}\n").unwrap();
        let e = FileSource::open(&path).unwrap().read(1, 10).unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "{}:2: byte offset {first_len}: missing field",
                path.display()
            )),
            "{text}"
        );
    }

    #[test]
    fn the_cursor_file_is_replaced_whole_and_parsed_strictly() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = FileCursor::new(&dir.path().join("cursor"));
        assert_eq!(c.load().unwrap(), 0);
        c.store(42).unwrap();
        assert_eq!(c.load().unwrap(), 42);
        assert_eq!(fs::read(dir.path().join("cursor")).unwrap(), b"42\n");
        assert_eq!(parse_cursor(b"18446744073709551615\n"), Ok(u64::MAX));
        assert_eq!(
            parse_cursor(b"18446744073709551616\n"),
            Err((0, "a sequence number that fits in 64 bits"))
        );
        assert_eq!(parse_cursor(b"12"), Err((2, "a newline after the digits")));
        assert_eq!(parse_cursor(b"\n"), Err((0, "a decimal sequence number")));
        assert_eq!(
            parse_cursor(b"1\n2"),
            Err((2, "the end of the file after the newline"))
        );
        fs::write(dir.path().join("cursor"), b"x").unwrap();
        assert_eq!(
            c.load().unwrap_err().to_string(),
            format!(
                "{}: byte offset 0: a decimal sequence number",
                dir.path().join("cursor").display()
            )
        );
    }
}
