//! Measured link rates (issue 32, item 2): how fast this peer's line moved a round's bytes.
//!
//! The runner's writers report each frame's write (bytes, start and end of the write, which
//! blocks while the socket's buffer is full, so at the line's pace) and its readers each
//! frame's reception (bytes, from the arrival of its head to its last byte), per link (a
//! *flow*). Per direction, the rate is the bytes over the time the line was busy, counted
//! where the most flows were moving at once:
//!
//! - Idle time (waiting for a window or a slow peer) does not dilute it: only time when some
//!   flow was moving counts (the union of the transfers' intervals).
//! - Nor does a lone slow flow. A member whose own line is slow (the bench's `slow`
//!   scenario: one line 4x slower) keeps its flow to us moving all round at its line's pace,
//!   long after the others have finished; over the union that made a 100 Mbit/s downlink
//!   measure 31-45 Mbit/s, so the plan took the fast lines for slow ones and gave the slow
//!   member a share it could not carry. So the time is swept in segments by how many flows
//!   were moving (each transfer's bytes spread evenly over its interval), and the rate is
//!   taken over the segments with at least `c` flows moving, for the largest `c` whose
//!   segments carried [`MIN_MEASURED_BYTES`]. With flows that never overlap, `c` = 1: the
//!   union, as before.
//!
//! Rounds that moved less than [`MIN_MEASURED_BYTES`] in a direction say nothing about it
//! (their time is latency, not bandwidth). Each direction keeps at most [`MAX_TRANSFERS`]
//! transfers: past that, each flow's consecutive transfers are merged pairwise (a merged one
//! spans both and the gap between them), so memory stays bounded however many frames a round
//! (or a hostile peer) moves.

use std::sync::Mutex;
use std::time::Instant;

use crate::allreduce::LinkRates;
use crate::allreduce::pacing::LinkTotals;

/// Fewest bytes in one direction for a round to measure that direction.
pub const MIN_MEASURED_BYTES: u64 = 1 << 20;

/// The most transfers one direction keeps (module docs).
pub const MAX_TRANSFERS: usize = 4096;

/// One frame's (or slice's) transfer on one flow.
#[derive(Clone, Copy, Debug)]
struct Transfer {
    flow: usize,
    bytes: u64,
    start: Instant,
    end: Instant,
}

#[derive(Debug, Default)]
struct Direction {
    bytes: u64,
    transfers: Vec<Transfer>,
    /// Per flow, the end of its latest transfer.
    ends: Vec<(usize, Instant)>,
}

impl Direction {
    /// `bytes` moved on `flow` between `start` and `end`. A flow moves one transfer at a time:
    /// one that starts before the flow's previous one ended starts at that end (a paced
    /// slice's time in the schedule can begin before a slow write of the slice before it
    /// returned), so that no flow counts twice in the segments it is swept in.
    fn add(&mut self, flow: usize, bytes: u64, start: Instant, end: Instant) {
        self.bytes += bytes;
        let start = match self.ends.iter_mut().find(|(f, _)| *f == flow) {
            Some((_, last)) => {
                let start = start.max(*last);
                *last = (*last).max(end);
                start
            }
            None => {
                self.ends.push((flow, end));
                start
            }
        };
        if self.transfers.len() >= MAX_TRANSFERS {
            self.merge();
        }
        self.transfers.push(Transfer {
            flow,
            bytes,
            start: start.min(end),
            end,
        });
    }

    /// Halves (about) the transfers: each flow's consecutive pairs become one.
    fn merge(&mut self) {
        let mut open: Vec<(usize, usize)> = Vec::new(); // (flow, index in `merged`)
        let mut merged: Vec<Transfer> = Vec::with_capacity(self.transfers.len() / 2 + 1);
        for t in self.transfers.drain(..) {
            match open.iter().position(|&(f, _)| f == t.flow) {
                Some(at) => {
                    let (_, i) = open.swap_remove(at);
                    let m = &mut merged[i];
                    m.bytes += t.bytes;
                    m.start = m.start.min(t.start);
                    m.end = m.end.max(t.end);
                }
                None => {
                    open.push((t.flow, merged.len()));
                    merged.push(t);
                }
            }
        }
        self.transfers = merged;
    }

    fn rate(&self) -> Option<f64> {
        if self.bytes < MIN_MEASURED_BYTES {
            return None;
        }
        busiest_rate(&self.transfers)
    }
}

/// The rate over the segments where at least `c` transfers were moving, for the largest `c`
/// whose segments moved [`MIN_MEASURED_BYTES`] (module docs); `None` if no time was busy.
fn busiest_rate(transfers: &[Transfer]) -> Option<f64> {
    let origin = transfers.iter().map(|t| t.start).min()?;
    let at = |i: Instant| i.saturating_duration_since(origin).as_secs_f64();
    // (time, change in moving transfers, change in bytes per second)
    let mut events: Vec<(f64, i64, f64)> = Vec::with_capacity(2 * transfers.len());
    for t in transfers {
        let (start, end) = (at(t.start), at(t.end));
        if end > start {
            let rate = t.bytes as f64 / (end - start);
            events.push((start, 1, rate));
            events.push((end, -1, -rate));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Per number of moving transfers: (seconds, bytes).
    let mut by_count: Vec<(f64, f64)> = Vec::new();
    let (mut moving, mut rate) = (0i64, 0.0f64);
    let mut last = events.first()?.0;
    for (time, d_moving, d_rate) in events {
        let c = usize::try_from(moving).unwrap_or(0);
        if c > 0 && time > last {
            if by_count.len() <= c {
                by_count.resize(c + 1, (0.0, 0.0));
            }
            by_count[c].0 += time - last;
            by_count[c].1 += rate.max(0.0) * (time - last);
        }
        last = time;
        moving += d_moving;
        rate += d_rate;
    }
    let (mut secs, mut bytes) = (0.0, 0.0);
    for &(s, b) in by_count.iter().rev() {
        secs += s;
        bytes += b;
        if bytes >= MIN_MEASURED_BYTES as f64 && secs > 0.0 {
            return Some(bytes / secs);
        }
    }
    (secs > 0.0).then(|| bytes / secs)
}

/// One round's traffic over all its links (shared by the runner's link tasks).
#[derive(Debug, Default)]
pub struct Traffic {
    up: Mutex<Direction>,
    down: Mutex<Direction>,
}

impl Traffic {
    /// A frame (or a slice of one) of `bytes` was written to the link of member `flow` from
    /// `start` to `end`.
    pub fn sent(&self, flow: usize, bytes: u64, start: Instant, end: Instant) {
        self.up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(flow, bytes, start, end);
    }

    /// A frame of `bytes` was received from member `flow` from `start` (its head) to `end`
    /// (its last byte).
    pub fn received(&self, flow: usize, bytes: u64, start: Instant, end: Instant) {
        self.down
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(flow, bytes, start, end);
    }

    /// Bytes sent and received so far.
    pub fn bytes(&self) -> (u64, u64) {
        let up = self.up.lock().unwrap_or_else(|e| e.into_inner()).bytes;
        let down = self.down.lock().unwrap_or_else(|e| e.into_inner()).bytes;
        (up, down)
    }

    /// The achieved upload and download rates (bytes per second while busy, module docs),
    /// when both directions moved enough to measure.
    pub fn rates(&self) -> Option<LinkRates> {
        let up = self.up.lock().unwrap_or_else(|e| e.into_inner()).rate()?;
        let down = self.down.lock().unwrap_or_else(|e| e.into_inner()).rate()?;
        Some(LinkRates { up, down })
    }
}

/// How far past the sum of its paces a paced round's measured rate may be and still count as
/// bounded by them (the pacer's slack, timer jitter).
pub const WITHIN_PACES: f64 = 1.1;

/// A paced round whose measured rate reached this fraction of the sum of its paces ran at its
/// paces, not at its line's limit: it says nothing against a higher estimate.
pub const PACE_LIMITED: f64 = 0.9;

/// Folds a round's measured rates into the running estimate, per direction.
///
/// - A rise is taken at once where the round was paced in that direction (`paced`, the sums
///   of its flows' paces: [`crate::allreduce::pacing::paced_totals`]) and its measured rate
///   stays within [`WITHIN_PACES`] of them. Such a round could go no faster than its paces,
///   so what it achieved is a lower bound on the line; halving the rise made the estimate,
///   and the paces with it, climb only about half the pacing headroom per round after a low
///   first measurement (five rounds from 66 to 90 Mbit/s on a 100 Mbit/s line, on the bed).
/// - A drop is ignored where the round was paced and reached [`PACE_LIMITED`] of its paces:
///   it ran as fast as it was let, which a plan limited by other lines can hold well below
///   this one (a client's uplink, paced at what the reducers' downlinks can take, measured
///   55 Mbit/s on a 100 Mbit/s line, round after round: the estimate sank to it).
/// - Any other drop, and a rise beyond the paces or in an unpaced round, moves half way, so
///   one disturbed round moves the estimate only half way.
pub fn smooth(previous: Option<LinkRates>, round: LinkRates, paced: LinkTotals) -> LinkRates {
    let fold = |previous: f64, round: f64, paced: Option<f64>| match paced {
        Some(p) if round > previous && round <= WITHIN_PACES * p => round,
        Some(p) if round <= previous && round >= PACE_LIMITED * p => previous,
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

    use proptest::prelude::*;
    use std::time::Duration;

    const MIB: u64 = 1 << 20;

    /// Transfers that never overlap count their union: idle time between them does not count.
    #[test]
    fn busy_time_is_the_union_of_transfers_that_never_overlap() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let t = Traffic::default();
        // Flow 0 from 0 to 100 ms, idle, flow 1 from 200 to 300 ms, flow 0 again to 400 ms.
        t.sent(0, MIB, s(0), s(100));
        t.sent(1, MIB, s(200), s(300));
        t.sent(0, 2 * MIB, s(300), s(400));
        t.received(2, 3 * MIB, s(0), s(300));
        let r = t.rates().unwrap();
        let expected = (4 * MIB) as f64 / 0.3;
        assert!((r.up - expected).abs() < 1e-6 * expected, "{}", r.up);
        assert!((r.down - (3 * MIB) as f64 / 0.3).abs() < 1.0);
        assert_eq!(t.bytes(), (4 * MIB, 3 * MIB));
    }

    /// Two fast flows that finish in a second and a slow one that trickles on for four (a
    /// member whose line is 4x slower): the rate is the three flows' while they all moved,
    /// not the bytes over the four seconds some flow was moving.
    #[test]
    fn a_lone_slow_flow_does_not_dilute_the_rate() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let t = Traffic::default();
        for i in 0..8u64 {
            // Frames of 512 KiB, back to back: 4 MiB/s per fast flow.
            t.received(0, MIB / 2, s(125 * i), s(125 * (i + 1)));
            t.received(1, MIB / 2, s(125 * i), s(125 * (i + 1)));
        }
        for i in 0..4u64 {
            t.received(2, MIB / 2, s(1000 * i), s(1000 * (i + 1)));
        }
        t.sent(0, 2 * MIB, s(0), s(1000));
        let down = t.rates().unwrap().down;
        let expected = 8.5 * MIB as f64;
        assert!((down - expected).abs() < 1e-6 * expected, "{down}");
        // Over the union it would be 10 MiB in 4 s.
        assert!(down > 3.0 * (10 * MIB) as f64 / 4.0);
    }

    /// A flow's transfer that starts before its previous one ended (a paced slice's time in
    /// the schedule, after a write that blocked) counts from that end: one flow alone
    /// measures its bytes over its own busy time, not as two flows at once.
    #[test]
    fn a_flow_never_overlaps_itself() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let mut d = Direction::default();
        d.add(0, 4 * MIB, s(0), s(100));
        d.add(0, 4 * MIB, s(50), s(200));
        let rate = d.rate().unwrap();
        // Counted as two flows at once from 50 to 100 ms, it would read 66.7 MiB/s.
        let expected = (8 * MIB) as f64 / 0.2;
        assert!((rate - expected).abs() < 1e-6 * expected, "{rate}");
    }

    /// A round of many small transfers keeps at most `MAX_TRANSFERS` of them, and measures
    /// the same steady rates after merging.
    #[test]
    fn transfers_stay_bounded_and_merging_keeps_a_steady_rate() {
        let t0 = Instant::now();
        let t = Traffic::default();
        let us = |i: u64| t0 + Duration::from_micros(i);
        // Three flows of 16 KiB slices, each at 16 KiB per 1000 µs, all round.
        for i in 0..10_000u64 {
            for flow in 0..3 {
                t.sent(flow, 16 << 10, us(1000 * i), us(1000 * (i + 1)));
            }
        }
        t.received(0, MIB, t0, us(1_000_000));
        let up = t.up.lock().unwrap();
        assert!(
            up.transfers.len() <= MAX_TRANSFERS,
            "{}",
            up.transfers.len()
        );
        assert_eq!(up.bytes, 30_000 * (16 << 10));
        let rate = up.rate().unwrap();
        let expected = 3.0 * (16u64 << 10) as f64 / 1e-3;
        assert!((rate - expected).abs() < 1e-6 * expected, "{rate}");
    }

    proptest! {
        /// Flows that each move at a steady rate over their own interval, with the rates
        /// summing to at most the line's: the measured rate never exceeds the line's, and is
        /// at least the slowest flow's.
        #[test]
        fn the_rate_never_exceeds_the_line(
            flows in prop::collection::vec((0u64..2000, 1u64..3000, 1u64..100), 1..6),
            frames in 1u64..20,
        ) {
            let t0 = Instant::now();
            let us = |i: u64| t0 + Duration::from_micros(i);
            let line: f64 = flows.iter().map(|&(_, _, r)| r as f64 * 1e6).sum();
            let mut d = Direction::default();
            for (flow, &(start, length, rate)) in flows.iter().enumerate() {
                // `rate` bytes per µs over [start, start + length), in `frames` frames.
                let step = length.div_ceil(frames);
                let mut at = start;
                while at < start + length {
                    let end = (at + step).min(start + length);
                    d.add(flow, rate * (end - at) * 64, us(at), us(end));
                    at = end;
                }
            }
            // Scaled by 64 so that every round moves at least MIN_MEASURED_BYTES.
            let line = 64.0 * line;
            match d.rate() {
                Some(r) => {
                    prop_assert!(r <= line * (1.0 + 1e-9), "{} > {}", r, line);
                    let slowest = flows.iter().map(|&(_, _, r)| r as f64 * 64e6).fold(f64::MAX, f64::min);
                    prop_assert!(r >= slowest * (1.0 - 1e-9), "{} < {}", r, slowest);
                }
                None => prop_assert!(d.bytes < MIN_MEASURED_BYTES),
            }
        }
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
        // A drop to where the round ran at its paces (11 of 12, from an estimate of 20) is
        // ignored; the same drop unpaced counts half.
        assert_eq!(
            smooth(Some(rates(20.0, 20.0)), rates(11.0, 11.0), paced),
            rates(20.0, 20.0)
        );
        assert_eq!(
            smooth(Some(rates(20.0, 20.0)), rates(11.0, 11.0), unpaced),
            rates(15.5, 15.5)
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
        t.sent(0, 1000, t0, t0 + Duration::from_millis(10));
        t.received(0, MIN_MEASURED_BYTES, t0, t0 + Duration::from_millis(10));
        assert_eq!(t.rates(), None);
    }
}
