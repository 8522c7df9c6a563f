//! RAPL: powercap trees built in a temporary directory from the ttar fixtures, with
//! injected EACCES, ENODATA and EIO.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use probity_collect::rapl::{Rapl, RaplConfig, RaplError, RaplSampler, RealSysfs, Sysfs};
use probity_collect::source::{Failure, FileError};
use probity_collect::{CollectError, Collected, Unavailable, Value};

use crate::common::{extract_ttar, fixture};

const AREA: &str = "rapl";

/// Extracts a ttar fixture and returns the temp dir and the powercap root inside it.
fn tree(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    extract_ttar(&fixture(AREA, name), dir.path());
    let root = dir.path().join("fixtures/sys/class/powercap");
    (dir, root)
}

fn config(root: &Path, include_dram: bool) -> RaplConfig {
    RaplConfig {
        root: root.to_path_buf(),
        include_dram,
        ..RaplConfig::default()
    }
}

fn set_energy(root: &Path, zone: &str, uj: u64) {
    std::fs::write(root.join(zone).join("energy_uj"), format!("{uj}\n")).unwrap();
}

fn ids(s: &RaplSampler) -> Vec<(&str, &str)> {
    s.zones()
        .iter()
        .map(|z| (z.id.as_str(), z.name.as_str()))
        .collect()
}

#[test]
fn procfs_capture_sums_top_level_packages_only() {
    let (_dir, root) = tree("procfs-fixtures-powercap-excerpt.ttar");
    let s = RaplSampler::discover(&RealSysfs, config(&root, true)).unwrap();
    // core (intel-rapl:0:0) is inside package-0; `intel-rapl:a` is procfs' made-up package-10.
    assert_eq!(
        ids(&s),
        vec![
            ("intel-rapl:0", "package-0"),
            ("intel-rapl:a", "package-10")
        ]
    );
    assert_eq!(s.zones()[0].max_energy_range_uj, 262_143_328_850);
}

#[test]
fn procfs_capture_two_samples_give_watts() {
    let (_dir, root) = tree("procfs-fixtures-powercap-excerpt.ttar");
    let mut rapl = Rapl::with_sysfs(RealSysfs, config(&root, false));
    let t0 = Instant::now();
    let first = rapl.collect_at(t0);
    let r = &first.reading().unwrap().value;
    assert!(
        r.total_watts.is_absent(),
        "one reading is no power, not 0 W"
    );
    assert_eq!(r.interval, None);
    set_energy(&root, "intel-rapl:0", 240_422_366_267 + 150_000_000);
    set_energy(&root, "intel-rapl:a", 240_422_366_267 + 50_000_000);
    let second = rapl.collect_at(t0 + Duration::from_secs(2));
    let r = &second.reading().unwrap().value;
    assert_eq!(r.total_watts, Value::Present(100.0));
    assert_eq!(r.zones[0].watts, Value::Present(75.0));
    assert_eq!(r.interval, Some(Duration::from_secs(2)));
}

#[test]
fn own_tree_skips_subzones_psys_and_mmio_and_adds_dram_when_asked() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    let s = RaplSampler::discover(&RealSysfs, config(&root, false)).unwrap();
    assert_eq!(
        ids(&s),
        vec![("intel-rapl:0", "package-0"), ("intel-rapl:1", "package-1")]
    );
    let s = RaplSampler::discover(&RealSysfs, config(&root, true)).unwrap();
    assert_eq!(
        ids(&s),
        vec![
            ("intel-rapl:0", "package-0"),
            ("intel-rapl:0:2", "dram"),
            ("intel-rapl:1", "package-1"),
            ("intel-rapl:1:1", "dram"),
        ]
    );
}

#[test]
fn a_counter_wrap_is_counted_modulo_max_plus_one() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    let mut rapl = Rapl::with_sysfs(RealSysfs, config(&root, false));
    let t0 = Instant::now();
    assert!(rapl.collect_at(t0).reading().is_some());
    // package-1 was at 262100000000 of 262143328850: it wraps to 10000000.
    set_energy(&root, "intel-rapl:0", 120_100_000_000);
    set_energy(&root, "intel-rapl:1", 10_000_000);
    let c = rapl.collect_at(t0 + Duration::from_secs(1));
    let r = &c.reading().unwrap_or_else(|| panic!("{c:?}")).value;
    // (10000000 - 262100000000) mod 262143328851 = 53328851 µJ in 1 s.
    assert_eq!(r.zones[1].watts, Value::Present(53.328851));
    assert_eq!(r.zones[0].watts, Value::Present(100.0));
    assert_eq!(r.total_watts, Value::Present(153.328851));
}

#[test]
fn a_counter_going_backwards_is_an_error_not_a_huge_reading() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    let mut rapl = Rapl::with_sysfs(RealSysfs, config(&root, false));
    let t0 = Instant::now();
    assert!(rapl.collect_at(t0).reading().is_some());
    set_energy(&root, "intel-rapl:0", 119_999_000_000);
    set_energy(&root, "intel-rapl:1", 262_100_000_000);
    let c = rapl.collect_at(t0 + Duration::from_secs(1));
    match &c {
        Collected::Error {
            error: CollectError::Rapl(RaplError::Backwards { old, new, .. }),
            ..
        } => {
            assert_eq!((*old, *new), (120_000_000_000, 119_999_000_000));
            assert!(c_message(&c).contains("went backwards"));
        }
        other => panic!("expected Backwards, got {other:?}"),
    }
    // The next sample starts from the new readings.
    set_energy(&root, "intel-rapl:0", 119_999_000_000 + 80_000_000);
    set_energy(&root, "intel-rapl:1", 262_100_000_000 + 20_000_000);
    let c = rapl.collect_at(t0 + Duration::from_secs(2));
    assert_eq!(
        c.reading().unwrap().value.total_watts,
        Value::Present(100.0)
    );
}

fn c_message<T>(c: &Collected<T>) -> String {
    match c {
        Collected::Error { error, .. } => error.to_string(),
        _ => String::new(),
    }
}

#[test]
fn a_counter_above_its_range_is_an_error() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    set_energy(&root, "intel-rapl:0", 262_143_328_851);
    let c = Rapl::with_sysfs(RealSysfs, config(&root, false)).collect_at(Instant::now());
    assert!(
        matches!(
            c,
            Collected::Error {
                error: CollectError::Rapl(RaplError::AboveRange { .. }),
                ..
            }
        ),
        "{c:?}"
    );
}

#[test]
fn garbage_in_energy_uj_is_located() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    std::fs::write(root.join("intel-rapl:1/energy_uj"), "12x4\n").unwrap();
    let c = Rapl::with_sysfs(RealSysfs, config(&root, false)).collect_at(Instant::now());
    let msg = c_message(&c);
    assert!(
        msg.ends_with("intel-rapl:1/energy_uj: \"12x4\" is not an unsigned integer"),
        "{msg}"
    );
}

#[test]
fn a_missing_powercap_tree_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let c = Rapl::new(config(&dir.path().join("powercap"), false)).collect();
    assert!(
        matches!(
            c,
            Collected::Unavailable {
                reason: Unavailable::Missing { .. },
                ..
            }
        ),
        "{c:?}"
    );
    // A tree with no package zone (a VM's empty class directory) too.
    let c = Rapl::new(config(dir.path(), false)).collect();
    assert!(
        matches!(
            c,
            Collected::Unavailable {
                reason: Unavailable::Empty { .. },
                ..
            }
        ),
        "{c:?}"
    );
}

/// The real sysfs, except that reading one file name fails with an errno.
struct Failing {
    file: &'static str,
    errno: i32,
}

impl Sysfs for Failing {
    fn read(&self, path: &Path) -> Result<Vec<u8>, FileError> {
        if path.file_name().is_some_and(|n| n == self.file) {
            return Err(FileError::from_io(
                path,
                std::io::Error::from_raw_os_error(self.errno),
            ));
        }
        RealSysfs.read(path)
    }

    fn list(&self, dir: &Path) -> Result<Vec<String>, FileError> {
        RealSysfs.list(dir)
    }
}

const EACCES: i32 = 13;
const EIO: i32 = 5;
const ENODATA: i32 = 61;

#[test]
fn eacces_on_energy_uj_is_unavailable_with_the_reason() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    let sysfs = Failing {
        file: "energy_uj",
        errno: EACCES,
    };
    let c = Rapl::with_sysfs(sysfs, config(&root, false)).collect_at(Instant::now());
    match c {
        Collected::Unavailable {
            reason: reason @ Unavailable::PermissionDenied { .. },
            ..
        } => {
            let text = reason.to_string();
            assert!(text.contains("intel-rapl:0/energy_uj"), "{text}");
            assert!(text.contains("root only since Linux 5.10"), "{text}");
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
}

#[test]
fn enodata_and_eio_are_errors_naming_the_file() {
    for errno in [ENODATA, EIO] {
        let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
        let sysfs = Failing {
            file: "energy_uj",
            errno,
        };
        let c = Rapl::with_sysfs(sysfs, config(&root, false)).collect_at(Instant::now());
        match &c {
            Collected::Error {
                error: CollectError::Rapl(RaplError::File(FileError::Io { path, source })),
                ..
            } => {
                assert!(path.ends_with("intel-rapl:0/energy_uj"));
                assert_eq!(source.raw_os_error(), Some(errno));
            }
            other => panic!("errno {errno}: {other:?}"),
        }
    }
}

#[test]
fn eacces_on_max_energy_range_is_unavailable_too() {
    let (_dir, root) = tree("own-2socket-dram-psys-mmio.ttar");
    let sysfs = Failing {
        file: "max_energy_range_uj",
        errno: EACCES,
    };
    let r = RaplSampler::discover(&sysfs, config(&root, false));
    assert!(
        matches!(
            r,
            Err(Failure::Unavailable(Unavailable::PermissionDenied { .. }))
        ),
        "{r:?}"
    );
}
