//! Forwards a file-backed record log to a syslog receiver until killed: the process
//! the kill -9 test kills mid-stream and restarts.
//!
//! ```text
//! forward_file --source LOG.jsonl --cursor CURSOR --to HOST:PORT [--transport tcp|relp]
//! ```
#![allow(clippy::print_stdout, reason = "it reports its counters on stdout")]

use std::sync::Arc;
use std::time::Duration;

use probity_siem::{FileCursor, FileSource, Forwarder, ForwarderConfig, SyslogConfig, Transport};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut source = None;
    let mut cursor = None;
    let mut to = None;
    let mut transport = Transport::Tcp;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = args.next().ok_or_else(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--source" => source = Some(value),
            "--cursor" => cursor = Some(value),
            "--to" => to = Some(value),
            "--transport" => {
                transport = match value.as_str() {
                    "tcp" => Transport::Tcp,
                    "relp" => Transport::Relp,
                    other => return Err(format!("unknown transport {other}").into()),
                }
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let (Some(source), Some(cursor), Some(to)) = (source, cursor, to) else {
        return Err(
            "usage: forward_file --source LOG --cursor FILE --to HOST:PORT [--transport tcp|relp]"
                .into(),
        );
    };
    let mut config = ForwarderConfig::new(to, transport);
    config.syslog = SyslogConfig {
        hostname: "test-host".into(),
        ..SyslogConfig::default()
    };
    config.confirm_interval = Duration::from_millis(200);
    config.confirm_linger = Duration::from_millis(50);
    let log = Arc::new(FileSource::open(source.as_ref())?);
    let forwarder = Forwarder::start(config, log, FileCursor::new(cursor.as_ref()))?;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let s = forwarder.stats();
        println!(
            "cursor {} sent {} backlog {} failures {}",
            s.cursor,
            s.sent,
            s.backlog,
            s.failed_sends + s.failed_connects
        );
    }
}
