//! Error feedback for [`SparseTopK`]: each peer keeps, per element, the residual of what it did
//! not send, and adds it to its next round's input.
//!
//! A round with error feedback, for one peer with input `x` (its tensors when the round
//! starts) and residual `r` (zero at first):
//!
//! 1. [`ErrorFeedback::prepare`]: `z = x + r`, and per part of the round's partition
//!    `y = decode(encode(z))`: what the reducers will receive. The round runs on `y`; the
//!    codec reproduces `y` exactly when it encodes it again (see [`super::sparse`]), and this
//!    peer's own span reads `y` directly, so every reducer averages exactly `y`.
//! 2. The round. Nothing of the residual changes while it runs.
//! 3. [`ErrorFeedback::commit`], only for a round that finished, part by part:
//!    * the part has an average that names this peer (a reply, or its own span) and the
//!      peer's weight is positive: `y` was applied, so `r ← z − y` (the values dropped or
//!      rounded away); with weight 0 it was not (`r ← z`), and the peer takes the average;
//!    * the part stayed local (its reducer died, banned this peer, or had no average): this
//!      peer's `y` reached no average that it knows of, so nothing counts as sent:
//!      `r ← z = x + r`, and the part's result becomes 0 (the tensor gets `0 − x` under the
//!      delta rule: it holds only what the group averaged, and the input is not applied twice,
//!      once locally and once from the residual later).
//!
//!    * reducer-side feedback: where the part's result is a quantized reply this peer encoded
//!      itself (its own span, or one it stood in for; [`SparseTopK::reply_bits`] below 32),
//!      the group applied `avg − e` instead of the average `avg`; the outcome carries
//!      `s · e` for the part ([`Outcome::reply_feedback`], `s` the contributors' total
//!      weight over this peer's), and `r ← r + s · e`: the group's next average (same weights)
//!      carries `e` once.
//!
//!    A round that fails (an error, a cancel, a timeout) never reaches `commit`: the residual
//!    stays what it was and the tensors are untouched, so nothing is lost.
//!
//! Hence, over any sequence of rounds, `Σ applied + r = Σ x + Σ s · e` exactly up to f32
//! rounding (`applied` = `y` where the peer's report names it, 0 elsewhere; `s · e` the reply
//! feedback it received): the quantizer's and the sparsifier's errors sit in `r`, not lost.
//! Over the group (equal weights, every part averaged), the applied averages plus the mean
//! residual equal the mean of the inputs: the replies' quantization error is not lost either. One caveat stays: a reducer that dies after
//! answering some senders but not this one applied this peer's `y` for them, while this peer
//! keeps it in its residual and sends it again later (counted twice by the group, never
//! lost). Error feedback is meant for additive quantities (gradients, pseudo-gradients), not
//! parameters.

use bytes::Bytes;

use super::{Compression, SparseTopK};
use crate::allreduce::{Outcome, PartResult, PartSpec, Partition, TensorDescriptor};
use crate::tensor::{DType, Tensor, TensorError};

/// Why error feedback could not prepare or commit a round.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum FeedbackError {
    /// The tensors or the outcome do not have the layout the residuals were made for.
    #[error("error feedback: {0}")]
    Layout(String),
    /// The input plus the residual is not finite: nothing can be sent (the residual is kept).
    #[error("error feedback: the input holds NaN or infinity")]
    NonFinite,
}

impl From<TensorError> for FeedbackError {
    fn from(e: TensorError) -> Self {
        Self::Layout(e.to_string())
    }
}

/// One peer's residuals (see the module docs).
#[derive(Debug, Clone)]
pub struct ErrorFeedback {
    codec: SparseTopK,
    part_size_bytes: usize,
    shapes: Vec<Vec<usize>>,
    residuals: Vec<Vec<f32>>,
}

impl ErrorFeedback {
    /// Zero residuals for tensors of these shapes, for rounds with `codec` and parts of
    /// `part_size_bytes`.
    pub fn new(
        codec: SparseTopK,
        part_size_bytes: usize,
        descriptors: &[TensorDescriptor],
    ) -> Self {
        Self {
            codec,
            part_size_bytes,
            shapes: descriptors.iter().map(|d| d.shape.clone()).collect(),
            residuals: descriptors.iter().map(|d| vec![0.0; d.numel()]).collect(),
        }
    }

    /// The residuals, per tensor, flattened.
    pub fn residuals(&self) -> &[Vec<f32>] {
        &self.residuals
    }

    /// The codec.
    pub fn codec(&self) -> SparseTopK {
        self.codec
    }

    /// The parts the round will cut (the round runs on f32 tensors of these shapes; the
    /// partition's parts do not depend on the group).
    pub fn parts(&self) -> Result<Vec<PartSpec>, FeedbackError> {
        let descriptors: Vec<TensorDescriptor> = self
            .shapes
            .iter()
            .map(|shape| TensorDescriptor {
                shape: shape.clone(),
                dtype: DType::F32,
            })
            .collect();
        let partition = Partition::new(
            &descriptors,
            &[1.0],
            self.part_size_bytes,
            &Compression::Sparse(self.codec),
        )
        .map_err(|e| FeedbackError::Layout(e.to_string()))?;
        Ok(partition.parts().to_vec())
    }

    fn check_inputs(&self, inputs: &[Tensor]) -> Result<(), FeedbackError> {
        if inputs.len() != self.shapes.len()
            || inputs.iter().zip(&self.shapes).any(|(t, s)| t.shape() != s)
        {
            return Err(FeedbackError::Layout(
                "the tensors do not have the shapes the residuals were made for".into(),
            ));
        }
        Ok(())
    }

    /// `z = inputs + residual` for tensor `t`.
    fn corrected(&self, inputs: &[Tensor], t: usize) -> Vec<f32> {
        let mut z = inputs[t].to_f32_vec();
        for (v, r) in z.iter_mut().zip(&self.residuals[t]) {
            *v += r;
        }
        z
    }

    /// What this peer sends: per part, `decode(encode(inputs + residual))`, as f32 tensors of
    /// the inputs' shapes. The residual does not change.
    pub fn prepare(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, FeedbackError> {
        self.check_inputs(inputs)?;
        let parts = self.parts()?;
        let mut sent = Vec::with_capacity(inputs.len());
        for t in 0..inputs.len() {
            let z = self.corrected(inputs, t);
            if !crate::tensor::ops::all_finite(&z) {
                return Err(FeedbackError::NonFinite);
            }
            let mut y = vec![0.0f32; z.len()];
            for p in parts.iter().filter(|p| p.tensor == t) {
                self.codec.roundtrip(&z[p.range()], &mut y[p.range()]);
            }
            sent.push(Tensor::from_f32(&self.shapes[t], y)?);
        }
        Ok(sent)
    }

    /// After a finished round that ran on `sent` (from [`ErrorFeedback::prepare`] of
    /// `inputs`) with this peer's averaging `weight`: updates the residuals and turns the
    /// outcome's local parts into zeros (see the module docs). Apply the outcome afterwards
    /// with `inputs` as the start values ([`apply`]). An aux peer's outcome (no results)
    /// changes nothing; with weight 0 nothing of this peer reached any average, so the whole
    /// corrected input stays in the residual (and the peer takes the others' average).
    pub fn commit(
        &mut self,
        inputs: &[Tensor],
        sent: &[Tensor],
        outcome: &mut Outcome,
        weight: f64,
    ) -> Result<(), FeedbackError> {
        self.check_inputs(inputs)?;
        if sent.len() != inputs.len()
            || sent.iter().zip(inputs).any(|(s, x)| s.shape() != x.shape())
        {
            return Err(FeedbackError::Layout("sent tensors of other shapes".into()));
        }
        if outcome.parts != self.parts()? {
            return Err(FeedbackError::Layout(
                "the round cut other parts than error feedback".into(),
            ));
        }
        let Some(results) = outcome.results.as_mut() else {
            return Ok(());
        };
        if results.len() != outcome.parts.len() {
            return Err(FeedbackError::Layout("one result per part expected".into()));
        }
        for (g, e) in &outcome.reply_feedback {
            if outcome.parts.get(*g).is_none_or(|p| p.len != e.len()) {
                return Err(FeedbackError::Layout(
                    "reply feedback that does not fit its part".into(),
                ));
            }
        }
        let mut new_residuals = Vec::with_capacity(inputs.len());
        for t in 0..inputs.len() {
            let z = self.corrected(inputs, t);
            let y = sent[t].to_f32_vec();
            let mut r = z;
            for (p, result) in outcome.parts.iter().zip(results.iter()) {
                if p.tensor == t && weight > 0.0 && !matches!(result, PartResult::Local) {
                    for (ri, yi) in r[p.range()].iter_mut().zip(&y[p.range()]) {
                        *ri -= yi;
                    }
                }
            }
            for (g, e) in &outcome.reply_feedback {
                let p = &outcome.parts[*g];
                if p.tensor == t && weight > 0.0 && !matches!(results[*g], PartResult::Local) {
                    for (ri, ei) in r[p.range()].iter_mut().zip(e) {
                        *ri += ei;
                    }
                }
            }
            new_residuals.push(r);
        }
        for (p, result) in outcome.parts.iter().zip(results.iter_mut()) {
            if matches!(result, PartResult::Local) {
                *result = PartResult::Average(Bytes::from(vec![0u8; p.len * 4]));
            }
        }
        self.residuals = new_residuals;
        Ok(())
    }
}

/// The delta rule for a committed error feedback round, ordered for agreement:
/// `tensors ← result + (tensors − inputs)`, part by part, in f32 (rounded once to the
/// tensor's dtype). The same as [`Outcome::apply`] up to rounding, but a tensor the training
/// loop did not touch while the round ran ends with the round's result bit for bit, so every
/// peer that got the same average holds the same values (`x + (avg − x)` may be an ulp off
/// `avg`, differently on each peer).
pub fn apply(
    outcome: &Outcome,
    tensors: &mut [Tensor],
    inputs: &[Tensor],
) -> Result<(), FeedbackError> {
    if outcome.results.is_none() {
        return Ok(());
    }
    if tensors.len() != inputs.len()
        || tensors
            .iter()
            .zip(inputs)
            .any(|(t, x)| t.shape() != x.shape())
    {
        return Err(FeedbackError::Layout(
            "tensors of other shapes than the inputs".into(),
        ));
    }
    let mut result = Vec::new();
    let mut now = Vec::new();
    let mut from = Vec::new();
    let mut bytes = Vec::new();
    for (g, spec) in outcome.parts.iter().enumerate() {
        if spec.tensor >= tensors.len() || spec.range().end > tensors[spec.tensor].numel() {
            return Err(FeedbackError::Layout("a part outside the tensors".into()));
        }
        result.resize(spec.len, 0.0);
        outcome
            .result_into(g, inputs, &mut result)
            .ok_or_else(|| FeedbackError::Layout(format!("no result for part {g}")))?;
        now.resize(spec.len, 0.0);
        from.resize(spec.len, 0.0);
        tensors[spec.tensor]
            .part(spec.range())
            .copy_to_f32(&mut now);
        inputs[spec.tensor]
            .part(spec.range())
            .copy_to_f32(&mut from);
        bytes.clear();
        for ((r, n), f) in result.iter().zip(&now).zip(&from) {
            bytes.extend_from_slice(&(r + (n - f)).to_le_bytes());
        }
        tensors[spec.tensor].set_from_le(spec.offset, &bytes)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::RoundReport;
    use crate::compression::elements::testing::randn;

    fn tensors(seed: u64) -> Vec<Tensor> {
        vec![
            Tensor::from_f32(&[70, 100], randn(7000, seed)).unwrap(),
            Tensor::from_f32(&[3], randn(3, seed + 1)).unwrap(),
        ]
    }

    fn le(v: &[f32]) -> Bytes {
        Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    /// An outcome in which this peer's `sent` values are averaged where `applied(part)`, local
    /// elsewhere (the average itself does not matter to the residual).
    fn outcome_of(fb: &ErrorFeedback, sent: &[Tensor], applied: impl Fn(usize) -> bool) -> Outcome {
        let parts = fb.parts().unwrap();
        let results = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                if applied(i) {
                    PartResult::Average(le(&sent[p.tensor].to_f32_vec()[p.range()]))
                } else {
                    PartResult::Local
                }
            })
            .collect();
        Outcome {
            results: Some(results),
            parts,
            report: RoundReport::default(),
            reply_feedback: Vec::new(),
        }
    }

    /// The residual is `inputs + before` (nothing of the round was applied).
    fn assert_residual_is_input_plus(fb: &ErrorFeedback, inputs: &[Tensor], before: &[Vec<f32>]) {
        for (t, x) in inputs.iter().enumerate() {
            let want: Vec<f32> = x
                .to_f32_vec()
                .iter()
                .zip(&before[t])
                .map(|(a, b)| a + b)
                .collect();
            assert_eq!(fb.residuals()[t], want);
        }
    }

    /// Over rounds with some parts local: Σ applied + residual = Σ inputs (f32 rounding only),
    /// local parts come back as zeros, and what is sent is sparse.
    #[test]
    fn applied_plus_residual_is_the_sum_of_inputs() {
        let codec = SparseTopK::new(0.05, 3, 256).unwrap();
        let shapes: Vec<TensorDescriptor> = tensors(0).iter().map(TensorDescriptor::of).collect();
        // Small parts: several per tensor, so some can stay local.
        let mut fb = ErrorFeedback::new(codec, 4096, &shapes);
        assert!(fb.parts().unwrap().len() > 3);
        let mut sum_inputs: Vec<Vec<f64>> = shapes.iter().map(|d| vec![0.0; d.numel()]).collect();
        let mut sum_applied = sum_inputs.clone();
        for round in 0..12u64 {
            let inputs = tensors(round * 10);
            let sent = fb.prepare(&inputs).unwrap();
            let nonzero: usize = sent
                .iter()
                .map(|t| t.to_f32_vec().iter().filter(|v| **v != 0.0).count())
                .sum();
            assert!(nonzero as f64 <= 7003.0 * 0.06, "{nonzero} values sent");
            let local = |i: usize| (i as u64 + round).is_multiple_of(3);
            let mut outcome = outcome_of(&fb, &sent, |i| !local(i));
            fb.commit(&inputs, &sent, &mut outcome, 1.0).unwrap();
            for (i, (p, r)) in outcome
                .parts
                .iter()
                .zip(outcome.results.as_ref().unwrap())
                .enumerate()
            {
                let PartResult::Average(b) = r else {
                    panic!("part {i} not an average")
                };
                let got: Vec<f32> = b
                    .chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let y = &sent[p.tensor].to_f32_vec()[p.range()];
                if local(i) {
                    assert!(got.iter().all(|v| *v == 0.0));
                } else {
                    assert_eq!(got, y);
                    for (a, v) in sum_applied[p.tensor][p.range()].iter_mut().zip(y) {
                        *a += f64::from(*v);
                    }
                }
            }
            for (s, x) in sum_inputs.iter_mut().zip(&inputs) {
                for (a, v) in s.iter_mut().zip(x.to_f32_vec()) {
                    *a += f64::from(v);
                }
            }
            for t in 0..shapes.len() {
                for e in 0..shapes[t].numel() {
                    let lhs = sum_applied[t][e] + f64::from(fb.residuals()[t][e]);
                    let rhs = sum_inputs[t][e];
                    assert!(
                        (lhs - rhs).abs() <= 1e-4 * (1.0 + rhs.abs()),
                        "round {round} t{t}[{e}]: {lhs} vs {rhs}"
                    );
                }
            }
        }
    }

    /// Reply feedback (a reducer's quantized replies' scaled error) goes into the residual
    /// where the part was applied, not where it stayed local or the weight is 0; feedback that
    /// does not fit its part is a layout error and changes nothing.
    #[test]
    fn reply_feedback_goes_into_the_residual() {
        let codec = SparseTopK::new(0.05, 3, 256).unwrap();
        let shapes: Vec<TensorDescriptor> = tensors(0).iter().map(TensorDescriptor::of).collect();
        let mut fb = ErrorFeedback::new(codec, 4096, &shapes);
        let parts = fb.parts().unwrap();
        assert!(parts.len() >= 3);
        let inputs = tensors(7);
        let sent = fb.prepare(&inputs).unwrap();
        let feedback = |g: usize| -> Vec<f32> {
            (0..parts[g].len)
                .map(|e| (g * 1000 + e) as f32 * 1e-3)
                .collect()
        };
        // Part 0 applied with feedback, part 1 local with feedback (ignored), the rest applied.
        let mut outcome = outcome_of(&fb, &sent, |i| i != 1);
        outcome.reply_feedback = vec![(0, feedback(0)), (1, feedback(1))];
        fb.commit(&inputs, &sent, &mut outcome, 1.0).unwrap();
        for (g, p) in parts.iter().enumerate() {
            let x = inputs[p.tensor].to_f32_vec();
            let y = sent[p.tensor].to_f32_vec();
            let r = &fb.residuals()[p.tensor][p.range()];
            for (e, i) in p.range().enumerate() {
                let want = match g {
                    0 => x[i] - y[i] + feedback(0)[e],
                    1 => x[i],
                    _ => x[i] - y[i],
                };
                assert_eq!(r[e], want, "part {g} [{e}]");
            }
        }
        // Weight 0: nothing applied, no feedback either.
        let before = fb.residuals().to_vec();
        let sent = fb.prepare(&inputs).unwrap();
        let mut outcome = outcome_of(&fb, &sent, |_| true);
        outcome.reply_feedback = vec![(0, feedback(0))];
        fb.commit(&inputs, &sent, &mut outcome, 0.0).unwrap();
        assert_residual_is_input_plus(&fb, &inputs, &before);
        // Feedback of the wrong length, or for a part that does not exist.
        let before = fb.residuals().to_vec();
        for bad in [(0, vec![1.0f32; 3]), (parts.len(), vec![])] {
            let mut outcome = outcome_of(&fb, &sent, |_| true);
            outcome.reply_feedback = vec![bad];
            assert!(matches!(
                fb.commit(&inputs, &sent, &mut outcome, 1.0),
                Err(FeedbackError::Layout(_))
            ));
            assert_eq!(fb.residuals(), &before[..]);
        }
    }

    /// The ordered delta rule: untouched tensors get the result bit for bit, a change made
    /// during the round stays on top.
    #[test]
    fn apply_gives_the_result_exactly_to_untouched_tensors() {
        let codec = SparseTopK::new(0.3, 4, 64).unwrap();
        let shapes: Vec<TensorDescriptor> = tensors(0).iter().map(TensorDescriptor::of).collect();
        let mut fb = ErrorFeedback::new(codec, 4096, &shapes);
        let inputs = tensors(5);
        let sent = fb.prepare(&inputs).unwrap();
        // An "average" of awkward values: 2/3 of what was sent.
        let parts = fb.parts().unwrap();
        let averages: Vec<Vec<f32>> = parts
            .iter()
            .map(|p| {
                sent[p.tensor].to_f32_vec()[p.range()]
                    .iter()
                    .map(|v| v * 2.0 / 3.0)
                    .collect()
            })
            .collect();
        let mut outcome = Outcome {
            results: Some(
                averages
                    .iter()
                    .map(|a| PartResult::Average(le(a)))
                    .collect(),
            ),
            parts: parts.clone(),
            report: RoundReport::default(),
            reply_feedback: Vec::new(),
        };
        fb.commit(&inputs, &sent, &mut outcome, 1.0).unwrap();
        let mut now = inputs.clone();
        now[1] = Tensor::from_f32(&[3], vec![10.0, 20.0, 30.0]).unwrap();
        apply(&outcome, &mut now, &inputs).unwrap();
        for (p, a) in parts.iter().zip(&averages) {
            let got = &now[p.tensor].to_f32_vec()[p.range()];
            if p.tensor == 0 {
                assert_eq!(got, &a[..]);
            } else {
                let moved: Vec<f32> = [10.0f32, 20.0, 30.0]
                    .iter()
                    .zip(inputs[1].to_f32_vec())
                    .zip(a)
                    .map(|((n, x), a)| a + (n - x))
                    .collect();
                assert_eq!(got, &moved[..]);
            }
        }
    }

    /// A failed round (no commit) leaves the residual as it was; an aux outcome too; a
    /// non-finite input is refused without touching it.
    #[test]
    fn failed_rounds_keep_the_residual() {
        let codec = SparseTopK::new(0.02, 2, 2048).unwrap();
        let shapes: Vec<TensorDescriptor> = tensors(0).iter().map(TensorDescriptor::of).collect();
        let mut fb = ErrorFeedback::new(codec, 1 << 19, &shapes);
        let inputs = tensors(1);
        let sent = fb.prepare(&inputs).unwrap();
        let mut outcome = outcome_of(&fb, &sent, |_| true);
        fb.commit(&inputs, &sent, &mut outcome, 1.0).unwrap();
        let before = fb.residuals().to_vec();
        assert!(before[0].iter().any(|v| *v != 0.0));
        // A round that failed: prepared, never committed.
        let _ = fb.prepare(&tensors(2)).unwrap();
        assert_eq!(fb.residuals(), &before[..]);
        let mut aux = Outcome {
            results: None,
            ..outcome_of(&fb, &sent, |_| true)
        };
        fb.commit(&inputs, &sent, &mut aux, 1.0).unwrap();
        assert_eq!(fb.residuals(), &before[..]);
        // Weight 0: nothing reached an average; everything stays in the residual.
        let next = tensors(4);
        let sent_next = fb.prepare(&next).unwrap();
        let mut listener = outcome_of(&fb, &sent_next, |_| true);
        let results = listener.results.clone();
        fb.commit(&next, &sent_next, &mut listener, 0.0).unwrap();
        assert_eq!(listener.results, results, "the others' average stays");
        assert_residual_is_input_plus(&fb, &next, &before);
        let before = fb.residuals().to_vec();
        let mut bad = tensors(3);
        bad[1] = Tensor::from_f32(&[3], vec![0.0, f32::NAN, 1.0]).unwrap();
        assert_eq!(fb.prepare(&bad), Err(FeedbackError::NonFinite));
        assert!(fb.prepare(&tensors(3)[..1]).is_err(), "a tensor missing");
        assert_eq!(fb.residuals(), &before[..]);
    }
}
