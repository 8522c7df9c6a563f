//! The PKCS#11 KEK provider against SoftHSM2: end to end (create, encrypt, rotate at 90 days
//! on an injected clock, decrypt old and new, rewrap, erase), the KEK's attributes as
//! `pkcs11-tool` (opensc) lists them, refusal of pre-provisioned KEKs that are extractable or
//! imported, PIN, token and KEK errors, wrapped keys that do not unwrap, and agreement of
//! the token's `CKM_AES_KEY_WRAP_PAD` with RFC 5649 vectors from python3-cryptography.
//!
//! Each test runs in a child process of this test binary with `SOFTHSM2_CONF` pointing at a
//! throwaway token directory: `C_Initialize` reads the configuration once per process, and
//! the library code never initializes (the test, as the engine will, does it once per
//! process). They fail, never skip, when SoftHSM2 or opensc is missing.

use std::fs;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::mechanism::Mechanism;
use cryptoki::object::{Attribute, KeyType, ObjectClass};
use cryptoki::session::UserType;
use cryptoki::types::AuthPin;
use probity_keys::stream::EncryptOptions;
use probity_keys::{
    DataKey, DecryptOptions, KekError, KekProvider, KeyError, KeyMetaStore as _, KeyScope, Pin,
    PinError, Pkcs11Kek, StreamError, Timestamp, decrypt_file, encrypt_file, rewrap_file,
    subject_kek_label,
};

use crate::common::{CountingKek, DAY, Setup, content, hex, key};

const MODULE: &str = "/usr/lib/softhsm/libsofthsm2.so";
const CHILD_ENV: &str = "PROBITY_KEYS_TEST_SOFTHSM_DIR";

/// A throwaway SoftHSM2 token, as seen from inside the child process.
pub struct Hsm {
    token: String,
    pin: String,
}

impl Hsm {
    fn pin(&self) -> Pin {
        Pin::new(self.pin.clone())
    }

    fn pkcs11_tool(&self, args: &[&str]) -> String {
        let out = Command::new("pkcs11-tool")
            .args(["--module", MODULE, "--token-label", &self.token])
            .args(["--login", "--pin", &self.pin])
            .args(args)
            .output()
            .expect("pkcs11-tool must be installed: apt-get install -y opensc");
        assert!(
            out.status.success(),
            "pkcs11-tool {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

/// The process's one initialized PKCS#11 context (the child runs one test).
fn pkcs11() -> Pkcs11 {
    static CTX: OnceLock<Pkcs11> = OnceLock::new();
    CTX.get_or_init(|| {
        let ctx = Pkcs11::new(MODULE).unwrap();
        ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK))
            .unwrap();
        ctx
    })
    .clone()
}

/// Runs `body` against a fresh SoftHSM2 token: in the parent, creates the token and re-runs
/// test `name` alone in a child process with `SOFTHSM2_CONF` set; in that child, runs `body`.
fn with_softhsm(name: &str, body: impl FnOnce(&Hsm, &Path)) {
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        let dir = PathBuf::from(dir);
        let hsm = Hsm {
            token: fs::read_to_string(dir.join("token.label")).unwrap(),
            pin: fs::read_to_string(dir.join("user.pin")).unwrap(),
        };
        let work = dir.join("work");
        fs::create_dir_all(&work).unwrap();
        body(&hsm, &work);
        return;
    }
    assert!(
        Path::new(MODULE).exists(),
        "SoftHSM2 is not installed ({MODULE} is missing): apt-get install -y softhsm2 opensc"
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    fs::create_dir_all(dir.join("tokens")).unwrap();
    let conf = dir.join("softhsm2.conf");
    fs::write(
        &conf,
        format!(
            "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
            dir.join("tokens").display()
        ),
    )
    .unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let label = format!("probity-keys-{}-{nanos}", std::process::id() % 100_000);
    let pin = format!("{:08x}", nanos ^ 0x5a5a_5a5a);
    fs::write(dir.join("token.label"), &label).unwrap();
    fs::write(dir.join("user.pin"), &pin).unwrap();
    let init = Command::new("softhsm2-util")
        .args(["--init-token", "--free", "--label", &label])
        .args(["--so-pin", "so-secret-1234", "--pin", &pin])
        .env("SOFTHSM2_CONF", &conf)
        .output()
        .expect("softhsm2-util must be installed: apt-get install -y softhsm2 opensc");
    assert!(
        init.status.success(),
        "softhsm2-util --init-token failed: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("SOFTHSM2_CONF", &conf)
        .env(CHILD_ENV, dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "SoftHSM2 child run of {name} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
}

fn threads(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

#[test]
fn softhsm_end_to_end() {
    with_softhsm("softhsm::softhsm_end_to_end", |hsm, dir| {
        let kek: Arc<dyn KekProvider> =
            Arc::new(Pkcs11Kek::open(&pkcs11(), &hsm.token, &hsm.pin()).unwrap());
        let d = kek.describe();
        assert!(d.is_hsm(), "{d}");
        assert!(d.summary.contains(&hsm.token), "{d}");
        let s = Setup::with_kek(kek.clone());
        let data = key("dataset/weights");
        let alice = key("subject/alice");
        s.keyring.create(&data, KeyScope::Dataset, "ops").unwrap();
        s.keyring
            .create(&alice, KeyScope::Subject("alice@example.org".into()), "ops")
            .unwrap();
        let enc_opts = EncryptOptions {
            segment_size: 64 * 1024,
            threads: threads(2),
            ..EncryptOptions::default()
        };
        let dec = DecryptOptions {
            threads: threads(2),
        };
        let mut objects: Vec<(String, PathBuf, Vec<u8>)> = Vec::new();
        let mut encrypt = |k: &probity_keys::KeyId, id: &str, len: usize| {
            let plain = content(len);
            let p = dir.join(format!("{}.plain", id.replace('/', "_")));
            let e = dir.join(format!("{}.enc", id.replace('/', "_")));
            fs::write(&p, &plain).unwrap();
            encrypt_file(&s.keyring, k, id, &p, &e, &enc_opts).unwrap();
            objects.push((id.to_owned(), e, plain));
        };
        encrypt(&data, "weights/1", 300_000);
        encrypt(&alice, "alice/1", 70_000);

        // 90 days later the engine's rule (age >= 90 days) rotates both keys.
        s.clock.advance(90 * DAY as i64);
        for k in [&data, &alice] {
            let st = s.keyring.key_status(k).unwrap();
            assert!(st.age(Timestamp::now(&*s.clock)) >= Duration::from_secs(90 * DAY));
            assert_eq!(s.keyring.rotate(k, "probity-engine").unwrap().primary, 2);
        }
        encrypt(&data, "weights/2", 1);
        encrypt(&alice, "alice/2", 0);
        s.keyring.rotate(&alice, "probity-engine").unwrap();
        encrypt(&alice, "alice/3", 65_537);

        // Old and new decrypt; then weights/1 is rewrapped to v2.
        for (id, e, plain) in &objects {
            let out = dir.join("out");
            decrypt_file(&s.keyring, id, e, &out, &dec).unwrap();
            assert_eq!(&fs::read(&out).unwrap(), plain, "{id}");
        }
        let r = rewrap_file(&s.keyring, "weights/1", &objects[0].1).unwrap();
        assert_eq!((r.from_version, r.to_version, r.rewritten), (1, 2, true));
        s.keyring.retire(&data, 1, "ops").unwrap();

        // A cold keyring (another process) pays one HSM unwrap per key version in use:
        // dataset v2, alice v1..v3.
        let counting = Arc::new(CountingKek::new(kek.clone()));
        let cold = s.another(counting.clone());
        for _ in 0..3 {
            for (id, e, plain) in &objects {
                let out = dir.join("out");
                decrypt_file(&cold, id, e, &out, &dec).unwrap();
                assert_eq!(&fs::read(&out).unwrap(), plain, "{id}");
            }
        }
        assert_eq!(counting.unwraps(), 4);

        // Erase alice: her KEK is destroyed in the token; her three versions fail, dated.
        let label = subject_kek_label("alice@example.org");
        assert!(
            hsm.pkcs11_tool(&["--list-objects", "--type", "secrkey"])
                .contains(&label)
        );
        s.clock.advance(DAY as i64);
        let erased = s
            .keyring
            .erase(
                "alice@example.org",
                "dpo@example.org",
                vec!["alice/1".into()],
            )
            .unwrap();
        assert_eq!(erased.keys[0].versions, vec![1, 2, 3]);
        assert!(erased.kek.summary.contains("PKCS#11 token"));
        assert!(!kek.kek_exists(&label).unwrap());
        assert!(
            !hsm.pkcs11_tool(&["--list-objects", "--type", "secrkey"])
                .contains(&label)
        );
        let date = Timestamp::now(&*s.clock).date();
        for (id, e, _) in objects.iter().filter(|(id, _, _)| id.starts_with("alice/")) {
            for keyring in [&s.keyring, &cold] {
                let err = decrypt_file(keyring, id, e, &dir.join("out"), &dec).unwrap_err();
                assert!(
                    matches!(err, StreamError::Key(KeyError::Erased { .. })),
                    "{id}: {err:?}"
                );
                assert!(
                    err.to_string().contains(&format!("erased on {date}")),
                    "{err}"
                );
            }
        }
        // The dataset is untouched.
        let (id, e, plain) = objects.iter().find(|(id, _, _)| id == "weights/2").unwrap();
        decrypt_file(&s.keyring, id, e, &dir.join("out"), &dec).unwrap();
        assert_eq!(&fs::read(dir.join("out")).unwrap(), plain);
    });
}

#[test]
fn softhsm_kek_is_sensitive_and_non_extractable_per_pkcs11_tool() {
    with_softhsm(
        "softhsm::softhsm_kek_is_sensitive_and_non_extractable_per_pkcs11_tool",
        |hsm, _| {
            let kek = Pkcs11Kek::open(&pkcs11(), &hsm.token, &hsm.pin()).unwrap();
            kek.generate_kek("probity-test-kek").unwrap();
            assert!(matches!(
                kek.generate_kek("probity-test-kek"),
                Err(KekError::KekExists { .. })
            ));
            let listing = hsm.pkcs11_tool(&["--list-objects", "--type", "secrkey"]);
            let block: Vec<&str> = listing
                .split("Secret Key Object")
                .filter(|b| b.contains("label:      probity-test-kek\n"))
                .collect();
            assert_eq!(block.len(), 1, "{listing}");
            let block = block[0];
            assert!(block.contains("AES length 32"), "{block}");
            assert!(block.contains("Usage:      wrap, unwrap"), "{block}");
            assert!(
                block.contains("Access:     sensitive, always sensitive, never extractable, local"),
                "{block}"
            );
            assert!(
                !block.contains("VALUE:"),
                "the key value must not be readable: {block}"
            );
        },
    );
}

#[test]
fn softhsm_refuses_preprovisioned_extractable_or_imported_kek() {
    with_softhsm(
        "softhsm::softhsm_refuses_preprovisioned_extractable_or_imported_kek",
        |hsm, dir| {
            // An operator made these with the right labels, but wrongly.
            hsm.pkcs11_tool(&[
                "--keygen",
                "--key-type",
                "AES:32",
                "--label",
                "kek-extractable",
                "--extractable",
            ]);
            hsm.pkcs11_tool(&[
                "--keygen",
                "--key-type",
                "AES:32",
                "--label",
                "kek-not-sensitive",
            ]);
            let raw = dir.join("raw.key");
            fs::write(&raw, [7u8; 32]).unwrap();
            hsm.pkcs11_tool(&[
                "--write-object",
                raw.to_str().unwrap(),
                "--type",
                "secrkey",
                "--key-type",
                "AES:32",
                "--label",
                "kek-imported",
                "--sensitive",
            ]);
            let kek = Pkcs11Kek::open(&pkcs11(), &hsm.token, &hsm.pin()).unwrap();
            let refused = |label: &str| match kek.ensure_kek(label) {
                Err(e @ KekError::KekAttribute { .. }) => e,
                other => panic!("{label}: {other:?}"),
            };
            for (label, attribute) in [
                ("kek-extractable", "CKA_SENSITIVE"),
                ("kek-not-sensitive", "CKA_SENSITIVE"),
                ("kek-imported", "CKA_LOCAL"),
            ] {
                let err = refused(label);
                assert!(
                    matches!(&err, KekError::KekAttribute { attribute: a, .. } if *a == attribute),
                    "{label}: {err}"
                );
                assert!(err.to_string().contains(attribute), "{err}");
                // Nor is it used to wrap or unwrap.
                assert!(matches!(
                    kek.wrap(label, &DataKey::from_bytes([1; 32])),
                    Err(KekError::KekAttribute { .. })
                ));
            }
            // A sensitive but extractable key names CKA_EXTRACTABLE.
            hsm.pkcs11_tool(&[
                "--keygen",
                "--key-type",
                "AES:32",
                "--label",
                "kek-sens-extr",
                "--sensitive",
                "--extractable",
            ]);
            let err = refused("kek-sens-extr");
            assert!(
                matches!(
                    err,
                    KekError::KekAttribute {
                        attribute: "CKA_EXTRACTABLE",
                        ..
                    }
                ),
                "{err}"
            );
            // Through the keyring, a dataset key cannot be created on such a KEK.
            let s = Setup::with_kek(Arc::new(kek));
            let keyring = probity_keys::Keyring::new(
                s.store.clone(),
                s.kek.clone(),
                s.clock.clone(),
                probity_keys::KeyringOptions {
                    dataset_kek_label: "kek-imported".into(),
                    ..Default::default()
                },
            );
            let err = keyring
                .create(&key("dataset/x"), KeyScope::Dataset, "ops")
                .unwrap_err();
            assert!(
                matches!(&err, KeyError::Kek { source, .. }
                    if matches!(**source, KekError::KekAttribute { .. })),
                "{err:?}"
            );
            assert!(s.store.load(&key("dataset/x")).unwrap().is_none());
        },
    );
}

#[test]
fn softhsm_pin_token_and_kek_errors_are_distinct() {
    with_softhsm(
        "softhsm::softhsm_pin_token_and_kek_errors_are_distinct",
        |hsm, _| {
            let ctx = pkcs11();
            // Wrong PIN first: login state is per process and token.
            let err =
                Pkcs11Kek::open(&ctx, &hsm.token, &Pin::new("not-the-pin".into())).unwrap_err();
            assert!(matches!(err, KekError::WrongPin { .. }), "{err:?}");
            assert!(!err.to_string().contains("not-the-pin"));
            let err = Pkcs11Kek::open(&ctx, &hsm.token, &Pin::new(String::new())).unwrap_err();
            assert!(matches!(err, KekError::PinMissing { .. }), "{err:?}");
            assert!(matches!(
                Pin::from_env("PROBITY_KEYS_TEST_UNSET_PIN"),
                Err(PinError::EnvMissing { .. })
            ));
            let err = Pkcs11Kek::open(&ctx, "no-such-token", &hsm.pin()).unwrap_err();
            assert!(matches!(err, KekError::TokenNotFound { .. }), "{err:?}");
            let kek = Pkcs11Kek::open(&ctx, &hsm.token, &hsm.pin()).unwrap();
            assert!(!format!("{kek:?}").contains(&hsm.pin));
            let err = kek.unwrap("kek-absent", &[0u8; 40]).unwrap_err();
            assert!(matches!(err, KekError::KekNotFound { .. }), "{err:?}");
            assert!(err.to_string().contains("kek-absent"), "{err}");
            assert!(matches!(
                kek.destroy_kek("kek-absent"),
                Err(KekError::KekNotFound { .. })
            ));
        },
    );
}

#[test]
fn softhsm_wrapped_key_that_does_not_unwrap() {
    with_softhsm(
        "softhsm::softhsm_wrapped_key_that_does_not_unwrap",
        |hsm, _| {
            let kek = Pkcs11Kek::open(&pkcs11(), &hsm.token, &hsm.pin()).unwrap();
            kek.generate_kek("kek-a").unwrap();
            kek.generate_kek("kek-b").unwrap();
            let data = DataKey::from_bytes([0x5c; 32]);
            let wrapped = kek.wrap("kek-a", &data).unwrap();
            assert_eq!(wrapped.len(), 40);
            assert_eq!(
                kek.unwrap("kek-a", &wrapped).unwrap().expose(),
                data.expose()
            );
            let mut bad = wrapped.clone();
            bad[9] ^= 1;
            for (label, bytes) in [
                ("kek-a", bad.as_slice()),
                ("kek-b", wrapped.as_slice()),
                ("kek-a", &wrapped[..24]),
            ] {
                let err = kek.unwrap(label, bytes).unwrap_err();
                assert!(
                    matches!(err, KekError::UnwrapRejected { .. }),
                    "{label}: {err:?}"
                );
            }
            // The session is still usable afterwards.
            assert_eq!(
                kek.unwrap("kek-a", &wrapped).unwrap().expose(),
                data.expose()
            );
        },
    );
}

#[test]
fn softhsm_key_wrap_pad_matches_rfc5649_vectors() {
    with_softhsm(
        "softhsm::softhsm_key_wrap_pad_matches_rfc5649_vectors",
        |hsm, _| {
            // Raw cryptoki, outside the provider: an imported (test-only) KEK of known value.
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../testdata/keys/vectors.json"
            );
            let all: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
            let ctx = pkcs11();
            let slot = ctx
                .get_slots_with_token()
                .unwrap()
                .into_iter()
                .find(|s| ctx.get_token_info(*s).unwrap().label().trim_end() == hsm.token)
                .unwrap();
            let session = ctx.open_rw_session(slot).unwrap();
            session
                .login(UserType::User, Some(&AuthPin::from(hsm.pin.clone())))
                .unwrap();
            for v in all["kwp"].as_array().unwrap() {
                let secret = |bytes: Vec<u8>, wrap: bool| {
                    session
                        .create_object(&[
                            Attribute::Class(ObjectClass::SECRET_KEY),
                            Attribute::KeyType(KeyType::AES),
                            Attribute::Token(false),
                            Attribute::Extractable(true),
                            Attribute::Sensitive(false),
                            Attribute::Wrap(wrap),
                            Attribute::Value(bytes),
                        ])
                        .unwrap()
                };
                let kek = secret(hex(v["kek"].as_str().unwrap()), true);
                let data = secret(hex(v["key"].as_str().unwrap()), false);
                let wrapped = session
                    .wrap_key(&Mechanism::AesKeyWrapPad, kek, data)
                    .unwrap();
                assert_eq!(wrapped, hex(v["wrapped"].as_str().unwrap()));
            }
        },
    );
}
