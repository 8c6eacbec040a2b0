//! The typed DHT's value model, sans-IO: what one key holds, how copies of it merge, when
//! entries expire, and which inbound records are accepted.
//!
//! # The model
//!
//! Every write to a key carries an absolute wall-clock expiration ([`DhtTime`], seconds since
//! the UNIX epoch), and that expiration is also the write's *version*: the later one wins (as in
//! hivemind, where a peer re-declares with a later expiration and leaves by writing the same
//! subkey again with an expiration nudged up by one ulp, [`DhtTime::next_up`]). A write is
//! either *plain* (the key as a whole) or a *subkey* write (one entry of the key's dictionary,
//! each subkey expiring on its own).
//!
//! A [`DhtValue`] holds the newest plain write, if any, and the newest write of every subkey.
//! What a reader sees ([`DhtValue::view`], a [`DhtView`]) follows hivemind's storage rules
//! (`DHTLocalStorage` / `DictionaryDHTValue`, digest §5.4): the **plain value** if its
//! expiration is strictly later than every subkey's, otherwise the **dictionary** of all
//! subkeys. So:
//!
//! * plain over plain: the later expiration wins;
//! * subkey over subkey: per subkey, the later expiration wins; different subkeys never
//!   conflict; the dictionary's expiration is its latest entry's ([`DhtValue::expiration`]);
//! * a plain write over a dictionary replaces it only if it is newer than the dictionary's latest
//!   entry; otherwise the whole dictionary, older entries included, stays visible;
//! * a subkey write over a plain value replaces it (with a dictionary) only if it is newer.
//!
//! # Merge rules
//!
//! Kademlia keeps one record per key and a later write overwrites an earlier one, replicas can
//! hold different subsets of the writes, and a GET returns one record per replica. The record
//! store therefore merges every inbound record into its copy and a reader merges all the
//! replicas' answers, and the result must not depend on the order or grouping of those merges
//! nor on seeing a record twice. [`merge`] is a join: the plain part takes the newer of the two
//! plain writes and the dictionary part the newer entry per subkey, where "newer" is the total
//! order of [`Entry`]: by expiration, then, on equal expirations, by value bytes (larger wins),
//! then by signature (see below), so that two different writes with the same expiration merge
//! the same way everywhere. It is commutative, associative and idempotent (property-tested),
//! and equal to the value holding all the writes ever merged in, whatever the order.
//! [`merge_all`] folds a GET's answers.
//!
//! Both parts are kept, even the one the view hides, because hivemind's rules are
//! order-dependent and no value that keeps only what is visible can make them
//! order-independent: stored one after the
//! other, `{a: t1}`, then a plain value at `t2 > t1`, then `{b: t3 > t2}` leave hivemind with
//! `{b}`, while the same writes in the order `{a}`, `{b}`, plain leave `{a, b}`. Keeping the hidden
//! part gives `{a, b}` in every order: a newer plain value *hides* older entries but does not
//! delete them, and they show again (until they expire) once a subkey write newer than the plain
//! value arrives. This is exactly hivemind's answer for every single write onto an existing
//! value (the tests replay `test_dht_storage.py::test_localstorage_nested` assertion by
//! assertion), and differs only in such sequences. Where hivemind is order-dependent on ties (a plain write and a subkey
//! write with the *same* expiration: each keeps the one stored first), we show the dictionary.
//!
//! # Expiry
//!
//! An entry is live while `now <= expiration` and expired once `expiration < now` (hivemind's
//! `TimedStorage` drops `expiration_time < get_dht_time()`). [`DhtValue::without_expired`] drops
//! expired writes, visible or hidden; a value with nothing left vanishes (`None`). Dropping
//! expired writes commutes with merging (property-tested), and never switches the view to an
//! older write: the write the view shows expires last.
//!
//! # Inbound records
//!
//! [`DhtValue::from_bytes`] checks the length before decoding and the subkey count before
//! building the map, and rejects non-finite expirations, empty subkeys (hivemind reserves `b""`
//! for "the whole dictionary"), duplicate subkeys and values holding nothing with typed
//! [`DhtValueError`]s; it never panics on arbitrary bytes. [`DhtValue::validate`] then checks a
//! value against [`ValidationLimits`] at `now`, including that no expiration lies past the
//! [horizon](ValidationLimits::horizon) `now + max_expiration_ahead + max_clock_skew`: a write's
//! expiration is its version, so an unbounded one would win every merge forever. Clocks
//! differ, so a reader does not refuse a replica's whole answer for a write past *its* horizon
//! (one that a replica whose clock runs ahead accepted): it drops that write and keeps the
//! rest ([`Dht::get`]). Expired writes are not an error (a replica may answer before
//! it pruned them); callers drop them with [`DhtValue::without_expired`]. Merging two valid
//! values can exceed the limits (the union of two full dictionaries); the record store validates
//! the merge result as well and keeps its current value when an inbound record would push it
//! over.
//!
//! # Owner subkeys: signed entries
//!
//! A subkey *names a peer* when it is an **owner subkey**: [`OWNER_SUBKEY_PREFIX`] (`0xff`
//! `owner:`, never valid UTF-8, so no textual subkey is one by accident) followed by exactly the
//! bytes of a libp2p [`PeerId`] ([`owner_subkey`], [`subkey_owner`]). Only that peer may write
//! it: its entry must carry the peer's signature ([`Entry::signature`]) over
//! [`signing_payload`], a domain-separated, length-prefixed encoding of the **record key**, the
//! subkey, the value bytes and the expiration, so a signature cannot be replayed under another
//! key, onto another value, or as another version. The verifying key is the one
//! embedded in the peer id (libp2p peer ids are the identity multihash of the protobuf-encoded
//! public key for keys of up to 42 bytes, Ed25519 included), so only the signature travels;
//! owner subkeys naming a peer whose id is a hash of its key (RSA, ECDSA) are refused
//! ([`DhtValueError::KeyNotEmbedded`]). Every other subkey, and the plain value, stays
//! unsigned and writable by anyone. This is hivemind's `RSASignatureValidator` restricted to
//! subkeys (digest §5.4), with the owner marker a typed prefix instead of a `[owner:<key>]`
//! substring and Ed25519 libp2p identities instead of RSA keys.
//!
//! [`DhtValue::validate`] takes the record key and enforces the rule on every entry, visible
//! or hidden: an owner subkey that is not a peer id
//! ([`MalformedOwnerSubkey`](DhtValueError::MalformedOwnerSubkey)), an owner entry without a
//! signature ([`MissingSignature`](DhtValueError::MissingSignature)) or with one that does not
//! verify for the named peer ([`BadSignature`](DhtValueError::BadSignature): forged, made by
//! another key, or over another key, value or expiration), and a signature on an ordinary
//! entry or the plain value ([`UnexpectedSignature`](DhtValueError::UnexpectedSignature)) make
//! the whole value invalid. The record store ([`DhtPolicy`]) validates every inbound record,
//! local or remote, before merging and rejects it whole (the stored value survives); a reader
//! ([`Dht::get`]) validates every replica's answer and skips a replica whose answer fails, so
//! neither a peer writing nor a replica answering can inject an entry under another peer's
//! owner subkey.
//! [`DhtValue::owned`] builds a signed write of the keypair's own owner subkey, and
//! [`Dht::store`] signs automatically when given the local peer's owner subkey and refuses
//! another peer's ([`DhtError::NotOwner`]).
//!
//! The signature is part of the entry and of its order, after expiration and value, so
//! [`merge`] stays a join with signed entries (property-tested): two writes with equal
//! expirations and values but different signature bytes (a non-deterministic signature scheme)
//! merge the same way everywhere. Replaying an owner's older signed write changes nothing, as
//! the later expiration wins; replaying one that has expired is dropped as expired. The owner
//! itself leaves as anyone does, with a later signed write.
//!
//! What the rule does not cover: a plain write to the key, newer than every subkey, *hides*
//! the dictionary from [`DhtValue::view`] (hivemind's rule), for at most
//! `max_expiration_ahead`. It does not delete anything, so readers of per-peer declarations use
//! [`DhtValue::owner_entries`], which lists every owner entry, hidden or not, with its peer.
//! Keys that resist this, and squatting in general, are owned keys (below).
//! Signature checks cost one verification per new entry; the record store skips entries it
//! already holds identically and a reader verifies each distinct entry once per GET.
//!
//! # Owned keys: squatting
//!
//! Under an ordinary key anyone can write anything within the limits, so one peer can freeze
//! a predictable key for up to `max_expiration_ahead`: a plain value as large as
//! `max_value_bytes` leaves no room to merge another entry next to it, and `max_subkeys` owner
//! entries signed by throwaway keys leave no subkey free. The averager's keys are predictable
//! (`{prefix}.0b…` for matchmaking, `{prefix}.all_averagers`, the relay directory), so they
//! are **owned keys** ([`owned_key`]: [`OWNED_KEY_PREFIX`], `0xff` `owned:`, then the name),
//! under which:
//!
//! * there is no plain value ([`PlainOnOwnedKey`](DhtValueError::PlainOnOwnedKey)) and no
//!   ordinary subkey ([`OrdinarySubkeyOnOwnedKey`](DhtValueError::OrdinarySubkeyOnOwnedKey)):
//!   every entry is an owner entry, signed;
//! * no entry's value exceeds [`ValidationLimits::max_owned_entry_bytes`] (1,040 bytes;
//!   [`OwnedEntryTooLarge`](DhtValueError::OwnedEntryTooLarge)), so filling the key's
//!   768 KiB takes about 670 owners, and its 4,096 subkeys as many owners;
//! * a replica takes an entry only from its owner: every entry of a remote PUT must be the
//!   sender's own ([`NotFromOwner`](DhtValueError::NotFromOwner); the sender is the
//!   noise-authenticated peer of the connection). Replicas neither republish nor replicate
//!   (values expire within the hour), so honest PUTs always come from their writers.
//!
//! The first two rules are part of [`DhtValue::validate`], so readers apply them to every
//! replica's answer too; the third only a replica can check. Together they turn "one peer
//! freezes the key" into "as many authenticated peers as the key has room for, each
//! connected to every replica of the key" (what a sybil with that many identities can still
//! do; `tests/integration/dht_swarm.rs::squatters_cannot_freeze_owned_keys` shows both attacks freezing an
//! ordinary key and failing on an owned one). A replica that lies in its answers can still
//! show a reader entries from throwaway owners (each costs the reader a signature check);
//! readers of the averager's keys treat declared peers as candidates, not as trusted.
//!
//! Every function here is pure: time comes in as a `now` argument ([`DhtTime::now`] is only a
//! convenience for callers).

mod addrs;
mod client;
mod owner;
pub mod relays;
mod value;
mod wire;

#[cfg(test)]
mod tests;

use std::time::Duration;

use libp2p::PeerId;

pub use addrs::{MAX_ADDR_BYTES, MAX_ADDRS, decode_addrs, encode_addrs};
pub(crate) use client::read_answer;
pub use client::{Dht, DhtError, DhtPolicy, StoreRequest};
pub(crate) use owner::embedded_public_key;
pub use owner::{
    DEFAULT_VERIFIED_ENTRIES, OWNED_KEY_PREFIX, OWNER_SUBKEY_PREFIX, SIGNING_DOMAIN, SignError,
    VerifiedEntries, is_owned_key, owned_key, owner_subkey, signing_payload, subkey_owner,
};
pub use relays::{RELAYS_KEY, RelayDirectory, lookup_relays};
pub use value::{DhtTime, DhtValue, DhtView, Entry, merge, merge_all};

/// Default [`ValidationLimits::max_value_bytes`]: 768 KiB.
pub const DEFAULT_MAX_VALUE_BYTES: usize = 768 << 10;
/// Default [`ValidationLimits::max_subkeys`].
pub const DEFAULT_MAX_SUBKEYS: usize = 4096;
/// Default [`ValidationLimits::max_expiration_ahead`]: one hour.
pub const DEFAULT_MAX_EXPIRATION_AHEAD: Duration = Duration::from_secs(3600);

/// Default [`ValidationLimits::max_owned_entry_bytes`]: 1,040 bytes, room for the largest value
/// the averager writes under an owned key (a matchmaking declaration: one tag byte and up to
/// 1,024 contact bytes; state and relay announcements carry at most 4 addresses of 128 bytes).
pub const DEFAULT_MAX_OWNED_ENTRY_BYTES: usize = 1040;

/// Default [`ValidationLimits::max_clock_skew`]: five minutes, well past what NTP-synced
/// machines drift (milliseconds) and enough for a home machine whose clock was set by hand.
pub const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);

/// Limits an inbound value must respect.
///
/// The defaults: **768 KiB** of encoded value, three quarters of the 1 MiB record bound the p2p
/// layer configures (its Kademlia packets are 1 MiB + 64 KiB, `rust-stack.md` §5), so that a
/// record plus its key, the kad envelope and a GET answer's list of closer peers (a few KiB)
/// always fits in one packet with over 300 KiB to spare; that is room for the largest
/// dictionary hivemind-style averaging writes at the default subkey limit: one *signed* entry
/// per averager under its owner subkey (45 bytes of subkey, a 64-byte signature, a 9-byte
/// expiration and framing: 4096 such entries with 1-byte values encode to 520 192 bytes,
/// measured), leaving about 60 bytes per entry for larger values. **4096 subkeys**: a
/// matchmaking key holds one entry per peer looking for a group in that bucket and the
/// state-sharing registry one per averager, so 4096 covers swarms of thousands of peers while
/// bounding the work of a merge and of checking its signatures (about 40 µs each on this
/// 2-core machine, 0.15 s for a full dictionary in the test profile). **One hour ahead**:
/// hivemind's writes expire seconds to minutes ahead (matchmaking declarations,
/// `declare_state_period` = 30 s), one hour leaves room for every such use and for clock skew
/// (hivemind tolerates 3 s), matches the planned kad `record_ttl`, and bounds how long one
/// bogus far-future write can win every merge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationLimits {
    /// Largest accepted encoded value, in bytes.
    pub max_value_bytes: usize,
    /// Most subkeys a value may hold (hidden ones included).
    pub max_subkeys: usize,
    /// How far past `now` an expiration may lie.
    pub max_expiration_ahead: Duration,
    /// How far another node's clock may run ahead of ours: added to `max_expiration_ahead`
    /// where a value is checked (a write ahead of this much is refused by a replica, and
    /// dropped from an answer by a reader; see [`Dht::get`]).
    pub max_clock_skew: Duration,
    /// Longest value one owner's entry may hold under an [owned key](owned_key): at the
    /// default, filling an owned key's 768 KiB takes entries from about 670 different owners.
    pub max_owned_entry_bytes: usize,
}

impl ValidationLimits {
    /// The latest expiration accepted at `now`: `now + max_expiration_ahead + max_clock_skew`.
    pub fn horizon(&self, now: DhtTime) -> DhtTime {
        now.saturating_add(self.max_expiration_ahead)
            .saturating_add(self.max_clock_skew)
    }
}

impl Default for ValidationLimits {
    fn default() -> Self {
        Self {
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_subkeys: DEFAULT_MAX_SUBKEYS,
            max_expiration_ahead: DEFAULT_MAX_EXPIRATION_AHEAD,
            max_clock_skew: DEFAULT_MAX_CLOCK_SKEW,
            max_owned_entry_bytes: DEFAULT_MAX_OWNED_ENTRY_BYTES,
        }
    }
}

/// A malformed or unacceptable DHT value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DhtValueError {
    /// The encoded value is longer than the limit.
    #[error("value of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Encoded length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// The value holds more subkeys than the limit.
    #[error("{count} subkeys exceed the limit of {max}")]
    TooManySubkeys {
        /// Subkeys in the value (from [`DhtValue::from_bytes`], which counts before decoding
        /// and stops at the first one over: the limit plus one).
        count: usize,
        /// Limit.
        max: usize,
    },
    /// A subkey is empty.
    #[error("empty subkey")]
    EmptySubkey,
    /// A subkey appears twice in an encoded value.
    #[error("duplicate subkey")]
    DuplicateSubkey,
    /// An encoded value has neither a plain value nor entries.
    #[error("value holds neither a plain value nor entries")]
    Empty,
    /// An expiration is NaN or infinite.
    #[error("expiration {0} is not a finite time")]
    NonFiniteExpiration(f64),
    /// An expiration lies further ahead than the limit allows.
    #[error("expiration {expiration} is past the horizon {horizon}")]
    ExpirationTooFar {
        /// The offending expiration.
        expiration: DhtTime,
        /// `now + max_expiration_ahead + max_clock_skew`.
        horizon: DhtTime,
    },
    /// The bytes are not a valid encoding.
    #[error("undecodable value: {0}")]
    Malformed(String),
    /// A subkey starts with [`OWNER_SUBKEY_PREFIX`] but the rest is not a peer id.
    #[error("subkey has the owner prefix but names no peer id")]
    MalformedOwnerSubkey,
    /// An owner subkey's entry carries no signature.
    #[error("entry of the owner subkey of {owner} is not signed")]
    MissingSignature {
        /// The peer the subkey names.
        owner: PeerId,
    },
    /// An owner subkey's signature does not verify for the peer the subkey names (forged, made
    /// by another key, or over another record key, value or expiration).
    #[error("entry of the owner subkey of {owner} has an invalid signature")]
    BadSignature {
        /// The peer the subkey names.
        owner: PeerId,
    },
    /// An owner subkey names a peer whose id does not embed its public key, so no signature
    /// by it can be verified.
    #[error("owner subkey names {owner}, whose peer id does not embed its public key")]
    KeyNotEmbedded {
        /// The peer the subkey names.
        owner: PeerId,
    },
    /// An ordinary subkey's entry or the plain value carries a signature (only owner subkeys
    /// are signed).
    #[error("an ordinary entry or the plain value carries a signature")]
    UnexpectedSignature,
    /// A plain value under an [owned key](owned_key), where only owner subkeys may be written.
    #[error("a plain value under an owned key")]
    PlainOnOwnedKey,
    /// An ordinary subkey under an [owned key](owned_key), where only owner subkeys may be
    /// written.
    #[error("an ordinary subkey under an owned key")]
    OrdinarySubkeyOnOwnedKey,
    /// An owner's entry under an [owned key](owned_key) holds a value over
    /// [`ValidationLimits::max_owned_entry_bytes`].
    #[error("an owned key's entry of {len} bytes exceeds the limit of {max}")]
    OwnedEntryTooLarge {
        /// The entry's value length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A peer sent a write of another owner's entry under an [owned key](owned_key); a
    /// replica takes an owned key's entries only from their owners.
    #[error("another peer sent the entry of {owner} under an owned key")]
    NotFromOwner {
        /// The peer the entry's subkey names (the sender is in the replica's log line).
        owner: PeerId,
    },
}
