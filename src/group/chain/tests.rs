//! The chain broadcast in virtual time: members pass messages through bounded in-memory
//! links, one message per link per step, so the pipeline and backpressure are visible.

use super::*;
use crate::compression::CompressionType;
use crate::group::exchange::tests::tensors;
use crate::runner::Machine;
use crate::tensor::DType;
use bytes::Bytes;
use proptest::prelude::*;

const UNIT: Duration = Duration::from_secs(5);
/// Messages a link holds before its sender must wait.
const LINK_ROOM: usize = 2;

fn cfg(n: usize, me: usize, root: usize, codec: CompressionType) -> ChainConfig {
    ChainConfig {
        members: n,
        me,
        root,
        part_size_bytes: 64,
        compression: Compression::Fixed(codec),
        sender_timeout: UNIT,
        op_timeout: Some(Duration::from_secs(3600)),
    }
}

/// How a member misbehaves.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// Its process is gone from the start: its neighbours' links to it fail.
    Dead,
    /// Gone once it has handed `after` parts downstream (or received them, at the tail).
    DiesAfter(usize),
    /// Alive but does nothing at all (its links stay open).
    Silent,
    /// Does everything but pass the completion notice upstream.
    NoNotice,
}

struct Net {
    machines: Vec<Chain>,
    faults: Vec<Option<Fault>>,
    dead: Vec<bool>,
    /// `links[from][to]`: messages in flight.
    links: Vec<Vec<VecDeque<Message>>>,
    /// Per member, the members it named failed (in the order it did).
    named: Vec<Vec<(usize, Violation)>>,
    now: Instant,
    /// Per member, the parts it had received when the root handed over its last part.
    received_when_root_done: Option<Vec<usize>>,
}

impl Net {
    fn new(machines: Vec<Chain>, faults: Vec<Option<Fault>>) -> Self {
        let n = machines.len();
        let dead = faults.iter().map(|f| *f == Some(Fault::Dead)).collect();
        let mut net = Self {
            links: vec![vec![VecDeque::new(); n]; n],
            named: vec![Vec::new(); n],
            now: Instant::now(),
            machines,
            faults,
            dead,
            received_when_root_done: None,
        };
        for d in 0..n {
            if net.dead[d] {
                net.kill(d);
            }
        }
        net
    }

    fn active(&self, i: usize) -> bool {
        !self.dead[i] && self.faults[i] != Some(Fault::Silent)
    }

    /// Member `d` dies: what it had in flight is lost, and every member's link to it fails.
    fn kill(&mut self, d: usize) {
        self.dead[d] = true;
        let now = self.now;
        for i in 0..self.machines.len() {
            self.links[d][i].clear();
            self.links[i][d].clear();
            if i != d && !self.dead[i] {
                self.machines[i].handle_link_failed(now, d);
            }
        }
    }

    fn collect_events(&mut self, i: usize) {
        while let Some(ev) = self.machines[i].poll_event() {
            if let RoundEvent::Banned { peer, reason } = ev {
                self.named[i].push((peer, reason));
            }
        }
    }

    /// One step: every active member sends what its links take, then every link delivers
    /// its oldest message. Whether anything moved.
    fn step(&mut self) -> bool {
        let n = self.machines.len();
        let now = self.now;
        let mut moved = false;
        for from in 0..n {
            if !self.active(from) {
                continue;
            }
            loop {
                let links = &self.links[from];
                let dead = &self.dead;
                let Some(t) = self.machines[from]
                    .poll_transmit(now, |to| !dead[to] && links[to].len() < LINK_ROOM)
                else {
                    break;
                };
                moved = true;
                if self.faults[from] == Some(Fault::NoNotice)
                    && matches!(&t.message, Message::Notice { failed } if failed.is_empty())
                {
                    continue;
                }
                if from == self.machines[0].cfg.root
                    && self.machines[from].sent == self.machines[from].parts.len()
                    && self.received_when_root_done.is_none()
                {
                    self.received_when_root_done =
                        Some(self.machines.iter().map(|m| m.received).collect());
                }
                self.links[from][t.to].push_back(t.message);
            }
            if let Some(Fault::DiesAfter(k)) = self.faults[from] {
                let m = &self.machines[from];
                let done = if m.down.is_some() { m.sent } else { m.received };
                if done >= k && !self.dead[from] {
                    self.kill(from);
                }
            }
        }
        for from in 0..n {
            for to in 0..n {
                if !self.active(to) {
                    continue;
                }
                if let Some(message) = self.links[from][to].pop_front() {
                    moved = true;
                    self.machines[to]
                        .handle_message(now, from, message)
                        .unwrap();
                }
            }
        }
        for i in 0..n {
            self.collect_events(i);
        }
        moved
    }

    /// Runs until every active member finished; time jumps to the next deadline when
    /// nothing moves.
    fn run(mut self) -> Self {
        for _ in 0..100_000 {
            let moved = self.step();
            let n = self.machines.len();
            if (0..n).all(|i| !self.active(i) || self.machines[i].is_finished()) {
                return self;
            }
            if !moved {
                let next = (0..n)
                    .filter(|&i| self.active(i))
                    .filter_map(|i| self.machines[i].poll_timeout())
                    .min()
                    .expect("a stuck chain has a deadline");
                self.now = self.now.max(next);
                for i in 0..n {
                    if self.active(i) {
                        self.machines[i].handle_timeout(self.now);
                        self.collect_events(i);
                    }
                }
            }
        }
        panic!("the chain did not end");
    }
}

fn start(
    n: usize,
    root: usize,
    codec: CompressionType,
    dtype: DType,
    sizes: &[usize],
) -> Vec<Chain> {
    (0..n)
        .map(|me| {
            // The others pass tensors of the right shapes holding other values.
            Chain::new(
                cfg(n, me, root, codec),
                tensors(me, dtype, sizes),
                Instant::now(),
                BufferPool::default(),
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn every_member_gets_the_roots_tensors_bit_exact_from_every_root() {
    const SIZES: [usize; 4] = [0, 1, 33, 100];
    for n in 1..=6 {
        for root in 0..n {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let net = Net::new(
                    start(n, root, CompressionType::None, dtype, &SIZES),
                    vec![None; n],
                )
                .run();
                let want = tensors(root, dtype, &SIZES);
                for (me, m) in net.machines.into_iter().enumerate() {
                    assert!(net.named[me].is_empty(), "{:?}", net.named[me]);
                    let got = m.into_tensors();
                    assert_eq!(got.len(), want.len());
                    for (g, w) in got.iter().zip(&want) {
                        assert_eq!(g.dtype(), dtype);
                        assert_eq!(g.to_f32_vec(), w.to_f32_vec(), "{n} from {root} at {me}");
                    }
                }
            }
        }
    }
}

/// Parts flow down the chain while the root still sends: the last member holds parts before
/// the root has handed over its last one (a chain that stored and forwarded whole tensors
/// would have the tail at 0 then).
#[test]
fn parts_are_forwarded_while_later_ones_still_arrive() {
    let n = 4;
    let net = Net::new(
        start(n, 1, CompressionType::None, DType::F32, &[4000]),
        vec![None; n],
    )
    .run();
    let parts = net.machines[0].parts.len();
    assert!(parts > 20, "{parts} parts");
    let at_root_done = net
        .received_when_root_done
        .expect("the root sent everything");
    // Tail of the chain 1, 2, 3, 0: member 0.
    assert!(at_root_done[0] > 0, "{at_root_done:?}");
    assert!(at_root_done[0] < parts, "{at_root_done:?}");
}

/// A lossy codec is applied once, at the root: every member decodes the same bytes, so every
/// non-root member ends with the same values (the codec's round trip of the root's), however
/// far down the chain.
#[test]
fn lossy_parts_are_forwarded_as_received_not_encoded_again() {
    for codec in [
        CompressionType::Float16,
        CompressionType::Uniform8Bit,
        CompressionType::Quantile8Bit,
        CompressionType::Blockwise8Bit,
    ] {
        let n = 5;
        let sizes = [3000];
        let root_values: Vec<Tensor> = vec![
            Tensor::from_f32(
                &[3000],
                (0..3000)
                    .map(|i| ((i * 7919) % 1000) as f32 / 37.0)
                    .collect(),
            )
            .unwrap(),
        ];
        let machines = (0..n)
            .map(|me| {
                let t = if me == 2 {
                    root_values.clone()
                } else {
                    tensors(me, DType::F32, &sizes)
                };
                Chain::new(
                    cfg(n, me, 2, codec),
                    t,
                    Instant::now(),
                    BufferPool::default(),
                )
                .unwrap()
            })
            .collect();
        let net = Net::new(machines, vec![None; n]).run();
        let results: Vec<Vec<f32>> = net
            .machines
            .into_iter()
            .map(|m| m.into_tensors()[0].to_f32_vec())
            .collect();
        let exact = root_values[0].to_f32_vec();
        assert_eq!(results[2], exact, "the root keeps its own values");
        for me in [3, 4, 0, 1] {
            assert_eq!(results[me], results[3], "{codec:?}: member {me}");
        }
        let err = results[3]
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err < 0.5, "{codec:?}: {err}");
    }
}

/// Asserts that every member but `culprit` named exactly `culprit` (and nobody else).
fn everyone_names(net: &Net, culprit: usize) {
    for (i, named) in net.named.iter().enumerate() {
        if i == culprit {
            continue;
        }
        let who: Vec<usize> = named.iter().map(|(p, _)| *p).collect();
        assert_eq!(who, vec![culprit], "member {i}: {named:?}");
    }
}

#[test]
fn a_member_dead_from_the_start_is_named_by_every_other() {
    for n in 2..=5 {
        for root in [0, n - 1] {
            for dead in 0..n {
                let mut faults = vec![None; n];
                faults[dead] = Some(Fault::Dead);
                let net = Net::new(
                    start(n, root, CompressionType::None, DType::F32, &[500]),
                    faults,
                )
                .run();
                everyone_names(&net, dead);
                // Its neighbours saw its link fail; the others heard of it.
                for (i, named) in net.named.iter().enumerate() {
                    if let Some((_, reason)) = named.first() {
                        let neighbour =
                            net.machines[i].up == Some(dead) || net.machines[i].down == Some(dead);
                        assert_eq!(
                            *reason == Violation::LinkFailed,
                            neighbour,
                            "member {i} of {n} (root {root}, dead {dead}): {reason}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_member_that_dies_mid_broadcast_is_named_by_every_other() {
    let n = 5;
    for root in 0..n {
        for victim in 0..n {
            let mut faults = vec![None; n];
            faults[victim] = Some(Fault::DiesAfter(7));
            let net = Net::new(
                start(n, root, CompressionType::None, DType::F32, &[2000]),
                faults,
            )
            .run();
            everyone_names(&net, victim);
        }
    }
}

/// A member that stops without its links failing is found by its neighbours' timeouts, and
/// nobody blames the members between it and them that were only waiting.
#[test]
fn a_silent_member_is_named_by_every_other_and_nobody_else_is() {
    let n = 5;
    for root in [0, 2] {
        for silent in 0..n {
            let mut faults = vec![None; n];
            faults[silent] = Some(Fault::Silent);
            let net = Net::new(
                start(n, root, CompressionType::None, DType::F32, &[700]),
                faults,
            )
            .run();
            everyone_names(&net, silent);
        }
    }
}

/// A member that forwards everything but never passes the completion on: the members after
/// it have the data and finish cleanly; those before it name it.
#[test]
fn a_member_that_never_confirms_is_named_upstream() {
    let n = 5;
    let root = 0;
    for quiet in 1..n {
        let mut faults = vec![None; n];
        faults[quiet] = Some(Fault::NoNotice);
        let net = Net::new(
            start(n, root, CompressionType::None, DType::F32, &[300]),
            faults,
        )
        .run();
        for (i, named) in net.named.iter().enumerate() {
            let who: Vec<usize> = named.iter().map(|(p, _)| *p).collect();
            if i < quiet {
                assert_eq!(who, vec![quiet], "member {i}: {named:?}");
            } else {
                assert!(who.is_empty(), "member {i}: {named:?}");
            }
        }
        let want = tensors(root, DType::F32, &[300])[0].to_f32_vec();
        for (i, m) in net.machines.into_iter().enumerate().skip(quiet) {
            assert_eq!(m.into_tensors()[0].to_f32_vec(), want, "member {i}");
        }
    }
}

/// One member of a chain of three (root 0: 0 -> 1 -> 2) gets `message` from `from`.
fn middle_after(from: usize, message: Message) -> (Vec<(usize, Violation)>, Vec<Transmit>) {
    let now = Instant::now();
    let mut m = Chain::new(
        cfg(3, 1, 0, CompressionType::None),
        tensors(1, DType::F32, &[100]),
        now,
        BufferPool::default(),
    )
    .unwrap();
    m.handle_message(now, from, message).unwrap();
    let mut named = Vec::new();
    while let Some(ev) = m.poll_event() {
        if let RoundEvent::Banned { peer, reason } = ev {
            named.push((peer, reason));
        }
    }
    let mut sent = Vec::new();
    while let Some(t) = m.poll_transmit(now, |_| true) {
        sent.push(t);
    }
    assert!(m.is_finished(), "a member that gives up finishes");
    (named, sent)
}

fn part(index: u32, codec: CompressionType, payload: Vec<u8>) -> Message {
    Message::Part(PartMessage {
        part: index,
        weight: 1.0,
        codec,
        dtype: crate::tensor::DType::F32,
        payload: Bytes::from(payload),
    })
}

#[test]
fn bad_messages_fail_their_sender_and_the_news_goes_both_ways() {
    let notice = |m: &[usize]| Message::Notice {
        failed: PeerSet::from_indices(m.iter().copied()),
    };
    let cases: Vec<(&str, usize, Message, Violation)> = vec![
        (
            "a part out of order",
            0,
            part(3, CompressionType::None, vec![0; 64]),
            Violation::UnexpectedPart {
                part: 3,
                expected: Some(0),
            },
        ),
        (
            "a part from downstream",
            2,
            part(0, CompressionType::None, vec![0; 64]),
            Violation::UnexpectedPart {
                part: 0,
                expected: None,
            },
        ),
        (
            "another codec",
            0,
            part(0, CompressionType::Float16, vec![0; 32]),
            Violation::WrongEncoding {
                part: 0,
                codec: CompressionType::Float16,
                dtype: DType::F32,
                expected_codec: CompressionType::None,
                expected_dtype: DType::F32,
            },
        ),
        ("a notice naming us", 0, notice(&[1]), Violation::BadNotice),
        (
            "a member out of range",
            2,
            notice(&[7]),
            Violation::BadNotice,
        ),
        ("done from upstream", 0, notice(&[]), Violation::BadNotice),
        (
            "done before it had everything",
            2,
            notice(&[]),
            Violation::BadNotice,
        ),
        (
            "an average",
            2,
            Message::Averaged(crate::allreduce::AveragedMessage {
                part: 0,
                codec: CompressionType::None,
                dtype: DType::F32,
                contributors: PeerSet::new(),
                payload: Bytes::new(),
                finite: None,
            }),
            Violation::UnexpectedReply(0),
        ),
        (
            "an abort",
            0,
            Message::Abort {
                role: Role::Sender,
                reason: AbortReason::Cancelled,
            },
            Violation::Aborted(AbortReason::Cancelled),
        ),
    ];
    for (what, from, message, want) in cases {
        let (named, sent) = middle_after(from, message);
        assert_eq!(named, vec![(from, want)], "{what}");
        // The living neighbour hears whom we found failed.
        let other = if from == 0 { 2 } else { 0 };
        assert_eq!(sent.len(), 1, "{what}: {sent:?}");
        assert_eq!(sent[0].to, other, "{what}");
        assert_eq!(
            sent[0].message,
            Message::Notice {
                failed: PeerSet::from_indices([from])
            },
            "{what}"
        );
    }
    // A payload that does not decode (short by one byte).
    let (named, _) = middle_after(0, part(0, CompressionType::None, vec![0; 63]));
    assert!(
        matches!(named.as_slice(), [(0, Violation::Codec(_))]),
        "{named:?}"
    );
}

/// A notice from a neighbour naming others: they are named as reported by it, and the news
/// goes on to the other neighbour.
#[test]
fn failures_heard_of_are_named_as_reported_and_passed_on() {
    let n = 6;
    let now = Instant::now();
    // Chain 0 -> 1 -> 2 -> ...: member 2 hears from member 3 that 4 and 5 failed.
    let mut m = Chain::new(
        cfg(n, 2, 0, CompressionType::None),
        tensors(2, DType::F32, &[10]),
        now,
        BufferPool::default(),
    )
    .unwrap();
    m.handle_message(
        now,
        3,
        Message::Notice {
            failed: PeerSet::from_indices([4, 5]),
        },
    )
    .unwrap();
    let events: Vec<RoundEvent> = std::iter::from_fn(|| m.poll_event()).collect();
    assert_eq!(
        events,
        vec![
            RoundEvent::Banned {
                peer: 4,
                reason: Violation::ReportedFailed { by: 3 }
            },
            RoundEvent::Banned {
                peer: 5,
                reason: Violation::ReportedFailed { by: 3 }
            },
        ]
    );
    let sent: Vec<Transmit> = std::iter::from_fn(|| m.poll_transmit(now, |_| true)).collect();
    let to: Vec<usize> = sent.iter().map(|t| t.to).collect();
    assert_eq!(to, vec![1, 3]);
    assert!(m.is_finished());
    assert!(matches!(m.poll_event(), Some(RoundEvent::Finished)));
}

#[test]
fn links_of_members_that_are_not_neighbours_do_not_matter() {
    let now = Instant::now();
    let mut m = Chain::new(
        cfg(5, 2, 0, CompressionType::None),
        tensors(2, DType::F32, &[10]),
        now,
        BufferPool::default(),
    )
    .unwrap();
    m.handle_link_failed(now, 4);
    m.handle_link_failed(now, 0);
    assert!(m.poll_event().is_none());
    assert!(!m.is_finished());
    m.handle_link_failed(now, 3);
    assert!(matches!(
        m.poll_event(),
        Some(RoundEvent::Banned {
            peer: 3,
            reason: Violation::LinkFailed
        })
    ));
}

#[test]
fn cancel_aborts_to_both_neighbours() {
    let now = Instant::now();
    let mut m = Chain::new(
        cfg(4, 2, 0, CompressionType::None),
        tensors(2, DType::F32, &[10]),
        now,
        BufferPool::default(),
    )
    .unwrap();
    m.cancel(now);
    assert!(m.is_cancelled() && !m.is_drained());
    let sent: Vec<Transmit> = std::iter::from_fn(|| m.poll_transmit(now, |_| true)).collect();
    assert_eq!(sent.iter().map(|t| t.to).collect::<Vec<_>>(), vec![1, 3]);
    assert!(sent.iter().all(|t| matches!(
        t.message,
        Message::Abort {
            reason: AbortReason::Cancelled,
            ..
        }
    )));
    assert!(m.is_drained());
}

/// `op_timeout` ends a chain whose neighbours keep their links open and say nothing, naming
/// the neighbours it still waited for.
#[test]
fn the_operation_deadline_fails_the_neighbours_still_waited_for() {
    let start = Instant::now();
    let mut c = cfg(3, 1, 0, CompressionType::None);
    c.sender_timeout = Duration::from_secs(3600);
    c.op_timeout = Some(Duration::from_secs(10));
    let mut m = Chain::new(
        c,
        tensors(1, DType::F32, &[10]),
        start,
        BufferPool::default(),
    )
    .unwrap();
    assert_eq!(m.poll_timeout(), Some(start + Duration::from_secs(10)));
    m.handle_timeout(start + Duration::from_secs(10));
    let named: Vec<usize> = std::iter::from_fn(|| m.poll_event())
        .filter_map(|e| match e {
            RoundEvent::Banned { peer, reason } => {
                assert_eq!(reason, Violation::RoundTimeout);
                Some(peer)
            }
            _ => None,
        })
        .collect();
    assert_eq!(named, vec![0, 2]);
    assert!(m.is_finished());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any group size, root, tensor sizes and 16-bit codec: every member ends with the
    /// root's values through the codec's own round trip.
    #[test]
    fn every_member_gets_the_codecs_round_trip_of_the_roots_values(
        n in 1usize..7,
        root_pick in 0usize..7,
        sizes in proptest::collection::vec(0usize..300, 0..4),
        float16 in any::<bool>(),
    ) {
        let root = root_pick % n;
        let codec = if float16 { CompressionType::Float16 } else { CompressionType::None };
        let net = Net::new(start(n, root, codec, DType::F32, &sizes), vec![None; n]).run();
        let want = tensors(root, DType::F32, &sizes);
        for (me, m) in net.machines.into_iter().enumerate() {
            prop_assert!(net.named[me].is_empty());
            let got = m.into_tensors();
            for (g, w) in got.iter().zip(&want) {
                // Small integers: exact through float16 too.
                prop_assert_eq!(g.to_f32_vec(), w.to_f32_vec());
            }
        }
    }
}

/// With nothing to broadcast (no tensors), completion still travels up the chain: a member
/// that never confirms is named by the members before it in the chain, and those after it,
/// who have everything there is, finish cleanly.
#[test]
fn an_empty_broadcast_completes_and_still_finds_a_silent_member() {
    let (n, root) = (4, 1);
    let net = Net::new(
        start(n, root, CompressionType::None, DType::F32, &[]),
        vec![None; n],
    )
    .run();
    assert!(net.named.iter().all(Vec::is_empty), "{:?}", net.named);
    for silent in 0..n {
        let mut faults = vec![None; n];
        faults[silent] = Some(Fault::Silent);
        let net = Net::new(
            start(n, root, CompressionType::None, DType::F32, &[]),
            faults,
        )
        .run();
        let pos = |i: usize| (i + n - root) % n;
        for (i, named) in net.named.iter().enumerate() {
            let who: Vec<usize> = named.iter().map(|(p, _)| *p).collect();
            let want = if pos(i) < pos(silent) {
                vec![silent]
            } else {
                vec![]
            };
            assert_eq!(who, want, "member {i}, silent {silent}");
            // Its neighbour finds it by the confirmation's wait, not the operation's.
            if pos(i) + 1 == pos(silent) {
                assert_eq!(named[0].1, Violation::DownstreamTimeout, "member {i}");
            }
        }
    }
}

/// A `sender_timeout` too large to add to an instant (`Duration::MAX`: "never") gives no wait
/// instead of overflowing: only the operation's deadline is left.
#[test]
fn a_huge_sender_timeout_means_no_wait() {
    let now = Instant::now();
    let mut c = cfg(5, 3, 0, CompressionType::None);
    c.sender_timeout = Duration::MAX;
    c.op_timeout = Some(Duration::from_secs(60));
    let mut m = Chain::new(c, tensors(3, DType::F32, &[10]), now, BufferPool::default()).unwrap();
    assert_eq!(m.poll_timeout(), Some(now + Duration::from_secs(60)));
    // Blocked downstream too: still nothing but the deadline.
    m.handle_message(now, 2, part(0, CompressionType::None, vec![0; 40]))
        .unwrap();
    assert!(m.poll_transmit(now, |_| false).is_none());
    assert_eq!(m.poll_timeout(), Some(now + Duration::from_secs(60)));
    m.handle_timeout(now + Duration::from_secs(59));
    assert!(m.poll_event().is_none());
}
