//! [`DecryptingReader`]: random-access decryption (`Read + Seek`) that decrypts only the
//! segments a read touches.

use std::io::{self, Read, Seek, SeekFrom};

use zeroize::{Zeroize as _, Zeroizing};

use super::header::{Header, MAX_HEADER_LEN, NONCE_PREFIX_LEN, SEGMENT_OVERHEAD, TAG_LEN};
use super::{ObjectCipher, StreamError, open_header};
use crate::keyring::KeySource;

/// Decrypts an encrypted object as it is read, segment by segment, with random access.
///
/// * Opening authenticates the header (through the keyring), checks it is the expected
///   object's, and checks the object's length against the header, so truncation and
///   extension are reported before any byte is read.
/// * A read decrypts the segment under the position (once: the segment stays decrypted in
///   the reader's buffer until the position leaves it); a read whose buffer spans a whole
///   segment decrypts straight into the caller's buffer.
/// * A segment that fails authentication releases none of its plaintext: that read fails
///   with the [`StreamError`] (inside an [`io::Error`]; see [`StreamError::from_io`]) and
///   every later read fails with [`StreamError::Poisoned`].
///
/// Memory: one segment buffer.
pub struct DecryptingReader<R> {
    inner: R,
    header: Header,
    cipher: ObjectCipher,
    pos: u64,
    /// The current segment, encrypted or (when `loaded`) decrypted; wiped on drop.
    buf: Zeroizing<Vec<u8>>,
    loaded: Option<u64>,
    aad: Vec<u8>,
    failure: Option<(u64, u64)>,
}

impl<R> std::fmt::Debug for DecryptingReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecryptingReader")
            .field("object", &self.header.object_id)
            .field("key", &self.header.key_id)
            .field("wrap_version", &self.header.wrap_version)
            .field("pos", &self.pos)
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

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

impl<R: Read + Seek> DecryptingReader<R> {
    /// Opens the encrypted object in `inner`, which must be object `object_id`.
    pub fn open(keys: &dyn KeySource, object_id: &str, mut inner: R) -> Result<Self, StreamError> {
        let len = inner
            .seek(SeekFrom::End(0))
            .map_err(StreamError::io(format!("find the length of {object_id:?}")))?;
        inner
            .seek(SeekFrom::Start(0))
            .map_err(StreamError::io(format!("seek in {object_id:?}")))?;
        let mut head = vec![0u8; usize::try_from(len.min(MAX_HEADER_LEN as u64)).unwrap_or(0)];
        let got = fill(&mut inner, &mut head)
            .map_err(StreamError::io(format!("read the header of {object_id:?}")))?;
        head.truncate(got);
        let (header, _) = Header::parse(&head)?;
        let cipher = open_header(keys, &header, object_id)?;
        cipher.layout.check_len(object_id, len)?;
        let buf = Zeroizing::new(vec![0u8; header.segment_size as usize + SEGMENT_OVERHEAD]);
        Ok(Self {
            inner,
            header,
            cipher,
            pos: 0,
            buf,
            loaded: None,
            aad: Vec::new(),
            failure: None,
        })
    }

    /// The object's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The plaintext length.
    pub fn len(&self) -> u64 {
        self.header.plaintext_len
    }

    /// Whether the plaintext is empty.
    pub fn is_empty(&self) -> bool {
        self.header.plaintext_len == 0
    }

    /// The segment that failed and its byte offset, once one has.
    pub fn failure(&self) -> Option<(u64, u64)> {
        self.failure
    }

    /// The underlying reader.
    pub fn into_inner(self) -> R {
        self.inner
    }

    fn poison(&mut self, segment: u64, e: StreamError) -> io::Error {
        self.buf.zeroize();
        self.loaded = None;
        self.failure = Some((segment, self.cipher.layout.cipher_offset(segment)));
        io::Error::other(e)
    }

    fn read_segment_into(&mut self, i: u64, seg_len: usize) -> Result<(), StreamError> {
        let layout = self.cipher.layout;
        let object = &self.cipher.object;
        self.inner
            .seek(SeekFrom::Start(layout.cipher_offset(i)))
            .map_err(StreamError::io(format!(
                "seek to segment {i} of {object:?}"
            )))?;
        let seg = self
            .buf
            .get_mut(..seg_len)
            .ok_or_else(|| super::internal("segment buffer"))?;
        let got = fill(&mut self.inner, seg)
            .map_err(StreamError::io(format!("read segment {i} of {object:?}")))?;
        if got < seg_len {
            return Err(StreamError::PartialSegment {
                object: object.clone(),
                segment: i,
                offset: layout.cipher_offset(i),
                have: got as u64,
                need: seg_len as u64,
            });
        }
        self.cipher.open(i, seg, &mut self.aad)
    }

    /// Decrypts segment `i` straight into `out` (exactly its plaintext length).
    fn read_segment_direct(&mut self, i: u64, out: &mut [u8]) -> Result<(), StreamError> {
        let layout = self.cipher.layout;
        let object = &self.cipher.object;
        let short = |have: usize| StreamError::PartialSegment {
            object: object.clone(),
            segment: i,
            offset: layout.cipher_offset(i),
            have: have as u64,
            need: layout.cipher_len(i) as u64,
        };
        let io_err = || StreamError::io(format!("read segment {i} of {object:?}"));
        self.inner
            .seek(SeekFrom::Start(layout.cipher_offset(i)))
            .map_err(StreamError::io(format!(
                "seek to segment {i} of {object:?}"
            )))?;
        let mut object_tag = [0u8; NONCE_PREFIX_LEN];
        let mut tag = [0u8; TAG_LEN];
        let a = fill(&mut self.inner, &mut object_tag).map_err(io_err())?;
        let b = if a == NONCE_PREFIX_LEN {
            fill(&mut self.inner, out).map_err(io_err())?
        } else {
            0
        };
        let c = if b == out.len() {
            fill(&mut self.inner, &mut tag).map_err(io_err())?
        } else {
            0
        };
        if a + b + c < layout.cipher_len(i) {
            out.zeroize();
            return Err(short(a + b + c));
        }
        self.cipher
            .open_parts(i, &object_tag, out, &tag, &mut self.aad)
            .inspect_err(|_| out.zeroize())
    }
}

impl<R: Read + Seek> Read for DecryptingReader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if let Some((segment, offset)) = self.failure {
            return Err(io::Error::other(StreamError::Poisoned {
                object: self.cipher.object.clone(),
                segment,
                offset,
            }));
        }
        let layout = self.cipher.layout;
        if out.is_empty() {
            return Ok(0);
        }
        if self.pos >= layout.plaintext_len {
            // An empty object is one empty segment: authenticate it before reporting the end.
            if layout.plaintext_len == 0 && self.loaded != Some(0) {
                if let Err(e) = self.read_segment_into(0, SEGMENT_OVERHEAD) {
                    return Err(self.poison(0, e));
                }
                self.loaded = Some(0);
            }
            return Ok(0);
        }
        let size = u64::from(layout.segment_size);
        let i = self.pos / size;
        let within = usize::try_from(self.pos - i * size).unwrap_or(0);
        let n = layout.plain_len(i);
        if self.loaded != Some(i) && within == 0 && out.len() >= n {
            let dest = out
                .get_mut(..n)
                .ok_or_else(|| io::Error::other(super::internal("read buffer")))?;
            if let Err(e) = self.read_segment_direct(i, dest) {
                return Err(self.poison(i, e));
            }
            self.pos += n as u64;
            return Ok(n);
        }
        if self.loaded != Some(i) {
            self.loaded = None;
            if let Err(e) = self.read_segment_into(i, n + SEGMENT_OVERHEAD) {
                return Err(self.poison(i, e));
            }
            self.loaded = Some(i);
        }
        let avail = self
            .buf
            .get(8 + within..8 + n)
            .ok_or_else(|| io::Error::other(super::internal("segment buffer")))?;
        let take = avail.len().min(out.len());
        let (dest, src) = (out.get_mut(..take), avail.get(..take));
        if let (Some(dest), Some(src)) = (dest, src) {
            dest.copy_from_slice(src);
        }
        self.pos += take as u64;
        Ok(take)
    }
}

impl<R: Read + Seek> Seek for DecryptingReader<R> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let len = self.header.plaintext_len;
        let target = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let Some(target) = target else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek before the start of the decrypted object",
            ));
        };
        self.pos = target;
        Ok(target)
    }
}
