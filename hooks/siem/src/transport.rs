//! The wire under the forwarder: a TCP connection, optionally wrapped in TLS (RFC 5425,
//! rustls with the ring provider), carrying octet-counted syslog frames (RFC 6587
//! §3.4.1) or RELP (rsyslog's reliable event logging protocol, [`relp`]).
//!
//! Plain TCP and TLS syslog have no acknowledgement. What a receiver holds is learnt by
//! an orderly close: we stop sending (TLS `close_notify`, then a TCP half-close) and
//! wait for the receiver to close its side. A receiver closes after it has read every
//! byte we sent; one that closes with bytes unread makes its kernel answer with a
//! reset, which we see as an error, not a close. So an end of stream after our
//! half-close means the receiving application read everything before it, unless the
//! receiver had closed first: that is checked before the half-close, and a reset
//! racing its end of stream is waited for (a few handshake round trips).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use thiserror::Error;

pub mod relp;

/// TLS settings of a connection (syslog over TLS or RELP over TLS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// PEM file of the CA certificates that may sign the receiver's certificate.
    pub ca_file: PathBuf,
    /// Client certificate chain and key (PEM), for receivers that authenticate senders.
    /// Default none.
    pub client_identity: Option<ClientIdentity>,
    /// The name the receiver's certificate must carry (DNS name or IP address). Default
    /// the host part of the forwarder's address.
    pub server_name: Option<String>,
}

impl TlsSettings {
    /// Trusts the CAs in `ca_file`; no client certificate; the server name from the
    /// address.
    pub fn new(ca_file: impl Into<PathBuf>) -> Self {
        Self {
            ca_file: ca_file.into(),
            client_identity: None,
            server_name: None,
        }
    }

    /// Presents `identity` to receivers that ask for a client certificate.
    pub fn with_client_identity(mut self, identity: ClientIdentity) -> Self {
        self.client_identity = Some(identity);
        self
    }

    /// Checks the receiver's certificate against `name` instead of the address's host.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Reads the files and builds a rustls client configuration (ring provider, TLS 1.2
    /// and 1.3).
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsConfigError> {
        let mut roots = RootCertStore::empty();
        for cert in read_certs(&self.ca_file)? {
            roots
                .add(cert)
                .map_err(|source| TlsConfigError::Certificate {
                    path: self.ca_file.clone(),
                    source,
                })?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsConfigError::Rustls { source })?
            .with_root_certificates(roots);
        let config = match &self.client_identity {
            None => builder.with_no_client_auth(),
            Some(id) => {
                let chain = read_certs(&id.cert_file)?;
                let key = PrivateKeyDer::from_pem_file(&id.key_file).map_err(|source| {
                    TlsConfigError::Key {
                        path: id.key_file.clone(),
                        source,
                    }
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|source| TlsConfigError::Certificate {
                        path: id.cert_file.clone(),
                        source,
                    })?
            }
        };
        Ok(Arc::new(config))
    }
}

/// A client certificate chain and its private key, both PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsConfigError::Pem {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// TLS settings that cannot be used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TlsConfigError {
    /// A PEM file could not be read or parsed.
    #[error("cannot read certificates from {path}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A PEM file holds no certificate.
    #[error("{path} holds no PEM certificate")]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The private key could not be read.
    #[error("cannot read a private key from {path}")]
    Key {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// rustls refused a certificate or key.
    #[error("rustls refused the certificate or key in {path}")]
    Certificate {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// rustls refused the protocol versions.
    #[error("rustls configuration failed")]
    Rustls {
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// The server name is neither a DNS name nor an IP address.
    #[error("{name:?} is not a valid TLS server name")]
    ServerName {
        /// The name.
        name: String,
    },
}

/// A connection to a receiver failed or misbehaved.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The address did not resolve.
    #[error("cannot resolve {addr}")]
    Resolve {
        /// host:port.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// No TCP connection could be made.
    #[error("cannot connect to {addr}")]
    Connect {
        /// host:port.
        addr: String,
        /// Why (the last address tried).
        #[source]
        source: io::Error,
    },
    /// The receiver's certificate was refused: wrong CA, wrong name, expired.
    #[error("certificate of {addr} refused for server name {server_name}")]
    Certificate {
        /// host:port.
        addr: String,
        /// The name checked.
        server_name: String,
        /// rustls's verdict.
        #[source]
        source: rustls::Error,
    },
    /// The TLS handshake failed for another reason.
    #[error("TLS handshake with {addr} failed")]
    Handshake {
        /// host:port.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An operation did not finish in time (a receiver that stalls).
    #[error("{op} on {addr} timed out after {after:?}")]
    Timeout {
        /// host:port.
        addr: String,
        /// What was being done.
        op: &'static str,
        /// The limit.
        after: Duration,
    },
    /// Reading or writing failed.
    #[error("{op} on {addr} failed")]
    Io {
        /// host:port.
        addr: String,
        /// What was being done.
        op: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The receiver closed the connection.
    #[error("{addr} closed the connection while {op}")]
    Closed {
        /// host:port.
        addr: String,
        /// What was being done.
        op: &'static str,
    },
    /// The receiver broke the RELP protocol or refused a message.
    #[error("RELP with {addr}: {problem}")]
    Relp {
        /// host:port.
        addr: String,
        /// What happened.
        problem: String,
    },
}

impl TransportError {
    /// Whether the receiver's certificate was refused.
    pub fn is_certificate(&self) -> bool {
        matches!(self, TransportError::Certificate { .. })
    }

    fn io(addr: &str, op: &'static str, source: io::Error, after: Duration) -> Self {
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransportError::Timeout {
                addr: addr.to_owned(),
                op,
                after,
            },
            io::ErrorKind::UnexpectedEof => TransportError::Closed {
                addr: addr.to_owned(),
                op,
            },
            _ => TransportError::Io {
                addr: addr.to_owned(),
                op,
                source,
            },
        }
    }
}

/// How long connecting and writing may take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    pub connect: Duration,
    pub write: Duration,
}

/// What TLS needs at connect time.
#[derive(Debug, Clone)]
pub(crate) struct TlsClient {
    pub config: Arc<ClientConfig>,
    pub server_name: ServerName<'static>,
}

impl TlsClient {
    pub fn new(settings: &TlsSettings, addr: &str) -> Result<Self, TlsConfigError> {
        let name = settings
            .server_name
            .clone()
            .unwrap_or_else(|| host_of(addr).to_owned());
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| TlsConfigError::ServerName { name })?;
        Ok(Self {
            config: settings.client_config()?,
            server_name,
        })
    }
}

/// The host part of `host:port` (`[v6]:port` gives `v6`).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// One connection to a receiver, plain or TLS, and the round trip its TCP handshake
/// took.
#[derive(Debug)]
pub(crate) struct Link {
    io: LinkIo,
    rtt: Duration,
}

#[derive(Debug)]
enum LinkIo {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Link {
    /// Connects to `addr` (each resolved address in turn) and, with `tls`, completes
    /// the handshake, all within `timeouts.connect`.
    pub fn connect(
        addr: &str,
        tls: Option<&TlsClient>,
        timeouts: Timeouts,
    ) -> Result<Self, TransportError> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|source| TransportError::Resolve {
                addr: addr.to_owned(),
                source,
            })?
            .collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolved to no address");
        let mut stream = None;
        let mut rtt = Duration::ZERO;
        for a in &addrs {
            let started = Instant::now();
            match TcpStream::connect_timeout(a, timeouts.connect) {
                Ok(s) => {
                    rtt = started.elapsed();
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let Some(sock) = stream else {
            return Err(TransportError::Connect {
                addr: addr.to_owned(),
                source: last,
            });
        };
        let setup = |e| TransportError::Io {
            addr: addr.to_owned(),
            op: "socket setup",
            source: e,
        };
        sock.set_nodelay(true).map_err(setup)?;
        sock.set_write_timeout(Some(timeouts.write))
            .map_err(setup)?;
        sock.set_read_timeout(Some(timeouts.connect))
            .map_err(setup)?;
        let Some(tls) = tls else {
            return Ok(Link {
                io: LinkIo::Plain(sock),
                rtt,
            });
        };
        let mut conn = ClientConnection::new(Arc::clone(&tls.config), tls.server_name.clone())
            .map_err(|e| TransportError::Handshake {
                addr: addr.to_owned(),
                source: io::Error::other(e),
            })?;
        let mut sock = sock;
        let deadline = crate::after(timeouts.connect);
        while conn.is_handshaking() {
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout {
                    addr: addr.to_owned(),
                    op: "TLS handshake",
                    after: timeouts.connect,
                });
            }
            if let Err(e) = conn.complete_io(&mut sock) {
                return Err(handshake_error(addr, &tls.server_name, e, timeouts.connect));
            }
        }
        Ok(Link {
            io: LinkIo::Tls(Box::new(StreamOwned::new(conn, sock))),
            rtt,
        })
    }

    pub fn tcp(&self) -> &TcpStream {
        match &self.io {
            LinkIo::Plain(s) => s,
            LinkIo::Tls(s) => s.get_ref(),
        }
    }

    /// Ends the connection in order and waits, at most `timeout`, for the receiver to
    /// close its side: proof that it read everything sent (see the module docs).
    ///
    /// Two cases look like a close and are not: a receiver that had closed before our
    /// close (it may not have read what we sent after; checked before we half-close),
    /// and one whose reset for such late bytes is still on its way when its earlier end
    /// of stream reaches us (checked by waiting a few handshake round trips after the
    /// end of stream for a reset).
    pub fn confirm_close(mut self, addr: &str, timeout: Duration) -> Result<(), TransportError> {
        let op = "confirming delivery by an orderly close";
        let fail = |e| TransportError::io(addr, op, e, timeout);
        self.flush().map_err(fail)?;
        // Before our close (TLS close_notify included): after it, the receiver's end
        // of stream is the answer we wait for.
        if self.receiver_closed_first().map_err(fail)? {
            return Err(TransportError::Closed {
                addr: addr.to_owned(),
                op: "sending (it closed first, so it may not have read everything)",
            });
        }
        if let LinkIo::Tls(s) = &mut self.io {
            s.conn.send_close_notify();
            self.flush().map_err(fail)?;
        }
        self.tcp().shutdown(Shutdown::Write).map_err(fail)?;
        let deadline = crate::after(timeout);
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout {
                    addr: addr.to_owned(),
                    op,
                    after: timeout,
                });
            }
            self.tcp().set_read_timeout(Some(left)).map_err(fail)?;
            match self.read(&mut buf) {
                Ok(0) => break,
                // Anything the receiver says before closing is of no interest.
                Ok(_) => {}
                // A TCP end without TLS close_notify: rsyslog closes that way, after
                // reading our close_notify, so it is a close all the same.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(fail(e)),
            }
        }
        // A reset for bytes that reached a socket already closed follows the close by
        // at most about a round trip: wait for it, bounded.
        std::thread::sleep(
            (self.rtt * 4).clamp(Duration::from_millis(2), Duration::from_millis(500)),
        );
        match self.tcp().take_error().map_err(fail)? {
            Some(e) => Err(fail(e)),
            None => Ok(()),
        }
    }

    /// Whether the receiver's end of stream arrived before we closed: reads, without
    /// waiting, whatever it sent (nothing, for syslog; TLS session tickets, say).
    fn receiver_closed_first(&mut self) -> io::Result<bool> {
        self.tcp().set_nonblocking(true)?;
        let mut buf = [0u8; 4096];
        let closed = loop {
            match self.read(&mut buf) {
                Ok(0) => break Ok(true),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break Ok(true),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        self.tcp().set_nonblocking(false)?;
        closed
    }
}

fn handshake_error(
    addr: &str,
    server_name: &ServerName<'_>,
    e: io::Error,
    after: Duration,
) -> TransportError {
    let rustls_error = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .cloned();
    match rustls_error {
        Some(source @ rustls::Error::InvalidCertificate(_)) => TransportError::Certificate {
            addr: addr.to_owned(),
            server_name: server_name.to_str().into_owned(),
            source,
        },
        _ => match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransportError::Timeout {
                addr: addr.to_owned(),
                op: "TLS handshake",
                after,
            },
            _ => TransportError::Handshake {
                addr: addr.to_owned(),
                source: e,
            },
        },
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.io {
            LinkIo::Plain(s) => s.read(buf),
            LinkIo::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.io {
            LinkIo::Plain(s) => s.write(buf),
            LinkIo::Tls(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match &mut self.io {
            LinkIo::Plain(s) => s.flush(),
            LinkIo::Tls(s) => s.flush(),
        }
    }
}

/// Appends one octet-counted frame (RFC 6587 §3.4.1: `MSG-LEN SP SYSLOG-MSG`).
pub fn write_octet_counted(out: &mut Vec<u8>, msg: &[u8]) {
    out.extend_from_slice(msg.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(msg);
}

pub(crate) fn io_error(
    addr: &str,
    op: &'static str,
    e: io::Error,
    after: Duration,
) -> TransportError {
    TransportError::io(addr, op, e, after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_of_handles_names_and_ipv6() {
        assert_eq!(host_of("siem.example:6514"), "siem.example");
        assert_eq!(host_of("127.0.0.1:514"), "127.0.0.1");
        assert_eq!(host_of("[::1]:6514"), "::1");
    }

    #[test]
    fn frames_are_octet_counted() {
        let mut out = Vec::new();
        write_octet_counted(&mut out, b"<13>1 - - - - - -");
        assert_eq!(out, b"17 <13>1 - - - - - -");
    }

    #[test]
    fn a_missing_ca_file_is_named() {
        let e = TlsSettings::new("/nonexistent/ca.pem")
            .client_config()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot read certificates from /nonexistent/ca.pem"
        );
    }
}
