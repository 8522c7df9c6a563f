//! Reloading the policy set (read, check, compile, swap) and reporting its status.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use cedar_policy_core::ast::EntityUID;

use super::Engine;
use super::snapshot::{Working, owned_cache};
use crate::bundle::Bundle;
use crate::error::{EntityError, LoadError};
use crate::facts::EntityOwner;
use crate::modes::{ModeChange, PolicyModes};
use crate::plugin::PluginInfo;
use crate::policy_seal::{self, LoadedSeal, SealInfo, Sealing};
use crate::source::Origin;
use crate::state::SharedState;
use crate::watch::{ReloadEvent, ReloadOutcome, ReloadTrigger};

/// The state of the loaded policy set, for status endpoints and `probity check`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyStatus {
    /// SHA-256 over the schema, configuration and policy files of the live set.
    pub digest: String,
    /// The policy files of the live set.
    pub files: Vec<String>,
    /// Number of policies in the live set.
    pub policies: usize,
    /// When the live set was loaded, in Unix seconds.
    pub loaded_at: u64,
    /// Successful reloads since start.
    pub reloads: u64,
    /// Rejected reloads since start.
    pub reload_errors: u64,
    /// The last rejected reload's error, until a good set loads.
    pub last_error: Option<String>,
    /// Number of entities in the store (including the ones the engine owns).
    pub entities: usize,
    /// The plugins of the live set (from `plugins.toml`).
    pub plugins: Vec<PluginInfo>,
    /// The seal the live set was checked against, in sealed mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seal: Option<SealInfo>,
    /// The policies not plainly enforcing: a `warn` or `audit` mode, or scoped modes.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub modes: std::collections::BTreeMap<String, PolicyModes>,
}

impl Engine {
    /// Reads the policy directory again and, if the whole set is valid (and, in sealed
    /// mode, matches its seal), swaps it in. On error the previous set keeps serving and
    /// the error stays in [`Engine::last_error`] until a good set loads. Either way the
    /// attempt is reported to [`Engine::reload_events`].
    ///
    /// The files are read as they are: a reload triggered while a file is being written
    /// may read half of it. The watcher ([`Engine::watch`]) reloads only once the files
    /// have settled ([`Engine::reload_when_settled`]); deploy files by atomic rename
    /// (see [`crate::ReloadWatcher`]).
    pub fn reload(&self) -> Result<(), Arc<LoadError>> {
        let started = std::time::Instant::now();
        let before = self.live_digest();
        let result = self
            .prepare_reload()
            .and_then(|bundle| self.commit_reload(bundle));
        self.finish_reload(started, before, 1, ReloadTrigger::Call, result)
    }

    /// Subscribes to reloads: every reload attempt from now on (by the watcher or
    /// [`Engine::reload`]), loaded, unchanged or rejected, with the digests before and
    /// after, the error and the duration. Each call returns a new receiver. A receiver
    /// that falls more than `RELOAD_EVENT_BACKLOG` (256) events behind misses the
    /// newest ones (it sees a gap in [`ReloadEvent::seq`]); a dropped receiver is
    /// forgotten. Hosts log these: the CLI prints nothing for them.
    pub fn reload_events(&self) -> std::sync::mpsc::Receiver<ReloadEvent> {
        self.shared.reload_events.subscribe()
    }

    /// The digest of the live set.
    pub(crate) fn live_digest(&self) -> String {
        self.shared.current.load().bundle.digest.clone()
    }

    /// The origin the engine reads.
    pub(crate) fn origin(&self) -> &Origin {
        &self.shared.origin
    }

    /// Reads, checks and compiles the set: a bundle ready to be swapped in.
    pub(crate) fn prepare_reload(&self) -> Result<Arc<Bundle>, LoadError> {
        let live = self.shared.current.load_full();
        let registry = self.shared.state.get().map(|s| s.as_ref());
        load_bundle(
            &self.shared.origin,
            self.shared.sealing.as_ref(),
            live.bundle.seal.as_deref(),
            registry,
        )
        .map(Arc::new)
    }

    /// Swaps `bundle` in: `None` when it is the live set, else the modes it lowers
    /// (see [`ReloadEvent::lowered`]). In sealed mode the seal
    /// is judged again against the live one (another reload may have won the race) and
    /// made durable in the attached state store before the set goes live.
    pub(crate) fn commit_reload(
        &self,
        bundle: Arc<Bundle>,
    ) -> Result<Option<Vec<ModeChange>>, LoadError> {
        let refusal: Arc<Mutex<Option<LoadError>>> = Arc::new(Mutex::new(None));
        let stash = Arc::clone(&refusal);
        let lowered: Arc<Mutex<Vec<ModeChange>>> = Arc::new(Mutex::new(Vec::new()));
        let lowered_stash = Arc::clone(&lowered);
        let state = self.shared.state.get().cloned();
        let dir = self
            .shared
            .origin
            .dir()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let result = self.write(Box::new(move |w: &mut Working| {
            let seal_digest = |b: &Bundle| b.seal.as_ref().map(|s| s.digest);
            if bundle.digest == w.bundle.digest && seal_digest(&bundle) == seal_digest(&w.bundle) {
                return Ok(0);
            }
            // What the live set marks required stays, as a forbid where it was one.
            let mut dropped: Vec<String> = w
                .bundle
                .meta
                .values()
                .filter(|m| m.required)
                .filter(|m| {
                    bundle
                        .meta
                        .get(&cedar_policy::PolicyId::new(&m.id))
                        .is_none_or(|n| m.forbid && !n.forbid)
                })
                .map(|m| m.id.clone())
                .collect();
            if !dropped.is_empty() {
                dropped.sort();
                *stash.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(LoadError::RequiredDropped { ids: dropped });
                return Err(EntityError::Invalid {
                    detail: "required policies dropped".into(),
                });
            }
            if let Some(seal) = &bundle.seal {
                let problem = match &w.bundle.seal {
                    Some(live) => policy_seal::compare_live(seal, live),
                    None => None,
                }
                .or_else(|| {
                    let state = state.as_ref()?;
                    state
                        .accept(
                            &seal.seal.registry_id(),
                            seal.seal.version(),
                            &seal.digest,
                            &seal.encoded,
                        )
                        .err()
                        .map(|e| policy_seal::registry_problem(&e))
                });
                if let Some(message) = problem {
                    *stash.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(policy_seal::late_problem(&dir, seal, message));
                    return Err(EntityError::Invalid {
                        detail: "sealed set refused".into(),
                    });
                }
            }
            *lowered_stash.lock().unwrap_or_else(PoisonError::into_inner) =
                lowered_modes(&w.bundle, &bundle);
            // The configuration's entities go with the set that made them.
            let stale: Vec<EntityUID> = w
                .store
                .iter()
                .filter(|(u, _)| {
                    w.bundle.origins.owner_of(&u.entity_type().to_string())
                        == Some(EntityOwner::Config)
                })
                .map(|(u, _)| u.clone())
                .collect();
            for u in &stale {
                w.store.remove(u);
            }
            for (uid, stored) in &bundle.settings {
                w.store.insert(uid.clone(), Arc::clone(stored));
            }
            w.owned = Arc::new(owned_cache(&bundle, &w.store));
            w.bundle = bundle;
            w.changed = true;
            Ok(1)
        }));
        match result {
            Ok(0) => Ok(None),
            Ok(_) => Ok(Some(std::mem::take(
                &mut *lowered.lock().unwrap_or_else(PoisonError::into_inner),
            ))),
            Err(e) => Err(refusal
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .unwrap_or_else(|| LoadError::Invalid {
                    problems: vec![crate::diagnostic::SourceDiagnostic::new(
                        "probity.toml",
                        &Arc::from(""),
                        0,
                        0,
                        format!("the new set could not be swapped in: {e}"),
                    )],
                })),
        }
    }

    /// Counts the attempt, keeps or clears the last error, and tells subscribers.
    pub(crate) fn finish_reload(
        &self,
        started: std::time::Instant,
        before: String,
        rounds: u32,
        trigger: ReloadTrigger,
        result: Result<Option<Vec<ModeChange>>, LoadError>,
    ) -> Result<(), Arc<LoadError>> {
        let mut lowered = Vec::new();
        let (outcome, error, returned) = match result {
            Ok(changed) => {
                self.shared.last_error.store(None);
                self.shared.reloads.fetch_add(1, Ordering::Relaxed);
                let outcome = match changed {
                    Some(changes) => {
                        lowered = changes;
                        ReloadOutcome::Loaded
                    }
                    None => ReloadOutcome::Unchanged,
                };
                (outcome, None, Ok(()))
            }
            Err(e) => {
                let e = Arc::new(e);
                self.shared.last_error.store(Some(Arc::clone(&e)));
                self.shared.reload_errors.fetch_add(1, Ordering::Relaxed);
                (ReloadOutcome::Rejected, Some(Arc::clone(&e)), Err(e))
            }
        };
        // A lowered mode is never silent: it goes to the event log (and, through the
        // reload event, to the host's log at warning level).
        if let Some(log) = self.log() {
            for change in &lowered {
                let detail = format!("{change}; trigger: {trigger}");
                // The reload already happened; a failed record is left to the host's
                // log, which the event below reaches either way.
                let _ = log.record_event(&change.policy, None, LOWERED_EVENT, &detail);
            }
        }
        let live = self.shared.current.load();
        self.shared.reload_events.publish(ReloadEvent {
            seq: 0,
            outcome,
            digest_before: before,
            digest_after: live.bundle.digest.clone(),
            seal: live.bundle.seal.as_ref().map(|s| s.info.clone()),
            error,
            duration: started.elapsed(),
            rounds,
            at_unix_ms: self.shared.clock.now_unix_ms(),
            trigger,
            lowered,
        });
        returned
    }

    /// The error of the last rejected reload, until a good set loads.
    pub fn last_error(&self) -> Option<Arc<LoadError>> {
        self.shared.last_error.load_full()
    }

    /// Digest, files, counts and the last reload error of the live set.
    pub fn status(&self) -> PolicyStatus {
        let current = self.shared.current.load();
        let b = &current.bundle;
        PolicyStatus {
            digest: b.digest.clone(),
            files: b.files.clone(),
            policies: b.policy_count(),
            loaded_at: b
                .loaded_at
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            reloads: self.shared.reloads.load(Ordering::Relaxed),
            reload_errors: self.shared.reload_errors.load(Ordering::Relaxed),
            last_error: self.last_error().map(|e| e.detail()),
            entities: current.store.len(),
            plugins: b.plugins.infos(),
            seal: b.seal.as_ref().map(|s| s.info.clone()),
            modes: b
                .modes
                .iter()
                .filter(|(_, m)| m.mode != crate::modes::Mode::Enforce || !m.scoped.is_empty())
                .map(|(id, m)| (id.clone(), m.clone()))
                .collect(),
        }
    }

    /// Policy ids of the live set, with whether each is a forbid.
    pub fn policy_ids(&self) -> Vec<(String, bool)> {
        let current = self.shared.current.load();
        let mut ids: Vec<_> = current
            .bundle
            .meta
            .values()
            .map(|m| (m.id.clone(), m.forbid))
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Each policy of the live set with its modes: its own (`enforce` unless `@mode`
    /// or probity.toml's `[modes]` say otherwise) and its scoped ones.
    pub fn policy_modes(&self) -> std::collections::BTreeMap<String, PolicyModes> {
        self.shared.current.load().bundle.modes.clone()
    }
}

/// The event log's kind for a reload that lowered a policy's mode.
pub(crate) const LOWERED_EVENT: &str = "policy-mode-lowered";

/// The modes `after` lowers against `before`, per policy present in both.
fn lowered_modes(before: &Bundle, after: &Bundle) -> Vec<ModeChange> {
    let mut out = Vec::new();
    for (id, now) in &after.modes {
        let Some(was) = before.modes.get(id) else {
            continue;
        };
        for (scope, from, to) in now.lowered_from(was) {
            // The file that declares the new mode: a scope's is probity.toml.
            let (declared_in, path) = after
                .meta
                .values()
                .find(|m| &m.id == id && m.mode == to)
                .map(|m| (m.declared_in.clone(), m.declared_path.clone()))
                .unwrap_or_else(|| (now.declared_in.clone(), None));
            out.push(ModeChange {
                policy: id.clone(),
                scope,
                from,
                to,
                owner: path.as_deref().and_then(crate::modes::file_owner),
                declared_in,
            });
        }
    }
    out
}

/// Reads the set from `origin`, checks it against its seal in sealed mode (before
/// compiling: an unsealed plugin is never compiled), compiles it, and checks that the
/// components compiled are the ones the seal covers.
pub(super) fn load_bundle(
    origin: &Origin,
    sealing: Option<&Sealing>,
    live: Option<&LoadedSeal>,
    registry: Option<&dyn SharedState>,
) -> Result<Bundle, LoadError> {
    let sources = origin.read()?;
    let checked = match sealing {
        None => None,
        Some(sealing) => {
            let Some(dir) = origin.dir() else {
                return Err(LoadError::Sealed {
                    seal: PathBuf::from(policy_seal::SEAL_FILE),
                    problems: vec![crate::diagnostic::SourceDiagnostic::new(
                        policy_seal::SEAL_FILE,
                        &Arc::from(""),
                        0,
                        0,
                        "sealed mode needs a policy directory: the embedded defaults carry no seal",
                    )],
                });
            };
            let texts: Vec<(PathBuf, crate::integrity::Hash)> = std::iter::once(&sources.schema)
                .chain(std::iter::once(&sources.config))
                .chain(sources.policies.iter())
                .chain(sources.plugins.iter().map(|m| &m.file))
                .filter_map(|f| {
                    Some((f.path.clone()?, crate::integrity::sha256(f.text.as_bytes())))
                })
                .collect();
            let mut components = Vec::new();
            if let Some(manifest) = &sources.plugins {
                for path in crate::plugin::component_paths(manifest) {
                    let bytes = crate::bundle::read_set_file(&path)?;
                    components.push((path, crate::integrity::sha256(&bytes)));
                }
            }
            Some(policy_seal::check(
                sealing,
                dir,
                &texts,
                &components,
                live,
                registry,
            )?)
        }
    };
    let mut bundle = Bundle::compile(&sources)?;
    if let Some(checked) = checked {
        for (path, hash) in bundle.plugins.components() {
            if !checked.components.contains(&(path.clone(), hash)) {
                let dir = origin.dir().unwrap_or(Path::new("."));
                return Err(policy_seal::late_problem(
                    dir,
                    &checked.seal,
                    format!(
                        "{} changed while it was loaded: it no longer matches the seal",
                        path.display()
                    ),
                ));
            }
        }
        bundle.seal = Some(checked.seal);
    }
    Ok(bundle)
}
