//! The decrypting reader on arbitrary bytes, with fixed keys for `dataset/fuzz` versions 1
//! and 2: never panics, never releases more than the header's plaintext length, and fails
//! for good once a read failed. The first input byte picks read sizes and a seek, the rest
//! is the encrypted object.
#![no_main]

use std::io::{Cursor, Read, Seek, SeekFrom};
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use probity_keys::{DataKey, DecryptingReader, KeyError, KeyId, KeySource};

struct Keys(KeyId);

impl KeySource for Keys {
    fn encryption_key(&self, key: &KeyId) -> Result<(u32, Arc<DataKey>), KeyError> {
        Ok((2, self.decryption_key(key, 2)?))
    }
    fn decryption_key(&self, key: &KeyId, version: u32) -> Result<Arc<DataKey>, KeyError> {
        match version {
            1 | 2 if *key == self.0 => Ok(Arc::new(DataKey::from_bytes([version as u8; 32]))),
            _ => Err(KeyError::UnknownVersion {
                key: key.clone(),
                version,
                primary: 2,
            }),
        }
    }
    fn decryptable_versions(&self, _key: &KeyId) -> Result<Vec<u32>, KeyError> {
        Ok(vec![1, 2])
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, object)) = data.split_first() else {
        return;
    };
    let Ok(key) = KeyId::new("dataset/fuzz") else {
        return;
    };
    let keys = Keys(key);
    let Ok(mut reader) = DecryptingReader::open(&keys, "fuzz/object", Cursor::new(object)) else {
        return;
    };
    if knobs & 1 == 1 {
        let _ = reader.seek(SeekFrom::Start(u64::from(knobs) * 7));
    }
    let mut buf = vec![0u8; 1 + usize::from(knobs >> 1)];
    let mut released = 0u64;
    for _ in 0..10_000 {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => released += n as u64,
            Err(_) => {
                assert!(
                    reader.read(&mut buf).is_err(),
                    "a failed reader must stay failed"
                );
                break;
            }
        }
    }
    assert!(released <= reader.len());
});
