//! auditd: a stream of lines through the assembler and the session correlator, with the
//! reader's clock moved by the input (a byte 0x01 at a line's start advances it 1 s).
#![no_main]

use std::time::{Duration, SystemTime};

use libfuzzer_sys::fuzz_target;
use probity_collect::auditd::{AssemblyConfig, AuditConfig, LineAt, Pipeline, SessionConfig};

fuzz_target!(|data: &[u8]| {
    // Small tables, so eviction paths run too.
    let config = AuditConfig {
        assembly: AssemblyConfig {
            max_open_events: 4,
            max_records_per_event: 8,
            ..AssemblyConfig::default()
        },
        sessions: SessionConfig {
            max_sessions: 3,
            max_pending_logins: 3,
            ..SessionConfig::default()
        },
        ..AuditConfig::default()
    };
    let mut p = Pipeline::new(&config);
    let mut now = SystemTime::UNIX_EPOCH;
    for (i, line) in data.split(|&b| b == b'\n').enumerate() {
        let line = match line.strip_prefix(b"\x01") {
            Some(rest) => {
                now += Duration::from_secs(1);
                p.tick(now);
                rest
            }
            None => line,
        };
        let at = LineAt {
            origin: "fuzz",
            line: i as u64 + 1,
            offset: 0,
        };
        let _ = p.push_line(line, at, now);
        for e in p.take_elevations() {
            let _ = e.context();
        }
    }
    p.finish();
    let _ = p.take_elevations();
});
