//! Binding, serving and shutting down: a Unix socket (peers identified by uid) and/or a
//! TCP listener with rustls TLS (peers identified by their client certificate's CN), or
//! plain HTTP on loopback only. Each connection runs hyper's HTTP/1 with keep-alive; at
//! shutdown the listeners close, readiness drops, and in-flight requests finish.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use probity::{Engine, ReloadWatcher};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::config::{Config, LogConfig, LogFormat, StateBackendKind, StateRole};
use crate::error::ServeError;
use crate::limits::Connections;
use crate::{AppState, Caller, app, certificate_identity};

/// Longest a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
fn load_engine(
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
                let etcd = Arc::new(open_etcd(config, dir).map_err(bad)?);
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

/// The etcd backend `[state]` describes, keeping its local logs in `dir`.
fn open_etcd(config: &Config, dir: &Path) -> Result<probity_etcd::EtcdState, String> {
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
        .with_resync(
            ResyncOptions::default().with_resync_after_disconnect(ms(s.resync_after_disconnect_ms)),
        );
    EtcdState::open(etcd, dir, options).map_err(|e| error_chain(&e))
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
        shutdown.await;
        tracing::info!("shutting down: finishing in-flight requests");
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

async fn bind_unix(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
    let fail = |source| ServeError::Listen {
        what: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        // Only a socket is ever removed: a regular file (or anything else) at the
        // socket path is the operator's, and a typo must not delete it.
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "something that is not a socket is there; it is left alone",
            )));
        }
        // A live server answers; a stale socket from a crash is replaced.
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another server is listening there",
            )));
        }
        std::fs::remove_file(path).map_err(fail)?;
    }
    let listener = UnixListener::bind(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(fail)?;
    Ok(listener)
}

fn read_pem(path: &Path) -> Result<Vec<u8>, ServeError> {
    std::fs::read(path).map_err(|e| ServeError::Tls(format!("cannot read {}: {e}", path.display())))
}

fn tls_acceptor(config: &Config) -> Result<TlsAcceptor, ServeError> {
    let s = &config.server;
    let (Some(cert), Some(key)) = (&s.tls_cert, &s.tls_key) else {
        return Err(ServeError::Tls("tls_cert and tls_key are required".into()));
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read_pem(cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| ServeError::Tls(format!("{}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(ServeError::Tls(format!(
            "{}: no certificate",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_slice(&read_pem(key)?)
        .map_err(|e| ServeError::Tls(format!("{}: {e}", key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Tls(e.to_string()))?;
    let builder = match &s.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read_pem(ca)?) {
                let c = c.map_err(|e| ServeError::Tls(format!("{}: {e}", ca.display())))?;
                roots
                    .add(c)
                    .map_err(|e| ServeError::Tls(format!("{}: {e}", ca.display())))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            );
            let verifier = match s.client_auth {
                crate::ClientAuth::Required => verifier,
                crate::ClientAuth::Optional => verifier.allow_unauthenticated(),
            }
            .build()
            .map_err(|e| ServeError::Tls(format!("{}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut tls = builder
        .with_single_cert(certs, key)
        .map_err(|e| ServeError::Tls(e.to_string()))?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(tls)))
}

/// What every accepted connection is held to.
#[derive(Clone)]
struct Listen {
    connections: Arc<Connections>,
    header_timeout: Duration,
}

/// Removes the socket at `path` if a socket is still there.
fn remove_socket(path: &Path) {
    use std::os::unix::fs::FileTypeExt;
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(path);
    }
}

/// How often the served digest is compared with the one last reported.
const DIGEST_CHECK: Duration = Duration::from_secs(1);

/// Reports the policy digest this process serves (`[state] process`) to the state store:
/// at start, and within [`DIGEST_CHECK`] of every reload; a failed report is tried
/// again at the next check.
async fn report_digests(state: AppState) {
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
fn start_alerts(state: &AppState) -> Result<(), ServeError> {
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
fn start_forwarders(state: &AppState) -> Result<(), ServeError> {
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
fn spawn_storage_watch(state: &AppState) -> Option<std::sync::mpsc::Sender<()>> {
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
fn spawn_retention(state: &AppState) -> Option<std::sync::mpsc::Sender<()>> {
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

async fn accept_unix(
    listener: UnixListener,
    router: Router,
    graceful: Arc<GracefulShutdown>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    limits: Listen,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        match accepted {
            Ok((stream, _)) => {
                let caller = stream.peer_cred().ok().map(|c| Caller::unix_uid(c.uid()));
                let key = caller.as_ref().map_or("unix:unknown", |c| c.0.as_str());
                let Ok(permit) = limits.connections.admit(key) else {
                    tracing::debug!(
                        caller = key,
                        "connection refused: over the connection limits"
                    );
                    continue;
                };
                serve_connection(
                    stream,
                    caller,
                    router.clone(),
                    graceful.watcher(),
                    permit,
                    limits.header_timeout,
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn accept_tcp(
    listener: TcpListener,
    acceptor: Option<TlsAcceptor>,
    router: Router,
    graceful: Arc<GracefulShutdown>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    limits: Listen,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // Until a certificate names the caller, its address stands for it.
        let by_address = format!("addr:{}", peer.ip());
        match &acceptor {
            None => {
                let Ok(permit) = limits.connections.admit(&by_address) else {
                    tracing::debug!(%peer, "connection refused: over the connection limits");
                    continue;
                };
                serve_connection(
                    stream,
                    Some(Caller::anonymous_at(peer.ip())),
                    router.clone(),
                    graceful.watcher(),
                    permit,
                    limits.header_timeout,
                );
            }
            Some(acceptor) => {
                let Ok(handshake_permit) = limits.connections.admit(&by_address) else {
                    tracing::debug!(%peer, "connection refused: over the connection limits");
                    continue;
                };
                let acceptor = acceptor.clone();
                let router = router.clone();
                let limits = limits.clone();
                // Watched from accept on, so a shutdown waits for the handshake too.
                let watcher = graceful.watcher();
                tokio::spawn(async move {
                    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    // Without a certificate the caller is anonymous, counted by network.
                    let caller = match tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
                        None => None,
                        Some(cert) => match certificate_identity(cert) {
                            Ok(c) => Some(c),
                            Err(e) => {
                                tracing::warn!(%peer, error = %e, "client certificate refused");
                                return;
                            }
                        },
                    };
                    // A named caller is counted under its name from now on.
                    let permit = match &caller {
                        None => handshake_permit,
                        Some(c) => match limits.connections.admit(&c.0) {
                            Ok(p) => {
                                drop(handshake_permit);
                                p
                            }
                            Err(_) => {
                                tracing::debug!(caller = %c.0, "connection refused: over the connection limits");
                                return;
                            }
                        },
                    };
                    let caller = caller.unwrap_or_else(|| Caller::anonymous_at(peer.ip()));
                    serve_connection(
                        tls,
                        Some(caller),
                        router,
                        watcher,
                        permit,
                        limits.header_timeout,
                    );
                });
            }
        }
    }
}

fn serve_connection<I>(
    io: I,
    caller: Option<Caller>,
    router: Router,
    watcher: Watcher,
    permit: crate::limits::ConnectionPermit,
    header_timeout: Duration,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        if let Some(c) = &caller {
            req.extensions_mut().insert(c.clone());
        }
        router.clone().oneshot(req)
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service);
    let conn = watcher.watch(conn);
    tokio::spawn(async move {
        // The connection's place is held until it closes.
        let _permit = permit;
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "connection ended with an error");
        }
    });
}
