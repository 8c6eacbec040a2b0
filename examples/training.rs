//! Decentralized training: logistic regression on a synthetic dataset split into one shard per
//! peer. Each peer runs mini-batch SGD on its own shard, reports its samples to a
//! `hivemesh::train::ProgressTracker`, and whenever the swarm's progress says the collaborative
//! epoch is over (the peers together accumulated `--average-every × --batch × --peers`
//! samples, or will have by now at their reported rates) it averages its parameters with the
//! others through `Averager::step()` and moves to the next epoch. A single-process
//! baseline trains on the union of the shards with the same hyperparameters; the example
//! prints both losses (on the full dataset) per epoch and fails unless the decentralized model
//! ends within `--tolerance` of the baseline.
//!
//! Usage: `cargo run --release --example training [-- --peers 4 --epochs 10 --blocking]`
//!
//! All peers live in this process: one bootstrap DHT node and one node per peer, real libp2p
//! and TLS links on loopback (as `hivemesh demo`). Every step averages all peers
//! (`target_group_size = min_group_size = --peers`), weighted by shard size. By default each
//! peer is a tokio task that awaits `step()`; `--blocking` runs each peer on its own OS thread
//! with a `BlockingAverager`, as a synchronous training loop would.
//!
//! The dataset (fixed `--seed`): `x` uniform in [-1, 1]^d plus a bias feature, labels drawn
//! from a logistic model with weights `w*` (`y = 1` with probability `sigmoid(w*·x)`), so the
//! classes are separable up to label noise. The shards are equal, shuffled slices.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig, BlockingAverager, StepOptions};
use hivemesh::tensor::{PartViewMut, Tensor};
use hivemesh::train::{ProgressConfig, ProgressTracker};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

#[derive(Parser, Debug, Clone)]
#[command(about = "Decentralized logistic regression over hivemesh averagers")]
struct Args {
    /// Number of peers (one shard each).
    #[arg(long, default_value_t = 4)]
    peers: usize,
    /// Samples in the whole dataset.
    #[arg(long, default_value_t = 8192)]
    samples: usize,
    /// Features per sample (a bias feature is added).
    #[arg(long, default_value_t = 16)]
    features: usize,
    /// Passes over each shard (and over the union, for the baseline).
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Mini-batch size.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.5)]
    lr: f32,
    /// Local SGD steps per peer in one collaborative epoch (the swarm's target is this many
    /// batches per peer); the peers average once per collaborative epoch.
    #[arg(long, default_value_t = 16)]
    average_every: usize,
    /// Simulated compute time of one SGD step, in milliseconds (the real step takes
    /// microseconds, far less than the progress tracker's refresh period).
    #[arg(long, default_value_t = 5)]
    step_ms: u64,
    /// Seed of the dataset, the shards and the batch order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run each peer on an OS thread with a `BlockingAverager` (a synchronous training loop).
    #[arg(long)]
    blocking: bool,
    /// Fail unless the decentralized loss ends below `tolerance × baseline loss`.
    #[arg(long, default_value_t = 1.05)]
    tolerance: f64,
}

/// Samples, row-major with the bias feature last, and 0/1 labels.
struct Dataset {
    dim: usize,
    /// The generating weights.
    truth: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Dataset {
    fn synthetic(samples: usize, features: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let dim = features + 1;
        let truth: Vec<f32> = (0..dim).map(|_| rng.random_range(-3.0..3.0)).collect();
        let mut x = Vec::with_capacity(samples * dim);
        let mut y = Vec::with_capacity(samples);
        for _ in 0..samples {
            let row: Vec<f32> = (0..features)
                .map(|_| rng.random_range(-1.0..1.0))
                .chain([1.0])
                .collect();
            let p = sigmoid(dot(&truth, &row));
            y.push(if rng.random::<f32>() < p { 1.0 } else { 0.0 });
            x.extend(row);
        }
        Self { dim, truth, x, y }
    }

    fn len(&self) -> usize {
        self.y.len()
    }

    fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.dim..(i + 1) * self.dim]
    }

    /// Mean log-loss and accuracy of `w` on the samples `rows`.
    fn evaluate(&self, w: &[f32], rows: impl Iterator<Item = usize>) -> (f64, f64) {
        let (mut loss, mut correct, mut n) = (0.0f64, 0usize, 0usize);
        for i in rows {
            let z = f64::from(dot(w, self.row(i)));
            let y = f64::from(self.y[i]);
            // log(1 + e^z) - y z, computed stably.
            loss += z.max(0.0) + (-z.abs()).exp().ln_1p() - y * z;
            correct += usize::from((z > 0.0) == (y > 0.5));
            n += 1;
        }
        (loss / n as f64, correct as f64 / n as f64)
    }

    fn evaluate_all(&self, w: &[f32]) -> (f64, f64) {
        self.evaluate(w, 0..self.len())
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Mini-batch SGD over a fixed set of rows, reshuffled every epoch.
struct Sgd {
    rows: Vec<usize>,
    next: usize,
    batch: usize,
    lr: f32,
    rng: StdRng,
    grad: Vec<f32>,
}

impl Sgd {
    fn new(mut rows: Vec<usize>, batch: usize, lr: f32, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        rows.shuffle(&mut rng);
        Self {
            rows,
            next: 0,
            batch,
            lr,
            rng,
            grad: Vec::new(),
        }
    }

    fn steps_per_epoch(&self) -> usize {
        self.rows.len() / self.batch
    }

    /// One step on the next mini-batch.
    fn step(&mut self, data: &Dataset, w: &mut [f32]) {
        if self.next + self.batch > self.rows.len() {
            self.rows.shuffle(&mut self.rng);
            self.next = 0;
        }
        self.grad.clear();
        self.grad.resize(w.len(), 0.0);
        for &i in &self.rows[self.next..self.next + self.batch] {
            let x = data.row(i);
            let err = sigmoid(dot(w, x)) - data.y[i];
            for (g, xi) in self.grad.iter_mut().zip(x) {
                *g += err * xi;
            }
        }
        self.next += self.batch;
        let scale = self.lr / self.batch as f32;
        for (wi, g) in w.iter_mut().zip(&self.grad) {
            *wi -= scale * g;
        }
    }
}

/// One peer's training state: its shard's SGD and the parameters.
struct Peer {
    sgd: Sgd,
    w: Vec<f32>,
    /// Averaging weight (shard size).
    weight: f64,
    /// How long each averaging step took.
    step_times: Vec<Duration>,
}

impl Peer {
    /// Copies the parameters into the averager's tensor (before a step).
    fn publish(&self, tensors: &mut [Tensor]) {
        if let PartViewMut::F32(t) = tensors[0].flat_mut() {
            t.copy_from_slice(&self.w);
        }
    }

    /// Copies the averaged tensor back into the parameters (after a step).
    fn adopt(&mut self, tensors: &[Tensor]) {
        self.w = tensors[0].to_f32_vec();
    }

    fn step_options(&self) -> StepOptions {
        StepOptions {
            weight: self.weight,
            timeout: Some(Duration::from_secs(60)),
            ..StepOptions::default()
        }
    }
}

/// What every peer runs: collaborative epochs (one averaging step each) until the swarm has
/// seen the dataset `epochs` times.
#[derive(Clone, Copy)]
struct Schedule {
    epochs: usize,
    steps_per_epoch: usize,
    average_every: usize,
    batch: usize,
    step_time: Duration,
}

impl Schedule {
    /// Collaborative epochs in the run: enough for `epochs` passes over every shard.
    fn rounds(&self) -> u64 {
        (self.epochs * self.steps_per_epoch).div_ceil(self.average_every) as u64
    }

    /// The dataset epoch (counted from 0) that ends with collaborative epoch `round` (counted
    /// from 1), if one does.
    fn dataset_epoch_ending(&self, round: u64) -> Option<usize> {
        let passes = |r: u64| r as usize * self.average_every / self.steps_per_epoch;
        let (before, after) = (passes(round - 1), passes(round));
        (after > before && before < self.epochs).then_some(before)
    }

    /// The tracker's parameters: the target is `average_every` batches from every peer.
    fn progress(&self, peers: usize) -> ProgressConfig {
        let mut cfg = ProgressConfig::new((self.average_every * self.batch * peers) as u64);
        cfg.min_refresh_period = Duration::from_millis(20);
        cfg.max_refresh_period = Duration::from_millis(500);
        cfg.default_refresh_period = Duration::from_millis(100);
        cfg.metadata_expiration = Duration::from_secs(30);
        cfg
    }
}

/// What peer 0 reports at the end of each epoch.
type EpochReport = (usize, Vec<f32>);

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    ensure!((2..=64).contains(&args.peers), "--peers must be 2..=64");
    ensure!(args.features >= 1, "--features must be at least 1");
    ensure!(args.batch >= 1, "--batch must be at least 1");
    ensure!(args.epochs >= 1, "--epochs must be at least 1");
    ensure!(
        args.average_every >= 1,
        "--average-every must be at least 1"
    );
    ensure!(
        args.samples / args.peers >= args.batch,
        "every shard needs at least one batch: --samples / --peers >= --batch"
    );
    let started = Instant::now();
    let data = Arc::new(Dataset::synthetic(args.samples, args.features, args.seed));

    // The baseline: one model, all the data, the same batch size and learning rate.
    let mut baseline_w = vec![0.0f32; data.dim];
    let mut baseline = Sgd::new(
        (0..data.len()).collect(),
        args.batch,
        args.lr,
        args.seed + 1,
    );
    let mut baseline_losses = Vec::new();
    for _ in 0..args.epochs {
        for _ in 0..baseline.steps_per_epoch() {
            baseline.step(&data, &mut baseline_w);
        }
        baseline_losses.push(data.evaluate_all(&baseline_w).0);
    }

    // The shards: a shuffled split into equal parts (the remainder is dropped).
    let mut order: Vec<usize> = (0..data.len()).collect();
    order.shuffle(&mut StdRng::seed_from_u64(args.seed + 2));
    let shard_len = data.len() / args.peers;
    let peers: Vec<Peer> = (0..args.peers)
        .map(|p| Peer {
            sgd: Sgd::new(
                order[p * shard_len..(p + 1) * shard_len].to_vec(),
                args.batch,
                args.lr,
                args.seed + 10 + p as u64,
            ),
            w: vec![0.0; data.dim],
            weight: shard_len as f64,
            step_times: Vec::new(),
        })
        .collect();
    let schedule = Schedule {
        epochs: args.epochs,
        steps_per_epoch: peers[0].sgd.steps_per_epoch(),
        average_every: args.average_every,
        batch: args.batch,
        step_time: Duration::from_millis(args.step_ms),
    };
    println!(
        "{} samples x {} features, {} peers x {} samples, batch {}, lr {}, averaging every {} \
         samples of the swarm ({} steps per epoch, {})",
        data.len(),
        args.features,
        args.peers,
        shard_len,
        args.batch,
        args.lr,
        args.average_every * args.batch * args.peers,
        schedule.steps_per_epoch,
        if args.blocking {
            "blocking threads"
        } else {
            "async tasks"
        },
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (nodes, averagers, trackers) =
        runtime.block_on(start_swarm(args.peers, data.dim, schedule))?;

    // Peer 0 reports its parameters after every epoch; the main thread prints the losses.
    let (reports, mut epochs) = tokio::sync::mpsc::unbounded_channel::<EpochReport>();
    let print_epoch = |(epoch, w): EpochReport| {
        let (loss, acc) = data.evaluate_all(&w);
        println!(
            "epoch {:>2}: peer 0 loss={loss:.4} acc={acc:.3}   baseline loss={:.4}",
            epoch + 1,
            baseline_losses[epoch]
        );
    };
    let finished: Vec<(Peer, usize)> = if args.blocking {
        let handle = runtime.handle().clone();
        let threads: Vec<_> = peers
            .into_iter()
            .zip(averagers)
            .zip(trackers.iter().cloned())
            .enumerate()
            .map(|(p, ((peer, averager), tracker))| {
                let handle = handle.clone();
                let averager = BlockingAverager::new(averager, handle.clone());
                let reports = (p == 0).then(|| reports.clone());
                let data = data.clone();
                std::thread::spawn(move || {
                    let ctx = PeerLoop {
                        p,
                        tracker,
                        schedule,
                        reports,
                    };
                    train_blocking(ctx, peer, averager, &handle, &data)
                })
            })
            .collect();
        drop(reports);
        while let Some(report) = epochs.blocking_recv() {
            print_epoch(report);
        }
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| anyhow::anyhow!("a peer thread panicked"))?
            })
            .collect::<anyhow::Result<_>>()?
    } else {
        runtime.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            let peers = peers
                .into_iter()
                .zip(averagers)
                .zip(trackers.iter().cloned());
            for (p, ((peer, averager), tracker)) in peers.enumerate() {
                let reports = (p == 0).then(|| reports.clone());
                let ctx = PeerLoop {
                    p,
                    tracker,
                    schedule,
                    reports,
                };
                tasks.spawn(train_async(ctx, peer, averager, data.clone()));
            }
            drop(reports);
            while let Some(report) = epochs.recv().await {
                print_epoch(report);
            }
            let mut finished = Vec::new();
            while let Some(joined) = tasks.join_next().await {
                finished.push(joined.context("a peer task panicked")??);
            }
            finished.sort_by_key(|(_, p)| *p);
            anyhow::Ok(finished)
        })?
    };
    runtime.block_on(async {
        for tracker in &trackers {
            tracker.shutdown(Duration::from_secs(10)).await?;
        }
        for node in nodes {
            node.shutdown().await;
        }
        anyhow::Ok(())
    })?;

    // Final comparison.
    let (base_loss, base_acc) = data.evaluate_all(&baseline_w);
    let (loss, acc) = data.evaluate_all(&finished[0].0.w);
    let spread = finished
        .iter()
        .map(|(peer, _)| {
            peer.w
                .iter()
                .zip(&finished[0].0.w)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .fold(0.0, f64::max);
    // The loss of the generating weights: what no model beats by much.
    let (truth_loss, _) = data.evaluate_all(&data.truth);
    println!("final: decentralized loss={loss:.4} acc={acc:.3}");
    println!("final: baseline      loss={base_loss:.4} acc={base_acc:.3}");
    println!("final: generating weights loss={truth_loss:.4}");
    println!("final: max distance between peers' parameters = {spread:.3e}");
    let mut times = finished[0].0.step_times.clone();
    times.sort();
    println!(
        "averaging: {} steps per peer, median {:.1} ms, slowest {:.1} ms",
        times.len(),
        times[times.len() / 2].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3
    );
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    ensure!(
        loss <= args.tolerance * base_loss,
        "the decentralized loss {loss:.4} is not within {}x of the baseline's {base_loss:.4} \
         (each peer makes 1/{} as many updates per epoch as the baseline: try more --epochs)",
        args.tolerance,
        args.peers
    );
    ensure!(
        spread < 1e-4,
        "peers ended with different parameters (distance {spread:.3e})"
    );
    Ok(())
}

/// A bootstrap node and one node + averager + progress tracker per peer, on loopback.
async fn start_swarm(
    peers: usize,
    dim: usize,
    schedule: Schedule,
) -> anyhow::Result<(Vec<Node>, Vec<Averager>, Vec<Arc<ProgressTracker>>)> {
    let bootstrap = Node::start(
        NodeConfig::loopback_bootstrap(),
        libp2p::identity::Keypair::generate_ed25519(),
    )
    .await
    .context("starting the bootstrap node")?;
    let addr = bootstrap.join_address().await?;
    let mut nodes = vec![bootstrap];
    let mut averagers = Vec::new();
    let mut trackers = Vec::new();
    for p in 0..peers {
        let mut config = NodeConfig::loopback();
        config.p2p.initial_peers = vec![addr.clone()];
        let node = Node::start(config, libp2p::identity::Keypair::generate_ed25519())
            .await
            .with_context(|| format!("starting peer {p}"))?;
        let mut cfg = AveragerConfig::new("training-example");
        // Every step averages all peers: the group closes once everyone is in.
        cfg.target_group_size = Some(peers);
        cfg.min_group_size = peers;
        cfg.min_matchmaking_time = Duration::from_secs(5);
        let params = Tensor::from_f32(&[dim], vec![0.0; dim])?;
        averagers.push(Averager::start(
            node.dht().clone(),
            node.hub().clone(),
            vec![params],
            cfg,
        )?);
        let tracker = ProgressTracker::new(
            node.dht().clone(),
            "training-example",
            schedule.progress(peers),
        )
        .await?;
        tracker.start();
        trackers.push(Arc::new(tracker));
        nodes.push(node);
    }
    // The bootstrap node is shut down last.
    nodes.rotate_left(1);
    Ok((nodes, averagers, trackers))
}

/// What a peer's loop needs besides its model and averager.
struct PeerLoop {
    p: usize,
    tracker: Arc<ProgressTracker>,
    schedule: Schedule,
    reports: Option<tokio::sync::mpsc::UnboundedSender<EpochReport>>,
}

impl PeerLoop {
    /// One local step's bookkeeping: reports `samples` toward `epoch`; whether the swarm's
    /// collaborative epoch is over.
    fn report(&self, epoch: u64, samples: u64) -> bool {
        self.tracker.report_local_progress(epoch, samples, true);
        self.tracker.ready_to_update_epoch()
    }

    /// After the averaging step of `epoch`: moves to the next collaborative epoch (every peer
    /// averaged in this one, so none skips ahead) and reports the dataset epoch it ends.
    fn next_epoch(&self, epoch: u64, peer: &Peer) -> u64 {
        let _paused = self.tracker.pause_updates();
        let next = self.tracker.update_epoch(Some(epoch + 1));
        if let (Some(reports), Some(pass)) =
            (&self.reports, self.schedule.dataset_epoch_ending(next))
        {
            let _ = reports.send((pass, peer.w.clone()));
        }
        next
    }
}

/// A peer as a tokio task: local SGD, `step().await` when the swarm's epoch is over.
async fn train_async(
    ctx: PeerLoop,
    mut peer: Peer,
    averager: Averager,
    data: Arc<Dataset>,
) -> anyhow::Result<(Peer, usize)> {
    let (mut epoch, mut samples) = (0, 0);
    while epoch < ctx.schedule.rounds() {
        peer.sgd.step(&data, &mut peer.w);
        samples += ctx.schedule.batch as u64;
        tokio::time::sleep(ctx.schedule.step_time).await;
        if ctx.report(epoch, samples) {
            peer.publish(&mut averager.tensors());
            let started = Instant::now();
            averager
                .step(peer.step_options())
                .await
                .with_context(|| format!("peer {}: averaging in epoch {epoch}", ctx.p))?;
            peer.step_times.push(started.elapsed());
            peer.adopt(&averager.tensors());
            epoch = ctx.next_epoch(epoch, &peer);
            samples = 0;
        }
    }
    averager.shutdown().await;
    Ok((peer, ctx.p))
}

/// A peer as an OS thread: local SGD, a blocking `step()` when the swarm's epoch is over.
fn train_blocking(
    ctx: PeerLoop,
    mut peer: Peer,
    averager: BlockingAverager,
    handle: &tokio::runtime::Handle,
    data: &Dataset,
) -> anyhow::Result<(Peer, usize)> {
    let (mut epoch, mut samples) = (0, 0);
    while epoch < ctx.schedule.rounds() {
        peer.sgd.step(data, &mut peer.w);
        samples += ctx.schedule.batch as u64;
        std::thread::sleep(ctx.schedule.step_time);
        if ctx.report(epoch, samples) {
            peer.publish(&mut averager.tensors());
            let started = Instant::now();
            averager
                .step(peer.step_options())
                .with_context(|| format!("peer {}: averaging in epoch {epoch}", ctx.p))?;
            peer.step_times.push(started.elapsed());
            peer.adopt(&averager.tensors());
            epoch = ctx.next_epoch(epoch, &peer);
            samples = 0;
        }
    }
    if let Ok(averager) = std::sync::Arc::try_unwrap(averager.into_inner()) {
        handle.block_on(averager.shutdown());
    }
    Ok((peer, ctx.p))
}
