//! One peer's side of one butterfly round, as a pure state machine.
//!
//! Inputs: [`Butterfly::handle_message`], [`Butterfly::handle_timeout`],
//! [`Butterfly::handle_link_failed`], [`Butterfly::cancel`], each with `now`.
//! Outputs: [`Butterfly::poll_transmit`] (messages, generated lazily so that at most
//! `max_in_flight_parts` parts per reducer exist at a time), [`Butterfly::poll_event`]
//! (bans, failed reducers, finish) and [`Butterfly::poll_timeout`] (the next deadline).
//!
//! Encoding, decoding and reduction happen inside these calls: the driver runs the machine on
//! a compute task and keeps network tasks for moving bytes.

mod reduce;
mod send;
mod stand_in;

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::deadline::{expected_gap, longer};
use super::{
    AbortReason, Message, Mode, Outcome, PartResult, Partition, PeerSet, Reducer, Role,
    RoundConfig, RoundError, RoundEvent, RoundReport, Segment, SpanReport, TensorDescriptor,
    Transmit, Violation,
};
use crate::buffers::BufferPool;
use crate::compression::{Codec, CompressionType};
use crate::tensor::{DType, Tensor};

use reduce::{InLink, own_input};
use send::{OutLink, StandInOut};
use stand_in::StandIn;
pub use stand_in::{MAX_HANDOVERS, MAX_STAND_IN_SPANS};

/// Where one link of a round stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkStatus {
    Active,
    Done,
    Failed,
}

/// The gap expected between a reducer's replies, and whether one of its senders has no
/// expectation (adaptive timeouts).
type ReplyExpectation = (Option<Duration>, bool);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Running,
    Finished,
    Cancelled,
}

/// Checks that a payload declares what the group's configuration prescribes for its tensor:
/// `codec`, and the dtype that codec produces from `source`.
fn check_encoding(
    codec: &dyn Codec,
    source: DType,
    part: u32,
    declared_codec: crate::compression::CompressionType,
    declared_dtype: DType,
) -> Result<(), Violation> {
    let expected_dtype = codec.wire_dtype(source);
    if declared_codec == codec.kind() && declared_dtype == expected_dtype {
        Ok(())
    } else {
        Err(Violation::WrongEncoding {
            part,
            codec: declared_codec,
            dtype: declared_dtype,
            expected_codec: codec.kind(),
            expected_dtype,
        })
    }
}

/// The bytes of one part of one tensor, kept alive by a share of the round's tensors: the
/// zero-copy payload of a lossless part.
pub(crate) struct TensorBytes {
    pub(crate) tensors: Arc<Vec<Tensor>>,
    pub(crate) tensor: usize,
    pub(crate) range: Range<usize>,
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.tensors[self.tensor]
            .part(self.range.clone())
            .as_bytes()
    }
}

/// Encodes part `spec` of `tensors` with `codec`: the dtype the payload declares, and the
/// payload (for the lossless codec the tensor's own bytes, no copy).
pub(crate) fn encode_part(
    tensors: &Arc<Vec<Tensor>>,
    spec: super::PartSpec,
    codec: &'static dyn Codec,
    pool: &BufferPool,
) -> (DType, Bytes) {
    let view = tensors[spec.tensor].part(spec.range());
    let dtype = codec.wire_dtype(view.dtype());
    let payload = if codec.kind() == CompressionType::None && cfg!(target_endian = "little") {
        // The raw little-endian elements are the encoding: send the tensor's own bytes.
        Bytes::from_owner(TensorBytes {
            tensors: Arc::clone(tensors),
            tensor: spec.tensor,
            range: spec.range(),
        })
    } else {
        let mut buf = pool.take_bytes(view.as_bytes().len());
        codec.encode(view, &mut buf);
        pool.freeze(buf)
    };
    (dtype, payload)
}

/// One peer's side of one butterfly all-reduce round (see the [module docs](super)).
#[derive(Debug)]
pub struct Butterfly {
    cfg: RoundConfig,
    modes: Vec<Mode>,
    partition: Partition,
    codecs: Vec<&'static dyn Codec>,
    /// Shared so that lossless parts go out as views of the tensors themselves (no copy).
    tensors: Arc<Vec<Tensor>>,
    /// What each part of our tensors became (senders only).
    outputs: Option<Vec<PartResult>>,
    /// Per part: where `outputs` holds a quantized sparse reply this peer encoded (its own
    /// span, or one it stood in for), the reply's error scaled for error feedback
    /// ([`Outcome::reply_feedback`]).
    reply_feedback: Vec<Option<Vec<f32>>>,
    /// Per tensor: its values are still being written (a device snapshot on its way to the
    /// host), so none of its parts is sent or reduced yet ([`Butterfly::mark_ready`]).
    pending: Vec<bool>,
    out_links: Vec<Option<OutLink>>,
    reducer: Option<Reducer>,
    in_links: Vec<Option<InLink>>,
    outbox: Vec<VecDeque<Message>>,
    events: VecDeque<RoundEvent>,
    results: Vec<Option<PeerSet>>,
    banned: PeerSet,
    failed_reducers: PeerSet,
    state: State,
    cursor: usize,
    scratch: Vec<f32>,
    pool: BufferPool,
    round_deadline: Option<Instant>,
    /// Per sender: the gap expected between its parts to us (adaptive timeouts, known rates).
    expected_in: Vec<Option<Duration>>,
    /// Per reducer: the gap expected between its replies to us, and whether one of its
    /// senders has no expectation (then its fixed `sender_timeout` applies there).
    expected_reply: Vec<ReplyExpectation>,
    /// Per failed reducer: where our values of its span were re-sent ([`stand_in`]).
    stand_in_out: Vec<Option<StandInOut>>,
    /// Per failed reducer: our reduction of its span as its stand-in ([`stand_in`]).
    stand_ins: Vec<Option<StandIn>>,
    /// Per failed reducer: how many stand-ins we tried for its span.
    handovers: Vec<u8>,
    /// Stand-ins that failed us while their own span did not (not asked again).
    failed_stand_ins: PeerSet,
    /// Until when other members may still be beginning the round (`RoundConfig::start_grace`;
    /// `None`: overflow, never): no first part or first reply is awaited from before it.
    start_by: Option<Instant>,
}

impl Butterfly {
    /// Starts a round over `tensors` (this peer's values, owned for the round's duration).
    pub fn new(cfg: RoundConfig, tensors: Vec<Tensor>, now: Instant) -> Result<Self, RoundError> {
        Self::with_pool(cfg, tensors, now, BufferPool::default())
    }

    /// Like [`Butterfly::new`], with the buffers of encoded payloads and of the reduction
    /// taken from (and returned to) `pool`, which may outlive the round and serve the next.
    pub fn with_pool(
        cfg: RoundConfig,
        tensors: Vec<Tensor>,
        now: Instant,
        pool: BufferPool,
    ) -> Result<Self, RoundError> {
        Self::with_pending(cfg, tensors, &[], now, pool)
    }

    /// Like [`Butterfly::with_pool`], with the tensors at `pending` (indices) not yet
    /// readable: their values are still being written (a device snapshot on its way to host
    /// memory). None of their parts is sent, and this peer's own contribution to the parts
    /// it reduces is not read, until [`Butterfly::mark_ready`] names them; the rest of the
    /// round goes on meanwhile, so parts go out as soon as their tensor is on the host.
    pub fn with_pending(
        cfg: RoundConfig,
        tensors: Vec<Tensor>,
        pending: &[usize],
        now: Instant,
        pool: BufferPool,
    ) -> Result<Self, RoundError> {
        let n = cfg.members.len();
        if cfg.me >= n {
            return Err(RoundError::NotInGroup {
                me: cfg.me,
                size: n,
            });
        }
        if cfg.reducer_timeout <= cfg.sender_timeout {
            return Err(RoundError::Timeouts {
                sender: cfg.sender_timeout,
                reducer: cfg.reducer_timeout,
            });
        }
        if cfg.max_in_flight_parts == 0 {
            return Err(RoundError::ZeroWindow);
        }
        if let Some(bounds) = cfg.adaptive_timeouts
            && !bounds.is_valid()
        {
            return Err(RoundError::BadAdaptiveTimeouts(bounds));
        }
        if !super::reducer::valid_weight(cfg.weight) {
            return Err(RoundError::BadWeight(cfg.weight));
        }
        if let super::Aggregator::CenteredClip(clip) = cfg.aggregator
            && !clip.is_valid()
        {
            return Err(RoundError::BadAggregator {
                tau: clip.tau,
                tolerance: clip.tolerance,
            });
        }
        let modes: Vec<Mode> = cfg.members.iter().map(|m| m.mode).collect();
        let senders = PeerSet::from_indices((0..n).filter(|&i| modes[i].is_sender()));
        if senders.is_empty() {
            return Err(RoundError::NoSenders);
        }
        let descriptors: Vec<TensorDescriptor> = tensors.iter().map(TensorDescriptor::of).collect();
        let partition = Partition::new(
            &descriptors,
            &cfg.fractions(),
            cfg.part_size_bytes,
            &cfg.compression,
        )
        .map_err(|e| match e {
            super::PartitionError::AllZero => RoundError::NoReducers(e),
            other => RoundError::Partition(other),
        })?;
        let codecs = descriptors
            .iter()
            .map(|d| cfg.compression.codec_for(d.numel()))
            .collect();
        let me = cfg.me;
        let my_mode = modes[me];

        // Every part stays local until its average (or delta) arrives.
        let outputs = my_mode
            .is_sender()
            .then(|| vec![PartResult::Local; partition.num_parts()]);

        let out_links = (0..n)
            .map(|r| {
                let span = partition.span(r);
                (my_mode.is_sender() && r != me && !span.is_empty())
                    .then(|| OutLink::new(span, now, &cfg))
            })
            .collect();

        let my_span = partition.span(me);
        let (reducer, in_links) = if my_mode.is_reducer() && !my_span.is_empty() {
            let lens = partition.parts()[my_span.clone()]
                .iter()
                .map(|p| p.len)
                .collect();
            let reducer = Reducer::with_pool(my_span.clone(), lens, senders.clone(), pool.clone())
                .with_aggregator(cfg.aggregator);
            let links = (0..n)
                .map(|s| (s != me && senders.contains(s)).then(|| InLink::new(now)))
                .collect();
            (Some(reducer), links)
        } else {
            (None, (0..n).map(|_| None).collect())
        };

        let mut pending_tensors = vec![false; tensors.len()];
        // A peer that sends nothing reads nothing of its own: nothing to wait for.
        let pending = if modes[cfg.me].is_sender() {
            pending
        } else {
            &[]
        };
        for &t in pending {
            let count = pending_tensors.len();
            *pending_tensors
                .get_mut(t)
                .ok_or_else(|| RoundError::BadPlan(format!("pending tensor {t} of {count}")))? =
                true;
        }
        let (expected_in, expected_reply) = expected_gaps(&cfg, &modes, &partition);
        let mut machine = Self {
            expected_in,
            expected_reply,
            pending: pending_tensors,
            modes,
            results: vec![None; partition.num_parts()],
            reply_feedback: vec![None; partition.num_parts()],
            partition,
            codecs,
            tensors: Arc::new(tensors),
            outputs,
            out_links,
            reducer,
            in_links,
            outbox: (0..n).map(|_| VecDeque::new()).collect(),
            events: VecDeque::new(),
            banned: PeerSet::new(),
            failed_reducers: PeerSet::new(),
            state: State::Running,
            cursor: 0,
            scratch: Vec::new(),
            pool,
            round_deadline: cfg.round_timeout.and_then(|t| now.checked_add(t)),
            stand_in_out: (0..n).map(|_| None).collect(),
            stand_ins: (0..n).map(|_| None).collect(),
            handovers: vec![0; n],
            failed_stand_ins: PeerSet::new(),
            start_by: now.checked_add(cfg.start_grace),
            cfg,
        };
        machine.contribute_local();
        machine.drain_completed();
        machine.check_finished();
        Ok(machine)
    }

    /// The partition of this round.
    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    /// This peer's values as they were when the round started.
    pub fn tensors(&self) -> &[Tensor] {
        self.tensors.as_slice()
    }

    /// Whether the round finished (successfully).
    pub fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    /// Whether the round was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.state == State::Cancelled
    }

    /// Whether every queued message has been handed out by [`Butterfly::poll_transmit`].
    pub fn is_drained(&self) -> bool {
        self.outbox.iter().all(VecDeque::is_empty)
    }

    /// The result, once [`RoundEvent::Finished`] was emitted.
    pub fn outcome(&self) -> Result<Outcome, RoundError> {
        match self.state {
            State::Running => Err(RoundError::NotFinished),
            State::Cancelled => Err(RoundError::Cancelled),
            State::Finished => Ok(Outcome {
                results: self.outputs.clone(),
                parts: self.partition.parts().to_vec(),
                report: self.report(),
                reply_feedback: self.reply_feedback(),
            }),
        }
    }

    /// Like [`Butterfly::outcome`], consuming the machine; also returns the tensors (the values
    /// the round started from, which [`Outcome::apply`] needs).
    pub fn into_outcome(self) -> Result<(Vec<Tensor>, Outcome), RoundError> {
        match self.state {
            State::Running => Err(RoundError::NotFinished),
            State::Cancelled => Err(RoundError::Cancelled),
            State::Finished => {
                let report = self.report();
                // Moved out, not copied: one error vector per part this peer reduced.
                let reply_feedback = self
                    .reply_feedback
                    .into_iter()
                    .enumerate()
                    .filter_map(|(g, e)| e.map(|e| (g, e)))
                    .collect();
                // Outgoing parts borrow the tensors; once every message is gone (the runner
                // joins its writers first) this is a move, else a copy.
                let tensors =
                    Arc::try_unwrap(self.tensors).unwrap_or_else(|shared| (*shared).clone());
                Ok((
                    tensors,
                    Outcome {
                        results: self.outputs,
                        parts: self.partition.parts().to_vec(),
                        report,
                        reply_feedback,
                    },
                ))
            }
        }
    }

    /// The parts whose result is a quantized reply of ours, with their scaled errors (copied:
    /// [`Butterfly::into_outcome`] moves them instead).
    fn reply_feedback(&self) -> Vec<(usize, Vec<f32>)> {
        self.reply_feedback
            .iter()
            .enumerate()
            .filter_map(|(g, e)| e.as_ref().map(|e| (g, e.clone())))
            .collect()
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<RoundEvent> {
        self.events.pop_front()
    }

    /// The earliest time at which [`Butterfly::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state != State::Running {
            return None;
        }
        let n = self.modes.len();
        let ins = self
            .lanes()
            .into_iter()
            .flat_map(|lane| (0..n).filter_map(move |s| self.in_deadline(lane, s)));
        let outs = (0..n).filter_map(|r| self.out_deadline(r));
        ins.chain(outs).chain(self.round_deadline).min()
    }

    /// The next message to send, to a destination for which `ready` returns true. Parts are
    /// produced (encoded) here, lazily, so a slow link holds back only its own data.
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        mut ready: impl FnMut(usize) -> bool,
    ) -> Option<Transmit> {
        let n = self.outbox.len();
        for k in 0..n {
            let to = (self.cursor + k) % n;
            if self.outbox[to].is_empty() && !self.can_send_part(to) {
                continue;
            }
            if !ready(to) {
                continue;
            }
            self.cursor = (to + 1) % n;
            if let Some(message) = self.outbox[to].pop_front() {
                if let Message::Averaged(a) = &message {
                    self.reply_sent(now, to, a.part as usize);
                }
                self.check_finished();
                return Some(Transmit { to, message });
            }
            let message = self.make_part(to, now);
            return Some(Transmit { to, message });
        }
        None
    }

    /// Handles a message from group member `from`.
    pub fn handle_message(
        &mut self,
        now: Instant,
        from: usize,
        message: Message,
    ) -> Result<(), RoundError> {
        if from >= self.modes.len() {
            return Err(RoundError::UnknownPeer(from));
        }
        if self.state != State::Running {
            return Ok(());
        }
        match message {
            Message::Part(part) => self.on_part(now, from, part),
            Message::Averaged(avg) => self.on_averaged(now, from, avg),
            Message::Abort { role, reason } => match role {
                Role::Sender => self.ban(from, Violation::Aborted(reason), false),
                Role::Reducer => self.fail_reducer(now, from, Violation::Aborted(reason), false),
            },
            // Another protocol's message: the peer is out of step in both roles.
            Message::Notice { .. } => {
                self.ban(from, Violation::UnexpectedNotice, true);
                self.fail_reducer(now, from, Violation::UnexpectedNotice, true);
            }
        }
        self.drain_completed();
        self.check_finished();
        Ok(())
    }

    /// Handles expired deadlines.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state != State::Running {
            return;
        }
        if self.round_deadline.is_some_and(|d| d <= now) && self.has_pending() {
            // Our own values never became readable: the parts we reduce cannot complete
            // without them, so the round cannot end by banning others. It fails instead.
            self.cancel(now);
            return;
        }
        if self.round_deadline.is_some_and(|d| d <= now) {
            for s in 0..self.in_links.len() {
                let sending = self.in_links[s]
                    .as_ref()
                    .is_some_and(|l| l.status == LinkStatus::Active);
                if sending {
                    self.ban(s, Violation::RoundTimeout, true);
                }
            }
            for d in 0..self.stand_ins.len() {
                for s in 0..self.modes.len() {
                    self.exclude_from_stand_in(d, s);
                }
            }
            for r in 0..self.out_links.len() {
                self.fail_reducer(now, r, Violation::RoundTimeout, true);
            }
        }
        for s in 0..self.in_links.len() {
            if self.in_deadline(None, s).is_some_and(|d| d <= now) {
                self.ban(s, Violation::SenderTimeout, true);
            }
        }
        for d in 0..self.stand_ins.len() {
            for s in 0..self.modes.len() {
                if self.in_deadline(Some(d), s).is_some_and(|t| t <= now) {
                    self.exclude_from_stand_in(d, s);
                }
            }
        }
        for r in 0..self.out_links.len() {
            if self.out_deadline(r).is_some_and(|d| d <= now) {
                self.fail_reducer(now, r, Violation::ReducerTimeout, true);
            }
        }
        self.drain_completed();
        self.check_finished();
    }

    /// The transport lost the link to `peer` in `role` (or both roles with `None`).
    pub fn handle_link_failed(&mut self, now: Instant, peer: usize, role: Option<Role>) {
        if self.state != State::Running || peer >= self.modes.len() {
            return;
        }
        if role != Some(Role::Reducer) {
            self.ban(peer, Violation::LinkFailed, false);
        }
        if role != Some(Role::Sender) {
            self.fail_reducer(now, peer, Violation::LinkFailed, false);
        }
        if role.is_none() {
            // Nothing more can reach that peer.
            self.outbox[peer].clear();
        }
        self.drain_completed();
        self.check_finished();
    }

    /// Cancels the round: every peer still linked gets an abort; the outcome is
    /// [`RoundError::Cancelled`]. Keep draining [`Butterfly::poll_transmit`] to send the aborts.
    pub fn cancel(&mut self, now: Instant) {
        let _ = now;
        if self.state != State::Running {
            return;
        }
        for q in &mut self.outbox {
            q.clear();
        }
        for r in 0..self.out_links.len() {
            if let Some(l) = self.out_links[r].as_mut()
                && l.status == LinkStatus::Active
            {
                l.status = LinkStatus::Failed;
                self.outbox[r].push_back(Message::Abort {
                    role: Role::Sender,
                    reason: AbortReason::Cancelled,
                });
            }
        }
        for s in 0..self.in_links.len() {
            if let Some(l) = self.in_links[s].as_mut()
                && l.status != LinkStatus::Failed
            {
                l.status = LinkStatus::Failed;
                self.outbox[s].push_back(Message::Abort {
                    role: Role::Reducer,
                    reason: AbortReason::Cancelled,
                });
            }
        }
        self.state = State::Cancelled;
    }

    /// Tensor `tensor`'s values are readable now (see [`Butterfly::with_pending`]): its parts
    /// may go out and this peer's contribution to the parts of it that it reduces counts.
    /// Naming a tensor that was not pending (or twice) changes nothing.
    pub fn mark_ready(&mut self, tensor: usize) {
        let Some(p) = self.pending.get_mut(tensor) else {
            return;
        };
        if !std::mem::take(p) {
            return;
        }
        if self.state != State::Running || !self.modes[self.cfg.me].is_sender() {
            return;
        }
        // Our own span and those we stand in for.
        let reducers = self.reducer.iter_mut().chain(
            self.stand_ins
                .iter_mut()
                .flatten()
                .map(|si| &mut si.reducer),
        );
        for reducer in reducers {
            for g in reducer.span() {
                let spec = *self.partition.part(g);
                if spec.tensor != tensor {
                    continue;
                }
                let input = own_input(&self.tensors, spec, self.codecs[spec.tensor], &self.pool);
                reducer
                    .accumulate(self.cfg.me, g, input, self.cfg.weight)
                    .expect("own contribution is well-formed: checked weight, own partition");
            }
        }
        self.drain_completed();
        self.check_finished();
    }

    /// Whether some tensor is still pending ([`Butterfly::with_pending`]).
    pub fn has_pending(&self) -> bool {
        self.pending.iter().any(|&p| p)
    }

    /// Where the wait for a link's next message counts from: its last activity `last`, or, for
    /// its first message (`first`), the end of the start grace if that is later (`None`: the
    /// grace never ends, no deadline).
    fn wait_anchor(&self, last: Instant, first: bool) -> Option<Instant> {
        if first {
            self.start_by.map(|by| by.max(last))
        } else {
            Some(last)
        }
    }

    fn check_finished(&mut self) {
        if self.state != State::Running {
            return;
        }
        let sending_done = self
            .out_links
            .iter()
            .flatten()
            .chain(self.stand_in_out.iter().flatten().map(|s| &s.link))
            .all(|l| l.status != LinkStatus::Active);
        let reducing_done = self
            .reducer
            .iter()
            .chain(self.stand_ins.iter().flatten().map(|si| &si.reducer))
            .all(|r| r.is_finished() && !r.has_completed());
        // Finished means every message was handed out too: a driver may stop at `Finished`.
        let drained = self.outbox.iter().all(VecDeque::is_empty);
        // Nor does a round end while a tensor of ours is pending: whoever takes the tensors
        // back may read them (the round deadline cancels a round whose tensors never came).
        if sending_done && reducing_done && drained && !self.has_pending() {
            self.state = State::Finished;
            self.events.push_back(RoundEvent::Finished);
        }
    }

    fn report(&self) -> RoundReport {
        let me = self.cfg.me;
        let mut spans = Vec::new();
        for r in 0..self.modes.len() {
            let parts = self.partition.span(r);
            if parts.is_empty() || (!self.modes[me].is_sender() && r != me) {
                continue;
            }
            let mut segments: Vec<Segment> = Vec::new();
            for g in parts.clone() {
                match segments.last_mut() {
                    Some(seg) if seg.contributors == self.results[g] => seg.parts.end = g + 1,
                    _ => segments.push(Segment {
                        parts: g..g + 1,
                        contributors: self.results[g].clone(),
                    }),
                }
            }
            spans.push(SpanReport {
                reducer: r,
                parts,
                segments,
            });
        }
        RoundReport {
            spans,
            banned: self.banned.clone(),
            failed_reducers: self.failed_reducers.clone(),
        }
    }
}

/// The expected gaps for adaptive timeouts (see [`super::deadline`]): per sender `s`, between
/// its parts to us; per reducer `r`, between its replies to us, with whether one of `r`'s
/// senders has no expectation. All `None` without adaptive timeouts or rates.
fn expected_gaps(
    cfg: &RoundConfig,
    modes: &[Mode],
    partition: &Partition,
) -> (Vec<Option<Duration>>, Vec<ReplyExpectation>) {
    let n = modes.len();
    if cfg.adaptive_timeouts.is_none() {
        return (vec![None; n], vec![(None, true); n]);
    }
    let reduces = |r: usize| modes[r].is_reducer() && !partition.span(r).is_empty();
    let rates = |i: usize| cfg.rates.get(i).copied().unwrap_or_default();
    // Senders into reducer r (other than r), and parts per step on member i's uplink.
    let senders_into = |r: usize| (0..n).filter(|&s| s != r && modes[s].is_sender()).count();
    let uplink_load = |i: usize| {
        let sends = if modes[i].is_sender() {
            (0..n).filter(|&r| r != i && reduces(r)).count()
        } else {
            0
        };
        let replies = if reduces(i) { senders_into(i) } else { 0 };
        sends + replies
    };
    let gap = |s: usize, r: usize| {
        expected_gap(
            cfg.part_size_bytes,
            rates(s).up(),
            uplink_load(s),
            rates(r).down(),
            senders_into(r),
        )
    };
    let me = cfg.me;
    let expected_in = (0..n)
        .map(|s| {
            (s != me && modes[s].is_sender() && reduces(me))
                .then(|| gap(s, me))
                .flatten()
        })
        .collect();
    let expected_reply = (0..n)
        .map(|r| {
            if r == me || !reduces(r) {
                return (None, true);
            }
            let mut unknown = false;
            let mut longest: Option<Duration> = None;
            for s in (0..n).filter(|&s| s != r && modes[s].is_sender()) {
                match gap(s, r) {
                    Some(g) => longest = longer(longest, Some(g)),
                    None => unknown = true,
                }
            }
            // The reducer's own uplink carries its replies and its own parts.
            let own = expected_gap(cfg.part_size_bytes, rates(r).up(), uplink_load(r), None, 0);
            (longer(longest, own), unknown)
        })
        .collect();
    (expected_in, expected_reply)
}
