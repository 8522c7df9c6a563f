//! Accepting connections: per-caller connection limits, the TLS handshake, hyper's HTTP/1.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::limits::Connections;
use crate::{Caller, certificate_identity};

/// Longest a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What every accepted connection is held to.
#[derive(Clone)]
pub(super) struct Listen {
    pub(super) connections: Arc<Connections>,
    pub(super) header_timeout: Duration,
}

pub(super) async fn accept_unix(
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
                let cred = stream.peer_cred().ok();
                let caller = cred.map(|c| Caller::unix_uid(c.uid()));
                // A local reader's claim to be a pod is checked against this process.
                let peer = cred.map(|c| crate::PeerProcess {
                    pid: c.pid().unwrap_or(0),
                });
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
                    peer,
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

pub(super) async fn accept_tcp(
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
                    None,
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
                        None,
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
    peer: Option<crate::PeerProcess>,
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
        if let Some(p) = peer {
            req.extensions_mut().insert(p);
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
