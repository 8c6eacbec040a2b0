//! The typed DHT on in-process libp2p swarms over loopback.

use crate::common;

use common::dht_node;

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use hivemesh::dht::{
    Dht, DhtError, DhtTime, DhtValue, DhtValueError, DhtView, Entry, StoreRequest, owner_subkey,
    signing_payload,
};
use hivemesh::p2p::{P2p, P2pConfig, RecordPolicy};
use libp2p::PeerId;
use libp2p::identity::Keypair;

async fn swarm(n: usize) -> Vec<Dht> {
    let boot = dht_node(vec![], false).await;
    let addrs = boot.p2p().listen_addrs().await.unwrap();
    let mut all = vec![boot];
    for i in 1..n {
        // The last peer is a client-mode DHT peer.
        all.push(dht_node(addrs.clone(), i == n - 1).await);
    }
    all
}

fn ahead(secs: f64) -> DhtTime {
    DhtTime::from_secs(DhtTime::now().as_secs() + secs).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_peer_reads_every_subkey() {
    let peers = swarm(8).await;
    let stores = peers.iter().enumerate().map(|(i, d)| async move {
        d.store(
            b"mygroup.0b01",
            Some(format!("peer-{i}").as_bytes()),
            b"hello",
            ahead(60.0),
        )
        .await
    });
    for r in futures::future::join_all(stores).await {
        r.unwrap();
    }
    for (i, d) in peers.iter().enumerate() {
        let v = d
            .get(b"mygroup.0b01")
            .await
            .unwrap()
            .expect("value present");
        let DhtView::Dictionary(entries) = v.view() else {
            panic!("peer {i}: expected a dictionary");
        };
        let names: Vec<_> = entries.keys().cloned().collect();
        let want: Vec<Bytes> = (0..8).map(|i| Bytes::from(format!("peer-{i}"))).collect();
        assert_eq!(names, want, "peer {i}");
    }
    assert!(peers[2].get(b"nothing-here").await.unwrap().is_none());
}

/// `hivemesh_dht_writes_total{replicas="..."}` of a node.
fn writes(d: &Dht, replicas: &str) -> u64 {
    counter(
        d,
        &format!("hivemesh_dht_writes_total{{replicas=\"{replicas}\"}} "),
    )
}

/// The value of the metric line that starts with `prefix` (its name and labels, then a space).
fn counter(d: &Dht, prefix: &str) -> u64 {
    let text = d.p2p().metrics().encode();
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in {text}"))
}

/// Re-storing a key (a progress record every few seconds) looks its closest peers up once, not
/// before every write, and every write still reaches every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrites_of_a_key_reuse_its_replicas() {
    let peers = swarm(4).await;
    let a = &peers[1];
    // Until a knows both other servers, its one lookup may find only one (3 in 30 runs).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for server in [&peers[0], &peers[2]] {
        let id = server.p2p().peer_id();
        while a.p2p().routing_addresses(id).await.unwrap().is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a never learned of server {id}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for round in 0..5u8 {
        let held = a
            .store(b"progress", Some(&a.own_subkey()), &[round], ahead(60.0))
            .await
            .unwrap();
        assert_eq!(held, 2, "round {round}: both other servers hold the write");
    }
    assert_eq!(writes(a, "looked_up"), 1);
    assert_eq!(writes(a, "known"), 4);
    // Five writes of at least one byte each, to two replicas each.
    let sent = counter(a, "hivemesh_dht_write_bytes_total ");
    assert!(sent >= 10, "{sent} bytes");
    for (i, d) in peers.iter().enumerate() {
        let v = d.get(b"progress").await.unwrap().expect("value present");
        let entry = v.subkeys().get(&a.own_subkey()[..]).cloned();
        assert_eq!(
            entry.map(|e| e.value),
            Some(Bytes::from_static(&[4])),
            "peer {i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_writes_win_and_expired_ones_vanish() {
    let peers = swarm(3).await;
    let (a, b) = (&peers[0], &peers[1]);
    a.store(b"k", Some(b"s"), b"new", ahead(60.0))
        .await
        .unwrap();
    b.store(b"k", Some(b"s"), b"old", ahead(30.0))
        .await
        .unwrap();
    for d in &peers {
        let v = d.get(b"k").await.unwrap().unwrap();
        let DhtView::Dictionary(e) = v.view() else {
            panic!("dictionary")
        };
        assert_eq!(
            e[&Bytes::from_static(b"s")].value,
            Bytes::from_static(b"new")
        );
    }
    // Leaving: the same subkey, a later expiration, an empty value.
    let leave = ahead(60.0).next_up();
    b.store(b"k", Some(b"s"), b"", leave).await.unwrap();
    let v = peers[2].get(b"k").await.unwrap().unwrap();
    let DhtView::Dictionary(e) = v.view() else {
        panic!("dictionary")
    };
    assert!(e[&Bytes::from_static(b"s")].value.is_empty());

    // Expiry across the swarm: the merged replicas, read at a time past the expiration.
    let expires = ahead(30.0);
    a.store(b"short", None, b"x", expires).await.unwrap();
    let before = DhtTime::from_secs(expires.as_secs() - 1.0).unwrap();
    let after = DhtTime::from_secs(expires.as_secs() + 1.0).unwrap();
    assert!(peers[2].get_at(b"short", before).await.unwrap().is_some());
    assert!(peers[2].get_at(b"short", after).await.unwrap().is_none());
    // The dictionary under "k" outlives "short" but not its own latest entry.
    let latest = DhtTime::from_secs(leave.as_secs() + 1.0).unwrap();
    assert!(peers[2].get_at(b"k", after).await.unwrap().is_some());
    assert!(peers[2].get_at(b"k", latest).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_writes_are_refused() {
    let peers = swarm(2).await;
    let err = peers[0]
        .store(b"k", None, b"v", ahead(10.0 * 3600.0))
        .await
        .unwrap_err();
    assert!(
        matches!(err, DhtError::Value(DhtValueError::ExpirationTooFar { .. })),
        "{err}"
    );
    let results = peers[1]
        .store_many(vec![
            StoreRequest {
                key: b"a".to_vec(),
                subkey: None,
                value: b"1".to_vec(),
                expiration: ahead(30.0),
            },
            StoreRequest {
                key: b"b".to_vec(),
                subkey: Some(Vec::new()),
                value: b"2".to_vec(),
                expiration: ahead(30.0),
            },
        ])
        .await;
    assert!(results[0].is_ok());
    assert!(matches!(
        results[1],
        Err(DhtError::Value(DhtValueError::EmptySubkey))
    ));
    let got = peers[0].get_many(&[b"a".to_vec(), b"b".to_vec()]).await;
    assert!(got[0].as_ref().unwrap().is_some());
    assert!(got[1].as_ref().unwrap().is_none());
}

/// A record store that checks nothing and keeps the last write: what a malicious peer runs, so
/// that its forged records leave it (an honest node's own policy would refuse them) and it
/// answers GETs with them.
struct AcceptAnything;

impl RecordPolicy for AcceptAnything {
    fn merge(
        &self,
        _key: &[u8],
        _existing: Option<&[u8]>,
        incoming: &[u8],
        _source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(Vec<u8>, SystemTime), String> {
        Ok((incoming.to_vec(), now + Duration::from_secs(3600)))
    }
}

/// What `d` reads under `key` for `owner`'s owner subkey.
async fn owner_entry(d: &Dht, key: &[u8], owner: PeerId) -> Option<Entry> {
    let v = d.get(key).await.unwrap()?;
    v.owner_entries()
        .find(|(p, _)| *p == owner)
        .map(|(_, e)| e.clone())
}

/// The signed-subkey rule: peer A declares under its owner subkey; a malicious peer E, which
/// stores and serves anything, pushes later-expiring records for A's subkey (unsigned, signed
/// with E's key, A's signature replayed with a later expiration, A's signed write for another
/// key replayed under this one). Every honest replica refuses them and every honest reader
/// skips E's forged answer (R, which joins through E, surely gets it), so every honest peer
/// still reads A's declaration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_subkeys_can_only_be_written_by_their_owner() {
    const KEY: &[u8] = b"mygroup.0b01";
    let peers = swarm(4).await;
    let a = &peers[1];
    let a_id = a.p2p().peer_id();
    let a_sub = a.own_subkey();
    assert_eq!(a_sub, owner_subkey(&a_id));

    // A declares itself, signed automatically; others may not write A's subkey.
    let declared = ahead(60.0);
    assert!(
        a.store(KEY, Some(&a_sub), b"A's declaration", declared)
            .await
            .unwrap()
            >= 1
    );
    let err = peers[0]
        .store(KEY, Some(&a_sub), b"mine", ahead(90.0))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        DhtError::NotOwner {
            owner: a_id,
            local: peers[0].p2p().peer_id()
        }
    );
    let mut malformed = a_sub.to_vec();
    malformed.push(0);
    assert!(matches!(
        peers[0]
            .store(KEY, Some(&malformed), b"x", ahead(90.0))
            .await,
        Err(DhtError::Value(DhtValueError::MalformedOwnerSubkey))
    ));
    let original = owner_entry(&peers[3], KEY, a_id)
        .await
        .expect("A's declaration");
    assert_eq!(original.value, Bytes::from_static(b"A's declaration"));
    assert!(original.signature.is_some(), "signed automatically");

    // A's legitimate write under another key, for the cross-key replay.
    a.store(b"other", Some(&a_sub), b"forged", ahead(120.0))
        .await
        .unwrap();
    let other = peers[0].get(b"other").await.unwrap().unwrap();
    let (_, signed_elsewhere) = other.owner_entries().next().unwrap();

    // E joins with a policy that accepts anything.
    let evil_key = Keypair::generate_ed25519();
    let boot = peers[0].p2p().listen_addrs().await.unwrap();
    let cfg = P2pConfig {
        initial_peers: boot,
        request_timeout: Duration::from_secs(10),
        ..P2pConfig::loopback()
    };
    let (evil, _task) = P2p::spawn(cfg, evil_key.clone(), Box::new(AcceptAnything))
        .await
        .unwrap();
    // An honest reader R that joins through E: E is in its routing table from the start, so
    // every GET of R's asks E (the others may not have learnt of E yet).
    let r = dht_node(evil.listen_addrs().await.unwrap(), true).await;

    let later = ahead(120.0);
    let forged_value = Bytes::from_static(b"forged");
    let e_signature = evil_key
        .sign(&signing_payload(KEY, &a_sub, &forged_value, later))
        .unwrap();
    let forgeries = [
        Entry::new(forged_value.clone(), later),
        Entry::new(forged_value.clone(), later).with_signature(e_signature),
        Entry {
            expiration: later,
            ..original.clone()
        },
        signed_elsewhere.clone(),
    ];
    for (i, forged) in forgeries.into_iter().enumerate() {
        assert!(forged.expiration > declared, "forgery {i} must be newer");
        let record = DhtValue::from_parts(None, [(a_sub.clone(), forged)]).unwrap();
        // Delivered: remote replicas acknowledge the PUT even when their policy refuses it.
        let delivered = evil
            .put_record(KEY.to_vec(), record.to_bytes())
            .await
            .unwrap();
        assert!(delivered >= 1, "forgery {i} reached no replica");
        let forged_bytes = record.to_bytes();
        // R's raw answers (every replica's): E's forged record, once, and no honest replica
        // took it (it would answer the same bytes, the forgery being newer); those holding A's
        // subkey hold A's declaration.
        let raw = r.p2p().get_record(KEY.to_vec()).await.unwrap();
        let carrying = raw.iter().filter(|a| **a == forged_bytes).count();
        assert_eq!(carrying, 1, "forgery {i}: answers carrying it");
        let honest: Vec<_> = raw.iter().filter(|a| **a != forged_bytes).collect();
        assert!(
            !honest.is_empty(),
            "forgery {i}: no honest replica answered"
        );
        for answer in honest {
            let v = DhtValue::from_bytes(answer, &Default::default()).unwrap();
            let held = v.subkeys().get(&a_sub);
            assert!(held.is_none_or(|e| *e == original), "forgery {i}");
        }
        // Every honest typed read skips E's answer and sees A's declaration, unchanged.
        for (j, d) in peers.iter().chain([&r]).enumerate() {
            let seen = owner_entry(d, KEY, a_id).await;
            assert_eq!(seen.as_ref(), Some(&original), "forgery {i}, peer {j}");
        }
    }
}

/// `Dht::store` counts the replicas that hold the write, not those that acknowledged it
/// (Kademlia acknowledges before the replica's store decides). A replica that takes one record
/// per remote peer holds the writer's first key and refuses its second: the second store
/// reports 0 replicas (before, 1). A newer write of the first key replaces it and counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_counts_the_replicas_that_kept_the_write() {
    let replica = Dht::start(
        P2pConfig {
            store: hivemesh::p2p::StoreLimits {
                max_records_per_peer: 1,
                ..hivemesh::p2p::StoreLimits::default()
            },
            request_timeout: Duration::from_secs(10),
            ..P2pConfig::loopback()
        },
        Keypair::generate_ed25519(),
    )
    .await
    .expect("replica")
    .0;
    let writer = dht_node(replica.p2p().listen_addrs().await.unwrap(), false).await;
    assert_eq!(
        writer
            .store(b"first", None, b"a", ahead(60.0))
            .await
            .unwrap(),
        1,
        "the replica keeps the writer's first record"
    );
    assert_eq!(
        writer
            .store(b"second", None, b"b", ahead(60.0))
            .await
            .unwrap(),
        0,
        "the replica refused the second (one record per peer): no replica holds it"
    );
    let acked = writer
        .store_unconfirmed(b"second", None, b"c", ahead(61.0))
        .await
        .unwrap();
    assert_eq!(acked, 1, "an acknowledgement alone still says 1");
    assert_eq!(
        writer
            .store(b"first", None, b"d", ahead(90.0))
            .await
            .unwrap(),
        1,
        "a newer write of a record it holds replaces it"
    );
    assert_eq!(
        replica.p2p().store_usage().await.unwrap().refused,
        2,
        "the two writes of the second key were refused"
    );
}

/// Key squatting: a peer that fills a key with one plain value sized to the limit, or with
/// 4,096 entries signed by throwaway keys, freezes an ordinary key (an honest declaration then
/// reaches no replica: the attack), but not an owned key, where the replica refuses both
/// writes and the honest declaration goes in and is read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn squatters_cannot_freeze_owned_keys() {
    let replica = dht_node(vec![], false).await;
    let boot = replica.p2p().listen_addrs().await.unwrap();
    let cfg = P2pConfig {
        initial_peers: boot.clone(),
        client_mode: true,
        request_timeout: Duration::from_secs(10),
        ..P2pConfig::loopback()
    };
    let (squatter, _task) = P2p::spawn(cfg, Keypair::generate_ed25519(), Box::new(AcceptAnything))
        .await
        .unwrap();
    let honest = dht_node(boot, true).await;
    let me = honest.p2p().peer_id();
    let limits = hivemesh::dht::ValidationLimits::default();

    let plain_squat = |_key: &[u8]| {
        // As large as the limit allows: nothing can be merged next to it.
        let mut len = limits.max_value_bytes - 64;
        loop {
            let v = DhtValue::plain(vec![0u8; len], ahead(3000.0));
            if v.to_bytes().len() <= limits.max_value_bytes {
                return v;
            }
            len -= 16;
        }
    };
    let flood_squat = |key: &[u8]| {
        let entries = (0..limits.max_subkeys).map(|_| {
            let kp = Keypair::generate_ed25519();
            DhtValue::owned(key, &kp, vec![1u8], ahead(3000.0)).unwrap()
        });
        hivemesh::dht::merge_all(entries).unwrap()
    };
    type Squat<'a> = &'a dyn Fn(&[u8]) -> DhtValue;
    let attacks: [(&str, Squat); 2] = [("plain", &plain_squat), ("flood", &flood_squat)];
    for (name, squat) in attacks {
        let ordinary = format!("run.{name}.all_averagers").into_bytes();
        let owned = hivemesh::dht::owned_key(&ordinary);
        for key in [&ordinary, &owned] {
            let value = squat(key);
            // Valid where the attack works (the flood's entries are validly signed under the
            // owned key too: what stops it there is that they do not come from their owners).
            if key == &ordinary {
                value.validate(key, DhtTime::now(), &limits).unwrap();
            }
            let before = replica.p2p().store_usage().await.unwrap().records;
            let delivered = squatter
                .put_record(key.clone(), value.to_bytes())
                .await
                .unwrap();
            assert_eq!(delivered, 1, "{name}: the PUT reached the replica");
            if key == &ordinary {
                // A record this large is checked on a blocking thread: wait until it is in.
                tokio::time::timeout(Duration::from_secs(60), async {
                    while replica.p2p().store_usage().await.unwrap().records == before {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .expect("the replica stores the squat on the ordinary key");
            }
        }
        // The attack works on an ordinary key: the honest declaration is refused.
        let kept = honest
            .store(&ordinary, Some(&honest.own_subkey()), b"decl", ahead(60.0))
            .await
            .unwrap();
        assert_eq!(
            kept, 0,
            "{name}: the squatted ordinary key took the declaration"
        );
        let replica_view = |key: Vec<u8>| async {
            let answers = honest.p2p().get_replica_records(key).await.unwrap();
            assert_eq!(answers.len(), 1, "{name}: the replica answers");
            DhtValue::from_bytes(&answers[0], &limits).unwrap()
        };
        let seen = replica_view(ordinary.clone()).await;
        assert!(seen.owner_entries().all(|(p, _)| p != me), "{name}");
        // Not on the owned key: the squat was refused, the declaration kept and read back.
        let kept = honest
            .store(&owned, Some(&honest.own_subkey()), b"decl", ahead(60.0))
            .await
            .unwrap();
        assert_eq!(kept, 1, "{name}: the owned key refused the declaration");
        let seen = replica_view(owned.clone()).await;
        let entries: Vec<_> = seen.owner_entries().collect();
        assert_eq!(entries.len(), 1, "{name}: only the honest entry");
        assert_eq!(entries[0].0, me);
        assert_eq!(entries[0].1.value, Bytes::from_static(b"decl"));
        assert!(seen.plain_entry().is_none(), "{name}");
    }
}

/// A replica that accepts a connection and never says a word (a stopped process: a laptop's
/// lid closed) does not hold a read up: the read answers with what the other replicas hold
/// while this node is still dialing the silent one. Before, every read waited until this node
/// gave up on it (the dial's 5 s timeout here, Kademlia's 10 s per-peer timeout on an open
/// connection), and reads that slow kept groups from forming in a matchmaking window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_replica_does_not_hold_reads_up() {
    use std::io::{ErrorKind, Read};

    let peers = swarm(3).await;
    let (writer, reader) = (&peers[1], &peers[2]);
    writer
        .store(b"silent.0b1", Some(b"writer"), b"here", ahead(60.0))
        .await
        .unwrap();
    // The silent replica: a listener that never accepts. The reader's dial lands in its
    // backlog and waits there for a handshake that never comes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    reader
        .p2p()
        .add_peer_addresses(
            PeerId::random(),
            vec![format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()],
        )
        .await
        .unwrap();

    let value = reader.get(b"silent.0b1").await.unwrap().expect("the value");
    let DhtView::Dictionary(entries) = value.view() else {
        panic!("expected a dictionary");
    };
    assert_eq!(&entries[&Bytes::from_static(b"writer")].value[..], b"here");

    // The read dialed the silent replica, and that dial is still open: the reader has not
    // given up on it (it closes the socket when it does), so the read did not wait for it.
    listener.set_nonblocking(true).unwrap();
    let (mut socket, _) = listener
        .accept()
        .expect("the read dialed the silent replica");
    socket.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match socket.read(&mut buf) {
            Ok(0) => panic!("the read waited until the reader gave up on the silent replica"),
            Ok(_) => continue, // the dialer's first handshake bytes
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("reading the silent replica's socket: {e}"),
        }
    }
}

/// Under an owned key the servers are both replicas and writers: a server whose own store
/// already holds another writer's entry still gets its write into the other replicas (a PUT
/// carries only the writer's own entry: replicas refuse a remote write that holds someone
/// else's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_holding_others_entries_still_writes_its_own() {
    let peers = swarm(3).await;
    let (a, b) = (&peers[0], &peers[1]);
    let key = hivemesh::dht::owned_key("run_progress");
    assert!(
        b.store(&key, Some(&b.own_subkey()), b"b1", ahead(60.0))
            .await
            .unwrap()
            >= 1,
        "b's first write reached no replica"
    );
    // a holds b's entry now: the third node is a client, so a is the replica that kept it.
    assert!(owner_entry(a, &key, b.p2p().peer_id()).await.is_some());
    let held = a
        .store(&key, Some(&a.own_subkey()), b"a1", ahead(60.0))
        .await
        .unwrap();
    assert!(held >= 1, "a's write was refused by every replica");
    let held = b
        .store(&key, Some(&b.own_subkey()), b"b2", ahead(61.0))
        .await
        .unwrap();
    assert!(held >= 1, "b's second write was refused by every replica");
}
