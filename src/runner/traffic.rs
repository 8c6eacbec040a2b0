//! Measured link rates (issue 32, item 2): how fast this peer's line moved a round's bytes.
//!
//! The runner's writers report each frame's write (bytes, start and end of the write, which
//! blocks while the socket's buffer is full, so at the line's pace) and its readers each
//! frame's reception (bytes, from the arrival of its head to its last byte). Per direction,
//! the bytes over the time some link was busy (the union of those intervals, counted as
//! they complete) is the rate the line achieved while it had data to move, which is what
//! load balancing and deadlines need; idle time (waiting for a window or a slow peer) does not
//! dilute it. Rounds that moved less than [`MIN_MEASURED_BYTES`] in a direction say nothing
//! about it (their time is latency, not bandwidth).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::allreduce::LinkRates;
use crate::allreduce::pacing::LinkTotals;

/// Fewest bytes in one direction for a round to measure that direction.
pub const MIN_MEASURED_BYTES: u64 = 1 << 20;

#[derive(Debug, Default)]
struct Direction {
    bytes: u64,
    busy: Duration,
    last_end: Option<Instant>,
}

impl Direction {
    /// `bytes` moved between `start` and `end` (`end` not before any earlier call's `end`
    /// up to clock granularity: calls come as transfers complete).
    fn add(&mut self, bytes: u64, start: Instant, end: Instant) {
        self.bytes += bytes;
        let from = self.last_end.map_or(start, |l| l.max(start));
        self.busy += end.saturating_duration_since(from);
        self.last_end = Some(self.last_end.map_or(end, |l| l.max(end)));
    }

    fn rate(&self) -> Option<f64> {
        let secs = self.busy.as_secs_f64();
        (self.bytes >= MIN_MEASURED_BYTES && secs > 0.0).then(|| self.bytes as f64 / secs)
    }
}

/// One round's traffic over all its links (shared by the runner's link tasks).
#[derive(Debug, Default)]
pub struct Traffic {
    up: Mutex<Direction>,
    down: Mutex<Direction>,
}

impl Traffic {
    /// A frame of `bytes` was written from `start` to `end`.
    pub fn sent(&self, bytes: u64, start: Instant, end: Instant) {
        self.up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(bytes, start, end);
    }

    /// A frame of `bytes` was received from `start` (its head) to `end` (its last byte).
    pub fn received(&self, bytes: u64, start: Instant, end: Instant) {
        self.down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(bytes, start, end);
    }

    /// Bytes sent and received so far.
    pub fn bytes(&self) -> (u64, u64) {
        let up = self.up.lock().unwrap_or_else(|e| e.into_inner()).bytes;
        let down = self.down.lock().unwrap_or_else(|e| e.into_inner()).bytes;
        (up, down)
    }

    /// The achieved upload and download rates (bytes per second while busy), when both
    /// directions moved enough to measure.
    pub fn rates(&self) -> Option<LinkRates> {
        let up = self.up.lock().unwrap_or_else(|e| e.into_inner()).rate()?;
        let down = self.down.lock().unwrap_or_else(|e| e.into_inner()).rate()?;
        Some(LinkRates { up, down })
    }
}

/// How far past the sum of its paces a paced round's measured rate may be and still count as
/// bounded by them (the pacer's slack, timer jitter).
pub const WITHIN_PACES: f64 = 1.1;

/// Folds a round's measured rates into the running estimate, per direction.
///
/// - A drop moves the estimate half way, so one disturbed round moves it only half way.
/// - A rise is taken at once where the round was paced in that direction (`paced`, the sums
///   of its flows' paces: [`crate::allreduce::pacing::paced_totals`]) and its measured rate
///   stays within [`WITHIN_PACES`] of them. Such a round could go no faster than its paces,
///   so what it achieved is a lower bound on the line; halving the rise made the estimate,
///   and the paces with it, climb only about half the pacing headroom per round after a low
///   first measurement (five rounds from 66 to 90 Mbit/s on a 100 Mbit/s line, on the bed).
/// - A rise beyond the paces, or in an unpaced round, counts half, as before: a socket buffer
///   that absorbed the writes, or a reader that fell behind, measures more than the line.
pub fn smooth(previous: Option<LinkRates>, round: LinkRates, paced: LinkTotals) -> LinkRates {
    let fold = |previous: f64, round: f64, paced: Option<f64>| match paced {
        Some(p) if round > previous && round <= WITHIN_PACES * p => round,
        _ => 0.5 * (previous + round),
    };
    match previous {
        None => round,
        Some(p) => LinkRates {
            up: fold(p.up, round.up, paced.up),
            down: fold(p.down, round.down, paced.down),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Overlapping transfers count their union; idle time between them does not count.
    #[test]
    fn busy_time_is_the_union_of_transfers() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let t = Traffic::default();
        // Two links writing at once from 0 to 100 ms, then idle, then 200-300 ms.
        t.sent(1 << 20, s(0), s(100));
        t.sent(1 << 20, s(50), s(100));
        t.sent(1 << 20, s(200), s(300));
        t.received(3 << 20, s(0), s(300));
        let r = t.rates().unwrap();
        let expected = (3u64 << 20) as f64 / 0.2;
        assert!((r.up - expected).abs() < 1e-6 * expected, "{}", r.up);
        assert!((r.down - (3u64 << 20) as f64 / 0.3).abs() < 1.0);
        assert_eq!(t.bytes(), (3 << 20, 3 << 20));
    }

    #[test]
    fn a_paced_rise_within_the_paces_is_taken_at_once_and_everything_else_half_way() {
        let rates = |up: f64, down: f64| LinkRates { up, down };
        let unpaced = LinkTotals::default();
        // The first round is taken as it is.
        assert_eq!(smooth(None, rates(5.0, 7.0), unpaced), rates(5.0, 7.0));
        // Unpaced: the mean, up or down.
        assert_eq!(
            smooth(Some(rates(10.0, 10.0)), rates(20.0, 4.0), unpaced),
            rates(15.0, 7.0)
        );
        // Paced at 12 each way: a rise to 11 (within the paces) is taken; a rise to 100 (a
        // socket buffer's burst, far past the paces) counts half; a drop counts half.
        let paced = LinkTotals {
            up: Some(12.0),
            down: Some(12.0),
        };
        assert_eq!(
            smooth(Some(rates(10.0, 10.0)), rates(11.0, 100.0), paced),
            rates(11.0, 55.0)
        );
        assert_eq!(
            smooth(Some(rates(10.0, 10.0)), rates(13.0, 6.0), paced),
            rates(13.0, 8.0)
        );
        // Paced one way only: the other way is the mean.
        let down_only = LinkTotals {
            up: None,
            down: Some(12.0),
        };
        assert_eq!(
            smooth(Some(rates(10.0, 10.0)), rates(11.0, 11.0), down_only),
            rates(10.5, 11.0)
        );
    }

    #[test]
    fn a_small_round_measures_nothing() {
        let t0 = Instant::now();
        let t = Traffic::default();
        t.sent(1000, t0, t0 + Duration::from_millis(10));
        t.received(MIN_MEASURED_BYTES, t0, t0 + Duration::from_millis(10));
        assert_eq!(t.rates(), None);
    }
}
