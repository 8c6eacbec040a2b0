//! Reducer shares from measured upload and download rates (issue 32, item 2).
//!
//! [`super::load_balancing`] follows hivemind: one advertised bandwidth per peer, and a model
//! that counts a peer's traffic in both directions together. On home lines the two directions
//! differ (100 Mbit/s down, 20 up) and a group with clients loads its reducers' *downlinks*
//! with every client's parts. Here each member has a measured upload `up_i` and download
//! `down_i` (bytes per second, from its past rounds), and the model counts each direction.
//!
//! # The model
//!
//! For a tensor of one unit (the time scales with its size), `S` senders, and member `i`
//! reducing a share `f_i` (`s_i` = 1 if it sends, else 0; clients and members that may not
//! reduce have `f_i = 0`):
//!
//! ```text
//! up_i   = s_i·(1 − f_i) + (S − s_i)·f_i      its parts to the other reducers, replies to its senders
//! down_i = (S − s_i)·f_i + s_i·(1 − f_i)      its senders' parts, the averages of its own parts
//! ```
//!
//! and the step takes at least `t = max_i max(up_i / up_rate_i, down_i / down_rate_i)`.
//! For a level `t` member `i` can take at most `cap_i(t)`, the largest `f ∈ [0, 1]` with both
//! loads within `t ×` its rates (both loads are `s_i + (S − 2 s_i)·f`: linear). The smallest
//! feasible level is the larger of the floor `max_i s_i / rate_i` (every sender's own parts)
//! and the level where `Σ cap_i(t) = 1` (found by bisection: the sum is monotone in `t`); the
//! shares are `cap_i(t)/Σ cap(t)` there, so no member is loaded past `t ×` its measured rates.
//! A member with an unknown (zero) rate reduces nothing and does not bound the level.
//!
//! # Noise
//!
//! Measured rates are noisy (a write that finds room in the socket's buffer returns at once;
//! queues fill and drain): on the `tbf` bed, four identical 100 Mbit/s lines measured a few
//! percent apart, and the exact shares above split a 32-part tensor 7/7/9/9 instead of 8 each,
//! so the busiest line carried 25 MiB where 24 would do and every step took that much longer.
//! [`planned_shares`], what groups use, keeps equal shares among the members that may reduce
//! unless the measured rates promise a step at least [`MIN_RATED_GAIN`] shorter with the exact
//! ones: a 4x slower line (a gain of a third) still gets its smaller share, a few percent of
//! measurement noise does not move any.

use super::load_balancing::LoadBalanceError;

/// One member as rate-based load balancing sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RatedPeer {
    /// Whether it contributes values (node or client).
    pub sender: bool,
    /// Whether it may reduce (a node every sender can reach).
    pub may_reduce: bool,
    /// Measured upload rate, bytes per second (0: unknown).
    pub up: f64,
    /// Measured download rate, bytes per second (0: unknown).
    pub down: f64,
}

/// Shares and the step time they give.
#[derive(Clone, Debug, PartialEq)]
pub struct RateShares {
    /// Per member, summing to 1.
    pub shares: Vec<f64>,
    /// Seconds per byte of tensor: the slowest member's time at these shares is at most this
    /// times the tensor's size.
    pub level: f64,
}

/// The load of member `p` (per unit of tensor) with share `f` among `senders` senders; the
/// same in each direction (module docs).
pub fn load(p: &RatedPeer, senders: usize, f: f64) -> f64 {
    crate::allreduce::line_load(p.sender, senders, f)
}

fn rate_ok(r: f64) -> bool {
    r.is_finite() && r > 0.0
}

/// The largest share `p` can take at level `t` (0 when it may not reduce or a rate is
/// unknown).
fn cap(p: &RatedPeer, senders: usize, t: f64) -> f64 {
    if !p.may_reduce || !rate_ok(p.up) || !rate_ok(p.down) {
        return 0.0;
    }
    let s = if p.sender { 1.0 } else { 0.0 };
    let slope = senders as f64 - 2.0 * s;
    let mut c: f64 = 1.0;
    for rate in [p.up, p.down] {
        if slope > 0.0 {
            c = c.min((t * rate - s) / slope);
        } else if s > t * rate {
            c = 0.0;
        }
    }
    c.clamp(0.0, 1.0)
}

/// How much shorter (as a fraction of the equal shares' step time) the step under
/// [`rate_shares`] must promise to be for [`planned_shares`] to use them.
pub const MIN_RATED_GAIN: f64 = 0.15;

/// The slowest member's time per unit of tensor at `shares` under the measured rates (unknown
/// rates bound nothing).
pub fn step_level(peers: &[RatedPeer], shares: &[f64]) -> f64 {
    let senders = peers.iter().filter(|p| p.sender).count();
    peers
        .iter()
        .zip(shares)
        .map(|(p, &f)| {
            let l = load(p, senders, f);
            [p.up, p.down]
                .into_iter()
                .filter(|&r| rate_ok(r))
                .map(|r| l / r)
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// The shares a group plans with (module docs, "Noise"): equal among the members that may
/// reduce with known rates, unless [`rate_shares`] promise a step more than
/// [`MIN_RATED_GAIN`] shorter; then those.
pub fn planned_shares(peers: &[RatedPeer]) -> Result<RateShares, LoadBalanceError> {
    let rated = rate_shares(peers)?;
    let able: Vec<bool> = peers
        .iter()
        .map(|p| p.may_reduce && rate_ok(p.up) && rate_ok(p.down))
        .collect();
    // At least one: `rate_shares` refuses a group where nobody can reduce.
    let n = able.iter().filter(|&&a| a).count().max(1) as f64;
    let equal: Vec<f64> = able
        .iter()
        .map(|&a| if a { 1.0 / n } else { 0.0 })
        .collect();
    let level = step_level(peers, &equal);
    if level <= rated.level * (1.0 + MIN_RATED_GAIN) {
        Ok(RateShares {
            shares: equal,
            level,
        })
    } else {
        Ok(rated)
    }
}

/// Shares minimising the slowest member's step time under measured rates (module docs).
pub fn rate_shares(peers: &[RatedPeer]) -> Result<RateShares, LoadBalanceError> {
    if peers.is_empty() {
        return Err(LoadBalanceError::NoPeers);
    }
    for p in peers {
        for r in [p.up, p.down] {
            if !r.is_finite() || r < 0.0 {
                return Err(LoadBalanceError::BadBandwidth(r));
            }
        }
    }
    let senders = peers.iter().filter(|p| p.sender).count();
    if !peers
        .iter()
        .any(|p| p.may_reduce && rate_ok(p.up) && rate_ok(p.down))
    {
        return Err(LoadBalanceError::AllZero);
    }
    // Floor: every sender's own parts out and averages back, at zero share.
    let floor = peers
        .iter()
        .filter(|p| p.sender)
        .flat_map(|p| [p.up, p.down])
        .filter(|&r| rate_ok(r))
        .map(|r| 1.0 / r)
        .fold(0.0, f64::max);
    let total = |t: f64| peers.iter().map(|p| cap(p, senders, t)).sum::<f64>();
    let mut lo = floor;
    let level = if total(lo) >= 1.0 {
        lo
    } else {
        let mut hi = if lo > 0.0 { lo * 2.0 } else { 1e-12 };
        while total(hi) < 1.0 {
            lo = hi;
            hi *= 2.0;
            if !hi.is_finite() {
                return Err(LoadBalanceError::AllZero);
            }
        }
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if mid <= lo || mid >= hi {
                break;
            }
            if total(mid) >= 1.0 {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    };
    let caps: Vec<f64> = peers.iter().map(|p| cap(p, senders, level)).collect();
    let sum: f64 = caps.iter().sum();
    Ok(RateShares {
        shares: caps.iter().map(|c| c / sum).collect(),
        level,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(up: f64, down: f64) -> RatedPeer {
        RatedPeer {
            sender: true,
            may_reduce: true,
            up,
            down,
        }
    }

    fn client(up: f64, down: f64) -> RatedPeer {
        RatedPeer {
            may_reduce: false,
            ..node(up, down)
        }
    }

    use super::step_level as step_time;

    #[test]
    fn equal_lines_share_equally() {
        let r = rate_shares(&[node(1e6, 1e6); 4]).unwrap();
        for s in &r.shares {
            assert!((s - 0.25).abs() < 1e-9, "{:?}", r.shares);
        }
        // 1.5 tensors per line: (1 − 1/4) out + 3 · 1/4 replies.
        assert!((r.level * 1e6 - 1.5).abs() < 1e-6, "{}", r.level * 1e6);
    }

    /// Two public reducers and two clients on equal lines: each reducer's downlink carries
    /// three senders' halves, its uplink the replies plus its own half: 2 tensors, the
    /// bench's bound for that scenario.
    #[test]
    fn clients_load_the_reducers_downlinks() {
        let peers = [
            node(1e6, 1e6),
            node(1e6, 1e6),
            client(1e6, 1e6),
            client(1e6, 1e6),
        ];
        let r = rate_shares(&peers).unwrap();
        assert_eq!(r.shares[2], 0.0);
        assert_eq!(r.shares[3], 0.0);
        assert!((r.shares[0] - 0.5).abs() < 1e-9);
        assert!((r.level * 1e6 - 2.0).abs() < 1e-6, "{}", r.level * 1e6);
    }

    /// A member with a 4x slower uplink gets a smaller share than the others.
    #[test]
    fn a_slow_uplink_reduces_less() {
        let peers = [
            node(1e6, 1e6),
            node(1e6, 1e6),
            node(1e6, 1e6),
            node(0.25e6, 1e6),
        ];
        let r = rate_shares(&peers).unwrap();
        assert!(r.shares[3] < r.shares[0] / 2.0, "{:?}", r.shares);
    }

    /// Four equal lines measured a few percent apart (the `tbf` bed's noise): exact shares
    /// would split them unevenly (7/9 of 32 parts); the plan keeps them equal.
    #[test]
    fn measurement_noise_keeps_equal_shares() {
        let peers = [
            node(1.0e6, 1.0e6),
            node(1.09e6, 1.04e6),
            node(0.95e6, 1.0e6),
            node(1.06e6, 0.97e6),
        ];
        let exact = rate_shares(&peers).unwrap();
        assert!(
            exact.shares.iter().any(|s| (s - 0.25).abs() > 0.01),
            "{:?}",
            exact.shares
        );
        let planned = planned_shares(&peers).unwrap();
        assert_eq!(planned.shares, vec![0.25; 4]);
        assert!((planned.level - step_time(&peers, &planned.shares)).abs() < 1e-15);
        // A client stays out of the equal split.
        let with_client = [peers[0], peers[1], client(1e6, 1e6), peers[3]];
        let planned = planned_shares(&with_client).unwrap();
        assert_eq!(planned.shares[2], 0.0);
        assert!(
            (planned.shares[0] - 1.0 / 3.0).abs() < 1e-12,
            "{:?}",
            planned.shares
        );
    }

    /// A 4x slower uplink is a real difference: the plan takes the exact shares.
    #[test]
    fn a_slow_line_still_gets_a_smaller_planned_share() {
        let peers = [
            node(1e6, 1e6),
            node(1e6, 1e6),
            node(1e6, 1e6),
            node(0.25e6, 1e6),
        ];
        let planned = planned_shares(&peers).unwrap();
        assert_eq!(planned, rate_shares(&peers).unwrap());
        assert!(
            planned.shares[3] < planned.shares[0] / 2.0,
            "{:?}",
            planned.shares
        );
    }

    fn peer_strategy() -> impl Strategy<Value = RatedPeer> {
        let rate = prop_oneof![1 => Just(0.0), 8 => 1e3f64..1e9];
        (any::<bool>(), any::<bool>(), rate.clone(), rate).prop_map(
            |(client, may_reduce, up, down)| RatedPeer {
                sender: true,
                may_reduce: may_reduce && !client,
                up,
                down,
            },
        )
    }

    proptest! {
        /// Shares sum to the whole, nobody who may not reduce gets any, no member is loaded
        /// past its measured rates at the level, and the level is the best: a slightly lower
        /// one cannot carry the whole tensor.
        #[test]
        fn shares_sum_to_one_within_capacity(peers in proptest::collection::vec(peer_strategy(), 1..12)) {
            let Ok(r) = rate_shares(&peers) else {
                prop_assert!(!peers.iter().any(|p| p.may_reduce && p.up > 0.0 && p.down > 0.0));
                return Ok(());
            };
            let sum: f64 = r.shares.iter().sum();
            prop_assert!((sum - 1.0).abs() < 1e-9, "sum {sum}");
            let senders = peers.iter().filter(|p| p.sender).count();
            for (p, &f) in peers.iter().zip(&r.shares) {
                prop_assert!(f >= 0.0);
                if !p.may_reduce || p.up == 0.0 || p.down == 0.0 {
                    prop_assert_eq!(f, 0.0);
                    continue;
                }
                let (u, d) = (load(p, senders, f), load(p, senders, f));
                prop_assert!(u <= r.level * p.up * (1.0 + 1e-9), "up {u} over {}", r.level * p.up);
                prop_assert!(d <= r.level * p.down * (1.0 + 1e-9), "down {d} over {}", r.level * p.down);
            }
            prop_assert!(step_time(&peers, &r.shares) <= r.level * (1.0 + 1e-9));
            let lower = r.level * (1.0 - 1e-6);
            let carried: f64 = peers.iter().map(|p| cap(p, senders, lower)).sum();
            let floor_binds = peers.iter().any(|p| p.sender && [p.up, p.down].iter().any(|&x| rate_ok(x) && 1.0 / x > lower));
            prop_assert!(carried < 1.0 || floor_binds, "level {} not minimal", r.level);

            // The plan: shares sum to the whole, nobody who may not reduce gets any, its level
            // bounds its step time and is within the allowed gain of the best.
            let plan = planned_shares(&peers).unwrap();
            let sum: f64 = plan.shares.iter().sum();
            prop_assert!((sum - 1.0).abs() < 1e-9, "planned sum {sum}");
            for (p, &f) in peers.iter().zip(&plan.shares) {
                if !p.may_reduce || p.up == 0.0 || p.down == 0.0 {
                    prop_assert_eq!(f, 0.0);
                }
            }
            prop_assert!(step_time(&peers, &plan.shares) <= plan.level * (1.0 + 1e-9));
            prop_assert!(plan.level <= r.level * (1.0 + MIN_RATED_GAIN) * (1.0 + 1e-9));
        }
    }
}
