//! ipmitool / FreeIPMI: DCMI power reading, `sdr`, `sdr elist`, `sensor`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_collect::ipmi;

fuzz_target!(|data: &[u8]| {
    let _ = ipmi::parse_dcmi_power(data);
    let _ = ipmi::parse_sdr(data).map(|t| t.readings());
    let _ = ipmi::parse_sdr_elist(data).map(|t| t.readings());
    let _ = ipmi::parse_sensor(data).map(|t| t.readings());
});
