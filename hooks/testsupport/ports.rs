//! Loopback ports for test daemons, chosen outside the kernel's ephemeral range.
//!
//! Why not `bind(":0")`: that hands out an ephemeral port, and between the test
//! choosing it and the daemon binding it any outgoing connection on the machine (the
//! daemons' own, another test's) may take the same port as its source port, so the
//! daemon fails with "Address already in use" (seen in CI with slurmd). Ports below
//! the ephemeral range are never handed out implicitly, and a process-wide counter
//! keeps two tests of one binary from choosing the same one.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The first port tried: below Linux's default ephemeral range (32768-60999).
const LOW: u32 = 12_000;
/// The span searched above `LOW`.
const SPAN: u32 = 20_000;

static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);

/// A loopback TCP port nobody listens on now, and that the kernel does not hand out
/// as a source port.
pub fn free_port() -> u16 {
    // Each test process starts at its own offset, so concurrent test binaries rarely
    // walk the same ports.
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(7_919)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let offset = NEXT.fetch_add(1, Ordering::SeqCst) % SPAN;
        let port = u16::try_from(LOW + offset).expect("below 65536");
        let free = TcpListener::bind(("0.0.0.0", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port)).is_ok();
        if free {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}
