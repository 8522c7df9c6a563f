//! Installing Probity as an operator does without Kubernetes: the Debian packages built
//! by scripts/build-deb.sh from this test binary's debug build, installed with apt into
//! a fresh Debian root (mmdebstrap, cached in /var/cache/probity/roots), run from the
//! installed paths as the package's `probity` user, its systemd units verified against
//! that root, lintian on both packages, and purged; and `probity serve`'s readiness
//! protocol (`Type=notify`) against a `NOTIFY_SOCKET` the test listens on.
//!
//! Needs root (chroot, mmdebstrap), cargo-deb, lintian and mmdebstrap (scripts/setup.sh)
//! and Debian's mirror (apt in the root, and the root itself the first time).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::{copy_policies, root, text};

/// The units the package ships.
const UNITS: [&str; 3] = [
    "probity.service",
    "probity-agent.service",
    "probity-baseline.service",
];

/// Cargo's target directory of this build: the binary is `<target>/debug/probity`.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_probity"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn run(what: &str, command: &mut Command) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e} (run scripts/setup.sh)"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// The two packages, built once for every test here: (probity, libprobity-dev).
fn packages() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let target = target_dir();
        // Earlier runs' packages (100 MB each time) go: only this run's stay.
        for entry in std::fs::read_dir(&target).unwrap().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with("debian-test-")
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let out = target.join(format!("debian-test-{}", std::process::id()));
        let built = run(
            "scripts/build-deb.sh --profile dev",
            Command::new("bash")
                .arg(root().join("scripts/build-deb.sh"))
                .args(["--profile", "dev", "--output"])
                .arg(&out)
                .env("CARGO_TARGET_DIR", &target)
                .current_dir(root()),
        );
        let listed = text(&built.stdout);
        let find = |prefix: &str| {
            listed
                .lines()
                .map(PathBuf::from)
                .find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
                })
                .unwrap_or_else(|| panic!("build-deb.sh printed no {prefix}*.deb: {listed}"))
        };
        (find("probity_0.1.0-1_"), find("libprobity-dev_0.1.0-1_"))
    })
}

/// A fresh Debian 12 root (minbase) in `dir`, unpacked from a cached tarball that
/// mmdebstrap makes the first time.
fn fresh_debian_root(dir: &Path) -> PathBuf {
    let cache = Path::new("/var/cache/probity/roots");
    let tarball = cache.join("bookworm-minbase.tar");
    if !tarball.is_file() {
        std::fs::create_dir_all(cache).unwrap();
        // mmdebstrap picks the format by the name's extension: .tar, or a directory.
        let partial = cache.join(format!("bookworm-minbase.{}.tar", std::process::id()));
        run(
            "mmdebstrap",
            Command::new("mmdebstrap")
                .args(["--quiet", "--variant=minbase", "bookworm"])
                .arg(&partial)
                .arg("http://deb.debian.org/debian"),
        );
        // A rename, so that a half-written tarball is never taken for the root.
        std::fs::rename(&partial, &tarball).unwrap();
    }
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    run(
        "tar",
        Command::new("tar")
            .arg("-C")
            .arg(&root)
            .arg("-xf")
            .arg(&tarball),
    );
    // apt in the root resolves names as the host does, and starts no service.
    std::fs::copy("/etc/resolv.conf", root.join("etc/resolv.conf")).unwrap();
    let policy_rc = root.join("usr/sbin/policy-rc.d");
    std::fs::write(&policy_rc, "#!/bin/sh\nexit 101\n").unwrap();
    std::fs::set_permissions(&policy_rc, std::fs::Permissions::from_mode(0o755)).unwrap();
    root
}

fn chroot(root: &Path, user: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new("chroot");
    if let Some(user) = user {
        command.arg(format!("--userspec={user}:{user}"));
    }
    command
        .arg(root)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .unwrap()
}

fn chroot_ok(root: &Path, user: Option<&str>, args: &[&str]) -> String {
    let out = chroot(root, user, args);
    assert!(
        out.status.success(),
        "chroot {args:?} failed: {}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// One HTTP/1.1 request on a Unix socket: (status, body).
fn unix_http(socket: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    crate::unix_http::unix_http(socket, method, path, body).unwrap()
}

/// The service manager's end of `$NOTIFY_SOCKET`.
pub(crate) struct NotifyListener {
    socket: UnixDatagram,
}

impl NotifyListener {
    pub(crate) fn bind(path: &Path) -> Self {
        let socket = UnixDatagram::bind(path).unwrap();
        // The service may run as another user.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        Self { socket }
    }

    /// The next message; panics after two minutes without one.
    pub(crate) fn next(&self, waiting_for: &str) -> String {
        let mut buf = [0u8; 4096];
        let n = self
            .socket
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no notification while waiting for {waiting_for}: {e}"));
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }
}

pub(crate) fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits for the child to exit and returns its status; a watchdog kills it after two
/// minutes (so a hung process fails the test, whose status then says it was killed).
pub(crate) fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let (done, exited) = std::sync::mpsc::channel::<()>();
    let pid = child.id().to_string();
    let watchdog = std::thread::spawn(move || {
        if exited.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
    });
    let status = child.wait().unwrap();
    let _ = done.send(());
    watchdog.join().unwrap();
    status
}

/// `probity serve` as systemd's `Type=notify` sees it: READY=1 only once the socket
/// answers, RELOADING=1 then READY=1 around each SIGHUP reload (a good set loads, a
/// broken one is refused and the old set keeps serving), STOPPING=1 at SIGTERM.
#[test]
fn serve_tells_systemd_when_it_is_ready_reloading_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let policies = copy_policies();
    let notify = NotifyListener::bind(&dir.path().join("notify"));
    let socket = dir.path().join("probity.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_probity"))
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg("--policies")
        .arg(policies.path())
        .env("NOTIFY_SOCKET", dir.path().join("notify"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let ready = notify.next("READY=1");
    let pid = child.id();
    assert!(ready.starts_with("READY=1\n"), "{ready}");
    assert!(ready.contains(&format!("\nMAINPID={pid}")), "{ready}");
    assert!(
        ready.contains("STATUS=serving 43 policies, digest "),
        "{ready}"
    );
    // Ready means ready: the socket answers at once, with no retry.
    let (status, body) = unix_http(&socket, "GET", "/readyz", "");
    assert_eq!(status, 200, "{body}");

    signal(&child, "HUP");
    let reloading = notify.next("RELOADING=1");
    assert!(
        reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
        "{reloading}"
    );
    let reloaded = notify.next("READY=1 after the reload");
    assert!(
        reloaded.starts_with("READY=1\nSTATUS=policies reloaded; serving 43 policies"),
        "{reloaded}"
    );

    // A broken file: the reload is refused, the previous 43 policies keep serving.
    std::fs::write(
        policies.path().join("security/broken.cedar"),
        "forbid (principal, action, resource) when { nonsense };",
    )
    .unwrap();
    signal(&child, "HUP");
    assert!(notify.next("RELOADING=1").starts_with("RELOADING=1\n"));
    let refused = notify.next("READY=1 after the refused reload");
    assert!(
        refused.starts_with(
            "READY=1\nSTATUS=reload refused; the previous policies keep serving: \
             policy set rejected: 1 problem "
        ),
        "{refused}"
    );
    assert!(refused.contains("broken.cedar"), "{refused}");
    assert!(
        refused.contains("; serving 43 policies, digest "),
        "{refused}"
    );
    let (status, _) = unix_http(&socket, "GET", "/healthz", "");
    assert_eq!(status, 200);

    signal(&child, "TERM");
    assert_eq!(notify.next("STOPPING=1"), "STOPPING=1");
    assert!(wait_exit(&mut child).success());
}

/// The package from apt in a fresh Debian root: the user, the directories and their
/// modes, the conffiles, man pages, completions and pkg-config file; `probity check`,
/// `probity eval` and `probity serve` from the installed paths as the `probity` user;
/// the units verified against the root, with the exposure scores README states; and a
/// purge that removes the state.
#[test]
fn the_debian_package_installs_into_a_fresh_debian_root_runs_there_and_purges() {
    let (probity_deb, dev_deb) = packages();
    let dir = tempfile::tempdir().unwrap();
    let root = fresh_debian_root(dir.path());
    for deb in [probity_deb, dev_deb] {
        std::fs::copy(deb, root.join("tmp").join(deb.file_name().unwrap())).unwrap();
    }
    let in_root = |deb: &PathBuf| format!("/tmp/{}", deb.file_name().unwrap().to_string_lossy());
    chroot_ok(&root, None, &["apt-get", "update", "-qq"]);
    chroot_ok(
        &root,
        None,
        &[
            "apt-get",
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            &in_root(probity_deb),
            &in_root(dev_deb),
        ],
    );

    // The user and the directories, with the modes README promises.
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    let user = passwd
        .lines()
        .find(|l| l.starts_with("probity:"))
        .unwrap_or_else(|| panic!("no probity user: {passwd}"));
    let fields: Vec<&str> = user.split(':').collect();
    let uid: u32 = fields[2].parse().unwrap();
    assert!(uid < 1000, "a system user: {user}");
    assert_eq!(fields[6], "/usr/sbin/nologin", "{user}");
    for (path, mode) in [
        ("var/lib/probity", 0o700),
        ("var/lib/probity-agent", 0o700),
        ("run/probity", 0o750),
    ] {
        let meta = std::fs::metadata(root.join(path)).unwrap();
        assert_eq!(meta.mode() & 0o7777, mode, "/{path}");
        assert_eq!(meta.uid(), uid, "/{path}");
    }
    let conffiles =
        std::fs::read_to_string(root.join("var/lib/dpkg/info/probity.conffiles")).unwrap();
    for file in [
        "/etc/probity/probity-server.toml",
        "/etc/probity/agent.toml",
        "/etc/probity/policies/probity.cedarschema",
        "/etc/probity/policies/probity.toml",
        "/etc/probity/policies/security/blocklist.cedar",
    ] {
        assert!(
            conffiles.lines().any(|l| l == file),
            "{file} not a conffile: {conffiles}"
        );
    }
    for file in [
        "usr/share/man/man1/probity.1.gz",
        "usr/share/man/man1/probity-serve.1.gz",
        "usr/share/man/man1/probity-agent.1.gz",
        "usr/share/bash-completion/completions/probity",
        "usr/share/zsh/vendor-completions/_probity",
        "usr/share/fish/vendor_completions.d/probity.fish",
        "usr/share/probity/prometheus/probity.rules.yml",
        "usr/share/probity/slurm/job_submit.lua",
        "usr/include/probity.h",
        "usr/lib/x86_64-linux-gnu/libprobity.so",
    ] {
        assert!(root.join(file).is_file(), "/{file} not installed");
    }
    // The pkg-config file names the installed paths, with no rpath into a build tree.
    let pc = std::fs::read_to_string(root.join("usr/lib/x86_64-linux-gnu/pkgconfig/probity.pc"))
        .unwrap();
    assert!(pc.contains("prefix=/usr\n"), "{pc}");
    assert!(
        pc.contains("libdir=${prefix}/lib/x86_64-linux-gnu\n"),
        "{pc}"
    );
    assert!(!pc.contains("rpath") && !pc.contains("target"), "{pc}");

    // Run from the installed paths, as the probity user.
    let version = chroot_ok(&root, Some("probity"), &["/usr/bin/probity", "--version"]);
    assert!(version.starts_with("probity 0.1.0 (commit "), "{version}");
    assert!(version.contains("built in: cedar policies"), "{version}");
    let check = chroot_ok(
        &root,
        Some("probity"),
        &["/usr/bin/probity", "check", "/etc/probity/policies"],
    );
    assert!(check.starts_with("ok: 43 policies in 9 files"), "{check}");
    for (file, source) in [
        ("cluster.json", "testdata/entities/cluster.json"),
        ("hot.json", "testdata/requests/schedule-hot-zone.json"),
    ] {
        std::fs::copy(crate::root().join(source), root.join("tmp").join(file)).unwrap();
    }
    let out = chroot(
        &root,
        Some("probity"),
        &[
            "/usr/bin/probity",
            "eval",
            "--policies",
            "/etc/probity/policies",
            "--entities",
            "/tmp/cluster.json",
            "--request",
            "/tmp/hot.json",
        ],
    );
    // Exit 1: denied (README's exit codes).
    let eval = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{eval}{}", text(&out.stderr));
    let decision: serde_json::Value = serde_json::from_str(&eval).unwrap();
    assert_eq!(decision["decision"], "deny", "{eval}");
    assert_eq!(
        decision["reasons"][0]["policy"], "thermal.zone-power-ceiling",
        "{eval}"
    );

    // The sidecar as probity.service runs it: its ExecStart, as its User, ready by
    // NOTIFY_SOCKET, answering on /run/probity/probity.sock.
    let notify = NotifyListener::bind(&root.join("tmp/notify"));
    let mut serve = Command::new("chroot")
        .arg("--userspec=probity:probity")
        .arg(&root)
        .args(exec_start(&root, "probity.service"))
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("NOTIFY_SOCKET", "/tmp/notify")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ready = notify.next("READY=1 from the installed sidecar");
    assert!(ready.starts_with("READY=1\n"), "{ready}");
    let socket = root.join("run/probity/probity.sock");
    let (status, body) = unix_http(&socket, "GET", "/readyz", "");
    assert_eq!(status, 200, "{body}");
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660);
    assert_eq!((meta.uid(), meta.gid()), (uid, uid));
    signal(&serve, "TERM");
    assert!(wait_exit(&mut serve).success());
    // What it wrote in its state directory is its own, and nobody else's.
    assert!(root.join("var/lib/probity/state.redb").is_file());
    for entry in std::fs::read_dir(root.join("var/lib/probity")).unwrap() {
        let meta = entry.as_ref().unwrap().metadata().unwrap();
        assert_eq!(meta.uid(), uid, "{:?}", entry.unwrap().path());
        assert_eq!(meta.mode() & 0o077, 0, "{:?}", entry.unwrap().path());
    }

    verify_units(&root);

    // A purge takes the state and the configuration; the user stays, as Debian's do.
    chroot_ok(&root, None, &["apt-get", "purge", "-y", "-qq", "probity"]);
    for path in ["var/lib/probity", "etc/probity", "usr/bin/probity"] {
        assert!(!root.join(path).exists(), "/{path} survived the purge");
    }
}

/// The unit's ExecStart, split on spaces (the units quote nothing).
fn exec_start(root: &Path, unit: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root.join("usr/lib/systemd/system").join(unit)).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap_or_else(|| panic!("{unit} has no ExecStart"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// `systemd-analyze verify` against the installed root passes (and fails once the
/// binary its ExecStart names is gone), and `systemd-analyze security` gives each unit
/// the exposure score README states.
fn verify_units(root: &Path) {
    let root_arg = format!("--root={}", root.display());
    // --man=no: the man pages are in the root, where systemd-analyze's `man` does not look
    // (their presence is asserted above).
    let verify = |units: &[&str]| {
        Command::new("systemd-analyze")
            .args(["verify", "--man=no", &root_arg])
            .args(units)
            .output()
            .unwrap()
    };
    let out = verify(&UNITS);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let binary = root.join("usr/bin/probity");
    let moved = root.join("usr/bin/probity.moved");
    std::fs::rename(&binary, &moved).unwrap();
    let out = verify(&["probity.service"]);
    std::fs::rename(&moved, &binary).unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Command /usr/bin/probity is not executable"),
        "{}",
        text(&out.stderr)
    );

    let readme = std::fs::read_to_string(crate::root().join("README.md")).unwrap();
    for unit in UNITS {
        let out = run(
            "systemd-analyze security",
            Command::new("systemd-analyze").args([
                "security",
                "--offline=true",
                &root_arg,
                "--no-pager",
                unit,
            ]),
        );
        let report = text(&out.stdout);
        let line = format!("Overall exposure level for {unit}: ");
        let score = report
            .lines()
            .find_map(|l| l.split_once(&line).map(|(_, rest)| rest.to_owned()))
            .unwrap_or_else(|| panic!("no score for {unit}: {report}"));
        let score = score.split_whitespace().next().unwrap();
        let stated = format!("| `{unit}` | {score} |");
        assert!(
            readme.contains(&stated),
            "README must state {unit}'s exposure as {score} (a row starting {stated:?})"
        );
    }
}

/// lintian finds nothing in either package that the package does not explain: every
/// remaining tag is overridden in usr/share/lintian/overrides with its reason.
#[test]
fn lintian_finds_nothing_unexplained_in_either_package() {
    let (probity_deb, dev_deb) = packages();
    for deb in [probity_deb, dev_deb] {
        let out = Command::new("lintian")
            .args(["--tag-display-limit", "0", "--fail-on", "error,warning"])
            .arg(deb)
            .output()
            .unwrap_or_else(|e| panic!("lintian: {e} (run scripts/setup.sh)"));
        let report = text(&out.stdout);
        let tags: Vec<&str> = report
            .lines()
            .filter(|l| l.starts_with("E: ") || l.starts_with("W: "))
            .collect();
        assert!(
            out.status.success() && tags.is_empty(),
            "lintian on {}: {}\n{report}{}",
            deb.display(),
            out.status,
            text(&out.stderr)
        );
    }
}
