//! Any request that parses is decided on the default policies without a panic.
#![no_main]
use std::sync::OnceLock;

static ENGINE: OnceLock<probity::Engine> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let engine = ENGINE.get_or_init(|| {
        probity::Engine::from_embedded_defaults().unwrap_or_else(|e| panic!("{e}"))
    });
    if let Ok(request) = probity::Request::from_json_slice(data) {
        let _ = engine.decide(&request);
    }
});
