//! Integrity throughput: whole-object verification on 1 and 2 threads against a plain
//! sequential SHA-256 of the file, and the verified reader against a plain read + hash.
//!
//! Run: `cargo bench -p probity --bench verify` (object size: `PROBITY_BENCH_MIB`, default 128).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "benchmark setup: a failure should abort the run"
)]

use std::fs::File;
use std::hint::black_box;
use std::io::{Read, Write};
use std::num::NonZeroUsize;

use criterion::{Criterion, Throughput, criterion_main};
use probity::integrity::{
    self, Anchor, HashOptions, SoftwareAnchor, VerifiedReader, Verifier, VerifyOptions,
};
use probity::state::StateStore;
use sha2::{Digest, Sha256};

const READ_BUF: usize = 1 << 20;

fn bench(c: &mut Criterion) {
    let mib: u64 = std::env::var("PROBITY_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    let size = mib << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("object.bin");
    {
        let mut f = File::create(&path).unwrap();
        let mut block = vec![0u8; 1 << 20];
        for (i, b) in block.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        for i in 0..mib {
            block[0] = i as u8;
            f.write_all(&block).unwrap();
        }
    }
    let anchor = SoftwareAnchor::generate(&dir.path().join("anchor.key")).unwrap();
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let signed = integrity::SignedManifest::seal(
        &path,
        "bench",
        1,
        &anchor,
        &store,
        &HashOptions::default(),
    )
    .unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());

    let mut g = c.benchmark_group("verify");
    g.throughput(Throughput::Bytes(size));
    g.sample_size(10);
    g.bench_function("sha2 baseline (read + hash, 1 thread)", |b| {
        b.iter(|| {
            let mut f = File::open(&path).unwrap();
            let mut h = Sha256::new();
            let mut buf = vec![0u8; integrity::Manifest::DEFAULT_CHUNK_SIZE as usize];
            loop {
                let n = f.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
            black_box(h.finalize())
        });
    });
    g.bench_function("hash_file (1 thread, no signature or registry)", |b| {
        let options = HashOptions {
            threads: NonZeroUsize::MIN,
            ..HashOptions::default()
        };
        b.iter(|| black_box(integrity::HashedObject::hash_file(&path, &options).unwrap()));
    });
    for threads in [1usize, 2] {
        g.bench_function(format!("verify_object ({threads} thread)"), |b| {
            b.iter(|| {
                let options = VerifyOptions {
                    hash: HashOptions {
                        threads: NonZeroUsize::new(threads).unwrap(),
                        ..HashOptions::default()
                    },
                    ..VerifyOptions::default()
                };
                black_box(
                    verifier
                        .verify_object(&path, &signed, &store, &options)
                        .unwrap(),
                )
            });
        });
    }
    g.bench_function("plain read + hash per 4 MiB chunk (1 MiB reads)", |b| {
        b.iter(|| {
            let mut f = File::open(&path).unwrap();
            let mut chunk = vec![0u8; integrity::Manifest::DEFAULT_CHUNK_SIZE as usize];
            let mut out = vec![0u8; READ_BUF];
            let mut leaves = Vec::new();
            loop {
                let mut filled = 0;
                while filled < chunk.len() {
                    let n = f.read(&mut chunk[filled..]).unwrap();
                    if n == 0 {
                        break;
                    }
                    filled += n;
                }
                if filled == 0 {
                    break;
                }
                leaves.push(Sha256::digest(&chunk[..filled]));
                for piece in chunk[..filled].chunks(READ_BUF) {
                    out[..piece.len()].copy_from_slice(piece);
                }
                black_box(&out);
            }
            black_box(leaves)
        });
    });
    g.bench_function("VerifiedReader sequential (1 MiB reads)", |b| {
        b.iter(|| {
            let f = File::open(&path).unwrap();
            let mut r = VerifiedReader::new(f, &signed, &verifier, &store).unwrap();
            let mut out = vec![0u8; READ_BUF];
            let mut total = 0u64;
            loop {
                let n = r.read(&mut out).unwrap();
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            assert_eq!(total, size);
            black_box(&out);
        });
    });
    g.finish();
}

/// The benchmark group (criterion_group! generates an undocumented function).
#[allow(missing_docs, reason = "generated by criterion_group!")]
mod group {
    criterion::criterion_group!(benches, super::bench);
}
criterion_main!(group::benches);
