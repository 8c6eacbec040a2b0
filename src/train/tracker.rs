//! The tokio shell around [`ProgressCore`]: publishes this peer's record under the progress
//! key, fetches everyone's on the core's schedule, and withdraws the record at shutdown.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use super::progress::{ConfigError, GlobalProgress, ProgressConfig, ProgressCore};
use super::record::LocalProgress;
use super::task::OwnedTask;
use crate::dht::{Dht, DhtError, DhtTime};

/// The DHT key of a run's progress records: the [owned key](crate::dht::owned_key)
/// `"{prefix}_progress"` (hivemind's key, owned so that nobody can squat it).
pub fn progress_key(prefix: &str) -> Vec<u8> {
    crate::dht::owned_key(format!("{prefix}_progress"))
}

/// Errors of the tracker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrackerError {
    /// The parameters are unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A DHT request failed.
    #[error(transparent)]
    Dht(#[from] DhtError),
    /// A DHT request took longer than `request_timeout`.
    #[error("the DHT request timed out")]
    Timeout,
}

fn now() -> f64 {
    DhtTime::now().as_secs()
}

struct Shared {
    core: Mutex<ProgressCore>,
    dht: Dht,
    key: Vec<u8>,
    /// Paused by [`ProgressTracker::pause_updates`] (a count: pauses nest).
    paused: Mutex<u32>,
    /// Local progress changed: the reporter looks at once.
    reported: Notify,
    /// Updates resumed or the epoch changed: the fetcher looks at once.
    wake_fetcher: Notify,
    /// Fetches applied so far.
    fetches: watch::Sender<u64>,
}

impl Shared {
    fn core(&self) -> MutexGuard<'_, ProgressCore> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn paused(&self) -> MutexGuard<'_, u32> {
        self.paused.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn timeout(&self) -> Duration {
        self.core().config().request_timeout
    }

    /// One fetch, under the request timeout; applied unless the epoch changed meanwhile or
    /// updates are paused (then the caller fetches again once they resume).
    async fn fetch(&self) -> Result<bool, TrackerError> {
        let generation = self.core().generation();
        let got = tokio::time::timeout(self.timeout(), self.dht.get(&self.key))
            .await
            .map_err(|_| TrackerError::Timeout)??;
        let paused = self.paused();
        let mut core = self.core();
        if *paused > 0 || core.generation() != generation {
            return Ok(false);
        }
        let entries = got.iter().flat_map(|v| v.owner_entries());
        let summary = core.apply_fetch(
            entries.map(|(peer, e)| (peer, &e.value[..], e.expiration.as_secs())),
            now(),
        );
        for (peer, error) in &summary.rejected {
            tracing::debug!(%peer, %error, "ignoring a malformed progress record");
        }
        let g = core.global_progress();
        tracing::debug!(
            epoch = g.epoch,
            samples = g.samples_accumulated,
            peers = g.num_peers,
            eta = g.eta_next_epoch - now(),
            "swarm progress"
        );
        drop(core);
        drop(paused);
        self.fetches.send_modify(|n| *n += 1);
        Ok(true)
    }

    async fn publish(&self, value: Vec<u8>, expiration: f64) -> Result<(), TrackerError> {
        let expiration = DhtTime::from_secs(expiration).unwrap_or_else(DhtTime::now);
        let subkey = self.dht.own_subkey();
        let store = self
            .dht
            .store_unconfirmed(&self.key, Some(&subkey), &value, expiration);
        tokio::time::timeout(self.timeout(), store)
            .await
            .map_err(|_| TrackerError::Timeout)??;
        Ok(())
    }
}

/// How long to sleep until DHT time `at`, at most `cap` (so that a clock step never stalls a
/// loop).
fn until(at: f64, cap: Duration) -> Duration {
    let secs = (at - now()).clamp(0.0, cap.as_secs_f64());
    Duration::from_secs_f64(secs)
}

async fn reporter(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let (due, next) = {
            let mut core = shared.core();
            let now = now();
            let due = core.publish_due(now);
            (due, core.next_publish_time(now))
        };
        if let Some((value, expiration)) = due {
            tokio::select! {
                r = shared.publish(value, expiration) => if let Err(e) = r {
                    tracing::debug!(error = %e, "progress not published");
                },
                _ = stop.wait_for(|s| *s) => break,
            }
            continue;
        }
        let cap = shared.core().config().max_refresh_period;
        let wait = next.map_or(cap, |t| until(t, cap));
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shared.reported.notified() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

async fn fetcher(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let (next, cap) = {
            let core = shared.core();
            (
                core.global_progress().next_fetch_time,
                core.config().max_refresh_period,
            )
        };
        tokio::select! {
            () = tokio::time::sleep(until(next, cap)) => {}
            () = shared.wake_fetcher.notified() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        if *shared.paused() > 0 {
            // Resuming wakes the fetcher.
            tokio::select! {
                () = tokio::time::sleep(cap) => {}
                () = shared.wake_fetcher.notified() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            continue;
        }
        let result = tokio::select! {
            r = shared.fetch() => r,
            _ = stop.wait_for(|s| *s) => break,
        };
        if let Err(e) = result {
            tracing::debug!(error = %e, "progress fetch failed");
            // Expire what was fetched before; the next fetch is scheduled from that.
            shared.core().recompute(now());
        }
    }
}

/// Keeps [`ProgressTracker`] updates paused while alive; see
/// [`ProgressTracker::pause_updates`].
#[must_use = "updates resume when the guard is dropped"]
pub struct PauseGuard<'a> {
    tracker: &'a ProgressTracker,
}

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        self.tracker.resume();
    }
}

/// Tracks this peer's and the swarm's training progress through the DHT (see the
/// [module docs](super)): a [`ProgressCore`] fed by two background loops, one publishing this
/// peer's record, one fetching everyone's.
pub struct ProgressTracker {
    shared: Arc<Shared>,
    task: OwnedTask,
}

impl std::fmt::Debug for ProgressTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgressTracker")
            .field("global", &self.global_progress())
            .field("local", &self.local_progress())
            .finish()
    }
}

impl ProgressTracker {
    /// A tracker of the run `prefix` on `dht`, holding the swarm's progress as one first fetch
    /// (under `request_timeout`) finds it. Nothing runs in the background until
    /// [`ProgressTracker::start`].
    pub async fn new(dht: Dht, prefix: &str, config: ProgressConfig) -> Result<Self, TrackerError> {
        let core = ProgressCore::new(config, dht.p2p().peer_id(), now())?;
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            dht,
            key: progress_key(prefix),
            paused: Mutex::new(0),
            reported: Notify::new(),
            wake_fetcher: Notify::new(),
            fetches: watch::Sender::new(0),
        });
        if let Err(e) = shared.fetch().await {
            tracing::debug!(error = %e, "first progress fetch failed");
        }
        Ok(Self {
            shared,
            task: OwnedTask::new(),
        })
    }

    /// Starts publishing and fetching in the background (a no-op if running or shut down).
    /// Call within a tokio runtime.
    pub fn start(&self) {
        let shared = self.shared.clone();
        self.task.spawn(|stop| async move {
            tokio::join!(
                reporter(shared.clone(), stop.clone()),
                fetcher(shared, stop)
            );
        });
    }

    /// Whether the background loops run.
    pub fn is_running(&self) -> bool {
        self.task.is_running()
    }

    /// The swarm's progress as last derived.
    pub fn global_progress(&self) -> GlobalProgress {
        self.shared.core().global_progress()
    }

    /// This peer's progress as last reported.
    pub fn local_progress(&self) -> LocalProgress {
        self.shared.core().local_progress()
    }

    /// The global epoch.
    pub fn global_epoch(&self) -> u64 {
        self.global_progress().epoch
    }

    /// Whether this peer may end its epoch now ([`ProgressCore::ready_to_update_epoch`]).
    pub fn ready_to_update_epoch(&self) -> bool {
        self.shared.core().ready_to_update_epoch(now())
    }

    /// When this peer should end its epoch (DHT time).
    pub fn estimated_next_update_time(&self) -> f64 {
        self.shared.core().estimated_next_update_time(now())
    }

    /// Runs `f` on the core (for what the other methods do not cover: the throughput
    /// estimate, the peers' records).
    pub fn with_core<R>(&self, f: impl FnOnce(&mut ProgressCore) -> R) -> R {
        f(&mut self.shared.core())
    }

    /// [`ProgressCore::report_local_progress`] now; the reporter publishes soon after.
    pub fn report_local_progress(
        &self,
        local_epoch: u64,
        samples_accumulated: u64,
        update_global_samples: bool,
    ) {
        self.shared.core().report_local_progress(
            local_epoch,
            samples_accumulated,
            update_global_samples,
            now(),
        );
        self.shared.reported.notify_one();
    }

    /// [`ProgressCore::update_epoch`] now; a fetch begun before is not applied, and the
    /// reporter publishes the new epoch at once.
    pub fn update_epoch(&self, new_epoch: Option<u64>) -> u64 {
        let epoch = self.shared.core().update_epoch(new_epoch, now());
        self.shared.reported.notify_one();
        epoch
    }

    /// Pauses updates of the global progress (fetches are not applied) and the throughput
    /// estimate's clock until the guard drops: hivemind's `pause_updates()`, held around
    /// ending an epoch.
    pub fn pause_updates(&self) -> PauseGuard<'_> {
        self.pause();
        PauseGuard { tracker: self }
    }

    /// [`ProgressTracker::pause_updates`] without a guard: pair with
    /// [`ProgressTracker::resume`] (pauses nest).
    pub fn pause(&self) {
        let mut paused = self.shared.paused();
        *paused += 1;
        if *paused == 1 {
            self.shared.core().performance_ema_mut().pause();
        }
    }

    /// Ends one [`ProgressTracker::pause`] (extra calls do nothing).
    pub fn resume(&self) {
        let mut paused = self.shared.paused();
        if *paused == 0 {
            return;
        }
        *paused -= 1;
        if *paused == 0 {
            self.shared.core().performance_ema_mut().resume(now());
            drop(paused);
            self.shared.wake_fetcher.notify_one();
        }
    }

    /// Waits until a fetch is applied after the last epoch change (hivemind's
    /// `fetched_global_progress_this_epoch.wait`), at most `timeout`; returns whether one was.
    pub async fn wait_fetched(&self, timeout: Duration) -> bool {
        let mut fetches = self.shared.fetches.subscribe();
        let wait = async {
            loop {
                if self.shared.core().fetched_this_epoch() {
                    return true;
                }
                if fetches.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    /// Stops the background loops (waiting for them at most `timeout`, then aborting them)
    /// and withdraws this peer's record (one write under `request_timeout`). Idempotent.
    pub async fn shutdown(&self, timeout: Duration) -> Result<(), TrackerError> {
        let first = self.task.stop(timeout).await;
        if !first {
            return Ok(());
        }
        let withdrawn = self.shared.core().withdraw(now());
        if let Some((value, expiration)) = withdrawn {
            self.shared.publish(value, expiration).await?;
        }
        Ok(())
    }
}
