//! One member's side of a pipelined chain broadcast, sans-IO.
//!
//! # The protocol
//!
//! The members form a chain that starts at the root and follows the group order, wrapping
//! around: `root, root+1, …, root-1`. The root cuts its tensors into parts exactly as an
//! exchange cuts a flow ([`super::exchange`]; lossless parts are views of its tensors) and
//! sends them, in order, to the next member. Every other member checks each part from the
//! member before it (order, codec, dtype, length, decodability), decodes it into its own
//! tensors, and forwards the very same encoded part (the received bytes, not a re-encoding:
//! a lossy codec is applied once, by the root, so every member decodes the same values) to
//! the member after it as soon as that link has room. Every uplink carries the data once,
//! and a member forwards part `p` while it still receives part `p+1`: on a network whose
//! uplinks bind, the broadcast takes about one transfer of the data, whatever the group's
//! size (the root's uplink carries `1×` the data, against `2(N-1)/N×` for scatter +
//! all-gather and `(N-1)×` for sending from the root to everyone); on one machine it moves
//! `(N-1)×` the data in all, the least any broadcast can.
//!
//! Received parts wait for room downstream in a queue of the received bytes (pooled frame
//! buffers): when the next member takes them more slowly than they arrive, a member holds up
//! to the broadcast's size in that queue, never more (parts past the expected count are a
//! violation).
//!
//! **Completion.** The last member, once it has every part, sends the member before it a
//! [`Message::Notice`] with no failed members: "everyone past me has the data". A member
//! passes it on upstream once it has every part, has handed every part downstream and has
//! heard it from downstream, so when the root hears it, every member has the data. A member
//! is done when its own part of that is done (the root: when it hears the notice).
//!
//! **Failures.** A member that detects a failure of a neighbour (its link died, it aborted,
//! it sent a bad part or notice, or it timed out) or hears of failures in a notice from a
//! neighbour stops, and sends every living neighbour a notice naming every member it knows
//! failed; neighbours do the same, so the news travels both ways along the chain and every
//! member ends with an error that names the failed member, however far away it was
//! ([`RoundEvent::Banned`] with [`Violation::ReportedFailed`] for failures heard of). What a
//! member had received stays decoded in its tensors (the caller gets no result).
//!
//! **Timeouts** are longer further down the chain so that a member hears of a failure
//! upstream before it would time out on its own upstream neighbour, who is only waiting
//! itself: the member at chain position `k` waits `(k + 1) / 2 × sender_timeout` for each
//! next part (counted from the start or the last part; half a timeout more per position is
//! the margin for the notice's one hop). Downstream, a member waits `sender_timeout` for its
//! next member to take a part when its link to it is full (a member takes every part it is
//! sent, whatever happens past it, so a full link means that member stopped), and after
//! handing its last part downstream it waits `(N - k + 1) / 2 × sender_timeout` for the
//! completion notice (a member that stalls after forwarding the data but before passing the
//! notice on is only seen by the one before it; the members before that wait longer, so
//! they hear of it first). `op_timeout` bounds the whole operation and fails the neighbours
//! still waited for.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::exchange::cut;
use crate::allreduce::{
    AbortReason, Message, PartMessage, PartSpec, PeerSet, Role, RoundError, RoundEvent,
    TensorDescriptor, Transmit, Violation, encode_part,
};
use crate::buffers::BufferPool;
use crate::compression::{Codec, Compression};
use crate::tensor::Tensor;

/// Parameters of one chain broadcast, the same on every member except `me`.
#[derive(Clone, Debug)]
pub(crate) struct ChainConfig {
    /// Members in the operation.
    pub members: usize,
    /// Our index.
    pub me: usize,
    /// The member whose tensors everyone gets.
    pub root: usize,
    /// Target encoded part size.
    pub part_size_bytes: usize,
    /// Codec choice per tensor.
    pub compression: Compression,
    /// The unit of the chain's waits (see the module docs).
    pub sender_timeout: Duration,
    /// Bound on the whole operation.
    pub op_timeout: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    /// Done (or given up): the notices queued go out, then it is finished.
    Finishing,
    Finished,
    Cancelled,
}

/// One member's side of one chain broadcast (see the module docs).
pub(crate) struct Chain {
    cfg: ChainConfig,
    /// Our position in the chain (0: the root).
    pos: usize,
    up: Option<usize>,
    down: Option<usize>,
    descriptors: Arc<[TensorDescriptor]>,
    parts: Arc<[PartSpec]>,
    codecs: Arc<[&'static dyn Codec]>,
    /// The root's tensors (its parts are views of them).
    source: Option<Arc<Vec<Tensor>>>,
    /// Everyone else's tensors, received into.
    dest: Vec<Tensor>,
    /// Parts we hold (all of them at the root).
    received: usize,
    /// When the last part came (or the operation started).
    last_heard: Instant,
    /// Received parts not yet forwarded.
    forward: VecDeque<PartMessage>,
    /// Parts handed downstream.
    sent: usize,
    /// When the last part was handed downstream.
    all_sent_at: Option<Instant>,
    /// Since when a part has been waiting for room on the link downstream.
    blocked_since: Option<Instant>,
    /// Downstream confirmed that everyone past us has the data.
    down_done: bool,
    /// Notices and aborts, sent before any part.
    notices: VecDeque<Transmit>,
    /// Members known to have failed.
    failed: PeerSet,
    events: VecDeque<RoundEvent>,
    state: State,
    deadline: Option<Instant>,
    pool: BufferPool,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("me", &self.cfg.me)
            .field("pos", &self.pos)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Chain {
    /// Starts a broadcast at `now`: the root passes the tensors to send, everyone else
    /// tensors of the same shapes and dtypes to receive into.
    pub(crate) fn new(
        cfg: ChainConfig,
        tensors: Vec<Tensor>,
        now: Instant,
        pool: BufferPool,
    ) -> Result<Self, RoundError> {
        let n = cfg.members;
        if cfg.me >= n || cfg.root >= n {
            return Err(RoundError::NotInGroup {
                me: cfg.me.max(cfg.root),
                size: n,
            });
        }
        let pos = (cfg.me + n - cfg.root) % n;
        let at = |p: usize| (cfg.root + p) % n;
        let descriptors: Arc<[TensorDescriptor]> =
            tensors.iter().map(TensorDescriptor::of).collect();
        let (parts, codecs) = cut(&descriptors, cfg.part_size_bytes, &cfg.compression)?;
        let root = pos == 0;
        let (source, dest) = if root {
            (Some(Arc::new(tensors)), Vec::new())
        } else {
            (None, tensors)
        };
        let mut chain = Self {
            pos,
            up: (pos > 0).then(|| at(pos - 1)),
            down: (pos + 1 < n).then(|| at(pos + 1)),
            descriptors,
            received: if root { parts.len() } else { 0 },
            parts,
            codecs,
            source,
            dest,
            last_heard: now,
            forward: VecDeque::new(),
            sent: 0,
            all_sent_at: None,
            blocked_since: None,
            down_done: pos + 1 >= n,
            notices: VecDeque::new(),
            failed: PeerSet::new(),
            events: VecDeque::new(),
            state: State::Running,
            deadline: cfg.op_timeout.and_then(|t| now.checked_add(t)),
            cfg,
            pool,
        };
        if chain.parts.is_empty() {
            // Nothing to send: the wait for downstream's confirmation starts now.
            chain.all_sent_at = Some(now);
        }
        chain.progress();
        Ok(chain)
    }

    /// The tensors: the root's own, or what everyone else received into theirs (complete
    /// when the broadcast finished without a failure).
    pub(crate) fn into_tensors(self) -> Vec<Tensor> {
        match self.source {
            Some(shared) => Arc::try_unwrap(shared).unwrap_or_else(|s| (*s).clone()),
            None => self.dest,
        }
    }

    /// Whether every part reached us and, past us, everyone.
    fn complete(&self) -> bool {
        self.received == self.parts.len()
            && (self.down.is_none() || (self.sent == self.parts.len() && self.down_done))
    }

    /// Finishes once everything is done here (passing the completion upstream).
    fn progress(&mut self) {
        if self.state == State::Running && self.complete() {
            if let Some(up) = self.up {
                self.notices.push_back(Transmit {
                    to: up,
                    message: Message::Notice {
                        failed: PeerSet::new(),
                    },
                });
            }
            self.state = State::Finishing;
        }
        self.settle();
    }

    /// Finishing with nothing left to send: finished.
    fn settle(&mut self) {
        if self.state == State::Finishing && self.notices.is_empty() {
            self.state = State::Finished;
            self.events.push_back(RoundEvent::Finished);
        }
    }

    /// We found `member` failed (what we meant to tell it is dropped).
    fn fail(&mut self, member: usize, reason: Violation) {
        if member != self.cfg.me && self.failed.insert(member) {
            self.events.push_back(RoundEvent::Banned {
                peer: member,
                reason,
            });
        }
        self.notices.retain(|t| t.to != member);
        self.give_up();
        self.settle();
    }

    /// Neighbour `by` told us these members failed.
    fn learn(&mut self, failed: &PeerSet, by: usize) {
        for member in failed.iter() {
            if self.failed.insert(member) {
                self.events.push_back(RoundEvent::Banned {
                    peer: member,
                    reason: Violation::ReportedFailed { by },
                });
            }
        }
        self.give_up();
    }

    /// Stops, telling every living neighbour whom we know failed.
    fn give_up(&mut self) {
        if self.state != State::Running {
            return;
        }
        for neighbour in [self.up, self.down].into_iter().flatten() {
            if !self.failed.contains(neighbour) {
                self.notices.push_back(Transmit {
                    to: neighbour,
                    message: Message::Notice {
                        failed: self.failed.clone(),
                    },
                });
            }
        }
        self.forward.clear();
        self.state = State::Finishing;
        self.settle();
    }

    fn on_part(&mut self, now: Instant, msg: PartMessage) -> Result<(), Violation> {
        let index = self.received;
        if index >= self.parts.len() || msg.part as usize != index {
            return Err(Violation::UnexpectedPart {
                part: msg.part,
                expected: (index < self.parts.len()).then_some(index),
            });
        }
        let spec = self.parts[index];
        let codec = self.codecs[spec.tensor];
        let expected_dtype = codec.wire_dtype(self.descriptors[spec.tensor].dtype);
        if msg.codec != codec.kind() || msg.dtype != expected_dtype {
            return Err(Violation::WrongEncoding {
                part: msg.part,
                codec: msg.codec,
                dtype: msg.dtype,
                expected_codec: codec.kind(),
                expected_dtype,
            });
        }
        decode_into(
            codec,
            &msg,
            &mut self.dest[spec.tensor],
            spec.range(),
            &self.pool,
        )?;
        self.received += 1;
        self.last_heard = now;
        if self.down.is_some() {
            self.forward.push_back(msg);
        }
        Ok(())
    }

    fn on_notice(&mut self, from: usize, failed: PeerSet) {
        let n = self.cfg.members;
        if failed.bound() > n || failed.contains(self.cfg.me) {
            return self.fail(from, Violation::BadNotice);
        }
        match (Some(from) == self.up, Some(from) == self.down) {
            // Done downstream: only once we handed it everything.
            (_, true) if failed.is_empty() => {
                if self.sent == self.parts.len() {
                    self.down_done = true;
                } else {
                    self.fail(from, Violation::BadNotice);
                }
            }
            // "Done" travels upstream only.
            (true, _) if failed.is_empty() => self.fail(from, Violation::BadNotice),
            (true, _) | (_, true) => self.learn(&failed, from),
            _ => self.fail(from, Violation::UnexpectedNotice),
        }
    }

    /// When we stop waiting for upstream (the next part) and for downstream (to take a part
    /// while its link is full, or to confirm), while we wait for them (see the module docs:
    /// the waits grow by half a `sender_timeout` per position, upstream towards the end of
    /// the chain and downstream towards its start).
    /// A wait that does not fit an `Instant` (a huge `sender_timeout`) is no wait.
    fn waits(&self) -> (Option<Instant>, Option<Instant>) {
        let unit = self.cfg.sender_timeout;
        let (pos, n) = (self.pos as u32, self.cfg.members as u32);
        let halves = |k: u32| unit.checked_mul(k).map(|d| d / 2);
        let after = |at: Instant, wait: Option<Duration>| wait.and_then(|w| at.checked_add(w));
        let upstream = (self.received < self.parts.len())
            .then(|| after(self.last_heard, halves(pos + 1)))
            .flatten();
        let unconfirmed = self
            .all_sent_at
            .filter(|_| !self.down_done)
            .and_then(|at| after(at, halves(n - pos + 1)));
        let stuck = self.blocked_since.and_then(|at| after(at, Some(unit)));
        (upstream, unconfirmed.into_iter().chain(stuck).min())
    }

    /// The next part for downstream.
    fn next_part(&mut self) -> Option<Message> {
        if let Some(source) = &self.source {
            let index = self.sent;
            let spec = self.parts[index];
            let codec = self.codecs[spec.tensor];
            let (dtype, payload) = encode_part(source, spec, codec, &self.pool);
            return Some(Message::Part(PartMessage {
                part: index as u32,
                weight: 1.0,
                codec: codec.kind(),
                dtype,
                payload,
            }));
        }
        self.forward.pop_front().map(Message::Part)
    }
}

/// Decodes `msg`'s payload into elements `range` of `dest` (the caller checked that they
/// lie within it): straight into an f32 tensor; through a pooled f32 buffer, rounded to the
/// tensor's dtype, otherwise (exact for values that came from that dtype).
fn decode_into(
    codec: &'static dyn Codec,
    msg: &PartMessage,
    dest: &mut Tensor,
    range: Range<usize>,
    pool: &BufferPool,
) -> Result<(), crate::compression::CodecError> {
    use crate::tensor::PartViewMut;
    match dest.flat_mut() {
        PartViewMut::F32(v) => codec.decode(&msg.payload, msg.dtype, &mut v[range]),
        PartViewMut::F16(v) => decode_rounded(codec, msg, &mut v[range], pool, half::f16::from_f32),
        PartViewMut::BF16(v) => {
            decode_rounded(codec, msg, &mut v[range], pool, half::bf16::from_f32)
        }
    }
}

/// Decodes `msg`'s payload through a pooled f32 buffer into `out`, rounded with `round`.
fn decode_rounded<T>(
    codec: &'static dyn Codec,
    msg: &PartMessage,
    out: &mut [T],
    pool: &BufferPool,
    round: fn(f32) -> T,
) -> Result<(), crate::compression::CodecError> {
    let mut tmp = pool.take_f32(out.len());
    let r = codec.decode(&msg.payload, msg.dtype, &mut tmp);
    if r.is_ok() {
        for (d, &x) in out.iter_mut().zip(tmp.iter()) {
            *d = round(x);
        }
    }
    pool.put_f32(tmp);
    r
}

impl crate::runner::Machine for Chain {
    fn poll_transmit(
        &mut self,
        now: Instant,
        mut ready: impl FnMut(usize) -> bool,
    ) -> Option<Transmit> {
        if let Some(at) = self.notices.iter().position(|t| ready(t.to)) {
            let t = self.notices.remove(at);
            self.settle();
            return t;
        }
        if self.state != State::Running {
            return None;
        }
        let down = self.down?;
        if self.sent >= self.received {
            return None;
        }
        if !ready(down) {
            self.blocked_since.get_or_insert(now);
            return None;
        }
        self.blocked_since = None;
        let message = self.next_part()?;
        self.sent += 1;
        if self.sent == self.parts.len() {
            self.all_sent_at = Some(now);
        }
        self.progress();
        Some(Transmit { to: down, message })
    }

    fn poll_event(&mut self) -> Option<RoundEvent> {
        self.events.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Running => {
                let (upstream, downstream) = self.waits();
                [upstream, downstream, self.deadline]
                    .into_iter()
                    .flatten()
                    .min()
            }
            State::Finishing => self.deadline,
            State::Finished | State::Cancelled => None,
        }
    }

    fn handle_message(
        &mut self,
        now: Instant,
        from: usize,
        message: Message,
    ) -> Result<(), RoundError> {
        if from >= self.cfg.members || from == self.cfg.me {
            return Err(RoundError::UnknownPeer(from));
        }
        if self.state != State::Running {
            return Ok(());
        }
        match message {
            Message::Part(p) if Some(from) == self.up => {
                if let Err(v) = self.on_part(now, p) {
                    self.fail(from, v);
                }
            }
            Message::Part(p) => self.fail(
                from,
                Violation::UnexpectedPart {
                    part: p.part,
                    expected: None,
                },
            ),
            Message::Notice { failed } => self.on_notice(from, failed),
            Message::Averaged(a) => self.fail(from, Violation::UnexpectedReply(a.part)),
            Message::Abort { reason, .. } => self.fail(from, Violation::Aborted(reason)),
        }
        self.progress();
        Ok(())
    }

    fn handle_link_failed(&mut self, _now: Instant, peer: usize) {
        // A link to a member that is not our neighbour carries nothing of this operation:
        // that member's neighbours report it.
        if self.up != Some(peer) && self.down != Some(peer) {
            return;
        }
        match self.state {
            State::Running => self.fail(peer, Violation::LinkFailed),
            State::Finishing | State::Cancelled => {
                self.notices.retain(|t| t.to != peer);
                self.settle();
            }
            State::Finished => {}
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        let overdue = self.deadline.is_some_and(|d| now >= d);
        match self.state {
            State::Running if overdue => {
                // The neighbours we still wait for.
                if let Some(up) = self.up.filter(|_| self.received < self.parts.len()) {
                    self.fail(up, Violation::RoundTimeout);
                }
                if let Some(down) = self.down.filter(|_| !self.down_done) {
                    self.fail(down, Violation::RoundTimeout);
                }
            }
            State::Running => {
                let (upstream, downstream) = self.waits();
                if let Some(up) = self.up
                    && upstream.is_some_and(|d| now >= d)
                {
                    self.fail(up, Violation::SenderTimeout);
                }
                if let Some(down) = self.down
                    && downstream.is_some_and(|d| now >= d)
                {
                    self.fail(down, Violation::DownstreamTimeout);
                }
            }
            // Notices a stuck link never took: the operation ends without them.
            State::Finishing if overdue => {
                self.notices.clear();
                self.settle();
            }
            State::Finishing | State::Finished | State::Cancelled => {}
        }
    }

    fn cancel(&mut self, _now: Instant) {
        if !matches!(self.state, State::Running | State::Finishing) {
            return;
        }
        let finishing = self.state == State::Finishing;
        self.state = State::Cancelled;
        if finishing {
            // What we owed the neighbours is sent as it was (a cancel after our part of the
            // broadcast is done changes nothing for them).
            return;
        }
        for neighbour in [self.up, self.down].into_iter().flatten() {
            self.notices.push_back(Transmit {
                to: neighbour,
                message: Message::Abort {
                    role: Role::Sender,
                    reason: AbortReason::Cancelled,
                },
            });
        }
    }

    fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    fn is_cancelled(&self) -> bool {
        self.state == State::Cancelled
    }

    fn is_drained(&self) -> bool {
        self.notices.is_empty()
    }
}

#[cfg(test)]
mod tests;
