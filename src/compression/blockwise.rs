//! [`Blockwise8Bit`]: blocks of 4096 values, each scaled by its absolute maximum and coded
//! against a fixed, nonlinear ("dynamic") 8-bit codebook, in the style of bitsandbytes'
//! `quantize_blockwise`. The codebook, the payload and the checks are documented on the type.
//!
//! Implementation: a value `x` of a block with absmax `a` gets the magnitude level nearest to
//! `|x| / a` (ties to the lower one). That is a binary search over the sorted level midpoints,
//! but here it is one lookup in a table indexed by the top 16 bits of the f32 `x / a` (sign,
//! exponent, 7 mantissa bits) plus one integer comparison of the low 16 bits: no cell of that
//! table holds more than one midpoint, which the tests check for every cell, and the sign comes
//! with the cell. Decoding is one table read and one multiply per value.

use std::sync::OnceLock;

use super::elements::{CHUNK, check_f32, check_len, for_each_f32_chunk};
use super::{Codec, CodecError, CompressionType};
use crate::tensor::{DType, PartView};

/// Values per block (one absmax each).
pub(crate) const BLOCK: usize = 4096;

const _: () = assert!(CHUNK == BLOCK, "blocks are encoded one f32 chunk at a time");

/// Magnitude levels per sign.
const LEVELS: usize = 128;
/// Entries of the lookup table: every value of the top 16 bits of an f32.
const LUT_LEN: usize = 1 << 16;
/// Top 16 bits of 1.0: magnitude cells above it (rounding above 1, infinity, NaN) get level 1.
const ONE_KEY: usize = 0x3F80;
/// Low field of a lookup entry meaning "no threshold in this cell" (above every 16-bit value).
const NO_THRESHOLD: u32 = 0x1_0000;

/// The fixed codebook and the table that finds a value's code.
struct Tables {
    /// `lut[key]`, for the cell of the scaled values `y = x / absmax` whose top 16 bits are
    /// `key`: `code << 17 | low`, where `code` is the sign bit of the cell and the number of
    /// level midpoints lying strictly below its magnitudes, and `low` the low 16 bits of the
    /// next midpoint if it lies inside the cell ([`NO_THRESHOLD`] if not). A `y` of the cell
    /// gets code `code + (low16(y) > low)`: within a cell (equal sign, exponent and top
    /// mantissa bits), comparing the low bits compares the magnitudes. 256 KiB, of which the few
    /// cells that real data touch stay in L1.
    lut: Box<[u32; LUT_LEN]>,
    /// The signed value of every code byte; `decode[..128]` are the magnitude levels, strictly
    /// ascending from `0` to `1`.
    decode: [f32; 256],
}

/// The 128 magnitude levels, ascending (see the module docs).
fn magnitude_levels() -> [f32; LEVELS] {
    let mut levels = [0.0f32; LEVELS];
    let mut i = 1;
    for d in 1..=6 {
        let count = 1usize << d;
        let decade = 10f64.powi(d - 6);
        for j in 0..count {
            levels[i] = (decade * (0.1 + 0.9 * (j as f64 + 0.5) / count as f64)) as f32;
            i += 1;
        }
    }
    levels[LEVELS - 1] = 1.0;
    levels
}

/// Midpoints between consecutive levels (the decision thresholds), `+inf` in the last slot.
fn midpoints(levels: &[f32; LEVELS]) -> [f32; LEVELS] {
    let mut thresholds = [f32::INFINITY; LEVELS];
    for (t, w) in thresholds.iter_mut().zip(levels.windows(2)) {
        *t = ((f64::from(w[0]) + f64::from(w[1])) / 2.0) as f32;
    }
    thresholds
}

fn build_tables() -> Tables {
    let levels = magnitude_levels();
    let thresholds = midpoints(&levels);
    let mut lut: Box<[u32; LUT_LEN]> = vec![0u32; LUT_LEN]
        .into_boxed_slice()
        .try_into()
        .expect("a boxed slice of LUT_LEN entries");
    let (positive, negative) = lut.split_at_mut(LUT_LEN / 2);
    let mut below = 0usize;
    for (key, (pos, neg)) in positive.iter_mut().zip(negative.iter_mut()).enumerate() {
        let (code, low) = if key > ONE_KEY {
            (LEVELS as u32 - 1, NO_THRESHOLD)
        } else {
            let cell_start = f32::from_bits((key as u32) << 16);
            while thresholds[below] < cell_start {
                below += 1; // stops at the +inf sentinel, so below ≤ 127
            }
            let next = thresholds[below].to_bits();
            let low = if next >> 16 == key as u32 {
                next & 0xFFFF
            } else {
                NO_THRESHOLD
            };
            (below as u32, low)
        };
        *pos = code << 17 | low;
        *neg = (code | LEVELS as u32) << 17 | low;
    }
    let mut decode = [0.0f32; 256];
    for (code, v) in decode.iter_mut().enumerate() {
        let m = levels[code & (LEVELS - 1)];
        *v = if code & LEVELS != 0 { -m } else { m };
    }
    Tables { lut, decode }
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(build_tables)
}

/// The code of `x`, for a block whose reciprocal absmax is `inv` (`|x| · inv ≤ 1` up to
/// rounding).
#[inline(always)]
fn code_of(t: &Tables, x: f32, inv: f32) -> u8 {
    let y = (x * inv).to_bits();
    let e = t.lut[(y >> 16) as usize];
    ((e >> 17) + u32::from(y & 0xFFFF > e & 0x1_FFFF)) as u8
}

/// Codes one block into `codes` and returns its absmax.
#[inline]
fn encode_block(t: &Tables, block: &[f32], codes: &mut [u8]) -> f32 {
    // Max of |x| on the bit patterns: monotone for non-negative floats, and a NaN (the largest
    // pattern) or infinity wins, which makes the absmax non-finite as documented.
    let amax_bits = block
        .iter()
        .fold(0u32, |a, &x| a.max(x.to_bits() & 0x7FFF_FFFF));
    let absmax = f32::from_bits(amax_bits);
    if amax_bits == 0 {
        codes.fill(0);
    } else if absmax >= f32::MIN_POSITIVE {
        let inv = 1.0 / absmax;
        for (k, &x) in codes.iter_mut().zip(block) {
            *k = code_of(t, x, inv);
        }
    } else {
        // Subnormal absmax: 1/absmax would overflow, so scale the block up by 2^24 first
        // (exact for these magnitudes).
        const UP: f32 = (1u32 << 24) as f32;
        let inv = 1.0 / (absmax * UP);
        for (k, &x) in codes.iter_mut().zip(block) {
            *k = code_of(t, x * UP, inv);
        }
    }
    absmax
}

/// Blockwise dynamic 8-bit quantisation (hivemind's `BlockwiseQuantization`, block 4096).
///
/// # Codebook
///
/// A code byte is sign-magnitude: bit 7 is the sign, bits 0–6 index 128 magnitude levels in
/// `[0, 1]`, ascending:
///
/// * level 0 is `0`;
/// * for each decade `d = 1..=6`, `2^d` levels at the midpoints of `2^d` equal sub-intervals of
///   `[0.1, 1] · 10^(d−6)` (2 + 4 + … + 64 = 126 levels, from `3.25e-6` up to `0.99297`);
/// * level 127 is `1`.
///
/// This is bitsandbytes' signed dynamic map (`create_dynamic_map`) made symmetric (its smallest
/// decade is dropped to make room for an exact `−1`), so a block's absmax, its negation and
/// zero all decode exactly, and resolution is finest near 0. Each value is coded as the level
/// nearest to `|x| / absmax`, with its sign.
///
/// # Payload
///
/// ```text
/// f32 absmax[ceil(n / 4096)] ‖ u8 code[n]          (little-endian, no header)
/// ```
///
/// Decoding is `±level[code & 127] · absmax[block]`. The payload declares [`DType::F32`]
/// (decode rejects any other declaration with [`CodecError::DType`]), must have exactly the
/// length above ([`CodecError::Length`]), and every absmax must be finite
/// ([`CodecError::NonFinite`]) and not negative ([`CodecError::Header`]); on error `out` is left
/// untouched. The encoder does not sanitise its input: a block holding a NaN or an infinity gets
/// a non-finite absmax, so the receiver rejects the part rather than averaging it in.
///
/// # Error bound
///
/// Stated and tested: `|decode − x| ≤ absmax · (0.9/128 + 2^-20)`, where `absmax` is the largest
/// magnitude in `x`'s block (half the widest gap between levels, `0.9/64` in the top decade);
/// a block's absmax, its negation and zero decode exactly, and an all-zero block decodes to
/// zeros. MSE on N(0, 1) data is about 1.7e-4 (hivemind's bound, tested: 8e-4).
///
/// Ratio: `(1 + 4/4096)` / input element size.
#[derive(Clone, Copy, Debug, Default)]
pub struct Blockwise8Bit;

impl Codec for Blockwise8Bit {
    fn kind(&self) -> CompressionType {
        CompressionType::Blockwise8Bit
    }

    fn compression_ratio(&self, dtype: DType) -> f64 {
        (1.0 + 4.0 / BLOCK as f64) / dtype.size_bytes() as f64
    }

    fn encode(&self, values: PartView<'_>, out: &mut Vec<u8>) {
        let t = tables();
        let n = values.len();
        let head = 4 * n.div_ceil(BLOCK);
        let start = out.len();
        out.reserve(head + n);
        out.resize(start + head, 0); // the absmax of each block, filled in as we go
        let mut codes = [0u8; BLOCK];
        let mut slot = start;
        for_each_f32_chunk(values, |block| {
            let k = &mut codes[..block.len()];
            let absmax = encode_block(t, block, k);
            out[slot..slot + 4].copy_from_slice(&absmax.to_le_bytes());
            slot += 4;
            out.extend_from_slice(k);
        });
    }

    fn decode(&self, payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError> {
        let kind = self.kind();
        check_f32(kind, dtype)?;
        let n = out.len();
        let head = 4 * n.div_ceil(BLOCK);
        check_len(kind, payload, head + n, n)?;
        let (head, codes) = payload.split_at(head);
        let (absmax, _) = head.as_chunks::<4>();
        for (b, w) in absmax.iter().enumerate() {
            let a = f32::from_le_bytes(*w);
            if !a.is_finite() {
                return Err(CodecError::NonFinite { codec: kind });
            }
            if a < 0.0 {
                return Err(CodecError::Header {
                    codec: kind,
                    detail: format!("block {b} has negative absmax {a}"),
                });
            }
        }
        let t = tables();
        for ((o, k), w) in out.chunks_mut(BLOCK).zip(codes.chunks(BLOCK)).zip(absmax) {
            let a = f32::from_le_bytes(*w);
            for (o, &k) in o.iter_mut().zip(k) {
                *o = t.decode[usize::from(k)] * a;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::elements::testing::*;
    use super::*;
    use proptest::prelude::*;

    fn levels() -> &'static [f32] {
        &tables().decode[..LEVELS]
    }

    /// Half the widest gap between adjacent levels.
    const HALF_GAP: f64 = 0.9 / 128.0;

    fn bound(absmax: f32) -> f64 {
        f64::from(absmax) * (HALF_GAP + 2f64.powi(-20))
    }

    /// Checks the stated bound block by block.
    fn check_bound(x: &[f32], d: &[f32]) -> Result<(), TestCaseError> {
        for (xb, db) in x.chunks(BLOCK).zip(d.chunks(BLOCK)) {
            let a = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (&u, &v) in xb.iter().zip(db) {
                let err = (f64::from(u) - f64::from(v)).abs();
                prop_assert!(err <= bound(a), "{u} -> {v}, absmax {a}");
                if u.abs() == a || u == 0.0 {
                    prop_assert_eq!(u, v);
                }
            }
        }
        Ok(())
    }

    #[test]
    fn tables_are_consistent() {
        let t = tables();
        assert_eq!(levels()[0], 0.0);
        assert_eq!(levels()[LEVELS - 1], 1.0);
        assert!(levels().windows(2).all(|w| w[0] < w[1]));
        let widest = levels()
            .windows(2)
            .map(|w| f64::from(w[1]) - f64::from(w[0]))
            .fold(0.0, f64::max);
        assert!(widest / 2.0 <= HALF_GAP + 1e-7, "{widest}");
        let thresholds = midpoints(&magnitude_levels());
        assert!(thresholds.windows(2).all(|w| w[0] < w[1]));
        // No lookup cell holds two thresholds, so one comparison finishes the search, and the
        // entry names the right one; negative cells mirror positive ones.
        for (key, &e) in t.lut[..LUT_LEN / 2].iter().enumerate() {
            assert_eq!(t.lut[key + LUT_LEN / 2], e | (LEVELS as u32) << 17);
            let below = (e >> 17) as usize;
            let low = e & 0x1_FFFF;
            if key > ONE_KEY {
                assert_eq!((below, low), (LEVELS - 1, NO_THRESHOLD));
                continue;
            }
            let cell_start = f32::from_bits((key as u32) << 16);
            let cell_last = f32::from_bits(((key as u32 + 1) << 16) - 1);
            assert!(below == 0 || thresholds[below - 1] < cell_start);
            assert!(thresholds[below] >= cell_start);
            if below + 1 < LEVELS {
                assert!(thresholds[below + 1] > cell_last, "key {key:#x}");
            }
            if thresholds[below] <= cell_last {
                assert_eq!(low, thresholds[below].to_bits() & 0xFFFF);
            } else {
                assert_eq!(low, NO_THRESHOLD);
            }
        }
        for code in 0..256 {
            assert_eq!(t.decode[code].abs(), levels()[code & 127]);
        }
    }

    #[test]
    fn codes_are_nearest_levels() {
        let t = tables();
        let thresholds = midpoints(&magnitude_levels());
        let mut rng = SplitMix(9);
        // Every 97th f32 in [0, 1], plus random ones: the code equals a binary search over the
        // thresholds and the level is a nearest one.
        let check = |m: f32| {
            let k = code_of(t, m, 1.0);
            let searched = thresholds.partition_point(|&th| th < m);
            assert_eq!(usize::from(k), searched, "m = {m}");
            let err = (f64::from(m) - f64::from(levels()[usize::from(k)])).abs();
            let best = levels()
                .iter()
                .map(|&l| (f64::from(m) - f64::from(l)).abs())
                .fold(f64::INFINITY, f64::min);
            assert!(
                err <= best + f64::from(m) * 2f64.powi(-23),
                "m = {m}: {err} vs {best}"
            );
            assert_eq!(code_of(t, -m, 1.0), k | 0x80);
        };
        for bits in (0..=1.0f32.to_bits()).step_by(97) {
            check(f32::from_bits(bits));
        }
        for th in thresholds[..LEVELS - 1].iter() {
            for m in [th.next_down(), *th, th.next_up()] {
                check(m);
            }
        }
        for _ in 0..100_000 {
            check(rng.unit() as f32);
        }
        check(1.0);
        check(0.0);
        assert_eq!(code_of(t, 1.5, 1.0), 127);
        assert_eq!(code_of(t, -1.5, 1.0), 255);
        assert_eq!(code_of(t, f32::INFINITY, 1.0), 127);
        assert_eq!(code_of(t, -0.0, 1.0), 128);
    }

    #[test]
    fn hivemind_randn_mse() {
        let x = hivemind_randn();
        let d = roundtrip(&Blockwise8Bit, PartView::F32(&x)).unwrap();
        let e = mse(&x, &d);
        eprintln!("Blockwise8Bit mse {e:.3e}");
        assert!(e < 8e-4, "mse {e}");
        check_bound(&x, &d).unwrap();
    }

    #[test]
    fn edge_cases() {
        common_edge_cases(&Blockwise8Bit);
        half_inputs_match_f32(&Blockwise8Bit, &randn(10_000, 5));
        // Zero blocks between non-zero ones; subnormal and huge blocks.
        let mut x = vec![0.0f32; 3 * BLOCK + 5];
        x[..BLOCK].copy_from_slice(&randn(BLOCK, 1));
        for (v, r) in x[2 * BLOCK..].iter_mut().zip(randn(BLOCK + 5, 2)) {
            *v = r * 1e-40;
        }
        x[BLOCK + 7] = -f32::MAX;
        x[BLOCK + 8] = f32::MAX;
        let d = roundtrip(&Blockwise8Bit, PartView::F32(&x)).unwrap();
        assert!(d.iter().all(|v| v.is_finite()));
        check_bound(&x, &d).unwrap();
        assert_eq!(d[BLOCK + 7], -f32::MAX);
        let mut p = Vec::new();
        Blockwise8Bit.encode(PartView::F32(&x), &mut p);
        assert_eq!(p.len(), 4 * 4 + x.len());
    }

    #[test]
    fn non_finite_inputs_are_rejected_not_averaged() {
        for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = randn(5000, 1);
            x[4500] = bad;
            let err = roundtrip(&Blockwise8Bit, PartView::F32(&x)).unwrap_err();
            assert!(matches!(err, CodecError::NonFinite { .. }), "{err:?}");
        }
    }

    #[test]
    fn payload_checks() {
        let x = randn(5000, 3);
        let mut p = Vec::new();
        Blockwise8Bit.encode(PartView::F32(&x), &mut p);
        assert_eq!(p.len(), 8 + 5000);
        let mut out = vec![0.0; 5000];
        assert!(matches!(
            Blockwise8Bit.decode(&p, DType::F16, &mut out),
            Err(CodecError::DType { .. })
        ));
        let mut q = p.clone();
        q[4..8].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(matches!(
            Blockwise8Bit.decode(&q, DType::F32, &mut out),
            Err(CodecError::Header { .. })
        ));
        q[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(matches!(
            Blockwise8Bit.decode(&q, DType::F32, &mut out),
            Err(CodecError::NonFinite { .. })
        ));
        assert!(out.iter().all(|&v| v == 0.0), "out is untouched on error");
        Blockwise8Bit.decode(&p, DType::F32, &mut out).unwrap();
    }

    proptest! {
        #[test]
        fn bound_holds(
            n in 0usize..5000,
            exp in -60i32..60,
            heavy in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let scale = 2f32.powi(exp);
            let x: Vec<f32> = randn(n, seed)
                .iter()
                .map(|&v| if heavy { v * v * v * scale } else { v * scale })
                .collect();
            let d = roundtrip(&Blockwise8Bit, PartView::F32(&x)).unwrap();
            check_bound(&x, &d)?;
        }

        #[test]
        fn any_bits_never_panic(bits in prop::collection::vec(any::<u32>(), 0..300)) {
            let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            match roundtrip(&Blockwise8Bit, PartView::F32(&x)) {
                Ok(d) => {
                    prop_assert!(x.iter().all(|v| v.is_finite()));
                    check_bound(&x, &d)?;
                }
                Err(e) => {
                    let non_finite = matches!(e, CodecError::NonFinite { .. });
                    prop_assert!(non_finite);
                    prop_assert!(x.iter().any(|v| !v.is_finite()));
                }
            }
        }

        #[test]
        fn wrong_lengths(n in 0usize..9000, seed in any::<u64>()) {
            wrong_lengths_are_errors(&Blockwise8Bit, n, seed);
        }

        #[test]
        fn garbage(payload in prop::collection::vec(any::<u8>(), 0..2000)) {
            garbage_never_panics(&Blockwise8Bit, &payload, true);
        }
    }
}
