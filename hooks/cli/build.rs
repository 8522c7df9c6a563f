//! The version `probity --version` prints: the crate's, the git commit it was built
//! from (`unknown` outside a git checkout, or `PROBITY_GIT_COMMIT` when a packager sets
//! it), and whether the work tree had changes.

use std::process::Command;

fn main() {
    // Rebuilt when HEAD moves (a checkout, a commit, a changed index). Only paths that
    // exist are named: cargo reruns a build script naming a missing one on every build.
    println!("cargo:rerun-if-changed=build.rs");
    for path in [
        "../../.git/HEAD",
        "../../.git/index",
        "../../.git/refs/heads",
        "../../.git/packed-refs",
    ] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-env-changed=PROBITY_GIT_COMMIT");
    let commit = std::env::var("PROBITY_GIT_COMMIT").ok().or_else(|| {
        let out = Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .output()
            .ok()?;
        let commit = String::from_utf8(out.stdout).ok()?.trim().to_owned();
        if !out.status.success() || commit.is_empty() {
            return None;
        }
        let dirty = Command::new("git")
            .args(["status", "--porcelain", "--untracked-files=no"])
            .output()
            .ok()
            .is_some_and(|o| o.status.success() && !o.stdout.is_empty());
        Some(if dirty {
            format!("{commit}-dirty")
        } else {
            commit
        })
    });
    println!(
        "cargo:rustc-env=PROBITY_GIT_COMMIT={}",
        commit.unwrap_or_else(|| "unknown".to_owned())
    );
}
