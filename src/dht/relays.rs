//! The relay directory: relay servers announce themselves in the DHT, and nodes that are not
//! publicly reachable look there for relays to reserve a slot on (next to the relays they meet
//! directly: every peer speaking the relay protocol is a candidate, see `crate::p2p`).
//!
//! Key [`RELAYS_KEY`], subkey = the relay's own owner subkey (signed: nobody announces a relay
//! for someone else), value = its address list ([`super::encode_addrs`]: the addresses that
//! dial-backs confirmed), expiration [`ANNOUNCE_TTL`] ahead, re-written every
//! [`ANNOUNCE_EVERY`] once a dial-back confirmed an address (libp2p's relay server refuses
//! reservations until it knows an external address of its own). A
//! reader takes every live entry, skips malformed ones and its own, and hands the addresses
//! (with `/p2p/<relay>`) to the p2p layer as relay candidates.
//!
//! One announcement must not supply every candidate (issue 29, attack 6: a peer announcing 16
//! addresses filled the whole lookup, so no other relay was ever tried). [`choose_relays`] takes
//! at most [`MAX_ADDRS_PER_RELAY`] addresses per relay, puts the relays this node has seen
//! working (a reservation there was accepted) first, and the others in random order (an
//! announcer cannot come first by grinding a peer id that sorts first), up to
//! [`MAX_LOOKUP_RELAYS`] addresses in all.

use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use rand::seq::SliceRandom;
use tokio::task::JoinHandle;

use super::{Dht, DhtTime, decode_addrs, encode_addrs};
use crate::reach::Reach;

/// The DHT key of the relay directory: the [owned key](super::owned_key) `_hivemesh.relays`.
pub const RELAYS_KEY: &[u8] = b"\xffowned:_hivemesh.relays";
/// How long an announcement lives.
pub const ANNOUNCE_TTL: Duration = Duration::from_secs(180);
/// How often a relay re-announces itself.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(60);
/// How often a node without a relay looks the directory up.
pub const LOOKUP_EVERY: Duration = Duration::from_secs(10);
/// Most relay addresses taken from one lookup.
pub const MAX_LOOKUP_RELAYS: usize = 16;
/// Most addresses taken from one relay's announcement.
pub const MAX_ADDRS_PER_RELAY: usize = 2;
/// Relays a node remembers as seen working.
const MAX_WORKED: usize = 64;

/// A node's part in the relay directory: announcing itself if it serves as a relay, looking up
/// relays while it is not public and has no reservation. Stops when dropped.
#[derive(Debug)]
pub struct RelayDirectory {
    task: JoinHandle<()>,
}

impl RelayDirectory {
    /// Starts it on `dht`; `serves_relay`: this node runs a relay server.
    pub fn start(dht: Dht, serves_relay: bool) -> Self {
        Self {
            task: tokio::spawn(run(dht, serves_relay)),
        }
    }

    /// Stops it and waits for its task.
    pub async fn shutdown(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for RelayDirectory {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The relays announced in `dht` (addresses ending with `/p2p/<relay>`), chosen by
/// [`choose_relays`] with `worked` the relays this node has seen working, this node's own
/// announcement left out.
pub async fn lookup_relays(
    dht: &Dht,
    worked: &[PeerId],
) -> Result<Vec<Multiaddr>, super::DhtError> {
    let me = dht.p2p().peer_id();
    let value = dht.get(RELAYS_KEY).await?;
    let announced = value
        .iter()
        .flat_map(|v| v.owner_entries())
        .filter_map(|(peer, entry)| Some((peer, decode_addrs(&entry.value)?)))
        .collect();
    Ok(choose_relays(announced, me, worked, &mut rand::rng()))
}

/// The relay candidates from `announced` (each relay with the addresses it announced): at
/// most [`MAX_ADDRS_PER_RELAY`] addresses of each relay, relays in `worked` first, the others
/// in random order, at most [`MAX_LOOKUP_RELAYS`] addresses in all, `me` left out. Each
/// address ends with `/p2p/<relay>`.
pub fn choose_relays(
    mut announced: Vec<(PeerId, Vec<Multiaddr>)>,
    me: PeerId,
    worked: &[PeerId],
    rng: &mut impl rand::Rng,
) -> Vec<Multiaddr> {
    announced.retain(|(peer, _)| *peer != me);
    announced.shuffle(rng);
    // Stable: the random order stays within each group.
    announced.sort_by_key(|(peer, _)| !worked.contains(peer));
    let mut seen = std::collections::HashSet::new();
    announced
        .into_iter()
        .filter(|(peer, _)| seen.insert(*peer))
        .flat_map(|(peer, addrs)| {
            addrs
                .into_iter()
                .filter(|a| !a.iter().any(|p| p == Protocol::P2pCircuit))
                .take(MAX_ADDRS_PER_RELAY)
                .map(move |a| a.with(Protocol::P2p(peer)))
        })
        .take(MAX_LOOKUP_RELAYS)
        .collect()
}

async fn run(dht: Dht, serves_relay: bool) {
    let p2p = dht.p2p().clone();
    let mut reach = p2p.watch_reachability();
    let start = tokio::time::Instant::now();
    let (mut next_announce, mut next_lookup) = (start, start);
    // Relays a reservation was accepted on, most recent last.
    let mut worked: Vec<PeerId> = Vec::new();
    loop {
        let now = tokio::time::Instant::now();
        let r = reach.borrow_and_update().clone();
        for relay in r.relayed.iter().filter_map(relay_of) {
            remember_worked(&mut worked, relay);
        }
        // Announced once a dial-back confirmed an address: a relay refuses reservations until
        // it knows an external address of its own.
        if serves_relay && !r.confirmed.is_empty() && now >= next_announce {
            let mut value = Vec::new();
            encode_addrs(&r.confirmed, &mut value);
            let expiration = DhtTime::now().saturating_add(ANNOUNCE_TTL);
            if let Err(error) = dht
                .store_unconfirmed(RELAYS_KEY, Some(&dht.own_subkey()), &value, expiration)
                .await
            {
                tracing::debug!(%error, "relay announcement not stored");
            }
            next_announce = now + ANNOUNCE_EVERY;
        }
        if r.class() != Reach::Public && r.relayed.is_empty() && now >= next_lookup {
            match lookup_relays(&dht, &worked).await {
                Ok(relays) if !relays.is_empty() => {
                    tracing::debug!(count = relays.len(), "relays found in the DHT");
                    let _ = p2p.add_relay_candidates(relays).await;
                }
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "relay lookup failed"),
            }
            next_lookup = now + LOOKUP_EVERY;
        }
        let wake = next_announce
            .min(next_lookup)
            .max(now + Duration::from_secs(1));
        tokio::select! {
            () = tokio::time::sleep_until(wake) => {}
            changed = reach.changed() => if changed.is_err() { return },
        }
    }
}

/// The relay of a circuit address (`.../p2p/<relay>/p2p-circuit/...`).
fn relay_of(circuit: &Multiaddr) -> Option<PeerId> {
    let mut relay = None;
    for p in circuit.iter() {
        match p {
            Protocol::P2p(peer) => relay = Some(peer),
            Protocol::P2pCircuit => return relay,
            _ => {}
        }
    }
    None
}

/// Remembers `relay` as seen working (the most recent last; the oldest forgotten past
/// [`MAX_WORKED`]).
fn remember_worked(worked: &mut Vec<PeerId>, relay: PeerId) {
    worked.retain(|p| *p != relay);
    if worked.len() == MAX_WORKED {
        worked.remove(0);
    }
    worked.push(relay);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn addrs(n: u16) -> Vec<Multiaddr> {
        (0..n)
            .map(|i| format!("/ip4/10.0.0.1/tcp/{}", 1000 + i).parse().unwrap())
            .collect()
    }

    fn relay_ids(chosen: &[Multiaddr]) -> Vec<PeerId> {
        chosen
            .iter()
            .map(|a| match a.iter().last() {
                Some(Protocol::P2p(peer)) => peer,
                _ => panic!("{a} does not end with /p2p/<relay>"),
            })
            .collect()
    }

    /// One relay announcing 16 addresses supplies at most two candidates, whatever the order:
    /// the other relays' addresses are all taken.
    #[test]
    fn one_announcement_supplies_at_most_two_candidates() {
        let greedy = PeerId::random();
        let others: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        for seed in 0..16 {
            let mut announced = vec![(greedy, addrs(16))];
            announced.extend(others.iter().map(|p| (*p, addrs(1))));
            let chosen = choose_relays(
                announced,
                PeerId::random(),
                &[],
                &mut StdRng::seed_from_u64(seed),
            );
            let ids = relay_ids(&chosen);
            assert_eq!(ids.iter().filter(|p| **p == greedy).count(), 2);
            for o in &others {
                assert!(ids.contains(o), "relay {o} left out: {chosen:?}");
            }
            assert_eq!(chosen.len(), 5);
        }
    }

    /// Relays seen working come first and are kept when more relays are announced than a lookup
    /// takes; the node's own announcement and circuit addresses are left out.
    #[test]
    fn relays_seen_working_come_first() {
        let me = PeerId::random();
        let good = PeerId::random();
        let mut announced: Vec<(PeerId, Vec<Multiaddr>)> =
            (0..20).map(|_| (PeerId::random(), addrs(2))).collect();
        let mut good_addrs = addrs(1);
        good_addrs.insert(
            0,
            format!("/ip4/10.0.0.9/tcp/1/p2p/{}/p2p-circuit", PeerId::random())
                .parse()
                .unwrap(),
        );
        announced.push((good, good_addrs));
        announced.push((me, addrs(2)));
        for seed in 0..16 {
            let chosen = choose_relays(
                announced.clone(),
                me,
                &[good],
                &mut StdRng::seed_from_u64(seed),
            );
            assert_eq!(chosen.len(), MAX_LOOKUP_RELAYS);
            let ids = relay_ids(&chosen);
            assert_eq!(ids[0], good);
            assert_eq!(ids.iter().filter(|p| **p == good).count(), 1);
            assert!(!ids.contains(&me));
        }
    }

    /// The order of relays not seen working is random: an announcer cannot always come first.
    #[test]
    fn unknown_relays_come_in_random_order() {
        let announced: Vec<(PeerId, Vec<Multiaddr>)> =
            (0..20).map(|_| (PeerId::random(), addrs(1))).collect();
        let firsts: std::collections::HashSet<PeerId> = (0..16)
            .map(|seed| {
                relay_ids(&choose_relays(
                    announced.clone(),
                    PeerId::random(),
                    &[],
                    &mut StdRng::seed_from_u64(seed),
                ))[0]
            })
            .collect();
        assert!(firsts.len() > 1, "always the same relay first");
    }

    #[test]
    fn the_relay_of_a_circuit_address_and_the_worked_list() {
        let relay = PeerId::random();
        let me = PeerId::random();
        let circuit: Multiaddr = format!("/ip4/10.0.0.1/tcp/1/p2p/{relay}/p2p-circuit/p2p/{me}")
            .parse()
            .unwrap();
        assert_eq!(relay_of(&circuit), Some(relay));
        assert_eq!(relay_of(&addrs(1)[0]), None);
        let mut worked = Vec::new();
        for _ in 0..MAX_WORKED + 5 {
            remember_worked(&mut worked, PeerId::random());
        }
        remember_worked(&mut worked, relay);
        remember_worked(&mut worked, relay);
        assert_eq!(worked.len(), MAX_WORKED);
        assert_eq!(worked.last(), Some(&relay));
    }
}
