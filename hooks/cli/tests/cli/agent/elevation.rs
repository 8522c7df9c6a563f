//! The elevation rule on the real thing: auditd (`auditd -n`) writes the log, a user
//! logs in over ssh to a real sshd on loopback and runs sudo, and `probity agent`
//! reads the log, decides `elevate`, alerts a real Alertmanager and forwards the
//! finding and the deny to a real rsyslog over RELP. The kernel has one audit daemon:
//! this is the suite's only test that starts one.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::Node;
use crate::services::{
    Alertmanager, Auditd, Proc, Rsyslog, Sshd, SyslogInput, ThrowawayUser, eventually, free_port,
};

const USER: &str = "probity-e2e";
/// An argument that stands for a secret on sudo's command line: nothing stored or
/// forwarded may carry it.
const SECRET: &str = "--token=s3cr3t-e2e-7f1c";

#[test]
fn a_real_ssh_login_then_sudo_alerts_alertmanager_and_reaches_rsyslog() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let auditd = Auditd::start(dir);
    let sshd = Sshd::start(dir);
    let user = ThrowawayUser::create(dir, USER, "/usr/bin/true");
    let mut alertmanager = Alertmanager::start(dir);
    let rsyslog = Rsyslog::start(dir, free_port(), SyslogInput::Relp);

    // The user's facts: not authorized to elevate soon after a remote login.
    let users = dir.join("users.json");
    std::fs::write(
        &users,
        format!(
            r#"[{{"uid": {{"type": "User", "id": "{USER}"}}, "attrs": {{"elevationAuthorized": false}}, "parents": []}}]"#
        ),
    )
    .unwrap();
    let state = dir.join("state");
    let node = Node::new(&format!(
        "[alerts]\nalertmanager_url = \"{am}\"\n\
         [audit]\nenabled = true\npath = \"{log}\"\nstart = \"beginning\"\npoll_interval_ms = 200\n\
         [engine]\nusers = \"{users}\"\n\
         [state]\ndir = \"{state}\"\n\
         [siem]\naddress = \"127.0.0.1:{siem}\"\ntransport = \"relp\"\n",
        am = alertmanager.url,
        log = auditd.log.display(),
        users = users.display(),
        state = state.display(),
        siem = rsyslog.port,
    ));
    let mut agent = Proc::spawn(
        "probity agent",
        Command::new(env!("CARGO_BIN_EXE_probity")).args(["agent", "--config", node.config()]),
        &dir.join("agent.log"),
    );
    eventually("the agent to start", Duration::from_secs(30), || {
        agent.assert_running();
        std::fs::read_to_string(dir.join("agent.log"))
            .ok()
            .filter(|t| t.contains("forwarding the decision and event logs"))
    });

    // The real login and sudo: sshd's PAM records carry the remote address, sudo's
    // USER_CMD the session (auid, ses) of that login.
    let out = user.ssh(sshd.port, &format!("sudo -n /usr/bin/true {SECRET}"));
    assert!(
        out.status.success(),
        "ssh and sudo: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
    );
    let log = eventually(
        "sudo's USER_CMD in the audit log",
        Duration::from_secs(20),
        || {
            let t = auditd.text();
            t.contains("type=USER_CMD").then_some(t)
        },
    );
    assert!(
        log.contains(&format!("acct=\"{USER}\" exe=\"/usr/sbin/sshd\"")),
        "{log}"
    );

    // Alertmanager holds the elevation alert, for this user.
    let alert = eventually(
        "the elevation alert at Alertmanager",
        Duration::from_secs(60),
        || {
            agent.assert_running();
            alertmanager
                .alerts()
                .into_iter()
                .find(|a| a["labels"]["alertname"] == "security.elevation-after-remote-login")
        },
    );
    assert_eq!(alert["labels"]["severity"], "critical", "{alert}");
    assert_eq!(
        alert["labels"]["node"],
        Value::from(format!("User::\"{USER}\"")),
        "{alert}"
    );
    assert_eq!(alert["status"]["state"], "active", "{alert}");

    // rsyslog holds the finding (event log) and the deny (decision log), each with its
    // chain link; the secret on sudo's command line is in neither.
    let text = eventually(
        "the finding and the deny at rsyslog",
        Duration::from_secs(60),
        || {
            let (_, text) = rsyslog.received();
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("security.elevation-after-remote-login"))
                .collect();
            let finding = lines.iter().any(|l| l.contains("event=\"finding\""));
            let deny = lines.iter().any(|l| l.contains("decision=\"deny\""));
            (finding && deny).then_some(text)
        },
    );
    assert!(text.contains(USER), "{text}");
    assert!(
        !text.contains(SECRET),
        "a secret argument was forwarded:\n{text}"
    );
    assert!(text.lines().all(|l| l.contains(" hash=\"")), "{text}");

    // Stopped (SIGTERM, a graceful stop): nothing of the secret was stored.
    agent.terminate = true;
    drop(agent);
    for entry in std::fs::read_dir(&state).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap_or_default();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "a secret argument was stored in the state directory"
        );
    }
}
