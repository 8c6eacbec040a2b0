//! Deadlines from measured rates and observed arrivals (issue 32, item 3).
//!
//! A fixed `sender_timeout` bans a slow but steady peer whose parts simply take longer than
//! the timeout to cross its line, and waits the full timeout for a silent one. With
//! [`AdaptiveTimeouts`] a reducer expects a sender's next part after
//!
//! ```text
//! gap(s → r) = part_bytes · max(load(s) / up(s), senders(r) / down(r))
//! ```
//!
//! where `load(s)` is the number of parts per step that share `s`'s uplink (one per reducer
//! it sends to, plus one reply per sender if it reduces) and `senders(r)` the number of
//! senders sharing `r`'s downlink; an unknown rate leaves its term out. Once the sender's
//! parts arrive, the observed gap between them (an average over the round, counted only while
//! the reducer is not holding the sender up) replaces the expectation where it is longer. The
//! sender timeout is `factor · gap`, clamped to `[min, max]`; with nothing known it is the
//! fixed `sender_timeout`, as before.
//!
//! A sender waits for a reducer's next reply `factor · reply_gap`, clamped to `[min, max]`,
//! plus the configured slack `reducer_timeout − sender_timeout`, where `reply_gap` is the
//! longest expected gap of any of that reducer's senders, the reducer's own uplink load, or
//! the observed gap between its replies, whichever is longest; the slack covers the latency
//! and queueing past an honest reducer's own wait for a silent sender, as the fixed timeouts'
//! margin does. A reducer with a sender of unknown rate gets at least the fixed
//! `reducer_timeout`. Every member computes the expectations from the same declared rates,
//! so a reducer's wait for a sender stays below its senders' wait for it.

use std::time::Duration;

/// Measured rates of one member's line, in bytes per second (zero or not finite: unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkRates {
    /// Upload.
    pub up: f64,
    /// Download.
    pub down: f64,
}

impl LinkRates {
    /// The upload rate, if known.
    pub fn up(&self) -> Option<f64> {
        known(self.up)
    }

    /// The download rate, if known.
    pub fn down(&self) -> Option<f64> {
        known(self.down)
    }
}

fn known(rate: f64) -> Option<f64> {
    (rate.is_finite() && rate > 0.0).then_some(rate)
}

/// Bounds of the adaptive timeouts (user-set).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveTimeouts {
    /// No timeout is shorter.
    pub min: Duration,
    /// No timeout is longer (plus the reducer slack for reducer timeouts).
    pub max: Duration,
    /// How many expected gaps a peer may take (at least 1).
    pub factor: f64,
}

impl Default for AdaptiveTimeouts {
    fn default() -> Self {
        Self {
            min: Duration::from_secs(1),
            max: Duration::from_secs(60),
            factor: 3.0,
        }
    }
}

impl AdaptiveTimeouts {
    /// Whether the bounds make sense: `0 < min ≤ max`, `factor ≥ 1` and finite.
    pub fn is_valid(&self) -> bool {
        !self.min.is_zero() && self.min <= self.max && self.factor.is_finite() && self.factor >= 1.0
    }

    /// The timeout for an expected `gap`: `factor · gap` within `[min, max]`.
    pub fn timeout(&self, gap: Duration) -> Duration {
        let t = gap.as_secs_f64() * self.factor;
        if !(t.is_finite()) || t >= self.max.as_secs_f64() {
            return self.max;
        }
        Duration::from_secs_f64(t).clamp(self.min, self.max)
    }
}

/// The expected gap between two parts of `part_bytes` from a sender whose uplink carries
/// `sender_load` parts per step at `sender_up` bytes/s, into a reducer whose downlink carries
/// `reducer_senders` senders' parts at `reducer_down` bytes/s. `None` when neither rate is
/// known.
pub fn expected_gap(
    part_bytes: usize,
    sender_up: Option<f64>,
    sender_load: usize,
    reducer_down: Option<f64>,
    reducer_senders: usize,
) -> Option<Duration> {
    let up = sender_up.map(|r| sender_load.max(1) as f64 / r);
    let down = reducer_down.map(|r| reducer_senders.max(1) as f64 / r);
    let per_byte = match (up, down) {
        (Some(a), Some(b)) => a.max(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => return None,
    };
    let secs = per_byte * part_bytes as f64;
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// A running average of gaps (the mean over the samples so far).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GapMean {
    total: Duration,
    count: u32,
}

impl GapMean {
    /// Adds one observed gap.
    pub(crate) fn add(&mut self, gap: Duration) {
        self.total = self.total.saturating_add(gap);
        self.count = self.count.saturating_add(1);
    }

    /// The mean gap, once one was observed.
    pub(crate) fn mean(&self) -> Option<Duration> {
        (self.count > 0).then(|| self.total / self.count)
    }
}

/// The longer of two optional gaps.
pub(crate) fn longer(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slower_line_sets_the_gap() {
        let part = 1_000_000;
        // 3 parts per step on a 1 MB/s uplink: 3 s; 2 senders into a 10 MB/s downlink: 0.2 s.
        let g = expected_gap(part, Some(1e6), 3, Some(1e7), 2).unwrap();
        assert_eq!(g, Duration::from_secs(3));
        let g = expected_gap(part, None, 3, Some(1e6), 2).unwrap();
        assert_eq!(g, Duration::from_secs(2));
        assert_eq!(expected_gap(part, None, 3, None, 2), None);
    }

    #[test]
    fn timeouts_stay_within_bounds() {
        let b = AdaptiveTimeouts {
            min: Duration::from_millis(100),
            max: Duration::from_secs(10),
            factor: 2.0,
        };
        assert!(b.is_valid());
        assert_eq!(b.timeout(Duration::ZERO), Duration::from_millis(100));
        assert_eq!(b.timeout(Duration::from_secs(1)), Duration::from_secs(2));
        assert_eq!(b.timeout(Duration::from_secs(100)), Duration::from_secs(10));
        assert_eq!(b.timeout(Duration::MAX), Duration::from_secs(10));
        assert!(!AdaptiveTimeouts { factor: 0.5, ..b }.is_valid());
    }
}
