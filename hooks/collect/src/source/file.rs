//! Reading a collector's file: regular files only, never more than a cap.
//!
//! The file is opened with `O_NONBLOCK`, then checked with `fstat` on the open descriptor, so
//! a FIFO or a character device put where a file was expected fails at once instead of
//! blocking the agent (and there is no window between the check and the open). On a regular
//! file `O_NONBLOCK` changes nothing.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a file could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FileError {
    /// No such file.
    #[error("{path}: no such file")]
    NotFound {
        /// The path.
        path: PathBuf,
    },
    /// Permission denied (EACCES or EPERM).
    #[error("{path}: permission denied")]
    PermissionDenied {
        /// The path.
        path: PathBuf,
    },
    /// Not a regular file (a FIFO, socket, device or directory).
    #[error("{path}: not a regular file ({kind})")]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// Longer than the cap.
    #[error("{path}: larger than the limit of {limit} bytes")]
    TooLarge {
        /// The path.
        path: PathBuf,
        /// The cap.
        limit: usize,
    },
    /// Any other I/O error (EIO, ENODATA…).
    #[error("{path}: read failed")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl FileError {
    /// Classifies an I/O error on `path`.
    pub fn from_io(path: &Path, source: std::io::Error) -> Self {
        let path = path.to_path_buf();
        match source.kind() {
            std::io::ErrorKind::NotFound => Self::NotFound { path },
            std::io::ErrorKind::PermissionDenied => Self::PermissionDenied { path },
            _ => Self::Io { path, source },
        }
    }
}

/// Reads a regular file of at most `limit` bytes.
pub fn read_regular_file(path: &Path, limit: usize) -> Result<Vec<u8>, FileError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(|e| FileError::from_io(path, e))?;
    let meta = file.metadata().map_err(|e| FileError::from_io(path, e))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_fifo() {
            "FIFO"
        } else if ft.is_dir() {
            "directory"
        } else if ft.is_socket() {
            "socket"
        } else if ft.is_char_device() {
            "character device"
        } else if ft.is_block_device() {
            "block device"
        } else {
            "special file"
        };
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind,
        });
    }
    // sysfs and procfs report sizes that are not the content length: read to the cap.
    let mut buf = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    file.take(cap)
        .read_to_end(&mut buf)
        .map_err(|e| FileError::from_io(path, e))?;
    if buf.len() > limit {
        return Err(FileError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_small_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"12345").unwrap();
        assert_eq!(read_regular_file(&p, 5).unwrap(), b"12345");
        assert!(matches!(
            read_regular_file(&p, 4),
            Err(FileError::TooLarge { limit: 4, .. })
        ));
    }

    #[test]
    fn a_directory_is_not_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            read_regular_file(dir.path(), 10),
            Err(FileError::NotRegular {
                kind: "directory",
                ..
            })
        ));
    }

    #[test]
    fn a_missing_file_is_not_found() {
        assert!(matches!(
            read_regular_file(Path::new("/nonexistent/probity"), 10),
            Err(FileError::NotFound { .. })
        ));
    }
}
