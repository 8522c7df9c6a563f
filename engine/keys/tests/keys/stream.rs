//! The encrypted object format through the public API: round trips at edge sizes and thread
//! counts, random access, and every tamper case with its own error naming the segment and
//! its byte offset; nothing is ever written over an input, and no plaintext of a segment
//! that failed authentication is released.

use std::fs;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::num::NonZeroUsize;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::Path;
use std::sync::Arc;

use probity_keys::stream::{self, EncryptOptions, HeaderError, SEGMENT_OVERHEAD};
use probity_keys::{
    DecryptOptions, DecryptingReader, Header, KekError, KeyError, KeyId, KeyMetaStore, KeyScope,
    Keyring, StreamError, decrypt_file, encrypt_file, rewrap_file,
};

use crate::common::{Setup, content, decrypt, key};

const S: u32 = 4096;
const SEG: usize = S as usize + SEGMENT_OVERHEAD;

fn opts(threads: usize) -> EncryptOptions {
    EncryptOptions {
        segment_size: S,
        threads: NonZeroUsize::new(threads).unwrap(),
        ..EncryptOptions::default()
    }
}

fn dopts(threads: usize) -> DecryptOptions {
    DecryptOptions {
        threads: NonZeroUsize::new(threads).unwrap(),
    }
}

/// A keyring with one dataset key and a 10½-segment object encrypted under it.
struct Fixture {
    _dir: tempfile::TempDir,
    setup: Setup,
    key: KeyId,
    plain: Vec<u8>,
    sealed: Vec<u8>,
    header_len: usize,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let setup = Setup::software(dir.path());
        let key = key("dataset/stream");
        setup
            .keyring
            .create(&key, KeyScope::Dataset, "ops")
            .unwrap();
        let plain = content(10 * S as usize + S as usize / 2);
        let sealed =
            stream::encrypt_to_vec(&setup.keyring, &key, "obj/a", &plain, &opts(1)).unwrap();
        let header_len = Header::parse(&sealed).unwrap().1;
        Self {
            _dir: dir,
            setup,
            key,
            plain,
            sealed,
            header_len,
        }
    }
    fn keys(&self) -> &Keyring {
        &self.setup.keyring
    }
    fn seg_at(&self, i: usize) -> usize {
        self.header_len + i * SEG
    }
    fn open(&self, bytes: &[u8]) -> Result<Vec<u8>, StreamError> {
        decrypt(self.keys(), "obj/a", bytes)
    }
}

/// Reads until the reader fails; returns the bytes it released and the error.
fn read_until_error<R: Read>(r: &mut R) -> (Vec<u8>, std::io::Error) {
    let mut got = Vec::new();
    let mut buf = [0u8; 1000];
    loop {
        match r.read(&mut buf) {
            Ok(0) => panic!("the reader returned every byte of a tampered object"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return (got, e),
        }
    }
}

fn stream_err(e: &std::io::Error) -> &StreamError {
    StreamError::from_io(e).unwrap_or_else(|| panic!("not a stream error: {e}"))
}

#[test]
fn files_round_trip_at_edge_sizes_on_one_and_two_threads() {
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::software(dir.path());
    let k = key("dataset/sizes");
    s.keyring.create(&k, KeyScope::Dataset, "ops").unwrap();
    let s_ = S as usize;
    for len in [0, 1, s_ - 1, s_, s_ + 1, 2 * s_, 5 * s_ + 3] {
        for threads in [1, 2] {
            let plain = content(len);
            let input = dir.path().join("plain");
            let enc = dir.path().join("enc");
            let out = dir.path().join("out");
            fs::write(&input, &plain).unwrap();
            let r = encrypt_file(&s.keyring, &k, "o/sizes", &input, &enc, &opts(threads)).unwrap();
            assert_eq!(r.plaintext_len, len as u64);
            assert_eq!(r.segments, (len.div_ceil(s_)).max(1) as u64);
            assert_eq!(fs::metadata(&enc).unwrap().len(), r.ciphertext_len);
            let d = decrypt_file(&s.keyring, "o/sizes", &enc, &out, &dopts(threads)).unwrap();
            assert_eq!(d.plaintext_len, len as u64);
            assert_eq!(
                fs::read(&out).unwrap(),
                plain,
                "len {len} threads {threads}"
            );
            assert_eq!(
                fs::metadata(&out).unwrap().permissions().mode() & 0o777,
                0o600
            );
            // The streaming encryptor reads the same format.
            assert_eq!(
                decrypt(&s.keyring, "o/sizes", &fs::read(&enc).unwrap()).unwrap(),
                plain
            );
        }
    }
}

#[test]
fn reader_gives_random_access_decrypting_only_what_it_touches() {
    let f = Fixture::new();
    // Damage segment 0: reads elsewhere still work, since only touched segments are opened.
    let mut bytes = f.sealed.clone();
    bytes[f.seg_at(0) + 20] ^= 1;
    let mut r = DecryptingReader::open(f.keys(), "obj/a", Cursor::new(&bytes)).unwrap();
    assert_eq!(r.len(), f.plain.len() as u64);
    for start in [7 * S as u64 + 5, S as u64, 3 * S as u64 - 1] {
        r.seek(SeekFrom::Start(start)).unwrap();
        let mut buf = vec![0u8; 2 * S as usize + 3];
        r.read_exact(&mut buf).unwrap();
        assert_eq!(buf, f.plain[start as usize..start as usize + buf.len()]);
    }
    r.seek(SeekFrom::End(-3)).unwrap();
    let mut tail = Vec::new();
    r.read_to_end(&mut tail).unwrap();
    assert_eq!(tail, f.plain[f.plain.len() - 3..]);
    assert_eq!(r.stream_position().unwrap(), f.plain.len() as u64);
    assert!(
        r.seek(SeekFrom::Current(-(f.plain.len() as i64) - 1))
            .is_err()
    );
    // A read buffer larger than a segment, at a segment start, decrypts in place.
    r.seek(SeekFrom::Start(2 * S as u64)).unwrap();
    let mut big = vec![0u8; 3 * S as usize];
    r.read_exact(&mut big).unwrap();
    assert_eq!(big, f.plain[2 * S as usize..5 * S as usize]);
    r.seek(SeekFrom::Start(0)).unwrap();
    let err = r.read(&mut big).unwrap_err();
    assert!(matches!(
        stream_err(&err),
        StreamError::SegmentTampered { segment: 0, .. }
    ));
    assert!(big.iter().all(|&b| b == 0) || big[..S as usize] != f.plain[..S as usize]);
}

#[test]
fn flipped_byte_in_a_segment_fails_that_segment_and_poisons_the_reader() {
    let f = Fixture::new();
    let mut bytes = f.sealed.clone();
    let at = f.seg_at(3) + 8 + 100;
    bytes[at] ^= 0x40;
    let mut r = DecryptingReader::open(f.keys(), "obj/a", Cursor::new(&bytes)).unwrap();
    let (got, err) = read_until_error(&mut r);
    // Every byte before segment 3, none of segment 3.
    assert_eq!(got, f.plain[..3 * S as usize]);
    let offset = f.seg_at(3) as u64;
    match stream_err(&err) {
        StreamError::SegmentTampered {
            segment, offset: o, ..
        } => {
            assert_eq!((*segment, *o), (3, offset));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string()
            .contains(&format!("segment 3 at byte offset {offset}")),
        "{err}"
    );
    assert_eq!(r.failure(), Some((3, offset)));
    // Every later read fails, wherever it is.
    r.seek(SeekFrom::Start(0)).unwrap();
    let again = r.read(&mut [0u8; 10]).unwrap_err();
    assert!(matches!(
        stream_err(&again),
        StreamError::Poisoned { segment: 3, .. }
    ));
    assert_eq!(stream_err(&again).kind(), "poisoned");
}

#[test]
fn flipped_byte_in_a_tag_is_caught() {
    let f = Fixture::new();
    let mut bytes = f.sealed.clone();
    let at = f.seg_at(5) + SEG - 1; // last byte of segment 5's GCM tag
    bytes[at] ^= 1;
    let err = f.open(&bytes).unwrap_err();
    assert!(
        matches!(err, StreamError::SegmentTampered { segment: 5, .. }),
        "{err:?}"
    );
    assert!(err.is_tampering());
}

#[test]
fn every_flipped_header_byte_is_refused_and_located() {
    let f = Fixture::new();
    for at in 0..f.header_len {
        let mut bytes = f.sealed.clone();
        bytes[at] ^= 0x01;
        let err = f.open(&bytes).unwrap_err();
        let ok = match &err {
            // A changed length field may surface in the field after it.
            StreamError::Header(h) => h.offset() <= f.header_len,
            StreamError::HeaderTampered { .. } | StreamError::KeyVersionSubstituted { .. } => true,
            // A changed key id or version may name a key or version that does not exist.
            StreamError::Key(KeyError::UnknownKey { .. } | KeyError::UnknownVersion { .. }) => true,
            _ => false,
        };
        assert!(ok, "flip at header byte {at}: {err:?}");
    }
    // Specific fields: magic, the plaintext length (authenticated), the wrapped key.
    let flip = |at: usize| {
        let mut b = f.sealed.clone();
        b[at] ^= 1;
        f.open(&b).unwrap_err()
    };
    assert!(matches!(
        flip(0),
        StreamError::Header(HeaderError::Invalid {
            field: "magic",
            offset: 0,
            ..
        })
    ));
    assert!(
        matches!(flip(19), StreamError::HeaderTampered { .. }),
        "plaintext length"
    );
    assert!(
        matches!(flip(f.header_len - 1), StreamError::HeaderTampered { .. }),
        "wrapped key"
    );
    let msg = flip(20).to_string();
    assert!(msg.contains("header of object \"obj/a\""), "{msg}");
}

#[test]
fn substituted_key_version_is_named() {
    let f = Fixture::new();
    f.setup.keyring.rotate(&f.key, "ops").unwrap();
    let mut bytes = f.sealed.clone();
    bytes[32..36].copy_from_slice(&2u32.to_be_bytes());
    let err = f.open(&bytes).unwrap_err();
    assert!(
        matches!(
            err,
            StreamError::KeyVersionSubstituted {
                claimed: 2,
                actual: 1,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn header_from_another_object_is_an_object_mismatch() {
    let f = Fixture::new();
    let other = stream::encrypt_to_vec(f.keys(), &f.key, "obj/b", &f.plain, &opts(1)).unwrap();
    // B's header on A's segments, read as A: the header is genuine, but B's.
    let mut spliced = other[..f.header_len].to_vec();
    spliced.extend_from_slice(&f.sealed[f.header_len..]);
    let err = f.open(&spliced).unwrap_err();
    match &err {
        StreamError::ObjectMismatch { expected, found } => {
            assert_eq!((expected.as_str(), found.as_str()), ("obj/a", "obj/b"));
        }
        other => panic!("{other:?}"),
    }
    // Read as B: the first segment is not B's.
    let err = decrypt(f.keys(), "obj/b", &spliced).unwrap_err();
    let offset = f.header_len as u64;
    assert!(
        matches!(err, StreamError::ForeignSegment { segment: 0, offset: o, .. } if o == offset),
        "{err:?}"
    );
}

#[test]
fn segment_from_another_object_is_foreign() {
    let f = Fixture::new();
    let other = stream::encrypt_to_vec(f.keys(), &f.key, "obj/b", &f.plain, &opts(1)).unwrap();
    let mut bytes = f.sealed.clone();
    let (a, b) = (f.seg_at(2), f.seg_at(2));
    bytes[a..a + SEG].copy_from_slice(&other[b..b + SEG]);
    let err = f.open(&bytes).unwrap_err();
    let offset = f.seg_at(2) as u64;
    assert!(
        matches!(err, StreamError::ForeignSegment { segment: 2, offset: o, .. } if o == offset),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("belongs to another object"),
        "{err}"
    );
}

#[test]
fn reordered_segments_are_named() {
    let f = Fixture::new();
    let mut bytes = f.sealed.clone();
    let (a, b) = (f.seg_at(1), f.seg_at(2));
    let seg1 = bytes[a..a + SEG].to_vec();
    let seg2 = bytes[b..b + SEG].to_vec();
    bytes[a..a + SEG].copy_from_slice(&seg2);
    bytes[b..b + SEG].copy_from_slice(&seg1);
    let err = f.open(&bytes).unwrap_err();
    assert!(
        matches!(
            err,
            StreamError::SegmentReordered {
                segment: 1,
                found: 2,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn truncation_at_a_segment_boundary() {
    let f = Fixture::new();
    let cut = f.seg_at(4);
    let err = f.open(&f.sealed[..cut]).unwrap_err();
    match err {
        StreamError::Truncated {
            segment,
            offset,
            expected_len,
            actual_len,
            ..
        } => {
            assert_eq!((segment, offset), (4, cut as u64));
            assert_eq!(
                (expected_len, actual_len),
                (f.sealed.len() as u64, cut as u64)
            );
        }
        other => panic!("{other:?}"),
    }
    // Cut to the last segment's start: that segment is missing entirely (0 bytes of it).
    let last = f.seg_at(10);
    let err = f.open(&f.sealed[..last]).unwrap_err();
    assert!(
        matches!(err, StreamError::Truncated { segment: 10, .. }),
        "{err:?}"
    );
}

#[test]
fn file_that_ends_mid_segment() {
    let f = Fixture::new();
    let cut = f.seg_at(6) + 100;
    let err = f.open(&f.sealed[..cut]).unwrap_err();
    match &err {
        StreamError::PartialSegment {
            segment,
            offset,
            have,
            need,
            ..
        } => {
            assert_eq!((*segment, *offset, *have), (6, f.seg_at(6) as u64, 100));
            assert_eq!(*need, SEG as u64);
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("ends mid-segment"), "{err}");
    let err = f.open(&f.sealed[..f.sealed.len() - 1]).unwrap_err();
    assert!(
        matches!(err, StreamError::PartialSegment { segment: 10, .. }),
        "{err:?}"
    );
}

#[test]
fn extension_is_caught() {
    let f = Fixture::new();
    let mut bytes = f.sealed.clone();
    bytes.extend_from_slice(b"more");
    let err = f.open(&bytes).unwrap_err();
    let end = f.sealed.len() as u64;
    assert!(
        matches!(err, StreamError::Extended { offset, extra: 4, .. } if offset == end),
        "{err:?}"
    );
}

#[test]
fn segment_of_zero_bytes_is_refused() {
    let f = Fixture::new();
    // A header that claims 0-byte segments: refused by the parser, located at offset 8.
    let mut bytes = f.sealed.clone();
    bytes[8..12].copy_from_slice(&0u32.to_be_bytes());
    let err = f.open(&bytes).unwrap_err();
    match &err {
        StreamError::Header(h) => {
            assert_eq!(h.offset(), 8);
            assert!(h.to_string().contains("segment size 0"), "{h}");
        }
        other => panic!("{other:?}"),
    }
    // An empty object is one empty final segment: removing it is a truncation.
    let empty = stream::encrypt_to_vec(f.keys(), &f.key, "obj/e", b"", &opts(1)).unwrap();
    assert_eq!(decrypt(f.keys(), "obj/e", &empty).unwrap(), b"");
    let h = Header::parse(&empty).unwrap().1;
    assert_eq!(empty.len(), h + SEGMENT_OVERHEAD);
    let err = decrypt(f.keys(), "obj/e", &empty[..h]).unwrap_err();
    assert!(
        matches!(err, StreamError::Truncated { segment: 0, .. }),
        "{err:?}"
    );
}

#[test]
fn wrapped_data_key_that_does_not_unwrap() {
    let f = Fixture::new();
    let store = &f.setup.store;
    let mut rec = store.load(&f.key).unwrap().unwrap();
    let wrapped = rec.value.versions[0].wrapped.as_mut().unwrap();
    wrapped[5] ^= 1;
    store.store(&rec.value, Some(rec.revision)).unwrap();
    rec.revision += 1;
    // A cold keyring must unwrap from the (damaged) record.
    let cold = f.setup.another(f.setup.kek.clone());
    let err = decrypt(&cold, "obj/a", &f.sealed).unwrap_err();
    match &err {
        StreamError::Key(KeyError::Kek {
            operation,
            version: 1,
            source,
            ..
        }) => {
            assert_eq!(*operation, "unwrap");
            assert!(
                matches!(**source, KekError::UnwrapRejected { len: 40, .. }),
                "{source:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn destroyed_version_names_the_date() {
    let f = Fixture::new();
    f.setup.keyring.rotate(&f.key, "ops").unwrap();
    f.setup.keyring.retire(&f.key, 1, "ops").unwrap();
    let err = f.open(&f.sealed).unwrap_err();
    assert!(
        matches!(
            err,
            StreamError::Key(KeyError::VersionDestroyed { version: 1, .. })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("destroyed on 2026-01-01"), "{err}");
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn nothing_is_written_over_the_input() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    let enc = dir.path().join("enc");
    fs::write(&plain, &f.plain).unwrap();
    let err = encrypt_file(f.keys(), &f.key, "obj/a", &plain, &plain, &opts(2)).unwrap_err();
    assert!(matches!(err, StreamError::SameFile { .. }), "{err:?}");
    assert_eq!(fs::read(&plain).unwrap(), f.plain);
    fs::hard_link(&plain, dir.path().join("link")).unwrap();
    let err = encrypt_file(
        f.keys(),
        &f.key,
        "obj/a",
        &plain,
        &dir.path().join("link"),
        &opts(2),
    )
    .unwrap_err();
    assert!(matches!(err, StreamError::SameFile { .. }), "{err:?}");
    fs::write(&enc, &f.sealed).unwrap();
    let err = decrypt_file(f.keys(), "obj/a", &enc, &enc, &dopts(2)).unwrap_err();
    assert!(matches!(err, StreamError::SameFile { .. }), "{err:?}");
    assert_eq!(fs::read(&enc).unwrap(), f.sealed);

    // A failed decryption leaves no output and no temporary file behind.
    let mut bad = f.sealed.clone();
    bad[f.seg_at(7) + 30] ^= 1;
    fs::write(&enc, &bad).unwrap();
    let before = dir_entries(dir.path());
    let out = dir.path().join("out");
    let err = decrypt_file(f.keys(), "obj/a", &enc, &out, &dopts(2)).unwrap_err();
    assert!(
        matches!(err, StreamError::SegmentTampered { segment: 7, .. }),
        "{err:?}"
    );
    assert!(!out.exists());
    assert_eq!(dir_entries(dir.path()), before);
    assert_eq!(fs::read(&enc).unwrap(), bad);
}

#[test]
fn rewrap_rewrites_only_the_header_atomically() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("obj.enc");
    fs::write(&path, &f.sealed).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
    let ino = fs::metadata(&path).unwrap().ino();
    let mut held = fs::File::open(&path).unwrap();
    f.setup.keyring.rotate(&f.key, "ops").unwrap();
    let report = rewrap_file(f.keys(), "obj/a", &path).unwrap();
    assert_eq!((report.from_version, report.to_version), (1, 2));
    assert_eq!(report.bytes_copied, (f.sealed.len() - f.header_len) as u64);
    let after = fs::read(&path).unwrap();
    assert_eq!(after.len(), f.sealed.len());
    assert_eq!(
        after[f.header_len..],
        f.sealed[f.header_len..],
        "segments untouched"
    );
    // Only the wrap version, wrap nonce and wrapped key changed in the header.
    let changed: Vec<usize> = (0..f.header_len)
        .filter(|&i| after[i] != f.sealed[i])
        .collect();
    assert!(
        changed
            .iter()
            .all(|&i| (32..36).contains(&i) || i >= f.header_len - 60),
        "{changed:?}"
    );
    // A new file replaced the old one by rename; the old inode was never written.
    let meta = fs::metadata(&path).unwrap();
    assert_ne!(meta.ino(), ino);
    assert_eq!(meta.permissions().mode() & 0o777, 0o640);
    let mut old = Vec::new();
    held.read_to_end(&mut old).unwrap();
    assert_eq!(old, f.sealed);
    assert_eq!(f.open(&after).unwrap(), f.plain);
    assert_eq!(dir_entries(dir.path()), vec!["obj.enc".to_owned()]);
    // Rewrap checks the object and the length before anything is written.
    let err = rewrap_file(f.keys(), "obj/other", &path).unwrap_err();
    assert!(matches!(err, StreamError::ObjectMismatch { .. }), "{err:?}");
    fs::write(&path, &f.sealed[..f.sealed.len() - 1]).unwrap();
    let err = rewrap_file(f.keys(), "obj/a", &path).unwrap_err();
    assert!(matches!(err, StreamError::PartialSegment { .. }), "{err:?}");
}

#[test]
fn parallel_and_streaming_encryption_agree_with_injected_randomness() {
    let f = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    fs::write(&plain, &f.plain).unwrap();
    let randomness: Vec<u8> = (0..52u8).collect();
    let with = |threads| EncryptOptions {
        segment_size: S,
        threads: NonZeroUsize::new(threads).unwrap(),
        random: Arc::new(crate::common::FixedRandom::new(&randomness)),
    };
    let streamed = stream::encrypt_to_vec(f.keys(), &f.key, "obj/p", &f.plain, &with(1)).unwrap();
    for threads in [1, 2, 3] {
        let out = dir.path().join(format!("enc{threads}"));
        encrypt_file(f.keys(), &f.key, "obj/p", &plain, &out, &with(threads)).unwrap();
        assert_eq!(fs::read(&out).unwrap(), streamed, "{threads} threads");
    }
    assert!(matches!(
        stream::encrypt_to_vec(
            f.keys(),
            &f.key,
            "obj/p",
            b"x",
            &EncryptOptions {
                segment_size: 0,
                ..EncryptOptions::default()
            }
        ),
        Err(StreamError::InvalidSegmentSize {
            segment_size: 0,
            ..
        })
    ));
}

/// Regression (found by the randomized reader test): an empty object's only segment was
/// never authenticated, so a damaged empty object read as empty.
#[test]
fn reader_authenticates_the_empty_segment_of_an_empty_object() {
    let f = Fixture::new();
    let mut empty = stream::encrypt_to_vec(f.keys(), &f.key, "obj/e", b"", &opts(1)).unwrap();
    let last = empty.len() - 1;
    empty[last] ^= 1;
    let mut r = DecryptingReader::open(f.keys(), "obj/e", Cursor::new(&empty)).unwrap();
    let err = r.read_to_end(&mut Vec::new()).unwrap_err();
    assert!(
        matches!(
            stream_err(&err),
            StreamError::SegmentTampered { segment: 0, .. }
        ),
        "{err}"
    );
}

#[test]
fn decrypt_buffer_releases_nothing_of_a_failed_object() {
    let f = Fixture::new();
    let mut out = Vec::new();
    stream::decrypt_buffer(f.keys(), "obj/a", &f.sealed, &mut out, &dopts(2)).unwrap();
    assert_eq!(out, f.plain);
    let mut bad = f.sealed.clone();
    bad[f.seg_at(9) + 8] ^= 1;
    let err = stream::decrypt_buffer(f.keys(), "obj/a", &bad, &mut out, &dopts(2)).unwrap_err();
    assert!(
        matches!(err, StreamError::SegmentTampered { segment: 9, .. }),
        "{err:?}"
    );
    assert!(
        out.is_empty(),
        "segments 0..9 authenticated, but none of the object is released"
    );
    let (a, b) = (f.seg_at(3), f.seg_at(4));
    let mut swapped = f.sealed.clone();
    swapped[a..a + SEG].copy_from_slice(&f.sealed[b..b + SEG]);
    let err = stream::decrypt_buffer(f.keys(), "obj/a", &swapped, &mut out, &dopts(1)).unwrap_err();
    assert!(
        matches!(
            err,
            StreamError::SegmentReordered {
                segment: 3,
                found: 4,
                ..
            }
        ),
        "{err:?}"
    );
}
