//! The controller's [`ControlState`] in the cluster: one ConfigMap, written only with the
//! `resourceVersion` it was read at, so the leader and an operator's command
//! (`probity controller pause`, `reset`, `dry-run`) never overwrite each other.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use super::ControllerError;
use super::plan::ControlState;

/// The ConfigMap's key holding the state as JSON.
const STATE_KEY: &str = "state";

/// Where the state lives.
#[derive(Clone)]
pub struct SharedControl {
    api: Api<ConfigMap>,
    name: String,
}

/// The state as read, with the version a write must match.
pub struct Versioned {
    /// The state.
    pub state: ControlState,
    /// The ConfigMap's resourceVersion (None: it does not exist yet).
    version: Option<String>,
    /// Its metadata as read: others' labels, annotations and owners are written back.
    metadata: ObjectMeta,
}

impl SharedControl {
    /// The state in ConfigMap `name` of `api`'s namespace.
    pub fn new(api: Api<ConfigMap>, name: &str) -> Self {
        Self {
            api,
            name: name.to_owned(),
        }
    }

    /// Reads the state; a missing ConfigMap is the default state. A ConfigMap whose
    /// state does not parse is an error, never a default: acting on a forgotten
    /// breaker or pause would be acting by mistake.
    pub async fn load(&self) -> Result<Versioned, ControllerError> {
        let found =
            self.api.get_opt(&self.name).await.map_err(|e| {
                ControllerError::kube(format!("reading ConfigMap {}", self.name), e)
            })?;
        let Some(map) = found else {
            return Ok(Versioned {
                state: ControlState::default(),
                version: None,
                metadata: ObjectMeta::default(),
            });
        };
        let text = map
            .data
            .as_ref()
            .and_then(|d| d.get(STATE_KEY))
            .map_or("{}", String::as_str);
        let state = serde_json::from_str(text).map_err(|e| ControllerError::State {
            name: self.name.clone(),
            reason: e.to_string(),
        })?;
        Ok(Versioned {
            state,
            version: map.metadata.resource_version.clone(),
            metadata: map.metadata,
        })
    }

    /// Writes `state` over the version read; `Ok(false)` when someone wrote in between
    /// (the caller reads again and plans again).
    pub async fn store(
        &self,
        read: &Versioned,
        state: &ControlState,
    ) -> Result<bool, ControllerError> {
        let text = serde_json::to_string(state).map_err(|e| ControllerError::State {
            name: self.name.clone(),
            reason: e.to_string(),
        })?;
        let mut metadata = read.metadata.clone();
        metadata.name = Some(self.name.clone());
        metadata.resource_version = read.version.clone();
        // Left out, the apiserver keeps them as they are.
        metadata.managed_fields = None;
        metadata.labels.get_or_insert_with(BTreeMap::new).insert(
            "app.kubernetes.io/component".to_owned(),
            "controller".to_owned(),
        );
        let map = ConfigMap {
            metadata,
            data: Some(BTreeMap::from([(STATE_KEY.to_owned(), text)])),
            ..ConfigMap::default()
        };
        let written = match read.version {
            None => self.api.create(&PostParams::default(), &map).await,
            Some(_) => {
                self.api
                    .replace(&self.name, &PostParams::default(), &map)
                    .await
            }
        };
        match written {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(ControllerError::kube(
                format!("writing ConfigMap {}", self.name),
                e,
            )),
        }
    }

    /// Reads, changes and writes the state, again after a conflicting write (at most
    /// a few times). For the operator's commands.
    pub async fn update(
        &self,
        change: impl Fn(&mut ControlState),
    ) -> Result<ControlState, ControllerError> {
        for _ in 0..10 {
            let read = self.load().await?;
            let mut state = read.state.clone();
            change(&mut state);
            if self.store(&read, &state).await? {
                return Ok(state);
            }
        }
        Err(ControllerError::Conflict(self.name.clone()))
    }
}
