//! Links for a round: one authenticated byte stream per member pair, over either of two
//! carriers, set up with a Hello/Ack handshake and handed to [`crate::runner`].
//!
//! # Carriers
//!
//! * **TLS direct** ([`Carrier::Tls`], the fast path): a [`crate::transport`] connection (TLS 1.3
//!   over TCP, both ends authenticated by their libp2p identities) to the peer's data-plane
//!   address. It costs a third of the CPU per byte of a libp2p stream, but needs a reachable
//!   data address.
//! * **libp2p stream** ([`Carrier::Stream`], the fallback): a [`PART_PROTOCOL`]
//!   (`/hivemesh/part/1`) stream on the swarm's connection to the peer (noise + yamux or QUIC),
//!   which works between any two peers the swarm can connect, relayed ones included.
//!
//! Both carry the same bytes: link frames first, then round frames ([`crate::wire`]).
//!
//! # The hub
//!
//! Each node runs one [`LinkHub`]. It owns the node's TLS [`crate::transport::DataListener`]
//! (optional: a node may have no data listener) and its inbound [`PART_PROTOCOL`] streams, and
//! serves both the same way: every inbound link gets its own task (at most
//! [`HubConfig::max_pending_links`] at once; more are dropped), which reads the opener's Hello
//! under [`HubConfig::hello_timeout`] and dispatches it by group id to the round that
//! registered itself with [`LinkHub::expect`]. The registration lives as long as the returned
//! [`Expectation`]: dropping it unregisters the group.
//!
//! The acceptor checks, in this order, and answers a failed check with a `Reject` carrying the
//! reason, logs it as a typed [`HubError::Refused`] and drops the link; the hub keeps serving:
//!
//! 1. a round is registered for the group id, else `UnknownGroup`;
//! 2. the peer id claimed in the Hello is the one the connection authenticated (the TLS client
//!    certificate, or the libp2p connection's noise/QUIC handshake), else `IdentityMismatch`;
//! 3. the claimed member index holds that peer id, else `NotMember`;
//! 4. that member opens the link to us (see "Who links with whom"), else `WrongDirection`;
//! 5. the pair is not linked yet, else `Duplicate`;
//! 6. a stream link that runs through a relay is allowed by both members
//!    ([`LinkPeer::relay_data`]), else `RelayNotAllowed`.
//!
//! Then it writes `Ack` and hands the link to the round. A Hello that is malformed, oversized
//! (the length prefix alone is checked against [`crate::wire::MAX_LINK_FRAME_BYTES`]), late, or
//! not a Hello costs only its own task.
//!
//! # Establishing a round's links
//!
//! [`establish_links`] (or [`LinkHub::expect`] then [`Expectation::establish`]) builds the
//! `Vec<Option<Box<dyn Link>>>` that [`crate::runner::run_round`] takes. Both sides stop at
//! one deadline, and a member that never linked stays `None` (the runner fails it at once).
//!
//! # Who links with whom
//!
//! Every member derives the same plan from the group ([`LinkPeer`]: reachability, whether it
//! sends and whether it reduces):
//!
//! * only pairs with traffic link: one of the two reduces and the other sends (two clients, or
//!   two aux peers, never link);
//! * the **path** is [`crate::reach::path`]: direct when one of them is public, a hole punch when
//!   both are behind endpoint-independent NATs, a relay when both allow tensor data there;
//! * the **opener** is [`crate::reach::opener`]: the one that can dial (a NATed member dials a
//!   public one), else the lower member index;
//! * a direct path uses TLS to the public member's data address, else a stream; a hole-punch
//!   path first makes a direct libp2p connection ([`crate::p2p::P2p::connect_direct`]: through
//!   the peer's relay, then DCUtR), then opens the stream on it; if the punch fails and both
//!   allow relayed data, the stream runs through the relay. [`LinkKind`] reports what each link
//!   became.
//!
//! The opener sends `Hello {group id, its index, its peer id}` and waits for the answer:
//!
//! * **Carrier choice**: TLS first if the peer has a data address (and we have a TLS
//!   identity). If the TLS connection, its handshake (a server proving another identity than
//!   the member's is refused by the client) or the link fails, or no answer comes within
//!   [`HubConfig::ack_timeout`], the next attempt uses a stream. Without a data address streams
//!   are used from the start.
//! * **Silence means "re-open"**: libp2p-stream 0.5.0-alpha silently drops inbound streams
//!   that arrive together (`../shared/reference/dataplane.md` §5.4). An attempt that gets no
//!   answer within [`HubConfig::ack_timeout`] is therefore joined by a new one, up to
//!   [`HubConfig::max_attempts`] attempts; failed attempts are retried the same way after a
//!   short delay. Earlier attempts stay open: **the first Ack on any attempt wins**, and the
//!   acceptor acks only the first Hello of a pair (`Duplicate` for the others), so both ends
//!   always agree on which attempt is the link, whatever order the attempts arrive in.
//! * **An early Hello waits, then "not yet" means "retry"**: a Hello can arrive before the
//!   acceptor's round has registered (group members finish their previous work at different
//!   times). The acceptor's task for that link waits up to [`HubConfig::early_hello_wait`]
//!   for the round to register and then runs the checks again, so the link is acked the
//!   moment the late member registers: the members of a round start it together. Only if the
//!   round does not register in that time is it answered `UnknownGroup`; the opener then
//!   retries after [`HubConfig::retry_delay`] (doubling up to 16×) until the deadline. The
//!   waiting Hello holds one of the [`HubConfig::max_pending_links`] slots, as a link slow to
//!   send its Hello does, and nothing else: the hub keeps no state for groups it does not
//!   know. (Without the wait, a member that registered 5 ms late cost the others 25 ms, one
//!   that registered 30 ms late cost them 75 ms: measured start skews of 100 ms in
//!   `hivemesh bench allreduce` rounds of 190 ms.)
//! * Any other `Reject` is a verdict: the pair stays unlinked.
//! * **Giving up is said, not timed out**: an opener whose hole punch failed (and that may not
//!   relay) sends [`crate::wire::LinkMessage::GiveUp`] with its Hello on a stream (which runs
//!   through the relay) instead of leaving the acceptor to wait for the deadline; the acceptor
//!   runs the Hello's checks and stops waiting for that member at once. A relayed link the
//!   acceptor refuses (`RelayNotAllowed`) settles the pair the same way on both sides.
//! * **Failed pairs are remembered**: a member behind a NAT that we could not link to is kept
//!   for [`crate::reach::UNLINKABLE_FOR`] ([`LinkHub::unlinkable`]) and published with our next
//!   join, so the next group plans no traffic between the pair.
//! * **The census** ([`census`]): in a round whose plan has hole-punched pairs, every member
//!   tells every member it is linked to which members it could not link to (a statement it
//!   signs), once the links are made and before the first round frame, and passes on the
//!   statements it heard until every member holds all of them; every member re-plans the round
//!   around the same failed pairs.
//!
//! Every wait is under a timeout, every queue is bounded, and the hub's tasks are owned by the
//! hub: [`LinkHub::shutdown`] (or dropping it) stops them.

pub mod census;
mod establish;
mod hub;

use std::net::SocketAddr;
use std::time::Duration;

use libp2p::PeerId;

use crate::p2p::{ConnPath, P2pError, Transport};
use crate::reach::Reach;
use crate::runner::Link;
use crate::transport::{DataIdentity, PeerMismatch, TlsError};
use crate::wire::{LinkReadError, RejectReason};

pub use establish::establish_links;
pub use hub::{Expectation, LinkHub};

/// libp2p protocol of the fallback part carrier.
pub const PART_PROTOCOL: &str = "/hivemesh/part/1";

/// Which carrier a link uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Carrier {
    /// A direct TLS 1.3 connection to the peer's data address ([`crate::transport`]).
    Tls,
    /// A [`PART_PROTOCOL`] libp2p stream.
    Stream,
}

impl std::fmt::Display for Carrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tls => "tls",
            Self::Stream => "stream",
        })
    }
}

/// How a link is carried, end to end (reported per member in a step's outcome).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// A direct TLS connection to the peer's data address.
    Tls,
    /// TLS over a TCP connection made by a simultaneous open through both NATs
    /// ([`crate::transport::PunchSocket`], [`HubConfig::punched_tls`]).
    PunchedTls,
    /// A libp2p stream on a direct connection over this transport.
    Stream(Transport),
    /// A libp2p stream on a connection made by hole punching, over this transport.
    Punched(Transport),
    /// A libp2p stream through a relay.
    Relayed,
}

impl LinkKind {
    /// The kind of a stream link on a connection with `path`.
    pub fn of_stream(path: ConnPath) -> Self {
        if path.relayed {
            Self::Relayed
        } else if path.punched {
            Self::Punched(path.transport)
        } else {
            Self::Stream(path.transport)
        }
    }

    /// The carrier underneath.
    pub fn carrier(self) -> Carrier {
        match self {
            Self::Tls | Self::PunchedTls => Carrier::Tls,
            _ => Carrier::Stream,
        }
    }
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tls => f.write_str("tls"),
            Self::PunchedTls => f.write_str("tls/punched"),
            Self::Stream(t) => write!(f, "stream/{t}"),
            Self::Punched(t) => write!(f, "punched/{t}"),
            Self::Relayed => f.write_str("relayed"),
        }
    }
}

/// A group member as the link layer needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkPeer {
    /// Its libp2p identity (the swarm must be able to reach it: connected, or its addresses
    /// known to Kademlia or given with [`crate::p2p::P2p::add_peer_addresses`]).
    pub peer_id: PeerId,
    /// Its TLS data-plane address, if it runs a reachable data listener.
    pub data_addr: Option<SocketAddr>,
    /// How others reach it.
    pub reach: Reach,
    /// It allows tensor data through relays.
    pub relay_data: bool,
    /// It sends data in the round (not aux).
    pub sends: bool,
    /// It reduces a part of the round (a positive fraction).
    pub reduces: bool,
    /// Its relay circuit addresses (`.../p2p-circuit/p2p/<id>`), through which a hole punch to
    /// it starts.
    pub relay_addrs: Vec<libp2p::Multiaddr>,
}

impl LinkPeer {
    /// A public member that sends and reduces (every member of a plain group on one network).
    pub fn public(peer_id: PeerId, data_addr: Option<SocketAddr>) -> Self {
        Self {
            peer_id,
            data_addr,
            reach: Reach::Public,
            relay_data: false,
            sends: true,
            reduces: true,
            relay_addrs: Vec::new(),
        }
    }

    fn plan(&self) -> crate::reach::Peer {
        crate::reach::Peer {
            reach: self.reach,
            relay_data: self.relay_data,
        }
    }
}

/// What member `me` does about its link with one other member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// No traffic between the two: no link.
    Idle,
    /// We open the link, over this path.
    Open(crate::reach::Path),
    /// The other member opens it, over this path.
    Await(crate::reach::Path),
    /// Traffic but no path (two NATed members that cannot punch and may not relay): no link;
    /// the round's bans and timeouts deal with it. Load balancing gives no span to a member
    /// that not every sender can reach, so only a sender/receiver pair of a bad plan gets here.
    Unreachable,
}

/// The plan of member `me` for each member of `members` ([`Plan::Idle`] for itself).
pub(crate) fn plan(members: &[LinkPeer], me: usize) -> Vec<Plan> {
    let peers: Vec<crate::reach::Peer> = members.iter().map(LinkPeer::plan).collect();
    (0..members.len())
        .map(|j| {
            let traffic = j != me
                && ((members[me].reduces && members[j].sends)
                    || (members[j].reduces && members[me].sends));
            if !traffic {
                return Plan::Idle;
            }
            match crate::reach::path(peers[me], peers[j]) {
                None => Plan::Unreachable,
                Some(path) if crate::reach::opener(&peers, me, j) == me => Plan::Open(path),
                Some(path) => Plan::Await(path),
            }
        })
        .collect()
}

/// The node's TLS data plane, for [`LinkHub::start`].
#[derive(Clone, Debug)]
pub struct DataPlane {
    /// The TLS identity; must be the p2p node's keypair's.
    pub identity: DataIdentity,
    /// Where to listen for TLS links; `None` opens TLS links but accepts only streams.
    pub listen: Option<SocketAddr>,
}

/// Parameters of a [`LinkHub`] and of the links it establishes.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Bound on waiting for the Hello of an inbound link, and on writing the answer.
    pub hello_timeout: Duration,
    /// Opener: an attempt without an answer for this long gets a new attempt beside it.
    pub ack_timeout: Duration,
    /// Bound on one TLS connect + handshake, or one stream open (dial included).
    pub connect_timeout: Duration,
    /// Most attempts per pair opened because earlier ones were silent or failed ("not yet"
    /// retries are bounded by the deadline only).
    pub max_attempts: usize,
    /// First delay before retrying a failed or "not yet" attempt; doubles up to 16×.
    pub retry_delay: Duration,
    /// Acceptor: how long a Hello for a group that is not registered (yet) waits for its round
    /// to register before it is refused as unknown. Keep it well below the openers'
    /// `ack_timeout` (theirs, not ours: nothing checks the two against each other): an opener
    /// whose TLS attempt stays unanswered that long opens the next attempt on a stream. At most
    /// half of `max_pending_links` Hellos wait at once; beyond that they are refused at once,
    /// as with zero, which turns the wait off.
    pub early_hello_wait: Duration,
    /// Inbound links waiting for their Hello at once; more are dropped.
    pub max_pending_links: usize,
    /// Inbound links waiting for their Hello at once from one peer; more from it are dropped
    /// (so one peer holding its share leaves the rest of `max_pending_links` to others).
    pub max_pending_links_per_peer: usize,
    /// Inbound TLS handshakes running at once (each in its own task, under `hello_timeout`);
    /// clients arriving while this many run wait in the kernel's accept queue.
    pub max_tls_handshakes: usize,
    /// Inbound TLS handshakes running at once from one address (an IPv4 address, or the /64
    /// of an IPv6 one; the peer is not known before the handshake ends); a client from an
    /// address holding its share is closed at once (its opener falls back to a stream).
    pub max_tls_handshakes_per_ip: usize,
    /// Inbound streams queued between the swarm and the hub.
    pub stream_queue: usize,
    /// Bound on making a direct connection by hole punching, per attempt.
    pub punch_timeout: Duration,
    /// Between two members behind NATs, carry the round over TLS on a TCP connection made by
    /// a simultaneous open (coordinated over whatever libp2p connection reaches the peer: the
    /// relayed one before any hole punch) rather than over a libp2p stream on a hole-punched
    /// connection; tried first, before DCUtR's punch. If the simultaneous open fails, DCUtR's
    /// punch and a stream on it are tried (and punched TLS with that peer is not tried again
    /// for 10 minutes). Only between
    /// peers whose NATs keep ports (a fresh port's endpoint must be predictable). Default on:
    /// on fast links it is 2.5× faster and half the CPU (docs/architecture.md).
    pub punched_tls: bool,
    /// Bound on the simultaneous open of a punched TLS link. Behind routers that reset early
    /// SYNs the two sides need a few hundred attempts to cross (0.1-4.1 s on the namespace
    /// bed, docs/architecture.md).
    pub punch_connect_timeout: Duration,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            hello_timeout: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            max_attempts: 8,
            retry_delay: Duration::from_millis(25),
            early_hello_wait: Duration::from_millis(500),
            max_pending_links: 64,
            max_pending_links_per_peer: 8,
            max_tls_handshakes: 64,
            max_tls_handshakes_per_ip: 16,
            stream_queue: 32,
            punch_timeout: Duration::from_secs(10),
            punched_tls: true,
            punch_connect_timeout: Duration::from_secs(6),
        }
    }
}

/// Errors of the link layer: starting a hub, registering a round, and (logged, or reported per
/// member in [`EstablishedLinks::errors`]) why a link was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The p2p layer failed (accepting or opening streams).
    #[error(transparent)]
    P2p(#[from] P2pError),
    /// The TLS data plane failed (binding, connecting, handshake).
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The TLS identity belongs to another peer than the p2p node (expected: the node's peer
    /// id; actual: the identity's; boxed, a PeerId is 80 bytes).
    #[error("the data-plane identity is not the node's: {0}")]
    ForeignIdentity(Box<PeerMismatch>),
    /// The group id is empty or too long.
    #[error("group id of {0} bytes (must be 1..={max})", max = crate::wire::MAX_GROUP_ID_BYTES)]
    BadGroupId(usize),
    /// The member list or our index in it is invalid.
    #[error("invalid members: {0}")]
    BadMembers(String),
    /// A round with this group id is registered already.
    #[error("a round with this group id is registered already")]
    AlreadyExpected,
    /// The link's first frame was malformed, oversized, or the link failed before it came.
    #[error("{carrier} link with {peer}: bad link frame: {error}")]
    Frame {
        /// The authenticated peer.
        peer: PeerId,
        /// The carrier.
        carrier: Carrier,
        /// What was wrong.
        error: LinkReadError,
    },
    /// The Hello (acceptor) did not arrive in time.
    #[error("{carrier} link with {peer}: no Hello within {timeout:?}")]
    HelloTimeout {
        /// The authenticated peer.
        peer: PeerId,
        /// The carrier.
        carrier: Carrier,
        /// The timeout.
        timeout: Duration,
    },
    /// A link frame other than the one due (an Ack where a Hello was due, ...).
    #[error("{carrier} link with {peer}: unexpected link frame")]
    Unexpected {
        /// The authenticated peer.
        peer: PeerId,
        /// The carrier.
        carrier: Carrier,
    },
    /// We refused an inbound link.
    #[error("refused {carrier} link from {peer}: {reason}: {detail}")]
    Refused {
        /// The authenticated peer.
        peer: PeerId,
        /// The carrier.
        carrier: Carrier,
        /// Why.
        reason: RejectReason,
        /// Detail.
        detail: String,
    },
    /// The peer refused our link.
    #[error("{peer} refused our {carrier} link: {reason}: {detail}")]
    Rejected {
        /// The peer.
        peer: PeerId,
        /// The carrier.
        carrier: Carrier,
        /// Why.
        reason: RejectReason,
        /// Its detail.
        detail: String,
    },
    /// Writing a link frame failed or timed out.
    #[error("{carrier} link with {peer}: cannot write: {detail}")]
    Write {
        /// The peer.
        peer: PeerId,
        /// The carrier.
        carrier: Carrier,
        /// Why.
        detail: String,
    },
    /// No path to this member: the hole punch failed and tensor data may not go through a
    /// relay, or the stream we got runs through a relay that is not allowed.
    #[error("no path to {peer}: {detail}")]
    NoPath {
        /// The member.
        peer: PeerId,
        /// Why.
        detail: String,
    },
    /// No link with this member within the timeout.
    #[error("no link with {peer} within {timeout:?}")]
    NoLink {
        /// The member.
        peer: PeerId,
        /// The timeout.
        timeout: Duration,
    },
}

/// Counters of a hub's inbound side (for tests and monitoring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HubStats {
    /// Links acked and handed to a round.
    pub accepted: u64,
    /// Hellos answered with a Reject.
    pub refused: u64,
    /// Hellos that arrived before their round registered and waited for it
    /// ([`HubConfig::early_hello_wait`]); counted when they start waiting.
    pub early: u64,
    /// Inbound links that failed before a valid Hello (malformed, oversized, late, closed).
    pub failed: u64,
    /// Inbound links dropped because [`HubConfig::max_pending_links`] were pending.
    pub dropped: u64,
    /// Inbound links and TLS clients dropped because their peer held its share
    /// ([`HubConfig::max_pending_links_per_peer`]) or their IP address did
    /// ([`HubConfig::max_tls_handshakes_per_ip`]).
    pub over_share: u64,
    /// TLS connections that failed their handshake.
    pub tls_failed: u64,
    /// TLS connections refused after their handshake because this node runs a private swarm
    /// and does not know the peer as a member ([`crate::wire::RejectReason::NotInSwarm`]).
    pub not_in_swarm: u64,
    /// TLS clients closed before any handshake because this node runs a private swarm and
    /// neither a swarm peer has connected from their address nor a registered round's member
    /// advertises it.
    pub unknown_address: u64,
}

/// The links of one round, as [`crate::runner::run_round`] takes them, and how they were made.
pub struct EstablishedLinks {
    /// `links[i]`: the link to member `i`; `None` for ourselves and for members not linked.
    pub links: Vec<Option<Box<dyn Link>>>,
    /// `carriers[i]`: the carrier of `links[i]`.
    pub carriers: Vec<Option<Carrier>>,
    /// `kinds[i]`: how `links[i]` is carried, end to end.
    pub kinds: Vec<Option<LinkKind>>,
    /// `errors[i]`: why member `i` has no link (`None` for ourselves and linked members).
    pub errors: Vec<Option<HubError>>,
    /// Attempts we opened beyond the first because earlier ones were silent or failed (the
    /// stream-drop recovery at work; "not yet" retries are not counted).
    pub reopened: usize,
}

impl std::fmt::Debug for EstablishedLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EstablishedLinks")
            .field("kinds", &self.kinds)
            .field("errors", &self.errors)
            .field("reopened", &self.reopened)
            .finish_non_exhaustive()
    }
}

impl EstablishedLinks {
    /// How many members we have a link with.
    pub fn linked(&self) -> usize {
        self.links.iter().filter(|l| l.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reach::Path;
    use proptest::prelude::*;

    /// What a member does in the round: node (sends and reduces), client (sends) or aux
    /// (reduces).
    #[derive(Clone, Copy, Debug)]
    enum Role {
        Node,
        Client,
        Aux,
    }

    fn member(role: Role, reach: Reach, relay_data: bool) -> LinkPeer {
        LinkPeer {
            reach,
            relay_data,
            sends: !matches!(role, Role::Aux),
            reduces: !matches!(role, Role::Client),
            ..LinkPeer::public(PeerId::random(), None)
        }
    }

    #[test]
    fn clients_and_aux_peers_do_not_link_among_themselves() {
        use Role::*;
        let m = [
            member(Node, Reach::Public, false),
            member(Client, Reach::Public, false),
            member(Client, Reach::Public, false),
            member(Aux, Reach::Public, false),
            member(Aux, Reach::Public, false),
        ];
        let plans: Vec<Vec<Plan>> = (0..m.len()).map(|me| plan(&m, me)).collect();
        for (me, p) in plans.iter().enumerate() {
            assert_eq!(p[me], Plan::Idle, "member {me} with itself");
        }
        // Two clients: neither reduces. Two aux peers: neither sends.
        assert_eq!(plans[1][2], Plan::Idle);
        assert_eq!(plans[2][1], Plan::Idle);
        assert_eq!(plans[3][4], Plan::Idle);
        assert_eq!(plans[4][3], Plan::Idle);
        // Every other pair has traffic: the node with everyone, a client with an aux peer (the
        // client sends, the aux peer reduces). All public: the lower index opens.
        for (a, b) in [
            (0, 1),
            (0, 2),
            (0, 3),
            (0, 4),
            (1, 3),
            (1, 4),
            (2, 3),
            (2, 4),
        ] {
            assert_eq!(plans[a][b], Plan::Open(Path::Direct), "{a} -> {b}");
            assert_eq!(plans[b][a], Plan::Await(Path::Direct), "{b} <- {a}");
        }
        // A member that reduces nothing after load balancing (a node with a zero fraction) is
        // like a client: no link with a client.
        let mut zero = m.clone();
        zero[0].reduces = false;
        assert_eq!(plan(&zero, 0)[1], Plan::Idle);
        assert_eq!(plan(&zero, 1)[0], Plan::Idle);
        assert_eq!(plan(&zero, 0)[3], Plan::Open(Path::Direct));
    }

    #[test]
    fn the_member_that_can_dial_opens() {
        use Reach::*;
        use Role::Node;
        // Indices chosen so that reachability, not the index, decides: the NATed members sit
        // above the public one they dial.
        let m = [
            member(Node, Public, false),
            member(Node, Punchable, false),
            member(Node, Private, false),
            member(Node, Public, false),
            member(Node, Punchable, false),
        ];
        let p: Vec<Vec<Plan>> = (0..m.len()).map(|me| plan(&m, me)).collect();
        // Public with public: the lower index.
        assert_eq!(p[0][3], Plan::Open(Path::Direct));
        assert_eq!(p[3][0], Plan::Await(Path::Direct));
        // A punchable or private member dials a public one, whichever index is lower.
        for nated in [1, 2, 4] {
            for public in [0, 3] {
                assert_eq!(
                    p[nated][public],
                    Plan::Open(Path::Direct),
                    "{nated} -> {public}"
                );
                assert_eq!(
                    p[public][nated],
                    Plan::Await(Path::Direct),
                    "{public} <- {nated}"
                );
            }
        }
        // Two punchable members: a hole punch, opened by the lower index.
        assert_eq!(p[1][4], Plan::Open(Path::HolePunch));
        assert_eq!(p[4][1], Plan::Await(Path::HolePunch));
        // Punchable with private, no relayed data: no path at all.
        for (a, b) in [(1, 2), (2, 1), (2, 4), (4, 2)] {
            assert_eq!(p[a][b], Plan::Unreachable, "{a} - {b}");
        }
    }

    #[test]
    fn relayed_data_needs_both_members_consent() {
        use Reach::*;
        use Role::Node;
        let pair = |relay_a: bool, relay_b: bool| {
            let m = [
                member(Node, Punchable, relay_a),
                member(Node, Private, relay_b),
            ];
            (plan(&m, 0)[1], plan(&m, 1)[0])
        };
        assert_eq!(pair(false, false), (Plan::Unreachable, Plan::Unreachable));
        assert_eq!(pair(true, false), (Plan::Unreachable, Plan::Unreachable));
        assert_eq!(pair(false, true), (Plan::Unreachable, Plan::Unreachable));
        assert_eq!(
            pair(true, true),
            (Plan::Open(Path::Relay), Plan::Await(Path::Relay))
        );
        // Two private members that both allow it: relayed, lower index opens.
        let m = [member(Node, Private, true), member(Node, Private, true)];
        assert_eq!(plan(&m, 0)[1], Plan::Open(Path::Relay));
        assert_eq!(plan(&m, 1)[0], Plan::Await(Path::Relay));
        // Relay consent does not replace a better path: two punchable members still punch, a
        // public member is still dialled directly.
        let m = [
            member(Node, Punchable, true),
            member(Node, Punchable, true),
            member(Node, Public, true),
        ];
        assert_eq!(plan(&m, 0)[1], Plan::Open(Path::HolePunch));
        assert_eq!(plan(&m, 1)[2], Plan::Open(Path::Direct));
    }

    fn any_member() -> impl Strategy<Value = LinkPeer> {
        (
            prop_oneof![
                Just(Reach::Public),
                Just(Reach::Punchable),
                Just(Reach::Private)
            ],
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(reach, relay_data, sends, reduces)| LinkPeer {
                reach,
                relay_data,
                sends,
                reduces,
                ..LinkPeer::public(PeerId::random(), None)
            })
    }

    proptest! {
        /// Both ends of every pair derive matching plans (one opens, the other awaits, over the
        /// same path; or both idle; or both unreachable), pairs link exactly when one reduces
        /// and the other sends, the path is the planner's, and a public member opens only to
        /// another public member.
        #[test]
        fn both_ends_of_every_pair_agree(
            members in prop::collection::vec(any_member(), 1..9)
        ) {
            let n = members.len();
            let plans: Vec<Vec<Plan>> = (0..n).map(|me| plan(&members, me)).collect();
            for a in 0..n {
                prop_assert_eq!(plans[a].len(), n);
                prop_assert_eq!(plans[a][a], Plan::Idle);
                for b in (0..n).filter(|&b| b != a) {
                    let (x, y) = (&members[a], &members[b]);
                    let traffic = (x.reduces && y.sends) || (y.reduces && x.sends);
                    let path = crate::reach::path(x.plan(), y.plan());
                    match (plans[a][b], plans[b][a]) {
                        (Plan::Idle, Plan::Idle) => prop_assert!(!traffic),
                        (Plan::Unreachable, Plan::Unreachable) => {
                            prop_assert!(traffic);
                            prop_assert_eq!(path, None);
                        }
                        (Plan::Open(p), Plan::Await(q)) => {
                            prop_assert!(traffic);
                            prop_assert_eq!(p, q);
                            prop_assert_eq!(Some(p), path);
                            if x.reach == Reach::Public {
                                prop_assert_eq!(y.reach, Reach::Public);
                                prop_assert!(a < b);
                            }
                            if x.reach != Reach::Public && y.reach != Reach::Public {
                                prop_assert!(a < b);
                            }
                        }
                        (Plan::Await(_), Plan::Open(_)) => {} // checked from the other end
                        other => prop_assert!(false, "{a} and {b} disagree: {other:?}"),
                    }
                }
            }
        }
    }
}
