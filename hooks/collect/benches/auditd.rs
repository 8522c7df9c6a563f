//! Throughput of the audit collector on a busy host: a generated ENRICHED log of 100,000
//! records (sshd logins, an execve rule's SYSCALL/EXECVE/CWD/PATH/PROCTITLE events, sudo,
//! logouts; two sessions' events interleaved), through the parser alone and through the
//! whole pipeline (parser, assembler, correlator).
//!
//! `cargo bench -p probity-collect --bench auditd`
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::SystemTime;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use probity_collect::auditd::{AuditConfig, LineAt, ParseOptions, Pipeline, parse_record};

const RECORDS: usize = 100_000;
const GS: char = '\u{1d}';

fn hex(s: &str) -> String {
    hex::encode_upper(s)
}

/// Lines of one session `n` (uid 2000+n, session n+1), as (time offset in ms, line).
fn session(n: u64, t0: u64, serial: &mut u64) -> Vec<Vec<String>> {
    let uid = 2000 + n;
    let ses = n + 1;
    let pid = 10_000 + n * 10;
    let user = format!("user{n}");
    let mut events: Vec<Vec<String>> = Vec::new();
    let mut ms = 0u64;
    let stamp = |ms: &mut u64, serial: &mut u64| {
        *ms += 3;
        *serial += 1;
        format!("{}.{:03}:{}", t0 + *ms / 1000, *ms % 1000, serial)
    };
    for (kind, op) in [
        ("USER_AUTH", "PAM:authentication"),
        ("USER_ACCT", "PAM:accounting"),
        ("CRED_ACQ", "PAM:setcred"),
    ] {
        let id = stamp(&mut ms, serial);
        events.push(vec![format!(
            "type={kind} msg=audit({id}): pid={pid} uid=0 auid=4294967295 ses=4294967295 \
             msg='op={op} grantors=pam_permit acct=\"{user}\" exe=\"/usr/sbin/sshd\" \
             hostname=10.9.{n}.1 addr=10.9.{n}.1 terminal=ssh res=success'{GS}UID=\"root\" AUID=\"unset\""
        )]);
    }
    let id = stamp(&mut ms, serial);
    events.push(vec![
        format!(
            "type=LOGIN msg=audit({id}): pid={pid} uid=0 old-auid=4294967295 auid={uid} tty=(none) \
             old-ses=4294967295 ses={ses} res=1{GS}UID=\"root\" OLD-AUID=\"unset\" AUID=\"{user}\""
        ),
        format!(
            "type=SYSCALL msg=audit({id}): arch=c000003e syscall=1 success=yes exit=4 a0=3 \
             a1=7ffc3807c450 a2=4 a3=7ffc3807c164 items=0 ppid=1 pid={pid} auid={uid} uid=0 gid=0 \
             euid=0 suid=0 fsuid=0 egid=0 sgid=0 fsgid=0 tty=(none) ses={ses} comm=\"sshd\" \
             exe=\"/usr/sbin/sshd\" key=(null){GS}ARCH=x86_64 SYSCALL=write AUID=\"{user}\" UID=\"root\""
        ),
        format!("type=PROCTITLE msg=audit({id}): proctitle={}", hex(&format!("sshd: {user} [priv]"))),
    ]);
    let id = stamp(&mut ms, serial);
    events.push(vec![format!(
        "type=USER_START msg=audit({id}): pid={pid} uid=0 auid={uid} ses={ses} \
         msg='op=PAM:session_open grantors=pam_unix acct=\"{user}\" exe=\"/usr/sbin/sshd\" \
         hostname=10.9.{n}.1 addr=10.9.{n}.1 terminal=ssh res=success'{GS}UID=\"root\" AUID=\"{user}\""
    )]);
    let execve = |id: &str, euid: u64, prog: &str, args: &[&str]| {
        let mut argv = format!("argc={} a0=\"{prog}\"", args.len() + 1);
        let mut title = prog.to_owned();
        for (i, a) in args.iter().enumerate() {
            argv.push_str(&format!(" a{}={}", i + 1, hex(a)));
            title.push('\0');
            title.push_str(a);
        }
        vec![
            format!(
                "type=SYSCALL msg=audit({id}): arch=c000003e syscall=59 success=yes exit=0 \
                 a0=55a1 a1=55a2 a2=55a3 a3=8 items=2 ppid={pid} pid={} auid={uid} uid={uid} \
                 gid={uid} euid={euid} suid={euid} fsuid={euid} egid={uid} sgid={uid} fsgid={uid} \
                 tty=pts0 ses={ses} comm=\"{prog}\" exe=\"/usr/bin/{prog}\" key=\"user_exec\"{GS}\
                 ARCH=x86_64 SYSCALL=execve AUID=\"{user}\" UID=\"{user}\" GID=\"{user}\" EUID=\"{user}\"",
                pid + 1
            ),
            format!("type=EXECVE msg=audit({id}): {argv}"),
            format!("type=CWD msg=audit({id}): cwd=\"/home/{user}\""),
            format!(
                "type=PATH msg=audit({id}): item=0 name=\"/usr/bin/{prog}\" inode=247153 dev=fe:00 \
                 mode=0100755 ouid=0 ogid=0 rdev=00:00 nametype=NORMAL cap_fp=0 cap_fi=0 cap_fe=0 \
                 cap_fver=0 cap_frootid=0{GS}OUID=\"root\" OGID=\"root\""
            ),
            format!(
                "type=PATH msg=audit({id}): item=1 name=\"/lib64/ld-linux-x86-64.so.2\" inode=325843 \
                 dev=fe:00 mode=0100755 ouid=0 ogid=0 rdev=00:00 nametype=NORMAL cap_fp=0 cap_fi=0 \
                 cap_fe=0 cap_fver=0 cap_frootid=0{GS}OUID=\"root\" OGID=\"root\""
            ),
            format!("type=PROCTITLE msg=audit({id}): proctitle={}", hex(&title)),
        ]
    };
    for i in 0..40 {
        let id = stamp(&mut ms, serial);
        events.push(execve(
            &id,
            uid,
            "grep",
            &["-r", "needle", &format!("/srv/data/{i}")],
        ));
    }
    let id = stamp(&mut ms, serial);
    events.push(execve(
        &id,
        0,
        "sudo",
        &["-S", "systemctl", "restart", "nvidia-dcgm"],
    ));
    for (kind, op) in [
        ("USER_AUTH", "PAM:authentication"),
        ("USER_ACCT", "PAM:accounting"),
    ] {
        let id = stamp(&mut ms, serial);
        events.push(vec![format!(
            "type={kind} msg=audit({id}): pid={} uid={uid} auid={uid} ses={ses} msg='op={op} \
             grantors=pam_permit acct=\"{user}\" exe=\"/usr/bin/sudo\" hostname=? addr=? terminal=pts/0 \
             res=success'{GS}UID=\"{user}\" AUID=\"{user}\"",
            pid + 1
        )]);
    }
    let id = stamp(&mut ms, serial);
    events.push(vec![format!(
        "type=USER_CMD msg=audit({id}): pid={} uid={uid} auid={uid} ses={ses} msg='cwd=\"/home/{user}\" \
         cmd={} exe=\"/usr/bin/sudo\" terminal=pts/0 res=success'{GS}UID=\"{user}\" AUID=\"{user}\"",
        pid + 1,
        hex("systemctl restart nvidia-dcgm")
    )]);
    for kind in ["USER_END", "CRED_DISP"] {
        let id = stamp(&mut ms, serial);
        events.push(vec![format!(
            "type={kind} msg=audit({id}): pid={pid} uid=0 auid={uid} ses={ses} msg='op=PAM:session_close \
             grantors=pam_unix acct=\"{user}\" exe=\"/usr/sbin/sshd\" hostname=10.9.{n}.1 \
             addr=10.9.{n}.1 terminal=ssh res=success'{GS}UID=\"root\" AUID=\"{user}\""
        )]);
    }
    events
}

/// The log: sessions two at a time, their events interleaved record by record.
fn generate() -> (Vec<u8>, usize) {
    let mut out = String::new();
    let (mut records, mut n, mut serial) = (0, 0u64, 0u64);
    while records < RECORDS {
        let t0 = 1_800_000_000 + n * 10;
        let a = session(n, t0, &mut serial);
        let b = session(n + 1, t0, &mut serial);
        n += 2;
        for (ea, eb) in a.iter().zip(b.iter()) {
            let longest = ea.len().max(eb.len());
            for i in 0..longest {
                for line in [ea.get(i), eb.get(i)].into_iter().flatten() {
                    if records < RECORDS {
                        out.push_str(line);
                        out.push('\n');
                        records += 1;
                    }
                }
            }
        }
    }
    (out.into_bytes(), n as usize)
}

fn pipeline(log: &[u8]) -> usize {
    let mut p = Pipeline::new(&AuditConfig::default());
    let now = SystemTime::UNIX_EPOCH;
    for (i, line) in log.split(|&b| b == b'\n').enumerate() {
        let at = LineAt {
            origin: "bench",
            line: i as u64 + 1,
            offset: 0,
        };
        p.push_line(line, at, now).expect("generated lines parse");
    }
    p.finish();
    p.take_elevations().len()
}

fn bench(c: &mut Criterion) {
    let (log, sessions) = generate();
    let elevations = pipeline(&log);
    // Every session's sudo (both the USER_CMD and the sudo execve is skipped as sudo's own).
    assert!(
        elevations >= sessions - 2,
        "{elevations} elevations for {sessions} sessions"
    );
    let options = ParseOptions::default();
    let mut group = c.benchmark_group("auditd_100k_records");
    group.sample_size(10);
    group.throughput(Throughput::Elements(RECORDS as u64));
    group.bench_function("parse_only", |b| {
        b.iter(|| {
            log.split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .map(|l| parse_record(black_box(l), &options).is_ok() as usize)
                .sum::<usize>()
        })
    });
    group.bench_function("parse_assemble_correlate", |b| {
        b.iter(|| pipeline(black_box(&log)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
