//! Objects held in memory: parallel encryption and decryption between buffers.
//!
//! The cipher reads the source and writes the destination in one pass (AES-GCM's counter
//! mode over an in/out buffer pair), so no byte is copied besides the one the cipher itself
//! writes: this is the path with the least overhead over the raw cipher. Destination
//! vectors are resized in place, so a caller that reuses one pays no allocation or page
//! faults per object.

use aes_gcm::aead::inout::InOutBuf;
use zeroize::Zeroize as _;

use super::file::{DecryptReport, EncryptReport};
use super::header::{Header, SEGMENT_OVERHEAD};
use super::{
    DecryptOptions, Draft, EncryptOptions, ObjectCipher, StreamError, internal, open_header,
};
use crate::keyring::KeySource;
use crate::meta::KeyId;

/// One unit of work: segment index, source bytes, destination bytes.
type Job<'a> = (u64, &'a [u8], &'a mut [u8]);

/// What a worker does with one segment: index, source, destination, AAD scratch.
type SegmentWork<'f> =
    &'f (dyn Fn(u64, &[u8], &mut [u8], &mut Vec<u8>) -> Result<(), StreamError> + Sync);

/// Runs `f` over `jobs` on up to `threads` threads, each taking a contiguous run of
/// segments; returns the error of the lowest failing segment.
fn run<'a>(threads: usize, mut jobs: Vec<Job<'a>>, f: SegmentWork<'_>) -> Result<(), StreamError> {
    let per = jobs.len().div_ceil(threads.max(1)).max(1);
    let mut failures: Vec<(u64, StreamError)> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .chunks_mut(per)
            .map(|group| {
                s.spawn(move || {
                    let mut aad = Vec::with_capacity(1100);
                    for (i, src, dst) in group.iter_mut() {
                        if let Err(e) = f(*i, src, dst, &mut aad) {
                            return Some((*i, e));
                        }
                    }
                    None
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| {
                h.join()
                    .unwrap_or_else(|_| Some((u64::MAX, internal("worker"))))
            })
            .collect()
    });
    failures.sort_by_key(|(i, _)| *i);
    match failures.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// Sets `v`'s length to `n` without rewriting bytes it already holds.
fn set_len(v: &mut Vec<u8>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    } else {
        v.truncate(n);
    }
}

impl ObjectCipher {
    /// Seals plaintext `src` as segment `i` into `dst` (object tag, ciphertext, GCM tag).
    fn seal_from(
        &self,
        i: u64,
        src: &[u8],
        dst: &mut [u8],
        aad: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        let (tag8, rest) = dst
            .split_first_chunk_mut::<8>()
            .ok_or_else(|| internal("segment layout"))?;
        let (body, tag_out) = rest
            .split_last_chunk_mut::<16>()
            .ok_or_else(|| internal("segment layout"))?;
        *tag8 = self.prefix;
        let inout = InOutBuf::new(src, body).map_err(|_| internal("segment layout"))?;
        let tag = self.seal_inout(i, inout, aad)?;
        *tag_out = tag;
        Ok(())
    }

    /// Opens segment `i` (`src`: object tag, ciphertext, GCM tag) into `dst`. On failure
    /// `dst` holds no plaintext.
    fn open_into(
        &self,
        i: u64,
        src: &[u8],
        dst: &mut [u8],
        aad: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        let (tag8, rest) = src
            .split_first_chunk::<8>()
            .ok_or_else(|| internal("segment layout"))?;
        let (body, tag) = rest
            .split_last_chunk::<16>()
            .ok_or_else(|| internal("segment layout"))?;
        if *tag8 == self.prefix {
            let inout = InOutBuf::new(body, dst).map_err(|_| internal("segment layout"))?;
            if self.open_inout(i, inout, tag, aad) {
                return Ok(());
            }
        }
        // Rare path: diagnose on a copy of the ciphertext, then wipe it.
        dst.copy_from_slice(body);
        let result = self.open_parts(i, tag8, dst, tag, aad);
        dst.zeroize();
        match result {
            Ok(()) => Err(internal("segment opened only on the second try")),
            Err(e) => Err(e),
        }
    }
}

/// Encrypts `plaintext` as object `object_id` under `key`'s primary version into `out`
/// (resized to the encrypted length; its capacity is reused), on `options.threads`
/// threads. Produces the same bytes as [`super::encrypt_stream`] and
/// [`super::encrypt_file`] given the same randomness.
pub fn encrypt_buffer(
    keys: &dyn KeySource,
    key: &KeyId,
    object_id: &str,
    plaintext: &[u8],
    out: &mut Vec<u8>,
    options: &EncryptOptions,
) -> Result<EncryptReport, StreamError> {
    let draft = Draft::new(keys, key, object_id, options)?;
    let (header, cipher) = draft.finish(plaintext.len() as u64)?;
    let layout = cipher.layout;
    let total = usize::try_from(layout.total_len()).map_err(|_| StreamError::TooLarge {
        len: layout.plaintext_len,
        segment_size: layout.segment_size,
    })?;
    set_len(out, total);
    let head = header.encode();
    let (head_out, segments) = out.split_at_mut(head.len());
    head_out.copy_from_slice(&head);
    let stride = layout.segment_size as usize + SEGMENT_OVERHEAD;
    let jobs: Vec<Job<'_>> = if plaintext.is_empty() {
        vec![(0, plaintext, segments)]
    } else {
        plaintext
            .chunks(layout.segment_size as usize)
            .zip(segments.chunks_mut(stride))
            .zip(0u64..)
            .map(|((src, dst), i)| (i, src, dst))
            .collect()
    };
    run(options.threads.get(), jobs, &|i, src, dst, aad| {
        cipher.seal_from(i, src, dst, aad)
    })?;
    Ok(EncryptReport {
        object_id: object_id.to_owned(),
        key: key.clone(),
        version: header.sealed_version,
        plaintext_len: layout.plaintext_len,
        segments: layout.segments,
        ciphertext_len: layout.total_len(),
    })
}

/// Decrypts the encrypted object `sealed`, which must be object `object_id`, into `out`
/// (resized to the plaintext length; its capacity is reused), on `options.threads` threads.
/// On any failure `out` is wiped and emptied: no plaintext of an object that failed is
/// released, not even of the segments that authenticated.
pub fn decrypt_buffer(
    keys: &dyn KeySource,
    object_id: &str,
    sealed: &[u8],
    out: &mut Vec<u8>,
    options: &DecryptOptions,
) -> Result<DecryptReport, StreamError> {
    let result = decrypt_buffer_inner(keys, object_id, sealed, out, options);
    if result.is_err() {
        out.zeroize();
        out.clear();
    }
    result
}

fn decrypt_buffer_inner(
    keys: &dyn KeySource,
    object_id: &str,
    sealed: &[u8],
    out: &mut Vec<u8>,
    options: &DecryptOptions,
) -> Result<DecryptReport, StreamError> {
    let (header, header_len) = Header::parse(sealed)?;
    let cipher = open_header(keys, &header, object_id)?;
    let layout = cipher.layout;
    layout.check_len(object_id, sealed.len() as u64)?;
    let plain_len = usize::try_from(layout.plaintext_len).map_err(|_| StreamError::TooLarge {
        len: layout.plaintext_len,
        segment_size: layout.segment_size,
    })?;
    set_len(out, plain_len);
    let segments = sealed.get(header_len..).unwrap_or_default();
    let stride = layout.segment_size as usize + SEGMENT_OVERHEAD;
    let jobs: Vec<Job<'_>> = if plain_len == 0 {
        vec![(0, segments, out.as_mut_slice())]
    } else {
        segments
            .chunks(stride)
            .zip(out.chunks_mut(layout.segment_size as usize))
            .zip(0u64..)
            .map(|((src, dst), i)| (i, src, dst))
            .collect()
    };
    run(options.threads.get(), jobs, &|i, src, dst, aad| {
        cipher.open_into(i, src, dst, aad)
    })?;
    Ok(DecryptReport {
        object_id: object_id.to_owned(),
        key: header.key_id.clone(),
        wrap_version: header.wrap_version,
        plaintext_len: layout.plaintext_len,
        segments: layout.segments,
    })
}
