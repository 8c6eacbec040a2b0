//! The butterfly all-reduce, sans-IO.
//!
//! # The protocol
//!
//! A group of `N` peers in an agreed order averages a list of tensors. All tensors are
//! flattened and cut into parts ([`partition`]); peer `i` *reduces* the `i`-th contiguous span
//! of parts, sized by its fraction. Every *sender* streams its parts of span `i` to peer `i`
//! ([`Message::Part`], in part order, with its weight); the reducer holds each part's
//! contributions until every sender that is still in the round has contributed it, then
//! computes `Σ w·x / Σ w` in one pass ([`Reducer`]) and answers every sender
//! ([`Message::Averaged`], with the set of contributors). With the lossless codec the answer
//! is the average itself, the same bytes for every sender; with a lossy codec it is the *delta*
//! `average − that sender's decoded input`, so each peer keeps its own compression error (as in
//! hivemind). A reducer's own parts never touch the network or a codec, except under the
//! sparse codec ([`crate::compression::SparseTopK`]): there the reducer counts its own part as
//! the others would receive it, and answers every sender with the same bytes, the average over
//! the union of the positions it received (exact f32 values, never densified).
//!
//! Modes ([`Mode`]): a **node** sends and reduces; a **client** sends and receives but reduces
//! nothing (fraction 0) and gets each average as soon as the part completes (hivemind holds a
//! client's results until it has sent everything to that reducer; on a WAN that serialises
//! the client's download behind its upload, issue 32); an **aux** peer reduces but sends
//! nothing and applies nothing. A group without any sender (all aux) is rejected with
//! [`RoundError::NoSenders`].
//!
//! # Timeouts and failures
//!
//! * Windows: a node sender keeps at most a window of parts outstanding per reducer, grown
//!   from `initial_in_flight_parts` to the link's measured bandwidth-delay product, never
//!   above `max_in_flight_parts` (which reducers enforce) ([`window`]).
//! * Pacing (optional, [`pacing`]): every flow is written at the rate the plan gives it (its
//!   share of the step's bytes over the plan's step time, with headroom), not at whatever
//!   share TCP gives it (the runner paces; the state machine is unchanged).
//! * Adaptive timeouts (optional, [`deadline`]): the two timeouts below are derived per link
//!   from part sizes, declared measured rates and the round's observed arrivals, within
//!   user-set bounds.
//! * `sender_timeout`: the longest a reducer waits for the next part of a sender that it is
//!   not itself holding up (the reducer owes it no reply, or it is a client still sending),
//!   counted from the round start (after `start_grace`, for members still linking), the
//!   sender's last part, or the reducer's last reply to it.
//!   A sender that misses it is **banned**: excluded from every part it has not contributed;
//!   parts it already contributed keep it.
//! * `reducer_timeout`: the longest a sender waits for the next reply of a reducer while it
//!   has parts outstanding there. A reducer that misses it has **failed**. It is validated to
//!   be larger than `sender_timeout`, but an honest
//!   reducer that waits out a silent sender replies up to `sender_timeout` plus one-way latency
//!   and queueing after the sender's last reply, so `reducer_timeout − sender_timeout` must
//!   exceed that network slack; the defaults (and hivemind's) use `2 × sender_timeout`.
//! * A failed reducer's span (whatever failed it: a deadline, a broken link, an abort, a
//!   malformed reply) is **re-reduced by a stand-in**, the next member in order, where
//!   [`RoundConfig::stand_ins`] is on and the round's deadline leaves time: every sender that
//!   gave up on it re-sends its values of the span there, and the stand-in answers each part
//!   over exactly whoever sent it. Otherwise (or if the stand-ins fail too) the span keeps the
//!   local values (`butterfly/stand_in.rs` has the protocol).
//! * `round_timeout` (optional): a bound on the whole round; a sender that trickles parts just
//!   under `sender_timeout` cannot stretch the round past it.
//! * Malformed or inconsistent messages (wrong part, size, codec, weight, non-finite values,
//!   duplicates, a reply naming impossible contributors) ban the sender or fail the reducer
//!   with a typed [`Violation`]. An [`Message::Abort`] (cancel, ban) does the same at once.
//!
//! The round ends with an [`Outcome`]: what each part became ([`PartResult`]: the average as
//! received, a delta, or local values), applied to the tensors with the delta rule
//! ([`Outcome::apply`]: `tensors += result − start`), and a [`RoundReport`] that names, for
//! every part, the senders whose values it averages or that it stayed local. [`Butterfly`] is one peer's side of a round; it never reads a clock or touches
//! a socket: the caller feeds it messages and `now`, and drives `poll_transmit`, `poll_event`
//! and `poll_timeout` (see [`crate::sim`] for a driver in virtual time).

mod butterfly;
pub mod deadline;
pub mod pacing;
pub mod partition;
mod peer_set;
mod reducer;
mod robust;
pub mod window;

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;

use crate::compression::{CodecError, Compression, CompressionType};
use crate::tensor::{DType, Tensor, TensorError, ops};

pub(crate) use butterfly::encode_part;
pub use butterfly::{Butterfly, MAX_HANDOVERS, MAX_STAND_IN_SPANS};
pub use deadline::{AdaptiveTimeouts, LinkRates};
pub use partition::{
    DEFAULT_PART_SIZE_BYTES, PartSpec, Partition, PartitionError, TensorDescriptor,
};
pub use peer_set::PeerSet;
pub use reducer::{
    CompletedPart, Input, LocalValues, MAX_WEIGHT, ReduceError, Reducer, valid_weight,
};
pub use robust::{Aggregator, CenteredClip};

/// Default `sender_timeout`.
pub const DEFAULT_SENDER_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `reducer_timeout` (twice the sender timeout, as hivemind derives it).
pub const DEFAULT_REDUCER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default cap on the parts a node sender may have outstanding at one reducer (the per-link
/// memory budget in parts, enforced by reducers; the window grows up to it,
/// [`window`]).
pub const DEFAULT_MAX_IN_FLIGHT_PARTS: usize = 16;
/// Default window a node sender starts a link with, before it has measured the link.
pub const DEFAULT_INITIAL_IN_FLIGHT_PARTS: usize = 4;

/// A peer's role in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Sends its values and reduces its span.
    Node,
    /// Sends and receives, reduces nothing, is never dialed.
    Client,
    /// Reduces its span, contributes nothing and applies nothing.
    Aux,
}

impl Mode {
    /// Whether this peer contributes values.
    pub fn is_sender(self) -> bool {
        !matches!(self, Self::Aux)
    }

    /// Whether this peer may reduce a span.
    pub fn is_reducer(self) -> bool {
        !matches!(self, Self::Client)
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "node" => Ok(Self::Node),
            "client" => Ok(Self::Client),
            "aux" => Ok(Self::Aux),
            other => Err(format!("unknown mode '{other}' (node, client or aux)")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Node => "node",
            Self::Client => "client",
            Self::Aux => "aux",
        })
    }
}

/// One member of the group, as every member sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Member {
    /// Its mode.
    pub mode: Mode,
    /// Its share of the reduction (any positive scale; forced to 0 for clients).
    pub fraction: f64,
}

/// The tensors per round (per unit of tensor) that each direction of a member's line carries
/// in a butterfly round, the same both ways: a sender sends its values of the other reducers'
/// spans and receives their averages (`s·(1 − f)`), a reducer with share `f` receives its
/// other senders' parts of its span and sends them its averages (`(S − s)·f`); `s` = 1 for a
/// sender, `S` senders in all. Load balancing (`matchmaking::rate_shares`) and pacing
/// ([`pacing`]) plan with it.
pub fn line_load(sender: bool, senders: usize, share: f64) -> f64 {
    let s = if sender { 1.0 } else { 0.0 };
    s * (1.0 - share) + (senders as f64 - s) * share
}

/// Parameters of one round, identical on every member except `me` and `weight`.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundConfig {
    /// The group, in the agreed order (= reducer order).
    pub members: Vec<Member>,
    /// This peer's index in `members`.
    pub me: usize,
    /// This peer's averaging weight (ignored for aux peers).
    pub weight: f64,
    /// Target size of a compressed part in bytes.
    pub part_size_bytes: usize,
    /// Codec choice per tensor.
    pub compression: Compression,
    /// See the module docs.
    pub sender_timeout: Duration,
    /// See the module docs; must be larger than `sender_timeout`.
    pub reducer_timeout: Duration,
    /// Cap on the parts a node may have outstanding at one reducer before it waits for
    /// replies (a reducer bans a node sender that exceeds it): the per-link memory budget in
    /// parts. Each link's window starts at `initial_in_flight_parts` and grows with the
    /// measured bandwidth-delay product up to this cap ([`window`]).
    pub max_in_flight_parts: usize,
    /// The window a link starts with (clamped to `[1, max_in_flight_parts]`), and its floor.
    pub initial_in_flight_parts: usize,
    /// Measured link rates per member (in member order; empty or shorter: unknown). Every
    /// member must use the same values (they come with the group's declarations).
    pub rates: Vec<LinkRates>,
    /// Timeouts derived from part sizes, `rates` and the round's observed arrivals, within
    /// bounds ([`deadline`]); `None` keeps the fixed `sender_timeout` / `reducer_timeout`.
    pub adaptive_timeouts: Option<AdaptiveTimeouts>,
    /// Bound on the whole round: when it passes, every sender still sending is banned and
    /// every reducer still owing replies is failed, and the round ends with what it has.
    /// `None` (the default) leaves the bound to the caller (e.g. the averager's step timeout).
    pub round_timeout: Option<Duration>,
    /// How this peer's reducer combines the contributions to its parts: the weighted mean
    /// (default) or the robust [`CenteredClip`] ([`Aggregator`]).
    pub aggregator: Aggregator,
    /// Whether a failed reducer's span is re-reduced by a stand-in (the next member in order)
    /// where the round's deadline allows, instead of keeping local values (see the module
    /// docs). Every member must understand stand-ins (a member that predates them bans the
    /// sender of a part outside its span). Off by default: the simulator and `bench-worker`
    /// turn it on; the averager turns it on where every member declared it
    /// (`MemberInfo::stand_ins`).
    pub stand_ins: bool,
    /// How much later than this peer the other members may begin the round: they may still be
    /// linking (a member that waits for a link gives up on it only after its link timeout, while
    /// one that dials a dead member learns at once). The first part from each sender and the
    /// first reply from each reducer (on every span, stand-in spans included) are awaited from
    /// the end of this grace at the earliest, with the usual timeout on top; later ones as
    /// usual. Zero (the default) starts every deadline with the round. The averager sets it to
    /// what is left of its link timeout (so a member silent from the start is dropped within
    /// the link timeout plus its usual timeout); without it, the member that began first
    /// banned the others, healthy but still linking (`tests/integration/averager.rs`,
    /// `member_dying_mid_round_does_not_hang_the_others`).
    pub start_grace: Duration,
    /// Whether every flow of the round is paced at the plan's rate from `rates` ([`pacing`];
    /// nothing is paced while a member's rates are unknown). Off by default; the averager
    /// turns it on (`AveragerConfig::pace_links`).
    pub pace_links: bool,
}

impl RoundConfig {
    /// A config with defaults for everything but the group and this peer's index.
    pub fn new(members: Vec<Member>, me: usize) -> Self {
        Self {
            members,
            me,
            weight: 1.0,
            part_size_bytes: DEFAULT_PART_SIZE_BYTES,
            compression: Compression::default(),
            sender_timeout: DEFAULT_SENDER_TIMEOUT,
            reducer_timeout: DEFAULT_REDUCER_TIMEOUT,
            max_in_flight_parts: DEFAULT_MAX_IN_FLIGHT_PARTS,
            initial_in_flight_parts: DEFAULT_INITIAL_IN_FLIGHT_PARTS,
            rates: Vec::new(),
            adaptive_timeouts: None,
            round_timeout: None,
            aggregator: Aggregator::Mean,
            stand_ins: false,
            start_grace: Duration::ZERO,
            pace_links: false,
        }
    }

    /// The effective fractions (0 for clients).
    pub fn fractions(&self) -> Vec<f64> {
        self.members
            .iter()
            .map(|m| if m.mode.is_reducer() { m.fraction } else { 0.0 })
            .collect()
    }
}

/// Which side of a link a message or failure concerns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The peer as a sender of parts to us.
    Sender,
    /// The peer as the reducer of our parts.
    Reducer,
}

/// Why a peer aborts its part of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// Its step was cancelled.
    Cancelled,
    /// It banned the receiver (as a sender) or gave up on it (as a reducer).
    Banned,
    /// It failed internally.
    Internal,
}

/// A message between two members of a round (the group id travels in the framing).
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// Sender -> reducer: one part of the sender's values.
    Part(PartMessage),
    /// Reducer -> sender: the delta for one part.
    Averaged(AveragedMessage),
    /// Either direction: the sending peer leaves the link in the given role.
    Abort {
        /// The role the aborting peer leaves.
        role: Role,
        /// Why.
        reason: AbortReason,
    },
    /// A chain of members relaying data (a lasting group's broadcast): the members the sender
    /// knows failed; none, sent upstream, means every member past the sender has all the
    /// data. Not part of a round: a round's peer that sends it breaks the protocol.
    Notice {
        /// Indices of the members known to have failed.
        failed: PeerSet,
    },
}

impl Message {
    /// Bytes of payload carried (for bandwidth accounting).
    pub fn payload_len(&self) -> usize {
        match self {
            Self::Part(p) => p.payload.len(),
            Self::Averaged(a) => a.payload.len(),
            Self::Abort { .. } | Self::Notice { .. } => 0,
        }
    }
}

/// One encoded part of a sender's values.
#[derive(Clone, Debug, PartialEq)]
pub struct PartMessage {
    /// Global part index.
    pub part: u32,
    /// The sender's averaging weight.
    pub weight: f64,
    /// Codec of the payload.
    pub codec: CompressionType,
    /// Dtype the payload declares.
    pub dtype: DType,
    /// Encoded values.
    pub payload: Bytes,
}

/// The delta for one part, from its reducer.
#[derive(Clone, Debug, PartialEq)]
pub struct AveragedMessage {
    /// Global part index.
    pub part: u32,
    /// Codec of the payload (the one the sender used for the part).
    pub codec: CompressionType,
    /// Dtype the payload declares.
    pub dtype: DType,
    /// Senders whose values are in the average; empty means "no average, keep local" (and
    /// then the payload is empty).
    pub contributors: PeerSet,
    /// For lossy codecs, the encoded `average − sender's decoded input`; for the lossless
    /// `none` codec, the encoded average itself (the same bytes for every sender).
    pub payload: Bytes,
    /// Not on the wire: whether the payload's little-endian f32 values are all finite, when
    /// the receiving side has checked already (the runner checks a lossless f32 payload as
    /// soon as its frame is read, while the bytes are still in cache); `None` when not
    /// checked, and then the round checks it.
    pub finite: Option<bool>,
}

/// An outgoing message.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// Destination peer index.
    pub to: usize,
    /// The message.
    pub message: Message,
}

/// A protocol violation or failure that got a peer banned or marked as a failed reducer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// The sender missed `sender_timeout`.
    #[error("sender timed out")]
    SenderTimeout,
    /// The reducer missed `reducer_timeout`.
    #[error("reducer timed out")]
    ReducerTimeout,
    /// The peer aborted.
    #[error("peer aborted: {0:?}")]
    Aborted(AbortReason),
    /// The transport reported the link dead.
    #[error("link failed")]
    LinkFailed,
    /// A part the reducer refused.
    #[error(transparent)]
    Reduce(#[from] ReduceError),
    /// A payload that does not decode.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A part out of order, or sent to a peer that reduces nothing.
    #[error("unexpected part {part} (expected {expected:?})")]
    UnexpectedPart {
        /// Part index received.
        part: u32,
        /// Part index expected next, if any.
        expected: Option<usize>,
    },
    /// A reply for a part that was not sent, already answered, or outside the span.
    #[error("unexpected reply for part {0}")]
    UnexpectedReply(u32),
    /// Codec or dtype other than the group's configuration prescribes.
    #[error("part {part} declares {codec:?}/{dtype}, expected {expected_codec:?}/{expected_dtype}")]
    WrongEncoding {
        /// Part index.
        part: u32,
        /// Declared codec.
        codec: CompressionType,
        /// Declared dtype.
        dtype: DType,
        /// Codec the configuration prescribes.
        expected_codec: CompressionType,
        /// Dtype the configuration prescribes.
        expected_dtype: DType,
    },
    /// A reply naming contributors that cannot be (not senders, or without us).
    #[error("reply for part {0} names impossible contributors")]
    BadContributors(u32),
    /// A reply with non-finite deltas.
    #[error("reply for part {0} carries non-finite values")]
    NonFiniteDelta(u32),
    /// A node sender has more parts outstanding than the window allows.
    #[error("more than {0} parts in flight")]
    WindowExceeded(usize),
    /// A sender changed its weight during the round.
    #[error("weight changed from {first} to {now}")]
    WeightChanged {
        /// The weight of its first part.
        first: f64,
        /// The weight now.
        now: f64,
    },
    /// The whole round ran past `round_timeout`.
    #[error("round timed out")]
    RoundTimeout,
    /// A message of another protocol (a chain's [`Message::Notice`] in a round or an
    /// exchange).
    #[error("unexpected chain notice")]
    UnexpectedNotice,
    /// A chain's next member took no data, or did not confirm that the members past it have
    /// it, in time.
    #[error("the next member in the chain took no data or gave no confirmation in time")]
    DownstreamTimeout,
    /// A chain neighbour reported the member failed.
    #[error("reported failed by member {by}")]
    ReportedFailed {
        /// The member that reported it.
        by: usize,
    },
    /// A chain notice that cannot be: it names us or members out of range, or says done
    /// before all the data went downstream.
    #[error("impossible chain notice")]
    BadNotice,
}

/// Errors that stop a round from starting or finishing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RoundError {
    /// `me` is not an index of `members`.
    #[error("own index {me} is outside the group of {size}")]
    NotInGroup {
        /// Own index.
        me: usize,
        /// Group size.
        size: usize,
    },
    /// `reducer_timeout` is not larger than `sender_timeout`.
    #[error("reducer_timeout ({reducer:?}) must be larger than sender_timeout ({sender:?})")]
    Timeouts {
        /// Sender timeout.
        sender: Duration,
        /// Reducer timeout.
        reducer: Duration,
    },
    /// Every member is aux: nobody contributes values.
    #[error("the group has no senders (every member is aux)")]
    NoSenders,
    /// No member can reduce (all clients or all zero fractions).
    #[error("no member reduces anything: {0}")]
    NoReducers(PartitionError),
    /// Bad partition parameters.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// Own weight is not 0 or a normal number up to [`MAX_WEIGHT`].
    #[error("weight {0} is not 0 or a normal number up to {MAX_WEIGHT:e}")]
    BadWeight(f64),
    /// `max_in_flight_parts` is zero.
    #[error("max_in_flight_parts must be at least 1")]
    ZeroWindow,
    /// [`AdaptiveTimeouts`] bounds out of range (`0 < min ≤ max`, `factor ≥ 1`).
    #[error("adaptive timeouts need 0 < min <= max and factor >= 1, got {0:?}")]
    BadAdaptiveTimeouts(AdaptiveTimeouts),
    /// [`CenteredClip`] parameters out of range (`tau` must be positive, `tolerance` not
    /// negative).
    #[error("CenteredClip needs tau > 0 and tolerance >= 0, got tau {tau}, tolerance {tolerance}")]
    BadAggregator {
        /// The radius given.
        tau: f64,
        /// The tolerance given.
        tolerance: f64,
    },
    /// A message named a peer index outside the group.
    #[error("peer index {0} is outside the group")]
    UnknownPeer(usize),
    /// The round was cancelled.
    #[error("the round was cancelled")]
    Cancelled,
    /// The round has not finished yet.
    #[error("the round has not finished")]
    NotFinished,
    /// Applying deltas failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A group operation's plan names elements its tensors do not have.
    #[error("inconsistent plan: {0}")]
    BadPlan(String),
}

/// Something the driver should know about.
#[derive(Debug, Clone, PartialEq)]
pub enum RoundEvent {
    /// A sender was banned from this peer's span.
    Banned {
        /// Peer index.
        peer: usize,
        /// Why.
        reason: Violation,
    },
    /// A reducer failed for this peer; its remaining parts stay local.
    ReducerFailed {
        /// Peer index.
        peer: usize,
        /// Why.
        reason: Violation,
    },
    /// A message was refused from a peer that has no role it could be banned from here (a
    /// part sent to a peer that reduces nothing, a reply from a peer that is not our reducer).
    Rejected {
        /// Peer index.
        peer: usize,
        /// Why.
        reason: Violation,
    },
    /// The round finished; [`Butterfly::outcome`] is ready.
    Finished,
}

/// A run of consecutive parts with the same result.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// Global part indices.
    pub parts: Range<usize>,
    /// The senders averaged into these parts, or `None` where the local values were kept.
    pub contributors: Option<PeerSet>,
}

/// What happened to one reducer's span, from this peer's point of view.
#[derive(Clone, Debug, PartialEq)]
pub struct SpanReport {
    /// The reducer's index.
    pub reducer: usize,
    /// Its global part indices.
    pub parts: Range<usize>,
    /// Runs of parts, in order, covering `parts`.
    pub segments: Vec<Segment>,
}

/// What one round did, part by part.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RoundReport {
    /// One entry per reducer with a non-empty span that concerns this peer (all of them for
    /// senders; only its own for an aux peer).
    pub spans: Vec<SpanReport>,
    /// Senders this peer banned from its span.
    pub banned: PeerSet,
    /// Reducers that failed for this peer.
    pub failed_reducers: PeerSet,
}

impl RoundReport {
    /// The contributors of global part `part`, `None` if it stayed local or is not covered.
    pub fn contributors(&self, part: usize) -> Option<&PeerSet> {
        self.spans
            .iter()
            .flat_map(|s| &s.segments)
            .find(|seg| seg.parts.contains(&part))
            .and_then(|seg| seg.contributors.as_ref())
    }

    /// Global part indices that kept local values.
    pub fn local_parts(&self) -> impl Iterator<Item = usize> + '_ {
        self.spans
            .iter()
            .flat_map(|s| &s.segments)
            .filter(|seg| seg.contributors.is_none())
            .flat_map(|seg| seg.parts.clone())
    }
}

/// What one part of a sender's tensors became in a round.
#[derive(Clone, Debug, PartialEq)]
pub enum PartResult {
    /// No average reached this peer for the part: its values stay as they are.
    Local,
    /// The part's average as little-endian f32 bytes (lossless rounds). A reply's bytes are
    /// kept as they arrived, in the received frame, and the own span's average as the buffer
    /// the reducer wrote it to: neither is copied.
    Average(Bytes),
    /// What to add to the values this peer started the round with (lossy codecs, whose
    /// replies carry the delta against the input as the reducer decoded it).
    Delta(Vec<f32>),
}

/// The result of a finished round.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Per part of the partition (global part order), what this peer's values became; `None`
    /// for an aux peer, which applies nothing.
    pub results: Option<Vec<PartResult>>,
    /// The partition's parts, aligned with `results`.
    pub parts: Vec<PartSpec>,
    /// What was averaged.
    pub report: RoundReport,
    /// Error feedback of this peer's quantized sparse replies ([`crate::compression::
    /// SparseTopK::reply_bits`] below 32): for each global part whose result is a reply this
    /// peer encoded (as the part's reducer or its stand-in) and applied itself, the reply's
    /// error, `average − decoded reply`, times the contributors' total weight over this peer's
    /// weight (times 1 under [`Aggregator::Sum`]), so that the group's next average carries it
    /// when it is added to this peer's residual ([`crate::compression::feedback`]). Empty for
    /// other codecs, raw f32 replies and aggregators other than the mean and the sum.
    pub reply_feedback: Vec<(usize, Vec<f32>)>,
}

/// Checks that `tensors` has the layout `parts` were cut from (every part inside its tensor).
fn check_layout(parts: &[PartSpec], tensors: &[Tensor], what: &str) -> Result<(), RoundError> {
    for p in parts {
        let fits = tensors
            .get(p.tensor)
            .zip(p.offset.checked_add(p.len))
            .is_some_and(|(t, end)| end <= t.numel());
        if !fits {
            return Err(TensorError::Mismatch(format!(
                "{what}: {} tensors do not hold part {:?} of the round",
                tensors.len(),
                p
            ))
            .into());
        }
    }
    Ok(())
}

impl PartResult {
    /// Whether the result fits a part of `len` elements.
    fn fits(&self, len: usize) -> bool {
        match self {
            PartResult::Local => true,
            PartResult::Average(avg) => avg.len() == len * 4,
            PartResult::Delta(d) => d.len() == len,
        }
    }
}

impl Outcome {
    /// Checks that `results` (if any) match `parts`, one fitting result per part.
    pub(crate) fn check_results(&self) -> Result<(), RoundError> {
        let Some(results) = &self.results else {
            return Ok(());
        };
        let fits = results.len() == self.parts.len()
            && self.parts.iter().zip(results).all(|(p, r)| r.fits(p.len));
        if fits {
            Ok(())
        } else {
            Err(TensorError::Mismatch("the outcome's results do not match its parts".into()).into())
        }
    }

    /// The delta rule: adds `alpha · (result − start)` to `tensors`, where `start` holds the
    /// values this peer started the round with (the runner hands them back) and `tensors` the
    /// values now (they may have moved on while the round ran). No-op for an aux peer.
    pub fn apply(
        &self,
        tensors: &mut [Tensor],
        start: &[Tensor],
        alpha: f32,
    ) -> Result<(), RoundError> {
        let all: Vec<usize> = (0..tensors.len()).collect();
        self.apply_mapped(tensors, &all, start, alpha)
    }

    /// [`Outcome::apply`] where `tensors` holds only some of the round's tensors: `tensors[k]`
    /// is round tensor `round_index[k]` (ascending); parts of the others are left out (an
    /// averager's device tensors, applied on the device).
    pub(crate) fn apply_mapped(
        &self,
        tensors: &mut [Tensor],
        round_index: &[usize],
        start: &[Tensor],
        alpha: f32,
    ) -> Result<(), RoundError> {
        let Some(results) = &self.results else {
            return Ok(());
        };
        self.check_results()?;
        check_layout(&self.parts, start, "start values")?;
        if round_index.len() != tensors.len() {
            return Err(TensorError::Mismatch("a tensor map of another length".into()).into());
        }
        for (spec, result) in self.parts.iter().zip(results) {
            let Ok(k) = round_index.binary_search(&spec.tensor) else {
                continue;
            };
            check_layout(&[PartSpec { tensor: k, ..*spec }], tensors, "tensors")?;
            let from = start[spec.tensor].part(spec.range());
            let t = &mut tensors[k];
            match result {
                PartResult::Local => {}
                PartResult::Average(avg) => t.add_average(spec.offset, avg, from, alpha)?,
                PartResult::Delta(d) => t.add_scaled_f32(spec.offset, d, alpha)?,
            }
        }
        Ok(())
    }

    /// Replaces `tensors` (the values the round started from) by the round's result: the
    /// average, `start + delta`, or nothing where a part stayed local. No copy of the tensors,
    /// unlike [`Outcome::apply`], which needs the start values beside the target.
    pub fn apply_in_place(&self, tensors: &mut [Tensor]) -> Result<(), RoundError> {
        let Some(results) = &self.results else {
            return Ok(());
        };
        self.check_results()?;
        check_layout(&self.parts, tensors, "tensors")?;
        for (spec, result) in self.parts.iter().zip(results) {
            let t = &mut tensors[spec.tensor];
            match result {
                PartResult::Local => {}
                PartResult::Average(avg) => t.set_from_le(spec.offset, avg)?,
                PartResult::Delta(d) => t.add_scaled_f32(spec.offset, d, 1.0)?,
            }
        }
        Ok(())
    }

    /// Writes part `part`'s resulting values into `out` (`parts[part].len` of them): the
    /// average, `start + delta`, or the start values where the part stayed local. `None` for
    /// an aux peer or a part index out of range.
    pub fn result_into(&self, part: usize, start: &[Tensor], out: &mut [f32]) -> Option<()> {
        let spec = self.parts.get(part)?;
        let result = self.results.as_ref()?.get(part)?;
        if out.len() != spec.len
            || !result.fits(spec.len)
            || check_layout(std::slice::from_ref(spec), start, "").is_err()
        {
            return None;
        }
        match result {
            PartResult::Average(avg) => ops::copy_from_le(out, avg),
            PartResult::Local | PartResult::Delta(_) => {
                start[spec.tensor].part(spec.range()).copy_to_f32(out);
                if let PartResult::Delta(d) = result {
                    ops::add_scaled(out, d, 1.0);
                }
            }
        }
        Some(())
    }

    /// Per tensor, the flat deltas `result − start` (zero where values stay local); `None`
    /// for an aux peer. Allocates them all: for tests and tools, where [`Outcome::apply`] is
    /// not what is wanted.
    pub fn deltas(&self, start: &[Tensor]) -> Result<Option<Vec<Vec<f32>>>, RoundError> {
        if self.results.is_none() {
            return Ok(None);
        }
        self.check_results()?;
        check_layout(&self.parts, start, "start values")?;
        let mut deltas: Vec<Vec<f32>> = start.iter().map(|t| vec![0.0; t.numel()]).collect();
        let mut own = Vec::new();
        for (spec, result) in self.parts.iter().zip(self.results.iter().flatten()) {
            let out = &mut deltas[spec.tensor][spec.range()];
            match result {
                PartResult::Local => {}
                PartResult::Delta(d) => out.copy_from_slice(d),
                PartResult::Average(avg) => {
                    ops::copy_from_le(out, avg);
                    own.resize(spec.len, 0.0);
                    start[spec.tensor].part(spec.range()).copy_to_f32(&mut own);
                    ops::sub_assign(out, &own);
                }
            }
        }
        Ok(Some(deltas))
    }

    /// Gives the decoded deltas' buffers to `pool` (received bytes go back to their pool when
    /// the outcome is dropped).
    pub fn recycle(self, pool: &crate::buffers::BufferPool) {
        for result in self.results.into_iter().flatten() {
            if let PartResult::Delta(d) = result {
                pool.put_f32(d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(v: &[f32]) -> Bytes {
        Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    /// Two tensors, three parts: an average, a delta and a local part.
    fn outcome() -> Outcome {
        Outcome {
            results: Some(vec![
                PartResult::Average(le(&[10.0, 20.0])),
                PartResult::Delta(vec![0.5, -0.5]),
                PartResult::Local,
            ]),
            parts: vec![
                PartSpec {
                    tensor: 0,
                    offset: 0,
                    len: 2,
                },
                PartSpec {
                    tensor: 0,
                    offset: 2,
                    len: 2,
                },
                PartSpec {
                    tensor: 1,
                    offset: 0,
                    len: 1,
                },
            ],
            report: RoundReport {
                spans: Vec::new(),
                banned: PeerSet::new(),
                failed_reducers: PeerSet::new(),
            },
            reply_feedback: Vec::new(),
        }
    }

    /// Applying to some of the round's tensors (an averager's host tensors beside device
    /// ones) touches exactly those, as the full apply would.
    #[test]
    fn apply_mapped_applies_to_the_mapped_tensors_only() {
        let o = outcome();
        let start = vec![
            Tensor::from_f32(&[4], vec![1.0, 2.0, 3.0, 4.0]).unwrap(),
            Tensor::from_f32(&[3], vec![5.0, 6.0, 7.0]).unwrap(),
        ];
        let mut all = start.clone();
        o.apply(&mut all, &start, 1.0).unwrap();
        for k in 0..2 {
            let mut one = vec![start[k].clone()];
            o.apply_mapped(&mut one, &[k], &start, 1.0).unwrap();
            assert_eq!(one[0], all[k], "tensor {k}");
        }
        // A map of another length, or a tensor too small for its parts, is an error.
        let mut one = vec![start[0].clone()];
        assert!(o.apply_mapped(&mut one, &[0, 1], &start, 1.0).is_err());
        let mut wrong = vec![start[1].clone()];
        assert!(o.apply_mapped(&mut wrong, &[0], &start, 1.0).is_err());
        // The mapped tensors changed where the outcome says, and only there.
        assert_ne!(all[0], start[0]);
    }

    #[test]
    fn apply_is_the_delta_rule_for_each_kind_of_result() {
        let o = outcome();
        let start = vec![
            Tensor::from_f32(&[4], vec![1.0, 2.0, 3.0, 4.0]).unwrap(),
            Tensor::from_f32(&[1], vec![7.0]).unwrap(),
        ];
        // The values moved on by +1 while the round ran: the delta still applies on top.
        let mut now = vec![
            Tensor::from_f32(&[4], vec![2.0, 3.0, 4.0, 5.0]).unwrap(),
            Tensor::from_f32(&[1], vec![8.0]).unwrap(),
        ];
        o.apply(&mut now, &start, 1.0).unwrap();
        assert_eq!(now[0].to_f32_vec(), vec![11.0, 21.0, 4.5, 4.5]);
        assert_eq!(now[1].to_f32_vec(), vec![8.0]);
        let deltas = o.deltas(&start).unwrap().unwrap();
        assert_eq!(deltas, vec![vec![9.0, 18.0, 0.5, -0.5], vec![0.0]]);
        let mut out = [0.0; 2];
        o.result_into(0, &start, &mut out).unwrap();
        assert_eq!(out, [10.0, 20.0]);
        o.result_into(1, &start, &mut out).unwrap();
        assert_eq!(out, [3.5, 3.5]);
        assert!(o.result_into(3, &start, &mut out).is_none());
        assert!(o.result_into(0, &start, &mut [0.0; 3]).is_none());

        // Half-precision tensors: computed in f32, rounded once.
        let start16 = vec![
            Tensor::from_f32_as(&[4], &[1.0, 2.0, 3.0, 4.0], DType::F16).unwrap(),
            Tensor::from_f32_as(&[1], &[7.0], DType::BF16).unwrap(),
        ];
        let mut now16 = start16.clone();
        o.apply(&mut now16, &start16, 0.5).unwrap();
        assert_eq!(now16[0].to_f32_vec(), vec![5.5, 11.0, 3.25, 3.75]);
    }

    #[test]
    fn mismatched_layouts_are_errors_not_panics() {
        let o = outcome();
        let start = vec![Tensor::from_f32(&[4], vec![0.0; 4]).unwrap()];
        let mut now = start.clone();
        assert!(o.apply(&mut now, &start, 1.0).is_err(), "a tensor missing");
        assert!(o.deltas(&start).is_err());
        let mut bad = outcome();
        bad.results.as_mut().unwrap()[1] = PartResult::Delta(vec![1.0; 3]);
        let start = vec![
            Tensor::from_f32(&[4], vec![0.0; 4]).unwrap(),
            Tensor::from_f32(&[1], vec![0.0]).unwrap(),
        ];
        let mut now = start.clone();
        assert!(
            bad.apply(&mut now, &start, 1.0).is_err(),
            "a delta too long"
        );
        assert_eq!(now, start, "nothing applied");
        let aux = Outcome {
            results: None,
            ..outcome()
        };
        aux.apply(&mut now, &start, 1.0).unwrap();
        assert_eq!(aux.deltas(&start).unwrap(), None);
    }
}
