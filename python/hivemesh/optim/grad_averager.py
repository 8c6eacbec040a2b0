"""``GradientAverager``: accumulates a peer's gradients over local batches and averages them
with a group, weighted by the samples each peer accumulated (hivemind 1.1.12's class).

Three sets of buffers: the parameters' ``.grad`` (written by autograd), the accumulators (the
``.grad`` buffers themselves with ``reuse_grad_buffers=True``, else buffers of their own), and
the averaged gradients, host tensors that the all-reduce averages in place. Each batch adds
``grad * batch_size`` to the accumulators; a round starts from ``accumulated / samples``, the
mean gradient per sample, with this peer's weight set to its sample count, so the group's
result is the mean gradient over every sample the group saw. (With ``reuse_grad_buffers`` the
caller accumulates in ``.grad`` and only the number of batches is known: the round starts from
``.grad / batches``.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from hivemesh.averaging import DecentralizedAverager
from hivemesh.averaging.control import StepControl
from hivemesh.dht import DHT
from hivemesh.utils import get_logger

__all__ = ["GradientAverager"]

logger = get_logger(__name__)


class GradientAverager(DecentralizedAverager):
    """Accumulates and averages the gradients of ``parameters``; see the module docs.

    ``reuse_grad_buffers``: accumulate in the parameters' ``.grad`` (never call ``zero_grad``
    then); ``accumulate_grads_on``: the device of the accumulators (default: the parameters');
    ``client_mode``: default the DHT's; ``warn``: warn when accumulators or results go unused;
    ``grad_extra_tensors``: use these host tensors as the averaged gradients. Everything else
    goes to :class:`hivemesh.DecentralizedAverager`.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        dht: DHT,
        prefix: str,
        reuse_grad_buffers: bool = False,
        accumulate_grads_on: Optional[torch.device] = None,
        client_mode: Optional[bool] = None,
        warn: bool = True,
        grad_extra_tensors: Sequence[torch.Tensor] = (),
        **kwargs: Any,
    ):
        if reuse_grad_buffers and accumulate_grads_on is not None:
            logger.warning("accumulate_grads_on has no effect with reuse_grad_buffers=True")
        if client_mode is None:
            client_mode = dht.client_mode
        self.parameters = tuple(parameters)
        if not self.parameters:
            raise ValueError("there are no parameters")
        self.reuse_grad_buffers = reuse_grad_buffers
        self.warn = warn
        self.local_samples_accumulated = 0
        self.local_times_accumulated = 0
        self._accumulators: Optional[tuple] = None
        if not reuse_grad_buffers:
            self._accumulators = tuple(
                torch.zeros_like(g, device=accumulate_grads_on) for g in self._grads()
            )
        self._accumulators_used_in_step = False
        self._new_averaged_grads = False
        #: Multiplies what :meth:`load_accumulators_into_averager_` loads (``1 / scale`` of
        #: a :class:`hivemesh.GradScaler`, set by :class:`hivemesh.Optimizer`).
        self.grad_scale_inverse = 1.0
        with torch.no_grad():
            if grad_extra_tensors:
                averaged = list(grad_extra_tensors)
            else:
                averaged = [
                    g.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
                    for g in self._grads()
                ]
        super().__init__(averaged, dht, prefix=prefix, client_mode=client_mode, **kwargs)

    def _grads(self) -> Iterator[torch.Tensor]:
        """The parameters' gradient buffers (made, as zeros, where missing)."""
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            yield p.grad

    def _grad_accumulators(self) -> Iterator[torch.Tensor]:
        """Where gradients accumulate: the ``.grad`` buffers or this averager's own."""
        if self.reuse_grad_buffers:
            yield from self._grads()
        else:
            assert self._accumulators is not None
            yield from self._accumulators

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        """Adds the current gradients (of a batch of ``batch_size`` samples) to the
        accumulators."""
        if not batch_size > 0:
            raise ValueError(f"batch_size must be positive, not {batch_size!r}")
        if self._accumulators_used_in_step and self.warn:
            logger.warning(
                "the gradient accumulators were not reset since the last round: call "
                "reset_accumulated_grads_() after each step, or step(reset_accumulators=True)"
            )
            self._accumulators_used_in_step = False
        self.local_samples_accumulated += int(batch_size)
        self.local_times_accumulated += 1
        if not self.reuse_grad_buffers:
            for grad, acc in zip(self._grads(), self._grad_accumulators()):
                acc.add_(grad.to(acc.device), alpha=float(batch_size))

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs: Any) -> StepControl:
        """Starts matchmaking now for a round that begins when :meth:`step` triggers it
        (``control=``); the weight is set then."""
        if kwargs.get("weight") is not None:
            raise ValueError("schedule_step does not take a weight: step() sets it")
        return super().step(scheduled_time=scheduled_time, wait=False, require_trigger=True,
                            **kwargs)

    def step(
        self,
        weight: Optional[float] = None,
        reset_accumulators: bool = True,
        control: Optional[StepControl] = None,
        timeout: Optional[float] = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Averages the accumulated gradients with a group: in a round from
        :meth:`schedule_step` (``control``) or a new one. ``weight`` defaults to the samples
        accumulated; ``reset_accumulators`` zeroes them once loaded into the round; with
        ``wait=False`` returns the :class:`StepControl`."""
        if control is None:
            control = self.schedule_step(timeout=timeout, **kwargs)
        elif kwargs:
            raise ValueError(f"a pre-scheduled round ignores {sorted(kwargs)}")
        if control.triggered:
            raise ValueError(f"{control} was already used")
        if self._new_averaged_grads and self.warn:
            logger.warning("starting a round while the last round's result was not used")
        self.load_accumulators_into_averager_()
        self._accumulators_used_in_step = True
        self._new_averaged_grads = True
        control.weight = float(self.local_samples_accumulated if weight is None else weight)
        if reset_accumulators:
            self.reset_accumulated_grads_()
        control.allow_allreduce()
        return control.result(timeout) if wait else control

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """Puts the mean accumulated gradient into the averaged gradients."""
        if self.reuse_grad_buffers:
            scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
        else:
            scale = 1.0 / self.local_samples_accumulated if self.local_samples_accumulated else 0.0
        scale *= self.grad_scale_inverse
        with self.get_tensors() as averaged:
            for acc, avg in zip(self._grad_accumulators(), averaged):
                avg.copy_(acc).mul_(scale)

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """Zeroes the accumulators and the counts."""
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        for acc in self._grad_accumulators():
            acc.zero_()

    @contextlib.contextmanager
    def use_averaged_gradients(self) -> Iterator[Sequence[torch.Tensor]]:
        """Within the block the parameters' ``.grad`` are the averaged gradients (host
        tensors); afterwards their own again."""
        self._new_averaged_grads = False
        with torch.no_grad(), self.get_tensors() as averaged:
            old = [p.grad for p in self.parameters]
            try:
                for p, g in zip(self.parameters, averaged):
                    p.grad = g
                yield averaged
            finally:
                for p, g in zip(self.parameters, old):
                    p.grad = g

    def notify_used_averaged_gradients(self) -> None:
        """Marks the last round's result as used."""
        self._new_averaged_grads = False
