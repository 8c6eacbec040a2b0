"""``hivemesh.averaging``: hivemind's averaging API over hivemesh's Rust core
(:class:`DecentralizedAverager` in :mod:`hivemesh.averaging.averager`, :class:`StepControl`
in :mod:`hivemesh.averaging.control`); see :mod:`hivemesh.averaging.averager` for how tensors
are shared."""

from hivemesh.averaging.allreduce import AllreduceException
from hivemesh.averaging.averager import DecentralizedAverager
from hivemesh.averaging.control import AveragingMode, AveragingStage, StepControl
from hivemesh.averaging.matchmaking import MatchmakingException

__all__ = ["DecentralizedAverager", "StepControl", "AveragingMode", "AveragingStage",
           "AllreduceException", "MatchmakingException"]
