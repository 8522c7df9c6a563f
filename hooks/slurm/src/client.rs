//! The sidecar's Unix socket, as `probity slurm` calls it from job_submit.lua, the
//! Prolog and the health check: one HTTP/1.1 request per connection, standard library
//! only (a Prolog is a short process: no runtime to start), under one deadline for the
//! connect, the write and the read together.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::SlurmError;

/// Largest answer read.
const MAX_ANSWER: u64 = 4 * 1024 * 1024;

/// The sidecar at a Unix socket.
#[derive(Debug, Clone)]
pub struct SidecarClient {
    socket: PathBuf,
    timeout: Duration,
}

impl SidecarClient {
    /// A client of the socket at `socket`, each request bounded by `timeout`.
    pub fn new(socket: &Path, timeout: Duration) -> Self {
        Self {
            socket: socket.to_owned(),
            timeout,
        }
    }

    /// POSTs `body` (JSON) to `path`; the status and the JSON answer. An answer that is
    /// not JSON is an error naming the status and its first bytes.
    pub fn post(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, serde_json::Value), SlurmError> {
        let deadline = Instant::now() + self.timeout;
        let fail = |problem: String| SlurmError::Sidecar {
            socket: self.socket.display().to_string(),
            problem,
        };
        let left = || {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| fail(format!("no answer within {:?}", self.timeout)))
        };
        let mut stream =
            UnixStream::connect(&self.socket).map_err(|e| fail(format!("cannot connect: {e}")))?;
        let body = body.to_string();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: probity\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream
            .set_write_timeout(Some(left()?))
            .and_then(|()| stream.write_all(request.as_bytes()))
            .map_err(|e| fail(format!("cannot send the request: {e}")))?;
        let mut answer = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            stream
                .set_read_timeout(Some(left()?))
                .map_err(|e| fail(e.to_string()))?;
            match stream.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    answer.extend_from_slice(chunk.get(..n).unwrap_or_default());
                    if answer.len() as u64 > MAX_ANSWER {
                        return Err(fail(format!("the answer is over {MAX_ANSWER} bytes")));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(fail(format!("no answer within {:?}", self.timeout)));
                }
                Err(e) => return Err(fail(format!("cannot read the answer: {e}"))),
            }
        }
        parse_answer(&answer).map_err(fail)
    }
}

/// An HTTP/1.1 answer's status and JSON body (identity or chunked); an error saying
/// what is wrong with it.
pub fn parse_answer(bytes: &[u8]) -> Result<(u16, serde_json::Value), String> {
    let split = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer has no end of headers")?;
    let head = String::from_utf8_lossy(bytes.get(..split).unwrap_or_default());
    let body = bytes.get(split + 4..).unwrap_or_default();
    let status = head
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| {
            format!(
                "the answer's status line is not HTTP: {:?}",
                head.lines().next().unwrap_or("")
            )
        })?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    let value = serde_json::from_slice(&body).map_err(|e| {
        let text = String::from_utf8_lossy(&body);
        let start: String = text.chars().take(200).collect();
        format!("answer {status} is not JSON ({e}): {start}")
    })?;
    Ok((status, value))
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk has no size line")?;
        let size_text = String::from_utf8_lossy(body.get(..line_end).unwrap_or_default());
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("chunk size {size_text:?} is not hexadecimal"))?;
        let start = line_end + 2;
        if size == 0 {
            return Ok(out);
        }
        let chunk = body
            .get(start..start.saturating_add(size))
            .ok_or("a chunk is cut short")?;
        out.extend_from_slice(chunk);
        body = body.get(start + size + 2..).ok_or("a chunk is cut short")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_identity_and_chunked_are_read() {
        let (status, value) =
            parse_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"a\": true}").unwrap();
        assert_eq!((status, value["a"].as_bool()), (200, Some(true)));
        let (status, value) = parse_answer(
            b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"e\"\r\n5\r\n: 12}\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((status, value["e"].as_i64()), (400, Some(12)));
    }

    #[test]
    fn broken_answers_are_errors_saying_what() {
        assert_eq!(
            parse_answer(b"HTTP/1.1 200").unwrap_err(),
            "the answer has no end of headers"
        );
        assert!(
            parse_answer(b"SSH-2.0\r\n\r\n{}")
                .unwrap_err()
                .contains("not HTTP")
        );
        assert!(
            parse_answer(b"HTTP/1.1 500 x\r\n\r\n<html>")
                .unwrap_err()
                .starts_with("answer 500 is not JSON")
        );
        assert!(
            parse_answer(b"HTTP/1.1 200 x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
        assert!(
            parse_answer(b"HTTP/1.1 200 x\r\ntransfer-encoding: chunked\r\n\r\nff\r\nab").is_err()
        );
    }

    #[test]
    fn a_missing_or_silent_socket_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("probity.sock");
        let err = SidecarClient::new(&path, Duration::from_millis(200))
            .post("/v1/slurm/submit", &serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "the sidecar at {}: cannot connect",
                path.display()
            )),
            "{err}"
        );
        // A listener that never answers: the deadline holds.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let err = SidecarClient::new(&path, Duration::from_millis(200))
            .post("/v1/slurm/submit", &serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("no answer within 200ms"), "{err}");
    }
}
