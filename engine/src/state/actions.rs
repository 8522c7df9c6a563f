//! Actions a node agent asks of the cluster manager (today `migrate`: move work out of
//! a zone), shared so that the controller reads them through Probity's API rather than
//! from a decision log.
//!
//! Why this module exists: an obligation such as `migrate` targets a zone, which no
//! node agent can act on by itself. The agent that raised the finding publishes an
//! [`ActionRequest`]; it withdraws it when the finding clears; and the request expires
//! with the agent (etcd: under its facts lease; the embedded store: after
//! `ttl_seconds` without a new publish), so a dead agent never keeps an action going.
//! A reader keeps only the live ones ([`ActionRequest::is_live`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::decision::Obligation;

/// The obligation kind that moves work out of a zone.
pub const MIGRATE: &str = "migrate";

/// One agent's request that the cluster manager carry out an obligation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRequest {
    /// The obligation kind (`migrate`).
    pub kind: String,
    /// The entity it targets, as its id (the zone's id for `migrate`).
    pub target: String,
    /// The target's entity type (`Zone`).
    #[serde(default, rename = "targetType")]
    pub target_type: String,
    /// The policy that imposed it.
    pub policy: String,
    /// Why, as the policy's message renders it.
    pub reason: String,
    /// The node whose agent (or reporter) asks it.
    pub node: String,
    /// When it was last published, in Unix seconds.
    pub at: u64,
    /// How long after `at` it expires unless published again, in seconds.
    #[serde(rename = "ttlSeconds")]
    pub ttl_seconds: u64,
    /// The policy's `@param_*` annotations for this obligation (a bound per window,
    /// the annotation that orders pods).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    /// From a policy in `warn` or `audit` mode: what would be done is reported (the
    /// controller's evictions go with `dryRun=All`), nothing is moved.
    #[serde(default, rename = "dryRun", skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
}

impl ActionRequest {
    /// The request that carries out `obligation` (a `migrate`), asked by `node` for
    /// the reason given; `None` for another kind, or a target that is not an entity
    /// `Type::"id"`.
    pub fn of_obligation(
        obligation: &Obligation,
        node: &str,
        reason: &str,
        at: u64,
        ttl_seconds: u64,
    ) -> Option<Self> {
        if obligation.kind != MIGRATE {
            return None;
        }
        let (target_type, target) = split_target(obligation.target.as_deref()?)?;
        Some(Self {
            kind: obligation.kind.clone(),
            target,
            target_type,
            policy: obligation.policy.clone(),
            reason: reason.to_owned(),
            node: node.to_owned(),
            at,
            ttl_seconds,
            parameters: obligation.parameters.clone(),
            dry_run: false,
        })
    }

    /// The key that identifies it: one per kind, node, policy and target, so one
    /// agent's request replaces its own earlier one and never another's.
    pub fn key(&self) -> String {
        Self::key_of(&self.kind, &self.node, &self.policy, &self.target)
    }

    /// The key of the request of `kind` by `node` under `policy` on `target`.
    pub fn key_of(kind: &str, node: &str, policy: &str, target: &str) -> String {
        format!("{kind}/{node}/{policy}/{target}")
    }

    /// Whether it is still in force at `now` (Unix seconds): published within its TTL.
    pub fn is_live(&self, now: u64) -> bool {
        now <= self.at.saturating_add(self.ttl_seconds)
    }
}

/// The type and id of an obligation target `Type::"id"` (`Zone::"zone-a"`), the id
/// unescaped; `None` when it is not one, or the id is empty or holds a `/` (it is part
/// of the request's key).
pub fn split_target(target: &str) -> Option<(String, String)> {
    let (kind, rest) = target.split_once("::\"")?;
    let id = rest.strip_suffix('"')?;
    let id = id.replace("\\\"", "\"").replace("\\\\", "\\");
    let valid = !kind.is_empty()
        && kind
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        && !id.is_empty()
        && !id.contains('/');
    valid.then(|| (kind.to_owned(), id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(at: u64, ttl_seconds: u64) -> ActionRequest {
        ActionRequest {
            kind: MIGRATE.into(),
            target: "zone-a".into(),
            target_type: "Zone".into(),
            policy: "thermal.zone-power-ceiling".into(),
            reason: "hot".into(),
            node: "gpu-1".into(),
            at,
            ttl_seconds,
            parameters: BTreeMap::new(),
            dry_run: false,
        }
    }

    #[test]
    fn a_migrate_target_names_an_entity_or_nothing() {
        assert_eq!(
            split_target("Zone::\"zone-a\""),
            Some(("Zone".into(), "zone-a".into()))
        );
        assert_eq!(split_target("Zone::\"a/b\""), None);
        assert_eq!(split_target("zone-a"), None);
    }

    #[test]
    fn a_request_not_published_again_within_its_ttl_is_not_live() {
        assert!(request(100, 30).is_live(130));
        assert!(!request(100, 30).is_live(131));
    }

    #[test]
    fn requests_of_two_agents_on_one_zone_have_their_own_keys() {
        let mut other = request(1, 1);
        other.node = "gpu-2".into();
        assert_ne!(request(1, 1).key(), other.key());
        assert_eq!(
            request(1, 1).key(),
            "migrate/gpu-1/thermal.zone-power-ceiling/zone-a"
        );
    }
}
