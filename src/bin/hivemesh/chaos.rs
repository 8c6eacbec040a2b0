//! `hivemesh bench chaos`: P peers as OS processes call `step()` in a loop while random ones
//! are SIGKILLed and restarted; prints
//! `hivemesh_chaos peers=P rounds=R ok=K wrong=W hung=H max_rss_mb=M`.
//!
//! The parent runs the bootstrap node in-process and P slots, each holding one
//! `bench-chaos-worker` process at a time. A worker joins, loads the state from its peers when
//! it replaces a killed one (`LOADED state|none|failed|wrong ...`), prints `READY` and then
//! steps back to back: before
//! step `s` it sets its vector to values generated from (slot, incarnation, s) and gathers
//! those three numbers, so that every member can recompute every other member's input. After
//! a step it checks every element against what its report promises: the mean of the inputs of
//! exactly the members the report names for that part, or its own input where the part stayed
//! local. It prints `STEP s ok|wrong <seconds> <detail>` or `STEP s err <seconds> <error>`: a
//! failed step is allowed (a member was killed under it) if it left the tensors as they were
//! (otherwise it is wrong), and a step whose report names no part averaged with anyone counts
//! as failed, not ok.
//!
//! Loaded states are checked as strictly. Each worker serves (through a state provider) a
//! copy of its values after its last verified step, with a [description](Description) of them
//! as the state's metadata: the members' ids and every part's contributors, from which anyone
//! recomputes every value (copy and description are taken together, so they always match).
//! A replacement recomputes the state it loaded from the description that came with it and
//! checks every element ([`check_loaded`]); a state that is not exactly what a donor held
//! after a verified step (zeros, another step's values, a corrupt element) prints
//! `LOADED wrong` and counts as a wrong step.
//!
//! Every `--kill-every` finished steps (all slots together) the parent SIGKILLs the worker of
//! a random slot and starts the slot's next incarnation. A worker that prints nothing for
//! `--step-timeout` plus a minute counts as hung (and is replaced). The run ends once
//! P × R steps have finished; `ok` counts verified steps, `wrong` steps whose values broke
//! the report's promise, `max_rss_mb` the largest resident size any worker reached (sampled
//! every second). Exits with status 1 when `wrong` or `hung` is not zero, or when fewer than a
//! majority of the steps are ok.

use std::io::Write;
use std::process::Child;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use hivemesh::allreduce::{Partition, TensorDescriptor};
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::state::ProvidedState;
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
                    ["LOADED", "wrong", ..] => {
                        wrong += 1;
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
        "chaos: {finished} steps finished ({failed} failed or averaged nothing; a majority \
         must be ok), {kills} kills, {} states loaded, {} replacements found no donor, {} \
         loads failed",
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
    ensure!(
        2 * ok > finished,
        "only {ok} of {finished} steps averaged and checked out (a majority must)"
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
    // What this worker serves newcomers: its values after its last verified step (or the
    // state it loaded), with their description.
    let served: Arc<Mutex<Option<(Tensor, bytes::Bytes)>>> = Arc::default();
    let provider = served.clone();
    averager.set_state_provider(Some(Arc::new(move || {
        let served = provider.lock().unwrap_or_else(|e| e.into_inner());
        let (values, description) = served.as_ref().ok_or("no verified state yet")?;
        Ok(ProvidedState {
            metadata: description.clone(),
            tensors: vec![values.clone()],
        })
    })));
    let serve = |values: Vec<f32>, description: bytes::Bytes| -> anyhow::Result<()> {
        let values = Tensor::from_f32(&[n], values)?;
        *served.lock().unwrap_or_else(|e| e.into_inner()) = Some((values, description));
        Ok(())
    };
    if args.incarnation > 0 {
        // A replacement: take the state the others serve, as a newcomer would.
        match averager.load_state_from_peers().await {
            Ok(Some(loaded)) => {
                let t = averager.tensors()[0].to_f32_vec();
                match check_loaded(&loaded.metadata, &partition, &t) {
                    Ok(()) => {
                        println!("LOADED state {} bytes", loaded.bytes);
                        serve(t, loaded.metadata)?;
                    }
                    Err(e) => println!("LOADED wrong {e:#}"),
                }
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
        let after = averager.tensors()[0].to_f32_vec();
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(e) => {
                // A failed step leaves the tensors as they were.
                match check_unchanged(me, &after) {
                    Ok(()) => println!("STEP {s} err {secs:.3} {e}"),
                    Err(wrong) => {
                        println!("STEP {s} wrong {secs:.3} after a failed step: {wrong:#}")
                    }
                }
                std::io::stdout().flush()?;
                continue;
            }
        };
        let ids = outcome
            .gathered
            .iter()
            .map(|g| decode_id(g).context("a member gathered malformed bytes"))
            .collect::<anyhow::Result<Vec<_>>>();
        let contributors = |g: usize| {
            outcome
                .report
                .contributors(g)
                .map(|set| set.iter().collect::<Vec<usize>>())
        };
        let verdict = ids.and_then(|ids| {
            let averaged = check(&ids, outcome.me, &partition, me, &after, contributors)?;
            let description = Description {
                ids,
                me: outcome.me,
                parts: (0..partition.num_parts()).map(contributors).collect(),
            };
            Ok((averaged, description))
        });
        let verdict = match verdict {
            Ok((averaged, description)) => {
                serve(after, description.encode())?;
                Ok(averaged)
            }
            Err(e) => Err(e),
        };
        match verdict {
            Ok(0) => println!(
                "STEP {s} err {secs:.3} nothing averaged (group={})",
                outcome.members.len()
            ),
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

/// Checks every element of `after` against a step's report: the mean of the inputs of the
/// contributors `contributors(part)` names (`None`: the part stayed local, our own input),
/// `ids` being what each member gathered and `me_index` our place in the group. Returns how
/// many elements were averaged with someone else (0: the step averaged nothing).
fn check(
    ids: &[[u64; 3]],
    me_index: usize,
    partition: &Partition,
    me: [u64; 3],
    after: &[f32],
    contributors: impl Fn(usize) -> Option<Vec<usize>>,
) -> anyhow::Result<usize> {
    ensure!(
        ids.get(me_index) == Some(&me),
        "our own gathered id is not ours"
    );
    ensure!(
        after.len() == partition.total_elements(),
        "{} values for {} elements",
        after.len(),
        partition.total_elements()
    );
    let mut averaged = 0;
    for g in 0..partition.num_parts() {
        let spec = *partition.part(g);
        let contributors = contributors(g).unwrap_or_else(|| vec![me_index]);
        ensure!(
            !contributors.is_empty() && contributors.iter().all(|&m| m < ids.len()),
            "part {g} names no contributor or one outside the group: {contributors:?}"
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

/// What a served state holds, enough to recompute every value: the ids the members of the
/// donor's last verified step gathered, the donor's place among them, and each part's
/// contributors (`None`: the part stayed local).
#[derive(Debug, Clone, PartialEq)]
struct Description {
    ids: Vec<[u64; 3]>,
    me: usize,
    parts: Vec<Option<Vec<usize>>>,
}

impl Description {
    /// `[members u8] [id 24 bytes]... [me u8] [parts u32] [contributor bitmask u64]...` (0: the
    /// part stayed local); groups have at most 64 members.
    fn encode(&self) -> bytes::Bytes {
        let mut out = vec![self.ids.len() as u8];
        for id in &self.ids {
            out.extend_from_slice(&encode_id(*id));
        }
        out.push(self.me as u8);
        out.extend_from_slice(&(self.parts.len() as u32).to_le_bytes());
        for part in &self.parts {
            let mask = part.iter().flatten().fold(0u64, |mask, &m| {
                mask | 1u64.checked_shl(m as u32).unwrap_or(0)
            });
            out.extend_from_slice(&mask.to_le_bytes());
        }
        out.into()
    }

    fn decode(bytes: &[u8]) -> anyhow::Result<Self> {
        let (&members, rest) = bytes.split_first().context("empty")?;
        let (ids, rest) = rest
            .split_at_checked(24 * usize::from(members))
            .context("short ids")?;
        let ids = ids
            .chunks(24)
            .map(|id| decode_id(id).context("an id"))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (&me, rest) = rest.split_first().context("no place")?;
        let (count, rest) = rest.split_first_chunk::<4>().context("no part count")?;
        let count = u32::from_le_bytes(*count) as usize;
        let (masks, []) = rest.as_chunks::<8>() else {
            bail!("a partial part");
        };
        ensure!(masks.len() == count, "{} parts for {count}", masks.len());
        let parts = masks
            .iter()
            .map(|m| {
                let mask = u64::from_le_bytes(*m);
                (mask != 0).then(|| (0..64).filter(|&i| mask >> i & 1 == 1).collect())
            })
            .collect();
        Ok(Self {
            ids,
            me: usize::from(me),
            parts,
        })
    }
}

/// Checks a loaded state (`values`) against the [`Description`] that came with it: every
/// element must be exactly what the donor held after its verified step.
fn check_loaded(description: &[u8], partition: &Partition, values: &[f32]) -> anyhow::Result<()> {
    let d = Description::decode(description).context("the loaded state's description")?;
    ensure!(
        d.parts.len() == partition.num_parts(),
        "the description has {} parts for {}",
        d.parts.len(),
        partition.num_parts()
    );
    let donor = *d
        .ids
        .get(d.me)
        .context("the donor is not among the members")?;
    check(&d.ids, d.me, partition, donor, values, |g| {
        d.parts[g].clone()
    })
    .context("the loaded state is not the donor's")?;
    Ok(())
}

/// Checks that `after` is still our own input `me` (what a failed step must leave).
fn check_unchanged(me: [u64; 3], after: &[f32]) -> anyhow::Result<()> {
    if let Some(e) = (0..after.len()).find(|&e| after[e] != input(me, e)) {
        bail!(
            "element {e} is {} instead of our input {}",
            after[e],
            input(me, e)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: usize = 5000;

    fn partition() -> Partition {
        let descriptor = [TensorDescriptor::of(
            &Tensor::from_f32(&[N], vec![0.0; N]).expect("tensor"),
        )];
        Partition::new(&descriptor, &[1.0], 4096, &Compression::default()).expect("partition")
    }

    fn mean_of(ids: &[[u64; 3]], members: &[usize]) -> Vec<f32> {
        (0..N)
            .map(|e| {
                (members
                    .iter()
                    .map(|&m| f64::from(input(ids[m], e)))
                    .sum::<f64>()
                    / members.len() as f64) as f32
            })
            .collect()
    }

    #[test]
    fn the_checker_accepts_the_true_mean_and_nothing_else() {
        let p = partition();
        assert!(
            p.num_parts() >= 2,
            "the test needs parts: {}",
            p.num_parts()
        );
        let ids = [[0, 0, 7], [1, 2, 7], [2, 0, 7]];
        let all = |_: usize| Some(vec![0, 1, 2]);
        let good = mean_of(&ids, &[0, 1, 2]);
        assert_eq!(check(&ids, 1, &p, ids[1], &good, all).unwrap(), N);

        // One element off by a little more than the tolerance.
        let mut bad = good.clone();
        bad[N - 1] += 1e-3;
        let err = check(&ids, 1, &p, ids[1], &bad, all).unwrap_err();
        assert!(
            err.to_string().contains(&format!("element {}", N - 1)),
            "{err}"
        );

        // Our own input where every part stayed local: valid, and nothing averaged.
        let own = mean_of(&ids, &[1]);
        assert_eq!(check(&ids, 1, &p, ids[1], &own, |_| None).unwrap(), 0);
        // ... but not where the report says the group averaged it.
        assert!(check(&ids, 1, &p, ids[1], &own, all).is_err());

        // The first part averaged by two, the rest local.
        let two = |g: usize| (g == 0).then(|| vec![0, 1]);
        let mut mixed = own.clone();
        let first = *p.part(0);
        let pair = mean_of(&ids, &[0, 1]);
        mixed[first.range()].copy_from_slice(&pair[first.range()]);
        assert_eq!(check(&ids, 1, &p, ids[1], &mixed, two).unwrap(), first.len);
        assert!(check(&ids, 1, &p, ids[1], &good, two).is_err());

        // Not our id at our place, contributors outside the group or none, a short tensor.
        assert!(check(&ids, 0, &p, ids[1], &good, all).is_err());
        assert!(check(&ids, 1, &p, ids[1], &good, |_| Some(vec![0, 3])).is_err());
        assert!(check(&ids, 1, &p, ids[1], &good, |_| Some(vec![])).is_err());
        assert!(check(&ids, 1, &p, ids[1], &good[..N - 1], all).is_err());
    }

    /// A loaded state must be exactly what its donor held: the mean its description names,
    /// part by part; the donor's own input where it averaged, zeros, one element off, a
    /// description that does not fit, all fail.
    #[test]
    fn a_loaded_state_must_be_what_its_donor_held() {
        let p = partition();
        let ids = vec![[0, 0, 7], [1, 2, 7], [2, 0, 7]];
        let first = *p.part(0);
        let description = Description {
            ids: ids.clone(),
            me: 1,
            parts: (0..p.num_parts())
                .map(|g| (g == 0).then(|| vec![0, 1, 2]))
                .collect(),
        };
        let bytes = description.encode();
        assert_eq!(Description::decode(&bytes).unwrap(), description);
        let mut held = mean_of(&ids, &[1]);
        held[first.range()].copy_from_slice(&mean_of(&ids, &[0, 1, 2])[first.range()]);
        check_loaded(&bytes, &p, &held).unwrap();

        let mut off = held.clone();
        off[first.range().start] += 1e-3;
        assert!(check_loaded(&bytes, &p, &off).is_err());
        assert!(
            check_loaded(&bytes, &p, &mean_of(&ids, &[1])).is_err(),
            "its input"
        );
        assert!(check_loaded(&bytes, &p, &vec![0.0; N]).is_err(), "zeros");
        assert!(check_loaded(&bytes, &p, &held[..N - 1]).is_err(), "short");
        assert!(check_loaded(&bytes[..bytes.len() - 1], &p, &held).is_err());
        assert!(check_loaded(&[], &p, &held).is_err());
        let mut fewer = description.clone();
        fewer.parts.pop();
        assert!(check_loaded(&fewer.encode(), &p, &held).is_err());
        let mut outside = description;
        outside.me = 3;
        assert!(check_loaded(&outside.encode(), &p, &held).is_err());
    }

    #[test]
    fn a_failed_step_must_leave_our_input() {
        let me = [3, 1, 4];
        let mut values: Vec<f32> = (0..N).map(|e| input(me, e)).collect();
        check_unchanged(me, &values).unwrap();
        values[17] += 0.5;
        assert!(check_unchanged(me, &values).is_err());
    }
}
