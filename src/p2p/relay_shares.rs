//! Per-address shares of a relay server's reservations and circuits.
//!
//! libp2p's relay server bounds reservations and circuits globally and per peer id
//! ([`super::RelayLimits`]), and rate-limits new ones per peer id and per IP address. Peer ids
//! cost nothing, so those bounds alone hand a relay to whoever makes enough identities: with the
//! default limits 32 identities on one machine held every one of 128 reservations, and 4 held
//! every one of 64 circuits, and no NATed peer could reserve a slot or be reached (issue 29,
//! attack 6). libp2p has no bound on what one address holds at once, so this module adds one,
//! keyed as inbound connections are ([`super::inbound::AddrKey`]: the IPv4 address or the IPv6
//! /64 of the connection a request arrives on): the first half of each pool is free for anyone
//! (several peers behind one NAT reserve on a quiet relay), and past it an address holding its
//! share gets nothing more ([`crate::shares::Shares::lenient`]).
//!
//! It plugs into libp2p through the only hook libp2p's relay offers for this, the
//! [`relay::RateLimiter`] that the server consults for each request that passed its own
//! bounds (the gate is the last limiter, so a request it admits is accepted). The gate takes
//! a share when it admits a request; the relay's events then say what became of the request,
//! without naming the connection, so the books follow them:
//!
//! * a request admitted holds its share as *pending* for at most [`ADMIT_TTL`] (libp2p's own
//!   stream timeouts end any negotiation well before), after which the share is freed: a
//!   request that failed frees its share then, whichever of libp2p's several failure events
//!   (or none) reported it;
//! * `ReservationReqAccepted` / `CircuitReqAccepted` move the source peer's oldest pending
//!   share to what it *holds* (a renewed reservation keeps the share it holds);
//! * `ReservationTimedOut` and `CircuitClosed` free one held share; libp2p reports
//!   `ReservationClosed` for every closed connection of a peer, reservation or not, so a
//!   reservation's share is freed when the peer's last connection closes (or it times out),
//!   and a peer's held reservation shares are bounded by libp2p's per-peer bound.
//!
//! A renewal from a peer whose address holds its share is admitted when the peer already holds a
//! reservation (libp2p does not tell the gate which requests are renewals).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::{Multiaddr, PeerId, relay};

use super::inbound::AddrKey;
use crate::shares::{Share, Shares};

/// How long an admitted request may wait for libp2p's verdict before its share is freed.
pub(super) const ADMIT_TTL: Duration = Duration::from_secs(30);

/// Requests of one peer admitted and waiting for libp2p's verdict, oldest first, with when
/// they were admitted; `None` for a renewal admitted without a share of its own.
type Pending = VecDeque<(Instant, Option<Share<AddrKey>>)>;

/// One pool (reservations or circuits) and what its shares are doing.
struct Ledger<K> {
    pool: Shares<AddrKey>,
    /// Admitted requests per source peer.
    pending: HashMap<PeerId, Pending>,
    /// Accepted reservations (per peer) or circuits (per source and destination).
    held: HashMap<K, Vec<Share<AddrKey>>>,
    /// Held shares one key keeps at most (older ones are freed first).
    max_held: usize,
}

impl<K: std::hash::Hash + Eq> Ledger<K> {
    fn new(total: usize, per_address: usize, max_held: usize) -> Self {
        Self {
            pool: Shares::lenient(total, per_address, total / 2),
            pending: HashMap::new(),
            held: HashMap::new(),
            max_held: max_held.max(1),
        }
    }

    fn expire(&mut self, now: Instant) {
        self.pending.retain(|_, queue| {
            while queue
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= ADMIT_TTL)
            {
                queue.pop_front();
            }
            !queue.is_empty()
        });
    }

    /// Admits a request of `peer` from `addr` (taking a share), or a renewal (`renewal_of`
    /// holds a share already).
    fn admit(
        &mut self,
        peer: PeerId,
        addr: &Multiaddr,
        renewal_of: Option<&K>,
        now: Instant,
    ) -> bool {
        self.expire(now);
        let share = match self.pool.try_take(AddrKey::of(addr)) {
            Ok(share) => Some(share),
            Err(why) => {
                if renewal_of.is_some_and(|k| self.held.get(k).is_some_and(|h| !h.is_empty())) {
                    None
                } else {
                    tracing::debug!(%peer, %addr, %why, "relay request refused (address share)");
                    return false;
                }
            }
        };
        self.pending
            .entry(peer)
            .or_default()
            .push_back((now, share));
        true
    }

    /// The oldest pending request of `peer` was accepted; `keep` says whether its share is
    /// held under `key` (else it is freed).
    fn accepted(&mut self, peer: &PeerId, key: K, keep: bool) {
        let Some(queue) = self.pending.get_mut(peer) else {
            return;
        };
        let share = queue.pop_front().and_then(|(_, s)| s);
        if queue.is_empty() {
            self.pending.remove(peer);
        }
        if let (true, Some(share)) = (keep, share) {
            let held = self.held.entry(key).or_default();
            if held.len() >= self.max_held {
                held.remove(0);
            }
            held.push(share);
        }
    }

    /// One held share of `key` is freed.
    fn release_one(&mut self, key: &K) {
        if let Some(held) = self.held.get_mut(key) {
            held.pop();
            if held.is_empty() {
                self.held.remove(key);
            }
        }
    }
}

struct Books {
    reservations: Ledger<PeerId>,
    circuits: Ledger<(PeerId, PeerId)>,
}

/// The shares of one relay server (module docs). Cheap to clone: clones share the books; the
/// gates ([`RelayShares::reservation_gate`], [`RelayShares::circuit_gate`]) go into libp2p's
/// relay configuration, and the event loop reports the relay's events
/// ([`RelayShares::on_event`]) and closed peers ([`RelayShares::on_peer_gone`]).
#[derive(Clone)]
pub(super) struct RelayShares {
    books: Arc<Mutex<Books>>,
}

impl RelayShares {
    /// Books for `limits`.
    pub(super) fn new(limits: &super::RelayLimits) -> Self {
        Self {
            books: Arc::new(Mutex::new(Books {
                // libp2p lets a peer hold one more than its bound (it refuses past `>`).
                reservations: Ledger::new(
                    limits.max_reservations,
                    limits.max_reservations_per_address,
                    limits.max_reservations_per_peer + 1,
                ),
                circuits: Ledger::new(
                    limits.max_circuits,
                    limits.max_circuits_per_address,
                    limits.max_circuits_per_peer + 1,
                ),
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a reservation request of `peer` arriving from `addr` is admitted.
    pub(super) fn admit_reservation(&self, peer: PeerId, addr: &Multiaddr, now: Instant) -> bool {
        self.lock().reservations.admit(peer, addr, Some(&peer), now)
    }

    /// Whether a circuit request of `src` arriving from `addr` is admitted.
    pub(super) fn admit_circuit(&self, src: PeerId, addr: &Multiaddr, now: Instant) -> bool {
        self.lock().circuits.admit(src, addr, None, now)
    }

    /// The reservation gate for libp2p's relay configuration.
    pub(super) fn reservation_gate(&self) -> Box<dyn relay::RateLimiter> {
        let shares = self.clone();
        Box::new(move |peer, addr: &Multiaddr, now| shares.admit_reservation(peer, addr, now))
    }

    /// The circuit gate for libp2p's relay configuration.
    pub(super) fn circuit_gate(&self) -> Box<dyn relay::RateLimiter> {
        let shares = self.clone();
        Box::new(move |peer, addr: &Multiaddr, now| shares.admit_circuit(peer, addr, now))
    }

    /// Follows one event of the relay server.
    pub(super) fn on_event(&self, event: &relay::Event) {
        let mut books = self.lock();
        match event {
            relay::Event::ReservationReqAccepted {
                src_peer_id,
                renewed,
            } => books
                .reservations
                .accepted(src_peer_id, *src_peer_id, !renewed),
            relay::Event::ReservationTimedOut { src_peer_id } => {
                books.reservations.release_one(src_peer_id)
            }
            relay::Event::CircuitReqAccepted {
                src_peer_id,
                dst_peer_id,
            } => books
                .circuits
                .accepted(src_peer_id, (*src_peer_id, *dst_peer_id), true),
            relay::Event::CircuitClosed {
                src_peer_id,
                dst_peer_id,
                ..
            } => books.circuits.release_one(&(*src_peer_id, *dst_peer_id)),
            _ => {}
        }
    }

    /// `peer`'s last connection closed: its reservations (and pending requests) are gone.
    pub(super) fn on_peer_gone(&self, peer: &PeerId) {
        let mut books = self.lock();
        books.reservations.held.remove(peer);
        books.reservations.pending.remove(peer);
        books.circuits.pending.remove(peer);
    }

    /// Reservation shares in use (pending and held).
    #[cfg(test)]
    fn reservations_in_use(&self) -> usize {
        self.lock().reservations.pool.in_use()
    }

    /// Circuit shares in use (pending and held).
    #[cfg(test)]
    fn circuits_in_use(&self) -> usize {
        self.lock().circuits.pool.in_use()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::p2p::RelayLimits;

    fn addr(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    fn limits() -> RelayLimits {
        RelayLimits {
            max_reservations: 8,
            max_reservations_per_peer: 1,
            max_reservations_per_address: 2,
            max_circuits: 8,
            max_circuits_per_peer: 4,
            max_circuits_per_address: 2,
            ..RelayLimits::default()
        }
    }

    /// Sybil identities on one address get the free half of the reservations and then nothing;
    /// another address still reserves; a sybil's renewal passes; freed shares come back.
    #[test]
    fn sybils_on_one_address_leave_reservations_to_others() {
        let shares = RelayShares::new(&limits());
        let now = Instant::now();
        let flood = addr("/ip4/127.0.0.2/tcp/5");
        let sybils: Vec<PeerId> = (0..16).map(|_| PeerId::random()).collect();
        let mut admitted = Vec::new();
        for s in &sybils {
            if shares.admit_reservation(*s, &flood, now) {
                shares.on_event(&relay::Event::ReservationReqAccepted {
                    src_peer_id: *s,
                    renewed: false,
                });
                admitted.push(*s);
            }
        }
        assert_eq!(
            admitted.len(),
            4,
            "the free half, then the address's share is spent"
        );
        assert_eq!(shares.reservations_in_use(), 4);
        // A renewal of a sybil that holds one passes and takes nothing more.
        assert!(shares.admit_reservation(admitted[0], &flood, now));
        shares.on_event(&relay::Event::ReservationReqAccepted {
            src_peer_id: admitted[0],
            renewed: true,
        });
        for i in 0..2 {
            let honest = PeerId::random();
            assert!(shares.admit_reservation(
                honest,
                &addr(&format!("/ip4/127.0.0.1/udp/{i}/quic-v1")),
                now
            ));
            shares.on_event(&relay::Event::ReservationReqAccepted {
                src_peer_id: honest,
                renewed: false,
            });
        }
        assert_eq!(shares.reservations_in_use(), 6);
        // A sybil's reservation that times out or whose peer leaves frees its share.
        shares.on_event(&relay::Event::ReservationTimedOut {
            src_peer_id: admitted[1],
        });
        shares.on_peer_gone(&admitted[2]);
        assert_eq!(shares.reservations_in_use(), 4);
    }

    /// Circuits from one address are bounded the same way; a request that never gets a
    /// verdict frees its share after the admission TTL; a closed circuit frees its share.
    #[test]
    fn sybil_circuits_are_bounded_per_address_and_failed_requests_expire() {
        let shares = RelayShares::new(&limits());
        let now = Instant::now();
        let flood = addr("/ip6/2001:db8:1:2::5/udp/1/quic-v1");
        let dst = PeerId::random();
        let mut open = Vec::new();
        for i in 0..16u16 {
            let src = PeerId::random();
            // Each sybil on its own address of the same /64.
            let from = addr(&format!("/ip6/2001:db8:1:2::{i:x}/udp/1/quic-v1"));
            if shares.admit_circuit(src, &from, now) {
                shares.on_event(&relay::Event::CircuitReqAccepted {
                    src_peer_id: src,
                    dst_peer_id: dst,
                });
                open.push(src);
            }
        }
        assert_eq!(open.len(), 4);
        assert!(!shares.admit_circuit(PeerId::random(), &flood, now));
        let honest = PeerId::random();
        assert!(shares.admit_circuit(honest, &addr("/ip4/10.0.0.1/tcp/1"), now));
        // No verdict for the honest request: its share is freed after the TTL.
        assert_eq!(shares.circuits_in_use(), 5);
        let later = now + ADMIT_TTL;
        assert!(shares.admit_circuit(honest, &addr("/ip4/10.0.0.1/tcp/1"), later));
        assert_eq!(shares.circuits_in_use(), 5);
        shares.on_event(&relay::Event::CircuitClosed {
            src_peer_id: open[0],
            dst_peer_id: dst,
            error: None,
        });
        assert_eq!(shares.circuits_in_use(), 4);
    }
}
