"""Type stubs of the native module ``hivemesh._hivemesh`` (see python/src/ for the Rust side).

Use the Python API (``hivemesh.DHT``, ``hivemesh.DecentralizedAverager``); these classes are
what it is built on.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

__version__: str
#: Whether CUDA tensors can be averaged (an extension built with ``--features cuda``).
CUDA: bool

class HivemeshError(Exception):
    """Base of every hivemesh error."""

class DHTError(HivemeshError):
    """The swarm or DHT failed (starting, storing, reading)."""

class AveragingError(HivemeshError):
    """A step failed: linking, the all-reduce, an unreachable group."""

class MatchmakingError(AveragingError):
    """No group formed in time."""

class StateError(HivemeshError):
    """Downloading or serving the averager's state failed."""

class ShutdownError(HivemeshError):
    """The node or averager has shut down (or was created in a parent process before a fork)."""

def get_dht_time() -> float:
    """Seconds since the UNIX epoch, as the DHT counts time."""

def peer_id_to_bytes(b58: str) -> bytes:
    """libp2p's binary form of a base58 peer id (``ValueError`` if it is none)."""

def peer_id_to_base58(data: bytes) -> str:
    """The base58 text of a binary peer id (``ValueError`` if it is none)."""

class Node:
    """A hivemesh node: swarm, DHT and link hub."""

    def __init__(
        self,
        initial_peers: Sequence[str] = ...,
        listen: Optional[Sequence[str]] = ...,
        client_mode: bool = ...,
        identity_path: Optional[str] = ...,
        relay: bool = ...,
        external: Sequence[str] = ...,
        data_plane: bool = ...,
        start_timeout: float = ...,
        swarm_key: Optional[str] = ...,
        metrics_listen: Optional[str] = ...,
    ) -> None: ...
    @property
    def peer_id(self) -> str:
        """This node's peer id (base58)."""
    @property
    def metrics_addr(self) -> Optional[str]:
        """``HOST:PORT`` of the metrics endpoint, if served."""
    def metrics_text(self) -> str:
        """The metrics in the Prometheus text format."""
    @property
    def is_alive(self) -> bool:
        """Whether the node runs."""
    def visible_maddrs(self) -> List[str]:
        """Addresses others can join through, each ending with ``/p2p/<peer id>``."""
    def reachability(self) -> Tuple[str, List[str], List[str]]:
        """``(class, confirmed addresses, relayed addresses)``."""
    def own_subkey(self) -> bytes:
        """A subkey that only this node can write."""
    def store(
        self, key: bytes, value: bytes, expiration_time: float, subkey: Optional[bytes] = ...
    ) -> bool:
        """Stores a value; returns whether a remote replica holds it when read back, or this
        node is connected to nobody (only its own store has it)."""
    def get(
        self, key: bytes
    ) -> Optional[Tuple[Optional[Tuple[bytes, float]], List[Tuple[bytes, bytes, float]]]]:
        """``None`` or ``(plain, [(subkey, value, expiration)])``."""
    def shutdown(self) -> None:
        """Stops the node. Idempotent."""

class StepControl:
    """A scheduled step."""

    @property
    def stage(self) -> str:
        """``queued``, ``matchmaking``, ``awaiting_trigger``, ``allreduce`` or ``finished``."""
    def trigger(self) -> None:
        """Lets the all-reduce begin."""
    @property
    def weight(self) -> float:
        """The step's weight (the one its all-reduce used, once it began)."""
    def set_weight(self, weight: float) -> bool:
        """Sets the weight; ``False`` (no change) once the all-reduce began; ``ValueError``
        for a weight that is not 0 or a finite positive number up to 1e12."""
    @property
    def scheduled_time(self) -> Optional[float]:
        """When the all-reduce should begin at the earliest (DHT time), or ``None``."""
    def set_scheduled_time(self, scheduled_time: float) -> bool:
        """Sets the scheduled time; ``False`` (no change) once the all-reduce began."""
    @property
    def params_final(self) -> bool:
        """Whether weight and scheduled time are final (the all-reduce began or the step
        ended)."""
    def cancel(self) -> None:
        """Cancels the step."""
    def done(self) -> bool:
        """Whether the step has finished."""
    def wait(self, timeout: Optional[float] = ...) -> bool:
        """Waits (GIL released) until finished or ``timeout``; returns whether finished."""
    def outcome(self) -> Dict[str, Any]:
        """The finished step's outcome, or its error raised."""

class TensorLock:
    """The averager's tensor lock, held until released."""

    def release(self) -> None:
        """Releases the lock. Idempotent."""

class Averager:
    """An averager over tensors shared with Python."""

    def __init__(
        self,
        node: Node,
        tensors: List[Any],
        prefix: str,
        *,
        target_group_size: Optional[int] = ...,
        min_group_size: int = ...,
        min_matchmaking_time: float = ...,
        request_timeout: float = ...,
        allreduce_timeout: Optional[float] = ...,
        sender_timeout: Optional[float] = ...,
        reducer_timeout: Optional[float] = ...,
        compression: Union[Tuple[int, int, int], str] = ...,
        part_size_bytes: Optional[int] = ...,
        mode: Optional[str] = ...,
        initial_group_bits: str = ...,
        allow_state_sharing: bool = ...,
        state_priority: float = ...,
        allow_relayed_data: bool = ...,
        bandwidth: Optional[float] = ...,
        state_trusted_peers: Optional[List[str]] = ...,
        state_min_agreeing: int = ...,
        centered_clip_tau: Optional[float] = ...,
        _apply_gate: bool = ...,
    ) -> None: ...
    @property
    def mode(self) -> str:
        """``node``, ``client`` or ``aux``."""
    def _apply_gate_reached(self, timeout: float) -> bool:
        """Test hook: whether a step stopped before its apply within ``timeout``."""
    def _apply_gate_release(self) -> None:
        """Test hook: lets the stopped step apply."""
    def schedule_step(
        self,
        *,
        weight: float = ...,
        gather: Optional[bytes] = ...,
        timeout: Optional[float] = ...,
        allow_retries: bool = ...,
        require_trigger: bool = ...,
        scheduled_in: Optional[float] = ...,
    ) -> StepControl:
        """Schedules a step."""
    def lock(self) -> TensorLock:
        """Takes the tensor lock."""
    def download_state(
        self, timeout: Optional[float] = ...
    ) -> Optional[Tuple[bytes, List[Tuple[str, List[int], bytes]]]]:
        """Downloads the state without installing it (``None``: no donor, or ``timeout`` passed)."""
    state_metadata: bytes
    def set_state_provider(
        self,
        provider: Optional[Callable[[], Tuple[bytes, List[Tuple[str, List[int], bytes]]]]],
    ) -> None:
        """Serves what ``provider()`` returns (``(metadata, [(dtype, shape, raw bytes)])``)
        instead of the tensors and metadata; ``None``: those again."""
    def error_feedback_residuals(self) -> Optional[List[List[float]]]:
        """With sparse compression, the residuals per tensor (flattened); else ``None``."""
    def group_bits(self) -> str:
        """The group bits the next step looks under."""
    def set_group_bits(self, bits: str) -> None:
        """Replaces the group bits."""
    def allow_state_sharing(self) -> bool: ...
    def set_allow_state_sharing(self, allow: bool) -> None: ...
    def state_priority(self) -> float: ...
    def set_state_priority(self, priority: float) -> None: ...
    def shutdown(self) -> None:
        """Stops the averager. Idempotent."""

class ProgressTracker:
    """Training progress through the DHT (the Rust ``hivemesh::train::ProgressTracker``); see
    ``hivemesh.optim.progress_tracker`` for the Python API built on it."""

    def __init__(
        self,
        node: Node,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: bool = ...,
        min_refresh_period: float = ...,
        max_refresh_period: float = ...,
        default_refresh_period: float = ...,
        expected_drift_peers: float = ...,
        expected_drift_rate: float = ...,
        performance_ema_alpha: float = ...,
        metadata_expiration: float = ...,
        request_timeout: float = ...,
        start: bool = ...,
    ) -> None: ...
    def start(self) -> None:
        """Starts publishing and fetching in the background."""
    @property
    def is_alive(self) -> bool:
        """Whether the background loops run."""
    def global_progress(self) -> Tuple[int, int, int, int, int, float, float]:
        """``(epoch, samples_accumulated, target_batch_size, num_peers, num_clients,
        eta_next_epoch, next_fetch_time)``."""
    def local_progress(self) -> Tuple[bytes, int, int, float, float, bool]:
        """``(peer_id, epoch, samples_accumulated, samples_per_second, time, client_mode)``."""
    @property
    def global_epoch(self) -> int: ...
    @property
    def ready_to_update_epoch(self) -> bool: ...
    @property
    def estimated_next_update_time(self) -> float: ...
    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = ...
    ) -> None: ...
    def update_epoch(self, new_epoch: Optional[int] = ...) -> int: ...
    def pause(self) -> None:
        """Pauses fetches' updates and the throughput clock (pair with ``resume``)."""
    def resume(self) -> None: ...
    @property
    def samples_per_second(self) -> float:
        """The local throughput estimate."""
    def ema_update(self, task_size: float, interval: Optional[float] = ...) -> float: ...
    def ema_pause(self) -> None: ...
    def ema_resume(self) -> None: ...
    def ema_reset_timer(self) -> None: ...
    def fetched_this_epoch(self) -> bool: ...
    def clear_fetched(self) -> None: ...
    def wait_fetched(self, timeout: Optional[float] = ...) -> bool:
        """Waits (GIL released) for a fetch after the last epoch change."""
    def shutdown(self, timeout: Optional[float] = ...) -> None:
        """Stops the loops and withdraws this peer's record. Idempotent."""

class Monitor:
    """A monitor node (``hivemesh monitor``): a DHT client watching the run ``run_id`` and
    serving its live page at ``http`` (``HOST:PORT``; port 0 picks one)."""

    def __init__(
        self,
        initial_peers: List[str],
        run_id: str,
        http: str = ...,
        *,
        listen: Optional[List[str]] = ...,
        target_batch_size: Optional[int] = ...,
        refresh_period: float = ...,
        max_peers: int = ...,
        history: int = ...,
        swarm_key: Optional[str] = ...,
    ) -> None: ...
    @property
    def url(self) -> str: ...
    def state_json(self) -> str: ...
    def shutdown(self) -> None: ...

class MetricsPublisher:
    """This peer's metrics record for monitors (the Rust ``hivemesh::train::MetricsPublisher``)."""

    def __init__(
        self,
        node: Node,
        prefix: str,
        *,
        min_period: float = ...,
        expiration: float = ...,
        request_timeout: float = ...,
    ) -> None: ...
    def report(
        self,
        epoch: int,
        samples_per_second: float,
        *,
        loss: Optional[float] = ...,
        target_batch_size: int = ...,
        rounds_ok: int = ...,
        rounds_failed: int = ...,
        last_group_size: int = ...,
        reach: Optional[str] = ...,
        mode: str = ...,
        name: str = ...,
    ) -> None: ...
    def shutdown(self, timeout: Optional[float] = ...) -> None: ...
