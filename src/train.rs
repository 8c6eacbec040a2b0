//! Collaborative training's progress: when the swarm has accumulated enough samples to end an
//! epoch (hivemind's `ProgressTracker`, `hivemind/optim/progress_tracker.py`).
//!
//! # The protocol
//!
//! Every peer of a run publishes its progress, a [`LocalProgress`] (its epoch, the samples it
//! accumulated toward the next one, its throughput in samples per second, the time it reported
//! and whether it is a client), under the DHT key `"{prefix}_progress"` ([`progress_key`], an
//! [owned key](crate::dht::owned_key)) at its own **owner subkey**: signed with its identity,
//! so nobody can publish or withdraw in its name, and nobody can squat the key. The record is a
//! fixed 34-byte encoding ([`ProgressRecord`]); it expires `metadata_expiration` after it is
//! written, and is re-written after reports (at once when the epoch changes, otherwise at most
//! once per period at which the peers fetch, see below: from `max_refresh_period` while the
//! end of the epoch is far down to `min_refresh_period` near it; readers extrapolate the
//! samples in between) and every half `metadata_expiration`. A peer publishes only while
//! it contributes: once it has reported samples, and while it reported them at most one epoch
//! before the global one (hivemind's rule, so a monitor or a peer that stopped is not
//! counted). At shutdown it writes [`ProgressRecord::Withdrawn`] with a later expiration, which
//! supersedes its progress (hivemind writes `None`).
//!
//! Every peer reads all the records on a schedule and derives the swarm's progress, a
//! [`GlobalProgress`] ([`ProgressCore`], sans-IO; [`ProgressTracker`] is its tokio shell):
//!
//! * the **global epoch**: the highest epoch among the peers that are not clients (see the
//!   bounds below), never below this peer's own;
//! * the **samples accumulated** toward it by the peers at it, and this peer's own reports
//!   added at once between fetches;
//! * the **number of peers and clients** reporting;
//! * the **ETA** of the next epoch: the samples still missing, after extrapolating each peer
//!   at the global epoch from its report time at its rate, over the sum of all rates;
//! * **when to fetch next**: `clip(ETA × n / n_max, min_refresh_period, max_refresh_period)`,
//!   where `n` peers report and `n_max = max(n + expected_drift_peers, n × (1 +
//!   expected_drift_rate))` allows for peers joining, so the fetches come faster as the end of
//!   the epoch nears; every `default_refresh_period` while nobody reports.
//!
//! A peer is **ready to end its epoch** ([`ProgressCore::ready_to_update_epoch`]) when the
//! global epoch is ahead of its own, the samples reach `target_batch_size`, or the ETA has
//! passed. Ending it ([`ProgressCore::update_epoch`]) moves the global epoch along if it was
//! behind, with no samples and an infinite ETA until the next fetch; a fetch begun before is
//! not applied after ([`ProgressCore::generation`]). The local throughput is an exponential
//! moving average of seconds per sample ([`PerformanceEma`], `performance_ema_alpha`), paused
//! while the epoch ends.
//!
//! A record is believed while its DHT entry lives *and* `now <= its report time +
//! metadata_expiration + max_clock_skew`, so a record written with a far expiration does not
//! outlive its report for long.
//!
//! # Hostile records
//!
//! Records are other peers' claims. A malformed one (wrong length or tag, unknown flags, a
//! rate that is NaN, infinite or negative, a time that is not finite, a time further ahead of
//! this peer's clock than `max_clock_skew`) is rejected with a typed [`RecordError`] and
//! ignored. What a well-formed record can claim is bounded as follows ([`ProgressLimits`]):
//!
//! 1. **Rates.** Another peer's rate counts at most `max_rate_factor` (10) times the lower
//!    median of the meaningful rates (above [`MIN_MEANINGFUL_RATE`]) of the reporting peers,
//!    this one included. One peer cannot move the median, so a claim of 10^12 samples/s
//!    counts as ten typical peers at most, for the ETA as for the samples.
//! 2. **Samples.** Another peer's samples toward the global epoch count at most what its
//!    capped rate produces in the time since this peer saw the epoch begin, plus
//!    `epoch_grace` (10 s, for the others having begun a little earlier): a huge count ends
//!    nobody's epoch, it counts as a fast peer's would.
//! 3. **Epochs.** Among the *other* non-client peers, an epoch counts once **two** of them
//!    report it or a later one (the second-highest epoch; the only one's if there is just one,
//!    since then nothing can be compared). A peer alone ahead of that is followed one epoch
//!    at a time, and only once the samples toward the current epoch (bounded as above,
//!    counting for peers that already moved on what was last counted for them) reach
//!    `lead_fraction` (½) of the target. So a peer claiming epoch 10^9 moves nobody far:
//!    at worst every epoch ends at half its samples. An honest peer that ends an epoch first
//!    is followed as soon as the swarm saw half the target, or at once when a second peer
//!    follows it; a newcomer adopts the epoch two others agree on.
//!
//! This peer's own record is never capped: it counts its own samples and rate as they are,
//! so a lone peer (or a fast one whose rate exceeds the cap) still ends its epochs by the
//! target. What the bounds do not cover: a swarm of two (the only other peer is believed), and
//! sybils, many identities that together move the median or agree on an epoch. Clients never
//! move the global epoch, whatever they claim; their samples count, bounded as everyone's.
//!
//! # The shell
//!
//! [`ProgressTracker`] owns one task running two loops: the reporter publishes whenever
//! [`ProgressCore::publish_due`] says so (woken by every report), the fetcher sleeps until the
//! next fetch time (or until updates resume) and applies the fetch unless updates are paused
//! ([`ProgressTracker::pause_updates`]) or the epoch changed meanwhile. Every DHT request runs
//! under `request_timeout`, every sleep is capped at `max_refresh_period` (a clock step cannot
//! stall a loop), and [`ProgressTracker::shutdown`] stops the loops (aborting them after its
//! timeout) before withdrawing the record.
//!
//! # Metrics for monitors
//!
//! Beside its progress, a peer may publish a [`PeerMetrics`] record under
//! `"{prefix}_metrics"` ([`metrics_key`], also at its owner subkey): its loss, how others reach
//! it, its averaging rounds, a display name. Training never reads it; `hivemesh monitor`
//! ([`crate::monitor`]) shows it. [`MetricsPublisher`] writes it (see [`publisher`] for the
//! schedule); the encoding and its checks are in [`metrics`].

pub mod diloco;
mod ema;
pub mod metrics;
mod progress;
pub mod publisher;
mod record;
pub(crate) mod task;
mod tracker;

#[cfg(test)]
mod tests;

pub use diloco::{DiLoCo, DiLoCoConfig, DiLoCoError, OuterSgd, OuterStep, StateCheckError};
pub use ema::{EmaError, PerformanceEma};
pub use metrics::{
    MAX_NAME_BYTES, MetricsError, MetricsRecord, ModeClaim, PeerMetrics, ReachClaim, metrics_key,
};
pub use progress::{
    ConfigError, FetchSummary, GlobalProgress, MIN_MEANINGFUL_RATE, ProgressConfig, ProgressCore,
    ProgressLimits,
};
pub use publisher::{MetricsConfig, MetricsPublisher, MetricsSchedule};
pub use record::{LocalProgress, PROGRESS_RECORD_BYTES, ProgressRecord, RecordError};
pub use tracker::{PauseGuard, ProgressTracker, TrackerError, progress_key};
