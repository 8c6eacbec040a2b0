//! Compression codecs for tensor parts.
//!
//! Every part on the wire says which codec encoded it ([`CompressionType`]) and the dtype of the
//! encoded values, so a receiver can decode any mix of schemes. Decoding always produces f32 (the
//! reducer accumulates in f32) into a caller-provided buffer whose length is the number of
//! elements the receiver expects from its partition: a payload that does not decode to exactly
//! that many elements is a [`CodecError`], never a panic or an unbounded allocation.
//!
//! | codec | payload | error bound |
//! |---|---|---|
//! | [`CompressionType::None`] | raw little-endian elements of the part's dtype | exact |
//! | [`CompressionType::Float16`] | f16 values (clamped to ±65504) | relative 2^-11 |
//! | [`CompressionType::BFloat16`] | bf16 values | relative 2^-8 |
//! | [`CompressionType::Uniform8Bit`] | f32 codebook\[256\] + u8 index per value, bins of 6σ/256 around the mean | MSE < 8e-4 for N(0,1) |
//! | [`CompressionType::Quantile8Bit`] | f32 codebook\[256\] + u8 index per value, bins at quantiles | MSE < 8e-4 for N(0,1) (2^20 values) |
//! | [`CompressionType::Blockwise8Bit`] | per block of 4096: f32 absmax, dynamic signed codebook, u8 index | MSE < 8e-4 for N(0,1) |
//! | [`CompressionType::SparseTopK`] | per chunk: top-k positions (Rice or bitmap), power-of-two step, 2-8 bit values | kept values within `max_chunk / 2^(bits−1)`; the rest dropped (error feedback carries them); a reducer's reply: every value of the average within `max_chunk / 2^(reply_bits−1)` (quantized, the reducer's residual carries the error) or exact (32 bits) |
//!
//! Each codec type documents its exact layout, the checks its decoder makes, and the bounds it
//! states and tests. The lossy codecs take any input dtype, declare [`DType::F32`] on the wire
//! and reject any other declaration; [`NoCompression`] declares and accepts the part's own dtype.
//!
//! [`Compression`] is the user-facing choice, including an adaptive choice by tensor size.

mod blockwise;
mod elements;
pub mod feedback;
mod float16;
mod none;
mod quantize;
pub mod sparse;

use crate::tensor::{DType, PartView};

pub(crate) use blockwise::BLOCK as BLOCKWISE_BLOCK;
pub use blockwise::Blockwise8Bit;
pub use float16::{BFloat16Codec, Float16Codec};
pub use none::NoCompression;
pub use quantize::{Quantile8Bit, Uniform8Bit};
pub use sparse::SparseTopK;

/// Wire identifier of a codec (values follow hivemind's `CompressionType` where one exists).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompressionType {
    /// Raw elements.
    None = 0,
    /// IEEE half precision.
    Float16 = 2,
    /// Quantile-binned 8-bit.
    Quantile8Bit = 3,
    /// Uniform 8-bit around the mean.
    Uniform8Bit = 4,
    /// Blockwise dynamic 8-bit.
    Blockwise8Bit = 5,
    /// bfloat16.
    BFloat16 = 6,
    /// Sparse top-k per chunk, quantized ([`SparseTopK`]; no hivemind counterpart).
    SparseTopK = 7,
}

impl CompressionType {
    /// Every codec.
    pub const ALL: [Self; 7] = [
        Self::None,
        Self::Float16,
        Self::BFloat16,
        Self::Uniform8Bit,
        Self::Quantile8Bit,
        Self::Blockwise8Bit,
        Self::SparseTopK,
    ];

    /// Parses the wire value.
    pub fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::None,
            2 => Self::Float16,
            3 => Self::Quantile8Bit,
            4 => Self::Uniform8Bit,
            5 => Self::Blockwise8Bit,
            6 => Self::BFloat16,
            7 => Self::SparseTopK,
            _ => return None,
        })
    }

    /// The wire value.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The shared codec instance for this type (for [`CompressionType::SparseTopK`], the
    /// default parameters: any instance decodes any of its payloads).
    pub fn codec(self) -> &'static dyn Codec {
        static SPARSE_DEFAULT: SparseTopK = SparseTopK::DEFAULT;
        match self {
            Self::None => &NoCompression,
            Self::Float16 => &Float16Codec,
            Self::BFloat16 => &BFloat16Codec,
            Self::Uniform8Bit => &Uniform8Bit,
            Self::Quantile8Bit => &Quantile8Bit,
            Self::Blockwise8Bit => &Blockwise8Bit,
            Self::SparseTopK => &SPARSE_DEFAULT,
        }
    }
}

/// A malformed, truncated or inconsistent payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The payload is shorter or longer than the expected element count requires.
    #[error("{codec:?} payload of {actual} bytes, expected {expected} for {elements} elements")]
    Length {
        /// Codec that rejected it.
        codec: CompressionType,
        /// Bytes the payload should have.
        expected: usize,
        /// Bytes it has.
        actual: usize,
        /// Elements the receiver expects.
        elements: usize,
    },
    /// A header field is out of range (e.g. a codebook length other than 256).
    #[error("{codec:?} payload has a bad header: {detail}")]
    Header {
        /// Codec that rejected it.
        codec: CompressionType,
        /// What is wrong.
        detail: String,
    },
    /// The payload decodes to non-finite values (NaN or infinity in a codebook or scale).
    #[error("{codec:?} payload carries non-finite values")]
    NonFinite {
        /// Codec that rejected it.
        codec: CompressionType,
    },
    /// The declared dtype cannot be carried by this codec.
    #[error("{codec:?} cannot carry dtype {dtype}")]
    DType {
        /// Codec that rejected it.
        codec: CompressionType,
        /// The declared dtype.
        dtype: DType,
    },
}

/// One compression scheme.
///
/// `encode` appends to a reusable buffer; `decode` writes into a caller-sized buffer, so neither
/// allocates per part on the hot path (beyond growing `out` once).
pub trait Codec: Send + Sync + std::fmt::Debug {
    /// The wire identifier.
    fn kind(&self) -> CompressionType;

    /// Estimated encoded bytes per input byte for values of `dtype` (used only to size parts,
    /// as hivemind's `estimate_compression_ratio`).
    fn compression_ratio(&self, dtype: DType) -> f64;

    /// The dtype the payload declares when encoding `input_dtype` (for [`NoCompression`] the
    /// input dtype itself; the lossy codecs decode to f32 whatever they were given).
    fn wire_dtype(&self, input_dtype: DType) -> DType {
        let _ = input_dtype;
        DType::F32
    }

    /// Appends the encoding of `values` to `out`.
    fn encode(&self, values: PartView<'_>, out: &mut Vec<u8>);

    /// Decodes `payload`, which declares `dtype` (see [`Codec::wire_dtype`]), into exactly
    /// `out.len()` f32 values.
    fn decode(&self, payload: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CodecError>;

    /// The sparse codec's parameters, for [`CompressionType::SparseTopK`] (a reducer encodes
    /// its replies with them); `None` for the others.
    fn sparse(&self) -> Option<&SparseTopK> {
        None
    }
}

/// Which codec to use for the parts of a tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Compression {
    /// One codec for every tensor.
    Fixed(CompressionType),
    /// Tensors with fewer than `threshold` elements use `below`, the rest `at_or_above`
    /// (hivemind's `SizeAdaptiveCompression`: decided by the full tensor's size).
    Adaptive {
        /// Element count at which `at_or_above` takes over.
        threshold: usize,
        /// Codec for small tensors.
        below: CompressionType,
        /// Codec for large tensors.
        at_or_above: CompressionType,
    },
    /// Sparse top-k with these parameters for every tensor. An averager keeps an error
    /// feedback residual with it ([`feedback`]); replies carry the exact average over the
    /// union of the positions the reducer received.
    Sparse(SparseTopK),
}

impl Default for Compression {
    /// No compression.
    fn default() -> Self {
        Self::Fixed(CompressionType::None)
    }
}

impl Compression {
    /// The default adaptive scheme: tensors under 65536 elements travel as float16 (precision
    /// matters more than bytes there), larger ones blockwise 8-bit.
    pub const ADAPTIVE_DEFAULT: Self = Self::Adaptive {
        threshold: 1 << 16,
        below: CompressionType::Float16,
        at_or_above: CompressionType::Blockwise8Bit,
    };

    /// The codec for a tensor of `numel` elements.
    pub fn codec_for(&self, numel: usize) -> &'static dyn Codec {
        match *self {
            Self::Fixed(kind) => kind.codec(),
            Self::Adaptive {
                threshold,
                below,
                at_or_above,
            } => {
                if numel < threshold {
                    below.codec()
                } else {
                    at_or_above.codec()
                }
            }
            Self::Sparse(params) => params.interned(),
        }
    }
}

impl Compression {
    /// The sparse codec's parameters when this choice sends sparse parts (an averager then
    /// keeps error feedback residuals); an error where sparse and dense codecs are mixed by
    /// size (error feedback covers every tensor or none).
    pub fn error_feedback(&self) -> Result<Option<SparseTopK>, String> {
        match *self {
            Self::Sparse(params) => Ok(Some(params)),
            Self::Fixed(CompressionType::SparseTopK) => Ok(Some(SparseTopK::DEFAULT)),
            Self::Adaptive {
                below, at_or_above, ..
            } if below == CompressionType::SparseTopK
                || at_or_above == CompressionType::SparseTopK =>
            {
                Err("sparse top-k cannot be mixed with other codecs by tensor size".into())
            }
            _ => Ok(None),
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = String;

    /// Accepts `none`, `float16`, `bfloat16`, `uniform8`, `quantile8`, `blockwise8`, `adaptive`,
    /// and `topk:<density>:<bits>:<chunk>` (e.g. `topk:0.02:2:2048`; `topk` alone is
    /// [`SparseTopK::DEFAULT`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(rest) = s.strip_prefix("topk") {
            return SparseTopK::parse(rest).map(Self::Sparse);
        }
        let kind = match s {
            "none" => CompressionType::None,
            "float16" | "fp16" => CompressionType::Float16,
            "bfloat16" | "bf16" => CompressionType::BFloat16,
            "uniform8" => CompressionType::Uniform8Bit,
            "quantile8" => CompressionType::Quantile8Bit,
            "blockwise8" => CompressionType::Blockwise8Bit,
            "adaptive" => return Ok(Self::ADAPTIVE_DEFAULT),
            other => {
                return Err(format!(
                    "unknown compression '{other}' (expected one of: none, float16, bfloat16, \
                     uniform8, quantile8, blockwise8, adaptive, topk:<density>:<bits>:<chunk>)"
                ));
            }
        };
        Ok(Self::Fixed(kind))
    }
}
