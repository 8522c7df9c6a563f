//! The C ABI against the same work in Rust, in one process, interleaved rounds.
//!
//! ```sh
//! cargo build --release -p probity-ffi --examples   # builds libprobity.so beside it
//! target/release/examples/abi_bench [ROUNDS]
//! target/release/examples/abi_bench ROUNDS MIX.ndjson   # the mix of scripts/bench-mix.py
//! ```
//!
//! * decide: `probity_decide` (JSON in, decision JSON out, freed with `probity_free`)
//!   against the Rust baseline that parses the request JSON, decides and serializes the
//!   decision; with the JSON share of the Rust time (parse, decide and serialize alone);
//! * verified reads: `probity_reader_read` with 1 MiB buffers against Rust's
//!   `VerifiedReader` filling the same buffers, over a 256 MiB object in the page cache,
//!   sealed in 4 MiB (the default) and in 64 KiB chunks.
//!
//! The library is loaded with dlopen from beside the example (`target/release`), so the
//! ABI side runs its own copy of the engine, exactly as a C program would.
#![allow(
    unsafe_code,
    reason = "calling the C ABI through dlopen: each call is an `unsafe` block with its SAFETY argument"
)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "a benchmark: a panic with its message is the right answer to a broken setup"
)]

use std::ffi::{CStr, CString, c_char};
use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use engine::integrity::{self, Anchor, HashOptions, SoftwareAnchor, VerifiedReader, Verifier};
use engine::state::StateStore;
use engine::{Engine, Request};

#[repr(C)]
#[derive(Clone, Copy)]
struct Handle {
    id: u64,
}

type Status = i32;
type Open = unsafe extern "C" fn(*const c_char, *const c_char, u32, *mut Handle) -> Status;
type Upsert = unsafe extern "C" fn(Handle, *const u8, usize, *mut usize) -> Status;
type Decide =
    unsafe extern "C" fn(Handle, *const u8, usize, u32, *mut *mut u8, *mut usize) -> Status;
type Free = unsafe extern "C" fn(*mut u8) -> Status;
type Close = extern "C" fn(Handle) -> Status;
type ReaderOpen = unsafe extern "C" fn(
    Handle,
    *const c_char,
    *const c_char,
    *const c_char,
    *const c_char,
    *const c_char,
    *mut Handle,
) -> Status;
type ReaderRead = unsafe extern "C" fn(Handle, *mut u8, usize, *mut usize) -> Status;
type LastError = extern "C" fn() -> *const c_char;

struct Abi {
    _lib: libloading::Library,
    open: Open,
    upsert: Upsert,
    decide: Decide,
    free: Free,
    close: Close,
    reader_open: ReaderOpen,
    reader_read: ReaderRead,
    reader_close: Close,
    last_error: LastError,
}

impl Abi {
    fn load(path: &Path) -> Self {
        // SAFETY: loading libprobity runs no initializers beyond Rust's std; the
        // symbols below are declared with the signatures of include/probity.h.
        unsafe {
            let lib = libloading::Library::new(path).unwrap_or_else(|e| {
                panic!(
                    "cannot load {}: {e} (build with --examples)",
                    path.display()
                )
            });
            Self {
                open: *lib.get(b"probity_engine_open\0").unwrap(),
                upsert: *lib.get(b"probity_upsert_entities\0").unwrap(),
                decide: *lib.get(b"probity_decide\0").unwrap(),
                free: *lib.get(b"probity_free\0").unwrap(),
                close: *lib.get(b"probity_engine_close\0").unwrap(),
                reader_open: *lib.get(b"probity_reader_open\0").unwrap(),
                reader_read: *lib.get(b"probity_reader_read\0").unwrap(),
                reader_close: *lib.get(b"probity_reader_close\0").unwrap(),
                last_error: *lib.get(b"probity_last_error\0").unwrap(),
                _lib: lib,
            }
        }
    }

    fn ok(&self, status: Status, what: &str) {
        if status != 0 {
            // SAFETY: probity_last_error returns a NUL-terminated string.
            let message = unsafe { CStr::from_ptr((self.last_error)()) };
            panic!("{what}: status {status}: {}", message.to_string_lossy());
        }
    }
}

const REQUEST: &[u8] = br#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}"#;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// An engine in Rust and one through the ABI, both on the default policies with the
/// test cluster loaded.
fn open_both(abi: &Abi) -> (Engine, Handle) {
    let cluster = std::fs::read(repo().join("testdata/entities/cluster.json")).unwrap();
    let rust = Engine::from_embedded_defaults().unwrap();
    rust.upsert_entities(&serde_json::from_slice(&cluster).unwrap())
        .unwrap();
    let mut h = Handle { id: 0 };
    // SAFETY: NULL strings are allowed; `h` is a local out parameter.
    abi.ok(
        unsafe { (abi.open)(std::ptr::null(), std::ptr::null(), 0, &mut h) },
        "open",
    );
    // SAFETY: a live slice; the count is not wanted.
    abi.ok(
        unsafe { (abi.upsert)(h, cluster.as_ptr(), cluster.len(), std::ptr::null_mut()) },
        "upsert",
    );
    (rust, h)
}

fn bench_decide(abi: &Abi, rounds: usize) {
    const N: usize = 4000;
    let (rust, h) = open_both(abi);

    let parsed = Request::from_json_slice(REQUEST).unwrap();
    let decision = rust.decide(&parsed);
    assert!(decision.is_allowed());
    let (mut t_rust, mut t_abi, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut t_parse, mut t_decide, mut t_ser) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..N {
            let request = Request::from_json_slice(black_box(REQUEST)).unwrap();
            let d = rust.decide(&request);
            black_box(serde_json::to_vec(&d).unwrap());
        }
        let r = start.elapsed().as_nanos() as f64 / N as f64;

        let start = Instant::now();
        for _ in 0..N {
            let mut out = std::ptr::null_mut();
            let mut len = 0;
            // SAFETY: a live slice and local out parameters.
            let s =
                unsafe { (abi.decide)(h, REQUEST.as_ptr(), REQUEST.len(), 0, &mut out, &mut len) };
            debug_assert_eq!(s, 0);
            black_box((out, len));
            // SAFETY: `out` came from probity_decide.
            unsafe { (abi.free)(out) };
        }
        let a = start.elapsed().as_nanos() as f64 / N as f64;

        let start = Instant::now();
        for _ in 0..N {
            black_box(Request::from_json_slice(black_box(REQUEST)).unwrap());
        }
        t_parse.push(start.elapsed().as_nanos() as f64 / N as f64);
        let start = Instant::now();
        for _ in 0..N {
            black_box(rust.decide(black_box(&parsed)));
        }
        t_decide.push(start.elapsed().as_nanos() as f64 / N as f64);
        let start = Instant::now();
        for _ in 0..N {
            black_box(serde_json::to_vec(black_box(&decision)).unwrap());
        }
        t_ser.push(start.elapsed().as_nanos() as f64 / N as f64);

        t_rust.push(r);
        t_abi.push(a);
        ratios.push(a / r);
    }
    (abi.close)(h);
    let (r, a, ratio) = (median(&mut t_rust), median(&mut t_abi), median(&mut ratios));
    let (p, d, s) = (
        median(&mut t_parse),
        median(&mut t_decide),
        median(&mut t_ser),
    );
    println!("decide ({rounds} rounds x {N}, medians):");
    println!("  rust, JSON in and out      {:>8.0} ns", r);
    println!("  C ABI probity_decide       {:>8.0} ns", a);
    println!(
        "  ratio C ABI / rust         {:>8.3}  (median of per-round ratios)",
        ratio
    );
    println!(
        "  rust parts: parse {p:.0} ns, decide {d:.0} ns, serialize {s:.0} ns; JSON share {:.0}%",
        100.0 * (p + s) / (p + d + s)
    );
}

fn bench_reader(abi: &Abi, rounds: usize, chunk: u32) {
    const SIZE: usize = 256 * 1024 * 1024;
    const BUF: usize = 1024 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("object.bin");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let data: Vec<u8> = (0..SIZE / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(&path, &data).unwrap();
    drop(data);
    let state_dir = tmp.path().join("state");
    let store = StateStore::open(&state_dir).unwrap();
    let anchor = SoftwareAnchor::load_or_generate(&state_dir.join("anchor.key")).unwrap();
    let options = HashOptions {
        chunk_size: chunk,
        ..HashOptions::default()
    };
    let signed =
        integrity::SignedManifest::seal(&path, "bench/object", 1, &anchor, &store, &options)
            .unwrap();
    std::fs::write(integrity::Manifest::default_path(&path), signed.encode()).unwrap();
    let key = tmp.path().join("trusted.pub");
    std::fs::write(&key, anchor.public_key().to_hex()).unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());
    let store = Arc::new(store);

    // The ABI side needs the state directory, which redb locks: a second copy of it.
    let abi_state = tmp.path().join("abi-state");
    {
        let s = StateStore::open(&abi_state).unwrap();
        integrity::SignedManifest::seal(&path, "bench/object", 1, &anchor, &s, &options).unwrap();
    }
    let mut h = Handle { id: 0 };
    let abi_state_c = CString::new(abi_state.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated string and a local out parameter.
    abi.ok(
        unsafe { (abi.open)(std::ptr::null(), abi_state_c.as_ptr(), 0, &mut h) },
        "open",
    );
    let path_c = CString::new(path.to_str().unwrap()).unwrap();
    let key_c = CString::new(key.to_str().unwrap()).unwrap();
    let id_c = CString::new("bench/object").unwrap();

    let mut buf = vec![0u8; BUF];
    let (mut t_rust, mut t_abi, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = Instant::now();
        let file = std::fs::File::open(&path).unwrap();
        let mut r = VerifiedReader::new(file, &signed, &verifier, store.as_ref()).unwrap();
        let mut total = 0;
        loop {
            let mut filled = 0;
            while filled < BUF {
                let n = r.read(&mut buf[filled..]).unwrap();
                if n == 0 {
                    break;
                }
                filled += n;
            }
            if filled == 0 {
                break;
            }
            total += filled;
        }
        assert_eq!(total, SIZE);
        let rust = SIZE as f64 / start.elapsed().as_secs_f64() / 1e9;

        let start = Instant::now();
        let mut reader = Handle { id: 0 };
        // SAFETY: NUL-terminated strings or NULL, and a local out parameter.
        let s = unsafe {
            (abi.reader_open)(
                h,
                path_c.as_ptr(),
                std::ptr::null(),
                key_c.as_ptr(),
                id_c.as_ptr(),
                std::ptr::null(),
                &mut reader,
            )
        };
        abi.ok(s, "reader_open");
        let mut total = 0;
        loop {
            let mut n = 0;
            // SAFETY: a live buffer of BUF bytes and a local out parameter.
            let s = unsafe { (abi.reader_read)(reader, buf.as_mut_ptr(), BUF, &mut n) };
            abi.ok(s, "reader_read");
            if n == 0 {
                break;
            }
            total += n;
        }
        (abi.reader_close)(reader);
        assert_eq!(total, SIZE);
        let via_abi = SIZE as f64 / start.elapsed().as_secs_f64() / 1e9;
        t_rust.push(rust);
        t_abi.push(via_abi);
        ratios.push(via_abi / rust);
    }
    (abi.close)(h);
    println!(
        "verified reads, 1 MiB buffers, 256 MiB object, {} KiB chunks ({rounds} rounds, medians):",
        chunk / 1024
    );
    println!(
        "  rust VerifiedReader        {:>6.3} GB/s",
        median(&mut t_rust)
    );
    println!(
        "  C ABI probity_reader_read  {:>6.3} GB/s",
        median(&mut t_abi)
    );
    println!(
        "  ratio C ABI / rust         {:>6.3}  (median of per-round ratios)",
        median(&mut ratios)
    );
}

/// The realistic mix of `scripts/bench-mix.py` (its `probity-mix.ndjson`), every line
/// decided as a fact reporter (its readers' `read` carries reported context), through
/// the ABI against the same in Rust (parse, decide, serialize), in interleaved rounds.
fn bench_mix(abi: &Abi, rounds: usize, bodies: &Path) {
    let text = std::fs::read_to_string(bodies).unwrap();
    let lines: Vec<&[u8]> = text.lines().take(20_000).map(str::as_bytes).collect();
    let (rust, h) = open_both(abi);
    const FACT_REPORTER: u32 = 1;
    let (mut t_rust, mut t_abi, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = Instant::now();
        for line in &lines {
            let request = Request::from_json_slice(black_box(line))
                .unwrap()
                .as_fact_reporter();
            let d = rust.decide(&request);
            black_box(serde_json::to_vec(&d).unwrap());
        }
        let r = start.elapsed().as_nanos() as f64 / lines.len() as f64;
        let start = Instant::now();
        for line in &lines {
            let mut out = std::ptr::null_mut();
            let mut len = 0;
            // SAFETY: a live slice and local out parameters.
            let s = unsafe {
                (abi.decide)(
                    h,
                    line.as_ptr(),
                    line.len(),
                    FACT_REPORTER,
                    &mut out,
                    &mut len,
                )
            };
            debug_assert_eq!(s, 0);
            black_box((out, len));
            // SAFETY: `out` came from probity_decide.
            unsafe { (abi.free)(out) };
        }
        let a = start.elapsed().as_nanos() as f64 / lines.len() as f64;
        t_rust.push(r);
        t_abi.push(a);
        ratios.push(a / r);
    }
    (abi.close)(h);
    println!(
        "mix of {} requests ({rounds} rounds, medians): rust {:.0} ns, C ABI {:.0} ns, ratio {:.3}",
        lines.len(),
        median(&mut t_rust),
        median(&mut t_abi),
        median(&mut ratios)
    );
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("ROUNDS is a number"))
        .unwrap_or(15);
    let exe = std::env::current_exe().unwrap();
    let lib = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("libprobity.so");
    let abi = Abi::load(&lib);
    if let Some(mix) = std::env::args().nth(2) {
        bench_mix(&abi, rounds, Path::new(&mix));
        return;
    }
    bench_decide(&abi, rounds);
    bench_reader(&abi, rounds.min(9), 4 * 1024 * 1024);
    bench_reader(&abi, rounds.min(9), 64 * 1024);
}
