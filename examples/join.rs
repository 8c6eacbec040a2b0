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
//! Behind a home router nothing changes: the peer finds out that it is behind a NAT, reserves a
//! slot on a relay (a `hivemesh dht` node relays by default), and takes part as a node whose
//! links to other NATed peers are hole-punched, or as a client when its NAT cannot be punched
//! through. `--allow-relayed-data` lets its tensor data go through the relay when no direct
//! connection can be made.
//!
//! A private swarm: make a key with `hivemesh swarm-key swarm.key`, start the DHT node with
//! `--swarm-key swarm.key` and every peer with the same flag; peers without the key cannot
//! connect.
//!
//! `--hold-after R` stops the peer after round R: it prints `held after round R` and waits for a
//! line on stdin before round R+1 (tests take a relay away while every peer is held).
//!
//! `--adaptive-timeouts MIN,MAX,FACTOR` derives the sender and reducer timeouts from the
//! members' measured rates and the observed gaps between parts (a slow but steady peer is not
//! banned), within the bounds.
//!
//! After every round a second line goes to stderr, for tests and the curious:
//! `round R: mode=M reach=C links=L contributors=MIN..MAX local_parts=N banned=B
//! failed_reducers=F` (L: how the link to each member was carried, in member order; MIN..MAX:
//! fewest and most members averaged into any part we hold; N: parts that kept local values; B:
//! senders we banned from our span, F: reducers that failed us). At exit it prints its hole punches and
//! relay reservations: `nat: punches_ok=.. punches_failed=.. reservations=.. reservations_lost=..`.

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
    /// IP address to listen on (libp2p TCP and QUIC, and the TLS data plane).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Let tensor data go through a relay when no direct connection can be made.
    #[arg(long)]
    allow_relayed_data: bool,
    /// Between two peers behind NATs, carry the round over a libp2p stream on the hole-punched
    /// connection instead of over TLS on a TCP connection made by a simultaneous open.
    #[arg(long)]
    no_punched_tls: bool,
    /// Seconds between the starts of two rounds (a training loop's compute between averaging
    /// steps); 0: back to back.
    #[arg(long, default_value_t = 0.0)]
    interval: f64,
    /// Join a private swarm: the key file its peers share (`hivemesh swarm-key FILE`; the
    /// DHT node runs with `--swarm-key FILE` too). TCP only.
    #[arg(long, value_name = "FILE")]
    swarm_key: Option<std::path::PathBuf>,
    /// Write the vector before the first round to `PREFIX.initial` and after the last to
    /// `PREFIX.final` (little-endian f32): tests compare every element with the exact mean.
    #[arg(long, value_name = "PREFIX")]
    dump: Option<std::path::PathBuf>,
    /// After round R (and before round R+1) print `held after round R` and wait for a line on
    /// stdin (or its end): tests change the network between two rounds while every peer is
    /// held. Repeatable.
    #[arg(long = "hold-after", value_name = "R")]
    hold_after: Vec<usize>,
    /// Sender and reducer timeouts from the part sizes, the members' measured rates and the
    /// gaps observed between parts, within MIN and MAX seconds and FACTOR expected gaps (e.g.
    /// `1,60,3`); without it, the fixed timeouts.
    #[arg(long = "adaptive-timeouts", value_name = "MIN,MAX,FACTOR", value_parser = adaptive_timeouts)]
    adaptive_timeouts: Option<hivemesh::allreduce::AdaptiveTimeouts>,
}

/// `MIN,MAX,FACTOR` (seconds, seconds, gaps) as adaptive timeout bounds the core accepts.
fn adaptive_timeouts(s: &str) -> Result<hivemesh::allreduce::AdaptiveTimeouts, String> {
    let numbers: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let [min, max, factor] = numbers[..] else {
        return Err(format!("expected MIN,MAX,FACTOR, got {s:?}"));
    };
    let secs = |v: f64| Duration::try_from_secs_f64(v).map_err(|e| format!("{v}: {e}"));
    let bounds = hivemesh::allreduce::AdaptiveTimeouts {
        min: secs(min)?,
        max: secs(max)?,
        factor,
    };
    if bounds.is_valid() {
        Ok(bounds)
    } else {
        Err(format!(
            "need 0 < MIN <= MAX and a finite FACTOR >= 1, got {s:?}"
        ))
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(
                    "warn,libp2p_kad::behaviour=error,libp2p_autonat=error,quinn_udp=error",
                )
            }),
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
    ensure!(
        args.interval.is_finite() && args.interval >= 0.0,
        "--interval must be a non-negative number of seconds"
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
    let swarm_key = args
        .swarm_key
        .as_deref()
        .map(hivemesh::p2p::SwarmKey::read)
        .transpose()?;
    let node = Node::start(
        NodeConfig {
            p2p: P2pConfig {
                listen: vec![
                    Multiaddr::from(args.host).with(Protocol::Tcp(0)),
                    Multiaddr::from(args.host)
                        .with(Protocol::Udp(0))
                        .with(Protocol::QuicV1),
                ],
                initial_peers: args.initial_peers.clone(),
                swarm_key,
                ..P2pConfig::loopback()
            },
            data_listen: Some(SocketAddr::new(args.host, 0)),
            hub: hivemesh::links::HubConfig {
                punched_tls: !args.no_punched_tls,
                ..hivemesh::links::HubConfig::default()
            },
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
    if let Some(prefix) = &args.dump {
        dump(prefix, "initial", &values)?;
    }

    // One stderr line per change of how others reach us (a relay going away, say).
    let mut reach = node.dht().p2p().watch_reachability();
    let watcher = tokio::spawn(async move {
        let mut last = String::new();
        loop {
            let r = reach.borrow_and_update().clone();
            let mut line = format!(
                "reachability: {}",
                r.reach.map_or("unknown", hivemesh::reach::Reach::name)
            );
            for a in &r.relayed {
                line += &format!(" relayed={a}");
            }
            if line != last {
                eprintln!("{line}");
                last = line;
            }
            if reach.changed().await.is_err() {
                break;
            }
        }
    });
    let mut config = AveragerConfig::new(args.prefix.clone());
    config.adaptive_timeouts = args.adaptive_timeouts;
    config.allow_relayed_data = args.allow_relayed_data;
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
    let mut next_start = Instant::now();
    for round in 1..=args.rounds {
        tokio::time::sleep_until(next_start.into()).await;
        next_start += Duration::from_secs_f64(args.interval);
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
                eprintln!("round {round}: {}", detail(&outcome));
            }
            Err(e) => {
                failed += 1;
                println!("round {round}: failed after {secs:.2} s: {e}");
            }
        }
        if args.hold_after.contains(&round) && round < args.rounds {
            hold(round).await?;
            // Round R+1 starts at the release: the hold stands in for the interval.
            next_start = Instant::now();
        }
    }
    if let Some(prefix) = &args.dump {
        dump(prefix, "final", &averager.tensors()[0].to_f32_vec())?;
    }
    let nat = node.dht().p2p().nat_stats();
    eprintln!(
        "nat: punches_ok={} punches_failed={} reservations={} reservations_lost={}",
        nat.punch_ok, nat.punch_failed, nat.reservations, nat.reservations_lost
    );
    averager.shutdown().await;
    watcher.abort();
    node.shutdown().await;
    ensure!(
        failed == 0,
        "{failed} of {} rounds found no group",
        args.rounds
    );
    Ok(())
}

/// Prints `held after round R` and waits until stdin yields a line or ends.
async fn hold(round: usize) -> anyhow::Result<()> {
    use std::io::Write;
    println!("held after round {round}");
    std::io::stdout().flush()?;
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(drop)
    })
    .await?
    .context("reading the release line from stdin")
}

/// The stderr line about a round: mode, reachability, how each link was carried, and how many
/// members the parts we hold average.
fn detail(outcome: &hivemesh::averager::StepOutcome) -> String {
    let links: Vec<String> = outcome
        .links
        .iter()
        .enumerate()
        .map(|(i, l)| match l {
            _ if i == outcome.me => "self".to_owned(),
            Some(kind) => kind.to_string(),
            None => "-".to_owned(),
        })
        .collect();
    let counts: Vec<usize> = outcome
        .report
        .spans
        .iter()
        .flat_map(|s| &s.segments)
        .map(|seg| seg.contributors.as_ref().map_or(0, |c| c.len()))
        .collect();
    // Mbit/s at which our sends to each member were paced (`-`: not paced).
    let paced: Vec<String> = outcome
        .paces
        .iter()
        .map(|p| p.map_or("-".to_owned(), |p| format!("{:.1}", p * 8e-6)))
        .collect();
    format!(
        "mode={} reach={} links={} contributors={}..{} local_parts={} banned={} failed_reducers={} paced_mbit={}",
        outcome.mode,
        outcome.reach,
        links.join(","),
        counts.iter().min().copied().unwrap_or(0),
        counts.iter().max().copied().unwrap_or(0),
        outcome.report.local_parts().count(),
        outcome.report.banned.len(),
        outcome.report.failed_reducers.len(),
        paced.join(",")
    )
}

/// Writes `values` to `{prefix}.{what}` as little-endian f32.
fn dump(prefix: &std::path::Path, what: &str, values: &[f32]) -> anyhow::Result<()> {
    let mut path = prefix.as_os_str().to_owned();
    path.push(format!(".{what}"));
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))
}

fn mean(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64
}
