//! Probity's cluster state in etcd v3.
//!
//! Why this crate exists: DESIGN.md's "one truth per cluster" puts the shared state in etcd:
//! the node blocklist, the manifest registry (versions only go up), the facts node agents
//! publish under a lease per node, key metadata, and the policy-set digest each process
//! serves. Every Probity process watches the prefixes it needs and applies the changes in
//! order. The crate has two layers: the etcd client (everything but [`backend`], which
//! knows nothing of the engine), and [`EtcdState`], the engine's
//! [`probity::state::SharedState`] built on it.
//!
//! What it promises, call by call:
//!
//! | call | contract |
//! | --- | --- |
//! | [`EtcdClient::get`], [`EtcdClient::list`] | linearizable reads; a listing is paged ([`EtcdConfig::page_size`]) yet one snapshot at one revision |
//! | [`EtcdClient::put`], [`EtcdClient::put_batch`], [`EtcdClient::delete`] | the revision of the write; retried on another member after a transient failure |
//! | [`EtcdClient::create`], [`EtcdClient::update_if`], [`EtcdClient::delete_if`] | one transaction; [`Swap::Refused`] carries the key as it is; a failure that may have applied the write is [`EtcdError::OutcomeUnknown`], never retried blindly |
//! | [`EtcdClient::put_versioned`] | the stored `version` never goes down; one winner per contested version; typed [`VersionedError::Rollback`] / [`VersionedError::Conflict`] refusals |
//! | [`EtcdClient::grant_lease`], [`EtcdClient::keep_alive`], [`EtcdClient::revoke_lease`], [`EtcdClient::put_with_lease`] | keys that vanish when their owner stops renewing |
//! | [`EtcdClient::watch_prefix`] | events in revision order, once each, across reconnects; [`WatchMessage::Compacted`] when history is gone |
//! | [`EtcdClient::watch_with_resync`] | a [`WatchHandler`] whose state always converges to etcd's, through compactions and outages |
//! | [`EtcdClient::health`], [`WatchStatus`] | connected or not, and how long since etcd last answered |
//! | [`EtcdState`] | the engine's state backend: blocklist, registry, key metadata, node facts and served digests in etcd, changes followed in order, read-your-writes for blocks (see [`backend`]) |
//!
//! Keys are strings relative to [`EtcdConfig::prefix`] (default `/probity/`): `put("blocklist/n7", ..)`
//! writes `/probity/blocklist/n7`.
//!
//! Tested against etcd 3.4 (Debian's etcd-server), which the bundled protocol files (etcd
//! 3.7) talk to as long as no 3.5+ call is used: this crate uses none (no streaming range,
//! no downgrade, no storage-version fields).
//!
//! ```no_run
//! use probity_etcd::{EtcdClient, EtcdConfig};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = EtcdClient::connect(EtcdConfig::new(["http://127.0.0.1:2379"])).await?;
//! client.put("blocklist/node-7", br#"{"reason":"checkpoint tampered"}"#.to_vec()).await?;
//! let listing = client.list("blocklist/").await?;
//! println!("{} blocked nodes at revision {}", listing.entries.len(), listing.revision);
//! # Ok(()) }
//! ```

pub mod backend;
mod cas;
mod client;
mod config;
mod error;
mod health;
mod key;
mod lease;
mod watch;

pub use backend::{
    BackendError, CHANGES_CAPACITY, DEFAULT_OUTBOX_RETRY, DEFAULT_PROCESS_TTL,
    DEFAULT_READ_YOUR_WRITES, EtcdState, EtcdStateOptions, Role,
};
pub use cas::{
    MAX_VERSIONED_LEN, MAX_VERSIONED_ROUNDS, Swap, VersionHead, VersionHeadError, VersionedError,
    VersionedWrite,
};
pub use client::{Deleted, DeletedPrefix, Entry, EtcdClient, Listing, MAX_TXN_OPS, MemberStatus};
pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_PAGE_SIZE, DEFAULT_PREFIX, DEFAULT_PROGRESS_INTERVAL, DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_RETRY_BUDGET, EtcdConfig, MAX_PAGE_SIZE, TlsConfig,
};
pub use error::{AttemptError, EndpointFailure, EtcdError, Operation};
pub use health::Health;
pub use key::{KeyError, Keyspace, MAX_KEY_LEN};
pub use lease::{KeepAlive, Lease, LeaseId, LeaseState};
pub use watch::{
    DEFAULT_RESYNC_AFTER_DISCONNECT, ResyncOptions, ResyncWatch, Snapshot, SyncReason, WatchEvent,
    WatchHandler, WatchMessage, WatchStatus, WatchStream,
};
