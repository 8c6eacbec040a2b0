//! Weighted accumulation of one peer's span of parts.
//!
//! For each part of the span the reducer keeps an f32 accumulator `Σ w·x` and the denominator
//! `Σ w` over the senders that actually contributed that part. A part is complete once every
//! sender that is not excluded has contributed it; its average is `Σ w·x / Σ w`. Senders may be
//! at different parts at the same time (out-of-order across senders); contributions of one
//! sender to one part are accepted once. Excluding (banning) a sender removes it from every part
//! it has not contributed yet, while its earlier contributions stay in their averages, so a
//! part's average is always over exactly the senders listed as its contributors.
//!
//! A part whose contributors all have weight 0, or that has no contributors at all, has no
//! average: it completes with `average = None` and every sender keeps its local values there
//! (hivemind divides by zero and returns NaN).

use std::collections::VecDeque;
use std::ops::Range;

use bytes::Bytes;

use super::peer_set::PeerSet;
use crate::buffers::BufferPool;
use crate::tensor::ops;
use crate::tensor::ops::{CpuBuffer, ReduceBuffer};

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
    /// The values contain NaN or infinity.
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

/// Recomputes `Σ w·x / Σ w` in f64 into `out` (the slow, exact path for averages that came out
/// non-finite in f32: weights below f32's range, or sums above it). Needs every contributor's
/// input; returns false if one is missing.
fn exact_average(out: &mut [f32], weights: &[(usize, f64)], inputs: &[(usize, Input)]) -> bool {
    let mut acc = vec![0.0f64; out.len()];
    let mut den = 0.0;
    let mut scratch = Vec::new();
    for &(s, w) in weights {
        let Some((_, x)) = inputs.iter().find(|(i, _)| *i == s) else {
            return false;
        };
        ops::add_scaled_f64(&mut acc, x.values(&mut scratch), w);
        den += w;
    }
    ops::average_into(out, &acc, den);
    ops::all_finite(out)
}

/// One sender's values for one part, as the reducer holds them: decoded, or still the received
/// little-endian f32 bytes (the lossless codec's payload, used without a decoding copy).
#[derive(Debug)]
pub enum Input {
    /// Decoded values.
    Values(Vec<f32>),
    /// Little-endian f32 values as received (any alignment; a multiple of 4 bytes).
    RawF32(Bytes),
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
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32: borrowed when decoded, else decoded into `scratch`.
    pub fn values<'a>(&'a self, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            Input::Values(v) => v,
            Input::RawF32(b) => {
                scratch.resize(b.len() / 4, 0.0);
                ops::copy_from_le(scratch, b);
                scratch
            }
        }
    }

    fn all_finite(&self) -> bool {
        match self {
            Input::Values(v) => ops::all_finite(v),
            Input::RawF32(b) => b
                .chunks_exact(4)
                .all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
        }
    }

    /// `acc = w · self` (`first`) or `acc += w · self`; whether every value was finite.
    fn add_into(&self, acc: &mut CpuBuffer, w: f64, first: bool) -> bool {
        match (self, first) {
            (Input::Values(v), true) => {
                acc.assign_scaled(v, w);
                ops::all_finite(v)
            }
            (Input::Values(v), false) => acc.add_scaled_checked(v, w),
            (Input::RawF32(b), true) => acc.assign_scaled_le(b, w),
            (Input::RawF32(b), false) => acc.add_scaled_le(b, w),
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
    /// The inputs of senders that asked to keep them (to compute their deltas).
    pub inputs: Vec<(usize, Input)>,
}

#[derive(Debug, Default)]
struct PartAcc {
    acc: Option<CpuBuffer>,
    denominator: f64,
    contributors: PeerSet,
    weights: Vec<(usize, f64)>,
    inputs: Vec<(usize, Input)>,
    /// Whether every contribution so far is in `inputs` (so `acc` can be rebuilt from them).
    partial_inputs: bool,
    done: bool,
}

/// Accumulates one span of parts from many senders.
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
        };
        if r.senders.is_empty() {
            for i in 0..r.parts.len() {
                r.try_complete(i);
            }
        }
        r
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

    /// Adds `weight · values` from `sender` to global part `part`. With `keep_input`, the
    /// values are handed back in [`CompletedPart::inputs`]; otherwise the buffer is recycled.
    ///
    /// The finiteness check runs in the same pass as the sum when every contribution to the
    /// part is kept (a non-finite input is then taken out again by rebuilding the sum from the
    /// kept inputs, a rare path); otherwise it runs first.
    pub fn accumulate(
        &mut self,
        sender: usize,
        part: usize,
        values: impl Into<Input>,
        weight: f64,
        keep_input: bool,
    ) -> Result<(), ReduceError> {
        let input = values.into();
        if let Err(e) = self.check(sender, part, input.len(), weight) {
            self.recycle_input(input);
            return Err(e);
        }
        let i = part - self.span.start;
        let fused = keep_input && !self.parts[i].partial_inputs;
        if !fused && !input.all_finite() {
            self.recycle_input(input);
            return Err(ReduceError::NonFinite(part));
        }
        let (mut acc, first) = match self.parts[i].acc.take() {
            Some(acc) => (acc, false),
            None => (CpuBuffer::from_vec(self.pool.take_f32(input.len())), true),
        };
        if !input.add_into(&mut acc, weight, first) {
            self.parts[i].acc = Some(acc);
            self.rebuild(i);
            self.recycle_input(input);
            return Err(ReduceError::NonFinite(part));
        }
        let p = &mut self.parts[i];
        p.acc = Some(acc);
        p.denominator += weight;
        p.contributors.insert(sender);
        p.weights.push((sender, weight));
        if keep_input {
            p.inputs.push((sender, input));
        } else {
            p.partial_inputs = true;
            self.recycle_input(input);
        }
        self.try_complete(i);
        Ok(())
    }

    /// Recomputes part `i`'s sum from its kept inputs (after a non-finite contribution).
    fn rebuild(&mut self, i: usize) {
        let p = &mut self.parts[i];
        let Some(mut acc) = p.acc.take() else {
            return;
        };
        let mut first = true;
        for &(s, w) in &p.weights {
            if let Some((_, x)) = p.inputs.iter().find(|(k, _)| *k == s) {
                x.add_into(&mut acc, w, first);
                first = false;
            }
        }
        if first {
            self.pool.put_f32(acc.into_vec());
        } else {
            self.parts[i].acc = Some(acc);
        }
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

    fn recycle_acc(&mut self, acc: CpuBuffer) {
        self.pool.put_f32(acc.into_vec());
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

    /// The next completed part, if any (in completion order).
    pub fn poll_completed(&mut self) -> Option<CompletedPart> {
        let i = self.completed.pop_front()?;
        let p = &mut self.parts[i];
        let acc = p.acc.take();
        let inputs = std::mem::take(&mut p.inputs);
        let denominator = p.denominator;
        let contributors = std::mem::take(&mut p.contributors);
        let len = self.lens[i];
        let weights = std::mem::take(&mut p.weights);
        let (average, contributors) = match acc {
            Some(acc) if denominator > 0.0 => {
                let mut avg = self.take_buffer(len);
                acc.average_to_host(denominator, &mut avg);
                self.recycle_acc(acc);
                if !ops::all_finite(&avg) && !exact_average(&mut avg, &weights, &inputs) {
                    // Unreachable with validated weights and every input kept; never apply
                    // a non-finite average.
                    self.recycle(avg);
                    (None, PeerSet::new())
                } else {
                    (Some(avg), contributors)
                }
            }
            other => {
                if let Some(acc) = other {
                    self.recycle_acc(acc);
                }
                (None, PeerSet::new())
            }
        };
        Some(CompletedPart {
            part: self.span.start + i,
            average,
            contributors,
            inputs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
                        r.accumulate(s, 10 + k, inputs[s][k].clone(), 1.0, true)
                            .unwrap();
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
        r.accumulate(0, 0, vec![1.0, 2.0], 1.0, false).unwrap();
        r.accumulate(1, 0, vec![3.0, 4.0], 3.0, false).unwrap();
        r.accumulate(0, 1, vec![1.0, 1.0], 1.0, false).unwrap();
        r.accumulate(2, 1, vec![5.0, 5.0], 1.0, false).unwrap();
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
            r.accumulate(1, 1, vec![0.0, 0.0], 1.0, false),
            Err(ReduceError::Excluded(1))
        );
    }

    #[test]
    fn rejects_bad_contributions() {
        let mut r = Reducer::new(4..6, vec![2, 3], PeerSet::from_indices([0, 1]));
        assert_eq!(
            r.accumulate(5, 4, vec![0.0; 2], 1.0, false),
            Err(ReduceError::NotASender(5))
        );
        assert!(matches!(
            r.accumulate(0, 6, vec![0.0; 2], 1.0, false),
            Err(ReduceError::OutsideSpan { .. })
        ));
        assert!(matches!(
            r.accumulate(0, 4, vec![0.0; 3], 1.0, false),
            Err(ReduceError::Length {
                expected: 2,
                actual: 3,
                ..
            })
        ));
        for w in [-1.0, f64::NAN, f64::INFINITY, 1e13, 1e-310] {
            assert!(matches!(
                r.accumulate(0, 4, vec![0.0; 2], w, false),
                Err(ReduceError::BadWeight(_))
            ));
        }
        assert_eq!(
            r.accumulate(0, 4, vec![f32::NAN, 0.0], 1.0, false),
            Err(ReduceError::NonFinite(4))
        );
        r.accumulate(0, 4, vec![0.0; 2], 1.0, false).unwrap();
        assert!(matches!(
            r.accumulate(0, 4, vec![0.0; 2], 1.0, false),
            Err(ReduceError::Duplicate { .. })
        ));
    }

    /// A non-finite contribution in the fused path (kept inputs, raw bytes or decoded values,
    /// first or later contributor) is refused and leaves the part's sum exactly as if it had
    /// never arrived.
    #[test]
    fn non_finite_input_is_taken_out_of_the_fused_sum() {
        let raw = |v: &[f32]| {
            Input::RawF32(Bytes::from(
                v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            ))
        };
        for bad_first in [false, true] {
            for bad_raw in [false, true] {
                let mut r = Reducer::new(0..1, vec![3], PeerSet::from_indices([0, 1, 2]));
                let bad = [1.0, f32::INFINITY, 2.0];
                let bad_input = || -> Input {
                    if bad_raw {
                        raw(&bad)
                    } else {
                        bad.to_vec().into()
                    }
                };
                if bad_first {
                    assert_eq!(
                        r.accumulate(2, 0, bad_input(), 1.0, true),
                        Err(ReduceError::NonFinite(0))
                    );
                }
                r.accumulate(0, 0, raw(&[1.0, 2.0, 3.0]), 1.0, true)
                    .unwrap();
                if !bad_first {
                    assert_eq!(
                        r.accumulate(2, 0, bad_input(), 1.0, true),
                        Err(ReduceError::NonFinite(0))
                    );
                }
                r.accumulate(1, 0, vec![3.0, 4.0, 5.0], 3.0, true).unwrap();
                r.exclude(2);
                let done = r.poll_completed().unwrap();
                assert_eq!(done.average.unwrap(), vec![2.5, 3.5, 4.5]);
                assert_eq!(done.contributors, PeerSet::from_indices([0, 1]));
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

    #[test]
    fn extreme_valid_inputs_stay_finite() {
        // Tiny and huge (valid) weights, values at the f32 limits: the f32 path overflows or
        // underflows, the exact f64 fallback gives the true mean (hivemind: NaN or inf).
        let mut r = Reducer::new(0..2, vec![2, 2], PeerSet::from_indices([0, 1]));
        r.accumulate(0, 0, vec![f32::MAX, 1.0], MAX_WEIGHT, true)
            .unwrap();
        r.accumulate(1, 0, vec![f32::MAX, 3.0], MAX_WEIGHT, true)
            .unwrap();
        r.accumulate(0, 1, vec![1.0, -1.0], 1e-300, true).unwrap();
        r.accumulate(1, 1, vec![3.0, -3.0], 1e-300, true).unwrap();
        let a = r.poll_completed().unwrap().average.unwrap();
        assert_eq!(a, vec![f32::MAX, 2.0]);
        let b = r.poll_completed().unwrap().average.unwrap();
        assert_eq!(b, vec![2.0, -2.0]);
        // Without the inputs there is no exact path: no average, never a non-finite one.
        let mut r = Reducer::new(0..1, vec![1], PeerSet::from_indices([0, 1]));
        r.accumulate(0, 0, vec![f32::MAX], MAX_WEIGHT, false)
            .unwrap();
        r.accumulate(1, 0, vec![f32::MAX], MAX_WEIGHT, false)
            .unwrap();
        let c = r.poll_completed().unwrap();
        assert!(c.average.is_none() && c.contributors.is_empty());
    }

    #[test]
    fn zero_weight_and_no_senders_have_no_average() {
        let mut r = Reducer::new(0..1, vec![1], PeerSet::from_indices([0, 1]));
        r.accumulate(0, 0, vec![1.0], 0.0, false).unwrap();
        r.accumulate(1, 0, vec![2.0], 0.0, false).unwrap();
        let c = r.poll_completed().unwrap();
        assert!(c.average.is_none() && c.contributors.is_empty());
        let mut empty = Reducer::new(0..3, vec![1, 2, 3], PeerSet::new());
        assert!(empty.is_finished());
        assert!(empty.poll_completed().unwrap().average.is_none());
    }
}
