//! What a declaration looks like in the DHT: the subkey that names the declaring peer and the
//! value bytes, isolated here so that the encoding can follow the DHT's ownership rule.

use bytes::Bytes;

use super::PeerId;
use crate::dht::{DhtTime, DhtValue};

/// Value of a declaration: looking for a group (hivemind's `True`).
pub const DECLARED_VALUE: &[u8] = &[1];
/// Value of a leave record (hivemind's `False`); written with the declaration's expiration
/// nudged up, so it supersedes the declaration in every merge.
pub const LEFT_VALUE: &[u8] = &[0];

/// The subkey under which `peer` declares itself: its id bytes.
///
/// The DHT will accept a subkey write only from the peer the subkey names (an owner-bound
/// subkey encoding is being added to the record policy); this function and [`subkey_owner`] are
/// the only places that know the encoding, so switching to that encoding changes nothing else.
pub fn declaration_subkey(peer: &PeerId) -> Bytes {
    peer.to_bytes()
}

/// The peer a declaration subkey names, or `None` for a subkey that is not a valid encoding.
pub fn subkey_owner(subkey: &[u8]) -> Option<PeerId> {
    PeerId::from_bytes(Bytes::copy_from_slice(subkey))
}

/// The peers actively declared in `value` at `now`, with their expirations: subkeys that name
/// a peer, hold [`DECLARED_VALUE`] and have not expired. Anything else (leave records, foreign
/// values, malformed subkeys) is skipped.
///
/// Reads every subkey the value holds, hidden or not: a plain value written over the key by
/// someone else must not hide the declarations.
pub fn active_declarations(value: &DhtValue, now: DhtTime) -> Vec<(PeerId, DhtTime)> {
    value
        .subkeys()
        .iter()
        .filter(|(_, e)| !e.is_expired(now) && e.value.as_ref() == DECLARED_VALUE)
        .filter_map(|(k, e)| subkey_owner(k).map(|p| (p, e.expiration)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dht::merge;

    fn t(s: f64) -> DhtTime {
        DhtTime::from_secs(s).unwrap()
    }

    /// hivemind's `test_key_manager`: declare, re-declare, leave, unknown key.
    #[test]
    fn declare_redeclare_leave() {
        let alice = PeerId::from_bytes(&b"alice"[..]).unwrap();
        let bob = PeerId::from_bytes(&b"bob"[..]).unwrap();
        let now = t(1000.0);
        let declare = |p: &PeerId, exp: DhtTime, v: &'static [u8]| {
            DhtValue::subkey(declaration_subkey(p), v, exp)
        };
        let v = merge(
            declare(&alice, t(1060.0), DECLARED_VALUE),
            declare(&bob, t(1061.0), DECLARED_VALUE),
        );
        let mut active = active_declarations(&v, now);
        active.sort();
        assert_eq!(
            active,
            vec![(alice.clone(), t(1060.0)), (bob.clone(), t(1061.0))]
        );
        // Alice re-declares later: updated.
        let v = merge(v, declare(&alice, t(1066.0), DECLARED_VALUE));
        assert!(active_declarations(&v, now).contains(&(alice.clone(), t(1066.0))));
        // Bob leaves: same subkey, "left", expiration nudged up.
        let v = merge(v, declare(&bob, t(1061.0).next_up(), LEFT_VALUE));
        assert_eq!(
            active_declarations(&v, now),
            vec![(alice.clone(), t(1066.0))]
        );
        // A stale copy of bob's declaration merged again does not revive it.
        let v = merge(v, declare(&bob, t(1061.0), DECLARED_VALUE));
        assert_eq!(
            active_declarations(&v, now),
            vec![(alice.clone(), t(1066.0))]
        );
        // Expired declarations are not active.
        assert!(active_declarations(&v, t(1066.5)).is_empty());
        // A plain value over the key does not hide declarations.
        let v = merge(v, DhtValue::plain(&b"junk"[..], t(2000.0)));
        assert_eq!(active_declarations(&v, now).len(), 1);
        // Foreign values and empty-looking subkeys are skipped.
        let v = merge(v, DhtValue::subkey(&b"carol"[..], &b"yes"[..], t(1070.0)));
        assert_eq!(active_declarations(&v, now).len(), 1);
    }
}
