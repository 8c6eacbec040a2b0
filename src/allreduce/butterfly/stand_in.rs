//! Re-reducing a failed reducer's span at a stand-in (issue 32, item 4).
//!
//! When a sender gives up on reducer `d` (a missed deadline, a broken link, an abort, a
//! malformed reply), the parts of `d`'s span it has no answer for would keep its local values.
//! Instead, where the round allows ([`RoundConfig::stand_ins`](crate::allreduce::RoundConfig::stand_ins) and time before the round's
//! deadline), the sender hands the span over ([`Butterfly::hand_over`]):
//!
//! * **Who stands in**: the first member after `d` in the group's cyclic order that reduces a
//!   non-empty span and has not failed for this sender itself. Every sender computes it from
//!   what it knows; senders that agree on who failed pick the same stand-in, and those that
//!   do not pick different ones (each reduces over whoever reaches it, see below).
//! * **What is re-sent**: the sender's values of `d`'s *whole* span, from its first part, in
//!   order, through an ordinary [`Message::Part`] stream with the usual window. The whole span,
//!   not only the parts still unanswered, so that every survivor contributes every part and
//!   each part's average at the stand-in is over every survivor that re-sent (a part `d`
//!   answered before it failed is re-averaged too, and the stand-in's answer replaces `d`'s).
//!   A stand-in that is this peer itself takes its own values directly.
//! * **The stand-in** ([`StandIn`]) recognises a part of another member's span and reduces
//!   that span beside its own, with a [`Reducer`] expecting every sender except `d`, and an
//!   [`InLink`] per sender with the usual sender deadline counted from when the stand-in
//!   opened. It contributes its own values at once if it is a sender. Each completed part is
//!   answered like any part ([`Message::Averaged`], with the exact contributor set), and the
//!   stand-in takes the average as its own result too. A sender that misses its deadline here
//!   is only left out of this span (no ban, no event: it may simply still trust `d`); parts it
//!   sends later are answered "no average" (empty contributors), so it keeps its own values
//!   there and does not wait out a reducer timeout. A protocol violation bans it as anywhere.
//! * **A stand-in that fails too** fails for the sender on every span it carries; each is
//!   handed over again, to the next member in order, at most [`MAX_HANDOVERS`] times per span.
//!   One that answered its own span and fails only as a stand-in (it may have finished its
//!   round before our parts came) is not counted a failed reducer: no event, no abort, just
//!   not asked again.
//!
//! Bounds: a peer stands in for at most [`MAX_STAND_IN_SPANS`] spans at once (memory: each
//! holds at most a window of parts per sender, as its own span does); parts of any further
//! span are answered "no average". A sender hands over only while the round's deadline is more
//! than a fixed `reducer_timeout` away: otherwise the span keeps local values, as before.
//!
//! Wire compatibility: no new message or field. A stand-in's traffic is ordinary parts and
//! replies, but a peer that predates stand-ins bans a sender whose part lies outside its span.
//! So members declare that they understand stand-ins (`MemberData.stand_ins`, absent = no), and
//! the averager turns [`RoundConfig::stand_ins`](crate::allreduce::RoundConfig::stand_ins) on
//! only in a group where every member declared it (this version does:
//! `crate::matchmaking::MemberInfo::stand_ins`). It is off by default in `RoundConfig`; the
//! simulator and `bench-worker` turn it on.

use std::time::Instant;

use super::super::{AveragedMessage, Message, PeerSet, Reducer};
use super::{Butterfly, InLink, LinkStatus, StandInOut, State};
use crate::tensor::DType;

/// Most spans of failed reducers one peer reduces as a stand-in at the same time.
pub const MAX_STAND_IN_SPANS: usize = 2;

/// Most stand-ins one sender tries, one after another, for one failed reducer's span.
pub const MAX_HANDOVERS: u8 = 2;

/// This peer's reduction of a failed reducer's span, as its stand-in.
#[derive(Debug)]
pub(super) struct StandIn {
    /// The span's parts, expecting every sender but the failed reducer.
    pub(super) reducer: Reducer,
    /// Per sender: its parts of the span (`None` for this peer, the failed reducer, aux peers).
    pub(super) links: Vec<Option<InLink>>,
}

impl Butterfly {
    /// The stand-in we re-send failed reducer `d`'s span to: the first member after `d`, in
    /// cyclic order, that reduces a non-empty span and has not failed for us (ourselves
    /// included).
    fn pick_stand_in(&self, d: usize) -> Option<usize> {
        let n = self.modes.len();
        let me = self.cfg.me;
        (1..n).map(|k| (d + k) % n).find(|&c| {
            self.modes[c].is_reducer()
                && !self.partition.span(c).is_empty()
                && !self.failed_reducers.contains(c)
                && !self.failed_stand_ins.contains(c)
                && (c == me || self.out_links[c].is_some())
        })
    }

    /// Whether a span handed over now could still be answered before the round's deadline.
    fn time_allows(&self, now: Instant) -> bool {
        self.round_deadline.is_none_or(|deadline| {
            now.checked_add(self.cfg.reducer_timeout)
                .is_some_and(|by| by < deadline)
        })
    }

    /// Re-sends our values of failed reducer `d`'s span to a stand-in, where the round allows
    /// (see the [module docs](self)); else they keep local values.
    pub(super) fn hand_over(&mut self, now: Instant, d: usize) {
        let me = self.cfg.me;
        if !self.cfg.stand_ins
            || self.state != State::Running
            || !self.modes[me].is_sender()
            || self.handovers[d] >= MAX_HANDOVERS
            || !self.time_allows(now)
        {
            return;
        }
        let Some(t) = self.pick_stand_in(d) else {
            return;
        };
        self.handovers[d] += 1;
        if t == me {
            self.stand_in_out[d] = None;
            self.open_stand_in(now, d);
        } else {
            self.stand_in_out[d] = Some(StandInOut {
                to: t,
                link: super::OutLink::new(self.partition.span(d), now, &self.cfg),
            });
        }
    }

    /// The failed reducer whose span part `g` from `from` belongs to, if this peer would
    /// stand in for it: stand-ins on, this peer reduces a span and `g` lies in another
    /// member's span, and `from` is a sender other than that member.
    pub(super) fn stand_in_lane(&self, g: usize, from: usize) -> Option<usize> {
        if !self.cfg.stand_ins || self.reducer.is_none() || !self.modes[from].is_sender() {
            return None;
        }
        let d = self.partition.owner(g)?;
        (d != self.cfg.me && d != from).then_some(d)
    }

    /// Starts reducing failed reducer `d`'s span (no-op if it runs already); returns whether it
    /// runs ([`MAX_STAND_IN_SPANS`]).
    pub(super) fn open_stand_in(&mut self, now: Instant, d: usize) -> bool {
        if self.stand_ins[d].is_some() {
            return true;
        }
        if self.stand_ins.iter().flatten().count() >= MAX_STAND_IN_SPANS {
            return false;
        }
        let me = self.cfg.me;
        let n = self.modes.len();
        let span = self.partition.span(d);
        let senders =
            PeerSet::from_indices((0..n).filter(|&s| s != d && self.modes[s].is_sender()));
        let lens = self.partition.parts()[span.clone()]
            .iter()
            .map(|p| p.len)
            .collect();
        let mut reducer = Reducer::with_pool(span, lens, senders.clone(), self.pool.clone())
            .with_aggregator(self.cfg.aggregator);
        let mut links: Vec<Option<InLink>> = (0..n)
            .map(|s| (s != me && senders.contains(s)).then(|| InLink::new(now)))
            .collect();
        // Senders this peer banned take no part here either.
        for s in self.banned.iter() {
            if let Some(l) = links.get_mut(s).and_then(Option::as_mut) {
                l.status = LinkStatus::Failed;
                reducer.exclude(s);
            }
        }
        let reducer = self.with_own_values(reducer);
        self.stand_ins[d] = Some(StandIn { reducer, links });
        true
    }

    /// Leaves sender `s` out of the stand-in reduction of `d`'s span (its deadline there
    /// passed): not a ban, it may still trust `d`.
    pub(super) fn exclude_from_stand_in(&mut self, d: usize, s: usize) {
        if let Some(si) = self.stand_ins[d].as_mut()
            && let Some(l) = si.links[s].as_mut()
            && l.status == LinkStatus::Active
        {
            l.status = LinkStatus::Failed;
            si.reducer.exclude(s);
        }
    }

    /// Answers part `g` to `to` with "no average, keep your values" (empty contributors).
    pub(super) fn answer_empty(&mut self, to: usize, g: usize) {
        let codec = self.codecs[self.partition.part(g).tensor];
        self.outbox[to].push_back(Message::Averaged(AveragedMessage {
            part: g as u32,
            codec: codec.kind(),
            dtype: codec.wire_dtype(DType::F32),
            contributors: PeerSet::new(),
            payload: bytes::Bytes::new(),
            finite: None,
        }));
    }
}
