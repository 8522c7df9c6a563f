//! `iptables-save` bytes (the first byte picks the family): the parser never panics; what
//! parses, the reduction takes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_firewall::{Family, Inputs, iptables, reduce};

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let family = if first & 1 == 0 {
        Family::Ipv4
    } else {
        Family::Ipv6
    };
    if let Ok(dump) = iptables::parse(rest, family) {
        let _ = reduce(&Inputs {
            nft: None,
            iptables: vec![&dump],
        });
    }
});
