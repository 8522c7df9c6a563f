//! Keys and encryption at rest, wired to the engine.
//!
//! Why this module exists: the keyring ([`probity_keys`], re-exported here) holds, wraps,
//! rotates and erases data keys, but *whether* a key may still encrypt is a policy
//! question (`security.key-too-old` and friends in `policies/security/keys.cedar`), and
//! the policies must judge the key's real metadata and the engine's clock, never facts a
//! caller made up. So:
//!
//! * the schema marks `Key` `@owned("keyring")`: no request and no `POST /v1/entities`
//!   can supply or change one; [`PolicyKeys::publish`] is the only way in, and it writes what
//!   the keyring's metadata says (the primary version's creation time and state);
//! * the keyring's metadata goes through the engine's [`SharedState`]
//!   ([`StateKeyStore`]), so redb holds it on one node and etcd across a cluster;
//! * the keyring reads the engine's clock ([`Engine::clock`], in whole seconds), so ages in `probity keys
//!   status` and in decisions agree, and a test can move time by 91 days;
//! * [`PolicyKeys::authorize_encrypt`] asks the `encrypt` decision and carries out its `rotate_key`
//!   obligation: a key past its maximum age is rotated (a new primary version; older
//!   versions keep decrypting), the rotation recorded in the event log, and the request
//!   decided again on the new metadata. The CLI's `probity encrypt` and the server's
//!   `POST /v1/encrypt` both go through it.
//!
//! ```
//! use std::sync::Arc;
//! use probity::keys::{KeyId, KeyScope, Keyring, KeyringOptions, PolicyKeys, SoftwareKek, StateKeyStore};
//! use probity::state::StateStore;
//! use probity::{Engine, EntityUid, ManualClock};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let clock = Arc::new(ManualClock::at(1_767_139_200));
//! let engine = Engine::defaults().clock(clock.clone()).build()?;
//! let keyring = Keyring::new(
//!     Arc::new(StateKeyStore::new(Arc::new(StateStore::open(&dir.path().join("state"))?))),
//!     Arc::new(SoftwareKek::open(&dir.path().join("kek"))?), // not an HSM
//!     engine.clock().clone(),
//!     KeyringOptions::default(),
//! );
//! let key = KeyId::new("dataset/imagenet")?;
//! keyring.create(&key, KeyScope::Dataset, "ops@example.org")?;
//!
//! // 91 days later the policy refuses the key and asks for a rotation, which is carried out.
//! clock.advance(91 * 86_400);
//! let who = EntityUid::new("User", "alice")?;
//! let grant = PolicyKeys::new(&engine, &keyring).authorize_encrypt(&who, &key, "alice")?;
//! assert!(grant.decision.is_allowed());
//! assert_eq!(grant.rotation.map(|r| r.primary), Some(2));
//! # Ok(()) }
//! ```

use std::sync::Arc;

use serde_json::{Value, json};
use thiserror::Error;

use crate::decision::Decision;
use crate::engine::Engine;
use crate::error::EntityError;
use crate::facts::EntityOwner;
use crate::request::{EntityUid, Request};
use crate::state::{SharedState, StateError};

use probity_keys::{
    ErasureRecord, KekError, KeyMetaStore, KeyRecord, KeyringStatus, MetaStoreError, Pkcs11Kek,
    Rotation, Timestamp, VersionState, Versioned,
};

pub use probity_keys::stream::encrypt_to_vec;
pub use probity_keys::{
    DecryptOptions, DecryptingReader, EncryptOptions, KekProvider, KeyError, KeyId, KeyScope,
    Keyring, KeyringOptions, Pin, SOFTWARE_KEK_NOTICE, SoftwareKek, decrypt_file, encrypt_file,
    rewrap_file,
};

/// The obligation a policy carries to ask for a key's rotation.
pub(crate) const ROTATE_OBLIGATION: &str = "rotate_key";

/// The entity type the keyring's keys are published as.
pub(crate) const KEY_ENTITY_TYPE: &str = "Key";

/// Why wiring the keyring to the engine failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KeysError {
    /// The keyring failed.
    #[error("keyring")]
    Key(#[from] KeyError),
    /// The engine refused the keyring's facts (a schema without an `@owned("keyring")`
    /// `Key` type, or one whose attributes differ).
    #[error("the engine refused the keyring's key facts")]
    Publish(#[source] EntityError),
    /// The HSM holding the KEKs could not be reached.
    #[error("cannot open the HSM that holds the key-encryption keys")]
    Hsm(#[source] crate::integrity::AnchorError),
    /// The key metadata could not be read.
    #[error("cannot read the key metadata")]
    Store(#[from] MetaStoreError),
    /// The KEK provider could not be opened (token missing, wrong or locked PIN).
    #[error("cannot open the key-encryption keys")]
    Kek(#[source] KekError),
    /// The request could not be built (a key id that is not a valid entity id).
    #[error("cannot ask the encrypt decision for key {key}: {problem}")]
    Request {
        /// The key.
        key: String,
        /// What was wrong.
        problem: String,
    },
}

/// The keyring's metadata in the engine's state backend: redb on one node, etcd across a
/// cluster. Records are the keyring's JSON; revisions are the backend's.
#[derive(Debug, Clone)]
pub struct StateKeyStore {
    state: Arc<dyn SharedState>,
}

impl StateKeyStore {
    /// Key metadata in `state`.
    pub fn new(state: Arc<dyn SharedState>) -> Self {
        Self { state }
    }
}

fn backend(e: StateError) -> MetaStoreError {
    MetaStoreError::Backend(Box::new(e))
}

impl KeyMetaStore for StateKeyStore {
    fn load(&self, key: &KeyId) -> Result<Option<Versioned<KeyRecord>>, MetaStoreError> {
        let Some((bytes, revision)) = self.state.key_record(key.as_str()).map_err(backend)? else {
            return Ok(None);
        };
        let value = serde_json::from_slice(&bytes).map_err(|e| MetaStoreError::Corrupt {
            key: key.clone(),
            source: Box::new(e),
        })?;
        Ok(Some(Versioned { value, revision }))
    }

    fn store(&self, record: &KeyRecord, expected: Option<u64>) -> Result<u64, MetaStoreError> {
        let bytes = serde_json::to_vec(record).map_err(|e| MetaStoreError::Backend(Box::new(e)))?;
        match self
            .state
            .put_key_record(record.id.as_str(), &bytes, expected)
        {
            Ok(revision) => Ok(revision),
            Err(StateError::Conflict {
                expected, found, ..
            }) => Err(MetaStoreError::Conflict {
                key: record.id.clone(),
                expected,
                found,
            }),
            Err(e) => Err(backend(e)),
        }
    }

    fn list(&self) -> Result<Vec<KeyId>, MetaStoreError> {
        let ids = self.state.key_ids().map_err(backend)?;
        ids.into_iter()
            .map(|id| {
                // A stored id the keyring would refuse is a damaged store, not a crash.
                KeyId::new(id.clone()).map_err(|e| {
                    MetaStoreError::Backend(format!("stored key id {id:?} is invalid: {e}").into())
                })
            })
            .collect()
    }
}

/// Opens the KEKs in the HSM token labelled `token` through PKCS#11 module `module`,
/// sharing the process's one initialized context with the manifest-signing anchor.
pub fn open_hsm_kek(
    module: &std::path::Path,
    token: &str,
    pin: &Pin,
) -> Result<Pkcs11Kek, KeysError> {
    let context = crate::integrity::pkcs11::context(module).map_err(KeysError::Hsm)?;
    Pkcs11Kek::open(&context, token, pin).map_err(KeysError::Kek)
}

/// A keyring bound to the engine whose policies govern it: what it does is recorded in the
/// engine's event log and published to it as `Key` entities, so that the policies decide
/// on the keys as they are.
#[derive(Clone, Copy)]
pub struct PolicyKeys<'a> {
    engine: &'a Engine,
    keyring: &'a Keyring,
}

impl<'a> PolicyKeys<'a> {
    /// Binds `keyring` to `engine`.
    pub fn new(engine: &'a Engine, keyring: &'a Keyring) -> Self {
        Self { engine, keyring }
    }
}

impl PolicyKeys<'_> {
    /// Records `erasure` in the engine's event log (who, when, which keys and versions, which
    /// objects were under them), when the engine has a state backend.
    pub fn record_erasure(&self, erasure: &ErasureRecord) {
        let engine = self.engine;
        let detail =
            serde_json::to_string(erasure).unwrap_or_else(|e| format!("(unserializable: {e})"));
        if let Some(log) = engine.log()
            && let Err(e) = log.record_event(
                &format!("subject:{}", erasure.subject),
                None,
                "subject-erased",
                &detail,
            )
        {
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!(
                    "probity: cannot record the erasure of {}: {e}\n",
                    erasure.subject
                ),
            );
        }
    }
}

/// The `Key` entities that stand for the keyring's keys: one per key, with the primary
/// version's creation time and state (an erased key is `destroyed`).
pub(crate) fn key_entities(status: &KeyringStatus) -> Value {
    Value::Array(
        status
            .keys
            .iter()
            .map(|k| {
                key_entity(
                    &k.id,
                    k.primary_created_at,
                    k.primary_state,
                    k.erased.is_some(),
                )
            })
            .collect(),
    )
}

fn key_entity(id: &KeyId, created_at: Timestamp, state: VersionState, erased: bool) -> Value {
    let state = if erased {
        VersionState::Destroyed
    } else {
        state
    };
    json!({
        "uid": {"type": KEY_ENTITY_TYPE, "id": id.as_str()},
        "attrs": {"createdAt": created_at.unix_seconds(), "state": state.to_string()},
        "parents": [],
    })
}

/// Publishes the keys whose metadata the engine's state backend holds, without opening
/// their KEKs: for programs that only decide (`probity eval --state-dir`). Publishes
/// nothing (and returns 0) for an engine without a state backend.
pub fn publish_stored_keys(engine: &Engine) -> Result<usize, KeysError> {
    let Some(state) = engine.state() else {
        return Ok(0);
    };
    let store = StateKeyStore::new(Arc::clone(state));
    let mut facts = Vec::new();
    for id in store.list()? {
        if let Some(record) = store.load(&id)? {
            let r = &record.value;
            let primary = r.version(r.primary);
            facts.push(key_entity(
                &r.id,
                primary.map_or(Timestamp::from_unix_seconds(0), |v| v.created_at),
                primary.map_or(VersionState::Destroyed, |v| v.state),
                r.erased.is_some(),
            ));
        }
    }
    engine
        .replace_owned_entities(EntityOwner::Keyring, &Value::Array(facts))
        .map_err(KeysError::Publish)
}

impl PolicyKeys<'_> {
    /// Publishes the keyring's keys to the engine as its `Key` entities, replacing the ones
    /// published before; how many. Call it after every keyring change (this module's
    /// functions do) and periodically where other processes change the keyring too.
    pub fn publish(&self) -> Result<usize, KeysError> {
        let engine = self.engine;
        let keyring = self.keyring;
        let status = keyring.status()?;
        engine
            .replace_owned_entities(EntityOwner::Keyring, &key_entities(&status))
            .map_err(KeysError::Publish)
    }
}

/// The outcome of [`PolicyKeys::authorize_encrypt`].
#[derive(Debug, Clone)]
pub struct EncryptGrant {
    /// The decision that stands: after a rotation, the one on the new metadata.
    pub decision: Decision,
    /// The rotation carried out for the first decision's `rotate_key` obligation.
    pub rotation: Option<Rotation>,
    /// The first decision, when a rotation made a second one.
    pub refused: Option<Decision>,
}

/// The `encrypt` request `principal` asks for `key`.
pub(crate) fn encrypt_request(principal: &EntityUid, key: &KeyId) -> Result<Request, KeysError> {
    let problem = |e: crate::RequestError| KeysError::Request {
        key: key.as_str().to_owned(),
        problem: e.to_string(),
    };
    Ok(Request::new(
        principal.clone(),
        EntityUid::action("encrypt").map_err(problem)?,
        EntityUid::new(KEY_ENTITY_TYPE, key.as_str()).map_err(problem)?,
    ))
}

/// Whether `decision` asks to rotate `key`.
fn asks_rotation(decision: &Decision, key: &KeyId) -> bool {
    let Ok(target) = EntityUid::new(KEY_ENTITY_TYPE, key.as_str()).map(|u| u.to_string()) else {
        return false;
    };
    decision
        .obligations
        .iter()
        .any(|o| o.kind == ROTATE_OBLIGATION && o.target.as_deref() == Some(target.as_str()))
}

impl PolicyKeys<'_> {
    /// Asks whether `principal` may encrypt under `key` now, on the keyring's metadata and the
    /// engine's clock, and carries out a `rotate_key` obligation on `key`: the key is
    /// rotated by `actor`, the rotation recorded in the engine's event log (when it has a
    /// state backend), and the request decided again. The grant's decision is the one that
    /// stands; encrypt only if it allows.
    pub fn authorize_encrypt(
        &self,
        principal: &EntityUid,
        key: &KeyId,
        actor: &str,
    ) -> Result<EncryptGrant, KeysError> {
        let engine = self.engine;
        let keyring = self.keyring;
        // A key the keyring does not hold is named as such: the policies, asked about it,
        // would list reasons that mislead ("created in the future", say).
        keyring.key_status(key)?;
        self.publish()?;
        let request = encrypt_request(principal, key)?;
        let first = engine.decide(&request);
        if first.is_allowed() || !asks_rotation(&first, key) {
            return Ok(EncryptGrant {
                decision: first,
                rotation: None,
                refused: None,
            });
        }
        let rotation = self.rotate(key, actor, &first)?;
        let decision = engine.decide(&request);
        Ok(EncryptGrant {
            decision,
            rotation: Some(rotation),
            refused: Some(first),
        })
    }
}

impl PolicyKeys<'_> {
    /// Rotates `key` because `decision` asked for it: a new primary version, recorded in the
    /// event log with the policy that asked, then published.
    fn rotate(&self, key: &KeyId, actor: &str, decision: &Decision) -> Result<Rotation, KeysError> {
        let rotation = self.keyring.rotate(key, actor)?;
        let policy = decision
            .obligations
            .iter()
            .find(|o| o.kind == ROTATE_OBLIGATION)
            .map_or("(unknown)", |o| o.policy.as_str());
        self.record_event(
            key,
            "key-rotated",
            &format!(
                "version {} -> {} by {actor}, for policy {policy}",
                rotation.previous, rotation.primary
            ),
        );
        self.publish()?;
        Ok(rotation)
    }
}

impl PolicyKeys<'_> {
    /// Records a keyring event in the engine's event log, when it has one. A failure to
    /// record is reported on standard error rather than undoing a change the keyring made.
    pub fn record_event(&self, key: &KeyId, kind: &str, detail: &str) {
        let engine = self.engine;
        if let Some(log) = engine.log()
            && let Err(e) = log.record_event(&format!("key:{}", key.as_str()), None, kind, detail)
        {
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!(
                    "probity: cannot record {kind} of key {}: {e}\n",
                    key.as_str()
                ),
            );
        }
    }
}

impl PolicyKeys<'_> {
    /// Rotates every key whose `encrypt` decision, asked by `principal`, carries a
    /// `rotate_key` obligation: the automatic rotation the policies ask for (`probity keys
    /// rotate --due`, and the server's periodic sweep). Keys that are erased are skipped.
    pub fn rotate_due(
        &self,
        principal: &EntityUid,
        actor: &str,
    ) -> Result<Vec<Rotation>, KeysError> {
        let engine = self.engine;
        let keyring = self.keyring;
        self.publish()?;
        let mut out = Vec::new();
        for status in keyring.status()?.keys {
            if status.erased.is_some() {
                continue;
            }
            let decision = engine.decide(&encrypt_request(principal, &status.id)?);
            if !decision.is_allowed() && asks_rotation(&decision, &status.id) {
                out.push(self.rotate(&status.id, actor, &decision)?);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ManualClock;
    use crate::state::StateStore;

    const DAY: i64 = 86_400;
    const T0: i64 = 1_767_139_200;

    struct Fixture {
        _dir: tempfile::TempDir,
        clock: Arc<ManualClock>,
        engine: Engine,
        keyring: Keyring,
        state: Arc<StateStore>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::at(T0));
        let engine = Engine::builder(concat!(env!("CARGO_MANIFEST_DIR"), "/../policies"))
            .clock(clock.clone())
            .build()
            .unwrap();
        let state = Arc::new(StateStore::open(&dir.path().join("state")).unwrap());
        engine.attach_state(state.clone()).unwrap();
        let keyring = Keyring::new(
            Arc::new(StateKeyStore::new(state.clone())),
            Arc::new(SoftwareKek::open(&dir.path().join("kek")).unwrap()),
            engine.clock().clone(),
            KeyringOptions::default(),
        );
        Fixture {
            _dir: dir,
            clock,
            engine,
            keyring,
            state,
        }
    }

    fn alice() -> EntityUid {
        EntityUid::new("User", "alice").unwrap()
    }

    #[test]
    fn a_key_past_its_maximum_age_is_rotated_and_the_rotation_recorded() {
        let f = fixture();
        let key = KeyId::new("dataset/imagenet").unwrap();
        f.keyring.create(&key, KeyScope::Dataset, "ops").unwrap();
        let fresh = PolicyKeys::new(&f.engine, &f.keyring)
            .authorize_encrypt(&alice(), &key, "alice")
            .unwrap();
        assert!(fresh.decision.is_allowed(), "{:?}", fresh.decision);
        assert!(fresh.rotation.is_none());

        f.clock.advance(90 * DAY);
        let at_90 = PolicyKeys::new(&f.engine, &f.keyring)
            .authorize_encrypt(&alice(), &key, "alice")
            .unwrap();
        assert!(at_90.decision.is_allowed(), "90 days is still allowed");

        f.clock.advance(DAY);
        let grant = PolicyKeys::new(&f.engine, &f.keyring)
            .authorize_encrypt(&alice(), &key, "alice")
            .unwrap();
        let refused = grant.refused.expect("the 91-day-old key is refused first");
        assert_eq!(refused.reasons[0].policy, "security.key-too-old");
        let rotation = grant.rotation.expect("and rotated");
        assert_eq!((rotation.previous, rotation.primary), (1, 2));
        assert!(grant.decision.is_allowed(), "{:?}", grant.decision);
        let status = f.keyring.key_status(&key).unwrap();
        assert_eq!(status.primary, 2);
        assert!(status.versions.iter().all(|v| v.decrypts), "{status:?}");
        let events = f.state.events(0).unwrap();
        let event = events.iter().find(|e| e.kind == "key-rotated").unwrap();
        assert_eq!(event.object_id, "key:dataset/imagenet");
        assert!(
            event.detail.contains("1 -> 2") && event.detail.contains("security.key-too-old"),
            "{}",
            event.detail
        );
    }

    #[test]
    fn a_caller_cannot_supply_or_override_a_key() {
        let f = fixture();
        let key = KeyId::new("k").unwrap();
        f.keyring.create(&key, KeyScope::Dataset, "ops").unwrap();
        f.clock.advance(200 * DAY);
        PolicyKeys::new(&f.engine, &f.keyring).publish().unwrap();
        // A fresh-looking Key in the request is refused for what it is.
        let forged = Request::from_json_value(&json!({
            "principal": "User::\"alice\"", "action": "encrypt", "resource": "Key::\"k\"",
            "entities": [{"uid": {"type": "Key", "id": "k"},
                          "attrs": {"createdAt": T0 + 199 * DAY, "state": "active"}, "parents": []}],
        }))
        .unwrap();
        let d = f.engine.decide(&forged);
        assert!(!d.is_allowed());
        assert!(format!("{d:?}").contains("never from a request"), "{d:?}");
        // And the store refuses it as well.
        let err = f
            .engine
            .upsert_entities(&json!([{"uid": {"type": "Key", "id": "k"},
                "attrs": {"createdAt": T0 + 199 * DAY, "state": "active"}, "parents": []}]))
            .unwrap_err();
        assert!(err.to_string().contains("keyring"), "{err}");
    }

    #[test]
    fn an_unknown_key_is_refused_not_rotated() {
        let f = fixture();
        let key = KeyId::new("nobody-made-me").unwrap();
        let err = PolicyKeys::new(&f.engine, &f.keyring)
            .authorize_encrypt(&alice(), &key, "alice")
            .unwrap_err();
        assert_eq!(err.to_string(), "keyring");
        assert!(
            matches!(&err, KeysError::Key(KeyError::UnknownKey { key: k }) if k == &key),
            "{err:?}"
        );
        // Nothing was made or rotated.
        assert!(f.keyring.key_status(&key).is_err());
    }

    #[test]
    fn an_erased_key_is_published_destroyed_and_refused() {
        let f = fixture();
        let key = KeyId::new("subject/alice").unwrap();
        f.keyring
            .create(&key, KeyScope::Subject("alice".into()), "ops")
            .unwrap();
        f.keyring.erase("alice", "dpo", Vec::new()).unwrap();
        let grant = PolicyKeys::new(&f.engine, &f.keyring)
            .authorize_encrypt(&alice(), &key, "alice")
            .unwrap();
        assert!(!grant.decision.is_allowed());
        assert_eq!(grant.decision.reasons[0].policy, "security.key-not-active");
        let facts = key_entities(&f.keyring.status().unwrap());
        assert_eq!(facts[0]["attrs"]["state"], "destroyed");
    }

    #[test]
    fn rotate_due_rotates_only_what_the_policies_ask_for() {
        let f = fixture();
        let old = KeyId::new("old").unwrap();
        let young = KeyId::new("young").unwrap();
        f.keyring.create(&old, KeyScope::Dataset, "ops").unwrap();
        f.clock.advance(60 * DAY);
        f.keyring.create(&young, KeyScope::Dataset, "ops").unwrap();
        f.clock.advance(31 * DAY);
        let node = EntityUid::new("Node", "gpu-a1").unwrap();
        let rotations = PolicyKeys::new(&f.engine, &f.keyring)
            .rotate_due(&node, "probity")
            .unwrap();
        assert_eq!(rotations.len(), 1);
        assert_eq!(rotations[0].key, old);
        assert!(
            PolicyKeys::new(&f.engine, &f.keyring)
                .rotate_due(&node, "probity")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn stored_keys_are_published_without_their_keks() {
        let f = fixture();
        let key = KeyId::new("k").unwrap();
        f.keyring.create(&key, KeyScope::Dataset, "ops").unwrap();
        f.clock.advance(91 * DAY);
        let engine = Engine::builder(concat!(env!("CARGO_MANIFEST_DIR"), "/../policies"))
            .clock(f.clock.clone())
            .build()
            .unwrap();
        engine.attach_state(f.state.clone()).unwrap();
        assert_eq!(publish_stored_keys(&engine).unwrap(), 1);
        let d = engine.decide(&encrypt_request(&alice(), &key).unwrap());
        assert_eq!(d.reasons[0].policy, "security.key-too-old");
        assert_eq!(d.obligations[0].kind, ROTATE_OBLIGATION);
    }

    #[test]
    fn key_metadata_round_trips_through_the_state_store_with_revisions() {
        let f = fixture();
        let store = StateKeyStore::new(f.state.clone());
        let key = KeyId::new("k").unwrap();
        f.keyring.create(&key, KeyScope::Dataset, "ops").unwrap();
        let loaded = store.load(&key).unwrap().unwrap();
        assert_eq!(loaded.value.primary, 1);
        let err = store.store(&loaded.value, None).unwrap_err();
        assert!(matches!(err, MetaStoreError::Conflict { .. }), "{err:?}");
        assert_eq!(store.list().unwrap(), vec![key]);
    }
}
