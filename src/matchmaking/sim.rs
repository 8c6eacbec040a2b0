//! A deterministic simulator of matchmaking: `N` [`Matchmaker`]s in virtual time, driven only
//! through their public API.
//!
//! * **DHT**: one shared store of [`DhtValue`]s. A store lands `dht_latency` (plus jitter) after
//!   it was issued and merges ([`crate::dht::merge`]); a read looks at the store `dht_latency`
//!   after it was issued (expired writes dropped) and its answer arrives `dht_latency` later.
//! * **Messages** take `latency` plus seeded jitter, FIFO per ordered pair of peers (as on one
//!   stream). A message to a dead peer is lost and its sender hears
//!   [`Matchmaker::handle_unreachable`] one latency later (a failed dial); a peer that dies with
//!   an exchange open is *not* reported to the other side (its stream just goes quiet).
//! * **Timers** fire exactly at [`Matchmaker::poll_timeout`].
//!
//! Faults ([`SimFault`]) kill or cancel a peer at protocol points the simulator sees from
//! outside (a `Begin` it emits, an `Accepted` it receives) or at fixed times. Nothing reads the
//! wall clock: a run is a pure function of its [`SimConfig`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::{
    Config, ConfigError, DhtRequest, Event, Group, GroupKey, Matchmaker, MatchmakingError,
    MemberInfo, Message, Mode, PeerId, RejectReason, ReplyBody, Step,
};
use crate::dht::{DhtTime, DhtValue, merge};

/// Virtual time zero, in seconds since the UNIX epoch (a plausible wall clock, so `f64`
/// expirations have realistic precision).
pub const SIM_EPOCH_SECS: u64 = 1_700_000_000;

/// The wall-clock time `d` after the simulation's start.
pub fn sim_time(d: Duration) -> DhtTime {
    DhtTime::EPOCH.saturating_add(Duration::from_secs(SIM_EPOCH_SECS) + d)
}

/// The virtual time of `t`, as time since the simulation's start.
pub fn since_start(t: DhtTime) -> Duration {
    Duration::from_secs_f64((t.as_secs() - SIM_EPOCH_SECS as f64).max(0.0))
}

/// A fault injected into one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimFault {
    /// Dies the moment it would send its first `Begin` (none is sent).
    DieBeforeBegin,
    /// Dies right after sending its `Begin`s (before writing its leave record).
    DieAfterBegin,
    /// Cancels its step as soon as a leader accepts it.
    LeaveWhenAccepted,
    /// Dies at this time after the start of the simulation.
    DieAt(Duration),
    /// Cancels its step at this time after the start of the simulation.
    CancelAt(Duration),
}

/// One simulated peer.
#[derive(Clone, Debug)]
pub struct SimPeer {
    /// Its id.
    pub id: PeerId,
    /// The key it looks under.
    pub key: GroupKey,
    /// What it brings (mode, bandwidth, addresses, gathered bytes).
    pub info: MemberInfo,
    /// Its schema hash, if it differs from the shared config's.
    pub schema_hash: Option<Bytes>,
    /// When it starts matchmaking, after the start of the simulation.
    pub start: Duration,
    /// Its deadline, after its start (`None`: none).
    pub timeout: Option<Duration>,
    /// Its scheduled time, after the start of the simulation (`None`: the default, its start
    /// plus `min_matchmaking_time`).
    pub scheduled: Option<Duration>,
    /// Injected fault.
    pub fault: Option<SimFault>,
}

impl SimPeer {
    /// A node under `key` starting at time zero with no deadline.
    pub fn new(id: PeerId, key: GroupKey) -> Self {
        Self {
            id,
            key,
            info: MemberInfo::new(Mode::Node),
            schema_hash: None,
            start: Duration::ZERO,
            timeout: None,
            scheduled: None,
            fault: None,
        }
    }
}

/// A simulation scenario.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The peers.
    pub peers: Vec<SimPeer>,
    /// Matchmaking settings shared by every peer.
    pub config: Config,
    /// One-way message latency.
    pub latency: Duration,
    /// Extra latency drawn uniformly from `[0, jitter)` per message and DHT operation.
    pub jitter: Duration,
    /// One-way latency to the DHT.
    pub dht_latency: Duration,
    /// Virtual time after which the run stops.
    pub time_limit: Duration,
    /// Seed of every peer's generator and of the jitter.
    pub seed: u64,
}

impl SimConfig {
    /// `peers` with `config`: 10 ms latency, 5 ms jitter, 20 ms to the DHT, a 10-minute limit.
    pub fn new(peers: Vec<SimPeer>, config: Config, seed: u64) -> Self {
        Self {
            peers,
            config,
            latency: Duration::from_millis(10),
            jitter: Duration::from_millis(5),
            dht_latency: Duration::from_millis(20),
            time_limit: Duration::from_secs(600),
            seed,
        }
    }
}

/// How a peer's step ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SimOutcome {
    /// It is in `group` since `at`.
    Assembled {
        /// The group.
        group: Group,
        /// When (after the start of the simulation).
        at: Duration,
    },
    /// It found no group.
    Failed {
        /// Why.
        error: MatchmakingError,
        /// When.
        at: Duration,
    },
    /// It died (fault).
    Died {
        /// When.
        at: Duration,
    },
    /// Still looking when the simulation stopped (or never started).
    Unfinished,
    /// Its configuration was refused.
    Rejected(ConfigError),
}

/// One peer after the run.
#[derive(Clone, Debug)]
pub struct PeerReport {
    /// Its id.
    pub id: PeerId,
    /// How its step ended.
    pub outcome: SimOutcome,
    /// `Accepted` replies it sent.
    pub accepted_sent: usize,
    /// `Begin` replies it sent.
    pub begins_sent: usize,
    /// Join requests it sent.
    pub joins_sent: usize,
    /// Declarations it stored in the DHT.
    pub declarations: usize,
    /// Rejections it received.
    pub rejections: Vec<RejectReason>,
}

/// A group as the run saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct SimGroup {
    /// Its id.
    pub group_id: Bytes,
    /// Members as peer indices, in the agreed order.
    pub members: Vec<usize>,
    /// The leader's index.
    pub leader: usize,
    /// Members that reported it (the others died).
    pub confirmed: Vec<usize>,
}

/// The result of a run.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// Per peer, in input order.
    pub peers: Vec<PeerReport>,
    /// DHT reads issued.
    pub dht_gets: usize,
    /// Virtual time when the run stopped.
    pub end: Duration,
    /// Set if a machine asked to be woken at or before a time it was just woken at (a bug).
    pub stuck: Option<String>,
}

impl SimResult {
    /// The groups, checked for consistency: every member that reported a group reported the
    /// same id, order, leader and key and sits at its own index; every member of a reported
    /// group either reported it or died; no peer is in two groups.
    pub fn groups(&self) -> Result<Vec<SimGroup>, String> {
        let index: HashMap<&PeerId, usize> = self
            .peers
            .iter()
            .enumerate()
            .map(|(i, p)| (&p.id, i))
            .collect();
        let mut by_id: BTreeMap<Bytes, (Group, Vec<usize>)> = BTreeMap::new();
        for (i, p) in self.peers.iter().enumerate() {
            let SimOutcome::Assembled { group, .. } = &p.outcome else {
                continue;
            };
            if group.members.get(group.me).map(|m| &m.peer) != Some(&p.id) {
                return Err(format!("peer {i} is not at its own index {}", group.me));
            }
            match by_id.get_mut(&group.group_id) {
                None => {
                    by_id.insert(group.group_id.clone(), (group.clone(), vec![i]));
                }
                Some((first, confirmed)) => {
                    let same = first.members == group.members
                        && first.leader == group.leader
                        && first.key == group.key;
                    if !same {
                        return Err(format!("peer {i} disagrees on group {:?}", group.group_id));
                    }
                    confirmed.push(i);
                }
            }
        }
        let mut seen: HashMap<usize, Bytes> = HashMap::new();
        let mut out = Vec::new();
        for (id, (group, confirmed)) in by_id {
            let mut members = Vec::new();
            for m in &group.members {
                let &i = index
                    .get(&m.peer)
                    .ok_or_else(|| format!("group member {} is not a peer", m.peer))?;
                if let Some(other) = seen.insert(i, id.clone()) {
                    return Err(format!("peer {i} is in groups {other:?} and {id:?}"));
                }
                let reported = confirmed.contains(&i);
                let died = matches!(self.peers[i].outcome, SimOutcome::Died { .. });
                if !reported && !died {
                    return Err(format!(
                        "peer {i} is in group {id:?} but ended {:?}",
                        self.peers[i].outcome
                    ));
                }
                members.push(i);
            }
            let leader = *index.get(&group.leader).ok_or("unknown leader")?;
            out.push(SimGroup {
                group_id: id,
                members,
                leader,
                confirmed,
            });
        }
        Ok(out)
    }
}

#[derive(Debug)]
enum SimEvent {
    Start(usize),
    Deliver {
        to: usize,
        from: usize,
        message: Message,
    },
    Unreachable {
        peer: usize,
        target: usize,
    },
    DhtApply {
        key: GroupKey,
        value: DhtValue,
    },
    DhtRead {
        peer: usize,
        id: u64,
        key: GroupKey,
    },
    DhtAnswer {
        peer: usize,
        id: u64,
        value: Option<DhtValue>,
    },
    Kill(usize),
    Cancel(usize),
}

struct Node {
    machine: Option<Matchmaker>,
    alive: bool,
    left_when_accepted: bool,
    report: PeerReport,
}

struct Sim {
    cfg: SimConfig,
    nodes: Vec<Node>,
    index: HashMap<PeerId, usize>,
    queue: BTreeMap<(DhtTime, u64), SimEvent>,
    seq: u64,
    links: HashMap<(usize, usize), DhtTime>,
    store: HashMap<GroupKey, DhtValue>,
    rng: StdRng,
    now: DhtTime,
    dht_gets: usize,
}

/// Runs a scenario.
pub fn run(cfg: SimConfig) -> SimResult {
    let mut sim = Sim {
        nodes: cfg
            .peers
            .iter()
            .map(|p| Node {
                machine: None,
                alive: true,
                left_when_accepted: false,
                report: PeerReport {
                    id: p.id.clone(),
                    outcome: SimOutcome::Unfinished,
                    accepted_sent: 0,
                    begins_sent: 0,
                    joins_sent: 0,
                    declarations: 0,
                    rejections: Vec::new(),
                },
            })
            .collect(),
        index: cfg
            .peers
            .iter()
            .enumerate()
            .map(|(i, p)| (p.id.clone(), i))
            .collect(),
        queue: BTreeMap::new(),
        seq: 0,
        links: HashMap::new(),
        store: HashMap::new(),
        rng: StdRng::seed_from_u64(cfg.seed ^ 0x6d61_7463_686d_616b),
        now: sim_time(Duration::ZERO),
        dht_gets: 0,
        cfg,
    };
    for i in 0..sim.nodes.len() {
        let p = &sim.cfg.peers[i];
        let (start, fault) = (p.start, p.fault);
        sim.schedule(sim_time(start), SimEvent::Start(i));
        match fault {
            Some(SimFault::DieAt(t)) => sim.schedule(sim_time(t), SimEvent::Kill(i)),
            Some(SimFault::CancelAt(t)) => sim.schedule(sim_time(t), SimEvent::Cancel(i)),
            _ => {}
        }
    }
    let stuck = sim.run_loop();
    SimResult {
        end: since_start(sim.now),
        dht_gets: sim.dht_gets,
        peers: sim.nodes.into_iter().map(|n| n.report).collect(),
        stuck,
    }
}

impl Sim {
    fn schedule(&mut self, at: DhtTime, ev: SimEvent) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    fn jitter(&mut self) -> Duration {
        let j = self.cfg.jitter.as_secs_f64();
        if j > 0.0 {
            Duration::from_secs_f64(self.rng.random_range(0.0..j))
        } else {
            Duration::ZERO
        }
    }

    fn run_loop(&mut self) -> Option<String> {
        let limit = sim_time(self.cfg.time_limit);
        loop {
            let timer = self
                .nodes
                .iter()
                .filter(|n| n.alive)
                .filter_map(|n| n.machine.as_ref()?.poll_timeout())
                .min();
            let event = self.queue.first_key_value().map(|(k, _)| k.0);
            let next = match (timer, event) {
                (None, None) => return None,
                (Some(t), None) | (None, Some(t)) => t,
                (Some(a), Some(b)) => a.min(b),
            };
            if next > limit {
                return None;
            }
            if next < self.now {
                return Some(format!(
                    "a machine asked for {next} after it was woken at {}",
                    self.now
                ));
            }
            self.now = next;
            if event == Some(next) {
                if let Some((_, ev)) = self.queue.pop_first() {
                    self.process(ev);
                }
                continue;
            }
            for i in 0..self.nodes.len() {
                let due = self.nodes[i].alive
                    && self.nodes[i]
                        .machine
                        .as_ref()
                        .and_then(Matchmaker::poll_timeout)
                        .is_some_and(|t| t <= self.now);
                if due {
                    let now = self.now;
                    if let Some(m) = self.nodes[i].machine.as_mut() {
                        m.handle_timeout(now);
                        if m.poll_timeout().is_some_and(|t| t <= now) {
                            return Some(format!("peer {i} stays due at {now} after a timeout"));
                        }
                    }
                    self.flush(i);
                }
            }
        }
    }

    fn process(&mut self, ev: SimEvent) {
        let now = self.now;
        match ev {
            SimEvent::Start(i) => {
                let p = &self.cfg.peers[i];
                let mut config = self.cfg.config.clone();
                if let Some(h) = &p.schema_hash {
                    config.schema_hash = h.clone();
                }
                let step = Step {
                    key: p.key.clone(),
                    info: p.info.clone(),
                    scheduled_time: p.scheduled.map(sim_time),
                    deadline: p.timeout.map(|t| now.saturating_add(t)),
                    contact: Bytes::new(),
                };
                let mut rng = StdRng::seed_from_u64(self.cfg.seed.wrapping_add(i as u64 + 1));
                if !self.nodes[i].alive {
                    return;
                }
                match Matchmaker::new(p.id.clone(), config, step, now, &mut rng) {
                    Ok(m) => self.nodes[i].machine = Some(m),
                    Err(e) => self.nodes[i].report.outcome = SimOutcome::Rejected(e),
                }
                self.flush(i);
            }
            SimEvent::Deliver { to, from, message } => {
                if !self.nodes[to].alive {
                    if self.nodes[from].alive {
                        let at = now.saturating_add(self.cfg.latency);
                        self.schedule(
                            at,
                            SimEvent::Unreachable {
                                peer: from,
                                target: to,
                            },
                        );
                    }
                    return;
                }
                let accepted = matches!(
                    &message,
                    Message::Reply(r) if r.body == ReplyBody::Accepted
                );
                if let Message::Reply(r) = &message
                    && let ReplyBody::Rejected(reason) = &r.body
                {
                    self.nodes[to].report.rejections.push(reason.clone());
                }
                let from_id = self.cfg.peers[from].id.clone();
                let leave = accepted
                    && self.cfg.peers[to].fault == Some(SimFault::LeaveWhenAccepted)
                    && !self.nodes[to].left_when_accepted;
                if let Some(m) = self.nodes[to].machine.as_mut() {
                    m.handle_message(now, from_id, message);
                    if leave {
                        m.cancel(now);
                    }
                }
                if leave {
                    self.nodes[to].left_when_accepted = true;
                }
                self.flush(to);
            }
            SimEvent::Unreachable { peer, target } => {
                let target = self.cfg.peers[target].id.clone();
                if self.nodes[peer].alive
                    && let Some(m) = self.nodes[peer].machine.as_mut()
                {
                    m.handle_unreachable(now, &target);
                    self.flush(peer);
                }
            }
            SimEvent::DhtApply { key, value } => {
                let merged = match self.store.remove(&key) {
                    Some(old) => merge(old, value),
                    None => value,
                };
                if let Some(v) = merged.without_expired(now) {
                    self.store.insert(key, v);
                }
            }
            SimEvent::DhtRead { peer, id, key } => {
                let value = self
                    .store
                    .get(&key)
                    .cloned()
                    .and_then(|v| v.without_expired(now));
                let at = now.saturating_add(self.cfg.dht_latency + self.jitter());
                self.schedule(at, SimEvent::DhtAnswer { peer, id, value });
            }
            SimEvent::DhtAnswer { peer, id, value } => {
                if self.nodes[peer].alive
                    && let Some(m) = self.nodes[peer].machine.as_mut()
                {
                    m.handle_dht_get(now, id, value);
                    self.flush(peer);
                }
            }
            SimEvent::Kill(i) => self.kill(i),
            SimEvent::Cancel(i) => {
                if self.nodes[i].alive
                    && let Some(m) = self.nodes[i].machine.as_mut()
                {
                    m.cancel(now);
                    self.flush(i);
                }
            }
        }
    }

    fn kill(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if !node.alive {
            return;
        }
        node.alive = false;
        node.machine = None;
        if matches!(node.report.outcome, SimOutcome::Unfinished) {
            node.report.outcome = SimOutcome::Died {
                at: since_start(self.now),
            };
        }
    }

    /// Moves everything peer `i`'s machine wants done into the simulation.
    fn flush(&mut self, i: usize) {
        let now = self.now;
        let fault = self.cfg.peers[i].fault;
        let mut die_now = false;
        loop {
            let Some(tx) = self.nodes[i]
                .machine
                .as_mut()
                .and_then(Matchmaker::poll_transmit)
            else {
                break;
            };
            let begin =
                matches!(&tx.message, Message::Reply(r) if matches!(r.body, ReplyBody::Begin(_)));
            if begin && fault == Some(SimFault::DieBeforeBegin) {
                self.kill(i);
                return;
            }
            die_now |= begin && fault == Some(SimFault::DieAfterBegin);
            let report = &mut self.nodes[i].report;
            match &tx.message {
                Message::Join(_) => report.joins_sent += 1,
                Message::Reply(r) => match r.body {
                    ReplyBody::Accepted => report.accepted_sent += 1,
                    ReplyBody::Begin(_) => report.begins_sent += 1,
                    _ => {}
                },
                Message::Leave { .. } => {}
            }
            let Some(&to) = self.index.get(&tx.to) else {
                continue;
            };
            let base = now.saturating_add(self.cfg.latency + self.jitter());
            let link = self.links.entry((i, to)).or_insert(base);
            let at = base.max(*link);
            *link = at;
            self.schedule(
                at,
                SimEvent::Deliver {
                    to,
                    from: i,
                    message: tx.message,
                },
            );
        }
        if die_now {
            self.kill(i);
            return;
        }
        loop {
            let Some(req) = self.nodes[i]
                .machine
                .as_mut()
                .and_then(Matchmaker::poll_dht)
            else {
                break;
            };
            let at = now.saturating_add(self.cfg.dht_latency + self.jitter());
            match req {
                DhtRequest::Store {
                    key,
                    subkey,
                    value,
                    expiration,
                } => {
                    if super::is_declared(&value) {
                        self.nodes[i].report.declarations += 1;
                    }
                    let value = DhtValue::subkey(subkey, value, expiration);
                    self.schedule(at, SimEvent::DhtApply { key, value });
                }
                DhtRequest::Get { id, key } => {
                    self.dht_gets += 1;
                    self.schedule(at, SimEvent::DhtRead { peer: i, id, key });
                }
            }
        }
        loop {
            let Some(ev) = self.nodes[i]
                .machine
                .as_mut()
                .and_then(Matchmaker::poll_event)
            else {
                break;
            };
            let at = since_start(now);
            self.nodes[i].report.outcome = match ev {
                Event::Assembled(group) => SimOutcome::Assembled { group, at },
                Event::Failed(error) => SimOutcome::Failed { error, at },
            };
        }
    }
}
