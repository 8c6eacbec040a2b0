//! The DHT over the p2p layer: [`DhtPolicy`] validates and merges records inside the swarm's
//! event loop, and [`Dht`] stores and reads typed values, merging every replica's answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use libp2p::{PeerId, identity::Keypair};

use super::{
    DhtTime, DhtValue, DhtValueError, SignError, ValidationLimits, VerifiedEntries, is_owned_key,
    merge, owner_subkey, subkey_owner,
};
use crate::p2p::{P2p, P2pConfig, P2pError, RecordPolicy};

/// Errors of DHT operations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DhtError {
    /// The network layer failed.
    #[error(transparent)]
    P2p(#[from] P2pError),
    /// The value is not acceptable.
    #[error(transparent)]
    Value(#[from] DhtValueError),
    /// The write is to the owner subkey of another peer, which only that peer can sign.
    #[error("the subkey belongs to {owner}; this node is {local}")]
    NotOwner {
        /// The peer the subkey names.
        owner: PeerId,
        /// This node's peer id.
        local: PeerId,
    },
    /// Signing a write to this node's owner subkey failed.
    #[error(transparent)]
    Sign(#[from] SignError),
}

fn to_dht_time(t: SystemTime) -> DhtTime {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    DhtTime::from_secs(secs).unwrap_or_else(|| DhtTime::from_secs(0.0).expect("0 is finite"))
}

fn to_system_time(t: DhtTime) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(t.as_secs().max(0.0))
}

/// Validates inbound records and merges them with the stored value (see [`crate::dht`]).
///
/// An inbound value must decode within the limits, be valid under the record key at `now`
/// ([`DhtValue::validate`]: limits and the owner-subkey signatures) and hold at least one live
/// write; under an [owned key](super::owned_key), a remote peer's write must hold only its own
/// entry ([`DhtValueError::NotFromOwner`]); the merge result must be valid too, otherwise the
/// stored value is kept. Expired writes are pruned from the stored value on every merge.
///
/// Checks run cheapest first (length, counts, limits, ownership, then signatures). The
/// signatures run in [`precheck`](RecordPolicy::precheck), which the p2p layer calls on a
/// blocking thread for remote writes, so the swarm's event loop never verifies a flood of
/// them; the entries that pass are remembered ([`VerifiedEntries`], shared with the node's
/// readers), so the merge that follows on the event loop, and any replay of the same entries,
/// verifies nothing again. Entries the stored value holds identically are skipped as well.
#[derive(Clone, Debug, Default)]
pub struct DhtPolicy {
    /// The limits every value must respect.
    pub limits: ValidationLimits,
    /// Owner entries verified lately.
    verified: VerifiedEntries,
}

impl DhtPolicy {
    /// A policy with `limits` and its own cache of verified entries.
    pub fn new(limits: ValidationLimits) -> Self {
        Self {
            limits,
            verified: VerifiedEntries::default(),
        }
    }

    /// The policy's cache of verified owner entries (shared by clones).
    pub fn verified(&self) -> &VerifiedEntries {
        &self.verified
    }

    /// Decodes `incoming` and checks what needs no stored value: the ownership of a remote
    /// write under an owned key, then the value's validity (signatures last).
    fn check(
        &self,
        key: &[u8],
        incoming: &[u8],
        source: Option<PeerId>,
        now: DhtTime,
        stored: Option<&DhtValue>,
    ) -> Result<DhtValue, String> {
        let incoming = DhtValue::from_bytes(incoming, &self.limits).map_err(|e| e.to_string())?;
        if let Some(source) = source
            && is_owned_key(key)
        {
            from_owner(&incoming, source).map_err(|e| e.to_string())?;
        }
        incoming
            .validate_against(key, now, &self.limits, stored, Some(&self.verified))
            .map_err(|e| e.to_string())?;
        Ok(incoming)
    }
}

impl RecordPolicy for DhtPolicy {
    fn precheck(
        &self,
        key: &[u8],
        incoming: &[u8],
        source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(), String> {
        self.check(key, incoming, source, to_dht_time(now), None)
            .map(drop)
    }

    fn merge(
        &self,
        key: &[u8],
        existing: Option<&[u8]>,
        incoming: &[u8],
        source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(Vec<u8>, SystemTime), String> {
        let now = to_dht_time(now);
        // The stored value was validated under this key when it was merged in.
        let stored = existing
            .and_then(|b| DhtValue::from_bytes(b, &self.limits).ok())
            .and_then(|v| v.without_expired(now));
        let incoming = self.check(key, incoming, source, now, stored.as_ref())?;
        let incoming = incoming
            .without_expired(now)
            .ok_or_else(|| "every write in the record has expired".to_owned())?;
        let merged = match stored {
            Some(old) => merge(old, incoming),
            None => incoming,
        };
        // Every entry of the merge is one of the two validated values'; only the limits
        // (size, subkey count) can fail here.
        merged
            .validate_limits(now, &self.limits)
            .map_err(|e| format!("merged value: {e}"))?;
        Ok((merged.to_bytes(), to_system_time(merged.expiration())))
    }
}

/// Checks that every entry of `value`, a write `source` sent under an owned key, is
/// `source`'s own: a peer writes its own entry and nobody else's, so filling an owned key takes
/// as many authenticated peers as it has entries. (Replicas never forward records: publication
/// and replication are off, so every inbound PUT comes from its writer.)
fn from_owner(value: &DhtValue, source: PeerId) -> Result<(), DhtValueError> {
    for subkey in value.subkeys().keys() {
        // Ordinary subkeys are refused by the validation that follows.
        if let Some(owner) = subkey_owner(subkey)?
            && owner != source
        {
            return Err(DhtValueError::NotFromOwner { owner });
        }
    }
    Ok(())
}

/// One replica's answer to a read of `key`, checked at `now`: `Ok(None)` if nothing in it is
/// usable, an error if it is malformed or invalid (a forged or corrupt answer, skipped whole).
///
/// Writes expiring past this reader's [horizon](ValidationLimits::horizon) are dropped one by
/// one before the answer is validated: a replica whose clock runs ahead of ours accepted them
/// honestly, and the rest of its answer is good. Entries `verified` already holds identically
/// (accepted from another replica) are not verified again.
pub(crate) fn read_answer(
    key: &[u8],
    bytes: &[u8],
    now: DhtTime,
    limits: &ValidationLimits,
    verified: Option<&DhtValue>,
    cache: Option<&VerifiedEntries>,
) -> Result<Option<DhtValue>, DhtValueError> {
    let (value, dropped) = DhtValue::from_bytes(bytes, limits)?.without_past(limits.horizon(now));
    if dropped > 0 {
        tracing::debug!(
            dropped,
            "dropping writes past this reader's horizon (clock skew)"
        );
    }
    let Some(value) = value else {
        return Ok(None);
    };
    value.validate_against(key, now, limits, verified, cache)?;
    Ok(Some(value))
}

/// One write for [`Dht::store_many`].
#[derive(Clone, Debug, PartialEq)]
pub struct StoreRequest {
    /// The key.
    pub key: Vec<u8>,
    /// The subkey, or `None` for a plain value.
    pub subkey: Option<Vec<u8>>,
    /// The value.
    pub value: Vec<u8>,
    /// When it expires (also its version: the later write wins).
    pub expiration: DhtTime,
}

/// A DHT node: typed values with per-subkey expirations on a libp2p Kademlia swarm. It holds
/// the node's identity keypair to sign writes to its own owner subkey.
#[derive(Clone, Debug)]
pub struct Dht {
    p2p: P2p,
    limits: ValidationLimits,
    /// Shared with the node's record policy: entries a replica's answer repeats are verified
    /// once.
    verified: VerifiedEntries,
    /// The node's identity (the p2p layer's), which signs owner-subkey writes.
    keypair: Keypair,
}

impl Dht {
    /// Starts a node with the default [`DhtPolicy`] (see [`P2p::spawn`] for what starting means).
    pub async fn start(
        config: P2pConfig,
        keypair: Keypair,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), DhtError> {
        let policy = DhtPolicy::default();
        let limits = policy.limits.clone();
        let verified = policy.verified().clone();
        let (p2p, task) = P2p::spawn(config, keypair.clone(), Box::new(policy)).await?;
        Ok((
            Self {
                p2p,
                limits,
                verified,
                keypair,
            },
            task,
        ))
    }

    /// The underlying p2p handle.
    pub fn p2p(&self) -> &P2p {
        &self.p2p
    }

    /// The node's identity keypair (for the link layer's signed census statements).
    pub(crate) fn keypair(&self) -> &Keypair {
        &self.keypair
    }

    /// This node's owner subkey ([`owner_subkey`] of its peer id): the subkey under which it
    /// declares itself, and which no other peer can write.
    pub fn own_subkey(&self) -> Bytes {
        owner_subkey(&self.p2p.peer_id())
    }

    /// Stores `value` under `key` (and `subkey`, if given) until `expiration`. Returns the
    /// number of remote replicas that hold the write afterwards (0 for a lone node).
    /// Cancel-safe.
    ///
    /// Kademlia acknowledges a PUT before the replica's record policy decides, so an
    /// acknowledgement proves nothing (a replica refuses writes over a peer's share, invalid
    /// ones, ...): after the PUT, the key is read back from the replicas and those whose answer
    /// holds this write (or a newer one of the same subkey) are counted. That costs a read;
    /// [`Dht::store_unconfirmed`] skips it.
    ///
    /// A write to this node's owner subkey ([`Dht::own_subkey`]) is signed with the node's
    /// identity; a write to another peer's owner subkey fails with [`DhtError::NotOwner`].
    pub async fn store(
        &self,
        key: &[u8],
        subkey: Option<&[u8]>,
        value: &[u8],
        expiration: DhtTime,
    ) -> Result<usize, DhtError> {
        let acknowledged = self
            .store_unconfirmed(key, subkey, value, expiration)
            .await?;
        if acknowledged == 0 {
            return Ok(0);
        }
        let answers = self.p2p.get_replica_records(key.to_vec()).await?;
        let holding = answers
            .iter()
            .filter(|bytes| {
                DhtValue::from_bytes(bytes, &self.limits).is_ok_and(|v| {
                    let entry = match subkey {
                        Some(s) => v.subkeys().get(s),
                        None => v.plain_entry(),
                    };
                    entry.is_some_and(|e| {
                        e.expiration > expiration
                            || (e.expiration == expiration && e.value == value)
                    })
                })
            })
            .count();
        Ok(holding)
    }

    /// [`Dht::store`] without the read-back: returns how many replicas acknowledged the PUT,
    /// which they do before deciding whether to keep it. For fire-and-forget writes (the
    /// averager's declarations and announcements) whose outcome nobody checks.
    pub async fn store_unconfirmed(
        &self,
        key: &[u8],
        subkey: Option<&[u8]>,
        value: &[u8],
        expiration: DhtTime,
    ) -> Result<usize, DhtError> {
        let v = match subkey {
            Some(s) => match subkey_owner(s)? {
                None => DhtValue::subkey(s.to_vec(), value.to_vec(), expiration),
                Some(owner) if owner == self.p2p.peer_id() => {
                    DhtValue::owned(key, &self.keypair, value.to_vec(), expiration)?
                }
                Some(owner) => {
                    return Err(DhtError::NotOwner {
                        owner,
                        local: self.p2p.peer_id(),
                    });
                }
            },
            None => DhtValue::plain(value.to_vec(), expiration),
        };
        v.validate(key, DhtTime::now(), &self.limits)?;
        Ok(self.p2p.put_record(key.to_vec(), v.to_bytes()).await?)
    }

    /// Reads `key`: every replica's value, merged, without expired writes. A replica whose
    /// answer does not decode or is not valid under `key` ([`DhtValue::validate`] at the
    /// current time: limits and owner signatures) is skipped whole, with a warning: honest
    /// replicas validate every record they store, so such an answer is forged or corrupt.
    /// Writes expiring past this node's [horizon](ValidationLimits::horizon) are dropped from an
    /// answer one by one first: a replica whose clock runs ahead accepted them honestly.
    /// Cancel-safe.
    pub async fn get(&self, key: &[u8]) -> Result<Option<DhtValue>, DhtError> {
        self.get_at(key, DhtTime::now()).await
    }

    /// Like [`Dht::get`], dropping the writes expired at `now` instead of at the current time
    /// (answers are still validated at the current time).
    pub async fn get_at(&self, key: &[u8], now: DhtTime) -> Result<Option<DhtValue>, DhtError> {
        let answers = self.p2p.get_record(key.to_vec()).await?;
        let checked_at = DhtTime::now();
        let mut merged: Option<DhtValue> = None;
        for (replica, bytes) in answers.iter().enumerate() {
            let (limits, cache) = (&self.limits, Some(&self.verified));
            match read_answer(key, bytes, checked_at, limits, merged.as_ref(), cache) {
                Ok(Some(v)) => {
                    merged = Some(match merged.take() {
                        Some(m) => merge(m, v),
                        None => v,
                    })
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(replica, error = %e, "skipping an invalid replica answer"),
            }
        }
        Ok(merged.and_then(|v| v.without_expired(now)))
    }

    /// Many writes at once (concurrently); results in request order.
    pub async fn store_many(&self, requests: Vec<StoreRequest>) -> Vec<Result<usize, DhtError>> {
        let futures = requests
            .iter()
            .map(|r| self.store(&r.key, r.subkey.as_deref(), &r.value, r.expiration));
        futures::future::join_all(futures).await
    }

    /// Many reads at once (concurrently); results in key order.
    pub async fn get_many(&self, keys: &[Vec<u8>]) -> Vec<Result<Option<DhtValue>, DhtError>> {
        futures::future::join_all(keys.iter().map(|k| self.get(k))).await
    }
}
