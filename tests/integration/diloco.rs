//! DiLoCo for Rust loops (`hivemesh::train::DiLoCo`) on real in-process swarms: every outer
//! step against a reference computed here, identical peers, a late joiner, a deferred round,
//! error-feedback compression.

use crate::swarm;

use std::time::Duration;
use swarm::Swarm;

use hivemesh::Compression;
use hivemesh::allreduce::Mode;
use hivemesh::averager::AveragerConfig;
use hivemesh::compression::SparseTopK;
use hivemesh::train::{DiLoCo, DiLoCoConfig, OuterSgd, OuterStep};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const INNER_LR: f32 = 0.1;

/// Peer `i` minimises ½‖x − cᵢ‖² with plain SGD: its inner step.
fn inner_step(params: &mut [Vec<f32>], target: &[Vec<f32>]) {
    for (p, c) in params.iter_mut().zip(target) {
        for (x, c) in p.iter_mut().zip(c) {
            *x -= INNER_LR * (*x - c);
        }
    }
}

fn random(rng: &mut StdRng, lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .map(|&n| (0..n).map(|_| rng.random_range(-1.0..1.0)).collect())
        .collect()
}

fn averager_config(prefix: &str, min_group: usize) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.mode = Some(Mode::Node);
    c.target_group_size = Some(4);
    c.min_group_size = min_group;
    c.min_matchmaking_time = Duration::from_secs(2);
    c
}

fn diloco_config(h: u64) -> DiLoCoConfig {
    DiLoCoConfig {
        num_inner_steps: h,
        outer: OuterSgd::default(),
        round_timeout: Duration::from_secs(60),
        load_state: false,
    }
}

async fn start(
    swarm: &Swarm,
    i: usize,
    params: Vec<Vec<f32>>,
    averager: AveragerConfig,
    config: DiLoCoConfig,
) -> DiLoCo {
    DiLoCo::start(
        swarm.nodes[i].dht().clone(),
        swarm.nodes[i].hub().clone(),
        params,
        averager,
        config,
    )
    .await
    .unwrap()
}

/// `steps` inner steps on every peer, the last through `inner_step_done` of all at once;
/// returns what each last call said.
async fn epoch(peers: &mut [DiLoCo], targets: &[Vec<Vec<f32>>], steps: u64) -> Vec<OuterStep> {
    for (p, t) in peers.iter_mut().zip(targets) {
        for _ in 1..steps {
            inner_step(p.params_mut(), t);
            assert_eq!(
                p.inner_step_done().await,
                None,
                "only the last step ends the epoch"
            );
        }
        inner_step(p.params_mut(), t);
    }
    let ends = peers.iter_mut().map(|p| async move {
        p.inner_step_done()
            .await
            .expect("the last inner step ends the epoch")
    });
    futures::future::join_all(ends).await
}

/// The reference: what every peer's start parameters and momentum must be after an outer step
/// from `start`/`momentum`, given each peer's parameters after its inner steps.
fn reference_step(
    start: &mut [Vec<f32>],
    momentum: &mut [Vec<f32>],
    after_inner: &[Vec<Vec<f32>>],
) {
    let n = after_inner.len() as f64;
    for t in 0..start.len() {
        let mean: Vec<f32> = (0..start[t].len())
            .map(|k| {
                let sum: f64 = after_inner
                    .iter()
                    .map(|p| f64::from(start[t][k]) - f64::from(p[t][k]))
                    .sum();
                (sum / n) as f32
            })
            .collect();
        OuterSgd::default().step(&mut start[t], &mean, &mut momentum[t]);
    }
}

/// Runs peer `i`'s inner steps from `from` without the network (the reference's input).
fn inner_only(from: &[Vec<f32>], target: &[Vec<f32>], steps: u64) -> Vec<Vec<f32>> {
    let mut p = from.to_vec();
    for _ in 0..steps {
        inner_step(&mut p, target);
    }
    p
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    for (g, w) in got.iter().zip(want) {
        for (x, y) in g.iter().zip(w) {
            assert!((x - y).abs() <= 1e-5, "{what}: {x} vs {y}");
        }
    }
}

fn assert_all_averaged(ends: &[OuterStep], epoch: u64, group_size: usize) {
    for end in ends {
        assert_eq!(end, &OuterStep::Averaged { epoch, group_size }, "{ends:?}");
    }
}

fn assert_identical(peers: &[DiLoCo], what: &str) {
    let (s0, m0) = peers[0].outer_state();
    for (i, p) in peers.iter().enumerate().skip(1) {
        let (s, m) = p.outer_state();
        assert_eq!(
            s, s0,
            "{what}: peer {i}'s start parameters differ from peer 0's"
        );
        assert_eq!(m, m0, "{what}: peer {i}'s momentum differs from peer 0's");
        assert_eq!(
            p.params(),
            peers[0].params(),
            "{what}: peer {i}'s parameters"
        );
        assert_eq!(p.epoch(), peers[0].epoch(), "{what}: peer {i}'s epoch");
    }
}

const LENS: [usize; 2] = [300, 7];

/// A swarm of `n` nodes, the common initial parameters and one target per node.
async fn setup(n: usize, seed: u64, lens: &[usize]) -> (Swarm, Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let swarm = Swarm::start(n, |_| false).await;
    let mut rng = StdRng::seed_from_u64(seed);
    let init = random(&mut rng, lens);
    let targets = (0..n).map(|_| random(&mut rng, lens)).collect();
    (swarm, init, targets)
}

async fn finish(peers: Vec<DiLoCo>, swarm: Swarm) {
    for p in peers {
        p.shutdown().await;
    }
    swarm.shutdown(Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outer_step_is_the_mean_pseudo_gradient_then_nesterov_and_peers_end_identical() {
    let (swarm, init, targets) = setup(3, 7, &LENS).await;
    let mut peers = Vec::new();
    for i in 0..3 {
        peers.push(
            start(
                &swarm,
                i,
                init.clone(),
                averager_config("dl-ref", 3),
                diloco_config(4),
            )
            .await,
        );
    }
    let (mut start_ref, mut momentum_ref) = (init.clone(), vec![vec![0.0; 300], vec![0.0; 7]]);
    for e in 1..=3u64 {
        let after: Vec<_> = targets
            .iter()
            .map(|t| inner_only(&start_ref, t, 4))
            .collect();
        let ends = epoch(&mut peers, &targets, 4).await;
        assert_all_averaged(&ends, e, 3);
        reference_step(&mut start_ref, &mut momentum_ref, &after);
        assert_identical(&peers, &format!("epoch {e}"));
        let (s, m) = peers[0].outer_state();
        assert_close(&s, &start_ref, &format!("start parameters after epoch {e}"));
        assert_close(&m, &momentum_ref, &format!("momentum after epoch {e}"));
        assert_eq!(
            peers[0].params(),
            s.as_slice(),
            "the parameters restart from the outer ones"
        );
    }
    finish(peers, swarm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_joiner_loads_the_outer_state_and_ends_in_lockstep() {
    let (swarm, init, targets) = setup(3, 8, &LENS).await;
    let mut rng = StdRng::seed_from_u64(80);
    let mut peers = Vec::new();
    for i in 0..2 {
        peers.push(
            start(
                &swarm,
                i,
                init.clone(),
                averager_config("dl-late", 2),
                diloco_config(3),
            )
            .await,
        );
    }
    for _ in 0..2 {
        epoch(&mut peers, &targets[..2], 3).await;
    }
    assert_eq!(peers[0].epoch(), 2);
    // The newcomer starts from other parameters; it must take the swarm's.
    let mut config = diloco_config(3);
    config.load_state = true;
    let joiner = start(
        &swarm,
        2,
        random(&mut rng, &LENS),
        averager_config("dl-late", 2),
        config,
    )
    .await;
    assert_eq!(joiner.epoch(), 2, "the joiner is at the swarm's epoch");
    assert_eq!(
        joiner.outer_state(),
        peers[0].outer_state(),
        "the joiner holds the outer state"
    );
    assert_eq!(joiner.params(), peers[0].outer_state().0.as_slice());
    peers.push(joiner);
    for e in 3..=4u64 {
        let ends = epoch(&mut peers, &targets, 3).await;
        assert_all_averaged(&ends, e, 3);
        assert_identical(&peers, &format!("epoch {e}"));
    }
    finish(peers, swarm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_with_nobody_is_deferred_and_its_inner_steps_count_at_the_retry() {
    let (swarm, init, targets) = setup(2, 9, &LENS).await;
    let mut config = diloco_config(3);
    config.round_timeout = Duration::from_secs(4);
    let mut a = start(
        &swarm,
        0,
        init.clone(),
        averager_config("dl-defer", 2),
        config.clone(),
    )
    .await;
    // Alone: the outer step finds no group and is deferred, without an error.
    for _ in 0..2 {
        inner_step(a.params_mut(), &targets[0]);
        assert_eq!(a.inner_step_done().await, None);
    }
    inner_step(a.params_mut(), &targets[0]);
    let end = a.inner_step_done().await.expect("the epoch ends");
    assert!(
        matches!(end, OuterStep::Deferred { epoch: 0, .. }),
        "{end:?}"
    );
    assert_eq!(a.epoch(), 0);
    assert_eq!(
        a.params(),
        inner_only(&init, &targets[0], 3).as_slice(),
        "inner work kept"
    );
    // B arrives; A's next inner step retries the outer step with four inner steps' work.
    let b = start(
        &swarm,
        1,
        init.clone(),
        averager_config("dl-defer", 2),
        config,
    )
    .await;
    let mut peers = vec![a, b];
    inner_step(peers[0].params_mut(), &targets[0]);
    for _ in 0..2 {
        inner_step(peers[1].params_mut(), &targets[1]);
        assert_eq!(peers[1].inner_step_done().await, None);
    }
    inner_step(peers[1].params_mut(), &targets[1]);
    let ends = futures::future::join_all(
        peers
            .iter_mut()
            .map(|p| async move { p.inner_step_done().await.expect("both end the epoch") }),
    )
    .await;
    assert_all_averaged(&ends, 1, 2);
    let (mut s, mut m) = (init.clone(), vec![vec![0.0; 300], vec![0.0; 7]]);
    reference_step(
        &mut s,
        &mut m,
        &[
            inner_only(&init, &targets[0], 4),
            inner_only(&init, &targets[1], 3),
        ],
    );
    assert_identical(&peers, "after the retry");
    assert_close(
        &peers[0].outer_state().0,
        &s,
        "outer step with the deferred inner work",
    );
    finish(peers, swarm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_error_feedback_top_k_every_peer_still_ends_identical() {
    let (swarm, init, targets) = setup(3, 10, &[4096, 64]).await;
    let mut peers = Vec::new();
    for i in 0..3 {
        let mut c = averager_config("dl-ef", 3);
        c.compression = Compression::Sparse(SparseTopK::new(0.05, 4, 512).unwrap());
        peers.push(start(&swarm, i, init.clone(), c, diloco_config(2)).await);
    }
    for e in 1..=3u64 {
        let ends = epoch(&mut peers, &targets, 2).await;
        assert_all_averaged(&ends, e, 3);
        assert_identical(&peers, &format!("epoch {e}"));
        // What was not sent waits in the residuals.
        let residuals = peers[0]
            .averager()
            .residuals()
            .expect("sparse keeps residuals");
        assert!(
            residuals.iter().flatten().any(|r| *r != 0.0),
            "epoch {e}: no residual"
        );
    }
    finish(peers, swarm).await;
}
