//! Where a policy set comes from: a directory on disk, or the defaults compiled
//! into the binary. Either way the engine sees the same thing: named texts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::LoadError;

/// The plugin manifest's file name inside a policy directory.
pub const PLUGIN_MANIFEST: &str = "plugins.toml";

/// The manifest of a policy directory, with the directory its paths are relative to.
/// This module reads it as one more source file of the set; what it names is the
/// plugins' business (`crate::plugin`).
#[derive(Debug, Clone)]
pub(crate) struct ManifestSource {
    pub file: SourceFile,
    pub dir: PathBuf,
}

/// Largest policy, schema or configuration file the engine reads.
pub const MAX_SOURCE_BYTES: u64 = 4 * 1024 * 1024;

/// One named source text.
#[derive(Debug, Clone)]
pub(crate) struct SourceFile {
    pub name: String,
    pub text: Arc<str>,
    /// The file it was read from (`None` for the embedded defaults).
    pub path: Option<PathBuf>,
}

impl SourceFile {
    /// A named text.
    pub fn inline(name: &str, text: &Arc<str>) -> Self {
        Self {
            name: name.to_owned(),
            text: Arc::clone(text),
            path: None,
        }
    }

    /// A problem at byte range `span` of this file.
    pub fn at(
        &self,
        span: std::ops::Range<usize>,
        message: String,
    ) -> Box<crate::diagnostic::SourceDiagnostic> {
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
                        path: None,
                    })
                    .collect(),
                schema: SourceFile {
                    name: "embedded:probity.cedarschema".into(),
                    text: Arc::from(EMBEDDED_SCHEMA),
                    path: None,
                },
                config: SourceFile {
                    name: "embedded:probity.toml".into(),
                    text: Arc::from(EMBEDDED_CONFIG),
                    path: None,
                },
                // The embedded defaults have no plugins: a component is not source text.
                plugins: None,
            }),
            Origin::Dir {
                dir,
                schema,
                config,
                ..
            } => {
                let mut paths = Vec::new();
                collect_cedar_files(dir, &mut paths)?;
                paths.sort();
                let policies = paths
                    .iter()
                    .map(|p| read_source(p))
                    .collect::<Result<Vec<_>, _>>()?;
                let plugins = match self.manifest_path() {
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

    /// A directory in the default layout: `dir/probity.cedarschema`, `dir/probity.toml`,
    /// `dir/plugins.toml` if present.
    pub fn default_dir(dir: &Path) -> Self {
        Origin::Dir {
            dir: dir.to_owned(),
            schema: dir.join("probity.cedarschema"),
            config: dir.join("probity.toml"),
            plugins: None,
        }
    }

    /// The policy directory, if the set comes from one.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            Origin::Dir { dir, .. } => Some(dir),
            Origin::Embedded => None,
        }
    }

    /// The plugin manifest this origin reads, if any.
    fn manifest_path(&self) -> Option<PathBuf> {
        match self {
            Origin::Embedded => None,
            Origin::Dir { dir, plugins, .. } => match plugins {
                Some(explicit) => Some(explicit.clone()),
                None => Some(dir.join(PLUGIN_MANIFEST)).filter(|m| m.is_file()),
            },
        }
    }

    /// Every file the set is built from, in a fixed order: the schema, the
    /// configuration, every policy file (sorted), the plugin manifest and the
    /// components it names. What a seal lists, and what the watcher checks is settled.
    /// A manifest that cannot be read or parsed names no component here (compiling it
    /// reports why).
    ///
    /// `components` names the files a readable manifest refers to (the plugins know
    /// how), so that this reader knows files, not plugins.
    pub(crate) fn set_files(
        &self,
        components: impl FnOnce(&ManifestSource) -> Vec<PathBuf>,
    ) -> Result<Vec<PathBuf>, LoadError> {
        let Origin::Dir {
            dir,
            schema,
            config,
            ..
        } = self
        else {
            return Ok(Vec::new());
        };
        let mut policies = Vec::new();
        collect_cedar_files(dir, &mut policies)?;
        policies.sort();
        let mut files = vec![schema.clone(), config.clone()];
        files.extend(policies);
        if let Some(manifest) = self.manifest_path() {
            if let Ok(file) = read_source(&manifest) {
                let source = ManifestSource {
                    dir: manifest.parent().map(Path::to_path_buf).unwrap_or_default(),
                    file,
                };
                files.push(manifest);
                files.extend(components(&source));
            } else {
                files.push(manifest);
            }
        }
        Ok(files)
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

/// Deepest directory nesting read under a policy directory: a symlink loop
/// (`security/again -> ..`) would otherwise recurse until the stack overflows.
const MAX_POLICY_DEPTH: usize = 32;

fn collect_cedar_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), LoadError> {
    collect_cedar_files_at(dir, out, 0)
}

fn collect_cedar_files_at(
    dir: &Path,
    out: &mut Vec<PathBuf>,
    depth: usize,
) -> Result<(), LoadError> {
    let io = |source| LoadError::Io {
        path: dir.to_path_buf(),
        source,
    };
    if depth > MAX_POLICY_DEPTH {
        return Err(io(std::io::Error::other(format!(
            "directories nest deeper than {MAX_POLICY_DEPTH} levels (a symlink loop?)"
        ))));
    }
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
            collect_cedar_files_at(&path, out, depth + 1)?;
        } else if path.extension().is_some_and(|e| e == "cedar") {
            out.push(path);
        }
    }
    Ok(())
}

fn read_source(path: &Path) -> Result<SourceFile, LoadError> {
    let bytes = read_limited_bytes(path, MAX_SOURCE_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|e| LoadError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    Ok(SourceFile {
        name: path.display().to_string(),
        text: Arc::from(text),
        path: Some(path.to_path_buf()),
    })
}

/// The bytes of `path`, refusing more than `limit` (the file may grow while it is read:
/// at most `limit + 1` bytes are read).
pub(crate) fn read_limited_bytes(path: &Path, limit: u64) -> Result<Vec<u8>, LoadError> {
    use std::io::Read as _;
    let io = |source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let too_large = |size| LoadError::TooLarge {
        path: path.to_path_buf(),
        size,
        limit,
    };
    if len > limit {
        return Err(too_large(len));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    let read = bytes.len() as u64;
    if read > limit {
        return Err(too_large(read));
    }
    Ok(bytes)
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

    /// A directory symlinked into itself recursed until the stack overflowed.
    #[test]
    fn bug_a_symlink_loop_in_the_policy_directory_is_an_error_not_a_stack_overflow() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("security")).unwrap();
        std::os::unix::fs::symlink("..", tmp.path().join("security/again")).unwrap();
        let mut out = Vec::new();
        let e = collect_cedar_files(tmp.path(), &mut out).unwrap_err();
        assert!(matches!(e, LoadError::Io { .. }), "{e:?}");
        let cause = std::error::Error::source(&e).unwrap().to_string();
        assert!(cause.contains("symlink loop"), "{cause}");
    }
}
