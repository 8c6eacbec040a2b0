"""``hivemesh.DecentralizedAverager``: hivemind's averaging API over hivemesh's Rust core.

The averaged tensors are the caller's own PyTorch CPU tensors (float32, float16, bfloat16) or
numpy arrays (float32, float16), contiguous: the Rust core reads and writes their memory, so
after :meth:`DecentralizedAverager.step` the caller's objects hold the group's average, and
:meth:`DecentralizedAverager.get_tensors` yields those same objects. A round adds
``average - snapshot`` to each tensor (the delta rule), so updates made while it runs are kept;
make them inside ``with averager.get_tensors():`` (the lock the round takes to apply) or
between steps.

CUDA tensors (in an extension built with ``MATURIN_PEP517_ARGS="--features cuda" pip install
.``) are taken through DLPack, shared as well: a round copies a snapshot to pinned host memory
and applies ``average - snapshot`` on the GPU, ordered on the CUDA stream that was current for
the tensor's device when the averager was created (use that stream for training; it is never
synchronized, it only runs the snapshot's device-side copy and the apply kernel). Only that
stream is ordered: training on side streams (AMP, DDP's communication streams, a
``torch.cuda.stream(s)`` block) must synchronize with it before a step
(``stream.wait_stream(side)``) and after it (``side.wait_stream(stream)``). No lock is needed
for them, and an averager holding them does not share state (``allow_state_sharing`` defaults
to ``False`` then).

While a step runs, the GIL is released: other Python threads (a data loader, the training
step) keep running. Ctrl-C during ``step()`` cancels it and raises ``KeyboardInterrupt``;
the tensors are left unchanged unless the round had already finished.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

from hivemesh import _hivemesh
from hivemesh._hivemesh import get_dht_time
from hivemesh.compression import CompressionBase, NoCompression
from hivemesh.dht import DHT, PeerID
from hivemesh.averaging.control import (
    AveragingMode,
    GatheredData,
    StepControl,
    _decode_value,
    _encode_value,
)

__all__ = ["DecentralizedAverager"]


#: ``adaptive_timeouts=True``: the Rust core's default bounds (min s, max s, factor).
DEFAULT_ADAPTIVE_TIMEOUTS = (1.0, 60.0, 3.0)


def _adaptive_timeouts(arg: Union[None, bool, Tuple[float, float, float]]
                       ) -> Optional[Tuple[float, float, float]]:
    """``adaptive_timeouts`` as the core takes it: ``None`` or ``(min, max, factor)``."""
    if arg is None or arg is False:
        return None
    if arg is True:
        return DEFAULT_ADAPTIVE_TIMEOUTS
    try:
        low, high, factor = (float(x) for x in arg)
    except (TypeError, ValueError):
        raise ValueError(f"adaptive_timeouts must be None, a bool or (min, max, factor), "
                         f"not {arg!r}") from None
    return (low, high, factor)


def _tensor_kind(t: Any) -> str:
    module = type(t).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("numpy"):
        return "numpy"
    raise TypeError(
        f"averaged_tensors must be torch.Tensor or numpy.ndarray, not {type(t).__name__}"
    )


def _any_cuda(tensors: List[Any]) -> bool:
    return any(getattr(t, "is_cuda", False) for t in tensors)


_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16",
                 "torch.bfloat16": "bfloat16"}
_NUMPY_DTYPES = {"float32": "float32", "float16": "float16"}


def _raw_tensor(index: int, t: Any) -> Tuple[str, List[int], bytes]:
    """``(dtype, shape, raw little-endian bytes)`` of a served tensor."""
    module = type(t).__module__
    if module.startswith("torch"):
        dtype = _TORCH_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise TypeError(f"get_current_state() tensor {index}: dtype {t.dtype}; served "
                            f"tensors are float32, float16 or bfloat16")
        import torch

        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if dtype == "bfloat16":  # numpy has no bfloat16: its bits as int16
            flat = flat.view(torch.int16)
        return dtype, list(t.shape), flat.numpy().tobytes()
    if module.startswith("numpy"):
        import numpy as np

        dtype = _NUMPY_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise TypeError(f"get_current_state() tensor {index}: dtype {t.dtype}; served "
                            f"arrays are float32 or float16")
        return dtype, list(t.shape), np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<")
                                                          ).tobytes()
    raise TypeError(f"get_current_state() tensor {index}: a {type(t).__name__}, not a "
                    f"torch.Tensor or numpy.ndarray")


def _done(value: Any) -> "concurrent.futures.Future[Any]":
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _state_provider(averager: "weakref.ref[DecentralizedAverager]") -> Any:
    """The callable the Rust donor calls: the averager's :meth:`get_current_state`, encoded."""

    def provide() -> Tuple[bytes, List[Tuple[str, List[int], bytes]]]:
        self = averager()
        if self is None:
            raise RuntimeError("the averager is gone")
        state = self.get_current_state()
        if not isinstance(state, (tuple, list)) or len(state) not in (2, 3):
            raise TypeError("get_current_state() must return (metadata, tensors)")
        metadata, tensors = state[0], state[1]
        return (_encode_value(metadata, "get_current_state()'s metadata"),
                [_raw_tensor(i, t) for i, t in enumerate(tensors)])

    return provide


class DecentralizedAverager:
    """Averages ``averaged_tensors`` with peers that share ``prefix``, in groups found through
    ``dht``. hivemind's arguments and meanings; see the module docs for how tensors are
    shared.

    hivemesh's own arguments: ``allow_relayed_data`` lets tensor data go through relays when
    no direct connection can be made; ``bandwidth`` is this peer's share of reduction work;
    ``state_trusted_peers`` (peer ids) are the only peers :meth:`load_state_from_peers` asks,
    and ``state_min_agreeing`` donors must serve byte-identical states before one is
    downloaded (a donor's ``state_sharing_priority`` is its own claim: with the default, 1, a
    peer announcing a huge priority wins). A state holding NaN or infinity is never loaded.
    ``centered_clip_tau``: combine the parts this peer reduces with the robust CenteredClip
    aggregator of this radius (L2 norm over a part, ``part_size_bytes`` long) instead of the
    mean, so that a minority of peers sending huge values cannot drag the average far; set
    it the same on every peer. ``adaptive_timeouts``: derive the sender and reducer timeouts
    of each round from the part sizes, the members' measured rates and the gaps observed
    between parts (a slow but steady peer is not banned, a silent one is dropped as fast as
    the bounds allow): ``True`` for the default bounds (1 s, 60 s, 3 expected gaps), or
    ``(min_seconds, max_seconds, factor)``; ``None`` (the default) keeps the fixed
    ``sender_timeout``/``reducer_timeout``.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[Any],
        dht: DHT,
        *,
        start: bool = True,
        prefix: str,
        target_group_size: Optional[int] = None,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: Optional[int] = None,
        allreduce_timeout: Optional[float] = None,
        next_chunk_timeout: Optional[float] = None,
        sender_timeout: Optional[float] = None,
        reducer_timeout: Optional[float] = None,
        compression: CompressionBase = NoCompression(),
        state_compression: CompressionBase = NoCompression(),
        tensor_infos: Any = None,
        bandwidth: Optional[float] = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        allow_state_sharing: Optional[bool] = None,
        state_sharing_priority: float = 0.0,
        declare_state_period: Optional[float] = None,
        client_mode: Optional[bool] = None,
        daemon: bool = True,
        shutdown_timeout: float = 5.0,
        allow_relayed_data: bool = False,
        state_trusted_peers: Optional[Sequence[Any]] = None,
        state_min_agreeing: int = 1,
        centered_clip_tau: Optional[float] = None,
        adaptive_timeouts: Union[None, bool, Tuple[float, float, float]] = None,
    ):
        if not isinstance(dht, DHT):
            raise TypeError(f"dht must be a hivemesh.DHT, not {type(dht).__name__}")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str")
        if target_group_size is not None and target_group_size < 2:
            raise ValueError(f"target_group_size must be at least 2, not {target_group_size}")
        if min_group_size < 1:
            raise ValueError(f"min_group_size must be at least 1, not {min_group_size}")
        if initial_group_bits and set(initial_group_bits) - {"0", "1"}:
            raise ValueError(f"initial_group_bits must be 0s and 1s, not {initial_group_bits!r}")
        if averaging_alpha != 1.0:
            raise ValueError("averaging_alpha other than 1.0 is not supported")
        if not isinstance(compression, CompressionBase):
            raise TypeError(f"compression must be a hivemesh.compression codec, not {compression!r}")
        if auxiliary and client_mode:
            raise ValueError("an auxiliary peer cannot be in client mode")
        tensors = list(averaged_tensors)
        if not tensors:
            raise ValueError("averaged_tensors is empty")
        kinds = {_tensor_kind(t) for t in tensors}
        if len(kinds) > 1:
            raise TypeError("averaged_tensors mixes torch tensors and numpy arrays")
        self._kind = kinds.pop()
        self._tensors = tensors
        self.dht = dht
        self.prefix = prefix
        self.client_mode = client_mode
        self.auxiliary = auxiliary
        if auxiliary:
            mode: Optional[str] = "aux"
        elif client_mode is None:
            mode = None
        else:
            mode = "client" if client_mode else "node"
        self._args = dict(
            prefix=prefix,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=float(min_matchmaking_time),
            request_timeout=float(request_timeout),
            allreduce_timeout=allreduce_timeout,
            sender_timeout=sender_timeout if sender_timeout is not None else next_chunk_timeout,
            reducer_timeout=reducer_timeout,
            compression=compression._spec(),
            part_size_bytes=part_size_bytes,
            mode=mode,
            initial_group_bits=initial_group_bits,
            # An averager holding CUDA tensors does not share state (hivemesh.cuda's docs).
            allow_state_sharing=(not auxiliary and not client_mode and not _any_cuda(tensors)
                                 if allow_state_sharing is None else bool(allow_state_sharing)),
            state_priority=float(state_sharing_priority),
            allow_relayed_data=bool(allow_relayed_data),
            bandwidth=bandwidth,
            state_trusted_peers=(None if state_trusted_peers is None
                                 else [str(p) for p in state_trusted_peers]),
            state_min_agreeing=int(state_min_agreeing),
            centered_clip_tau=None if centered_clip_tau is None else float(centered_clip_tau),
            adaptive_timeouts=_adaptive_timeouts(adaptive_timeouts),
        )
        #: hivemind's ``matchmaking_kwargs``: the matchmaking arguments this averager was made
        #: with (read by hivemind's optimizer stack; changing them after the start does
        #: nothing, as in hivemind).
        self.matchmaking_kwargs = dict(
            prefix=prefix,
            initial_group_bits=initial_group_bits,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=float(min_matchmaking_time),
            request_timeout=float(request_timeout),
        )
        self._native: Optional[_hivemesh.Averager] = None
        if start:
            self.run_in_background()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        """Starts the averager (a no-op if it runs)."""
        if self._native is None:
            self._native = _hivemesh.Averager(self.dht._native, self._tensors, **self._args)
            if type(self).get_current_state is not DecentralizedAverager.get_current_state:
                # Overridden: the donor serves what it returns. Through a weak reference, so
                # that the native averager does not keep this object alive.
                self._native.set_state_provider(_state_provider(weakref.ref(self)))

    @property
    def _averager(self) -> _hivemesh.Averager:
        if self._native is None:
            raise _hivemesh.ShutdownError("the averager is not running (start=False or shut down)")
        return self._native

    @property
    def peer_id(self) -> PeerID:
        """This peer's id (its DHT's)."""
        return self.dht.peer_id

    @property
    def mode(self) -> AveragingMode:
        """How this peer takes part now (with ``client_mode=None``: a client when behind a NAT
        that nobody can reach)."""
        return AveragingMode[self._averager.mode.upper()]

    def step(
        self,
        gather: Optional[GatheredData] = None,
        scheduled_time: Optional[float] = None,
        weight: Optional[float] = None,
        timeout: Optional[float] = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
    ) -> Any:
        """Finds a group and averages with it. With ``wait=True`` returns the group's
        gathered data ``{peer_id: gather}`` (``None`` if no group formed in time); with
        ``wait=False`` a :class:`StepControl`.

        ``gather``: bytes or JSON-serializable data shared with the group; ``scheduled_time``:
        when the all-reduce should begin at the earliest (DHT time; default now +
        ``min_matchmaking_time``, settable on the :class:`StepControl` until the all-reduce
        begins, as ``weight`` is); ``weight``: this peer's
        weight (default 1, 0 for an auxiliary peer); ``timeout``: give up after this long;
        ``require_trigger``: begin the all-reduce only after ``StepControl.trigger()``."""
        if weight is None:
            weight = 0.0 if self.auxiliary else 1.0
        if scheduled_time is None:
            # hivemind's default, so that StepControl.scheduled_time is always a time.
            scheduled_time = get_dht_time() + self.matchmaking_kwargs["min_matchmaking_time"]
        scheduled_in = max(0.0, float(scheduled_time) - get_dht_time())
        native = self._averager.schedule_step(
            weight=float(weight),
            gather=_encode_value(gather),
            timeout=None if timeout is None else float(timeout),
            allow_retries=allow_retries,
            require_trigger=require_trigger,
            scheduled_in=scheduled_in,
        )
        control = StepControl(native)
        return control.result() if wait else control

    def error_feedback_residuals(self) -> Optional[List[Any]]:
        """With :class:`~hivemesh.compression.ErrorFeedbackTopK`, this averager's residuals
        (what it has not sent yet), one flat float32 numpy array per averaged tensor; ``None``
        with any other compression."""
        import numpy as np

        residuals = self._averager.error_feedback_residuals()
        if residuals is None:
            return None
        return [np.asarray(r, dtype=np.float32) for r in residuals]

    def get_group_bits(self, wait: bool = True) -> Any:
        """The bits of the group key the next step looks under (``"0101..."``;
        ``initial_group_bits`` at first, rotated after each group). With ``wait=False`` a
        completed ``concurrent.futures.Future`` of them (hivemind's signature)."""
        bits = self._averager.group_bits()
        return bits if wait else _done(bits)

    def set_group_bits(self, group_bits: str, wait: bool = True) -> Any:
        """Replaces the group bits (``0``s and ``1``s, any length): the next step's
        matchmaking looks under them. With ``wait=False`` returns a completed
        ``concurrent.futures.Future`` of ``None``."""
        if not isinstance(group_bits, str) or set(group_bits) - {"0", "1"}:
            raise ValueError(f"group_bits must be a str of 0s and 1s, not {group_bits!r}")
        self._averager.set_group_bits(group_bits)
        return None if wait else _done(None)

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[List[Any]]:
        """Holds the averager's tensor lock and yields the averaged tensors (the caller's own
        objects). A round that finishes meanwhile waits to apply its result."""
        lock = self._averager.lock()
        try:
            yield self._tensors
        finally:
            lock.release()

    def _new_tensor(self, dtype: str, shape: List[int], data: bytes) -> Any:
        if self._kind == "numpy":
            import numpy as np

            return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
        import torch

        torch_dtype = getattr(torch, dtype)
        if not data:
            return torch.empty(shape, dtype=torch_dtype)
        # A bytearray is writable, so the tensor may own it without a copy or a warning.
        return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)

    def get_current_state(self) -> Tuple[Any, Sequence[Any]]:
        """What this peer serves to newcomers (:meth:`load_state_from_peers` on their side):
        ``(metadata, tensors)``. By default :attr:`state_metadata` and the averaged tensors.

        Override it to serve something else, as hivemind's ``TrainingStateAverager`` does
        (parameters, optimizer statistics, extra tensors, ``{"epoch": ...}``): ``metadata``
        is bytes or JSON-serializable data (at most about 1 MiB encoded), ``tensors`` a
        sequence of torch tensors or numpy arrays of any count and shapes, float32, float16
        or bfloat16 (torch), on any device (copied to the CPU). hivemind's third element
        (compression infos) may be returned and is ignored. The override is called with the
        GIL on a thread of the Rust core, once per newcomer (a result is reused for up to a
        second), and must return within the state request timeout (10 s); if it raises or is
        late, the newcomer is refused and asks another peer (the traceback is printed)."""
        with self.get_tensors() as tensors:
            return self.state_metadata, list(tensors)

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None) -> Any:
        """Downloads the state a peer serves (the one with the highest
        ``state_sharing_priority``): ``(metadata, tensors)``, the tensors new ones of the same
        kind as this averager's (torch or numpy) with the donor's count, shapes and dtypes (what
        its :meth:`get_current_state` returned), or ``None`` if no peer shares or ``timeout``
        seconds pass first. The local tensors are left as they are. With ``wait=False`` returns a
        ``concurrent.futures.Future`` of that result at once (the download runs on a thread
        of its own, with the GIL released)."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        native = self._averager
        if not wait:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()

            def download() -> None:
                try:
                    future.set_result(self._load_state(native, timeout))
                except BaseException as e:  # noqa: BLE001 - handed to the future's owner
                    future.set_exception(e)

            threading.Thread(target=download, name="hivemesh-load-state", daemon=True).start()
            return future
        return self._load_state(native, timeout)

    def _load_state(self, native: _hivemesh.Averager, timeout: Optional[float]
                    ) -> Optional[Tuple[Any, List[Any]]]:
        got = native.download_state(timeout)
        if got is None:
            return None
        metadata, tensors = got
        return (_decode_value(metadata, untagged=metadata),
                [self._new_tensor(d, s, b) for d, s, b in tensors])

    @property
    def state_metadata(self) -> Any:
        """What newcomers get with the tensors (hivemind's ``metadata`` of
        ``get_current_state``): bytes or JSON-serializable data (a dict of the epoch, the
        learning rate, ...), at most about 1 MiB encoded; ``None`` when unset."""
        raw = self._averager.state_metadata
        return _decode_value(raw, untagged=raw)

    @state_metadata.setter
    def state_metadata(self, value: Any) -> None:
        self._averager.state_metadata = _encode_value(value, "state_metadata")

    @property
    def allow_state_sharing(self) -> bool:
        """Whether this peer serves its tensors to newcomers (settable)."""
        return self._averager.allow_state_sharing()

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self._averager.set_allow_state_sharing(bool(value))

    @property
    def state_sharing_priority(self) -> float:
        """Priority newcomers see (higher is asked first; settable)."""
        return self._averager.state_priority()

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._averager.set_state_priority(float(value))

    def is_alive(self) -> bool:
        """Whether the averager runs."""
        return self._native is not None

    def shutdown(self) -> None:
        """Stops the averager (a step in flight fails). Idempotent."""
        if self._native is not None:
            self._native.shutdown()
            self._native = None

    def __enter__(self) -> "DecentralizedAverager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<hivemesh.DecentralizedAverager {self.prefix!r} {self._kind}>"
