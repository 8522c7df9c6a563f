//! Trust material on disk: created tight whatever the umask, refused when others can
//! change it (through symlinks too), as the issue found it under `umask 000`.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use probity::integrity::{self, Anchor as _, AnchorError, SoftwareAnchor};
use probity::state::{StateError, StateStore};
use probity_base::trust::TrustError;

const UMASK_CHILD_ENV: &str = "PROBITY_TEST_UMASK_DIR";

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().mode() & 0o7777
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Runs `body` in a child process of this test binary under `umask 000`, with a
/// directory to work in; returns that directory (kept by the parent's temp dir).
fn under_umask_000(name: &str, body: impl FnOnce(&Path)) -> Option<(tempfile::TempDir, PathBuf)> {
    if let Some(dir) = std::env::var_os(UMASK_CHILD_ENV) {
        rustix::process::umask(rustix::fs::Mode::empty());
        body(Path::new(&dir));
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(UMASK_CHILD_ENV, &work)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child run of {name} failed\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some((tmp, work))
}

/// Issue: under `umask 000` the state directory was 0777 and `trusted.pub` and
/// `state.redb` 0666, so another user could replace the pinned key.
#[test]
fn bug_under_umask_000_trust_material_is_created_private() {
    let outcome = under_umask_000(
        "trust::bug_under_umask_000_trust_material_is_created_private",
        |work| {
            // The child really runs under umask 000: a plain file comes out 0666.
            std::fs::write(work.join("plain"), "x").unwrap();
            assert_eq!(mode(&work.join("plain")), 0o666);
            let state_dir = work.join("state/nested");
            let store = StateStore::open(&state_dir).unwrap();
            assert!(store.is_new());
            let anchor = SoftwareAnchor::generate(&state_dir.join("anchor.key")).unwrap();
            anchor
                .public_key()
                .pin(&state_dir.join("trusted.pub"))
                .unwrap();
        },
    );
    let Some((_tmp, work)) = outcome else { return };
    let state_dir = work.join("state/nested");
    assert_eq!(mode(&state_dir), 0o700);
    assert_eq!(mode(&work.join("state")), 0o700);
    assert_eq!(mode(&state_dir.join("state.redb")), 0o600);
    assert_eq!(mode(&state_dir.join("anchor.key")), 0o600);
    assert_eq!(mode(&state_dir.join("trusted.pub")), 0o644);
    // And what was created is trusted again on the next open.
    let store = StateStore::open(&state_dir).unwrap();
    assert!(!store.is_new());
    integrity::PublicKey::load_pinned(&state_dir.join("trusted.pub")).unwrap();
    SoftwareAnchor::load(&state_dir.join("anchor.key")).unwrap();
}

fn pinned_key(dir: &Path) -> PathBuf {
    let anchor = SoftwareAnchor::generate(&dir.join("anchor.key")).unwrap();
    let path = dir.join("trusted.pub");
    anchor.public_key().pin(&path).unwrap();
    path
}

/// Issue: another user replaced `trusted.pub`, and root then verified a forged object.
#[test]
fn bug_a_pinned_key_others_can_write_or_own_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let key = pinned_key(tmp.path());
    integrity::PublicKey::load_pinned(&key).unwrap();

    set_mode(&key, 0o666);
    let e = integrity::PublicKey::load_pinned(&key).unwrap_err();
    assert!(
        matches!(
            &e,
            AnchorError::Untrusted(TrustError::Writable {
                mode: 0o666,
                who: "group and others",
                ..
            })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("trusted.pub"), "{e}");
    set_mode(&key, 0o644);

    std::os::unix::fs::chown(&key, Some(65534), None).unwrap();
    let e = integrity::PublicKey::load_pinned(&key).unwrap_err();
    assert!(
        matches!(
            &e,
            AnchorError::Untrusted(TrustError::Owner { owner: 65534, .. })
        ),
        "{e:?}"
    );
    std::os::unix::fs::chown(&key, Some(0), None).unwrap();
    integrity::PublicKey::load_pinned(&key).unwrap();

    // Not a key at all.
    std::fs::write(&key, "not hex\n").unwrap();
    assert!(matches!(
        integrity::PublicKey::load_pinned(&key),
        Err(AnchorError::PinnedKeyInvalid { .. })
    ));
}

/// Kubernetes mounts a Secret as symlinks into a `..data` directory: the final target is
/// judged, and the directories on the way.
#[test]
fn a_pinned_key_behind_symlinks_is_judged_by_its_target_and_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path().join("secret");
    let data = mount.join("..2026_05_01_00_00_00.000000001");
    std::fs::create_dir_all(&data).unwrap();
    let key = pinned_key(&data);
    assert!(key.ends_with("trusted.pub"));
    symlink(data.file_name().unwrap(), mount.join("..data")).unwrap();
    symlink("..data/trusted.pub", mount.join("trusted.pub")).unwrap();
    integrity::PublicKey::load_pinned(&mount.join("trusted.pub")).unwrap();

    // The target made writable by others is refused through the link.
    set_mode(&key, 0o646);
    let e = integrity::PublicKey::load_pinned(&mount.join("trusted.pub")).unwrap_err();
    assert!(
        matches!(
            &e,
            AnchorError::Untrusted(TrustError::Writable { who: "others", .. })
        ),
        "{e:?}"
    );
    set_mode(&key, 0o644);

    // A link into a world-writable directory without the sticky bit.
    let open = tmp.path().join("drop");
    std::fs::create_dir(&open).unwrap();
    let planted = pinned_key(&open);
    set_mode(&open, 0o777);
    symlink(&planted, tmp.path().join("via-link.pub")).unwrap();
    let e = integrity::PublicKey::load_pinned(&tmp.path().join("via-link.pub")).unwrap_err();
    assert!(
        matches!(
            &e,
            AnchorError::Untrusted(TrustError::UnsafeDirectory { .. })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("drop"), "{e}");
}

#[test]
fn bug_a_registry_others_can_write_or_own_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    drop(StateStore::open(&dir).unwrap());
    let db = dir.join("state.redb");

    set_mode(&db, 0o664);
    let e = StateStore::open(&dir).unwrap_err();
    assert!(
        matches!(
            &e,
            StateError::Untrusted(TrustError::Writable { mode: 0o664, .. })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("state.redb"), "{e}");
    set_mode(&db, 0o600);

    std::os::unix::fs::chown(&db, Some(65534), None).unwrap();
    let e = StateStore::open(&dir).unwrap_err();
    assert!(
        matches!(
            &e,
            StateError::Untrusted(TrustError::Owner { owner: 65534, .. })
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("uid 65534"), "{e}");
    std::os::unix::fs::chown(&db, Some(0), None).unwrap();

    // A state directory others can write (made by an older Probity under umask 000).
    set_mode(&dir, 0o777);
    let e = StateStore::open(&dir).unwrap_err();
    assert!(
        matches!(
            &e,
            StateError::Untrusted(TrustError::UnsafeDirectory { mode: 0o777, .. })
        ),
        "{e:?}"
    );
    set_mode(&dir, 0o700);
    assert!(!StateStore::open(&dir).unwrap().is_new());
}

#[test]
fn a_software_key_of_another_user_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("anchor.key");
    SoftwareAnchor::generate(&path).unwrap();
    std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
    let e = SoftwareAnchor::load(&path).unwrap_err();
    assert!(
        matches!(
            &e,
            AnchorError::Untrusted(TrustError::Owner { owner: 65534, .. })
        ),
        "{e:?}"
    );
}

/// The trust error a state directory was refused with.
fn state_refusal(dir: &Path) -> TrustError {
    match StateStore::open(dir) {
        Ok(_) => panic!("{} was trusted", dir.display()),
        Err(StateError::Untrusted(e)) => e,
        Err(e) => panic!("refused for another reason: {e}"),
    }
}

/// Issue 28, item 9: the state directory was accepted with mode 1777 (where another
/// user can plant `anchor.key` and stop the server), 0770 with a foreign group, and
/// through a symlink another user owns (who can repoint it, at an empty directory that
/// drops the blocklist, before the next start).
#[test]
fn bug_a_state_directory_others_can_write_or_repoint_was_trusted() {
    let tmp = tempfile::tempdir().unwrap();

    let sticky = tmp.path().join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    set_mode(&sticky, 0o1777);
    let e = state_refusal(&sticky);
    assert!(
        e.to_string()
            .contains("mode 1777 lets group and others write it (chmod go-w it)"),
        "{e}"
    );

    let shared = tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::os::unix::fs::chown(&shared, None, Some(4242)).unwrap();
    set_mode(&shared, 0o770);
    let e = state_refusal(&shared);
    assert!(
        e.to_string().contains("mode 0770 lets group write it"),
        "{e}"
    );

    // A link another user owns, to a directory that is fine in itself.
    let private = tmp.path().join("private");
    std::fs::create_dir(&private).unwrap();
    set_mode(&private, 0o700);
    let link = tmp.path().join("state-link");
    symlink(&private, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(4242), None).unwrap();
    let e = state_refusal(&link.join("state"));
    assert!(
        matches!(&e, TrustError::Owner { path, owner: 4242, .. } if path == &link),
        "{e}"
    );
    // The same link owned by this user is followed.
    std::os::unix::fs::lchown(&link, Some(probity_base::trust::running_user()), None).unwrap();
    StateStore::open(&link.join("state")).unwrap();
}
