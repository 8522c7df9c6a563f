//! A record read back from etcd under the engine's prefixes (blocklist, facts, digests,
//! registry): a value or a located error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_etcd::backend::records::{
    RecordError, decode_block, decode_digest, decode_facts, decode_registry,
};

fn check<T>(data: &[u8], result: Result<T, RecordError>) {
    if let Err(RecordError::Json { line, column, .. }) = result {
        // serde_json counts from 1; 0 only for an error at no position (end of input).
        assert!(line <= data.len() + 1 && column <= data.len() + 1);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data, decode_block(data));
    check(data, decode_facts("gpu-a1", data));
    check(data, decode_digest(data));
    check(data, decode_registry(data));
});
