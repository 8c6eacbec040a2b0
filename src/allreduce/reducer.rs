//! Weighted averaging of one peer's span of parts.
//!
//! For each part of the span the reducer collects one contribution per sender, with the
//! sender's weight. A part is complete once every sender that is not excluded has contributed
//! it; its average `Σ w·x / Σ w` is then computed in a single pass over memory
//! ([`ops::weighted_mean`]): every contribution is read once and the average written once,
//! instead of an accumulator read and written once per contribution. Senders may be at
//! different parts at the same time (out-of-order across senders); contributions of one sender
//! to one part are accepted once. The contributions a part holds until it completes are
//! bounded by the senders' in-flight windows (clients, which have no window, by their span); a
//! received payload is held as the bytes that arrived ([`Input::RawF32`]) and this peer's own
//! values as a view of its tensors ([`Input::Local`]): neither is copied.
//!
//! Contributions are checked for NaN and infinity in the same pass: a non-finite contribution
//! is left out of its part's average and its sender named in [`CompletedPart::non_finite`] (the
//! caller bans it). Excluding (banning) a sender removes it from every part it has not
//! contributed yet, while its earlier contributions stay in their averages, so a part's average
//! is always over exactly the senders listed as its contributors.
//!
//! A part whose contributors all have weight 0, or that has no contributors at all, has no
//! average: it completes with `average = None` and every sender keeps its local values there
//! (hivemind divides by zero and returns NaN).

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use super::peer_set::PeerSet;
use super::robust::Aggregator;
use crate::buffers::BufferPool;
use crate::tensor::ops::{CpuKernel, ReduceKernel, Source};
use crate::tensor::{PartView, Tensor, ops};

/// Largest accepted weight. In the exact f64 fallback no sum of finite f32 values times weights
/// up to this bound overflows, for any group size.
pub const MAX_WEIGHT: f64 = 1e12;

/// Why a contribution was refused. Each one is a protocol violation by the sender, except
/// [`ReduceError::Excluded`], which only means the sender was banned earlier.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ReduceError {
    /// The peer is not a sender of this group.
    #[error("peer {0} is not a sender in this group")]
    NotASender(usize),
    /// The part is not in this reducer's span.
    #[error("part {part} is outside this reducer's span {span:?}")]
    OutsideSpan {
        /// Global part index.
        part: usize,
        /// This reducer's span.
        span: Range<usize>,
    },
    /// The sender already contributed this part.
    #[error("peer {sender} contributed part {part} twice")]
    Duplicate {
        /// Sender.
        sender: usize,
        /// Global part index.
        part: usize,
    },
    /// The values do not have the part's length.
    #[error("part {part} has {expected} elements, got {actual}")]
    Length {
        /// Global part index.
        part: usize,
        /// Expected element count.
        expected: usize,
        /// Received element count.
        actual: usize,
    },
    /// A weight that is negative, NaN, infinite, above [`MAX_WEIGHT`], or positive but below
    /// the smallest normal f64.
    #[error("weight {0} is not 0 or a normal number in [{min:e}, {MAX_WEIGHT:e}]", min = f64::MIN_POSITIVE)]
    BadWeight(f64),
    /// The values contain NaN or infinity (found when the part is reduced; the sender is named
    /// in [`CompletedPart::non_finite`]).
    #[error("part {0} carries non-finite values")]
    NonFinite(usize),
    /// The sender was excluded earlier; the contribution is ignored.
    #[error("peer {0} was excluded from this round")]
    Excluded(usize),
}

/// Whether `w` is an acceptable averaging weight: 0, or a normal number up to [`MAX_WEIGHT`].
pub fn valid_weight(w: f64) -> bool {
    w == 0.0 || (f64::MIN_POSITIVE..=MAX_WEIGHT).contains(&w)
}

/// One sender's contribution as the reducer holds it until its part completes.
type Contribution = (usize, f64, Input);

/// Recomputes `Σ w·x / Σ w` in f64 into `out` (the slow, exact path for averages that came out
/// non-finite in f32: weights below f32's range, or sums above it). Returns whether the result
/// is finite.
fn exact_average(out: &mut [f32], contributions: &[Contribution]) -> bool {
    let mut acc = vec![0.0f64; out.len()];
    let mut den = 0.0;
    let mut scratch = Vec::new();
    for (_, w, x) in contributions {
        ops::add_scaled_f64(&mut acc, x.values(&mut scratch), *w);
        den += w;
    }
    ops::average_into(out, &acc, den);
    ops::all_finite(out)
}

/// A run of this peer's own tensor values, shared with the round that owns the tensors: the
/// reducer reads its own contribution from there, without a copy.
#[derive(Clone)]
pub struct LocalValues {
    tensors: Arc<Vec<Tensor>>,
    tensor: usize,
    range: Range<usize>,
}

impl LocalValues {
    /// Elements `range` of the flattened tensor `tensor` of `tensors`, or `None` if there is no
    /// such run.
    pub fn new(tensors: Arc<Vec<Tensor>>, tensor: usize, range: Range<usize>) -> Option<Self> {
        let numel = tensors.get(tensor)?.numel();
        (range.start <= range.end && range.end <= numel).then_some(Self {
            tensors,
            tensor,
            range,
        })
    }

    /// The values.
    pub fn view(&self) -> PartView<'_> {
        self.tensors[self.tensor].part(self.range.clone())
    }
}

impl fmt::Debug for LocalValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalValues")
            .field("tensor", &self.tensor)
            .field("range", &self.range)
            .finish()
    }
}

/// One sender's values for one part, as the reducer holds them: decoded, still the received
/// little-endian f32 bytes (the lossless codec's payload, used without a decoding copy), or a
/// view of this peer's own tensors.
#[derive(Debug)]
pub enum Input {
    /// Decoded values.
    Values(Vec<f32>),
    /// Little-endian f32 values as received (any alignment; a multiple of 4 bytes).
    RawF32(Bytes),
    /// This peer's own values.
    Local(LocalValues),
}

impl From<Vec<f32>> for Input {
    fn from(v: Vec<f32>) -> Self {
        Input::Values(v)
    }
}

impl Input {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Input::Values(v) => v.len(),
            Input::RawF32(b) => b.len() / 4,
            Input::Local(l) => l.range.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32: borrowed where they are f32 already, else decoded into `scratch`.
    pub fn values<'a>(&'a self, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            Input::Values(v) => v,
            Input::RawF32(b) => {
                scratch.resize(b.len() / 4, 0.0);
                ops::copy_from_le(scratch, b);
                scratch
            }
            Input::Local(l) => match l.view() {
                PartView::F32(x) => x,
                other => {
                    scratch.resize(other.len(), 0.0);
                    other.copy_to_f32(scratch);
                    scratch
                }
            },
        }
    }

    /// Whether every value is finite (no copy, except for a half-precision local view).
    pub fn is_finite(&self) -> bool {
        match self {
            Input::Values(v) => ops::all_finite(v),
            Input::RawF32(b) => ops::all_finite_le(b),
            Input::Local(_) => ops::all_finite(self.values(&mut Vec::new())),
        }
    }

    /// The values as the reduction kernel reads them (no copy).
    pub fn source(&self) -> Source<'_> {
        match self {
            Input::Values(v) => Source::F32(v),
            Input::RawF32(b) => Source::Le(b),
            Input::Local(l) => l.view().into(),
        }
    }
}

/// A part whose contributions are all in.
#[derive(Debug)]
pub struct CompletedPart {
    /// Global part index.
    pub part: usize,
    /// `Σ w·x / Σ w` over `contributors`, or `None` if the total weight is zero.
    pub average: Option<Vec<f32>>,
    /// Senders whose values are in the average (empty when `average` is `None`).
    pub contributors: PeerSet,
    /// The total weight of `contributors` (0 when `average` is `None`).
    pub total_weight: f64,
    /// The inputs of the part's contributors (for replies that depend on them: lossy codecs'
    /// deltas). Non-finite contributions are not among them.
    pub inputs: Vec<(usize, Input)>,
    /// Senders whose contribution held NaN or infinity and was left out (to be banned).
    pub non_finite: Vec<usize>,
}

#[derive(Debug, Default)]
struct PartAcc {
    contributions: Vec<Contribution>,
    contributors: PeerSet,
    done: bool,
}

/// Collects and averages one span of parts from many senders.
#[derive(Debug)]
pub struct Reducer {
    span: Range<usize>,
    lens: Vec<usize>,
    senders: PeerSet,
    excluded: PeerSet,
    parts: Vec<PartAcc>,
    completed: VecDeque<usize>,
    remaining: usize,
    pool: BufferPool,
    kernel: CpuKernel,
    aggregator: Aggregator,
}

impl Reducer {
    /// A reducer for the global parts `span` (with element counts `lens`), expecting a
    /// contribution from every member of `senders`.
    pub fn new(span: Range<usize>, lens: Vec<usize>, senders: PeerSet) -> Self {
        Self::with_pool(span, lens, senders, BufferPool::default())
    }

    /// Like [`Reducer::new`], taking its buffers from (and returning them to) `pool`.
    pub fn with_pool(
        span: Range<usize>,
        lens: Vec<usize>,
        senders: PeerSet,
        pool: BufferPool,
    ) -> Self {
        assert_eq!(span.len(), lens.len(), "one length per part of the span");
        let mut r = Self {
            parts: (0..lens.len()).map(|_| PartAcc::default()).collect(),
            remaining: lens.len(),
            span,
            lens,
            senders,
            excluded: PeerSet::new(),
            completed: VecDeque::new(),
            pool,
            kernel: CpuKernel,
            aggregator: Aggregator::Mean,
        };
        if r.senders.is_empty() {
            for i in 0..r.parts.len() {
                r.try_complete(i);
            }
        }
        r
    }

    /// Combines contributions with `aggregator` instead of the weighted mean.
    pub fn with_aggregator(mut self, aggregator: Aggregator) -> Self {
        self.aggregator = aggregator;
        self
    }

    /// The global part indices this reducer handles.
    pub fn span(&self) -> Range<usize> {
        self.span.clone()
    }

    /// Element count of global part `part` (which must be in the span).
    pub fn part_len(&self, part: usize) -> usize {
        self.lens[part - self.span.start]
    }

    /// Whether every part has completed.
    pub fn is_finished(&self) -> bool {
        self.remaining == 0
    }

    /// Whether completed parts wait to be taken out with [`Reducer::poll_completed`].
    pub fn has_completed(&self) -> bool {
        !self.completed.is_empty()
    }

    /// Whether `sender` has been excluded.
    pub fn is_excluded(&self, sender: usize) -> bool {
        self.excluded.contains(sender)
    }

    /// A buffer of `len` elements from the pool (contents unspecified).
    pub fn take_buffer(&mut self, len: usize) -> Vec<f32> {
        self.pool.take_f32(len)
    }

    /// Returns a buffer to the pool.
    pub fn recycle(&mut self, buf: Vec<f32>) {
        self.pool.put_f32(buf);
    }

    /// Returns an input's buffer to the pool (received bytes go back to theirs on drop).
    pub fn recycle_input(&mut self, input: Input) {
        if let Input::Values(v) = input {
            self.pool.put_f32(v);
        }
    }

    /// Takes `weight · values` from `sender` for global part `part`. The values are held
    /// until the part completes; they are checked for NaN and infinity then, in the averaging
    /// pass, and handed back in [`CompletedPart::inputs`].
    pub fn accumulate(
        &mut self,
        sender: usize,
        part: usize,
        values: impl Into<Input>,
        weight: f64,
    ) -> Result<(), ReduceError> {
        let input = values.into();
        if let Err(e) = self.check(sender, part, input.len(), weight) {
            self.recycle_input(input);
            return Err(e);
        }
        let i = part - self.span.start;
        let p = &mut self.parts[i];
        p.contributors.insert(sender);
        p.contributions.push((sender, weight, input));
        self.try_complete(i);
        Ok(())
    }

    fn check(
        &self,
        sender: usize,
        part: usize,
        len: usize,
        weight: f64,
    ) -> Result<(), ReduceError> {
        if !self.senders.contains(sender) {
            return Err(ReduceError::NotASender(sender));
        }
        if self.excluded.contains(sender) {
            return Err(ReduceError::Excluded(sender));
        }
        if !self.span.contains(&part) {
            return Err(ReduceError::OutsideSpan {
                part,
                span: self.span.clone(),
            });
        }
        let i = part - self.span.start;
        if self.parts[i].contributors.contains(sender) {
            return Err(ReduceError::Duplicate { sender, part });
        }
        if len != self.lens[i] {
            return Err(ReduceError::Length {
                part,
                expected: self.lens[i],
                actual: len,
            });
        }
        if !valid_weight(weight) {
            return Err(ReduceError::BadWeight(weight));
        }
        Ok(())
    }

    /// Excludes `sender` from every part it has not contributed yet. Returns whether it was
    /// newly excluded.
    pub fn exclude(&mut self, sender: usize) -> bool {
        if !self.senders.contains(sender) || !self.excluded.insert(sender) {
            return false;
        }
        for i in 0..self.parts.len() {
            self.try_complete(i);
        }
        true
    }

    /// Whether `sender` has contributed every part already (or the span is empty).
    pub fn has_all_from(&self, sender: usize) -> bool {
        self.parts
            .iter()
            .all(|p| p.done || p.contributors.contains(sender))
    }

    fn try_complete(&mut self, i: usize) {
        let p = &self.parts[i];
        if p.done {
            return;
        }
        let complete = self
            .senders
            .iter()
            .all(|s| self.excluded.contains(s) || p.contributors.contains(s));
        if complete {
            self.parts[i].done = true;
            self.remaining -= 1;
            self.completed.push_back(i);
        }
    }

    /// Averages `contributions` into a pooled buffer of `len` values. Non-finite contributions
    /// are moved out (their senders pushed to `non_finite`) and the rest averaged again; an
    /// average that overflows f32 is recomputed exactly. `None` when the remaining weight is
    /// zero.
    fn average(
        &mut self,
        len: usize,
        contributions: &mut Vec<Contribution>,
        non_finite: &mut Vec<usize>,
    ) -> Option<Vec<f32>> {
        // The sum is the mean's one-pass kernel without the division.
        let sum = match self.aggregator {
            Aggregator::Mean => false,
            Aggregator::Sum => true,
            other => return self.combine(other, len, contributions, non_finite),
        };
        let mut out: Option<Vec<f32>> = None;
        loop {
            let den: f64 = contributions.iter().map(|(_, w, _)| w).sum();
            if den <= 0.0 {
                if let Some(buf) = out {
                    self.pool.put_f32(buf);
                }
                return None;
            }
            let mut buf = out.take().unwrap_or_else(|| self.pool.take_f32(len));
            let sources: Vec<(Source<'_>, f32)> = contributions
                .iter()
                .map(|(_, w, x)| (x.source(), *w as f32))
                .collect();
            let mut bad = vec![false; sources.len()];
            let scale = if sum { 1.0 } else { (1.0 / den) as f32 };
            let finite = self
                .kernel
                .weighted_mean(&sources, scale, &mut buf, &mut bad);
            drop(sources);
            if bad.iter().any(|&b| b) {
                let all = std::mem::take(contributions);
                for ((s, w, x), is_bad) in all.into_iter().zip(bad) {
                    if is_bad {
                        non_finite.push(s);
                        self.recycle_input(x);
                    } else {
                        contributions.push((s, w, x));
                    }
                }
                out = Some(buf);
                continue;
            }
            // A sum past f32's range has no finite result; a mean whose f32 accumulation
            // overflowed is recomputed exactly.
            if finite || (!sum && exact_average(&mut buf, contributions)) {
                return Some(buf);
            }
            // Unreachable with validated weights and finite inputs; never hand out a
            // non-finite average.
            self.pool.put_f32(buf);
            return None;
        }
    }

    /// [`Reducer::average`] with an aggregator other than the mean ([`super::CenteredClip`], sum,
    /// max, min): non-finite contributions are moved out first, zero weights take no part, and
    /// the rest are combined. The result is a sum of finite values (which may overflow to
    /// infinity: then no result), a maximum or minimum of them, or a convex combination.
    fn combine(
        &mut self,
        aggregator: Aggregator,
        len: usize,
        contributions: &mut Vec<Contribution>,
        non_finite: &mut Vec<usize>,
    ) -> Option<Vec<f32>> {
        // Finiteness is read from the inputs as they are (no decoded copy); the values are
        // decoded once, below, for the contributions that stay.
        let all = std::mem::take(contributions);
        for (s, w, x) in all {
            if x.is_finite() {
                contributions.push((s, w, x));
            } else {
                non_finite.push(s);
                self.recycle_input(x);
            }
        }
        let mut scratch: Vec<Vec<f32>> = contributions.iter().map(|_| Vec::new()).collect();
        let inputs: Vec<(&[f32], f64)> = contributions
            .iter()
            .zip(scratch.iter_mut())
            .filter(|((_, w, _), _)| *w > 0.0)
            .map(|((_, w, x), s)| (x.values(s), *w))
            .collect();
        if inputs.is_empty() {
            return None;
        }
        let mut out = self.pool.take_f32(len);
        match aggregator {
            Aggregator::CenteredClip(clip) => {
                clip.aggregate(&inputs, &mut out);
            }
            other => {
                other.element_wise(&inputs, &mut out);
                if !out.iter().all(|v| v.is_finite()) {
                    // A sum past f32's range: never hand out a non-finite result.
                    drop(inputs);
                    self.pool.put_f32(out);
                    return None;
                }
            }
        }
        Some(out)
    }

    /// The next completed part, if any (in completion order), with its average computed.
    pub fn poll_completed(&mut self) -> Option<CompletedPart> {
        let i = self.completed.pop_front()?;
        let len = self.lens[i];
        let mut contributions = std::mem::take(&mut self.parts[i].contributions);
        let mut non_finite = Vec::new();
        let average = self.average(len, &mut contributions, &mut non_finite);
        let (contributors, total_weight) = if average.is_some() {
            (
                PeerSet::from_indices(contributions.iter().map(|(s, _, _)| *s)),
                contributions.iter().map(|(_, w, _)| w).sum(),
            )
        } else {
            (PeerSet::new(), 0.0)
        };
        Some(CompletedPart {
            part: self.span.start + i,
            average,
            contributors,
            total_weight,
            inputs: contributions.into_iter().map(|(s, _, x)| (s, x)).collect(),
            non_finite,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::CenteredClip;
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    /// hivemind's `test_reducer`: senders submit parts in random interleavings (sometimes far
    /// ahead of the others); every part ends as the plain mean.
    #[test]
    fn reducer_like_hivemind() {
        for num_senders in [1usize, 2, 4, 10] {
            for num_parts in [0usize, 1, 100] {
                for sync_prob in [1.0, 0.1, 0.0] {
                    let mut rng = StdRng::seed_from_u64((num_senders * 1000 + num_parts) as u64);
                    let lens: Vec<usize> = (0..num_parts).collect();
                    let inputs: Vec<Vec<Vec<f32>>> = (0..num_senders)
                        .map(|_| {
                            lens.iter()
                                .map(|&n| (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect())
                                .collect()
                        })
                        .collect();
                    let mut r = Reducer::new(
                        10..10 + num_parts,
                        lens.clone(),
                        PeerSet::from_indices(0..num_senders),
                    );
                    let mut next = vec![0usize; num_senders];
                    let mut done = Vec::new();
                    loop {
                        let active: Vec<usize> =
                            (0..num_senders).filter(|&s| next[s] < num_parts).collect();
                        if active.is_empty() {
                            break;
                        }
                        let s = active[rng.random_range(0..active.len())];
                        // With probability sync_prob a sender waits until its previous part
                        // completed; otherwise it runs ahead.
                        let min_next = *next.iter().min().unwrap();
                        if next[s] > min_next && rng.random::<f64>() < sync_prob {
                            continue;
                        }
                        let k = next[s];
                        r.accumulate(s, 10 + k, inputs[s][k].clone(), 1.0).unwrap();
                        next[s] += 1;
                        while let Some(c) = r.poll_completed() {
                            done.push(c);
                        }
                    }
                    assert!(r.is_finished());
                    assert_eq!(done.len(), num_parts);
                    for c in done {
                        let k = c.part - 10;
                        let avg = c.average.clone().unwrap_or_default();
                        assert_eq!(c.inputs.len(), num_senders);
                        for (i, a) in avg.iter().enumerate() {
                            let want: f32 = (0..num_senders).map(|s| inputs[s][k][i]).sum::<f32>()
                                / num_senders as f32;
                            assert!((a - want).abs() <= 1e-5 + 1e-3 * want.abs());
                        }
                        assert_eq!(c.contributors.len(), num_senders);
                    }
                }
            }
        }
    }

    #[test]
    fn weighted_and_excluded() {
        let mut r = Reducer::new(0..2, vec![2, 2], PeerSet::from_indices([0, 1, 2]));
        r.accumulate(0, 0, vec![1.0, 2.0], 1.0).unwrap();
        r.accumulate(1, 0, vec![3.0, 4.0], 3.0).unwrap();
        r.accumulate(0, 1, vec![1.0, 1.0], 1.0).unwrap();
        r.accumulate(2, 1, vec![5.0, 5.0], 1.0).unwrap();
        assert!(r.poll_completed().is_none());
        // Sender 1 banned: stays in part 0 (contributed), excluded from part 1.
        // Sender 2 never sent part 0: ban it too.
        assert!(r.exclude(1));
        assert!(!r.exclude(1));
        let c1 = r.poll_completed().unwrap();
        assert_eq!(c1.part, 1);
        assert_eq!(c1.average.unwrap(), vec![3.0, 3.0]);
        assert_eq!(c1.contributors, PeerSet::from_indices([0, 2]));
        assert!(r.exclude(2));
        let c0 = r.poll_completed().unwrap();
        assert_eq!(c0.average.unwrap(), vec![2.5, 3.5]);
        assert_eq!(c0.contributors, PeerSet::from_indices([0, 1]));
        assert!(r.is_finished());
        assert_eq!(
            r.accumulate(1, 1, vec![0.0, 0.0], 1.0),
            Err(ReduceError::Excluded(1))
        );
    }

    #[test]
    fn rejects_bad_contributions() {
        let mut r = Reducer::new(4..6, vec![2, 3], PeerSet::from_indices([0, 1]));
        assert_eq!(
            r.accumulate(5, 4, vec![0.0; 2], 1.0),
            Err(ReduceError::NotASender(5))
        );
        assert!(matches!(
            r.accumulate(0, 6, vec![0.0; 2], 1.0),
            Err(ReduceError::OutsideSpan { .. })
        ));
        assert!(matches!(
            r.accumulate(0, 4, vec![0.0; 3], 1.0),
            Err(ReduceError::Length {
                expected: 2,
                actual: 3,
                ..
            })
        ));
        for w in [-1.0, f64::NAN, f64::INFINITY, 1e13, 1e-310] {
            assert!(matches!(
                r.accumulate(0, 4, vec![0.0; 2], w),
                Err(ReduceError::BadWeight(_))
            ));
        }
        r.accumulate(0, 4, vec![0.0; 2], 1.0).unwrap();
        assert!(matches!(
            r.accumulate(0, 4, vec![0.0; 2], 1.0),
            Err(ReduceError::Duplicate { .. })
        ));
    }

    /// A non-finite contribution (raw bytes, decoded values or local values; first, middle or
    /// last in arrival order; one or two of them) is left out of the average, which comes out
    /// exactly as if it had never arrived, and its sender is named for a ban.
    #[test]
    fn non_finite_input_is_left_out_of_the_average() {
        let raw = |v: &[f32]| {
            Input::RawF32(Bytes::from(
                v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            ))
        };
        let bad = [1.0, f32::INFINITY, 2.0];
        let local_bad = {
            let t = Tensor::from_f32(&[3], vec![f32::NAN, 0.0, 0.0]).unwrap();
            LocalValues::new(Arc::new(vec![t]), 0, 0..3).unwrap()
        };
        // Both aggregators leave non-finite contributions out (τ = ∞: CenteredClip is the mean).
        let aggregators = [
            super::Aggregator::Mean,
            super::Aggregator::CenteredClip(CenteredClip::new(f64::INFINITY)),
        ];
        for (position, aggregator) in (0..3).flat_map(|p| aggregators.map(|a| (p, a))) {
            for kind in 0..3 {
                for two_bad in [false, true] {
                    let mut r = Reducer::new(0..1, vec![3], PeerSet::from_indices([0, 1, 2, 3]))
                        .with_aggregator(aggregator);
                    let bad_input = || -> Input {
                        match kind {
                            0 => raw(&bad),
                            1 => bad.to_vec().into(),
                            _ => Input::Local(local_bad.clone()),
                        }
                    };
                    let mut good = vec![
                        (0, raw(&[1.0, 2.0, 3.0]), 1.0),
                        (1, Input::from(vec![3.0, 4.0, 5.0]), 3.0),
                    ];
                    good.insert(position.min(good.len()), (2, bad_input(), 1.0));
                    for (s, x, w) in good {
                        r.accumulate(s, 0, x, w).unwrap();
                    }
                    if two_bad {
                        r.accumulate(3, 0, vec![f32::NAN; 3], 1.0).unwrap();
                    } else {
                        r.exclude(3);
                    }
                    let done = r.poll_completed().unwrap();
                    assert_eq!(done.average.unwrap(), vec![2.5, 3.5, 4.5]);
                    assert_eq!(done.contributors, PeerSet::from_indices([0, 1]));
                    let want_bad = if two_bad { vec![2, 3] } else { vec![2] };
                    assert_eq!(done.non_finite, want_bad);
                    let mut scratch = Vec::new();
                    let kept: Vec<Vec<f32>> = done
                        .inputs
                        .iter()
                        .map(|(_, x)| x.values(&mut scratch).to_vec())
                        .collect();
                    assert_eq!(kept, vec![vec![1.0, 2.0, 3.0], vec![3.0, 4.0, 5.0]]);
                }
            }
        }
        // Only non-finite contributions: no average at all.
        let mut r = Reducer::new(0..1, vec![1], PeerSet::from_indices([0]));
        r.accumulate(0, 0, vec![f32::NAN], 1.0).unwrap();
        let done = r.poll_completed().unwrap();
        assert!(done.average.is_none() && done.contributors.is_empty());
        assert_eq!(done.non_finite, vec![0]);
    }

    /// Sum, max and min: against a reference computed here, with weights (a sum multiplies
    /// by them; max and min ignore them), a zero weight that takes no part, a non-finite
    /// contribution left out, and a sum past f32's range that gives no result.
    #[test]
    fn element_wise_ops_match_a_reference() {
        use super::Aggregator::{Max, Min, Sum};
        let inputs: [(usize, Vec<f32>, f64); 4] = [
            (0, vec![1.0, -2.0, 3.5, 0.0], 1.0),
            (1, vec![4.0, 5.0, -6.0, 0.25], 2.0),
            (2, vec![-7.0, 8.0, 9.0, -0.5], 0.5),
            (3, vec![100.0, 100.0, -100.0, 100.0], 0.0),
        ];
        for op in [Sum, Max, Min] {
            let mut r = Reducer::new(0..1, vec![4], PeerSet::from_indices([0, 1, 2, 3, 4]))
                .with_aggregator(op);
            for (s, x, w) in &inputs {
                r.accumulate(*s, 0, x.clone(), *w).unwrap();
            }
            r.accumulate(4, 0, vec![1.0, f32::NAN, 1.0, 1.0], 1.0)
                .unwrap();
            let done = r.poll_completed().unwrap();
            let want: Vec<f32> = (0..4)
                .map(|e| {
                    let live = inputs.iter().filter(|(_, _, w)| *w > 0.0);
                    match op {
                        Sum => live.map(|(_, x, w)| w * f64::from(x[e])).sum::<f64>() as f32,
                        Max => live.map(|(_, x, _)| x[e]).fold(f32::MIN, f32::max),
                        _ => live.map(|(_, x, _)| x[e]).fold(f32::MAX, f32::min),
                    }
                })
                .collect();
            assert_eq!(done.average.unwrap(), want, "{op:?}");
            assert_eq!(done.non_finite, vec![4], "{op:?}");
        }
        let mut r = Reducer::new(0..1, vec![1], PeerSet::from_indices([0, 1])).with_aggregator(Sum);
        r.accumulate(0, 0, vec![f32::MAX], 1.0).unwrap();
        r.accumulate(1, 0, vec![f32::MAX], 1.0).unwrap();
        assert!(
            r.poll_completed().unwrap().average.is_none(),
            "no infinite sum"
        );
    }

    /// Own values are read in place, in their own dtype.
    #[test]
    fn local_values_are_averaged_in_place() {
        let t16 =
            Tensor::from_f32_as(&[4], &[1.0, 2.0, 3.0, 4.0], crate::tensor::DType::F16).unwrap();
        let t32 = Tensor::from_f32(&[4], vec![5.0, 6.0, 7.0, 8.0]).unwrap();
        let tensors = Arc::new(vec![t16, t32]);
        assert!(LocalValues::new(tensors.clone(), 2, 0..1).is_none());
        assert!(LocalValues::new(tensors.clone(), 0, 2..5).is_none());
        let mut r = Reducer::new(0..2, vec![2, 2], PeerSet::from_indices([0, 1]));
        let local = |t, range| Input::Local(LocalValues::new(tensors.clone(), t, range).unwrap());
        r.accumulate(0, 0, local(0, 1..3), 1.0).unwrap();
        r.accumulate(0, 1, local(1, 2..4), 1.0).unwrap();
        r.accumulate(1, 0, vec![0.0, 1.0], 1.0).unwrap();
        r.accumulate(1, 1, vec![1.0, 0.0], 3.0).unwrap();
        assert_eq!(r.poll_completed().unwrap().average.unwrap(), vec![1.0, 2.0]);
        assert_eq!(r.poll_completed().unwrap().average.unwrap(), vec![2.5, 2.0]);
    }

    #[test]
    fn extreme_valid_inputs_stay_finite() {
        // Tiny and huge (valid) weights, values at the f32 limits: the f32 path overflows or
        // underflows, the exact f64 fallback gives the true mean (hivemind: NaN or inf).
        let mut r = Reducer::new(0..2, vec![2, 2], PeerSet::from_indices([0, 1]));
        r.accumulate(0, 0, vec![f32::MAX, 1.0], MAX_WEIGHT).unwrap();
        r.accumulate(1, 0, vec![f32::MAX, 3.0], MAX_WEIGHT).unwrap();
        r.accumulate(0, 1, vec![1.0, -1.0], 1e-300).unwrap();
        r.accumulate(1, 1, vec![3.0, -3.0], 1e-300).unwrap();
        let a = r.poll_completed().unwrap().average.unwrap();
        assert_eq!(a, vec![f32::MAX, 2.0]);
        let b = r.poll_completed().unwrap().average.unwrap();
        assert_eq!(b, vec![2.0, -2.0]);
        // Every input is held until its part completes, so the exact path always has them.
        let mut r = Reducer::new(0..1, vec![1], PeerSet::from_indices([0, 1]));
        r.accumulate(0, 0, vec![-f32::MAX], MAX_WEIGHT).unwrap();
        r.accumulate(1, 0, vec![-f32::MAX], MAX_WEIGHT).unwrap();
        let c = r.poll_completed().unwrap();
        assert_eq!(c.average.unwrap(), vec![-f32::MAX]);
        assert_eq!(c.contributors, PeerSet::from_indices([0, 1]));
    }

    #[test]
    fn zero_weight_and_no_senders_have_no_average() {
        let mut r = Reducer::new(0..1, vec![1], PeerSet::from_indices([0, 1]));
        r.accumulate(0, 0, vec![1.0], 0.0).unwrap();
        r.accumulate(1, 0, vec![2.0], 0.0).unwrap();
        let c = r.poll_completed().unwrap();
        assert!(c.average.is_none() && c.contributors.is_empty());
        let mut empty = Reducer::new(0..3, vec![1, 2, 3], PeerSet::new());
        assert!(empty.is_finished());
        assert!(empty.poll_completed().unwrap().average.is_none());
    }
}
