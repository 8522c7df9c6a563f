//! Parallel chunk hashing of a file or block device with bounded memory.
//!
//! Worker threads take chunk indices from a shared counter and read each chunk with
//! positioned reads (`pread`), so no thread shares a file offset. A chunk is read and hashed
//! in pieces of at most [`READ_PIECE`] bytes, which stay in the core's L2 cache between the
//! copy and the hash; memory is one piece buffer per thread plus 32 bytes per leaf.

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sha2::{Digest as _, Sha256};
use thiserror::Error;

use super::manifest::{DEFAULT_CHUNK_SIZE, Hash, Manifest};

/// Bytes read and hashed at a time within a chunk (1 MiB, half a typical L2 cache).
pub const READ_PIECE: u32 = 1024 * 1024;

/// How to hash an object.
#[derive(Clone, Copy)]
pub struct HashOptions<'a> {
    /// Chunk size in bytes. Default: 4 MiB ([`super::Manifest::DEFAULT_CHUNK_SIZE`]).
    pub chunk_size: u32,
    /// Worker threads. Default: the cores available to the process (1 if unknown).
    pub threads: NonZeroUsize,
    /// Called after each chunk with the cumulative bytes hashed. Default: none.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
}

impl std::fmt::Debug for HashOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashOptions")
            .field("chunk_size", &self.chunk_size)
            .field("threads", &self.threads)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl Default for HashOptions<'_> {
    fn default() -> Self {
        Self {
            chunk_size: DEFAULT_CHUNK_SIZE,
            threads: crate::available_cores(),
            progress: None,
        }
    }
}

/// Why an object could not be hashed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum HashError {
    /// The file could not be opened or its size read.
    #[error("cannot open {path} for hashing")]
    Open {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A chunk could not be read (the object may have shrunk while being read).
    #[error("cannot read chunk {index} at byte offset {offset} of {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// Chunk index.
        index: u64,
        /// Byte offset of the chunk.
        offset: u64,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The object has more chunks than this platform can index in memory.
    #[error("{path} is too large to hash ({size} bytes)")]
    TooLarge {
        /// The path.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
}

/// The size and chunk leaves of a hashed object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashedObject {
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of each chunk, in order.
    pub leaves: Vec<Hash>,
}

/// Opens `path` and returns the file with its size (seeking to the end, which also works
/// for block devices whose metadata length is 0). Only a regular file or a block device
/// is opened, and the open never waits: a FIFO, socket or character device named here
/// is an error at once, judged on the opened descriptor (not on the path, which could
/// change in between).
pub(crate) fn open_sized(path: &Path) -> Result<(File, u64), HashError> {
    let open_err = |source| HashError::Open {
        path: path.to_owned(),
        source,
    };
    let file = HashedObject::open(path).map_err(open_err)?;
    sized(file, path)
}

impl HashedObject {
    /// Opens `path` for reading without blocking, and refuses anything that is not a
    /// regular file or a block device.
    pub fn open(path: &Path) -> std::io::Result<File> {
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(path)?;
        let kind = file.metadata()?.file_type();
        if kind.is_file() || kind.is_block_device() {
            Ok(file)
        } else {
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file or a block device",
            ))
        }
    }
}

/// An opened object with its size.
pub(crate) fn sized(mut file: File, path: &Path) -> Result<(File, u64), HashError> {
    let size = file
        .seek(SeekFrom::End(0))
        .map_err(|source| HashError::Open {
            path: path.to_owned(),
            source,
        })?;
    Ok((file, size))
}

impl HashedObject {
    /// Hashes the whole file or block device at `path` in parallel.
    pub fn hash_file(path: &Path, options: &HashOptions<'_>) -> Result<HashedObject, HashError> {
        let (file, size) = open_sized(path)?;
        let leaves = hash_chunks(&file, path, size, options)?;
        Ok(HashedObject { size, leaves })
    }
}

/// Hashes `size` bytes of `file` in chunks; `path` is only used in errors.
pub(crate) fn hash_chunks(
    file: &File,
    path: &Path,
    size: u64,
    options: &HashOptions<'_>,
) -> Result<Vec<Hash>, HashError> {
    let chunk_size = options.chunk_size.max(1);
    let count = Manifest::chunks_for(size, chunk_size);
    let n = usize::try_from(count).map_err(|_| HashError::TooLarge {
        path: path.to_owned(),
        size,
    })?;
    let threads = options.threads.get().min(n.max(1)).max(1);
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<HashError>> = Mutex::new(None);
    let results: Vec<Vec<(u64, Hash)>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    let mut buf = vec![0u8; chunk_size.min(READ_PIECE) as usize];
                    'chunks: loop {
                        if failed.load(Ordering::Relaxed) {
                            break;
                        }
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        if index >= count {
                            break;
                        }
                        let offset = index * u64::from(chunk_size);
                        let len = (size - offset).min(u64::from(chunk_size));
                        let mut hasher = Sha256::new();
                        let mut at = 0u64;
                        while at < len {
                            let piece_len = (len - at).min(buf.len() as u64) as usize;
                            let Some(piece) = buf.get_mut(..piece_len) else {
                                break 'chunks;
                            };
                            if let Err(source) = file.read_exact_at(piece, offset + at) {
                                failed.store(true, Ordering::Relaxed);
                                if let Ok(mut slot) = first_error.lock() {
                                    slot.get_or_insert(HashError::Read {
                                        path: path.to_owned(),
                                        index,
                                        offset,
                                        source,
                                    });
                                }
                                break 'chunks;
                            }
                            hasher.update(&*piece);
                            at += piece_len as u64;
                        }
                        out.push((index, hasher.finalize().into()));
                        let total = done.fetch_add(len, Ordering::Relaxed) + len;
                        if let Some(progress) = options.progress {
                            progress(total);
                        }
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_default())
            .collect()
    });
    if let Some(err) = first_error.into_inner().ok().flatten() {
        return Err(err);
    }
    let mut leaves = vec![[0u8; 32]; n];
    let mut filled = 0usize;
    for (index, hash) in results.into_iter().flatten() {
        if let Some(slot) = usize::try_from(index).ok().and_then(|i| leaves.get_mut(i)) {
            *slot = hash;
            filled += 1;
        }
    }
    if filled != n {
        // Only possible if a worker panicked; report it as a read failure of the object.
        return Err(HashError::Read {
            path: path.to_owned(),
            index: filled as u64,
            offset: 0,
            source: io::Error::other("a hashing thread stopped unexpectedly"),
        });
    }
    Ok(leaves)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn hashes_match_sequential() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        for threads in [1, 2, 3, 8] {
            let opts = HashOptions {
                chunk_size: 1024,
                threads: NonZeroUsize::new(threads).unwrap(),
                progress: None,
            };
            let h = HashedObject::hash_file(f.path(), &opts).unwrap();
            assert_eq!(h.size, 10_000);
            let expected: Vec<Hash> = data
                .chunks(1024)
                .map(|c| Sha256::digest(c).into())
                .collect();
            assert_eq!(h.leaves, expected);
        }
    }

    #[test]
    fn empty_file_has_no_leaves() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let h = HashedObject::hash_file(f.path(), &HashOptions::default()).unwrap();
        assert_eq!(h.size, 0);
        assert!(h.leaves.is_empty());
    }

    #[test]
    fn progress_reaches_size() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[1u8; 5000]).unwrap();
        let last = AtomicU64::new(0);
        let hook = |n: u64| {
            last.fetch_max(n, Ordering::Relaxed);
        };
        let opts = HashOptions {
            chunk_size: 1024,
            threads: NonZeroUsize::new(2).unwrap(),
            progress: Some(&hook),
        };
        HashedObject::hash_file(f.path(), &opts).unwrap();
        assert_eq!(last.load(Ordering::Relaxed), 5000);
    }
}

#[cfg(test)]
mod open_tests {
    use super::*;

    /// Issue: naming a FIFO made verification block in `open` until someone wrote to it.
    #[test]
    fn bug_a_fifo_blocked_the_verifier_until_written_to() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let (tx, rx) = std::sync::mpsc::channel();
        let f = fifo.clone();
        std::thread::spawn(move || {
            // The kind is in the cause, never in the message itself.
            let _ = tx.send(open_sized(&f).map(|_| ()).map_err(|e| {
                let cause = std::error::Error::source(&e).map(ToString::to_string);
                format!("{e}: {}", cause.unwrap_or_default())
            }));
        });
        let outcome = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("opening a FIFO must not block");
        let err = outcome.unwrap_err();
        assert!(
            err.contains("not a regular file or a block device"),
            "{err}"
        );
        assert!(HashedObject::open(Path::new("/dev/null")).is_err());
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        assert_eq!(open_sized(&plain).unwrap().1, 1);
    }
}
