//! Watches: order, previous values, progress, compaction, resume, and the resync helper.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use probity_etcd::{
    EtcdClient, ResyncOptions, Snapshot, SyncReason, WatchEvent, WatchHandler, WatchMessage,
    WatchStream,
};

use crate::harness::{Etcd, Proxy, eventually};

const WAIT: Duration = Duration::from_secs(20);

/// The next message, or a panic after [`WAIT`].
async fn next(watch: &mut WatchStream) -> WatchMessage {
    tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("a watch message in time")
        .expect("the watch is open")
}

/// Collects put/delete events until `count` arrived.
async fn collect(watch: &mut WatchStream, count: usize) -> Vec<WatchEvent> {
    let mut out = Vec::new();
    while out.len() < count {
        match next(watch).await {
            WatchMessage::Events { events, revision } => {
                assert_eq!(revision, events.last().unwrap().mod_revision());
                out.extend(events);
            }
            other => panic!("{other:?}"),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_a_revision_delivers_puts_and_deletes_in_order_with_previous_values() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let r1 = client.put("blocklist/a", b"1".to_vec()).await.unwrap();
    client.put("blocklist/a", b"2".to_vec()).await.unwrap();
    client
        .put("elsewhere/x", b"not watched".to_vec())
        .await
        .unwrap();
    client.delete("blocklist/a").await.unwrap();
    // From r1: history first, then live changes.
    let mut watch = client.watch_prefix("blocklist/", r1);
    client.put("blocklist/b", b"3".to_vec()).await.unwrap();
    let events = collect(&mut watch, 4).await;
    let revisions: Vec<i64> = events.iter().map(WatchEvent::mod_revision).collect();
    assert!(revisions.windows(2).all(|w| w[0] < w[1]), "{revisions:?}");
    match &events[..] {
        [
            WatchEvent::Put {
                entry: a1,
                prev: None,
            },
            WatchEvent::Put {
                entry: a2,
                prev: Some(p2),
            },
            WatchEvent::Delete {
                key,
                prev: Some(p3),
                ..
            },
            WatchEvent::Put { entry: b, .. },
        ] => {
            assert_eq!(
                (a1.key.as_str(), a1.value.as_slice()),
                ("blocklist/a", &b"1"[..])
            );
            assert_eq!(a2.value, b"2");
            assert_eq!(p2.value, b"1");
            assert_eq!(key, "blocklist/a");
            assert_eq!(p3.value, b"2");
            assert_eq!(b.key, "blocklist/b");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(watch.status().revision, revisions[3]);
}

/// An idle watch keeps hearing from etcd through progress notifications: its age drops back
/// while no key changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_notifications_keep_an_idle_watch_fresh() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let watch = client.watch_prefix("idle/", 0);
    // Heard at creation; then, with no event at all, heard again and again.
    let mut refreshes = 0;
    let mut last = None;
    let deadline = std::time::Instant::now() + WAIT;
    while refreshes < 5 {
        assert!(std::time::Instant::now() < deadline, "{:?}", watch.status());
        let status = watch.status();
        if let (Some(prev), Some(now)) = (last, status.since_last_heard)
            && now < prev
        {
            refreshes += 1;
        }
        last = status.since_last_heard;
        tokio::time::sleep(crate::harness::POLL).await;
    }
    let status = watch.status();
    assert!(status.connected);
    assert_eq!(status.revision, 0, "no event was delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_a_compacted_revision_reports_compacted() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let first = client.put("blocklist/a", b"1".to_vec()).await.unwrap();
    let last = client.put("blocklist/a", b"2".to_vec()).await.unwrap();
    client.compact(last).await.unwrap();
    // Compacting again, or to an older revision, is not an error: the history is gone
    // (a compaction retried after a lost answer asks exactly this).
    client.compact(last).await.unwrap();
    client.compact(first).await.unwrap();
    let mut watch = client.watch_prefix("blocklist/", first);
    assert_eq!(
        next(&mut watch).await,
        WatchMessage::Compacted {
            requested: first,
            compact_revision: last
        }
    );
    assert!(watch.next().await.is_none(), "the stream ends");
}

/// A handler that mirrors the prefix in a map, for comparison with etcd.
#[derive(Clone, Default)]
pub struct Mirror {
    state: Arc<Mutex<MirrorState>>,
}

#[derive(Default, Debug)]
pub struct MirrorState {
    map: BTreeMap<String, Vec<u8>>,
    revision: i64,
    resets: Vec<SyncReason>,
    applied: Vec<i64>,
}

impl WatchHandler for Mirror {
    fn reset(&mut self, snapshot: Snapshot) {
        let mut s = self.state.lock().unwrap();
        s.map = snapshot
            .entries
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect();
        s.revision = snapshot.revision;
        s.resets.push(snapshot.reason);
    }

    fn apply(&mut self, events: Vec<WatchEvent>, revision: i64) {
        let mut s = self.state.lock().unwrap();
        for e in events {
            assert!(
                e.mod_revision() > s.revision,
                "no event at or below the state"
            );
            s.applied.push(e.mod_revision());
            match e {
                WatchEvent::Put { entry, .. } => {
                    s.map.insert(entry.key, entry.value);
                }
                WatchEvent::Delete { key, .. } => {
                    s.map.remove(&key);
                }
            }
        }
        s.revision = revision;
    }
}

impl Mirror {
    pub fn map(&self) -> BTreeMap<String, Vec<u8>> {
        self.state.lock().unwrap().map.clone()
    }
    pub fn resets(&self) -> Vec<SyncReason> {
        self.state.lock().unwrap().resets.clone()
    }
}

/// Waits until the mirror equals etcd's prefix.
pub async fn converged(client: &EtcdClient, mirror: &Mirror, prefix: &str) {
    let end = std::time::Instant::now() + WAIT;
    loop {
        let listing = client.list(prefix).await.unwrap();
        let truth: BTreeMap<String, Vec<u8>> = listing
            .entries
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect();
        let mine = mirror.map();
        if truth == mine {
            return;
        }
        assert!(
            std::time::Instant::now() < end,
            "mirror never matched etcd: etcd {} keys, mirror {} keys",
            truth.len(),
            mine.len()
        );
        tokio::time::sleep(crate::harness::POLL).await;
    }
}

fn addr(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// A watch cut off from etcd while the history it would resume from is compacted recovers by
/// reading everything again; afterwards the handler's state equals etcd's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_falls_behind_a_compaction_resyncs_to_etcds_state() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let direct = etcd.client("/probity/").await;
    let proxy = Proxy::start(addr(&etcd.endpoints()[0])).await;
    let mut config = etcd.config().with_prefix("/probity/");
    config.endpoints = vec![proxy.url()];
    let watcher = EtcdClient::connect(config).await.unwrap();

    for i in 0..50 {
        direct
            .put(&format!("blocklist/n{i:02}"), b"before".to_vec())
            .await
            .unwrap();
    }
    let mirror = Mirror::default();
    let watch = watcher
        .watch_with_resync("blocklist/", mirror.clone())
        .unwrap();
    converged(&direct, &mirror, "blocklist/").await;
    assert_eq!(mirror.resets(), [SyncReason::Initial]);

    proxy.cut();
    eventually(WAIT, "the watch notices the cut", || {
        let connected = watch.status().connected;
        async move { (!connected).then_some(()) }
    })
    .await;
    // Changes it misses, then the history of them compacted away.
    for i in 0..25 {
        direct.delete(&format!("blocklist/n{i:02}")).await.unwrap();
    }
    let mut last = 0;
    for i in 50..80 {
        last = direct
            .put(&format!("blocklist/n{i:02}"), b"during".to_vec())
            .await
            .unwrap();
    }
    direct.compact(last).await.unwrap();
    proxy.restore();

    converged(&direct, &mirror, "blocklist/").await;
    let resets = mirror.resets();
    assert_eq!(resets.len(), 2, "{resets:?}");
    assert!(
        matches!(resets[1], SyncReason::Compacted { compact_revision, .. } if compact_revision == last),
        "{resets:?}"
    );
    assert_eq!(watch.status().resyncs, 1);
    // And it follows live changes again.
    direct.put("blocklist/after", b"x".to_vec()).await.unwrap();
    converged(&direct, &mirror, "blocklist/").await;
}

/// Disconnected longer than the resync threshold, the watch reads everything again instead
/// of resuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_disconnection_resyncs() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let direct = etcd.client("/probity/").await;
    let proxy = Proxy::start(addr(&etcd.endpoints()[0])).await;
    let mut config = etcd.config().with_prefix("/probity/");
    config.endpoints = vec![proxy.url()];
    let watcher = EtcdClient::connect(config).await.unwrap();
    direct.put("policy/digest", b"v1".to_vec()).await.unwrap();
    let mirror = Mirror::default();
    let watch = watcher
        .watch_with_resync_options(
            "policy/",
            mirror.clone(),
            ResyncOptions::default().with_resync_after_disconnect(Duration::from_millis(500)),
        )
        .unwrap();
    converged(&direct, &mirror, "policy/").await;
    proxy.cut();
    direct.put("policy/digest", b"v2".to_vec()).await.unwrap();
    eventually(WAIT, "disconnected past the threshold", || {
        let status = watch.status();
        async move {
            (!status.connected && status.since_last_heard? > Duration::from_millis(800))
                .then_some(())
        }
    })
    .await;
    proxy.restore();
    converged(&direct, &mirror, "policy/").await;
    eventually(WAIT, "the resync is reported", || {
        let resets = mirror.resets();
        async move { (resets.len() == 2).then_some(resets) }
    })
    .await;
    assert!(matches!(
        mirror.resets()[1],
        SyncReason::Disconnected { .. }
    ));
}

/// A raw watch cut off and reconnected several times while 200 keys are written delivers
/// each write once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_watch_neither_loses_nor_repeats_an_event() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let direct = etcd.client("/probity/").await;
    let proxy = Proxy::start(addr(&etcd.endpoints()[0])).await;
    let mut config = etcd.config().with_prefix("/probity/");
    config.endpoints = vec![proxy.url()];
    let watcher = EtcdClient::connect(config).await.unwrap();
    let (_, start) = direct.get("seq/").await.unwrap();
    let mut watch = watcher.watch_prefix("seq/", start + 1);

    let writer = tokio::spawn(async move {
        for i in 0..200 {
            direct
                .put(&format!("seq/{i:04}"), i.to_string().into_bytes())
                .await
                .unwrap();
            if i % 50 == 25 {
                proxy.cut();
            }
            if i % 50 == 40 {
                proxy.restore();
            }
        }
        proxy
    });
    let events = collect(&mut watch, 200).await;
    let _proxy = writer.await.unwrap();
    let status = watch.status();
    assert!(
        status.last_error.is_some(),
        "the cut broke the stream at least once: {status:?}"
    );
    let keys: Vec<String> = events.iter().map(|e| e.key().to_owned()).collect();
    let expected: Vec<String> = (0..200).map(|i| format!("seq/{i:04}")).collect();
    assert_eq!(keys, expected);
    // Nothing more is pending: no duplicate arrives late.
    let extra = tokio::time::timeout(Duration::from_millis(500), watch.next()).await;
    assert!(extra.is_err(), "unexpected {extra:?}");
}
