"""A one-line progress bar for a collaborative run (``Optimizer(verbose=True)`` on a terminal).

hivemind's ``verbose`` gives log lines; a long run on a terminal also wants to see, between
them, how far the swarm is into the current epoch. :class:`EpochProgressBar` redraws one line
on standard error (``\\r``, no dependency on tqdm), at most every ``min_interval`` seconds:

``epoch 3 [#######.............] 1,536/4,096 samples | 4 peers (1 client) | 512 samples/s |
ETA 5.0 s | last round: 4 peers in 0.42 s``

It draws only where standard error is a terminal (a log file or a pipe gets the per-epoch log
lines alone, not carriage returns), and moves to a new line when the epoch changes or before a
log line is written, so that bars and logs do not overwrite each other.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

__all__ = ["EpochProgressBar", "ProgressSnapshot", "render"]

# Bars with a line open: hivemesh's log handler ends their lines before writing a record.
_open_bars: "weakref.WeakSet[EpochProgressBar]" = weakref.WeakSet()


class _EndBarLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for bar in list(_open_bars):
            bar.newline()
        return True


_END_BAR_LINES = _EndBarLines()


@dataclass(frozen=True)
class ProgressSnapshot:
    """What the bar shows: the swarm's progress toward the end of ``epoch``."""

    epoch: int
    samples: int
    target: int
    peers: int
    clients: int
    samples_per_second: float
    eta_seconds: float
    round_peers: Optional[int] = None
    round_seconds: Optional[float] = None


def _count(n: float) -> str:
    return f"{int(n):,}"


def render(s: ProgressSnapshot, width: int = 20) -> str:
    """The bar's text for ``s`` (no carriage return): pure, for tests and for callers that
    draw it themselves."""
    target = max(s.target, 1)
    fraction = min(max(s.samples / target, 0.0), 1.0)
    filled = int(fraction * width)
    bar = "#" * filled + "." * (width - filled)
    peers = f"{s.peers} peer{'s' if s.peers != 1 else ''}"
    if s.clients:
        peers += f" ({s.clients} client{'s' if s.clients != 1 else ''})"
    if s.eta_seconds != s.eta_seconds or s.eta_seconds == float("inf"):  # NaN or never
        eta = "ETA ?"
    else:
        eta = f"ETA {max(s.eta_seconds, 0.0):.1f} s"
    parts = [
        f"epoch {s.epoch} [{bar}] {_count(min(s.samples, 10**15))}/{_count(s.target)} samples",
        peers,
        f"{s.samples_per_second:.0f} samples/s" if s.samples_per_second > 0 else "? samples/s",
        eta,
    ]
    if s.round_peers is not None and s.round_peers > 1 and s.round_seconds is not None:
        parts.append(f"last round: {s.round_peers} peers in {s.round_seconds:.2f} s")
    return " | ".join(parts)


class EpochProgressBar:
    """Redraws :func:`render`'s line on a terminal; see the module docs.

    ``stream`` is looked up at every draw (default: ``sys.stderr`` as it is then), ``enabled``
    ``None`` means "if the stream is a terminal", ``clock`` is for tests."""

    def __init__(
        self,
        enabled: Optional[bool] = None,
        min_interval: float = 0.5,
        stream: Optional[Callable[[], TextIO]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._enabled, self.min_interval = enabled, min_interval
        self._stream = stream or (lambda: sys.stderr)
        self._clock = clock
        self._last_draw: Optional[float] = None
        self._epoch: Optional[int] = None
        self._width = 0  # characters on the line now (0: the cursor is at a line's start)
        self.draws = 0

    def active(self) -> bool:
        """Whether the bar draws now."""
        if self._enabled is not None:
            return self._enabled
        isatty = getattr(self._stream(), "isatty", None)
        try:
            return bool(isatty and isatty())
        except (OSError, ValueError):  # a closed stream
            return False

    def due(self) -> bool:
        """Whether an :meth:`update` now would draw for time's sake (the last draw is
        ``min_interval`` old, or there was none on this line)."""
        return self._last_draw is None or self._clock() - self._last_draw >= self.min_interval

    def update(self, snapshot: ProgressSnapshot, force: bool = False) -> bool:
        """Draws ``snapshot`` if the last draw is ``min_interval`` old (or ``force``, or the
        epoch changed: the finished epoch's line is kept); whether it drew."""
        if not self.active():
            return False
        now = self._clock()
        new_epoch = self._epoch is not None and snapshot.epoch != self._epoch
        if not (force or new_epoch or self._last_draw is None
                or now - self._last_draw >= self.min_interval):
            return False
        stream = self._stream()
        if new_epoch:
            self.newline()
        line = render(snapshot)
        try:
            stream.write("\r" + line + " " * max(self._width - len(line), 0))
            stream.flush()
        except (OSError, ValueError):
            return False
        self._width, self._last_draw, self._epoch = len(line), now, snapshot.epoch
        self.draws += 1
        if self not in _open_bars:
            from hivemesh.utils.logging import add_handler_filter

            add_handler_filter(_END_BAR_LINES)
            _open_bars.add(self)
        return True

    def newline(self) -> None:
        """Ends the bar's line (before a log line, at an epoch's end, at shutdown)."""
        if self._width:
            try:
                stream = self._stream()
                stream.write("\n")
                stream.flush()
            except (OSError, ValueError):
                pass
            self._width = 0
            self._last_draw = None  # the next update draws again at once
        _open_bars.discard(self)
