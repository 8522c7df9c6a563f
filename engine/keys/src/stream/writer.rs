//! Encrypting a stream of unknown length (a pipe, a socket, a generator) on one thread.
//!
//! The header carries the plaintext length, which a stream only knows at its end, so the
//! output must be seekable: a placeholder header is written first and the real one (whose
//! wrapped key authenticates the length) over it at the end. Each segment is sealed only once
//! the next byte is known to exist or not, so the last segment carries the last flag.
//! Memory: one segment buffer.

use std::io::{self, Read, Seek, SeekFrom, Write};

use zeroize::Zeroize as _;

use super::header::SEGMENT_OVERHEAD;
use super::{Draft, EncryptOptions, StreamError, file::EncryptReport};
use crate::keyring::KeySource;
use crate::meta::KeyId;

/// Fills `buf` from `reader` until it is full or the reader ends; returns the bytes read.
fn fill(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while let Some(rest) = buf.get_mut(got..) {
        if rest.is_empty() {
            break;
        }
        match reader.read(rest) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Encrypts everything `reader` yields as object `object_id` under `key`'s primary version,
/// writing the encrypted object to `writer` from its current position. Produces the same
/// bytes as [`super::encrypt_file`] given the same randomness.
pub fn encrypt_stream<R: Read, W: Write + Seek>(
    keys: &dyn KeySource,
    key: &KeyId,
    object_id: &str,
    mut reader: R,
    mut writer: W,
    options: &EncryptOptions,
) -> Result<EncryptReport, StreamError> {
    let draft = Draft::new(keys, key, object_id, options)?;
    let cipher = draft.cipher();
    let write_err = |what: &str| StreamError::io(format!("write the {what} of {object_id:?}"));
    let start = writer
        .stream_position()
        .map_err(StreamError::io("find the output position"))?;
    let header_len = draft.header.len();
    writer
        .write_all(&vec![0u8; header_len])
        .map_err(write_err("header placeholder"))?;

    let size = options.segment_size as usize;
    let mut buf = vec![0u8; size + SEGMENT_OVERHEAD];
    let mut aad = Vec::new();
    let mut carry: Option<u8> = None;
    let mut total: u64 = 0;
    let mut index: u64 = 0;
    let result: Result<(), StreamError> = (|| {
        loop {
            let body = buf
                .get_mut(8..8 + size)
                .ok_or_else(|| super::internal("segment buffer"))?;
            let mut n = 0;
            if let (Some(b), Some(first)) = (carry.take(), body.first_mut()) {
                *first = b;
                n = 1;
            }
            n += fill(&mut reader, body.get_mut(n..).unwrap_or_default())
                .map_err(StreamError::io(format!("read the input of {object_id:?}")))?;
            let mut last = n < size;
            if !last {
                let mut one = [0u8; 1];
                if fill(&mut reader, &mut one)
                    .map_err(StreamError::io(format!("read the input of {object_id:?}")))?
                    == 0
                {
                    last = true;
                } else {
                    carry = Some(one[0]);
                }
            }
            let seg = buf
                .get_mut(..n + SEGMENT_OVERHEAD)
                .ok_or_else(|| super::internal("segment buffer"))?;
            cipher.seal_as(index, last, seg, &mut aad)?;
            writer.write_all(seg).map_err(write_err("segments"))?;
            total += n as u64;
            index += 1;
            if last {
                return Ok(());
            }
        }
    })();
    buf.zeroize();
    result?;
    let (header, _) = draft.finish(total)?;
    let end = writer
        .stream_position()
        .map_err(StreamError::io("find the output position"))?;
    writer
        .seek(SeekFrom::Start(start))
        .and_then(|_| writer.write_all(&header.encode()))
        .and_then(|()| writer.seek(SeekFrom::Start(end)))
        .and_then(|_| writer.flush())
        .map_err(write_err("header"))?;
    Ok(EncryptReport {
        object_id: object_id.to_owned(),
        key: key.clone(),
        version: header.sealed_version,
        plaintext_len: total,
        segments: index,
        ciphertext_len: end - start,
    })
}

/// Encrypts `plaintext` into a new buffer (see [`super::encrypt_buffer`]).
pub fn encrypt_to_vec(
    keys: &dyn KeySource,
    key: &KeyId,
    object_id: &str,
    plaintext: &[u8],
    options: &EncryptOptions,
) -> Result<Vec<u8>, StreamError> {
    let mut out = Vec::new();
    super::encrypt_buffer(keys, key, object_id, plaintext, &mut out, options)?;
    Ok(out)
}
