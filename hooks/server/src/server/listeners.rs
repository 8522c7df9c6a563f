//! Binding the listeners: the Unix socket (and its removal) and the TCP listener's rustls TLS.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::UnixListener;
use tokio_rustls::TlsAcceptor;

use crate::config::Config;
use crate::error::ServeError;

pub(super) async fn bind_unix(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
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

pub(super) fn tls_acceptor(config: &Config) -> Result<TlsAcceptor, ServeError> {
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

/// Removes the socket at `path` if a socket is still there.
pub(super) fn remove_socket(path: &Path) {
    use std::os::unix::fs::FileTypeExt;
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(path);
    }
}
