//! The cursor file parser: no panic; what parses is printed back identically.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(seq) = probity_siem::source::parse_cursor(data) {
        assert!(format!("{seq}\n").len() <= data.len());
    }
});
