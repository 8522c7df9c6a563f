use std::path::Path;
use std::sync::Arc;

use probity::Engine;
use probity::state::StateStore;
use serde_json::Value;

#[cfg(doc)]
use super::Agent;
use super::AgentError;
use crate::config::Config;

/// Largest entities file loaded at start.
pub const MAX_ENTITIES_BYTES: u64 = 64 * 1024 * 1024;

/// Builds the engine `config` names: its policies (or the embedded ones), the state
/// store of its state directory when `attach_state`, and its entities and users files.
pub fn build_engine(
    config: &Config,
    clock: Option<Arc<dyn probity::Clock>>,
    attach_state: bool,
) -> Result<Engine, AgentError> {
    build_engine_with_state(config, clock, attach_state).map(|(engine, _)| engine)
}

/// The agent's decision cache budget: its questions are few and repeat each cycle.
const AGENT_DECISION_CACHE_BYTES: usize = 2 << 20;

/// [`build_engine`], and the state store it attached (which the SIEM forwarders read:
/// [`Agent::forward_to_siem`]).
pub fn build_engine_with_state(
    config: &Config,
    clock: Option<Arc<dyn probity::Clock>>,
    attach_state: bool,
) -> Result<(Engine, Option<Arc<StateStore>>), AgentError> {
    let mut builder = match &config.engine.policies {
        Some(dir) => Engine::builder(dir),
        None => Engine::defaults(),
    };
    if let Some(c) = clock {
        builder = builder.clock(c);
    }
    let engine = builder
        .build()
        .map_err(|e| AgentError::Policies(Box::new(e)))?;
    // A node's few questions a cycle: a small cache keeps its resident memory near idle
    // (its `comply` carries readings that change every cycle and are never reused).
    engine
        .decision_cache()
        .set_budget(AGENT_DECISION_CACHE_BYTES);
    let mut attached = None;
    if attach_state && let Some(dir) = &config.state_dir {
        let store = Arc::new(
            StateStore::open_with_clock(dir, engine.clock().clone()).map_err(|source| {
                AgentError::State {
                    path: dir.clone(),
                    source,
                }
            })?,
        );
        attached = Some(Arc::clone(&store));
        engine
            .attach_state(store)
            .map_err(|source| AgentError::Entities {
                what: format!("attaching the state store in {}", dir.display()),
                source,
            })?;
    }
    for path in [&config.engine.entities, &config.engine.users]
        .into_iter()
        .flatten()
    {
        load_entities(&engine, path)?;
    }
    Ok((engine, attached))
}

/// Upserts a Cedar entity JSON file.
pub fn load_entities(engine: &Engine, path: &Path) -> Result<usize, AgentError> {
    let read = |source| AgentError::Read {
        path: path.to_owned(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read)?.len();
    if len > MAX_ENTITIES_BYTES {
        return Err(read(std::io::Error::other(format!(
            "{len} bytes, over the limit of {MAX_ENTITIES_BYTES}"
        ))));
    }
    let bytes = std::fs::read(path).map_err(read)?;
    let json: Value = serde_json::from_slice(&bytes).map_err(|source| AgentError::Json {
        path: path.to_owned(),
        line: source.line(),
        column: source.column(),
        source,
    })?;
    engine
        .upsert_entities(&json)
        .map_err(|source| AgentError::Entities {
            what: format!("loading {}", path.display()),
            source,
        })
}
