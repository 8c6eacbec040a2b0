//! The exchange machine in virtual time: members pass messages through in-memory queues.

use super::*;
use crate::compression::CompressionType;
use crate::runner::Machine;
use crate::tensor::DType;
use bytes::Bytes;
use proptest::prelude::*;

fn cfg(members: usize, me: usize, compression: CompressionType) -> ExchangeConfig {
    ExchangeConfig {
        members,
        me,
        part_size_bytes: 64,
        compression: Compression::Fixed(compression),
        sender_timeout: Duration::from_secs(5),
        op_timeout: Some(Duration::from_secs(60)),
    }
}

/// Member `seed`'s tensors (small integers: exact in every dtype and 16-bit codec; the chain's
/// tests use them too).
pub(in crate::group) fn tensors(seed: usize, dtype: DType, sizes: &[usize]) -> Vec<Tensor> {
    sizes
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            let v: Vec<f32> = (0..n)
                .map(|i| ((seed * 31 + t * 7 + i) % 97) as f32 - 40.0)
                .collect();
            Tensor::from_f32_as(&[n], &v, dtype).unwrap()
        })
        .collect()
}

fn all_gather_plan(n: usize, me: usize, mine: Vec<Tensor>) -> Plan {
    let d: Arc<[TensorDescriptor]> = mine.iter().map(TensorDescriptor::of).collect();
    let mine = Arc::new(mine);
    Plan {
        sends: (0..n).map(|j| (j != me).then(|| mine.clone())).collect(),
        expects: (0..n).map(|j| (j != me).then(|| d.clone())).collect(),
    }
}

/// One machine per member, each with the plan `plan(me)`.
fn start(n: usize, codec: CompressionType, plan: impl Fn(usize) -> Plan) -> Vec<Exchange> {
    (0..n)
        .map(|me| {
            Exchange::new(
                cfg(n, me, codec),
                plan(me),
                Instant::now(),
                BufferPool::default(),
            )
            .unwrap()
        })
        .collect()
}

/// Runs the machines to the end: every message is delivered in order unless `silent` is the
/// sender (that member sends nothing at all); time jumps to the next deadline when nothing
/// moves.
fn run(mut machines: Vec<Exchange>, silent: Option<usize>) -> Vec<Exchange> {
    let start = Instant::now();
    let mut now = start;
    for _ in 0..100_000 {
        let mut moved = false;
        for from in 0..machines.len() {
            while let Some(t) = machines[from].poll_transmit(now, |_| true) {
                moved = true;
                if Some(from) != silent {
                    machines[t.to].handle_message(now, from, t.message).unwrap();
                }
            }
        }
        if machines
            .iter()
            .enumerate()
            .all(|(i, m)| Some(i) == silent || m.is_finished())
        {
            return machines;
        }
        if !moved {
            let next = machines
                .iter()
                .filter_map(|m| m.poll_timeout())
                .min()
                .expect("a stuck exchange has a deadline");
            now = now.max(next);
            for m in &mut machines {
                m.handle_timeout(now);
            }
        }
    }
    panic!("the exchange did not end");
}

#[test]
fn all_gather_delivers_every_members_tensors_bit_exact() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let n = 4;
        let machines = start(n, CompressionType::None, |me| {
            all_gather_plan(n, me, tensors(me, dtype, &[0, 1, 33, 100]))
        });
        for (me, m) in run(machines, None).into_iter().enumerate() {
            let r = m.into_received().unwrap();
            assert!(r.failed.is_empty());
            for s in 0..n {
                if s == me {
                    assert!(r.values[s].is_none());
                    continue;
                }
                let got = r.values[s].as_ref().expect("complete");
                let want = tensors(s, dtype, &[0, 1, 33, 100]);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(g, &w.to_f32_vec(), "{dtype:?} from {s} at {me}");
                }
            }
        }
    }
}

#[test]
fn plans_whose_lists_do_not_fit_the_group_are_refused() {
    let n = 2;
    let make = |plan: Plan| {
        Exchange::new(
            cfg(n, 0, CompressionType::None),
            plan,
            Instant::now(),
            BufferPool::default(),
        )
        .map(|_| ())
    };
    let plan = || all_gather_plan(n, 0, tensors(0, DType::F32, &[10, 20]));
    assert_eq!(make(plan()), Ok(()));
    let mut long = plan();
    long.sends.push(None);
    assert!(matches!(make(long), Err(RoundError::NotInGroup { .. })));
    let mut short = plan();
    short.expects.pop();
    assert!(matches!(make(short), Err(RoundError::NotInGroup { .. })));
}

#[test]
fn a_silent_member_fails_by_timeout_and_the_rest_complete() {
    let n = 3;
    let machines = (0..n)
        .map(|me| {
            Exchange::new(
                cfg(n, me, CompressionType::Float16),
                all_gather_plan(n, me, tensors(me, DType::F32, &[50])),
                Instant::now(),
                BufferPool::default(),
            )
            .unwrap()
        })
        .collect();
    let mut machines = run(machines, Some(2));
    // The silent member's own parts were dropped by the driver, but it got everyone else's.
    let silent = machines.remove(2).into_received().expect("it finished");
    assert!(silent.failed.is_empty());
    assert!(silent.values[0].is_some() && silent.values[1].is_some());
    for (me, m) in machines.into_iter().enumerate() {
        let r = m.into_received().unwrap();
        assert_eq!(r.failed.len(), 1, "member {me}: {:?}", r.failed);
        assert_eq!(r.failed[0], (2, Violation::SenderTimeout));
        assert!(r.values[2].is_none());
        let other = 1 - me;
        let got = &r.values[other].as_ref().unwrap()[0];
        let want = tensors(other, DType::F32, &[50])[0].to_f32_vec();
        // float16 keeps these small integers exactly.
        assert_eq!(got, &want);
    }
}

#[test]
fn bad_parts_fail_their_sender_with_a_typed_violation() {
    let n = 2;
    let mut m = Exchange::new(
        cfg(n, 0, CompressionType::None),
        all_gather_plan(n, 0, tensors(0, DType::F32, &[40])),
        Instant::now(),
        BufferPool::default(),
    )
    .unwrap();
    let now = Instant::now();
    // Part 1 before part 0.
    m.handle_message(
        now,
        1,
        Message::Part(PartMessage {
            part: 1,
            weight: 1.0,
            codec: CompressionType::None,
            dtype: DType::F32,
            payload: Bytes::from(vec![0u8; 64]),
        }),
    )
    .unwrap();
    let ev = m.poll_event().unwrap();
    assert!(
        matches!(
            ev,
            RoundEvent::Banned {
                peer: 1,
                reason: Violation::UnexpectedPart {
                    part: 1,
                    expected: Some(0)
                }
            }
        ),
        "{ev:?}"
    );
    // Later good parts from a failed source are ignored, and an index outside the group is
    // an error, not a panic.
    assert!(
        m.handle_message(
            now,
            5,
            Message::Abort {
                role: Role::Sender,
                reason: AbortReason::Cancelled
            }
        )
        .is_err()
    );
}

#[test]
fn wrong_codec_and_short_payloads_are_violations() {
    for (codec, len, want_codec_error) in [
        (CompressionType::Float16, 64, false),
        (CompressionType::None, 10, true),
    ] {
        let mut m = Exchange::new(
            cfg(2, 0, CompressionType::None),
            all_gather_plan(2, 0, tensors(0, DType::F32, &[16])),
            Instant::now(),
            BufferPool::default(),
        )
        .unwrap();
        m.handle_message(
            Instant::now(),
            1,
            Message::Part(PartMessage {
                part: 0,
                weight: 1.0,
                codec,
                dtype: DType::F32,
                payload: Bytes::from(vec![0u8; len]),
            }),
        )
        .unwrap();
        match m.poll_event() {
            Some(RoundEvent::Banned {
                reason: Violation::Codec(_),
                ..
            }) => assert!(want_codec_error),
            Some(RoundEvent::Banned {
                reason: Violation::WrongEncoding { .. },
                ..
            }) => assert!(!want_codec_error),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn the_operation_deadline_ends_everything_still_running() {
    let mut c = cfg(2, 0, CompressionType::None);
    c.sender_timeout = Duration::from_secs(3600);
    c.op_timeout = Some(Duration::from_secs(10));
    let start = Instant::now();
    let mut m = Exchange::new(
        c,
        all_gather_plan(2, 0, tensors(0, DType::F32, &[16])),
        start,
        BufferPool::default(),
    )
    .unwrap();
    assert_eq!(m.poll_timeout(), Some(start + Duration::from_secs(10)));
    m.handle_timeout(start + Duration::from_secs(10));
    assert!(m.is_finished());
    let r = m.into_received().unwrap();
    assert_eq!(r.failed, vec![(1, Violation::RoundTimeout)]);
}

#[test]
fn cancel_aborts_to_every_member_still_in_a_flow() {
    let mut m = Exchange::new(
        cfg(3, 1, CompressionType::None),
        all_gather_plan(3, 1, tensors(0, DType::F32, &[16])),
        Instant::now(),
        BufferPool::default(),
    )
    .unwrap();
    m.cancel(Instant::now());
    let mut to = Vec::new();
    while let Some(t) = m.poll_transmit(Instant::now(), |_| true) {
        assert!(matches!(t.message, Message::Abort { .. }));
        to.push(t.to);
    }
    assert_eq!(to, vec![0, 2]);
    assert!(m.is_cancelled() && m.is_drained());
    assert_eq!(m.into_received().unwrap_err(), RoundError::Cancelled);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any group size, sizes (including empty tensors) and codec: every complete flow
    /// decodes to what the codec's own round trip gives.
    #[test]
    fn all_gather_matches_the_codec_round_trip(
        n in 1usize..6,
        sizes in proptest::collection::vec(0usize..300, 1..4),
        codec in prop_oneof![
            Just(CompressionType::None),
            Just(CompressionType::Float16),
            Just(CompressionType::BFloat16),
            Just(CompressionType::Uniform8Bit),
        ],
    ) {
        let machines = (0..n)
            .map(|me| Exchange::new(
                cfg(n, me, codec),
                all_gather_plan(n, me, tensors(me, DType::F32, &sizes)),
                Instant::now(),
                BufferPool::default(),
            ).unwrap())
            .collect();
        for (me, m) in run(machines, None).into_iter().enumerate() {
            let r = m.into_received().unwrap();
            prop_assert!(r.failed.is_empty());
            for s in (0..n).filter(|&s| s != me) {
                let got = r.values[s].as_ref().unwrap();
                for (t, want) in tensors(s, DType::F32, &sizes).iter().enumerate() {
                    let c = codec.codec();
                    let mut expected = vec![0.0; want.numel()];
                    // Part by part, as the sender encodes.
                    let parts = Partition::new(
                        &[TensorDescriptor::of(want)],
                        &[1.0],
                        64,
                        &Compression::Fixed(codec),
                    ).unwrap();
                    for p in parts.parts() {
                        let mut buf = Vec::new();
                        c.encode(want.part(p.range()), &mut buf);
                        c.decode(&buf, c.wire_dtype(DType::F32), &mut expected[p.range()]).unwrap();
                    }
                    prop_assert_eq!(&got[t], &expected);
                }
            }
        }
    }
}
