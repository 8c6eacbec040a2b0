//! Publishing this peer's [`PeerMetrics`] for monitors: a sans-IO schedule
//! ([`MetricsSchedule`]) and its tokio shell ([`MetricsPublisher`]), next to the
//! [`ProgressTracker`](super::ProgressTracker).
//!
//! A report is published at once the first time, then at most every `min_period` (the latest
//! report wins: reports in between only replace what is waiting), and again every half
//! `expiration` to keep it alive; expirations only grow, so the newest write wins. At shutdown
//! the record is withdrawn (a later expiration), so a monitor shows the peer as gone at once.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use super::metrics::{MetricsError, MetricsRecord, PeerMetrics, metrics_key};
use super::progress::ConfigError;
use super::task::OwnedTask;
use super::tracker::TrackerError;
use crate::dht::{Dht, DhtTime};

/// When a [`MetricsPublisher`] writes.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsConfig {
    /// At most one publication per this period (the latest report wins).
    pub min_period: Duration,
    /// How long a record lives; it is re-published every half of it.
    pub expiration: Duration,
    /// Bound on every DHT write.
    pub request_timeout: Duration,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            min_period: Duration::from_secs(2),
            expiration: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
        }
    }
}

impl MetricsConfig {
    /// Checks that the parameters make sense (a zero expiration would republish forever).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.expiration.is_zero() || self.request_timeout.is_zero() {
            return Err(ConfigError {
                field: "expiration",
                reason: "expiration and timeout must be positive",
            });
        }
        Ok(())
    }
}

/// The publication schedule, sans-IO (DHT times in seconds).
#[derive(Clone, Debug)]
pub struct MetricsSchedule {
    config: MetricsConfig,
    latest: Option<PeerMetrics>,
    dirty: bool,
    published_at: Option<f64>,
    expiration: Option<f64>,
}

impl MetricsSchedule {
    /// A schedule with nothing reported yet.
    pub fn new(config: MetricsConfig) -> Self {
        Self {
            config,
            latest: None,
            dirty: false,
            published_at: None,
            expiration: None,
        }
    }

    /// Takes a report (checked: it must encode).
    pub fn report(&mut self, metrics: PeerMetrics) -> Result<(), MetricsError> {
        metrics.check()?;
        self.latest = Some(metrics);
        self.dirty = true;
        Ok(())
    }

    /// The latest report.
    pub fn latest(&self) -> Option<&PeerMetrics> {
        self.latest.as_ref()
    }

    /// The record to write now, with its expiration, if one is due.
    pub fn publish_due(&mut self, now: f64) -> Option<(Vec<u8>, f64)> {
        let latest = self.latest.as_ref()?;
        let due = match self.published_at {
            None => true,
            Some(t) => {
                (self.dirty && now >= t + self.config.min_period.as_secs_f64())
                    || now >= t + self.config.expiration.as_secs_f64() / 2.0
            }
        };
        if !due {
            return None;
        }
        // `report` checked it: encoding cannot fail.
        let bytes = MetricsRecord::Metrics(latest.clone()).encode().ok()?;
        let expiration = self.next_expiration(now);
        self.published_at = Some(now);
        self.dirty = false;
        Some((bytes, expiration))
    }

    /// When [`MetricsSchedule::publish_due`] may next have something; `None` before the first
    /// report.
    pub fn next_publish_time(&self) -> Option<f64> {
        self.latest.as_ref()?;
        Some(match self.published_at {
            None => f64::NEG_INFINITY,
            Some(t) if self.dirty => t + self.config.min_period.as_secs_f64(),
            Some(t) => t + self.config.expiration.as_secs_f64() / 2.0,
        })
    }

    /// The record that withdraws this peer, if it ever published.
    pub fn withdraw(&mut self, now: f64) -> Option<(Vec<u8>, f64)> {
        self.published_at?;
        let expiration = self.next_expiration(now);
        Some((MetricsRecord::Withdrawn.encode().ok()?, expiration))
    }

    fn next_expiration(&mut self, now: f64) -> f64 {
        let e = now + self.config.expiration.as_secs_f64();
        let e = match self.expiration {
            Some(last) if e <= last => last.next_up(),
            _ => e,
        };
        self.expiration = Some(e);
        e
    }
}

struct Shared {
    schedule: Mutex<MetricsSchedule>,
    dht: Dht,
    key: Vec<u8>,
    reported: Notify,
}

impl Shared {
    fn schedule(&self) -> MutexGuard<'_, MetricsSchedule> {
        self.schedule.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn write(&self, value: Vec<u8>, expiration: f64) -> Result<(), TrackerError> {
        let timeout = self.schedule().config.request_timeout;
        let expiration = DhtTime::from_secs(expiration).unwrap_or_else(DhtTime::now);
        let subkey = self.dht.own_subkey();
        let store = self
            .dht
            .store_unconfirmed(&self.key, Some(&subkey), &value, expiration);
        tokio::time::timeout(timeout, store)
            .await
            .map_err(|_| TrackerError::Timeout)??;
        Ok(())
    }
}

async fn publisher(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let now = DhtTime::now().as_secs();
        let (due, next, cap) = {
            let mut s = shared.schedule();
            let due = s.publish_due(now);
            (due, s.next_publish_time(), s.config.expiration / 2)
        };
        if let Some((value, expiration)) = due {
            tokio::select! {
                r = shared.write(value, expiration) => if let Err(e) = r {
                    tracing::debug!(error = %e, "metrics not published");
                },
                _ = stop.wait_for(|s| *s) => break,
            }
            continue;
        }
        let wait = next.map_or(cap, |t| {
            Duration::from_secs_f64((t - now).clamp(0.0, cap.as_secs_f64()))
        });
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shared.reported.notified() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

/// Publishes this peer's [`PeerMetrics`] under `"{prefix}_metrics"` (see the
/// [module docs](self)): [`MetricsPublisher::report`] as often as you like, one task writes.
pub struct MetricsPublisher {
    shared: Arc<Shared>,
    task: OwnedTask,
}

impl std::fmt::Debug for MetricsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsPublisher")
            .field("latest", &self.shared.schedule().latest())
            .finish()
    }
}

impl MetricsPublisher {
    /// A publisher for the run `prefix` on `dht`, writing in the background at once (call
    /// within a tokio runtime).
    pub fn start(dht: Dht, prefix: &str, config: MetricsConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let shared = Arc::new(Shared {
            schedule: Mutex::new(MetricsSchedule::new(config)),
            dht,
            key: metrics_key(prefix),
            reported: Notify::new(),
        });
        let task = OwnedTask::new();
        let s = shared.clone();
        task.spawn(|stop| publisher(s, stop));
        Ok(Self { shared, task })
    }

    /// Takes this peer's latest metrics (refused, with nothing changed, if they would not
    /// decode: a NaN loss, a name too long); published soon.
    pub fn report(&self, metrics: PeerMetrics) -> Result<(), MetricsError> {
        self.shared.schedule().report(metrics)?;
        self.shared.reported.notify_one();
        Ok(())
    }

    /// The latest report.
    pub fn latest(&self) -> Option<PeerMetrics> {
        self.shared.schedule().latest().cloned()
    }

    /// Stops the task (aborting it after `timeout`) and withdraws the record (one write under
    /// `request_timeout`). Idempotent.
    pub async fn shutdown(&self, timeout: Duration) -> Result<(), TrackerError> {
        let first = self.task.stop(timeout).await;
        if !first {
            return Ok(());
        }
        let withdrawn = self.shared.schedule().withdraw(DhtTime::now().as_secs());
        if let Some((value, expiration)) = withdrawn {
            self.shared.write(value, expiration).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(epoch: u64) -> PeerMetrics {
        PeerMetrics {
            epoch,
            time: 100.0,
            ..PeerMetrics::default()
        }
    }

    #[test]
    fn the_schedule_publishes_first_reports_at_once_then_at_most_every_min_period() {
        let mut s = MetricsSchedule::new(MetricsConfig::default());
        assert_eq!(s.publish_due(100.0), None);
        assert_eq!(s.next_publish_time(), None);
        assert_eq!(
            s.withdraw(100.0),
            None,
            "nothing published: nothing to withdraw"
        );
        s.report(metrics(1)).unwrap();
        let (bytes, exp) = s.publish_due(100.0).unwrap();
        assert_eq!(
            MetricsRecord::decode(&bytes),
            Ok(MetricsRecord::Metrics(metrics(1)))
        );
        assert_eq!(exp, 160.0);
        s.report(metrics(2)).unwrap();
        s.report(metrics(3)).unwrap();
        assert_eq!(s.next_publish_time(), Some(102.0));
        assert_eq!(s.publish_due(101.0), None);
        let (bytes, _) = s.publish_due(102.0).unwrap();
        assert_eq!(
            MetricsRecord::decode(&bytes),
            Ok(MetricsRecord::Metrics(metrics(3)))
        );
        // Nothing new: kept alive every half expiration.
        assert_eq!(s.next_publish_time(), Some(132.0));
        assert_eq!(s.publish_due(131.0), None);
        assert!(s.publish_due(132.0).is_some());
        // A withdrawal outlives the last write, even at the same time.
        let (bytes, exp) = s.withdraw(132.0).unwrap();
        assert_eq!(MetricsRecord::decode(&bytes), Ok(MetricsRecord::Withdrawn));
        assert!(exp > 192.0);
    }

    #[test]
    fn a_zero_expiration_is_refused() {
        let config = MetricsConfig {
            expiration: Duration::ZERO,
            ..MetricsConfig::default()
        };
        assert!(config.validate().is_err());
        assert!(MetricsConfig::default().validate().is_ok());
    }

    #[test]
    fn bad_reports_are_refused_and_change_nothing() {
        let mut s = MetricsSchedule::new(MetricsConfig::default());
        s.report(metrics(1)).unwrap();
        let bad = PeerMetrics {
            loss: Some(f64::NAN),
            ..metrics(2)
        };
        assert!(matches!(s.report(bad), Err(MetricsError::BadLoss(_))));
        assert_eq!(s.latest(), Some(&metrics(1)));
    }
}
