//! Any text as probity.toml: an located error or a configuration, never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = probity::Config::parse("fuzz.toml", &std::sync::Arc::from(text));
    }
});
