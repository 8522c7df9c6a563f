//! The zone label the mutating webhook's affinity names, kept equal to each node's zone
//! in Probity's store.

use probity_base::error::chain as error_chain;

use super::{ActionRecord, Controller, ControllerError, StateStore, unix_now};

impl Controller {
    /// Keeps the zone label of every node equal to its group in Probity's store, so the
    /// mutating webhook's affinity matches the nodes it means (a node without the label
    /// matches no term). Owns that label alone; a node the store has no group for keeps
    /// whatever it has. Runs every `label_interval`, or when a node lacks the label; not
    /// while paused (the caller's modes, as the pass read them).
    pub(super) async fn sync_zone_labels(&self, dry_run: bool) -> Result<(), ControllerError> {
        let label = &self.options.zone_label;
        let nodes = self.nodes.state();
        let unlabelled = nodes.iter().any(|n| {
            n.metadata
                .labels
                .as_ref()
                .is_none_or(|l| !l.contains_key(label))
        });
        let due = {
            let at = self.labelled_at.lock().unwrap_or_else(|p| p.into_inner());
            at.is_none_or(|at| at.elapsed() >= self.options.label_interval)
        };
        if !(due || unlabelled) {
            return Ok(());
        }
        let groups = self
            .probity
            .node_groups(&self.options.zone_attribute)
            .await?;
        *self.labelled_at.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now());
        let actuator = &self.actuator;
        let now = unix_now();
        let mut records = Vec::new();
        for node in &nodes {
            let Some(name) = node.metadata.name.as_deref() else {
                continue;
            };
            let Some(zone) = groups.get(name) else {
                continue;
            };
            let current = node.metadata.labels.as_ref().and_then(|l| l.get(label));
            if current == Some(zone) {
                continue;
            }
            let note = |outcome: &str, detail: String| ActionRecord {
                at: now,
                node: name.to_owned(),
                action: "label".into(),
                outcome: outcome.into(),
                detail,
            };
            let record = if dry_run {
                note("would", format!("{label}={zone}"))
            } else {
                match actuator.set_label(name, label, zone).await {
                    Ok(outcome) => note(outcome.as_str(), format!("{label}={zone}")),
                    Err(error) => note("failed", error_chain(&error)),
                }
            };
            self.metrics.action(&record.action, &record.outcome);
            records.push(record);
        }
        if !records.is_empty() {
            // A label that cannot be set is reported once, not on every pass.
            self.shared
                .update(|s| {
                    let fresh: Vec<ActionRecord> = records
                        .iter()
                        .filter(|r| {
                            !matches!(r.outcome.as_str(), "failed" | "would")
                                || !s.report.iter().any(|k| {
                                    k.node == r.node
                                        && k.outcome == r.outcome
                                        && k.detail == r.detail
                                })
                        })
                        .cloned()
                        .collect();
                    s.record(fresh);
                })
                .await?;
        }
        Ok(())
    }
}
