//! Any bytes as a request: an error or a request, never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = probity::Request::from_json_slice(data);
});
