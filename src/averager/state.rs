//! State sharing: a newcomer downloads the current tensors (and the user metadata shared with
//! them) from averagers that already hold them, [`Averager::load_state_from_peers`].
//!
//! # Donors announce themselves
//!
//! An averager that shares its state ([`AveragerConfig::allow_state_sharing`], only
//! [`Mode::Node`] averagers can) writes an [`Announcement`] under the DHT key
//! `"{prefix}.all_averagers"`, an [owned key](crate::dht::owned_key) ([`registry_key`]: no
//! plain value, no other peer's entry, a bounded size per entry, so nobody can squat it),
//! subkey = its own owner subkey (signed, so nobody can announce or withdraw in its name), value = its priority
//! ([`AveragerConfig::state_priority`]) and its listen addresses (dials go by peer id, and a
//! newcomer may not know the donor yet), expiring [`StateConfig::declare_period`] ahead and
//! re-written every half period by a task the averager owns. Disabling sharing (or shutting
//! down) writes "not sharing" once, at a later expiration, so it supersedes the last
//! announcement; the setters ([`Averager::set_allow_state_sharing`],
//! [`Averager::set_state_priority`]) return once that write is stored. This is hivemind's
//! `declare_state_period` loop, with the priority `None` of a withdrawn peer as a typed value.
//!
//! # The protocol
//!
//! `/hivemesh/state/1/<prefix>` ([`protocol`]) on libp2p streams. The newcomer writes one
//! length-delimited request at a time and reads its answer ([`wire`]):
//!
//! * `Metadata` → the donor snapshots its state: its tensors and metadata, or whatever its
//!   [`StateProvider`] returns (see below). The snapshot holds the raw bytes of every tensor,
//!   little-endian as on every target hivemesh builds for, concatenated; copied under the
//!   tensor lock, hashed on a blocking thread; the last snapshot, hashes included, is reused
//!   while neither the tensors nor the metadata changed, so repeated requests cost no copy and
//!   no hash; where a tensor is external memory or a provider serves the state, a change goes
//!   unseen, so the snapshot is reused for a second or twenty times what building it took,
//!   whichever is longer: however often peers ask, building takes at most ~5% of the donor's
//!   time),
//!   opens a **session** for the newcomer and answers with the session id, its schema hash, the
//!   tensor shapes and dtypes, the total size, the chunk size ([`StateConfig::chunk_bytes`]),
//!   the SHA-256 of every chunk and a **content hash** over all of that and the metadata
//!   ([`wire::content_hash`]).
//! * `Chunk{session, index}` → the chunk's bytes, from the session's snapshot: the donor keeps
//!   serving exactly the state it described even while its tensors change.
//! * `Release{session}` → no answer; the session is dropped.
//! * Any request may be answered `Refused(reason)` ([`Refusal`]): not sharing (sharing is off:
//!   every session is dropped too), busy, unknown session, chunk out of range.
//!
//! Sessions are bounded (`state/sessions.rs`): one per peer id (a new `Metadata` request
//! replaces it), at most [`StateConfig::max_sessions`] in all, dropped after
//! [`StateConfig::session_idle_timeout`] without a request; when every slot is taken, a
//! newcomer evicts the session that has fallen furthest behind
//! [`StateConfig::min_session_rate`] (after a grace of [`StateConfig::session_grace`]), and
//! is `Busy` only if every session keeps up, so sybils trickling a chunk a minute cannot hold
//! every slot; sessions whose snapshots have equal content hashes share one copy. At most one
//! snapshot is built at a time. Inbound streams are served each in its own task, at most
//! [`StateConfig::max_inbound`] at once and [`StateConfig::max_inbound_per_peer`] for one peer
//! (more are dropped: their openers retry), each request read under the idle timeout with its
//! length checked from its prefix before anything is buffered ([`wire::MAX_REQUEST_BYTES`]);
//! garbage, an oversized prefix or a second request sent before the first is answered closes
//! that stream only.
//!
//! # The download
//!
//! 1. Read the registry; keep the peers announcing a finite priority, skip ourselves, sort by
//!    priority (highest first, ties by peer id); add their announced addresses to the swarm.
//! 2. Ask the first [`StateConfig::max_donors`] of them for metadata at once. Keep the answers
//!    whose schema (hash and tensor descriptors) is ours; the decoder has already checked that
//!    sizes add up and that the content hash matches the description.
//! 3. The best-priority usable answer (with [`Trust::min_agreeing`] > 1: the first content hash
//!    that many answers share, asking further batches until one is) is the **reference**; every
//!    answer with the same content hash serves the same bytes, so the download runs from all of them **in parallel**:
//!    [`StateConfig::streams_per_donor`] streams per donor (the first is the metadata stream),
//!    each asking one chunk at a time from a shared queue, so faster donors take more chunks.
//!    Every chunk is checked on arrival (index, length, SHA-256 against the reference's list):
//!    a donor that sends a bad chunk, refuses or breaks the protocol is dropped and its chunk
//!    goes back to the queue for the others; a stream that fails (I/O, timeout: including the
//!    streams libp2p-stream 0.5.0-alpha drops, see [`crate::p2p`]) is re-opened, up to
//!    [`StateConfig::attempts`] consecutive failures per stream. **End game:** once no chunk
//!    is left to hand out, an idle stream also asks for the chunk in flight longest that its
//!    donor is not fetching (at most two copies of a chunk at once); the first verified copy
//!    counts and the download ends as soon as every chunk has one. So a donor that answers
//!    slowly (each chunk just under the request timeout, or never) holds up the download no
//!    longer than the other donors take to fetch what it holds. A lone slow donor can only be
//!    waited for, up to [`StateConfig::load_timeout`].
//! 4. Once every chunk is verified, the tensors are replaced in one go under the tensor lock
//!    (after checking that they still have the schema) and the metadata is replaced too, so the
//!    newcomer can serve the state it loaded. If the set of donors fails, the next content hash
//!    among the answers is tried, then the next batch of candidates.
//!
//! Everything runs under [`StateConfig::request_timeout`] per request and
//! [`StateConfig::load_timeout`] overall. Nothing is installed unless the whole state arrived
//! and verified: a partial or corrupt download is an error, never a silently wrong state.
//! `Ok(None)` means no donor was available (none announced, or every one refused or could not be
//! reached); donors that answered with another schema give [`StateError::SchemaMismatch`].
//!
//! # Serving another state
//!
//! By default a donor serves its averaged tensors and [`Averager::set_state_metadata`]'s
//! bytes. A [`StateProvider`] ([`Averager::set_state_provider`]) replaces that with whatever it
//! returns: any number of tensors of any shapes and dtypes (hivemind's `TrainingStateAverager`
//! serves parameters, optimizer statistics and extra tensors) and its own metadata. The donor
//! calls it on a blocking thread, never on a network task, bounded by
//! [`StateConfig::request_timeout`]: a provider that fails, or has not answered by then, gets
//! the newcomer a `Busy` refusal (it asks the next donor), and while a call is still running no
//! second one starts (`Busy` too), so a provider that hangs holds one thread, not one per
//! request. A provided state is reused for a second, or twenty times what building it took if
//! longer (the provider's state changes without the averager knowing), and must fit the wire's limits
//! ([`wire::MAX_TENSORS`], [`wire::MAX_DIMS`], [`wire::MAX_METADATA_BYTES`]).
//!
//! The schema hash in a provided state's description stays the averager's (it says which
//! averaging the donor belongs to). A newcomer that installs the state
//! ([`Averager::load_state_from_peers`]) needs the donor's tensors to have its own shapes and
//! dtypes (else [`DonorError::SchemaMismatch`]); one that only fetches it
//! ([`Averager::download_state_from_peers`]) takes any tensors.
//!
//! What verification cannot catch: the reference donor itself lying consistently (a wrong state
//! with matching hashes). Nothing distinguishes it from an honest donor with a different state,
//! and a donor's priority is its own claim; the caller's [`Trust`] decides instead (an allowlist,
//! agreement of several donors on the content hash: `trust.rs`), and a state holding a NaN or
//! an infinity is never installed. Donors with different states (any local update, or the
//! last-ulp differences an all-reduce leaves between peers) have different content hashes, so
//! in practice a download is parallel only across donors whose states are byte-identical.

mod donor;
mod download;
mod sessions;
mod trust;
pub mod wire;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use libp2p::{Multiaddr, PeerId};
use rand::RngExt;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::{Averager, AveragerConfig, AveragerError, Shared};
use crate::allreduce::{Mode, TensorDescriptor};
use crate::dht::{Dht, DhtError, DhtTime};
use crate::p2p::{InboundStreams, P2p, P2pError, P2pStream};
use crate::shares::Shares;
use crate::tensor::{PartViewMut, Tensor};

use donor::*;
use sessions::Sessions;

pub use trust::Trust;
pub use wire::{Metadata, Refusal, Request, Response, WireError};

/// Default [`StateConfig::declare_period`] (hivemind's `declare_state_period`).
pub const DEFAULT_DECLARE_PERIOD: Duration = Duration::from_secs(30);
/// Default [`StateConfig::chunk_bytes`].
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;
/// Default [`StateConfig::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`StateConfig::load_timeout`] (hivemind's `load_state_timeout`).
pub const DEFAULT_LOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// Default [`StateConfig::session_grace`].
pub const DEFAULT_SESSION_GRACE: Duration = Duration::from_secs(30);
/// Default [`StateConfig::min_session_rate`]: 256 KiB/s, a 1 MiB chunk every 4 s.
pub const DEFAULT_MIN_SESSION_RATE: u64 = 256 << 10;

/// State-sharing parameters, both sides.
#[derive(Clone, Debug)]
pub struct StateConfig {
    /// Donor: how long an announcement lives; it is re-written every half period.
    pub declare_period: Duration,
    /// Donor: chunk size of its snapshots (clamped to
    /// [`wire::MIN_CHUNK_BYTES`]`..=`[`wire::MAX_CHUNK_BYTES`]).
    pub chunk_bytes: usize,
    /// Donor: most sessions held at once (each may hold a copy of the state).
    pub max_sessions: usize,
    /// Donor: a session (and a stream) without requests for this long is dropped.
    pub session_idle_timeout: Duration,
    /// Donor: the credit a new session opens with, and the most a session may bank ahead
    /// (see [`StateConfig::min_session_rate`]).
    pub session_grace: Duration,
    /// Donor: bytes per second a session must fetch, on average since it opened (with at most
    /// [`StateConfig::session_grace`] banked), to keep its slot when every slot is taken and a
    /// newcomer asks; the session that fell furthest behind is evicted for the newcomer.
    pub min_session_rate: u64,
    /// Donor: most inbound streams served at once.
    pub max_inbound: usize,
    /// Donor: most inbound streams served at once for one peer (a newcomer needs
    /// [`StateConfig::streams_per_donor`]), so that one peer holding its share leaves the rest
    /// of [`StateConfig::max_inbound`] to others.
    pub max_inbound_per_peer: usize,
    /// Both: bound on one request and its answer, stream opening included (donor: on writing
    /// an answer). A metadata answer includes the donor's snapshot time.
    pub request_timeout: Duration,
    /// Newcomer: bound on a whole [`Averager::load_state_from_peers`].
    pub load_timeout: Duration,
    /// Newcomer: donors asked for metadata at once (and at most downloaded from at once).
    pub max_donors: usize,
    /// Newcomer: streams per donor during a download.
    pub streams_per_donor: usize,
    /// Newcomer: attempts per metadata request and consecutive failures per stream.
    pub attempts: usize,
    /// Newcomer: which donors' states it downloads (an allowlist, agreement of several donors
    /// on the content hash; see [`Trust`]). The default trusts the best-priority answer.
    pub trust: Trust,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            declare_period: DEFAULT_DECLARE_PERIOD,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            max_sessions: 4,
            session_idle_timeout: Duration::from_secs(60),
            session_grace: DEFAULT_SESSION_GRACE,
            min_session_rate: DEFAULT_MIN_SESSION_RATE,
            max_inbound: 32,
            max_inbound_per_peer: 8,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            load_timeout: DEFAULT_LOAD_TIMEOUT,
            max_donors: 4,
            streams_per_donor: 2,
            attempts: 3,
            trust: Trust::default(),
        }
    }
}

/// The protocol name for `prefix`.
pub fn protocol(prefix: &str) -> String {
    format!("/hivemesh/state/1/{prefix}")
}

/// The DHT key under which the donors of `prefix` announce themselves: the
/// [owned key](crate::dht::owned_key) `"{prefix}.all_averagers"`.
pub fn registry_key(prefix: &str) -> Vec<u8> {
    crate::dht::owned_key(format!("{prefix}.all_averagers"))
}

/// Most addresses an [`Announcement`] carries.
pub const MAX_ANNOUNCED_ADDRS: usize = crate::dht::MAX_ADDRS;
/// Longest announced address, in bytes (binary multiaddr).
pub const MAX_ANNOUNCED_ADDR_BYTES: usize = crate::dht::MAX_ADDR_BYTES;

/// The donor side's counters ([`Averager::state_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateStats {
    /// Snapshots of the state built for newcomers. A snapshot is reused while the tensors and
    /// the metadata stay as they were, so a peer repeating metadata requests costs no copies.
    pub snapshots_built: u64,
    /// Sessions open now.
    pub sessions: usize,
}

/// A state a [`StateProvider`] serves to newcomers in place of the averaged tensors.
#[derive(Clone, Debug, Default)]
pub struct ProvidedState {
    /// The user metadata served with it (at most [`wire::MAX_METADATA_BYTES`]).
    pub metadata: Bytes,
    /// The tensors, in order: any count (up to [`wire::MAX_TENSORS`]), shapes and dtypes.
    pub tensors: Vec<Tensor>,
}

/// The donor's source of the state it serves ([`Averager::set_state_provider`]; see the
/// module docs): hivemind's overridable `get_current_state`.
pub trait StateProvider: Send + Sync + 'static {
    /// The state to serve now. Called on a blocking thread, one call at a time, bounded by
    /// [`StateConfig::request_timeout`]; an error is logged and the newcomer refused (`Busy`).
    fn current_state(&self) -> Result<ProvidedState, String>;
}

impl<F> StateProvider for F
where
    F: Fn() -> Result<ProvidedState, String> + Send + Sync + 'static,
{
    fn current_state(&self) -> Result<ProvidedState, String> {
        self()
    }
}

/// A donor's entry in the registry ([`registry_key`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Announcement {
    /// Sharing, with this priority (finite; higher is asked first).
    Sharing {
        /// The priority.
        priority: f64,
        /// Where the donor listens (without `/p2p/<id>`), so that a newcomer that does not know
        /// it yet can dial it; at most [`MAX_ANNOUNCED_ADDRS`].
        addrs: Vec<Multiaddr>,
    },
    /// Not sharing (written once when sharing is switched off).
    NotSharing,
}

impl Announcement {
    /// The value bytes: `[1]`, the priority as little-endian f64 and the address list
    /// ([`crate::dht::encode_addrs`]: the first [`MAX_ANNOUNCED_ADDRS`] of at most
    /// [`MAX_ANNOUNCED_ADDR_BYTES`] bytes; a trailing `/p2p/<id>` is dropped); or `[0]`.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Sharing { priority, addrs } => {
                let mut v = vec![1];
                v.extend_from_slice(&priority.to_le_bytes());
                crate::dht::encode_addrs(addrs, &mut v);
                v
            }
            Self::NotSharing => vec![0],
        }
    }

    /// Parses [`Announcement::encode`]; `None` for anything else (a non-finite priority, a
    /// malformed or oversized address, too many addresses).
    pub fn decode(value: &[u8]) -> Option<Self> {
        match value {
            [0] => Some(Self::NotSharing),
            [1, rest @ ..] => {
                let (priority, rest) = rest.split_first_chunk::<8>()?;
                let priority = f64::from_le_bytes(*priority);
                if !priority.is_finite() {
                    return None;
                }
                let addrs = crate::dht::decode_addrs(rest)?;
                Some(Self::Sharing { priority, addrs })
            }
            _ => None,
        }
    }
}

/// A peer announcing that it shares its state.
#[derive(Clone, Debug, PartialEq)]
pub struct Donor {
    /// Its peer id.
    pub peer: PeerId,
    /// Its announced priority.
    pub priority: f64,
    /// Its announced addresses.
    pub addrs: Vec<Multiaddr>,
}

/// What one donor contributed to a download.
#[derive(Clone, Debug, PartialEq)]
pub struct DonorReport {
    /// The donor.
    pub peer: PeerId,
    /// Its announced priority.
    pub priority: f64,
    /// Verified chunks it served.
    pub chunks: u64,
    /// Verified bytes it served.
    pub bytes: u64,
}

/// A successful [`Averager::load_state_from_peers`].
#[derive(Clone, Debug)]
pub struct LoadedState {
    /// The best-priority donor of the set the state came from (whose description it matches).
    pub source: PeerId,
    /// Every donor of that set, in priority order, with what it served (possibly nothing).
    pub donors: Vec<DonorReport>,
    /// Size of the state in bytes.
    pub bytes: u64,
    /// The state's content hash ([`wire::content_hash`]).
    pub content_hash: [u8; wire::HASH_BYTES],
    /// The user metadata that came with the state (now also this averager's).
    pub metadata: Bytes,
    /// Donors that were asked and failed, refused or were dropped along the way.
    pub skipped: Vec<(PeerId, DonorError)>,
}

/// Why one donor was not (or no longer) used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DonorError {
    /// No stream could be opened.
    #[error("cannot open a stream: {0}")]
    Open(P2pError),
    /// The stream failed or closed early.
    #[error("i/o: {0}")]
    Io(String),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The donor refused.
    #[error("refused: {0}")]
    Refused(Refusal),
    /// A malformed, oversized or inconsistent answer.
    #[error("protocol violation: {0}")]
    Protocol(WireError),
    /// A well-formed answer of the wrong kind.
    #[error("unexpected answer: {0}")]
    Unexpected(&'static str),
    /// The donor's state has another schema (schema hash or tensor shapes and dtypes).
    #[error("the donor's state has another schema")]
    SchemaMismatch,
    /// A chunk that does not match the reference description.
    #[error("corrupt chunk {index}: {reason}")]
    CorruptChunk {
        /// The chunk.
        index: u64,
        /// What was wrong.
        reason: String,
    },
    /// The state it served holds a NaN or an infinity.
    #[error("its state holds non-finite values")]
    NonFinite,
    /// Too few other donors served its state ([`Trust::min_agreeing`]).
    #[error("{agreeing} donor(s) served its state; {required} required")]
    Unconfirmed {
        /// Donors that served its content hash (itself included).
        agreeing: usize,
        /// [`Trust::min_agreeing`].
        required: usize,
    },
}

impl DonorError {
    /// Failures of the stream rather than of the donor: worth another stream.
    fn is_transient(&self) -> bool {
        matches!(self, Self::Open(_) | Self::Io(_) | Self::Timeout(_))
    }

    /// Failures that say nothing about whether the donor has a usable state.
    fn is_unavailable(&self) -> bool {
        self.is_transient() || matches!(self, Self::Refused(_))
    }
}

fn summary(failures: &[(PeerId, DonorError)]) -> String {
    if failures.is_empty() {
        return "no donor".to_owned();
    }
    failures
        .iter()
        .map(|(p, e)| format!("{p}: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Errors of state sharing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// Only [`Mode::Node`] averagers can share their state.
    #[error("a {0} averager cannot share its state")]
    NotADonor(Mode),
    /// A priority must be finite.
    #[error("priority {0} is not finite")]
    InvalidPriority(f64),
    /// The metadata is over [`wire::MAX_METADATA_BYTES`].
    #[error("metadata of {len} bytes exceeds the limit of {max}")]
    MetadataTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Reading the registry or announcing failed.
    #[error(transparent)]
    Dht(Box<DhtError>),
    /// Every donor that described its state has another schema.
    #[error("every donor that answered has another schema: {peers:?}")]
    SchemaMismatch {
        /// Those donors.
        peers: Vec<PeerId>,
    },
    /// Donors answered, but none with a usable description.
    #[error("no usable donor: {}", summary(.failures))]
    NoUsableDonor {
        /// Every donor asked, with its failure.
        failures: Vec<(PeerId, DonorError)>,
    },
    /// A download was attempted and no set of donors completed it; nothing was installed.
    #[error("state download failed: {}", summary(.failures))]
    DownloadFailed {
        /// Every donor that failed, with its failure.
        failures: Vec<(PeerId, DonorError)>,
    },
    /// The averager holds device tensors ([`crate::averager::AveragedTensor`]): it neither
    /// serves nor installs a state (fetching one without installing it works).
    #[error("an averager with device tensors neither shares nor installs state")]
    DeviceTensors,
    /// The local tensors no longer have the averager's schema (replaced through
    /// [`Averager::tensors`]); nothing was installed.
    #[error("the local tensors no longer have the averager's schema")]
    LocalSchemaChanged,
    /// A shared tensor's memory was freed or moved by its owner
    /// ([`crate::tensor::MovableMemory`]); nothing was installed.
    #[error(transparent)]
    LocalMemoryChanged(crate::tensor::TensorError),
    /// The download did not finish within [`StateConfig::load_timeout`]; nothing was installed.
    #[error("state download did not finish within {0:?}")]
    Timeout(Duration),
}

impl From<DhtError> for StateError {
    fn from(e: DhtError) -> Self {
        Self::Dht(Box::new(e))
    }
}

/// What the last announcement said, so that writes stay ordered.
#[derive(Default)]
struct Announced {
    last_expiration: Option<DhtTime>,
    sharing: bool,
}

/// A snapshot being served: the concatenated data and its description (session left empty).
struct Snapshot {
    data: Bytes,
    meta: Metadata,
}

/// Everything both sides share; owned by the averager's [`StateSharing`] and its tasks.
struct Inner {
    dht: Dht,
    shared: Arc<Shared>,
    config: StateConfig,
    mode: Mode,
    key: Vec<u8>,
    protocol: String,
    schema_hash: Bytes,
    allow: AtomicBool,
    priority: AtomicU64,
    metadata: Mutex<Bytes>,
    announced: Mutex<Announced>,
    sessions: Mutex<Sessions>,
    /// Held while a snapshot is built: one at a time.
    building: tokio::sync::Mutex<()>,
    /// The last snapshot built and the tensors' version it was taken at: served again while
    /// neither the tensors nor the metadata changed, so metadata requests cost no copy.
    last_snapshot: Mutex<Option<CachedSnapshot>>,
    /// Snapshots built since the start ([`StateStats::snapshots_built`]).
    snapshots_built: AtomicU64,
    /// Where the served state comes from instead of the tensors ([`StateProvider`]).
    provider: Mutex<Option<Arc<dyn StateProvider>>>,
    /// A provider call is running (on a blocking thread): no second one starts.
    providing: AtomicBool,
}

/// The shortest time a snapshot of tensors that include external memory (or of a provided
/// state) is served again: such memory changes without the averager knowing, so the reuse is
/// bounded in time ([`CachedSnapshot::reuse_window`]).
const EXTERNAL_SNAPSHOT_REUSE: Duration = Duration::from_secs(1);

/// A snapshot of external memory or a provided state is served again for at least this many
/// times what building it took, so however often peers ask, building snapshots takes at most
/// about 1/this of the donor's time (5%).
const SNAPSHOT_COST_FACTOR: u32 = 20;

/// The donor's last snapshot ([`Inner::current_snapshot`]).
struct CachedSnapshot {
    version: u64,
    /// Some tensor is external memory, or the state came from a provider: reused only for
    /// its [reuse window](Self::reuse_window).
    external: bool,
    /// Built from a [`StateProvider`]'s state (its metadata is the provider's).
    provided: bool,
    built: Instant,
    /// What building it took (copy, provider call and hashes).
    cost: Duration,
    snapshot: Arc<Snapshot>,
}

impl CachedSnapshot {
    /// How long an external or provided snapshot is served again:
    /// [`EXTERNAL_SNAPSHOT_REUSE`], or [`SNAPSHOT_COST_FACTOR`] times its cost if longer.
    fn reuse_window(&self) -> Duration {
        self.cost
            .saturating_mul(SNAPSHOT_COST_FACTOR)
            .max(EXTERNAL_SNAPSHOT_REUSE)
    }

    /// Whether it still serves at `now`, the tensors being at `version`, a provider set or not
    /// (`provided`) and the metadata `metadata`: the tensors' version has not moved, the
    /// metadata is the same (a provided state's is the provider's) and, where it is external
    /// or provided, it is within its [reuse window](Self::reuse_window).
    fn serves(&self, now: Instant, version: u64, provided: bool, metadata: &Bytes) -> bool {
        self.provided == provided
            && self.version == version
            && (!self.external || now.saturating_duration_since(self.built) < self.reuse_window())
            && (provided || self.snapshot.meta.metadata == *metadata)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The averager's state-sharing part: the donor server and the announcer (started with the
/// averager, stopped at its shutdown) and the newcomer's download.
pub(super) struct StateSharing {
    inner: Arc<Inner>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl StateSharing {
    /// Starts serving `/hivemesh/state/1/<prefix>` and announcing (if sharing).
    pub(super) fn start(
        dht: Dht,
        shared: Arc<Shared>,
        config: &AveragerConfig,
        schema_hash: Bytes,
    ) -> Result<Self, AveragerError> {
        if !config.state_priority.is_finite() {
            return Err(AveragerError::Config(
                StateError::InvalidPriority(config.state_priority).to_string(),
            ));
        }
        let protocol = protocol(&config.prefix);
        let inbound = dht
            .p2p()
            .accept_streams(&protocol, 64)
            .map_err(|e| AveragerError::Config(e.to_string()))?;
        let mode = config.resolved_mode(dht.p2p().reachability().class());
        let inner = Arc::new(Inner {
            dht,
            shared,
            config: config.state.clone(),
            mode,
            key: registry_key(&config.prefix),
            protocol,
            schema_hash,
            allow: AtomicBool::new(config.allow_state_sharing && mode == Mode::Node),
            priority: AtomicU64::new(config.state_priority.to_bits()),
            metadata: Mutex::new(Bytes::new()),
            announced: Mutex::new(Announced::default()),
            sessions: Mutex::new(Sessions::new(sessions::Limits {
                max: config.state.max_sessions.max(1),
                idle: config.state.session_idle_timeout,
                // Kept where an `Instant` can add it.
                grace: config.state.session_grace.min(Duration::from_secs(1 << 30)),
                min_rate: config.state.min_session_rate.max(1),
            })),
            building: tokio::sync::Mutex::new(()),
            last_snapshot: Mutex::new(None),
            snapshots_built: AtomicU64::new(0),
            provider: Mutex::new(None),
            providing: AtomicBool::new(false),
        });
        let (stop, stop_rx) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(serve(inner.clone(), inbound)),
            tokio::spawn(announce_loop(inner.clone(), stop_rx)),
        ];
        Ok(Self { inner, stop, tasks })
    }

    /// Stops serving and announcing, and withdraws the announcement (bounded by the request
    /// timeout).
    pub(super) async fn shutdown(&mut self) {
        let _ = self.stop.send(true);
        for task in self.tasks.drain(..) {
            task.abort();
            let _ = task.await;
        }
        self.inner.allow.store(false, Ordering::SeqCst);
        lock(&self.inner.sessions).clear();
        let timeout = self.inner.config.request_timeout;
        if let Ok(Err(e)) = tokio::time::timeout(timeout, self.inner.announce()).await {
            tracing::debug!(error = %e, "state sharing not withdrawn");
        }
    }
}

impl Drop for StateSharing {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Averager {
    /// Downloads the state (tensors and metadata) from the donors of this averager's prefix and
    /// installs it (see [`crate::averager::state`]). `Ok(Some(_))` says where it came from,
    /// `Ok(None)` that no donor was available; on any error the local state is unchanged.
    ///
    /// Deltas of a round that finishes while the download runs are added to whatever the
    /// tensors hold then, so load state between steps.
    pub async fn load_state_from_peers(&self) -> Result<Option<LoadedState>, StateError> {
        if !self.shared.devices.is_empty() {
            return Err(StateError::DeviceTensors);
        }
        let inner = &self.state.inner;
        let limit = inner.config.load_timeout;
        let loaded = tokio::time::timeout(limit, inner.load(true))
            .await
            .map_err(|_| StateError::Timeout(limit))??;
        Ok(loaded.map(|l| l.state))
    }

    /// Like [`Averager::load_state_from_peers`], but installs nothing: returns the verified
    /// state's tensors (owned, in the local schema) beside where they came from, and leaves
    /// the local tensors and metadata as they are (hivemind's `load_state_from_peers`, which
    /// hands the state to the caller).
    pub async fn download_state_from_peers(
        &self,
    ) -> Result<Option<(LoadedState, Vec<Tensor>)>, StateError> {
        let inner = &self.state.inner;
        let limit = inner.config.load_timeout;
        let loaded = tokio::time::timeout(limit, inner.load(false))
            .await
            .map_err(|_| StateError::Timeout(limit))??;
        Ok(loaded.and_then(|l| Some((l.state, l.tensors?))))
    }

    /// Switches serving the state on or off and returns once the announcement (or its
    /// withdrawal) is stored in the DHT. Switching off drops every session at once. Only
    /// [`Mode::Node`] averagers can switch it on ([`StateError::NotADonor`]). The switch
    /// holds even if the DHT write fails (the error says so; the announcer retries).
    pub async fn set_allow_state_sharing(&self, allow: bool) -> Result<(), StateError> {
        let inner = &self.state.inner;
        if allow && inner.mode != Mode::Node {
            return Err(StateError::NotADonor(inner.mode));
        }
        if allow && !self.shared.devices.is_empty() {
            return Err(StateError::DeviceTensors);
        }
        inner.allow.store(allow, Ordering::SeqCst);
        if !allow {
            lock(&inner.sessions).clear();
        }
        inner.announce().await
    }

    /// Whether this averager serves its state.
    pub fn allow_state_sharing(&self) -> bool {
        self.state.inner.sharing()
    }

    /// Sets the priority newcomers see (higher is asked first) and returns once it is
    /// announced (if sharing).
    pub async fn set_state_priority(&self, priority: f64) -> Result<(), StateError> {
        if !priority.is_finite() {
            return Err(StateError::InvalidPriority(priority));
        }
        let inner = &self.state.inner;
        inner.priority.store(priority.to_bits(), Ordering::SeqCst);
        inner.announce().await
    }

    /// The announced priority.
    pub fn state_priority(&self) -> f64 {
        self.state.inner.priority()
    }

    /// Sets the opaque metadata served with the tensors (hivemind's `metadata` of
    /// `get_current_state`: an epoch, optimizer settings, ...). At most
    /// [`wire::MAX_METADATA_BYTES`].
    pub fn set_state_metadata(&self, metadata: Bytes) -> Result<(), StateError> {
        if metadata.len() > wire::MAX_METADATA_BYTES {
            return Err(StateError::MetadataTooLarge {
                len: metadata.len(),
                max: wire::MAX_METADATA_BYTES,
            });
        }
        *lock(&self.state.inner.metadata) = metadata;
        Ok(())
    }

    /// Serves what `provider` returns to newcomers instead of the averaged tensors and the
    /// metadata (see the [module docs](self)); `None` goes back to those. The next newcomer
    /// gets a fresh snapshot either way.
    pub fn set_state_provider(&self, provider: Option<Arc<dyn StateProvider>>) {
        let inner = &self.state.inner;
        *lock(&inner.provider) = provider;
        *lock(&inner.last_snapshot) = None;
    }

    /// The metadata served with the tensors (replaced by a successful download).
    pub fn state_metadata(&self) -> Bytes {
        lock(&self.state.inner.metadata).clone()
    }

    /// What the donor side has done so far.
    pub fn state_stats(&self) -> StateStats {
        let inner = &self.state.inner;
        StateStats {
            snapshots_built: inner.snapshots_built.load(Ordering::SeqCst),
            sessions: lock(&inner.sessions).len(),
        }
    }

    /// The donors currently announced for this prefix, best first, without this averager:
    /// the candidates [`Averager::load_state_from_peers`] would ask.
    pub async fn state_donors(&self) -> Result<Vec<Donor>, StateError> {
        self.state.inner.donors().await
    }
}

impl Inner {
    /// The last snapshot, if the tensors and the metadata are still what it holds
    /// ([`CachedSnapshot::serves`]: where some tensor is external memory, which its owner,
    /// e.g. PyTorch, writes without telling us, or the state is provided, within its reuse
    /// window).
    fn current_snapshot(&self, now: Instant) -> Option<Arc<Snapshot>> {
        let provided = lock(&self.provider).is_some();
        let metadata = lock(&self.metadata).clone();
        let last = lock(&self.last_snapshot);
        let cached = last.as_ref()?;
        let version = self.shared.version.load(Ordering::SeqCst);
        cached
            .serves(now, version, provided, &metadata)
            .then(|| cached.snapshot.clone())
    }

    fn sharing(&self) -> bool {
        self.allow.load(Ordering::SeqCst) && self.mode == Mode::Node
    }

    fn priority(&self) -> f64 {
        f64::from_bits(self.priority.load(Ordering::SeqCst))
    }

    /// Writes the current announcement: "sharing at priority p" while sharing, "not sharing"
    /// once after sharing stops, nothing otherwise. Expirations only grow, and the value is
    /// read together with its expiration, so the latest write always says the latest state.
    async fn announce(&self) -> Result<(), StateError> {
        let addrs = if self.sharing() {
            super::contact_addrs(self.dht.p2p()).await
        } else {
            Vec::new()
        };
        let (value, expiration) = {
            let mut a = lock(&self.announced);
            let sharing = self.sharing();
            if !sharing && !a.sharing {
                return Ok(());
            }
            let mut expiration = DhtTime::now().saturating_add(self.config.declare_period);
            if let Some(last) = a.last_expiration
                && expiration <= last
            {
                expiration = last.next_up();
            }
            a.last_expiration = Some(expiration);
            a.sharing = sharing;
            let value = if sharing {
                Announcement::Sharing {
                    priority: self.priority(),
                    addrs,
                }
            } else {
                Announcement::NotSharing
            };
            (value.encode(), expiration)
        };
        self.dht
            .store_unconfirmed(&self.key, Some(&self.dht.own_subkey()), &value, expiration)
            .await?;
        Ok(())
    }

    async fn donors(&self) -> Result<Vec<Donor>, StateError> {
        let me = self.dht.p2p().peer_id();
        let value = self.dht.get(&self.key).await?;
        let mut donors: Vec<Donor> = value
            .iter()
            .flat_map(|v| v.owner_entries())
            .filter(|(peer, _)| *peer != me && self.config.trust.allows(peer))
            .filter_map(|(peer, entry)| match Announcement::decode(&entry.value)? {
                Announcement::Sharing { priority, addrs } => Some(Donor {
                    peer,
                    priority,
                    addrs,
                }),
                Announcement::NotSharing => None,
            })
            .collect();
        donors.sort_by(|a, b| {
            b.priority
                .total_cmp(&a.priority)
                .then_with(|| a.peer.to_bytes().cmp(&b.peer.to_bytes()))
        });
        Ok(donors)
    }

    fn expire_sessions(&self) {
        lock(&self.sessions).expire(Instant::now());
    }
}

async fn announce_loop(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    let tick = (inner.config.declare_period / 2).max(Duration::from_millis(100));
    loop {
        if let Err(e) = inner.announce().await {
            tracing::debug!(error = %e, "state announcement not stored");
        }
        inner.expire_sessions();
        tokio::select! {
            () = tokio::time::sleep(tick) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

/// Copies of one chunk fetched at once in the end game.
const END_GAME_COPIES: usize = 2;

/// The end game's pick for an idle stream of `donor`: the chunk in flight longest that `donor`
/// is not fetching and fewer than [`END_GAME_COPIES`] streams are.
fn end_game_pick(fetching: &HashMap<u64, (Vec<usize>, Instant)>, donor: usize) -> Option<u64> {
    fetching
        .iter()
        .filter(|(_, (donors, _))| donors.len() < END_GAME_COPIES && !donors.contains(&donor))
        .min_by_key(|(index, (_, since))| (*since, **index))
        .map(|(index, _)| *index)
}

#[cfg(test)]
mod tests {
    use super::download::copy_into;
    use super::*;
    use crate::tensor::DType;
    use libp2p::multiaddr::Protocol;

    #[test]
    fn announcements_round_trip_and_reject_junk() {
        let tcp: Multiaddr = "/ip4/10.0.0.1/tcp/4001".parse().unwrap();
        let quic: Multiaddr = "/ip6/::1/udp/9/quic-v1".parse().unwrap();
        for a in [
            Announcement::Sharing {
                priority: 5.0,
                addrs: vec![tcp.clone(), quic.clone()],
            },
            Announcement::Sharing {
                priority: -0.5,
                addrs: vec![],
            },
            Announcement::NotSharing,
        ] {
            assert_eq!(Announcement::decode(&a.encode()), Some(a));
        }
        // `/p2p/<id>` is dropped, and only the first addresses are kept.
        let id = PeerId::random();
        let with_id = Announcement::Sharing {
            priority: 1.0,
            addrs: vec![tcp.clone().with(Protocol::P2p(id)); 9],
        };
        assert_eq!(
            Announcement::decode(&with_id.encode()),
            Some(Announcement::Sharing {
                priority: 1.0,
                addrs: vec![tcp.clone(); MAX_ANNOUNCED_ADDRS],
            })
        );
        let nan = Announcement::Sharing {
            priority: f64::NAN,
            addrs: vec![],
        }
        .encode();
        assert_eq!(Announcement::decode(&nan), None);
        let mut bad_addr = Announcement::Sharing {
            priority: 1.0,
            addrs: vec![],
        }
        .encode();
        bad_addr.extend_from_slice(&[3, 0xff, 0xff, 0xff]);
        let mut cut = Announcement::Sharing {
            priority: 1.0,
            addrs: vec![tcp],
        }
        .encode();
        cut.pop();
        for junk in [&[][..], &[2], &[1, 0, 0], &[0, 0], &bad_addr, &cut] {
            assert_eq!(Announcement::decode(junk), None, "{junk:?}");
        }
        assert_eq!(registry_key("run"), b"\xffowned:run.all_averagers");
        assert_eq!(protocol("run"), "/hivemesh/state/1/run");
    }

    fn cached(external: bool, cost: Duration, built: Instant) -> CachedSnapshot {
        CachedSnapshot {
            version: 7,
            external,
            provided: false,
            built,
            cost,
            snapshot: Arc::new(Snapshot {
                data: Bytes::new(),
                meta: Metadata {
                    session: Bytes::new(),
                    schema_hash: Bytes::new(),
                    tensors: Vec::new(),
                    total_bytes: 0,
                    chunk_bytes: wire::MIN_CHUNK_BYTES,
                    chunk_hashes: Bytes::new(),
                    content_hash: [0; wire::HASH_BYTES],
                    metadata: Bytes::from_static(b"epoch 1"),
                },
            }),
        }
    }

    /// The donor's snapshots in virtual time: how many a peer asking for metadata every
    /// 1.5 s for ten minutes makes the donor build (copy under the tensor lock, then hash).
    /// Tensors of external memory and a snapshot that took 2 s to build (a large state): the
    /// reuse window grows with the cost, so building takes at most 1/`SNAPSHOT_COST_FACTOR` of
    /// the time (with a window of one second, as before, it rebuilt each time it was
    /// asked once the last build had finished: 201 builds).
    /// A cheap snapshot is still refreshed after a second, and tensors that are not external
    /// are rebuilt only when their version or the metadata moves.
    #[test]
    fn repeated_metadata_requests_rebuild_a_costly_snapshot_rarely() {
        let start = Instant::now();
        let metadata = Bytes::from_static(b"epoch 1");
        let builds_over_ten_minutes = |external: bool, cost: Duration| {
            let mut last = cached(external, cost, start);
            let mut builds = 1u32;
            let mut now = start;
            for _ in 0..400 {
                now += Duration::from_millis(1500);
                if !last.serves(now, 7, false, &metadata) {
                    builds += 1;
                    last = cached(external, cost, now + cost);
                }
            }
            builds
        };
        let costly = Duration::from_secs(2);
        let builds = builds_over_ten_minutes(true, costly);
        assert!(
            costly * builds <= Duration::from_secs(600) / SNAPSHOT_COST_FACTOR + costly,
            "{builds} builds of {costly:?} in 10 minutes"
        );
        assert!(builds >= 2, "a changing external state is still refreshed");
        let cheap = Duration::from_millis(1);
        assert_eq!(builds_over_ten_minutes(true, cheap), 401);
        assert_eq!(builds_over_ten_minutes(false, costly), 1);

        let last = cached(false, costly, start);
        let later = start + Duration::from_secs(3600);
        assert!(last.serves(later, 7, false, &metadata));
        assert!(
            !last.serves(start, 8, false, &metadata),
            "the tensors changed"
        );
        assert!(
            !last.serves(start, 7, false, &Bytes::new()),
            "the metadata changed"
        );
        assert!(
            !last.serves(start, 7, true, &metadata),
            "a provider was set"
        );
    }

    /// What a donor concatenates (each tensor's raw bytes) is what a newcomer copies back.
    #[test]
    fn raw_bytes_round_trip_every_dtype() {
        let source = [
            Tensor::from_f32_as(&[2, 3], &[1.0, -2.0, 3.5, 0.25, 8.0, -0.0], DType::F32).unwrap(),
            Tensor::from_f32_as(&[3], &[1.5, -2.0, 65504.0], DType::F16).unwrap(),
            Tensor::from_f32_as(&[], &[-3.0], DType::BF16).unwrap(),
            Tensor::zeros(&[0, 4], DType::F32),
        ];
        let data: Vec<u8> = source
            .iter()
            .flat_map(|t| t.flat().as_bytes().to_vec())
            .collect();
        assert_eq!(data.len(), 6 * 4 + 3 * 2 + 2);
        let mut target: Vec<Tensor> = source
            .iter()
            .map(|t| Tensor::zeros(t.shape(), t.dtype()))
            .collect();
        let mut offset = 0;
        for t in &mut target {
            let n = t.size_bytes();
            copy_into(t, &data[offset..offset + n]);
            offset += n;
        }
        assert_eq!(target, source);
    }
}
