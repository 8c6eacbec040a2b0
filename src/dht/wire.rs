//! Encoding of a [`DhtValue`] as a Kademlia record value: prost types from
//! `proto/hivemesh/dht.proto`, translated at this boundary ("parse, don't validate").
//!
//! Encoding is canonical: entries go out sorted by subkey, so equal values encode to equal
//! bytes; an absent signature is empty bytes, which proto3 leaves off the wire. Decoding is
//! structural only: the ownership rule needs the record key and is checked by
//! [`DhtValue::validate`]. Decoding checks the length before touching the bytes and the entry
//! count before building the map, and turns every structural fault into a [`DhtValueError`].

use prost::Message as _;

use super::value::{DhtTime, DhtValue, Entry, insert_newer};
use super::{DhtValueError, ValidationLimits};
use crate::proto_guard::{self, Field, GuardError, Kind};

/// Generated prost types (do not use outside this boundary).
#[allow(missing_docs, clippy::all)]
mod proto {
    include!(concat!(env!("OUT_DIR"), "/hivemesh.dht.v1.rs"));
}

impl From<&DhtValue> for proto::DhtValue {
    fn from(v: &DhtValue) -> Self {
        Self {
            plain: v.plain_entry().map(|p| proto::PlainValue {
                value: p.value.clone(),
                expiration: p.expiration.as_secs(),
            }),
            entries: v
                .subkeys()
                .iter()
                .map(|(k, e)| proto::DictionaryEntry {
                    subkey: k.clone(),
                    value: e.value.clone(),
                    expiration: e.expiration.as_secs(),
                    signature: e.signature.clone().unwrap_or_default(),
                })
                .collect(),
        }
    }
}

fn time(secs: f64) -> Result<DhtTime, DhtValueError> {
    DhtTime::from_secs(secs).ok_or(DhtValueError::NonFiniteExpiration(secs))
}

impl TryFrom<proto::DhtValue> for DhtValue {
    type Error = DhtValueError;

    fn try_from(v: proto::DhtValue) -> Result<Self, Self::Error> {
        let plain = match v.plain {
            Some(p) => Some(Entry::new(p.value, time(p.expiration)?)),
            None => None,
        };
        let mut subkeys = std::collections::BTreeMap::new();
        for e in v.entries {
            if e.subkey.is_empty() {
                return Err(DhtValueError::EmptySubkey);
            }
            let mut entry = Entry::new(e.value, time(e.expiration)?);
            if !e.signature.is_empty() {
                entry = entry.with_signature(e.signature);
            }
            if subkeys.contains_key(&e.subkey) {
                return Err(DhtValueError::DuplicateSubkey);
            }
            insert_newer(&mut subkeys, e.subkey, entry);
        }
        DhtValue::from_parts(plain, subkeys).ok_or(DhtValueError::Empty)
    }
}

impl DhtValue {
    /// The length of [`to_bytes`](Self::to_bytes), without encoding.
    pub fn encoded_len(&self) -> usize {
        proto::DhtValue::from(self).encoded_len()
    }

    /// The canonical encoding (a Kademlia record value).
    pub fn to_bytes(&self) -> Vec<u8> {
        proto::DhtValue::from(self).encode_to_vec()
    }

    /// Decodes a record value, enforcing `limits.max_value_bytes` (before decoding) and
    /// `limits.max_subkeys`. Expirations (against `now`) and owner signatures (against the
    /// record key) are checked by [`validate`](Self::validate), which an inbound record must
    /// pass as well.
    pub fn from_bytes(bytes: &[u8], limits: &ValidationLimits) -> Result<Self, DhtValueError> {
        if bytes.len() > limits.max_value_bytes {
            return Err(DhtValueError::TooLarge {
                len: bytes.len(),
                max: limits.max_value_bytes,
            });
        }
        // Counted before decoding, so that a value of small entries cannot make prost build
        // more of them than the limit (`crate::proto_guard`).
        let shape = [
            Field {
                number: 1,
                max: 1,
                slot: 0,
                kind: Kind::Opaque,
            },
            Field {
                number: 2,
                max: limits.max_subkeys,
                slot: 1,
                kind: Kind::Opaque,
            },
        ];
        match proto_guard::check(bytes, &shape) {
            Ok(()) => {}
            Err(GuardError::TooMany { field: 2, .. }) => {
                return Err(DhtValueError::TooManySubkeys {
                    count: limits.max_subkeys + 1,
                    max: limits.max_subkeys,
                });
            }
            Err(e) => return Err(DhtValueError::Malformed(e.to_string())),
        }
        let msg =
            proto::DhtValue::decode(bytes).map_err(|e| DhtValueError::Malformed(e.to_string()))?;
        Self::try_from(msg)
    }
}

#[cfg(test)]
pub(super) mod test_support {
    //! Raw encodings for tests of malformed input.
    use super::proto;
    use prost::Message as _;

    /// Encodes a value from raw parts: `(subkey, value, expiration)` entries and an optional
    /// plain `(value, expiration)`, with no checks at all.
    pub(in crate::dht) fn raw(
        plain: Option<(&[u8], f64)>,
        entries: &[(&[u8], &[u8], f64)],
    ) -> Vec<u8> {
        proto::DhtValue {
            plain: plain.map(|(v, t)| proto::PlainValue {
                value: bytes::Bytes::copy_from_slice(v),
                expiration: t,
            }),
            entries: entries
                .iter()
                .map(|(k, v, t)| proto::DictionaryEntry {
                    subkey: bytes::Bytes::copy_from_slice(k),
                    value: bytes::Bytes::copy_from_slice(v),
                    expiration: *t,
                    signature: bytes::Bytes::new(),
                })
                .collect(),
        }
        .encode_to_vec()
    }
}
