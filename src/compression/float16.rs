//! [`Float16Codec`] and [`BFloat16Codec`]: 16-bit floats, two bytes per value.
//!
//! Both payloads are `n` little-endian 16-bit words and declare [`DType::F32`] (the trait's
//! default [`Codec::wire_dtype`]: they decode to f32 whatever they were given); decode accepts
//! only that declaration and rejects any other with [`CodecError::DType`].

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::elements::{
    CHUNK, bf16_le_to_f32, check_f32, check_len, f16_le_to_f32, f32_to_bf16_bits,
    for_each_f32_chunk, push_u16_le,
};
use super::{Codec, CodecError, CompressionType};
use crate::tensor::{DType, PartView};

/// Bits of the largest finite f16, 65504.
const F16_MAX_BITS: u16 = 0x7BFF;
/// Bits of f16 infinity (without sign).
const F16_INF_BITS: u16 = 0x7C00;

/// Replaces ±infinity by ±65504, in place (NaN is left alone). Applied after rounding to
/// nearest, this is the same as clamping the f32 input to ±65504 first: every f32 that
/// rounds to infinity is above 65504 in magnitude.
#[inline]
fn saturate_f16_bits(words: &mut [u16]) {
    for w in words {
        if *w & 0x7FFF == F16_INF_BITS {
            *w -= F16_INF_BITS - F16_MAX_BITS;
        }
    }
}

/// IEEE half precision: `f32 → clamp to ±65504 → f16` (round to nearest even).
///
/// Payload: `n` little-endian f16 words (`2n` bytes). It declares [`DType::F32`] (the values
/// decode to f32 whatever the input dtype was); decode rejects any other declaration
/// ([`CodecError::DType`]) and any other length ([`CodecError::Length`]), nothing else.
///
/// Error bound (stated and tested): for `|x| ≤ 65504`, `|decode − x| ≤ max(2^-11·|x|, 2^-25)`
/// (relative 2^-11 in f16's normal range, half a subnormal step below 2^-14); larger
/// magnitudes, infinities included, come back as ±65504; NaN stays NaN. MSE on N(0, 1) data
/// is about 4.3e-8 (hivemind's bound, tested: 5e-8). Ratio: 2 / input element size.
#[derive(Clone, Copy, Debug, Default)]
pub struct Float16Codec;

impl Codec for Float16Codec {
    fn kind(&self) -> CompressionType {
        CompressionType::Float16
    }

    fn compression_ratio(&self, dtype: DType) -> f64 {
        2.0 / dtype.size_bytes() as f64
    }

    fn encode(&self, values: PartView<'_>, out: &mut Vec<u8>) {
        out.reserve(values.len() * 2);
        let mut words = [0u16; CHUNK];
        if let PartView::F16(s) = values {
            for c in s.chunks(CHUNK) {
                let w = &mut words[..c.len()];
                for (d, v) in w.iter_mut().zip(c) {
                    *d = v.to_bits();
                }
                saturate_f16_bits(w);
                push_u16_le(w, out);
            }
            return;
        }
        let mut halves = [f16::ZERO; CHUNK];
        for_each_f32_chunk(values, |c| {
            let h = &mut halves[..c.len()];
            h.convert_from_f32_slice(c);
            let w: &mut [u16] = bytemuck::cast_slice_mut(h);
            saturate_f16_bits(w);
            push_u16_le(w, out);
        });
    }

    fn decode(&self, payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError> {
        check_f32(self.kind(), dtype)?;
        check_len(self.kind(), payload, out.len() * 2, out.len())?;
        f16_le_to_f32(payload, out);
        Ok(())
    }
}

/// bfloat16: `f32 → bf16` (round to nearest even; f32's exponent range, so no clamping).
///
/// Payload: `n` little-endian bf16 words (`2n` bytes); declared dtype and checks as
/// [`Float16Codec`]. A bf16 input is sent as is.
///
/// Error bound (stated and tested): for f32-normal `|x|` up to bf16's largest finite value
/// (≈3.3895e38), `|decode − x| ≤ 2^-8·|x|`; f32 subnormals are off by at most 2^-134; NaN
/// stays NaN. MSE on N(0, 1) data is about 2.8e-6, 64 times f16's (3 fewer mantissa bits;
/// bound tested: 5e-6). Ratio: 2 / input element size.
#[derive(Clone, Copy, Debug, Default)]
pub struct BFloat16Codec;

impl Codec for BFloat16Codec {
    fn kind(&self) -> CompressionType {
        CompressionType::BFloat16
    }

    fn compression_ratio(&self, dtype: DType) -> f64 {
        2.0 / dtype.size_bytes() as f64
    }

    fn encode(&self, values: PartView<'_>, out: &mut Vec<u8>) {
        if let PartView::BF16(s) = values {
            // Already bf16: the raw words (the same bytes `NoCompression` would send).
            if cfg!(target_endian = "little") {
                out.extend_from_slice(values.as_bytes());
            } else {
                out.reserve(s.len() * 2);
                for v in s {
                    out.extend_from_slice(&v.to_bits().to_le_bytes());
                }
            }
            return;
        }
        out.reserve(values.len() * 2);
        let mut words = [0u16; CHUNK];
        for_each_f32_chunk(values, |c| {
            let w = &mut words[..c.len()];
            for (d, &x) in w.iter_mut().zip(c) {
                *d = f32_to_bf16_bits(x);
            }
            push_u16_le(w, out);
        });
    }

    fn decode(&self, payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError> {
        check_f32(self.kind(), dtype)?;
        check_len(self.kind(), payload, out.len() * 2, out.len())?;
        bf16_le_to_f32(payload, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::elements::testing::*;
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    /// The stated Float16 bound for `|x| ≤ 65504`.
    fn f16_bound(x: f32) -> f64 {
        (f64::from(x.abs()) * 2f64.powi(-11)).max(2f64.powi(-25))
    }

    #[test]
    fn hivemind_randn_mse() {
        let x = hivemind_randn();
        let d = roundtrip(&Float16Codec, PartView::F32(&x)).unwrap();
        let e = mse(&x, &d);
        eprintln!("Float16 mse {e:.3e}");
        assert!(e < 5e-8, "float16 mse {e}");
        let d = roundtrip(&BFloat16Codec, PartView::F32(&x)).unwrap();
        let e = mse(&x, &d);
        eprintln!("BFloat16 mse {e:.3e}");
        assert!(e < 5e-6, "bfloat16 mse {e}");
    }

    #[test]
    fn edge_cases() {
        for codec in [&Float16Codec as &dyn Codec, &BFloat16Codec] {
            common_edge_cases(codec);
            half_inputs_match_f32(codec, &randn(5000, 5));
            let mut p = Vec::new();
            codec.encode(PartView::F32(&[1.0, 2.0]), &mut p);
            let mut out = [0.0; 2];
            for dtype in [DType::F16, DType::BF16] {
                assert!(matches!(
                    codec.decode(&p, dtype, &mut out),
                    Err(CodecError::DType { .. })
                ));
            }
        }
    }

    #[test]
    fn float16_saturates_and_keeps_nan() {
        let x = [
            1e6,
            -1e6,
            65504.0,
            65519.0,
            65520.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-9,
            -0.0,
        ];
        let d = roundtrip(&Float16Codec, PartView::F32(&x)).unwrap();
        assert_eq!(
            &d[..7],
            &[
                65504.0, -65504.0, 65504.0, 65504.0, 65504.0, 65504.0, -65504.0
            ]
        );
        assert!(d[7].is_nan());
        assert_eq!(d[8], 0.0);
        assert_eq!(d[9].to_bits(), (-0.0f32).to_bits());
        // An f16 input holding infinity is clamped as well.
        let h = [f16::INFINITY, f16::NEG_INFINITY, f16::from_f32(3.5)];
        let d = roundtrip(&Float16Codec, PartView::F16(&h)).unwrap();
        assert_eq!(d, vec![65504.0, -65504.0, 3.5]);
    }

    #[test]
    fn bfloat16_specials() {
        let x = [
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            1.0 + 2f32.powi(-8),
        ];
        let d = roundtrip(&BFloat16Codec, PartView::F32(&x)).unwrap();
        assert_eq!(d[0], f32::INFINITY);
        assert_eq!(d[1], f32::INFINITY);
        assert!(d[2].is_nan());
        assert_eq!(d[3], f32::MIN_POSITIVE);
        assert_eq!(d[4], 1.0); // a tie rounds to even
        let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut p = Vec::new();
        BFloat16Codec.encode(PartView::BF16(&b), &mut p);
        assert_eq!(p, bytemuck::cast_slice::<bf16, u8>(&b));
    }

    proptest! {
        #[test]
        fn float16_bound(n in 0usize..5000, exp in -30i32..17, seed in any::<u64>()) {
            let scale = 2f32.powi(exp);
            let x: Vec<f32> = randn(n, seed).iter().map(|v| v * scale).collect();
            let d = roundtrip(&Float16Codec, PartView::F32(&x)).unwrap();
            for (&a, &b) in x.iter().zip(&d) {
                if a.abs() <= 65504.0 {
                    let err = (f64::from(a) - f64::from(b)).abs();
                    prop_assert!(err <= f16_bound(a), "{a} -> {b}");
                } else {
                    prop_assert_eq!(b, 65504f32.copysign(a));
                }
            }
        }

        #[test]
        fn bfloat16_bound(n in 0usize..5000, exp in -120i32..120, seed in any::<u64>()) {
            let scale = 2f32.powi(exp);
            let x: Vec<f32> = randn(n, seed).iter().map(|v| v * scale).collect();
            let d = roundtrip(&BFloat16Codec, PartView::F32(&x)).unwrap();
            for (&a, &b) in x.iter().zip(&d) {
                let err = (f64::from(a) - f64::from(b)).abs();
                if a.abs() >= f32::MIN_POSITIVE {
                    prop_assert!(err <= f64::from(a.abs()) * 2f64.powi(-8), "{a} -> {b}");
                } else {
                    prop_assert!(err <= 2f64.powi(-134), "{a} -> {b}");
                }
            }
        }

        #[test]
        fn any_bits_never_panic(bits in prop::collection::vec(any::<u32>(), 0..300)) {
            let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            for codec in [&Float16Codec as &dyn Codec, &BFloat16Codec] {
                let d = roundtrip(codec, PartView::F32(&x)).unwrap();
                for (&a, &b) in x.iter().zip(&d) {
                    prop_assert_eq!(a.is_nan(), b.is_nan());
                }
            }
        }

        #[test]
        fn wrong_lengths(n in 0usize..5000, seed in any::<u64>()) {
            wrong_lengths_are_errors(&Float16Codec, n, seed);
            wrong_lengths_are_errors(&BFloat16Codec, n, seed);
        }

        #[test]
        fn garbage(payload in prop::collection::vec(any::<u8>(), 0..600)) {
            garbage_never_panics(&Float16Codec, &payload, false);
            garbage_never_panics(&BFloat16Codec, &payload, false);
        }
    }
}
