//! The Go package (`go/`, cgo) under `go test`, linked through the build tree's
//! `probity.pc`, with a throwaway GOPATH and GOCACHE and no module proxy.

use std::process::Command;
use std::time::Duration;

use crate::{check, crate_dir, lib_dir, run, sealed};

#[test]
fn go_decides_reads_and_is_refused_a_tampered_chunk() {
    let (_tmp, f) = sealed();
    let go = tempfile::tempdir().unwrap();
    let out = run(
        Command::new("go")
            .args(["test", "-count=1", "-v", "./..."])
            .current_dir(crate_dir().join("go"))
            .env("PKG_CONFIG_PATH", lib_dir())
            .env("PROBITY_TEST_FIXTURES", &f.dir)
            .env("CGO_ENABLED", "1")
            .env("GOFLAGS", "-mod=mod")
            .env("GOPROXY", "off")
            .env("GOTOOLCHAIN", "local")
            .env("GOPATH", go.path().join("path"))
            .env("GOCACHE", go.path().join("cache")),
        Duration::from_secs(600),
    );
    let stdout = check("go test", &out);
    assert!(
        stdout.lines().any(|l| l.starts_with("ok "))
            && stdout.contains("--- PASS: TestATamperedChunkFailsMidReadAndBlocksTheNode"),
        "{stdout}"
    );
    assert!(!stdout.contains("--- FAIL"), "{stdout}");
}
