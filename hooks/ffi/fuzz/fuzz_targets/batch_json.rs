//! A batch of requests from another program: never a panic, a value or an error.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/json.rs"]
mod json;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = json::batch(data) {
        assert!(!e.to_string().is_empty());
    }
});
