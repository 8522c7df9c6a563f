//! `agent-status.json` bytes, as `probity agent status` reads them: a status (which
//! renders its metrics) or a located error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_agent::status::Status;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = Status::parse(std::path::Path::new("f.json"), data) {
        let _ = s.render_metrics();
    }
});
