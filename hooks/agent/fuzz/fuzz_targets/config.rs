//! `probity-agent.toml` text: a configuration or an error located inside the text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_agent::config::{Config, ConfigError};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // A base directory where no inventory file can be found.
    match Config::parse("f.toml", text, std::path::Path::new("/nonexistent/probity-fuzz")) {
        Err(ConfigError::Invalid(l)) if l.file == "f.toml" => {
            assert!(l.line >= 1 && l.offset <= text.len());
        }
        _ => {}
    }
});
