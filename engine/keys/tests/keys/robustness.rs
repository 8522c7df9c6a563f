//! Bounded randomized robustness (fixed-seed xorshift): the header parser and the
//! decrypting reader take thousands of mutated encrypted objects (truncations, byte flips,
//! duplicated ranges, extreme length fields) and never panic; the parser returns a header
//! or a located error; the reader never releases a byte that differs from the plaintext.

use std::collections::HashMap;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::sync::Arc;

use probity_keys::stream::{self, EncryptOptions};
use probity_keys::{DataKey, DecryptingReader, Header, StreamError};

use crate::common::{StaticKeys, content, key};

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn keys() -> StaticKeys {
    let mut keys = HashMap::new();
    keys.insert(1, Arc::new(DataKey::from_bytes([0x11; 32])));
    keys.insert(2, Arc::new(DataKey::from_bytes([0x22; 32])));
    StaticKeys {
        key: key("dataset/robust"),
        primary: 2,
        keys,
    }
}

fn mutate(rng: &mut XorShift, original: &[u8]) -> Vec<u8> {
    let mut b = original.to_vec();
    for _ in 0..1 + rng.below(3) {
        match rng.below(6) {
            0 if !b.is_empty() => {
                let at = rng.below(b.len());
                b[at] ^= 1 << rng.below(8);
            }
            1 => b.truncate(rng.below(b.len() + 1)),
            2 if !b.is_empty() => {
                let start = rng.below(b.len());
                let end = (start + 1 + rng.below(80)).min(b.len());
                let piece = b[start..end].to_vec();
                let at = rng.below(b.len() + 1);
                b.splice(at..at, piece);
            }
            3 if b.len() >= 40 => {
                // An extreme value in one of the fixed numeric fields.
                let field = [(6, 2), (8, 4), (12, 8), (28, 4), (32, 4), (36, 2)][rng.below(6)];
                let value = [0u64, 1, u64::MAX, 0x7fff, 16, 1 << 32][rng.below(6)];
                let bytes = value.to_be_bytes();
                b[field.0..field.0 + field.1].copy_from_slice(&bytes[8 - field.1..]);
            }
            4 => b.extend((0..rng.below(100)).map(|_| rng.next() as u8)),
            _ if !b.is_empty() => {
                let at = rng.below(b.len());
                b[at] = rng.next() as u8;
            }
            _ => {}
        }
    }
    b
}

fn fixtures(keys: &StaticKeys) -> Vec<(String, Vec<u8>, Vec<u8>)> {
    [
        ("o", 0usize),
        ("obj/1", 1),
        ("a/much/longer/object/id", 64 * 6 + 10),
        ("é", 200),
    ]
    .iter()
    .map(|(id, len)| {
        let plain = content(*len);
        let options = EncryptOptions {
            segment_size: 64,
            ..EncryptOptions::default()
        };
        let sealed = stream::encrypt_to_vec(keys, &keys.key, id, &plain, &options).unwrap();
        ((*id).to_owned(), plain, sealed)
    })
    .collect()
}

#[test]
fn header_parser_returns_a_header_or_a_located_error_on_mutations() {
    let keys = keys();
    let fixtures = fixtures(&keys);
    let mut rng = XorShift(0x5eed_1234_9abc_def1);
    let (mut parsed, mut refused) = (0, 0);
    for _ in 0..5000 {
        let (_, _, sealed) = &fixtures[rng.below(fixtures.len())];
        let input = mutate(&mut rng, sealed);
        match Header::parse(&input) {
            Ok((h, len)) => {
                assert!(len <= input.len());
                assert_eq!(
                    h.encode(),
                    input[..len],
                    "a parsed header re-encodes to its bytes"
                );
                parsed += 1;
            }
            Err(e) => {
                assert!(e.offset() <= input.len(), "{e}");
                assert!(e.to_string().contains("byte offset"), "{e}");
                refused += 1;
            }
        }
    }
    assert!(
        parsed > 100 && refused > 100,
        "{parsed} parsed, {refused} refused"
    );
}

#[test]
fn reader_never_releases_a_wrong_byte_on_mutations() {
    let keys = keys();
    let fixtures = fixtures(&keys);
    let mut rng = XorShift(0x0dd_ba11_cafe_f00d);
    let (mut opened, mut failed_reads) = (0, 0);
    for _ in 0..3000 {
        let (id, plain, sealed) = &fixtures[rng.below(fixtures.len())];
        let input = mutate(&mut rng, sealed);
        let Ok(mut reader) = DecryptingReader::open(&keys, id, Cursor::new(&input)) else {
            continue;
        };
        opened += 1;
        let mut buf = vec![0u8; 1 + rng.below(150)];
        let mut pos = 0u64;
        let started_at_zero = rng.below(3) != 0 || plain.is_empty();
        if !started_at_zero {
            pos = rng.below(plain.len()) as u64;
            reader.seek(SeekFrom::Start(pos)).unwrap();
        }
        let mut complete = false;
        loop {
            match reader.read(&mut buf) {
                Ok(0) => {
                    complete = true;
                    break;
                }
                Ok(n) => {
                    let at = pos as usize;
                    assert_eq!(
                        &buf[..n],
                        &plain[at..at + n],
                        "released bytes differ at {at}"
                    );
                    pos += n as u64;
                }
                Err(e) => {
                    assert!(StreamError::from_io(&e).is_some(), "{e}");
                    failed_reads += 1;
                    // Poisoned from now on.
                    assert!(reader.read(&mut buf).is_err());
                    break;
                }
            }
        }
        if complete && started_at_zero && input != *sealed {
            // Reading everything authenticates every byte: no mutation may survive that.
            // (A read that started mid-object skipped segments it never had to open.)
            panic!("a mutated object read to the end: {id}");
        }
    }
    assert!(
        opened > 50 && failed_reads > 20,
        "{opened} opened, {failed_reads} failed reads"
    );
}
