//! `nft -j` bytes: the parser never panics; what parses, the reduction takes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_firewall::{Inputs, nft, reduce};

fuzz_target!(|data: &[u8]| {
    if let Ok(rs) = nft::parse(data) {
        let _ = reduce(&Inputs {
            nft: Some(&rs),
            iptables: vec![],
        });
    }
});
