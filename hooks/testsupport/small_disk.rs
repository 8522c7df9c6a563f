//! A small filesystem that fills up on demand: a tmpfs of a few MiB mounted (as root)
//! on a fresh directory, unmounted when the guard drops. Tests of a full disk put a
//! state directory on it, fill it with a ballast file, and free the ballast to let the
//! disk recover.
//!
//! Shared by the engine's and the server's test binaries through `#[path]`; it uses
//! the standard library and `tempfile` alone.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A mounted tmpfs, unmounted (lazily, so an open file cannot keep it) on drop.
pub struct SmallDisk {
    mount: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Mounts a tmpfs of `mib` MiB, mode 0700, on a new temporary directory.
    pub fn mount(mib: u32) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("disk");
        std::fs::create_dir(&mount).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={mib}m,mode=0700"))
            .arg("probity-test")
            .arg(&mount)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mounting a tmpfs (these tests run as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk { mount, _dir: dir }
    }

    /// The mounted directory.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// Writes a ballast file until the disk refuses a byte more.
    pub fn fill(&self) {
        let mut file = std::fs::File::create(self.ballast()).unwrap();
        let chunk = vec![0xA5u8; 64 * 1024];
        let mut size = chunk.len();
        // Down to single bytes, so that no block is left over.
        while size > 0 {
            match file.write(&chunk[..size]) {
                Ok(0) => size /= 2,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(28) => size /= 2,
                Err(e) => panic!("filling the small disk: {e}"),
            }
        }
        let _ = file.sync_all();
    }

    /// Removes the ballast: the disk has room again.
    pub fn free(&self) {
        std::fs::remove_file(self.ballast()).unwrap();
    }

    fn ballast(&self) -> PathBuf {
        self.mount.join("ballast")
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}
