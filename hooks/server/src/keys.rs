//! The keyring over the API: key status, rotation, erasure, and encryption of small
//! payloads (`/v1/keys`, `/v1/keys/rotate`, `/v1/keys/erase`, `/v1/encrypt`,
//! `/v1/decrypt`), plus the periodic rotation the policies ask for.
//!
//! Every call is authorized by the api policies on `Api::"keys"` (operations `read`,
//! `encrypt`, `decrypt`, `rotate`, `erase`; only admins erase). Encrypting asks the
//! `encrypt` decision on the keyring's own metadata and the engine's clock, and carries
//! out its `rotate_key` obligation ([`probity::keys::PolicyKeys::authorize_encrypt`]). The keyring's
//! metadata lives in the server's state backend; its KEKs in the HSM of `[keys]`, or a
//! software KEK under the state directory, said at start ("not an HSM").

use std::io::Read as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use probity::keys::{
    self, DecryptingReader, EncryptOptions, KekProvider, KeyError, KeyId, Keyring, KeyringOptions,
    Pin, SoftwareKek, StateKeyStore,
};
use probity::{Engine, EntityUid};
use probity_base::prometheus::{Kind, Writer};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::api::{authorize, caller, json_body};
use crate::caller::Caller;
use crate::config::Config;
use crate::error::ApiError;

/// The keyring and its counters.
pub(crate) struct KeyService {
    keyring: Keyring,
    rotations: AtomicU64,
    encrypted: AtomicU64,
    decrypted: AtomicU64,
    refused: AtomicU64,
}

/// Opens the keyring on the engine's state backend; `None` without one (the key
/// endpoints then answer 503).
pub(crate) fn open(engine: &Engine, config: &Config) -> Result<Option<KeyService>, String> {
    let Some(state) = engine.state().cloned() else {
        return Ok(None);
    };
    let k = &config.keys;
    let kek: Arc<dyn KekProvider> = match &k.hsm_module {
        Some(module) => {
            let token = k
                .hsm_token
                .as_deref()
                .ok_or("[keys] hsm_module needs hsm_token")?;
            let pin = match &k.hsm_pin_file {
                Some(path) => {
                    probity_base::trust::check_file(path, probity_base::trust::Material::Secret)
                        .map_err(|e| e.to_string())?;
                    Pin::from_file(path).map_err(|e| e.to_string())?
                }
                None => Pin::from_env("PROBITY_HSM_PIN").map_err(|e| e.to_string())?,
            };
            Arc::new(keys::open_hsm_kek(module, token, &pin).map_err(|e| chain(&e))?)
        }
        None => {
            let dir = config
                .integrity
                .state_dir
                .as_ref()
                .ok_or("[keys] needs a state directory for its software KEK")?
                .join("kek");
            let kek = SoftwareKek::open(&dir).map_err(|e| chain(&e))?;
            tracing::warn!(kek = %dir.display(), "{}", keys::SOFTWARE_KEK_NOTICE);
            Arc::new(kek)
        }
    };
    let keyring = Keyring::new(
        Arc::new(StateKeyStore::new(state)),
        kek,
        engine.clock().clone(),
        KeyringOptions::default(),
    );
    keys::PolicyKeys::new(engine, &keyring)
        .publish()
        .map_err(|e| chain(&e))?;
    Ok(Some(KeyService {
        keyring,
        rotations: AtomicU64::new(0),
        encrypted: AtomicU64::new(0),
        decrypted: AtomicU64::new(0),
        refused: AtomicU64::new(0),
    }))
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Who the `encrypt` decision names for `caller`: its node's sidecar asks as the node,
/// any other caller as a user of its identity.
fn principal(state: &AppState, caller: &Caller) -> Result<EntityUid, ApiError> {
    let uid = match state.config().auth.nodes.get(&caller.0) {
        Some(node) => EntityUid::new("Node", node),
        None => EntityUid::new("User", &caller.0),
    };
    uid.map_err(|e| ApiError::BadRequest(e.to_string()))
}

fn service(state: &AppState) -> Result<&KeyService, ApiError> {
    state.keys().ok_or_else(|| {
        ApiError::Unavailable(
            "no keyring: the server runs without a state directory ([integrity] state_dir)".into(),
        )
    })
}

/// A keyring error as an answer: unknown keys 404, erased or destroyed ones 410-like
/// refusals (422), a failing HSM or store 503.
fn key_error(e: &KeyError) -> ApiError {
    let text = chain(e);
    match e {
        KeyError::UnknownKey { .. } | KeyError::UnknownSubject { .. } => ApiError::NotFound(text),
        KeyError::Kek { .. } | KeyError::Store { .. } => ApiError::Unavailable(text),
        _ => ApiError::Unprocessable(text),
    }
}

fn keys_error(e: &keys::KeysError) -> ApiError {
    match e {
        keys::KeysError::Key(inner) => key_error(inner),
        other => ApiError::Unavailable(chain(other)),
    }
}

/// Runs keyring work (HSM calls, store writes) off the async threads.
async fn blocking<T: Send + 'static>(
    state: &AppState,
    work: impl FnOnce(&AppState, &KeyService) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    service(state)?;
    let s = state.clone();
    tokio::task::spawn_blocking(move || match s.keys() {
        Some(k) => work(&s, k),
        None => Err(ApiError::Internal),
    })
    .await
    .map_err(|_| ApiError::Internal)?
}

/// `GET /v1/keys`: every key's metadata (never key material) and where the KEKs live.
pub(crate) async fn status(
    State(state): State<AppState>,
    ext: Extensions,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &caller(&ext), "keys", "read", None).await?;
    blocking(&state, |_, k| {
        let status = k.keyring.status().map_err(|e| key_error(&e))?;
        serde_json::to_value(status).map_err(|_| ApiError::Internal)
    })
    .await
    .map(Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateBody {
    key: String,
}

/// `POST /v1/keys/rotate` `{"key": ID}`: a new primary version.
pub(crate) async fn rotate(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let who = caller(&ext);
    authorize(&state, &who, "keys", "rotate", None).await?;
    let parsed: RotateBody = serde_json::from_value(json_body(&state, body, "rotation")?)
        .map_err(|e| ApiError::BadRequest(format!("expected {{\"key\": \"...\"}}: {e}")))?;
    let key = KeyId::new(parsed.key).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    blocking(&state, move |s, k| {
        let r = k.keyring.rotate(&key, &who.0).map_err(|e| key_error(&e))?;
        k.rotations.fetch_add(1, Ordering::Relaxed);
        keys::PolicyKeys::new(s.engine(), &k.keyring).record_event(
            &key,
            "key-rotated",
            &format!("version {} -> {} by {}", r.previous, r.primary, who.0),
        );
        keys::PolicyKeys::new(s.engine(), &k.keyring)
            .publish()
            .map_err(|e| keys_error(&e))?;
        tracing::info!(key = key.as_str(), version = r.primary, caller = %who.0, "key rotated");
        serde_json::to_value(r).map_err(|_| ApiError::Internal)
    })
    .await
    .map(Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EraseBody {
    subject: String,
    #[serde(default)]
    objects: Vec<String>,
}

/// `POST /v1/keys/erase` `{"subject": S, "objects": [...]}`: crypto-shredding.
pub(crate) async fn erase(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let who = caller(&ext);
    authorize(&state, &who, "keys", "erase", None).await?;
    let parsed: EraseBody =
        serde_json::from_value(json_body(&state, body, "erasure")?).map_err(|e| {
            ApiError::BadRequest(format!(
                "expected {{\"subject\": \"...\", \"objects\": [...]}}: {e}"
            ))
        })?;
    blocking(&state, move |s, k| {
        let erasure = k
            .keyring
            .erase(&parsed.subject, &who.0, parsed.objects)
            .map_err(|e| key_error(&e))?;
        keys::PolicyKeys::new(s.engine(), &k.keyring).record_erasure(&erasure);
        keys::PolicyKeys::new(s.engine(), &k.keyring)
            .publish()
            .map_err(|e| keys_error(&e))?;
        tracing::warn!(subject = %erasure.subject, caller = %who.0, "data subject erased");
        serde_json::to_value(erasure).map_err(|_| ApiError::Internal)
    })
    .await
    .map(Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EncryptBody {
    key: String,
    object_id: String,
    /// Base64.
    plaintext: String,
}

/// `POST /v1/encrypt` `{"key", "object_id", "plaintext": base64}`: the encrypted
/// object (base64), after the policies allow it; a key past its age is rotated first.
pub(crate) async fn encrypt(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let who = caller(&ext);
    authorize(&state, &who, "keys", "encrypt", None).await?;
    let parsed: EncryptBody = serde_json::from_value(json_body(&state, body, "encryption")?)
        .map_err(|e| {
            ApiError::BadRequest(format!(
                "expected {{\"key\", \"object_id\", \"plaintext\" (base64)}}: {e}"
            ))
        })?;
    let plaintext = BASE64
        .decode(parsed.plaintext.as_bytes())
        .map_err(|e| ApiError::BadRequest(format!("plaintext is not base64: {e}")))?;
    let key = KeyId::new(parsed.key).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let asker = principal(&state, &who)?;
    blocking(&state, move |s, k| {
        let grant = keys::PolicyKeys::new(s.engine(), &k.keyring)
            .authorize_encrypt(&asker, &key, &who.0)
            .map_err(|e| keys_error(&e))?;
        if let Some(r) = &grant.rotation {
            k.rotations.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                key = key.as_str(),
                version = r.primary,
                "key rotated: the policies asked"
            );
        }
        if !grant.decision.is_allowed() {
            k.refused.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::Forbidden(format!(
                "encrypting under {} is refused: {}",
                key.as_str(),
                grant
                    .decision
                    .reasons
                    .iter()
                    .map(|r| format!("{} ({})", r.policy, r.message))
                    .collect::<Vec<_>>()
                    .join("; ")
            )));
        }
        let sealed = keys::encrypt_to_vec(
            &k.keyring,
            &key,
            &parsed.object_id,
            &plaintext,
            &EncryptOptions::default(),
        )
        .map_err(|e| ApiError::Unprocessable(chain(&e)))?;
        k.encrypted.fetch_add(1, Ordering::Relaxed);
        Ok(json!({
            "key": key.as_str(),
            "object_id": parsed.object_id,
            "ciphertext": BASE64.encode(&sealed),
            "rotated": grant.rotation,
        }))
    })
    .await
    .map(Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DecryptBody {
    object_id: String,
    /// Base64.
    ciphertext: String,
}

/// `POST /v1/decrypt` `{"object_id", "ciphertext": base64}`: the plaintext (base64), or
/// 422 naming what failed to authenticate (nothing of a failed segment is returned).
pub(crate) async fn decrypt(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let who = caller(&ext);
    authorize(&state, &who, "keys", "decrypt", None).await?;
    let parsed: DecryptBody = serde_json::from_value(json_body(&state, body, "decryption")?)
        .map_err(|e| {
            ApiError::BadRequest(format!(
                "expected {{\"object_id\", \"ciphertext\" (base64)}}: {e}"
            ))
        })?;
    let sealed = BASE64
        .decode(parsed.ciphertext.as_bytes())
        .map_err(|e| ApiError::BadRequest(format!("ciphertext is not base64: {e}")))?;
    blocking(&state, move |_, k| {
        let fail = |e: &dyn std::error::Error| ApiError::Unprocessable(chain(e));
        let mut reader =
            DecryptingReader::open(&k.keyring, &parsed.object_id, std::io::Cursor::new(sealed))
                .map_err(|e| fail(&e))?;
        let mut plain = Vec::new();
        reader.read_to_end(&mut plain).map_err(|e| fail(&e))?;
        k.decrypted.fetch_add(1, Ordering::Relaxed);
        Ok(json!({"object_id": parsed.object_id, "plaintext": BASE64.encode(&plain)}))
    })
    .await
    .map(Json)
}

/// Rotates, every `[keys] rotation_check_seconds`, what the policies ask to rotate
/// (asked as `User::"probity"`), on a thread of its own. Stops when the returned sender
/// drops.
pub(crate) fn spawn_rotation(state: &AppState) -> Option<std::sync::mpsc::Sender<()>> {
    state.keys()?;
    let every = state.config().keys.rotation_check_seconds;
    if every == 0 {
        return None;
    }
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let s = state.clone();
    let spawned = std::thread::Builder::new()
        .name("probity-key-rotation".into())
        .spawn(move || {
            loop {
                if let (Some(k), Ok(asker)) = (s.keys(), EntityUid::new("User", "probity")) {
                    match keys::PolicyKeys::new(s.engine(), &k.keyring)
                        .rotate_due(&asker, "probity (automatic)")
                    {
                        Ok(done) => {
                            for r in &done {
                                k.rotations.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(
                                    key = r.key.as_str(),
                                    version = r.primary,
                                    "key rotated: the policies asked"
                                );
                            }
                        }
                        Err(e) => {
                            tracing::error!(error = %chain(&e), "automatic key rotation failed")
                        }
                    }
                }
                match rx.recv_timeout(Duration::from_secs(every)) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::error!(error = %e, "cannot start automatic key rotation");
            None
        }
    }
}

/// The key age past which the policies refuse a key to encrypt and ask for its rotation:
/// `Settings::"active"`'s `keyMaxAgeSeconds` (probity.toml's `security.key_max_age_days`)
/// in the live set; `None` when the set has no such setting.
fn key_max_age_seconds(engine: &Engine) -> Option<u64> {
    let settings = EntityUid::new("Settings", "active").ok()?;
    engine
        .entity(&settings)?
        .pointer("/attrs/keyMaxAgeSeconds")?
        .as_u64()
}

/// `probity_key_max_age_seconds`: beside each key's age, the age it is rotated at, so an
/// alert compares the two instead of repeating probity.toml's number.
fn render_max_age(engine: &Engine, w: &mut Writer<'_>) {
    if let Some(max) = key_max_age_seconds(engine) {
        w.single(
            "probity_key_max_age_seconds",
            Kind::Gauge,
            "The key age past which the policies refuse a key to encrypt and ask for its rotation (probity.toml's security.key_max_age_days): a probity_key_age_seconds above it is overdue.",
            max,
        );
    }
}

/// The keyring's metrics: each key's primary age and the age it is rotated at,
/// rotations, and payloads.
pub(crate) fn render_metrics(service: &KeyService, engine: &Engine, out: &mut String) {
    let mut w = Writer::new(out);
    render_max_age(engine, &mut w);
    w.single(
        "probity_key_rotations_total",
        Kind::Counter,
        "Key rotations made by this server (asked through the API or by the policies).",
        service.rotations.load(Ordering::Relaxed),
    );
    w.family(
        "probity_key_operations_total",
        Kind::Counter,
        "Payloads encrypted and decrypted, and encryptions the policies refused.",
    );
    for (operation, n) in [
        ("encrypt", &service.encrypted),
        ("decrypt", &service.decrypted),
        ("refused", &service.refused),
    ] {
        w.sample(
            "probity_key_operations_total",
            &[("operation", operation)],
            n.load(Ordering::Relaxed),
        );
    }
    if let Ok(status) = service.keyring.status() {
        w.family(
            "probity_key_age_seconds",
            Kind::Gauge,
            "Age of each key's primary version.",
        );
        for k in status.keys.iter().filter(|k| k.erased.is_none()) {
            w.sample(
                "probity_key_age_seconds",
                &[("key", k.id.as_str())],
                k.age(status.now).as_secs(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_age_text(engine: &Engine) -> String {
        let mut text = String::new();
        render_max_age(engine, &mut Writer::new(&mut text));
        probity_base::prometheus::check(&text).unwrap();
        text
    }

    #[test]
    fn the_key_max_age_metric_is_the_live_sets_setting() {
        let engine = Engine::defaults().build().unwrap();
        assert!(
            max_age_text(&engine).ends_with("\nprobity_key_max_age_seconds 7776000\n"),
            "90 days: {}",
            max_age_text(&engine)
        );

        let dir = tempfile::tempdir().unwrap();
        let policies = concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies");
        copy_dir(std::path::Path::new(policies), dir.path());
        let toml = dir.path().join("probity.toml");
        let text = std::fs::read_to_string(&toml).unwrap();
        assert!(text.contains("key_max_age_days = 90\n"));
        std::fs::write(
            &toml,
            text.replace("key_max_age_days = 90\n", "key_max_age_days = 30\n"),
        )
        .unwrap();
        let engine = Engine::builder(dir.path()).build().unwrap();
        assert!(
            max_age_text(&engine).ends_with("\nprobity_key_max_age_seconds 2592000\n"),
            "{}",
            max_age_text(&engine)
        );
    }

    fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                std::fs::create_dir_all(&target).unwrap();
                copy_dir(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).unwrap();
            }
        }
    }
}
