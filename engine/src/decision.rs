//! What the engine answers: a [`Decision`] with its reasons, obligations and errors.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Allow or deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    /// The request may proceed.
    Allow,
    /// The request may not proceed.
    Deny,
}

impl fmt::Display for Effect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Effect::Allow => "allow",
            Effect::Deny => "deny",
        })
    }
}

/// How serious a reason is, from the policy's `@severity` annotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Informational: usually the permit that allowed a request.
    Info,
    /// Low.
    Low,
    /// Medium.
    Medium,
    /// High.
    High,
    /// Critical.
    Critical,
}

impl FromStr for Severity {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        Ok(match s {
            "info" => Severity::Info,
            "low" => Severity::Low,
            "medium" => Severity::Medium,
            "high" => Severity::High,
            "critical" => Severity::Critical,
            _ => return Err(()),
        })
    }
}

/// Why a decision came out as it did: one policy (or plugin) that determined it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reason {
    /// The policy's `@id`.
    pub policy: String,
    /// The policy's `@message`.
    pub message: String,
    /// The policy's `@severity`.
    pub severity: Severity,
}

/// Something the caller must do because of the decision: block a node, alert, migrate...
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Obligation {
    /// `alert`, `block_node`, `burst_to_cloud`, `migrate` or `rotate_key`.
    pub kind: String,
    /// The entity it applies to, as `Type::"id"`, when the policy names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Extra parameters from the policy's `@param_*` annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    /// The policy that imposed it.
    pub policy: String,
}

/// An error met while deciding. On a forbid policy it makes the decision deny.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionError {
    /// The policy being evaluated, if the error belongs to one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// What went wrong.
    pub message: String,
}

/// A forbid in `warn` or `audit` mode that fired (see [`crate::Mode`]): what it would
/// have refused, and what it would have had done. It changes nothing: the decision is
/// made by the enforcing policies alone, and these obligations are never carried out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// The policy's `@id`.
    pub policy: String,
    /// The policy's `@message`, filled.
    pub message: String,
    /// The policy's `@severity`.
    pub severity: Severity,
    /// What the policy would have imposed had it enforced: recorded, never done.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub obligations: Vec<Obligation>,
    /// Set when the policy could not be evaluated (an enforcing one would have denied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The engine's answer to a [`Request`](crate::Request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Allow or deny.
    pub decision: Effect,
    /// The policies that determined the decision: the forbids that fired on a deny, the
    /// permits that matched on an allow.
    pub reasons: Vec<Reason>,
    /// What the caller must do.
    pub obligations: Vec<Obligation>,
    /// Errors met while deciding.
    pub errors: Vec<DecisionError>,
    /// The forbids in `warn` mode that fired: the caller is told (admission answers
    /// them as AdmissionReview `warnings`), and the decision is not changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Notice>,
    /// The forbids in `audit` mode that fired: recorded only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub audit: Vec<Notice>,
    /// How much the policies prefer this allow: the sum of the `@score` annotations of
    /// the permit policies that allowed it (0 on a deny, or when none has one). The
    /// scheduler extender ranks nodes by it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub score: i64,
    /// True when the decision needed a record (it denied, or carried obligations) and
    /// the decision log could not write it (a full disk, say): it was turned into a deny
    /// that no policy made, with an error saying why. Tell it from a policy's deny and
    /// treat it as "unavailable": the server answers 503, and admission a deny with
    /// code 503.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unrecorded: bool,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl Decision {
    /// A deny caused by an error outside any policy (a malformed request, say).
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            decision: Effect::Deny,
            reasons: Vec::new(),
            obligations: Vec::new(),
            errors: vec![DecisionError {
                policy: None,
                message: message.into(),
            }],
            warnings: Vec::new(),
            audit: Vec::new(),
            score: 0,
            unrecorded: false,
        }
    }

    /// True if the request may proceed.
    pub fn is_allowed(&self) -> bool {
        self.decision == Effect::Allow
    }

    /// The policy ids among the reasons.
    pub fn reason_ids(&self) -> impl Iterator<Item = &str> {
        self.reasons.iter().map(|r| r.policy.as_str())
    }
}
