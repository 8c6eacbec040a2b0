//! Regressions for defects found in review of the butterfly core (each failed before its fix).

use crate::common;

use std::time::{Duration, Instant};

use common::{f32_part, machine, node_config};
use hivemesh::allreduce::{
    Butterfly, Member, Mode, RoundConfig, RoundEvent, TensorDescriptor, Violation,
};
use hivemesh::sim::{self, Fault, PeerStatus, SimConfig, SimPeer};
use hivemesh::tensor::DType;

fn banned(m: &mut Butterfly) -> Vec<(usize, Violation)> {
    let mut out = Vec::new();
    while let Some(ev) = m.poll_event() {
        if let RoundEvent::Banned { peer, reason } = ev {
            out.push((peer, reason));
        }
    }
    out
}

fn finish(m: &mut Butterfly, mut now: Instant) {
    for _ in 0..20 {
        while m.poll_transmit(now, |_| true).is_some() {}
        if m.is_finished() {
            return;
        }
        now = m.poll_timeout().unwrap_or(now).max(now);
        m.handle_timeout(now);
    }
    panic!("round did not finish");
}

/// B1: a member's finite-but-extreme weight or values made an honest reducer's own average
/// inf/NaN without a ban. Now out-of-range weights are a ban and in-range extremes stay finite
/// (f64 accumulation).
#[test]
fn extreme_weights_and_values_never_poison_a_reducer() {
    for (weight, value, expect_ban) in [
        (1e300f64, 1.0f32, true),
        (2.0, f32::MAX, false),
        (1e39, 0.0, true),
    ] {
        let start = Instant::now();
        let mut m = machine(node_config(3, 0), start);
        let span = m.partition().span(0);
        for g in span.clone() {
            let len = m.partition().part(g).len;
            m.handle_message(start, 1, f32_part(g, &vec![0.5; len], 1.0))
                .unwrap();
            m.handle_message(start, 2, f32_part(g, &vec![value; len], weight))
                .unwrap();
            while m.poll_transmit(start, |_| true).is_some() {}
        }
        let bans = banned(&mut m);
        assert_eq!(
            bans.iter().any(|(p, _)| *p == 2),
            expect_ban,
            "weight {weight:e}: {bans:?}"
        );
        finish(&mut m, start);
        let out = m.outcome().unwrap();
        assert!(
            out.deltas(m.tensors()).unwrap().unwrap()[0]
                .iter()
                .all(|d| d.is_finite()),
            "weight {weight:e}"
        );
    }
}

/// B2: tiny honest weights (0 as f32) made NaN.
#[test]
fn tiny_weights_average_exactly() {
    let mut ps = vec![SimPeer::node(); 2];
    ps[0].weight = 1e-46;
    ps[1].weight = 1e-46;
    let res = sim::run(
        &SimConfig::new(ps, 1),
        &[TensorDescriptor {
            shape: vec![100],
            dtype: DType::F32,
        }],
    )
    .unwrap();
    assert_eq!(res.finished(), 2);
    assert!(res.max_abs_err() < 1e-5);
}

/// B3: a slow reducer must be noticed by its senders' reducer timeouts (the simulated stall
/// used to leak the slow reducer's own bans as immediate aborts).
#[test]
fn slow_reducer_is_caught_by_reducer_timeout() {
    let mut ps = vec![SimPeer::node(); 5];
    ps[0].fault = Some(Fault::SlowReducing);
    let mut cfg = SimConfig::new(ps, 3);
    cfg.round.part_size_bytes = 1 << 16;
    let res = sim::run(
        &cfg,
        &[TensorDescriptor {
            shape: vec![1 << 20],
            dtype: DType::F32,
        }],
    )
    .unwrap();
    for p in 1..5 {
        let PeerStatus::Finished(at) = res.peers[p].status else {
            panic!("peer {p} unfinished")
        };
        assert!(
            at >= cfg.round.reducer_timeout,
            "peer {p} finished at {at:?}"
        );
        let r = &res.peers[p].outcome.as_ref().unwrap().report;
        assert!(r.failed_reducers.contains(0), "peer {p}: {r:?}");
        assert!(r.banned.is_empty(), "peer {p} banned {:?}", r.banned);
    }
    assert!(res.max_abs_err() < 1e-5);
}

/// R3: `Finished` only once every queued message was handed out.
#[test]
fn finished_only_after_the_outbox_drains() {
    let start = Instant::now();
    let members = vec![
        Member {
            mode: Mode::Aux,
            fraction: 1.0,
        },
        Member {
            mode: Mode::Node,
            fraction: 1.0,
        },
    ];
    let mut cfg = RoundConfig::new(members, 0);
    cfg.part_size_bytes = 64;
    let mut m = machine(cfg, start);
    for g in m.partition().span(0) {
        let len = m.partition().part(g).len;
        m.handle_message(start, 1, f32_part(g, &vec![0.5; len], 1.0))
            .unwrap();
        // Node 1 stays within its window: we hand its replies out as we go, except the last.
        if g + 1 < m.partition().span(0).end {
            while m.poll_transmit(start, |_| true).is_some() {}
        }
    }
    assert!(!m.is_finished(), "a reply is still queued");
    assert!(m.poll_transmit(start, |_| true).is_some());
    assert!(m.is_finished());
    assert!(std::iter::from_fn(|| m.poll_event()).any(|e| e == RoundEvent::Finished));
}

/// R4: a sender trickling parts just under `sender_timeout` cannot stretch a round past
/// `round_timeout`.
#[test]
fn round_timeout_bounds_a_trickling_sender() {
    let start = Instant::now();
    let mut cfg = node_config(3, 0);
    cfg.round_timeout = Some(Duration::from_millis(350));
    let mut m = machine(cfg, start);
    let span = m.partition().span(0);
    let mut now = start;
    for g in span.clone() {
        let len = m.partition().part(g).len;
        m.handle_message(now, 1, f32_part(g, &vec![0.5; len], 1.0))
            .unwrap();
        now += Duration::from_millis(99);
        m.handle_timeout(now);
        m.handle_message(now, 2, f32_part(g, &vec![0.5; len], 1.0))
            .unwrap();
        while m.poll_transmit(now, |_| true).is_some() {}
    }
    let bans = banned(&mut m);
    assert!(
        bans.iter()
            .any(|(p, r)| *p == 2 && *r == Violation::RoundTimeout),
        "{bans:?}"
    );
    finish(&mut m, now);
    assert!(m.outcome().unwrap().report.banned.contains(2));
}

/// R5: a node sender beyond its in-flight window is banned.
#[test]
fn node_beyond_its_window_is_banned() {
    let start = Instant::now();
    let mut cfg = node_config(3, 0);
    cfg.max_in_flight_parts = 4; // the cap reducers enforce (the default is 16)
    let mut m = machine(cfg, start);
    let span = m.partition().span(0);
    assert!(span.len() > 4);
    for g in span {
        let len = m.partition().part(g).len;
        m.handle_message(start, 1, f32_part(g, &vec![0.5; len], 1.0))
            .unwrap();
    }
    let bans = banned(&mut m);
    assert!(
        bans.iter()
            .any(|(p, r)| *p == 1 && *r == Violation::WindowExceeded(4)),
        "{bans:?}"
    );
}

/// R6: a sender may not change its weight mid-round.
#[test]
fn weight_changes_are_banned() {
    let start = Instant::now();
    let mut m = machine(node_config(3, 0), start);
    let span = m.partition().span(0);
    let len = m.partition().part(span.start).len;
    m.handle_message(start, 1, f32_part(span.start, &vec![0.5; len], 1.0))
        .unwrap();
    let len = m.partition().part(span.start + 1).len;
    m.handle_message(start, 1, f32_part(span.start + 1, &vec![0.5; len], 9.0))
        .unwrap();
    let bans = banned(&mut m);
    assert!(
        matches!(bans.as_slice(), [(1, Violation::WeightChanged { .. })]),
        "{bans:?}"
    );
}

/// Nit: an effectively infinite timeout must not overflow `Instant` arithmetic.
#[test]
fn huge_timeouts_do_not_panic() {
    let mut cfg = node_config(2, 0);
    cfg.sender_timeout = Duration::MAX / 2;
    cfg.reducer_timeout = Duration::MAX;
    cfg.round_timeout = Some(Duration::MAX);
    let m = machine(cfg, Instant::now());
    assert!(m.poll_timeout().is_none());
}

fn reply_parts(m: &mut Butterfly, now: Instant, to: usize) -> Vec<(usize, bool)> {
    let mut out = Vec::new();
    while let Some(t) = m.poll_transmit(now, |_| true) {
        if let hivemesh::allreduce::Message::Averaged(a) = &t.message
            && t.to == to
        {
            out.push((a.part as usize, !a.contributors.is_empty()));
        }
    }
    out
}

/// Session-4 review: a NaN found when a part completes bans its sender, and the ban completes
/// the parts that only waited for that sender. Those used to stay unanswered: the round
/// finished with them queued, the honest sender got no replies for them, and the queued
/// parts kept the round's tensors shared (a copy instead of a move at the end).
#[test]
fn parts_completed_by_a_nan_ban_are_still_answered() {
    let now = Instant::now();
    let mut cfg = node_config(3, 0);
    cfg.max_in_flight_parts = 16;
    // Without stand-ins: with them, we would stand in for both failed reducers (issue 32),
    // and their spans would keep the round open too.
    cfg.stand_ins = false;
    let mut m = machine(cfg, now);
    let span = m.partition().span(0);
    assert!(span.len() > 2);
    // Our own reducers are gone, so only our span keeps the round open.
    for r in [1, 2] {
        let abort = hivemesh::allreduce::Message::Abort {
            role: hivemesh::allreduce::Role::Reducer,
            reason: hivemesh::allreduce::AbortReason::Banned,
        };
        m.handle_message(now, r, abort).unwrap();
    }
    while m.poll_transmit(now, |_| true).is_some() {}
    for g in span.clone() {
        let len = m.partition().part(g).len;
        m.handle_message(now, 1, f32_part(g, &vec![0.5; len], 1.0))
            .unwrap();
    }
    let len = m.partition().part(span.start).len;
    m.handle_message(now, 2, f32_part(span.start, &vec![f32::NAN; len], 1.0))
        .unwrap();
    let replies = reply_parts(&mut m, now, 1);
    assert_eq!(
        replies,
        span.clone().map(|g| (g, true)).collect::<Vec<_>>(),
        "every part answered with an average"
    );
    assert!(m.is_finished());
    let bans = banned(&mut m);
    assert!(bans.iter().any(|(p, _)| *p == 2), "{bans:?}");
    for g in span.clone() {
        let named = m.outcome().unwrap().report.contributors(g).cloned();
        assert_eq!(
            named,
            Some(hivemesh::allreduce::PeerSet::from_indices([0, 1]))
        );
    }
    let before = m.tensors().as_ptr();
    let (tensors, _) = m.into_outcome().unwrap();
    assert_eq!(
        tensors.as_ptr(),
        before,
        "the tensors are moved out, not copied"
    );
}

/// Session-4 review: a NaN in a sender's last part is found only after its link is done. It
/// used to go unreported and unanswered (the sender waited out its reducer timeout); now it is
/// named as banned and told that the part has no average for it.
#[test]
fn a_nan_in_the_last_part_is_reported_and_answered() {
    let now = Instant::now();
    let mut m = machine(node_config(3, 0), now);
    let span = m.partition().span(0);
    let mut to_bad = Vec::new();
    for g in span.clone() {
        let len = m.partition().part(g).len;
        let v = if g + 1 == span.end {
            vec![f32::NAN; len]
        } else {
            vec![1.5; len]
        };
        m.handle_message(now, 1, f32_part(g, &vec![0.5; len], 1.0))
            .unwrap();
        m.handle_message(now, 2, f32_part(g, &v, 1.0)).unwrap();
        to_bad.extend(reply_parts(&mut m, now, 2));
    }
    let last = span.end - 1;
    assert_eq!(to_bad.last(), Some(&(last, false)), "{to_bad:?}");
    assert!(to_bad[..to_bad.len() - 1].iter().all(|&(_, avg)| avg));
    let bans = banned(&mut m);
    assert!(bans.iter().any(|(p, _)| *p == 2), "{bans:?}");
}
