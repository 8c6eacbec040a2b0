//! Matchmaking scenarios in the deterministic simulator (`hivemesh::matchmaking::sim`): many
//! `Matchmaker`s over a simulated DHT and simulated links, in virtual time.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;
use hivemesh::matchmaking::sim::{
    self, SimConfig, SimFault, SimGroup, SimOutcome, SimPeer, SimResult,
};
use hivemesh::matchmaking::{
    Config, Grid, GroupKey, KeyManager, MatchmakingError, Mode, PeerId, RejectReason,
};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Distinct ids whose byte order does not follow the peer index.
fn peer_id(seed: u64, i: usize) -> PeerId {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(i as u64 + 1);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    PeerId::from_bytes(format!("{:016x}-{i:03}", z ^ (z >> 31)).into_bytes()).unwrap()
}

/// Target 4, min 2, 2 s minimum matchmaking time, 0.5 s request timeout, 0.2 s refresh.
fn config(target: Option<usize>) -> Config {
    let mut c = Config::new(Bytes::from_static(&[7; 20]));
    c.target_group_size = target;
    c.min_group_size = 2;
    c.min_matchmaking_time = Duration::from_secs(2);
    c.request_timeout = Duration::from_millis(500);
    c.dht_refresh_interval = Duration::from_millis(200);
    c
}

fn key(bits: &str) -> GroupKey {
    GroupKey::new("mygroup", bits).unwrap()
}

/// `n` nodes under one key, starting at `starts` (ms), deadline 20 s after their start.
fn peers(seed: u64, n: usize, starts: &[u64]) -> Vec<SimPeer> {
    (0..n)
        .map(|i| {
            let mut p = SimPeer::new(peer_id(seed, i), key(""));
            p.start = Duration::from_millis(starts.get(i).copied().unwrap_or(0));
            p.timeout = Some(Duration::from_secs(20));
            p
        })
        .collect()
}

fn assembled(r: &SimResult) -> usize {
    r.peers
        .iter()
        .filter(|p| matches!(p.outcome, SimOutcome::Assembled { .. }))
        .count()
}

fn sizes(groups: &[SimGroup]) -> Vec<usize> {
    let mut s: Vec<usize> = groups.iter().map(|g| g.members.len()).collect();
    s.sort();
    s
}

/// Every peer ended (none unfinished), no machine stalled, groups consistent.
fn checked(r: &SimResult) -> Vec<SimGroup> {
    assert_eq!(r.stuck, None);
    for (i, p) in r.peers.iter().enumerate() {
        assert!(
            !matches!(p.outcome, SimOutcome::Unfinished | SimOutcome::Rejected(_)),
            "peer {i} ended {:?}",
            p.outcome
        );
    }
    r.groups().expect("groups are consistent")
}

fn sixteen_form_groups_of_four(seed: u64, starts: &[u64]) -> Result<(), TestCaseError> {
    let r = sim::run(SimConfig::new(
        peers(seed, 16, starts),
        config(Some(4)),
        seed,
    ));
    let groups = checked(&r);
    prop_assert_eq!(assembled(&r), 16, "every peer is matched");
    prop_assert_eq!(sizes(&groups), vec![4, 4, 4, 4]);
    for g in &groups {
        prop_assert_eq!(
            &g.confirmed.iter().copied().collect::<BTreeSet<_>>(),
            &g.members.iter().copied().collect::<BTreeSet<_>>()
        );
    }
    // Full groups close at once, long before anyone's declaration expires.
    for p in &r.peers {
        if let SimOutcome::Assembled { at, .. } = p.outcome {
            prop_assert!(at < Duration::from_secs(4), "assembled late, at {at:?}");
        }
    }
    Ok(())
}

#[test]
fn sixteen_peers_target_four_form_four_groups_of_four() {
    sixteen_form_groups_of_four(1, &[]).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn sixteen_peers_any_arrivals_form_groups_of_four(
        seed in any::<u64>(),
        starts in proptest::collection::vec(0u64..1500, 16),
    ) {
        sixteen_form_groups_of_four(seed, &starts)?;
    }

    /// No deadlock for any seed, arrival pattern, group size target or population: every
    /// peer ends by its deadline (plus the accepted follower's grace), groups are consistent,
    /// and fewer than `min_group_size` peers stay unmatched.
    #[test]
    fn random_seeds_and_arrivals_never_deadlock(
        seed in any::<u64>(),
        n in 2usize..14,
        target in prop_oneof![Just(None), (2usize..6).prop_map(Some)],
        starts in proptest::collection::vec(0u64..3000, 14),
        clients in proptest::collection::vec(any::<bool>(), 14),
    ) {
        let mut ps = peers(seed, n, &starts);
        // Some clients, but never all: someone must be able to lead.
        for (i, p) in ps.iter_mut().enumerate().skip(1) {
            if clients[i] && i % 3 == 0 {
                p.info.mode = Mode::Client;
            }
        }
        let cfg = config(target);
        let r = sim::run(SimConfig::new(ps.clone(), cfg.clone(), seed));
        let groups = checked(&r);
        for (i, p) in r.peers.iter().enumerate() {
            let at = match &p.outcome {
                SimOutcome::Assembled { at, .. } | SimOutcome::Failed { at, .. } => *at,
                other => return Err(TestCaseError::fail(format!("peer {i}: {other:?}"))),
            };
            let limit = ps[i].start + ps[i].timeout.unwrap() + cfg.request_timeout;
            prop_assert!(at <= limit, "peer {i} ended at {at:?} after {limit:?}");
        }
        for g in &groups {
            prop_assert!(g.members.len() >= 2);
            prop_assert!(target.is_none_or(|t| g.members.len() <= t));
            prop_assert!(ps[g.leader].info.mode != Mode::Client);
        }
        let unmatched = n - assembled(&r);
        let leaders = ps.iter().filter(|p| p.info.mode != Mode::Client).count();
        // Leftover peers would have found each other before the deadline, unless they are
        // clients with nobody left to lead them.
        if leaders == n {
            prop_assert!(unmatched < 2, "{unmatched} unmatched: {:?}", sizes(&groups));
        }
    }
}

/// hivemind's optimizer schedules every peer's step for the same time, so every declaration
/// has the same expiration: priorities tie and only the peer id orders them.
#[test]
fn common_scheduled_time_ties_are_broken_by_peer_id() {
    for seed in 0..16 {
        let mut ps = peers(seed, 16, &[0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]);
        for p in &mut ps {
            p.scheduled = Some(Duration::from_secs(3));
        }
        let r = sim::run(SimConfig::new(ps, config(Some(4)), seed));
        let groups = checked(&r);
        assert_eq!(sizes(&groups), vec![4, 4, 4, 4], "seed {seed}");
        for p in &r.peers {
            let SimOutcome::Assembled { at, .. } = p.outcome else {
                unreachable!()
            };
            // No request waited out its timeout on the way.
            assert!(
                at < Duration::from_millis(900),
                "seed {seed}: assembled at {at:?}"
            );
        }
    }
}

/// Without a target the best leader takes everyone and closes at its expiration.
#[test]
fn without_a_target_one_group_closes_at_the_leaders_expiration() {
    for seed in 0..8 {
        let r = sim::run(SimConfig::new(
            peers(seed, 6, &[0, 40, 80, 120, 160, 200]),
            config(None),
            seed,
        ));
        let groups = checked(&r);
        assert_eq!(sizes(&groups), vec![6], "seed {seed}");
        assert_eq!(groups[0].leader, 0);
        for p in &r.peers {
            let SimOutcome::Assembled { at, .. } = p.outcome else {
                unreachable!()
            };
            assert!(at >= Duration::from_secs(2) && at < Duration::from_millis(2100));
        }
    }
}

#[test]
fn too_few_peers_fail_by_their_deadline() {
    // Two peers, min_group_size 3.
    let mut cfg = config(Some(4));
    cfg.min_group_size = 3;
    let mut ps = peers(2, 2, &[0, 300]);
    for p in &mut ps {
        p.timeout = Some(Duration::from_secs(3));
    }
    let r = sim::run(SimConfig::new(ps.clone(), cfg, 2));
    assert_eq!(r.stuck, None);
    for (i, p) in r.peers.iter().enumerate() {
        let deadline = ps[i].start + Duration::from_secs(3);
        match &p.outcome {
            SimOutcome::Failed {
                error: MatchmakingError::NoGroup { .. },
                at,
            } => assert!(*at <= deadline, "peer {i} failed at {at:?} > {deadline:?}"),
            other => panic!("peer {i}: {other:?}"),
        }
    }

    // hivemind's test_too_few_peers: four peers, each alone in its own 3-bit bucket, target 2,
    // 1 s minimum matchmaking time, 0.5 s request timeout, 2 s step timeout.
    let mut cfg = config(Some(2));
    cfg.min_matchmaking_time = Duration::from_secs(1);
    let ps: Vec<SimPeer> = (0..4)
        .map(|i| {
            let mut p = SimPeer::new(peer_id(3, i), key(&format!("{i:03b}")));
            p.timeout = Some(Duration::from_secs(2));
            p
        })
        .collect();
    let r = sim::run(SimConfig::new(ps, cfg, 3));
    for p in &r.peers {
        assert!(
            matches!(
                p.outcome,
                SimOutcome::Failed { error: MatchmakingError::NoGroup { .. }, at }
                    if at <= Duration::from_secs(2)
            ),
            "{:?}",
            p.outcome
        );
    }
}

/// Four peers, target 4; peer 0 starts first, so it has the best priority and leads.
fn leader_scenario(fault: SimFault, seed: u64) -> (Vec<SimPeer>, SimResult) {
    let mut ps = peers(seed, 4, &[0, 200, 250, 300]);
    ps[0].fault = Some(fault);
    let r = sim::run(SimConfig::new(ps.clone(), config(Some(4)), seed));
    (ps, r)
}

#[test]
fn leader_dies_before_begin_followers_regroup() {
    for seed in 0..8 {
        let (_, r) = leader_scenario(SimFault::DieBeforeBegin, seed);
        let groups = checked(&r);
        assert!(matches!(r.peers[0].outcome, SimOutcome::Died { .. }));
        // The leader did get the whole group before dying: nobody saw its Begin.
        assert_eq!(r.peers[0].begins_sent, 0);
        assert_eq!(r.peers[0].accepted_sent, 3, "seed {seed}");
        // The followers waited out their expiration, then formed a group of the three of them.
        assert_eq!(groups.len(), 1, "seed {seed}: {groups:?}");
        let members: BTreeSet<usize> = groups[0].members.iter().copied().collect();
        assert_eq!(members, BTreeSet::from([1, 2, 3]));
        for p in &r.peers[1..] {
            let SimOutcome::Assembled { at, .. } = p.outcome else {
                panic!("{:?}", p.outcome)
            };
            // Not before their first expiration plus the request timeout: they waited for the
            // dead leader's Begin that long.
            assert!(at >= Duration::from_millis(2700), "{at:?}");
        }
    }
}

#[test]
fn leader_dies_right_after_begin_followers_agree() {
    for seed in 0..8 {
        let (_, r) = leader_scenario(SimFault::DieAfterBegin, seed);
        let groups = checked(&r);
        assert!(matches!(r.peers[0].outcome, SimOutcome::Died { .. }));
        assert_eq!(r.peers[0].begins_sent, 3);
        assert_eq!(groups.len(), 1);
        let g = &groups[0];
        assert_eq!(g.leader, 0);
        assert_eq!(g.members.len(), 4);
        assert_eq!(
            g.confirmed.iter().copied().collect::<BTreeSet<_>>(),
            BTreeSet::from([1, 2, 3])
        );
    }
}

#[test]
fn follower_that_leaves_is_never_in_a_group() {
    for seed in 0..8 {
        let mut ps = peers(seed, 8, &[0, 50, 100, 150, 200, 250, 300, 350]);
        ps[5].fault = Some(SimFault::LeaveWhenAccepted);
        let r = sim::run(SimConfig::new(ps, config(Some(4)), seed));
        let groups = checked(&r);
        assert!(
            matches!(
                r.peers[5].outcome,
                SimOutcome::Failed {
                    error: MatchmakingError::Cancelled,
                    ..
                }
            ),
            "{:?}",
            r.peers[5].outcome
        );
        assert!(groups.iter().all(|g| !g.members.contains(&5)));
        assert_eq!(assembled(&r), 7, "seed {seed}: {groups:?}");
        assert_eq!(sizes(&groups), vec![3, 4]);
    }
    // Leaving at a fixed time, while possibly a leader with followers.
    for seed in 0..8 {
        let mut ps = peers(seed, 6, &[0, 100, 200, 300, 400, 500]);
        ps[0].fault = Some(SimFault::CancelAt(Duration::from_millis(450)));
        let r = sim::run(SimConfig::new(ps, config(None), seed));
        let groups = checked(&r);
        assert!(groups.iter().all(|g| !g.members.contains(&0)));
        assert_eq!(assembled(&r), 5, "seed {seed}: {groups:?}");
    }
}

#[test]
fn clients_join_but_never_lead() {
    for seed in 0..8 {
        let mut ps = peers(seed, 8, &[0, 40, 80, 120, 160, 200, 240, 280]);
        // The earliest peers are clients: with the best arrival times they would lead.
        let clients = [0usize, 1, 5];
        for &c in &clients {
            ps[c].info.mode = Mode::Client;
        }
        let r = sim::run(SimConfig::new(ps, config(Some(4)), seed));
        let groups = checked(&r);
        assert_eq!(assembled(&r), 8, "seed {seed}: {groups:?}");
        for g in &groups {
            assert!(!clients.contains(&g.leader));
        }
        for &c in &clients {
            let p = &r.peers[c];
            assert_eq!((p.accepted_sent, p.begins_sent, p.declarations), (0, 0, 0));
            assert!(p.joins_sent > 0);
        }
    }
    // Only clients: nobody can lead, everybody fails.
    let mut ps = peers(9, 3, &[]);
    for p in &mut ps {
        p.info.mode = Mode::Client;
        p.timeout = Some(Duration::from_secs(3));
    }
    let r = sim::run(SimConfig::new(ps, config(Some(4)), 9));
    assert_eq!(assembled(&r), 0);
    assert!(
        r.peers
            .iter()
            .all(|p| matches!(p.outcome, SimOutcome::Failed { .. }))
    );
}

#[test]
fn schema_hash_mismatch_is_rejected() {
    for seed in 0..4 {
        let mut ps = peers(seed, 5, &[0, 100, 200, 300, 400]);
        for p in &mut ps {
            p.timeout = Some(Duration::from_secs(6));
        }
        // The odd one is the best candidate (first to arrive), then second best (it asks the
        // first and is asked by the later ones).
        for odd in [0, 1] {
            let mut ps = ps.clone();
            ps[odd].schema_hash = Some(Bytes::from_static(&[8; 20]));
            let r = sim::run(SimConfig::new(ps, config(Some(4)), seed));
            let groups = checked(&r);
            assert_eq!(sizes(&groups), vec![4]);
            assert!(!groups[0].members.contains(&odd));
            assert!(matches!(
                r.peers[odd].outcome,
                SimOutcome::Failed {
                    error: MatchmakingError::NoGroup { .. },
                    ..
                }
            ));
            let bad_schema = r
                .peers
                .iter()
                .flat_map(|p| &p.rejections)
                .filter(|x| **x == RejectReason::BadSchemaHash)
                .count();
            assert!(bad_schema > 0);
            assert_eq!(r.peers[odd].accepted_sent, 0);
            if odd == 1 {
                assert!(r.peers[1].rejections.contains(&RejectReason::BadSchemaHash));
            }
        }
    }
}

/// Exact mean of `values` over each group, in place.
fn average_in_groups(values: &mut [Vec<f64>], groups: &[Vec<usize>]) {
    for g in groups {
        let dim = values[g[0]].len();
        let mean: Vec<f64> = (0..dim)
            .map(|k| g.iter().map(|&i| values[i][k]).sum::<f64>() / g.len() as f64)
            .collect();
        for &i in g {
            values[i].clone_from(&mean);
        }
    }
}

fn max_error(values: &[Vec<f64>], target: &[f64]) -> f64 {
    values
        .iter()
        .flat_map(|v| v.iter().zip(target).map(|(a, b)| (a - b).abs()))
        .fold(0.0, f64::max)
}

#[test]
fn moshpit_grid_64_peers_exact_mean_in_three_rounds() {
    let grid = Grid::new(4, 3).unwrap();
    let n = 64;
    let mut rng = StdRng::seed_from_u64(64);
    let initial: Vec<Vec<f64>> = (0..n)
        .map(|_| (0..16).map(|_| rng.random_range(-100.0..100.0)).collect())
        .collect();
    let mean: Vec<f64> = (0..16)
        .map(|k| initial.iter().map(|v| v[k]).sum::<f64>() / n as f64)
        .collect();
    let ids: Vec<PeerId> = (0..n).map(|i| peer_id(64, i)).collect();

    // 1. Pure grid: groups from the keys alone.
    let mut by_keys = initial.clone();
    let mut key_groups_per_round = Vec::new();
    for round in 0..3u64 {
        let mut buckets: BTreeMap<GroupKey, Vec<usize>> = BTreeMap::new();
        for i in 0..n {
            let k = grid.key("grid", &grid.coords_of_index(i), round).unwrap();
            buckets.entry(k).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = buckets.into_values().collect();
        assert!(groups.iter().all(|g| g.len() == 4));
        average_in_groups(&mut by_keys, &groups);
        key_groups_per_round.push(groups);
        if round < 2 {
            assert!(max_error(&by_keys, &mean) > 1e-3, "exact too early");
        }
    }
    assert!(max_error(&by_keys, &mean) < 1e-5);

    // 2. The same through matchmaking: the simulation forms exactly those groups.
    let mut by_sim = initial.clone();
    for round in 0..3u64 {
        let ps: Vec<SimPeer> = (0..n)
            .map(|i| {
                let k = grid.key("grid", &grid.coords_of_index(i), round).unwrap();
                let mut p = SimPeer::new(ids[i].clone(), k);
                p.start = Duration::from_millis((i as u64 * 37) % 500);
                p.timeout = Some(Duration::from_secs(20));
                p
            })
            .collect();
        let r = sim::run(SimConfig::new(ps, config(Some(4)), 100 + round));
        let groups = checked(&r);
        assert_eq!(assembled(&r), n);
        let formed: BTreeSet<BTreeSet<usize>> = groups
            .iter()
            .map(|g| g.members.iter().copied().collect())
            .collect();
        let expected: BTreeSet<BTreeSet<usize>> = key_groups_per_round[round as usize]
            .iter()
            .map(|g| g.iter().copied().collect())
            .collect();
        assert_eq!(formed, expected, "round {round}");
        let member_lists: Vec<Vec<usize>> = groups.into_iter().map(|g| g.members).collect();
        average_in_groups(&mut by_sim, &member_lists);
    }
    assert!(max_error(&by_sim, &mean) < 1e-5);
}

/// hivemind's `test_allreduce_grid`: 8 peers, target 2, initial bits = `i // 2` in 2 bits;
/// the key manager rotates the bits after each group; all groups have 2 members and the mean
/// is exact from the fourth round on.
#[test]
fn key_rotation_reaches_exact_mean_with_eight_peers() {
    let n = 8;
    let mut rng = StdRng::seed_from_u64(8);
    let mut values: Vec<Vec<f64>> = (0..n)
        .map(|_| (0..4).map(|_| rng.random_range(-1.0..1.0)).collect())
        .collect();
    let mean: Vec<f64> = (0..4)
        .map(|k| values.iter().map(|v| v[k]).sum::<f64>() / n as f64)
        .collect();
    let mut managers: Vec<KeyManager> = (0..n)
        .map(|i| KeyManager::new("mygroup", &format!("{:02b}", i / 2), Some(2)).unwrap())
        .collect();
    let ids: Vec<PeerId> = (0..n).map(|i| peer_id(8, i)).collect();
    for round in 0..5u64 {
        let ps: Vec<SimPeer> = (0..n)
            .map(|i| {
                let mut p = SimPeer::new(ids[i].clone(), managers[i].key());
                p.start = Duration::from_millis(i as u64 * 25);
                p.timeout = Some(Duration::from_secs(10));
                p
            })
            .collect();
        let r = sim::run(SimConfig::new(ps, config(Some(2)), 1000 + round));
        let groups = checked(&r);
        assert_eq!(assembled(&r), n, "round {round}");
        assert_eq!(sizes(&groups), vec![2; 4]);
        for (i, p) in r.peers.iter().enumerate() {
            let SimOutcome::Assembled { group, .. } = &p.outcome else {
                unreachable!()
            };
            managers[i].update_on_group_assembled(group);
        }
        let lists: Vec<Vec<usize>> = groups.into_iter().map(|g| g.members).collect();
        average_in_groups(&mut values, &lists);
        let err = max_error(&values, &mean);
        if round >= 2 {
            assert!(err < 1e-9, "round {round}: {err}");
        } else {
            assert!(err > 1e-6, "round {round}: exact too early");
        }
    }
}

#[test]
fn simulation_is_deterministic() {
    let run = || {
        let r = sim::run(SimConfig::new(
            peers(5, 10, &[0, 30, 60, 90]),
            config(Some(4)),
            5,
        ));
        r.peers
            .iter()
            .map(|p| format!("{:?}", p.outcome))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}
