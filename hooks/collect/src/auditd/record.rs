//! One line of the audit log: `[node=NAME ]type=TYPE msg=audit(SECONDS.MILLIS:SERIAL): …`.
//!
//! A line has up to three parts: the kernel's `key=value` fields; for user-space messages
//! a second `msg='…'` holding the sender's own fields; and, in the ENRICHED format, a part
//! after the byte 0x1d (GS) with upper-case translated fields (`AUID="alice"`).
//!
//! Values come three ways: `"quoted"`, bare (`auid=1001`, `res=success`, `key=(null)`), or
//! as **bare upper-case hex** where auditd found a space, quote, control or non-ASCII byte
//! in a string field. Hex is decoded only for the fields that auditd encodes (`cmd`,
//! `proctitle`, `cwd`, `exe`, `acct`, `data`, `comm`, `name`, `key`, EXECVE `aN`…): a
//! bare `a0=7fff0` in a SYSCALL record is a register, not text.
//!
//! Secret-bearing values are redacted here, while they are decoded, so a [`Record`] never
//! holds them (see [`super::redact`]): EXECVE `a1`, `a2`… (and their `aN[i]` pieces) become
//! the marker; `proctitle=` and `cmd=` become a [`RedactedCommand`] (program plus markers);
//! `TTY`/`USER_TTY` `data=` (keystrokes) becomes the marker.

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, SystemTime};

use thiserror::Error;

use super::record_type::RecordType;
use super::redact::{RedactedCommand, Redaction};

/// Longest line accepted unless configured otherwise. The kernel caps a record near 8,970
/// bytes; ENRICHED translations add to it.
pub const DEFAULT_MAX_LINE_BYTES: usize = 64 * 1024;

/// The ENRICHED separator (ASCII group separator).
const GS: u8 = 0x1d;

/// The value of `auid=` and `ses=` that means "not set".
pub const UNSET: u32 = u32::MAX;

/// When an event happened, as the kernel stamped it: seconds and milliseconds since the
/// Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AuditTime {
    /// Whole seconds since 1970-01-01T00:00:00Z.
    pub secs: u64,
    /// Milliseconds, 0–999.
    pub millis: u16,
}

impl AuditTime {
    /// The time `secs.millis`.
    pub fn new(secs: u64, millis: u16) -> Self {
        Self { secs, millis }
    }

    /// As a [`SystemTime`]; `None` only for a time the platform cannot represent.
    pub fn to_system_time(self) -> Option<SystemTime> {
        SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_secs(self.secs))?
            .checked_add(Duration::from_millis(u64::from(self.millis)))
    }

    /// Milliseconds since the epoch (saturating).
    pub fn as_millis(self) -> u128 {
        u128::from(self.secs) * 1000 + u128::from(self.millis)
    }

    /// How long after `earlier` this is; `None` if it is before.
    pub fn since(self, earlier: AuditTime) -> Option<Duration> {
        let ms = self.as_millis().checked_sub(earlier.as_millis())?;
        Some(Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
    }

    /// This time plus `d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Self {
        let total = self
            .as_millis()
            .saturating_add(d.as_millis())
            .min(u128::from(u64::MAX) * 1000 + 999);
        Self {
            secs: u64::try_from(total / 1000).unwrap_or(u64::MAX),
            millis: u16::try_from(total % 1000).unwrap_or(999),
        }
    }
}

impl fmt::Display for AuditTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}", self.secs, self.millis)
    }
}

/// What `audit(SECONDS.MILLIS:SERIAL)` names: every record of one event carries the same.
/// Serials restart at boot and auditd's own DAEMON_* records carry a serial of its own,
/// so only the pair (with the node) identifies an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId {
    /// When.
    pub time: AuditTime,
    /// The serial.
    pub serial: u64,
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.time, self.serial)
    }
}

/// Which part of a line a field came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The kernel's fields (`pid=… uid=… auid=… ses=…`, or a whole kernel record).
    Kernel,
    /// The sender's fields inside `msg='…'`.
    User,
    /// The ENRICHED translations after 0x1d (`UID="root" AUID="alice"`).
    Enriched,
}

/// How a value was printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueKind {
    /// In double quotes (the quotes are not part of the value).
    Quoted,
    /// Bare: numbers, `?`, `(null)`, words.
    Bare,
    /// Bare hex of an encoded field, decoded (invalid UTF-8 replaced by U+FFFD).
    Hex,
    /// Withheld: the value is the redaction marker or a [`RedactedCommand`]'s text.
    Redacted,
}

/// One `name=value` of a record, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field<'a> {
    /// Which part of the line.
    pub part: Part,
    /// The name as printed (`auid`, `a1[0]`, `old-auid`, `AUID`).
    pub name: &'a str,
    /// The value: unquoted, hex decoded, or redacted.
    pub value: &'a str,
    /// How it was printed.
    pub kind: ValueKind,
}

/// Parser settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseOptions {
    /// Longest line accepted, without its newline. Default [`DEFAULT_MAX_LINE_BYTES`].
    pub max_line_bytes: usize,
    /// How withheld values are shown. Default [`Redaction::default`].
    pub redaction: Redaction,
}

impl Default for ParseOptions {
    fn default() -> Self {
        Self {
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            redaction: Redaction::default(),
        }
    }
}

/// Why a line is not an audit record. Columns are 1-based byte columns in the line.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Longer than the limit.
    #[error("{len} bytes, more than the limit of {limit}")]
    TooLong {
        /// Line length (at least; a reader stops counting at the limit).
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A byte sequence that is not UTF-8 (auditd writes ASCII and hex-encodes the rest).
    #[error("column {column}: not UTF-8")]
    NotUtf8 {
        /// Column of the first bad byte.
        column: usize,
    },
    /// The line does not start with `type=` (after an optional `node=NAME `). Like every
    /// error here it quotes at most one token of the line, never its fields.
    #[error("column {column}: expected `type=`, found {found:?}")]
    MissingType {
        /// Where `type=` was expected.
        column: usize,
        /// What is there.
        found: String,
    },
    /// No `msg=audit(SECONDS.MILLIS:SERIAL)` after the type: no event to put it in.
    /// (`ausearch -i` output, with dates instead of seconds, is not supported.)
    #[error("column {column}: expected `msg=audit(SECONDS.MILLIS:SERIAL)`, found {found:?}")]
    BadHeader {
        /// Where the header was expected or went wrong.
        column: usize,
        /// What is there.
        found: String,
    },
    /// A quote that is never closed.
    #[error("column {column}: unterminated {quote} quote")]
    Unterminated {
        /// Where the quote opens.
        column: usize,
        /// `"`, `'` or `{`.
        quote: char,
    },
    /// `=value` with no name.
    #[error("column {column}: a value without a field name")]
    EmptyName {
        /// Where.
        column: usize,
    },
}

impl RecordError {
    /// The 1-based column the error points at, if it points at one.
    pub fn column(&self) -> Option<usize> {
        match self {
            Self::TooLong { .. } => None,
            Self::NotUtf8 { column }
            | Self::MissingType { column, .. }
            | Self::BadHeader { column, .. }
            | Self::Unterminated { column, .. }
            | Self::EmptyName { column } => Some(*column),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    part: Part,
    kind: ValueKind,
    name: (u32, u32),
    value: (u32, u32),
}

/// One parsed line. Secret-bearing values are already redacted (module docs).
#[derive(Debug, Clone)]
pub struct Record {
    node: Option<Box<str>>,
    record_type: RecordType,
    id: EventId,
    // Names and values, back to back; entries point into it. One allocation per record.
    buf: String,
    entries: Vec<Entry>,
    text: Option<Box<str>>,
    command: Option<RedactedCommand>,
}

impl Record {
    /// The `node=` name, when auditd's `name_format` adds one.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// The `type=`.
    pub fn record_type(&self) -> &RecordType {
        &self.record_type
    }

    /// The event this record belongs to.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// The event's time.
    pub fn time(&self) -> AuditTime {
        self.id.time
    }

    fn slice(&self, (a, b): (u32, u32)) -> &str {
        self.buf.get(a as usize..b as usize).unwrap_or_default()
    }

    fn view(&self, e: &Entry) -> Field<'_> {
        Field {
            part: e.part,
            name: self.slice(e.name),
            value: self.slice(e.value),
            kind: e.kind,
        }
    }

    /// Every field, in line order.
    pub fn fields(&self) -> impl Iterator<Item = Field<'_>> + '_ {
        self.entries.iter().map(|e| self.view(e))
    }

    /// The first field `name` of `part`.
    pub fn field_in(&self, part: Part, name: &str) -> Option<Field<'_>> {
        self.entries
            .iter()
            .filter(|e| e.part == part)
            .map(|e| self.view(e))
            .find(|f| f.name == name)
    }

    /// The value of `name` from the kernel's fields, else from the sender's `msg='…'`.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.field_in(Part::Kernel, name)
            .or_else(|| self.field_in(Part::User, name))
            .map(|f| f.value)
    }

    /// The value of an ENRICHED field (`AUID`, `UID`, `SYSCALL`…).
    pub fn enriched(&self, name: &str) -> Option<&str> {
        self.field_in(Part::Enriched, name).map(|f| f.value)
    }

    /// A decimal field as a number.
    pub fn number(&self, name: &str) -> Option<u64> {
        self.field(name)?.parse().ok()
    }

    /// A uid, auid or session id; `None` when absent, not a number, or unset
    /// (`4294967295`, `-1`).
    pub fn id_field(&self, name: &str) -> Option<u32> {
        let v: u32 = self.field(name)?.parse().ok()?;
        (v != UNSET).then_some(v)
    }

    /// `res=`: `Some(true)` for `success`/`yes`/`1`, `Some(false)` for `failed`/`no`/`0`.
    pub fn succeeded(&self) -> Option<bool> {
        match self.field("res")? {
            "success" | "yes" | "1" => Some(true),
            "failed" | "fail" | "no" | "0" => Some(false),
            _ => None,
        }
    }

    /// The free-text words of old-style records (`auditd start, ver=…` gives
    /// `auditd start,`), joined by spaces.
    pub fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }

    /// The redacted command of a `cmd=` (USER_CMD) or `proctitle=` (PROCTITLE) field.
    pub fn command(&self) -> Option<&RedactedCommand> {
        self.command.as_ref()
    }
}

/// Parses one line (with or without its `\n`). Never panics; a line that is not a record
/// gives an error with the column.
pub fn parse_record(line: &[u8], options: &ParseOptions) -> Result<Record, RecordError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.len() > options.max_line_bytes {
        return Err(RecordError::TooLong {
            len: line.len(),
            limit: options.max_line_bytes,
        });
    }
    let (main, enriched) = match line.iter().position(|&b| b == GS) {
        Some(i) => (
            line.get(..i).unwrap_or_default(),
            Some((i + 1, line.get(i + 1..).unwrap_or_default())),
        ),
        None => (line, None),
    };
    let main = utf8(main, 0)?;
    let enriched = enriched
        .map(|(base, b)| utf8(b, base).map(|s| (base, s)))
        .transpose()?;

    let (node, record_type, id, body_start) = parse_header(main)?;
    let mut b = Builder {
        record_type: &record_type,
        options,
        buf: String::with_capacity(line.len()),
        entries: Vec::with_capacity(24),
        text: String::new(),
        command: None,
    };
    b.tokenize(
        main.get(body_start..).unwrap_or_default(),
        body_start,
        Part::Kernel,
    )?;
    if let Some((base, s)) = enriched {
        b.tokenize(s, base, Part::Enriched)?;
    }
    let Builder {
        buf,
        entries,
        text,
        command,
        ..
    } = b;
    Ok(Record {
        node: node.map(Into::into),
        record_type,
        id,
        buf,
        entries,
        text: (!text.is_empty()).then(|| text.into_boxed_str()),
        command,
    })
}

fn utf8(bytes: &[u8], base: usize) -> Result<&str, RecordError> {
    std::str::from_utf8(bytes).map_err(|e| RecordError::NotUtf8 {
        column: base + e.valid_up_to() + 1,
    })
}

/// The token at the start of `s`, cut short: what an error may quote of a line. Never
/// more than one token, so an error cannot carry the fields (and secrets) after it.
fn token(s: &str) -> String {
    let end = s.find(' ').unwrap_or(s.len());
    let mut t: String = s.get(..end).unwrap_or_default().chars().take(40).collect();
    if t.len() < end {
        t.push('…');
    }
    t
}

fn bad_header(line: &str, at: usize) -> RecordError {
    RecordError::BadHeader {
        column: at + 1,
        found: token(line.get(at..).unwrap_or_default()),
    }
}

/// `[node=NAME ]type=TYPE msg=audit(S.MMM:SERIAL)[:]`: the node, type, id, and where the
/// fields start.
fn parse_header(line: &str) -> Result<(Option<&str>, RecordType, EventId, usize), RecordError> {
    let mut pos = 0;
    let mut node = None;
    if let Some(after) = line.strip_prefix("node=") {
        let end = after.find(' ').ok_or_else(|| bad_header(line, 5))?;
        node = after.get(..end);
        pos = 5 + end + 1;
    }
    let rest = line.get(pos..).unwrap_or_default();
    let Some(after_type) = rest.strip_prefix("type=") else {
        return Err(RecordError::MissingType {
            column: pos + 1,
            found: token(rest),
        });
    };
    pos += 5;
    let end = after_type.find(' ').unwrap_or(after_type.len());
    let name = after_type.get(..end).unwrap_or_default();
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b'=') {
        return Err(RecordError::MissingType {
            column: pos + 1,
            found: token(name),
        });
    }
    let record_type = RecordType::from_name(name);
    pos += end;
    pos += line
        .get(pos..)
        .unwrap_or_default()
        .bytes()
        .take_while(|&b| b == b' ')
        .count();
    let header = line
        .get(pos..)
        .and_then(|s| s.strip_prefix("msg=audit("))
        .ok_or_else(|| bad_header(line, pos))?;
    let id_start = pos + 10;
    let close = header.find(')').ok_or_else(|| bad_header(line, id_start))?;
    let id = parse_event_id(header.get(..close).unwrap_or_default())
        .ok_or_else(|| bad_header(line, id_start))?;
    let mut body = id_start + close + 1;
    if line.as_bytes().get(body) == Some(&b':') {
        body += 1;
    }
    Ok((node, record_type, id, body))
}

/// `SECONDS.MMM:SERIAL`.
fn parse_event_id(s: &str) -> Option<EventId> {
    let (time, serial) = s.split_once(':')?;
    let (secs, millis) = time.split_once('.')?;
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if !digits(secs) || millis.len() != 3 || !digits(millis) || !digits(serial) {
        return None;
    }
    Some(EventId {
        time: AuditTime {
            secs: secs.parse().ok()?,
            millis: millis.parse().ok()?,
        },
        serial: serial.parse().ok()?,
    })
}

/// What a secret-bearing field turns into.
enum Secret {
    /// The whole value becomes the marker.
    Whole,
    /// NUL-separated argv: program plus markers.
    Argv,
    /// A space-separated command line: program plus markers.
    Words,
}

/// `aN` or `aN[i]` of an EXECVE record: `Some(N)`.
fn execve_argument(name: &str) -> Option<u64> {
    let rest = name.strip_prefix('a')?;
    let digits = match rest.find('[') {
        Some(i) => {
            let (d, idx) = rest.split_at(i);
            let inner = idx.strip_prefix('[')?.strip_suffix(']')?;
            if inner.is_empty() || !inner.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            d
        }
        None => rest,
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn secret(record_type: &RecordType, name: &str) -> Option<Secret> {
    match (record_type, name) {
        (_, "proctitle") => Some(Secret::Argv),
        (_, "cmd") => Some(Secret::Words),
        (RecordType::Tty | RecordType::UserTty, "data") => Some(Secret::Whole),
        (RecordType::Execve, n) => match execve_argument(n) {
            Some(0) | None => None,
            Some(_) => Some(Secret::Whole),
        },
        _ => None,
    }
}

/// Whether auditd hex-encodes this field when it holds an awkward byte.
fn is_encoded(record_type: &RecordType, name: &str) -> bool {
    matches!(
        name,
        "cmd"
            | "proctitle"
            | "cwd"
            | "exe"
            | "acct"
            | "data"
            | "comm"
            | "ocomm"
            | "name"
            | "path"
            | "key"
            | "dir"
            | "watch"
            | "vm"
            | "root_dir"
    ) || (*record_type == RecordType::Execve && execve_argument(name).is_some())
}

/// Decodes even-length hex; `None` if it is not hex.
fn decode_hex(s: &str) -> Option<Vec<u8>> {
    // An empty value stays as written rather than being called hex.
    if s.is_empty() {
        return None;
    }
    hex::decode(s).ok()
}

struct Builder<'a> {
    record_type: &'a RecordType,
    options: &'a ParseOptions,
    buf: String,
    entries: Vec<Entry>,
    text: String,
    command: Option<RedactedCommand>,
}

impl Builder<'_> {
    fn store(&mut self, s: &str) -> (u32, u32) {
        // Lines are capped far below 4 GiB, so offsets fit; saturate rather than wrap.
        let start = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf.push_str(s);
        (start, u32::try_from(self.buf.len()).unwrap_or(u32::MAX))
    }

    fn push(&mut self, part: Part, name: &str, value: &str, kind: ValueKind) {
        let name = self.store(name);
        let value = self.store(value);
        self.entries.push(Entry {
            part,
            kind,
            name,
            value,
        });
    }

    fn push_word(&mut self, word: &str) {
        if !self.text.is_empty() {
            self.text.push(' ');
        }
        self.text.push_str(word);
    }

    fn push_value(&mut self, part: Part, name: &str, raw: &str, quoted: bool) {
        let base_kind = if quoted {
            ValueKind::Quoted
        } else {
            ValueKind::Bare
        };
        if part == Part::Enriched {
            self.push(part, name, raw, base_kind);
            return;
        }
        let decoded = (!quoted && is_encoded(self.record_type, name))
            .then(|| decode_hex(raw))
            .flatten();
        match secret(self.record_type, name) {
            None => match decoded {
                Some(bytes) => {
                    let text = String::from_utf8_lossy(&bytes);
                    self.push(part, name, &text, ValueKind::Hex);
                }
                None => self.push(part, name, raw, base_kind),
            },
            Some(Secret::Whole) => {
                let options = self.options;
                self.push(part, name, &options.redaction.marker, ValueKind::Redacted);
            }
            Some(Secret::Argv) => {
                let bytes: Cow<'_, [u8]> = match decoded {
                    Some(b) => b.into(),
                    None => raw.as_bytes().into(),
                };
                let cmd = RedactedCommand::from_nul_separated(&bytes, &self.options.redaction);
                self.push(part, name, cmd.as_str(), ValueKind::Redacted);
                self.command = Some(cmd);
            }
            Some(Secret::Words) => {
                let text: Cow<'_, str> = match &decoded {
                    Some(b) => String::from_utf8_lossy(b),
                    None => raw.into(),
                };
                let cmd = RedactedCommand::from_words(&text, &self.options.redaction);
                self.push(part, name, cmd.as_str(), ValueKind::Redacted);
                self.command = Some(cmd);
            }
        }
    }

    /// Splits `s` (which starts at byte `base` of the line) into fields of `part`.
    fn tokenize(&mut self, s: &str, base: usize, part: Part) -> Result<(), RecordError> {
        let bytes = s.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes.get(i) == Some(&b' ') {
                i += 1;
                continue;
            }
            let start = i;
            let stop = bytes
                .get(start..)
                .and_then(|rest| rest.iter().position(|&b| b == b' ' || b == b'='))
                .map_or(bytes.len(), |p| start + p);
            if bytes.get(stop) != Some(&b'=') {
                self.push_word(s.get(start..stop).unwrap_or_default());
                i = stop;
                continue;
            }
            let name = s.get(start..stop).unwrap_or_default();
            if name.is_empty() {
                return Err(RecordError::EmptyName {
                    column: base + start + 1,
                });
            }
            let v = stop + 1;
            let unterminated = |quote| RecordError::Unterminated {
                column: base + v + 1,
                quote,
            };
            match bytes.get(v) {
                Some(b'\'') if part == Part::Kernel && name == "msg" => {
                    let close = s.rfind('\'').filter(|&c| c > v).ok_or(unterminated('\''))?;
                    self.tokenize(
                        s.get(v + 1..close).unwrap_or_default(),
                        base + v + 1,
                        Part::User,
                    )?;
                    i = close + 1;
                }
                Some(b'"') => {
                    let len = s
                        .get(v + 1..)
                        .and_then(|rest| rest.find('"'))
                        .ok_or(unterminated('"'))?;
                    let value = s.get(v + 1..v + 1 + len).unwrap_or_default();
                    self.push_value(part, name, value, true);
                    i = v + 1 + len + 1;
                }
                Some(b'{') if part == Part::Enriched => {
                    let len = s
                        .get(v..)
                        .and_then(|rest| rest.find('}'))
                        .ok_or(unterminated('{'))?;
                    let value = s.get(v..=v + len).unwrap_or_default();
                    self.push_value(part, name, value, false);
                    i = v + len + 1;
                }
                _ => {
                    let end = bytes
                        .get(v..)
                        .and_then(|rest| rest.iter().position(|&b| b == b' '))
                        .map_or(bytes.len(), |p| v + p);
                    let value = s.get(v..end).unwrap_or_default();
                    self.push_value(part, name, value, false);
                    i = end;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Record {
        parse_record(line.as_bytes(), &ParseOptions::default()).unwrap()
    }

    fn err(line: &[u8]) -> RecordError {
        parse_record(line, &ParseOptions::default()).unwrap_err()
    }

    #[test]
    fn kernel_user_and_enriched_parts_are_split() {
        let r = parse(
            "type=USER_CMD msg=audit(1796075114.065:29): pid=15242 uid=1001 auid=1001 ses=1 \
             msg='cwd=\"/home/alice\" cmd=6C73202D6C61202F726F6F74 exe=\"/usr/bin/sudo\" \
             terminal=? res=success'\x1dUID=\"alice\" AUID=\"alice\"\n",
        );
        assert_eq!(*r.record_type(), RecordType::UserCmd);
        assert_eq!(r.id().to_string(), "1796075114.065:29");
        assert_eq!(r.id_field("auid"), Some(1001));
        assert_eq!(r.field_in(Part::User, "cwd").unwrap().value, "/home/alice");
        assert_eq!(r.field("exe"), Some("/usr/bin/sudo"));
        assert_eq!(r.field("terminal"), Some("?"));
        assert_eq!(r.succeeded(), Some(true));
        assert_eq!(r.enriched("AUID"), Some("alice"));
        let cmd = r.field_in(Part::User, "cmd").unwrap();
        assert_eq!(cmd.kind, ValueKind::Redacted);
        assert_eq!(cmd.value, "ls <redacted> <redacted>");
        assert_eq!(r.command().unwrap().program(), "ls");
    }

    #[test]
    fn hex_is_decoded_only_in_encoded_fields() {
        let r = parse(
            "type=SYSCALL msg=audit(1.000:2): arch=c000003e syscall=42 a0=6 a1=7ffeb50e4570 \
             exe=2F7573722F62696E2F707974686F6E key=(null) comm=\"x\"",
        );
        assert_eq!(r.field("a1"), Some("7ffeb50e4570"));
        assert_eq!(r.field("arch"), Some("c000003e"));
        assert_eq!(
            r.field_in(Part::Kernel, "exe").unwrap().kind,
            ValueKind::Hex
        );
        assert_eq!(r.field("exe"), Some("/usr/bin/python"));
        assert_eq!(r.field("key"), Some("(null)"));
        let acct = parse(
            "type=USER_LOGIN msg=audit(1.000:3): pid=1 uid=0 auid=4294967295 ses=4294967295 \
             msg='op=login acct=28696E76616C6964207573657229 exe=\"/usr/sbin/sshd\" res=failed'",
        );
        assert_eq!(acct.field("acct"), Some("(invalid user)"));
        assert_eq!(acct.id_field("auid"), None);
        assert_eq!(acct.succeeded(), Some(false));
    }

    #[test]
    fn execve_arguments_after_argv0_are_withheld() {
        let r = parse(
            "type=EXECVE msg=audit(1.000:4): argc=3 a0=\"bash\" a1=\"-c\" \
             a2=6563686F20466978747572652D506173732D313233",
        );
        assert_eq!(r.field("a0"), Some("bash"));
        assert_eq!(r.field("a1"), Some("<redacted>"));
        assert_eq!(r.field("a2"), Some("<redacted>"));
        assert!(!format!("{r:?}").contains("Fixture"));
        let split = parse("type=EXECVE msg=audit(1.000:5): a1_len=8 a1[0]=41414141 a1[1]=42424242");
        assert_eq!(split.field("a1_len"), Some("8"));
        assert_eq!(split.field("a1[0]"), Some("<redacted>"));
    }

    #[test]
    fn proctitle_keeps_the_program_only() {
        let r = parse(
            "type=PROCTITLE msg=audit(1.000:6): proctitle=7375646F002D53002D7000006C73002D6C61002F726F6F74",
        );
        assert_eq!(
            r.field("proctitle"),
            Some("sudo <redacted> <redacted> <redacted> <redacted> <redacted> <redacted>")
        );
        assert_eq!(r.command().unwrap().argument_count(), Some(6));
        let q = parse("type=PROCTITLE msg=audit(1.000:7): proctitle=\"bash\"");
        assert_eq!(q.field("proctitle"), Some("bash"));
    }

    #[test]
    fn keystrokes_are_withheld() {
        let r =
            parse("type=USER_TTY msg=audit(1.000:8): pid=1 uid=0 auid=1000 ses=7 data=7375202D");
        assert_eq!(r.field("data"), Some("<redacted>"));
        let t = parse("type=TTY msg=audit(1.000:9): tty pid=2 uid=1000 data=\"exit\"");
        assert_eq!(t.field("data"), Some("<redacted>"));
        assert_eq!(t.text(), Some("tty"));
    }

    #[test]
    fn node_prefix_unknown_types_and_old_free_text() {
        let r = parse("node=gpu-a1 type=UNKNOWN[1329] msg=audit(1.001:2): x=1");
        assert_eq!(r.node(), Some("gpu-a1"));
        assert_eq!(*r.record_type(), RecordType::Unknown(1329));
        let d = parse(
            "type=DAEMON_CONFIG msg=audit(1490239800.477:34) config changed, auid=0 pid=1512 res=success",
        );
        assert_eq!(d.text(), Some("config changed,"));
        assert_eq!(d.field("pid"), Some("1512"));
        let e = parse(
            "type=SOCKADDR msg=audit(1.000:3): saddr=10\x1dSADDR={ saddr_fam=netlink nlnk-pid=0 }",
        );
        assert_eq!(
            e.enriched("SADDR"),
            Some("{ saddr_fam=netlink nlnk-pid=0 }")
        );
    }

    #[test]
    fn malformed_lines_are_located() {
        assert_eq!(
            err(b"type=UNKNOWN[1329] msg=?"),
            RecordError::BadHeader {
                column: 20,
                found: "msg=?".into()
            }
        );
        assert!(matches!(
            err(b"hello"),
            RecordError::MissingType { column: 1, .. }
        ));
        assert!(matches!(
            err(b"type=X msg=audit(1.2:3): a=1"),
            RecordError::BadHeader { column: 18, .. }
        ));
        assert_eq!(
            err(b"type=X msg=audit(1.002:3): a=\"open"),
            RecordError::Unterminated {
                column: 30,
                quote: '"'
            }
        );
        assert_eq!(
            err(b"type=X msg=audit(1.002:3): a=1 =2"),
            RecordError::EmptyName { column: 32 }
        );
        assert_eq!(
            err(b"type=X msg=audit(1.002:3): a=\xff"),
            RecordError::NotUtf8 { column: 30 }
        );
        let opts = ParseOptions {
            max_line_bytes: 10,
            ..ParseOptions::default()
        };
        assert!(matches!(
            parse_record(b"type=X msg=audit(1.002:3):", &opts),
            Err(RecordError::TooLong { limit: 10, .. })
        ));
    }

    #[test]
    fn an_error_quotes_one_token_and_never_the_fields_after_it() {
        let e = err(b"type=EXECVE msg=audit(17x:3): argc=2 a0=\"mysql\" a1=\"-pSecret\"");
        assert_eq!(
            e,
            RecordError::BadHeader {
                column: 23,
                found: "17x:3):".into()
            }
        );
        let e = err(b"a0=\"mysql\" a1=\"-pSecret\"");
        assert!(!e.to_string().contains("Secret"), "{e}");
    }

    #[test]
    fn audit_time_arithmetic() {
        let a = AuditTime::new(100, 900);
        let b = AuditTime::new(101, 100);
        assert_eq!(b.since(a), Some(Duration::from_millis(200)));
        assert_eq!(a.since(b), None);
        assert_eq!(
            a.saturating_add(Duration::from_millis(250)),
            AuditTime::new(101, 150)
        );
        assert_eq!(a.to_string(), "100.900");
    }
}
