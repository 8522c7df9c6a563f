use std::sync::Arc;

use probity::BlockRecord;

use super::records::{BLOCKLIST, DIGESTS};
use super::{Core, HOUSEKEEPING, lock};
use crate::{EtcdError, KeepAlive, Lease, LeaseId};

/// Writes queued blocks to etcd until each lands.
pub(super) async fn send_outbox(core: Arc<Core>) {
    loop {
        let pending: Vec<(String, BlockRecord)> = lock(&core.outbox)
            .iter()
            .filter(|(_, q)| q.landed.is_none())
            .map(|(n, q)| (n.clone(), q.record.clone()))
            .collect();
        for (node, record) in pending {
            // Merged into what etcd holds: the queued record is this process's view, and
            // another process may have blocked the node meanwhile.
            let key = format!("{BLOCKLIST}{node}");
            match super::shared::merge_block(&core.client, &key, &record).await {
                Ok(None) => {
                    tracing::warn!(%node, "queued block lost every compare-and-swap race; retrying");
                }
                Ok(Some(revision)) => {
                    tracing::info!(%node, revision, "queued block reached etcd");
                    if let Some(q) = lock(&core.outbox).get_mut(&node)
                        && q.record == record
                    {
                        q.landed = Some(revision);
                    }
                    let local = Arc::clone(&core.local);
                    let done = node.clone();
                    let _ = tokio::task::spawn_blocking(move || local.unblock_node(&done)).await;
                }
                Err(e) => {
                    tracing::warn!(%node, error = %e, "queued block has not reached etcd yet; retrying");
                }
            }
        }
        core.prune_outbox();
        tokio::select! {
            () = core.outbox_wake.notified() => {}
            () = tokio::time::sleep(core.options.outbox_retry) => {}
        }
    }
}

/// Revokes the facts leases of publishers that stopped publishing, and grants the process
/// lease again if it expired.
pub(super) async fn look_after_leases(core: Arc<Core>) {
    loop {
        tokio::time::sleep(HOUSEKEEPING).await;
        let silent: Vec<(String, LeaseId)> = {
            let mut facts = lock(&core.facts);
            let silent: Vec<(String, LeaseId)> = facts
                .iter()
                .filter(|(_, f)| f.last_publish.elapsed() > f.lease.ttl)
                .map(|(n, f)| (n.clone(), f.lease.id))
                .collect();
            for (node, _) in &silent {
                facts.remove(node);
            }
            silent
        };
        for (node, lease) in silent {
            tracing::warn!(%node, "no facts published within their TTL; revoking them");
            if let Err(e) = core.client.revoke_lease(lease).await {
                tracing::warn!(%node, error = %e, "revoking stale facts failed; they expire with their lease");
            }
        }
        let regrant = {
            let digest = lock(&core.digest);
            let expired = digest
                .lease
                .as_ref()
                .is_some_and(|(_, keep)| keep.state().expired);
            expired.then(|| digest.last.clone()).flatten()
        };
        if let Some(last) = regrant {
            tracing::warn!(process = %last.process, "the process lease expired; reporting the served digest again");
            if let Ok(bytes) = serde_json::to_vec(&last) {
                match put_digest(&core, &last.process, bytes).await {
                    Ok(lease) => lock(&core.digest).lease = Some(lease),
                    Err(e) => tracing::warn!(error = %e, "reporting the served digest failed"),
                }
            }
        }
    }
}

/// Puts `digests/<process>` under a new process lease, kept alive from now on.
pub(super) async fn put_digest(
    core: &Core,
    process: &str,
    bytes: Vec<u8>,
) -> Result<(Lease, KeepAlive), EtcdError> {
    let key = format!("{DIGESTS}{process}");
    let lease = core.client.grant_lease(core.options.process_ttl).await?;
    core.client.put_with_lease(&key, bytes, lease.id).await?;
    Ok((lease, core.client.keep_alive(lease)))
}
