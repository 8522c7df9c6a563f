//! Delivery to a real rsyslog over each transport, and refusal of bad certificates.

use std::sync::Arc;
use std::time::Duration;

use probity_siem::{Forwarder, MemoryCursor, MemorySource, Transport};

use crate::support::{Ca, Chain, Input, Pki, Rsyslog, check_delivery, eventually, fast, free_port};

/// Sends 1,500 records, then 500 more, over `transport` to rsyslog listening with
/// `input`; checks every message and that the cursor reached the end.
fn delivers_everything(input: &Input<'_>, transport: Transport, dir: &std::path::Path) {
    let port = free_port();
    let mut rsyslog = Rsyslog::start(dir, port, input);
    let source = Arc::new(MemorySource::new());
    let mut chain = Chain::new();
    let mut records = chain.take(1500);
    source.append(records.clone()).unwrap();
    let cursor = MemoryCursor::new();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), transport),
        source.clone(),
        cursor.clone(),
    )
    .unwrap();
    rsyslog.wait_for_seq(1500, Duration::from_secs(60));
    // A second burst on the same forwarder.
    let more = chain.take(500);
    source.append(more.clone()).unwrap();
    records.extend(more);
    let msgs = rsyslog.wait_for_seq(2000, Duration::from_secs(60));
    let stats = eventually("the cursor to reach 2000", Duration::from_secs(30), || {
        let s = fwd.stats();
        (s.cursor == 2000).then_some(s)
    });
    assert_eq!(cursor.value(), 2000);
    let duplicates = check_delivery(&msgs, &records);
    // Nothing failed, so nothing was sent twice.
    assert_eq!(
        (duplicates, stats.failed_sends, stats.failed_connects),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.forwarded, 2000);
    assert_eq!((stats.backlog, stats.behind), (0, false));
    assert_eq!(stats.last_error, None);
}

#[test]
fn tcp_octet_counted_delivers_every_record_in_order() {
    let dir = tempfile::tempdir().unwrap();
    delivers_everything(&Input::Tcp, Transport::Tcp, dir.path());
}

#[test]
fn tls_delivers_every_record_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let input = Input::Tls {
        server: &pki.server,
        ca: &pki.ca.pem_path,
        client_auth: false,
    };
    delivers_everything(&input, Transport::Tls(pki.tls()), dir.path());
}

#[test]
fn tls_with_a_client_certificate_delivers_to_a_receiver_that_demands_one() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let input = Input::Tls {
        server: &pki.server,
        ca: &pki.ca.pem_path,
        client_auth: true,
    };
    delivers_everything(&input, Transport::Tls(pki.tls_with_client()), dir.path());
}

#[test]
fn relp_delivers_every_record_in_order() {
    let dir = tempfile::tempdir().unwrap();
    delivers_everything(&Input::Relp, Transport::Relp, dir.path());
}

#[test]
fn relp_over_tls_delivers_every_record_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let input = Input::RelpTls {
        server: &pki.server,
        ca: &pki.ca.pem_path,
    };
    delivers_everything(
        &input,
        Transport::RelpTls(pki.tls_with_client()),
        dir.path(),
    );
}

/// Starts rsyslog with `server`'s certificate and a forwarder trusting `client_tls`;
/// checks that nothing is marked delivered and the error says why.
fn refused(
    dir: &std::path::Path,
    server: &crate::support::Leaf,
    ca: &std::path::Path,
    client_tls: probity_siem::TlsSettings,
    why: &str,
) {
    let port = free_port();
    let rsyslog = Rsyslog::start(
        dir,
        port,
        &Input::Tls {
            server,
            ca,
            client_auth: false,
        },
    );
    let source = Arc::new(MemorySource::new());
    source.append(Chain::new().take(10)).unwrap();
    let cursor = MemoryCursor::new();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), Transport::Tls(client_tls)),
        source.clone(),
        cursor.clone(),
    )
    .unwrap();
    let stats = eventually("certificate errors", Duration::from_secs(30), || {
        let s = fwd.stats();
        (s.certificate_errors >= 2).then_some(s)
    });
    let stats = {
        let s = fwd.stop();
        assert!(s.certificate_errors >= stats.certificate_errors);
        s
    };
    assert_eq!(stats.failed_connects, stats.certificate_errors, "{stats:?}");
    assert_eq!(
        (stats.forwarded, stats.sent, stats.cursor, stats.backlog),
        (0, 0, 0, 10)
    );
    assert_eq!(cursor.value(), 0);
    let error = stats.last_error.unwrap();
    assert_eq!(
        error,
        format!(
            "certificate of 127.0.0.1:{port} refused for server name 127.0.0.1: invalid peer certificate: {why}"
        )
    );
    let (got, bad) = rsyslog.received();
    assert!(got.is_empty() && bad.is_empty());
}

#[test]
fn a_receiver_certified_by_another_ca_is_refused_and_nothing_is_marked_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let other = Ca::new(dir.path(), "some-other-ca");
    refused(
        dir.path(),
        &pki.server,
        &pki.ca.pem_path,
        probity_siem::TlsSettings::new(&other.pem_path),
        "UnknownIssuer",
    );
}

#[test]
fn a_receiver_certified_for_another_name_is_refused_and_nothing_is_marked_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let elsewhere = pki.ca.leaf(
        "elsewhere",
        "siem",
        &["siem.elsewhere.test", "127.0.0.9"],
        false,
    );
    refused(
        dir.path(),
        &elsewhere,
        &pki.ca.pem_path,
        pki.tls(),
        "certificate not valid for name \"127.0.0.1\"; certificate is only valid for DnsName(\"siem.elsewhere.test\") or IpAddress(127.0.0.9)",
    );
}

/// With TLS 1.3 the client finishes its handshake before the server has checked the
/// client's certificate: the refusal arrives later, and must not pass for the orderly
/// close that confirms delivery.
#[test]
fn a_receiver_that_refuses_our_missing_client_certificate_gets_nothing_marked_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let port = free_port();
    let rsyslog = Rsyslog::start(
        dir.path(),
        port,
        &Input::Tls {
            server: &pki.server,
            ca: &pki.ca.pem_path,
            client_auth: true,
        },
    );
    let source = Arc::new(MemorySource::new());
    source.append(Chain::new().take(10)).unwrap();
    let cursor = MemoryCursor::new();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), Transport::Tls(pki.tls())),
        source.clone(),
        cursor.clone(),
    )
    .unwrap();
    eventually("failures", Duration::from_secs(30), || {
        let s = fwd.stats();
        (s.failed_sends + s.failed_connects >= 3).then_some(())
    });
    let stats = fwd.stop();
    assert_eq!(
        (stats.forwarded, stats.cursor, stats.confirmations),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(cursor.value(), 0);
    let (got, _) = rsyslog.received();
    assert!(got.is_empty());
}

/// A differential check of our escaping and SD-NAMEs: rsyslog's own structured-data
/// parser (mmpstrucdata) reads back the values we meant, for hostile names and values.
#[test]
fn rsyslogs_structured_data_parser_reads_back_the_values_we_meant() {
    use probity_siem::{Record, RecordKind, Severity};
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let extra = "module(load=\"mmpstrucdata\")\n\
        template(name=\"sd\" type=\"string\" string=\"%$!rfc5424-sd%\\n\")\n\
        ruleset(name=\"probity\") { action(type=\"mmpstrucdata\" sd_name.lowercase=\"off\")\n\
        action(type=\"omfile\" file=\"OUT\" template=\"sd\") }";
    let rsyslog = Rsyslog::start_with(dir.path(), port, &Input::Tcp, extra);
    let mut chain = Chain::new();
    let mut records = Vec::new();
    let values = [
        "plain",
        "a \"quoted\" word",
        "back\\slash",
        "close]bracket",
        "all \\\"]\\",
        "ünïcödé €",
    ];
    for (i, v) in values.iter().enumerate() {
        let mut r: Record = chain.one();
        r.kind = RecordKind::Decision;
        r.severity = Severity::Critical;
        r.node = Some((*v).to_owned());
        r.fields = [
            ("resource".to_owned(), (*v).to_owned()),
            (format!("odd name={i}]\""), (*v).to_owned()),
        ]
        .into();
        records.push(r);
    }
    let source = Arc::new(MemorySource::new());
    source.append(records.clone()).unwrap();
    let fwd = Forwarder::start(
        fast(format!("127.0.0.1:{port}"), Transport::Tcp),
        source.clone(),
        MemoryCursor::new(),
    )
    .unwrap();
    eventually(
        "the cursor to reach the end",
        Duration::from_secs(30),
        || (fwd.stats().cursor == values.len() as u64).then_some(()),
    );
    let text = eventually("rsyslog's output", Duration::from_secs(30), || {
        let t = std::fs::read_to_string(&rsyslog.out).unwrap_or_default();
        (t.lines().count() >= values.len()).then_some(t)
    });
    for (i, (line, v)) in text.lines().zip(values).enumerate() {
        let json: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let sd = &json["probity@32473"];
        assert_eq!(sd["seq"], records[i].seq.to_string(), "{line}");
        assert_eq!(sd["node"], v, "{line}");
        assert_eq!(sd["resource"], v, "{line}");
        assert_eq!(sd[format!("odd_name_{i}__")], v, "{line}");
    }
}
