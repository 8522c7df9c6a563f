//! Reading a configuration file and checking its values at the places they were written.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use toml::Spanned;

use super::{ConfigError, Located, MAX_CONFIG_BYTES};

/// Parses TOML text into `T`, locating a syntax or shape error.
pub(super) fn parse_toml<T: serde::de::DeserializeOwned>(
    file: &str,
    text: &str,
) -> Result<T, Located> {
    toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        Located::at(file, text, span, e.message().trim_end().to_owned())
    })
}

/// Reads a configuration-sized file.
pub(super) fn read_file(path: &Path) -> Result<String, ConfigError> {
    let read = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read)?.len();
    if len > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge {
            path: path.to_owned(),
            limit: MAX_CONFIG_BYTES,
        });
    }
    let bytes = std::fs::read(path).map_err(read)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge {
            path: path.to_owned(),
            limit: MAX_CONFIG_BYTES,
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        let text = String::from_utf8_lossy(e.as_bytes()).into_owned();
        ConfigError::Invalid(Located::at(
            &path.display().to_string(),
            &text,
            offset..offset,
            "not UTF-8",
        ))
    })
}

/// Checks values against the places they were written.
pub(super) struct Check<'a> {
    pub(super) file: &'a str,
    pub(super) text: &'a str,
}

impl Check<'_> {
    pub(super) fn err(&self, span: Range<usize>, message: impl Into<String>) -> Located {
        Located::at(self.file, self.text, span, message)
    }

    /// An integer within `lo..=hi`, or the default.
    pub(super) fn int(
        &self,
        v: &Option<Spanned<i64>>,
        name: &str,
        lo: i64,
        hi: i64,
        default: i64,
    ) -> Result<u64, Located> {
        let n = match v {
            None => default,
            Some(s) => {
                let n = *s.get_ref();
                if n < lo || n > hi {
                    return Err(self.err(
                        s.span(),
                        format!("{name} must be between {lo} and {hi}, not {n}"),
                    ));
                }
                n
            }
        };
        u64::try_from(n).map_err(|_| self.err(0..0, format!("{name} is negative")))
    }

    pub(super) fn millis(
        &self,
        v: &Option<Spanned<i64>>,
        name: &str,
        default_ms: i64,
    ) -> Result<Duration, Located> {
        self.int(v, name, 1, 3_600_000, default_ms)
            .map(Duration::from_millis)
    }

    pub(super) fn seconds(
        &self,
        v: &Option<Spanned<i64>>,
        name: &str,
        default: i64,
    ) -> Result<Duration, Located> {
        self.int(v, name, 1, 7 * 86_400, default)
            .map(Duration::from_secs)
    }

    pub(super) fn url(
        &self,
        v: &Option<Spanned<String>>,
        name: &str,
        https_ok: bool,
    ) -> Result<Option<String>, Located> {
        let Some(s) = v else {
            return Ok(None);
        };
        let u = s.get_ref().trim();
        let ok = u.starts_with("http://") || (https_ok && u.starts_with("https://"));
        if !ok || u.len() <= "http://".len() || u.chars().any(char::is_whitespace) {
            let want = if https_ok {
                "an http:// or https:// URL"
            } else {
                "an http:// URL (the DCGM scrape has no TLS)"
            };
            return Err(self.err(s.span(), format!("{name} must be {want}, not {u:?}")));
        }
        Ok(Some(u.to_owned()))
    }

    /// An id for Cedar and the engine: what a node name may be.
    pub(super) fn id(&self, s: &Spanned<String>, name: &str) -> Result<String, Located> {
        let v = s.get_ref();
        if !valid_id(v) {
            return Err(self.err(
                s.span(),
                format!(
                    "{name} {v:?} must be 1-253 of A-Z a-z 0-9 - . _, not starting or ending with - or ."
                ),
            ));
        }
        Ok(v.clone())
    }
}

/// Whether `id` is acceptable as a node name (the engine's rule for node ids).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 253
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && !id.starts_with(['-', '.'])
        && !id.ends_with(['-', '.'])
}
