//! `hivemesh bench collective`: N processes on loopback form one [`Group`] (TLS data links,
//! linked once) and run one collective per round, nccl-tests style.
//!
//! Sizes follow nccl-tests: `--mib` is the all-reduce and broadcast buffer, the all-gather
//! *output* (each member contributes `mib / N`) and the reduce-scatter *input* (each member
//! gets `mib / N` back). Bus bandwidth factors: `2(N-1)/N` for all-reduce, `(N-1)/N` for
//! all-gather and reduce-scatter, 1 for broadcast. Every member checks its result against
//! values computed from the generator ([`hivemesh::sim::generated_value`]), without the
//! others' data; the parent fails on any error above the codec's tolerance.
//!
//! Lines: workers print `READY` (see [`super::bench`]), `LINKED`, then per round `PREPARED r`
//! (inputs made), `START r`, `ROUND r <s> <cpu s>` and, after the parent's `CHECK`,
//! `CHECKED r <max error>`. The parent sends `GO` per round once every member prepared (the
//! timing barrier) and prints the median of the slowest member's
//! times over the timed rounds (round 0 is a warm-up).
//!
//! With `--kill-member K` (the SIGKILL test), member K kills itself with SIGKILL in round 1
//! once it has written 1 MiB of the operation's data (mid-operation, whatever the timing);
//! the others must each end the operation with [`GroupError::Failed`] naming exactly K
//! (`FAILED 1 K`), shrink the group (`SHRUNK N-1`), and run the operation again without it
//! in round 2, checked as usual. The parent then prints
//! `hivemesh_collective_kill op=OP world=N killed=K named_by=N-1 shrunk_to=N-1 after=ok`.

use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use clap::Args;
use hivemesh::compression::{Compression, CompressionType};
use hivemesh::runner::Link;
use hivemesh::sim::generated_value;
use hivemesh::tensor::Tensor;
use hivemesh::{Group, GroupConfig, GroupError, ReduceOp};
use libp2p::PeerId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::bench::{
    Transport, compression_name, exchange_roster, join_roster, process_cpu_seconds, validate_sizes,
};
use crate::workers::{PerfControl, Workers, runtime, stdin_lines};

const SEED: u64 = 7;
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes the victim writes in its kill round before it kills itself.
const KILL_AFTER_BYTES: u64 = 1 << 20;

/// A collective.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// All-reduce (sum).
    AllReduce,
    /// All-gather.
    AllGather,
    /// Broadcast from member 0 (from the victim with `--kill-member`).
    Broadcast,
    /// Reduce-scatter (sum).
    ReduceScatter,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all-reduce",
            Self::AllGather => "all-gather",
            Self::Broadcast => "broadcast",
            Self::ReduceScatter => "reduce-scatter",
        }
    }

    fn bus_factor(self, n: f64) -> f64 {
        match self {
            Self::AllReduce => 2.0 * (n - 1.0) / n,
            Self::AllGather | Self::ReduceScatter => (n - 1.0) / n,
            Self::Broadcast => 1.0,
        }
    }
}

/// Options shared by the harness and its workers.
#[derive(Args, Debug, Clone)]
pub struct CollectiveArgs {
    /// The collective.
    #[arg(long, value_enum)]
    op: Op,
    /// Number of member processes.
    #[arg(long, default_value_t = 4)]
    peers: usize,
    /// MiB of f32 values (see the nccl-tests size convention in `--help` of the command).
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Timed rounds (after one warm-up round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Target part size in bytes.
    #[arg(long, default_value_t = hivemesh::allreduce::DEFAULT_PART_SIZE_BYTES)]
    part_bytes: usize,
    /// none, float16, bfloat16, uniform8, quantile8, blockwise8 or adaptive.
    #[arg(long, default_value = "none")]
    compression: Compression,
    /// The SIGKILL test: this member kills itself mid-operation in round 1 (see the module
    /// docs).
    #[arg(long, hide = true)]
    kill_member: Option<usize>,
}

/// A worker's options.
#[derive(Args, Debug, Clone)]
pub struct CollectiveWorkerArgs {
    #[command(flatten)]
    bench: CollectiveArgs,
    /// This worker's index.
    #[arg(long)]
    index: usize,
}

impl CollectiveArgs {
    fn validate(&self) -> anyhow::Result<()> {
        validate_sizes(self.peers, self.mib, self.rounds, self.part_bytes)?;
        if let Some(k) = self.kill_member {
            ensure!(
                self.peers >= 3 && k < self.peers,
                "--kill-member needs at least 3 peers and an index below --peers"
            );
        }
        Ok(())
    }

    fn elements(&self) -> usize {
        self.mib * (1 << 20) / 4
    }

    fn rounds_run(&self) -> usize {
        if self.kill_member.is_some() {
            2
        } else {
            self.rounds
        }
    }

    /// Largest acceptable error of one result element, for `members` members.
    fn tolerance(&self, members: usize) -> f32 {
        let per_value = match self.compression {
            Compression::Fixed(CompressionType::None) => 1e-6,
            Compression::Fixed(CompressionType::Float16) => 2e-3,
            Compression::Fixed(CompressionType::BFloat16) => 2e-2,
            _ => 0.1,
        };
        // Sums add one rounding per member (values are below 1 in magnitude).
        per_value * members as f32 * 2.0
    }
}

/// The parent.
pub fn run(args: CollectiveArgs) -> anyhow::Result<()> {
    args.validate()?;
    let mut flags = vec![
        ("--op", args.op.name().to_owned()),
        ("--peers", args.peers.to_string()),
        ("--mib", args.mib.to_string()),
        ("--rounds", args.rounds.to_string()),
        ("--part-bytes", args.part_bytes.to_string()),
        ("--compression", compression_name(&args.compression)),
    ];
    if let Some(k) = args.kill_member {
        flags.push(("--kill-member", k.to_string()));
    }
    let mut perf = PerfControl::from_env()?;
    let mut workers = Workers::spawn(args.peers, "bench-collective-worker", &flags)?;
    exchange_roster(&mut workers, args.peers)?;
    let deadline = Instant::now() + Duration::from_secs(60 * 60);
    let read = |workers: &mut Workers| -> anyhow::Result<(usize, Vec<String>)> {
        let left = deadline.saturating_duration_since(Instant::now());
        let (i, line) = workers
            .lines
            .recv_timeout(left)
            .context("bench timed out")?;
        Ok((i, line.split_whitespace().map(str::to_owned).collect()))
    };
    // Workers that made their inputs for each round (`PREPARED r`, counted wherever it comes:
    // a fast worker prepares the next round while the others still check this one).
    let prepared = std::cell::RefCell::new(vec![0usize; args.rounds_run() + 1]);
    let count_prepared = |i: usize, f: &[String]| -> anyhow::Result<bool> {
        let [p, r] = f else {
            return Ok(false);
        };
        if p != "PREPARED" {
            return Ok(false);
        }
        let r: usize = r.parse()?;
        let mut prepared = prepared.borrow_mut();
        ensure!(r < prepared.len(), "worker {i}: round {r} out of range");
        prepared[r] += 1;
        Ok(true)
    };
    // The next line that is not a `PREPARED`.
    let next = |workers: &mut Workers| -> anyhow::Result<(usize, Vec<String>)> {
        loop {
            let (i, f) = read(workers)?;
            if !count_prepared(i, &f)? {
                return Ok((i, f));
            }
        }
    };
    let mut live: Vec<usize> = (0..args.peers).collect();
    let mut linked = 0;
    while linked < args.peers {
        match next(&mut workers)? {
            (_, f) if f == ["LINKED"] => linked += 1,
            (i, f) => bail!("worker {i}: expected LINKED, got {f:?}"),
        }
    }
    let mut times = Vec::new();
    let mut killed = None;
    // A member that checked the last round says DONE, maybe before the others checked.
    let mut done = 0;
    let mut finished = vec![false; args.peers];
    let last = args.rounds_run();
    for round in 0..=args.rounds_run() {
        // The timing barrier: every member has its inputs ready, then GO (so that no member
        // starts the timed round while another still makes its inputs).
        while prepared.borrow()[round] < live.len() {
            let (i, f) = read(&mut workers)?;
            ensure!(
                count_prepared(i, &f)?,
                "worker {i}: expected PREPARED {round}, got {f:?}"
            );
        }
        perf.set(round > 0)?;
        workers.send_to(|i| live.contains(&i), "GO")?;
        let mut slowest = 0.0f64;
        let mut ended = 0;
        let mut failed = 0;
        // A survivor shrinks right after it fails: its SHRUNK may come before the others'
        // FAILED or the victim's end.
        let mut shrunk = 0;
        let survivors = live.len().saturating_sub(1).to_string();
        while ended < live.len() {
            let (i, f) = next(&mut workers)?;
            let f: Vec<&str> = f.iter().map(String::as_str).collect();
            match f.as_slice() {
                ["START", _] => {}
                ["ROUND", r, secs, _cpu] if r.parse::<usize>()? == round => {
                    slowest = slowest.max(secs.parse()?);
                    ended += 1;
                }
                ["FAILED", r, who] if r.parse::<usize>()? == round => {
                    let k = args
                        .kill_member
                        .filter(|_| round == 1)
                        .with_context(|| format!("worker {i}: round {round} failed: {who}"))?;
                    ensure!(
                        *who == k.to_string(),
                        "worker {i} named {who} as failed, not member {k}"
                    );
                    failed += 1;
                    ended += 1;
                }
                ["SHRUNK", n] if round == 1 && args.kill_member.is_some() => {
                    ensure!(*n == survivors, "worker {i} shrank to {n}, not {survivors}");
                    shrunk += 1;
                }
                ["EOF"] if Some(i) == args.kill_member && round == 1 => {
                    killed = Some(i);
                    ended += 1;
                }
                _ => bail!("worker {i}: unexpected {f:?} in round {round}"),
            }
        }
        perf.set(false)?;
        if let Some(k) = killed.filter(|_| round == 1) {
            ensure!(
                failed == live.len() - 1,
                "{failed} of {} survivors named the killed member",
                live.len() - 1
            );
            live.retain(|&i| i != k);
            while shrunk < live.len() {
                match next(&mut workers)? {
                    (_, f) if f == ["SHRUNK".to_owned(), live.len().to_string()] => shrunk += 1,
                    (i, f) => bail!("worker {i}: expected SHRUNK {}, got {f:?}", live.len()),
                }
            }
            continue;
        }
        ensure!(
            failed == 0,
            "round {round}: {failed} members failed without a kill"
        );
        eprintln!(
            "round {round}{}: {slowest:.3} s",
            if round == 0 { " (warm-up)" } else { "" }
        );
        if round > 0 {
            times.push(slowest);
        }
        workers.send_to(|i| live.contains(&i), "CHECK")?;
        let tolerance = args.tolerance(live.len());
        let mut checked = 0;
        while checked < live.len() {
            let (i, f) = next(&mut workers)?;
            let f: Vec<&str> = f.iter().map(String::as_str).collect();
            match f.as_slice() {
                ["CHECKED", r, err] if r.parse::<usize>()? == round => {
                    let err: f32 = err.parse()?;
                    ensure!(
                        err <= tolerance,
                        "worker {i} round {round}: error {err:e} above {tolerance:e}"
                    );
                    checked += 1;
                }
                ["DONE"] if round == last => {
                    finished[i] = true;
                    done += 1;
                }
                ["EOF"] if finished[i] => {}
                _ => bail!("worker {i}: expected CHECKED {round}, got {f:?}"),
            }
        }
    }
    while done < live.len() {
        match next(&mut workers)? {
            (i, f) if f == ["DONE"] => {
                finished[i] = true;
                done += 1;
            }
            (i, f) if f == ["EOF"] && (finished[i] || killed == Some(i)) => {}
            (i, f) => bail!("worker {i}: expected DONE, got {f:?}"),
        }
    }
    workers.finish_except(killed)?;
    if let Some(k) = args.kill_member {
        ensure!(killed == Some(k), "member {k} did not die");
        println!(
            "hivemesh_collective_kill op={} world={} killed={k} named_by={} shrunk_to={} after=ok",
            args.op.name(),
            args.peers,
            live.len(),
            live.len()
        );
        return Ok(());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let algbw = (args.elements() * 4) as f64 / median / 1e9;
    let busbw = algbw * args.op.bus_factor(args.peers as f64);
    println!(
        "hivemesh_collective op={} world={} mib={} median_s={median:.4} algbw_gbs={algbw:.3} busbw_gbs={busbw:.3}",
        args.op.name(),
        args.peers,
        args.mib
    );
    Ok(())
}

/// One worker process.
pub fn run_worker(args: CollectiveWorkerArgs) -> anyhow::Result<()> {
    let bench = args.bench.clone();
    bench.validate()?;
    ensure!(args.index < bench.peers, "--index out of range");
    runtime(2)?.block_on(worker(bench, args.index))
}

/// A link that SIGKILLs this process once `left` more bytes are written through it.
struct KillAfter {
    inner: Box<dyn Link>,
    left: std::sync::Arc<std::sync::atomic::AtomicI64>,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl AsyncRead for KillAfter {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillAfter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        use std::sync::atomic::Ordering;
        if self.armed.load(Ordering::Relaxed)
            && self.left.fetch_sub(buf.len() as i64, Ordering::Relaxed) <= buf.len() as i64
        {
            // Mid-operation, on purpose: nothing after this byte count goes out.
            let _ = std::process::Command::new("kill")
                .args(["-9", &std::process::id().to_string()])
                .status();
            std::process::abort();
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What a round hands the operation, and what its result must be.
struct Round {
    inputs: Vec<Tensor>,
    root: usize,
}

enum Output {
    Tensors(Vec<Tensor>),
    Gathered(Vec<Vec<Tensor>>),
    One(Tensor),
}

fn values(member: usize, from: usize, len: usize) -> Vec<f32> {
    (from..from + len)
        .map(|e| generated_value(SEED, member, e))
        .collect()
}

fn tensor(v: Vec<f32>) -> anyhow::Result<Tensor> {
    Ok(Tensor::from_f32(&[v.len()], v)?)
}

/// The inputs of member `me` (roster index; `members` are the current members' roster
/// indices in group order).
fn prepare(
    op: Op,
    total: usize,
    members: &[usize],
    me: usize,
    root: usize,
) -> anyhow::Result<Round> {
    let n = members.len();
    let chunk = total / n;
    let inputs = match op {
        Op::AllReduce | Op::Broadcast => vec![tensor(values(me, 0, total))?],
        Op::AllGather => vec![tensor(values(me, 0, chunk))?],
        Op::ReduceScatter => (0..n)
            .map(|j| tensor(values(me, j * chunk, chunk)))
            .collect::<anyhow::Result<_>>()?,
    };
    Ok(Round { inputs, root })
}

async fn run_op(group: &mut Group, op: Op, round: Round) -> Result<Output, GroupError> {
    Ok(match op {
        Op::AllReduce => Output::Tensors(group.all_reduce(ReduceOp::Sum, round.inputs).await?),
        Op::AllGather => Output::Gathered(group.all_gather(round.inputs).await?),
        Op::Broadcast => Output::Tensors(group.broadcast(round.root, round.inputs).await?),
        Op::ReduceScatter => Output::One(group.reduce_scatter(ReduceOp::Sum, round.inputs).await?),
    })
}

/// Largest error of the output against the generator.
fn check(op: Op, total: usize, members: &[usize], me: usize, root: usize, out: &Output) -> f32 {
    let n = members.len();
    let chunk = total / n;
    let max_err = |got: &[f32], want: &mut dyn FnMut(usize) -> f32, len: usize| -> f32 {
        if got.len() != len {
            return f32::INFINITY;
        }
        got.iter()
            .enumerate()
            .map(|(e, g)| (g - want(e)).abs())
            .fold(0.0, f32::max)
    };
    match (op, out) {
        (Op::AllReduce, Output::Tensors(t)) => max_err(
            &t[0].to_f32_vec(),
            &mut |e| members.iter().map(|&m| generated_value(SEED, m, e)).sum(),
            total,
        ),
        (Op::Broadcast, Output::Tensors(t)) => max_err(
            &t[0].to_f32_vec(),
            &mut |e| generated_value(SEED, members[root], e),
            total,
        ),
        (Op::AllGather, Output::Gathered(g)) => {
            if g.len() != n {
                return f32::INFINITY;
            }
            g.iter()
                .zip(members)
                .map(|(t, &m)| {
                    max_err(
                        &t[0].to_f32_vec(),
                        &mut |e| generated_value(SEED, m, e),
                        chunk,
                    )
                })
                .fold(0.0, f32::max)
        }
        (Op::ReduceScatter, Output::One(t)) => {
            let j = members.iter().position(|&m| m == me).unwrap_or(usize::MAX);
            max_err(
                &t.to_f32_vec(),
                &mut |e| {
                    members
                        .iter()
                        .map(|&m| generated_value(SEED, m, j * chunk + e))
                        .sum()
                },
                chunk,
            )
        }
        _ => f32::INFINITY,
    }
}

async fn worker(b: CollectiveArgs, me: usize) -> anyhow::Result<()> {
    let mut lines = stdin_lines();
    let (node, link_peers) = join_roster(Transport::Tcp, b.peers, me, &mut lines).await?;
    let established = node
        .hub()
        .expect(Bytes::from_static(b"bench-collective"), &link_peers, me)?
        .establish(SETUP_TIMEOUT)
        .await;
    for (j, link) in established.links.iter().enumerate() {
        ensure!(
            j == me || link.is_some(),
            "no link to member {j}: {:?}",
            established.errors[j]
        );
    }
    let roster: Vec<PeerId> = link_peers.iter().map(|p| p.peer_id).collect();
    let left = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(KILL_AFTER_BYTES as i64));
    let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let victim = b.kill_member == Some(me);
    let links = established
        .links
        .into_iter()
        .map(|l| {
            l.map(|inner| -> Box<dyn Link> {
                if victim {
                    Box::new(KillAfter {
                        inner,
                        left: left.clone(),
                        armed: armed.clone(),
                    })
                } else {
                    inner
                }
            })
        })
        .collect();
    let kill_test = b.kill_member.is_some();
    let cfg = GroupConfig {
        // The SIGKILL test waits for nobody: the dead member's links fail at once.
        sender_timeout: Duration::from_secs(if kill_test { 5 } else { 10 }),
        reducer_timeout: Duration::from_secs(if kill_test { 10 } else { 20 }),
        op_timeout: Duration::from_secs(300),
        part_size_bytes: b.part_bytes,
        compression: b.compression.clone(),
        ..GroupConfig::default()
    };
    let mut group = Group::new(
        b"bench-collective",
        roster.clone(),
        me,
        links,
        established.kinds,
        cfg,
    )?;
    println!("LINKED");
    let total = b.elements();
    for round in 0..=b.rounds_run() {
        // Inputs are made before the GO barrier, so that no member spends the timed round's
        // first moments (and the others' CPU) on them.
        let members: Vec<usize> = group
            .members()
            .iter()
            .map(|p| roster.iter().position(|r| r == p).expect("a roster member"))
            .collect();
        // Broadcast from the victim in the kill round (so that it has data to send), else
        // from the first member.
        let root = match b.kill_member {
            Some(k) if round == 1 => members.iter().position(|&m| m == k).unwrap_or(0),
            _ => 0,
        };
        let inputs = prepare(b.op, total, &members, me, root)?;
        println!("PREPARED {round}");
        let go = lines.recv().await.context("parent closed stdin")?;
        ensure!(go == "GO", "expected GO, got '{go}'");
        if victim && round == 1 {
            armed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        println!("START {round}");
        let started = Instant::now();
        let cpu = process_cpu_seconds();
        let result = run_op(&mut group, b.op, inputs).await;
        let secs = started.elapsed().as_secs_f64();
        let cpu = process_cpu_seconds() - cpu;
        match result {
            Ok(out) => {
                println!("ROUND {round} {secs:.6} {cpu:.3}");
                let go = lines.recv().await.context("parent closed stdin")?;
                ensure!(go == "CHECK", "expected CHECK, got '{go}'");
                let err = check(b.op, total, &members, me, root, &out);
                println!("CHECKED {round} {err:e}");
            }
            Err(GroupError::Failed { failed, .. }) => {
                let named: Vec<String> = failed
                    .iter()
                    .map(|f| members[f.index].to_string())
                    .collect();
                println!("FAILED {round} {}", named.join(","));
                eprintln!(
                    "member {me}: {}",
                    failed
                        .iter()
                        .map(|f| f.reason.as_str())
                        .collect::<Vec<_>>()
                        .join("; ")
                );
                group.shrink().await?;
                println!("SHRUNK {}", group.size());
            }
            Err(e) => return Err(e.into()),
        }
    }
    println!("DONE");
    group.close().await;
    node.shutdown().await;
    Ok(())
}
