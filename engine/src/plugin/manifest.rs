//! `plugins.toml`: which plugins a policy directory uses, where their components are,
//! which actions they apply to, their limits and their settings.
//!
//! ```toml
//! [[plugin]]
//! name = "power-spike"                        # required; reported as plugin:<name>/<id>
//! path = "../plugins/power-spike.wasm"       # required; relative to this file
//! actions = ["comply"]                        # default: the actions the plugin describes
//! timeout_ms = 50                             # default 50 (epoch deadline per call)
//! memory_mib = 64                             # default 64 (linear memory cap per call)
//! entities = true                             # default true: send the request's entities
//! [plugin.settings]                           # default {}: handed to the plugin as JSON
//! spike_pct = 25
//! ```

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

/// Default epoch deadline of one plugin call, in milliseconds.
pub const DEFAULT_PLUGIN_TIMEOUT_MS: u64 = 50;
/// Default cap on one plugin call's linear memory, in MiB.
pub const DEFAULT_PLUGIN_MEMORY_MIB: u64 = 64;
/// Largest deadline a manifest may set, in milliseconds.
const MAX_TIMEOUT_MS: u64 = 10_000;
/// Largest memory cap a manifest may set, in MiB.
const MAX_MEMORY_MIB: u64 = 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    #[serde(default)]
    pub plugin: Vec<Spanned<Entry>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Entry {
    pub name: Spanned<String>,
    pub path: Spanned<String>,
    #[serde(default)]
    pub actions: Option<Spanned<Vec<String>>>,
    #[serde(default = "default_timeout")]
    pub timeout_ms: Spanned<u64>,
    #[serde(default = "default_memory")]
    pub memory_mib: Spanned<u64>,
    #[serde(default = "yes")]
    pub entities: bool,
    #[serde(default)]
    pub settings: BTreeMap<String, toml::Value>,
}

fn yes() -> bool {
    true
}

fn default_timeout() -> Spanned<u64> {
    Spanned::new(0..0, DEFAULT_PLUGIN_TIMEOUT_MS)
}

fn default_memory() -> Spanned<u64> {
    Spanned::new(0..0, DEFAULT_PLUGIN_MEMORY_MIB)
}

/// A problem in the manifest, at a byte range of it.
#[derive(Debug)]
pub(crate) struct Problem {
    pub span: Range<usize>,
    pub message: String,
}

impl Manifest {
    pub fn parse(text: &str) -> Result<Self, Problem> {
        let manifest: Manifest = toml::from_str(text).map_err(|e| Problem {
            span: e.span().unwrap_or(0..0),
            message: e.message().to_owned(),
        })?;
        let mut seen = BTreeMap::new();
        for entry in &manifest.plugin {
            let e = entry.get_ref();
            let name = e.name.get_ref();
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(Problem {
                    span: e.name.span(),
                    message: format!(
                        "plugin name {name:?} must be non-empty ASCII letters, digits, - or _"
                    ),
                });
            }
            if seen.insert(name.clone(), ()).is_some() {
                return Err(Problem {
                    span: e.name.span(),
                    message: format!("plugin name {name:?} is used twice"),
                });
            }
            let timeout = *e.timeout_ms.get_ref();
            if timeout == 0 || timeout > MAX_TIMEOUT_MS {
                return Err(Problem {
                    span: e.timeout_ms.span(),
                    message: format!("timeout_ms must be between 1 and {MAX_TIMEOUT_MS}"),
                });
            }
            let memory = *e.memory_mib.get_ref();
            if memory == 0 || memory > MAX_MEMORY_MIB {
                return Err(Problem {
                    span: e.memory_mib.span(),
                    message: format!("memory_mib must be between 1 and {MAX_MEMORY_MIB}"),
                });
            }
        }
        Ok(manifest)
    }
}

/// TOML settings as the JSON object handed to the plugin.
pub(crate) fn settings_json(settings: &BTreeMap<String, toml::Value>) -> String {
    fn convert(v: &toml::Value) -> serde_json::Value {
        match v {
            toml::Value::String(s) => serde_json::Value::String(s.clone()),
            toml::Value::Integer(i) => serde_json::Value::from(*i),
            toml::Value::Float(f) => serde_json::Value::from(*f),
            toml::Value::Boolean(b) => serde_json::Value::Bool(*b),
            toml::Value::Datetime(d) => serde_json::Value::String(d.to_string()),
            toml::Value::Array(a) => serde_json::Value::Array(a.iter().map(convert).collect()),
            toml::Value::Table(t) => {
                serde_json::Value::Object(t.iter().map(|(k, v)| (k.clone(), convert(v))).collect())
            }
        }
    }
    serde_json::Value::Object(
        settings
            .iter()
            .map(|(k, v)| (k.clone(), convert(v)))
            .collect(),
    )
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_apply_and_settings_become_json() {
        let m = Manifest::parse(
            "[[plugin]]\nname = \"p\"\npath = \"p.wasm\"\n[plugin.settings]\nspike_pct = 25\n",
        )
        .unwrap();
        let e = m.plugin[0].get_ref();
        assert_eq!(*e.timeout_ms.get_ref(), DEFAULT_PLUGIN_TIMEOUT_MS);
        assert_eq!(*e.memory_mib.get_ref(), DEFAULT_PLUGIN_MEMORY_MIB);
        assert_eq!(settings_json(&e.settings), r#"{"spike_pct":25}"#);
    }

    #[test]
    fn duplicate_names_and_bad_limits_are_located() {
        let text =
            "[[plugin]]\nname = \"p\"\npath = \"a\"\n[[plugin]]\nname = \"p\"\npath = \"b\"\n";
        let p = Manifest::parse(text).err().unwrap();
        assert!(p.message.contains("used twice"));
        assert_eq!(&text[p.span], "\"p\"");
        let p = Manifest::parse("[[plugin]]\nname = \"p\"\npath = \"a\"\ntimeout_ms = 0\n")
            .err()
            .unwrap();
        assert!(p.message.contains("timeout_ms"));
        assert!(Manifest::parse("[[plugin]]\nname = \"p\"\n").is_err());
    }
}
