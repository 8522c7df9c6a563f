//! Hot reload: follow the policy directory, schema, configuration and plugins with
//! notify, wait for the files to settle, then reload the whole set, and tell whoever
//! listens ([`Engine::reload_events`]).
//!
//! # Deploying policy files
//!
//! **Write a file in full under a temporary name in the same directory, then rename it
//! over the old one** (`mv`, `rename(2)`): a rename is atomic, so the engine sees the old
//! file or the new one, never a mix. Editors that save by rename, `kubectl cp` to a
//! temporary name followed by `mv`, and Kubernetes ConfigMap and Secret mounts (which
//! swap a `..data` symlink) all do this. An in-place write (`>`, `cp` over the file,
//! `truncate` then write) is visible half-done.
//!
//! # Settling (a heuristic)
//!
//! Because in-place writes happen anyway, the watcher does not reload on the first
//! event. Once no event came for the debounce (`DEFAULT_DEBOUNCE`), it reloads only
//! when the files are **quiescent**: it notes every file of the set (size and
//! modification time, and a SHA-256 of its bytes), reads and compiles the set, waits
//! one more debounce, and notes them again. Only if nothing changed across that wait,
//! and the bytes re-read equal the bytes read before compiling, does the attempt count
//! (the set goes live, or its rejection is reported); else it starts over, at most
//! `DEFAULT_SETTLE_ROUNDS` (40) times, then reports [`LoadError::Unsettled`]. The digest
//! comparison catches what sizes and times miss: a same-size rewrite within one tick of
//! a coarse file-system clock.
//!
//! # Writers that pause
//!
//! The watcher also follows inotify's close-write: a file written and not yet closed is
//! open for writing, and no set is read while one is, so **a writer that pauses between
//! two writes of one file without closing it** is waited for, up to
//! [`DEFAULT_OPEN_WAIT`] from its first write; past that the burst is refused
//! ([`LoadError::StillOpen`]) and the previous set keeps serving until the close.
//!
//! What it cannot protect against: a writer that **closes** the file between two
//! writes and pauses longer than a settling round (`cp` of the first half, then an
//! append minutes later). If that first part is a valid set on its own, it goes live
//! until the second write lands and settles; the schema's `@block_policy` and the
//! policies marked `@required` are kept by any reload, but other rules are not. Deploy
//! by atomic rename; where that cannot be guaranteed, run in sealed mode
//! ([`crate::EngineBuilder::sealed`], [`crate::policy_seal`]), where a set that does not
//! match its signed seal never loads, half-written or not.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use notify::{EventKind, RecursiveMode, Watcher};

use crate::engine::Engine;
use crate::error::{LoadError, WatchError};
use crate::integrity::{Hash, sha256};
use crate::policy_seal::SealInfo;

/// How long the watcher waits after the last change before it looks at the files, and
/// how long a settling round lasts. Editors and `kubectl cp` write a file in several
/// steps; one reload should see all of them.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(50);

/// Most settling rounds before the watcher gives up on files that keep changing
/// ([`LoadError::Unsettled`]); the next change tries again.
pub const DEFAULT_SETTLE_ROUNDS: u32 = 40;

/// How long the watcher waits for a writer to close a policy file it wrote (inotify's
/// close-write) before it gives up on that burst and reports [`LoadError::StillOpen`]:
/// a file written in several writes with pauses between them is never read half-done.
pub const DEFAULT_OPEN_WAIT: Duration = Duration::from_secs(5);

/// Reload events a subscriber may have unread before it misses the newest ones.
pub const RELOAD_EVENT_BACKLOG: usize = 256;

/// How a reload attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReloadOutcome {
    /// A different set went live.
    Loaded,
    /// The set read is the live one: nothing changed.
    Unchanged,
    /// The set was refused; the previous set keeps serving.
    Rejected,
}

/// What started a reload attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReloadTrigger {
    /// The watcher saw the policy files change ([`Engine::watch`]).
    FileWatch,
    /// A host asked: [`Engine::reload`] or [`Engine::reload_when_settled`] (a signal,
    /// an administrative call).
    Call,
}

impl std::fmt::Display for ReloadTrigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReloadTrigger::FileWatch => "the policy files changed (file watch)",
            ReloadTrigger::Call => "a reload asked by the host",
        })
    }
}

/// One reload attempt, as [`Engine::reload_events`] reports it.
#[derive(Debug, Clone)]
pub struct ReloadEvent {
    /// Attempt number, from 1, per engine: a gap means events were missed.
    pub seq: u64,
    /// How it ended.
    pub outcome: ReloadOutcome,
    /// Digest of the live set when the attempt started.
    pub digest_before: String,
    /// Digest of the live set after it (the same as before unless [`ReloadOutcome::Loaded`]).
    pub digest_after: String,
    /// The seal of the live set after the attempt, in sealed mode.
    pub seal: Option<SealInfo>,
    /// Why it was refused.
    pub error: Option<Arc<LoadError>>,
    /// How long the attempt took, settling included.
    pub duration: Duration,
    /// Settling rounds it took (1 for [`Engine::reload`]).
    pub rounds: u32,
    /// When it ended, by the engine's clock, in Unix milliseconds.
    pub at_unix_ms: u64,
    /// What started it.
    pub trigger: ReloadTrigger,
    /// The policies whose mode the new set lowers (enforce to warn or audit, warn to
    /// audit), each also recorded in the event log (kind `policy-mode-lowered`) when a
    /// state store is attached. Hosts log these at warning level.
    pub lowered: Vec<crate::modes::ModeChange>,
}

/// The receivers of [`Engine::reload_events`].
#[derive(Default)]
pub(crate) struct ReloadSubscribers {
    senders: Mutex<Vec<SyncSender<ReloadEvent>>>,
    seq: std::sync::atomic::AtomicU64,
}

impl ReloadSubscribers {
    pub fn subscribe(&self) -> Receiver<ReloadEvent> {
        let (tx, rx) = mpsc::sync_channel(RELOAD_EVENT_BACKLOG);
        self.senders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(tx);
        rx
    }

    /// Numbers `event` and hands it to every live subscriber, never waiting on one.
    pub fn publish(&self, mut event: ReloadEvent) {
        event.seq = self
            .seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .saturating_add(1);
        self.senders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|tx| match tx.try_send(event.clone()) {
                Ok(()) | Err(TrySendError::Full(_)) => true,
                Err(TrySendError::Disconnected(_)) => false,
            });
    }
}

/// Waits: the watcher's only way to let time pass, so that tests drive time without
/// sleeping.
pub trait Sleeper: Send + Sync {
    /// Returns after `duration` (or whatever the implementation makes of it).
    fn sleep(&self, duration: Duration);
}

/// [`Sleeper`] on the thread's own sleep: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadSleeper;

impl Sleeper for ThreadSleeper {
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
    }
}

/// When the watcher considers the files settled (see the module docs).
#[derive(Clone)]
pub struct Settle {
    debounce: Duration,
    open_wait: Duration,
    max_rounds: u32,
    sleeper: Arc<dyn Sleeper>,
}

impl std::fmt::Debug for Settle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settle")
            .field("debounce", &self.debounce)
            .field("max_rounds", &self.max_rounds)
            .finish_non_exhaustive()
    }
}

impl Default for Settle {
    fn default() -> Self {
        Self::new(DEFAULT_DEBOUNCE)
    }
}

impl Settle {
    /// Rounds of `debounce`, at most `DEFAULT_SETTLE_ROUNDS` (40), sleeping on the thread.
    pub fn new(debounce: Duration) -> Self {
        Self {
            debounce,
            open_wait: DEFAULT_OPEN_WAIT,
            max_rounds: DEFAULT_SETTLE_ROUNDS,
            sleeper: Arc::new(ThreadSleeper),
        }
    }

    /// Lets time pass with `sleeper` instead of the thread's sleep (tests).
    pub fn with_sleeper(mut self, sleeper: Arc<dyn Sleeper>) -> Self {
        self.sleeper = sleeper;
        self
    }

    /// At most `rounds` rounds (at least 1).
    pub fn with_max_rounds(mut self, rounds: u32) -> Self {
        self.max_rounds = rounds.max(1);
        self
    }

    /// How long the watcher waits for a writer to close a file it wrote (at least
    /// one debounce); then the burst is refused ([`LoadError::StillOpen`]).
    pub fn with_open_wait(mut self, wait: Duration) -> Self {
        self.open_wait = wait.max(self.debounce);
        self
    }

    /// The length of a round.
    pub fn debounce(&self) -> Duration {
        self.debounce
    }
}

/// What one look at a file saw.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileState {
    len: u64,
    modified: Option<SystemTime>,
    sha256: Hash,
}

/// What one look at every file of the set saw (`None`: unreadable or absent).
type Observation = Vec<(PathBuf, Option<FileState>)>;

fn observe(files: &[PathBuf]) -> Observation {
    files
        .iter()
        .map(|path| {
            let state = std::fs::metadata(path).ok().and_then(|meta| {
                let bytes = crate::bundle::read_set_file(path).ok()?;
                Some(FileState {
                    len: meta.len(),
                    modified: meta.modified().ok(),
                    sha256: sha256(&bytes),
                })
            });
            (path.clone(), state)
        })
        .collect()
}

/// A file that differs between two looks.
fn changed(a: &Observation, b: &Observation) -> Option<PathBuf> {
    if a.len() != b.len() {
        let longer = if a.len() > b.len() { a } else { b };
        let shorter = if a.len() > b.len() { b } else { a };
        return longer
            .iter()
            .find(|(p, _)| !shorter.iter().any(|(q, _)| q == p))
            .map(|(p, _)| p.clone())
            .or_else(|| longer.first().map(|(p, _)| p.clone()));
    }
    a.iter()
        .zip(b)
        .find(|(x, y)| x != y)
        .map(|((p, _), _)| p.clone())
}

/// Keeps the engine's policy set in step with the files. Dropping it stops watching.
pub struct ReloadWatcher {
    watcher: Option<Arc<Mutex<notify::RecommendedWatcher>>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Watches the policy files and reloads once they settle, with `DEFAULT_DEBOUNCE`.
    pub fn watch(&self) -> Result<ReloadWatcher, WatchError> {
        self.watch_settled(Settle::default())
    }

    /// Watches the policy files and reloads once no change has come for `debounce` and
    /// the files have settled in rounds of `debounce`.
    pub fn watch_with_debounce(&self, debounce: Duration) -> Result<ReloadWatcher, WatchError> {
        self.watch_settled(Settle::new(debounce))
    }

    /// Reads the set once the files are quiescent (see the module docs), then swaps it
    /// in as [`Engine::reload`] does, reporting the attempt to
    /// [`Engine::reload_events`]. What the watcher calls after each burst of changes;
    /// a host that reloads on a signal should call it too.
    pub fn reload_when_settled(&self, settle: &Settle) -> Result<(), Arc<LoadError>> {
        self.settled_reload(settle, ReloadTrigger::Call)
    }

    fn settled_reload(
        &self,
        settle: &Settle,
        trigger: ReloadTrigger,
    ) -> Result<(), Arc<LoadError>> {
        let started = Instant::now();
        let before = self.live_digest();
        let mut last_changed = PathBuf::new();
        for round in 1..=settle.max_rounds {
            // A directory that cannot be listed is reported by reading the set.
            let files = crate::bundle::set_files(self.origin()).unwrap_or_default();
            let first = observe(&files);
            let prepared = self.prepare_reload();
            settle.sleeper.sleep(settle.debounce);
            let files = crate::bundle::set_files(self.origin()).unwrap_or_default();
            let second = observe(&files);
            match changed(&first, &second) {
                None => {
                    let result = prepared.and_then(|bundle| self.commit_reload(bundle));
                    return self.finish_reload(started, before, round, trigger, result);
                }
                Some(path) => last_changed = path,
            }
        }
        let debounce_ms = u64::try_from(settle.debounce.as_millis()).unwrap_or(u64::MAX);
        self.finish_reload(
            started,
            before,
            settle.max_rounds,
            trigger,
            Err(LoadError::Unsettled {
                rounds: settle.max_rounds,
                debounce_ms,
                path: last_changed,
            }),
        )
    }

    /// Watches the policy files and, after each burst of changes, reloads with
    /// [`Engine::reload_when_settled`].
    pub fn watch_settled(&self, settle: Settle) -> Result<ReloadWatcher, WatchError> {
        let paths = self.watched_paths();
        if paths.is_empty() {
            return Err(WatchError::NothingToWatch);
        }
        // A watched path that is a symlink (`--policies /srv/policies`, repointed by
        // `ln -s new tmp && mv -T tmp /srv/policies`) is followed by the watch, which
        // then sees the old target only: its parent is watched too, for the link's own
        // replacement, and after each reload a path whose target moved is watched
        // again, so edits under the new target are seen.
        let links: Vec<PathBuf> = paths
            .iter()
            .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()))
            .cloned()
            .collect();
        let (tx, rx) = mpsc::channel::<()>();
        // Files written and not closed yet, with when the first write was seen.
        let open_writes: Arc<Mutex<OpenWrites>> = Arc::default();
        let noted = Arc::clone(&open_writes);
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                if let Ok(e) = &event {
                    note_writes(&noted, e);
                }
                let relevant = match event {
                    Ok(e) => !matches!(
                        e.kind,
                        EventKind::Access(notify::event::AccessKind::Open(_))
                            | EventKind::Access(notify::event::AccessKind::Read)
                            | EventKind::Access(notify::event::AccessKind::Close(
                                notify::event::AccessMode::Read
                            ))
                    ),
                    // A watcher error may mean missed events: reload to be safe.
                    Err(_) => true,
                };
                if relevant {
                    let _ = tx.send(());
                }
            })
            .map_err(|source| WatchError::Notify {
                path: paths.first().cloned().unwrap_or_default(),
                source,
            })?;
        let dirs: Vec<_> = paths.iter().filter(|p| p.is_dir()).cloned().collect();
        for path in &paths {
            if !path.is_dir() && dirs.iter().any(|d| path.starts_with(d)) {
                continue;
            }
            let (target, mode) = watch_target(path);
            watcher
                .watch(target, mode)
                .map_err(|source| WatchError::Notify {
                    path: path.clone(),
                    source,
                })?;
        }
        for link in &links {
            let parent = link.parent().unwrap_or(Path::new("."));
            if paths.iter().any(|p| p.as_path() == parent) {
                continue;
            }
            watcher
                .watch(parent, RecursiveMode::NonRecursive)
                .map_err(|source| WatchError::Notify {
                    path: link.clone(),
                    source,
                })?;
        }
        let mut targets: Vec<Option<PathBuf>> = links
            .iter()
            .map(|l| std::fs::canonicalize(l).ok())
            .collect();
        let watcher = Arc::new(Mutex::new(watcher));
        // Weak: dropping the ReloadWatcher drops the watcher, whose sender ends the
        // thread's loop.
        let rewatch = Arc::downgrade(&watcher);
        let engine = self.clone();
        let debounce = settle.debounce;
        let open_wait = settle.open_wait;
        let thread = std::thread::Builder::new()
            .name("probity-reload".into())
            .spawn(move || {
                while rx.recv().is_ok() {
                    loop {
                        match rx.recv_timeout(debounce) {
                            Ok(()) => continue,
                            Err(mpsc::RecvTimeoutError::Timeout) => break,
                            Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        }
                    }
                    // A writer still holding a file open may be half-way: wait for its
                    // close (which sends an event of its own), bounded.
                    if let Err(e) = wait_for_writers(&open_writes, &rx, open_wait) {
                        match e {
                            Waited::Disconnected => return,
                            Waited::TooLong(path, waited) => {
                                engine.report_still_open(path, waited);
                                continue;
                            }
                        }
                    }
                    for (link, target) in links.iter().zip(targets.iter_mut()) {
                        let now = std::fs::canonicalize(link).ok();
                        if now != *target
                            && let Some(w) = rewatch.upgrade()
                        {
                            let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
                            let (path, mode) = watch_target(link);
                            let _ = w.unwatch(path);
                            // A failure leaves the link's parent watched: the next
                            // swap is seen and this is tried again.
                            if w.watch(path, mode).is_ok() {
                                *target = now;
                            }
                        }
                    }
                    // The outcome is kept in the engine (last_error, status) and sent to
                    // the reload event subscribers.
                    let _ = engine.settled_reload(&settle, ReloadTrigger::FileWatch);
                }
            })
            .map_err(|source| WatchError::Notify {
                path: paths.first().cloned().unwrap_or_default(),
                source: notify::Error::io(source),
            })?;
        Ok(ReloadWatcher {
            watcher: Some(watcher),
            thread: Some(thread),
        })
    }
}

/// What to hand notify for `path`: a directory recursively; a file through its
/// directory, so that an editor's write-to-temp-then-rename is seen.
fn watch_target(path: &Path) -> (&Path, RecursiveMode) {
    if path.is_dir() {
        (path, RecursiveMode::Recursive)
    } else {
        (
            path.parent().unwrap_or(Path::new(".")),
            RecursiveMode::NonRecursive,
        )
    }
}

type OpenWrites = std::collections::HashMap<PathBuf, Instant>;

/// Keeps `open` in step with `event`: a write marks a file open for writing, its
/// close-write (or its removal or rename) clears it.
fn note_writes(open: &Mutex<OpenWrites>, event: &notify::Event) {
    use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind};
    let mut open = open.lock().unwrap_or_else(PoisonError::into_inner);
    match event.kind {
        EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any)
        | EventKind::Create(CreateKind::File) => {
            let now = Instant::now();
            for p in &event.paths {
                open.entry(p.clone()).or_insert(now);
            }
        }
        EventKind::Access(AccessKind::Close(AccessMode::Write))
        | EventKind::Remove(_)
        | EventKind::Modify(ModifyKind::Name(_)) => {
            for p in &event.paths {
                open.remove(p);
            }
        }
        _ => {}
    }
}

/// Why the watcher did not go on to read the set.
enum Waited {
    /// The watcher is being dropped.
    Disconnected,
    /// A file stayed open for writing past the bound.
    TooLong(PathBuf, Duration),
}

/// Waits until no watched file is open for writing, at most `bound` from its first
/// write; events meanwhile (the close among them) are taken from `rx`.
fn wait_for_writers(
    open: &Mutex<OpenWrites>,
    rx: &Receiver<()>,
    bound: Duration,
) -> Result<(), Waited> {
    loop {
        let oldest = open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .min_by_key(|(_, at)| **at)
            .map(|(p, at)| (p.clone(), *at));
        let Some((path, since)) = oldest else {
            return Ok(());
        };
        let waited = since.elapsed();
        if waited >= bound {
            return Err(Waited::TooLong(path, waited));
        }
        match rx.recv_timeout(bound.saturating_sub(waited)) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Waited::Disconnected),
        }
    }
}

impl Engine {
    /// Reports a burst not read because `path` stayed open for writing.
    fn report_still_open(&self, path: PathBuf, waited: Duration) {
        let before = self.live_digest();
        let waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        let _ = self.finish_reload(
            Instant::now(),
            before,
            0,
            ReloadTrigger::FileWatch,
            Err(LoadError::StillOpen { path, waited_ms }),
        );
    }
}

impl Drop for ReloadWatcher {
    fn drop(&mut self) {
        // Dropping the watcher drops the sender, which ends the thread's loop.
        self.watcher.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
