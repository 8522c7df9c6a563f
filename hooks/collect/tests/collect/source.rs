//! The command runner, the file reader and staleness, with real commands and files.

use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use probity_collect::source::{CommandError, CommandSpec, FileError, Stream, read_regular_file};
use probity_collect::{Clock, Collected, Freshness, Reading};

#[test]
fn sleep_past_its_deadline_is_a_timeout() {
    let err = CommandSpec::new("sleep")
        .args(["10"])
        .timeout(Duration::from_millis(200))
        .run()
        .unwrap_err();
    assert!(
        matches!(err, CommandError::Timeout { timeout, .. } if timeout == Duration::from_millis(200)),
        "{err:?}"
    );
    assert!(err.to_string().contains("process group was killed"));
}

fn process_is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // A zombie waiting for its new parent to reap it is dead too.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

#[test]
fn a_timeout_kills_the_whole_process_group() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("child.pid");
    let err = CommandSpec::new("sh")
        .args([
            "-c".to_owned(),
            format!("sleep 30 & echo $! > {}; wait", pidfile.display()),
        ])
        .timeout(Duration::from_millis(300))
        .run()
        .unwrap_err();
    assert!(matches!(err, CommandError::Timeout { .. }), "{err:?}");
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The grandchild got SIGKILL with its group; wait (bounded) for it to disappear.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !process_is_gone(pid) {
        assert!(
            Instant::now() < deadline,
            "grandchild {pid} survived the group kill"
        );
        std::thread::yield_now();
    }
}

#[test]
fn yes_hits_the_output_cap() {
    let err = CommandSpec::new("yes")
        .output_limit(64 * 1024)
        .timeout(Duration::from_secs(20))
        .run()
        .unwrap_err();
    assert!(
        matches!(
            err,
            CommandError::OutputTooLarge {
                stream: Stream::Stdout,
                limit: 65536,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_flood_on_stderr_hits_the_cap_too() {
    let err = CommandSpec::new("sh")
        .args(["-c", "yes >&2"])
        .output_limit(4096)
        .run()
        .unwrap_err();
    assert!(
        matches!(
            err,
            CommandError::OutputTooLarge {
                stream: Stream::Stderr,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_missing_binary_is_not_found_and_its_source_unavailable() {
    let err = CommandSpec::new("/nonexistent/probity-tool")
        .run()
        .unwrap_err();
    assert!(matches!(err, CommandError::NotFound { .. }), "{err:?}");
    let c = probity_collect::nvidia_smi::NvidiaSmi::new()
        .binary("/nonexistent/nvidia-smi")
        .query_gpu();
    match c {
        Collected::Unavailable { reason, .. } => {
            assert_eq!(
                reason.to_string(),
                "/nonexistent/nvidia-smi is not installed"
            );
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
}

#[test]
fn output_over_exactly_the_cap_is_accepted() {
    let out = CommandSpec::new("head")
        .args(["-c", "4096", "/dev/zero"])
        .output_limit(4096)
        .run()
        .unwrap();
    assert_eq!(out.stdout.len(), 4096);
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(status.success());
    // Read on another thread so that a blocking open fails the test instead of hanging it.
    let (tx, rx) = mpsc::channel();
    let path = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(read_regular_file(&path, 1024));
    });
    let result = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("reading a FIFO blocked");
    assert!(
        matches!(result, Err(FileError::NotRegular { kind: "FIFO", .. })),
        "{result:?}"
    );
}

#[test]
fn a_device_is_refused() {
    assert!(matches!(
        read_regular_file("/dev/zero".as_ref(), 1024),
        Err(FileError::NotRegular {
            kind: "character device",
            ..
        })
    ));
}

#[test]
fn procfs_files_are_read_to_their_end() {
    // procfs reports size 0: the reader must read, not trust the size.
    let bytes = read_regular_file("/proc/self/status".as_ref(), 1 << 20).unwrap();
    assert!(String::from_utf8_lossy(&bytes).contains("Name:"));
}

#[derive(Debug)]
struct FixedClock(SystemTime);

impl Clock for FixedClock {
    fn now(&self) -> SystemTime {
        self.0
    }
}

#[test]
fn a_collected_reading_goes_stale_by_the_injected_clock() {
    let c = Collected::ok_now(42u32);
    let reading: &Reading<u32> = c.reading().unwrap();
    let t = reading.collected_at;
    let max = Duration::from_secs(60);
    assert_eq!(
        reading.freshness(max, &FixedClock(t + Duration::from_secs(59))),
        Freshness::Fresh
    );
    assert!(reading.is_stale(max, &FixedClock(t + Duration::from_secs(61))));
}
