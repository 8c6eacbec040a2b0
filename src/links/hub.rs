//! The acceptor side: the hub's tasks, round registrations, and the Hello checks.
//!
//! Task tree (all owned by [`LinkHub::tasks`], aborted on shutdown or drop):
//!
//! * one task accepts TCP clients on the [`DataListener`] and runs each TLS handshake (under
//!   `hello_timeout`) in a task of its own, at most `max_tls_handshakes` at once (at the limit
//!   it stops accepting: later clients wait in the kernel's queue) and `max_tls_handshakes_per_ip`
//!   from one address (an IPv4 address or an IPv6 /64, [`AddrKey`]: a client over its address's
//!   share is closed at once), in a `JoinSet` it owns (aborted when the task is); they forward
//!   authenticated TLS streams. In a private swarm a client is first checked by address, before
//!   any handshake runs ([`Shared::admits_addr`]): one from an address no swarm peer has
//!   connected from, and no registered member advertises, is closed before a ServerHello;
//! * one task forwards the node's inbound [`PART_PROTOCOL`] streams;
//! * the *supervisor* receives both (one bounded queue) and runs one task per inbound link in
//!   its own `JoinSet` (dropped, so aborted, with it), at most `max_pending_links` at once and
//!   `max_pending_links_per_peer` for one peer (more are dropped).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use libp2p::PeerId;
use tokio::io::{AsyncWrite, AsyncWriteExt as _};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use super::{
    Carrier, DataPlane, HubConfig, HubError, HubStats, LinkKind, LinkPeer, PART_PROTOCOL, Plan,
};
use crate::p2p::{AddrKey, InboundStreams, P2p};
use crate::runner::Link;
use crate::shares::{Refused, Shares};
use crate::transport::{DataIdentity, DataListener, Handshake, PeerMismatch, PunchSocket};
use crate::wire::{self, Hello, LinkMessage, Reject, RejectReason};

/// A node's link hub: accepts links over both carriers and dispatches them to the rounds that
/// expect them; opens links through [`Expectation::establish`]. Dropping it (or
/// [`LinkHub::shutdown`]) stops its tasks and closes its TLS listener. It holds a [`P2p`]
/// handle, so the p2p node runs at least as long as the hub.
pub struct LinkHub {
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for LinkHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkHub")
            .field("peer_id", &self.shared.peer_id)
            .field("data_addr", &self.shared.data_addr)
            .finish_non_exhaustive()
    }
}

/// How long a failed punched TLS link keeps us from trying again with that peer.
const PUNCH_MEMORY: Duration = Duration::from_secs(600);
/// Most peers remembered for [`PUNCH_MEMORY`].
const MAX_PUNCH_MEMORY: usize = 1024;

/// State shared by the hub's tasks and the rounds using it.
pub(super) struct Shared {
    pub(super) peer_id: PeerId,
    pub(super) p2p: P2p,
    pub(super) identity: Option<DataIdentity>,
    pub(super) data_addr: Option<SocketAddr>,
    pub(super) config: HubConfig,
    groups: Mutex<HashMap<Bytes, Registration>>,
    /// Bumped after every registration: wakes Hellos waiting for their round.
    registered: watch::Sender<u64>,
    /// Hellos waiting for their round now (at most half of `max_pending_links`).
    early_waiting: AtomicUsize,
    next_token: AtomicU64,
    stats: watch::Sender<HubStats>,
    /// Peers a punched TLS link failed with, and when ([`Shared::punch_failed_recently`]).
    punch_failures: Mutex<HashMap<PeerId, std::time::Instant>>,
    /// Members behind NATs we could not link to lately ([`LinkHub::unlinkable`]).
    unlinkable: Mutex<crate::reach::Unlinkable<PeerId>>,
}

impl Shared {
    /// Whether a TLS link from `peer` may go on to its Hello: always in an open swarm; in a
    /// private one, when the peer has had a libp2p connection with this node (through the
    /// key) or is a member of a round registered here (learned from a leader over such a
    /// connection).
    fn admits(&self, peer: &PeerId) -> bool {
        self.p2p.knows_swarm_member(peer)
            || self.groups().values().any(|reg| reg.members.contains(peer))
    }

    /// Whether a TCP client from `ip` may run a TLS handshake: always in an open swarm; in a
    /// private one, when a peer has had a libp2p connection with this node from that address
    /// (IPv4 address or IPv6 /64), or a member of a round registered here advertises a data
    /// address there. The ClientHello names no peer, so this is all that can be checked
    /// before the handshake; [`Shared::admits`] checks the peer after it. A member refused
    /// here falls back to a libp2p stream, which makes its address known.
    fn admits_addr(&self, ip: std::net::IpAddr) -> bool {
        if self.p2p.knows_swarm_address(ip) {
            return true;
        }
        let key = AddrKey::of_ip(ip);
        self.groups()
            .values()
            .any(|reg| reg.member_addrs.contains(&key))
    }
}

/// Counts one event in the hub's stats.
fn bump(shared: &Shared, count: impl FnOnce(&mut HubStats) -> &mut u64) {
    shared.stats.send_modify(|s| *count(s) += 1);
}

/// A round waiting for links.
struct Registration {
    /// Tells this registration from a later one with the same group id.
    token: u64,
    members: Vec<PeerId>,
    /// The keys of the members' advertised data addresses ([`Shared::admits_addr`]).
    member_addrs: Vec<AddrKey>,
    me: usize,
    /// Which members open their link to us ([`Plan::Await`]).
    expect_from: Vec<bool>,
    /// With which members a link through a relay is allowed (both allow relayed data).
    relay_ok: Vec<bool>,
    /// Which of them have a link already (first Hello wins).
    linked: Vec<bool>,
    /// To the round; room for one link (or give-up) per awaited member, so `try_send` never
    /// finds it full.
    arrivals: mpsc::Sender<Arrived>,
}

/// What the hub hands a round for an awaited member: its link, or word that it will not come.
pub(super) enum Arrived {
    /// An acked inbound link.
    Link(Arrival),
    /// The member cannot open its link to us (its hole punch failed, or only a relay that is not
    /// allowed connects us): stop waiting for it.
    GaveUp {
        /// The member's index.
        from: usize,
        /// Why.
        error: HubError,
    },
}

/// An acked inbound link, on its way to its round.
pub(super) struct Arrival {
    pub(super) from: usize,
    pub(super) kind: LinkKind,
    pub(super) link: Box<dyn Link>,
}

/// An inbound link before its Hello.
struct Inbound {
    peer: PeerId,
    carrier: Carrier,
    link: Box<dyn Link>,
    /// A TLS link over a TCP connection made by a simultaneous open.
    punched: bool,
}

/// A round registered with the hub ([`LinkHub::expect`]): Hellos for its group id are checked
/// against its members and acked links are queued for it. Dropping it unregisters the group;
/// later Hellos for it are refused as unknown.
pub struct Expectation {
    pub(super) shared: Arc<Shared>,
    pub(super) group_id: Bytes,
    pub(super) members: Vec<LinkPeer>,
    pub(super) me: usize,
    /// What we do about each member's link.
    pub(super) plan: Vec<Plan>,
    token: u64,
    pub(super) arrivals: mpsc::Receiver<Arrived>,
}

impl std::fmt::Debug for Expectation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Expectation")
            .field("members", &self.members.len())
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

impl Drop for Expectation {
    fn drop(&mut self) {
        let mut groups = self.shared.groups();
        if groups
            .get(&self.group_id)
            .is_some_and(|r| r.token == self.token)
        {
            groups.remove(&self.group_id);
        }
    }
}

impl LinkHub {
    /// Starts the hub: accepts [`PART_PROTOCOL`] streams on `p2p` (one hub per node) and, if
    /// `data_plane` has a listen address, TLS links on it. Without `data_plane` the node uses
    /// streams only.
    pub async fn start(
        p2p: P2p,
        data_plane: Option<DataPlane>,
        config: HubConfig,
    ) -> Result<Self, HubError> {
        let peer_id = p2p.peer_id();
        let (identity, listener) = match data_plane {
            None => (None, None),
            Some(DataPlane { identity, listen }) => {
                if identity.peer_id() != peer_id {
                    return Err(HubError::ForeignIdentity(Box::new(PeerMismatch {
                        expected: peer_id,
                        actual: identity.peer_id(),
                    })));
                }
                let listener = match listen {
                    Some(addr) => Some(DataListener::bind(&identity, addr).await?),
                    None => None,
                };
                (Some(identity), listener)
            }
        };
        let streams = p2p.accept_streams(PART_PROTOCOL, config.stream_queue)?;
        let shared = Arc::new(Shared {
            peer_id,
            p2p,
            identity,
            data_addr: listener.as_ref().map(DataListener::local_addr),
            config,
            groups: Mutex::new(HashMap::new()),
            registered: watch::Sender::new(0),
            early_waiting: AtomicUsize::new(0),
            next_token: AtomicU64::new(0),
            stats: watch::Sender::new(HubStats::default()),
            punch_failures: Mutex::new(HashMap::new()),
            unlinkable: Mutex::new(crate::reach::Unlinkable::default()),
        });
        register_metrics(&shared);
        let (tx, rx) = mpsc::channel(shared.config.max_pending_links.max(1));
        let mut tasks = JoinSet::new();
        if let Some(listener) = listener {
            tasks.spawn(accept_tls(Arc::clone(&shared), listener, tx.clone()));
        }
        tasks.spawn(accept_streams(streams, tx));
        tasks.spawn(supervise(Arc::clone(&shared), rx));
        Ok(Self { shared, tasks })
    }

    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.shared.peer_id
    }

    /// The TLS listener's address (to advertise as this node's data address), if it has one.
    pub fn data_addr(&self) -> Option<SocketAddr> {
        self.shared.data_addr
    }

    /// Peers behind NATs that a round could not link us to (a failed hole punch) in the last
    /// [`crate::reach::UNLINKABLE_FOR`], the newest first, at most
    /// [`crate::reach::MAX_UNLINKABLE`]: what this node publishes when it joins a group
    /// ([`crate::matchmaking::MemberInfo::unlinkable`]), so that the group plans no traffic
    /// between them.
    pub fn unlinkable(&self) -> Vec<PeerId> {
        self.shared.unlinkable().recent(std::time::Instant::now())
    }

    /// Counters of the inbound side so far.
    pub fn stats(&self) -> HubStats {
        *self.shared.stats.borrow()
    }

    /// The counters as they change (for waiting on an event, e.g. in tests).
    pub fn watch_stats(&self) -> watch::Receiver<HubStats> {
        self.shared.stats.subscribe()
    }

    /// Registers a round: from now on Hellos for `group_id` from the members that open their
    /// links to us (the plan in the `links` module docs) are acked and their links queued for
    /// the returned [`Expectation`], until it is dropped. `members` is the group in member
    /// order; `members[me]` must be this node.
    pub fn expect(
        &self,
        group_id: Bytes,
        members: &[LinkPeer],
        me: usize,
    ) -> Result<Expectation, HubError> {
        if group_id.is_empty() || group_id.len() > wire::MAX_GROUP_ID_BYTES {
            return Err(HubError::BadGroupId(group_id.len()));
        }
        if u32::try_from(members.len()).is_err() {
            return Err(HubError::BadMembers(format!("{} members", members.len())));
        }
        match members.get(me) {
            None => {
                return Err(HubError::BadMembers(format!(
                    "index {me} in a group of {}",
                    members.len()
                )));
            }
            Some(m) if m.peer_id != self.shared.peer_id => {
                return Err(HubError::BadMembers(format!(
                    "member {me} is {}, this node is {}",
                    m.peer_id, self.shared.peer_id
                )));
            }
            Some(_) => {}
        }
        let mut seen = std::collections::HashSet::with_capacity(members.len());
        if let Some(dup) = members.iter().find(|m| !seen.insert(m.peer_id)) {
            return Err(HubError::BadMembers(format!(
                "{} appears more than once",
                dup.peer_id
            )));
        }
        let token = self.shared.next_token.fetch_add(1, Ordering::Relaxed);
        let plan = super::plan(members, me);
        let expect_from: Vec<bool> = plan.iter().map(|p| matches!(p, Plan::Await(_))).collect();
        let awaited = expect_from.iter().filter(|&&e| e).count();
        let relay_ok = members
            .iter()
            .map(|m| m.relay_data && members[me].relay_data)
            .collect();
        let (tx, rx) = mpsc::channel(awaited.max(1));
        let mut groups = self.shared.groups();
        if groups.contains_key(&group_id) {
            return Err(HubError::AlreadyExpected);
        }
        groups.insert(
            group_id.clone(),
            Registration {
                token,
                members: members.iter().map(|m| m.peer_id).collect(),
                member_addrs: members
                    .iter()
                    .filter_map(|m| m.data_addr.map(|a| AddrKey::of_ip(a.ip())))
                    .collect(),
                me,
                expect_from,
                relay_ok,
                linked: vec![false; members.len()],
                arrivals: tx,
            },
        );
        drop(groups);
        self.shared
            .registered
            .send_modify(|n| *n = n.wrapping_add(1));
        Ok(Expectation {
            shared: Arc::clone(&self.shared),
            group_id,
            members: members.to_vec(),
            me,
            plan,
            token,
            arrivals: rx,
        })
    }

    /// Stops the hub's tasks and waits for them; closes the TLS listener and stops accepting
    /// streams. Links already handed out are not affected.
    pub async fn shutdown(mut self) {
        self.tasks.shutdown().await;
    }
}

/// An admitted Hello.
struct Admitted {
    from: usize,
    token: u64,
    arrivals: mpsc::Sender<Arrived>,
}

impl Shared {
    fn groups(&self) -> MutexGuard<'_, HashMap<Bytes, Registration>> {
        // No code panics while holding the lock; recover the map anyway.
        self.groups.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The acceptor's checks (module doc of `links`) for a link from `peer` (through a relay
    /// if `relayed`); marks the pair linked on success.
    fn admit(&self, hello: &Hello, peer: PeerId, relayed: bool) -> Result<Admitted, Reject> {
        let mut groups = self.groups();
        let (reg, from) = Self::checked(&mut groups, hello, peer, relayed)?;
        reg.linked[from] = true;
        Ok(Admitted {
            from,
            token: reg.token,
            arrivals: reg.arrivals.clone(),
        })
    }

    /// The checks of [`Shared::admit`] for a punch request (the TLS link it makes is admitted
    /// later, with its own Hello); links nothing.
    fn check(&self, hello: &Hello, peer: PeerId) -> Result<(), Reject> {
        Self::checked(&mut self.groups(), hello, peer, false).map(|_| ())
    }

    /// The checks themselves: the registration and the opener's index.
    fn checked<'a>(
        groups: &'a mut HashMap<Bytes, Registration>,
        hello: &Hello,
        peer: PeerId,
        relayed: bool,
    ) -> Result<(&'a mut Registration, usize), Reject> {
        let reject = |reason, detail: String| Reject { reason, detail };
        let Some(reg) = groups.get_mut(&hello.group_id) else {
            return Err(reject(
                RejectReason::UnknownGroup,
                "no round with this group id is waiting for links".into(),
            ));
        };
        if hello.from_peer != peer {
            return Err(reject(
                RejectReason::IdentityMismatch,
                format!(
                    "the hello claims {}, the connection authenticated {peer}",
                    hello.from_peer
                ),
            ));
        }
        let from = hello.from_index as usize;
        if reg.members.get(from) != Some(&peer) {
            return Err(reject(
                RejectReason::NotMember,
                format!("{peer} is not member {from}"),
            ));
        }
        if !reg.expect_from[from] {
            return Err(reject(
                RejectReason::WrongDirection,
                format!("member {from} does not open a link to member {}", reg.me),
            ));
        }
        if reg.linked[from] {
            return Err(reject(
                RejectReason::Duplicate,
                format!("member {from} is linked already"),
            ));
        }
        if relayed && !reg.relay_ok[from] {
            return Err(reject(
                RejectReason::RelayNotAllowed,
                format!("the link from member {from} runs through a relay"),
            ));
        }
        Ok((reg, from))
    }

    /// Whether a punched TLS link with `peer` failed less than [`PUNCH_MEMORY`] ago: its NAT (or
    /// ours) defeats the simultaneous open, and every round would wait for it in vain.
    pub(super) fn punch_failed_recently(&self, peer: &PeerId) -> bool {
        let failures = self
            .punch_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        failures
            .get(peer)
            .is_some_and(|at| at.elapsed() < PUNCH_MEMORY)
    }

    /// Remembers that a punched TLS link with `peer` failed (at most [`MAX_PUNCH_MEMORY`]
    /// peers; the oldest are forgotten first).
    pub(super) fn punch_failed(&self, peer: PeerId) {
        let mut failures = self
            .punch_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        failures.retain(|_, at| at.elapsed() < PUNCH_MEMORY);
        if failures.len() >= MAX_PUNCH_MEMORY
            && let Some(oldest) = failures.iter().min_by_key(|(_, at)| **at).map(|(p, _)| *p)
        {
            failures.remove(&oldest);
        }
        failures.insert(peer, std::time::Instant::now());
    }

    /// The peers we could not link to ([`LinkHub::unlinkable`]).
    pub(super) fn unlinkable(&self) -> std::sync::MutexGuard<'_, crate::reach::Unlinkable<PeerId>> {
        self.unlinkable.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Undoes [`Shared::admit`] when the Ack could not be written.
    fn unlink(&self, group_id: &Bytes, token: u64, from: usize) {
        if let Some(reg) = self.groups().get_mut(group_id)
            && reg.token == token
        {
            reg.linked[from] = false;
        }
    }
}

/// Writes one link frame and flushes.
pub(super) async fn write_link_frame(
    link: &mut (impl AsyncWrite + Unpin + ?Sized),
    message: &LinkMessage,
) -> std::io::Result<()> {
    let mut buf = BytesMut::new();
    wire::encode_link_frame(message, &mut buf);
    link.write_all(&buf).await?;
    link.flush().await
}

async fn accept_tls(shared: Arc<Shared>, listener: DataListener, tx: mpsc::Sender<Inbound>) {
    // Each handshake runs in a task of its own, so a client that connects and stalls holds up
    // nobody else while fewer than `max_tls_handshakes` run. At the limit the loop stops
    // accepting: later clients wait in the kernel's accept queue (none is dropped) until a
    // handshake ends (at most `hello_timeout`).
    let mut handshakes = JoinSet::new();
    let shares = Shares::new(
        shared.config.max_tls_handshakes,
        shared.config.max_tls_handshakes_per_ip,
    );
    loop {
        tokio::select! {
            accepted = listener.accept_tcp(), if !shares.is_full() => match accepted {
                Ok(handshake) => {
                    let ip = handshake.peer_addr().ip();
                    if !shared.admits_addr(ip) {
                        // A private swarm, and an address no member is known at: closed
                        // before any handshake (dropping the handshake closes it).
                        bump(&shared, |s| &mut s.unknown_address);
                        tracing::debug!(%ip, "TLS client from an address not known in this private swarm");
                        continue;
                    }
                    match shares.try_take(handshake_key(ip)) {
                        Ok(share) => {
                            let (shared, tx) = (Arc::clone(&shared), tx.clone());
                            handshakes.spawn(async move {
                                let _share = share;
                                handshake_and_forward(shared, handshake, tx).await;
                            });
                        }
                        Err(refused) => {
                            // Dropping the handshake closes the connection.
                            bump(&shared, |s| &mut s.over_share);
                            tracing::debug!(%ip, %refused, "TLS client dropped");
                        }
                    }
                }
                Err(error) => {
                    // The socket itself failed (e.g. out of file descriptors): do not spin.
                    tracing::warn!(%error, "accepting a TLS link failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                if let Err(e) = done {
                    tracing::error!(error = %e, "TLS handshake task failed");
                }
            }
        }
    }
}

/// Whose share of the TLS handshakes a client from `ip` takes: its IPv4 address, or the /64 of
/// its IPv6 one (one subscriber's usual allocation, so one host cannot fill the pool by
/// spreading over its addresses).
fn handshake_key(ip: std::net::IpAddr) -> AddrKey {
    AddrKey::of_ip(ip)
}

/// Runs one inbound TLS handshake (under `hello_timeout`) and hands the link to the supervisor.
async fn handshake_and_forward(
    shared: Arc<Shared>,
    handshake: Handshake,
    tx: mpsc::Sender<Inbound>,
) {
    match handshake.run(shared.config.hello_timeout).await {
        Ok((peer, mut stream)) => {
            if !shared.admits(&peer) {
                // A private swarm, and a peer that never came through its key: refused before
                // it can send a Hello or hold a pending link.
                bump(&shared, |s| &mut s.not_in_swarm);
                tracing::debug!(%peer, "TLS link from a peer not known in this private swarm");
                let reject = LinkMessage::Reject(Reject {
                    reason: RejectReason::NotInSwarm,
                    detail: "this node runs a private swarm".into(),
                });
                let _ = tokio::time::timeout(
                    shared.config.hello_timeout,
                    write_link_frame(&mut stream, &reject),
                )
                .await;
                return;
            }
            let inbound = Inbound {
                peer,
                carrier: Carrier::Tls,
                link: Box::new(stream),
                punched: false,
            };
            // Fails only when the hub is shutting down.
            let _ = tx.send(inbound).await;
        }
        Err(error) => {
            bump(&shared, |s| &mut s.tls_failed);
            tracing::debug!(%error, "inbound TLS link failed its handshake");
        }
    }
}

async fn accept_streams(mut streams: InboundStreams, tx: mpsc::Sender<Inbound>) {
    while let Some((peer, stream)) = streams.next().await {
        let inbound = Inbound {
            peer,
            carrier: Carrier::Stream,
            link: Box::new(stream),
            punched: false,
        };
        if tx.send(inbound).await.is_err() {
            return;
        }
    }
}

async fn supervise(shared: Arc<Shared>, mut rx: mpsc::Receiver<Inbound>) {
    let mut handlers = JoinSet::new();
    let shares = Shares::new(
        shared.config.max_pending_links,
        shared.config.max_pending_links_per_peer,
    );
    loop {
        tokio::select! {
            inbound = rx.recv() => {
                let Some(inbound) = inbound else { break };
                let share = match shares.try_take(inbound.peer) {
                    Ok(share) => share,
                    Err(refused) => {
                        bump(&shared, |s| match refused {
                            Refused::Full => &mut s.dropped,
                            Refused::PeerShare => &mut s.over_share,
                        });
                        tracing::info!(
                            peer = %inbound.peer, carrier = %inbound.carrier, %refused,
                            "inbound link dropped before its Hello"
                        );
                        continue;
                    }
                };
                let shared = Arc::clone(&shared);
                handlers.spawn(async move {
                    let _share = share;
                    serve(shared, inbound).await;
                });
            }
            Some(done) = handlers.join_next(), if !handlers.is_empty() => {
                if let Err(e) = done {
                    tracing::error!(error = %e, "inbound link task failed");
                }
            }
        }
    }
}

/// `checks` (those of [`Shared::admit`], or of a punch request) until they do not say
/// "unknown group": a Hello for a group not registered (yet) waits up to
/// [`HubConfig::early_hello_wait`] for a registration and is checked again after each one.
/// At most half of [`HubConfig::max_pending_links`] Hellos wait at once (each holds a pending
/// slot meanwhile); the others are refused at once.
///
/// [`HubConfig::early_hello_wait`]: super::HubConfig::early_hello_wait
/// [`HubConfig::max_pending_links`]: super::HubConfig::max_pending_links
async fn when_registered<T>(
    shared: &Shared,
    registered: &mut watch::Receiver<u64>,
    checks: impl Fn() -> Result<T, Reject>,
) -> Result<T, Reject> {
    let first = checks();
    match &first {
        Err(reject) if reject.reason == RejectReason::UnknownGroup => {}
        _ => return first,
    }
    let limit = shared.config.max_pending_links / 2;
    let waiting = &shared.early_waiting;
    if shared.config.early_hello_wait.is_zero()
        || waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_err()
    {
        return first;
    }
    // Given back however this ends (the task may be aborted while it waits).
    struct Slot<'a>(&'a AtomicUsize);
    impl Drop for Slot<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _slot = Slot(waiting);
    bump(shared, |s| &mut s.early);
    let deadline = tokio::time::Instant::now() + shared.config.early_hello_wait;
    loop {
        // Woken by the next registration (any group's), or refused at the deadline.
        match tokio::time::timeout_at(deadline, registered.changed()).await {
            Ok(Ok(())) => match checks() {
                Err(reject) if reject.reason == RejectReason::UnknownGroup => {}
                result => return result,
            },
            Ok(Err(_)) | Err(_) => return checks(),
        }
    }
}

/// One inbound link: its Hello, the checks, the answer, the hand-over.
async fn serve(shared: Arc<Shared>, inbound: Inbound) {
    let Inbound {
        peer,
        carrier,
        mut link,
        punched,
    } = inbound;
    let timeout = shared.config.hello_timeout;
    // Subscribed before the first check, so a registration right after it is not missed.
    let mut registered = shared.registered.subscribe();
    let hello = match tokio::time::timeout(timeout, wire::read_link_frame(&mut link)).await {
        Ok(Ok(LinkMessage::Hello(hello))) => hello,
        Ok(Ok(LinkMessage::GiveUp(hello))) => {
            let detail = "the member could not make the link (its hole punch failed)";
            gave_up(&shared, &mut registered, peer, &hello, detail).await;
            return;
        }
        Ok(Ok(LinkMessage::Punch { hello, endpoint })) if carrier == Carrier::Stream => {
            if let Err(error) = punch(&shared, peer, link, &hello, endpoint, registered).await {
                bump(&shared, |s| &mut s.failed);
                tracing::info!(%error, "no punched TLS link");
            }
            return;
        }
        Ok(Ok(_)) => {
            bump(&shared, |s| &mut s.failed);
            let error = HubError::Unexpected { peer, carrier };
            tracing::info!(%error, "dropped inbound link");
            return;
        }
        Ok(Err(error)) => {
            bump(&shared, |s| &mut s.failed);
            let error = HubError::Frame {
                peer,
                carrier,
                error,
            };
            tracing::info!(%error, "dropped inbound link");
            return;
        }
        Err(_) => {
            bump(&shared, |s| &mut s.failed);
            let error = HubError::HelloTimeout {
                peer,
                carrier,
                timeout,
            };
            tracing::info!(%error, "dropped inbound link");
            return;
        }
    };
    let kind = match carrier {
        Carrier::Tls if punched => LinkKind::PunchedTls,
        Carrier::Tls => LinkKind::Tls,
        Carrier::Stream => super::establish::stream_kind(&shared.p2p, peer).await,
    };
    let relayed = kind == LinkKind::Relayed;
    match when_registered(&shared, &mut registered, || {
        shared.admit(&hello, peer, relayed)
    })
    .await
    {
        Err(reject) => {
            bump(&shared, |s| &mut s.refused);
            let error = HubError::Refused {
                peer,
                carrier,
                reason: reject.reason,
                detail: reject.detail.clone(),
            };
            if reject.reason == RejectReason::UnknownGroup {
                // Usually "not yet": the opener retries.
                tracing::debug!(%error);
            } else {
                tracing::info!(%error);
            }
            if reject.reason == RejectReason::RelayNotAllowed {
                // A verdict for the opener too: neither side waits for this link any longer.
                let detail = "only a relay connects the member, and it is not allowed";
                gave_up(&shared, &mut registered, peer, &hello, detail).await;
            }
            let _ = tokio::time::timeout(timeout, async {
                write_link_frame(&mut link, &LinkMessage::Reject(reject)).await?;
                link.shutdown().await
            })
            .await;
        }
        Ok(admitted) => {
            let acked =
                tokio::time::timeout(timeout, write_link_frame(&mut link, &LinkMessage::Ack))
                    .await
                    .map_err(|_| format!("timed out after {timeout:?}"))
                    .and_then(|r| r.map_err(|e| e.to_string()));
            if let Err(detail) = acked {
                shared.unlink(&hello.group_id, admitted.token, admitted.from);
                bump(&shared, |s| &mut s.failed);
                let error = HubError::Write {
                    peer,
                    carrier,
                    detail,
                };
                tracing::info!(%error, "could not ack an inbound link");
                return;
            }
            let arrival = Arrival {
                from: admitted.from,
                kind,
                link,
            };
            if admitted.arrivals.try_send(Arrived::Link(arrival)).is_ok() {
                bump(&shared, |s| &mut s.accepted);
                tracing::debug!(%peer, %kind, from = admitted.from, "inbound link accepted");
            } else {
                // The round stopped waiting between the check and now.
                tracing::debug!(%peer, %carrier, "inbound link acked after its round stopped waiting");
            }
        }
    }
}

/// A member we await gave up its link (a [`LinkMessage::GiveUp`], or a relayed link refused):
/// after the Hello's checks (waiting for the round like a Hello), the pair counts as settled
/// (a later Hello from it is a duplicate) and the round stops waiting for it at once.
async fn gave_up(
    shared: &Arc<Shared>,
    registered: &mut watch::Receiver<u64>,
    peer: PeerId,
    hello: &Hello,
    detail: &str,
) {
    match when_registered(shared, registered, || shared.admit(hello, peer, false)).await {
        Ok(admitted) => {
            let error = HubError::NoPath {
                peer,
                detail: detail.to_owned(),
            };
            tracing::info!(%peer, from = admitted.from, %detail, "a member gave up its link");
            let _ = admitted.arrivals.try_send(Arrived::GaveUp {
                from: admitted.from,
                error,
            });
        }
        Err(reject) => {
            tracing::debug!(%peer, reason = %reject.reason, "a give-up that does not count");
        }
    }
}

/// The acceptor's side of a punched TLS link (a [`LinkMessage::Punch`] on a stream from `peer`):
/// the Hello's checks (without linking the pair: the Hello on the TLS link does that; refused
/// as `NoPunch` without a TLS identity or behind a NAT that does not keep ports), a fresh
/// port, our endpoint as our NAT maps it (the IP peers observe, the port kept: punchable NATs
/// preserve it), the simultaneous open, the TLS server handshake (the client must be `peer`),
/// then the TLS link is served like any inbound one.
async fn punch(
    shared: &Arc<Shared>,
    peer: PeerId,
    mut stream: Box<dyn Link>,
    hello: &Hello,
    endpoint: SocketAddr,
    mut registered: watch::Receiver<u64>,
) -> Result<(), HubError> {
    let config = &shared.config;
    let failed = |detail: String| HubError::NoPath { peer, detail };
    let checks = || {
        shared.check(hello, peer)?;
        if shared.identity.is_none() || !shared.p2p.reachability().port_preserving {
            return Err(Reject {
                reason: RejectReason::NoPunch,
                detail: "no TLS identity, or a NAT that does not keep ports".into(),
            });
        }
        Ok(())
    };
    if let Err(reject) = when_registered(shared, &mut registered, checks).await {
        let _ = tokio::time::timeout(config.hello_timeout, async {
            write_link_frame(&mut stream, &LinkMessage::Reject(reject)).await?;
            stream.shutdown().await
        })
        .await;
        return Err(failed("the punch request failed the Hello's checks".into()));
    }
    let identity = shared
        .identity
        .clone()
        .ok_or_else(|| failed("no TLS identity here".into()))?;
    let socket = PunchSocket::bind().map_err(|e| failed(e.to_string()))?;
    let ours = super::establish::mapped_endpoint(&shared.p2p, socket.port())
        .ok_or_else(|| failed("no observed address to punch from".into()))?;
    if !punchable(endpoint, ours) {
        return Err(failed(format!(
            "the punch names {endpoint}, which {ours} does not dial"
        )));
    }
    tokio::time::timeout(
        config.hello_timeout,
        write_link_frame(&mut stream, &LinkMessage::PunchAnswer(ours)),
    )
    .await
    .map_err(|_| failed("timed out answering the punch".into()))?
    .map_err(|e| failed(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + config.punch_connect_timeout;
    let tcp = socket
        .connect(endpoint, deadline)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let (client, tls) = Handshake::over(&identity, tcp)?
        .run(config.hello_timeout)
        .await?;
    if client != peer {
        return Err(failed(format!(
            "the punched TLS client is {client}, the punch came from {peer}"
        )));
    }
    drop(stream);
    Box::pin(serve(
        Arc::clone(shared),
        Inbound {
            peer,
            carrier: Carrier::Tls,
            link: Box::new(tls),
            punched: true,
        },
    ))
    .await;
    Ok(())
}

/// Whether the endpoint a punch request names (where the requester says its NAT maps it) may
/// be dialled from `ours` (issue 29, item 8): never an address that is nobody's (unspecified,
/// multicast, broadcast, port 0), and a loopback address only from a loopback endpoint, so a
/// member cannot make this node send SYNs to services on its own host.
fn punchable(endpoint: SocketAddr, ours: SocketAddr) -> bool {
    let ip = endpoint.ip().to_canonical();
    let nobody = ip.is_unspecified()
        || ip.is_multicast()
        || matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast())
        || endpoint.port() == 0;
    !nobody && (!ip.is_loopback() || ours.ip().to_canonical().is_loopback())
}

/// `inbound_links_total{result}` from the hub's stats (see [`crate::metrics`]).
fn register_metrics(shared: &Shared) {
    type Read = fn(&HubStats) -> u64;
    let results: Vec<(&'static str, Read)> = vec![
        ("accepted", |s| s.accepted),
        ("refused", |s| s.refused),
        ("early", |s| s.early),
        ("failed", |s| s.failed),
        ("dropped", |s| s.dropped),
        ("over_share", |s| s.over_share),
        ("tls_failed", |s| s.tls_failed),
        ("not_in_swarm", |s| s.not_in_swarm),
        ("unknown_address", |s| s.unknown_address),
    ];
    shared.p2p.metrics().register_collector(
        crate::metrics::WatchCollector::new(shared.stats.subscribe()).counters(
            "inbound_links",
            "Inbound round links (TLS and stream), by what became of them",
            results,
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_handshake_shares_count_an_ipv6_net_as_one_address() {
        let config = HubConfig::default();
        let shares = Shares::new(config.max_tls_handshakes, config.max_tls_handshakes_per_ip);
        let mut held = Vec::new();
        let mut refused = 0;
        for host in 1..=(config.max_tls_handshakes_per_ip as u16 + 8) {
            let ip =
                std::net::IpAddr::V6(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 7, host, 0, 0, 1));
            match shares.try_take(handshake_key(ip)) {
                Ok(share) => held.push(share),
                Err(Refused::PeerShare) => refused += 1,
                Err(Refused::Full) => panic!("the pool is larger than one net's share"),
            }
        }
        assert_eq!(held.len(), config.max_tls_handshakes_per_ip);
        assert_eq!(refused, 8);
        // Another /64 and an IPv4 address still find room.
        let other_net = "2001:db8:0:8::1".parse().unwrap();
        assert!(shares.try_take(handshake_key(other_net)).is_ok());
        assert!(
            shares
                .try_take(handshake_key("192.0.2.1".parse().unwrap()))
                .is_ok()
        );
    }

    #[test]
    fn punch_endpoints_are_checked() {
        let public: SocketAddr = "203.0.113.5:4000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert!(punchable("198.51.100.7:5000".parse().unwrap(), public));
        assert!(punchable("127.0.0.1:5000".parse().unwrap(), local));
        for bad in [
            "127.0.0.1:22",
            "[::1]:22",
            "[::ffff:127.0.0.1]:22",
            "0.0.0.0:5000",
            "224.0.0.1:5000",
            "255.255.255.255:5000",
            "198.51.100.7:0",
        ] {
            assert!(!punchable(bad.parse().unwrap(), public), "{bad}");
        }
    }
}
