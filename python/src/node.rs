//! `Node`: a hivemesh node (swarm, DHT, link hub) for Python, and the DHT's store/get.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hivemesh::averager::node::{Node as RustNode, NodeConfig};
use hivemesh::dht::{Dht, DhtTime, DhtView};
use hivemesh::links::{HubConfig, LinkHub};
use hivemesh::p2p::{P2pConfig, RelayLimits, is_explicit_addr, load_or_create_identity};
use hivemesh::reach::Reach;
use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use crate::runtime::{self, Owner};
use crate::{DHTError, ShutdownError};

/// The current time as the DHT counts it: seconds since the UNIX epoch (hivemind's
/// `get_dht_time`).
#[pyfunction]
pub(crate) fn get_dht_time() -> f64 {
    DhtTime::now().as_secs()
}

/// libp2p's binary form of the peer id `b58` (a multihash).
#[pyfunction]
pub(crate) fn peer_id_to_bytes<'py>(py: Python<'py>, b58: &str) -> PyResult<Bound<'py, PyBytes>> {
    let peer: libp2p::PeerId = b58
        .parse()
        .map_err(|e| PyValueError::new_err(format!("not a peer id: {b58:?}: {e}")))?;
    Ok(PyBytes::new(py, &peer.to_bytes()))
}

/// The base58 text of the peer id whose binary form is `data`.
#[pyfunction]
pub(crate) fn peer_id_to_base58(data: &[u8]) -> PyResult<String> {
    libp2p::PeerId::from_bytes(data)
        .map(|p| p.to_base58())
        .map_err(|e| PyValueError::new_err(format!("not a binary peer id: {e}")))
}

/// `addr` without a trailing `/p2p/<id>` (an announced address may name this node).
fn without_peer_id(mut addr: Multiaddr) -> Multiaddr {
    if matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
        addr.pop();
    }
    addr
}

fn parse_addrs(what: &str, addrs: Vec<String>) -> PyResult<Vec<Multiaddr>> {
    addrs
        .into_iter()
        .map(|a| {
            a.parse::<Multiaddr>()
                .map_err(|e| PyValueError::new_err(format!("{what} {a:?} is not a multiaddr: {e}")))
        })
        .collect()
}

/// The IP of the first listen address with one (the data plane listens there too).
fn data_ip(listen: &[Multiaddr]) -> IpAddr {
    listen
        .iter()
        .flat_map(|a| a.iter())
        .find_map(|p| match p {
            Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
            Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
            _ => None,
        })
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// The parts of a running node that averagers use.
#[derive(Clone)]
pub(crate) struct Parts {
    pub(crate) dht: Dht,
    pub(crate) hub: Arc<LinkHub>,
}

/// A hivemesh node: joins the swarm through `initial_peers` and serves the DHT; averagers run
/// on it. See `hivemesh.DHT` for the Python API built on this class.
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct Node {
    inner: Mutex<Option<RustNode>>,
    owner: Owner,
    peer_id: String,
}

impl Node {
    /// The DHT and hub, for an averager; fails once shut down.
    pub(crate) fn parts(&self) -> PyResult<Parts> {
        self.owner.check("DHT")?;
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let node = inner
            .as_ref()
            .ok_or_else(|| ShutdownError::new_err("the DHT has shut down"))?;
        Ok(Parts {
            dht: node.dht().clone(),
            hub: node.hub().clone(),
        })
    }
}

#[pymethods]
impl Node {
    /// Starts a node. `listen`: multiaddrs to listen on (default TCP and QUIC on all
    /// interfaces); `initial_peers`: multiaddrs ending in `/p2p/<id>` to join through;
    /// `client_mode`: a DHT client (serves nothing); `identity_path`: an Ed25519 key file,
    /// created if missing; `relay`: serve as a relay for peers behind NATs; `external`:
    /// addresses others reach this node at; `data_plane`: listen for TLS data links;
    /// `start_timeout`: seconds to wait for reachability at start; `swarm_key`: a private
    /// swarm's key file (`hivemesh swarm-key FILE`): only peers holding it connect, over TCP;
    /// `metrics_listen`: `HOST:PORT` to serve Prometheus metrics at (`/metrics`).
    #[new]
    #[pyo3(signature = (initial_peers=Vec::new(), listen=None, client_mode=false, identity_path=None, relay=false, external=Vec::new(), data_plane=true, start_timeout=5.0, swarm_key=None, metrics_listen=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        initial_peers: Vec<String>,
        listen: Option<Vec<String>>,
        client_mode: bool,
        identity_path: Option<std::path::PathBuf>,
        relay: bool,
        external: Vec<String>,
        data_plane: bool,
        start_timeout: f64,
        swarm_key: Option<std::path::PathBuf>,
        metrics_listen: Option<String>,
    ) -> PyResult<Self> {
        let metrics_listen = metrics_listen
            .map(|a| {
                a.parse::<SocketAddr>().map_err(|_| {
                    PyValueError::new_err(format!(
                        "metrics address {a:?} is not HOST:PORT (an IP address and a port)"
                    ))
                })
            })
            .transpose()?;
        // Finite and not negative, and within what a duration holds (1e30 panicked).
        let start_timeout = Duration::try_from_secs_f64(start_timeout).map_err(|_| {
            PyValueError::new_err(format!(
                "start_timeout must be a non-negative number of seconds, not {start_timeout}"
            ))
        })?;
        let swarm_key = swarm_key
            .map(|path| {
                hivemesh::p2p::SwarmKey::read(&path)
                    .map_err(|e| PyValueError::new_err(e.to_string()))
            })
            .transpose()?;
        let mut p2p = P2pConfig {
            initial_peers: parse_addrs("initial peer", initial_peers)?,
            client_mode,
            swarm_key,
            ..P2pConfig::default()
        };
        if let Some(listen) = listen {
            if listen.is_empty() {
                return Err(PyValueError::new_err("host_maddrs must not be empty"));
            }
            p2p.listen = parse_addrs("listen address", listen)?;
        }
        for a in &p2p.initial_peers {
            if !a.iter().any(|p| matches!(p, Protocol::P2p(_))) {
                return Err(PyValueError::new_err(format!(
                    "initial peer {a} must end with /p2p/<peer id>"
                )));
            }
        }
        p2p.nat.relay_server = relay.then(RelayLimits::default);
        p2p.nat.external = p2p
            .listen
            .iter()
            .filter(|a| is_explicit_addr(a))
            .cloned()
            .chain(
                parse_addrs("external address", external)?
                    .into_iter()
                    .map(without_peer_id),
            )
            .collect();
        if client_mode {
            // A DHT client takes no inbound connections: others reach it through relays.
            p2p.nat.assume = Some(Reach::Private);
        }
        let keypair = match &identity_path {
            Some(path) => load_or_create_identity(path)
                .map_err(|e| DHTError::new_err(format!("identity {}: {e}", path.display())))?,
            None => libp2p::identity::Keypair::generate_ed25519(),
        };
        let peer_id = keypair.public().to_peer_id().to_string();
        let config = NodeConfig {
            data_listen: data_plane.then(|| SocketAddr::new(data_ip(&p2p.listen), 0)),
            p2p,
            hub: HubConfig::default(),
            reachability_wait: start_timeout,
            metrics_listen,
            rpc: hivemesh::rpc::RpcConfig::default(),
        };
        let node = runtime::block_on(py, RustNode::start(config, keypair))?
            .map_err(|e| DHTError::new_err(format!("starting the node: {e}")))?;
        Ok(Self {
            inner: Mutex::new(Some(node)),
            owner: Owner::here(),
            peer_id,
        })
    }

    /// This node's peer id (base58).
    #[getter]
    fn peer_id(&self) -> String {
        self.peer_id.clone()
    }

    /// Where the metrics endpoint listens (`HOST:PORT`), if it runs.
    #[getter]
    fn metrics_addr(&self) -> PyResult<Option<String>> {
        self.owner.check("DHT")?;
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let node = inner
            .as_ref()
            .ok_or_else(|| ShutdownError::new_err("the DHT has shut down"))?;
        Ok(node.metrics_addr().map(|a| a.to_string()))
    }

    /// The node's metrics in the Prometheus (OpenMetrics) text format, as `/metrics` serves
    /// them.
    fn metrics_text(&self) -> PyResult<String> {
        Ok(self.parts()?.dht.p2p().metrics().encode())
    }

    /// Addresses others can join through, each ending with `/p2p/<peer id>`: the listen
    /// addresses, and relay circuit addresses when behind a NAT.
    fn visible_maddrs(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let parts = self.parts()?;
        let addrs = runtime::block_on(py, async move {
            let mut addrs = parts.dht.p2p().listen_addrs().await?;
            let r = parts.dht.p2p().reachability();
            for a in r.confirmed.iter().chain(&r.relayed) {
                let a = if a.iter().any(|p| matches!(p, Protocol::P2p(_))) {
                    a.clone()
                } else {
                    a.clone().with(Protocol::P2p(parts.dht.p2p().peer_id()))
                };
                if !addrs.contains(&a) {
                    addrs.push(a);
                }
            }
            Ok::<_, hivemesh::p2p::P2pError>(addrs)
        })?
        .map_err(|e| DHTError::new_err(e.to_string()))?;
        Ok(addrs.iter().map(ToString::to_string).collect())
    }

    /// How others reach this node: `(class, confirmed, relayed)`, with class one of
    /// `"public"`, `"punchable"`, `"private"` or `"unknown"`.
    fn reachability(&self) -> PyResult<(String, Vec<String>, Vec<String>)> {
        let parts = self.parts()?;
        let r = parts.dht.p2p().reachability();
        let strings = |v: &[Multiaddr]| v.iter().map(ToString::to_string).collect();
        Ok((
            r.reach.map_or("unknown", Reach::name).to_owned(),
            strings(&r.confirmed),
            strings(&r.relayed),
        ))
    }

    /// This node's owner subkey: a subkey of any key that only this node can write.
    fn own_subkey<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.parts()?.dht.own_subkey()))
    }

    /// Stores `value` under `key` (and `subkey`) until `expiration_time` (DHT time, seconds).
    /// Returns whether it was stored: some remote replica holds it when read back, or this
    /// node is connected to nobody (then only its own store has it).
    #[pyo3(signature = (key, value, expiration_time, subkey=None))]
    fn store(
        &self,
        py: Python<'_>,
        key: PyBackedBytes,
        value: PyBackedBytes,
        expiration_time: f64,
        subkey: Option<PyBackedBytes>,
    ) -> PyResult<bool> {
        let expiration = DhtTime::from_secs(expiration_time).ok_or_else(|| {
            PyValueError::new_err(format!(
                "expiration_time must be finite, not {expiration_time}"
            ))
        })?;
        let parts = self.parts()?;
        runtime::block_on(py, async move {
            let held = parts
                .dht
                .store(&key, subkey.as_deref(), &value, expiration)
                .await?;
            let lone = held == 0
                && parts
                    .dht
                    .p2p()
                    .connected_peers()
                    .await
                    .is_ok_and(|p| p.is_empty());
            Ok::<_, hivemesh::dht::DhtError>(held > 0 || lone)
        })?
        .map_err(|e| DHTError::new_err(e.to_string()))
    }

    /// Reads `key`: `None`, or `(plain, entries)` where `plain` is `(value, expiration)` for a
    /// plain value (else `None`) and `entries` lists `(subkey, value, expiration)`.
    #[allow(clippy::type_complexity)]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: PyBackedBytes,
    ) -> PyResult<
        Option<(
            Option<(Bound<'py, PyBytes>, f64)>,
            Vec<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, f64)>,
        )>,
    > {
        let parts = self.parts()?;
        let value = runtime::block_on(py, async move { parts.dht.get(&key).await })?
            .map_err(|e| DHTError::new_err(e.to_string()))?;
        Ok(value.map(|v| match v.view() {
            DhtView::Plain(e) => (
                Some((PyBytes::new(py, &e.value), e.expiration.as_secs())),
                Vec::new(),
            ),
            DhtView::Dictionary(map) => (
                None,
                map.iter()
                    .map(|(k, e)| {
                        (
                            PyBytes::new(py, k),
                            PyBytes::new(py, &e.value),
                            e.expiration.as_secs(),
                        )
                    })
                    .collect(),
            ),
        }))
    }

    /// Whether the node is running.
    #[getter]
    fn is_alive(&self) -> bool {
        self.owner.is_here()
            && self
                .inner
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    /// Stops the node (averagers on it must be shut down first). Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if !self.owner.is_here() {
            return Ok(());
        }
        let node = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(node) = node {
            runtime::block_on(py, node.shutdown())?;
        }
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let node = self
            .inner
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(node) = node {
            if self.owner.is_here() {
                // Shut down on the runtime without blocking the dropping thread.
                if let Ok(rt) = runtime::handle() {
                    rt.spawn(node.shutdown());
                }
            } else {
                // A forked child: the node's tasks live only in the parent.
                std::mem::forget(node);
            }
        }
    }
}
