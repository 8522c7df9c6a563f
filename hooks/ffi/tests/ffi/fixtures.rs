//! Sealed objects for the callers: an intact checkpoint and a copy with one flipped byte,
//! sealed with the software anchor in 64 KiB chunks, in a state directory of their own.
//!
//! Also compiled into the unit tests (`src/tests.rs`) and the `make_fixtures` example
//! (which lets a developer run the Python and Go tests by hand).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use engine::integrity::{self, Anchor, HashOptions, SoftwareAnchor};
use engine::state::StateStore;

/// The object id the fixtures are sealed under.
pub const OBJECT_ID: &str = "llm/epoch-7";
/// Chunk size of the fixtures.
pub const CHUNK: u32 = 64 * 1024;
/// Size of the fixture object: four whole chunks and a short fifth.
pub const SIZE: usize = 4 * CHUNK as usize + 1000;
/// Where the tampered copy differs: a byte inside chunk 2.
pub const TAMPERED_AT: usize = 2 * CHUNK as usize + 100;

/// Paths of a fixture set.
#[allow(dead_code, reason = "each includer uses a different part")]
pub struct Fixtures {
    pub dir: PathBuf,
    pub state: PathBuf,
    pub object: PathBuf,
    pub tampered: PathBuf,
    pub public_key: PathBuf,
    pub cluster: PathBuf,
}

/// The object's bytes: deterministic, and different in every chunk.
pub fn content() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Seals the fixtures into `dir` (which must exist) and copies the cluster entities
/// from the repository at `repo`. The state store is closed on return, so a caller
/// can open it.
pub fn make(dir: &Path, repo: &Path) -> Fixtures {
    let f = Fixtures {
        dir: dir.to_owned(),
        state: dir.join("state"),
        object: dir.join("epoch-7.ckpt"),
        tampered: dir.join("tampered.ckpt"),
        public_key: dir.join("state/trusted.pub"),
        cluster: dir.join("cluster.json"),
    };
    let data = content();
    std::fs::write(&f.object, &data).unwrap();
    let store = StateStore::open(&f.state).unwrap();
    let anchor = SoftwareAnchor::load_or_generate(&f.state.join("anchor.key")).unwrap();
    let options = HashOptions {
        chunk_size: CHUNK,
        ..HashOptions::default()
    };
    let signed =
        integrity::SignedManifest::seal(&f.object, OBJECT_ID, 1, &anchor, &store, &options)
            .unwrap();
    let manifest = signed.encode();
    std::fs::write(integrity::Manifest::default_path(&f.object), &manifest).unwrap();
    std::fs::write(&f.public_key, anchor.public_key().to_hex()).unwrap();
    // Whatever the umask: a pinned key others could write is refused.
    std::fs::set_permissions(&f.public_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut bad = data;
    bad[TAMPERED_AT] ^= 0x01;
    std::fs::write(&f.tampered, &bad).unwrap();
    std::fs::write(integrity::Manifest::default_path(&f.tampered), &manifest).unwrap();
    std::fs::copy(repo.join("testdata/entities/cluster.json"), &f.cluster).unwrap();
    drop(store);
    f
}
