//! The client: one lazy gRPC channel per endpoint, failover between them, and the key-value
//! primitives (get, paged list, put, batched put, delete, compact).
//!
//! Why this module exists: etcd-client balances requests over all endpoints behind one
//! channel, which hides which member failed and, with a member down, can park a request
//! until it times out. Here each endpoint has its own channel; a request goes to the member
//! that last answered, and a failure moves it on to the next at once, within one retry budget
//! ([`EtcdConfig::retry_budget`]). Whether a failed request may be repeated is decided by the
//! operation ([`Retry`]): reads and plain puts are repeated after any transient failure; a
//! compare-and-swap only after a failure that certainly did not apply it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{
    CompactionOptions, Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp,
};

use crate::config::EtcdConfig;
use crate::error::{
    AttemptError, Class, EndpointFailure, EtcdError, Operation, classify, describe,
};
use crate::health::{Health, HealthState};
use crate::key::{Escaped, Keyspace};
use crate::lease::LeaseId;

/// Most operations etcd accepts in one transaction (its `--max-txn-ops` default).
pub const MAX_TXN_OPS: usize = 128;

/// Pauses between rounds over all endpoints: the first, doubling up to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(25);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Restarts of a paged listing whose revision was compacted while it was read.
const LIST_RESTARTS: u32 = 3;

/// One key as stored in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key, relative to the configured prefix.
    pub key: String,
    /// The value.
    pub value: Vec<u8>,
    /// Revision of the last change to this key.
    pub mod_revision: i64,
    /// Revision at which the key was created.
    pub create_revision: i64,
    /// Number of changes since creation (1 for a new key).
    pub version: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

impl Entry {
    pub(crate) fn from_kv(
        keyspace: &Keyspace,
        kv: &etcd_client::KeyValue,
    ) -> Result<Self, EtcdError> {
        let key = keyspace
            .relative(kv.key())
            .map_err(|source| EtcdError::MalformedKey {
                key: Escaped(kv.key()).to_string(),
                source,
            })?;
        Ok(Self {
            key: key.to_owned(),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            create_revision: kv.create_revision(),
            version: kv.version(),
            lease: (kv.lease() != 0).then_some(LeaseId(kv.lease())),
        })
    }
}

/// A prefix read at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    /// The revision every page was read at: watch from `revision + 1` to follow on.
    pub revision: i64,
    /// The keys in key order.
    pub entries: Vec<Entry>,
    /// Requests it took (pages, including any retried at a smaller size).
    pub pages: u32,
}

/// What a delete did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    /// Revision of the store after the delete.
    pub revision: i64,
    /// Whether the key existed. A delete retried after a lost answer may say `false` for a
    /// key its first attempt deleted.
    pub existed: bool,
}

/// What a prefix delete did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeletedPrefix {
    /// Revision of the store after the delete.
    pub revision: i64,
    /// Keys deleted.
    pub count: i64,
}

/// A member's view of the cluster, from etcd's Status call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// The endpoint asked.
    pub endpoint: String,
    /// Its member id.
    pub member_id: u64,
    /// The leader it knows of (0: none).
    pub leader: u64,
    /// Its raft term.
    pub raft_term: u64,
    /// Its store revision.
    pub revision: i64,
    /// Its server version, e.g. `3.4.23`.
    pub version: String,
}

impl MemberStatus {
    /// Whether this member is the leader.
    pub fn is_leader(&self) -> bool {
        self.leader != 0 && self.leader == self.member_id
    }
}

/// Which failures an operation may repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Repeating is harmless (a read, a put of the same value, an idempotent CAS).
    Always,
    /// Repeat only what certainly was not applied; otherwise [`EtcdError::OutcomeUnknown`].
    IfNotApplied,
}

/// Responses that carry etcd's header revision.
pub(crate) trait HeaderRevision {
    fn header_revision(&self) -> Option<i64>;
}

macro_rules! header_revision {
    ($($t:ty),*) => {$(
        impl HeaderRevision for $t {
            fn header_revision(&self) -> Option<i64> {
                self.header().map(|h| h.revision())
            }
        }
    )*};
}
header_revision!(
    etcd_client::GetResponse,
    etcd_client::PutResponse,
    etcd_client::DeleteResponse,
    etcd_client::TxnResponse,
    etcd_client::CompactionResponse,
    etcd_client::LeaseGrantResponse,
    etcd_client::LeaseRevokeResponse,
    etcd_client::LeaseTimeToLiveResponse,
    etcd_client::StatusResponse
);

/// An etcd v3 client for Probity's state: see the crate docs for what each call promises.
/// Cheap to clone; clones share connections and the health view.
#[derive(Clone)]
pub struct EtcdClient {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClient")
            .field("endpoints", &self.endpoints())
            .field("prefix", &self.inner.keyspace.prefix())
            .finish()
    }
}

pub(crate) struct Inner {
    pub(crate) config: EtcdConfig,
    pub(crate) keyspace: Keyspace,
    pub(crate) members: Vec<Member>,
    /// The member that last answered: requests start there.
    pub(crate) current: AtomicUsize,
    pub(crate) health: HealthState,
}

pub(crate) struct Member {
    pub(crate) url: String,
    pub(crate) client: etcd_client::Client,
}

impl EtcdClient {
    /// A client for `config`. Connections are made lazily: this succeeds while etcd is down,
    /// and the first request (or [`EtcdClient::status`]) finds out. Fails only on a
    /// configuration that cannot work.
    pub async fn connect(config: EtcdConfig) -> Result<Self, EtcdError> {
        let urls = config.validate()?;
        let tls = config.tls.as_ref().map(|t| t.to_tonic());
        let mut members = Vec::with_capacity(urls.len());
        for url in urls {
            let endpoint_err = |source| EtcdError::Endpoint {
                endpoint: url.clone(),
                source,
            };
            let mut endpoint = tonic::transport::Endpoint::from_shared(url.clone())
                .map_err(endpoint_err)?
                .connect_timeout(config.connect_timeout)
                .http2_keep_alive_interval(config.keep_alive_interval)
                .keep_alive_timeout(config.keep_alive_timeout)
                .keep_alive_while_idle(true)
                .tcp_nodelay(true);
            if let Some(tls) = &tls {
                endpoint = endpoint.tls_config(tls.clone()).map_err(endpoint_err)?;
            }
            let channel = etcd_client::Channel::Tonic(endpoint.connect_lazy());
            // require_leader: a member cut off from the leader refuses at once ("no leader")
            // and cancels its watches, so the client moves to a member that has one.
            let options = etcd_client::ConnectOptions::new().with_require_leader(true);
            let client = etcd_client::Client::from_channel(channel, Some(options))
                .await
                .map_err(|source| EtcdError::Request {
                    endpoint: url.clone(),
                    operation: Operation::Status,
                    key: String::new(),
                    source: AttemptError::Etcd(source),
                })?;
            members.push(Member { url, client });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                keyspace: crate::key::Keyspace::new(config.prefix.clone()),
                config,
                members,
                current: AtomicUsize::new(0),
                health: HealthState::new(),
            }),
        })
    }

    /// The endpoint URLs, in configured order.
    pub fn endpoints(&self) -> Vec<&str> {
        self.inner.members.iter().map(|m| m.url.as_str()).collect()
    }

    /// The configuration.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The prefix and key conversions.
    pub fn keyspace(&self) -> &Keyspace {
        &self.inner.keyspace
    }

    /// Whether etcd answers, and how long ago it last did: for readiness endpoints.
    pub fn health(&self) -> Health {
        self.inner.health.report()
    }

    /// Runs `attempt` against the member that last answered, then the others, until one
    /// succeeds, a failure may not be repeated, or the retry budget is spent.
    pub(crate) async fn run<T, F, Fut>(
        &self,
        operation: Operation,
        key: &str,
        retry: Retry,
        mut attempt: F,
    ) -> Result<T, EtcdError>
    where
        T: HeaderRevision,
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let inner = &*self.inner;
        let started = Instant::now();
        let deadline = started + inner.config.retry_budget;
        let count = inner.members.len();
        let mut failures: Vec<EndpointFailure> = Vec::new();
        let mut backoff = BACKOFF_FIRST;
        loop {
            let first = inner.current.load(Ordering::Relaxed);
            for step in 0..count {
                let index = (first + step) % count;
                let Some(member) = inner.members.get(index) else {
                    continue;
                };
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    break;
                }
                let timeout = inner.config.request_timeout.min(remaining);
                let outcome = tokio::time::timeout(timeout, attempt(member.client.clone())).await;
                let (error, class) = match outcome {
                    Ok(Ok(value)) => {
                        inner.current.store(index, Ordering::Relaxed);
                        inner.health.heard(value.header_revision());
                        return Ok(value);
                    }
                    Ok(Err(e)) => {
                        let class = classify(&e);
                        (AttemptError::Etcd(e), class)
                    }
                    Err(_) => (AttemptError::TimedOut(timeout), Class::Ambiguous),
                };
                let fail = |source| EtcdError::Request {
                    endpoint: member.url.clone(),
                    operation,
                    key: key.to_owned(),
                    source,
                };
                match (class, retry) {
                    (Class::Fatal, _) => {
                        // etcd itself refused: it is reachable.
                        if error.code().is_some_and(is_server_refusal) {
                            inner.health.heard(None);
                        }
                        return Err(fail(error));
                    }
                    (Class::Ambiguous, Retry::IfNotApplied) => {
                        inner.health.failed(format!("{}: {error}", member.url));
                        return Err(EtcdError::OutcomeUnknown {
                            endpoint: member.url.clone(),
                            operation,
                            key: key.to_owned(),
                            source: error,
                        });
                    }
                    _ => {
                        tracing::debug!(endpoint = %member.url, %operation, key, %error, "etcd attempt failed");
                        failures.retain(|f| f.endpoint != member.url);
                        failures.push(EndpointFailure {
                            endpoint: member.url.clone(),
                            reason: error.to_string(),
                        });
                        inner.current.store((index + 1) % count, Ordering::Relaxed);
                    }
                }
            }
            let summary = failures
                .iter()
                .map(|f| format!("{}: {}", f.endpoint, f.reason))
                .collect::<Vec<_>>()
                .join("; ");
            inner.health.failed(summary);
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(EtcdError::Unavailable {
                    operation,
                    key: key.to_owned(),
                    elapsed: started.elapsed(),
                    failures,
                });
            }
            tokio::time::sleep(backoff.min(remaining)).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// The value of `key` (relative to the prefix) and the store revision it was read at.
    /// Linearizable: reflects every write acknowledged before the call.
    pub async fn get(&self, key: &str) -> Result<(Option<Entry>, i64), EtcdError> {
        let full = self.inner.keyspace.full(key);
        let mut resp = self
            .run(Operation::Get, key, Retry::Always, |mut c| {
                let full = full.clone();
                async move { c.get(full, None).await }
            })
            .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        let entry = match resp.take_kvs().first() {
            Some(kv) => Some(Entry::from_kv(&self.inner.keyspace, kv)?),
            None => None,
        };
        Ok((entry, revision))
    }

    /// Every key under `prefix` (relative to the configured prefix; `""` lists everything),
    /// read in pages of [`EtcdConfig::page_size`] keys, all at the revision of the first page,
    /// so the listing is one consistent snapshot however many pages it takes. A page too big
    /// for one gRPC message (4 MiB) is asked again at half the size. A revision compacted
    /// while the pages were read restarts the listing.
    pub async fn list(&self, prefix: &str) -> Result<Listing, EtcdError> {
        let mut restarts = 0;
        loop {
            match self.list_once(prefix).await {
                Err(EtcdError::Compacted { .. }) if restarts < LIST_RESTARTS => restarts += 1,
                other => return other,
            }
        }
    }

    async fn list_once(&self, prefix: &str) -> Result<Listing, EtcdError> {
        let full_prefix = self.inner.keyspace.full(prefix);
        let end = prefix_end(&full_prefix);
        let mut start = full_prefix;
        let mut page_size = i64::from(self.inner.config.page_size);
        let mut revision = 0_i64;
        let mut entries = Vec::new();
        let mut pages = 0_u32;
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(page_size);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            pages = pages.saturating_add(1);
            let result = self
                .run(Operation::List, prefix, Retry::Always, |mut c| {
                    let (start, options) = (start.clone(), options.clone());
                    async move { c.get(start, Some(options)).await }
                })
                .await;
            let mut resp = match result {
                Ok(resp) => resp,
                Err(EtcdError::Request { source, .. })
                    if is_too_large(&source) && page_size > 1 =>
                {
                    page_size /= 2;
                    continue;
                }
                Err(EtcdError::Request { source, .. }) if is_compacted(&source) => {
                    return Err(EtcdError::Compacted {
                        operation: Operation::List,
                        key: prefix.to_owned(),
                        requested: revision,
                        compact_revision: 0,
                    });
                }
                Err(e) => return Err(e),
            };
            if revision == 0 {
                revision = resp.header().map(|h| h.revision()).unwrap_or(0);
            }
            let more = resp.more();
            let kvs = resp.take_kvs();
            for kv in &kvs {
                entries.push(Entry::from_kv(&self.inner.keyspace, kv)?);
            }
            match kvs.last() {
                Some(last) if more => {
                    // The next page starts just after the last key.
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => break,
            }
        }
        Ok(Listing {
            revision,
            entries,
            pages,
        })
    }

    /// Writes `value` at `key` and returns the revision of the write. A put retried after a
    /// lost answer may be applied twice (the same value, two revisions).
    pub async fn put(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<i64, EtcdError> {
        self.put_inner(key, value.into(), None).await
    }

    /// Writes `value` at `key` attached to `lease`: the key is deleted when the lease ends.
    pub async fn put_with_lease(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
    ) -> Result<i64, EtcdError> {
        self.put_inner(key, value.into(), Some(lease)).await
    }

    async fn put_inner(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<i64, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let options = lease.map(|l| PutOptions::new().with_lease(l.0));
        let resp = self
            .run(Operation::Put, key, Retry::Always, |mut c| {
                let (full, value, options) = (full.clone(), value.clone(), options.clone());
                async move { c.put(full, value, options).await }
            })
            .await
            .map_err(|e| lease_error(e, lease))?;
        Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
    }

    /// Writes every `(key, value)` pair, attached to `lease` if given, in transactions of at
    /// most [`MAX_TXN_OPS`] puts each; returns the revision of the last. Each transaction is
    /// atomic; the batch as a whole is not (a failure part-way leaves the earlier
    /// transactions applied). One transaction costs etcd one raft entry and one fsync
    /// whatever its size, which is what makes batching cheaper than single puts.
    pub async fn put_batch<K: AsRef<str>, V: AsRef<[u8]>>(
        &self,
        items: &[(K, V)],
        lease: Option<LeaseId>,
    ) -> Result<i64, EtcdError> {
        let ops = items
            .iter()
            .map(|(k, v)| (k.as_ref(), v.as_ref(), lease))
            .collect::<Vec<_>>();
        self.put_txns(&ops).await
    }

    /// [`EtcdClient::put_batch`] with a lease per key (or none): for a process publishing
    /// several nodes' facts, each under its node's lease.
    pub async fn put_many<K: AsRef<str>, V: AsRef<[u8]>>(
        &self,
        items: &[(K, V, Option<LeaseId>)],
    ) -> Result<i64, EtcdError> {
        let ops = items
            .iter()
            .map(|(k, v, l)| (k.as_ref(), v.as_ref(), *l))
            .collect::<Vec<_>>();
        self.put_txns(&ops).await
    }

    async fn put_txns(&self, items: &[(&str, &[u8], Option<LeaseId>)]) -> Result<i64, EtcdError> {
        let mut revision = 0;
        for chunk in items.chunks(MAX_TXN_OPS) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(k, v, lease)| {
                    TxnOp::put(
                        self.inner.keyspace.full(k),
                        v.to_vec(),
                        lease.map(|l| PutOptions::new().with_lease(l.0)),
                    )
                })
                .collect();
            let first = chunk.first().map(|(k, _, _)| *k).unwrap_or_default();
            let lease = chunk.iter().find_map(|(_, _, l)| *l);
            let resp = self
                .run(Operation::PutBatch, first, Retry::Always, |mut c| {
                    let txn = Txn::new().and_then(ops.clone());
                    async move { c.txn(txn).await }
                })
                .await
                .map_err(|e| lease_error(e, lease))?;
            revision = resp.header().map(|h| h.revision()).unwrap_or(revision);
        }
        Ok(revision)
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) -> Result<Deleted, EtcdError> {
        let full = self.inner.keyspace.full(key);
        let resp = self
            .run(Operation::Delete, key, Retry::Always, |mut c| {
                let full = full.clone();
                async move { c.delete(full, None).await }
            })
            .await?;
        Ok(Deleted {
            revision: resp.header().map(|h| h.revision()).unwrap_or(0),
            existed: resp.deleted() > 0,
        })
    }

    /// Deletes every key under `prefix` (relative to the configured prefix) in one request.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<DeletedPrefix, EtcdError> {
        let full = self.inner.keyspace.full(prefix);
        let resp = self
            .run(Operation::Delete, prefix, Retry::Always, |mut c| {
                let full = full.clone();
                async move {
                    c.delete(full, Some(DeleteOptions::new().with_prefix()))
                        .await
                }
            })
            .await?;
        Ok(DeletedPrefix {
            revision: resp.header().map(|h| h.revision()).unwrap_or(0),
            count: resp.deleted(),
        })
    }

    /// Discards the history before `revision` (the whole cluster's, not only Probity's keys),
    /// waiting until it is physically gone. Watches that start before it get
    /// [`crate::WatchMessage::Compacted`].
    ///
    /// Idempotent: a history already compacted at or past `revision` is success, which is
    /// also what a retry sees after an attempt whose answer was lost. (On that path the
    /// physical removal may still be under way when this returns.)
    pub async fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        let result = self
            .run(Operation::Compact, "", Retry::Always, |mut c| async move {
                c.compact(revision, Some(CompactionOptions::new().with_physical()))
                    .await
            })
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(EtcdError::Request { source, .. }) if is_compacted(&source) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Asks one endpoint (by its URL as configured) for its status, without failover.
    pub async fn member_status(&self, endpoint: &str) -> Result<MemberStatus, EtcdError> {
        let Some(member) = self.inner.members.iter().find(|m| m.url == endpoint) else {
            return Err(EtcdError::Config {
                field: "endpoints",
                problem: format!("{endpoint:?} is not a configured endpoint"),
            });
        };
        let timeout = self.inner.config.request_timeout;
        let fail = |source| EtcdError::Request {
            endpoint: member.url.clone(),
            operation: Operation::Status,
            key: String::new(),
            source,
        };
        let mut client = member.client.clone();
        let resp = tokio::time::timeout(timeout, client.status())
            .await
            .map_err(|_| fail(AttemptError::TimedOut(timeout)))?
            .map_err(|e| fail(AttemptError::Etcd(e)))?;
        let header = resp.header().ok_or_else(|| EtcdError::Protocol {
            endpoint: member.url.clone(),
            operation: Operation::Status,
            key: String::new(),
            what: "a header",
        })?;
        self.inner.health.heard(Some(header.revision()));
        Ok(MemberStatus {
            endpoint: member.url.clone(),
            member_id: header.member_id(),
            leader: resp.leader(),
            raft_term: header.raft_term(),
            revision: header.revision(),
            version: resp.version().to_owned(),
        })
    }

    /// The status of the first member that answers (through failover): a readiness probe.
    pub async fn status(&self) -> Result<MemberStatus, EtcdError> {
        let resp = self
            .run(Operation::Status, "", Retry::Always, |mut c| async move {
                c.status().await
            })
            .await?;
        let index = self.inner.current.load(Ordering::Relaxed);
        let endpoint = self
            .inner
            .members
            .get(index)
            .map(|m| m.url.clone())
            .unwrap_or_default();
        let header = resp.header().ok_or_else(|| EtcdError::Protocol {
            endpoint: endpoint.clone(),
            operation: Operation::Status,
            key: String::new(),
            what: "a header",
        })?;
        Ok(MemberStatus {
            endpoint,
            member_id: header.member_id(),
            leader: resp.leader(),
            raft_term: header.raft_term(),
            revision: header.revision(),
            version: resp.version().to_owned(),
        })
    }

    /// A compare-and-swap transaction, retried per `retry`.
    pub(crate) async fn txn(
        &self,
        key: &str,
        retry: Retry,
        compares: Vec<Compare>,
        success: Vec<TxnOp>,
        failure: Vec<TxnOp>,
    ) -> Result<etcd_client::TxnResponse, EtcdError> {
        self.run(Operation::Txn, key, retry, |mut c| {
            let txn = Txn::new()
                .when(compares.clone())
                .and_then(success.clone())
                .or_else(failure.clone());
            async move { c.txn(txn).await }
        })
        .await
    }
}

/// Compares for "key absent" and "key at mod revision `rev`".
pub(crate) fn absent(full: &[u8]) -> Compare {
    Compare::version(full.to_vec(), CompareOp::Equal, 0)
}

pub(crate) fn at_mod_revision(full: &[u8], revision: i64) -> Compare {
    Compare::mod_revision(full.to_vec(), CompareOp::Equal, revision)
}

/// The first key after every key that starts with `prefix` (etcd's range end for a prefix).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte is 0xff (or the prefix is empty): to the end of the keyspace.
    vec![0]
}

/// gRPC codes by which etcd itself, not the network, refused a request.
fn is_server_refusal(code: tonic::Code) -> bool {
    use tonic::Code as C;
    matches!(
        code,
        C::InvalidArgument
            | C::NotFound
            | C::AlreadyExists
            | C::PermissionDenied
            | C::FailedPrecondition
            | C::OutOfRange
            | C::ResourceExhausted
            | C::Unauthenticated
    )
}

fn is_too_large(e: &AttemptError) -> bool {
    let text = e.to_string();
    text.contains("message length too large") || text.contains("message too large")
}

fn is_compacted(e: &AttemptError) -> bool {
    e.to_string()
        .contains("required revision has been compacted")
}

fn lease_error(e: EtcdError, lease: Option<LeaseId>) -> EtcdError {
    match (&e, lease) {
        (EtcdError::Request { source, .. }, Some(lease))
            if source.to_string().contains("requested lease not found") =>
        {
            EtcdError::LeaseNotFound { id: lease.0 }
        }
        _ => e,
    }
}

pub(crate) fn describe_error(e: &etcd_client::Error) -> String {
    describe(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_key_after_the_prefix() {
        assert_eq!(prefix_end(b"/probity/"), b"/probity0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), [0]);
        assert_eq!(prefix_end(b""), [0]);
    }
}
