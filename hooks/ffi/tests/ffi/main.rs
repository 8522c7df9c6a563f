//! libprobity through its callers: the generated header, the pkg-config file, and the C,
//! Python and Go programs that link the library, each run as a child process against
//! fixtures sealed here.
//!
//! The library must be built (`cargo test -p probity-ffi` builds `libprobity.so` and
//! `libprobity.a` with the test); it is found beside this test binary's `deps/` folder.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "test helpers as well as tests: a panic is a failed test"
)]

mod c;
mod fixtures;
mod go;
mod header;
mod pkgconfig;
mod python;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// This crate's directory.
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where cargo put libprobity.so, libprobity.a and probity.pc: `<target>/<profile>`.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap().to_owned();
    for artifact in ["libprobity.so", "libprobity.a", "probity.pc"] {
        assert!(
            dir.join(artifact).exists(),
            "{} is missing: build the library first (cargo build -p probity-ffi)",
            dir.join(artifact).display()
        );
    }
    dir
}

/// Fresh fixtures in a temporary directory of their own.
pub fn sealed() -> (tempfile::TempDir, fixtures::Fixtures) {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixtures::make(tmp.path(), &repo());
    (tmp, f)
}

/// Kills the child when dropped (a failed assertion must not leave it running).
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs `cmd` to completion within `limit`, capturing its output; kills it (by PID)
/// and fails the test past the limit.
pub fn run(cmd: &mut Command, limit: Duration) -> Output {
    let shown = format!("{cmd:?}");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let mut guard = ChildGuard(child);
    let mut out = guard.0.stdout.take().unwrap();
    let mut err = guard.0.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = guard.0.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = guard.0.kill();
            let _ = guard.0.wait();
            panic!("{shown} ran past {limit:?} and was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    }
}

/// Fails the test with the child's output unless it exited 0.
pub fn check(what: &str, output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    stdout
}
