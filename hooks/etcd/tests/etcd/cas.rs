//! Compare-and-swap and versions that only go up.

use std::collections::BTreeMap;
use std::sync::Arc;

use probity_etcd::{Swap, VersionedError, VersionedWrite, WatchMessage};
use serde::Serialize;

use crate::harness::Etcd;

#[derive(Serialize)]
struct Manifest<'a> {
    object_id: &'a str,
    version: u64,
    digest: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_refuses_an_existing_key_and_hands_it_back() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let first = client.create("keys/k1", b"one".to_vec()).await.unwrap();
    let Swap::Applied { revision } = first else {
        panic!("{first:?}")
    };
    let second = client.create("keys/k1", b"two".to_vec()).await.unwrap();
    match second {
        Swap::Refused { current: Some(e) } => {
            assert_eq!(e.value, b"one");
            assert_eq!(e.mod_revision, revision);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_if_and_delete_if_hold_only_at_the_revision_read() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let rev = client.put("keys/k1", b"one".to_vec()).await.unwrap();
    let swapped = client
        .update_if("keys/k1", b"two".to_vec(), rev)
        .await
        .unwrap();
    let Swap::Applied { revision: rev2 } = swapped else {
        panic!("{swapped:?}")
    };
    // A writer that read the old revision loses and sees the new value.
    match client
        .update_if("keys/k1", b"three".to_vec(), rev)
        .await
        .unwrap()
    {
        Swap::Refused { current: Some(e) } => {
            assert_eq!(e.value, b"two");
            assert_eq!(e.mod_revision, rev2);
        }
        other => panic!("{other:?}"),
    }
    assert!(!client.delete_if("keys/k1", rev).await.unwrap().is_applied());
    assert!(
        client
            .delete_if("keys/k1", rev2)
            .await
            .unwrap()
            .is_applied()
    );
    match client
        .update_if("keys/k1", b"four".to_vec(), rev2)
        .await
        .unwrap()
    {
        Swap::Refused { current: None } => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_versioned_record_only_goes_up() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let m = |version, digest: &str| Manifest {
        object_id: "models/llama",
        version,
        digest: digest.into(),
    };
    let key = "registry/models/llama";
    assert!(matches!(
        client.put_versioned(key, &m(1, "aa")).await.unwrap(),
        VersionedWrite::Created { .. }
    ));
    let updated = client.put_versioned(key, &m(3, "cc")).await.unwrap();
    let VersionedWrite::Updated {
        previous: 1,
        revision,
    } = updated
    else {
        panic!("{updated:?}")
    };
    match client.put_versioned(key, &m(2, "bb")).await.unwrap_err() {
        VersionedError::Rollback {
            offered: 2,
            accepted: 3,
            key: k,
        } => assert_eq!(k, key),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        client.put_versioned(key, &m(3, "cc")).await.unwrap(),
        VersionedWrite::Unchanged {
            mod_revision: revision
        }
    );
    let conflict = client.put_versioned(key, &m(3, "dd")).await.unwrap_err();
    assert!(
        matches!(conflict, VersionedError::Conflict { version: 3, .. }),
        "{conflict:?}"
    );
    assert_eq!(
        conflict.to_string(),
        "refusing a different record for \"registry/models/llama\" version 3: another digest was accepted for it"
    );
    // Records without a digest compare by their bytes.
    let plain = "registry/plain";
    client
        .put_versioned_bytes(plain, br#"{"version":5}"#.to_vec())
        .await
        .unwrap();
    assert!(matches!(
        client
            .put_versioned_bytes(plain, br#"{"version":5}"#.to_vec())
            .await
            .unwrap(),
        VersionedWrite::Unchanged { .. }
    ));
    assert!(matches!(
        client
            .put_versioned_bytes(plain, br#"{"version":5,"x":1}"#.to_vec())
            .await
            .unwrap_err(),
        VersionedError::Conflict { version: 5, .. }
    ));
    // Garbage on either side fails closed, naming where.
    match client
        .put_versioned_bytes(plain, br#"{"digest":"x"}"#.to_vec())
        .await
        .unwrap_err()
    {
        VersionedError::InvalidOffered { .. } => {}
        other => panic!("{other:?}"),
    }
    client
        .put("registry/garbage", b"not json".to_vec())
        .await
        .unwrap();
    match client
        .put_versioned("registry/garbage", &m(9, "ee"))
        .await
        .unwrap_err()
    {
        VersionedError::InvalidStored { mod_revision, .. } => assert!(mod_revision > 0),
        other => panic!("{other:?}"),
    }
}

/// Several writers over two connections race to write versions 1..=N of one id, each with
/// its own digest. The stored version never goes down (a watch sees it rise one by one) and
/// each version has exactly one winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_never_roll_back_and_one_wins_each_version() {
    const WRITERS: usize = 4;
    const VERSIONS: u64 = 120;
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let clients = [
        etcd.client("/probity/").await,
        etcd.client("/probity/").await,
    ];
    let key = "registry/models/contested";
    let (_, start) = clients[0].get(key).await.unwrap();
    let mut watch = clients[0].watch_prefix("registry/", start + 1);

    let barrier = Arc::new(tokio::sync::Barrier::new(WRITERS));
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let client = clients[w % 2].clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut won = Vec::new();
            for v in 1..=VERSIONS {
                let record = Manifest {
                    object_id: "models/contested",
                    version: v,
                    digest: format!("writer-{w}-v{v}"),
                };
                match client.put_versioned(key, &record).await {
                    Ok(VersionedWrite::Created { .. } | VersionedWrite::Updated { .. }) => {
                        won.push(v)
                    }
                    Ok(VersionedWrite::Unchanged { .. }) => panic!("digests differ"),
                    Err(VersionedError::Rollback {
                        offered, accepted, ..
                    }) => assert!(accepted > offered),
                    Err(VersionedError::Conflict { version, .. }) => assert_eq!(version, v),
                    Err(e) => panic!("writer {w} v{v}: {e}"),
                }
            }
            won
        }));
    }
    let mut winners: BTreeMap<u64, usize> = BTreeMap::new();
    for task in tasks {
        for v in task.await.unwrap() {
            *winners.entry(v).or_default() += 1;
        }
    }
    for v in 1..=VERSIONS {
        assert_eq!(winners.get(&v), Some(&1), "version {v}");
    }

    // The watch saw every accepted version, in order, never going down.
    let mut seen = Vec::new();
    while seen.len() < VERSIONS as usize {
        let message = tokio::time::timeout(std::time::Duration::from_secs(10), watch.next())
            .await
            .expect("watch delivers")
            .expect("watch open");
        let WatchMessage::Events { events, .. } = message else {
            panic!("{message:?}")
        };
        for e in events {
            if let probity_etcd::WatchEvent::Put { entry, .. } = e {
                let head = probity_etcd::VersionHead::parse(&entry.value).unwrap();
                seen.push(head.version);
            }
        }
    }
    assert_eq!(seen, (1..=VERSIONS).collect::<Vec<_>>());
}
