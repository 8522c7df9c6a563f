//! Prometheus text exposition and the DCGM per-GPU mapping.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_collect::dcgm;

fuzz_target!(|data: &[u8]| {
    let _ = dcgm::parse_dcgm(data);
});
