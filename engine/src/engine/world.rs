//! A scenario's world: a request decided against entities of its own, apart from the
//! live store.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};
use cedar_policy::Authorizer;
use serde_json::Value;

use super::entities::{apply_upsert, convert_all, rejected};
use super::snapshot::{Snapshot, Working, Writes, owned_cache};
use super::{Engine, Shared};
use crate::block::BlockRecord;
use crate::decision::Decision;
use crate::error::EntityError;
use crate::facts::EntityOwner;
use crate::request::Request;
use crate::store::{self, Store};
use crate::watch::ReloadSubscribers;

impl Engine {
    /// Decides `request` in a world of its own: `entities` stored (not request-scoped),
    /// `blocked` the blocklist, the engine's clock replaced by `now`. The engine's own
    /// store and blocklist are neither read nor changed. For policy test cases
    /// ([`crate::scenario`]); not a stable API.
    pub(crate) fn decide_in_world(
        &self,
        request: &Request,
        entities: &[Value],
        blocked: &[String],
        now: Option<i64>,
    ) -> Result<Decision, EntityError> {
        let current = self.shared.current.load_full();
        let bundle = Arc::clone(&current.bundle);
        let mut store = Store::default();
        for (uid, stored) in &bundle.settings {
            store.insert(uid.clone(), Arc::clone(stored));
        }
        for (uid, stored) in current.store.iter() {
            if bundle.origins.owner_of(&uid.entity_type().to_string()) == Some(EntityOwner::Api) {
                store.insert(uid.clone(), Arc::clone(stored));
            }
        }
        let mut map = BTreeMap::new();
        for b in blocked {
            map.insert(b.clone(), BlockRecord::new("scenario", 0));
        }
        let mut w = Working {
            owned: Arc::new(owned_cache(&bundle, &store)),
            bundle: Arc::clone(&bundle),
            store,
            blocked: Arc::new(map),
            cluster: Arc::default(),
            changed: false,
        };
        // The world's API callers and groups stand for the server's configuration, and
        // its keys for the keyring.
        let (api, facts): (Vec<Value>, Vec<Value>) = entities.iter().cloned().partition(|e| {
            matches!(
                store::parse_uid(e.get("uid").unwrap_or(&Value::Null))
                    .ok()
                    .and_then(|u| bundle.origins.owner_of(&u.entity_type().to_string())),
                Some(EntityOwner::Api | EntityOwner::Keyring)
            )
        });
        let converter = bundle.converter();
        for (i, item) in api.iter().enumerate() {
            let c = converter
                .entity(item)
                .map_err(|(uid, e)| rejected(i, uid, e))?;
            w.store.insert(c.uid, Arc::new(c.stored));
        }
        w.owned = Arc::new(owned_cache(&bundle, &w.store));
        let converted = convert_all(&bundle, &facts)?;
        apply_upsert(&mut w, converted)?;
        let snapshot = Snapshot::new(w.bundle, w.store, w.owned, w.blocked);
        let world = match now {
            None => self.clone(),
            Some(t) => Engine {
                shared: Arc::new(Shared {
                    origin: self.shared.origin.clone(),
                    current: ArcSwap::from_pointee(Snapshot::new(
                        Arc::clone(&snapshot.bundle),
                        snapshot.store.clone(),
                        Arc::clone(&snapshot.owned),
                        Arc::clone(&snapshot.blocked),
                    )),
                    writes: Writes::default(),
                    last_error: ArcSwapOption::empty(),
                    reloads: AtomicU64::new(0),
                    reload_errors: AtomicU64::new(0),
                    authorizer: Authorizer::new(),
                    clock: Arc::new(crate::clock::ManualClock::at(t)),
                    state: std::sync::OnceLock::new(),
                    log: std::sync::OnceLock::new(),
                    decision_log: std::sync::OnceLock::new(),
                    record_options: crate::decision_log::RecordOptions::default(),
                    sealing: None,
                    reload_events: ReloadSubscribers::default(),
                    by_reference: Mutex::new(None),
                    // A world of one decision: nothing to reuse.
                    decisions: crate::DecisionCache::with_budget(0),
                }),
            },
        };
        Ok(world.decide_in(&snapshot, request, None))
    }
}
