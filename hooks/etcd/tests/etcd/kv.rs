//! Get, paged list, put, batched put, delete, and the errors that name the endpoint.

use std::time::Duration;

use probity_etcd::{EtcdClient, EtcdConfig, EtcdError, KeyError, Operation};

use crate::harness::Etcd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_delete_report_the_revision_they_happened_at() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;

    let (absent, before) = client.get("blocklist/n1").await.unwrap();
    assert_eq!(absent, None);
    let put = client
        .put("blocklist/n1", b"tampered".to_vec())
        .await
        .unwrap();
    assert!(put > before);
    let (entry, at) = client.get("blocklist/n1").await.unwrap();
    let entry = entry.unwrap();
    assert_eq!(entry.key, "blocklist/n1");
    assert_eq!(entry.value, b"tampered");
    assert_eq!(entry.mod_revision, put);
    assert_eq!(entry.create_revision, put);
    assert_eq!(entry.version, 1);
    assert_eq!(entry.lease, None);
    assert_eq!(at, put);

    let again = client.put("blocklist/n1", b"twice".to_vec()).await.unwrap();
    assert_eq!(again, put + 1);
    let deleted = client.delete("blocklist/n1").await.unwrap();
    assert!(deleted.existed);
    assert_eq!(deleted.revision, again + 1);
    let gone = client.delete("blocklist/n1").await.unwrap();
    assert!(!gone.existed);
    assert_eq!(client.get("blocklist/n1").await.unwrap().0, None);

    // The prefix is really there in etcd's keyspace, and only our keys are listed.
    let raw = etcd.client("/").await;
    raw.put("other/x", b"not ours".to_vec()).await.unwrap();
    client.put("blocklist/n2", b"x".to_vec()).await.unwrap();
    let (full, _) = raw.get("probity/blocklist/n2").await.unwrap();
    assert_eq!(full.unwrap().value, b"x");
    let listing = client.list("").await.unwrap();
    let keys: Vec<&str> = listing.entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["blocklist/n2"]);
    client.put("blocklist/n3", b"y".to_vec()).await.unwrap();
    let wiped = client.delete_prefix("blocklist/").await.unwrap();
    assert_eq!(wiped.count, 2);
    assert!(client.list("").await.unwrap().entries.is_empty());
    assert_eq!(
        raw.get("other/x").await.unwrap().0.unwrap().value,
        b"not ours"
    );
    assert!(client.health().connected);
}

/// 20,000 keys list in pages at one revision; a writer adding keys meanwhile does not leak
/// into the listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_of_twenty_thousand_keys_lists_in_pages_at_one_revision() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let value = vec![b'f'; 256];
    let items: Vec<(String, Vec<u8>)> = (0..20_000)
        .map(|i| (format!("facts/node-{i:05}"), value.clone()))
        .collect();
    client.put_batch(&items, None).await.unwrap();

    let writer_client = client.clone();
    let writer = tokio::spawn(async move {
        for i in 0..200 {
            writer_client
                .put(&format!("facts/zz-late-{i:03}"), b"late".to_vec())
                .await
                .unwrap();
        }
    });
    let listing = client.list("facts/").await.unwrap();
    writer.await.unwrap();

    // 20 pages of 1,000 keys (the 20,000 keys of 256 bytes are 5.6 MiB: more than one
    // gRPC message may carry), plus whatever late keys were in at the first page.
    assert!(listing.pages >= 20, "{} pages", listing.pages);
    assert!(
        listing
            .entries
            .iter()
            .all(|e| e.mod_revision <= listing.revision)
    );
    let nodes = listing
        .entries
        .iter()
        .filter(|e| e.key.starts_with("facts/node-"))
        .count();
    assert_eq!(nodes, 20_000);
    let keys: Vec<&String> = listing.entries.iter().map(|e| &e.key).collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "key order, no repeat");
    let late_in = listing.entries.len() - 20_000;
    let late_total = client.list("facts/zz-late-").await.unwrap().entries.len();
    assert_eq!(late_total, 200);
    assert!(late_in <= 200);
}

/// One request for everything would exceed the 4 MiB gRPC message limit: the page is asked
/// again at half the size until it fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_too_big_for_one_message_is_asked_again_smaller() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = EtcdClient::connect(
        etcd.config()
            .with_prefix("/probity/")
            .with_page_size(probity_etcd::MAX_PAGE_SIZE),
    )
    .await
    .unwrap();
    let value = vec![b'v'; 512 * 1024];
    let items: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| (format!("big/{i:02}"), value.clone()))
        .collect();
    for chunk in items.chunks(2) {
        client.put_batch(chunk, None).await.unwrap();
    }
    let listing = client.list("big/").await.unwrap();
    assert_eq!(listing.entries.len(), 12);
    assert!(listing.pages > 1, "{} pages", listing.pages);
    assert!(listing.entries.iter().all(|e| e.value == value));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_utf8_fails_the_listing_with_its_escaped_bytes() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    client.put("blocklist/ok", b"x".to_vec()).await.unwrap();
    let mut raw = etcd_client::Client::connect([etcd.endpoints()[0].as_str()], None)
        .await
        .unwrap();
    raw.put(b"/probity/blocklist/\xffbad".to_vec(), b"x".to_vec(), None)
        .await
        .unwrap();
    let err = client.list("blocklist/").await.unwrap_err();
    match &err {
        EtcdError::MalformedKey { key, source } => {
            assert_eq!(key, "\"/probity/blocklist/\\xffbad\"");
            assert_eq!(*source, KeyError::NotUtf8 { offset: 19 });
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_fails_with_its_url_and_cause_after_the_retry_budget() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let client = EtcdClient::connect(
        EtcdConfig::new([url.clone()])
            .with_request_timeout(Duration::from_millis(500))
            .with_retry_budget(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let err = client.put("blocklist/n1", b"x".to_vec()).await.unwrap_err();
    match &err {
        EtcdError::Unavailable {
            operation,
            key,
            failures,
            ..
        } => {
            assert_eq!(*operation, Operation::Put);
            assert_eq!(key, "blocklist/n1");
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].endpoint, url);
            assert!(
                failures[0].reason.contains("Connection refused"),
                "{}",
                failures[0].reason
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(err.is_unavailable());
    let health = client.health();
    assert!(!health.connected);
    assert_eq!(health.since_last_heard, None);
    assert!(health.last_error.unwrap().contains(&url));
}
