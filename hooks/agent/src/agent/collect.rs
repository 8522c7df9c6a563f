use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use probity::EntityUid;
use probity::state::NodeFacts;
use probity_collect::sockets::ListeningSocket;
use probity_firewall::source::Reading as FwReading;
use probity_firewall::{Inputs, Reachability};
use serde_json::Value;

use super::Agent;
use crate::config::Config;
use crate::facts::{self, GpuFact, NodeNumbers, PowerFact};
use crate::listen::{self, ListenSubject, PortSets};
use crate::sources::{SourceState, SourceStatus};

/// The power readings of the window, oldest first, with their times (probity-collect's
/// `PowerWindow` computes the mean; this keeps the readings the plugins are given).
#[derive(Debug)]
pub(super) struct PowerHistory {
    window: probity_collect::source::PowerWindow,
    readings: VecDeque<(SystemTime, f64)>,
    capacity: usize,
    max_age: Duration,
}

impl PowerHistory {
    pub(super) fn new(config: &Config) -> Self {
        let interval = config.collect.interval.as_secs().max(1);
        let n = config.collect.power_window.as_secs() / interval + 2;
        let capacity = usize::try_from(n).unwrap_or(4096).clamp(2, 4096);
        Self {
            window: probity_collect::source::PowerWindow::new(
                capacity,
                config.collect.power_window,
            ),
            readings: VecDeque::with_capacity(capacity),
            capacity,
            max_age: config.collect.power_window,
        }
    }

    fn push(&mut self, at: SystemTime, watts: f64) -> Result<(), String> {
        self.window.push(at, watts).map_err(|e| e.to_string())?;
        if self.readings.len() == self.capacity {
            self.readings.pop_front();
        }
        self.readings.push_back((at, watts));
        Ok(())
    }

    fn mean(&self, now: SystemTime) -> Option<f64> {
        self.window.baseline(now).watts()
    }

    fn readings(&self, now: SystemTime) -> Vec<i64> {
        self.readings
            .iter()
            .filter(|(at, _)| now.duration_since(*at).is_ok_and(|age| age <= self.max_age))
            .map(|(_, w)| facts::long(*w))
            .collect()
    }
}

/// What the facts step of a cycle read: the node's facts before they become entities.
pub(super) struct Readings {
    pub(super) unreadable: BTreeMap<String, String>,
    pub(super) statuses: BTreeMap<String, SourceStatus>,
    pub(super) gpus: Vec<GpuFact>,
    pub(super) power: PowerFact,
    pub(super) driver_version: String,
    pub(super) gpu_model: Option<String>,
    pub(super) gpu_count: i64,
    pub(super) gpu_memory_mib: i64,
    pub(super) hottest: i64,
    pub(super) cpu_count: i64,
}

impl Agent {
    fn firewall_state<T>(state: &mut SourceState<Option<T>>, r: FwReading<T>, now: SystemTime) {
        use probity_collect::{Collected, Reading};
        let collected = match r {
            FwReading::Read(v) => Collected::Ok(Reading::new(Some(v), now)),
            // Not installed: no rules of this kind, which is a reading.
            FwReading::Unavailable { .. } => Collected::Ok(Reading::new(None, now)),
            FwReading::Failed(e) => {
                state.record_failure(crate::sources::error_chain(&e), now);
                return;
            }
        };
        if state.enabled() {
            state.record(Some(collected), now);
        }
    }

    /// Step 1 of a cycle: reads every source into its state.
    pub(super) fn collect(&mut self, now: SystemTime) {
        self.smi.record(self.sources.gpus(), now);
        self.dcgm.record(self.sources.dcgm(), now);
        let rapl = self.sources.rapl();
        self.rapl.record(rapl, now);
        self.bmc.record(self.sources.bmc_power(), now);
        self.sockets.record(Some(self.sources.sockets()), now);
        self.cpu.record_result(self.sources.cpu_count(), now);
        let snapshot = self.sources.firewall();
        Self::firewall_state(&mut self.nft, snapshot.nft, now);
        Self::firewall_state(&mut self.iptables, snapshot.iptables, now);
        Self::firewall_state(&mut self.ip6tables, snapshot.ip6tables, now);
    }

    /// Step 2 of a cycle: the sources' states and readings as the node's facts, with
    /// what could not be read.
    pub(super) fn read_facts(&mut self, now: SystemTime, stale: Duration) -> Readings {
        let mut unreadable: BTreeMap<String, String> = BTreeMap::new();
        let mut statuses: BTreeMap<String, SourceStatus> = BTreeMap::new();
        {
            let mut note = |name: &'static str, status: SourceStatus| {
                if let Some(why) = &status.why_unreadable {
                    unreadable.insert(name.to_owned(), why.clone());
                }
                statuses.insert(name.to_owned(), status);
            };
            note(self.smi.name(), self.smi.status(now, stale));
            note(self.dcgm.name(), self.dcgm.status(now, stale));
            note(self.rapl.name(), self.rapl.status(now, stale));
            note(self.bmc.name(), self.bmc.status(now, stale));
            note(self.sockets.name(), self.sockets.status(now, stale));
            note(self.cpu.name(), self.cpu.status(now, stale));
            note(self.nft.name(), self.nft.status(now, stale));
            note(self.iptables.name(), self.iptables.status(now, stale));
            note(self.ip6tables.name(), self.ip6tables.status(now, stale));
            note(self.audit_state.name(), self.audit_state.status(now, stale));
        }
        let smi_gpus = self
            .smi
            .value()
            .map(|rows| facts::gpus_from_smi(&self.config, rows));
        let dcgm_gpus = self
            .dcgm
            .value()
            .map(|r| facts::gpus_from_dcgm(&self.config, r));
        let temperatures: Vec<f64> = smi_gpus
            .iter()
            .chain(dcgm_gpus.iter())
            .flatten()
            .filter_map(|g| g.temperature_c)
            .collect();
        let gpus: Vec<GpuFact> = smi_gpus.clone().or(dcgm_gpus.clone()).unwrap_or_default();
        for (source, why) in facts::gaps(&gpus) {
            unreadable.entry(source.to_owned()).or_insert(why);
        }
        if self.config.inventory.gpu_node && !self.smi.enabled() && !self.dcgm.enabled() {
            unreadable.insert(
                "gpu".into(),
                "inventory.gpu_node is set, but nvidia-smi and dcgm are both off".into(),
            );
        }
        let (driver_version, gpu_model, gpu_count, gpu_memory_mib, hottest) =
            facts::gpu_numbers(&gpus, &temperatures);

        // The GPUs stand for the node from nvidia-smi when it has a reading, else DCGM.
        let gpus_fresh = if smi_gpus.is_some() {
            self.smi.is_fresh()
        } else {
            self.dcgm.is_fresh()
        };
        let power = self.node_power(&gpus, gpus_fresh, now);
        if power.draw_w.is_none() {
            unreadable.insert(
                "power".into(),
                "no BMC reading and no RAPL reading: the node's draw is unknown".into(),
            );
        }
        let cpu_count = self
            .config
            .inventory
            .cpu_count
            .or_else(|| self.cpu.value().copied())
            .map_or(0, i64::from);
        Readings {
            unreadable,
            statuses,
            gpus,
            power,
            driver_version,
            gpu_model,
            gpu_count,
            gpu_memory_mib,
            hottest,
            cpu_count,
        }
    }

    /// Step 2 of a cycle, continued: the `listen` questions, with a note in
    /// `unreadable` when some were left out.
    pub(super) fn listen_subjects(
        &mut self,
        reach: Option<&Reachability>,
        unreadable: &mut BTreeMap<String, String>,
    ) -> Vec<ListenSubject> {
        let sets = self.port_sets();
        let sockets: &[ListeningSocket] = self.sockets.value().map_or(&[], Vec::as_slice);
        let (subjects, truncated) = listen::subjects(
            sockets,
            reach,
            &sets,
            self.config.collect.max_listen_decisions,
        );
        if truncated {
            unreadable.insert(
                "listen".into(),
                format!(
                    "more than {} ports to decide: the rest were not",
                    self.config.collect.max_listen_decisions
                ),
            );
        }
        subjects
    }

    /// Step 2 of a cycle, ended: the node's and its GPUs' entities upserted into the
    /// engine (and published to the state store), GPUs no longer reported removed. The
    /// node's entity and every entity upserted.
    pub(super) fn report_facts(
        &mut self,
        readings: &Readings,
        at: u64,
        stale: Duration,
        errors: &mut Vec<String>,
    ) -> (Value, Vec<Value>) {
        let Readings {
            unreadable,
            gpus,
            power,
            ..
        } = readings;
        let numbers = NodeNumbers {
            driver_version: readings.driver_version.clone(),
            gpu_model: readings.gpu_model.clone(),
            gpu_count: readings.gpu_count,
            cpu_count: readings.cpu_count,
            gpu_memory_mib: readings.gpu_memory_mib,
            hottest_gpu_temp_c: readings.hottest,
            power_draw_w: power.draw_w.map_or(0, facts::long),
            power_window_mean_w: power.window_mean_w.map_or(0, facts::long),
            unreadable: unreadable.keys().cloned().collect(),
        };
        let node_entity = facts::node_entity(&self.config, &numbers);
        let mut entities = vec![node_entity.clone()];
        let mut ids = BTreeSet::new();
        for g in gpus {
            if let Some(e) = facts::gpu_entity(&self.config.node, g) {
                ids.insert(g.id.clone());
                entities.push(e);
            }
        }
        let facts_json = Value::Array(entities.clone());
        match self.engine.upsert_entities(&facts_json) {
            Ok(_) => {
                if let Some(state) = self.engine.state() {
                    let published = state.publish_facts(&NodeFacts {
                        node: self.config.node.clone(),
                        entities: facts_json.clone(),
                        collected_at: at,
                        ttl_seconds: stale.as_secs(),
                    });
                    if let Err(e) = published {
                        errors.push(format!("publishing the facts: {e}"));
                    }
                }
            }
            Err(e) => {
                errors.push(format!(
                    "the engine rejected the node's facts (its entity is removed, so decisions about it fail closed): {e}"
                ));
                ids.clear();
                if let Some(uid) = self.node_uid()
                    && let Err(e) = self.engine.remove_entities(&[uid])
                {
                    errors.push(format!("removing the node's entity: {e}"));
                }
            }
        }
        let gone: Vec<EntityUid> = self
            .gpu_ids
            .difference(&ids)
            .filter_map(|id| EntityUid::new("Gpu", id).ok())
            .collect();
        if !gone.is_empty()
            && let Err(e) = self.engine.remove_entities(&gone)
        {
            errors.push(format!("removing GPUs no longer reported: {e}"));
        }
        self.gpu_ids = ids;
        (node_entity, entities)
    }

    /// The node's power this cycle (see [`crate::facts`]), pushed into the window when
    /// it was read now (`gpus_fresh`: the GPUs' source answered this cycle).
    fn node_power(&mut self, gpus: &[GpuFact], gpus_fresh: bool, now: SystemTime) -> PowerFact {
        let dcmi = self.bmc.value().and_then(|p| p.instantaneous_w.value());
        let (draw, from, fresh) = if let Some(w) = dcmi {
            (Some(w), "bmc-dcmi", self.bmc.is_fresh())
        } else if let Some(cpu) = self.rapl.value().and_then(|r| r.total_watts.value()) {
            let gpu: f64 = gpus.iter().filter_map(|g| g.power_w).sum();
            let gpus_ok = gpus.is_empty() || gpus_fresh;
            (
                Some(cpu + gpu),
                "rapl+gpus",
                self.rapl.is_fresh() && gpus_ok,
            )
        } else {
            (None, "none", false)
        };
        if fresh && let Some(w) = draw {
            // A refused reading (out of order after a clock step) leaves the window as is.
            let _ = self.power.push(now, w);
        }
        PowerFact {
            draw_w: draw,
            from,
            fresh,
            window_mean_w: self.power.mean(now),
            readings_w: self.power.readings(now),
        }
    }

    /// The reduction of the last good rulesets, computed again only when they changed.
    pub(super) fn reachability(&mut self) -> Option<Arc<Reachability>> {
        if self.nft.value().is_none()
            && self.iptables.value().is_none()
            && self.ip6tables.value().is_none()
        {
            // Nothing was ever read: the firewall is unknown ("nft" is unreadable); the
            // listening sockets are still decided.
            return None;
        }
        let nft = self.nft.value().cloned().flatten();
        let v4 = self.iptables.value().cloned().flatten();
        let v6 = self.ip6tables.value().cloned().flatten();
        if let Some((a, b, c, r)) = &self.reduced
            && *a == nft
            && *b == v4
            && *c == v6
        {
            return Some(Arc::clone(r));
        }
        let reach = Arc::new(probity_firewall::reduce(&Inputs {
            nft: nft.as_ref(),
            iptables: [v4.as_ref(), v6.as_ref()].into_iter().flatten().collect(),
        }));
        self.reduced = Some((nft, v4, v6, Arc::clone(&reach)));
        Some(reach)
    }

    fn port_sets(&mut self) -> PortSets {
        let digest = self.engine.status().digest;
        match &self.port_sets {
            Some((d, s)) if *d == digest => s.clone(),
            _ => {
                let s = PortSets::from_engine(&self.engine);
                self.port_sets = Some((digest, s.clone()));
                s
            }
        }
    }
}
