//! Hot reload: follow the policy directory, schema and configuration with notify,
//! wait for writes to settle, then [`Engine::reload`] the whole set.

use std::path::Path;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};

use crate::engine::Engine;
use crate::error::WatchError;

/// How long the watcher waits after the last change before reloading. Editors and
/// `kubectl cp` write a file in several steps; one reload should see all of them.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(50);

/// Keeps the engine's policy set in step with the files. Dropping it stops watching.
pub struct ReloadWatcher {
    watcher: Option<notify::RecommendedWatcher>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Watches the policy files and reloads on change, with [`DEFAULT_DEBOUNCE`].
    pub fn watch(&self) -> Result<ReloadWatcher, WatchError> {
        self.watch_with_debounce(DEFAULT_DEBOUNCE)
    }

    /// Watches the policy files and reloads once no change has come for `debounce`.
    pub fn watch_with_debounce(&self, debounce: Duration) -> Result<ReloadWatcher, WatchError> {
        let paths = self.watched_paths();
        if paths.is_empty() {
            return Err(WatchError::NothingToWatch);
        }
        let (tx, rx) = mpsc::channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let relevant = match event {
                    Ok(e) => !matches!(
                        e.kind,
                        EventKind::Access(notify::event::AccessKind::Open(_))
                            | EventKind::Access(notify::event::AccessKind::Read)
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
            // Files are watched through their directory so that an editor's
            // write-to-temp-then-rename is seen.
            let (target, mode) = if path.is_dir() {
                (path.as_path(), RecursiveMode::Recursive)
            } else {
                (
                    path.parent().unwrap_or(Path::new(".")),
                    RecursiveMode::NonRecursive,
                )
            };
            watcher
                .watch(target, mode)
                .map_err(|source| WatchError::Notify {
                    path: path.clone(),
                    source,
                })?;
        }
        let engine = self.clone();
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
                    // The error is kept in the engine (last_error, status) for callers.
                    let _ = engine.reload();
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

impl Drop for ReloadWatcher {
    fn drop(&mut self) {
        // Dropping the watcher drops the sender, which ends the thread's loop.
        self.watcher.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
