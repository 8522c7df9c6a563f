//! The forwarder: one thread that carries records from a [`RecordSource`] to a SIEM, in
//! order, at least once, resuming from a durable cursor.
//!
//! Why a thread of its own with blocking I/O: the engine's decision threads append to
//! the log and must never wait for a SIEM. The forwarder only reads the log (after the
//! cursor), so a receiver that is down or stalls makes it fall behind, never the
//! appender; the backlog lives in the log, bounded by the log's own retention, and
//! drains in order when the receiver returns.
//!
//! What each transport guarantees (records are numbered; "delivered" is what the
//! durable cursor records, and everything after it is resent after any failure or
//! restart, so duplicates happen and every message carries `seq` and `hash` for the
//! SIEM to drop them):
//!
//! * **RELP** (and RELP over TLS): a record is delivered when the receiver answered its
//!   frame with `200 OK`, which rsyslog sends once the message is in its queue (durable
//!   if that queue is disk-assisted). Acknowledged per record; at most a window of
//!   frames is in flight.
//! * **TCP and TLS syslog** (RFC 6587 octet counting, RFC 5425): nothing is
//!   acknowledged on the wire, so records sent on a connection are marked delivered
//!   only when that connection is closed in order: after at most
//!   [`ForwarderConfig::confirm_records`] records, at most
//!   [`ForwarderConfig::confirm_interval`] after the first unconfirmed one was sent,
//!   as soon as the log runs dry with at least a batch unconfirmed, or once it has had
//!   nothing new for [`ForwarderConfig::confirm_linger`], the
//!   forwarder sends TLS `close_notify`, half-closes TCP and waits for the receiver to
//!   close its side. A receiver closes after reading everything before our close; one
//!   that closes with data unread sends a reset; one that stalls never closes. Only an
//!   orderly close advances the cursor; a reset, a timeout or any I/O error leaves it,
//!   and the next connection resends from it. The guarantee: every record up to the
//!   cursor was read by the receiving application; what it did next (its queue, its
//!   disk) is its own. A TCP proxy between us and the receiver would confirm on the
//!   receiver's behalf. The cost is one reconnect per confirmation (by default at most
//!   one a second under load).

use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::backoff::{Backoff, Jitter};
use crate::source::{CursorError, CursorStore, RecordSource, SourceError};
use crate::syslog::{FormatError, SyslogConfig, SyslogFormat};
use crate::transport::relp::{self, Reply};
use crate::transport::{
    Link, Timeouts, TlsClient, TlsConfigError, TlsSettings, TransportError, io_error,
    write_octet_counted,
};

/// How messages travel.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// Syslog over TCP, octet-counted frames (RFC 6587).
    Tcp,
    /// Syslog over TLS (RFC 5425), octet-counted frames.
    Tls(TlsSettings),
    /// RELP over TCP.
    Relp,
    /// RELP over TLS.
    RelpTls(TlsSettings),
}

impl Transport {
    fn tls(&self) -> Option<&TlsSettings> {
        match self {
            Transport::Tls(t) | Transport::RelpTls(t) => Some(t),
            Transport::Tcp | Transport::Relp => None,
        }
    }

    fn is_relp(&self) -> bool {
        matches!(self, Transport::Relp | Transport::RelpTls(_))
    }
}

/// Forwarder settings. Every field states its default ([`ForwarderConfig::new`]).
#[derive(Debug, Clone)]
pub struct ForwarderConfig {
    /// The receiver, `host:port`.
    pub address: String,
    /// How to reach it.
    pub transport: Transport,
    /// How records become messages; default [`SyslogConfig::default`].
    pub syslog: SyslogConfig,
    /// Records read from the source at a time; default 512.
    pub batch_records: usize,
    /// Limit on connecting, including the TLS handshake; default 5 s.
    pub connect_timeout: Duration,
    /// Limit on one blocked write (a receiver that stops reading); default 10 s.
    pub write_timeout: Duration,
    /// Limit on waiting for a RELP response or for the receiver's orderly close;
    /// default 10 s.
    pub ack_timeout: Duration,
    /// Delay between failed attempts; default 100 ms doubling to 30 s.
    pub backoff: Backoff,
    /// TCP/TLS: confirm (orderly close) at the latest this long after the first
    /// unconfirmed record was sent; default 1 s.
    pub confirm_interval: Duration,
    /// TCP/TLS: confirm after this many unconfirmed records; default 100,000.
    pub confirm_records: u64,
    /// TCP/TLS: with fewer than `batch_records` unconfirmed, confirm once the source
    /// has had nothing new for this long (a larger backlog is confirmed as soon as the
    /// source runs dry); default 200 ms.
    pub confirm_linger: Duration,
    /// RELP: frames in flight; default 128 (librelp's own window).
    pub relp_window: usize,
    /// RELP: store the cursor at most this often while acknowledgements stream in (it
    /// is always stored when nothing is in flight); default 200 ms.
    pub cursor_store_interval: Duration,
    /// The backlog (newest − cursor) above which [`ForwarderStats::behind`] is set, for
    /// a readiness check; default 10,000.
    pub behind_threshold: u64,
    /// How long the idle forwarder waits for new records before looking at its stop
    /// flag again; default 250 ms.
    pub idle_wait: Duration,
}

impl ForwarderConfig {
    /// Settings with every default, sending to `address` over `transport`.
    pub fn new(address: impl Into<String>, transport: Transport) -> Self {
        Self {
            address: address.into(),
            transport,
            syslog: SyslogConfig::default(),
            batch_records: 512,
            connect_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            ack_timeout: Duration::from_secs(10),
            backoff: Backoff::default(),
            confirm_interval: Duration::from_secs(1),
            confirm_records: 100_000,
            confirm_linger: Duration::from_millis(200),
            relp_window: 128,
            cursor_store_interval: Duration::from_millis(200),
            behind_threshold: 10_000,
            idle_wait: Duration::from_millis(250),
        }
    }
}

/// A forwarder that could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ForwarderError {
    /// The syslog settings are invalid.
    #[error("invalid syslog settings")]
    Syslog(#[source] FormatError),
    /// The TLS settings cannot be used.
    #[error("invalid TLS settings")]
    Tls(#[source] TlsConfigError),
    /// The cursor could not be loaded.
    #[error("cannot load the delivery cursor")]
    Cursor(#[source] CursorError),
    /// A setting is out of range.
    #[error("forwarder setting {name} {problem}")]
    Setting {
        /// The field.
        name: &'static str,
        /// What is wrong.
        problem: &'static str,
    },
    /// The thread could not be started.
    #[error("cannot start the forwarder thread")]
    Spawn(#[source] std::io::Error),
}

/// A snapshot of the forwarder's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwarderStats {
    /// Records confirmed delivered (acknowledged, or before an orderly close) since
    /// start.
    pub forwarded: u64,
    /// Records written to a connection, resends included.
    pub sent: u64,
    /// Connections that failed after being established (write, acknowledgement or
    /// confirmation failed or timed out).
    pub failed_sends: u64,
    /// Connection attempts that failed (refused, timed out, TLS refused).
    pub failed_connects: u64,
    /// Connection attempts refused because of the receiver's certificate.
    pub certificate_errors: u64,
    /// Connection attempts made after a failure.
    pub reconnects: u64,
    /// TCP/TLS orderly closes that confirmed delivery.
    pub confirmations: u64,
    /// Messages whose MSG or fields were cut by the size limit.
    pub truncated: u64,
    /// Failed reads of the source and failed stores of the cursor.
    pub source_errors: u64,
    /// Sequence numbers missing from the source (skipped over).
    pub gaps: u64,
    /// The durable cursor: the highest sequence number delivered.
    pub cursor: u64,
    /// The newest sequence number in the source.
    pub newest: u64,
    /// `newest − cursor`.
    pub backlog: u64,
    /// Whether the backlog exceeds the threshold.
    pub behind: bool,
    /// Whether a connection is open.
    pub connected: bool,
    /// The latest error, if any since the last success.
    pub last_error: Option<String>,
}

#[derive(Default)]
struct Counters {
    forwarded: AtomicU64,
    sent: AtomicU64,
    failed_sends: AtomicU64,
    failed_connects: AtomicU64,
    certificate_errors: AtomicU64,
    reconnects: AtomicU64,
    confirmations: AtomicU64,
    truncated: AtomicU64,
    source_errors: AtomicU64,
    gaps: AtomicU64,
    cursor: AtomicU64,
    connected: AtomicBool,
}

struct Shared {
    counters: Counters,
    last_error: Mutex<Option<String>>,
    stop: AtomicBool,
    stop_lock: Mutex<()>,
    stop_wake: Condvar,
    behind_threshold: u64,
}

impl Shared {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    fn set_error(&self, e: Option<String>) {
        *self
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = e;
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Sleeps for `d` unless asked to stop first.
    fn sleep(&self, d: Duration) {
        let deadline = crate::after(d);
        let mut guard = self
            .stop_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while !self.stopping() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            guard = self
                .stop_wake
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A running forwarder. Dropping it stops the thread (after confirming what it sent,
/// within the acknowledgement timeout).
pub struct Forwarder {
    shared: Arc<Shared>,
    source: Arc<dyn RecordSource>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Forwarder {
    /// Checks `config`, loads the cursor and starts the forwarding thread.
    pub fn start<C>(
        config: ForwarderConfig,
        source: Arc<dyn RecordSource>,
        cursor: C,
    ) -> Result<Self, ForwarderError>
    where
        C: CursorStore + 'static,
    {
        let format = SyslogFormat::new(&config.syslog).map_err(ForwarderError::Syslog)?;
        let tls = config
            .transport
            .tls()
            .map(|t| TlsClient::new(t, &config.address))
            .transpose()
            .map_err(ForwarderError::Tls)?;
        let setting = |name, problem| Err(ForwarderError::Setting { name, problem });
        if config.batch_records == 0 {
            return setting("batch_records", "must be at least 1");
        }
        if config.relp_window == 0 {
            return setting("relp_window", "must be at least 1");
        }
        if config.confirm_records == 0 {
            return setting("confirm_records", "must be at least 1");
        }
        let start = cursor.load().map_err(ForwarderError::Cursor)?;
        let shared = Arc::new(Shared {
            counters: Counters::default(),
            last_error: Mutex::new(None),
            stop: AtomicBool::new(false),
            stop_lock: Mutex::new(()),
            stop_wake: Condvar::new(),
            behind_threshold: config.behind_threshold,
        });
        shared.counters.cursor.store(start, Ordering::Relaxed);
        let worker = Worker {
            timeouts: Timeouts {
                connect: config.connect_timeout,
                write: config.write_timeout,
            },
            cfg: config,
            tls,
            format,
            source: Arc::clone(&source),
            store: Box::new(cursor),
            cursor: start,
            acked: start,
            stored_at: Instant::now(),
            shared: Arc::clone(&shared),
            failures: 0,
            jitter: Jitter::new(),
            msg: Vec::with_capacity(8192),
            frame: Vec::with_capacity(8192),
        };
        let thread = std::thread::Builder::new()
            .name("probity-siem-forwarder".into())
            .spawn(move || worker.run())
            .map_err(ForwarderError::Spawn)?;
        Ok(Self {
            shared,
            source,
            thread: Some(thread),
        })
    }

    /// The counters now. Backlog and `behind` read the source's newest sequence number.
    pub fn stats(&self) -> ForwarderStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let cursor = get(&c.cursor);
        let newest = match self.source.newest_seq() {
            Ok(n) => n,
            Err(_) => cursor,
        };
        let backlog = newest.saturating_sub(cursor);
        ForwarderStats {
            forwarded: get(&c.forwarded),
            sent: get(&c.sent),
            failed_sends: get(&c.failed_sends),
            failed_connects: get(&c.failed_connects),
            certificate_errors: get(&c.certificate_errors),
            reconnects: get(&c.reconnects),
            confirmations: get(&c.confirmations),
            truncated: get(&c.truncated),
            source_errors: get(&c.source_errors),
            gaps: get(&c.gaps),
            cursor,
            newest,
            backlog,
            behind: backlog > self.shared.behind_threshold,
            connected: c.connected.load(Ordering::Relaxed),
            last_error: self
                .shared
                .last_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }

    /// Whether the backlog exceeds the threshold (for a readiness check).
    pub fn is_behind(&self) -> bool {
        self.stats().behind
    }

    /// Stops the thread and returns the final counters.
    pub fn stop(mut self) -> ForwarderStats {
        self.halt();
        self.stats()
    }

    fn halt(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _guard = self
                .shared
                .stop_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.shared.stop_wake.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Why a session ended early.
#[derive(Debug, Error)]
enum SessionError {
    #[error(transparent)]
    Connect(TransportError),
    #[error(transparent)]
    Send(TransportError),
    #[error(transparent)]
    Source(#[from] SourceError),
}

struct Worker {
    cfg: ForwarderConfig,
    timeouts: Timeouts,
    tls: Option<TlsClient>,
    format: SyslogFormat,
    source: Arc<dyn RecordSource>,
    store: Box<dyn CursorStore>,
    /// Durable cursor.
    cursor: u64,
    /// Highest sequence number known delivered (≥ cursor).
    acked: u64,
    stored_at: Instant,
    shared: Arc<Shared>,
    failures: u32,
    jitter: Jitter,
    msg: Vec<u8>,
    frame: Vec<u8>,
}

impl Worker {
    fn run(mut self) {
        while !self.shared.stopping() {
            if !self
                .source
                .wait_for(self.acked.saturating_add(1), self.cfg.idle_wait)
            {
                continue;
            }
            let result = if self.cfg.transport.is_relp() {
                self.relp_session()
            } else {
                self.stream_session()
            };
            self.shared
                .counters
                .connected
                .store(false, Ordering::Relaxed);
            match result {
                Ok(()) => self.failures = 0,
                Err(e) => {
                    let c = &self.shared.counters;
                    match &e {
                        SessionError::Connect(t) => {
                            Shared::add(&c.failed_connects, 1);
                            if t.is_certificate() {
                                Shared::add(&c.certificate_errors, 1);
                            }
                        }
                        SessionError::Send(_) => Shared::add(&c.failed_sends, 1),
                        SessionError::Source(_) => Shared::add(&c.source_errors, 1),
                    }
                    self.shared.set_error(Some(crate::error_chain(&e)));
                    self.failures = self.failures.saturating_add(1);
                    let delay = self.cfg.backoff.delay(self.failures, &mut self.jitter);
                    self.shared.sleep(delay);
                }
            }
        }
        self.store_cursor();
    }

    fn connect(&mut self) -> Result<Link, SessionError> {
        if self.failures > 0 {
            Shared::add(&self.shared.counters.reconnects, 1);
        }
        let link = Link::connect(&self.cfg.address, self.tls.as_ref(), self.timeouts)
            .map_err(SessionError::Connect)?;
        self.shared
            .counters
            .connected
            .store(true, Ordering::Relaxed);
        Ok(link)
    }

    /// Marks everything up to `upto` delivered; stores the cursor if `force` or if the
    /// last store is older than the interval.
    fn advance(&mut self, upto: u64, force: bool) {
        if upto > self.acked {
            Shared::add(&self.shared.counters.forwarded, upto - self.acked);
            self.acked = upto;
            self.shared.set_error(None);
        }
        if force || self.stored_at.elapsed() >= self.cfg.cursor_store_interval {
            self.store_cursor();
        }
    }

    fn store_cursor(&mut self) {
        if self.acked == self.cursor {
            return;
        }
        match self.store.store(self.acked) {
            Ok(()) => {
                self.cursor = self.acked;
                self.stored_at = Instant::now();
                self.shared
                    .counters
                    .cursor
                    .store(self.cursor, Ordering::Relaxed);
            }
            Err(e) => {
                // Not fatal: a cursor that lags only causes resends.
                Shared::add(&self.shared.counters.source_errors, 1);
                self.shared.set_error(Some(crate::error_chain(&e)));
            }
        }
    }

    /// Formats `r` into `self.msg`, counting truncation and gaps.
    fn format(&mut self, r: &crate::record::Record, expected: u64) {
        if r.seq > expected {
            Shared::add(&self.shared.counters.gaps, r.seq - expected);
            self.shared.set_error(Some(format!(
                "the source skipped records {expected}..{}",
                r.seq - 1
            )));
        }
        self.msg.clear();
        let f = self.format.format(r, &mut self.msg);
        if f.msg_truncated || f.fields_omitted > 0 {
            Shared::add(&self.shared.counters.truncated, 1);
        }
    }

    /// TCP or TLS: send from the cursor, confirm by an orderly close.
    fn stream_session(&mut self) -> Result<(), SessionError> {
        let addr = self.cfg.address.clone();
        let write_timeout = self.cfg.write_timeout;
        let send_err =
            |e| SessionError::Send(io_error(&addr, "sending syslog frames", e, write_timeout));
        let link = self.connect()?;
        let mut w = BufWriter::with_capacity(64 * 1024, link);
        let mut next = self.acked.saturating_add(1);
        let mut written = self.acked;
        let mut first_unconfirmed: Option<Instant> = None;
        loop {
            if self.shared.stopping() {
                break;
            }
            let batch = self.source.read(next, self.cfg.batch_records)?;
            if batch.is_empty() {
                w.flush().map_err(send_err)?;
                match first_unconfirmed {
                    None => {
                        self.source.wait_for(next, self.cfg.idle_wait);
                        continue;
                    }
                    Some(t) => {
                        // A backlog just drained: confirm now. A trickle: linger for
                        // more records, so that one reconnect confirms many.
                        let unconfirmed = written - self.acked;
                        let batch = u64::try_from(self.cfg.batch_records).unwrap_or(u64::MAX);
                        if unconfirmed >= batch {
                            break;
                        }
                        let deadline = crate::later(t, self.cfg.confirm_interval)
                            .min(crate::after(self.cfg.confirm_linger));
                        let left = deadline.saturating_duration_since(Instant::now());
                        if !left.is_zero() && self.source.wait_for(next, left) {
                            continue;
                        }
                        break;
                    }
                }
            }
            for r in &batch {
                self.format(r, next);
                self.frame.clear();
                write_octet_counted(&mut self.frame, &self.msg);
                w.write_all(&self.frame).map_err(send_err)?;
                written = r.seq;
                next = r.seq.saturating_add(1);
            }
            Shared::add(
                &self.shared.counters.sent,
                u64::try_from(batch.len()).unwrap_or(0),
            );
            let since = *first_unconfirmed.get_or_insert_with(Instant::now);
            if written - self.acked >= self.cfg.confirm_records
                || since.elapsed() >= self.cfg.confirm_interval
            {
                break;
            }
        }
        let link = w.into_inner().map_err(|e| send_err(e.into_error()))?;
        if written == self.acked {
            return Ok(());
        }
        link.confirm_close(&addr, self.cfg.ack_timeout)
            .map_err(SessionError::Send)?;
        Shared::add(&self.shared.counters.confirmations, 1);
        self.advance(written, true);
        Ok(())
    }

    /// RELP: keep a window of frames in flight; advance on each `200 OK`.
    fn relp_session(&mut self) -> Result<(), SessionError> {
        let link = self.connect()?;
        let addr = self.cfg.address.clone();
        let mut s =
            relp::Session::open(link, &addr, self.cfg.ack_timeout).map_err(SessionError::Send)?;
        let mut next = self.acked.saturating_add(1);
        loop {
            let stopping = self.shared.stopping();
            if stopping && s.in_flight.is_empty() {
                break;
            }
            let room = self.cfg.relp_window.saturating_sub(s.in_flight.len());
            if room > 0 && !stopping {
                let batch = self.source.read(next, room.min(self.cfg.batch_records))?;
                for r in &batch {
                    self.format(r, next);
                    s.send(r.seq, &self.msg).map_err(SessionError::Send)?;
                    next = r.seq.saturating_add(1);
                }
                Shared::add(
                    &self.shared.counters.sent,
                    u64::try_from(batch.len()).unwrap_or(0),
                );
            }
            s.flush().map_err(SessionError::Send)?;
            if s.in_flight.is_empty() {
                self.store_cursor();
                self.source.wait_for(next, self.cfg.idle_wait);
                continue;
            }
            // More to send and room for it: send before waiting for answers.
            if !stopping
                && s.in_flight.len() < self.cfg.relp_window
                && self.source.newest_seq()? >= next
            {
                continue;
            }
            let deadline = crate::after(self.cfg.ack_timeout);
            let replies = s
                .read_replies(deadline, self.cfg.ack_timeout)
                .map_err(SessionError::Send)?;
            let mut acked = self.acked;
            for reply in replies {
                match reply {
                    Reply::Rsp { txnr, code, text } => {
                        let Some(&(front, seq)) = s.in_flight.front() else {
                            return Err(SessionError::Send(TransportError::Relp {
                                addr,
                                problem: format!("response to transaction {txnr}, none in flight"),
                            }));
                        };
                        if txnr != front {
                            return Err(SessionError::Send(TransportError::Relp {
                                addr,
                                problem: format!(
                                    "response to transaction {txnr}, expected {front}"
                                ),
                            }));
                        }
                        if code != 200 {
                            self.advance(acked, true);
                            return Err(SessionError::Send(TransportError::Relp {
                                addr,
                                problem: format!("record {seq} refused: {code} {text}"),
                            }));
                        }
                        s.in_flight.pop_front();
                        acked = seq;
                    }
                    Reply::ServerClose => {
                        self.advance(acked, true);
                        return Err(SessionError::Send(TransportError::Closed {
                            addr,
                            op: "sending RELP frames",
                        }));
                    }
                }
            }
            let idle = s.in_flight.is_empty();
            self.advance(acked, idle);
        }
        s.close(self.cfg.ack_timeout);
        self.store_cursor();
        Ok(())
    }
}
