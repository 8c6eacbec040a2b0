//! Element-level helpers shared by the codecs: reading little-endian payload bytes into f32,
//! walking a [`PartView`] of any dtype as f32 chunks, and the common payload checks.
//!
//! Everything here works on fixed-size stack chunks, so no helper allocates, and every loop is
//! written over zipped slices / `as_chunks` so that it vectorises and carries no bounds checks.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{CodecError, CompressionType};
use crate::tensor::{DType, PartView};

/// Elements per chunk when a part is walked as f32 (16 KiB of f32: stays in L1).
pub(super) const CHUNK: usize = 4096;

/// Calls `f` on consecutive runs of at most [`CHUNK`] values of `values`, as f32.
///
/// f32 parts are passed through without copying; f16/bf16 parts are converted chunk by chunk
/// into a stack buffer (f16 with the F16C instructions where the CPU has them).
#[inline]
pub(super) fn for_each_f32_chunk(values: PartView<'_>, mut f: impl FnMut(&[f32])) {
    match values {
        PartView::F32(s) => s.chunks(CHUNK).for_each(f),
        PartView::F16(s) => {
            let mut buf = [0.0f32; CHUNK];
            for c in s.chunks(CHUNK) {
                let dst = &mut buf[..c.len()];
                c.convert_to_f32_slice(dst);
                f(dst);
            }
        }
        PartView::BF16(s) => {
            let mut buf = [0.0f32; CHUNK];
            for c in s.chunks(CHUNK) {
                let dst = &mut buf[..c.len()];
                for (o, v) in dst.iter_mut().zip(c) {
                    *o = bf16_bits_to_f32(v.to_bits());
                }
                f(dst);
            }
        }
    }
}

/// Widens bf16 bits to f32 (exact; NaN stays NaN).
#[inline(always)]
pub(super) fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Rounds f32 to bf16 bits, to nearest with ties to even; NaN stays (quiet) NaN, overflow
/// rounds to infinity. Branch-free so that loops over it vectorise; agrees with
/// [`half::bf16::from_f32`].
#[inline(always)]
pub(super) fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x0040;
    (if b & 0x7FFF_FFFF > 0x7F80_0000 {
        quiet_nan
    } else {
        rounded
    }) as u16
}

/// Appends 16-bit words (f16 or bf16 bits) as little-endian bytes.
pub(super) fn push_u16_le(words: &[u16], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(words));
    } else {
        out.reserve(words.len() * 2);
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// Decodes little-endian f32 bytes into `out`. `bytes.len()` must be `4 * out.len()`.
pub(super) fn f32_le_to_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 4);
    if cfg!(target_endian = "little")
        && let Ok(src) = bytemuck::try_cast_slice::<u8, f32>(bytes)
    {
        out.copy_from_slice(src);
        return;
    }
    let (words, _) = bytes.as_chunks::<4>();
    for (o, w) in out.iter_mut().zip(words) {
        *o = f32::from_le_bytes(*w);
    }
}

/// Decodes little-endian f16 bytes into `out`. `bytes.len()` must be `2 * out.len()`.
pub(super) fn f16_le_to_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 2);
    if cfg!(target_endian = "little")
        && let Ok(src) = bytemuck::try_cast_slice::<u8, f16>(bytes)
    {
        src.convert_to_f32_slice(out);
        return;
    }
    // Misaligned (or big-endian): go through an aligned stack chunk.
    let mut buf = [f16::ZERO; CHUNK];
    let (words, _) = bytes.as_chunks::<2>();
    for (o, w) in out.chunks_mut(CHUNK).zip(words.chunks(CHUNK)) {
        let h = &mut buf[..o.len()];
        for (d, w) in h.iter_mut().zip(w) {
            *d = f16::from_bits(u16::from_le_bytes(*w));
        }
        h.convert_to_f32_slice(o);
    }
}

/// Decodes little-endian bf16 bytes into `out`. `bytes.len()` must be `2 * out.len()`.
pub(super) fn bf16_le_to_f32(bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * 2);
    let (words, _) = bytes.as_chunks::<2>();
    for (o, w) in out.iter_mut().zip(words) {
        *o = bf16_bits_to_f32(u16::from_le_bytes(*w));
    }
}

/// Checks that `payload` has exactly `expected` bytes.
#[inline]
pub(super) fn check_len(
    codec: CompressionType,
    payload: &[u8],
    expected: usize,
    elements: usize,
) -> Result<(), CodecError> {
    if payload.len() == expected {
        Ok(())
    } else {
        Err(CodecError::Length {
            codec,
            expected,
            actual: payload.len(),
            elements,
        })
    }
}

/// Checks that a lossy codec's payload declares f32, the only dtype its encoder declares.
#[inline]
pub(super) fn check_f32(codec: CompressionType, dtype: DType) -> Result<(), CodecError> {
    if dtype == DType::F32 {
        Ok(())
    } else {
        Err(CodecError::DType { codec, dtype })
    }
}

#[cfg(test)]
pub(super) mod testing {
    //! Deterministic test data and helpers shared by the codec tests.

    use super::super::{Codec, CodecError};
    use crate::tensor::{DType, PartView};

    /// SplitMix64: a tiny seeded generator, good enough for test data.
    pub struct SplitMix(pub u64);

    impl SplitMix {
        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in (0, 1].
        pub fn unit(&mut self) -> f64 {
            ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
        }
    }

    /// `n` N(0, 1) values (Box–Muller), seeded.
    pub fn randn(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix(seed);
        let mut v = Vec::with_capacity(n + 1);
        while v.len() < n {
            let r = (-2.0 * rng.unit().ln()).sqrt();
            let t = std::f64::consts::TAU * rng.unit();
            v.push((r * t.cos()) as f32);
            v.push((r * t.sin()) as f32);
        }
        v.truncate(n);
        v
    }

    /// hivemind's test tensor: randn(128, 128, 64).
    pub fn hivemind_randn() -> Vec<f32> {
        randn(128 * 128 * 64, 0)
    }

    /// Encodes, then decodes into a buffer of the same length.
    pub fn roundtrip(codec: &dyn Codec, values: PartView<'_>) -> Result<Vec<f32>, CodecError> {
        let mut payload = Vec::new();
        codec.encode(values, &mut payload);
        let mut out = vec![f32::NAN; values.len()];
        codec.decode(&payload, codec.wire_dtype(values.dtype()), &mut out)?;
        Ok(out)
    }

    /// Mean squared error in f64.
    pub fn mse(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len());
        let s: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
            .sum();
        s / a.len().max(1) as f64
    }

    /// The checks every codec must pass on awkward inputs: empty, single value, constant,
    /// zeros(5, 5), appending to a non-empty buffer, and wrong output lengths.
    pub fn common_edge_cases(codec: &dyn Codec) {
        // Empty input round-trips.
        assert_eq!(
            roundtrip(codec, PartView::F32(&[])).unwrap(),
            Vec::<f32>::new()
        );
        // zeros(5, 5) decodes to finite values (in fact to zeros).
        let z = roundtrip(codec, PartView::F32(&[0.0; 25])).unwrap();
        assert!(z.iter().all(|v| v.is_finite()), "{:?}", codec.kind());
        assert!(z.iter().all(|&v| v == 0.0), "{:?}: {z:?}", codec.kind());
        // A single value and constant inputs come back (nearly) exactly (within every
        // codec's range; extreme constants are tested per codec).
        for c in [0.0f32, 1.0, -3.25, 0.1, -1000.0, 3e4] {
            for n in [1usize, 2, 3, 1000, 5000] {
                let v = vec![c; n];
                let d = roundtrip(codec, PartView::F32(&v)).unwrap();
                let tol = c.abs() * 1e-2;
                assert!(
                    d.iter().all(|&x| (x - c).abs() <= tol),
                    "{:?} constant {c} n={n}: {:?}",
                    codec.kind(),
                    &d[..n.min(4)]
                );
            }
        }
        // encode appends and never clears.
        let v = randn(300, 7);
        let mut buf = vec![0xAB; 13];
        codec.encode(PartView::F32(&v), &mut buf);
        assert_eq!(&buf[..13], &[0xAB; 13]);
        let mut alone = Vec::new();
        codec.encode(PartView::F32(&v), &mut alone);
        assert_eq!(&buf[13..], &alone[..]);
        // Wrong element counts and truncated/extended payloads are typed errors.
        let mut out = vec![0.0; 301];
        assert!(matches!(
            codec.decode(&alone, DType::F32, &mut out),
            Err(CodecError::Length { .. })
        ));
        assert!(matches!(
            codec.decode(&alone, DType::F32, &mut out[..299]),
            Err(CodecError::Length { .. })
        ));
        assert!(matches!(
            codec.decode(&alone[..alone.len() - 1], DType::F32, &mut out[..300]),
            Err(CodecError::Length { .. })
        ));
        let mut longer = alone.clone();
        longer.push(0);
        assert!(matches!(
            codec.decode(&longer, DType::F32, &mut out[..300]),
            Err(CodecError::Length { .. })
        ));
        codec.decode(&alone, DType::F32, &mut out[..300]).unwrap();
    }

    /// Encodes `n` values, then checks that decoding into `n + 1` or `n − 1` slots is a
    /// [`CodecError::Length`] (and into `n` slots succeeds).
    pub fn wrong_lengths_are_errors(codec: &dyn Codec, n: usize, seed: u64) {
        let x = randn(n, seed);
        let mut p = Vec::new();
        codec.encode(PartView::F32(&x), &mut p);
        let dtype = codec.wire_dtype(DType::F32);
        let mut out = vec![0.0; n + 1];
        assert!(matches!(
            codec.decode(&p, dtype, &mut out),
            Err(CodecError::Length { .. })
        ));
        if n > 0 {
            assert!(matches!(
                codec.decode(&p, dtype, &mut out[..n - 1]),
                Err(CodecError::Length { .. })
            ));
        }
        codec.decode(&p, dtype, &mut out[..n]).unwrap();
    }

    /// Decodes `payload` under every declared dtype into every output length from 0 to
    /// `payload.len()`: each call must return (Ok or a typed error), never panic, and an Ok
    /// decode must have written finite values wherever the codec promises them.
    pub fn garbage_never_panics(codec: &dyn Codec, payload: &[u8], finite_if_ok: bool) {
        let mut out = vec![0.0f32; payload.len() + 1];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for n in 0..=payload.len() {
                let o = &mut out[..n];
                if codec.decode(payload, dtype, o).is_ok() && finite_if_ok {
                    assert!(o.iter().all(|v| v.is_finite()), "{:?}", codec.kind());
                }
            }
        }
    }

    /// Round-trips an input given as f16 and as bf16 against the same values given as f32.
    pub fn half_inputs_match_f32(codec: &dyn Codec, values: &[f32]) {
        use half::{bf16, f16};
        let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        let hf: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let b: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        let bf: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
        for (view, as_f32) in [(PartView::F16(&h), &hf), (PartView::BF16(&b), &bf)] {
            let mut p_half = Vec::new();
            codec.encode(view, &mut p_half);
            let mut p_f32 = Vec::new();
            codec.encode(PartView::F32(as_f32), &mut p_f32);
            let mut d_half = vec![0.0; values.len()];
            codec
                .decode(&p_half, codec.wire_dtype(view.dtype()), &mut d_half)
                .unwrap();
            let mut d_f32 = vec![0.0; values.len()];
            codec
                .decode(&p_f32, codec.wire_dtype(DType::F32), &mut d_f32)
                .unwrap();
            assert_eq!(
                d_half.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                d_f32.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{:?} {:?}",
                codec.kind(),
                view.dtype()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    #[test]
    fn misaligned_payloads_decode() {
        let v: Vec<f32> = (0..9000).map(|i| i as f32 * 0.37 - 100.0).collect();
        let h: Vec<u16> = v.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
        let expected_h: Vec<f32> = h.iter().map(|&b| f16::from_bits(b).to_f32()).collect();
        let f32_bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut f16_bytes = Vec::new();
        push_u16_le(&h, &mut f16_bytes);
        let mut out = vec![0.0; v.len()];
        // A Vec's data is aligned; one byte in, it is not: both paths must agree.
        for shift in [0usize, 1] {
            let mut buf = vec![0u8; shift];
            buf.extend_from_slice(&f32_bytes);
            f32_le_to_f32(&buf[shift..], &mut out);
            assert_eq!(out, v);
            let mut buf = vec![0u8; shift];
            buf.extend_from_slice(&f16_bytes);
            f16_le_to_f32(&buf[shift..], &mut out);
            assert_eq!(out, expected_h);
        }
    }

    proptest! {
        #[test]
        fn bf16_rounding_matches_half(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            let ours = f32_to_bf16_bits(x);
            let theirs = bf16::from_f32(x).to_bits();
            if x.is_nan() {
                prop_assert!(bf16_bits_to_f32(ours).is_nan());
            } else {
                prop_assert_eq!(ours, theirs);
            }
        }
    }
}
