//! RELP, rsyslog's Reliable Event Logging Protocol: every syslog message travels in a
//! numbered frame and the receiver answers each with `rsp 200 OK` once it has taken the
//! message, so the sender knows exactly what arrived. Several frames may be in flight
//! (a window); responses come back in order.
//!
//! A frame is `TXNR SP COMMAND SP DATALEN [SP DATA] LF`: TXNR 1–999999999 (wrapping to
//! 1), COMMAND 1–32 letters (`open`, `syslog`, `close`, `rsp`, `serverclose`), DATALEN
//! the length of DATA in decimal. A session starts with `open` (offers
//! `relp_version=0`, `commands=syslog`) and ends with `close`.
//!
//! [`parse_frame`] reads what the receiver sends: untrusted bytes, so it is bounded,
//! total, and says where a frame went wrong.

use std::collections::VecDeque;
use std::io::{BufWriter, Read, Write};
use std::time::{Duration, Instant};

use thiserror::Error;

use super::{Link, TransportError, io_error};

/// Highest transaction number; the next one is 1.
pub const MAX_TXNR: u32 = 999_999_999;
/// Longest DATA accepted in a response.
pub const MAX_RESPONSE_DATA: usize = 64 * 1024;
/// What this sender offers when opening a session.
pub const OPEN_OFFERS: &str = concat!(
    "relp_version=0\nrelp_software=probity-siem,",
    env!("CARGO_PKG_VERSION"),
    ",-\ncommands=syslog"
);

/// One RELP frame, borrowing from the buffer it was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Transaction number (0 for `serverclose`).
    pub txnr: u32,
    /// The command.
    pub command: &'a str,
    /// DATA (empty when DATALEN is 0).
    pub data: &'a [u8],
}

/// Where a frame stops being RELP.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("RELP frame byte {offset}: expected {expected}")]
pub struct FrameError {
    /// Byte offset from the start of the frame.
    pub offset: usize,
    /// What was expected there.
    pub expected: &'static str,
}

/// Parses the frame at the start of `buf`. `Ok(None)` means the bytes so far are a
/// valid beginning and more are needed; `Ok(Some((frame, n)))` gives the frame and the
/// bytes it took. DATA longer than `max_data` is an error.
pub fn parse_frame(buf: &[u8], max_data: usize) -> Result<Option<(Frame<'_>, usize)>, FrameError> {
    let err = |offset, expected| Err(FrameError { offset, expected });
    let mut at = 0;
    // TXNR
    let mut txnr: u32 = 0;
    loop {
        match buf.get(at) {
            None => return Ok(None),
            Some(c) if c.is_ascii_digit() => {
                if at == 9 {
                    return err(at, "a space after at most 9 TXNR digits");
                }
                txnr = txnr * 10 + u32::from(c - b'0');
                at += 1;
            }
            Some(b' ') if at > 0 => break,
            Some(_) => return err(at, "a TXNR digit"),
        }
    }
    at += 1;
    // COMMAND
    let cmd_start = at;
    loop {
        match buf.get(at) {
            None => return Ok(None),
            Some(c) if c.is_ascii_alphabetic() => {
                if at - cmd_start == 32 {
                    return err(at, "a space after at most 32 COMMAND letters");
                }
                at += 1;
            }
            Some(b' ') if at > cmd_start => break,
            Some(_) => return err(at, "a COMMAND letter"),
        }
    }
    let command = buf
        .get(cmd_start..at)
        .and_then(|c| std::str::from_utf8(c).ok())
        .unwrap_or_default();
    at += 1;
    // DATALEN
    let len_start = at;
    let mut len: usize = 0;
    loop {
        match buf.get(at) {
            None => return Ok(None),
            Some(c) if c.is_ascii_digit() => {
                if at - len_start == 9 {
                    return err(at, "at most 9 DATALEN digits");
                }
                len = len * 10 + usize::from(c - b'0');
                at += 1;
            }
            Some(b' ' | b'\n') if at > len_start => break,
            Some(_) => return err(at, "a DATALEN digit"),
        }
    }
    if len > max_data {
        return err(len_start, "a DATALEN within the limit");
    }
    let data = if len == 0 {
        // librelp writes `4 rsp 0\n`; tolerate `4 rsp 0 \n` too.
        if buf.get(at) == Some(&b' ') {
            at += 1;
        }
        &[][..]
    } else {
        if buf.get(at) != Some(&b' ') {
            return err(at, "a space before DATA");
        }
        at += 1;
        let Some(data) = buf.get(at..at + len) else {
            return Ok(None);
        };
        at += len;
        data
    };
    match buf.get(at) {
        None => Ok(None),
        Some(b'\n') => Ok(Some((
            Frame {
                txnr,
                command,
                data,
            },
            at + 1,
        ))),
        Some(_) => err(at, "LF ending the frame"),
    }
}

/// The status code and text of a response's DATA (`200 OK\n…` gives `(200, "OK")`).
pub fn response_status(data: &[u8]) -> Option<(u16, &str)> {
    let line = data.split(|b| *b == b'\n').next()?;
    let code = std::str::from_utf8(line.get(..3)?).ok()?.parse().ok()?;
    let text = match line.get(3) {
        None => "",
        Some(b' ') => std::str::from_utf8(line.get(4..)?).ok()?,
        Some(_) => return None,
    };
    Some((code, text))
}

/// Appends one frame to `out`.
pub fn write_frame(out: &mut Vec<u8>, txnr: u32, command: &str, data: &[u8]) {
    out.extend_from_slice(txnr.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(command.as_bytes());
    out.push(b' ');
    out.extend_from_slice(data.len().to_string().as_bytes());
    if !data.is_empty() {
        out.push(b' ');
        out.extend_from_slice(data);
    }
    out.push(b'\n');
}

/// What the receiver said about a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `rsp` with a status.
    Rsp { txnr: u32, code: u16, text: String },
    /// The receiver is closing the session.
    ServerClose,
}

/// An open RELP session over a link.
pub(crate) struct Session {
    io: BufWriter<Link>,
    addr: String,
    rbuf: Vec<u8>,
    next_txnr: u32,
    frame: Vec<u8>,
    /// Transactions sent and not yet answered, oldest first.
    pub in_flight: VecDeque<(u32, u64)>,
}

impl Session {
    /// Sends `open` and checks the answer (within `timeout`).
    pub fn open(link: Link, addr: &str, timeout: Duration) -> Result<Self, TransportError> {
        let mut s = Session {
            io: BufWriter::with_capacity(64 * 1024, link),
            addr: addr.to_owned(),
            rbuf: Vec::with_capacity(4096),
            next_txnr: 1,
            frame: Vec::new(),
            in_flight: VecDeque::new(),
        };
        let txnr = s.write_command("open", OPEN_OFFERS.as_bytes())?;
        s.flush()?;
        let deadline = crate::after(timeout);
        // `read_replies` returns at least one reply; the first must answer `open`.
        let replies = s.read_replies(deadline, timeout)?;
        match replies.first() {
            Some(Reply::Rsp {
                txnr: t,
                code,
                text,
            }) if *t == txnr => {
                if *code != 200 {
                    return Err(s.problem(format!("open refused: {code} {text}")));
                }
                Ok(s)
            }
            Some(Reply::Rsp { txnr: t, .. }) => {
                Err(s.problem(format!("response to transaction {t} before open")))
            }
            Some(Reply::ServerClose) | None => Err(TransportError::Closed {
                addr: s.addr.clone(),
                op: "opening a RELP session",
            }),
        }
    }

    fn problem(&self, problem: String) -> TransportError {
        TransportError::Relp {
            addr: self.addr.clone(),
            problem,
        }
    }

    fn write_command(&mut self, command: &str, data: &[u8]) -> Result<u32, TransportError> {
        let txnr = self.next_txnr;
        self.next_txnr = if txnr >= MAX_TXNR { 1 } else { txnr + 1 };
        self.frame.clear();
        write_frame(&mut self.frame, txnr, command, data);
        let timeout = self.io.get_ref().tcp().write_timeout().ok().flatten();
        self.io.write_all(&self.frame).map_err(|e| {
            io_error(
                &self.addr,
                "sending a RELP frame",
                e,
                timeout.unwrap_or_default(),
            )
        })?;
        Ok(txnr)
    }

    /// Sends one syslog message carrying record `seq`.
    pub fn send(&mut self, seq: u64, msg: &[u8]) -> Result<(), TransportError> {
        let txnr = self.write_command("syslog", msg)?;
        self.in_flight.push_back((txnr, seq));
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), TransportError> {
        let timeout = self.io.get_ref().tcp().write_timeout().ok().flatten();
        self.io.flush().map_err(|e| {
            io_error(
                &self.addr,
                "sending RELP frames",
                e,
                timeout.unwrap_or_default(),
            )
        })
    }

    /// Waits until at least one reply has arrived (or `deadline`), and returns every
    /// complete reply received.
    pub fn read_replies(
        &mut self,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<Reply>, TransportError> {
        let op = "waiting for RELP responses";
        let mut out = Vec::new();
        loop {
            let mut consumed = 0;
            loop {
                let rest = self.rbuf.get(consumed..).unwrap_or_default();
                match parse_frame(rest, MAX_RESPONSE_DATA) {
                    Ok(Some((f, n))) => {
                        consumed += n;
                        match f.command {
                            "rsp" => {
                                // `close` is answered with an empty `rsp`: status 0.
                                let (code, text) = if f.data.is_empty() {
                                    Some((0, ""))
                                } else {
                                    response_status(f.data)
                                }
                                .ok_or_else(|| {
                                    self.problem(format!(
                                        "response to transaction {} has no status",
                                        f.txnr
                                    ))
                                })?;
                                out.push(Reply::Rsp {
                                    txnr: f.txnr,
                                    code,
                                    text: text.to_owned(),
                                });
                            }
                            "serverclose" => out.push(Reply::ServerClose),
                            other => {
                                return Err(self.problem(format!(
                                    "unexpected command {other:?} from the receiver"
                                )));
                            }
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return Err(self.problem(e.to_string())),
                }
            }
            self.rbuf.drain(..consumed);
            if !out.is_empty() {
                return Ok(out);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout {
                    addr: self.addr.clone(),
                    op,
                    after: timeout,
                });
            }
            let link = self.io.get_mut();
            link.tcp()
                .set_read_timeout(Some(left))
                .map_err(|e| io_error(&self.addr, op, e, timeout))?;
            let mut chunk = [0u8; 16 * 1024];
            match link.read(&mut chunk) {
                Ok(0) => {
                    return Err(TransportError::Closed {
                        addr: self.addr.clone(),
                        op,
                    });
                }
                Ok(n) => self
                    .rbuf
                    .extend_from_slice(chunk.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_error(&self.addr, op, e, timeout)),
            }
        }
    }

    /// Sends `close` and waits (at most `timeout`) for its answer. Best effort: the
    /// caller has what it needs already.
    pub fn close(mut self, timeout: Duration) {
        if self.write_command("close", b"").is_err() || self.flush().is_err() {
            return;
        }
        let deadline = crate::after(timeout);
        while let Ok(replies) = self.read_replies(deadline, timeout) {
            if replies
                .iter()
                .any(|r| matches!(r, Reply::ServerClose | Reply::Rsp { code: 0, .. }))
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_librelp_responses() {
        let buf = b"1 rsp 93 200 OK\nrelp_version=0\nrelp_software=librelp,1.11.0,http://librelp.adiscon.com\ncommands=syslog\n2 rsp 6 200 OK\n";
        let (f, n) = parse_frame(buf, 1024).unwrap().unwrap();
        assert_eq!((f.txnr, f.command), (1, "rsp"));
        assert_eq!(response_status(f.data), Some((200, "OK")));
        let (g, m) = parse_frame(&buf[n..], 1024).unwrap().unwrap();
        assert_eq!((g.txnr, g.data), (2, &b"200 OK"[..]));
        assert_eq!(n + m, buf.len());
        let (h, _) = parse_frame(b"0 serverclose 0\n", 10).unwrap().unwrap();
        assert_eq!((h.txnr, h.command, h.data), (0, "serverclose", &b""[..]));
    }

    #[test]
    fn every_prefix_of_a_frame_asks_for_more() {
        let buf = b"12 rsp 6 200 OK\n";
        for end in 0..buf.len() {
            assert_eq!(parse_frame(&buf[..end], 100), Ok(None), "{end}");
        }
    }

    #[test]
    fn malformed_frames_are_located() {
        let cases: [(&[u8], usize, &str); 5] = [
            (b"x rsp 0\n", 0, "a TXNR digit"),
            (
                b"1234567890 rsp 0\n",
                9,
                "a space after at most 9 TXNR digits",
            ),
            (b"1 r$p 0\n", 3, "a COMMAND letter"),
            (b"1 rsp 70000 ", 6, "a DATALEN within the limit"),
            (b"1 rsp 2 okX", 10, "LF ending the frame"),
        ];
        for (input, offset, expected) in cases {
            assert_eq!(
                parse_frame(input, MAX_RESPONSE_DATA),
                Err(FrameError { offset, expected })
            );
        }
    }

    #[test]
    fn frames_round_trip() {
        let mut out = Vec::new();
        write_frame(&mut out, 7, "syslog", b"<13>1 - - - - - - hi\nthere");
        write_frame(&mut out, 8, "close", b"");
        let (f, n) = parse_frame(&out, 100).unwrap().unwrap();
        assert_eq!(
            (f.txnr, f.command, f.data),
            (7, "syslog", &b"<13>1 - - - - - - hi\nthere"[..])
        );
        assert_eq!(&out[n..], b"8 close 0\n");
    }
}
