//! A hivemesh node: the libp2p swarm with its DHT, plus the link hub that accepts round links
//! (TLS data plane and `/hivemesh/part/1` streams). Averagers run on a node.

use std::net::SocketAddr;
use std::sync::Arc;

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use tokio::task::JoinHandle;

use crate::dht::Dht;
use crate::links::{DataPlane, HubConfig, LinkHub};
use crate::p2p::P2pConfig;
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
}

impl NodeConfig {
    /// Everything on loopback (tests, the demo).
    pub fn loopback() -> Self {
        Self {
            p2p: P2pConfig::loopback(),
            data_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            hub: HubConfig::default(),
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
}

/// A running node (see the module docs).
#[derive(Debug)]
pub struct Node {
    dht: Dht,
    hub: Arc<LinkHub>,
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
        let (dht, swarm) = Dht::start(config.p2p, keypair).await?;
        let hub = LinkHub::start(dht.p2p().clone(), data_plane, config.hub).await?;
        Ok(Self {
            dht,
            hub: Arc::new(hub),
            swarm,
        })
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

    /// The node's link hub.
    pub fn hub(&self) -> &Arc<LinkHub> {
        &self.hub
    }

    /// Stops the hub and the swarm, in that order, and waits for the swarm task. Averagers
    /// on this node must be shut down first.
    pub async fn shutdown(self) {
        let Self { dht, hub, swarm } = self;
        if let Ok(hub) = Arc::try_unwrap(hub) {
            hub.shutdown().await;
        }
        let _ = dht.p2p().clone().shutdown().await;
        drop(dht);
        let _ = swarm.await;
    }
}
