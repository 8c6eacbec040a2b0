//! The NAT side of the event loop: reachability from observed addresses and dial-backs, relay
//! reservations, hole punching, and how each connection runs (see the `p2p` module docs).
//!
//! State lives in [`Nat`], owned by the event loop; the handlers below are `impl EventLoop`
//! blocks called from its event dispatch. Everything is bounded: observations
//! ([`crate::reach::MAX_OBSERVATIONS`]), observed and confirmed addresses, relay candidates
//! ([`MAX_RELAY_CANDIDATES`]); connections are tracked only while they are open.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use libp2p::core::ConnectedPoint;
use libp2p::core::transport::{ListenerId, PortUse};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::{Multiaddr, PeerId, StreamProtocol, autonat, dcutr, identify, kad, relay};
use tokio::sync::{oneshot, watch};

use super::relay_shares::RelayShares;
use super::swarm::EventLoop;
use super::{ConnPath, NatConfig, NatStats, P2pError, Reachability, RelayLimits, Transport};
use crate::reach::{self, Observations, Reach, Seen};

/// How often the event loop looks after its relay reservations.
pub(super) const TICK: Duration = Duration::from_secs(1);
/// The circuit relay v2 protocol a relay serves.
const HOP_PROTOCOL: &str = "/libp2p/circuit/relay/0.2.0/hop";
/// Relays remembered as candidates for reservations.
pub(super) const MAX_RELAY_CANDIDATES: usize = 64;
/// Observed and confirmed addresses kept for [`Reachability`].
const MAX_ADDRS: usize = 16;
/// How long a node that joined through peers may stay a Kademlia client without learning its
/// reachability (every peer's identify tells it within a round trip, so this is a fallback for
/// peers that never do): then it serves the DHT as public nodes do.
const UNKNOWN_GRACE: Duration = Duration::from_secs(20);
/// Pause before a relay that failed us is tried again; doubles per failure up to 64×.
const RELAY_BACKOFF: Duration = Duration::from_secs(1);

/// libp2p's relay server configuration for our limits (see [`RelayLimits`]), with `shares`
/// gating every reservation and circuit request last (after libp2p's own bounds and rate
/// limiters, so that a request it admits is accepted: see `relay_shares.rs`).
pub(super) fn relay_config(limits: &RelayLimits, shares: &RelayShares) -> relay::Config {
    let per_minute =
        NonZeroU32::new(limits.circuits_per_peer_per_minute.max(1)).unwrap_or(NonZeroU32::MIN);
    let per_ip = per_minute.saturating_mul(NonZeroU32::new(2).unwrap_or(NonZeroU32::MIN));
    let mut config = relay::Config {
        max_reservations: limits.max_reservations,
        max_reservations_per_peer: limits.max_reservations_per_peer,
        reservation_duration: limits.reservation_duration,
        max_circuits: limits.max_circuits,
        max_circuits_per_peer: limits.max_circuits_per_peer,
        max_circuit_duration: limits.max_circuit_duration,
        max_circuit_bytes: limits.max_circuit_bytes,
        ..relay::Config::default()
    };
    config.circuit_src_rate_limiters = Vec::new();
    let mut config = config
        .circuit_src_per_peer(per_minute, Duration::from_secs(60))
        .circuit_src_per_ip(per_ip, Duration::from_secs(60));
    config
        .reservation_rate_limiters
        .push(shares.reservation_gate());
    config.circuit_src_rate_limiters.push(shares.circuit_gate());
    config
}

/// Failed direct dials to a peer we wait to punch to that count as a failed hole punch: DCUtR
/// reports a failure only on the side that dials as the listener (after its 3 attempts); the
/// other side sees only its own dials fail, one per attempt.
const PUNCH_DIALS: u8 = 3;

/// Whether `addr` goes through a relay.
pub(super) fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

fn transport_of(addr: &Multiaddr) -> Transport {
    let mut transport = Transport::Other;
    for p in addr.iter() {
        match p {
            Protocol::Tcp(_) => transport = Transport::Tcp,
            Protocol::QuicV1 => transport = Transport::Quic,
            Protocol::P2pCircuit => break,
            _ => {}
        }
    }
    transport
}

fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

/// The port of `addr` for its transport (TCP port, or UDP port of QUIC).
fn port_of(addr: &Multiaddr) -> Option<u16> {
    addr.iter().find_map(|p| match p {
        Protocol::Tcp(port) | Protocol::Udp(port) => Some(port),
        _ => None,
    })
}

fn without_peer_id(addr: &Multiaddr) -> Multiaddr {
    addr.iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect()
}

fn push_bounded(list: &mut Vec<Multiaddr>, addr: Multiaddr) {
    list.retain(|a| a != &addr);
    if list.len() == MAX_ADDRS {
        list.remove(0);
    }
    list.push(addr);
}

/// One open connection.
struct Conn {
    peer: PeerId,
    path: ConnPath,
    /// We dialed it from our listening port (port reuse), so what the peer observes is how our
    /// NAT maps that port.
    reused_port: bool,
    /// The remote address (for an outbound connection: what we dialed).
    remote: Multiaddr,
    /// We dialed it.
    outbound: bool,
}

/// A relay we may reserve a slot on.
struct Candidate {
    peer: PeerId,
    /// Ends with `/p2p/<relay>`.
    addr: Multiaddr,
    next_try: Instant,
    failures: u32,
}

/// Handles waiting for a direct connection to one peer ([`EventLoop::connect_direct`]).
struct DirectWait {
    waiters: Vec<oneshot::Sender<Result<ConnPath, P2pError>>>,
    /// Where to dial the peer through its relay (empty: by peer id).
    via: Vec<Multiaddr>,
    /// Fresh relayed connections (fresh punches) left to try after a failed punch.
    retries: u8,
}

/// How long a relayed connection's hole punch may still be under way: a new one is not dialed
/// while an earlier one may succeed (two punches at once between the same ports collide, and
/// each side's dial then waits for the transport's timeout).
const PUNCH_WINDOW: Duration = Duration::from_secs(8);
/// Fresh punches [`EventLoop::connect_direct`] tries after a failed one.
const PUNCH_RETRIES: u8 = 1;

/// A reservation (pending or accepted) on one relay.
struct Reservation {
    relay: PeerId,
    /// Our circuit address there, once the relay accepted.
    addr: Option<Multiaddr>,
}

/// NAT state of the event loop.
pub(super) struct Nat {
    assume: Option<Reach>,
    want_reservations: usize,
    obs: Observations,
    class: Option<Reach>,
    confirmed: Vec<Multiaddr>,
    observed: Vec<Multiaddr>,
    conns: HashMap<ConnectionId, Conn>,
    /// Connections DCUtR reported before the swarm announced them.
    punched_early: HashSet<ConnectionId>,
    candidates: Vec<Candidate>,
    reservations: HashMap<ListenerId, Reservation>,
    direct_waiters: HashMap<PeerId, DirectWait>,
    /// When the node started, until its class is known or [`UNKNOWN_GRACE`] has passed.
    unknown_since: Option<Instant>,
    /// Peers with a relayed connection whose hole punch has not reported yet, and since when.
    punching: HashMap<PeerId, Instant>,
    /// Failed direct dials to peers we wait to punch to, since their punch began.
    failed_dials: HashMap<PeerId, u8>,
    reach_tx: watch::Sender<Reachability>,
    stats_tx: watch::Sender<NatStats>,
}

impl Nat {
    pub(super) fn new(config: &NatConfig) -> Self {
        let reach = Reachability {
            reach: config.assume,
            ..Reachability::default()
        };
        Self {
            assume: config.assume,
            want_reservations: config.relay_reservations,
            obs: Observations::default(),
            class: config.assume,
            confirmed: Vec::new(),
            observed: Vec::new(),
            conns: HashMap::new(),
            punched_early: HashSet::new(),
            candidates: Vec::new(),
            reservations: HashMap::new(),
            direct_waiters: HashMap::new(),
            unknown_since: config.assume.is_none().then(Instant::now),
            punching: HashMap::new(),
            failed_dials: HashMap::new(),
            reach_tx: watch::Sender::new(reach),
            stats_tx: watch::Sender::new(NatStats::default()),
        }
    }

    pub(super) fn watches(&self) -> (watch::Receiver<Reachability>, watch::Receiver<NatStats>) {
        (self.reach_tx.subscribe(), self.stats_tx.subscribe())
    }

    pub(super) fn is_relay_listener(&self, id: ListenerId) -> bool {
        self.reservations.contains_key(&id)
    }

    pub(super) fn paths(&self, peer: &PeerId) -> Vec<ConnPath> {
        self.conns
            .values()
            .filter(|c| &c.peer == peer)
            .map(|c| c.path)
            .collect()
    }

    fn direct_path(&self, peer: &PeerId) -> Option<ConnPath> {
        self.conns
            .values()
            .filter(|c| &c.peer == peer && !c.path.relayed)
            // A punched connection says more than one that happens to exist.
            .max_by_key(|c| c.path.punched)
            .map(|c| c.path)
    }

    pub(super) fn add_relay_candidates(&mut self, addrs: Vec<Multiaddr>) {
        for addr in addrs {
            if let Some(Protocol::P2p(peer)) = addr.iter().last()
                && !is_relayed(&addr)
            {
                self.add_candidate(peer, addr);
            }
        }
    }

    fn add_candidate(&mut self, peer: PeerId, addr: Multiaddr) {
        if let Some(c) = self.candidates.iter_mut().find(|c| c.peer == peer) {
            c.addr = addr;
            return;
        }
        if self.candidates.len() == MAX_RELAY_CANDIDATES {
            // Forget the one that failed most.
            if let Some(worst) =
                (0..self.candidates.len()).max_by_key(|&i| self.candidates[i].failures)
            {
                self.candidates.swap_remove(worst);
            }
        }
        self.candidates.push(Candidate {
            peer,
            addr,
            next_try: Instant::now(),
            failures: 0,
        });
    }

    pub(super) fn on_listen_addr(&mut self, addr: &Multiaddr) {
        if let Some(ip) = ip_of(addr)
            && !self.obs.own_ips.contains(&ip)
        {
            self.obs.own_ips.push(ip);
        }
    }

    pub(super) fn on_expired_addr(&mut self, addr: &Multiaddr) {
        if let Some(ip) = ip_of(addr) {
            self.obs.own_ips.retain(|i| *i != ip);
        }
    }

    fn bump(&self, count: impl FnOnce(&mut NatStats) -> &mut u64) {
        self.stats_tx.send_modify(|s| *count(s) += 1);
    }

    fn publish(&self) {
        let relayed: Vec<Multiaddr> = self
            .reservations
            .values()
            .filter_map(|r| r.addr.clone())
            .collect();
        let reach = Reachability {
            reach: self.class,
            confirmed: self.confirmed.clone(),
            observed: self.observed.clone(),
            relayed,
            port_preserving: self.obs.seen.iter().any(|s| s.port == s.local_port),
        };
        self.reach_tx.send_if_modified(|r| {
            let changed = *r != reach;
            *r = reach;
            changed
        });
    }

    /// Answers and clears the waiters for a direct connection to `peer`.
    fn answer_direct(&mut self, peer: &PeerId, result: Result<ConnPath, P2pError>) {
        self.failed_dials.remove(peer);
        if let Some(wait) = self.direct_waiters.remove(peer) {
            for w in wait.waiters {
                let _ = w.send(result.clone());
            }
        }
    }

    /// Whether a hole punch with `peer` may still be under way.
    fn punch_under_way(&self, peer: &PeerId) -> bool {
        self.punching
            .get(peer)
            .is_some_and(|since| since.elapsed() < PUNCH_WINDOW)
    }

    pub(super) fn shutdown(&mut self) {
        for (_, wait) in self.direct_waiters.drain() {
            for w in wait.waiters {
                let _ = w.send(Err(P2pError::Shutdown));
            }
        }
    }
}

impl EventLoop {
    /// Re-derives the class; on a change, switches Kademlia's mode and tells the watchers.
    fn reclassify(&mut self) {
        let class = self.nat.assume.or_else(|| reach::classify(&self.nat.obs));
        if class != self.nat.class {
            tracing::info!(
                reach = class.map_or("unknown", Reach::name),
                observed = ?self.nat.observed,
                "reachability changed"
            );
            self.nat.class = class;
            if self.kad_mode_follows_reach() {
                let mode = match class.unwrap_or_default() {
                    Reach::Public => kad::Mode::Server,
                    Reach::Punchable | Reach::Private => kad::Mode::Client,
                };
                self.swarm.behaviour_mut().kad.set_mode(Some(mode));
            }
        }
        self.nat.publish();
    }

    /// Once a second: keep the wanted number of relay reservations while not public, drop them
    /// once public.
    pub(super) fn nat_tick(&mut self) {
        if self.nat.class.is_some() {
            self.nat.unknown_since = None;
        } else if self
            .nat
            .unknown_since
            .is_some_and(|since| since.elapsed() >= UNKNOWN_GRACE)
        {
            self.nat.unknown_since = None;
            if self.kad_mode_follows_reach() {
                tracing::info!("reachability still unknown: serving the DHT as a public node");
                self.swarm
                    .behaviour_mut()
                    .kad
                    .set_mode(Some(kad::Mode::Server));
            }
        }
        let class = self.nat.class.unwrap_or_default();
        if class == Reach::Public {
            let ids: Vec<ListenerId> = self.nat.reservations.keys().copied().collect();
            for id in ids {
                self.swarm.remove_listener(id);
            }
            return;
        }
        let now = Instant::now();
        while self.nat.reservations.len() < self.nat.want_reservations {
            let taken: HashSet<PeerId> = self.nat.reservations.values().map(|r| r.relay).collect();
            let me = *self.swarm.local_peer_id();
            let Some(c) = self
                .nat
                .candidates
                .iter_mut()
                .filter(|c| c.peer != me && !taken.contains(&c.peer) && c.next_try <= now)
                .min_by_key(|c| (c.failures, c.next_try))
            else {
                return;
            };
            // Tried again only after a backoff, whatever happens to this attempt.
            c.next_try = now + RELAY_BACKOFF * 2u32.pow(c.failures.min(6));
            let addr = c.addr.clone().with(Protocol::P2pCircuit);
            let relay = c.peer;
            match self.swarm.listen_on(addr.clone()) {
                Ok(id) => {
                    tracing::debug!(%relay, "asking for a relay reservation");
                    self.nat
                        .reservations
                        .insert(id, Reservation { relay, addr: None });
                }
                Err(error) => {
                    tracing::debug!(%addr, %error, "cannot listen through the relay");
                    c.failures += 1;
                }
            }
        }
    }

    /// The relay accepted: `addr` is our circuit address there.
    pub(super) fn on_relay_address(&mut self, id: ListenerId, addr: Multiaddr) {
        let me = *self.swarm.local_peer_id();
        let addr = if matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
            addr
        } else {
            addr.with(Protocol::P2p(me))
        };
        if let Some(r) = self.nat.reservations.get_mut(&id) {
            tracing::info!(relay = %r.relay, %addr, "reachable through a relay");
            r.addr = Some(addr);
            if let Some(c) = self.nat.candidates.iter_mut().find(|c| c.peer == r.relay) {
                c.failures = 0;
            }
        }
        self.nat.publish();
    }

    pub(super) fn on_listener_closed(
        &mut self,
        id: ListenerId,
        reason: Result<(), impl std::fmt::Display>,
    ) {
        let Some(r) = self.nat.reservations.remove(&id) else {
            return;
        };
        self.nat.bump(|s| &mut s.reservations_lost);
        match reason {
            Ok(()) => tracing::info!(relay = %r.relay, "relay reservation closed"),
            Err(error) => tracing::info!(relay = %r.relay, %error, "relay reservation lost"),
        }
        if let Some(c) = self.nat.candidates.iter_mut().find(|c| c.peer == r.relay) {
            c.failures += 1;
        }
        self.nat.publish();
        // Look for another relay at once rather than at the next tick.
        self.nat_tick();
    }

    pub(super) fn on_connection(
        &mut self,
        peer: PeerId,
        id: ConnectionId,
        endpoint: &ConnectedPoint,
    ) {
        let remote = endpoint.get_remote_address().clone();
        let relayed = endpoint.is_relayed();
        let reused_port = matches!(
            endpoint,
            ConnectedPoint::Dialer {
                port_use: PortUse::Reuse,
                ..
            }
        ) && !relayed;
        // Nobody can dial a node behind a NAT: a direct connection it did not dial (QUIC's
        // punch makes one on the side whose dial lost) was made by a hole punch too.
        let nated = matches!(self.nat.class, Some(Reach::Punchable | Reach::Private));
        let punched =
            self.nat.punched_early.remove(&id) || (nated && !relayed && !endpoint.is_dialer());
        let path = ConnPath {
            relayed,
            punched,
            transport: transport_of(&remote),
        };
        self.nat.conns.insert(
            id,
            Conn {
                peer,
                path,
                reused_port,
                remote,
                outbound: endpoint.is_dialer(),
            },
        );
        if relayed {
            self.one_relayed_connection(peer);
            // DCUtR starts on every relayed connection (the side it reaches begins).
            self.nat.punching.entry(peer).or_insert_with(Instant::now);
        } else if self.nat.direct_waiters.contains_key(&peer) {
            self.close_relayed(&peer);
            self.nat.answer_direct(&peer, Ok(path));
        }
    }

    pub(super) fn on_connection_closed(&mut self, peer: PeerId, id: ConnectionId) {
        let closed = self.nat.conns.remove(&id);
        self.nat.punched_early.remove(&id);
        let relayed_left = self
            .nat
            .conns
            .values()
            .any(|c| c.peer == peer && c.path.relayed);
        if relayed_left {
            return;
        }
        self.nat.punching.remove(&peer);
        // The relayed connection whose punch someone waited for is gone (closed as a second
        // one, or its relay went away): punch anew rather than wait for a punch that died.
        if closed.is_some_and(|c| c.path.relayed)
            && self.nat.direct_waiters.contains_key(&peer)
            && self.nat.direct_path(&peer).is_none()
        {
            self.punch_anew(peer);
        }
    }

    /// Keeps at most one relayed connection to `peer`. DCUtR starts a hole punch on every
    /// relayed connection, and two punches between the same pair at once collide (both use
    /// the same ports, and the connection that forms pairs two sessions whose roles disagree:
    /// its handshake stalls until the transport's timeout). Two relayed connections appear
    /// when both peers dial each other at once; both sides then keep the one the smaller peer
    /// id dialed (the older one if that dialed both), so they agree without talking, and close
    /// the others at once, before their punches begin (DCUtR first measures a round trip
    /// through the relay).
    fn one_relayed_connection(&mut self, peer: PeerId) {
        let me = *self.swarm.local_peer_id();
        let smaller_dials_out = me < peer;
        let relayed: Vec<(ConnectionId, bool)> = self
            .nat
            .conns
            .iter()
            .filter(|(_, c)| c.peer == peer && c.path.relayed)
            .map(|(id, c)| (*id, c.outbound))
            .collect();
        if relayed.len() < 2 {
            return;
        }
        // Connection ids grow with time: the smallest is the oldest.
        let keep = relayed
            .iter()
            .filter(|(_, outbound)| *outbound == smaller_dials_out)
            .map(|(id, _)| *id)
            .min()
            .or_else(|| relayed.iter().map(|(id, _)| *id).min());
        for (id, _) in relayed {
            if Some(id) != keep {
                tracing::debug!(%peer, "closing a second relayed connection");
                self.swarm.close_connection(id);
            }
        }
    }

    /// Closes every relayed connection to `peer`.
    fn close_relayed(&mut self, peer: &PeerId) {
        let relayed: Vec<ConnectionId> = self
            .nat
            .conns
            .iter()
            .filter(|(_, c)| &c.peer == peer && c.path.relayed)
            .map(|(id, _)| *id)
            .collect();
        for id in relayed {
            tracing::debug!(%peer, "closing a relayed connection: a direct one exists");
            self.swarm.close_connection(id);
        }
    }

    pub(super) fn connect_direct(
        &mut self,
        peer: PeerId,
        via: Vec<Multiaddr>,
        reply: oneshot::Sender<Result<ConnPath, P2pError>>,
    ) {
        if let Some(path) = self.nat.direct_path(&peer) {
            self.close_relayed(&peer);
            let _ = reply.send(Ok(path));
            return;
        }
        let wait = self
            .nat
            .direct_waiters
            .entry(peer)
            .or_insert_with(|| DirectWait {
                waiters: Vec::new(),
                via: Vec::new(),
                retries: PUNCH_RETRIES,
            });
        wait.waiters.retain(|w| !w.is_closed());
        let first = wait.waiters.is_empty();
        wait.waiters.push(reply);
        if !via.is_empty() {
            wait.via = via;
        }
        if !first || self.nat.punch_under_way(&peer) {
            // A dial or a punch for this peer is under way: its outcome answers us.
            return;
        }
        self.punch_anew(peer);
    }

    /// Starts a fresh hole punch with `peer`: closes relayed connections whose punch is over,
    /// and dials the peer through its relay (the addresses its waiters gave), or by peer id.
    /// Only through the relay addresses: dialing the peer's other addresses (private ones, or
    /// its NAT's, which drops the dial) only waits.
    fn punch_anew(&mut self, peer: PeerId) {
        let via = self
            .nat
            .direct_waiters
            .get(&peer)
            .map(|w| w.via.clone())
            .unwrap_or_default();
        let connected = self.nat.conns.values().any(|c| c.peer == peer);
        if !connected && via.is_empty() {
            // Not connected and no relay known: the usual dial (routing table, DHT lookup); a
            // dial failure for this peer fails the waiters (`on_dial_failed`).
            let (tx, _rx) = oneshot::channel();
            self.connect(peer, tx);
            return;
        }
        self.close_relayed(&peer);
        self.nat.punching.remove(&peer);
        self.nat.failed_dials.remove(&peer);
        let opts = DialOpts::peer_id(peer).condition(PeerCondition::Always);
        let opts = if via.is_empty() {
            opts.build()
        } else {
            opts.addresses(via).build()
        };
        if let Err(error) = self.swarm.dial(opts) {
            self.nat.answer_direct(
                &peer,
                Err(P2pError::NoDirectConnection {
                    peer,
                    detail: error.to_string(),
                }),
            );
        }
    }

    /// A dial to `peer` failed (`direct`: only direct addresses were tried): fail its direct
    /// waiters unless some connection exists; while we wait to punch to it, the
    /// [`PUNCH_DIALS`]th failed direct dial counts as a failed punch (the side that dials as
    /// DCUtR's dialer hears of no failure otherwise, and would wait for its whole timeout).
    pub(super) fn on_dial_failed(&mut self, peer: PeerId, error: &str, direct: bool) {
        if !self.nat.direct_waiters.contains_key(&peer) {
            return;
        }
        if !self.nat.conns.values().any(|c| c.peer == peer) {
            self.nat.answer_direct(
                &peer,
                Err(P2pError::NoDirectConnection {
                    peer,
                    detail: error.to_owned(),
                }),
            );
            return;
        }
        if !direct || self.nat.direct_path(&peer).is_some() {
            return;
        }
        let failed = self.nat.failed_dials.entry(peer).or_default();
        *failed += 1;
        if *failed >= PUNCH_DIALS {
            self.nat.failed_dials.remove(&peer);
            self.punch_failed(peer, &format!("{PUNCH_DIALS} direct dials failed: {error}"));
        }
    }

    /// A hole punch with `peer` failed: punch once more through a fresh relayed connection if
    /// its waiters have retries left, else fail them.
    fn punch_failed(&mut self, peer: PeerId, error: &str) {
        self.nat.punching.remove(&peer);
        tracing::info!(%peer, %error, "hole punch failed");
        if self.nat.direct_path(&peer).is_some() {
            return;
        }
        let retry = match self.nat.direct_waiters.get_mut(&peer) {
            Some(wait) if wait.retries > 0 => {
                wait.retries -= 1;
                true
            }
            _ => false,
        };
        if retry {
            tracing::debug!(%peer, "punching again through a fresh relayed connection");
            self.punch_anew(peer);
        } else {
            self.nat.answer_direct(
                &peer,
                Err(P2pError::NoDirectConnection {
                    peer,
                    detail: format!("hole punch failed: {error}"),
                }),
            );
        }
    }

    pub(super) fn on_identify(&mut self, peer: PeerId, id: ConnectionId, info: &identify::Info) {
        let Some(conn) = self.nat.conns.get(&id) else {
            return;
        };
        let (relayed, outbound, reused_port, remote) = (
            conn.path.relayed,
            conn.outbound,
            conn.reused_port,
            conn.remote.clone(),
        );
        // A relay we could reserve a slot on: where we reached it, or where it listens.
        if info.protocols.contains(&StreamProtocol::new(HOP_PROTOCOL)) && !relayed {
            let addr = if outbound {
                Some(without_peer_id(&remote))
            } else {
                let remote_ip = ip_of(&remote);
                let direct = || info.listen_addrs.iter().filter(|a| !is_relayed(a));
                direct()
                    .find(|a| ip_of(a) == remote_ip)
                    .or_else(|| direct().next())
                    .map(without_peer_id)
            };
            if let Some(addr) = addr {
                self.nat.add_candidate(peer, addr.with(Protocol::P2p(peer)));
            }
        }
        // How the peer sees our connection, if we dialed it from our listening port.
        let observed = &info.observed_addr;
        if !reused_port || is_relayed(observed) {
            return;
        }
        let (Some(remote), Some(ip), Some(port)) =
            (ip_of(&remote), ip_of(observed), port_of(observed))
        else {
            return;
        };
        let transport = transport_of(observed);
        let Some(local_port) = self
            .listen_addrs()
            .iter()
            .filter(|a| transport_of(a) == transport && !is_relayed(a))
            .find_map(port_of)
        else {
            return;
        };
        self.nat.obs.add(Seen {
            remote,
            local_port,
            ip,
            port,
        });
        if port == local_port {
            self.port_preserved_candidates(ip);
        }
        push_bounded(&mut self.nat.observed, without_peer_id(observed));
        self.reclassify();
    }

    /// Our NAT kept a listening port: it keeps the others too, so every listen address of ours
    /// is reachable (after a punch) at the observed `ip` with its own port. Announced as
    /// candidates ([`super::candidates`]): DCUtR then punches over QUIC too where identify only
    /// ever saw our TCP address, and a UDP mapping survives a router's ICMP error where TCP's
    /// dies of a reset.
    fn port_preserved_candidates(&mut self, ip: IpAddr) {
        let candidates: Vec<Multiaddr> = self
            .listen_addrs()
            .iter()
            .filter(|a| !is_relayed(a) && ip_of(a).is_some_and(|own| own != ip))
            .map(|a| {
                a.iter()
                    .map(|p| match p {
                        Protocol::Ip4(_) | Protocol::Ip6(_) => Protocol::from(ip),
                        other => other,
                    })
                    .filter(|p| !matches!(p, Protocol::P2p(_)))
                    .collect()
            })
            .collect();
        for addr in candidates {
            self.swarm.behaviour_mut().candidates.push(addr);
        }
    }

    pub(super) fn on_external_confirmed(&mut self, addr: Multiaddr) {
        // The relay client confirms our circuit addresses; those say nothing about us.
        if is_relayed(&addr) {
            return;
        }
        tracing::info!(%addr, "external address confirmed");
        push_bounded(&mut self.nat.confirmed, addr);
        self.nat.obs.confirmed = true;
        self.reclassify();
    }

    pub(super) fn on_external_expired(&mut self, addr: &Multiaddr) {
        self.nat.confirmed.retain(|a| a != addr);
        self.nat.obs.confirmed = !self.nat.confirmed.is_empty();
        self.reclassify();
    }

    pub(super) fn on_autonat(&mut self, event: autonat::v2::client::Event) {
        match &event.result {
            Ok(()) => {
                tracing::debug!(addr = %event.tested_addr, server = %event.server, "dial-back worked")
            }
            Err(error) => {
                tracing::debug!(addr = %event.tested_addr, server = %event.server, %error, "dial-back failed");
                // Only a failure at one of our own addresses says something (a firewall);
                // candidates at other addresses are what a NAT mapped, or junk.
                if ip_of(&event.tested_addr).is_some_and(|ip| self.nat.obs.own_ips.contains(&ip))
                    && !is_relayed(&event.tested_addr)
                {
                    self.nat.obs.dial_back_failures += 1;
                    self.reclassify();
                }
            }
        }
    }

    pub(super) fn on_relay_client(&mut self, event: relay::client::Event) {
        match event {
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            } => {
                if !renewal {
                    self.nat.bump(|s| &mut s.reservations);
                }
                tracing::debug!(relay = %relay_peer_id, renewal, "relay reservation accepted");
            }
            other => tracing::debug!(event = ?other, "relay client"),
        }
    }

    pub(super) fn on_dcutr(&mut self, event: dcutr::Event) {
        let peer = event.remote_peer_id;
        match event.result {
            Ok(id) => {
                self.nat.bump(|s| &mut s.punch_ok);
                self.nat.punching.remove(&peer);
                match self.nat.conns.get_mut(&id) {
                    Some(c) => c.path.punched = true,
                    None => {
                        self.nat.punched_early.insert(id);
                    }
                }
                tracing::info!(%peer, "hole punch made a direct connection");
                if let Some(path) = self.nat.direct_path(&peer)
                    && self.nat.direct_waiters.contains_key(&peer)
                {
                    self.close_relayed(&peer);
                    self.nat.answer_direct(&peer, Ok(path));
                }
            }
            Err(error) => {
                self.nat.bump(|s| &mut s.punch_failed);
                if self.nat.punching.contains_key(&peer)
                    || !self.nat.direct_waiters.contains_key(&peer)
                {
                    self.punch_failed(peer, &error.to_string());
                } else {
                    // Its failed dials told us first, and a fresh punch is under way.
                    tracing::debug!(%peer, %error, "hole punch failed (handled already)");
                }
            }
        }
    }
}
