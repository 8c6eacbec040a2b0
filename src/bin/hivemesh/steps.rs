//! `hivemesh bench steps`: P peers as OS processes, each running a node and an averager and
//! calling `step()` R times (matchmaking + all-reduce); prints
//! `hivemesh_steps peers=P group=G ok=K total=T median_step_s=S`.
//!
//! The parent runs the bootstrap node in-process and re-executes this binary as P
//! `bench-steps-worker`s, passing the bootstrap address. Each worker joins, prints `READY`,
//! and for every round waits for `GO <r>` on stdin (the parent sends it once every worker has
//! finished the previous round, so steps start together), runs one step and prints
//! `STEP <r> ok <seconds> <group size>` or `STEP <r> err <seconds> <message>`, and after its
//! last step stays in the swarm until the parent closes its stdin (once every worker has
//! reported), so no peer leaves while others still look for groups. Results are
//! checked: every member gathers its index, and after the first step a worker verifies a
//! sample of its elements against the mean of its group's initial values (recomputed from the
//! generator); later steps are checked for finiteness.

use std::time::{Duration, Instant};

use crate::workers::{Workers, stdin_lines};
use anyhow::{Context, bail, ensure};
use clap::Args;
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig, StepOptions};
use hivemesh::tensor::Tensor;

const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Options shared by the harness and its workers.
#[derive(Args, Debug, Clone)]
pub struct StepsArgs {
    /// Number of peer processes.
    #[arg(long, default_value_t = 16)]
    peers: usize,
    /// Target group size.
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    /// Steps per peer.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// MiB of f32 values per peer.
    #[arg(long, default_value_t = 4)]
    mib: usize,
    /// Matchmaking time before a smaller group is closed, in seconds (hivemind's default;
    /// full groups close at once, so this only bounds how long a peer whose messages were lost
    /// has to find its group again).
    #[arg(long, default_value_t = 5.0)]
    min_matchmaking_time: f64,
    /// Step timeout in seconds.
    #[arg(long, default_value_t = 60.0)]
    step_timeout: f64,
}

/// A worker's options.
#[derive(Args, Debug, Clone)]
pub struct StepsWorkerArgs {
    #[command(flatten)]
    steps: StepsArgs,
    /// This worker's index.
    #[arg(long)]
    index: usize,
    /// The bootstrap node's address.
    #[arg(long)]
    bootstrap: libp2p::Multiaddr,
}

impl StepsArgs {
    fn validate(&self) -> anyhow::Result<()> {
        crate::workers::validate_group(self.peers, self.group_size)?;
        ensure!(
            (1..=100).contains(&self.rounds),
            "--rounds must be between 1 and 100"
        );
        ensure!(
            (1..=1024).contains(&self.mib),
            "--mib must be between 1 and 1024"
        );
        ensure!(
            self.min_matchmaking_time > 0.0 && self.min_matchmaking_time <= 60.0,
            "--min-matchmaking-time must be in (0, 60]"
        );
        ensure!(
            self.step_timeout > 0.0 && self.step_timeout <= 3600.0,
            "--step-timeout must be in (0, 3600]"
        );
        Ok(())
    }

    fn elements(&self) -> usize {
        self.mib * (1 << 20) / 4
    }
}

/// The parent.
pub fn run(args: StepsArgs) -> anyhow::Result<()> {
    args.validate()?;
    let runtime = crate::workers::runtime(1)?;
    let (bootstrap, addr) = crate::workers::start_bootstrap(&runtime)?;

    let mut workers = Workers::spawn(
        args.peers,
        "bench-steps-worker",
        &[
            ("--bootstrap", addr.to_string()),
            ("--peers", args.peers.to_string()),
            ("--group-size", args.group_size.to_string()),
            ("--rounds", args.rounds.to_string()),
            ("--mib", args.mib.to_string()),
            (
                "--min-matchmaking-time",
                args.min_matchmaking_time.to_string(),
            ),
            ("--step-timeout", args.step_timeout.to_string()),
        ],
    )?;

    let mut ready = 0;
    while ready < args.peers {
        let (i, line) = workers
            .lines
            .recv_timeout(SETUP_TIMEOUT)
            .context("workers did not report ready in time")?;
        match line.as_str() {
            "READY" => ready += 1,
            "EOF" => bail!("worker {i} exited during setup"),
            other => bail!("worker {i}: unexpected line '{other}'"),
        }
    }
    // Successful steps' durations; workers stay until `finish` closes their stdin, so an
    // end of output before that is always an early exit.
    let mut times = Vec::new();
    let step_limit = Duration::from_secs_f64(args.step_timeout) + SETUP_TIMEOUT;
    for round in 0..args.rounds {
        workers.broadcast(&format!("GO {round}"))?;
        let mut round_times = Vec::new();
        let mut failures = Vec::new();
        while round_times.len() + failures.len() < args.peers {
            let (i, line) = workers
                .lines
                .recv_timeout(step_limit)
                .context("a step did not end in time")?;
            let fields: Vec<&str> = line.splitn(5, ' ').collect();
            match fields.as_slice() {
                ["STEP", r, "ok", secs, _size] if r.parse::<usize>()? == round => {
                    round_times.push(secs.parse::<f64>()?);
                }
                ["STEP", r, "err", _secs, message] if r.parse::<usize>()? == round => {
                    failures.push(format!("worker {i}: {message}"));
                }
                ["EOF"] => bail!("worker {i} exited early"),
                _ => bail!("worker {i}: unexpected line '{line}'"),
            }
        }
        eprintln!(
            "round {round}: {}/{} steps ok, slowest {:.3} s{}",
            round_times.len(),
            args.peers,
            round_times.iter().copied().fold(0.0, f64::max),
            if failures.is_empty() {
                String::new()
            } else {
                format!(" ({})", failures.join("; "))
            }
        );
        times.extend(round_times);
    }
    workers.finish()?;
    runtime.block_on(bootstrap.shutdown());
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "hivemesh_steps peers={} group={} ok={} total={} median_step_s={median:.4}",
        args.peers,
        args.group_size,
        times.len(),
        args.peers * args.rounds
    );
    Ok(())
}

/// One worker process.
pub fn run_worker(args: StepsWorkerArgs) -> anyhow::Result<()> {
    args.steps.validate()?;
    ensure!(args.index < args.steps.peers, "--index out of range");
    let runtime = crate::workers::runtime(2)?;
    runtime.block_on(worker(args))
}

/// The value every peer's element `e` starts with (so any peer can recompute a group's mean
/// from the members' indices).
fn initial(peer: usize, e: usize) -> f32 {
    hivemesh::sim::generated_value(7, peer, e)
}

async fn worker(args: StepsWorkerArgs) -> anyhow::Result<()> {
    let steps = &args.steps;
    let mut config = NodeConfig::loopback();
    config.p2p.initial_peers = vec![args.bootstrap.clone()];
    let node = Node::start(config, libp2p::identity::Keypair::generate_ed25519()).await?;
    let n = steps.elements();
    let values: Vec<f32> = (0..n).map(|e| initial(args.index, e)).collect();
    let mut cfg = AveragerConfig::new("bench-steps");
    cfg.target_group_size = Some(steps.group_size);
    cfg.min_matchmaking_time = Duration::from_secs_f64(steps.min_matchmaking_time);
    let averager = Averager::start(
        node.dht().clone(),
        node.hub().clone(),
        vec![Tensor::from_f32(&[n], values)?],
        cfg,
    )?;
    println!("READY");

    let mut lines = stdin_lines();
    for round in 0..steps.rounds {
        let go = lines.recv().await.context("parent closed stdin")?;
        ensure!(
            go == format!("GO {round}"),
            "expected GO {round}, got '{go}'"
        );
        let started = Instant::now();
        let result = averager
            .step(StepOptions {
                gather: bytes::Bytes::from(args.index.to_le_bytes().to_vec()),
                timeout: Some(Duration::from_secs_f64(steps.step_timeout)),
                ..StepOptions::default()
            })
            .await;
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(outcome) => {
                let after: Vec<f32> = averager.tensors()[0].to_f32_vec();
                ensure!(
                    after.iter().all(|x| x.is_finite()),
                    "non-finite values after step {round}"
                );
                let members: Vec<usize> = outcome
                    .gathered
                    .iter()
                    .map(|g| {
                        let bytes: [u8; 8] = g[..].try_into().unwrap_or([0xff; 8]);
                        usize::from_le_bytes(bytes)
                    })
                    .collect();
                ensure!(
                    members.iter().all(|&m| m < steps.peers),
                    "bad gathered bytes"
                );
                if round == 0 {
                    // First step: everyone starts from the generator, so the mean is known.
                    for e in (0..n).step_by(4099) {
                        let mean = members
                            .iter()
                            .map(|&m| f64::from(initial(m, e)))
                            .sum::<f64>()
                            / members.len() as f64;
                        ensure!(
                            (f64::from(after[e]) - mean).abs() < 1e-5,
                            "element {e}: {} vs group mean {mean}",
                            after[e]
                        );
                    }
                }
                println!("STEP {round} ok {secs:.6} {}", outcome.members.len());
            }
            Err(e) => println!("STEP {round} err {secs:.6} {e}"),
        }
    }
    // Stay in the swarm until every worker is done (the parent closes stdin then): a peer
    // that left early would leave stale declarations and refuse the others' join requests,
    // which measures our exit, not a step.
    while lines.recv().await.is_some() {}
    averager.shutdown().await;
    node.shutdown().await;
    Ok(())
}
