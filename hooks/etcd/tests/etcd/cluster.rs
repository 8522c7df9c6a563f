//! Three members: losing a follower costs nothing; losing the leader costs writes until the
//! election, but neither the watched state nor an event.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use probity_etcd::{EtcdClient, EtcdError, Swap, WatchEvent, WatchMessage};
use rustix::process::Signal;

use crate::harness::{Etcd, eventually};
use crate::watch::{Mirror, converged};

const WAIT: Duration = Duration::from_secs(30);

/// A client whose endpoints start with member `first`, so it talks to that one first.
async fn client_starting_at(etcd: &Etcd, first: usize) -> EtcdClient {
    let mut endpoints = etcd.endpoints();
    endpoints.rotate_left(first);
    let mut config = etcd.config().with_prefix("/probity/");
    config.endpoints = endpoints;
    EtcdClient::connect(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_follower_costs_reads_and_writes_no_error() {
    let mut etcd = Etcd::cluster();
    let leader = etcd.wait_healthy(None).await;
    let follower = (leader + 1) % 3;
    let client = client_starting_at(&etcd, follower).await;
    let mirror = Mirror::default();
    let _watch = client.watch_with_resync("nodes/", mirror.clone()).unwrap();
    for i in 0..20 {
        client
            .put(&format!("nodes/n{i:03}"), b"up".to_vec())
            .await
            .unwrap();
    }
    // The client has been talking to the follower; it dies mid-stream.
    let status = client.status().await.unwrap();
    assert_eq!(status.endpoint, etcd.endpoints()[follower]);
    etcd.stop(follower, Signal::KILL);

    for i in 20..120 {
        let key = format!("nodes/n{i:03}");
        client.put(&key, b"up".to_vec()).await.unwrap();
        let (entry, _) = client.get(&key).await.unwrap();
        assert_eq!(entry.unwrap().value, b"up");
    }
    assert_eq!(client.list("nodes/").await.unwrap().entries.len(), 120);
    converged(&client, &mirror, "nodes/").await;
    assert!(client.health().connected);
    assert_ne!(
        client.status().await.unwrap().endpoint,
        etcd.endpoints()[follower]
    );

    // Restarted by PID with its data, it rejoins and catches up.
    etcd.start(follower);
    etcd.wait_healthy(None).await;
    let alone = etcd.member_client(follower, None).await;
    let rejoined = alone.list("nodes/").await.unwrap();
    assert_eq!(rejoined.entries.len(), 120);
}

/// 200 writes, the leader killed after the 60th (once the watch holds all 61, the writer
/// waiting): the caller's watched state stays readable,
/// writes fail with a clear error or are retried, resume after the election, and the watch
/// delivers all 200 in order, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_leader_keeps_the_watched_state_and_loses_no_event() {
    let mut etcd = Etcd::cluster();
    let leader = etcd.wait_healthy(None).await;
    // Writer and watchers talk to the leader first: its death hits all of them.
    let client = client_starting_at(&etcd, leader).await;
    let writer_client = client_starting_at(&etcd, leader).await;
    let (_, start) = client.get("seq/").await.unwrap();
    let mut raw = client.watch_prefix("seq/", start + 1);
    let mirror = Mirror::default();
    let watch = client.watch_with_resync("seq/", mirror.clone()).unwrap();

    let (reached, mut at_60) = tokio::sync::mpsc::channel::<()>(1);
    // The writer waits at the 60th write until the leader is killed, so the kill always
    // falls mid-stream however slowly the watch catches up on a loaded machine.
    let (resume, resumed) = tokio::sync::oneshot::channel::<()>();
    let writer = tokio::spawn(async move {
        let mut resumed = Some(resumed);
        let mut errors: Vec<EtcdError> = Vec::new();
        let mut end = Instant::now() + WAIT;
        for i in 0..200_u32 {
            let key = format!("seq/{i:04}");
            let value = i.to_string().into_bytes();
            loop {
                assert!(
                    Instant::now() < end,
                    "write {i} never succeeded: {errors:?}"
                );
                match writer_client.create(&key, value.clone()).await {
                    Ok(Swap::Applied { .. }) => break,
                    // An earlier attempt whose answer was lost did apply it.
                    Ok(Swap::Refused { current: Some(e) }) if e.value == value => break,
                    Ok(other) => panic!("{key}: {other:?}"),
                    Err(e) => {
                        assert!(e.is_unavailable(), "{e}");
                        errors.push(e);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            if i == 60 {
                reached.send(()).await.unwrap();
                if let Some(resumed) = resumed.take() {
                    resumed.await.unwrap();
                    end = Instant::now() + WAIT;
                }
            }
        }
        errors
    });

    at_60.recv().await.unwrap();
    // The watch delivers the 61 acknowledged writes (it lagged by dozens under load).
    let caught_up = Instant::now() + WAIT;
    while mirror.map().len() < 61 {
        assert!(
            Instant::now() < caught_up,
            "the watch applied {} of 61 acknowledged writes",
            mirror.map().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    etcd.stop(leader, Signal::KILL);
    resume.send(()).unwrap();
    // The state applied so far stays readable while the cluster elects.
    let state = mirror.map();
    assert_eq!(state.len(), 61, "keys applied before the kill");
    assert!(state.contains_key("seq/0000"));

    let errors = writer.await.unwrap();
    for e in &errors {
        let text = e.to_string();
        assert!(text.contains("seq/"), "{text}");
        assert!(text.contains("127.0.0.1:"), "names an endpoint: {text}");
    }

    // The raw watch: 200 puts, in order, each once.
    let mut keys = Vec::new();
    let mut revisions = Vec::new();
    while keys.len() < 200 {
        let message = tokio::time::timeout(WAIT, raw.next())
            .await
            .expect("watch delivers")
            .expect("watch open");
        let WatchMessage::Events { events, .. } = message else {
            panic!("{message:?}")
        };
        for e in events {
            revisions.push(e.mod_revision());
            match e {
                WatchEvent::Put { entry, .. } => keys.push(entry.key),
                other => panic!("{other:?}"),
            }
        }
    }
    let expected: Vec<String> = (0..200).map(|i| format!("seq/{i:04}")).collect();
    assert_eq!(keys, expected);
    assert!(revisions.windows(2).all(|w| w[0] < w[1]));
    let unique: BTreeSet<&String> = keys.iter().collect();
    assert_eq!(unique.len(), 200);

    converged(&client, &mirror, "seq/").await;
    assert_eq!(mirror.resets().len(), 1, "resumed, not resynced");
    let new_leader = eventually(WAIT, "a new leader", || async {
        let s = client.status().await.ok()?;
        (s.leader != 0).then_some(s.leader)
    })
    .await;
    assert_ne!(new_leader, 0);
    assert!(watch.status().connected);
    eprintln!(
        "leader loss: {} write attempts failed and were retried",
        errors.len()
    );
}
