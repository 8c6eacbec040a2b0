//! [`Matchmaker`]: one peer's matchmaking for one step, as a pure state machine (see the
//! [module docs](super) for the protocol).
//!
//! Every input ends in `drive(now)`, which performs whatever is due at `now` in a fixed order:
//! expire the outstanding join request, enforce the deadline, handle an expired declaration
//! (assemble, or disband and re-declare), decide deferred join requests, and ask the next
//! candidate leader (or read the DHT). After it returns, every time [`Matchmaker::poll_timeout`]
//! reports lies after `now`.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngExt, SeedableRng};

use super::{
    Begin, Config, ConfigError, DhtRequest, Event, GROUP_ID_BYTES, Group, GroupKey, GroupMember,
    JoinRequest, LEFT_VALUE, MAX_GROUP_SIZE, MatchmakingError, MemberInfo, Message, Mode, PeerId,
    RejectReason, Reply, ReplyBody, Step, Transmit, active_declarations, declaration_subkey,
    declaration_value,
};
use crate::dht::{DhtTime, DhtValue};

/// How many abandoned join requests a peer remembers (to honour a late `Begin`).
const ABANDONED_MEMORY: usize = 16;

/// This peer's own join request to a leader.
#[derive(Debug)]
struct Pending {
    leader: PeerId,
    request_id: u64,
    /// The expiration the request carried.
    expiration: DhtTime,
    sent_at: DhtTime,
    accepted: bool,
}

/// An accepted follower.
#[derive(Debug)]
struct Follower {
    peer: PeerId,
    request_id: u64,
    info: MemberInfo,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Looking,
    Assembled,
    Failed,
}

enum Decision {
    Accept,
    Defer,
    Reject(RejectReason),
}

/// One peer's matchmaking for one step (see the [module docs](super)).
#[derive(Debug)]
pub struct Matchmaker {
    me: PeerId,
    config: Config,
    key: GroupKey,
    info: MemberInfo,
    /// Published with every declaration.
    contact: Bytes,
    scheduled_time: DhtTime,
    deadline: Option<DhtTime>,
    rng: StdRng,
    state: State,
    /// The last time seen.
    now: DhtTime,
    /// The current declaration's expiration (never set for clients).
    declared: Option<DhtTime>,
    followers: Vec<Follower>,
    /// Join requests waiting for this peer's own request to be answered.
    deferred: VecDeque<(PeerId, JoinRequest)>,
    pending: Option<Pending>,
    abandoned: VecDeque<(PeerId, u64)>,
    /// Declared peers from the last DHT read, best first.
    candidates: BTreeSet<(DhtTime, PeerId)>,
    tried: HashSet<(PeerId, DhtTime)>,
    get_in_flight: Option<(u64, DhtTime)>,
    /// A client's reads in a row that left it no one to ask (see [`client_reread_wait`]).
    fruitless_reads: u32,
    next_get_id: u64,
    next_refresh: DhtTime,
    want_refresh: bool,
    transmits: VecDeque<Transmit>,
    dht: VecDeque<DhtRequest>,
    events: VecDeque<Event>,
}

impl Matchmaker {
    /// Starts matchmaking for `step` as peer `me` at `now`; `rng` seeds the machine's own
    /// generator (request ids, group ids, member order). Queues the first declaration (unless
    /// this peer is a client) and the first DHT read.
    pub fn new(
        me: PeerId,
        config: Config,
        step: Step,
        now: DhtTime,
        rng: &mut impl Rng,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        step.info.validate()?;
        if step.contact.len() > super::MAX_CONTACT_BYTES {
            return Err(ConfigError::Contact(step.contact.len()));
        }
        let scheduled_time = step
            .scheduled_time
            .unwrap_or_else(|| now.saturating_add(config.min_matchmaking_time));
        let mut m = Self {
            me,
            key: step.key,
            info: step.info,
            contact: step.contact,
            scheduled_time,
            deadline: step.deadline,
            rng: StdRng::from_rng(rng),
            state: State::Looking,
            now,
            declared: None,
            followers: Vec::new(),
            deferred: VecDeque::new(),
            pending: None,
            abandoned: VecDeque::new(),
            candidates: BTreeSet::new(),
            tried: HashSet::new(),
            get_in_flight: None,
            fruitless_reads: 0,
            next_get_id: 0,
            next_refresh: now,
            want_refresh: false,
            transmits: VecDeque::new(),
            dht: VecDeque::new(),
            events: VecDeque::new(),
            config,
        };
        if m.info.mode != Mode::Client && !m.deadline_passed(now) {
            m.declare(now);
        }
        m.drive(now);
        Ok(m)
    }

    /// This peer's id.
    pub fn peer_id(&self) -> &PeerId {
        &self.me
    }

    /// The key this step looks under.
    pub fn group_key(&self) -> &GroupKey {
        &self.key
    }

    /// The current declaration's expiration (`None` for clients and after the end).
    pub fn declared_expiration(&self) -> Option<DhtTime> {
        self.declared
    }

    /// Changes when the all-reduce should begin at the earliest (the step's scheduled time,
    /// [`Step::scheduled_time`]): declarations from the next one on expire then (bounded as
    /// always by `now + min_matchmaking_time` and the deadline); one made already stands until
    /// it expires, since followers and candidates know it.
    pub fn set_scheduled_time(&mut self, at: DhtTime) {
        self.scheduled_time = at;
    }

    /// Whether the step ended (a terminal event was queued). Keep draining
    /// [`Matchmaker::poll_transmit`] and [`Matchmaker::poll_dht`] after it: the leave record
    /// and the leader's `Begin`s are queued with the event.
    pub fn is_finished(&self) -> bool {
        self.state != State::Looking
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next DHT operation to perform.
    pub fn poll_dht(&mut self) -> Option<DhtRequest> {
        self.dht.pop_front()
    }

    /// The next event ([`Event::Assembled`] or [`Event::Failed`], once).
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The earliest time at which [`Matchmaker::handle_timeout`] must be called (`None` once
    /// finished).
    pub fn poll_timeout(&self) -> Option<DhtTime> {
        if self.state != State::Looking {
            return None;
        }
        let rt = self.config.request_timeout;
        let accepted = self.pending.as_ref().is_some_and(|p| p.accepted);
        let pending = self.pending.as_ref().map(|p| {
            if p.accepted {
                p.expiration.saturating_add(rt)
            } else {
                p.sent_at.saturating_add(rt)
            }
        });
        let deadline = self.deadline.filter(|_| !accepted);
        // An expired declaration waits for the outstanding request unless the group can be
        // closed; a new follower (an input) re-checks that.
        let declared = self
            .declared
            .filter(|&e| !accepted && (self.pending.is_none() || e > self.now));
        let refresh = (self.pending.is_none() && self.want_refresh).then_some(self.next_refresh);
        let get = self.get_in_flight.map(|(_, at)| at.saturating_add(rt));
        [pending, deadline, declared, refresh, get]
            .into_iter()
            .flatten()
            .min()
    }

    /// Handles expired timers.
    pub fn handle_timeout(&mut self, now: DhtTime) {
        self.drive(now);
    }

    /// Handles a message from `from` (an identity the transport authenticated).
    pub fn handle_message(&mut self, now: DhtTime, from: PeerId, message: Message) {
        self.now = now;
        match message {
            Message::Join(req) => self.on_join(from, req),
            Message::Reply(reply) => self.on_reply(now, from, reply),
            Message::Leave { request_id } => self.drop_follower(&from, Some(request_id)),
        }
        self.drive(now);
    }

    /// Handles the result of [`DhtRequest::Get`] `id`: the merged value of the key (`None` if
    /// it holds nothing or the read failed).
    pub fn handle_dht_get(&mut self, now: DhtTime, id: u64, value: Option<DhtValue>) {
        self.now = now;
        let mut issued = None;
        if let Some((i, at)) = self.get_in_flight
            && i == id
        {
            self.get_in_flight = None;
            issued = Some(at);
        }
        if id >= self.next_get_id || self.state != State::Looking {
            self.drive(now);
            return;
        }
        // Expired pairs can never be candidates again.
        self.tried.retain(|(_, e)| *e >= now);
        if let Some(v) = value {
            self.candidates = active_declarations(&v, now)
                .into_iter()
                .filter(|(p, _)| *p != self.me)
                .map(|(p, e)| (e, p))
                .collect();
        }
        if self.info.mode == Mode::Client
            && let Some(at) = issued
        {
            // A client declares nothing, so nobody finds it: its own reads are its only way
            // into a group. A read that found no one to ask (the leaders' declarations were
            // not stored yet) is repeated sooner than `dht_refresh_interval`, which is as long
            // as a leader's wait (`min_matchmaking_time`) by default.
            if self.has_candidate(now) {
                self.fruitless_reads = 0;
            } else {
                self.fruitless_reads = self.fruitless_reads.saturating_add(1);
                let wait =
                    client_reread_wait(self.config.dht_refresh_interval, self.fruitless_reads);
                self.next_refresh = self.next_refresh.min(at.saturating_add(wait));
            }
        }
        self.drive(now);
    }

    /// The transport could not reach `peer` (dial failed, stream reset): a leader this peer
    /// waits on counts as failed, a follower as gone.
    pub fn handle_unreachable(&mut self, now: DhtTime, peer: &PeerId) {
        self.now = now;
        if self.pending.as_ref().is_some_and(|p| p.leader == *peer) {
            self.pending = None;
        }
        self.drop_follower(peer, None);
        self.drive(now);
    }

    /// Cancels the step: withdraws the own request, disbands followers, leaves the DHT, and
    /// emits [`Event::Failed`] with [`MatchmakingError::Cancelled`].
    pub fn cancel(&mut self, now: DhtTime) {
        self.now = now;
        if self.state != State::Looking {
            return;
        }
        self.abandon_pending();
        self.finish(State::Failed, None);
        self.events
            .push_back(Event::Failed(MatchmakingError::Cancelled));
    }

    // ---- the driver ----

    fn deadline_passed(&self, now: DhtTime) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }

    fn drive(&mut self, now: DhtTime) {
        self.now = now;
        if self.state != State::Looking {
            return;
        }
        let rt = self.config.request_timeout;
        if self
            .get_in_flight
            .is_some_and(|(_, at)| now >= at.saturating_add(rt))
        {
            self.get_in_flight = None;
        }
        if let Some(p) = &self.pending {
            let limit = if p.accepted {
                p.expiration.saturating_add(rt)
            } else {
                p.sent_at.saturating_add(rt)
            };
            if now >= limit {
                self.abandon_pending();
            }
        }
        let accepted = self.pending.as_ref().is_some_and(|p| p.accepted);
        if !accepted && self.deadline_passed(now) {
            self.abandon_pending();
            if self.can_assemble() {
                self.assemble();
            } else {
                let deadline = self.deadline.unwrap_or(now);
                self.finish(State::Failed, None);
                self.events
                    .push_back(Event::Failed(MatchmakingError::NoGroup { deadline }));
            }
            return;
        }
        if !accepted && self.declared.is_some_and(|e| now >= e) {
            if self.can_assemble() {
                // A group in hand beats an outstanding request.
                self.abandon_pending();
                self.assemble();
                return;
            }
            if self.pending.is_none() {
                self.disband(None);
                self.declare(now);
            }
        }
        if self.pending.is_none() {
            while let Some((from, req)) = self.deferred.pop_front() {
                self.decide(from, req);
                if self.state != State::Looking {
                    return;
                }
            }
            self.search(now);
        }
    }

    /// Asks the next candidate leader, or reads the DHT when none is left.
    fn search(&mut self, now: DhtTime) {
        self.want_refresh = false;
        if let Some(leader) = self.next_candidate(now) {
            self.send_request(now, leader);
            return;
        }
        if self.get_in_flight.is_some() {
            return;
        }
        if now >= self.next_refresh {
            let id = self.next_get_id;
            self.next_get_id += 1;
            self.get_in_flight = Some((id, now));
            self.next_refresh = now.saturating_add(self.config.dht_refresh_interval);
            self.dht.push_back(DhtRequest::Get {
                id,
                key: self.key.clone(),
            });
        } else {
            self.want_refresh = true;
        }
    }

    /// Whether candidate `(exp, peer)` may still be asked at `now`: not expired, not this
    /// peer, not tried.
    fn askable(&self, (exp, peer): &(DhtTime, PeerId), now: DhtTime) -> bool {
        *exp >= now && *peer != self.me && !self.tried.contains(&(peer.clone(), *exp))
    }

    /// Whether candidate `(exp, peer)` ranks before this peer's own declaration (any does
    /// while this peer has declared nothing).
    fn ranks_before_me(&self, (exp, peer): &(DhtTime, PeerId)) -> bool {
        self.declared
            .is_none_or(|mine| (*exp, peer) < (mine, &self.me))
    }

    /// Whether [`Matchmaker::next_candidate`] would pick someone at `now`.
    fn has_candidate(&self, now: DhtTime) -> bool {
        self.candidates
            .iter()
            .find(|c| self.askable(c, now))
            .is_some_and(|c| self.ranks_before_me(c))
    }

    /// The best candidate strictly better than this peer, not tried, not expired.
    fn next_candidate(&mut self, now: DhtTime) -> Option<PeerId> {
        let mut drop = Vec::new();
        let mut pick = None;
        for c in &self.candidates {
            if !self.askable(c, now) {
                drop.push(c.clone());
                continue;
            }
            if self.ranks_before_me(c) {
                pick = Some(c.clone());
            }
            break;
        }
        for c in drop {
            self.candidates.remove(&c);
        }
        let (exp, peer) = pick?;
        self.candidates.remove(&(exp, peer.clone()));
        self.tried.insert((peer.clone(), exp));
        Some(peer)
    }

    fn expiration_at(&self, now: DhtTime) -> DhtTime {
        let e = self
            .scheduled_time
            .max(now.saturating_add(self.config.min_matchmaking_time));
        let e = match self.deadline {
            Some(d) => e.min(d),
            None => e,
        };
        // Durations too small to move a wall-clock f64 still move the expiration.
        e.max(now.next_up())
    }

    fn declare(&mut self, now: DhtTime) {
        let expiration = self.expiration_at(now);
        self.declared = Some(expiration);
        self.dht.push_back(DhtRequest::Store {
            key: self.key.clone(),
            subkey: declaration_subkey(&self.me),
            value: declaration_value(&self.contact),
            expiration,
        });
    }

    fn send_request(&mut self, now: DhtTime, leader: PeerId) {
        let request_id: u64 = self.rng.random();
        let expiration = self.declared.unwrap_or_else(|| self.expiration_at(now));
        self.pending = Some(Pending {
            leader: leader.clone(),
            request_id,
            expiration,
            sent_at: now,
            accepted: false,
        });
        self.transmits.push_back(Transmit {
            to: leader,
            message: Message::Join(JoinRequest {
                request_id,
                schema_hash: self.config.schema_hash.clone(),
                expiration,
                group_key: self.key.clone(),
                info: self.info.clone(),
            }),
        });
    }

    /// Withdraws the own request, if any (the leader drops this peer).
    fn abandon_pending(&mut self) {
        if let Some(p) = self.pending.take() {
            self.transmits.push_back(Transmit {
                to: p.leader.clone(),
                message: Message::Leave {
                    request_id: p.request_id,
                },
            });
            if self.abandoned.len() == ABANDONED_MEMORY {
                self.abandoned.pop_front();
            }
            self.abandoned.push_back((p.leader, p.request_id));
        }
    }

    // ---- leader side ----

    fn reply(&mut self, to: PeerId, request_id: u64, body: ReplyBody) {
        self.transmits.push_back(Transmit {
            to,
            message: Message::Reply(Reply { request_id, body }),
        });
    }

    fn on_join(&mut self, from: PeerId, req: JoinRequest) {
        if self.state != State::Looking {
            self.reply(
                from,
                req.request_id,
                ReplyBody::Rejected(RejectReason::NotLookingForGroup),
            );
            return;
        }
        if self.deferred.iter().any(|(p, _)| *p == from) {
            self.reply(
                from,
                req.request_id,
                ReplyBody::Rejected(RejectReason::DuplicatePeerId),
            );
            return;
        }
        self.decide(from, req);
    }

    fn decide(&mut self, from: PeerId, req: JoinRequest) {
        match self.evaluate(&from, &req) {
            Decision::Reject(reason) => {
                self.reply(from, req.request_id, ReplyBody::Rejected(reason));
            }
            Decision::Defer => self.deferred.push_back((from, req)),
            Decision::Accept => {
                let request_id = req.request_id;
                self.followers.push(Follower {
                    peer: from.clone(),
                    request_id,
                    info: req.info,
                });
                self.reply(from, request_id, ReplyBody::Accepted);
                let full = self
                    .config
                    .target_group_size
                    .is_some_and(|t| self.followers.len() + 1 >= t);
                if full && self.can_assemble() {
                    self.abandon_pending();
                    self.assemble();
                }
            }
        }
    }

    /// hivemind's checks, in its order; `Defer` only where the outcome depends on the own
    /// outstanding request.
    fn evaluate(&self, from: &PeerId, req: &JoinRequest) -> Decision {
        use RejectReason as R;
        if self.info.mode == Mode::Client
            || req.schema_hash.is_empty()
            || req.info.validate().is_err()
        {
            return Decision::Reject(R::ProtocolViolation);
        }
        if req.schema_hash != self.config.schema_hash {
            return Decision::Reject(R::BadSchemaHash);
        }
        if req.group_key != self.key {
            return Decision::Reject(R::BadGroupKey);
        }
        let Some(mine) = self.declared else {
            return Decision::Reject(R::NotDeclared);
        };
        if (mine, &self.me) >= (req.expiration, from) {
            return Decision::Reject(R::BadExpirationTime);
        }
        if let Some(p) = self.pending.as_ref().filter(|p| p.accepted) {
            return Decision::Reject(R::NotALeader {
                suggested_leader: Some(p.leader.clone()),
            });
        }
        if *from == self.me || self.followers.iter().any(|f| f.peer == *from) {
            return Decision::Reject(R::DuplicatePeerId);
        }
        if self.followers.len() + 1 >= self.config.max_group_size() {
            return Decision::Reject(R::GroupIsFull);
        }
        if self.pending.is_some() {
            // Bounded: a flood of identities cannot queue without limit.
            if self.deferred.len() >= MAX_GROUP_SIZE {
                return Decision::Reject(R::GroupIsFull);
            }
            return Decision::Defer;
        }
        Decision::Accept
    }

    fn can_assemble(&self) -> bool {
        let senders =
            self.info.mode.is_sender() || self.followers.iter().any(|f| f.info.mode.is_sender());
        self.info.mode != Mode::Client
            && self.followers.len() + 1 >= self.config.min_group_size
            && senders
    }

    fn assemble(&mut self) {
        let mut members: Vec<GroupMember> = self
            .followers
            .iter()
            .map(|f| GroupMember {
                peer: f.peer.clone(),
                info: f.info.clone(),
            })
            .chain(std::iter::once(GroupMember {
                peer: self.me.clone(),
                info: self.info.clone(),
            }))
            .collect();
        members.shuffle(&mut self.rng);
        let mut id = [0u8; GROUP_ID_BYTES];
        self.rng.fill(&mut id[..]);
        let group_id = Bytes::copy_from_slice(&id);
        for f in std::mem::take(&mut self.followers) {
            self.reply(
                f.peer,
                f.request_id,
                ReplyBody::Begin(Begin {
                    group_id: group_id.clone(),
                    members: members.clone(),
                }),
            );
        }
        let me = members
            .iter()
            .position(|m| m.peer == self.me)
            .expect("the leader put itself among the members");
        let group = Group {
            group_id,
            members,
            me,
            leader: self.me.clone(),
            key: self.key.clone(),
        };
        self.finish(State::Assembled, None);
        self.events.push_back(Event::Assembled(group));
    }

    fn disband(&mut self, suggested_leader: Option<PeerId>) {
        for f in std::mem::take(&mut self.followers) {
            self.reply(
                f.peer,
                f.request_id,
                ReplyBody::Disbanded {
                    suggested_leader: suggested_leader.clone(),
                },
            );
        }
    }

    fn drop_follower(&mut self, peer: &PeerId, request_id: Option<u64>) {
        let matches = |p: &PeerId, r: u64| p == peer && request_id.is_none_or(|id| id == r);
        self.followers.retain(|f| !matches(&f.peer, f.request_id));
        self.deferred.retain(|(p, r)| !matches(p, r.request_id));
    }

    /// Ends the step: disbands followers (pointing them to `suggested_leader`), refuses
    /// deferred requests, and writes the leave record.
    fn finish(&mut self, state: State, suggested_leader: Option<PeerId>) {
        self.disband(suggested_leader);
        for (from, req) in std::mem::take(&mut self.deferred) {
            self.reply(
                from,
                req.request_id,
                ReplyBody::Rejected(RejectReason::NotLookingForGroup),
            );
        }
        if let Some(e) = self.declared.take() {
            self.dht.push_back(DhtRequest::Store {
                key: self.key.clone(),
                subkey: declaration_subkey(&self.me),
                value: Bytes::from_static(LEFT_VALUE),
                expiration: e.next_up(),
            });
        }
        self.pending = None;
        self.state = state;
    }

    // ---- follower side ----

    fn on_reply(&mut self, now: DhtTime, from: PeerId, reply: Reply) {
        if self.state != State::Looking {
            return;
        }
        let current = self
            .pending
            .as_ref()
            .is_some_and(|p| p.leader == from && p.request_id == reply.request_id);
        if !current {
            self.on_late_reply(from, reply);
            return;
        }
        match reply.body {
            ReplyBody::Accepted => {
                if let Some(p) = self.pending.as_mut().filter(|p| !p.accepted) {
                    p.accepted = true;
                    // Followers of this peer go to its new leader; deferred ones learn it.
                    self.disband(Some(from.clone()));
                    for (f, req) in std::mem::take(&mut self.deferred) {
                        self.reply(
                            f,
                            req.request_id,
                            ReplyBody::Rejected(RejectReason::NotALeader {
                                suggested_leader: Some(from.clone()),
                            }),
                        );
                    }
                }
            }
            ReplyBody::Begin(begin) => match self.validate_begin(&from, begin) {
                Some(group) => {
                    self.pending = None;
                    self.finish(State::Assembled, None);
                    self.events.push_back(Event::Assembled(group));
                }
                None => self.abandon_pending(),
            },
            ReplyBody::Rejected(_) => self.pending = None,
            ReplyBody::Disbanded { suggested_leader } => {
                self.pending = None;
                if let Some(s) = suggested_leader.filter(|s| *s != self.me && *s != from) {
                    self.send_request(now, s);
                }
            }
        }
    }

    /// A `Begin` for a request this peer gave up on: the leader counts it in, so it joins if
    /// it is still free (not accepted elsewhere).
    fn on_late_reply(&mut self, from: PeerId, reply: Reply) {
        let ReplyBody::Begin(begin) = reply.body else {
            return;
        };
        let ours = self
            .abandoned
            .iter()
            .any(|(p, r)| *p == from && *r == reply.request_id);
        let free = self.pending.as_ref().is_none_or(|p| !p.accepted);
        if !ours || !free {
            return;
        }
        if let Some(group) = self.validate_begin(&from, begin) {
            self.abandon_pending();
            self.finish(State::Assembled, None);
            self.events.push_back(Event::Assembled(group));
        }
    }

    /// The group a `Begin` describes, if it is one this peer can run with: a group id of the
    /// right size, at most [`MAX_GROUP_SIZE`] distinct members including the leader and this
    /// peer with the info it sent, and at least one member that contributes values.
    fn validate_begin(&self, leader: &PeerId, begin: Begin) -> Option<Group> {
        let Begin { group_id, members } = begin;
        if group_id.is_empty() || group_id.len() > crate::wire::MAX_GROUP_ID_BYTES {
            return None;
        }
        if members.is_empty() || members.len() > MAX_GROUP_SIZE {
            return None;
        }
        let distinct: HashSet<&PeerId> = members.iter().map(|m| &m.peer).collect();
        if distinct.len() != members.len() || !distinct.contains(leader) {
            return None;
        }
        let me = members.iter().position(|m| m.peer == self.me)?;
        if members[me].info != self.info || !members.iter().any(|m| m.info.mode.is_sender()) {
            return None;
        }
        Some(Group {
            group_id,
            members,
            me,
            leader: leader.clone(),
            key: self.key.clone(),
        })
    }
}

/// How long after a read a client that found no one to ask reads again, after `fruitless`
/// such reads in a row (at least 1): an eighth of `refresh`, doubling with each, at most
/// `refresh`.
pub(crate) fn client_reread_wait(refresh: Duration, fruitless: u32) -> Duration {
    let shift = fruitless.saturating_sub(1).min(3);
    (refresh / 8).saturating_mul(1 << shift).min(refresh)
}
