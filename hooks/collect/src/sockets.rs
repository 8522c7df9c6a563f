//! Listening sockets from `/proc/net/{tcp,tcp6,udp,udp6}`.
//!
//! Why this module exists: the `listen` rule compares what a node actually exposes with the
//! port baseline, and `/proc/net` is the one view that needs no tool and no privilege. Its
//! addresses are hexadecimal words in the kernel's memory order: an IPv4 address is one
//! 32-bit word and an IPv6 address four, each printed as a host-order integer, so on a
//! little-endian machine `0100007F` is 127.0.0.1 and `::1` is
//! `00000000000000000000000001000000`. The words are decoded with the host's byte order.
//!
//! A TCP socket listens in state `0A`. A UDP socket "listens" when it is bound and not
//! connected: state `07` and no remote peer. An IPv6 wildcard (`::`) socket serves IPv4 too
//! unless it is v6only, which `/proc` does not show: [`ServesIpv4`] says when that is an
//! assumption from the system default `net.ipv6.bindv6only`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use thiserror::Error;

use crate::Collected;
use crate::source::{self, CollectError, Failure, FileError, InputError, Unavailable};
use crate::text;

/// Largest table accepted (about 150 bytes per socket).
pub const MAX_PROC_NET_BYTES: usize = 64 * 1024 * 1024;

/// Transport protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// Address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

/// One of the four tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcNetTable {
    /// `tcp`.
    Tcp,
    /// `tcp6`.
    Tcp6,
    /// `udp`.
    Udp,
    /// `udp6`.
    Udp6,
}

impl ProcNetTable {
    /// All four.
    pub const ALL: [Self; 4] = [Self::Tcp, Self::Tcp6, Self::Udp, Self::Udp6];

    /// The file name under `/proc/net`.
    pub fn file_name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Tcp6 => "tcp6",
            Self::Udp => "udp",
            Self::Udp6 => "udp6",
        }
    }

    /// Its protocol.
    pub fn protocol(self) -> Protocol {
        match self {
            Self::Tcp | Self::Tcp6 => Protocol::Tcp,
            Self::Udp | Self::Udp6 => Protocol::Udp,
        }
    }

    /// Its family.
    pub fn family(self) -> Family {
        match self {
            Self::Tcp | Self::Udp => Family::V4,
            Self::Tcp6 | Self::Udp6 => Family::V6,
        }
    }
}

/// Whether a wildcard socket accepts IPv4 traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServesIpv4 {
    /// An IPv4 socket on 0.0.0.0.
    Yes,
    /// An IPv6 socket on `::`; its IPV6_V6ONLY is not visible, and the system default
    /// (`bindv6only = 0`) makes it dual-stack: it probably accepts IPv4 too.
    AssumedYes,
    /// An IPv6 socket on `::` under `bindv6only = 1`: probably IPv6 only.
    AssumedNo,
}

/// Who can reach a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Loopback only (127.0.0.0/8, `::1`, `::ffff:127.x.y.z`).
    Loopback,
    /// Every address (`0.0.0.0`, `::`).
    Wildcard {
        /// Whether IPv4 traffic reaches it.
        serves_ipv4: ServesIpv4,
    },
    /// One specific non-loopback address.
    Specific,
}

/// A socket that accepts traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListeningSocket {
    /// TCP or UDP.
    pub protocol: Protocol,
    /// Which table it came from.
    pub family: Family,
    /// Local address.
    pub address: IpAddr,
    /// Local port.
    pub port: u16,
    /// Owner's uid.
    pub uid: u32,
    /// Socket inode (links it to a process through `/proc/<pid>/fd`).
    pub inode: u64,
    /// Who can reach it.
    pub scope: Scope,
}

/// Why a table does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProcNetError {
    /// Too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The first line is not the table header.
    #[error("line 1: not a /proc/net table header")]
    MissingHeader,
    /// A row has too few fields.
    #[error("line {line}: {found} fields, expected at least 10")]
    TooFewFields {
        /// Line.
        line: usize,
        /// Fields found.
        found: usize,
    },
    /// A field does not decode.
    #[error("line {line}, field {field}: {value:?} is not {expected}")]
    Field {
        /// Line.
        line: usize,
        /// Field name.
        field: &'static str,
        /// Its text.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
}

fn decode_address(hex: &str, family: Family) -> Option<IpAddr> {
    let word = |s: &str| -> Option<[u8; 4]> {
        if s.len() != 8 {
            return None;
        }
        u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes)
    };
    match family {
        Family::V4 => word(hex).map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        Family::V6 => {
            if hex.len() != 32 || !hex.is_ascii() {
                return None;
            }
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                let w = word(hex.get(i * 8..i * 8 + 8)?)?;
                chunk.copy_from_slice(&w);
            }
            Some(IpAddr::V6(Ipv6Addr::from(bytes)))
        }
    }
}

fn split_endpoint(
    line: usize,
    field: &'static str,
    s: &str,
    family: Family,
) -> Result<(IpAddr, u16), ProcNetError> {
    let bad = || ProcNetError::Field {
        line,
        field,
        value: text::excerpt(s),
        expected: match family {
            Family::V4 => "ADDRESS:PORT with 8 hex digits of address",
            Family::V6 => "ADDRESS:PORT with 32 hex digits of address",
        },
    };
    let (addr, port) = s.split_once(':').ok_or_else(bad)?;
    let address = decode_address(addr, family).ok_or_else(bad)?;
    if port.len() != 4 {
        return Err(bad());
    }
    let port = u16::from_str_radix(port, 16).map_err(|_| bad())?;
    Ok((address, port))
}

/// Classifies an address; `bindv6only` is the system default for `::`.
pub fn scope_of(address: IpAddr, bindv6only: bool) -> Scope {
    match address {
        IpAddr::V4(a) if a.is_loopback() => Scope::Loopback,
        IpAddr::V4(a) if a.is_unspecified() => Scope::Wildcard {
            serves_ipv4: ServesIpv4::Yes,
        },
        IpAddr::V4(_) => Scope::Specific,
        IpAddr::V6(a) if a.is_loopback() => Scope::Loopback,
        IpAddr::V6(a) if a.is_unspecified() => Scope::Wildcard {
            serves_ipv4: if bindv6only {
                ServesIpv4::AssumedNo
            } else {
                ServesIpv4::AssumedYes
            },
        },
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => scope_of(IpAddr::V4(v4), bindv6only),
            None => Scope::Specific,
        },
    }
}

const TCP_LISTEN: u8 = 0x0A;
const TCP_CLOSE: u8 = 0x07;

/// Parses one table and returns its listening sockets. `bindv6only` is the system default
/// (`/proc/sys/net/ipv6/bindv6only`), used only to classify `::`.
pub fn parse_proc_net(
    input: &[u8],
    table: ProcNetTable,
    bindv6only: bool,
) -> Result<Vec<ListeningSocket>, ProcNetError> {
    let text = text::decode(input, MAX_PROC_NET_BYTES)?;
    let mut lines = text::lines(text);
    match lines.next() {
        Some((_, header)) if header.trim_start().starts_with("sl ") => {}
        _ => return Err(ProcNetError::MissingHeader),
    }
    let family = table.family();
    let mut out = Vec::new();
    for (line, l) in lines {
        if l.trim().is_empty() {
            continue;
        }
        // The first ten fields; the rest (ref, pointer, drops…) vary by table and kernel.
        let mut fields = [""; 10];
        let mut found = 0;
        for (slot, field) in fields.iter_mut().zip(l.split_ascii_whitespace()) {
            *slot = field;
            found += 1;
        }
        if found < fields.len() {
            return Err(ProcNetError::TooFewFields { line, found });
        }
        let [
            sl,
            local,
            remote,
            state,
            _queues,
            _timer,
            _retr,
            uid,
            _timeout,
            inode,
        ] = fields;
        let field_err = |field, value: &str, expected| ProcNetError::Field {
            line,
            field,
            value: text::excerpt(value),
            expected,
        };
        if sl
            .strip_suffix(':')
            .is_none_or(|n| n.parse::<u64>().is_err())
        {
            return Err(field_err("sl", sl, "an entry number and ':'"));
        }
        let (address, port) = split_endpoint(line, "local_address", local, family)?;
        let (peer, peer_port) = split_endpoint(line, "rem_address", remote, family)?;
        let st = if state.len() == 2 {
            u8::from_str_radix(state, 16).ok()
        } else {
            None
        };
        let st = st.ok_or_else(|| field_err("st", state, "two hex digits"))?;
        let uid: u32 = uid
            .parse()
            .map_err(|_| field_err("uid", uid, "a decimal uid"))?;
        let inode: u64 = inode
            .parse()
            .map_err(|_| field_err("inode", inode, "a decimal inode"))?;
        let listening = match table.protocol() {
            Protocol::Tcp => st == TCP_LISTEN,
            Protocol::Udp => st == TCP_CLOSE && peer.is_unspecified() && peer_port == 0,
        };
        if listening {
            out.push(ListeningSocket {
                protocol: table.protocol(),
                family,
                address,
                port,
                uid,
                inode,
                scope: scope_of(address, bindv6only),
            });
        }
    }
    Ok(out)
}

/// Reads the four tables under a proc root.
#[derive(Debug, Clone)]
pub struct ProcNet {
    root: PathBuf,
}

impl Default for ProcNet {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl ProcNet {
    /// Tables under `<root>/net`, the default under `<root>/sys/net/ipv6/bindv6only`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Every listening socket. A missing `tcp6`/`udp6` (IPv6 disabled) is skipped; a
    /// missing `tcp` means there is no procfs here: unavailable.
    pub fn listening(&self) -> Collected<Vec<ListeningSocket>> {
        source::stamp(self.try_listening())
    }

    fn bindv6only(&self) -> Result<bool, Failure> {
        let path = self.root.join("sys/net/ipv6/bindv6only");
        match source::read_regular_file(&path, 64) {
            Ok(b) => Ok(String::from_utf8_lossy(&b).trim() == "1"),
            // No IPv6 sysctl: the kernel default, 0.
            Err(FileError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn try_listening(&self) -> Result<Vec<ListeningSocket>, Failure> {
        let bindv6only = self.bindv6only()?;
        let mut out = Vec::new();
        for table in ProcNetTable::ALL {
            let path = self.root.join("net").join(table.file_name());
            let bytes = match source::read_regular_file(&path, MAX_PROC_NET_BYTES) {
                Ok(b) => b,
                Err(FileError::NotFound { path }) if table == ProcNetTable::Tcp => {
                    return Err(Failure::Unavailable(Unavailable::Missing { path }));
                }
                Err(FileError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let sockets = parse_proc_net(&bytes, table, bindv6only)
                .map_err(|source| Failure::Error(CollectError::ProcNet { path, source }))?;
            out.extend(sockets);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_endian = "little")]
    #[test]
    fn addresses_decode_in_host_word_order() {
        assert_eq!(
            decode_address("0100007F", Family::V4),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            decode_address("00000000000000000000000001000000", Family::V6),
            Some(IpAddr::V6(Ipv6Addr::LOCALHOST))
        );
        // 2001:db8::1 is printed as B80D0120 00000000 00000000 01000000.
        assert_eq!(
            decode_address("B80D0120000000000000000001000000", Family::V6),
            Some("2001:db8::1".parse().unwrap())
        );
        // ::ffff:127.0.0.1
        assert_eq!(
            decode_address("0000000000000000FFFF00000100007F", Family::V6),
            Some("::ffff:127.0.0.1".parse().unwrap())
        );
    }

    #[test]
    fn scopes() {
        assert_eq!(
            scope_of("::ffff:127.0.0.1".parse().unwrap(), false),
            Scope::Loopback
        );
        assert_eq!(
            scope_of("::".parse().unwrap(), false),
            Scope::Wildcard {
                serves_ipv4: ServesIpv4::AssumedYes
            }
        );
        assert_eq!(
            scope_of("::".parse().unwrap(), true),
            Scope::Wildcard {
                serves_ipv4: ServesIpv4::AssumedNo
            }
        );
        assert_eq!(
            scope_of("10.0.0.5".parse().unwrap(), false),
            Scope::Specific
        );
    }

    #[test]
    fn udp_listens_only_when_unconnected() {
        let input = b"   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  1: 00000000:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 100 2 0000000000000000 0
  2: 0100007F:A000 0100007F:0035 07 00000000:00000000 00:00000000 00000000     0        0 101 2 0000000000000000 0
  3: 0100007F:A001 0100007F:0035 01 00000000:00000000 00:00000000 00000000     0        0 102 2 0000000000000000 0
";
        let s = parse_proc_net(input, ProcNetTable::Udp, false).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].port, 53);
        assert_eq!(s[0].inode, 100);
    }

    #[test]
    fn bad_rows_are_located() {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let bad = format!(
            "{header}   0: 0100007F:XYZW 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1066 1\n"
        );
        assert!(matches!(
            parse_proc_net(bad.as_bytes(), ProcNetTable::Tcp, false),
            Err(ProcNetError::Field {
                line: 2,
                field: "local_address",
                ..
            })
        ));
        let short = format!("{header}   0: 0100007F:0016 00000000:0000 0A\n");
        assert!(matches!(
            parse_proc_net(short.as_bytes(), ProcNetTable::Tcp, false),
            Err(ProcNetError::TooFewFields { line: 2, found: 4 })
        ));
        assert_eq!(
            parse_proc_net(b"garbage\n", ProcNetTable::Tcp, false),
            Err(ProcNetError::MissingHeader)
        );
    }
}
