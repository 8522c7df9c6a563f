//! Helpers shared by the test modules.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// testdata/fixtures/<area>/<name> of the repository.
pub fn fixture_path(area: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(area)
        .join(name)
}

/// The bytes of a fixture.
pub fn fixture(area: &str, name: &str) -> Vec<u8> {
    let p = fixture_path(area, name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every file name of a fixture area, sorted.
pub fn fixture_names(area: &str) -> Vec<String> {
    let dir = fixture_path(area, "");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// Extracts a ttar archive (the format of prometheus/procfs fixtures) under `dest`:
/// `Directory:`, `Path:` + `Lines:` + content, `Mode:`, and separator lines.
pub fn extract_ttar(archive: &[u8], dest: &Path) {
    let text = std::str::from_utf8(archive).unwrap();
    let mut lines = text.lines();
    let mut current: Option<PathBuf> = None;
    while let Some(line) = lines.next() {
        if let Some(dir) = line.strip_prefix("Directory: ") {
            std::fs::create_dir_all(dest.join(dir)).unwrap();
            current = Some(dest.join(dir));
        } else if let Some(path) = line.strip_prefix("Path: ") {
            let count: usize = lines
                .next()
                .and_then(|l| l.strip_prefix("Lines: "))
                .unwrap()
                .parse()
                .unwrap();
            let mut content = String::new();
            for _ in 0..count {
                content.push_str(lines.next().unwrap());
                content.push('\n');
            }
            let p = dest.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, content).unwrap();
            current = Some(p);
        } else if let Some(mode) = line.strip_prefix("Mode: ") {
            let mode = u32::from_str_radix(mode, 8).unwrap();
            if let Some(p) = &current {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
            }
        }
    }
}

/// A fixed-seed xorshift64 generator for the mutation tests.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Writes an executable shell script (a test double for a tool) and returns its path.
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}
