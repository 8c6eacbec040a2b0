//! A peer that joins a running swarm and averages a random vector with whoever else is there:
//! the two-terminal example.
//!
//! Usage:
//!
//! ```sh
//! # terminal 1: a bootstrap/DHT node; it prints its address
//! cargo run --release -- dht --listen /ip4/127.0.0.1/tcp/4001
//! # terminals 2..n, started within a few seconds of each other:
//! cargo run --release --example join -- --initial-peer /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...
//! ```
//!
//! Each peer holds `--size` values scattered around its own random center, so its mean starts
//! anywhere in [0, 10). It calls `step()` `--rounds` times; groups close at `--group-size`
//! members, or with at least `--min-group-size` after `--matchmaking-time` seconds. After every
//! round it prints `round R: group=G mean=M` (G: the group's size, M: this peer's new mean), so
//! the means of all terminals converge to the average of the centers. It exits with status 1
//! if a round found no group within `--timeout` seconds (e.g. everyone else had finished).
//!
//! `--host` is the address to listen on (default 127.0.0.1); to average across machines pass
//! this machine's address, and start the DHT node with `--listen /ip4/0.0.0.0/tcp/4001`.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig, StepOptions};
use hivemesh::p2p::P2pConfig;
use hivemesh::tensor::Tensor;
use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

#[derive(Parser, Debug)]
#[command(about = "Join a hivemesh swarm and average a random vector with its peers")]
struct Args {
    /// A peer to join through, ending with /p2p/<peer id> (what `hivemesh dht` prints).
    /// Repeatable.
    #[arg(long = "initial-peer", value_name = "MADDR", required = true)]
    initial_peers: Vec<Multiaddr>,
    /// Averaging rounds (`step()` calls).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Close a group as soon as it has this many members.
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    /// Smallest group worth averaging in.
    #[arg(long, default_value_t = 2)]
    min_group_size: usize,
    /// Seconds to look for peers before closing a smaller group.
    #[arg(long, default_value_t = 5.0)]
    matchmaking_time: f64,
    /// Seconds a round may take, retries included, before it counts as failed.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Values in the vector.
    #[arg(long, default_value_t = 1000)]
    size: usize,
    /// Seed of the vector (default: random).
    #[arg(long)]
    seed: Option<u64>,
    /// Averaging prefix: only peers with the same prefix (and --size) average together.
    #[arg(long, default_value = "join-example")]
    prefix: String,
    /// IP address to listen on (libp2p TCP and the TLS data plane).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    ensure!(
        (2..=64).contains(&args.group_size),
        "--group-size must be between 2 and 64"
    );
    ensure!(
        (2..=args.group_size).contains(&args.min_group_size),
        "--min-group-size must be between 2 and --group-size"
    );
    ensure!(args.size >= 1, "--size must be at least 1");
    ensure!(
        args.matchmaking_time > 0.0 && args.timeout > 0.0,
        "--matchmaking-time and --timeout must be positive"
    );
    for addr in &args.initial_peers {
        ensure!(
            matches!(addr.iter().last(), Some(Protocol::P2p(_))),
            "--initial-peer {addr} must end with /p2p/<peer id>"
        );
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let node = Node::start(
        NodeConfig {
            p2p: P2pConfig {
                listen: vec![Multiaddr::from(args.host).with(Protocol::Tcp(0))],
                initial_peers: args.initial_peers.clone(),
                ..P2pConfig::loopback()
            },
            data_listen: Some(SocketAddr::new(args.host, 0)),
            ..NodeConfig::loopback()
        },
        libp2p::identity::Keypair::generate_ed25519(),
    )
    .await
    .context("joining the swarm")?;

    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let center: f32 = rng.random_range(0.0..10.0);
    let values: Vec<f32> = (0..args.size)
        .map(|_| center + rng.random_range(-1.0..1.0))
        .collect();
    println!(
        "peer {} joined; {} values, mean={:.4}",
        node.dht().p2p().peer_id(),
        args.size,
        mean(&values)
    );

    let mut config = AveragerConfig::new(args.prefix.clone());
    config.target_group_size = Some(args.group_size);
    config.min_group_size = args.min_group_size;
    config.min_matchmaking_time = Duration::from_secs_f64(args.matchmaking_time);
    let averager = Averager::start(
        node.dht().clone(),
        node.hub().clone(),
        vec![Tensor::from_f32(&[args.size], values)?],
        config,
    )?;

    let mut failed = 0;
    for round in 1..=args.rounds {
        let started = Instant::now();
        let result = averager
            .step(StepOptions {
                timeout: Some(Duration::from_secs_f64(args.timeout)),
                ..StepOptions::default()
            })
            .await;
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(outcome) => {
                let m = mean(&averager.tensors()[0].to_f32_vec());
                println!(
                    "round {round}: group={} mean={m:.4} ({secs:.2} s)",
                    outcome.members.len()
                );
            }
            Err(e) => {
                failed += 1;
                println!("round {round}: failed after {secs:.2} s: {e}");
            }
        }
    }
    averager.shutdown().await;
    node.shutdown().await;
    ensure!(
        failed == 0,
        "{failed} of {} rounds found no group",
        args.rounds
    );
    Ok(())
}

fn mean(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64
}
