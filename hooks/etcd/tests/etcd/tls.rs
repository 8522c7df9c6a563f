//! Mutual TLS against an etcd started with --client-cert-auth.

use probity_etcd::{EtcdClient, EtcdError, TlsConfig};

use crate::harness::{Etcd, Pki};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_the_client_certificate_and_refuses_a_client_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let etcd = Etcd::single_tls(pki.server());
    etcd.wait_healthy(Some(pki.client())).await;
    let endpoint = etcd.endpoints()[0].clone();
    assert!(endpoint.starts_with("https://"));

    let client = EtcdClient::connect(etcd.config().with_tls(pki.client()))
        .await
        .unwrap();
    client.put("keys/k1", b"meta".to_vec()).await.unwrap();
    assert_eq!(
        client.get("keys/k1").await.unwrap().0.unwrap().value,
        b"meta"
    );

    let refused = |tls: TlsConfig| {
        let config = etcd.config().with_tls(tls);
        async move {
            let client = EtcdClient::connect(config).await.unwrap();
            client.get("keys/k1").await.unwrap_err()
        }
    };
    let check = |err: &EtcdError, needle: &str| {
        let text = match err {
            EtcdError::Request {
                endpoint: e,
                source,
                ..
            } => {
                assert_eq!(e, &endpoint);
                source.to_string()
            }
            EtcdError::Unavailable { failures, .. } => {
                assert_eq!(failures[0].endpoint, endpoint);
                failures[0].reason.clone()
            }
            other => panic!("{other:?}"),
        };
        assert!(
            text.to_lowercase().contains(needle),
            "{needle:?} not in {text:?}"
        );
        eprintln!("refused as expected: {err}: {text}");
    };

    // No client certificate.
    let anonymous = refused(TlsConfig::from_ca_file(&pki.ca).unwrap()).await;
    check(&anonymous, "certificate");
    // A certificate from another CA.
    let stranger = TlsConfig::from_ca_file(&pki.ca)
        .unwrap()
        .with_client_identity_files(&pki.stranger_cert, &pki.stranger_key)
        .unwrap();
    check(&refused(stranger).await, "certificate");
    // A server the client's CA did not sign.
    let other_dir = tempfile::tempdir().unwrap();
    let other = Pki::new(other_dir.path());
    check(&refused(other.client()).await, "certificate");
}
