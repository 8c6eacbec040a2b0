"""``hivemesh.DiLoCoOptimizer``: DiLoCo (Douillard et al., arXiv 2311.08105) over hivemesh,
taking OpenDiLoCo's arguments (``open_diloco/hivemind_diloco.py``) where they mean the same.

Every call to :meth:`DiLoCoOptimizer.step` runs the *inner* optimizer (e.g. AdamW) on the
model's parameters, locally. Every ``num_inner_steps`` calls the peers end an *outer epoch*:

1. each peer computes its pseudo-gradient, ``outer_params - params`` (``outer_params``: host
   float32 copies of the parameters as they were when the outer epoch began, identical on every
   peer);
2. the peers average the pseudo-gradients in one all-reduce (the averager's
   ``compression=`` is ``grad_compression``), each weighted by the share of the epoch's
   samples it processed (1 for a peer that did all ``num_inner_steps`` steps);
3. every peer runs the *outer* optimizer (e.g. SGD, Nesterov momentum 0.9, lr 0.7) on
   ``outer_params`` with the averaged pseudo-gradient as their gradient, and copies the result
   into the model.

With a lossless codec every peer that took part ends each outer step with identical
parameters and identical outer optimizer state (with a lossy one, see
``average_state_every``). The outer epoch is the swarm's epoch of the
:class:`ProgressTracker`; the outer state (``outer_params``, the outer optimizer's state, the
epoch) is what newcomers download (the :class:`TrainingStateAverager` serves it).

Synchronisation (all inside :meth:`step`, which never raises because a round with peers
failed):

* a peer behind the swarm's epoch (it missed an outer step, or it is new) downloads the outer
  state, puts its parameters at ``outer_params`` and carries on with the swarm's current epoch;
  its progress toward the epoch starts at the swarm's mean, so it reaches the next outer step
  with the others, contributing what it did since (weighted accordingly);
* ``all_reduce_strategy=WAIT_FOR_ALL`` (the default): a peer that finished its inner steps
  waits, up to ``timeout_waiting_for_peers``, until the tracker shows every peer of the swarm
  done with the epoch, then all of them start matchmaking together; ``NO_WAIT``: it starts at
  once (the slowest peers miss the round and reload);
* a peer still looking for a group when the tracker shows the others past its epoch stops
  looking and reloads;
* a round that fails, or forms no group, is retried at once with the same pseudo-gradient
  until ``averaging_timeout`` has passed since the first try; a peer that sees the swarm's
  epoch move past its own meanwhile (the others succeeded without it) reloads the state; one
  still without a round after that skips the outer step and retries at its next call (its
  pseudo-gradient then spans more inner steps); a lone peer applies its own pseudo-gradient;
* the group key of an outer round carries its epoch (8 group bits), so a peer retrying a late
  round never averages with peers already on the next epoch (and the gathered epochs are
  checked as well).

``overlap_communication=True`` hides the outer round behind the next epoch's inner steps (a
one-round-delayed outer update, as Streaming DiLoCo's overlapping and DiLoCoX's one-step
delay; here the delay is only as long as the round takes). At the end of its inner steps a
peer waits for the others as above, keeps a copy ``launched`` of its parameters, loads its
pseudo-gradient ``outer_params - launched`` and starts the round without waiting for it; its
next inner steps go on from ``launched`` and count toward the next epoch. At the first call
after the round ends, the outer optimizer steps as above and the model moves to ``outer_params
+ (params - launched)``: the new outer parameters plus this peer's progress since the launch,
whose pseudo-gradient the next round averages. Every peer's outer parameters and outer
optimizer state stay identical; their models differ by each one's progress since its launch,
as they do anyway during an epoch. A round still running after a whole epoch of inner steps
blocks the next call until it ends; a failed round is restarted with the same pseudo-gradient
until ``averaging_timeout`` has passed since the epoch's end, then skipped as above; a peer
still looking for a group when the others are past its epoch reloads. The tracker keeps
reporting the epoch finished until the outer step; the state served to newcomers is the outer
state without the round in flight.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from hivemesh._hivemesh import ShutdownError
from hivemesh.averaging import DecentralizedAverager
from hivemesh.compression import CompressionBase, NoCompression
from hivemesh.dht import DHT
from hivemesh.optim.optimizer import Optimizer
from hivemesh.optim.progress_tracker import ProgressTracker
from hivemesh.optim.state_averager import (
    LRSchedulerBase,
    OptimizerFactory,
    Parameters,
    ParamGroups,
    SchedulerFactory,
    TorchOptimizer,
    TrainingStateAverager,
)
from hivemesh.utils import get_dht_time, get_logger

__all__ = ["DiLoCoOptimizer", "AllReduceStrategy", "DEFAULT_TIMEOUT_WAITING_FOR_PEERS"]

logger = get_logger(__name__)

#: OpenDiLoCo's default for ``timeout_waiting_for_peers`` with ``WAIT_FOR_ALL`` (seconds).
DEFAULT_TIMEOUT_WAITING_FOR_PEERS = 600.0


class AllReduceStrategy(Enum):
    """When a peer that finished its inner steps starts the outer round (OpenDiLoCo's names)."""

    #: Once the swarm's progress shows every peer done (at most ``timeout_waiting_for_peers``).
    WAIT_FOR_ALL = "WAIT_FOR_ALL"
    #: At once: the slowest peers miss the round and reload the state.
    NO_WAIT = "NO_WAIT"


def _copy_groups(params: Any) -> List[Any]:
    """``params`` as a list of tensors or of param-group dicts (each with a list of
    parameters), so that both optimizers can consume it."""
    items = list(params)
    if all(isinstance(p, dict) for p in items) and items:
        return [dict(g, params=list(g["params"])) for g in items]
    return items


@dataclass
class _InFlightRound:
    """An outer round running while the inner steps go on (``overlap_communication``)."""

    epoch: int
    weight: float
    began: float  # perf_counter() when this peer's inner steps of the epoch ended
    deadline: float  # monotonic(): no retry after it
    control: Any = None


class DiLoCoOptimizer(torch.optim.Optimizer):
    """DiLoCo with every peer of ``run_id``; see the module docs.

    OpenDiLoCo's arguments: ``dht``, ``run_id``, ``batch_size`` (samples per call to
    :meth:`step`), ``num_inner_steps`` (inner steps per outer step), ``outer_optimizer`` (a
    callable making the outer optimizer from param groups, e.g. ``lambda p:
    torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)``), ``inner_optimizer`` (a torch
    optimizer over ``params``, or a callable making one), ``params`` (the model's parameters or
    param groups; default: the inner optimizer's), ``scheduler`` (a scheduler of the inner
    optimizer or a callable making one; stepped every inner step), ``grad_compression`` (the
    pseudo-gradient round's codec), ``all_reduce_strategy``, ``timeout_waiting_for_peers``
    (default 600 s with ``WAIT_FOR_ALL``; at least ``matchmaking_time``), ``matchmaking_time``,
    ``averaging_timeout`` (how long one outer step retries failed rounds), ``averager_opts`` and
    ``tracker_opts`` (more arguments for the averagers and the :class:`ProgressTracker`;
    ``max_refresh_period`` defaults to 2 s as in OpenDiLoCo), ``verbose``.
    ``overlap_communication``: the outer round runs while this peer takes the next epoch's
    inner steps, and its outer step is applied when the round ends, keeping the progress made
    since (module docs); off by default.
    hivemind's: ``allreduce_timeout``, ``next_chunk_timeout``, ``load_state_timeout``,
    ``load_state_compression``, ``client_mode``, ``shutdown_timeout``, and
    ``average_state_every`` with ``average_opt_statistics``: every that many outer steps, a
    lossless round averages the outer parameters and the named outer optimizer statistics (e.g.
    ``("momentum_buffer",)`` for SGD). With a lossless ``grad_compression`` the peers of a round
    are identical without it; with a lossy one each peer keeps its own compression error (the
    averager's rule, as hivemind's) and the peers drift apart by it until such a round.

    Every peer must use the same ``batch_size`` and ``num_inner_steps`` (a peer's share of an
    outer epoch is ``batch_size * num_inner_steps`` samples) and start from the same parameters
    (DiLoCo averages updates: peers that start apart stay apart).
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        batch_size: int,
        num_inner_steps: int,
        outer_optimizer: OptimizerFactory,
        inner_optimizer: Union[TorchOptimizer, OptimizerFactory],
        params: Optional[Union[Parameters, ParamGroups]] = None,
        scheduler: Optional[Union[LRSchedulerBase, SchedulerFactory]] = None,
        grad_compression: CompressionBase = NoCompression(),
        load_state_compression: CompressionBase = NoCompression(),
        all_reduce_strategy: AllReduceStrategy = AllReduceStrategy.WAIT_FOR_ALL,
        timeout_waiting_for_peers: Optional[float] = None,
        matchmaking_time: float = 15.0,
        averaging_timeout: float = 60.0,
        allreduce_timeout: Optional[float] = None,
        next_chunk_timeout: Optional[float] = None,
        load_state_timeout: float = 600.0,
        average_state_every: Optional[int] = None,
        average_opt_statistics: Sequence[str] = (),
        client_mode: Optional[bool] = None,
        averager_opts: Optional[dict] = None,
        tracker_opts: Optional[dict] = None,
        shutdown_timeout: float = 5.0,
        overlap_communication: bool = False,
        verbose: bool = False,
    ):
        self._parent_pid = os.getpid()
        if not isinstance(dht, DHT):
            raise TypeError(f"dht must be a hivemesh.DHT, not {type(dht).__name__}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty str")
        for name, value in (("batch_size", batch_size), ("num_inner_steps", num_inner_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        if not callable(outer_optimizer) or isinstance(outer_optimizer, TorchOptimizer):
            raise TypeError("outer_optimizer must be a callable making the optimizer from params")
        all_reduce_strategy = AllReduceStrategy(all_reduce_strategy)
        if timeout_waiting_for_peers is not None:
            if all_reduce_strategy is AllReduceStrategy.NO_WAIT:
                raise ValueError("timeout_waiting_for_peers needs all_reduce_strategy=WAIT_FOR_ALL")
            if timeout_waiting_for_peers < matchmaking_time:
                raise ValueError("timeout_waiting_for_peers must be at least matchmaking_time")
        elif all_reduce_strategy is AllReduceStrategy.WAIT_FOR_ALL:
            timeout_waiting_for_peers = DEFAULT_TIMEOUT_WAITING_FOR_PEERS
        if not isinstance(grad_compression, CompressionBase):
            raise TypeError(f"grad_compression must be a hivemesh.compression codec, not "
                            f"{grad_compression!r}")
        if average_state_every is not None and (
                isinstance(average_state_every, bool) or not isinstance(average_state_every, int)
                or average_state_every < 1):
            raise ValueError(f"average_state_every must be a positive int or None, not "
                             f"{average_state_every!r}")
        if client_mode is None:
            client_mode = dht.client_mode
        if allreduce_timeout is None:
            allreduce_timeout = averaging_timeout
        if next_chunk_timeout is None:
            next_chunk_timeout = matchmaking_time

        if isinstance(inner_optimizer, TorchOptimizer):
            if params is None:
                params = [p for g in inner_optimizer.param_groups for p in g["params"]]
            params = _copy_groups(params)
            self.inner_optimizer = inner_optimizer
        elif callable(inner_optimizer):
            if params is None:
                raise ValueError("pass params=..., or inner_optimizer=an already made optimizer")
            params = _copy_groups(params)
            self.inner_optimizer = inner_optimizer(_copy_groups(params))
        else:
            raise TypeError(f"inner_optimizer must be a torch optimizer or a callable making one, "
                            f"not {inner_optimizer!r}")
        if not isinstance(self.inner_optimizer, TorchOptimizer):
            raise TypeError(f"inner_optimizer made {self.inner_optimizer!r}, not an optimizer")

        self.dht, self.run_id = dht, run_id
        self.batch_size, self.num_inner_steps = batch_size, num_inner_steps
        self.all_reduce_strategy = all_reduce_strategy
        self.timeout_waiting_for_peers = timeout_waiting_for_peers
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.client_mode, self.verbose = bool(client_mode), verbose
        self.average_state_every = average_state_every
        self.overlap_communication = bool(overlap_communication)
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        #: The last outer step: epoch reached, group size (1: own pseudo-gradient), seconds
        #: from the end of the inner steps to the update (``None`` before the first).
        self.last_outer_step: Optional[Dict[str, Any]] = None

        tracker_opts = dict(tracker_opts or {})
        tracker_opts.setdefault("max_refresh_period", 2.0)
        self.tracker = ProgressTracker(
            dht, f"{run_id}_progress", self.samples_per_epoch, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, start=True, **tracker_opts,
        )
        averager_common = dict(
            min_matchmaking_time=matchmaking_time, allreduce_timeout=allreduce_timeout,
            shutdown_timeout=shutdown_timeout, next_chunk_timeout=next_chunk_timeout,
            client_mode=self.client_mode, start=True, **(averager_opts or {}),
        )
        # The outer optimizer works on host float32 copies of the parameters (the outer
        # parameters), whose gradients this peer fills; the state averager serves them, the
        # outer optimizer's state and the epoch to newcomers, and runs the lossless rounds of
        # ``average_state_every`` (over copies: loading a state replaces the optimizer's
        # state tensors).
        self.state_averager = TrainingStateAverager(
            dht=dht, prefix=f"{run_id}_state_averager", optimizer=outer_optimizer,
            params=params, offload_optimizer=True, custom_gradients=True, reuse_tensors=False,
            average_opt_statistics=average_opt_statistics, status_loglevel=self.status_loglevel,
            state_compression=load_state_compression, **averager_common,
        )
        outer_params = self.state_averager._opt_parameters()
        # The pseudo-gradients: averaged in place, then read by the outer optimizer as its
        # gradients.
        self.grad_averager = DecentralizedAverager(
            [torch.zeros_like(p) for p in outer_params], dht,
            prefix=f"{run_id}_grad_averager", compression=grad_compression,
            allow_state_sharing=False, **averager_common,
        )
        with self.grad_averager.get_tensors() as buffers:
            for p, g in zip(outer_params, buffers):
                p.grad = g

        if scheduler is not None and not isinstance(scheduler, LRSchedulerBase):
            scheduler = scheduler(self.inner_optimizer)
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not \
                self.inner_optimizer:
            raise ValueError("the scheduler must drive the inner optimizer")
        #: The inner optimizer's learning-rate scheduler, stepped once per inner step.
        self.inner_scheduler = scheduler
        self._inner_steps_total = 0  # inner steps the schedule has seen
        self._samples = 0  # samples this peer processed toward the current outer epoch
        self._head_start = 0  # progress credited at a mid-epoch reload (the swarm's mean)
        self._ready_since: Optional[float] = None
        self._reported = False  # whether the tracker has this peer's progress
        # overlap_communication: the outer round in flight, the samples processed since it was
        # launched (the next epoch's), and the model's parameters at its launch (host copies,
        # reused from round to round).
        self._inflight: Optional[_InFlightRound] = None
        self._samples_since_launch = 0
        self._launch_params: Optional[List[torch.Tensor]] = None
        # torch.optim.Optimizer.__init__ is not called: param_groups and state are the inner
        # optimizer's. These keep torch's hooks (used by schedulers) working.
        self.defaults = dict(self.inner_optimizer.defaults)
        self._optimizer_step_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_step_post_hooks: Dict[int, Callable] = {}
        self._announce_epoch()

    # --- properties ------------------------------------------------------------------------

    @property
    def samples_per_epoch(self) -> int:
        """A peer's share of an outer epoch: ``batch_size * num_inner_steps`` samples."""
        return self.batch_size * self.num_inner_steps

    @property
    def local_epoch(self) -> int:
        """The outer epoch this peer is in (outer steps the swarm took before it)."""
        return self.state_averager.local_epoch

    @property
    def outer_optimizer(self) -> TorchOptimizer:
        """The outer optimizer (over :attr:`outer_parameters`)."""
        return self.state_averager.optimizer

    @property
    def outer_parameters(self) -> List[torch.Tensor]:
        """The parameters as of the start of this outer epoch (host float32, identical on
        every peer in the epoch)."""
        return self.state_averager._opt_parameters()

    @property
    def main_parameters(self) -> List[torch.Tensor]:
        """The model's parameters (the inner optimizer's)."""
        return list(self.state_averager.main_parameters)

    def is_alive(self) -> bool:
        """Whether the averagers run."""
        return self.state_averager.is_alive()

    # --- the step --------------------------------------------------------------------------

    def step(
        self,
        closure: Optional[Callable[[], torch.Tensor]] = None,
        batch_size: Optional[int] = None,
        scaler: Optional[Any] = None,
    ) -> Optional[torch.Tensor]:
        """One inner step on the gradients in ``.grad`` (``scaler``: a ``torch`` grad scaler
        stepping the inner optimizer; call its ``update()`` yourself), counted as
        ``batch_size`` samples (default: the one given at init); then, once this peer has
        processed its share of the epoch, the outer step with the swarm. A peer behind the swarm
        reloads the outer state instead (and takes no inner step: the gradients were computed on
        stale parameters). Returns ``closure()``'s loss, if given. Never raises because a round
        with peers failed."""
        if scaler is not None and closure is not None:
            raise ValueError("pass either a closure or a scaler, not both")
        batch_size = self.batch_size if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be a non-negative int, not {batch_size!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # With a round in flight, the swarm moving on is that round's business (_poll_inflight).
        if self._inflight is None and self._behind():
            logger.log(self.status_loglevel, "this peer is behind the swarm: loading its state")
            self.load_state_from_peers()
            return loss

        if scaler is not None:
            scaler.step(self.inner_optimizer)
        else:
            self.inner_optimizer.step()
        self._inner_steps_total += 1
        if self.inner_scheduler is not None:
            self.inner_scheduler.step()
        if self._inflight is None:
            self._samples += batch_size
        else:
            self._samples_since_launch += batch_size
            self._poll_inflight(block=False)
            if self._inflight is not None and \
                    self._samples_since_launch >= self.samples_per_epoch:
                # A whole epoch's inner steps and the round still runs: the compute waits.
                with self.tracker.performance_ema.pause():
                    self._poll_inflight(block=True)
        self._report_progress()
        if self._inflight is None and self._reported_samples() >= self.samples_per_epoch:
            self._outer_step()
        return loss

    def _reported_samples(self) -> int:
        return self._head_start + self._samples

    def _report_progress(self) -> None:
        self.tracker.report_local_progress(self.local_epoch, self._reported_samples())
        self._reported = True

    def _behind(self) -> bool:
        return self.tracker.global_epoch > self.local_epoch

    def _outer_step(self) -> None:
        """The end of this peer's outer epoch: wait for the swarm (``WAIT_FOR_ALL``), average
        the pseudo-gradients (retrying), step the outer optimizer. Never raises because a round
        failed."""
        # Waiting is not this peer's throughput (the others bound its samples by its rate).
        with self.tracker.performance_ema.pause():
            self._outer_step_unmeasured()

    def _outer_step_unmeasured(self) -> None:
        began = time.perf_counter()
        waits = self.all_reduce_strategy is AllReduceStrategy.WAIT_FOR_ALL
        if waits and not self._wait_for_peers():
            return  # it reloaded the state
        deadline = time.monotonic() + self.averaging_timeout
        while True:
            if self._behind():
                logger.log(self.status_loglevel, "the swarm ended this epoch without this peer")
                self.load_state_from_peers()
                return
            if self.tracker.global_progress.num_peers <= 1:
                logger.log(self.status_loglevel, "no other peers: own pseudo-gradient")
                self._load_pseudo_gradient_into_averager_()
                self._apply_outer_step(group_size=1, began=began)
                return
            if self.overlap_communication:
                self._launch_outer_round(began, deadline)
                return
            try:
                group_size = self._average_pseudo_gradient()
            except ShutdownError:
                logger.log(self.status_loglevel, "the averager is shut down: no outer step")
                return
            if group_size is not None:
                self._apply_outer_step(group_size=group_size, began=began)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning(f"no outer round for epoch {self.local_epoch} within "
                               f"{self.averaging_timeout} s: retrying at the next step")
                return
            # Until the tracker's next fetch, which says whether the others moved on.
            fetch = self.tracker.global_progress.next_fetch_time - get_dht_time()
            time.sleep(min(max(fetch, 0.0), 0.2, left))

    def _wait_for_peers(self) -> bool:
        """Waits until every peer of the swarm has processed its share of the epoch (or
        ``timeout_waiting_for_peers`` passes); ``False`` if it reloaded the state instead."""
        if self._ready_since is None:
            self._ready_since = time.monotonic()
        fresh = False
        while True:
            if self._behind():
                self.load_state_from_peers()
                return False
            g = self.tracker.global_progress
            if g.num_peers <= 1 and not fresh:
                # Alone, or the others have not been seen yet: a fetch made from now on says.
                fresh = True
                fetched = self.tracker.fetched_global_progress_this_epoch
                fetched.clear()
                fetched.wait(2 * self.tracker.max_refresh_period + 1.0)
                continue
            if g.num_peers <= 1 or (
                g.epoch == self.local_epoch
                and g.samples_accumulated >= g.num_peers * self.samples_per_epoch
            ):
                return True
            waited = time.monotonic() - self._ready_since
            if waited >= self.timeout_waiting_for_peers:
                logger.log(self.status_loglevel, f"waited {waited:.1f} s for the slowest peers: "
                           "averaging with those that are ready")
                return True
            # Until the tracker's next fetch (it tightens as the epoch's end nears).
            pause = g.next_fetch_time - get_dht_time()
            time.sleep(min(max(pause, 0.01), 0.5, self.timeout_waiting_for_peers - waited))

    def _average_pseudo_gradient(self) -> Optional[int]:
        """One round over the pseudo-gradients; the group size, or ``None`` if it failed or
        formed no group (the averaged tensors may then hold anything: they are reloaded before
        every try)."""
        weight = min(1.0, self._samples / self.samples_per_epoch)
        self._load_pseudo_gradient_into_averager_()
        epoch = self.local_epoch
        try:
            control = self._start_round(epoch, weight)
            while True:
                try:
                    gathered = control.result(0.1)
                    break
                except concurrent.futures.TimeoutError:
                    pass
                # Until a group forms: a peer that missed the others' group stops looking as
                # soon as the tracker shows them past this epoch (it reloads instead).
                if not control.began_allreduce and self._behind():
                    control.cancel()
                    logger.log(self.status_loglevel, f"the swarm ended epoch {epoch} without "
                               "this peer: no more looking for a group")
                    return None
        except Exception as e:  # noqa: BLE001 - never out of step()
            logger.log(self.status_loglevel, f"the outer round of epoch {epoch} failed: {e!r}")
            return None
        return self._group_size(gathered, epoch)

    def _start_round(self, epoch: int, weight: float) -> Any:
        """Starts the pseudo-gradient round of ``epoch`` over the averaged tensors as they
        are; its step control."""
        # The round's group key carries the epoch: a late retry never meets the next one.
        self.grad_averager.set_group_bits(format(epoch % 256, "08b"))
        return self.grad_averager.step(gather=epoch, weight=weight,
                                       timeout=self.averaging_timeout, wait=False)

    def _group_size(self, gathered: Optional[dict], epoch: int) -> Optional[int]:
        """A finished round's group size, or ``None`` if it formed no group or met peers of
        another epoch."""
        if not gathered:
            logger.log(self.status_loglevel, f"no group for the outer round of epoch {epoch}")
            return None
        if set(gathered.values()) != {epoch}:
            logger.warning(f"the outer round of epoch {epoch} met epochs "
                           f"{sorted(set(map(str, gathered.values())))}: discarded")
            return None
        return len(gathered)

    @torch.no_grad()
    def _load_pseudo_gradient_into_averager_(
            self, params: Optional[Sequence[torch.Tensor]] = None) -> None:
        """``outer_params - params`` into the averaged tensors (``params``: the model's
        parameters unless given, e.g. those saved when an overlapped round was launched)."""
        if params is None:
            params = self.state_averager.main_parameters
        with self.grad_averager.get_tensors() as buffers:
            for outer, p, buf in zip(self.outer_parameters, params, buffers):
                torch.sub(outer, p.detach().to(device=outer.device, dtype=outer.dtype), out=buf)

    @torch.no_grad()
    def _apply_outer_step(self, group_size: int, began: float,
                          launched: Optional[List[torch.Tensor]] = None) -> None:
        """The outer optimizer's step on the averaged pseudo-gradient; the model then starts
        the next epoch from the new outer parameters, or, for a round launched from the
        parameters ``launched`` (``overlap_communication``), from the new outer parameters
        plus the progress made since the launch (whose samples count toward the new epoch)."""
        with self.state_averager.lock_optimizer, self.grad_averager.get_tensors():
            self.outer_optimizer.step()
            self.state_averager.local_epoch += 1
        if (self.average_state_every and group_size > 1
                and self.local_epoch % self.average_state_every == 0):
            self._average_outer_state()
        if launched is None:
            self._set_main_parameters_to_outer_()
            self._samples = 0
        else:
            self._move_main_parameters_by_outer_step_(launched)
            self._samples = self._samples_since_launch
        self._samples_since_launch, self._head_start, self._ready_since = 0, 0, None
        with self.tracker.pause_updates():
            self.tracker.update_epoch(new_epoch=self.local_epoch)
        self._announce_epoch()
        seconds = time.perf_counter() - began
        self.last_outer_step = dict(epoch=self.local_epoch, group_size=group_size, seconds=seconds)
        logger.log(self.status_loglevel, f"outer step to epoch {self.local_epoch} with "
                   f"{group_size} peer(s) in {seconds:.2f} s")

    # --- overlap_communication --------------------------------------------------------------

    def _launch_outer_round(self, began: float, deadline: float) -> None:
        """Starts this epoch's round over the pseudo-gradient and returns at once: the inner
        steps go on from the current parameters while it runs (:meth:`_poll_inflight`)."""
        weight = min(1.0, self._samples / self.samples_per_epoch)
        mains = self.state_averager.main_parameters
        with torch.no_grad():
            if self._launch_params is None:
                self._launch_params = [
                    torch.empty_like(outer) for outer in self.outer_parameters]
            for saved, main in zip(self._launch_params, mains):
                saved.copy_(main.detach())
        self._load_pseudo_gradient_into_averager_()
        self._submit_inflight(_InFlightRound(
            epoch=self.local_epoch, weight=weight, began=began, deadline=deadline))

    def _submit_inflight(self, round_: "_InFlightRound") -> None:
        """Starts ``round_``'s all-reduce over the averaged tensors (already loaded)."""
        try:
            round_.control = self._start_round(round_.epoch, round_.weight)
        except ShutdownError:
            logger.log(self.status_loglevel, "the averager is shut down: no outer step")
            return
        except Exception as e:  # noqa: BLE001 - never out of step()
            logger.log(self.status_loglevel,
                       f"the outer round of epoch {round_.epoch} did not start: {e!r}")
            self._round_failed(round_)
            return
        self._inflight = round_

    def _poll_inflight(self, block: bool) -> None:
        """Takes the round in flight's outcome if it has one (waits for it if ``block``): on
        success the outer step, on failure a retry with the same pseudo-gradient while its
        ``averaging_timeout`` lasts, or a reload if the swarm moved on without this peer."""
        round_ = self._inflight
        while not round_.control.done():
            # Still looking for a group while the others are past the epoch: they formed theirs
            # without this peer.
            if not round_.control.began_allreduce and self._behind():
                round_.control.cancel()
                self._drop_inflight()
                logger.log(self.status_loglevel, f"the swarm ended epoch {round_.epoch} "
                           "without this peer: loading its state")
                self.load_state_from_peers()
                return
            if not block:
                return
            try:
                round_.control.result(0.1)
            except concurrent.futures.TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - taken below
                break
        self._inflight = None
        try:
            # Finished (done() said so): the result is there, no wait.
            group_size = self._group_size(round_.control.result(), round_.epoch)
        except Exception as e:  # noqa: BLE001 - never out of step()
            logger.log(self.status_loglevel,
                       f"the outer round of epoch {round_.epoch} failed: {e!r}")
            group_size = None
        if group_size is not None:
            self._apply_outer_step(group_size, round_.began, launched=self._launch_params)
            return
        self._round_failed(round_)

    def _round_failed(self, round_: "_InFlightRound") -> None:
        """A launched round that failed: retried with the same pseudo-gradient until its
        deadline; after it, the outer step is skipped and the next call starts a round over
        a pseudo-gradient that spans the inner steps since (as without overlap)."""
        if self._behind():
            logger.log(self.status_loglevel, f"the swarm ended epoch {round_.epoch} without "
                       "this peer: loading its state")
            self._drop_inflight()
            self.load_state_from_peers()
            return
        if time.monotonic() < round_.deadline:
            with torch.no_grad():
                self._load_pseudo_gradient_into_averager_(self._launch_params)
            self._submit_inflight(round_)
            return
        logger.warning(f"no outer round for epoch {round_.epoch} within "
                       f"{self.averaging_timeout} s: retrying at the next step")
        self._samples += self._samples_since_launch
        self._samples_since_launch = 0

    def _drop_inflight(self) -> None:
        """Forgets the round in flight (cancelled if still running) and its progress."""
        round_, self._inflight = getattr(self, "_inflight", None), None
        if round_ is not None and round_.control is not None:
            round_.control.cancel()
        self._samples_since_launch = 0

    @torch.no_grad()
    def _move_main_parameters_by_outer_step_(self, launched: List[torch.Tensor]) -> None:
        """The model to the new outer parameters plus its progress since ``launched``."""
        for main, outer, saved in zip(self.state_averager.main_parameters,
                                      self.outer_parameters, launched):
            main.add_((outer - saved).to(device=main.device, dtype=main.dtype))

    def _average_outer_state(self) -> None:
        """A lossless round over the outer parameters and ``average_opt_statistics``: the
        peers in it leave with identical outer state again (a lossy codec's pseudo-gradient
        rounds leave each peer its own compression error). A failed round changes nothing."""
        epoch = self.local_epoch
        try:
            self.state_averager.set_group_bits(format(epoch % 256, "08b"))
            gathered = self.state_averager.step(
                averaging_round=True, averaging_opts=dict(timeout=self.averaging_timeout))
        except Exception as e:  # noqa: BLE001 - never out of step()
            logger.log(self.status_loglevel, f"averaging the outer state failed: {e!r}")
            return
        logger.log(self.status_loglevel,
                   f"averaged the outer state of epoch {epoch} with {len(gathered or {})} peers")

    @torch.no_grad()
    def _set_main_parameters_to_outer_(self) -> None:
        for main, outer in zip(self.state_averager.main_parameters, self.outer_parameters):
            main.copy_(outer)

    # Newcomers ask the peer with the newest epoch first (never raises out of step()).
    _announce_epoch = Optimizer._announce_epoch

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Downloads the swarm's outer state (outer parameters, outer optimizer state, epoch),
        puts the model's parameters at the outer parameters and joins the swarm's epoch,
        retrying until a state is loaded or ``load_state_timeout`` passes. The inner optimizer
        keeps its own state; the inner schedule catches up with the epoch."""
        self._drop_inflight()
        with self.tracker.pause_updates():
            self.state_averager.load_state_retrying(
                self.load_state_timeout, lambda: self.tracker.global_progress.num_peers, **kwargs)
            # The model starts from the outer parameters (loaded, or this peer's own if no
            # state came: its inner steps since are dropped either way).
            self._set_main_parameters_to_outer_()
            self._samples, self._ready_since = 0, None
            # Start where the swarm's mean peer is, to reach the outer step with it: the
            # samples toward the loaded epoch are the others' (this peer was behind it), and
            # the peers counted include this one once it has reported.
            g = self.tracker.global_progress
            others = g.num_peers - (1 if self._reported else 0)
            self._head_start = 0
            if g.epoch == self.local_epoch and others > 0:
                self._head_start = min(g.samples_accumulated // others, self.samples_per_epoch)
            if self.local_epoch != self.tracker.local_progress.epoch:
                self.tracker.update_epoch(new_epoch=self.local_epoch)
        self._report_progress()
        self._catch_up_inner_schedule()
        self._announce_epoch()

    def _catch_up_inner_schedule(self) -> None:
        """Steps the inner scheduler up to the epoch's first inner step, if it is behind."""
        if self.inner_scheduler is None:
            return
        target = self.local_epoch * self.num_inner_steps
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            while self._inner_steps_total < target:
                self.inner_scheduler.step()
                self._inner_steps_total += 1

    # --- torch.optim.Optimizer's interface --------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the model's gradients (the inner optimizer's ``zero_grad``)."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> List[dict]:
        """The inner optimizer's param groups (the model's parameters)."""
        return self.inner_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise ValueError("set the inner optimizer's param groups (opt.inner_optimizer)")

    @property
    def state(self) -> dict:
        """The inner optimizer's state."""
        return self.inner_optimizer.state

    def add_param_group(self, param_group: dict) -> None:
        """Not supported: give every param group at init."""
        raise ValueError("DiLoCoOptimizer takes its param groups at init only")

    def state_dict(self) -> dict:
        """Both optimizers' state dicts (OpenDiLoCo's keys, the epoch in the outer one's
        ``state``), and the outer parameters."""
        outer = self.outer_optimizer.state_dict()
        outer["state"]["local_epoch"] = self.local_epoch
        return dict(state_dict_outer=outer, state_dict_inner=self.inner_optimizer.state_dict(),
                    outer_params=[p.detach().clone() for p in self.outer_parameters],
                    inner_steps=self._inner_steps_total)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a :meth:`state_dict` (the model's own parameters are the caller's to load)."""
        self._drop_inflight()
        outer = state_dict["state_dict_outer"]
        outer = dict(outer, state=dict(outer["state"]))
        epoch = outer["state"].pop("local_epoch", None)
        with self.state_averager.lock_optimizer:
            self.outer_optimizer.load_state_dict(outer)
            for p, q in zip(self.outer_parameters, state_dict.get("outer_params", ())):
                p.copy_(q)
            if epoch is not None:
                self.state_averager.local_epoch = int(epoch)
        self.inner_optimizer.load_state_dict(state_dict["state_dict_inner"])
        self._inner_steps_total = int(state_dict.get("inner_steps", self._inner_steps_total))
        with self.tracker.pause_updates():
            self.tracker.update_epoch(new_epoch=self.local_epoch)
        self._samples, self._head_start = 0, 0
        self._announce_epoch()

    __repr__ = Optimizer.__repr__

    def shutdown(self) -> None:
        """Leaves the swarm: withdraws this peer's progress, stops the averagers. Idempotent."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self._drop_inflight()
        self.tracker.shutdown(self.shutdown_timeout)
        self.grad_averager.shutdown()
        self.state_averager.shutdown()

    __del__ = Optimizer.__del__  # shuts down in the process that made it
