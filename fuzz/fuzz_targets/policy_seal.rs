//! Any bytes as a `policy.seal`: an error naming a line within the input, or a seal
//! whose canonical encoding is exactly the input. Never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    match probity::policy_seal::PolicySeal::decode(data) {
        Ok(seal) => assert_eq!(seal.encode().as_bytes(), data),
        Err(e) => assert!(e.offset <= data.len()),
    }
});
