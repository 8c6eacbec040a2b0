//! Matchmaking, sans-IO: how peers that want to average find each other and agree on a group.
//!
//! # The protocol
//!
//! Peers that look for a group together share a **group key** ([`GroupKey`],
//! `"{prefix}.0b{bits}"`). Keys come from a [`KeyManager`] (hivemind's scheme: fixed-length
//! bits, rotated after every group by a draw seeded with the group id, so members of one group
//! move to different buckets) or from a Moshpit [`Grid`] (round `t` groups the peers along
//! dimension `t mod dims`; after `dims` failure-free rounds every peer holds the exact global
//! mean).
//!
//! One [`Matchmaker`] runs per peer per step:
//!
//! 1. **Declare.** A node or aux peer stores itself in the DHT under the group key, subkey = its
//!    own id ([`declaration_subkey`]), value "looking", with an expiration
//!    `min(max(scheduled_time, now + min_matchmaking_time), deadline)`. The expiration is also
//!    its **leadership priority**: earlier = better, ties broken by the smaller peer id. When
//!    the declaration expires the peer re-declares with a new expiration; when it stops looking
//!    it *leaves* by rewriting the subkey as "left" with the expiration nudged up
//!    ([`DhtTime::next_up`]), which supersedes the declaration everywhere. Client peers never
//!    declare: they cannot accept connections, so they only follow.
//! 2. **Find leaders.** The peer reads the key (on demand, at most every
//!    `dht_refresh_interval`; a client whose read found no one to ask reads again sooner, from
//!    an eighth of the interval, as nobody can find it) and keeps the declared peers as
//!    candidates. It asks the best
//!    candidate that is strictly better than itself, `(expiration, peer id)` lexicographically
//!    (a client's own priority is infinitely bad), never the same `(peer, expiration)` twice.
//! 3. **Join.** The follower sends a [`JoinRequest`] (schema hash, its expiration, its key, its
//!    [`MemberInfo`]: mode, bandwidth, data-plane addresses, gathered bytes). The leader checks,
//!    in hivemind's order: it is still looking ([`RejectReason::NotLookingForGroup`]), it is not
//!    a client and the request is well-formed ([`RejectReason::ProtocolViolation`]), schema hash
//!    ([`RejectReason::BadSchemaHash`]), key ([`RejectReason::BadGroupKey`]), it has declared
//!    ([`RejectReason::NotDeclared`]), it is strictly better than the follower
//!    ([`RejectReason::BadExpirationTime`]), it is not itself accepted by someone
//!    ([`RejectReason::NotALeader`], naming that leader), the follower is not itself or already
//!    a follower ([`RejectReason::DuplicatePeerId`]), the group has room
//!    ([`RejectReason::GroupIsFull`]). Then it answers [`ReplyBody::Accepted`].
//! 4. **Assemble.** The leader closes the group as soon as it reaches `target_group_size`, or
//!    when its declaration expires (at the latest at the deadline) with at least
//!    `min_group_size` members, one of which contributes values (not every member aux). It draws
//!    a random 20-byte group id, shuffles the members, and sends every follower
//!    [`ReplyBody::Begin`] with the ordered members. Too few at expiration: it sends
//!    [`ReplyBody::Disbanded`] to its followers and re-declares. A follower that is accepted
//!    stops searching and re-declaring and waits for `Begin` until its own expiration plus
//!    `request_timeout`; a leader that is accepted by a better leader disbands its own followers,
//!    pointing them to that leader (they ask it directly).
//! 5. **Done.** Every member emits [`Event::Assembled`] with the same [`Group`] (id, ordered
//!    members with their info, its own index); every peer writes its leave record. A peer that
//!    finds no group by its deadline emits [`Event::Failed`] with
//!    [`MatchmakingError::NoGroup`]. The shell then rotates its key
//!    ([`KeyManager::update_on_group_assembled`]), computes the peers' fractions
//!    ([`load_balancing`]) and runs the all-reduce.
//!
//! # No lock, no deadlock
//!
//! hivemind serialises a peer's own join request and the requests it serves with one lock, so
//! two peers asking each other at once (possible when one read a stale declaration) deadlock
//! until `request_timeout` (documented there, not solved). Here a peer with a join request of
//! its own outstanding answers every request it can decide independently of that request's
//! outcome at once (all checks above but `NotALeader`) and *defers* the rest until its own
//! request is answered. A request is deferred only after it passed the priority check, so along
//! a chain of deferrals priorities strictly improve; and a peer never re-declares while its own
//! request is outstanding, so those priorities are fixed while the chain exists. A cycle would
//! need a peer strictly better than itself: waits are acyclic and every one ends within
//! `request_timeout`.
//!
//! # Driving it
//!
//! [`Matchmaker`] never reads a clock or touches the network. Inputs: [`Matchmaker::new`],
//! [`Matchmaker::handle_message`], [`Matchmaker::handle_dht_get`],
//! [`Matchmaker::handle_unreachable`], [`Matchmaker::handle_timeout`], [`Matchmaker::cancel`],
//! each with `now` (wall clock as [`DhtTime`], since expirations are compared across peers).
//! Outputs: [`Matchmaker::poll_transmit`] (messages to peers), [`Matchmaker::poll_dht`] (DHT
//! stores and reads), [`Matchmaker::poll_event`] (assembled / failed) and
//! [`Matchmaker::poll_timeout`]. [`sim`] drives many of them in virtual time; [`wire`] is the
//! prost encoding of [`Message`].

mod declaration;
mod key;
pub mod load_balancing;
mod machine;
pub mod rate_shares;
pub mod sim;
#[cfg(test)]
mod tests;
pub mod wire;

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::reach::Reach;

pub use crate::allreduce::Mode;
pub use crate::dht::DhtTime;
pub use declaration::{
    DECLARED_VALUE, LEFT_VALUE, MAX_CONTACT_BYTES, active_declarations, declaration_contact,
    declaration_subkey, declaration_value, is_declared, subkey_owner,
};
pub use key::{
    Grid, GroupKey, KeyError, KeyManager, MAX_GROUP_BITS, MAX_GROUP_KEY_BYTES, MAX_PREFIX_BYTES,
    next_bits,
};
pub use machine::Matchmaker;

/// Default `min_matchmaking_time` (hivemind's).
pub const DEFAULT_MIN_MATCHMAKING_TIME: Duration = Duration::from_secs(5);
/// Default `request_timeout` (hivemind's).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Default `dht_refresh_interval`.
pub const DEFAULT_DHT_REFRESH_INTERVAL: Duration = Duration::from_secs(1);
/// Default `min_group_size` (hivemind's).
pub const DEFAULT_MIN_GROUP_SIZE: usize = 2;
/// Length of the random group id (hivemind's 20 bytes).
pub const GROUP_ID_BYTES: usize = 20;

/// Longest accepted peer id, in bytes (libp2p ids are 38 bytes or less).
pub const MAX_PEER_ID_BYTES: usize = 128;
/// Longest accepted schema hash, in bytes (hivemind's is 20).
pub const MAX_SCHEMA_HASH_BYTES: usize = 64;
/// Most gathered bytes a member may bring.
pub const MAX_GATHERED_BYTES: usize = 8 << 10;
/// Most data-plane addresses a member may advertise.
pub const MAX_ADDRS: usize = 16;
/// Longest accepted data-plane address, in bytes.
pub const MAX_ADDR_BYTES: usize = 256;
/// Largest group; also the most members a `Begin` may list. At the limits above a `Begin`
/// stays under 2.7 MiB, below [`wire::MAX_MESSAGE_BYTES`].
pub const MAX_GROUP_SIZE: usize = 256;

/// A peer's identity as matchmaking sees it: opaque bytes (a libp2p `PeerId`'s
/// `to_bytes()`), 1 to [`MAX_PEER_ID_BYTES`] long, ordered bytewise (hivemind's tie-break).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(Bytes);

impl PeerId {
    /// The id for `bytes`, or `None` if empty or longer than [`MAX_PEER_ID_BYTES`].
    pub fn from_bytes(bytes: impl Into<Bytes>) -> Option<Self> {
        let bytes = bytes.into();
        (!bytes.is_empty() && bytes.len() <= MAX_PEER_ID_BYTES).then_some(Self(bytes))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The id's bytes, shared.
    pub fn to_bytes(&self) -> Bytes {
        self.0.clone()
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({self})")
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Short hex of the last bytes (libp2p ids share their multihash prefix).
        let tail = &self.0[self.0.len().saturating_sub(6)..];
        for b in tail {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// What a member brings to a group; every member receives every member's info.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberInfo {
    /// Its all-reduce mode (clients never lead and reduce nothing).
    pub mode: Mode,
    /// Advertised bandwidth for load balancing (finite, `>= 0`; `None`: the average of the
    /// others' specified bandwidths; `0`: reduce nothing if others can).
    pub bandwidth: Option<f64>,
    /// Data-plane addresses the all-reduce connects to (opaque strings, e.g. multiaddrs).
    pub addrs: Vec<String>,
    /// Opaque user bytes (hivemind's `gather`).
    pub gathered: Bytes,
    /// How others reach it ([`crate::reach`]): decides whether it may reduce and who opens
    /// its links.
    pub reach: Reach,
    /// It allows its tensor data to go through relays.
    pub relay_data: bool,
    /// Peers it could not link to recently (a failed hole punch), at most
    /// [`crate::reach::MAX_UNLINKABLE`]: a group plans no traffic between it and those of them
    /// it contains ([`crate::reach::honoured_cuts`] says which claims count).
    pub unlinkable: Vec<PeerId>,
    /// Its upload and download rates measured in past rounds (bytes per second, finite and
    /// positive where known; `None`: nothing measured, or an older peer).
    pub measured: Option<crate::allreduce::LinkRates>,
    /// It understands stand-ins for failed reducers ([`crate::allreduce::RoundConfig::stand_ins`]);
    /// `false` for an older peer. A group uses them only if every member does. This version
    /// declares `true` ([`MemberInfo::new`]).
    pub stand_ins: bool,
}

impl MemberInfo {
    /// A public member of `mode` with no bandwidth, addresses or gathered bytes.
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            bandwidth: None,
            addrs: Vec::new(),
            gathered: Bytes::new(),
            reach: Reach::Public,
            relay_data: false,
            unlinkable: Vec::new(),
            measured: None,
            stand_ins: true,
        }
    }

    /// The member as [`crate::reach`]'s planner sees it.
    pub fn plan_peer(&self) -> crate::reach::Peer {
        crate::reach::Peer {
            reach: self.reach,
            relay_data: self.relay_data,
        }
    }

    /// Checks the limits a receiver enforces ([`MAX_GATHERED_BYTES`], [`MAX_ADDRS`],
    /// [`crate::reach::MAX_UNLINKABLE`],
    /// [`MAX_ADDR_BYTES`], a finite non-negative bandwidth).
    pub fn validate(&self) -> Result<(), InfoError> {
        if let Some(b) = self.bandwidth
            && !(b.is_finite() && b >= 0.0)
        {
            return Err(InfoError::Bandwidth(b));
        }
        if let Some(r) = self.measured
            && let Some(b) = [r.up, r.down]
                .into_iter()
                .find(|b| !(b.is_finite() && *b > 0.0))
        {
            return Err(InfoError::Bandwidth(b));
        }
        if self.addrs.len() > MAX_ADDRS {
            return Err(InfoError::TooManyAddrs(self.addrs.len()));
        }
        if let Some(a) = self.addrs.iter().find(|a| a.len() > MAX_ADDR_BYTES) {
            return Err(InfoError::AddrTooLong(a.len()));
        }
        if self.gathered.len() > MAX_GATHERED_BYTES {
            return Err(InfoError::GatheredTooLarge(self.gathered.len()));
        }
        if self.unlinkable.len() > crate::reach::MAX_UNLINKABLE {
            return Err(InfoError::TooManyUnlinkable(self.unlinkable.len()));
        }
        Ok(())
    }
}

/// A [`MemberInfo`] outside the limits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum InfoError {
    /// Bandwidth negative, NaN or infinite.
    #[error("bandwidth {0} is not a finite non-negative number")]
    Bandwidth(f64),
    /// More than [`MAX_ADDRS`] addresses.
    #[error("{0} addresses (at most {MAX_ADDRS})")]
    TooManyAddrs(usize),
    /// An address longer than [`MAX_ADDR_BYTES`].
    #[error("address of {0} bytes (at most {MAX_ADDR_BYTES})")]
    AddrTooLong(usize),
    /// More than [`MAX_GATHERED_BYTES`] gathered bytes.
    #[error("{0} gathered bytes (at most {MAX_GATHERED_BYTES})")]
    GatheredTooLarge(usize),
    /// More than [`crate::reach::MAX_UNLINKABLE`] peers it cannot link to.
    #[error("{0} unlinkable peers (at most {max})", max = crate::reach::MAX_UNLINKABLE)]
    TooManyUnlinkable(usize),
}

/// One member of an assembled group.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupMember {
    /// Its id.
    pub peer: PeerId,
    /// What it brought.
    pub info: MemberInfo,
}

/// An assembled group, identical on every member except `me`.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    /// Random id of the group (the all-reduce round id).
    pub group_id: Bytes,
    /// The members in the agreed order (= the all-reduce's reducer order).
    pub members: Vec<GroupMember>,
    /// This peer's index in `members`.
    pub me: usize,
    /// The leader that assembled it.
    pub leader: PeerId,
    /// The key it was assembled under.
    pub key: GroupKey,
}

impl Group {
    /// The members' ids, in order.
    pub fn peer_ids(&self) -> impl Iterator<Item = &PeerId> {
        self.members.iter().map(|m| &m.peer)
    }
}

/// Follower -> leader: "take me into your group".
#[derive(Clone, Debug, PartialEq)]
pub struct JoinRequest {
    /// Random id of this join exchange, echoed in every reply.
    pub request_id: u64,
    /// Hash of the follower's tensor schema.
    pub schema_hash: Bytes,
    /// The follower's declared expiration (for a client, the one it would declare).
    pub expiration: DhtTime,
    /// The key the follower looks under.
    pub group_key: GroupKey,
    /// The follower's info.
    pub info: MemberInfo,
}

/// Why a leader refuses a join request (hivemind's `MessageCode`s).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RejectReason {
    /// The leader is not looking for a group (any more).
    #[error("not looking for a group")]
    NotLookingForGroup,
    /// Malformed request (empty schema hash), or the leader is a client.
    #[error("protocol violation")]
    ProtocolViolation,
    /// The schema hashes differ.
    #[error("bad schema hash")]
    BadSchemaHash,
    /// The keys differ.
    #[error("bad group key")]
    BadGroupKey,
    /// The leader has not declared itself yet.
    #[error("leader has not declared")]
    NotDeclared,
    /// The leader's priority is not strictly better than the follower's.
    #[error("bad expiration time")]
    BadExpirationTime,
    /// The leader follows someone else.
    #[error("not a leader (suggested: {suggested_leader:?})")]
    NotALeader {
        /// The leader it follows, if it says.
        suggested_leader: Option<PeerId>,
    },
    /// The follower is the leader itself or already its follower.
    #[error("duplicate peer id")]
    DuplicatePeerId,
    /// The group is full.
    #[error("group is full")]
    GroupIsFull,
    /// The leader failed internally.
    #[error("internal error")]
    Internal,
}

/// The members and id of an assembled group, as the leader sends them.
#[derive(Clone, Debug, PartialEq)]
pub struct Begin {
    /// Random group id.
    pub group_id: Bytes,
    /// The members in the agreed order.
    pub members: Vec<GroupMember>,
}

/// What a leader tells a follower.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplyBody {
    /// The follower is in; wait for `Begin` or `Disbanded`.
    Accepted,
    /// The group is assembled.
    Begin(Begin),
    /// The request is refused.
    Rejected(RejectReason),
    /// The group will not run with this follower (optionally: ask this leader instead).
    Disbanded {
        /// A better leader to ask.
        suggested_leader: Option<PeerId>,
    },
}

/// Leader -> follower.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// The follower's request id.
    pub request_id: u64,
    /// The reply.
    pub body: ReplyBody,
}

/// A matchmaking control message.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// Follower -> leader.
    Join(JoinRequest),
    /// Leader -> follower.
    Reply(Reply),
    /// Follower -> leader: the follower withdraws request `request_id`.
    Leave {
        /// The request withdrawn.
        request_id: u64,
    },
}

/// An outgoing message.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// Destination.
    pub to: PeerId,
    /// The message.
    pub message: Message,
}

/// A DHT operation for the shell to perform.
#[derive(Clone, Debug, PartialEq)]
pub enum DhtRequest {
    /// Store `value` under `key` / `subkey` until `expiration` (fire and forget).
    Store {
        /// The group key.
        key: GroupKey,
        /// This peer's subkey ([`declaration_subkey`]).
        subkey: Bytes,
        /// [`DECLARED_VALUE`] or [`LEFT_VALUE`].
        value: Bytes,
        /// Expiration (also the write's version).
        expiration: DhtTime,
    },
    /// Read `key` and report the merged value with [`Matchmaker::handle_dht_get`] and `id`
    /// (also on failure, with `None`).
    Get {
        /// Id to report the result with.
        id: u64,
        /// The group key.
        key: GroupKey,
    },
}

/// Why no group was formed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MatchmakingError {
    /// The deadline passed without a group.
    #[error("no group was formed before the deadline {deadline}")]
    NoGroup {
        /// The step's deadline.
        deadline: DhtTime,
    },
    /// The step was cancelled.
    #[error("matchmaking was cancelled")]
    Cancelled,
}

/// What the driver learns from a [`Matchmaker`].
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A group was assembled with this peer in it (terminal).
    Assembled(Group),
    /// No group (terminal).
    Failed(MatchmakingError),
}

/// Per-averager matchmaking settings (identical across steps).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Hash of the tensor schema; peers with different hashes never group (1 to
    /// [`MAX_SCHEMA_HASH_BYTES`] bytes).
    pub schema_hash: Bytes,
    /// The leader closes the group as soon as it has this many members (`None`: only at its
    /// expiration). Default `None`.
    pub target_group_size: Option<usize>,
    /// Smallest group a leader closes at its expiration. Default 2.
    pub min_group_size: usize,
    /// Declarations reach at least this far ahead. Default 5 s.
    pub min_matchmaking_time: Duration,
    /// How long a follower waits for a leader's first reply (and, past its own expiration, for
    /// `Begin`). Should be below `min_matchmaking_time`. Default 3 s.
    pub request_timeout: Duration,
    /// Least time between two DHT reads while no candidate is left. Default 1 s.
    pub dht_refresh_interval: Duration,
}

impl Config {
    /// Defaults (hivemind's where it has one) for `schema_hash`.
    pub fn new(schema_hash: impl Into<Bytes>) -> Self {
        Self {
            schema_hash: schema_hash.into(),
            target_group_size: None,
            min_group_size: DEFAULT_MIN_GROUP_SIZE,
            min_matchmaking_time: DEFAULT_MIN_MATCHMAKING_TIME,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            dht_refresh_interval: DEFAULT_DHT_REFRESH_INTERVAL,
        }
    }

    /// The largest group a leader accepts: the target, or [`MAX_GROUP_SIZE`].
    pub fn max_group_size(&self) -> usize {
        self.target_group_size.unwrap_or(MAX_GROUP_SIZE)
    }
}

/// One step's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// The key to look under (from a [`KeyManager`] or a [`Grid`]).
    pub key: GroupKey,
    /// What this peer brings to the group.
    pub info: MemberInfo,
    /// When the all-reduce should begin at the earliest (default: `now +
    /// min_matchmaking_time`).
    pub scheduled_time: Option<DhtTime>,
    /// When to give up (`None`: never).
    pub deadline: Option<DhtTime>,
    /// Opaque bytes published with the declaration ([`declaration_value`]), at most
    /// [`MAX_CONTACT_BYTES`]: how followers that never met this peer reach it.
    pub contact: Bytes,
}

impl Step {
    /// A step under `key` with `info`, no schedule, no deadline and no contact bytes.
    pub fn new(key: GroupKey, info: MemberInfo) -> Self {
        Self {
            key,
            info,
            scheduled_time: None,
            deadline: None,
            contact: Bytes::new(),
        }
    }
}

/// A [`Config`] or [`Step`] the machine cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Empty or too long schema hash.
    #[error("schema hash of {0} bytes (must be 1..={MAX_SCHEMA_HASH_BYTES})")]
    SchemaHash(usize),
    /// More than [`MAX_CONTACT_BYTES`] contact bytes.
    #[error("{0} contact bytes (at most {MAX_CONTACT_BYTES})")]
    Contact(usize),
    /// `min_group_size` is 0, above `target_group_size`, or a size above [`MAX_GROUP_SIZE`].
    #[error(
        "group sizes min {min} / target {target:?} (need 1 <= min <= target <= {MAX_GROUP_SIZE})"
    )]
    GroupSizes {
        /// `min_group_size`.
        min: usize,
        /// `target_group_size`.
        target: Option<usize>,
    },
    /// A zero duration.
    #[error("{0} must be positive")]
    ZeroDuration(&'static str),
    /// The own info breaks the limits.
    #[error(transparent)]
    Info(#[from] InfoError),
}

impl Config {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.schema_hash.is_empty() || self.schema_hash.len() > MAX_SCHEMA_HASH_BYTES {
            return Err(ConfigError::SchemaHash(self.schema_hash.len()));
        }
        let bad_sizes = self.min_group_size == 0
            || self.min_group_size > MAX_GROUP_SIZE
            || self
                .target_group_size
                .is_some_and(|t| t < self.min_group_size || t > MAX_GROUP_SIZE);
        if bad_sizes {
            return Err(ConfigError::GroupSizes {
                min: self.min_group_size,
                target: self.target_group_size,
            });
        }
        for (name, d) in [
            ("min_matchmaking_time", self.min_matchmaking_time),
            ("request_timeout", self.request_timeout),
            ("dht_refresh_interval", self.dht_refresh_interval),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        Ok(())
    }
}
