//! nvidia-smi: the sections cut from the real captures, our own 8-GPU and schema fixtures,
//! bad input, and the source against test doubles of the tool.

use std::time::Duration;

use probity_collect::nvidia_smi::{
    self, Columns, CsvError, MigMode, NvidiaSmi, PowerDraw, PowerKind, QUERY_GPU_FIELDS,
};
use probity_collect::source::{CommandError, Status};
use probity_collect::{Absent, CollectError, Collected, Unavailable, Value};

use crate::common::{fixture, fixture_names, fixture_path, script};

const AREA: &str = "nvidia-smi";

fn power(watts: f64, kind: PowerKind) -> Value<PowerDraw> {
    Value::Present(PowerDraw { watts, kind })
}

#[test]
fn every_cut_section_and_own_fixture_parses() {
    let mut parsed = 0;
    for name in fixture_names(AREA) {
        if name.starts_with("own-bad-") {
            continue;
        }
        let bytes = fixture(AREA, &name);
        if name.ends_with(".query-gpu.csv") {
            let gpus = nvidia_smi::parse_query_gpu(&bytes, Columns::Header)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!gpus.is_empty(), "{name}");
        } else if name.ends_with(".csv") {
            let t = nvidia_smi::parse_table(&bytes, Columns::Header)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(t.fields().contains(&"gpu_uuid".to_owned()), "{name}");
        } else if name.ends_with(".q.txt") {
            let r = nvidia_smi::parse_query_text(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                r.driver_version,
                Value::Present("590.48.01".into()),
                "{name}"
            );
            assert_eq!(r.gpus.len(), 1, "{name}");
        } else if name.ends_with(".q.xml") {
            let r = nvidia_smi::parse_query_xml(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!r.gpus.is_empty(), "{name}");
        } else {
            continue;
        }
        parsed += 1;
    }
    // 3 captures × 10 sections, and 5 fixtures of our own.
    assert_eq!(parsed, 35);
}

#[test]
fn h200_query_gpu_capture_values() {
    let idle = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "h200-590.48.01.idle.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    let g = &idle[0];
    assert_eq!(g.driver_version, Value::Present("590.48.01".into()));
    assert_eq!(g.name, Value::Present("NVIDIA H200".into()));
    assert_eq!(g.pci_bus_id, Value::Present("00000000:83:00.0".into()));
    assert_eq!(g.index, Value::Present(0));
    assert_eq!(g.temperature_c, Value::Present(28.0));
    // Both printed: the instant reading is used, and says so.
    assert_eq!(g.power, power(78.21, PowerKind::Instant));
    assert_eq!(g.power_limit_w, Value::Present(700.0));
    assert_eq!(g.memory_total_mib, Value::Present(143_771));
    assert_eq!(g.memory_used_mib, Value::Present(0));
    assert_eq!(g.mig_mode, Value::Present(MigMode::Disabled));
    // SXM: no fan speed. Absent, not 0.
    assert_eq!(g.fan_speed_pct, Value::Absent(Absent::NotAvailable));

    let load = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "h200-590.48.01.load.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    assert_eq!(load[0].temperature_c, Value::Present(52.0));
    assert_eq!(load[0].power, power(626.26, PowerKind::Instant));
    assert_eq!(load[0].memory_used_mib, Value::Present(32_362));
}

#[test]
fn h100_capture_values_from_csv_and_text_agree() {
    let csv = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "h100-80gb-hbm3-590.48.01.load.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    let q = nvidia_smi::parse_query_text(&fixture(AREA, "h100-80gb-hbm3-590.48.01.load.q.txt"))
        .unwrap();
    let g = &q.gpus[0];
    assert_eq!(csv[0].name, Value::Present("NVIDIA H100 80GB HBM3".into()));
    assert_eq!(g.product_name, csv[0].name);
    assert_eq!(g.uuid, csv[0].uuid);
    assert_eq!(g.temperature_c, Value::Present(59.0));
    assert_eq!(csv[0].temperature_c, Value::Present(59.0));
    assert_eq!(g.memory_total_mib, Value::Present(81_559));
    assert_eq!(g.memory_used_mib, Value::Present(19_818));
    assert_eq!(g.power, power(588.39, PowerKind::Instant));
    assert_eq!(g.power_limit_w, Value::Present(700.0));
    assert_eq!(q.cuda_version, Value::Present("13.1".into()));
    assert_eq!(g.pci_bus_id, "00000000:00:09.0");
    assert_eq!(g.minor_number, Value::Present(0));
    assert_eq!(g.fan_speed_pct, Value::Absent(Absent::NotAvailable));
}

#[test]
fn h200_mig_capture_has_mig_mode_and_devices() {
    let csv = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "h200-mig-590.48.01.idle.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    assert_eq!(csv.len(), 1, "MIG prints one row per physical GPU");
    assert_eq!(csv[0].mig_mode, Value::Present(MigMode::Enabled));
    assert_eq!(csv[0].memory_used_mib, Value::Present(55));
    let table = nvidia_smi::parse_table(
        &fixture(AREA, "h200-mig-590.48.01.idle.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    // Under MIG utilization is not reported: absent, not 0 %.
    let row = &table.rows()[0];
    assert_eq!(
        table.number(row, "utilization.gpu").unwrap(),
        Value::Absent(Absent::NotAvailable)
    );

    let q = nvidia_smi::parse_query_text(&fixture(AREA, "h200-mig-590.48.01.idle.q.txt")).unwrap();
    let g = &q.gpus[0];
    assert_eq!(g.mig_current, Value::Present(MigMode::Enabled));
    assert_eq!(g.mig_pending, Value::Present(MigMode::Enabled));
    type Row = (u32, u32, u32, Option<u64>, Option<u64>);
    let ids: Vec<Row> = g
        .mig_devices
        .iter()
        .map(|d| {
            (
                d.index,
                d.gpu_instance_id,
                d.compute_instance_id,
                d.memory_total_mib.value(),
                d.memory_used_mib.value(),
            )
        })
        .collect();
    assert_eq!(
        ids,
        vec![
            (0, 2, 0, Some(71_424), Some(22)),
            (1, 2, 1, Some(71_424), Some(22)),
            (2, 3, 0, Some(33_280), Some(17)),
            (3, 9, 0, Some(16_384), Some(9)),
            (4, 10, 0, Some(16_384), Some(9)),
        ]
    );
    assert_eq!(g.temperature_c, Value::Present(28.0));
    assert_eq!(g.power, power(77.88, PowerKind::Instant));
}

#[test]
fn compute_apps_capture_reads_as_a_table() {
    let t = nvidia_smi::parse_table(
        &fixture(AREA, "h200-mig-590.48.01.load.query-compute-apps.csv"),
        Columns::Header,
    )
    .unwrap();
    assert_eq!(t.rows().len(), 3);
    let row = &t.rows()[2];
    assert_eq!(t.text(row, "process_name"), Value::Present("./gpu_burn"));
    assert_eq!(
        t.number(row, "used_gpu_memory").unwrap(),
        Value::Present(13_526.0)
    );
    assert_eq!(row.line(), 4);
}

#[test]
fn own_8gpu_csv_and_xml_agree() {
    let csv = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "own-8gpu-h100.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    let xml = nvidia_smi::parse_query_xml(&fixture(AREA, "own-8gpu-h100.q.xml")).unwrap();
    assert_eq!(csv.len(), 8);
    assert_eq!(xml.gpus.len(), 8);
    assert_eq!(xml.driver_version, Value::Present("570.133.20".into()));
    assert_eq!(xml.cuda_version, Value::Present("12.8".into()));
    for (c, x) in csv.iter().zip(&xml.gpus) {
        assert_eq!(c.uuid, x.uuid);
        assert_eq!(c.temperature_c, x.temperature_c);
        assert_eq!(c.power, x.power);
        assert_eq!(c.memory_used_mib, x.memory_used_mib);
        assert_eq!(c.pci_bus_id.get(), Some(&x.pci_bus_id));
        assert_eq!(c.mig_mode, x.mig_current);
        assert!(x.mig_devices.is_empty());
    }
    assert_eq!(csv[5].temperature_c, Value::Present(71.0));
    assert_eq!(xml.gpus[5].power, power(699.95, PowerKind::Instant));
    assert_eq!(csv[7].index, Value::Present(7));
}

#[test]
fn xml_schemas_v11_and_v12_power_and_mig() {
    let t4 = nvidia_smi::parse_query_xml(&fixture(AREA, "own-t4-v11.q.xml")).unwrap();
    let g = &t4.gpus[0];
    assert_eq!(g.power, power(26.78, PowerKind::Draw));
    assert_eq!(g.power_limit_w, Value::Present(70.0));
    assert_eq!(g.mig_current, Value::Absent(Absent::NotAvailable));
    assert_eq!(g.temperature_c, Value::Present(40.0));

    let a100 = nvidia_smi::parse_query_xml(&fixture(AREA, "own-a100-mig-v12.q.xml")).unwrap();
    let g = &a100.gpus[0];
    // gpu_power_readings, never module_power_readings (whose draw is N/A here).
    assert_eq!(g.power, power(88.12, PowerKind::Draw));
    assert_eq!(g.mig_current, Value::Present(MigMode::Enabled));
    assert_eq!(g.mig_pending, Value::Present(MigMode::Disabled));
    assert_eq!(g.minor_number, Value::Present(3));
    assert_eq!(g.mig_devices.len(), 3);
    assert_eq!(g.mig_devices[1].gpu_instance_id, 5);
    assert_eq!(g.mig_devices[1].memory_total_mib, Value::Present(19_968));
    assert_eq!(
        g.mig_devices[2].memory_used_mib,
        Value::Absent(Absent::NotAvailable)
    );
}

#[test]
fn placeholders_are_absent_never_zero() {
    let gpus = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "own-placeholders.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap();
    let g0 = &gpus[0];
    assert_eq!(g0.temperature_c, Value::Absent(Absent::NotAvailable));
    assert_eq!(g0.power, Value::Absent(Absent::NotSupported));
    assert_eq!(g0.memory_used_mib, Value::Absent(Absent::NotAvailable));
    assert_eq!(g0.mig_mode, Value::Absent(Absent::NotAvailable));
    let g1 = &gpus[1];
    let lost = Value::Absent(Absent::Failed("GPU is lost".into()));
    assert_eq!(g1.power, lost);
    let unknown = Absent::Failed("Unknown Error".into());
    assert_eq!(g1.temperature_c, Value::Absent(unknown.clone()));
    assert_eq!(g1.memory_used_mib, Value::Absent(unknown.clone()));
    assert_eq!(g1.mig_mode, Value::Absent(unknown));
    let g2 = &gpus[2];
    assert_eq!(g2.temperature_c, Value::Absent(Absent::NotAvailable));
    assert_eq!(g2.power, power(98.5, PowerKind::Draw));
    assert_eq!(g2.power_limit_w, Value::Absent(Absent::NotSupported));
    assert_eq!(g2.mig_mode, Value::Present(MigMode::Enabled));
    for g in &gpus {
        assert_ne!(g.temperature_c.value(), Some(0.0));
    }
}

#[test]
fn truncated_csv_is_an_error_naming_the_line() {
    let err = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "own-bad-truncated.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap_err();
    assert_eq!(
        err,
        CsvError::ColumnCount {
            line: 3,
            expected: 13,
            found: 5
        }
    );
    assert_eq!(err.to_string(), "line 3: 5 columns, expected 13");
}

#[test]
fn a_non_numeric_reading_is_an_error_naming_line_and_field() {
    let err = nvidia_smi::parse_query_gpu(
        &fixture(AREA, "own-bad-non-numeric.query-gpu.csv"),
        Columns::Header,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "line 3, column 2 (temperature.gpu): \"hot\" is not a number"
    );
}

#[test]
fn noheader_formats_take_the_queried_fields() {
    let with_units = b"0, GPU-x, 41, 70.5 W, 71.25 W, 81559 MiB, Disabled\n";
    let fields = &[
        "index",
        "uuid",
        "temperature.gpu",
        "power.draw",
        "power.draw.instant",
        "memory.total",
        "mig.mode.current",
    ];
    let a = nvidia_smi::parse_query_gpu(with_units, Columns::Given(fields)).unwrap();
    let b = nvidia_smi::parse_query_gpu(
        b"0, GPU-x, 41, 70.5, 71.25, 81559, Disabled\n",
        Columns::Given(fields),
    )
    .unwrap();
    assert_eq!(a[0].power, power(71.25, PowerKind::Instant));
    assert_eq!(a[0].uuid, b[0].uuid);
    assert_eq!(a[0].power, b[0].power);
    assert_eq!(a[0].memory_total_mib, b[0].memory_total_mib);
    // Too many columns for the fields given.
    assert!(matches!(
        nvidia_smi::parse_query_gpu(
            b"0, GPU-x, 41, 1, 2, 3, Disabled, 9\n",
            Columns::Given(fields)
        ),
        Err(CsvError::ColumnCount {
            line: 1,
            expected: 7,
            found: 8
        })
    ));
}

// --- the source, against test doubles of nvidia-smi -------------------------------------

#[test]
fn source_runs_the_query_and_parses_it() {
    let dir = tempfile::tempdir().unwrap();
    let csv = fixture_path(AREA, "own-8gpu-h100.query-gpu.csv");
    let expected_args = format!(
        "--query-gpu={} --format=csv,nounits",
        QUERY_GPU_FIELDS.join(",")
    );
    let fake = script(
        dir.path(),
        "nvidia-smi",
        &format!(
            "[ \"$*\" = \"{expected_args}\" ] || {{ echo \"bad args: $*\" >&2; exit 9; }}\ncat {}",
            csv.display()
        ),
    );
    let c = NvidiaSmi::new().binary(&fake).query_gpu();
    let gpus = &c.reading().unwrap_or_else(|| panic!("{c:?}")).value;
    assert_eq!(gpus.len(), 8);
    assert_eq!(gpus[3].power, power(661.3, PowerKind::Instant));
}

#[test]
fn source_retries_without_fields_an_old_driver_does_not_know() {
    let dir = tempfile::tempdir().unwrap();
    let fake = script(
        dir.path(),
        "nvidia-smi",
        r#"case "$*" in
  *power.draw.instant*) echo 'Field "power.draw.instant" is not a valid field to query.'; exit 2;;
esac
echo 'index, power.draw'
echo '0, 61.5'"#,
    );
    let c = NvidiaSmi::new().binary(&fake).query_gpu();
    let gpus = &c.reading().unwrap_or_else(|| panic!("{c:?}")).value;
    assert_eq!(gpus[0].power, power(61.5, PowerKind::Draw));
}

#[test]
fn source_reports_a_hung_tool_as_a_timeout_error() {
    let dir = tempfile::tempdir().unwrap();
    let fake = script(dir.path(), "nvidia-smi", "exec sleep 30");
    let c = NvidiaSmi::new()
        .binary(&fake)
        .timeout(Duration::from_millis(200))
        .query_gpu();
    match c {
        Collected::Error {
            error: CollectError::Command(CommandError::Timeout { .. }),
            ..
        } => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn source_reports_no_devices_as_unavailable_and_garbage_as_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let none = script(dir.path(), "none", "echo 'No devices were found'; exit 6");
    match NvidiaSmi::new().binary(&none).query_gpu() {
        Collected::Unavailable {
            reason: Unavailable::NoDevice { message, .. },
            ..
        } => assert_eq!(message, "No devices were found"),
        other => panic!("{other:?}"),
    }
    let garbage = script(dir.path(), "garbage", "printf '\\377\\376 not csv'");
    let c = NvidiaSmi::new().binary(&garbage).query_gpu();
    assert_eq!(c.status(), Status::Error);
    let driver = script(
        dir.path(),
        "nodriver",
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9",
    );
    let c = NvidiaSmi::new().binary(&driver).query_gpu();
    assert_eq!(
        c.status(),
        Status::Error,
        "a broken driver is a failure, not an absence"
    );
}

#[test]
fn source_runs_q_x_and_parses_it() {
    let dir = tempfile::tempdir().unwrap();
    let xml = fixture_path(AREA, "own-8gpu-h100.q.xml");
    let fake = script(
        dir.path(),
        "nvidia-smi",
        &format!("[ \"$*\" = \"-q -x\" ] || exit 9\ncat {}", xml.display()),
    );
    let c = NvidiaSmi::new().binary(&fake).query_report();
    let r = &c.reading().unwrap_or_else(|| panic!("{c:?}")).value;
    assert_eq!(r.gpus.len(), 8);
}
