//! Policy modes: whether a forbid that fires denies (`enforce`), is only told to the
//! caller (`warn`) or is only recorded (`audit`). A policy declares its mode with
//! `@mode`; the policy directory's `probity.toml` overrides it by id (`[modes]`) and,
//! for part of the cluster only, by a Cedar condition over the request
//! (`[[mode_scope]]`). Both live in the set's own files, so a sealed set covers its
//! modes. Required policies (`@required`, the schema's `@block_policy`) always enforce.
//!
//! A scoped mode becomes policies of its own at load time: for a policy `P` with
//! scopes `S1..Sn`, the policy `P when S1` takes the first scope's mode, `P unless S1
//! when S2` the second's, and `P unless S1 .. unless Sn` the policy's own. Exactly one
//! of them can fire for a request, and each is validated strictly like any policy.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use toml::de::{DeTable, DeValue};

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

/// What a forbid policy's firing does.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Recorded in the decision's `audit` list and the decision log; the caller is not
    /// told, and the decision is not changed.
    Audit,
    /// Told to the caller in the decision's `warnings` (admission: AdmissionReview
    /// `warnings`) and recorded; the decision is not changed.
    Warn,
    /// Denies: today's behaviour, and the default.
    #[default]
    Enforce,
}

impl Mode {
    /// Every mode, weakest first.
    pub const ALL: [Mode; 3] = [Mode::Audit, Mode::Warn, Mode::Enforce];

    /// The mode's name as written in policies and `probity.toml`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Audit => "audit",
            Mode::Warn => "warn",
            Mode::Enforce => "enforce",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Mode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("\"{s}\" is not a mode (enforce, warn or audit)"))
    }
}

/// The top-level tables of `probity.toml` that this module reads, which the settings
/// reader therefore leaves alone.
pub(crate) const MODE_TABLES: [&str; 2] = ["modes", "mode_scope"];

/// `[modes]`: a policy's mode, by id.
#[derive(Debug, Clone)]
pub(crate) struct ModeOverride {
    pub policy: String,
    pub mode: Mode,
    /// The key's span in `probity.toml`.
    pub span: Range<usize>,
}

/// `[[mode_scope]]`: a policy's mode where a condition over the request holds.
#[derive(Debug, Clone)]
pub(crate) struct ModeScope {
    pub policy: String,
    pub mode: Mode,
    /// A Cedar expression, as `when { ... }` would hold it.
    pub when: String,
    /// Where `when` is written, for the errors of its expression.
    pub when_span: Range<usize>,
    /// The whole entry's span.
    pub span: Range<usize>,
}

/// What `probity.toml` says of modes.
#[derive(Debug, Clone, Default)]
pub(crate) struct ModeConfig {
    pub overrides: Vec<ModeOverride>,
    pub scopes: Vec<ModeScope>,
}

/// The most scopes a set may declare: each one adds a policy to evaluate.
pub(crate) const MAX_SCOPES: usize = 256;

impl ModeConfig {
    /// Reads `[modes]` and `[[mode_scope]]` of `file` (a `probity.toml` that the
    /// settings reader has parsed too; its syntax errors are reported there).
    pub fn read(file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        let Ok(doc) = DeTable::parse(&file.text) else {
            return Ok(Self::default());
        };
        let mut out = Self::default();
        let mut problems = Vec::new();
        let at = |span: Range<usize>, message: String| *file.at(span, message);
        if let Some(modes) = doc.get_ref().get("modes") {
            match modes.get_ref() {
                DeValue::Table(t) => {
                    for (key, value) in t.iter() {
                        let policy: &str = key.get_ref();
                        match value.get_ref() {
                            DeValue::String(s) => match Mode::from_str(s) {
                                Ok(mode) => out.overrides.push(ModeOverride {
                                    policy: policy.to_owned(),
                                    mode,
                                    span: key.span(),
                                }),
                                Err(why) => {
                                    problems.push(at(value.span(), format!("modes.{policy}: {why}")))
                                }
                            },
                            _ => problems.push(at(
                                value.span(),
                                format!(
                                    "modes.{policy}: expected a mode (\"enforce\", \"warn\" or \"audit\")"
                                ),
                            )),
                        }
                    }
                }
                _ => problems.push(at(
                    modes.span(),
                    "modes: expected a table of policy ids and modes".into(),
                )),
            }
        }
        if let Some(scopes) = doc.get_ref().get("mode_scope") {
            match scopes.get_ref() {
                DeValue::Array(items) => {
                    if items.len() > MAX_SCOPES {
                        problems.push(at(
                            scopes.span(),
                            format!(
                                "mode_scope: {} entries, more than the {MAX_SCOPES} a set may have",
                                items.len()
                            ),
                        ));
                    }
                    for (i, item) in items.iter().enumerate().take(MAX_SCOPES) {
                        match read_scope(i, item, file) {
                            Ok(scope) => out.scopes.push(scope),
                            Err(d) => problems.push(*d),
                        }
                    }
                }
                _ => problems.push(at(
                    scopes.span(),
                    "mode_scope: expected an array of tables ([[mode_scope]])".into(),
                )),
            }
        }
        if problems.is_empty() {
            Ok(out)
        } else {
            Err(problems)
        }
    }
}

fn read_scope(
    index: usize,
    item: &toml::Spanned<DeValue<'_>>,
    file: &SourceFile,
) -> Result<ModeScope, Box<SourceDiagnostic>> {
    let name = format!("mode_scope[{index}]");
    let DeValue::Table(t) = item.get_ref() else {
        return Err(file.at(item.span(), format!("{name}: expected a table")));
    };
    for (key, _) in t.iter() {
        let k: &str = key.get_ref();
        if !["policy", "mode", "when"].contains(&k) {
            return Err(file.at(
                key.span(),
                format!("{name}.{k}: unknown key (a scope has policy, mode and when)"),
            ));
        }
    }
    let text = |key: &str| -> Result<(String, Range<usize>), Box<SourceDiagnostic>> {
        match t.get(key) {
            Some(v) => match v.get_ref() {
                DeValue::String(s) if !s.trim().is_empty() => Ok((s.to_string(), v.span())),
                _ => Err(file.at(
                    v.span(),
                    format!("{name}.{key}: expected a non-empty string"),
                )),
            },
            None => Err(file.at(item.span(), format!("{name}: missing {key}"))),
        }
    };
    let (policy, _) = text("policy")?;
    let (mode, mode_span) = text("mode")?;
    let mode =
        Mode::from_str(&mode).map_err(|why| *file.at(mode_span, format!("{name}.mode: {why}")))?;
    let (when, when_span) = text("when")?;
    Ok(ModeScope {
        policy,
        mode,
        when,
        when_span,
        span: item.span(),
    })
}

/// A policy's modes as the live set has them: its own, and the scoped ones in the order
/// they are tried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyModes {
    /// The mode where no scope applies.
    pub mode: Mode,
    /// Where that mode was declared: `probity.toml`, the policy's file (its `@mode`),
    /// or `default`; `required` for a policy that always enforces.
    pub declared_in: String,
    /// `(condition, mode)` pairs from `[[mode_scope]]`, the first that holds wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub scoped: Vec<ScopedMode>,
}

/// One `[[mode_scope]]` of a policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScopedMode {
    /// The Cedar condition over the request.
    pub when: String,
    /// The mode where it holds.
    pub mode: Mode,
}

impl PolicyModes {
    /// The mode `self` gives where `when` holds (the unscoped mode for `None` or a
    /// condition it does not name).
    fn mode_for(&self, when: Option<&str>) -> Mode {
        when.and_then(|w| self.scoped.iter().find(|s| s.when == w))
            .map_or(self.mode, |s| s.mode)
    }

    /// The parts of `self` whose mode is weaker than `before` gave them: each
    /// `(scope, from, to)`, `None` for the unscoped mode.
    pub(crate) fn lowered_from(&self, before: &PolicyModes) -> Vec<(Option<String>, Mode, Mode)> {
        let mut out = Vec::new();
        if self.mode < before.mode {
            out.push((None, before.mode, self.mode));
        }
        for s in &self.scoped {
            let was = before.mode_for(Some(&s.when));
            if s.mode < was {
                out.push((Some(s.when.clone()), was, s.mode));
            }
        }
        out
    }
}

/// A policy whose mode a reload lowered (enforce to warn or audit, warn to audit).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModeChange {
    /// The policy's `@id`.
    pub policy: String,
    /// The scope's condition, for a scoped mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// The mode before the reload.
    pub from: Mode,
    /// The mode after it.
    pub to: Mode,
    /// The file that declares the new mode.
    pub declared_in: String,
    /// Who owns that file (`uid:N`, with the user's name when `/etc/passwd` has it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl fmt::Display for ModeChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} lowered from {} to {}",
            self.policy, self.from, self.to
        )?;
        if let Some(scope) = &self.scope {
            write!(f, " where {scope}")?;
        }
        write!(f, " by {}", self.declared_in)?;
        if let Some(owner) = &self.owner {
            write!(f, " (owned by {owner})")?;
        }
        Ok(())
    }
}

/// The owner of `path`, as `uid:N (name)`.
pub(crate) fn file_owner(path: &std::path::Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::symlink_metadata(path).ok()?.uid();
    let name = std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let mut fields = line.split(':');
                let name = fields.next()?;
                let _password = fields.next()?;
                (fields.next()?.parse::<u32>().ok()? == uid).then(|| name.to_owned())
            })
        });
    Some(match name {
        Some(n) => format!("uid:{uid} ({n})"),
        None => format!("uid:{uid}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn config(text: &str) -> Result<ModeConfig, Vec<SourceDiagnostic>> {
        ModeConfig::read(&SourceFile::inline("probity.toml", &Arc::from(text)))
    }

    #[test]
    fn modes_order_weakest_first() {
        assert!(Mode::Audit < Mode::Warn && Mode::Warn < Mode::Enforce);
        assert_eq!(Mode::default(), Mode::Enforce);
        assert_eq!("warn".parse::<Mode>(), Ok(Mode::Warn));
        assert_eq!(
            "deny".parse::<Mode>().unwrap_err(),
            "\"deny\" is not a mode (enforce, warn or audit)"
        );
    }

    #[test]
    fn overrides_and_scopes_are_read_with_their_places() {
        let c = config(
            "[modes]\n\"a.b\" = \"audit\"\n\n[[mode_scope]]\npolicy = \"a.b\"\nmode = \"enforce\"\nwhen = 'principal.class == \"x\"'\n",
        )
        .unwrap();
        assert_eq!(c.overrides.len(), 1);
        assert_eq!(c.overrides[0].policy, "a.b");
        assert_eq!(c.overrides[0].mode, Mode::Audit);
        assert_eq!(c.scopes[0].when, "principal.class == \"x\"");
        assert_eq!(c.scopes[0].mode, Mode::Enforce);
    }

    #[test]
    fn a_bad_mode_or_scope_is_located() {
        let e = config("[modes]\n\"a.b\" = \"off\"\n").unwrap_err();
        assert_eq!(
            e[0].to_string(),
            "probity.toml:2:9: modes.a.b: \"off\" is not a mode (enforce, warn or audit)"
        );
        let e = config("[[mode_scope]]\npolicy = \"a.b\"\nmode = \"warn\"\n").unwrap_err();
        assert!(
            e[0].to_string().contains("mode_scope[0]: missing when"),
            "{}",
            e[0]
        );
        let e =
            config("[[mode_scope]]\npolicy = \"a.b\"\nmode = \"warn\"\nwhen = \"true\"\nwho = 1\n")
                .unwrap_err();
        assert!(
            e[0].to_string().contains("mode_scope[0].who: unknown key"),
            "{}",
            e[0]
        );
        let e = config("modes = 3\n").unwrap_err();
        assert!(
            e[0].to_string().contains("modes: expected a table"),
            "{}",
            e[0]
        );
    }

    #[test]
    fn lowering_is_found_per_part() {
        let before = PolicyModes {
            mode: Mode::Enforce,
            declared_in: "default".into(),
            scoped: vec![],
        };
        let after = PolicyModes {
            mode: Mode::Enforce,
            declared_in: "probity.toml".into(),
            scoped: vec![ScopedMode {
                when: "c".into(),
                mode: Mode::Audit,
            }],
        };
        assert_eq!(
            after.lowered_from(&before),
            vec![(Some("c".into()), Mode::Enforce, Mode::Audit)]
        );
        assert!(before.lowered_from(&after).is_empty());
    }
}

/// For the fuzz target `mode_tables`; not part of the API.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use std::sync::Arc;

    use super::ModeConfig;
    use crate::source::SourceFile;

    /// Reads `data` as a `probity.toml`'s `[modes]` and `[[mode_scope]]`: no panic, and
    /// every problem is on a line of the text, with a message.
    pub fn mode_tables(data: &[u8]) {
        let Ok(text) = std::str::from_utf8(data) else {
            return;
        };
        let lines = text.lines().count().max(1);
        let text: Arc<str> = Arc::from(text);
        if let Err(problems) = ModeConfig::read(&SourceFile::inline("probity.toml", &text)) {
            assert!(!problems.is_empty(), "an error without a problem");
            for p in problems {
                assert!(
                    p.line >= 1 && p.line <= lines + 1,
                    "line {} of {lines}",
                    p.line
                );
                assert!(!p.message.is_empty());
            }
        }
    }
}
