//! The monitor's state, sans-IO: fetches of the progress and metrics records in, a
//! [`Snapshot`] out. Every method takes the current DHT time (`now`, seconds since the UNIX
//! epoch); see the [module docs](super) for the rules.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use libp2p::PeerId;
use serde::Serialize;

use crate::train::{
    ConfigError, FetchSummary, LocalProgress, MetricsError, MetricsRecord, ModeClaim, PeerMetrics,
    ProgressConfig, ProgressCore, ProgressLimits,
};

/// What the monitor keeps, and how often it looks.
#[derive(Clone, Debug, PartialEq)]
pub struct MonitorConfig {
    /// How often to fetch the records.
    pub refresh_period: Duration,
    /// Bound on one fetch.
    pub request_timeout: Duration,
    /// Rows of the peer table, gone peers included.
    pub max_peers: usize,
    /// Points of history (one per fetch).
    pub history_len: usize,
    /// How long a peer that left stays in the table.
    pub gone_retention: Duration,
    /// The run's target batch size; `None`: the lower median of what the peers' metrics say.
    pub target_batch_size: Option<u64>,
    /// How long the peers' records live (the progress tracker's `metadata_expiration`): a
    /// record is believed while its entry lives and at most this (plus the clock skew) after
    /// its report time.
    pub metadata_expiration: Duration,
    /// Bounds on the peers' progress claims (the progress core's).
    pub limits: ProgressLimits,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            refresh_period: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            max_peers: 1000,
            history_len: 900,
            gone_retention: Duration::from_secs(15 * 60),
            target_batch_size: None,
            metadata_expiration: Duration::from_secs(60),
            limits: ProgressLimits::default(),
        }
    }
}

impl MonitorConfig {
    /// Checks that the parameters make sense.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, reason| Err(ConfigError { field, reason });
        if self.refresh_period.is_zero() || self.request_timeout.is_zero() {
            return bad(
                "refresh_period",
                "refresh period and timeout must be positive",
            );
        }
        if self.max_peers == 0 || self.history_len == 0 {
            return bad(
                "max_peers",
                "table and history must hold at least one entry",
            );
        }
        if self.target_batch_size == Some(0) {
            return bad("target_batch_size", "must be positive");
        }
        Ok(())
    }
}

/// A target nobody said: the epoch logic works, the ETA is not shown.
const UNKNOWN_TARGET: u64 = u64::MAX;

/// One row of the peer table.
#[derive(Clone, Debug)]
struct Row {
    progress: Option<LocalProgress>,
    metrics: Option<PeerMetrics>,
    /// The latest report time of its records.
    last_seen: f64,
    gone_since: Option<f64>,
    /// The latest entry expiration seen under each key (progress, metrics): the version of
    /// its records. An older version (a stale replica's answer) is ignored.
    versions: [f64; 2],
}

/// One point of history.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HistoryPoint {
    /// When (DHT time).
    pub time: f64,
    /// The global epoch.
    pub epoch: u64,
    /// Peers reporting progress, clients included.
    pub peers: usize,
    /// Of which clients.
    pub clients: usize,
    /// The sum of the live peers' claimed rates.
    pub samples_per_second: f64,
    /// The mean loss the live peers report, if any does.
    pub loss: Option<f64>,
    /// Averaging rounds the peers finished since the previous point.
    pub rounds_ok: u64,
    /// Averaging rounds that failed for them since the previous point.
    pub rounds_failed: u64,
    /// The mean size of the peers' last groups, if any reports one.
    pub group_size: Option<f64>,
}

/// The run as a whole.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GlobalView {
    /// The global epoch (the progress core's rule).
    pub epoch: u64,
    /// Samples accumulated toward the next epoch.
    pub samples_accumulated: u64,
    /// The target batch size, if known.
    pub target_batch_size: Option<u64>,
    /// Peers reporting progress, clients included.
    pub num_peers: usize,
    /// Of which clients.
    pub num_clients: usize,
    /// Seconds until the next epoch is expected (`None` while the target is unknown or
    /// nobody trains).
    pub eta_seconds: Option<f64>,
    /// The sum of the live peers' claimed rates.
    pub samples_per_second: f64,
    /// The mean loss the live peers report.
    pub loss: Option<f64>,
    /// Averaging rounds finished, summed over the window.
    pub rounds_ok: u64,
    /// Averaging rounds failed, summed over the window.
    pub rounds_failed: u64,
}

/// One row of the peer table as shown. Every string but the fixed names comes from the
/// network: the page renders it as text.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeerView {
    /// Its full peer id (base58).
    pub peer_id: String,
    /// The last 8 characters of it.
    pub short_id: String,
    /// The name it gave (hostile: any text).
    pub name: String,
    /// `live` or `gone`.
    pub status: &'static str,
    /// How others reach it (`client` for clients), as it says.
    pub reach: &'static str,
    /// `node`, `client` or `aux`.
    pub mode: &'static str,
    /// Its epoch.
    pub epoch: Option<u64>,
    /// Its claimed rate (0 once gone).
    pub samples_per_second: f64,
    /// Its share of the swarm's claimed rate (0 to 1).
    pub share: f64,
    /// The latest report time of its records.
    pub last_seen: f64,
    /// When the monitor saw it leave.
    pub gone_since: Option<f64>,
    /// Its loss.
    pub loss: Option<f64>,
    /// Averaging rounds it finished.
    pub rounds_ok: Option<u32>,
    /// Averaging rounds that failed for it.
    pub rounds_failed: Option<u32>,
    /// The size of its last group.
    pub group_size: Option<u16>,
}

/// Everything the page shows (and `/api/state` returns).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    /// The run.
    pub run_id: String,
    /// When this was taken (DHT time).
    pub now: f64,
    /// Fetches applied so far.
    pub fetches: u64,
    /// When the last fetch was applied.
    pub last_fetch: Option<f64>,
    /// Why the last fetch failed, if it did.
    pub last_error: Option<String>,
    /// The run as a whole.
    pub global: GlobalView,
    /// The peer table: live peers first, fastest first; then the ones that left, latest first.
    pub peers: Vec<PeerView>,
    /// The history window, oldest first.
    pub history: Vec<HistoryPoint>,
    /// Malformed records seen so far.
    pub rejected_records: u64,
    /// Live peers left out of the table at the last fetch (it was full).
    pub untracked_peers: usize,
    /// The table's size.
    pub max_peers: usize,
    /// The history's length.
    pub history_len: usize,
}

/// What one fetch held.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ApplySummary {
    /// The progress records.
    pub progress: FetchSummary,
    /// Live metrics records.
    pub metrics_accepted: usize,
    /// Malformed metrics records, with their peers.
    pub metrics_rejected: Vec<(PeerId, MetricsError)>,
}

/// The monitor's state (see the [module docs](super)).
#[derive(Clone, Debug)]
pub struct MonitorState {
    config: MonitorConfig,
    core: ProgressCore,
    rows: BTreeMap<PeerId, Row>,
    history: VecDeque<HistoryPoint>,
    rejected: u64,
    untracked: usize,
    fetches: u64,
    last_fetch: Option<f64>,
    last_error: Option<String>,
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / f64::from(n))
}

impl MonitorState {
    /// A state with nothing fetched yet; `me` is the monitor's own peer id (its own records,
    /// if any, are not shown).
    pub fn new(config: MonitorConfig, me: PeerId, now: f64) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut progress = ProgressConfig::new(config.target_batch_size.unwrap_or(UNKNOWN_TARGET));
        progress.client_mode = true;
        progress.metadata_expiration = config.metadata_expiration;
        progress.limits = config.limits.clone();
        let core = ProgressCore::new(progress, me, now)?;
        Ok(Self {
            config,
            core,
            rows: BTreeMap::new(),
            history: VecDeque::new(),
            rejected: 0,
            untracked: 0,
            fetches: 0,
            last_fetch: None,
            last_error: None,
        })
    }

    /// The parameters.
    pub fn config(&self) -> &MonitorConfig {
        &self.config
    }

    /// Rows in the peer table.
    pub fn table_len(&self) -> usize {
        self.rows.len()
    }

    /// Points of history held.
    pub fn history_len(&self) -> usize {
        self.history.len()
    }

    /// Notes that a fetch failed; the records fetched before expire as they would.
    pub fn fetch_failed(&mut self, error: String, now: f64) {
        self.core.recompute(now);
        self.last_error = Some(error);
    }

    /// Takes one fetch: `(peer, record bytes, entry expiration)` per owner entry under the
    /// progress key and under the metrics key.
    pub fn apply<'a, 'b>(
        &mut self,
        progress: impl IntoIterator<Item = (PeerId, &'a [u8], f64)>,
        metrics: impl IntoIterator<Item = (PeerId, &'b [u8], f64)>,
        now: f64,
    ) -> ApplySummary {
        let mut seen: HashMap<PeerId, [f64; 2]> = HashMap::new();
        let progress = self.current(0, progress, &mut seen);
        let metrics = self.current(1, metrics, &mut seen);
        let mut summary = ApplySummary {
            progress: self.core.apply_fetch(progress, now),
            ..ApplySummary::default()
        };
        let live_metrics = self.decode_metrics(metrics, now, &mut summary);
        self.rejected += (summary.progress.rejected.len() + summary.metrics_rejected.len()) as u64;
        if self.config.target_batch_size.is_none() {
            let mut targets: Vec<u64> = live_metrics
                .values()
                .map(|m| m.target_batch_size)
                .filter(|t| *t > 0)
                .collect();
            targets.sort_unstable();
            let target = targets
                .get(targets.len().saturating_sub(1) / 2)
                .copied()
                .unwrap_or(UNKNOWN_TARGET);
            if target != self.core.config().target_batch_size {
                // Positive by construction.
                let _ = self.core.set_target_batch_size(target, now);
            }
        }
        let mut live: BTreeMap<PeerId, Row> = self
            .core
            .peers()
            .map(|(peer, p)| {
                let row = Row {
                    progress: Some(p),
                    metrics: None,
                    last_seen: p.time,
                    gone_since: None,
                    versions: [f64::NEG_INFINITY; 2],
                };
                (peer, row)
            })
            .collect();
        for (peer, m) in live_metrics {
            let row = live.entry(peer).or_insert(Row {
                progress: None,
                metrics: None,
                last_seen: m.time,
                gone_since: None,
                versions: [f64::NEG_INFINITY; 2],
            });
            row.last_seen = row.last_seen.max(m.time);
            row.metrics = Some(m);
        }

        let (mut rounds_ok, mut rounds_failed) = (0u64, 0u64);
        for (peer, row) in &live {
            if let Some(old) = self.rows.get(peer).and_then(|r| r.metrics.as_ref())
                && let Some(new) = &row.metrics
            {
                // A counter that went down: the peer restarted.
                let delta = |new: u32, old: u32| u64::from(new.checked_sub(old).unwrap_or(new));
                rounds_ok += delta(new.rounds_ok, old.rounds_ok);
                rounds_failed += delta(new.rounds_failed, old.rounds_failed);
            }
        }
        let retention = self.config.gone_retention.as_secs_f64();
        for (peer, row) in self.rows.iter_mut() {
            if !live.contains_key(peer) && row.gone_since.is_none() {
                row.gone_since = Some(now);
            }
        }
        self.rows
            .retain(|_, r| r.gone_since.is_none_or(|t| now - t <= retention));
        self.untracked = 0;
        for (peer, row) in live {
            if let Some(slot) = self.rows.get_mut(&peer) {
                *slot = Row {
                    versions: slot.versions,
                    ..row
                };
            } else if self.make_room() {
                self.rows.insert(peer, row);
            } else {
                self.untracked += 1;
            }
        }
        for (peer, versions) in seen {
            if let Some(row) = self.rows.get_mut(&peer) {
                for (v, s) in row.versions.iter_mut().zip(versions) {
                    *v = v.max(s);
                }
            }
        }

        let live_rows = || self.rows.values().filter(|r| r.gone_since.is_none());
        let global = self.core.global_progress();
        let point = HistoryPoint {
            time: now,
            epoch: global.epoch,
            peers: global.num_peers,
            clients: global.num_clients,
            samples_per_second: live_rows().map(rate).sum(),
            loss: mean(live_rows().filter_map(|r| r.metrics.as_ref()?.loss)),
            rounds_ok,
            rounds_failed,
            group_size: mean(
                live_rows()
                    .filter_map(|r| r.metrics.as_ref())
                    .filter(|m| m.last_group_size > 0)
                    .map(|m| f64::from(m.last_group_size)),
            ),
        };
        self.history.push_back(point);
        while self.history.len() > self.config.history_len {
            self.history.pop_front();
        }
        self.fetches += 1;
        self.last_fetch = Some(now);
        self.last_error = None;
        summary
    }

    /// The entries under key `k` (0: progress, 1: metrics) not older than what the table
    /// already saw of their peers (a DHT answer may come from a replica that missed the latest
    /// writes: a peer's withdrawal must not be undone by its older record, nor its epoch go
    /// back); notes each peer's version in `seen`.
    fn current<'a>(
        &self,
        k: usize,
        entries: impl IntoIterator<Item = (PeerId, &'a [u8], f64)>,
        seen: &mut HashMap<PeerId, [f64; 2]>,
    ) -> Vec<(PeerId, &'a [u8], f64)> {
        entries
            .into_iter()
            .filter(|(peer, _, expiration)| {
                let known = self
                    .rows
                    .get(peer)
                    .map_or(f64::NEG_INFINITY, |r| r.versions[k]);
                if *expiration < known {
                    return false;
                }
                let slot = seen.entry(*peer).or_insert([f64::NEG_INFINITY; 2]);
                slot[k] = slot[k].max(*expiration);
                true
            })
            .collect()
    }

    fn decode_metrics<'b>(
        &self,
        entries: impl IntoIterator<Item = (PeerId, &'b [u8], f64)>,
        now: f64,
        summary: &mut ApplySummary,
    ) -> HashMap<PeerId, PeerMetrics> {
        let skew = self.config.limits.max_clock_skew.as_secs_f64();
        let lifetime = self.config.metadata_expiration.as_secs_f64() + skew;
        let me = self.core.peer_id();
        let mut live = HashMap::new();
        for (peer, bytes, expiration) in entries {
            if peer == me {
                continue;
            }
            match MetricsRecord::decode(bytes) {
                Ok(MetricsRecord::Metrics(m)) if m.time > now + skew => {
                    let ahead = m.time - now;
                    let e = MetricsError::FromTheFuture {
                        time: m.time,
                        ahead,
                    };
                    summary.metrics_rejected.push((peer, e));
                }
                Ok(MetricsRecord::Metrics(m)) => {
                    if now <= expiration && now <= m.time + lifetime {
                        summary.metrics_accepted += 1;
                        live.insert(peer, m);
                    }
                }
                Ok(MetricsRecord::Withdrawn) => {}
                Err(e) => summary.metrics_rejected.push((peer, e)),
            }
        }
        live
    }

    /// Frees a row for a newcomer if the table is full: the peer that left longest ago goes;
    /// live peers are never evicted (a newcomer that finds the table full of live peers is
    /// counted as untracked, and gets the first row that frees up).
    fn make_room(&mut self) -> bool {
        if self.rows.len() < self.config.max_peers {
            return true;
        }
        let oldest = self
            .rows
            .iter()
            .filter_map(|(p, r)| Some((r.gone_since?, *p)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        match oldest {
            Some((_, peer)) => {
                self.rows.remove(&peer);
                true
            }
            None => false,
        }
    }

    /// What the page shows, at `now`.
    pub fn snapshot(&self, run_id: &str, now: f64) -> Snapshot {
        let g = self.core.global_progress();
        let target = (g.target_batch_size != UNKNOWN_TARGET).then_some(g.target_batch_size);
        let total: f64 = self
            .rows
            .values()
            .filter(|r| r.gone_since.is_none())
            .map(rate)
            .sum();
        let mut peers: Vec<PeerView> = self
            .rows
            .iter()
            .map(|(peer, r)| view(peer, r, total))
            .collect();
        peers.sort_by(|a, b| {
            let key = |p: &PeerView| (p.gone_since.is_some(), -p.samples_per_second);
            let (ga, ra) = key(a);
            let (gb, rb) = key(b);
            ga.cmp(&gb)
                .then(ra.total_cmp(&rb))
                .then(
                    b.gone_since
                        .unwrap_or(0.0)
                        .total_cmp(&a.gone_since.unwrap_or(0.0)),
                )
                .then(a.peer_id.cmp(&b.peer_id))
        });
        let eta = g.eta_next_epoch - now;
        let last = self.history.back();
        let global = GlobalView {
            epoch: g.epoch,
            samples_accumulated: g.samples_accumulated,
            target_batch_size: target,
            num_peers: g.num_peers,
            num_clients: g.num_clients,
            eta_seconds: (target.is_some() && g.num_peers > 0 && eta.is_finite())
                .then_some(eta.max(0.0)),
            samples_per_second: total,
            loss: last.and_then(|p| p.loss),
            rounds_ok: self.history.iter().map(|p| p.rounds_ok).sum(),
            rounds_failed: self.history.iter().map(|p| p.rounds_failed).sum(),
        };
        Snapshot {
            run_id: run_id.to_owned(),
            now,
            fetches: self.fetches,
            last_fetch: self.last_fetch,
            last_error: self.last_error.clone(),
            global,
            peers,
            history: self.history.iter().cloned().collect(),
            rejected_records: self.rejected,
            untracked_peers: self.untracked,
            max_peers: self.config.max_peers,
            history_len: self.config.history_len,
        }
    }
}

/// A live row's claimed rate: its progress record's, else its metrics'.
fn rate(r: &Row) -> f64 {
    match (&r.progress, &r.metrics) {
        (Some(p), _) => p.samples_per_second,
        (None, Some(m)) => m.samples_per_second,
        (None, None) => 0.0,
    }
}

fn view(peer: &PeerId, r: &Row, total: f64) -> PeerView {
    let id = peer.to_base58();
    let live = r.gone_since.is_none();
    let m = r.metrics.as_ref();
    let mode = match (m, &r.progress) {
        (Some(m), _) => m.mode,
        (None, Some(p)) if p.client_mode => ModeClaim::Client,
        _ => ModeClaim::Node,
    };
    let reach = if mode == ModeClaim::Client {
        "client"
    } else {
        m.map_or("unknown", |m| m.reach.name())
    };
    let samples_per_second = if live { rate(r) } else { 0.0 };
    PeerView {
        short_id: id[id.len().saturating_sub(8)..].to_owned(),
        peer_id: id,
        name: m.map(|m| m.name.clone()).unwrap_or_default(),
        status: if live { "live" } else { "gone" },
        reach,
        mode: mode.name(),
        epoch: r.progress.map(|p| p.epoch).or(m.map(|m| m.epoch)),
        samples_per_second,
        share: if total > 0.0 {
            samples_per_second / total
        } else {
            0.0
        },
        last_seen: r.last_seen,
        gone_since: r.gone_since,
        loss: m.and_then(|m| m.loss),
        rounds_ok: m.map(|m| m.rounds_ok),
        rounds_failed: m.map(|m| m.rounds_failed),
        group_size: m.map(|m| m.last_group_size),
    }
}
