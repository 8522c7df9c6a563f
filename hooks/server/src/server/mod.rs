//! Binding, serving and shutting down: a Unix socket (peers identified by uid) and/or a
//! TCP listener with rustls TLS (peers identified by their client certificate's CN), or
//! plain HTTP on loopback only. Each connection runs hyper's HTTP/1 with keep-alive; at
//! shutdown the listeners close, readiness drops, and in-flight requests finish.

mod connections;
mod engine;
mod listeners;
mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::server::graceful::GracefulShutdown;
use probity::{Engine, ReloadWatcher};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;

use crate::config::{Config, LogConfig, LogFormat};
use crate::error::ServeError;
use crate::limits::Connections;
use crate::{AppState, app};
use connections::{Listen, accept_tcp, accept_unix};
use engine::load_engine;
use listeners::{bind_unix, remove_socket, tls_acceptor};
use workers::{
    report_digests, spawn_retention, spawn_storage_watch, start_alerts, start_forwarders,
};

/// A bound server, ready to [`Server::run`].
pub struct Server {
    state: AppState,
    unix: Option<(UnixListener, PathBuf)>,
    tcp: Option<(TcpListener, Option<TlsAcceptor>)>,
    _watcher: Option<ReloadWatcher>,
}

/// Sets up logging as configured (text or JSON lines on standard error). `RUST_LOG`
/// overrides the level. Does nothing if logging is already set up.
pub fn init_logging(log: &LogConfig) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&log.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = match log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Resolves at SIGTERM or SIGINT. The handlers are installed when this is called (inside
/// a tokio runtime), so a signal that comes before the future is first polled still counts.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    use tokio::signal::unix::{Signal, SignalKind, signal};
    let term = signal(SignalKind::terminate()).ok();
    let int = signal(SignalKind::interrupt()).ok();
    async fn recv(s: Option<Signal>) {
        match s {
            Some(mut s) => {
                s.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    }
    async move {
        tokio::select! {
            () = recv(term) => {}
            () = recv(int) => {}
        }
    }
}

/// Binds as configured and serves until SIGTERM or SIGINT.
pub async fn serve(config: Config) -> Result<(), ServeError> {
    // Before binding: a signal as soon as the socket exists must stop the server cleanly.
    let stop = shutdown_signal();
    Server::bind(config).await?.run(stop).await
}

/// SIGHUP reloads the policy directory (`systemctl reload`, `kill -HUP`), as the watcher
/// does on a change: a set that fails to load is refused and the previous one keeps
/// serving. The service manager hears `RELOADING=1`, then `READY=1` with the outcome.
/// None when the handler cannot be installed (it is logged).
fn spawn_reload_on_hangup(
    state: &AppState,
    notifier: probity_base::systemd::Notifier,
) -> Option<tokio::task::JoinHandle<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGHUP: reload by editing the policy files");
            return None;
        }
    };
    let engine = state.engine().clone();
    Some(tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            let _ = notifier.reloading();
            let outcome = if engine.policy_dir().is_none() {
                "embedded policies, nothing to reload".to_owned()
            } else {
                let engine = engine.clone();
                match tokio::task::spawn_blocking(move || engine.reload()).await {
                    Ok(Ok(())) => "policies reloaded".to_owned(),
                    // The reload event is logged and counted as well.
                    Ok(Err(e)) => format!(
                        "reload refused; the previous policies keep serving: {}",
                        e.detail()
                    ),
                    Err(e) => format!("reload did not finish: {e}"),
                }
            };
            tracing::info!(outcome = %outcome, "SIGHUP reload");
            let status = engine.status();
            let _ = notifier.ready(&format!(
                "{outcome}; serving {} policies, digest {}",
                status.policies, status.digest
            ));
        }
    }))
}

/// An error and its causes, on one line (for start-up failures, which print once).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let t = c.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        cause = c.source();
    }
    text
}

impl Server {
    /// Validates the configuration, loads the policies (watching the directory for
    /// changes), and binds the listeners.
    pub async fn bind(config: Config) -> Result<Self, ServeError> {
        config.validate()?;
        let (engine, local_logs) = load_engine(&config)?;
        let watcher = match engine.policy_dir() {
            Some(_) => Some(engine.watch()?),
            None => None,
        };
        let server = Self::bind_with_engine(engine, config, watcher).await?;
        if let Some(store) = local_logs {
            server.state.set_local_logs(store);
        }
        Ok(server)
    }

    async fn bind_with_engine(
        engine: Engine,
        config: Config,
        watcher: Option<ReloadWatcher>,
    ) -> Result<Self, ServeError> {
        let unix = if config.server.socket.as_os_str().is_empty() {
            None
        } else {
            let path = config.server.socket.clone();
            let listener = bind_unix(&path, config.socket_mode()?).await?;
            Some((listener, path))
        };
        let tcp = match config.server.listen {
            None => None,
            Some(addr) => {
                let acceptor = if config.server.insecure {
                    None
                } else {
                    Some(tls_acceptor(&config)?)
                };
                let listener =
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| ServeError::Listen {
                            what: addr.to_string(),
                            source,
                        })?;
                Some((listener, acceptor))
            }
        };
        let state = AppState::new(engine, config);
        // An untrusted key is logged at error level here, and refused on every read.
        let _ = state.check_verify_key();
        match state.open_keyring() {
            Ok(true) => tracing::info!("keyring ready"),
            Ok(false) => {}
            Err(detail) => return Err(ServeError::Keys(detail)),
        }
        Ok(Self {
            state,
            unix,
            tcp,
            _watcher: watcher,
        })
    }

    /// The bound TCP address (useful with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// The shared state (engine, metrics).
    pub fn state(&self) -> AppState {
        self.state.clone()
    }

    /// Serves until `shutdown` resolves, then stops accepting, drops readiness and
    /// waits (up to the configured grace) for in-flight requests.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
        let router = app(self.state.clone());
        let graceful = Arc::new(GracefulShutdown::new());
        let server_config = &self.state.config().server;
        let limits = Listen {
            connections: Connections::new(
                server_config.max_connections,
                server_config.max_connections_per_caller,
            ),
            header_timeout: Duration::from_millis(server_config.header_read_timeout_ms.max(1)),
        };
        self.state.set_connections(Arc::clone(&limits.connections));
        // Before retention: what the SIEM has not received is kept.
        start_forwarders(&self.state)?;
        start_alerts(&self.state)?;
        let retention = spawn_retention(&self.state);
        let storage = spawn_storage_watch(&self.state);
        let rotation = crate::keys::spawn_rotation(&self.state);
        let digests = tokio::spawn(report_digests(self.state.clone()));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        let socket_path = self.unix.as_ref().map(|(_, p)| p.clone());
        if let Some((listener, path)) = self.unix {
            tracing::info!(socket = %path.display(), "listening on Unix socket");
            tasks.spawn(accept_unix(
                listener,
                router.clone(),
                Arc::clone(&graceful),
                stop_rx.clone(),
                limits.clone(),
            ));
        }
        if let Some((listener, acceptor)) = self.tcp {
            let addr = listener.local_addr().ok();
            tracing::info!(addr = ?addr, tls = acceptor.is_some(), "listening on TCP");
            tasks.spawn(accept_tcp(
                listener,
                acceptor,
                router,
                Arc::clone(&graceful),
                stop_rx,
                limits.clone(),
            ));
        }
        let status = self.state.engine().status();
        tracing::info!(digest = %status.digest, policies = status.policies, "serving");
        // Under systemd (`Type=notify`): the sockets accept from here on.
        let notifier = probity_base::systemd::Notifier::from_env();
        let serving = format!(
            "serving {} policies, digest {}",
            status.policies, status.digest
        );
        // The handler before READY: systemd may send SIGHUP as soon as it hears it, and
        // SIGHUP's default action would end the server (a clean exit, never restarted).
        let reloads = spawn_reload_on_hangup(&self.state, notifier.clone());
        if let Err(e) = notifier.ready(&serving) {
            tracing::warn!(error = %e, "cannot tell the service manager we are ready");
        }
        shutdown.await;
        tracing::info!("shutting down: finishing in-flight requests");
        let _ = notifier.stopping();
        if let Some(task) = reloads {
            task.abort();
        }
        self.state.set_ready(false);
        let _ = stop_tx.send(true);
        while tasks.join_next().await.is_some() {}
        if let Some(p) = socket_path {
            remove_socket(&p);
        }
        for stop in [retention, rotation, storage].into_iter().flatten() {
            let _ = stop.send(());
        }
        digests.abort();
        if let Some(a) = self.state.set_alerts(None) {
            // Joins the follower thread.
            let _ = tokio::task::spawn_blocking(move || drop(a)).await;
        }
        if let Some(f) = self.state.set_forwarders(None) {
            // Each confirms what it sent (within its acknowledgement timeout).
            if let Ok(stopped) = tokio::task::spawn_blocking(move || f.stop()).await {
                for (log, s) in stopped {
                    tracing::info!(
                        log = log.as_str(),
                        forwarded = s.forwarded,
                        cursor = s.cursor,
                        "SIEM forwarder stopped"
                    );
                }
            }
        }
        let grace = Duration::from_millis(self.state.config().server.shutdown_grace_ms);
        // The accept loops have ended, so this is the last reference.
        match Arc::try_unwrap(graceful) {
            Ok(g) => {
                if tokio::time::timeout(grace, g.shutdown()).await.is_err() {
                    tracing::warn!("shutdown grace period over; closing remaining connections");
                }
            }
            Err(_) => tracing::warn!("connections still referenced at shutdown; not waiting"),
        }
        tracing::info!("stopped");
        Ok(())
    }
}
