//! A line of the file-backed record log: no panic on any bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = probity_siem::source::parse_line(data);
});
