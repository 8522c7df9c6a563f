//! A stored versioned record, as read back from etcd: a head or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_etcd::{VersionHead, VersionHeadError};

fuzz_target!(|data: &[u8]| {
    match VersionHead::parse(data) {
        Ok(_) => {}
        Err(VersionHeadError::Invalid { line, .. }) => assert!(line >= 1),
        Err(VersionHeadError::NotObject { offset, .. }) => assert!(offset <= data.len()),
        Err(_) => {}
    }
});
