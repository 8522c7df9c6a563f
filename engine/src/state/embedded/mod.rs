//! [`StateStore`]: the state on one machine, in a redb database under the state
//! directory, which recovers by itself from I/O errors (a full disk).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

use redb::{Database, ReadableDatabase as _, ReadableTable as _, TableDefinition};
use serde::Serialize;

use super::*;
use crate::audit::CheckpointPolicy;
use crate::block::BlockRecord;
use crate::clock::{Clock, SystemClock};
use crate::trust::{self, Material};

mod actions;
mod backend;
mod codec;
mod logs;
#[cfg(test)]
mod tests;

pub(in crate::state) use codec::check_against;
use codec::*;
pub(crate) use codec::{decode_event, encode_event};

/// Object id -> registry record (version, digest, signed manifest).
const MANIFESTS: TableDefinition<&str, &[u8]> = TableDefinition::new("manifests");
/// Node id -> blocklist record (time, reason).
const BLOCKLIST: TableDefinition<&str, &[u8]> = TableDefinition::new("blocklist");
/// Node id -> the revision of its last unblock (see [`StateStore::unblock_node`]).
const TOMBSTONES: TableDefinition<&str, u64> = TableDefinition::new("tombstones");
/// [`META`]'s key of the last revision given to a block or an unblock.
const BLOCK_REVISION: &str = "blocklist.revision";
/// Sequence number -> event record.
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// Decision log: sequence number -> the record as JSON ([`DecisionRecord`]).
const DECISIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("decisions");
/// Key metadata: key id -> revision (8 bytes, big endian) then the record's bytes.
const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
/// Node facts: node id -> [`NodeFacts`] as JSON.
const FACTS: TableDefinition<&str, &[u8]> = TableDefinition::new("facts");
/// Served policy digests: process name -> [`ServedDigest`] as JSON.
const DIGESTS: TableDefinition<&str, &[u8]> = TableDefinition::new("digests");
/// Counters that must survive pruning: the decision log's next sequence number, its
/// bytes, where pruning stopped.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Each log's chain: log name -> [`ChainState`] (its head, last record, records not yet
/// checkpointed, time of the last checkpoint).
const CHAIN: TableDefinition<&str, &[u8]> = TableDefinition::new("chain");
/// Checkpoints (signed tree heads): (log name, the last record covered) -> the rest of
/// the [`Checkpoint`].
const CHECKPOINTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("checkpoints");
/// Facts of admitted objects (pods, Slurm jobs), by `namespace/name`: JSON
/// [`AdmittedFacts`] with the lifetime each was remembered with (`StoredAdmitted`).
const ADMITTED: TableDefinition<&str, &[u8]> = TableDefinition::new("admitted");
/// Action requests (`migrate`), by [`ActionRequest::key`]: JSON [`ActionRequest`].
const ACTIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("actions");

/// The durable state store under a state directory.
///
/// An I/O error (a full disk, say) leaves redb refusing every later operation until the
/// database is closed and opened again, so the store does that itself: the failure is
/// kept ([`StateStore::storage_health`]), and the next operation at least
/// [`StateStore::RECOVERY_INTERVAL`] later reopens the file, which redb brings back to its last
/// durable commit (the chains' heads included: a failed commit changed nothing). The
/// failure clears with the first write that commits.
#[derive(Debug)]
pub struct StateStore {
    /// `None` while a reopen failed; every operation then fails until one succeeds.
    db: RwLock<Option<Database>>,
    health: Mutex<Health>,
    path: PathBuf,
    created: bool,
    checkpoints: RwLock<CheckpointPolicy>,
    /// Why the last checkpoint could not be signed (cleared by the next that is).
    checkpoint_failure: Mutex<Option<String>>,
    /// The time of records, failures and admitted facts.
    clock: Arc<dyn Clock>,
}

/// How often a failing store tries again: reopening its database, or (when it is open)
/// a probe write to learn whether the disk takes writes again.
pub(crate) const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// Why the state store cannot write, and since when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StorageFailure {
    /// The database file.
    pub path: PathBuf,
    /// What was being done when the store first failed.
    pub operation: &'static str,
    /// The latest error, with its causes (`No space left on device`, say).
    pub detail: String,
    /// When the store began failing, in milliseconds since the Unix epoch.
    pub since_unix_ms: u64,
}

/// The state store's health: whether it writes, and its failure and recovery counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StorageHealth {
    /// Why writes fail now; `None` while the last write committed.
    pub failure: Option<StorageFailure>,
    /// Operations that failed with an I/O error since the store was opened.
    pub failures_total: u64,
    /// Times the store went from failing back to writing.
    pub recoveries_total: u64,
}

#[derive(Debug, Default)]
struct Health {
    failure: Option<StorageFailure>,
    /// redb refuses every operation after an I/O error until it is reopened.
    reopen: bool,
    last_reopen: Option<std::time::Instant>,
    last_probe: Option<std::time::Instant>,
    failures_total: u64,
    recoveries_total: u64,
}

fn due(last: Option<std::time::Instant>) -> bool {
    last.is_none_or(|t| t.elapsed() >= RECOVERY_INTERVAL)
}

/// Whether `e` came from the disk (and leaves redb wanting a reopen).
fn is_io(e: &redb::Error) -> bool {
    matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo)
}

/// Where a log's chain stands, kept in [`CHAIN`] and updated in the transaction that
/// appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChainState {
    /// The last record's hash ([`GENESIS`] before the first).
    head: crate::integrity::Hash,
    /// The last record's sequence number.
    last: Option<u64>,
    /// Records since the last checkpoint.
    unchecked: u64,
    /// When the last checkpoint was made (or the chain started), in Unix milliseconds.
    last_checkpoint_ms: u64,
}

impl ChainState {
    fn encode(&self) -> [u8; 56] {
        let mut v = [0u8; 56];
        let last = self.last.map_or(0, |l| l.saturating_add(1));
        for (dst, src) in v.iter_mut().zip(
            self.head
                .iter()
                .chain(&last.to_be_bytes())
                .chain(&self.unchecked.to_be_bytes())
                .chain(&self.last_checkpoint_ms.to_be_bytes()),
        ) {
            *dst = *src;
        }
        v
    }

    fn decode(raw: &[u8]) -> Option<Self> {
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(
                raw.get(at..at.checked_add(8)?)?.try_into().ok()?,
            ))
        };
        let last = word(32)?;
        Some(Self {
            head: raw.get(..32)?.try_into().ok()?,
            last: last.checked_sub(1),
            unchecked: word(40)?,
            last_checkpoint_ms: word(48)?,
        })
    }
}

impl StateStore {
    /// How often a store whose disk failed retries (see [`StorageHealth`]).
    pub const RECOVERY_INTERVAL: Duration = RECOVERY_INTERVAL;
    /// The store's file in its directory.
    pub const FILE: &str = super::STATE_FILE;

    /// Opens (creating if needed) the store in directory `dir` (file [`StateStore::FILE`]).
    ///
    /// A new directory is created 0700 and a new database file 0600, whatever the umask.
    /// An existing database file is refused if group or others may write it, or if it
    /// belongs to another user than this one or root (symlinks followed; see
    /// `probity_base::trust`); so is a directory others can write. Whether this call created
    /// the database ([`StateStore::is_new`]) tells a caller that the registry remembers
    /// no version: see [`crate::integrity::RollbackMemory::restore`].
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        Self::open_with_clock(dir, Arc::new(SystemClock))
    }

    /// [`StateStore::open`], with `clock` for the times the store writes (the logs'
    /// records, failures, admitted facts' ages): an engine's store takes the engine's
    /// clock, so a replay or a test sees one time.
    pub fn open_with_clock(dir: &Path, clock: Arc<dyn Clock>) -> Result<Self, StateError> {
        trust::create_private_dir(dir)?;
        let path = dir.join(STATE_FILE);
        let created = match trust::create_private_file(&path) {
            Ok(_) => true,
            Err(e) if e.already_exists() => {
                trust::check_file(&path, Material::Registry)?;
                false
            }
            Err(e) => return Err(e.into()),
        };
        // redb initializes an empty file in place, keeping the mode it was created with.
        let db = Database::create(&path).map_err(|e| StateError::Database {
            path: path.clone(),
            operation: "opening",
            source: Box::new(e),
        })?;
        let store = Self {
            db: RwLock::new(Some(db)),
            health: Mutex::new(Health::default()),
            path,
            created,
            checkpoints: RwLock::new(CheckpointPolicy::default()),
            checkpoint_failure: Mutex::new(None),
            clock,
        };
        // Create the tables so that read transactions find them.
        store.write("creating tables", |txn| {
            txn.open_table(MANIFESTS)?;
            txn.open_table(BLOCKLIST)?;
            txn.open_table(EVENTS)?;
            txn.open_table(DECISIONS)?;
            txn.open_table(KEYS)?;
            txn.open_table(FACTS)?;
            txn.open_table(DIGESTS)?;
            txn.open_table(META)?;
            txn.open_table(CHAIN)?;
            txn.open_table(CHECKPOINTS)?;
            txn.open_table(ADMITTED)?;
            txn.open_table(TOMBSTONES)?;
            txn.open_table(ACTIONS)?;
            Ok(())
        })?;
        Ok(store)
    }

    /// The store's time in Unix seconds (its clock's, never before the epoch).
    pub(super) fn now_unix(&self) -> u64 {
        u64::try_from(self.clock.now_unix()).unwrap_or(0)
    }

    /// The store's time in Unix milliseconds.
    pub(super) fn now_unix_ms(&self) -> u64 {
        self.clock.now_unix_ms()
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether [`StateStore::open`] created the database: its registry then remembers no
    /// accepted version, and rollback protection restarts from zero unless it is rebuilt
    /// ([`crate::integrity::RollbackMemory::restore`]).
    pub fn is_new(&self) -> bool {
        self.created
    }

    fn db_err(&self, operation: &'static str) -> impl FnOnce(redb::Error) -> StateError + '_ {
        move |e| StateError::Database {
            path: self.path.clone(),
            operation,
            source: Box::new(e),
        }
    }

    /// Runs `f` in a write transaction committed durably before returning. A commit
    /// clears the store's failure; an I/O error sets it.
    fn write<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StateError> {
        let out = self.with_db(operation, |db| {
            let txn = db.begin_write()?;
            let out = f(&txn)?;
            txn.commit()?;
            Ok(out)
        })?;
        self.note_commit();
        Ok(out)
    }

    /// Runs `f` in a read transaction.
    fn read<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StateError> {
        self.with_db(operation, |db| f(&db.begin_read()?))
    }

    /// Runs `f` on the open database, reopening it first if an I/O error left it
    /// refusing and a reopen is due.
    fn with_db<T>(
        &self,
        operation: &'static str,
        f: impl FnOnce(&Database) -> Result<T, redb::Error>,
    ) -> Result<T, StateError> {
        self.reopen_if_due();
        let db = self.db.read().unwrap_or_else(PoisonError::into_inner);
        let Some(open) = db.as_ref() else {
            let detail = self
                .lock_health()
                .failure
                .as_ref()
                .map(|f| f.detail.clone())
                .unwrap_or_default();
            return Err(StateError::Database {
                path: self.path.clone(),
                operation,
                source: format!("the database is closed after an I/O error ({detail}); it is opened again every {RECOVERY_INTERVAL:?}").into(),
            });
        };
        f(open).map_err(|e| {
            if is_io(&e) {
                self.note_failure(operation, &e);
            }
            self.db_err(operation)(e)
        })
    }

    fn lock_health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn note_failure(&self, operation: &'static str, e: &redb::Error) {
        let detail = crate::diagnostic::join_chain(e.to_string(), std::error::Error::source(e));
        let mut h = self.lock_health();
        h.failures_total = h.failures_total.saturating_add(1);
        h.reopen = true;
        match &mut h.failure {
            Some(f) => f.detail = detail,
            None => {
                h.failure = Some(StorageFailure {
                    path: self.path.clone(),
                    operation,
                    detail,
                    since_unix_ms: self.now_unix_ms(),
                });
            }
        }
    }

    fn note_commit(&self) {
        let mut h = self.lock_health();
        if h.failure.take().is_some() {
            h.recoveries_total = h.recoveries_total.saturating_add(1);
        }
    }

    /// Closes and opens the database again if an I/O error asked for it and the last
    /// attempt is [`StateStore::RECOVERY_INTERVAL`] old. redb brings the file back to its last
    /// durable commit.
    fn reopen_if_due(&self) {
        {
            let mut h = self.lock_health();
            if !h.reopen || !due(h.last_reopen) {
                return;
            }
            h.last_reopen = Some(std::time::Instant::now());
        }
        let mut db = self.db.write().unwrap_or_else(PoisonError::into_inner);
        // The old handle holds the file's lock: it must be gone before the new open.
        drop(db.take());
        match Database::create(&self.path) {
            Ok(open) => {
                *db = Some(open);
                self.lock_health().reopen = false;
            }
            Err(e) => {
                let e = redb::Error::from(e);
                let detail =
                    crate::diagnostic::join_chain(e.to_string(), std::error::Error::source(&e));
                let mut h = self.lock_health();
                h.failures_total = h.failures_total.saturating_add(1);
                if let Some(f) = &mut h.failure {
                    f.detail = detail;
                }
            }
        }
    }

    /// Whether the store writes. While it fails, this call itself tries to recover
    /// (at most every [`StateStore::RECOVERY_INTERVAL`]): it reopens the database if need be, then
    /// probes with a small write, whose commit clears the failure. Readiness checks
    /// call it, so a store recovers when the disk does, with or without traffic.
    pub fn storage_health(&self) -> StorageHealth {
        self.reopen_if_due();
        let probe = {
            let mut h = self.lock_health();
            let probe = h.failure.is_some() && !h.reopen && due(h.last_probe);
            if probe {
                h.last_probe = Some(std::time::Instant::now());
            }
            probe
        };
        if probe {
            let now = self.now_unix_ms();
            // Its failure is kept in the health this returns.
            let _ = self.write("probing whether the disk takes writes", |txn| {
                txn.open_table(META)?.insert("health.probe_ms", now)?;
                Ok(())
            });
        }
        let h = self.lock_health();
        StorageHealth {
            failure: h.failure.clone(),
            failures_total: h.failures_total,
            recoveries_total: h.recoveries_total,
        }
    }

    fn corrupt(&self, table: &'static str, key: &str) -> StateError {
        StateError::Corrupt {
            path: self.path.clone(),
            table,
            key: key.to_owned(),
        }
    }

    /// The registry entry of `object_id`, if any version was accepted.
    pub fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Option<Vec<u8>>, redb::Error> {
            let table = txn.open_table(MANIFESTS)?;
            Ok(table.get(object_id)?.map(|g| g.value().to_vec()))
        };
        match self.read("reading the registry", read)? {
            None => Ok(None),
            Some(raw) => decode_entry(&raw)
                .map(Some)
                .ok_or_else(|| self.corrupt("manifests", object_id)),
        }
    }

    /// Checks, without changing anything, that `version` with `digest` may be accepted.
    pub fn check_version(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError> {
        match self.registry_entry(object_id)? {
            Some(entry) => check_against(object_id, version, digest, &entry),
            None => Ok(()),
        }
    }

    /// Records `version` as accepted for `object_id`, atomically refusing a rollback or a
    /// different digest for the accepted version. Accepting the same version and digest again
    /// is a no-op.
    pub fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError> {
        // Ok(Some(refusal)) refuses, Ok(None) with `changed` false leaves the store as is.
        let mut changed = false;
        let outcome = self.with_db("accepting a manifest", |db| {
            let txn = db.begin_write()?;
            let outcome = (|| -> Result<Option<StateError>, redb::Error> {
                let mut table = txn.open_table(MANIFESTS)?;
                let existing = table.get(object_id)?.map(|g| g.value().to_vec());
                if let Some(raw) = existing {
                    let Some(entry) = decode_entry(&raw) else {
                        return Ok(Some(self.corrupt("manifests", object_id)));
                    };
                    if let Err(refusal) = check_against(object_id, version, digest, &entry) {
                        return Ok(Some(refusal));
                    }
                    if entry.version == version {
                        return Ok(None);
                    }
                }
                let record = encode_entry(version, digest, signed_manifest);
                table.insert(object_id, record.as_slice())?;
                changed = true;
                Ok(None)
            })()?;
            if outcome.is_none() && changed {
                txn.commit()?;
            } else {
                // Nothing to write (or refused): no commit, no fsync.
                let _ = txn.abort();
            }
            Ok(outcome)
        })?;
        match outcome {
            None => {
                if changed {
                    self.note_commit();
                }
                Ok(())
            }
            Some(refusal) => Err(refusal),
        }
    }

    /// Stores `node`'s block record (the engine computes it) and returns its revision:
    /// the one it already has while the node stays blocked, else the next of the
    /// store's counter, which blocks and unblocks share, so a block made after an
    /// unblock is always numbered after that unblock's tombstone.
    pub fn put_block(&self, node: &str, record: &BlockRecord) -> Result<u64, StateError> {
        let mut record = record.clone();
        let path = self.path.clone();
        self.write("blocking a node", |txn| {
            let mut table = txn.open_table(BLOCKLIST)?;
            let kept = table
                .get(node)?
                .and_then(|g| decode_block(node, g.value()))
                .and_then(|b| b.record.revision);
            let revision = match kept {
                Some(revision) => revision,
                None => {
                    // Numbered above the node's tombstone, which has nothing left to
                    // tell apart: dropped, so tombstones stay one per unblocked node.
                    txn.open_table(TOMBSTONES)?.remove(node)?;
                    next_block_revision(txn)?
                }
            };
            record.revision = Some(revision);
            let encoded = serde_json::to_vec(&record).map_err(|e| {
                redb::Error::Io(std::io::Error::other(format!(
                    "encoding a block record for {}: {e}",
                    path.display()
                )))
            })?;
            table.insert(node, encoded.as_slice())?;
            Ok(revision)
        })
    }

    /// Unblocks `node`; returns whether it was blocked. An unblock leaves a tombstone,
    /// the next revision of the store's counter, which no earlier block record passes.
    pub fn unblock_node(&self, node: &str) -> Result<bool, StateError> {
        self.write("unblocking a node", |txn| {
            let existed = txn.open_table(BLOCKLIST)?.remove(node)?.is_some();
            if existed {
                let revision = next_block_revision(txn)?;
                txn.open_table(TOMBSTONES)?.insert(node, revision)?;
            }
            Ok(existed)
        })
    }

    /// Per node, the revision of its last unblock.
    pub fn block_tombstones(&self) -> Result<BTreeMap<String, u64>, StateError> {
        self.read("reading the blocklist's tombstones", |txn| {
            let table = txn.open_table(TOMBSTONES)?;
            let mut out = BTreeMap::new();
            for row in table.iter()? {
                let (k, v) = row?;
                out.insert(k.value().to_owned(), v.value());
            }
            Ok(out)
        })
    }

    /// The block record of `node`, if blocked.
    pub fn blocked(&self, node: &str) -> Result<Option<BlockedNode>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Option<Vec<u8>>, redb::Error> {
            let table = txn.open_table(BLOCKLIST)?;
            Ok(table.get(node)?.map(|g| g.value().to_vec()))
        };
        match self.read("reading the blocklist", read)? {
            None => Ok(None),
            Some(raw) => decode_block(node, &raw)
                .map(Some)
                .ok_or_else(|| self.corrupt("blocklist", node)),
        }
    }

    /// All blocked nodes, by node id.
    pub fn blocked_nodes(&self) -> Result<Vec<BlockedNode>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(String, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(BLOCKLIST)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                out.push((k.value().to_owned(), v.value().to_vec()));
            }
            Ok(out)
        };
        self.read("reading the blocklist", read)?
            .into_iter()
            .map(|(node, raw)| {
                decode_block(&node, &raw).ok_or_else(|| self.corrupt("blocklist", &node))
            })
            .collect()
    }
}

/// The next revision of the blocklist's counter, stored in the same transaction.
fn next_block_revision(txn: &redb::WriteTransaction) -> Result<u64, redb::Error> {
    let mut meta = txn.open_table(META)?;
    let next = meta
        .get(BLOCK_REVISION)?
        .map_or(0, |g| g.value())
        .saturating_add(1);
    meta.insert(BLOCK_REVISION, next)?;
    Ok(next)
}

impl StateStore {
    fn encode<T: Serialize>(
        &self,
        operation: &'static str,
        value: &T,
    ) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(value).map_err(|e| StateError::Database {
            path: self.path.clone(),
            operation,
            source: Box::new(e),
        })
    }

    fn keys_of(
        &self,
        table: TableDefinition<&str, &[u8]>,
        operation: &'static str,
    ) -> Result<Vec<String>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<String>, redb::Error> {
            let table = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, _) = row?;
                out.push(k.value().to_owned());
            }
            Ok(out)
        };
        self.read(operation, read)
    }

    fn values_of<T: serde::de::DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        name: &'static str,
        operation: &'static str,
    ) -> Result<Vec<T>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(String, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                out.push((k.value().to_owned(), v.value().to_vec()));
            }
            Ok(out)
        };
        self.read(operation, read)?
            .into_iter()
            .map(|(k, raw)| serde_json::from_slice(&raw).map_err(|_| self.corrupt(name, &k)))
            .collect()
    }
}
