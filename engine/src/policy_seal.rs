//! Sealed policy sets: `policy.seal`, a signed list of every file a policy set is built
//! from, so that an engine in sealed mode ([`crate::EngineBuilder::sealed`]) loads only a
//! set an operator signed, whole, and never an older one.
//!
//! Why this module exists: hot reload follows the files. Whoever can write the policy
//! directory (or a half-finished write, or a ConfigMap rolled back by hand) decides what
//! the engine enforces; the quiescence heuristic of the watcher narrows the window of a
//! half-written file but cannot close it. A seal closes it: the set loads only if
//!
//! * `policy.seal` verifies against the pinned key (the same anchors as checkpoints: an
//!   HSM over PKCS#11 or the software anchor, checked with [`Verifier`]);
//! * every file the engine reads (schema, `probity.toml`, every `.cedar`, `plugins.toml`
//!   and every component it names) is listed with the SHA-256 of the bytes the engine
//!   compiled, and no other policy file is present;
//! * its version is not lower than the live set's, nor than the version remembered in
//!   the attached state store (so an old signed set cannot be replayed even across a
//!   restart); the same version must have the same contents.
//!
//! Anything else is a rejected reload, located in `policy.seal`, and the previous set
//! keeps serving.
//!
//! # Encoding (format 1)
//!
//! UTF-8 text, lines ended by `\n` (no `\r`, no control characters, no trailing spaces),
//! exactly:
//!
//! ```text
//! probity-policy-seal 1
//! name <name>
//! version <decimal u64, no sign, no leading zero>
//! file <sha256, 64 lowercase hex> <path relative to the policy directory>
//! ...                                   (one or more, sorted by path bytes, unique)
//! signed-by <key id, 64 lowercase hex: SHA-256 of the signer's public point>
//! signature <128 lowercase hex: ECDSA P-256 r || s>
//! ```
//!
//! * `name`: 1 to 128 ASCII letters, digits, `.`, `_` or `-`.
//! * `path`: `/`-separated, relative, no empty, `.` or `..` component, at most 4096
//!   bytes. Every file lies under the policy directory.
//! * The **seal digest** is SHA-256 of the bytes from the start of the file through the
//!   newline of the last `file` line; the signature is the anchor's signature over that
//!   digest (the scheme of [`crate::integrity`]: ECDSA P-256 over SHA-256 of the digest).
//!   The header line separates it from manifest digests, which hash binary encodings
//!   starting `PRBM`.
//!
//! Every field has one spelling, so the encoding is canonical: a file decodes only if
//! re-encoding it gives back the same bytes. Decoding takes untrusted bytes: at most
//! [`MAX_SEAL_BYTES`], never panics, and an error names the line and what is wrong.
//!
//! The seal's version is remembered in the state store's manifest registry under the
//! object id `policy-set:<name>`, and (with an HSM) on the token as a `CKO_DATA` object of
//! that id, so it survives the loss of the state directory like a checkpoint's.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use crate::diagnostic::SourceDiagnostic;
use crate::error::LoadError;
use crate::integrity::{
    Anchor, AnchorError, Hash, KeyId, SIGNATURE_LEN, Signature, SignatureProblem, Verifier, hex,
    sha256,
};
use crate::source::Origin;

/// File name of the seal in the policy directory.
pub const SEAL_FILE: &str = "policy.seal";
/// First line of a seal, format 1.
pub const SEAL_HEADER: &str = "probity-policy-seal 1";
/// Largest seal read.
pub const MAX_SEAL_BYTES: usize = 1024 * 1024;
/// Most files one seal lists.
pub const MAX_SEALED_FILES: usize = 10_000;
/// Longest seal name.
pub const MAX_SEAL_NAME_LEN: usize = 128;
/// Longest path in a seal, in bytes.
pub const MAX_SEALED_PATH_LEN: usize = 4096;
/// Prefix of the registry object id under which a sealed set's version is remembered.
pub const REGISTRY_PREFIX: &str = "policy-set:";

/// One file of a sealed set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedFile {
    /// Its path relative to the policy directory, `/`-separated.
    pub path: String,
    /// SHA-256 of its bytes.
    pub sha256: Hash,
}

/// A decoded (not yet trusted) or freshly signed `policy.seal`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySeal {
    name: String,
    version: u64,
    files: Vec<SealedFile>,
    key_id: KeyId,
    signature: Signature,
}

/// Where a seal failed to decode: the line (1-based; 0 for the whole file), its byte
/// offset, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{SEAL_FILE} line {line}: {problem}")]
pub struct SealParseError {
    /// 1-based line; 0 when the problem is the whole file.
    pub line: usize,
    /// Byte offset of the line.
    pub offset: usize,
    /// What is wrong.
    pub problem: SealProblem,
}

/// What is wrong with a seal's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SealProblem {
    /// Over [`MAX_SEAL_BYTES`].
    #[error("the seal is {size} bytes, over the limit of {MAX_SEAL_BYTES}")]
    TooLarge {
        /// Its size.
        size: usize,
    },
    /// Not UTF-8.
    #[error("invalid UTF-8 at byte {offset}")]
    NotUtf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// A control character (including `\r` and tab) or trailing space.
    #[error("control character or trailing space at byte {offset}")]
    BadCharacter {
        /// Offset of the character.
        offset: usize,
    },
    /// The file does not end with a newline.
    #[error("the last line has no newline")]
    NoFinalNewline,
    /// The first line is not [`SEAL_HEADER`].
    #[error("expected `{SEAL_HEADER}`")]
    Header,
    /// A line other than the expected one.
    #[error("expected a `{expected}` line")]
    Expected {
        /// The line's keyword.
        expected: &'static str,
    },
    /// The name is empty, too long, or has characters other than letters, digits, `.`,
    /// `_`, `-`.
    #[error("the name must be 1 to {MAX_SEAL_NAME_LEN} ASCII letters, digits, '.', '_' or '-'")]
    Name,
    /// The version is not a canonical decimal `u64`.
    #[error(
        "the version must be a decimal number without sign or leading zero, at most {}",
        u64::MAX
    )]
    Version,
    /// A hex field of the wrong length or case.
    #[error("{field} must be {digits} lowercase hex digits")]
    Hex {
        /// Which field.
        field: &'static str,
        /// How many digits.
        digits: usize,
    },
    /// A path that is not relative, normal and `/`-separated.
    #[error("path {path:?}: {reason}")]
    Path {
        /// The path, as written.
        path: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Paths out of order or repeated.
    #[error("path {path:?} is out of order or repeated (paths are sorted by bytes, once each)")]
    Order {
        /// The path.
        path: String,
    },
    /// No `file` line.
    #[error("the seal lists no file")]
    NoFiles,
    /// More than [`MAX_SEALED_FILES`] files.
    #[error("the seal lists more than {MAX_SEALED_FILES} files")]
    TooManyFiles,
    /// Lines after the signature.
    #[error("nothing may follow the signature line")]
    Trailing,
}

/// Why a policy directory could not be sealed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SealError {
    /// The set's files could not be listed or read.
    #[error("cannot read the policy set to seal it")]
    Files(#[source] LoadError),
    /// A file of the set lies outside the policy directory.
    #[error(
        "{} is outside the policy directory {}: a sealed set keeps every file under it",
        path.display(),
        dir.display()
    )]
    Outside {
        /// The file.
        path: PathBuf,
        /// The policy directory.
        dir: PathBuf,
    },
    /// A name, version or path that the encoding refuses.
    #[error("cannot seal")]
    Invalid(#[source] SealProblem),
    /// The last version a `u64` holds: no later version could follow it.
    #[error(
        "refusing version {version}: it is the last version, after which the set could never be sealed again"
    )]
    LastVersion {
        /// The version offered.
        version: u64,
    },
    /// The anchor failed to sign or to store the digest on the token.
    #[error("the anchor failed to seal version {version} of {name:?}")]
    Anchor {
        /// Set name.
        name: String,
        /// Version.
        version: u64,
        /// Why.
        #[source]
        source: AnchorError,
    },
    /// `policy.seal` could not be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// The seal file.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::trust::TrustError,
    },
}

/// The seal of the live set, for status endpoints and `probity check`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SealInfo {
    /// The set's name.
    pub name: String,
    /// Its version.
    pub version: u64,
    /// The seal digest, hex.
    pub digest: String,
    /// The key that signed it, hex.
    pub key_id: String,
}

impl PolicySeal {
    /// Signs a seal of `files` (sorted here) as version `version` of set `name`.
    pub fn sign(
        name: &str,
        version: u64,
        mut files: Vec<SealedFile>,
        anchor: &dyn Anchor,
    ) -> Result<Self, SealError> {
        check_name(name).map_err(SealError::Invalid)?;
        files.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
        if files.is_empty() {
            return Err(SealError::Invalid(SealProblem::NoFiles));
        }
        if files.len() > MAX_SEALED_FILES {
            return Err(SealError::Invalid(SealProblem::TooManyFiles));
        }
        for pair in files.windows(2) {
            if let [a, b] = pair
                && a.path == b.path
            {
                return Err(SealError::Invalid(SealProblem::Order {
                    path: b.path.clone(),
                }));
            }
        }
        for f in &files {
            check_path(&f.path).map_err(SealError::Invalid)?;
        }
        let unsigned = Self {
            name: name.to_owned(),
            version,
            files,
            key_id: anchor.public_key().key_id(),
            signature: Signature([0; SIGNATURE_LEN]),
        };
        let signature = anchor
            .sign(&unsigned.digest())
            .map_err(|source| SealError::Anchor {
                name: name.to_owned(),
                version,
                source,
            })?;
        Ok(Self {
            signature,
            ..unsigned
        })
    }

    /// The set's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Its version.
    pub fn version(&self) -> u64 {
        self.version
    }
    /// Its files, sorted by path.
    pub fn files(&self) -> &[SealedFile] {
        &self.files
    }
    /// The id of the key that signed it.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }
    /// The signature.
    pub fn signature(&self) -> &Signature {
        &self.signature
    }
    /// The registry object id its version is remembered under: `policy-set:<name>`.
    pub fn registry_id(&self) -> String {
        format!("{REGISTRY_PREFIX}{}", self.name)
    }

    /// The signed part of the encoding (see the module docs).
    fn body(&self) -> String {
        let mut out = format!(
            "{SEAL_HEADER}\nname {}\nversion {}\n",
            self.name, self.version
        );
        for f in &self.files {
            out.push_str("file ");
            out.push_str(&hex(&f.sha256));
            out.push(' ');
            out.push_str(&f.path);
            out.push('\n');
        }
        out
    }

    /// The seal digest: SHA-256 of the signed part.
    pub fn digest(&self) -> Hash {
        sha256(self.body().as_bytes())
    }

    /// The canonical encoding.
    pub fn encode(&self) -> String {
        let mut out = self.body();
        out.push_str("signed-by ");
        out.push_str(&hex(&self.key_id.0));
        out.push_str("\nsignature ");
        out.push_str(&hex(&self.signature.0));
        out.push('\n');
        out
    }

    /// Checks the signature against the verifier's pinned key.
    pub fn check_signature(&self, verifier: &Verifier) -> Result<(), SignatureProblem> {
        if self.key_id != verifier.key_id() {
            return Err(SignatureProblem::WrongKey {
                expected: verifier.key_id(),
                found: self.key_id,
            });
        }
        if verifier.verify(&self.digest(), &self.signature) {
            Ok(())
        } else {
            Err(SignatureProblem::Invalid)
        }
    }

    /// The public description of the seal.
    pub fn info(&self) -> SealInfo {
        SealInfo {
            name: self.name.clone(),
            version: self.version,
            digest: hex(&self.digest()),
            key_id: hex(&self.key_id.0),
        }
    }

    /// Byte spans (offset, length without the newline) of the lines of the canonical
    /// encoding: name, version, each file, signed-by, signature.
    fn spans(&self) -> Spans {
        let mut at = SEAL_HEADER.len() + 1;
        let mut line = |len: usize| {
            let span = (at, len);
            at += len + 1;
            span
        };
        let name = line(5 + self.name.len());
        let version = line(8 + self.version.to_string().len());
        let files = self
            .files
            .iter()
            .map(|f| line(5 + 64 + 1 + f.path.len()))
            .collect();
        let signed_by = line(10 + 64);
        let signature = line(10 + 2 * SIGNATURE_LEN);
        Spans {
            name,
            version,
            files,
            signed_by,
            signature,
        }
    }

    /// Decodes a seal strictly (see the module docs). Does not check the signature.
    pub fn decode(bytes: &[u8]) -> Result<Self, SealParseError> {
        let whole = |problem| SealParseError {
            line: 0,
            offset: 0,
            problem,
        };
        if bytes.len() > MAX_SEAL_BYTES {
            return Err(whole(SealProblem::TooLarge { size: bytes.len() }));
        }
        let text = std::str::from_utf8(bytes).map_err(|e| {
            let offset = e.valid_up_to();
            let line = bytes
                .get(..offset)
                .map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count())
                + 1;
            SealParseError {
                line,
                offset,
                problem: SealProblem::NotUtf8 { offset },
            }
        })?;
        if !text.ends_with('\n') {
            return Err(whole(SealProblem::NoFinalNewline));
        }
        let mut lines = Lines {
            text,
            at: 0,
            number: 0,
        };
        let (_, header) = lines.next_line()?;
        if header != SEAL_HEADER {
            return Err(lines.error(SealProblem::Header));
        }
        let name = lines.field("name")?;
        check_name(name).map_err(|p| lines.error(p))?;
        let name = name.to_owned();
        let version = lines.field("version")?;
        let version = parse_version(version).ok_or_else(|| lines.error(SealProblem::Version))?;
        let mut files: Vec<SealedFile> = Vec::new();
        let key_id = loop {
            let (_, line) = lines.next_line()?;
            if let Some(rest) = line.strip_prefix("file ") {
                if files.len() >= MAX_SEALED_FILES {
                    return Err(lines.error(SealProblem::TooManyFiles));
                }
                let (digest, path) = rest.split_at_checked(64).ok_or_else(|| {
                    lines.error(SealProblem::Hex {
                        field: "a file's SHA-256",
                        digits: 64,
                    })
                })?;
                let sha256: Hash = parse_hex(digest).ok_or_else(|| {
                    lines.error(SealProblem::Hex {
                        field: "a file's SHA-256",
                        digits: 64,
                    })
                })?;
                let path = path
                    .strip_prefix(' ')
                    .ok_or_else(|| lines.error(SealProblem::Expected { expected: "file" }))?;
                check_path(path).map_err(|p| lines.error(p))?;
                if let Some(last) = files.last()
                    && last.path.as_bytes() >= path.as_bytes()
                {
                    return Err(lines.error(SealProblem::Order {
                        path: path.to_owned(),
                    }));
                }
                files.push(SealedFile {
                    path: path.to_owned(),
                    sha256,
                });
            } else if let Some(rest) = line.strip_prefix("signed-by ") {
                if files.is_empty() {
                    return Err(lines.error(SealProblem::NoFiles));
                }
                break KeyId(parse_hex(rest).ok_or_else(|| {
                    lines.error(SealProblem::Hex {
                        field: "the key id",
                        digits: 64,
                    })
                })?);
            } else {
                return Err(lines.error(SealProblem::Expected {
                    expected: if files.is_empty() {
                        "file"
                    } else {
                        "file or signed-by"
                    },
                }));
            }
        };
        let signature = lines.field("signature")?;
        let signature = Signature(parse_hex(signature).ok_or_else(|| {
            lines.error(SealProblem::Hex {
                field: "the signature",
                digits: 2 * SIGNATURE_LEN,
            })
        })?);
        if lines.at < text.len() {
            lines.next_line()?;
            return Err(lines.error(SealProblem::Trailing));
        }
        Ok(Self {
            name,
            version,
            files,
            key_id,
            signature,
        })
    }
}

struct Spans {
    name: (usize, usize),
    version: (usize, usize),
    files: Vec<(usize, usize)>,
    signed_by: (usize, usize),
    signature: (usize, usize),
}

/// A line reader that remembers where it is, for errors.
struct Lines<'a> {
    text: &'a str,
    at: usize,
    number: usize,
}

impl<'a> Lines<'a> {
    fn error(&self, problem: SealProblem) -> SealParseError {
        SealParseError {
            line: self.number,
            offset: self.line_start(),
            problem,
        }
    }

    fn line_start(&self) -> usize {
        let before = self.text.get(..self.at).unwrap_or_default();
        let trimmed = before.strip_suffix('\n').unwrap_or(before);
        trimmed.rfind('\n').map_or(0, |i| i + 1)
    }

    /// The next line (without its newline) and its offset.
    fn next_line(&mut self) -> Result<(usize, &'a str), SealParseError> {
        let start = self.at;
        self.number += 1;
        let rest = self.text.get(start..).unwrap_or_default();
        let Some(end) = rest.find('\n') else {
            return Err(SealParseError {
                line: self.number,
                offset: start,
                problem: SealProblem::Expected {
                    expected: "further",
                },
            });
        };
        let line = rest.get(..end).unwrap_or_default();
        self.at = start + end + 1;
        if let Some(i) = line
            .char_indices()
            .find(|(_, c)| c.is_control())
            .map(|(i, _)| i)
        {
            return Err(SealParseError {
                line: self.number,
                offset: start,
                problem: SealProblem::BadCharacter { offset: start + i },
            });
        }
        if line.ends_with(' ') {
            return Err(SealParseError {
                line: self.number,
                offset: start,
                problem: SealProblem::BadCharacter {
                    offset: start + line.len() - 1,
                },
            });
        }
        Ok((start, line))
    }

    /// The value of the next line, which must be `<keyword> <value>`.
    fn field(&mut self, keyword: &'static str) -> Result<&'a str, SealParseError> {
        let (_, line) = self.next_line()?;
        line.strip_prefix(keyword)
            .and_then(|r| r.strip_prefix(' '))
            .ok_or_else(|| self.error(SealProblem::Expected { expected: keyword }))
    }
}

fn check_name(name: &str) -> Result<(), SealProblem> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SEAL_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(SealProblem::Name) }
}

fn check_path(path: &str) -> Result<(), SealProblem> {
    let bad = |reason| {
        Err(SealProblem::Path {
            path: path.chars().take(200).collect(),
            reason,
        })
    };
    if path.is_empty() {
        return bad("empty");
    }
    if path.len() > MAX_SEALED_PATH_LEN {
        return bad("longer than 4096 bytes");
    }
    if path.starts_with('/') {
        return bad("absolute (paths are relative to the policy directory)");
    }
    if path.chars().any(char::is_control) {
        return bad("holds a control character");
    }
    for component in path.split('/') {
        match component {
            "" => return bad("has an empty component"),
            "." | ".." => return bad("has a '.' or '..' component"),
            _ => {}
        }
    }
    Ok(())
}

fn parse_version(text: &str) -> Option<u64> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if canonical { text.parse().ok() } else { None }
}

fn parse_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let [hi, lo] = pair else { return None };
        *byte = (digit(*hi)? << 4) | digit(*lo)?;
    }
    Some(out)
}

/// The seal path of a policy directory.
pub fn seal_path(dir: &Path) -> PathBuf {
    dir.join(SEAL_FILE)
}

/// The path of `file` relative to `dir`, `/`-separated, if it lies under `dir` (judged
/// lexically: `.` components dropped, `..` popping a component).
pub(crate) fn relative_name(dir: &Path, file: &Path) -> Option<String> {
    let rest = file.strip_prefix(dir).ok()?;
    let mut parts: Vec<String> = Vec::new();
    for c in rest.components() {
        match c {
            Component::Normal(s) => parts.push(s.to_str()?.to_owned()),
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    if parts.is_empty() {
        None
    } else {
        Some(parts.join("/"))
    }
}

/// Seals the policy set in `dir` (default layout: `probity.cedarschema`,
/// `probity.toml`, the `.cedar` files, `plugins.toml` if present and its components) as
/// version `version` of `name`: hashes every file, signs the seal with `anchor`, keeps
/// its digest on the token when the anchor is an HSM (object id `policy-set:<name>`),
/// and writes `dir/policy.seal` atomically (mode 0644). Validating the set is the
/// caller's business (`probity policy seal` builds an engine on it first).
pub fn seal_policy_dir(
    dir: &Path,
    name: &str,
    version: u64,
    anchor: &dyn Anchor,
) -> Result<PolicySeal, SealError> {
    if version == u64::MAX {
        return Err(SealError::LastVersion { version });
    }
    check_name(name).map_err(SealError::Invalid)?;
    let origin = Origin::default_dir(dir);
    let paths = origin.set_files().map_err(SealError::Files)?;
    let mut files = Vec::with_capacity(paths.len());
    for path in paths {
        let Some(rel) = relative_name(dir, &path) else {
            return Err(SealError::Outside {
                path,
                dir: dir.to_owned(),
            });
        };
        let bytes = crate::source::read_bytes(&path).map_err(SealError::Files)?;
        files.push(SealedFile {
            path: rel,
            sha256: sha256(&bytes),
        });
    }
    let seal = PolicySeal::sign(name, version, files, anchor)?;
    anchor
        .store_digest(&seal.registry_id(), version, &seal.digest())
        .map_err(|source| SealError::Anchor {
            name: name.to_owned(),
            version,
            source,
        })?;
    let path = seal_path(dir);
    crate::trust::write_file_atomic(
        &path,
        seal.encode().as_bytes(),
        crate::trust::PUBLIC_FILE_MODE,
    )
    .map_err(|source| SealError::Write { path, source })?;
    Ok(seal)
}

/// How an engine in sealed mode judges a set.
#[derive(Debug, Clone)]
pub(crate) struct Sealing {
    pub verifier: Verifier,
    /// The name every seal must carry, when pinned.
    pub name: Option<String>,
}

/// A seal that verified, with the bytes to remember it by.
#[derive(Debug, Clone)]
pub(crate) struct LoadedSeal {
    pub seal: PolicySeal,
    pub info: SealInfo,
    pub encoded: Vec<u8>,
    pub digest: Hash,
}

/// A verified seal and the component hashes it was checked against.
pub(crate) struct Checked {
    pub seal: Arc<LoadedSeal>,
    /// Component path -> SHA-256, as read before compiling, for the check after.
    pub components: Vec<(PathBuf, Hash)>,
}

/// Collects located problems in `policy.seal`.
struct Problems {
    file: String,
    text: Arc<str>,
    found: Vec<SourceDiagnostic>,
}

impl Problems {
    fn at(&mut self, span: (usize, usize), message: String) {
        self.found.push(SourceDiagnostic::new(
            &self.file, &self.text, span.0, span.1, message,
        ));
    }
}

fn seal_error(path: &Path, found: Vec<SourceDiagnostic>) -> LoadError {
    LoadError::Sealed {
        seal: path.to_owned(),
        problems: found,
    }
}

/// Reads and verifies `dir/policy.seal` against `sources` (the hashes of the texts about
/// to be compiled) and `components` (the hashes of the plugin components their manifest
/// names), against the live seal (`live`) and the versions `registry` remembers:
/// signature, file list and digests, name, version. Every problem found is reported,
/// located in the seal.
pub(crate) fn check(
    sealing: &Sealing,
    dir: &Path,
    sources: &[(PathBuf, Hash)],
    components: &[(PathBuf, Hash)],
    live: Option<&LoadedSeal>,
    registry: Option<&dyn crate::state::StateBackend>,
) -> Result<Checked, LoadError> {
    let path = seal_path(dir);
    let file = path.display().to_string();
    let empty: Arc<str> = Arc::from("");
    let bytes = match crate::source::read_limited_bytes(&path, MAX_SEAL_BYTES as u64) {
        Ok(b) => b,
        Err(e) => {
            let message = format!(
                "sealed mode: {}",
                crate::error::join_chain(e.to_string(), std::error::Error::source(&e))
            );
            return Err(seal_error(
                &path,
                vec![SourceDiagnostic::new(&file, &empty, 0, 0, message)],
            ));
        }
    };
    let text: Arc<str> = Arc::from(String::from_utf8_lossy(&bytes).into_owned());
    let mut problems = Problems {
        file,
        text: Arc::clone(&text),
        found: Vec::new(),
    };
    let seal = match PolicySeal::decode(&bytes) {
        Ok(s) => s,
        Err(e) => {
            let len = text.get(e.offset..).and_then(|r| r.find('\n')).unwrap_or(0);
            problems.at((e.offset, len), e.to_string());
            return Err(seal_error(&path, problems.found));
        }
    };
    let spans = seal.spans();
    match seal.check_signature(&sealing.verifier) {
        Ok(()) => {}
        Err(SignatureProblem::WrongKey { expected, found }) => {
            problems.at(
                spans.signed_by,
                format!("signed by key {found}, not the pinned key {expected}"),
            );
            return Err(seal_error(&path, problems.found));
        }
        Err(SignatureProblem::Invalid) => {
            problems.at(
                spans.signature,
                "the signature does not verify under the pinned key: the seal was altered".into(),
            );
            return Err(seal_error(&path, problems.found));
        }
    }
    // The signature holds: everything below is what the signer said.
    if let Some(pinned) = &sealing.name
        && pinned != &seal.name
    {
        problems.at(
            spans.name,
            format!("this engine loads only the set named {pinned:?}"),
        );
    }
    let mut actual: Vec<(String, Hash)> = Vec::with_capacity(sources.len() + components.len());
    for (p, hash) in sources.iter().chain(components) {
        match relative_name(dir, p) {
            Some(rel) => actual.push((rel, *hash)),
            None => problems.at(
                (0, 0),
                format!(
                    "{} is outside the policy directory: a sealed set keeps every file under it",
                    p.display()
                ),
            ),
        }
    }
    actual.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    for (i, sealed) in seal.files.iter().enumerate() {
        let span = spans.files.get(i).copied().unwrap_or((0, 0));
        match actual.iter().find(|(rel, _)| rel == &sealed.path) {
            None => problems.at(span, format!("{} is sealed but missing", sealed.path)),
            Some((_, hash)) if hash != &sealed.sha256 => problems.at(
                span,
                format!(
                    "{} was changed after sealing: its SHA-256 is {}, the seal says {}",
                    sealed.path,
                    hex(hash),
                    hex(&sealed.sha256)
                ),
            ),
            Some(_) => {}
        }
    }
    for (rel, _) in &actual {
        if !seal.files.iter().any(|f| &f.path == rel) {
            problems.at(
                (0, 0),
                format!("{rel} is part of the policy set but not sealed: remove it or seal the set again"),
            );
        }
    }
    let digest = seal.digest();
    if let Some(live) = live
        && let Some((on_name, message)) = compare(&seal, &digest, &live.seal, &live.digest)
    {
        problems.at(if on_name { spans.name } else { spans.version }, message);
    }
    if let Some(registry) = registry
        && let Err(e) = registry.check_version(&seal.registry_id(), seal.version, &digest)
    {
        problems.at(spans.version, registry_problem(&e));
    }
    if !problems.found.is_empty() {
        return Err(seal_error(&path, problems.found));
    }
    Ok(Checked {
        seal: Arc::new(LoadedSeal {
            info: seal.info(),
            seal,
            encoded: bytes,
            digest,
        }),
        components: components.to_vec(),
    })
}

/// Why `new` may not replace `live`, if it may not: whether the problem is the name
/// (else the version), and the message.
fn compare(
    new: &PolicySeal,
    new_digest: &Hash,
    live: &PolicySeal,
    live_digest: &Hash,
) -> Option<(bool, String)> {
    if live.name != new.name {
        Some((
            true,
            format!(
                "the live set is {:?}; a set of another name is not loaded by a reload",
                live.name
            ),
        ))
    } else if new.version < live.version {
        Some((
            false,
            format!(
                "version {} is older than the live version {}: refusing the rollback",
                new.version, live.version
            ),
        ))
    } else if new.version == live.version && new_digest != live_digest {
        Some((
            false,
            format!(
                "version {} is live with other contents: seal the change as a new version",
                new.version
            ),
        ))
    } else {
        None
    }
}

/// Why the checked seal `new` may not replace the live one, if it may not.
pub(crate) fn compare_live(new: &LoadedSeal, live: &LoadedSeal) -> Option<String> {
    compare(&new.seal, &new.digest, &live.seal, &live.digest).map(|(_, m)| m)
}

/// A registry refusal of a seal's version, as a message about that version.
pub(crate) fn registry_problem(e: &crate::state::StateError) -> String {
    use crate::state::StateError;
    match e {
        StateError::Rollback {
            offered, accepted, ..
        } => format!(
            "version {offered} is older than version {accepted}, which the state store remembers: refusing the rollback"
        ),
        StateError::DigestConflict { version, .. } => format!(
            "the state store remembers other contents for version {version}: seal the change as a new version"
        ),
        other => format!(
            "cannot check the version against the state store: {}",
            crate::error::join_chain(other.to_string(), std::error::Error::source(other))
        ),
    }
}

/// Locates a problem found after the check (a component that changed while it was
/// compiled, a registry refusal at commit) in the seal.
pub(crate) fn late_problem(dir: &Path, seal: &LoadedSeal, message: String) -> LoadError {
    let path = seal_path(dir);
    let text: Arc<str> = Arc::from(String::from_utf8_lossy(&seal.encoded).into_owned());
    let span = seal.seal.spans().version;
    seal_error(
        &path,
        vec![SourceDiagnostic::new(
            &path.display().to_string(),
            &text,
            span.0,
            span.1,
            message,
        )],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::integrity::SoftwareAnchor;

    fn seal(anchor: &SoftwareAnchor) -> PolicySeal {
        PolicySeal::sign(
            "prod",
            7,
            vec![
                SealedFile {
                    path: "security/blocklist.cedar".into(),
                    sha256: sha256(b"b"),
                },
                SealedFile {
                    path: "probity.toml".into(),
                    sha256: sha256(b"t"),
                },
            ],
            anchor,
        )
        .unwrap()
    }

    #[test]
    fn encode_decode_roundtrip_and_signature() {
        let dir = tempfile::tempdir().unwrap();
        let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
        let s = seal(&anchor);
        let text = s.encode();
        assert!(text.starts_with("probity-policy-seal 1\nname prod\nversion 7\nfile "));
        // Sorted by path.
        assert!(text.find("probity.toml").unwrap() < text.find("security/").unwrap());
        let back = PolicySeal::decode(text.as_bytes()).unwrap();
        assert_eq!(back, s);
        back.check_signature(&Verifier::new(anchor.public_key().clone()))
            .unwrap();
        let spans = s.spans();
        assert_eq!(
            text.get(spans.version.0..spans.version.0 + spans.version.1),
            Some("version 7")
        );
        let (o, l) = spans.files[1];
        assert!(
            text.get(o..o + l)
                .unwrap()
                .ends_with(" security/blocklist.cedar")
        );
        let (o, l) = spans.signature;
        assert!(text.get(o..o + l).unwrap().starts_with("signature "));
        assert_eq!(o + l + 1, text.len());
    }

    #[test]
    fn non_canonical_spellings_are_refused_with_their_line() {
        let dir = tempfile::tempdir().unwrap();
        let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
        let text = seal(&anchor).encode();
        let cases: Vec<(String, usize)> = vec![
            (text.replace("version 7", "version 07"), 3),
            (text.replace("version 7", "version +7"), 3),
            (text.replace("name prod", "name pr od"), 2),
            (text.replace("\n", "\r\n"), 1),
            (text.replacen("file ", "file  ", 1), 4),
            (text.replace("probity.toml", "./probity.toml"), 4),
            (text.replace("probity.toml", "/probity.toml"), 4),
            (text.replace("probity.toml", "zz.toml"), 5),
            (format!("{text}extra\n"), 8),
            (text.trim_end().to_owned(), 0),
            (
                text.replacen("probity-policy-seal 1", "probity-policy-seal 2", 1),
                1,
            ),
        ];
        for (bad, line) in cases {
            let e = PolicySeal::decode(bad.as_bytes()).unwrap_err();
            assert_eq!(e.line, line, "{bad:?}: {e}");
        }
        let upper = text.replace(&hex(&sha256(b"t")), &hex(&sha256(b"t")).to_uppercase());
        assert!(PolicySeal::decode(upper.as_bytes()).is_err());
        let big = vec![b'a'; MAX_SEAL_BYTES + 1];
        assert!(matches!(
            PolicySeal::decode(&big).unwrap_err().problem,
            SealProblem::TooLarge { .. }
        ));
    }

    /// Truncations, byte flips and duplicated lines of a real seal: never a panic, and
    /// either a seal whose re-encoding is the input or a located error.
    #[test]
    fn mutated_seals_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
        let good = seal(&anchor).encode().into_bytes();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..5000 {
            let mut b = good.clone();
            match next() % 4 {
                0 => b.truncate((next() as usize) % (good.len() + 1)),
                1 => {
                    let i = (next() as usize) % b.len();
                    b[i] ^= 1 << (next() % 8);
                }
                2 => {
                    let lines: Vec<&[u8]> = good.split_inclusive(|&c| c == b'\n').collect();
                    let i = (next() as usize) % lines.len();
                    let mut v = Vec::new();
                    for (j, l) in lines.iter().enumerate() {
                        v.extend_from_slice(l);
                        if j == i {
                            v.extend_from_slice(l);
                        }
                    }
                    b = v;
                }
                _ => {
                    let i = (next() as usize) % b.len();
                    b.insert(i, (next() % 256) as u8);
                }
            }
            match PolicySeal::decode(&b) {
                Ok(s) => assert_eq!(s.encode().as_bytes(), b.as_slice()),
                Err(e) => assert!(e.offset <= b.len(), "{e}"),
            }
        }
    }

    #[test]
    fn relative_names_stay_under_the_directory() {
        let d = Path::new("/p");
        assert_eq!(
            relative_name(d, Path::new("/p/a/./b.cedar")).as_deref(),
            Some("a/b.cedar")
        );
        assert_eq!(
            relative_name(d, Path::new("/p/a/../b.wasm")).as_deref(),
            Some("b.wasm")
        );
        assert_eq!(relative_name(d, Path::new("/p/../q/x")), None);
        assert_eq!(relative_name(d, Path::new("/q/x")), None);
        assert_eq!(relative_name(d, Path::new("/p")), None);
    }
}
