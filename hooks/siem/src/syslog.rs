//! RFC 5424 syslog messages: records become messages a SIEM can index, and messages
//! can be read back ([`parse`]) to check what a receiver stored.
//!
//! A message looks like this (one line, BOM shown as `BOM`):
//!
//! ```text
//! <106>1 2026-11-30T21:47:13.385181Z gpu-node-1 probity 4242 decision [probity@32473
//!  seq="17" hash="9f…" prev="4c…" kind="decision" severity="high" node="gpu-node-7"
//!  policy="integrity.unverified-read" decision="deny" action="Action::\"read\""]
//!  BOMcheckpoint failed verification
//! ```
//!
//! Choices, and why:
//! * **Facility 13, "log audit"** by default (PRI = 13 × 8 + severity): RFC 5424's
//!   facility for audit trails, kept apart from authentication chatter (4 auth, 10
//!   authpriv) so a relay can route Probity's trail with one selector (`audit.*` in
//!   rsyslog's naming). Configurable, e.g. to a `local0..7` facility a site reserves.
//! * **SD-ID `probity@32473`** by default. RFC 5424 §7.2.2 wants `name@<private
//!   enterprise number>`; Probity has no IANA number of its own, and 32473 is the one
//!   IANA reserves for documentation and examples (RFC 5612), so the default claims no
//!   one else's number. A site that registers its own (free, at IANA) sets
//!   [`SyslogConfig::enterprise_number`].
//! * **Every message carries seq, hash and prev** in that element, and the size limit
//!   never cuts them: the MSG is shortened first (at a UTF-8 boundary), then extra
//!   fields are left out, largest first, and `truncated`/`omitted` say so. Delivery
//!   is at least once, so a SIEM drops a repeated `(seq, hash)`.
//! * **MSG is UTF-8 and starts with a BOM**, as RFC 5424 §6.4 requires of UTF-8 text.
//! * **MSGID** is the record kind (`decision`, `key-event`, …); **APP-NAME** `probity`;
//!   **PROCID** the forwarding process's id.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::record::Record;
use crate::time::write_rfc3339_micros;

mod parse;

pub use parse::{MAX_MESSAGE, ParseError, SdElement, SyslogMessage, parse};

/// The UTF-8 byte order mark that starts a UTF-8 MSG.
pub const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The smallest message size limit accepted: RFC 5425 §4.3.1 has every receiver
/// accept 2048 octets, and it leaves room for the header and the element that holds
/// seq and hash at their longest.
pub const MIN_MESSAGE_SIZE: usize = 2048;
/// The largest message size limit accepted.
pub const MAX_MESSAGE_SIZE: usize = 1 << 20;
/// Longest `node` or `policy` value carried (bytes; longer ones are cut and marked).
pub const MAX_NAME_VALUE: usize = 255;
/// The IANA private enterprise number reserved for documentation (RFC 5612).
pub const DOCUMENTATION_ENTERPRISE_NUMBER: u32 = 32473;

/// Parameter names this crate writes itself; an extra field with one of these names is
/// carried as `x-<name>`.
const RESERVED: [&str; 9] = [
    "seq",
    "hash",
    "prev",
    "kind",
    "severity",
    "node",
    "policy",
    "truncated",
    "omitted",
];

/// A syslog facility (0–23).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facility(u8);

impl Facility {
    /// 4, security/authorization messages.
    pub const AUTH: Facility = Facility(4);
    /// 10, security/authorization messages (private).
    pub const AUTHPRIV: Facility = Facility(10);
    /// 13, log audit: the default.
    pub const LOG_AUDIT: Facility = Facility(13);
    /// 14, log alert.
    pub const LOG_ALERT: Facility = Facility(14);
    /// 16, local use 0 (17–23 are local1–local7).
    pub const LOCAL0: Facility = Facility(16);

    /// The facility with this code, if it is one (0–23).
    pub fn new(code: u8) -> Result<Self, FormatError> {
        if code <= 23 {
            Ok(Facility(code))
        } else {
            Err(FormatError::Facility { code })
        }
    }

    /// The numeric code.
    pub fn code(self) -> u8 {
        self.0
    }
}

/// How records are written as syslog messages. Every field states its default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyslogConfig {
    /// Facility; default [`Facility::LOG_AUDIT`] (13).
    pub facility: Facility,
    /// HOSTNAME: 1–255 printable US-ASCII characters or `-`; default this machine's
    /// host name (from `/proc/sys/kernel/hostname`, unprintable bytes replaced by `_`).
    pub hostname: String,
    /// APP-NAME: 1–48 printable US-ASCII; default `probity`.
    pub app_name: String,
    /// PROCID: 1–128 printable US-ASCII; default this process's id.
    pub procid: String,
    /// The private enterprise number in the SD-ID `probity@<n>`; default 32473 (see the
    /// module documentation).
    pub enterprise_number: u32,
    /// Largest message in bytes (without transport framing), 2048 ..= 1 MiB; default
    /// 8192, the size RFC 5425 says receivers should accept and rsyslog's default.
    pub max_message_size: usize,
}

impl Default for SyslogConfig {
    fn default() -> Self {
        Self {
            facility: Facility::LOG_AUDIT,
            hostname: system_hostname(),
            app_name: "probity".to_owned(),
            procid: std::process::id().to_string(),
            enterprise_number: DOCUMENTATION_ENTERPRISE_NUMBER,
            max_message_size: 8192,
        }
    }
}

/// This machine's host name as a syslog HOSTNAME (`-` if it cannot be read).
pub fn system_hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| if is_print_us_ascii(c) { c } else { '_' })
        .take(255)
        .collect();
    if name.is_empty() {
        "-".to_owned()
    } else {
        name
    }
}

fn is_print_us_ascii(c: char) -> bool {
    ('!'..='~').contains(&c)
}

/// A syslog configuration that cannot produce valid messages.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Facility codes are 0–23.
    #[error("syslog facility {code} does not exist (0-23)")]
    Facility {
        /// The code given.
        code: u8,
    },
    /// A header field is empty, too long or not printable US-ASCII.
    #[error("syslog {field} {value:?} must be 1-{max} printable US-ASCII characters")]
    HeaderField {
        /// `hostname`, `app_name` or `procid`.
        field: &'static str,
        /// The value given.
        value: String,
        /// Longest allowed.
        max: usize,
    },
    /// The size limit is out of range.
    #[error("max_message_size {size} is outside {MIN_MESSAGE_SIZE}..={MAX_MESSAGE_SIZE}")]
    MessageSize {
        /// The size given.
        size: usize,
    },
}

/// What the size limit cost a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Formatted {
    /// The MSG was shortened (or left out).
    pub msg_truncated: bool,
    /// Extra fields left out (or whose names could not be made valid).
    pub fields_omitted: usize,
}

/// A validated [`SyslogConfig`], ready to format records.
#[derive(Debug, Clone)]
pub struct SyslogFormat {
    pri_base: u8,
    /// ` HOSTNAME APP-NAME PROCID `
    middle: String,
    sd_id: String,
    max: usize,
}

impl SyslogFormat {
    /// Checks `config`.
    pub fn new(config: &SyslogConfig) -> Result<Self, FormatError> {
        let check = |field: &'static str, value: &str, max: usize| {
            if value.is_empty() || value.len() > max || !value.chars().all(is_print_us_ascii) {
                Err(FormatError::HeaderField {
                    field,
                    value: value.to_owned(),
                    max,
                })
            } else {
                Ok(())
            }
        };
        check("hostname", &config.hostname, 255)?;
        check("app_name", &config.app_name, 48)?;
        check("procid", &config.procid, 128)?;
        if !(MIN_MESSAGE_SIZE..=MAX_MESSAGE_SIZE).contains(&config.max_message_size) {
            return Err(FormatError::MessageSize {
                size: config.max_message_size,
            });
        }
        let facility = Facility::new(config.facility.code())?;
        Ok(Self {
            pri_base: facility.code() * 8,
            middle: format!(
                " {} {} {} ",
                config.hostname, config.app_name, config.procid
            ),
            sd_id: format!("probity@{}", config.enterprise_number),
            max: config.max_message_size,
        })
    }

    /// The SD-ID of the element that carries the record (`probity@<n>`).
    pub fn sd_id(&self) -> &str {
        &self.sd_id
    }

    /// The size limit in bytes.
    pub fn max_message_size(&self) -> usize {
        self.max
    }

    /// Appends `record` as one RFC 5424 message (no framing) to `out`. Never fails and
    /// never writes more than the size limit; see the module documentation for what
    /// gives way.
    pub fn format(&self, record: &Record, out: &mut Vec<u8>) -> Formatted {
        let start = out.len();
        out.push(b'<');
        push_u64(
            out,
            u64::from(self.pri_base + record.severity.syslog_severity()),
        );
        out.extend_from_slice(b">1 ");
        write_rfc3339_micros(record.time, out);
        out.extend_from_slice(self.middle.as_bytes());
        out.extend_from_slice(record.kind.as_str().as_bytes());
        out.extend_from_slice(b" [");
        out.extend_from_slice(self.sd_id.as_bytes());
        param_start(out, "seq");
        push_u64(out, record.seq);
        out.push(b'"');
        param_start(out, "hash");
        push_hex(out, &record.hash);
        out.push(b'"');
        param_start(out, "prev");
        push_hex(out, &record.prev_hash);
        out.push(b'"');
        push_param(out, "kind", record.kind.as_str());
        push_param(out, "severity", record.severity.as_str());
        let mut cut: Vec<&str> = Vec::new();
        for (name, value) in [("node", &record.node), ("policy", &record.policy)] {
            if let Some(v) = value {
                let kept = prefix(v, MAX_NAME_VALUE);
                if kept.len() < v.len() {
                    cut.push(name);
                }
                push_param(out, name, kept);
            }
        }
        let head = out.len() - start;

        // Extra fields, encoded back to back; `spans` holds each one's range.
        let mut extras: Vec<u8> = Vec::new();
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(record.fields.len());
        let mut invalid = 0usize;
        for (name, value) in field_names(&record.fields)
            .into_iter()
            .zip(record.fields.values())
        {
            match name {
                Some(name) => {
                    let from = extras.len();
                    push_param(&mut extras, &name, value);
                    spans.push((from, extras.len()));
                }
                None => invalid += 1,
            }
        }

        let msg = record.message.as_str();
        let mut kept = vec![true; spans.len()];
        let (msg_len, msg_cut, omitted) = loop {
            let extras_len: usize = spans
                .iter()
                .zip(&kept)
                .filter(|(_, k)| **k)
                .map(|((a, b), _)| b - a)
                .sum();
            let omitted = invalid + kept.iter().filter(|k| !**k).count();
            // Everything but the MSG: header, element, marks, `]`.
            let fixed = |msg_cut: bool| head + extras_len + marks_len(&cut, msg_cut, omitted) + 1;
            // SP, BOM and the MSG's bytes.
            let msg_cost = |n: usize| if n == 0 { 0 } else { 1 + BOM.len() + n };
            if fixed(false) + msg_cost(msg.len()) <= self.max {
                break (msg.len(), false, omitted);
            }
            if !msg.is_empty() && fixed(true) <= self.max {
                let room = self.max - fixed(true);
                let keep = prefix(msg, room.saturating_sub(1 + BOM.len())).len();
                break (keep, true, omitted);
            }
            // Leave out the largest field still kept.
            let largest = spans
                .iter()
                .zip(&kept)
                .enumerate()
                .filter(|(_, (_, k))| **k)
                .max_by_key(|(_, ((a, b), _))| b - a)
                .map(|(i, _)| i);
            match largest.and_then(|i| kept.get_mut(i)) {
                Some(k) => *k = false,
                // Unreachable with MIN_MESSAGE_SIZE: the header and the fixed element
                // are bounded well below it. Send them without a MSG rather than nothing.
                None => break (0, !msg.is_empty(), omitted),
            }
        };

        for ((a, b), _) in spans.iter().zip(&kept).filter(|(_, k)| **k) {
            out.extend_from_slice(extras.get(*a..*b).unwrap_or_default());
        }
        if msg_cut {
            cut.insert(0, "msg");
        }
        if !cut.is_empty() {
            push_param(out, "truncated", &cut.join(","));
        }
        if omitted > 0 {
            param_start(out, "omitted");
            push_u64(out, u64::try_from(omitted).unwrap_or(u64::MAX));
            out.push(b'"');
        }
        out.push(b']');
        if msg_len > 0 {
            out.push(b' ');
            out.extend_from_slice(BOM);
            out.extend_from_slice(msg.as_bytes().get(..msg_len).unwrap_or_default());
        }
        debug_assert!(out.len() - start <= self.max);
        Formatted {
            msg_truncated: msg_cut,
            fields_omitted: omitted,
        }
    }
}

/// Length of the `truncated` and `omitted` parameters for these marks.
fn marks_len(cut: &[&str], msg_cut: bool, omitted: usize) -> usize {
    let mut n = 0;
    let names: usize = cut.iter().map(|c| c.len()).sum::<usize>() + if msg_cut { 3 } else { 0 };
    let count = cut.len() + usize::from(msg_cut);
    if count > 0 {
        // ` truncated="a,b"`
        n += 13 + names + (count - 1);
    }
    if omitted > 0 {
        // ` omitted="12"`
        n += 11 + omitted.to_string().len();
    }
    n
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn prefix(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut n = max;
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    s.get(..n).unwrap_or_default()
}

/// Appends ` name="`.
fn param_start(out: &mut Vec<u8>, name: &str) {
    out.push(b' ');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"=\"");
}

/// Appends ` name="value"` with the value escaped as RFC 5424 §6.3.3 requires: `"`,
/// `\` and `]` get a backslash.
fn push_param(out: &mut Vec<u8>, name: &str, value: &str) {
    param_start(out, name);
    let v = value.as_bytes();
    let mut from = 0;
    for (i, b) in v.iter().enumerate() {
        if matches!(b, b'"' | b'\\' | b']') {
            out.extend_from_slice(v.get(from..i).unwrap_or_default());
            out.push(b'\\');
            from = i;
        }
    }
    out.extend_from_slice(v.get(from..).unwrap_or_default());
    out.push(b'"');
}

fn push_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        if let Some(d) = digits.get_mut(i) {
            *d = b'0' + u8::try_from(n % 10).unwrap_or(0);
        }
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(digits.get(i..).unwrap_or_default());
}

fn push_hex(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(hex::encode(bytes).as_bytes());
}

/// Valid, distinct SD-NAMEs for the fields' names, in the map's order (`None` where
/// none could be made). A name is printable US-ASCII except `=`, space, `]` and `"`
/// (others become `_`), at most 32 characters; a name that collides with ours or an
/// earlier one is tried as `x-<name>`.
fn field_names(fields: &BTreeMap<String, String>) -> Vec<Option<Cow<'_, str>>> {
    let mut names: Vec<Option<Cow<'_, str>>> = fields.keys().map(|k| sd_name(k)).collect();
    // Names left as they were are distinct already (map keys); only changed or
    // reserved ones need checking.
    let simple = names
        .iter()
        .all(|n| matches!(n, Some(Cow::Borrowed(s)) if !RESERVED.contains(s)));
    if simple {
        return names;
    }
    let mut taken: BTreeSet<String> = RESERVED.iter().map(|s| (*s).to_owned()).collect();
    for n in &mut names {
        let Some(name) = n.take() else { continue };
        let chosen = if !taken.contains(name.as_ref()) {
            Some(name)
        } else {
            let prefixed: String = format!("x-{name}").chars().take(32).collect();
            (!taken.contains(&prefixed)).then_some(Cow::Owned(prefixed))
        };
        if let Some(c) = &chosen {
            taken.insert(c.to_string());
        }
        *n = chosen;
    }
    names
}

/// `name` as an SD-NAME: unchanged if valid, else with invalid characters replaced by
/// `_` and cut to 32; `None` if empty.
fn sd_name(name: &str) -> Option<Cow<'_, str>> {
    let valid = |c: char| is_print_us_ascii(c) && !matches!(c, '=' | ']' | '"');
    if name.is_empty() {
        return None;
    }
    if name.len() <= 32 && name.chars().all(valid) {
        return Some(Cow::Borrowed(name));
    }
    Some(Cow::Owned(
        name.chars()
            .map(|c| if valid(c) { c } else { '_' })
            .take(32)
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RecordKind, Severity};
    use crate::time::from_unix_micros;

    fn config() -> SyslogConfig {
        SyslogConfig {
            hostname: "host-1".into(),
            procid: "77".into(),
            ..SyslogConfig::default()
        }
    }

    fn record() -> Record {
        Record {
            seq: 17,
            hash: [0xab; 32],
            prev_hash: [0x01; 32],
            time: from_unix_micros(1_796_075_233_385_181),
            kind: RecordKind::Decision,
            severity: Severity::High,
            node: Some("gpu-node-7".into()),
            policy: Some("integrity.unverified-read".into()),
            message: "checkpoint failed verification".into(),
            fields: [
                ("decision".to_owned(), "deny".to_owned()),
                ("resource".to_owned(), "Checkpoint::\"a]b\\c\"".to_owned()),
            ]
            .into(),
        }
    }

    fn format(cfg: &SyslogConfig, r: &Record) -> (Vec<u8>, Formatted) {
        let f = SyslogFormat::new(cfg).unwrap();
        let mut out = Vec::new();
        let info = f.format(r, &mut out);
        (out, info)
    }

    #[test]
    fn writes_the_expected_bytes() {
        let (out, info) = format(&config(), &record());
        let expected = format!(
            "<107>1 2026-11-30T21:47:13.385181Z host-1 probity 77 decision [probity@32473 \
             seq=\"17\" hash=\"{}\" prev=\"{}\" kind=\"decision\" severity=\"high\" \
             node=\"gpu-node-7\" policy=\"integrity.unverified-read\" decision=\"deny\" \
             resource=\"Checkpoint::\\\"a\\]b\\\\c\\\"\"] \u{feff}checkpoint failed verification",
            "ab".repeat(32),
            "01".repeat(32)
        );
        assert_eq!(String::from_utf8(out).unwrap(), expected);
        assert_eq!(info, Formatted::default());
    }

    #[test]
    fn the_size_limit_cuts_the_msg_first_then_fields_never_seq_or_hash() {
        let mut cfg = config();
        cfg.max_message_size = MIN_MESSAGE_SIZE;
        let mut r = record();
        r.message = "é".repeat(3000);
        let (out, info) = format(&cfg, &r);
        // "é" is two bytes: the cut lands on the limit or one byte short of it.
        assert!((MIN_MESSAGE_SIZE - 1..=MIN_MESSAGE_SIZE).contains(&out.len()));
        assert!(info.msg_truncated);
        assert_eq!(info.fields_omitted, 0);
        let m = parse(&out).unwrap();
        assert_eq!(m.param("probity@32473", "truncated"), Some("msg"));
        assert_eq!(m.param("probity@32473", "decision"), Some("deny"));

        r.fields.insert("big".into(), "x".repeat(5000));
        let (out, info) = format(&cfg, &r);
        assert!(out.len() <= MIN_MESSAGE_SIZE);
        assert_eq!(info.fields_omitted, 1);
        let m = parse(&out).unwrap();
        assert_eq!(m.param("probity@32473", "seq"), Some("17"));
        assert_eq!(
            m.param("probity@32473", "hash"),
            Some("ab".repeat(32).as_str())
        );
        assert_eq!(m.param("probity@32473", "omitted"), Some("1"));
        // The largest field goes first; the others stay.
        assert_eq!(m.param("probity@32473", "big"), None);
        assert_eq!(m.param("probity@32473", "decision"), Some("deny"));
    }

    #[test]
    fn long_node_names_are_cut_and_marked() {
        let mut r = record();
        r.node = Some("n".repeat(300));
        let (out, _) = format(&config(), &r);
        let m = parse(&out).unwrap();
        assert_eq!(
            m.param("probity@32473", "node").unwrap().len(),
            MAX_NAME_VALUE
        );
        assert_eq!(m.param("probity@32473", "truncated"), Some("node"));
    }

    #[test]
    fn invalid_and_reserved_field_names_are_made_valid_or_left_out() {
        let mut r = record();
        r.fields = [
            ("seq".to_owned(), "forged".to_owned()),
            ("a b=c]\"d".to_owned(), "1".to_owned()),
            ("é".to_owned(), "2".to_owned()),
            ("".to_owned(), "3".to_owned()),
            ("k".repeat(40), "4".to_owned()),
        ]
        .into();
        let (out, info) = format(&config(), &r);
        let m = parse(&out).unwrap();
        assert_eq!(m.param("probity@32473", "seq"), Some("17"));
        assert_eq!(m.param("probity@32473", "x-seq"), Some("forged"));
        assert_eq!(m.param("probity@32473", "a_b_c__d"), Some("1"));
        assert_eq!(m.param("probity@32473", "_"), Some("2"));
        assert_eq!(m.param("probity@32473", &"k".repeat(32)), Some("4"));
        assert_eq!(info.fields_omitted, 1, "the empty name");
    }

    #[test]
    fn an_empty_message_has_no_msg_part() {
        let mut r = record();
        r.message.clear();
        let (out, _) = format(&config(), &r);
        assert_eq!(out.last(), Some(&b']'));
        assert_eq!(parse(&out).unwrap().msg, None);
    }

    #[test]
    fn configuration_is_checked() {
        let mut c = config();
        c.hostname = "has space".into();
        assert_eq!(
            SyslogFormat::new(&c).unwrap_err().to_string(),
            "syslog hostname \"has space\" must be 1-255 printable US-ASCII characters"
        );
        let mut c = config();
        c.max_message_size = 100;
        assert!(matches!(
            SyslogFormat::new(&c),
            Err(FormatError::MessageSize { size: 100 })
        ));
        assert_eq!(Facility::new(24), Err(FormatError::Facility { code: 24 }));
    }
}
