"""``hivemesh.averaging.control``: a step in flight (:class:`StepControl`), its stages, and how
gathered values and state metadata travel (hivemind's ``hivemind.averaging.control``)."""

from __future__ import annotations

import concurrent.futures
import enum
import json
import math
import warnings
from typing import Any, Dict, Optional

from hivemesh import _hivemesh
from hivemesh._hivemesh import AveragingError, MatchmakingError
from hivemesh.averaging.allreduce import AllreduceException
from hivemesh.dht import PeerID

__all__ = ["StepControl", "AveragingStage", "AveragingMode"]

GatheredData = Any

# A gathered value (and the state metadata) travels as one tag byte and its encoding: raw
# bytes, or JSON for anything JSON can carry (dicts, lists, numbers, strings). Nothing from the
# network is unpickled.
_RAW, _JSON = b"\x00", b"\x01"


def _encode_value(value: Any, what: str = "gather") -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _RAW + bytes(value)
    try:
        return _JSON + json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be bytes or JSON-serializable (dicts, lists, str, numbers): {e}"
        ) from None


def _decode_value(data: bytes, untagged: Any = None) -> Any:
    """The value ``data`` carries; ``untagged`` for bytes that are not one of ours (a peer
    that sent something else, or a Rust peer's raw metadata)."""
    if not data:
        return None
    tag, body = data[:1], data[1:]
    if tag == _RAW:
        return body
    if tag == _JSON:
        try:
            return json.loads(body)
        except ValueError:
            return untagged
    return untagged


class AveragingMode(enum.Enum):
    """How a peer takes part: sends and reduces (``NODE``), sends only and is never dialled
    (``CLIENT``), reduces only (``AUX``)."""

    NODE = 0
    CLIENT = 1
    AUX = 2


class AveragingStage(enum.Enum):
    """Where a step is."""

    IDLE = 0
    LOOKING_FOR_GROUP = 1
    AWAITING_TRIGGER = 2
    RUNNING_ALLREDUCE = 3
    FINISHED = 4


_STAGES = {
    "queued": AveragingStage.IDLE,
    "matchmaking": AveragingStage.LOOKING_FOR_GROUP,
    "awaiting_trigger": AveragingStage.AWAITING_TRIGGER,
    "allreduce": AveragingStage.RUNNING_ALLREDUCE,
    "finished": AveragingStage.FINISHED,
}


class StepControl:
    """A step in flight (``step(wait=False)``): :meth:`trigger` it, :meth:`cancel` it, read
    its :attr:`stage`, wait for its :meth:`result`."""

    def __init__(self, native: _hivemesh.StepControl):
        self._native = native
        self._cancelled = False
        self._triggered = False
        #: The last step's outcome (group id, members, links per member, mode): hivemesh's
        #: round report, set once the step succeeded.
        self.outcome: Optional[Dict[str, Any]] = None

    def trigger(self) -> None:
        """Lets the all-reduce begin (for ``require_trigger=True``)."""
        self._triggered = True
        self._native.trigger()

    allow_allreduce = trigger  # hivemind's name

    @property
    def triggered(self) -> bool:
        """Whether :meth:`trigger` was called."""
        return self._triggered

    @property
    def weight(self) -> float:
        """This peer's averaging weight in the step. Settable until the all-reduce begins
        (hivemind's ``GradientAverager`` sets it after scheduling; a peer tagging along sets
        0); the value the all-reduce reads as it begins is the one used. After that, setting
        it warns and changes nothing (as hivemind)."""
        return self._native.weight

    @weight.setter
    def weight(self, weight: float) -> None:
        weight = float(weight)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be a finite non-negative number, not {weight}")
        if not self._native.set_weight(weight):
            warnings.warn("the step's all-reduce has begun: the weight change has no effect",
                          RuntimeWarning, stacklevel=2)

    @property
    def scheduled_time(self) -> Optional[float]:
        """When the all-reduce should begin at the earliest (DHT time, :func:`get_dht_time`);
        ``None`` for as soon as ``min_matchmaking_time`` allows. Settable until the all-reduce
        begins: matchmaking's next declaration of this peer expires then (one made already
        stands until it expires). After that, setting it warns and changes nothing."""
        return self._native.scheduled_time

    @scheduled_time.setter
    def scheduled_time(self, scheduled_time: float) -> None:
        if not self._native.set_scheduled_time(float(scheduled_time)):
            warnings.warn("the step's all-reduce has begun: the scheduled time change has no "
                          "effect", RuntimeWarning, stacklevel=2)

    @property
    def stage(self) -> AveragingStage:
        """The step's stage."""
        return _STAGES[self._native.stage]

    @property
    def began_allreduce(self) -> bool:
        """Whether the all-reduce has begun."""
        return self.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED)

    def cancel(self) -> bool:
        """Cancels the step; returns ``False`` if it had already finished."""
        if self._native.done():
            return False
        self._cancelled = True
        self._native.cancel()
        return True

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` stopped the step."""
        return self._cancelled and self._native.done()

    def done(self) -> bool:
        """Whether the step has finished (in any way)."""
        return self._native.done()

    def result(self, timeout: Optional[float] = None) -> Optional[Dict[PeerID, GatheredData]]:
        """Waits for the step: the group's gathered data ``{peer_id: gather}`` (every
        member, this peer too), or ``None`` if no group formed in time. Raises
        ``concurrent.futures.TimeoutError`` if ``timeout`` seconds pass first,
        ``concurrent.futures.CancelledError`` if the step was cancelled, and
        :class:`hivemesh.averaging.allreduce.AllreduceException` (a
        ``hivemesh.AveragingError``) if the group's all-reduce failed."""
        if not self._native.wait(timeout):
            raise concurrent.futures.TimeoutError(f"the step did not finish in {timeout} s")
        try:
            outcome = self._native.outcome()
        except MatchmakingError:
            return None
        except AveragingError as e:
            if type(e) is AveragingError:
                # The group formed and its all-reduce failed: hivemind's name for it.
                raise AllreduceException(*e.args) from e
            raise
        self.outcome = outcome
        return {
            PeerID(peer): _decode_value(g)
            for peer, g in zip(outcome["members"], outcome["gathered"])
        }

    def __repr__(self) -> str:
        return f"<StepControl {self.stage.name}>"
