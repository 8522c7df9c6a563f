//! The C caller (`c/test_probity.c`), compiled with `cc` against the header, once linked
//! to `libprobity.so` (flags from the build tree's `probity.pc`) and once to
//! `libprobity.a`; then run under valgrind, which must find no leak and no invalid
//! access over a loop of decides and verified reads.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{check, crate_dir, lib_dir, run, sealed};

/// Decides and verified reads in the native loop.
const NATIVE_LOOPS: (u32, u32) = (10_000, 10_000);
/// The same under valgrind. Valgrind runs the debug library some 50 times slower (a
/// decide takes ~0.2 s, a verified read of a fresh 64 KiB chunk ~0.05 s on this 2-core
/// machine), so the suite runs a few minutes' worth; the full 10,000 and 10,000 run
/// with PROBITY_VALGRIND_LOOPS="10000 10000" (about an hour in debug).
const VALGRIND_LOOPS: (u32, u32) = (50, 200);

fn pkg_config(args: &[&str]) -> Vec<String> {
    let out = run(
        Command::new("pkg-config")
            .args(args)
            .arg("probity")
            .env("PKG_CONFIG_PATH", lib_dir()),
        Duration::from_secs(30),
    );
    check("pkg-config", &out)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Compiles the test program into `dir`: linked dynamically, or statically to the archive.
fn compile(dir: &Path, static_archive: bool) -> PathBuf {
    let exe = dir.join(if static_archive {
        "test_probity_static"
    } else {
        "test_probity"
    });
    let mut cmd = Command::new("cc");
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .arg(crate_dir().join("c/test_probity.c"))
        .arg("-o")
        .arg(&exe)
        .args(pkg_config(&["--cflags"]));
    if static_archive {
        // The archive by path, then the system libraries it needs (Libs.private).
        cmd.arg(lib_dir().join("libprobity.a")).args(
            pkg_config(&["--static", "--libs-only-l"])
                .into_iter()
                .filter(|f| f != "-lprobity"),
        );
    } else {
        cmd.args(pkg_config(&["--libs"]));
    }
    check("cc", &run(&mut cmd, Duration::from_secs(120)));
    exe
}

fn loops(var: &str, default: (u32, u32)) -> (u32, u32) {
    std::env::var(var)
        .ok()
        .and_then(|v| {
            let mut it = v.split_whitespace().map(str::parse::<u32>);
            Some((it.next()?.ok()?, it.next()?.ok()?))
        })
        .unwrap_or(default)
}

fn assert_all_passed(stdout: &str) {
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(
        summary.ends_with(" passed, 0 failed"),
        "no clean summary: {stdout}"
    );
}

#[test]
fn c_decides_reads_and_is_refused_a_tampered_chunk_linked_to_the_shared_library() {
    let (tmp, f) = sealed();
    let exe = compile(tmp.path(), false);
    let (decides, reads) = loops("PROBITY_NATIVE_LOOPS", NATIVE_LOOPS);
    let out = run(
        Command::new(&exe)
            .arg(&f.dir)
            .arg(decides.to_string())
            .arg(reads.to_string()),
        Duration::from_secs(300),
    );
    assert_all_passed(&check("test_probity (shared)", &out));
}

#[test]
fn c_decides_reads_and_is_refused_a_tampered_chunk_linked_to_the_static_archive() {
    let (tmp, f) = sealed();
    let exe = compile(tmp.path(), true);
    // Linked statically: no libprobity.so in its dynamic dependencies.
    let elf = std::fs::read(&exe).unwrap();
    assert!(
        !elf.windows(13).any(|w| w == b"libprobity.so"),
        "the static build still needs libprobity.so"
    );
    let out = run(Command::new(&exe).arg(&f.dir), Duration::from_secs(120));
    assert_all_passed(&check("test_probity (static)", &out));
}

#[test]
fn c_under_valgrind_leaks_nothing_and_touches_no_invalid_memory() {
    let (tmp, f) = sealed();
    let exe = compile(tmp.path(), false);
    let (decides, reads) = loops("PROBITY_VALGRIND_LOOPS", VALGRIND_LOOPS);
    // A bound on a hung run, not a measurement: generous per call under valgrind.
    let limit = Duration::from_secs(600 + u64::from(decides + reads));
    let out = run(
        Command::new("valgrind")
            .args([
                "--error-exitcode=1",
                "--leak-check=full",
                // Not `possible`: the engine's interners and Cedar's extension tables
                // are process-lifetime statics that valgrind reports as possibly lost
                // (pointers into their middle), whatever the loop counts.
                "--errors-for-leak-kinds=definite,indirect",
                "--quiet",
            ])
            .arg(&exe)
            .arg(&f.dir)
            .arg(decides.to_string())
            .arg(reads.to_string()),
        limit,
    );
    let stdout = check("valgrind test_probity", &out);
    assert_all_passed(&stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("definitely lost") && !stderr.contains("Invalid "),
        "{stderr}"
    );
}
