//! The one API error type: every failure renders as `{"error": "...", "code": N}` with a
//! message meant for the caller, never an internal detail.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// A request the API refuses or could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not what the endpoint takes.
    #[error("{0}")]
    BadRequest(String),
    /// The caller may not do this; the message names the policies that said no.
    #[error("{0}")]
    Forbidden(String),
    /// Nothing at this path, or no such entity.
    #[error("{0}")]
    NotFound(String),
    /// The method is not served at this path.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The body is over the size limit.
    #[error("request body is over the limit of {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The body parses but the engine rejects it (entities that do not fit the schema).
    #[error("{0}")]
    Unprocessable(String),
    /// The request took longer than the configured timeout.
    #[error("request timed out")]
    Timeout,
    /// The server is shutting down or not ready.
    #[error("{0}")]
    Unavailable(String),
    /// The caller is over one of its limits (recorded decisions, I/O jobs in flight).
    #[error("{0}")]
    TooManyRequests(String),
    /// The caller may not have this path (outside the data roots, not a regular file,
    /// absent): one message for all, so errors tell nothing about files the caller
    /// may not read.
    #[error("not permitted")]
    NotPermitted,
    /// Something failed inside the server; details are logged, not returned.
    #[error("internal error")]
    Internal,
}

impl ApiError {
    /// The HTTP status this error is sent with.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Timeout | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotPermitted => StatusCode::FORBIDDEN,
            ApiError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = serde_json::json!({"error": self.to_string(), "code": status.as_u16()});
        (status, Json(body)).into_response()
    }
}

/// `probity serve` could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The policy set does not load.
    #[error("cannot load the policies: {}", .0.detail())]
    Policies(#[from] probity::LoadError),
    /// The entities file does not load.
    #[error("cannot load entities from {path}: {detail}")]
    Entities {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        detail: String,
    },
    /// The state directory cannot be opened or attached.
    #[error("cannot use the state directory {path}: {detail}")]
    State {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        detail: String,
    },
    /// Sealed mode's pinned key cannot be used.
    #[error("sealed mode: cannot use the pinned public key {path}: {detail}")]
    SealKey {
        /// The key file.
        path: std::path::PathBuf,
        /// Why.
        detail: String,
    },
    /// The keyring cannot be opened (HSM, PIN, KEK or its metadata).
    #[error("cannot open the keyring: {0}")]
    Keys(String),
    /// The alert sinks (`[alerts]`) cannot start.
    #[error("cannot start the alert sinks: {0}")]
    Alerts(String),
    /// The SIEM forwarders (`[siem]`) cannot start.
    #[error("cannot forward the audit logs to the SIEM: {0}")]
    Siem(String),
    /// The policy directory cannot be watched for hot reload.
    #[error("cannot watch the policies for changes")]
    Watch(#[from] probity::WatchError),
    /// TLS material is missing or invalid.
    #[error("TLS: {0}")]
    Tls(String),
    /// A listener cannot be set up.
    #[error("cannot listen on {what}")]
    Listen {
        /// The socket path or address.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}
