//! State sharing on real in-process swarms (libp2p on loopback): hivemind's
//! `test_load_state_from_peers` and `test_load_state_priority` (digest §9.2), a parallel download
//! from several donors, corrupt and lying donors (a man-in-the-middle donor built on the public
//! wire module), schema mismatches, hostile bytes on the protocol and client mode.
//!
//! Nothing here waits on a clock: where a test needs the DHT to show an announcement it polls
//! [`Averager::state_donors`] until it does (with a deadline), and no assertion is about time.

use crate::swarm;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use swarm::Swarm;

use bytes::Bytes;
use hivemesh::allreduce::Mode;
use hivemesh::averager::node::Node;
use hivemesh::averager::state::{
    self, Announcement, Donor, DonorError, LoadedState, Refusal, Request, Response, StateError,
    wire,
};
use hivemesh::averager::{Averager, AveragerConfig};
use hivemesh::dht::DhtTime;
use hivemesh::p2p::{InboundStreams, P2p, P2pStream};
use hivemesh::tensor::{DType, Tensor};
use libp2p::PeerId;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(prefix: &str, priority: f64, allow: bool) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.state_priority = priority;
    c.allow_state_sharing = allow;
    c.state.request_timeout = Duration::from_secs(2);
    c.state.load_timeout = Duration::from_secs(60);
    c
}

fn vector(values: Vec<f32>) -> Tensor {
    Tensor::from_f32(&[values.len()], values).unwrap()
}

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn values(a: &Averager) -> Vec<Vec<f32>> {
    a.tensors().iter().map(Tensor::to_f32_vec).collect()
}

/// Polls `a.state_donors()` until `ok` holds (the DHT shows the announcements a test needs).
async fn wait_donors(a: &Averager, what: &str, ok: impl Fn(&[Donor]) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let donors = a.state_donors().await.unwrap_or_default();
        if ok(&donors) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: donors never became right, last seen {donors:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn peers(donors: &[Donor]) -> Vec<PeerId> {
    donors.iter().map(|d| d.peer).collect()
}

fn loaded(r: Result<Option<LoadedState>, StateError>, what: &str) -> LoadedState {
    match r {
        Ok(Some(info)) => info,
        Ok(None) => panic!("{what}: no donor"),
        Err(e) => panic!("{what}: {e}"),
    }
}

/// hivemind's `test_load_state_from_peers`: the download matches the donor's state and
/// metadata, the donor's changes show on the next download, a donor that stops sharing gives
/// `None`, and sharing again works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_from_peers() {
    let swarm = Swarm::start(2, |_| true).await;
    let mut rng = StdRng::seed_from_u64(1);
    let donor_state = || {
        let mut rng = StdRng::seed_from_u64(7);
        vec![
            vector(random(&mut rng, 3)),
            Tensor::from_f32_as(&[3], &[1.0, 4.0, 2.0], DType::F16).unwrap(),
        ]
    };
    let donor = swarm.averager(0, donor_state(), config("demo-run", 0.0, true));
    let newcomer = swarm.averager(
        1,
        vec![vector(random(&mut rng, 3)), Tensor::zeros(&[3], DType::F16)],
        config("demo-run", 0.0, false),
    );
    donor
        .set_state_metadata(Bytes::from_static(b"{x: 123}"))
        .unwrap();
    let donor_id = swarm.peer(0);
    wait_donors(&newcomer, "donor announced", |d| {
        peers(d) == [donor_id] && !d[0].addrs.is_empty()
    })
    .await;

    let info = loaded(newcomer.load_state_from_peers().await, "first download");
    assert_eq!(info.source, donor_id);
    assert_eq!(values(&newcomer), values(&donor));
    assert_eq!(info.metadata, Bytes::from_static(b"{x: 123}"));
    assert_eq!(newcomer.state_metadata(), info.metadata);
    assert_eq!(info.bytes, 3 * 4 + 3 * 2);
    assert_eq!(info.donors.len(), 1);
    assert_eq!(info.donors[0].bytes, info.bytes);

    // Changes on the donor show on the next download.
    donor.tensors()[0] = vector(vec![-1.0, 0.5, 7.0]);
    donor
        .set_state_metadata(Bytes::from_static(b"{x: 124}"))
        .unwrap();
    let info = loaded(newcomer.load_state_from_peers().await, "second download");
    assert_eq!(values(&newcomer)[0], vec![-1.0, 0.5, 7.0]);
    assert_eq!(values(&newcomer), values(&donor));
    assert_eq!(info.metadata, Bytes::from_static(b"{x: 124}"));

    // A donor that stops sharing: no donor (whether the DHT already shows the withdrawal or
    // the donor refuses), and the local state stays as it was.
    newcomer.tensors()[0] = vector(vec![9.0, 9.0, 9.0]);
    donor.set_allow_state_sharing(false).await.unwrap();
    assert!(!donor.allow_state_sharing());
    assert!(newcomer.load_state_from_peers().await.unwrap().is_none());
    assert_eq!(values(&newcomer)[0], vec![9.0, 9.0, 9.0]);

    // Sharing again.
    donor.set_allow_state_sharing(true).await.unwrap();
    wait_donors(&newcomer, "donor announced again", |d| {
        peers(d) == [donor_id]
    })
    .await;
    let info = loaded(newcomer.load_state_from_peers().await, "after re-enabling");
    assert_eq!(info.source, donor_id);
    assert_eq!(values(&newcomer), values(&donor));
    swarm.shutdown(vec![donor, newcomer]).await;
}

/// hivemind's `test_load_state_priority`: 4 averagers, #1 not sharing, priority `5 − |2 − i|`,
/// the last tensor `[i]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_priority() {
    let swarm = Swarm::start(4, |_| true).await;
    let mut rng = StdRng::seed_from_u64(2);
    let averagers: Vec<_> = (0..4)
        .map(|i| {
            let priority = 5.0 - (2.0 - i as f64).abs();
            swarm.averager(
                i,
                vec![vector(random(&mut rng, 5)), vector(vec![i as f32])],
                config("priority", priority, i != 1),
            )
        })
        .collect();
    let id: Vec<PeerId> = (0..4).map(|i| swarm.peer(i)).collect();
    let last = |i: usize| values(&averagers[i])[1].clone();
    for (i, a) in averagers.iter().enumerate() {
        let want: Vec<PeerId> = [0, 2, 3]
            .into_iter()
            .filter(|&j| j != i)
            .map(|j| id[j])
            .collect();
        wait_donors(a, "all announced", |d| {
            let mut got = peers(d);
            got.sort();
            let mut want = want.clone();
            want.sort();
            got == want
        })
        .await;
    }

    let info = loaded(averagers[0].load_state_from_peers().await, "#0");
    assert_eq!(info.source, id[2], "#0 downloads from #2 (priority 5)");
    assert_eq!(last(0), vec![2.0]);

    let info = loaded(averagers[2].load_state_from_peers().await, "#2");
    assert_eq!(
        info.source, id[3],
        "#2 downloads from #3, skipping #1 (not sharing)"
    );
    assert_eq!(last(2), vec![3.0]);

    averagers[0].set_state_priority(10.0).await.unwrap();
    assert_eq!(averagers[0].state_priority(), 10.0);
    wait_donors(&averagers[2], "#0 at priority 10", |d| {
        d.first()
            .is_some_and(|d| d.peer == id[0] && d.priority == 10.0)
    })
    .await;
    let info = loaded(averagers[2].load_state_from_peers().await, "#2 again");
    assert_eq!(info.source, id[0], "#2 downloads from #0 (priority 10)");
    assert_eq!(last(2), vec![2.0], "#0 holds what it loaded from #2");

    averagers[1].set_allow_state_sharing(false).await.unwrap();
    averagers[2].set_allow_state_sharing(false).await.unwrap();
    wait_donors(&averagers[0], "only #3 shares", |d| peers(d) == [id[3]]).await;
    let info = loaded(averagers[0].load_state_from_peers().await, "#0 again");
    assert_eq!(info.source, id[3], "#0 downloads from #3");
    assert_eq!(last(0), vec![3.0]);
    swarm.shutdown(averagers).await;
}

/// Three donors with byte-identical states serve one download together: the chunks are spread
/// over several of them, and the result is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_uses_several_donors_in_parallel() {
    let swarm = Swarm::start(4, |_| true).await;
    let mut rng = StdRng::seed_from_u64(3);
    let state = vec![random(&mut rng, 150_000), random(&mut rng, 4_321)];
    let mut averagers = Vec::new();
    for i in 0..3 {
        let mut c = config("parallel", i as f64, true);
        c.state.chunk_bytes = 16 << 10;
        let a = swarm.averager(i, state.iter().cloned().map(vector).collect::<Vec<_>>(), c);
        a.set_state_metadata(Bytes::from_static(b"epoch 12"))
            .unwrap();
        averagers.push(a);
    }
    let newcomer = swarm.averager(
        3,
        vec![vector(vec![0.0; 150_000]), vector(vec![0.0; 4_321])],
        config("parallel", 0.0, false),
    );
    wait_donors(&newcomer, "three donors", |d| d.len() == 3).await;
    let info = loaded(newcomer.load_state_from_peers().await, "parallel");
    assert_eq!(values(&newcomer), state);
    assert_eq!(info.metadata, Bytes::from_static(b"epoch 12"));
    assert_eq!(
        info.source,
        swarm.peer(2),
        "the best priority is the reference"
    );
    assert_eq!(
        info.donors.len(),
        3,
        "every donor had the same state: {info:?}"
    );
    let serving = info.donors.iter().filter(|d| d.chunks > 0).count();
    assert!(serving >= 2, "chunks came from several donors: {info:?}");
    assert_eq!(
        info.donors.iter().map(|d| d.bytes).sum::<u64>(),
        info.bytes,
        "every byte came from exactly one donor"
    );
    assert_eq!(info.bytes, (150_000 + 4_321) * 4);
    averagers.push(newcomer);
    swarm.shutdown(averagers).await;
}

/// Tells `node` where `other` listens (dials go by peer id); returns `other`'s id.
async fn introduce(node: &Node, other: &Node) -> PeerId {
    let peer = other.dht().p2p().peer_id();
    let addrs = other.dht().p2p().listen_addrs().await.unwrap();
    node.dht()
        .p2p()
        .add_peer_addresses(peer, addrs)
        .await
        .unwrap();
    peer
}

/// How the man-in-the-middle donor misbehaves.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Flips a bit in every chunk.
    FlipChunkBytes,
    /// Drops the last byte of every chunk.
    ShortChunks,
    /// Answers chunk `i` with chunk `i + 1`'s bytes when there is one.
    WrongChunk,
    /// Describes the state with a content hash that does not match it.
    LyingMetadata,
    /// Answers metadata and never answers a chunk request (a donor answering just under the
    /// request timeout, taken to the limit).
    StallChunks,
}

/// A donor on `node` that serves `prefix` by forwarding every request to `upstream`'s
/// `upstream_prefix` protocol (an honest averager) and corrupting the answers as `fault` says;
/// announced at `priority`.
async fn spawn_mitm(
    node: &Node,
    prefix: &str,
    upstream: &Node,
    upstream_prefix: &str,
    fault: Fault,
    priority: f64,
) -> tokio::task::JoinHandle<()> {
    let upstream = introduce(node, upstream).await;
    let inbound = node
        .dht()
        .p2p()
        .accept_streams(&state::protocol(prefix), 64)
        .unwrap();
    let addrs = node.dht().p2p().listen_addrs().await.unwrap();
    node.dht()
        .store(
            &state::registry_key(prefix),
            Some(&node.dht().own_subkey()),
            &Announcement::Sharing { priority, addrs }.encode(),
            DhtTime::now().saturating_add(Duration::from_secs(300)),
        )
        .await
        .unwrap();
    tokio::spawn(mitm(
        node.dht().p2p().clone(),
        inbound,
        upstream,
        state::protocol(upstream_prefix),
        fault,
    ))
}

async fn mitm(
    p2p: P2p,
    mut inbound: InboundStreams,
    upstream: PeerId,
    upstream_protocol: String,
    fault: Fault,
) {
    let mut tasks = tokio::task::JoinSet::new();
    while let Some((_, stream)) = inbound.next().await {
        let p2p = p2p.clone();
        let upstream_protocol = upstream_protocol.clone();
        tasks.spawn(async move {
            let Ok(up) = p2p
                .open_stream(upstream, &upstream_protocol, Duration::from_secs(5))
                .await
            else {
                return;
            };
            let _ = relay(stream, up, fault).await;
        });
    }
}

async fn relay(mut down: P2pStream, mut up: P2pStream, fault: Fault) -> Option<()> {
    loop {
        let body = wire::read_frame(&mut down, wire::MAX_REQUEST_BYTES)
            .await
            .ok()??;
        let request = wire::decode_request(body).ok()?;
        if matches!(
            (fault, &request),
            (Fault::StallChunks, Request::Chunk { .. })
        ) {
            // Held until the test aborts the donor.
            std::future::pending::<()>().await;
        }
        wire::write_frame(&mut up, &wire::encode_request(&request))
            .await
            .ok()?;
        let next = match &request {
            Request::Release { .. } => continue,
            Request::Chunk { session, index } => Some(Request::Chunk {
                session: session.clone(),
                index: index + 1,
            }),
            Request::Metadata => None,
        };
        let answer = wire::read_frame(&mut up, wire::MAX_RESPONSE_BYTES)
            .await
            .ok()??;
        let mut response = wire::decode_response(answer).ok()?;
        match (fault, &mut response) {
            (Fault::FlipChunkBytes, Response::Chunk { data, .. }) if !data.is_empty() => {
                let mut d = data.to_vec();
                d[0] ^= 1;
                *data = d.into();
            }
            (Fault::ShortChunks, Response::Chunk { data, .. }) if !data.is_empty() => {
                *data = data.slice(..data.len() - 1);
            }
            (Fault::WrongChunk, Response::Chunk { data, .. }) => {
                wire::write_frame(&mut up, &wire::encode_request(&next?))
                    .await
                    .ok()?;
                let answer = wire::read_frame(&mut up, wire::MAX_RESPONSE_BYTES)
                    .await
                    .ok()??;
                if let Ok(Response::Chunk { data: other, .. }) = wire::decode_response(answer) {
                    *data = other;
                }
            }
            (Fault::LyingMetadata, Response::Metadata(m)) => m.content_hash[0] ^= 1,
            _ => {}
        }
        wire::write_frame(&mut down, &wire::encode_response(&response))
            .await
            .ok()?;
    }
}

/// The highest-priority donor corrupts every chunk it serves (it forwards an honest donor's
/// metadata, so it is the reference and joins the download): its chunks fail verification, it
/// is dropped, and the honest donors complete the download with the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_chunks_are_redone_by_honest_donors() {
    let swarm = Swarm::start(4, |_| true).await;
    let mut rng = StdRng::seed_from_u64(4);
    let state = vec![random(&mut rng, 40_000), random(&mut rng, 17)];
    let mut averagers = Vec::new();
    for i in 0..2 {
        let mut c = config("mitm", 1.0 + i as f64, true);
        c.state.chunk_bytes = 4 << 10;
        averagers.push(swarm.averager(i, state.iter().cloned().map(vector).collect::<Vec<_>>(), c));
    }
    let mitm = spawn_mitm(
        &swarm.nodes[2],
        "mitm",
        &swarm.nodes[0],
        "mitm",
        Fault::FlipChunkBytes,
        10.0,
    )
    .await;
    let newcomer = swarm.averager(
        3,
        vec![vector(vec![0.0; 40_000]), vector(vec![0.0; 17])],
        config("mitm", 0.0, false),
    );
    wait_donors(&newcomer, "two donors and the mitm", |d| d.len() == 3).await;
    let info = loaded(newcomer.load_state_from_peers().await, "with a mitm");
    assert_eq!(values(&newcomer), state, "exactly the honest state");
    let bad = swarm.peer(2);
    assert_eq!(info.source, bad, "the mitm was the reference");
    assert!(
        info.donors.iter().any(|d| d.peer == bad && d.chunks == 0),
        "{info:?}"
    );
    assert!(
        info.skipped
            .iter()
            .any(|(p, e)| *p == bad && matches!(e, DonorError::CorruptChunk { .. })),
        "the mitm was dropped for a corrupt chunk: {info:?}"
    );
    assert_eq!(info.donors.iter().map(|d| d.bytes).sum::<u64>(), info.bytes);
    mitm.abort();
    averagers.push(newcomer);
    swarm.shutdown(averagers).await;
}

/// A lone donor that corrupts chunks (flipped, short, or another chunk's bytes) or lies in its
/// description: the download fails with a typed error and the local state is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_bad_donor_fails_and_installs_nothing() {
    let swarm = Swarm::start(3, |_| true).await;
    let mut rng = StdRng::seed_from_u64(5);
    let state = [random(&mut rng, 5_000)];
    // The honest upstream shares on a prefix nobody downloads from.
    let mut c = config("hidden", 0.0, true);
    c.state.chunk_bytes = 1 << 10;
    let honest = swarm.averager(0, state.iter().cloned().map(vector).collect::<Vec<_>>(), c);
    let mut averagers = vec![honest];
    let mut mitms = Vec::new();
    for (k, fault) in [
        Fault::FlipChunkBytes,
        Fault::ShortChunks,
        Fault::WrongChunk,
        Fault::LyingMetadata,
    ]
    .into_iter()
    .enumerate()
    {
        let prefix = format!("lone{k}");
        mitms.push(
            spawn_mitm(
                &swarm.nodes[1],
                &prefix,
                &swarm.nodes[0],
                "hidden",
                fault,
                1.0,
            )
            .await,
        );
        let mine = vec![random(&mut rng, 5_000)];
        let newcomer = swarm.averager(
            2,
            mine.iter().cloned().map(vector).collect::<Vec<_>>(),
            config(&prefix, 0.0, false),
        );
        wait_donors(&newcomer, "the mitm", |d| d.len() == 1).await;
        let result = newcomer.load_state_from_peers().await;
        let failures = match (fault, result) {
            (Fault::LyingMetadata, Err(StateError::NoUsableDonor { failures })) => failures,
            (Fault::LyingMetadata, other) => panic!("{fault:?}: {other:?}"),
            (_, Err(StateError::DownloadFailed { failures })) => failures,
            (_, other) => panic!("{fault:?}: {other:?}"),
        };
        assert_eq!(failures.len(), 1, "{fault:?}: {failures:?}");
        assert_eq!(failures[0].0, swarm.peer(1));
        match fault {
            Fault::LyingMetadata => assert!(
                matches!(failures[0].1, DonorError::Protocol(_)),
                "{failures:?}"
            ),
            _ => assert!(
                matches!(failures[0].1, DonorError::CorruptChunk { .. }),
                "{fault:?}: {failures:?}"
            ),
        }
        assert_eq!(values(&newcomer), mine, "{fault:?}: nothing was installed");
        averagers.push(newcomer);
    }
    for m in mitms {
        m.abort();
    }
    swarm.shutdown(averagers).await;
}

/// A donor with another schema is skipped when a matching one exists, and is a typed error
/// when it is the only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_mismatch_is_skipped_or_a_typed_error() {
    let swarm = Swarm::start(3, |_| true).await;
    let other = swarm.averager(0, vec![vector(vec![1.0; 10])], config("schema", 5.0, true));
    let matching = swarm.averager(1, vec![vector(vec![2.0; 12])], config("schema", 1.0, true));
    let newcomer = swarm.averager(2, vec![vector(vec![0.0; 12])], config("schema", 0.0, false));
    wait_donors(&newcomer, "both donors", |d| d.len() == 2).await;
    let info = loaded(newcomer.load_state_from_peers().await, "mixed schemas");
    assert_eq!(info.source, swarm.peer(1));
    assert_eq!(values(&newcomer), vec![vec![2.0; 12]]);
    assert!(
        info.skipped
            .iter()
            .any(|(p, e)| *p == swarm.peer(0) && *e == DonorError::SchemaMismatch),
        "{info:?}"
    );

    matching.set_allow_state_sharing(false).await.unwrap();
    newcomer.tensors()[0] = vector(vec![3.0; 12]);
    match newcomer.load_state_from_peers().await {
        Err(StateError::SchemaMismatch { peers }) => assert_eq!(peers, [swarm.peer(0)]),
        other => panic!("expected a schema mismatch, got {other:?}"),
    }
    assert_eq!(values(&newcomer), vec![vec![3.0; 12]]);
    swarm.shutdown(vec![other, matching, newcomer]).await;
}

async fn open(p2p: &P2p, peer: PeerId, prefix: &str) -> P2pStream {
    p2p.open_stream(peer, &state::protocol(prefix), Duration::from_secs(5))
        .await
        .unwrap()
}

/// Whether the donor closed the stream (rather than answering).
async fn closed(stream: &mut P2pStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

async fn ask(stream: &mut P2pStream, request: &Request) -> Response {
    wire::write_frame(stream, &wire::encode_request(request))
        .await
        .unwrap();
    let body = wire::read_frame(stream, wire::MAX_RESPONSE_BYTES)
        .await
        .unwrap()
        .unwrap();
    wire::decode_response(body).unwrap()
}

/// Garbage, an oversized length prefix, pipelined requests, unknown sessions, chunks out of
/// range and a burst of streams cost the donor nothing but those streams: a download then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_does_not_crash_the_donor() {
    let swarm = Swarm::start(3, |_| true).await;
    let mut rng = StdRng::seed_from_u64(6);
    let state = vec![random(&mut rng, 3_000)];
    let mut c = config("hostile", 0.0, true);
    c.state.chunk_bytes = 1 << 10;
    let donor = swarm.averager(0, state.iter().cloned().map(vector).collect::<Vec<_>>(), c);
    let attacker = swarm.nodes[1].dht().p2p().clone();
    let target = introduce(&swarm.nodes[1], &swarm.nodes[0]).await;

    let mut s = open(&attacker, target, "hostile").await;
    let garbage: Vec<u8> = (0..4096).map(|_| rng.random()).collect();
    let _ = s.write_all(&garbage).await;
    assert!(closed(&mut s).await, "garbage closes the stream");

    let mut s = open(&attacker, target, "hostile").await;
    let mut prefix = bytes::BytesMut::new();
    hivemesh::wire::put_length_prefix(4 << 30, &mut prefix);
    let _ = s.write_all(&prefix).await;
    assert!(closed(&mut s).await, "a 4 GiB prefix closes the stream");

    let mut s = open(&attacker, target, "hostile").await;
    let session = Bytes::from_static(b"made up");
    assert_eq!(
        ask(&mut s, &Request::Chunk { session, index: 0 }).await,
        Response::Refused(Refusal::UnknownSession)
    );
    let Response::Metadata(meta) = ask(&mut s, &Request::Metadata).await else {
        panic!("no metadata");
    };
    assert_eq!(meta.chunks(), 12);
    let past_the_end = Request::Chunk {
        session: meta.session.clone(),
        index: 12,
    };
    assert_eq!(
        ask(&mut s, &past_the_end).await,
        Response::Refused(Refusal::BadRequest)
    );
    // Two requests before reading an answer: the stream is closed.
    let mut two = Vec::new();
    for _ in 0..2 {
        let body = wire::encode_request(&Request::Metadata);
        hivemesh::wire::put_length_prefix(body.len(), &mut two);
        two.extend_from_slice(&body);
    }
    s.write_all(&two).await.unwrap();
    assert!(closed(&mut s).await, "pipelined requests close the stream");

    // A burst of silent streams, more than the donor serves at once.
    let mut silent = Vec::new();
    for _ in 0..40 {
        if let Ok(s) = attacker
            .open_stream(target, &state::protocol("hostile"), Duration::from_secs(5))
            .await
        {
            silent.push(s);
        }
    }
    drop(silent);

    let newcomer = swarm.averager(
        2,
        vec![vector(vec![0.0; 3_000])],
        config("hostile", 0.0, false),
    );
    wait_donors(&newcomer, "the donor", |d| d.len() == 1).await;
    // The donor frees the silent streams' sessions as it sees them close, which may be after
    // the newcomer's first request (then refused as busy): the download works once they are.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match newcomer.load_state_from_peers().await {
            Ok(Some(_)) => break,
            other if tokio::time::Instant::now() < deadline => {
                tracing::debug!(?other, "no download yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => {
                loaded(other, "after the attack");
            }
        }
    }
    assert_eq!(values(&newcomer), state);
    swarm.shutdown(vec![donor, newcomer]).await;
}

/// Clients cannot share: nothing is announced, switching sharing on is refused, and a
/// newcomer finds no donor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_do_not_share() {
    let swarm = Swarm::start(2, |_| true).await;
    let mut c = config("clients", 3.0, true);
    c.mode = Some(Mode::Client);
    let client = swarm.averager(0, vec![vector(vec![1.0; 4])], c);
    assert!(!client.allow_state_sharing());
    assert_eq!(
        client.set_allow_state_sharing(true).await,
        Err(StateError::NotADonor(Mode::Client))
    );
    let newcomer = swarm.averager(1, vec![vector(vec![0.0; 4])], config("clients", 0.0, false));
    assert!(newcomer.state_donors().await.unwrap().is_empty());
    assert!(newcomer.load_state_from_peers().await.unwrap().is_none());
    assert_eq!(values(&newcomer), vec![vec![0.0; 4]]);
    swarm.shutdown(vec![client, newcomer]).await;
}

/// A donor's priority is its own word. A sybil announcing 1e300 and serving NaNs is skipped
/// (a non-finite state is never installed; before, it was); one serving zeros at 1e299 still
/// wins under the default trust (the best-priority answer, as in hivemind), and loses to a
/// newcomer that requires two donors to agree on the content hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sybil_donors_lose_to_the_callers_trust() {
    let swarm = Swarm::start(6, |_| true).await;
    let mut rng = StdRng::seed_from_u64(9);
    let honest = vec![random(&mut rng, 300), vec![1.0, 2.0]];
    let mut poisoned = honest.clone();
    poisoned[0][17] = f32::NAN;
    let zeros = vec![vec![0.0; 300], vec![0.0; 2]];
    let tensors = |v: &[Vec<f32>]| v.iter().cloned().map(vector).collect::<Vec<_>>();
    let fresh = vec![vec![5.0; 300], vec![5.0; 2]];
    let mut agreeing = config("trust", 0.0, false);
    agreeing.state.trust.min_agreeing = 2;
    let averagers = vec![
        swarm.averager(0, tensors(&poisoned), config("trust", 1e300, true)),
        swarm.averager(1, tensors(&zeros), config("trust", 1e299, true)),
        swarm.averager(2, tensors(&honest), config("trust", 2.0, true)),
        swarm.averager(3, tensors(&honest), config("trust", 1.0, true)),
        swarm.averager(4, tensors(&fresh), config("trust", 0.0, false)),
        swarm.averager(5, tensors(&fresh), agreeing),
    ];
    let id: Vec<PeerId> = (0..6).map(|i| swarm.peer(i)).collect();
    for a in &averagers[4..] {
        wait_donors(a, "the four donors announced", |d| d.len() == 4).await;
    }

    let info = loaded(averagers[4].load_state_from_peers().await, "default trust");
    assert!(
        info.skipped
            .iter()
            .any(|(p, e)| *p == id[0] && matches!(e, DonorError::NonFinite)),
        "the NaN donor is skipped: {:?}",
        info.skipped
    );
    assert_eq!(info.source, id[1], "then the best priority wins");
    assert_eq!(values(&averagers[4]), zeros);

    let info = loaded(averagers[5].load_state_from_peers().await, "two must agree");
    assert_eq!(info.source, id[2], "the honest pair's best priority");
    assert_eq!(values(&averagers[5]), honest);
    swarm.shutdown(averagers).await;
}

/// What [`state::Trust::min_agreeing`] protects against, and what not (its docs): it counts
/// peer ids, and peer ids are free. Two sybils serving byte-identical zeros at the top
/// priorities satisfy `min_agreeing = 2`: the newcomer installs their zeros, not the lone
/// honest donor's state. It does stop colluders fewer than it requires: with 3 required the
/// two sybils are not enough (nor is the honest donor alone), and nothing is installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sybils_that_agree_satisfy_min_agreeing() {
    let swarm = Swarm::start(5, |_| true).await;
    let mut rng = StdRng::seed_from_u64(12);
    let honest = vec![random(&mut rng, 300)];
    let zeros = vec![vec![0.0; 300]];
    let fresh = vec![vec![5.0; 300]];
    let tensors = |v: &[Vec<f32>]| v.iter().cloned().map(vector).collect::<Vec<_>>();
    let agreeing = |n: usize| {
        let mut c = config("sybils", 0.0, false);
        c.state.trust.min_agreeing = n;
        c
    };
    let averagers = vec![
        swarm.averager(0, tensors(&zeros), config("sybils", 1e300, true)),
        swarm.averager(1, tensors(&zeros), config("sybils", 1e299, true)),
        swarm.averager(2, tensors(&honest), config("sybils", 1.0, true)),
        swarm.averager(3, tensors(&fresh), agreeing(2)),
        swarm.averager(4, tensors(&fresh), agreeing(3)),
    ];
    for a in &averagers[3..] {
        wait_donors(a, "the three donors announced", |d| d.len() == 3).await;
    }

    let info = loaded(averagers[3].load_state_from_peers().await, "two must agree");
    assert_eq!(info.source, swarm.peer(0), "the sybils agree");
    assert_eq!(values(&averagers[3]), zeros);

    match averagers[4].load_state_from_peers().await {
        Err(StateError::NoUsableDonor { failures } | StateError::DownloadFailed { failures }) => {
            assert!(
                failures.iter().any(|(p, e)| *p == swarm.peer(0)
                    && *e
                        == DonorError::Unconfirmed {
                            agreeing: 2,
                            required: 3
                        }),
                "{failures:?}"
            );
        }
        other => panic!("three must agree, two sybils did: {other:?}"),
    }
    assert_eq!(values(&averagers[4]), fresh, "nothing installed");
    swarm.shutdown(averagers).await;
}

/// As many sybils as the donor has session slots each hold one and fetch nothing (to the
/// donor the same as fetching a chunk a minute: with `session_grace` zero and a minimum rate
/// nobody reaches, every session is stalled once open). Before progress was measured, a
/// newcomer was refused as busy for as long as the sybils kept their streams (no donor); now
/// it evicts the sybil stalled longest and downloads, and that sybil's next chunk request is
/// refused. (The trickle itself, in virtual time: `averager::state::sessions`'s tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sybils_holding_every_session_cannot_lock_newcomers_out() {
    let swarm = Swarm::start(4, |_| true).await;
    let mut c = config("slots", 0.0, true);
    c.state.max_sessions = 2;
    c.state.session_grace = Duration::ZERO;
    c.state.min_session_rate = u64::MAX;
    let donor = swarm.averager(0, vec![vector(vec![1.0, 2.0, 3.0])], c);
    let mut held = Vec::new();
    for i in [1, 2] {
        let sybil = swarm.nodes[i].dht().p2p().clone();
        let target = introduce(&swarm.nodes[i], &swarm.nodes[0]).await;
        let mut s = open(&sybil, target, "slots").await;
        let Response::Metadata(meta) = ask(&mut s, &Request::Metadata).await else {
            panic!("sybil {i} got no session");
        };
        held.push((s, meta.session));
    }
    assert_eq!(donor.state_stats().sessions, 2);

    let newcomer = swarm.averager(3, vec![vector(vec![0.0; 3])], config("slots", 0.0, false));
    let donor_id = swarm.peer(0);
    wait_donors(&newcomer, "the donor", |d| peers(d) == [donor_id]).await;
    let info = loaded(newcomer.load_state_from_peers().await, "beside the sybils");
    assert_eq!(info.source, donor_id);
    assert_eq!(values(&newcomer), vec![vec![1.0, 2.0, 3.0]]);

    let mut evicted = Vec::new();
    for (i, (s, session)) in held.iter_mut().enumerate() {
        let request = Request::Chunk {
            session: session.clone(),
            index: 0,
        };
        match ask(s, &request).await {
            Response::Refused(Refusal::UnknownSession) => evicted.push(i),
            Response::Chunk { .. } => {}
            other => panic!("sybil {i}: {other:?}"),
        }
    }
    assert_eq!(evicted, [0], "the sybil stalled longest lost its session");
    drop(held);
    swarm.shutdown(vec![donor, newcomer]).await;
}

/// A stream on which the donor answered a metadata request (so it holds a slot), or `None`
/// once the donor drops new streams.
async fn held_stream(p2p: &P2p, peer: PeerId, prefix: &str) -> Option<P2pStream> {
    let mut s = p2p
        .open_stream(peer, &state::protocol(prefix), Duration::from_secs(10))
        .await
        .ok()?;
    let exchange = async {
        wire::write_frame(&mut s, &wire::encode_request(&Request::Metadata))
            .await
            .ok()?;
        wire::read_frame(&mut s, wire::MAX_RESPONSE_BYTES)
            .await
            .ok()?
    };
    let body = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .ok()??;
    matches!(wire::decode_response(body), Ok(Response::Metadata(_))).then_some(s)
}

/// One peer takes every state stream the donor will serve it and keeps them open. With no
/// per-peer share (the share equal to the pool, as before) it holds the whole pool and an
/// honest newcomer's download finds no donor; with a share of half the pool it holds exactly
/// its share and the download goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_holding_its_share_of_streams_cannot_stop_a_download() {
    const POOL: usize = 4;
    for per_peer in [POOL, POOL / 2] {
        let prefix = format!("share{per_peer}");
        let swarm = Swarm::start(3, |_| true).await;
        let mut c = config(&prefix, 0.0, true);
        c.state.max_inbound = POOL;
        c.state.max_inbound_per_peer = per_peer;
        let donor = swarm.averager(0, vec![vector(vec![1.0, 2.0, 3.0])], c);
        let mut nc = config(&prefix, 0.0, false);
        nc.state.load_timeout = Duration::from_secs(if per_peer == POOL { 15 } else { 120 });
        let newcomer = swarm.averager(2, vec![vector(vec![0.0; 3])], nc);
        let donor_id = swarm.peer(0);
        wait_donors(&newcomer, "donor announced", |d| peers(d) == [donor_id]).await;

        let attacker = swarm.nodes[1].dht().p2p().clone();
        let target = introduce(&swarm.nodes[1], &swarm.nodes[0]).await;
        // Streams opened one at a time until the attacker holds its share (a stream may
        // also be dropped by libp2p-stream itself, see `hivemesh::links`: then it tries
        // again), then two more, which the donor must refuse.
        let mut held = Vec::new();
        for _ in 0..8 * POOL {
            if held.len() == per_peer {
                break;
            }
            if let Some(s) = held_stream(&attacker, target, &prefix).await {
                held.push(s);
            }
        }
        assert_eq!(held.len(), per_peer, "streams the attacker holds");
        for _ in 0..2 {
            assert!(
                held_stream(&attacker, target, &prefix).await.is_none(),
                "the donor served a stream past the attacker's share"
            );
        }

        let result = newcomer.load_state_from_peers().await;
        if per_peer == POOL {
            assert!(
                !matches!(result, Ok(Some(_))),
                "the attacker held every stream, yet the download went through"
            );
        } else {
            let info = loaded(result, "download beside the attacker");
            assert_eq!(info.source, donor_id);
            assert_eq!(values(&newcomer), vec![vec![1.0, 2.0, 3.0]]);
        }
        drop(held);
        swarm.shutdown(vec![donor, newcomer]).await;
    }
}

/// A slow donor cannot hold a download: the best-priority donor (the reference, so it gets
/// the first chunks) answers metadata and then never answers a chunk, within a request timeout
/// longer than the whole download may take. The end game has the honest donor fetch the chunks
/// the slow one holds, so the download completes from it alone; without the end game it
/// waited for those chunks until the load timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_donor_cannot_hold_a_download() {
    let swarm = Swarm::start(3, |_| true).await;
    let mut rng = StdRng::seed_from_u64(9);
    let state = vec![random(&mut rng, 20_000)];
    let mut c = config("slow", 1.0, true);
    c.state.chunk_bytes = 4 << 10;
    let honest = swarm.averager(0, state.iter().cloned().map(vector).collect::<Vec<_>>(), c);
    let slow = spawn_mitm(
        &swarm.nodes[1],
        "slow",
        &swarm.nodes[0],
        "slow",
        Fault::StallChunks,
        10.0,
    )
    .await;
    let mut nc = config("slow", 0.0, false);
    nc.state.request_timeout = Duration::from_secs(600);
    nc.state.load_timeout = Duration::from_secs(120);
    let newcomer = swarm.averager(2, vec![vector(vec![0.0; 20_000])], nc);
    wait_donors(&newcomer, "the donor and the slow one", |d| d.len() == 2).await;
    let info = loaded(
        newcomer.load_state_from_peers().await,
        "beside a slow donor",
    );
    assert_eq!(values(&newcomer), state);
    let slow_id = swarm.peer(1);
    assert_eq!(info.source, slow_id, "the slow donor was the reference");
    assert!(
        info.donors
            .iter()
            .any(|d| d.peer == slow_id && d.chunks == 0),
        "{info:?}"
    );
    assert_eq!(info.donors.iter().map(|d| d.bytes).sum::<u64>(), info.bytes);
    slow.abort();
    swarm.shutdown(vec![honest, newcomer]).await;
}

/// A donor copies its state for newcomers only when it changed: repeated metadata requests
/// (a peer hammering the donor) reuse one snapshot, and a change to the tensors or to the
/// metadata gives the next request a new one, with a new content hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_requests_reuse_one_snapshot_until_the_state_changes() {
    let swarm = Swarm::start(2, |_| true).await;
    let donor = swarm.averager(
        0,
        vec![vector(vec![1.0, 2.0, 3.0])],
        config("snap", 0.0, true),
    );
    let asker = swarm.nodes[1].dht().p2p().clone();
    let target = introduce(&swarm.nodes[1], &swarm.nodes[0]).await;
    let mut s = open(&asker, target, "snap").await;
    let hash = |meta: Response| match meta {
        Response::Metadata(m) => m.content_hash,
        other => panic!("no metadata: {other:?}"),
    };
    let first = hash(ask(&mut s, &Request::Metadata).await);
    for _ in 0..5 {
        assert_eq!(hash(ask(&mut s, &Request::Metadata).await), first);
    }
    assert_eq!(
        donor.state_stats().snapshots_built,
        1,
        "one copy for six requests"
    );
    // Reading the tensors changes nothing; writing them does.
    assert_eq!(donor.tensors()[0].to_f32_vec(), vec![1.0, 2.0, 3.0]);
    assert_eq!(hash(ask(&mut s, &Request::Metadata).await), first);
    assert_eq!(donor.state_stats().snapshots_built, 1);
    donor.tensors()[0] = vector(vec![4.0, 5.0, 6.0]);
    let second = hash(ask(&mut s, &Request::Metadata).await);
    assert_ne!(second, first);
    assert_eq!(donor.state_stats().snapshots_built, 2);
    donor
        .set_state_metadata(Bytes::from_static(b"epoch 2"))
        .unwrap();
    let third = hash(ask(&mut s, &Request::Metadata).await);
    assert_ne!(third, second);
    assert_eq!(donor.state_stats().snapshots_built, 3);
    assert_eq!(hash(ask(&mut s, &Request::Metadata).await), third);
    assert_eq!(donor.state_stats().snapshots_built, 3);
    swarm.shutdown(vec![donor]).await;
}

/// hivemind's overridable `get_current_state`: a donor with a [`state::StateProvider`] serves
/// what it returns (more tensors than it averages, other shapes and dtypes, its own metadata)
/// and a newcomer fetching the state gets exactly that; installing it into tensors of the
/// averaged schema is refused as a schema mismatch; a provider that fails gets newcomers
/// refused (no donor); removing the provider serves the averaged tensors again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_provider_serves_whatever_it_returns() {
    let swarm = Swarm::start(2, |_| true).await;
    let donor = swarm.averager(
        0,
        vec![vector(vec![1.0, 2.0])],
        config("provided", 1.0, true),
    );
    let newcomer = swarm.averager(
        1,
        vec![vector(vec![0.0; 2])],
        config("provided", 0.0, false),
    );
    let served = vec![
        vector(vec![1.0, 2.0]),
        Tensor::from_f32_as(&[2, 3], &[1.5, -2.0, 3.0, 0.25, 8.0, -0.5], DType::BF16).unwrap(),
        Tensor::from_f32_as(&[], &[42.0], DType::F16).unwrap(),
        Tensor::zeros(&[0, 4], DType::F32),
        Tensor::from_f32(&[3, 1, 2], (0..6).map(|i| i as f32 * 0.5).collect()).unwrap(),
    ];
    let fail = Arc::new(AtomicBool::new(false));
    donor.set_state_provider(Some(provider(&fail, &served)));
    wait_donors(&newcomer, "donor announced", |d| d.len() == 1).await;
    let (info, tensors) = newcomer
        .download_state_from_peers()
        .await
        .unwrap()
        .expect("a donor");
    assert_eq!(tensors, served);
    assert_eq!(info.metadata, Bytes::from_static(b"{\"epoch\": 3}"));
    // Installing needs the averaged schema.
    match newcomer.load_state_from_peers().await {
        Err(StateError::SchemaMismatch { peers }) => assert_eq!(peers, [swarm.peer(0)]),
        other => panic!("expected a schema mismatch, got {other:?}"),
    }
    assert_eq!(values(&newcomer), vec![vec![0.0; 2]]);
    // A failing provider (set anew: a provided state is reused for up to a second): the donor
    // refuses (busy), so no donor is available.
    fail.store(true, Ordering::SeqCst);
    donor.set_state_provider(Some(provider(&fail, &served)));
    assert!(
        newcomer
            .download_state_from_peers()
            .await
            .unwrap()
            .is_none()
    );
    // Without a provider: the averaged tensors and metadata.
    donor.set_state_provider(None);
    donor
        .set_state_metadata(Bytes::from_static(b"plain"))
        .unwrap();
    let info = loaded(newcomer.load_state_from_peers().await, "without a provider");
    assert_eq!(values(&newcomer), vec![vec![1.0, 2.0]]);
    assert_eq!(info.metadata, Bytes::from_static(b"plain"));
    swarm.shutdown(vec![donor, newcomer]).await;
}

/// A provider serving `served` (metadata `{"epoch": 3}`) unless `fail` is set.
fn provider(fail: &Arc<AtomicBool>, served: &[Tensor]) -> Arc<dyn state::StateProvider> {
    let (fail, served) = (fail.clone(), served.to_vec());
    Arc::new(move || {
        if fail.load(Ordering::SeqCst) {
            return Err("no state right now".to_owned());
        }
        Ok(state::ProvidedState {
            metadata: Bytes::from_static(b"{\"epoch\": 3}"),
            tensors: served.clone(),
        })
    })
}
