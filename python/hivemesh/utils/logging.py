"""hivemesh's loggers (hivemind's ``hivemind.utils.logging``): one handler on the ``hivemesh``
logger, at the level ``HIVEMESH_LOGLEVEL`` names (default ``INFO``)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

__all__ = ["get_logger", "add_handler_filter"]

_lock = threading.Lock()
_handler: Optional[logging.Handler] = None


def _install() -> None:
    global _handler
    with _lock:
        if _handler is not None:
            return
        _handler = logging.StreamHandler()
        _handler.setFormatter(
            logging.Formatter(
                fmt="{asctime}.{msecs:03.0f} [{levelname}] [{name}] {message}",
                style="{",
                datefmt="%b %d %H:%M:%S",
            )
        )
        root = logging.getLogger("hivemesh")
        root.addHandler(_handler)
        root.propagate = False
        level = os.getenv("HIVEMESH_LOGLEVEL", "INFO").upper()
        try:
            root.setLevel(level)
        except ValueError:
            root.setLevel(logging.INFO)
            root.warning("HIVEMESH_LOGLEVEL=%r is no log level; using INFO", level)


def get_logger(name: Optional[str] = None) -> logging.Logger:
    """``logging.getLogger(name)``, once hivemesh's handler is installed: loggers under
    ``hivemesh`` print through it at ``HIVEMESH_LOGLEVEL``; others propagate as usual (give
    them a name under ``hivemesh.`` to use it)."""
    _install()
    return logging.getLogger(name)


def add_handler_filter(f: logging.Filter) -> None:
    """Adds ``f`` to hivemesh's handler (once): it sees every record before it is written
    (the optimizer's progress bar ends its line there, so a log line never lands after it)."""
    _install()
    assert _handler is not None
    if f not in _handler.filters:
        _handler.addFilter(f)
