//! Links for rounds over both carriers, in-process on loopback: TLS direct, libp2p streams,
//! the choice between them, the stream-drop recovery under many simultaneous opens, "not yet"
//! retries, and garbage on both carriers while a round runs.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use hivemesh::allreduce::{Member, Mode, Outcome, Partition, RoundConfig, TensorDescriptor};
use hivemesh::links::{
    Carrier, DataPlane, EstablishedLinks, HubConfig, HubError, HubStats, LinkHub, LinkPeer,
    PART_PROTOCOL, establish_links,
};
use hivemesh::p2p::{P2p, P2pConfig, RecordPolicy};
use hivemesh::runner::{self, Link, RunnerConfig};
use hivemesh::sim::make_tensors;
use hivemesh::tensor::{DType, Tensor};
use hivemesh::transport::{DataIdentity, connect};
use hivemesh::wire::{self, Hello, LinkMessage, RejectReason};
use libp2p::{PeerId, identity::Keypair};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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

/// What TLS a node runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tls {
    /// Identity and listener.
    Listen,
    /// Identity (opens TLS links) but no listener.
    DialOnly,
    /// No TLS at all: streams only.
    None,
}

struct Node {
    p2p: P2p,
    keypair: Keypair,
    hub: Option<LinkHub>,
}

impl Node {
    fn hub(&self) -> &LinkHub {
        self.hub.as_ref().expect("node has a hub")
    }

    fn peer(&self) -> LinkPeer {
        LinkPeer::public(
            self.p2p.peer_id(),
            self.hub.as_ref().and_then(LinkHub::data_addr),
        )
    }

    fn identity(&self) -> DataIdentity {
        DataIdentity::new(&self.keypair).expect("identity")
    }
}

/// Swarms that know each other's addresses; a hub on each where `tls` is `Some`.
async fn nodes(tls: &[Option<Tls>]) -> Vec<Node> {
    nodes_with(tls, HubConfig::default()).await
}

/// [`nodes`], with hubs configured by `config`.
async fn nodes_with(tls: &[Option<Tls>], config: HubConfig) -> Vec<Node> {
    let mut nodes = Vec::new();
    for t in tls {
        let keypair = Keypair::generate_ed25519();
        let (p2p, _) = P2p::spawn(P2pConfig::loopback(), keypair.clone(), Box::new(NoRecords))
            .await
            .expect("p2p node");
        let hub = match t {
            None => None,
            Some(t) => {
                let data_plane = match t {
                    Tls::None => None,
                    Tls::DialOnly | Tls::Listen => Some(DataPlane {
                        identity: DataIdentity::new(&keypair).expect("identity"),
                        listen: (*t == Tls::Listen).then(|| "127.0.0.1:0".parse().expect("addr")),
                    }),
                };
                Some(
                    LinkHub::start(p2p.clone(), data_plane, config.clone())
                        .await
                        .expect("hub"),
                )
            }
        };
        nodes.push(Node { p2p, keypair, hub });
    }
    common::introduce_all(&nodes.iter().map(|n| &n.p2p).collect::<Vec<_>>()).await;
    nodes
}

fn descriptors() -> Vec<TensorDescriptor> {
    [vec![150_000], vec![100], vec![]]
        .into_iter()
        .map(|shape| TensorDescriptor {
            shape,
            dtype: DType::F32,
        })
        .collect()
}

fn round_config(n: usize, me: usize, weight: f64) -> RoundConfig {
    let members = vec![
        Member {
            mode: Mode::Node,
            fraction: 1.0
        };
        n
    ];
    let mut cfg = RoundConfig::new(members, me);
    cfg.weight = weight;
    cfg.part_size_bytes = 64 << 10;
    cfg.sender_timeout = Duration::from_secs(2);
    cfg.reducer_timeout = Duration::from_secs(4);
    cfg
}

/// The largest deviation of `outcome` from the weighted mean of the contributors it names.
fn max_err(me: usize, outcome: &Outcome, start: &[Vec<Tensor>], weights: &[f64]) -> f32 {
    let cfg = round_config(start.len(), me, weights[me]);
    let part = Partition::new(
        &descriptors(),
        &cfg.fractions(),
        cfg.part_size_bytes,
        &cfg.compression,
    )
    .expect("partition");
    hivemesh::sim::deviation_from_report(me, outcome, &part, start, weights)
}

/// Each member in `runs` establishes its links through its hub (`members[i]` is node
/// `who[i]`), then runs the round over them. Returns those members' carriers and outcomes.
async fn round(
    nodes: &[Node],
    who: &[usize],
    members: &[LinkPeer],
    group: &'static [u8],
    start: &[Vec<Tensor>],
    weights: &[f64],
    runs: &[usize],
) -> Vec<(Vec<Option<Carrier>>, Outcome)> {
    let n = who.len();
    let mut tasks = Vec::new();
    for &me in runs {
        let node = who[me];
        // Register before anyone opens: every Hello finds its round.
        let expectation = nodes[node]
            .hub()
            .expect(Bytes::from_static(group), members, me)
            .expect("register");
        let (cfg, tensors) = (round_config(n, me, weights[me]), start[me].clone());
        tasks.push(tokio::spawn(async move {
            let links = expectation.establish(T).await;
            let carriers = links.carriers.clone();
            let result = runner::run_round(
                cfg,
                Bytes::from_static(group),
                tensors,
                links.links,
                RunnerConfig::default(),
            )
            .await;
            (carriers, links.errors, result)
        }));
    }
    let mut out = Vec::new();
    for (&me, t) in runs.iter().zip(tasks) {
        let (carriers, errors, result) = tokio::time::timeout(2 * T, t)
            .await
            .expect("member finishes")
            .expect("member task");
        let (_, outcome) = result.unwrap_or_else(|e| panic!("member {me}: {e}; links {errors:?}"));
        out.push((carriers, outcome));
    }
    out
}

fn start_values(n: usize, seed: u64) -> Vec<Vec<Tensor>> {
    (0..n)
        .map(|p| make_tensors(&descriptors(), seed, p).expect("tensors"))
        .collect()
}

/// Runs a full round among `who` and checks exact averages and the expected carriers.
async fn exact_round(
    nodes: &[Node],
    who: &[usize],
    members: &[LinkPeer],
    group: &'static [u8],
    expected: impl Fn(usize, usize) -> Carrier,
) {
    let n = who.len();
    let weights: Vec<f64> = [1.0, 2.0, 0.5, 1.0].into_iter().cycle().take(n).collect();
    let start = start_values(n, 7);
    let all: Vec<usize> = (0..n).collect();
    let results = round(nodes, who, members, group, &start, &weights, &all).await;
    for (me, (carriers, outcome)) in results.iter().enumerate() {
        for (peer, carrier) in carriers.iter().enumerate() {
            let want = (peer != me).then(|| expected(me.min(peer), me.max(peer)));
            assert_eq!(*carrier, want, "member {me}, link to {peer}: {carriers:?}");
        }
        let report = &outcome.report;
        assert!(report.local_parts().next().is_none(), "member {me}");
        assert!(
            report.banned.is_empty() && report.failed_reducers.is_empty(),
            "member {me}: {report:?}"
        );
        let err = max_err(me, outcome, &start, &weights);
        assert!(err < 1e-5, "member {me}: {err}");
        common::assert_full_mean(me, outcome, &start, &weights);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_over_tls_links() {
    let nodes = nodes(&[Some(Tls::Listen); 4]).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    assert!(members.iter().all(|m| m.data_addr.is_some()));
    exact_round(&nodes, &[0, 1, 2, 3], &members, b"tls-round", |_, _| {
        Carrier::Tls
    })
    .await;
}

/// Clients that connect to a TLS port and never start their handshake hold up only
/// themselves: with eight of them stalled at member 1, member 0 still links to it over TLS.
/// (If its handshake had to wait for theirs, which last `hello_timeout`, the opener would fall
/// back to a stream after `ack_timeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tls_handshakes_hold_up_nobody() {
    let config = HubConfig {
        hello_timeout: T,
        ack_timeout: T / 3,
        ..HubConfig::default()
    };
    assert!(config.max_tls_handshakes > 8);
    let nodes = nodes_with(&[Some(Tls::Listen); 2], config).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let addr = members[1].data_addr.expect("listener");
    let mut stalled = Vec::new();
    for _ in 0..8 {
        stalled.push(TcpStream::connect(addr).await.expect("tcp"));
    }
    exact_round(&nodes, &[0, 1], &members, b"past-the-stalled", |_, _| {
        Carrier::Tls
    })
    .await;
}

/// At `max_tls_handshakes` the hub stops accepting instead of dropping clients: with both
/// slots held by stalled clients, an honest member's TLS link waits in the accept queue until
/// their handshakes time out (2 s here; its own connect and ack timeouts are 30 s), and then
/// links over TLS. A dropped client would have fallen back to a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_past_the_handshake_limit_wait_their_turn() {
    let config = HubConfig {
        hello_timeout: Duration::from_secs(2),
        ack_timeout: T,
        connect_timeout: T,
        max_tls_handshakes: 2,
        ..HubConfig::default()
    };
    let nodes = nodes_with(&[Some(Tls::Listen); 2], config).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let addr = members[1].data_addr.expect("listener");
    let mut stalled = Vec::new();
    for _ in 0..2 {
        stalled.push(TcpStream::connect(addr).await.expect("tcp"));
    }
    exact_round(&nodes, &[0, 1], &members, b"wait-your-turn", |_, _| {
        Carrier::Tls
    })
    .await;
    let mut stats = nodes[1].hub().watch_stats();
    let counted = tokio::time::timeout(T, stats.wait_for(|s| s.tls_failed >= 2))
        .await
        .expect("both stalled handshakes time out")
        .map(|s| *s)
        .expect("hub alive");
    assert_eq!((counted.dropped, counted.tls_failed), (0, 2), "{counted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_over_streams_without_data_addresses() {
    let nodes = nodes(&[Some(Tls::None); 4]).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    assert!(members.iter().all(|m| m.data_addr.is_none()));
    exact_round(&nodes, &[0, 1, 2, 3], &members, b"stream-round", |_, _| {
        Carrier::Stream
    })
    .await;
}

/// Node 1 opens TLS links but has no listener, node 2 has no TLS at all: a pair uses TLS
/// exactly when the opener (lower index) has an identity and the other end a listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_carriers_follow_who_has_a_data_listener() {
    let tls = [Tls::Listen, Tls::DialOnly, Tls::None, Tls::Listen];
    let nodes = nodes(&tls.map(Some)).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    assert_eq!(
        members
            .iter()
            .map(|m| m.data_addr.is_some())
            .collect::<Vec<_>>(),
        [true, false, false, true]
    );
    exact_round(&nodes, &[0, 1, 2, 3], &members, b"mixed-round", |lo, hi| {
        if tls[lo] != Tls::None && tls[hi] == Tls::Listen {
            Carrier::Tls
        } else {
            Carrier::Stream
        }
    })
    .await;
}

/// Member 3 advertises a dead port and member 2 another node's listener (a TLS server proving
/// another identity): links to them fall back to streams; the others stay on TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_data_addresses_fall_back_to_streams() {
    let nodes = nodes(&[Some(Tls::Listen); 4]).await;
    let mut members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let dead: SocketAddr = {
        let probe = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        probe.local_addr().expect("addr")
    };
    members[3].data_addr = Some(dead);
    members[2].data_addr = members[1].data_addr;
    exact_round(
        &nodes,
        &[0, 1, 2, 3],
        &members,
        b"fallback-round",
        |_, hi| {
            if hi >= 2 {
                Carrier::Stream
            } else {
                Carrier::Tls
            }
        },
    )
    .await;
}

/// Node 0 opens its link for group `late` before node 1 registers that group; node 1
/// registers another group, then `late`, once its hub's counters satisfy `ready`. Checks that
/// the pair is linked on the expected carrier and carries bytes; returns node 1's counters.
async fn register_late(config: &HubConfig, tls: Tls, ready: fn(&HubStats) -> bool) -> HubStats {
    let nodes = nodes_with(&[Some(tls); 2], config.clone()).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let mut stats = nodes[1].hub().watch_stats();
    let early = {
        let hub = nodes[0]
            .hub()
            .expect(Bytes::from_static(b"late"), &members, 0);
        let expectation = hub.expect("register");
        tokio::spawn(expectation.establish(T))
    };
    tokio::time::timeout(T, stats.wait_for(ready))
        .await
        .expect("node 0's Hello arrives")
        .expect("hub alive");
    // Another round's registration does not admit a Hello for `late`.
    let other = nodes[1]
        .hub()
        .expect(Bytes::from_static(b"other"), &members, 1)
        .expect("register");
    let late = establish_links(nodes[1].hub(), Bytes::from_static(b"late"), &members, 1, T)
        .await
        .expect("register");
    drop(other);
    let early = early.await.expect("opener");
    let carrier = if tls == Tls::Listen {
        Carrier::Tls
    } else {
        Carrier::Stream
    };
    assert_eq!(early.carriers, [None, Some(carrier)], "{early:?}");
    assert_eq!(late.carriers, [Some(carrier), None], "{late:?}");
    ping_pong(early, late).await;
    // The hub counts an acceptance just after handing the link over: wait for the count.
    tokio::time::timeout(T, stats.wait_for(|s| s.accepted >= 1))
        .await
        .expect("counted")
        .map(|s| *s)
        .expect("hub alive")
}

/// A Hello that arrives before its round registered waits for the registration and is acked
/// then, without a refusal and a retry (the opener's retry delay is an hour here, so only the
/// wait can link the pair in time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_hello_waits_for_its_round() {
    let config = HubConfig {
        early_hello_wait: T,
        ack_timeout: 2 * T,
        retry_delay: Duration::from_secs(3600),
        ..HubConfig::default()
    };
    for tls in [Tls::Listen, Tls::None] {
        let counted = register_late(&config, tls, |s| s.early >= 1).await;
        assert_eq!(
            (counted.early, counted.refused, counted.accepted),
            (1, 0, 1),
            "{counted:?}"
        );
    }
}

/// Without the wait (`early_hello_wait` zero), a Hello that arrives before its round registered
/// is refused as "not yet" and retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_before_registration_is_retried() {
    let config = HubConfig {
        early_hello_wait: Duration::ZERO,
        ..HubConfig::default()
    };
    for tls in [Tls::Listen, Tls::None] {
        let counted = register_late(&config, tls, |s| s.refused >= 1).await;
        assert_eq!(counted.early, 0, "{counted:?}");
        assert!(counted.refused >= 1 && counted.accepted == 1, "{counted:?}");
    }
}

/// The two ends of one link: `lo`'s link to `hi` and `hi`'s link to `lo`.
async fn ping_pong(mut lo: EstablishedLinks, mut hi: EstablishedLinks) {
    let mut a = lo.links[1].take().expect("link");
    let mut b = hi.links[0].take().expect("link");
    a.write_all(b"ping").await.expect("write");
    let mut got = [0u8; 4];
    b.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"ping");
}

/// Eight nodes, three groups at once with different member orders, streams only: 84 links
/// opened at the same moment, the pattern that makes libp2p-stream drop inbound streams. Every
/// link must come up and connect the right two members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_simultaneous_stream_opens_all_link() {
    let nodes = nodes(&[Some(Tls::None); 8]).await;
    let orders: [[usize; 8]; 3] = [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [7, 6, 5, 4, 3, 2, 1, 0],
        [3, 6, 1, 4, 7, 2, 5, 0],
    ];
    let groups: [&'static [u8]; 3] = [b"storm-a", b"storm-b", b"storm-c"];
    let mut expectations = Vec::new();
    for (order, group) in orders.iter().zip(groups) {
        let members: Vec<LinkPeer> = order.iter().map(|&i| nodes[i].peer()).collect();
        for (me, &i) in order.iter().enumerate() {
            expectations.push(
                nodes[i]
                    .hub()
                    .expect(Bytes::from_static(group), &members, me)
                    .expect("register"),
            );
        }
    }
    let established: Vec<EstablishedLinks> =
        futures::future::join_all(expectations.into_iter().map(|e| e.establish(T))).await;
    let reopened: usize = established.iter().map(|l| l.reopened).sum();
    eprintln!("attempts re-opened for 84 stream links: {reopened}");
    let mut checks = Vec::new();
    for (k, links) in established.into_iter().enumerate() {
        let (g, me) = (k / 8, k % 8);
        assert_eq!(links.linked(), 7, "group {g} member {me}: {links:?}");
        for (peer, (link, carrier)) in links.links.into_iter().zip(links.carriers).enumerate() {
            if peer == me {
                continue;
            }
            assert_eq!(carrier, Some(Carrier::Stream));
            let mut link = link.expect("linked");
            // Both ends of every pair name themselves; each must hear the other.
            checks.push(async move {
                link.write_all(&[g as u8, me as u8, peer as u8]).await?;
                let mut got = [0u8; 3];
                link.read_exact(&mut got).await?;
                assert_eq!(
                    got,
                    [g as u8, peer as u8, me as u8],
                    "group {g}, {me} <-> {peer}"
                );
                Ok::<_, std::io::Error>(())
            });
        }
    }
    assert_eq!(checks.len(), 3 * 8 * 7);
    for r in tokio::time::timeout(T, futures::future::join_all(checks))
        .await
        .expect("exchanges finish")
    {
        r.expect("exchange");
    }
}

/// Deterministic pseudo-random bytes (as in `tests/integration/runner.rs`).
fn random_bytes() -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

fn huge_prefix() -> Vec<u8> {
    let mut b = BytesMut::new();
    wire::put_length_prefix(4 << 30, &mut b);
    b.to_vec()
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

/// Waits until the other end closes or resets `link`.
async fn closed_by_peer(link: &mut (impl tokio::io::AsyncRead + Unpin)) {
    let mut buf = [0u8; 1024];
    tokio::time::timeout(T, async {
        while let Ok(n) = link.read(&mut buf).await
            && n > 0
        {}
    })
    .await
    .expect("the receiver closes the link");
}

/// Sends `frame` on a fresh `/hivemesh/part/1` stream to `to` and returns the Reject it gets.
/// A stream closed without an answer was dropped by libp2p-stream (or by the receiver's
/// bounds): try again on a new one.
async fn reject_on_stream(from: &P2p, to: PeerId, frame: &[u8]) -> RejectReason {
    for _ in 0..8 {
        let mut s = from
            .open_stream(to, PART_PROTOCOL, T)
            .await
            .expect("open stream");
        s.write_all(frame).await.expect("write");
        match tokio::time::timeout(Duration::from_secs(5), wire::read_link_frame(&mut s)).await {
            Ok(Ok(LinkMessage::Reject(r))) => return r.reason,
            Ok(Ok(other)) => panic!("expected a Reject, got {other:?}"),
            Ok(Err(_)) | Err(_) => continue,
        }
    }
    panic!("no answer from {to}");
}

async fn reject_on_tls(
    identity: &DataIdentity,
    to: &LinkPeer,
    frame: &[u8],
) -> (RejectReason, impl AsyncWrite) {
    let mut s = connect(identity, to.data_addr.expect("listener"), to.peer_id, T)
        .await
        .expect("TLS handshake (any valid identity passes it)");
    s.write_all(frame).await.expect("write");
    match tokio::time::timeout(T, wire::read_link_frame(&mut s)).await {
        Ok(Ok(LinkMessage::Reject(r))) => (r.reason, s),
        other => panic!("expected a Reject, got {other:?}"),
    }
}

async fn write_garbage(link: &mut Option<Box<dyn Link>>, garbage: &[u8]) {
    let link = link.as_mut().expect("linked");
    link.write_all(garbage).await.expect("write garbage");
    link.flush().await.expect("flush");
}

/// Everything a peer outside the group throws at the honest members (members 1..=3). While
/// they wait for links (`registered`) the Hellos for `group` are refused for what they are;
/// later the group is unknown to the hubs, so either answer is right.
async fn outsider_garbage(outsider: &Node, members: &[LinkPeer], group: &[u8], registered: bool) {
    let expect = |got: RejectReason, want: RejectReason| {
        assert!(
            got == want || (!registered && got == RejectReason::UnknownGroup),
            "got {got}, want {want}"
        );
    };
    let o = &outsider.p2p;
    let h = &members[1..];
    // Streams: random bytes, a 4 GiB length prefix: dropped.
    for (to, bytes) in [
        (h[0].clone(), random_bytes()),
        (h[1].clone(), huge_prefix()),
    ] {
        let mut s = o
            .open_stream(to.peer_id, PART_PROTOCOL, T)
            .await
            .expect("open");
        let _ = s.write_all(&bytes).await;
        closed_by_peer(&mut s).await;
    }
    // Streams: a Hello for a group nobody runs; a Hello from a non-member.
    assert_eq!(
        reject_on_stream(o, h[2].peer_id, &hello(b"no-such-group", 0, o.peer_id())).await,
        RejectReason::UnknownGroup
    );
    expect(
        reject_on_stream(o, h[0].peer_id, &hello(group, 0, o.peer_id())).await,
        RejectReason::NotMember,
    );
    // TLS: random bytes on the listener fail the handshake.
    let mut tcp = TcpStream::connect(h[1].data_addr.expect("listener"))
        .await
        .expect("tcp");
    let _ = tcp.write_all(&random_bytes()).await;
    closed_by_peer(&mut tcp).await;
    // TLS clients with another identity: claiming to be member 0 (who links to member 2 in
    // this very round), or claiming a member index as itself.
    let identity = outsider.identity();
    let (reason, _) = reject_on_tls(&identity, &h[1], &hello(group, 0, members[0].peer_id)).await;
    expect(reason, RejectReason::IdentityMismatch);
    let (reason, _) = reject_on_tls(&identity, &h[2], &hello(group, 2, o.peer_id())).await;
    expect(reason, RejectReason::NotMember);
}

/// Member 0 is hostile: it links properly (streams to members 1 and 3, TLS to member 2) and
/// then writes garbage on each link. Node 4, outside the group, throws garbage at both
/// carriers of the honest members: while they wait for member 0's links (member 0 links only
/// once the outsider is done, so this is while the round is registered at every honest hub),
/// and again while the round runs. The honest members finish with correct averages and ban
/// member 0; their hubs refused the outsider with the right reasons and serve the next round
/// as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_both_carriers_while_a_round_runs() {
    // Hellos for unknown groups refused at once: with the early-Hello wait, the outsider's
    // second go would take seconds and miss the running round.
    let config = HubConfig {
        early_hello_wait: Duration::ZERO,
        ..HubConfig::default()
    };
    let nodes = nodes_with(
        &[
            Some(Tls::DialOnly),
            Some(Tls::Listen),
            Some(Tls::Listen),
            Some(Tls::Listen),
            None,
        ],
        config,
    )
    .await;
    let members: Vec<LinkPeer> = nodes[..4].iter().map(Node::peer).collect();
    let group: &'static [u8] = b"garbage-round";
    let weights = [1.0; 4];
    let start = start_values(4, 11);
    let mut watches: Vec<_> = nodes[1..4].iter().map(|n| n.hub().watch_stats()).collect();

    let adversary = async {
        outsider_garbage(&nodes[4], &members, group, true).await;
        let mut view = members.clone();
        view[1].data_addr = None;
        view[3].data_addr = None;
        let links = establish_links(nodes[0].hub(), Bytes::from_static(group), &view, 0, T)
            .await
            .expect("register");
        assert_eq!(
            links.carriers,
            [
                None,
                Some(Carrier::Stream),
                Some(Carrier::Tls),
                Some(Carrier::Stream)
            ],
            "{links:?}"
        );
        let foreign = common::foreign_group_frame();
        let mut links = links.links;
        for (to, garbage) in [(1, foreign), (3, huge_prefix())] {
            write_garbage(&mut links[to], &garbage).await;
        }
        // Member 2 hears nothing yet: every honest round now waits for member 0's parts at
        // member 2 (up to the 2 s sender timeout), so the outsider's second go hits running
        // rounds.
        outsider_garbage(&nodes[4], &members, group, false).await;
        write_garbage(&mut links[2], &random_bytes()).await;
        links // kept open until the round is over
    };
    let (results, adversary_links) = tokio::join!(
        round(
            &nodes,
            &[0, 1, 2, 3],
            &members,
            group,
            &start,
            &weights,
            &[1, 2, 3]
        ),
        adversary,
    );
    for (&me, (carriers, outcome)) in [1, 2, 3].iter().zip(&results) {
        assert_eq!(
            carriers[0],
            Some(if me == 2 {
                Carrier::Tls
            } else {
                Carrier::Stream
            })
        );
        let report = &outcome.report;
        assert!(
            report.banned.contains(0) && report.failed_reducers.contains(0),
            "member {me}: {report:?}"
        );
        assert!(
            (1..4).all(|p| !report.banned.contains(p) && !report.failed_reducers.contains(p)),
            "member {me}: {report:?}"
        );
        let err = max_err(me, outcome, &start, &weights);
        assert!(err < 1e-5, "member {me}: {err}");
    }
    drop(adversary_links);

    // What the hubs counted: the TLS garbage failed its handshake at member 2; each honest hub
    // refused at least one Hello of the outsider.
    let wait = |w: &mut tokio::sync::watch::Receiver<hivemesh::links::HubStats>, tls: bool| {
        let mut w = w.clone();
        async move {
            tokio::time::timeout(
                T,
                w.wait_for(|s| s.refused >= 1 && (!tls || s.tls_failed >= 1)),
            )
            .await
            .expect("counted")
            .map(|s| *s)
            .expect("hub alive")
        }
    };
    for (i, w) in watches.iter_mut().enumerate() {
        let stats = wait(w, i == 1).await;
        assert!(stats.accepted >= 1, "{stats:?}");
    }

    // The hubs still serve: a round among the honest members alone.
    let honest: Vec<LinkPeer> = members[1..].to_vec();
    exact_round(&nodes, &[1, 2, 3], &honest, b"after-garbage", |_, _| {
        Carrier::Tls
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_checked() {
    let nodes = nodes(&[Some(Tls::None), Some(Tls::None)]).await;
    let hub = nodes[0].hub();
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let g = || Bytes::from_static(b"g");
    assert!(matches!(
        hub.expect(Bytes::new(), &members, 0),
        Err(HubError::BadGroupId(0))
    ));
    assert!(matches!(
        hub.expect(Bytes::from(vec![1u8; 65]), &members, 0),
        Err(HubError::BadGroupId(65))
    ));
    assert!(matches!(
        hub.expect(g(), &members, 2),
        Err(HubError::BadMembers(_))
    ));
    assert!(matches!(
        hub.expect(g(), &members, 1),
        Err(HubError::BadMembers(_))
    ));
    assert!(matches!(
        hub.expect(
            g(),
            &[members[0].clone(), members[1].clone(), members[0].clone()],
            0
        ),
        Err(HubError::BadMembers(_))
    ));
    let first = hub.expect(g(), &members, 0).expect("register");
    assert!(matches!(
        hub.expect(g(), &members, 0),
        Err(HubError::AlreadyExpected)
    ));
    drop(first);
    let again = hub.expect(g(), &members, 0).expect("unregistered on drop");
    drop(again);
    // A second hub on the same node cannot take the stream protocol; a TLS identity must be
    // the node's own.
    assert!(matches!(
        LinkHub::start(nodes[0].p2p.clone(), None, HubConfig::default()).await,
        Err(HubError::P2p(_))
    ));
    assert!(matches!(
        LinkHub::start(
            nodes[0].p2p.clone(),
            Some(DataPlane {
                identity: nodes[1].identity(),
                listen: None
            }),
            HubConfig::default()
        )
        .await,
        Err(HubError::ForeignIdentity(_))
    ));
    // A peer that is not reachable at all is reported, within the timeout.
    let stranger = LinkPeer::public(PeerId::random(), None);
    let links = establish_links(
        hub,
        g(),
        &[members[0].clone(), stranger],
        0,
        Duration::from_millis(1500),
    )
    .await
    .expect("register");
    assert_eq!(links.linked(), 0);
    assert!(links.errors[1].is_some(), "{links:?}");
}

/// Shutting a hub down closes its TLS listener and stops offering the stream protocol; a new
/// hub can then take the node's streams over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_both_carriers() {
    let mut nodes = nodes(&[Some(Tls::Listen), Some(Tls::None)]).await;
    let addr = nodes[0].hub().data_addr().expect("listener");
    let target = nodes[0].p2p.peer_id();
    // Serving: a TLS connection is accepted, a stream is negotiated.
    TcpStream::connect(addr).await.expect("listening");
    nodes[1]
        .p2p
        .open_stream(target, PART_PROTOCOL, T)
        .await
        .expect("protocol offered");

    nodes[0].hub.take().expect("hub").shutdown().await;
    assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
    let refused = nodes[1].p2p.open_stream(target, PART_PROTOCOL, T).await;
    assert!(
        matches!(refused, Err(hivemesh::p2p::P2pError::OpenStream { .. })),
        "{refused:?}"
    );
    LinkHub::start(nodes[0].p2p.clone(), None, HubConfig::default())
        .await
        .expect("the protocol is free again");
}

/// An attempt that is never answered (what a stream silently dropped on the way looks like) is
/// joined by a new attempt after `ack_timeout`, and the answered one becomes the link. The
/// acceptor here is played by hand: it swallows the first Hello and acks the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_attempt_is_reopened() {
    let mut nodes = nodes(&[None, None]).await;
    let config = HubConfig {
        ack_timeout: Duration::from_millis(200),
        ..HubConfig::default()
    };
    nodes[0].hub = Some(
        LinkHub::start(nodes[0].p2p.clone(), None, config)
            .await
            .expect("hub"),
    );
    let mut inbound = nodes[1]
        .p2p
        .accept_streams(PART_PROTOCOL, 4)
        .expect("accept");
    let members = [nodes[0].peer(), nodes[1].peer()];
    let opener = nodes[0]
        .hub()
        .expect(Bytes::from_static(b"silence"), &members, 0)
        .expect("register");
    let acceptor = async {
        let (_, mut silent) = inbound.next().await.expect("first attempt");
        let first = wire::read_link_frame(&mut silent).await.expect("hello");
        let (_, mut answered) = inbound.next().await.expect("second attempt");
        let second = wire::read_link_frame(&mut answered).await.expect("hello");
        assert_eq!(first, second);
        let mut ack = BytesMut::new();
        wire::encode_link_frame(&LinkMessage::Ack, &mut ack);
        answered.write_all(&ack).await.expect("ack");
        (silent, answered)
    };
    let (links, (_silent, mut answered)) =
        tokio::time::timeout(T, async { tokio::join!(opener.establish(T), acceptor) })
            .await
            .expect("linked");
    assert_eq!(links.carriers, [None, Some(Carrier::Stream)], "{links:?}");
    assert!(links.reopened >= 1, "{links:?}");
    let mut link = links.links.into_iter().nth(1).flatten().expect("link");
    link.write_all(b"over the answered one")
        .await
        .expect("write");
    let mut got = [0u8; 21];
    answered.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"over the answered one");
}

/// One IP address holding its share of TLS handshakes leaves the rest to others: four clients
/// from 127.0.0.2 connect to member 1 and never start their handshakes (they outlive the
/// round). With no per-IP share (the share equal to the pool of four, as before) they hold
/// every slot, member 0's TLS attempt waits in the accept queue and its link falls back to a
/// stream; with a share of two, the other two are closed at once and member 0 links over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holding_its_handshake_share_leaves_tls_to_others() {
    const POOL: usize = 4;
    for per_ip in [POOL, POOL / 2] {
        let config = HubConfig {
            hello_timeout: 4 * T,
            ack_timeout: T / 4,
            max_tls_handshakes: POOL,
            max_tls_handshakes_per_ip: per_ip,
            ..HubConfig::default()
        };
        let nodes = nodes_with(&[Some(Tls::Listen); 2], config).await;
        let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
        let addr = members[1].data_addr.expect("listener");
        let mut stalled = Vec::new();
        for _ in 0..POOL {
            let socket = tokio::net::TcpSocket::new_v4().expect("socket");
            socket
                .bind("127.0.0.2:0".parse().expect("addr"))
                .expect("bind 127.0.0.2");
            stalled.push(socket.connect(addr).await.expect("tcp"));
        }
        if per_ip < POOL {
            let mut stats = nodes[1].hub().watch_stats();
            let dropped = tokio::time::timeout(T, stats.wait_for(|s| s.over_share >= 2))
                .await
                .expect("the clients over the address's share are closed")
                .map(|s| s.over_share)
                .expect("hub alive");
            assert_eq!(dropped, (POOL - per_ip) as u64);
        }
        let expected = if per_ip == POOL {
            Carrier::Stream
        } else {
            Carrier::Tls
        };
        exact_round(&nodes, &[0, 1], &members, b"share-of-handshakes", |_, _| {
            expected
        })
        .await;
        drop(stalled);
    }
}

/// One peer holding its share of pending links (links that never send their Hello) leaves
/// the rest to others: with a share of two in a pool of four, its third and fourth links are
/// dropped (counted as over its share) and an honest member still links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_holding_its_pending_link_share_leaves_room_for_others() {
    let config = HubConfig {
        hello_timeout: 4 * T,
        max_pending_links: 4,
        max_pending_links_per_peer: 2,
        ..HubConfig::default()
    };
    let nodes = nodes_with(&[Some(Tls::Listen); 3], config).await;
    let members: Vec<LinkPeer> = nodes.iter().map(Node::peer).collect();
    let addr = members[1].data_addr.expect("listener");
    // Node 2 opens four TLS links to member 1 and sends no Hello on any.
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(
            connect(&nodes[2].identity(), addr, members[1].peer_id, T)
                .await
                .expect("TLS link"),
        );
    }
    let mut stats = nodes[1].hub().watch_stats();
    let counted = tokio::time::timeout(T, stats.wait_for(|s| s.over_share >= 2))
        .await
        .expect("the links over the peer's share are dropped")
        .map(|s| *s)
        .expect("hub alive");
    assert_eq!((counted.over_share, counted.dropped), (2, 0), "{counted:?}");
    exact_round(&nodes, &[0, 1], &members[..2], b"share-of-links", |_, _| {
        Carrier::Tls
    })
    .await;
    drop(silent);
}
