//! Any text as probity.toml: a located error or the settings entities, never a panic.
#![no_main]

static SCHEMA: &str = include_str!("../../policies/probity.cedarschema");

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let schema = std::sync::Arc::from(SCHEMA);
        if let Ok(settings) = probity::SettingsSchema::from_cedarschema("schema", &schema) {
            let _ = settings.read("fuzz.toml", &std::sync::Arc::from(text));
        }
    }
});
