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

impl Butterfly {
    pub(super) fn can_send_part(&self, to: usize) -> bool {
        if self.state != State::Running {
            return false;
        }
        let Some(l) = &self.out_links[to] else {
            return false;
        };
        l.status == LinkStatus::Active
            && l.next < l.span.end
            && !self.pending[self.partition.part(l.next).tensor]
            && (self.modes[self.cfg.me] == Mode::Client || l.in_flight < l.window.window())
    }

    pub(super) fn make_part(&mut self, to: usize, now: Instant) -> Message {
        let client = self.modes[self.cfg.me] == Mode::Client;
        let link = self.out_links[to]
            .as_mut()
            .expect("can_send_part checked the link");
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
        link.window.on_send(g - link.span.start, now, payload.len());
        Message::Part(PartMessage {
            part: g as u32,
            weight: self.cfg.weight,
            codec: codec.kind(),
            dtype,
            payload,
        })
    }

    pub(super) fn out_deadline(&self, r: usize) -> Option<std::time::Instant> {
        let l = self.out_links[r].as_ref()?;
        if l.status != LinkStatus::Active || l.in_flight == 0 {
            return None;
        }
        if self.modes[self.cfg.me] == Mode::Client && l.next < l.span.end {
            return None;
        }
        // Overflow (an effectively infinite timeout) means no deadline.
        l.last_progress.checked_add(self.reducer_timeout(r))
    }

    /// How long we wait for reducer `r`'s next reply (see [`super::deadline`]).
    fn reducer_timeout(&self, r: usize) -> Duration {
        let fixed = self.cfg.reducer_timeout;
        let Some(bounds) = self.cfg.adaptive_timeouts else {
            return fixed;
        };
        let (expected, unknown_sender) = self.expected_reply[r];
        let observed = self.out_links[r].as_ref().and_then(|l| l.reply_gaps.mean());
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
        let Some(link) = self.out_links[from].as_ref() else {
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
        let g = msg.part as usize;
        if !(link.span.start <= g && g < link.next) || link.replied[g - link.span.start] {
            self.fail_reducer(from, Violation::UnexpectedReply(msg.part), true);
            return;
        }
        let spec = *self.partition.part(g);
        let codec = self.codecs[spec.tensor];
        if let Err(v) = check_encoding(codec, DType::F32, msg.part, msg.codec, msg.dtype) {
            self.fail_reducer(from, v, true);
            return;
        }
        let contributors_ok = if msg.contributors.is_empty() {
            msg.payload.is_empty()
        } else {
            msg.contributors.contains(me)
                && msg.contributors.bound() <= self.modes.len()
                && msg.contributors.iter().all(|s| self.modes[s].is_sender())
        };
        if !contributors_ok {
            self.fail_reducer(from, Violation::BadContributors(msg.part), true);
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
                    self.fail_reducer(from, e.into(), true);
                    return;
                }
                if !msg
                    .finite
                    .unwrap_or_else(|| ops::all_finite_le(&msg.payload))
                {
                    self.fail_reducer(from, Violation::NonFiniteDelta(msg.part), true);
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
                    self.fail_reducer(from, reason, true);
                    return;
                }
                if codec.kind() == CompressionType::SparseTopK {
                    // The average itself, the same for every sender.
                    PartResult::Average(self.pool.freeze_f32(out))
                } else {
                    PartResult::Delta(out)
                }
            };
            let outputs = self.outputs.as_mut().expect("senders have outputs");
            outputs[g] = output;
            self.results[g] = Some(msg.contributors);
        }
        let client = self.modes[me] == Mode::Client;
        let link = self.out_links[from].as_mut().expect("checked above");
        if !client || link.next == link.span.end {
            // Its deadline was running: the time since is a gap between its replies.
            link.reply_gaps
                .add(now.saturating_duration_since(link.last_progress));
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

    /// Marks reducer `r` as failed for us: its remaining parts keep local values.
    pub(super) fn fail_reducer(&mut self, r: usize, reason: Violation, notify: bool) {
        let Some(link) = self.out_links[r].as_mut() else {
            return;
        };
        if link.status != LinkStatus::Active {
            return;
        }
        link.status = LinkStatus::Failed;
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
    }
}
