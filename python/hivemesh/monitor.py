"""``python -m hivemesh.monitor``: a live web page of a training run, the same as ``hivemesh
monitor`` (the Rust monitor runs inside this process, through the native module).

Usage::

    python -m hivemesh.monitor --initial-peer /ip4/.../p2p/12D3... [--run-id quickstart_run]
                               [--http 127.0.0.1:8080]

It joins the swarm as a DHT client, reads the run's progress and metrics records, prints the
page's URL and serves it until Ctrl-C; ``/api/state`` has the same data as JSON. From Python,
:class:`Monitor` does the same without the command line.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence

from hivemesh import _hivemesh

__all__ = ["Monitor", "main"]


class Monitor:
    """A monitor of the run ``run_id``, joined through ``initial_peers``, serving its page at
    ``http`` (``HOST:PORT``; port 0 picks one: see :attr:`url`). ``target_batch_size``: for
    the ETA (default: what the peers' metrics say). ``swarm_key``: a private swarm's key file
    (``hivemesh swarm-key FILE``), as the swarm's ``DHT(swarm_key=...)``."""

    def __init__(self, initial_peers: Sequence[Any], run_id: str, http: str = "127.0.0.1:8080",
                 *, listen: Optional[Sequence[str]] = None,
                 target_batch_size: Optional[int] = None, refresh_period: float = 2.0,
                 max_peers: int = 1000, history: int = 900, swarm_key: Optional[str] = None):
        self._native = _hivemesh.Monitor(
            [str(a) for a in initial_peers], run_id, http,
            listen=None if listen is None else [str(a) for a in listen],
            target_batch_size=target_batch_size, refresh_period=refresh_period,
            max_peers=max_peers, history=history,
            swarm_key=None if swarm_key is None else str(swarm_key),
        )

    @property
    def url(self) -> str:
        """The page's address, ``http://HOST:PORT/``."""
        return self._native.url

    def state(self) -> Dict[str, Any]:
        """What ``/api/state`` returns: the run, its peers and the history window."""
        return json.loads(self._native.state_json())

    def shutdown(self) -> None:
        """Stops the server and leaves the swarm. Idempotent."""
        self._native.shutdown()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hivemesh.monitor",
                                description="A live web page of a hivemesh training run.")
    p.add_argument("--initial-peer", dest="initial_peers", action="append", required=True,
                   metavar="MADDR", help="a peer of the swarm, ending with /p2p/<peer id> "
                   "(repeatable; at least one)")
    p.add_argument("--run-id", default="quickstart_run", metavar="ID",
                   help="the run to watch: the optimizer's run_id (default: %(default)s)")
    p.add_argument("--http", default="127.0.0.1:8080", metavar="ADDR",
                   help="where to serve the page; port 0 picks one (default: %(default)s)")
    p.add_argument("--listen", action="append", metavar="MADDR",
                   help="address to listen on for the swarm (repeatable)")
    p.add_argument("--target-batch-size", type=int, metavar="N",
                   help="the run's target batch size, for the ETA (default: the peers' metrics)")
    p.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between two fetches of the swarm's records (default: 2)")
    p.add_argument("--max-peers", type=int, default=1000, metavar="N",
                   help="rows of the peer table, peers that left included (default: 1000)")
    p.add_argument("--history", type=int, default=900, metavar="N",
                   help="fetches kept for the charts (default: 900)")
    p.add_argument("--swarm-key", metavar="FILE",
                   help="a private swarm's key file (hivemesh swarm-key FILE writes one)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """The command line; returns the exit status."""
    p = _parser()
    args = p.parse_args(argv)
    if not args.run_id:
        p.error("--run-id must not be empty")
    if not 0.05 <= args.refresh <= 3600:
        p.error("--refresh must be between 0.05 and 3600 seconds")
    if args.max_peers < 1 or args.history < 1:
        p.error("--max-peers and --history must be at least 1")
    if args.target_batch_size is not None and args.target_batch_size < 1:
        p.error("--target-batch-size must be at least 1")
    try:
        monitor = Monitor(args.initial_peers, args.run_id, args.http, listen=args.listen,
                          target_batch_size=args.target_batch_size,
                          refresh_period=args.refresh, max_peers=args.max_peers,
                          history=args.history, swarm_key=args.swarm_key)
    except ValueError as e:
        p.error(str(e))
    except _hivemesh.HivemeshError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(monitor.url, flush=True)
    print(f"monitoring run '{args.run_id}' at {monitor.url}; Ctrl-C to stop", file=sys.stderr,
          flush=True)
    while not stop.wait(0.5):
        pass
    print("shutting down", file=sys.stderr, flush=True)
    monitor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
