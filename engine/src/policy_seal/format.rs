//! The seal's text: signing, encoding, and decoding untrusted bytes with located errors.

use crate::integrity::{
    Anchor, Hash, KeyId, SIGNATURE_LEN, Signature, SignatureProblem, Verifier, hex, sha256,
};

use super::*;

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
    pub(super) fn body(&self) -> String {
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
    pub(super) fn spans(&self) -> Spans {
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

pub(super) struct Spans {
    pub(super) name: (usize, usize),
    pub(super) version: (usize, usize),
    pub(super) files: Vec<(usize, usize)>,
    pub(super) signed_by: (usize, usize),
    pub(super) signature: (usize, usize),
}

/// A line reader that remembers where it is, for errors.
pub(super) struct Lines<'a> {
    pub(super) text: &'a str,
    pub(super) at: usize,
    pub(super) number: usize,
}

impl<'a> Lines<'a> {
    pub(super) fn error(&self, problem: SealProblem) -> SealParseError {
        SealParseError {
            line: self.number,
            offset: self.line_start(),
            problem,
        }
    }

    pub(super) fn line_start(&self) -> usize {
        let before = self.text.get(..self.at).unwrap_or_default();
        let trimmed = before.strip_suffix('\n').unwrap_or(before);
        trimmed.rfind('\n').map_or(0, |i| i + 1)
    }

    /// The next line (without its newline) and its offset.
    pub(super) fn next_line(&mut self) -> Result<(usize, &'a str), SealParseError> {
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
    pub(super) fn field(&mut self, keyword: &'static str) -> Result<&'a str, SealParseError> {
        let (_, line) = self.next_line()?;
        line.strip_prefix(keyword)
            .and_then(|r| r.strip_prefix(' '))
            .ok_or_else(|| self.error(SealProblem::Expected { expected: keyword }))
    }
}

pub(super) fn check_name(name: &str) -> Result<(), SealProblem> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SEAL_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(SealProblem::Name) }
}

pub(super) fn check_path(path: &str) -> Result<(), SealProblem> {
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

pub(super) fn parse_version(text: &str) -> Option<u64> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if canonical { text.parse().ok() } else { None }
}

pub(super) fn parse_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
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
