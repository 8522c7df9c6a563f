//! The committed header is what cbindgen generates from `src/lib.rs`, so it cannot drift
//! from the library. To update it: `PROBITY_BLESS=1 cargo test -p probity-ffi --test ffi header`.

use crate::crate_dir;

fn generate() -> String {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    // Only lib.rs: it holds every exported function, type and constant, and parsing
    // one file needs no `cargo metadata`.
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .unwrap();
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let fresh = generate();
    let path = crate_dir().join("include/probity.h");
    if std::env::var_os("PROBITY_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let line = committed
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(fresh.lines().count()))
            + 1;
        panic!(
            "{} differs from what cbindgen generates from src/lib.rs (first at line {line}); \
             regenerate it: PROBITY_BLESS=1 cargo test -p probity-ffi --test ffi header",
            path.display()
        );
    }
}

#[test]
fn the_header_declares_every_entry_point() {
    let header = std::fs::read_to_string(crate_dir().join("include/probity.h")).unwrap();
    for name in [
        "probity_version",
        "probity_abi_version",
        "probity_last_error",
        "probity_free",
        "probity_engine_open",
        "probity_engine_close",
        "probity_engine_status",
        "probity_engine_reload",
        "probity_decide",
        "probity_decide_batch",
        "probity_upsert_entities",
        "probity_remove_entities",
        "probity_verify",
        "probity_verify_as",
        "probity_reader_open_as",
        "probity_reader_open",
        "probity_reader_read",
        "probity_reader_read_at",
        "probity_reader_seek",
        "probity_reader_size",
        "probity_reader_close",
    ] {
        // `probity_status probity_free(` or `const char *probity_version(`.
        assert!(
            header.contains(&format!(" {name}(")) || header.contains(&format!("*{name}(")),
            "{name} is not declared"
        );
    }
    assert!(header.contains("#define PROBITY_ABI_VERSION 1"));
}
