//! Tests of the DHT value model: hivemind's storage semantics (`test_dht_storage.py`, the
//! subkey rules of `test_dht_node.py` / `test_dht.py`), validation and decoding of hostile
//! input, and property tests of the merge laws.

use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;

use libp2p::PeerId;
use libp2p::identity::Keypair;

use super::wire::test_support::raw;
use super::*;
use crate::p2p::RecordPolicy;

fn t(secs: f64) -> DhtTime {
    DhtTime::from_secs(secs).unwrap()
}

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// hivemind's `store`: merges `write` into `state` and says whether the write is visible
/// afterwards (hivemind's `True`: accepted; `False`: the current value is newer).
fn store(state: &mut Option<DhtValue>, write: DhtValue) -> bool {
    let merged = match state.take() {
        Some(s) => merge(s, write.clone()),
        None => write.clone(),
    };
    let visible = match (merged.view(), write.view()) {
        (DhtView::Plain(p), DhtView::Plain(w)) => p == w,
        (DhtView::Dictionary(d), DhtView::Dictionary(w)) => {
            w.iter().all(|(k, e)| d.get(k) == Some(e))
        }
        _ => false,
    };
    *state = Some(merged);
    visible
}

fn get(state: &Option<DhtValue>) -> DhtView<'_> {
    state.as_ref().unwrap().view()
}

fn dict<'a>(view: DhtView<'a>) -> &'a std::collections::BTreeMap<Bytes, Entry> {
    match view {
        DhtView::Dictionary(d) => d,
        DhtView::Plain(p) => panic!("expected a dictionary, got plain {p:?}"),
    }
}

#[test]
fn dht_time_is_finite_and_totally_ordered() {
    assert!(DhtTime::from_secs(f64::NAN).is_none());
    assert!(DhtTime::from_secs(f64::INFINITY).is_none());
    assert!(DhtTime::from_secs(f64::NEG_INFINITY).is_none());
    assert_eq!(t(-0.0), t(0.0));
    assert_eq!(t(-0.0).as_secs().to_bits(), 0.0f64.to_bits());
    assert!(t(1.0) < t(2.0) && t(-5.0) < DhtTime::EPOCH);
    assert!(t(1.0).next_up() > t(1.0));
    assert_eq!(t(f64::MAX).next_up(), t(f64::MAX));
    assert_eq!(
        t(f64::MAX).saturating_add(Duration::MAX).as_secs(),
        f64::MAX
    );
    assert_eq!(t(10.0).saturating_add(Duration::from_millis(500)), t(10.5));
    assert!(DhtTime::now() > t(1.7e9));
}

/// `test_store`, `test_get_expired`, `test_get_empty`.
#[test]
fn expired_writes_vanish() {
    let now = 1000.0;
    let v = DhtValue::plain(b("val"), t(now + 0.1));
    assert_eq!(v.clone().without_expired(t(now)), Some(v.clone()));
    // Live up to and including its expiration, gone after it.
    assert_eq!(v.clone().without_expired(t(now + 0.1)), Some(v.clone()));
    assert_eq!(v.without_expired(t(now + 0.5)), None);
    assert_eq!(merge_all([]), None);

    let d = DhtValue::from_parts(
        None,
        [
            (b("a"), Entry::new(b("1"), t(now + 1.0))),
            (b("b"), Entry::new(b("2"), t(now + 3.0))),
        ],
    )
    .unwrap();
    let live = d.clone().without_expired(t(now + 2.0)).unwrap();
    assert_eq!(dict(live.view()).keys().collect::<Vec<_>>(), [&b("b")]);
    assert_eq!(d.without_expired(t(now + 3.5)), None);
}

/// `test_change_expiration_time`, and an older write never replaces a newer one.
#[test]
fn newer_write_wins_and_older_write_does_not_replace_it() {
    let now = 1000.0;
    let old = DhtValue::plain(b("val1"), t(now + 1.0));
    let new = DhtValue::plain(b("val2"), t(now + 200.0));
    for m in [merge(old.clone(), new.clone()), merge(new.clone(), old)] {
        assert_eq!(m, new);
        let m = m.without_expired(t(now + 1.5)).unwrap();
        assert_eq!(
            m.view(),
            DhtView::Plain(&Entry::new(b("val2"), t(now + 200.0)))
        );
    }
    let mut state = Some(new.clone());
    assert!(!store(
        &mut state,
        DhtValue::plain(b("stale"), t(now + 100.0))
    ));
    assert_eq!(state, Some(new));
}

#[test]
fn equal_expirations_break_ties_by_value_bytes() {
    let x = DhtValue::plain(b("x"), t(5.0));
    let y = DhtValue::plain(b("y"), t(5.0));
    assert_eq!(merge(x.clone(), y.clone()), y);
    assert_eq!(merge(y.clone(), x), y);
    let sx = DhtValue::subkey(b("k"), b("x"), t(5.0));
    let sy = DhtValue::subkey(b("k"), b("y"), t(5.0));
    assert_eq!(merge(sx.clone(), sy.clone()), sy);
    assert_eq!(merge(sy.clone(), sx.clone()), sy);
    // A plain write and a subkey write with the same expiration: the dictionary shows.
    let p = DhtValue::plain(b("p"), t(5.0));
    for m in [merge(p.clone(), sx.clone()), merge(sx, p)] {
        assert!(matches!(m.view(), DhtView::Dictionary(_)));
    }
}

/// `test_dht_storage.py::test_localstorage_nested`, assertion by assertion.
#[test]
fn nested_values_follow_hivemind_local_storage() {
    let time = 1000.0;
    let d2 = DhtValue::from_parts(
        None,
        [
            (b("subkey1"), Entry::new(b("value1"), t(time + 2.0))),
            (b("subkey2"), Entry::new(b("value2"), t(time + 3.0))),
            (b("subkey3"), Entry::new(b("value3"), t(time + 1.0))),
        ],
    )
    .unwrap();
    assert_eq!(d2.expiration(), t(time + 3.0));

    let (mut foo, mut bar) = (None, None);
    for (k, e) in d2.subkeys() {
        assert!(store(
            &mut foo,
            DhtValue::subkey(k.clone(), e.value.clone(), e.expiration)
        ));
    }
    assert!(store(&mut bar, DhtValue::plain(b("456"), t(time + 2.0))));
    assert_eq!(dict(get(&foo)), d2.subkeys());
    assert_eq!(foo.as_ref().unwrap().expiration(), d2.expiration());
    assert_eq!(
        dict(get(&foo)).get(&b("subkey1")[..]),
        Some(&Entry::new(b("value1"), t(time + 2.0)))
    );
    assert_eq!(dict(get(&foo)).len(), 3);
    assert!(store(
        &mut foo,
        DhtValue::subkey(b("subkey4"), b("value4"), t(time + 4.0))
    ));
    assert_eq!(dict(get(&foo)).len(), 4);

    // A subkey write onto a plain value replaces it only if newer.
    assert!(!store(
        &mut bar,
        DhtValue::subkey(b("subkeyA"), b("valueA"), t(time + 1.0))
    ));
    assert!(store(
        &mut bar,
        DhtValue::subkey(b("subkeyA"), b("valueA"), t(time + 3.0))
    ));
    assert!(store(
        &mut bar,
        DhtValue::subkey(b("subkeyB"), b("valueB"), t(time + 4.0))
    ));
    assert!(store(
        &mut bar,
        DhtValue::subkey(b("subkeyA"), b("valueA+"), t(time + 5.0))
    ));
    let bar_dict = dict(get(&bar));
    assert!(bar_dict.contains_key(&b("subkeyA")[..]) && bar_dict.contains_key(&b("subkeyB")[..]));
    assert_eq!(bar_dict.len(), 2);
    assert_eq!(bar.as_ref().unwrap().expiration(), t(time + 5.0));

    // A plain write onto a dictionary replaces it only if newer than its latest entry.
    assert!(!store(
        &mut foo,
        DhtValue::plain(b("nothing"), t(time + 3.5))
    ));
    assert_eq!(
        dict(get(&foo)).get(&b("subkey2")[..]),
        Some(&Entry::new(b("value2"), t(time + 3.0)))
    );
    assert!(store(
        &mut foo,
        DhtValue::plain(b("nothing"), t(time + 5.0))
    ));
    assert_eq!(
        get(&foo),
        DhtView::Plain(&Entry::new(b("nothing"), t(time + 5.0)))
    );
}

/// The one place where we differ from hivemind's sequential storage: hidden writes are kept.
#[test]
fn newer_plain_value_hides_older_subkeys_without_deleting_them() {
    let a = DhtValue::subkey(b("a"), b("1"), t(10.0));
    let p = DhtValue::plain(b("p"), t(20.0));
    let bk = DhtValue::subkey(b("b"), b("2"), t(30.0));
    let hidden = merge(a.clone(), p.clone());
    assert_eq!(hidden.view(), DhtView::Plain(&Entry::new(b("p"), t(20.0))));
    assert_eq!(hidden.subkeys().len(), 1);
    // In every order the three writes leave {a, b}.
    let orders = [
        merge(hidden, bk.clone()),
        merge(merge(a.clone(), bk.clone()), p.clone()),
        merge(merge(p.clone(), bk.clone()), a.clone()),
    ];
    for m in &orders {
        assert_eq!(m, &orders[0]);
        assert_eq!(dict(m.view()).len(), 2);
        assert_eq!(m.plain_entry(), Some(&Entry::new(b("p"), t(20.0))));
    }
    // Once the hidden entry expires, the dictionary only shows b.
    let later = orders[0].clone().without_expired(t(15.0)).unwrap();
    assert_eq!(dict(later.view()).keys().collect::<Vec<_>>(), [&b("b")]);
}

/// `test_dht.py::test_get_store` and `test_dht_node`: subkeys stored by different peers at
/// different replicas merge into one dictionary on a `latest` read.
#[test]
fn subkeys_from_several_peers_merge_across_replicas() {
    let now = 1000.0;
    let peer1 = DhtValue::subkey(b("peer1"), b("1"), t(now + 10.0));
    let peer2 = DhtValue::subkey(b("peer2"), b("1"), t(now + 12.0));
    let peer2_old = DhtValue::subkey(b("peer2"), b("0"), t(now + 5.0));
    // Replicas hold partial, differently stale copies.
    let replicas = [
        peer1.clone(),
        merge(peer2_old.clone(), peer1.clone()),
        peer2.clone(),
        peer2_old,
    ];
    let merged = merge_all(replicas).unwrap();
    assert_eq!(merged, merge(peer1, peer2));
    let d = dict(merged.view());
    assert_eq!(d.len(), 2);
    assert_eq!(d[&b("peer2")[..]], Entry::new(b("1"), t(now + 12.0)));
    assert_eq!(merged.expiration(), t(now + 12.0));
}

/// Matchmaking's leave (digest §3.2): the same subkey, value False, expiration nudged up.
#[test]
fn leave_overrides_declaration() {
    let declared = t(1000.0 + 15.0);
    let join = DhtValue::subkey(b("peer"), b("\x01"), declared);
    let leave = DhtValue::subkey(b("peer"), Bytes::new(), declared.next_up());
    for m in [
        merge(join.clone(), leave.clone()),
        merge(leave.clone(), join.clone()),
    ] {
        let active: Vec<_> = dict(m.view())
            .iter()
            .filter(|(_, e)| !e.value.is_empty())
            .collect();
        assert!(active.is_empty());
    }
    // Without the nudge the tie-break on value bytes would keep the declaration.
    let same_time = DhtValue::subkey(b("peer"), Bytes::new(), declared);
    assert_eq!(merge(same_time, join.clone()), join);
}

#[test]
fn validate_bounds_expirations_subkeys_and_size() {
    let now = t(1000.0);
    let limits = ValidationLimits::default();
    let horizon = limits.horizon(now);
    assert_eq!(
        horizon,
        now.saturating_add(DEFAULT_MAX_EXPIRATION_AHEAD + DEFAULT_MAX_CLOCK_SKEW)
    );
    assert_eq!(
        DhtValue::plain(b("v"), horizon).validate(b"key", now, &limits),
        Ok(())
    );
    // Expired writes are not an error.
    assert_eq!(
        DhtValue::plain(b("v"), t(1.0)).validate(b"key", now, &limits),
        Ok(())
    );
    let far = horizon.next_up();
    let hidden_far = DhtValue::from_parts(
        Some(Entry::new(b("p"), far)),
        [(b("k"), Entry::new(b("v"), t(1001.0)))],
    )
    .unwrap();
    assert_eq!(
        hidden_far.validate(b"key", now, &limits),
        Err(DhtValueError::ExpirationTooFar {
            expiration: far,
            horizon
        })
    );

    let small = ValidationLimits {
        max_value_bytes: 64,
        max_subkeys: 3,
        ..ValidationLimits::default()
    };
    let four = DhtValue::from_parts(
        None,
        (0..4u8).map(|i| (Bytes::from(vec![b'k', i]), Entry::new(b(""), t(1001.0)))),
    )
    .unwrap();
    let err = DhtValueError::TooManySubkeys { count: 4, max: 3 };
    assert_eq!(four.validate(b"key", now, &small), Err(err.clone()));
    assert_eq!(DhtValue::from_bytes(&four.to_bytes(), &small), Err(err));

    let big = DhtValue::plain(Bytes::from(vec![7u8; 100]), t(1001.0));
    let len = big.encoded_len();
    assert_eq!(len, big.to_bytes().len());
    let err = DhtValueError::TooLarge { len, max: 64 };
    assert_eq!(big.validate(b"key", now, &small), Err(err.clone()));
    assert_eq!(DhtValue::from_bytes(&big.to_bytes(), &small), Err(err));

    let empty_subkey = DhtValue::subkey(Bytes::new(), b("v"), t(1001.0));
    assert_eq!(
        empty_subkey.validate(b"key", now, &limits),
        Err(DhtValueError::EmptySubkey)
    );
}

/// The default size limit holds a full dictionary of hivemind-style declarations: one signed
/// entry under each peer's owner subkey.
#[test]
fn default_limits_fit_a_full_averaging_dictionary() {
    let now = t(1.7e9);
    let exp = now.saturating_add(Duration::from_secs(30));
    let writes: Vec<DhtValue> = (0..DEFAULT_MAX_SUBKEYS)
        .map(|_| DhtValue::owned(b"key", &Keypair::generate_ed25519(), b("\x01"), exp).unwrap())
        .collect();
    let full = merge_all(writes).unwrap();
    assert_eq!(full.subkeys().len(), DEFAULT_MAX_SUBKEYS);
    let limits = ValidationLimits::default();
    let started = std::time::Instant::now();
    assert_eq!(full.validate(b"key", now, &limits), Ok(()));
    eprintln!(
        "{} signed entries: {} bytes encoded, validated in {:?}",
        DEFAULT_MAX_SUBKEYS,
        full.encoded_len(),
        started.elapsed()
    );
    assert!(full.encoded_len() < DEFAULT_MAX_VALUE_BYTES * 3 / 4);
    assert_eq!(DhtValue::from_bytes(&full.to_bytes(), &limits), Ok(full));
}

#[test]
fn from_bytes_rejects_malformed_values() {
    let limits = ValidationLimits::default();
    let dec = |bytes: &[u8]| DhtValue::from_bytes(bytes, &limits);
    // The length is checked before anything is decoded.
    let junk = vec![0xffu8; 65];
    let small = ValidationLimits {
        max_value_bytes: 64,
        ..ValidationLimits::default()
    };
    assert_eq!(
        DhtValue::from_bytes(&junk, &small),
        Err(DhtValueError::TooLarge { len: 65, max: 64 })
    );
    assert!(matches!(dec(&junk), Err(DhtValueError::Malformed(_))));
    assert_eq!(dec(&[]), Err(DhtValueError::Empty));
    assert_eq!(dec(&raw(None, &[])), Err(DhtValueError::Empty));
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert!(matches!(
            dec(&raw(Some((b"v", bad)), &[])),
            Err(DhtValueError::NonFiniteExpiration(_))
        ));
        assert!(matches!(
            dec(&raw(None, &[(b"k", b"v", bad)])),
            Err(DhtValueError::NonFiniteExpiration(_))
        ));
    }
    assert_eq!(
        dec(&raw(None, &[(b"", b"v", 1.0)])),
        Err(DhtValueError::EmptySubkey)
    );
    assert_eq!(
        dec(&raw(None, &[(b"k", b"v", 1.0), (b"k", b"w", 2.0)])),
        Err(DhtValueError::DuplicateSubkey)
    );
    // Entries in any order decode; the encoding is canonical (sorted by subkey).
    let unsorted = raw(Some((b"p", 3.0)), &[(b"z", b"1", 1.0), (b"a", b"2", 2.0)]);
    let v = dec(&unsorted).unwrap();
    let sorted = raw(Some((b"p", 3.0)), &[(b"a", b"2", 2.0), (b"z", b"1", 1.0)]);
    assert_eq!(v.to_bytes(), sorted);
}

// ---- Owner subkeys and signatures ----

const KEY: &[u8] = b"mygroup.0b01";

fn limits() -> ValidationLimits {
    ValidationLimits::default()
}

/// A valid signed write of `kp`'s owner subkey under [`KEY`], and its subkey and entry.
fn owned(kp: &Keypair, value: &str, exp: DhtTime) -> (DhtValue, Bytes, Entry) {
    let v = DhtValue::owned(KEY, kp, b(value), exp).unwrap();
    let (k, e) = v.subkeys().iter().next().unwrap();
    let (k, e) = (k.clone(), e.clone());
    (v, k, e)
}

fn one(subkey: &Bytes, entry: Entry) -> DhtValue {
    DhtValue::from_parts(None, [(subkey.clone(), entry)]).unwrap()
}

fn sign(kp: &Keypair, key: &[u8], subkey: &[u8], value: &[u8], exp: DhtTime) -> Bytes {
    Bytes::from(kp.sign(&signing_payload(key, subkey, value, exp)).unwrap())
}

#[test]
fn owner_subkeys_name_exactly_one_peer() {
    let peer = Keypair::generate_ed25519().public().to_peer_id();
    let sub = owner_subkey(&peer);
    assert!(sub.starts_with(OWNER_SUBKEY_PREFIX));
    assert_eq!(subkey_owner(&sub), Ok(Some(peer)));
    // Ordinary subkeys, including a peer id's bytes or text without the prefix.
    for ordinary in [
        &b"peer-1"[..],
        &peer.to_bytes(),
        peer.to_base58().as_bytes(),
        b"owner:",
    ] {
        assert_eq!(subkey_owner(ordinary), Ok(None));
    }
    // The prefix followed by anything but exactly one peer id is malformed.
    let mut trailing = sub.to_vec();
    trailing.push(0);
    let truncated = &sub[..sub.len() - 1];
    for bad in [
        OWNER_SUBKEY_PREFIX,
        &trailing[..],
        truncated,
        b"\xffowner:garbage",
    ] {
        assert_eq!(subkey_owner(bad), Err(DhtValueError::MalformedOwnerSubkey));
        let v = DhtValue::subkey(Bytes::copy_from_slice(bad), b("v"), t(1001.0));
        assert_eq!(
            v.validate(KEY, t(1000.0), &limits()),
            Err(DhtValueError::MalformedOwnerSubkey)
        );
    }
}

#[test]
fn a_valid_signature_is_accepted() {
    let kp = Keypair::generate_ed25519();
    let peer = kp.public().to_peer_id();
    let exp = t(1010.0);
    let (v, sub, e) = owned(&kp, "decl", exp);
    assert_eq!(sub, owner_subkey(&peer));
    assert_eq!((e.value.clone(), e.expiration), (b("decl"), exp));
    assert_eq!(e.signature, Some(sign(&kp, KEY, &sub, b"decl", exp)));
    assert_eq!(v.validate(KEY, t(1000.0), &limits()), Ok(()));
    assert_eq!(v.owner_entries().collect::<Vec<_>>(), [(peer, &e)]);
    // Survives the wire and mixes with ordinary subkeys and a plain value.
    let decoded = DhtValue::from_bytes(&v.to_bytes(), &limits()).unwrap();
    assert_eq!(decoded, v);
    let mixed = merge_all([
        v.clone(),
        DhtValue::subkey(b("ordinary"), b("x"), t(1005.0)),
        DhtValue::plain(b("p"), t(1020.0)),
    ])
    .unwrap();
    assert_eq!(mixed.validate(KEY, t(1000.0), &limits()), Ok(()));
    // A newer plain value hides the dictionary but not the owner's entry.
    assert!(matches!(mixed.view(), DhtView::Plain(_)));
    assert_eq!(mixed.owner_entries().collect::<Vec<_>>(), [(peer, &e)]);
}

#[test]
fn missing_signature_is_rejected() {
    let kp = Keypair::generate_ed25519();
    let peer = kp.public().to_peer_id();
    let unsigned = DhtValue::subkey(owner_subkey(&peer), b("decl"), t(1010.0));
    assert_eq!(
        unsigned.validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::MissingSignature { owner: peer })
    );
    // Also when hidden behind a newer plain value, and next to valid entries.
    let (good, _, _) = owned(&Keypair::generate_ed25519(), "ok", t(1010.0));
    let hidden = merge_all([unsigned, good, DhtValue::plain(b("p"), t(1020.0))]).unwrap();
    assert_eq!(
        hidden.validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::MissingSignature { owner: peer })
    );
}

#[test]
fn forged_signature_is_rejected() {
    let kp = Keypair::generate_ed25519();
    let peer = kp.public().to_peer_id();
    let (_, sub, e) = owned(&kp, "decl", t(1010.0));
    let mut flipped = e.signature.clone().unwrap().to_vec();
    flipped[10] ^= 1;
    for forged in [vec![0u8; 64], vec![7u8; 3], flipped] {
        let v = one(&sub, e.clone().with_signature(forged));
        assert_eq!(
            v.validate(KEY, t(1000.0), &limits()),
            Err(DhtValueError::BadSignature { owner: peer })
        );
    }
}

#[test]
fn signature_by_another_key_is_rejected() {
    let (owner, thief) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let peer = owner.public().to_peer_id();
    let sub = owner_subkey(&peer);
    let exp = t(1010.0);
    let v = one(
        &sub,
        Entry::new(b("mine now"), exp).with_signature(sign(&thief, KEY, &sub, b"mine now", exp)),
    );
    assert_eq!(
        v.validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::BadSignature { owner: peer })
    );
    // The thief's own valid entry does not authorise anything under the owner's subkey.
    let (theirs, _, te) = owned(&thief, "mine now", exp);
    assert_eq!(theirs.validate(KEY, t(1000.0), &limits()), Ok(()));
    assert_eq!(
        one(&sub, te).validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::BadSignature { owner: peer })
    );
}

#[test]
fn altered_value_expiration_or_key_is_rejected() {
    let kp = Keypair::generate_ed25519();
    let peer = kp.public().to_peer_id();
    let (v, sub, e) = owned(&kp, "decl", t(1010.0));
    let bad = Err(DhtValueError::BadSignature { owner: peer });
    let altered_value = Entry {
        value: b("decl!"),
        ..e.clone()
    };
    assert_eq!(
        one(&sub, altered_value).validate(KEY, t(1000.0), &limits()),
        bad
    );
    // A later expiration (a replay as a newer version) and an earlier one.
    for exp in [t(1010.0).next_up(), t(2000.0), t(1009.0)] {
        let altered = Entry {
            expiration: exp,
            ..e.clone()
        };
        assert_eq!(one(&sub, altered).validate(KEY, t(1000.0), &limits()), bad);
    }
    // The same signed entry replayed under another DHT key.
    assert_eq!(v.validate(b"mygroup.0b10", t(1000.0), &limits()), bad);
    assert_eq!(v.validate(KEY, t(1000.0), &limits()), Ok(()));
}

#[test]
fn signatures_on_ordinary_subkeys_and_unverifiable_owners_are_rejected() {
    let kp = Keypair::generate_ed25519();
    let sig = sign(&kp, KEY, b"ordinary", b"v", t(1010.0));
    let signed_ordinary = one(
        &b("ordinary"),
        Entry::new(b("v"), t(1010.0)).with_signature(sig),
    );
    assert_eq!(
        signed_ordinary.validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::UnexpectedSignature)
    );
    let signed_plain = DhtValue::from_parts(
        Some(Entry::new(b("v"), t(1010.0)).with_signature(b("s"))),
        [],
    )
    .unwrap();
    assert_eq!(
        signed_plain.validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::UnexpectedSignature)
    );
    // A peer id that is a hash of its key (RSA, ECDSA) gives nothing to verify with.
    let hashed =
        PeerId::from_multihash(libp2p::multihash::Multihash::wrap(0x12, &[7; 32]).unwrap())
            .unwrap();
    let v = one(
        &owner_subkey(&hashed),
        Entry::new(b("v"), t(1010.0)).with_signature(vec![1u8; 64]),
    );
    assert_eq!(
        v.validate(KEY, t(1000.0), &limits()),
        Err(DhtValueError::KeyNotEmbedded { owner: hashed })
    );
}

/// Replaying an owner's older signed write never beats its newer one; its leave (a later
/// signed write) beats its declaration.
#[test]
fn replayed_older_signed_entries_lose() {
    let kp = Keypair::generate_ed25519();
    let (old, _, _) = owned(&kp, "old", t(1010.0));
    let (new, _, _) = owned(&kp, "new", t(1020.0));
    let (leave, _, left) = owned(&kp, "", t(1020.0).next_up());
    for m in [
        merge(old.clone(), new.clone()),
        merge(new.clone(), old.clone()),
    ] {
        assert_eq!(m, new);
        assert_eq!(m.validate(KEY, t(1000.0), &limits()), Ok(()));
    }
    let m = merge_all([leave, old, new]).unwrap();
    assert_eq!(
        m.owner_entries().map(|(_, e)| e).collect::<Vec<_>>(),
        [&left]
    );
}

#[test]
fn equal_writes_with_different_signatures_merge_by_signature_bytes() {
    let sub = owner_subkey(&Keypair::generate_ed25519().public().to_peer_id());
    let e = Entry::new(b("v"), t(5.0));
    let (lo, hi) = (
        one(&sub, e.clone().with_signature(b("a"))),
        one(&sub, e.with_signature(b("b"))),
    );
    assert_eq!(merge(lo.clone(), hi.clone()), hi);
    assert_eq!(merge(hi.clone(), lo), hi);
}

/// The record store refuses a record holding a bad owner entry and keeps its value; entries it
/// already holds are accepted again without being checked twice.
#[test]
fn record_store_rejects_forged_owner_entries() {
    let policy = DhtPolicy::default();
    let now = std::time::SystemTime::now();
    let exp = DhtTime::now().saturating_add(Duration::from_secs(60));
    let later = exp.saturating_add(Duration::from_secs(1));
    let (owner, thief) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let (decl, sub, e) = owned(&owner, "decl", exp);
    let (stored, _) = policy
        .merge(KEY, None, &decl.to_bytes(), None, now)
        .unwrap();

    let unsigned = one(&sub, Entry::new(b("forged"), later));
    let stolen = one(
        &sub,
        Entry::new(b("forged"), later).with_signature(sign(&thief, KEY, &sub, b"forged", later)),
    );
    let replayed = one(
        &sub,
        Entry {
            expiration: later,
            ..e.clone()
        },
    );
    // A record that also carries valid writes is refused whole.
    let (theirs, _, _) = owned(&thief, "theirs", later);
    let mixed = merge(theirs, stolen.clone());
    for forged in [unsigned, stolen, replayed, mixed] {
        let err = policy
            .merge(KEY, Some(&stored), &forged.to_bytes(), None, now)
            .unwrap_err();
        assert!(err.contains("owner subkey"), "{err}");
    }
    // The valid declaration is accepted under its key only.
    assert!(
        policy
            .merge(b"other", None, &decl.to_bytes(), None, now)
            .is_err()
    );
    let (again, _) = policy
        .merge(KEY, Some(&stored), &decl.to_bytes(), None, now)
        .unwrap();
    assert_eq!(again, stored);
}

/// Under an owned key a value may hold owner entries only: no plain value, no ordinary subkey,
/// no entry over the per-owner size; the same writes under an ordinary key are fine.
#[test]
fn owned_keys_hold_only_bounded_owner_entries() {
    let key = owned_key("run.0b01");
    assert!(is_owned_key(&key) && !is_owned_key(b"run.0b01"));
    let kp = Keypair::generate_ed25519();
    let now = t(1000.0);
    let exp = t(1010.0);
    let lim = limits();
    let mine = DhtValue::owned(&key, &kp, b("decl"), exp).unwrap();
    assert_eq!(mine.validate(&key, now, &lim), Ok(()));

    let plain = DhtValue::plain(b("squat"), exp);
    assert_eq!(plain.validate(b"run.0b01", now, &lim), Ok(()));
    assert_eq!(
        plain.validate(&key, now, &lim),
        Err(DhtValueError::PlainOnOwnedKey)
    );
    // Hidden or not, a plain value beside the entries is refused.
    let hidden = merge(mine.clone(), DhtValue::plain(b("squat"), t(1001.0)));
    assert_eq!(
        hidden.validate(&key, now, &lim),
        Err(DhtValueError::PlainOnOwnedKey)
    );
    let ordinary = DhtValue::subkey(b("alice"), b("decl"), exp);
    assert_eq!(ordinary.validate(b"run.0b01", now, &lim), Ok(()));
    assert_eq!(
        ordinary.validate(&key, now, &lim),
        Err(DhtValueError::OrdinarySubkeyOnOwnedKey)
    );

    let max = lim.max_owned_entry_bytes;
    let fits = DhtValue::owned(&key, &kp, vec![7u8; max], exp).unwrap();
    assert_eq!(fits.validate(&key, now, &lim), Ok(()));
    let big = DhtValue::owned(&key, &kp, vec![7u8; max + 1], exp).unwrap();
    assert_eq!(
        big.validate(&key, now, &lim),
        Err(DhtValueError::OwnedEntryTooLarge { len: max + 1, max })
    );
    let big_elsewhere = DhtValue::owned(b"run.0b01", &kp, vec![7u8; max + 1], exp).unwrap();
    assert_eq!(big_elsewhere.validate(b"run.0b01", now, &lim), Ok(()));
}

/// A replica takes an owned key's entry only from its owner: a peer relaying (or forging a
/// dictionary of) other owners' validly signed entries is refused, whatever else it holds.
#[test]
fn replicas_take_owned_entries_from_their_owners_only() {
    let policy = DhtPolicy::default();
    let now = std::time::SystemTime::now();
    let exp = DhtTime::now().saturating_add(Duration::from_secs(60));
    let key = owned_key("run.all_averagers");
    let (owner, squatter) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let (owner_id, squatter_id) = (owner.public().to_peer_id(), squatter.public().to_peer_id());
    let theirs = DhtValue::owned(&key, &owner, b("decl"), exp).unwrap();
    let own = DhtValue::owned(&key, &squatter, b("decl"), exp).unwrap();

    let (stored, _) = policy
        .merge(&key, None, &theirs.to_bytes(), Some(owner_id), now)
        .unwrap();
    let err = policy
        .merge(&key, None, &theirs.to_bytes(), Some(squatter_id), now)
        .unwrap_err();
    assert!(err.contains("another peer sent the entry of"), "{err}");
    let both = merge(theirs.clone(), own.clone());
    assert!(
        policy
            .merge(
                &key,
                Some(&stored),
                &both.to_bytes(),
                Some(squatter_id),
                now
            )
            .is_err()
    );
    let (merged, _) = policy
        .merge(&key, Some(&stored), &own.to_bytes(), Some(squatter_id), now)
        .unwrap();
    let merged = DhtValue::from_bytes(&merged, &policy.limits).unwrap();
    assert_eq!(merged.owner_entries().count(), 2);
    // Under an ordinary key anyone may pass a signed entry on; this node's own writes
    // (no source) are not held to the rule.
    assert!(
        policy
            .merge(
                b"run.all_averagers",
                None,
                &DhtValue::owned(b"run.all_averagers", &owner, b("decl"), exp)
                    .unwrap()
                    .to_bytes(),
                Some(squatter_id),
                now
            )
            .is_ok()
    );
    assert!(
        policy
            .merge(&key, None, &theirs.to_bytes(), None, now)
            .is_ok()
    );
}

/// The cache of verified entries: an entry that passed is remembered, its replay passes
/// without growing the cache, a changed entry (another value under the same signature, or
/// the same bytes under another key) is still checked and refused, and the cache is bounded.
#[test]
fn verified_entries_are_remembered_by_every_byte_checked() {
    let cache = VerifiedEntries::new(3);
    let kp = Keypair::generate_ed25519();
    let (v, sub, e) = owned(&kp, "decl", t(1010.0));
    let check = |key: &[u8], value: &DhtValue| {
        value.validate_against(key, t(1000.0), &limits(), None, Some(&cache))
    };
    assert_eq!(check(KEY, &v), Ok(()));
    assert_eq!(cache.len(), 1);
    assert_eq!(check(KEY, &v), Ok(()));
    assert_eq!(
        cache.len(),
        1,
        "a replay is not checked or remembered again"
    );
    let altered = one(
        &sub,
        Entry {
            value: b("other"),
            ..e.clone()
        },
    );
    let bad = Err(DhtValueError::BadSignature {
        owner: kp.public().to_peer_id(),
    });
    assert_eq!(check(KEY, &altered), bad);
    assert_eq!(check(b"another key", &v), bad);
    assert_eq!(cache.len(), 1);
    for i in 0..5 {
        let (w, _, _) = owned(&Keypair::generate_ed25519(), &format!("d{i}"), t(1010.0));
        assert_eq!(check(KEY, &w), Ok(()));
    }
    assert_eq!(cache.len(), 3, "bounded");
    // Unsigned entries are never remembered.
    let plain = DhtValue::subkey(b("alice"), b("decl"), t(1010.0));
    let before = cache.len();
    assert_eq!(check(KEY, &plain), Ok(()));
    assert_eq!(cache.len(), before);
}

#[test]
fn store_skips_checks_only_for_identical_verified_entries() {
    let kp = Keypair::generate_ed25519();
    let (v, sub, e) = owned(&kp, "decl", t(1010.0));
    let forged = one(
        &sub,
        Entry {
            value: b("x"),
            ..e.clone()
        },
    );
    let bad = Err(DhtValueError::BadSignature {
        owner: kp.public().to_peer_id(),
    });
    assert_eq!(
        forged.validate_against(KEY, t(1000.0), &limits(), Some(&v), None),
        bad
    );
    assert_eq!(
        v.validate_against(KEY, t(1000.0), &limits(), Some(&v), None),
        Ok(())
    );
    let unsigned = DhtValue::subkey(sub, b("decl"), t(1010.0));
    assert!(
        unsigned
            .validate_against(KEY, t(1000.0), &limits(), Some(&v), None)
            .is_err()
    );
}

fn arb_time() -> impl Strategy<Value = DhtTime> {
    prop_oneof![
        // A small grid, so equal expirations (ties) are frequent.
        4 => (0u8..6).prop_map(|i| t(f64::from(i) * 0.5)),
        1 => (-1e10f64..1e10).prop_map(t),
    ]
}

fn arb_bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop_oneof![
        Just(Bytes::new()),
        Just(b("x")),
        Just(b("y")),
        proptest::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from),
    ]
}

fn arb_subkey() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        Just(b("a")),
        Just(b("b")),
        Just(b("c")),
        proptest::collection::vec(any::<u8>(), 1..3).prop_map(Bytes::from),
    ]
}

/// A signature (never empty bytes): two fixed ones, so ties on equal writes are frequent.
fn arb_signature() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        Just(b("s1")),
        Just(b("s2")),
        proptest::collection::vec(any::<u8>(), 1..4).prop_map(Bytes::from),
    ]
}

/// An unsigned entry (plain values are never signed).
fn arb_plain_entry() -> impl Strategy<Value = Entry> {
    (arb_bytes(4), arb_time()).prop_map(|(v, e)| Entry::new(v, e))
}

/// A subkey entry, signed or not (merging ignores whether signatures verify).
fn arb_entry() -> impl Strategy<Value = Entry> {
    (arb_plain_entry(), proptest::option::of(arb_signature())).prop_map(|(e, s)| match s {
        Some(s) => e.with_signature(s),
        None => e,
    })
}

/// Three identities for really signed writes.
fn signers() -> &'static [Keypair] {
    static SIGNERS: std::sync::OnceLock<Vec<Keypair>> = std::sync::OnceLock::new();
    SIGNERS.get_or_init(|| (0..3).map(|_| Keypair::generate_ed25519()).collect())
}

/// A valid value under [`KEY`]: signed writes of the signers' owner subkeys, ordinary subkey
/// writes and plain writes, merged.
fn arb_signed_value() -> impl Strategy<Value = DhtValue> {
    let write = prop_oneof![
        3 => (0..signers().len(), arb_bytes(4), arb_time())
            .prop_map(|(i, v, e)| DhtValue::owned(KEY, &signers()[i], v, e).unwrap()),
        1 => (arb_subkey(), arb_bytes(4), arb_time())
            .prop_map(|(k, v, e)| DhtValue::subkey(k, v, e)),
        1 => (arb_bytes(4), arb_time()).prop_map(|(v, e)| DhtValue::plain(v, e)),
    ];
    proptest::collection::vec(write, 1..6).prop_map(|w| merge_all(w).unwrap())
}

/// One write: plain (no subkey) or to a subkey.
fn arb_write() -> impl Strategy<Value = (Option<Bytes>, Entry)> {
    prop_oneof![
        arb_plain_entry().prop_map(|e| (None, e)),
        (arb_subkey(), arb_entry()).prop_map(|(k, e)| (Some(k), e)),
    ]
}

fn arb_value() -> impl Strategy<Value = DhtValue> {
    (
        proptest::option::of(arb_plain_entry()),
        proptest::collection::vec((arb_subkey(), arb_entry()), 0..6),
    )
        .prop_filter_map("a value holds something", |(p, s)| {
            DhtValue::from_parts(p, s)
        })
}

fn single(write: (Option<Bytes>, Entry)) -> DhtValue {
    match write {
        (None, e) => DhtValue::plain(e.value, e.expiration),
        (Some(k), e) => DhtValue::from_parts(None, [(k, e)]).unwrap(),
    }
}

proptest! {
    #[test]
    fn merge_is_commutative(a in arb_value(), b in arb_value()) {
        prop_assert_eq!(merge(a.clone(), b.clone()), merge(b, a));
    }

    #[test]
    fn merge_is_associative(a in arb_value(), b in arb_value(), c in arb_value()) {
        prop_assert_eq!(
            merge(merge(a.clone(), b.clone()), c.clone()),
            merge(a, merge(b, c))
        );
    }

    #[test]
    fn merge_is_idempotent(a in arb_value(), b in arb_value()) {
        prop_assert_eq!(merge(a.clone(), a.clone()), a.clone());
        let ab = merge(a.clone(), b);
        prop_assert_eq!(merge(ab.clone(), a), ab);
    }

    /// Folding writes in any order gives the value holding the newest plain write and the
    /// newest write of every subkey.
    #[test]
    fn merge_all_equals_the_newest_writes_in_any_order(
        (writes, shuffled) in proptest::collection::vec(arb_write(), 1..12)
            .prop_flat_map(|w| (Just(w.clone()), Just(w).prop_shuffle()))
    ) {
        let plain = writes.iter().filter(|(k, _)| k.is_none()).map(|(_, e)| e.clone()).max();
        let mut model = std::collections::BTreeMap::<Bytes, Entry>::new();
        for (k, e) in &writes {
            if let Some(k) = k {
                let cur = model.entry(k.clone()).or_insert_with(|| e.clone());
                if e > cur {
                    *cur = e.clone();
                }
            }
        }
        let expected = DhtValue::from_parts(plain, model);
        prop_assert_eq!(merge_all(writes.into_iter().map(single)), expected.clone());
        prop_assert_eq!(merge_all(shuffled.into_iter().map(single)), expected);
    }

    /// The merge laws with really signed owner entries; merging valid values stays valid (every
    /// signature survives) and keeps the newest signed write of every owner.
    #[test]
    fn merge_laws_hold_for_signed_values(
        a in arb_signed_value(),
        b in arb_signed_value(),
        c in arb_signed_value(),
    ) {
        let lax = ValidationLimits {
            max_expiration_ahead: Duration::MAX,
            ..ValidationLimits::default()
        };
        let now = t(-1e11);
        for v in [&a, &b, &c] {
            prop_assert_eq!(v.validate(KEY, now, &lax), Ok(()));
        }
        let ab = merge(a.clone(), b.clone());
        prop_assert_eq!(&ab, &merge(b.clone(), a.clone()));
        prop_assert_eq!(merge(ab.clone(), c.clone()), merge(a.clone(), merge(b.clone(), c)));
        prop_assert_eq!(merge(ab.clone(), a.clone()), ab.clone());
        prop_assert_eq!(ab.validate(KEY, now, &lax), Ok(()));
        for (peer, e) in ab.owner_entries() {
            let newest = [&a, &b]
                .iter()
                .flat_map(|v| v.owner_entries())
                .filter(|(p, _)| *p == peer)
                .map(|(_, e)| e)
                .max();
            prop_assert_eq!(Some(e), newest);
        }
    }

    #[test]
    fn without_expired_commutes_with_merge(a in arb_value(), b in arb_value(), now in arb_time()) {
        let merged_then_dropped = merge(a.clone(), b.clone()).without_expired(now);
        let dropped_then_merged =
            merge_all([a.without_expired(now), b.without_expired(now)].into_iter().flatten());
        prop_assert_eq!(merged_then_dropped, dropped_then_merged);
    }

    /// Expiry never switches the view to an older write: what remains visible is the live part
    /// of what was visible.
    #[test]
    fn expiry_keeps_the_live_part_of_the_view(v in arb_value(), now in arb_time()) {
        let live = v.clone().without_expired(now);
        match (v.view(), live.as_ref().map(DhtValue::view)) {
            (DhtView::Plain(p), Some(DhtView::Plain(q))) => prop_assert_eq!(p, q),
            (DhtView::Plain(p), None) => prop_assert!(p.is_expired(now)),
            (DhtView::Dictionary(d), Some(DhtView::Dictionary(e))) => {
                let expected: std::collections::BTreeMap<_, _> = d
                    .iter()
                    .filter(|(_, x)| !x.is_expired(now))
                    .map(|(k, x)| (k.clone(), x.clone()))
                    .collect();
                prop_assert_eq!(&expected, e);
            }
            (DhtView::Dictionary(d), None) => prop_assert!(d.values().all(|x| x.is_expired(now))),
            (before, after) => prop_assert!(false, "view changed kind: {:?} -> {:?}", before, after),
        }
    }

    #[test]
    fn encode_decode_round_trip(v in arb_value()) {
        let bytes = v.to_bytes();
        prop_assert_eq!(bytes.len(), v.encoded_len());
        prop_assert_eq!(DhtValue::from_bytes(&bytes, &ValidationLimits::default()), Ok(v));
    }

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let limits = ValidationLimits { max_subkeys: 4, ..ValidationLimits::default() };
        if let Ok(v) = DhtValue::from_bytes(&data, &limits) {
            let again = DhtValue::from_bytes(&v.to_bytes(), &limits);
            prop_assert_eq!(again, Ok(v));
        }
    }

    #[test]
    fn mutated_encodings_never_panic(
        v in arb_value(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
    ) {
        let mut bytes = v.to_bytes();
        for (at, byte) in edits {
            if !bytes.is_empty() {
                let i = at % bytes.len();
                bytes[i] = byte;
            }
        }
        let limits = ValidationLimits::default();
        if let Ok(d) = DhtValue::from_bytes(&bytes, &limits) {
            let _ = d.validate(b"key", t(0.0), &limits);
            prop_assert_eq!(DhtValue::from_bytes(&d.to_bytes(), &limits), Ok(d));
        }
    }
}

/// A replica whose clock runs ahead of the reader's holds an honest write that expires past the
/// reader's horizon. The reader drops that write and keeps the rest of the answer (before, it
/// threw the whole answer away); a write within the stated skew is kept.
#[test]
fn a_reader_behind_a_replica_drops_the_entry_not_the_answer() {
    let limits = ValidationLimits::default();
    let reader_now = t(10_000.0);
    let horizon = limits.horizon(reader_now);
    let ahead = horizon.saturating_add(Duration::from_secs(60));
    let within_skew = reader_now
        .saturating_add(DEFAULT_MAX_EXPIRATION_AHEAD)
        .saturating_add(Duration::from_secs(120));
    let keypair = Keypair::generate_ed25519();
    let signed = DhtValue::owned(KEY, &keypair, b("mine"), t(10_030.0)).unwrap();
    let answer = merge(
        signed.clone(),
        DhtValue::from_parts(
            None,
            [
                (b("late"), Entry::new(b("a"), ahead)),
                (b("skewed"), Entry::new(b("b"), within_skew)),
                (b("now"), Entry::new(b("c"), t(10_010.0))),
            ],
        )
        .unwrap(),
    );
    // As a replica would: its clock is 10 minutes ahead of the reader's.
    let replica_now = reader_now.saturating_add(Duration::from_secs(600));
    assert_eq!(answer.validate(KEY, replica_now, &limits), Ok(()));
    assert!(matches!(
        answer.validate(KEY, reader_now, &limits),
        Err(DhtValueError::ExpirationTooFar { .. })
    ));

    let read = client::read_answer(KEY, &answer.to_bytes(), reader_now, &limits, None, None)
        .unwrap()
        .expect("the answer's other writes are kept");
    let DhtView::Dictionary(entries) = read.view() else {
        panic!("a dictionary")
    };
    let kept: Vec<&[u8]> = entries.keys().map(|k| k.as_ref()).collect();
    let owner = signed.view();
    let DhtView::Dictionary(owner) = owner else {
        panic!("a dictionary")
    };
    let mut expected: Vec<&[u8]> = vec![b"now", b"skewed"];
    expected.extend(owner.keys().map(|k| k.as_ref()));
    expected.sort();
    assert_eq!(kept, expected);

    // Only writes past the horizon: nothing usable, and not an error.
    let only_late = DhtValue::subkey(b("late"), b("a"), ahead);
    assert_eq!(
        client::read_answer(KEY, &only_late.to_bytes(), reader_now, &limits, None, None),
        Ok(None)
    );
    // A forged signed write still gets the whole answer refused.
    let (subkey, entry) = owner.iter().next().unwrap();
    let mut tampered = entry.clone();
    tampered.value = b("not mine");
    let forged = DhtValue::from_parts(
        None,
        [
            (subkey.clone(), tampered),
            (b("now"), Entry::new(b("c"), t(10_010.0))),
        ],
    )
    .unwrap();
    assert!(client::read_answer(KEY, &forged.to_bytes(), reader_now, &limits, None, None).is_err());
}
