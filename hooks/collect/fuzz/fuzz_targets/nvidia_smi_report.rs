//! `nvidia-smi -q -x` (XML) and `nvidia-smi -q` (text).
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_collect::nvidia_smi;

fuzz_target!(|data: &[u8]| {
    let _ = nvidia_smi::parse_query_xml(data);
    let _ = nvidia_smi::parse_query_text(data);
});
