//! The RELP frame parser: no panic, a frame never claims more bytes than given, and an
//! error's offset lies within the input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use probity_siem::transport::relp::{MAX_RESPONSE_DATA, parse_frame, response_status};

fuzz_target!(|data: &[u8]| {
    match parse_frame(data, MAX_RESPONSE_DATA) {
        Ok(Some((frame, n))) => {
            assert!(n <= data.len());
            let _ = response_status(frame.data);
        }
        Ok(None) => {}
        Err(e) => assert!(e.offset <= data.len()),
    }
});
