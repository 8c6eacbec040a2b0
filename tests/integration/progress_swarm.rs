//! Progress trackers on a real swarm over loopback: peers see each other's progress, the
//! global epoch advances for everyone, and a peer that shuts down is withdrawn.

use crate::common;

use common::dht_node;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hivemesh::train::{ProgressConfig, ProgressTracker};

fn config() -> ProgressConfig {
    let mut cfg = ProgressConfig::new(60);
    cfg.min_refresh_period = Duration::from_millis(100);
    cfg.max_refresh_period = Duration::from_millis(500);
    cfg.default_refresh_period = Duration::from_millis(200);
    // Longer than the wait for a withdrawal below: the record must be withdrawn, not expire.
    cfg.metadata_expiration = Duration::from_secs(60);
    cfg.request_timeout = Duration::from_secs(10);
    cfg
}

/// Polls `check` every 20 ms until it holds or `limit` passes.
async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// A training loop: `batch` samples every 50 ms of "compute", ending epochs as the swarm's
/// progress says, until `epochs` are done.
async fn train(tracker: Arc<ProgressTracker>, batch: u64, epochs: u64) -> u64 {
    let mut epoch = tracker.local_progress().epoch;
    let mut samples = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while epoch < epochs && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        samples += batch;
        tracker.report_local_progress(epoch, samples, true);
        if tracker.ready_to_update_epoch() {
            let _paused = tracker.pause_updates();
            epoch = tracker.update_epoch(Some(tracker.global_epoch().max(epoch + 1)));
            samples = 0;
        }
    }
    epoch
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_peers_advance_the_global_epoch_together() {
    let boot = dht_node(vec![], false).await;
    let addrs = boot.p2p().listen_addrs().await.unwrap();
    let mut trackers = Vec::new();
    let mut dhts = vec![boot];
    for _ in 0..3 {
        let dht = dht_node(addrs.clone(), false).await;
        let tracker = ProgressTracker::new(dht.clone(), "swarm_test", config())
            .await
            .unwrap();
        tracker.start();
        trackers.push(Arc::new(tracker));
        dhts.push(dht);
    }
    let runs: Vec<_> = trackers
        .iter()
        .zip([4u64, 6, 8])
        .map(|(t, batch)| tokio::spawn(train(t.clone(), batch, 4)))
        .collect();
    // Everyone sees everyone while training.
    assert!(
        eventually(Duration::from_secs(60), || trackers
            .iter()
            .all(|t| t.global_progress().num_peers == 3))
        .await,
        "peers never saw each other: {trackers:?}"
    );
    for run in runs {
        assert_eq!(run.await.unwrap(), 4, "a peer did not reach epoch 4");
    }
    for t in &trackers {
        assert!(t.global_epoch() >= 3, "{t:?}");
    }
    // A peer that leaves is withdrawn from the others' view.
    trackers[2].shutdown(Duration::from_secs(10)).await.unwrap();
    assert!(!trackers[2].is_running());
    // The others keep reporting (a peer stops publishing after two epochs without samples).
    for t in &trackers[..2] {
        t.report_local_progress(4, 1, true);
    }
    assert!(
        eventually(Duration::from_secs(30), || trackers[..2]
            .iter()
            .all(|t| t.global_progress().num_peers == 2))
        .await,
        "the withdrawn peer is still counted: {trackers:?}"
    );
    for t in &trackers[..2] {
        t.shutdown(Duration::from_secs(10)).await.unwrap();
    }
}
