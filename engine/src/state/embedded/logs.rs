//! The event and decision logs of the embedded store: hash-chained appends, reads,
//! pruning and checkpoints.

use redb::{ReadableTable as _, ReadableTableMetadata as _, TableDefinition};

use crate::audit::{self, Checkpoint, CheckpointPolicy, GENESIS, Log};

use super::*;

impl StateStore {
    /// Appends an integrity failure to the event log, durably; returns its sequence number.
    pub fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError> {
        let time = self.now_unix();
        let now_ms = self.now_unix_ms();
        let record = encode_event(time, object_id, node, kind, detail);
        self.write("appending an event", |txn| {
            let mut table = txn.open_table(EVENTS)?;
            let chained = self.chain_state(txn, Log::Events, now_ms)?.last;
            let held = table.last()?.map(|(k, _)| k.value());
            // The chain remembers the last number even if the table lost it.
            let seq = next_seq(held.max(chained), 1)?;
            self.append_chained(
                txn,
                Log::Events,
                &mut table,
                seq,
                std::slice::from_ref(&record),
                now_ms,
            )?;
            Ok(seq)
        })
    }

    /// Appends decision records in one durable transaction (a group commit); returns
    /// the sequence number given to the first. Each record's `seq` is set on the way.
    pub fn record_decisions(&self, records: &mut [DecisionRecord]) -> Result<u64, StateError> {
        // The sequence number is the key, not part of the stored JSON.
        let encoded = records
            .iter()
            .map(serde_json::to_vec)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StateError::Database {
                path: self.path.clone(),
                operation: "encoding decision records",
                source: Box::new(e),
            })?;
        let now_ms = self.now_unix_ms();
        let first = self.write("appending decision records", |txn| {
            let mut table = txn.open_table(DECISIONS)?;
            let mut meta = txn.open_table(META)?;
            // The counter survives pruning, so sequence numbers never repeat.
            let after_last = next_seq(table.last()?.map(|(k, _)| k.value()), encoded.len())?;
            let counted = meta.get("decisions.next")?.map(|g| g.value()).unwrap_or(0);
            let first = after_last.max(counted);
            let end = first
                .checked_add(encoded.len() as u64)
                .ok_or_else(exhausted)?;
            // Hashed here, in the group commit, not per request.
            let added =
                self.append_chained(txn, Log::Decisions, &mut table, first, &encoded, now_ms)?;
            let bytes = meta.get("decisions.bytes")?.map(|g| g.value()).unwrap_or(0);
            meta.insert("decisions.bytes", bytes.saturating_add(added))?;
            meta.insert("decisions.next", end)?;
            Ok(first)
        })?;
        for (seq, record) in (first..).zip(records.iter_mut()) {
            record.seq = seq;
        }
        Ok(first)
    }

    /// How much the decision log holds.
    pub fn decision_log_usage(&self) -> Result<LogUsage, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<LogUsage, redb::Error> {
            let table = txn.open_table(DECISIONS)?;
            let meta = txn.open_table(META)?;
            let first = table.first()?.map(|(k, _)| k.value());
            let last = table.last()?.map(|(k, _)| k.value());
            let counted = meta.get("decisions.next")?.map(|g| g.value()).unwrap_or(0);
            let next = last.map_or(0, |l| l + 1).max(counted);
            Ok(LogUsage {
                records: table.len()?,
                bytes: meta.get("decisions.bytes")?.map(|g| g.value()).unwrap_or(0),
                first: first.unwrap_or(next),
                next,
            })
        };
        self.read("measuring the decision log", read)
    }

    /// Prunes the oldest records up to a checkpoint, one checkpoint span at a time, while
    /// the log is over `max_bytes` or the span's last record is older than
    /// `max_age_seconds`; never a record at or after `keep_from`, and never a span that no
    /// checkpoint ends (the first kept record chains from the checkpoint it was cut at, so
    /// [`crate::audit::verify`] still passes). Checkpoints older than the cut go with it.
    /// Returns the records pruned. `now_ms` is the judge of age.
    pub fn prune_decisions(&self, retention: &Retention, now_ms: u64) -> Result<u64, StateError> {
        let mut pruned = 0u64;
        loop {
            let usage = self.decision_log_usage()?;
            if usage.records == 0 {
                return Ok(pruned);
            }
            // The first checkpoint at or after the first record held.
            let Some(cut) = self
                .raw_checkpoints_from(Log::Decisions, usage.first, 1)?
                .first()
                .map(|(seq, _)| *seq)
            else {
                return Ok(pruned);
            };
            if cut >= retention.keep_from || cut >= usage.next {
                return Ok(pruned);
            }
            let newest_ms = self
                .decisions(cut, 1)?
                .first()
                .filter(|r| r.seq == cut)
                .map(|r| r.time_unix_ms);
            let too_old = newest_ms.is_some_and(|t| {
                now_ms.saturating_sub(t) > retention.max_age_seconds.saturating_mul(1000)
            });
            if usage.bytes <= retention.max_bytes && !too_old {
                return Ok(pruned);
            }
            let removed = self.write("pruning the decision log", |txn| {
                let mut table = txn.open_table(DECISIONS)?;
                let mut meta = txn.open_table(META)?;
                let mut bytes = 0u64;
                let mut count = 0u64;
                let seqs: Vec<u64> = table
                    .range(usage.first..=cut)?
                    .map(|row| row.map(|(k, _)| k.value()))
                    .collect::<Result<_, _>>()?;
                for seq in seqs {
                    if let Some(v) = table.remove(seq)? {
                        bytes += v.value().len() as u64;
                        count += 1;
                    }
                }
                // Older checkpoints vouch for records no longer held.
                let mut checkpoints = txn.open_table(CHECKPOINTS)?;
                let name = Log::Decisions.name();
                let older: Vec<u64> = checkpoints
                    .range((name, 0)..(name, cut))?
                    .map(|row| row.map(|(k, _)| k.value().1))
                    .collect::<Result<_, _>>()?;
                for seq in older {
                    checkpoints.remove((name, seq))?;
                }
                let held = meta.get("decisions.bytes")?.map(|g| g.value()).unwrap_or(0);
                meta.insert("decisions.bytes", held.saturating_sub(bytes))?;
                meta.insert("decisions.next", usage.next)?;
                Ok(count)
            })?;
            if removed == 0 {
                return Ok(pruned);
            }
            pruned += removed;
        }
    }

    /// Up to `limit` decision records with sequence number `from` or later, in order.
    pub fn decisions(&self, from: u64, limit: usize) -> Result<Vec<DecisionRecord>, StateError> {
        self.read_log(DECISIONS, from, limit, "reading decision records")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::body_of(&raw)
                    .and_then(|body| serde_json::from_slice::<DecisionRecord>(body).ok())
                    .map(|r| DecisionRecord { seq, ..r })
                    .ok_or_else(|| self.corrupt("decisions", &seq.to_string()))
            })
            .collect()
    }

    /// Up to `limit` decision records from sequence number `from`, each with its place in
    /// the chain (for forwarding).
    pub fn chained_decisions(
        &self,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(DecisionRecord, audit::ChainLink)>, StateError> {
        self.read_log(DECISIONS, from, limit, "reading decision records")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::ChainLink::of(seq, &raw)
                    .and_then(|(link, body)| {
                        serde_json::from_slice::<DecisionRecord>(body)
                            .ok()
                            .map(|r| (DecisionRecord { seq, ..r }, link))
                    })
                    .ok_or_else(|| self.corrupt("decisions", &seq.to_string()))
            })
            .collect()
    }

    /// Up to `limit` events from sequence number `from`, each with its place in the
    /// chain (for forwarding).
    pub fn chained_events(
        &self,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(Event, audit::ChainLink)>, StateError> {
        self.read_log(EVENTS, from, limit, "reading events")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::ChainLink::of(seq, &raw)
                    .and_then(|(link, body)| decode_event(seq, body).map(|e| (e, link)))
                    .ok_or_else(|| self.corrupt("events", &seq.to_string()))
            })
            .collect()
    }

    /// All events with sequence number `from` or later, in order.
    pub fn events(&self, from: u64) -> Result<Vec<Event>, StateError> {
        self.read_log(EVENTS, from, usize::MAX, "reading events")?
            .into_iter()
            .map(|(seq, raw)| {
                audit::body_of(&raw)
                    .and_then(|body| decode_event(seq, body))
                    .ok_or_else(|| self.corrupt("events", &seq.to_string()))
            })
            .collect()
    }

    /// Sets when checkpoints are made and who signs them (the default: every
    /// [`audit::CheckpointPolicy::DEFAULT_RECORDS`] records or
    /// [`audit::CheckpointPolicy::DEFAULT_INTERVAL`], unsigned). Takes effect at the next append.
    pub fn set_checkpoint_policy(&self, policy: CheckpointPolicy) {
        match self.checkpoints.write() {
            Ok(mut p) => *p = policy,
            Err(poisoned) => *poisoned.into_inner() = policy,
        }
    }

    /// The checkpoint policy in force.
    pub fn checkpoint_policy(&self) -> CheckpointPolicy {
        match self.checkpoints.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Why the last checkpoint could not be signed, if it could not (the records were
    /// kept; the checkpoint is retried at the next append or tick).
    pub fn checkpoint_failure(&self) -> Option<String> {
        match self.checkpoint_failure.lock() {
            Ok(f) => f.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub(super) fn set_checkpoint_failure(&self, failure: Option<String>) {
        match self.checkpoint_failure.lock() {
            Ok(mut f) => *f = failure,
            Err(poisoned) => *poisoned.into_inner() = failure,
        }
    }

    /// Every checkpoint of `log`, oldest first.
    pub fn checkpoints(&self, log: Log) -> Result<Vec<Checkpoint>, StateError> {
        self.raw_checkpoints(log)?
            .into_iter()
            .map(|(seq, raw)| {
                Checkpoint::decode(log, seq, &raw)
                    .ok_or_else(|| self.corrupt("checkpoints", &format!("{log}/{seq}")))
            })
            .collect()
    }

    /// Checkpoints the logs whose records waited [`CheckpointPolicy::every`] (with
    /// `force`: every log with records not yet checkpointed); the checkpoints made. Writes
    /// nothing when none is due.
    pub fn checkpoint(&self, force: bool) -> Result<Vec<Checkpoint>, StateError> {
        let now_ms = self.now_unix_ms();
        let policy = self.checkpoint_policy();
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<Option<ChainState>>, redb::Error> {
            let table = txn.open_table(CHAIN)?;
            Log::ALL
                .iter()
                .map(|log| {
                    Ok(table
                        .get(log.name())?
                        .and_then(|g| ChainState::decode(g.value())))
                })
                .collect()
        };
        let states = self.read("reading the chains", read)?;
        let due = states.iter().flatten().any(|c| {
            if force {
                c.unchecked > 0
            } else {
                policy.due(c.unchecked, now_ms.saturating_sub(c.last_checkpoint_ms))
            }
        });
        if !due {
            return Ok(Vec::new());
        }
        self.write("checkpointing the logs", |txn| {
            let mut made = Vec::new();
            for log in Log::ALL {
                let mut chain = self.chain_state(txn, log, now_ms)?;
                if let Some(cp) = self.checkpoint_in(txn, log, &mut chain, now_ms, force)? {
                    txn.open_table(CHAIN)?
                        .insert(log.name(), chain.encode().as_slice())?;
                    made.push(cp);
                }
            }
            Ok(made)
        })
    }

    /// The chain state of `log` in a write transaction (a new chain starts now).
    pub(super) fn chain_state(
        &self,
        txn: &redb::WriteTransaction,
        log: Log,
        now_ms: u64,
    ) -> Result<ChainState, redb::Error> {
        let table = txn.open_table(CHAIN)?;
        match table.get(log.name())? {
            None => Ok(ChainState {
                head: GENESIS,
                last: None,
                unchecked: 0,
                last_checkpoint_ms: now_ms,
            }),
            Some(g) => ChainState::decode(g.value()).ok_or_else(|| {
                redb::Error::Corrupted(format!("the chain state of the {log} log is malformed"))
            }),
        }
    }

    /// Appends `bodies` to `log` from sequence number `first`, each chained to the one
    /// before, and checkpoints if one is due; the bytes stored.
    pub(super) fn append_chained(
        &self,
        txn: &redb::WriteTransaction,
        log: Log,
        table: &mut redb::Table<u64, &[u8]>,
        first: u64,
        bodies: &[Vec<u8>],
        now_ms: u64,
    ) -> Result<u64, redb::Error> {
        let mut chain = self.chain_state(txn, log, now_ms)?;
        let mut stored = 0u64;
        for (seq, body) in (first..).zip(bodies) {
            let hash = audit::record_hash(log, seq, &chain.head, body);
            let value = audit::encode_link(seq, &chain.head, &hash, body);
            stored = stored.saturating_add(value.len() as u64);
            table.insert(seq, value.as_slice())?;
            chain.head = hash;
            chain.last = Some(seq);
            chain.unchecked = chain.unchecked.saturating_add(1);
        }
        self.checkpoint_in(txn, log, &mut chain, now_ms, false)?;
        txn.open_table(CHAIN)?
            .insert(log.name(), chain.encode().as_slice())?;
        Ok(stored)
    }

    /// Makes the checkpoint of `log` at its last record if one is due (or, with `force`,
    /// if any record is not yet checkpointed). A signing failure keeps the records and is
    /// kept in [`StateStore::checkpoint_failure`]: the checkpoint stays due.
    pub(super) fn checkpoint_in(
        &self,
        txn: &redb::WriteTransaction,
        log: Log,
        chain: &mut ChainState,
        now_ms: u64,
        force: bool,
    ) -> Result<Option<Checkpoint>, redb::Error> {
        let policy = self.checkpoint_policy();
        let Some(last) = chain.last else {
            return Ok(None);
        };
        let due = if force {
            chain.unchecked > 0
        } else {
            policy.due(
                chain.unchecked,
                now_ms.saturating_sub(chain.last_checkpoint_ms),
            )
        };
        if !due {
            return Ok(None);
        }
        match policy.make(log, last, chain.head, now_ms) {
            Ok(cp) => {
                txn.open_table(CHECKPOINTS)?
                    .insert((log.name(), last), cp.encode().as_slice())?;
                chain.unchecked = 0;
                chain.last_checkpoint_ms = now_ms;
                self.set_checkpoint_failure(None);
                Ok(Some(cp))
            }
            Err(e) => {
                self.set_checkpoint_failure(Some(crate::diagnostic::join_chain(
                    format!("cannot sign the checkpoint of the {log} log at record {last}: {e}"),
                    std::error::Error::source(&e),
                )));
                Ok(None)
            }
        }
    }

    /// The stored checkpoints of `log`, by the last record they cover.
    pub(crate) fn raw_checkpoints(&self, log: Log) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        self.raw_checkpoints_from(log, 0, usize::MAX)
    }

    pub(super) fn raw_checkpoints_from(
        &self,
        log: Log,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(u64, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(CHECKPOINTS)?;
            let name = log.name();
            let mut out = Vec::new();
            for row in table.range((name, from)..=(name, u64::MAX))?.take(limit) {
                let (k, v) = row?;
                out.push((k.value().1, v.value().to_vec()));
            }
            Ok(out)
        };
        self.read("reading checkpoints", read)
    }

    /// Up to `limit` stored rows of `log` from sequence number `from`, as stored (for
    /// verification).
    pub(crate) fn raw_log(
        &self,
        log: Log,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        let table = match log {
            Log::Decisions => DECISIONS,
            Log::Events => EVENTS,
        };
        self.read_log(table, from, limit, "reading a log to verify it")
    }

    /// Up to `limit` raw rows of an append-only log table, from sequence number `from`.
    pub(super) fn read_log(
        &self,
        table: TableDefinition<u64, &[u8]>,
        from: u64,
        limit: usize,
        operation: &'static str,
    ) -> Result<Vec<(u64, Vec<u8>)>, StateError> {
        let read = |txn: &redb::ReadTransaction| -> Result<Vec<(u64, Vec<u8>)>, redb::Error> {
            let table = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in table.range(from..)?.take(limit) {
                let (k, v) = row?;
                out.push((k.value(), v.value().to_vec()));
            }
            Ok(out)
        };
        self.read(operation, read)
    }
}
