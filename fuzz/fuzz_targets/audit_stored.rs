//! Any bytes as a stored audit-log value (a chained or pre-chain record, its decision
//! or event body, a checkpoint): decoded without a panic, and re-encoded to exactly the
//! input where it decodes. The redb file is only as trustworthy as its disk.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity::audit::fuzzing::stored(data);
});
