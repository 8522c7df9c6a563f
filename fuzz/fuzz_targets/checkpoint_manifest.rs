//! Any bytes as a signed checkpoint manifest (the `.manifest` beside a checkpoint that
//! `probity verify` and `POST /v1/verify` read): decoded strictly without a panic, and
//! what decodes re-encodes to exactly the input.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity::integrity::fuzzing::signed_manifest(data);
});
