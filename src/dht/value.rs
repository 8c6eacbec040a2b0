//! [`DhtTime`], [`Entry`], [`DhtValue`] and the pure functions on them: [`merge`],
//! [`merge_all`], [`DhtValue::without_expired`] and [`DhtValue::validate`].
//!
//! Owner subkeys and their signatures are in `owner.rs`.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::collections::btree_map;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::{DhtValueError, ValidationLimits};

/// A wall-clock time in seconds since the UNIX epoch: always finite, totally ordered.
///
/// `-0.0` is stored as `0.0`, so equality, order and hashing agree with the numeric value.
#[derive(Clone, Copy, Debug)]
pub struct DhtTime(f64);

impl DhtTime {
    /// The UNIX epoch.
    pub const EPOCH: Self = Self(0.0);

    /// `secs` seconds since the UNIX epoch, or `None` if `secs` is NaN or infinite.
    pub fn from_secs(secs: f64) -> Option<Self> {
        // Adding +0.0 turns -0.0 into +0.0 and leaves every other finite value unchanged.
        secs.is_finite().then_some(Self(secs + 0.0))
    }

    /// The current wall-clock time (a convenience for callers; nothing in this module reads the
    /// clock). Times before the epoch come out negative.
    pub fn now() -> Self {
        let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        };
        Self(secs + 0.0)
    }

    /// Seconds since the UNIX epoch.
    pub fn as_secs(self) -> f64 {
        self.0
    }

    /// `self + d`, saturating at the largest finite time.
    pub fn saturating_add(self, d: Duration) -> Self {
        let t = self.0 + d.as_secs_f64();
        Self(if t.is_finite() { t } else { f64::MAX })
    }

    /// The next representable time after `self` (the largest finite time stays as it is):
    /// hivemind's `nextafter(expiration, inf)`, the expiration of a write that must supersede
    /// one at `self`, such as leaving a group.
    pub fn next_up(self) -> Self {
        let t = self.0.next_up();
        Self(if t.is_finite() { t } else { self.0 })
    }
}

impl PartialEq for DhtTime {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for DhtTime {}

impl PartialOrd for DhtTime {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for DhtTime {
    fn cmp(&self, other: &Self) -> Ordering {
        // Both are finite and neither is -0.0, so this is the numeric order.
        self.0.total_cmp(&other.0)
    }
}

impl Hash for DhtTime {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}

impl fmt::Display for DhtTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}s", self.0)
    }
}

/// One write: a value, its expiration and, for an owner subkey, its owner's signature.
///
/// Entries are ordered by expiration, then by value bytes, then by signature (none first, then
/// by bytes): the order in which [`merge`] picks the newer of two writes (the larger wins).
/// The signature is last so that it only settles ties between writes that are otherwise equal.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Entry {
    /// When the write expires; also its version.
    pub expiration: DhtTime,
    /// The value bytes (opaque to the DHT).
    pub value: Bytes,
    /// The owner's signature over [`signing_payload`](super::signing_payload); present exactly
    /// on entries of owner subkeys (see [`DhtValue::validate`]). Never `Some` of empty bytes:
    /// the wire encodes "no signature" as empty bytes, and has no signature for plain values.
    pub signature: Option<Bytes>,
}

impl Entry {
    /// An unsigned entry.
    pub fn new(value: impl Into<Bytes>, expiration: DhtTime) -> Self {
        Self {
            expiration,
            value: value.into(),
            signature: None,
        }
    }

    /// The entry with `signature` attached (see [`DhtValue::owned`] for signing).
    pub fn with_signature(mut self, signature: impl Into<Bytes>) -> Self {
        self.signature = Some(signature.into());
        self
    }

    /// Whether the entry has expired at `now` (`expiration < now`).
    pub fn is_expired(&self, now: DhtTime) -> bool {
        self.expiration < now
    }
}

/// What one key holds: the newest plain write, if any, and the newest write of every subkey
/// (never neither). See the [module docs](super) for what a reader sees and how values merge.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DhtValue {
    plain: Option<Entry>,
    subkeys: BTreeMap<Bytes, Entry>,
}

/// What a reader of a key sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DhtView<'a> {
    /// A plain value: its expiration is later than every subkey's.
    Plain(&'a Entry),
    /// A dictionary of subkeys (never empty); its expiration is its latest entry's.
    Dictionary(&'a BTreeMap<Bytes, Entry>),
}

impl DhtValue {
    /// A plain write.
    pub fn plain(value: impl Into<Bytes>, expiration: DhtTime) -> Self {
        Self {
            plain: Some(Entry::new(value, expiration)),
            subkeys: BTreeMap::new(),
        }
    }

    /// A write of one subkey.
    pub fn subkey(subkey: impl Into<Bytes>, value: impl Into<Bytes>, expiration: DhtTime) -> Self {
        Self {
            plain: None,
            subkeys: BTreeMap::from([(subkey.into(), Entry::new(value, expiration))]),
        }
    }

    /// The value holding `plain` and the given subkey writes (a subkey given twice keeps its
    /// newer write), or `None` if there are none.
    pub fn from_parts(
        plain: Option<Entry>,
        subkeys: impl IntoIterator<Item = (Bytes, Entry)>,
    ) -> Option<Self> {
        let mut map = BTreeMap::new();
        for (k, e) in subkeys {
            insert_newer(&mut map, k, e);
        }
        (plain.is_some() || !map.is_empty()).then_some(Self {
            plain,
            subkeys: map,
        })
    }

    /// What a reader sees: the plain value if its expiration is strictly later than every
    /// subkey's, else the dictionary.
    pub fn view(&self) -> DhtView<'_> {
        match (&self.plain, self.latest_subkey_expiration()) {
            (Some(p), Some(latest)) if p.expiration <= latest => DhtView::Dictionary(&self.subkeys),
            (Some(p), _) => DhtView::Plain(p),
            (None, _) => DhtView::Dictionary(&self.subkeys),
        }
    }

    /// The expiration of what [`view`](Self::view) shows (for a dictionary, its latest entry's),
    /// which is also the latest expiration the value holds.
    pub fn expiration(&self) -> DhtTime {
        let plain = self.plain.as_ref().map(|p| p.expiration);
        // One of the two is present by construction; EPOCH only keeps this total.
        plain
            .max(self.latest_subkey_expiration())
            .unwrap_or(DhtTime::EPOCH)
    }

    /// The newest plain write, visible or hidden.
    pub fn plain_entry(&self) -> Option<&Entry> {
        self.plain.as_ref()
    }

    /// The newest write of every subkey, visible or hidden.
    pub fn subkeys(&self) -> &BTreeMap<Bytes, Entry> {
        &self.subkeys
    }

    fn latest_subkey_expiration(&self) -> Option<DhtTime> {
        self.subkeys.values().map(|e| e.expiration).max()
    }

    /// The value without the writes expired at `now`; `None` if nothing is left.
    pub fn without_expired(mut self, now: DhtTime) -> Option<Self> {
        self.plain = self.plain.filter(|p| !p.is_expired(now));
        self.subkeys.retain(|_, e| !e.is_expired(now));
        (self.plain.is_some() || !self.subkeys.is_empty()).then_some(self)
    }

    /// The value without the writes that expire after `horizon`, and how many were dropped;
    /// `None` if nothing is left. A reader applies it to each replica's answer: a write that a
    /// replica whose clock runs ahead accepted is dropped, and the rest of the answer kept.
    pub fn without_past(mut self, horizon: DhtTime) -> (Option<Self>, usize) {
        let before = self.subkeys.len() + usize::from(self.plain.is_some());
        self.plain = self.plain.filter(|p| p.expiration <= horizon);
        self.subkeys.retain(|_, e| e.expiration <= horizon);
        let dropped = before - self.subkeys.len() - usize::from(self.plain.is_some());
        let left = (self.plain.is_some() || !self.subkeys.is_empty()).then_some(self);
        (left, dropped)
    }

    /// Checks the value stored under `key` against `limits` at `now`: at most `max_subkeys`
    /// subkeys, none empty, no expiration past [`ValidationLimits::horizon`], at most
    /// `max_value_bytes` encoded; and the ownership rule: every subkey starting with
    /// [`OWNER_SUBKEY_PREFIX`](super::OWNER_SUBKEY_PREFIX) names a peer and its entry carries
    /// a valid signature by that peer over `key`, the subkey, the value and the expiration,
    /// while other entries (ordinary subkeys, the plain value) carry no signature. Under an
    /// [owned key](super::owned_key) there must be no plain value and no ordinary subkey, and
    /// no entry's value may exceed `max_owned_entry_bytes`. Expired writes are not an error
    /// (see [`without_expired`](Self::without_expired)).
    pub fn validate(
        &self,
        key: &[u8],
        now: DhtTime,
        limits: &ValidationLimits,
    ) -> Result<(), DhtValueError> {
        self.validate_against(key, now, limits, None, None)
    }

    /// [`validate`](Self::validate), skipping the signature check of every entry that
    /// `verified` (a value already validated under the same `key`) holds identically under the
    /// same subkey. The record store passes its stored value and a reader the replicas' answers
    /// it accepted so far, so that each signature is checked once rather than on every copy.
    /// Owner entries `cache` holds are not checked again either, and those that pass are added
    /// to it.
    pub(super) fn validate_against(
        &self,
        key: &[u8],
        now: DhtTime,
        limits: &ValidationLimits,
        verified: Option<&DhtValue>,
        cache: Option<&super::VerifiedEntries>,
    ) -> Result<(), DhtValueError> {
        self.validate_limits(now, limits)?;
        if super::is_owned_key(key) {
            self.validate_owned(limits)?;
        }
        if self.plain.as_ref().is_some_and(|p| p.signature.is_some()) {
            return Err(DhtValueError::UnexpectedSignature);
        }
        // Signatures last: they are the expensive part.
        for (k, e) in &self.subkeys {
            if verified.is_some_and(|v| v.subkeys.get(k) == Some(e)) {
                continue;
            }
            super::owner::check_entry_cached(key, k, e, cache)?;
        }
        Ok(())
    }

    /// The rules of an [owned key](super::owned_key), signatures aside: no plain value, only
    /// owner subkeys, none holding more than `max_owned_entry_bytes`.
    fn validate_owned(&self, limits: &ValidationLimits) -> Result<(), DhtValueError> {
        if self.plain.is_some() {
            return Err(DhtValueError::PlainOnOwnedKey);
        }
        for (k, e) in &self.subkeys {
            if !k.starts_with(super::OWNER_SUBKEY_PREFIX) {
                return Err(DhtValueError::OrdinarySubkeyOnOwnedKey);
            }
            if e.value.len() > limits.max_owned_entry_bytes {
                return Err(DhtValueError::OwnedEntryTooLarge {
                    len: e.value.len(),
                    max: limits.max_owned_entry_bytes,
                });
            }
        }
        Ok(())
    }

    /// The part of [`validate`](Self::validate) that does not depend on the key: the limits.
    pub(super) fn validate_limits(
        &self,
        now: DhtTime,
        limits: &ValidationLimits,
    ) -> Result<(), DhtValueError> {
        if self.subkeys.len() > limits.max_subkeys {
            return Err(DhtValueError::TooManySubkeys {
                count: self.subkeys.len(),
                max: limits.max_subkeys,
            });
        }
        if self.subkeys.contains_key(&b""[..]) {
            return Err(DhtValueError::EmptySubkey);
        }
        let horizon = limits.horizon(now);
        if let Some(e) = self
            .plain
            .iter()
            .chain(self.subkeys.values())
            .find(|e| e.expiration > horizon)
        {
            return Err(DhtValueError::ExpirationTooFar {
                expiration: e.expiration,
                horizon,
            });
        }
        let len = self.encoded_len();
        if len > limits.max_value_bytes {
            return Err(DhtValueError::TooLarge {
                len,
                max: limits.max_value_bytes,
            });
        }
        Ok(())
    }
}

/// Inserts `e` under `k` unless `map` already holds a newer (or the same) entry there.
pub(super) fn insert_newer(map: &mut BTreeMap<Bytes, Entry>, k: Bytes, e: Entry) {
    match map.entry(k) {
        btree_map::Entry::Vacant(v) => {
            v.insert(e);
        }
        btree_map::Entry::Occupied(mut o) => {
            if e > *o.get() {
                o.insert(e);
            }
        }
    }
}

/// Merges two copies of a key: the newer plain write and, per subkey, the newer write, in the
/// order of [`Entry`] (expiration, then value bytes, then signature). Commutative, associative,
/// idempotent.
pub fn merge(a: DhtValue, b: DhtValue) -> DhtValue {
    // Insert the smaller dictionary into the larger one.
    let (mut into, from) = if a.subkeys.len() >= b.subkeys.len() {
        (a, b)
    } else {
        (b, a)
    };
    into.plain = into.plain.max(from.plain);
    for (k, e) in from.subkeys {
        insert_newer(&mut into.subkeys, k, e);
    }
    into
}

/// Merges any number of copies of a key (the answers of several replicas to a GET); `None` if
/// there are none. The result does not depend on their order.
pub fn merge_all(values: impl IntoIterator<Item = DhtValue>) -> Option<DhtValue> {
    values.into_iter().reduce(merge)
}
