//! Session correlation: which login sessions came in remotely, and which events raised a
//! user's privileges in them.
//!
//! Why this module exists: the rule "no privilege elevation within 5 minutes of a remote
//! login by a user not authorized for it" needs two facts the audit log never puts in one
//! record: the elevation (sudo's `USER_CMD`, su's `USER_START`, an SELinux role change, an
//! execve of a setuid-root program) and the remote login of the session it happened in.
//! Both carry the session's `(auid, ses)`; this state machine joins them.
//!
//! A **remote login** is established by, strongest first:
//! 1. sshd's successful `USER_LOGIN` with a remote `addr=` (Debian writes it only for
//!    sessions with a pty): its time becomes the login time;
//! 2. sshd's successful PAM records (`USER_AUTH`, `USER_ACCT`, `CRED_ACQ`; a public-key
//!    login has no `USER_AUTH`) with a remote `addr=`, which come before the session has an
//!    id and are therefore held per sshd `pid`, joined to the kernel's `LOGIN` record of
//!    that pid, which assigns `auid` and `ses`: the LOGIN's time is the login time;
//! 3. failing both (the PAM records were missed), sshd's `USER_START`/`CRED_ACQ` of the
//!    session with a remote `addr=`.
//!
//! A failed login (`res=failed`, `acct="(invalid user)"`) establishes nothing; a console
//! login (`/bin/login`, `addr=?`) is not remote. A session ends at its own `USER_END`,
//! `USER_LOGOUT` or `CRED_DISP` (by the pid that logged in, or by a login program: sudo's
//! and su's records in the same session do not end it); an ended session is kept for
//! [`SessionConfig::ended_session_retention`] of log time, so a process left running after
//! logout still finds the login it came from, then forgotten. Sessions, held logins and
//! ended sessions are bounded: the oldest is evicted and counted.
//!
//! A `LOGIN` for a known `(auid, ses)` from another pid without held PAM evidence means the
//! ids were reused (serials and session ids restart at boot): the old session is dropped.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use super::event::{Event, is_successful_execve};
use super::record::{AuditTime, EventId, Record};
use super::record_type::RecordType;
use super::redact::{RedactedCommand, Redaction};

/// Correlation settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Most sessions with a remote login remembered; beyond it the oldest is evicted.
    /// Default 4,096.
    pub max_sessions: usize,
    /// Most sshd processes with successful PAM records but no `LOGIN` yet. Default 1,024.
    pub max_pending_logins: usize,
    /// How long (log time) PAM evidence waits for its `LOGIN`. Default 10 minutes (sshd's
    /// `LoginGraceTime` is 2).
    pub pending_login_timeout: Duration,
    /// How long (log time) an ended session is kept before it is forgotten. Default 10
    /// minutes, twice the 5-minute rule; zero forgets a session when it ends.
    pub ended_session_retention: Duration,
    /// Programs whose logins are remote when they carry a remote `addr=`. Default sshd's
    /// paths, including OpenSSH 9.8's `sshd-session`.
    pub remote_login_programs: Vec<String>,
    /// Programs that log users in: their `USER_ROLE_CHANGE` is the login's default context,
    /// not an elevation, and their `USER_END` ends a session. Default the remote ones plus
    /// `/bin/login` and `/usr/bin/login`.
    pub login_programs: Vec<String>,
    /// su's paths. Default `/usr/bin/su`, `/bin/su`.
    pub su_programs: Vec<String>,
    /// setuid programs whose elevation is reported from their own records (sudo's
    /// `USER_CMD`, su's `USER_START`), so their execve is not reported again. Default sudo's
    /// and su's paths.
    pub setuid_reported_elsewhere: Vec<String>,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

const SSHD: &[&str] = &[
    "/usr/sbin/sshd",
    "/usr/bin/sshd",
    "/usr/lib/openssh/sshd-session",
    "/usr/libexec/openssh/sshd-session",
    "/usr/libexec/sshd-session",
    "/usr/sbin/sshd-session",
];

impl Default for SessionConfig {
    fn default() -> Self {
        let mut login_programs = strings(SSHD);
        login_programs.extend(strings(&["/bin/login", "/usr/bin/login"]));
        Self {
            max_sessions: 4096,
            max_pending_logins: 1024,
            pending_login_timeout: Duration::from_secs(600),
            ended_session_retention: Duration::from_secs(600),
            remote_login_programs: strings(SSHD),
            login_programs,
            su_programs: strings(&["/usr/bin/su", "/bin/su"]),
            setuid_reported_elsewhere: strings(&[
                "/usr/bin/sudo",
                "/bin/sudo",
                "/usr/bin/su",
                "/bin/su",
            ]),
        }
    }
}

/// What established a remote login.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoginEvidence {
    /// sshd's `USER_LOGIN`.
    UserLogin,
    /// sshd's PAM records joined to the kernel's `LOGIN` through the sshd pid.
    PamAndLogin,
    /// sshd's `USER_START`/`CRED_ACQ` for the session alone.
    PamSession,
}

/// A remote login: when, from where, by which program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteLogin {
    /// The login's own event time (module docs for which record).
    pub at: AuditTime,
    /// The peer address (`addr=`).
    pub addr: String,
    /// The peer's host name (`hostname=`), when it is not `?`.
    pub hostname: Option<String>,
    /// The account named (`acct=`), when given.
    pub account: Option<String>,
    /// The login program (`exe=`).
    pub program: String,
    /// The process that logged in (the kernel `LOGIN`'s pid).
    pub pid: Option<u32>,
    /// What established it.
    pub evidence: LoginEvidence,
}

/// A login session with a remote login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The node, when the log carries `node=`.
    pub node: Option<String>,
    /// The login uid.
    pub auid: u32,
    /// The kernel's session id.
    pub ses: u32,
    /// Its remote login.
    pub login: RemoteLogin,
    /// When it ended, if it did.
    pub ended_at: Option<AuditTime>,
}

/// The kind of an elevation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElevationKind {
    /// sudo ran a command (`USER_CMD`).
    Sudo,
    /// su opened a session (`USER_START`), or failed to (`USER_AUTH`/`USER_ACCT` failed).
    Su,
    /// An SELinux role change outside a login (`USER_ROLE_CHANGE`).
    RoleChange,
    /// An execve that made a user's effective uid root (SYSCALL `uid≠0 euid=0`, with the
    /// execve rule loaded).
    Setuid,
}

impl ElevationKind {
    /// `sudo`, `su`, `role-change` or `setuid`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sudo => "sudo",
            Self::Su => "su",
            Self::RoleChange => "role-change",
            Self::Setuid => "setuid",
        }
    }
}

/// The engine's context for an `elevate` request, in whole seconds since the epoch
/// (both rounded down, which never makes an elevation inside the window look outside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElevateContext {
    /// `now`: the elevation's own event time.
    pub now: i64,
    /// `lastRemoteLoginAt`: the session's remote login, absent when none was seen.
    pub last_remote_login_at: Option<i64>,
}

/// A privilege elevation. Its command is redacted: the program and, if configured, the
/// argument count, never an argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elevation {
    /// What kind.
    pub kind: ElevationKind,
    /// Whether it succeeded (`res=success`; a failed sudo is `false`, never `true`).
    pub succeeded: bool,
    /// Who: the auid's name from ENRICHED `AUID=`, else the auid number, else `acct=`,
    /// else the uid's name or number.
    pub user: String,
    /// The login uid, if set.
    pub auid: Option<u32>,
    /// The session id, if set.
    pub session: Option<u32>,
    /// The command, redacted (sudo's `cmd=`, the setuid program's argv).
    pub command: Option<RedactedCommand>,
    /// The elevating program (`exe=`), when given.
    pub program: Option<String>,
    /// What was elevated to: su's `acct=`, the role change's `selected-context=`, `root`
    /// for a setuid execve.
    pub target: Option<String>,
    /// The event's time.
    pub at: AuditTime,
    /// The event.
    pub event: EventId,
    /// The node, when the log carries `node=`.
    pub node: Option<String>,
    /// The session's remote login, absent when the session had none (or it was not seen).
    pub remote_login: Option<RemoteLogin>,
}

impl Elevation {
    /// The engine's `now` and `lastRemoteLoginAt`.
    pub fn context(&self) -> ElevateContext {
        let secs = |t: AuditTime| i64::try_from(t.secs).unwrap_or(i64::MAX);
        ElevateContext {
            now: secs(self.at),
            last_remote_login_at: self.remote_login.as_ref().map(|l| secs(l.at)),
        }
    }
}

/// Counters of a [`Correlator`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CorrelatorStats {
    /// Remote logins established.
    pub remote_logins: u64,
    /// Failed remote login attempts (`USER_LOGIN`/`USER_AUTH` `res=failed` by sshd).
    pub failed_logins: u64,
    /// Elevations reported.
    pub elevations: u64,
    /// Sessions evicted because the table was full.
    pub sessions_evicted: u64,
    /// Held PAM evidence evicted because the table was full.
    pub pending_evicted: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SessionKey {
    node: Option<Box<str>>,
    auid: u32,
    ses: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PidKey {
    node: Option<Box<str>>,
    pid: u32,
}

#[derive(Debug)]
struct Entry {
    session: Session,
    seq: u64,
}

#[derive(Debug)]
struct Pending {
    login: RemoteLogin,
    seq: u64,
}

enum Establish {
    /// Keep an existing session as it is.
    IfAbsent,
    /// USER_LOGIN: take its time and evidence.
    Upgrade,
    /// A new login with these ids: replace.
    Replace,
}

/// What an elevation record showed, before the session is looked up.
struct Found {
    kind: ElevationKind,
    succeeded: bool,
    command: Option<RedactedCommand>,
    target: Option<String>,
}

/// The session state machine (module docs).
#[derive(Debug)]
pub struct Correlator {
    config: SessionConfig,
    redaction: Redaction,
    sessions: HashMap<SessionKey, Entry>,
    session_order: BTreeMap<u64, SessionKey>,
    ended: VecDeque<(AuditTime, SessionKey)>,
    pending: HashMap<PidKey, Pending>,
    pending_order: BTreeMap<u64, PidKey>,
    seq: u64,
    latest: Option<AuditTime>,
    stats: CorrelatorStats,
}

impl Correlator {
    /// A correlator that knows no session yet.
    pub fn new(config: SessionConfig, redaction: Redaction) -> Self {
        Self {
            config,
            redaction,
            sessions: HashMap::new(),
            session_order: BTreeMap::new(),
            ended: VecDeque::new(),
            pending: HashMap::new(),
            pending_order: BTreeMap::new(),
            seq: 0,
            latest: None,
            stats: CorrelatorStats::default(),
        }
    }

    /// Takes one event; elevations it shows are appended to `out`.
    pub fn process(&mut self, event: &Event, out: &mut Vec<Elevation>) {
        self.advance(event.id().time);
        for record in event.records() {
            self.record(event, record, out);
        }
    }

    /// The session `(auid, ses)` on `node`, if it had a remote login that is still
    /// remembered.
    pub fn session(&self, node: Option<&str>, auid: u32, ses: u32) -> Option<&Session> {
        let key = SessionKey {
            node: node.map(Into::into),
            auid,
            ses,
        };
        self.sessions.get(&key).map(|e| &e.session)
    }

    /// Every remembered session with a remote login.
    pub fn sessions(&self) -> impl Iterator<Item = &Session> + '_ {
        self.sessions.values().map(|e| &e.session)
    }

    /// How many sshd processes have PAM evidence waiting for their `LOGIN`.
    pub fn pending_logins(&self) -> usize {
        self.pending.len()
    }

    /// Counters.
    pub fn stats(&self) -> CorrelatorStats {
        self.stats
    }

    fn is_in(list: &[String], exe: Option<&str>) -> bool {
        exe.is_some_and(|e| list.iter().any(|p| p == e))
    }

    fn record(&mut self, event: &Event, r: &Record, out: &mut Vec<Elevation>) {
        let exe = r.field("exe");
        match r.record_type() {
            RecordType::UserStart | RecordType::UserAuth | RecordType::UserAcct
                if Self::is_in(&self.config.su_programs, exe) =>
            {
                let ok = r.succeeded() == Some(true);
                // One su gives one elevation: its session opening, or its first failure.
                if *r.record_type() == RecordType::UserStart || !ok {
                    let target = r.field("acct").map(str::to_owned);
                    self.report(
                        event,
                        r,
                        Found {
                            kind: ElevationKind::Su,
                            succeeded: ok,
                            command: None,
                            target,
                        },
                        out,
                    );
                }
            }
            RecordType::UserAuth
            | RecordType::UserAcct
            | RecordType::CredAcq
            | RecordType::CredRefr
            | RecordType::UserStart
            | RecordType::UserLogin
                if Self::is_in(&self.config.remote_login_programs, exe) =>
            {
                self.login_evidence(event, r);
            }
            RecordType::Login => self.kernel_login(event, r),
            RecordType::UserEnd | RecordType::UserLogout | RecordType::CredDisp => {
                self.session_end(event, r);
            }
            RecordType::UserCmd => {
                let ok = r.succeeded() == Some(true);
                let command = r.command().cloned();
                self.report(
                    event,
                    r,
                    Found {
                        kind: ElevationKind::Sudo,
                        succeeded: ok,
                        command,
                        target: None,
                    },
                    out,
                );
            }
            RecordType::UserRoleChange if !Self::is_in(&self.config.login_programs, exe) => {
                let ok = r.succeeded() == Some(true);
                let target = r.field("selected-context").map(str::to_owned);
                self.report(
                    event,
                    r,
                    Found {
                        kind: ElevationKind::RoleChange,
                        succeeded: ok,
                        command: None,
                        target,
                    },
                    out,
                );
            }
            RecordType::Syscall => self.setuid(event, r, out),
            _ => {}
        }
    }

    fn remote_login_of(r: &Record, evidence: LoginEvidence) -> Option<RemoteLogin> {
        let addr = r.field("addr").filter(|a| is_remote_addr(a))?;
        let known = |v: Option<&str>| v.filter(|v| !v.is_empty() && *v != "?").map(str::to_owned);
        Some(RemoteLogin {
            at: r.time(),
            addr: addr.to_owned(),
            hostname: known(r.field("hostname")),
            account: known(r.field("acct")),
            program: r.field("exe").unwrap_or_default().to_owned(),
            pid: r.id_field("pid"),
            evidence,
        })
    }

    fn login_evidence(&mut self, event: &Event, r: &Record) {
        if r.succeeded() != Some(true) {
            if matches!(
                r.record_type(),
                RecordType::UserLogin | RecordType::UserAuth
            ) && r.succeeded() == Some(false)
            {
                self.stats.failed_logins += 1;
            }
            return;
        }
        let user_login = *r.record_type() == RecordType::UserLogin;
        let evidence = if user_login {
            LoginEvidence::UserLogin
        } else {
            LoginEvidence::PamSession
        };
        let Some(login) = Self::remote_login_of(r, evidence) else {
            return;
        };
        match (r.id_field("auid"), r.id_field("ses")) {
            (Some(auid), Some(ses)) => {
                let key = SessionKey {
                    node: event.node().map(Into::into),
                    auid,
                    ses,
                };
                let how = if user_login {
                    Establish::Upgrade
                } else {
                    Establish::IfAbsent
                };
                self.establish(key, login, how);
            }
            _ => {
                let Some(pid) = r.id_field("pid") else {
                    return;
                };
                let key = PidKey {
                    node: event.node().map(Into::into),
                    pid,
                };
                if let Some(p) = self.pending.get_mut(&key) {
                    if user_login {
                        p.login.at = login.at;
                        p.login.evidence = LoginEvidence::UserLogin;
                    }
                    return;
                }
                if self.pending.len() >= self.config.max_pending_logins.max(1)
                    && let Some((_, old)) = self.pending_order.pop_first()
                {
                    self.pending.remove(&old);
                    self.stats.pending_evicted += 1;
                }
                self.seq += 1;
                self.pending_order.insert(self.seq, key.clone());
                self.pending.insert(
                    key,
                    Pending {
                        login,
                        seq: self.seq,
                    },
                );
            }
        }
    }

    fn take_pending(&mut self, key: &PidKey) -> Option<RemoteLogin> {
        let p = self.pending.remove(key)?;
        self.pending_order.remove(&p.seq);
        Some(p.login)
    }

    fn kernel_login(&mut self, event: &Event, r: &Record) {
        if !matches!(r.field("res"), Some("1" | "success")) {
            return;
        }
        let (Some(pid), Some(auid), Some(ses)) =
            (r.id_field("pid"), r.id_field("auid"), r.id_field("ses"))
        else {
            return;
        };
        let key = SessionKey {
            node: event.node().map(Into::into),
            auid,
            ses,
        };
        let pid_key = PidKey {
            node: key.node.clone(),
            pid,
        };
        if let Some(mut login) = self.take_pending(&pid_key) {
            if login.evidence != LoginEvidence::UserLogin {
                login.at = r.time();
                login.evidence = LoginEvidence::PamAndLogin;
            }
            login.pid = Some(pid);
            let how = match self.sessions.get(&key) {
                Some(e) if e.session.login.pid != Some(pid) => Establish::Replace,
                _ => Establish::IfAbsent,
            };
            self.establish(key, login, how);
        } else if self
            .sessions
            .get(&key)
            .is_some_and(|e| e.session.login.pid != Some(pid))
        {
            self.remove_session(&key);
        }
    }

    fn establish(&mut self, key: SessionKey, login: RemoteLogin, how: Establish) {
        if let Some(entry) = self.sessions.get_mut(&key) {
            match how {
                Establish::IfAbsent => return,
                Establish::Upgrade => {
                    let pid = entry.session.login.pid.or(login.pid);
                    entry.session.login = RemoteLogin { pid, ..login };
                    return;
                }
                Establish::Replace => self.remove_session(&key),
            }
        }
        if self.sessions.len() >= self.config.max_sessions.max(1)
            && let Some((_, old)) = self.session_order.pop_first()
        {
            self.sessions.remove(&old);
            self.stats.sessions_evicted += 1;
        }
        self.stats.remote_logins += 1;
        self.seq += 1;
        self.session_order.insert(self.seq, key.clone());
        let session = Session {
            node: key.node.as_deref().map(str::to_owned),
            auid: key.auid,
            ses: key.ses,
            login,
            ended_at: None,
        };
        self.sessions.insert(
            key,
            Entry {
                session,
                seq: self.seq,
            },
        );
    }

    fn remove_session(&mut self, key: &SessionKey) {
        if let Some(e) = self.sessions.remove(key) {
            self.session_order.remove(&e.seq);
        }
    }

    fn session_end(&mut self, event: &Event, r: &Record) {
        let node: Option<Box<str>> = event.node().map(Into::into);
        let pid = r.id_field("pid");
        if let Some(pid) = pid {
            self.take_pending(&PidKey {
                node: node.clone(),
                pid,
            });
        }
        let (Some(auid), Some(ses)) = (r.id_field("auid"), r.id_field("ses")) else {
            return;
        };
        let key = SessionKey { node, auid, ses };
        let by_login_program = Self::is_in(&self.config.login_programs, r.field("exe"));
        let Some(entry) = self.sessions.get_mut(&key) else {
            return;
        };
        if entry.session.ended_at.is_some()
            || !(by_login_program || (pid.is_some() && entry.session.login.pid == pid))
        {
            return;
        }
        if self.config.ended_session_retention.is_zero() {
            self.remove_session(&key);
            return;
        }
        entry.session.ended_at = Some(r.time());
        if self.ended.len() >= self.config.max_sessions.max(1)
            && let Some((_, old)) = self.ended.pop_front()
        {
            self.remove_session(&old);
            self.stats.sessions_evicted += 1;
        }
        self.ended.push_back((r.time(), key));
    }

    /// Moves log time forward to `t` and forgets what has aged out.
    fn advance(&mut self, t: AuditTime) {
        let latest = match self.latest {
            Some(l) if l >= t => l,
            _ => t,
        };
        self.latest = Some(latest);
        let retention = self.config.ended_session_retention;
        while let Some((ended, _)) = self.ended.front() {
            if ended.saturating_add(retention) > latest {
                break;
            }
            if let Some((ended, key)) = self.ended.pop_front()
                && self
                    .sessions
                    .get(&key)
                    .is_some_and(|e| e.session.ended_at == Some(ended))
            {
                self.remove_session(&key);
            }
        }
        let timeout = self.config.pending_login_timeout;
        while let Some((_, key)) = self.pending_order.first_key_value() {
            let expired = self
                .pending
                .get(key)
                .is_none_or(|p| p.login.at.saturating_add(timeout) <= latest);
            if !expired {
                break;
            }
            if let Some((_, key)) = self.pending_order.pop_first() {
                self.pending.remove(&key);
            }
        }
    }

    fn setuid(&mut self, event: &Event, r: &Record, out: &mut Vec<Elevation>) {
        let became_root = r.id_field("euid") == Some(0)
            && r.id_field("uid").is_some_and(|u| u != 0)
            && r.id_field("auid").is_some_and(|a| a != 0);
        if !became_root
            || !is_successful_execve(r)
            || Self::is_in(&self.config.setuid_reported_elsewhere, r.field("exe"))
        {
            return;
        }
        let command = event.command(&self.redaction);
        self.report(
            event,
            r,
            Found {
                kind: ElevationKind::Setuid,
                succeeded: true,
                command,
                target: Some("root".to_owned()),
            },
            out,
        );
    }

    fn report(&mut self, event: &Event, r: &Record, found: Found, out: &mut Vec<Elevation>) {
        let Found {
            kind,
            succeeded,
            command,
            target,
        } = found;
        let auid = r.id_field("auid");
        let session = r.id_field("ses");
        let remote_login = match (auid, session) {
            (Some(auid), Some(ses)) => self
                .session(event.node(), auid, ses)
                .map(|s| s.login.clone()),
            _ => None,
        };
        self.stats.elevations += 1;
        out.push(Elevation {
            kind,
            succeeded,
            user: user_name(r),
            auid,
            session,
            command,
            program: r.field("exe").filter(|e| *e != "?").map(str::to_owned),
            target,
            at: r.time(),
            event: event.id(),
            node: event.node().map(str::to_owned),
            remote_login,
        });
    }
}

/// A peer address that is one: not `?`, empty or `UNKNOWN`.
fn is_remote_addr(addr: &str) -> bool {
    !(addr.is_empty() || addr == "?" || addr.eq_ignore_ascii_case("unknown"))
}

fn user_name(r: &Record) -> String {
    let name = |v: Option<&str>| {
        v.filter(|n| !n.is_empty() && *n != "unset" && *n != "?" && !n.starts_with("unknown("))
            .map(str::to_owned)
    };
    if let Some(auid) = r.id_field("auid") {
        return name(r.enriched("AUID")).unwrap_or_else(|| auid.to_string());
    }
    name(r.field("acct"))
        .or_else(|| name(r.enriched("UID")))
        .or_else(|| r.id_field("uid").map(|u| u.to_string()))
        .unwrap_or_else(|| "?".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auditd::event::{Assembler, AssemblyConfig};
    use crate::auditd::record::{ParseOptions, parse_record};
    use std::time::SystemTime;

    fn run(lines: &[&str], config: SessionConfig) -> (Correlator, Vec<Elevation>) {
        let mut a = Assembler::new(AssemblyConfig::default());
        let mut c = Correlator::new(config, Redaction::default());
        let mut out = Vec::new();
        for line in lines {
            let r = parse_record(line.as_bytes(), &ParseOptions::default()).unwrap();
            a.push(r, SystemTime::UNIX_EPOCH);
            while let Some(e) = a.next_event() {
                c.process(&e, &mut out);
            }
        }
        a.flush();
        while let Some(e) = a.next_event() {
            c.process(&e, &mut out);
        }
        (c, out)
    }

    fn pam(kind: &str, t: &str, pid: u32, auid: &str, ses: &str, res: &str) -> String {
        format!(
            "type={kind} msg=audit({t}): pid={pid} uid=0 auid={auid} ses={ses} msg='op=PAM:x \
             acct=\"bob\" exe=\"/usr/sbin/sshd\" hostname=10.0.0.9 addr=10.0.0.9 terminal=ssh res={res}'"
        )
    }

    fn login(t: &str, pid: u32, auid: u32, ses: u32) -> String {
        format!(
            "type=LOGIN msg=audit({t}): pid={pid} uid=0 old-auid=4294967295 auid={auid} \
             tty=(none) old-ses=4294967295 ses={ses} res=1"
        )
    }

    fn sudo(t: &str, auid: u32, ses: u32, res: &str) -> String {
        format!(
            "type=USER_CMD msg=audit({t}): pid=77 uid={auid} auid={auid} ses={ses} \
             msg='cwd=\"/\" cmd=69642061 exe=\"/usr/bin/sudo\" terminal=pts/0 res={res}'"
        )
    }

    #[test]
    fn pam_records_join_the_kernel_login_by_pid() {
        let unset = "4294967295";
        let lines = [
            pam("USER_ACCT", "1000.000:1", 500, unset, unset, "success"),
            login("1000.010:2", 500, 1002, 9),
            sudo("1001.000:3", 1002, 9, "success"),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (c, out) = run(&lines, SessionConfig::default());
        assert_eq!(out.len(), 1);
        let login = out[0].remote_login.as_ref().unwrap();
        assert_eq!(login.at, AuditTime::new(1000, 10));
        assert_eq!(login.addr, "10.0.0.9");
        assert_eq!(login.evidence, LoginEvidence::PamAndLogin);
        assert_eq!(out[0].user, "1002");
        assert_eq!(out[0].command.as_ref().unwrap().as_str(), "id <redacted>");
        assert_eq!(c.pending_logins(), 0);
    }

    #[test]
    fn a_failed_login_is_not_a_login() {
        let unset = "4294967295";
        let lines = [
            pam("USER_AUTH", "1000.000:1", 500, unset, unset, "failed"),
            login("1000.010:2", 500, 1002, 9),
            sudo("1001.000:3", 1002, 9, "failed"),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (c, out) = run(&lines, SessionConfig::default());
        assert_eq!(out.len(), 1);
        assert!(!out[0].succeeded);
        assert!(out[0].remote_login.is_none());
        assert_eq!(c.stats().failed_logins, 1);
    }

    #[test]
    fn a_session_ends_at_its_own_user_end_not_at_sudos() {
        let unset = "4294967295";
        let sudo_end = "type=USER_END msg=audit(1001.500:5): pid=77 uid=1002 auid=1002 ses=9 \
             msg='op=PAM:session_close acct=\"root\" exe=\"/usr/bin/sudo\" addr=? res=success'";
        let lines = [
            pam("CRED_ACQ", "1000.000:1", 500, unset, unset, "success"),
            login("1000.010:2", 500, 1002, 9),
            sudo_end.to_owned(),
            sudo("1002.000:6", 1002, 9, "success"),
            pam("USER_END", "1003.000:7", 500, "1002", "9", "success"),
            sudo("1004.000:8", 1002, 9, "success"),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (c, out) = run(
            &lines,
            SessionConfig {
                ended_session_retention: Duration::ZERO,
                ..SessionConfig::default()
            },
        );
        assert_eq!(out.len(), 2);
        assert!(out[0].remote_login.is_some());
        assert!(out[1].remote_login.is_none(), "forgotten at its USER_END");
        assert_eq!(c.sessions().count(), 0);
    }

    #[test]
    fn an_ended_session_is_kept_for_the_retention() {
        let unset = "4294967295";
        let lines = [
            pam("USER_AUTH", "1000.000:1", 500, unset, unset, "success"),
            login("1000.010:2", 500, 1002, 9),
            pam("USER_END", "1003.000:7", 500, "1002", "9", "success"),
            sudo("1004.000:8", 1002, 9, "success"),
            sudo("1604.000:9", 1002, 9, "success"),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (_, out) = run(&lines, SessionConfig::default());
        assert!(
            out[0].remote_login.is_some(),
            "a process left behind after logout"
        );
        assert!(out[1].remote_login.is_none(), "after the retention");
    }

    #[test]
    fn the_session_table_is_bounded() {
        let unset = "4294967295";
        let mut lines = Vec::new();
        for i in 0..10u32 {
            lines.push(pam(
                "USER_ACCT",
                &format!("{}.000:{}", 1000 + i, 2 * i),
                500 + i,
                unset,
                unset,
                "success",
            ));
            lines.push(login(
                &format!("{}.001:{}", 1000 + i, 2 * i + 1),
                500 + i,
                1002,
                i,
            ));
        }
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (c, _) = run(
            &lines,
            SessionConfig {
                max_sessions: 4,
                ..SessionConfig::default()
            },
        );
        assert_eq!(c.sessions().count(), 4);
        assert_eq!(c.stats().sessions_evicted, 6);
        assert!(c.session(None, 1002, 0).is_none());
        assert!(c.session(None, 1002, 9).is_some());
    }

    #[test]
    fn a_login_reusing_known_ids_from_another_pid_drops_the_old_session() {
        let unset = "4294967295";
        let lines = [
            pam("USER_ACCT", "1000.000:1", 500, unset, unset, "success"),
            login("1000.010:2", 500, 1002, 1),
            // After a reboot: a console login gets session 1 again.
            login("2000.000:2", 900, 1002, 1),
            sudo("2001.000:3", 1002, 1, "success"),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (_, out) = run(&lines, SessionConfig::default());
        assert!(out[0].remote_login.is_none());
    }
}
