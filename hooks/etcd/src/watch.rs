//! Watches: every change under a prefix, in revision order, exactly once, across reconnects;
//! and [`EtcdClient::watch_with_resync`], which keeps a caller's state equal to etcd's.
//!
//! Why this module exists: each Probity process holds the cluster state it decides from in
//! memory and must apply etcd's changes in order without losing one. A gRPC watch breaks
//! when its member dies or loses the leader; the history it would resume from may have been
//! compacted meanwhile. Here a watch resumes on another member from the revision after the
//! last one it delivered, drops anything at or below it (no duplicate), and when the history
//! is gone says so ([`WatchMessage::Compacted`]) so the caller reads everything again. The
//! resync helper does that read itself and hands the handler a fresh snapshot.
//!
//! Invariants:
//! * events are delivered in increasing `mod_revision`, each revision once; a resumed watch
//!   starts at the last delivered revision + 1;
//! * a handler sees `reset(snapshot at R)` then only events above R, so after any sequence of
//!   disconnects and compactions its state equals etcd's at the last revision it applied;
//! * the handler runs on a thread of its own, never on a gRPC or runtime task, so a slow
//!   handler holds back only its own watch (by backpressure: nothing is dropped).
//!
//! Staleness: an idle watch asks etcd for a progress notification every
//! [`EtcdConfig::progress_interval`](crate::EtcdConfig::progress_interval), so
//! [`WatchStatus::since_last_heard`] stays below that interval while etcd answers and grows
//! when it does not. (etcd 3.4 answers progress requests with the store's current revision
//! even for a watcher still catching up, so a progress notification is used as a sign of life
//! only, never to advance the resume revision.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::WatchOptions;
use tokio::sync::mpsc;

use crate::client::{Entry, EtcdClient, prefix_end};
use crate::error::EtcdError;
use crate::health::HealthState;
use crate::key::Escaped;

/// Default time a watch may stay disconnected before [`EtcdClient::watch_with_resync`] reads
/// everything again instead of resuming.
pub const DEFAULT_RESYNC_AFTER_DISCONNECT: Duration = Duration::from_secs(30);

/// Messages buffered between the gRPC reader and the consumer.
const CHANNEL_CAPACITY: usize = 256;
/// Reconnection pauses: the first, doubling up to the last.
const RECONNECT_FIRST: Duration = Duration::from_millis(25);
const RECONNECT_MAX: Duration = Duration::from_millis(1000);

/// One change to a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// The key was created or changed.
    Put {
        /// The key as it is now.
        entry: Entry,
        /// The key before, if it existed and etcd still had it.
        prev: Option<Entry>,
    },
    /// The key was deleted (or its lease expired).
    Delete {
        /// The key, relative to the prefix.
        key: String,
        /// Revision of the delete.
        mod_revision: i64,
        /// The key before, if etcd still had it.
        prev: Option<Entry>,
    },
}

impl WatchEvent {
    /// The key, relative to the prefix.
    pub fn key(&self) -> &str {
        match self {
            Self::Put { entry, .. } => &entry.key,
            Self::Delete { key, .. } => key,
        }
    }

    /// The revision of the change.
    pub fn mod_revision(&self) -> i64 {
        match self {
            Self::Put { entry, .. } => entry.mod_revision,
            Self::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// What a [`WatchStream`] delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchMessage {
    /// Changes, in revision order, all above those delivered before.
    Events {
        /// The events (never empty).
        events: Vec<WatchEvent>,
        /// The highest revision among them.
        revision: i64,
    },
    /// The revision to resume from was compacted away: events were lost, read everything
    /// again (a [`crate::Listing`]) and watch from its revision + 1. The stream ends here.
    Compacted {
        /// The revision the watch asked for.
        requested: i64,
        /// The oldest revision etcd still has.
        compact_revision: i64,
    },
}

/// Why a [`WatchHandler`] receives a whole snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncReason {
    /// The first read.
    Initial,
    /// The watch fell behind a compaction.
    Compacted {
        /// The revision the watch asked for.
        requested: i64,
        /// The oldest revision etcd still had.
        compact_revision: i64,
    },
    /// The watch was disconnected for longer than the resync threshold.
    Disconnected {
        /// For how long.
        duration: Duration,
    },
}

/// Every key under the prefix at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The revision read at.
    pub revision: i64,
    /// The keys, in key order.
    pub entries: Vec<Entry>,
    /// Why this snapshot was taken.
    pub reason: SyncReason,
}

/// Receives a prefix's state from [`EtcdClient::watch_with_resync`], on a thread of its own.
pub trait WatchHandler: Send + 'static {
    /// Replaces the whole state with `snapshot`: the first call, and after every resync.
    fn reset(&mut self, snapshot: Snapshot);
    /// Applies `events` (in revision order, all above the last reset or batch); the state is
    /// then etcd's at `revision`.
    fn apply(&mut self, events: Vec<WatchEvent>, revision: i64);
}

/// A watch's link to etcd, for readiness ("serving from state N s old").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchStatus {
    /// Whether the watch stream is open.
    pub connected: bool,
    /// Time since etcd last sent anything on this watch (an event, a progress notification,
    /// the snapshot read); `None` before the first.
    pub since_last_heard: Option<Duration>,
    /// The revision the consumer's state reflects: the last delivered (a [`WatchStream`]) or
    /// applied by the handler ([`ResyncWatch`]).
    pub revision: i64,
    /// Full reads after the first (compactions and long disconnects).
    pub resyncs: u64,
    /// Events skipped because their key was not UTF-8 (logged with the key).
    pub malformed_keys: u64,
    /// The last failure, if any (kept after recovery).
    pub last_error: Option<String>,
}

/// Shared between a watch's task, its consumer and its status readers.
#[derive(Debug)]
struct WatchShared {
    link: HealthState,
    resyncs: AtomicU64,
    malformed: AtomicU64,
}

impl WatchShared {
    fn new() -> Self {
        Self {
            link: HealthState::new(),
            resyncs: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
        }
    }

    fn status(&self) -> WatchStatus {
        let link = self.link.report();
        WatchStatus {
            connected: link.connected,
            since_last_heard: link.since_last_heard,
            revision: link.revision,
            resyncs: self.resyncs.load(Ordering::Relaxed),
            malformed_keys: self.malformed.load(Ordering::Relaxed),
            last_error: link.last_error,
        }
    }
}

/// Changes under a prefix, from [`EtcdClient::watch_prefix`]. Dropping it ends the watch.
#[derive(Debug)]
pub struct WatchStream {
    rx: mpsc::Receiver<WatchMessage>,
    shared: Arc<WatchShared>,
    task: tokio::task::JoinHandle<()>,
}

impl WatchStream {
    /// The next message; `None` after [`WatchMessage::Compacted`].
    pub async fn next(&mut self) -> Option<WatchMessage> {
        self.rx.recv().await
    }

    /// The watch's link to etcd.
    pub fn status(&self) -> WatchStatus {
        self.shared.status()
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A running [`EtcdClient::watch_with_resync`]. Dropping it stops the watch; the handler's
/// thread ends after the call it is in.
#[derive(Debug)]
pub struct ResyncWatch {
    shared: Arc<WatchShared>,
    task: tokio::task::JoinHandle<()>,
}

impl ResyncWatch {
    /// The watch's link to etcd and the revision the handler has applied.
    pub fn status(&self) -> WatchStatus {
        self.shared.status()
    }
}

impl Drop for ResyncWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Options of [`EtcdClient::watch_with_resync_options`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ResyncOptions {
    /// See [`DEFAULT_RESYNC_AFTER_DISCONNECT`].
    pub resync_after_disconnect: Duration,
}

impl Default for ResyncOptions {
    fn default() -> Self {
        Self {
            resync_after_disconnect: DEFAULT_RESYNC_AFTER_DISCONNECT,
        }
    }
}

impl ResyncOptions {
    /// Sets the disconnection time after which the watch reads everything again.
    pub fn with_resync_after_disconnect(mut self, after: Duration) -> Self {
        self.resync_after_disconnect = after;
        self
    }
}

/// How a [`follow`] ended.
enum FollowEnd {
    Compacted {
        requested: i64,
        compact_revision: i64,
    },
    Disconnected(Duration),
    /// The consumer went away.
    Closed,
}

/// Where [`follow`] delivers.
trait EventSink: Send + Sync {
    /// `false` when the consumer went away.
    fn deliver(
        &self,
        events: Vec<WatchEvent>,
        revision: i64,
    ) -> impl std::future::Future<Output = bool> + Send;
}

impl EventSink for mpsc::Sender<WatchMessage> {
    async fn deliver(&self, events: Vec<WatchEvent>, revision: i64) -> bool {
        self.send(WatchMessage::Events { events, revision })
            .await
            .is_ok()
    }
}

/// What the resync driver hands the handler thread.
enum Delivery {
    Reset(Snapshot),
    Apply(Vec<WatchEvent>, i64),
}

impl EventSink for mpsc::Sender<Delivery> {
    async fn deliver(&self, events: Vec<WatchEvent>, revision: i64) -> bool {
        self.send(Delivery::Apply(events, revision)).await.is_ok()
    }
}

impl EtcdClient {
    /// Watches every key under `prefix` (relative to the configured prefix) from revision
    /// `from` (inclusive; 0 = from now), with previous values. Reconnects to any member,
    /// forever, resuming after the last delivered revision; ends with
    /// [`WatchMessage::Compacted`] if that revision is gone. Spawns a task on the current
    /// tokio runtime.
    pub fn watch_prefix(&self, prefix: &str, from: i64) -> WatchStream {
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let shared = Arc::new(WatchShared::new());
        let client = self.clone();
        let prefix = prefix.to_owned();
        let task_shared = shared.clone();
        let task = tokio::spawn(async move {
            if let FollowEnd::Compacted {
                requested,
                compact_revision,
            } = follow(&client, &prefix, from, &tx, &task_shared, None, true).await
            {
                let _ = tx
                    .send(WatchMessage::Compacted {
                        requested,
                        compact_revision,
                    })
                    .await;
            }
        });
        WatchStream { rx, shared, task }
    }

    /// Keeps `handler`'s state equal to etcd's for every key under `prefix`: reads everything
    /// ([`WatchHandler::reset`]), then applies each change ([`WatchHandler::apply`]); after a
    /// compaction or a disconnection longer than [`DEFAULT_RESYNC_AFTER_DISCONNECT`] it
    /// reads everything again and resets. Full reads that fail are retried until they succeed
    /// (the status shows the failure and the growing staleness meanwhile).
    pub fn watch_with_resync<H: WatchHandler>(
        &self,
        prefix: &str,
        handler: H,
    ) -> Result<ResyncWatch, EtcdError> {
        self.watch_with_resync_options(prefix, handler, ResyncOptions::default())
    }

    /// [`EtcdClient::watch_with_resync`] with options.
    pub fn watch_with_resync_options<H: WatchHandler>(
        &self,
        prefix: &str,
        mut handler: H,
        options: ResyncOptions,
    ) -> Result<ResyncWatch, EtcdError> {
        let (tx, mut rx) = mpsc::channel::<Delivery>(CHANNEL_CAPACITY);
        let shared = Arc::new(WatchShared::new());
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("probity-etcd-watch".into())
            .spawn(move || {
                while let Some(delivery) = rx.blocking_recv() {
                    let revision = match delivery {
                        Delivery::Reset(snapshot) => {
                            let revision = snapshot.revision;
                            handler.reset(snapshot);
                            revision
                        }
                        Delivery::Apply(events, revision) => {
                            handler.apply(events, revision);
                            revision
                        }
                    };
                    thread_shared.link.heard(Some(revision));
                }
            })
            .map_err(|source| EtcdError::Spawn {
                what: "watch handler",
                source,
            })?;
        let client = self.clone();
        let prefix = prefix.to_owned();
        let task_shared = shared.clone();
        let task = tokio::spawn(async move {
            resync_loop(&client, &prefix, &tx, &task_shared, &options).await;
        });
        Ok(ResyncWatch { shared, task })
    }
}

async fn resync_loop(
    client: &EtcdClient,
    prefix: &str,
    tx: &mpsc::Sender<Delivery>,
    shared: &WatchShared,
    options: &ResyncOptions,
) {
    let mut reason = SyncReason::Initial;
    loop {
        let mut backoff = RECONNECT_FIRST;
        let listing = loop {
            match client.list(prefix).await {
                Ok(listing) => break listing,
                Err(e) => {
                    shared.link.failed(e.to_string());
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RECONNECT_MAX);
                }
            }
        };
        if reason != SyncReason::Initial {
            shared.resyncs.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                prefix,
                ?reason,
                revision = listing.revision,
                "etcd watch resynced"
            );
        }
        let snapshot = Snapshot {
            revision: listing.revision,
            entries: listing.entries,
            reason,
        };
        if tx.send(Delivery::Reset(snapshot)).await.is_err() {
            return;
        }
        let from = listing.revision.saturating_add(1);
        reason = match follow(
            client,
            prefix,
            from,
            tx,
            shared,
            Some(options.resync_after_disconnect),
            false,
        )
        .await
        {
            FollowEnd::Compacted {
                requested,
                compact_revision,
            } => SyncReason::Compacted {
                requested,
                compact_revision,
            },
            FollowEnd::Disconnected(duration) => SyncReason::Disconnected { duration },
            FollowEnd::Closed => return,
        };
    }
}

/// Follows `prefix` from revision `from`, delivering to `sink`, across reconnects, until
/// compaction, a disconnection longer than `give_up_after`, or the consumer leaves.
/// `track_revision`: whether delivering advances the status revision (otherwise the handler
/// thread does, after applying).
async fn follow<S: EventSink>(
    client: &EtcdClient,
    prefix: &str,
    from: i64,
    sink: &S,
    shared: &WatchShared,
    give_up_after: Option<Duration>,
    track_revision: bool,
) -> FollowEnd {
    let inner = &*client.inner;
    let keyspace = &inner.keyspace;
    let full_prefix = keyspace.full(prefix);
    let range_end = prefix_end(&full_prefix);
    let progress_interval = inner.config.progress_interval;
    let silence_limit = progress_interval * 3 + inner.config.request_timeout;
    let count = inner.members.len().max(1);
    // The next revision wanted: everything below it was delivered.
    let mut next = from;
    let mut disconnected_since: Option<Instant> = None;
    let mut backoff = RECONNECT_FIRST;
    loop {
        if let (Some(since), Some(limit)) = (disconnected_since, give_up_after)
            && since.elapsed() >= limit
        {
            return FollowEnd::Disconnected(since.elapsed());
        }
        let index = inner.current.load(Ordering::Relaxed) % count;
        let Some(member) = inner.members.get(index) else {
            return FollowEnd::Closed;
        };
        let mut options = WatchOptions::new()
            .with_range(range_end.clone())
            .with_prev_key()
            .with_progress_notify();
        if next > 0 {
            options = options.with_start_revision(next);
        }
        let mut watch_client = member.client.watch_client();
        let opened = tokio::time::timeout(
            inner.config.request_timeout,
            watch_client.watch(full_prefix.clone(), Some(options)),
        )
        .await;
        let reason = match opened {
            Ok(Ok(stream)) => {
                let (mut requests, mut responses) = stream.split();
                let mut last_message = Instant::now();
                let mut progress_asked = false;
                loop {
                    // Quiet for a progress interval: ask for progress; asked and still
                    // quiet at the silence limit: the stream is dead.
                    let deadline = last_message
                        + if progress_asked {
                            silence_limit
                        } else {
                            progress_interval
                        };
                    tokio::select! {
                        message = responses.message() => {
                            let resp = match message {
                                Ok(Some(resp)) => resp,
                                Ok(None) => break format!("{}: watch stream closed", member.url),
                                Err(e) => break format!("{}: {}", member.url, crate::client::describe_error(&e)),
                            };
                            last_message = Instant::now();
                            progress_asked = false;
                            shared.link.heard(None);
                            inner.health.heard(resp.header().map(|h| h.revision()));
                            if resp.compact_revision() > 0 {
                                return FollowEnd::Compacted {
                                    requested: next,
                                    compact_revision: resp.compact_revision(),
                                };
                            }
                            if resp.canceled() {
                                break format!("{}: watch canceled: {}", member.url, resp.cancel_reason());
                            }
                            if resp.created() {
                                disconnected_since = None;
                                backoff = RECONNECT_FIRST;
                            }
                            if let Some((events, revision)) = convert(keyspace, shared, resp.events(), next) {
                                // Recorded before the consumer can see the events.
                                if track_revision {
                                    shared.link.heard(Some(revision));
                                }
                                if !sink.deliver(events, revision).await {
                                    return FollowEnd::Closed;
                                }
                                next = revision.saturating_add(1);
                            }
                        }
                        () = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {
                            if progress_asked {
                                break format!("{}: watch silent for {:?}", member.url, last_message.elapsed());
                            }
                            if let Err(e) = requests.request_progress().await {
                                break format!("{}: {}", member.url, crate::client::describe_error(&e));
                            }
                            progress_asked = true;
                        }
                    }
                }
            }
            Ok(Err(e)) => format!("{}: {}", member.url, crate::client::describe_error(&e)),
            Err(_) => format!(
                "{}: watch not opened within {:?}",
                member.url, inner.config.request_timeout
            ),
        };
        tracing::debug!(prefix, next, %reason, "etcd watch reconnecting");
        shared.link.failed(reason);
        disconnected_since.get_or_insert_with(Instant::now);
        inner
            .current
            .compare_exchange(
                index,
                (index + 1) % count,
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .ok();
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RECONNECT_MAX);
    }
}

/// The events of one response at or above `next`, converted; `None` if none remain.
fn convert(
    keyspace: &crate::key::Keyspace,
    shared: &WatchShared,
    events: &[etcd_client::Event],
    next: i64,
) -> Option<(Vec<WatchEvent>, i64)> {
    let mut out = Vec::with_capacity(events.len());
    let mut revision = 0;
    for event in events {
        let Some(kv) = event.kv() else {
            continue;
        };
        if kv.mod_revision() < next {
            // Already delivered before a reconnect.
            continue;
        }
        let prev = event
            .prev_kv()
            .and_then(|p| Entry::from_kv(keyspace, p).ok());
        // Read the raw type: etcd-client's accessor panics on a value it does not know.
        let converted = match event.0.r#type {
            0 => Entry::from_kv(keyspace, kv).map(|entry| WatchEvent::Put { entry, prev }),
            1 => keyspace
                .relative(kv.key())
                .map(|key| WatchEvent::Delete {
                    key: key.to_owned(),
                    mod_revision: kv.mod_revision(),
                    prev,
                })
                .map_err(|source| EtcdError::MalformedKey {
                    key: Escaped(kv.key()).to_string(),
                    source,
                }),
            other => {
                tracing::error!(
                    event_type = other,
                    "etcd sent an unknown event type; skipped"
                );
                continue;
            }
        };
        match converted {
            Ok(event) => {
                revision = revision.max(event.mod_revision());
                out.push(event);
            }
            Err(e) => {
                shared.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "etcd watch event skipped");
            }
        }
    }
    (!out.is_empty()).then_some((out, revision))
}
