//! The tokio shell around [`MonitorState`]: one task fetching the records on a schedule
//! ([`Monitor`]), and a whole monitor node, DHT client plus web server ([`MonitorNode`]), as
//! `hivemesh monitor` and `python -m hivemesh.monitor` run it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use libp2p::Multiaddr;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::server::{MonitorServer, serve};
use super::state::{MonitorConfig, MonitorState, Snapshot};
use crate::dht::{Dht, DhtError, DhtTime, DhtValue};
use crate::p2p::{P2pConfig, P2pError, SwarmKey};
use crate::train::task::OwnedTask;
use crate::train::{ConfigError, metrics_key, progress_key};

fn now() -> f64 {
    DhtTime::now().as_secs()
}

/// The progress tracker's prefix in the run `run_id`: `"{run_id}_progress"`, as hivemind's
/// `Optimizer` (and `hivemesh.optim.Optimizer`) names it; its records live under
/// `progress_key` of that, `"{run_id}_progress_progress"`.
pub fn progress_prefix(run_id: &str) -> String {
    format!("{run_id}_progress")
}

/// `(peer, record bytes, expiration)` per owner entry of a fetched value.
fn entries(value: &Option<DhtValue>) -> Vec<(libp2p::PeerId, &[u8], f64)> {
    value
        .iter()
        .flat_map(|v| v.owner_entries())
        .map(|(peer, e)| (peer, &e.value[..], e.expiration.as_secs()))
        .collect()
}

struct Shared {
    state: Mutex<MonitorState>,
    dht: Dht,
    run_id: String,
    keys: Vec<Vec<u8>>,
    fetches: watch::Sender<u64>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, MonitorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One fetch of both keys under the request timeout, applied.
    async fn fetch(&self) {
        let timeout = self.state().config().request_timeout;
        let got = tokio::time::timeout(timeout, self.dht.get_many(&self.keys)).await;
        let (progress, metrics) = match got.as_deref() {
            Ok([Ok(progress), Ok(metrics)]) => (progress, metrics),
            Ok([Err(e), _] | [_, Err(e)]) => return self.failed(e.to_string()),
            Ok(_) => return self.failed("the DHT answered the wrong number of keys".into()),
            Err(_) => return self.failed("the DHT request timed out".into()),
        };
        let summary = self
            .state()
            .apply(entries(progress), entries(metrics), now());
        for (peer, error) in &summary.progress.rejected {
            tracing::debug!(%peer, %error, "ignoring a malformed progress record");
        }
        for (peer, error) in &summary.metrics_rejected {
            tracing::debug!(%peer, %error, "ignoring a malformed metrics record");
        }
        self.fetches.send_modify(|n| *n += 1);
    }

    fn failed(&self, error: String) {
        tracing::debug!(%error, "monitor fetch failed");
        self.state().fetch_failed(error, now());
    }
}

async fn fetcher(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = shared.fetch() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let period = shared.state().config().refresh_period;
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

/// Watches a run: fetches its progress and metrics records every `refresh_period` into a
/// [`MonitorState`] (see the [module docs](super)).
pub struct Monitor {
    shared: Arc<Shared>,
    task: OwnedTask,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("run_id", &self.shared.run_id)
            .finish_non_exhaustive()
    }
}

impl Monitor {
    /// Starts watching the run `run_id` on `dht` (call within a tokio runtime).
    pub fn start(dht: Dht, run_id: &str, config: MonitorConfig) -> Result<Self, ConfigError> {
        let state = MonitorState::new(config, dht.p2p().peer_id(), now())?;
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            keys: vec![progress_key(&progress_prefix(run_id)), metrics_key(run_id)],
            dht,
            run_id: run_id.to_owned(),
            fetches: watch::Sender::new(0),
        });
        let task = OwnedTask::new();
        let s = shared.clone();
        task.spawn(|stop| fetcher(s, stop));
        Ok(Self { shared, task })
    }

    /// The run watched.
    pub fn run_id(&self) -> &str {
        &self.shared.run_id
    }

    /// What the page shows now.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.state().snapshot(&self.shared.run_id, now())
    }

    /// Waits until `n` fetches were applied, at most `timeout`; returns whether they were.
    pub async fn wait_fetches(&self, n: u64, timeout: Duration) -> bool {
        let mut fetches = self.shared.fetches.subscribe();
        tokio::time::timeout(timeout, fetches.wait_for(|f| *f >= n))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Stops fetching (a fetch under way is dropped). Idempotent.
    pub async fn shutdown(&self) {
        self.task.stop(Duration::from_secs(5)).await;
    }
}

/// What a [`MonitorNode`] needs.
#[derive(Clone, Debug)]
pub struct MonitorOptions {
    /// Peers of the swarm to join through (each ending with `/p2p/<peer id>`).
    pub initial_peers: Vec<Multiaddr>,
    /// The run to watch (the optimizer's `run_id`; see [`progress_prefix`]).
    pub run_id: String,
    /// Where to serve the page (port 0 picks one).
    pub http: SocketAddr,
    /// Addresses to listen on for the swarm (empty: the p2p layer's default).
    pub listen: Vec<Multiaddr>,
    /// The private swarm's key, if the swarm is private.
    pub swarm_key: Option<SwarmKey>,
    /// What the monitor keeps.
    pub config: MonitorConfig,
}

/// Why a monitor did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MonitorError {
    /// Nothing to join through.
    #[error("at least one initial peer is needed (--initial-peer ADDR)")]
    NoInitialPeers,
    /// The run id is empty or too long.
    #[error("the run id must be 1 to 256 bytes")]
    BadRunId,
    /// The parameters are unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The DHT client did not start.
    #[error("starting the DHT client: {0}")]
    Dht(#[from] DhtError),
    /// The web server could not listen.
    #[error("serving the page on {addr}: {source}")]
    Http {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The p2p task failed to stop.
    #[error("stopping the p2p node: {0}")]
    Shutdown(#[from] P2pError),
}

/// A monitor node: a DHT client in the swarm, a [`Monitor`] of the run and the web server.
pub struct MonitorNode {
    dht: Dht,
    p2p_task: Option<JoinHandle<()>>,
    monitor: Arc<Monitor>,
    server: Option<MonitorServer>,
}

impl std::fmt::Debug for MonitorNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MonitorNode")
            .field("url", &self.url())
            .finish_non_exhaustive()
    }
}

impl MonitorNode {
    /// Joins the swarm as a DHT client, starts watching `run_id` and serves the page (call
    /// within a tokio runtime).
    pub async fn start(options: MonitorOptions) -> Result<Self, MonitorError> {
        if options.initial_peers.is_empty() {
            return Err(MonitorError::NoInitialPeers);
        }
        if options.run_id.is_empty() || options.run_id.len() > 256 {
            return Err(MonitorError::BadRunId);
        }
        options.config.validate()?;
        let mut config = P2pConfig {
            initial_peers: options.initial_peers,
            client_mode: true,
            swarm_key: options.swarm_key,
            ..P2pConfig::default()
        };
        if !options.listen.is_empty() {
            config.listen = options.listen;
        }
        let keypair = libp2p::identity::Keypair::generate_ed25519();
        let (dht, p2p_task) = Dht::start(config, keypair).await?;
        let monitor = Arc::new(Monitor::start(
            dht.clone(),
            &options.run_id,
            options.config,
        )?);
        let server = serve(options.http, monitor.clone())
            .await
            .map_err(|source| MonitorError::Http {
                addr: options.http,
                source,
            })?;
        Ok(Self {
            dht,
            p2p_task: Some(p2p_task),
            monitor,
            server: Some(server),
        })
    }

    /// The page's address, `http://ADDR/`.
    pub fn url(&self) -> String {
        match &self.server {
            Some(s) => format!("http://{}/", s.local_addr()),
            None => String::new(),
        }
    }

    /// The monitor.
    pub fn monitor(&self) -> &Arc<Monitor> {
        &self.monitor
    }

    /// Stops the server, the monitor and the DHT client (each under a timeout).
    pub async fn shutdown(mut self) -> Result<(), MonitorError> {
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
        self.monitor.shutdown().await;
        self.dht.p2p().clone().shutdown().await?;
        if let Some(mut task) = self.p2p_task.take()
            && tokio::time::timeout(Duration::from_secs(10), &mut task)
                .await
                .is_err()
        {
            tracing::warn!("the monitor's p2p task did not stop in time");
            task.abort();
        }
        Ok(())
    }
}
