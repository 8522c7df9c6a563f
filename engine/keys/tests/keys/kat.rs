//! Known-answer vectors made by an independent implementation of FORMAT.md
//! (testdata/keys/gen_vectors.py, python3-cryptography): every vector decrypts, and
//! re-encrypting with the same injected randomness gives the same bytes, through
//! `encrypt_to_vec`, `encrypt_buffer` (parallel), `encrypt_stream` (one thread, unknown
//! length) and `encrypt_file` (parallel); and every decryption path agrees.

use std::collections::HashMap;
use std::fs;
use std::io::{Cursor, Read};
use std::num::NonZeroUsize;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::sync::Arc;

use probity_keys::stream::{self, EncryptOptions};
use probity_keys::{
    DataKey, DecryptOptions, DecryptingReader, Header, KekProvider, SoftwareKek, decrypt_file,
    encrypt_file,
};

use crate::common::{FixedRandom, StaticKeys, hex, key};

fn vectors() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/keys/vectors.json"
    );
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

fn keys(all: &serde_json::Value, primary: u32) -> StaticKeys {
    let mut keys = HashMap::new();
    for (v, k) in all["data_keys"].as_object().unwrap() {
        keys.insert(
            v.parse().unwrap(),
            Arc::new(DataKey::from_slice(&hex(k.as_str().unwrap())).unwrap()),
        );
    }
    StaticKeys {
        key: key(all["key_id"].as_str().unwrap()),
        primary,
        keys,
    }
}

#[test]
fn every_vector_decrypts_and_reencrypts_to_the_same_bytes() {
    let all = vectors();
    assert_eq!(all["format"], 1);
    let list = all["vectors"].as_array().unwrap();
    assert_eq!(list.len(), 8);
    let dir = tempfile::tempdir().unwrap();
    let mut reencrypted = 0;
    for v in list {
        let name = v["name"].as_str().unwrap();
        let object = v["object_id"].as_str().unwrap();
        let encrypted = hex(v["encrypted"].as_str().unwrap());
        let plaintext = hex(v["plaintext"].as_str().unwrap());
        let wrap = v["wrap_version"].as_u64().unwrap() as u32;
        let sealed = v["sealed_version"].as_u64().unwrap() as u32;
        let keys = keys(&all, wrap);

        let (header, header_len) = Header::parse(&encrypted).unwrap();
        assert_eq!(header.object_id(), object, "{name}");
        assert_eq!(
            (header.sealed_version(), header.wrap_version()),
            (sealed, wrap)
        );
        assert_eq!(header.plaintext_len(), plaintext.len() as u64, "{name}");
        assert_eq!(header.ciphertext_len(), encrypted.len() as u64, "{name}");
        assert_eq!(header_len, header.len());

        let mut reader = DecryptingReader::open(&keys, object, Cursor::new(&encrypted)).unwrap();
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got, plaintext, "{name}: reader");

        let mut buffer = vec![0xAA; 7];
        let two = DecryptOptions {
            threads: NonZeroUsize::new(2).unwrap(),
        };
        stream::decrypt_buffer(&keys, object, &encrypted, &mut buffer, &two).unwrap();
        assert_eq!(buffer, plaintext, "{name}: decrypt_buffer");

        let input = dir.path().join(format!("{name}.enc"));
        let output = dir.path().join(format!("{name}.out"));
        fs::write(&input, &encrypted).unwrap();
        let options = DecryptOptions {
            threads: NonZeroUsize::new(2).unwrap(),
        };
        decrypt_file(&keys, object, &input, &output, &options).unwrap();
        assert_eq!(
            fs::read(&output).unwrap(),
            plaintext,
            "{name}: decrypt_file"
        );

        if sealed != wrap {
            continue;
        }
        let randomness = [
            hex(v["object_key"].as_str().unwrap()),
            hex(v["nonce_prefix"].as_str().unwrap()),
            hex(v["wrap_nonce"].as_str().unwrap()),
        ]
        .concat();
        let options = |threads| EncryptOptions {
            segment_size: v["segment_size"].as_u64().unwrap() as u32,
            threads: NonZeroUsize::new(threads).unwrap(),
            random: Arc::new(FixedRandom::new(&randomness)),
        };
        let again =
            stream::encrypt_to_vec(&keys, &keys.key, object, &plaintext, &options(1)).unwrap();
        assert_eq!(again, encrypted, "{name}: encrypt_to_vec");
        let mut reused = vec![0x55; 10_000];
        stream::encrypt_buffer(
            &keys,
            &keys.key,
            object,
            &plaintext,
            &mut reused,
            &options(3),
        )
        .unwrap();
        assert_eq!(reused, encrypted, "{name}: encrypt_buffer, 3 threads");
        let mut streamed = Cursor::new(Vec::new());
        stream::encrypt_stream(
            &keys,
            &keys.key,
            object,
            &plaintext[..],
            &mut streamed,
            &options(1),
        )
        .unwrap();
        assert_eq!(streamed.into_inner(), encrypted, "{name}: encrypt_stream");
        let plain_path = dir.path().join(format!("{name}.plain"));
        let enc_path = dir.path().join(format!("{name}.enc2"));
        fs::write(&plain_path, &plaintext).unwrap();
        encrypt_file(
            &keys,
            &keys.key,
            object,
            &plain_path,
            &enc_path,
            &options(2),
        )
        .unwrap();
        assert_eq!(
            fs::read(&enc_path).unwrap(),
            encrypted,
            "{name}: encrypt_file"
        );
        reencrypted += 1;
    }
    assert_eq!(reencrypted, 7);
}

#[test]
fn software_kek_matches_rfc5649_vectors() {
    let all = vectors();
    let dir = tempfile::tempdir().unwrap();
    let kek = SoftwareKek::open(&dir.path().join("kek")).unwrap();
    for (i, v) in all["kwp"].as_array().unwrap().iter().enumerate() {
        let label = format!("kat-{i}");
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(kek.kek_path(&label).unwrap())
            .unwrap();
        std::io::Write::write_all(&mut f, &hex(v["kek"].as_str().unwrap())).unwrap();
        f.set_permissions(fs::Permissions::from_mode(0o600))
            .unwrap();
        let data = DataKey::from_slice(&hex(v["key"].as_str().unwrap())).unwrap();
        let wrapped = hex(v["wrapped"].as_str().unwrap());
        assert_eq!(kek.wrap(&label, &data).unwrap(), wrapped);
        assert_eq!(
            kek.unwrap(&label, &wrapped).unwrap().expose(),
            data.expose()
        );
    }
}
