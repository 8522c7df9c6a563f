//! thermal-headroom: predicts a zone's power and a node's GPU temperature after a
//! placement and denies a placement that would cross the zone's fan-curve ceiling or
//! the GPU model's temperature target, with a `migrate` obligation naming the zone
//! with the most headroom that can take the work.
//!
//! Applies to `schedule` (principal a Workload, resource a Node). Settings (defaults):
//! `watts_per_gpu` (700): power one GPU of the workload adds; `ceiling_pct` (95): the
//! share of the fan-curve ceiling a zone may reach; `celsius_per_kw` (1): how much the
//! node's hottest GPU warms per kW added to the node.

use probity_plugin_sdk::{
    Description, Entity, Host, Obligation, Plugin, Reason, Request, Severity, Uid, Verdict,
    export_plugin,
};

/// The plugin.
pub struct ThermalHeadroom;

/// The model's parameters, from the plugin's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Model {
    /// Power one GPU adds, in watts.
    pub watts_per_gpu: f64,
    /// Share of the ceiling a zone may reach, in percent.
    pub ceiling_pct: f64,
    /// GPU warming per kW added to a node, in degrees C.
    pub celsius_per_kw: f64,
}

impl Model {
    fn from_request(r: &Request) -> Self {
        Self {
            watts_per_gpu: r.setting_f64("watts_per_gpu", 700.0),
            ceiling_pct: r.setting_f64("ceiling_pct", 95.0),
            celsius_per_kw: r.setting_f64("celsius_per_kw", 1.0),
        }
    }

    /// Watts left under the zone's allowed ceiling after adding `added_w`.
    pub fn zone_headroom_w(&self, zone: &Entity, added_w: f64) -> Option<f64> {
        let draw = zone.long("powerDrawW")? as f64;
        let ceiling = zone.long("powerCeilingW")? as f64;
        Some(ceiling * self.ceiling_pct / 100.0 - draw - added_w)
    }
}

impl Plugin for ThermalHeadroom {
    fn describe() -> Description {
        Description::new("thermal-headroom", env!("CARGO_PKG_VERSION"), ["schedule"])
    }

    fn evaluate(request: &Request, host: &dyn Host) -> Verdict {
        let model = Model::from_request(request);
        let (Some(workload), Some(node)) = (request.principal_entity(), request.resource_entity())
        else {
            return Verdict::Abstain;
        };
        let Some(zone) = node.entity_ref("zone").and_then(|z| request.entity(&z)) else {
            return Verdict::Abstain;
        };
        let gpus = workload.long("gpus").unwrap_or(0).max(0);
        if gpus == 0 {
            return Verdict::Abstain;
        }
        let added_w = gpus as f64 * model.watts_per_gpu;
        let mut reasons = Vec::new();
        let headroom = model.zone_headroom_w(zone, added_w).unwrap_or(f64::MIN);
        if headroom < 0.0 {
            reasons.push(Reason::new(
                "zone-ceiling",
                format!(
                    "placing {gpus} GPUs (+{} W) in {} would exceed {}% of its fan-curve ceiling by {} W",
                    whole(added_w), zone.uid, whole(model.ceiling_pct), whole(-headroom)
                ),
                Severity::High,
            ));
        }
        let target = node
            .entity_ref("gpuModel")
            .and_then(|m| request.entity(&m))
            .and_then(|m| m.long("tempTargetC"));
        if let (Some(temp), Some(target)) = (node.long("hottestGpuTempC"), target) {
            let predicted = temp as f64 + added_w / 1000.0 * model.celsius_per_kw;
            if predicted > target as f64 {
                reasons.push(Reason::new(
                    "gpu-temperature",
                    format!(
                        "{} would run its hottest GPU at {predicted:.1} C, above the {target} C target",
                        node.uid
                    ),
                    Severity::High,
                ));
            }
        }
        if reasons.is_empty() {
            return Verdict::allow();
        }
        let class = workload.string("class");
        let mut migrate = Obligation::new("migrate")
            .param("from_zone", &zone.uid)
            .param("needed_w", whole(added_w));
        if let Some((cooler, room)) = coolest_zone(
            &host.entities_of_type("Zone"),
            &zone.uid,
            class,
            &model,
            added_w,
        ) {
            migrate = migrate
                .target(cooler.to_string())
                .param("headroom_w", whole(room));
        }
        let mut verdict = Verdict::deny(reasons.remove(0)).with_obligation(migrate);
        for r in reasons {
            verdict = verdict.with_reason(r);
        }
        verdict
    }
}

/// A figure as a whole number, for messages. Rounding through an integer rather than
/// `{:.0}`: fixed-precision float formatting is the slow path of `core::fmt`, and this
/// runs on every denied placement.
fn whole(figure: f64) -> i64 {
    figure.round() as i64
}

/// The zone, other than `from`, with the most headroom after taking `added_w`, that is
/// open to the workload's class (a dedicated zone takes only its class).
pub fn coolest_zone(
    zones: &[Entity],
    from: &Uid,
    class: Option<&str>,
    model: &Model,
    added_w: f64,
) -> Option<(Uid, f64)> {
    zones
        .iter()
        .filter(|z| &z.uid != from)
        .filter(|z| match z.string("dedicatedClass") {
            Some(dedicated) => Some(dedicated) == class,
            None => true,
        })
        .filter_map(|z| Some((&z.uid, model.zone_headroom_w(z, added_w)?)))
        .filter(|(_, room)| *room >= 0.0)
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(uid, room)| (uid.clone(), room))
}

export_plugin!(ThermalHeadroom);

#[cfg(test)]
mod tests {
    use super::*;
    use probity_plugin_sdk::MockHost;
    use serde_json::{Value, json};

    fn zone(id: &str, draw: i64, ceiling: i64) -> Value {
        json!({"uid": {"type": "Zone", "id": id}, "attrs": {"powerDrawW": draw, "powerCeilingW": ceiling}, "parents": []})
    }

    fn request(gpus: i64, zone_draw: i64, temp: i64) -> Request {
        Request::new(r#"Workload::"w""#, "schedule", r#"Node::"n""#).with_entities(&json!([
            {"uid": {"type": "Workload", "id": "w"}, "attrs": {"gpus": gpus, "class": "training"}, "parents": []},
            {"uid": {"type": "Node", "id": "n"}, "parents": [], "attrs": {
                "zone": {"__entity": {"type": "Zone", "id": "warm"}},
                "gpuModel": {"__entity": {"type": "GpuModel", "id": "A100"}},
                "hottestGpuTempC": temp}},
            {"uid": {"type": "GpuModel", "id": "A100"}, "attrs": {"tempTargetC": 65}, "parents": []},
            zone("warm", zone_draw, 40000),
        ]))
    }

    fn host() -> MockHost {
        let mut dedicated = zone("rlhf", 0, 40000);
        dedicated["attrs"]["dedicatedClass"] = json!("rlhf");
        MockHost::with_entities(&json!([
            zone("warm", 34000, 40000),
            zone("cool", 10000, 40000),
            zone("cooler-but-full", 37000, 40000),
            dedicated,
        ]))
    }

    #[test]
    fn room_to_spare_is_allowed() {
        assert_eq!(
            ThermalHeadroom::evaluate(&request(2, 20000, 50), &host()),
            Verdict::allow()
        );
    }

    #[test]
    fn crossing_the_zone_ceiling_denies_and_migrates_to_the_zone_with_most_headroom() {
        // 34000 + 8 * 700 = 39600 > 38000 (95% of 40000)
        let v = ThermalHeadroom::evaluate(&request(8, 34000, 50), &host());
        let o = v.outcome().unwrap();
        assert!(v.is_deny());
        assert_eq!(o.reasons[0].id, "zone-ceiling");
        assert_eq!(o.obligations[0].kind, "migrate");
        // the empty rlhf zone is dedicated to another class
        assert_eq!(o.obligations[0].target.as_deref(), Some(r#"Zone::"cool""#));
    }

    #[test]
    fn a_gpu_that_would_overheat_denies() {
        // 63 + 4 * 0.7 * 1 = 65.8 > 65
        let v = ThermalHeadroom::evaluate(&request(4, 1000, 63), &host());
        assert_eq!(v.outcome().unwrap().reasons[0].id, "gpu-temperature");
    }

    #[test]
    fn without_the_facts_it_abstains() {
        let r = Request::new(r#"Workload::"w""#, "schedule", r#"Node::"n""#);
        assert_eq!(ThermalHeadroom::evaluate(&r, &host()), Verdict::Abstain);
    }
}
