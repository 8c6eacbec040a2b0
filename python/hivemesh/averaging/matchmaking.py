"""``hivemesh.averaging.matchmaking``: hivemind's name for a failed matchmaking.

:data:`MatchmakingException` is ``hivemesh.MatchmakingError`` itself (an alias): what
matchmaking raises where it raises, a ``hivemesh.AveragingError`` too. A step that finds no
group in time returns ``None`` rather than raising (see
:meth:`hivemesh.averaging.control.StepControl.result`).
"""

from hivemesh._hivemesh import MatchmakingError

__all__ = ["MatchmakingException"]

#: hivemind's ``MatchmakingException``: the same class as ``hivemesh.MatchmakingError``.
MatchmakingException = MatchmakingError
