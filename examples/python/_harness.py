"""What the Python examples share: waiting for their peer processes' messages, stopping the
processes, and their failure type."""

import queue
import time
from typing import Any, Collection, List


class Failure(Exception):
    """The run failed (the message says why)."""


def stop_processes(procs: List[Any], grace: float) -> None:
    """Waits up to ``grace`` seconds for the processes to exit, then terminates (and if need
    be kills) the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def next_message(results: Any, procs: List[Any], timeout: float, waiting_for: str,
                 done: Collection[int] = ()) -> tuple:
    """The next ``(kind, index, ...)`` message from a peer process on ``results``. Fails if
    ``timeout`` seconds pass first, if a process not in ``done`` exits meanwhile, or on a
    ``("fatal", index, traceback)`` message."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            for i, proc in enumerate(procs):
                if proc.exitcode is not None and i not in done:
                    raise Failure(f"peer {i} exited (status {proc.exitcode}) {waiting_for}")
            if time.monotonic() >= deadline:
                raise Failure(f"timed out after {timeout:.0f} s {waiting_for}")
            continue
        if msg[0] == "fatal":
            raise Failure(f"peer {msg[1]} failed:\n{msg[2]}")
        return msg
