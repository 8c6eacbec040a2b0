//! [`NoCompression`]: the raw elements.

use super::elements::{bf16_le_to_f32, check_len, f16_le_to_f32, f32_le_to_f32};
use super::{Codec, CodecError, CompressionType};
use crate::tensor::{DType, PartView};

/// Sends the raw little-endian elements in the part's own dtype (f32, f16 or bf16).
///
/// Payload: `n × dtype.size_bytes()` bytes. The payload declares the input dtype
/// ([`Codec::wire_dtype`] is the identity) and decode accepts all three dtypes. Exact: decoding
/// gives back the input converted to f32 bit for bit (NaN payloads included).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoCompression;

impl Codec for NoCompression {
    fn kind(&self) -> CompressionType {
        CompressionType::None
    }

    fn compression_ratio(&self, _dtype: DType) -> f64 {
        1.0
    }

    fn wire_dtype(&self, input_dtype: DType) -> DType {
        input_dtype
    }

    fn encode(&self, values: PartView<'_>, out: &mut Vec<u8>) {
        if cfg!(target_endian = "little") {
            out.extend_from_slice(values.as_bytes());
            return;
        }
        out.reserve(values.as_bytes().len());
        match values {
            PartView::F32(s) => s
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            PartView::F16(s) => s
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_bits().to_le_bytes())),
            PartView::BF16(s) => s
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_bits().to_le_bytes())),
        }
    }

    fn decode(&self, payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError> {
        let n = out.len();
        check_len(self.kind(), payload, n * dtype.size_bytes(), n)?;
        match dtype {
            DType::F32 => f32_le_to_f32(payload, out),
            DType::F16 => f16_le_to_f32(payload, out),
            DType::BF16 => bf16_le_to_f32(payload, out),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::elements::testing::*;
    use super::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    #[test]
    fn hivemind_randn_is_exact() {
        let x = hivemind_randn();
        assert_eq!(roundtrip(&NoCompression, PartView::F32(&x)).unwrap(), x);
    }

    #[test]
    fn edge_cases() {
        common_edge_cases(&NoCompression);
        half_inputs_match_f32(&NoCompression, &randn(5000, 3));
    }

    #[test]
    fn half_dtypes_are_carried_raw() {
        let x = randn(1000, 11);
        let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        for view in [PartView::F16(&h), PartView::BF16(&b)] {
            let mut p = Vec::new();
            NoCompression.encode(view, &mut p);
            assert_eq!(p.len(), 2 * x.len());
            assert_eq!(NoCompression.wire_dtype(view.dtype()), view.dtype());
            let mut out = vec![0.0; x.len()];
            NoCompression.decode(&p, view.dtype(), &mut out).unwrap();
            for (i, o) in out.iter().enumerate() {
                assert_eq!(*o, view.get_f32(i));
            }
            // Declaring f32 for a 2-byte payload is a length error.
            assert!(matches!(
                NoCompression.decode(&p, DType::F32, &mut out),
                Err(CodecError::Length { .. })
            ));
        }
    }

    #[test]
    fn special_values_survive() {
        let x = [
            f32::NAN,
            f32::INFINITY,
            -0.0,
            f32::MIN_POSITIVE / 4.0,
            f32::MAX,
        ];
        let d = roundtrip(&NoCompression, PartView::F32(&x)).unwrap();
        assert_eq!(
            d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            x.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    proptest! {
        #[test]
        fn roundtrip_is_bit_exact(bits in prop::collection::vec(any::<u32>(), 0..5000)) {
            let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let d = roundtrip(&NoCompression, PartView::F32(&x)).unwrap();
            prop_assert_eq!(d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits);
        }

        #[test]
        fn wrong_lengths(n in 0usize..5000, seed in any::<u64>()) {
            wrong_lengths_are_errors(&NoCompression, n, seed);
        }

        #[test]
        fn garbage(payload in prop::collection::vec(any::<u8>(), 0..600)) {
            // Raw payloads may carry NaN/inf: no finiteness promise.
            garbage_never_panics(&NoCompression, &payload, false);
        }
    }
}
