//! `probity keys`, `encrypt`, `decrypt` and `eval` on an `encrypt` request, end to end on
//! a real SoftHSM2 token: the keyring's metadata is what the policies judge, a 91-day-old
//! key is refused with a `rotate_key` obligation and rotated, old and new versions
//! decrypt, rewrap moves an object to the primary, and an erased subject's data is gone.

use std::path::Path;
use std::process::{Command, Output};

use super::{env_of, probity_env, softhsm_env, text};

const T0: i64 = 1_767_139_200; // 2025-12-31
const DAY: i64 = 86_400;

struct Keyring<'a> {
    state: String,
    env: Vec<(&'a str, &'a std::ffi::OsStr)>,
}

impl Keyring<'_> {
    /// Runs `probity ARGS --state-dir STATE --now AT` with the token's environment.
    fn run(&self, args: &[&str], at: i64) -> Output {
        let at = at.to_string();
        let mut all: Vec<&str> = args.to_vec();
        all.extend_from_slice(&["--state-dir", &self.state, "--now", &at, "--actor", "ops"]);
        probity_env(&all, &self.env)
    }

    /// `probity eval --request R --state-dir STATE --now AT` (eval has no actor).
    fn eval(&self, request: &str, at: i64) -> Output {
        let at = at.to_string();
        probity_env(
            &[
                "eval",
                "--request",
                request,
                "--state-dir",
                &self.state,
                "--now",
                &at,
            ],
            &self.env,
        )
    }

    fn ok(&self, args: &[&str], at: i64) -> serde_json::Value {
        let out = self.run(args, at);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        serde_json::from_slice(text(&out.stdout).lines().last().unwrap().as_bytes()).unwrap()
    }
}

fn write(path: &Path, bytes: &[u8]) -> String {
    std::fs::write(path, bytes).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn keys_on_softhsm_rotate_at_91_days_decrypt_every_version_rewrap_and_erase() {
    let tmp = tempfile::tempdir().unwrap();
    let vars = softhsm_env(&tmp.path().join("hsm"), "probity-keys-cli");
    let ring = Keyring {
        state: tmp.path().join("state").to_str().unwrap().to_owned(),
        env: env_of(&vars),
    };
    let p = |name: &str| tmp.path().join(name).to_str().unwrap().to_owned();

    let created = ring.ok(&["keys", "create", "dataset/a"], T0);
    assert_eq!(created["primary"], 1);
    // The KEK is in the token, sensitive and never extractable.
    let get = |k: &str| vars.iter().find(|(n, _)| n == k).unwrap().1.clone();
    let pin = std::fs::read_to_string(get("PROBITY_HSM_PIN_FILE")).unwrap();
    let listed = Command::new("pkcs11-tool")
        .args(["--module", &get("PROBITY_HSM_MODULE")])
        .args(["--token-label", &get("PROBITY_HSM_TOKEN")])
        .args([
            "--login",
            "--pin",
            pin.trim(),
            "--list-objects",
            "--type",
            "secrkey",
        ])
        .env("SOFTHSM2_CONF", get("SOFTHSM2_CONF"))
        .output()
        .unwrap();
    let listed = text(&listed.stdout);
    assert!(listed.contains("probity-dataset-kek"), "{listed}");
    assert!(listed.contains("never extractable"), "{listed}");

    // Day 1: encrypt under version 1.
    let plain1 = b"checkpoint shard one".repeat(1000);
    let in1 = write(&tmp.path().join("shard1"), &plain1);
    let enc1 = ring.ok(
        &[
            "encrypt",
            &in1,
            "-o",
            &p("shard1.enc"),
            "--key",
            "dataset/a",
            "--principal",
            r#"User::"alice""#,
        ],
        T0 + DAY,
    );
    assert_eq!(enc1["encrypted"]["version"], 1);
    assert!(enc1["rotated"].is_null());

    // Day 91: `eval` judges the keyring's own metadata and asks for a rotation.
    let request = write(
        &tmp.path().join("req.json"),
        br#"{"principal": "User::\"alice\"", "action": "encrypt", "resource": "Key::\"dataset/a\""}"#,
    );
    let eval = ring.eval(&request, T0 + 91 * DAY);
    assert_eq!(eval.status.code(), Some(1), "{}", text(&eval.stderr));
    let decision: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    assert_eq!(decision["reasons"][0]["policy"], "security.key-too-old");
    assert_eq!(decision["obligations"][0]["kind"], "rotate_key");
    assert_eq!(decision["obligations"][0]["target"], r#"Key::"dataset/a""#);
    // At 90 days it still encrypts.
    let eval = ring.eval(&request, T0 + 90 * DAY);
    assert_eq!(eval.status.code(), Some(0), "{}", text(&eval.stdout));

    // `encrypt` carries the obligation out: rotated to version 2, then encrypted under it.
    let plain2 = b"checkpoint shard two".to_vec();
    let in2 = write(&tmp.path().join("shard2"), &plain2);
    let out = ring.run(
        &[
            "encrypt",
            &in2,
            "-o",
            &p("shard2.enc"),
            "--key",
            "dataset/a",
            "--principal",
            r#"User::"alice""#,
        ],
        T0 + 91 * DAY,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("refused by security.key-too-old; rotated to version 2"),
        "{}",
        text(&out.stderr)
    );
    let enc2: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(enc2["encrypted"]["version"], 2);
    assert_eq!(enc2["rotated"]["previous"], 1);

    // Both versions decrypt.
    ring.ok(
        &[
            "decrypt",
            &p("shard1.enc"),
            "-o",
            &p("out1"),
            "--object-id",
            "shard1",
        ],
        T0 + 92 * DAY,
    );
    assert_eq!(std::fs::read(p("out1")).unwrap(), plain1);
    ring.ok(
        &[
            "decrypt",
            &p("shard2.enc"),
            "-o",
            &p("out2"),
            "--object-id",
            "shard2",
        ],
        T0 + 92 * DAY,
    );
    assert_eq!(std::fs::read(p("out2")).unwrap(), plain2);

    // Rewrap moves shard1's header to version 2; it still decrypts.
    let rewrap = ring.ok(
        &["keys", "rewrap", &p("shard1.enc"), "--object-id", "shard1"],
        T0 + 92 * DAY,
    );
    assert_eq!(
        (
            rewrap["from_version"].as_u64(),
            rewrap["to_version"].as_u64()
        ),
        (Some(1), Some(2))
    );
    ring.ok(
        &[
            "decrypt",
            &p("shard1.enc"),
            "-o",
            &p("out1b"),
            "--object-id",
            "shard1",
        ],
        T0 + 92 * DAY,
    );
    assert_eq!(std::fs::read(p("out1b")).unwrap(), plain1);

    // A header from another object is refused, and nothing is written over the input.
    let out = ring.run(
        &[
            "decrypt",
            &p("shard2.enc"),
            "-o",
            &p("wrong"),
            "--object-id",
            "shard1",
        ],
        T0 + 92 * DAY,
    );
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert!(!tmp.path().join("wrong").exists() || std::fs::read(p("wrong")).unwrap().is_empty());
    let out = ring.run(&["decrypt", &in1, "-o", &in1], T0 + 92 * DAY);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        text(&out.stderr).contains("over its own input"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read(&in1).unwrap(), plain1);

    // A data subject's data under three key versions, then erased.
    ring.ok(
        &["keys", "create", "subject/alice", "--subject", "alice"],
        T0,
    );
    let mut sealed = Vec::new();
    for v in 1..=3 {
        let name = format!("alice{v}");
        let input = write(
            &tmp.path().join(&name),
            format!("alice's record {v}").as_bytes(),
        );
        let enc = ring.ok(
            &[
                "encrypt",
                &input,
                "-o",
                &p(&format!("{name}.enc")),
                "--key",
                "subject/alice",
                "--principal",
                r#"User::"alice""#,
            ],
            T0 + DAY,
        );
        assert_eq!(enc["encrypted"]["version"], v);
        if v < 3 {
            ring.ok(&["keys", "rotate", "subject/alice"], T0 + DAY);
        }
        sealed.push(name);
    }
    let out = ring.run(&["keys", "erase", "alice"], T0 + 2 * DAY);
    assert_eq!(out.status.code(), Some(8));
    assert!(text(&out.stderr).contains("--yes"), "{}", text(&out.stderr));
    let erased = ring.ok(
        &["keys", "erase", "alice", "--yes", "--object", "alice1"],
        T0 + 2 * DAY,
    );
    assert_eq!(erased["subject"], "alice");
    for name in &sealed {
        let out = ring.run(
            &[
                "decrypt",
                &p(&format!("{name}.enc")),
                "-o",
                &p(&format!("{name}.out")),
                "--object-id",
                name,
            ],
            T0 + 3 * DAY,
        );
        assert_eq!(out.status.code(), Some(5), "{name}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("erased on 2026-01-02"),
            "{name}: {}",
            text(&out.stderr)
        );
    }
    // The subject's KEK is gone from the token; the dataset KEK stays.
    let listed = Command::new("pkcs11-tool")
        .args(["--module", &get("PROBITY_HSM_MODULE")])
        .args(["--token-label", &get("PROBITY_HSM_TOKEN")])
        .args([
            "--login",
            "--pin",
            pin.trim(),
            "--list-objects",
            "--type",
            "secrkey",
        ])
        .env("SOFTHSM2_CONF", get("SOFTHSM2_CONF"))
        .output()
        .unwrap();
    let listed = text(&listed.stdout);
    assert!(listed.contains("probity-dataset-kek"), "{listed}");
    assert!(!listed.contains("alice"), "{listed}");
    // And the erased key may not encrypt any more.
    let out = ring.run(
        &[
            "encrypt",
            &in2,
            "-o",
            &p("late.enc"),
            "--key",
            "subject/alice",
            "--principal",
            r#"User::"alice""#,
        ],
        T0 + 3 * DAY,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("security.key-not-active"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn keys_without_an_hsm_say_so_and_a_wrong_pin_is_its_own_error() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let out = probity_env(
        &[
            "keys",
            "create",
            "k",
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("not an HSM"),
        "{}",
        text(&out.stderr)
    );

    let vars = softhsm_env(&tmp.path().join("hsm"), "probity-keys-pin");
    let bad_pin = tmp.path().join("bad.pin");
    std::fs::write(&bad_pin, "000000\n").unwrap();
    super::set_mode(&bad_pin, 0o600);
    let mut env = env_of(&vars);
    env.retain(|(k, _)| *k != "PROBITY_HSM_PIN_FILE");
    env.push(("PROBITY_HSM_PIN_FILE", bad_pin.as_os_str()));
    let out = probity_env(
        &[
            "keys",
            "create",
            "k2",
            "--state-dir",
            tmp.path().join("s2").to_str().unwrap(),
        ],
        &env,
    );
    assert_eq!(out.status.code(), Some(8));
    assert!(text(&out.stderr).contains("PIN"), "{}", text(&out.stderr));
}
