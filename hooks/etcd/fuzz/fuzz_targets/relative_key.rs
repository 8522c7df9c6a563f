//! A key as returned by etcd: relative to the prefix and round-tripping, or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_etcd::Keyspace;

fuzz_target!(|data: &[u8]| {
    let keyspace = Keyspace::new("/probity/");
    if let Ok(relative) = keyspace.relative(data) {
        assert_eq!(keyspace.full(relative), data);
    }
});
