//! `hivemesh bench allreduce`: N peers as separate OS processes on loopback, one butterfly
//! all-reduce per round over the link layer ([`hivemesh::links`]).
//!
//! The parent re-executes this binary as N `bench-worker`s. Each worker starts a node (swarm +
//! link hub; with a TLS data listener for `--transport tcp`, listening on QUIC only for
//! `--transport quic`) and prints `READY <peer id> <multiaddr> <data addr or ->`; the parent
//! sends every worker the roster (`ROSTER <id>@<multiaddr>@<data> ...`). For every round each
//! worker registers the round with its hub and links to the others (the lower index opens;
//! TLS where a data address is given, `/hivemesh/part/1` streams otherwise; the links double as
//! a first barrier), checks that every link uses the requested carrier and prints `LINKED <r>`.
//! Once every worker is linked, the parent says `GO` (the timing barrier: the members start
//! the timed round within a pipe write of each other, not a TLS handshake or two apart). Each
//! worker then prints `START <r>`, runs the round, prints `ROUND <r> <seconds> <cpu seconds>`
//! and, once the parent says `CHECK`, checks its result against the exact mean (computed from
//! the generator, without holding the other peers' data) and against the weighted mean over
//! the contributors its report names: `CHECKED <r> <err_vs_report> <err_vs_mean> <local_parts>
//! <fewest>`, the last the fewest contributors any part was averaged over (0 if one is local).
//! The parent prints each round's slowest time and the workers' total CPU time on stderr.
//! Round 0 is a warm-up. A round's time is the slowest worker's; the parent prints the median.
//!
//! With `--device cuda` each worker's tensor lives on the GPU ([`crate::bench_device`]): a
//! round's time then includes the snapshot to the host and the apply on the device, workers
//! also print `DEVICE <r> <staging s> <stream blocked ms> <apply kernel ms> <d2h GB/s>` and the
//! parent adds a `hivemesh_device` line with the medians.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::bench_device::{Device, DeviceTimes, Gpu};
use crate::workers::{PerfControl, Workers, stdin_lines};
use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use clap::Args;
use hivemesh::allreduce::{Member, Mode, Partition, RoundConfig, TensorDescriptor};
use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::buffers::BufferPool;
use hivemesh::compression::{Compression, CompressionType};
use hivemesh::links::{Carrier, LinkPeer};
use hivemesh::runner::{self, RunnerConfig};
use hivemesh::sim::{generated_value, make_tensors};
use hivemesh::tensor::DType;
use libp2p::PeerId;

const SEED: u64 = 1;
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// How the bench's peers carry parts.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Direct TLS 1.3 over TCP (the fast path).
    Tcp,
    /// libp2p streams over QUIC.
    Quic,
    /// libp2p streams over TCP + noise + yamux.
    Stream,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Quic => "quic",
            Self::Stream => "stream",
        }
    }

    fn carrier(self) -> Carrier {
        match self {
            Self::Tcp => Carrier::Tls,
            Self::Quic | Self::Stream => Carrier::Stream,
        }
    }
}

/// Options shared by the harness and its workers.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Number of peer processes.
    #[arg(long, default_value_t = 4)]
    peers: usize,
    /// MiB of f32 values per peer.
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
    /// Carrier of the parts: tcp (direct TLS 1.3 over TCP, authenticated by peer ids: the
    /// fast path), quic (`/hivemesh/part/1` libp2p streams over QUIC), or stream
    /// (`/hivemesh/part/1` libp2p streams over TCP + noise + yamux).
    #[arg(long, value_enum, default_value_t = Transport::Tcp)]
    transport: Transport,
    /// Where each worker's tensor lives: cpu (host memory) or cuda (GPU 0: snapshot by an
    /// asynchronous copy to pinned memory, delta rule applied on the device; needs a build with
    /// `--features cuda`).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
}

/// A worker's options: the shared ones plus its index.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    bench: BenchArgs,
    /// This worker's index in the group.
    #[arg(long)]
    index: usize,
}

impl BenchArgs {
    fn validate(&self) -> anyhow::Result<()> {
        ensure!(
            self.device == Device::Cpu || cfg!(feature = "cuda"),
            crate::bench_device::NO_CUDA
        );
        #[cfg(feature = "cuda")]
        if self.device == Device::Cuda {
            crate::bench_device::check_device()?;
        }
        validate_sizes(self.peers, self.mib, self.rounds, self.part_bytes)
    }

    fn elements(&self) -> usize {
        self.mib * (1 << 20) / 4
    }

    fn descriptors(&self) -> Vec<TensorDescriptor> {
        vec![TensorDescriptor {
            shape: vec![self.elements()],
            dtype: DType::F32,
        }]
    }

    fn round_config(&self, me: usize) -> RoundConfig {
        let members = vec![
            Member {
                mode: Mode::Node,
                fraction: 1.0
            };
            self.peers
        ];
        let mut cfg = RoundConfig::new(members, me);
        cfg.part_size_bytes = self.part_bytes;
        cfg.compression = self.compression.clone();
        cfg.sender_timeout = Duration::from_secs(10);
        cfg.reducer_timeout = Duration::from_secs(20);
        cfg.round_timeout = Some(Duration::from_secs(300));
        // A killed worker's span is re-reduced by a stand-in (every worker runs this code).
        cfg.stand_ins = true;
        cfg
    }

    /// Largest acceptable deviation from the exact mean for the chosen codec.
    fn tolerance(&self) -> f32 {
        match self.compression {
            Compression::Fixed(CompressionType::None) => 1e-5,
            Compression::Fixed(CompressionType::Float16) => 2e-3,
            Compression::Fixed(CompressionType::BFloat16) => 2e-2,
            _ => 0.1,
        }
    }
}

/// The size flags every multi-process bench shares: `--peers`, `--mib`, `--rounds`,
/// `--part-bytes`.
pub(crate) fn validate_sizes(
    peers: usize,
    mib: usize,
    rounds: usize,
    part_bytes: usize,
) -> anyhow::Result<()> {
    ensure!(
        (1..=64).contains(&peers),
        "--peers must be between 1 and 64"
    );
    ensure!(
        (1..=4096).contains(&mib),
        "--mib must be between 1 and 4096"
    );
    ensure!(
        (1..=1000).contains(&rounds),
        "--rounds must be between 1 and 1000"
    );
    ensure!(part_bytes >= 1024, "--part-bytes must be at least 1024");
    Ok(())
}

/// The parent: spawns the workers, relays the roster, prints the result line.
pub fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    args.validate()?;
    let mut perf = PerfControl::from_env()?;
    let mut workers = Workers::spawn(
        args.peers,
        "bench-worker",
        &[
            ("--peers", args.peers.to_string()),
            ("--mib", args.mib.to_string()),
            ("--rounds", args.rounds.to_string()),
            ("--part-bytes", args.part_bytes.to_string()),
            ("--compression", compression_name(&args.compression)),
            ("--transport", args.transport.name().to_owned()),
            ("--device", args.device.name().to_owned()),
        ],
    )?;

    exchange_roster(&mut workers, args.peers)?;
    // Per timed round, the slowest worker's (staging s, stream blocked ms, apply ms), and the
    // slowest worker's plain device-to-host copy rate.
    let mut device: Vec<[f64; 3]> = Vec::new();
    let mut d2h_gbs = f64::INFINITY;

    let total_rounds = args.rounds + 1;
    let mut times = vec![vec![0.0f64; args.peers]; total_rounds];
    let mut reported = vec![0usize; total_rounds];
    let mut linked = vec![0usize; total_rounds];
    let mut cpu_s = vec![0.0f64; total_rounds];
    let mut finished = vec![false; args.peers];
    let mut done = 0;
    let deadline = Instant::now() + Duration::from_secs(60 * 60);
    let tolerance = args.tolerance();
    while done < args.peers {
        let left = deadline.saturating_duration_since(Instant::now());
        let (i, line) = workers
            .lines
            .recv_timeout(left)
            .context("bench timed out")?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["LINKED", r] => {
                let r: usize = r.parse()?;
                ensure!(r < total_rounds, "worker {i}: round {r} out of range");
                linked[r] += 1;
                if linked[r] == args.peers {
                    perf.set(r > 0)?;
                    workers.broadcast("GO")?;
                }
            }
            ["START", _] => {}
            ["DEVICE", r, staging, blocked, apply, d2h] => {
                let r: usize = r.parse()?;
                ensure!(r < total_rounds, "worker {i}: round {r} out of range");
                d2h_gbs = d2h_gbs.min(d2h.parse()?);
                if r > 0 {
                    device.resize(args.rounds, [0.0; 3]);
                    let slot = &mut device[r - 1];
                    for (k, v) in [staging, blocked, apply].into_iter().enumerate() {
                        slot[k] = slot[k].max(v.parse()?);
                    }
                }
            }
            ["ROUND", r, secs, cpu] => {
                let r: usize = r.parse()?;
                ensure!(r < total_rounds, "worker {i}: round {r} out of range");
                times[r][i] = secs.parse()?;
                cpu_s[r] += cpu.parse::<f64>()?;
                reported[r] += 1;
                if reported[r] == args.peers {
                    perf.set(false)?;
                    let slowest = times[r].iter().cloned().fold(0.0, f64::max);
                    eprintln!(
                        "round {r}{}: {slowest:.3} s, {:.2} CPU-s in all workers",
                        if r == 0 { " (warm-up)" } else { "" },
                        cpu_s[r]
                    );
                    // Everyone is done with the timed part: now they may check (checking
                    // earlier would steal CPU from peers still in the round).
                    workers.broadcast("CHECK")?;
                }
            }
            ["CHECKED", r, err_report, err_mean, local, _fewest] => {
                let (err_report, err_mean): (f32, f32) = (err_report.parse()?, err_mean.parse()?);
                ensure!(
                    err_report <= tolerance && err_mean <= tolerance && *local == "0",
                    "worker {i} round {r}: error vs report {err_report:e}, vs exact mean \
                     {err_mean:e}, {local} parts left local (tolerance {tolerance:e})"
                );
            }
            ["DONE"] => {
                finished[i] = true;
                done += 1;
            }
            ["EOF"] if finished[i] => {}
            ["EOF"] => bail!("worker {i} exited early"),
            _ => bail!("worker {i}: unexpected line '{line}'"),
        }
    }
    workers.finish()?;

    let mut per_round: Vec<f64> = times[1..]
        .iter()
        .map(|t| t.iter().cloned().fold(0.0, f64::max))
        .collect();
    per_round.sort_by(f64::total_cmp);
    let median = per_round[per_round.len() / 2];
    let bytes = (args.elements() * 4) as f64;
    let algbw = bytes / median / 1e9;
    let n = args.peers as f64;
    let busbw = algbw * 2.0 * (n - 1.0) / n;
    println!(
        "hivemesh world={} mib={} median_s={median:.4} algbw_gbs={algbw:.3} busbw_gbs={busbw:.3}",
        args.peers, args.mib
    );
    if args.device == Device::Cuda {
        ensure!(
            device.len() == args.rounds,
            "workers reported no device times"
        );
        let median = |k: usize| {
            let mut v: Vec<f64> = device.iter().map(|d| d[k]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let snapshot_bytes =
            crate::bench_device::snapshot_bytes(args.elements(), &args.compression) as f64;
        println!(
            "hivemesh_device world={} mib={} device=cuda staging_gbs={:.2} pcie_d2h_gbs={d2h_gbs:.2} \
             stream_blocked_ms={:.3} apply_kernel_ms={:.3} {}",
            args.peers,
            args.mib,
            snapshot_bytes / median(0) / 1e9,
            median(1),
            median(2),
            crate::bench_device::nvrtc_summary()
        );
    }
    Ok(())
}

/// The parent's side of the roster: every worker's `READY <id> <multiaddr> <data>`, then
/// `ROSTER <id>@<multiaddr>@<data> ...` to all.
pub(crate) fn exchange_roster(workers: &mut Workers, peers: usize) -> anyhow::Result<()> {
    let mut ready: Vec<Option<String>> = vec![None; peers];
    while ready.iter().any(Option::is_none) {
        let (i, line) = workers
            .lines
            .recv_timeout(SETUP_TIMEOUT)
            .context("workers did not report ready in time")?;
        let rest = line
            .strip_prefix("READY ")
            .with_context(|| format!("worker {i}: unexpected line '{line}'"))?;
        let fields: Vec<&str> = rest.split(' ').collect();
        let [id, maddr, data] = fields[..] else {
            bail!("worker {i}: expected READY <id> <multiaddr> <data addr or ->, got '{line}'");
        };
        ready[i] = Some(format!("{id}@{maddr}@{data}"));
    }
    workers.broadcast(&format!(
        "ROSTER {}",
        ready.into_iter().flatten().collect::<Vec<_>>().join(" ")
    ))?;
    Ok(())
}

pub(crate) fn compression_name(c: &Compression) -> String {
    match c {
        Compression::Fixed(CompressionType::None) => "none",
        Compression::Fixed(CompressionType::Float16) => "float16",
        Compression::Fixed(CompressionType::BFloat16) => "bfloat16",
        Compression::Fixed(CompressionType::Uniform8Bit) => "uniform8",
        Compression::Fixed(CompressionType::Quantile8Bit) => "quantile8",
        Compression::Fixed(CompressionType::Blockwise8Bit) => "blockwise8",
        Compression::Fixed(CompressionType::SparseTopK) => "topk",
        Compression::Adaptive { .. } => "adaptive",
        Compression::Sparse(params) => return format!("topk{}", params.spec()),
    }
    .to_owned()
}

/// One worker process.
pub fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    let bench = args.bench.clone();
    bench.validate()?;
    let me = args.index;
    ensure!(me < bench.peers, "--index out of range");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(worker(bench, me))
}

async fn worker(bench: BenchArgs, me: usize) -> anyhow::Result<()> {
    let mut lines = stdin_lines();
    let (node, link_peers) = join_roster(bench.transport, bench.peers, me, &mut lines).await?;

    let descriptors = bench.descriptors();
    let mut tensors = make_tensors(&descriptors, SEED, me)?;
    let mut gpu = match bench.device {
        Device::Cpu => None,
        Device::Cuda => Some(Gpu::open(&tensors[0], &bench.compression)?),
    };
    let cfg = bench.round_config(me);
    let partition = Partition::new(
        &descriptors,
        &cfg.fractions(),
        cfg.part_size_bytes,
        &cfg.compression,
    )?;
    // One runner config, so one buffer pool, for every round; it keeps the received averages too.
    let runner_cfg = RunnerConfig {
        pool: BufferPool::new(bench.elements() * 4 + hivemesh::buffers::DEFAULT_RETAIN_BYTES),
        ..RunnerConfig::default()
    };
    for round in 0..=bench.rounds {
        // Fresh links every round, through the node's link hub (they double as the start
        // barrier: a peer links only once it is ready for the round).
        let group = Bytes::from(format!("bench-round-{round}"));
        let established = node
            .hub()
            .expect(group.clone(), &link_peers, me)?
            .establish(SETUP_TIMEOUT)
            .await;
        for (j, carrier) in established.carriers.iter().enumerate() {
            if j == me {
                continue;
            }
            match (carrier, &established.errors[j]) {
                (Some(c), _) if *c == bench.transport.carrier() => {}
                (Some(c), _) => bail!("link to peer {j} uses {c}, not {}", bench.transport.name()),
                (None, error) => bail!("no link to peer {j}: {error:?}"),
            }
        }
        println!("LINKED {round}");
        let go = lines.recv().await.context("parent closed stdin")?;
        ensure!(go == "GO", "expected GO, got '{go}'");
        println!("START {round}");
        let started = Instant::now();
        let cpu_before = process_cpu_seconds();
        let mut staging_s = 0.0;
        let round_tensors = match gpu.as_mut() {
            Some(gpu) => {
                let (snapshot, s) = gpu.snapshot()?;
                staging_s = s;
                vec![snapshot]
            }
            None => std::mem::take(&mut tensors),
        };
        let (start, outcome) = runner::run_round(
            cfg.clone(),
            group,
            round_tensors,
            established.links,
            runner_cfg.clone(),
        )
        .await?;
        let device_times: Option<DeviceTimes> = match gpu.as_mut() {
            Some(gpu) => Some(gpu.apply(&outcome, &start[0], staging_s)?),
            None => None,
        };
        let secs = started.elapsed().as_secs_f64();
        let cpu = process_cpu_seconds() - cpu_before;
        println!("ROUND {round} {secs:.6} {cpu:.3}");
        if let (Some(t), Some(gpu)) = (&device_times, &gpu) {
            println!(
                "DEVICE {round} {:.6} {:.4} {:.4} {:.3}",
                t.staging_s,
                t.blocked_ms,
                t.apply_ms,
                gpu.rates().0
            );
        }
        let go = lines.recv().await.context("parent closed stdin")?;
        ensure!(go == "CHECK", "expected CHECK, got '{go}'");
        let (err_report, mut err_mean, local, fewest) = check(&bench, &partition, &start, &outcome);
        if let Some(gpu) = &gpu {
            // The device tensor itself now holds the mean (every round averages equal means
            // after the first, so the generator's mean stays the reference).
            for (e, v) in gpu.values()?.into_iter().enumerate() {
                let mean = (0..bench.peers)
                    .map(|p| f64::from(generated_value(SEED, p, e)))
                    .sum::<f64>()
                    / bench.peers as f64;
                err_mean = err_mean.max((v - mean as f32).abs());
            }
        }
        println!("CHECKED {round} {err_report:e} {err_mean:e} {local} {fewest}");
        outcome.recycle(&runner_cfg.pool);
        if gpu.is_none() {
            tensors = start;
        }
    }
    println!("DONE");
    node.shutdown().await;
    Ok(())
}

/// A worker's side of the roster: starts its node, prints `READY`, reads the roster, adds
/// every other worker's address to the swarm; returns the node and the members' link
/// descriptions in roster order.
pub(crate) async fn join_roster(
    transport: Transport,
    peers: usize,
    me: usize,
    lines: &mut tokio::sync::mpsc::Receiver<String>,
) -> anyhow::Result<(Node, Vec<LinkPeer>)> {
    let keypair = libp2p::identity::Keypair::generate_ed25519();
    let peer_id = keypair.public().to_peer_id();
    let mut config = NodeConfig::loopback();
    match transport {
        Transport::Tcp => {}
        Transport::Stream => config.data_listen = None,
        Transport::Quic => {
            config.data_listen = None;
            config.p2p.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse()?];
        }
    }
    let node = Node::start(config, keypair).await?;
    let maddr = node
        .dht()
        .p2p()
        .listen_addrs()
        .await?
        .into_iter()
        .next()
        .context("the node has no listen address")?;
    let data = node
        .hub()
        .data_addr()
        .map_or_else(|| "-".to_owned(), |a| a.to_string());
    println!("READY {peer_id} {maddr} {data}");

    let roster_line = lines.recv().await.context("parent closed stdin")?;
    let roster: Vec<(PeerId, libp2p::Multiaddr, Option<SocketAddr>)> = roster_line
        .trim()
        .strip_prefix("ROSTER ")
        .context("expected ROSTER")?
        .split(' ')
        .map(|entry| {
            let mut parts = entry.split('@');
            let (Some(id), Some(maddr), Some(data), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                bail!("roster entry '{entry}' is not id@multiaddr@data");
            };
            let data = if data == "-" {
                None
            } else {
                Some(data.parse()?)
            };
            Ok((id.parse()?, maddr.parse()?, data))
        })
        .collect::<anyhow::Result<_>>()?;
    ensure!(
        roster.len() == peers && roster[me].0 == peer_id,
        "bad roster"
    );
    for (i, (id, maddr, _)) in roster.iter().enumerate() {
        if i != me {
            node.dht()
                .p2p()
                .add_peer_addresses(*id, vec![maddr.clone()])
                .await?;
        }
    }
    let link_peers: Vec<LinkPeer> = roster
        .iter()
        .map(|(peer_id, _, data_addr)| LinkPeer::public(*peer_id, *data_addr))
        .collect();

    Ok((node, link_peers))
}

/// CPU time (user + system) this process has used so far, from `/proc/self/stat` (0 where
/// that is not available; it only feeds a diagnostic line).
pub(crate) fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Kernel clock ticks are 100 Hz on every Linux configuration we run on.
    (ticks(11) + ticks(12)) / 100.0
}

/// (error vs the contributors the report names, error vs the exact mean, parts left local).
fn check(
    bench: &BenchArgs,
    partition: &Partition,
    start: &[hivemesh::tensor::Tensor],
    outcome: &hivemesh::allreduce::Outcome,
) -> (f32, f32, usize, usize) {
    if outcome.results.is_none() {
        return (0.0, 0.0, 0, 0);
    }
    // (A device snapshot under a 16-bit codec is 16-bit.)
    let own = start[0].to_f32_vec();
    let n = bench.peers;
    let mean_of = |peers: &mut dyn Iterator<Item = usize>, e: usize| -> f32 {
        let (sum, count) = peers.fold((0.0f64, 0usize), |(s, c), p| {
            (s + f64::from(generated_value(SEED, p, e)), c + 1)
        });
        (sum / count as f64) as f32
    };
    let (mut err_report, mut err_mean, mut local) = (0.0f32, 0.0f32, 0);
    let mut fewest = n;
    let mut result = Vec::new();
    for span in &outcome.report.spans {
        for seg in &span.segments {
            let everyone = seg.contributors.as_ref().is_some_and(|c| c.len() == n);
            for g in seg.parts.clone() {
                let spec = *partition.part(g);
                if seg.contributors.is_none() {
                    local += 1;
                }
                fewest = fewest.min(seg.contributors.as_ref().map_or(0, |c| c.len()));
                result.resize(spec.len, 0.0);
                if outcome.result_into(g, start, &mut result).is_none() {
                    return (f32::INFINITY, f32::INFINITY, local, 0);
                }
                for (e, &result) in spec.range().zip(&result) {
                    let mean = mean_of(&mut (0..n), e);
                    let named = match &seg.contributors {
                        None => own[e],
                        Some(_) if everyone => mean,
                        Some(c) => mean_of(&mut c.iter(), e),
                    };
                    err_mean = err_mean.max((result - mean).abs());
                    err_report = err_report.max((result - named).abs());
                }
            }
        }
    }
    (err_report, err_mean, local, fewest)
}
