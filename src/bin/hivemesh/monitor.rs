//! `hivemesh monitor`: joins a swarm as a DHT client and serves a live web page of a training
//! run (`hivemesh::monitor`).

use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use hivemesh::monitor::{MonitorConfig, MonitorNode, MonitorOptions};

#[derive(Args, Debug)]
pub struct MonitorArgs {
    /// A peer of the swarm, ending with /p2p/<peer id> (repeatable; at least one).
    #[arg(long = "initial-peer", value_name = "MADDR", required = true)]
    initial_peers: Vec<libp2p::Multiaddr>,
    /// The run to watch: the optimizer's `run_id` (the progress records' prefix).
    #[arg(long, value_name = "ID", default_value = "quickstart_run")]
    run_id: String,
    /// Where to serve the page (port 0 picks one; the address is printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    http: std::net::SocketAddr,
    /// Address to listen on for the swarm (repeatable). Default: TCP and QUIC on all
    /// interfaces.
    #[arg(long, value_name = "MADDR")]
    listen: Vec<libp2p::Multiaddr>,
    /// The private swarm's key file, if the swarm is private.
    #[arg(long, value_name = "FILE")]
    swarm_key: Option<std::path::PathBuf>,
    /// The run's target batch size, for the ETA (default: what the peers' metrics say).
    #[arg(long, value_name = "N")]
    target_batch_size: Option<u64>,
    /// Seconds between two fetches of the swarm's records.
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0)]
    refresh: f64,
    /// Rows of the peer table, peers that left included.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    max_peers: usize,
    /// Fetches kept for the charts.
    #[arg(long, value_name = "N", default_value_t = 900)]
    history: usize,
}

pub fn run(args: MonitorArgs) -> anyhow::Result<()> {
    if !(args.refresh.is_finite() && (0.05..=3600.0).contains(&args.refresh)) {
        bail!("--refresh must be between 0.05 and 3600 seconds");
    }
    if args.max_peers == 0 || args.history == 0 {
        bail!("--max-peers and --history must be at least 1");
    }
    if args.target_batch_size == Some(0) {
        bail!("--target-batch-size must be at least 1");
    }
    if args.run_id.is_empty() {
        bail!("--run-id must not be empty");
    }
    let swarm_key = args
        .swarm_key
        .as_deref()
        .map(hivemesh::p2p::SwarmKey::read)
        .transpose()?;
    let options = MonitorOptions {
        initial_peers: args.initial_peers,
        run_id: args.run_id,
        http: args.http,
        listen: args.listen,
        swarm_key,
        config: MonitorConfig {
            refresh_period: Duration::from_secs_f64(args.refresh),
            max_peers: args.max_peers,
            history_len: args.history,
            target_batch_size: args.target_batch_size,
            ..MonitorConfig::default()
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let mut stop = super::StopSignal::install()?;
        let run_id = options.run_id.clone();
        let node = MonitorNode::start(options).await?;
        println!("{}", node.url());
        eprintln!(
            "monitoring run '{run_id}' at {}; Ctrl-C to stop",
            node.url()
        );
        stop.wait().await;
        eprintln!("shutting down");
        node.shutdown().await?;
        Ok(())
    })
}
