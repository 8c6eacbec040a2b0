//! A hivemesh node: the libp2p swarm with its DHT, plus the link hub that accepts round links
//! (TLS data plane and `/hivemesh/part/1` streams), and its part in the relay directory
//! ([`crate::dht::RelayDirectory`]). Averagers run on a node.
//!
//! [`Node::start`] returns once the node knows how others reach it (bounded by
//! [`NodeConfig::reachability_wait`]): with initial peers, the first peer's identify answer says
//! where our connection came from ([`crate::reach`]); a node behind a NAT then also waits for
//! a relay reservation, so that its first step can already be joined through the relay.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use tokio::task::JoinHandle;

use crate::dht::{Dht, RelayDirectory};
use crate::links::{DataPlane, HubConfig, LinkHub};
use crate::metrics::{Metrics, MetricsServer};
use crate::p2p::{P2pConfig, Reachability};
use crate::reach::Reach;
use crate::rpc::{HandlerResult, Rpc, RpcConfig, RpcError};
use crate::transport::DataIdentity;

/// What a node runs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The swarm.
    pub p2p: P2pConfig,
    /// Where the TLS data plane listens (`None`: no data listener; peers link to us over
    /// libp2p streams, and we open TLS links to those that have one).
    pub data_listen: Option<SocketAddr>,
    /// The link hub.
    pub hub: HubConfig,
    /// How long [`Node::start`] waits to learn the node's reachability (and, behind a NAT,
    /// for a relay reservation).
    pub reachability_wait: Duration,
    /// Where to serve the node's metrics (`http://ADDR/metrics`, Prometheus text format;
    /// [`crate::metrics`]). `None`: not served (they are still kept: [`Node::metrics`]).
    pub metrics_listen: Option<SocketAddr>,
    /// The RPC endpoint's limits ([`Node::serve`], [`Node::call`]).
    pub rpc: RpcConfig,
}

impl NodeConfig {
    /// Everything on loopback (tests, the demo).
    pub fn loopback() -> Self {
        Self {
            p2p: P2pConfig::loopback(),
            data_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            hub: HubConfig::default(),
            reachability_wait: Duration::from_secs(5),
            metrics_listen: None,
            rpc: RpcConfig::default(),
        }
    }

    /// A bootstrap node on loopback: the swarm and DHT only, no data-plane listener (it takes
    /// part in no rounds).
    pub fn loopback_bootstrap() -> Self {
        Self {
            data_listen: None,
            ..Self::loopback()
        }
    }
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The swarm or DHT.
    #[error(transparent)]
    Dht(#[from] crate::dht::DhtError),
    /// The data-plane identity.
    #[error(transparent)]
    Tls(#[from] crate::transport::TlsError),
    /// The link hub.
    #[error(transparent)]
    Hub(#[from] crate::links::HubError),
    /// The swarm failed after starting.
    #[error(transparent)]
    P2p(#[from] crate::p2p::P2pError),
    /// The node listens nowhere.
    #[error("the node has no listen address")]
    NoAddress,
    /// The RPC endpoint could not start.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// The metrics endpoint could not listen.
    #[error("serving metrics on {addr}: {source}")]
    Metrics {
        /// Where it was to listen.
        addr: SocketAddr,
        /// Why it could not.
        source: std::io::Error,
    },
}

/// A running node (see the module docs).
#[derive(Debug)]
pub struct Node {
    dht: Dht,
    hub: Arc<LinkHub>,
    relays: RelayDirectory,
    metrics_server: Option<MetricsServer>,
    rpc: Rpc,
    swarm: JoinHandle<()>,
}

impl Node {
    /// Starts the swarm (joining through `config.p2p.initial_peers`) and the link hub.
    pub async fn start(config: NodeConfig, keypair: Keypair) -> Result<Self, NodeError> {
        let data_plane = match config.data_listen {
            Some(listen) => Some(DataPlane {
                identity: DataIdentity::new(&keypair)?,
                listen: Some(listen),
            }),
            None => None,
        };
        let bootstrapped = !config.p2p.initial_peers.is_empty();
        let nat = config.p2p.nat.clone();
        let (dht, swarm) = Dht::start(config.p2p, keypair).await?;
        let hub = LinkHub::start(dht.p2p().clone(), data_plane, config.hub).await?;
        let metrics_server = match config.metrics_listen {
            Some(addr) => Some(
                crate::metrics::serve(addr, dht.p2p().metrics().clone())
                    .await
                    .map_err(|source| NodeError::Metrics { addr, source })?,
            ),
            None => None,
        };
        let rpc = Rpc::start(dht.p2p().clone(), config.rpc)?;
        let relays = RelayDirectory::start(dht.clone(), nat.relay_server.is_some());
        let p2p = dht.p2p();
        if bootstrapped && nat.assume.is_none() {
            let wait = config.reachability_wait;
            let r = p2p.wait_reachability(wait, |r| r.reach.is_some()).await;
            if r.class() != Reach::Public && nat.relay_reservations > 0 {
                p2p.wait_reachability(wait, |r| !r.relayed.is_empty()).await;
            }
        }
        let r = p2p.reachability();
        tracing::info!(
            reach = r.reach.map_or("unknown", Reach::name),
            relayed = ?r.relayed,
            "node started"
        );
        Ok(Self {
            dht,
            hub: Arc::new(hub),
            relays,
            metrics_server,
            rpc,
            swarm,
        })
    }

    /// How others can reach this node, as far as it knows now.
    pub fn reachability(&self) -> Reachability {
        self.dht.p2p().reachability()
    }

    /// The node's DHT (and, through it, its p2p handle).
    pub fn dht(&self) -> &Dht {
        &self.dht
    }

    /// An address to join this node through (`--initial-peer` / `P2pConfig::initial_peers`):
    /// its first listen address, ending with `/p2p/<peer id>`.
    pub async fn join_address(&self) -> Result<Multiaddr, NodeError> {
        self.dht
            .p2p()
            .listen_addrs()
            .await?
            .into_iter()
            .next()
            .ok_or(NodeError::NoAddress)
    }

    /// Serves `method` to other peers: each call runs `handler(caller, payload)` (see
    /// [`crate::rpc`] for the protocol and its bounds).
    pub fn serve<F, Fut>(&self, method: &str, handler: F) -> Result<(), RpcError>
    where
        F: Fn(libp2p::PeerId, bytes::Bytes) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = HandlerResult> + Send + 'static,
    {
        self.rpc.serve(method, handler)
    }

    /// Calls `method` on `peer`; the whole call runs under `timeout`.
    pub async fn call(
        &self,
        peer: libp2p::PeerId,
        method: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<bytes::Bytes, RpcError> {
        self.rpc.call(peer, method, payload, timeout).await
    }

    /// The node's RPC endpoint (to hand to tasks, or to stop serving a method).
    pub fn rpc(&self) -> &Rpc {
        &self.rpc
    }

    /// The node's metrics (served at [`Self::metrics_addr`] if
    /// [`NodeConfig::metrics_listen`] was set).
    pub fn metrics(&self) -> &Metrics {
        self.dht.p2p().metrics()
    }

    /// Where the metrics endpoint listens, if it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().map(MetricsServer::local_addr)
    }

    /// The node's link hub.
    pub fn hub(&self) -> &Arc<LinkHub> {
        &self.hub
    }

    /// Stops the hub and the swarm, in that order, and waits for the swarm task. Averagers
    /// on this node must be shut down first.
    pub async fn shutdown(self) {
        let Self {
            dht,
            hub,
            relays,
            metrics_server,
            rpc,
            swarm,
        } = self;
        rpc.shutdown().await;
        if let Some(server) = metrics_server {
            server.shutdown().await;
        }
        relays.shutdown().await;
        if let Ok(hub) = Arc::try_unwrap(hub) {
            hub.shutdown().await;
        }
        let _ = dht.p2p().clone().shutdown().await;
        drop(dht);
        let _ = swarm.await;
    }
}
