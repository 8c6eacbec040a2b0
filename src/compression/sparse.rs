//! [`SparseTopK`]: per chunk of a part, the `k` values of largest magnitude, quantized to a few
//! bits against a power-of-two step, with their positions Rice- or bitmap-coded (whichever is
//! smaller). Made for error feedback ([`super::feedback`]): what a peer does not send stays in
//! its residual and goes out in a later round.
//!
//! # Payload
//!
//! Little-endian header, then one bit stream (least significant bit first), zero-padded to a
//! whole byte:
//!
//! | field | size | meaning |
//! |---|---|---|
//! | `value_bits` | 1 byte | 2..=8: quantized values; 32: raw f32 values (a reducer's reply) |
//! | `chunk_log2` | 1 byte | chunk size `C = 2^chunk_log2`, 6..=16 |
//! | `n` | 8 bytes | element count of the part (must equal the receiver's) |
//!
//! then for every chunk `c` (of `len_c = min(C, n − c·C)` elements), in the bit stream:
//!
//! * `count`: `bit_width(len_c)` bits, the number of entries, at most `len_c`;
//! * if `count > 0`: one mode bit. `0`: a 4-bit Rice parameter `m`, then `count` gaps
//!   `g_j = i_j − i_{j−1} − 1` (with `i_{−1} = −1`), each as `g >> m` in unary (ones, then a
//!   zero) and `g mod 2^m` in `m` bits. `1`: a bitmap of `len_c` bits whose population count
//!   must be `count`;
//! * quantized: a 9-bit exponent field `f`, step `2^(f − 149)` (`f ≤ 276`), then per entry a
//!   sign bit and `|q| − 1` in `value_bits − 1` bits: the value is `±|q| · step`,
//!   `1 ≤ |q| ≤ 2^(value_bits−1)`. Raw: per entry the f32's 32 bits.
//!
//! Positions are strictly increasing by construction (so never duplicated); a position past
//! the chunk, a bitmap with another population count, a truncated stream, bytes or set bits
//! after its end, a bad header, an exponent out of range and non-finite values are typed
//! [`CodecError`]s. Decoding writes only into the caller's buffer (zeros, then the entries):
//! no allocation, and the work is bounded by the payload's bits plus the buffer's length.
//!
//! # Encoding and its error bound
//!
//! Per chunk the encoder keeps the `k` values of largest magnitude (ties: lower position first),
//! takes the smallest power-of-two step `2^e` with `max_c ≤ L · 2^e` (`L = 2^(bits−1)`, `max_c`
//! the chunk's largest magnitude) and rounds each kept value to `q · 2^e`, `|q| ≤ L`; entries
//! that round to 0 are dropped (there is no zero code). Every kept value is then within
//! `2^(e−1) ≤ max_c / L` of its input (for `max_c` below 2^126; plus 2^−150 where the step
//! bottoms out at the smallest subnormal); every value not kept is off by itself. Error
//! feedback carries both errors to the next round.
//!
//! Because the step is a power of two and there is no zero code, decoding then encoding again
//! reproduces the decoded values exactly (the grid of the second encoding is the same or a
//! finer power of two, and every decoded value lies on it): an averager can compress its input
//! once, keep the residual, and the round's encoder sends exactly those values.
//!
//! A reducer answers with the average over the union of the positions it received, the same
//! bytes for every sender, never densified ([`SparseTopK::encode_reply`]): its non-zero values
//! either as raw f32 ([`encode_nonzeros_f32`], `reply_bits` 32) or quantized like a part, to
//! `reply_bits` bits on each chunk's power-of-two step with every value kept (those that round
//! to 0 dropped), in chunks of `2^REPLY_CHUNK_LOG2`. Every member, the reducer included,
//! applies the decoded reply, so every peer ends with the same values. A quantized reply's
//! values are within the bound above of the average (`max_c` now the average's largest
//! magnitude in the chunk); the reducer keeps that error in its own residual (see
//! [`super::feedback`]).

use std::sync::Mutex;

use super::elements::check_f32;
use super::{Codec, CodecError, CompressionType};
use crate::tensor::{DType, PartView};

/// Header bytes: value bits, chunk log2, element count.
pub const HEADER_BYTES: usize = 10;
/// `value_bits` of a payload with raw f32 values.
pub const RAW_F32_BITS: u8 = 32;
/// Smallest chunk, as log2.
pub const MIN_CHUNK_LOG2: u8 = 6;
/// Largest chunk, as log2.
pub const MAX_CHUNK_LOG2: u8 = 16;
/// Chunk (as log2) of a reducer's replies ([`SparseTopK::encode_reply`]).
pub const REPLY_CHUNK_LOG2: u8 = 11;
/// Bits per value of a reducer's reply unless configured otherwise
/// ([`SparseTopK::with_reply_bits`]).
pub const DEFAULT_REPLY_BITS: u8 = 8;
/// Bias of the 9-bit exponent field: step `2^(field − 149)`.
const EXP_BIAS: i32 = 149;
/// Largest valid exponent field (step 2^127).
const EXP_MAX_FIELD: u32 = 276;
/// Exponent field the encoder writes for a chunk with non-finite values (rejected by every
/// decoder, so the receiver treats the part as it treats any non-finite contribution).
const EXP_NON_FINITE: u32 = 511;

/// The sparse codec's parameters: chunk size, kept values per chunk, bits per kept value, and
/// bits per value of a reducer's reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SparseTopK {
    chunk_log2: u8,
    k: u32,
    bits: u8,
    reply_bits: u8,
}

/// Parameters a [`SparseTopK`] cannot have.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sparse top-k: {0}")]
pub struct SparseConfigError(String);

impl Default for SparseTopK {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl SparseTopK {
    /// 2 % density (41 of 2048 values per chunk), 2 bits per kept value, replies of
    /// [`DEFAULT_REPLY_BITS`].
    pub const DEFAULT: Self = Self {
        chunk_log2: 11,
        k: 41,
        bits: 2,
        reply_bits: DEFAULT_REPLY_BITS,
    };

    /// Parses `""` (the default), `":<density>:<bits>:<chunk>"` (replies of
    /// [`DEFAULT_REPLY_BITS`]) or `":<density>:<bits>:<chunk>:<reply_bits>"` (what follows
    /// `topk` in [`super::Compression`]'s string form).
    pub fn parse(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Ok(Self::DEFAULT);
        }
        let fields: Vec<&str> = s.strip_prefix(':').unwrap_or("").split(':').collect();
        let (density, bits, chunk, reply_bits) = match fields[..] {
            [density, bits, chunk] => (density, bits, chunk, None),
            [density, bits, chunk, reply_bits] => (density, bits, chunk, Some(reply_bits)),
            _ => {
                return Err(format!(
                    "expected topk:<density>:<bits>:<chunk>[:<reply_bits>], not topk{s}"
                ));
            }
        };
        let bad = |what: &str, v: &str| format!("topk {what} {v:?} is not a number");
        let density: f64 = density.parse().map_err(|_| bad("density", density))?;
        let bits: u8 = bits.parse().map_err(|_| bad("bits", bits))?;
        let chunk: usize = chunk.parse().map_err(|_| bad("chunk", chunk))?;
        let codec = Self::new(density, bits, chunk).map_err(|e| e.to_string())?;
        match reply_bits {
            None => Ok(codec),
            Some(r) => {
                let r: u8 = r.parse().map_err(|_| bad("reply bits", r))?;
                codec.with_reply_bits(r).map_err(|e| e.to_string())
            }
        }
    }

    /// The string form [`SparseTopK::parse`] reads back (after `topk`).
    pub fn spec(&self) -> String {
        format!(
            ":{}:{}:{}:{}",
            self.density(),
            self.bits,
            self.chunk(),
            self.reply_bits
        )
    }

    /// Keeps `round(density · chunk)` (at least 1) values per chunk of `chunk` (a power of two,
    /// 64..=65536) values, each quantized to `bits` (2..=8) bits; replies of
    /// [`DEFAULT_REPLY_BITS`].
    pub fn new(density: f64, bits: u8, chunk: usize) -> Result<Self, SparseConfigError> {
        if !(density > 0.0 && density <= 1.0) {
            return Err(SparseConfigError(format!(
                "density must be in (0, 1], not {density}"
            )));
        }
        if !(2..=8).contains(&bits) {
            return Err(SparseConfigError(format!("bits must be 2..=8, not {bits}")));
        }
        let log2 = chunk.trailing_zeros();
        if !chunk.is_power_of_two()
            || !(u32::from(MIN_CHUNK_LOG2)..=u32::from(MAX_CHUNK_LOG2)).contains(&log2)
        {
            return Err(SparseConfigError(format!(
                "chunk must be a power of two from 64 to 65536, not {chunk}"
            )));
        }
        let k = ((density * chunk as f64).round() as u32).clamp(1, chunk as u32);
        Ok(Self {
            chunk_log2: log2 as u8,
            k,
            bits,
            reply_bits: DEFAULT_REPLY_BITS,
        })
    }

    /// The same codec with reducers' replies of `reply_bits`: 2..=8 (quantized, see
    /// [`SparseTopK::encode_reply`]) or 32 (raw f32, exact).
    pub fn with_reply_bits(self, reply_bits: u8) -> Result<Self, SparseConfigError> {
        if !((2..=8).contains(&reply_bits) || reply_bits == RAW_F32_BITS) {
            return Err(SparseConfigError(format!(
                "reply bits must be 2..=8 or 32, not {reply_bits}"
            )));
        }
        Ok(Self { reply_bits, ..self })
    }

    /// Bits per value of a reducer's reply (32: raw f32).
    pub fn reply_bits(&self) -> u8 {
        self.reply_bits
    }

    /// Appends a reducer's reply: the non-zero values of `average` (the mean over the union of
    /// the positions it received) in chunks of `2^REPLY_CHUNK_LOG2`, as raw f32 (reply bits
    /// 32: exact) or quantized to the reply bits on each chunk's power-of-two step with every
    /// value kept, those that round to 0 dropped (each value within `max_c / 2^(bits−1)` of
    /// the average, as for a part; see the module docs).
    pub fn encode_reply(&self, average: &[f32], out: &mut Vec<u8>) {
        self.encode_reply_into(average, out, None);
    }

    /// Values per chunk.
    pub fn chunk(&self) -> usize {
        1 << self.chunk_log2
    }

    /// Values kept per full chunk.
    pub fn k(&self) -> usize {
        self.k as usize
    }

    /// Bits per kept value.
    pub fn bits(&self) -> u8 {
        self.bits
    }

    /// Kept values per value (`k / chunk`).
    pub fn density(&self) -> f64 {
        f64::from(self.k) / self.chunk() as f64
    }

    /// The shared instance with these parameters (one per distinct configuration in the
    /// process, kept for its lifetime: configurations come from local settings, never from
    /// the network).
    pub fn interned(self) -> &'static SparseTopK {
        static INTERNED: Mutex<Vec<&'static SparseTopK>> = Mutex::new(Vec::new());
        let mut all = INTERNED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = all.iter().find(|c| ***c == self) {
            return found;
        }
        let leaked: &'static SparseTopK = Box::leak(Box::new(self));
        all.push(leaked);
        leaked
    }

    /// Kept values of a chunk of `len` elements (the last chunk of a part may be shorter).
    fn k_for(&self, len: usize) -> usize {
        if len == self.chunk() {
            self.k()
        } else {
            // Proportional, rounded up: a short chunk is never starved.
            (self.k() * len).div_ceil(self.chunk()).min(len)
        }
    }

    /// `decode(encode(values))` into `out` (same length): what a receiver gets. Where the
    /// input is not finite, that chunk comes back as NaN.
    pub fn roundtrip(&self, values: &[f32], out: &mut [f32]) {
        let mut payload = Vec::new();
        self.encode_f32(values, &mut payload);
        if self.decode(&payload, DType::F32, out).is_err() {
            // Only a chunk with non-finite values fails; mark the whole part.
            out.fill(f32::NAN);
        }
    }

    /// Upper bound of the encoded size of `n` values, in bytes, when every chunk keeps `k`
    /// entries: the header, per chunk the count, the mode bit, the cheaper of a bitmap and a
    /// Rice code of its gaps (bounded here by the Rice parameter `⌊log2(C/k)⌋`: at most
    /// `k·(m + 1) + C/2^m` bits), the exponent and the values.
    pub fn max_encoded_len(&self, n: usize) -> usize {
        let c = self.chunk();
        let mut bits = 0usize;
        let mut start = 0;
        while start < n {
            let len = c.min(n - start);
            let k = self.k_for(len);
            let m = (len / k.max(1)).max(1).ilog2() as usize;
            let rice = 4 + k * (m + 1) + len.div_ceil(1 << m);
            bits += bit_width(len) as usize + 1 + rice.min(len) + 9 + k * usize::from(self.bits);
            start += len;
        }
        HEADER_BYTES + bits.div_ceil(8)
    }

    /// Encodes f32 values (see the module docs).
    pub fn encode_f32(&self, values: &[f32], out: &mut Vec<u8>) {
        self.encode_f32_decoded(values, out, None);
    }

    /// [`SparseTopK::encode_reply`], also writing into `decoded` (as long as `average`) what
    /// every receiver decodes from the reply, without decoding it: zeros, and the sent
    /// entries' values. Returns false where the reply does not decode (a non-finite value in
    /// `average`) or `decoded` has another length; `decoded` is then unspecified.
    pub fn encode_reply_decoded(
        &self,
        average: &[f32],
        out: &mut Vec<u8>,
        decoded: &mut [f32],
    ) -> bool {
        if average.len() != decoded.len() {
            // Nowhere to write what the decoder reads: the reply alone.
            self.encode_reply(average, out);
            return false;
        }
        self.encode_reply_into(average, out, Some(decoded))
    }

    /// The reply encoder behind [`SparseTopK::encode_reply`] and
    /// [`SparseTopK::encode_reply_decoded`] (`decoded`, if given, as long as `average`);
    /// returns whether the reply decodes.
    fn encode_reply_into(
        &self,
        average: &[f32],
        out: &mut Vec<u8>,
        decoded: Option<&mut [f32]>,
    ) -> bool {
        if self.reply_bits != RAW_F32_BITS {
            // A part's format with every value of a chunk kept.
            return Self {
                chunk_log2: REPLY_CHUNK_LOG2,
                k: 1 << REPLY_CHUNK_LOG2,
                bits: self.reply_bits,
                reply_bits: self.reply_bits,
            }
            .encode_f32_decoded(average, out, decoded);
        }
        encode_nonzeros_f32(average, REPLY_CHUNK_LOG2, out);
        let Some(decoded) = decoded else {
            return true;
        };
        for (d, v) in decoded.iter_mut().zip(average) {
            // The decoder writes zeros, then the non-zero values it reads.
            *d = if *v == 0.0 { 0.0 } else { *v };
        }
        average.iter().all(|v| v.is_finite())
    }

    /// Encodes f32 values; with `decoded`, also writes there what the decoder will read (see
    /// [`SparseTopK::encode_reply_decoded`]). Returns whether every chunk was finite.
    fn encode_f32_decoded(
        &self,
        values: &[f32],
        out: &mut Vec<u8>,
        mut decoded: Option<&mut [f32]>,
    ) -> bool {
        write_header(self.bits, self.chunk_log2, values.len(), out);
        let mut w = BitWriter::new(out);
        let mut order: Vec<u32> = Vec::new();
        let mut entries: Vec<(u32, u32)> = Vec::new();
        let levels = 1i64 << (self.bits - 1);
        let mut finite = true;
        for (c, chunk) in values.chunks(self.chunk()).enumerate() {
            let base = c * self.chunk();
            let mut dst = decoded
                .as_deref_mut()
                .map(|d| &mut d[base..base + chunk.len()]);
            if let Some(dst) = dst.as_deref_mut() {
                dst.fill(0.0);
            }
            let k = self.k_for(chunk.len());
            order.clear();
            order.extend(0..chunk.len() as u32);
            let by_magnitude = |a: &u32, b: &u32| {
                let (x, y) = (chunk[*a as usize].abs(), chunk[*b as usize].abs());
                // NaN ranks first: it reaches the exponent check below.
                y.total_cmp(&x).then(a.cmp(b))
            };
            if k < order.len() {
                order.select_nth_unstable_by(k - 1, by_magnitude);
                order.truncate(k);
            }
            order.sort_unstable();
            let max = order
                .iter()
                .map(|&i| chunk[i as usize].abs())
                .fold(0.0f32, |m, v| if v.is_nan() || v > m { v } else { m });
            entries.clear();
            let mut exp_field = 0;
            if !max.is_finite() {
                // Rejected by the decoder: the part counts as non-finite.
                exp_field = EXP_NON_FINITE;
                entries.push((order[0], 0));
                finite = false;
            } else if max > 0.0 {
                let e = step_exponent(f64::from(max), levels);
                exp_field = (e + EXP_BIAS) as u32;
                let step = pow2(e);
                // Keep |q|·step finite where the step is near f32's range.
                let limit = levels.min((f64::from(f32::MAX) / step) as i64).max(1);
                for &i in &order {
                    let q = (f64::from(chunk[i as usize]) / step).round() as i64;
                    let q = q.clamp(-limit, limit);
                    if q != 0 {
                        let sign = u32::from(q < 0);
                        let code = sign | (((q.unsigned_abs() - 1) as u32) << 1);
                        entries.push((i, code));
                        if let Some(dst) = dst.as_deref_mut() {
                            // The decoder's arithmetic: ±|q| · step, rounded to f32.
                            let x = (q as f64 * step) as f32;
                            finite &= x.is_finite();
                            dst[i as usize] = x;
                        }
                    }
                }
            }
            let len = chunk.len();
            w.put(entries.len() as u64, bit_width(len));
            if entries.is_empty() {
                continue;
            }
            write_positions(&mut w, entries.iter().map(|e| e.0), len);
            w.put(u64::from(exp_field), 9);
            for &(_, code) in &entries {
                w.put(u64::from(code), u32::from(self.bits));
            }
        }
        w.finish();
        finite
    }
}

/// Appends the encoding of `values`' non-zero entries as raw f32 (`value_bits` 32) in chunks
/// of `2^chunk_log2`: a reducer's reply, the average over the union of the positions it
/// received, exact and the same for every sender.
pub fn encode_nonzeros_f32(values: &[f32], chunk_log2: u8, out: &mut Vec<u8>) {
    let chunk_log2 = chunk_log2.clamp(MIN_CHUNK_LOG2, MAX_CHUNK_LOG2);
    write_header(RAW_F32_BITS, chunk_log2, values.len(), out);
    let mut w = BitWriter::new(out);
    for chunk in values.chunks(1 << chunk_log2) {
        let count = chunk.iter().filter(|v| **v != 0.0).count();
        w.put(count as u64, bit_width(chunk.len()));
        if count == 0 {
            continue;
        }
        let positions = (0..chunk.len() as u32).filter(|&i| chunk[i as usize] != 0.0);
        write_positions(&mut w, positions, chunk.len());
        for v in chunk.iter().filter(|v| **v != 0.0) {
            w.put(u64::from(v.to_bits()), 32);
        }
    }
    w.finish();
}

/// Number of bits needed to write `0..=n`.
fn bit_width(n: usize) -> u32 {
    usize::BITS - n.leading_zeros()
}

/// `2^e` (exact in f64), for `e` in `-149..=127`.
fn pow2(e: i32) -> f64 {
    debug_assert!((-EXP_BIAS..=127).contains(&e));
    (2.0f64).powi(e)
}

/// The smallest `e ≥ −149` with `max ≤ levels · 2^e` (`max` finite and positive).
fn step_exponent(max: f64, levels: i64) -> i32 {
    let levels = levels as f64;
    let mut e = ((max / levels).log2().ceil() as i32).clamp(-EXP_BIAS, 127);
    while e < 127 && levels * pow2(e) < max {
        e += 1;
    }
    while e > -EXP_BIAS && levels * pow2(e - 1) >= max {
        e -= 1;
    }
    e
}

fn write_header(bits: u8, chunk_log2: u8, n: usize, out: &mut Vec<u8>) {
    out.push(bits);
    out.push(chunk_log2);
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

/// Writes the mode bit and the positions (strictly increasing, below `len`) as the cheaper of
/// a Rice code of their gaps and a bitmap.
fn write_positions(
    w: &mut BitWriter<'_>,
    positions: impl Iterator<Item = u32> + Clone,
    len: usize,
) {
    let gaps = || {
        let mut prev: i64 = -1;
        positions.clone().map(move |i| {
            let g = (i64::from(i) - prev - 1) as u64;
            prev = i64::from(i);
            g
        })
    };
    let (m, rice_bits) = (0..16u32)
        .map(|m| {
            let bits: u64 = gaps().map(|g| (g >> m) + 1 + u64::from(m)).sum();
            (m, bits + 4)
        })
        .min_by_key(|&(_, bits)| bits)
        .expect("16 candidates");
    if rice_bits <= len as u64 {
        w.put(0, 1);
        w.put(u64::from(m), 4);
        for g in gaps() {
            let mut ones = g >> m;
            while ones > 0 {
                let run = ones.min(32);
                w.put((1u64 << run) - 1, run as u32);
                ones -= run;
            }
            w.put(0, 1);
            w.put(g & ((1 << m) - 1), m);
        }
    } else {
        w.put(1, 1);
        let mut next = positions.peekable();
        let mut word = 0u64;
        let mut filled = 0u32;
        for i in 0..len as u32 {
            if next.peek() == Some(&i) {
                next.next();
                word |= 1 << filled;
            }
            filled += 1;
            if filled == 32 {
                w.put(word, 32);
                word = 0;
                filled = 0;
            }
        }
        if filled > 0 {
            w.put(word, filled);
        }
    }
}

/// Appends bits, least significant first.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    filled: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        Self {
            out,
            acc: 0,
            filled: 0,
        }
    }

    /// Writes the low `n` (≤ 32) bits of `v`.
    fn put(&mut self, v: u64, n: u32) {
        debug_assert!(n <= 32);
        if n == 0 {
            return;
        }
        self.acc |= (v & ((1u64 << n) - 1)) << self.filled;
        self.filled += n;
        while self.filled >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.filled -= 8;
        }
    }

    fn finish(self) {
        if self.filled > 0 {
            self.out.push(self.acc as u8);
        }
    }
}

/// Reads bits, least significant first; running past the end is an error.
struct BitReader<'a> {
    data: &'a [u8],
    pos: usize,
}

/// The stream ended early.
struct Truncated;

impl<'a> BitReader<'a> {
    fn get(&mut self, n: u32) -> Result<u64, Truncated> {
        debug_assert!(n <= 32);
        if self.pos + n as usize > self.data.len() * 8 {
            return Err(Truncated);
        }
        let mut v = 0u64;
        let mut done = 0u32;
        while done < n {
            let byte = self.data[self.pos / 8];
            let offset = (self.pos % 8) as u32;
            let take = (8 - offset).min(n - done);
            let bits = (u64::from(byte) >> offset) & ((1 << take) - 1);
            v |= bits << done;
            done += take;
            self.pos += take as usize;
        }
        Ok(v)
    }

    /// Whether everything after the position is zero padding within the last byte.
    fn only_padding_left(&self) -> bool {
        let used = self.pos.div_ceil(8);
        used == self.data.len()
            && (self.pos.is_multiple_of(8) || self.data[used - 1] >> (self.pos % 8) == 0)
    }
}

impl Codec for SparseTopK {
    fn kind(&self) -> CompressionType {
        CompressionType::SparseTopK
    }

    fn sparse(&self) -> Option<&SparseTopK> {
        Some(self)
    }

    /// As if the values went as raw f32, on purpose: parts are sized as for raw f32 values
    /// (128K elements at the default 512 KiB) whatever the density and the input dtype, so
    /// that spans stay balanced over small models and an averager can cut its parts before
    /// the round (error feedback) exactly as the round will.
    fn compression_ratio(&self, dtype: DType) -> f64 {
        4.0 / dtype.size_bytes() as f64
    }

    fn encode(&self, values: PartView<'_>, out: &mut Vec<u8>) {
        match values {
            PartView::F32(v) => self.encode_f32(v, out),
            other => {
                let mut v = vec![0.0f32; other.len()];
                other.copy_to_f32(&mut v);
                self.encode_f32(&v, out);
            }
        }
    }

    fn decode(&self, payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError> {
        decode_sparse(payload, dtype, out)
    }
}

fn header_error(detail: impl Into<String>) -> CodecError {
    CodecError::Header {
        codec: CompressionType::SparseTopK,
        detail: detail.into(),
    }
}

fn truncated(payload: &[u8], elements: usize) -> CodecError {
    CodecError::Length {
        codec: CompressionType::SparseTopK,
        expected: payload.len() + 1,
        actual: payload.len(),
        elements,
    }
}

/// Decodes any [`SparseTopK`] payload (quantized or raw f32) into exactly `out.len()` values.
pub fn decode_sparse(payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError> {
    let codec = CompressionType::SparseTopK;
    check_f32(codec, dtype)?;
    let n = out.len();
    if payload.len() < HEADER_BYTES {
        return Err(truncated(payload, n));
    }
    let value_bits = payload[0];
    let chunk_log2 = payload[1];
    if !((2..=8).contains(&value_bits) || value_bits == RAW_F32_BITS) {
        return Err(header_error(format!("value bits {value_bits}")));
    }
    if !(MIN_CHUNK_LOG2..=MAX_CHUNK_LOG2).contains(&chunk_log2) {
        return Err(header_error(format!("chunk log2 {chunk_log2}")));
    }
    let declared = u64::from_le_bytes(payload[2..10].try_into().expect("8 bytes"));
    if declared != n as u64 {
        return Err(CodecError::Length {
            codec,
            expected: n,
            actual: usize::try_from(declared).unwrap_or(usize::MAX),
            elements: n,
        });
    }
    out.fill(0.0);
    let mut r = BitReader {
        data: &payload[HEADER_BYTES..],
        pos: 0,
    };
    for dst in out.chunks_mut(1usize << chunk_log2) {
        decode_chunk(&mut r, value_bits, dst).map_err(|e| match e {
            ChunkError::Truncated => truncated(payload, n),
            ChunkError::Codec(e) => e,
        })?;
    }
    if !r.only_padding_left() {
        return Err(CodecError::Length {
            codec,
            expected: HEADER_BYTES + r.pos.div_ceil(8),
            actual: payload.len(),
            elements: n,
        });
    }
    Ok(())
}

enum ChunkError {
    Truncated,
    Codec(CodecError),
}

impl From<Truncated> for ChunkError {
    fn from(_: Truncated) -> Self {
        ChunkError::Truncated
    }
}

/// Decodes one chunk into `dst` (zeroed): positions are written first as markers (the
/// entries' order), then the values in the same order.
fn decode_chunk(r: &mut BitReader<'_>, value_bits: u8, dst: &mut [f32]) -> Result<(), ChunkError> {
    let len = dst.len();
    let count = r.get(bit_width(len))? as usize;
    if count == 0 {
        return Ok(());
    }
    if count > len {
        return Err(ChunkError::Codec(header_error(format!(
            "{count} entries in a chunk of {len}"
        ))));
    }
    // The positions come before the values: they are marked in `dst` (zeroed) first, and the
    // values then fill the marks in order, each mark looked at once before it is written (so
    // a value with the mark's bits, the smallest negative subnormal, is harmless).
    const MARK: f32 = f32::from_bits(0x8000_0001);
    let bitmap = r.get(1)? == 1;
    if bitmap {
        let mut seen = 0usize;
        let mut i = 0usize;
        while i < len {
            let take = (len - i).min(32);
            let word = r.get(take as u32)?;
            let mut bits = word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                dst[i + b] = MARK;
                bits &= bits - 1;
                seen += 1;
            }
            i += take;
        }
        if seen != count {
            return Err(ChunkError::Codec(header_error(format!(
                "bitmap of {seen} positions, count {count}"
            ))));
        }
    } else {
        let m = r.get(4)? as u32;
        let mut next = 0usize; // smallest position the next entry may have
        for _ in 0..count {
            let mut high = 0usize;
            while r.get(1)? == 1 {
                high += 1;
                if (high << m) >= len {
                    return Err(ChunkError::Codec(header_error("position past the chunk")));
                }
            }
            let gap = (high << m) | r.get(m)? as usize;
            let i = next + gap;
            if i >= len {
                return Err(ChunkError::Codec(header_error("position past the chunk")));
            }
            dst[i] = MARK;
            next = i + 1;
        }
    }
    if value_bits == RAW_F32_BITS {
        for v in dst.iter_mut().filter(|v| v.to_bits() == MARK.to_bits()) {
            let x = f32::from_bits(r.get(32)? as u32);
            if !x.is_finite() {
                return Err(ChunkError::Codec(CodecError::NonFinite {
                    codec: CompressionType::SparseTopK,
                }));
            }
            *v = x;
        }
    } else {
        let field = r.get(9)? as u32;
        if field > EXP_MAX_FIELD {
            return Err(ChunkError::Codec(header_error(format!(
                "exponent field {field}"
            ))));
        }
        let step = pow2(field as i32 - EXP_BIAS);
        for v in dst.iter_mut().filter(|v| v.to_bits() == MARK.to_bits()) {
            let code = r.get(u32::from(value_bits))?;
            let magnitude = ((code >> 1) + 1) as f64;
            let signed = if code & 1 == 1 { -magnitude } else { magnitude };
            let x = (signed * step) as f32;
            if !x.is_finite() {
                return Err(ChunkError::Codec(CodecError::NonFinite {
                    codec: CompressionType::SparseTopK,
                }));
            }
            *v = x;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::elements::testing::{garbage_never_panics, randn};
    use super::*;
    use proptest::prelude::*;

    fn encode(c: &SparseTopK, x: &[f32]) -> Vec<u8> {
        let mut p = Vec::new();
        c.encode_f32(x, &mut p);
        p
    }

    fn decode(p: &[u8], n: usize) -> Result<Vec<f32>, CodecError> {
        let mut out = vec![f32::NAN; n];
        decode_sparse(p, DType::F32, &mut out).map(|()| out)
    }

    /// The stated bounds, chunk by chunk: at most `k` entries; every entry within
    /// `max_c / 2^(bits−1)` (or 2^−150) of its input; every element not sent either small
    /// (rounded to zero) or outside the top k.
    fn check_bounds(c: &SparseTopK, x: &[f32], y: &[f32]) -> Result<(), TestCaseError> {
        for (xs, ys) in x.chunks(c.chunk()).zip(y.chunks(c.chunk())) {
            let max = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let bound = (f64::from(max) / f64::from(1u32 << (c.bits() - 1))).max(2f64.powi(-150));
            let sent = ys.iter().filter(|v| **v != 0.0).count();
            let mut sorted: Vec<f32> = xs.iter().map(|v| v.abs()).collect();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            let kth = sorted[c.k_for(xs.len()) - 1];
            prop_assert!(
                sent <= c.k_for(xs.len()),
                "{sent} entries, k {}",
                c.k_for(xs.len())
            );
            for (i, (&xi, &yi)) in xs.iter().zip(ys).enumerate() {
                let err = (f64::from(xi) - f64::from(yi)).abs();
                if yi != 0.0 || err <= bound {
                    prop_assert!(
                        err <= bound * (1.0 + 1e-9),
                        "value {xi} -> {yi}, bound {bound}"
                    );
                } else {
                    // Not sent and not small: at least k others are as large.
                    prop_assert!(xi.abs() <= kth, "{xi} (at {i}) dropped from the top k");
                }
            }
        }
        Ok(())
    }

    fn config() -> impl Strategy<Value = SparseTopK> {
        (0.001f64..1.0, 2u8..=8, 6u32..=12)
            .prop_map(|(d, b, log2)| SparseTopK::new(d, b, 1 << log2).unwrap())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Round trip within the stated bound, idempotent (encoding the decoded values again
        /// gives them back bit for bit), and within the size formula.
        #[test]
        fn round_trip_bound_idempotence_and_size(
            c in config(),
            n in 0usize..9000,
            scale in -30i32..30,
            seed in any::<u64>(),
        ) {
            let x: Vec<f32> = randn(n, seed).iter().map(|v| v * 2f32.powi(scale)).collect();
            let p = encode(&c, &x);
            prop_assert!(p.len() <= c.max_encoded_len(n), "{} > {}", p.len(), c.max_encoded_len(n));
            let y = decode(&p, n).unwrap();
            check_bounds(&c, &x, &y)?;
            let mut again = vec![0.0; n];
            c.roundtrip(&y, &mut again);
            prop_assert_eq!(
                again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            // The reply format carries the non-zero values exactly.
            let mut reply = Vec::new();
            encode_nonzeros_f32(&y, REPLY_CHUNK_LOG2, &mut reply);
            let mut raw = Vec::new();
            c.with_reply_bits(RAW_F32_BITS).unwrap().encode_reply(&y, &mut raw);
            prop_assert_eq!(&raw, &reply);
            prop_assert_eq!(decode(&reply, n).unwrap(), y);
        }

        /// A quantized reply of any values (an average: dense or sparse) keeps every value
        /// within `max_c / 2^(reply_bits−1)` per chunk of 2048 (or 2^−150), sends no more
        /// entries than the non-zero values, and the decoder reads it like a part.
        #[test]
        fn quantized_replies_are_within_the_bound(
            reply_bits in 2u8..=8,
            n in 0usize..9000,
            scale in -30i32..30,
            sparsity in 0u32..4,
            seed in any::<u64>(),
        ) {
            let mut x: Vec<f32> = randn(n, seed).iter().map(|v| v * 2f32.powi(scale)).collect();
            // Keep about 1 in 2^sparsity values (an average over a union of positions).
            for (i, v) in x.iter_mut().enumerate() {
                if (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(seed) >> 61
                    >= 8 >> sparsity
                {
                    *v = 0.0;
                }
            }
            let c = SparseTopK::DEFAULT.with_reply_bits(reply_bits).unwrap();
            let mut reply = Vec::new();
            c.encode_reply(&x, &mut reply);
            prop_assert_eq!(reply[0], reply_bits);
            prop_assert_eq!(reply[1], REPLY_CHUNK_LOG2);
            let y = decode(&reply, n).unwrap();
            // As a part of a codec that keeps every value of its chunks.
            let every = SparseTopK {
                chunk_log2: REPLY_CHUNK_LOG2,
                k: 1 << REPLY_CHUNK_LOG2,
                bits: reply_bits,
                reply_bits,
            };
            check_bounds(&every, &x, &y)?;
            let nonzero = |v: &[f32]| v.iter().filter(|v| **v != 0.0).count();
            prop_assert!(nonzero(&y) <= nonzero(&x));
            prop_assert!(reply.len() <= every.max_encoded_len(n));
        }

        /// `encode_reply_decoded` writes the same bytes as `encode_reply` and, beside them,
        /// exactly what the decoder reads from them (bit for bit), for every reply width and
        /// for values at the edges of f32's range; a non-finite value: false, as the decoder
        /// refuses the reply.
        #[test]
        fn fused_replies_are_what_the_decoder_reads(
            reply_bits in prop::sample::select(vec![2u8, 3, 4, 8, RAW_F32_BITS]),
            n in 0usize..9000,
            scale in prop::sample::select(vec![-140i32, -60, -10, 0, 10, 60, 120]),
            sparsity in 0u32..4,
            poison in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut x: Vec<f32> = randn(n, seed).iter().map(|v| v * 2f32.powi(scale)).collect();
            for (i, v) in x.iter_mut().enumerate() {
                if (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(seed) >> 61
                    >= 8 >> sparsity
                {
                    *v = if i % 2 == 0 { 0.0 } else { -0.0 };
                }
            }
            if poison && n > 0 {
                x[(seed % n as u64) as usize] = f32::NAN;
            }
            let c = SparseTopK::DEFAULT.with_reply_bits(reply_bits).unwrap();
            let (mut plain, mut fused) = (Vec::new(), Vec::new());
            c.encode_reply(&x, &mut plain);
            let mut decoded = vec![f32::NAN; n];
            let ok = c.encode_reply_decoded(&x, &mut fused, &mut decoded);
            prop_assert_eq!(&fused, &plain);
            match decode(&plain, n) {
                Ok(y) => {
                    prop_assert!(ok);
                    prop_assert_eq!(
                        decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                }
                Err(_) => prop_assert!(!ok),
            }
        }

        /// Any change of a valid payload decodes to finite values or fails with a typed error;
        /// any truncation of a valid payload fails. (Not: any truncation of a *changed* one. A
        /// change can shorten what the header declares, and the prefix of that length is then
        /// a valid payload: found by this test.)
        #[test]
        fn corrupted_payloads_fail_cleanly(
            c in config(),
            n in 1usize..3000,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
            cut in any::<usize>(),
        ) {
            let valid = encode(&c, &randn(n, n as u64));
            let mut p = valid.clone();
            for (at, bits) in flips {
                let i = at % p.len();
                p[i] ^= bits;
            }
            if let Ok(y) = decode(&p, n) {
                prop_assert!(y.iter().all(|v| v.is_finite()));
            }
            let cut = cut % p.len();
            if let Ok(y) = decode(&p[..cut], n) {
                prop_assert!(y.iter().all(|v| v.is_finite()));
            }
            prop_assert!(decode(&valid[..cut], n).is_err());
        }
    }

    #[test]
    fn a_chunk_keeps_its_largest_values() {
        let c = SparseTopK::new(4.0 / 64.0, 4, 64).unwrap();
        let mut x = vec![0.01f32; 64];
        x[3] = -8.0;
        x[10] = 5.0;
        x[40] = 2.0;
        x[63] = -1.0;
        let y = decode(&encode(&c, &x), 64).unwrap();
        let mut want = vec![0.0f32; 64];
        // step 1 (8 = 8 levels · 1): each kept value is exact.
        want[3] = -8.0;
        want[10] = 5.0;
        want[40] = 2.0;
        want[63] = -1.0;
        assert_eq!(y, want);
        // 2 bits: step 4 (8 ≤ 2 · 4); 5 → 4, 2 → 4 (ties away from zero), -1 rounds to 0.
        let c2 = SparseTopK::new(4.0 / 64.0, 2, 64).unwrap();
        let y = decode(&encode(&c2, &x), 64).unwrap();
        want[10] = 4.0;
        want[40] = 4.0;
        want[63] = 0.0;
        assert_eq!(y, want);
        // All zeros: no entries, only the counts.
        let zeros = encode(&c, &[0.0; 200]);
        assert_eq!(zeros.len(), HEADER_BYTES + (7 * 3 + 4usize).div_ceil(8));
        assert_eq!(decode(&zeros, 200).unwrap(), vec![0.0; 200]);
        assert_eq!(decode(&encode(&c, &[]), 0).unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn dense_chunks_use_the_bitmap() {
        // Every value kept: a bitmap (64 bits) is cheaper than gaps of 0 (≥ 1 bit each + 4).
        let c = SparseTopK::new(1.0, 8, 64).unwrap();
        let x: Vec<f32> = (1..=64).map(|i| i as f32).collect();
        let p = encode(&c, &x);
        assert_eq!(
            p.len(),
            HEADER_BYTES + (7 + 1 + 64 + 9 + 64 * 8usize).div_ceil(8)
        );
        assert_eq!(decode(&p, 64).unwrap(), x);
    }

    #[test]
    fn hostile_payloads_are_typed_errors() {
        let c = SparseTopK::DEFAULT;
        let x = randn(5000, 3);
        let p = encode(&c, &x);
        decode(&p, 5000).unwrap();
        // Wrong element count, trailing bytes, every truncation.
        assert!(matches!(decode(&p, 4999), Err(CodecError::Length { .. })));
        assert!(matches!(decode(&p, 5001), Err(CodecError::Length { .. })));
        let mut longer = p.clone();
        longer.push(0);
        assert!(matches!(
            decode(&longer, 5000),
            Err(CodecError::Length { .. })
        ));
        for cut in 0..p.len() {
            assert!(decode(&p[..cut], 5000).is_err(), "cut at {cut}");
        }
        // Bad header fields and a declared dtype other than f32.
        for (at, v) in [(0, 1u8), (0, 9), (0, 31), (1, 5), (1, 17)] {
            let mut bad = p.clone();
            bad[at] = v;
            assert!(
                matches!(decode(&bad, 5000), Err(CodecError::Header { .. })),
                "{at}={v}"
            );
        }
        let mut out = vec![0.0; 5000];
        assert!(matches!(
            decode_sparse(&p, DType::F16, &mut out),
            Err(CodecError::DType { .. })
        ));
        // Hand-made chunks: one chunk of 64 (count width 7 bits).
        let chunk = |bits: &[(u64, u32)]| {
            let mut out = Vec::new();
            write_header(4, 6, 64, &mut out);
            let mut w = BitWriter::new(&mut out);
            for &(v, n) in bits {
                w.put(v, n);
            }
            w.finish();
            out
        };
        // Two entries; Rice m = 5: gaps 10 and 60 (position 71: past the chunk).
        let past = chunk(&[
            (2, 7),
            (0, 1),
            (5, 4),
            (0, 1),
            (10, 5),
            (1, 1),
            (0, 1),
            (28, 5),
        ]);
        assert!(matches!(decode(&past, 64), Err(CodecError::Header { .. })));
        // A count larger than the chunk.
        assert!(matches!(
            decode(&chunk(&[(65, 7)]), 64),
            Err(CodecError::Header { .. })
        ));
        // A bitmap with 3 positions under a count of 2.
        let bitmap = chunk(&[(2, 7), (1, 1), (0b111, 32), (0, 32), (150, 9), (0, 8)]);
        assert!(matches!(
            decode(&bitmap, 64),
            Err(CodecError::Header { .. })
        ));
        // An exponent field out of range, and a step that overflows f32 with |q| = 8.
        let ok = chunk(&[(1, 7), (1, 1), (1, 32), (0, 32), (150, 9), (0, 4)]);
        assert_eq!(decode(&ok, 64).unwrap()[0], 2.0);
        let exp = chunk(&[(1, 7), (1, 1), (1, 32), (0, 32), (300, 9), (0, 4)]);
        assert!(matches!(decode(&exp, 64), Err(CodecError::Header { .. })));
        let huge = chunk(&[(1, 7), (1, 1), (1, 32), (0, 32), (276, 9), (14, 4)]);
        assert!(matches!(
            decode(&huge, 64),
            Err(CodecError::NonFinite { .. })
        ));
        // Set padding bits after the stream.
        let mut padded = ok.clone();
        *padded.last_mut().unwrap() |= 0x80;
        assert!(matches!(
            decode(&padded, 64),
            Err(CodecError::Length { .. })
        ));
        // Raw f32 values must be finite.
        let raw = |v: f32| {
            let mut out = Vec::new();
            write_header(RAW_F32_BITS, 6, 64, &mut out);
            let mut w = BitWriter::new(&mut out);
            for (v, n) in [
                (1, 7),
                (1, 1),
                (1 << 5, 32),
                (0, 32),
                (u64::from(v.to_bits()), 32),
            ] {
                w.put(v, n);
            }
            w.finish();
            out
        };
        assert_eq!(decode(&raw(-2.5), 64).unwrap()[5], -2.5);
        for bad in [f32::NAN, f32::INFINITY] {
            assert!(matches!(
                decode(&raw(bad), 64),
                Err(CodecError::NonFinite { .. })
            ));
        }
        garbage_never_panics(&c, &p, true);
        garbage_never_panics(
            &c,
            &[11, 6, 3, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0x0F],
            true,
        );
    }

    #[test]
    fn non_finite_inputs_are_refused_by_the_receiver() {
        let c = SparseTopK::new(0.1, 3, 64).unwrap();
        let mut x = randn(300, 1);
        x[70] = f32::NAN;
        let p = encode(&c, &x);
        assert!(decode(&p, 300).is_err());
        let mut y = vec![0.0; 300];
        c.roundtrip(&x, &mut y);
        assert!(y.iter().all(|v| v.is_nan()));
        x[70] = f32::INFINITY;
        assert!(decode(&encode(&c, &x), 300).is_err());
    }

    #[test]
    fn parameters_and_their_string_form() {
        let c = SparseTopK::new(0.02, 2, 2048).unwrap();
        assert_eq!(c, SparseTopK::DEFAULT);
        assert_eq!(c.reply_bits(), DEFAULT_REPLY_BITS);
        assert_eq!(SparseTopK::parse(&c.spec()).unwrap(), c);
        assert_eq!(SparseTopK::parse("").unwrap(), c);
        assert_eq!(SparseTopK::parse(":0.02:2:2048").unwrap(), c);
        let raw = SparseTopK::parse(":0.02:2:2048:32").unwrap();
        assert_eq!(raw, c.with_reply_bits(32).unwrap());
        assert_eq!(raw.reply_bits(), RAW_F32_BITS);
        assert_eq!(SparseTopK::parse(&raw.spec()).unwrap(), raw);
        assert_eq!(SparseTopK::parse(":0.02:2:2048:4").unwrap().reply_bits(), 4);
        for bad in [0u8, 1, 9, 16, 31, 33] {
            assert!(c.with_reply_bits(bad).is_err(), "{bad}");
        }
        let c3 = SparseTopK::parse(":0.01:3:1024").unwrap();
        assert_eq!((c3.k(), c3.bits(), c3.chunk()), (10, 3, 1024));
        assert!(std::ptr::eq(c3.interned(), c3.interned()));
        for bad in [
            ":0:2:2048",
            ":0.5:1:2048",
            ":0.5:9:2048",
            ":0.5:2:1000",
            ":0.5:2:32",
            ":x:2:64",
            ":0.1:2",
            ":0.1:2:64:1",
            ":0.1:2:64:9",
            ":0.1:2:64:x",
            ":0.1:2:64:8:8",
        ] {
            assert!(SparseTopK::parse(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            "topk:0.03:4:4096".parse::<super::super::Compression>(),
            Ok(super::super::Compression::Sparse(_))
        ));
    }
}
