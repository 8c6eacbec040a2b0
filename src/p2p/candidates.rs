//! A behaviour that hands the swarm external address candidates we derive ourselves
//! ([`Candidates::push`]); every behaviour hears them as `NewExternalAddrCandidate`, DCUtR
//! included, which offers its candidates to the peer it hole punches with.
//!
//! Why: identify tells us the address a peer sees only for the transport we reached it on,
//! usually TCP (bootstrap and relay nodes often listen on TCP alone). DCUtR then has TCP
//! candidates only, and a TCP punch dies on routers that answer an early SYN with a reset
//! (the reset also closes the sender's own mapping). A UDP mapping survives the ICMP error
//! such a router sends, so QUIC punches where TCP cannot. Behind a port-preserving NAT our
//! QUIC endpoint is predictable: the observed IP with our QUIC listen port.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::task::{Context, Poll};

use libp2p::core::Endpoint;
use libp2p::core::transport::PortUse;
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{Multiaddr, PeerId};

/// Candidates queued at most (the oldest are dropped first).
const MAX_QUEUED: usize = 16;

/// See the module docs.
#[derive(Default)]
pub(super) struct Candidates {
    queue: VecDeque<Multiaddr>,
    /// Already announced (DCUtR keeps its own bounded list; no need to repeat).
    announced: Vec<Multiaddr>,
}

impl Candidates {
    /// Announces `addr` as an external address candidate (once).
    pub(super) fn push(&mut self, addr: Multiaddr) {
        if self.announced.contains(&addr) || self.queue.contains(&addr) {
            return;
        }
        if self.queue.len() == MAX_QUEUED {
            self.queue.pop_front();
        }
        self.queue.push_back(addr);
    }
}

impl NetworkBehaviour for Candidates {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, _: FromSwarm) {}

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Infallible, THandlerInEvent<Self>>> {
        match self.queue.pop_front() {
            Some(addr) => {
                if self.announced.len() == MAX_QUEUED {
                    self.announced.remove(0);
                }
                self.announced.push(addr.clone());
                Poll::Ready(ToSwarm::NewExternalAddrCandidate(addr))
            }
            None => Poll::Pending,
        }
    }
}
