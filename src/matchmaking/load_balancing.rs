//! Who reduces how much: peer shares from advertised bandwidths (hivemind's
//! `load_balance_peers`, with its linear program solved in closed form).
//!
//! # The model
//!
//! In a butterfly all-reduce over `N` peers where peer `i` reduces a share `w_i` of a vector of
//! `T` elements, peer `i` moves `T(1 + (N − 2)·w_i)` elements in total (as a sender `T(1 − w_i)`
//! out and back, as a reducer `(N − 1)·T·w_i` in and out). hivemind minimises the slowest
//! peer's time `ξ = max_i (1 + (N − 2)·w_i) / b_i` over peers with bandwidth `b_i > 0`, subject
//! to `w ≥ 0`, `Σ w = 1`, `w_i ≤ 1`, and `w_i = 0` where `b_i = 0`, with SciPy's (deprecated)
//! interior-point LP solver.
//!
//! # Closed form
//!
//! For `N ≥ 3` the constraints on peer `i` at a level `ξ` are `0 ≤ w_i ≤ u_i(ξ) = clamp((ξ·b_i −
//! 1)/(N − 2), 0, 1)`, so `ξ` is feasible iff `ξ ≥ 1/b_i` for every `b_i > 0` (the slowest peer's
//! own traffic is a floor) and `Σ u_i(ξ) ≥ 1` (water filling). The optimum is the larger of the
//! two: `ξ* = max(max_i 1/b_i, ξ_wf)` with `Σ u_i(ξ_wf) = 1` (found by bisection; the sum is
//! monotone). At `ξ*` any `0 ≤ w ≤ u, Σ w = 1` is optimal; we take `w = u/Σu` (unique when the
//! water-filling level binds, and otherwise the central choice, which matches every exact
//! assertion of hivemind's tests). `N = 2`: the traffic does not depend on `w` (coefficient
//! `N − 2 = 0`), so the peers with `b > 0` share equally (the LP's central point); `N = 1`: the
//! single peer takes everything.
//!
//! Then, as in hivemind: shares below `min_size / T` are zeroed if the largest share is at
//! least that, and element counts are apportioned with Hagenbach-Bischoff (floor, then one
//! element at a time to the largest `w_i / (count_i + 1)`, first index on ties). Bandwidth
//! `None` counts as the mean of the specified positive bandwidths; if none is specified
//! (every peer `None` or `0`), the `None` peers share equally; all zero is an error. Clients
//! reduce nothing: [`group_fractions`] gives them zero whatever they advertise, and so does it
//! to members that some sender of the group cannot connect to ([`crate::reach::reducers`]:
//! e.g. a member behind a NAT that another member's NAT keeps it from hole punching to).

use super::rate_shares::{RatedPeer, planned_shares};
use super::{Group, Mode};
use crate::allreduce::Member;

/// Why shares cannot be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadBalanceError {
    /// No peers.
    #[error("no peers to balance")]
    NoPeers,
    /// A bandwidth is negative, NaN or infinite.
    #[error("bandwidth {0} is not a finite non-negative number")]
    BadBandwidth(f64),
    /// Every peer has bandwidth zero (or is a client): nobody can reduce.
    #[error("every peer has zero bandwidth")]
    AllZero,
    /// Some member could reduce, but none of those can be reached by every member that sends
    /// data (they are behind NATs that keep each other out, and relaying tensor data is not
    /// allowed): the group cannot average.
    #[error(
        "no member that may reduce can be reached by every other member (NATs keep them apart; \
         a public peer in the group, or allowing tensor data over relays, would help)"
    )]
    Unreachable,
}

/// The optimal continuous shares `w` (non-negative, summing to 1) for `bandwidths` (see the
/// [module docs](self)); `None` = the mean of the specified positive bandwidths.
pub fn optimal_shares(bandwidths: &[Option<f64>]) -> Result<Vec<f64>, LoadBalanceError> {
    if bandwidths.is_empty() {
        return Err(LoadBalanceError::NoPeers);
    }
    if let Some(&bad) = bandwidths
        .iter()
        .flatten()
        .find(|b| !(b.is_finite() && **b >= 0.0))
    {
        return Err(LoadBalanceError::BadBandwidth(bad));
    }
    let specified: Vec<f64> = bandwidths
        .iter()
        .flatten()
        .copied()
        .filter(|&b| b > 0.0)
        .collect();
    if specified.is_empty() {
        // Equal split among the unspecified peers.
        let n = bandwidths.iter().filter(|b| b.is_none()).count();
        if n == 0 {
            return Err(LoadBalanceError::AllZero);
        }
        let share = 1.0 / n as f64;
        return Ok(bandwidths
            .iter()
            .map(|b| if b.is_none() { share } else { 0.0 })
            .collect());
    }
    let mean = specified.iter().sum::<f64>() / specified.len() as f64;
    let b: Vec<f64> = bandwidths.iter().map(|b| b.unwrap_or(mean)).collect();
    let n = b.len();
    let positive = b.iter().filter(|&&x| x > 0.0).count();
    if n <= 2 {
        let share = 1.0 / positive as f64;
        return Ok(b
            .iter()
            .map(|&x| if x > 0.0 { share } else { 0.0 })
            .collect());
    }
    let k = (n - 2) as f64;
    let u = |xi: f64| -> Vec<f64> {
        b.iter()
            .map(|&bi| {
                if bi > 0.0 {
                    ((xi * bi - 1.0) / k).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            })
            .collect()
    };
    let floor = b
        .iter()
        .filter(|&&x| x > 0.0)
        .map(|&x| 1.0 / x)
        .fold(0.0f64, f64::max);
    // Water filling: the smallest xi with sum(u(xi)) >= 1. At xi = (N-1)/min(b) every
    // positive peer's u is 1, so the sum is >= 1 there.
    let mut hi = b
        .iter()
        .filter(|&&x| x > 0.0)
        .map(|&x| (n - 1) as f64 / x)
        .fold(0.0f64, f64::max);
    let mut lo = 0.0f64;
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if u(mid).iter().sum::<f64>() >= 1.0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let xi = floor.max(hi);
    let upper = u(xi);
    let total: f64 = upper.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return Err(LoadBalanceError::AllZero);
    }
    Ok(upper.iter().map(|x| x / total).collect())
}

/// hivemind's `load_balance_peers`: element counts summing to `vector_size`, one per peer.
/// Shares below `min_size / vector_size` are zeroed when the largest share is at least that.
pub fn load_balance_peers(
    vector_size: u64,
    bandwidths: &[Option<f64>],
    min_size: u64,
) -> Result<Vec<u64>, LoadBalanceError> {
    let mut w = optimal_shares(bandwidths)?;
    // hivemind rounds the LP's scores to 9 decimals.
    for x in &mut w {
        *x = (*x * 1e9).round() / 1e9;
    }
    if vector_size > 0 {
        let min_share = min_size as f64 / vector_size as f64;
        if w.iter().copied().fold(0.0, f64::max) >= min_share {
            for x in &mut w {
                if *x < min_share {
                    *x = 0.0;
                }
            }
        }
    }
    Ok(hagenbach_bishoff(vector_size, &w))
}

/// Apportions `total` by `scores` (not all zero): floor of the proportional share, then one
/// at a time to the largest `score / (count + 1)`, first index on ties.
fn hagenbach_bishoff(total: u64, scores: &[f64]) -> Vec<u64> {
    let sum: f64 = scores.iter().sum();
    let mut alloc: Vec<u64> = scores
        .iter()
        .map(|&s| ((total as f64 * s / sum).floor() as u64).min(total))
        .collect();
    let mut given: u64 = alloc.iter().sum();
    // Float rounding can overshoot by a few; take them back from the largest counts.
    while given > total {
        let i = (0..alloc.len()).max_by_key(|&i| alloc[i]).unwrap_or(0);
        alloc[i] -= 1;
        given -= 1;
    }
    while given < total {
        let mut best = 0;
        let mut best_q = f64::NEG_INFINITY;
        for (i, &s) in scores.iter().enumerate() {
            let q = s / (alloc[i] + 1) as f64;
            if q > best_q {
                best = i;
                best_q = q;
            }
        }
        alloc[best] += 1;
        given += 1;
    }
    alloc
}

/// The pairs of `group`'s members that cannot link: what its members published
/// ([`MemberInfo::unlinkable`](super::MemberInfo::unlinkable), mapped to member indices)
/// plus `found` (`(claimant, other)` pairs learnt in the round), as far as
/// [`crate::reach::honoured_cuts`] honours them. Every member computes the same from the same
/// group and the same `found`.
pub fn group_cuts(group: &Group, found: &[(usize, usize)]) -> crate::reach::Cuts {
    let index = |peer: &super::PeerId| group.members.iter().position(|m| &m.peer == peer);
    let mut claims: Vec<(usize, usize)> = Vec::new();
    for (i, m) in group.members.iter().enumerate() {
        let named = m.info.unlinkable.iter().take(crate::reach::MAX_UNLINKABLE);
        claims.extend(named.filter_map(index).map(|j| (i, j)));
    }
    claims.extend_from_slice(found);
    let (peers, may_reduce, sends) = planning(group);
    crate::reach::honoured_cuts(&peers, &claims, &may_reduce, &sends)
}

/// The planner's view of `group`: each member's reachability, whether its mode may reduce and
/// whether it sends.
fn planning(group: &Group) -> (Vec<crate::reach::Peer>, Vec<bool>, Vec<bool>) {
    let peers = group.members.iter().map(|m| m.info.plan_peer()).collect();
    let may_reduce = group
        .members
        .iter()
        .map(|m| m.info.mode != Mode::Client)
        .collect();
    let sends = group
        .members
        .iter()
        .map(|m| m.info.mode.is_sender())
        .collect();
    (peers, may_reduce, sends)
}

/// Fractions of a group's vector of `vector_size` elements per member, in group order:
/// element counts from [`load_balance_peers`] as `f64`, with clients forced to bandwidth 0
/// (they reduce nothing) and `min_vector_size` as hivemind's `min_size`. Members that some
/// sender cannot link to ([`crate::reach::reducers_with`], with the group's [`group_cuts`])
/// reduce nothing either. Every member computes the same fractions from the same [`Group`].
pub fn group_fractions(
    group: &Group,
    vector_size: u64,
    min_vector_size: u64,
) -> Result<Vec<f64>, LoadBalanceError> {
    group_fractions_cut(group, vector_size, min_vector_size, &group_cuts(group, &[]))
}

/// [`group_fractions`] with the given cuts (e.g. [`group_cuts`] with pairs found in the round).
pub fn group_fractions_cut(
    group: &Group,
    vector_size: u64,
    min_vector_size: u64,
    cuts: &crate::reach::Cuts,
) -> Result<Vec<f64>, LoadBalanceError> {
    let (peers, may_reduce, sends) = planning(group);
    let reachable = crate::reach::reducers_with(&peers, cuts, &may_reduce, &sends);
    if may_reduce.iter().any(|&m| m) && !reachable.iter().any(|&r| r) {
        return Err(LoadBalanceError::Unreachable);
    }
    // Every member declared measured rates: shares from those (issue 32; equal unless the
    // rates differ by more than their noise, `planned_shares`), as element counts.
    let rated: Option<Vec<RatedPeer>> = group
        .members
        .iter()
        .zip(&reachable)
        .map(|(m, &reachable)| {
            m.info.measured.map(|r| RatedPeer {
                sender: m.info.mode.is_sender(),
                may_reduce: reachable,
                up: r.up,
                down: r.down,
            })
        })
        .collect();
    if let Some(rated) = rated
        && vector_size > 0
    {
        let shares = planned_shares(&rated)?.shares;
        return Ok(shares.iter().map(|s| s * vector_size as f64).collect());
    }
    let bandwidths: Vec<Option<f64>> = group
        .members
        .iter()
        .zip(&reachable)
        .map(|(m, &reachable)| {
            if reachable {
                m.info.bandwidth
            } else {
                Some(0.0)
            }
        })
        .collect();
    // With an empty vector the counts are all zero; shares keep the partition well-defined.
    if vector_size == 0 {
        return optimal_shares(&bandwidths);
    }
    let counts = load_balance_peers(vector_size, &bandwidths, min_vector_size)?;
    Ok(counts.into_iter().map(|c| c as f64).collect())
}

/// The all-reduce members of `group` (mode and fraction, in group order) for a
/// [`RoundConfig`](crate::allreduce::RoundConfig) over `vector_size` elements.
pub fn round_members(
    group: &Group,
    vector_size: u64,
    min_vector_size: u64,
) -> Result<Vec<Member>, LoadBalanceError> {
    round_members_cut(group, vector_size, min_vector_size, &group_cuts(group, &[]))
}

/// [`round_members`] with the given cuts.
pub fn round_members_cut(
    group: &Group,
    vector_size: u64,
    min_vector_size: u64,
    cuts: &crate::reach::Cuts,
) -> Result<Vec<Member>, LoadBalanceError> {
    let fractions = group_fractions_cut(group, vector_size, min_vector_size, cuts)?;
    Ok(group
        .members
        .iter()
        .zip(fractions)
        .map(|(m, fraction)| Member {
            mode: m.info.mode,
            fraction,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matchmaking::{GroupKey, GroupMember, MemberInfo, PeerId};
    use crate::reach::Reach;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn some(b: &[f64]) -> Vec<Option<f64>> {
        b.iter().map(|&x| Some(x)).collect()
    }

    /// hivemind's `get_cost`.
    fn cost(t: u64, parts: &[u64], b: &[f64]) -> f64 {
        let n = parts.len() as f64;
        parts
            .iter()
            .zip(b)
            .map(|(&p, &bi)| (t as f64 - p as f64 + (n - 1.0) * p as f64) / bi.max(1e-9))
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// hivemind's `check_optimality`: no worse than the reference partition.
    fn check_optimality(t: u64, b: &[f64], reference: &[u64]) {
        let ours = load_balance_peers(t, &some(b), 0).unwrap();
        assert_eq!(ours.iter().sum::<u64>(), t);
        assert!(
            cost(t, &ours, b) <= cost(t, reference, b),
            "{ours:?} costs {} > reference {reference:?} {}",
            cost(t, &ours, b),
            cost(t, reference, b)
        );
    }

    #[test]
    fn hivemind_optimality_references() {
        check_optimality(60, &[0.25; 4], &[15, 15, 15, 15]);
        check_optimality(1024, &[0.3, 0.5, 0.9], &[0, 255, 769]);
        check_optimality(60, &[0.44, 0.33, 0.22], &[42, 18, 0]);
        check_optimality(60, &[0.55, 0.44, 0.40], &[35, 16, 9]);
        check_optimality(1 << 20, &[0.3, 0.5, 0.9, 0.6], &[0, 169327, 602629, 276620]);
        check_optimality(1 << 20, &[0.0, 0.5, 0.0, 0.6], &[0, 428963, 0, 619613]);
    }

    #[test]
    fn hivemind_exact_outputs() {
        let lb = |t, b: &[f64], min| load_balance_peers(t, &some(b), min).unwrap();
        assert_eq!(lb(60, &[0.55, 0.44, 0.40], 10), vec![41, 19, 0]);
        assert_eq!(lb(60, &[0.32, 0.55, 0.44], 10), vec![0, 40, 20]);
        assert_eq!(lb(2, &[0.55, 0.20, 0.44], 10), vec![1, 0, 1]);
        assert_eq!(lb(1, &[0.55, 0.20, 0.44], 10), vec![1, 0, 0]);
        // The water-filling level binds: the unique optimum.
        assert_eq!(lb(60, &[0.55, 0.44, 0.40], 0), vec![35, 16, 9]);
        assert_eq!(lb(60, &[0.25; 4], 0), vec![15; 4]);
        assert_eq!(
            load_balance_peers(100, &[None, None], 0).unwrap(),
            vec![50, 50]
        );
        assert_eq!(load_balance_peers(100, &[None; 5], 0).unwrap(), vec![20; 5]);
        assert_eq!(
            load_balance_peers(100, &[Some(0.0), Some(0.0), Some(0.0), None, None], 0).unwrap(),
            vec![0, 0, 0, 50, 50]
        );
        assert_eq!(
            load_balance_peers(100, &some(&[0.0, 0.0, 0.0]), 0),
            Err(LoadBalanceError::AllZero)
        );
        assert_eq!(
            load_balance_peers(100, &[], 0),
            Err(LoadBalanceError::NoPeers)
        );
        assert!(matches!(
            load_balance_peers(100, &some(&[1.0, f64::NAN]), 0),
            Err(LoadBalanceError::BadBandwidth(b)) if b.is_nan()
        ));
        assert!(matches!(
            load_balance_peers(100, &some(&[1.0, -2.0]), 0),
            Err(LoadBalanceError::BadBandwidth(b)) if b == -2.0
        ));
        // None = mean of the specified: equal to them.
        assert_eq!(
            load_balance_peers(90, &[Some(2.0), None, Some(2.0)], 0).unwrap(),
            vec![30, 30, 30]
        );
        // Two peers: equal among the positive ones; one peer: everything.
        assert_eq!(
            load_balance_peers(10, &some(&[1.0, 9.0]), 0).unwrap(),
            vec![5, 5]
        );
        assert_eq!(
            load_balance_peers(10, &some(&[0.0, 9.0]), 0).unwrap(),
            vec![0, 10]
        );
        assert_eq!(load_balance_peers(10, &some(&[3.0]), 0).unwrap(), vec![10]);
    }

    fn group(modes_bw: &[(Mode, Option<f64>)]) -> Group {
        Group {
            group_id: Bytes::from_static(b"g"),
            members: modes_bw
                .iter()
                .enumerate()
                .map(|(i, &(mode, bandwidth))| GroupMember {
                    peer: PeerId::from_bytes(vec![i as u8 + 1]).unwrap(),
                    info: MemberInfo {
                        bandwidth,
                        ..MemberInfo::new(mode)
                    },
                })
                .collect(),
            me: 0,
            leader: PeerId::from_bytes(vec![1]).unwrap(),
            key: GroupKey::parse("p.0b").unwrap(),
        }
    }

    /// With every member's measured rates declared, shares follow them: a member with a 4x
    /// slower uplink reduces less, a client nothing; one member without measured rates (an
    /// older peer) brings back the advertised-bandwidth balancing (equal here).
    #[test]
    fn measured_rates_set_the_fractions() {
        let rates = |up: f64| crate::allreduce::LinkRates { up, down: 1e7 };
        let mut g = group(&[
            (Mode::Node, None),
            (Mode::Node, None),
            (Mode::Node, None),
            (Mode::Client, None),
        ]);
        for (m, up) in g.members.iter_mut().zip([1e6, 1e6, 0.25e6, 1e6]) {
            m.info.measured = Some(rates(up));
        }
        let f = group_fractions(&g, 1000, 1).unwrap();
        assert!((f.iter().sum::<f64>() - 1000.0).abs() < 1e-6, "{f:?}");
        assert!(f[2] < f[0] / 2.0, "{f:?}");
        assert_eq!(f[3], 0.0);
        g.members[1].info.measured = None;
        let f = group_fractions(&g, 999, 1).unwrap();
        assert_eq!(f, vec![333.0, 333.0, 333.0, 0.0]);
    }

    #[test]
    fn members_that_cannot_link_reduce_nothing() {
        let mut g = group(&[(Mode::Node, None); 4]);
        g.members[2].info.reach = Reach::Punchable;
        g.members[3].info.reach = Reach::Punchable;
        assert_eq!(group_fractions(&g, 1200, 0).unwrap(), vec![300.0; 4]);
        // Member 3 could not link to member 2 last time: neither reduces now; the public two
        // carry the vector, and the pair needs no link (neither reduces).
        g.members[3].info.unlinkable = vec![g.members[2].peer.clone()];
        assert_eq!(
            group_fractions(&g, 1200, 0).unwrap(),
            vec![600.0, 600.0, 0.0, 0.0]
        );
        // A pair found in the round does the same.
        g.members[3].info.unlinkable.clear();
        let cuts = group_cuts(&g, &[(2, 3)]);
        assert_eq!(
            group_fractions_cut(&g, 1200, 0, &cuts).unwrap(),
            vec![600.0, 600.0, 0.0, 0.0]
        );
        // Names outside the group, and claims against public members, change nothing.
        g.members[3].info.unlinkable = vec![
            PeerId::from_bytes(vec![99]).unwrap(),
            g.members[0].peer.clone(),
        ];
        assert_eq!(group_fractions(&g, 1200, 0).unwrap(), vec![300.0; 4]);
    }

    #[test]
    fn clients_reduce_nothing_and_members_convert() {
        let g = group(&[
            (Mode::Node, Some(1.0)),
            (Mode::Client, Some(100.0)),
            (Mode::Aux, None),
            (Mode::Node, Some(1.0)),
        ]);
        let members = round_members(&g, 1200, 0).unwrap();
        assert_eq!(members.len(), 4);
        assert_eq!(members[1].mode, Mode::Client);
        assert_eq!(members[1].fraction, 0.0);
        let sum: f64 = members.iter().map(|m| m.fraction).sum();
        assert_eq!(sum, 1200.0);
        assert_eq!(
            members.iter().map(|m| m.fraction).collect::<Vec<_>>(),
            vec![400.0, 0.0, 400.0, 400.0]
        );
        // The fractions build a partition where the client owns no part.
        let cfg = crate::allreduce::RoundConfig::new(members, 0);
        let desc = [crate::allreduce::TensorDescriptor {
            shape: vec![1200],
            dtype: crate::tensor::DType::F32,
        }];
        let p = crate::allreduce::Partition::new(&desc, &cfg.fractions(), 64, &cfg.compression)
            .unwrap();
        assert!(p.span(1).is_empty());
        assert!(!p.span(0).is_empty() && !p.span(2).is_empty() && !p.span(3).is_empty());
        // All clients: nobody reduces.
        let clients = group(&[(Mode::Client, None), (Mode::Client, Some(5.0))]);
        assert_eq!(
            round_members(&clients, 10, 0),
            Err(LoadBalanceError::AllZero)
        );
        // An empty vector still yields usable fractions.
        let f = group_fractions(&g, 0, 0).unwrap();
        assert!((f.iter().sum::<f64>() - 1.0).abs() < 1e-12 && f[1] == 0.0);
    }

    /// A group of members with these modes, reachabilities and relay consents (no bandwidth).
    fn reach_group(members: &[(Mode, Reach, bool)]) -> Group {
        let mut g = group(&vec![(Mode::Node, None); members.len()]);
        for (m, &(mode, reach, relay_data)) in g.members.iter_mut().zip(members) {
            m.info.mode = mode;
            m.info.reach = reach;
            m.info.relay_data = relay_data;
        }
        g
    }

    /// Which members get a positive fraction (and the fractions sum to the vector).
    fn reducing(g: &Group, t: u64) -> Vec<bool> {
        let f = group_fractions(g, t, 0).unwrap();
        assert_eq!(f.iter().sum::<f64>(), t as f64, "{f:?}");
        assert!(f.iter().all(|&x| x >= 0.0), "{f:?}");
        f.iter().map(|&x| x > 0.0).collect()
    }

    #[test]
    fn members_some_sender_cannot_reach_reduce_nothing() {
        use Reach::*;
        // A private client sends to every reducer; it cannot reach the punchable member.
        let g = reach_group(&[
            (Mode::Node, Public, false),
            (Mode::Node, Public, false),
            (Mode::Node, Punchable, false),
            (Mode::Client, Private, false),
        ]);
        assert_eq!(reducing(&g, 1000), [true, true, false, false]);
        assert_eq!(
            round_members(&g, 1000, 0).unwrap()[2],
            Member {
                mode: Mode::Node,
                fraction: 0.0
            }
        );
        // Without the private member, punchable members reach each other by hole punching.
        let g = reach_group(&[
            (Mode::Node, Public, false),
            (Mode::Node, Public, false),
            (Mode::Node, Punchable, false),
            (Mode::Node, Punchable, false),
        ]);
        assert_eq!(reducing(&g, 1000), [true; 4]);
        // An empty vector: shares, with the same zeros.
        let g = reach_group(&[
            (Mode::Node, Public, false),
            (Mode::Node, Punchable, false),
            (Mode::Client, Private, false),
        ]);
        let f = group_fractions(&g, 0, 0).unwrap();
        assert_eq!(f, [1.0, 0.0, 0.0]);
    }

    #[test]
    fn a_group_nobody_can_reduce_for_is_unreachable() {
        use Reach::*;
        for mode in [Mode::Client, Mode::Node] {
            let g = reach_group(&[(Mode::Node, Punchable, false), (mode, Private, false)]);
            assert_eq!(
                group_fractions(&g, 100, 0),
                Err(LoadBalanceError::Unreachable),
                "private {mode:?}"
            );
            assert_eq!(
                round_members(&g, 100, 0),
                Err(LoadBalanceError::Unreachable)
            );
            // One of the two allowing relayed data is not enough.
            for (a, b) in [(true, false), (false, true)] {
                let g = reach_group(&[(Mode::Node, Punchable, a), (mode, Private, b)]);
                assert_eq!(
                    group_fractions(&g, 100, 0),
                    Err(LoadBalanceError::Unreachable)
                );
            }
        }
        // Two private nodes: the same.
        let g = reach_group(&[(Mode::Node, Private, false), (Mode::Node, Private, false)]);
        assert_eq!(
            group_fractions(&g, 100, 0),
            Err(LoadBalanceError::Unreachable)
        );
        // Nobody may reduce at all (all clients): that is AllZero, not a reachability problem.
        let g = reach_group(&[
            (Mode::Client, Punchable, false),
            (Mode::Client, Private, false),
        ]);
        assert_eq!(group_fractions(&g, 100, 0), Err(LoadBalanceError::AllZero));
    }

    #[test]
    fn relayed_data_lets_the_punchable_member_reduce_again() {
        use Reach::*;
        let g = reach_group(&[(Mode::Node, Punchable, true), (Mode::Client, Private, true)]);
        assert_eq!(reducing(&g, 100), [true, false]);
        // A private node is reached through the relay too.
        let g = reach_group(&[(Mode::Node, Punchable, true), (Mode::Node, Private, true)]);
        assert_eq!(reducing(&g, 100), [true, true]);
        // In the mixed group, relaying between the two NATed members brings the punchable one
        // back; a member that does not allow relaying stays out.
        let g = reach_group(&[
            (Mode::Node, Public, false),
            (Mode::Node, Public, false),
            (Mode::Node, Punchable, true),
            (Mode::Client, Private, true),
        ]);
        assert_eq!(reducing(&g, 1000), [true, true, true, false]);
        let g = reach_group(&[
            (Mode::Node, Public, false),
            (Mode::Node, Public, false),
            (Mode::Node, Punchable, true),
            (Mode::Client, Private, false),
        ]);
        assert_eq!(reducing(&g, 1000), [true, true, false, false]);
    }

    /// An aux peer sends nothing: a member it cannot reach may still reduce.
    #[test]
    fn aux_peers_do_not_constrain_reducers() {
        use Reach::*;
        let g = reach_group(&[
            (Mode::Node, Public, false),
            (Mode::Node, Punchable, false),
            (Mode::Aux, Private, false),
        ]);
        // The private aux peer reduces only if every sender reaches it: the punchable node does
        // not.
        assert_eq!(reducing(&g, 1000), [true, true, false]);
    }

    proptest! {
        #[test]
        fn counts_sum_and_are_optimal(
            t in 1u64..(1 << 30),
            b in proptest::collection::vec(
                prop_oneof![Just(None), Just(Some(0.0)), (1e-6f64..1e5).prop_map(Some)], 1..64),
            min_div in 0u64..20,
        ) {
            let min_size = (t / 10).checked_div(min_div).unwrap_or(0);
            match load_balance_peers(t, &b, min_size) {
                Ok(c) => {
                    prop_assert_eq!(c.len(), b.len());
                    prop_assert_eq!(c.iter().sum::<u64>(), t);
                    // Explicit zeros get nothing whenever someone else can reduce.
                    for (ci, bi) in c.iter().zip(&b) {
                        if *bi == Some(0.0) {
                            prop_assert_eq!(*ci, 0);
                        }
                    }
                }
                Err(e) => {
                    prop_assert_eq!(e, LoadBalanceError::AllZero);
                    prop_assert!(b.iter().all(|x| *x == Some(0.0)));
                }
            }
        }

        #[test]
        fn shares_are_a_distribution_no_worse_than_equal(
            b in proptest::collection::vec(1e-3f64..1e3, 1..40),
        ) {
            let w = optimal_shares(&some(&b)).unwrap();
            prop_assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            prop_assert!(w.iter().all(|&x| (0.0..=1.0).contains(&x)));
            // Continuous cost no worse than an equal split (up to bisection precision).
            let n = b.len() as f64;
            let c = |w: &[f64]| w.iter().zip(&b)
                .map(|(wi, bi)| (1.0 + (n - 2.0).max(0.0) * wi) / bi)
                .fold(0.0f64, f64::max);
            let equal = vec![1.0 / n; b.len()];
            prop_assert!(c(&w) <= c(&equal) * (1.0 + 1e-9));
        }

        #[test]
        fn group_fractions_zero_for_clients(
            members in proptest::collection::vec(
                (prop_oneof![Just(Mode::Node), Just(Mode::Client), Just(Mode::Aux)],
                 prop_oneof![Just(None), (0.0f64..100.0).prop_map(Some)]), 1..20),
            t in 0u64..100_000,
        ) {
            let g = group(&members);
            if let Ok(f) = group_fractions(&g, t, 0) {
                let expect = if t == 0 { 1.0 } else { t as f64 };
                prop_assert!((f.iter().sum::<f64>() - expect).abs() < 1e-6 * expect);
                for (fi, (mode, _)) in f.iter().zip(&members) {
                    prop_assert!(*fi >= 0.0);
                    if *mode == Mode::Client {
                        prop_assert_eq!(*fi, 0.0);
                    }
                }
            }
        }
    }
}
