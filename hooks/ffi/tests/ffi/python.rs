//! The Python package (`python/probity`, ctypes) under Debian's pytest, against fixtures
//! sealed here and the library built with this test.

use std::process::Command;
use std::time::Duration;

use crate::{check, crate_dir, lib_dir, run, sealed};

/// Debian's interpreter, which has python3-pytest (a `python3` earlier on the PATH, such
/// as pyenv's, may not).
const PYTHON: &str = "/usr/bin/python3";

#[test]
fn python_decides_reads_and_is_refused_a_tampered_chunk() {
    let (_tmp, f) = sealed();
    let cache = tempfile::tempdir().unwrap();
    let out = run(
        Command::new(PYTHON)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(crate_dir().join("python"))
            .env("PROBITY_LIB", lib_dir().join("libprobity.so"))
            .env("PROBITY_TEST_FIXTURES", &f.dir)
            .env("PYTHONPATH", crate_dir().join("python"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PYTHONPYCACHEPREFIX", cache.path()),
        Duration::from_secs(300),
    );
    let stdout = check("pytest", &out);
    let summary = stdout
        .lines()
        .rev()
        .find(|l| l.contains("passed"))
        .unwrap_or_default();
    assert!(
        summary.contains(" passed") && !summary.contains("failed") && !summary.contains("error"),
        "{stdout}"
    );
}
