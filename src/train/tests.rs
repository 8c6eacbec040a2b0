//! The progress core in virtual time: every `now` below is made up.

use std::time::Duration;

use libp2p::PeerId;
use libp2p::identity::Keypair;
use rand::{RngExt, SeedableRng};

use super::*;

const T0: f64 = 1_000_000.0;
const TARGET: u64 = 100;

fn peer() -> PeerId {
    Keypair::generate_ed25519().public().to_peer_id()
}

fn config() -> ProgressConfig {
    ProgressConfig::new(TARGET)
}

fn core() -> ProgressCore {
    ProgressCore::new(config(), peer(), T0).unwrap()
}

/// A progress record's bytes.
fn rec(epoch: u64, samples: u64, rate: f64, time: f64, client_mode: bool) -> Vec<u8> {
    ProgressRecord::Progress(LocalProgress {
        epoch,
        samples_accumulated: samples,
        samples_per_second: rate,
        time,
        client_mode,
    })
    .encode()
}

/// A fetch of `records` (each expiring a minute after `now`) at `now`.
fn fetch(core: &mut ProgressCore, records: &[(PeerId, Vec<u8>)], now: f64) -> FetchSummary {
    core.apply_fetch(records.iter().map(|(p, b)| (*p, &b[..], now + 60.0)), now)
}

/// Three peers at `epoch` with `samples` each, reporting 10 samples/s at `now`.
fn trio(peers: &[PeerId; 3], epoch: u64, samples: u64, now: f64) -> Vec<(PeerId, Vec<u8>)> {
    peers
        .iter()
        .map(|p| (*p, rec(epoch, samples, 10.0, now, false)))
        .collect()
}

#[test]
fn epoch_ends_by_target() {
    let mut c = core();
    let others = [peer(), peer(), peer()];
    let now = T0 + 5.0;
    let s = fetch(&mut c, &trio(&others, 0, 30, now), now);
    assert_eq!((s.accepted, s.rejected.len()), (3, 0));
    let g = c.global_progress();
    assert_eq!((g.epoch, g.samples_accumulated, g.num_peers), (0, 90, 3));
    assert!(!c.ready_to_update_epoch(now), "90 of 100 samples: {g:?}");
    // This peer's own samples count at once, before the next fetch.
    c.report_local_progress(0, 10, true, now);
    assert_eq!(c.global_progress().samples_accumulated, 100);
    assert!(c.ready_to_update_epoch(now));
    assert_eq!(c.estimated_next_update_time(now), now);
    assert_eq!(c.update_epoch(None, now), 1);
    let g = c.global_progress();
    assert_eq!((g.epoch, g.samples_accumulated), (1, 0));
    assert!(g.eta_next_epoch.is_infinite() && !c.ready_to_update_epoch(now + 100.0));
}

#[test]
fn epoch_ends_by_eta() {
    let mut c = core();
    let others = [peer(), peer(), peer()];
    let now = T0 + 5.0;
    // 3 × 10 = 30 samples reported at 30 samples/s: the 70 missing take 7/3 s.
    fetch(&mut c, &trio(&others, 0, 10, now), now);
    let g = c.global_progress();
    assert!(
        (g.eta_next_epoch - (now + 70.0 / 30.0)).abs() < 1e-6,
        "{g:?}"
    );
    assert!(!c.ready_to_update_epoch(now + 2.0));
    assert!(c.ready_to_update_epoch(now + 2.5), "the ETA passed");
    // Extrapolation: a fetch two seconds later of the same reports puts the ETA at the same
    // time.
    fetch(&mut c, &trio(&others, 0, 10, now), now + 2.0);
    let g = c.global_progress();
    assert!(
        (g.eta_next_epoch - (now + 70.0 / 30.0)).abs() < 1e-6,
        "{g:?}"
    );
}

#[test]
fn epoch_ends_when_peers_are_ahead() {
    let now = T0 + 5.0;
    // Two other peers agree on epoch 3: a newcomer at 0 adopts it.
    let mut c = core();
    let (a, b, x) = (peer(), peer(), peer());
    let records = [
        (a, rec(3, 0, 10.0, now, false)),
        (b, rec(3, 5, 10.0, now, false)),
        (x, rec(0, 5, 10.0, now, false)),
    ];
    fetch(&mut c, &records, now);
    assert_eq!(c.global_progress().epoch, 3);
    assert!(c.ready_to_update_epoch(now));
    assert_eq!(
        c.global_progress().samples_accumulated,
        5,
        "only peers at epoch 3 count"
    );

    // A lone other peer (a swarm of two) is believed.
    let mut c = core();
    fetch(&mut c, &[(a, rec(7, 0, 10.0, now, false))], now);
    assert_eq!(c.global_progress().epoch, 7);

    // One peer alone ahead of three: followed once half the target is in, counting what
    // the leader had before it moved on.
    let mut c = core();
    let trio_peers = [a, b, x];
    fetch(&mut c, &trio(&trio_peers, 0, 20, now), now);
    assert_eq!(c.global_progress().epoch, 0);
    let mut moved = trio(&trio_peers, 0, 20, now);
    moved[0].1 = rec(1, 0, 10.0, now, false);
    fetch(&mut c, &moved, now);
    assert_eq!(
        c.global_progress().epoch,
        1,
        "60 of 100 samples, a peer ahead"
    );
    assert!(c.ready_to_update_epoch(now));

    let mut c = core();
    let mut early = trio(&trio_peers, 0, 10, now);
    early[0].1 = rec(1, 0, 10.0, now, false);
    fetch(&mut c, &early, now);
    assert_eq!(
        c.global_progress().epoch,
        0,
        "20 of 100 samples: the leader waits"
    );
    assert!(!c.ready_to_update_epoch(now));
}

#[test]
fn clients_do_not_move_the_global_epoch() {
    let mut c = core();
    let now = T0 + 5.0;
    let records = [
        (peer(), rec(9, 0, 10.0, now, true)),
        (peer(), rec(9, 0, 10.0, now, true)),
        (peer(), rec(0, 20, 10.0, now, true)),
        (peer(), rec(0, 30, 10.0, now, false)),
    ];
    fetch(&mut c, &records, now);
    let g = c.global_progress();
    assert_eq!((g.epoch, g.num_peers, g.num_clients), (0, 4, 3));
    assert_eq!(g.samples_accumulated, 50, "a client's samples count");
    // A client tracker's own epoch does not count for others either: it is flagged.
    let mut cfg = config();
    cfg.client_mode = true;
    let mut client = ProgressCore::new(cfg, peer(), T0).unwrap();
    client.report_local_progress(0, 4, true, now);
    let (bytes, _) = client.publish_due(now).unwrap();
    let Ok(ProgressRecord::Progress(p)) = ProgressRecord::decode(&bytes) else {
        panic!("undecodable");
    };
    assert!(p.client_mode);
}

#[test]
fn hostile_counts_and_rates_are_bounded() {
    let mut c = core();
    let honest = [peer(), peer(), peer()];
    let now = T0 + 1.0;
    let mut records = trio(&honest, 0, 5, now);
    let liar = peer();
    records.push((liar, rec(0, u64::MAX, 1e12, now, false)));
    fetch(&mut c, &records, now);
    let g = c.global_progress();
    // The liar's rate counts at most 10 × 10/s, its samples at most 100/s × (1 s + 10 s).
    assert!(
        g.samples_accumulated <= 15 + 1100 && g.samples_accumulated > 15,
        "{g:?}"
    );
    let mut big = config();
    big.target_batch_size = 100_000;
    let mut c = ProgressCore::new(big, peer(), T0).unwrap();
    fetch(&mut c, &records, now);
    let g = c.global_progress();
    assert!(!c.ready_to_update_epoch(now), "{g:?}");
    // 100 000 samples at no more than 130 samples/s: well over ten minutes away.
    assert!(g.eta_next_epoch > now + 600.0, "{g:?}");
    // Its share grows with time as an honest fast peer's would, no faster.
    fetch(&mut c, &records, now + 100.0);
    let g = c.global_progress();
    assert!(g.samples_accumulated <= 15 + 100 * 111, "{g:?}");
}

#[test]
fn a_hostile_epoch_moves_the_swarm_one_epoch_at_half_the_target_at_most() {
    let mut c = core();
    let honest = [peer(), peer(), peer()];
    let liar = peer();
    let mut now = T0 + 1.0;
    let with_liar = |mut r: Vec<(PeerId, Vec<u8>)>, now| {
        r.push((liar, rec(u64::MAX, 0, 10.0, now, false)));
        r
    };
    fetch(&mut c, &with_liar(trio(&honest, 0, 5, now), now), now);
    assert_eq!(c.global_progress().epoch, 0);
    assert!(!c.ready_to_update_epoch(now));
    now += 1.0;
    fetch(&mut c, &with_liar(trio(&honest, 0, 17, now), now), now);
    assert_eq!(
        c.global_progress().epoch,
        1,
        "51 samples: follow, one epoch"
    );
    assert_eq!(c.update_epoch(None, now), 1);
    now += 1.0;
    fetch(&mut c, &with_liar(trio(&honest, 1, 10, now), now), now);
    assert_eq!(
        c.global_progress().epoch,
        1,
        "30 samples into epoch 1: stay"
    );
    assert!(!c.ready_to_update_epoch(now));
}

#[test]
fn malformed_records_are_rejected_with_typed_errors() {
    let mut c = core();
    let now = T0 + 1.0;
    let mut flags = rec(0, 1, 1.0, now, false);
    flags[33] = 0x82;
    let cases = [
        (Vec::new(), RecordError::Empty),
        (vec![7], RecordError::UnknownTag(7)),
        (
            vec![1, 0, 0],
            RecordError::Length {
                len: 3,
                expected: PROGRESS_RECORD_BYTES,
            },
        ),
        (
            vec![0, 0],
            RecordError::Length {
                len: 2,
                expected: 1,
            },
        ),
        (flags, RecordError::UnknownFlags(0x82)),
    ];
    for (bytes, want) in cases {
        assert_eq!(ProgressRecord::decode(&bytes), Err(want));
    }
    let bad = [
        rec(0, 1, f64::NAN, now, false),
        rec(0, 1, f64::INFINITY, now, false),
        rec(0, 1, -1.0, now, false),
        rec(0, 1, 1.0, f64::NAN, false),
        rec(0, 1, 1.0, now + 3600.0, false),
    ];
    let records: Vec<_> = bad.iter().map(|b| (peer(), b.clone())).collect();
    let s = fetch(&mut c, &records, now);
    assert_eq!((s.accepted, s.rejected.len()), (0, 5));
    assert!(matches!(s.rejected[4].1, RecordError::FromTheFuture { .. }));
    assert_eq!(c.global_progress().num_peers, 0);
    // Arbitrary bytes never panic.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for len in 0..64 {
        for _ in 0..200 {
            let mut b: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if len > 0 && rng.random_bool(0.5) {
                b[0] = 1;
            }
            let _ = ProgressRecord::decode(&b);
        }
    }
    // A withdrawn peer is not counted.
    let s = fetch(&mut c, &[(peer(), ProgressRecord::Withdrawn.encode())], now);
    assert_eq!((s.withdrawn, c.global_progress().num_peers), (1, 0));
}

#[test]
fn records_expire() {
    let mut c = core();
    let now = T0 + 1.0;
    let (a, b) = (peer(), peer());
    let ra = rec(0, 10, 1.0, now, false);
    let rb = rec(0, 10, 1.0, now, false);
    let entries = [(a, &ra[..], now + 60.0), (b, &rb[..], now - 1.0)];
    let s = c.apply_fetch(entries, now);
    assert_eq!((s.accepted, s.expired), (1, 1));
    assert_eq!(c.global_progress().num_peers, 1);
    c.recompute(now + 61.0);
    assert_eq!(c.global_progress().num_peers, 0, "its entry expired");
    // A far expiration does not keep an old report alive past metadata_expiration + skew.
    let lifetime = 60.0 + ProgressLimits::default().max_clock_skew.as_secs_f64();
    let entries = [(a, &ra[..], now + 3600.0)];
    c.apply_fetch(entries, now + 30.0);
    assert_eq!(c.global_progress().num_peers, 1);
    c.recompute(now + lifetime + 1.0);
    assert_eq!(c.global_progress().num_peers, 0, "its report is too old");
}

#[test]
fn fetches_come_faster_as_the_epoch_end_nears() {
    let mut c = core();
    let cfg = config();
    let (min, max) = (
        cfg.min_refresh_period.as_secs_f64(),
        cfg.max_refresh_period.as_secs_f64(),
    );
    let now = T0 + 10.0;
    let default = c.global_progress().next_fetch_time - T0;
    assert_eq!(
        default,
        cfg.default_refresh_period.as_secs_f64(),
        "nobody reports"
    );
    let others = [peer(), peer(), peer()];
    let slow: Vec<_> = others
        .iter()
        .map(|p| (*p, rec(0, 0, 0.5, now, false)))
        .collect();
    fetch(&mut c, &slow, now);
    assert_eq!(
        c.global_progress().next_fetch_time - now,
        max,
        "far from the end"
    );
    let mut last = f64::INFINITY;
    for samples in [10, 20, 25, 30, 32] {
        let records: Vec<_> = others
            .iter()
            .map(|p| (*p, rec(0, samples, 2.0, now, false)))
            .collect();
        fetch(&mut c, &records, now);
        let wait = c.global_progress().next_fetch_time - now;
        assert!(
            wait <= last && (min..=max).contains(&wait),
            "{samples}: {wait}"
        );
        last = wait;
    }
    assert_eq!(last, min, "at the end");
    // 3 peers, drift of 3 peers: the wait is half the ETA in between.
    let records: Vec<_> = others
        .iter()
        .map(|p| (*p, rec(0, 20, 2.0, now, false)))
        .collect();
    fetch(&mut c, &records, now);
    let eta = c.global_progress().eta_next_epoch - now;
    let wait = c.global_progress().next_fetch_time - now;
    assert!((wait - eta * 3.0 / 6.0).abs() < 1e-9, "{wait} {eta}");
}

#[test]
fn publications_follow_reports_and_expirations_only_grow() {
    let mut c = core();
    let mut now = T0;
    assert_eq!(
        c.publish_due(now),
        None,
        "nothing reported: a monitor does not publish"
    );
    assert_eq!(c.withdraw(now), None);
    c.report_local_progress(0, 8, true, now + 1.0);
    now += 1.0;
    let (bytes, first) = c.publish_due(now).expect("first report publishes");
    assert_eq!(bytes.len(), PROGRESS_RECORD_BYTES);
    c.report_local_progress(0, 16, true, now + 0.1);
    assert_eq!(
        c.publish_due(now + 0.1),
        None,
        "at most once per fetch period"
    );
    // Nobody seen yet (nothing fetched): every min_refresh_period.
    let period = config().min_refresh_period.as_secs_f64();
    assert_eq!(c.next_publish_time(now + 0.1), Some(now + period));
    assert!(c.publish_due(now + period).is_some());
    now += period;
    c.update_epoch(None, now + 0.1);
    let (bytes, second) = c
        .publish_due(now + 0.1)
        .expect("a new epoch publishes at once");
    assert!(second > first);
    let Ok(ProgressRecord::Progress(p)) = ProgressRecord::decode(&bytes) else {
        panic!("undecodable")
    };
    assert_eq!((p.epoch, p.samples_accumulated), (1, 0));
    assert_eq!(c.publish_due(now + 1.0), None);
    assert!(
        c.publish_due(now + 31.0).is_some(),
        "kept alive every half expiration"
    );
    let (bytes, last) = c.withdraw(now + 31.0).unwrap();
    assert!(last > second);
    assert_eq!(
        ProgressRecord::decode(&bytes),
        Ok(ProgressRecord::Withdrawn)
    );
}

/// Publications while this peer reports every `step` seconds from `from` for `secs` seconds.
fn publications(c: &mut ProgressCore, samples: &mut u64, from: f64, secs: f64, step: f64) -> usize {
    let mut count = 0;
    let mut now = from;
    while now < from + secs {
        *samples += 8;
        c.report_local_progress(c.local_progress().epoch, *samples, true, now);
        count += usize::from(c.publish_due(now).is_some());
        now += step;
    }
    count
}

#[test]
fn changed_records_are_published_once_per_fetch_period_not_per_report() {
    // DiLoCo's tracker: fetches every 2 s at most, 0.5 s at least.
    let mut cfg = ProgressConfig::new(3_000);
    cfg.max_refresh_period = Duration::from_secs(2);
    let mut c = ProgressCore::new(cfg, peer(), T0).unwrap();
    let others = [peer(), peer(), peer()];
    let mut samples = 0;
    assert_eq!(publications(&mut c, &mut samples, T0, 0.5, 0.4), 1);
    let idle: Vec<_> = others
        .iter()
        .map(|p| (*p, rec(0, 0, 0.0, T0 + 0.5, false)))
        .collect();
    fetch(&mut c, &idle, T0 + 0.5);
    let wait = c.global_progress().next_fetch_time - (T0 + 0.5);
    assert_eq!(
        wait, 2.0,
        "the end is far: readers fetch every max_refresh_period"
    );
    // 2.5 reports a second for 20 s (the benchmark's idle peer): a record per fetch period, not
    // one per min_refresh_period (40) nor per report (50).
    let n = publications(&mut c, &mut samples, T0 + 0.5, 20.0, 0.4);
    assert!((9..=11).contains(&n), "{n} publications in 20 s");

    // Near the end of the epoch (2,996 of 3,000 samples) readers fetch every
    // min_refresh_period, and the record follows as fast.
    let now = T0 + 21.0;
    let near: Vec<_> = others
        .iter()
        .map(|p| (*p, rec(0, 860, 40.0, now, false)))
        .collect();
    fetch(&mut c, &near, now);
    assert_eq!(c.global_progress().next_fetch_time - now, 0.5);
    let n = publications(&mut c, &mut samples, now, 2.0, 0.1);
    assert!((4..=5).contains(&n), "{n} publications in 2 s near the end");

    // An epoch change is published at once.
    c.update_epoch(None, now + 2.05);
    assert!(c.publish_due(now + 2.05).is_some());
}

#[test]
fn the_epoch_change_bumps_the_generation_and_clears_the_fetch_flag() {
    let mut c = core();
    fetch(&mut c, &[], T0 + 1.0);
    assert!(c.fetched_this_epoch());
    let g = c.generation();
    c.update_epoch(Some(4), T0 + 2.0);
    assert!(!c.fetched_this_epoch() && c.generation() == g + 1);
    assert_eq!(
        (c.global_progress().epoch, c.local_progress().epoch),
        (4, 4)
    );
    // A lower epoch leaves the global one alone.
    c.update_epoch(Some(2), T0 + 3.0);
    assert_eq!(c.global_progress().epoch, 4);
}

#[test]
fn bad_configs_are_refused() {
    let mut cfg = config();
    cfg.target_batch_size = 0;
    assert!(ProgressCore::new(cfg, peer(), T0).is_err());
    let mut cfg = config();
    cfg.min_refresh_period = Duration::from_secs(20);
    assert!(ProgressCore::new(cfg, peer(), T0).is_err());
    let mut cfg = config();
    cfg.performance_ema_alpha = 0.0;
    assert!(ProgressCore::new(cfg, peer(), T0).is_err());
    let mut cfg = config();
    cfg.limits.lead_fraction = f64::NAN;
    assert!(ProgressCore::new(cfg, peer(), T0).is_err());
}
