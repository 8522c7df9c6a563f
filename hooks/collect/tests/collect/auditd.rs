//! The audit collector: the real captures (Debian 12 auditd 3.0.9, RHEL 7), our own log,
//! the file follower across rotation and truncation, the audisp stdin reader, bounded
//! mutations of the captures, and one end-to-end run with the real auditd, sshd and sudo.

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use probity_collect::Clock;
use probity_collect::auditd::{
    Assembler, AssemblyConfig, AudispSource, AuditConfig, AuditTime, Closure, Correlator,
    Elevation, ElevationKind, Event, FollowConfig, LineAt, LineReader, LogFollower, LoginEvidence,
    ParseOptions, Part, Pipeline, RecordError, RecordType, Redaction, SessionConfig, StartAt,
    ValueKind, parse_record,
};

use crate::common::{XorShift, fixture, fixture_names};

const SUDO_SU: &str = "debian12-auditd3.0.9-sshd-sudo-su-enriched.log";
const PTY: &str = "debian12-auditd3.0.9-sshd-pty-login-and-failed-logins-enriched.log";
const RHEL: &str = "rhel7-catalog-go-libaudit.log";
const OWN: &str = "own-console-login-sudo-setuid.log";

/// The throwaway password typed in the Debian capture (hex-encoded there).
const PASSWORD: &str = "Fixture-Pass-123";

/// A clock the test moves by hand (to the nanosecond, unlike `ManualClock`).
#[derive(Debug)]
struct TestClock(Mutex<SystemTime>);

impl TestClock {
    fn at(secs: u64) -> Self {
        Self(Mutex::new(
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
        ))
    }

    fn advance(&self, d: Duration) {
        *self.0.lock().unwrap() += d;
    }
}

impl Clock for TestClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap()
    }
}

fn lines(bytes: &[u8]) -> Vec<&[u8]> {
    bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect()
}

/// Runs a whole log through a pipeline; returns it, the elevations and the line errors.
fn run_log(bytes: &[u8], config: &AuditConfig) -> (Pipeline, Vec<Elevation>, Vec<String>) {
    let mut p = Pipeline::new(config);
    let mut errors = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let at = LineAt {
            origin: "log",
            line: i as u64 + 1,
            offset: 0,
        };
        if let Err(e) = p.push_line(line, at, SystemTime::UNIX_EPOCH) {
            errors.push(format!("{e}: {}", e.error));
        }
    }
    p.finish();
    let elevations = p.take_elevations();
    (p, elevations, errors)
}

/// Every event of a log, with the elevations the correlator found in them.
fn events_of(bytes: &[u8]) -> (Vec<Event>, Vec<Elevation>, Correlator) {
    let options = ParseOptions::default();
    let mut a = Assembler::new(AssemblyConfig::default());
    let mut c = Correlator::new(SessionConfig::default(), Redaction::default());
    let (mut events, mut out) = (Vec::new(), Vec::new());
    for line in lines(bytes) {
        if let Ok(r) = parse_record(line, &options) {
            a.push(r, SystemTime::UNIX_EPOCH);
        }
        while let Some(e) = a.next_event() {
            c.process(&e, &mut out);
            events.push(e);
        }
    }
    a.flush();
    while let Some(e) = a.next_event() {
        c.process(&e, &mut out);
        events.push(e);
    }
    (events, out, c)
}

// ---------------------------------------------------------------------------------------
// The real captures

#[test]
fn every_capture_line_parses_except_rhels_record_without_an_event_id() {
    let options = ParseOptions::default();
    let mut parsed = 0;
    for name in [SUDO_SU, PTY, RHEL, OWN] {
        let bytes = fixture("auditd", name);
        for (i, line) in lines(&bytes).into_iter().enumerate() {
            match parse_record(line, &options) {
                Ok(r) => {
                    let empty = r.fields().count() == 0 && r.text().is_none();
                    assert_eq!(
                        empty,
                        *r.record_type() == RecordType::Eoe,
                        "{name}:{}",
                        i + 1
                    );
                    parsed += 1;
                }
                // go-libaudit's catalog holds `type=UNKNOWN[1329] msg=?`: no
                // audit(SECONDS.MILLIS:SERIAL), so no event to put it in.
                Err(e) => {
                    assert_eq!(name, RHEL, "{name}:{}: {e}", i + 1);
                    assert_eq!(line, b"type=UNKNOWN[1329] msg=?");
                    assert_eq!(
                        e,
                        RecordError::BadHeader {
                            column: 20,
                            found: "msg=?".into()
                        }
                    );
                }
            }
        }
    }
    assert_eq!(parsed, 220 + 88 + 49 + 23);
}

#[test]
fn debian_capture_gives_exactly_the_four_elevations_a_reader_sees() {
    let (p, elevations, errors) = run_log(&fixture("auditd", SUDO_SU), &AuditConfig::default());
    assert!(errors.is_empty(), "{errors:?}");
    let summary: Vec<(ElevationKind, bool, &str, Option<&str>)> = elevations
        .iter()
        .map(|e| {
            (
                e.kind,
                e.succeeded,
                e.user.as_str(),
                e.command.as_ref().map(|c| c.as_str()),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            // sudo ls -la /root: cmd=6C73202D6C61202F726F6F74, decoded and redacted.
            (
                ElevationKind::Sudo,
                true,
                "alice",
                Some("ls <redacted> <redacted>")
            ),
            // sudo su -c id root
            (
                ElevationKind::Sudo,
                true,
                "alice",
                Some("su <redacted> <redacted> <redacted>")
            ),
            // …and the su it ran (pam_rootok).
            (ElevationKind::Su, true, "alice", None),
            // echo wrong-password | sudo -k -S -p "" true
            (ElevationKind::Sudo, false, "alice", Some("true")),
        ]
    );
    // The password login had no pty: no USER_LOGIN, so PAM + LOGIN (pid 15232) at .905.
    for e in &elevations {
        assert_eq!((e.auid, e.session), (Some(1001), Some(1)));
        let login = e.remote_login.as_ref().expect("session 1 came in over ssh");
        assert_eq!(login.at, AuditTime::new(1796075113, 905));
        assert_eq!(login.addr, "127.0.0.1");
        assert_eq!(login.evidence, LoginEvidence::PamAndLogin);
        assert_eq!(login.pid, Some(15232));
        assert_eq!(login.account.as_deref(), Some("alice"));
    }
    assert_eq!(elevations[0].at, AuditTime::new(1796075114, 65));
    assert_eq!(elevations[0].command.as_ref().unwrap().program(), "ls");
    assert_eq!(
        elevations[0].command.as_ref().unwrap().argument_count(),
        Some(2)
    );
    assert_eq!(elevations[2].target.as_deref(), Some("root"));
    assert_eq!(elevations[2].program.as_deref(), Some("/usr/bin/su"));
    assert_eq!(elevations[3].at, AuditTime::new(1796075115, 649));
    let ctx = elevations[0].context();
    assert_eq!(
        (ctx.now, ctx.last_remote_login_at),
        (1796075114, Some(1796075113))
    );

    // The public-key login (no USER_AUTH: USER_ACCT + CRED_ACQ, then LOGIN pid 15426).
    let pubkey = p.correlator().session(None, 1001, 2).expect("session 2");
    assert_eq!(pubkey.login.at, AuditTime::new(1796075127, 865));
    assert_eq!(pubkey.login.evidence, LoginEvidence::PamAndLogin);
    assert_eq!(pubkey.ended_at, Some(AuditTime::new(1796075127, 969)));
    assert_eq!(p.correlator().sessions().count(), 2);
    assert_eq!(p.correlator().pending_logins(), 0);
}

#[test]
fn debian_pty_login_is_correlated_through_user_login_and_failures_are_not_logins() {
    let (p, elevations, errors) = run_log(&fixture("auditd", PTY), &AuditConfig::default());
    assert!(errors.is_empty(), "{errors:?}");
    assert!(elevations.is_empty());
    let sessions: Vec<_> = p.correlator().sessions().collect();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    let s = sessions[0];
    assert_eq!((s.auid, s.ses), (1001, 3));
    assert_eq!(s.login.evidence, LoginEvidence::UserLogin);
    assert_eq!(s.login.at, AuditTime::new(1796075366, 25));
    assert_eq!(s.login.addr, "127.0.0.1");
    // alice's wrong password (USER_AUTH + USER_LOGIN) and nosuchuser's (USER_LOGIN ×3,
    // USER_AUTH): six failed records, no session.
    assert_eq!(p.correlator().stats().failed_logins, 6);
    assert_eq!(p.correlator().pending_logins(), 0);
}

#[test]
fn rhel7_catalog_user_cmd_hex_and_role_change_parse() {
    let bytes = fixture("auditd", RHEL);
    let options = ParseOptions::default();
    let find = |t: &str| {
        lines(&bytes)
            .into_iter()
            .find(|l| l.starts_with(format!("type={t} ").as_bytes()))
            .map(|l| parse_record(l, &options).unwrap())
            .unwrap()
    };
    let cmd = find("USER_CMD");
    assert_eq!(*cmd.record_type(), RecordType::UserCmd);
    assert_eq!(
        cmd.command().unwrap().as_str(),
        "./metricbeat <redacted> <redacted>"
    );
    assert_eq!(cmd.field("cwd"), Some("/home/andrew_kroh"));
    assert_eq!(
        cmd.field("subj"),
        Some("unconfined_u:unconfined_r:unconfined_t:s0-s0:c0.c1023")
    );
    let role = find("USER_ROLE_CHANGE");
    assert_eq!(*role.record_type(), RecordType::UserRoleChange);
    assert_eq!(role.text(), Some("pam:"));
    assert_eq!(
        role.field("selected-context"),
        Some("unconfined_u:unconfined_r:unconfined_t:s0-s0:c0.c1023")
    );
    assert_eq!(role.field("exe"), Some("/usr/sbin/sshd"));
    assert_eq!(role.succeeded(), Some(true));
    let cwd = lines(&bytes)
        .into_iter()
        .filter(|l| l.starts_with(b"type=CWD "))
        .map(|l| parse_record(l, &options).unwrap())
        .find(|r| r.field_in(Part::Kernel, "cwd").unwrap().kind == ValueKind::Hex)
        .unwrap();
    assert_eq!(cwd.field("cwd"), Some("/tmp/a b c"));
    let syscall = lines(&bytes)
        .into_iter()
        .filter(|l| l.starts_with(b"type=SYSCALL "))
        .map(|l| parse_record(l, &options).unwrap())
        .find(|r| r.field("comm") == Some("google_ip_forwa"))
        .unwrap();
    assert_eq!(
        syscall.field("exe"),
        Some("/usr/bin/python2.7;58d1ccfb (deleted)")
    );
    let daemon = find("DAEMON_START");
    assert_eq!(daemon.text(), Some("auditd start,"));
    assert_eq!(daemon.field("format"), Some("raw"));
    for tty in ["TTY", "USER_TTY"] {
        for l in lines(&bytes)
            .into_iter()
            .filter(|l| l.starts_with(format!("type={tty} ").as_bytes()))
        {
            assert_eq!(
                parse_record(l, &options).unwrap().field("data"),
                Some("<redacted>")
            );
        }
    }

    // sshd's role change at login is the login's context, not an elevation; the sudo is.
    let (_, elevations, errors) = run_log(&bytes, &AuditConfig::default());
    assert_eq!(errors.len(), 1, "the UNKNOWN[1329] line: {errors:?}");
    assert!(
        errors[0].starts_with("log: line 31 (byte offset 0): column 20"),
        "{errors:?}"
    );
    assert_eq!(elevations.len(), 1, "{elevations:?}");
    assert_eq!(elevations[0].kind, ElevationKind::Sudo);
    assert_eq!(elevations[0].user, "1000", "RAW format: no ENRICHED name");
    assert_eq!(
        (elevations[0].auid, elevations[0].session),
        (Some(1000), Some(3))
    );
}

#[test]
fn a_role_change_outside_a_login_is_an_elevation() {
    let log = "type=USER_ROLE_CHANGE msg=audit(1500000000.000:9): pid=3000 uid=1000 auid=1000 ses=4 \
        msg='newrole: old-context=staff_u:staff_r:staff_t:s0 new-context=staff_u:sysadm_r:sysadm_t:s0 \
        exe=\"/usr/bin/newrole\" hostname=? addr=? terminal=pts/0 res=success'\n";
    let (_, elevations, _) = run_log(log.as_bytes(), &AuditConfig::default());
    assert_eq!(elevations.len(), 1);
    assert_eq!(elevations[0].kind, ElevationKind::RoleChange);
    assert!(elevations[0].succeeded);
}

// ---------------------------------------------------------------------------------------
// Our own log: a console login, node= prefixes, a setuid execve with a split argument

#[test]
fn a_local_console_login_followed_by_sudo_has_no_remote_login() {
    let (_, elevations, errors) = run_log(&fixture("auditd", OWN), &AuditConfig::default());
    assert!(errors.is_empty(), "{errors:?}");
    let dave = elevations.iter().find(|e| e.user == "dave").unwrap();
    assert_eq!(dave.kind, ElevationKind::Sudo);
    assert_eq!(
        dave.command.as_ref().unwrap().as_str(),
        "systemctl <redacted> <redacted>"
    );
    assert_eq!(dave.node.as_deref(), Some("gpu-a1"));
    assert!(dave.remote_login.is_none(), "{dave:?}");
    assert_eq!(dave.context().last_remote_login_at, None);
}

#[test]
fn a_setuid_execve_after_a_remote_login_is_an_elevation_with_its_split_argument_withheld() {
    let bytes = fixture("auditd", OWN);
    let (_, elevations, _) = run_log(&bytes, &AuditConfig::default());
    assert_eq!(elevations.len(), 2);
    let carol = elevations.iter().find(|e| e.user == "carol").unwrap();
    assert_eq!(carol.kind, ElevationKind::Setuid);
    assert!(carol.succeeded);
    assert_eq!(
        carol.command.as_ref().unwrap().as_str(),
        "passwd <redacted>"
    );
    assert_eq!(carol.program.as_deref(), Some("/usr/bin/passwd"));
    let login = carol.remote_login.as_ref().unwrap();
    assert_eq!(login.evidence, LoginEvidence::UserLogin);
    assert_eq!(login.at, AuditTime::new(1800000100, 200));
    assert_eq!(login.addr, "203.0.113.7");
    assert_eq!(login.hostname.as_deref(), Some("203.0.113.7"));
    let (events, _, _) = events_of(&bytes);
    let setuid = events.iter().find(|e| e.id().serial == 230).unwrap();
    assert_eq!(
        setuid.records().len(),
        7,
        "SYSCALL, 2 EXECVE, CWD, 2 PATH, PROCTITLE"
    );
    assert_eq!(setuid.closure(), Closure::Complete);
    let everything = format!("{events:?}{elevations:?}");
    for secret in [
        "Secret-Split-Arg",
        "Secret-S",
        "plit-Arg",
        "5365637265742D53",
    ] {
        assert!(!everything.contains(secret), "{secret} leaked");
    }
}

// ---------------------------------------------------------------------------------------
// The 5-minute window as the engine sees it

fn login_then_sudo(sudo_offsets: &[u64]) -> Vec<Elevation> {
    let t0 = 1_767_138_900u64;
    let mut log = format!(
        "type=USER_ACCT msg=audit({t0}.400:10): pid=42 uid=0 auid=4294967295 ses=4294967295 \
         msg='op=PAM:accounting acct=\"bob\" exe=\"/usr/sbin/sshd\" hostname=198.51.100.4 \
         addr=198.51.100.4 terminal=ssh res=success'\n\
         type=LOGIN msg=audit({t0}.410:11): pid=42 uid=0 old-auid=4294967295 auid=1002 tty=(none) \
         old-ses=4294967295 ses=7 res=1\x1dUID=\"root\" OLD-AUID=\"unset\" AUID=\"bob\"\n"
    );
    for (i, off) in sudo_offsets.iter().enumerate() {
        log.push_str(&format!(
            "type=USER_CMD msg=audit({}.900:{}): pid=50 uid=1002 auid=1002 ses=7 \
             msg='cwd=\"/\" cmd=\"id\" exe=\"/usr/bin/sudo\" terminal=pts/0 res=success'\
             \x1dUID=\"bob\" AUID=\"bob\"\n",
            t0 + off,
            20 + i
        ));
    }
    run_log(log.as_bytes(), &AuditConfig::default()).1
}

#[test]
fn elevations_299_and_301_seconds_after_the_remote_login_reach_the_engine_as_such() {
    let e = login_then_sudo(&[299, 301]);
    assert_eq!(e.len(), 2);
    let contexts: Vec<_> = e.iter().map(Elevation::context).collect();
    assert_eq!(
        contexts[0].now - contexts[0].last_remote_login_at.unwrap(),
        299
    );
    assert_eq!(
        contexts[1].now - contexts[1].last_remote_login_at.unwrap(),
        301
    );
    assert_eq!(contexts[0].last_remote_login_at, Some(1_767_138_900));
    assert!(e.iter().all(|e| e.user == "bob"));
}

// ---------------------------------------------------------------------------------------
// Assembly: interleaving, order, partial events

const EV_A: [&str; 4] = [
    "type=SYSCALL msg=audit(100.000:1): arch=c000003e syscall=59 success=yes exit=0 items=1 ppid=1 pid=10 auid=1000 uid=1000 euid=1000 ses=2 exe=\"/usr/bin/id\"",
    "type=EXECVE msg=audit(100.000:1): argc=1 a0=\"id\"",
    "type=PATH msg=audit(100.000:1): item=0 name=\"/usr/bin/id\"",
    "type=PROCTITLE msg=audit(100.000:1): proctitle=\"id\"",
];
const EV_B: [&str; 4] = [
    "type=SYSCALL msg=audit(100.001:2): arch=c000003e syscall=59 success=yes exit=0 items=1 ppid=1 pid=11 auid=1000 uid=1000 euid=1000 ses=2 exe=\"/usr/bin/ls\"",
    "type=EXECVE msg=audit(100.001:2): argc=2 a0=\"ls\" a1=\"-l\"",
    "type=PATH msg=audit(100.001:2): item=0 name=\"/usr/bin/ls\"",
    "type=PROCTITLE msg=audit(100.001:2): proctitle=6C73002D6C",
];

fn assemble(lines: &[&str], clock: &TestClock, tick_after: Option<Duration>) -> Vec<Event> {
    let mut a = Assembler::new(AssemblyConfig::default());
    let mut out = Vec::new();
    for l in lines {
        a.push(
            parse_record(l.as_bytes(), &ParseOptions::default()).unwrap(),
            clock.now(),
        );
        out.extend(std::iter::from_fn(|| a.next_event()));
    }
    if let Some(d) = tick_after {
        clock.advance(d);
        a.expire(clock.now());
        out.extend(std::iter::from_fn(|| a.next_event()));
    }
    out
}

#[test]
fn interleaved_events_are_assembled_each_whole() {
    let clock = TestClock::at(1000);
    let mixed: Vec<&str> = EV_A
        .iter()
        .zip(EV_B.iter())
        .flat_map(|(a, b)| [*a, *b])
        .collect();
    let events = assemble(&mixed, &clock, None);
    assert_eq!(events.len(), 2);
    for (e, serial) in events.iter().zip([1, 2]) {
        assert_eq!(e.id().serial, serial);
        assert_eq!(e.records().len(), 4);
        assert_eq!(e.closure(), Closure::Complete);
        assert!(e.records().iter().all(|r| r.id().serial == serial));
    }
    assert_eq!(
        events[1].command(&Redaction::default()).unwrap().as_str(),
        "ls <redacted>"
    );
}

#[test]
fn records_out_of_order_or_missing_their_proctitle_still_make_an_event() {
    let clock = TestClock::at(1000);
    let reversed: Vec<&str> = EV_A.iter().rev().copied().collect();
    let events = assemble(&reversed, &clock, None);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].records().len(), 4);
    assert_eq!(events[0].closure(), Closure::Complete);

    // No PROCTITLE: the event waits, then closes by the reader's clock (log is quiet).
    let partial = &EV_B[..3];
    assert!(assemble(partial, &clock, Some(Duration::from_millis(1999))).is_empty());
    let events = assemble(partial, &clock, Some(Duration::from_secs(2)));
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].records().len(), 3);
    assert_eq!(events[0].closure(), Closure::Idle);
    assert!(!events[0].is_complete());
    assert_eq!(
        events[0].command(&Redaction::default()).unwrap().as_str(),
        "ls <redacted>"
    );
}

// ---------------------------------------------------------------------------------------
// Sources: the file follower and the audisp stdin reader

fn write(path: &std::path::Path, bytes: &[u8], append: bool) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(append)
        .write(true)
        .truncate(!append)
        .open(path)
        .unwrap();
    f.write_all(bytes).unwrap();
}

fn follower(path: &std::path::Path) -> LogFollower {
    LogFollower::new(FollowConfig {
        path: path.to_path_buf(),
        ..FollowConfig::default()
    })
}

#[test]
fn log_rotation_mid_stream_sees_every_record_once() {
    let capture = fixture("auditd", SUDO_SU);
    let all = lines(&capture);
    let (first, second) = all.split_at(100);
    let join = |ls: &[&[u8]]| {
        ls.iter()
            .flat_map(|l| [*l, b"\n"])
            .flatten()
            .copied()
            .collect::<Vec<u8>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let clock = TestClock::at(1_796_075_200);
    let mut p = Pipeline::new(&AuditConfig::default());
    let mut f = follower(&log);

    write(&log, &join(&first[..60]), false);
    let poll = f.poll(&mut p, &clock).unwrap();
    assert_eq!(poll.lines, 60);
    let mut elevations = poll.elevations;
    // auditd rotates: the old file is renamed (after a last write), a new one created.
    write(&log, &join(&first[60..]), true);
    std::fs::rename(&log, dir.path().join("audit.log.1")).unwrap();
    let poll = f.poll(&mut p, &clock).unwrap();
    assert_eq!(
        (poll.lines, poll.rotations),
        (40, 0),
        "no new file yet: keep reading the old"
    );
    elevations.extend(poll.elevations);
    write(&dir.path().join("audit.log.1"), b"", true);
    write(&log, &join(second), false);
    let poll = f.poll(&mut p, &clock).unwrap();
    assert_eq!((poll.lines, poll.rotations), (120, 1));
    assert!(poll.errors.is_empty(), "{:?}", poll.errors);
    elevations.extend(poll.elevations);
    p.finish();
    elevations.extend(p.take_elevations());

    assert_eq!(p.stats().records, 220, "every record once");
    assert_eq!(p.assembler().stats().records, 220);
    let kinds: Vec<_> = elevations.iter().map(|e| (e.kind, e.succeeded)).collect();
    assert_eq!(
        kinds,
        [
            (ElevationKind::Sudo, true),
            (ElevationKind::Sudo, true),
            (ElevationKind::Su, true),
            (ElevationKind::Sudo, false)
        ]
    );
    let pos = f.position().unwrap();
    assert_eq!(pos.offset, std::fs::metadata(&log).unwrap().len());
}

#[test]
fn a_saved_position_resumes_without_rereading_and_end_skips_the_past() {
    let capture = fixture("auditd", SUDO_SU);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let clock = TestClock::at(1_796_075_200);
    // Cut in the middle of a line: the agent stops with a partial line held.
    let half = capture.len() / 2;
    let whole = capture[..half].iter().rposition(|&b| b == b'\n').unwrap() + 1;
    write(&log, &capture[..half], false);
    let mut p = Pipeline::new(&AuditConfig::default());
    let mut f = follower(&log);
    let first = f.poll(&mut p, &clock).unwrap();
    let saved = f.position().unwrap();
    assert_eq!(
        saved.offset, whole as u64,
        "the held partial line is not past the cursor"
    );
    drop(f);

    write(&log, &capture[half..], true);
    let resume = |start| {
        LogFollower::new(FollowConfig {
            path: log.clone(),
            start,
            ..FollowConfig::default()
        })
    };
    let mut p2 = Pipeline::new(&AuditConfig::default());
    let second = resume(StartAt::Position(saved))
        .poll(&mut p2, &clock)
        .unwrap();
    assert_eq!(first.lines + second.lines, 220, "every line once");
    assert!(first.errors.is_empty() && second.errors.is_empty());

    // Another file at the path (rotated meanwhile): the saved offset is not applied.
    let other = dir.path().join("other.log");
    write(&other, &capture, false);
    std::fs::rename(&other, &log).unwrap();
    let mut p3 = Pipeline::new(&AuditConfig::default());
    let poll = resume(StartAt::Position(saved))
        .poll(&mut p3, &clock)
        .unwrap();
    assert_eq!(poll.lines, 220);

    let mut end = resume(StartAt::End);
    let mut p4 = Pipeline::new(&AuditConfig::default());
    let poll = end.poll(&mut p4, &clock).unwrap();
    assert_eq!((poll.lines, poll.bytes), (0, 0));
    write(&log, &capture[..whole], true);
    assert_eq!(end.poll(&mut p4, &clock).unwrap().lines, first.lines);
}

#[test]
fn a_partial_last_line_waits_for_its_newline() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let clock = TestClock::at(1000);
    let mut p = Pipeline::new(&AuditConfig::default());
    let mut f = follower(&log);
    let line = "type=USER_CMD msg=audit(100.000:5): pid=1 uid=1000 auid=1000 ses=2 msg='cwd=\"/\" cmd=\"id\" exe=\"/usr/bin/sudo\" terminal=? res=success'\n";
    let (head, tail) = line.split_at(70);
    write(&log, head.as_bytes(), false);
    let poll = f.poll(&mut p, &clock).unwrap();
    assert_eq!((poll.lines, poll.errors.len(), poll.bytes), (0, 0, 70));
    assert!(poll.elevations.is_empty());
    write(&log, tail.as_bytes(), true);
    let poll = f.poll(&mut p, &clock).unwrap();
    assert_eq!(poll.lines, 1);
    assert!(poll.errors.is_empty());
    assert_eq!(poll.elevations.len(), 1);
}

#[test]
fn truncation_restarts_from_the_beginning() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let clock = TestClock::at(1000);
    let mut p = Pipeline::new(&AuditConfig::default());
    let mut f = follower(&log);
    let sudo = |serial: u32| {
        format!(
            "type=USER_CMD msg=audit(100.000:{serial}): pid=1 uid=1000 auid=1000 ses=2 msg='cmd=\"id\" res=success'\n"
        )
    };
    write(&log, format!("{}{}", sudo(1), sudo(2)).as_bytes(), false);
    assert_eq!(f.poll(&mut p, &clock).unwrap().elevations.len(), 2);
    write(&log, sudo(3).as_bytes(), false);
    let poll = f.poll(&mut p, &clock).unwrap();
    assert_eq!(poll.truncations, 1);
    assert_eq!(poll.elevations.len(), 1);
    assert_eq!(poll.elevations[0].event.serial, 3);
}

#[test]
fn a_malformed_line_is_located_and_the_rest_of_the_stream_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let good = "type=USER_CMD msg=audit(100.000:1): pid=1 uid=1000 auid=1000 ses=2 msg='cmd=\"id\" res=success'\n";
    let bad = "type=USER_CMD msg=audit(100.000:2): pid=1 msg='cmd=\"id\n";
    write(
        &log,
        format!("{good}{bad}{}", good.replace(":1)", ":3)")).as_bytes(),
        false,
    );
    let mut p = Pipeline::new(&AuditConfig::default());
    let poll = follower(&log).poll(&mut p, &TestClock::at(1000)).unwrap();
    assert_eq!(poll.lines, 3);
    assert_eq!(poll.errors.len(), 1);
    let e = &poll.errors[0];
    assert_eq!((e.line, e.offset), (2, good.len() as u64));
    assert_eq!(
        e.error,
        RecordError::Unterminated {
            column: 47,
            quote: '\''
        }
    );
    assert_eq!(
        e.to_string(),
        format!("{}: line 2 (byte offset {})", log.display(), good.len())
    );
    assert_eq!(poll.elevations.len(), 2);
}

#[test]
fn an_overlong_line_is_an_error_and_the_next_line_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let good = "type=USER_CMD msg=audit(100.000:1): pid=1 uid=1000 auid=1000 ses=2 msg='cmd=\"id\" res=success'\n";
    write(
        &log,
        format!("type=EXECVE {}\n{good}", "x".repeat(5000)).as_bytes(),
        false,
    );
    let config = AuditConfig {
        parse: ParseOptions {
            max_line_bytes: 1024,
            ..ParseOptions::default()
        },
        ..AuditConfig::default()
    };
    let mut p = Pipeline::new(&config);
    let poll = follower(&log).poll(&mut p, &TestClock::at(1000)).unwrap();
    assert_eq!(poll.errors.len(), 1);
    assert_eq!(
        poll.errors[0].error,
        RecordError::TooLong {
            len: 5012,
            limit: 1024
        }
    );
    assert_eq!(poll.elevations.len(), 1);
}

#[test]
fn a_missing_log_is_unavailable_and_a_fifo_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = Pipeline::new(&AuditConfig::default());
    let clock = TestClock::at(1000);
    let missing = follower(&dir.path().join("audit.log")).collect(&mut p, &clock);
    assert_eq!(missing.status().as_str(), "unavailable");
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let refused = follower(&fifo).collect(&mut p, &clock);
    assert_eq!(refused.status().as_str(), "error");
}

#[test]
fn audisp_stdin_gives_the_same_elevations_as_the_file() {
    let capture = fixture("auditd", SUDO_SU);
    let clock = TestClock::at(1_796_075_200);
    let mut p = Pipeline::new(&AuditConfig::default());
    let mut source =
        AudispSource::spawn(std::io::Cursor::new(capture.clone()), "stdin", 65536, 64).unwrap();
    let mut elevations = Vec::new();
    for _ in 0..1000 {
        let poll = source
            .poll(&mut p, &clock, Duration::from_secs(5), 50)
            .unwrap();
        assert!(poll.errors.is_empty());
        elevations.extend(poll.elevations);
        if poll.ended {
            break;
        }
    }
    assert_eq!(p.stats().records, 220);
    let (_, from_file, _) = run_log(&capture, &AuditConfig::default());
    assert_eq!(elevations, from_file);

    let mut p = Pipeline::new(&AuditConfig::default());
    let poll = LineReader::new(&capture[..], 65536)
        .read_to_end(&mut p, "stdin", &clock)
        .unwrap();
    assert_eq!((poll.lines, poll.ended), (220, true));
    assert_eq!(poll.elevations, from_file);
}

#[test]
fn an_idle_audisp_stream_still_closes_its_last_event_by_the_clock() {
    // A SYSCALL without its PROCTITLE arrives and the daemon goes quiet.
    let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
    let clock = TestClock::at(1000);
    let mut p = Pipeline::new(&AuditConfig::default());
    let mut source = AudispSource::spawn(rx, "stdin", 65536, 8).unwrap();
    let setuid = "type=SYSCALL msg=audit(100.000:1): arch=c000003e syscall=59 success=yes exit=0 items=0 ppid=1 pid=10 auid=1000 uid=1000 euid=0 ses=2 exe=\"/usr/bin/newgrp\"\n";
    tx.write_all(setuid.as_bytes()).unwrap();
    let poll = source
        .poll(&mut p, &clock, Duration::from_secs(10), 10)
        .unwrap();
    assert_eq!(poll.lines, 1);
    assert!(poll.elevations.is_empty(), "waiting for more records");
    clock.advance(Duration::from_secs(2));
    let poll = source
        .poll(&mut p, &clock, Duration::from_millis(1), 10)
        .unwrap();
    assert_eq!((poll.lines, poll.ended), (0, false));
    assert_eq!(poll.elevations.len(), 1);
    assert_eq!(poll.elevations[0].kind, ElevationKind::Setuid);
    assert_eq!(
        poll.elevations[0].command.as_ref().map(|c| c.as_str()),
        None
    );
}

// ---------------------------------------------------------------------------------------
// Secrets

#[test]
fn the_captures_password_never_appears_in_any_output() {
    let capture = fixture("auditd", SUDO_SU);
    let text = String::from_utf8_lossy(&capture);
    let hex = hex::encode_upper(PASSWORD);
    assert!(text.contains(&hex), "the capture carries it hex-encoded");
    assert!(!text.contains(PASSWORD));
    let (events, elevations, correlator) = events_of(&capture);
    let mut outputs = vec![format!("{events:?}"), format!("{elevations:?}")];
    outputs.extend(correlator.sessions().map(|s| format!("{s:?}")));
    for e in &events {
        for r in e.records() {
            outputs.extend(r.fields().map(|f| f.value.to_owned()));
            outputs.extend(r.command().map(|c| c.to_string()));
            outputs.extend(r.text().map(str::to_owned));
        }
        outputs.extend(e.command(&Redaction::default()).map(|c| c.to_string()));
    }
    for e in &elevations {
        outputs.push(
            e.command
                .as_ref()
                .map(|c| c.to_string())
                .unwrap_or_default(),
        );
    }
    for needle in [PASSWORD, hex.as_str(), "wrong-password", "Fixture"] {
        let hits: Vec<&String> = outputs.iter().filter(|o| o.contains(needle)).collect();
        assert!(hits.is_empty(), "{needle} in {hits:?}");
    }
    // The EXECVE that carried it: the program stays, the arguments are markers.
    let bash = events.iter().find(|e| e.id().serial == 25).unwrap();
    assert_eq!(
        bash.command(&Redaction::default()).unwrap().as_str(),
        "bash <redacted> <redacted>"
    );
}

// ---------------------------------------------------------------------------------------
// Bounded randomized mutations of the captures

const NOISE: &[u8] = b"'\"=: \t\x1d()[]{}.0A9\n\xff\xc3";

fn mutate(rng: &mut XorShift, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..=rng.below(3) {
        let lines: Vec<&[u8]> = out.split_inclusive(|&b| b == b'\n').collect();
        out = match rng.below(6) {
            0 => out[..rng.below(out.len() + 1)].to_vec(),
            1 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] = rng.next() as u8;
                out
            }
            2 => {
                let i = rng.below(out.len() + 1);
                let mut v = out[..i].to_vec();
                for _ in 0..=rng.below(4) {
                    v.push(NOISE[rng.below(NOISE.len())]);
                }
                v.extend_from_slice(&out[i..]);
                v
            }
            3 if !lines.is_empty() => {
                let i = rng.below(lines.len());
                let mut v = lines.clone();
                v.insert(i, lines[i]);
                v.concat()
            }
            4 if !lines.is_empty() => {
                let mut v = lines.clone();
                v.remove(rng.below(lines.len()));
                v.concat()
            }
            5 if lines.len() > 1 => {
                let mut v = lines.clone();
                let (a, b) = (rng.below(v.len()), rng.below(v.len()));
                v.swap(a, b);
                v.concat()
            }
            _ => out,
        };
    }
    out
}

#[test]
fn mutated_captures_give_values_or_located_errors_and_never_the_password() {
    const ROUNDS: usize = 300;
    let mut rng = XorShift::new(0x5eed_a0d1);
    let (mut values, mut errors) = (0, 0);
    let config = AuditConfig::default();
    for name in fixture_names("auditd")
        .into_iter()
        .filter(|n| n.ends_with(".log"))
    {
        let original = fixture("auditd", &name);
        for round in 0..ROUNDS {
            let input = mutate(&mut rng, &original);
            let mut p = Pipeline::new(&config);
            let mut f = LineReader::new(&input[..], config.parse.max_line_bytes);
            let poll = f.read_to_end(&mut p, "mutant", &TestClock::at(1)).unwrap();
            for e in &poll.errors {
                assert!(!format!("{e}: {}", e.error).contains(PASSWORD));
                assert!(
                    e.line >= 1 && e.line <= poll.lines,
                    "{name} round {round}: {e}"
                );
                assert!(
                    e.error.column().is_some() || matches!(e.error, RecordError::TooLong { .. }),
                    "{name} round {round}: {e}: {}",
                    e.error
                );
            }
            values += poll.lines as usize - poll.errors.len();
            errors += poll.errors.len();
            let out = format!(
                "{:?}{:?}",
                poll.elevations,
                p.correlator().sessions().collect::<Vec<_>>()
            );
            assert!(!out.contains(PASSWORD), "{name} round {round}");
            // Every single line of the mutant through the parser directly, too.
            for line in lines(&input) {
                if let Ok(r) = parse_record(line, &config.parse) {
                    assert!(!format!("{r:?}").contains(PASSWORD), "{name} round {round}");
                }
            }
        }
    }
    assert!(values > 0 && errors > 0, "{values} values, {errors} errors");
}

// ---------------------------------------------------------------------------------------
// The real thing: auditd, sshd over loopback, a throwaway user, sudo

mod live {
    use std::fs::File;
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Output, Stdio};
    use std::sync::{Mutex, MutexGuard};
    use std::time::{Duration, Instant, SystemTime};

    use probity_collect::SystemClock;
    use probity_collect::auditd::{
        AuditConfig, Elevation, ElevationKind, FollowConfig, LogFollower, LoginEvidence, Pipeline,
    };

    /// Every test that touches the kernel's audit (rules, the enabled flag, the daemon pid)
    /// takes this lock: the mutex within this binary, the lock file across processes.
    pub const LOCK_FILE: &str = "/run/lock/probity-kernel-audit.lock";
    static IN_PROCESS: Mutex<()> = Mutex::new(());

    struct KernelAuditLock {
        _guard: MutexGuard<'static, ()>,
        _file: File,
    }

    fn lock_kernel_audit() -> KernelAuditLock {
        let guard = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK_FILE)
            .unwrap_or_else(|e| panic!("{LOCK_FILE}: {e}"));
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).unwrap();
        KernelAuditLock {
            _guard: guard,
            _file: file,
        }
    }

    const RULE_KEY: &str = "probity-test";

    fn run(program: &str, args: &[&str]) -> Output {
        let out = Command::new(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn run_with_stdin(program: &str, args: &[&str], stdin: &str) {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "{program} {args:?}");
    }

    /// `auditctl -s`: (enabled, pid).
    fn audit_status() -> (u32, u32) {
        let out = run("auditctl", &["-s"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let value = |key: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(key)?
                        .strip_prefix(' ')?
                        .split(' ')
                        .next()?
                        .parse()
                        .ok()
                })
                .unwrap_or_else(|| panic!("no {key} in auditctl -s: {text}"))
        };
        (value("enabled"), value("pid"))
    }

    use crate::ports::free_port;

    fn stop(child: &mut Child) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        let pid = rustix::process::Pid::from_child(child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Undoes everything the test did, in order, even when it panics.
    #[derive(Default)]
    struct Cleanup {
        sshd: Option<Child>,
        user: Option<String>,
        auditd: Option<Child>,
        rule_added: bool,
        enabled_before: Option<u32>,
        made_privsep_dir: Option<PathBuf>,
    }

    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Some(mut sshd) = self.sshd.take() {
                stop(&mut sshd);
            }
            if let Some(user) = self.user.take() {
                // The session's processes may take a moment to exit after ssh returns.
                let deadline = Instant::now() + Duration::from_secs(15);
                loop {
                    let ok = Command::new("userdel")
                        .args(["-r", &user])
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success());
                    let gone = Command::new("id")
                        .arg(&user)
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| !s.success());
                    if ok || gone || Instant::now() > deadline {
                        if !gone {
                            eprintln!("could not remove the test user {user}");
                        }
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if let Some(mut auditd) = self.auditd.take() {
                stop(&mut auditd);
            }
            if self.rule_added {
                let _ = Command::new("auditctl")
                    .args(["-D", "-k", RULE_KEY])
                    .stdout(Stdio::null())
                    .status();
            }
            if let Some(enabled) = self.enabled_before {
                let _ = Command::new("auditctl")
                    .args(["-e", &enabled.to_string()])
                    .stdout(Stdio::null())
                    .status();
            }
            if let Some(dir) = self.made_privsep_dir.take() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }

    fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + limit;
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn random_hex() -> String {
        let mut b = [0u8; 6];
        File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut b)
            .unwrap();
        hex::encode(b)
    }

    fn auditd_conf(dir: &Path) -> String {
        format!(
            "local_events = yes\nwrite_logs = yes\nlog_file = {log}\nlog_group = root\n\
             log_format = ENRICHED\nflush = INCREMENTAL_ASYNC\nfreq = 50\nmax_log_file = 8\n\
             num_logs = 2\nmax_log_file_action = IGNORE\nspace_left = 2\n\
             space_left_action = IGNORE\nadmin_space_left = 1\nadmin_space_left_action = IGNORE\n\
             disk_full_action = IGNORE\ndisk_error_action = IGNORE\nname_format = NONE\n\
             plugin_dir = {plugins}\nend_of_event_timeout = 2\nq_depth = 2000\n",
            log = dir.join("audit.log").display(),
            plugins = dir.join("plugins.d").display(),
        )
    }

    #[test]
    fn real_auditd_reports_sudo_after_an_ssh_login_with_the_login_time() {
        let _lock = lock_kernel_audit();
        for program in [
            "/usr/sbin/auditd",
            "/usr/sbin/auditctl",
            "/usr/sbin/sshd",
            "/usr/bin/ssh",
            "/usr/bin/ssh-keygen",
            "/usr/bin/sudo",
            "/usr/sbin/useradd",
        ] {
            assert!(Path::new(program).exists(), "{program} is not installed");
        }
        let (enabled, pid) = audit_status();
        if pid != 0 && Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!(
                "SKIPPED: an audit daemon (pid {pid}) already owns the kernel's audit; \
                 this test needs its own auditd"
            );
            return;
        }
        let mut cleanup = Cleanup::default();
        cleanup.enabled_before = Some(enabled);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("plugins.d")).unwrap();
        std::fs::write(d.join("auditd.conf"), auditd_conf(d)).unwrap();
        std::fs::set_permissions(
            d.join("auditd.conf"),
            std::fs::Permissions::from_mode(0o640),
        )
        .unwrap();

        let auditd = Command::new("/usr/sbin/auditd")
            .args(["-n", "-c"])
            .arg(d)
            .stdout(File::create(d.join("auditd.out")).unwrap())
            .stderr(File::create(d.join("auditd.err")).unwrap())
            .spawn()
            .unwrap();
        let auditd_pid = auditd.id();
        cleanup.auditd = Some(auditd);
        wait_until(
            "auditd to register with the kernel",
            Duration::from_secs(15),
            || {
                if let Some(Ok(Some(status))) = cleanup.auditd.as_mut().map(Child::try_wait) {
                    panic!(
                        "auditd exited ({status}): {}",
                        std::fs::read_to_string(d.join("auditd.err")).unwrap_or_default()
                    );
                }
                audit_status().1 == auditd_pid
            },
        );
        run(
            "auditctl",
            &[
                "-a",
                "always,exit",
                "-F",
                "arch=b64",
                "-S",
                "execve",
                "-F",
                "auid>=1000",
                "-F",
                "auid!=unset",
                "-k",
                RULE_KEY,
            ],
        );
        cleanup.rule_added = true;

        for key in ["hostkey", "userkey"] {
            let path = d.join(key);
            run(
                "ssh-keygen",
                &[
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-f",
                    path.to_str().unwrap(),
                ],
            );
        }
        let user = format!("prb{}", random_hex());
        let password = format!("Pw-{}-t", random_hex());
        run("useradd", &["-m", "-s", "/bin/bash", "-G", "sudo", &user]);
        cleanup.user = Some(user.clone());
        run_with_stdin("chpasswd", &[], &format!("{user}:{password}\n"));
        let home = PathBuf::from(format!("/home/{user}"));
        let ssh_dir = home.join(".ssh");
        std::fs::create_dir_all(&ssh_dir).unwrap();
        std::fs::copy(d.join("userkey.pub"), ssh_dir.join("authorized_keys")).unwrap();
        let id = |flag: &str| -> u32 {
            String::from_utf8(run("id", &[flag, &user]).stdout)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        let (uid, gid) = (id("-u"), id("-g"));
        for p in [&ssh_dir, &ssh_dir.join("authorized_keys")] {
            std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
        }
        std::fs::set_permissions(&ssh_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(
            ssh_dir.join("authorized_keys"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let privsep = PathBuf::from("/run/sshd");
        if !privsep.exists() {
            std::fs::create_dir(&privsep).unwrap();
            cleanup.made_privsep_dir = Some(privsep);
        }

        let port = free_port();
        let sshd = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-f", "/dev/null", "-p", &port.to_string()])
            .args(["-o", "ListenAddress=127.0.0.1", "-o", "UsePAM=yes"])
            .args(["-o", "PasswordAuthentication=yes"])
            .arg("-o")
            .arg(format!("HostKey={}", d.join("hostkey").display()))
            .arg("-o")
            .arg(format!("PidFile={}", d.join("sshd.pid").display()))
            .stdout(Stdio::null())
            .stderr(File::create(d.join("sshd.err")).unwrap())
            .spawn()
            .unwrap();
        cleanup.sshd = Some(sshd);
        wait_until("sshd to listen", Duration::from_secs(15), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });

        let remote = format!("printf '%s\\n' '{password}' | sudo -S -p '' true && echo elevated");
        let mut ssh = Command::new("ssh")
            .arg("-i")
            .arg(d.join("userkey"))
            .args(["-p", &port.to_string()])
            .args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"])
            .args([
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "ConnectTimeout=10",
            ])
            .arg(format!("{user}@127.0.0.1"))
            .arg(&remote)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = ssh.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = ssh.kill();
                panic!("ssh did not finish");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stdout = String::new();
        ssh.stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .unwrap();
        let mut stderr = String::new();
        ssh.stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(
            status.success() && stdout.contains("elevated"),
            "ssh: {status}\n{stdout}\n{stderr}\nsshd: {}",
            std::fs::read_to_string(d.join("sshd.err")).unwrap_or_default()
        );

        // The collector, following the test's own audit log.
        let mut pipeline = Pipeline::new(&AuditConfig::default());
        let mut follower = LogFollower::new(FollowConfig {
            path: d.join("audit.log"),
            ..FollowConfig::default()
        });
        let mut seen: Vec<Elevation> = Vec::new();
        let mut errors = Vec::new();
        let is_ours = |e: &Elevation| e.kind == ElevationKind::Sudo && e.user == user;
        wait_until("the sudo in the audit log", Duration::from_secs(30), || {
            let poll = follower.poll(&mut pipeline, &SystemClock).unwrap();
            errors.extend(poll.errors.into_iter().map(|e| format!("{e}: {}", e.error)));
            seen.extend(poll.elevations);
            seen.iter().any(is_ours)
        });
        assert!(errors.is_empty(), "{errors:?}");
        let sudo = seen.iter().find(|e| is_ours(e)).unwrap();
        assert!(sudo.succeeded, "{sudo:?}");
        assert_eq!(sudo.command.as_ref().unwrap().as_str(), "true");
        assert_eq!(sudo.auid, Some(uid));
        let login = sudo
            .remote_login
            .as_ref()
            .expect("the session came in over ssh");
        assert_eq!(login.addr, "127.0.0.1");
        // A public-key login without a pty: no USER_AUTH, no USER_LOGIN.
        assert_eq!(login.evidence, LoginEvidence::PamAndLogin);
        assert_eq!(login.account.as_deref(), Some(user.as_str()));
        let gap = sudo
            .at
            .since(login.at)
            .expect("the login comes before the sudo");
        assert!(gap < Duration::from_secs(30), "{gap:?}");
        let ctx = sudo.context();
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert!((now - 120..=now).contains(&ctx.now), "{ctx:?}");
        assert!(ctx.now - ctx.last_remote_login_at.unwrap() <= 30);
        // The password went through `bash -c` (EXECVE, PROCTITLE); none of it comes out.
        let log = std::fs::read_to_string(d.join("audit.log")).unwrap();
        let hex = hex::encode_upper(&password);
        assert!(
            log.contains(&hex[..20]),
            "the password is in the raw log, hex-encoded"
        );
        let out = format!(
            "{seen:?}{:?}",
            pipeline.correlator().sessions().collect::<Vec<_>>()
        );
        assert!(!out.contains(&password) && !out.contains(&hex[..20]));
        drop(cleanup);
        assert_eq!(
            audit_status(),
            (enabled, 0),
            "the kernel's audit is left as found"
        );
        let rules = String::from_utf8(run("auditctl", &["-l"]).stdout).unwrap();
        assert!(!rules.contains(RULE_KEY), "{rules}");
    }
}
