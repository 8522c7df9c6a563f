//! Trust material on disk: the files Probity believes without checking them against
//! anything else (a pinned public key, the manifest registry, a PIN file, the software
//! anchor's key) and the directory that holds them.
//!
//! Why this module exists: whoever can replace `trusted.pub` decides what verifies, and
//! whoever can rewrite `state.redb` decides which versions count as new. So trust
//! material is
//!
//! * **created tight whatever the umask**: directories 0700, private files 0600, public
//!   files (a public key) 0644 at most. The mode is given at creation
//!   (`DirBuilder::mode`, `OpenOptions::mode`) and set again explicitly afterwards,
//!   since the umask only ever removes bits and a process may run under `umask 000`;
//! * **refused when others can change it**: a file that is group- or world-writable, or
//!   owned by someone other than the running user or root, is not trusted. Symlinks are
//!   followed (Kubernetes Secret and ConfigMap mounts are symlinks into `..data/`) and
//!   the final target is judged; every directory holding a link or the target must be
//!   owned by the running user or root, and no directory on the way to the target may
//!   be world-writable without the sticky bit (anyone could rename the file away and
//!   put another in its place);
//! * **kept secret when it is a secret**: a PIN file or a private key readable by group
//!   or others is refused (a PIN file may be let through with a warning, see
//!   [`check_file_lenient`]).
//!
//! Every refusal is a [`TrustError`] naming the path, the mode or owner, and what is
//! wrong. The two judgements under every check, [`granted_to_others`] (the mode) and
//! [`foreign_owner`] (the owner), are public so that a stricter checker (the keyring's
//! software KEK, which trusts neither root's files nor symlinks) judges by the same code.

use std::fs::{DirBuilder, File, OpenOptions, Permissions};
use std::io::Write as _;
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt,
};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Mode of a directory of trust material.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// Mode of a private file (registry, key, PIN).
pub const PRIVATE_FILE_MODE: u32 = 0o600;
/// Mode of a public file (a pinned public key).
pub const PUBLIC_FILE_MODE: u32 = 0o644;

/// Most symlinks followed to reach a file (Linux's own limit).
const MAX_LINK_HOPS: usize = 40;

/// What a file is, which decides what is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Material {
    /// Public material (a pinned public key): others may read it, not write it.
    Public,
    /// A private database (the registry): others may not write it.
    Registry,
    /// A secret (a PIN, a private key): others may neither read nor write it.
    Secret,
}

impl Material {
    fn describe(self) -> &'static str {
        match self {
            Material::Public => "public key",
            Material::Registry => "registry",
            Material::Secret => "secret",
        }
    }
}

/// Why a file or directory is not trusted, or could not be created tight.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TrustError {
    /// The path could not be inspected or created.
    #[error("cannot {operation} {}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done (`inspect`, `create`, `set the mode of`...).
        operation: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Group or others may write the file: anyone among them could replace what it says.
    #[error(
        "refusing to trust {kind} {}: mode {mode:04o} lets {who} write it (chmod go-w it)",
        path.display()
    )]
    Writable {
        /// The file (the final target of any symlinks).
        path: PathBuf,
        /// What the file is.
        kind: &'static str,
        /// Its permission bits.
        mode: u32,
        /// `group`, `others` or `group and others`.
        who: &'static str,
    },
    /// Group or others may read a secret.
    #[error(
        "refusing to use {kind} {}: mode {mode:04o} lets {who} read it (chmod 600 it)",
        path.display()
    )]
    Readable {
        /// The file (the final target of any symlinks).
        path: PathBuf,
        /// What the file is.
        kind: &'static str,
        /// Its permission bits.
        mode: u32,
        /// `group`, `others` or `group and others`.
        who: &'static str,
    },
    /// The file or a directory holding it belongs to another user, who could change it.
    #[error(
        "refusing to trust {}: it is owned by uid {owner}, neither this user (uid {user}) nor root",
        path.display()
    )]
    Owner {
        /// The file or directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// The running (effective) user.
        user: u32,
    },
    /// A directory on the way to the file is world-writable without the sticky bit:
    /// anyone could rename the file away and put another in its place.
    #[error(
        "refusing to trust {}: directory {} has mode {mode:04o} (world-writable without the sticky bit)",
        file.display(),
        dir.display()
    )]
    UnsafeDirectory {
        /// The directory.
        dir: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// The file it leads to.
        file: PathBuf,
    },
    /// The path is not a regular file (a directory, a device, a socket...).
    #[error("refusing to trust {}: it is not a regular file", path.display())]
    NotRegular {
        /// The path.
        path: PathBuf,
    },
    /// Too many symlinks, or a loop.
    #[error("refusing to trust {}: more than {MAX_LINK_HOPS} symlinks on the way", path.display())]
    SymlinkLoop {
        /// The path.
        path: PathBuf,
    },
}

impl TrustError {
    /// Whether creating failed because the path already exists.
    pub fn already_exists(&self) -> bool {
        matches!(self, TrustError::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists)
    }
}

/// The effective user id of this process.
pub fn running_user() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn io<'a>(
    path: &'a Path,
    operation: &'static str,
) -> impl FnOnce(std::io::Error) -> TrustError + 'a {
    move |source| TrustError::Io {
        path: path.to_owned(),
        operation,
        source,
    }
}

/// Whom `mode` grants any of `access` (a mask over `rwx`: `0o2` write, `0o4` read, `0o7`
/// anything) beyond the owner: `group`, `others` or `group and others`; `None` if nobody.
pub fn granted_to_others(mode: u32, access: u32) -> Option<&'static str> {
    let access = access & 0o7;
    who(mode, access << 3, access)
}

/// The owner of `meta` and the running user, when the owner is neither the running user
/// nor (if `root_trusted`) root: someone who could change the file behind our back.
pub fn foreign_owner(meta: &std::fs::Metadata, root_trusted: bool) -> Option<(u32, u32)> {
    let user = running_user();
    let owner = meta.uid();
    (owner != user && !(root_trusted && owner == 0)).then_some((owner, user))
}

fn who(bits: u32, group: u32, others: u32) -> Option<&'static str> {
    match (bits & group != 0, bits & others != 0) {
        (true, true) => Some("group and others"),
        (true, false) => Some("group"),
        (false, true) => Some("others"),
        (false, false) => None,
    }
}

/// Creates directory `path` (and missing parents) with mode 0700 whatever the umask. An
/// existing directory is kept as it is, but refused if others could replace what it
/// holds (see [`check_dir`]).
pub fn create_private_dir(path: &Path) -> Result<(), TrustError> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => return check_dir(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(path, "inspect")(e)),
    }
    DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR_MODE)
        .create(path)
        .map_err(io(path, "create"))?;
    std::fs::set_permissions(path, Permissions::from_mode(PRIVATE_DIR_MODE))
        .map_err(io(path, "set the mode of"))?;
    check_dir(path)
}

/// Checks that a directory of trust material is one: owned by this user or root, its
/// own mode letting neither group nor others write (not even with the sticky bit: in a
/// 1777 directory anyone may plant a file, `anchor.key` say, and stop the server), no
/// directory above it world-writable without the sticky bit, and every symlink on the
/// way to it owned by this user or root in a directory that passes the same checks (a
/// link another user owns can be repointed, at an empty directory that drops the
/// blocklist, before the next start).
pub fn check_dir(path: &Path) -> Result<(), TrustError> {
    let link_dirs = path_links(path)?;
    let dir = std::fs::canonicalize(path).map_err(io(path, "inspect"))?;
    let meta = std::fs::metadata(&dir).map_err(io(&dir, "inspect"))?;
    if !meta.is_dir() {
        return Err(TrustError::NotRegular { path: dir });
    }
    check_owner(&dir, &meta)?;
    check_ancestors(&dir, &dir)?;
    let mode = meta.mode() & 0o7777;
    if let Some(who) = granted_to_others(mode, 0o2) {
        return Err(TrustError::Writable {
            path: dir,
            kind: "directory",
            mode,
            who,
        });
    }
    for holder in &link_dirs {
        let meta = std::fs::metadata(holder).map_err(io(holder, "inspect"))?;
        check_owner(holder, &meta)?;
        check_ancestors(holder, &dir)?;
    }
    Ok(())
}

/// Walks `path` component by component, following every symlink on the way (not only
/// the last): each must be owned by this user or root. Returns the canonical
/// directories that hold them.
fn path_links(path: &Path) -> Result<Vec<PathBuf>, TrustError> {
    use std::path::Component;
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(io(path, "resolve"))?
            .join(path)
    };
    let mut pending: std::collections::VecDeque<PathBuf> = absolute
        .components()
        .map(|c| PathBuf::from(c.as_os_str()))
        .collect();
    let mut current = PathBuf::from("/");
    let mut holders = Vec::new();
    let mut hops = 0;
    while let Some(part) = pending.pop_front() {
        match part.components().next() {
            Some(Component::RootDir) => current = PathBuf::from("/"),
            Some(Component::ParentDir) => {
                current.pop();
            }
            Some(Component::Normal(name)) => {
                let next = current.join(name);
                let meta = std::fs::symlink_metadata(&next).map_err(io(&next, "inspect"))?;
                if !meta.file_type().is_symlink() {
                    current = next;
                    continue;
                }
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return Err(TrustError::SymlinkLoop {
                        path: path.to_owned(),
                    });
                }
                check_owner(&next, &meta)?;
                holders.push(std::fs::canonicalize(&current).map_err(io(&current, "resolve"))?);
                let target = std::fs::read_link(&next).map_err(io(&next, "read the link"))?;
                if target.is_absolute() {
                    current = PathBuf::from("/");
                }
                for c in target.components().rev() {
                    pending.push_front(PathBuf::from(c.as_os_str()));
                }
            }
            _ => {}
        }
    }
    holders.sort();
    holders.dedup();
    Ok(holders)
}

/// Creates a new file with mode 0600 whatever the umask; fails if it exists
/// ([`TrustError::already_exists`]).
pub fn create_private_file(path: &Path) -> Result<File, TrustError> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(PRIVATE_FILE_MODE)
        .open(path)
        .map_err(io(path, "create"))?;
    file.set_permissions(Permissions::from_mode(PRIVATE_FILE_MODE))
        .map_err(io(path, "set the mode of"))?;
    Ok(file)
}

/// Writes `bytes` to `path` atomically with `mode` (0600 or 0644), whatever the umask: a
/// temporary file in the same directory, synced, then renamed over `path`.
pub fn write_file_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TrustError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> Result<(), TrustError> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode & 0o644)
            .open(&tmp)
            .map_err(io(&tmp, "create"))?;
        file.set_permissions(Permissions::from_mode(mode & 0o644))
            .map_err(io(&tmp, "set the mode of"))?;
        file.write_all(bytes).map_err(io(&tmp, "write"))?;
        file.sync_all().map_err(io(&tmp, "sync"))?;
        std::fs::rename(&tmp, path).map_err(io(path, "replace"))
    };
    let result = write();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Checks that `path` may be trusted as `material` (see the module docs). Returns the
/// final target of any symlinks.
pub fn check_file(path: &Path, material: Material) -> Result<PathBuf, TrustError> {
    let (target, readable) = check_file_lenient(path, material)?;
    match readable {
        Some(problem) => Err(problem),
        None => Ok(target),
    }
}

/// [`check_file`], except that a secret readable by group or others is returned as a
/// warning beside the target instead of refused. Everything else is refused as by
/// [`check_file`].
pub fn check_file_lenient(
    path: &Path,
    material: Material,
) -> Result<(PathBuf, Option<TrustError>), TrustError> {
    let link_dirs = link_directories(path)?;
    let target = std::fs::canonicalize(path).map_err(io(path, "resolve"))?;
    let meta = std::fs::metadata(&target).map_err(io(&target, "inspect"))?;
    if !meta.is_file() {
        return Err(TrustError::NotRegular { path: target });
    }
    let mode = meta.mode() & 0o7777;
    let kind = material.describe();
    if let Some(who) = granted_to_others(mode, 0o2) {
        return Err(TrustError::Writable {
            path: target,
            kind,
            mode,
            who,
        });
    }
    check_owner(&target, &meta)?;
    let mut dirs = link_dirs;
    if let Some(parent) = target.parent() {
        dirs.push(parent.to_path_buf());
    }
    dirs.sort();
    dirs.dedup();
    for dir in &dirs {
        let meta = std::fs::metadata(dir).map_err(io(dir, "inspect"))?;
        check_owner(dir, &meta)?;
        check_ancestors(dir, &target)?;
    }
    let readable = match material {
        Material::Secret => granted_to_others(mode, 0o4).map(|who| TrustError::Readable {
            path: target.clone(),
            kind,
            mode,
            who,
        }),
        Material::Public | Material::Registry => None,
    };
    Ok((target, readable))
}

fn check_owner(path: &Path, meta: &std::fs::Metadata) -> Result<(), TrustError> {
    match foreign_owner(meta, true) {
        None => Ok(()),
        Some((owner, user)) => Err(TrustError::Owner {
            path: path.to_owned(),
            owner,
            user,
        }),
    }
}

/// Refuses if `dir` or any directory above it is world-writable without the sticky bit.
fn check_ancestors(dir: &Path, file: &Path) -> Result<(), TrustError> {
    for d in dir.ancestors() {
        if d.as_os_str().is_empty() {
            continue;
        }
        let meta = std::fs::metadata(d).map_err(io(d, "inspect"))?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(TrustError::UnsafeDirectory {
                dir: d.to_path_buf(),
                mode,
                file: file.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// The directories (canonical) that hold `path` and each symlink followed from it.
fn link_directories(path: &Path) -> Result<Vec<PathBuf>, TrustError> {
    let mut dirs = Vec::new();
    let mut current = path.to_path_buf();
    for _ in 0..MAX_LINK_HOPS {
        let parent = match current.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        dirs.push(std::fs::canonicalize(&parent).map_err(io(&parent, "resolve"))?);
        let meta = std::fs::symlink_metadata(&current).map_err(io(&current, "inspect"))?;
        if !meta.file_type().is_symlink() {
            return Ok(dirs);
        }
        let link = std::fs::read_link(&current).map_err(io(&current, "read the link"))?;
        current = if link.is_absolute() {
            link
        } else {
            parent.join(link)
        };
    }
    Err(TrustError::SymlinkLoop {
        path: path.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn created_dirs_and_files_are_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        create_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        let f = dir.join("f");
        create_private_file(&f).unwrap();
        assert_eq!(mode(&f), 0o600);
        assert!(create_private_file(&f).unwrap_err().already_exists());
        let p = dir.join("p");
        write_file_atomic(&p, b"x", PUBLIC_FILE_MODE).unwrap();
        assert_eq!(mode(&p), 0o644);
        // Never more than 0644, even if asked.
        write_file_atomic(&p, b"y", 0o666).unwrap();
        assert_eq!(mode(&p), 0o644);
        assert_eq!(std::fs::read(&p).unwrap(), b"y");
        check_file(&p, Material::Public).unwrap();
        check_file(&f, Material::Secret).unwrap();
    }

    #[test]
    fn writable_readable_and_unsafe_directories_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("k");
        std::fs::write(&f, "k").unwrap();
        std::fs::set_permissions(&f, Permissions::from_mode(0o664)).unwrap();
        let e = check_file(&f, Material::Public).unwrap_err();
        assert!(
            matches!(
                e,
                TrustError::Writable {
                    mode: 0o664,
                    who: "group",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("0664"), "{e}");
        std::fs::set_permissions(&f, Permissions::from_mode(0o644)).unwrap();
        check_file(&f, Material::Public).unwrap();
        let e = check_file(&f, Material::Secret).unwrap_err();
        assert!(matches!(e, TrustError::Readable { .. }), "{e}");
        let (_, warning) = check_file_lenient(&f, Material::Secret).unwrap();
        assert!(warning.is_some());

        // A world-writable directory without the sticky bit on the way.
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, Permissions::from_mode(0o777)).unwrap();
        let g = open.join("k");
        std::fs::write(&g, "k").unwrap();
        std::fs::set_permissions(&g, Permissions::from_mode(0o644)).unwrap();
        let e = check_file(&g, Material::Public).unwrap_err();
        assert!(matches!(e, TrustError::UnsafeDirectory { .. }), "{e}");
        // The sticky bit makes it safe (like /tmp).
        std::fs::set_permissions(&open, Permissions::from_mode(0o1777)).unwrap();
        check_file(&g, Material::Public).unwrap();
    }

    #[test]
    fn symlinks_are_followed_and_their_directories_judged() {
        let tmp = tempfile::tempdir().unwrap();
        // A ConfigMap mount: data in a hidden timestamped directory, `..data` pointing at
        // it, and the visible name pointing through `..data`.
        let mount = tmp.path().join("mount");
        std::fs::create_dir_all(mount.join("..2026_01_01")).unwrap();
        std::fs::write(mount.join("..2026_01_01/trusted.pub"), "k").unwrap();
        symlink("..2026_01_01", mount.join("..data")).unwrap();
        symlink("..data/trusted.pub", mount.join("trusted.pub")).unwrap();
        let target = check_file(&mount.join("trusted.pub"), Material::Public).unwrap();
        assert!(target.ends_with("..2026_01_01/trusted.pub"), "{target:?}");

        // A link to a file in a world-writable directory is judged by that directory.
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::write(open.join("k"), "k").unwrap();
        std::fs::set_permissions(&open, Permissions::from_mode(0o777)).unwrap();
        symlink(open.join("k"), tmp.path().join("link")).unwrap();
        let e = check_file(&tmp.path().join("link"), Material::Public).unwrap_err();
        assert!(matches!(e, TrustError::UnsafeDirectory { .. }), "{e}");

        // A loop.
        symlink("b", tmp.path().join("a")).unwrap();
        symlink("a", tmp.path().join("b")).unwrap();
        assert!(check_file(&tmp.path().join("a"), Material::Public).is_err());
    }

    #[test]
    fn files_and_directories_of_another_user_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("k");
        std::fs::write(&f, "k").unwrap();
        std::os::unix::fs::chown(&f, Some(65534), None).unwrap();
        let e = check_file(&f, Material::Public).unwrap_err();
        assert!(matches!(e, TrustError::Owner { owner: 65534, .. }), "{e}");
        assert!(e.to_string().contains("uid 65534"), "{e}");

        let d = tmp.path().join("theirs");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("k"), "k").unwrap();
        std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
        let e = check_file(&d.join("k"), Material::Public).unwrap_err();
        assert!(matches!(e, TrustError::Owner { .. }), "{e}");
        assert!(check_dir(&d).is_err());
    }
}
