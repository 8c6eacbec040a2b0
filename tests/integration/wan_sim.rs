//! WAN efficiency (issue 32) in the deterministic simulator and by hand: windows sized to the
//! link, clients' averages not held behind their own sends, adaptive deadlines.

use crate::common;

use std::time::{Duration, Instant};

use hivemesh::allreduce::deadline::expected_gap;
use hivemesh::allreduce::{
    AdaptiveTimeouts, LinkRates, Member, Message, Mode, RoundConfig, RoundEvent, TensorDescriptor,
};
use hivemesh::compression::{Compression, CompressionType};
use hivemesh::sim::{self, Fault, PeerStatus, SimConfig, SimPeer, SimResult};
use hivemesh::tensor::DType;

fn desc(n: usize) -> TensorDescriptor {
    TensorDescriptor {
        shape: vec![n],
        dtype: DType::F32,
    }
}

/// Every peer in `finished` finished, banned and failed nobody, and holds the mean of all
/// `n` peers in every part.
fn assert_all_averaged(res: &SimResult, n: usize, finished: &[usize]) {
    let checks = res.check();
    for &p in finished {
        let PeerStatus::Finished(_) = res.peers[p].status else {
            panic!("peer {p} did not finish: {:?}", res.peers[p].status);
        };
        let report = &res.peers[p].outcome.as_ref().unwrap().report;
        assert!(
            report.banned.is_empty(),
            "peer {p} banned {:?}",
            report.banned
        );
        assert!(
            report.failed_reducers.is_empty(),
            "peer {p} failed {:?}",
            report.failed_reducers
        );
        for g in 0..res.partition.num_parts() {
            let c = report.contributors(g).expect("averaged");
            assert_eq!(c.len(), n, "peer {p} part {g}");
        }
        let c = checks[p].as_ref().unwrap();
        assert!(c.max_abs_err < 1e-5, "peer {p}: {c:?}");
    }
}

/// A reducer answers a client's part as soon as the part completes, while the client still
/// has parts to send (hivemind, and this code before issue 32, held every reply until the
/// client had sent its whole span).
#[test]
fn a_client_gets_each_average_before_it_has_sent_everything() {
    let now = Instant::now();
    let members = vec![
        Member {
            mode: Mode::Node,
            fraction: 1.0,
        },
        Member {
            mode: Mode::Client,
            fraction: 0.0,
        },
    ];
    let mut cfg = RoundConfig::new(members, 0);
    cfg.part_size_bytes = 64;
    let mut m = common::machine(cfg, now);
    let span = m.partition().span(0);
    assert!(span.len() > 2);
    let len = m.partition().part(span.start).len;
    m.handle_message(now, 1, common::f32_part(span.start, &vec![1.0; len], 1.0))
        .unwrap();
    let t = m
        .poll_transmit(now, |_| true)
        .expect("the average of the client's first part goes out at once");
    assert_eq!(t.to, 1);
    let Message::Averaged(avg) = t.message else {
        panic!("expected an average, got {:?}", t.message);
    };
    assert_eq!(avg.part as usize, span.start);
    assert_eq!(avg.contributors.len(), 2);
}

/// On a long fat link (100 Mbit/s, 200 ms one way) a window of 4 small parts leaves the line
/// idle; grown to the measured bandwidth-delay product the same round takes less than 70 %
/// of the time (virtual), with every part averaged over all four peers.
#[test]
fn windows_grow_to_the_bandwidth_delay_product() {
    let run = |cap: usize| {
        let mut cfg = SimConfig::new(vec![SimPeer::node(); 4], 7);
        cfg.latency = Duration::from_millis(200);
        cfg.jitter = Duration::ZERO;
        cfg.bandwidth = 12.5e6;
        cfg.round.part_size_bytes = 32 << 10;
        cfg.round.compression = Compression::Fixed(CompressionType::None);
        cfg.round.sender_timeout = Duration::from_secs(5);
        cfg.round.reducer_timeout = Duration::from_secs(10);
        cfg.round.initial_in_flight_parts = 4;
        cfg.round.max_in_flight_parts = cap;
        let res = sim::run(&cfg, &[desc(1 << 20)]).unwrap();
        assert_all_averaged(&res, 4, &[0, 1, 2, 3]);
        // The round's time: the last peer's finish (later events are stale timers).
        res.peers
            .iter()
            .filter_map(|p| match p.status {
                PeerStatus::Finished(at) => Some(at),
                _ => None,
            })
            .max()
            .unwrap()
    };
    let fixed = run(4);
    let grown = run(64);
    assert!(
        grown.as_secs_f64() < 0.7 * fixed.as_secs_f64(),
        "grown {grown:?} vs fixed {fixed:?}"
    );
}

/// 4 nodes on 1 MB/s uplinks, one of them 4x slower (its parts come every ~1.6 s, far past
/// the fixed 0.5 s sender timeout). With adaptive timeouts from the declared rates every peer
/// finishes and every part is averaged over all four: the slow but steady peer is not banned.
#[test]
fn a_slow_steady_peer_is_not_banned() {
    let mut cfg = SimConfig::new(vec![SimPeer::node(); 4], 11);
    cfg.bandwidth = 1e6;
    cfg.peer_bandwidth = vec![1e6, 1e6, 1e6, 0.25e6];
    cfg.uplink_buffer_bytes = 128 << 10;
    cfg.round.part_size_bytes = 64 << 10;
    cfg.round.compression = Compression::Fixed(CompressionType::None);
    cfg.round.rates = cfg
        .peer_bandwidth
        .iter()
        .map(|&up| LinkRates { up, down: 0.0 })
        .collect();
    cfg.round.adaptive_timeouts = Some(AdaptiveTimeouts {
        min: Duration::from_millis(100),
        max: Duration::from_secs(60),
        factor: 3.0,
    });
    let res = sim::run(&cfg, &[desc(1 << 18)]).unwrap();
    assert_all_averaged(&res, 4, &[0, 1, 2, 3]);
}

/// A silent peer (never starts) is banned by every other peer within its adaptive bound: the
/// expected gap of its parts from the declared rates, times the factor, clamped to the
/// bounds (here the 50 ms minimum, a tenth of the fixed 0.5 s timeout). The others finish
/// with every part averaged over the three of them.
#[test]
fn a_silent_peer_is_dropped_within_its_bound() {
    let mut cfg = SimConfig::new(vec![SimPeer::node(); 4], 12);
    cfg.peers[3].fault = Some(Fault::FailBefore);
    cfg.round.part_size_bytes = 64 << 10;
    cfg.round.compression = Compression::Fixed(CompressionType::None);
    cfg.round.rates = vec![
        LinkRates {
            up: cfg.bandwidth,
            down: 0.0,
        };
        4
    ];
    let bounds = AdaptiveTimeouts {
        min: Duration::from_millis(50),
        max: Duration::from_secs(60),
        factor: 3.0,
    };
    cfg.round.adaptive_timeouts = Some(bounds);
    // Peer 3 sends to 3 reducers and answers 3 senders: 6 parts per step on its uplink.
    let gap = expected_gap(cfg.round.part_size_bytes, Some(cfg.bandwidth), 6, None, 3).unwrap();
    let bound = bounds.timeout(gap);
    assert!(bound < cfg.round.sender_timeout);
    let res = sim::run(&cfg, &[desc(1 << 16)]).unwrap();
    for p in 0..3 {
        let PeerStatus::Finished(_) = res.peers[p].status else {
            panic!("peer {p} did not finish: {:?}", res.peers[p].status);
        };
        let banned_at = res.peers[p]
            .events
            .iter()
            .find_map(|(at, ev)| matches!(ev, RoundEvent::Banned { peer: 3, .. }).then_some(*at))
            .unwrap_or_else(|| panic!("peer {p} never banned the silent peer"));
        assert!(
            banned_at <= bound,
            "peer {p} banned it at {banned_at:?} > {bound:?}"
        );
        let report = &res.peers[p].outcome.as_ref().unwrap().report;
        for g in res.partition.span(p) {
            assert_eq!(
                report.contributors(g).unwrap().len(),
                3,
                "peer {p} part {g}"
            );
        }
    }
    let checks = res.check();
    for c in checks.iter().take(3) {
        assert!(c.as_ref().unwrap().max_abs_err < 1e-5);
    }
}
