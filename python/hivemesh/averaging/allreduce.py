"""``hivemesh.averaging.allreduce``: hivemind's name for a failed all-reduce.

:class:`AllreduceException` is what a step whose group formed but whose all-reduce failed
(linking to the members, an unreachable group, the round itself) raises. It is a
``hivemesh.AveragingError``, so ``except hivemesh.AveragingError`` still catches it. (hivemind
wraps such failures in a ``MatchmakingException``; a step that finds no group returns ``None``
here, see :meth:`hivemesh.averaging.control.StepControl.result`.)
"""

from hivemesh._hivemesh import AveragingError

__all__ = ["AllreduceException"]


class AllreduceException(AveragingError):
    """A step's all-reduce failed (hivemind's ``AllreduceException``)."""
