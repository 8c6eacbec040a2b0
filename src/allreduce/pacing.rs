//! Pacing the flows between nodes and clients at the plan's rates (issue 32, items 1-2).
//!
//! # Why
//!
//! In a group with clients, the clients reach only the nodes, so the nodes' lines carry more
//! than in a group of nodes: with two public reducers and two clients (the bench's
//! `symmetric` scenario) each reducer's downlink carries the two clients' parts of its span
//! (half a tensor each) and the other reducer's parts and averages (a tensor), and its uplink
//! the mirror image. The plan needs the reducer↔reducer flow at half of each line and each
//! client flow at a quarter. TCP shares a bottleneck per flow: each of the three flows gets a
//! third, so the clients' parts come in early, the reducers' exchange lags, their reductions
//! wait on it, and the round ends in a long tail of reducer-to-reducer traffic (61 % of the
//! bound, measured; see docs/architecture.md, "WAN efficiency").
//!
//! # What
//!
//! Every flow between a node and a client is paced at the rate the plan gives it, with
//! headroom: a client's parts to reducer `r` at `k · f_r / t` and a node's averages to each
//! client at `k · f_me / t` bytes per second, where `f` are the reducers' shares, `t` the
//! plan's level (seconds per byte of tensor: the slowest member's time under the traffic
//! model of [`crate::matchmaking::rate_shares`], from the members' declared measured rates)
//! and `k` = [`PACE_HEADROOM`]. A flow paced like that carries its bytes in `t / k` of the
//! planned step, and the flows between nodes, unpaced, take what the client flows leave.
//! Nothing is paced when any member's rates are unknown, or in a group without clients.
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
//! round measured low (before pacing, the reducers' lines were not busy all round) would keep
//! every later round slow. With `k > 1` a round limited by its pacing finishes sooner than
//! the plan said, its measured rates rise, and the next plan paces faster, until the line,
//! not the pacing, is the limit. Too much headroom gives the client flows more than their
//! share again. Measured on the bed (`cargo bench --bench nat -- --scenario symmetric
//! --rounds 10`, bound 2.68 s): `k` = 1.1 reached 3.06-3.09 s per step but only from round 8
//! on; 1.15 was at 3.1-3.3 s from round 4; 1.25 3.2-3.4 s; 1.4 3.3-3.5 s; unpaced 4.4 s.

use std::time::{Duration, Instant};

use super::{LinkRates, Member, Mode};

/// How much faster than the plan's rate a paced flow may go (module docs).
pub const PACE_HEADROOM: f64 = 1.15;

/// A paced frame is written in slices of this many bytes, each at its time.
pub const PACE_SLICE_BYTES: usize = 16 << 10;

/// Per member (in group order), the rate in bytes per second at which this peer (`me`) sends
/// its parts and averages to it, or `None` (unpaced): see the module docs. `members` and
/// `rates` are the round's (every member must use the same values); `me` must index
/// `members`.
pub fn link_paces(members: &[Member], rates: &[LinkRates], me: usize) -> Vec<Option<f64>> {
    let unpaced = vec![None; members.len()];
    let has_client = members.iter().any(|m| m.mode == Mode::Client);
    let Some(level) = has_client.then(|| plan_level(members, rates)).flatten() else {
        return unpaced;
    };
    let shares = shares(members);
    let Some(&mine) = members.get(me) else {
        return unpaced;
    };
    members
        .iter()
        .enumerate()
        .map(|(i, other)| {
            // Bytes per byte of tensor on the flow from me to member i.
            let flow = match (mine.mode, other.mode) {
                _ if i == me => 0.0,
                // A client's parts of i's span.
                (Mode::Client, Mode::Node | Mode::Aux) => shares[i],
                // The averages of my span for a client.
                (Mode::Node | Mode::Aux, Mode::Client) => shares[me],
                _ => 0.0,
            };
            (flow > 0.0).then(|| PACE_HEADROOM * flow / level)
        })
        .collect()
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

/// The plan's level: the slowest member's time per byte of tensor, each direction of each
/// line carrying `s·(1 − f) + (S − s)·f` tensors (`s` = 1 for a sender, `S` senders, share
/// `f`), at its declared measured rate. `None` if a rate is unknown or nothing is carried.
pub fn plan_level(members: &[Member], rates: &[LinkRates]) -> Option<f64> {
    if rates.len() < members.len() {
        return None;
    }
    let shares = shares(members);
    let senders = members.iter().filter(|m| m.mode.is_sender()).count() as f64;
    let mut level: f64 = 0.0;
    for ((m, f), r) in members.iter().zip(&shares).zip(rates) {
        let (up, down) = (r.up()?, r.down()?);
        let s = if m.mode.is_sender() { 1.0 } else { 0.0 };
        let load = s * (1.0 - f) + (senders - s) * f;
        level = level.max(load / up).max(load / down);
    }
    (level.is_finite() && level > 0.0).then_some(level)
}

/// When the slices of a paced flow may be written (sans-IO: the caller sleeps until the
/// instant [`Pacer::reserve`] returns, then writes the slice).
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

    /// The instant at which `bytes` more may be written, at or after `now`, and takes them:
    /// slices follow each other at the rate, and a flow that was idle starts again at once
    /// without a burst of saved-up credit.
    pub fn reserve(&mut self, now: Instant, bytes: usize) -> Instant {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return now;
        }
        let at = self.next.map_or(now, |next| next.max(now));
        self.next = Some(at + Duration::from_secs_f64(bytes as f64 / self.rate));
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn two_reducers_pace_two_clients_at_a_quarter_of_the_line() {
        // The bench's symmetric scenario: reducers carry 2 tensors each way, the plan's level
        // is 2 / line, and every client flow carries half a tensor: a quarter of the line.
        let members = vec![
            member(Mode::Node, 1.0),
            member(Mode::Node, 1.0),
            member(Mode::Client, 0.0),
            member(Mode::Client, 0.0),
        ];
        let rates = vec![line(100.0); 4];
        let quarter = PACE_HEADROOM * 100e6 / 8.0 / 4.0;
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6 * b);
        // A client paces its parts to both reducers, and sends nothing to the other client.
        let client = link_paces(&members, &rates, 2);
        assert!(
            close(client[0], quarter) && close(client[1], quarter),
            "{client:?}"
        );
        assert_eq!(client[2..], [None, None]);
        // A reducer paces its averages to the clients, not its flow to the other reducer.
        let node = link_paces(&members, &rates, 0);
        assert_eq!(node[..2], [None, None]);
        assert!(
            close(node[2], quarter) && close(node[3], quarter),
            "{node:?}"
        );
    }

    #[test]
    fn nothing_is_paced_without_clients_or_with_an_unknown_rate() {
        let nodes = vec![member(Mode::Node, 1.0); 4];
        let rates = vec![line(100.0); 4];
        assert!(link_paces(&nodes, &rates, 0).iter().all(Option::is_none));
        let mut with_client = nodes.clone();
        with_client[3] = member(Mode::Client, 0.0);
        assert!(
            link_paces(&with_client, &rates, 3)
                .iter()
                .any(Option::is_some)
        );
        let mut unknown = rates.clone();
        unknown[1].down = 0.0;
        assert!(
            link_paces(&with_client, &unknown, 3)
                .iter()
                .all(Option::is_none)
        );
        // Fewer rates than members (an older peer declared none): unknown.
        assert!(
            link_paces(&with_client, &rates[..3], 3)
                .iter()
                .all(Option::is_none)
        );
    }

    #[test]
    fn a_pacer_spaces_slices_at_its_rate_without_saving_credit() {
        let t0 = Instant::now();
        let mut p = Pacer::new(1000.0); // bytes per second
        assert_eq!(p.reserve(t0, 500), t0);
        assert_eq!(p.reserve(t0, 500), t0 + Duration::from_millis(500));
        assert_eq!(p.reserve(t0, 100), t0 + Duration::from_millis(1000));
        // Idle for a while: the next slice goes at once, the one after it at the rate again.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(p.reserve(later, 1000), later);
        assert_eq!(p.reserve(later, 1), later + Duration::from_secs(1));
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
        /// Every paced flow carries its planned bytes in `level / k` of the step, and the paced
        /// flows through any member's line never add up to more than `k ×` its rate.
        #[test]
        fn paced_flows_fit_the_plan((members, rates) in group()) {
            prop_assume!(members.iter().any(|m| m.mode.is_reducer()));
            prop_assume!(members.iter().any(|m| m.mode.is_sender()));
            let n = members.len();
            let shares = shares(&members);
            let Some(level) = plan_level(&members, &rates) else {
                // Only where some member carries nothing at all.
                return Ok(());
            };
            let mut down = vec![0.0; n];
            for me in 0..n {
                let paces = link_paces(&members, &rates, me);
                let mut up = 0.0;
                for (i, pace) in paces.iter().enumerate() {
                    let Some(pace) = *pace else { continue };
                    prop_assert!(pace > 0.0 && pace.is_finite());
                    // Only flows between a client and a node or aux peer, never to oneself.
                    prop_assert!(i != me);
                    prop_assert!((members[me].mode == Mode::Client) != (members[i].mode == Mode::Client));
                    let bytes = if members[me].mode == Mode::Client { shares[i] } else { shares[me] };
                    prop_assert!((bytes / pace - level / PACE_HEADROOM).abs() <= 1e-9 * level);
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
