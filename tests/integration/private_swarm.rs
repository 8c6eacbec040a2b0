//! Private swarms (`P2pConfig::swarm_key`, `src/p2p/private.rs`) on loopback: members holding
//! the key form the DHT and average together; a peer without the key, or with another one,
//! can join neither the DHT nor a round, and the data plane refuses its TLS links.

use std::sync::Arc;
use std::time::Duration;

use hivemesh::averager::node::{Node, NodeConfig};
use hivemesh::averager::{Averager, AveragerConfig, StepOptions};
use hivemesh::p2p::{P2pConfig, P2pError, SwarmKey};
use hivemesh::tensor::Tensor;
use hivemesh::transport::{self, DataIdentity};
use hivemesh::wire::{self, Hello, LinkMessage, RejectReason};
use libp2p::Multiaddr;
use libp2p::identity::Keypair;

fn config(initial: Option<&Multiaddr>, key: Option<SwarmKey>) -> NodeConfig {
    NodeConfig {
        p2p: P2pConfig {
            initial_peers: initial.into_iter().cloned().collect(),
            swarm_key: key,
            bootstrap_timeout: Duration::from_secs(60),
            ..P2pConfig::loopback()
        },
        ..NodeConfig::loopback()
    }
}

/// Opens a TLS link as `keypair` to `to`'s data plane, sends a Hello for a group nobody
/// registered, and returns the hub's answer.
async fn hello_answer(keypair: &Keypair, to: &Node) -> LinkMessage {
    let identity = DataIdentity::new(keypair).expect("identity");
    let addr = to.hub().data_addr().expect("a data listener");
    let peer = to.dht().p2p().peer_id();
    let mut link = transport::connect(&identity, addr, peer, Duration::from_secs(30))
        .await
        .expect("the TLS handshake itself succeeds: the gate comes after it");
    let hello = LinkMessage::Hello(Hello {
        group_id: bytes::Bytes::from_static(b"no-such-group"),
        from_index: 0,
        from_peer: keypair.public().to_peer_id(),
    });
    let mut buf = bytes::BytesMut::new();
    wire::encode_link_frame(&hello, &mut buf);
    use tokio::io::AsyncWriteExt as _;
    // The hub may refuse before reading the Hello (and close): a failed write is fine here,
    // the answer is what counts.
    let _ = link.write_all(&buf).await;
    let _ = link.flush().await;
    tokio::time::timeout(Duration::from_secs(60), wire::read_link_frame(&mut link))
        .await
        .expect("the hub answers within a minute")
        .expect("a link frame")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_average_and_outsiders_join_neither_the_dht_nor_a_round() {
    let key = SwarmKey::generate();
    let boot_key = Keypair::generate_ed25519();
    let boot = Node::start(config(None, Some(key)), boot_key.clone())
        .await
        .expect("bootstrap node");
    let boot_addr = boot.dht().p2p().listen_addrs().await.expect("addrs")[0].clone();
    assert!(
        boot_addr
            .iter()
            .all(|p| !matches!(p, libp2p::multiaddr::Protocol::QuicV1)),
        "a private swarm listens on TCP only: {boot_addr}"
    );

    // Outsiders: no key, and another key. Neither gets a connection to the swarm.
    for other in [None, Some(SwarmKey::generate())] {
        let err = Node::start(config(Some(&boot_addr), other), Keypair::generate_ed25519())
            .await
            .expect_err("an outsider cannot join through a member");
        assert!(
            matches!(err, hivemesh::averager::node::NodeError::Dht(_)),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(text.contains("initial peer"), "{text}");
    }
    // An outsider that starts alone and dials a member fails the same way; the member never
    // counts it as a swarm peer.
    let outsider_key = Keypair::generate_ed25519();
    let outsider = Node::start(config(None, None), outsider_key.clone())
        .await
        .expect("a lone outsider");
    let boot_id = boot.dht().p2p().peer_id();
    outsider
        .dht()
        .p2p()
        .add_peer_addresses(boot_id, vec![boot_addr.clone()])
        .await
        .expect("addresses");
    let dialed = outsider
        .dht()
        .p2p()
        .open_stream(boot_id, "/hivemesh/test/1", Duration::from_secs(30))
        .await;
    assert!(
        matches!(
            dialed,
            Err(P2pError::Dial { .. }
                | P2pError::OpenStream { .. }
                | P2pError::OpenStreamTimeout { .. })
        ),
        "{dialed:?}"
    );
    assert!(
        !boot
            .dht()
            .p2p()
            .knows_swarm_member(&outsider_key.public().to_peer_id())
    );

    // Members: a DHT write is read back by another member.
    let keys: Vec<Keypair> = (0..3).map(|_| Keypair::generate_ed25519()).collect();
    let mut members = Vec::new();
    for k in &keys {
        members.push(
            Node::start(config(Some(&boot_addr), Some(key)), k.clone())
                .await
                .expect("a member joins"),
        );
    }
    let expiration = hivemesh::dht::DhtTime::now().saturating_add(Duration::from_secs(60));
    members[0]
        .dht()
        .store(b"private-key", None, b"v", expiration)
        .await
        .expect("store");
    let got = members[2].dht().get(b"private-key").await.expect("get");
    assert!(got.is_some(), "a member reads another member's write");

    // The data plane: the outsider's TLS link is refused right after its handshake; a member's
    // (connected to `boot` through the key) gets as far as its Hello.
    assert!(
        matches!(
            hello_answer(&outsider_key, &boot).await,
            LinkMessage::Reject(r) if r.reason == RejectReason::NotInSwarm
        ),
        "an outsider's TLS link is refused as not in the swarm"
    );
    assert!(
        matches!(
            hello_answer(&keys[0], &boot).await,
            LinkMessage::Reject(r) if r.reason == RejectReason::UnknownGroup
        ),
        "a member's Hello is checked (and its group is unknown)"
    );
    let stats = boot.hub().stats();
    assert_eq!(stats.not_in_swarm, 1, "{stats:?}");
    assert_eq!(stats.unknown_address, 0, "{stats:?}");

    // Before any handshake, the address: a TLS client from 127.0.0.2, where no swarm peer has
    // connected from, is closed before the hub sends a ServerHello, so its handshake fails on
    // the client's side (after a handshake, TLS 1.3 would have let it finish and read a
    // Reject), and the hub counts no failed handshake.
    let failed_before = stats.tls_failed;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.2:0".parse().expect("addr"))
        .expect("bind 127.0.0.2");
    let tcp = socket
        .connect(boot.hub().data_addr().expect("a data listener"))
        .await
        .expect("the TCP connection is accepted");
    let identity = DataIdentity::new(&keys[1]).expect("identity");
    let refused = transport::connect_over(&identity, tcp, boot_id, Duration::from_secs(30)).await;
    assert!(
        matches!(refused, Err(transport::TlsError::Handshake { .. })),
        "closed before a ServerHello: {:?}",
        refused.map(|s| s.peer_id())
    );
    let stats = boot.hub().stats();
    assert_eq!(stats.unknown_address, 1, "{stats:?}");
    assert_eq!(stats.tls_failed, failed_before, "{stats:?}");
    assert_eq!(stats.not_in_swarm, 1, "{stats:?}");

    // A round among the three members, over TLS links between peers that may have no libp2p
    // connection of their own (admitted as registered members). The outsider runs an averager
    // under the same prefix at the same time, and the groups have room for a fourth: it is
    // kept out (its step finds no group; had it got in, the members' groups would hold it and
    // their mean would move toward its 100s).
    let outsider_averager = Averager::start(
        outsider.dht().clone(),
        outsider.hub().clone(),
        vec![Tensor::from_f32(&[4], vec![100.0; 4]).expect("tensor")],
        {
            let mut c = AveragerConfig::new("private");
            c.target_group_size = Some(4);
            c.min_group_size = 2;
            c.min_matchmaking_time = Duration::from_secs(2);
            c
        },
    )
    .expect("the outsider's averager");
    let outsider_step = outsider_averager.step(StepOptions {
        timeout: Some(Duration::from_secs(20)),
        ..StepOptions::default()
    });
    let averagers: Vec<Arc<Averager>> = members
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut c = AveragerConfig::new("private");
            c.target_group_size = Some(4);
            c.min_group_size = 3;
            c.min_matchmaking_time = Duration::from_secs(2);
            let t = Tensor::from_f32(&[4], vec![i as f32; 4]).expect("tensor");
            Arc::new(
                Averager::start(node.dht().clone(), node.hub().clone(), vec![t], c)
                    .expect("averager"),
            )
        })
        .collect();
    let steps = averagers.iter().map(|a| {
        let a = Arc::clone(a);
        async move {
            a.step(StepOptions {
                timeout: Some(Duration::from_secs(120)),
                ..StepOptions::default()
            })
            .await
        }
    });
    let (outcomes, outsider_outcome) =
        futures::future::join(futures::future::join_all(steps), outsider_step).await;
    assert!(
        outsider_outcome.is_err(),
        "the outsider found no group: {outsider_outcome:?}"
    );
    assert_eq!(
        outsider_averager.tensors()[0].to_f32_vec(),
        vec![100.0; 4],
        "the outsider averaged with nobody"
    );
    outsider_averager.shutdown().await;
    for (i, outcome) in outcomes.into_iter().enumerate() {
        let outcome = outcome.expect("a group of three formed and averaged");
        assert_eq!(outcome.members.len(), 3, "member {i}");
        assert!(
            !outcome
                .members
                .contains(&outsider_key.public().to_peer_id()),
            "member {i}"
        );
        let values = averagers[i].tensors()[0].to_f32_vec();
        assert_eq!(values, vec![1.0; 4], "member {i} holds the mean of 0, 1, 2");
    }
    for a in averagers {
        if let Ok(a) = Arc::try_unwrap(a) {
            a.shutdown().await;
        }
    }
    for node in members.into_iter().chain([outsider, boot]) {
        node.shutdown().await;
    }
}
