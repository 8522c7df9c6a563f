//! Writes `probity.pc` for the build tree beside the artifacts it describes.
//!
//! Why here: a pkg-config file must hold absolute paths, and only the build knows
//! where the target directory is. It goes to `<target>/<profile>/probity.pc` (three
//! levels above `OUT_DIR`), next to `libprobity.so` and `libprobity.a`, so that
//! `PKG_CONFIG_PATH=<target>/<profile>` finds it; the template is `probity.pc.in`.

use std::path::{Path, PathBuf};

/// The system libraries a Rust static library needs on Linux (what
/// `--print native-static-libs` lists for this crate).
const NATIVE_LIBS: &str = "-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc";

fn main() {
    println!("cargo:rerun-if-changed=probity.pc.in");
    println!("cargo:rerun-if-changed=build.rs");
    let Some(out_dir) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        return;
    };
    let Some(manifest_dir) = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from) else {
        return;
    };
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
    let Some(libdir) = out_dir.ancestors().nth(3) else {
        return;
    };
    let Ok(template) = std::fs::read_to_string(manifest_dir.join("probity.pc.in")) else {
        println!("cargo:warning=probity.pc.in is missing: no probity.pc written");
        return;
    };
    let text = fill(&template, libdir, &manifest_dir.join("include"));
    let target = libdir.join("probity.pc");
    // Rewrite only on change, so the file's time says when its content last changed.
    if std::fs::read_to_string(&target).ok().as_deref() != Some(text.as_str())
        && let Err(e) = std::fs::write(&target, &text)
    {
        println!("cargo:warning=cannot write {}: {e}", target.display());
    }
}

fn fill(template: &str, libdir: &Path, includedir: &Path) -> String {
    template
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("@PREFIX@", &libdir.display().to_string())
        .replace("@LIBDIR@", "${prefix}")
        .replace("@INCLUDEDIR@", &includedir.display().to_string())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"))
        .replace("@RPATH@", "-Wl,-rpath,${libdir} ")
        .replace("@NATIVE_LIBS@", NATIVE_LIBS)
        + "\n"
}
