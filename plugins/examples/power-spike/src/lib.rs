//! power-spike: flags a power reading far above its window's mean.
//!
//! Reads `powerReadingsW` (an array of watts, oldest first) from the context of a
//! `comply` request. The newest reading is the one under test; the window is the
//! readings before it. A newest reading at or above `mean * (1 + spike_pct / 100)` of
//! the window is a spike: the plugin denies with an `alert` obligation on the
//! resource. `spike_pct` comes from the plugin's settings (default 25). With fewer
//! than two readings (no window), or a window mean of 0 (no data), it abstains.

use probity_plugin_sdk::{
    Description, Host, Level, Obligation, Plugin, Reason, Request, Severity, Verdict, export_plugin,
};

/// The plugin.
pub struct PowerSpike;

/// Default spike threshold, percent above the window mean.
pub const DEFAULT_SPIKE_PCT: f64 = 25.0;

impl Plugin for PowerSpike {
    fn describe() -> Description {
        Description::new("power-spike", env!("CARGO_PKG_VERSION"), ["comply"])
    }

    fn evaluate(request: &Request, host: &dyn Host) -> Verdict {
        let readings: Vec<f64> = match request.context.get("powerReadingsW") {
            Some(serde_json::Value::Array(items)) => {
                items.iter().filter_map(serde_json::Value::as_f64).collect()
            }
            _ => return Verdict::Abstain,
        };
        if readings.len() < 2 {
            return Verdict::Abstain;
        }
        let pct = request.setting_f64("spike_pct", DEFAULT_SPIKE_PCT);
        match find_spike(&readings, pct) {
            None => Verdict::allow(),
            Some(spike) => {
                host.log(
                    Level::Info,
                    &format!(
                        "{}: {} W against a mean of {:.0} W",
                        request.resource, spike.reading, spike.mean
                    ),
                );
                Verdict::deny(Reason::new(
                    "spike",
                    format!(
                        "power reading {} W is {:.0}% above the window mean of {:.0} W (threshold {pct}%)",
                        spike.reading, spike.excess_pct, spike.mean
                    ),
                    Severity::Medium,
                ))
                .with_obligation(
                    Obligation::new("alert")
                        .target(request.resource.clone())
                        .param("reading_w", spike.reading)
                        .param("mean_w", format!("{:.0}", spike.mean)),
                )
            }
        }
    }
}

/// The newest reading, at or above the threshold, with the mean of the window before it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spike {
    /// The reading, in watts.
    pub reading: f64,
    /// The window mean, in watts.
    pub mean: f64,
    /// How far above the mean, in percent.
    pub excess_pct: f64,
}

/// Whether the newest reading is at or above `mean * (1 + pct / 100)`, where the mean
/// is over the readings before it: a reading is never part of its own baseline (it
/// would pull the mean towards itself and hide the spike).
pub fn find_spike(readings: &[f64], pct: f64) -> Option<Spike> {
    let (&reading, window) = readings.split_last()?;
    if window.is_empty() {
        return None;
    }
    let mean = window.iter().sum::<f64>() / window.len() as f64;
    if mean <= 0.0 {
        return None;
    }
    (reading >= mean * (1.0 + pct / 100.0)).then(|| Spike {
        reading,
        mean,
        excess_pct: (reading / mean - 1.0) * 100.0,
    })
}

export_plugin!(PowerSpike);

#[cfg(test)]
mod tests {
    use super::*;
    use probity_plugin_sdk::MockHost;
    use serde_json::json;

    fn comply(readings: serde_json::Value) -> Request {
        Request::new(r#"Node::"n1""#, "comply", r#"Node::"n1""#)
            .with_context(json!({ "powerReadingsW": readings }))
    }

    #[test]
    fn a_steady_window_is_allowed() {
        let v = PowerSpike::evaluate(
            &comply(json!([3000, 3050, 2980, 3100])),
            &MockHost::default(),
        );
        assert_eq!(v, Verdict::allow());
    }

    #[test]
    fn a_reading_25_percent_over_the_mean_is_a_spike_with_an_alert() {
        let host = MockHost::default();
        let v = PowerSpike::evaluate(&comply(json!([100, 100, 100, 140])), &host);
        let o = v.outcome().unwrap();
        assert!(v.is_deny());
        assert_eq!(o.reasons[0].id, "spike");
        assert_eq!(o.obligations[0].kind, "alert");
        assert_eq!(o.obligations[0].target.as_deref(), Some(r#"Node::"n1""#));
        assert_eq!(host.log.borrow().len(), 1);
    }

    #[test]
    fn the_threshold_comes_from_settings() {
        let r = comply(json!([100, 100, 100, 140])).with_settings(json!({"spike_pct": 50}));
        assert_eq!(
            PowerSpike::evaluate(&r, &MockHost::default()),
            Verdict::allow()
        );
    }

    #[test]
    fn no_readings_abstains() {
        let r = Request::new(r#"Node::"n1""#, "comply", r#"Node::"n1""#);
        assert_eq!(
            PowerSpike::evaluate(&r, &MockHost::default()),
            Verdict::Abstain
        );
        assert_eq!(
            PowerSpike::evaluate(&comply(json!([])), &MockHost::default()),
            Verdict::Abstain
        );
    }

    #[test]
    fn exactly_at_the_threshold_is_a_spike() {
        // the window [100, 100] has a mean of 100; 125 >= 100 * 1.25
        assert!(find_spike(&[100.0, 100.0, 125.0], 25.0).is_some());
        assert!(find_spike(&[100.0, 100.0, 124.9], 25.0).is_none());
        assert!(find_spike(&[0.0, 0.0], 25.0).is_none());
        assert!(find_spike(&[500.0], 25.0).is_none());
    }

    /// The mean used to include the reading under test: +30% read as +22.5%.
    #[test]
    fn bug_the_reading_under_test_was_part_of_its_own_mean() {
        let spike = find_spike(&[3000.0, 3000.0, 3000.0, 3900.0], 25.0).unwrap();
        assert_eq!(spike.mean, 3000.0);
        assert_eq!(spike.reading, 3900.0);
    }

    #[test]
    fn one_reading_is_no_window_and_abstains() {
        assert_eq!(
            PowerSpike::evaluate(&comply(json!([9000])), &MockHost::default()),
            Verdict::Abstain
        );
    }
}
