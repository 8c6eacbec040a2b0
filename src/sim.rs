//! A deterministic simulator: `N` peers run [`Butterfly`] rounds in virtual time.
//!
//! Each peer has an uplink of fixed bandwidth that serialises its outgoing messages in order,
//! with a bounded backlog (a full backlog makes [`Butterfly::poll_transmit`] hold its parts
//! back, as a full socket would); every message then takes the link latency (plus seeded
//! jitter, never reordering one link) to arrive. Timers fire exactly at the machines'
//! deadlines. Nothing reads the wall clock, so a run is a pure function of its [`SimConfig`].
//!
//! Faults ([`Fault`]) mirror hivemind's `test_fault_tolerance` injections; `R` is the last peer
//! (other than the faulty one) with a non-empty span:
//!
//! | fault | effect |
//! |---|---|
//! | `fail-before` | the peer never starts |
//! | `fail-sending` | after its first part to `R`, its stream to `R` breaks (both ends see it) |
//! | `slow-sending` | after its first part to `R`, its further parts to `R` wait `slow_pause` |
//! | `fail-reducing` | after 3 replies to a sender, it aborts that sender with an internal error |
//! | `slow-reducing` | after 3 replies to a sender, its further replies to it wait `slow_pause` |
//! | `cancel` | the peer cancels its round at the start |
//! | `corrupt-sending` | after its first part to `R`, its parts to `R` arrive truncated |
//! | `corrupt-reducing` | after 3 replies to a sender, its replies arrive truncated |
//! | `crash` | at its 4th reply to any sender it dies (as a killed process): it sends nothing more, what it had queued is lost, and every peer's links to it fail one latency later |
//! | `crash-standing-in` | dies as `crash` does, at its 2nd reply for a part outside its own span (as the stand-in of a failed reducer) |
//!
//! A peer may also begin its round late ([`SimConfig::start_delay`], as a member still linking
//! does): what reaches it before waits on its links, in order.
//!
//! [`SimResult::check`] compares every finished sender's values with the weighted mean over
//! exactly the contributors that its round report names, part by part.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::allreduce::{
    Aggregator, Butterfly, Member, Message, Mode, Outcome, Partition, PeerSet, Role, RoundConfig,
    RoundError, RoundEvent, TensorDescriptor, Transmit,
};
use crate::tensor::{Tensor, TensorError};

/// Fault injected into one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Never starts.
    FailBefore,
    /// Its stream to the last reducer breaks after the first part.
    FailSending,
    /// Its parts to the last reducer stall after the first one.
    SlowSending,
    /// Aborts each sender after 3 replies.
    FailReducing,
    /// Stalls each sender's replies after 3.
    SlowReducing,
    /// Cancels its round at the start.
    Cancel,
    /// After its first part to the last reducer, sends it truncated payloads.
    CorruptSending,
    /// After 3 replies to a sender, sends it replies with truncated payloads.
    CorruptReducing,
    /// Dies at its 4th reply to any sender: nothing more leaves it, and every peer's links
    /// to it fail (a killed process's connections reset).
    Crash,
    /// Dies as [`Fault::Crash`] does, at its 2nd reply for a part outside its own span (while
    /// standing in for a failed reducer).
    CrashStandingIn,
}

impl Fault {
    /// All faults.
    pub const ALL: [Self; 10] = [
        Self::FailBefore,
        Self::FailSending,
        Self::SlowSending,
        Self::FailReducing,
        Self::SlowReducing,
        Self::Cancel,
        Self::CorruptSending,
        Self::CorruptReducing,
        Self::Crash,
        Self::CrashStandingIn,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Self::FailBefore => "fail-before",
            Self::FailSending => "fail-sending",
            Self::SlowSending => "slow-sending",
            Self::FailReducing => "fail-reducing",
            Self::SlowReducing => "slow-reducing",
            Self::Cancel => "cancel",
            Self::CorruptSending => "corrupt-sending",
            Self::CorruptReducing => "corrupt-reducing",
            Self::Crash => "crash",
            Self::CrashStandingIn => "crash-standing-in",
        }
    }
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|f| f.name()).collect();
                format!(
                    "unknown fault '{s}' (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// One simulated peer.
#[derive(Clone, Debug, PartialEq)]
pub struct SimPeer {
    /// Mode.
    pub mode: Mode,
    /// Averaging weight.
    pub weight: f64,
    /// Share of the reduction (forced to 0 for clients).
    pub fraction: f64,
    /// Injected fault.
    pub fault: Option<Fault>,
}

impl SimPeer {
    /// A healthy node with weight 1 and fraction 1.
    pub fn node() -> Self {
        Self {
            mode: Mode::Node,
            weight: 1.0,
            fraction: 1.0,
            fault: None,
        }
    }
}

/// A simulation scenario.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The group, in order.
    pub peers: Vec<SimPeer>,
    /// Round parameters (members, `me` and `weight` are filled in per peer).
    pub round: RoundConfig,
    /// One-way latency of every link.
    pub latency: Duration,
    /// Extra latency drawn uniformly from `[0, jitter)` per message (links stay FIFO).
    pub jitter: Duration,
    /// Uplink bandwidth of every peer, bytes per second.
    pub bandwidth: f64,
    /// Per-peer uplink bandwidth overriding `bandwidth` (peer `i` uses entry `i` where there
    /// is one).
    pub peer_bandwidth: Vec<f64>,
    /// Uplink backlog, in bytes, beyond which a peer's machine is not asked for more.
    pub uplink_buffer_bytes: usize,
    /// How long the slow faults stall.
    pub slow_pause: Duration,
    /// Virtual time after which the run stops (peers still running count as unfinished).
    pub time_limit: Duration,
    /// Seed for data and jitter.
    pub seed: u64,
    /// Per peer, how long after the others it begins its round (entry `i` for peer `i`; none:
    /// at once), as a member still linking does: what reaches it before waits on its links,
    /// and its `start_grace` is what is left of `round.start_grace` (as the averager's is
    /// what is left of its link timeout).
    pub start_delay: Vec<Duration>,
}

impl SimConfig {
    /// `peers` healthy nodes with defaults: 5 ms latency, 1 ms jitter, 1 GB/s uplinks,
    /// 0.5 s sender and 1 s reducer timeouts, stand-ins on, slow faults stalling 10 s, a
    /// 10-minute limit.
    pub fn new(peers: Vec<SimPeer>, seed: u64) -> Self {
        let members = peers
            .iter()
            .map(|p| Member {
                mode: p.mode,
                fraction: p.fraction,
            })
            .collect();
        let mut round = RoundConfig::new(members, 0);
        round.stand_ins = true;
        round.sender_timeout = Duration::from_millis(500);
        round.reducer_timeout = Duration::from_millis(1000);
        Self {
            peers,
            round,
            latency: Duration::from_millis(5),
            jitter: Duration::from_millis(1),
            bandwidth: 1e9,
            peer_bandwidth: Vec::new(),
            uplink_buffer_bytes: 4 << 20,
            slow_pause: Duration::from_secs(10),
            time_limit: Duration::from_secs(600),
            seed,
            start_delay: Vec::new(),
        }
    }
}

/// How a peer's round ended.
#[derive(Clone, Debug, PartialEq)]
pub enum PeerStatus {
    /// Finished at this virtual time after the start.
    Finished(Duration),
    /// Cancelled (fault `cancel`).
    Cancelled,
    /// Never started (fault `fail-before`).
    NotStarted,
    /// Still running when the simulation stopped.
    Unfinished,
    /// Its round could not start.
    Rejected(RoundError),
    /// Died mid-round (fault `crash`), at this virtual time after the start.
    Crashed(Duration),
}

/// One peer after the run.
#[derive(Debug)]
pub struct PeerResult {
    /// How its round ended.
    pub status: PeerStatus,
    /// Its values at the start (empty if its round was rejected).
    pub tensors: Vec<Tensor>,
    /// Its outcome, if it finished.
    pub outcome: Option<Outcome>,
    /// Its machine's events, with the virtual time after the start at which they came out.
    pub events: Vec<(Duration, RoundEvent)>,
}

/// The result of a simulation.
#[derive(Debug)]
pub struct SimResult {
    /// Per peer, in group order.
    pub peers: Vec<PeerResult>,
    /// Virtual time when the last event was processed.
    pub elapsed: Duration,
    /// Weights used.
    pub weights: Vec<f64>,
    /// The partition every peer used.
    pub partition: Partition,
    /// How reducers combined contributions (what [`SimResult::check`] expects).
    pub aggregator: Aggregator,
    /// Per peer, the payload bytes it put on its uplink (parts and replies; framing not
    /// counted).
    pub payload_bytes_sent: Vec<u64>,
}

/// Deviation of one peer from what its report promises.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerCheck {
    /// Largest `|result − expected|` over all elements (0 for aux peers).
    pub max_abs_err: f32,
    /// Elements whose value is the average of at least one other peer.
    pub averaged_elements: usize,
    /// All elements.
    pub total_elements: usize,
}

impl SimResult {
    /// Peers whose round finished.
    pub fn finished(&self) -> usize {
        self.peers
            .iter()
            .filter(|p| matches!(p.status, PeerStatus::Finished(_)))
            .count()
    }

    /// For every finished peer, its deviation from the weighted mean over the contributors its
    /// report names (or from its own start values where the report says "local").
    pub fn check(&self) -> Vec<Option<PeerCheck>> {
        // expected values, cached per (part, contributor set)
        let mut cache: BTreeMap<(usize, Vec<u64>), Vec<f32>> = BTreeMap::new();
        let mut checks = Vec::with_capacity(self.peers.len());
        for p in &self.peers {
            let (PeerStatus::Finished(_), Some(outcome)) = (&p.status, &p.outcome) else {
                checks.push(None);
                continue;
            };
            if outcome.results.is_none() {
                checks.push(Some(PeerCheck {
                    max_abs_err: 0.0,
                    averaged_elements: 0,
                    total_elements: 0,
                }));
                continue;
            };
            let mut max_err = 0.0f32;
            let mut averaged = 0;
            let mut total = 0;
            let mut result = Vec::new();
            for span in &outcome.report.spans {
                for seg in &span.segments {
                    for g in seg.parts.clone() {
                        let spec = *self.partition.part(g);
                        let own = p.tensors[spec.tensor].part(spec.range());
                        result.resize(spec.len, 0.0);
                        if outcome.result_into(g, &p.tensors, &mut result).is_none() {
                            max_err = f32::NAN;
                            continue;
                        }
                        total += spec.len;
                        let expected: Option<&Vec<f32>> = match &seg.contributors {
                            None => None,
                            Some(c) => {
                                if c.len() > 1 {
                                    averaged += spec.len;
                                }
                                let key = (g, c.words().to_vec());
                                if !cache.contains_key(&key) {
                                    let v = self.expected(g, c);
                                    cache.insert(key.clone(), v);
                                }
                                cache.get(&key)
                            }
                        };
                        let own_f32;
                        let own: &[f32] = match own {
                            crate::tensor::PartView::F32(x) => x,
                            other => {
                                let mut v = vec![0.0; other.len()];
                                other.copy_to_f32(&mut v);
                                own_f32 = v;
                                &own_f32
                            }
                        };
                        // max with f32::max (vectorises) plus a sum that turns NaN into NaN.
                        let want: &[f32] = expected.map_or(own, |e| &e[..]);
                        let (err, poison) =
                            result
                                .iter()
                                .zip(want)
                                .fold((0.0f32, 0.0f32), |(m, s), (r, w)| {
                                    let diff = r - w;
                                    (m.max(diff.abs()), s + diff * 0.0)
                                });
                        let err = if poison.is_nan() { f32::NAN } else { err };
                        max_err = max_nan(max_err, err);
                    }
                }
            }
            checks.push(Some(PeerCheck {
                max_abs_err: max_err,
                averaged_elements: averaged,
                total_elements: total,
            }));
        }
        checks
    }

    /// The largest deviation over all finished peers (0 if none finished).
    pub fn max_abs_err(&self) -> f32 {
        self.check()
            .into_iter()
            .flatten()
            .map(|c| c.max_abs_err)
            .fold(0.0, f32::max)
    }

    /// What part `g` averaged over `contributors` must be: the weighted mean in f64, or
    /// CenteredClip over the contributors' values when the run used it.
    fn expected(&self, g: usize, contributors: &PeerSet) -> Vec<f32> {
        let spec = *self.partition.part(g);
        let values: Vec<(Vec<f32>, f64)> = contributors
            .iter()
            .map(|c| {
                let mut v = vec![0.0f32; spec.len];
                self.peers[c].tensors[spec.tensor]
                    .part(spec.range())
                    .copy_to_f32(&mut v);
                (v, self.weights[c])
            })
            .collect();
        if let Aggregator::CenteredClip(clip) = self.aggregator {
            let inputs: Vec<(&[f32], f64)> = values
                .iter()
                .filter(|(_, w)| *w > 0.0)
                .map(|(v, w)| (&v[..], *w))
                .collect();
            let mut out = vec![0.0f32; spec.len];
            clip.aggregate(&inputs, &mut out);
            return out;
        }
        let mut acc = vec![0.0f64; spec.len];
        let mut den = 0.0f64;
        for (x, w) in &values {
            den += w;
            for (a, &v) in acc.iter_mut().zip(x) {
                *a += w * v as f64;
            }
        }
        acc.into_iter().map(|a| (a / den) as f32).collect()
    }
}

/// `max` that propagates NaN (as infinity, so that it is never "below" a bound).
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::INFINITY
    } else {
        a.max(b)
    }
}

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn peer_state(seed: u64, peer: usize) -> u64 {
    seed ^ (peer as u64).wrapping_mul(GAMMA) ^ 0xD1B5_4A32_D192_ED03
}

/// SplitMix64's output for a state.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit_value(bits: u32, peer: usize) -> f32 {
    let unit = (bits >> 8) as f32 / (1u32 << 24) as f32;
    unit * 2.0 - 1.0 + peer as f32 * 0.25
}

/// Deterministic pseudo-random tensors for peer `peer`: values uniform in `[-1, 1)` plus a
/// per-peer offset of `0.25 · peer`, so that means differ visibly between peers. Element `e` of
/// the first tensor is also [`generated_value`]`(seed, peer, e)`, without generating the rest.
pub fn make_tensors(
    descriptors: &[TensorDescriptor],
    seed: u64,
    peer: usize,
) -> Result<Vec<Tensor>, TensorError> {
    let mut state = peer_state(seed, peer);
    descriptors
        .iter()
        .map(|d| {
            let n = d.numel();
            let mut values = Vec::with_capacity(n);
            while values.len() < n {
                // SplitMix64: fast, random-access, good enough for test data.
                state = state.wrapping_add(GAMMA);
                let z = mix(state);
                for half in [z as u32, (z >> 32) as u32] {
                    if values.len() < n {
                        values.push(unit_value(half, peer));
                    }
                }
            }
            match d.dtype {
                crate::tensor::DType::F32 => Tensor::from_f32(&d.shape, values),
                other => Tensor::from_f32_as(&d.shape, &values, other),
            }
        })
        .collect()
}

/// Element `element` of the first tensor that [`make_tensors`] generates for `peer` (f32
/// tensors), computed directly.
pub fn generated_value(seed: u64, peer: usize, element: usize) -> f32 {
    let k = (element / 2) as u64 + 1;
    let z = mix(peer_state(seed, peer).wrapping_add(GAMMA.wrapping_mul(k)));
    let bits = if element.is_multiple_of(2) {
        z as u32
    } else {
        (z >> 32) as u32
    };
    unit_value(bits, peer)
}

/// The message with its payload cut short by one byte (or one junk byte if it was empty).
fn truncated(mut t: Transmit) -> Transmit {
    let cut = |b: &bytes::Bytes| {
        if b.is_empty() {
            bytes::Bytes::from_static(&[0xAB])
        } else {
            b.slice(..b.len() - 1)
        }
    };
    match &mut t.message {
        Message::Part(p) => p.payload = cut(&p.payload),
        Message::Averaged(a) => a.payload = cut(&a.payload),
        Message::Abort { .. } | Message::Notice { .. } => {}
    }
    t
}

enum Ev {
    Deliver {
        to: usize,
        from: usize,
        message: Message,
    },
    LinkFailed {
        at: usize,
        peer: usize,
        /// `None`: both roles (the peer is gone).
        role: Option<Role>,
    },
    Timer {
        peer: usize,
    },
    Wake {
        peer: usize,
    },
    Release {
        from: usize,
        transmit: Transmit,
    },
}

struct Uplink {
    free_at: Instant,
    last_arrival: Vec<Instant>,
    wake_at: Option<Instant>,
}

/// Per-peer fault bookkeeping.
#[derive(Default)]
struct FaultState {
    parts_to_target: usize,
    replies_to: Vec<usize>,
    aborted: Vec<bool>,
    stalled: Vec<bool>,
    /// Replies sent to anyone (fault `crash`).
    replies: usize,
}

/// Message overhead on the wire beyond the payload (framing, headers), for bandwidth.
const MESSAGE_OVERHEAD_BYTES: usize = 64;

struct World<'a> {
    cfg: &'a SimConfig,
    start: Instant,
    now: Instant,
    seq: u64,
    queue: BTreeMap<(Instant, u64), Ev>,
    machines: Vec<Option<Butterfly>>,
    uplinks: Vec<Uplink>,
    timers: Vec<Option<Instant>>,
    status: Vec<PeerStatus>,
    faults: Vec<FaultState>,
    target: Vec<Option<usize>>,
    /// Per peer, its own span.
    spans: Vec<std::ops::Range<usize>>,
    /// Per crashed peer, the values it started with (the reports of others may name it).
    remains: Vec<Option<Vec<Tensor>>>,
    rng: StdRng,
    payload_bytes_sent: Vec<u64>,
    events: Vec<Vec<(Duration, RoundEvent)>>,
    /// Per peer, when its round begins ([`SimConfig::start_delay`]).
    started_at: Vec<Instant>,
}

impl World<'_> {
    fn push(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    fn fault(&self, p: usize) -> Option<Fault> {
        self.cfg.peers[p].fault
    }

    /// Puts a message on `from`'s uplink.
    fn send(&mut self, from: usize, t: Transmit) {
        self.payload_bytes_sent[from] += t.message.payload_len() as u64;
        let bytes = t.message.payload_len() + MESSAGE_OVERHEAD_BYTES;
        let rate = self.bandwidth(from);
        let up = &mut self.uplinks[from];
        let start = up.free_at.max(self.now);
        let done = start + Duration::from_secs_f64(bytes as f64 / rate);
        up.free_at = done;
        let jitter = if self.cfg.jitter.is_zero() {
            Duration::ZERO
        } else {
            self.cfg.jitter.mul_f64(self.rng.random::<f64>())
        };
        let arrive = (done + self.cfg.latency + jitter).max(up.last_arrival[t.to]);
        up.last_arrival[t.to] = arrive;
        self.push(
            arrive,
            Ev::Deliver {
                to: t.to,
                from,
                message: t.message,
            },
        );
    }

    fn bandwidth(&self, p: usize) -> f64 {
        self.cfg
            .peer_bandwidth
            .get(p)
            .copied()
            .unwrap_or(self.cfg.bandwidth)
    }

    fn backlog_limit(&self, p: usize) -> Duration {
        Duration::from_secs_f64(self.cfg.uplink_buffer_bytes as f64 / self.bandwidth(p))
    }

    /// Sends `t` from `p` only after the slow faults' pause.
    fn hold(&mut self, p: usize, t: Transmit) {
        let at = self.now + self.cfg.slow_pause;
        self.push(
            at,
            Ev::Release {
                from: p,
                transmit: t,
            },
        );
    }

    /// Applies peer `p`'s fault to an outgoing message: send it now, later, or not at all.
    fn route(&mut self, p: usize, t: Transmit) {
        match (self.fault(p), &t.message) {
            (Some(Fault::FailSending | Fault::SlowSending), Message::Part(_))
                if Some(t.to) == self.target[p] =>
            {
                let n = self.faults[p].parts_to_target;
                self.faults[p].parts_to_target += 1;
                if n == 0 {
                    let to = t.to;
                    self.send(p, t);
                    if self.fault(p) == Some(Fault::FailSending) {
                        // The stream breaks right after the first part: both ends notice.
                        let arrive = self.uplinks[p].last_arrival[to];
                        self.push(
                            arrive,
                            Ev::LinkFailed {
                                at: to,
                                peer: p,
                                role: Some(Role::Sender),
                            },
                        );
                        let now = self.now;
                        if let Some(m) = self.machines[p].as_mut() {
                            m.handle_link_failed(now, to, Some(Role::Reducer));
                        }
                    }
                } else if self.fault(p) == Some(Fault::SlowSending) {
                    self.hold(p, t);
                }
            }
            // A stalled reducer is silent towards that sender: its replies and its abort (when
            // its own timers give up on the sender) arrive only after the pause, so the
            // sender has to notice through its reducer timeout.
            (
                Some(Fault::SlowReducing),
                Message::Abort {
                    role: Role::Reducer,
                    ..
                },
            ) if self.faults[p].stalled[t.to] => {
                self.hold(p, t);
            }
            (Some(Fault::FailReducing | Fault::SlowReducing), Message::Averaged(_)) => {
                let n = self.faults[p].replies_to[t.to];
                self.faults[p].replies_to[t.to] += 1;
                if n < 3 {
                    self.send(p, t);
                } else if self.fault(p) == Some(Fault::SlowReducing) {
                    self.faults[p].stalled[t.to] = true;
                    self.hold(p, t);
                } else if !self.faults[p].aborted[t.to] {
                    self.faults[p].aborted[t.to] = true;
                    self.send(
                        p,
                        Transmit {
                            to: t.to,
                            message: Message::Abort {
                                role: Role::Reducer,
                                reason: crate::allreduce::AbortReason::Internal,
                            },
                        },
                    );
                }
            }
            (Some(Fault::CorruptSending), Message::Part(_)) if Some(t.to) == self.target[p] => {
                let n = self.faults[p].parts_to_target;
                self.faults[p].parts_to_target += 1;
                self.send(p, if n == 0 { t } else { truncated(t) });
            }
            (Some(Fault::Crash), Message::Averaged(_)) => {
                self.faults[p].replies += 1;
                if self.faults[p].replies > 3 {
                    self.crash(p);
                } else {
                    self.send(p, t);
                }
            }
            (Some(Fault::CrashStandingIn), Message::Averaged(a))
                if !self.spans[p].contains(&(a.part as usize)) =>
            {
                self.faults[p].replies += 1;
                if self.faults[p].replies > 1 {
                    self.crash(p);
                } else {
                    self.send(p, t);
                }
            }
            (Some(Fault::CorruptReducing), Message::Averaged(_)) => {
                let n = self.faults[p].replies_to[t.to];
                self.faults[p].replies_to[t.to] += 1;
                self.send(p, if n < 3 { t } else { truncated(t) });
            }
            _ => self.send(p, t),
        }
    }

    /// Peer `p` dies now: its machine is gone, the messages still on its uplink are lost, and
    /// every other peer sees its link to `p` fail one latency later.
    fn crash(&mut self, p: usize) {
        if let Some(m) = self.machines[p].take() {
            self.remains[p] = Some(m.tensors().to_vec());
        }
        self.timers[p] = None;
        self.status[p] = PeerStatus::Crashed(self.now - self.start);
        let gone = self.now;
        self.queue.retain(|(at, _), ev| {
            !matches!(ev, Ev::Deliver { from, .. } if *from == p && *at > gone)
                && !matches!(ev, Ev::Release { from, .. } if *from == p)
        });
        let at = self.now + self.cfg.latency;
        for q in (0..self.machines.len()).filter(|&q| q != p) {
            self.push(
                at,
                Ev::LinkFailed {
                    at: q,
                    peer: p,
                    role: None,
                },
            );
        }
    }

    /// Lets peer `p` transmit while its uplink has room, then records events and timers.
    fn pump(&mut self, p: usize) {
        if self.now < self.started_at[p] {
            return; // not begun yet: woken when it does
        }
        let limit = self.backlog_limit(p);
        loop {
            let now = self.now;
            let ready = self.uplinks[p].free_at.saturating_duration_since(now) <= limit;
            if !ready {
                let at = self.uplinks[p].free_at - limit;
                if self.uplinks[p].wake_at != Some(at) {
                    self.uplinks[p].wake_at = Some(at);
                    self.push(at, Ev::Wake { peer: p });
                }
                break;
            }
            let Some(m) = self.machines[p].as_mut() else {
                return;
            };
            match m.poll_transmit(now, |_| true) {
                Some(t) => self.route(p, t),
                None => break,
            }
        }
        let Some(m) = self.machines[p].as_mut() else {
            return;
        };
        while let Some(ev) = m.poll_event() {
            if ev == RoundEvent::Finished {
                self.status[p] = PeerStatus::Finished(self.now - self.start);
            }
            self.events[p].push((self.now - self.start, ev));
        }
        let deadline = m.poll_timeout();
        if deadline.is_some() && deadline != self.timers[p] {
            self.timers[p] = deadline;
            if let Some(at) = deadline {
                self.push(at.max(self.now), Ev::Timer { peer: p });
            }
        }
    }
}

/// Runs one round among `cfg.peers` over `descriptors`-shaped data from [`make_tensors`]
/// (generated on both cores).
pub fn run(cfg: &SimConfig, descriptors: &[TensorDescriptor]) -> Result<SimResult, TensorError> {
    let n = cfg.peers.len();
    let t0 = std::time::Instant::now();
    let threads = std::thread::available_parallelism()
        .map_or(1, |c| c.get())
        .min(n.max(1));
    let mut tensors: Vec<Option<Result<Vec<Tensor>, TensorError>>> = (0..n).map(|_| None).collect();
    std::thread::scope(|scope| {
        for (t, chunk) in tensors.chunks_mut(n.div_ceil(threads).max(1)).enumerate() {
            let first = t * n.div_ceil(threads).max(1);
            scope.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    *slot = Some(make_tensors(descriptors, cfg.seed, first + i));
                }
            });
        }
    });
    let tensors = tensors
        .into_iter()
        .map(|t| t.expect("every slot is filled by its thread"))
        .collect::<Result<Vec<_>, _>>()?;
    tracing::info!(elapsed = ?t0.elapsed(), "sim: data generated");
    run_with_tensors(cfg, tensors)
}

/// Runs one round among `cfg.peers`, peer `i` starting from `tensors[i]` (all peers must have
/// the same shapes and dtypes).
pub fn run_with_tensors(
    cfg: &SimConfig,
    tensors: Vec<Vec<Tensor>>,
) -> Result<SimResult, TensorError> {
    let n = cfg.peers.len();
    if tensors.len() != n {
        return Err(TensorError::Mismatch(format!(
            "{} tensor sets for {n} peers",
            tensors.len()
        )));
    }
    let descriptors: Vec<TensorDescriptor> = tensors
        .first()
        .map(|ts| ts.iter().map(TensorDescriptor::of).collect())
        .unwrap_or_default();
    if tensors.iter().any(|ts| {
        ts.iter()
            .map(TensorDescriptor::of)
            .ne(descriptors.iter().cloned())
    }) {
        return Err(TensorError::Mismatch(
            "peers hold different tensor shapes".into(),
        ));
    }
    let descriptors = &descriptors[..];
    let start = Instant::now();
    let members: Vec<Member> = cfg
        .peers
        .iter()
        .map(|p| Member {
            mode: p.mode,
            fraction: p.fraction,
        })
        .collect();
    let weights: Vec<f64> = cfg
        .peers
        .iter()
        .map(|p| if p.mode == Mode::Aux { 0.0 } else { p.weight })
        .collect();
    let mut round = cfg.round.clone();
    round.members = members;
    let fractions = round.fractions();
    let partition = Partition::new(
        descriptors,
        &fractions,
        round.part_size_bytes,
        &round.compression,
    )
    .unwrap_or_else(|_| {
        // Every machine rejects this group; any partition serves the bookkeeping.
        Partition::new(
            descriptors,
            &vec![1.0; n.max(1)],
            round.part_size_bytes,
            &round.compression,
        )
        .expect("positive fractions always partition")
    });
    let mut world = World {
        cfg,
        start,
        now: start,
        seq: 0,
        queue: BTreeMap::new(),
        machines: Vec::with_capacity(n),
        uplinks: (0..n)
            .map(|_| Uplink {
                free_at: start,
                last_arrival: vec![start; n],
                wake_at: None,
            })
            .collect(),
        timers: vec![None; n],
        status: vec![PeerStatus::Unfinished; n],
        faults: (0..n)
            .map(|_| FaultState {
                parts_to_target: 0,
                replies_to: vec![0; n],
                aborted: vec![false; n],
                stalled: vec![false; n],
                replies: 0,
            })
            .collect(),
        target: (0..n)
            .map(|p| {
                (0..n)
                    .rev()
                    .find(|&r| r != p && !partition.span(r).is_empty())
            })
            .collect(),
        spans: (0..n).map(|p| partition.span(p)).collect(),
        remains: vec![None; n],
        rng: StdRng::seed_from_u64(cfg.seed ^ 0x5EED),
        payload_bytes_sent: vec![0; n],
        events: vec![Vec::new(); n],
        started_at: (0..n)
            .map(|p| start + cfg.start_delay.get(p).copied().unwrap_or_default())
            .collect(),
    };
    let mut initial = Vec::with_capacity(n);
    for ((p, peer), tensors) in cfg.peers.iter().enumerate().zip(tensors) {
        if peer.fault == Some(Fault::FailBefore) {
            world.status[p] = PeerStatus::NotStarted;
            world.machines.push(None);
            initial.push(Some(tensors));
            continue;
        }
        let mut rc = round.clone();
        rc.me = p;
        rc.weight = weights[p];
        let begins = world.started_at[p];
        rc.start_grace = round.start_grace.saturating_sub(begins - start);
        match Butterfly::new(rc, tensors, begins) {
            Ok(mut m) => {
                if peer.fault == Some(Fault::Cancel) {
                    m.cancel(begins);
                    world.status[p] = PeerStatus::Cancelled;
                }
                world.machines.push(Some(m));
                initial.push(None);
            }
            Err(e) => {
                world.status[p] = PeerStatus::Rejected(e);
                world.machines.push(None);
                initial.push(Some(Vec::new()));
            }
        }
    }
    let t1 = std::time::Instant::now();
    for p in 0..n {
        if world.started_at[p] > start {
            let at = world.started_at[p];
            world.push(at, Ev::Wake { peer: p });
        }
        world.pump(p);
    }
    let limit = start + cfg.time_limit;
    while let Some(((at, seq), ev)) = world.queue.pop_first() {
        if at > limit {
            break;
        }
        world.now = at;
        let begins = match &ev {
            Ev::Deliver { to: p, .. } | Ev::LinkFailed { at: p, .. } => world.started_at[*p],
            _ => start,
        };
        if at < begins {
            // Waits on the link until the peer begins (a socket's buffer); its sequence number
            // keeps each link in order.
            world.queue.insert((begins, seq), ev);
            continue;
        }
        let touched = match ev {
            Ev::Deliver { to, from, message } => {
                if let Some(m) = world.machines[to].as_mut() {
                    m.handle_message(at, from, message)
                        .expect("simulated senders are group members");
                }
                to
            }
            Ev::LinkFailed { at: p, peer, role } => {
                if let Some(m) = world.machines[p].as_mut() {
                    m.handle_link_failed(world.now, peer, role);
                }
                p
            }
            Ev::Timer { peer } => {
                if world.timers[peer].is_some_and(|d| d <= at) {
                    world.timers[peer] = None;
                    if let Some(m) = world.machines[peer].as_mut() {
                        m.handle_timeout(at);
                    }
                }
                peer
            }
            Ev::Wake { peer } => {
                world.uplinks[peer].wake_at = None;
                peer
            }
            Ev::Release { from, transmit } => {
                world.send(from, transmit);
                from
            }
        };
        world.pump(touched);
    }
    let elapsed = world.now - start;
    let payload_bytes_sent = std::mem::take(&mut world.payload_bytes_sent);
    let events = std::mem::take(&mut world.events);
    let remains = std::mem::take(&mut world.remains);
    tracing::info!(wall = ?t1.elapsed(), virtual_time = ?elapsed, "sim: round done");
    let peers = world
        .machines
        .into_iter()
        .zip(world.status)
        .zip(initial.into_iter().zip(remains).map(|(i, r)| i.or(r)))
        .zip(events)
        .map(|(((m, status), init), events)| match m {
            Some(m) if matches!(status, PeerStatus::Finished(_)) => {
                let (tensors, outcome) =
                    m.into_outcome().expect("a finished machine has an outcome");
                PeerResult {
                    status,
                    tensors,
                    outcome: Some(outcome),
                    events,
                }
            }
            Some(m) => PeerResult {
                status,
                tensors: m.tensors().to_vec(),
                outcome: None,
                events,
            },
            None => PeerResult {
                status,
                tensors: init.unwrap_or_default(),
                outcome: None,
                events,
            },
        })
        .collect();
    Ok(SimResult {
        peers,
        elapsed,
        weights,
        partition,
        aggregator: cfg.round.aggregator,
        payload_bytes_sent,
    })
}

/// Largest deviation of one peer's result from what its report promises: for every part the
/// weighted mean over the contributors it names (from `all_start[peer]` and `weights`), or its
/// own start value where the part stayed local. `me` indexes `all_start`. Returns 0 for an aux
/// outcome (no results); NaN anywhere counts as infinity.
pub fn deviation_from_report(
    me: usize,
    outcome: &Outcome,
    partition: &Partition,
    all_start: &[Vec<Tensor>],
    weights: &[f64],
) -> f32 {
    if outcome.results.is_none() {
        return 0.0;
    }
    let mut worst = 0.0f32;
    let mut own = Vec::new();
    let mut result = Vec::new();
    for span in &outcome.report.spans {
        for seg in &span.segments {
            for g in seg.parts.clone() {
                let spec = *partition.part(g);
                own.resize(spec.len, 0.0);
                all_start[me][spec.tensor]
                    .part(spec.range())
                    .copy_to_f32(&mut own);
                result.resize(spec.len, 0.0);
                if outcome
                    .result_into(g, &all_start[me], &mut result)
                    .is_none()
                {
                    return f32::INFINITY;
                }
                let expected: Vec<f32> = match &seg.contributors {
                    None => own.clone(),
                    Some(c) => {
                        let mut acc = vec![0.0f64; spec.len];
                        let mut den = 0.0;
                        let mut x = vec![0.0f32; spec.len];
                        for s in c.iter() {
                            all_start[s][spec.tensor]
                                .part(spec.range())
                                .copy_to_f32(&mut x);
                            for (a, &v) in acc.iter_mut().zip(&x) {
                                *a += weights[s] * f64::from(v);
                            }
                            den += weights[s];
                        }
                        acc.iter().map(|a| (a / den) as f32).collect()
                    }
                };
                for (r, e) in result.iter().zip(&expected) {
                    worst = max_nan(worst, (r - e).abs());
                }
            }
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_values_are_random_access() {
        let d = [TensorDescriptor {
            shape: vec![1001],
            dtype: crate::tensor::DType::F32,
        }];
        for peer in [0, 3] {
            let t = make_tensors(&d, 42, peer).unwrap();
            for e in [0, 1, 2, 999, 1000] {
                assert_eq!(t[0].flat().get_f32(e), generated_value(42, peer, e));
            }
        }
    }
}
