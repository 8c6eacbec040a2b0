//! Pacing every flow of a round at the plan's rate (issue 32, items 1-2).
//!
//! # Why
//!
//! TCP shares a bottleneck per flow, and the plan does not. In a group with clients, the
//! clients reach only the nodes, so the nodes' lines carry more: with two public reducers and
//! two clients (the bench's `symmetric` scenario) each reducer's downlink carries the two
//! clients' parts of its span (half a tensor each) and the other reducer's parts and averages
//! (a tensor), and its uplink the mirror image. The plan needs the reducer↔reducer flow at
//! half of each line and each client flow at a quarter; per-flow fairness gave each a third,
//! the clients' parts came early, the reducers' exchange lagged, their reductions waited on it,
//! and the round ended in a long tail of reducer-to-reducer traffic (61 % of the bound). In
//! groups of nodes alone the flows need equal shares, but unpaced they arrive in bursts that
//! fill the lines' queues and delay the averages that windows wait on; paced, the same
//! rounds ran 8-14 points of their bound faster on the bed (docs/architecture.md, "WAN
//! efficiency").
//!
//! # What
//!
//! The flow from member `a` to member `b` carries `s_a · f_b + s_b · f_a` tensors per round
//! (`a`'s parts of `b`'s span if `a` sends, the averages of `a`'s span for `b` if `b` sends;
//! `f` the reducers' shares, `s` = 1 for a sender) and is paced at `k ·` that `/ t` bytes per
//! second, where `t` is the time per byte of tensor of the slower of the two lines the flow
//! crosses (`a`'s uplink, `b`'s downlink), each carrying its load under the traffic model of
//! [`crate::matchmaking::rate_shares`] at its member's declared measured rates, and `k` =
//! [`PACE_HEADROOM`]. Summed over a member's flows, its lines are never paced above `k ×` its
//! measured rates. Only the two ends' rates count: a member that declares a tiny rate (the
//! rates come from the DHT, and may lie) slows the flows to and from itself, which it could
//! slow anyway by reading slowly, and no flow between two others. (The plan's level, the
//! slowest line of the group, paced every flow in a first version: measured on the bed with
//! that rule, below; equal lines give the same paces either way.) Nothing is paced while any
//! member's rates are unknown (before its first measured round).
//!
//! Pacing is smooth, not per frame: the writer releases a frame in slices of
//! [`PACE_SLICE_BYTES`], each at its time ([`Pacer`]); a whole 512 KiB part written at the
//! line's rate and then a pause made bursts that filled the reducers' queues and slowed the
//! other flows (measured: 3.5-3.7 s against 3.1 s per step with slices).
//!
//! # The headroom
//!
//! Measured rates are *achieved* rates, a little under what the line can do. Pacing at exactly
//! `f / t` would make the next round's measurement no better than this one's, and a first
//! round measured low (unpaced, the lines were not busy all round) would keep every later
//! round slow. With `k > 1` a round limited by its pacing finishes sooner than the plan said,
//! its measured rates rise, and the next plan paces faster, until the line, not the pacing, is
//! the limit. Measured on the bed (`cargo bench --bench nat -- --scenario S --rounds 8`, one
//! run each), when a round's rates were measured over the union of its transfers and a paced
//! write counted only while it ran: `k` = 1.05 gave 4 public peers 2.17 s (bound 2.01 s) but
//! left two symmetric-NAT clients at 4.0 s (bound 2.68 s, unpaced 4.4 s): their estimates
//! never rose; 1.1: 2.23 s and 3.45 s, still falling at round 8; 1.15: 2.26 s and 3.35 s, with
//! rounds 7-8 at 2.9-3.2 s. Those measurements read about 0.87 of the paces, so 1.15 paced
//! about at the lines. Since session 40 they read the lines (`runner::traffic`: rates where
//! the most flows moved, a paced slice over its time in the schedule, writes that return when
//! the bytes leave), and 1.15 overdrove them: 3.38-3.43 s for the clients' scenario and
//! 2.36-2.43 s for the public one, against 3.22 s and 2.28 s at 1.05 (one run each).

use std::time::{Duration, Instant};

use super::{LinkRates, Member};

/// How much faster than the plan's rate a paced flow may go (module docs).
pub const PACE_HEADROOM: f64 = 1.05;

/// A paced frame is written in slices of this many bytes, each at its time.
pub const PACE_SLICE_BYTES: usize = 16 << 10;

/// Per member (in group order), the rate in bytes per second at which this peer (`me`) sends
/// its parts and averages to it, or `None` (unpaced: nothing to send, or a rate unknown): see
/// the module docs. `members` and `rates` are the round's; `me` indexes `members`.
pub fn link_paces(members: &[Member], rates: &[LinkRates], me: usize) -> Vec<Option<f64>> {
    match Plan::new(members, rates) {
        Some(plan) if me < members.len() => (0..members.len()).map(|i| plan.pace(me, i)).collect(),
        _ => vec![None; members.len()],
    }
}

/// The sums of the paces of `me`'s flows in each direction: out of it (its own
/// [`link_paces`]) and into it (what every other member paces its flow to `me` at), or `None`
/// for a direction with no paced flow. What a paced round's measured rates can reach; see
/// [`crate::runner::traffic::smooth`].
pub fn paced_totals(members: &[Member], rates: &[LinkRates], me: usize) -> LinkTotals {
    match Plan::new(members, rates) {
        Some(plan) if me < members.len() => {
            let total =
                |paces: &mut dyn Iterator<Item = Option<f64>>| paces.flatten().reduce(|a, b| a + b);
            let n = members.len();
            LinkTotals {
                up: total(&mut (0..n).map(|i| plan.pace(me, i))),
                down: total(&mut (0..n).map(|i| plan.pace(i, me))),
            }
        }
        _ => LinkTotals::default(),
    }
}

/// What [`paced_totals`] returns: bytes per second per direction, `None` where unpaced.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkTotals {
    /// The sum of the paces of the flows this member sends.
    pub up: Option<f64>,
    /// The sum of the paces of the flows this member receives.
    pub down: Option<f64>,
}

/// A round's traffic as pacing sees it, computed once per round.
struct Plan {
    /// Per member, its reducer share (summing to 1 over the members that reduce).
    shares: Vec<f64>,
    /// Per member, whether it sends.
    sends: Vec<bool>,
    /// Per member, the time per byte of tensor its uplink and its downlink need for their
    /// loads ([`super::line_load`]) at its declared measured rates.
    times: Vec<(f64, f64)>,
}

impl Plan {
    /// `None` if a member's rate is unknown.
    fn new(members: &[Member], rates: &[LinkRates]) -> Option<Self> {
        if rates.len() < members.len() {
            return None;
        }
        let shares = shares(members);
        let sends: Vec<bool> = members.iter().map(|m| m.mode.is_sender()).collect();
        let senders = sends.iter().filter(|&&s| s).count();
        let times = sends
            .iter()
            .zip(&shares)
            .zip(rates)
            .map(|((&s, &f), r)| {
                let load = super::line_load(s, senders, f);
                Some((load / r.up()?, load / r.down()?))
            })
            .collect::<Option<_>>()?;
        Some(Self {
            shares,
            sends,
            times,
        })
    }

    /// The pace of the flow from member `a` to member `b`, `None` where it carries nothing.
    fn pace(&self, a: usize, b: usize) -> Option<f64> {
        if a == b {
            return None;
        }
        // Tensors per round from a to b: a's parts of b's span (if a sends), the averages of
        // a's span for b (if b sends).
        let s = |i: usize| if self.sends[i] { 1.0 } else { 0.0 };
        let flow = s(a) * self.shares[b] + s(b) * self.shares[a];
        // The slower of the two lines it crosses: a's uplink, b's downlink.
        let level = self.times[a].0.max(self.times[b].1);
        (flow > 0.0 && level > 0.0).then(|| PACE_HEADROOM * flow / level)
    }
}

/// Reducer shares (summing to 1 over the members that reduce), or all zero if none does.
fn shares(members: &[Member]) -> Vec<f64> {
    let raw: Vec<f64> = members
        .iter()
        .map(|m| {
            if m.mode.is_reducer() && m.fraction.is_finite() && m.fraction > 0.0 {
                m.fraction
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = raw.iter().sum();
    if total > 0.0 {
        raw.iter().map(|f| f / total).collect()
    } else {
        raw
    }
}

/// How far behind its schedule a paced flow may be and still catch up: a writer's timer wakes
/// it up to a millisecond late (tokio's resolution), and a flow whose slices are due every few
/// milliseconds, or faster than that, would otherwise lose that much every slice.
pub const PACE_SLACK: Duration = Duration::from_millis(2);

/// The longest one slice's time may be, however slow its rate: a rate that a member's absurd
/// declaration made tiny (the rates come from the DHT) would otherwise overflow the
/// arithmetic. The writer's frame timeout ends such a flow long before
/// (`runner::write_frame_paced`).
pub const MAX_SLICE_TIME: Duration = Duration::from_secs(24 * 60 * 60);

/// When the slices of a paced flow may be written (sans-IO: the caller waits until the instant
/// [`Pacer::reserve`] returns, if it is later than now, then writes the slice).
#[derive(Clone, Debug)]
pub struct Pacer {
    rate: f64,
    next: Option<Instant>,
}

impl Pacer {
    /// A pacer for `rate` bytes per second (positive and finite; else nothing is paced).
    pub fn new(rate: f64) -> Self {
        Self { rate, next: None }
    }

    /// The instant at which `bytes` more may be written, and takes them: slices follow each
    /// other at the rate. A flow up to [`PACE_SLACK`] behind its schedule (a late wake-up)
    /// catches up; one idle for longer keeps no more credit than that slack.
    pub fn reserve(&mut self, now: Instant, bytes: usize) -> Instant {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return now;
        }
        let earliest = now.checked_sub(PACE_SLACK).unwrap_or(now);
        let at = self.next.map_or(now, |next| next.max(earliest));
        let time = Duration::try_from_secs_f64(bytes as f64 / self.rate).unwrap_or(MAX_SLICE_TIME);
        self.next = Some(at + time.min(MAX_SLICE_TIME));
        at
    }

    /// The end of the last reserved slice's time: when the flow is due to have sent what it
    /// reserved (`None` before the first reservation, or if nothing is paced).
    pub fn scheduled_until(&self) -> Option<Instant> {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::Mode;
    use proptest::prelude::*;

    fn member(mode: Mode, fraction: f64) -> Member {
        Member { mode, fraction }
    }

    fn line(mbit: f64) -> LinkRates {
        LinkRates {
            up: mbit * 1e6 / 8.0,
            down: mbit * 1e6 / 8.0,
        }
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-6 * b)
    }

    /// The bench's symmetric scenario: two public reducers, two clients.
    fn two_nodes_two_clients() -> Vec<Member> {
        vec![
            member(Mode::Node, 1.0),
            member(Mode::Node, 1.0),
            member(Mode::Client, 0.0),
            member(Mode::Client, 0.0),
        ]
    }

    #[test]
    fn two_reducers_and_two_clients_pace_at_their_planned_shares_of_the_line() {
        // The bench's symmetric scenario: reducers carry 2 tensors each way, the plan's level
        // is 2 / line; a client flow carries half a tensor (a quarter of the line), the
        // reducer↔reducer flow a tensor (half of it).
        let members = two_nodes_two_clients();
        let rates = vec![line(100.0); 4];
        let quarter = PACE_HEADROOM * 100e6 / 8.0 / 4.0;
        // A client paces its parts to both reducers and sends nothing to the other client.
        let client = link_paces(&members, &rates, 2);
        assert!(
            close(client[0], quarter) && close(client[1], quarter),
            "{client:?}"
        );
        assert_eq!(client[2..], [None, None]);
        // A reducer paces its averages to the clients at a quarter, its flow to the other
        // reducer at half of the line.
        let node = link_paces(&members, &rates, 0);
        assert_eq!(node[0], None);
        assert!(close(node[1], 2.0 * quarter), "{node:?}");
        assert!(
            close(node[2], quarter) && close(node[3], quarter),
            "{node:?}"
        );
    }

    #[test]
    fn paced_totals_sum_the_flows_out_of_and_into_a_member() {
        let members = two_nodes_two_clients();
        let rates = vec![line(100.0); 4];
        let full = PACE_HEADROOM * 100e6 / 8.0;
        // A reducer's line carries its planned load both ways: k times the line.
        let reducer = paced_totals(&members, &rates, 1);
        assert!(
            close(reducer.up, full) && close(reducer.down, full),
            "{reducer:?}"
        );
        // A client sends a quarter of the line to each reducer and gets as much back.
        let client = paced_totals(&members, &rates, 3);
        assert!(
            close(client.up, full / 2.0) && close(client.down, full / 2.0),
            "{client:?}"
        );
        // Four nodes, the last one's uplink at a quarter of the line: its flows out are paced
        // by its uplink, the flows into it by the others' (full) lines.
        let nodes = vec![member(Mode::Node, 1.0); 4];
        let mut slow_up = rates.clone();
        slow_up[3].up /= 4.0;
        let last = paced_totals(&nodes, &slow_up, 3);
        assert!(
            close(last.up, full / 4.0) && close(last.down, full),
            "{last:?}"
        );
        // Nothing paced: no totals.
        let mut unknown = rates.clone();
        unknown[0].up = 0.0;
        assert_eq!(paced_totals(&members, &unknown, 1), LinkTotals::default());
    }

    #[test]
    fn four_nodes_pace_each_flow_at_a_third_of_the_line_and_unknown_rates_pace_nothing() {
        // Four nodes with equal shares: each flow carries 1/4 + 1/4 of a tensor, each line
        // 1.5 tensors: a third of the line per flow.
        let nodes = vec![member(Mode::Node, 1.0); 4];
        let rates = vec![line(100.0); 4];
        let third = PACE_HEADROOM * 100e6 / 8.0 / 3.0;
        let paces = link_paces(&nodes, &rates, 1);
        assert_eq!(paces[1], None);
        for i in [0, 2, 3] {
            assert!(close(paces[i], third), "{paces:?}");
        }
        let mut unknown = rates.clone();
        unknown[2].down = 0.0;
        assert!(link_paces(&nodes, &unknown, 1).iter().all(Option::is_none));
        // Fewer rates than members (an older peer declared none): unknown.
        assert!(
            link_paces(&nodes, &rates[..3], 1)
                .iter()
                .all(Option::is_none)
        );
    }

    #[test]
    fn a_member_declaring_a_tiny_rate_slows_only_its_own_flows() {
        let nodes = vec![member(Mode::Node, 1.0); 4];
        let honest = vec![line(100.0); 4];
        let mut lying = honest.clone();
        lying[3] = LinkRates { up: 1.0, down: 1.0 }; // one byte per second
        for me in 0..3 {
            let (h, l) = (
                link_paces(&nodes, &honest, me),
                link_paces(&nodes, &lying, me),
            );
            // Flows between honest members keep their pace; the liar's own flows crawl.
            for i in 0..3 {
                assert_eq!(h[i], l[i], "{me} -> {i}");
            }
            assert!(l[3].unwrap() < 2.0, "{me} -> 3: {:?}", l[3]);
        }
    }

    #[test]
    fn a_pacer_spaces_slices_at_its_rate_and_saves_no_more_than_its_slack() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut p = Pacer::new(1000.0); // bytes per second
        assert_eq!(p.reserve(t0, 500), t0);
        assert_eq!(p.reserve(t0, 500), t0 + ms(500));
        assert_eq!(p.reserve(t0, 100), t0 + ms(1000));
        // Woken 1 ms late for the next slice (due at 1100 ms): it keeps its schedule.
        assert_eq!(p.reserve(t0 + ms(1101), 100), t0 + ms(1100));
        assert_eq!(p.reserve(t0 + ms(1101), 100), t0 + ms(1200));
        // Idle for a while: the next slice goes at once, and the one after it a slice's time
        // later, not at once on saved-up credit.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(p.reserve(later, 1000), later - PACE_SLACK);
        assert_eq!(
            p.reserve(later, 1),
            later - PACE_SLACK + Duration::from_secs(1)
        );
        // A rate so small that a slice's time overflows a Duration waits the cap, no panic.
        let mut crawl = Pacer::new(1e-300);
        assert_eq!(crawl.reserve(t0, PACE_SLICE_BYTES), t0);
        assert_eq!(crawl.reserve(t0, PACE_SLICE_BYTES), t0 + MAX_SLICE_TIME);
        // A rate that is not positive paces nothing.
        let mut off = Pacer::new(0.0);
        assert_eq!(off.reserve(t0, 1 << 20), t0);
        assert_eq!(off.reserve(t0, 1 << 20), t0);
    }

    fn group() -> impl Strategy<Value = (Vec<Member>, Vec<LinkRates>)> {
        prop::collection::vec((0u8..3, 0.1f64..4.0, 1e5f64..1e8, 1e5f64..1e8), 2..10).prop_map(
            |v| {
                v.into_iter()
                    .map(|(mode, f, up, down)| {
                        let mode = [Mode::Node, Mode::Client, Mode::Aux][mode as usize];
                        let f = if mode == Mode::Client { 0.0 } else { f };
                        (member(mode, f), LinkRates { up, down })
                    })
                    .unzip()
            },
        )
    }

    proptest! {
        /// Every flow is paced at `k ·` its planned bytes over the time of the slower line it
        /// crosses (never slower than the plan's level allows), only flows that carry
        /// something are paced, and the flows through any member's uplink and downlink never
        /// add up to more than `k ×` its measured rate.
        #[test]
        fn paced_flows_fit_the_plan((members, rates) in group()) {
            prop_assume!(members.iter().any(|m| m.mode.is_reducer()));
            prop_assume!(members.iter().any(|m| m.mode.is_sender()));
            let n = members.len();
            let shares = shares(&members);
            let s = |i: usize| if members[i].mode.is_sender() { 1.0 } else { 0.0 };
            let times = Plan::new(&members, &rates).unwrap().times;
            // The plan's level: the slowest line's time.
            let level = times.iter().fold(0.0, |l: f64, &(up, down)| l.max(up).max(down));
            if !(level.is_finite() && level > 0.0) {
                // Only where nobody carries anything.
                return Ok(());
            }
            let mut down = vec![0.0; n];
            for me in 0..n {
                let paces = link_paces(&members, &rates, me);
                let mut up = 0.0;
                for (i, pace) in paces.iter().enumerate() {
                    let bytes = if i == me { 0.0 } else { s(me) * shares[i] + s(i) * shares[me] };
                    let Some(pace) = *pace else {
                        prop_assert!(bytes == 0.0, "{me} -> {i}: {bytes} unpaced");
                        continue;
                    };
                    prop_assert!(pace > 0.0 && pace.is_finite());
                    let flow_level = times[me].0.max(times[i].1);
                    prop_assert!(flow_level <= level);
                    prop_assert!((bytes / pace - flow_level / PACE_HEADROOM).abs() <= 1e-9 * flow_level);
                    up += pace;
                    down[i] += pace;
                }
                prop_assert!(up <= PACE_HEADROOM * rates[me].up * (1.0 + 1e-9), "{up} up at {me}");
            }
            for i in 0..n {
                prop_assert!(down[i] <= PACE_HEADROOM * rates[i].down * (1.0 + 1e-9), "{} down at {i}", down[i]);
            }
        }
    }
}
