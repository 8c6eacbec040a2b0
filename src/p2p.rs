//! The libp2p layer: the only module that touches libp2p types beyond `PeerId`, `Multiaddr` and
//! `Keypair`.
//!
//! # Shape
//!
//! One task (the *event loop*, `swarm.rs`) owns the [`libp2p::Swarm`]: TCP (noise + yamux) and
//! QUIC transports, DNS, identify, ping and Kademlia. Everything else talks to it through a
//! cloneable [`P2p`] handle that sends commands over a bounded channel, each
//! with a oneshot reply; every wait on a reply is under a timeout. When the last handle is
//! dropped (or [`P2p::shutdown`] is called) the event loop closes its listeners and ends.
//!
//! # Kademlia records
//!
//! libp2p-kad keeps one record per key and overwrites on every put. hivemesh values are
//! dictionaries whose entries come from many peers, so the event loop runs Kademlia with
//! `StoreInserts::FilterBoth`: every inbound PUT is handed to a [`RecordPolicy`], which
//! validates it and merges it with the stored value; local puts are merged the same way
//! before they are replicated. GETs return every replica's value, for the caller to merge.
//! A write looks up the key's closest peers and PUTs to them; the peers found serve the key's
//! next writes for 30 s without a lookup (`replicas.rs`: a progress record is re-stored every
//! few seconds, and the lookup was most of each write's bytes).
//! The policy (value format, merge rules, limits) lives in [`crate::dht`]; this layer only moves
//! bytes. Kademlia's defaults (16 KiB messages, 65 KiB values) are raised deliberately:
//! [`P2pConfig::max_record_bytes`] bounds stored values and the packet size follows from it.
//!
//! Kademlia's mode follows the node's reachability (next section): a client (it queries but
//! is never added to others' routing tables) while it is behind a NAT, a server once it is
//! public. [`P2pConfig::client_mode`] forces client mode.
//!
//! # Reachability, relays and hole punching
//!
//! Volunteers sit behind home routers. The event loop (`nat.rs`) finds out how others can reach
//! this node and makes it reachable where it is not:
//!
//! * **Reachability.** identify tells us the address each peer sees our connections come from;
//!   the classification of [`crate::reach`] turns those into a [`Reach`] (public, punchable,
//!   private), published in [`Reachability`] ([`P2p::reachability`], [`P2p::watch_reachability`])
//!   and re-derived with every new observation. An AutoNAT v2 client asks peers to dial those
//!   addresses back: a confirmed address makes the node public (a forwarded port), failed
//!   dial-backs of its own address mean a firewall; [`NatConfig::external`] names addresses
//!   known to be public. Every node also serves AutoNAT v2 dial-backs
//!   ([`NatConfig::autonat_server`]). A node joining through peers starts as a Kademlia client
//!   and becomes a server once it is public (a lone node is a server from the start; one whose
//!   class is still unknown after 20 s becomes one), unless [`P2pConfig::client_mode`] forces
//!   client mode.
//! * **Relays.** A node with [`NatConfig::relay_server`] serves circuit relay v2 with limits
//!   sized for tensor data ([`RelayLimits`]; libp2p's defaults, 128 KiB and 2 min per circuit,
//!   carry nothing but signalling), shared out per address as well as per peer id (peer ids
//!   are free: `relay_shares.rs`). A node that is not public reserves a slot on a relay among its
//!   peers that speak the relay protocol (initial peers and others it meets, and the candidates
//!   handed to [`P2p::add_relay_candidates`], e.g. from the DHT), keeps
//!   [`NatConfig::relay_reservations`] reservations and replaces a relay that goes away. Its
//!   circuit addresses (`<relay>/p2p-circuit/p2p/<us>`) are in [`Reachability::relayed`].
//! * **Hole punching.** DCUtR runs on every node, over TCP and QUIC: when a peer connects to us
//!   through a relay, both sides dial each other's observed addresses at once.
//!   [`P2p::connect_direct`] makes sure a direct connection to a peer exists (dialing through its
//!   relay and waiting for the punch if needed) and closes relayed connections to a peer once a
//!   direct one exists, so that streams opened afterwards use the direct one (libp2p-stream picks
//!   any connection to the peer). [`P2p::connection_paths`] says how we are connected to a peer.
//!
//! # Streams
//!
//! The swarm also runs the `libp2p-stream` behaviour (0.5.0-alpha, the version that builds with
//! libp2p 0.57.1): [`P2p::open_stream`] opens an outbound stream for a protocol to a peer
//! (dialing it first if needed, everything under one timeout) and [`P2p::accept_streams`]
//! registers a protocol and returns its inbound streams through a bounded queue. Both hand out
//! [`P2pStream`]s, which are tokio byte streams, so no libp2p type leaves this module beyond
//! `PeerId`, `Multiaddr` and `Keypair`.
//!
//! libp2p-stream 0.5.0-alpha hands inbound streams over through a channel with a single slot
//! and *drops* a stream that arrives while the slot is occupied (the opener sees its stream
//! reset or never answered). [`InboundStreams`] drains that slot from a dedicated task into a
//! bounded queue, which makes drops rare but cannot rule them out; protocols on top must detect
//! a silent stream and re-open it (`crate::links` does, with its Hello/Ack).

mod candidates;
mod identity;
mod inbound;
mod nat;
mod private;
mod relay_shares;
mod replicas;
mod store;
mod swarm;

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::StreamExt as _;
use libp2p::{Multiaddr, PeerId, identity::Keypair};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt as _};

pub use identity::load_or_create as load_or_create_identity;
pub(crate) use inbound::AddrKey;
pub use private::{SwarmKey, SwarmKeyError, SwarmPeers};
pub use store::{StoreLimits, StoreRefusal, StoreUsage};

/// Whether `addr` names a specific IP and port (not `0.0.0.0`, `::` or port 0): where an
/// operator told peers to find a node, so it counts as an external address
/// ([`NatConfig::external`]).
pub fn is_explicit_addr(addr: &Multiaddr) -> bool {
    use libp2p::multiaddr::Protocol;
    let ip = addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => !ip.is_unspecified(),
        Protocol::Ip6(ip) => !ip.is_unspecified(),
        _ => false,
    });
    let port = addr
        .iter()
        .any(|p| matches!(p, Protocol::Tcp(port) | Protocol::Udp(port) if port != 0));
    ip && port
}

use crate::reach::Reach;

/// Kademlia protocol name of hivemesh DHTs.
pub const KAD_PROTOCOL: &str = "/hivemesh/kad/1.0.0";
/// Identify protocol version string.
pub const IDENTIFY_PROTOCOL: &str = "/hivemesh/id/1.0.0";
/// Default bound on a stored record value.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1 << 20;
/// Default timeout of DHT queries and of waits on the event loop.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time to reach at least one initial peer.
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(15);
/// Capacity of the command channel from handles to the event loop.
pub const COMMAND_BUFFER: usize = 64;

/// Errors of the p2p layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum P2pError {
    /// The identity file cannot be read, parsed or written.
    #[error("identity file {path}: {detail}")]
    Identity {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// Building the transport failed.
    #[error("cannot build the swarm: {0}")]
    Build(String),
    /// A listen address was refused.
    #[error("cannot listen on {addr}: {detail}")]
    Listen {
        /// The address.
        addr: Multiaddr,
        /// Why.
        detail: String,
    },
    /// An initial peer address lacks its `/p2p/<peer id>` suffix.
    #[error("initial peer {0} must end with /p2p/<peer id>")]
    BadInitialPeer(Multiaddr),
    /// None of the initial peers could be reached in time.
    #[error("failed to connect to any initial peer within {0:?}")]
    Bootstrap(Duration),
    /// Dialing failed.
    #[error("cannot dial {addr}: {detail}")]
    Dial {
        /// The address.
        addr: Multiaddr,
        /// Why.
        detail: String,
    },
    /// A record was rejected by the local policy.
    #[error("record rejected: {0}")]
    Rejected(String),
    /// A DHT query failed.
    #[error("dht query failed: {0}")]
    Query(String),
    /// The event loop did not answer in time.
    #[error("the p2p event loop did not answer within {0:?}")]
    Timeout(Duration),
    /// The event loop has shut down.
    #[error("the p2p node has shut down")]
    Shutdown,
    /// A stream protocol name is not valid (it must start with `/`).
    #[error("invalid stream protocol {0:?}")]
    BadProtocol(String),
    /// Inbound streams of this protocol are already being accepted on this node.
    #[error("inbound streams of {0} are already being accepted")]
    AlreadyAccepting(String),
    /// Opening a stream failed: no connection, the peer does not speak the protocol, or the
    /// negotiation failed.
    #[error("cannot open a stream to {peer}: {detail}")]
    OpenStream {
        /// The peer.
        peer: PeerId,
        /// Why (naming the protocol).
        detail: String,
    },
    /// No direct connection to the peer could be made (the hole punch failed or timed out).
    #[error("no direct connection to {peer}: {detail}")]
    NoDirectConnection {
        /// The peer.
        peer: PeerId,
        /// Why.
        detail: String,
    },
    /// Opening a stream (including dialing the peer) took longer than the timeout.
    #[error("no stream to {peer} within {timeout:?}")]
    OpenStreamTimeout {
        /// The peer.
        peer: PeerId,
        /// The timeout.
        timeout: Duration,
    },
}

/// How stored DHT values are validated and merged; implemented by [`crate::dht`].
pub trait RecordPolicy: Send + Sync + 'static {
    /// The expensive checks of an inbound remote record that need no stored value (decoding,
    /// signatures), run before [`merge`](Self::merge): for a record over 16 KiB on a blocking
    /// thread (at most 64 such records at once; more are dropped), for a smaller one on the
    /// event loop. An error rejects the record. A policy may remember what passed so that `merge` need not check it again.
    /// The default checks nothing.
    fn precheck(
        &self,
        key: &[u8],
        incoming: &[u8],
        source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(), String> {
        let _ = (key, incoming, source, now);
        Ok(())
    }

    /// Validates `incoming` (written by `source`, `None` for local writes) and merges it with
    /// the `existing` stored value. Returns the value to store and its wall-clock expiration
    /// (the latest of its entries), or a reason to reject the write.
    fn merge(
        &self,
        key: &[u8],
        existing: Option<&[u8]>,
        incoming: &[u8],
        source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(Vec<u8>, SystemTime), String>;
}

/// Configuration of a p2p node.
#[derive(Clone, Debug)]
pub struct P2pConfig {
    /// Addresses to listen on. Default: TCP and QUIC on all interfaces, random ports.
    pub listen: Vec<Multiaddr>,
    /// Peers to join through, each ending with `/p2p/<peer id>`.
    pub initial_peers: Vec<Multiaddr>,
    /// Always run Kademlia in client mode (otherwise it follows reachability: see the module
    /// docs).
    pub client_mode: bool,
    /// Bound on a stored record value (Kademlia packets get this plus 64 KiB).
    pub max_record_bytes: usize,
    /// Timeout of DHT queries and of waits on the event loop.
    pub request_timeout: Duration,
    /// Time to reach at least one initial peer before [`P2p::spawn`] fails.
    pub bootstrap_timeout: Duration,
    /// Close connections idle for this long.
    pub idle_connection_timeout: Duration,
    /// Reachability, relays and hole punching.
    pub nat: NatConfig,
    /// Bounds on the DHT records kept for others (`store.rs`: a share per peer; local records
    /// are never evicted).
    pub store: StoreLimits,
    /// Bounds on the swarm's connections.
    pub connections: ConnectionLimits,
    /// A private swarm's key: only peers holding it connect (`private.rs`: TCP only, QUIC
    /// listen addresses are left out). `None` (the default): an open swarm.
    pub swarm_key: Option<SwarmKey>,
}

/// Bounds on the swarm's connections: connections beyond them are refused before their
/// handshake completes (pending) or right after it (established).
///
/// The defaults: **128 pending inbound** (handshakes in flight: a burst of dials costs at most
/// that many noise handshakes at once), **1024 established inbound** (a bootstrap node of a
/// swarm of a thousand peers), **8 per peer** (TCP and QUIC, direct, relayed and hole-punched
/// connections of one peer, with room for redials while old ones close). Both inbound pools
/// are shared out by remote address (`inbound.rs`: an IPv4 address or an IPv6 /64): once half
/// of a pool is in use, an address holding **8 handshakes** or **64 established connections**
/// gets no more, so one address cannot lock others out. A handshake not finished within
/// **5 s** is dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Inbound connections still in their handshake.
    pub max_pending_incoming: u32,
    /// Handshakes one remote address (IPv6: one /64) may hold once half of
    /// `max_pending_incoming` is in use.
    pub max_pending_per_address: u32,
    /// Established inbound connections.
    pub max_established_incoming: u32,
    /// Established inbound connections one remote address may hold once half of
    /// `max_established_incoming` is in use.
    pub max_established_per_address: u32,
    /// Established connections (either direction) with one peer.
    pub max_per_peer: u32,
    /// The longest a connection may take from its first byte to a finished handshake (noise
    /// and the multiplexer, or QUIC's), both directions; a silent or stalled handshake holds
    /// its slot no longer than this.
    pub handshake_timeout: Duration,
    /// Refuse new connections (both directions) while this process uses more memory than this
    /// (resident bytes, as libp2p's `memory_connection_limits` measures them, refreshed at most
    /// every 100 ms). Off by default: the averaged tensors live in the same process and may
    /// rightly take most of the machine; set it where a node must not take on more peers under
    /// memory pressure (`--max-memory-mib` on `hivemesh dht`).
    pub max_process_memory_bytes: Option<usize>,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_pending_incoming: 128,
            max_pending_per_address: 8,
            max_established_incoming: 1024,
            max_established_per_address: 64,
            max_per_peer: 8,
            handshake_timeout: Duration::from_secs(5),
            max_process_memory_bytes: None,
        }
    }
}

/// How a node finds out its reachability and makes itself reachable (module docs).
#[derive(Clone, Debug)]
pub struct NatConfig {
    /// Take this reachability instead of finding it out (`None`: find out, the default). For
    /// nodes whose operator knows better, and for tests.
    pub assume: Option<Reach>,
    /// Addresses others reach this node at, known without asking (a public server's own
    /// address): confirmed at start, so the node is public from the first moment, and a relay
    /// serves at once. Otherwise a dial-back (AutoNAT) must confirm an address, which needs a
    /// connection this node dialed: a lone bootstrap that only ever accepts connections would
    /// never get one.
    pub external: Vec<Multiaddr>,
    /// Ask peers to dial our observed addresses back (AutoNAT v2 client).
    pub autonat: bool,
    /// Dial back the addresses peers ask us to test (AutoNAT v2 server).
    pub autonat_server: bool,
    /// How often the AutoNAT client tests untested address candidates.
    pub autonat_interval: Duration,
    /// Serve as a circuit relay v2 with these limits (`None`: not a relay).
    pub relay_server: Option<RelayLimits>,
    /// Relay reservations a node that is not public keeps (0: none).
    pub relay_reservations: usize,
    /// Hole punching (DCUtR) when a peer connects through a relay.
    pub hole_punching: bool,
}

impl Default for NatConfig {
    fn default() -> Self {
        Self {
            assume: None,
            external: Vec::new(),
            autonat: true,
            autonat_server: true,
            autonat_interval: Duration::from_secs(2),
            relay_server: None,
            relay_reservations: 1,
            hole_punching: true,
        }
    }
}

/// Limits of a relay server. libp2p's defaults (128 KiB and 2 minutes per circuit, 16
/// circuits) are for hole-punch signalling only; hivemesh relays also carry matchmaking and
/// state-sharing messages of NATed peers for as long as they are members, and tensor parts where
/// both ends allow it, so circuits get 1 GiB and 30 minutes (hivemind's relays: 4 GiB per
/// direction, 30 min), and rate limits that a peer joining a group every few seconds stays far
/// below. A circuit is closed when it reaches either limit; a link over it then fails like any
/// link, and the next round opens a new circuit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayLimits {
    /// Reservations held at once.
    pub max_reservations: usize,
    /// Reservations one peer id may hold.
    pub max_reservations_per_peer: usize,
    /// Reservations one address (IPv4 address, IPv6 /64) may hold once half of
    /// `max_reservations` are in use (identities are free, addresses are not: issue 29, attack 6).
    pub max_reservations_per_address: usize,
    /// How long a reservation lasts (the client renews it).
    pub reservation_duration: Duration,
    /// Circuits relayed at once.
    pub max_circuits: usize,
    /// Circuits one peer id may have open at once.
    pub max_circuits_per_peer: usize,
    /// Circuits whose source is one address (IPv4 address, IPv6 /64) once half of
    /// `max_circuits` are open.
    pub max_circuits_per_address: usize,
    /// How long one circuit may last.
    pub max_circuit_duration: Duration,
    /// Bytes one circuit may carry (both directions together).
    pub max_circuit_bytes: u64,
    /// New circuits one source peer may open per minute.
    pub circuits_per_peer_per_minute: u32,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            max_reservations: 128,
            max_reservations_per_peer: 4,
            max_reservations_per_address: 8,
            reservation_duration: Duration::from_secs(3600),
            max_circuits: 64,
            max_circuits_per_peer: 16,
            max_circuits_per_address: 16,
            max_circuit_duration: Duration::from_secs(30 * 60),
            max_circuit_bytes: 1 << 30,
            circuits_per_peer_per_minute: 120,
        }
    }
}

/// How this node can be reached, as far as it knows ([`P2p::reachability`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reachability {
    /// Its class; `None` while nothing was observed (e.g. a lone bootstrap node).
    pub reach: Option<Reach>,
    /// Addresses confirmed by dial-backs (AutoNAT) or configured as external.
    pub confirmed: Vec<Multiaddr>,
    /// The addresses peers observed our connections come from (newest last).
    pub observed: Vec<Multiaddr>,
    /// Our relay circuit addresses (`.../p2p/<relay>/p2p-circuit/p2p/<us>`), one per active
    /// reservation.
    pub relayed: Vec<Multiaddr>,
    /// Some peer saw a connection we dialed from our listening port coming from that same port
    /// number: our NAT (if any) keeps ports, so the endpoint of a fresh local port can be
    /// predicted (what a TCP simultaneous open for the data plane needs).
    pub port_preserving: bool,
}

impl Reachability {
    /// The class to act on: the observed one, [`Reach::Public`] while unknown.
    pub fn class(&self) -> Reach {
        self.reach.unwrap_or_default()
    }
}

/// The transport of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// TCP (noise + yamux).
    Tcp,
    /// QUIC.
    Quic,
    /// Anything else (a relayed connection's inner transport is reported as the relay's).
    Other,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::Quic => "quic",
            Self::Other => "other",
        })
    }
}

/// How one connection to a peer runs ([`P2p::connection_paths`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnPath {
    /// Through a relay.
    pub relayed: bool,
    /// Made by a hole punch (DCUtR).
    pub punched: bool,
    /// Its transport (for a relayed connection: the transport to the relay).
    pub transport: Transport,
}

/// Counters of the NAT machinery (for tests, monitoring and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatStats {
    /// Hole punches that made a direct connection.
    pub punch_ok: u64,
    /// Hole punches that failed (all attempts of one relayed connection).
    pub punch_failed: u64,
    /// Relay reservations accepted (renewals not counted).
    pub reservations: u64,
    /// Relay reservations that failed or were lost.
    pub reservations_lost: u64,
}

impl Default for P2pConfig {
    fn default() -> Self {
        Self {
            listen: vec![
                "/ip4/0.0.0.0/tcp/0".parse().expect("valid multiaddr"),
                "/ip4/0.0.0.0/udp/0/quic-v1"
                    .parse()
                    .expect("valid multiaddr"),
            ],
            initial_peers: Vec::new(),
            client_mode: false,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            bootstrap_timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
            idle_connection_timeout: Duration::from_secs(60),
            nat: NatConfig::default(),
            store: StoreLimits::default(),
            connections: ConnectionLimits::default(),
            swarm_key: None,
        }
    }
}

impl P2pConfig {
    /// Listening on loopback TCP only (tests, local demos).
    pub fn loopback() -> Self {
        Self {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().expect("valid multiaddr")],
            ..Self::default()
        }
    }
}

/// A cloneable handle to a running p2p node. The node shuts down when the last handle is
/// dropped or [`P2p::shutdown`] is called.
#[derive(Clone)]
pub struct P2p {
    commands: mpsc::Sender<swarm::Command>,
    peer_id: PeerId,
    request_timeout: Duration,
    streams: libp2p_stream::Control,
    reach: watch::Receiver<Reachability>,
    nat_stats: watch::Receiver<NatStats>,
    swarm_peers: Option<SwarmPeers>,
    metrics: crate::metrics::Metrics,
}

impl std::fmt::Debug for P2p {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2p")
            .field("peer_id", &self.peer_id)
            .field("request_timeout", &self.request_timeout)
            .finish_non_exhaustive()
    }
}

impl P2p {
    /// Starts a node: listens, dials the initial peers, waits until at least one of them is
    /// connected (if any were given), and bootstraps Kademlia. Must be called inside a tokio
    /// runtime. Cancel-safe: dropping the future before it resolves drops the node.
    pub async fn spawn(
        config: P2pConfig,
        keypair: Keypair,
        policy: Box<dyn RecordPolicy>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), P2pError> {
        let peer_id = keypair.public().to_peer_id();
        let mut initial = Vec::with_capacity(config.initial_peers.len());
        for addr in &config.initial_peers {
            let id = addr
                .iter()
                .find_map(|p| match p {
                    libp2p::multiaddr::Protocol::P2p(id) => Some(id),
                    _ => None,
                })
                .ok_or_else(|| P2pError::BadInitialPeer(addr.clone()))?;
            initial.push((id, addr.clone()));
        }
        let (tx, rx) = mpsc::channel(COMMAND_BUFFER);
        let event_loop = swarm::EventLoop::new(&config, keypair, policy, rx, &initial)?;
        let streams = event_loop.stream_control();
        let (reach, nat_stats) = event_loop.nat_watches();
        let swarm_peers = event_loop.swarm_peers();
        let metrics = event_loop.metrics();
        metrics.register_collector(
            crate::metrics::WatchCollector::new(nat_stats.clone())
                .counters(
                    "hole_punches",
                    "Hole punches, by result",
                    vec![
                        ("ok", |s: &NatStats| s.punch_ok),
                        ("failed", |s: &NatStats| s.punch_failed),
                    ],
                )
                .counters(
                    "own_relay_reservations",
                    "This node's relay reservations: accepted, or failed and lost",
                    vec![
                        ("accepted", |s: &NatStats| s.reservations),
                        ("lost", |s: &NatStats| s.reservations_lost),
                    ],
                ),
        );
        metrics.register_collector(crate::metrics::WatchCollector::new(reach.clone()).gauge(
            "relayed_addresses",
            "Relayed addresses this node holds (its relay reservations)",
            |r: &Reachability| i64::try_from(r.relayed.len()).unwrap_or(i64::MAX),
        ));
        let task = tokio::spawn(event_loop.run());
        let p2p = Self {
            commands: tx,
            peer_id,
            request_timeout: config.request_timeout,
            streams,
            reach,
            nat_stats,
            swarm_peers,
            metrics,
        };
        if !initial.is_empty() {
            let connected = tokio::time::timeout(
                config.bootstrap_timeout,
                p2p.call_untimed(|reply| swarm::Command::WaitConnected { reply }),
            )
            .await;
            match connected {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e)) | Err(e)) => return Err(e),
                Err(_) => return Err(P2pError::Bootstrap(config.bootstrap_timeout)),
            }
            p2p.call(|reply| swarm::Command::Bootstrap { reply })
                .await?;
        }
        Ok((p2p, task))
    }

    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// Whether this node runs a private swarm ([`P2pConfig::swarm_key`]).
    pub fn is_private(&self) -> bool {
        self.swarm_peers.is_some()
    }

    /// Whether `peer` is known to hold the swarm key: in a private swarm, whether it has had
    /// a libp2p connection with this node (every such connection went through the key); in
    /// an open swarm, always.
    pub fn knows_swarm_member(&self, peer: &PeerId) -> bool {
        self.swarm_peers.as_ref().is_none_or(|p| p.contains(peer))
    }

    /// Whether a connection from `ip` may come from a swarm member: in a private swarm,
    /// whether a peer has had a libp2p connection with this node from that address (its IPv4
    /// address, or the /64 of its IPv6 one); in an open swarm, always. The TLS data plane
    /// checks it before running a handshake (`links::hub`).
    pub fn knows_swarm_address(&self, ip: std::net::IpAddr) -> bool {
        self.swarm_peers
            .as_ref()
            .is_none_or(|p| p.knows_address(ip))
    }

    /// The addresses others can dial, each ending with `/p2p/<peer id>` (waits until every
    /// listener has reported its address).
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, P2pError> {
        self.call(|reply| swarm::Command::ListenAddrs { reply })
            .await
    }

    /// How this node can be reached, as far as it knows now (module docs).
    pub fn reachability(&self) -> Reachability {
        self.reach.borrow().clone()
    }

    /// The reachability as it changes.
    pub fn watch_reachability(&self) -> watch::Receiver<Reachability> {
        self.reach.clone()
    }

    /// Waits until `ready` holds for the reachability, at most `timeout`; returns the last one.
    pub async fn wait_reachability(
        &self,
        timeout: Duration,
        ready: impl FnMut(&Reachability) -> bool,
    ) -> Reachability {
        let mut rx = self.reach.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(ready)).await;
        rx.borrow().clone()
    }

    /// Counters of hole punches and relay reservations.
    pub fn nat_stats(&self) -> NatStats {
        *self.nat_stats.borrow()
    }

    /// This node's metrics (see [`crate::metrics`]); [`crate::metrics::serve`] serves them.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// What the DHT record store holds (records, bytes, this node's own share, evictions and
    /// refusals).
    pub async fn store_usage(&self) -> Result<StoreUsage, P2pError> {
        self.call(|reply| swarm::Command::StoreUsage { reply })
            .await
    }

    /// The addresses of `peer` in the Kademlia routing table (empty if it is not there). At
    /// most 8 of them come from what the peer itself announces (identify).
    pub async fn routing_addresses(&self, peer: PeerId) -> Result<Vec<Multiaddr>, P2pError> {
        self.call(|reply| swarm::Command::RoutingAddresses { peer, reply })
            .await
    }

    /// How we are connected to `peer` now, one entry per connection (empty: not connected).
    pub async fn connection_paths(&self, peer: PeerId) -> Result<Vec<ConnPath>, P2pError> {
        self.call(|reply| swarm::Command::ConnectionPaths { peer, reply })
            .await
    }

    /// Makes sure a direct (not relayed) connection to `peer` exists, within `timeout`: dials it
    /// if needed, through `via` (its relay circuit addresses) when given, else by peer id, and
    /// waits for the hole punch that a relayed connection starts; a relayed connection whose
    /// punch failed is closed and dialed anew once. Relayed connections to the peer are closed
    /// once a direct one exists, so that streams opened afterwards run on the direct one.
    /// Returns the direct connection's path.
    pub async fn connect_direct(
        &self,
        peer: PeerId,
        via: Vec<Multiaddr>,
        timeout: Duration,
    ) -> Result<ConnPath, P2pError> {
        tokio::time::timeout(
            timeout,
            self.call_untimed(|reply| swarm::Command::ConnectDirect { peer, via, reply }),
        )
        .await
        .map_err(|_| P2pError::NoDirectConnection {
            peer,
            detail: format!("no direct connection within {timeout:?}"),
        })??
    }

    /// Offers relays to reserve slots on (each address ending with `/p2p/<relay id>`), e.g.
    /// relays announced in the DHT. Used when this node is not public and has fewer
    /// reservations than it wants.
    pub async fn add_relay_candidates(&self, addrs: Vec<Multiaddr>) -> Result<(), P2pError> {
        self.call(|reply| swarm::Command::AddRelayCandidates { addrs, reply })
            .await
    }

    /// Peers with an open connection.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, P2pError> {
        self.call(|reply| swarm::Command::ConnectedPeers { reply })
            .await
    }

    /// Merges `value` into the local record under `key` (through the policy) and sends `value`
    /// to the closest peers (not the merged record: a replica refuses a remote write holding
    /// another owner's entry under an owned key). Returns how many remote peers acknowledged it.
    pub async fn put_record(&self, key: Vec<u8>, value: Vec<u8>) -> Result<usize, P2pError> {
        self.call(|reply| swarm::Command::Put { key, value, reply })
            .await?
    }

    /// Every value found for `key`: the local one first (if any), then each replica's answer.
    pub async fn get_record(&self, key: Vec<u8>) -> Result<Vec<Vec<u8>>, P2pError> {
        self.call(|reply| swarm::Command::Get {
            key,
            local: true,
            reply,
        })
        .await?
    }

    /// What the replicas answer for `key` (one answer per peer that holds a record), without
    /// this node's own record.
    pub async fn get_replica_records(&self, key: Vec<u8>) -> Result<Vec<Vec<u8>>, P2pError> {
        self.call(|reply| swarm::Command::Get {
            key,
            local: false,
            reply,
        })
        .await?
    }

    /// Tells the node where `peer` can be reached (added to Kademlia's routing table and
    /// announced to every behaviour), so that dials by peer id, as [`P2p::open_stream`] makes,
    /// find it.
    pub async fn add_peer_addresses(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    ) -> Result<(), P2pError> {
        self.call(|reply| swarm::Command::AddAddresses { peer, addrs, reply })
            .await
    }

    /// Opens an outbound stream for `protocol` to `peer`, dialing the peer first if it is not
    /// connected (by peer id: its addresses must be known, from Kademlia or
    /// [`P2p::add_peer_addresses`]). Dialing, opening and protocol negotiation together run
    /// under `timeout`.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: &str,
        timeout: Duration,
    ) -> Result<P2pStream, P2pError> {
        let proto = stream_protocol(protocol)?;
        let open = async {
            self.call_untimed(|reply| swarm::Command::Connect { peer, reply })
                .await??;
            // Each open uses its own clone: a Control opens one stream at a time.
            let mut control = self.streams.clone();
            control
                .open_stream(peer, proto)
                .await
                .map_err(|e| P2pError::OpenStream {
                    peer,
                    detail: format!("{protocol}: {e}"),
                })
        };
        let stream = tokio::time::timeout(timeout, open)
            .await
            .map_err(|_| P2pError::OpenStreamTimeout { peer, timeout })??;
        Ok(P2pStream::new(peer, stream))
    }

    /// Starts accepting inbound streams of `protocol`: peers can open such streams from now on
    /// until the returned [`InboundStreams`] is dropped. At most `queue` accepted streams wait
    /// to be taken; while the queue is full further streams are dropped (their openers see a
    /// reset). Only one acceptor per protocol and node.
    pub fn accept_streams(&self, protocol: &str, queue: usize) -> Result<InboundStreams, P2pError> {
        let proto = stream_protocol(protocol)?;
        let mut control = self.streams.clone();
        let mut incoming = control
            .accept(proto)
            .map_err(|_| P2pError::AlreadyAccepting(protocol.to_owned()))?;
        let (tx, rx) = mpsc::channel(queue.max(1));
        // Drain libp2p-stream's single slot as fast as we can (see the module doc).
        let pump = tokio::spawn(async move {
            while let Some((peer, stream)) = incoming.next().await {
                if tx.send((peer, P2pStream::new(peer, stream))).await.is_err() {
                    break;
                }
            }
        });
        Ok(InboundStreams { rx, pump })
    }

    /// Stops the node: closes listeners and connections, ends the event loop.
    pub async fn shutdown(self) -> Result<(), P2pError> {
        self.call(|reply| swarm::Command::Shutdown { reply }).await
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> swarm::Command,
    ) -> Result<T, P2pError> {
        // Queries have their own Kademlia timeout; leave them room before giving up here.
        let limit = self.request_timeout + Duration::from_secs(5);
        tokio::time::timeout(limit, self.call_untimed(make))
            .await
            .map_err(|_| P2pError::Timeout(limit))?
    }

    async fn call_untimed<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> swarm::Command,
    ) -> Result<T, P2pError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| P2pError::Shutdown)?;
        rx.await.map_err(|_| P2pError::Shutdown)
    }
}

fn stream_protocol(protocol: &str) -> Result<libp2p::StreamProtocol, P2pError> {
    libp2p::StreamProtocol::try_from_owned(protocol.to_owned())
        .map_err(|_| P2pError::BadProtocol(protocol.to_owned()))
}

/// Inbound streams of one protocol ([`P2p::accept_streams`]), in arrival order. Dropping it
/// stops accepting: the protocol is no longer offered to peers.
#[derive(Debug)]
pub struct InboundStreams {
    rx: mpsc::Receiver<(PeerId, P2pStream)>,
    pump: tokio::task::JoinHandle<()>,
}

impl InboundStreams {
    /// The next inbound stream and the (authenticated) peer that opened it; `None` once the
    /// node has shut down.
    pub async fn next(&mut self) -> Option<(PeerId, P2pStream)> {
        self.rx.recv().await
    }

    /// Serves every stream in a task of its own, at most `shares`' bounds at once (a stream
    /// beyond them is dropped: its opener retries), until the streams end or `handle` returns
    /// `None` (whoever consumes what the streams carry is gone); then the tasks are stopped.
    /// `what` names the protocol in the log.
    pub(crate) async fn serve_each<F, Fut>(
        mut self,
        shares: crate::shares::Shares<PeerId>,
        what: &'static str,
        mut handle: F,
    ) where
        F: FnMut(PeerId, P2pStream) -> Option<Fut>,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut tasks = tokio::task::JoinSet::new();
        while let Some((peer, stream)) = self.next().await {
            while tasks.try_join_next().is_some() {}
            let permit = match shares.try_take(peer) {
                Ok(permit) => permit,
                Err(refused) => {
                    tracing::debug!(%peer, %refused, what, "inbound stream dropped");
                    continue;
                }
            };
            let Some(served) = handle(peer, stream) else {
                break;
            };
            tasks.spawn(async move {
                let _permit = permit;
                served.await;
            });
        }
        tasks.shutdown().await;
    }
}

impl Drop for InboundStreams {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

/// A libp2p stream (a yamux substream on a noise-encrypted connection, or a QUIC stream) as a
/// tokio byte stream. Shutting down the write side closes it for writing; the peer reads end of
/// stream. Drive it from spawned tasks (see `../shared/reference/dataplane.md` §5.4).
pub struct P2pStream {
    inner: Compat<libp2p::Stream>,
    peer: PeerId,
}

impl std::fmt::Debug for P2pStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pStream")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl P2pStream {
    fn new(peer: PeerId, stream: libp2p::Stream) -> Self {
        Self {
            inner: stream.compat(),
            peer,
        }
    }

    /// The peer at the other end (authenticated by the connection's security handshake).
    pub fn peer_id(&self) -> PeerId {
        self.peer
    }
}

impl AsyncRead for P2pStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for P2pStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    /// Only dial failures that say the peer is gone drop it from the routing table.
    #[test]
    fn dial_failures_that_mean_gone() {
        use libp2p::TransportError;
        use libp2p::swarm::DialError;
        use std::io::{Error, ErrorKind};
        let addr: Multiaddr = "/ip4/127.0.0.1/tcp/1".parse().unwrap();
        let dial = |errors: Vec<Error>| {
            DialError::Transport(
                errors
                    .into_iter()
                    .map(|e| (addr.clone(), TransportError::Other(e)))
                    .collect(),
            )
        };
        #[derive(Debug)]
        struct Wrapper(Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = || Error::other(Wrapper(Error::from(ErrorKind::ConnectionRefused)));
        let handshake = || Error::other("Handshake failed: input error");
        assert!(swarm::peer_is_gone(&dial(vec![refused()])));
        assert!(swarm::peer_is_gone(&dial(vec![
            refused(),
            Error::other(libp2p::quic::Error::HandshakeTimedOut),
        ])));
        assert!(!swarm::peer_is_gone(&dial(vec![handshake()])));
        assert!(!swarm::peer_is_gone(&dial(vec![refused(), handshake()])));
        assert!(!swarm::peer_is_gone(&dial(vec![])));
        assert!(!swarm::peer_is_gone(&DialError::Aborted));
    }

    use super::*;

    #[test]
    fn explicit_addresses_name_an_ip_and_a_port() {
        let explicit = |a: &str| is_explicit_addr(&a.parse().unwrap());
        assert!(explicit("/ip4/203.0.113.7/tcp/4001"));
        assert!(explicit("/ip6/2001:db8::1/udp/4001/quic-v1"));
        assert!(!explicit("/ip4/0.0.0.0/tcp/4001"), "unspecified IP");
        assert!(!explicit("/ip6/::/tcp/4001"), "unspecified IP");
        assert!(!explicit("/ip4/203.0.113.7/tcp/0"), "any port");
        assert!(!explicit("/dns4/example.com/tcp/4001"), "no IP");
    }
}
