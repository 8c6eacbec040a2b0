//! The numeric kernels of the reducer.
//!
//! Loops are written so that LLVM vectorises them (plain zipped iterators over slices, no
//! bounds checks in the body). [`ReduceKernel`] is the interface the reducer uses to turn a
//! part's contributions into their weighted mean; [`CpuKernel`] is the reference
//! implementation, and a device kernel (behind the planned `cuda` feature) implements the same
//! trait and is tested against it.

use half::{bf16, f16};

use super::PartView;

/// `acc[i] += w * x[i]`.
#[inline]
pub fn add_scaled(acc: &mut [f32], x: &[f32], w: f32) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}

/// Whether an f32 bit pattern is NaN or infinite (all exponent bits set).
#[inline(always)]
fn non_finite_bits(bits: u32) -> u32 {
    const EXP: u32 = 0x7f80_0000;
    u32::from(bits & EXP == EXP)
}

/// Little-endian f32 number `i` of `bytes` (any alignment).
#[inline(always)]
fn le_f32(chunk: &[u8]) -> f32 {
    f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])
}

/// `x[i] += alpha · (avg[i] − start[i])` for an average given as little-endian f32 bytes
/// (any alignment): the delta rule applied in one pass. Where `alpha` is 1 and an element has
/// not changed since the round began (`x[i] == start[i]`), it becomes `avg[i]` exactly (in
/// f32, `x + (avg − x)` may be one rounding away from `avg`), so every peer of a lossless
/// round that left its tensors alone holds the same bits.
#[inline]
pub fn add_average_le(x: &mut [f32], avg: &[u8], start: &[f32], alpha: f32) {
    debug_assert!(avg.len() == x.len() * 4 && start.len() == x.len());
    let whole = alpha == 1.0;
    for ((v, c), &s) in x.iter_mut().zip(avg.chunks_exact(4)).zip(start) {
        let a = le_f32(c);
        let moved = *v + alpha * (a - s);
        // A select, not a branch: the loop still vectorises.
        *v = if whole && *v == s { a } else { moved };
    }
}

/// Whether every little-endian f32 value in `bytes` (any alignment) is finite.
pub fn all_finite_le(bytes: &[u8]) -> bool {
    const EXP: u32 = 0x7f80_0000;
    for block in bytes.as_chunks::<4>().0.chunks(1024) {
        let bad = block.iter().fold(0u32, |acc, c| {
            acc | u32::from(u32::from_le_bytes(*c) & EXP == EXP)
        });
        if bad != 0 {
            return false;
        }
    }
    true
}

/// Decodes little-endian f32 bytes into `out` (`bytes.len() == 4 * out.len()`).
#[inline]
pub fn copy_from_le(out: &mut [f32], bytes: &[u8]) {
    debug_assert_eq!(bytes.len(), out.len() * 4);
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = le_f32(c);
    }
}

/// `acc[i] += w * x[i]` with an f64 accumulator (the reducer's exact fallback: no overflow for
/// any finite f32 input and weight up to 1e12, and a weighted mean in `[min, max]`).
#[inline]
pub fn add_scaled_f64(acc: &mut [f64], x: &[f32], w: f64) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * f64::from(v);
    }
}

/// `out[i] = (acc[i] / denominator) as f32`: the average out of an f64 sum.
#[inline]
pub fn average_into(out: &mut [f32], acc: &[f64], denominator: f64) {
    debug_assert_eq!(out.len(), acc.len());
    let inv = 1.0 / denominator;
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = (a * inv) as f32;
    }
}

/// `out[i] = a[i] * scale - b[i]`: the delta of an average (given as a sum and `1/denominator`)
/// against one sender's input.
#[inline]
pub fn scaled_sub(out: &mut [f32], a: &[f32], scale: f32, b: &[f32]) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = x * scale - y;
    }
}

/// `x[i] -= b[i]`: turns a received average into this peer's delta.
#[inline]
pub fn sub_assign(x: &mut [f32], b: &[f32]) {
    debug_assert!(x.len() == b.len());
    for (o, &y) in x.iter_mut().zip(b) {
        *o -= y;
    }
}

/// Whether every value is finite (no NaN, no infinity). Branch-free so that it vectorises.
pub fn all_finite(x: &[f32]) -> bool {
    const EXP: u32 = 0x7f80_0000;
    let mut bad = 0u32;
    for chunk in x.chunks(1024) {
        bad |= chunk
            .iter()
            .fold(0u32, |acc, v| acc | u32::from(v.to_bits() & EXP == EXP));
        if bad != 0 {
            return false;
        }
    }
    true
}

/// One contribution to a part, as the reduction reads it: f32 values, little-endian f32 bytes
/// as received (any alignment), or a run of a local tensor in half precision.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// Little-endian f32 values as bytes (a multiple of 4 bytes, any alignment).
    Le(&'a [u8]),
    /// f16 values.
    F16(&'a [f16]),
    /// bf16 values.
    BF16(&'a [bf16]),
}

impl Source<'_> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Source::F32(s) => s.len(),
            Source::Le(b) => b.len() / 4,
            Source::F16(s) => s.len(),
            Source::BF16(s) => s.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `acc = w · self[range]` (`first`) or `acc += w · self[range]` for the values starting at
    /// `start` (`acc.len()` of them); nonzero if one of them is not finite.
    #[inline]
    fn accumulate(&self, acc: &mut [f32], start: usize, w: f32, first: bool) -> u32 {
        let end = start + acc.len();
        match *self {
            Source::F32(x) => fold(acc, x[start..end].iter().copied(), w, first),
            Source::Le(b) => fold(
                acc,
                b[start * 4..end * 4]
                    .as_chunks::<4>()
                    .0
                    .iter()
                    .map(|c| f32::from_le_bytes(*c)),
                w,
                first,
            ),
            Source::F16(x) => fold(acc, x[start..end].iter().map(|v| v.to_f32()), w, first),
            Source::BF16(x) => fold(acc, x[start..end].iter().map(|v| v.to_f32()), w, first),
        }
    }
}

impl<'a> From<PartView<'a>> for Source<'a> {
    fn from(v: PartView<'a>) -> Self {
        match v {
            PartView::F32(s) => Source::F32(s),
            PartView::F16(s) => Source::F16(s),
            PartView::BF16(s) => Source::BF16(s),
        }
    }
}

/// The body of [`Source::accumulate`]: one pass over `acc` and `x`, the finiteness check in the
/// same pass. Two loops so that neither carries a branch.
#[inline(always)]
fn fold(acc: &mut [f32], x: impl Iterator<Item = f32>, w: f32, first: bool) -> u32 {
    let mut bad = 0u32;
    if first {
        for (a, v) in acc.iter_mut().zip(x) {
            bad |= non_finite_bits(v.to_bits());
            *a = w * v;
        }
    } else {
        for (a, v) in acc.iter_mut().zip(x) {
            bad |= non_finite_bits(v.to_bits());
            *a += w * v;
        }
    }
    bad
}

/// Values per block of [`weighted_mean`] when it needs several passes (more than
/// [`GROUP`] inputs): the block's partial sums (8 KiB) stay in L1 between passes.
const BLOCK: usize = 2048;

/// Inputs combined per pass of [`weighted_mean`]: each pass streams up to this many inputs
/// side by side (measured: one pass over 4 inputs runs about 3x faster than 4 passes over
/// one input each, `cargo bench --bench core -- weighted_mean`).
const GROUP: usize = 4;

/// Little-endian f32 values (any alignment) with their weight: one input of a pass.
type Lane<'a> = (&'a [[u8; 4]], f32);

/// `dst = scale · (dst + Σ w[k]·x[k])` (`ACC`) or `dst = scale · Σ w[k]·x[k]`, summing in input
/// order; returns the non-finite flags of each input and of the result. The values are
/// little-endian f32 (any alignment: `[u8; 4]` loads).
#[inline(always)]
fn combine<const K: usize, const ACC: bool>(
    dst: &mut [f32],
    x: [&[[u8; 4]]; K],
    w: [f32; K],
    scale: f32,
) -> ([u32; K], u32) {
    let n = dst.len();
    let x = x.map(|s| &s[..n]);
    let mut bad = [0u32; K];
    let mut out_bad = 0u32;
    for (e, d) in dst.iter_mut().enumerate() {
        let mut sum = if ACC { *d } else { 0.0 };
        for k in 0..K {
            let v = f32::from_le_bytes(x[k][e]);
            bad[k] |= non_finite_bits(v.to_bits());
            sum += w[k] * v;
        }
        let v = sum * scale;
        out_bad |= non_finite_bits(v.to_bits());
        *d = v;
    }
    (bad, out_bad)
}

/// One pass of [`weighted_mean`]: up to [`GROUP`] inputs, the elements `range` of each, added
/// into the destination (`accumulate`) or written to it, then scaled.
struct Pass<'p, 'a> {
    group: &'p [Lane<'a>],
    range: std::ops::Range<usize>,
    accumulate: bool,
    scale: f32,
}

impl Pass<'_, '_> {
    /// Runs the pass into `dst`; sets the inputs' `bad` flags and returns whether the written
    /// values are finite.
    fn run(&self, dst: &mut [f32], bad: &mut [bool]) -> bool {
        match self.group.len() {
            1 => self.run_k::<1>(dst, bad),
            2 => self.run_k::<2>(dst, bad),
            3 => self.run_k::<3>(dst, bad),
            _ => self.run_k::<4>(dst, bad),
        }
    }

    fn run_k<const K: usize>(&self, dst: &mut [f32], bad: &mut [bool]) -> bool {
        let x: [&[[u8; 4]]; K] = std::array::from_fn(|k| &self.group[k].0[self.range.clone()]);
        let w: [f32; K] = std::array::from_fn(|k| self.group[k].1);
        let (flags, out_bad) = if self.accumulate {
            combine::<K, true>(dst, x, w, self.scale)
        } else {
            combine::<K, false>(dst, x, w, self.scale)
        };
        for (b, f) in bad.iter_mut().zip(flags) {
            *b |= f != 0;
        }
        out_bad == 0
    }
}

/// `out = inv · Σ w·x` over `inputs` (each as long as `out`), summing in input order in f32.
/// Sets `bad[k]` for every input `k` that holds a NaN or an infinity (then `out` is
/// unspecified) and returns whether `out` is all finite.
///
/// Every input is read once and `out` written once: up to four inputs stream through
/// one loop straight into `out`; with more, `out` is built block by block, the block's
/// partial sums staying in L1 while the groups of inputs pass over it. f16 and bf16 inputs
/// take a slower path that converts them as it goes.
///
/// # Panics
///
/// If `bad` does not have one flag per input, or an input is not as long as `out`.
pub fn weighted_mean(
    inputs: &[(Source<'_>, f32)],
    inv: f32,
    out: &mut [f32],
    bad: &mut [bool],
) -> bool {
    assert_eq!(inputs.len(), bad.len(), "one flag per input");
    assert!(
        inputs.iter().all(|(x, _)| x.len() == out.len()),
        "every input as long as the output"
    );
    let lanes: Option<Vec<Lane<'_>>> = inputs
        .iter()
        .map(|&(x, w)| match x {
            Source::F32(v) => Some((bytemuck::cast_slice::<f32, [u8; 4]>(v), w)),
            Source::Le(b) => Some((b.as_chunks::<4>().0, w)),
            Source::F16(_) | Source::BF16(_) => None,
        })
        .collect();
    let Some(lanes) = lanes else {
        return weighted_mean_converting(inputs, inv, out, bad);
    };
    if lanes.is_empty() {
        out.fill(0.0);
        return true;
    }
    if lanes.len() <= GROUP {
        let pass = Pass {
            group: &lanes,
            range: 0..out.len(),
            accumulate: false,
            scale: inv,
        };
        return pass.run(out, bad);
    }
    let groups = lanes.len().div_ceil(GROUP);
    let mut finite = true;
    for (b, block) in out.chunks_mut(BLOCK).enumerate() {
        for (g, group) in lanes.chunks(GROUP).enumerate() {
            let last = g + 1 == groups;
            let pass = Pass {
                group,
                range: b * BLOCK..b * BLOCK + block.len(),
                accumulate: g > 0,
                scale: if last { inv } else { 1.0 },
            };
            let ok = pass.run(block, &mut bad[g * GROUP..]);
            finite &= ok || !last;
        }
    }
    finite
}

/// [`weighted_mean`] for inputs that include f16 or bf16 values: block by block, each input
/// converted and added in its own pass over the block's sums.
fn weighted_mean_converting(
    inputs: &[(Source<'_>, f32)],
    inv: f32,
    out: &mut [f32],
    bad: &mut [bool],
) -> bool {
    let mut sums = [0.0f32; BLOCK];
    let mut out_bad = 0u32;
    for (b, block) in out.chunks_mut(BLOCK).enumerate() {
        let start = b * BLOCK;
        let sums = &mut sums[..block.len()];
        for (k, (x, w)) in inputs.iter().enumerate() {
            if x.accumulate(sums, start, *w, k == 0) != 0 {
                bad[k] = true;
            }
        }
        for (o, &s) in block.iter_mut().zip(sums.iter()) {
            let v = s * inv;
            out_bad |= non_finite_bits(v.to_bits());
            *o = v;
        }
    }
    out_bad == 0
}

/// Computes one part's weighted mean from its contributions: the operation the reducer needs
/// from a compute backend. [`CpuKernel`] is the reference; a device implementation must agree
/// with it within float tolerance. A non-finite mean (only possible for extreme weights or
/// values) is caught by the reducer, which then recomputes that part exactly in f64.
pub trait ReduceKernel: Send {
    /// `out = inv · Σ w·x` over `inputs`, with the contract of [`weighted_mean`].
    fn weighted_mean(
        &mut self,
        inputs: &[(Source<'_>, f32)],
        inv: f32,
        out: &mut [f32],
        bad: &mut [bool],
    ) -> bool;
}

/// The CPU reference [`ReduceKernel`]: [`weighted_mean`], memory-bound (each input read once,
/// the output written once).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuKernel;

impl ReduceKernel for CpuKernel {
    fn weighted_mean(
        &mut self,
        inputs: &[(Source<'_>, f32)],
        inv: f32,
        out: &mut [f32],
        bad: &mut [bool],
    ) -> bool {
        weighted_mean(inputs, inv, out, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels() {
        let mut acc = vec![1.0, 2.0, 3.0];
        add_scaled(&mut acc, &[1.0, 1.0, 1.0], 2.0);
        assert_eq!(acc, vec![3.0, 4.0, 5.0]);
        sub_assign(&mut acc, &[1.0, 2.0, 3.0]);
        assert_eq!(acc, vec![2.0, 2.0, 2.0]);
        let mut out = vec![0.0; 3];
        scaled_sub(&mut out, &acc, 0.5, &[1.0, 0.0, -1.0]);
        assert_eq!(out, vec![0.0, 1.0, 2.0]);
        let mut acc64 = vec![1.0f64];
        add_scaled_f64(&mut acc64, &[f32::MAX], 1e12);
        let mut avg = [0.0f32];
        average_into(&mut avg, &acc64, 1e12);
        assert_eq!(avg[0], f32::MAX);
        assert!(all_finite(&[0.0, -1.0, f32::MAX]));
        assert!(!all_finite(&[0.0, f32::NAN]));
        assert!(!all_finite(&vec![f32::NEG_INFINITY; 3000]));
        assert!(all_finite(&[]));
    }

    #[test]
    fn an_unchanged_element_takes_the_average_exactly() {
        // 1e8 + (1e-8 - 1e8) is 0 in f32, not 1e-8: the delta rule must still leave the
        // average where the element did not move, and keep a concurrent change (+1) where it
        // did.
        let avg: Vec<u8> = [0.3f32, 0.3, 1e-8]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let start = [0.1f32, 0.1, 1.0e8];
        assert_ne!(
            1.0e8f32 + (1e-8f32 - 1.0e8),
            1e-8,
            "the example needs a rounding"
        );
        let mut x = [0.1f32, 1.1, 1.0e8];
        add_average_le(&mut x, &avg, &start, 1.0);
        assert_eq!(x[0].to_bits(), 0.3f32.to_bits());
        assert_eq!(x[1], 1.1 + (0.3 - 0.1));
        assert_eq!(
            x[2].to_bits(),
            1e-8f32.to_bits(),
            "a large start still gives the average"
        );
        // With another alpha, the rule is the plain one.
        let mut y = [0.1f32];
        add_average_le(&mut y, &avg[..4], &start[..1], 0.5);
        assert_eq!(y[0], 0.1 + 0.5 * (0.3 - 0.1));
    }

    #[test]
    fn fused_kernels_match_the_plain_ones() {
        let x: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Any alignment of the byte view.
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&bytes);
        let unaligned = &shifted[1..];
        let base: Vec<f32> = (0..1001).map(|i| i as f32).collect();

        let mut decoded = vec![0.0; x.len()];
        copy_from_le(&mut decoded, unaligned);
        assert_eq!(decoded, x);

        let mut applied = base.clone();
        add_average_le(&mut applied, unaligned, &base, 0.5);
        let want: Vec<f32> = base
            .iter()
            .zip(&x)
            .map(|(b, v)| b + 0.5 * (v - b))
            .collect();
        assert_eq!(applied, want);

        assert!(all_finite_le(unaligned));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 500, 1000] {
                let mut y = x.clone();
                y[at] = bad;
                let mut yb = vec![0u8; 3];
                yb.extend(y.iter().flat_map(|v| v.to_le_bytes()));
                assert!(!all_finite_le(&yb[3..]));
            }
        }
    }

    /// The plain reference of [`weighted_mean`]: sums in input order, in f32.
    fn naive_mean(inputs: &[Vec<f32>], weights: &[f32], inv: f32) -> Vec<f32> {
        let n = inputs.first().map_or(0, Vec::len);
        (0..n)
            .map(|i| {
                let mut s = 0.0f32;
                for (k, x) in inputs.iter().enumerate() {
                    if k == 0 {
                        s = weights[k] * x[i];
                    } else {
                        s += weights[k] * x[i];
                    }
                }
                s * inv
            })
            .collect()
    }

    #[test]
    fn weighted_mean_reads_every_source_kind() {
        // Lengths around the block size; one input of each kind, the byte view unaligned.
        for n in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17] {
            let a: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            let h: Vec<f16> = (0..n)
                .map(|i| f16::from_f32((i % 7) as f32 * 0.5))
                .collect();
            let bh: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i % 5) as f32)).collect();
            let mut shifted = vec![0u8; 3];
            shifted.extend(b.iter().flat_map(|v| v.to_le_bytes()));
            let inputs = [
                (Source::F32(&a), 0.5),
                (Source::Le(&shifted[3..]), 2.0),
                (Source::F16(&h), 1.0),
                (Source::BF16(&bh), 0.25),
            ];
            let plain = [
                a.clone(),
                b.clone(),
                h.iter().map(|v| v.to_f32()).collect(),
                bh.iter().map(|v| v.to_f32()).collect(),
            ];
            let mut out = vec![f32::NAN; n];
            let mut bad = [false; 4];
            assert!(CpuKernel.weighted_mean(&inputs, 1.0 / 3.75, &mut out, &mut bad));
            assert_eq!(bad, [false; 4]);
            assert_eq!(out, naive_mean(&plain, &[0.5, 2.0, 1.0, 0.25], 1.0 / 3.75));
        }
        // No inputs: zeros.
        let mut out = vec![1.0; 5];
        assert!(weighted_mean(&[], 1.0, &mut out, &mut []));
        assert_eq!(out, vec![0.0; 5]);
    }

    #[test]
    fn weighted_mean_flags_exactly_the_bad_inputs() {
        let n = 2 * BLOCK + 5;
        let good: Vec<f32> = vec![1.5; n];
        for bad_value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, BLOCK, n - 1] {
                let mut y = good.clone();
                y[at] = bad_value;
                let yb: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
                let inputs = [
                    (Source::F32(&good), 1.0),
                    (Source::Le(&yb), 1.0),
                    (Source::F32(&y), 1.0),
                ];
                let mut bad = [false; 3];
                weighted_mean(&inputs, 1.0, &mut vec![0.0; n], &mut bad);
                assert_eq!(bad, [false, true, true]);
            }
        }
        // Finite inputs whose sum overflows: the inputs are fine, the output is not.
        let big = vec![f32::MAX; 3];
        let mut bad = [false; 2];
        let finite = weighted_mean(
            &[(Source::F32(&big), 1.0), (Source::F32(&big), 1.0)],
            0.5,
            &mut [0.0; 3],
            &mut bad,
        );
        assert!(!finite);
        assert_eq!(bad, [false, false]);
    }

    proptest::proptest! {
        /// Any number of inputs, any length, any weights: the blocked one-pass kernel gives
        /// exactly the plain loop's f32 result.
        #[test]
        fn weighted_mean_equals_the_plain_loop(
            n in 0usize..5000,
            k in 0usize..6,
            seed in proptest::prelude::any::<u32>(),
            inv in 0.001f32..10.0,
        ) {
            let inputs: Vec<Vec<f32>> = (0..k)
                .map(|j| {
                    (0..n)
                        .map(|i| {
                            let h = (i as u32 ^ seed).wrapping_mul(2654435761).wrapping_add(j as u32 * 7919);
                            (h >> 8) as f32 / (1 << 24) as f32 * 200.0 - 100.0
                        })
                        .collect()
                })
                .collect();
            let weights: Vec<f32> = (0..k).map(|j| 0.5 + j as f32).collect();
            let sources: Vec<(Source<'_>, f32)> =
                inputs.iter().zip(&weights).map(|(x, &w)| (Source::F32(x), w)).collect();
            let mut out = vec![0.0; n];
            let mut bad = vec![false; k];
            let want = if k == 0 { vec![0.0; n] } else { naive_mean(&inputs, &weights, inv) };
            proptest::prop_assert!(weighted_mean(&sources, inv, &mut out, &mut bad));
            proptest::prop_assert_eq!(out, want);
            proptest::prop_assert!(bad.iter().all(|b| !b));
        }
    }
}
