//! The task that owns the Swarm.
//!
//! Message flow: handles send [`Command`]s (bounded channel); the loop `select!`s between the
//! next command and the next swarm event. Long operations (DHT queries, waiting for the first
//! connection or for listen addresses) park their reply sender in a pending map keyed by the
//! Kademlia `QueryId` (or in a waiter list) and answer it when the matching event arrives.
//! When every handle is gone the channel closes and the loop ends, dropping the swarm.
//!
//! Inbound DHT records are checked in two steps: the policy's
//! [`precheck`](super::RecordPolicy::precheck) (decoding and signatures: the expensive part),
//! then its [`merge`](super::RecordPolicy::merge) with the stored value, which finds the
//! signatures already verified. A record over [`INLINE_CHECK_BYTES`] is prechecked on a
//! blocking thread, at most [`MAX_PRECHECKS`] at once, and merged when its check comes back;
//! a smaller one (every write the averager makes) on the loop, at once, so that a read right
//! after a write finds it merged.
//!
//! Streams (`libp2p-stream`) bypass the loop: handles open and accept them through the
//! behaviour's [`libp2p_stream::Control`], which talks to the behaviour through shared state.
//! The loop only dials for them ([`Command::Connect`]): libp2p-stream's own dial request goes
//! through a channel of capacity 0 with `try_send` and is lost when several opens to
//! unconnected peers happen at once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use libp2p::kad::{self, store::RecordStore};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, StreamProtocol, Swarm, identify, identity::Keypair, noise, ping};
use libp2p::{autonat, dcutr, relay, tcp, yamux};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

use super::nat::Nat;
use super::private::SwarmPeers;
use super::store::{BoundedStore, StoreUsage};
use super::{
    ConnPath, IDENTIFY_PROTOCOL, KAD_PROTOCOL, NatStats, P2pConfig, P2pError, Reachability,
    RecordPolicy,
};

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    pub(super) kad: kad::Behaviour<BoundedStore>,
    pub(super) identify: identify::Behaviour,
    ping: ping::Behaviour,
    pub(super) stream: libp2p_stream::Behaviour,
    relay_client: relay::client::Behaviour,
    relay_server: Toggle<relay::Behaviour>,
    dcutr: Toggle<dcutr::Behaviour>,
    autonat_client: Toggle<autonat::v2::client::Behaviour>,
    autonat_server: Toggle<autonat::v2::server::Behaviour>,
    inbound: super::inbound::Behaviour,
    limits: libp2p::connection_limits::Behaviour,
    memory_limits: Toggle<libp2p::memory_connection_limits::Behaviour>,
    pub(super) candidates: super::candidates::Candidates,
}

/// Requests from handles to the event loop.
#[derive(Debug)]
pub(super) enum Command {
    ListenAddrs {
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    ConnectedPeers {
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    WaitConnected {
        reply: oneshot::Sender<Result<(), P2pError>>,
    },
    Bootstrap {
        reply: oneshot::Sender<()>,
    },
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        reply: oneshot::Sender<Result<usize, P2pError>>,
    },
    Get {
        key: Vec<u8>,
        /// Whether the answer starts with this node's own record (if it holds one).
        local: bool,
        reply: oneshot::Sender<Result<Vec<Vec<u8>>, P2pError>>,
    },
    AddAddresses {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        reply: oneshot::Sender<()>,
    },
    Connect {
        peer: PeerId,
        reply: oneshot::Sender<Result<(), P2pError>>,
    },
    ConnectionPaths {
        peer: PeerId,
        reply: oneshot::Sender<Vec<ConnPath>>,
    },
    ConnectDirect {
        peer: PeerId,
        via: Vec<Multiaddr>,
        reply: oneshot::Sender<Result<ConnPath, P2pError>>,
    },
    AddRelayCandidates {
        addrs: Vec<Multiaddr>,
        reply: oneshot::Sender<()>,
    },
    StoreUsage {
        reply: oneshot::Sender<StoreUsage>,
    },
    RoutingAddresses {
        peer: PeerId,
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

enum Pending {
    /// A PUT to the closest peers of `key`, found by a lookup now or earlier
    /// ([`super::replicas`]).
    Put {
        reply: oneshot::Sender<Result<usize, P2pError>>,
        key: Vec<u8>,
    },
    /// The lookup of the closest peers of `record`'s key before its PUT.
    PutLookup {
        reply: oneshot::Sender<Result<usize, P2pError>>,
        record: kad::Record,
    },
    /// A Kademlia lookup of a peer we were asked to connect to but know no address of.
    FindPeer(PeerId),
    Get {
        reply: oneshot::Sender<Result<Vec<Vec<u8>>, P2pError>>,
        values: Vec<Vec<u8>>,
        /// Only answers of remote peers, one per peer ([`super::P2p::get_replica_records`]):
        /// Kademlia also reports this node's own record, without a peer.
        replicas_only: Option<HashSet<PeerId>>,
        /// When the lookup started: a merged read answers [`GET_GRACE_MIN`] or the time its
        /// first remote answer took (whichever is longer) after that answer, without waiting
        /// for replicas that do not answer.
        started: Instant,
        /// Whether the early answer's timer runs.
        timed: bool,
    },
}

/// The least a merged read ([`super::P2p::get_record`]) waits, after its first remote answer,
/// for the other replicas' answers before it answers with what it has. Kademlia itself waits
/// for every one of the closest peers or its 10 s per-peer timeout, so one replica that
/// accepts a request and never answers (a stopped process: a laptop's lid closed) made every
/// read of its keys take 10 s, and a group could not form within a matchmaking window
/// (seen in `tests/python/test_optimizer.py`'s frozen peer: 40 s per epoch without it). The
/// lookup ends there; what a late replica holds, a later read sees, and a writer stores its
/// entries on every replica, so any one of them holds what the others do (up to races that
/// the next read repairs).
pub(super) const GET_GRACE_MIN: Duration = Duration::from_millis(250);

/// Inbound records checked at once on blocking threads; more are dropped (their writers
/// see no difference: Kademlia acknowledged them already).
pub(super) const MAX_PRECHECKS: usize = 64;

/// Inbound records up to this size are checked on the event loop (a record this small holds at
/// most about a hundred signed entries: a few milliseconds of checks); larger ones on a
/// blocking thread.
pub(super) const INLINE_CHECK_BYTES: usize = 16 << 10;

/// An inbound record and its precheck's verdict.
struct Prechecked {
    key: Vec<u8>,
    value: Vec<u8>,
    source: PeerId,
    verdict: Result<(), String>,
}

pub(super) struct EventLoop {
    pub(super) swarm: Swarm<Behaviour>,
    commands: mpsc::Receiver<Command>,
    policy: Arc<dyn RecordPolicy>,
    /// Prechecks of inbound records running on blocking threads ([`MAX_PRECHECKS`] at most).
    prechecks: JoinSet<Prechecked>,
    pending: HashMap<kad::QueryId, Pending>,
    listeners_without_addr: HashSet<libp2p::core::transport::ListenerId>,
    listen_addrs: Vec<Multiaddr>,
    addr_waiters: Vec<oneshot::Sender<Vec<Multiaddr>>>,
    initial_peers: HashSet<PeerId>,
    /// Initial peers whose last dial failed, with why: when every one has, whoever waits for
    /// a first connection hears it at once instead of at the bootstrap timeout.
    initial_failures: HashMap<PeerId, String>,
    /// The last moment a failed initial dial is made again ([`MAX_REDIALS`]): after it, another
    /// handshake (up to its timeout) would end past the bootstrap timeout, so whoever waits
    /// would hear only that time ran out, not why each initial peer failed.
    initial_redial_until: Instant,
    connect_waiters: Vec<oneshot::Sender<Result<(), P2pError>>>,
    /// Handles waiting for a connection to one peer ([`Command::Connect`]).
    peer_waiters: HashMap<PeerId, Vec<oneshot::Sender<Result<(), P2pError>>>>,
    /// Reachability, relays, hole punching (`nat.rs`).
    pub(super) nat: Nat,
    /// Kademlia's mode is forced to client ([`P2pConfig::client_mode`]).
    forced_client: bool,
    /// In a private swarm, the peers connected through the key (`private.rs`).
    swarm_peers: Option<SwarmPeers>,
    /// The node's metrics: this loop sets the connection, store and relay-server ones.
    metrics: crate::metrics::Metrics,
    /// Dials made again for waiting handles after a failed handshake, per peer
    /// ([`MAX_REDIALS`]); cleared when the peer connects or its waiters are answered.
    redials: HashMap<PeerId, u32>,
    /// Pauses before those dials, each ending with its peer.
    redial_timers: JoinSet<PeerId>,
    /// Early answers of merged reads ([`GET_GRACE_MIN`]): one timer per read with an answer.
    get_timers: JoinSet<kad::QueryId>,
    /// Per-address shares of the relay server's reservations and circuits (`relay_shares.rs`),
    /// which follow the relay's events; `None` when this node is no relay.
    relay_shares: Option<super::relay_shares::RelayShares>,
    /// Per key, the peers this node's last write of it went to (`replicas.rs`).
    replicas: super::replicas::ReplicaSets,
}

/// Times a dial for waiting handles is made again after a failed handshake (not after a
/// failure that says the peer is gone): two peers that dial each other at the same instant
/// from their listen ports get one TCP connection with two initiators, and both handshakes
/// fail; a second dial after a random pause almost never meets the other's again. An initial
/// peer is dialed again the same way (waiters or not, and from a new port) before it counts
/// as failed: a dial from the listen port meets "address already in use" while the kernel
/// keeps a closed connection between the same two ports (seen in tests' `Node::start` on
/// loopback, a node listening on the port of a node just shut down).
const MAX_REDIALS: u32 = 2;

/// The longest random pause before such a dial, in milliseconds.
const REDIAL_PAUSE_MAX_MS: u64 = 200;

/// Most addresses of one peer that identify adds to the routing table.
const MAX_ROUTING_ADDRS: usize = 8;

fn kad_protocol() -> StreamProtocol {
    StreamProtocol::new(KAD_PROTOCOL)
}

impl EventLoop {
    pub(super) fn new(
        config: &P2pConfig,
        keypair: Keypair,
        policy: Box<dyn RecordPolicy>,
        commands: mpsc::Receiver<Command>,
        initial_peers: &[(PeerId, Multiaddr)],
    ) -> Result<Self, P2pError> {
        let build = |e: &dyn std::fmt::Display| P2pError::Build(e.to_string());
        let max_record = config.max_record_bytes;
        let store_limits = config.store.clone();
        let conn_limits = config.connections.clone();
        let request_timeout = config.request_timeout;
        let client_mode = config.client_mode;
        let nat = config.nat.clone();
        let relay_shares = nat
            .relay_server
            .as_ref()
            .map(super::relay_shares::RelayShares::new);
        let relay_gates = relay_shares.clone();
        let bootstrapping = !initial_peers.is_empty();
        let make_behaviour = move |key: &Keypair, relay_client: relay::client::Behaviour| {
            let peer_id = key.public().to_peer_id();
            let mut kcfg = kad::Config::new(kad_protocol());
            kcfg.set_record_filtering(kad::StoreInserts::FilterBoth)
                .set_max_packet_size(max_record + (64 << 10))
                .set_query_timeout(request_timeout)
                .set_publication_interval(None)
                // No replication either: every inbound PUT then comes from its writer, which
                // owned keys rely on (`dht::owned_key`), and values expire within the hour.
                .set_replication_interval(None)
                .set_record_ttl(Some(Duration::from_secs(3600)))
                .set_periodic_bootstrap_interval(Some(Duration::from_secs(60)));
            let store = BoundedStore::new(peer_id, store_limits, max_record);
            let mut kad = kad::Behaviour::with_config(peer_id, store, kcfg);
            // Server only where others can dial us. A node joining through initial peers
            // starts as a client and becomes a server once it knows it is public (its first
            // identify answer): a NATed node must never land in routing tables with its
            // private addresses, where every lookup would stall on dialing them. A lone
            // node (the first bootstrap) can only assume it is public.
            let server = !client_mode
                && match nat.assume {
                    Some(reach) => reach == crate::reach::Reach::Public,
                    None => !bootstrapping,
                };
            kad.set_mode(Some(if server {
                kad::Mode::Server
            } else {
                kad::Mode::Client
            }));
            let relay_server =
                nat.relay_server
                    .as_ref()
                    .zip(relay_gates.as_ref())
                    .map(|(limits, shares)| {
                        relay::Behaviour::new(peer_id, super::nat::relay_config(limits, shares))
                    });
            let autonat_client = nat.autonat.then(|| {
                autonat::v2::client::Behaviour::new(
                    rand::make_rng(),
                    autonat::v2::client::Config::default()
                        .with_probe_interval(nat.autonat_interval),
                )
            });
            Behaviour {
                kad,
                identify: identify::Behaviour::new(identify::Config::new(
                    IDENTIFY_PROTOCOL.to_owned(),
                    key.public(),
                )),
                ping: ping::Behaviour::default(),
                stream: libp2p_stream::Behaviour::new(),
                relay_client,
                relay_server: relay_server.into(),
                dcutr: nat
                    .hole_punching
                    .then(|| dcutr::Behaviour::new(peer_id))
                    .into(),
                autonat_client: autonat_client.into(),
                autonat_server: nat
                    .autonat_server
                    .then(autonat::v2::server::Behaviour::default)
                    .into(),
                inbound: super::inbound::Behaviour::new(
                    conn_limits.max_pending_incoming as usize,
                    conn_limits.max_pending_per_address as usize,
                    conn_limits.max_established_incoming as usize,
                    conn_limits.max_established_per_address as usize,
                ),
                limits: libp2p::connection_limits::Behaviour::new(
                    libp2p::connection_limits::ConnectionLimits::default()
                        .with_max_established_per_peer(Some(conn_limits.max_per_peer)),
                ),
                memory_limits: conn_limits
                    .max_process_memory_bytes
                    .map(libp2p::memory_connection_limits::Behaviour::with_max_bytes)
                    .into(),
                candidates: super::candidates::Candidates::default(),
            }
        };
        let handshake_timeout = config.connections.handshake_timeout;
        let idle = config.idle_connection_timeout;
        let swarm_config = move |c: libp2p::swarm::Config| c.with_idle_connection_timeout(idle);
        // The same after the transports, whose builder types differ between the two.
        macro_rules! finish {
            ($builder:expr) => {
                $builder
                    .with_dns()
                    .map_err(|e| build(&e))?
                    .with_relay_client(noise::Config::new, yamux::Config::default)
                    .map_err(|e| build(&e))?
                    .with_behaviour(make_behaviour)
                    .map_err(|e| build(&e))?
                    .with_swarm_config(swarm_config)
                    .with_connection_timeout(handshake_timeout)
                    .build()
            };
        }
        let mut swarm = match config.swarm_key {
            None => finish!(
                libp2p::SwarmBuilder::with_existing_identity(keypair)
                    .with_tokio()
                    .with_tcp(
                        tcp::Config::default().nodelay(true),
                        noise::Config::new,
                        yamux::Config::default,
                    )
                    .map_err(|e| build(&e))?
                    .with_quic()
            ),

            // A private swarm: TCP only, with the pnet layer under noise (`private.rs`).
            Some(key) => finish!(
                libp2p::SwarmBuilder::with_existing_identity(keypair)
                    .with_tokio()
                    .with_other_transport(|keypair| {
                        use libp2p::Transport as _;
                        let psk = key.psk();
                        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                            tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
                                .and_then(move |socket, _| {
                                    libp2p::pnet::PnetConfig::new(psk).handshake(socket)
                                })
                                .upgrade(libp2p::core::upgrade::Version::V1Lazy)
                                .authenticate(noise::Config::new(keypair)?)
                                .multiplex(yamux::Config::default()),
                        )
                    })
                    .map_err(|e| build(&e))?
            ),
        };
        let mut listeners = HashSet::new();
        for addr in &config.listen {
            if config.swarm_key.is_some() && addr.iter().any(|p| matches!(p, Protocol::QuicV1)) {
                tracing::warn!(%addr, "a private swarm runs on TCP only: not listening on QUIC");
                continue;
            }
            let id = swarm
                .listen_on(addr.clone())
                .map_err(|e| P2pError::Listen {
                    addr: addr.clone(),
                    detail: e.to_string(),
                })?;
            listeners.insert(id);
        }
        for (peer, addr) in initial_peers {
            swarm.behaviour_mut().kad.add_address(peer, addr.clone());
            swarm.dial(addr.clone()).map_err(|e| P2pError::Dial {
                addr: addr.clone(),
                detail: e.to_string(),
            })?;
        }
        for addr in &config.nat.external {
            // Confirmed by the operator: behaviours (the relay server among them) see it as
            // confirmed (this causes no swarm event: `Nat` is told below).
            swarm.add_external_address(addr.clone());
        }
        let mut event_loop = Self {
            swarm,
            commands,
            policy: Arc::from(policy),
            prechecks: JoinSet::new(),
            pending: HashMap::new(),
            listeners_without_addr: listeners,
            listen_addrs: Vec::new(),
            addr_waiters: Vec::new(),
            initial_peers: initial_peers.iter().map(|(p, _)| *p).collect(),
            initial_failures: HashMap::new(),
            initial_redial_until: Instant::now()
                + config.bootstrap_timeout.saturating_sub(
                    config.connections.handshake_timeout
                        + Duration::from_millis(REDIAL_PAUSE_MAX_MS),
                ),
            connect_waiters: Vec::new(),
            peer_waiters: HashMap::new(),
            nat: Nat::new(&config.nat),
            forced_client: client_mode,
            swarm_peers: config.swarm_key.map(|_| SwarmPeers::default()),
            metrics: crate::metrics::Metrics::new(),
            redials: HashMap::new(),
            redial_timers: JoinSet::new(),
            get_timers: JoinSet::new(),
            relay_shares,
            replicas: super::replicas::ReplicaSets::default(),
        };
        for addr in &config.nat.external {
            event_loop.on_external_confirmed(addr.clone());
        }
        Ok(event_loop)
    }

    /// The watches behind [`super::P2p::reachability`] and [`super::P2p::nat_stats`].
    /// The node's metrics ([`super::P2p::metrics`]).
    pub(super) fn metrics(&self) -> crate::metrics::Metrics {
        self.metrics.clone()
    }

    /// Sets the gauges this loop owns (connections, the store): cheap, so after every event.
    fn update_metrics(&mut self) {
        let info = self.swarm.network_info();
        self.metrics.set_connections(
            info.num_peers(),
            info.connection_counters().num_established() as usize,
        );
        let usage = self.swarm.behaviour_mut().kad.store_mut().usage();
        self.metrics.set_store(&usage);
    }

    pub(super) fn nat_watches(&self) -> (watch::Receiver<Reachability>, watch::Receiver<NatStats>) {
        self.nat.watches()
    }

    /// Whether Kademlia's mode may follow the reachability.
    pub(super) fn kad_mode_follows_reach(&self) -> bool {
        !self.forced_client
    }

    /// A control for opening and accepting streams (used by handles, outside the loop).
    /// When no initial peer is connected and the last dial of each failed: the error to give
    /// whoever waits for a first connection.
    fn every_initial_peer_failed(&self) -> Option<P2pError> {
        let all_failed = !self.initial_peers.is_empty()
            && self
                .initial_peers
                .iter()
                .all(|p| self.initial_failures.contains_key(p) && !self.swarm.is_connected(p));
        if !all_failed {
            return None;
        }
        let (peer, detail) = self.initial_failures.iter().next()?;
        let hint = if self.swarm_peers.is_some() {
            " (this node runs a private swarm: does that peer use the same swarm key?)"
        } else {
            ""
        };
        Some(P2pError::Dial {
            addr: Multiaddr::empty().with(Protocol::P2p(*peer)),
            detail: format!("every initial peer failed; {detail}{hint}"),
        })
    }

    /// In a private swarm, the peers connected through the key.
    pub(super) fn swarm_peers(&self) -> Option<SwarmPeers> {
        self.swarm_peers.clone()
    }

    pub(super) fn stream_control(&self) -> libp2p_stream::Control {
        self.swarm.behaviour().stream.new_control()
    }

    pub(super) async fn run(mut self) {
        let mut tick = tokio::time::interval(super::nat::TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.nat_tick(),
                command = self.commands.recv() => match command {
                    Some(Command::Shutdown { reply }) => {
                        let _ = reply.send(());
                        break;
                    }
                    Some(command) => self.on_command(command),
                    None => break, // every handle dropped
                },
                event = self.swarm.select_next_some() => self.on_event(event),
                Some(Ok(peer)) = self.redial_timers.join_next(), if !self.redial_timers.is_empty() => {
                    self.redial(peer);
                }
                Some(Ok(id)) = self.get_timers.join_next(), if !self.get_timers.is_empty() => {
                    self.answer_get_early(id);
                }
                Some(done) = self.prechecks.join_next(), if !self.prechecks.is_empty() => {
                    match done {
                        Ok(checked) => self.on_prechecked(checked),
                        Err(e) => tracing::error!(error = %e, "record precheck failed"),
                    }
                }
            }
            self.update_metrics();
        }
        // Dropping the swarm closes listeners and connections; tell waiters we are gone.
        for (_, p) in self.pending.drain() {
            match p {
                Pending::Put { reply, .. } | Pending::PutLookup { reply, .. } => {
                    drop(reply.send(Err(P2pError::Shutdown)))
                }
                Pending::Get { reply, .. } => drop(reply.send(Err(P2pError::Shutdown))),
                Pending::FindPeer(_) => {}
            }
        }
        for (_, waiters) in self.peer_waiters.drain() {
            for w in waiters {
                let _ = w.send(Err(P2pError::Shutdown));
            }
        }
        self.nat.shutdown();
        tracing::debug!(peer = %self.swarm.local_peer_id(), "p2p event loop stopped");
    }

    /// A merged read's early answer ([`GET_GRACE_MIN`]): what the replicas answered so far;
    /// the lookup is finished (answers still under way are dropped).
    fn answer_get_early(&mut self, id: kad::QueryId) {
        if let Some(Pending::Get { reply, values, .. }) = self.pending.remove(&id) {
            let _ = reply.send(Ok(values));
            if let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                query.finish();
            }
        }
    }

    fn local_addrs(&self) -> Vec<Multiaddr> {
        let me = *self.swarm.local_peer_id();
        self.listen_addrs
            .iter()
            .map(|a| a.clone().with(Protocol::P2p(me)))
            .collect()
    }

    /// Our listen addresses (without `/p2p/<id>`).
    pub(super) fn listen_addrs(&self) -> &[Multiaddr] {
        &self.listen_addrs
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs { reply } => {
                if self.listeners_without_addr.is_empty() {
                    let _ = reply.send(self.local_addrs());
                } else {
                    self.addr_waiters.push(reply);
                }
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::WaitConnected { reply } => {
                if self
                    .initial_peers
                    .iter()
                    .any(|p| self.swarm.is_connected(p))
                {
                    let _ = reply.send(Ok(()));
                } else if let Some(e) = self.every_initial_peer_failed() {
                    let _ = reply.send(Err(e));
                } else {
                    self.connect_waiters.push(reply);
                }
            }
            Command::Bootstrap { reply } => {
                // No known peers is not an error for a lone bootstrap node.
                let _ = self.swarm.behaviour_mut().kad.bootstrap();
                let _ = reply.send(());
            }
            Command::Put { key, value, reply } => self.put(key, value, reply),
            Command::Get { key, local, reply } => {
                let include_local = local;
                let key = kad::RecordKey::new(&key);
                let local = if local {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .store_mut()
                        .get(&key)
                        .map(|r| r.value.clone())
                } else {
                    None
                };
                let id = self.swarm.behaviour_mut().kad.get_record(key);
                self.pending.insert(
                    id,
                    Pending::Get {
                        reply,
                        values: local.into_iter().collect(),
                        replicas_only: (!include_local).then(HashSet::new),
                        started: Instant::now(),
                        timed: false,
                    },
                );
            }
            Command::AddAddresses { peer, addrs, reply } => {
                for addr in addrs {
                    // Kademlia hands its routing table's addresses to dials by peer id.
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, addr.clone());
                    self.swarm.add_peer_address(peer, addr);
                }
                let _ = reply.send(());
            }
            Command::Connect { peer, reply } => self.connect(peer, reply),
            Command::ConnectionPaths { peer, reply } => {
                let _ = reply.send(self.nat.paths(&peer));
            }
            Command::ConnectDirect { peer, via, reply } => self.connect_direct(peer, via, reply),
            Command::AddRelayCandidates { addrs, reply } => {
                self.nat.add_relay_candidates(addrs);
                let _ = reply.send(());
            }
            Command::RoutingAddresses { peer, reply } => {
                let _ = reply.send(self.routing_addresses(&peer));
            }
            Command::StoreUsage { reply } => {
                let _ = reply.send(self.swarm.behaviour_mut().kad.store_mut().usage());
            }
            Command::Shutdown { .. } => unreachable!("handled in run()"),
        }
    }

    /// Schedules another dial of `peer` after a random pause, unless it has had its
    /// [`MAX_REDIALS`] or nobody waits for it. Whether one was scheduled.
    fn redial_later(&mut self, peer: PeerId) -> bool {
        let Some(waiters) = self.peer_waiters.get_mut(&peer) else {
            return false;
        };
        waiters.retain(|w| !w.is_closed());
        if waiters.is_empty() {
            return false;
        }
        self.redial_after_pause(peer)
    }

    /// An initial peer's dial failed: remembered, and whoever waits for a first connection is
    /// told once every initial peer failed.
    fn initial_dial_failed(&mut self, peer: PeerId, detail: String) {
        self.initial_failures.insert(peer, detail);
        if let Some(e) = self.every_initial_peer_failed() {
            for w in self.connect_waiters.drain(..) {
                let _ = w.send(Err(e.clone()));
            }
        }
    }

    /// Schedules a dial of `peer` after a random pause, at most [`MAX_REDIALS`] times in a
    /// row (a connection resets the count): whether it did.
    fn redial_after_pause(&mut self, peer: PeerId) -> bool {
        let done = self.redials.entry(peer).or_insert(0);
        if *done >= MAX_REDIALS {
            return false;
        }
        *done += 1;
        let pause = Duration::from_millis(rand::random_range(20..REDIAL_PAUSE_MAX_MS));
        tracing::debug!(%peer, ?pause, "handshake failed: dialing again");
        self.redial_timers.spawn(async move {
            tokio::time::sleep(pause).await;
            peer
        });
        true
    }

    /// Answers every handle waiting for `peer` with a dial error (and forgets its redials).
    fn fail_waiters(&mut self, peer: PeerId, detail: &str) {
        self.redials.remove(&peer);
        for w in self.peer_waiters.remove(&peer).unwrap_or_default() {
            let _ = w.send(Err(P2pError::Dial {
                addr: Multiaddr::empty().with(Protocol::P2p(peer)),
                detail: detail.to_owned(),
            }));
        }
    }

    /// The dial [`Self::redial_later`] scheduled (if the peer is still waited for).
    fn redial(&mut self, peer: PeerId) {
        let initial = self.initial_peers.contains(&peer);
        if self.swarm.is_connected(&peer) || !(initial || self.peer_waiters.contains_key(&peer)) {
            return;
        }
        // From a new port. A dial from the listen port meets "address already in use" for as
        // long as the kernel keeps an earlier connection between the same two ports
        // (TIME_WAIT, a minute): a node whose random listen port was a closed node's that had
        // dialed the same peer, or a peer dialed again after a connection to it from the listen
        // port closed (then that error, which does not say the peer is gone, came back on
        // every redial: `a_peer_that_left_leaves_the_routing_table_when_it_cannot_be_dialed`,
        // 1 run in 12). A new port also rules out meeting the peer's own dial again (TCP's
        // simultaneous open, the other reason for a redial).
        let opts = DialOpts::peer_id(peer)
            .condition(PeerCondition::DisconnectedAndNotDialing)
            .allocate_new_port()
            .build();
        match self.swarm.dial(opts) {
            Ok(()) | Err(libp2p::swarm::DialError::DialPeerConditionFalse(_)) => {}
            Err(e) => {
                if initial {
                    self.initial_dial_failed(peer, e.to_string());
                }
                self.fail_waiters(peer, &e.to_string());
            }
        }
    }

    /// Answers `reply` once `peer` is connected, dialing it (by peer id, addresses from the
    /// behaviours) unless a connection or a dial exists already.
    pub(super) fn connect(&mut self, peer: PeerId, reply: oneshot::Sender<Result<(), P2pError>>) {
        if self.swarm.is_connected(&peer) {
            let _ = reply.send(Ok(()));
            return;
        }
        let opts = DialOpts::peer_id(peer)
            .condition(PeerCondition::DisconnectedAndNotDialing)
            .build();
        match self.swarm.dial(opts) {
            Ok(()) | Err(libp2p::swarm::DialError::DialPeerConditionFalse(_)) => {
                let waiters = self.peer_waiters.entry(peer).or_default();
                // Waiters that gave up (their handle timed out) are pruned here.
                waiters.retain(|w| !w.is_closed());
                waiters.push(reply);
            }
            Err(libp2p::swarm::DialError::NoAddresses) => {
                // Nobody told us where it is: ask the DHT (FIND_NODE), then dial what it says.
                let waiters = self.peer_waiters.entry(peer).or_default();
                waiters.retain(|w| !w.is_closed());
                let first = waiters.is_empty();
                waiters.push(reply);
                if first {
                    let id = self.swarm.behaviour_mut().kad.get_closest_peers(peer);
                    self.pending.insert(id, Pending::FindPeer(peer));
                }
            }
            Err(e) => {
                let _ = reply.send(Err(P2pError::Dial {
                    addr: Multiaddr::empty().with(Protocol::P2p(peer)),
                    detail: e.to_string(),
                }));
            }
        }
    }

    /// The end of a [`Pending::FindPeer`] lookup: dials the addresses found, or fails the
    /// peer's waiters.
    fn found_peer(&mut self, peer: PeerId, found: Vec<kad::PeerInfo>) {
        let addrs: Vec<Multiaddr> = found
            .into_iter()
            .filter(|p| p.peer_id == peer)
            .flat_map(|p| p.addrs)
            .collect();
        let fail = |this: &mut Self, detail: String| this.fail_waiters(peer, &detail);
        if self.swarm.is_connected(&peer) {
            for w in self.peer_waiters.remove(&peer).unwrap_or_default() {
                let _ = w.send(Ok(()));
            }
            return;
        }
        if addrs.is_empty() {
            fail(
                self,
                "no address known and none found in the DHT".to_owned(),
            );
            return;
        }
        for addr in &addrs {
            self.swarm
                .behaviour_mut()
                .kad
                .add_address(&peer, addr.clone());
        }
        let opts = DialOpts::peer_id(peer)
            .condition(PeerCondition::DisconnectedAndNotDialing)
            .addresses(addrs)
            .build();
        match self.swarm.dial(opts) {
            Ok(()) | Err(libp2p::swarm::DialError::DialPeerConditionFalse(_)) => {}
            Err(e) => fail(self, e.to_string()),
        }
    }

    /// Merges `value` into the local record (through the policy) and replicates `value` itself,
    /// not the merged record: the replicas merge it into theirs. Under an owned key a replica
    /// refuses a remote write holding anyone else's entry, so a merged record was refused
    /// everywhere as soon as this node held another writer's entry (a withdrawal reached nobody
    /// but its writer); alone it is also O(1) per write, however many writers share the key.
    /// Nothing republishes records, so a replica holds what the writers sent it; readers merge
    /// every replica's answer.
    fn put(
        &mut self,
        key: Vec<u8>,
        value: Vec<u8>,
        reply: oneshot::Sender<Result<usize, P2pError>>,
    ) {
        let expires = match self.merge_into_store(&key, &value, None) {
            Ok(e) => e,
            Err(e) => {
                let _ = reply.send(Err(P2pError::Rejected(e)));
                return;
            }
        };
        let mut record = kad::Record::new(kad::RecordKey::new(&key), value);
        record.expires = Some(expires);
        if let Some(peers) = self.replicas.fresh(&key, Instant::now()) {
            let peers = peers.to_vec();
            self.metrics.dht_write(false);
            self.put_to(record, peers, reply);
            return;
        }
        self.metrics.dht_write(true);
        // Kademlia's `put_record` in two steps, so that the peers found are kept for the next
        // writes of the key.
        let id = self
            .swarm
            .behaviour_mut()
            .kad
            .get_closest_peers(record.key.to_vec());
        self.pending
            .insert(id, Pending::PutLookup { reply, record });
    }

    /// The PUT of `record` to `peers` (none: nobody to replicate to).
    fn put_to(
        &mut self,
        mut record: kad::Record,
        peers: Vec<PeerId>,
        reply: oneshot::Sender<Result<usize, P2pError>>,
    ) {
        if peers.is_empty() {
            let _ = reply.send(Ok(0));
            return;
        }
        record.publisher = Some(*self.swarm.local_peer_id());
        self.metrics.dht_write_sent(record.value.len(), peers.len());
        let key = record.key.to_vec();
        let id = self.swarm.behaviour_mut().kad.put_record_to(
            record,
            peers.into_iter(),
            kad::Quorum::One,
        );
        self.pending.insert(id, Pending::Put { reply, key });
    }

    /// Prechecks an inbound record, at once if it is small ([`INLINE_CHECK_BYTES`]), else on a
    /// blocking thread; it is merged when the check passes ([`EventLoop::on_prechecked`]). A
    /// large record is dropped while [`MAX_PRECHECKS`] run.
    fn precheck(&mut self, record: kad::Record, source: PeerId) {
        if record.value.len() <= INLINE_CHECK_BYTES {
            // Small: checked at once, so that a read right after the write sees it.
            let key = record.key.to_vec();
            let verdict =
                self.policy
                    .precheck(&key, &record.value, Some(source), SystemTime::now());
            self.on_prechecked(Prechecked {
                key,
                value: record.value,
                source,
                verdict,
            });
            return;
        }
        if self.prechecks.len() >= MAX_PRECHECKS {
            tracing::debug!(%source, "too many inbound records being checked: one dropped");
            return;
        }
        let policy = Arc::clone(&self.policy);
        self.prechecks.spawn_blocking(move || {
            let key = record.key.to_vec();
            let verdict = policy.precheck(&key, &record.value, Some(source), SystemTime::now());
            Prechecked {
                key,
                value: record.value,
                source,
                verdict,
            }
        });
    }

    fn on_prechecked(&mut self, checked: Prechecked) {
        let Prechecked {
            key,
            value,
            source,
            verdict,
        } = checked;
        if let Err(reason) =
            verdict.and_then(|()| self.merge_into_store(&key, &value, Some(source)).map(drop))
        {
            tracing::debug!(%source, %reason, "rejected inbound record");
        }
    }

    /// Drops `peer` from Kademlia's routing table after a dial to it failed on every address
    /// (initial peers excepted: they are how this node finds the swarm again). libp2p-kad
    /// keeps such a peer, with its last address, until its bucket is full and a newcomer
    /// replaces it; in a swarm smaller than a bucket that never happens, so every peer that
    /// ever left stayed, and every lookup kept dialing the dead (a QUIC dial to a closed port
    /// waits out its handshake timeout). A live peer dropped by mistake comes back with its
    /// next connection or lookup answer.
    ///
    /// Only a failure that says the peer is gone counts ([`peer_is_gone`]): a handshake that
    /// failed (e.g. both peers dialled each other at once and TCP joined the two dials into
    /// one connection with two initiators) says nothing about whether it is still there.
    fn forget_unreachable(&mut self, peer: PeerId, error: &libp2p::swarm::DialError) {
        if self.initial_peers.contains(&peer) || !peer_is_gone(error) {
            return;
        }
        self.replicas.forget_peer(&peer);
        if self.swarm.behaviour_mut().kad.remove_peer(&peer).is_some() {
            tracing::debug!(%peer, "unreachable: removed from the routing table");
        }
    }

    /// Merges `incoming` with the stored value under `key` and stores the result; returns when
    /// the stored record expires.
    fn merge_into_store(
        &mut self,
        key: &[u8],
        incoming: &[u8],
        source: Option<PeerId>,
    ) -> Result<Instant, String> {
        let rkey = kad::RecordKey::new(&key);
        let store = self.swarm.behaviour_mut().kad.store_mut();
        let existing = store.get(&rkey).map(|r| r.value.clone());
        let now = SystemTime::now();
        let (merged, expires_at) =
            self.policy
                .merge(key, existing.as_deref(), incoming, source, now)?;
        let ttl = expires_at.duration_since(now).unwrap_or(Duration::ZERO);
        let expires = Instant::now() + ttl;
        let mut record = kad::Record::new(rkey, merged);
        record.expires = Some(expires);
        // The store charges this write's growth of the record to its writer (`store.rs`).
        record.publisher = Some(source.unwrap_or(*self.swarm.local_peer_id()));
        self.swarm
            .behaviour_mut()
            .kad
            .store_mut()
            .try_put(record)
            .map_err(|e| e.to_string())?;
        Ok(expires)
    }

    /// The addresses of `peer` in the routing table (empty if it is not there).
    fn routing_addresses(&mut self, peer: &PeerId) -> Vec<Multiaddr> {
        self.swarm
            .behaviour_mut()
            .kad
            .kbucket(*peer)
            .and_then(|bucket| {
                bucket
                    .iter()
                    .find(|e| e.node.key.preimage() == peer)
                    .map(|e| e.node.value.iter().cloned().collect())
            })
            .unwrap_or_default()
    }

    fn on_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } if self.nat.is_relay_listener(listener_id) => {
                self.on_relay_address(listener_id, address);
            }
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                tracing::debug!(%address, "listening");
                self.nat.on_listen_addr(&address);
                if !self.listen_addrs.contains(&address) {
                    self.listen_addrs.push(address);
                }
                self.listeners_without_addr.remove(&listener_id);
                if self.listeners_without_addr.is_empty() {
                    let addrs = self.local_addrs();
                    for w in self.addr_waiters.drain(..) {
                        let _ = w.send(addrs.clone());
                    }
                }
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.retain(|a| a != &address);
                self.nat.on_expired_addr(&address);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => self.on_listener_closed(listener_id, reason),
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => {
                if let Some(peers) = &self.swarm_peers {
                    peers.insert(peer_id, endpoint.get_remote_address());
                }
                self.on_connection(peer_id, connection_id, &endpoint);
                if self.initial_peers.contains(&peer_id) {
                    for w in self.connect_waiters.drain(..) {
                        let _ = w.send(Ok(()));
                    }
                }
                self.redials.remove(&peer_id);
                for w in self.peer_waiters.remove(&peer_id).unwrap_or_default() {
                    let _ = w.send(Ok(()));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => {
                if num_established == 0
                    && let Some(shares) = &self.relay_shares
                {
                    shares.on_peer_gone(&peer_id);
                }
                self.on_connection_closed(peer_id, connection_id)
            }
            SwarmEvent::ExternalAddrConfirmed { address } => self.on_external_confirmed(address),
            SwarmEvent::ExternalAddrExpired { address } => self.on_external_expired(&address),
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                tracing::debug!(?peer_id, %error, "outgoing connection failed");
                if let Some(peer) = peer_id {
                    // A dial of direct addresses only: a hole punch's dial, or a plain one.
                    let direct = matches!(
                        &error,
                        libp2p::swarm::DialError::Transport(tried)
                            if tried.iter().all(|(a, _)| !super::nat::is_relayed(a))
                    );
                    self.on_dial_failed(peer, &error.to_string(), direct);
                    if self.initial_peers.contains(&peer) && !self.swarm.is_connected(&peer) {
                        if !peer_is_gone(&error)
                            && Instant::now() < self.initial_redial_until
                            && self.redial_after_pause(peer)
                        {
                            // Not "nobody there" (e.g. "address already in use": a port-reuse
                            // clash on loopback): dialed again before it counts as failed;
                            // whoever waits hears the outcome of that dial.
                            return;
                        }
                        self.initial_dial_failed(peer, error.to_string());
                    }
                }
                if let Some(peer) = peer_id
                    && !self.swarm.is_connected(&peer)
                {
                    self.forget_unreachable(peer, &error);
                    if !peer_is_gone(&error) && self.redial_later(peer) {
                        return;
                    }
                    self.fail_waiters(peer, &error.to_string());
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                connection_id,
                info,
            })) => {
                self.on_identify(peer_id, connection_id, &info);
                if info.protocols.contains(&kad_protocol()) {
                    // A peer chooses its listen addresses and may push new ones at will: only
                    // up to MAX_ROUTING_ADDRS of them go into the routing table (Kademlia's own
                    // per-peer lists have no bound).
                    let mut known = self.routing_addresses(&peer_id);
                    for addr in info.listen_addrs {
                        if known.len() >= MAX_ROUTING_ADDRS {
                            break;
                        }
                        // Circuit addresses do not belong in the routing table.
                        if !super::nat::is_relayed(&addr) && !known.contains(&addr) {
                            known.push(addr.clone());
                            self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                        }
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(event)) => self.on_kad(event),
            SwarmEvent::Behaviour(BehaviourEvent::RelayClient(event)) => {
                self.on_relay_client(event)
            }
            SwarmEvent::Behaviour(BehaviourEvent::RelayServer(event)) => {
                if let Some(shares) = &self.relay_shares {
                    shares.on_event(&event);
                }
                match &event {
                    relay::Event::CircuitReqAccepted { .. } => self.metrics.relay_circuits_add(1),
                    relay::Event::CircuitClosed { .. } => self.metrics.relay_circuits_add(-1),
                    relay::Event::ReservationReqAccepted { renewed: false, .. } => {
                        self.metrics.relay_reservations_add(1)
                    }
                    relay::Event::ReservationClosed { .. }
                    | relay::Event::ReservationTimedOut { .. } => {
                        self.metrics.relay_reservations_add(-1)
                    }
                    _ => {}
                }
                tracing::debug!(?event, "relay server");
            }
            SwarmEvent::Behaviour(BehaviourEvent::Dcutr(event)) => self.on_dcutr(event),
            SwarmEvent::Behaviour(BehaviourEvent::AutonatClient(event)) => self.on_autonat(event),
            _ => {}
        }
    }

    fn on_kad(&mut self, event: kad::Event) {
        match event {
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::PutRecord {
                        source,
                        record: Some(record),
                        ..
                    },
            } => {
                self.precheck(record, source);
            }
            kad::Event::OutboundQueryProgressed {
                id,
                result,
                step,
                stats,
            } => match result {
                kad::QueryResult::PutRecord(res) => {
                    if let Some(Pending::Put { reply, key }) = self.pending.remove(&id) {
                        if res.is_err() || stats.num_failures() > 0 {
                            // A replica did not answer: look the key's peers up again.
                            self.replicas.forget(&key);
                        }
                        let stored = match res {
                            Ok(_) => 1,
                            Err(kad::PutRecordError::QuorumFailed { success, .. })
                            | Err(kad::PutRecordError::Timeout { success, .. }) => success.len(),
                        };
                        let _ = reply.send(Ok(stored));
                    }
                }
                kad::QueryResult::GetRecord(res) => {
                    if let Some(Pending::Get {
                        values,
                        replicas_only,
                        started,
                        timed,
                        ..
                    }) = self.pending.get_mut(&id)
                        && let Ok(kad::GetRecordOk::FoundRecord(found)) = &res
                    {
                        let merged = replicas_only.is_none();
                        let keep = match (replicas_only, found.peer) {
                            (None, _) => true,
                            (Some(seen), Some(peer)) => seen.insert(peer),
                            (Some(_), None) => false,
                        };
                        if keep {
                            values.push(found.record.value.clone());
                        }
                        // A merged read's first remote answer starts its early answer's timer
                        // (reads of every replica, `replicas_only`, wait for all of them).
                        if merged && found.peer.is_some() && !*timed {
                            *timed = true;
                            let grace = started.elapsed().max(GET_GRACE_MIN);
                            self.get_timers.spawn(async move {
                                tokio::time::sleep(grace).await;
                                id
                            });
                        }
                    }
                    let finished = step.last
                        || matches!(
                            res,
                            Ok(kad::GetRecordOk::FinishedWithNoAdditionalRecord { .. }) | Err(_)
                        );
                    if finished
                        && let Some(Pending::Get { reply, values, .. }) = self.pending.remove(&id)
                    {
                        // NotFound or a timeout after some answers still returns what we have.
                        let _ = reply.send(Ok(values));
                    }
                }
                kad::QueryResult::GetClosestPeers(res) => {
                    let found = match res {
                        Ok(ok) => ok.peers,
                        Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                    };
                    match self.pending.remove(&id) {
                        Some(Pending::FindPeer(peer)) => self.found_peer(peer, found),
                        Some(Pending::PutLookup { reply, record }) => {
                            let peers: Vec<PeerId> = found.into_iter().map(|p| p.peer_id).collect();
                            self.replicas
                                .found(record.key.to_vec(), peers.clone(), Instant::now());
                            self.put_to(record, peers, reply);
                        }
                        Some(other) => {
                            self.pending.insert(id, other);
                        }
                        None => {}
                    }
                }
                kad::QueryResult::Bootstrap(Err(e)) => {
                    tracing::debug!(error = %e, "bootstrap step failed");
                }
                _ => {}
            },
            _ => {}
        }
    }
}

/// Whether a failed dial says that the peer is no longer where we looked: another peer answered
/// there, or every address refused the connection, was unreachable or timed out. Errors of
/// the handshake or of the protocols negotiated after it (a simultaneous open, a limit
/// reached on either side, a peer under load) do not count.
pub(super) fn peer_is_gone(error: &libp2p::swarm::DialError) -> bool {
    use libp2p::TransportError;
    use libp2p::swarm::DialError;
    match error {
        DialError::WrongPeerId { .. } => true,
        DialError::Transport(errors) => {
            !errors.is_empty()
                && errors.iter().all(|(_, e)| match e {
                    TransportError::MultiaddrNotSupported(_) => false,
                    TransportError::Other(e) => says_gone(e),
                })
        }
        _ => false,
    }
}

/// Whether an error, or anything it wraps, is an I/O error that means nobody is there
/// (refused, unreachable, timed out) or QUIC's handshake timeout (a closed UDP port).
///
/// Read from the error's `Debug` text: libp2p's transport stack wraps the socket's error in
/// `Either`s whose `source()` skips the error they hold, so walking the sources does not reach
/// it; the `Debug` text names every layer, down to the `io::ErrorKind`.
fn says_gone(error: &std::io::Error) -> bool {
    let text = format!("{error:?}");
    [
        "ConnectionRefused",
        "HostUnreachable",
        "NetworkUnreachable",
        "TimedOut",
    ]
    .iter()
    .any(|kind| text.contains(kind))
}
