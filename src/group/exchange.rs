//! One member's side of a direct-exchange collective, sans-IO.
//!
//! A [`Plan`] says what flows between members: for each destination, the tensors this member
//! sends it; for each source, the shapes it expects from it. All-gather, reduce-scatter,
//! barrier and point-to-point sends are such plans (see [`super`]); the all-reduce is the
//! butterfly and the broadcast a chain (`chain`) instead.
//!
//! Each flow is cut into parts exactly as a butterfly round cuts tensors
//! ([`Partition`] with one owner), encoded lazily when its link has room (lossless parts are
//! views of the tensors, no copy) and sent in part order as [`Message::Part`]s. A receiver
//! checks each part (order, codec, dtype, length, decodability) and decodes it into the
//! source's buffers. A flow with no elements still sends its one empty part, so that a barrier
//! sees every member arrive.
//!
//! A source that misses `sender_timeout` between parts (counted from the start of the
//! operation), sends a bad part, aborts, or whose link dies is **failed**: its buffers are
//! dropped and [`RoundEvent::Banned`] names it; what it sent so far is not used. The operation
//! ends when every flow is sent (handed to the link) and every expected flow is complete or
//! failed, or at `op_timeout`, which fails every flow still running.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::allreduce::{
    AbortReason, Message, PartMessage, PartSpec, Partition, Role, RoundError, RoundEvent,
    TensorDescriptor, Transmit, Violation, encode_part,
};
use crate::buffers::BufferPool;
use crate::compression::{Codec, Compression};
use crate::tensor::Tensor;

/// Parameters of one exchange, the same on every member except `me`.
#[derive(Clone, Debug)]
pub(crate) struct ExchangeConfig {
    /// Members in the operation.
    pub members: usize,
    /// Our index.
    pub me: usize,
    /// Target encoded part size.
    pub part_size_bytes: usize,
    /// Codec choice per tensor.
    pub compression: Compression,
    /// Longest wait for a source's next part.
    pub sender_timeout: Duration,
    /// Bound on the whole operation.
    pub op_timeout: Option<Duration>,
}

/// What flows: `sends[d]` to member `d`, `expects[s]` from member `s` (`None`: nothing).
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// Per destination, the tensors sent to it.
    pub sends: Vec<Option<Arc<Vec<Tensor>>>>,
    /// Per source, the shapes and dtypes expected from it.
    pub expects: Vec<Option<Arc<[TensorDescriptor]>>>,
}

struct Out {
    tensors: Arc<Vec<Tensor>>,
    parts: Arc<[PartSpec]>,
    codecs: Arc<[&'static dyn Codec]>,
    next: usize,
    stopped: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InStatus {
    Active,
    Done,
    Failed,
}

struct In {
    descriptors: Arc<[TensorDescriptor]>,
    parts: Arc<[PartSpec]>,
    codecs: Arc<[&'static dyn Codec]>,
    next: usize,
    /// Decoded values, per tensor.
    values: Vec<Vec<f32>>,
    last: Instant,
    status: InStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Finished,
    Cancelled,
}

/// The flows received: per source, its tensors when its flow completed.
#[derive(Debug)]
pub(crate) struct Received {
    /// Per source: its values (f32, per tensor, row-major) when complete.
    pub values: Vec<Option<Vec<Vec<f32>>>>,
    /// The shapes of each source's tensors.
    pub descriptors: Vec<Option<Arc<[TensorDescriptor]>>>,
    /// Sources that failed, with why (the driver learns them from the events as they
    /// happen; the tests read them here).
    #[cfg_attr(not(test), allow(dead_code))]
    pub failed: Vec<(usize, Violation)>,
}

/// One member's side of one exchange (see the module docs).
pub(crate) struct Exchange {
    cfg: ExchangeConfig,
    out: Vec<Option<Out>>,
    inc: Vec<Option<In>>,
    events: VecDeque<RoundEvent>,
    aborts: VecDeque<Transmit>,
    failed: Vec<(usize, Violation)>,
    state: State,
    deadline: Option<Instant>,
    cursor: usize,
    pool: BufferPool,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("me", &self.cfg.me)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// A flow's parts, and the codec of each of its tensors.
type Cut = (Arc<[PartSpec]>, Arc<[&'static dyn Codec]>);

/// The parts and codecs of a flow of `descriptors`.
pub(super) fn cut(
    descriptors: &[TensorDescriptor],
    part_size_bytes: usize,
    compression: &Compression,
) -> Result<Cut, RoundError> {
    let partition = Partition::new(descriptors, &[1.0], part_size_bytes, compression)?;
    let codecs = descriptors
        .iter()
        .map(|d| compression.codec_for(d.numel()))
        .collect();
    Ok((partition.parts().into(), codecs))
}

impl Exchange {
    /// Starts an exchange at `now`.
    pub(crate) fn new(
        cfg: ExchangeConfig,
        plan: Plan,
        now: Instant,
        pool: BufferPool,
    ) -> Result<Self, RoundError> {
        let n = cfg.members;
        if cfg.me >= n || plan.sends.len() != n || plan.expects.len() != n {
            return Err(RoundError::NotInGroup {
                me: cfg.me,
                size: n,
            });
        }
        let mut out = Vec::with_capacity(n);
        for (d, sends) in plan.sends.into_iter().enumerate() {
            out.push(match sends {
                Some(tensors) if d != cfg.me => {
                    let descriptors: Vec<_> = tensors.iter().map(TensorDescriptor::of).collect();
                    let (parts, codecs) = cut(&descriptors, cfg.part_size_bytes, &cfg.compression)?;
                    Some(Out {
                        tensors,
                        parts,
                        codecs,
                        next: 0,
                        stopped: false,
                    })
                }
                _ => None,
            });
        }
        let mut inc = Vec::with_capacity(n);
        for (s, expects) in plan.expects.into_iter().enumerate() {
            inc.push(match expects {
                Some(descriptors) if s != cfg.me => {
                    let (parts, codecs) = cut(&descriptors, cfg.part_size_bytes, &cfg.compression)?;
                    // Every element is decoded into before the flow completes, so pooled
                    // buffers need no zeroing.
                    let values = descriptors
                        .iter()
                        .map(|d| pool.take_f32(d.numel()))
                        .collect();
                    Some(In {
                        values,
                        descriptors,
                        parts,
                        codecs,
                        next: 0,
                        last: now,
                        status: InStatus::Active,
                    })
                }
                _ => None,
            });
        }
        let mut machine = Self {
            deadline: cfg.op_timeout.and_then(|t| now.checked_add(t)),
            cfg,
            out,
            inc,
            events: VecDeque::new(),
            aborts: VecDeque::new(),
            failed: Vec::new(),
            state: State::Running,
            cursor: 0,
            pool,
        };
        machine.check_finished();
        Ok(machine)
    }

    fn check_finished(&mut self) {
        if self.state != State::Running {
            return;
        }
        let sent = self
            .out
            .iter()
            .flatten()
            .all(|o| o.stopped || o.next == o.parts.len());
        let received = self
            .inc
            .iter()
            .flatten()
            .all(|i| i.status != InStatus::Active);
        if sent && received {
            self.state = State::Finished;
            self.events.push_back(RoundEvent::Finished);
        }
    }

    fn fail(&mut self, peer: usize, reason: Violation) {
        let mut failed = false;
        if let Some(i) = self.inc.get_mut(peer).and_then(Option::as_mut)
            && i.status == InStatus::Active
        {
            i.status = InStatus::Failed;
            i.values = Vec::new();
            failed = true;
        }
        if let Some(o) = self.out.get_mut(peer).and_then(Option::as_mut)
            && !o.stopped
            && o.next < o.parts.len()
        {
            o.stopped = true;
            failed = true;
        }
        if failed {
            self.failed.push((peer, reason.clone()));
            self.events.push_back(RoundEvent::Banned { peer, reason });
        }
        self.check_finished();
    }

    fn make_part(&mut self, to: usize) -> Message {
        let o = self.out[to].as_mut().expect("checked by the caller");
        let index = o.next;
        o.next += 1;
        let spec = o.parts[index];
        let codec = o.codecs[spec.tensor];
        let (dtype, payload) = encode_part(&o.tensors, spec, codec, &self.pool);
        Message::Part(PartMessage {
            part: index as u32,
            weight: 1.0,
            codec: codec.kind(),
            dtype,
            payload,
        })
    }

    fn on_part(&mut self, now: Instant, from: usize, msg: &PartMessage) -> Result<(), Violation> {
        let Some(i) = self.inc.get_mut(from).and_then(Option::as_mut) else {
            return Err(Violation::UnexpectedPart {
                part: msg.part,
                expected: None,
            });
        };
        if i.status != InStatus::Active {
            return Ok(()); // failed already (or a duplicate after completion: ignored)
        }
        if msg.part as usize != i.next {
            return Err(Violation::UnexpectedPart {
                part: msg.part,
                expected: Some(i.next),
            });
        }
        let spec = i.parts[i.next];
        let codec = i.codecs[spec.tensor];
        let expected_dtype = codec.wire_dtype(i.descriptors[spec.tensor].dtype);
        if msg.codec != codec.kind() || msg.dtype != expected_dtype {
            return Err(Violation::WrongEncoding {
                part: msg.part,
                codec: msg.codec,
                dtype: msg.dtype,
                expected_codec: codec.kind(),
                expected_dtype,
            });
        }
        codec.decode(
            &msg.payload,
            msg.dtype,
            &mut i.values[spec.tensor][spec.range()],
        )?;
        i.next += 1;
        i.last = now;
        if i.next == i.parts.len() {
            i.status = InStatus::Done;
        }
        Ok(())
    }

    /// The flows received (after the exchange finished; buffers move out).
    pub(crate) fn into_received(self) -> Result<Received, RoundError> {
        match self.state {
            State::Running => Err(RoundError::NotFinished),
            State::Cancelled => Err(RoundError::Cancelled),
            State::Finished => {
                let mut values = Vec::with_capacity(self.inc.len());
                let mut descriptors = Vec::with_capacity(self.inc.len());
                for i in self.inc {
                    match i {
                        Some(i) => {
                            values.push((i.status == InStatus::Done).then_some(i.values));
                            descriptors.push(Some(i.descriptors));
                        }
                        None => {
                            values.push(None);
                            descriptors.push(None);
                        }
                    }
                }
                Ok(Received {
                    values,
                    descriptors,
                    failed: self.failed,
                })
            }
        }
    }
}

impl crate::runner::Machine for Exchange {
    fn poll_transmit(
        &mut self,
        _now: Instant,
        mut ready: impl FnMut(usize) -> bool,
    ) -> Option<Transmit> {
        if let Some(pos) = self.aborts.iter().position(|t| ready(t.to)) {
            return self.aborts.remove(pos);
        }
        if self.state != State::Running {
            return None;
        }
        let n = self.out.len();
        for k in 0..n {
            let to = (self.cursor + k) % n;
            let sendable = self.out[to]
                .as_ref()
                .is_some_and(|o| !o.stopped && o.next < o.parts.len());
            if sendable && ready(to) {
                self.cursor = (to + 1) % n;
                let message = self.make_part(to);
                self.check_finished();
                return Some(Transmit { to, message });
            }
        }
        None
    }

    fn poll_event(&mut self) -> Option<RoundEvent> {
        self.events.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        if self.state != State::Running {
            return None;
        }
        self.inc
            .iter()
            .flatten()
            .filter(|i| i.status == InStatus::Active)
            .filter_map(|i| i.last.checked_add(self.cfg.sender_timeout))
            .chain(self.deadline)
            .min()
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
            Message::Part(p) => {
                if let Err(v) = self.on_part(now, from, &p) {
                    self.fail(from, v);
                }
            }
            Message::Averaged(a) => self.fail(from, Violation::UnexpectedReply(a.part)),
            Message::Abort { reason, .. } => self.fail(from, Violation::Aborted(reason)),
            Message::Notice { .. } => self.fail(from, Violation::UnexpectedNotice),
        }
        self.check_finished();
        Ok(())
    }

    fn handle_link_failed(&mut self, _now: Instant, peer: usize) {
        if self.state == State::Running {
            self.fail(peer, Violation::LinkFailed);
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        if self.state != State::Running {
            return;
        }
        if self.deadline.is_some_and(|d| now >= d) {
            for peer in 0..self.cfg.members {
                self.fail(peer, Violation::RoundTimeout);
            }
            // Every flow is stopped or failed now, so `fail` has finished the exchange.
            debug_assert_eq!(self.state, State::Finished);
            return;
        }
        let late: Vec<usize> = self
            .inc
            .iter()
            .enumerate()
            .filter_map(|(s, i)| {
                let i = i.as_ref()?;
                (i.status == InStatus::Active
                    && i.last
                        .checked_add(self.cfg.sender_timeout)
                        .is_some_and(|d| now >= d))
                .then_some(s)
            })
            .collect();
        for s in late {
            self.fail(s, Violation::SenderTimeout);
        }
    }

    fn cancel(&mut self, _now: Instant) {
        if self.state != State::Running {
            return;
        }
        self.state = State::Cancelled;
        for peer in 0..self.cfg.members {
            let active_in = self.inc[peer]
                .as_ref()
                .is_some_and(|i| i.status == InStatus::Active);
            let active_out = self.out[peer]
                .as_ref()
                .is_some_and(|o| !o.stopped && o.next < o.parts.len());
            if active_in || active_out {
                self.aborts.push_back(Transmit {
                    to: peer,
                    message: Message::Abort {
                        role: Role::Sender,
                        reason: AbortReason::Cancelled,
                    },
                });
            }
        }
    }

    fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    fn is_cancelled(&self) -> bool {
        self.state == State::Cancelled
    }

    fn is_drained(&self) -> bool {
        self.aborts.is_empty()
    }
}

#[cfg(test)]
pub(super) mod tests;
