//! In-process swarms of real nodes on loopback, shared by the averager and state-sharing
//! tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig};
use hivemesh::tensor::Tensor;
use libp2p::{Multiaddr, PeerId};

/// Tensors for an averager: given as tensors, or as f32 vectors (one 1-d tensor each).
pub trait IntoTensors {
    fn into_tensors(self) -> Vec<Tensor>;
}

impl IntoTensors for Vec<Tensor> {
    fn into_tensors(self) -> Vec<Tensor> {
        self
    }
}

impl IntoTensors for Vec<Vec<f32>> {
    fn into_tensors(self) -> Vec<Tensor> {
        self.into_iter()
            .map(|v| Tensor::from_f32(&[v.len()], v).unwrap())
            .collect()
    }
}

/// A bootstrap node and `n` nodes joined through it (node `i` has a TLS data listener unless
/// `no_listener(i)`).
pub struct Swarm {
    pub bootstrap: Node,
    pub nodes: Vec<Node>,
}

impl Swarm {
    pub async fn start(n: usize, no_listener: impl Fn(usize) -> bool) -> Self {
        Self::start_with(n, |i, config| {
            if no_listener(i) {
                config.data_listen = None;
            }
        })
        .await
    }

    /// [`Swarm::start`] with node `i`'s config (`NodeConfig::loopback` joined through the
    /// bootstrap) adjusted by `configure(i, ..)`.
    pub async fn start_with(n: usize, configure: impl Fn(usize, &mut NodeConfig)) -> Self {
        let bootstrap = Node::start(
            NodeConfig::loopback_bootstrap(),
            libp2p::identity::Keypair::generate_ed25519(),
        )
        .await
        .unwrap();
        let addr: Multiaddr = bootstrap.join_address().await.unwrap();
        let mut nodes = Vec::new();
        for i in 0..n {
            let mut config = NodeConfig::loopback();
            config.p2p.initial_peers = vec![addr.clone()];
            configure(i, &mut config);
            nodes.push(
                Node::start(config, libp2p::identity::Keypair::generate_ed25519())
                    .await
                    .unwrap(),
            );
        }
        Self { bootstrap, nodes }
    }

    /// Tells every node every other node's listen addresses, so that peers that are in no
    /// routing table (Kademlia clients, e.g. nodes that assume they are behind a NAT) and
    /// have no relay address can still be dialled on loopback.
    pub async fn introduce(&self) {
        self.introduce_except(&[]).await
    }

    /// [`Swarm::introduce`], but nobody learns the addresses of the nodes in `hidden` (as if
    /// they were behind a NAT that drops unsolicited connections): every connection with
    /// them is one they dialled.
    pub async fn introduce_except(&self, hidden: &[usize]) {
        let mut addrs = Vec::new();
        for n in &self.nodes {
            addrs.push(n.dht().p2p().listen_addrs().await.unwrap());
        }
        for (i, a) in self.nodes.iter().enumerate() {
            for (j, b) in self.nodes.iter().enumerate() {
                if i != j && !hidden.contains(&j) {
                    a.dht()
                        .p2p()
                        .add_peer_addresses(b.dht().p2p().peer_id(), addrs[j].clone())
                        .await
                        .unwrap();
                }
            }
        }
    }

    pub fn peer(&self, i: usize) -> PeerId {
        self.nodes[i].dht().p2p().peer_id()
    }

    pub fn averager(
        &self,
        i: usize,
        tensors: impl IntoTensors,
        config: AveragerConfig,
    ) -> Arc<Averager> {
        Arc::new(
            Averager::start(
                self.nodes[i].dht().clone(),
                self.nodes[i].hub().clone(),
                tensors.into_tensors(),
                config,
            )
            .unwrap(),
        )
    }

    pub async fn shutdown(self, averagers: Vec<Arc<Averager>>) {
        for a in averagers {
            if let Ok(a) = Arc::try_unwrap(a) {
                a.shutdown().await;
            }
        }
        for n in self.nodes {
            n.shutdown().await;
        }
        self.bootstrap.shutdown().await;
    }
}
