//! The encrypted-object header parser on arbitrary bytes: never panics; a parsed header
//! re-encodes to exactly the bytes it was parsed from; an error's offset lies in the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_keys::Header;

fuzz_target!(|data: &[u8]| {
    match Header::parse(data) {
        Ok((header, len)) => {
            assert!(len <= data.len());
            assert_eq!(header.encode(), data[..len]);
        }
        Err(e) => assert!(e.offset() <= data.len()),
    }
});
