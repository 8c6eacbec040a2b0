"""Codecs for the tensor parts of a round, with hivemind's names.

Pass one as ``DecentralizedAverager(..., compression=...)``. Lossy codecs change only what
travels: every peer ends with the same averaged values.
"""

from typing import Tuple

__all__ = [
    "CompressionBase",
    "NoCompression",
    "Float16Compression",
    "BFloat16Compression",
    "Uniform8BitQuantization",
    "Quantile8BitQuantization",
    "BlockwiseQuantization",
    "SizeAdaptiveCompression",
]


class CompressionBase:
    """A codec. Subclasses name one of hivemesh's wire codecs."""

    #: The wire code of the codec (hivemind's ``CompressionType`` value).
    code: int = 0

    def _spec(self) -> Tuple[int, int, int]:
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
            if not isinstance(c, CompressionBase) or isinstance(c, SizeAdaptiveCompression):
                raise TypeError(f"{name} must be a single codec, not {c!r}")
        self.threshold = threshold
        self.less = less
        self.greater_equal = greater_equal

    def _spec(self) -> Tuple[int, int, int]:
        return (self.less.code, self.threshold, self.greater_equal.code)

    def __repr__(self) -> str:
        return f"SizeAdaptiveCompression({self.threshold}, {self.less!r}, {self.greater_equal!r})"
