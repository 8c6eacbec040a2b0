"""``ProgressTracker``: hivemind's ``hivemind.optim.progress_tracker`` over hivemesh's Rust
progress tracker (``hivemesh::train``; the protocol and its bounds on hostile records are in
``docs/architecture.md``, "Training progress").

Every peer publishes its progress (epoch, samples accumulated, samples per second, time,
client mode) under the DHT key ``{prefix}_progress`` at its own signed subkey; every peer reads
all of them on a schedule that tightens as the epoch's end nears, and derives the swarm's
progress: the global epoch, the samples accumulated toward it, the peers, an ETA. The
background work is Rust on hivemesh's runtime and never takes the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional

from hivemesh import _hivemesh
from hivemesh.dht import DHT
from hivemesh.utils.logging import get_logger
from hivemesh.utils.timed_storage import DHTExpiration, get_dht_time

__all__ = ["GlobalTrainingProgress", "LocalTrainingProgress", "ProgressTracker"]

logger = get_logger(__name__)


@dataclass(frozen=False)
class GlobalTrainingProgress:
    """The swarm's progress as this peer last derived it."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    eta_next_epoch: float
    next_fetch_time: float


class LocalTrainingProgress(NamedTuple):
    """One peer's progress, as it publishes it."""

    peer_id: bytes
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float
    client_mode: bool

    def dict(self) -> dict:
        """The fields as a dict (hivemind's pydantic ``.dict()``)."""
        return self._asdict()


class _TrackerPerformanceEMA:
    """The tracker's estimate of this peer's throughput (kept in Rust): hivemind's
    ``PerformanceEMA`` interface."""

    def __init__(self, native: "_hivemesh.ProgressTracker"):
        self._native = native

    @property
    def samples_per_second(self) -> float:
        """The current estimate."""
        return self._native.samples_per_second

    def update(self, task_size: float, interval: Optional[float] = None) -> float:
        """Registers ``task_size`` samples (processed in ``interval`` seconds, default since the
        last update); returns the new estimate."""
        return self._native.ema_update(float(task_size), None if interval is None else float(interval))

    def reset_timer(self) -> None:
        """The next update counts from now."""
        self._native.ema_reset_timer()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Inside this context, time passing does not count toward the estimate."""
        self._native.ema_pause()
        try:
            yield
        finally:
            self._native.ema_resume()

    def __repr__(self) -> str:
        return f"PerformanceEMA(ema={self.samples_per_second:.5f})"


class _FetchedEvent:
    """Set once the global progress was fetched after the last epoch change
    (hivemind's ``threading.Event`` ``fetched_global_progress_this_epoch``)."""

    def __init__(self, native: "_hivemesh.ProgressTracker"):
        self._native = native

    def is_set(self) -> bool:
        return self._native.fetched_this_epoch()

    def clear(self) -> None:
        self._native.clear_fetched()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits (without holding the GIL) until set, at most ``timeout`` seconds."""
        return self._native.wait_fetched(timeout)


class ProgressTracker:
    """Keeps track of this peer's and the swarm's training progress, in epochs: an epoch ends
    once the swarm has accumulated ``target_batch_size`` samples (or its ETA has passed, or a
    peer is already past it).

    hivemind's arguments: ``min_refresh_period`` / ``max_refresh_period`` bound the time
    between two fetches of the swarm's progress, ``default_refresh_period`` is used while
    nobody reports, ``expected_drift_peers`` / ``expected_drift_rate`` say how many peers may
    join between fetches (fetches come sooner), ``performance_ema_alpha`` smooths the local
    throughput, and a record lives ``metadata_expiration`` seconds. ``client_mode`` defaults to
    the DHT's. ``private_key`` is accepted and not used: records are signed with the DHT node's
    identity. ``daemon`` changes nothing (the background work is Rust, not a thread).

    Example (hivemind's)::

        tracker = ProgressTracker(dht, "my_run", target_batch_size=256, start=True)
        local_epoch, local_samples = 0, 0
        while True:
            accumulate_gradients(batch_size=32)
            local_samples += 32
            tracker.report_local_progress(local_epoch, local_samples)
            if tracker.ready_to_update_epoch:
                with tracker.pause_updates():
                    local_epoch = tracker.update_epoch(local_epoch + 1)
                    local_samples = 0
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        client_mode: Optional[bool] = None,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10,
        default_refresh_period: float = 3,
        expected_drift_peers: float = 3,
        expected_drift_rate: float = 0.2,
        performance_ema_alpha: float = 0.1,
        metadata_expiration: float = 60.0,
        status_loglevel: int = logging.DEBUG,
        private_key: Any = None,
        daemon: bool = True,
        start: bool = False,
    ):
        client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self.dht, self.prefix, self.client_mode = dht, prefix, client_mode
        self.training_progress_key = f"{prefix}_progress"
        self.target_batch_size = int(target_batch_size)
        self.min_refresh_period, self.max_refresh_period = min_refresh_period, max_refresh_period
        self.default_refresh_period = default_refresh_period
        self.expected_drift_peers, self.expected_drift_rate = expected_drift_peers, expected_drift_rate
        self.metadata_expiration = metadata_expiration
        self.status_loglevel = status_loglevel
        self.daemon = daemon
        self._native = _hivemesh.ProgressTracker(
            dht._native,
            prefix,
            self.target_batch_size,
            client_mode=client_mode,
            min_refresh_period=float(min_refresh_period),
            max_refresh_period=float(max_refresh_period),
            default_refresh_period=float(default_refresh_period),
            expected_drift_peers=float(expected_drift_peers),
            expected_drift_rate=float(expected_drift_rate),
            performance_ema_alpha=float(performance_ema_alpha),
            metadata_expiration=float(metadata_expiration),
            start=start,
        )
        self.performance_ema = _TrackerPerformanceEMA(self._native)
        self.fetched_global_progress_this_epoch = _FetchedEvent(self._native)
        self.lock_global_progress = threading.Lock()
        self._last_logged_fetch: Optional[float] = None

    def start(self) -> None:
        """Starts publishing and fetching in the background."""
        self._native.start()

    def is_alive(self) -> bool:
        """Whether the background work runs."""
        return self._native.is_alive

    @property
    def global_progress(self) -> GlobalTrainingProgress:
        """The swarm's progress as last fetched (plus this peer's reports since)."""
        progress = GlobalTrainingProgress(*self._native.global_progress())
        if progress.next_fetch_time != self._last_logged_fetch and logger.isEnabledFor(self.status_loglevel):
            self._last_logged_fetch = progress.next_fetch_time
            now = get_dht_time()
            logger.log(
                self.status_loglevel,
                f"{self.prefix} accumulated {progress.samples_accumulated} samples for epoch "
                f"#{progress.epoch} from {progress.num_peers} peers. ETA "
                f"{max(0.0, progress.eta_next_epoch - now):.2f} sec "
                f"(refresh in {max(0.0, progress.next_fetch_time - now):.2f} sec)",
            )
        return progress

    @property
    def local_progress(self) -> LocalTrainingProgress:
        """This peer's progress as last reported."""
        return LocalTrainingProgress(*self._native.local_progress())

    @property
    def global_epoch(self) -> int:
        """The global epoch."""
        return self._native.global_epoch

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether this peer may end its epoch now: a peer is past it, the swarm has
        accumulated ``target_batch_size`` samples, or the estimated time of that has passed."""
        return self._native.ready_to_update_epoch

    @property
    def estimated_next_update_time(self) -> DHTExpiration:
        """When this peer should end its epoch (DHT time): now if it may already."""
        return self._native.estimated_next_update_time

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """This peer holds ``samples_accumulated`` samples toward the end of ``local_epoch``;
        published to the other peers soon after."""
        for name, value in (("local_epoch", local_epoch), ("samples_accumulated", samples_accumulated)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, not {value!r}")
        self._native.report_local_progress(local_epoch, samples_accumulated, bool(update_global_samples))

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        """Inside this context the global progress is not updated by fetches and the
        throughput clock stops: hold it while ending an epoch (:meth:`update_epoch`)."""
        with self.lock_global_progress:
            self._native.pause()
            try:
                yield
            finally:
                self._native.resume()

    def update_epoch(self, new_epoch: Optional[int] = None) -> int:
        """Moves this peer to ``new_epoch`` (default: its epoch + 1) with no samples, and the
        global epoch with it if it was behind; returns the new epoch. Call inside
        :meth:`pause_updates`."""
        assert self.lock_global_progress.locked(), "ProgressTracker must be paused when incrementing epoch"
        if new_epoch is not None and (isinstance(new_epoch, bool) or not isinstance(new_epoch, int) or new_epoch < 0):
            raise ValueError(f"new_epoch must be a non-negative int, not {new_epoch!r}")
        return self._native.update_epoch(new_epoch)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stops tracking for good and withdraws this peer's record from the DHT."""
        self._native.shutdown(timeout)

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is not None and native.is_alive:
            try:
                native.shutdown(None)
            except Exception:  # interpreter shutdown, a DHT already gone
                pass

    def __repr__(self) -> str:
        return f"<ProgressTracker {self.prefix!r} epoch={self.global_epoch}>"
