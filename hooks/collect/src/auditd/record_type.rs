//! Record type names: the few the collector acts on as variants, every other name of
//! libaudit's table as a static string, and `UNKNOWN[n]` for numbers auditd could not name.
//!
//! Whether a type is a **user-space message** matters to event assembly: the kernel gives
//! each user-space message (1100–1299, 2100–2999: PAM, sudo, sshd, auditd's own DAEMON_*)
//! a serial of its own, so such a record is a whole event; kernel records (SYSCALL, EXECVE,
//! PATH, PROCTITLE, LOGIN…) share their serial with others and wait for the rest.

use std::fmt;

/// The `type=` of a record.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordType {
    /// `SYSCALL` (1300): the system call a kernel event is about.
    Syscall,
    /// `EXECVE` (1309): the arguments of an `execve`.
    Execve,
    /// `PROCTITLE` (1327): the process's command line (NUL-separated argv), the last record
    /// of a kernel event before `EOE`.
    Proctitle,
    /// `PATH` (1302): one path the system call touched (`items=` of them).
    Path,
    /// `CWD` (1307).
    Cwd,
    /// `EOE` (1320): end of a multi-record event (not written by every auditd).
    Eoe,
    /// `LOGIN` (1006): the kernel set a process's login uid and session id.
    Login,
    /// `USER_AUTH` (1100).
    UserAuth,
    /// `USER_ACCT` (1101).
    UserAcct,
    /// `CRED_ACQ` (1103).
    CredAcq,
    /// `CRED_DISP` (1104).
    CredDisp,
    /// `USER_START` (1105).
    UserStart,
    /// `USER_END` (1106).
    UserEnd,
    /// `CRED_REFR` (1110).
    CredRefr,
    /// `USER_LOGIN` (1112).
    UserLogin,
    /// `USER_LOGOUT` (1113).
    UserLogout,
    /// `USER_CMD` (1123): sudo's command.
    UserCmd,
    /// `USER_TTY` (1124): keystrokes (redacted).
    UserTty,
    /// `TTY` (1319): keystrokes from the kernel's TTY auditing (redacted).
    Tty,
    /// `DAEMON_START` (1200): auditd started (auditd's own serial).
    DaemonStart,
    /// `DAEMON_END` (1201): auditd stopped (auditd's own serial).
    DaemonEnd,
    /// `USER_ROLE_CHANGE` (2300): an SELinux role was selected.
    UserRoleChange,
    /// Another name from libaudit's table.
    Named(&'static str),
    /// A name this parser does not know.
    Other(Box<str>),
    /// `UNKNOWN[n]`: auditd had no name for type `n`.
    Unknown(u32),
}

/// libaudit's type names that are not variants, with their numbers (for classification).
static TABLE: &[(&str, u32)] = &[
    ("ACCT_LOCK", 1135),
    ("ACCT_UNLOCK", 1136),
    ("ADD_GROUP", 1116),
    ("ADD_USER", 1114),
    ("ANOM_ABEND", 1701),
    ("ANOM_ACCESS_FS", 2111),
    ("ANOM_ADD_ACCT", 2114),
    ("ANOM_AMTU_FAIL", 2107),
    ("ANOM_CREAT", 1703),
    ("ANOM_CRYPTO_FAIL", 2110),
    ("ANOM_DEL_ACCT", 2115),
    ("ANOM_EXEC", 2112),
    ("ANOM_LINK", 1702),
    ("ANOM_LOGIN_ACCT", 2103),
    ("ANOM_LOGIN_FAILURES", 2100),
    ("ANOM_LOGIN_LOCATION", 2104),
    ("ANOM_LOGIN_ROOT", 2119),
    ("ANOM_LOGIN_SERVICE", 2118),
    ("ANOM_LOGIN_SESSIONS", 2102),
    ("ANOM_LOGIN_TIME", 2101),
    ("ANOM_MAX_DAC", 2105),
    ("ANOM_MAX_MAC", 2106),
    ("ANOM_MK_EXEC", 2113),
    ("ANOM_MOD_ACCT", 2116),
    ("ANOM_ORIGIN_FAILURES", 2120),
    ("ANOM_PROMISCUOUS", 1700),
    ("ANOM_RBAC_FAIL", 2108),
    ("ANOM_RBAC_INTEGRITY_FAIL", 2109),
    ("ANOM_ROOT_TRANS", 2117),
    ("ANOM_SESSION", 2121),
    ("APPARMOR_ALLOWED", 1502),
    ("APPARMOR_AUDIT", 1501),
    ("APPARMOR_DENIED", 1503),
    ("APPARMOR_ERROR", 1506),
    ("APPARMOR_HINT", 1504),
    ("APPARMOR_KILL", 1507),
    ("APPARMOR_STATUS", 1505),
    ("AVC", 1400),
    ("AVC_PATH", 1402),
    ("BPF", 1334),
    ("BPRM_FCAPS", 1321),
    ("CAPSET", 1322),
    ("CHGRP_ID", 1119),
    ("CHUSER_ID", 1125),
    ("CONFIG_CHANGE", 1305),
    ("CRYPTO_FAILURE_USER", 2405),
    ("CRYPTO_IKE_SA", 2408),
    ("CRYPTO_IPSEC_SA", 2409),
    ("CRYPTO_KEY_USER", 2404),
    ("CRYPTO_LOGIN", 2402),
    ("CRYPTO_LOGOUT", 2403),
    ("CRYPTO_PARAM_CHANGE_USER", 2401),
    ("CRYPTO_REPLAY_USER", 2406),
    ("CRYPTO_SESSION", 2407),
    ("CRYPTO_TEST_USER", 2400),
    ("DAC_CHECK", 1118),
    ("DAEMON_ABORT", 1202),
    ("DAEMON_ACCEPT", 1207),
    ("DAEMON_CLOSE", 1208),
    ("DAEMON_CONFIG", 1203),
    ("DAEMON_ERR", 1209),
    ("DAEMON_RECONFIG", 1204),
    ("DAEMON_RESUME", 1206),
    ("DAEMON_ROTATE", 1205),
    ("DEL_GROUP", 1117),
    ("DEL_USER", 1115),
    ("DEV_ALLOC", 2307),
    ("DEV_DEALLOC", 2308),
    ("EVENT_LISTENER", 1335),
    ("FANOTIFY", 1331),
    ("FD_PAIR", 1317),
    ("FEATURE_CHANGE", 1328),
    ("FS_RELABEL", 2309),
    ("GRP_AUTH", 1126),
    ("GRP_CHAUTHTOK", 1133),
    ("GRP_MGMT", 1132),
    ("INTEGRITY_DATA", 1800),
    ("INTEGRITY_EVM_XATTR", 1806),
    ("INTEGRITY_HASH", 1803),
    ("INTEGRITY_METADATA", 1801),
    ("INTEGRITY_PCR", 1804),
    ("INTEGRITY_POLICY_RULE", 1807),
    ("INTEGRITY_RULE", 1805),
    ("INTEGRITY_STATUS", 1802),
    ("IPC", 1303),
    ("IPC_SET_PERM", 1311),
    ("KERNEL", 2000),
    ("KERNEL_OTHER", 1316),
    ("KERN_MODULE", 1330),
    ("LABEL_LEVEL_CHANGE", 2304),
    ("LABEL_OVERRIDE", 2303),
    ("MAC_CALIPSO_ADD", 1418),
    ("MAC_CALIPSO_DEL", 1419),
    ("MAC_CHECK", 1134),
    ("MAC_CIPSOV4_ADD", 1407),
    ("MAC_CIPSOV4_DEL", 1408),
    ("MAC_CONFIG_CHANGE", 1405),
    ("MAC_IPSEC_ADDSA", 1411),
    ("MAC_IPSEC_ADDSPD", 1413),
    ("MAC_IPSEC_DELSA", 1412),
    ("MAC_IPSEC_DELSPD", 1414),
    ("MAC_IPSEC_EVENT", 1415),
    ("MAC_MAP_ADD", 1409),
    ("MAC_MAP_DEL", 1410),
    ("MAC_POLICY_LOAD", 1403),
    ("MAC_STATUS", 1404),
    ("MAC_UNLBL_ALLOW", 1406),
    ("MAC_UNLBL_STCADD", 1416),
    ("MAC_UNLBL_STCDEL", 1417),
    ("MMAP", 1323),
    ("MQ_GETSETATTR", 1315),
    ("MQ_NOTIFY", 1314),
    ("MQ_OPEN", 1312),
    ("MQ_SENDRECV", 1313),
    ("NETFILTER_CFG", 1325),
    ("NETFILTER_PKT", 1324),
    ("OBJ_PID", 1318),
    ("OPENAT2", 1337),
    ("REPLACE", 1329),
    ("RESP_ACCT_LOCK", 2207),
    ("RESP_ACCT_LOCK_TIMED", 2205),
    ("RESP_ACCT_REMOTE", 2204),
    ("RESP_ACCT_UNLOCK_TIMED", 2206),
    ("RESP_ALERT", 2201),
    ("RESP_ANOMALY", 2200),
    ("RESP_EXEC", 2210),
    ("RESP_HALT", 2212),
    ("RESP_KILL_PROC", 2202),
    ("RESP_ORIGIN_BLOCK", 2213),
    ("RESP_ORIGIN_BLOCK_TIMED", 2214),
    ("RESP_ORIGIN_UNBLOCK_TIMED", 2215),
    ("RESP_SEBOOL", 2209),
    ("RESP_SINGLE", 2211),
    ("RESP_TERM_ACCESS", 2203),
    ("RESP_TERM_LOCK", 2208),
    ("ROLE_ASSIGN", 2301),
    ("ROLE_MODIFY", 2311),
    ("ROLE_REMOVE", 2302),
    ("SECCOMP", 1326),
    ("SELINUX_ERR", 1401),
    ("SERVICE_START", 1130),
    ("SERVICE_STOP", 1131),
    ("SOCKADDR", 1306),
    ("SOCKETCALL", 1304),
    ("SOFTWARE_UPDATE", 1138),
    ("SYSTEM_BOOT", 1127),
    ("SYSTEM_RUNLEVEL", 1129),
    ("SYSTEM_SHUTDOWN", 1128),
    ("TEST", 1120),
    ("TIME_ADJNTPVAL", 1333),
    ("TIME_INJOFFSET", 1332),
    ("TRUSTED_APP", 1121),
    ("URINGOP", 1336),
    ("USER", 1005),
    ("USER_AVC", 1107),
    ("USER_CHAUTHTOK", 1108),
    ("USER_DEVICE", 1137),
    ("USER_ERR", 1109),
    ("USER_LABELED_EXPORT", 2305),
    ("USER_MAC_CONFIG_CHANGE", 2312),
    ("USER_MAC_POLICY_LOAD", 2310),
    ("USER_MAC_STATUS", 2313),
    ("USER_MGMT", 1102),
    ("USER_SELINUX_ERR", 1122),
    ("USER_UNLABELED_EXPORT", 2306),
    ("USYS_CONFIG", 1111),
    ("VIRT_CONTROL", 2500),
    ("VIRT_CREATE", 2505),
    ("VIRT_DESTROY", 2506),
    ("VIRT_INTEGRITY_CHECK", 2504),
    ("VIRT_MACHINE_ID", 2503),
    ("VIRT_MIGRATE_IN", 2507),
    ("VIRT_MIGRATE_OUT", 2508),
    ("VIRT_RESOURCE", 2501),
];

impl RecordType {
    /// The type for a `type=` name (without the `type=`).
    pub fn from_name(name: &str) -> Self {
        match name {
            "SYSCALL" => Self::Syscall,
            "EXECVE" => Self::Execve,
            "PROCTITLE" => Self::Proctitle,
            "PATH" => Self::Path,
            "CWD" => Self::Cwd,
            "EOE" => Self::Eoe,
            "LOGIN" => Self::Login,
            "USER_AUTH" => Self::UserAuth,
            "USER_ACCT" => Self::UserAcct,
            "CRED_ACQ" => Self::CredAcq,
            "CRED_DISP" => Self::CredDisp,
            "USER_START" => Self::UserStart,
            "USER_END" => Self::UserEnd,
            "CRED_REFR" => Self::CredRefr,
            "USER_LOGIN" => Self::UserLogin,
            "USER_LOGOUT" => Self::UserLogout,
            "USER_CMD" => Self::UserCmd,
            "USER_TTY" => Self::UserTty,
            "TTY" => Self::Tty,
            "DAEMON_START" => Self::DaemonStart,
            "DAEMON_END" => Self::DaemonEnd,
            "USER_ROLE_CHANGE" => Self::UserRoleChange,
            _ => {
                if let Some(n) = name
                    .strip_prefix("UNKNOWN[")
                    .and_then(|rest| rest.strip_suffix(']'))
                    .and_then(|digits| digits.parse().ok())
                {
                    return Self::Unknown(n);
                }
                match TABLE.binary_search_by(|(n, _)| (*n).cmp(name)) {
                    Ok(i) => TABLE
                        .get(i)
                        .map_or_else(|| Self::Other(name.into()), |(n, _)| Self::Named(n)),
                    Err(_) => Self::Other(name.into()),
                }
            }
        }
    }

    /// The name as auditd prints it (`UNKNOWN[1329]` for an unnamed number).
    pub fn name(&self) -> std::borrow::Cow<'_, str> {
        let s = match self {
            Self::Syscall => "SYSCALL",
            Self::Execve => "EXECVE",
            Self::Proctitle => "PROCTITLE",
            Self::Path => "PATH",
            Self::Cwd => "CWD",
            Self::Eoe => "EOE",
            Self::Login => "LOGIN",
            Self::UserAuth => "USER_AUTH",
            Self::UserAcct => "USER_ACCT",
            Self::CredAcq => "CRED_ACQ",
            Self::CredDisp => "CRED_DISP",
            Self::UserStart => "USER_START",
            Self::UserEnd => "USER_END",
            Self::CredRefr => "CRED_REFR",
            Self::UserLogin => "USER_LOGIN",
            Self::UserLogout => "USER_LOGOUT",
            Self::UserCmd => "USER_CMD",
            Self::UserTty => "USER_TTY",
            Self::Tty => "TTY",
            Self::DaemonStart => "DAEMON_START",
            Self::DaemonEnd => "DAEMON_END",
            Self::UserRoleChange => "USER_ROLE_CHANGE",
            Self::Named(n) => n,
            Self::Other(n) => n,
            Self::Unknown(n) => return format!("UNKNOWN[{n}]").into(),
        };
        s.into()
    }

    /// The numeric type, when known.
    pub fn number(&self) -> Option<u32> {
        Some(match self {
            Self::Syscall => 1300,
            Self::Execve => 1309,
            Self::Proctitle => 1327,
            Self::Path => 1302,
            Self::Cwd => 1307,
            Self::Eoe => 1320,
            Self::Login => 1006,
            Self::UserAuth => 1100,
            Self::UserAcct => 1101,
            Self::CredAcq => 1103,
            Self::CredDisp => 1104,
            Self::UserStart => 1105,
            Self::UserEnd => 1106,
            Self::CredRefr => 1110,
            Self::UserLogin => 1112,
            Self::UserLogout => 1113,
            Self::UserCmd => 1123,
            Self::UserTty => 1124,
            Self::Tty => 1319,
            Self::DaemonStart => 1200,
            Self::DaemonEnd => 1201,
            Self::UserRoleChange => 2300,
            Self::Named(name) => {
                let i = TABLE.binary_search_by(|(n, _)| n.cmp(name)).ok()?;
                return TABLE.get(i).map(|(_, n)| *n);
            }
            Self::Other(_) => return None,
            Self::Unknown(n) => *n,
        })
    }

    /// Whether a record of this type is a whole event by itself: a user-space message
    /// (1005, 1100–1299 including auditd's DAEMON_*, 2100–2999). Unknown names are not.
    pub fn is_single_record(&self) -> bool {
        matches!(self.number(), Some(1005 | 1100..=1299 | 2100..=2999))
    }
}

impl fmt::Display for RecordType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sorted_for_binary_search() {
        for pair in TABLE.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{} !< {}", pair[0].0, pair[1].0);
        }
    }

    #[test]
    fn names_round_trip_and_classify() {
        for name in [
            "SYSCALL",
            "USER_CMD",
            "CONFIG_CHANGE",
            "UNKNOWN[1329]",
            "NEW_THING",
        ] {
            assert_eq!(RecordType::from_name(name).name(), name);
        }
        assert_eq!(
            RecordType::from_name("UNKNOWN[1329]"),
            RecordType::Unknown(1329)
        );
        assert!(RecordType::from_name("USER_CMD").is_single_record());
        assert!(RecordType::from_name("DAEMON_CONFIG").is_single_record());
        assert!(RecordType::from_name("CRYPTO_KEY_USER").is_single_record());
        assert!(RecordType::from_name("UNKNOWN[1150]").is_single_record());
        assert!(!RecordType::from_name("LOGIN").is_single_record());
        assert!(!RecordType::from_name("CONFIG_CHANGE").is_single_record());
        assert!(!RecordType::from_name("UNKNOWN[1329]").is_single_record());
        assert!(!RecordType::from_name("NEW_THING").is_single_record());
    }
}
