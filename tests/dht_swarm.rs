//! The typed DHT on in-process libp2p swarms over loopback.

use std::time::Duration;

use bytes::Bytes;
use hivemesh::dht::{Dht, DhtError, DhtTime, DhtValueError, DhtView, StoreRequest};
use hivemesh::p2p::P2pConfig;
use libp2p::identity::Keypair;

async fn node(initial: Vec<libp2p::Multiaddr>, client: bool) -> Dht {
    let cfg = P2pConfig {
        initial_peers: initial,
        client_mode: client,
        request_timeout: Duration::from_secs(10),
        ..P2pConfig::loopback()
    };
    Dht::start(cfg, Keypair::generate_ed25519())
        .await
        .expect("node starts")
        .0
}

async fn swarm(n: usize) -> Vec<Dht> {
    let boot = node(vec![], false).await;
    let addrs = boot.p2p().listen_addrs().await.unwrap();
    let mut all = vec![boot];
    for i in 1..n {
        // The last peer is a client-mode DHT peer.
        all.push(node(addrs.clone(), i == n - 1).await);
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
