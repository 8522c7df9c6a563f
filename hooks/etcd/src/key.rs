//! Where Probity's keys live in etcd's one flat keyspace.
//!
//! Why this module exists: every Probity key sits under one configured prefix (default
//! `/probity/`), so a cluster can share etcd with Kubernetes or another Probity deployment.
//! Callers speak in keys relative to that prefix; this module adds the prefix on the way out
//! and checks it on the way in, where the bytes come from etcd and are not trusted: a key
//! outside the prefix or not UTF-8 is an error, never silently mangled.

use std::fmt;

use thiserror::Error;

/// Longest key accepted back from etcd, in bytes (etcd has no limit of its own but its 1.5 MiB
/// request size; Probity's keys are short paths).
pub const MAX_KEY_LEN: usize = 4096;

/// Why a key returned by etcd is not one of ours.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key does not start with the configured prefix.
    #[error("not under the prefix {prefix:?}")]
    OutsidePrefix {
        /// The configured prefix.
        prefix: String,
    },
    /// The part after the prefix is not UTF-8.
    #[error("not UTF-8 at byte {offset}")]
    NotUtf8 {
        /// Byte offset of the first invalid byte, counted in the whole key.
        offset: usize,
    },
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("{len} bytes long, more than the {limit} allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
}

/// The configured prefix and the conversions between relative and full keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyspace {
    prefix: String,
}

impl Keyspace {
    /// A keyspace under `prefix` (validated by the configuration).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    /// The prefix, e.g. `/probity/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The full etcd key of `relative`.
    pub fn full(&self, relative: &str) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + relative.len());
        key.extend_from_slice(self.prefix.as_bytes());
        key.extend_from_slice(relative.as_bytes());
        key
    }

    /// The key relative to the prefix of a full key that etcd returned.
    pub fn relative<'k>(&self, full: &'k [u8]) -> Result<&'k str, KeyError> {
        if full.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong {
                len: full.len(),
                limit: MAX_KEY_LEN,
            });
        }
        let rest =
            full.strip_prefix(self.prefix.as_bytes())
                .ok_or_else(|| KeyError::OutsidePrefix {
                    prefix: self.prefix.clone(),
                })?;
        std::str::from_utf8(rest).map_err(|e| KeyError::NotUtf8 {
            offset: self.prefix.len().saturating_add(e.valid_up_to()),
        })
    }
}

/// A key shown in a message: printable ASCII as is, every other byte as `\xNN`.
pub(crate) struct Escaped<'a>(pub &'a [u8]);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        for &b in self.0.iter().take(256) {
            if b.is_ascii_graphic() || b == b' ' {
                if b == b'"' || b == b'\\' {
                    f.write_str("\\")?;
                }
                write!(f, "{}", char::from(b))?;
            } else {
                write!(f, "\\x{b:02x}")?;
            }
        }
        if self.0.len() > 256 {
            write!(f, "...({} bytes)", self.0.len())?;
        }
        f.write_str("\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_strips_the_prefix_and_refuses_foreign_keys() {
        let ks = Keyspace::new("/probity/");
        assert_eq!(ks.full("blocklist/n1"), b"/probity/blocklist/n1");
        assert_eq!(ks.relative(b"/probity/blocklist/n1"), Ok("blocklist/n1"));
        assert_eq!(ks.relative(b"/probity/"), Ok(""));
        assert_eq!(
            ks.relative(b"/other/x"),
            Err(KeyError::OutsidePrefix {
                prefix: "/probity/".into()
            })
        );
        assert_eq!(
            ks.relative(b"/probity/a\xffb"),
            Err(KeyError::NotUtf8 { offset: 10 })
        );
        let long = [b'a'; MAX_KEY_LEN + 1];
        assert!(matches!(
            ks.relative(&long),
            Err(KeyError::TooLong { len, .. }) if len == MAX_KEY_LEN + 1
        ));
    }

    #[test]
    fn escaped_shows_bytes_that_do_not_print() {
        assert_eq!(
            Escaped(b"/probity/a\xff\n\"").to_string(),
            "\"/probity/a\\xff\\x0a\\\"\""
        );
    }

    /// Keys from a fixed-seed generator: mutated valid keys never panic, and either parse or
    /// fail with a located error.
    #[test]
    fn relative_survives_mutated_keys() {
        let ks = Keyspace::new("/probity/");
        let seeds: [&[u8]; 4] = [
            b"/probity/blocklist/node-7",
            b"/probity/facts/node-1/gpu",
            b"/probity/",
            "/probity/keys/é".as_bytes(),
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for i in 0..4000_u64 {
            let mut key = seeds[(i % 4) as usize].to_vec();
            match next() % 4 {
                0 => key.truncate((next() as usize) % (key.len() + 1)),
                1 => {
                    if !key.is_empty() {
                        let at = (next() as usize) % key.len();
                        key[at] ^= (next() & 0xff) as u8;
                    }
                }
                2 => {
                    let copy = key.clone();
                    key.extend_from_slice(&copy);
                }
                _ => key.push((next() & 0xff) as u8),
            }
            match ks.relative(&key) {
                Ok(rel) => assert_eq!(ks.full(rel), key),
                Err(KeyError::NotUtf8 { offset }) => assert!(offset < key.len()),
                Err(KeyError::OutsidePrefix { .. }) => assert!(!key.starts_with(b"/probity/")),
                Err(KeyError::TooLong { len, .. }) => assert!(len > MAX_KEY_LEN),
            }
        }
    }
}
