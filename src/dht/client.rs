//! The DHT over the p2p layer: [`DhtPolicy`] validates and merges records inside the swarm's
//! event loop, and [`Dht`] stores and reads typed values, merging every replica's answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use libp2p::{PeerId, identity::Keypair};

use super::{DhtTime, DhtValue, DhtValueError, ValidationLimits, merge, merge_all};
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
/// An inbound value must decode within the limits, be valid at `now` and hold at least one live
/// write; the merge result must be valid too, otherwise the stored value is kept. Expired
/// writes are pruned from the stored value on every merge.
#[derive(Clone, Debug, Default)]
pub struct DhtPolicy {
    /// The limits every value must respect.
    pub limits: ValidationLimits,
}

impl RecordPolicy for DhtPolicy {
    fn merge(
        &self,
        _key: &[u8],
        existing: Option<&[u8]>,
        incoming: &[u8],
        _source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(Vec<u8>, SystemTime), String> {
        let now = to_dht_time(now);
        let incoming = DhtValue::from_bytes(incoming, &self.limits).map_err(|e| e.to_string())?;
        incoming
            .validate(now, &self.limits)
            .map_err(|e| e.to_string())?;
        let incoming = incoming
            .without_expired(now)
            .ok_or_else(|| "every write in the record has expired".to_owned())?;
        let stored = existing
            .and_then(|b| DhtValue::from_bytes(b, &self.limits).ok())
            .and_then(|v| v.without_expired(now));
        let merged = match stored {
            Some(old) => merge(old, incoming),
            None => incoming,
        };
        merged
            .validate(now, &self.limits)
            .map_err(|e| format!("merged value: {e}"))?;
        Ok((merged.to_bytes(), to_system_time(merged.expiration())))
    }
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

/// A DHT node: typed values with per-subkey expirations on a libp2p Kademlia swarm.
#[derive(Clone, Debug)]
pub struct Dht {
    p2p: P2p,
    limits: ValidationLimits,
}

impl Dht {
    /// Starts a node with the default [`DhtPolicy`] (see [`P2p::spawn`] for what starting means).
    pub async fn start(
        config: P2pConfig,
        keypair: Keypair,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), DhtError> {
        let policy = DhtPolicy::default();
        let limits = policy.limits.clone();
        let (p2p, task) = P2p::spawn(config, keypair, Box::new(policy)).await?;
        Ok((Self { p2p, limits }, task))
    }

    /// The underlying p2p handle.
    pub fn p2p(&self) -> &P2p {
        &self.p2p
    }

    /// Stores `value` under `key` (and `subkey`, if given) until `expiration`. Returns the
    /// number of remote peers that took the write (0 for a lone node). Cancel-safe.
    pub async fn store(
        &self,
        key: &[u8],
        subkey: Option<&[u8]>,
        value: &[u8],
        expiration: DhtTime,
    ) -> Result<usize, DhtError> {
        let v = match subkey {
            Some(s) => DhtValue::subkey(s.to_vec(), value.to_vec(), expiration),
            None => DhtValue::plain(value.to_vec(), expiration),
        };
        v.validate(DhtTime::now(), &self.limits)?;
        Ok(self.p2p.put_record(key.to_vec(), v.to_bytes()).await?)
    }

    /// Reads `key`: every replica's value, merged, without expired writes. Replicas answering
    /// garbage are skipped. Cancel-safe.
    pub async fn get(&self, key: &[u8]) -> Result<Option<DhtValue>, DhtError> {
        self.get_at(key, DhtTime::now()).await
    }

    /// Like [`Dht::get`], dropping the writes expired at `now` instead of at the current time.
    pub async fn get_at(&self, key: &[u8], now: DhtTime) -> Result<Option<DhtValue>, DhtError> {
        let answers = self.p2p.get_record(key.to_vec()).await?;
        let values = answers.iter().filter_map(|bytes| {
            DhtValue::from_bytes(bytes, &self.limits)
                .inspect_err(|e| tracing::debug!(error = %e, "skipping a malformed replica"))
                .ok()
        });
        Ok(merge_all(values).and_then(|v| v.without_expired(now)))
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
