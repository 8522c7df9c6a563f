//! Every fixture parses, and the two real captures reduce to what their rules mean.

use probity_firewall::{
    Exposure, Family, Inputs, Note, Protocol, Reachability, iptables, nft, reduce,
};

use super::{fixture, fixture_dir};

const V4: Family = Family::Ipv4;
const V6: Family = Family::Ipv6;
const TCP: Protocol = Protocol::Tcp;
const UDP: Protocol = Protocol::Udp;

/// The reachable ranges of a family and protocol as text: "22 any; 10250 10.0.0.0/8".
pub fn show(r: &Reachability, family: Family, protocol: Protocol) -> String {
    r.ranges(family, protocol)
        .iter()
        .map(|x| {
            let e = match &x.exposure {
                Exposure::Any => "any".to_owned(),
                Exposure::Sources(p) => p
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                Exposure::AnyExcept(p) => format!(
                    "any-except {}",
                    p.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            };
            format!("{} {e}", x.ports)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The family of an iptables fixture, from its name.
pub fn iptables_family(name: &str) -> Family {
    if name.contains("ip6tables") { V6 } else { V4 }
}

#[test]
fn every_fixture_parses() {
    let mut seen = 0;
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let bytes = std::fs::read(&path).unwrap();
        if name.ends_with(".json") {
            let rs = nft::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(
                !rs.tables.is_empty() || name.contains("empty"),
                "{name} has no table"
            );
            seen += 1;
        } else if name.ends_with(".txt") {
            iptables::parse(&bytes, iptables_family(&name))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            seen += 1;
        }
    }
    assert!(seen >= 2, "only {seen} fixtures");
}

#[test]
fn nft_capture_reduces_to_its_rules() {
    let rs = nft::parse(&fixture("nft-j-netns.json")).unwrap();
    let r = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    // Set allowed_tcp {22, 2379, 2380}, kubelet 10250 from 10/8 over IPv4 only, lo and
    // established admit no new remote connection, ICMP is not TCP or UDP.
    assert_eq!(show(&r, V4, TCP), "22 any; 2379-2380 any; 10250 10.0.0.0/8");
    assert_eq!(show(&r, V6, TCP), "22 any; 2379-2380 any");
    assert_eq!(show(&r, V4, UDP), "");
    assert_eq!(show(&r, V6, UDP), "");
    assert!(r.uncertainties.is_empty(), "{:#?}", r.uncertainties);
    assert!(r.admits(TCP, 10250, &"10.20.30.40".parse().unwrap()));
    assert!(!r.admits(TCP, 10250, &"192.0.2.1".parse().unwrap()));
}

#[test]
fn iptables_capture_reduces_to_its_rules() {
    let dump = iptables::parse(&fixture("iptables-save-netns.txt"), V4).unwrap();
    assert_eq!(dump.backend, iptables::Backend::NfTables);
    let r = reduce(&Inputs {
        nft: None,
        iptables: vec![&dump],
    });
    assert_eq!(show(&r, V4, TCP), "22 any; 2379-2380 any; 10250 10.0.0.0/8");
    assert_eq!(show(&r, V4, UDP), "");
    assert!(r.uncertainties.is_empty(), "{:#?}", r.uncertainties);
    // The nat table's INPUT chain accepts everything; only filter narrows.
    assert_eq!(r.filters.len(), 2);
    // No IPv6 source was given: nothing filters IPv6.
    assert_eq!(show(&r, V6, TCP), "0-65535 any");
    assert!(r.notes.contains(&Note::NoInputHook { family: V6 }));
}

/// The dumps the namespace tests saved reduce, offline, to what the live tests saw.
#[test]
fn saved_namespace_dumps_reduce_as_they_did_live() {
    let rs = nft::parse(&fixture("netns-nft-extra-ports.json")).unwrap();
    let r = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert_eq!(
        show(&r, V4, TCP),
        "2222 any; 2379-2380 any; 8080 any; 9000 192.0.2.0/24; 10250 10.0.0.0/8"
    );
    assert_eq!(show(&r, V6, UDP), "53 any; 5000 any");

    let rs = nft::parse(&fixture("netns-iptables-nft.json")).unwrap();
    let v4 = iptables::parse(&fixture("netns-iptables-save.txt"), V4).unwrap();
    let v6 = iptables::parse(&fixture("netns-ip6tables-save.txt"), V6).unwrap();
    let r = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![&v4, &v6],
    });
    assert_eq!(
        show(&r, V4, TCP),
        "2379-2380 any; 7000 any; 7002 any; 10250 10.0.0.0/8"
    );
    assert_eq!(show(&r, V4, UDP), "4000-4010 any");
    assert_eq!(show(&r, V6, TCP), "2379-2380 any; 7000 any");
    assert!(r.notes.contains(&Note::TableFromIptables {
        family: "ip".into(),
        table: "filter".into()
    }));

    // Both the iptables-nft table and a native one; without the iptables view, the xt
    // matches are uncertainties that count as reachable.
    let rs = nft::parse(&fixture("netns-native-and-iptables-nft.json")).unwrap();
    let r = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert_eq!(show(&r, V4, TCP), "0-8079 any; 8081-65535 any");
    assert!(
        r.uncertainties
            .iter()
            .any(|u| u.reason.contains("xt match multiport"))
    );

    let rs = nft::parse(&fixture("netns-probity-baseline.json")).unwrap();
    let r = reduce(&Inputs {
        nft: Some(&rs),
        iptables: vec![],
    });
    assert_eq!(
        show(&r, V4, TCP),
        "2222 any; 2379-2380 any; 10250 10.0.0.0/8"
    );
    assert_eq!(show(&r, V6, UDP), "4789 any");
    assert!(r.uncertainties.is_empty());
}
