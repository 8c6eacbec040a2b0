//! `hivemesh demo`: a swarm of local peers in one process averaging random vectors on a
//! Moshpit grid, with progress bars, ending with `demo peers=P rounds=R max_dev=E`.
//!
//! One bootstrap DHT node, then `peers` nodes (real libp2p on loopback, each with a TLS data
//! listener) join through it. Every peer holds its own random vector and an averager whose
//! group keys come from a `group^dims` grid (`peers` must be a power of `group`). Round `t`
//! groups the peers along dimension `t mod dims`, so after `dims` rounds every peer holds the
//! exact global mean; the demo prints, per round, the largest distance of any peer's vector
//! from the global mean.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig, KeySchedule, StepOptions};
use hivemesh::matchmaking::Grid;
use hivemesh::tensor::Tensor;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// `hivemesh demo` options.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Number of peers (a power of --group-size).
    #[arg(long, default_value_t = 16)]
    peers: usize,
    /// Group size (the grid's side).
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    /// Elements per vector.
    #[arg(long, default_value_t = 100_000)]
    size: usize,
    /// Averaging rounds (default: the grid's dimensions, enough for the exact mean).
    #[arg(long)]
    rounds: Option<usize>,
    /// Seed of the random vectors.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hide the progress bars.
    #[arg(long)]
    quiet: bool,
}

fn dims_of(peers: usize, side: usize) -> Option<usize> {
    let mut cells = 1usize;
    for dims in 1..=16 {
        cells = cells.checked_mul(side)?;
        if cells == peers {
            return Some(dims);
        }
        if cells > peers {
            return None;
        }
    }
    None
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    ensure!(
        (2..=64).contains(&args.group_size),
        "--group-size must be between 2 and 64"
    );
    ensure!(
        (2..=256).contains(&args.peers),
        "--peers must be between 2 and 256"
    );
    ensure!(
        (1..=64 << 20).contains(&args.size),
        "--size must be between 1 and 67108864"
    );
    let Some(dims) = dims_of(args.peers, args.group_size) else {
        bail!(
            "--peers {} is not a power of --group-size {} (the Moshpit grid needs peers = \
             group_size^k, e.g. 16 = 4^2 or 64 = 4^3)",
            args.peers,
            args.group_size
        );
    };
    let rounds = args.rounds.unwrap_or(dims);
    ensure!(
        (1..=100).contains(&rounds),
        "--rounds must be between 1 and 100"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(demo(args, dims, rounds))
}

async fn demo(args: DemoArgs, dims: usize, rounds: usize) -> anyhow::Result<()> {
    let started = Instant::now();
    let grid = Grid::new(args.group_size, dims)?;
    let bootstrap = Node::start(
        NodeConfig::loopback_bootstrap(),
        libp2p::identity::Keypair::generate_ed25519(),
    )
    .await
    .context("starting the bootstrap node")?;
    let bootstrap_addr = bootstrap.join_address().await?;

    let mut rng = StdRng::seed_from_u64(args.seed);
    let vectors: Vec<Vec<f32>> = (0..args.peers)
        .map(|_| {
            (0..args.size)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect()
        })
        .collect();
    let mean: Vec<f64> = (0..args.size)
        .map(|e| vectors.iter().map(|v| f64::from(v[e])).sum::<f64>() / args.peers as f64)
        .collect();

    let mut nodes = Vec::new();
    let mut averagers = Vec::new();
    for (i, values) in vectors.into_iter().enumerate() {
        let mut config = NodeConfig::loopback();
        config.p2p.initial_peers = vec![bootstrap_addr.clone()];
        let node = Node::start(config, libp2p::identity::Keypair::generate_ed25519())
            .await
            .with_context(|| format!("starting peer {i}"))?;
        let mut cfg = AveragerConfig::new("demo");
        cfg.target_group_size = Some(args.group_size);
        cfg.min_group_size = args.group_size;
        cfg.min_matchmaking_time = Duration::from_secs(2);
        cfg.keys = KeySchedule::Grid {
            grid,
            coords: grid.coords_of_index(i),
        };
        let tensor = Tensor::from_f32(&[args.size], values)?;
        let averager = Averager::start(node.dht().clone(), node.hub().clone(), vec![tensor], cfg)?;
        nodes.push(node);
        averagers.push(Arc::new(averager));
    }
    let deviation = |averagers: &[Arc<Averager>]| -> f64 {
        averagers
            .iter()
            .map(|a| {
                let tensors = a.tensors();
                let v = tensors[0].to_f32_vec();
                v.iter()
                    .zip(&mean)
                    .map(|(&x, &m)| (f64::from(x) - m).abs())
                    .fold(0.0, f64::max)
            })
            .fold(0.0, f64::max)
    };
    if !args.quiet {
        eprintln!(
            "{} peers on a {}^{} grid, {} elements each; initial max |x - mean| = {:.3e}",
            args.peers,
            args.group_size,
            dims,
            args.size,
            deviation(&averagers)
        );
    }

    let bars = MultiProgress::new();
    if args.quiet {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template("{prefix:>9} [{bar:32}] {pos}/{len} peers {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    let mut max_dev = deviation(&averagers);
    for round in 0..rounds {
        let bar = bars.add(ProgressBar::new(args.peers as u64));
        bar.set_style(style.clone());
        bar.set_prefix(format!("round {}", round + 1));
        let mut steps = tokio::task::JoinSet::new();
        for (i, averager) in averagers.iter().enumerate() {
            let averager = averager.clone();
            steps.spawn(async move {
                let options = StepOptions {
                    timeout: Some(Duration::from_secs(60)),
                    round: Some(round as u64),
                    ..StepOptions::default()
                };
                (i, averager.step(options).await)
            });
        }
        let mut failed = Vec::new();
        while let Some(joined) = steps.join_next().await {
            let (i, result) = joined.context("a step task panicked")?;
            if let Err(e) = result {
                failed.push(format!("peer {i}: {e}"));
            }
            bar.inc(1);
        }
        max_dev = deviation(&averagers);
        bar.finish_with_message(format!("max |x - mean| = {max_dev:.3e}"));
        bars.suspend(|| println!("round {}: max_dev={max_dev:.3e}", round + 1));
        ensure!(
            failed.is_empty(),
            "round {}: {} step(s) failed: {}",
            round + 1,
            failed.len(),
            failed.join("; ")
        );
    }
    for averager in averagers {
        if let Ok(averager) = Arc::try_unwrap(averager) {
            averager.shutdown().await;
        }
    }
    for node in nodes {
        node.shutdown().await;
    }
    bootstrap.shutdown().await;
    if !args.quiet {
        eprintln!("done in {:.1} s", started.elapsed().as_secs_f64());
    }
    println!(
        "demo peers={} rounds={rounds} max_dev={max_dev:.3e}",
        args.peers
    );
    Ok(())
}
