//! A running server's background work: digests, alerts, SIEM, storage health, retention.

use std::sync::Arc;
use std::time::Duration;

use super::error_chain;
use crate::AppState;
use crate::error::ServeError;

/// How often the served digest is compared with the one last reported.
const DIGEST_CHECK: Duration = Duration::from_secs(1);

/// Reports the policy digest this process serves (`[state] process`) to the state store:
/// at start, and within [`DIGEST_CHECK`] of every reload; a failed report is tried
/// again at the next check.
pub(super) async fn report_digests(state: AppState) {
    let Some(store) = state.engine().state().cloned() else {
        return;
    };
    let process = state.config().state.process_name();
    let mut reported: Option<String> = None;
    loop {
        let digest = state.engine().status().digest;
        if reported.as_deref() != Some(digest.as_str()) {
            let served = probity::state::ServedDigest {
                process: process.clone(),
                digest: digest.clone(),
                at: u64::try_from(state.engine().clock().now_unix()).unwrap_or(0),
            };
            let s = Arc::clone(&store);
            match tokio::task::spawn_blocking(move || s.report_digest(&served)).await {
                Ok(Ok(())) => {
                    tracing::info!(%process, %digest, "reported the served policy digest");
                    reported = Some(digest);
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %error_chain(&e), "reporting the served policy digest failed; retrying");
                }
                Err(_) => return,
            }
        }
        tokio::time::sleep(DIGEST_CHECK).await;
    }
}

/// Starts the alert sinks `[alerts]` names, fed from the decision log.
pub(super) fn start_alerts(state: &AppState) -> Result<(), ServeError> {
    let config = state.config();
    let (true, Some(dir)) = (config.alerts.enabled(), &config.integrity.state_dir) else {
        return Ok(());
    };
    let Some(store) = state.local_logs() else {
        return Err(ServeError::Alerts(
            "no local decision log to take alerts from".into(),
        ));
    };
    // The engine's conventions, asked per batch: a reload that renames the alert kind
    // is followed.
    let engine = state.engine().clone();
    let alerts = crate::alerts::DecisionAlerts::start(
        &config.alerts,
        Arc::clone(store),
        dir,
        Box::new(move || engine.conventions()),
    )
    .map_err(ServeError::Alerts)?;
    tracing::info!(
        alertmanager = ?config.alerts.alertmanager_url,
        webhook = ?config.alerts.webhook_url,
        "alert obligations of recorded decisions go to the alert sinks"
    );
    state.set_alerts(alerts);
    Ok(())
}

/// Starts the SIEM forwarders `[siem]` asks for, one per log.
pub(super) fn start_forwarders(state: &AppState) -> Result<(), ServeError> {
    let config = state.config();
    let (Some(address), Some(dir)) = (&config.siem.address, &config.integrity.state_dir) else {
        return Ok(());
    };
    let Some(store) = state.local_logs() else {
        return Err(ServeError::Siem(
            "no local decision and event logs to forward".into(),
        ));
    };
    let forwarders = crate::forward::Forwarders::start(&config.siem, address, store, dir)
        .map_err(ServeError::Siem)?;
    tracing::info!(siem = %address, transport = ?config.siem.transport, "forwarding the audit logs");
    state.set_forwarders(Some(forwarders));
    Ok(())
}

/// Asks the state store for its health every [`probity::state::StateStore::RECOVERY_INTERVAL`],
/// on a thread of its own: a failing store recovers (reopen, probe write) when the disk
/// does, with or without traffic, and each change is logged and shown in the metrics.
/// Stops when the returned sender drops.
pub(super) fn spawn_storage_watch(state: &AppState) -> Option<std::sync::mpsc::Sender<()>> {
    state.engine().state()?;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let s = state.clone();
    let spawned = std::thread::Builder::new()
        .name("probity-storage".into())
        .spawn(move || {
            loop {
                let _ = s.storage_health();
                match rx.recv_timeout(probity::state::StateStore::RECOVERY_INTERVAL) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the state store's health watch");
            None
        }
    }
}

/// Prunes the decision log on an interval, on a thread of its own, and keeps the
/// usage figures for readiness and metrics. Stops when the returned sender drops.
pub(super) fn spawn_retention(state: &AppState) -> Option<std::sync::mpsc::Sender<()>> {
    let store = state.engine().log().cloned()?;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let s = state.clone();
    let spawned = std::thread::Builder::new()
        .name("probity-retention".into())
        .spawn(move || {
            let c = s.config().decision_log.clone();
            let every = Duration::from_secs(c.prune_interval_seconds.max(1));
            loop {
                let retention = probity::state::Retention {
                    max_bytes: c.max_bytes,
                    max_age_seconds: c.max_age_days.saturating_mul(86_400),
                    // What the SIEM has not received yet is kept; without one,
                    // nothing holds pruning back.
                    keep_from: s.siem_keep_from().unwrap_or(u64::MAX),
                };
                match store.prune_decisions(&retention, s.engine().clock().now_unix_ms()) {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(records = n, "pruned the decision log"),
                    Err(e) => tracing::error!(error = %e, "pruning the decision log failed"),
                }
                if let Ok(usage) = store.decision_log_usage() {
                    // Sampled allows stay within the disk budget: none are kept while
                    // the log is near it, so that they never push out denies.
                    let near = usage.bytes.saturating_mul(100)
                        >= c.max_bytes.saturating_mul(u64::from(c.warn_pct));
                    s.engine()
                        .sample_allows(if near { 0 } else { c.sample_allows_every });
                    s.set_log_usage(usage);
                }
                match rx.recv_timeout(every) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::error!(error = %e, "cannot start decision log retention");
            None
        }
    }
}
