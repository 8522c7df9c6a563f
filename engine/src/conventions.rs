//! What the engine itself relies on about a schema, declared in one place.
//!
//! The engine is a policy engine for clusters, not for one schema: the few names it
//! acts on (which obligation kinds policies may carry, which of them blocks an entity,
//! which action a verify-before-read decides) are read from an entity type the schema
//! marks `@conventions`, each with a documented default that matches the default schema:
//!
//! ```cedarschema
//! @conventions
//! @obligations("alert block_node burst_to_cloud migrate rotate_key")
//! @block_obligation("block_node")
//! @verified_read("read")
//! @block_policy("security.blocked-node")
//! entity Conventions;
//! ```
//!
//! | annotation | default | meaning |
//! | --- | --- | --- |
//! | `@obligations` | `alert block_node burst_to_cloud migrate rotate_key` | the obligation kinds a policy's `@obligation` may name; another is a load error, so a typo cannot drop an obligation |
//! | `@block_obligation` | `block_node` | the kind whose target the engine blocks when it carries out a decision (its type must be the blocklist's, `@owned("blocklist")`) |
//! | `@verified_read` | `read` | the action [`Engine::decide_read`](crate::Engine::decide_read) asks: its principal is the reader, its resource the object, and its context holds a Bool `verified` and an optional String `failure` |
//!
//! | `@block_policy` | none | the id of the forbid policy that enforces the blocklist: a set without it, or with it as a permit, is refused (naming it), and no reload can drop it. The default schema declares `security.blocked-node` |
//!
//! A policy annotated `@required` is protected the same way: a reload whose set lacks a
//! policy the live set marks `@required` (or has it as a permit where it was a forbid)
//! is refused, naming it, and the live set keeps serving. To retire such a policy,
//! remove its `@required` in one reload, then the policy in the next.
//!
//! A schema without the declaration gets the defaults. A declared name the schema does
//! not back (a verified-read action it lacks) is a load error; a default one is simply
//! unavailable, and asking for it is a deny that says why (fail closed).

use std::collections::BTreeSet;

use serde_json::Value as Json;

use crate::diagnostic::SourceDiagnostic;
use crate::source::SourceFile;

/// The obligation kinds a schema without `@obligations` allows.
pub const DEFAULT_OBLIGATION_KINDS: &[&str] = &[
    "alert",
    "block_node",
    "burst_to_cloud",
    "migrate",
    "rotate_key",
];

/// The annotation that marks the entity type holding the conventions.
pub const CONVENTIONS_ANNOTATION: &str = "conventions";

/// The names the engine acts on, as the schema declares them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conventions {
    obligation_kinds: BTreeSet<String>,
    block_obligation: String,
    verified_read: Option<VerifiedRead>,
    block_policy: Option<String>,
}

/// The action a verify-before-read decides, and the types it relates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedRead {
    /// The action's id (`read`).
    pub action: String,
    /// The reader's entity type (`Node`).
    pub reader: String,
    /// The read object's entity type (`Checkpoint`).
    pub object: String,
}

/// The context attribute holding the verification's outcome.
pub(crate) const VERIFIED_ATTR: &str = "verified";
/// The context attribute holding why verification failed.
pub(crate) const FAILURE_ATTR: &str = "failure";

impl Default for Conventions {
    fn default() -> Self {
        Self {
            obligation_kinds: DEFAULT_OBLIGATION_KINDS
                .iter()
                .map(|k| (*k).to_owned())
                .collect(),
            block_obligation: "block_node".into(),
            verified_read: None,
            block_policy: None,
        }
    }
}

impl Conventions {
    /// The obligation kinds policies may carry.
    pub fn obligation_kinds(&self) -> impl Iterator<Item = &str> {
        self.obligation_kinds.iter().map(String::as_str)
    }

    /// Whether policies may carry obligation `kind`.
    pub fn knows_obligation(&self, kind: &str) -> bool {
        self.obligation_kinds.contains(kind)
    }

    /// The obligation kind whose target the engine blocks.
    pub fn block_obligation(&self) -> &str {
        &self.block_obligation
    }

    /// The id of the policy that enforces the blocklist, if the schema names one.
    pub fn block_policy(&self) -> Option<&str> {
        self.block_policy.as_deref()
    }

    /// The verify-before-read action, if the schema has one.
    pub fn verified_read(&self) -> Option<&VerifiedRead> {
        self.verified_read.as_ref()
    }

    /// Reads the conventions from the JSON form of the schema `file`.
    pub(crate) fn read(json: &Json, file: &SourceFile) -> Result<Self, Vec<SourceDiagnostic>> {
        let mut out = Self::default();
        let mut problems = Vec::new();
        let problem = |needle: &str, what: String| {
            let offset = file.text.find(needle).unwrap_or(0);
            SourceDiagnostic::new(&file.name, &file.text, offset, needle.len(), what)
        };
        let mut declared = None;
        for (namespace, body) in json.as_object().into_iter().flatten() {
            for (name, decl) in body
                .get("entityTypes")
                .and_then(Json::as_object)
                .into_iter()
                .flatten()
            {
                let Some(annotations) = decl.get("annotations").and_then(Json::as_object) else {
                    continue;
                };
                if !annotations.contains_key(CONVENTIONS_ANNOTATION) {
                    continue;
                }
                let qualified = if namespace.is_empty() {
                    name.clone()
                } else {
                    format!("{namespace}::{name}")
                };
                if let Some(first) = &declared {
                    problems.push(problem(
                        "@conventions",
                        format!(
                            "entity {qualified}: @conventions is declared twice (first on {first})"
                        ),
                    ));
                    continue;
                }
                declared = Some(qualified.clone());
                let get = |k: &str| annotations.get(k).and_then(Json::as_str);
                if let Some(list) = get("obligations") {
                    let kinds: BTreeSet<String> =
                        list.split_whitespace().map(str::to_owned).collect();
                    let bad = kinds.iter().find(|k| {
                        !k.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                    });
                    if let Some(bad) = bad {
                        problems.push(problem(
                            "@obligations",
                            format!("entity {qualified}: obligation kind {bad:?} is not lower_snake_case"),
                        ));
                    } else if kinds.is_empty() {
                        problems.push(problem(
                            "@obligations",
                            format!("entity {qualified}: @obligations names no kind"),
                        ));
                    } else {
                        out.obligation_kinds = kinds;
                    }
                }
                if let Some(kind) = get("block_obligation") {
                    out.block_obligation = kind.to_owned();
                }
                match get("block_policy") {
                    Some(id) if id.trim().is_empty() => problems.push(problem(
                        "@block_policy",
                        format!("entity {qualified}: @block_policy names no policy"),
                    )),
                    Some(id) => out.block_policy = Some(id.to_owned()),
                    None => {}
                }
                if let Some(action) = get("verified_read") {
                    match verified_read(json, action) {
                        Ok(v) => out.verified_read = Some(v),
                        Err(why) => problems.push(problem(
                            "@verified_read",
                            format!("entity {qualified}: @verified_read(\"{action}\"): {why}"),
                        )),
                    }
                }
            }
        }
        if !out.obligation_kinds.contains(&out.block_obligation) {
            problems.push(problem(
                "@block_obligation",
                format!(
                    "the block obligation {:?} is not among the obligation kinds ({})",
                    out.block_obligation,
                    out.obligation_kinds
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if out.verified_read.is_none() && problems.is_empty() {
            // The default: the schema's `read` action, when it has the right shape.
            out.verified_read = verified_read(json, "read").ok();
        }
        if problems.is_empty() {
            Ok(out)
        } else {
            Err(problems)
        }
    }
}

/// The action `name` (in the schema's default namespace) as a verify-before-read: one
/// principal type, one resource type, a Bool `verified` and an optional String `failure`.
fn verified_read(json: &Json, name: &str) -> Result<VerifiedRead, String> {
    let decl = json
        .get("")
        .and_then(|ns| ns.get("actions"))
        .and_then(|a| a.get(name))
        .ok_or("the schema declares no such action")?;
    let one = |key: &str| -> Result<String, String> {
        let list = decl
            .pointer(&format!("/appliesTo/{key}"))
            .and_then(Json::as_array)
            .ok_or(format!("the action has no {key} type"))?;
        match list.as_slice() {
            [Json::String(t)] => Ok(t.clone()),
            _ => Err(format!("the action needs exactly one {key} type")),
        }
    };
    let reader = one("principalTypes")?;
    let object = one("resourceTypes")?;
    let context = decl.pointer("/appliesTo/context/attributes");
    let type_of = |attr: &str| {
        context
            .and_then(|c| c.get(attr))
            .and_then(|a| a.get("name").or_else(|| a.get("type")))
            .and_then(Json::as_str)
    };
    if !matches!(type_of(VERIFIED_ATTR), Some("Bool" | "Boolean")) {
        return Err(format!("its context needs a Bool `{VERIFIED_ATTR}`"));
    }
    if !matches!(type_of(FAILURE_ATTR), None | Some("String")) {
        return Err(format!("its context's `{FAILURE_ATTR}` must be a String"));
    }
    Ok(VerifiedRead {
        action: name.to_owned(),
        reader,
        object,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn read(text: &str) -> Result<Conventions, Vec<SourceDiagnostic>> {
        let (fragment, _) = cedar_policy::SchemaFragment::from_cedarschema_str(text).unwrap();
        let json = fragment.to_json_value().unwrap();
        Conventions::read(
            &json,
            &SourceFile::inline("s.cedarschema", &Arc::from(text)),
        )
    }

    #[test]
    fn the_default_schema_declares_the_defaults() {
        let c = read(include_str!("../../policies/probity.cedarschema")).unwrap();
        let defaults = Conventions {
            verified_read: Some(VerifiedRead {
                action: "read".into(),
                reader: "Node".into(),
                object: "Checkpoint".into(),
            }),
            block_policy: Some("security.blocked-node".into()),
            ..Conventions::default()
        };
        assert_eq!(c, defaults);
    }

    #[test]
    fn another_schema_names_its_own() {
        let c = read(
            r#"
            entity Host; entity Blob;
            action fetch appliesTo { principal: Host, resource: Blob,
                                     context: { verified: Bool, failure?: String } };
            @conventions @obligations("page quarantine") @block_obligation("quarantine")
            @verified_read("fetch")
            entity Conventions;"#,
        )
        .unwrap();
        assert!(c.knows_obligation("page") && !c.knows_obligation("alert"));
        assert_eq!(c.block_obligation(), "quarantine");
        assert_eq!(
            c.verified_read().unwrap(),
            &VerifiedRead {
                action: "fetch".into(),
                reader: "Host".into(),
                object: "Blob".into()
            }
        );
        // No `read` action and no declaration: no verified read at all.
        assert!(read("entity A;").unwrap().verified_read().is_none());
    }

    #[test]
    fn a_declaration_the_schema_does_not_back_is_located() {
        for (text, message) in [
            (
                r#"@conventions @verified_read("fetch") entity C;"#,
                "entity C: @verified_read(\"fetch\"): the schema declares no such action",
            ),
            (
                r#"entity A; action fetch appliesTo { principal: A, resource: A, context: { verified: Long } };
                   @conventions @verified_read("fetch") entity C;"#,
                "entity C: @verified_read(\"fetch\"): its context needs a Bool `verified`",
            ),
            (
                r#"@conventions @obligations("alert") entity C;"#,
                "the block obligation \"block_node\" is not among the obligation kinds (alert)",
            ),
            (
                r#"@conventions @obligations("Alert") entity C;"#,
                "entity C: obligation kind \"Alert\" is not lower_snake_case",
            ),
        ] {
            let problems = read(text).unwrap_err();
            assert_eq!(problems[0].message, message, "{text}");
        }
    }
}
