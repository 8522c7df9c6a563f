//! Seals the fixtures the C, Python and Go tests read into a directory, so they can be
//! run by hand: `cargo run -p probity-ffi --example make_fixtures -- /tmp/probity-fixtures`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "a developer tool: a panic with its message is the right answer to a bad argument"
)]

#[path = "../tests/ffi/fixtures.rs"]
mod fixtures;

fn main() {
    let dir = std::env::args()
        .nth(1)
        .expect("usage: make_fixtures DIR (created if missing, must be empty)");
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let f = fixtures::make(&dir, &repo);
    println!("{}", f.dir.display());
}
