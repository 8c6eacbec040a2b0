//! `hivemesh bench chaos`: P peers as OS processes call `step()` in a loop while random ones
//! are SIGKILLed and restarted; prints
//! `hivemesh_chaos peers=P rounds=R ok=K wrong=W hung=H max_rss_mb=M`.
//!
//! The parent runs the bootstrap node in-process and P slots, each holding one
//! `bench-chaos-worker` process at a time. A worker joins, loads the state from its peers when
//! it replaces a killed one (`LOADED ...`), prints `READY` and then steps back to back: before
//! step `s` it sets its vector to values generated from (slot, incarnation, s) and gathers
//! those three numbers, so that every member can recompute every other member's input. After
//! a step it checks every element against what its report promises: the mean of the inputs of
//! exactly the members the report names for that part, or its own input where the part stayed
//! local. It prints `STEP s ok|wrong <seconds> <detail>` or `STEP s err <seconds> <error>` (a
//! failed step is allowed: a member was killed under it).
//!
//! Every `--kill-every` finished steps (all slots together) the parent SIGKILLs the worker of
//! a random slot and starts the slot's next incarnation. A worker that prints nothing for
//! `--step-timeout` plus a minute counts as hung (and is replaced). The run ends once
//! P × R steps have finished; `ok` counts verified steps, `wrong` steps whose values broke
//! the report's promise, `max_rss_mb` the largest resident size any worker reached (sampled
//! every second). Exits with status 1 when `wrong` or `hung` is not zero.

use std::io::Write;
use std::process::Child;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use hivemesh::allreduce::{Partition, TensorDescriptor};
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig, StepOptions};
use hivemesh::compression::Compression;
use hivemesh::tensor::Tensor;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::workers::{spawn_worker, stdin_lines};

/// Options shared by the harness and its workers.
#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Peer slots (processes alive at once).
    #[arg(long, default_value_t = 8)]
    peers: usize,
    /// Steps per slot: the run ends after peers × rounds finished steps.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// SIGKILL a random worker (and start its replacement) after every this many finished
    /// steps, all slots together; 0: never.
    #[arg(long, default_value_t = 10)]
    kill_every: usize,
    /// Target group size.
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    /// f32 values per peer.
    #[arg(long, default_value_t = 100_000)]
    size: usize,
    /// Step timeout in seconds.
    #[arg(long, default_value_t = 30.0)]
    step_timeout: f64,
    /// Seed of the kill schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print every worker's lines on stderr.
    #[arg(long)]
    verbose: bool,
}

/// A worker's options.
#[derive(Args, Debug, Clone)]
pub struct ChaosWorkerArgs {
    #[command(flatten)]
    chaos: ChaosArgs,
    /// This worker's slot.
    #[arg(long)]
    index: usize,
    /// How many workers held this slot before.
    #[arg(long)]
    incarnation: u32,
    /// The bootstrap node's address.
    #[arg(long)]
    bootstrap: libp2p::Multiaddr,
}

/// Part size of the averagers (and of the workers' own partition, which must match it).
const PART_SIZE_BYTES: usize = 64 << 10;
/// How long a worker may take to start (and load state) before it counts as hung.
const START_LIMIT: Duration = Duration::from_secs(120);

impl ChaosArgs {
    fn validate(&self) -> anyhow::Result<()> {
        crate::workers::validate_group(self.peers, self.group_size)?;
        ensure!(
            (1..=100_000).contains(&self.rounds),
            "--rounds must be between 1 and 100000"
        );
        ensure!(
            (1..=64 << 20).contains(&self.size),
            "--size must be between 1 and 67108864"
        );
        ensure!(
            self.step_timeout > 0.0 && self.step_timeout <= 3600.0,
            "--step-timeout must be in (0, 3600]"
        );
        Ok(())
    }

    fn flags(&self, bootstrap: &str) -> Vec<String> {
        [
            ("--peers", self.peers.to_string()),
            ("--rounds", self.rounds.to_string()),
            ("--kill-every", self.kill_every.to_string()),
            ("--group-size", self.group_size.to_string()),
            ("--size", self.size.to_string()),
            ("--step-timeout", self.step_timeout.to_string()),
            ("--bootstrap", bootstrap.to_owned()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect()
    }
}

/// One slot's current worker.
struct Slot {
    child: Child,
    incarnation: u32,
    /// When it last printed a line (or started).
    last_heard: Instant,
    /// Whether it printed `READY` (steps are expected from then on).
    ready: bool,
}

/// The worker processes, killed (and reaped) when the harness returns.
struct Slots {
    slots: Vec<Slot>,
    tx: std_mpsc::Sender<(usize, u32, String)>,
    flags: Vec<String>,
}

impl Slots {
    fn start(&mut self, slot: usize, incarnation: u32) -> anyhow::Result<Slot> {
        let exe = std::env::current_exe().context("locating the hivemesh binary")?;
        let mut args = vec![
            "--index".to_owned(),
            slot.to_string(),
            "--incarnation".to_owned(),
            incarnation.to_string(),
        ];
        args.extend(self.flags.iter().cloned());
        let child = spawn_worker(
            &exe,
            "bench-chaos-worker",
            &args,
            self.tx.clone(),
            move |line| (slot, incarnation, line),
        )?;
        Ok(Slot {
            child,
            incarnation,
            last_heard: Instant::now(),
            ready: false,
        })
    }

    /// SIGKILLs the slot's worker and starts its next incarnation.
    fn replace(&mut self, slot: usize) -> anyhow::Result<()> {
        let next = self.slots[slot].incarnation + 1;
        let _ = self.slots[slot].child.kill();
        let _ = self.slots[slot].child.wait();
        self.slots[slot] = self.start(slot, next)?;
        Ok(())
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        for s in &mut self.slots {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
    }
}

/// Resident set size of a process in MiB (Linux; 0 elsewhere or when it is gone).
fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The parent.
pub fn run(args: ChaosArgs) -> anyhow::Result<()> {
    args.validate()?;
    let runtime = crate::workers::runtime(1)?;
    let (bootstrap, addr) = crate::workers::start_bootstrap(&runtime)?;
    let (tx, lines) = std_mpsc::channel();
    let mut slots = Slots {
        slots: Vec::new(),
        tx,
        flags: args.flags(&addr.to_string()),
    };
    for i in 0..args.peers {
        let slot = slots.start(i, 0)?;
        slots.slots.push(slot);
    }

    let total = args.peers * args.rounds;
    let silence_limit = Duration::from_secs_f64(args.step_timeout) + Duration::from_secs(60);
    let mut rng = StdRng::seed_from_u64(args.seed);
    let (mut finished, mut ok, mut wrong, mut hung, mut failed, mut kills) = (0, 0, 0, 0, 0, 0);
    let mut loads = (0, 0, 0); // (loaded, no donor, failed)
    let mut max_rss = 0.0f64;
    let mut last_sample = Instant::now();
    let mut since_kill = 0;
    while finished < total {
        if last_sample.elapsed() >= Duration::from_secs(1) {
            last_sample = Instant::now();
            for s in &slots.slots {
                max_rss = max_rss.max(rss_mib(s.child.id()));
            }
        }
        match lines.recv_timeout(Duration::from_millis(500)) {
            Ok((slot, incarnation, line)) => {
                if slots.slots[slot].incarnation != incarnation {
                    continue; // a killed worker's last words
                }
                slots.slots[slot].last_heard = Instant::now();
                if args.verbose {
                    eprintln!("slot {slot}.{incarnation}: {line}");
                }
                let fields: Vec<&str> = line.splitn(5, ' ').collect();
                match fields.as_slice() {
                    ["READY"] => slots.slots[slot].ready = true,
                    ["LOADED", "state", ..] => loads.0 += 1,
                    ["LOADED", "none", ..] => loads.1 += 1,
                    ["LOADED", "failed", ..] => {
                        loads.2 += 1;
                        eprintln!("slot {slot}.{incarnation}: {line}");
                    }
                    ["STEP", _, verdict, _, detail] => {
                        finished += 1;
                        since_kill += 1;
                        match *verdict {
                            "ok" => ok += 1,
                            "wrong" => {
                                wrong += 1;
                                eprintln!("slot {slot}.{incarnation}: WRONG {detail}");
                            }
                            _ => failed += 1,
                        }
                    }
                    ["EOF"] => bail!("the worker of slot {slot} exited on its own"),
                    _ => bail!("slot {slot}: unexpected line '{line}'"),
                }
            }
            Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            Err(std_mpsc::RecvTimeoutError::Disconnected) => bail!("every worker is gone"),
        }
        for i in 0..slots.slots.len() {
            let s = &slots.slots[i];
            let limit = if s.ready { silence_limit } else { START_LIMIT };
            if s.last_heard.elapsed() > limit {
                hung += 1;
                eprintln!(
                    "slot {i}.{}: silent for {:?}: hung",
                    s.incarnation,
                    s.last_heard.elapsed()
                );
                slots.replace(i)?;
            }
        }
        if args.kill_every > 0 && since_kill >= args.kill_every && finished < total {
            since_kill = 0;
            let victim = rng.random_range(0..args.peers);
            kills += 1;
            slots.replace(victim)?;
        }
    }
    drop(slots);
    runtime.block_on(bootstrap.shutdown());
    eprintln!(
        "chaos: {finished} steps finished ({failed} failed, allowed), {kills} kills, \
         {} states loaded, {} replacements found no donor, {} loads failed",
        loads.0, loads.1, loads.2
    );
    println!(
        "hivemesh_chaos peers={} rounds={} ok={ok} wrong={wrong} hung={hung} max_rss_mb={:.0}",
        args.peers, args.rounds, max_rss
    );
    ensure!(
        wrong == 0 && hung == 0,
        "{wrong} wrong and {hung} hung steps"
    );
    Ok(())
}

/// One worker process.
pub fn run_worker(args: ChaosWorkerArgs) -> anyhow::Result<()> {
    args.chaos.validate()?;
    ensure!(args.index < args.chaos.peers, "--index out of range");
    let runtime = crate::workers::runtime(2)?;
    runtime.block_on(worker(args))
}

/// Input of (slot, incarnation, step), element `e`: any member recomputes it from the three.
fn input(id: [u64; 3], e: usize) -> f32 {
    let seed = id[1].wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id[2].rotate_left(32);
    hivemesh::sim::generated_value(seed, id[0] as usize, e)
}

fn encode_id(id: [u64; 3]) -> bytes::Bytes {
    id.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn decode_id(b: &[u8]) -> Option<[u64; 3]> {
    let b: &[u8; 24] = b.try_into().ok()?;
    let word = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    Some([word(0), word(1), word(2)])
}

async fn worker(args: ChaosWorkerArgs) -> anyhow::Result<()> {
    let c = &args.chaos;
    let mut config = NodeConfig::loopback();
    config.p2p.initial_peers = vec![args.bootstrap.clone()];
    let node = Node::start(config, libp2p::identity::Keypair::generate_ed25519()).await?;
    let n = c.size;
    let mut cfg = AveragerConfig::new("bench-chaos");
    cfg.target_group_size = Some(c.group_size);
    cfg.min_group_size = 2;
    cfg.min_matchmaking_time = Duration::from_secs(2);
    cfg.part_size_bytes = PART_SIZE_BYTES;
    cfg.round_timeout = Duration::from_secs_f64(c.step_timeout);
    let descriptor = [TensorDescriptor::of(&Tensor::from_f32(&[n], vec![0.0; n])?)];
    let partition = Partition::new(
        &descriptor,
        &[1.0],
        PART_SIZE_BYTES,
        &Compression::default(),
    )?;
    let averager = Averager::start(
        node.dht().clone(),
        node.hub().clone(),
        vec![Tensor::from_f32(&[n], vec![0.0; n])?],
        cfg,
    )?;
    if args.incarnation > 0 {
        // A replacement: take the state the others serve, as a newcomer would.
        match averager.load_state_from_peers().await {
            Ok(Some(loaded)) => {
                let t = averager.tensors()[0].to_f32_vec();
                ensure!(
                    t.len() == n && t.iter().all(|x| x.is_finite()),
                    "loaded state is malformed"
                );
                println!("LOADED state {} bytes", loaded.bytes);
            }
            Ok(None) => println!("LOADED none"),
            Err(e) => println!("LOADED failed {e}"),
        }
    }
    println!("READY");

    let mut stdin = stdin_lines();
    for s in 0u64.. {
        // The parent never writes: its stdin closing means the parent is gone.
        if !matches!(
            stdin.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty)
        ) {
            break;
        }
        let me = [args.index as u64, u64::from(args.incarnation), s];
        {
            let mut t = averager.tensors();
            let values: Vec<f32> = (0..n).map(|e| input(me, e)).collect();
            t[0] = Tensor::from_f32(&[n], values)?;
        }
        let started = Instant::now();
        let result = averager
            .step(StepOptions {
                gather: encode_id(me),
                timeout: Some(Duration::from_secs_f64(c.step_timeout)),
                ..StepOptions::default()
            })
            .await;
        let secs = started.elapsed().as_secs_f64();
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(e) => {
                println!("STEP {s} err {secs:.3} {e}");
                continue;
            }
        };
        let after = averager.tensors()[0].to_f32_vec();
        let verdict = check(&outcome, &partition, me, &after);
        match verdict {
            Ok(averaged) => println!(
                "STEP {s} ok {secs:.3} group={} averaged={averaged}",
                outcome.members.len()
            ),
            Err(e) => println!("STEP {s} wrong {secs:.3} {e:#}"),
        }
        std::io::stdout().flush()?;
    }
    averager.shutdown().await;
    node.shutdown().await;
    Ok(())
}

/// Checks every element of `after` against the report: the mean of the named contributors'
/// inputs, or our own input where the part stayed local. Returns how many elements were
/// averaged with someone else.
fn check(
    outcome: &hivemesh::averager::StepOutcome,
    partition: &Partition,
    me: [u64; 3],
    after: &[f32],
) -> anyhow::Result<usize> {
    let ids: Vec<[u64; 3]> = outcome
        .gathered
        .iter()
        .map(|g| decode_id(g).context("a member gathered malformed bytes"))
        .collect::<anyhow::Result<_>>()?;
    ensure!(
        ids.get(outcome.me) == Some(&me),
        "our own gathered id is not ours"
    );
    let mut averaged = 0;
    for g in 0..partition.num_parts() {
        let spec = *partition.part(g);
        let contributors: Vec<usize> = match outcome.report.contributors(g) {
            Some(set) => set.iter().collect(),
            None => vec![outcome.me],
        };
        ensure!(
            contributors.iter().all(|&m| m < ids.len()),
            "part {g} names a contributor outside the group"
        );
        if contributors.len() > 1 {
            averaged += spec.len;
        }
        for e in spec.range() {
            let mean = contributors
                .iter()
                .map(|&m| f64::from(input(ids[m], e)))
                .sum::<f64>()
                / contributors.len() as f64;
            let got = f64::from(after[e]);
            if (got - mean).abs() > 1e-5 * mean.abs().max(1.0) {
                bail!(
                    "element {e} (part {g}, contributors {contributors:?}): {got} vs mean {mean}"
                );
            }
        }
    }
    Ok(averaged)
}
