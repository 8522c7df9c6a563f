//! auditd: one audit log line (kernel part, `msg='…'`, ENRICHED part, hex, redaction).
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_collect::auditd::{ParseOptions, parse_record};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = parse_record(data, &ParseOptions::default()) {
        // Every accessor on whatever parsed.
        for f in r.fields() {
            let _ = (f.name, f.value, f.kind);
        }
        let _ = (r.id_field("auid"), r.succeeded(), r.command(), r.text());
    }
});
