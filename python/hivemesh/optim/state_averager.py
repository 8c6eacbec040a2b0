"""``TrainingStateAverager``: a peer's whole training state (parameters, optimizer, scheduler,
extra tensors), kept weakly in sync with the swarm (hivemind 1.1.12's class and arguments).

It owns the optimizer and the learning-rate scheduler; :meth:`TrainingStateAverager.step`
runs, in this order and each optionally, an optimizer step, ``zero_grad`` and an averaging
round of the parameters, of the optimizer statistics named in ``average_opt_statistics`` and of
``extra_tensors``, either at once or in a background thread whose results a later call applies
(``delay_optimizer_step`` / ``delay_averaging``). The scheduler follows :attr:`local_epoch`,
never the number of calls.

Which tensors the round averages:

* by default, host float32 copies of the local tensors, filled just before a round and copied
  back after it (``delta_rule_averaging=True``: only the round's change, ``average - before``,
  is added back, so local updates made while it ran are kept);
* with ``reuse_tensors`` (the default with ``offload_optimizer``), the offloaded optimizer's own
  host tensors: hivemesh's averager applies ``average - snapshot`` to them itself, so an
  optimizer step that runs during the round is kept as well.

Newcomers get the whole state from :meth:`get_current_state` (served by this peer's averager
to whoever calls ``load_state_from_peers``): the parameters, the extra tensors and every
tensor of the optimizer's ``state_dict()``, with ``{"epoch", "group_bits", "optimizer"}``
metadata. :meth:`load_state_from_peers` refuses a state older than the local one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from hivemesh.averaging import DecentralizedAverager
from hivemesh.averaging.control import StepControl
from hivemesh.dht import DHT
from hivemesh.utils import PerformanceEMA, get_logger

__all__ = [
    "TrainingStateAverager",
    "LRSchedulerBase",
    "OptimizerFactory",
    "SchedulerFactory",
    "Parameters",
    "ParamGroups",
    "TorchOptimizer",
    "dump_optimizer_state",
    "load_optimizer_state",
    "initialize_optimizer_state_",
]

logger = get_logger(__name__)

Parameters = Iterable[torch.Tensor]
ParamGroups = Iterable[Dict[str, Any]]
TorchOptimizer = torch.optim.Optimizer
LRSchedulerBase = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or getattr(
    torch.optim.lr_scheduler, "_LRScheduler"
)
OptimizerFactory = Callable[[Union[Parameters, ParamGroups]], TorchOptimizer]
SchedulerFactory = Callable[[TorchOptimizer], Any]

# Dtypes the averager's tensors and its state sharing carry as they are; anything else (int64
# step counters, float64) travels as float32 and is cast back on load.
_CARRIED = (torch.float32, torch.float16, torch.bfloat16)


class TrainingStateAverager(DecentralizedAverager):
    """Holds and averages a peer's training state; see the module docs.

    ``optimizer``: a ``torch.optim.Optimizer`` or a callable making one from param groups;
    ``params``: the parameters or param groups (needed with a callable); ``scheduler``: an LR
    scheduler or a callable making one from the optimizer; ``initialize_optimizer``: run one
    step with zero gradients so that every state tensor exists (default: when the optimizer
    holds no tensors yet); ``offload_optimizer``: the optimizer works on host copies of the
    parameters; ``custom_gradients``: the offloaded optimizer's gradients are filled by the
    caller (``hivemesh.Optimizer`` does); ``reuse_tensors``: average the offloaded optimizer's
    tensors in place; ``delta_rule_averaging``: add only the round's change back;
    ``sync_epoch_when_averaging``: take the highest epoch of the group; ``average_opt_statistics``:
    names of optimizer state entries (e.g. ``"exp_avg_sq"``) averaged with the parameters;
    ``extra_tensors``: more tensors averaged and served to newcomers. Everything else goes to
    :class:`hivemesh.DecentralizedAverager`.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        optimizer: Union[TorchOptimizer, OptimizerFactory],
        params: Optional[Union[Parameters, ParamGroups]] = None,
        scheduler: Optional[Any] = None,
        initialize_optimizer: Optional[bool] = None,
        offload_optimizer: bool = False,
        custom_gradients: bool = False,
        reuse_tensors: Optional[bool] = None,
        delta_rule_averaging: bool = False,
        performance_ema_alpha: float = 0.1,
        sync_epoch_when_averaging: bool = False,
        parameter_names: Optional[Sequence[str]] = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        status_loglevel: int = logging.DEBUG,
        **kwargs: Any,
    ):
        average_opt_statistics = tuple(average_opt_statistics)
        if not all(isinstance(k, str) for k in average_opt_statistics):
            raise TypeError("average_opt_statistics must be names (str) of optimizer state entries")
        if reuse_tensors is None:
            reuse_tensors = offload_optimizer and not delta_rule_averaging
        if reuse_tensors and delta_rule_averaging:
            raise ValueError("reuse_tensors and delta_rule_averaging are mutually exclusive")
        if custom_gradients and not offload_optimizer:
            logger.warning("custom_gradients=True has no effect: the optimizer is not offloaded")

        groups, main_parameters, names = self._check_params(optimizer, params, parameter_names)
        self.status_loglevel = status_loglevel
        self.offload_optimizer, self.custom_gradients = offload_optimizer, custom_gradients
        self.reuse_tensors, self.delta_rule_averaging = reuse_tensors, delta_rule_averaging
        self.main_parameters, self.parameter_names = main_parameters, names
        self._averaged_parameters = tuple(
            self._host_tensor(p, force_copy=offload_optimizer) for p in main_parameters
        )
        self.optimizer, self.scheduler = self._init_components(
            groups, optimizer, scheduler, initialize_optimizer
        )
        self.opt_keys_for_averaging = average_opt_statistics
        self.extra_tensors = tuple(extra_tensors)
        self.sync_epoch_when_averaging = sync_epoch_when_averaging
        self.local_epoch = 0

        self.delay_before_averaging = PerformanceEMA(alpha=performance_ema_alpha)
        self._executor = ThreadPoolExecutor(
            max_workers=2 if delta_rule_averaging else 1, thread_name_prefix="hivemesh-state"
        )
        self.finished_optimizer_step = threading.Event()
        self.finished_averaging_round = threading.Event()
        self.lock_optimizer = threading.Lock()
        self.lock_averaging = threading.Lock()
        self.pending_updates: set = set()
        # The pending calls that only average (with the delta rule, local steps skip them).
        self._background_rounds: set = set()
        self._old_tensors: Optional[Tuple[torch.Tensor, ...]] = None
        self._allreduce_timeout = kwargs.get("allreduce_timeout")

        averaged = self._init_averaged_tensors()
        super().__init__(averaged, dht, **kwargs)

    # --- construction ----------------------------------------------------------------------

    @staticmethod
    def _check_params(
        optimizer: Union[TorchOptimizer, OptimizerFactory],
        params: Optional[Union[Parameters, ParamGroups]],
        names: Optional[Sequence[str]],
    ) -> Tuple[Tuple[Dict[str, Any], ...], Tuple[torch.Tensor, ...], Tuple[Any, ...]]:
        if params is None:
            if not hasattr(optimizer, "param_groups"):
                raise ValueError("pass params=..., or an optimizer that has param_groups")
            params = optimizer.param_groups
        groups = tuple(params)
        if all(isinstance(p, torch.Tensor) for p in groups):
            groups = (dict(params=groups),)
        for group in groups:
            if not isinstance(group, dict) or group.get("params") is None:
                raise TypeError("param groups must be dicts with 'params'")
            group["params"] = list(group["params"])
            if not all(isinstance(p, torch.Tensor) for p in group["params"]):
                raise TypeError("params must be torch tensors")
        parameters = tuple(chain.from_iterable(g["params"] for g in groups))
        if not parameters:
            raise ValueError("there are no parameters to optimize")
        if len({id(p) for p in parameters}) != len(parameters):
            raise ValueError("a parameter appears twice in the param groups")
        names = tuple(range(len(parameters))) if names is None else tuple(names)
        if len(names) != len(parameters):
            raise ValueError(f"expected {len(parameters)} parameter names, got {len(names)}")
        return groups, parameters, names

    def _host_tensor(self, source: torch.Tensor, force_copy: bool = False) -> torch.Tensor:
        """The tensor a round averages for ``source``: itself (``reuse_tensors``) or a host
        float32 copy."""
        if self.reuse_tensors and not force_copy:
            if source.device.type != "cpu" or source.dtype not in _CARRIED:
                raise ValueError(
                    "reuse_tensors needs CPU tensors of float32, float16 or bfloat16; "
                    f"got {source.dtype} on {source.device}"
                )
            return source
        copy = source.detach().to(device="cpu", dtype=torch.float32, copy=True)
        return copy.requires_grad_(source.requires_grad)

    def _init_components(
        self,
        groups: Tuple[Dict[str, Any], ...],
        optimizer_or_factory: Union[TorchOptimizer, OptimizerFactory],
        scheduler_or_factory: Optional[Any],
        initialize_optimizer: Optional[bool],
    ) -> Tuple[TorchOptimizer, Optional[Any]]:
        opt_is_factory = callable(optimizer_or_factory) and not isinstance(
            optimizer_or_factory, TorchOptimizer
        )
        sched_is_factory = callable(scheduler_or_factory) and not isinstance(
            scheduler_or_factory, LRSchedulerBase
        )
        if opt_is_factory and scheduler_or_factory is not None and not sched_is_factory:
            raise ValueError("an optimizer made here needs a scheduler factory: callable(opt)")
        if self.offload_optimizer and not opt_is_factory:
            raise ValueError("offload_optimizer needs optimizer=callable(params)")

        if opt_is_factory:
            if self.offload_optimizer:
                if self.reuse_tensors:
                    opt_params = self._averaged_parameters
                else:
                    opt_params = tuple(
                        t.detach().clone().requires_grad_(t.requires_grad)
                        for t in self._averaged_parameters
                    )
                opt_groups, start = [], 0
                for group in groups:
                    n = len(group["params"])
                    opt_groups.append(dict(group, params=list(opt_params[start:start + n])))
                    start += n
                for p in opt_params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            else:
                opt_groups = list(groups)
            optimizer = optimizer_or_factory(opt_groups)
        else:
            optimizer = optimizer_or_factory
        if not isinstance(optimizer, TorchOptimizer):
            raise TypeError(f"the optimizer must be a torch.optim.Optimizer, not {optimizer!r}")

        if initialize_optimizer is None:
            initialize_optimizer = not any(
                isinstance(v, torch.Tensor) for s in optimizer.state.values() for v in s.values()
            )
        if initialize_optimizer:
            initialize_optimizer_state_(optimizer)

        scheduler = scheduler_or_factory(optimizer) if sched_is_factory else scheduler_or_factory
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
            raise ValueError("the scheduler must drive this averager's optimizer")
        return optimizer, scheduler

    def _opt_parameters(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _local_tensors(self) -> Iterator[torch.Tensor]:
        """The local tensors a round averages: parameters, chosen statistics, extras."""
        opt_params = self._opt_parameters()
        yield from opt_params
        for key in self.opt_keys_for_averaging:
            for p in opt_params:
                yield self.optimizer.state[p][key]
        yield from self.extra_tensors

    @torch.no_grad()
    def _init_averaged_tensors(self) -> List[torch.Tensor]:
        local = list(self._local_tensors())
        n = len(self._averaged_parameters)
        if self.reuse_tensors:
            rest = [self._host_tensor(t) for t in local[n:]]
            averaged = [p.detach() for p in self._averaged_parameters] + rest
        else:
            averaged = [self._host_tensor(t, force_copy=True).detach() for t in local]
        for a, t in zip(averaged, local):
            if a.shape != t.shape:
                raise ValueError(f"averaged tensor shape {tuple(a.shape)} != {tuple(t.shape)}")
        return averaged

    # --- stepping --------------------------------------------------------------------------

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs: Any) -> StepControl:
        """Starts matchmaking for a later averaging round (hand the control to
        :meth:`step` as ``averaging_control``); the round waits for its trigger."""
        if kwargs.get("weight") is not None:
            raise ValueError("schedule_step does not take a weight (set control.weight)")
        return DecentralizedAverager.step(
            self, scheduled_time=scheduled_time, wait=False, require_trigger=True, **kwargs
        )

    def step(
        self,
        wait_for_delayed_updates: Optional[bool] = None,
        apply_delayed_updates: bool = True,
        increment_epoch: bool = False,
        optimizer_step: bool = False,
        zero_grad: bool = False,
        delay_optimizer_step: bool = False,
        averaging_round: bool = False,
        delay_averaging: Optional[bool] = None,
        averaging_control: Optional[StepControl] = None,
        wait_for_trigger: Optional[Callable[[], Any]] = None,
        grad_scaler: Optional[Any] = None,
        averaging_opts: Optional[Dict[str, Any]] = None,
        **legacy: Any,
    ) -> Any:
        """Does, in this order and each only if asked: waits for background work, applies
        its finished results, increments :attr:`local_epoch` (and the scheduler), runs an
        optimizer step, ``zero_grad``, and an averaging round. ``delay_optimizer_step`` /
        ``delay_averaging`` run those in the background (applied by a later call);
        ``averaging_control`` is a round from :meth:`schedule_step`; ``wait_for_trigger`` is
        called (in the background) before the optimizer step; ``averaging_opts`` go to the
        round (e.g. ``timeout``)."""
        if "wait_for_delayed_update" in legacy:  # hivemind's tests spell it so
            wait_for_delayed_updates = legacy.pop("wait_for_delayed_update")
        if legacy:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(legacy)}")
        if delay_averaging is None:
            delay_averaging = delay_optimizer_step
        if self.delta_rule_averaging:
            should_wait = averaging_round or optimizer_step or zero_grad
        else:
            should_wait = averaging_round
        # With the delta rule, local updates go on while a background round runs: its
        # result is added as ``average - before`` whenever it arrives (hivemind waits for the
        # round at every optimizer step; a round longer than an epoch then blocks training).
        # Only another averaging round, or a caller asking to wait, waits for it.
        skip_rounds = (self.delta_rule_averaging and not averaging_round
                       and wait_for_delayed_updates is None)
        if wait_for_delayed_updates is None:
            wait_for_delayed_updates = should_wait
        if should_wait and not (wait_for_delayed_updates and apply_delayed_updates):
            raise ValueError("wait for the background work to finish before starting more")
        if delay_optimizer_step and not delay_averaging:
            raise ValueError("a delayed optimizer step needs delayed averaging")
        if delay_optimizer_step and not self.offload_optimizer:
            raise ValueError("delay_optimizer_step needs offload_optimizer")
        if averaging_control is not None and not averaging_round:
            raise ValueError("averaging_control is only used with averaging_round=True")
        if wait_for_trigger is not None:
            if not (optimizer_step or zero_grad or averaging_round):
                raise ValueError("wait_for_trigger is only used before updating the state")
            if not (self.reuse_tensors or self.custom_gradients):
                raise ValueError("wait_for_trigger needs reuse_tensors or custom_gradients")
        if averaging_opts and not averaging_round:
            logger.warning(f"averaging_opts unused (no averaging round): {averaging_opts}")

        output = None
        if wait_for_delayed_updates:
            timeout = (averaging_opts or {}).get("timeout", self._allreduce_timeout)
            for pending in list(self.pending_updates):
                if skip_rounds and pending in self._background_rounds:
                    continue
                try:
                    output = pending.result(timeout)
                except BaseException:  # noqa: BLE001 - logged below, with the others
                    if not pending.done():
                        pending.cancel()
        finished = {p for p in self.pending_updates if p.done()}
        self.pending_updates -= finished
        self._background_rounds -= finished
        for p in finished:
            if p.cancelled() or p.exception() is not None:
                logger.log(self.status_loglevel, f"a background update failed: {p}")

        if apply_delayed_updates:
            if self.finished_averaging_round.is_set():
                if not self.reuse_tensors:
                    self._apply_averaging_results_()
                if self.offload_optimizer and not self.finished_optimizer_step.is_set():
                    self._apply_optimizer_parameters_()
                self.finished_averaging_round.clear()
                logger.log(self.status_loglevel, "applied a background averaging round")
            if self.finished_optimizer_step.is_set():
                if self.offload_optimizer:
                    self._apply_optimizer_parameters_()
                self.finished_optimizer_step.clear()

        if increment_epoch:
            self.local_epoch += 1

        if optimizer_step or zero_grad or averaging_round:
            if self.offload_optimizer and not self.custom_gradients:
                self._load_local_grads_into_optimizer_()
            pending = self._executor.submit(
                self._do, wait_for_trigger, optimizer_step, zero_grad, averaging_round,
                averaging_control, grad_scaler, **(averaging_opts or {}),
            )
            self.pending_updates.add(pending)
            if averaging_round and not (optimizer_step or zero_grad):
                self._background_rounds.add(pending)
            await_optimizer = (optimizer_step or zero_grad) and not delay_optimizer_step
            await_averaging = averaging_round and not delay_averaging
            if await_optimizer:
                self.finished_optimizer_step.wait()
                self.finished_optimizer_step.clear()
                if self.offload_optimizer and not await_averaging:
                    self._apply_optimizer_parameters_()
            if await_averaging:
                self.finished_averaging_round.wait()
                self.finished_averaging_round.clear()
                if not self.reuse_tensors:
                    self._apply_averaging_results_()
                if self.offload_optimizer:
                    self._apply_optimizer_parameters_()
            in_background = (averaging_round and delay_averaging) or (
                (optimizer_step or zero_grad) and delay_optimizer_step
            )
            if not in_background:
                try:
                    output = pending.result()
                finally:
                    self.pending_updates.discard(pending)
        return output

    def _do(
        self,
        wait_for_trigger: Optional[Callable[[], Any]],
        optimizer_step: bool,
        zero_grad: bool,
        averaging_round: bool,
        control: Optional[StepControl],
        grad_scaler: Optional[Any],
        timeout: Optional[float] = None,
        **kwargs: Any,
    ) -> Any:
        """The optimizer step, the scheduler and an averaging round, on the executor."""
        if control is not None and (control.triggered or control.done()):
            logger.log(self.status_loglevel, f"discarding a used or failed round: {control}")
            control = None
        started = time.perf_counter()
        began = False
        try:
            if averaging_round and control is None:
                control = DecentralizedAverager.step(
                    self, gather=self.local_epoch, require_trigger=True, timeout=timeout,
                    wait=False, **kwargs,
                )
            if wait_for_trigger is not None:
                wait_for_trigger()
            began = True
            with self.lock_optimizer:
                if optimizer_step:
                    with self.get_tensors() if self.reuse_tensors else nullcontext():
                        if grad_scaler is None:
                            self.optimizer.step()
                        else:
                            with grad_scaler.running_global_step():
                                if not grad_scaler.step(self.optimizer):
                                    raise RuntimeError("the grad scaler refused the step")
                if zero_grad:
                    self.optimizer.zero_grad()
                    if self.offload_optimizer:
                        for p in self.main_parameters:
                            if p.grad is not None:
                                p.grad.zero_()
                self._update_scheduler()
                if optimizer_step or zero_grad:
                    # (A round alone must not wake a caller awaiting its own optimizer step
                    # on the other worker.)
                    self.finished_optimizer_step.set()

            gathered: Dict[Any, Any] = {}
            if averaging_round:
                with self.lock_averaging:
                    if not self.reuse_tensors:
                        self._load_local_tensors_into_averager_()
                    if self.delta_rule_averaging:
                        with torch.no_grad(), self.get_tensors() as averaged:
                            self._old_tensors = tuple(t.clone() for t in averaged)
                    self.delay_before_averaging.update(1, interval=time.perf_counter() - started)
                    try:
                        control.allow_allreduce()
                        gathered = control.result(timeout) or {}
                        logger.log(self.status_loglevel, f"averaged the state with {len(gathered)} peers")
                    except BaseException as e:  # noqa: BLE001 - a failed round is not an error
                        logger.log(self.status_loglevel, f"averaging the state failed: {e!r}")
                        gathered = {}
                        self._old_tensors = None
                    self.finished_averaging_round.set()
                if self.sync_epoch_when_averaging:
                    epochs = [e for e in gathered.values() if isinstance(e, int)]
                    if epochs and max(epochs) > self.local_epoch:
                        self.local_epoch = max(epochs)
                        logger.log(self.status_loglevel, f"a peer is at epoch {self.local_epoch}")
                        self._update_scheduler()
            return gathered
        except BaseException as e:
            if not began:
                logger.error(f"{type(self).__name__}.step aborted: wait_for_trigger raised")
            logger.exception(e)
            if control is not None and not control.done():
                control.cancel()
            if optimizer_step or zero_grad:
                self.finished_optimizer_step.set()
            if averaging_round:
                self.finished_averaging_round.set()
            raise

    # --- moving tensors --------------------------------------------------------------------

    @torch.no_grad()
    def _load_local_grads_into_optimizer_(self) -> None:
        for main, opt in zip(self.main_parameters, self._opt_parameters()):
            if main.grad is None:
                continue
            if opt.grad is None:
                opt.grad = main.grad.detach().to(opt.device, opt.dtype, copy=True)
            else:
                opt.grad.copy_(main.grad)

    @torch.no_grad()
    def _apply_optimizer_parameters_(self) -> None:
        opt_params = self._opt_parameters()
        if len(opt_params) != len(self.main_parameters):
            raise RuntimeError("the optimizer's parameters changed during training")
        for main, opt in zip(self.main_parameters, opt_params):
            main.copy_(opt)

    @torch.no_grad()
    def _load_local_tensors_into_averager_(self) -> None:
        with self.get_tensors() as averaged:
            for local, a in zip(self._local_tensors(), averaged):
                a.copy_(local)

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        # With the delta rule a delayed optimizer step may be running on the other worker:
        # add the round's change between two steps, not in the middle of one.
        with self.lock_optimizer if self.delta_rule_averaging else nullcontext():
            self._apply_averaging_results_locked_()

    @torch.no_grad()
    def _apply_averaging_results_locked_(self) -> None:
        old = self._old_tensors
        self._old_tensors = None
        with self.get_tensors() as averaged:
            local = list(self._local_tensors())
            if len(local) != len(averaged):
                raise RuntimeError("the state's tensors changed during training")
            if not self.delta_rule_averaging or old is None:
                for t, a in zip(local, averaged):
                    t.copy_(a)
            else:
                for t, a, o in zip(local, averaged, old):
                    t.add_(a.sub(o).to(device=t.device, dtype=t.dtype))

    @property
    def averaging_in_progress(self) -> bool:
        """Whether an averaging round of this averager runs now (or waits in the
        background to begin)."""
        return self.lock_averaging.locked() or any(not p.done() for p in self._background_rounds)

    @property
    @contextmanager
    def lock_averaged_tensors(self) -> Iterator[None]:
        """hivemind's lock of the averaged tensors (the averager's tensor lock)."""
        with self.get_tensors():
            yield

    def _update_scheduler(self) -> None:
        """Steps the scheduler until it matches :attr:`local_epoch`."""
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # Catching up with an epoch is not a call out of order.
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                while self.scheduler._step_count <= self.local_epoch:
                    self.scheduler.step()

    # --- state for newcomers ---------------------------------------------------------------

    def get_current_state(self) -> Tuple[Any, List[torch.Tensor]]:
        """What a newcomer downloads: ``({"epoch", "group_bits", "optimizer"}, tensors)``,
        the tensors being the optimizer's parameters, the extra tensors, then the optimizer's
        state tensors (as :func:`dump_optimizer_state` lays them out)."""
        tensor_lock = self.get_tensors() if self.reuse_tensors else nullcontext()
        with torch.no_grad(), self.lock_optimizer, tensor_lock:
            params = [p.detach().cpu().clone() for p in self._opt_parameters()]
            extras = [t.detach().cpu().clone() for t in self.extra_tensors]
            opt_meta, opt_tensors = dump_optimizer_state(self.optimizer)
            # Read with the tensors: an update holding the optimizer's lock moves both.
            epoch = self.local_epoch
        try:
            group_bits = self.get_group_bits()
        except (AttributeError, NotImplementedError):
            group_bits = ""
        metadata = dict(epoch=epoch, group_bits=group_bits, optimizer=opt_meta)
        if self.scheduler is not None:
            # The schedule's own state: a chained scheduler (StepLR) scales the loaded lr
            # again if it is merely stepped up to the epoch.
            metadata["scheduler"] = _encode_tree(self.scheduler.state_dict(), [])
        tensors = [_carried(t) for t in chain(params, extras)] + opt_tensors
        return metadata, tensors

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None,
                              **kwargs: Any) -> Optional[bool]:
        """Downloads the newest state from a peer and installs it: parameters, optimizer
        state, extras, :attr:`local_epoch` and the scheduler. Returns ``True`` if a state
        was installed, ``None``/``False`` if none was available or it was refused (older than
        ours, or not laid out like ours)."""
        if not wait:
            raise ValueError("TrainingStateAverager.load_state_from_peers needs wait=True")
        got = DecentralizedAverager.load_state_from_peers(self, wait=True, timeout=timeout)
        if got is None:
            return None
        metadata, tensors = got
        if not isinstance(metadata, dict) or not isinstance(metadata.get("epoch"), int):
            logger.warning("refusing a peer's state: its metadata has no epoch")
            return False
        if metadata["epoch"] < self.local_epoch:
            logger.warning(
                f"refusing a peer's state: its epoch {metadata['epoch']} is behind ours "
                f"({self.local_epoch})"
            )
            return False
        opt_params = self._opt_parameters()
        targets = list(chain(opt_params, self.extra_tensors))
        n = len(targets)
        if len(tensors) < n or any(
            t.numel() != s.numel() for t, s in zip(targets, tensors[:n])
        ):
            logger.error("refusing a peer's state: its tensors are not laid out like ours")
            return False
        with torch.no_grad(), self.lock_optimizer:
            try:
                load_optimizer_state(self.optimizer, metadata.get("optimizer"), tensors[n:])
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
                logger.error(f"refusing a peer's state: its optimizer state does not fit: {e}")
                return False
            sched_state = metadata.get("scheduler")
            if self.scheduler is not None and sched_state is not None:
                try:
                    self.scheduler.load_state_dict(_decode_tree(sched_state, [], [0]))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    logger.warning(f"the peer's scheduler state does not fit ({e}): stepping ours")
            for local, loaded in zip(targets, tensors[:n]):
                local.copy_(loaded.reshape(local.shape))
        if self.offload_optimizer:
            self._apply_optimizer_parameters_()
        if not self.reuse_tensors:
            self._load_local_tensors_into_averager_()
        self.local_epoch = metadata["epoch"]
        self._update_scheduler()
        return True

    def load_state_retrying(self, timeout: float, num_peers: Callable[[], int],
                            **kwargs: Any) -> bool:
        """:meth:`load_state_from_peers`, retried (a failure is logged) until a state is
        installed, ``timeout`` seconds pass, or ``num_peers()`` says nobody else is there;
        whether one was installed."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("could not load the state from peers in time; going on")
                return False
            try:
                if self.load_state_from_peers(timeout=left, **kwargs):
                    return True
                if num_peers() <= 1:
                    return False  # nobody to load from
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - retried
                logger.log(self.status_loglevel, f"loading the state failed: {e!r}; retrying")
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def shutdown(self) -> None:
        """Waits for background work, then stops the averager."""
        for pending in list(self.pending_updates):
            try:
                pending.result(self._allreduce_timeout)
            except BaseException:  # noqa: BLE001 - shutting down
                pass
        self._executor.shutdown(wait=False)
        super().shutdown()


def _carried(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous host tensor of a dtype state sharing carries."""
    t = t.detach().cpu()
    if t.dtype not in _CARRIED:
        t = t.to(torch.float32)
    return t.contiguous()


def initialize_optimizer_state_(opt: TorchOptimizer) -> None:
    """Makes every optimizer state tensor exist: one step with zero gradients (the
    parameters' own gradients are put back afterwards)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, g in zip(params, saved):
        p.grad = g


def _encode_tree(x: Any, tensors: List[torch.Tensor]) -> Any:
    """``x`` (a state dict) as JSON-safe tagged nodes; its tensors appended to ``tensors``."""
    if isinstance(x, torch.Tensor):
        tensors.append(_carried(x.detach().cpu().clone()))
        return {"t": len(tensors) - 1, "dt": str(x.dtype).replace("torch.", ""),
                "s": list(x.shape)}
    if isinstance(x, dict):
        return {"m": [[_encode_tree(k, tensors), _encode_tree(v, tensors)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"u": [_encode_tree(v, tensors) for v in x]}
    if isinstance(x, list):
        return [_encode_tree(v, tensors) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot share state of type {type(x).__name__}")


def _decode_tree(x: Any, tensors: Sequence[torch.Tensor], used: List[int], depth: int = 0) -> Any:
    """The inverse of :func:`_encode_tree`; ``ValueError`` for anything malformed (a peer's
    state is hostile input). Counts the tensors referenced in ``used[0]``."""
    if depth > 64:
        raise ValueError("state nested too deeply")
    if isinstance(x, list):
        return [_decode_tree(v, tensors, used, depth + 1) for v in x]
    if isinstance(x, dict):
        if "t" in x:
            i = x["t"]
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tensors):
                raise ValueError(f"bad tensor index {i!r}")
            dtype = getattr(torch, str(x.get("dt", "float32")), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"bad dtype {x.get('dt')!r}")
            shape = x.get("s", list(tensors[i].shape))
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise ValueError(f"bad shape {shape!r}")
            if math.prod(shape) != tensors[i].numel():
                raise ValueError(f"tensor {i}: shape {shape} does not fit {tensors[i].numel()} values")
            used[0] += 1
            return tensors[i].reshape(shape).to(dtype)
        if "m" in x:
            pairs = x["m"]
            if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in pairs
            ):
                raise ValueError("bad mapping in the state")
            out = {}
            for k, v in pairs:
                key = _decode_tree(k, tensors, used, depth + 1)
                if isinstance(key, (list, dict)):
                    raise ValueError("unhashable key in the state")
                out[key] = _decode_tree(v, tensors, used, depth + 1)
            return out
        if "u" in x:
            if not isinstance(x["u"], list):
                raise ValueError("bad tuple in the state")
            return tuple(_decode_tree(v, tensors, used, depth + 1) for v in x["u"])
        raise ValueError("unknown node in the state")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise ValueError(f"unexpected {type(x).__name__} in the state")


def dump_optimizer_state(opt: TorchOptimizer) -> Tuple[Any, List[torch.Tensor]]:
    """``opt.state_dict()`` as ``(metadata, tensors)``: JSON-safe tagged nodes (a tensor as
    its index, dtype and shape; a mapping as key/value pairs, so integer keys stay integers;
    a tuple) and the tensors, as host tensors that state sharing carries (see
    :func:`load_optimizer_state`)."""
    tensors: List[torch.Tensor] = []
    with torch.no_grad():
        return _encode_tree(opt.state_dict(), tensors), tensors


def load_optimizer_state(opt: TorchOptimizer, metadata: Any, tensors: Sequence[torch.Tensor]
                         ) -> None:
    """Loads what :func:`dump_optimizer_state` made into ``opt``; a malformed tree, or
    tensors it does not use, raise ``ValueError``."""
    used = [0]
    state = _decode_tree(metadata, tensors, used)
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise ValueError("the optimizer state has no 'state' and 'param_groups'")
    if used[0] != len(tensors):
        raise ValueError(f"{len(tensors)} optimizer tensors served, {used[0]} referenced")
    opt.load_state_dict(state)
