//! The Averager: what a training loop talks to. `step()` finds a group through the DHT
//! ([`crate::matchmaking`]), links to its members ([`crate::links`]), runs one butterfly
//! all-reduce ([`crate::runner`]) and adds the resulting deltas to the local tensors.
//!
//! # Shape
//!
//! [`Averager::start`] spawns one **actor task** that owns the step machinery; the
//! [`Averager`] handle and every [`StepControl`] talk to it over bounded channels. The actor:
//!
//! * serves this averager's matchmaking protocol (`/hivemesh/mm/1/<prefix>`,
//!   [`control`]) all the time: between steps it answers join requests with
//!   `NotLookingForGroup`, so a peer asking a stale declaration learns at once;
//! * runs one step at a time, in request order. A step is: build a [`Matchmaker`] for the key of
//!   this step (hivemind-style rotating bits from a [`KeyManager`], or a Moshpit [`Grid`]
//!   line), drive it with wall-clock time, DHT reads/writes and messages until the group is
//!   assembled or matchmaking fails; wait for the step's trigger; link to the members (TLS
//!   where a data address is known, libp2p streams otherwise); run the round; add the deltas.
//!
//! # Tensors stay usable
//!
//! The averager holds the tensors behind a mutex ([`Averager::tensors`]). A round works on a
//! snapshot taken when the all-reduce begins and, at the end, adds `average − snapshot` to the
//! *current* tensors, holding the lock only for that addition. Local updates made while the
//! round ran are kept (hivemind's delta rule).
//!
//! # Cancellation
//!
//! [`StepControl::cancel`] stops a step in any stage: during matchmaking the matchmaker leaves
//! its group cleanly; during the all-reduce the round is cancelled through
//! [`crate::runner::run_round_cancellable`], which sends aborts to the peers (so they finish
//! without us instead of waiting for timeouts); the tensors are left unchanged.
//!
//! # State sharing
//!
//! Next to the actor, the averager serves its state to newcomers and announces itself as a
//! donor; [`Averager::load_state_from_peers`] downloads a state from such donors (see
//! [`state`]).

pub mod control;
mod devices;
pub mod node;
pub mod state;
mod step_control;

pub use devices::AveragedTensor;
use step_control::{ParamsCell, StepParams};
pub use step_control::{Stage, StepControl, StepControlError};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::allreduce::{Mode, Outcome, RoundConfig, RoundReport, TensorDescriptor};
use crate::buffers::BufferPool;
use crate::compression::Compression;
use crate::compression::feedback::ErrorFeedback;
use crate::dht::{Dht, DhtTime};
use crate::links::{Carrier, LinkHub, LinkKind, LinkPeer};
use crate::matchmaking::{
    self, Config as MmConfig, DhtRequest, Event, Grid, GroupKey, KeyManager, Matchmaker,
    MatchmakingError, MemberInfo, Message, RejectReason, Reply, ReplyBody,
};
use crate::reach::Reach;
use crate::runner::{self, RunnerConfig};
use crate::tensor::Tensor;

/// Where a step's group key comes from.
#[derive(Clone, Debug)]
pub enum KeySchedule {
    /// hivemind's scheme: `"{prefix}.0b{bits}"`, the bits rotated after every group.
    Bits {
        /// Initial bits (`""`: one bucket).
        initial_bits: String,
    },
    /// Moshpit grid: this peer sits at `coords` of `grid`; step `t` groups along dimension
    /// `t mod dims`.
    Grid {
        /// The grid.
        grid: Grid,
        /// This peer's coordinates.
        coords: Vec<usize>,
    },
}

/// Averager parameters (hivemind's `DecentralizedAverager` arguments).
#[derive(Clone, Debug)]
pub struct AveragerConfig {
    /// Averaging prefix: peers with the same prefix (and tensor schema) average together.
    pub prefix: String,
    /// Close a group as soon as it has this many members.
    pub target_group_size: Option<usize>,
    /// Smallest group worth averaging in.
    pub min_group_size: usize,
    /// How long to look for peers before closing a smaller group.
    pub min_matchmaking_time: Duration,
    /// Bound on every matchmaking request.
    pub request_timeout: Duration,
    /// All-reduce: a sender silent this long is banned.
    pub sender_timeout: Duration,
    /// All-reduce: a reducer silent this long is failed.
    pub reducer_timeout: Duration,
    /// All-reduce: bound on the whole round.
    pub round_timeout: Duration,
    /// All-reduce: derive the sender and reducer timeouts from part sizes, the members'
    /// declared measured rates and the round's observed arrivals, within these bounds
    /// ([`crate::allreduce::deadline`]); `None` (the default) keeps the fixed ones.
    pub adaptive_timeouts: Option<crate::allreduce::AdaptiveTimeouts>,
    /// All-reduce: pace every flow to another member at the rate the plan gives it (from the
    /// members' declared measured rates, with headroom; [`crate::allreduce::pacing`]), so that
    /// each flow gets its planned share of the lines rather than TCP's per-flow share, and
    /// arrives smoothly. Default `true`; nothing is paced while a member's rates are unknown.
    pub pace_links: bool,
    /// Bound on linking to a group's members. Also how much later than this peer the others
    /// may begin the all-reduce (they may still be linking): their first parts and replies
    /// are awaited that long after linking began (twice that where a census runs), plus the
    /// usual timeout ([`crate::allreduce::RoundConfig::start_grace`]).
    pub link_timeout: Duration,
    /// Target part size in bytes.
    pub part_size_bytes: usize,
    /// Codec for parts.
    pub compression: Compression,
    /// How this peer combines the contributions to the parts it reduces: the weighted mean
    /// (default) or the robust [`CenteredClip`](crate::allreduce::CenteredClip), which a
    /// minority of members sending huge values cannot drag far. Set the same on every peer
    /// of a swarm: each part's reducer decides for that part.
    pub aggregator: crate::allreduce::Aggregator,
    /// Node (sends and reduces), client (sends only; cannot be dialled) or aux (reduces only);
    /// `None` (the default, hivemind's `client_mode=None`): a node, or a client when this
    /// node is behind a NAT that nobody can dial or punch through ([`Reach::Private`]), so
    /// that such a peer never holds up a group as a reducer.
    pub mode: Option<Mode>,
    /// Let this peer's tensor data go through relays when no direct connection to another
    /// member can be made (both members must allow it; within the relay's limits). Default
    /// `false`: relays carry only control messages and hole-punch signalling.
    pub allow_relayed_data: bool,
    /// Advertised bandwidth for load balancing (any unit shared by the group).
    pub bandwidth: Option<f64>,
    /// Group keys.
    pub keys: KeySchedule,
    /// Serve this averager's state to newcomers ([`state`]). Only [`Mode::Node`] averagers
    /// share: for clients and aux peers this is ignored. Default `true`.
    pub allow_state_sharing: bool,
    /// Donor priority announced to newcomers (finite; higher is asked first). Default 0.
    pub state_priority: f64,
    /// State download and serving parameters.
    pub state: state::StateConfig,
    /// Test hook, not for use: a step whose round is over stops here before applying its
    /// result (after taking its snapshot), so that a test can change the tensors meanwhile.
    #[doc(hidden)]
    pub apply_gate: Option<ApplyGate>,
}

/// Test hook ([`AveragerConfig::apply_gate`]): a step signals `reached` (one permit) once
/// its round is over and waits for `release` (at most the round timeout) before applying.
#[doc(hidden)]
#[derive(Clone, Debug, Default)]
pub struct ApplyGate {
    /// Notified (a stored permit) when a step reaches the gate.
    pub reached: Arc<tokio::sync::Notify>,
    /// The step applies once this is notified.
    pub release: Arc<tokio::sync::Notify>,
}

impl AveragerConfig {
    /// Defaults for `prefix` (hivemind's where it has them; shorter matchmaking time).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            target_group_size: None,
            min_group_size: matchmaking::DEFAULT_MIN_GROUP_SIZE,
            min_matchmaking_time: matchmaking::DEFAULT_MIN_MATCHMAKING_TIME,
            request_timeout: matchmaking::DEFAULT_REQUEST_TIMEOUT,
            sender_timeout: crate::allreduce::DEFAULT_SENDER_TIMEOUT,
            reducer_timeout: crate::allreduce::DEFAULT_REDUCER_TIMEOUT,
            round_timeout: Duration::from_secs(300),
            adaptive_timeouts: None,
            pace_links: true,
            link_timeout: Duration::from_secs(10),
            part_size_bytes: crate::allreduce::DEFAULT_PART_SIZE_BYTES,
            compression: Compression::default(),
            aggregator: crate::allreduce::Aggregator::Mean,
            mode: None,
            allow_relayed_data: false,
            bandwidth: None,
            keys: KeySchedule::Bits {
                initial_bits: String::new(),
            },
            allow_state_sharing: true,
            state_priority: 0.0,
            state: state::StateConfig::default(),
            apply_gate: None,
        }
    }
}

impl AveragerConfig {
    /// The mode to take part in with reachability `reach`: [`AveragerConfig::mode`] if set,
    /// else a client when [`Reach::Private`] and a node otherwise.
    pub fn resolved_mode(&self, reach: Reach) -> Mode {
        self.mode.unwrap_or(match reach {
            Reach::Private => Mode::Client,
            Reach::Public | Reach::Punchable => Mode::Node,
        })
    }
}

/// Options of one step.
#[derive(Clone, Debug)]
pub struct StepOptions {
    /// This peer's averaging weight.
    pub weight: f64,
    /// Bytes shared with every member of the group (hivemind's `gather`).
    pub gather: Bytes,
    /// Give up (typed error) if the step has not finished after this long.
    pub timeout: Option<Duration>,
    /// When matchmaking fails, look again until the timeout instead of failing.
    pub allow_retries: bool,
    /// Begin the all-reduce only after [`StepControl::trigger`] (else at once).
    pub wait_for_trigger: bool,
    /// When the all-reduce should begin at the earliest (matchmaking's scheduled time).
    pub scheduled_in: Option<Duration>,
    /// Grid round to use (default: this averager's count of successful steps).
    pub round: Option<u64>,
}

impl Default for StepOptions {
    fn default() -> Self {
        Self {
            weight: 1.0,
            gather: Bytes::new(),
            timeout: None,
            allow_retries: true,
            wait_for_trigger: false,
            scheduled_in: None,
            round: None,
        }
    }
}

/// What a successful step did.
#[derive(Clone, Debug)]
pub struct StepOutcome {
    /// The round's group id.
    pub group_id: Bytes,
    /// The members, in group order (libp2p peer ids).
    pub members: Vec<libp2p::PeerId>,
    /// Our index in `members`.
    pub me: usize,
    /// Every member's gathered bytes, in group order.
    pub gathered: Vec<Bytes>,
    /// The carrier of our link to each member (`None`: ourselves, or no link).
    pub carriers: Vec<Option<Carrier>>,
    /// How our link to each member was carried end to end: direct TLS, a libp2p stream on a
    /// direct or hole-punched connection (and its transport), or relayed (`None`: ourselves,
    /// no traffic between us, or no link).
    pub links: Vec<Option<LinkKind>>,
    /// Our mode in this step (see [`AveragerConfig::mode`]).
    pub mode: Mode,
    /// How others could reach us when the step began.
    pub reach: Reach,
    /// Part by part, whose values we now hold the mean of.
    pub report: RoundReport,
    /// The group key the step used.
    pub key: GroupKey,
    /// Bytes per second at which our parts and averages to each member were paced (`None`:
    /// not paced; see [`AveragerConfig::pace_links`]).
    pub paces: Vec<Option<f64>>,
}

/// Why a step failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AveragerError {
    /// No group formed in time (too few peers, or the deadline passed).
    #[error(transparent)]
    Matchmaking(#[from] MatchmakingError),
    /// The step was cancelled.
    #[error("step cancelled")]
    Cancelled,
    /// The step did not finish within its timeout.
    #[error("step timed out after {0:?}")]
    Timeout(Duration),
    /// Linking to the group failed.
    #[error("linking to the group: {0}")]
    Links(String),
    /// The group's members cannot reach each other (NATs keep apart every member that could
    /// reduce from some member that sends); found before any link is tried.
    #[error("the group cannot average: {0}")]
    Unreachable(String),
    /// The all-reduce failed.
    #[error("all-reduce: {0}")]
    Round(String),
    /// Bad configuration or tensors.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The averager has shut down.
    #[error("the averager has shut down")]
    Shutdown,
    /// A shared tensor's memory was freed or moved by its owner
    /// ([`crate::tensor::MovableMemory`]): the step read or wrote nothing of it.
    #[error(transparent)]
    TensorMemory(crate::tensor::TensorError),
}

struct StepRequest {
    options: StepOptions,
    params: ParamsCell,
    stage: watch::Sender<Stage>,
    trigger: watch::Receiver<bool>,
    cancel: watch::Receiver<bool>,
    result: oneshot::Sender<Result<StepOutcome, AveragerError>>,
    /// Form a lasting group ([`Averager::form_group`]) instead of averaging.
    form: Option<oneshot::Sender<Result<crate::Group, AveragerError>>>,
}

struct Shared {
    /// The host tensors, in order.
    tensors: Mutex<Vec<Tensor>>,
    /// The device tensors, and where host and device tensors sit in the round's order.
    devices: devices::Devices,
    /// Bumped whenever the tensors may have changed (a guard handed out mutably, a step's
    /// result, an installed state): a donor rebuilds its state snapshot only when it moved.
    version: AtomicU64,
    /// Error feedback residuals, with sparse compression (`crate::compression::feedback`).
    feedback: Option<Mutex<ErrorFeedback>>,
    /// This peer's upload and download rates measured in its past rounds
    /// ([`runner::traffic`]), published with its declarations.
    measured: Mutex<Option<crate::allreduce::LinkRates>>,
}

impl Shared {
    fn lock_tensors(&self) -> MutexGuard<'_, Vec<Tensor>> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tensors, locked for a change: counts as one.
    fn lock_tensors_mut(&self) -> MutexGuard<'_, Vec<Tensor>> {
        let guard = self.lock_tensors();
        self.version.fetch_add(1, Ordering::SeqCst);
        guard
    }
}

/// The averager's tensors, locked ([`Averager::tensors`]). Reading through it changes nothing;
/// the first mutable access marks the tensors as changed (a donor then snapshots them anew
/// for the next newcomer).
pub struct TensorsGuard<'a> {
    guard: MutexGuard<'a, Vec<Tensor>>,
    version: &'a AtomicU64,
    marked: bool,
}

impl std::fmt::Debug for TensorsGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.guard.iter()).finish()
    }
}

impl std::ops::Deref for TensorsGuard<'_> {
    type Target = Vec<Tensor>;
    fn deref(&self) -> &Vec<Tensor> {
        &self.guard
    }
}

impl std::ops::DerefMut for TensorsGuard<'_> {
    fn deref_mut(&mut self) -> &mut Vec<Tensor> {
        if !self.marked {
            self.marked = true;
            self.version.fetch_add(1, Ordering::SeqCst);
        }
        &mut self.guard
    }
}

/// One peer's averager (see the module docs).
pub struct Averager {
    shared: Arc<Shared>,
    steps: mpsc::Sender<StepRequest>,
    actor: Option<JoinHandle<()>>,
    /// Serves `/hivemesh/mm/1/<prefix>` (see [`control`]).
    server: JoinHandle<()>,
    shutdown: watch::Sender<bool>,
    state: state::StateSharing,
    /// For [`Averager::join_group`].
    dht: Dht,
    hub: Arc<LinkHub>,
    config: AveragerConfig,
    /// The group bits ([`KeySchedule::Bits`]; `None` for a grid), shared with the actor.
    key_manager: Arc<Mutex<Option<KeyManager>>>,
}

impl std::fmt::Debug for Averager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Averager").finish_non_exhaustive()
    }
}

impl Averager {
    /// Starts an averager over `tensors` on a node's DHT and link hub: host [`Tensor`]s, or
    /// with the `cuda` feature a mix of host and device tensors ([`AveragedTensor`]; an
    /// averager with device tensors does not share state, so `allow_state_sharing` must be
    /// off).
    pub fn start<T: Into<AveragedTensor>>(
        dht: Dht,
        hub: Arc<LinkHub>,
        tensors: Vec<T>,
        config: AveragerConfig,
    ) -> Result<Self, AveragerError> {
        let tensors: Vec<AveragedTensor> = tensors.into_iter().map(Into::into).collect();
        let protocol = control::protocol(&config.prefix);
        let key_manager = match &config.keys {
            KeySchedule::Bits { initial_bits } => Some(
                KeyManager::new(&config.prefix, initial_bits, config.target_group_size)
                    .map_err(|e| AveragerError::Config(e.to_string()))?,
            ),
            KeySchedule::Grid { grid, coords } => {
                grid.key(&config.prefix, coords, 0)
                    .map_err(|e| AveragerError::Config(e.to_string()))?;
                None
            }
        };
        if tensors.is_empty() {
            return Err(AveragerError::Config("no tensors".into()));
        }
        if let crate::allreduce::Aggregator::CenteredClip(clip) = config.aggregator
            && !clip.is_valid()
        {
            return Err(AveragerError::Config(format!(
                "CenteredClip needs tau > 0 and tolerance >= 0 (got {clip:?})"
            )));
        }
        let inbound = dht
            .p2p()
            .accept_streams(&protocol, 64)
            .map_err(|e| AveragerError::Config(e.to_string()))?;
        let (inbox_tx, inbox) = mpsc::channel(256);
        let serve_timeout = config.request_timeout;
        let server = tokio::spawn(control::serve(inbound, inbox_tx, serve_timeout));
        let (tensors, descriptors, devices) =
            match devices::Devices::split(tensors, &config.compression) {
                Ok(split) => split,
                Err(e) => {
                    server.abort();
                    return Err(e);
                }
            };
        let feedback = match config.compression.error_feedback() {
            Ok(Some(params)) if devices.is_empty() => Some(Mutex::new(ErrorFeedback::new(
                params,
                config.part_size_bytes,
                &descriptors,
            ))),
            Ok(None) => None,
            Ok(Some(_)) | Err(_) => {
                server.abort();
                return Err(AveragerError::Config(
                    "sparse compression keeps error feedback on the host for every tensor: no \
                     device tensors, no size-adaptive mix"
                        .into(),
                ));
            }
        };
        if !devices.is_empty() && config.allow_state_sharing {
            server.abort();
            return Err(AveragerError::Config(
                "device tensors are not shared as state: set allow_state_sharing = false".into(),
            ));
        }
        let shared = Arc::new(Shared {
            tensors: Mutex::new(tensors),
            devices,
            version: AtomicU64::new(0),
            feedback,
            measured: Mutex::new(None),
        });
        let (steps_tx, steps) = mpsc::channel(16);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let bytes: usize = descriptors.iter().map(|d| d.numel() * 4).sum();
        let schema_hash = schema_hash(&config, &descriptors);
        let state = match state::StateSharing::start(
            dht.clone(),
            shared.clone(),
            &config,
            schema_hash.clone(),
        ) {
            Ok(state) => state,
            Err(e) => {
                server.abort();
                return Err(e);
            }
        };
        let joining = (dht.clone(), hub.clone(), config.clone());
        let key_manager = Arc::new(Mutex::new(key_manager));
        let actor = Actor {
            schema_hash,
            descriptors,
            pool: BufferPool::new(bytes + crate::buffers::DEFAULT_RETAIN_BYTES),
            protocol,
            dht,
            hub,
            config,
            key_manager: key_manager.clone(),
            successes: 0,
            shared: shared.clone(),
            inbox,
            sends: JoinSet::new(),
            rng: StdRng::from_rng(&mut rand::rng()),
        };
        let task = tokio::spawn(actor.run(steps, shutdown_rx));
        Ok(Self {
            shared,
            steps: steps_tx,
            actor: Some(task),
            server,
            shutdown,
            state,
            dht: joining.0,
            hub: joining.1,
            config: joining.2,
            key_manager,
        })
    }

    /// The group bits the next step looks for a group under (hivemind's `get_group_bits`):
    /// `None` for a [`KeySchedule::Grid`].
    pub fn group_bits(&self) -> Option<String> {
        lock_keys(&self.key_manager)
            .as_ref()
            .map(|km| km.bits().to_owned())
    }

    /// Replaces the group bits (hivemind's `set_group_bits`: `0`s and `1`s, any length); the
    /// next matchmaking uses them. A [`KeySchedule::Grid`] has none to set
    /// ([`AveragerError::Config`]).
    pub fn set_group_bits(&self, bits: &str) -> Result<(), AveragerError> {
        match lock_keys(&self.key_manager).as_mut() {
            Some(km) => km
                .set_bits(bits)
                .map_err(|e| AveragerError::Config(e.to_string())),
            None => Err(AveragerError::Config(
                "a grid key schedule has no group bits".into(),
            )),
        }
    }

    /// The local tensors (lock briefly: a finishing round waits for this lock to add its
    /// deltas).
    pub fn tensors(&self) -> TensorsGuard<'_> {
        TensorsGuard {
            guard: self.shared.lock_tensors(),
            version: &self.shared.version,
            marked: false,
        }
    }

    /// With [`Compression::Sparse`], the error feedback residuals (per tensor, flattened): what
    /// this peer has not sent yet and adds to its next step's input; `None` otherwise.
    pub fn residuals(&self) -> Option<Vec<Vec<f32>>> {
        let feedback = self.shared.feedback.as_ref()?;
        let feedback = feedback.lock().unwrap_or_else(|e| e.into_inner());
        Some(feedback.residuals().to_vec())
    }

    /// Schedules a step; use the returned control to trigger, cancel or await it.
    pub async fn schedule_step(&self, options: StepOptions) -> Result<StepControl, AveragerError> {
        step_control::check_weight(options.weight)
            .map_err(|e| AveragerError::Config(e.to_string()))?;
        let (params, _) = watch::channel(StepParams::of(&options));
        let (stage_tx, stage) = watch::channel(Stage::Queued);
        let (trigger, trigger_rx) = watch::channel(!options.wait_for_trigger);
        let (cancel, cancel_rx) = watch::channel(false);
        let (result_tx, result) = oneshot::channel();
        self.steps
            .send(StepRequest {
                options,
                params: ParamsCell(params.clone()),
                stage: stage_tx,
                trigger: trigger_rx,
                cancel: cancel_rx,
                result: result_tx,
                form: None,
            })
            .await
            .map_err(|_| AveragerError::Shutdown)?;
        Ok(StepControl {
            stage,
            trigger,
            cancel,
            params,
            result,
        })
    }

    /// Forms a lasting [`Group`](crate::Group) through the same matchmaking as a step (this
    /// averager's prefix, group size and keys; `options.timeout` bounds matchmaking and
    /// linking, `options.wait_for_trigger` is ignored) and links every member to every other.
    /// The group's operations use this averager's timeouts, part size and compression; its
    /// `round_timeout` bounds each operation.
    pub async fn form_group(&self, options: StepOptions) -> Result<crate::Group, AveragerError> {
        let (stage, _) = watch::channel(Stage::Queued);
        let (_trigger, trigger) = watch::channel(true);
        let (_cancel, cancel) = watch::channel(false);
        let (result, _) = oneshot::channel();
        let (form, formed) = oneshot::channel();
        let (params, _) = watch::channel(StepParams::of(&options));
        self.steps
            .send(StepRequest {
                options,
                params: ParamsCell(params),
                stage,
                trigger,
                cancel,
                result,
                form: Some(form),
            })
            .await
            .map_err(|_| AveragerError::Shutdown)?;
        formed.await.map_err(|_| AveragerError::Shutdown)?
    }

    /// Joins a group that members formed under this averager's prefix, at their next
    /// [`Group::admit`](crate::Group::admit): finds the group's invitation in the DHT (retrying
    /// until `timeout`), asks its leader through `node`'s RPC, and links to every member.
    pub async fn join_group(
        &self,
        node: &crate::Node,
        timeout: Duration,
    ) -> Result<crate::Group, crate::GroupError> {
        let info = member_info(&self.dht, &self.hub, &self.config, Bytes::new()).await;
        crate::group::join(
            node,
            &self.config.prefix,
            info,
            group_config(&self.config),
            timeout,
        )
        .await
    }

    /// One averaging step: find a group, all-reduce, apply. See [`StepOptions`].
    pub async fn step(&self, options: StepOptions) -> Result<StepOutcome, AveragerError> {
        self.schedule_step(options).await?.result().await
    }

    /// Stops the actor (a step in progress is cancelled) and waits for it; stops serving the
    /// state and withdraws its announcement.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.actor.take() {
            let _ = task.await;
        }
        self.server.abort();
        self.state.shutdown().await;
    }
}

impl Drop for Averager {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.actor.take() {
            task.abort();
        }
        // The matchmaking server would otherwise live on until the node stops.
        self.server.abort();
    }
}

/// A blocking wrapper for synchronous training loops: owns a tokio runtime handle and blocks
/// on the averager's async calls. Must not be used from inside an async context.
#[derive(Debug)]
pub struct BlockingAverager {
    averager: Arc<Averager>,
    runtime: tokio::runtime::Handle,
}

impl BlockingAverager {
    /// Wraps `averager` (owned or shared), whose tasks run on `runtime`.
    pub fn new(averager: impl Into<Arc<Averager>>, runtime: tokio::runtime::Handle) -> Self {
        Self {
            averager: averager.into(),
            runtime,
        }
    }

    /// [`Averager::step`], blocking.
    pub fn step(&self, options: StepOptions) -> Result<StepOutcome, AveragerError> {
        self.runtime.block_on(self.averager.step(options))
    }

    /// [`Averager::tensors`].
    pub fn tensors(&self) -> TensorsGuard<'_> {
        self.averager.tensors()
    }

    /// The wrapped averager.
    pub fn into_inner(self) -> Arc<Averager> {
        self.averager
    }
}

/// A stable hash of what must match for peers to average together: the tensors' shapes and
/// dtypes and the codec (hivemind hashes shapes and dtypes).
fn schema_hash(config: &AveragerConfig, descriptors: &[TensorDescriptor]) -> Bytes {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"hivemesh/schema/v1\0");
    for d in descriptors {
        h.update((d.shape.len() as u64).to_le_bytes());
        for &s in &d.shape {
            h.update((s as u64).to_le_bytes());
        }
        h.update(d.dtype.name().as_bytes());
        h.update([0]);
    }
    h.update(format!("{:?}", config.compression).as_bytes());
    Bytes::copy_from_slice(&h.finalize()[..20])
}

/// The addresses other peers reach this node at, for declarations, state announcements and
/// member infos: our listen addresses (dial-back-confirmed ones first) while we are public,
/// our relay circuit addresses while we are not.
pub(crate) async fn contact_addrs(p2p: &crate::p2p::P2p) -> Vec<libp2p::Multiaddr> {
    let r = p2p.reachability();
    match r.class() {
        Reach::Public => {
            let mut addrs = r.confirmed.clone();
            for a in p2p.listen_addrs().await.unwrap_or_default() {
                let bare: libp2p::Multiaddr = a
                    .iter()
                    .filter(|p| !matches!(p, libp2p::multiaddr::Protocol::P2p(_)))
                    .collect();
                if !addrs.contains(&bare) {
                    addrs.push(bare);
                }
            }
            addrs
        }
        Reach::Punchable | Reach::Private => r.relayed,
    }
}

/// Our TLS data address as others should dial it: the listener's address, with an unspecified
/// IP (a listener on all interfaces) replaced by one that others saw us at.
fn advertised_data_addr(
    listen: Option<std::net::SocketAddr>,
    reachability: &crate::p2p::Reachability,
) -> Option<std::net::SocketAddr> {
    let mut addr = listen?;
    if addr.ip().is_unspecified() {
        let ip = reachability
            .confirmed
            .iter()
            .chain(&reachability.observed)
            .find_map(|a| {
                a.iter().find_map(|p| match p {
                    libp2p::multiaddr::Protocol::Ip4(ip) => Some(std::net::IpAddr::V4(ip)),
                    libp2p::multiaddr::Protocol::Ip6(ip) => Some(std::net::IpAddr::V6(ip)),
                    _ => None,
                })
            })?;
        addr.set_ip(ip);
    }
    Some(addr)
}

fn lock_keys(m: &Mutex<Option<KeyManager>>) -> MutexGuard<'_, Option<KeyManager>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn to_mm(peer: &libp2p::PeerId) -> matchmaking::PeerId {
    matchmaking::PeerId::from_bytes(peer.to_bytes()).expect("libp2p peer ids are 1..=128 bytes")
}

pub(crate) fn from_mm(peer: &matchmaking::PeerId) -> Option<libp2p::PeerId> {
    libp2p::PeerId::from_bytes(peer.as_bytes()).ok()
}

/// Wall-clock time `t` as a tokio instant.
fn instant_of(t: DhtTime) -> tokio::time::Instant {
    let now = DhtTime::now().as_secs();
    let ahead = (t.as_secs() - now).clamp(0.0, 86_400.0);
    tokio::time::Instant::now() + Duration::from_secs_f64(ahead)
}

/// A group ready to link: member ids, the round's members (modes and fractions), and the round
/// registered with the link hub.
struct Prepared {
    members: Vec<libp2p::PeerId>,
    round_members: Vec<crate::allreduce::Member>,
    /// The members as the link layer planned them (for the census).
    link_peers: Vec<LinkPeer>,
    expectation: crate::links::Expectation,
}

enum Wake {
    Inbound(libp2p::PeerId, Message),
    DhtGet(u64, Option<crate::dht::DhtValue>),
    Unreachable(libp2p::PeerId),
    /// The step's parameters changed ([`StepControl::set_scheduled_time`]).
    Params,
    Cancel,
    Timeout,
    StepTimeout,
    Shutdown,
}

struct Actor {
    schema_hash: Bytes,
    descriptors: Vec<TensorDescriptor>,
    pool: BufferPool,
    protocol: String,
    dht: Dht,
    hub: Arc<LinkHub>,
    config: AveragerConfig,
    key_manager: Arc<Mutex<Option<KeyManager>>>,
    successes: u64,
    shared: Arc<Shared>,
    inbox: mpsc::Receiver<(libp2p::PeerId, Message)>,
    /// Outgoing messages and DHT writes in flight (owned; aborted at shutdown).
    sends: JoinSet<()>,
    rng: StdRng,
}

impl Actor {
    async fn run(
        mut self,
        mut steps: mpsc::Receiver<StepRequest>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            while self.sends.try_join_next().is_some() {}
            tokio::select! {
                request = steps.recv() => {
                    let Some(request) = request else { break };
                    self.run_step(request, &mut shutdown).await;
                }
                message = self.inbox.recv() => {
                    let Some((from, message)) = message else { break };
                    self.refuse(from, &message);
                }
                _ = shutdown.changed() => break,
            }
            if *shutdown.borrow() {
                break;
            }
        }
        // Fail queued steps rather than leaving their callers waiting.
        steps.close();
        while let Some(request) = steps.recv().await {
            request.params.close();
            let _ = request.stage.send(Stage::Finished);
            let _ = request.result.send(Err(AveragerError::Shutdown));
        }
        self.sends.shutdown().await;
    }

    /// Answers a join request that arrives while we are not looking.
    fn refuse(&mut self, from: libp2p::PeerId, message: &Message) {
        if let Message::Join(request) = message {
            self.send(
                from,
                Message::Reply(Reply {
                    request_id: request.request_id,
                    body: ReplyBody::Rejected(RejectReason::NotLookingForGroup),
                }),
                None,
            );
        }
    }

    fn send(
        &mut self,
        to: libp2p::PeerId,
        message: Message,
        unreachable: Option<mpsc::Sender<libp2p::PeerId>>,
    ) {
        let p2p = self.dht.p2p().clone();
        let protocol = self.protocol.clone();
        let timeout = self.config.request_timeout;
        self.sends.spawn(async move {
            if let Err(e) = control::send(&p2p, to, &protocol, &message, timeout).await {
                tracing::debug!(peer = %to, error = %e, "matchmaking message not delivered");
                if let Some(tx) = unreachable {
                    let _ = tx.send(to).await;
                }
            }
        });
    }

    fn step_key(&self, options: &StepOptions) -> Result<GroupKey, AveragerError> {
        match (&self.config.keys, lock_keys(&self.key_manager).as_ref()) {
            (KeySchedule::Grid { grid, coords }, _) => grid
                .key(
                    &self.config.prefix,
                    coords,
                    options.round.unwrap_or(self.successes),
                )
                .map_err(|e| AveragerError::Config(e.to_string())),
            (_, Some(km)) => Ok(km.key()),
            (_, None) => Err(AveragerError::Config("no key schedule".into())),
        }
    }

    /// What we bring to a group: mode (resolved from our reachability), bandwidth, gathered
    /// bytes, how others reach us, and where: the TLS data address (`ip:port`, only when we
    /// are public) and our contact multiaddrs ([`contact_addrs`]: listen addresses when public,
    /// relay circuit addresses when not), so members that never talked to us can link.
    async fn member_info(&self, options: &StepOptions) -> MemberInfo {
        let mut info =
            member_info(&self.dht, &self.hub, &self.config, options.gather.clone()).await;
        info.measured = *self
            .shared
            .measured
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        info
    }

    /// Tells the swarm where the peers declared in `value` can be reached (the contact
    /// addresses in their declarations), once per peer and step: a NATed leader is in no
    /// routing table, and its relay address is how a follower reaches it.
    fn learn_contacts(
        &mut self,
        value: Option<&crate::dht::DhtValue>,
        known: &mut std::collections::HashSet<libp2p::PeerId>,
    ) {
        let Some(value) = value else { return };
        let me = self.dht.p2p().peer_id();
        let now = DhtTime::now();
        for (peer, entry) in value.owner_entries() {
            if peer == me || entry.is_expired(now) || known.contains(&peer) {
                continue;
            }
            let Some(addrs) = matchmaking::declaration_contact(&entry.value)
                .and_then(crate::dht::decode_addrs)
                .filter(|a| !a.is_empty())
            else {
                continue;
            };
            known.insert(peer);
            let p2p = self.dht.p2p().clone();
            self.sends.spawn(async move {
                let _ = p2p.add_peer_addresses(peer, addrs).await;
            });
        }
    }

    async fn run_step(&mut self, request: StepRequest, shutdown: &mut watch::Receiver<bool>) {
        let StepRequest {
            options,
            params,
            stage,
            mut trigger,
            mut cancel,
            result,
            form,
        } = request;
        let started = Instant::now();
        let step_deadline = options
            .timeout
            .map(|t| tokio::time::Instant::from_std(started + t));
        if let Some(form) = form {
            let formed = self
                .form_group(&options, &params, &mut cancel, shutdown, step_deadline)
                .await;
            params.close();
            let _ = stage.send(Stage::Finished);
            let _ = form.send(formed);
            return;
        }
        let outcome = self
            .step(
                &options,
                &params,
                &stage,
                &mut trigger,
                &mut cancel,
                shutdown,
                step_deadline,
            )
            .await;
        if outcome.is_ok() {
            self.successes += 1;
        }
        params.close();
        let _ = stage.send(Stage::Finished);
        let _ = result.send(outcome);
    }

    #[allow(clippy::too_many_arguments)]
    async fn step(
        &mut self,
        options: &StepOptions,
        params: &ParamsCell,
        stage: &watch::Sender<Stage>,
        trigger: &mut watch::Receiver<bool>,
        cancel: &mut watch::Receiver<bool>,
        shutdown: &mut watch::Receiver<bool>,
        step_deadline: Option<tokio::time::Instant>,
    ) -> Result<StepOutcome, AveragerError> {
        let _ = stage.send(Stage::Matchmaking);
        let group = self
            .find_group(options, params, cancel, shutdown, step_deadline)
            .await?;
        // Register the round with the hub at once, so members that start linking while we
        // still wait for our trigger (or are slower to see `Begin`) are not turned away.
        let prepared = self.prepare_links(&group, false).await?;
        let _ = stage.send(Stage::AwaitingTrigger);
        let wait = async {
            tokio::select! {
                r = trigger.wait_for(|t| *t) => r.map(|_| ()).map_err(|_| AveragerError::Shutdown),
                _ = cancel.wait_for(|c| *c) => Err(AveragerError::Cancelled),
                _ = shutdown.wait_for(|s| *s) => Err(AveragerError::Shutdown),
            }
        };
        self.while_serving(wait, step_deadline, options.timeout)
            .await?;
        // The weight is read, and the parameters closed to changes, as the all-reduce begins.
        let weight = params.begin();
        let _ = stage.send(Stage::AllReduce);
        let started = std::time::Instant::now();
        let result = self
            .all_reduce(options, weight, group, prepared, cancel, step_deadline)
            .await;
        use crate::metrics::RoundResult;
        let counted = match &result {
            Ok(_) => RoundResult::Ok,
            Err(AveragerError::Cancelled | AveragerError::Shutdown) => RoundResult::Cancelled,
            Err(_) => RoundResult::Failed,
        };
        let metrics = self.dht.p2p().metrics();
        metrics.round_finished(counted, started.elapsed());
        result
    }

    /// Matchmaking, retried while `options.allow_retries` and the deadline allow.
    async fn find_group(
        &mut self,
        options: &StepOptions,
        params: &ParamsCell,
        cancel: &mut watch::Receiver<bool>,
        shutdown: &mut watch::Receiver<bool>,
        step_deadline: Option<tokio::time::Instant>,
    ) -> Result<matchmaking::Group, AveragerError> {
        let started = std::time::Instant::now();
        let group = loop {
            match self
                .matchmake(options, params, cancel, shutdown, step_deadline)
                .await
            {
                Ok(group) => break group,
                Err(AveragerError::Matchmaking(MatchmakingError::NoGroup { .. }))
                    if options.allow_retries
                        && step_deadline.is_some_and(|d| tokio::time::Instant::now() < d) =>
                {
                    continue;
                }
                Err(e) => return Err(e),
            }
        };
        if let Some(km) = lock_keys(&self.key_manager).as_mut() {
            km.update_on_group_assembled(&group);
        }
        self.trace("matchmaking", started, || {
            vec![
                ("group", crate::runner::hex(&group.group_id)),
                ("members", group.members.len().to_string()),
            ]
        });
        Ok(group)
    }

    /// Links to the group's members (refusing join requests meanwhile), traced.
    async fn link(
        &mut self,
        expectation: crate::links::Expectation,
        options: &StepOptions,
        step_deadline: Option<tokio::time::Instant>,
    ) -> Result<crate::links::EstablishedLinks, AveragerError> {
        let link_timeout = self.config.link_timeout;
        let linking = std::time::Instant::now();
        let established = self
            .while_serving(
                async { Ok(expectation.establish(link_timeout).await) },
                step_deadline,
                options.timeout,
            )
            .await?;
        self.trace("linking", linking, || {
            vec![("linked", established.linked().to_string())]
        });
        Ok(established)
    }

    /// [`Averager::form_group`]: a group, linked as a full mesh.
    async fn form_group(
        &mut self,
        options: &StepOptions,
        params: &ParamsCell,
        cancel: &mut watch::Receiver<bool>,
        shutdown: &mut watch::Receiver<bool>,
        step_deadline: Option<tokio::time::Instant>,
    ) -> Result<crate::Group, AveragerError> {
        let group = self
            .find_group(options, params, cancel, shutdown, step_deadline)
            .await?;
        let prepared = self.prepare_links(&group, true).await?;
        let established = self
            .link(prepared.expectation, options, step_deadline)
            .await?;
        let cfg = group_config(&self.config);
        let formation = crate::group::Formation {
            group_id: group.group_id.clone(),
            name: self.config.prefix.clone(),
            infos: group.members.iter().map(|m| m.info.clone()).collect(),
        };
        crate::Group::new(
            &group.group_id,
            prepared.members,
            group.me,
            established.links,
            established.kinds,
            cfg,
        )
        .map(|g| g.with_formation(formation))
        .map_err(|e| AveragerError::Links(e.to_string()))
    }

    /// A timeline span of this node's step lane ([`crate::timeline`]), from `started` to now.
    fn trace(
        &self,
        name: &'static str,
        started: std::time::Instant,
        args: impl FnOnce() -> Vec<(&'static str, String)>,
    ) {
        let me = self.dht.p2p().peer_id();
        crate::timeline::span(
            "step",
            || format!("node {}", short_id(&me)),
            || name.to_owned(),
            started,
            args,
        );
    }

    /// The members' libp2p ids, the round's members (modes and fractions: members that not
    /// every sender can reach reduce nothing, and a group where nobody may reduce fails here,
    /// before any link is tried), their addresses handed to the swarm, and the round registered
    /// with the link hub.
    async fn prepare_links(
        &mut self,
        group: &matchmaking::Group,
        full_mesh: bool,
    ) -> Result<Prepared, AveragerError> {
        let members: Vec<libp2p::PeerId> = group
            .members
            .iter()
            .map(|m| from_mm(&m.peer))
            .collect::<Option<_>>()
            .ok_or_else(|| AveragerError::Links("a member id is not a libp2p peer id".into()))?;
        let elements: usize = self.descriptors.iter().map(TensorDescriptor::numel).sum();
        let round_members = matchmaking::load_balancing::round_members(group, elements as u64, 1)
            .map_err(|e| match e {
            matchmaking::load_balancing::LoadBalanceError::Unreachable => {
                let reach: Vec<String> = group
                    .members
                    .iter()
                    .map(|m| format!("{}/{}", m.info.mode, m.info.reach))
                    .collect();
                AveragerError::Unreachable(format!("{e} (members: {})", reach.join(", ")))
            }
            other => AveragerError::Round(other.to_string()),
        })?;
        let link_peers: Vec<LinkPeer> = group
            .members
            .iter()
            .zip(&members)
            .zip(&round_members)
            .map(|((m, &peer_id), r)| {
                link_peer(
                    peer_id,
                    &m.info,
                    full_mesh || r.mode.is_sender(),
                    full_mesh || (r.fraction > 0.0 && r.mode != Mode::Client),
                )
            })
            .collect();
        let expectation = self
            .hub
            .expect(group.group_id.clone(), &link_peers, group.me)
            .map_err(|e| AveragerError::Links(e.to_string()))?;
        let p2p = self.dht.p2p().clone();
        for (i, (m, &peer)) in group.members.iter().zip(&members).enumerate() {
            if i != group.me {
                // Best effort: the swarm may know the peer already.
                add_addresses(&p2p, peer, &m.info).await;
            }
        }
        Ok(Prepared {
            members,
            round_members,
            link_peers,
            expectation,
        })
    }

    /// Runs `fut` while refusing join requests that arrive meanwhile, bounded by the step's
    /// deadline.
    async fn while_serving<T>(
        &mut self,
        fut: impl std::future::Future<Output = Result<T, AveragerError>>,
        step_deadline: Option<tokio::time::Instant>,
        step_timeout: Option<Duration>,
    ) -> Result<T, AveragerError> {
        tokio::pin!(fut);
        let deadline = step_deadline;
        loop {
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = &mut fut => return r,
                message = self.inbox.recv() => {
                    if let Some((from, message)) = message {
                        self.refuse(from, &message);
                    }
                }
                () = sleep => return Err(AveragerError::Timeout(step_timeout.unwrap_or_default())),
            }
        }
    }

    async fn matchmake(
        &mut self,
        options: &StepOptions,
        params: &ParamsCell,
        cancel: &mut watch::Receiver<bool>,
        shutdown: &mut watch::Receiver<bool>,
        step_deadline: Option<tokio::time::Instant>,
    ) -> Result<matchmaking::Group, AveragerError> {
        let me = to_mm(&self.dht.p2p().peer_id());
        let mut mm_config = MmConfig::new(self.schema_hash.clone());
        mm_config.target_group_size = self.config.target_group_size;
        mm_config.min_group_size = self.config.min_group_size;
        mm_config.min_matchmaking_time = self.config.min_matchmaking_time;
        mm_config.request_timeout = self.config.request_timeout;
        let key = self.step_key(options)?;
        let mut step = matchmaking::Step::new(key, self.member_info(options).await);
        let mut contact = Vec::new();
        crate::dht::encode_addrs(&contact_addrs(self.dht.p2p()).await, &mut contact);
        step.contact = Bytes::from(contact);
        let mut known_contacts = std::collections::HashSet::new();
        let now = DhtTime::now();
        step.scheduled_time = params.scheduled_time();
        let mut changes = params.0.subscribe();
        step.deadline = step_deadline
            .map(|d| now.saturating_add(d.saturating_duration_since(tokio::time::Instant::now())));
        let mut machine = Matchmaker::new(me, mm_config, step, now, &mut self.rng)
            .map_err(|e| AveragerError::Config(e.to_string()))?;
        let (unreachable_tx, mut unreachable) = mpsc::channel(64);
        let (gets_tx, mut gets) = mpsc::channel(16);
        let mut result = None;
        loop {
            // Finished sends and lookups leave the set now, not only between steps: a long
            // matchmaking spawns one per message.
            while self.sends.try_join_next().is_some() {}
            // Outputs first: messages, DHT requests, events.
            while let Some(t) = machine.poll_transmit() {
                match from_mm(&t.to) {
                    Some(to) => self.send(to, t.message, Some(unreachable_tx.clone())),
                    None => machine.handle_unreachable(DhtTime::now(), &t.to),
                }
            }
            while let Some(request) = machine.poll_dht() {
                let dht = self.dht.clone();
                match request {
                    DhtRequest::Store {
                        key,
                        subkey,
                        value,
                        expiration,
                    } => {
                        self.sends.spawn(async move {
                            if let Err(e) = dht
                                .store_unconfirmed(
                                    &crate::dht::owned_key(key.as_bytes()),
                                    Some(&subkey),
                                    &value,
                                    expiration,
                                )
                                .await
                            {
                                tracing::debug!(error = %e, "declaration not stored");
                            }
                        });
                    }
                    DhtRequest::Get { id, key } => {
                        let tx = gets_tx.clone();
                        self.sends.spawn(async move {
                            let value = dht
                                .get(&crate::dht::owned_key(key.as_bytes()))
                                .await
                                .ok()
                                .flatten();
                            let _ = tx.send((id, value)).await;
                        });
                    }
                }
            }
            while let Some(event) = machine.poll_event() {
                result = Some(match event {
                    Event::Assembled(group) => Ok(group),
                    Event::Failed(e) => Err(AveragerError::Matchmaking(e)),
                });
            }
            if let Some(r) = result.take_if(|_| machine.is_finished()) {
                return r;
            }
            if machine.is_finished() {
                return Err(AveragerError::Matchmaking(MatchmakingError::Cancelled));
            }
            let timeout = machine.poll_timeout().map(instant_of);
            let wake = tokio::select! {
                m = self.inbox.recv() => match m {
                    Some((from, message)) => Wake::Inbound(from, message),
                    None => Wake::Shutdown,
                },
                Some((id, value)) = gets.recv() => Wake::DhtGet(id, value),
                Some(peer) = unreachable.recv() => Wake::Unreachable(peer),
                Ok(()) = changes.changed() => Wake::Params,
                _ = cancel.wait_for(|c| *c) => Wake::Cancel,
                _ = shutdown.wait_for(|s| *s) => Wake::Shutdown,
                () = async { match timeout { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => Wake::Timeout,
                () = async { match step_deadline { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => Wake::StepTimeout,
            };
            let now = DhtTime::now();
            match wake {
                Wake::Inbound(from, message) => machine.handle_message(now, to_mm(&from), message),
                Wake::DhtGet(id, value) => {
                    self.learn_contacts(value.as_ref(), &mut known_contacts);
                    machine.handle_dht_get(now, id, value)
                }
                Wake::Unreachable(peer) => machine.handle_unreachable(now, &to_mm(&peer)),
                Wake::Params => {
                    if let Some(at) = params.scheduled_time() {
                        machine.set_scheduled_time(at);
                    }
                }
                Wake::Timeout => machine.handle_timeout(now),
                Wake::Cancel | Wake::Shutdown | Wake::StepTimeout => {
                    machine.cancel(now);
                    // Flush the leave record and disband messages, then report.
                    while let Some(t) = machine.poll_transmit() {
                        if let Some(to) = from_mm(&t.to) {
                            self.send(to, t.message, None);
                        }
                    }
                    while let Some(DhtRequest::Store {
                        key,
                        subkey,
                        value,
                        expiration,
                    }) = machine.poll_dht()
                    {
                        let dht = self.dht.clone();
                        self.sends.spawn(async move {
                            let _ = dht
                                .store_unconfirmed(
                                    &crate::dht::owned_key(key.as_bytes()),
                                    Some(&subkey),
                                    &value,
                                    expiration,
                                )
                                .await;
                        });
                    }
                    return Err(match wake {
                        Wake::Cancel => AveragerError::Cancelled,
                        Wake::Shutdown => AveragerError::Shutdown,
                        _ => AveragerError::Timeout(options.timeout.unwrap_or_default()),
                    });
                }
            }
        }
    }

    /// Where the plan has hole-punched pairs ([`crate::links::census::needs_census`]): tells
    /// every linked member which members we could not link to (a signed statement), floods
    /// the statements over the links until every member holds all of them (so members linked
    /// to neither end of a failed pair learn of it too), and re-plans the
    /// round's fractions with the pairs that failed ([`load_balancing::group_cuts`]), so that
    /// no member whom a sender cannot reach keeps a span: the round goes on at once with every
    /// contribution instead of banning the pair and waiting for timeouts. A link whose census
    /// does not come is dropped (the runner fails it at once).
    async fn census(
        &self,
        group: &matchmaking::Group,
        link_peers: &[LinkPeer],
        established: &mut crate::links::EstablishedLinks,
        round_members: Vec<crate::allreduce::Member>,
    ) -> Result<Vec<crate::allreduce::Member>, AveragerError> {
        use crate::links::census;
        use matchmaking::load_balancing;
        if !census::needs_census(link_peers) {
            return Ok(round_members);
        }
        let n = group.members.len();
        let mine: Vec<u32> = (0..n)
            .filter(|&i| established.errors[i].is_some())
            .map(|i| i as u32)
            .collect();
        let own = census::sign(self.dht.keypair(), &group.group_id, group.me as u32, &mine)
            .map_err(|e| AveragerError::Round(e.to_string()))?;
        let linked: Vec<bool> = established.links.iter().map(Option::is_some).collect();
        let mut flood = census::Flood::new(n, group.me, own, &linked);
        let peers: Vec<libp2p::PeerId> = link_peers.iter().map(|p| p.peer_id).collect();
        let verify = |k: usize, s: &crate::wire::CensusStatement| {
            peers
                .get(k)
                .is_some_and(|peer| census::verify(peer, &group.group_id, s))
        };
        census::exchange(
            &mut established.links,
            &mut flood,
            verify,
            census::wait(self.config.link_timeout),
        )
        .await;
        let mut found = flood.failed_pairs();
        for &i in flood.dropped() {
            tracing::info!(member = i, "no census on the link: dropped");
            established.kinds[i] = None;
            established.carriers[i] = None;
            found.push((group.me, i));
        }
        tracing::debug!(
            rounds = flood.rounds(),
            heard = flood.heard().len(),
            "census over"
        );
        let cuts = load_balancing::group_cuts(group, &found);
        if cuts == load_balancing::group_cuts(group, &[]) {
            return Ok(round_members);
        }
        let elements: usize = self.descriptors.iter().map(TensorDescriptor::numel).sum();
        let replanned = load_balancing::round_members_cut(group, elements as u64, 1, &cuts)
            .map_err(|e| AveragerError::Round(e.to_string()))?;
        tracing::info!(
            pairs = ?cuts.pairs(),
            "members that cannot link: the round re-planned around them"
        );
        Ok(replanned)
    }

    async fn all_reduce(
        &mut self,
        options: &StepOptions,
        weight: f64,
        group: matchmaking::Group,
        prepared: Prepared,
        cancel: &mut watch::Receiver<bool>,
        step_deadline: Option<tokio::time::Instant>,
    ) -> Result<StepOutcome, AveragerError> {
        let Prepared {
            members,
            round_members,
            link_peers,
            expectation,
        } = prepared;
        // Device snapshots copy to the host while the links are made.
        self.shared.devices.begin()?;
        let linking = std::time::Instant::now();
        let mut established = self.link(expectation, options, step_deadline).await?;
        // Each phase that waits for members may keep a member longer than us: linking up to a
        // link timeout (a member that died since matchmaking fails at once for whoever dials
        // it, while those it was to dial wait for it until their link timeout), and the census,
        // where it runs, up to `census::wait`. The round's first deadlines allow for that
        // (`start_grace`).
        let link_timeout = self.config.link_timeout;
        let others_begin_by = linking
            + if crate::links::census::needs_census(&link_peers) {
                link_timeout + crate::links::census::wait(link_timeout)
            } else {
                link_timeout
            };
        let round_members = self
            .census(&group, &link_peers, &mut established, round_members)
            .await?;
        let mut cfg = RoundConfig::new(round_members, group.me);
        cfg.weight = weight;
        cfg.part_size_bytes = self.config.part_size_bytes;
        cfg.compression = self.config.compression.clone();
        cfg.sender_timeout = self.config.sender_timeout;
        cfg.reducer_timeout = self.config.reducer_timeout;
        cfg.round_timeout = Some(self.config.round_timeout);
        cfg.aggregator = self.config.aggregator;
        cfg.adaptive_timeouts = self.config.adaptive_timeouts;
        cfg.pace_links = self.config.pace_links;
        // The others may begin the round as late as their link phases allow.
        cfg.start_grace = others_begin_by.saturating_duration_since(std::time::Instant::now());
        cfg.rates = group
            .members
            .iter()
            .map(|m| m.info.measured.unwrap_or_default())
            .collect();
        // A member that predates stand-ins would ban a sender whose part lies outside its span.
        cfg.stand_ins = group.members.iter().all(|m| m.info.stand_ins);
        // What the runner paces our links at (it computes the same from `cfg`), and their sums
        // each way (what a paced round can measure: `runner::traffic::smooth`).
        let (paces, paced) = if cfg.pace_links {
            (
                crate::allreduce::pacing::link_paces(&cfg.members, &cfg.rates, group.me),
                crate::allreduce::pacing::paced_totals(&cfg.members, &cfg.rates, group.me),
            )
        } else {
            (vec![None; group.members.len()], Default::default())
        };
        let carriers = established.carriers.clone();
        let links = established.kinds.clone();
        let summary: Vec<String> = links
            .iter()
            .enumerate()
            .map(|(i, k)| match k {
                _ if i == group.me => "self".to_owned(),
                Some(k) => k.to_string(),
                None => "-".to_owned(),
            })
            .collect();
        let summary = summary.join(",");
        tracing::info!(links = %summary, "linked to the group");
        let span = tracing::info_span!("step", links = %summary);
        let snapshot: Vec<Tensor> =
            crate::tensor::with_memory_checked(&mut self.shared.lock_tensors(), |t| t.to_vec())
                .map_err(AveragerError::TensorMemory)?;
        let (snapshot, pending) = self.shared.devices.start_round(snapshot)?;
        // Error feedback: the round sends `compress(input + residual)` (one pass over the
        // tensors, on a blocking thread); the residual changes only once the round finished
        // (a failed round keeps it).
        let (snapshot, inputs) = if self.shared.feedback.is_some() {
            let shared = self.shared.clone();
            tokio::task::spawn_blocking(move || {
                let feedback = shared.feedback.as_ref().expect("checked above");
                let feedback = feedback.lock().unwrap_or_else(|e| e.into_inner());
                let sent = feedback
                    .prepare(&snapshot)
                    .map_err(|e| AveragerError::Round(e.to_string()))?;
                Ok::<_, AveragerError>((sent, Some(snapshot)))
            })
            .await
            .map_err(|e| AveragerError::Round(format!("the error feedback task failed: {e}")))??
        } else {
            (snapshot, None)
        };
        let me = self.dht.p2p().peer_id();
        let lanes = crate::timeline::enabled().then(|| {
            members
                .iter()
                .enumerate()
                .map(|(i, peer)| format!("node {} ↔ member {i} {}", short_id(&me), short_id(peer)))
                .collect()
        });
        let traffic = Arc::new(runner::Traffic::default());
        let runner_cfg = RunnerConfig {
            pool: self.pool.clone(),
            lanes,
            traffic: Some(traffic.clone()),
            ..RunnerConfig::default()
        };
        let rounding = std::time::Instant::now();
        let round = tracing::Instrument::instrument(
            runner::run_round_pending(
                cfg,
                group.group_id.clone(),
                snapshot,
                pending,
                established.links,
                runner_cfg,
                cancel.clone(),
            ),
            span,
        );
        let (start, outcome): (Vec<Tensor>, Outcome) = self
            .while_serving(
                async {
                    round.await.map_err(|e| match e {
                        runner::RunnerError::Round(crate::allreduce::RoundError::Cancelled) => {
                            AveragerError::Cancelled
                        }
                        other => AveragerError::Round(other.to_string()),
                    })
                },
                step_deadline,
                options.timeout,
            )
            .await?;
        let round_rates = traffic.rates();
        let estimate = round_rates.map(|rates| {
            let mut measured = self
                .shared
                .measured
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *measured = Some(runner::traffic::smooth(*measured, rates, paced));
            *measured
        });
        self.trace("round", rounding, || {
            // Mbit/s: what this round measured, the estimate it left, the members' declared
            // rates this round was planned with, and our paces to each member.
            let mbit = |r: Option<crate::allreduce::LinkRates>| {
                r.map_or("-".to_owned(), |r| {
                    format!("{:.1}/{:.1}", r.up * 8e-6, r.down * 8e-6)
                })
            };
            let list = |v: Vec<String>| v.join(",");
            vec![
                ("group", crate::runner::hex(&group.group_id)),
                ("me", group.me.to_string()),
                ("measured_mbit", mbit(round_rates)),
                ("estimate_mbit", mbit(estimate.flatten())),
                (
                    "declared_mbit",
                    list(
                        group
                            .members
                            .iter()
                            .map(|m| mbit(m.info.measured))
                            .collect(),
                    ),
                ),
                (
                    "paces_mbit",
                    list(
                        paces
                            .iter()
                            .map(|p| p.map_or("-".to_owned(), |p| format!("{:.1}", p * 8e-6)))
                            .collect(),
                    ),
                ),
            ]
        });
        if let Some(gate) = &self.config.apply_gate {
            gate.reached.notify_one();
            let _ = tokio::time::timeout(self.config.round_timeout, gate.release.notified()).await;
        }
        let applying = std::time::Instant::now();
        // The delta rule passes over every tensor (and waits for device uploads): on a
        // blocking thread, not on the runtime's workers. Once started it runs to the end even
        // if the step is dropped meanwhile, so tensors are never left half-applied (nor the
        // error feedback residual committed without its apply).
        let shared = self.shared.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let mut outcome = outcome;
            {
                let mut tensors = shared.lock_tensors_mut();
                // Shared memory is checked (and held in place) for the whole read-modify-write;
                // if it moved, nothing is written and the residual is not committed.
                crate::tensor::with_memory_checked(&mut tensors, |tensors| {
                    match (&shared.feedback, inputs) {
                        (Some(feedback), Some(inputs)) => {
                            let mut feedback = feedback.lock().unwrap_or_else(|e| e.into_inner());
                            let failed = |e: crate::compression::feedback::FeedbackError| {
                                AveragerError::Round(e.to_string())
                            };
                            feedback
                                .commit(&inputs, &start, &mut outcome, weight)
                                .map_err(failed)?;
                            // Host tensors only; ordered so that peers agree bit for bit.
                            crate::compression::feedback::apply(&outcome, tensors, &inputs)
                                .map_err(failed)
                        }
                        _ => shared.devices.apply_host(&outcome, tensors, &start, 1.0),
                    }
                })
                .map_err(AveragerError::TensorMemory)??;
            }
            // The device snapshots are read (for the deltas) once their copies are done.
            shared.devices.wait_snapshots()?;
            devices::Devices::apply_devices(&shared, &outcome, &start, 1.0)?;
            Ok::<_, AveragerError>(outcome)
        })
        .await
        .map_err(|e| AveragerError::Round(format!("the apply task failed: {e}")))??;
        self.trace("apply", applying, Vec::new);
        let report = outcome.report.clone();
        outcome.recycle(&self.pool);
        Ok(StepOutcome {
            group_id: group.group_id.clone(),
            gathered: group
                .members
                .iter()
                .map(|m| m.info.gathered.clone())
                .collect(),
            members,
            me: group.me,
            carriers,
            links,
            mode: group.members[group.me].info.mode,
            reach: group.members[group.me].info.reach,
            report,
            key: group.key,
            paces,
        })
    }
}

/// What this node brings to a group: its mode, reach, addresses (the data address where it is
/// public, then its contact addresses) and `gathered` bytes.
pub(crate) async fn member_info(
    dht: &Dht,
    hub: &LinkHub,
    config: &AveragerConfig,
    gathered: Bytes,
) -> MemberInfo {
    let reachability = dht.p2p().reachability();
    let reach = reachability.class();
    let mut info = MemberInfo::new(config.resolved_mode(reach));
    info.reach = reach;
    info.relay_data = config.allow_relayed_data;
    info.unlinkable = hub.unlinkable().iter().map(to_mm).collect();
    info.bandwidth = config.bandwidth;
    info.gathered = gathered;
    if reach == Reach::Public
        && let Some(addr) = advertised_data_addr(hub.data_addr(), &reachability)
    {
        info.addrs.push(addr.to_string());
    }
    let contact = contact_addrs(dht.p2p()).await;
    let room = matchmaking::MAX_ADDRS - info.addrs.len();
    info.addrs.extend(
        contact
            .into_iter()
            .map(|a| a.to_string())
            .filter(|a| a.len() <= matchmaking::MAX_ADDR_BYTES)
            .take(room),
    );
    info
}

/// A group's parameters from an averager's: its timeouts (`round_timeout` bounds each
/// operation), part size and compression.
pub(crate) fn group_config(config: &AveragerConfig) -> crate::group::GroupConfig {
    crate::group::GroupConfig {
        sender_timeout: config.sender_timeout,
        reducer_timeout: config.reducer_timeout,
        op_timeout: config.round_timeout,
        part_size_bytes: config.part_size_bytes,
        compression: config.compression.clone(),
        ..Default::default()
    }
}

/// How to link with a member that brought `info`, and whether it sends and reduces.
pub(crate) fn link_peer(
    peer_id: libp2p::PeerId,
    info: &matchmaking::MemberInfo,
    sends: bool,
    reduces: bool,
) -> LinkPeer {
    LinkPeer {
        peer_id,
        data_addr: info.addrs.iter().find_map(|a| a.parse().ok()),
        reach: info.reach,
        relay_data: info.relay_data,
        sends,
        reduces,
        relay_addrs: info
            .addrs
            .iter()
            .filter_map(|a| a.parse::<libp2p::Multiaddr>().ok())
            .filter(|a| {
                a.iter()
                    .any(|p| p == libp2p::multiaddr::Protocol::P2pCircuit)
            })
            .collect(),
    }
}

/// Hands the multiaddresses among `info`'s addresses to the swarm (best effort).
pub(crate) async fn add_addresses(
    p2p: &crate::p2p::P2p,
    peer: libp2p::PeerId,
    info: &matchmaking::MemberInfo,
) {
    let maddrs: Vec<libp2p::Multiaddr> = info.addrs.iter().filter_map(|a| a.parse().ok()).collect();
    if !maddrs.is_empty() {
        let _ = p2p.add_peer_addresses(peer, maddrs).await;
    }
}

/// The last 8 characters of a peer id (timeline lanes).
pub(crate) fn short_id(peer: &libp2p::PeerId) -> String {
    let s = peer.to_base58();
    s[s.len().saturating_sub(8)..].to_owned()
}
