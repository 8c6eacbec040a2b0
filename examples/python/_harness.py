"""What the Python examples share: stopping their peer processes, and their failure type."""

import time
from typing import Any, List


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
