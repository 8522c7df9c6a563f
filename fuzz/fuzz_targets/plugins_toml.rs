//! Any bytes as a policy set's `plugins.toml`: parsed and validated without a panic,
//! and every problem located within the text.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity::plugin_fuzzing::plugins_toml(data);
});
