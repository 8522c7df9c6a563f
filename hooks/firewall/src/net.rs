//! The vocabulary shared by the parsers, the reduction and the baseline: address families,
//! transport protocols, port ranges and source prefixes, and the interval sets the reduction
//! computes with.
//!
//! Why this module exists: every other module speaks of "TCP port 10250 from 10.0.0.0/8 over
//! IPv4"; defining those words once keeps the parsers, the reduction and the baseline from
//! each growing its own.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// An address family a packet can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// IPv4.
    Ipv4,
    /// IPv6.
    Ipv6,
}

impl Family {
    /// Both families, IPv4 first.
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// The family of an address.
    pub fn of(addr: &IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::Ipv4,
            IpAddr::V6(_) => Family::Ipv6,
        }
    }

    /// Address width in bits.
    pub(crate) fn bits(self) -> u8 {
        match self {
            Family::Ipv4 => 32,
            Family::Ipv6 => 128,
        }
    }

    /// The largest address, as an integer.
    pub(crate) fn max_addr(self) -> u128 {
        match self {
            Family::Ipv4 => u128::from(u32::MAX),
            Family::Ipv6 => u128::MAX,
        }
    }

    /// Every address of the family a remote host can send from: all but loopback
    /// (127.0.0.0/8, ::1), which never arrives from another host.
    pub(crate) fn remote_universe(self) -> Ranges {
        let all = Ranges::from_range(0, self.max_addr());
        let loopback = match self {
            Family::Ipv4 => Ranges::from_range(0x7f00_0000, 0x7fff_ffff),
            Family::Ipv6 => Ranges::from_range(1, 1),
        };
        all.subtract(&loopback)
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Ipv4 => "IPv4",
            Family::Ipv6 => "IPv6",
        })
    }
}

/// A transport protocol whose ports the reduction reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    /// Both protocols, TCP first.
    pub const ALL: [Protocol; 2] = [Protocol::Tcp, Protocol::Udp];

    /// The lower-case name nft and iptables use.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An inclusive range of ports, `start..=end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    start: u16,
    end: u16,
}

impl PortRange {
    /// Every port, 0-65535.
    pub const ALL: PortRange = PortRange {
        start: 0,
        end: u16::MAX,
    };

    /// `start..=end`; `None` when `start > end`.
    pub fn new(start: u16, end: u16) -> Option<Self> {
        (start <= end).then_some(Self { start, end })
    }

    /// One port.
    pub fn single(port: u16) -> Self {
        Self {
            start: port,
            end: port,
        }
    }

    /// First port.
    pub fn start(self) -> u16 {
        self.start
    }

    /// Last port.
    pub fn end(self) -> u16 {
        self.end
    }

    /// Whether `port` lies in the range.
    pub fn contains(self, port: u16) -> bool {
        self.start <= port && port <= self.end
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.start == self.end {
            write!(f, "{}", self.start)
        } else {
            write!(f, "{}-{}", self.start, self.end)
        }
    }
}

/// Why a port range did not parse.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{text:?} is not a port or a port range (\"22\", \"2379-2380\")")]
pub struct PortRangeError {
    /// The text given.
    pub text: String,
}

impl FromStr for PortRange {
    type Err = PortRangeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || PortRangeError { text: s.to_owned() };
        let (a, b) = match s.split_once(['-', ':']) {
            Some((a, b)) => (a, b),
            None => (s, s),
        };
        let start: u16 = a.trim().parse().map_err(|_| err())?;
        let end: u16 = b.trim().parse().map_err(|_| err())?;
        PortRange::new(start, end).ok_or_else(err)
    }
}

impl Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.start == self.end {
            s.serialize_u16(self.start)
        } else {
            s.collect_str(self)
        }
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Port(u16),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Port(p) => Ok(PortRange::single(p)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// An address prefix such as `10.0.0.0/8` or `fd00::/8`; a host is a full-length prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Prefix {
    addr: IpAddr,
    len: u8,
}

/// Why a prefix did not parse or was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PrefixError {
    /// Not an address, or a length that is not a number.
    #[error("{text:?} is not an address prefix (\"10.0.0.0/8\", \"fd00::/8\", \"192.0.2.7\")")]
    Syntax {
        /// The text given.
        text: String,
    },
    /// The length exceeds the family's width.
    #[error("prefix length {len} is longer than {bits} bits in {text:?}")]
    Length {
        /// The text given.
        text: String,
        /// The length given.
        len: u8,
        /// The family's width.
        bits: u8,
    },
    /// Bits are set after the prefix length, so the text does not say what it means.
    #[error("{text:?} has bits set after its prefix length (did you mean {canonical}?)")]
    HostBits {
        /// The text given.
        text: String,
        /// The prefix with those bits cleared.
        canonical: Prefix,
    },
}

impl Prefix {
    /// `addr/len`, refusing a length beyond the family's width or bits set after it.
    pub fn new(addr: IpAddr, len: u8) -> Result<Self, PrefixError> {
        let bits = Family::of(&addr).bits();
        if len > bits {
            return Err(PrefixError::Length {
                text: format!("{addr}/{len}"),
                len,
                bits,
            });
        }
        let p = Self::masked(addr, len);
        if p.addr != addr {
            return Err(PrefixError::HostBits {
                text: format!("{addr}/{len}"),
                canonical: p,
            });
        }
        Ok(p)
    }

    /// One host.
    pub fn host(addr: IpAddr) -> Self {
        Self {
            addr,
            len: Family::of(&addr).bits(),
        }
    }

    /// `addr/len` with the bits after `len` cleared (`len` is clamped to the width).
    pub(crate) fn masked(addr: IpAddr, len: u8) -> Self {
        let family = Family::of(&addr);
        let len = len.min(family.bits());
        let (lo, _) = prefix_bounds(family, to_int(&addr), len);
        Self {
            addr: from_int(family, lo),
            len,
        }
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    /// The family.
    pub fn family(&self) -> Family {
        Family::of(&self.addr)
    }

    /// Whether `addr` lies in the prefix.
    pub fn contains(&self, addr: &IpAddr) -> bool {
        if Family::of(addr) != self.family() {
            return false;
        }
        let (lo, hi) = self.bounds();
        let a = to_int(addr);
        lo <= a && a <= hi
    }

    /// The first and last address as integers.
    pub(crate) fn bounds(&self) -> (u128, u128) {
        prefix_bounds(self.family(), to_int(&self.addr), self.len)
    }
}

fn prefix_bounds(family: Family, addr: u128, len: u8) -> (u128, u128) {
    let host_bits = u32::from(family.bits().saturating_sub(len));
    let host_mask = if host_bits >= 128 {
        u128::MAX
    } else {
        (1u128 << host_bits) - 1
    };
    let lo = addr & !host_mask;
    (lo, (lo | host_mask) & family.max_addr())
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl FromStr for Prefix {
    type Err = PrefixError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let syntax = || PrefixError::Syntax { text: s.to_owned() };
        match s.split_once('/') {
            None => s.parse::<IpAddr>().map(Prefix::host).map_err(|_| syntax()),
            Some((a, l)) => {
                let addr: IpAddr = a.parse().map_err(|_| syntax())?;
                let len: u8 = l.parse().map_err(|_| syntax())?;
                Prefix::new(addr, len).map_err(|e| match e {
                    PrefixError::Length { len, bits, .. } => PrefixError::Length {
                        text: s.to_owned(),
                        len,
                        bits,
                    },
                    PrefixError::HostBits { canonical, .. } => PrefixError::HostBits {
                        text: s.to_owned(),
                        canonical,
                    },
                    other => other,
                })
            }
        }
    }
}

impl Serialize for Prefix {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Prefix {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An address as an integer (IPv4 in the low 32 bits).
pub(crate) fn to_int(addr: &IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(*a)),
        IpAddr::V6(a) => u128::from(*a),
    }
}

/// An integer as an address of `family` (IPv4 takes the low 32 bits).
pub(crate) fn from_int(family: Family, n: u128) -> IpAddr {
    match family {
        Family::Ipv4 => IpAddr::V4(Ipv4Addr::from(
            u32::try_from(n & u128::from(u32::MAX)).unwrap_or(u32::MAX),
        )),
        Family::Ipv6 => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

/// The smallest list of prefixes covering exactly `lo..=hi` of `family`.
pub(crate) fn range_to_prefixes(family: Family, lo: u128, hi: u128) -> Vec<Prefix> {
    let mut out = Vec::new();
    let bits = u32::from(family.bits());
    let mut cur = lo;
    loop {
        if cur > hi {
            break;
        }
        // Largest block aligned at `cur` that fits before `hi`.
        let align = if cur == 0 {
            bits
        } else {
            cur.trailing_zeros().min(bits)
        };
        let mut size_bits = align;
        while size_bits > 0 {
            let last = if size_bits >= 128 {
                u128::MAX
            } else {
                cur.saturating_add((1u128 << size_bits) - 1)
            };
            if last <= hi {
                break;
            }
            size_bits -= 1;
        }
        let len = u8::try_from(bits - size_bits).unwrap_or(0);
        out.push(Prefix {
            addr: from_int(family, cur),
            len,
        });
        let block_last = if size_bits >= 128 {
            u128::MAX
        } else {
            cur.saturating_add((1u128 << size_bits) - 1)
        };
        match block_last.checked_add(1) {
            Some(next) => cur = next,
            None => break,
        }
    }
    out
}

/// A set of integers as sorted, disjoint, non-adjacent inclusive intervals. Ports and
/// addresses both use it. Shared, so that cloning one (as splitting a segment of a
/// [`crate::space::Space`] does) costs a reference count, not an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub(crate) struct Ranges(Arc<[(u128, u128)]>);

impl Ranges {
    pub(crate) fn empty() -> Self {
        Self::default()
    }

    fn from_vec(v: Vec<(u128, u128)>) -> Self {
        Self(Arc::from(v))
    }

    pub(crate) fn from_range(lo: u128, hi: u128) -> Self {
        if lo <= hi {
            Self(Arc::from([(lo, hi)]))
        } else {
            Self::empty()
        }
    }

    /// From intervals in any order, overlapping or not.
    pub(crate) fn from_unsorted(mut v: Vec<(u128, u128)>) -> Self {
        v.retain(|(a, b)| a <= b);
        v.sort_unstable();
        let mut out: Vec<(u128, u128)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match out.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        Self::from_vec(out)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn intervals(&self) -> &[(u128, u128)] {
        &self.0
    }

    pub(crate) fn contains(&self, x: u128) -> bool {
        let i = self.0.partition_point(|&(_, b)| b < x);
        self.0.get(i).is_some_and(|&(a, _)| a <= x)
    }

    /// Whether every member of `other` is in `self`.
    pub(crate) fn covers(&self, other: &Ranges) -> bool {
        other.subtract(self).is_empty()
    }

    pub(crate) fn union(&self, other: &Ranges) -> Ranges {
        if other.is_empty() {
            return self.clone();
        }
        if self.is_empty() {
            return other.clone();
        }
        let mut v = Vec::with_capacity(self.0.len() + other.0.len());
        v.extend_from_slice(&self.0);
        v.extend_from_slice(&other.0);
        Self::from_unsorted(v)
    }

    pub(crate) fn intersect(&self, other: &Ranges) -> Ranges {
        if Arc::ptr_eq(&self.0, &other.0) {
            return self.clone();
        }
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while let (Some(&(a1, b1)), Some(&(a2, b2))) = (self.0.get(i), other.0.get(j)) {
            let lo = a1.max(a2);
            let hi = b1.min(b2);
            if lo <= hi {
                out.push((lo, hi));
            }
            if b1 < b2 {
                i += 1;
            } else {
                j += 1;
            }
        }
        Self::from_vec(out)
    }

    pub(crate) fn subtract(&self, other: &Ranges) -> Ranges {
        if other.is_empty() || self.is_empty() {
            return self.clone();
        }
        let mut out = Vec::new();
        let mut j = 0;
        for &(a, b) in self.0.iter() {
            let mut cur = a;
            let mut done = false;
            // Skip cuts entirely before this interval.
            while other.0.get(j).is_some_and(|&(_, cb)| cb < a) {
                j += 1;
            }
            let mut k = j;
            while let Some(&(ca, cb)) = other.0.get(k) {
                if ca > b {
                    break;
                }
                if ca > cur {
                    out.push((cur, ca - 1));
                }
                match cb.checked_add(1) {
                    Some(n) if cb < b => cur = n,
                    _ => {
                        done = true;
                        break;
                    }
                }
                k += 1;
            }
            if !done && cur <= b {
                out.push((cur, b));
            }
        }
        Self::from_vec(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_parses_hosts_and_refuses_host_bits() {
        assert_eq!(
            "10.0.0.0/8".parse::<Prefix>().unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert_eq!(
            "192.0.2.7".parse::<Prefix>().unwrap().to_string(),
            "192.0.2.7/32"
        );
        assert_eq!("fd00::/8".parse::<Prefix>().unwrap().prefix_len(), 8);
        let e = "10.1.0.0/8".parse::<Prefix>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"10.1.0.0/8\" has bits set after its prefix length (did you mean 10.0.0.0/8?)"
        );
        assert!(matches!(
            "10.0.0.0/33".parse::<Prefix>(),
            Err(PrefixError::Length {
                len: 33,
                bits: 32,
                ..
            })
        ));
        assert!("10.0.0/8".parse::<Prefix>().is_err());
    }

    #[test]
    fn port_range_parses_single_and_ranges() {
        assert_eq!("22".parse::<PortRange>().unwrap(), PortRange::single(22));
        assert_eq!(
            "2379-2380".parse::<PortRange>().unwrap(),
            PortRange::new(2379, 2380).unwrap()
        );
        assert_eq!("1000:2000".parse::<PortRange>().unwrap().end(), 2000);
        assert!("2380-2379".parse::<PortRange>().is_err());
        assert!("70000".parse::<PortRange>().is_err());
    }

    #[test]
    fn ranges_algebra() {
        let a = Ranges::from_unsorted(vec![(10, 20), (0, 5), (6, 8)]);
        assert_eq!(a.intervals(), &[(0, 8), (10, 20)]);
        let b = Ranges::from_range(4, 12);
        assert_eq!(a.intersect(&b).intervals(), &[(4, 8), (10, 12)]);
        assert_eq!(a.subtract(&b).intervals(), &[(0, 3), (13, 20)]);
        assert_eq!(a.union(&b).intervals(), &[(0, 20)]);
        let full = Ranges::from_range(0, u128::MAX);
        assert_eq!(
            full.subtract(&Ranges::from_range(0, 0)).intervals(),
            &[(1, u128::MAX)]
        );
        assert!(full.subtract(&full).is_empty());
        assert!(a.contains(7) && !a.contains(9));
    }

    #[test]
    fn ranges_become_minimal_prefixes() {
        let p = range_to_prefixes(Family::Ipv4, 0x0a00_0000, 0x0aff_ffff);
        assert_eq!(p, vec!["10.0.0.0/8".parse().unwrap()]);
        let p = range_to_prefixes(Family::Ipv4, 0xc0a8_0101, 0xc0a8_0114);
        let text: Vec<String> = p.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "192.168.1.1/32",
                "192.168.1.2/31",
                "192.168.1.4/30",
                "192.168.1.8/29",
                "192.168.1.16/30",
                "192.168.1.20/32"
            ]
        );
        let all6 = range_to_prefixes(Family::Ipv6, 0, u128::MAX);
        assert_eq!(all6, vec!["::/0".parse().unwrap()]);
    }

    #[test]
    fn remote_universe_excludes_loopback() {
        let v4 = Family::Ipv4.remote_universe();
        assert!(!v4.contains(0x7f00_0001));
        assert!(v4.contains(0x0a00_0001));
        let v6 = Family::Ipv6.remote_universe();
        assert!(!v6.contains(1) && v6.contains(2));
    }
}
