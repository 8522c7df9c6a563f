//! Where a policy set comes from: a directory on disk, or the defaults compiled
//! into the binary. Either way the engine sees the same thing: named texts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::LoadError;
use crate::plugin::{ManifestSource, PLUGIN_MANIFEST};

/// Largest policy, schema or configuration file the engine reads.
pub const MAX_SOURCE_BYTES: u64 = 4 * 1024 * 1024;

/// One named source text.
#[derive(Debug, Clone)]
pub(crate) struct SourceFile {
    pub name: String,
    pub text: Arc<str>,
}

impl SourceFile {
    /// A named text.
    pub fn inline(name: &str, text: &Arc<str>) -> Self {
        Self {
            name: name.to_owned(),
            text: Arc::clone(text),
        }
    }

    /// A problem at byte range `span` of this file.
    pub fn at(&self, span: std::ops::Range<usize>, message: String) -> Box<crate::diagnostic::SourceDiagnostic> {
        Box::new(crate::diagnostic::SourceDiagnostic::new(
            &self.name,
            &self.text,
            span.start,
            span.len(),
            message,
        ))
    }
}

/// Everything a policy set is built from.
#[derive(Debug, Clone)]
pub(crate) struct Sources {
    pub policies: Vec<SourceFile>,
    pub schema: SourceFile,
    pub config: SourceFile,
    /// The plugin manifest (`plugins.toml`), when the directory has one.
    pub plugins: Option<ManifestSource>,
}

/// Where the engine reads its policies from; kept so that reloads read the same place.
#[derive(Debug, Clone)]
pub(crate) enum Origin {
    Embedded,
    Dir {
        dir: PathBuf,
        schema: PathBuf,
        config: PathBuf,
        /// An explicit plugin manifest; `None` means `<dir>/plugins.toml` if it exists.
        plugins: Option<PathBuf>,
    },
}

macro_rules! embedded {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_str!(concat!("../../policies/", $path)))),*]
    };
}

/// The default policies, compiled in so that a first run needs no files.
/// A test checks this list against the policies/ directory.
pub(crate) const EMBEDDED_POLICIES: &[(&str, &str)] = embedded![
    "api/manage.cedar",
    "integrity/checkpoints.cedar",
    "placement/admission.cedar",
    "placement/scheduling.cedar",
    "security/blocklist.cedar",
    "security/elevation.cedar",
    "security/keys.cedar",
    "security/network.cedar",
    "thermal/thermal.cedar",
];
const EMBEDDED_SCHEMA: &str = include_str!("../../policies/probity.cedarschema");
const EMBEDDED_CONFIG: &str = include_str!("../../policies/probity.toml");

impl Origin {
    pub fn read(&self) -> Result<Sources, LoadError> {
        match self {
            Origin::Embedded => Ok(Sources {
                policies: EMBEDDED_POLICIES
                    .iter()
                    .map(|(name, text)| SourceFile {
                        name: format!("embedded:{name}"),
                        text: Arc::from(*text),
                    })
                    .collect(),
                schema: SourceFile {
                    name: "embedded:probity.cedarschema".into(),
                    text: Arc::from(EMBEDDED_SCHEMA),
                },
                config: SourceFile {
                    name: "embedded:probity.toml".into(),
                    text: Arc::from(EMBEDDED_CONFIG),
                },
                // The embedded defaults have no plugins: a component is not source text.
                plugins: None,
            }),
            Origin::Dir {
                dir,
                schema,
                config,
                plugins,
            } => {
                let mut paths = Vec::new();
                collect_cedar_files(dir, &mut paths)?;
                paths.sort();
                let policies = paths
                    .iter()
                    .map(|p| read_source(p))
                    .collect::<Result<Vec<_>, _>>()?;
                let manifest = match plugins {
                    Some(explicit) => Some(explicit.clone()),
                    None => Some(dir.join(PLUGIN_MANIFEST)).filter(|m| m.is_file()),
                };
                let plugins = match manifest {
                    Some(path) => Some(ManifestSource {
                        file: read_source(&path)?,
                        // Component paths are relative to the manifest.
                        dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
                    }),
                    None => None,
                };
                Ok(Sources {
                    policies,
                    schema: read_source(schema)?,
                    config: read_source(config)?,
                    plugins,
                })
            }
        }
    }

    /// The paths a watcher must follow for this origin.
    pub fn watched_paths(&self) -> Vec<PathBuf> {
        match self {
            Origin::Embedded => Vec::new(),
            Origin::Dir {
                dir,
                schema,
                config,
                plugins,
            } => {
                let mut paths = vec![dir.clone(), schema.clone(), config.clone()];
                paths.extend(plugins.iter().cloned());
                paths
            }
        }
    }
}

fn collect_cedar_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), LoadError> {
    let io = |source| LoadError::Io {
        path: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let path = entry.path();
        let name = entry.file_name();
        // Editors and ConfigMap mounts leave hidden files and directories (`..data`) beside
        // the real ones; a ConfigMap's visible names are symlinks into them.
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        let meta = std::fs::metadata(&path).map_err(|source| LoadError::Io {
            path: path.clone(),
            source,
        })?;
        if meta.is_dir() {
            collect_cedar_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "cedar") {
            out.push(path);
        }
    }
    Ok(())
}

fn read_source(path: &Path) -> Result<SourceFile, LoadError> {
    let io = |source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MAX_SOURCE_BYTES {
        return Err(LoadError::TooLarge {
            path: path.to_path_buf(),
            size: len,
            limit: MAX_SOURCE_BYTES,
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    let text = String::from_utf8(bytes).map_err(|e| LoadError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    Ok(SourceFile {
        name: path.display().to_string(),
        text: Arc::from(text),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_list_matches_the_policies_directory() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
        let mut on_disk = Vec::new();
        collect_cedar_files(&dir, &mut on_disk).unwrap();
        let mut on_disk: Vec<String> = on_disk
            .iter()
            .map(|p| p.strip_prefix(&dir).unwrap().to_string_lossy().into_owned())
            .collect();
        on_disk.sort();
        let embedded: Vec<String> = EMBEDDED_POLICIES
            .iter()
            .map(|(n, _)| (*n).to_owned())
            .collect();
        assert_eq!(on_disk, embedded, "update EMBEDDED_POLICIES in source.rs");
    }
}
