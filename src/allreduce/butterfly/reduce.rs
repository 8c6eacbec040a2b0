//! The reducer side of a butterfly round: each sender's parts of this peer's span arrive
//! through an [`InLink`] ([`Butterfly::on_part`]) and are reduced; every completed part is
//! answered to its contributors ([`Butterfly::drain_completed`]); a sender that misses its
//! deadline or breaks the protocol is banned ([`Butterfly::ban`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::super::deadline::{GapMean, longer};
use super::super::{
    AbortReason, Aggregator, AveragedMessage, Input, LocalValues, Message, Mode, PartMessage,
    PartResult, ReduceError, Reducer, Role, RoundEvent, Violation,
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
    /// The reductions this peer runs: its own span (`None`) and the spans it stands in for
    /// (`Some(d)`, failed reducer `d`'s).
    pub(super) fn lanes(&self) -> Vec<Option<usize>> {
        std::iter::once(None)
            .chain(
                self.stand_ins
                    .iter()
                    .enumerate()
                    .filter(|(_, si)| si.is_some())
                    .map(|(d, _)| Some(d)),
            )
            .collect()
    }

    /// The lane of part `g`, if this peer reduces it: `Some(None)` for its own span,
    /// `Some(Some(d))` for failed reducer `d`'s span it stands in for.
    fn lane_of(&self, g: usize) -> Option<Option<usize>> {
        match self.partition.owner(g)? {
            d if d == self.cfg.me => Some(None),
            d => self.stand_ins[d].is_some().then_some(Some(d)),
        }
    }

    pub(super) fn in_link(&self, lane: Option<usize>, s: usize) -> Option<&InLink> {
        match lane {
            None => self.in_links[s].as_ref(),
            Some(d) => self.stand_ins[d].as_ref()?.links[s].as_ref(),
        }
    }

    fn in_link_mut(&mut self, lane: Option<usize>, s: usize) -> Option<&mut InLink> {
        match lane {
            None => self.in_links[s].as_mut(),
            Some(d) => self.stand_ins[d].as_mut()?.links[s].as_mut(),
        }
    }

    pub(super) fn lane_reducer(&self, lane: Option<usize>) -> Option<&Reducer> {
        match lane {
            None => self.reducer.as_ref(),
            Some(d) => self.stand_ins[d].as_ref().map(|si| &si.reducer),
        }
    }

    fn lane_reducer_mut(&mut self, lane: Option<usize>) -> Option<&mut Reducer> {
        match lane {
            None => self.reducer.as_mut(),
            Some(d) => self.stand_ins[d].as_mut().map(|si| &mut si.reducer),
        }
    }

    pub(super) fn contribute_local(&mut self) {
        if let Some(reducer) = self.reducer.take() {
            self.reducer = Some(self.with_own_values(reducer));
        }
    }

    /// `reducer` with this peer's own values accumulated for every part of its span, if this
    /// peer is a sender (parts of a pending tensor come with `mark_ready`).
    pub(super) fn with_own_values(&self, mut reducer: Reducer) -> Reducer {
        let me = self.cfg.me;
        if !self.modes[me].is_sender() {
            return reducer;
        }
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
        reducer
    }

    /// When we stop waiting for sender `s`'s next part in `lane`.
    pub(super) fn in_deadline(&self, lane: Option<usize>, s: usize) -> Option<Instant> {
        let l = self.in_link(lane, s)?;
        let reducer = self.lane_reducer(lane)?;
        if l.status != LinkStatus::Active || l.received >= reducer.span().len() {
            return None;
        }
        let owes = l.received > l.transmitted;
        if self.modes[s] != Mode::Client && owes {
            return None;
        }
        self.wait_anchor(l.last_activity, l.received == 0)?
            .checked_add(self.sender_timeout(s, l))
    }

    /// How long we wait for sender `s`'s next part on `link` (see [`super::deadline`]).
    fn sender_timeout(&self, s: usize, link: &InLink) -> Duration {
        let fixed = self.cfg.sender_timeout;
        let Some(bounds) = self.cfg.adaptive_timeouts else {
            return fixed;
        };
        let observed = link.gaps.mean();
        longer(self.expected_in[s], observed).map_or(fixed, |g| bounds.timeout(g))
    }

    pub(super) fn on_part(&mut self, now: Instant, from: usize, msg: PartMessage) {
        let lane = self.stand_in_lane(msg.part as usize, from);
        if let Some(d) = lane {
            let g = msg.part as usize;
            if !self.open_stand_in(now, d) {
                // Standing in for as many spans as we may: no average, keep local.
                self.answer_empty(from, g);
                return;
            }
            let excluded = self
                .in_link(lane, from)
                .is_some_and(|l| l.status == LinkStatus::Failed);
            if excluded && !self.banned.contains(from) {
                // Its deadline here passed: it keeps its own values for the rest.
                self.answer_empty(from, g);
                return;
            }
        }
        let link_state = self
            .in_link(lane, from)
            .map(|l| (l.status, l.received, l.transmitted, l.weight));
        let span = self.lane_reducer(lane).map(Reducer::span);
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
            .lane_reducer_mut(lane)
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
        let client = self.modes[from] == Mode::Client;
        let link = self.in_link(lane, from).expect("checked above");
        let running = client || link.received == link.transmitted;
        // Its deadline was running: the time since it started is a gap between its parts (not
        // a first part that came within the start grace: that is the start's skew).
        let gap = self
            .wait_anchor(link.last_activity, link.received == 0)
            .and_then(|anchor| now.checked_duration_since(anchor))
            .filter(|_| running);
        let link = self.in_link_mut(lane, from).expect("checked above");
        if let Some(gap) = gap {
            link.gaps.add(gap);
        }
        link.weight = Some(msg.weight);
        link.received += 1;
        link.last_activity = now;
        if link.received == span.len() {
            link.status = LinkStatus::Done;
        }
    }

    /// A reply to sender `to` for part `part` went out: the link it answers owes one less.
    pub(super) fn reply_sent(&mut self, now: Instant, to: usize, part: usize) {
        let Some(lane) = self.lane_of(part) else {
            return; // a refused stand-in's "no average": no link owes it
        };
        if let Some(link) = self.in_link_mut(lane, to) {
            link.transmitted += 1;
            link.last_activity = now;
        }
    }

    /// Bans sender `s` from our span (and leaves it out of the spans we stand in for).
    pub(super) fn ban(&mut self, s: usize, reason: Violation, notify: bool) {
        for d in 0..self.stand_ins.len() {
            self.exclude_from_stand_in(d, s);
        }
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
            let mut non_finite = Vec::new();
            for lane in self.lanes() {
                non_finite.extend(self.answer_completed(lane));
            }
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
        let Some(lane) = self.lane_of(g) else {
            return;
        };
        let Some(link) = self.in_link(lane, s) else {
            return;
        };
        match link.status {
            LinkStatus::Active => self.ban(s, reason, true),
            LinkStatus::Done => {
                // It delivered everything already, so there is nothing left to exclude it
                // from; it is told that this part has no average for it (it would otherwise
                // wait out its reducer timeout for the reply), and named, in our own span.
                self.answer_empty(s, g);
                if lane.is_none() && self.banned.insert(s) {
                    self.events
                        .push_back(RoundEvent::Banned { peer: s, reason });
                }
            }
            LinkStatus::Failed => {}
        }
    }

    /// Answers every part `lane`'s reducer has completed; returns the `(sender, part)` pairs
    /// whose contributions were not finite.
    fn answer_completed(&mut self, lane: Option<usize>) -> Vec<(usize, usize)> {
        let me = self.cfg.me;
        let mut non_finite = Vec::new();
        let (reducer, links) = match lane {
            None => match self.reducer.as_mut() {
                Some(r) => (r, &mut self.in_links),
                None => return non_finite,
            },
            Some(d) => match self.stand_ins[d].as_mut() {
                Some(si) => (&mut si.reducer, &mut si.links),
                None => return non_finite,
            },
        };
        while let Some(done) = reducer.poll_completed() {
            let g = done.part;
            let spec = *self.partition.part(g);
            let codec = self.codecs[spec.tensor];
            let own_left_out = done.non_finite.contains(&me);
            non_finite.extend(done.non_finite.iter().map(|&s| (s, g)));
            // Standing in, we take our own answer where we gave up on the failed reducer
            // ourselves (it replaces what that reducer answered before, as at the senders that
            // re-sent) or have no answer yet; one that still answers us keeps its answers.
            let take_own = match lane {
                None => true,
                Some(d) => self.failed_reducers.contains(d) || self.results[g].is_none(),
            };
            let own_average = done.average.is_some() && !own_left_out;
            if lane.is_none() {
                self.results[g] = own_average.then(|| done.contributors.clone());
            } else if own_average && take_own && self.outputs.is_some() {
                self.results[g] = Some(done.contributors.clone());
            }
            // Lossless codec: every sender gets the same bytes, the average itself, shared
            // without a copy (a sender's delta `average − input` is computed when it applies
            // the result). Lossy codecs reply with the delta against the input as the reducer
            // decoded it, so that compression error does not accumulate; they need the
            // average as values first.
            let lossless = codec.kind() == CompressionType::None;
            // Sparse: every sender gets the same bytes too, the average over the union of the
            // positions received (its non-zero values, exact or quantized to the codec's reply
            // bits), never densified.
            let sparse_codec = codec.sparse();
            let mut average = done.average;
            // A quantized sparse reply: what every sender decodes from it, written while it is
            // encoded (our own result, below).
            let mut decoded = None;
            let shared = if let Some(sparse_codec) = sparse_codec {
                average.as_ref().map(|avg| {
                    let mut payload = self.pool.take_bytes(64);
                    if sparse_codec.reply_bits() == sparse::RAW_F32_BITS {
                        sparse_codec.encode_reply(avg, &mut payload);
                    } else {
                        let mut values = self.pool.take_f32(spec.len);
                        // Our own encoding of a finite average: it decodes (checked, never
                        // assumed).
                        if sparse_codec.encode_reply_decoded(avg, &mut payload, &mut values) {
                            decoded = Some(values);
                        } else {
                            self.pool.put_f32(values);
                        }
                    }
                    self.pool.freeze(payload)
                })
            } else {
                average
                    .take_if(|_| lossless)
                    .map(|avg| self.pool.freeze_f32(avg))
            };
            for (s, input) in done.inputs {
                let Some(link) = links[s].as_mut() else {
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
            // A quantized sparse reply: our own result is the decoded reply, as every sender
            // applies it (all peers hold the same values), and its error, `average − reply`,
            // goes to our error feedback, scaled so that the group's next average carries it
            // once (`Outcome::reply_feedback`).
            let mut feedback = None;
            if let (Some(avg), Some(mut decoded)) = (average.as_mut(), decoded) {
                let mine = done.contributors.contains(me);
                let scale = match self.cfg.aggregator {
                    Aggregator::Mean if mine && self.cfg.weight > 0.0 => {
                        Some(done.total_weight / self.cfg.weight)
                    }
                    Aggregator::Sum if mine => Some(1.0),
                    _ => None,
                };
                feedback = scale.map(|scale| {
                    avg.iter()
                        .zip(&decoded)
                        .map(|(a, d)| ((f64::from(*a) - f64::from(*d)) * scale) as f32)
                        .collect::<Vec<f32>>()
                });
                std::mem::swap(avg, &mut decoded);
                self.pool.put_f32(decoded);
            }
            // Our own result: the exact average (never compressed; the decoded reply where
            // replies are quantized). Values of ours that are not finite were left out of it:
            // that part stays local for us, as it does in the other reducers' spans, which ban
            // us for them.
            let own = match average {
                Some(avg) => Some(self.pool.freeze_f32(avg)),
                None => shared,
            };
            if let (Some(own), Some(outputs)) = (own, self.outputs.as_mut())
                && !own_left_out
                && take_own
            {
                outputs[g] = PartResult::Average(own);
                self.reply_feedback[g] = feedback;
            }
        }
        non_finite
    }
}
