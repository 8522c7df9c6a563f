//! Measures integrity throughput and latency on a real file, for BENCHMARKS.md (Integrity).
//!
//! ```text
//! integrity_bench seal   FILE STATE_DIR        # seal with a software anchor, write FILE.signed
//! integrity_bench verify FILE STATE_DIR THREADS [RUNS]   # verify_object, median of RUNS
//! integrity_bench reader FILE STATE_DIR [RUNS]  # VerifiedReader, sequential 1 MiB reads
//! integrity_bench plain  FILE [RUNS]            # plain read + SHA-256 per 4 MiB chunk
//! integrity_bench hsm    RUNS                   # PKCS#11 sign + ring verify latency; needs
//!                                               # PROBITY_HSM_{MODULE,TOKEN,PIN_FILE}
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "measurement tool: a failure should abort the run"
)]

use std::fs::File;
use std::io::Read;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use probity::integrity::{
    self, Anchor, HashOptions, Pin, Pkcs11Anchor, Pkcs11Config, SignedManifest, SoftwareAnchor,
    VerifiedReader, Verifier, VerifyOptions,
};
use probity::state::StateStore;

/// SHA-256 of `data`, as the manifests hash chunks.
fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(data).into()
}
use sha2::{Digest, Sha256};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn report(what: &str, size: u64, times: Vec<Duration>) {
    let all: Vec<String> = times
        .iter()
        .map(|t| format!("{:.3}", t.as_secs_f64()))
        .collect();
    let m = median(times);
    println!(
        "{what}: median {:.3} s, {:.0} MiB/s (runs: {})",
        m.as_secs_f64(),
        size as f64 / (1 << 20) as f64 / m.as_secs_f64(),
        all.join(" ")
    );
}

fn load(file: &Path, state: &Path) -> (SignedManifest, Verifier, StateStore) {
    let anchor = SoftwareAnchor::load(&state.join("anchor.key")).unwrap();
    let signed = SignedManifest::decode(&std::fs::read(signed_path(file)).unwrap()).unwrap();
    let store = StateStore::open(&state.join("node")).unwrap();
    (signed, Verifier::new(anchor.public_key().clone()), store)
}

fn signed_path(file: &Path) -> PathBuf {
    let mut p = file.as_os_str().to_owned();
    p.push(".signed");
    PathBuf::from(p)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let runs = |i: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(5usize);
    match arg(1).as_str() {
        "seal" => {
            let (file, state) = (PathBuf::from(arg(2)), PathBuf::from(arg(3)));
            std::fs::create_dir_all(&state).unwrap();
            let anchor = SoftwareAnchor::load_or_generate(&state.join("anchor.key")).unwrap();
            let store = StateStore::open(&state.join("sealer")).unwrap();
            let t = Instant::now();
            let signed = integrity::SignedManifest::seal(
                &file,
                "bench",
                1,
                &anchor,
                &store,
                &HashOptions::default(),
            )
            .unwrap();
            std::fs::write(signed_path(&file), signed.encode()).unwrap();
            println!(
                "sealed in {:.3} s by {}",
                t.elapsed().as_secs_f64(),
                anchor.describe()
            );
        }
        "verify" => {
            let (file, state) = (PathBuf::from(arg(2)), PathBuf::from(arg(3)));
            let threads: usize = arg(4).parse().unwrap();
            let (signed, verifier, store) = load(&file, &state);
            let options = VerifyOptions {
                hash: HashOptions {
                    threads: NonZeroUsize::new(threads).unwrap(),
                    ..HashOptions::default()
                },
                ..VerifyOptions::default()
            };
            let times = (0..runs(5))
                .map(|_| {
                    let t = Instant::now();
                    verifier
                        .verify_object(&file, &signed, &store, &options)
                        .unwrap();
                    t.elapsed()
                })
                .collect();
            report(
                &format!("verify_object {threads} thread(s)"),
                signed.manifest().size(),
                times,
            );
        }
        "reader" => {
            let (file, state) = (PathBuf::from(arg(2)), PathBuf::from(arg(3)));
            let (signed, verifier, store) = load(&file, &state);
            let times = (0..runs(4))
                .map(|_| {
                    let t = Instant::now();
                    let f = File::open(&file).unwrap();
                    let mut r = VerifiedReader::new(f, &signed, &verifier, &store).unwrap();
                    let mut buf = vec![0u8; 1 << 20];
                    while r.read(&mut buf).unwrap() != 0 {}
                    t.elapsed()
                })
                .collect();
            report("VerifiedReader sequential", signed.manifest().size(), times);
        }
        "plain" => {
            let file = PathBuf::from(arg(2));
            let mut size = 0;
            let times = (0..runs(3))
                .map(|_| {
                    let t = Instant::now();
                    let mut f = File::open(&file).unwrap();
                    let mut chunk = vec![0u8; integrity::Manifest::DEFAULT_CHUNK_SIZE as usize];
                    let mut out = vec![0u8; 1 << 20];
                    size = 0;
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
                        std::hint::black_box(Sha256::digest(&chunk[..filled]));
                        for piece in chunk[..filled].chunks(out.len()) {
                            out[..piece.len()].copy_from_slice(piece);
                        }
                        size += filled as u64;
                    }
                    std::hint::black_box(&out);
                    t.elapsed()
                })
                .collect();
            report("plain read + hash", size, times);
        }
        "hsm" => {
            let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"));
            let config = Pkcs11Config::new(
                env("PROBITY_HSM_MODULE"),
                env("PROBITY_HSM_TOKEN"),
                "probity-bench",
                Pin::from_file(Path::new(&env("PROBITY_HSM_PIN_FILE"))).unwrap(),
            );
            let t = Instant::now();
            let anchor = Pkcs11Anchor::open_or_generate(&config).unwrap();
            println!(
                "open (load, login, find or generate key): {:?}",
                t.elapsed()
            );
            let verifier = Verifier::new(anchor.public_key().clone());
            let n = runs(2);
            let mut sign = Vec::new();
            let mut verify = Vec::new();
            for i in 0..n {
                let digest = sha256(&i.to_be_bytes());
                let t = Instant::now();
                let sig = anchor.sign(&digest).unwrap();
                sign.push(t.elapsed());
                let t = Instant::now();
                assert!(verifier.verify(&digest, &sig));
                verify.push(t.elapsed());
            }
            let mut store = Vec::new();
            for i in 0..n.min(200) {
                let t = Instant::now();
                anchor
                    .store_digest("bench", i as u64, &sha256(b"x"))
                    .unwrap();
                store.push(t.elapsed());
            }
            println!(
                "{}: sign median {:?} (includes a ring self-check), ring verify median {:?}, \
                 store_digest median {:?} over {n} runs",
                anchor.describe(),
                median(sign),
                median(verify),
                median(store)
            );
        }
        _ => {
            eprintln!("usage: see the doc comment of engine/examples/integrity_bench.rs");
            std::process::exit(2);
        }
    }
}
