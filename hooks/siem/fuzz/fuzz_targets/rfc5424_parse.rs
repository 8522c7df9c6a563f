//! The RFC 5424 parser: no panic, and an error's offset lies within the input.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = probity_siem::syslog::parse(data) {
        assert!(e.offset <= data.len());
    }
});
