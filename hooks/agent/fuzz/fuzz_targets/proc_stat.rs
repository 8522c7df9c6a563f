//! `/proc/stat` bytes: a CPU count of at least 1, or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(n) = probity_agent::sources::parse_proc_stat_cpus(data) {
        assert!(n >= 1);
    }
});
