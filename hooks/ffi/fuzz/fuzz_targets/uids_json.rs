//! A list of uids to remove: never a panic, a value or an error.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/json.rs"]
mod json;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = json::uids(data) {
        assert!(!e.to_string().is_empty());
    }
});
