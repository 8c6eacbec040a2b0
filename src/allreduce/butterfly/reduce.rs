//! The reducer side of a butterfly round: each sender's parts of this peer's span arrive
//! through an [`InLink`] ([`Butterfly::on_part`]) and are reduced; every completed part is
//! answered to its contributors ([`Butterfly::drain_completed`]); a sender that misses its
//! deadline or breaks the protocol is banned ([`Butterfly::ban`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::super::deadline::{GapMean, longer};
use super::super::{
    AbortReason, AveragedMessage, Input, LocalValues, Message, Mode, PartMessage, PartResult,
    PeerSet, ReduceError, Reducer, Role, RoundEvent, Violation,
};
use super::{Butterfly, LinkStatus, check_encoding};
use crate::buffers::BufferPool;
use crate::compression::{Codec, CompressionType, sparse};
use crate::tensor::{DType, PartView, Tensor, ops};

/// One sender to this peer as a reducer.
#[derive(Debug)]
pub(super) struct InLink {
    pub(super) weight: Option<f64>,
    pub(super) received: usize,
    pub(super) transmitted: usize,
    pub(super) status: LinkStatus,
    pub(super) last_activity: Instant,
    /// Observed gaps between this sender's parts (while its deadline runs).
    pub(super) gaps: GapMean,
}

/// This peer's own contribution to a part it reduces. Read where it is, when the part is
/// averaged, except under the sparse codec: there it is what the others would receive from
/// it, `decode(encode(values))` (the codec drops most values, and every contribution to a
/// part must count the same way). Values that do not encode finitely come back as NaN, which
/// leaves them out of the average as any non-finite contribution.
pub(super) fn own_input(
    tensors: &Arc<Vec<Tensor>>,
    spec: super::super::PartSpec,
    codec: &dyn Codec,
    pool: &BufferPool,
) -> Input {
    let local = LocalValues::new(tensors.clone(), spec.tensor, spec.range())
        .expect("the partition covers the tensors");
    if codec.kind() != CompressionType::SparseTopK {
        return Input::Local(local);
    }
    let mut payload = pool.take_bytes(64);
    codec.encode(local.view(), &mut payload);
    let mut values = pool.take_f32(spec.len);
    if codec.decode(&payload, DType::F32, &mut values).is_err() {
        values.fill(f32::NAN);
    }
    pool.put_bytes(payload);
    Input::Values(values)
}

impl InLink {
    /// A sender's link, waiting for its first part since `now`.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            weight: None,
            received: 0,
            transmitted: 0,
            status: LinkStatus::Active,
            last_activity: now,
            gaps: GapMean::default(),
        }
    }
}

impl Butterfly {
    pub(super) fn contribute_local(&mut self) {
        let me = self.cfg.me;
        if !self.modes[me].is_sender() {
            return;
        }
        let Some(reducer) = self.reducer.as_mut() else {
            return;
        };
        for g in reducer.span() {
            let spec = *self.partition.part(g);
            if self.pending[spec.tensor] {
                continue; // contributed by `mark_ready`
            }
            let input = own_input(&self.tensors, spec, self.codecs[spec.tensor], &self.pool);
            reducer
                .accumulate(me, g, input, self.cfg.weight)
                .expect("own contribution is well-formed: checked weight, own partition");
        }
    }

    pub(super) fn in_deadline(&self, s: usize) -> Option<Instant> {
        let l = self.in_links[s].as_ref()?;
        let reducer = self.reducer.as_ref()?;
        if l.status != LinkStatus::Active || l.received >= reducer.span().len() {
            return None;
        }
        let owes = l.received > l.transmitted;
        if self.modes[s] != Mode::Client && owes {
            return None;
        }
        l.last_activity.checked_add(self.sender_timeout(s))
    }

    /// How long we wait for sender `s`'s next part (see [`super::deadline`]).
    fn sender_timeout(&self, s: usize) -> Duration {
        let fixed = self.cfg.sender_timeout;
        let Some(bounds) = self.cfg.adaptive_timeouts else {
            return fixed;
        };
        let observed = self.in_links[s].as_ref().and_then(|l| l.gaps.mean());
        longer(self.expected_in[s], observed).map_or(fixed, |g| bounds.timeout(g))
    }

    pub(super) fn on_part(&mut self, now: Instant, from: usize, msg: PartMessage) {
        let link_state = self.in_links[from]
            .as_ref()
            .map(|l| (l.status, l.received, l.transmitted, l.weight));
        let span = self.reducer.as_ref().map(Reducer::span);
        let (Some((status, received, transmitted, weight)), Some(span)) = (link_state, span) else {
            self.events.push_back(RoundEvent::Rejected {
                peer: from,
                reason: Violation::UnexpectedPart {
                    part: msg.part,
                    expected: None,
                },
            });
            return;
        };
        if status != LinkStatus::Active {
            return; // stale part from a banned (or finished) sender
        }
        let window = self.cfg.max_in_flight_parts;
        if self.modes[from] != Mode::Client && received - transmitted >= window {
            self.ban(from, Violation::WindowExceeded(window), true);
            return;
        }
        if let Some(first) = weight
            && first != msg.weight
        {
            self.ban(
                from,
                Violation::WeightChanged {
                    first,
                    now: msg.weight,
                },
                true,
            );
            return;
        }
        let g = span.start + received;
        if msg.part as usize != g {
            self.ban(
                from,
                Violation::UnexpectedPart {
                    part: msg.part,
                    expected: Some(g),
                },
                true,
            );
            return;
        }
        let spec = *self.partition.part(g);
        let codec = self.codecs[spec.tensor];
        let source = self.tensors[spec.tensor].dtype();
        if let Err(v) = check_encoding(codec, source, msg.part, msg.codec, msg.dtype) {
            self.ban(from, v, true);
            return;
        }
        let reducer = self
            .reducer
            .as_mut()
            .expect("span exists, so the reducer does");
        let input = if codec.kind() == CompressionType::None
            && msg.dtype == DType::F32
            && msg.payload.len() == spec.len * 4
        {
            // Raw little-endian f32: summed straight from the received bytes.
            Input::RawF32(msg.payload)
        } else {
            let mut buf = reducer.take_buffer(spec.len);
            if let Err(e) = codec.decode(&msg.payload, msg.dtype, &mut buf) {
                reducer.recycle(buf);
                self.ban(from, e.into(), true);
                return;
            }
            Input::Values(buf)
        };
        if let Err(e) = reducer.accumulate(from, g, input, msg.weight) {
            self.ban(from, e.into(), true);
            return;
        }
        let link = self.in_links[from].as_mut().expect("checked above");
        if self.modes[from] == Mode::Client || link.received == link.transmitted {
            // Its deadline was running: the time since is a gap between its parts.
            link.gaps
                .add(now.saturating_duration_since(link.last_activity));
        }
        link.weight = Some(msg.weight);
        link.received += 1;
        link.last_activity = now;
        if link.received == span.len() {
            link.status = LinkStatus::Done;
        }
    }

    /// Bans sender `s` from our span.
    pub(super) fn ban(&mut self, s: usize, reason: Violation, notify: bool) {
        let Some(link) = self.in_links[s].as_mut() else {
            if s != self.cfg.me && self.reducer.is_some() && !self.modes[s].is_sender() {
                // An aux peer posing as a sender: nothing to exclude, but say so.
                self.events
                    .push_back(RoundEvent::Rejected { peer: s, reason });
            }
            return;
        };
        // A sender that already delivered everything has nothing left to be excluded from (its
        // link closing after a clean finish is not misbehaviour).
        if link.status != LinkStatus::Active {
            return;
        }
        link.status = LinkStatus::Failed;
        self.banned.insert(s);
        self.outbox[s].retain(|m| !matches!(m, Message::Averaged(_)));
        if notify {
            self.outbox[s].push_back(Message::Abort {
                role: Role::Reducer,
                reason: AbortReason::Banned,
            });
        }
        if let Some(r) = self.reducer.as_mut() {
            r.exclude(s);
        }
        self.events
            .push_back(RoundEvent::Banned { peer: s, reason });
    }

    /// Answers every completed part, then deals with the senders whose contributions were not
    /// finite. Banning one excludes it from the parts it has not sent, which may complete
    /// more parts: those are answered in the next turn of the loop, so that nothing completed
    /// stays unanswered when the round may finish.
    pub(super) fn drain_completed(&mut self) {
        loop {
            let non_finite = self.answer_completed();
            if non_finite.is_empty() {
                return;
            }
            for (s, g) in non_finite {
                self.reject_non_finite(s, g);
            }
        }
    }

    /// A contribution of `s` to part `g` was not finite (found when the part completed).
    fn reject_non_finite(&mut self, s: usize, g: usize) {
        if s == self.cfg.me {
            return; // our own values: that part stays local for us (see answer_completed)
        }
        let reason: Violation = ReduceError::NonFinite(g).into();
        let Some(link) = self.in_links[s].as_mut() else {
            return;
        };
        match link.status {
            LinkStatus::Active => self.ban(s, reason, true),
            LinkStatus::Done => {
                // It delivered everything already, so there is nothing left to exclude it
                // from; it is still named, and told that this part has no average for it
                // (it would otherwise wait out its reducer timeout for the reply).
                let spec = *self.partition.part(g);
                let codec = self.codecs[spec.tensor];
                self.outbox[s].push_back(Message::Averaged(AveragedMessage {
                    part: g as u32,
                    codec: codec.kind(),
                    dtype: codec.wire_dtype(DType::F32),
                    contributors: PeerSet::new(),
                    payload: Bytes::new(),
                    finite: None,
                }));
                if self.banned.insert(s) {
                    self.events
                        .push_back(RoundEvent::Banned { peer: s, reason });
                }
            }
            LinkStatus::Failed => {}
        }
    }

    /// Answers every part the reducer has completed; returns the `(sender, part)` pairs whose
    /// contributions were not finite.
    fn answer_completed(&mut self) -> Vec<(usize, usize)> {
        let me = self.cfg.me;
        let mut non_finite = Vec::new();
        let Some(reducer) = self.reducer.as_mut() else {
            return non_finite;
        };
        while let Some(done) = reducer.poll_completed() {
            let g = done.part;
            let spec = *self.partition.part(g);
            let codec = self.codecs[spec.tensor];
            let own_left_out = done.non_finite.contains(&me);
            non_finite.extend(done.non_finite.iter().map(|&s| (s, g)));
            self.results[g] =
                (done.average.is_some() && !own_left_out).then(|| done.contributors.clone());
            // Lossless codec: every sender gets the same bytes, the average itself, shared
            // without a copy (a sender's delta `average − input` is computed when it applies
            // the result). Lossy codecs reply with the delta against the input as the reducer
            // decoded it, so that compression error does not accumulate; they need the
            // average as values first.
            let lossless = codec.kind() == CompressionType::None;
            // Sparse: every sender gets the same bytes too, the average over the union of the
            // positions received (its non-zero values, exact), never densified.
            let sparse = codec.kind() == CompressionType::SparseTopK;
            let mut average = done.average;
            let shared = if sparse {
                average.as_ref().map(|avg| {
                    let mut payload = self.pool.take_bytes(64);
                    sparse::encode_nonzeros_f32(avg, sparse::REPLY_CHUNK_LOG2, &mut payload);
                    self.pool.freeze(payload)
                })
            } else {
                average
                    .take_if(|_| lossless)
                    .map(|avg| self.pool.freeze_f32(avg))
            };
            for (s, input) in done.inputs {
                let Some(link) = self.in_links[s].as_mut() else {
                    reducer.recycle_input(input);
                    continue;
                };
                if link.status == LinkStatus::Failed {
                    reducer.recycle_input(input);
                    continue;
                }
                let payload = match (&shared, &average) {
                    (Some(shared), _) => shared.clone(),
                    (None, Some(avg)) => {
                        self.scratch.resize(spec.len, 0.0);
                        let mut raw = Vec::new();
                        ops::scaled_sub(&mut self.scratch, avg, 1.0, input.values(&mut raw));
                        let mut payload = self.pool.take_bytes(spec.len * 4);
                        codec.encode(PartView::F32(&self.scratch), &mut payload);
                        self.pool.freeze(payload)
                    }
                    (None, None) => Bytes::new(),
                };
                reducer.recycle_input(input);
                let reply = Message::Averaged(AveragedMessage {
                    part: g as u32,
                    codec: codec.kind(),
                    dtype: codec.wire_dtype(DType::F32),
                    contributors: done.contributors.clone(),
                    payload,
                    finite: None,
                });
                // Clients too get each average at once (issue 32: never held behind their
                // own sends).
                self.outbox[s].push_back(reply);
            }
            // Our own result: the exact average (never compressed). Values of ours that are
            // not finite were left out of it: that part stays local for us, as it does in the
            // other reducers' spans, which ban us for them.
            let own = match average {
                Some(avg) => Some(self.pool.freeze_f32(avg)),
                None => shared,
            };
            if let (Some(own), Some(outputs)) = (own, self.outputs.as_mut())
                && !own_left_out
            {
                outputs[g] = PartResult::Average(own);
            }
        }
        non_finite
    }
}
