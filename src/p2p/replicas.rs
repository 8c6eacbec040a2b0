//! Where this node's writes of a key went last (sans-IO): the peers a closest-peers lookup
//! found for it, reused by the next writes of the same key for a while.
//!
//! A Kademlia PUT is two phases: an iterative lookup of the key's closest peers (FIND_NODE
//! requests to every peer on the way, each answered with up to `k` peers and their addresses),
//! then a PUT_VALUE to each of them. A progress tracker re-stores the same key every few
//! seconds, and the key's closest peers rarely change between two writes, so the first phase
//! was most of the bytes of every write: in a swarm of four, three FIND_NODE exchanges for three
//! PUT_VALUEs. [`ReplicaSets`] remembers, per key, the peers the last lookup found for
//! [`REPLICA_SET_TTL`]; a write within that time goes straight to them
//! (`put_record_to`), a later one looks them up again. A set is forgotten early when a write to
//! it saw a failure (a replica that left), and it drops a peer that disconnected for good, so
//! writes look up again at once where the set is known to be stale. What this trades: a peer
//! that joins and lands among a key's closest peers receives the key's writes up to
//! [`REPLICA_SET_TTL`] later than it would have (readers ask every closest peer and merge their
//! answers, so they still see the writes held by the others).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;

/// How long the peers found for a key are reused by its writes.
pub(crate) const REPLICA_SET_TTL: Duration = Duration::from_secs(30);

/// Keys remembered at most (the oldest set is dropped beyond).
pub(crate) const MAX_REPLICA_SETS: usize = 256;

#[derive(Clone, Debug)]
struct Set {
    found: Instant,
    peers: Vec<PeerId>,
}

/// Per key, the peers its last lookup found (see the module docs).
#[derive(Debug)]
pub(crate) struct ReplicaSets {
    ttl: Duration,
    max_keys: usize,
    sets: HashMap<Vec<u8>, Set>,
}

impl Default for ReplicaSets {
    fn default() -> Self {
        Self::new(REPLICA_SET_TTL, MAX_REPLICA_SETS)
    }
}

impl ReplicaSets {
    pub(crate) fn new(ttl: Duration, max_keys: usize) -> Self {
        Self {
            ttl,
            max_keys: max_keys.max(1),
            sets: HashMap::new(),
        }
    }

    /// The peers to write `key` to at `now` without a lookup: those found within the TTL, if
    /// any are left.
    pub(crate) fn fresh(&self, key: &[u8], now: Instant) -> Option<&[PeerId]> {
        self.sets
            .get(key)
            .filter(|s| now.saturating_duration_since(s.found) < self.ttl && !s.peers.is_empty())
            .map(|s| &s.peers[..])
    }

    /// Remembers what a lookup of `key` found at `now` (an empty result is not remembered).
    pub(crate) fn found(&mut self, key: Vec<u8>, peers: Vec<PeerId>, now: Instant) {
        if peers.is_empty() {
            self.sets.remove(&key);
            return;
        }
        if !self.sets.contains_key(&key) && self.sets.len() >= self.max_keys {
            let ttl = self.ttl;
            self.sets
                .retain(|_, s| now.saturating_duration_since(s.found) < ttl);
            if self.sets.len() >= self.max_keys
                && let Some(oldest) = self
                    .sets
                    .iter()
                    .min_by_key(|(_, s)| s.found)
                    .map(|(k, _)| k.clone())
            {
                self.sets.remove(&oldest);
            }
        }
        self.sets.insert(key, Set { found: now, peers });
    }

    /// A write of `key` to its set saw a failure: the next write looks the peers up again.
    pub(crate) fn forget(&mut self, key: &[u8]) {
        self.sets.remove(key);
    }

    /// `peer` is gone (unreachable, or its last connection closed): it leaves every set.
    pub(crate) fn forget_peer(&mut self, peer: &PeerId) {
        for s in self.sets.values_mut() {
            s.peers.retain(|p| p != peer);
        }
        self.sets.retain(|_, s| !s.peers.is_empty());
    }

    /// Keys remembered now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.sets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::identity::Keypair;

    fn peer() -> PeerId {
        Keypair::generate_ed25519().public().to_peer_id()
    }

    #[test]
    fn a_set_is_reused_within_its_ttl_only() {
        let t0 = Instant::now();
        let mut sets = ReplicaSets::new(Duration::from_secs(30), 8);
        let (a, b) = (peer(), peer());
        assert_eq!(sets.fresh(b"k", t0), None, "nothing looked up yet");
        sets.found(b"k".to_vec(), vec![a, b], t0);
        assert_eq!(
            sets.fresh(b"k", t0 + Duration::from_secs(29)),
            Some(&[a, b][..])
        );
        assert_eq!(sets.fresh(b"k", t0 + Duration::from_secs(30)), None);
        assert_eq!(sets.fresh(b"other", t0), None);
        sets.found(b"empty".to_vec(), Vec::new(), t0);
        assert_eq!(sets.fresh(b"empty", t0), None, "an empty lookup is no set");
    }

    #[test]
    fn failures_and_departures_make_the_next_write_look_up() {
        let t0 = Instant::now();
        let mut sets = ReplicaSets::default();
        let (a, b) = (peer(), peer());
        sets.found(b"k".to_vec(), vec![a, b], t0);
        sets.found(b"j".to_vec(), vec![a], t0);
        sets.forget_peer(&a);
        assert_eq!(sets.fresh(b"k", t0), Some(&[b][..]));
        assert_eq!(sets.fresh(b"j", t0), None, "its only replica left");
        sets.forget(b"k");
        assert_eq!(sets.fresh(b"k", t0), None);
    }

    #[test]
    fn the_number_of_keys_is_bounded() {
        let t0 = Instant::now();
        let mut sets = ReplicaSets::new(Duration::from_secs(30), 4);
        let a = peer();
        for i in 0..10u8 {
            sets.found(vec![i], vec![a], t0 + Duration::from_millis(u64::from(i)));
        }
        assert_eq!(sets.len(), 4);
        assert!(sets.fresh(&[9], t0).is_some(), "the newest is kept");
        assert!(sets.fresh(&[0], t0).is_none(), "the oldest went first");
    }
}
