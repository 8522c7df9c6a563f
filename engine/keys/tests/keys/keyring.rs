//! The keyring's lifecycle with the software KEK provider: rotation at 90 days on an
//! injected clock, decrypt-only versions, rewrap, retirement, minimum decryption version,
//! compare-and-swap between writers, one unwrap per key version, and erasure.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use probity_keys::stream::{self, EncryptOptions};
use probity_keys::{
    KekError, KeyError, KeyId, KeyMetaStore, KeyRecord, KeyScope, Keyring, KeyringOptions,
    MemoryMetaStore, MetaStoreError, SOFTWARE_KEK_NOTICE, StreamError, Timestamp, VersionState,
    Versioned, rewrap_file, subject_kek_label,
};

use crate::common::{CountingKek, DAY, Setup, content, decrypt, key};

fn small() -> EncryptOptions {
    EncryptOptions {
        segment_size: 1024,
        ..EncryptOptions::default()
    }
}

fn key_err(e: StreamError) -> KeyError {
    match e {
        StreamError::Key(k) => k,
        other => panic!("expected a key error, got {other:?}"),
    }
}

#[test]
fn rotation_at_90_days_on_the_injected_clock_keeps_old_versions_decrypting() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    let k = key("dataset/imagenet");
    let created = s
        .keyring
        .create(&k, KeyScope::Dataset, "ops@example.org")
        .unwrap();
    assert_eq!(
        (created.primary, created.primary_state),
        (1, VersionState::Active)
    );
    assert_eq!(created.versions[0].created_by, "ops@example.org");
    let p1 = content(5000);
    let o1 = stream::encrypt_to_vec(&s.keyring, &k, "shard/1", &p1, &small()).unwrap();

    // What the engine's rotation rule reads: the primary's age on the engine's clock.
    s.clock.advance(89 * DAY as i64);
    let st = s.keyring.key_status(&k).unwrap();
    assert_eq!(
        st.age(Timestamp::now(&*s.clock)),
        Duration::from_secs(89 * DAY)
    );
    s.clock.advance(DAY as i64);
    let st = s.keyring.key_status(&k).unwrap();
    assert_eq!(st.age(Timestamp::now(&*s.clock)).as_secs(), 90 * DAY);
    assert_eq!(st.versions[0].age_seconds, 90 * DAY);

    let rot = s.keyring.rotate(&k, "probity-engine").unwrap();
    assert_eq!((rot.previous, rot.primary), (1, 2));
    assert_eq!(rot.created_at, Timestamp::now(&*s.clock));
    let st = s.keyring.key_status(&k).unwrap();
    assert_eq!(st.age(Timestamp::now(&*s.clock)), Duration::ZERO);
    assert_eq!(st.versions[0].state, VersionState::DecryptOnly);
    assert!(st.versions[0].decrypts);
    assert_eq!(st.versions[1].state, VersionState::Active);

    let p2 = content(3000);
    let o2 = stream::encrypt_to_vec(&s.keyring, &k, "shard/2", &p2, &small()).unwrap();
    assert_eq!(
        probity_keys::Header::parse(&o2).unwrap().0.wrap_version(),
        2
    );
    assert_eq!(decrypt(&s.keyring, "shard/1", &o1).unwrap(), p1);
    assert_eq!(decrypt(&s.keyring, "shard/2", &o2).unwrap(), p2);

    // Rewrap shard/1 under v2, retire v1: the rewrapped copy decrypts, the old one cannot.
    let path = dir.path().join("shard1.enc");
    std::fs::write(&path, &o1).unwrap();
    let report = rewrap_file(&s.keyring, "shard/1", &path).unwrap();
    assert_eq!(
        (report.from_version, report.to_version, report.rewritten),
        (1, 2, true)
    );
    let rewrapped = std::fs::read(&path).unwrap();
    let h = probity_keys::Header::parse(&rewrapped).unwrap().0;
    assert_eq!((h.sealed_version(), h.wrap_version()), (1, 2));
    s.clock.advance(DAY as i64);
    s.keyring.retire(&k, 1, "ops@example.org").unwrap();
    assert_eq!(decrypt(&s.keyring, "shard/1", &rewrapped).unwrap(), p1);
    let err = key_err(decrypt(&s.keyring, "shard/1", &o1).unwrap_err());
    assert!(
        matches!(err, KeyError::VersionDestroyed { version: 1, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("version 1 was destroyed on 2026-04-02 by ops@example.org"),
        "{err}"
    );
    // Nothing else to rewrap: already under the primary.
    let again = rewrap_file(&s.keyring, "shard/1", &path).unwrap();
    assert!(!again.rewritten);

    let status = s.keyring.status().unwrap();
    assert_eq!(status.keys.len(), 1);
    let json = serde_json::to_string(&status).unwrap();
    assert!(json.contains(SOFTWARE_KEK_NOTICE), "{json}");
    assert!(json.contains("\"state\":\"destroyed\""), "{json}");
    assert!(json.contains("\"state\":\"active\""), "{json}");
}

#[test]
fn retire_and_minimum_version_rules() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    let k = key("dataset/rules");
    s.keyring.create(&k, KeyScope::Dataset, "ops").unwrap();
    let o1 = stream::encrypt_to_vec(&s.keyring, &k, "o", b"one", &small()).unwrap();
    assert!(matches!(
        s.keyring.retire(&k, 1, "ops"),
        Err(KeyError::RetirePrimary { version: 1, .. })
    ));
    s.keyring.rotate(&k, "ops").unwrap();
    s.keyring.rotate(&k, "ops").unwrap();
    assert!(matches!(
        s.keyring.retire(&k, 9, "ops"),
        Err(KeyError::UnknownVersion {
            version: 9,
            primary: 3,
            ..
        })
    ));
    assert!(matches!(
        s.keyring.set_min_decrypt_version(&k, 4, "ops"),
        Err(KeyError::MinimumRefused {
            requested: 4,
            primary: 3,
            ..
        })
    ));
    s.keyring.set_min_decrypt_version(&k, 2, "ops").unwrap();
    assert!(matches!(
        s.keyring.set_min_decrypt_version(&k, 1, "ops"),
        Err(KeyError::MinimumRefused { current: 2, .. })
    ));
    let err = key_err(decrypt(&s.keyring, "o", &o1).unwrap_err());
    assert!(
        matches!(
            err,
            KeyError::BelowMinimum {
                version: 1,
                min: 2,
                ..
            }
        ),
        "{err:?}"
    );
    let st = s.keyring.key_status(&k).unwrap();
    assert!(!st.versions[0].decrypts && st.versions[1].decrypts);
    assert!(matches!(
        s.keyring.create(&k, KeyScope::Dataset, "ops"),
        Err(KeyError::KeyExists { .. })
    ));
    assert!(matches!(
        s.keyring.rotate(&key("dataset/none"), "ops"),
        Err(KeyError::UnknownKey { .. })
    ));
    assert!(matches!(
        s.keyring.create(&key("dataset/x"), KeyScope::Dataset, ""),
        Err(KeyError::InvalidId(_))
    ));
}

/// A store that lets another writer in between a keyring's read and its write.
struct RacingStore {
    inner: Arc<MemoryMetaStore>,
    before_store: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl KeyMetaStore for RacingStore {
    fn load(&self, key: &KeyId) -> Result<Option<Versioned<KeyRecord>>, MetaStoreError> {
        self.inner.load(key)
    }
    fn store(&self, record: &KeyRecord, expected: Option<u64>) -> Result<u64, MetaStoreError> {
        if let Some(other_writer) = self.before_store.lock().unwrap().take() {
            other_writer();
        }
        self.inner.store(record, expected)
    }
    fn list(&self) -> Result<Vec<KeyId>, MetaStoreError> {
        self.inner.list()
    }
}

#[test]
fn two_writers_cannot_both_rotate() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    let k = key("dataset/race");
    s.keyring.create(&k, KeyScope::Dataset, "ops").unwrap();
    let other = Arc::new(s.another(s.kek.clone()));
    let racing = Arc::new(RacingStore {
        inner: s.store.clone(),
        before_store: Mutex::new(None),
    });
    let first = Keyring::new(
        racing.clone(),
        s.kek.clone(),
        s.clock.clone(),
        KeyringOptions::default(),
    );
    let (k2, o2) = (k.clone(), other.clone());
    *racing.before_store.lock().unwrap() = Some(Box::new(move || {
        o2.rotate(&k2, "writer-b").unwrap();
    }));
    let err = first.rotate(&k, "writer-a").unwrap_err();
    assert!(matches!(err, KeyError::Conflict { .. }), "{err:?}");
    assert!(err.to_string().contains("nothing was written"), "{err}");
    let st = s.keyring.key_status(&k).unwrap();
    assert_eq!(st.primary, 2);
    assert_eq!(st.versions.len(), 2);
    assert_eq!(st.versions[1].created_by, "writer-b");
    // Having re-read, the loser's next rotation succeeds.
    assert_eq!(first.rotate(&k, "writer-a").unwrap().primary, 3);
}

#[test]
fn unwrap_is_paid_once_per_key_version() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    let k = key("dataset/cache");
    s.keyring.create(&k, KeyScope::Dataset, "ops").unwrap();
    let mut objects = Vec::new();
    for v in 0..3 {
        if v > 0 {
            s.keyring.rotate(&k, "ops").unwrap();
        }
        for i in 0..10 {
            let id = format!("o/{v}/{i}");
            let p = content(100 + i);
            objects.push((
                id.clone(),
                p.clone(),
                stream::encrypt_to_vec(&s.keyring, &k, &id, &p, &small()).unwrap(),
            ));
        }
    }
    // A cold keyring (another process) over the same records, counting KEK unwraps.
    let counting = Arc::new(CountingKek::new(s.kek.clone()));
    let cold = s.another(counting.clone());
    for _ in 0..2 {
        for (id, p, sealed) in &objects {
            assert_eq!(&decrypt(&cold, id, sealed).unwrap(), p);
        }
    }
    assert_eq!(
        counting.unwraps(),
        3,
        "one unwrap per key version, not per object"
    );
    let stats = cold.cache_stats();
    assert_eq!(stats.unwraps, 3);
    assert_eq!(stats.hits, 57);
    assert_eq!(stats.entries, 3);
    // Retiring evicts: a retired version is not served from the cache.
    cold.retire(&k, 1, "ops").unwrap();
    assert_eq!(cold.cache_stats().entries, 2);
    assert!(decrypt(&cold, &objects[0].0, &objects[0].2).is_err());
    assert_eq!(counting.unwraps.load(Ordering::SeqCst), 3);
}

#[test]
fn erasure_makes_all_three_versions_fail_with_the_date() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    let k = key("subject/alice");
    let other_subject = key("subject/bob");
    let dataset = key("dataset/shared");
    s.keyring
        .create(&k, KeyScope::Subject("alice@example.org".into()), "ops")
        .unwrap();
    s.keyring
        .create(
            &other_subject,
            KeyScope::Subject("bob@example.org".into()),
            "ops",
        )
        .unwrap();
    s.keyring
        .create(&dataset, KeyScope::Dataset, "ops")
        .unwrap();
    let mut sealed = Vec::new();
    for v in 1..=3 {
        if v > 1 {
            s.clock.advance(30 * DAY as i64);
            s.keyring.rotate(&k, "ops").unwrap();
        }
        let id = format!("alice/{v}");
        let o = stream::encrypt_to_vec(&s.keyring, &k, &id, &content(2000), &small()).unwrap();
        assert_eq!(probity_keys::Header::parse(&o).unwrap().0.wrap_version(), v);
        sealed.push((id, o));
    }
    let bob = stream::encrypt_to_vec(&s.keyring, &other_subject, "bob/1", b"b", &small()).unwrap();
    let label = subject_kek_label("alice@example.org");
    let kek_file = dir.path().join("kek").join(format!("{label}.kek"));
    assert!(kek_file.exists());

    s.clock.advance(DAY as i64);
    let record = s
        .keyring
        .erase(
            "alice@example.org",
            "dpo@example.org",
            sealed.iter().map(|(id, _)| id.clone()).collect(),
        )
        .unwrap();
    assert_eq!(record.subject, "alice@example.org");
    assert_eq!(record.erased_by, "dpo@example.org");
    assert_eq!(record.erased_at, Timestamp::now(&*s.clock));
    assert_eq!(record.keys.len(), 1);
    assert_eq!(record.keys[0].key, k);
    assert_eq!(record.keys[0].versions, vec![1, 2, 3]);
    assert_eq!(record.kek_labels, vec![label.clone()]);
    assert_eq!(record.objects, vec!["alice/1", "alice/2", "alice/3"]);
    assert!(record.kek.summary.contains(SOFTWARE_KEK_NOTICE));
    assert!(!kek_file.exists(), "the subject's KEK file is deleted");
    // The wrapped data keys are gone from the metadata too.
    let raw = String::from_utf8(s.store.raw(&k).unwrap()).unwrap();
    assert!(!raw.contains("\"wrapped\":\""), "{raw}");

    let date = Timestamp::now(&*s.clock).date();
    for keyring in [&s.keyring, &s.another(s.kek.clone())] {
        for (id, o) in &sealed {
            let err = key_err(decrypt(keyring, id, o).unwrap_err());
            assert!(matches!(err, KeyError::Erased { .. }), "{err:?}");
            assert!(err.is_shredded());
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("was erased on {date} by dpo@example.org")),
                "{msg}"
            );
            assert!(msg.contains("alice@example.org"), "{msg}");
        }
    }
    // Even with the old wrapped data keys (from a backup of the metadata), the KEK is gone.
    assert!(matches!(
        s.kek.unwrap(&label, &[0u8; 40]),
        Err(KekError::KekNotFound { .. })
    ));
    assert!(matches!(
        s.keyring.rotate(&k, "ops"),
        Err(KeyError::Erased { .. })
    ));
    assert!(matches!(
        s.keyring.erase("alice@example.org", "dpo", vec![]),
        Err(KeyError::AlreadyErased { .. })
    ));
    assert!(matches!(
        s.keyring.erase("carol@example.org", "dpo", vec![]),
        Err(KeyError::UnknownSubject { .. })
    ));
    // Other subjects and datasets are untouched.
    assert_eq!(decrypt(&s.keyring, "bob/1", &bob).unwrap(), b"b");
    let st = s.keyring.key_status(&k).unwrap();
    assert!(st.erased.is_some());
    assert!(
        st.versions
            .iter()
            .all(|v| v.state == VersionState::Destroyed && !v.decrypts)
    );
}
