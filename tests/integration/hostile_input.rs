//! Hostile input against one peer's round: malformed, inconsistent or random messages get a
//! ban (or a failed reducer), never a panic or a hang, and honest peers still finish.

use crate::common;

use common::{machine, node_config, raw_part};

use std::time::{Duration, Instant};

use bytes::Bytes;
use hivemesh::allreduce::TensorDescriptor;
use hivemesh::allreduce::{
    AbortReason, AveragedMessage, Message, PartMessage, PeerSet, Role, RoundEvent,
};
use hivemesh::compression::CompressionType;
use hivemesh::sim::{self, Fault, PeerStatus, SimConfig, SimPeer};
use hivemesh::tensor::DType;
use proptest::prelude::*;

fn arb_message() -> impl Strategy<Value = Message> {
    let codec = proptest::sample::select(vec![
        CompressionType::None,
        CompressionType::Float16,
        CompressionType::Uniform8Bit,
        CompressionType::Blockwise8Bit,
    ]);
    let dtype = proptest::sample::select(vec![DType::F32, DType::F16, DType::BF16]);
    let payload = proptest::collection::vec(any::<u8>(), 0..200).prop_map(Bytes::from);
    let weight = prop_oneof![
        Just(1.0),
        Just(-1.0),
        Just(f64::NAN),
        Just(f64::INFINITY),
        0.0..10.0
    ];
    prop_oneof![
        (
            0u32..40,
            weight,
            codec.clone(),
            dtype.clone(),
            payload.clone()
        )
            .prop_map(
                |(part, weight, codec, dtype, payload)| Message::Part(PartMessage {
                    part,
                    weight,
                    codec,
                    dtype,
                    payload
                })
            ),
        (
            0u32..40,
            codec,
            dtype,
            proptest::collection::vec(any::<u64>(), 0..3),
            payload
        )
            .prop_map(|(part, codec, dtype, words, payload)| Message::Averaged(
                AveragedMessage {
                    part,
                    codec,
                    dtype,
                    contributors: PeerSet::from_words(words),
                    payload,
                    finite: None,
                }
            )),
        (prop_oneof![Just(Role::Sender), Just(Role::Reducer)]).prop_map(|role| Message::Abort {
            role,
            reason: AbortReason::Internal
        }),
    ]
}

proptest! {
    /// Random messages from random members, with time passing: no panic, every refusal is an
    /// event, and once the deadlines pass the round finishes.
    #[test]
    fn random_messages_never_break_a_round(
        msgs in proptest::collection::vec((1usize..4, arb_message(), 0u64..50), 0..60),
    ) {
        let start = Instant::now();
        let mut m = machine(node_config(4, 0), start);
        let mut now = start;
        for (from, msg, dt) in msgs {
            now += Duration::from_millis(dt);
            m.handle_message(now, from, msg).unwrap();
            m.handle_timeout(now);
            while m.poll_transmit(now, |_| true).is_some() {}
            while m.poll_event().is_some() {}
        }
        let unknown = Message::Abort { role: Role::Sender, reason: AbortReason::Banned };
        prop_assert!(m.handle_message(now, 99, unknown).is_err(), "unknown peer index accepted");
        // Honest-but-silent peers: deadlines end the round.
        for _ in 0..10 {
            if m.is_finished() { break; }
            now = m.poll_timeout().unwrap_or(now).max(now);
            m.handle_timeout(now);
            while m.poll_transmit(now, |_| true).is_some() {}
        }
        prop_assert!(m.is_finished(), "round did not finish after all deadlines");
        let outcome = m.outcome().unwrap();
        // Whatever happened, values stay finite and the report covers every part.
        for d in outcome.deltas(m.tensors()).unwrap().unwrap() {
            prop_assert!(d.iter().all(|v| v.is_finite()));
        }
        let covered: usize = outcome.report.spans.iter().map(|s| s.parts.len()).sum();
        prop_assert_eq!(covered, m.partition().num_parts());
    }
}

#[test]
fn specific_violations_are_banned_with_reasons() {
    let start = Instant::now();
    let mut m = machine(node_config(3, 0), start);
    let span = m.partition().span(0);
    // Peer 1: part out of order.
    m.handle_message(start, 1, raw_part(span.start + 1, vec![0; 64], 1.0))
        .unwrap();
    // Peer 2: right part, truncated payload.
    m.handle_message(start, 2, raw_part(span.start, vec![0; 63], 1.0))
        .unwrap();
    let mut banned = Vec::new();
    while let Some(ev) = m.poll_event() {
        if let RoundEvent::Banned { peer, reason } = ev {
            banned.push((peer, reason.to_string()));
        }
    }
    assert_eq!(banned.len(), 2, "{banned:?}");
    assert_eq!(banned[0].0, 1);
    assert!(banned[0].1.contains("unexpected part"), "{banned:?}");
    assert_eq!(banned[1].0, 2);
    assert!(banned[1].1.contains("payload"), "{banned:?}");
    // Both banned peers are told so.
    let mut aborts = 0;
    while let Some(t) = m.poll_transmit(start, |_| true) {
        if let Message::Abort {
            role: Role::Reducer,
            reason: AbortReason::Banned,
        } = t.message
        {
            aborts += 1;
        }
    }
    assert_eq!(aborts, 2);
}

/// Corrupting peers are dropped; everyone else finishes with the exact mean of whom their
/// report names.
#[test]
fn corrupt_peers_do_not_stop_honest_ones() {
    for fault in [Fault::CorruptSending, Fault::CorruptReducing] {
        let mut peers = vec![SimPeer::node(); 5];
        peers[1].fault = Some(fault);
        let mut cfg = SimConfig::new(peers, 3);
        cfg.round.part_size_bytes = 4096;
        let res = sim::run(
            &cfg,
            &[TensorDescriptor {
                shape: vec![20_000],
                dtype: DType::F32,
            }],
        )
        .unwrap();
        let checks = res.check();
        for p in [0, 2, 3, 4] {
            assert!(
                matches!(res.peers[p].status, PeerStatus::Finished(_)),
                "{fault:?} peer {p}"
            );
            assert!(checks[p].as_ref().unwrap().max_abs_err < 1e-5);
        }
        let reports: Vec<_> = [0, 2, 3, 4]
            .iter()
            .map(|&p| res.peers[p].outcome.as_ref().unwrap().report.clone())
            .collect();
        match fault {
            Fault::CorruptSending => assert!(reports.iter().any(|r| r.banned.contains(1))),
            _ => assert!(reports.iter().all(|r| r.failed_reducers.contains(1))),
        }
    }
}
