//! The controller's [`ControlState`] in the cluster: one ConfigMap, written only with the
//! `resourceVersion` it was read at, so the leader and an operator's command
//! (`probity controller pause`, `reset`, `dry-run`) never overwrite each other.

use std::collections::BTreeMap;
use std::future::Future;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use super::ControllerError;
use super::plan::ControlState;

/// The ConfigMap's key holding the state as JSON.
const STATE_KEY: &str = "state";

/// A store of the controller's state written only over the version it was read at: a
/// ConfigMap ([`SharedControl`], Kubernetes) or an etcd key (Slurm's controller). The
/// read-change-write loop of the operator's commands is written once, over both.
pub trait StateStore: Sync {
    /// A read: the state and what a conditional write must match.
    type Read: Send + Sync;

    /// Where the state lives, for errors.
    fn location(&self) -> String;

    /// Reads the state; an absent store is the default state, one that does not parse
    /// an error (acting on a forgotten breaker or pause would be acting by mistake).
    fn load(&self) -> impl Future<Output = Result<Self::Read, ControllerError>> + Send;

    /// The state a read carries.
    fn state_of(read: &Self::Read) -> &ControlState;

    /// Writes `state` over the version read; `Ok(false)` when someone wrote in between
    /// (the caller reads again and plans again).
    fn store(
        &self,
        read: &Self::Read,
        state: &ControlState,
    ) -> impl Future<Output = Result<bool, ControllerError>> + Send;

    /// Reads, changes and writes the state, again after a conflicting write (at most a
    /// few times): the operator's commands (pause, resume, reset, dry run).
    fn update(
        &self,
        change: impl Fn(&mut ControlState) + Send,
    ) -> impl Future<Output = Result<ControlState, ControllerError>> + Send {
        async move {
            for _ in 0..10 {
                let read = self.load().await?;
                let mut state = Self::state_of(&read).clone();
                change(&mut state);
                if self.store(&read, &state).await? {
                    return Ok(state);
                }
            }
            Err(ControllerError::Conflict(self.location()))
        }
    }
}

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
}

impl StateStore for SharedControl {
    type Read = Versioned;

    fn location(&self) -> String {
        self.name.clone()
    }

    fn state_of(read: &Versioned) -> &ControlState {
        &read.state
    }

    async fn load(&self) -> Result<Versioned, ControllerError> {
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

    async fn store(&self, read: &Versioned, state: &ControlState) -> Result<bool, ControllerError> {
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
}
