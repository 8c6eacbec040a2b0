//! Helpers shared by the integration tests: driving one `Butterfly` by hand, and DHT nodes on
//! loopback.

#![allow(dead_code)] // each test binary uses a subset

use std::time::{Duration, Instant};

use bytes::Bytes;
use hivemesh::allreduce::{Butterfly, Member, Message, Mode, Outcome, PartMessage, RoundConfig};
use hivemesh::compression::CompressionType;
use hivemesh::tensor::{DType, Tensor};

/// `n` nodes, 64-byte parts, 100 ms sender / 200 ms reducer timeouts.
pub fn node_config(n: usize, me: usize) -> RoundConfig {
    let members = vec![
        Member {
            mode: Mode::Node,
            fraction: 1.0
        };
        n
    ];
    let mut cfg = RoundConfig::new(members, me);
    cfg.part_size_bytes = 64;
    cfg.sender_timeout = Duration::from_millis(100);
    cfg.reducer_timeout = Duration::from_millis(200);
    cfg
}

/// A machine over one tensor of 300 f32 values.
pub fn machine(cfg: RoundConfig, now: Instant) -> Butterfly {
    let t = Tensor::from_f32(&[300], (0..300).map(|i| i as f32 * 0.01).collect()).unwrap();
    Butterfly::new(cfg, vec![t], now).unwrap()
}

/// An uncompressed f32 part carrying `payload` as is (possibly malformed).
pub fn raw_part(part: usize, payload: Vec<u8>, weight: f64) -> Message {
    Message::Part(PartMessage {
        part: part as u32,
        weight,
        codec: CompressionType::None,
        dtype: DType::F32,
        payload: Bytes::from(payload),
    })
}

/// An uncompressed f32 part with these values.
pub fn f32_part(part: usize, values: &[f32], weight: f64) -> Message {
    raw_part(
        part,
        values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        weight,
    )
}

/// A well-formed part frame for the group `other-group` (a valid frame from the wrong round).
pub fn foreign_group_frame() -> Vec<u8> {
    let mut b = bytes::BytesMut::new();
    hivemesh::wire::encode_frame(
        &hivemesh::wire::Frame {
            group_id: Bytes::from_static(b"other-group"),
            message: Message::Part(PartMessage {
                part: 0,
                weight: 1.0,
                codec: CompressionType::None,
                dtype: DType::F32,
                payload: Bytes::from(vec![0u8; 64]),
            }),
        },
        &mut b,
    );
    b.to_vec()
}

/// Tells every node the others' listen addresses, so that any of them can dial any other.
pub async fn introduce_all(nodes: &[&hivemesh::p2p::P2p]) {
    let mut addrs = Vec::new();
    for n in nodes {
        addrs.push(n.listen_addrs().await.expect("addrs"));
    }
    for a in nodes {
        for (b, addrs) in nodes.iter().zip(&addrs) {
            if a.peer_id() != b.peer_id() {
                a.add_peer_addresses(b.peer_id(), addrs.clone())
                    .await
                    .expect("add addresses");
            }
        }
    }
}

/// A fault-free round, checked without trusting its report: every segment of every span lists
/// every member as a contributor, and every part's result is the weighted mean of all members'
/// start values, computed here (in f64) from the inputs alone.
pub fn assert_full_mean(me: usize, outcome: &Outcome, start: &[Vec<Tensor>], weights: &[f64]) {
    let n = start.len();
    for span in &outcome.report.spans {
        for seg in &span.segments {
            let c = seg
                .contributors
                .as_ref()
                .unwrap_or_else(|| panic!("peer {me}: parts {:?} kept local values", seg.parts));
            assert_eq!(c.iter().collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
        }
    }
    let values: Vec<Vec<Vec<f32>>> = start
        .iter()
        .map(|ts| ts.iter().map(Tensor::to_f32_vec).collect())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut got = Vec::new();
    for (g, spec) in outcome.parts.iter().enumerate() {
        got.resize(spec.len, 0.0);
        outcome
            .result_into(g, &start[me], &mut got)
            .unwrap_or_else(|| panic!("peer {me}: no result for part {g}"));
        for (k, &v) in spec.range().zip(&got) {
            let want = (0..n)
                .map(|i| weights[i] * f64::from(values[i][spec.tensor][k]))
                .sum::<f64>()
                / total;
            assert!(
                (f64::from(v) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "peer {me}, part {g}, element {k}: {v} != {want}"
            );
        }
    }
}

/// A DHT node on loopback (a DHT client with `client`), joined through `initial`, with a 10 s
/// request timeout.
pub async fn dht_node(initial: Vec<libp2p::Multiaddr>, client: bool) -> hivemesh::dht::Dht {
    let cfg = hivemesh::p2p::P2pConfig {
        initial_peers: initial,
        client_mode: client,
        request_timeout: Duration::from_secs(10),
        ..hivemesh::p2p::P2pConfig::loopback()
    };
    hivemesh::dht::Dht::start(cfg, libp2p::identity::Keypair::generate_ed25519())
        .await
        .expect("node starts")
        .0
}
