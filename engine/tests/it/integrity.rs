//! Integrity through the public API: sealing and verification with a software anchor and a
//! SoftHSM2 token, every tamper case, rollback, edge sizes, codec robustness, and interop with
//! `pkcs11-tool` and `sha256sum`.
//!
//! SoftHSM2 tests each run in a child process of this test binary with `SOFTHSM2_CONF`
//! pointing at a throwaway token directory (the configuration is read once per process, at
//! `C_Initialize`, and setting the environment in-process would need `unsafe`). They fail,
//! never skip, when SoftHSM2 is not installed.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "test helpers as well as tests: a panic is a failed test, as clippy.toml allows in #[test]s"
)]

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use probity::integrity::{
    self, Anchor, AnchorError, HashOptions, IntegrityError, Manifest, Pin, Pkcs11Anchor,
    Pkcs11Config, SignedManifest, SoftwareAnchor, VerifiedReader, Verifier, VerifyOptions,
};
use probity::state::StateStore;

/// SHA-256 of `data`, as the manifests hash chunks.
fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(data).into()
}

const MODULE: &str = "/usr/lib/softhsm/libsofthsm2.so";
const CS: u32 = 4096;
const CHILD_ENV: &str = "PROBITY_TEST_SOFTHSM_DIR";
const PIN_ENV: &str = "PROBITY_TEST_SOFTHSM_PIN";
const KEY: &str = "probity-it-key";

fn opts() -> HashOptions<'static> {
    HashOptions {
        chunk_size: CS,
        ..HashOptions::default()
    }
}

/// Deterministic, chunk-distinct content.
fn content(len: u64) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn write_object(dir: &Path, name: &str, len: u64) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, content(len)).unwrap();
    path
}

fn integrity_err(e: &io::Error) -> &IntegrityError {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<IntegrityError>())
        .unwrap_or_else(|| panic!("not an integrity error: {e}"))
}

// ---------------------------------------------------------------- SoftHSM2 harness

/// A throwaway SoftHSM2 token, as seen from inside the child process.
pub(crate) struct Hsm {
    token: String,
    pin_file: PathBuf,
}

impl Hsm {
    pub(crate) fn config(&self, key: &str) -> Pkcs11Config {
        Pkcs11Config::new(
            MODULE,
            self.token.clone(),
            key,
            Pin::from_file(&self.pin_file).unwrap(),
        )
    }
    fn pin(&self) -> String {
        fs::read_to_string(&self.pin_file)
            .unwrap()
            .trim()
            .to_owned()
    }
}

/// Runs `body` against a fresh SoftHSM2 token: in the parent, creates the token and re-runs
/// test `name` alone in a child process with `SOFTHSM2_CONF` set; in that child, runs `body`.
pub(crate) fn with_softhsm(name: &str, body: impl FnOnce(&Hsm, &Path)) {
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        let dir = PathBuf::from(dir);
        let hsm = Hsm {
            token: fs::read_to_string(dir.join("token.label")).unwrap(),
            pin_file: dir.join("user.pin"),
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
    let label = format!("probity-it-{}-{nanos}", std::process::id());
    let pin = format!("{:08x}", nanos ^ 0x5a5a_5a5a);
    fs::write(dir.join("token.label"), &label).unwrap();
    fs::write(dir.join("user.pin"), format!("{pin}\n")).unwrap();
    // A PIN file others can read is refused (trust.rs).
    {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(dir.join("user.pin"), fs::Permissions::from_mode(0o600)).unwrap();
    }
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
        .env(PIN_ENV, &pin)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "SoftHSM2 child run of {name} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
}

// ---------------------------------------------------------------- the tamper suite

/// Seals a 10½-chunk object with `anchor`, then checks every tamper case is caught and
/// reported by its own variant, by `verify_object` and by `VerifiedReader`.
fn tamper_suite(anchor: &dyn Anchor, other: &dyn Anchor, dir: &Path) {
    let verifier = Verifier::new(anchor.public_key().clone());
    let size = 10 * u64::from(CS) + 100;
    let original = content(size);
    let path = dir.join("object.bin");
    fs::write(&path, &original).unwrap();
    let sealer = StateStore::open(&dir.join("sealer")).unwrap();
    let signed =
        integrity::SignedManifest::seal(&path, "suite/object", 1, anchor, &sealer, &opts())
            .unwrap();
    let signed = SignedManifest::decode(&signed.encode()).unwrap();
    assert_eq!(signed.manifest().chunk_count(), 11);

    let mut case = 0;
    let mut fresh_node = || {
        case += 1;
        StateStore::open(&dir.join(format!("node-{case}"))).unwrap()
    };
    let verify = |store: &StateStore, node: Option<&str>| {
        let options = VerifyOptions {
            node,
            ..VerifyOptions::default()
        };
        verifier.verify_object(&path, &signed, store, &options)
    };
    let restore = || fs::write(&path, &original).unwrap();

    // Intact: verifies, and the reader returns the exact bytes.
    let store = fresh_node();
    let report = verify(&store, None).unwrap();
    assert_eq!((report.size, report.chunks, report.version), (size, 11, 1));
    assert!(report.newly_accepted);
    let mut reader =
        VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store).unwrap();
    let mut all = Vec::new();
    reader.read_to_end(&mut all).unwrap();
    assert_eq!(all, original);

    // A flipped bit anywhere: the chunk index and its offset.
    for at in [0, 3 * u64::from(CS) + 17, 10 * u64::from(CS), size - 1] {
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        let byte = original[at as usize] ^ 0x10;
        f.write_all_at(&[byte], at).unwrap();
        let index = at / u64::from(CS);
        let store = fresh_node();
        let err = verify(&store, Some("gpu-node-7")).unwrap_err();
        match err {
            IntegrityError::ChunkMismatch {
                index: i, offset, ..
            } => assert_eq!((i, offset), (index, index * u64::from(CS)), "flip at {at}"),
            other => panic!("flip at {at}: {other:?}"),
        }
        let events = store.events(0).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, "chunk-mismatch");
        assert_eq!(events[0].node.as_deref(), Some("gpu-node-7"));
        assert!(store.blocked("gpu-node-7").unwrap().is_some());
        assert!(store.registry_entry("suite/object").unwrap().is_none());

        // The reader hands out every byte before the bad chunk, none of it, then refuses.
        let mut reader =
            VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store)
                .unwrap();
        let mut got = 0u64;
        let mut buf = [0u8; 1000];
        let err = loop {
            match reader.read(&mut buf) {
                Ok(0) => panic!("reader returned all bytes despite flip at {at}"),
                Ok(n) => got += n as u64,
                Err(e) => break e,
            }
        };
        assert_eq!(got, index * u64::from(CS));
        assert!(matches!(
            integrity_err(&err),
            IntegrityError::ChunkMismatch { index: i, .. } if *i == index
        ));
        assert_eq!(reader.failure().unwrap().0, index);
        let again = reader.read(&mut buf).unwrap_err();
        assert!(matches!(
            integrity_err(&again),
            IntegrityError::Poisoned { .. }
        ));
        restore();
    }

    // Random access verifies only what it touches.
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[original[100] ^ 1], 100).unwrap();
    let store = fresh_node();
    let mut reader =
        VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store).unwrap();
    let start = 7 * u64::from(CS) + 5;
    reader.seek(SeekFrom::Start(start)).unwrap();
    let mut buf = vec![0u8; 2 * CS as usize];
    reader.read_exact(&mut buf).unwrap();
    assert_eq!(buf, original[start as usize..start as usize + buf.len()]);
    reader.seek(SeekFrom::End(-3)).unwrap();
    let mut tail = [0u8; 3];
    reader.read_exact(&mut tail).unwrap();
    assert_eq!(tail, original[size as usize - 3..]);
    reader.seek(SeekFrom::Start(0)).unwrap();
    assert!(reader.read(&mut buf).is_err());
    restore();

    // Truncation: the first short chunk and where the data ends.
    for len in [size - 1, 5 * u64::from(CS), 0] {
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len).unwrap();
        let store = fresh_node();
        match verify(&store, Some("n")).unwrap_err() {
            IntegrityError::Truncated {
                index,
                offset,
                actual,
                expected,
                ..
            } => {
                assert_eq!((index, offset), (len / u64::from(CS), len));
                assert_eq!((actual, expected), (len, size));
            }
            other => panic!("truncate to {len}: {other:?}"),
        }
        assert_eq!(store.events(0).unwrap()[0].kind, "truncated");
        assert!(store.blocked("n").unwrap().is_some());
        let r = VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store);
        assert!(matches!(r, Err(IntegrityError::Truncated { .. })));
        restore();
    }

    // Extension.
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(b"x").unwrap();
    match verify(&fresh_node(), None).unwrap_err() {
        IntegrityError::Extended { offset, actual, .. } => {
            assert_eq!((offset, actual), (size, size + 1))
        }
        other => panic!("extension: {other:?}"),
    }
    restore();

    // Reordered chunks: swap chunks 1 and 2.
    let mut swapped = original.clone();
    let c = CS as usize;
    swapped[c..2 * c].copy_from_slice(&original[2 * c..3 * c]);
    swapped[2 * c..3 * c].copy_from_slice(&original[c..2 * c]);
    fs::write(&path, &swapped).unwrap();
    match verify(&fresh_node(), None).unwrap_err() {
        IntegrityError::ChunkReordered {
            index,
            offset,
            found_chunk,
            ..
        } => assert_eq!((index, offset, found_chunk), (1, u64::from(CS), 2)),
        other => panic!("reorder: {other:?}"),
    }
    let store = fresh_node();
    let mut reader =
        VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store).unwrap();
    reader.seek(SeekFrom::Start(u64::from(CS))).unwrap();
    let err = reader.read(&mut [0u8; 10]).unwrap_err();
    assert!(matches!(
        integrity_err(&err),
        IntegrityError::ChunkReordered {
            index: 1,
            found_chunk: 2,
            ..
        }
    ));
    restore();

    // A manifest signed by another key.
    let foreign = integrity::SignedManifest::seal(
        &path,
        "suite/object",
        1,
        other,
        &StateStore::open(&dir.join("foreign-sealer")).unwrap(),
        &opts(),
    )
    .unwrap();
    let store = fresh_node();
    let err = verifier
        .verify_object(&path, &foreign, &store, &VerifyOptions::default())
        .unwrap_err();
    assert!(matches!(err, IntegrityError::WrongKey { .. }), "{err:?}");
    assert_eq!(store.events(0).unwrap()[0].kind, "wrong-key");
    let r = VerifiedReader::new(fs::File::open(&path).unwrap(), &foreign, &verifier, &store);
    assert!(matches!(r, Err(IntegrityError::WrongKey { .. })));

    // A validly signed manifest of another object, substituted: refused when the caller says
    // which object it expects.
    let substitute =
        integrity::SignedManifest::seal(&path, "suite/impostor", 1, anchor, &sealer, &opts())
            .unwrap();
    let options = VerifyOptions {
        expected_object_id: Some("suite/object"),
        ..VerifyOptions::default()
    };
    let err = verifier
        .verify_object(&path, &substitute, &fresh_node(), &options)
        .unwrap_err();
    assert!(
        matches!(err, IntegrityError::ObjectMismatch { .. }),
        "{err:?}"
    );

    // An edited manifest keeping the signature: a valid encoding, a different digest.
    let m = signed.manifest();
    for edited in [
        Manifest::new(
            m.object_id(),
            2,
            m.size(),
            m.chunk_size(),
            m.leaves().to_vec(),
        )
        .unwrap(),
        Manifest::new(
            "suite/other",
            1,
            m.size(),
            m.chunk_size(),
            m.leaves().to_vec(),
        )
        .unwrap(),
        {
            let mut leaves = m.leaves().to_vec();
            leaves[4] = sha256(b"attacker chunk");
            Manifest::new(m.object_id(), 1, m.size(), m.chunk_size(), leaves).unwrap()
        },
    ] {
        let forged = SignedManifest::new(edited, signed.signature().clone(), signed.key_id());
        let err = verifier
            .verify_object(&path, &forged, &fresh_node(), &VerifyOptions::default())
            .unwrap_err();
        assert!(
            matches!(err, IntegrityError::BadSignature { .. }),
            "{err:?}"
        );
    }
    // An edited manifest at the byte level: the strict decoder already refuses it.
    let mut bytes = signed.encode();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    assert!(SignedManifest::decode(&bytes).is_err());

    // Rollback: v2 sealed and accepted, then v1 offered again.
    let v2 = integrity::SignedManifest::seal(&path, "suite/object", 2, anchor, &sealer, &opts())
        .unwrap();
    let store = fresh_node();
    let report = verifier
        .verify_object(&path, &v2, &store, &VerifyOptions::default())
        .unwrap();
    assert_eq!(report.version, 2);
    match verify(&store, None).unwrap_err() {
        IntegrityError::Rollback {
            offered, accepted, ..
        } => assert_eq!((offered, accepted), (1, 2)),
        other => panic!("rollback: {other:?}"),
    }
    assert_eq!(store.events(0).unwrap()[0].kind, "rollback");
    let r = VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store);
    assert!(matches!(r, Err(IntegrityError::Rollback { .. })));
    let err = integrity::SignedManifest::seal(&path, "suite/object", 1, anchor, &sealer, &opts())
        .unwrap_err();
    assert!(matches!(err, IntegrityError::Rollback { .. }), "{err:?}");
    // Re-verifying the accepted version is fine and not "new".
    let again = verifier
        .verify_object(&path, &v2, &store, &VerifyOptions::default())
        .unwrap();
    assert!(!again.newly_accepted);

    // Same version, different content: a version conflict.
    let other_path = write_object(dir, "other.bin", 3000);
    let conflicting = integrity::SignedManifest::seal(
        &other_path,
        "suite/object",
        2,
        anchor,
        &StateStore::open(&dir.join("second-sealer")).unwrap(),
        &opts(),
    );
    // (An HSM anchor refuses already: the token holds the other digest for suite/object@2.)
    if let Ok(conflicting) = conflicting {
        let err = verifier
            .verify_object(&other_path, &conflicting, &store, &VerifyOptions::default())
            .unwrap_err();
        assert!(
            matches!(err, IntegrityError::VersionConflict { .. }),
            "{err:?}"
        );
    } else if let Err(e) = conflicting {
        assert!(
            matches!(
                e,
                IntegrityError::Anchor {
                    source: AnchorError::DigestConflict { .. },
                    ..
                }
            ),
            "{e:?}"
        );
    }
}

// ---------------------------------------------------------------- software anchor

fn software_anchors(dir: &Path) -> (SoftwareAnchor, SoftwareAnchor) {
    (
        SoftwareAnchor::generate(&dir.join("anchor.key")).unwrap(),
        SoftwareAnchor::generate(&dir.join("other.key")).unwrap(),
    )
}

#[test]
fn software_anchor_every_tamper_case() {
    let dir = tempfile::tempdir().unwrap();
    let (anchor, other) = software_anchors(dir.path());
    let d = anchor.describe();
    assert!(!d.is_hsm());
    assert!(d.to_string().starts_with("software anchor (not an HSM)"));
    tamper_suite(&anchor, &other, dir.path());
}

#[test]
fn zero_byte_object() {
    let dir = tempfile::tempdir().unwrap();
    let (anchor, _) = software_anchors(dir.path());
    let path = write_object(dir.path(), "empty", 0);
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let signed = integrity::SignedManifest::seal(
        &path,
        "empty",
        1,
        &anchor,
        &store,
        &HashOptions::default(),
    )
    .unwrap();
    assert_eq!(signed.manifest().chunk_count(), 0);
    assert_eq!(signed.manifest().root(), &sha256(b""));
    let verifier = Verifier::new(anchor.public_key().clone());
    let node = StateStore::open(&dir.path().join("node")).unwrap();
    let report = verifier
        .verify_object(&path, &signed, &node, &VerifyOptions::default())
        .unwrap();
    assert_eq!((report.size, report.chunks), (0, 0));
    let mut r =
        VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &node).unwrap();
    let mut out = Vec::new();
    assert_eq!(r.read_to_end(&mut out).unwrap(), 0);
    fs::write(&path, b"!").unwrap();
    let err = verifier
        .verify_object(&path, &signed, &node, &VerifyOptions::default())
        .unwrap_err();
    assert!(matches!(err, IntegrityError::Extended { offset: 0, .. }));
}

#[test]
fn thread_counts_and_sizes_agree() {
    let dir = tempfile::tempdir().unwrap();
    for size in [1, 1023, 1024, 1025, 4096 * 3, 4096 * 3 + 1, 100_000] {
        let path = write_object(dir.path(), "obj", size);
        let mut first = None;
        for threads in [1, 2, 5] {
            let o = HashOptions {
                chunk_size: 1024,
                threads: threads.try_into().unwrap(),
                progress: None,
            };
            let h = integrity::HashedObject::hash_file(&path, &o).unwrap();
            assert_eq!(h.size, size);
            assert_eq!(h.leaves.len() as u64, size.div_ceil(1024));
            match &first {
                None => first = Some(h.leaves),
                Some(f) => assert_eq!(f, &h.leaves, "size {size} threads {threads}"),
            }
        }
    }
}

#[test]
fn progress_hook_reports_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let (anchor, _) = software_anchors(dir.path());
    let path = write_object(dir.path(), "obj", 50_000);
    let max = AtomicU64::new(0);
    let calls = AtomicU64::new(0);
    let hook = |done: u64| {
        max.fetch_max(done, Ordering::Relaxed);
        calls.fetch_add(1, Ordering::Relaxed);
    };
    let o = HashOptions {
        chunk_size: 1024,
        progress: Some(&hook),
        ..HashOptions::default()
    };
    let store = StateStore::open(&dir.path().join("s")).unwrap();
    integrity::SignedManifest::seal(&path, "obj", 1, &anchor, &store, &o).unwrap();
    assert_eq!(max.load(Ordering::Relaxed), 50_000);
    // A bad chunk size or object id is refused before any hashing.
    for (id, chunk_size) in [("obj", 512), ("obj", 0), ("", 1024), ("a\u{7}b", 1024)] {
        let o = HashOptions {
            chunk_size,
            progress: Some(&hook),
            ..HashOptions::default()
        };
        let err = integrity::SignedManifest::seal(&path, id, 2, &anchor, &store, &o).unwrap_err();
        assert!(matches!(err, IntegrityError::Manifest { .. }), "{err:?}");
    }
    assert_eq!(calls.load(Ordering::Relaxed), 49);
}

#[test]
fn one_chunk_leaf_is_sha256sum_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_object(dir.path(), "small.bin", 3000);
    let h = integrity::HashedObject::hash_file(&path, &HashOptions::default()).unwrap();
    let out = Command::new("sha256sum").arg(&path).output().unwrap();
    let line = String::from_utf8(out.stdout).unwrap();
    let expected = line.split_whitespace().next().unwrap();
    assert_eq!(h.leaves.len(), 1);
    assert_eq!(hex::encode(h.leaves[0]), expected);
}

#[test]
fn over_4_gib_sparse_object() {
    // 64 MiB chunks: 64 full chunks of zeros below 4 GiB, one partial chunk above it.
    let cs: u32 = 64 * 1024 * 1024;
    let size: u64 = (4 << 30) + (3 << 20) + 5;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.img");
    fs::File::create(&path).unwrap().set_len(size).unwrap();
    let full = sha256(&vec![0u8; cs as usize]);
    let last_len = (size - 64 * u64::from(cs)) as usize;
    let mut leaves = vec![full; 64];
    leaves.push(sha256(&vec![0u8; last_len]));
    let manifest = Manifest::new("sparse", 1, size, cs, leaves).unwrap();
    assert_eq!(
        manifest.chunk_count(),
        integrity::Manifest::chunks_for(size, cs)
    );
    assert_eq!(manifest.chunk_offset(64), 4 << 30);
    let (anchor, _) = software_anchors(dir.path());
    let signed = SignedManifest::new(
        manifest.clone(),
        anchor.sign(&manifest.digest()).unwrap(),
        anchor.public_key().key_id(),
    );
    let signed = SignedManifest::decode(&signed.encode()).unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());
    let store = StateStore::open(&dir.path().join("node")).unwrap();

    // Seek past 4 GiB: only the last chunk is hashed.
    let mut r =
        VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store).unwrap();
    r.seek(SeekFrom::Start((4 << 30) + (1 << 20))).unwrap();
    let mut buf = [1u8; 16];
    r.read_exact(&mut buf).unwrap();
    assert_eq!(buf, [0u8; 16]);
    assert_eq!(r.seek(SeekFrom::End(-1)).unwrap(), size - 1);
    let mut one = [1u8; 1];
    r.read_exact(&mut one).unwrap();
    assert_eq!(r.read(&mut one).unwrap(), 0);

    // A byte changed above 4 GiB is caught, with a 64-bit offset.
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xff], (4 << 30) + (2 << 20)).unwrap();
    let mut r =
        VerifiedReader::new(fs::File::open(&path).unwrap(), &signed, &verifier, &store).unwrap();
    r.seek(SeekFrom::Start(size - 10)).unwrap();
    let err = r.read(&mut buf).unwrap_err();
    assert!(matches!(
        integrity_err(&err),
        IntegrityError::ChunkMismatch { index: 64, offset, .. } if *offset == 4 << 30
    ));

    // Size changes are caught before any hashing.
    f.set_len(size + 7).unwrap();
    let err = verifier
        .verify_object(&path, &signed, &store, &VerifyOptions::default())
        .unwrap_err();
    assert!(matches!(err, IntegrityError::Extended { offset, .. } if offset == size));
    f.set_len((4 << 30) + 1).unwrap();
    let err = verifier
        .verify_object(&path, &signed, &store, &VerifyOptions::default())
        .unwrap_err();
    assert!(matches!(
        err,
        IntegrityError::Truncated { index: 64, offset, .. } if offset == (4 << 30) + 1
    ));
}

#[test]
fn corrupt_signed_manifest_bytes_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let (anchor, _) = software_anchors(dir.path());
    let path = write_object(dir.path(), "obj", 5 * 1024 + 1);
    let store = StateStore::open(&dir.path().join("s")).unwrap();
    let o = HashOptions {
        chunk_size: 1024,
        ..HashOptions::default()
    };
    let signed = integrity::SignedManifest::seal(&path, "obj", 9, &anchor, &store, &o).unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());
    let bytes = signed.encode();
    for n in 0..bytes.len() {
        assert!(SignedManifest::decode(&bytes[..n]).is_err(), "prefix {n}");
        assert!(Manifest::decode(&signed.manifest().encode()[..n.min(bytes.len() - 114)]).is_err());
    }
    let mut accepted = 0;
    for bit in 0..bytes.len() * 8 {
        let mut b = bytes.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        if let Ok(s) = SignedManifest::decode(&b) {
            accepted += 1;
            assert!(s.check_signature(&verifier).is_err(), "bit {bit} verified");
        }
    }
    // Flips in the version, signature and key id decode but never verify.
    assert!(accepted > 0);
    let mut x: u32 = 12345;
    for len in [0usize, 1, 4, 7, 50, 113, 200, 1000] {
        let junk: Vec<u8> = (0..len)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (x >> 16) as u8
            })
            .collect();
        assert!(SignedManifest::decode(&junk).is_err());
        let mut framed = bytes[..7].to_vec();
        framed.extend_from_slice(&junk);
        assert!(SignedManifest::decode(&framed).is_err());
    }
}

/// The manifest format and signature scheme, pinned by fixtures made with independent tools
/// (Python hashlib for the encoding and RFC 6962 root, OpenSSL for the signature): see
/// testdata/integrity/gen_*.
#[test]
fn known_answer_fixtures_from_independent_implementations() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/integrity");
    let encoded = fs::read(dir.join("manifest-v1.bin")).unwrap();
    let m = Manifest::decode(&encoded).unwrap();
    assert_eq!(
        (m.object_id(), m.version(), m.size(), m.chunk_size()),
        ("testdata/known-answer", 42, 6644, 1024)
    );
    assert_eq!(
        hex::encode(m.root()),
        "66e36ad713a4f25a4d942965b694bdd2de6ed9f070336ef20413b2868540b172"
    );
    assert_eq!(
        hex::encode(m.digest()),
        "51c94f839d9ee836953d727991a9f0bf6f71bda88ffb84489fe56b7a46cb4fad"
    );
    assert_eq!(m.encode(), encoded);
    // Hashing the object reproduces the manifest byte for byte.
    let o = HashOptions {
        chunk_size: 1024,
        ..HashOptions::default()
    };
    let h = integrity::HashedObject::hash_file(&dir.join("object-7chunks.bin"), &o).unwrap();
    let rebuilt = Manifest::new("testdata/known-answer", 42, h.size, 1024, h.leaves).unwrap();
    assert_eq!(rebuilt.encode(), encoded);

    // An OpenSSL signature over the digest verifies with the pinned key, and the object too.
    let key = fs::read_to_string(dir.join("signer-public-key.hex")).unwrap();
    let key = probity::integrity::PublicKey::from_hex(&key).unwrap();
    assert_eq!(key.to_hex().len(), 130);
    let verifier = Verifier::new(key);
    let signed =
        SignedManifest::decode(&fs::read(dir.join("signed-manifest-v1.bin")).unwrap()).unwrap();
    assert_eq!(signed.manifest(), &m);
    signed.check_signature(&verifier).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = StateStore::open(tmp.path()).unwrap();
    let report = verifier
        .verify_object(
            &dir.join("object-7chunks.bin"),
            &signed,
            &store,
            &VerifyOptions::default(),
        )
        .unwrap();
    assert_eq!(report.chunks, 7);
    assert!(probity::integrity::PublicKey::from_hex("04zz").is_err());
}

// ---------------------------------------------------------------- SoftHSM2 anchor

#[test]
fn softhsm_anchor_every_tamper_case() {
    with_softhsm("integrity::softhsm_anchor_every_tamper_case", |hsm, dir| {
        let anchor = Pkcs11Anchor::open_or_generate(&hsm.config(KEY)).unwrap();
        let d = anchor.describe();
        assert!(d.is_hsm());
        assert!(d.summary.contains(&hsm.token));
        let other = SoftwareAnchor::generate(&dir.join("other.key")).unwrap();
        tamper_suite(&anchor, &other, dir);
    });
}

#[test]
fn softhsm_key_is_persistent_and_signatures_verify_with_ring() {
    with_softhsm(
        "integrity::softhsm_key_is_persistent_and_signatures_verify_with_ring",
        |hsm, _| {
            let a = Pkcs11Anchor::generate(&hsm.config(KEY)).unwrap();
            let b = Pkcs11Anchor::open(&hsm.config(KEY)).unwrap();
            assert_eq!(a.public_key(), b.public_key());
            let digest = sha256(b"manifest");
            let sig = b.sign(&digest).unwrap();
            let v = Verifier::new(a.public_key().clone());
            assert!(v.verify(&digest, &sig));
            assert!(!v.verify(&sha256(b"other"), &sig));
            assert!(matches!(
                Pkcs11Anchor::generate(&hsm.config(KEY)),
                Err(AnchorError::KeyExists { .. })
            ));
            // The token keeps one digest per object version.
            a.store_digest("o", 1, &digest).unwrap();
            a.store_digest("o", 1, &digest).unwrap();
            assert!(matches!(
                a.store_digest("o", 1, &sha256(b"x")),
                Err(AnchorError::DigestConflict { .. })
            ));
        },
    );
}

#[test]
fn softhsm_errors_are_distinct() {
    with_softhsm("integrity::softhsm_errors_are_distinct", |hsm, dir| {
        // Wrong PIN first: PKCS#11 login state is per process and token.
        let mut cfg = hsm.config(KEY);
        cfg.pin = Pin::new("not-the-pin".into());
        let err = Pkcs11Anchor::open(&cfg).unwrap_err();
        assert!(matches!(err, AnchorError::WrongPin { .. }), "{err:?}");
        assert!(!err.to_string().contains("not-the-pin"));

        let mut cfg = hsm.config(KEY);
        cfg.token_label = "no-such-token".into();
        let err = Pkcs11Anchor::open(&cfg).unwrap_err();
        assert!(matches!(err, AnchorError::TokenNotFound { .. }), "{err:?}");

        let mut cfg = hsm.config(KEY);
        cfg.module = dir.join("libmissing.so");
        let err = Pkcs11Anchor::open(&cfg).unwrap_err();
        assert!(matches!(err, AnchorError::ModuleLoad { .. }), "{err:?}");

        let err = Pkcs11Anchor::open(&hsm.config("absent-key")).unwrap_err();
        assert!(matches!(err, AnchorError::KeyNotFound { .. }), "{err:?}");

        // The PIN from the environment works; an unset variable is its own error.
        let mut cfg = hsm.config(KEY);
        cfg.pin = Pin::from_env(PIN_ENV).unwrap();
        assert!(!format!("{cfg:?}").contains(&hsm.pin()));
        Pkcs11Anchor::generate(&cfg).unwrap();
        assert!(matches!(
            Pin::from_env("PROBITY_TEST_UNSET_PIN_VARIABLE"),
            Err(AnchorError::PinEnvMissing { .. })
        ));
        assert!(matches!(
            Pin::from_file(&dir.join("no-pin-file")),
            Err(AnchorError::PinFile { .. })
        ));
    });
}

#[test]
fn softhsm_interop_with_pkcs11_tool() {
    with_softhsm("integrity::softhsm_interop_with_pkcs11_tool", |hsm, dir| {
        let anchor = Pkcs11Anchor::generate(&hsm.config(KEY)).unwrap();
        let path = write_object(dir, "model.bin", 20_000);
        let store = StateStore::open(&dir.join("state")).unwrap();
        let signed =
            integrity::SignedManifest::seal(&path, "models/demo", 3, &anchor, &store, &opts())
                .unwrap();
        let pkcs11_tool = |args: &[&str]| {
            let out = Command::new("pkcs11-tool")
                .args(["--module", MODULE, "--token-label", &hsm.token])
                .args(["--login", "--pin", &hsm.pin()])
                .args(args)
                .output()
                .expect("pkcs11-tool must be installed: apt-get install -y opensc");
            assert!(
                out.status.success(),
                "pkcs11-tool {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        };
        let listing = String::from_utf8(pkcs11_tool(&["--list-objects"])).unwrap();
        assert!(listing.contains(&format!("label:      {KEY}")), "{listing}");
        assert!(listing.contains("never extractable"), "{listing}");
        assert!(listing.contains("Usage:      sign\n"), "{listing}");
        assert!(listing.contains("'models/demo@3'"), "{listing}");
        assert!(listing.contains("application:    'probity'"), "{listing}");
        let out = dir.join("digest.bin");
        pkcs11_tool(&[
            "--read-object",
            "--type",
            "data",
            "--label",
            "models/demo@3",
            "--output-file",
            out.to_str().unwrap(),
        ]);
        assert_eq!(fs::read(&out).unwrap(), signed.digest());
    });
}

// ---------------------------------------------------------------- hardening

/// Runs pkcs11-tool logged in to the test token.
fn pkcs11_tool(hsm: &Hsm, args: &[&str]) -> String {
    let out = Command::new("pkcs11-tool")
        .args(["--module", MODULE, "--token-label", &hsm.token])
        .args(["--login", "--pin", &hsm.pin()])
        .args(args)
        .output()
        .expect("pkcs11-tool must be installed: apt-get install -y opensc");
    assert!(
        out.status.success(),
        "pkcs11-tool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Issue: a pre-provisioned key pair under Probity's label, imported and extractable,
/// was used and `seal` said `"hsm": true`. Such keys are refused, naming the attribute,
/// unless explicitly allowed, and then nothing calls the signature HSM-protected.
#[test]
fn bug_an_extractable_or_imported_key_under_our_label_is_not_trusted() {
    with_softhsm(
        "integrity::bug_an_extractable_or_imported_key_under_our_label_is_not_trusted",
        |hsm, dir| {
            // Generated in the token, but extractable.
            pkcs11_tool(
                hsm,
                &[
                    "--keypairgen",
                    "--key-type",
                    "EC:prime256v1",
                    "--label",
                    "extractable-key",
                    "--usage-sign",
                    "--extractable",
                ],
            );
            let err = Pkcs11Anchor::open(&hsm.config("extractable-key")).unwrap_err();
            assert!(
                matches!(
                    &err,
                    AnchorError::UnprotectedKey {
                        attribute: "CKA_EXTRACTABLE",
                        found: Some(true),
                        ..
                    }
                ),
                "{err:?}"
            );
            assert!(err.to_string().contains("CKA_EXTRACTABLE"), "{err}");
            // open_or_generate does not paper over it by generating another key.
            assert!(Pkcs11Anchor::open_or_generate(&hsm.config("extractable-key")).is_err());

            // Allowed explicitly: usable, and described as NOT HSM-protected.
            let mut cfg = hsm.config("extractable-key");
            cfg.allow_unprotected_key = true;
            let anchor = Pkcs11Anchor::open(&cfg).unwrap();
            let d = anchor.describe();
            assert!(!d.is_hsm());
            assert!(!d.key_protected);
            assert!(d.summary.contains("NOT HSM-protected"), "{}", d.summary);
            assert!(anchor.protection_problem().is_some());
            let digest = sha256(b"m");
            assert!(
                Verifier::new(anchor.public_key().clone())
                    .verify(&digest, &anchor.sign(&digest).unwrap())
            );

            // Imported from outside the token (sensitive, not extractable, but not local
            // and never always-sensitive): its plaintext existed somewhere.
            let pem = dir.join("k.pem");
            let der = dir.join("k.der");
            let pubder = dir.join("pub.der");
            let run = |args: &[&str]| {
                let out = Command::new("openssl").args(args).output().unwrap();
                assert!(
                    out.status.success(),
                    "openssl {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            run(&[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                pem.to_str().unwrap(),
            ]);
            run(&[
                "pkcs8",
                "-topk8",
                "-nocrypt",
                "-in",
                pem.to_str().unwrap(),
                "-outform",
                "DER",
                "-out",
                der.to_str().unwrap(),
            ]);
            run(&[
                "ec",
                "-in",
                pem.to_str().unwrap(),
                "-pubout",
                "-outform",
                "DER",
                "-out",
                pubder.to_str().unwrap(),
            ]);
            pkcs11_tool(
                hsm,
                &[
                    "--write-object",
                    der.to_str().unwrap(),
                    "--type",
                    "privkey",
                    "--label",
                    "imported-key",
                    "--usage-sign",
                    "--sensitive",
                ],
            );
            pkcs11_tool(
                hsm,
                &[
                    "--write-object",
                    pubder.to_str().unwrap(),
                    "--type",
                    "pubkey",
                    "--label",
                    "imported-key",
                ],
            );
            let err = Pkcs11Anchor::open(&hsm.config("imported-key")).unwrap_err();
            assert!(
                matches!(
                    &err,
                    AnchorError::UnprotectedKey {
                        attribute: "CKA_ALWAYS_SENSITIVE",
                        ..
                    }
                ),
                "{err:?}"
            );
            assert!(err.to_string().contains("CKA_LOCAL"), "{err}");

            // A key Probity generated passes.
            let good = Pkcs11Anchor::generate(&hsm.config(KEY)).unwrap();
            assert!(good.describe().is_hsm());
            assert!(good.describe().key_protected);
        },
    );
}

/// Issue: after the state directory was deleted, `verify` created an empty registry and
/// accepted version 1 again, although the token keeps every sealed digest. A new
/// registry is now rebuilt from the token before anything is accepted.
#[test]
fn bug_a_lost_registry_is_rebuilt_from_the_token_and_refuses_the_rollback() {
    with_softhsm(
        "integrity::bug_a_lost_registry_is_rebuilt_from_the_token_and_refuses_the_rollback",
        |hsm, dir| {
            let anchor = Pkcs11Anchor::generate(&hsm.config(KEY)).unwrap();
            let verifier = Verifier::new(anchor.public_key().clone());
            let state_dir = dir.join("state");
            let store = StateStore::open(&state_dir).unwrap();
            let v1_path = write_object(dir, "v1.bin", 10_000);
            let v2_path = write_object(dir, "v2.bin", 12_000);
            let v1 = integrity::SignedManifest::seal(&v1_path, "ckpt", 1, &anchor, &store, &opts())
                .unwrap();
            let v2 = integrity::SignedManifest::seal(&v2_path, "ckpt", 2, &anchor, &store, &opts())
                .unwrap();
            integrity::SignedManifest::seal(&v1_path, "other", 5, &anchor, &store, &opts())
                .unwrap();
            drop(store);
            fs::remove_dir_all(&state_dir).unwrap();

            let store = StateStore::open(&state_dir).unwrap();
            assert!(store.is_new());
            let token: Vec<_> = anchor.stored_digests().unwrap();
            assert_eq!(token.len(), 3, "{token:?}");
            let memory =
                integrity::RollbackMemory::restore(&store, store.is_new(), Some(&hsm.config(KEY)))
                    .unwrap();
            assert_eq!(memory, integrity::RollbackMemory::Rebuilt { objects: 2 });
            assert!(!memory.restarted_from_zero());
            let entry = store.registry_entry("ckpt").unwrap().unwrap();
            assert_eq!((entry.version, entry.digest), (2, *v2.digest()));
            assert_eq!(store.registry_entry("other").unwrap().unwrap().version, 5);

            let err = verifier
                .verify_object(&v1_path, &v1, &store, &VerifyOptions::default())
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    IntegrityError::Rollback {
                        offered: 1,
                        accepted: 2,
                        ..
                    }
                ),
                "{err:?}"
            );
            verifier
                .verify_object(&v2_path, &v2, &store, &VerifyOptions::default())
                .unwrap();

            // An existing registry is left alone.
            assert_eq!(
                integrity::RollbackMemory::restore(&store, false, Some(&hsm.config(KEY))).unwrap(),
                integrity::RollbackMemory::Kept
            );
        },
    );
}

/// Without an HSM nothing remembers: the library says so, and the old version is
/// accepted once (what the CLI and the server must say loudly).
#[test]
fn a_lost_registry_without_an_hsm_says_rollback_protection_restarts_from_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::generate(&tmp.path().join("anchor.key")).unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());
    let state_dir = tmp.path().join("state");
    let store = StateStore::open(&state_dir).unwrap();
    assert!(store.is_new());
    let v1_path = write_object(tmp.path(), "v1.bin", 3000);
    let v1 =
        integrity::SignedManifest::seal(&v1_path, "ckpt", 1, &anchor, &store, &opts()).unwrap();
    let v2_path = write_object(tmp.path(), "v2.bin", 4000);
    integrity::SignedManifest::seal(&v2_path, "ckpt", 2, &anchor, &store, &opts()).unwrap();
    drop(store);
    let store = StateStore::open(&state_dir).unwrap();
    assert!(!store.is_new());
    assert_eq!(
        integrity::RollbackMemory::restore(&store, store.is_new(), None).unwrap(),
        integrity::RollbackMemory::Kept
    );
    drop(store);
    fs::remove_dir_all(&state_dir).unwrap();
    let store = StateStore::open(&state_dir).unwrap();
    let memory = integrity::RollbackMemory::restore(&store, store.is_new(), None).unwrap();
    assert!(memory.restarted_from_zero());
    verifier
        .verify_object(&v1_path, &v1, &store, &VerifyOptions::default())
        .unwrap();
}

/// `seal --version 18446744073709551615` panicked in debug builds and burnt the id in
/// release ones: the last version is refused, and the next version never overflows.
#[test]
fn bug_the_last_version_is_refused_and_the_next_version_never_overflows() {
    let tmp = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::generate(&tmp.path().join("anchor.key")).unwrap();
    let store = StateStore::open(&tmp.path().join("state")).unwrap();
    let path = write_object(tmp.path(), "o.bin", 2000);
    let err = integrity::SignedManifest::seal(&path, "o", u64::MAX, &anchor, &store, &opts())
        .unwrap_err();
    assert!(matches!(err, IntegrityError::LastVersion { .. }), "{err:?}");
    assert!(err.to_string().contains("last version"), "{err}");
    assert_eq!(
        integrity::SignedManifest::next_version(&store, "o").unwrap(),
        Some(1)
    );
    integrity::SignedManifest::seal(&path, "o", u64::MAX - 1, &anchor, &store, &opts()).unwrap();
    assert_eq!(
        integrity::SignedManifest::next_version(&store, "o").unwrap(),
        None
    );
}
