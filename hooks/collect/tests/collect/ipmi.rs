//! IPMI: every capture, our own power-reading and garbage fixtures, and the source against
//! test doubles and this machine's real ipmitool (which has no BMC).

use probity_collect::ipmi::{
    self, IpmiError, Ipmitool, PowerState, SensorReading, parse_dcmi_power, parse_sdr,
    parse_sdr_elist, parse_sensor,
};
use probity_collect::source::Status;
use probity_collect::{Absent, Collected, Unavailable, Value};

use crate::common::{fixture, fixture_path, script};

const AREA: &str = "ipmi";

#[test]
fn ibm_sdr_capture() {
    let t = parse_sdr(&fixture(AREA, "ipmitool-sdr-ibm-telegraf.txt")).unwrap();
    let r = t.readings();
    assert_eq!(r.power_w, Value::Present(210.0));
    assert_eq!(r.temperatures_c[0], ("Ambient Temp".to_owned(), 20.0));
    assert_eq!(r.fans_rpm[0], ("Fan 1A Tach".to_owned(), 2610.0));
    assert_eq!(r.fans_rpm.len(), 6);
    assert!(r.unread.contains(&"DASD Backplane 3".to_owned()));
    let fan1 = t.rows.iter().find(|r| r.name == "Fan 1").unwrap();
    assert_eq!(fan1.reading, SensorReading::Discrete("0x00".into()));
    let ns = t
        .rows
        .iter()
        .find(|r| r.name == "DASD Backplane 4")
        .unwrap();
    assert_eq!(ns.status, "ns");
    assert_eq!(ns.reading, SensorReading::Missing("Not Readable".into()));
}

#[test]
fn elist_capture_with_interleaved_stderr() {
    let t = parse_sdr_elist(&fixture(
        AREA,
        "ipmitool-sdr-elist-curated-with-errors-telegraf.txt",
    ))
    .unwrap();
    assert_eq!(t.rows.len(), 7);
    assert_eq!(
        t.diagnostics,
        vec![
            (6, "Unable to send command: Invalid argument".to_owned()),
            (8, "Unable to send command: Invalid argument".to_owned()),
        ]
    );
    let r = t.readings();
    // `110 Watts, Presence detected`: the only power sensor, a supply.
    assert_eq!(r.power_w, Value::Present(110.0));
    assert_eq!(r.temperatures_c, vec![("Inlet Temp".to_owned(), 25.0)]);
    assert_eq!(r.fans_rpm, vec![("Fan1".to_owned(), 5040.0)]);
    assert_eq!(r.unread, vec!["SEL".to_owned(), "Intrusion".to_owned()]);
    let usb = t.rows.iter().find(|r| r.name == "USB Cable Pres").unwrap();
    assert_eq!(usb.reading, SensorReading::State("Connected".into()));
    let amps = t.rows.iter().find(|r| r.name == "Current 1").unwrap();
    assert_eq!(
        amps.reading,
        SensorReading::Numeric {
            value: 7.2,
            unit: "Amps".into()
        }
    );
}

#[test]
fn supermicro_sensor_capture() {
    let t = parse_sensor(&fixture(AREA, "ipmitool-sensor-supermicro-gpu-lovoo.txt")).unwrap();
    let r = t.readings();
    assert_eq!(r.temperatures_c[0], ("CPU1 Temp".to_owned(), 33.0));
    assert_eq!(
        r.temperatures_c
            .iter()
            .find(|(n, _)| n == "System Temp")
            .map(|(_, v)| *v),
        Some(25.0)
    );
    for gpu in ["GPU1 Temp", "GPU2 Temp", "GPU3 Temp", "GPU4 Temp"] {
        assert!(r.unread.contains(&gpu.to_owned()), "{gpu}");
        assert!(!r.temperatures_c.iter().any(|(n, _)| n == gpu));
    }
    assert_eq!(
        r.fans_rpm,
        vec![
            ("FAN2".to_owned(), 3000.0),
            ("FAN3".to_owned(), 3150.0),
            ("FAN4".to_owned(), 3000.0)
        ]
    );
    assert_eq!(r.power_w, Value::Absent(Absent::NotAvailable));
    assert_eq!(t.rows.iter().filter(|r| r.name == "HDD Status").count(), 2);
    let intru = t.rows.iter().find(|r| r.name == "Chassis Intru").unwrap();
    assert_eq!(intru.reading, SensorReading::Discrete("0x0".into()));
    assert_eq!(intru.status, "0x0000");
    let vtt = t.rows.iter().find(|r| r.name == "VTT").unwrap();
    assert_eq!(
        vtt.reading,
        SensorReading::Numeric {
            value: 0.992,
            unit: "Volts".into()
        }
    );
}

#[test]
fn help_text_is_not_sensor_output() {
    let err = parse_sdr(&fixture(AREA, "ipmitool-1.8.19-help.txt")).unwrap_err();
    assert_eq!(
        err,
        IpmiError::Garbage {
            line: 1,
            text: "Commands:".into()
        }
    );
}

#[test]
fn dcmi_power_readings_in_every_layout() {
    let old =
        parse_dcmi_power(&fixture(AREA, "own-ipmitool-dcmi-power-reading-1.8.18.txt")).unwrap();
    assert_eq!(old.instantaneous_w, Value::Present(105.0));
    assert_eq!(old.minimum_w, Value::Present(52.0));
    assert_eq!(old.maximum_w, Value::Present(331.0));
    assert_eq!(old.average_w, Value::Present(104.0));
    assert_eq!(old.timestamp.as_deref(), Some("Wed Feb 15 12:49:51 2017"));
    assert_eq!(old.sampling_period.as_deref(), Some("00000001 Seconds."));
    assert_eq!(old.state, PowerState::Active);

    let new = parse_dcmi_power(&fixture(
        AREA,
        "own-ipmitool-dcmi-power-reading-1.8.19-oneline.txt",
    ))
    .unwrap();
    assert_eq!(new.instantaneous_w, Value::Present(2184.0));
    assert_eq!(new.timestamp.as_deref(), Some("07/26/26 16:57:12 CDT"));
    assert_eq!(new.sampling_period.as_deref(), Some("00000005 Seconds."));

    let free = parse_dcmi_power(&fixture(AREA, "own-freeipmi-dcmi-power-statistics.txt")).unwrap();
    assert_eq!(free.instantaneous_w, Value::Present(105.0));
    assert_eq!(free.maximum_w, Value::Present(331.0));
    assert_eq!(free.timestamp.as_deref(), Some("02/15/2017 - 12:49:51"));
    assert_eq!(free.state, PowerState::Active);
}

#[test]
fn deactivated_and_epoch_zero_power_is_no_reading_not_zero_watts() {
    for name in [
        "own-ipmitool-dcmi-power-reading-deactivated.txt",
        "own-ipmitool-dcmi-power-reading-zero-1970-activated.txt",
        "own-freeipmi-dcmi-power-statistics-na.txt",
    ] {
        let p = parse_dcmi_power(&fixture(AREA, name)).unwrap();
        assert!(p.instantaneous_w.is_absent(), "{name}: {p:?}");
        assert!(p.average_w.is_absent(), "{name}");
        assert_ne!(p.instantaneous_w.value(), Some(0.0));
    }
    let p = parse_dcmi_power(&fixture(
        AREA,
        "own-ipmitool-dcmi-power-reading-deactivated.txt",
    ))
    .unwrap();
    assert_eq!(
        p.instantaneous_w,
        Value::Absent(Absent::Other("power measurement deactivated".into()))
    );
    assert_eq!(p.state, PowerState::Inactive);
}

#[test]
fn na_power_sensors_are_no_reading() {
    let t = parse_sensor(&fixture(AREA, "own-ipmitool-sensor-na-power.txt")).unwrap();
    let r = t.readings();
    assert_eq!(r.power_w, Value::Absent(Absent::NotAvailable));
    assert_eq!(
        r.unread,
        vec!["PS1 Input Power".to_owned(), "PS2 Input Power".to_owned()]
    );
    assert_eq!(r.fans_rpm, vec![("FAN1".to_owned(), 8400.0)]);
    let t = parse_sdr(&fixture(AREA, "own-ipmitool-sdr-pwr-no-reading.txt")).unwrap();
    assert_eq!(t.readings().power_w, Value::Absent(Absent::NotAvailable));
}

#[test]
fn whole_node_sensor_wins_over_supplies() {
    let t = parse_sdr(&fixture(AREA, "own-ipmitool-sdr-8gpu-node.txt")).unwrap();
    let r = t.readings();
    assert_eq!(r.power_w, Value::Present(4560.0));
    assert_eq!(r.temperatures_c.len(), 16);
    assert_eq!(r.fans_rpm.len(), 8);
    assert_eq!(
        r.unread,
        vec![
            "Fan5A".to_owned(),
            "Fan5B".to_owned(),
            "SEL Fullness".to_owned()
        ]
    );
}

#[test]
fn garbage_output_is_a_located_error() {
    let html = fixture(AREA, "own-garbage.txt");
    assert!(matches!(
        parse_sdr(&html),
        Err(IpmiError::Garbage { line: 1, .. })
    ));
    assert!(matches!(
        parse_sensor(&html),
        Err(IpmiError::Garbage { line: 1, .. })
    ));
    assert!(matches!(
        parse_dcmi_power(&html),
        Err(IpmiError::Garbage { line: 1, .. })
    ));
    assert!(matches!(
        parse_dcmi_power(b"Sensor: 1\nOther: 2\n"),
        Err(IpmiError::NotAPowerReading)
    ));
    assert_eq!(
        parse_sdr(&fixture(AREA, "own-garbage-columns.txt")).unwrap_err(),
        IpmiError::ColumnCount {
            line: 2,
            expected: 3,
            found: 2
        }
    );
    assert!(matches!(
        parse_sensor(b"FAN1 | fast | RPM | ok | na | na | na | na | na | na\n"),
        Err(IpmiError::NotANumber {
            line: 1,
            column: 2,
            ..
        })
    ));
    assert!(matches!(
        parse_sdr(b""),
        Err(IpmiError::NoRows { first: None })
    ));
    assert!(matches!(
        parse_dcmi_power(b"    Instantaneous power reading:   lots Watts\n"),
        Err(IpmiError::NotANumber { line: 1, .. })
    ));
}

#[test]
fn no_bmc_device_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = fixture_path(AREA, "ipmitool-1.8.19-no-bmc-dcmi-power-reading.stderr.txt");
    let fake = script(
        dir.path(),
        "ipmitool",
        &format!("cat {} >&2\nexit 1", stderr.display()),
    );
    match Ipmitool::new().binary(&fake).power_reading() {
        Collected::Unavailable {
            reason: Unavailable::NoDevice { message, .. },
            ..
        } => assert_eq!(
            message,
            "Could not open device at /dev/ipmi0 or /dev/ipmi/0 or /dev/ipmidev/0: No such file or directory"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn this_machines_ipmitool_has_no_bmc_so_it_is_unavailable() {
    // ipmitool is installed here without a /dev/ipmi0 (NoDevice); where it is not installed
    // it is ProgramNotFound. Either way: unavailable, never a reading and never an error.
    let c = Ipmitool::new().power_reading();
    assert_eq!(c.status(), Status::Unavailable, "{c:?}");
    let c = Ipmitool::new().sensors();
    assert_eq!(c.status(), Status::Unavailable, "{c:?}");
}

#[test]
fn source_parses_sensor_output_and_fails_on_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let elist = fixture_path(AREA, "ipmitool-sdr-elist-curated-with-errors-telegraf.txt");
    let fake = script(
        dir.path(),
        "ipmitool",
        &format!(
            "[ \"$*\" = \"sdr elist\" ] || exit 9\ncat {}",
            elist.display()
        ),
    );
    let c = Ipmitool::new().binary(&fake).sensors();
    assert_eq!(c.reading().unwrap().value.power_w, Value::Present(110.0));
    let garbage = fixture_path(AREA, "own-garbage.txt");
    let fake = script(dir.path(), "garbage", &format!("cat {}", garbage.display()));
    let c = Ipmitool::new().binary(&fake).power_reading();
    assert_eq!(c.status(), Status::Error, "{c:?}");
    let _ = ipmi::MAX_IPMI_BYTES;
}
