//! `/proc/net/{tcp,tcp6,udp,udp6}`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_collect::sockets::{self, ProcNetTable};

fuzz_target!(|data: &[u8]| {
    for table in ProcNetTable::ALL {
        let _ = sockets::parse_proc_net(data, table, false);
    }
});
