//! A rolling window of one node's power readings, for the anomaly rule ("a power reading 25%
//! above its window mean"). The threshold itself lives in the policies; this only keeps the
//! readings and computes the baseline.
//!
//! The baseline is the mean of the readings **before** the newest one: a spike must not raise
//! its own baseline. With no earlier reading inside the window the answer is
//! [`Baseline::NoData`], never a mean of 0 (against which every reading would be a spike).

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use thiserror::Error;

/// A rolling window of power readings (watts) for one node.
#[derive(Debug, Clone)]
pub struct PowerWindow {
    capacity: usize,
    max_age: Duration,
    samples: VecDeque<(SystemTime, f64)>,
}

/// The mean the newest reading is judged against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Baseline {
    /// No earlier reading inside the window.
    NoData,
    /// The mean of the earlier readings inside the window.
    Mean {
        /// Mean power, watts.
        watts: f64,
        /// How many readings it averages.
        samples: usize,
    },
}

impl Baseline {
    /// The mean, if there is one.
    pub fn watts(self) -> Option<f64> {
        match self {
            Self::NoData => None,
            Self::Mean { watts, .. } => Some(watts),
        }
    }
}

/// A reading the window refuses.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum WindowError {
    /// Not a finite, non-negative number of watts.
    #[error("power reading {watts} W is not a finite non-negative number")]
    Invalid {
        /// The reading.
        watts: f64,
    },
    /// Older than the newest reading already in the window.
    #[error("power reading at {at:?} is older than the newest one at {newest:?}")]
    OutOfOrder {
        /// The refused reading's time.
        at: SystemTime,
        /// The newest time in the window.
        newest: SystemTime,
    },
}

impl PowerWindow {
    /// A window of at most `capacity` readings (at least 2: the newest and one to compare
    /// with), none older than `max_age`.
    pub fn new(capacity: usize, max_age: Duration) -> Self {
        let capacity = capacity.max(2);
        Self {
            capacity,
            max_age,
            samples: VecDeque::with_capacity(capacity),
        }
    }

    /// Adds a reading; the oldest drops out once the window is full.
    pub fn push(&mut self, at: SystemTime, watts: f64) -> Result<(), WindowError> {
        if !watts.is_finite() || watts < 0.0 {
            return Err(WindowError::Invalid { watts });
        }
        if let Some(&(newest, _)) = self.samples.back()
            && at < newest
        {
            return Err(WindowError::OutOfOrder { at, newest });
        }
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((at, watts));
        Ok(())
    }

    /// The newest reading: the one under test.
    pub fn newest(&self) -> Option<(SystemTime, f64)> {
        self.samples.back().copied()
    }

    /// The mean of the readings before the newest one that are no older than the window's
    /// maximum age at `now`.
    pub fn baseline(&self, now: SystemTime) -> Baseline {
        let earlier = self.samples.len().saturating_sub(1);
        let (sum, n) = self
            .samples
            .iter()
            .take(earlier)
            .filter(|(at, _)| now.duration_since(*at).is_ok_and(|age| age <= self.max_age))
            .fold((0.0, 0usize), |(s, n), (_, w)| (s + w, n + 1));
        if n == 0 {
            return Baseline::NoData;
        }
        Baseline::Mean {
            watts: sum / n as f64,
            samples: n,
        }
    }

    /// Number of readings held (the newest included).
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether the window holds no reading.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + s)
    }

    #[test]
    fn baseline_excludes_the_newest_reading() {
        let mut w = PowerWindow::new(10, Duration::from_secs(600));
        w.push(t(0), 100.0).unwrap();
        w.push(t(10), 200.0).unwrap();
        w.push(t(20), 900.0).unwrap();
        assert_eq!(
            w.baseline(t(20)),
            Baseline::Mean {
                watts: 150.0,
                samples: 2
            }
        );
        assert_eq!(w.newest(), Some((t(20), 900.0)));
    }

    #[test]
    fn a_single_reading_has_no_baseline_not_zero() {
        let mut w = PowerWindow::new(10, Duration::from_secs(600));
        assert_eq!(w.baseline(t(0)), Baseline::NoData);
        w.push(t(0), 500.0).unwrap();
        assert_eq!(w.baseline(t(0)), Baseline::NoData);
        assert_eq!(w.baseline(t(0)).watts(), None);
    }

    #[test]
    fn readings_older_than_max_age_leave_the_mean() {
        let mut w = PowerWindow::new(10, Duration::from_secs(60));
        w.push(t(0), 1000.0).unwrap();
        w.push(t(100), 100.0).unwrap();
        w.push(t(110), 300.0).unwrap();
        assert_eq!(
            w.baseline(t(110)),
            Baseline::Mean {
                watts: 100.0,
                samples: 1
            }
        );
        // Everything earlier has aged out: no data, not 0.
        assert_eq!(w.baseline(t(500)), Baseline::NoData);
    }

    #[test]
    fn capacity_drops_the_oldest() {
        let mut w = PowerWindow::new(3, Duration::from_secs(600));
        for (i, watts) in [10.0, 20.0, 30.0, 40.0].into_iter().enumerate() {
            w.push(t(i as u64), watts).unwrap();
        }
        assert_eq!(w.len(), 3);
        assert_eq!(w.baseline(t(3)).watts(), Some(25.0));
    }

    #[test]
    fn invalid_and_out_of_order_readings_are_refused() {
        let mut w = PowerWindow::new(3, Duration::from_secs(600));
        assert!(w.push(t(0), f64::NAN).is_err());
        assert!(w.push(t(0), -1.0).is_err());
        w.push(t(10), 1.0).unwrap();
        assert!(matches!(
            w.push(t(5), 1.0),
            Err(WindowError::OutOfOrder { .. })
        ));
        assert_eq!(w.len(), 1);
    }
}
