//! How a reducer combines its senders' contributions to a part: the weighted mean (the
//! default, and hivemind's), or CenteredClip, a robust aggregator that a minority of peers
//! sending huge or crafted values cannot drag far.
//!
//! # CenteredClip
//!
//! CenteredClip (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust
//! Optimization", 2021; used per butterfly part by BTARD, Gorbunov et al., "Secure Distributed
//! Training at Scale", 2022, hivemind's research prototype) is the fixed-point iteration
//!
//! ```text
//! v ← v + Σᵢ wᵢ · (xᵢ − v) · min(1, τ / ‖xᵢ − v‖₂) / Σᵢ wᵢ
//! ```
//!
//! over the part's contributions `xᵢ` with weights `wᵢ`. A contribution within `τ` of the
//! estimate pulls as in the mean; one farther away pulls with length at most `τ`, whatever
//! its size. At the fixed point, contributions with total weight `B` that are arbitrary move
//! the estimate by at most `τ · B / (W − B)` from the honest contributions' mean, as long as
//! the honest ones lie within `τ` of it (`W` is the total weight). With `τ = ∞` it is the mean.
//!
//! Here the iteration starts from the coordinate-wise weighted median (itself robust, so few
//! iterations are needed), runs at most [`CenteredClip::iterations`] times and stops early
//! once a step moves the estimate by less than `tolerance · τ`. Norms are over the whole part
//! (so `τ` is in units of a part's L2 norm: parts are `part_size_bytes` long) and sums are in
//! f64. The result is a convex combination of the inputs, so finite inputs give a finite
//! result.
//!
//! Every member of a group must use the same aggregator for the group's result to be one
//! value; the reducer of a part decides, so a member with a different setting changes only
//! the parts it reduces.

/// How a reducer combines the contributions to a part: the op of an all-reduce.
///
/// Every op leaves non-finite contributions out (their senders are reported as such), and
/// contributions of weight 0 take no part in any of them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Aggregator {
    /// `Σ w·x / Σ w` (the default).
    #[default]
    Mean,
    /// The robust CenteredClip aggregator (see the module docs).
    CenteredClip(CenteredClip),
    /// `Σ w·x` (with the default weight 1, the plain sum).
    Sum,
    /// The element-wise maximum.
    Max,
    /// The element-wise minimum.
    Min,
}

impl Aggregator {
    /// Combines `inputs` (values and weights, all of one length, weights positive) into
    /// `out` for the element-wise ops (`Sum`, `Max`, `Min`); `false` for the others.
    pub(crate) fn element_wise(&self, inputs: &[(&[f32], f64)], out: &mut [f32]) -> bool {
        match self {
            Self::Sum => {
                let mut acc = vec![0.0f64; out.len()];
                for (x, w) in inputs {
                    for (a, v) in acc.iter_mut().zip(x.iter()) {
                        *a += w * f64::from(*v);
                    }
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    *o = a as f32;
                }
            }
            Self::Max | Self::Min => {
                let pick = |a: f32, b: f32| match self {
                    Self::Max => a.max(b),
                    _ => a.min(b),
                };
                let Some(((first, _), rest)) = inputs.split_first() else {
                    return true;
                };
                out.copy_from_slice(first);
                for (x, _) in rest {
                    for (o, v) in out.iter_mut().zip(x.iter()) {
                        *o = pick(*o, *v);
                    }
                }
            }
            Self::Mean | Self::CenteredClip(_) => return false,
        }
        true
    }
}

/// Parameters of [`Aggregator::CenteredClip`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CenteredClip {
    /// The clipping radius `τ`, in L2 norm over a part (positive; `f64::INFINITY` gives the
    /// mean).
    pub tau: f64,
    /// Most iterations per part.
    pub iterations: u32,
    /// Stop when a step moves the estimate by less than `tolerance · τ`.
    pub tolerance: f64,
}

impl CenteredClip {
    /// CenteredClip with radius `tau`, at most 20 iterations, tolerance 1e-6.
    pub fn new(tau: f64) -> Self {
        Self {
            tau,
            iterations: 20,
            tolerance: 1e-6,
        }
    }

    /// Whether the parameters are usable: `tau > 0` (not NaN), `tolerance >= 0`.
    pub fn is_valid(&self) -> bool {
        self.tau > 0.0 && self.tolerance >= 0.0
    }

    /// Combines `inputs` (values and weight, all the same length as `out`, finite, weights
    /// positive) into `out`. Returns the number of iterations run.
    pub fn aggregate(&self, inputs: &[(&[f32], f64)], out: &mut [f32]) -> u32 {
        let len = out.len();
        debug_assert!(inputs.iter().all(|(x, _)| x.len() == len));
        let total: f64 = inputs.iter().map(|(_, w)| w).sum();
        if inputs.is_empty() || total <= 0.0 {
            return 0;
        }
        let mut v = vec![0.0f64; len];
        weighted_median(inputs, &mut v);
        let mut step = vec![0.0f64; len];
        let mut run = 0;
        while run < self.iterations {
            run += 1;
            step.fill(0.0);
            for (x, w) in inputs {
                let distance = x
                    .iter()
                    .zip(&v)
                    .map(|(&xi, &vi)| {
                        let d = f64::from(xi) - vi;
                        d * d
                    })
                    .sum::<f64>()
                    .sqrt();
                let scale = if distance > self.tau {
                    w * self.tau / distance
                } else {
                    *w
                } / total;
                for ((s, &xi), &vi) in step.iter_mut().zip(x.iter()).zip(&v) {
                    *s += scale * (f64::from(xi) - vi);
                }
            }
            let mut moved = 0.0;
            for (vi, s) in v.iter_mut().zip(&step) {
                *vi += s;
                moved += s * s;
            }
            if moved.sqrt() <= self.tolerance * self.tau {
                break;
            }
        }
        for (o, vi) in out.iter_mut().zip(&v) {
            *o = *vi as f32;
        }
        run
    }
}

/// The coordinate-wise weighted median of `inputs` into `out` (the lower one at a tie).
fn weighted_median(inputs: &[(&[f32], f64)], out: &mut [f64]) {
    let half: f64 = inputs.iter().map(|(_, w)| w).sum::<f64>() / 2.0;
    let mut column: Vec<(f32, f64)> = Vec::with_capacity(inputs.len());
    for (j, o) in out.iter_mut().enumerate() {
        column.clear();
        column.extend(inputs.iter().map(|(x, w)| (x[j], *w)));
        column.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let mut acc = 0.0;
        *o = f64::from(column[column.len() - 1].0);
        for &(x, w) in &column {
            acc += w;
            if acc >= half {
                *o = f64::from(x);
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mean(inputs: &[(&[f32], f64)]) -> Vec<f64> {
        let total: f64 = inputs.iter().map(|(_, w)| w).sum();
        let mut m = vec![0.0; inputs[0].0.len()];
        for (x, w) in inputs {
            for (mi, &xi) in m.iter_mut().zip(x.iter()) {
                *mi += w * f64::from(xi) / total;
            }
        }
        m
    }

    fn distance(a: &[f32], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (f64::from(x) - y).powi(2))
            .sum::<f64>()
            .sqrt()
    }

    /// A straightforward CenteredClip, written apart from the one above: same start (the
    /// lower weighted median, by sorting indices), fixed iteration count.
    fn reference(inputs: &[(&[f32], f64)], tau: f64, iterations: u32) -> Vec<f64> {
        let len = inputs[0].0.len();
        let total: f64 = inputs.iter().map(|(_, w)| w).sum();
        let mut v: Vec<f64> = (0..len)
            .map(|j| {
                let mut idx: Vec<usize> = (0..inputs.len()).collect();
                idx.sort_by(|&a, &b| inputs[a].0[j].total_cmp(&inputs[b].0[j]));
                let mut acc = 0.0;
                for &i in &idx {
                    acc += inputs[i].1;
                    if acc >= total / 2.0 {
                        return f64::from(inputs[i].0[j]);
                    }
                }
                f64::from(inputs[idx[idx.len() - 1]].0[j])
            })
            .collect();
        for _ in 0..iterations {
            let mut next = v.clone();
            for (x, w) in inputs {
                let d = distance(x, &v);
                let c = if d > tau { tau / d } else { 1.0 };
                for j in 0..len {
                    next[j] += w * c * (f64::from(x[j]) - v[j]) / total;
                }
            }
            v = next;
        }
        v
    }

    #[test]
    fn matches_a_reference_implementation() {
        let a = [1.0f32, 2.0, 3.0, 4.0];
        let b = [1.5f32, 2.5, 2.0, 5.0];
        let c = [0.0f32, -1.0, 3.5, 4.5];
        let evil = [1e6f32, -1e6, 1e6, 1e6];
        let inputs: Vec<(&[f32], f64)> = vec![(&a, 1.0), (&b, 2.0), (&c, 1.0), (&evil, 1.0)];
        let clip = CenteredClip {
            tau: 1.0,
            iterations: 7,
            tolerance: 0.0,
        };
        let mut out = [0.0f32; 4];
        assert_eq!(clip.aggregate(&inputs, &mut out), 7);
        let want = reference(&inputs, 1.0, 7);
        for (o, w) in out.iter().zip(&want) {
            assert!(
                (f64::from(*o) - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{out:?} {want:?}"
            );
        }
    }

    #[test]
    fn a_huge_minority_moves_the_result_at_most_tau_times_its_weight_share() {
        // Three honest inputs close together, one sending 1e9 everywhere.
        let honest: Vec<Vec<f32>> = (0..3)
            .map(|i| {
                (0..64)
                    .map(|j| (j as f32 * 0.01).sin() + i as f32 * 0.1)
                    .collect()
            })
            .collect();
        let evil = vec![1e9f32; 64];
        let mut inputs: Vec<(&[f32], f64)> = honest.iter().map(|x| (&x[..], 1.0)).collect();
        let honest_mean = mean(&inputs);
        inputs.push((&evil, 1.0));
        let tau = 2.0;
        let mut out = vec![0.0f32; 64];
        CenteredClip::new(tau).aggregate(&inputs, &mut out);
        // Bound at the fixed point: tau * B / (W - B) = 2 / 3.
        let moved = distance(&out, &honest_mean);
        assert!(moved <= tau / 3.0 * 1.01, "moved {moved}");
        // The mean is dragged by 1e9 / 4 per coordinate.
        assert!(distance(&out, &mean(&inputs)) > 1e9);
    }

    #[test]
    fn infinite_tau_is_the_weighted_mean() {
        let a = [1.0f32, -2.0, 8.0];
        let b = [3.0f32, 4.0, -8.0];
        let inputs: Vec<(&[f32], f64)> = vec![(&a, 1.0), (&b, 3.0)];
        let mut out = [0.0f32; 3];
        CenteredClip::new(f64::INFINITY).aggregate(&inputs, &mut out);
        assert_eq!(out, [2.5, 2.5, -4.0]);
    }

    proptest! {
        #[test]
        fn the_result_stays_in_the_inputs_bounding_box(
            rows in prop::collection::vec(prop::collection::vec(-1e30f32..1e30, 5), 1..6),
            tau in 1e-3f64..1e3,
        ) {
            let inputs: Vec<(&[f32], f64)> = rows.iter().map(|r| (&r[..], 1.0)).collect();
            let mut out = [0.0f32; 5];
            CenteredClip::new(tau).aggregate(&inputs, &mut out);
            for j in 0..5 {
                let lo = rows.iter().map(|r| r[j]).fold(f32::INFINITY, f32::min);
                let hi = rows.iter().map(|r| r[j]).fold(f32::NEG_INFINITY, f32::max);
                prop_assert!(out[j].is_finite());
                prop_assert!(lo <= out[j] && out[j] <= hi, "{} not in [{lo}, {hi}]", out[j]);
            }
        }
    }
}
