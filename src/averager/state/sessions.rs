//! The donor's sessions, sans-IO: who holds a slot, and who loses it to a newcomer.
//!
//! A session is a newcomer's claim on a snapshot (see the [parent module](super)). Slots are
//! few ([`super::StateConfig::max_sessions`]), so a claim must be earned:
//!
//! * **One per peer id.** A peer's new `Metadata` request replaces its session.
//! * **Idle sessions lapse**: one without a request for
//!   [`super::StateConfig::session_idle_timeout`] is dropped.
//! * **Progress is measured.** Each session holds credit, kept as the instant it is *paid
//!   until*: [`super::StateConfig::session_grace`] from its opening, and every chunk served adds
//!   the time that chunk takes at [`super::StateConfig::min_session_rate`] (at most `grace`
//!   ahead of now, so a burst does not pay for a long silence). A session whose credit ran out
//!   is **stalled**: it has fetched less than the minimum rate allows since it opened. When
//!   every slot is taken and a newcomer asks, the session stalled longest is evicted (its next
//!   chunk request is `UnknownSession`); with no stalled session the newcomer is `Busy`.
//!
//! Peer ids are free, so the per-peer rule alone stops only the trivial case (one peer taking
//! every slot). What stops `max_sessions` sybils that each trickle a chunk a minute (which kept
//! every slot forever under the idle rule alone) is the measured progress: to hold a slot
//! against newcomers a peer must keep downloading at the minimum rate, so holding every slot
//! costs `max_sessions × min_session_rate` of the attacker's own download, for as long as it
//! lasts. A slow honest download can lose its slot too, but only to a newcomer that needs it.
//!
//! Everything here takes `now` as an argument and session ids from the caller; the donor's
//! shell ([`super::donor`]) passes the clock and random ids.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use libp2p::PeerId;

use super::Snapshot;
use super::wire::{HASH_BYTES, Refusal};

/// The limits of a donor's sessions (from [`super::StateConfig`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// Most sessions at once (at least 1).
    pub max: usize,
    /// A session without a request for this long is dropped.
    pub idle: Duration,
    /// Credit a session opens with, and the most credit it may hold ahead of now.
    pub grace: Duration,
    /// Bytes per second a session must fetch to keep its slot against a newcomer.
    pub min_rate: u64,
}

struct Session {
    peer: PeerId,
    id: Bytes,
    snapshot: Arc<Snapshot>,
    last_used: Instant,
    /// The session keeps up while `now < paid_until` (module docs).
    paid_until: Instant,
}

/// The sessions of one donor (module docs).
pub(super) struct Sessions {
    limits: Limits,
    list: Vec<Session>,
}

impl Sessions {
    pub(super) fn new(limits: Limits) -> Self {
        Self {
            limits,
            list: Vec::new(),
        }
    }

    /// Sessions open now.
    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    /// Drops every session.
    pub(super) fn clear(&mut self) {
        self.list.clear();
    }

    /// Drops the sessions idle at `now`.
    pub(super) fn expire(&mut self, now: Instant) {
        let idle = self.limits.idle;
        self.list
            .retain(|s| now.saturating_duration_since(s.last_used) < idle);
    }

    /// Drops idle sessions and `peer`'s own; then the index of the session a newcomer would
    /// evict, `Ok(None)` when there is a free slot, `Err` (busy) when neither.
    fn make_room(&mut self, peer: PeerId, now: Instant) -> Result<Option<usize>, Refusal> {
        self.expire(now);
        self.list.retain(|s| s.peer != peer);
        if self.list.len() < self.limits.max.max(1) {
            return Ok(None);
        }
        self.list
            .iter()
            .enumerate()
            .filter(|(_, s)| s.paid_until <= now)
            .min_by_key(|(_, s)| s.paid_until)
            .map(|(i, _)| Some(i))
            .ok_or(Refusal::Busy)
    }

    /// Whether `peer` would get a session at `now` (dropping idle sessions and `peer`'s own,
    /// evicting nobody): checked before a snapshot is built for it.
    pub(super) fn has_room(&mut self, peer: PeerId, now: Instant) -> bool {
        self.make_room(peer, now).is_ok()
    }

    /// A snapshot an open session holds whose description has `content_hash` (sessions of
    /// one state share one copy).
    pub(super) fn same_state(&self, content_hash: &[u8; HASH_BYTES]) -> Option<Arc<Snapshot>> {
        self.list
            .iter()
            .find(|s| s.snapshot.meta.content_hash == *content_hash)
            .map(|s| s.snapshot.clone())
    }

    /// Opens session `id` on `snapshot` for `peer` at `now`, replacing `peer`'s own and
    /// evicting the session stalled longest if every slot is taken; `Busy` if none is stalled.
    pub(super) fn open(
        &mut self,
        peer: PeerId,
        id: Bytes,
        snapshot: Arc<Snapshot>,
        now: Instant,
    ) -> Result<(), Refusal> {
        if let Some(evicted) = self.make_room(peer, now)? {
            let s = self.list.swap_remove(evicted);
            tracing::debug!(peer = %s.peer, "state session evicted: it stalled");
        }
        self.list.push(Session {
            peer,
            id,
            snapshot,
            last_used: now,
            paid_until: now + self.limits.grace,
        });
        Ok(())
    }

    /// The snapshot of `peer`'s session `id` for a chunk of `bytes` bytes requested at `now`,
    /// crediting the session with it; `UnknownSession` if there is none (never opened,
    /// released, idle or evicted).
    pub(super) fn serve(
        &mut self,
        peer: PeerId,
        id: &[u8],
        bytes: impl FnOnce(&Snapshot) -> Option<u64>,
        now: Instant,
    ) -> Result<Arc<Snapshot>, Refusal> {
        let limits = self.limits;
        let s = self
            .list
            .iter_mut()
            .find(|s| s.peer == peer && *s.id == *id)
            .ok_or(Refusal::UnknownSession)?;
        s.last_used = now;
        if let Some(bytes) = bytes(&s.snapshot) {
            let earned = Duration::from_secs_f64(bytes as f64 / limits.min_rate.max(1) as f64);
            s.paid_until = (s.paid_until + earned).min(now + limits.grace);
        }
        Ok(s.snapshot.clone())
    }

    /// Drops `peer`'s session `id`.
    pub(super) fn release(&mut self, peer: PeerId, id: &[u8]) {
        self.list.retain(|s| !(s.peer == peer && *s.id == *id));
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metadata;
    use super::*;

    const CHUNK: u64 = 1 << 20;

    fn snapshot() -> Arc<Snapshot> {
        Arc::new(Snapshot {
            data: Bytes::from(vec![0u8; 8 * CHUNK as usize]),
            meta: Metadata {
                session: Bytes::new(),
                schema_hash: Bytes::new(),
                tensors: Vec::new(),
                total_bytes: 8 * CHUNK,
                chunk_bytes: CHUNK,
                chunk_hashes: Bytes::new(),
                content_hash: [7; HASH_BYTES],
                metadata: Bytes::new(),
            },
        })
    }

    /// The defaults of [`super::super::StateConfig`].
    fn limits() -> Limits {
        let c = super::super::StateConfig::default();
        Limits {
            max: c.max_sessions,
            idle: c.session_idle_timeout,
            grace: c.session_grace,
            min_rate: c.min_session_rate,
        }
    }

    fn id(i: usize) -> Bytes {
        Bytes::from(i.to_le_bytes().to_vec())
    }

    fn chunk(sessions: &mut Sessions, peer: PeerId, i: usize, now: Instant) -> bool {
        sessions.serve(peer, &id(i), |_| Some(CHUNK), now).is_ok()
    }

    /// The attack of issue 29 (attack 5): as many sybils as there are slots each open a
    /// session and then fetch one chunk a minute, just inside the idle timeout, for an hour.
    /// Under the idle rule alone every newcomer got `Busy` for as long as they kept on; with
    /// progress measured, a newcomer takes a stalled sybil's slot (the sybil's next chunk
    /// request is refused), and a newcomer fetching at the minimum rate keeps its slot
    /// against the next sybil.
    #[test]
    fn trickling_sybils_cannot_hold_every_slot() {
        let limits = limits();
        let mut sessions = Sessions::new(limits);
        let start = Instant::now();
        let sybils: Vec<PeerId> = (0..limits.max).map(|_| PeerId::random()).collect();
        for (i, &peer) in sybils.iter().enumerate() {
            sessions.open(peer, id(i), snapshot(), start).unwrap();
        }
        let trickle = limits.idle - Duration::from_secs(1);
        let mut now = start;
        for _ in 0..60 {
            now += trickle;
            for (i, &peer) in sybils.iter().enumerate() {
                assert!(
                    chunk(&mut sessions, peer, i, now),
                    "sybil {i} lost its session"
                );
            }
        }
        assert_eq!(sessions.len(), limits.max);

        let honest = PeerId::random();
        let h = limits.max;
        sessions
            .open(honest, id(h), snapshot(), now)
            .expect("a newcomer beside trickling sybils");
        assert_eq!(sessions.len(), limits.max);
        let evicted = (0..limits.max)
            .filter(|&i| !chunk(&mut sessions, sybils[i], i, now))
            .count();
        assert_eq!(evicted, 1, "exactly one sybil lost its slot");

        // The newcomer downloads at the minimum rate while new sybils keep arriving (one
        // each ten chunks, more than the grace period apart): they take the stalled sybils'
        // slots, then each other's, never the newcomer's.
        let step = Duration::from_secs_f64(CHUNK as f64 / limits.min_rate as f64);
        assert!(10 * step > limits.grace);
        for round in 1..=200 {
            now += step;
            assert!(chunk(&mut sessions, honest, h, now), "the newcomer's slot");
            if round % 10 == 0 {
                sessions
                    .open(PeerId::random(), id(h + 1), snapshot(), now)
                    .expect("a stalled sybil's slot");
            }
        }
        assert!(chunk(&mut sessions, honest, h, now));
    }

    /// Sessions that keep up are never evicted: a newcomer beside them is `Busy`. Credit
    /// banked by a burst lasts at most the grace period.
    #[test]
    fn sessions_that_keep_up_keep_their_slots() {
        let limits = limits();
        let mut sessions = Sessions::new(limits);
        let mut now = Instant::now();
        let peers: Vec<PeerId> = (0..limits.max).map(|_| PeerId::random()).collect();
        for (i, &peer) in peers.iter().enumerate() {
            sessions.open(peer, id(i), snapshot(), now).unwrap();
        }
        // Within the grace period nobody is stalled.
        now += limits.grace / 2;
        assert!(!sessions.has_room(PeerId::random(), now));
        assert_eq!(
            sessions.open(PeerId::random(), id(99), snapshot(), now),
            Err(Refusal::Busy)
        );
        // A burst of 1000 chunks at once banks at most the grace period.
        for _ in 0..1000 {
            assert!(chunk(&mut sessions, peers[0], 0, now));
        }
        for (i, &peer) in peers.iter().enumerate().skip(1) {
            // The others keep up at twice the minimum rate.
            let step = Duration::from_secs_f64(CHUNK as f64 / limits.min_rate as f64 / 2.0);
            let mut t = now;
            while t < now + limits.grace + Duration::from_secs(1) {
                t += step;
                assert!(chunk(&mut sessions, peer, i, t));
            }
        }
        now += limits.grace + Duration::from_secs(1);
        assert!(sessions.has_room(PeerId::random(), now));
        sessions
            .open(PeerId::random(), id(99), snapshot(), now)
            .unwrap();
        assert!(!chunk(&mut sessions, peers[0], 0, now), "the burst stalled");
        for (i, &peer) in peers.iter().enumerate().skip(1) {
            assert!(chunk(&mut sessions, peer, i, now), "session {i} kept up");
        }
    }

    /// One session per peer id, idle sessions lapse, releases and unknown ids.
    #[test]
    fn one_session_per_peer_and_idle_ones_lapse() {
        let limits = limits();
        let mut sessions = Sessions::new(limits);
        let now = Instant::now();
        let peer = PeerId::random();
        for i in 0..10 {
            sessions.open(peer, id(i), snapshot(), now).unwrap();
        }
        assert_eq!(
            sessions.len(),
            1,
            "a new request replaces the peer's session"
        );
        assert!(chunk(&mut sessions, peer, 9, now));
        assert!(!chunk(&mut sessions, peer, 8, now));
        assert!(
            !chunk(&mut sessions, PeerId::random(), 9, now),
            "not its session"
        );
        assert!(sessions.same_state(&[7; HASH_BYTES]).is_some());
        assert!(sessions.same_state(&[8; HASH_BYTES]).is_none());
        sessions.release(peer, &id(9));
        assert_eq!(sessions.len(), 0);

        sessions.open(peer, id(1), snapshot(), now).unwrap();
        sessions.expire(now + limits.idle - Duration::from_millis(1));
        assert_eq!(sessions.len(), 1);
        sessions.expire(now + limits.idle);
        assert_eq!(sessions.len(), 0);
    }
}
