"""``python -m hivemesh.dht``: a bootstrap node for a swarm (hivemind's ``hivemind-dht``;
behaves like ``hivemesh dht``). Prints its join addresses on stdout, one per line, then how
others reach it on stderr; Ctrl-C stops it."""

import argparse
import signal
import sys
import threading

from hivemesh.dht import DHT


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hivemesh.dht",
        description="Run a hivemesh DHT node that others join through (a relay by default).",
    )
    parser.add_argument("--listen", action="append", default=[], metavar="MADDR",
                        help="address to listen on (repeatable; default TCP and QUIC on all "
                             "interfaces)")
    parser.add_argument("--initial-peer", action="append", default=[], metavar="MADDR",
                        dest="initial_peers", help="peer to join through (repeatable)")
    parser.add_argument("--identity", metavar="FILE",
                        help="Ed25519 identity file, created if missing")
    parser.add_argument("--client", action="store_true", help="run the DHT in client mode")
    parser.add_argument("--no-relay", action="store_true",
                        help="do not relay for peers behind NATs")
    parser.add_argument("--external", action="append", default=[], metavar="MADDR",
                        help="an address others reach this node at (repeatable)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        dht = DHT(
            initial_peers=args.initial_peers,
            host_maddrs=args.listen or None,
            client_mode=args.client,
            identity_path=args.identity,
            relay=not args.no_relay,
            external_maddrs=args.external,
        )
    except Exception as e:  # the message is the point; no traceback for a bad flag
        print(f"error: {e}", file=sys.stderr)
        return 1
    for addr in dht.get_visible_maddrs():
        print(addr, flush=True)
    relay = "" if args.no_relay else " as a relay"
    print(f"dht peer {dht.peer_id} running{relay}; Ctrl-C to stop", file=sys.stderr, flush=True)
    print(f"reachability: {dht.reachability()}", file=sys.stderr, flush=True)
    while not stop.wait(0.2):
        pass
    print("shutting down", file=sys.stderr, flush=True)
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
