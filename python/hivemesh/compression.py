"""Codecs for the tensor parts of a round, with hivemind's names.

Pass one as ``DecentralizedAverager(..., compression=...)``. The dense lossy codecs change
only what travels, and each peer keeps its own compression error: on a part another member
reduces, a peer ends at the group's average of the decoded contributions plus (its input
minus its decoded input), so peers differ by their codec errors. :class:`ErrorFeedbackTopK` instead hands every peer the same values and
keeps what was not sent in a residual for the next round.
"""

from typing import Tuple, Union

__all__ = [
    "CompressionBase",
    "NoCompression",
    "Float16Compression",
    "BFloat16Compression",
    "Uniform8BitQuantization",
    "Quantile8BitQuantization",
    "BlockwiseQuantization",
    "SizeAdaptiveCompression",
    "ErrorFeedbackTopK",
]


class CompressionBase:
    """A codec. Subclasses name one of hivemesh's wire codecs."""

    #: The wire code of the codec (hivemind's ``CompressionType`` value).
    code: int = 0

    def _spec(self) -> Union[Tuple[int, int, int], str]:
        return (self.code, 0, self.code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompressionBase) and self._spec() == other._spec()

    def __hash__(self) -> int:
        return hash(self._spec())


class NoCompression(CompressionBase):
    """Raw float32 values."""

    code = 0


class Float16Compression(CompressionBase):
    """IEEE half precision (half the bytes)."""

    code = 2


class Quantile8BitQuantization(CompressionBase):
    """8 bits per value, quantile bins."""

    code = 3


class Uniform8BitQuantization(CompressionBase):
    """8 bits per value, uniform bins around the mean."""

    code = 4


class BlockwiseQuantization(CompressionBase):
    """8 bits per value, blockwise dynamic quantization (bitsandbytes' scheme)."""

    code = 5


class BFloat16Compression(CompressionBase):
    """bfloat16 (half the bytes, float32's range)."""

    code = 6


class SizeAdaptiveCompression(CompressionBase):
    """``less`` for tensors with fewer than ``threshold`` elements, ``greater_equal`` for the
    rest (decided per tensor by its full size)."""

    def __init__(self, threshold: int, less: CompressionBase, greater_equal: CompressionBase):
        if not isinstance(threshold, int) or threshold <= 0:
            raise ValueError(f"threshold must be a positive int, not {threshold!r}")
        for name, c in (("less", less), ("greater_equal", greater_equal)):
            if not isinstance(c, CompressionBase) or isinstance(
                c, (SizeAdaptiveCompression, ErrorFeedbackTopK)
            ):
                raise TypeError(f"{name} must be a single codec, not {c!r}")
        self.threshold = threshold
        self.less = less
        self.greater_equal = greater_equal

    def _spec(self) -> Union[Tuple[int, int, int], str]:
        return (self.less.code, self.threshold, self.greater_equal.code)

    def __repr__(self) -> str:
        return f"SizeAdaptiveCompression({self.threshold}, {self.less!r}, {self.greater_equal!r})"


class ErrorFeedbackTopK(CompressionBase):
    """Sparse, quantized parts with error feedback (for gradients and pseudo-gradients).

    Per chunk of ``chunk`` values (a power of two, 64 to 65536) of each part, only the
    ``round(density * chunk)`` values of largest magnitude travel, each quantized to ``bits``
    bits (2 to 8) against a power-of-two step: a kept value is within ``max / 2**(bits - 1)``
    of its input, ``max`` the chunk's largest magnitude. Each averager keeps the residual of
    what it did not send (the values left out and the rounding) and adds it to its next step's
    input, so nothing is lost, only delayed; ``DecentralizedAverager.error_feedback_residuals()``
    shows it. A step that fails keeps the residual; where a reducer failed during a step, the
    residual takes the whole input of those parts back and the averaged tensors hold 0 there.

    Reducers average the sparse parts over the union of the positions they received and send
    that union back (not densified), the same bytes to every member: all peers end a step with
    identical values. ``reply_bits`` (2 to 8, or 32) is how those replies carry the average:
    quantized like the parts (every value of the union kept, each chunk of 2048 on its own
    power-of-two step, within ``max / 2**(reply_bits - 1)``), the reducer keeping the rounding
    error in its own residual, scaled so that the next step's average delivers it; or 32: exact
    float32 (about 3x the bytes of 8 bits). Tensors hold the averaged compressed contributions afterwards, so use it
    for additive quantities (gradients, DiLoCo's pseudo-gradients), not for parameters. Every
    member of a swarm must use the same parameters; CPU tensors only.
    """

    code = 7

    def __init__(self, density: float = 0.02, bits: int = 2, chunk: int = 2048,
                 reply_bits: int = 8):
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], not {density!r}")
        if not isinstance(bits, int) or not 2 <= bits <= 8:
            raise ValueError(f"bits must be an int from 2 to 8, not {bits!r}")
        if not isinstance(chunk, int) or chunk < 64 or chunk > 65536 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two from 64 to 65536, not {chunk!r}")
        if not isinstance(reply_bits, int) or not (2 <= reply_bits <= 8 or reply_bits == 32):
            raise ValueError(f"reply_bits must be an int from 2 to 8, or 32, not {reply_bits!r}")
        self.density = density
        self.bits = bits
        self.chunk = chunk
        self.reply_bits = reply_bits

    def _spec(self) -> Union[Tuple[int, int, int], str]:
        return f"topk:{self.density!r}:{self.bits}:{self.chunk}:{self.reply_bits}"

    def __repr__(self) -> str:
        return (f"ErrorFeedbackTopK(density={self.density!r}, bits={self.bits}, "
                f"chunk={self.chunk}, reply_bits={self.reply_bits})")
