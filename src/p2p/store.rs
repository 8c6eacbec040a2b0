//! The Kademlia record store, bounded in bytes and records, with a share per source.
//!
//! libp2p-kad's `MemoryStore` bounds the number of records (and each value's size) but not what
//! one peer may hold, and once full it refuses every write, the node's own included: one peer
//! PUTting 65,536 keys of 768 KiB could make a node hold 48 GiB and then lock it out of its own
//! DHT. [`BoundedStore`] wraps a `MemoryStore` and keeps its own books:
//!
//! * **Who holds a record.** The peers whose writes put its bytes there, each for what its
//!   writes added: the event loop sets a merged record's `publisher` to the PUT's source, or to
//!   this node for its own writes (a `None` publisher counts as this node), and a write that
//!   grows a record is charged the growth (one that shrinks it gives bytes back, its writer's
//!   first). A record merged from many writers (a matchmaking key holding one entry per peer)
//!   is thus shared out among them, and no writer takes over what others wrote: charging the
//!   whole record to its last writer let a remote peer that merged one byte into a record of
//!   this node's turn it into a remote record, which eviction could then drop, and charged an
//!   honest peer for every other writer's entries (issue 29, item 8). A record with a part of
//!   this node's is this node's own for eviction (below).
//! * **A share per source.** A remote peer may hold at most [`StoreLimits::max_bytes_per_peer`]
//!   bytes (key plus value) in at most [`StoreLimits::max_records_per_peer`] records; a write
//!   beyond that is refused ([`StoreRefusal::PeerShare`]), after expired records have been
//!   dropped (they would otherwise count against their holder until the store ran full).
//! * **Totals and eviction.** When a write would take the store past [`StoreLimits::max_bytes`]
//!   or [`StoreLimits::max_records`], expired records go first (looked for at most once a
//!   second: the scan reads every record); then the largest record of the
//!   remote peer holding the most bytes, repeatedly. A remote write that would have to evict its
//!   own writer's records (it is the largest holder) is refused instead
//!   ([`StoreRefusal::Full`]).
//! * **Local records are never evicted** (nor any record with a part this node wrote), and
//!   this node's writes are never refused for space:
//!   remote records cannot crowd them out. They count towards the totals, so remote ones make
//!   room for them.
//!
//! Provider records are passed through to the inner store (hivemesh does not use them;
//! `MemoryStore` bounds them).

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use libp2p::kad::store::{self, MemoryStore, MemoryStoreConfig, RecordStore};
use libp2p::kad::{ProviderRecord, Record, RecordKey};

/// Bounds on the records a node keeps for others ([`crate::p2p::P2pConfig::store`]).
///
/// The defaults: **256 MiB and 65,536 records** in all, about a quarter of this 2-core test
/// machine's memory for a bootstrap node, and far above what averaging needs (a matchmaking key
/// holds one small signed entry per peer looking for a group: 4,096 peers fit in 520 KiB). **4 MiB
/// and 256 records per peer**: more than any honest peer writes (an averager declares itself
/// under a few keys at a time), so that 64 distinct peers are needed to fill the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Bytes (keys plus values) of every record together.
    pub max_bytes: usize,
    /// Records together.
    pub max_records: usize,
    /// Bytes the records one remote peer holds may take.
    pub max_bytes_per_peer: usize,
    /// Records one remote peer may hold.
    pub max_records_per_peer: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            max_bytes: 256 << 20,
            max_records: 1 << 16,
            max_bytes_per_peer: 4 << 20,
            max_records_per_peer: 256,
        }
    }
}

/// Why the store refused a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreRefusal {
    /// The writing peer's share is used up.
    #[error(
        "{peer} would hold {bytes} bytes in {records} records, over its share ({max_bytes} bytes, {max_records} records)"
    )]
    PeerShare {
        /// The writer.
        peer: PeerId,
        /// What it would hold, in bytes.
        bytes: usize,
        /// What it would hold, in records.
        records: usize,
        /// Its byte share.
        max_bytes: usize,
        /// Its record share.
        max_records: usize,
    },
    /// The store is full and the writer holds the most of it.
    #[error("the record store is full ({bytes} bytes in {records} records)")]
    Full {
        /// Bytes held.
        bytes: usize,
        /// Records held.
        records: usize,
    },
    /// A value over the inner store's size bound.
    #[error("record value of {0} bytes is too large")]
    TooLarge(usize),
}

/// What a store holds (see [`crate::p2p::P2p::store_usage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Records held.
    pub records: usize,
    /// Bytes (keys plus values) held.
    pub bytes: usize,
    /// Of those, the records this node holds for itself.
    pub local_records: usize,
    /// Of those, the bytes this node holds for itself.
    pub local_bytes: usize,
    /// Records evicted since the start.
    pub evicted: u64,
    /// Records refused since the start (share used up or store full).
    pub refused: u64,
}

/// One holder's parts of records, smallest first: `(bytes, key)`.
type BySize = BTreeSet<(usize, Vec<u8>)>;

/// Who is charged for one record, and for how many of its bytes (they add up to its size).
type Parts = Vec<(PeerId, usize)>;

/// The parts of a record of `size` bytes written by `writer` whose parts were `old`: growth is
/// charged to the writer, shrinkage given back by the writer first, then by the others
/// (largest part first).
fn parts_after(old: &[(PeerId, usize)], writer: PeerId, size: usize) -> Parts {
    let mut parts: Parts = old.to_vec();
    let before: usize = parts.iter().map(|(_, b)| b).sum();
    if size >= before {
        match parts.iter_mut().find(|(p, _)| *p == writer) {
            Some((_, b)) => *b += size - before,
            None => parts.push((writer, size - before)),
        }
    } else {
        let mut cut = before - size;
        parts.sort_by_key(|(p, b)| (*p != writer, std::cmp::Reverse(*b)));
        for (_, b) in &mut parts {
            let take = cut.min(*b);
            *b -= take;
            cut -= take;
        }
    }
    parts.retain(|(_, b)| *b > 0);
    parts
}

#[derive(Clone, Copy, Debug, Default)]
struct Held {
    bytes: usize,
    records: usize,
}

/// A `MemoryStore` with the bounds of the module docs.
pub(crate) struct BoundedStore {
    local: PeerId,
    limits: StoreLimits,
    inner: MemoryStore,
    /// Every stored key: who is charged for its bytes.
    held: HashMap<RecordKey, Parts>,
    /// Per holder: its parts of records, by size, for eviction.
    by_peer: HashMap<PeerId, (Held, BySize)>,
    total: Held,
    evicted: u64,
    refused: u64,
    /// When expired records may next be looked for: a scan reads every record, so a full
    /// store under a stream of PUTs scans at most once per [`EXPIRY_SCAN_INTERVAL`].
    next_expiry_scan: Instant,
}

/// Least time between two scans for expired records.
const EXPIRY_SCAN_INTERVAL: Duration = Duration::from_secs(1);

fn size_of(r: &Record) -> usize {
    r.key.as_ref().len() + r.value.len()
}

impl BoundedStore {
    pub(crate) fn new(local: PeerId, limits: StoreLimits, max_value_bytes: usize) -> Self {
        let inner = MemoryStore::with_config(
            local,
            MemoryStoreConfig {
                // Ours are the binding limits; the inner store's only have to stay out of the way.
                max_records: limits.max_records.saturating_add(1),
                max_value_bytes,
                ..Default::default()
            },
        );
        Self {
            local,
            limits,
            inner,
            held: HashMap::new(),
            by_peer: HashMap::new(),
            total: Held::default(),
            evicted: 0,
            refused: 0,
            next_expiry_scan: Instant::now(),
        }
    }

    pub(crate) fn usage(&self) -> StoreUsage {
        let local = self
            .by_peer
            .get(&self.local)
            .map(|(h, _)| *h)
            .unwrap_or_default();
        StoreUsage {
            records: self.total.records,
            bytes: self.total.bytes,
            local_records: local.records,
            local_bytes: local.bytes,
            evicted: self.evicted,
            refused: self.refused,
        }
    }

    fn holder_of(&self, r: &Record) -> PeerId {
        r.publisher.unwrap_or(self.local)
    }

    /// Checks a write of `size` bytes under `key` by `holder`, making room by eviction.
    fn admit(&mut self, key: &RecordKey, holder: PeerId, size: usize) -> Result<(), StoreRefusal> {
        let old: Parts = self.held.get(key).cloned().unwrap_or_default();
        let freed: usize = old.iter().map(|(_, b)| b).sum();
        let replaced = usize::from(self.held.contains_key(key));
        if holder != self.local {
            // What the holder would hold with this write (its part of `key` updated).
            let new_part = parts_after(&old, holder, size)
                .iter()
                .find(|(p, _)| *p == holder)
                .map_or(0, |(_, b)| *b);
            let old_part = old.iter().find(|(p, _)| *p == holder).map(|(_, b)| *b);
            let share = |s: &Self| {
                let mine = s.by_peer.get(&holder).map(|(h, _)| *h).unwrap_or_default();
                (
                    mine.bytes - old_part.unwrap_or(0) + new_part,
                    mine.records - usize::from(old_part.is_some()) + usize::from(new_part > 0),
                )
            };
            let (max_bytes, max_records) = (
                self.limits.max_bytes_per_peer,
                self.limits.max_records_per_peer,
            );
            let over_share =
                |(bytes, records): (usize, usize)| bytes > max_bytes || records > max_records;
            let (mut bytes, mut records) = share(self);
            if over_share((bytes, records)) {
                // Expired records still count against their holder until they are dropped:
                // drop them first (`key`'s own old value stays: it is being replaced).
                self.drop_expired(key);
                (bytes, records) = share(self);
            }
            if over_share((bytes, records)) {
                return Err(StoreRefusal::PeerShare {
                    peer: holder,
                    bytes,
                    records,
                    max_bytes: self.limits.max_bytes_per_peer,
                    max_records: self.limits.max_records_per_peer,
                });
            }
        }
        let over = |s: &Self| {
            s.total.bytes - freed + size > s.limits.max_bytes
                || s.total.records - replaced + 1 > s.limits.max_records
        };
        if over(self) {
            self.drop_expired(key);
        }
        while over(self) {
            // The remote holder with the most bytes in records that may be evicted (not
            // `key`, none with a part of this node's), and its largest such record.
            let evictable = |s: &Self, k: &[u8]| {
                k != key.as_ref()
                    && !s
                        .held
                        .get(&RecordKey::from(k.to_vec()))
                        .is_some_and(|parts| parts.iter().any(|(p, _)| *p == s.local))
            };
            let mut holders: Vec<(usize, PeerId)> = self
                .by_peer
                .iter()
                .filter(|(p, (h, _))| **p != self.local && h.records > 0)
                .map(|(p, (h, _))| (h.bytes, *p))
                .collect();
            holders.sort_unstable_by(|a, b| b.cmp(a));
            let victim = holders.into_iter().find_map(|(_, p)| {
                let largest = self.by_peer[&p]
                    .1
                    .iter()
                    .rev()
                    .find(|(_, k)| evictable(self, k))?;
                Some((p, RecordKey::from(largest.1.clone())))
            });
            let Some((victim, largest)) = victim else {
                if holder == self.local {
                    // Only local records left: this node's own writes are never refused.
                    return Ok(());
                }
                return Err(self.full());
            };
            if victim == holder {
                return Err(self.full());
            }
            tracing::debug!(%victim, "record store full: evicting a record");
            self.evicted += 1;
            self.remove(&largest);
        }
        Ok(())
    }

    fn full(&self) -> StoreRefusal {
        StoreRefusal::Full {
            bytes: self.total.bytes,
            records: self.total.records,
        }
    }

    fn drop_expired(&mut self, keep: &RecordKey) {
        let now = Instant::now();
        if now < self.next_expiry_scan {
            return;
        }
        self.next_expiry_scan = now + EXPIRY_SCAN_INTERVAL;
        let expired: Vec<RecordKey> = self
            .inner
            .records()
            .filter(|r| r.is_expired(now) && &r.key != keep)
            .map(|r| r.key.clone())
            .collect();
        for k in expired {
            self.remove(&k);
        }
    }

    /// Stores `r` if the bounds allow; the typed form of [`RecordStore::put`].
    pub(crate) fn try_put(&mut self, r: Record) -> Result<(), StoreRefusal> {
        let holder = self.holder_of(&r);
        let size = size_of(&r);
        if let Err(e) = self.admit(&r.key, holder, size) {
            self.refused += 1;
            return Err(e);
        }
        let key = r.key.clone();
        let len = r.value.len();
        self.inner.put(r).map_err(|e| match e {
            store::Error::ValueTooLarge => StoreRefusal::TooLarge(len),
            _ => self.full(),
        })?;
        let old = self.held.get(&key).cloned().unwrap_or_default();
        let parts = parts_after(&old, holder, size);
        self.forget(&key);
        for (peer, bytes) in &parts {
            let (h, set) = self.by_peer.entry(*peer).or_default();
            h.bytes += bytes;
            h.records += 1;
            set.insert((*bytes, key.to_vec()));
        }
        self.held.insert(key, parts);
        self.total.bytes += size;
        self.total.records += 1;
        Ok(())
    }

    /// Drops the books of `key` (not the record).
    fn forget(&mut self, key: &RecordKey) {
        let Some(parts) = self.held.remove(key) else {
            return;
        };
        for (holder, bytes) in &parts {
            if let Some((h, set)) = self.by_peer.get_mut(holder) {
                h.bytes -= bytes;
                h.records -= 1;
                set.remove(&(*bytes, key.to_vec()));
                if h.records == 0 {
                    self.by_peer.remove(holder);
                }
            }
        }
        self.total.bytes -= parts.iter().map(|(_, b)| b).sum::<usize>();
        self.total.records -= 1;
    }
}

impl RecordStore for BoundedStore {
    type RecordsIter<'a> = <MemoryStore as RecordStore>::RecordsIter<'a>;
    type ProvidedIter<'a> = <MemoryStore as RecordStore>::ProvidedIter<'a>;

    fn get(&self, k: &RecordKey) -> Option<Cow<'_, Record>> {
        self.inner.get(k)
    }

    fn put(&mut self, r: Record) -> store::Result<()> {
        self.try_put(r).map_err(|e| match e {
            StoreRefusal::TooLarge(_) => store::Error::ValueTooLarge,
            _ => store::Error::MaxRecords,
        })
    }

    fn remove(&mut self, k: &RecordKey) {
        self.inner.remove(k);
        self.forget(k);
    }

    fn records(&self) -> Self::RecordsIter<'_> {
        self.inner.records()
    }

    fn add_provider(&mut self, record: ProviderRecord) -> store::Result<()> {
        self.inner.add_provider(record)
    }

    fn providers(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        self.inner.providers(key)
    }

    fn provided(&self) -> Self::ProvidedIter<'_> {
        self.inner.provided()
    }

    fn remove_provider(&mut self, k: &RecordKey, p: &PeerId) {
        self.inner.remove_provider(k, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, len: usize, holder: PeerId) -> Record {
        let mut r = Record::new(RecordKey::new(&key), vec![7u8; len]);
        r.publisher = Some(holder);
        r
    }

    fn limits() -> StoreLimits {
        StoreLimits {
            max_bytes: 10_000,
            max_records: 20,
            max_bytes_per_peer: 4_000,
            max_records_per_peer: 8,
        }
    }

    /// A peer's expired records stop counting against its share when it writes again (before,
    /// they counted until the whole store ran full).
    #[test]
    fn a_peers_expired_records_stop_counting_against_its_share() {
        let peer = PeerId::random();
        let mut s = BoundedStore::new(PeerId::random(), limits(), 1 << 20);
        for i in 0..8 {
            let mut r = record(&format!("old-{i}"), 10, peer);
            r.expires = Some(Instant::now() - Duration::from_millis(1));
            s.try_put(r).unwrap();
        }
        let mut live = record("live", 10, PeerId::random());
        live.expires = Some(Instant::now() + Duration::from_secs(3600));
        s.try_put(live).unwrap();
        s.try_put(record("fresh", 10, peer))
            .expect("the expired records no longer count");
        assert_eq!(
            s.usage().records,
            2,
            "the expired ones are gone, the live one stays"
        );
        check_books(&s);
        // A share full of live records still refuses.
        let other = PeerId::random();
        for i in 0..8 {
            s.try_put(record(&format!("o-{i}"), 10, other)).unwrap();
        }
        assert!(matches!(
            s.try_put(record("o-8", 10, other)),
            Err(StoreRefusal::PeerShare { .. })
        ));
    }

    fn check_books(s: &BoundedStore) {
        let (bytes, records) = s
            .inner
            .records()
            .fold((0, 0), |(b, n), r| (b + size_of(&r), n + 1));
        let u = s.usage();
        assert_eq!((u.bytes, u.records), (bytes, records));
        assert!(u.records == s.held.len());
        for r in s.inner.records() {
            let parts = &s.held[&r.key];
            assert_eq!(parts.iter().map(|(_, b)| b).sum::<usize>(), size_of(&r));
        }
        let by_peer: usize = s.by_peer.values().map(|(h, _)| h.bytes).sum();
        assert_eq!(by_peer, u.bytes);
    }

    /// Issue 29, item 8: a remote peer that merges into a record of this node's does not take
    /// it over. Before, the record was charged to its last writer: one remote byte made a
    /// local record remote, and a store filling up then evicted it.
    #[test]
    fn a_remote_merge_into_a_local_record_does_not_make_it_evictable() {
        let local = PeerId::random();
        let mut s = BoundedStore::new(local, limits(), 1 << 20);
        s.try_put(record("mine", 1_000, local)).unwrap();
        let merger = PeerId::random();
        s.try_put(record("mine", 1_001, merger)).unwrap();
        assert_eq!(s.usage().local_records, 1);
        assert_eq!(s.by_peer[&merger].0.bytes, 1);
        // The merger and sybils fill the store: the record stays.
        for (n, p) in std::iter::once(merger)
            .chain((0..6).map(|_| PeerId::random()))
            .enumerate()
        {
            for i in 0..4 {
                let _ = s.try_put(record(&format!("s{n}-{i}"), 900, p));
            }
        }
        assert!(s.usage().evicted > 0, "the store ran full");
        assert!(s.get(&RecordKey::new(&"mine")).is_some());
        check_books(&s);
    }

    /// A record merged from several remote writers is charged to each for what it added, not
    /// all to the last: the last writer's share is not spent on the others' entries.
    #[test]
    fn a_merged_record_is_shared_out_among_its_writers() {
        let mut s = BoundedStore::new(PeerId::random(), limits(), 1 << 20);
        let writers: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
        for (i, w) in writers.iter().enumerate() {
            // Each merge adds 900 bytes: 4,500 in all, over one peer's 4,000-byte share.
            s.try_put(record("group", 900 * (i + 1) - 5, *w))
                .expect("each writer holds its own entry only");
        }
        for w in &writers {
            assert!(s.by_peer[w].0.bytes <= 901, "{:?}", s.by_peer[w].0);
        }
        check_books(&s);
    }

    #[test]
    fn a_peer_cannot_hold_more_than_its_share() {
        let local = PeerId::random();
        let hostile = PeerId::random();
        let mut s = BoundedStore::new(local, limits(), 1 << 20);
        let mut refused = 0;
        for i in 0..100 {
            if s.try_put(record(&format!("k{i}"), 999, hostile)).is_err() {
                refused += 1;
            }
        }
        // 4 records of 1001 bytes would be 4004 > 4000: three fit.
        assert_eq!(s.usage().records, 3);
        assert_eq!(refused, 97);
        assert!(matches!(s.try_put(record("more", 10, hostile)), Ok(())));
        assert!(matches!(
            s.try_put(record("most", 999, hostile)),
            Err(StoreRefusal::PeerShare { .. })
        ));
        // Replacing one of its own records within its share works.
        s.try_put(record("k0", 500, hostile)).unwrap();
        check_books(&s);
    }

    #[test]
    fn remote_records_never_crowd_out_local_ones() {
        let local = PeerId::random();
        let mut s = BoundedStore::new(local, limits(), 1 << 20);
        // Sybils fill the store to its byte bound.
        let sybils: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
        for (n, p) in sybils.iter().enumerate() {
            for i in 0..3 {
                let _ = s.try_put(record(&format!("s{n}-{i}"), 900, *p));
            }
        }
        assert!(s.usage().bytes <= 10_000);
        assert!(s.usage().bytes + 1_000 > 10_000, "the store is full");
        // A newcomer's write still goes in: the largest holder's records make room.
        let honest = PeerId::random();
        let evicted = s.usage().evicted;
        s.try_put(record("honest", 900, honest)).unwrap();
        assert!(s.usage().evicted > evicted);
        // This node's own writes always go in, and remote ones never push them out.
        for i in 0..10 {
            s.try_put(record(&format!("mine{i}"), 900, local)).unwrap();
        }
        assert_eq!(s.usage().local_records, 10);
        for (n, p) in sybils.iter().enumerate() {
            let _ = s.try_put(record(&format!("again{n}"), 900, *p));
        }
        assert_eq!(s.usage().local_records, 10);
        assert!(s.usage().bytes <= 10_000);
        check_books(&s);
    }

    #[test]
    fn the_largest_holder_cannot_evict_others_to_grow() {
        let local = PeerId::random();
        let lim = StoreLimits {
            max_bytes: 5_000,
            max_bytes_per_peer: 10_000,
            ..limits()
        };
        let mut s = BoundedStore::new(local, lim, 1 << 20);
        let big = PeerId::random();
        let small = PeerId::random();
        s.try_put(record("small", 900, small)).unwrap();
        for i in 0..4 {
            s.try_put(record(&format!("b{i}"), 999, big)).unwrap();
        }
        // 4,909 bytes held. One more from the largest holder would need an eviction.
        assert!(matches!(
            s.try_put(record("b4", 999, big)),
            Err(StoreRefusal::Full { .. })
        ));
        assert!(s.get(&RecordKey::new(&"small")).is_some());
        check_books(&s);
    }

    #[test]
    fn removal_and_replacement_keep_the_books() {
        let local = PeerId::random();
        let a = PeerId::random();
        let b = PeerId::random();
        let mut s = BoundedStore::new(local, limits(), 1 << 20);
        s.try_put(record("k", 100, a)).unwrap();
        // b's merge grows the value: b is charged the growth, a keeps its part.
        s.try_put(record("k", 300, b)).unwrap();
        assert_eq!(s.by_peer[&a].0.bytes, 101);
        assert_eq!(s.by_peer[&b].0.bytes, 200);
        check_books(&s);
        // A shrinking write gives back its writer's part first, then the largest other part.
        s.try_put(record("k", 50, b)).unwrap();
        assert_eq!(s.by_peer.get(&b).map(|(h, _)| h.records), None);
        assert_eq!(s.by_peer[&a].0.bytes, 51);
        check_books(&s);
        s.remove(&RecordKey::new(&"k"));
        assert_eq!(s.usage(), StoreUsage::default());
        check_books(&s);
    }
}
