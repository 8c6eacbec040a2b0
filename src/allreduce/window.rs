//! In-flight windows sized to the link (issue 32, item 1).
//!
//! A node sender keeps at most `window` parts outstanding at one reducer. A constant window
//! (hivemind's, and ours before) is below the bandwidth-delay product of a queued WAN line:
//! the link idles while the sender waits for replies. Here each link measures, from the
//! parts it sends and the replies it gets:
//!
//! * the **round trip**: the smallest time from handing a part out to its reply (the smallest
//!   rather than a mean, so that the queue the window itself builds does not feed back into a
//!   larger window, as BBR's `min_rtt`);
//! * the **acknowledged rate**: bytes replied to per unit time, sampled per reply as the bytes
//!   acknowledged since that part was sent over the time since the acknowledgement that
//!   preceded its sending (BBR's delivery rate), keeping the largest sample;
//!
//! and sizes the window to `WINDOW_GAIN ×` rate × round trip, in parts, between a floor (the
//! configured initial window) and the cap every reducer enforces (`max_in_flight_parts`: the
//! per-link memory budget, in parts). [`window_parts`] is that rule as a pure function.

use std::time::{Duration, Instant};

/// How many bandwidth-delay products the window covers: one keeps the line busy only if
/// the estimates are exact; two absorbs a reducer that answers in bursts (it replies only
/// once every sender contributed a part).
pub const WINDOW_GAIN: f64 = 2.0;

/// The window, in parts, for a link acknowledging `rate` bytes per second with round trip
/// `rtt` and parts of `part_bytes`: `⌈WINDOW_GAIN · rate · rtt / part_bytes⌉`, clamped to
/// `[floor, cap]` (`cap` at least 1, `floor` at most `cap`). No estimate yet (a rate that is
/// zero or not finite, empty parts) gives the floor.
pub fn window_parts(
    rate: f64,
    rtt: Duration,
    part_bytes: usize,
    floor: usize,
    cap: usize,
) -> usize {
    let cap = cap.max(1);
    let floor = floor.clamp(1, cap);
    if !(rate.is_finite() && rate > 0.0) || part_bytes == 0 {
        return floor;
    }
    let parts = (WINDOW_GAIN * rate * rtt.as_secs_f64() / part_bytes as f64).ceil();
    if parts.is_nan() {
        return floor;
    }
    // `as` saturates: an enormous product is the cap.
    (parts as usize).clamp(floor, cap)
}

/// A part handed out and not yet answered.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Instant,
    bytes: u64,
    /// Bytes acknowledged on the link when it was sent.
    acked_before: u64,
    /// When the acknowledgement before its sending arrived (or its own sending time).
    acked_at: Instant,
}

/// One link's measurements and window (sender side).
#[derive(Clone, Debug)]
pub(crate) struct LinkWindow {
    floor: usize,
    cap: usize,
    window: usize,
    sent: Vec<Option<Sent>>,
    acked: u64,
    last_ack: Option<Instant>,
    min_rtt: Option<Duration>,
    max_rate: f64,
    max_part: usize,
}

impl LinkWindow {
    /// A link over `parts` parts (indexed from 0), starting at `floor` parts, never above `cap`.
    pub(crate) fn new(parts: usize, floor: usize, cap: usize) -> Self {
        let cap = cap.max(1);
        let floor = floor.clamp(1, cap);
        Self {
            floor,
            cap,
            window: floor,
            sent: vec![None; parts],
            acked: 0,
            last_ack: None,
            min_rtt: None,
            max_rate: 0.0,
            max_part: 0,
        }
    }

    /// The current window, in parts.
    pub(crate) fn window(&self) -> usize {
        self.window
    }

    /// Part `i` (of this link) of `bytes` went out at `now`.
    pub(crate) fn on_send(&mut self, i: usize, now: Instant, bytes: usize) {
        self.max_part = self.max_part.max(bytes);
        if let Some(slot) = self.sent.get_mut(i) {
            *slot = Some(Sent {
                at: now,
                bytes: bytes as u64,
                acked_before: self.acked,
                acked_at: self.last_ack.unwrap_or(now),
            });
        }
    }

    /// Part `i`'s reply arrived at `now`: update the estimates and the window.
    pub(crate) fn on_ack(&mut self, i: usize, now: Instant) {
        let Some(sent) = self.sent.get_mut(i).and_then(Option::take) else {
            return;
        };
        self.acked += sent.bytes;
        self.last_ack = Some(now);
        let rtt = now.saturating_duration_since(sent.at);
        self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
        let interval = now.saturating_duration_since(sent.acked_at).as_secs_f64();
        if interval > 0.0 {
            let rate = (self.acked - sent.acked_before) as f64 / interval;
            self.max_rate = self.max_rate.max(rate);
        }
        let rtt = self.min_rtt.unwrap_or_default();
        self.window = window_parts(self.max_rate, rtt, self.max_part, self.floor, self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The window stays within its bounds and, where the cap allows, covers the
        /// bandwidth-delay product: `window · part ≥ rate · rtt`.
        #[test]
        fn window_covers_the_bdp_within_bounds(
            rate in 0.0f64..1e10,
            rtt_us in 0u64..10_000_000,
            part in 1usize..(64 << 20),
            floor in 0usize..64,
            cap in 0usize..256,
        ) {
            let rtt = Duration::from_micros(rtt_us);
            let w = window_parts(rate, rtt, part, floor, cap);
            prop_assert!(w >= 1);
            prop_assert!(w <= cap.max(1));
            prop_assert!(w >= floor.clamp(1, cap.max(1)));
            let bdp = rate * rtt.as_secs_f64();
            if w < cap.max(1) {
                prop_assert!(w as f64 * part as f64 >= bdp * (1.0 - 1e-9),
                    "window {w} × {part} below the bdp {bdp}");
            }
        }

        /// More rate or a longer round trip never shrinks the window.
        #[test]
        fn window_is_monotone(
            rate in 0.0f64..1e10,
            more in 0.0f64..1e10,
            rtt_us in 0u64..10_000_000,
            longer in 0u64..10_000_000,
            part in 1usize..(64 << 20),
            cap in 1usize..256,
        ) {
            let rtt = Duration::from_micros(rtt_us);
            let w = window_parts(rate, rtt, part, 1, cap);
            prop_assert!(window_parts(rate + more, rtt, part, 1, cap) >= w);
            prop_assert!(window_parts(rate, rtt + Duration::from_micros(longer), part, 1, cap) >= w);
        }
    }

    #[test]
    fn no_estimate_is_the_floor() {
        assert_eq!(window_parts(0.0, Duration::from_secs(1), 1 << 19, 4, 16), 4);
        assert_eq!(
            window_parts(f64::NAN, Duration::from_secs(1), 1 << 19, 4, 16),
            4
        );
        assert_eq!(
            window_parts(f64::INFINITY, Duration::from_secs(1), 1 << 19, 4, 16),
            4
        );
        assert_eq!(window_parts(1e9, Duration::from_secs(1), 0, 4, 16), 4);
        assert_eq!(window_parts(1e30, Duration::from_secs(1000), 1, 4, 16), 16);
    }

    /// A link acknowledging 12.5 MB/s (100 Mbit/s) with a 200 ms round trip and 512 KiB
    /// parts grows from 4 to cover twice its 2.5 MB product (10 parts).
    #[test]
    fn a_long_fat_link_grows_its_window() {
        let t0 = Instant::now();
        let part = 1usize << 19;
        let mut w = LinkWindow::new(64, 4, 16);
        assert_eq!(w.window(), 4);
        let gap = Duration::from_secs_f64(part as f64 / 12.5e6);
        let rtt = Duration::from_millis(200);
        // Steady state: one part out and one reply in every `gap`.
        for i in 0..32 {
            w.on_send(i, t0 + gap * i as u32, part);
            if i >= 5 {
                let j = i - 5;
                w.on_ack(j, t0 + gap * j as u32 + rtt);
            }
        }
        let bdp = 12.5e6 * rtt.as_secs_f64();
        let expected = (WINDOW_GAIN * bdp / part as f64).ceil() as usize;
        assert!(w.window() > 4, "window {}", w.window());
        assert!(w.window() <= 16);
        assert!(
            w.window() >= expected.min(16) - 1,
            "window {} vs {expected}",
            w.window()
        );
    }
}
