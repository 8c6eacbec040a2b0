//! Per-peer shares of a bounded pool of inbound slots.
//!
//! Every server of a node (the link hub's pending links and TLS handshakes, the matchmaking
//! control server, the state server) bounds how much inbound work it holds at once. A global
//! bound alone lets one peer take every slot and keep honest peers out for as long as it
//! likes, so each pool also gives every peer a share: a peer (a peer id, or an IP address
//! where no peer id is known yet) holds at most `per_peer` of the `total` slots. One peer
//! holding its whole share then leaves `total - per_peer` slots to everyone else.
//!
//! A pool may also hand out its first slots freely ([`Shares::lenient`]): the per-peer bound
//! then applies only once that many slots are in use, so a burst from one address that is
//! legitimate (many local processes joining one bootstrap node) passes while the node is not
//! under pressure, and one peer can still take at most the free part plus nothing more.
//!
//! [`Shares::try_take`] either hands out a [`Share`], which gives its slot back when dropped
//! (so a task that holds one and is aborted frees it too), or says which bound refused it.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// Which bound refused a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    /// Every slot of the pool is taken.
    #[error("every slot is taken")]
    Full,
    /// The peer holds its whole share.
    #[error("the peer holds its whole share")]
    PeerShare,
}

struct Books<K> {
    total: usize,
    per_peer: usize,
    /// The per-peer bound applies once this many slots are in use.
    strict_from: usize,
    in_use: usize,
    held: HashMap<K, usize>,
}

/// A pool of `total` slots, at most `per_peer` of them held by any one peer. Cheap to clone
/// (clones share the pool).
pub(crate) struct Shares<K> {
    books: Arc<Mutex<Books<K>>>,
}

impl<K> Clone for Shares<K> {
    fn clone(&self) -> Self {
        Self {
            books: Arc::clone(&self.books),
        }
    }
}

/// One slot, held by one peer until dropped.
pub(crate) struct Share<K: Hash + Eq> {
    books: Arc<Mutex<Books<K>>>,
    peer: K,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    /// A pool of `total` slots (at least one) with `per_peer` (at least one, at most `total`)
    /// per peer.
    pub(crate) fn new(total: usize, per_peer: usize) -> Self {
        Self::lenient(total, per_peer, 0)
    }

    /// As [`Shares::new`], but the per-peer bound applies only while at least `free` slots
    /// are in use: below that, anyone takes a slot (see the module docs).
    pub(crate) fn lenient(total: usize, per_peer: usize, free: usize) -> Self {
        let total = total.max(1);
        Self {
            books: Arc::new(Mutex::new(Books {
                total,
                per_peer: per_peer.clamp(1, total),
                strict_from: free.min(total),
                in_use: 0,
                held: HashMap::new(),
            })),
        }
    }

    /// A slot for `peer`, unless the pool is full or `peer` holds its share.
    pub(crate) fn try_take(&self, peer: K) -> Result<Share<K>, Refused> {
        let mut books = lock(&self.books);
        if books.in_use >= books.total {
            return Err(Refused::Full);
        }
        let per_peer = books.per_peer;
        let strict = books.in_use >= books.strict_from;
        let held = books.held.entry(peer.clone()).or_insert(0);
        if strict && *held >= per_peer {
            return Err(Refused::PeerShare);
        }
        *held += 1;
        books.in_use += 1;
        Ok(Share {
            books: Arc::clone(&self.books),
            peer,
        })
    }

    /// Slots taken now.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        lock(&self.books).in_use
    }

    /// Whether every slot is taken.
    pub(crate) fn is_full(&self) -> bool {
        let books = lock(&self.books);
        books.in_use >= books.total
    }
}

impl<K: Hash + Eq> Drop for Share<K> {
    fn drop(&mut self) {
        let mut books = lock(&self.books);
        books.in_use -= 1;
        if let Some(held) = books.held.get_mut(&self.peer) {
            *held -= 1;
            if *held == 0 {
                books.held.remove(&self.peer);
            }
        }
    }
}

/// Locks `m`, taking the data of a poisoned lock as it is (the crate's shared helper: a panic
/// elsewhere must not turn every later lock into a second panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_peer_gets_its_share_and_the_rest_stays_free() {
        let pool = Shares::new(4, 2);
        let a1 = pool.try_take("a").unwrap();
        let _a2 = pool.try_take("a").unwrap();
        assert_eq!(pool.try_take("a").err(), Some(Refused::PeerShare));
        let _b1 = pool.try_take("b").unwrap();
        let _c1 = pool.try_take("c").unwrap();
        assert!(pool.is_full());
        assert_eq!(pool.try_take("d").err(), Some(Refused::Full));
        drop(a1);
        assert_eq!(pool.in_use(), 3);
        let _d1 = pool.try_take("d").unwrap();
    }

    #[test]
    fn a_lenient_pool_applies_the_share_once_busy() {
        let pool = Shares::lenient(6, 1, 3);
        let a: Vec<_> = (0..3).map(|_| pool.try_take("a").unwrap()).collect();
        assert_eq!(pool.try_take("a").err(), Some(Refused::PeerShare));
        let _b = pool.try_take("b").unwrap();
        assert_eq!(pool.try_take("b").err(), Some(Refused::PeerShare));
        let _c = pool.try_take("c").unwrap();
        let _d = pool.try_take("d").unwrap();
        assert_eq!(pool.try_take("e").err(), Some(Refused::Full));
        drop(a);
        let _a = pool.try_take("a").unwrap();
    }

    #[test]
    fn the_share_is_clamped_to_the_pool() {
        let pool = Shares::new(0, 0);
        let s = pool.try_take(1).unwrap();
        assert_eq!(pool.try_take(2).err(), Some(Refused::Full));
        drop(s);
        let pool = Shares::new(2, 10);
        let _x = pool.try_take(1).unwrap();
        let _y = pool.try_take(1).unwrap();
        assert_eq!(pool.try_take(1).err(), Some(Refused::Full));
    }

    proptest! {
        /// Any sequence of takes and drops keeps both bounds and the books exact.
        #[test]
        fn bounds_hold_under_any_sequence(
            total in 1usize..8,
            per_peer in 1usize..8,
            free in 0usize..10,
            ops in proptest::collection::vec((0u8..4, any::<bool>()), 0..64),
        ) {
            let pool = Shares::lenient(total, per_peer, free);
            let per_peer = per_peer.min(total);
            let free = free.min(total);
            let mut held: Vec<(u8, Share<u8>)> = Vec::new();
            for (peer, take) in ops {
                if take {
                    let mine = held.iter().filter(|(p, _)| *p == peer).count();
                    match pool.try_take(peer) {
                        Ok(s) => {
                            prop_assert!(held.len() < total);
                            prop_assert!(mine < per_peer || held.len() < free);
                            held.push((peer, s));
                        }
                        Err(Refused::Full) => prop_assert_eq!(held.len(), total),
                        Err(Refused::PeerShare) => {
                            prop_assert!(mine >= per_peer && held.len() >= free);
                        }
                    }
                } else if let Some(i) = held.iter().position(|(p, _)| *p == peer) {
                    held.swap_remove(i);
                }
                prop_assert_eq!(pool.in_use(), held.len());
            }
            drop(held);
            prop_assert_eq!(pool.in_use(), 0);
            prop_assert!(lock(&pool.books).held.is_empty());
        }
    }
}
