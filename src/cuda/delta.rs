//! The host half of the delta rule for a device tensor: a round's results turned into one
//! buffer of `average − snapshot` per element, which the device adds to the tensor
//! (`hm_apply_*` in `kernels.cu`). Pure, so it is tested without a GPU against
//! [`Outcome::apply`], the host tensors' rule.

use half::{bf16, f16};

use crate::allreduce::{Outcome, PartResult, RoundError};
use crate::tensor::{DType, PartViewMut, Tensor, TensorError};

fn mismatch(what: String) -> RoundError {
    TensorError::Mismatch(what).into()
}

/// Writes into `out` (little-endian elements of `dtype`, one per element of round tensor
/// `index`) what the round adds to that tensor before scaling: `average − start` where a part
/// was averaged, the delta where the round gave one, zero where the part stayed local.
/// `start` is the snapshot the round started from (any dtype). Computed in f32, rounded once
/// to `dtype`.
pub(crate) fn fill_deltas(
    outcome: &Outcome,
    index: usize,
    start: &Tensor,
    dtype: DType,
    out: &mut [u8],
) -> Result<(), RoundError> {
    let n = start.numel();
    if out.len() != n * dtype.size_bytes() {
        return Err(mismatch(format!(
            "a delta buffer of {} bytes for {n} elements of {dtype}",
            out.len()
        )));
    }
    outcome.check_results()?;
    out.fill(0);
    let Some(results) = &outcome.results else {
        return Ok(());
    };
    let size = dtype.size_bytes();
    // One part's worth of f32 values at a time (parts are bounded; the tensor may be huge).
    let mut part = Vec::new();
    for (spec, result) in outcome.parts.iter().zip(results) {
        if spec.tensor != index {
            continue;
        }
        if spec.offset.checked_add(spec.len).is_none_or(|end| end > n) {
            return Err(mismatch(format!(
                "part {spec:?} outside a tensor of {n} elements"
            )));
        }
        let dst = &mut out[spec.offset * size..(spec.offset + spec.len) * size];
        match result {
            PartResult::Local => {}
            PartResult::Average(avg) => {
                part.resize(spec.len, 0.0);
                start.part(spec.range()).copy_to_f32(&mut part);
                for (v, c) in part.iter_mut().zip(avg.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) - *v;
                }
                store(&part, dtype, dst);
            }
            PartResult::Delta(delta) => store(delta, dtype, dst),
        }
    }
    Ok(())
}

/// `values` as little-endian `dtype` bytes (round to nearest even).
fn store(values: &[f32], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(values) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        DType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
    }
}

/// What `hm_apply_T_D` computes, on the host: `t[i] = round(t[i] + alpha · d[i])`, with `d`
/// little-endian `dtype` bytes. The reference the device tests compare against, and the
/// kernel's specification.
pub fn apply_reference(t: &mut Tensor, deltas: &[u8], dtype: DType, alpha: f32) {
    let d: Vec<f32> = match dtype {
        DType::F32 => {
            let mut d = vec![0.0f32; deltas.len() / 4];
            crate::tensor::ops::copy_from_le(&mut d, deltas);
            d
        }
        DType::F16 => deltas
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::BF16 => deltas
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    };
    match t.flat_mut() {
        PartViewMut::F32(x) => {
            for (v, d) in x.iter_mut().zip(&d) {
                *v += alpha * d;
            }
        }
        PartViewMut::F16(x) => {
            for (v, d) in x.iter_mut().zip(&d) {
                *v = f16::from_f32(v.to_f32() + alpha * d);
            }
        }
        PartViewMut::BF16(x) => {
            for (v, d) in x.iter_mut().zip(&d) {
                *v = bf16::from_f32(v.to_f32() + alpha * d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use proptest::prelude::*;

    use super::*;
    use crate::allreduce::PartSpec;

    fn le(v: &[f32]) -> Bytes {
        Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    /// Tensor 1 of two, cut in three parts: averaged, delta, local.
    fn outcome(avg: &[f32], delta: &[f32], local: usize) -> Outcome {
        let (a, d) = (avg.len(), delta.len());
        Outcome {
            results: Some(vec![
                PartResult::Average(le(&[1.0, 2.0])),
                PartResult::Average(le(avg)),
                PartResult::Delta(delta.to_vec()),
                PartResult::Local,
            ]),
            parts: vec![
                PartSpec {
                    tensor: 0,
                    offset: 0,
                    len: 2,
                },
                PartSpec {
                    tensor: 1,
                    offset: 0,
                    len: a,
                },
                PartSpec {
                    tensor: 1,
                    offset: a,
                    len: d,
                },
                PartSpec {
                    tensor: 1,
                    offset: a + d,
                    len: local,
                },
            ],
            report: Default::default(),
            reply_feedback: Vec::new(),
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 37.0 - 13.0)
            .collect()
    }

    proptest! {
        /// Deltas then the device rule equal the host rule (`Outcome::apply`) for every
        /// tensor dtype, exactly with f32 deltas and within 16-bit rounding otherwise.
        #[test]
        fn deltas_then_device_rule_equal_the_host_rule(
            a in 0usize..40, d in 0usize..40, local in 0usize..40,
            tensor_dtype in 0usize..3, delta_dtype in 0usize..3,
            alpha in prop_oneof![Just(1.0f32), 0.25f32..2.0],
            seed in any::<u32>(),
        ) {
            let dt = [DType::F32, DType::F16, DType::BF16];
            let (tensor_dtype, delta_dtype) = (dt[tensor_dtype], dt[delta_dtype]);
            let n = a + d + local;
            let avg = values(a, seed);
            let delta = values(d, seed ^ 7);
            let outcome = outcome(&avg, &delta, local);
            let start = Tensor::from_f32_as(&[n], &values(n, seed ^ 1), tensor_dtype).unwrap();
            // The training loop moved on meanwhile.
            let now = Tensor::from_f32_as(&[n], &values(n, seed ^ 2), tensor_dtype).unwrap();
            let other = Tensor::from_f32(&[2], vec![0.0; 2]).unwrap();

            let mut expected = vec![other.clone(), now.clone()];
            outcome.apply(&mut expected, &[other.clone(), start.clone()], alpha).unwrap();

            let mut buf = vec![0u8; n * delta_dtype.size_bytes()];
            fill_deltas(&outcome, 1, &start, delta_dtype, &mut buf).unwrap();
            let mut got = now.clone();
            apply_reference(&mut got, &buf, delta_dtype, alpha);

            let (e, g) = (expected[1].to_f32_vec(), got.to_f32_vec());
            for i in 0..n {
                if delta_dtype == DType::F32 {
                    prop_assert_eq!(e[i].to_bits(), g[i].to_bits(), "element {}", i);
                } else {
                    // One 16-bit rounding of the delta, one of the result.
                    let tol = 2e-2 * (1.0 + e[i].abs() + (e[i] - now.to_f32_vec()[i]).abs());
                    prop_assert!((e[i] - g[i]).abs() <= tol, "element {}: {} vs {}", i, e[i], g[i]);
                }
            }
            // Local parts are left exactly as they are.
            for i in a + d..n {
                prop_assert_eq!(g[i].to_bits(), now.to_f32_vec()[i].to_bits());
            }
        }
    }

    #[test]
    fn an_aux_outcome_gives_zero_deltas_and_bad_layouts_are_errors() {
        let start = Tensor::from_f32(&[3], vec![1.0, 2.0, 3.0]).unwrap();
        let aux = Outcome {
            results: None,
            parts: vec![],
            report: Default::default(),
            reply_feedback: Vec::new(),
        };
        let mut buf = vec![7u8; 12];
        fill_deltas(&aux, 0, &start, DType::F32, &mut buf).unwrap();
        assert_eq!(buf, vec![0u8; 12]);

        // A buffer of the wrong size.
        assert!(fill_deltas(&aux, 0, &start, DType::F16, &mut buf).is_err());
        // A part beyond the tensor.
        let bad = Outcome {
            results: Some(vec![PartResult::Local]),
            parts: vec![PartSpec {
                tensor: 0,
                offset: 2,
                len: 2,
            }],
            report: Default::default(),
            reply_feedback: Vec::new(),
        };
        assert!(fill_deltas(&bad, 0, &start, DType::F32, &mut buf).is_err());
        // Results that do not fit their parts.
        let short = Outcome {
            results: Some(vec![PartResult::Average(le(&[1.0]))]),
            parts: vec![PartSpec {
                tensor: 0,
                offset: 0,
                len: 3,
            }],
            report: Default::default(),
            reply_feedback: Vec::new(),
        };
        assert!(fill_deltas(&short, 0, &start, DType::F32, &mut buf).is_err());
    }
}
