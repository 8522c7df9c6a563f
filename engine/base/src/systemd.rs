//! Readiness and state for systemd's `Type=notify` services: `sd_notify(3)`'s protocol,
//! one datagram per state change to the Unix socket named by `$NOTIFY_SOCKET`.
//!
//! Why our own and not libsystemd: the protocol is one `sendto` of `KEY=VALUE` lines, and
//! linking libsystemd would bring C and `unsafe` into every binary for it. Without
//! `$NOTIFY_SOCKET` (not started by systemd, or in a container) every call does nothing,
//! so callers never branch on it.
//!
//! ```
//! use probity_base::systemd::Notifier;
//! // Outside systemd there is no socket: telling it anything is a no-op.
//! let notifier = Notifier::from_value(None);
//! assert!(!notifier.enabled());
//! notifier.ready("serving 43 policies").unwrap();
//! ```

use std::ffi::OsStr;
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;

/// Where readiness goes: the service manager's socket, or nowhere.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    address: Option<NotifyAddress>,
}

#[derive(Debug, Clone)]
enum NotifyAddress {
    /// A socket file.
    Path(std::path::PathBuf),
    /// Linux's abstract namespace (`@name` in the variable).
    Abstract(Vec<u8>),
}

impl Notifier {
    /// The notifier `$NOTIFY_SOCKET` names (none when it is unset or empty).
    pub fn from_env() -> Self {
        Self::from_value(std::env::var_os("NOTIFY_SOCKET").as_deref())
    }

    /// The notifier for a `$NOTIFY_SOCKET` value: a path, or `@name` for an abstract socket.
    pub fn from_value(value: Option<&OsStr>) -> Self {
        use std::os::unix::ffi::OsStrExt;
        let address = value.and_then(|v| {
            let bytes = v.as_bytes();
            match bytes.split_first() {
                Some((b'@', name)) => Some(NotifyAddress::Abstract(name.to_vec())),
                Some((b'/', _)) => Some(NotifyAddress::Path(Path::new(v).to_path_buf())),
                // Empty, relative, or another transport (systemd 254's vsock:): not ours
                // to guess at, as sd_notify(3) refuses it too.
                _ => None,
            }
        });
        Self { address }
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.address.is_some()
    }

    /// Start-up is done: the service answers from now on.
    pub fn ready(&self, status: &str) -> io::Result<()> {
        self.send(&format!(
            "READY=1\nSTATUS={}\nMAINPID={}",
            one_line(status),
            std::process::id()
        ))
    }

    /// A reload started (`READY=1` follows when it has ended, whatever its outcome).
    /// `MONOTONIC_USEC` is required by systemd 253's `Type=notify-reload`.
    pub fn reloading(&self) -> io::Result<()> {
        let usec = monotonic_usec().unwrap_or(0);
        self.send(&format!("RELOADING=1\nMONOTONIC_USEC={usec}"))
    }

    /// Shutting down: the service finishes what it has in hand and exits.
    pub fn stopping(&self) -> io::Result<()> {
        self.send("STOPPING=1")
    }

    /// A free-form status line (`systemctl status` shows it).
    pub fn status(&self, status: &str) -> io::Result<()> {
        self.send(&format!("STATUS={}", one_line(status)))
    }

    fn send(&self, message: &str) -> io::Result<()> {
        let Some(address) = &self.address else {
            return Ok(());
        };
        let socket = UnixDatagram::unbound()?;
        match address {
            NotifyAddress::Path(path) => socket.send_to(message.as_bytes(), path)?,
            NotifyAddress::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = SocketAddr::from_abstract_name(name)?;
                socket.send_to_addr(message.as_bytes(), &addr)?
            }
        };
        Ok(())
    }
}

/// systemd ignores a notification of 4096 bytes or more (PIPE_BUF): a status is cut
/// well below, so that the READY=1 it travels with is never lost.
const MAX_STATUS_BYTES: usize = 1024;

/// A status for one `STATUS=` line: a newline would start a new assignment, and a long
/// one (a refused reload's every problem) is cut at a character boundary.
fn one_line(text: &str) -> String {
    let mut line = text.replace(['\n', '\r'], " ");
    if line.len() > MAX_STATUS_BYTES {
        let mut end = MAX_STATUS_BYTES - 3;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push_str("...");
    }
    line
}

/// CLOCK_MONOTONIC in microseconds: the clock systemd compares `MONOTONIC_USEC` with.
fn monotonic_usec() -> Option<u64> {
    let time = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(time.tv_sec).ok()?;
    let nanos = u64::try_from(time.tv_nsec).ok()?;
    Some(secs.saturating_mul(1_000_000).saturating_add(nanos / 1_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (tempfile::TempDir, std::path::PathBuf, UnixDatagram) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        (dir, path, socket)
    }

    fn receive(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 4096];
        let n = socket.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn ready_reaches_the_socket_with_the_pid_and_a_one_line_status() {
        let (_dir, path, socket) = listener();
        let notifier = Notifier::from_value(Some(path.as_os_str()));
        assert!(notifier.enabled());
        notifier.ready("serving\nSTOPPING=1").unwrap();
        let message = receive(&socket);
        let pid = std::process::id();
        assert_eq!(
            message,
            format!("READY=1\nSTATUS=serving STOPPING=1\nMAINPID={pid}")
        );
    }

    #[test]
    fn reloading_carries_the_monotonic_clock_and_stopping_is_one_word() {
        let (_dir, path, socket) = listener();
        let notifier = Notifier::from_value(Some(path.as_os_str()));
        notifier.reloading().unwrap();
        let message = receive(&socket);
        let usec: u64 = message
            .strip_prefix("RELOADING=1\nMONOTONIC_USEC=")
            .unwrap()
            .parse()
            .unwrap();
        assert!(usec > 0);
        notifier.stopping().unwrap();
        assert_eq!(receive(&socket), "STOPPING=1");
    }

    #[test]
    fn an_abstract_socket_is_reached_by_its_at_name() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("probity-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let socket = UnixDatagram::bind_addr(&addr).unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let notifier = Notifier::from_value(Some(OsStr::new(&format!("@{name}"))));
        notifier.status("reloading policies").unwrap();
        assert_eq!(receive(&socket), "STATUS=reloading policies");
    }

    #[test]
    fn a_long_status_is_cut_so_the_ready_message_stays_under_systemds_limit() {
        let (_dir, path, socket) = listener();
        let notifier = Notifier::from_value(Some(path.as_os_str()));
        let long = "é problem\n".repeat(2000);
        notifier.ready(&long).unwrap();
        let message = receive(&socket);
        assert!(message.len() < 4096, "{} bytes", message.len());
        assert!(message.starts_with("READY=1\nSTATUS=é problem é problem"));
        assert!(message.contains("...\nMAINPID="), "{message}");
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_nothing_fails() {
        for value in [
            None,
            Some(OsStr::new("")),
            Some(OsStr::new("relative/notify")),
            Some(OsStr::new("vsock:2:1234")),
        ] {
            let notifier = Notifier::from_value(value);
            assert!(!notifier.enabled());
            notifier.ready("x").unwrap();
            notifier.stopping().unwrap();
        }
    }

    #[test]
    fn a_socket_nobody_listens_on_is_an_error_to_the_caller() {
        let dir = tempfile::tempdir().unwrap();
        let notifier = Notifier::from_value(Some(dir.path().join("absent").as_os_str()));
        assert!(notifier.ready("x").is_err());
    }
}
