//! etcd stopped entirely for a while, then restarted on the same data: the state served
//! ages visibly, writes fail clearly, then everything catches up.

use std::time::Duration;

use probity_etcd::{EtcdClient, EtcdError, Operation};
use rustix::process::Signal;

use crate::harness::{Etcd, POLL, eventually};
use crate::watch::{Mirror, converged};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_then_back_staleness_grows_writes_fail_then_all_catches_up() {
    let mut etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let endpoint = etcd.endpoints()[0].clone();
    // A short retry budget: a write fails within a second instead of waiting for etcd.
    let client = EtcdClient::connect(
        etcd.config()
            .with_prefix("/probity/")
            .with_retry_budget(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    for i in 0..10 {
        client
            .put(&format!("blocklist/n{i}"), b"blocked".to_vec())
            .await
            .unwrap();
    }
    let mirror = Mirror::default();
    let watch = client
        .watch_with_resync("blocklist/", mirror.clone())
        .unwrap();
    converged(&client, &mirror, "blocklist/").await;
    assert!(watch.status().connected);

    etcd.stop(0, Signal::TERM);

    // The watch notices, and the age of what it serves grows.
    let first = eventually(WAIT, "the watch sees etcd gone", || {
        let s = watch.status();
        async move { (!s.connected).then_some(s.since_last_heard?) }
    })
    .await;
    let later = eventually(WAIT, "the staleness grows", || {
        let s = watch.status();
        async move { s.since_last_heard.filter(|age| *age > first + POLL * 5) }
    })
    .await;
    assert!(later > first);

    // Writes fail clearly: which operation, which key, which endpoint, what.
    let err = client
        .put("blocklist/n99", b"x".to_vec())
        .await
        .unwrap_err();
    match &err {
        EtcdError::Unavailable {
            operation,
            key,
            failures,
            ..
        } => {
            assert_eq!(*operation, Operation::Put);
            assert_eq!(key, "blocklist/n99");
            assert_eq!(failures[0].endpoint, endpoint);
            assert!(failures[0].reason.contains("Connection refused"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    let health = client.health();
    assert!(!health.connected);
    assert!(health.last_error.unwrap().contains(&endpoint));
    // What was applied is still served from memory.
    assert_eq!(mirror.map().len(), 10);

    etcd.start(0);
    etcd.wait_healthy(None).await;
    // Changes made before the watch is back: it must deliver them (or resync).
    let writer = etcd.client("/probity/").await;
    for i in 10..15 {
        writer
            .put(&format!("blocklist/n{i}"), b"later".to_vec())
            .await
            .unwrap();
    }
    writer.delete("blocklist/n0").await.unwrap();
    converged(&writer, &mirror, "blocklist/").await;
    eventually(WAIT, "the watch is connected again", || {
        let s = watch.status();
        async move { (s.connected && s.since_last_heard? < first).then_some(()) }
    })
    .await;
    client.put("blocklist/n99", b"x".to_vec()).await.unwrap();
    assert!(client.health().connected);
    converged(&writer, &mirror, "blocklist/").await;
}
