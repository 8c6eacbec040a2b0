"""``hivemesh.Optimizer``: hivemind 1.1.12's ``Optimizer`` over hivemesh, so that a training
script written for ``hivemind.Optimizer`` runs by changing its import.

It wraps a PyTorch optimizer for training together with whoever uses the same ``run_id``.
The swarm counts epochs: an epoch ends when the peers together have processed
``target_batch_size`` samples (the :class:`ProgressTracker` follows everyone's progress through
the DHT). Each call to :meth:`Optimizer.step` reports this peer's samples; at the end of an
epoch:

* ``use_local_updates=False`` (the default, equivalent to synchronous training with batch
  ``target_batch_size``): the peers average the gradients they accumulated over the epoch,
  weighted by samples (:class:`GradientAverager`), and every peer runs one optimizer step with
  the averaged gradients;
* ``use_local_updates=True``: every call runs a local optimizer step, and at the end of an
  epoch the peers average their parameters (:class:`TrainingStateAverager`).

Either way the learning-rate scheduler follows the epoch, every ``average_state_every`` epochs
the parameters (and ``average_opt_statistics``, ``extra_tensors``) are averaged, and a peer
that falls behind the swarm downloads the state from a peer that is up to date and goes on
from there. A lone peer proceeds with its own gradients. An averaging round that fails never
raises out of :meth:`Optimizer.step`: it is logged and the peer goes on with its local values.

Matchmaking for the gradient round starts ahead of the epoch's end (when the tracker's ETA is
within ``matchmaking_time``), so that the all-reduce begins as soon as the epoch ends. A peer
that has to drop out of a round it already joined (it must reload its state) stays in it with
weight 0, so the group is not kept waiting.
"""

from __future__ import annotations

import logging
import math
import os
import time
from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch

from hivemesh import _hivemesh
from hivemesh.averaging.control import AveragingStage, StepControl
from hivemesh.compression import CompressionBase, NoCompression
from hivemesh.dht import DHT
from hivemesh.optim.grad_averager import GradientAverager
from hivemesh.optim.grad_scaler import GradScaler
from hivemesh.optim.progress_bar import EpochProgressBar, ProgressSnapshot
from hivemesh.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemesh.optim.state_averager import (
    LRSchedulerBase,
    OptimizerFactory,
    Parameters,
    ParamGroups,
    SchedulerFactory,
    TorchOptimizer,
    TrainingStateAverager,
)
from hivemesh.utils import PerformanceEMA, get_dht_time, get_logger

__all__ = ["Optimizer"]

logger = get_logger(__name__)


class Optimizer(torch.optim.Optimizer):
    """Trains collaboratively with every peer of ``run_id``; see the module docs.

    hivemind's arguments and meanings: ``dht``, ``run_id``, ``target_batch_size`` (samples per
    epoch, swarm-wide), ``batch_size_per_step`` (samples per call to :meth:`step`),
    ``optimizer`` (a torch optimizer, or a callable making one from ``params``), ``params``,
    ``scheduler`` (a scheduler, or a callable making one from the optimizer; stepped once per
    epoch), ``matchmaking_time``, ``averaging_timeout``, ``allreduce_timeout``,
    ``next_chunk_timeout``, ``load_state_timeout``, ``reuse_grad_buffers``,
    ``offload_optimizer``, ``delay_optimizer_step``, ``delay_grad_averaging``,
    ``delay_state_averaging``, ``average_state_every``, ``use_local_updates``,
    ``client_mode``, ``auxiliary``, ``grad_compression``, ``state_averaging_compression``,
    ``load_state_compression``, ``average_opt_statistics``, ``extra_tensors``,
    ``averager_opts`` (more arguments for both averagers, e.g. ``target_group_size``),
    ``tracker_opts`` (for the :class:`ProgressTracker`), ``performance_ema_alpha``,
    ``shutdown_timeout``, ``verbose`` (log every epoch: the swarm's samples per second, its
    peers, the last round's group size and time; on a terminal, also a progress bar of the
    current epoch on standard error, :mod:`hivemesh.optim.progress_bar`).

    hivemesh's own: ``progress_bar`` (``None``: with ``verbose``, where standard error is a
    terminal; ``True``/``False``: always/never).
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: Optional[int] = None,
        optimizer: Union[TorchOptimizer, OptimizerFactory],
        params: Optional[Union[Parameters, ParamGroups]] = None,
        scheduler: Optional[Union[LRSchedulerBase, SchedulerFactory]] = None,
        matchmaking_time: Optional[float] = 15.0,
        averaging_timeout: Optional[float] = 60.0,
        allreduce_timeout: Optional[float] = None,
        next_chunk_timeout: Optional[float] = None,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        offload_optimizer: Optional[bool] = None,
        delay_optimizer_step: Optional[bool] = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: Optional[bool] = None,
        auxiliary: bool = False,
        grad_compression: CompressionBase = NoCompression(),
        state_averaging_compression: CompressionBase = NoCompression(),
        load_state_compression: CompressionBase = NoCompression(),
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: Optional[dict] = None,
        tracker_opts: Optional[dict] = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5,
        verbose: bool = False,
        progress_bar: Optional[bool] = None,
    ):
        self._parent_pid = os.getpid()
        if not isinstance(dht, DHT):
            raise TypeError(f"dht must be a hivemesh.DHT, not {type(dht).__name__}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty str")
        if not target_batch_size > 0:
            raise ValueError(f"target_batch_size must be positive, not {target_batch_size!r}")
        if average_state_every < 1:
            raise ValueError(f"average_state_every must be at least 1, not {average_state_every}")
        if client_mode is None:
            client_mode = dht.client_mode
        if delay_optimizer_step is None:
            delay_optimizer_step = delay_grad_averaging
        if offload_optimizer is None:
            offload_optimizer = params is not None
        if allreduce_timeout is None:
            allreduce_timeout = averaging_timeout
        if next_chunk_timeout is None:
            next_chunk_timeout = matchmaking_time
        if delay_grad_averaging and not delay_optimizer_step:
            raise ValueError("delay_grad_averaging requires delay_optimizer_step")
        if client_mode and auxiliary:
            raise ValueError("a client-mode peer cannot be auxiliary")
        if auxiliary and batch_size_per_step is not None:
            raise ValueError("an auxiliary peer accumulates no batches: leave batch_size_per_step")
        if callable(optimizer) and params is not None:
            if scheduler is not None and (
                not callable(scheduler) or isinstance(scheduler, LRSchedulerBase)
            ):
                raise ValueError("with optimizer=callable(params), pass scheduler=callable(opt)")
        elif all(hasattr(optimizer, a) for a in ("param_groups", "step", "zero_grad")):
            if offload_optimizer or delay_optimizer_step or delay_grad_averaging:
                raise ValueError(
                    "offload_optimizer and delayed updates need "
                    "Optimizer(..., params=params, optimizer=lambda params: make_opt(params))"
                )
        else:
            raise ValueError(
                "pass either params=... with optimizer=callable(params), or optimizer=an "
                "already made torch optimizer"
            )
        if delay_optimizer_step and not offload_optimizer:
            raise ValueError("delay_optimizer_step needs offload_optimizer")
        if use_local_updates and reuse_grad_buffers:
            raise ValueError("use_local_updates accumulates no gradients: no reuse_grad_buffers")
        if use_local_updates and delay_grad_averaging:
            raise ValueError("use_local_updates averages no gradients: no delay_grad_averaging")

        self.dht, self.run_id = dht, run_id
        self.client_mode, self.auxiliary = bool(client_mode), auxiliary
        self.batch_size_per_step, self.target_batch_size = batch_size_per_step, target_batch_size
        self.delay_state_averaging, self.average_state_every = delay_state_averaging, average_state_every
        self.matchmaking_time, self.offload_optimizer = matchmaking_time, offload_optimizer
        self.delay_grad_averaging, self.delay_optimizer_step = delay_grad_averaging, delay_optimizer_step
        self.averaging_timeout, self.allreduce_timeout = averaging_timeout, allreduce_timeout
        self.load_state_timeout, self.shutdown_timeout = load_state_timeout, shutdown_timeout
        self.next_chunk_timeout = next_chunk_timeout
        self.verbose = verbose
        #: The epoch's progress bar (drawn from :meth:`step`).
        self.progress_bar = EpochProgressBar(
            enabled=progress_bar if progress_bar is not None else (None if verbose else False))
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        self.scheduled_grads: Optional[StepControl] = None
        self.scheduled_state: Optional[StepControl] = None
        #: The last gradient round: group size and seconds (``None`` before the first).
        self.last_round: Optional[Dict[str, Any]] = None
        self._round_started = time.perf_counter()
        self._epoch_began = time.monotonic()
        # Gradient rounds with a group that finished / failed, and the metrics record for
        # monitors (started by the first report_metrics call).
        self._rounds_ok = self._rounds_failed = 0
        self._metrics: Optional[Any] = None

        self.tracker = ProgressTracker(
            dht, f"{run_id}_progress", target_batch_size, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, start=True,
            performance_ema_alpha=performance_ema_alpha, **(tracker_opts or {}),
        )
        averager_common = dict(
            min_matchmaking_time=matchmaking_time, allreduce_timeout=allreduce_timeout,
            shutdown_timeout=shutdown_timeout, next_chunk_timeout=next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=auxiliary, start=True,
        )
        self.state_averager = TrainingStateAverager(
            dht=dht, prefix=f"{run_id}_state_averager", optimizer=optimizer, params=params,
            scheduler=scheduler, offload_optimizer=offload_optimizer,
            # The gradient round fills the offloaded optimizer's gradients; local updates use
            # the model's own, copied in before each step.
            custom_gradients=offload_optimizer and not use_local_updates,
            status_loglevel=self.status_loglevel,
            delta_rule_averaging=use_local_updates and delay_state_averaging,
            compression=state_averaging_compression, state_compression=load_state_compression,
            average_opt_statistics=average_opt_statistics,
            performance_ema_alpha=performance_ema_alpha, extra_tensors=extra_tensors,
            **averager_common, **(averager_opts or {}),
        )
        self.grad_averager: Optional[GradientAverager] = None
        if not use_local_updates:
            self.grad_averager = GradientAverager(
                self.state_averager.main_parameters, dht=dht, prefix=f"{run_id}_grad_averager",
                reuse_grad_buffers=reuse_grad_buffers, compression=grad_compression,
                allow_state_sharing=False, **averager_common, **(averager_opts or {}),
            )
            if offload_optimizer:
                # The offloaded optimizer reads the averaged gradients directly.
                opt_params = self.state_averager._opt_parameters()
                with self.grad_averager.get_tensors() as averaged:
                    for p, g in zip(opt_params, averaged):
                        p.grad = g
        self._check_sync_on_update = True
        self._schema = self._schema_hash()
        # Seconds from the start of an epoch's update to the state round: pre-scheduling.
        self.delay_before_state_averaging = PerformanceEMA(alpha=performance_ema_alpha)
        # torch's GradScaler looks for this to know the optimizer unscales itself.
        self._step_supports_amp_scaling = reuse_grad_buffers
        # torch.optim.Optimizer.__init__ is not called: param_groups and state are properties
        # over the wrapped optimizer. These keep torch's hooks (used by schedulers) working.
        self.defaults = dict(self.state_averager.optimizer.defaults)
        self._optimizer_step_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_step_post_hooks: Dict[int, Callable] = {}

    # --- properties ------------------------------------------------------------------------

    def _schema_hash(self) -> int:
        params = self.state_averager._opt_parameters()
        grads = tuple(id(p.grad) for p in params) if self.offload_optimizer else None
        return hash((grads, tuple(tuple(p.shape) for p in params)))

    def is_alive(self) -> bool:
        """Whether the optimizer's averagers run."""
        return self.state_averager.is_alive()

    @property
    def local_epoch(self) -> int:
        """This peer's epoch, kept in step with the swarm (reloaded when it falls behind)."""
        return self.state_averager.local_epoch

    @property
    def local_progress(self) -> LocalTrainingProgress:
        """This peer's progress as the swarm sees it."""
        return self.tracker.local_progress

    @property
    def use_local_updates(self) -> bool:
        """Whether every step updates the parameters locally."""
        return self.grad_averager is None

    @property
    def use_gradient_averaging(self) -> bool:
        """Whether gradients are averaged at the end of each epoch."""
        return self.grad_averager is not None

    # --- the step --------------------------------------------------------------------------

    def step(
        self,
        closure: Optional[Callable[[], torch.Tensor]] = None,
        batch_size: Optional[int] = None,
        grad_scaler: Optional[GradScaler] = None,
    ) -> Optional[torch.Tensor]:
        """Reports ``batch_size`` more samples (default ``batch_size_per_step``) whose
        gradients are in the parameters' ``.grad``, and does what the epoch needs: accumulates
        them, updates the parameters (locally, or with the swarm's averaged gradients once the
        epoch ends), averages the state, or reloads it when this peer fell behind. Returns
        ``closure()``'s loss, if given. Never raises because a round with peers failed."""
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise ValueError("use hivemesh.GradScaler with hivemesh.Optimizer")
        if self.batch_size_per_step is None and batch_size is None and not self.auxiliary:
            raise ValueError("set batch_size_per_step at init, or pass batch_size to step()")
        if self.auxiliary and (closure is not None or batch_size is not None or grad_scaler):
            raise ValueError("an auxiliary peer takes no batches, closures or grad scalers")
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step

        # Results of background work that finished since the last call.
        self.state_averager.step(apply_delayed_updates=True)

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        if not self.auxiliary and self._should_load_state_from_peers():
            logger.log(self.status_loglevel, "this peer is behind the swarm: loading its state")
            self.load_state_from_peers()
            return loss  # the gradients were computed on stale parameters

        if self.use_gradient_averaging:
            if not self.auxiliary and not self._accumulate(batch_size, grad_scaler):
                return loss
            self._maybe_schedule_gradient_averaging()
            self._maybe_schedule_state_averaging()
        elif not self.auxiliary:
            if grad_scaler is not None:
                with grad_scaler.running_global_step():
                    if not grad_scaler.unscale_(self):
                        logger.log(self.status_loglevel, "non-finite fp16 gradients: step skipped")
                        return loss
            samples = self.tracker.local_progress.samples_accumulated + batch_size
            self.tracker.report_local_progress(self.local_epoch, samples)
            self._maybe_schedule_state_averaging()
            self.state_averager.step(
                increment_epoch=False, optimizer_step=True,
                delay_optimizer_step=self.delay_optimizer_step, grad_scaler=grad_scaler,
            )

        if self.tracker.ready_to_update_epoch:
            self._update_global_epoch(grad_scaler)
        self._draw_progress()
        return loss

    def _draw_progress(self, force: bool = False) -> None:
        """Redraws the progress bar (when it is on and due)."""
        bar = self.progress_bar
        if not bar.active() or not (force or bar.due()):
            return
        g = self.tracker.global_progress
        now = get_dht_time()
        elapsed = time.monotonic() - self._epoch_began
        rnd = self.last_round or {}
        bar.update(ProgressSnapshot(
            epoch=self.local_epoch, samples=g.samples_accumulated, target=self.target_batch_size,
            peers=g.num_peers, clients=g.num_clients,
            samples_per_second=g.samples_accumulated / elapsed if elapsed > 0 else 0.0,
            eta_seconds=g.eta_next_epoch - now,
            round_peers=rnd.get("group_size"), round_seconds=rnd.get("seconds"),
        ), force=force)

    def _accumulate(self, batch_size: int, grad_scaler: Optional[GradScaler]) -> bool:
        """Adds this batch's gradients; ``False`` (and local progress reset) on inf/NaN."""
        assert self.grad_averager is not None
        if grad_scaler is not None and not grad_scaler.are_grads_finite(self):
            logger.log(self.status_loglevel, "non-finite fp16 gradients: resetting the local ones")
            self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
            self.grad_averager.reset_accumulated_grads_()
            return False
        self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(
            self.local_epoch, self.grad_averager.local_samples_accumulated
        )
        return True

    def _update_global_epoch(self, grad_scaler: Optional[GradScaler]) -> None:
        """The end of an epoch: average gradients and/or state, step the optimizer."""
        if self._schema != self._schema_hash():
            raise RuntimeError("the parameters or their gradient buffers changed during training")
        started = time.perf_counter()
        with self.tracker.pause_updates():
            wait_for_trigger = None
            if self.use_gradient_averaging:
                logger.log(self.status_loglevel, f"beginning optimizer step #{self.local_epoch}")
                if self.delay_optimizer_step:
                    self.state_averager.step(wait_for_delayed_updates=True)
                began = self._begin_averaging_gradients(grad_scaler)
                if not began:
                    pass  # no round (a lone peer, or it could not start): local gradients
                elif self.delay_grad_averaging:
                    wait_for_trigger = partial(self._average_gradients_and_load_into_optimizer,
                                               self.scheduled_grads)
                else:
                    self._average_gradients_and_load_into_optimizer(self.scheduled_grads)
                if not began and not self.auxiliary:
                    self._average_gradients_and_load_into_optimizer(None)

            next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
            swarm_not_empty = self.tracker.global_progress.num_peers > 1
            do_optimizer_step = not self.auxiliary and not self.use_local_updates
            average_state = (
                swarm_not_empty
                and next_epoch % self.average_state_every == 0
                and not self.state_averager.averaging_in_progress
            )
            if average_state and self.scheduled_state is not None:
                if self.scheduled_state.triggered or self.scheduled_state.done():
                    self.scheduled_state = None
                self.delay_before_state_averaging.update(1, interval=time.perf_counter() - started)

            self.state_averager.step(
                increment_epoch=True,
                wait_for_trigger=wait_for_trigger,
                optimizer_step=do_optimizer_step,
                delay_optimizer_step=self.delay_optimizer_step and do_optimizer_step,
                grad_scaler=grad_scaler,
                averaging_round=average_state,
                delay_averaging=self.delay_state_averaging and not self.auxiliary,
                averaging_control=self.scheduled_state if average_state else None,
                averaging_opts=dict(timeout=self.averaging_timeout) if average_state else None,
            )
            if not average_state and self.scheduled_state is not None:
                if not self.scheduled_state.done():
                    self.scheduled_state.cancel()
            self.scheduled_state = None

            self.tracker.update_epoch(new_epoch=self.state_averager.local_epoch)
            self._check_sync_on_update = True
            self._announce_epoch()
            if self.use_gradient_averaging and not self.auxiliary:
                self.grad_averager.reset_accumulated_grads_()
        self._log_epoch()

    def _announce_epoch(self) -> None:
        """Newcomers ask the peer with the newest epoch first; a node that cannot say so
        now (its event loop busy or gone) says it at the next epoch."""
        if self.client_mode:
            return
        try:
            self.state_averager.state_sharing_priority = self.local_epoch
        except Exception as e:  # noqa: BLE001 - never out of step()
            logger.log(self.status_loglevel, f"could not announce epoch {self.local_epoch}: {e!r}")

    def _log_epoch(self) -> None:
        """With ``verbose``: one line per epoch, the swarm's pace measured as the epoch's
        samples over the time since the last epoch began."""
        now = time.monotonic()
        seconds, self._epoch_began = now - self._epoch_began, now
        if not self.verbose:
            self._draw_progress(force=True)
            return
        g = self.tracker.global_progress
        rnd = self.last_round
        averaged = (f", averaged gradients with {rnd['group_size']} peers in "
                    f"{rnd['seconds']:.2f} s" if rnd and rnd.get("group_size", 1) > 1 else "")
        logger.info(
            f"epoch {self.local_epoch} | swarm: {self.target_batch_size / max(seconds, 1e-9):.1f} "
            f"samples/s, {g.num_peers} peers ({g.num_clients} clients) | this peer: "
            f"{self.tracker.performance_ema.samples_per_second:.1f} samples/s{averaged}"
        )
        self._draw_progress(force=True)

    def _begin_averaging_gradients(self, grad_scaler: Optional[GradScaler]) -> bool:
        """Starts the gradient round (in the pre-scheduled group if there is one); whether
        it started."""
        assert self.grad_averager is not None
        self.grad_averager.grad_scale_inverse = (
            1.0 if grad_scaler is None else grad_scaler.inverse_scale())
        began = False
        if self.scheduled_grads is not None and (
            self.scheduled_grads.triggered or self.scheduled_grads.done()
        ):
            self.scheduled_grads = None
        if self.tracker.global_progress.num_peers > 1 and not self.auxiliary:
            try:
                self._round_started = time.perf_counter()
                self.scheduled_grads = self.grad_averager.step(
                    control=self.scheduled_grads, reset_accumulators=True, wait=False,
                    **({} if self.scheduled_grads is not None else
                       dict(timeout=self.averaging_timeout)),
                )
                began = True
            except BaseException as e:  # noqa: BLE001 - never out of step()
                logger.log(self.status_loglevel, f"could not start averaging gradients: {e!r}")
        elif self.auxiliary and self.tracker.global_progress.num_peers > 1:
            try:
                control = self.scheduled_grads or self.grad_averager.schedule_step(
                    timeout=self.averaging_timeout)
                control.weight = 0.0
                control.allow_allreduce()
                self.scheduled_grads = control
                self._wait_quietly(control)
            except BaseException as e:  # noqa: BLE001 - never out of step()
                logger.log(self.status_loglevel, f"auxiliary round failed: {e!r}")
            self.scheduled_grads = None
            return False
        if not began and self.scheduled_grads is not None and not self.scheduled_grads.done():
            if self.tracker.global_progress.num_peers > 1:
                self._tag_along_with_zero_weight(self.scheduled_grads)
            else:
                self.scheduled_grads.cancel()
            self.scheduled_grads = None
        return began

    def _maybe_schedule_gradient_averaging(self) -> None:
        """Starts matchmaking for the gradient round when the epoch's end is near."""
        assert self.grad_averager is not None
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if eta <= self.matchmaking_time:
            if self.scheduled_grads is None or self.scheduled_grads.triggered or self.scheduled_grads.done():
                logger.log(self.status_loglevel,
                           f"pre-scheduling the gradient round in {max(eta, 0):.2f} s")
                try:
                    self.scheduled_grads = self.grad_averager.schedule_step(
                        timeout=self.averaging_timeout)
                except BaseException as e:  # noqa: BLE001 - never out of step()
                    logger.log(self.status_loglevel, f"could not pre-schedule: {e!r}")
                    self.scheduled_grads = None

    def _maybe_schedule_state_averaging(self) -> None:
        """Starts matchmaking for the state round when it is near."""
        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        if next_epoch % self.average_state_every != 0:
            return
        if self.state_averager.averaging_in_progress:
            return
        if self.delay_before_state_averaging.num_updates == 0:
            return
        eta = (self.tracker.estimated_next_update_time
               + self.delay_before_state_averaging.ema_seconds_per_sample
               + self.state_averager.delay_before_averaging.ema_seconds_per_sample
               - get_dht_time())
        if eta <= self.matchmaking_time:
            if self.scheduled_state is None or self.scheduled_state.triggered or self.scheduled_state.done():
                try:
                    self.scheduled_state = self.state_averager.schedule_step(
                        gather=next_epoch, timeout=self.averaging_timeout)
                except BaseException as e:  # noqa: BLE001 - never out of step()
                    logger.log(self.status_loglevel, f"could not pre-schedule: {e!r}")
                    self.scheduled_state = None

    def _average_gradients_and_load_into_optimizer(self, control: Optional[StepControl]) -> None:
        """Waits for the gradient round; the optimizer then sees the averaged gradients, or
        this peer's own if the round failed (a failed round leaves the averaged tensors as
        they were loaded: this peer's mean gradient) or there was none (``control=None``:
        the accumulators are loaded now)."""
        assert self.grad_averager is not None
        if control is None:
            logger.log(self.status_loglevel, "no other peers: proceeding with local gradients")
            self.grad_averager.load_accumulators_into_averager_()
            self.last_round = dict(group_size=1, seconds=0.0)
        else:
            try:
                gathered = control.result(self.averaging_timeout)
                if gathered:
                    seconds = time.perf_counter() - self._round_started
                    self.last_round = dict(group_size=len(gathered), seconds=seconds)
                    self._rounds_ok += 1
                    logger.log(self.status_loglevel,
                               f"averaged gradients with {len(gathered)} peers in {seconds:.2f} s")
                else:
                    self.last_round = dict(group_size=1, seconds=0.0)
                    logger.log(self.status_loglevel,
                               "no group for the gradients in time: local gradients")
                    self._rounds_failed += 1
            except BaseException as e:  # noqa: BLE001 - never out of step()
                self.last_round = dict(group_size=1, seconds=0.0)
                self._rounds_failed += 1
                logger.log(self.status_loglevel,
                           f"averaging gradients failed ({e!r}): local gradients")
        self._load_averaged_gradients_into_optimizer_()

    def _load_averaged_gradients_into_optimizer_(self) -> None:
        assert self.grad_averager is not None
        if not self.offload_optimizer:
            params = self.state_averager._opt_parameters()
            with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
                for p, g in zip(params, averaged):
                    if p.grad is None:
                        p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)
                    else:
                        p.grad.copy_(g)
        self.grad_averager.notify_used_averaged_gradients()

    def _should_load_state_from_peers(self) -> bool:
        """Whether this peer must reload: once per epoch (after the tracker fetched) it must
        be exactly at the global epoch; otherwise at most one behind (the swarm may just have
        moved on)."""
        fetched = getattr(self.tracker, "fetched_global_progress_this_epoch", None)
        if self._check_sync_on_update and (fetched is None or fetched.is_set()):
            self._check_sync_on_update = False
            return self.local_epoch != self.tracker.global_epoch
        return self.local_epoch < self.tracker.global_epoch - 1

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm."""
        return self.local_epoch >= self.tracker.global_epoch - 1

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """Downloads the swarm's newest state (parameters, optimizer state, epoch, schedule)
        and installs it, retrying until one is loaded or ``load_state_timeout`` passes; a
        pending gradient round goes on with this peer at weight 0."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            self.state_averager.load_state_retrying(
                self.load_state_timeout, lambda: self.tracker.global_progress.num_peers, **kwargs)
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch
                self.state_averager._update_scheduler()
            if self.local_epoch != self.tracker.local_progress.epoch:
                # A new epoch from the donor: the tracker moves there too (and so does its
                # view of the global epoch, until its next fetch says more).
                self.tracker.update_epoch(new_epoch=self.local_epoch)
            else:
                self.tracker.report_local_progress(local_epoch=self.local_epoch,
                                                   samples_accumulated=0)
            self._announce_epoch()
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()

    def _tag_along_with_zero_weight(self, control: StepControl) -> None:
        """Stays in a round already joined, contributing nothing."""
        if not control.triggered:
            control.weight = 0.0
            control.allow_allreduce()
        self._wait_quietly(control)

    def _wait_quietly(self, control: StepControl) -> None:
        if control.done():
            return
        try:
            control.result(self.averaging_timeout)
        except BaseException as e:  # noqa: BLE001 - never out of step()
            logger.log(self.status_loglevel, f"a round this peer tagged along failed: {e!r}")
            if not control.done():
                control.cancel()

    # --- torch.optim.Optimizer's interface --------------------------------------------------

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the parameters' gradients (refused with ``reuse_grad_buffers``, where the
        optimizer zeroes them itself)."""
        if self.grad_averager is not None and self.grad_averager.reuse_grad_buffers:
            raise ValueError("with reuse_grad_buffers=True, never call zero_grad: the "
                             "optimizer refreshes the gradients itself")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, with ``local_epoch`` in its ``state``."""
        sd = self.state_averager.optimizer.state_dict()
        sd["state"]["local_epoch"] = self.local_epoch
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a :meth:`state_dict` (the epoch too, and the scheduler follows it)."""
        state_dict = dict(state_dict, state=dict(state_dict["state"]))
        if "local_epoch" in state_dict["state"]:
            self.state_averager.local_epoch = state_dict["state"].pop("local_epoch")
        self.state_averager.optimizer.load_state_dict(state_dict)
        self.state_averager._update_scheduler()

    @property
    def state(self) -> dict:
        """The wrapped optimizer's state, plus ``local_epoch``."""
        return dict(self.state_averager.optimizer.state, local_epoch=self.local_epoch)

    @property
    def opt(self) -> TorchOptimizer:
        """The wrapped torch optimizer."""
        return self.state_averager.optimizer

    @property
    def param_groups(self) -> tuple:
        """The wrapped optimizer's param groups, holding the model's own parameters (not the
        offloaded copies)."""
        groups = tuple(dict(g) for g in self.state_averager.optimizer.param_groups)
        main, start = self.state_averager.main_parameters, 0
        for g in groups:
            n = len(g["params"])
            g["params"] = list(main[start:start + n])
            start += n
        return groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise ValueError("set the wrapped optimizer's param groups (opt.opt.param_groups)")

    def add_param_group(self, param_group: dict) -> None:
        """Not supported: give every param group at init."""
        raise ValueError("hivemesh.Optimizer takes its param groups at init only")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self.run_id}, epoch={self.local_epoch})"

    def report_metrics(self, loss: Optional[float] = None, *, name: str = "") -> None:
        """Publishes this peer's metrics for monitors (``hivemesh monitor``, ``python -m
        hivemesh.monitor``): its epoch, samples per second, ``loss`` (a float or a one-element
        tensor; left out if NaN or infinite), gradient rounds finished and failed, the last
        round's group size, how others reach it, its mode and a display ``name`` (at most 64
        bytes). Not in hivemind's API (its ``step`` takes no loss): call it after ``step()``,
        as often as you like; it writes to the DHT at most every 2 s, in the background."""
        if loss is not None:
            loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
            if not math.isfinite(loss):
                logger.debug(f"loss {loss} not reported (not finite)")
                loss = None
        if self._metrics is None:
            self._metrics = _hivemesh.MetricsPublisher(self.dht._native, self.run_id)
        mode = "client" if self.client_mode else "aux" if self.auxiliary else "node"
        self._metrics.report(
            self.local_epoch, self.tracker.performance_ema.samples_per_second, loss=loss,
            target_batch_size=self.target_batch_size, rounds_ok=self._rounds_ok,
            rounds_failed=self._rounds_failed,
            last_group_size=min((self.last_round or {}).get("group_size", 0), 65535),
            mode=mode, name=name,
        )

    def shutdown(self) -> None:
        """Leaves the swarm: removes this peer's progress, finishes or leaves pending rounds,
        stops the averagers. Idempotent."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        self.progress_bar.newline()
        logger.log(self.status_loglevel, "leaving the swarm")
        self.tracker.shutdown(self.shutdown_timeout)
        if self._metrics is not None:
            self._metrics.shutdown(self.shutdown_timeout)
        try:
            self.state_averager.step(wait_for_delayed_updates=True)
        except BaseException as e:  # noqa: BLE001 - shutting down
            logger.log(self.status_loglevel, f"a background update failed at shutdown: {e!r}")
        for control in (self.scheduled_grads, self.scheduled_state):
            if control is None or control.done():
                continue
            if control.stage == AveragingStage.LOOKING_FOR_GROUP:
                control.cancel()
            else:
                self._tag_along_with_zero_weight(control)
        self.state_averager.shutdown()
        if self.grad_averager is not None:
            self.grad_averager.shutdown()

    def __del__(self) -> None:
        try:
            if self._parent_pid == os.getpid() and self.is_alive():
                self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
