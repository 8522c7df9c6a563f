//! In-memory source and cursor, for tests, benchmarks and embedding in a process that
//! keeps its log elsewhere.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{CursorError, CursorStore, RecordSource, SourceError};
use crate::record::Record;

/// An append-only list of records in memory. Appending takes a short lock and wakes
/// waiting readers; it never waits for a reader.
#[derive(Debug, Default)]
pub struct MemorySource {
    records: Mutex<Vec<Record>>,
    grew: Condvar,
}

impl MemorySource {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Record>> {
        // A panic while holding the lock cannot leave the vector half-pushed.
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends records whose sequence numbers are above the newest one.
    pub fn append(&self, records: impl IntoIterator<Item = Record>) -> Result<(), SourceError> {
        let mut all = self.lock();
        for r in records {
            let last = all.last().map_or(0, |l| l.seq);
            if r.seq <= last {
                return Err(SourceError::OutOfOrder { seq: r.seq, last });
            }
            all.push(r);
        }
        drop(all);
        self.grew.notify_all();
        Ok(())
    }

    /// Number of records held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

impl RecordSource for MemorySource {
    fn read(&self, from_seq: u64, limit: usize) -> Result<Vec<Record>, SourceError> {
        let all = self.lock();
        let start = all.partition_point(|r| r.seq < from_seq);
        Ok(all.iter().skip(start).take(limit).cloned().collect())
    }

    fn newest_seq(&self) -> Result<u64, SourceError> {
        Ok(self.lock().last().map_or(0, |r| r.seq))
    }

    fn wait_for(&self, seq: u64, timeout: Duration) -> bool {
        let deadline = crate::after(timeout);
        let mut all = self.lock();
        loop {
            if all.last().is_some_and(|r| r.seq >= seq) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            all = self
                .grew
                .wait_timeout(all, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A cursor held in memory, shared between clones (so a test can watch it move).
/// Not durable: a restart starts from 0 and resends everything.
#[derive(Debug, Clone, Default)]
pub struct MemoryCursor {
    seq: Arc<Mutex<u64>>,
}

impl MemoryCursor {
    /// A cursor at 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// A cursor at `seq`.
    pub fn at(seq: u64) -> Self {
        Self {
            seq: Arc::new(Mutex::new(seq)),
        }
    }

    /// The current value.
    pub fn value(&self) -> u64 {
        *self.seq.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl CursorStore for MemoryCursor {
    fn load(&self) -> Result<u64, CursorError> {
        Ok(self.value())
    }
    fn store(&mut self, seq: u64) -> Result<(), CursorError> {
        *self.seq.lock().unwrap_or_else(PoisonError::into_inner) = seq;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RecordKind, Severity};

    pub(crate) fn record(seq: u64) -> Record {
        Record {
            seq,
            hash: [1; 32],
            prev_hash: [0; 32],
            time: std::time::UNIX_EPOCH,
            kind: RecordKind::Decision,
            severity: Severity::High,
            node: None,
            policy: None,
            message: String::new(),
            fields: Default::default(),
        }
    }

    #[test]
    fn reads_from_a_sequence_number_and_refuses_going_back() {
        let s = MemorySource::new();
        s.append((1..=10).map(record)).unwrap();
        let got: Vec<u64> = s.read(4, 3).unwrap().iter().map(|r| r.seq).collect();
        assert_eq!(got, [4, 5, 6]);
        assert!(s.read(11, 5).unwrap().is_empty());
        assert_eq!(s.newest_seq().unwrap(), 10);
        assert_eq!(
            s.append([record(10)]).unwrap_err().to_string(),
            "record 10 appended after record 10: sequence numbers must increase"
        );
    }

    #[test]
    fn a_waiting_reader_wakes_on_append() {
        let s = Arc::new(MemorySource::new());
        let waiter = {
            let s = Arc::clone(&s);
            std::thread::spawn(move || s.wait_for(1, Duration::from_secs(60)))
        };
        s.append([record(1)]).unwrap();
        assert!(waiter.join().unwrap());
        assert!(!s.wait_for(2, Duration::from_millis(1)));
    }
}
