//! A strict RFC 5424 parser, for reading back what a receiver stored and for tests.
//! It takes untrusted bytes: a size limit, no panic, and an error that names the byte
//! offset and what was expected there.

use std::fmt;

use crate::time::parse_rfc3339;

use super::BOM;

/// Longest message accepted, in bytes.
pub const MAX_MESSAGE: usize = 1 << 20;

/// A parsed RFC 5424 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyslogMessage {
    /// Facility (0–23).
    pub facility: u8,
    /// Severity (0–7).
    pub severity: u8,
    /// TIMESTAMP as microseconds since the epoch (UTC), `None` for `-`.
    pub timestamp: Option<i64>,
    /// HOSTNAME, `None` for `-`.
    pub hostname: Option<String>,
    /// APP-NAME, `None` for `-`.
    pub app_name: Option<String>,
    /// PROCID, `None` for `-`.
    pub procid: Option<String>,
    /// MSGID, `None` for `-`.
    pub msgid: Option<String>,
    /// STRUCTURED-DATA elements in order (empty for `-`).
    pub structured_data: Vec<SdElement>,
    /// MSG without its BOM, `None` if absent.
    pub msg: Option<Vec<u8>>,
    /// Whether MSG started with a BOM (and so is UTF-8).
    pub msg_bom: bool,
}

impl SyslogMessage {
    /// The first value of parameter `name` in element `sd_id`.
    pub fn param(&self, sd_id: &str, name: &str) -> Option<&str> {
        self.structured_data
            .iter()
            .find(|e| e.id == sd_id)?
            .params
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// MSG as text (lossy for bytes that are not UTF-8).
    pub fn msg_text(&self) -> String {
        self.msg
            .as_deref()
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .unwrap_or_default()
    }
}

/// One SD-ELEMENT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SdElement {
    /// SD-ID.
    pub id: String,
    /// (PARAM-NAME, unescaped PARAM-VALUE) in order.
    pub params: Vec<(String, String)>,
}

/// Where a message stops being RFC 5424, and what was expected there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Byte offset in the message.
    pub offset: usize,
    /// What was expected.
    pub expected: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "byte {}: expected {}", self.offset, self.expected)
    }
}

impl std::error::Error for ParseError {}

struct P<'a> {
    s: &'a [u8],
    at: usize,
}

impl<'a> P<'a> {
    fn err<T>(&self, expected: &'static str) -> Result<T, ParseError> {
        Err(ParseError {
            offset: self.at,
            expected,
        })
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }
    fn byte(&mut self, b: u8, expected: &'static str) -> Result<(), ParseError> {
        if self.peek() == Some(b) {
            self.at += 1;
            Ok(())
        } else {
            self.err(expected)
        }
    }
    /// Bytes up to (not including) the next space or the end.
    fn token(&mut self) -> &'a [u8] {
        let start = self.at;
        while self.peek().is_some_and(|c| c != b' ') {
            self.at += 1;
        }
        self.s.get(start..self.at).unwrap_or_default()
    }
    /// A header field: `-` or 1..=max printable US-ASCII.
    fn field(&mut self, max: usize, expected: &'static str) -> Result<Option<String>, ParseError> {
        let start = self.at;
        let t = self.token();
        if t == b"-" {
            return Ok(None);
        }
        if t.is_empty() || t.len() > max || !t.iter().all(|c| (33..=126).contains(c)) {
            self.at = start;
            return self.err(expected);
        }
        Ok(Some(String::from_utf8_lossy(t).into_owned()))
    }
    /// SD-NAME: 1..=32 printable US-ASCII except `=`, space, `]`, `"`.
    fn sd_name(&mut self, expected: &'static str) -> Result<String, ParseError> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|c| (33..=126).contains(&c) && !matches!(c, b'=' | b']' | b'"'))
        {
            self.at += 1;
            if self.at - start > 32 {
                self.at = start + 32;
                return self.err("an SD-NAME of at most 32 characters");
            }
        }
        if self.at == start {
            return self.err(expected);
        }
        Ok(String::from_utf8_lossy(self.s.get(start..self.at).unwrap_or_default()).into_owned())
    }
    fn param_value(&mut self) -> Result<String, ParseError> {
        let mut v = Vec::new();
        let start = self.at;
        loop {
            match self.peek() {
                None => return self.err("'\"' closing the PARAM-VALUE"),
                Some(b'"') => break,
                Some(b'\\') => {
                    match self.s.get(self.at + 1).copied() {
                        Some(c @ (b'"' | b'\\' | b']')) => {
                            v.push(c);
                            self.at += 2;
                        }
                        // RFC 5424 §6.3.3: any other escape is two ordinary characters.
                        _ => {
                            v.push(b'\\');
                            self.at += 1;
                        }
                    }
                }
                Some(b']') => return self.err("']' escaped as '\\]' inside a PARAM-VALUE"),
                Some(c) => {
                    v.push(c);
                    self.at += 1;
                }
            }
        }
        String::from_utf8(v).or_else(|_| {
            self.at = start;
            self.err("a PARAM-VALUE in UTF-8")
        })
    }
}

/// Parses one RFC 5424 message (version 1), without framing or trailing newline.
pub fn parse(bytes: &[u8]) -> Result<SyslogMessage, ParseError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(ParseError {
            offset: MAX_MESSAGE,
            expected: "a message of at most 1 MiB",
        });
    }
    let mut p = P { s: bytes, at: 0 };
    p.byte(b'<', "'<' opening the PRI")?;
    let start = p.at;
    let mut pri: u32 = 0;
    while let Some(c) = p.peek().filter(u8::is_ascii_digit) {
        if p.at - start == 3 {
            return p.err("'>' after at most three PRI digits");
        }
        pri = pri * 10 + u32::from(c - b'0');
        p.at += 1;
    }
    if p.at == start {
        return p.err("a PRI value");
    }
    if pri > 191 {
        p.at = start;
        return p.err("a PRI value 0-191");
    }
    p.byte(b'>', "'>' closing the PRI")?;
    p.byte(b'1', "VERSION 1")?;
    p.byte(b' ', "a space after VERSION 1")?;

    let ts_start = p.at;
    let ts = p.token();
    let timestamp = if ts == b"-" {
        None
    } else {
        Some(parse_rfc3339(ts).map_err(|e| ParseError {
            offset: ts_start + e.offset,
            expected: e.expected,
        })?)
    };
    p.byte(b' ', "a space after TIMESTAMP")?;
    let hostname = p.field(255, "a HOSTNAME of 1-255 printable characters or '-'")?;
    p.byte(b' ', "a space after HOSTNAME")?;
    let app_name = p.field(48, "an APP-NAME of 1-48 printable characters or '-'")?;
    p.byte(b' ', "a space after APP-NAME")?;
    let procid = p.field(128, "a PROCID of 1-128 printable characters or '-'")?;
    p.byte(b' ', "a space after PROCID")?;
    let msgid = p.field(32, "a MSGID of 1-32 printable characters or '-'")?;
    p.byte(b' ', "a space after MSGID")?;

    let mut structured_data: Vec<SdElement> = Vec::new();
    if p.peek() == Some(b'-') {
        p.at += 1;
    } else {
        if p.peek() != Some(b'[') {
            return p.err("STRUCTURED-DATA: '-' or '['");
        }
        while p.peek() == Some(b'[') {
            p.at += 1;
            let id_at = p.at;
            let id = p.sd_name("an SD-ID")?;
            if structured_data.iter().any(|e| e.id == id) {
                p.at = id_at;
                return p.err("an SD-ID not already used in this message");
            }
            let mut params = Vec::new();
            while p.peek() == Some(b' ') {
                p.at += 1;
                let name = p.sd_name("a PARAM-NAME")?;
                p.byte(b'=', "'=' after the PARAM-NAME")?;
                p.byte(b'"', "'\"' opening the PARAM-VALUE")?;
                let value = p.param_value()?;
                p.byte(b'"', "'\"' closing the PARAM-VALUE")?;
                params.push((name, value));
            }
            p.byte(
                b']',
                "']' closing the SD-ELEMENT, or a space and an SD-PARAM",
            )?;
            structured_data.push(SdElement { id, params });
        }
    }

    let (msg, msg_bom) = match p.peek() {
        None => (None, false),
        Some(b' ') => {
            p.at += 1;
            let rest = bytes.get(p.at..).unwrap_or_default();
            match rest.strip_prefix(BOM) {
                Some(text) => {
                    if std::str::from_utf8(text).is_err() {
                        return p.err("UTF-8 after the BOM");
                    }
                    (Some(text.to_vec()), true)
                }
                None => (Some(rest.to_vec()), false),
            }
        }
        Some(_) => return p.err("a space before MSG, or the end of the message"),
    };

    Ok(SyslogMessage {
        facility: u8::try_from(pri / 8).unwrap_or(u8::MAX),
        severity: u8::try_from(pri % 8).unwrap_or(u8::MAX),
        timestamp,
        hostname,
        app_name,
        procid,
        msgid,
        structured_data,
        msg,
        msg_bom,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_rfc_examples() {
        let m = parse(
            b"<165>1 2003-10-11T22:14:15.003Z mymachine.example.com evntslog - ID47 \
              [exampleSDID@32473 iut=\"3\" eventSource=\"Application\" eventID=\"1011\"]\
              [examplePriority@32473 class=\"high\"]",
        )
        .unwrap();
        assert_eq!((m.facility, m.severity), (20, 5));
        assert_eq!(m.procid, None);
        assert_eq!(m.param("exampleSDID@32473", "eventID"), Some("1011"));
        assert_eq!(m.param("examplePriority@32473", "class"), Some("high"));
        assert_eq!(m.msg, None);
    }

    #[test]
    fn unescapes_values_and_keeps_unknown_escapes() {
        let m = parse(b"<0>1 - - - - - [a@1 v=\"q\\\"b\\\\s\\]e\\n\"] x").unwrap();
        assert_eq!(m.param("a@1", "v"), Some("q\"b\\s]e\\n"));
        assert_eq!(m.msg.as_deref(), Some(&b"x"[..]));
    }

    #[test]
    fn locates_errors() {
        let cases: [(&[u8], usize, &str); 7] = [
            (b"<192>1 - - - - - -", 1, "a PRI value 0-191"),
            (b"<1>2 - - - - - -", 3, "VERSION 1"),
            (
                b"<1>1 - - - - - [a@1 v=\"]\"]",
                23,
                "']' escaped as '\\]' inside a PARAM-VALUE",
            ),
            (
                b"<1>1 - - - - - [a@1][a@1]",
                21,
                "an SD-ID not already used in this message",
            ),
            (
                b"<1>1 - - - - - -x",
                16,
                "a space before MSG, or the end of the message",
            ),
            (
                b"<1>1 - - - - - - \xEF\xBB\xBF\xff",
                17,
                "UTF-8 after the BOM",
            ),
            (
                b"<1>1 - - - - - [a@1 v=\"x",
                24,
                "'\"' closing the PARAM-VALUE",
            ),
        ];
        for (input, offset, expected) in cases {
            assert_eq!(
                parse(input),
                Err(ParseError { offset, expected }),
                "{}",
                String::from_utf8_lossy(input)
            );
        }
    }
}
