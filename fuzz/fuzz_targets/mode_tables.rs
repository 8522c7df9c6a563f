//! Any bytes as a policy set's `probity.toml` read for its `[modes]` and
//! `[[mode_scope]]` tables: no panic, and every problem located on a line of the text.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity::modes_fuzzing::mode_tables(data);
});
