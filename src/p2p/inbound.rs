//! Per-address shares of a node's inbound connections.
//!
//! A node bounds the inbound connections it holds in their handshake (pending) and
//! established ([`super::ConnectionLimits`]). A global bound alone hands the node's door to
//! whoever fills it: one address holding 128 silent handshakes kept every newcomer out of a
//! bootstrap node, the one door every volunteer uses, for as long as it kept dialing (issue 29,
//! attack 0). So each bound is also shared out by remote address: the source IPv4 address, or
//! the /64 of an IPv6 one (one subscriber's usual allocation), or for a relayed connection the
//! whole relayed address. The first half of each pool is free for anyone (a burst of local
//! processes joining one node passes while the node is not under pressure); past it, an
//! address holding its share is refused, so one address takes at most half of the pool plus
//! nothing, and every other address still finds room. A connection's slot is freed when its
//! handshake fails or times out ([`super::ConnectionLimits::handshake_timeout`]), when it is
//! refused (by any behaviour), or when it closes.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

use libp2p::core::Endpoint;
use libp2p::core::transport::PortUse;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    ConnectionClosed, ConnectionDenied, ConnectionId, FromSwarm, ListenFailure, NetworkBehaviour,
    THandler, THandlerInEvent, THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{Multiaddr, PeerId};

use crate::shares::{Refused, Share, Shares};

/// Whom a remote address's connections are counted against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum AddrKey {
    /// An IPv4 address.
    V4(std::net::Ipv4Addr),
    /// The first 64 bits of an IPv6 address.
    V6Net(u64),
    /// An address without an IP of its own (a relayed connection): the whole address.
    Other(Multiaddr),
}

impl AddrKey {
    /// The key of `remote` (a connection's send-back address).
    pub(crate) fn of(remote: &Multiaddr) -> Self {
        if remote.iter().any(|p| matches!(p, Protocol::P2pCircuit)) {
            return Self::Other(remote.clone());
        }
        let ip = remote.iter().find_map(|p| match p {
            Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
            Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
            _ => None,
        });
        match ip {
            Some(ip) => Self::of_ip(ip),
            None => Self::Other(remote.clone()),
        }
    }

    /// The key of a connection from `ip`: the IPv4 address (an IPv4-mapped IPv6 address
    /// counts as its IPv4 one), or the /64 of an IPv6 one.
    pub(crate) fn of_ip(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(ip) => Self::V4(ip),
            IpAddr::V6(ip) => Self::V6Net((ip.to_bits() >> 64) as u64),
        }
    }
}

/// An inbound connection refused for its address's share or for a full pool.
#[derive(Debug, thiserror::Error)]
#[error("inbound connection from {remote} refused ({stage}): {why}")]
pub(crate) struct InboundRefused {
    remote: Multiaddr,
    stage: &'static str,
    why: Refused,
}

/// The behaviour keeping the shares (module docs).
pub(crate) struct Behaviour {
    pending: Shares<AddrKey>,
    established: Shares<AddrKey>,
    held: HashMap<ConnectionId, Share<AddrKey>>,
}

impl Behaviour {
    /// Pools of `max_pending` handshakes and `max_established` established inbound
    /// connections, each address holding at most `per_address` pending and
    /// `per_address_established` established ones once half of a pool is in use.
    pub(crate) fn new(
        max_pending: usize,
        per_address: usize,
        max_established: usize,
        per_address_established: usize,
    ) -> Self {
        Self {
            pending: Shares::lenient(max_pending, per_address, max_pending / 2),
            established: Shares::lenient(
                max_established,
                per_address_established,
                max_established / 2,
            ),
            held: HashMap::new(),
        }
    }

    fn take(
        &mut self,
        pool: Pool,
        id: ConnectionId,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        let (shares, stage) = match pool {
            Pool::Pending => (&self.pending, "handshake"),
            Pool::Established => (&self.established, "established"),
        };
        // A connection moving from pending to established gives its handshake slot back first.
        self.held.remove(&id);
        match shares.try_take(AddrKey::of(remote)) {
            Ok(share) => {
                self.held.insert(id, share);
                Ok(())
            }
            Err(why) => {
                tracing::debug!(%remote, stage, %why, "inbound connection refused");
                Err(ConnectionDenied::new(InboundRefused {
                    remote: remote.clone(),
                    stage,
                    why,
                }))
            }
        }
    }

    /// Connections holding a slot now (pending and established).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.len()
    }
}

#[derive(Clone, Copy)]
enum Pool {
    Pending,
    Established,
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.take(Pool::Pending, connection_id, remote_addr)
    }

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _peer: PeerId,
        _local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.take(Pool::Established, connection_id, remote_addr)?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role_override: Endpoint,
        _port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ListenFailure(ListenFailure { connection_id, .. })
            | FromSwarm::ConnectionClosed(ConnectionClosed { connection_id, .. }) => {
                self.held.remove(&connection_id);
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _connection: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        libp2p::core::util::unreachable(event)
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn addresses_are_keyed_by_ip_and_ipv6_slash_64() {
        let k = |s| AddrKey::of(&addr(s));
        assert_eq!(k("/ip4/10.0.0.1/tcp/1"), k("/ip4/10.0.0.1/udp/9/quic-v1"));
        assert_ne!(k("/ip4/10.0.0.1/tcp/1"), k("/ip4/10.0.0.2/tcp/1"));
        assert_eq!(
            k("/ip6/2001:db8:1:2:aaaa::1/tcp/1"),
            k("/ip6/2001:db8:1:2:bbbb:cccc:dddd:eeee/tcp/2")
        );
        assert_ne!(
            k("/ip6/2001:db8:1:2::1/tcp/1"),
            k("/ip6/2001:db8:1:3::1/tcp/1")
        );
        // An IPv4-mapped IPv6 address is its IPv4 address.
        assert_eq!(k("/ip6/::ffff:10.0.0.1/tcp/1"), k("/ip4/10.0.0.1/tcp/1"));
        let relayed = "/ip4/10.0.0.1/tcp/1/p2p/12D3KooWGzh9HG2SQyj4G5ugPZbMMWMRAdaDpQkZn2KyKqZ7JzsJ/p2p-circuit";
        assert_ne!(k(relayed), k("/ip4/10.0.0.1/tcp/1"));
    }

    /// One address fills the free half of the handshake slots and then gets nothing more;
    /// other addresses still get their shares; a failed or closed connection frees its slot.
    #[test]
    fn one_address_cannot_take_every_handshake_slot() {
        let mut b = Behaviour::new(8, 2, 8, 2);
        let local = addr("/ip4/127.0.0.1/tcp/1");
        let flood = addr("/ip4/127.0.0.2/tcp/5");
        let mut ids = Vec::new();
        for _ in 0..4 {
            let id = ConnectionId::new_unchecked(ids.len());
            b.handle_pending_inbound_connection(id, &local, &flood)
                .unwrap();
            ids.push(id);
        }
        let id = ConnectionId::new_unchecked(100);
        assert!(
            b.handle_pending_inbound_connection(id, &local, &flood)
                .is_err()
        );
        for (i, honest) in ["/ip4/127.0.0.1/tcp/7", "/ip4/127.0.0.3/tcp/7"]
            .into_iter()
            .enumerate()
        {
            for j in 0..2 {
                let id = ConnectionId::new_unchecked(200 + 2 * i + j);
                b.handle_pending_inbound_connection(id, &local, &addr(honest))
                    .unwrap();
            }
        }
        assert_eq!(b.held(), 8);
        let late = addr("/ip4/127.0.0.4/tcp/7");
        assert!(
            b.handle_pending_inbound_connection(ConnectionId::new_unchecked(300), &local, &late)
                .is_err()
        );
        // A handshake that fails frees its slot.
        let error = libp2p::swarm::ListenError::Aborted;
        b.on_swarm_event(FromSwarm::ListenFailure(ListenFailure {
            local_addr: &local,
            send_back_addr: &flood,
            error: &error,
            connection_id: ids[0],
            peer_id: None,
        }));
        b.handle_pending_inbound_connection(ConnectionId::new_unchecked(301), &local, &late)
            .unwrap();
        // One that completes moves to the established pool.
        let peer = PeerId::random();
        b.handle_established_inbound_connection(ids[1], peer, &local, &flood)
            .unwrap();
        assert_eq!(b.held(), 8);
        assert!(b.pending.try_take(AddrKey::of(&late)).is_ok());
    }
}
