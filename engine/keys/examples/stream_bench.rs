//! Streaming AES-256-GCM throughput against its anchors, in the same run, interleaved.
//!
//! ```text
//! cargo run --release --example stream_bench -- [--mib 512] [--rounds 5] [--segments-kib 64,256,1024,4096] [--dir /dev/shm]
//! cargo run --release --example stream_bench -- --rss-gib 4 [--dir /var/tmp]
//! ```
//!
//! Per segment size and round, in this order: raw `aes-gcm` sealing every segment of an
//! in-memory buffer in place on one core (the anchor), raw `aes-gcm` opening them, ring's
//! AES-256-GCM sealing the same segments (the ceiling), then this crate: `encrypt_buffer`
//! and `decrypt_buffer` (memory to memory) on 1 and 2 threads, `DecryptingReader` and
//! `encrypt_stream` over memory, a plain file copy without crypto (the I/O floor of the file
//! paths), and `encrypt_file` and `decrypt_file` on 1 and 2 threads (file to file). Reports
//! medians in GB/s and the ratio of each to the anchor's median. `--rss-gib` instead encrypts and decrypts a sparse
//! file of that size on 2 threads with the default segment size and reports peak RSS.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::io::{Cursor, Read as _};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use aes_gcm::aead::array::Array;
use aes_gcm::aead::{Nonce, Tag};
use aes_gcm::{AeadInOut as _, Aes256Gcm, KeyInit as _};
use probity_keys::stream::{self, DEFAULT_SEGMENT_SIZE, EncryptOptions};
use probity_keys::{
    DecryptOptions, DecryptingReader, KeyId, KeyScope, Keyring, KeyringOptions, MemoryMetaStore,
    SoftwareKek, SystemClock, decrypt_file, encrypt_file,
};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// CPU time (user + system) this process has used, all threads, exited ones included
/// (`/proc/self/stat`, clock ticks of 10 ms).
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// One measurement: wall-clock GB/s and GB per CPU-second. On a shared machine the wall
/// figure depends on what else runs; the CPU figure measures the work itself.
#[derive(Clone, Copy)]
struct Sample {
    wall: f64,
    cpu: f64,
}

fn gbps(bytes: usize, f: impl FnOnce()) -> Sample {
    let c = cpu_secs();
    let t = Instant::now();
    f();
    let wall = t.elapsed().as_secs_f64();
    let cpu = (cpu_secs() - c).max(0.01);
    Sample {
        wall: bytes as f64 / wall / 1e9,
        cpu: bytes as f64 / cpu / 1e9,
    }
}

fn nonce(i: usize) -> Nonce<Aes256Gcm> {
    let mut n = [0u8; 12];
    n[8..].copy_from_slice(&(i as u32).to_be_bytes());
    Nonce::<Aes256Gcm>::from(n)
}

fn keyring(dir: &Path) -> (Keyring, KeyId) {
    let kek = SoftwareKek::open(&dir.join("kek")).unwrap();
    let keyring = Keyring::new(
        Arc::new(MemoryMetaStore::new()),
        Arc::new(kek),
        Arc::new(SystemClock),
        KeyringOptions::default(),
    );
    let key = KeyId::new("dataset/bench").unwrap();
    keyring.create(&key, KeyScope::Dataset, "bench").unwrap();
    (keyring, key)
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn rss_run(gib: u64, dir: &Path) {
    let work = tempfile::tempdir_in(dir).unwrap();
    let (keys, key) = keyring(work.path());
    let input = work.path().join("sparse.bin");
    let enc = work.path().join("sparse.enc");
    let out = work.path().join("sparse.out");
    std::fs::File::create(&input)
        .unwrap()
        .set_len(gib << 30)
        .unwrap();
    let before = peak_rss_kib();
    let two = NonZeroUsize::new(2).unwrap();
    let t = Instant::now();
    encrypt_file(
        &keys,
        &key,
        "rss/object",
        &input,
        &enc,
        &EncryptOptions {
            threads: two,
            ..EncryptOptions::default()
        },
    )
    .unwrap();
    let enc_s = t.elapsed().as_secs_f64();
    let after_enc = peak_rss_kib();
    let t = Instant::now();
    decrypt_file(
        &keys,
        "rss/object",
        &enc,
        &out,
        &DecryptOptions { threads: two },
    )
    .unwrap();
    let dec_s = t.elapsed().as_secs_f64();
    let after_dec = peak_rss_kib();
    let mut reader =
        DecryptingReader::open(&keys, "rss/object", std::fs::File::open(&enc).unwrap()).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    assert_eq!(total, gib << 30);
    let after_read = peak_rss_kib();
    println!(
        "rss: {gib} GiB object, segment {} KiB, 2 threads; peak RSS (VmHWM) before {:.1} MiB, \
         after encrypt_file {:.1} MiB ({:.2} GB/s incl. disk), after decrypt_file {:.1} MiB \
         ({:.2} GB/s), after DecryptingReader {:.1} MiB",
        DEFAULT_SEGMENT_SIZE / 1024,
        before as f64 / 1024.0,
        after_enc as f64 / 1024.0,
        (gib << 30) as f64 / enc_s / 1e9,
        after_dec as f64 / 1024.0,
        (gib << 30) as f64 / dec_s / 1e9,
        after_read as f64 / 1024.0,
    );
}

fn main() {
    let dir = PathBuf::from(arg("--dir").unwrap_or_else(|| "/dev/shm".into()));
    if let Some(gib) = arg("--rss-gib") {
        rss_run(gib.parse().unwrap(), &dir);
        return;
    }
    let mib: usize = arg("--mib").map_or(512, |v| v.parse().unwrap());
    let rounds: usize = arg("--rounds").map_or(5, |v| v.parse().unwrap());
    let segments: Vec<usize> = arg("--segments-kib")
        .unwrap_or_else(|| "64,256,1024,4096".into())
        .split(',')
        .map(|s| s.parse::<usize>().unwrap() * 1024)
        .collect();
    let len = mib << 20;
    let work = tempfile::tempdir_in(&dir).unwrap();
    let (keys, key) = keyring(work.path());
    let plain: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
    let plain_path = work.path().join("plain");
    std::fs::write(&plain_path, &plain).unwrap();
    let raw_key = Array::from([7u8; 32]);
    let gcm = Aes256Gcm::new(&raw_key);
    let ring_key = ring::aead::LessSafeKey::new(
        ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &[7u8; 32]).unwrap(),
    );
    let aad = [0u8; 20];
    println!(
        "{mib} MiB per measurement, {rounds} interleaved rounds, files in {}",
        dir.display()
    );
    for &seg in &segments {
        let names = [
            "raw aes-gcm seal, 1 core (anchor)",
            "raw aes-gcm open, 1 core",
            "ring seal, 1 core (ceiling)",
            "encrypt_buffer mem->mem, 1 thread",
            "encrypt_buffer mem->mem, 2 threads",
            "decrypt_buffer mem->mem, 1 thread",
            "decrypt_buffer mem->mem, 2 threads",
            "DecryptingReader mem, 1 thread",
            "encrypt_stream mem->mem, 1 thread",
            "file copy, no crypto (I/O floor)",
            "encrypt_file, 1 thread",
            "encrypt_file, 2 threads",
            "decrypt_file, 1 thread",
            "decrypt_file, 2 threads",
        ];
        let mut results: Vec<Vec<Sample>> = vec![Vec::new(); names.len()];
        let mut buf = plain.clone();
        let mut tags: Vec<Tag<Aes256Gcm>> = Vec::new();
        let enc_path = work.path().join("enc");
        let out_path = work.path().join("out");
        let options = |threads: usize| EncryptOptions {
            segment_size: seg as u32,
            threads: NonZeroUsize::new(threads).unwrap(),
            ..EncryptOptions::default()
        };
        let dopts = |threads: usize| DecryptOptions {
            threads: NonZeroUsize::new(threads).unwrap(),
        };
        // Output buffers are reused (touched before timing, as the anchor's buffer is):
        // first-touch page faults are the allocator's cost, not the cipher's.
        let mut sealed = vec![1u8; len + len / 16 + 4096];
        let mut back = vec![1u8; len];
        let mut streamed = Cursor::new(vec![1u8; len + len / 16 + 4096]);
        let mut io_buf = vec![0u8; seg];
        for _ in 0..rounds {
            buf.copy_from_slice(&plain);
            results[0].push(gbps(len, || {
                tags.clear();
                for (i, chunk) in buf.chunks_mut(seg).enumerate() {
                    tags.push(
                        gcm.encrypt_inout_detached(&nonce(i), &aad, chunk.into())
                            .unwrap(),
                    );
                }
            }));
            results[1].push(gbps(len, || {
                for (i, chunk) in buf.chunks_mut(seg).enumerate() {
                    gcm.decrypt_inout_detached(&nonce(i), &aad, chunk.into(), &tags[i])
                        .unwrap();
                }
            }));
            assert!(buf == plain);
            results[2].push(gbps(len, || {
                for (i, chunk) in buf.chunks_mut(seg).enumerate() {
                    let mut n = [0u8; 12];
                    n[8..].copy_from_slice(&(i as u32).to_be_bytes());
                    let _tag = ring_key
                        .seal_in_place_separate_tag(
                            ring::aead::Nonce::assume_unique_for_key(n),
                            ring::aead::Aad::from(&aad),
                            chunk,
                        )
                        .unwrap();
                }
            }));
            for (slot, threads) in [(3, 1), (4, 2)] {
                results[slot].push(gbps(len, || {
                    stream::encrypt_buffer(
                        &keys,
                        &key,
                        "bench/mem",
                        &plain,
                        &mut sealed,
                        &options(threads),
                    )
                    .unwrap();
                }));
            }
            for (slot, threads) in [(5, 1), (6, 2)] {
                results[slot].push(gbps(len, || {
                    stream::decrypt_buffer(&keys, "bench/mem", &sealed, &mut back, &dopts(threads))
                        .unwrap();
                }));
                assert!(back == plain);
            }
            back.fill(1);
            results[7].push(gbps(len, || {
                let mut r =
                    DecryptingReader::open(&keys, "bench/mem", Cursor::new(&sealed[..])).unwrap();
                r.read_exact(&mut back).unwrap();
            }));
            assert!(back == plain);
            streamed.set_position(0);
            results[8].push(gbps(len, || {
                stream::encrypt_stream(
                    &keys,
                    &key,
                    "bench/mem",
                    &plain[..],
                    &mut streamed,
                    &options(1),
                )
                .unwrap();
            }));
            let copy_path = work.path().join("copy");
            let _ = std::fs::remove_file(&copy_path);
            results[9].push(gbps(len, || {
                let mut src = std::fs::File::open(&plain_path).unwrap();
                let mut dst = std::fs::File::create(&copy_path).unwrap();
                loop {
                    let n = src.read(&mut io_buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    std::io::Write::write_all(&mut dst, &io_buf[..n]).unwrap();
                }
                dst.sync_all().unwrap();
            }));
            for (slot, threads) in [(10, 1), (11, 2)] {
                let _ = std::fs::remove_file(&enc_path);
                results[slot].push(gbps(len, || {
                    encrypt_file(
                        &keys,
                        &key,
                        "bench/obj",
                        &plain_path,
                        &enc_path,
                        &options(threads),
                    )
                    .unwrap();
                }));
            }
            for (slot, threads) in [(12, 1), (13, 2)] {
                let _ = std::fs::remove_file(&out_path);
                results[slot].push(gbps(len, || {
                    decrypt_file(&keys, "bench/obj", &enc_path, &out_path, &dopts(threads))
                        .unwrap();
                }));
            }
        }
        let walls = |r: &[Sample]| median(&mut r.iter().map(|x| x.wall).collect::<Vec<_>>());
        let cpus = |r: &[Sample]| median(&mut r.iter().map(|x| x.cpu).collect::<Vec<_>>());
        let (anchor_wall, anchor_cpu) = (walls(&results[0]), cpus(&results[0]));
        println!(
            "segment {} KiB:   wall-clock GB/s (ratio to anchor) | GB per CPU-second (ratio) | wall rounds",
            seg / 1024
        );
        for (name, r) in names.iter().zip(results.iter()) {
            let (w, c) = (walls(r), cpus(r));
            println!(
                "  {name:38} {w:5.2} ({:4.2}x) | {c:5.2} ({:4.2}x) | {}",
                w / anchor_wall,
                c / anchor_cpu,
                r.iter()
                    .map(|v| format!("{:.2}", v.wall))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
    }

    // The KEK unwrap is paid once per key version: open many small objects under two
    // versions with a cold cache.
    let small = EncryptOptions::default();
    let mut objects = Vec::new();
    for v in 0..2 {
        if v == 1 {
            keys.rotate(&key, "bench").unwrap();
        }
        for i in 0..500 {
            let id = format!("small/{v}/{i}");
            objects.push((
                id.clone(),
                stream::encrypt_to_vec(&keys, &key, &id, b"x", &small).unwrap(),
            ));
        }
    }
    keys.clear_cache();
    let before = keys.cache_stats();
    let mut open_us = Vec::new();
    for (id, sealed) in &objects {
        let t = Instant::now();
        let mut r = DecryptingReader::open(&keys, id, Cursor::new(&sealed[..])).unwrap();
        let mut b = Vec::new();
        r.read_to_end(&mut b).unwrap();
        open_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let after = keys.cache_stats();
    let first = open_us[0];
    let first_v2 = open_us[500];
    let rest = median(&mut open_us.clone());
    println!(
        "unwrap once per key version: {} objects under 2 versions, KEK unwraps {} (software KEK), \
         cache hits {}; open+read of a 1-byte object: first under v1 {first:.1} us, first under \
         v2 {first_v2:.1} us, median {rest:.1} us",
        objects.len(),
        after.unwraps - before.unwraps,
        after.hits - before.hits,
    );
}
