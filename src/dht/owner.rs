//! Owner subkeys: subkeys that name a peer and that only that peer may write (see the
//! [module docs](super#owner-subkeys-signed-entries)).
//!
//! An owner subkey is [`OWNER_SUBKEY_PREFIX`] followed by the bytes of a [`PeerId`]. An entry
//! under it carries an Ed25519 (or any other libp2p) signature by that peer over
//! [`signing_payload`]: the record key, the subkey, the value and the expiration. The verifying
//! key comes out of the peer id itself (the identity multihash of the protobuf-encoded public
//! key, which libp2p uses for every key of at most 42 encoded bytes, Ed25519 included), so
//! nothing but the signature travels with the entry.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use libp2p::PeerId;
use libp2p::identity::{Keypair, PublicKey};
use sha2::{Digest as _, Sha256};

use super::DhtValueError;
use super::value::{DhtTime, DhtValue, Entry};

/// The reserved prefix of owner subkeys. Any subkey that starts with it must be the prefix
/// followed by exactly the bytes of a [`PeerId`]. It starts with `0xff`, a byte that never
/// occurs in UTF-8, so no textual subkey is an owner subkey by accident.
pub const OWNER_SUBKEY_PREFIX: &[u8] = b"\xffowner:";

/// The reserved prefix of owned keys: keys whose every entry is an owner subkey written by its
/// owner (see the [module docs](super#owned-keys-squatting)). Like [`OWNER_SUBKEY_PREFIX`] it
/// starts with `0xff`, so no textual key is owned by accident.
pub const OWNED_KEY_PREFIX: &[u8] = b"\xffowned:";

/// The owned key named `name`: [`OWNED_KEY_PREFIX`] followed by `name`. The averager's
/// matchmaking keys, its state-sharing registry and the relay directory are owned keys.
pub fn owned_key(name: impl AsRef<[u8]>) -> Vec<u8> {
    let name = name.as_ref();
    let mut key = Vec::with_capacity(OWNED_KEY_PREFIX.len() + name.len());
    key.extend_from_slice(OWNED_KEY_PREFIX);
    key.extend_from_slice(name);
    key
}

/// Whether `key` is an owned key ([`owned_key`]).
pub fn is_owned_key(key: &[u8]) -> bool {
    key.starts_with(OWNED_KEY_PREFIX)
}

/// Domain separation tag at the start of every [`signing_payload`].
pub const SIGNING_DOMAIN: &[u8] = b"hivemesh/dht/owner-entry/v1\0";

/// Multihash code of the identity hash: the "digest" is the input itself.
const IDENTITY_MULTIHASH: u64 = 0;

/// The owner subkey of `peer`: [`OWNER_SUBKEY_PREFIX`] followed by `peer`'s bytes.
pub fn owner_subkey(peer: &PeerId) -> Bytes {
    let mut subkey = OWNER_SUBKEY_PREFIX.to_vec();
    subkey.extend_from_slice(&peer.to_bytes());
    Bytes::from(subkey)
}

/// The peer an owner subkey names: `Ok(None)` for an ordinary subkey (one without
/// [`OWNER_SUBKEY_PREFIX`]), `Ok(Some(peer))` for an owner subkey, and
/// [`DhtValueError::MalformedOwnerSubkey`] for the prefix followed by anything but a peer id.
pub fn subkey_owner(subkey: &[u8]) -> Result<Option<PeerId>, DhtValueError> {
    match subkey.strip_prefix(OWNER_SUBKEY_PREFIX) {
        None => Ok(None),
        Some(id) => PeerId::from_bytes(id)
            .map(Some)
            .map_err(|_| DhtValueError::MalformedOwnerSubkey),
    }
}

/// The bytes an owner signs for one entry: [`SIGNING_DOMAIN`], then the record key, the subkey
/// and the value, each preceded by its length as a big-endian `u64`, then the expiration's
/// IEEE 754 bits, big-endian. Every field is covered, so a signature cannot be replayed under
/// another key or subkey, with another value, or with another expiration (version).
pub fn signing_payload(key: &[u8], subkey: &[u8], value: &[u8], expiration: DhtTime) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        SIGNING_DOMAIN.len() + 3 * 8 + key.len() + subkey.len() + value.len() + 8,
    );
    out.extend_from_slice(SIGNING_DOMAIN);
    for field in [key, subkey, value] {
        out.extend_from_slice(&(field.len() as u64).to_be_bytes());
        out.extend_from_slice(field);
    }
    out.extend_from_slice(&expiration.as_secs().to_bits().to_be_bytes());
    out
}

/// The public key embedded in `peer`, if its id is the identity multihash of its key.
pub(crate) fn embedded_public_key(peer: &PeerId) -> Option<PublicKey> {
    let mh = peer.as_ref();
    (mh.code() == IDENTITY_MULTIHASH)
        .then(|| PublicKey::try_decode_protobuf(mh.digest()).ok())
        .flatten()
}

/// Why an owner entry could not be signed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignError {
    /// The keypair's peer id is a hash of its public key (RSA, ECDSA), so verifiers could not
    /// recover the key from the subkey; owner subkeys need keys embedded in the peer id.
    #[error("peer id {0} does not embed its public key; owner subkeys need one that does")]
    KeyNotEmbedded(PeerId),
    /// The keypair failed to sign.
    #[error("signing failed: {0}")]
    Failed(String),
}

impl DhtValue {
    /// A write of `keypair`'s own owner subkey under `key`, signed by `keypair`: the only kind
    /// of write to an owner subkey that [`validate`](Self::validate) accepts.
    pub fn owned(
        key: &[u8],
        keypair: &Keypair,
        value: impl Into<Bytes>,
        expiration: DhtTime,
    ) -> Result<Self, SignError> {
        let peer = keypair.public().to_peer_id();
        if embedded_public_key(&peer).is_none() {
            return Err(SignError::KeyNotEmbedded(peer));
        }
        let subkey = owner_subkey(&peer);
        let value = value.into();
        let signature = keypair
            .sign(&signing_payload(key, &subkey, &value, expiration))
            .map_err(|e| SignError::Failed(e.to_string()))?;
        let entry = Entry::new(value, expiration).with_signature(signature);
        Ok(Self::from_parts(None, [(subkey, entry)]).expect("one entry"))
    }

    /// Every owner subkey's entry, visible or hidden by a newer plain value, with the peer that
    /// wrote it. Readers of per-peer declarations should use this rather than
    /// [`view`](Self::view): a plain write by anyone can hide a dictionary, but not delete it.
    /// Subkeys that are not well-formed owner subkeys are skipped (a value that passed
    /// [`validate`](Self::validate) has none).
    pub fn owner_entries(&self) -> impl Iterator<Item = (PeerId, &Entry)> {
        self.subkeys()
            .range::<[u8], _>((
                std::ops::Bound::Included(OWNER_SUBKEY_PREFIX),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(k, _)| k.starts_with(OWNER_SUBKEY_PREFIX))
            .filter_map(|(k, e)| Some((subkey_owner(k).ok()??, e)))
    }
}

/// Checks the ownership rule for one entry of the value stored under `key`: an ordinary subkey
/// carries no signature, an owner subkey is well-formed and carries a valid signature by the
/// peer it names.
pub(super) fn check_entry(key: &[u8], subkey: &[u8], entry: &Entry) -> Result<(), DhtValueError> {
    let Some(owner) = subkey_owner(subkey)? else {
        return match entry.signature {
            Some(_) => Err(DhtValueError::UnexpectedSignature),
            None => Ok(()),
        };
    };
    let signature = entry
        .signature
        .as_ref()
        .ok_or(DhtValueError::MissingSignature { owner })?;
    let public = embedded_public_key(&owner).ok_or(DhtValueError::KeyNotEmbedded { owner })?;
    let payload = signing_payload(key, subkey, &entry.value, entry.expiration);
    if public.verify(&payload, signature) {
        Ok(())
    } else {
        Err(DhtValueError::BadSignature { owner })
    }
}

/// Owner entries whose signatures were verified lately, by digest: a replayed or re-read entry
/// is not verified again. Shared by a node's record policy and its readers (clones share the
/// set); FIFO-bounded.
///
/// The digest is SHA-256 over the record key, the subkey, the value, the expiration and the
/// signature, each length-prefixed: an entry is skipped only when every byte that its
/// signature check covered is the same as in one that passed it.
#[derive(Clone)]
pub struct VerifiedEntries {
    inner: Arc<Mutex<Verified>>,
}

struct Verified {
    set: HashSet<[u8; 32]>,
    order: VecDeque<[u8; 32]>,
    capacity: usize,
}

/// Default capacity of [`VerifiedEntries`]: eight full dictionaries (2 MiB of digests).
pub const DEFAULT_VERIFIED_ENTRIES: usize = 32_768;

impl Default for VerifiedEntries {
    fn default() -> Self {
        Self::new(DEFAULT_VERIFIED_ENTRIES)
    }
}

impl std::fmt::Debug for VerifiedEntries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedEntries")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl VerifiedEntries {
    /// An empty set remembering at most `capacity` entries (the oldest are forgotten first).
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Verified {
                set: HashSet::new(),
                order: VecDeque::new(),
                capacity: capacity.max(1),
            })),
        }
    }

    /// Entries remembered now.
    pub fn len(&self) -> usize {
        self.lock().set.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Verified> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn contains(&self, digest: &[u8; 32]) -> bool {
        self.lock().set.contains(digest)
    }

    fn insert(&self, digest: [u8; 32]) {
        let mut v = self.lock();
        if v.set.insert(digest) {
            v.order.push_back(digest);
            while v.order.len() > v.capacity {
                if let Some(old) = v.order.pop_front() {
                    v.set.remove(&old);
                }
            }
        }
    }
}

fn entry_digest(key: &[u8], subkey: &[u8], entry: &Entry) -> [u8; 32] {
    let mut h = Sha256::new();
    let signature = entry.signature.as_deref().unwrap_or_default();
    for field in [key, subkey, &entry.value[..], signature] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field);
    }
    h.update(entry.expiration.as_secs().to_bits().to_be_bytes());
    h.finalize().into()
}

/// [`check_entry`], skipping owner entries `cache` holds and remembering those that pass.
pub(super) fn check_entry_cached(
    key: &[u8],
    subkey: &[u8],
    entry: &Entry,
    cache: Option<&VerifiedEntries>,
) -> Result<(), DhtValueError> {
    let Some(cache) = cache.filter(|_| entry.signature.is_some()) else {
        return check_entry(key, subkey, entry);
    };
    let digest = entry_digest(key, subkey, entry);
    if cache.contains(&digest) {
        return Ok(());
    }
    check_entry(key, subkey, entry)?;
    cache.insert(digest);
    Ok(())
}
