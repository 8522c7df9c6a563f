//! Loading the engine as configured: sealed policies, state store, checkpoints, entities.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use probity::Engine;

use super::error_chain;
use crate::config::{Config, StateBackendKind, StateRole};
use crate::error::ServeError;

/// The verifier of sealed mode: the pinned key, judged as every trust file is.
fn seal_verifier(config: &Config) -> Result<probity::integrity::Verifier, ServeError> {
    let path = config
        .integrity
        .pinned_key_path()
        .ok_or_else(|| ServeError::SealKey {
            path: "trusted.pub".into(),
            detail: "no integrity.public_key and no integrity.state_dir".into(),
        })?;
    probity::integrity::PublicKey::load_pinned(&path)
        .map(probity::integrity::Verifier::new)
        .map_err(|e| ServeError::SealKey {
            detail: error_chain(&e),
            path,
        })
}

/// Every reload attempt, by the watcher or by hand, goes to the log: loaded and
/// rejected ones at info and error, unchanged ones at debug.
fn log_reloads(engine: &Engine) {
    let events = engine.reload_events();
    let spawned = std::thread::Builder::new()
        .name("probity-reload-log".into())
        .spawn(move || {
            // Ends when the engine, and with it the sender, is dropped.
            for e in events {
                for change in &e.lowered {
                    tracing::warn!(
                        policy = %change.policy,
                        from = %change.from,
                        to = %change.to,
                        scope = change.scope.as_deref().unwrap_or(""),
                        declared_in = %change.declared_in,
                        owner = change.owner.as_deref().unwrap_or("unknown"),
                        trigger = %e.trigger,
                        "a policy's mode was lowered: it no longer denies what it did"
                    );
                }
                let seal = e
                    .seal
                    .as_ref()
                    .map(|s| format!("{} v{}", s.name, s.version))
                    .unwrap_or_default();
                match e.outcome {
                    probity::ReloadOutcome::Loaded => tracing::info!(
                        seq = e.seq,
                        before = %e.digest_before,
                        after = %e.digest_after,
                        seal,
                        millis = e.duration.as_millis() as u64,
                        rounds = e.rounds,
                        "policies reloaded"
                    ),
                    probity::ReloadOutcome::Unchanged => {
                        tracing::debug!(seq = e.seq, digest = %e.digest_after, "policies unchanged")
                    }
                    probity::ReloadOutcome::Rejected => tracing::error!(
                        seq = e.seq,
                        serving = %e.digest_after,
                        error = e.error.as_ref().map(|x| x.detail()).unwrap_or_default(),
                        "policy reload rejected; the previous set keeps serving"
                    ),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the reload log thread; reloads are not logged");
    }
}

/// The engine as configured, and the local store that holds its decision and event
/// logs (when it has a state directory), which the SIEM forwarders read.
pub(super) fn load_engine(
    config: &Config,
) -> Result<(Engine, Option<Arc<probity::state::StateStore>>), ServeError> {
    let engine = match &config.policies.dir {
        Some(dir) => {
            let mut builder = Engine::builder(dir);
            if config.policies.sealed {
                builder = builder.sealed(seal_verifier(config)?);
                if let Some(name) = &config.policies.seal_name {
                    builder = builder.sealed_name(name.clone());
                }
            }
            builder.build()?
        }
        None => Engine::from_embedded_defaults()?,
    };
    log_reloads(&engine);
    engine.keep_requests(config.decision_log.keep_requests);
    let mut local_logs: Option<Arc<probity::state::StateStore>> = None;
    if let Some(dir) = &config.integrity.state_dir {
        let bad = |detail: String| ServeError::State {
            path: dir.clone(),
            detail,
        };
        // The decision and event logs always stay on this machine, in the state
        // directory's store; with etcd, the cluster shares the rest.
        let (shared, local): (Arc<dyn probity::state::SharedState>, _) = match config.state.backend
        {
            StateBackendKind::Redb => {
                let local = Arc::new(
                    probity::state::StateStore::open_with_clock(dir, engine.clock().clone())
                        .map_err(|e| bad(e.to_string()))?,
                );
                (Arc::clone(&local) as _, local)
            }
            StateBackendKind::Etcd => {
                let etcd = Arc::new(open_etcd(config, dir, engine.clock()).map_err(bad)?);
                let local = Arc::clone(etcd.local());
                (etcd as _, local)
            }
        };
        tracing::info!(state = %shared.describe(), "state attached");
        // Before attaching: the log's writer reads the interval once, at start.
        local.set_checkpoint_policy(checkpoint_policy(config, dir).map_err(bad)?);
        local_logs = Some(Arc::clone(&local));
        engine
            .attach_state(probity::state::AttachedState::new(shared, local))
            .map_err(|e| bad(error_chain(&e)))?;
    }
    if let Some(path) = &config.policies.entities {
        let bad = |detail: String| ServeError::Entities {
            path: path.clone(),
            detail,
        };
        // Read as it is parsed: a store of 100,000 entities is never one JSON tree.
        let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        engine
            .upsert_entities_from_reader(std::io::BufReader::with_capacity(1 << 20, file))
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok((engine, local_logs))
}

/// The audit trail's checkpoint policy of `[audit]`, with its signing anchor opened.
fn checkpoint_policy(
    config: &Config,
    state_dir: &Path,
) -> Result<probity::audit::CheckpointPolicy, String> {
    use probity::integrity::{Anchor, Pin, Pkcs11Anchor, Pkcs11Config, SoftwareAnchor};
    let a = &config.audit;
    let anchor: Option<Arc<dyn Anchor>> = match a.sign {
        crate::config::CheckpointSigner::None => None,
        crate::config::CheckpointSigner::Software => Some(Arc::new(
            SoftwareAnchor::load_or_generate(&state_dir.join("anchor.key"))
                .map_err(|e| format!("[audit] sign = \"software\": {}", error_chain(&e)))?,
        )),
        crate::config::CheckpointSigner::Hsm => {
            let (Some(module), Some(token)) = (&a.hsm_module, &a.hsm_token) else {
                return Err("[audit] sign = \"hsm\" needs hsm_module and hsm_token".into());
            };
            let pin = match &a.hsm_pin_file {
                Some(path) => Pin::from_file(path),
                None => Pin::from_env("PROBITY_HSM_PIN"),
            }
            .map_err(|e| format!("[audit] {}", error_chain(&e)))?;
            let anchor = Pkcs11Anchor::open_or_generate(&Pkcs11Config::new(
                module,
                token,
                a.hsm_key.clone(),
                pin,
            ))
            .map_err(|e| format!("[audit] sign = \"hsm\": {}", error_chain(&e)))?;
            Some(Arc::new(anchor))
        }
    };
    match &anchor {
        Some(signer) => tracing::info!(
            key = %signer.public_key().to_hex(),
            "audit checkpoints are signed; verify with this public key"
        ),
        None => tracing::warn!(
            "audit checkpoints are unsigned ([audit] sign = \"none\"): they catch accidents and truncation, not a forger who can write the state directory"
        ),
    }
    Ok(probity::audit::CheckpointPolicy {
        every_records: a.checkpoint_records.max(1),
        every: Duration::from_secs(a.checkpoint_seconds.max(1)),
        anchor,
    })
}

/// The etcd backend `[state]` describes, keeping its local logs in `dir` on `clock` (the
/// engine's).
fn open_etcd(
    config: &Config,
    dir: &Path,
    clock: &Arc<dyn probity::Clock>,
) -> Result<probity_etcd::EtcdState, String> {
    use probity_etcd::{EtcdConfig, EtcdState, EtcdStateOptions, ResyncOptions, Role, TlsConfig};
    let s = &config.state;
    let ms = Duration::from_millis;
    let mut etcd = EtcdConfig::new(s.endpoints.clone())
        .with_prefix(s.prefix.clone())
        .with_connect_timeout(ms(s.connect_timeout_ms))
        .with_request_timeout(ms(s.request_timeout_ms))
        .with_retry_budget(ms(s.retry_budget_ms))
        .with_progress_interval(ms(s.progress_interval_ms));
    if let Some(ca) = &s.ca_file {
        let mut tls = TlsConfig::from_ca_file(ca).map_err(|e| error_chain(&e))?;
        if let (Some(cert), Some(key)) = (&s.cert_file, &s.key_file) {
            tls = tls
                .with_client_identity_files(cert, key)
                .map_err(|e| error_chain(&e))?;
        }
        if let Some(name) = &s.server_name {
            tls = tls.with_domain_name(name.clone());
        }
        etcd = etcd.with_tls(tls);
    }
    let role = match s.role {
        StateRole::Webhook => Role::Webhook,
        StateRole::Sidecar => Role::Sidecar {
            node: s
                .node_name()
                .ok_or_else(|| "[state] role = \"sidecar\" needs its node".to_owned())?,
        },
    };
    let options = EtcdStateOptions::new(role, s.process_name())
        .with_read_your_writes(s.read_your_writes())
        .with_process_ttl(Duration::from_secs(s.process_ttl_seconds))
        .with_clock(Arc::clone(clock))
        .with_resync(
            ResyncOptions::default().with_resync_after_disconnect(ms(s.resync_after_disconnect_ms)),
        );
    EtcdState::open(etcd, dir, options).map_err(|e| error_chain(&e))
}
