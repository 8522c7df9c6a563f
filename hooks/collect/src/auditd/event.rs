//! Event assembly: the records of one `audit(SECONDS.MILLIS:SERIAL)` put back together.
//!
//! Why this module exists: one kernel event is written as several lines (SYSCALL, EXECVE,
//! CWD, PATH…, PROCTITLE), events interleave, and Debian's auditd writes no `EOE` to say
//! that one is over. An event therefore closes when the first of these happens:
//! * `EOE` arrives;
//! * its record set is complete: a user-space message (a whole event by itself), or a
//!   SYSCALL with its PROCTITLE, as many PATH records as `items=`, and for a successful
//!   `execve` its EXECVE record, in any order;
//! * a record arrives whose time is at least `end_of_event_timeout` after the event's (the
//!   log's own clock: measured against the arriving record, not the largest time seen, so
//!   a clock stepped back does not split new events);
//! * nothing was added to it for `end_of_event_timeout` by the reader's clock (injected:
//!   [`Assembler::expire`]), so a quiet log still delivers its last event;
//! * too many events are open ([`AssemblyConfig::max_open_events`]): the oldest is closed
//!   and counted.
//!
//! Events are keyed by node, time and serial, never by serial alone: serials restart at
//! boot, and auditd's DAEMON_* records carry auditd's own serial next to the kernel's.
//!
//! Closed events are handed out **in event order** (time, then serial), not in the order
//! they closed: a sudo `USER_CMD` (a whole event at once) waits until the kernel `LOGIN`
//! before it, which may wait for its timeout when no syscall rule adds a SYSCALL to it,
//! has closed. Otherwise the elevation would be judged before its session's login was
//! known. The wait is bounded by the timeout and by `max_open_events`.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::record::{EventId, Record};
use super::record_type::RecordType;
use super::redact::{RedactedCommand, Redaction};

/// Event assembly settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssemblyConfig {
    /// How long an incomplete event waits for more records, in log time and in reader
    /// time. Default 2 s (auditd's own `end_of_event_timeout`).
    pub end_of_event_timeout: Duration,
    /// Most events open at once, and most closed events waiting for an older open one;
    /// beyond it the oldest open event is closed. Default 4,096.
    pub max_open_events: usize,
    /// Most records kept per event; later ones are dropped and counted. Default 1,024.
    pub max_records_per_event: usize,
}

impl Default for AssemblyConfig {
    fn default() -> Self {
        Self {
            end_of_event_timeout: Duration::from_secs(2),
            max_open_events: 4096,
            max_records_per_event: 1024,
        }
    }
}

/// Why an event was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Closure {
    /// A user-space message: one record is the whole event.
    SingleRecord,
    /// `EOE` arrived.
    EndOfEvent,
    /// All the records a SYSCALL announces arrived.
    Complete,
    /// A record `end_of_event_timeout` later in log time arrived.
    LogTimeout,
    /// Nothing arrived for `end_of_event_timeout` by the reader's clock.
    Idle,
    /// Too many events were open and this was the oldest.
    Evicted,
    /// The input ended ([`Assembler::flush`]).
    Flushed,
}

/// The records of one event, in arrival order.
#[derive(Debug, Clone)]
pub struct Event {
    node: Option<Box<str>>,
    id: EventId,
    records: Vec<Record>,
    closure: Closure,
    dropped_records: usize,
}

impl Event {
    /// The node name, if the log carries `node=`.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// Time and serial.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// Every record, in arrival order.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// The first record of a type.
    pub fn record(&self, record_type: &RecordType) -> Option<&Record> {
        self.records.iter().find(|r| r.record_type() == record_type)
    }

    /// Why it was closed.
    pub fn closure(&self) -> Closure {
        self.closure
    }

    /// Records dropped over [`AssemblyConfig::max_records_per_event`].
    pub fn dropped_records(&self) -> usize {
        self.dropped_records
    }

    /// Whether the event closed with every record it announced (or by `EOE`).
    pub fn is_complete(&self) -> bool {
        matches!(
            self.closure,
            Closure::SingleRecord | Closure::EndOfEvent | Closure::Complete
        )
    }

    /// The executed command, redacted: argv\[0\] from the EXECVE records (reassembled from
    /// `a0[i]` pieces when the kernel split it) and `argc`; else the PROCTITLE's.
    pub fn command(&self, redaction: &Redaction) -> Option<RedactedCommand> {
        let execves: Vec<&Record> = self
            .records
            .iter()
            .filter(|r| *r.record_type() == RecordType::Execve)
            .collect();
        if !execves.is_empty() {
            let program = match execves.iter().find_map(|r| r.field("a0")) {
                Some(a0) => a0.to_owned(),
                None => {
                    let mut pieces: Vec<(u64, &str)> = execves
                        .iter()
                        .flat_map(|r| r.fields())
                        .filter_map(|f| {
                            let i = f.name.strip_prefix("a0[")?.strip_suffix(']')?;
                            Some((i.parse().ok()?, f.value))
                        })
                        .collect();
                    pieces.sort_by_key(|(i, _)| *i);
                    pieces.into_iter().map(|(_, v)| v).collect()
                }
            };
            let argc = execves
                .iter()
                .find_map(|r| r.number("argc"))
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(1);
            return Some(RedactedCommand::new(
                &program,
                argc.saturating_sub(1),
                redaction,
            ));
        }
        self.record(&RecordType::Proctitle)
            .and_then(Record::command)
            .cloned()
    }
}

/// Counters of an [`Assembler`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AssemblyStats {
    /// Records taken in.
    pub records: u64,
    /// Events closed, by any cause.
    pub events: u64,
    /// Events closed before they were complete (timeouts, eviction, flush).
    pub incomplete_events: u64,
    /// Events closed because too many were open.
    pub evicted_events: u64,
    /// Records dropped because their event held too many.
    pub dropped_records: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Key {
    id: EventId,
    node: Option<Box<str>>,
}

/// What is known of an open event's record set.
#[derive(Debug, Default)]
struct Progress {
    syscall: bool,
    items: Option<u64>,
    paths: u64,
    wants_execve: bool,
    execve: bool,
    proctitle: bool,
}

impl Progress {
    fn note(&mut self, r: &Record) {
        match r.record_type() {
            RecordType::Syscall => {
                self.syscall = true;
                self.items = r.number("items");
                self.wants_execve = is_successful_execve(r);
            }
            RecordType::Path => self.paths += 1,
            RecordType::Execve => self.execve = true,
            RecordType::Proctitle => self.proctitle = true,
            _ => {}
        }
    }

    fn complete(&self) -> bool {
        self.syscall
            && self.proctitle
            && self.paths >= self.items.unwrap_or(0)
            && (!self.wants_execve || self.execve)
    }
}

/// Whether a SYSCALL record is a successful `execve`/`execveat`: by the ENRICHED name, else
/// by the architecture's number.
pub(crate) fn is_successful_execve(syscall: &Record) -> bool {
    if syscall.field("success") != Some("yes") {
        return false;
    }
    if let Some(name) = syscall.enriched("SYSCALL") {
        return name == "execve" || name == "execveat";
    }
    let Some(nr) = syscall.number("syscall") else {
        return false;
    };
    match syscall.field("arch") {
        Some("c000003e") => nr == 59 || nr == 322, // x86_64
        Some("40000003") => nr == 11 || nr == 358, // i386
        Some("c00000b7") | Some("c00000f3") => nr == 221 || nr == 281, // aarch64, riscv64
        Some("40000028") => nr == 11 || nr == 387, // arm
        Some("c0000015") => nr == 11 || nr == 362, // ppc64le
        Some("80000016") => nr == 11 || nr == 354, // s390x
        _ => false,
    }
}

#[derive(Debug)]
struct Open {
    records: Vec<Record>,
    touched: SystemTime,
    progress: Progress,
    dropped: usize,
}

/// Puts records together into [`Event`]s (module docs for when an event closes).
#[derive(Debug)]
pub struct Assembler {
    config: AssemblyConfig,
    open: BTreeMap<Key, Open>,
    // Closed events by key (and closure order, for events that share one).
    ready: BTreeMap<(Key, u64), Event>,
    closed: u64,
    stats: AssemblyStats,
}

impl Assembler {
    /// An assembler with nothing open.
    pub fn new(config: AssemblyConfig) -> Self {
        Self {
            config,
            open: BTreeMap::new(),
            ready: BTreeMap::new(),
            closed: 0,
            stats: AssemblyStats::default(),
        }
    }

    /// Takes one record that arrived at `now` by the reader's clock. Closed events wait in
    /// [`Assembler::next_event`].
    pub fn push(&mut self, record: Record, now: SystemTime) {
        self.stats.records += 1;
        self.close_older_than(record.id());
        let key = Key {
            id: record.id(),
            node: record.node().map(Into::into),
        };
        if record.record_type().is_single_record() {
            self.emit(key, vec![record], Closure::SingleRecord, 0);
            return;
        }
        let max_records = self.config.max_records_per_event;
        let eoe = *record.record_type() == RecordType::Eoe;
        let done = match self.open.get_mut(&key) {
            Some(open) => {
                open.touched = now;
                if eoe {
                    true
                } else {
                    if open.records.len() < max_records {
                        open.progress.note(&record);
                        open.records.push(record);
                    } else {
                        open.dropped += 1;
                        self.stats.dropped_records += 1;
                    }
                    open.progress.complete()
                }
            }
            None if eoe => {
                // An EOE whose records were all closed already (or never came): nothing to
                // close.
                return;
            }
            None => {
                if self.open.len() >= self.config.max_open_events.max(1) {
                    self.evict_oldest();
                }
                let mut progress = Progress::default();
                progress.note(&record);
                let complete = progress.complete();
                self.open.insert(
                    key.clone(),
                    Open {
                        records: vec![record],
                        touched: now,
                        progress,
                        dropped: 0,
                    },
                );
                complete
            }
        };
        if done && let Some(open) = self.open.remove(&key) {
            let closure = if eoe {
                Closure::EndOfEvent
            } else {
                Closure::Complete
            };
            self.emit(key, open.records, closure, open.dropped);
        }
    }

    /// Closes events untouched for `end_of_event_timeout` by the reader's clock at `now`.
    /// Call it when the source is idle (each poll).
    pub fn expire(&mut self, now: SystemTime) {
        let timeout = self.config.end_of_event_timeout;
        let mut idle = Vec::new();
        for (key, open) in &mut self.open {
            match now.duration_since(open.touched) {
                Ok(age) if age >= timeout => idle.push(key.clone()),
                Ok(_) => {}
                // The clock went back: restart the wait rather than keep the event forever.
                Err(_) => open.touched = now,
            }
        }
        for key in idle {
            if let Some(open) = self.open.remove(&key) {
                self.emit(key, open.records, Closure::Idle, open.dropped);
            }
        }
    }

    /// Closes every open event (the input ended).
    pub fn flush(&mut self) {
        while let Some((key, open)) = self.open.pop_first() {
            self.emit(key, open.records, Closure::Flushed, open.dropped);
        }
    }

    /// The next closed event in event order; `None` while an older event is still open.
    pub fn next_event(&mut self) -> Option<Event> {
        loop {
            let ((first_ready, _), _) = self.ready.first_key_value()?;
            match self.open.first_key_value() {
                Some((oldest_open, _)) if oldest_open < first_ready => {
                    if self.ready.len() < self.config.max_open_events.max(1) {
                        return None;
                    }
                    self.evict_oldest();
                }
                _ => return self.ready.pop_first().map(|(_, e)| e),
            }
        }
    }

    /// How many closed events wait for an older open one.
    pub fn waiting_events(&self) -> usize {
        self.ready.len()
    }

    /// How many events are open.
    pub fn open_events(&self) -> usize {
        self.open.len()
    }

    /// Counters.
    pub fn stats(&self) -> AssemblyStats {
        self.stats
    }

    /// Closes open events that `arriving` is at least the timeout later than.
    fn close_older_than(&mut self, arriving: EventId) {
        let timeout = self.config.end_of_event_timeout;
        while let Some((key, _)) = self.open.first_key_value() {
            if key.id.time.saturating_add(timeout) > arriving.time {
                break;
            }
            if let Some((key, open)) = self.open.pop_first() {
                self.emit(key, open.records, Closure::LogTimeout, open.dropped);
            }
        }
    }

    fn evict_oldest(&mut self) {
        if let Some((key, open)) = self.open.pop_first() {
            self.stats.evicted_events += 1;
            self.emit(key, open.records, Closure::Evicted, open.dropped);
        }
    }

    fn emit(&mut self, key: Key, records: Vec<Record>, closure: Closure, dropped: usize) {
        self.stats.events += 1;
        let event = Event {
            node: key.node.clone(),
            id: key.id,
            records,
            closure,
            dropped_records: dropped,
        };
        if !event.is_complete() {
            self.stats.incomplete_events += 1;
        }
        self.closed += 1;
        self.ready.insert((key, self.closed), event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auditd::record::{ParseOptions, parse_record};

    fn rec(line: &str) -> Record {
        parse_record(line.as_bytes(), &ParseOptions::default()).unwrap()
    }

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    const SYSCALL: &str = "type=SYSCALL msg=audit(100.000:7): arch=c000003e syscall=59 success=yes exit=0 items=2 ppid=1 pid=2 auid=1000 uid=1000 euid=0 ses=3 exe=\"/usr/bin/passwd\"";
    const EXECVE: &str = "type=EXECVE msg=audit(100.000:7): argc=2 a0=\"passwd\" a1=\"bob\"";
    const PATH0: &str = "type=PATH msg=audit(100.000:7): item=0 name=\"/usr/bin/passwd\"";
    const PATH1: &str = "type=PATH msg=audit(100.000:7): item=1 name=\"/lib64/ld.so\"";
    const PROCTITLE: &str = "type=PROCTITLE msg=audit(100.000:7): proctitle=70617373776400626F62";

    fn events(a: &mut Assembler) -> Vec<Event> {
        std::iter::from_fn(|| a.next_event()).collect()
    }

    #[test]
    fn a_complete_record_set_closes_in_any_order() {
        let mut a = Assembler::new(AssemblyConfig::default());
        for line in [PROCTITLE, PATH1, EXECVE, SYSCALL] {
            assert!(events(&mut a).is_empty());
            a.push(rec(line), t(0));
        }
        let ev = events(&mut a);
        assert_eq!(ev.len(), 0, "one PATH is still missing");
        a.push(rec(PATH0), t(0));
        let ev = events(&mut a);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].closure(), Closure::Complete);
        assert_eq!(ev[0].records().len(), 5);
        assert_eq!(
            ev[0].command(&Redaction::default()).unwrap().as_str(),
            "passwd <redacted>"
        );
    }

    #[test]
    fn a_partial_event_closes_on_log_time_or_the_readers_clock() {
        let mut a = Assembler::new(AssemblyConfig::default());
        a.push(rec(SYSCALL), t(0));
        a.push(rec(EXECVE), t(0));
        a.push(rec("type=CWD msg=audit(101.999:8): cwd=\"/\""), t(0));
        assert!(events(&mut a).is_empty());
        a.push(rec("type=CWD msg=audit(102.000:9): cwd=\"/\""), t(0));
        let ev = events(&mut a);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].id().serial, 7);
        assert_eq!(ev[0].closure(), Closure::LogTimeout);
        assert!(!ev[0].is_complete());
        a.expire(t(1));
        assert!(events(&mut a).is_empty());
        a.expire(t(2));
        let ev = events(&mut a);
        assert_eq!(ev.iter().map(|e| e.id().serial).collect::<Vec<_>>(), [8, 9]);
        assert!(ev.iter().all(|e| e.closure() == Closure::Idle));
    }

    #[test]
    fn eoe_closes_and_serials_do_not_merge_across_times() {
        let mut a = Assembler::new(AssemblyConfig::default());
        a.push(
            rec("type=CONFIG_CHANGE msg=audit(50.000:4662): op=add_rule"),
            t(0),
        );
        a.push(
            rec("type=DAEMON_START msg=audit(50.001:4662): op=start res=success"),
            t(0),
        );
        assert!(
            events(&mut a).is_empty(),
            "closed, but waits for the older open event"
        );
        assert_eq!(a.waiting_events(), 1);
        a.push(rec("type=EOE msg=audit(50.000:4662): "), t(0));
        let ev = events(&mut a);
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].closure(), Closure::EndOfEvent);
        assert_eq!(ev[0].records().len(), 1);
        assert_eq!(ev[1].closure(), Closure::SingleRecord);
        assert_eq!(ev[1].id().time, crate::auditd::AuditTime::new(50, 1));
    }

    #[test]
    fn too_many_open_events_evict_the_oldest() {
        let mut a = Assembler::new(AssemblyConfig {
            max_open_events: 2,
            max_records_per_event: 1,
            ..AssemblyConfig::default()
        });
        for serial in 1..=3 {
            a.push(
                rec(&format!("type=CWD msg=audit(10.000:{serial}): cwd=\"/\"")),
                t(0),
            );
        }
        a.push(rec("type=CWD msg=audit(10.000:3): cwd=\"/x\""), t(0));
        let ev = events(&mut a);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].id().serial, 1);
        assert_eq!(ev[0].closure(), Closure::Evicted);
        assert_eq!(a.stats().evicted_events, 1);
        assert_eq!(a.stats().dropped_records, 1);
        a.flush();
        let ev = events(&mut a);
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[1].dropped_records(), 1);
    }
}
