//! The monitor's state in virtual time: records in, snapshots out.

use std::time::Duration;

use libp2p::PeerId;

use super::*;
use crate::train::{
    LocalProgress, MetricsRecord, ModeClaim, PeerMetrics, ProgressRecord, ReachClaim,
};

const T0: f64 = 1_700_000_000.0;

fn progress(epoch: u64, samples: u64, rate: f64, time: f64) -> Vec<u8> {
    ProgressRecord::Progress(LocalProgress {
        epoch,
        samples_accumulated: samples,
        samples_per_second: rate,
        time,
        client_mode: false,
    })
    .encode()
}

fn metrics(epoch: u64, time: f64, ok: u32, name: &str) -> Vec<u8> {
    MetricsRecord::Metrics(PeerMetrics {
        epoch,
        samples_per_second: 10.0,
        loss: Some(2.0 + epoch as f64),
        time,
        target_batch_size: 100,
        rounds_ok: ok,
        rounds_failed: 1,
        last_group_size: 4,
        reach: ReachClaim::HolePunched,
        mode: ModeClaim::Node,
        name: name.into(),
    })
    .encode()
    .unwrap()
}

fn state(config: MonitorConfig) -> MonitorState {
    MonitorState::new(config, PeerId::random(), T0).unwrap()
}

type Entries = Vec<(PeerId, Vec<u8>, f64)>;

fn apply(s: &mut MonitorState, p: &Entries, m: &Entries, now: f64) -> ApplySummary {
    s.apply(
        p.iter().map(|(id, b, e)| (*id, &b[..], *e)),
        m.iter().map(|(id, b, e)| (*id, &b[..], *e)),
        now,
    )
}

#[test]
fn the_snapshot_shows_the_swarm_as_its_records_say() {
    let mut s = state(MonitorConfig::default());
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let p: Entries = peers
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, progress(2, 10, 10.0 * (i + 1) as f64, T0), T0 + 60.0))
        .collect();
    let m: Entries = vec![(
        peers[0],
        metrics(2, T0, 5, "<script>alert(1)</script>"),
        T0 + 60.0,
    )];
    let summary = apply(&mut s, &p, &m, T0 + 1.0);
    assert_eq!(summary.progress.accepted, 3);
    assert_eq!(summary.metrics_accepted, 1);
    let snap = s.snapshot("run", T0 + 1.0);
    assert_eq!(snap.global.epoch, 2);
    assert_eq!(snap.global.num_peers, 3);
    assert_eq!(snap.global.target_batch_size, Some(100), "from the metrics");
    assert!(snap.global.eta_seconds.is_some());
    assert_eq!(snap.global.samples_per_second, 60.0);
    assert_eq!(snap.peers.len(), 3);
    // Fastest first; shares add up.
    assert_eq!(snap.peers[0].peer_id, peers[2].to_base58());
    let shares: f64 = snap.peers.iter().map(|p| p.share).sum();
    assert!((shares - 1.0).abs() < 1e-9);
    let first = snap
        .peers
        .iter()
        .find(|v| v.peer_id == peers[0].to_base58())
        .unwrap();
    assert_eq!(first.name, "<script>alert(1)</script>", "kept as text");
    assert_eq!(first.reach, "hole-punched");
    assert_eq!(first.loss, Some(4.0));
    assert_eq!(first.short_id.len(), 8);
    assert_eq!(snap.history.len(), 1);
    assert_eq!(snap.history[0].loss, Some(4.0));
    assert_eq!(snap.history[0].group_size, Some(4.0));
}

#[test]
fn peers_that_leave_are_shown_as_gone_then_dropped() {
    let config = MonitorConfig {
        gone_retention: Duration::from_secs(30),
        ..MonitorConfig::default()
    };
    let mut s = state(config);
    let (a, b) = (PeerId::random(), PeerId::random());
    let both: Entries = vec![
        (a, progress(0, 1, 1.0, T0), T0 + 60.0),
        (b, progress(0, 1, 1.0, T0), T0 + 60.0),
    ];
    apply(&mut s, &both, &vec![], T0);
    // b withdraws.
    let left: Entries = vec![
        (a, progress(0, 2, 1.0, T0 + 2.0), T0 + 62.0),
        (b, ProgressRecord::Withdrawn.encode(), T0 + 70.0),
    ];
    apply(&mut s, &left, &vec![], T0 + 2.0);
    let snap = s.snapshot("run", T0 + 2.0);
    assert_eq!(snap.global.num_peers, 1);
    assert_eq!(snap.peers.len(), 2);
    let gone = &snap.peers[1];
    assert_eq!(gone.peer_id, b.to_base58());
    assert_eq!((gone.status, gone.gone_since), ("gone", Some(T0 + 2.0)));
    assert_eq!(gone.samples_per_second, 0.0);
    assert_eq!(snap.peers[0].status, "live");
    // Kept for the retention, then dropped.
    let later: Entries = vec![(a, progress(0, 3, 1.0, T0 + 30.0), T0 + 90.0)];
    apply(&mut s, &later, &vec![], T0 + 32.0);
    assert_eq!(s.table_len(), 2);
    apply(&mut s, &later, &vec![], T0 + 32.5);
    assert_eq!(s.table_len(), 1);
    // A record past its lifetime counts as gone too, and one coming back is live again.
    apply(&mut s, &later, &vec![], T0 + 200.0);
    assert_eq!(s.snapshot("run", T0 + 200.0).peers[0].status, "gone");
    let back: Entries = vec![(a, progress(1, 0, 1.0, T0 + 201.0), T0 + 261.0)];
    apply(&mut s, &back, &vec![], T0 + 201.0);
    let snap = s.snapshot("run", T0 + 201.0);
    assert_eq!(
        (snap.peers[0].status, snap.peers[0].gone_since),
        ("live", None)
    );
}

#[test]
fn the_history_is_a_bounded_window() {
    let config = MonitorConfig {
        history_len: 5,
        ..MonitorConfig::default()
    };
    let mut s = state(config);
    let a = PeerId::random();
    for i in 0..20u32 {
        let t = T0 + f64::from(i);
        let m: Entries = vec![(a, metrics(u64::from(i), t, 10 + i, "a"), t + 60.0)];
        apply(
            &mut s,
            &vec![(a, progress(u64::from(i), 0, 1.0, t), t + 60.0)],
            &m,
            t,
        );
        assert!(s.history_len() <= 5);
    }
    let snap = s.snapshot("run", T0 + 19.0);
    let times: Vec<f64> = snap.history.iter().map(|p| p.time).collect();
    assert_eq!(
        times,
        (15..20).map(|i| T0 + f64::from(i)).collect::<Vec<_>>()
    );
    assert_eq!(snap.history.last().unwrap().epoch, 19);
    // One round per fetch (the counter grows by one), the first sight of a peer adds none.
    assert!(snap.history.iter().all(|p| p.rounds_ok == 1));
    assert_eq!(snap.global.rounds_ok, 5, "summed over the window");
}

#[test]
fn the_table_is_bounded_and_never_evicts_live_peers_for_newcomers() {
    let config = MonitorConfig {
        max_peers: 4,
        ..MonitorConfig::default()
    };
    let mut s = state(config);
    let first: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
    let entries = |ids: &[PeerId], t: f64| -> Entries {
        ids.iter()
            .map(|id| (*id, progress(0, 1, 1.0, t), t + 60.0))
            .collect()
    };
    apply(&mut s, &entries(&first, T0), &vec![], T0);
    // A flood of newcomers: the table keeps the four, counts the others.
    let flood: Vec<PeerId> = (0..100).map(|_| PeerId::random()).collect();
    let all: Vec<PeerId> = first.iter().chain(&flood).copied().collect();
    apply(&mut s, &entries(&all, T0 + 1.0), &vec![], T0 + 1.0);
    let snap = s.snapshot("run", T0 + 1.0);
    assert_eq!(s.table_len(), 4);
    assert_eq!(snap.untracked_peers, 100);
    let mut shown: Vec<String> = snap.peers.iter().map(|p| p.peer_id.clone()).collect();
    let mut want: Vec<String> = first.iter().map(|p| p.to_base58()).collect();
    shown.sort();
    want.sort();
    assert_eq!(shown, want);
    // Two of the first leave: newcomers take their rows once they are gone (the gone rows
    // make room, oldest first).
    apply(&mut s, &entries(&first[..2], T0 + 2.0), &vec![], T0 + 2.0);
    let newcomers = [flood[0], flood[1], flood[2]];
    let mixed: Vec<PeerId> = first[..2].iter().chain(&newcomers).copied().collect();
    apply(&mut s, &entries(&mixed, T0 + 3.0), &vec![], T0 + 3.0);
    assert_eq!(s.table_len(), 4);
    assert_eq!(s.snapshot("run", T0 + 3.0).untracked_peers, 1);
}

#[test]
fn hostile_records_are_rejected_with_typed_errors_and_counted() {
    let mut s = state(MonitorConfig::default());
    let (a, b, c, d) = (
        PeerId::random(),
        PeerId::random(),
        PeerId::random(),
        PeerId::random(),
    );
    let mut nan_loss = metrics(0, T0, 0, "x");
    nan_loss[17..25].copy_from_slice(&f64::NAN.to_be_bytes());
    let m: Entries = vec![
        (a, nan_loss, T0 + 60.0),
        (b, metrics(0, T0 + 3600.0, 0, "future"), T0 + 60.0),
        (c, vec![1, 2, 3], T0 + 60.0),
    ];
    let p: Entries = vec![(d, progress(0, 1, f64::INFINITY, T0), T0 + 60.0)];
    let summary = apply(&mut s, &p, &m, T0);
    let errors: Vec<String> = summary
        .metrics_rejected
        .iter()
        .map(|(_, e)| format!("{e:?}"))
        .collect();
    assert_eq!(summary.metrics_rejected.len(), 3, "{errors:?}");
    assert!(errors.iter().any(|e| e.starts_with("BadLoss")));
    assert!(errors.iter().any(|e| e.starts_with("FromTheFuture")));
    assert!(errors.iter().any(|e| e.starts_with("Length")));
    assert_eq!(summary.progress.rejected.len(), 1);
    let snap = s.snapshot("run", T0);
    assert_eq!(snap.rejected_records, 4);
    assert!(snap.peers.is_empty());
    assert_eq!(
        snap.global.eta_seconds, None,
        "no target known, nobody trains"
    );
}

#[test]
fn one_peer_cannot_move_the_target_and_a_flag_fixes_it() {
    let mut s = state(MonitorConfig::default());
    let ids: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let with_target = |target: u64| {
        MetricsRecord::Metrics(PeerMetrics {
            target_batch_size: target,
            time: T0,
            ..PeerMetrics::default()
        })
        .encode()
        .unwrap()
    };
    let m: Entries = vec![
        (ids[0], with_target(100), T0 + 60.0),
        (ids[1], with_target(100), T0 + 60.0),
        (ids[2], with_target(u64::MAX - 1), T0 + 60.0),
    ];
    apply(&mut s, &vec![], &m, T0);
    assert_eq!(s.snapshot("run", T0).global.target_batch_size, Some(100));
    let mut fixed = state(MonitorConfig {
        target_batch_size: Some(7),
        ..MonitorConfig::default()
    });
    apply(&mut fixed, &vec![], &m, T0);
    assert_eq!(fixed.snapshot("run", T0).global.target_batch_size, Some(7));
}

#[test]
fn bad_configs_are_refused() {
    for config in [
        MonitorConfig {
            max_peers: 0,
            ..MonitorConfig::default()
        },
        MonitorConfig {
            history_len: 0,
            ..MonitorConfig::default()
        },
        MonitorConfig {
            target_batch_size: Some(0),
            ..MonitorConfig::default()
        },
        MonitorConfig {
            refresh_period: Duration::ZERO,
            ..MonitorConfig::default()
        },
    ] {
        assert!(MonitorState::new(config, PeerId::random(), T0).is_err());
    }
}

#[test]
fn the_snapshot_serializes_to_json_with_nulls_for_unknowns() {
    let s = state(MonitorConfig::default());
    let json = serde_json::to_value(s.snapshot("r<b>", T0)).unwrap();
    assert_eq!(json["run_id"], "r<b>");
    assert_eq!(json["global"]["eta_seconds"], serde_json::Value::Null);
    assert_eq!(json["global"]["loss"], serde_json::Value::Null);
    assert_eq!(json["peers"], serde_json::json!([]));
}

#[test]
fn a_stale_replica_neither_undoes_a_withdrawal_nor_moves_a_peer_back() {
    let mut s = state(MonitorConfig::default());
    let a = PeerId::random();
    let old: Entries = vec![(a, progress(0, 1, 1.0, T0), T0 + 60.0)];
    let new: Entries = vec![(a, progress(3, 1, 1.0, T0 + 5.0), T0 + 65.0)];
    apply(&mut s, &old, &vec![], T0);
    apply(&mut s, &new, &vec![], T0 + 5.0);
    // A replica that missed the latest write answers the older record: ignored.
    apply(&mut s, &old, &vec![], T0 + 6.0);
    assert_eq!(s.snapshot("run", T0 + 6.0).peers[0].epoch, Some(3));
    // The peer withdraws; an older record from a stale replica does not bring it back.
    let withdrawn: Entries = vec![(a, ProgressRecord::Withdrawn.encode(), T0 + 70.0)];
    apply(&mut s, &withdrawn, &vec![], T0 + 7.0);
    apply(&mut s, &new, &vec![], T0 + 8.0);
    let snap = s.snapshot("run", T0 + 8.0);
    assert_eq!((snap.peers[0].status, snap.global.num_peers), ("gone", 0));
}
