use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::DEFAULT_SOCKET;

/// Limits per caller identity on what callers share.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Decisions per second a caller may cause to be recorded (denies, obligations,
    /// refused API calls); past its budget a caller is answered 429 and nothing is
    /// recorded. 0 turns the limit off. Default 200.
    pub recorded_per_second: u32,
    /// Recorded decisions a caller may cause at once. Default 1000.
    pub recorded_burst: u32,
    /// Threads for callers' blocking I/O (verification reads), apart from everything
    /// else. Default 4.
    pub io_threads: usize,
    /// Verification jobs waiting for an I/O thread at most; more are answered 429.
    /// Default 64.
    pub io_queue: usize,
    /// Verification jobs one caller may have in flight. Default 2.
    pub io_per_caller: usize,
    /// Bytes the engine's decision cache may hold (answers reused while their facts
    /// hold), shared fairly between callers; 0 turns it off. Default 32 MiB.
    pub decision_cache_bytes: usize,
    /// Bytes the memo of `/v1/decide` bodies already parsed may be counted at (a body
    /// sent again is not parsed again); 0 turns it off. Default 8 MiB.
    pub parsed_request_bytes: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            recorded_per_second: 200,
            recorded_burst: 1000,
            io_threads: 4,
            io_queue: 64,
            io_per_caller: 2,
            decision_cache_bytes: probity::DecisionCache::DEFAULT_BUDGET_BYTES,
            parsed_request_bytes: probity::ParsedRequests::DEFAULT_BUDGET_BYTES,
        }
    }
}

/// Listeners, TLS and limits.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Unix socket path; empty to listen on no socket. Default [`DEFAULT_SOCKET`].
    pub socket: PathBuf,
    /// Permission bits of the socket, in octal. Default `"0660"`.
    pub socket_mode: String,
    /// TCP address to listen on (TLS unless `insecure`). Default: none.
    pub listen: Option<SocketAddr>,
    /// Serve plain HTTP on `listen`; refused unless the address is loopback. Default false.
    pub insecure: bool,
    /// PEM certificate chain for TLS. Required with `listen` unless `insecure`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: when set, TCP clients present a certificate it signed (mTLS).
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: `"required"` (the default: a client without a certificate is
    /// refused at the handshake) or `"optional"` (a client without one is served as
    /// `anonymous`, budgeted per network; one with a certificate must present a valid
    /// one). Optional lets the kubelet's probes in while the apiserver and the scheduler
    /// authenticate.
    pub client_auth: ClientAuth,
    /// Largest request body in bytes. Default 1 MiB.
    pub max_body_bytes: usize,
    /// Longest time one request may take, in milliseconds. Default 5000.
    pub request_timeout_ms: u64,
    /// Most requests handled at once; more wait. Default 1024.
    pub max_concurrency: usize,
    /// Longest wait for in-flight requests at shutdown, in milliseconds. Default 10000.
    pub shutdown_grace_ms: u64,
    /// Connections open at once, at most. Default 4096.
    pub max_connections: usize,
    /// Connections one caller identity (or, without one, one peer address) may have
    /// open. Default 256.
    pub max_connections_per_caller: usize,
    /// Longest time a connection may take to send a request's headers, in
    /// milliseconds (a slowloris is cut off after it). Default 10000.
    pub header_read_timeout_ms: u64,
    /// Fact streams (`POST /v1/entities/stream`) open at once, over all callers, at
    /// most. Default 64.
    pub max_fact_streams: usize,
    /// Fact streams one caller identity may have open at once, so that one writer
    /// cannot take every stream. Default 16.
    pub max_fact_streams_per_caller: usize,
    /// A fact stream that sends no byte, or reads no acknowledgement, for this long is
    /// ended, in milliseconds. Default 60000.
    pub fact_stream_idle_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            socket_mode: "0660".into(),
            listen: None,
            insecure: false,
            tls_cert: None,
            tls_key: None,
            client_ca: None,
            client_auth: ClientAuth::Required,
            max_body_bytes: 1024 * 1024,
            request_timeout_ms: 5000,
            max_concurrency: 1024,
            shutdown_grace_ms: 10_000,
            max_connections: 4096,
            max_connections_per_caller: 256,
            header_read_timeout_ms: 10_000,
            max_fact_streams: 64,
            max_fact_streams_per_caller: 16,
            fact_stream_idle_ms: 60_000,
        }
    }
}

impl ServerConfig {
    /// The request timeout as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

/// Who may change state through the API. Callers are `uid:<n>` on the Unix socket,
/// `cn:<subject CN>` with a client certificate, and `anonymous` otherwise.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Group name to member identities; the policies under policies/api read the groups.
    /// Default: `admins = ["uid:0"]`.
    pub groups: BTreeMap<String, Vec<String>>,
    /// Identity to the node whose sidecar it is, e.g. `"cn:sidecar-gpu-001" = "gpu-001"`.
    /// Default: none.
    pub nodes: BTreeMap<String, String>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            groups: BTreeMap::from([("admins".to_owned(), vec!["uid:0".to_owned()])]),
            nodes: BTreeMap::new(),
        }
    }
}

/// The endpoint families of the API, as `Api` entities.
pub(crate) const API_FAMILIES: &[&str] = &[
    "cluster",
    "decisions",
    "entities",
    "events",
    "facts",
    "keys",
    "nodes",
    "verify",
];

impl AuthConfig {
    /// The API's callers, groups and endpoint families as the engine-owned entities the
    /// `manage` policies read (`ApiCaller` in its `ApiGroup`s, with its `node`). A
    /// caller not named here has no groups: it exists only as a uid in its requests.
    pub fn api_entities(&self) -> serde_json::Value {
        use serde_json::json;
        let mut callers: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (group, members) in &self.groups {
            for m in members {
                callers.entry(m).or_default().push(group);
            }
        }
        for id in self.nodes.keys() {
            callers.entry(id).or_default();
        }
        let mut out = Vec::new();
        for (id, groups) in callers {
            let mut attrs = serde_json::Map::new();
            if let Some(n) = self.nodes.get(id) {
                attrs.insert("node".into(), json!(n));
            }
            out.push(json!({
                "uid": {"type": "ApiCaller", "id": id},
                "attrs": attrs,
                "parents": groups.iter().map(|g| json!({"type": "ApiGroup", "id": g})).collect::<Vec<_>>(),
            }));
        }
        for g in self.groups.keys() {
            out.push(json!({"uid": {"type": "ApiGroup", "id": g}, "attrs": {}, "parents": []}));
        }
        for f in API_FAMILIES {
            out.push(json!({"uid": {"type": "Api", "id": f}, "attrs": {}, "parents": []}));
        }
        serde_json::Value::Array(out)
    }
}

/// Whether TCP clients must present a certificate when `client_ca` is set.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// Every client presents a certificate `client_ca` signed. The default.
    #[default]
    Required,
    /// A client may present none and is then `anonymous`; a certificate it presents
    /// must verify.
    Optional,
}
