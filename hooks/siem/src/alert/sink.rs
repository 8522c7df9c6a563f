//! Where alerts go over HTTP: Alertmanager's API v2 and a generic JSON webhook, both
//! through ureq (blocking, with timeouts), on the alerter's own thread.

use std::path::PathBuf;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::Alert;

/// Something that takes alerts. Implementations block; the alerter calls them from
/// its own thread.
pub trait AlertSink: Send {
    /// Posts one alert (firing, or resolved when its `endsAt` is not in the future).
    fn post(&self, alert: &Alert) -> Result<(), SinkError>;
}

/// HTTP client settings. Every field states its default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpSettings {
    /// Limit on a whole request, connecting included; default 10 s.
    pub timeout: Duration,
    /// PEM file of the CAs trusted for `https` URLs; default none (Mozilla's roots).
    pub ca_file: Option<PathBuf>,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            ca_file: None,
        }
    }
}

/// Largest response body read.
const MAX_BODY: u64 = 64 * 1024;

/// A post that did not succeed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The request did not complete: refused, unreachable, timed out.
    #[error("cannot reach {url}")]
    Unreachable {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: ureq::Error,
    },
    /// The receiver refused the alert as malformed (400 or 422). Retrying cannot help.
    #[error("{url} rejected the alert with {status}: {message}")]
    Rejected {
        /// The URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// The receiver's message (`message` of Alertmanager's JSON error, or the body).
        message: String,
    },
    /// Any other answer than success: 5xx, 429, 404… Retried.
    #[error("{url} answered {status}: {body}")]
    Status {
        /// The URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The CA file could not be used.
    #[error("cannot read CA certificates from {path}")]
    CaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The alert could not be encoded.
    #[error("cannot encode the alert")]
    Encode(#[source] serde_json::Error),
}

impl SinkError {
    /// Whether the receiver refused the alert itself (so a retry would fail again).
    pub fn is_rejection(&self) -> bool {
        matches!(self, SinkError::Rejected { .. } | SinkError::Encode(_))
    }
}

/// Alertmanager's error body: `{"code":602,"message":"0.labels in body is required"}`.
#[derive(Deserialize)]
struct ApiError {
    message: String,
}

fn agent(settings: &HttpSettings) -> Result<ureq::Agent, SinkError> {
    let mut builder = ureq::Agent::config_builder()
        .timeout_global(Some(settings.timeout))
        .http_status_as_error(false)
        .user_agent(concat!("probity-siem/", env!("CARGO_PKG_VERSION")));
    if let Some(path) = &settings.ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|source| SinkError::CaFile {
                path: path.clone(),
                source,
            })?;
        let roots: Vec<ureq::tls::Certificate<'static>> = certs
            .iter()
            .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
            .collect();
        builder = builder.tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::new_with_certs(&roots))
                .build(),
        );
    }
    Ok(builder.build().into())
}

/// POSTs `body` as JSON and sorts the answer into success or a [`SinkError`].
fn post_json(agent: &ureq::Agent, url: &str, body: &[u8]) -> Result<(), SinkError> {
    let mut resp = agent
        .post(url)
        .header("Content-Type", "application/json")
        .send(body)
        .map_err(|source| SinkError::Unreachable {
            url: url.to_owned(),
            source,
        })?;
    let status = resp.status().as_u16();
    if (200..300).contains(&status) {
        return Ok(());
    }
    // An unreadable body still leaves the status to act on.
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(MAX_BODY)
        .read_to_vec()
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes)
        .chars()
        .take(512)
        .collect::<String>();
    if status == 400 || status == 422 {
        let message = serde_json::from_slice::<ApiError>(&bytes)
            .map(|e| e.message)
            .unwrap_or(text);
        return Err(SinkError::Rejected {
            url: url.to_owned(),
            status,
            message,
        });
    }
    Err(SinkError::Status {
        url: url.to_owned(),
        status,
        body: text,
    })
}

/// Alertmanager's API v2: `POST <base>/api/v2/alerts` with a JSON array of alerts.
#[derive(Debug)]
pub struct AlertmanagerSink {
    agent: ureq::Agent,
    url: String,
}

impl AlertmanagerSink {
    /// A sink for the Alertmanager at `base_url` (e.g. `http://127.0.0.1:9093`).
    pub fn new(base_url: &str, settings: &HttpSettings) -> Result<Self, SinkError> {
        Ok(Self {
            agent: agent(settings)?,
            url: format!("{}/api/v2/alerts", base_url.trim_end_matches('/')),
        })
    }

    /// The URL posted to.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl AlertSink for AlertmanagerSink {
    fn post(&self, alert: &Alert) -> Result<(), SinkError> {
        let body = serde_json::to_vec(&[alert]).map_err(SinkError::Encode)?;
        post_json(&self.agent, &self.url, &body)
    }
}

/// A generic webhook: `POST <url>` with one JSON object per alert, Alertmanager's
/// alert fields plus `status` (`firing` or `resolved`).
#[derive(Debug)]
pub struct WebhookSink {
    agent: ureq::Agent,
    url: String,
}

/// The webhook's body.
#[derive(Serialize)]
struct WebhookBody<'a> {
    status: &'static str,
    #[serde(flatten)]
    alert: &'a Alert,
}

impl WebhookSink {
    /// A sink posting to `url`.
    pub fn new(url: &str, settings: &HttpSettings) -> Result<Self, SinkError> {
        Ok(Self {
            agent: agent(settings)?,
            url: url.to_owned(),
        })
    }
}

impl AlertSink for WebhookSink {
    fn post(&self, alert: &Alert) -> Result<(), SinkError> {
        let now = crate::time::rfc3339_micros(std::time::SystemTime::now());
        // Both are RFC 3339 UTC with microseconds, so they compare as strings.
        let status = if alert.ends_at <= now {
            "resolved"
        } else {
            "firing"
        };
        let body = serde_json::to_vec(&WebhookBody { status, alert }).map_err(SinkError::Encode)?;
        post_json(&self.agent, &self.url, &body)
    }
}
