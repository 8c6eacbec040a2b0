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

use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
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
/// Most relays taken from one lookup.
pub const MAX_LOOKUP_RELAYS: usize = 16;

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

/// The relays announced in `dht` (addresses ending with `/p2p/<relay>`), at most
/// [`MAX_LOOKUP_RELAYS`], this node's own announcement left out.
pub async fn lookup_relays(dht: &Dht) -> Result<Vec<Multiaddr>, super::DhtError> {
    let me = dht.p2p().peer_id();
    let value = dht.get(RELAYS_KEY).await?;
    Ok(value
        .iter()
        .flat_map(|v| v.owner_entries())
        .filter(|(peer, _)| *peer != me)
        .filter_map(|(peer, entry)| {
            let addrs = decode_addrs(&entry.value)?;
            Some(addrs.into_iter().map(move |a| a.with(Protocol::P2p(peer))))
        })
        .flatten()
        .take(MAX_LOOKUP_RELAYS)
        .collect())
}

async fn run(dht: Dht, serves_relay: bool) {
    let p2p = dht.p2p().clone();
    let mut reach = p2p.watch_reachability();
    let start = tokio::time::Instant::now();
    let (mut next_announce, mut next_lookup) = (start, start);
    loop {
        let now = tokio::time::Instant::now();
        let r = reach.borrow_and_update().clone();
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
            match lookup_relays(&dht).await {
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
