//! The keyring over the API: who may do what (the api policies), encrypt and decrypt of
//! small payloads, a key past its maximum age refused and rotated by the server, erasure
//! by admins only, and the key metrics.

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use probity::ManualClock;
use probity::state::StateStore;
use probity_server::{AppState, Config};
use serde_json::json;

use crate::{call, cluster};

const T0: i64 = 1_767_139_200;
const DAY: i64 = 86_400;

fn keyring_state(tmp: &std::path::Path, clock: Arc<ManualClock>) -> AppState {
    let state_dir = tmp.join("state");
    let store = Arc::new(StateStore::open(&state_dir).unwrap());
    let mut config = Config::default();
    config.integrity.state_dir = Some(state_dir);
    config
        .auth
        .groups
        .insert("admins".into(), vec!["uid:0".into()]);
    config
        .auth
        .groups
        .insert("key-users".into(), vec!["cn:trainer".into()]);
    let engine = probity::Engine::defaults().clock(clock).build().unwrap();
    engine.upsert_entities(&cluster()).unwrap();
    engine.attach_state(store).unwrap();
    let s = AppState::new(engine, config);
    assert!(s.open_keyring().unwrap());
    s
}

/// Issue 28, item 10: an encrypt under a key the keyring does not hold listed the
/// policies' reasons ("created in the future"), which misled the caller.
#[tokio::test]
async fn an_encrypt_under_an_unknown_key_answers_no_such_key_not_policy_reasons() {
    let tmp = tempfile::tempdir().unwrap();
    let s = keyring_state(tmp.path(), Arc::new(ManualClock::at(T0)));
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/encrypt",
        Some(
            &json!({"key": "dataset/missing", "object_id": "o1", "plaintext": BASE64.encode(b"x")}),
        ),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{out}");
    let message = out["error"].as_str().unwrap();
    assert!(
        message.contains("no key \"dataset/missing\" in the keyring"),
        "{out}"
    );
    assert!(!message.contains("future"), "{out}");
}

#[tokio::test]
async fn keys_over_the_api_encrypt_rotate_at_91_days_and_only_admins_erase() {
    let tmp = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at(T0));
    let s = keyring_state(tmp.path(), clock.clone());

    // Keys are made by the keyring (here the CLI's library path), never by a caller.
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&json!([{"uid": {"type": "Key", "id": "dataset/a"},
            "attrs": {"createdAt": T0, "state": "active"}, "parents": []}])),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{out}");
    assert!(out.to_string().contains("keyring"), "{out}");

    let body = |key: &str, object: &str, plain: &[u8]| json!({"key": key, "object_id": object, "plaintext": BASE64.encode(plain)});
    // An unknown key is refused as such (see the test below).
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/encrypt",
        Some(&body("dataset/a", "o1", b"x")),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{out}");

    // The admin makes the key through the library (there is no create endpoint).
    crate::keys::create(&s, "dataset/a", None);
    crate::keys::create(&s, "subject/alice", Some("alice"));

    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/encrypt",
        Some(&body("dataset/a", "o1", b"first")),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert!(out["rotated"].is_null());
    let first = out["ciphertext"].as_str().unwrap().to_owned();

    // Anonymous callers may not encrypt; a stranger may not either.
    for who in [None, Some("cn:stranger")] {
        let (status, _) = call(
            &s,
            Method::POST,
            "/v1/encrypt",
            Some(&body("dataset/a", "o1", b"x")),
            who,
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{who:?}");
    }

    // 91 days on, the server rotates as the policy asks, then encrypts.
    clock.advance(91 * DAY);
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/encrypt",
        Some(&body("dataset/a", "o2", b"second")),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["rotated"]["previous"], 1);
    assert_eq!(out["rotated"]["primary"], 2);
    let second = out["ciphertext"].as_str().unwrap().to_owned();

    // Both versions decrypt; a header from another object does not.
    for (object, sealed, plain) in [("o1", &first, "first"), ("o2", &second, "second")] {
        let (status, out) = call(
            &s,
            Method::POST,
            "/v1/decrypt",
            Some(&json!({"object_id": object, "ciphertext": sealed})),
            Some("cn:trainer"),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{out}");
        assert_eq!(
            BASE64.decode(out["plaintext"].as_str().unwrap()).unwrap(),
            plain.as_bytes()
        );
    }
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/decrypt",
        Some(&json!({"object_id": "o2", "ciphertext": first})),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{out}");

    // Status shows metadata only; metrics show ages and the rotation.
    let (status, out) = call(&s, Method::GET, "/v1/keys", None, Some("cn:trainer")).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert!(!out.to_string().contains("wrapped"), "{out}");
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    let metrics = metrics.as_str().unwrap().to_owned();
    assert!(
        metrics.contains("probity_key_rotations_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("probity_key_age_seconds{key=\"dataset/a\"} 0"),
        "{metrics}"
    );

    // Only admins erase, and afterwards the subject's data is gone.
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/encrypt",
        Some(&body("subject/alice", "a1", b"alice")),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let alice = out["ciphertext"].as_str().unwrap().to_owned();
    let erase = json!({"subject": "alice", "objects": ["a1"]});
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/keys/erase",
        Some(&erase),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{out}");
    assert!(out.to_string().contains("api.erase-needs-admin"), "{out}");
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/keys/erase",
        Some(&erase),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/decrypt",
        Some(&json!({"object_id": "a1", "ciphertext": alice})),
        Some("cn:trainer"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{out}");
    assert!(out.to_string().contains("was erased on"), "{out}");
    let events = s.engine().log().unwrap().events(0).unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert!(kinds.contains(&"key-rotated"), "{kinds:?}");
    assert!(kinds.contains(&"subject-erased"), "{kinds:?}");
}

#[tokio::test]
async fn without_a_state_directory_the_key_endpoints_are_unavailable() {
    let s = crate::state();
    let (status, out) = call(&s, Method::GET, "/v1/keys", None, Some("uid:0")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{out}");
    assert!(out.to_string().contains("no keyring"), "{out}");
}

/// Creates a key with the library, as `probity keys create` does.
pub(crate) fn create(s: &AppState, key: &str, subject: Option<&str>) {
    use probity::keys::{KeyId, KeyScope, Keyring, KeyringOptions, SoftwareKek, StateKeyStore};
    let engine = s.engine();
    let state = engine.state().unwrap().clone();
    let dir = s.config().integrity.state_dir.clone().unwrap();
    let keyring = Keyring::new(
        Arc::new(StateKeyStore::new(state)),
        Arc::new(SoftwareKek::open(&dir.join("kek")).unwrap()),
        engine.clock().clone(),
        KeyringOptions::default(),
    );
    let scope = subject.map_or(KeyScope::Dataset, |s| KeyScope::Subject(s.to_owned()));
    keyring
        .create(&KeyId::new(key).unwrap(), scope, "ops")
        .unwrap();
}
