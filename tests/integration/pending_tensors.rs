//! A round whose tensors are not all readable at its start (a device snapshot still on its
//! way to host memory): `Butterfly::with_pending` and `mark_ready`, in virtual time, and the
//! runner's wiring (`runner::run_round_pending`) over in-memory links.

use std::time::{Duration, Instant};

use hivemesh::allreduce::{Butterfly, Member, Message, Mode, RoundConfig, RoundError};
use hivemesh::buffers::BufferPool;
use hivemesh::runner::{self, Link, PendingTensors, RunnerConfig};
use hivemesh::tensor::Tensor;

const N: usize = 3;
const SIZES: [usize; 2] = [50, 70];

fn cfg(me: usize) -> RoundConfig {
    let mut cfg = RoundConfig::new(
        vec![
            Member {
                mode: Mode::Node,
                fraction: 1.0,
            };
            N
        ],
        me,
    );
    cfg.part_size_bytes = 64;
    cfg.sender_timeout = Duration::from_secs(5);
    cfg.reducer_timeout = Duration::from_secs(10);
    cfg
}

fn tensors(me: usize) -> Vec<Tensor> {
    SIZES
        .iter()
        .enumerate()
        .map(|(t, &n)| {
            let v = (0..n)
                .map(|i| ((me * 13 + t * 5 + i) % 29) as f32)
                .collect();
            Tensor::from_f32(&[n], v).unwrap()
        })
        .collect()
}

/// Delivers messages between the machines until none moves (time stands still, so no
/// timeout fires). Returns, per sender, the tensors of the parts it sent.
fn exchange(machines: &mut [Butterfly], now: Instant) -> Vec<Vec<usize>> {
    let mut sent = vec![Vec::new(); machines.len()];
    loop {
        let mut moved = false;
        for from in 0..machines.len() {
            while let Some(t) = machines[from].poll_transmit(now, |_| true) {
                moved = true;
                if let Message::Part(p) = &t.message {
                    let spec = machines[from].partition().part(p.part as usize);
                    sent[from].push(spec.tensor);
                }
                machines[t.to].handle_message(now, from, t.message).unwrap();
            }
        }
        if !moved {
            return sent;
        }
    }
}

/// Each member's tensors after the round (the delta rule applied to its start values).
fn results(machines: Vec<Butterfly>) -> Vec<Vec<Tensor>> {
    machines
        .into_iter()
        .map(|m| {
            let (start, outcome) = m.into_outcome().unwrap();
            let mut out = start.clone();
            outcome.apply(&mut out, &start, 1.0).unwrap();
            out
        })
        .collect()
}

#[test]
fn a_pending_tensor_holds_back_only_its_own_parts_and_the_round_ends_as_a_plain_one() {
    let now = Instant::now();
    let plain: Vec<Butterfly> = (0..N)
        .map(|me| Butterfly::new(cfg(me), tensors(me), now).unwrap())
        .collect();
    let mut plain = plain;
    exchange(&mut plain, now);
    assert!(plain.iter().all(Butterfly::is_finished));
    let want = results(plain);

    // Member 0's tensor 1 is still being copied.
    let mut machines: Vec<Butterfly> = (0..N)
        .map(|me| {
            let pending: &[usize] = if me == 0 { &[1] } else { &[] };
            Butterfly::with_pending(cfg(me), tensors(me), pending, now, BufferPool::default())
                .unwrap()
        })
        .collect();
    let sent = exchange(&mut machines, now);
    assert!(machines[0].has_pending());
    // Its other tensor went out; of the pending one, nothing. Nobody can finish: every
    // reducer waits for member 0's share of tensor 1, and member 0 for its own.
    assert!(sent[0].contains(&0), "{:?}", sent[0]);
    assert!(!sent[0].contains(&1), "{:?}", sent[0]);
    assert!(sent[1].contains(&1) && sent[2].contains(&1));
    assert!(machines.iter().all(|m| !m.is_finished()));

    machines[0].mark_ready(1);
    assert!(!machines[0].has_pending());
    let sent = exchange(&mut machines, now);
    assert!(sent[0].iter().all(|&t| t == 1), "{:?}", sent[0]);
    assert!(machines.iter().all(Butterfly::is_finished));
    assert_eq!(results(machines), want);
}

#[test]
fn a_pending_index_outside_the_tensors_is_refused() {
    let r = Butterfly::with_pending(
        cfg(0),
        tensors(0),
        &[SIZES.len()],
        Instant::now(),
        BufferPool::default(),
    );
    assert!(matches!(r, Err(RoundError::BadPlan(_))), "{r:?}");
}

type Ended = Result<(Vec<Tensor>, hivemesh::allreduce::Outcome), runner::RunnerError>;

/// Where member 0's readiness goes in, the rounds, and the (never used) cancel switch.
type Rounds = (
    tokio::sync::mpsc::Sender<Result<usize, String>>,
    Vec<tokio::task::JoinHandle<Ended>>,
    tokio::sync::watch::Sender<bool>,
);

/// Runs a round of three members over in-memory links, member 0 with `pending` tensors whose
/// readiness comes from the returned sender; returns the rounds' results.
fn three_rounds(pending: Vec<usize>) -> Rounds {
    let mut ends: Vec<Vec<Option<Box<dyn Link>>>> =
        (0..N).map(|_| (0..N).map(|_| None).collect()).collect();
    for a in 0..N {
        for b in a + 1..N {
            let (x, y) = tokio::io::duplex(1 << 16);
            ends[a][b] = Some(Box::new(x));
            ends[b][a] = Some(Box::new(y));
        }
    }
    let (ready, readiness) = tokio::sync::mpsc::channel(2);
    let mut readiness = Some(readiness);
    let (keep, cancel) = tokio::sync::watch::channel(false);
    let mut rounds = Vec::new();
    for (me, links) in ends.into_iter().enumerate() {
        let pending = (me == 0).then(|| PendingTensors {
            indices: pending.clone(),
            ready: readiness.take().expect("one member has pending tensors"),
        });
        rounds.push(tokio::spawn(runner::run_round_pending(
            cfg(me),
            bytes::Bytes::from_static(b"pending"),
            tensors(me),
            pending,
            links,
            RunnerConfig::default(),
            cancel.clone(),
        )));
    }
    (ready, rounds, keep)
}

/// The runner hands readiness to the round: member 0's tensors are both pending, released
/// one by one after the round started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_starts_a_round_before_its_tensors_are_ready() {
    let (ready, rounds, _keep) = three_rounds(vec![0, 1]);
    for t in [1, 0] {
        ready.send(Ok(t)).await.unwrap();
    }
    let mut got = Vec::new();
    for r in rounds {
        let (start, outcome) = tokio::time::timeout(Duration::from_secs(120), r)
            .await
            .expect("the round ended")
            .unwrap()
            .unwrap();
        let mut out = start.clone();
        outcome.apply(&mut out, &start, 1.0).unwrap();
        got.push(out);
    }
    let now = Instant::now();
    let mut plain: Vec<Butterfly> = (0..N)
        .map(|me| Butterfly::new(cfg(me), tensors(me), now).unwrap())
        .collect();
    exchange(&mut plain, now);
    assert_eq!(got, results(plain));
}

/// A pending tensor that will never be ready (its copy failed) cancels that member's round;
/// the others end theirs without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_cancels_the_round_and_the_others_go_on() {
    let (ready, rounds, _keep) = three_rounds(vec![1]);
    ready.send(Err("copy failed".into())).await.unwrap();
    let mut ended = Vec::new();
    for r in rounds {
        let r = tokio::time::timeout(Duration::from_secs(120), r)
            .await
            .expect("the round ended")
            .unwrap();
        ended.push(r);
    }
    assert!(
        matches!(
            ended[0],
            Err(runner::RunnerError::Round(RoundError::Cancelled))
        ),
        "{:?}",
        ended[0].as_ref().err()
    );
    for r in &ended[1..] {
        let (_, outcome) = r.as_ref().expect("the others finish");
        assert!(outcome.report.banned.contains(0), "{:?}", outcome.report);
    }
}

/// A pending tensor that is still pending at the round's deadline fails the round (our own
/// contribution to the parts we reduce never came, so banning the others cannot end it), and
/// then nothing is due any more: no deadline in the past to spin on.
#[test]
fn the_round_deadline_cancels_a_round_still_waiting_for_its_tensors() {
    let now = Instant::now();
    let mut machines: Vec<Butterfly> = (0..N)
        .map(|me| {
            let mut c = cfg(me);
            c.round_timeout = Some(Duration::from_secs(30));
            let pending: &[usize] = if me == 0 { &[1] } else { &[] };
            Butterfly::with_pending(c, tensors(me), pending, now, BufferPool::default()).unwrap()
        })
        .collect();
    exchange(&mut machines, now);
    let deadline = machines[0].poll_timeout().expect("a deadline");
    assert!(deadline <= now + Duration::from_secs(30));
    let late = now + Duration::from_secs(30);
    machines[0].handle_timeout(late);
    assert!(machines[0].is_cancelled());
    assert_eq!(machines[0].poll_timeout(), None);
    // Its aborts reach the others, which end their rounds without it.
    let mut aborts = 0;
    while let Some(t) = machines[0].poll_transmit(late, |_| true) {
        assert!(
            matches!(t.message, Message::Abort { .. }),
            "{:?}",
            t.message
        );
        aborts += 1;
        machines[t.to].handle_message(late, 0, t.message).unwrap();
    }
    assert!(aborts > 0);
    for m in &mut machines[1..] {
        m.handle_timeout(late);
    }
    exchange(&mut machines, late);
    assert!(machines[1..].iter().all(Butterfly::is_finished));
}

/// An aux peer sends and reduces nothing of its own: it has nothing to wait for.
#[test]
fn an_aux_peer_has_nothing_pending() {
    let mut c = cfg(2);
    c.members[2].mode = Mode::Aux;
    let m = Butterfly::with_pending(
        c,
        tensors(2),
        &[0, 1],
        Instant::now(),
        BufferPool::default(),
    )
    .unwrap();
    assert!(!m.has_pending());
}
