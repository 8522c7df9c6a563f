//! The container image: scripts/build-image.sh run once on this test binary's `probity`,
//! then its archive read the way a runtime reads it (index, manifest, configuration and
//! layer, each blob checked against its digest), its layer unpacked and run through
//! chroot as root and as the image's user, and packaging/image/Containerfile parsed to
//! check that the docker/podman build makes the same image.
//!
//! Needs root (mmdebstrap, chown, chroot), mmdebstrap and umoci (scripts/setup.sh), and
//! Debian's mirror the first time on a machine: the Debian root filesystem is cached in
//! /var/cache/probity/image. The build lives in the target directory
//! (image-test-<pid>): removed when every test here passed, otherwise kept for
//! inspection until the next run.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use serde_json::Value;

use crate::{root, text};

/// The image's user and group (the chart's runAsUser and fsGroup).
const UID: u32 = 65532;
/// How many tests share the build: the last to finish removes it.
const TESTS: usize = 5;

static BUILT: OnceLock<Result<Image, String>> = OnceLock::new();
static FINISHED: AtomicUsize = AtomicUsize::new(0);
static FAILED: AtomicBool = AtomicBool::new(false);

/// One build of the image, unpacked.
struct Image {
    /// Everything below: the script's output, the archive unpacked, the layer unpacked.
    dir: PathBuf,
    archive: PathBuf,
    /// The archive unpacked: an OCI image layout.
    layout: PathBuf,
    /// The image's only layer, unpacked.
    rootfs: PathBuf,
    index: Value,
    manifest: Value,
    config: Value,
}

/// A test's use of the shared build; the last one dropped removes it, unless a test
/// failed.
struct Shared(&'static Image);

impl std::ops::Deref for Shared {
    type Target = Image;
    fn deref(&self) -> &Image {
        self.0
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if std::thread::panicking() {
            FAILED.store(true, Ordering::SeqCst);
        }
        let finished = FINISHED.fetch_add(1, Ordering::SeqCst) + 1;
        if finished == TESTS && !FAILED.load(Ordering::SeqCst) {
            let _ = std::fs::remove_dir_all(&self.0.dir);
        }
    }
}

fn image() -> Shared {
    match BUILT.get_or_init(build) {
        Ok(image) => Shared(image),
        Err(e) => panic!("{e}"),
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(tool).is_file()))
}

fn build() -> Result<Image, String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| e.to_string())?;
    if text(&uid.stdout).trim() != "0" {
        return Err("the image tests run as root (mmdebstrap, chown, chroot)".into());
    }
    for tool in ["mmdebstrap", "umoci"] {
        if !on_path(tool) {
            return Err(format!("{tool} is missing: run scripts/setup.sh"));
        }
    }
    let binary = Path::new(env!("CARGO_BIN_EXE_probity"));
    let target = binary
        .parent()
        .and_then(Path::parent)
        .ok_or("the test binary is outside a target directory")?;
    // One directory per test process; those of processes that ended (a failed run's,
    // kept for inspection) go now.
    for entry in std::fs::read_dir(target).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if let Some(pid) = name.strip_prefix("image-test-")
            && (!Path::new("/proc").join(pid).exists() || pid == std::process::id().to_string())
        {
            std::fs::remove_dir_all(&path).map_err(|e| e.to_string())?;
        }
    }
    let dir = target.join(format!("image-test-{}", std::process::id()));
    std::fs::create_dir(&dir).map_err(|e| e.to_string())?;
    let out = dir.join("out");
    let run = Command::new("bash")
        .arg(root().join("scripts/build-image.sh"))
        .arg("--binary")
        .arg(binary)
        .arg("--out")
        .arg(&out)
        .output()
        .map_err(|e| e.to_string())?;
    let log = text(&run.stderr);
    if !run.status.success() {
        return Err(format!(
            "scripts/build-image.sh failed ({}), output in {}:\n{log}",
            run.status,
            dir.display()
        ));
    }
    eprintln!("{log}");
    let archive = PathBuf::from(text(&run.stdout).lines().last().unwrap_or_default());

    let layout = dir.join("layout");
    std::fs::create_dir(&layout).unwrap();
    tar(&["-xf"], &archive, &layout);
    let index = json(&layout.join("index.json"));
    let manifest = json(&blob(&layout, &index["manifests"][0]));
    let config = json(&blob(&layout, &manifest["config"]));
    let rootfs = dir.join("rootfs");
    std::fs::create_dir(&rootfs).unwrap();
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{manifest}");
    tar(
        &["--same-owner", "--numeric-owner", "-xzf"],
        &blob(&layout, &layers[0]),
        &rootfs,
    );
    Ok(Image {
        dir,
        archive,
        layout,
        rootfs,
        index,
        manifest,
        config,
    })
}

fn tar(args: &[&str], archive: &Path, into: &Path) {
    let out = Command::new("tar")
        .args(args)
        .arg(archive)
        .arg("-C")
        .arg(into)
        .output()
        .unwrap();
    assert!(out.status.success(), "tar {args:?}: {}", text(&out.stderr));
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The path of the blob a descriptor names, after checking its size and its digest
/// (with coreutils' sha256sum, an implementation of its own).
fn blob(layout: &Path, descriptor: &Value) -> PathBuf {
    let digest = descriptor["digest"].as_str().unwrap();
    let hex = digest.strip_prefix("sha256:").unwrap();
    let path = layout.join("blobs/sha256").join(hex);
    let size = std::fs::metadata(&path).unwrap().len();
    assert_eq!(Some(size), descriptor["size"].as_u64(), "{descriptor}");
    assert_eq!(sha256sum(&path), hex, "{}", path.display());
    path
}

fn sha256sum(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success());
    text(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

/// The chart's image reference: values.yaml's image.repository, and image.tag or else
/// Chart.yaml's appVersion.
fn chart_image() -> (String, String) {
    let chart = root().join("hooks/chart/probity");
    let values = std::fs::read_to_string(chart.join("values.yaml")).unwrap();
    let block: Vec<&str> = values
        .lines()
        .skip_while(|l| *l != "image:")
        .skip(1)
        .take_while(|l| l.starts_with(' ') || l.starts_with('#'))
        .collect();
    let value = |key: &str| {
        block
            .iter()
            .find_map(|l| l.trim().strip_prefix(key))
            .map(|v| v.trim().trim_matches('"').to_owned())
            .unwrap_or_else(|| panic!("no image.{key} in values.yaml"))
    };
    let repository = value("repository:");
    let tag = value("tag:");
    let tag = if tag.is_empty() { app_version() } else { tag };
    (repository, tag)
}

fn app_version() -> String {
    let chart = std::fs::read_to_string(root().join("hooks/chart/probity/Chart.yaml")).unwrap();
    chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .unwrap()
}

/// A `[workspace.package]` field of the workspace's Cargo.toml.
fn workspace_field(key: &str) -> String {
    let cargo = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    cargo
        .lines()
        .skip_while(|l| *l != "[workspace.package]")
        .take_while(|l| !l.starts_with("[dependencies") && !l.starts_with("[workspace.dep"))
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == key).then(|| v.trim().trim_matches('"').to_owned())
        })
        .unwrap()
}

/// A bash array or variable of scripts/build-image.sh (`name=(a b c)` or `name=value`).
fn script_words(name: &str) -> Vec<String> {
    let script = std::fs::read_to_string(root().join("scripts/build-image.sh")).unwrap();
    let line = script
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name}= in scripts/build-image.sh"));
    line.trim_start_matches('(')
        .split(')')
        .next()
        .unwrap()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

fn chroot(image: &Image, userspec: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new("chroot");
    if let Some(spec) = userspec {
        cmd.arg(format!("--userspec={spec}"));
    }
    cmd.arg(&image.rootfs).args(args).output().unwrap()
}

fn labels(config: &Value) -> BTreeMap<String, String> {
    config["config"]["Labels"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn the_archive_is_the_chart_image_with_verified_blobs_and_a_non_root_config() {
    let image = image();
    let version = env!("CARGO_PKG_VERSION");
    // One version everywhere: the crate's, the workspace's, the chart's appVersion.
    assert_eq!(workspace_field("version"), version);
    assert_eq!(app_version(), version, "Chart.yaml appVersion");
    // Every Probity container of the chart pulls the chart's image reference.
    let templates = root().join("hooks/chart/probity/templates");
    for (file, containers) in [
        ("sidecar-daemonset.yaml", 2),
        ("webhook-deployment.yaml", 1),
        ("controller-deployment.yaml", 1),
    ] {
        let yaml = std::fs::read_to_string(templates.join(file)).unwrap();
        let pulls = yaml
            .matches(r#"image: {{ include "probity.image" . }}"#)
            .count();
        assert_eq!(pulls, containers, "{file}");
    }
    let helpers = std::fs::read_to_string(templates.join("_helpers.tpl")).unwrap();
    assert!(
        helpers.contains(
            r#"printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag)"#
        ),
        "the probity.image helper changed: update chart_image() here"
    );
    let (repository, tag) = chart_image();
    assert_eq!((repository.as_str(), tag.as_str()), ("probity", version));

    // The archive: named after the reference, an OCI layout whose one manifest is
    // tagged with the chart's tag and named as containerd's CRI resolves the reference.
    assert_eq!(
        image.archive.file_name().unwrap().to_str().unwrap(),
        format!("{repository}-{tag}.oci.tar")
    );
    let layout = json(&image.layout.join("oci-layout"));
    assert_eq!(layout["imageLayoutVersion"], "1.0.0");
    let manifests = image.index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "{}", image.index);
    let annotations = &manifests[0]["annotations"];
    assert_eq!(
        annotations["org.opencontainers.image.ref.name"],
        tag.as_str()
    );
    assert_eq!(
        annotations["io.containerd.image.name"],
        format!("docker.io/library/{repository}:{tag}").as_str()
    );
    assert_eq!(
        manifests[0]["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        image.manifest["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    // The layer's uncompressed digest is the configuration's diff_id (what a runtime
    // checks when it unpacks).
    let layer = &image.manifest["layers"][0];
    assert_eq!(
        layer["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    let layer_path = blob(&image.layout, layer);
    let gunzip = Command::new("sh")
        .arg("-c")
        .arg("gzip -dc \"$1\" | sha256sum")
        .arg("sh")
        .arg(&layer_path)
        .output()
        .unwrap();
    assert!(gunzip.status.success());
    let diff_id = format!(
        "sha256:{}",
        text(&gunzip.stdout).split_whitespace().next().unwrap()
    );
    assert_eq!(strings(&image.config["rootfs"]["diff_ids"]), [diff_id]);

    // The configuration: the binary as entrypoint, the non-root user, the labels.
    let config = &image.config;
    assert_eq!(config["os"], "linux");
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    assert_eq!(config["architecture"], arch);
    let run = &config["config"];
    assert_eq!(strings(&run["Entrypoint"]), ["/usr/bin/probity"]);
    assert_eq!(run["User"], format!("{UID}:{UID}").as_str());
    assert_eq!(
        strings(&run["Cmd"]),
        [
            "serve",
            "--policies=/usr/share/probity/policies",
            "--state-dir=/var/lib/probity"
        ]
    );
    assert!(
        strings(&run["Env"]).contains(
            &"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned()
        ),
        "{run}"
    );
    let labels = labels(config);
    assert_eq!(labels["org.opencontainers.image.title"], "probity");
    assert_eq!(labels["org.opencontainers.image.version"], version);
    assert_eq!(
        labels["org.opencontainers.image.source"],
        workspace_field("repository")
    );
    assert_eq!(
        labels["org.opencontainers.image.licenses"],
        workspace_field("license")
    );
    // The revision is the commit the packaged binary reports.
    let reported = text(&chroot(&image, None, &["/usr/bin/probity", "--version"]).stdout);
    let commit = reported
        .lines()
        .next()
        .and_then(|l| l.split_once("(commit "))
        .and_then(|(_, c)| c.strip_suffix(')'))
        .unwrap();
    assert_eq!(labels["org.opencontainers.image.revision"], commit);
}

#[test]
fn the_root_filesystem_runs_probity_check_and_the_firewall_tools() {
    let image = image();
    let version = chroot(&image, None, &["/usr/bin/probity", "--version"]);
    assert!(version.status.success(), "{version:?}");
    assert!(
        text(&version.stdout).starts_with(&format!("probity {} ", env!("CARGO_PKG_VERSION"))),
        "{}",
        text(&version.stdout)
    );
    // The real policies, as root and as the image's user.
    for user in [None, Some("65532:65532")] {
        let check = chroot(
            &image,
            user,
            &["/usr/bin/probity", "check", "/usr/share/probity/policies"],
        );
        assert!(
            check.status.success(),
            "probity check as {user:?}: {}{}",
            text(&check.stdout),
            text(&check.stderr)
        );
    }
    // The image's policies are the repository's, file for file.
    let shipped = files(&root().join("policies"));
    let packaged = files(&image.rootfs.join("usr/share/probity/policies"));
    assert_eq!(
        shipped.keys().collect::<Vec<_>>(),
        packaged.keys().collect::<Vec<_>>()
    );
    assert!(shipped == packaged, "a policy differs from policies/");

    // The tools the agent runs, at the paths it runs them by default (hooks/firewall,
    // SourceConfig), the nf_tables variants under the plain names, and the legacy ones.
    let tools: [(&[&str], &str); 6] = [
        (&["/usr/sbin/nft", "--version"], "nftables v"),
        (&["/usr/sbin/iptables", "--version"], "(nf_tables)"),
        (&["/usr/sbin/iptables-save", "--version"], "(nf_tables)"),
        (&["/usr/sbin/ip6tables-save", "--version"], "(nf_tables)"),
        (&["/usr/sbin/iptables-legacy-save", "--version"], "(legacy)"),
        (
            &["/usr/sbin/ip6tables-legacy-save", "--version"],
            "(legacy)",
        ),
    ];
    for (args, says) in tools {
        let out = chroot(&image, None, args);
        let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(
            out.status.success() && said.contains(says),
            "{args:?}: {said}"
        );
    }

    // The user, by name, and the binary without debug information (symbols kept).
    let passwd = std::fs::read_to_string(image.rootfs.join("etc/passwd")).unwrap();
    assert!(
        passwd
            .lines()
            .any(|l| l.starts_with(&format!("probity:x:{UID}:{UID}:"))),
        "{passwd}"
    );
    let group = std::fs::read_to_string(image.rootfs.join("etc/group")).unwrap();
    assert!(group.lines().any(|l| l == format!("probity:x:{UID}:")));
    let sections = Command::new("readelf")
        .args(["-S", "-W"])
        .arg(image.rootfs.join("usr/bin/probity"))
        .output()
        .unwrap();
    let sections = text(&sections.stdout);
    assert!(sections.contains(".symtab"), "{sections}");
    // (.debug_gdb_scripts is loaded data, not debug information: strip keeps it.)
    for debug in [".debug_info", ".debug_line", ".debug_str"] {
        assert!(!sections.contains(debug), "{sections}");
    }
}

/// Every regular file under `dir`, by path relative to it, with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                found.insert(path.strip_prefix(dir).unwrap().to_owned(), bytes);
            }
        }
    }
    found
}

#[test]
fn the_default_command_serves_on_the_socket_as_the_non_root_user() {
    let image = image();
    let run = &image.config["config"];
    let user = run["User"].as_str().unwrap();
    let mut cmd = Command::new("chroot");
    cmd.arg(format!("--userspec={user}"))
        .arg(&image.rootfs)
        .args(strings(&run["Entrypoint"]))
        .args(strings(&run["Cmd"]))
        .env("NOTIFY_SOCKET", "/tmp/notify")
        .stderr(Stdio::piped());
    // Readiness as systemd hears it: the server says READY=1 once its socket accepts.
    let notify_path = image.rootfs.join("tmp/notify");
    let _ = std::fs::remove_file(&notify_path);
    let notify = crate::install::NotifyListener::bind(&notify_path);
    let child = cmd.spawn().unwrap();
    let ready = notify.next("READY=1 from the image's default command");
    assert!(ready.starts_with("READY=1\n"), "{ready}");
    drop(notify);
    std::fs::remove_file(&notify_path).unwrap();
    // The socket's default path, as the chart's sidecar mounts its directory.
    let socket = image.rootfs.join("run/probity/probity.sock");
    let health = std::os::unix::net::UnixStream::connect(&socket).and_then(|mut s| {
        use std::io::{Read, Write};
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: probity\r\nConnection: close\r\n\r\n")?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer)
    });
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let logs = text(&out.stderr);
    let health = health.unwrap_or_else(|e| panic!("{}: {e}\n{logs}", socket.display()));
    assert!(health.starts_with("HTTP/1.1 200"), "{health}\n{logs}");
    assert!(killed.success());
    assert_eq!(out.status.code(), Some(0), "{logs}");
    // The state the server made is its user's, in the image's state directory.
    let state = std::fs::metadata(image.rootfs.join("var/lib/probity/state.redb")).unwrap();
    assert_eq!((state.uid(), state.gid()), (UID, UID));
}

#[test]
fn the_root_filesystem_holds_no_shell_no_package_manager_and_no_setuid_file() {
    let image = image();
    let root_dir = &image.rootfs;
    // No shell (so `kubectl exec` gets none either), no package manager, no interpreter,
    // none of the tools the data-only packages' maintainer scripts would have needed.
    for absent in [
        "usr/bin/sh",
        "usr/bin/bash",
        "usr/bin/dash",
        "usr/bin/busybox",
        "usr/bin/apt",
        "usr/bin/apt-get",
        "usr/bin/dpkg",
        "usr/bin/perl",
        "usr/bin/openssl",
        "usr/bin/awk",
        "usr/bin/mawk",
        "usr/share/doc/libc6/changelog.Debian.gz",
        "usr/share/man",
        "var/lib/dpkg/status",
        "var/lib/apt",
        "etc/apt",
        "etc/resolv.conf",
        "etc/hostname",
    ] {
        assert!(
            root_dir.join(absent).symlink_metadata().is_err(),
            "{absent} is in the image"
        );
    }
    for entry in std::fs::read_dir(root_dir.join("usr/lib")).unwrap() {
        let path = entry.unwrap().path();
        if path.to_string_lossy().ends_with("-linux-gnu") {
            assert!(!path.join("gconv").exists(), "glibc's iconv modules");
        }
    }
    // No setuid or setgid file, no device node (the runtime makes /dev). (Directories
    // may be setgid: base-files' /var/local is.)
    let special = Command::new("find")
        .arg(root_dir)
        .args([
            "(", "-type", "f", "(", "-perm", "-4000", "-o", "-perm", "-2000", ")", ")", "-o",
            "-type", "c", "-o", "-type", "b",
        ])
        .output()
        .unwrap();
    assert!(special.status.success());
    assert_eq!(text(&special.stdout), "", "setuid, setgid or device files");

    // The package inventory scanners read: the script's packages and their
    // dependencies, without what only maintainer scripts needed.
    let inventory: BTreeSet<String> = std::fs::read_dir(root_dir.join("var/lib/dpkg/status.d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for p in script_words("packages")
        .iter()
        .chain(&script_words("data_only"))
    {
        assert!(
            inventory.contains(p),
            "{p} is not in status.d: {inventory:?}"
        );
        let control =
            std::fs::read_to_string(root_dir.join("var/lib/dpkg/status.d").join(p)).unwrap();
        assert!(control.starts_with(&format!("Package: {p}\n")), "{control}");
        assert!(control.contains("\nVersion: "), "{control}");
    }
    for p in [
        "perl-base",
        "openssl",
        "debconf",
        "dpkg",
        "apt",
        "bash",
        "coreutils",
    ] {
        assert!(!inventory.contains(p), "{p} is in the image: {inventory:?}");
    }
    let os_release = std::fs::read_to_string(root_dir.join("usr/lib/os-release")).unwrap();
    let suite = script_words("suite").join("");
    assert!(
        os_release.contains(&format!("VERSION_CODENAME={suite}")),
        "{os_release}"
    );
    // The trust store, bundled as update-ca-certificates would.
    let bundle =
        std::fs::read_to_string(root_dir.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
    assert!(
        bundle.matches("-----BEGIN CERTIFICATE-----").count() > 100,
        "{} certificates",
        bundle.matches("-----BEGIN CERTIFICATE-----").count()
    );

    // Small: everything but the probity binary fits in 32 MiB (12 MiB when written).
    let rest: u64 = sizes(root_dir)
        .into_iter()
        .filter(|(path, _)| path != Path::new("usr/bin/probity"))
        .map(|(_, size)| size)
        .sum();
    assert!(rest < 32 << 20, "{} MiB besides the binary", rest >> 20);
}

/// The size of every regular file under `dir` (symlinks not followed).
fn sizes(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let entry = entry.unwrap();
            let meta = entry.path().symlink_metadata().unwrap();
            if meta.is_dir() {
                dirs.push(entry.path());
            } else if meta.is_file() {
                found.push((
                    entry.path().strip_prefix(dir).unwrap().to_owned(),
                    meta.len(),
                ));
            }
        }
    }
    found
}

/// A Containerfile's instructions: comment lines dropped, continuation lines joined.
fn instructions(file: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut line = String::new();
    for raw in file.lines() {
        let t = raw.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(part) = t.strip_suffix('\\') {
            line.push_str(part);
            line.push(' ');
            continue;
        }
        line.push_str(t);
        let (op, rest) = line.split_once(' ').unwrap();
        found.push((op.to_owned(), rest.trim().to_owned()));
        line.clear();
    }
    found
}

/// `key="value" key2="value 2"` pairs.
fn label_pairs(text: &str) -> BTreeMap<String, String> {
    let mut pairs = BTreeMap::new();
    let mut rest = text.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let after = after.strip_prefix('"').unwrap();
        let (value, tail) = after.split_once('"').unwrap();
        pairs.insert(key.trim().to_owned(), value.to_owned());
        rest = tail.trim();
    }
    pairs
}

#[test]
fn the_containerfile_agrees_with_the_scripted_image() {
    let image = image();
    let file = std::fs::read_to_string(root().join("packaging/image/Containerfile")).unwrap();
    let ops = instructions(&file);
    let all = |op: &str| -> Vec<&String> {
        ops.iter()
            .filter(|(o, _)| o == op)
            .map(|(_, rest)| rest)
            .collect()
    };
    let one = |op: &str| -> String {
        let found = all(op);
        assert_eq!(found.len(), 1, "{op}: {found:?}");
        found[0].clone()
    };
    let args: BTreeMap<&str, &str> = all("ARG")
        .into_iter()
        .filter_map(|a| a.split_once('='))
        .collect();

    // The same Debian release, and a toolchain at least the workspace's rust-version.
    let suite = script_words("suite").join("");
    let froms = all("FROM");
    assert_eq!(froms.len(), 2, "{froms:?}");
    assert!(
        froms[0].contains(&format!("rust:${{RUST_VERSION}}-{suite}")),
        "{froms:?}"
    );
    assert_eq!(*froms[1], format!("docker.io/library/debian:{suite}-slim"));
    let minor = |v: &str| -> u32 { v.split('.').nth(1).unwrap().parse().unwrap() };
    assert!(minor(args["RUST_VERSION"]) >= minor(&workspace_field("rust-version")));

    // Every package it installs is in the scripted image (which adds what slim has).
    let runs = all("RUN");
    let install = runs
        .iter()
        .find_map(|r| r.split_once("--no-install-recommends "))
        .map(|(_, rest)| rest.split("&&").next().unwrap())
        .unwrap();
    let installed: BTreeSet<&str> = install.split_whitespace().collect();
    let scripted: Vec<String> = script_words("packages")
        .into_iter()
        .chain(script_words("data_only"))
        .collect();
    assert_eq!(
        installed,
        BTreeSet::from(["nftables", "iptables", "ca-certificates"])
    );
    for p in &installed {
        assert!(scripted.iter().any(|s| s == p), "{p} is not in the script");
    }

    // The user, the entrypoint, the default command.
    let run = &image.config["config"];
    assert_eq!(one("USER"), run["User"].as_str().unwrap());
    let entrypoint: Value = serde_json::from_str(&one("ENTRYPOINT")).unwrap();
    assert_eq!(strings(&entrypoint), strings(&run["Entrypoint"]));
    let cmd: Value = serde_json::from_str(&one("CMD")).unwrap();
    assert_eq!(strings(&cmd), strings(&run["Cmd"]));
    let users = runs
        .iter()
        .find(|r| r.contains("useradd"))
        .expect("a RUN with useradd");
    for flag in [format!("--uid {UID}"), format!("--gid {UID}")] {
        assert!(users.contains(&flag), "{users}");
    }
    assert!(users.contains(&format!("groupadd --system --gid {UID} probity")));
    assert!(users.contains("--shell /usr/sbin/nologin"), "{users}");

    // The directories it makes, with the same modes and owners in the scripted image.
    let mut made = Vec::new();
    for part in users.split("&&") {
        let words: Vec<&str> = part.split_whitespace().collect();
        if words.starts_with(&["install", "-d", "-m"]) {
            let (mode, owner, group, path) = (words[3], words[5], words[7], words[8]);
            let meta = image
                .rootfs
                .join(path.trim_start_matches('/'))
                .metadata()
                .unwrap();
            assert_eq!(
                format!("{:o}", meta.permissions().mode() & 0o7777),
                mode.trim_start_matches('0'),
                "{path}"
            );
            assert_eq!(
                (meta.uid().to_string(), meta.gid().to_string()),
                (owner.to_owned(), group.to_owned()),
                "{path}"
            );
            made.push(path.to_owned());
        }
    }
    assert_eq!(made, ["/var/lib/probity", "/run/probity"]);

    // What it copies lands where the scripted image has it.
    let copies = all("COPY");
    for (copy, dest) in [
        (
            "--from=build /out/probity /usr/bin/probity",
            "usr/bin/probity",
        ),
        (
            "policies /usr/share/probity/policies",
            "usr/share/probity/policies/probity.toml",
        ),
    ] {
        assert!(copies.iter().any(|c| *c == copy), "{copies:?}");
        assert!(image.rootfs.join(dest).is_file(), "{dest}");
    }
    // Stripped of debug information, as the script strips its binary.
    let env = all("ENV");
    assert!(
        env.iter()
            .any(|e| *e == "CARGO_PROFILE_RELEASE_STRIP=debuginfo"),
        "{env:?}"
    );

    // The same labels: equal values, but the version (the ARG's default, which must be
    // the crate's) and the revision (whatever commit each build is made from).
    let mut theirs = label_pairs(&one("LABEL"));
    let ours = labels(&image.config);
    assert_eq!(
        theirs.keys().collect::<Vec<_>>(),
        ours.keys().collect::<Vec<_>>()
    );
    assert_eq!(theirs["org.opencontainers.image.version"], "${VERSION}");
    assert_eq!(args["VERSION"], env!("CARGO_PKG_VERSION"));
    assert_eq!(theirs["org.opencontainers.image.revision"], "${REVISION}");
    for key in [
        "org.opencontainers.image.version",
        "org.opencontainers.image.revision",
    ] {
        theirs.remove(key);
    }
    for (key, value) in &theirs {
        assert_eq!(&ours[key], value, "{key}");
    }
}
