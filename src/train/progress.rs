//! The progress core, sans-IO: local progress in, peers' records in, the swarm's progress out.
//! Every method takes the current DHT time (`now`, seconds since the UNIX epoch) as an
//! argument; see the [module docs](super) for the rules.

use std::collections::BTreeMap;
use std::time::Duration;

use libp2p::PeerId;

use super::ema::PerformanceEma;
use super::record::{LocalProgress, ProgressRecord, RecordError};

/// Rates at or below this (samples per second) say "no throughput measured yet": they are left
/// out of the median the rate cap is taken from.
pub const MIN_MEANINGFUL_RATE: f64 = 1e-9;

/// The bounds on what another peer's record can claim (see the [module docs](super)).
#[derive(Clone, Debug, PartialEq)]
pub struct ProgressLimits {
    /// Another peer's rate counts at most this many times the (lower) median of the rates
    /// reported by the peers that report one.
    pub max_rate_factor: f64,
    /// A peer alone ahead of the swarm's epoch is followed only once the samples toward the
    /// current epoch reach this fraction of the target.
    pub lead_fraction: f64,
    /// How long before this peer saw an epoch begin the others may have begun it: another
    /// peer's samples count at most `rate × (time since the epoch began here + grace)`.
    pub epoch_grace: Duration,
    /// How far ahead of this peer's clock a report time may lie; a record is believed while
    /// `now <= its report time + metadata_expiration + max_clock_skew` (and its DHT entry
    /// lives).
    pub max_clock_skew: Duration,
}

impl Default for ProgressLimits {
    fn default() -> Self {
        Self {
            max_rate_factor: 10.0,
            lead_fraction: 0.5,
            epoch_grace: Duration::from_secs(10),
            max_clock_skew: crate::dht::DEFAULT_MAX_CLOCK_SKEW,
        }
    }
}

/// A progress tracker's parameters (hivemind's `ProgressTracker` arguments).
#[derive(Clone, Debug, PartialEq)]
pub struct ProgressConfig {
    /// Samples the swarm accumulates per epoch.
    pub target_batch_size: u64,
    /// This peer is a client (its epoch does not count toward the global epoch).
    pub client_mode: bool,
    /// Fetch the swarm's progress at most this often.
    pub min_refresh_period: Duration,
    /// Fetch it at least this often.
    pub max_refresh_period: Duration,
    /// How often to fetch while no peer reports.
    pub default_refresh_period: Duration,
    /// Peers assumed to join between two fetches (tightens the fetch schedule).
    pub expected_drift_peers: f64,
    /// Fraction of the swarm assumed to join between two fetches.
    pub expected_drift_rate: f64,
    /// Smoothing factor of the local throughput estimate.
    pub performance_ema_alpha: f64,
    /// How long a published record lives; it is re-published every half of it.
    pub metadata_expiration: Duration,
    /// Bound on every DHT request of the tracker (a fetch, a publication).
    pub request_timeout: Duration,
    /// What others' records may claim.
    pub limits: ProgressLimits,
}

impl ProgressConfig {
    /// hivemind's defaults for `target_batch_size`.
    pub fn new(target_batch_size: u64) -> Self {
        Self {
            target_batch_size,
            client_mode: false,
            min_refresh_period: Duration::from_millis(500),
            max_refresh_period: Duration::from_secs(10),
            default_refresh_period: Duration::from_secs(3),
            expected_drift_peers: 3.0,
            expected_drift_rate: 0.2,
            performance_ema_alpha: 0.1,
            metadata_expiration: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
            limits: ProgressLimits::default(),
        }
    }

    /// Checks that the parameters make sense.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, reason| Err(ConfigError { field, reason });
        if self.target_batch_size == 0 {
            return bad("target_batch_size", "must be positive");
        }
        if self.min_refresh_period > self.max_refresh_period {
            return bad("min_refresh_period", "must not exceed max_refresh_period");
        }
        if self.max_refresh_period.is_zero() || self.default_refresh_period.is_zero() {
            return bad("max_refresh_period", "refresh periods must be positive");
        }
        for (field, v) in [
            ("expected_drift_peers", self.expected_drift_peers),
            ("expected_drift_rate", self.expected_drift_rate),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, "must be a finite non-negative number");
            }
        }
        let a = self.performance_ema_alpha;
        if !(a.is_finite() && a > 0.0 && a <= 1.0) {
            return bad("performance_ema_alpha", "must lie in (0, 1]");
        }
        if self.metadata_expiration.is_zero() || self.request_timeout.is_zero() {
            return bad(
                "metadata_expiration",
                "expiration and timeout must be positive",
            );
        }
        let l = &self.limits;
        if !(l.max_rate_factor.is_finite() && l.max_rate_factor >= 1.0) {
            return bad("max_rate_factor", "must be a finite number of at least 1");
        }
        if !(l.lead_fraction.is_finite() && (0.0..=1.0).contains(&l.lead_fraction)) {
            return bad("lead_fraction", "must lie in [0, 1]");
        }
        Ok(())
    }
}

/// An unusable [`ProgressConfig`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} {reason}")]
pub struct ConfigError {
    /// The offending parameter.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// The swarm's progress as this peer sees it (hivemind's `GlobalTrainingProgress`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GlobalProgress {
    /// The global epoch.
    pub epoch: u64,
    /// Samples reported toward the next epoch by the peers at the global epoch.
    pub samples_accumulated: u64,
    /// The target.
    pub target_batch_size: u64,
    /// Peers reporting (this one included once it reports), clients included.
    pub num_peers: usize,
    /// Of which clients.
    pub num_clients: usize,
    /// When the target is expected to be reached (DHT time; infinite right after an epoch
    /// ends here).
    pub eta_next_epoch: f64,
    /// When to fetch the peers' records next (DHT time).
    pub next_fetch_time: f64,
}

/// What one fetch held.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchSummary {
    /// Live progress records of other peers.
    pub accepted: usize,
    /// Peers that have left.
    pub withdrawn: usize,
    /// Records past their lifetime.
    pub expired: usize,
    /// Malformed records, with their peers.
    pub rejected: Vec<(PeerId, RecordError)>,
}

/// A record as last fetched, and when its DHT entry expires.
#[derive(Clone, Copy, Debug)]
struct Seen {
    progress: LocalProgress,
    expiration: f64,
}

/// What was last published.
#[derive(Clone, Copy, Debug, Default)]
struct Published {
    /// Local progress changed since the last publication.
    dirty: bool,
    time: Option<f64>,
    epoch: Option<u64>,
    expiration: Option<f64>,
}

/// The progress core: this peer's progress, the records fetched from the others, and the
/// swarm's progress derived from both (see the [module docs](super)).
#[derive(Clone, Debug)]
pub struct ProgressCore {
    config: ProgressConfig,
    me: PeerId,
    local: LocalProgress,
    ema: PerformanceEma,
    global: GlobalProgress,
    peers: BTreeMap<PeerId, Seen>,
    /// When this peer first saw the global epoch it holds now.
    epoch_began: f64,
    /// Per peer, the most samples counted for it toward `remembered_epoch` (kept after it
    /// moves ahead, for the lead rule).
    remembered: BTreeMap<PeerId, f64>,
    remembered_epoch: u64,
    fetched_this_epoch: bool,
    /// The global epoch when this peer last reported samples (hivemind's `last_report_epoch`).
    last_report_epoch: Option<u64>,
    /// Bumped by every [`ProgressCore::update_epoch`]: a fetch begun before must not be
    /// applied after.
    generation: u64,
    published: Published,
}

impl ProgressCore {
    /// A core for peer `me` at epoch 0 with nothing fetched yet.
    pub fn new(config: ProgressConfig, me: PeerId, now: f64) -> Result<Self, ConfigError> {
        config.validate()?;
        let ema = PerformanceEma::new(config.performance_ema_alpha, 1e-20, now);
        let local = LocalProgress {
            epoch: 0,
            samples_accumulated: 0,
            samples_per_second: ema.samples_per_second(),
            time: now,
            client_mode: config.client_mode,
        };
        let mut core = Self {
            global: GlobalProgress {
                epoch: 0,
                samples_accumulated: 0,
                target_batch_size: config.target_batch_size,
                num_peers: 0,
                num_clients: 0,
                eta_next_epoch: f64::INFINITY,
                next_fetch_time: now,
            },
            config,
            me,
            local,
            ema,
            peers: BTreeMap::new(),
            epoch_began: now,
            remembered: BTreeMap::new(),
            remembered_epoch: 0,
            fetched_this_epoch: false,
            last_report_epoch: None,
            generation: 0,
            published: Published::default(),
        };
        core.recompute(now);
        Ok(core)
    }

    /// The parameters.
    pub fn config(&self) -> &ProgressConfig {
        &self.config
    }

    /// Changes the target batch size (a monitor learns it from the peers' metrics), then
    /// derives the swarm's progress again.
    pub fn set_target_batch_size(&mut self, target: u64, now: f64) -> Result<(), ConfigError> {
        if target == 0 {
            return Err(ConfigError {
                field: "target_batch_size",
                reason: "must be positive",
            });
        }
        self.config.target_batch_size = target;
        self.recompute(now);
        Ok(())
    }

    /// This peer.
    pub fn peer_id(&self) -> PeerId {
        self.me
    }

    /// This peer's progress as last reported.
    pub fn local_progress(&self) -> LocalProgress {
        self.local
    }

    /// The swarm's progress as last derived.
    pub fn global_progress(&self) -> GlobalProgress {
        self.global
    }

    /// The local throughput estimate.
    pub fn performance_ema(&self) -> &PerformanceEma {
        &self.ema
    }

    /// The local throughput estimate, to update by hand (hivemind lets callers do so).
    pub fn performance_ema_mut(&mut self) -> &mut PerformanceEma {
        &mut self.ema
    }

    /// Whether a fetch was applied since the local epoch last changed (hivemind's
    /// `fetched_global_progress_this_epoch`).
    pub fn fetched_this_epoch(&self) -> bool {
        self.fetched_this_epoch
    }

    /// Marks the global progress as not fetched since (hivemind's
    /// `fetched_global_progress_this_epoch.clear()`).
    pub fn clear_fetched(&mut self) {
        self.fetched_this_epoch = false;
    }

    /// Bumped by every [`ProgressCore::update_epoch`].
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether this peer may end its epoch now: a peer is ahead of it, the swarm reached the
    /// target, or the estimated time of the target has passed.
    pub fn ready_to_update_epoch(&self, now: f64) -> bool {
        self.global.epoch > self.local.epoch
            || self.global.samples_accumulated >= self.config.target_batch_size
            || now >= self.global.eta_next_epoch
    }

    /// When this peer should end its epoch: `now` if it may already, else the estimate.
    pub fn estimated_next_update_time(&self, now: f64) -> f64 {
        if self.ready_to_update_epoch(now) {
            now
        } else {
            self.global.eta_next_epoch
        }
    }

    /// Records that this peer holds `samples_accumulated` samples toward the end of
    /// `local_epoch` (hivemind's `report_local_progress`): the swarm's count moves by the
    /// difference if this peer is at the global epoch (and `update_global_samples`), the
    /// throughput estimate takes the new samples (or restarts its timer if the count went
    /// down; while the estimate is paused, new samples leave it as it is), and the record is
    /// marked for publication.
    pub fn report_local_progress(
        &mut self,
        local_epoch: u64,
        samples_accumulated: u64,
        update_global_samples: bool,
        now: f64,
    ) {
        let extra = i128::from(samples_accumulated) - i128::from(self.local.samples_accumulated);
        if update_global_samples
            && local_epoch == self.local.epoch
            && local_epoch == self.global.epoch
        {
            let total = i128::from(self.global.samples_accumulated) + extra;
            self.global.samples_accumulated = total.clamp(0, i128::from(u64::MAX)) as u64;
        }
        if extra > 0 {
            if !self.ema.is_paused() {
                // `extra` is positive and finite: the update cannot fail.
                let _ = self.ema.update(extra as f64, None, now);
            }
        } else {
            self.ema.reset_timer(now);
        }
        self.local = LocalProgress {
            epoch: local_epoch,
            samples_accumulated,
            samples_per_second: self.ema.samples_per_second(),
            time: now,
            client_mode: self.config.client_mode,
        };
        if samples_accumulated > 0 {
            self.last_report_epoch = Some(self.global.epoch);
        }
        self.published.dirty = true;
    }

    /// Moves this peer to `new_epoch` (default: its epoch + 1) with no samples, raising the
    /// global epoch if it is behind (then with no samples and an infinite ETA until the next
    /// fetch); returns the new epoch. Fetches begun before must not be applied after
    /// ([`ProgressCore::generation`]).
    pub fn update_epoch(&mut self, new_epoch: Option<u64>, now: f64) -> u64 {
        let new_epoch = new_epoch.unwrap_or_else(|| self.local.epoch.saturating_add(1));
        if new_epoch > self.global.epoch {
            self.global.epoch = new_epoch;
            self.global.samples_accumulated = 0;
            self.global.eta_next_epoch = f64::INFINITY;
            self.enter_epoch(new_epoch, now);
        }
        self.report_local_progress(new_epoch, 0, true, now);
        self.fetched_this_epoch = false;
        self.generation += 1;
        new_epoch
    }

    /// Takes the records of one fetch: `(peer, record bytes, entry expiration)` per owner
    /// entry under the progress key. This peer's own entry is skipped (its local progress is
    /// fresher); malformed records, records from the future, withdrawn and expired ones are
    /// left out. Then derives the swarm's progress.
    pub fn apply_fetch<'a>(
        &mut self,
        entries: impl IntoIterator<Item = (PeerId, &'a [u8], f64)>,
        now: f64,
    ) -> FetchSummary {
        let mut summary = FetchSummary::default();
        self.peers.clear();
        let skew = self.config.limits.max_clock_skew.as_secs_f64();
        for (peer, bytes, expiration) in entries {
            if peer == self.me {
                continue;
            }
            let record = ProgressRecord::decode(bytes).and_then(|r| match r {
                ProgressRecord::Progress(p) if p.time > now + skew => {
                    Err(RecordError::FromTheFuture {
                        time: p.time,
                        ahead: p.time - now,
                    })
                }
                r => Ok(r),
            });
            match record {
                Ok(ProgressRecord::Withdrawn) => summary.withdrawn += 1,
                Ok(ProgressRecord::Progress(progress)) => {
                    let seen = Seen {
                        progress,
                        expiration,
                    };
                    if self.live(&seen, now) {
                        summary.accepted += 1;
                        self.peers.insert(peer, seen);
                    } else {
                        summary.expired += 1;
                    }
                }
                Err(e) => summary.rejected.push((peer, e)),
            }
        }
        self.recompute(now);
        self.fetched_this_epoch = true;
        summary
    }

    /// Derives the swarm's progress again at `now` from the records last fetched, dropping
    /// those that expired (what a failed fetch leaves).
    pub fn recompute(&mut self, now: f64) {
        let peers = std::mem::take(&mut self.peers);
        self.peers = peers
            .into_iter()
            .filter(|(_, s)| self.live(s, now))
            .collect();
        self.global = self.derive(now);
    }

    /// Peers whose records are believed now (not this one).
    pub fn peers(&self) -> impl Iterator<Item = (PeerId, LocalProgress)> + '_ {
        self.peers.iter().map(|(p, s)| (*p, s.progress))
    }

    /// The record to publish now, with its expiration, if one is due: while this peer reports
    /// samples at most one epoch back (hivemind: a peer that stopped contributing stops
    /// publishing), at once after its first report or an epoch change, after other changes at
    /// most once per period at which the readers fetch (`max_refresh_period` while the end
    /// of the epoch is far, down to `min_refresh_period` as it nears: a record re-stored
    /// faster is overwritten before anyone reads it, and readers extrapolate the samples at
    /// the published rate in between), and every half `metadata_expiration` to keep it alive.
    /// Expirations only grow, so the newest record always wins.
    pub fn publish_due(&mut self, now: f64) -> Option<(Vec<u8>, f64)> {
        if !self.reporting() {
            return None;
        }
        let p = self.published;
        let due = match p.time {
            None => true,
            Some(t) => {
                let changed = p.dirty
                    && (p.epoch != Some(self.local.epoch) || now >= t + self.publish_period(now));
                changed || now >= t + self.config.metadata_expiration.as_secs_f64() / 2.0
            }
        };
        if !due {
            return None;
        }
        let expiration = self.next_expiration(now);
        self.published = Published {
            dirty: false,
            time: Some(now),
            epoch: Some(self.local.epoch),
            expiration: Some(expiration),
        };
        Some((ProgressRecord::Progress(self.local).encode(), expiration))
    }

    /// When [`ProgressCore::publish_due`] may next have something (DHT time), as seen at
    /// `now` (the wait for a changed record shrinks as the end of the epoch nears); `None`
    /// while this peer does not report.
    pub fn next_publish_time(&self, now: f64) -> Option<f64> {
        if !self.reporting() {
            return None;
        }
        let p = self.published;
        Some(match p.time {
            None => f64::NEG_INFINITY,
            Some(t) if p.dirty && p.epoch != Some(self.local.epoch) => t,
            Some(t) if p.dirty => t + self.publish_period(now),
            Some(t) => t + self.config.metadata_expiration.as_secs_f64() / 2.0,
        })
    }

    /// The record that withdraws this peer (it leaves), expiring after its last publication,
    /// if it ever published.
    pub fn withdraw(&mut self, now: f64) -> Option<(Vec<u8>, f64)> {
        self.published.time?;
        let expiration = self.next_expiration(now);
        self.published.expiration = Some(expiration);
        Some((ProgressRecord::Withdrawn.encode(), expiration))
    }

    fn next_expiration(&self, now: f64) -> f64 {
        let e = now + self.config.metadata_expiration.as_secs_f64();
        match self.published.expiration {
            Some(last) if e <= last => last.next_up(),
            _ => e,
        }
    }

    /// Whether this peer publishes (and counts itself): it reported samples at most one epoch
    /// before the global one.
    fn reporting(&self) -> bool {
        self.last_report_epoch
            .is_some_and(|e| e.saturating_add(1) >= self.global.epoch)
    }

    fn live(&self, seen: &Seen, now: f64) -> bool {
        let lifetime = self.config.metadata_expiration.as_secs_f64()
            + self.config.limits.max_clock_skew.as_secs_f64();
        now <= seen.expiration && now <= seen.progress.time + lifetime
    }

    /// The fetch period for an epoch `eta` seconds from its end with `num_peers` reporting
    /// (hivemind's schedule): `clip(eta × n / n_max, min_refresh_period, max_refresh_period)`,
    /// `max_refresh_period` for an unknown (NaN) ETA.
    fn refresh_period(&self, eta: f64, num_peers: usize) -> f64 {
        let cfg = &self.config;
        let (min, max) = (
            cfg.min_refresh_period.as_secs_f64(),
            cfg.max_refresh_period.as_secs_f64(),
        );
        let n = num_peers as f64;
        let expected_max = (n + cfg.expected_drift_peers).max(n * (1.0 + cfg.expected_drift_rate));
        let period = eta * n / expected_max;
        if period.is_nan() {
            max
        } else {
            period.clamp(min, max)
        }
    }

    /// How long a changed record waits after the last publication: the period at which the
    /// readers fetch now ([`ProgressCore::refresh_period`] at the ETA as extrapolated to
    /// `now`), so a record is not re-stored faster than anyone reads it. Near the end of an
    /// epoch that is `min_refresh_period`, as readers then fetch that often.
    fn publish_period(&self, now: f64) -> f64 {
        let eta = (self.global.eta_next_epoch - now).max(0.0);
        self.refresh_period(eta, self.global.num_peers)
    }

    /// Notes that the global epoch is `epoch` from `now` on.
    fn enter_epoch(&mut self, epoch: u64, now: f64) {
        if epoch != self.remembered_epoch {
            self.remembered.clear();
            self.remembered_epoch = epoch;
            self.epoch_began = now;
        }
    }

    /// The rate cap at `now`: `max_rate_factor` times the lower median of the meaningful
    /// rates (this peer's included when it reports), infinite when nobody reports one.
    fn rate_cap(&self, own: Option<&LocalProgress>) -> f64 {
        let mut rates: Vec<f64> = self
            .peers
            .values()
            .map(|s| s.progress.samples_per_second)
            .chain(own.map(|p| p.samples_per_second))
            .filter(|r| *r > MIN_MEANINGFUL_RATE)
            .collect();
        if rates.is_empty() {
            return f64::INFINITY;
        }
        rates.sort_by(f64::total_cmp);
        rates[(rates.len() - 1) / 2] * self.config.limits.max_rate_factor
    }

    /// Another peer's samples toward the epoch that began (here) at `began`, as reported and
    /// as extrapolated to `now` at its (capped) rate, both at most `rate × (now - began +
    /// grace)`.
    fn bounded(&self, p: &LocalProgress, rate: f64, began: f64, now: f64) -> (f64, f64) {
        let window = (now - began).max(0.0) + self.config.limits.epoch_grace.as_secs_f64();
        let ceiling = rate * window;
        let samples = p.samples_accumulated as f64;
        let since = (now - p.time.min(now)).max(0.0);
        (samples.min(ceiling), (samples + rate * since).min(ceiling))
    }

    /// Estimated samples toward `epoch` at `now`: peers at it (bounded, extrapolated), peers
    /// that left it for a later epoch (what was last counted for them at it), this peer.
    fn samples_toward(&self, epoch: u64, cap: f64, now: f64) -> f64 {
        let began = if epoch == self.remembered_epoch {
            self.epoch_began
        } else {
            now
        };
        let mut total = 0.0;
        for (peer, s) in &self.peers {
            let p = &s.progress;
            if p.epoch == epoch {
                total += self.bounded(p, p.samples_per_second.min(cap), began, now).1;
            } else if p.epoch > epoch && epoch == self.remembered_epoch {
                total += self.remembered.get(peer).copied().unwrap_or(0.0);
            }
        }
        if self.local.epoch == epoch {
            total += self.local.samples_accumulated as f64;
        }
        total
    }

    /// hivemind's `_parse_swarm_progress_data`, with the bounds of the module docs.
    fn derive(&mut self, now: f64) -> GlobalProgress {
        let cfg = self.config.clone();
        let target = cfg.target_batch_size as f64;
        let own = self.reporting().then_some(self.local);
        if self.peers.is_empty() && own.is_none() {
            let remaining = (target - self.local.samples_accumulated as f64).max(0.0);
            self.enter_epoch(self.local.epoch, now);
            return GlobalProgress {
                epoch: self.local.epoch,
                samples_accumulated: self.local.samples_accumulated,
                target_batch_size: cfg.target_batch_size,
                num_peers: 0,
                num_clients: 0,
                eta_next_epoch: now + remaining / self.ema.samples_per_second(),
                next_fetch_time: now + cfg.default_refresh_period.as_secs_f64(),
            };
        }
        let cap = self.rate_cap(own.as_ref());

        // The epoch: the q-th highest epoch of the other non-client peers (q = 2, or 1 if
        // there is only one), never below this peer's; one more if a peer alone is ahead and
        // the samples toward the current one reach the lead fraction.
        let mut epochs: Vec<u64> = self
            .peers
            .values()
            .filter(|s| !s.progress.client_mode)
            .map(|s| s.progress.epoch)
            .collect();
        epochs.sort_unstable_by(|a, b| b.cmp(a));
        let corroborated = match epochs.len() {
            0 => 0,
            1 => epochs[0],
            _ => epochs[1],
        };
        let mut epoch = self.local.epoch.max(corroborated);
        if epochs.first().is_some_and(|&e| e > epoch)
            && self.samples_toward(epoch, cap, now) >= cfg.limits.lead_fraction * target
        {
            epoch += 1;
        }
        self.enter_epoch(epoch, now);

        let mut samples = 0.0;
        let mut estimated = 0.0;
        let mut total_rate = self.ema.eps();
        let mut counted = Vec::new();
        for (peer, s) in &self.peers {
            let p = &s.progress;
            let rate = p.samples_per_second.min(cap);
            total_rate += rate;
            if p.epoch == epoch {
                let (reported, extrapolated) = self.bounded(p, rate, self.epoch_began, now);
                samples += reported;
                estimated += extrapolated;
                counted.push((*peer, extrapolated));
            }
        }
        for (peer, n) in counted {
            let slot = self.remembered.entry(peer).or_insert(0.0);
            *slot = slot.max(n);
        }
        if let Some(own) = &own {
            total_rate += own.samples_per_second;
            if own.epoch == epoch {
                samples += own.samples_accumulated as f64;
                estimated += own.samples_accumulated as f64;
            }
        }
        let num_peers = self.peers.len() + usize::from(own.is_some());
        let num_clients = self
            .peers
            .values()
            .map(|s| &s.progress)
            .chain(own.as_ref())
            .filter(|p| p.client_mode)
            .count();
        let eta = (target - estimated).max(0.0) / total_rate;
        let next_fetch = self.refresh_period(eta, num_peers);
        GlobalProgress {
            epoch,
            samples_accumulated: samples.floor() as u64,
            target_batch_size: cfg.target_batch_size,
            num_peers,
            num_clients,
            eta_next_epoch: now + eta,
            next_fetch_time: now + next_fetch,
        }
    }
}
