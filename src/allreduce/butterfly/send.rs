//! The sender side of a butterfly round: this peer's parts of each reducer's span go out
//! through an [`OutLink`] (lazily encoded, within the link's window), and the reducers'
//! averages come back ([`Butterfly::on_averaged`]); a reducer that misses its deadline or
//! breaks the protocol has failed ([`Butterfly::fail_reducer`]).

use std::ops::Range;
use std::time::{Duration, Instant};

use super::super::deadline::{GapMean, longer};
use super::super::window::LinkWindow;
use super::super::{
    AbortReason, AveragedMessage, Message, Mode, PartMessage, PartResult, Role, RoundConfig,
    RoundEvent, Violation,
};
use super::{Butterfly, LinkStatus, State, check_encoding, encode_part};
use crate::compression::{CodecError, CompressionType};
use crate::tensor::{DType, ops};

/// This peer as a sender to one reducer.
#[derive(Debug)]
pub(super) struct OutLink {
    pub(super) span: Range<usize>,
    pub(super) next: usize,
    pub(super) in_flight: usize,
    pub(super) replied: Vec<bool>,
    pub(super) replies: usize,
    pub(super) status: LinkStatus,
    pub(super) last_progress: Instant,
    /// The in-flight window, sized to the link's measured bandwidth-delay product.
    pub(super) window: LinkWindow,
    /// Observed gaps between this reducer's replies (while its deadline runs).
    pub(super) reply_gaps: GapMean,
}

impl OutLink {
    /// A link sending the parts `span` of a reducer, starting at `now`.
    pub(super) fn new(span: Range<usize>, now: Instant, cfg: &RoundConfig) -> Self {
        Self {
            next: span.start,
            in_flight: 0,
            replied: vec![false; span.len()],
            replies: 0,
            status: LinkStatus::Active,
            last_progress: now,
            window: LinkWindow::new(
                span.len(),
                cfg.initial_in_flight_parts,
                cfg.max_in_flight_parts,
            ),
            reply_gaps: GapMean::default(),
            span,
        }
    }
}

/// Our parts of failed reducer `dead`'s span, re-sent to a stand-in (see
/// [`super::stand_in`]).
#[derive(Debug)]
pub(super) struct StandInOut {
    /// The stand-in.
    pub(super) to: usize,
    /// The whole span of `dead`, from its start.
    pub(super) link: OutLink,
}

impl Butterfly {
    /// The out-link to `to` carrying reducer `owner`'s span: our own link to `to` when
    /// `owner == to`, else the stand-in link for `owner`'s span if it goes to `to`.
    pub(super) fn out_link(&self, to: usize, owner: usize) -> Option<&OutLink> {
        if owner == to {
            self.out_links[to].as_ref()
        } else {
            self.stand_in_out[owner]
                .as_ref()
                .filter(|s| s.to == to)
                .map(|s| &s.link)
        }
    }

    fn out_link_mut(&mut self, to: usize, owner: usize) -> Option<&mut OutLink> {
        if owner == to {
            self.out_links[to].as_mut()
        } else {
            self.stand_in_out[owner]
                .as_mut()
                .filter(|s| s.to == to)
                .map(|s| &mut s.link)
        }
    }

    /// The spans whose parts go to `to` (by owner): its own first, then those it stands in
    /// for.
    fn out_owners(&self, to: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(to).chain(
            self.stand_in_out
                .iter()
                .enumerate()
                .filter(move |(_, s)| s.as_ref().is_some_and(|s| s.to == to))
                .map(|(d, _)| d),
        )
    }

    fn link_can_send(&self, l: &OutLink) -> bool {
        l.status == LinkStatus::Active
            && l.next < l.span.end
            && !self.pending[self.partition.part(l.next).tensor]
            && (self.modes[self.cfg.me] == Mode::Client || l.in_flight < l.window.window())
    }

    /// The span (by owner) whose next part may go to `to` now, if any.
    fn sendable(&self, to: usize) -> Option<usize> {
        if self.state != State::Running {
            return None;
        }
        self.out_owners(to).find(|&owner| {
            self.out_link(to, owner)
                .is_some_and(|l| self.link_can_send(l))
        })
    }

    pub(super) fn can_send_part(&self, to: usize) -> bool {
        self.sendable(to).is_some()
    }

    pub(super) fn make_part(&mut self, to: usize, now: Instant) -> Message {
        let client = self.modes[self.cfg.me] == Mode::Client;
        let owner = self.sendable(to).expect("can_send_part checked a link");
        let link = self.out_link_mut(to, owner).expect("sendable names a link");
        let g = link.next;
        link.next += 1;
        if link.in_flight == 0 && !client {
            link.last_progress = now;
        }
        link.in_flight += 1;
        if client && link.next == link.span.end {
            link.last_progress = now;
        }
        let spec = *self.partition.part(g);
        let codec = self.codecs[spec.tensor];
        let (dtype, payload) = encode_part(&self.tensors, spec, codec, &self.pool);
        let link = self.out_link_mut(to, owner).expect("sendable names a link");
        link.window.on_send(g - link.span.start, now, payload.len());
        Message::Part(PartMessage {
            part: g as u32,
            weight: self.cfg.weight,
            codec: codec.kind(),
            dtype,
            payload,
        })
    }

    /// When we stop waiting for reducer `r`'s next reply, over every span it carries for us.
    pub(super) fn out_deadline(&self, r: usize) -> Option<Instant> {
        self.out_owners(r)
            .filter_map(|owner| {
                let l = self.out_link(r, owner)?;
                if l.status != LinkStatus::Active || l.in_flight == 0 {
                    return None;
                }
                if self.modes[self.cfg.me] == Mode::Client && l.next < l.span.end {
                    return None;
                }
                // Overflow (an effectively infinite timeout) means no deadline.
                self.wait_anchor(l.last_progress, l.replies == 0)?
                    .checked_add(self.reducer_timeout(r, l))
            })
            .min()
    }

    /// How long we wait for reducer `r`'s next reply on `link` (see [`super::deadline`]).
    fn reducer_timeout(&self, r: usize, link: &OutLink) -> Duration {
        let fixed = self.cfg.reducer_timeout;
        let Some(bounds) = self.cfg.adaptive_timeouts else {
            return fixed;
        };
        let (expected, unknown_sender) = self.expected_reply[r];
        let observed = link.reply_gaps.mean();
        let slack = fixed.saturating_sub(self.cfg.sender_timeout);
        let adaptive = longer(expected, observed).map(|g| bounds.timeout(g).saturating_add(slack));
        match (adaptive, unknown_sender) {
            (Some(t), false) => t,
            (Some(t), true) => t.max(fixed),
            (None, _) => fixed,
        }
    }

    pub(super) fn on_averaged(&mut self, now: Instant, from: usize, msg: AveragedMessage) {
        let me = self.cfg.me;
        let g = msg.part as usize;
        // A stand-in's answer for the span of the failed reducer it stands in for; anything
        // else is checked against `from`'s own span.
        let owner = self
            .partition
            .owner(g)
            .filter(|&d| d != from && self.out_link(from, d).is_some())
            .unwrap_or(from);
        let Some(link) = self.out_link(from, owner) else {
            // Not a reducer of ours (or ourselves): nothing of ours to fail, just report it.
            self.events.push_back(RoundEvent::Rejected {
                peer: from,
                reason: Violation::UnexpectedReply(msg.part),
            });
            return;
        };
        if link.status != LinkStatus::Active {
            return; // stale reply after a failure
        }
        if !(link.span.start <= g && g < link.next) || link.replied[g - link.span.start] {
            self.fail_reducer(now, from, Violation::UnexpectedReply(msg.part), true);
            return;
        }
        let spec = *self.partition.part(g);
        let codec = self.codecs[spec.tensor];
        if let Err(v) = check_encoding(codec, DType::F32, msg.part, msg.codec, msg.dtype) {
            self.fail_reducer(now, from, v, true);
            return;
        }
        let contributors_ok = if msg.contributors.is_empty() {
            msg.payload.is_empty()
        } else {
            msg.contributors.contains(me)
                && msg.contributors.bound() <= self.modes.len()
                && msg.contributors.iter().all(|s| self.modes[s].is_sender())
                // A failed reducer never sent its own span to anyone.
                && (owner == from || !msg.contributors.contains(owner))
        };
        if !contributors_ok {
            self.fail_reducer(now, from, Violation::BadContributors(msg.part), true);
            return;
        }
        if !msg.contributors.is_empty() {
            let output = if codec.kind() == CompressionType::None {
                // The average itself (f32: `check_encoding` above), kept in the frame it
                // arrived in; checked (by the runner already, where it read the frame), not
                // copied.
                if msg.payload.len() != spec.len * 4 {
                    let e = CodecError::Length {
                        codec: CompressionType::None,
                        expected: spec.len * 4,
                        actual: msg.payload.len(),
                        elements: spec.len,
                    };
                    self.fail_reducer(now, from, e.into(), true);
                    return;
                }
                if !msg
                    .finite
                    .unwrap_or_else(|| ops::all_finite_le(&msg.payload))
                {
                    self.fail_reducer(now, from, Violation::NonFiniteDelta(msg.part), true);
                    return;
                }
                PartResult::Average(msg.payload)
            } else {
                let mut out = self.pool.take_f32(spec.len);
                let failure = match codec.decode(&msg.payload, msg.dtype, &mut out) {
                    Err(e) => Some(e.into()),
                    Ok(()) if !ops::all_finite(&out) => Some(Violation::NonFiniteDelta(msg.part)),
                    Ok(()) => None,
                };
                if let Some(reason) = failure {
                    self.pool.put_f32(out);
                    self.fail_reducer(now, from, reason, true);
                    return;
                }
                if codec.kind() == CompressionType::SparseTopK {
                    // The average itself, the same for every sender.
                    PartResult::Average(self.pool.freeze_f32(out))
                } else {
                    PartResult::Delta(out)
                }
            };
            // A stand-in's answer replaces what the failed reducer may have answered before
            // it failed: every survivor that re-sent ends with the same average.
            let outputs = self.outputs.as_mut().expect("senders have outputs");
            outputs[g] = output;
            self.reply_feedback[g] = None;
            self.results[g] = Some(msg.contributors);
        }
        let client = self.modes[me] == Mode::Client;
        let link = self.out_link(from, owner).expect("checked above");
        let running = !client || link.next == link.span.end;
        // Its deadline was running: the time since it started is a gap between its replies
        // (not a first reply that came within the start grace: that is the start's skew).
        let gap = self
            .wait_anchor(link.last_progress, link.replies == 0)
            .and_then(|anchor| now.checked_duration_since(anchor))
            .filter(|_| running);
        let link = self.out_link_mut(from, owner).expect("checked above");
        if let Some(gap) = gap {
            link.reply_gaps.add(gap);
        }
        link.window.on_ack(g - link.span.start, now);
        link.replied[g - link.span.start] = true;
        link.replies += 1;
        link.in_flight -= 1;
        link.last_progress = now;
        if link.replies == link.span.len() {
            link.status = LinkStatus::Done;
        }
    }

    /// Marks reducer `r` as failed for us, on its own span and on every span it stands in
    /// for. Each of those spans is handed to a stand-in where the round allows
    /// ([`Butterfly::hand_over`]); else its remaining parts keep local values.
    pub(super) fn fail_reducer(&mut self, now: Instant, r: usize, reason: Violation, notify: bool) {
        let mut spans = Vec::new();
        let own = if let Some(link) = self.out_links[r].as_mut()
            && link.status == LinkStatus::Active
        {
            link.status = LinkStatus::Failed;
            spans.push(r);
            true
        } else {
            false
        };
        for (d, s) in self.stand_in_out.iter_mut().enumerate() {
            if let Some(s) = s.as_mut()
                && s.to == r
                && s.link.status == LinkStatus::Active
            {
                s.link.status = LinkStatus::Failed;
                spans.push(d);
            }
        }
        if spans.is_empty() {
            return;
        }
        if !own {
            // Only as a stand-in: it answered its own span, and may simply have finished its
            // round before our parts came. Not a failed reducer; just not asked again.
            self.failed_stand_ins.insert(r);
            for d in spans {
                self.hand_over(now, d);
            }
            return;
        }
        self.failed_reducers.insert(r);
        self.outbox[r].retain(|m| !matches!(m, Message::Part(_)));
        if notify {
            self.outbox[r].push_back(Message::Abort {
                role: Role::Sender,
                reason: AbortReason::Banned,
            });
        }
        self.events
            .push_back(RoundEvent::ReducerFailed { peer: r, reason });
        for d in spans {
            self.hand_over(now, d);
        }
    }
}
