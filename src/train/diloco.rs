//! DiLoCo for Rust training loops (arXiv 2311.08105; the Python layer is
//! `hivemesh.DiLoCoOptimizer`): each peer takes `num_inner_steps` optimizer steps of its own
//! on its parameters, then the peers average their **pseudo-gradients** (the parameters at the
//! start of the outer epoch minus the current ones) and every peer applies the same **outer
//! step** (SGD with Nesterov momentum, lr 0.7, momentum 0.9 by default) to the start-of-epoch
//! parameters. Traffic is one all-reduce per `num_inner_steps` steps instead of one per step.
//!
//! # The protocol
//!
//! A [`DiLoCo`] owns an [`Averager`] whose tensors are pseudo-gradient buffers (f32, the
//! parameters' lengths), the parameters themselves (the loop's inner optimizer writes them
//! through [`DiLoCo::params_mut`]) and the **outer state**: the epoch, the start-of-epoch
//! parameters and the outer momentum, identical on every peer of the epoch.
//!
//! 1. [`DiLoCo::inner_step_done`] counts inner steps; the `num_inner_steps`-th ends the epoch.
//! 2. The pseudo-gradients go into the averager's buffers and one averaging round runs, keyed
//!    by the epoch: the group bits are the epoch modulo 256 (8 bits), so a peer retrying a late
//!    round never meets peers already on the next epoch, and every member gathers its epoch
//!    (8 bytes) so that a wrapped key that met another epoch is discarded. The round retries
//!    until [`DiLoCoConfig::round_timeout`].
//! 3. After a round, every member holds the same averaged pseudo-gradient `g` (the butterfly
//!    sends every member the same bytes for a span), and applies the outer step to the start
//!    parameters `s` with the momentum `m` ([`OuterSgd::step`], PyTorch's `SGD`):
//!    `m = μ·m + g`, `s = s − lr·(g + μ·m)` (Nesterov) or `s = s − lr·m`. The parameters become
//!    `s` and the epoch moves on: every peer of the round ends it with identical parameters and
//!    momentum.
//! 4. **Nothing raises for a failed round.** If no round completes in time (no group, a failed
//!    all-reduce, a discarded mix of epochs), the outer step is deferred
//!    ([`OuterStep::Deferred`]): the parameters keep the inner steps' work, so the
//!    pseudo-gradient keeps growing, and the next [`DiLoCo::inner_step_done`] tries again. A
//!    peer that finds a donor announcing a later epoch (below) loads its outer state instead
//!    ([`OuterStep::Reloaded`]) and carries on from there.
//!
//! # Outer state for newcomers
//!
//! The averager serves the outer state through a [`crate::averager::state::StateProvider`]:
//! the start parameters, then the momentum, one f32 tensor each, with the metadata
//! [`STATE_MAGIC`] followed by the epoch (8 bytes, little-endian). Its state priority is the
//! epoch (hivemind's `TrainingStateAverager` announces its epoch the same way), so a peer reads
//! from the donor registry alone, without downloading anything, whether somebody is ahead of
//! it. A peer started with [`DiLoCoConfig::load_state`] downloads the state before its first
//! step and joins at that epoch's outer step.
//!
//! Donors are other peers: what one serves is checked (magic, epoch, tensor count and lengths,
//! finite values) and refused with [`StateCheckError`] when it does not fit, and a state is
//! adopted only if its epoch is ahead of this peer's (a donor announcing a high priority gets
//! one download, not an adoption, unless what it serves checks out). That a state is *honest*
//! is what [`crate::averager::state::Trust`] (`min_agreeing` donors serving the same content
//! hash) is for; the donors of one epoch all serve the same bytes.
//!
//! Compared to the Python `DiLoCoOptimizer`: there is no progress tracker here. The loop decides
//! when an epoch ends (its own count of inner steps), every peer weighs 1 in the average, and
//! "behind" is read from the donors' priorities rather than the swarm's published progress.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::averager::state::{ProvidedState, StateError};
use crate::averager::{Averager, AveragerConfig, AveragerError, StepOptions};
use crate::dht::Dht;
use crate::links::LinkHub;
use crate::shares::lock;
use crate::tensor::{PartViewMut, Tensor};

/// The first bytes of the metadata a DiLoCo donor serves (then the epoch, u64 little-endian).
pub const STATE_MAGIC: &[u8; 8] = b"diloco\x00\x01";

/// The outer optimizer: SGD with momentum, as `torch.optim.SGD(lr, momentum, nesterov)` with no
/// dampening and no weight decay (DiLoCo's: lr 0.7, momentum 0.9, Nesterov).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterSgd {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0: plain SGD).
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for OuterSgd {
    fn default() -> Self {
        Self {
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
        }
    }
}

impl OuterSgd {
    /// One step of `params` along `grad`, with the momentum buffer `momentum` (zero before the
    /// first step, as PyTorch's lazily created buffer equals the first gradient):
    /// `m = μ·m + g`, then `p −= lr·(g + μ·m)` (Nesterov) or `p −= lr·m`.
    ///
    /// # Panics
    /// If the three slices differ in length (a caller's bug, not input).
    pub fn step(&self, params: &mut [f32], grad: &[f32], momentum: &mut [f32]) {
        assert!(
            params.len() == grad.len() && grad.len() == momentum.len(),
            "outer step over slices of different lengths"
        );
        for ((p, &g), m) in params.iter_mut().zip(grad).zip(momentum.iter_mut()) {
            *m = self.momentum * *m + g;
            let d = if self.nesterov {
                g + self.momentum * *m
            } else {
                *m
            };
            *p -= self.lr * d;
        }
    }

    fn check(&self) -> Result<(), DiLoCoError> {
        let ok = self.lr.is_finite()
            && self.lr > 0.0
            && self.momentum.is_finite()
            && (0.0..1.0).contains(&self.momentum);
        if ok {
            Ok(())
        } else {
            Err(DiLoCoError::Config(format!(
                "outer optimizer needs lr > 0 and 0 <= momentum < 1 (got {self:?})"
            )))
        }
    }
}

/// How a [`DiLoCo`] runs.
#[derive(Clone, Debug)]
pub struct DiLoCoConfig {
    /// Inner steps per outer epoch (DiLoCo's H; OpenDiLoCo's `num_inner_steps`).
    pub num_inner_steps: u64,
    /// The outer optimizer.
    pub outer: OuterSgd,
    /// How long one outer round may look for a group and average (retrying) before the outer
    /// step is deferred to the next inner step.
    pub round_timeout: Duration,
    /// Download the outer state from peers before the first step (a peer joining a running
    /// swarm). Without a donor the peer starts from its own parameters at epoch 0.
    pub load_state: bool,
}

impl Default for DiLoCoConfig {
    fn default() -> Self {
        Self {
            num_inner_steps: 500,
            outer: OuterSgd::default(),
            round_timeout: Duration::from_secs(60),
            load_state: false,
        }
    }
}

/// What [`DiLoCo::inner_step_done`] (or [`DiLoCo::outer_step`]) did at the end of an epoch.
#[derive(Clone, Debug, PartialEq)]
pub enum OuterStep {
    /// The pseudo-gradients were averaged over `group_size` peers (this one included) and the
    /// outer optimizer stepped; the peer is now at `epoch`.
    Averaged {
        /// The epoch the peer is in now.
        epoch: u64,
        /// Peers whose pseudo-gradients were averaged.
        group_size: usize,
    },
    /// The peer was behind the swarm: it loaded the outer state of `epoch` from a donor.
    Reloaded {
        /// The epoch the peer is in now.
        epoch: u64,
    },
    /// No round completed: the parameters keep their inner steps and the outer step is tried
    /// again at the next inner step.
    Deferred {
        /// The epoch the peer is still in.
        epoch: u64,
        /// Why (the last round's error).
        reason: String,
    },
}

/// Why a [`DiLoCo`] could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiLoCoError {
    /// Bad configuration or parameters.
    #[error("invalid DiLoCo configuration: {0}")]
    Config(String),
    /// The averager did not start.
    #[error(transparent)]
    Averager(#[from] AveragerError),
    /// Loading the outer state at start failed.
    #[error("loading the outer state: {0}")]
    State(#[from] StateError),
    /// The state a donor served does not fit this run.
    #[error(transparent)]
    BadState(#[from] StateCheckError),
}

/// Why a donor's outer state was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateCheckError {
    /// The metadata is not `STATE_MAGIC` + 8 bytes.
    #[error("metadata is not a DiLoCo outer state ({0} bytes)")]
    Metadata(usize),
    /// The tensor count or lengths differ from this run's parameters.
    #[error("tensors do not match the parameters: {0}")]
    Shape(String),
    /// A value is NaN or infinite.
    #[error("tensor {0} holds a non-finite value")]
    NonFinite(usize),
}

/// The outer state: identical on every peer of an epoch, served to newcomers.
#[derive(Clone, Debug)]
struct OuterState {
    epoch: u64,
    start: Vec<Vec<f32>>,
    momentum: Vec<Vec<f32>>,
}

impl OuterState {
    fn provided(&self) -> Result<ProvidedState, String> {
        let mut metadata = STATE_MAGIC.to_vec();
        metadata.extend_from_slice(&self.epoch.to_le_bytes());
        let tensors = self
            .start
            .iter()
            .chain(&self.momentum)
            .map(|v| Tensor::from_f32(&[v.len()], v.clone()).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        Ok(ProvidedState {
            metadata: Bytes::from(metadata),
            tensors,
        })
    }

    /// Checks a donor's state against this run's parameter lengths.
    fn from_provided(
        metadata: &[u8],
        tensors: &[Tensor],
        lens: &[usize],
    ) -> Result<Self, StateCheckError> {
        let epoch = match metadata.strip_prefix(STATE_MAGIC.as_slice()) {
            Some(rest) => <[u8; 8]>::try_from(rest)
                .map(u64::from_le_bytes)
                .map_err(|_| StateCheckError::Metadata(metadata.len()))?,
            None => return Err(StateCheckError::Metadata(metadata.len())),
        };
        if tensors.len() != 2 * lens.len() {
            return Err(StateCheckError::Shape(format!(
                "{} tensors for {} parameters (start and momentum each)",
                tensors.len(),
                lens.len()
            )));
        }
        let mut values = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let want = lens[i % lens.len()];
            if t.numel() != want {
                return Err(StateCheckError::Shape(format!(
                    "tensor {i} has {} elements, not {want}",
                    t.numel()
                )));
            }
            let v = t.to_f32_vec();
            if v.iter().any(|x| !x.is_finite()) {
                return Err(StateCheckError::NonFinite(i));
            }
            values.push(v);
        }
        let momentum = values.split_off(lens.len());
        Ok(Self {
            epoch,
            start: values,
            momentum,
        })
    }
}

/// Pause between two tries of an outer round.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// A try of an outer round that did not count.
struct Failed {
    reason: String,
    /// Worth another try before the round's deadline (not: shut down, bad configuration).
    again: bool,
}

impl Failed {
    fn again(reason: String) -> Self {
        Self {
            reason,
            again: true,
        }
    }

    fn fatal(reason: String) -> Self {
        Self {
            reason,
            again: false,
        }
    }
}

/// A peer of a DiLoCo run (see the [module docs](self)).
pub struct DiLoCo {
    averager: Averager,
    params: Vec<Vec<f32>>,
    outer: Arc<Mutex<OuterState>>,
    lens: Vec<usize>,
    inner_steps: u64,
    config: DiLoCoConfig,
}

impl std::fmt::Debug for DiLoCo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiLoCo")
            .field("epoch", &self.epoch())
            .field("inner_steps", &self.inner_steps)
            .finish_non_exhaustive()
    }
}

impl DiLoCo {
    /// Starts a peer on a node's DHT and link hub with its initial parameters (one flat f32
    /// vector per tensor; every peer of a run starts from the same ones, or loads them with
    /// [`DiLoCoConfig::load_state`]). `averager` configures the pseudo-gradient rounds (prefix,
    /// group sizes, compression: [`crate::Compression::Sparse`] gives error-feedback top-k);
    /// its state priority is managed here.
    pub async fn start(
        dht: Dht,
        hub: Arc<LinkHub>,
        params: Vec<Vec<f32>>,
        averager: AveragerConfig,
        config: DiLoCoConfig,
    ) -> Result<Self, DiLoCoError> {
        if config.num_inner_steps == 0 {
            return Err(DiLoCoError::Config(
                "num_inner_steps must be at least 1".into(),
            ));
        }
        config.outer.check()?;
        if params.is_empty() || params.iter().any(Vec::is_empty) {
            return Err(DiLoCoError::Config("no parameters, or an empty one".into()));
        }
        if params.iter().flatten().any(|x| !x.is_finite()) {
            return Err(DiLoCoError::Config("a parameter is not finite".into()));
        }
        let lens: Vec<usize> = params.iter().map(Vec::len).collect();
        let buffers = lens
            .iter()
            .map(|&n| Tensor::from_f32(&[n], vec![0.0; n]))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| DiLoCoError::Config(e.to_string()))?;
        let donor = averager.allow_state_sharing;
        let averager = Averager::start(dht, hub, buffers, averager)?;
        let outer = Arc::new(Mutex::new(OuterState {
            epoch: 0,
            start: params.clone(),
            momentum: lens.iter().map(|&n| vec![0.0; n]).collect(),
        }));
        let served = outer.clone();
        averager.set_state_provider(Some(Arc::new(move || lock(&served).provided())));
        let mut me = Self {
            averager,
            params,
            outer,
            lens,
            inner_steps: 0,
            config,
        };
        if me.config.load_state {
            match me.averager.download_state_from_peers().await {
                Ok(Some((loaded, tensors))) => {
                    let state = OuterState::from_provided(&loaded.metadata, &tensors, &me.lens)?;
                    me.adopt(state);
                }
                Ok(None) => tracing::info!("no donor of an outer state: starting at epoch 0"),
                Err(e) => return Err(e.into()),
            }
        }
        if donor {
            me.announce_epoch().await;
        }
        Ok(me)
    }

    /// The parameters (what the inner optimizer trains).
    pub fn params(&self) -> &[Vec<f32>] {
        &self.params
    }

    /// The parameters, to step them with the inner optimizer.
    pub fn params_mut(&mut self) -> &mut [Vec<f32>] {
        &mut self.params
    }

    /// The outer epoch this peer is in (outer steps taken before it).
    pub fn epoch(&self) -> u64 {
        lock(&self.outer).epoch
    }

    /// Inner steps taken in this epoch.
    pub fn inner_steps(&self) -> u64 {
        self.inner_steps
    }

    /// The start-of-epoch parameters and the outer momentum (identical on every peer of the
    /// epoch).
    pub fn outer_state(&self) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let s = lock(&self.outer);
        (s.start.clone(), s.momentum.clone())
    }

    /// The averager of the pseudo-gradients (its metrics, residuals, group bits).
    pub fn averager(&self) -> &Averager {
        &self.averager
    }

    /// Call after every inner optimizer step. At the end of an epoch (the
    /// `num_inner_steps`-th step, or any step after a deferred outer step) runs the outer
    /// step and says what it did; `None` otherwise. Never fails: see [`OuterStep::Deferred`].
    pub async fn inner_step_done(&mut self) -> Option<OuterStep> {
        self.inner_steps += 1;
        if self.inner_steps < self.config.num_inner_steps {
            return None;
        }
        Some(self.outer_step().await)
    }

    /// Ends the epoch now: averages the pseudo-gradients and steps the outer optimizer (or
    /// reloads, or defers: [`OuterStep`]).
    pub async fn outer_step(&mut self) -> OuterStep {
        if let Some(reloaded) = self.reload_if_behind().await {
            return reloaded;
        }
        let epoch = self.epoch();
        let deadline = Instant::now() + self.config.round_timeout;
        let mut reason = String::from("no time for a round");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match self.average(epoch, left).await {
                Ok(group_size) => {
                    self.apply();
                    self.announce_epoch().await;
                    return OuterStep::Averaged {
                        epoch: self.epoch(),
                        group_size,
                    };
                }
                Err(Failed { reason: why, again }) => {
                    tracing::debug!(epoch, error = %why, "outer round failed");
                    reason = why;
                    if !again {
                        break;
                    }
                }
            }
            if let Some(reloaded) = self.reload_if_behind().await {
                return reloaded;
            }
            // The others retry too: a short pause keeps a round that fails at once (a
            // discarded mix of epochs) from spinning.
            tokio::time::sleep(RETRY_PAUSE.min(deadline.saturating_duration_since(Instant::now())))
                .await;
        }
        tracing::warn!(epoch, %reason, "no outer round: retrying at the next inner step");
        OuterStep::Deferred { epoch, reason }
    }

    /// One round over the pseudo-gradients: the group size, or why it failed.
    async fn average(&self, epoch: u64, left: Duration) -> Result<usize, Failed> {
        {
            let s = lock(&self.outer);
            let mut buffers = self.averager.tensors();
            for ((buf, start), now) in buffers.iter_mut().zip(&s.start).zip(&self.params) {
                let PartViewMut::F32(b) = buf.flat_mut() else {
                    return Err(Failed::fatal("pseudo-gradient buffers are not f32".into()));
                };
                for ((b, s), p) in b.iter_mut().zip(start).zip(now) {
                    *b = s - p;
                }
            }
        }
        self.averager
            .set_group_bits(&format!("{:08b}", epoch % 256))
            .map_err(|e| Failed::fatal(e.to_string()))?;
        let outcome = self
            .averager
            .step(StepOptions {
                gather: Bytes::copy_from_slice(&epoch.to_le_bytes()),
                timeout: Some(left),
                allow_retries: true,
                ..StepOptions::default()
            })
            .await
            .map_err(|e| match e {
                AveragerError::Shutdown
                | AveragerError::Config(_)
                | AveragerError::TensorMemory(_) => Failed::fatal(e.to_string()),
                _ => Failed::again(e.to_string()),
            })?;
        let mine = epoch.to_le_bytes();
        if outcome.gathered.iter().any(|g| g.as_ref() != mine) {
            return Err(Failed::again(format!(
                "the round of epoch {epoch} met other epochs: discarded"
            )));
        }
        // A part that kept this peer's own values (its reducer failed, or banned us) would
        // leave us apart from the others: the round does not count, the others (who also
        // miss that span, if its reducer died) retry with us, or move on and we reload.
        if let Some(part) = outcome.report.local_parts().next() {
            return Err(Failed::again(format!(
                "part {part} of the round of epoch {epoch} was not averaged: discarded"
            )));
        }
        let members: std::collections::BTreeSet<usize> = outcome
            .report
            .spans
            .iter()
            .flat_map(|span| &span.segments)
            .filter_map(|seg| seg.contributors.as_ref())
            .flat_map(|c| c.iter())
            .collect();
        let members = members.len();
        Ok(members.max(1))
    }

    /// The outer step on the averaged pseudo-gradients in the averager's buffers.
    fn apply(&mut self) {
        let grads: Vec<Vec<f32>> = self
            .averager
            .tensors()
            .iter()
            .map(Tensor::to_f32_vec)
            .collect();
        let mut s = lock(&self.outer);
        let OuterState {
            start, momentum, ..
        } = &mut *s;
        for ((p, g), m) in start.iter_mut().zip(&grads).zip(momentum.iter_mut()) {
            self.config.outer.step(p, g, m);
        }
        s.epoch += 1;
        self.params.clone_from(&s.start);
        self.inner_steps = 0;
    }

    fn adopt(&mut self, state: OuterState) {
        self.params.clone_from(&state.start);
        *lock(&self.outer) = state;
        self.inner_steps = 0;
    }

    /// Loads the outer state if a donor announces a later epoch than ours.
    async fn reload_if_behind(&mut self) -> Option<OuterStep> {
        let epoch = self.epoch();
        let donors = self.averager.state_donors().await.ok()?;
        #[allow(clippy::cast_precision_loss)] // epochs stay far below 2^53
        let ours = epoch as f64;
        if !donors.iter().any(|d| d.priority > ours) {
            return None;
        }
        match self.averager.download_state_from_peers().await {
            Ok(Some((loaded, tensors))) => {
                match OuterState::from_provided(&loaded.metadata, &tensors, &self.lens) {
                    Ok(state) if state.epoch > epoch => {
                        let now = state.epoch;
                        tracing::info!(from = epoch, to = now, source = %loaded.source, "behind the swarm: loaded the outer state");
                        self.adopt(state);
                        self.announce_epoch().await;
                        Some(OuterStep::Reloaded { epoch: now })
                    }
                    Ok(_) => None,
                    Err(e) => {
                        tracing::warn!(source = %loaded.source, error = %e, "a donor's outer state was refused");
                        None
                    }
                }
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, "outer state not loaded");
                None
            }
        }
    }

    /// Announces the epoch as the state priority (donors only).
    async fn announce_epoch(&self) {
        if self.averager.allow_state_sharing() {
            #[allow(clippy::cast_precision_loss)]
            let priority = self.epoch() as f64;
            if let Err(e) = self.averager.set_state_priority(priority).await {
                tracing::debug!(error = %e, "epoch not announced");
            }
        }
    }

    /// Stops the averager (withdraws the state announcement).
    pub async fn shutdown(self) {
        self.averager.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nesterov_steps_match_a_hand_computed_torch_sgd() {
        // torch: p=1, g=0.5 twice, lr 0.7, momentum 0.9, nesterov.
        // step 1: m = 0.5, d = 0.5 + 0.45 = 0.95, p = 1 - 0.665 = 0.335
        // step 2: m = 0.45 + 0.5 = 0.95, d = 0.5 + 0.855 = 1.355, p = 0.335 - 0.9485 = -0.6135
        let sgd = OuterSgd::default();
        let (mut p, mut m) = (vec![1.0f32], vec![0.0f32]);
        sgd.step(&mut p, &[0.5], &mut m);
        assert!(
            (p[0] - 0.335).abs() < 1e-6 && (m[0] - 0.5).abs() < 1e-6,
            "{p:?} {m:?}"
        );
        sgd.step(&mut p, &[0.5], &mut m);
        assert!(
            (p[0] + 0.6135).abs() < 1e-6 && (m[0] - 0.95).abs() < 1e-6,
            "{p:?} {m:?}"
        );
        // Plain momentum: d = m.
        let plain = OuterSgd {
            nesterov: false,
            ..sgd
        };
        let (mut p, mut m) = (vec![1.0f32], vec![0.0f32]);
        plain.step(&mut p, &[0.5], &mut m);
        plain.step(&mut p, &[0.5], &mut m);
        assert!((p[0] - (1.0 - 0.35 - 0.665)).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn bad_outer_settings_are_refused() {
        for sgd in [
            OuterSgd {
                lr: 0.0,
                ..OuterSgd::default()
            },
            OuterSgd {
                lr: f32::NAN,
                ..OuterSgd::default()
            },
            OuterSgd {
                momentum: 1.0,
                ..OuterSgd::default()
            },
            OuterSgd {
                momentum: -0.1,
                ..OuterSgd::default()
            },
        ] {
            assert!(sgd.check().is_err(), "{sgd:?}");
        }
        assert!(OuterSgd::default().check().is_ok());
    }

    fn state(epoch: u64) -> OuterState {
        OuterState {
            epoch,
            start: vec![vec![1.0, 2.0], vec![3.0]],
            momentum: vec![vec![0.5, 0.25], vec![-1.0]],
        }
    }

    #[test]
    fn a_served_state_reads_back() {
        let s = state(7);
        let p = s.provided().unwrap();
        let back = OuterState::from_provided(&p.metadata, &p.tensors, &[2, 1]).unwrap();
        assert_eq!(back.epoch, 7);
        assert_eq!(back.start, s.start);
        assert_eq!(back.momentum, s.momentum);
    }

    #[test]
    fn a_donor_state_that_does_not_fit_is_refused() {
        let p = state(3).provided().unwrap();
        let lens = [2, 1];
        // Metadata: wrong magic, wrong length.
        let mut bad = p.metadata.to_vec();
        bad[0] ^= 1;
        assert!(matches!(
            OuterState::from_provided(&bad, &p.tensors, &lens),
            Err(StateCheckError::Metadata(_))
        ));
        assert!(matches!(
            OuterState::from_provided(&p.metadata[..12], &p.tensors, &lens),
            Err(StateCheckError::Metadata(12))
        ));
        // Tensors: too few, a wrong length, a NaN.
        assert!(matches!(
            OuterState::from_provided(&p.metadata, &p.tensors[..3], &lens),
            Err(StateCheckError::Shape(_))
        ));
        assert!(matches!(
            OuterState::from_provided(&p.metadata, &p.tensors, &[1, 2]),
            Err(StateCheckError::Shape(_))
        ));
        let mut tensors = p.tensors.clone();
        tensors[3] = Tensor::from_f32(&[1], vec![f32::NAN]).unwrap();
        assert_eq!(
            OuterState::from_provided(&p.metadata, &tensors, &lens).unwrap_err(),
            StateCheckError::NonFinite(3)
        );
    }

    proptest! {
        /// From a zero momentum, one step moves every parameter by `lr·(1 + μ)·g` with
        /// Nesterov and by `lr·g` without, and leaves `g` in the momentum.
        #[test]
        fn a_first_step_moves_by_the_closed_form(
            pg in proptest::collection::vec((-10.0f32..10.0, -10.0f32..10.0), 1..32),
            lr in 0.01f32..1.0,
            mu in 0.0f32..0.99,
            nesterov in any::<bool>(),
        ) {
            let sgd = OuterSgd { lr, momentum: mu, nesterov };
            let (mut p, g): (Vec<f32>, Vec<f32>) = pg.iter().copied().unzip();
            let before = p.clone();
            let mut m = vec![0.0; p.len()];
            sgd.step(&mut p, &g, &mut m);
            let k = if nesterov { 1.0 + mu } else { 1.0 };
            for i in 0..p.len() {
                let want = before[i] - lr * k * g[i];
                prop_assert!((p[i] - want).abs() <= 1e-4 * (1.0 + want.abs()), "{} vs {}", p[i], want);
                prop_assert_eq!(m[i], g[i]);
            }
        }
    }
}
