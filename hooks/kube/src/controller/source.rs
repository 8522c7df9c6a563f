//! What the controller reads from Probity: the blocklist, over Probity's API
//! (`GET /v1/nodes/blocked`), with the server's certificate checked against a CA and,
//! when given, a client certificate.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

use super::ControllerError;
use super::kubernetes::BlockTaint;
use super::plan::BlockMark;

/// Largest answer read from Probity (a blocklist of every node of a large cluster fits
/// many times over).
const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// How long one request to Probity may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Probity's API, as the controller calls it.
#[derive(Clone)]
pub struct ProbityApi {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    base: String,
}

#[derive(Deserialize)]
struct Blocked {
    nodes: BTreeMap<String, BlockMark>,
    #[serde(default)]
    tombstones: BTreeMap<String, u64>,
    #[serde(default, rename = "tombstonesError")]
    tombstones_error: Option<String>,
}

/// Probity's blocklist as one answer gave it.
#[derive(Debug, Clone, Default)]
pub struct Blocklist {
    /// The blocked nodes, with the record of each.
    pub blocks: BTreeMap<String, BlockMark>,
    /// Per node, the store revision of its last unblock: a block numbered no higher
    /// was lifted by it, whatever a lagging answer still holds.
    pub tombstones: BTreeMap<String, u64>,
}

impl ProbityApi {
    /// A client of the server at `base_url` (`https://host:port`), trusting `ca_pem`,
    /// presenting `identity` (certificate chain and key, PEM) when given.
    pub fn new(
        base_url: &str,
        ca_pem: &[u8],
        identity: Option<(&[u8], &[u8])>,
    ) -> Result<Self, ControllerError> {
        let tls = |reason: String| ControllerError::Tls(reason);
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| tls(format!("the CA bundle: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| tls(format!("the CA bundle: {e}")))?;
        }
        if roots.is_empty() {
            return Err(tls("the CA bundle holds no certificate".into()));
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| tls(e.to_string()))?
        .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((chain, key)) => {
                let chain = CertificateDer::pem_slice_iter(chain)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| tls(format!("the client certificate: {e}")))?;
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| tls(format!("the client key: {e}")))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| tls(format!("the client certificate: {e}")))?
            }
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_only()
            .enable_http1()
            .build();
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: base_url.trim_end_matches('/').to_owned(),
        })
    }

    /// The nodes Probity's blocklist holds now, with the record of each, and the
    /// tombstones of its unblocks. An answer whose tombstones Probity could not read is
    /// an error: without them a stale record cannot be told from a live one.
    pub async fn blocks(&self) -> Result<Blocklist, ControllerError> {
        let body = self.get("/v1/nodes/blocked").await?;
        let fail = |reason: String| ControllerError::Probity {
            what: "GET /v1/nodes/blocked".into(),
            reason,
        };
        let blocked: Blocked = serde_json::from_slice(&body)
            .map_err(|e| fail(format!("the answer is not a blocklist: {e}")))?;
        if let Some(error) = blocked.tombstones_error {
            return Err(fail(format!(
                "Probity could not read its unblock tombstones: {error}"
            )));
        }
        Ok(Blocklist {
            blocks: blocked.nodes,
            tombstones: blocked.tombstones,
        })
    }

    /// The taint Probity's settings name for blocked nodes (`Settings::"active"`'s
    /// `blockTaintKey` and `blockTaintEffect`, from `[kubernetes]` in probity.toml): the
    /// one the default policies let tolerating pods past, so the controller and the
    /// webhook never disagree about it.
    pub async fn block_taint(&self) -> Result<BlockTaint, ControllerError> {
        const PATH: &str = "/v1/entities/Settings/active";
        let body = self.get(PATH).await?;
        let fail = |reason: String| ControllerError::Probity {
            what: format!("GET {PATH}"),
            reason,
        };
        let settings: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| fail(format!("not an entity: {e}")))?;
        let attr = |name: &str| {
            settings
                .get("attrs")
                .and_then(|a| a.get(name))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| {
                    fail(format!(
                        "the settings have no {name} (policies older than the controller?)"
                    ))
                })
        };
        let taint = BlockTaint {
            key: attr("blockTaintKey")?,
            effect: attr("blockTaintEffect")?,
        };
        taint.check().map_err(fail)?;
        Ok(taint)
    }

    /// Each stored node's group (its `attribute`, an entity reference such as
    /// `zone: Zone::"z1"`): node id to the group's id, read in one request.
    pub async fn node_groups(
        &self,
        attribute: &str,
    ) -> Result<BTreeMap<String, String>, ControllerError> {
        const PATH: &str = "/v1/entities/Node";
        let body = self.get(PATH).await?;
        let answer: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| ControllerError::Probity {
                what: format!("GET {PATH}"),
                reason: format!("not an entity list: {e}"),
            })?;
        let entities = answer
            .get("entities")
            .and_then(serde_json::Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        Ok(entities
            .iter()
            .filter_map(|entity| {
                let id = entity.get("uid")?.get("id")?.as_str()?;
                let group = entity
                    .get("attrs")?
                    .get(attribute)?
                    .get("__entity")?
                    .get("id")?
                    .as_str()?;
                Some((id.to_owned(), group.to_owned()))
            })
            .collect())
    }

    /// Appends the controller's actions to Probity's event log (`POST /v1/events`), so
    /// they are chained, checkpointed and forwarded to the SIEM with Probity's own, in
    /// requests of 256; how many were appended, and the error that stopped the rest.
    pub async fn record_events(
        &self,
        records: &[super::ActionRecord],
    ) -> (usize, Option<ControllerError>) {
        let mut sent = 0;
        for chunk in records.chunks(256) {
            let events: Vec<serde_json::Value> = chunk
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "object": format!("node/{}", r.node),
                        "node": r.node,
                        "kind": format!("controller-{}-{}", r.action, r.outcome),
                        "detail": format!("{} (at {})", r.detail, r.at),
                    })
                })
                .collect();
            let body = serde_json::json!({ "events": events }).to_string();
            if let Err(error) = self
                .request(hyper::Method::POST, "/v1/events", Bytes::from(body))
                .await
            {
                // What went before is in the log: only the rest is sent again.
                return (sent, Some(error));
            }
            sent += chunk.len();
        }
        (sent, None)
    }

    pub(super) async fn get(&self, path: &str) -> Result<Bytes, ControllerError> {
        self.request(hyper::Method::GET, path, Bytes::new()).await
    }

    async fn request(
        &self,
        method: hyper::Method,
        path: &str,
        body: Bytes,
    ) -> Result<Bytes, ControllerError> {
        let what = format!("{method} {path}");
        let fail = |reason: String| ControllerError::Probity {
            what: what.clone(),
            reason,
        };
        let uri: hyper::Uri = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| fail(format!("bad URL: {e}")))?;
        tokio::time::timeout(REQUEST_TIMEOUT, async {
            let request = hyper::Request::builder()
                .method(method.clone())
                .uri(uri)
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(body))
                .map_err(|e| fail(format!("bad request: {e}")))?;
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| fail(probity_base::error::chain(&e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| fail(format!("reading the answer: {e}")))?
                .to_bytes();
            if !status.is_success() {
                return Err(fail(format!(
                    "answered {status}: {}",
                    String::from_utf8_lossy(body.get(..512).unwrap_or(&body))
                )));
            }
            Ok(body)
        })
        .await
        .map_err(|_| fail(format!("no answer within {} s", REQUEST_TIMEOUT.as_secs())))?
    }

    /// Replaces the facts the cluster owns (`PUT /v1/facts/cluster`) with `body`
    /// (`{"entities": [..]}`, see [`super::nodes`]).
    pub async fn replace_cluster_facts(&self, body: String) -> Result<(), ControllerError> {
        self.request(hyper::Method::PUT, "/v1/facts/cluster", Bytes::from(body))
            .await
            .map(|_| ())
    }
}
