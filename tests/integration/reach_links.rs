//! Links planned by reachability, with real hubs on loopback and the members' reachability set
//! by hand in their `LinkPeer`s: a NATed member opens its link to a public one (and the hub
//! refuses a Hello from the other side), clients link only to reducers, and `EstablishedLinks`
//! reports how each link is carried.

use crate::common;

use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use hivemesh::allreduce::{Member, Mode, Outcome, Partition, RoundConfig, TensorDescriptor};
use hivemesh::links::{
    Carrier, DataPlane, EstablishedLinks, HubConfig, HubStats, LinkHub, LinkKind, LinkPeer,
    PART_PROTOCOL,
};
use hivemesh::p2p::{P2p, P2pConfig, RecordPolicy, Transport};
use hivemesh::reach::Reach;
use hivemesh::runner::{self, RunnerConfig};
use hivemesh::sim::make_tensors;
use hivemesh::tensor::{DType, Tensor};
use hivemesh::transport::{DataIdentity, connect};
use hivemesh::wire::{self, Hello, LinkMessage, RejectReason};
use libp2p::{PeerId, identity::Keypair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// Bound on operations that should succeed.
const T: Duration = Duration::from_secs(30);

/// The DHT is not used here.
struct NoRecords;

impl RecordPolicy for NoRecords {
    fn merge(
        &self,
        _key: &[u8],
        _existing: Option<&[u8]>,
        _incoming: &[u8],
        _source: Option<PeerId>,
        _now: SystemTime,
    ) -> Result<(Vec<u8>, SystemTime), String> {
        Err("no records".into())
    }
}

struct Node {
    p2p: P2p,
    keypair: Keypair,
    hub: LinkHub,
}

impl Node {
    /// The member as a plain public node (sends and reduces), with its data address if any.
    fn peer(&self) -> LinkPeer {
        LinkPeer::public(self.p2p.peer_id(), self.hub.data_addr())
    }

    fn identity(&self) -> DataIdentity {
        DataIdentity::new(&self.keypair).expect("identity")
    }
}

/// How a node is set up.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Setup {
    /// TLS identity and listener; libp2p on loopback TCP.
    Tls,
    /// TLS identity (opens TLS links) but no listener; libp2p on loopback TCP.
    TlsDialOnly,
    /// No TLS; libp2p on loopback TCP.
    Tcp,
    /// No TLS; libp2p on loopback QUIC only.
    Quic,
}

/// Swarms that know each other's addresses, each with a hub.
async fn nodes(setups: &[Setup]) -> Vec<Node> {
    let mut nodes = Vec::new();
    for &setup in setups {
        let keypair = Keypair::generate_ed25519();
        let mut config = P2pConfig::loopback();
        if setup == Setup::Quic {
            config.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("addr")];
        }
        let (p2p, _) = P2p::spawn(config, keypair.clone(), Box::new(NoRecords))
            .await
            .expect("p2p node");
        let data_plane = match setup {
            Setup::Tls | Setup::TlsDialOnly => Some(DataPlane {
                identity: DataIdentity::new(&keypair).expect("identity"),
                listen: (setup == Setup::Tls).then(|| "127.0.0.1:0".parse().expect("addr")),
            }),
            Setup::Tcp | Setup::Quic => None,
        };
        let hub = LinkHub::start(p2p.clone(), data_plane, HubConfig::default())
            .await
            .expect("hub");
        nodes.push(Node { p2p, keypair, hub });
    }
    common::introduce_all(&nodes.iter().map(|n| &n.p2p).collect::<Vec<_>>()).await;
    nodes
}

/// Every member of `members` (member `i` runs on `nodes[i]`) registers and establishes its
/// links, all at once.
async fn establish_all(
    nodes: &[Node],
    members: &[LinkPeer],
    group: &[u8],
) -> Vec<EstablishedLinks> {
    let expectations: Vec<_> = (0..members.len())
        .map(|me| {
            nodes[me]
                .hub
                .expect(Bytes::copy_from_slice(group), members, me)
                .expect("register")
        })
        .collect();
    futures::future::join_all(expectations.into_iter().map(|e| e.establish(T))).await
}

fn hello(group: &[u8], from_index: u32, from_peer: PeerId) -> Vec<u8> {
    let mut b = BytesMut::new();
    wire::encode_link_frame(
        &LinkMessage::Hello(Hello {
            group_id: Bytes::copy_from_slice(group),
            from_index,
            from_peer,
        }),
        &mut b,
    );
    b.to_vec()
}

/// The answer to `frame` sent on a fresh `/hivemesh/part/1` stream from `from` to `to` (a
/// stream closed without an answer was dropped on the way: try again on a new one).
async fn answer_on_stream(from: &P2p, to: PeerId, frame: &[u8]) -> LinkMessage {
    for _ in 0..8 {
        let mut s = from
            .open_stream(to, PART_PROTOCOL, T)
            .await
            .expect("open stream");
        s.write_all(frame).await.expect("write");
        if let Ok(Ok(answer)) =
            tokio::time::timeout(Duration::from_secs(5), wire::read_link_frame(&mut s)).await
        {
            return answer;
        }
    }
    panic!("no answer from {to}");
}

/// The answer to `frame` sent over TLS (as `identity`) to `to`'s data address.
async fn answer_on_tls(identity: &DataIdentity, to: &LinkPeer, frame: &[u8]) -> LinkMessage {
    let mut s = connect(identity, to.data_addr.expect("listener"), to.peer_id, T)
        .await
        .expect("TLS handshake");
    s.write_all(frame).await.expect("write");
    tokio::time::timeout(T, wire::read_link_frame(&mut s))
        .await
        .expect("an answer in time")
        .expect("a link frame")
}

fn rejected(answer: LinkMessage) -> RejectReason {
    match answer {
        LinkMessage::Reject(r) => r.reason,
        other => panic!("expected a Reject, got {other:?}"),
    }
}

/// Waits until the hub's counters satisfy `ready`.
async fn stats_when(hub: &LinkHub, ready: impl FnMut(&HubStats) -> bool) -> HubStats {
    let mut w: watch::Receiver<HubStats> = hub.watch_stats();
    tokio::time::timeout(T, w.wait_for(ready))
        .await
        .expect("counted in time")
        .map(|s| *s)
        .expect("hub alive")
}

/// Writes on `from`'s link to `to` and reads it at the other end.
async fn ping(links: &mut [EstablishedLinks], from: usize, to: usize) {
    let msg = [from as u8, to as u8, 0xAB];
    let a = links[from].links[to].as_mut().expect("linked");
    a.write_all(&msg).await.expect("write");
    a.flush().await.expect("flush");
    let b = links[to].links[from].as_mut().expect("linked");
    let mut got = [0u8; 3];
    tokio::time::timeout(T, b.read_exact(&mut got))
        .await
        .expect("read in time")
        .expect("read");
    assert_eq!(got, msg, "{from} -> {to}");
}

/// A punchable member opens its link to a public member, whichever of the two has the lower
/// index; the public one never sends it a Hello (the NATed member's hub accepts nothing), and
/// a Hello from the public side is refused as `WrongDirection` on both carriers while the
/// round waits for its links. Both members have a TLS listener, so only reachability can decide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nated_member_opens_its_link_to_a_public_one() {
    for (nated, public) in [(1usize, 0usize), (0, 1)] {
        let nodes = nodes(&[Setup::Tls, Setup::Tls]).await;
        let mut members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
        members[nated].reach = Reach::Punchable;
        assert!(members.iter().all(|m| m.data_addr.is_some()));
        let group: &[u8] = if nated == 1 {
            b"nat-above"
        } else {
            b"nat-below"
        };

        // The NATed member's round is registered; the public member writes a Hello by hand.
        let waiting = nodes[nated]
            .hub
            .expect(Bytes::copy_from_slice(group), &members, nated)
            .expect("register");
        let wrong = hello(group, public as u32, nodes[public].p2p.peer_id());
        let on_stream =
            answer_on_stream(&nodes[public].p2p, nodes[nated].p2p.peer_id(), &wrong).await;
        assert_eq!(rejected(on_stream), RejectReason::WrongDirection);
        let on_tls = answer_on_tls(&nodes[public].identity(), &members[nated], &wrong).await;
        assert_eq!(rejected(on_tls), RejectReason::WrongDirection);

        // Now the round proper: the public member registers and both establish.
        let other = nodes[public]
            .hub
            .expect(Bytes::copy_from_slice(group), &members, public)
            .expect("register");
        let (a, b) = tokio::join!(waiting.establish(T), other.establish(T));
        let mut links = if nated == 0 { vec![a, b] } else { vec![b, a] };
        for (me, l) in links.iter().enumerate() {
            assert_eq!(l.linked(), 1, "member {me}: {l:?}");
            assert_eq!(l.kinds[1 - me], Some(LinkKind::Tls), "member {me}: {l:?}");
            assert_eq!(l.kinds[me], None);
        }
        ping(&mut links, nated, public).await;
        ping(&mut links, public, nated).await;

        // The public member's hub accepted the link; the NATed member's hub saw only the two
        // Hellos written by hand, and refused them.
        let at_public = stats_when(&nodes[public].hub, |s| s.accepted >= 1).await;
        assert_eq!(
            (at_public.accepted, at_public.refused),
            (1, 0),
            "{at_public:?}"
        );
        let at_nated = nodes[nated].hub.stats();
        assert_eq!(
            (at_nated.accepted, at_nated.refused),
            (0, 2),
            "{at_nated:?}"
        );
    }
}

fn descriptors() -> Vec<TensorDescriptor> {
    [vec![20_000], vec![7]]
        .into_iter()
        .map(|shape| TensorDescriptor {
            shape,
            dtype: DType::F32,
        })
        .collect()
}

/// One node (member 0, public, TLS listener) and two clients: member 1 public with a TLS
/// listener, member 2 private (TLS identity, no listener). Each client links to the node and
/// not to the other client, although member 2 could reach member 1's listener, and every
/// member ends with the exact mean of all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_link_to_the_reducer_and_not_to_each_other() {
    let nodes = nodes(&[Setup::Tls, Setup::Tls, Setup::TlsDialOnly]).await;
    let mut members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    for client in &mut members[1..] {
        client.reduces = false;
    }
    members[2].reach = Reach::Private;
    let modes = [Mode::Node, Mode::Client, Mode::Client];
    let round_members: Vec<Member> = modes
        .iter()
        .map(|&mode| Member {
            mode,
            fraction: if mode == Mode::Node { 1.0 } else { 0.0 },
        })
        .collect();
    let weights = [1.0, 2.0, 0.5];
    let start: Vec<Vec<Tensor>> = (0..3)
        .map(|p| make_tensors(&descriptors(), 5, p).expect("tensors"))
        .collect();
    let group: &'static [u8] = b"two-clients";
    let config = |me: usize| {
        let mut cfg = RoundConfig::new(round_members.clone(), me);
        cfg.weight = weights[me];
        cfg.part_size_bytes = 16 << 10;
        cfg.sender_timeout = Duration::from_secs(5);
        cfg.reducer_timeout = Duration::from_secs(10);
        cfg
    };
    let links = establish_all(&nodes, &members, group).await;
    // The node is linked to both clients over TLS: it opened the link to the public client
    // (lower index), the private client opened its own.
    assert_eq!(
        links[0].kinds,
        [None, Some(LinkKind::Tls), Some(LinkKind::Tls)],
        "{:?}",
        links[0]
    );
    for c in [1, 2] {
        let other = 3 - c;
        let l = &links[c];
        assert_eq!(l.kinds[0], Some(LinkKind::Tls), "client {c}: {l:?}");
        assert!(
            l.links[other].is_none(),
            "client {c} linked to client {other}"
        );
        assert!(
            l.errors[other].is_none(),
            "no traffic between clients is no error: {l:?}"
        );
        assert_eq!(l.linked(), 1, "client {c}: {l:?}");
    }
    // Who accepted what: the node the private client's link, the public client the node's;
    // the private client nothing.
    for (i, accepted) in [(0, 1), (1, 1), (2, 0)] {
        let s = stats_when(&nodes[i].hub, |s| s.accepted >= accepted).await;
        assert_eq!((s.accepted, s.refused), (accepted, 0), "member {i}: {s:?}");
    }

    let rounds = links.into_iter().enumerate().map(|(me, l)| {
        let (cfg, tensors) = (config(me), start[me].clone());
        tokio::spawn(async move {
            runner::run_round(
                cfg,
                Bytes::from_static(group),
                tensors,
                l.links,
                RunnerConfig::default(),
            )
            .await
        })
    });
    let results = tokio::time::timeout(2 * T, futures::future::join_all(rounds))
        .await
        .expect("the round finishes");
    for (me, r) in results.into_iter().enumerate() {
        let (_, outcome) = r
            .expect("member task")
            .unwrap_or_else(|e| panic!("member {me}: {e}"));
        let report = &outcome.report;
        assert!(
            report.banned.is_empty() && report.failed_reducers.is_empty(),
            "member {me}: {report:?}"
        );
        let err = deviation(me, &outcome, &config(me), &start, &weights);
        assert!(err < 1e-5, "member {me}: {err}");
        // Everyone holds the mean of all three: each part's contributors are every member.
        for span in &report.spans {
            for seg in &span.segments {
                let c = seg.contributors.as_ref().expect("averaged");
                assert_eq!(c.iter().count(), 3, "member {me}: {report:?}");
            }
        }
    }
}

fn deviation(
    me: usize,
    outcome: &Outcome,
    cfg: &RoundConfig,
    start: &[Vec<Tensor>],
    weights: &[f64],
) -> f32 {
    let part = Partition::new(
        &descriptors(),
        &cfg.fractions(),
        cfg.part_size_bytes,
        &cfg.compression,
    )
    .expect("partition");
    hivemesh::sim::deviation_from_report(me, outcome, &part, start, weights)
}

/// `EstablishedLinks::kinds` says how each link is carried, at both ends: TLS where the opener
/// has an identity and the other end a listener, else a libp2p stream over the transport of the
/// connection between the two (TCP, or QUIC to a node that listens on QUIC only). `carriers`
/// agrees with `kinds`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_report_how_each_link_is_carried() {
    let setups = [Setup::Tls, Setup::Tls, Setup::Tcp, Setup::Quic];
    let nodes = nodes(&setups).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let mut links = establish_all(&nodes, &members, b"kinds").await;
    // All public: the lower index opens.
    let expected = |lo: usize, hi: usize| match (setups[lo], setups[hi]) {
        (Setup::Tls, Setup::Tls) => LinkKind::Tls,
        (_, Setup::Quic) => LinkKind::Stream(Transport::Quic),
        _ => LinkKind::Stream(Transport::Tcp),
    };
    for (me, l) in links.iter().enumerate() {
        let want: Vec<Option<LinkKind>> = (0..setups.len())
            .map(|j| (j != me).then(|| expected(me.min(j), me.max(j))))
            .collect();
        assert_eq!(l.kinds, want, "member {me}: {l:?}");
        let carriers: Vec<Option<Carrier>> =
            want.iter().map(|k| k.map(LinkKind::carrier)).collect();
        assert_eq!(l.carriers, carriers, "member {me}");
        assert!(l.errors.iter().all(Option::is_none), "member {me}: {l:?}");
    }
    for (a, b) in [(0, 1), (0, 2), (1, 3), (3, 2)] {
        ping(&mut links, a, b).await;
    }
}
