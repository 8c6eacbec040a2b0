"""``hivemesh.GradScaler``: loss scaling for mixed-precision training with
:class:`hivemesh.Optimizer` (hivemind's ``GradScaler`` name and use).

Use it as torch's scaler, handing it the hivemesh optimizer::

    scaler = hivemesh.GradScaler()
    scaler.scale(loss).backward()
    scaler.step(opt)          # = opt.step(grad_scaler=scaler)
    scaler.update()

What differs from torch's: gradients accumulate over a whole epoch before the optimizer uses
them, so the scale must not change within an epoch. The optimizer checks every batch's
gradients (a batch with inf/NaN resets the epoch's local gradients, as hivemind does) and
divides by the scale only what the optimizer step uses (the epoch's averaged gradients, or a
local step's); :meth:`update` backs the scale off after an overflow and grows it only after
``growth_interval`` optimizer steps, never in between.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

__all__ = ["GradScaler"]

_TorchGradScaler = getattr(torch.amp, "GradScaler", None) or torch.cuda.amp.GradScaler


class GradScaler(_TorchGradScaler):
    """torch's ``GradScaler`` (``scale()``, ``get_scale()``, the same arguments; ``device``
    defaults to ``"cuda"`` where there is a GPU, else ``"cpu"``) whose :meth:`step` hands the
    work to :class:`hivemesh.Optimizer` and whose :meth:`update` changes the scale only
    between epochs; see the module docs."""

    def __init__(self, *args: Any, **kwargs: Any):
        if not args and "device" not in kwargs and _TorchGradScaler is not torch.cuda.amp.GradScaler:
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(*args, **kwargs)
        self._lock = threading.RLock()
        self._in_global_step = False
        self._found_inf = False
        self._optimizer_steps = 0

    @contextlib.contextmanager
    def running_global_step(self) -> Iterator[None]:
        """Marks the optimizer's own use of the scaler (an epoch's optimizer step)."""
        with self._lock:
            was, self._in_global_step = self._in_global_step, True
            try:
                yield
            finally:
                self._in_global_step = was

    def inverse_scale(self) -> float:
        """``1 / scale`` (1 when scaling is disabled)."""
        return 1.0 / float(self.get_scale()) if self.is_enabled() else 1.0

    def are_grads_finite(self, optimizer: Any) -> bool:
        """Whether every gradient of ``optimizer``'s params is finite; records an overflow
        (so that :meth:`update` backs off) when not."""
        with self._lock:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                        self._found_inf = True
                        return False
            return True

    def unscale_(self, optimizer: Any) -> bool:
        """Divides ``optimizer``'s gradients by the scale, in place (only within the
        optimizer's global step; elsewhere a no-op returning ``False``, since the gradients
        are still being accumulated)."""
        with self._lock:
            if not self._in_global_step:
                return False
            if not self.is_enabled():
                return True
            if not self.are_grads_finite(optimizer):
                return False
            inv = self.inverse_scale()
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv)
            return True

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """With a :class:`hivemesh.Optimizer`: ``optimizer.step(grad_scaler=self)``. Within
        its global step, on the wrapped torch optimizer: runs ``optimizer.step()`` (the
        gradients are unscaled already) and returns ``True``."""
        from hivemesh.optim.optimizer import Optimizer

        if isinstance(optimizer, Optimizer):
            return optimizer.step(*args, grad_scaler=self, **kwargs)
        with self._lock:
            if not self._in_global_step:
                raise ValueError("hivemesh.GradScaler.step takes the hivemesh.Optimizer")
            optimizer.step(*args, **kwargs)
            self._optimizer_steps += 1
            return True

    def update(self, new_scale: Any = None) -> bool:
        """Backs the scale off after an overflow, grows it after ``growth_interval``
        optimizer steps without one, or sets ``new_scale``; otherwise leaves it (within an
        epoch). Returns whether the scale was revisited."""
        with self._lock:
            if not self.is_enabled() or getattr(self, "_scale", None) is None:
                return False  # disabled, or nothing was scaled yet
            if new_scale is not None:
                super().update(new_scale)
                self._found_inf, self._optimizer_steps = False, 0
                return True
            if self._found_inf:
                self._set_scale(float(self.get_scale()) * self.get_backoff_factor())
                self._found_inf, self._optimizer_steps = False, 0
                return True
            if self._optimizer_steps >= self.get_growth_interval():
                self._set_scale(float(self.get_scale()) * self.get_growth_factor())
                self._optimizer_steps = 0
                return True
            return False

    def _set_scale(self, value: float) -> None:
        super().update(float(value))
