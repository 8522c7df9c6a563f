//! Whole files: parallel encryption and decryption with positioned I/O, and rewrapping.
//!
//! Worker threads take segment indices from a shared counter; each reads its segment with
//! `pread`, seals or opens it in its own buffer, and writes it with `pwrite`, so no thread
//! shares a file offset and memory is one segment buffer per thread. Output goes to a
//! temporary file in the destination's directory, is synced, and is renamed over the
//! destination only when every segment succeeded: a failed decryption leaves no plaintext
//! file behind, and the input is never written.

use std::fs::{self, File};
use std::io::{self, Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::fs::{FileExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::Serialize;
use tempfile::NamedTempFile;
use zeroize::Zeroize as _;

use super::header::{Header, MAX_HEADER_LEN, SEGMENT_OVERHEAD, WRAP_NONCE_LEN};
use super::{
    DecryptOptions, Draft, EncryptOptions, Layout, StreamError, open_header, unwrap_header,
    wrap_object_key,
};
use crate::keyring::KeySource;
use crate::meta::KeyId;
use crate::secret::{RandomSource, SystemRandom};

/// What [`encrypt_file`] wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EncryptReport {
    /// The object id.
    pub object_id: String,
    /// The keyring key.
    pub key: KeyId,
    /// The key version (sealed and wrap version).
    pub version: u32,
    /// Plaintext bytes.
    pub plaintext_len: u64,
    /// Segments.
    pub segments: u64,
    /// Encrypted bytes written.
    pub ciphertext_len: u64,
}

/// What [`decrypt_file`] wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DecryptReport {
    /// The object id.
    pub object_id: String,
    /// The keyring key.
    pub key: KeyId,
    /// The version whose data key unwrapped the object key.
    pub wrap_version: u32,
    /// Plaintext bytes written.
    pub plaintext_len: u64,
    /// Segments.
    pub segments: u64,
}

/// What [`rewrap_file`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RewrapReport {
    /// The object id.
    pub object_id: String,
    /// The keyring key.
    pub key: KeyId,
    /// The wrap version before.
    pub from_version: u32,
    /// The wrap version after (the key's primary).
    pub to_version: u32,
    /// Whether the file was rewritten (false when it was already under the primary).
    pub rewritten: bool,
    /// Encrypted segment bytes copied unchanged.
    pub bytes_copied: u64,
}

/// Whether `a` and `b` name the same file (an absent `b` is not `a`).
fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

fn refuse_same(input: &Path, output: &Path) -> Result<(), StreamError> {
    if same_file(input, output) {
        return Err(StreamError::SameFile {
            input: input.to_owned(),
            output: output.to_owned(),
        });
    }
    Ok(())
}

fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// A temporary file beside `dest` (same directory, so the final rename is atomic), mode 0600.
fn temp_beside(dest: &Path) -> Result<NamedTempFile, StreamError> {
    let dir = parent(dest);
    tempfile::Builder::new()
        .prefix(".probity-keys-")
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(StreamError::io(format!(
            "create a temporary file in {}",
            dir.display()
        )))
}

/// Syncs `temp`, renames it to `dest` and syncs the directory.
fn commit(temp: NamedTempFile, dest: &Path) -> Result<(), StreamError> {
    temp.as_file().sync_all().map_err(StreamError::io(format!(
        "sync the output for {}",
        dest.display()
    )))?;
    temp.persist(dest).map_err(|e| {
        StreamError::io(format!("rename the output to {}", dest.display()))(e.error)
    })?;
    let dir = parent(dest);
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(StreamError::io(format!(
            "sync the directory {}",
            dir.display()
        )))
}

fn len_of(file: &mut File, path: &Path) -> Result<u64, StreamError> {
    file.seek(SeekFrom::End(0)).map_err(StreamError::io(format!(
        "find the length of {}",
        path.display()
    )))
}

/// What a worker does with one segment: index, its buffer, AAD scratch.
type SegmentWork<'f> = &'f (dyn Fn(u64, &mut [u8], &mut Vec<u8>) -> Result<(), StreamError> + Sync);

/// Runs `work(segment, buffer, aad scratch)` for every segment on `threads` threads, each
/// with one buffer of `buf_len` bytes (wiped at the end). Stops at the first failure and
/// returns the failure of the lowest segment index seen.
fn run_parallel(
    threads: usize,
    segments: u64,
    buf_len: usize,
    work: SegmentWork<'_>,
) -> Result<(), StreamError> {
    let threads = u64::try_from(threads)
        .unwrap_or(1)
        .clamp(1, segments.max(1));
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<(u64, StreamError)>> = Mutex::new(None);
    let worker = || {
        let mut buf = vec![0u8; buf_len];
        let mut aad = Vec::with_capacity(1100);
        while !stop.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= segments {
                break;
            }
            if let Err(e) = work(i, &mut buf, &mut aad) {
                stop.store(true, Ordering::Relaxed);
                let mut f = failure
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if f.as_ref().is_none_or(|(j, _)| i < *j) {
                    *f = Some((i, e));
                }
                break;
            }
        }
        buf.zeroize();
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
    });
    match failure
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// Encrypts the file `input` as object `object_id` under `key`'s primary version into
/// `output` (written to a temporary file beside it, mode 0600, then renamed). Refuses to write over the
/// input. Memory: `options.threads` × (segment size + 24) bytes.
pub fn encrypt_file(
    keys: &dyn KeySource,
    key: &KeyId,
    object_id: &str,
    input: &Path,
    output: &Path,
    options: &EncryptOptions,
) -> Result<EncryptReport, StreamError> {
    refuse_same(input, output)?;
    let mut src =
        File::open(input).map_err(StreamError::io(format!("open {}", input.display())))?;
    let len = len_of(&mut src, input)?;
    let draft = Draft::new(keys, key, object_id, options)?;
    let (header, cipher) = draft.finish(len)?;
    let layout = cipher.layout;
    let temp = temp_beside(output)?;
    let out = temp.as_file();
    out.set_len(layout.total_len())
        .and_then(|()| out.write_all_at(&header.encode(), 0))
        .map_err(StreamError::io(format!(
            "write the header for {}",
            output.display()
        )))?;
    let segment_buf = options.segment_size as usize + SEGMENT_OVERHEAD;
    run_parallel(
        options.threads.get(),
        layout.segments,
        segment_buf,
        &|i, buf, aad| {
            let n = layout.plain_len(i);
            let seg = buf
                .get_mut(..n + SEGMENT_OVERHEAD)
                .ok_or_else(|| super::internal("segment buffer"))?;
            let body = seg
                .get_mut(8..8 + n)
                .ok_or_else(|| super::internal("segment buffer"))?;
            src.read_exact_at(body, layout.plain_offset(i))
                .map_err(|e| {
                    if e.kind() == io::ErrorKind::UnexpectedEof {
                        StreamError::InputChanged {
                            path: input.to_owned(),
                            expected: len,
                            actual: fs::metadata(input).map(|m| m.len()).unwrap_or(0),
                        }
                    } else {
                        StreamError::io(format!("read segment {i} of {}", input.display()))(e)
                    }
                })?;
            cipher.seal(i, seg, aad)?;
            out.write_all_at(seg, layout.cipher_offset(i))
                .map_err(StreamError::io(format!(
                    "write segment {i} of {}",
                    output.display()
                )))
        },
    )?;
    let now = len_of(&mut src, input)?;
    if now != len {
        return Err(StreamError::InputChanged {
            path: input.to_owned(),
            expected: len,
            actual: now,
        });
    }
    commit(temp, output)?;
    Ok(EncryptReport {
        object_id: object_id.to_owned(),
        key: key.clone(),
        version: header.sealed_version,
        plaintext_len: len,
        segments: layout.segments,
        ciphertext_len: layout.total_len(),
    })
}

/// Reads and parses the header at the start of `file`.
fn read_header(file: &File, len: u64, path: &Path) -> Result<Header, StreamError> {
    let want = usize::try_from(len.min(MAX_HEADER_LEN as u64)).unwrap_or(MAX_HEADER_LEN);
    let mut bytes = vec![0u8; want];
    file.read_exact_at(&mut bytes, 0)
        .map_err(StreamError::io(format!(
            "read the header of {}",
            path.display()
        )))?;
    Ok(Header::parse(&bytes)?.0)
}

/// Decrypts the encrypted file `input`, which must be object `object_id`, into `output`
/// (a temporary file beside it, mode 0600, renamed when every segment authenticated; removed
/// otherwise). Refuses to write over the input. Memory: `options.threads` × (segment size +
/// 24) bytes.
pub fn decrypt_file(
    keys: &dyn KeySource,
    object_id: &str,
    input: &Path,
    output: &Path,
    options: &DecryptOptions,
) -> Result<DecryptReport, StreamError> {
    refuse_same(input, output)?;
    let mut src =
        File::open(input).map_err(StreamError::io(format!("open {}", input.display())))?;
    let len = len_of(&mut src, input)?;
    let header = read_header(&src, len, input)?;
    let cipher = open_header(keys, &header, object_id)?;
    let layout = cipher.layout;
    layout.check_len(object_id, len)?;
    let temp = temp_beside(output)?;
    let out = temp.as_file();
    out.set_len(layout.plaintext_len)
        .map_err(StreamError::io(format!(
            "size the output {}",
            output.display()
        )))?;
    let segment_buf = header.segment_size as usize + SEGMENT_OVERHEAD;
    run_parallel(
        options.threads.get(),
        layout.segments,
        segment_buf,
        &|i, buf, aad| {
            let n = layout.plain_len(i);
            let seg = buf
                .get_mut(..n + SEGMENT_OVERHEAD)
                .ok_or_else(|| super::internal("segment buffer"))?;
            src.read_exact_at(seg, layout.cipher_offset(i))
                .map_err(StreamError::io(format!(
                    "read segment {i} of {}",
                    input.display()
                )))?;
            cipher.open(i, seg, aad)?;
            let plain = seg
                .get(8..8 + n)
                .ok_or_else(|| super::internal("segment buffer"))?;
            out.write_all_at(plain, layout.plain_offset(i))
                .map_err(StreamError::io(format!(
                    "write segment {i} of {}",
                    output.display()
                )))
        },
    )?;
    commit(temp, output)?;
    Ok(DecryptReport {
        object_id: object_id.to_owned(),
        key: header.key_id.clone(),
        wrap_version: header.wrap_version,
        plaintext_len: layout.plaintext_len,
        segments: layout.segments,
    })
}

/// Re-wraps the object key of the encrypted file at `path` (object `object_id`) under its
/// key's primary version. Only the header changes; the segments are copied unchanged (by the
/// kernel where it can), never decrypted. The new file is written beside the old one, synced
/// and renamed over it: the old file's bytes are never overwritten in place, so a reader that
/// has it open keeps reading the old, still valid, object.
pub fn rewrap_file(
    keys: &dyn KeySource,
    object_id: &str,
    path: &Path,
) -> Result<RewrapReport, StreamError> {
    rewrap_with(keys, object_id, path, &SystemRandom::new())
}

pub(crate) fn rewrap_with(
    keys: &dyn KeySource,
    object_id: &str,
    path: &Path,
    random: &dyn RandomSource,
) -> Result<RewrapReport, StreamError> {
    let mut src = File::open(path).map_err(StreamError::io(format!("open {}", path.display())))?;
    let len = len_of(&mut src, path)?;
    let header = read_header(&src, len, path)?;
    let object_key = unwrap_header(keys, &header)?;
    if header.object_id != object_id {
        return Err(StreamError::ObjectMismatch {
            expected: object_id.to_owned(),
            found: header.object_id.clone(),
        });
    }
    let layout = Layout::of(&header);
    layout.check_len(object_id, len)?;
    let (primary, data_key) = keys.encryption_key(&header.key_id)?;
    let mut report = RewrapReport {
        object_id: object_id.to_owned(),
        key: header.key_id.clone(),
        from_version: header.wrap_version,
        to_version: primary,
        rewritten: false,
        bytes_copied: 0,
    };
    if primary == header.wrap_version {
        return Ok(report);
    }
    let mut new = header.clone();
    new.wrap_version = primary;
    let mut wrap_nonce = [0u8; WRAP_NONCE_LEN];
    random.fill(&mut wrap_nonce)?;
    new.wrap_nonce = wrap_nonce;
    wrap_object_key(&mut new, &data_key, &object_key)?;
    let mode = src
        .metadata()
        .map(|m| m.permissions().mode() & 0o7777)
        .map_err(StreamError::io(format!("inspect {}", path.display())))?;
    let mut temp = temp_beside(path)?;
    temp.as_file_mut()
        .write_all(&new.encode())
        .map_err(StreamError::io(format!(
            "write the new header for {}",
            path.display()
        )))?;
    src.seek(SeekFrom::Start(layout.header_len))
        .map_err(StreamError::io(format!("seek in {}", path.display())))?;
    let body = len - layout.header_len;
    let copied = io::copy(&mut (&src).take(body), temp.as_file_mut()).map_err(StreamError::io(
        format!("copy the segments of {}", path.display()),
    ))?;
    if copied != body {
        return Err(StreamError::InputChanged {
            path: path.to_owned(),
            expected: len,
            actual: layout.header_len + copied,
        });
    }
    temp.as_file()
        .set_permissions(fs::Permissions::from_mode(mode))
        .map_err(StreamError::io(format!(
            "set the mode of the new {}",
            path.display()
        )))?;
    commit(temp, path)?;
    report.rewritten = true;
    report.bytes_copied = copied;
    Ok(report)
}
