//! `nvidia-smi --query-gpu` CSV, with and without a header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_collect::nvidia_smi::{self, Columns, QUERY_GPU_FIELDS};

fuzz_target!(|data: &[u8]| {
    let _ = nvidia_smi::parse_query_gpu(data, Columns::Header);
    let _ = nvidia_smi::parse_query_gpu(data, Columns::Given(QUERY_GPU_FIELDS));
});
