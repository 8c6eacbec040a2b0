//! What a declaration looks like in the DHT: the subkey that names the declaring peer and the
//! value bytes, isolated here so that the encoding can follow the DHT's ownership rule.

use bytes::Bytes;

use super::PeerId;
use crate::dht::{DhtTime, DhtValue, OWNER_SUBKEY_PREFIX};

/// Value of a declaration: looking for a group (hivemind's `True`). A declaration may carry
/// the declaring peer's contact bytes after it ([`declaration_value`]).
pub const DECLARED_VALUE: &[u8] = &[1];
/// Most contact bytes a declaration carries ([`crate::matchmaking::Step::contact`]).
pub const MAX_CONTACT_BYTES: usize = 1024;
/// Value of a leave record (hivemind's `False`); written with the declaration's expiration
/// nudged up, so it supersedes the declaration in every merge.
pub const LEFT_VALUE: &[u8] = &[0];

/// The subkey under which `peer` declares itself: the DHT's owner subkey of that peer
/// ([`crate::dht::owner_subkey`]: [`OWNER_SUBKEY_PREFIX`] followed by the id bytes), so the
/// record policy accepts it only signed by that peer and nobody can declare, re-declare or
/// "leave" for another peer. This function and [`subkey_owner`] are the only places that know
/// the encoding.
pub fn declaration_subkey(peer: &PeerId) -> Bytes {
    let mut subkey = OWNER_SUBKEY_PREFIX.to_vec();
    subkey.extend_from_slice(peer.as_bytes());
    Bytes::from(subkey)
}

/// The peer a declaration subkey names, or `None` for a subkey that is not a valid encoding.
pub fn subkey_owner(subkey: &[u8]) -> Option<PeerId> {
    let id = subkey.strip_prefix(OWNER_SUBKEY_PREFIX)?;
    PeerId::from_bytes(Bytes::copy_from_slice(id))
}

/// The value of a declaration: [`DECLARED_VALUE`] followed by the peer's contact bytes
/// (opaque here; the averager puts the addresses where followers can reach it, which matters
/// for peers behind NATs that no routing table lists).
pub fn declaration_value(contact: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(1 + contact.len());
    v.extend_from_slice(DECLARED_VALUE);
    v.extend_from_slice(contact);
    Bytes::from(v)
}

/// Whether `value` is a declaration ([`declaration_value`]), as opposed to a leave record or
/// anything else.
pub fn is_declared(value: &[u8]) -> bool {
    value.len() <= 1 + MAX_CONTACT_BYTES && value.starts_with(DECLARED_VALUE)
}

/// The contact bytes of a declaration, or `None` if `value` is not one.
pub fn declaration_contact(value: &[u8]) -> Option<&[u8]> {
    if is_declared(value) {
        Some(&value[DECLARED_VALUE.len()..])
    } else {
        None
    }
}

/// The peers actively declared in `value` at `now`, with their expirations: subkeys that name
/// a peer, hold a declaration ([`is_declared`]) and have not expired. Anything else (leave
/// records, foreign values, malformed subkeys) is skipped.
///
/// Reads every subkey the value holds, hidden or not: a plain value written over the key by
/// someone else must not hide the declarations.
pub fn active_declarations(value: &DhtValue, now: DhtTime) -> Vec<(PeerId, DhtTime)> {
    value
        .subkeys()
        .iter()
        .filter(|(_, e)| !e.is_expired(now) && is_declared(&e.value))
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

    /// For a libp2p peer id the declaration subkey is exactly the DHT's owner subkey, so the
    /// record policy binds it to that peer's signature.
    #[test]
    fn declaration_subkeys_are_dht_owner_subkeys() {
        let libp2p_id = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let peer = PeerId::from_bytes(libp2p_id.to_bytes()).unwrap();
        let subkey = declaration_subkey(&peer);
        assert_eq!(subkey, crate::dht::owner_subkey(&libp2p_id));
        assert_eq!(crate::dht::subkey_owner(&subkey), Ok(Some(libp2p_id)));
        assert_eq!(subkey_owner(&subkey), Some(peer));
        assert_eq!(subkey_owner(libp2p_id.to_bytes().as_slice()), None);
    }

    #[test]
    fn declarations_carry_contact_bytes() {
        let v = declaration_value(b"addrs");
        assert!(is_declared(&v));
        assert_eq!(declaration_contact(&v), Some(&b"addrs"[..]));
        assert_eq!(declaration_contact(DECLARED_VALUE), Some(&[][..]));
        assert_eq!(declaration_contact(LEFT_VALUE), None);
        assert_eq!(declaration_contact(b""), None);
        // Oversized contact bytes are not a declaration.
        let big = declaration_value(&[7; MAX_CONTACT_BYTES + 1]);
        assert!(!is_declared(&big));
        let alice = PeerId::from_bytes(&b"alice"[..]).unwrap();
        let now = DhtTime::from_secs(1000.0).unwrap();
        let later = DhtTime::from_secs(1060.0).unwrap();
        let value = DhtValue::subkey(declaration_subkey(&alice), v, later);
        assert_eq!(
            active_declarations(&value, now),
            vec![(alice.clone(), later)]
        );
        let value = DhtValue::subkey(declaration_subkey(&alice), big, later);
        assert!(active_declarations(&value, now).is_empty());
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
