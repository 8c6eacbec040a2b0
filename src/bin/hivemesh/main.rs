//! The `hivemesh` command line: `hivemesh demo` (the main job) averages vectors among local
//! peers; `hivemesh sim` runs one simulated all-reduce round; `hivemesh dht` runs a
//! bootstrap/DHT peer; `hivemesh monitor` serves a live web page of a training run;
//! `hivemesh bench` measures.

mod bench;
mod bench_device;
mod chaos;
mod collective;
mod demo;
mod monitor;
mod steps;
mod workers;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use hivemesh::allreduce::{Mode, TensorDescriptor};
use hivemesh::compression::Compression;
use hivemesh::sim::{self, Fault, PeerStatus, SimConfig, SimPeer};
use hivemesh::tensor::DType;

#[derive(Parser, Debug)]
#[command(
    name = "hivemesh",
    version,
    about = "Peer-to-peer decentralized averaging"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The main job: a swarm of local peers in one process averaging random vectors on a
    /// Moshpit grid, with progress bars; ends with `demo peers=P rounds=R max_dev=E`.
    Demo(demo::DemoArgs),
    /// Run one butterfly all-reduce round among simulated peers in virtual time.
    Sim(SimArgs),
    /// Run a bootstrap/DHT peer; prints one dialable address per line, then serves until
    /// Ctrl-C.
    Dht(DhtArgs),
    /// Watch a training run: join its swarm as a DHT client and serve a live web page of it
    /// (and its data as JSON at /api/state); prints the page's URL, then serves until Ctrl-C.
    Monitor(monitor::MonitorArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a new private-swarm key to FILE (go-libp2p / IPFS `swarm.key` format, mode
    /// 0600); give it to every peer of the swarm with `--swarm-key FILE`.
    SwarmKey(SwarmKeyArgs),
    /// Internal: one process of `bench chaos`.
    #[command(hide = true)]
    BenchChaosWorker(chaos::ChaosWorkerArgs),
    /// Internal: one process of `bench allreduce`.
    #[command(hide = true)]
    BenchWorker(bench::WorkerArgs),
    /// Internal: one process of `bench steps`.
    #[command(hide = true)]
    BenchStepsWorker(steps::StepsWorkerArgs),
    /// Internal: one process of `bench collective`.
    #[command(hide = true)]
    BenchCollectiveWorker(collective::CollectiveWorkerArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// N peers as OS processes on loopback run timed all-reduce rounds over TLS data links and
    /// print `hivemesh world=N mib=M median_s=S algbw_gbs=A busbw_gbs=B`.
    Allreduce(bench::BenchArgs),
    /// P peers as OS processes each call `step()` R times (matchmaking + all-reduce) and print
    /// `hivemesh_steps peers=P group=G ok=K total=T median_step_s=S`.
    Steps(steps::StepsArgs),
    /// P peers as OS processes call `step()` in a loop while random ones are SIGKILLed and
    /// restarted (replacements load state); every finished step is checked against its
    /// report; prints `hivemesh_chaos peers=P rounds=R ok=K wrong=W hung=H max_rss_mb=M`.
    Chaos(chaos::ChaosArgs),
    /// N peers as OS processes on loopback form one lasting group (linked once) and run one
    /// collective per round (all-reduce and reduce-scatter sum), every result verified; prints
    /// `hivemesh_collective op=OP world=N mib=M median_s=S algbw_gbs=A busbw_gbs=B`. Sizes as
    /// nccl-tests: M is the all-reduce and broadcast buffer, the all-gather output and the
    /// reduce-scatter input.
    Collective(collective::CollectiveArgs),
}

#[derive(Args, Debug)]
struct SwarmKeyArgs {
    /// Where to write the key (refused if the file exists).
    #[arg(value_name = "FILE")]
    file: std::path::PathBuf,
}

#[derive(Args, Debug)]
struct DhtArgs {
    /// Address to listen on (repeatable). Default: TCP and QUIC on all interfaces.
    #[arg(long, value_name = "MADDR")]
    listen: Vec<libp2p::Multiaddr>,
    /// Peer to join through, ending with /p2p/<peer id> (repeatable).
    #[arg(long = "initial-peer", value_name = "MADDR")]
    initial_peers: Vec<libp2p::Multiaddr>,
    /// Ed25519 identity file; created (mode 0600) if missing, so the peer id survives restarts.
    #[arg(long, value_name = "FILE")]
    identity: Option<std::path::PathBuf>,
    /// Run the DHT in client mode (for peers that cannot accept connections).
    #[arg(long)]
    client: bool,
    /// Do not serve as a relay for peers behind NATs (by default a DHT node relays, with limits
    /// of 1 GiB and 30 minutes per circuit).
    #[arg(long)]
    no_relay: bool,
    /// An address others reach this node at (repeatable), e.g. a public IP in front of
    /// `--listen /ip4/0.0.0.0/...`. Listen addresses with an explicit IP count as such
    /// addresses already. Without one, peers must confirm an address first (a dial-back), and
    /// a node that only accepts connections never gets one: it cannot relay.
    #[arg(long, value_name = "MADDR")]
    external: Vec<libp2p::Multiaddr>,
    /// Run a private swarm: only peers holding this key (`hivemesh swarm-key FILE` makes one)
    /// connect. TCP only: QUIC is not used.
    #[arg(long, value_name = "FILE")]
    swarm_key: Option<std::path::PathBuf>,
    /// Refuse new connections while this process uses more than this much memory (MiB).
    #[arg(long, value_name = "MIB")]
    max_memory_mib: Option<usize>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9100; port 0 picks
    /// one, printed on stderr).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

/// A fault injected into one peer: `KIND@PEER`.
#[derive(Clone, Debug)]
struct FaultSpec {
    fault: Fault,
    peer: usize,
}

impl std::str::FromStr for FaultSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, peer) = s
            .split_once('@')
            .ok_or_else(|| format!("fault '{s}' must look like KIND@PEER, e.g. fail-sending@0"))?;
        let peer = peer
            .parse()
            .map_err(|_| format!("fault '{s}': '{peer}' is not a peer index"))?;
        Ok(Self {
            fault: kind.parse()?,
            peer,
        })
    }
}

#[derive(Args, Debug)]
struct SimArgs {
    /// Number of peers in the group.
    #[arg(long, default_value_t = 8)]
    peers: usize,
    /// MiB of f32 values per peer.
    #[arg(long, default_value_t = 16.0)]
    mib: f64,
    /// Target part size in bytes (after compression).
    #[arg(long, default_value_t = hivemesh::allreduce::DEFAULT_PART_SIZE_BYTES)]
    part_bytes: usize,
    /// none, float16, bfloat16, uniform8, quantile8, blockwise8 or adaptive.
    #[arg(long, default_value = "none")]
    compression: Compression,
    /// Inject a fault, KIND@PEER (repeatable). Kinds: fail-before, fail-sending, slow-sending,
    /// fail-reducing, slow-reducing, cancel, corrupt-sending, corrupt-reducing, crash,
    /// crash-standing-in.
    #[arg(long = "fault", value_name = "KIND@PEER")]
    faults: Vec<FaultSpec>,
    /// Number of client-mode peers (taken from the end of the group).
    #[arg(long, default_value_t = 0)]
    clients: usize,
    /// Number of aux-mode peers (taken before the clients).
    #[arg(long, default_value_t = 0)]
    aux: usize,
    /// Seed for the data and the link jitter.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// One-way link latency in milliseconds.
    #[arg(long, default_value_t = 5.0)]
    latency_ms: f64,
    /// Uplink bandwidth per peer in MB/s.
    #[arg(long, default_value_t = 1000.0)]
    bandwidth_mbps: f64,
    /// sender_timeout in seconds (reducer_timeout is twice that).
    #[arg(long, default_value_t = 0.5)]
    sender_timeout: f64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Sim(args) => run_sim(args),
        Command::Dht(args) => run_dht(args),
        Command::Monitor(args) => monitor::run(args),
        Command::SwarmKey(args) => write_swarm_key(&args.file),
        Command::Bench(BenchCommand::Allreduce(args)) => bench::run_bench(args),
        Command::BenchWorker(args) => bench::run_worker(args),
        Command::Bench(BenchCommand::Steps(args)) => steps::run(args),
        Command::Bench(BenchCommand::Chaos(args)) => chaos::run(args),
        Command::BenchChaosWorker(args) => chaos::run_worker(args),
        Command::BenchStepsWorker(args) => steps::run_worker(args),
        Command::Bench(BenchCommand::Collective(args)) => collective::run(args),
        Command::BenchCollectiveWorker(args) => collective::run_worker(args),
    };
    // Everything recorded reaches the timeline file (HIVEMESH_TIMELINE), closed.
    hivemesh::timeline::flush(true);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// What is logged unless `RUST_LOG` says otherwise: warnings, less the ones that are routine on
/// the internet (Kademlia peers that went away, AutoNAT dial-backs that a NAT dropped, QUIC
/// packets to unreachable addresses).
const DEFAULT_LOG_FILTER: &str =
    "warn,libp2p_kad::behaviour=error,libp2p_autonat=error,quinn_udp=error";

/// Ctrl-C (SIGINT) or SIGTERM, registered as soon as it is created.
struct StopSignal {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl StopSignal {
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    async fn wait(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Writes a new swarm key to `path`, readable by its owner only; never overwrites a file.
fn write_swarm_key(path: &std::path::Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    let key = hivemesh::p2p::SwarmKey::generate();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(key.to_key_file().as_bytes())
        .and_then(|()| file.write_all(b"\n"))
        .with_context(|| format!("writing {}", path.display()))?;
    println!(
        "swarm key written to {} (fingerprint {})",
        path.display(),
        key.fingerprint()
    );
    Ok(())
}

fn run_dht(args: DhtArgs) -> anyhow::Result<()> {
    use hivemesh::dht::{Dht, RelayDirectory};
    use hivemesh::p2p::{P2pConfig, RelayLimits, load_or_create_identity};

    let keypair = match &args.identity {
        Some(path) => load_or_create_identity(path)?,
        None => libp2p::identity::Keypair::generate_ed25519(),
    };
    let swarm_key = args
        .swarm_key
        .as_deref()
        .map(hivemesh::p2p::SwarmKey::read)
        .transpose()?;
    let mut config = P2pConfig {
        initial_peers: args.initial_peers,
        client_mode: args.client,
        swarm_key,
        ..P2pConfig::default()
    };
    config.connections.max_process_memory_bytes = args.max_memory_mib.map(|m| m << 20);
    let relay = !args.no_relay;
    config.nat.relay_server = relay.then(RelayLimits::default);
    if !args.listen.is_empty() {
        config.listen = args.listen;
    }
    // An explicit listen IP (and port) is where the operator told peers to find this node.
    config.nat.external = config
        .listen
        .iter()
        .filter(|a| hivemesh::p2p::is_explicit_addr(a))
        .cloned()
        .chain(args.external)
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        // Install the signal handlers before announcing addresses: whoever reads them may
        // interrupt us right away.
        let mut stop = StopSignal::install()?;
        let (dht, task) = Dht::start(config, keypair).await?;
        let metrics = match args.metrics {
            Some(addr) => Some(
                hivemesh::metrics::serve(addr, dht.p2p().metrics().clone())
                    .await
                    .with_context(|| format!("serving metrics on {addr}"))?,
            ),
            None => None,
        };
        for addr in dht.p2p().listen_addrs().await? {
            println!("{addr}");
        }
        if let Some(server) = &metrics {
            eprintln!("metrics at http://{}/metrics", server.local_addr());
        }
        eprintln!(
            "dht peer {} running{}; Ctrl-C to stop",
            dht.p2p().peer_id(),
            if relay { " as a relay" } else { "" }
        );
        let directory = RelayDirectory::start(dht.clone(), relay);
        let mut reach = dht.p2p().watch_reachability();
        let report = async {
            // One line per change of how others reach us, and a hint if a relay cannot relay.
            let hint_at = tokio::time::Instant::now() + Duration::from_secs(30);
            let mut hinted = !relay;
            loop {
                let r = reach.borrow_and_update().clone();
                eprintln!("{}", describe_reachability(&r));
                if !r.confirmed.is_empty() {
                    hinted = true;
                }
                let hint = async {
                    if hinted {
                        std::future::pending::<()>().await;
                    }
                    tokio::time::sleep_until(hint_at).await;
                };
                tokio::select! {
                    changed = reach.changed() => if changed.is_err() { break },
                    () = hint => {
                        hinted = true;
                        eprintln!(
                            "warning: no confirmed external address after 30 s, so this node \
                             does not relay for peers behind NATs yet; pass --external \
                             /ip4/<public ip>/tcp/<port> (or --listen with this host's public IP)"
                        );
                    }
                }
            }
        };
        tokio::select! {
            () = stop.wait() => {}
            () = report => {}
        }
        eprintln!("shutting down");
        if let Some(server) = metrics {
            server.shutdown().await;
        }
        directory.shutdown().await;
        dht.p2p().clone().shutdown().await?;
        drop(dht);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .context("the p2p task did not stop in time")?
            .context("the p2p task failed")?;
        Ok(())
    })
}

/// `reachability: public (confirmed /ip4/...)`, `reachability: punchable (relayed /ip4/...)`.
fn describe_reachability(r: &hivemesh::p2p::Reachability) -> String {
    let mut line = format!(
        "reachability: {}",
        r.reach.map_or("unknown", hivemesh::reach::Reach::name)
    );
    let mut list = |label: &str, addrs: &[libp2p::Multiaddr]| {
        if !addrs.is_empty() {
            let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
            line += &format!(" {label} {}", addrs.join(" "));
        }
    };
    list("confirmed", &r.confirmed);
    list("observed", &r.observed);
    list("relayed", &r.relayed);
    line
}

fn run_sim(args: SimArgs) -> anyhow::Result<()> {
    if args.peers == 0 {
        bail!("--peers must be at least 1");
    }
    if args.peers > 4096 {
        bail!("--peers must be at most 4096");
    }
    if !(args.mib.is_finite() && args.mib >= 0.0 && args.mib <= 4096.0) {
        bail!("--mib must be between 0 and 4096");
    }
    if args.part_bytes == 0 {
        bail!("--part-bytes must be at least 1");
    }
    if args.clients + args.aux > args.peers {
        bail!("--clients + --aux exceed --peers");
    }
    if !(args.sender_timeout.is_finite() && args.sender_timeout > 0.0) {
        bail!("--sender-timeout must be a positive number of seconds");
    }
    if !(args.bandwidth_mbps.is_finite() && args.bandwidth_mbps > 0.0) {
        bail!("--bandwidth-mbps must be positive");
    }
    if !(args.latency_ms.is_finite() && args.latency_ms >= 0.0) {
        bail!("--latency-ms must be non-negative");
    }
    let mut peers = vec![SimPeer::node(); args.peers];
    for p in peers.iter_mut().rev().take(args.clients) {
        p.mode = Mode::Client;
        p.fraction = 0.0;
    }
    for p in peers.iter_mut().rev().skip(args.clients).take(args.aux) {
        p.mode = Mode::Aux;
    }
    for f in &args.faults {
        let peer = peers.get_mut(f.peer).with_context(|| {
            format!(
                "fault at peer {} but there are {} peers",
                f.peer, args.peers
            )
        })?;
        if peer.fault.replace(f.fault).is_some() {
            bail!("peer {} has more than one fault", f.peer);
        }
    }
    let mut cfg = SimConfig::new(peers, args.seed);
    cfg.round.part_size_bytes = args.part_bytes;
    cfg.round.compression = args.compression.clone();
    cfg.round.sender_timeout = Duration::from_secs_f64(args.sender_timeout);
    cfg.round.reducer_timeout = cfg.round.sender_timeout * 2;
    cfg.slow_pause = cfg.round.reducer_timeout * 10;
    cfg.latency = Duration::from_secs_f64(args.latency_ms / 1e3);
    cfg.bandwidth = args.bandwidth_mbps * 1e6;

    // One large tensor plus a small one and a scalar, so that parts of several tensors mix.
    let total = ((args.mib * (1 << 20) as f64) / 4.0) as usize;
    let small = total.min(1000);
    let scalar = usize::from(total > small);
    let descriptors = vec![
        TensorDescriptor {
            shape: vec![total - small - scalar],
            dtype: DType::F32,
        },
        TensorDescriptor {
            shape: vec![small],
            dtype: DType::F32,
        },
        TensorDescriptor {
            shape: if scalar == 1 { vec![] } else { vec![0] },
            dtype: DType::F32,
        },
    ];

    let started = Instant::now();
    let result = sim::run(&cfg, &descriptors).context("generating peer data")?;
    let wall = started.elapsed();
    let checks = result.check();
    for (p, (peer, check)) in result.peers.iter().zip(&checks).enumerate() {
        let status = match &peer.status {
            PeerStatus::Finished(at) => format!("finished at={:.3}s", at.as_secs_f64()),
            PeerStatus::Cancelled => "cancelled".to_owned(),
            PeerStatus::NotStarted => "not-started".to_owned(),
            PeerStatus::Unfinished => "unfinished".to_owned(),
            PeerStatus::Rejected(e) => format!("rejected ({e})"),
            PeerStatus::Crashed(at) => format!("crashed at={:.3}s", at.as_secs_f64()),
        };
        let mut line = format!("peer {p} mode={} {status}", cfg.peers[p].mode);
        if let Some(f) = cfg.peers[p].fault {
            line += &format!(" fault={}", f.name());
        }
        if let (Some(outcome), Some(c)) = (&peer.outcome, check) {
            let r = &outcome.report;
            if c.total_elements > 0 {
                line += &format!(
                    " averaged={:.1}%",
                    100.0 * c.averaged_elements as f64 / c.total_elements as f64
                );
            }
            if !r.banned.is_empty() {
                line += &format!(" banned={:?}", r.banned);
            }
            if !r.failed_reducers.is_empty() {
                line += &format!(" failed_reducers={:?}", r.failed_reducers);
            }
            line += &format!(" max_abs_err={:.3e}", c.max_abs_err);
        }
        println!("{line}");
    }
    eprintln!(
        "virtual time {:.3}s, wall time {:.3}s",
        result.elapsed.as_secs_f64(),
        wall.as_secs_f64()
    );
    let max_err = checks
        .iter()
        .flatten()
        .map(|c| c.max_abs_err)
        .fold(0.0f32, f32::max);
    println!(
        "sim peers={} ok={} max_abs_err={:.3e}",
        args.peers,
        result.finished(),
        max_err
    );
    Ok(())
}
