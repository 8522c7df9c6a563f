//! The build tree's `probity.pc` points pkg-config at this build's library and header.

use std::process::Command;
use std::time::Duration;

use crate::{check, crate_dir, lib_dir, run};

#[test]
fn pkg_config_finds_the_build_trees_library_and_header() {
    let dir = lib_dir();
    let out = run(
        Command::new("pkg-config")
            .args(["--cflags", "--libs", "probity"])
            .env("PKG_CONFIG_PATH", &dir),
        Duration::from_secs(30),
    );
    let flags = check("pkg-config", &out);
    let include = crate_dir().join("include");
    assert!(
        flags.contains(&format!("-I{}", include.display())),
        "{flags}"
    );
    assert!(flags.contains(&format!("-L{}", dir.display())), "{flags}");
    assert!(flags.contains("-lprobity"), "{flags}");
    assert!(
        flags.contains(&format!("-Wl,-rpath,{}", dir.display())),
        "{flags}"
    );
    let out = run(
        Command::new("pkg-config")
            .args(["--modversion", "probity"])
            .env("PKG_CONFIG_PATH", &dir),
        Duration::from_secs(30),
    );
    assert_eq!(check("pkg-config", &out).trim(), env!("CARGO_PKG_VERSION"));
}
