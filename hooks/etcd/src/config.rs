//! How to reach etcd: endpoints, timeouts, mutual TLS, the key prefix.
//!
//! Why this module exists: one place states every setting with its default and checks them
//! before the first request, so a typo in an endpoint or a world-writable CA bundle is a
//! configuration error at start-up, not a puzzling failure an hour later.

use std::path::Path;
use std::time::Duration;

use crate::error::EtcdError;

/// Default prefix under which every Probity key lives.
pub const DEFAULT_PREFIX: &str = "/probity/";
/// Default time to establish a TCP (and TLS) connection to one endpoint.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default time one request may take at one endpoint before the client tries the next.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Default total time an operation keeps retrying across endpoints (leader elections in etcd
/// take one to three election timeouts, 1 s each by default).
pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(10);
/// Default number of keys per page when listing a prefix.
pub const DEFAULT_PAGE_SIZE: u32 = 1000;
/// Default interval between watch progress requests when a watch is idle; it bounds how stale
/// an idle watch can look.
pub const DEFAULT_PROGRESS_INTERVAL: Duration = Duration::from_secs(1);
/// Default HTTP/2 ping interval, which finds a dead connection that TCP has not noticed.
pub const DEFAULT_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Default time to wait for a ping's answer.
pub const DEFAULT_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest page size accepted.
pub const MAX_PAGE_SIZE: u32 = 100_000;

/// Connection settings. Build with [`EtcdConfig::new`] and the `with_*` methods; every
/// setting not given keeps the default named in its doc.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// Client URLs of the members, `http://host:port` or `https://host:port` (a bare
    /// `host:port` takes `https` when TLS is configured, `http` otherwise). No default.
    pub endpoints: Vec<String>,
    /// See [`DEFAULT_CONNECT_TIMEOUT`].
    pub connect_timeout: Duration,
    /// See [`DEFAULT_REQUEST_TIMEOUT`].
    pub request_timeout: Duration,
    /// See [`DEFAULT_RETRY_BUDGET`].
    pub retry_budget: Duration,
    /// Mutual TLS; default none (plain HTTP/2, for loopback or a private network).
    pub tls: Option<TlsConfig>,
    /// See [`DEFAULT_PREFIX`]; must end with `/`.
    pub prefix: String,
    /// See [`DEFAULT_PAGE_SIZE`].
    pub page_size: u32,
    /// See [`DEFAULT_PROGRESS_INTERVAL`].
    pub progress_interval: Duration,
    /// See [`DEFAULT_KEEP_ALIVE_INTERVAL`].
    pub keep_alive_interval: Duration,
    /// See [`DEFAULT_KEEP_ALIVE_TIMEOUT`].
    pub keep_alive_timeout: Duration,
}

impl EtcdConfig {
    /// Settings for `endpoints`, everything else at its default.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            retry_budget: DEFAULT_RETRY_BUDGET,
            tls: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            page_size: DEFAULT_PAGE_SIZE,
            progress_interval: DEFAULT_PROGRESS_INTERVAL,
            keep_alive_interval: DEFAULT_KEEP_ALIVE_INTERVAL,
            keep_alive_timeout: DEFAULT_KEEP_ALIVE_TIMEOUT,
        }
    }

    /// Uses mutual TLS.
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Puts every key under `prefix` (must end with `/`).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the connect timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the per-attempt request timeout.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets how long an operation keeps retrying.
    pub fn with_retry_budget(mut self, budget: Duration) -> Self {
        self.retry_budget = budget;
        self
    }

    /// Sets the list page size.
    pub fn with_page_size(mut self, page_size: u32) -> Self {
        self.page_size = page_size;
        self
    }

    /// Sets the idle watch progress interval.
    pub fn with_progress_interval(mut self, interval: Duration) -> Self {
        self.progress_interval = interval;
        self
    }

    /// Sets the HTTP/2 keep-alive ping interval and timeout.
    pub fn with_keep_alive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keep_alive_interval = interval;
        self.keep_alive_timeout = timeout;
        self
    }

    /// Checks the settings and returns the endpoint URLs with their scheme.
    pub(crate) fn validate(&self) -> Result<Vec<String>, EtcdError> {
        let bad = |field, problem: &str| EtcdError::Config {
            field,
            problem: problem.to_owned(),
        };
        if self.endpoints.is_empty() {
            return Err(bad("endpoints", "no endpoint given"));
        }
        if !self.prefix.ends_with('/') {
            return Err(EtcdError::Config {
                field: "prefix",
                problem: format!("{:?} must end with '/'", self.prefix),
            });
        }
        if self.page_size == 0 || self.page_size > MAX_PAGE_SIZE {
            return Err(EtcdError::Config {
                field: "page_size",
                problem: format!("{} is not within 1..={MAX_PAGE_SIZE}", self.page_size),
            });
        }
        for (field, d) in [
            ("connect_timeout", self.connect_timeout),
            ("request_timeout", self.request_timeout),
            ("retry_budget", self.retry_budget),
            ("progress_interval", self.progress_interval),
            ("keep_alive_interval", self.keep_alive_interval),
            ("keep_alive_timeout", self.keep_alive_timeout),
        ] {
            if d.is_zero() {
                return Err(bad(field, "must be more than zero"));
            }
        }
        let mut urls = Vec::with_capacity(self.endpoints.len());
        for endpoint in &self.endpoints {
            let url = if endpoint.starts_with("https://") {
                if self.tls.is_none() {
                    return Err(EtcdError::Config {
                        field: "endpoints",
                        problem: format!("{endpoint:?} is https but no TLS is configured"),
                    });
                }
                endpoint.clone()
            } else if endpoint.starts_with("http://") {
                if self.tls.is_some() {
                    return Err(EtcdError::Config {
                        field: "endpoints",
                        problem: format!(
                            "{endpoint:?} is plain http but TLS is configured; use https://"
                        ),
                    });
                }
                endpoint.clone()
            } else if endpoint.contains("://") {
                return Err(EtcdError::Config {
                    field: "endpoints",
                    problem: format!("{endpoint:?}: only http:// and https:// are supported"),
                });
            } else if self.tls.is_some() {
                format!("https://{endpoint}")
            } else {
                format!("http://{endpoint}")
            };
            if urls.contains(&url) {
                return Err(EtcdError::Config {
                    field: "endpoints",
                    problem: format!("{url:?} is listed twice"),
                });
            }
            urls.push(url);
        }
        Ok(urls)
    }
}

/// Mutual TLS material: the CA bundle that signed the members' certificates and, for etcd's
/// `--client-cert-auth`, a client certificate and key. PEM throughout.
#[derive(Clone)]
pub struct TlsConfig {
    pub(crate) ca_pem: Vec<u8>,
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
    pub(crate) domain_name: Option<String>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_identity", &self.identity.is_some())
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

impl TlsConfig {
    /// Trusts the CA certificates in `ca_pem`; no client certificate.
    pub fn from_pem(ca_pem: impl Into<Vec<u8>>) -> Self {
        Self {
            ca_pem: ca_pem.into(),
            identity: None,
            domain_name: None,
        }
    }

    /// Trusts the CA bundle in file `ca`, which group and others must not be able to write.
    pub fn from_ca_file(ca: &Path) -> Result<Self, EtcdError> {
        Ok(Self::from_pem(read_trusted("CA bundle", ca)?))
    }

    /// Presents the client certificate `cert_pem` with its private key `key_pem`.
    pub fn with_client_identity_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Presents the client certificate in file `cert` with the key in file `key` (neither
    /// writable by group or others).
    pub fn with_client_identity_files(self, cert: &Path, key: &Path) -> Result<Self, EtcdError> {
        let cert_pem = read_trusted("client certificate", cert)?;
        let key_pem = read_trusted("client key", key)?;
        Ok(self.with_client_identity_pem(cert_pem, key_pem))
    }

    /// Checks the members' certificates against `name` instead of the endpoint's host.
    pub fn with_domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain_name = Some(name.into());
        self
    }

    pub(crate) fn to_tonic(&self) -> tonic::transport::ClientTlsConfig {
        let mut tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        if let Some(name) = &self.domain_name {
            tls = tls.domain_name(name.clone());
        }
        tls
    }
}

/// Reads a file of trust material, refusing one that group or others can write.
fn read_trusted(what: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    use std::os::unix::fs::PermissionsExt as _;
    let read_err = |source| EtcdError::ReadFile {
        what,
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    let mode = meta.permissions().mode() & 0o7777;
    // The same judgement as every other trust file's (write access beyond the owner).
    if probity_base::trust::granted_to_others(mode, 0o2).is_some() {
        return Err(EtcdError::InsecureFile {
            what,
            path: path.to_owned(),
            mode,
        });
    }
    std::fs::read(path).map_err(read_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_endpoints_take_the_scheme_of_the_tls_setting() {
        let plain = EtcdConfig::new(["127.0.0.1:2379"]);
        assert_eq!(plain.validate().unwrap(), ["http://127.0.0.1:2379"]);
        let tls = EtcdConfig::new(["127.0.0.1:2379"]).with_tls(TlsConfig::from_pem("x"));
        assert_eq!(tls.validate().unwrap(), ["https://127.0.0.1:2379"]);
    }

    #[test]
    fn validate_names_the_bad_setting() {
        let cases: [(EtcdConfig, &str); 6] = [
            (
                EtcdConfig::new(Vec::<String>::new()),
                "endpoints: no endpoint given",
            ),
            (
                EtcdConfig::new(["a:1"]).with_prefix("/probity"),
                "prefix: \"/probity\" must end with '/'",
            ),
            (
                EtcdConfig::new(["https://a:1"]),
                "endpoints: \"https://a:1\" is https but no TLS is configured",
            ),
            (
                EtcdConfig::new(["unix://x"]),
                "endpoints: \"unix://x\": only http:// and https:// are supported",
            ),
            (
                EtcdConfig::new(["a:1", "http://a:1"]),
                "endpoints: \"http://a:1\" is listed twice",
            ),
            (
                EtcdConfig::new(["a:1"]).with_page_size(0),
                "page_size: 0 is not within 1..=100000",
            ),
        ];
        for (config, message) in cases {
            let err = config.validate().unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("invalid etcd configuration: {message}")
            );
        }
    }

    #[test]
    fn trust_material_that_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "pem").unwrap();
        std::fs::set_permissions(&ca, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = TlsConfig::from_ca_file(&ca).unwrap_err();
        assert!(
            matches!(err, EtcdError::InsecureFile { mode: 0o666, .. }),
            "{err}"
        );
        std::fs::set_permissions(&ca, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(TlsConfig::from_ca_file(&ca).unwrap().ca_pem, b"pem");
        let missing = TlsConfig::from_ca_file(&dir.path().join("nope")).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("cannot read the etcd CA bundle")
        );
    }
}
