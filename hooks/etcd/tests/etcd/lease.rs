//! Leases: keys that vanish with the agent that keeps them alive.

use std::time::Duration;

use probity_etcd::{EtcdError, LeaseId};

use crate::harness::{Etcd, eventually};

/// A lease of 2 s kept alive outlives several TTLs; once the keep-alive stops, etcd deletes
/// its key by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_lease_outlives_its_ttl_and_its_key_goes_when_renewal_stops() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let lease = client.grant_lease(Duration::from_secs(2)).await.unwrap();
    assert_eq!(lease.ttl, Duration::from_secs(2));
    client
        .put_with_lease("facts/node-1", b"{}".to_vec(), lease.id)
        .await
        .unwrap();
    let (entry, _) = client.get("facts/node-1").await.unwrap();
    assert_eq!(entry.unwrap().lease, Some(lease.id));

    let mut keep = client.keep_alive(lease);
    // Renewals every ~0.67 s: ten of them span more than three TTLs.
    let state = keep.wait_for(|s| s.renewals >= 10 || s.expired).await;
    assert!(!state.expired);
    assert!(client.get("facts/node-1").await.unwrap().0.is_some());
    assert!(client.lease_time_to_live(lease.id).await.unwrap().is_some());

    drop(keep);
    eventually(
        Duration::from_secs(10),
        "the leased key expires",
        || async {
            client
                .get("facts/node-1")
                .await
                .unwrap()
                .0
                .is_none()
                .then_some(())
        },
    )
    .await;
    assert_eq!(client.lease_time_to_live(lease.id).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_deletes_the_keys_at_once_and_the_keep_alive_reports_expiry() {
    let etcd = Etcd::single();
    etcd.wait_healthy(None).await;
    let client = etcd.client("/probity/").await;
    let lease = client.grant_lease(Duration::from_secs(30)).await.unwrap();
    let items = [("facts/node-2/gpu0", b"a"), ("facts/node-2/gpu1", b"b")];
    client.put_batch(&items, Some(lease.id)).await.unwrap();
    let mut keep = client.keep_alive(lease);
    keep.wait_for(|s| s.renewals >= 1).await;
    assert!(client.revoke_lease(lease.id).await.unwrap());
    assert!(
        client
            .list("facts/node-2/")
            .await
            .unwrap()
            .entries
            .is_empty()
    );
    tokio::time::timeout(Duration::from_secs(30), keep.expired())
        .await
        .expect("keep-alive sees the lease gone");
    assert!(keep.state().expired);
    assert!(!client.revoke_lease(lease.id).await.unwrap());
    // Writing under a lease that is gone is refused by name.
    let err = client
        .put_with_lease("facts/node-2/gpu0", b"x".to_vec(), lease.id)
        .await
        .unwrap_err();
    assert!(
        matches!(err, EtcdError::LeaseNotFound { id } if LeaseId(id) == lease.id),
        "{err:?}"
    );
}
