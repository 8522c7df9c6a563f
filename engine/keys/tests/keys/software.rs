//! The software KEK provider's files: created 0600 whatever the umask, and refused when
//! group or others can read or write them, when another user owns them, when they are links
//! or of the wrong length; every description says "software KEK: not an HSM".

use std::fs;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::PathBuf;
use std::process::Command;

use probity_keys::{
    DataKey, KekError, KekOutcome, KekProvider, KeyScope, SOFTWARE_KEK_NOTICE, SoftwareKek,
};

use crate::common::{Setup, key};

const CHILD_ENV: &str = "PROBITY_KEYS_TEST_UMASK_CHILD";

/// Runs test `name` again, alone, in a child process whose umask is `umask` (the umask is
/// process-wide: changing it here would race with other tests).
fn with_umask(name: &str, umask: &str, body: impl FnOnce()) {
    if std::env::var_os(CHILD_ENV).is_some() {
        body();
        return;
    }
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask {umask} && exec \"$0\" --exact {name} --nocapture --test-threads=1"
        ))
        .arg(std::env::current_exe().unwrap())
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child run of {name} failed\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn mode(path: &std::path::Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn kek_files_are_0600_under_a_permissive_umask() {
    with_umask(
        "software::kek_files_are_0600_under_a_permissive_umask",
        "000",
        || {
            let dir = tempfile::tempdir().unwrap();
            let kek = SoftwareKek::open(&dir.path().join("kek")).unwrap();
            assert_eq!(mode(&dir.path().join("kek")), 0o700);
            kek.generate_kek("a").unwrap();
            assert_eq!(mode(&kek.kek_path("a").unwrap()), 0o600);
        },
    );
}

#[test]
fn kek_files_are_0600_under_a_restrictive_umask() {
    with_umask(
        "software::kek_files_are_0600_under_a_restrictive_umask",
        "277",
        || {
            let dir = tempfile::tempdir().unwrap();
            let kek = SoftwareKek::open(&dir.path().join("kek")).unwrap();
            kek.generate_kek("a").unwrap();
            assert_eq!(mode(&kek.kek_path("a").unwrap()), 0o600);
            let data = DataKey::from_bytes([5; 32]);
            let wrapped = kek.wrap("a", &data).unwrap();
            assert_eq!(kek.unwrap("a", &wrapped).unwrap().expose(), &[5; 32]);
        },
    );
}

fn fresh() -> (tempfile::TempDir, SoftwareKek, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let kek = SoftwareKek::open(&dir.path().join("kek")).unwrap();
    assert_eq!(kek.ensure_kek("k").unwrap(), KekOutcome::Created);
    let path = kek.kek_path("k").unwrap();
    (dir, kek, path)
}

#[test]
fn kek_readable_or_writable_by_group_or_others_is_refused() {
    let (_dir, kek, path) = fresh();
    for bad in [0o640, 0o604, 0o620, 0o602, 0o660] {
        fs::set_permissions(&path, fs::Permissions::from_mode(bad)).unwrap();
        let err = kek.wrap("k", &DataKey::from_bytes([1; 32])).unwrap_err();
        match &err {
            KekError::KeyFilePermissions { mode, path: p, .. } => {
                assert_eq!((*mode, p), (bad, &path));
            }
            other => panic!("{bad:o}: {other:?}"),
        }
        assert!(err.to_string().contains(SOFTWARE_KEK_NOTICE), "{err}");
        assert!(matches!(
            kek.ensure_kek("k"),
            Err(KekError::KeyFilePermissions { .. })
        ));
    }
    fs::set_permissions(&path, fs::Permissions::from_mode(0o400)).unwrap();
    kek.wrap("k", &DataKey::from_bytes([1; 32])).unwrap();
}

#[test]
fn kek_owned_by_another_user_is_refused() {
    let (_dir, kek, path) = fresh();
    std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().uid(), 65534);
    let err = kek.unwrap("k", &[0u8; 40]).unwrap_err();
    assert!(
        matches!(err, KekError::KeyFileOwner { owner: 65534, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("owned by uid 65534"), "{err}");
}

#[test]
fn kek_directory_writable_by_others_or_owned_by_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let kdir = dir.path().join("kek");
    SoftwareKek::open(&kdir).unwrap();
    fs::set_permissions(&kdir, fs::Permissions::from_mode(0o777)).unwrap();
    let err = SoftwareKek::open(&kdir).unwrap_err();
    assert!(
        matches!(
            err,
            KekError::KeyFilePermissions {
                mode: 0o777,
                access: "write",
                ..
            }
        ),
        "{err:?}"
    );
    fs::set_permissions(&kdir, fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&kdir, Some(65534), None).unwrap();
    assert!(matches!(
        SoftwareKek::open(&kdir),
        Err(KekError::KeyFileOwner { .. })
    ));
}

#[test]
fn symlinked_or_wrong_length_kek_is_refused() {
    let (dir, kek, path) = fresh();
    let elsewhere = dir.path().join("elsewhere.kek");
    fs::rename(&path, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
    let err = kek.wrap("k", &DataKey::from_bytes([1; 32])).unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    fs::remove_file(&path).unwrap();
    fs::write(&path, [0u8; 31]).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    let err = kek.wrap("k", &DataKey::from_bytes([1; 32])).unwrap_err();
    assert!(err.to_string().contains("31 bytes long"), "{err}");
    assert!(matches!(
        kek.unwrap("absent", &[0u8; 40]),
        Err(KekError::KekNotFound { .. })
    ));
    assert!(matches!(
        kek.generate_kek("../x"),
        Err(KekError::InvalidLabel { .. })
    ));
}

#[test]
fn every_description_says_not_an_hsm() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    assert!(!s.keyring.describe_kek().is_hsm());
    assert!(
        s.keyring
            .describe_kek()
            .to_string()
            .starts_with(SOFTWARE_KEK_NOTICE)
    );
    assert!(format!("{:?}", s.keyring).contains(SOFTWARE_KEK_NOTICE));
    let kek = SoftwareKek::open(&dir.path().join("kek")).unwrap();
    assert!(format!("{kek:?}").contains(SOFTWARE_KEK_NOTICE));
    s.keyring
        .create(&key("subject/x"), KeyScope::Subject("x".into()), "ops")
        .unwrap();
    let status = s.keyring.status().unwrap();
    assert!(status.kek.summary.contains(SOFTWARE_KEK_NOTICE));
    let erased = s.keyring.erase("x", "dpo", vec![]).unwrap();
    assert!(
        serde_json::to_string(&erased)
            .unwrap()
            .contains(SOFTWARE_KEK_NOTICE)
    );
}
