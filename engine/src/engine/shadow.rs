//! A shadow set: a candidate policy set decided beside the live one, on the live store
//! and blocklist (with its own configuration's settings), never answering anyone. The
//! server decides sampled requests with it off the hot path and counts where the two
//! disagree (`[policies] shadow`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use super::Engine;
use super::snapshot::{Snapshot, owned_cache};
use crate::bundle::Bundle;
use crate::decision::Decision;
use crate::diagnostic::SourceDiagnostic;
use crate::error::LoadError;
use crate::facts::EntityOwner;
use crate::request::Request;
use crate::source::Origin;

/// A candidate set loaded for shadow decisions ([`Engine::decide_shadow`]).
pub struct ShadowSet {
    bundle: Arc<Bundle>,
    dir: PathBuf,
    /// The shadow snapshot made from the live one it names, reused until the live
    /// snapshot changes.
    made: Mutex<Option<(Arc<Snapshot>, Arc<Snapshot>)>>,
}

impl std::fmt::Debug for ShadowSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShadowSet")
            .field("dir", &self.dir)
            .field("digest", &self.bundle.digest)
            .finish()
    }
}

impl ShadowSet {
    /// The digest of the shadow set.
    pub fn digest(&self) -> &str {
        &self.bundle.digest
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Engine {
    /// Loads `dir` as a shadow set. It decides on the live store, so its schema must
    /// be the live set's: another schema is refused, as is any set that does not load.
    pub fn load_shadow(&self, dir: &Path) -> Result<ShadowSet, LoadError> {
        let sources = Origin::default_dir(dir).read()?;
        let live = self.shared.origin.read()?;
        if sources.schema.text != live.schema.text {
            return Err(LoadError::Invalid {
                problems: vec![SourceDiagnostic::new(
                    &sources.schema.name,
                    &sources.schema.text,
                    0,
                    0,
                    "a shadow set decides on the live store, so its schema must be the live set's; this one differs",
                )],
            });
        }
        Ok(ShadowSet {
            bundle: Arc::new(Bundle::compile(&sources)?),
            dir: dir.to_owned(),
            made: Mutex::new(None),
        })
    }

    /// Decides `request` under `shadow`, on the live store and blocklist, as a dry run:
    /// nothing is recorded and nothing is carried out.
    pub fn decide_shadow(&self, shadow: &ShadowSet, request: &Request) -> Decision {
        let live = self.shared.current.load_full();
        let snapshot = {
            let mut made = shadow.made.lock().unwrap_or_else(PoisonError::into_inner);
            match made.as_ref() {
                Some((from, s)) if Arc::ptr_eq(from, &live) => Arc::clone(s),
                _ => {
                    let s = Arc::new(shadow_snapshot(&shadow.bundle, &live));
                    *made = Some((Arc::clone(&live), Arc::clone(&s)));
                    s
                }
            }
        };
        self.decide_in(&snapshot, request, None)
    }
}

/// The live snapshot with `bundle` in place of the live set, and its configuration's
/// entities in place of the live ones.
fn shadow_snapshot(bundle: &Arc<Bundle>, live: &Snapshot) -> Snapshot {
    let mut store = live.store.clone();
    let stale: Vec<_> = store
        .iter()
        .filter(|(u, _)| {
            live.bundle.origins.owner_of(&u.entity_type().to_string()) == Some(EntityOwner::Config)
        })
        .map(|(u, _)| u)
        .collect();
    for u in &stale {
        store.remove(u);
    }
    for (uid, stored) in &bundle.settings {
        store.insert(uid.clone(), Arc::clone(stored));
    }
    let owned = Arc::new(owned_cache(bundle, &store));
    let mut snapshot = Snapshot::new(Arc::clone(bundle), store, owned, Arc::clone(&live.blocked));
    snapshot.cluster = Arc::clone(&live.cluster);
    snapshot
}
