//! The numeric kernels of the reducer.
//!
//! Loops are written so that LLVM vectorises them (plain zipped iterators over slices, no
//! bounds checks in the body). [`ReduceBuffer`] is the interface the reducer uses for its
//! accumulators; [`CpuBuffer`] is the reference implementation, and a device buffer (behind the
//! future `cuda` feature) implements the same trait and is tested against it.

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

/// `acc[i] += w * x[i]`, returning whether every `x[i]` was finite (one pass for the check and
/// the sum; on `false`, `acc` holds garbage and must be rebuilt).
#[inline]
pub fn add_scaled_checked(acc: &mut [f32], x: &[f32], w: f32) -> bool {
    debug_assert_eq!(acc.len(), x.len());
    let mut bad = 0u32;
    for (a, &v) in acc.iter_mut().zip(x) {
        bad |= non_finite_bits(v.to_bits());
        *a += w * v;
    }
    bad == 0
}

/// [`add_scaled_checked`] with `x` given as little-endian f32 bytes (a received payload, any
/// alignment; `bytes.len() == 4 * acc.len()`).
#[inline]
pub fn add_scaled_le_checked(acc: &mut [f32], bytes: &[u8], w: f32) -> bool {
    debug_assert_eq!(bytes.len(), acc.len() * 4);
    let mut bad = 0u32;
    for (a, c) in acc.iter_mut().zip(bytes.chunks_exact(4)) {
        let v = le_f32(c);
        bad |= non_finite_bits(v.to_bits());
        *a += w * v;
    }
    bad == 0
}

/// `out = w * x` for little-endian f32 bytes `x` (cleared and refilled, reusing its
/// allocation), returning whether every value was finite.
#[inline]
pub fn assign_scaled_le_checked(out: &mut Vec<f32>, bytes: &[u8], w: f32) -> bool {
    let mut bad = 0u32;
    out.clear();
    out.extend(bytes.chunks_exact(4).map(|c| {
        let v = le_f32(c);
        bad |= non_finite_bits(v.to_bits());
        w * v
    }));
    bad == 0
}

/// `out[i] = avg[i] - own[i]` for an average given as little-endian f32 bytes (any
/// alignment), returning whether every result is finite.
#[inline]
pub fn sub_le_checked(out: &mut [f32], avg: &[u8], own: &[f32]) -> bool {
    debug_assert!(avg.len() == out.len() * 4 && own.len() == out.len());
    let mut bad = 0u32;
    for ((o, c), &y) in out.iter_mut().zip(avg.chunks_exact(4)).zip(own) {
        let d = le_f32(c) - y;
        bad |= non_finite_bits(d.to_bits());
        *o = d;
    }
    bad == 0
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

/// `acc[i] += w * x[i]` for any element type of `x` (converted to f32 on the fly).
pub fn add_scaled_view(acc: &mut [f32], x: PartView<'_>, w: f32) {
    debug_assert_eq!(acc.len(), x.len());
    match x {
        PartView::F32(s) => add_scaled(acc, s, w),
        PartView::F16(s) => {
            for (a, v) in acc.iter_mut().zip(s) {
                *a += w * v.to_f32();
            }
        }
        PartView::BF16(s) => {
            for (a, v) in acc.iter_mut().zip(s) {
                *a += w * v.to_f32();
            }
        }
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

/// `x[i] *= s`.
#[inline]
pub fn scale(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
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

/// Largest `|a[i] - b[i]|` (0 for empty input; NaN if any difference is NaN).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0f32, |m, (&x, &y)| {
        let d = (x - y).abs();
        if d.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(d)
        }
    })
}

/// A weighted-sum accumulator for one part, as the reducer uses it: `Σ w·x` over f32 inputs,
/// then the average out to host memory.
///
/// Implementations: [`CpuBuffer`] (reference, used by [`crate::allreduce::Reducer`]). A GPU
/// buffer implements the same operations on device memory; results must agree with the CPU
/// buffer within float tolerance. A non-finite average (only possible for extreme weights or
/// values) is caught by the reducer, which then recomputes that part exactly in f64.
pub trait ReduceBuffer: Send {
    /// Number of accumulator elements.
    fn len(&self) -> usize;
    /// Whether the accumulator is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Resizes to `len` elements, all zero (reusing the allocation).
    fn reset(&mut self, len: usize);
    /// `acc += w * x`.
    fn add_scaled(&mut self, x: &[f32], w: f64);
    /// Resizes to `x.len()` elements and sets `acc = w * x` (the first contribution; one pass
    /// instead of zeroing and adding).
    fn assign_scaled(&mut self, x: &[f32], w: f64) {
        self.reset(x.len());
        self.add_scaled(x, w);
    }
    /// `acc += w * x`, returning whether every value of `x` was finite (if not, the
    /// accumulator's contents are unspecified).
    fn add_scaled_checked(&mut self, x: &[f32], w: f64) -> bool {
        self.add_scaled(x, w);
        all_finite(x)
    }
    /// `acc += w * x` for `x` given as little-endian f32 bytes, returning whether every value
    /// of `x` was finite (if not, the accumulator's contents are unspecified).
    fn add_scaled_le(&mut self, x: &[u8], w: f64) -> bool {
        let mut values = vec![0.0; x.len() / 4];
        copy_from_le(&mut values, x);
        self.add_scaled(&values, w);
        all_finite(&values)
    }
    /// [`ReduceBuffer::assign_scaled`] for little-endian f32 bytes, with the same check as
    /// [`ReduceBuffer::add_scaled_le`].
    fn assign_scaled_le(&mut self, x: &[u8], w: f64) -> bool {
        let mut values = vec![0.0; x.len() / 4];
        copy_from_le(&mut values, x);
        self.assign_scaled(&values, w);
        all_finite(&values)
    }
    /// Writes `acc / denominator` to host memory.
    fn average_to_host(&self, denominator: f64, out: &mut [f32]);
}

/// The CPU reference [`ReduceBuffer`] (f32 accumulator: memory-bound, as fast as a copy).
#[derive(Debug, Default, Clone)]
pub struct CpuBuffer {
    data: Vec<f32>,
}

impl CpuBuffer {
    /// The accumulator contents.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// An accumulator reusing `data`'s allocation (contents irrelevant).
    pub fn from_vec(data: Vec<f32>) -> Self {
        Self { data }
    }

    /// The allocation back, for reuse.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
}

impl ReduceBuffer for CpuBuffer {
    fn len(&self) -> usize {
        self.data.len()
    }

    fn reset(&mut self, len: usize) {
        self.data.clear();
        self.data.resize(len, 0.0);
    }

    fn add_scaled(&mut self, x: &[f32], w: f64) {
        add_scaled(&mut self.data, x, w as f32);
    }

    fn assign_scaled(&mut self, x: &[f32], w: f64) {
        let w = w as f32;
        self.data.clear();
        self.data.extend(x.iter().map(|&v| w * v));
    }

    fn add_scaled_checked(&mut self, x: &[f32], w: f64) -> bool {
        add_scaled_checked(&mut self.data, x, w as f32)
    }

    fn add_scaled_le(&mut self, x: &[u8], w: f64) -> bool {
        add_scaled_le_checked(&mut self.data, x, w as f32)
    }

    fn assign_scaled_le(&mut self, x: &[u8], w: f64) -> bool {
        assign_scaled_le_checked(&mut self.data, x, w as f32)
    }

    fn average_to_host(&self, denominator: f64, out: &mut [f32]) {
        let inv = (1.0 / denominator) as f32;
        for (o, &a) in out.iter_mut().zip(&self.data) {
            *o = a * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn kernels() {
        let mut acc = vec![1.0, 2.0, 3.0];
        add_scaled(&mut acc, &[1.0, 1.0, 1.0], 2.0);
        assert_eq!(acc, vec![3.0, 4.0, 5.0]);
        let h: Vec<f16> = [1.0f32, 2.0, 3.0]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        add_scaled_view(&mut acc, PartView::F16(&h), -1.0);
        assert_eq!(acc, vec![2.0, 2.0, 2.0]);
        let mut out = vec![0.0; 3];
        scaled_sub(&mut out, &acc, 0.5, &[1.0, 0.0, -1.0]);
        assert_eq!(out, vec![0.0, 1.0, 2.0]);
        assert_eq!(max_abs_diff(&out, &[0.0, 1.0, 1.5]), 0.5);
        assert!(max_abs_diff(&[f32::NAN], &[0.0]).is_nan());
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
    fn fused_kernels_match_the_plain_ones() {
        let x: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Any alignment of the byte view.
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&bytes);
        let unaligned = &shifted[1..];
        let base: Vec<f32> = (0..1001).map(|i| i as f32).collect();

        let mut want = base.clone();
        add_scaled(&mut want, &x, 0.5);
        let mut got = base.clone();
        assert!(add_scaled_checked(&mut got, &x, 0.5));
        assert_eq!(got, want);
        let mut got = base.clone();
        assert!(add_scaled_le_checked(&mut got, unaligned, 0.5));
        assert_eq!(got, want);

        let mut assigned = vec![9.0; 3];
        assert!(assign_scaled_le_checked(&mut assigned, unaligned, 2.0));
        assert_eq!(assigned, x.iter().map(|v| 2.0 * v).collect::<Vec<_>>());

        let mut out = vec![0.0; x.len()];
        assert!(sub_le_checked(&mut out, unaligned, &base));
        let mut want = x.clone();
        sub_assign(&mut want, &base);
        assert_eq!(out, want);

        let mut decoded = vec![0.0; x.len()];
        copy_from_le(&mut decoded, unaligned);
        assert_eq!(decoded, x);

        // Every non-finite value is reported, wherever it sits.
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 500, 1000] {
                let mut y = x.clone();
                y[at] = bad;
                let yb: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
                assert!(!add_scaled_checked(&mut base.clone(), &y, 1.0));
                assert!(!add_scaled_le_checked(&mut base.clone(), &yb, 1.0));
                assert!(!assign_scaled_le_checked(&mut Vec::new(), &yb, 1.0));
                assert!(!sub_le_checked(&mut vec![0.0; y.len()], &yb, &base));
            }
        }
        // An overflowing difference of finite values is caught too.
        let big = f32::MAX.to_le_bytes();
        assert!(!sub_le_checked(&mut [0.0], &big, &[-f32::MAX]));
    }

    #[test]
    fn cpu_buffer() {
        let mut b = CpuBuffer::default();
        b.reset(2);
        b.add_scaled(&[2.0, 4.0], 1.0);
        b.add_scaled(&[4.0, 8.0], 0.5);
        let mut out = [0.0; 2];
        b.average_to_host(1.5, &mut out);
        assert_eq!(out, [8.0 / 3.0, 16.0 / 3.0]);
        b.reset(1);
        assert_eq!(b.as_slice(), &[0.0]);
    }
}
