"""``hivemesh.DHT``: a node of the swarm, with hivemind's ``DHT`` interface.

Keys and subkeys are ``str`` (stored as UTF-8) or ``bytes``; values are ``bytes``. hivemind
serializes arbitrary objects with msgpack; hivemesh stores bytes as they are, so serialize
values yourself (never unpickle what the network sends you).

Forking: a process that forks after creating a DHT (PyTorch ``DataLoader`` workers do) keeps
working in the parent. In the child, a DHT or averager created before the fork cannot be used
(calls raise ``ShutdownError``; the child holds no copy of its threads); the child may create
new ones of its own.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Union

from hivemesh import _hivemesh
from hivemesh._hivemesh import DHTError, get_dht_time

__all__ = ["DHT", "Multiaddr", "PeerID", "ValueWithExpiration", "DHTError", "get_dht_time"]

Key = Union[str, bytes]

# hivemind's DHT arguments that change nothing here; anything else is a TypeError.
_IGNORED = {
    "daemon",
    "await_ready",
    "num_workers",
    "max_workers",
    "parallel_rpc",
    "shutdown_timeout",
    "wait_timeout",
    "ensure_bootstrap_success",
    "use_relay",
    "use_auto_relay",
    "record_validators",
    "use_ipfs",
    "announce_maddrs",
}


class Multiaddr(str):
    """A multiaddr; ``str()`` of it is what ``initial_peers`` takes."""

    __slots__ = ()


class PeerID:
    """A peer's id (base58, as libp2p prints it)."""

    __slots__ = ("_b58",)

    def __init__(self, b58: str):
        if not isinstance(b58, str) or not b58:
            raise ValueError(f"not a peer id: {b58!r}")
        self._b58 = b58

    @classmethod
    def from_base58(cls, b58: str) -> "PeerID":
        """The peer id with base58 text ``b58``."""
        return cls(b58)

    def to_base58(self) -> str:
        """The base58 text."""
        return self._b58

    def to_string(self) -> str:
        """The base58 text (hivemind's name)."""
        return self._b58

    def __str__(self) -> str:
        return self._b58

    def __repr__(self) -> str:
        return f"<PeerID {self._b58}>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PeerID):
            return self._b58 == other._b58
        return NotImplemented

    def __lt__(self, other: "PeerID") -> bool:
        return self._b58 < other._b58

    def __hash__(self) -> int:
        return hash(self._b58)


class ValueWithExpiration(NamedTuple):
    """A value and when it expires (DHT time, seconds); for a dictionary key, ``value`` maps
    each subkey to a ``ValueWithExpiration``."""

    value: Any
    expiration_time: float


def _key_bytes(what: str, key: Key) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"DHT {what} must be str or bytes, not {type(key).__name__}")


def _subkey_out(subkey: bytes) -> Key:
    try:
        return subkey.decode()
    except UnicodeDecodeError:
        return subkey


class DHT:
    """A hivemesh node: joins the swarm through ``initial_peers`` (multiaddrs ending in
    ``/p2p/<peer id>``) and serves the DHT that averagers find each other through.

    ``host_maddrs``: where to listen (default TCP and QUIC on all interfaces, random ports);
    ``client_mode``: take no inbound connections (serve nothing; reached through relays);
    ``identity_path``: an Ed25519 key file (created if missing) so the peer id survives
    restarts; ``start``: start now (else call :meth:`run_in_background`). hivemesh's own:
    ``relay`` serves as a relay for peers behind NATs (what ``python -m hivemesh.dht`` does),
    ``external_maddrs`` are addresses others reach this node at, ``start_timeout`` bounds the
    wait to learn this node's reachability, ``swarm_key`` is a private swarm's key file
    (``hivemesh swarm-key FILE`` writes one): only peers holding it connect (over TCP),
    ``metrics_addr`` (``"HOST:PORT"``, port 0 picks one) serves Prometheus metrics at
    ``http://HOST:PORT/metrics`` (:attr:`metrics_addr` tells where).
    """

    def __init__(
        self,
        initial_peers: Optional[Iterable[Any]] = (),
        *,
        host_maddrs: Optional[Sequence[Any]] = None,
        client_mode: bool = False,
        identity_path: Optional[str] = None,
        start: bool = True,
        relay: bool = False,
        external_maddrs: Sequence[Any] = (),
        start_timeout: float = 5.0,
        swarm_key: Optional[str] = None,
        metrics_addr: Optional[str] = None,
        **hivemind_kwargs: Any,
    ):
        for name, value in hivemind_kwargs.items():
            if name not in _IGNORED:
                raise TypeError(f"DHT() got an unexpected keyword argument {name!r}")
            if name == "use_ipfs" and value:
                raise ValueError("hivemesh does not join IPFS; pass initial_peers instead")
            if name == "record_validators" and value:
                raise ValueError("hivemesh's DHT validates records itself (owner subkeys)")
        if initial_peers is None:
            initial_peers = ()
        if isinstance(initial_peers, (str, bytes)):
            raise TypeError("initial_peers must be a list of multiaddrs, not a single string")
        self._config = dict(
            initial_peers=[str(a) for a in initial_peers],
            listen=None if host_maddrs is None else [str(a) for a in host_maddrs],
            client_mode=bool(client_mode),
            identity_path=None if identity_path is None else str(identity_path),
            relay=bool(relay),
            external=[str(a) for a in external_maddrs],
            start_timeout=float(start_timeout),
            swarm_key=None if swarm_key is None else str(swarm_key),
            metrics_listen=None if metrics_addr is None else str(metrics_addr),
        )
        self._node: Optional[_hivemesh.Node] = None
        self.client_mode = bool(client_mode)
        if start:
            self.run_in_background()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        """Starts the node (a no-op if it runs). hivemind's signature; hivemesh always waits
        until the node has joined."""
        if self._node is None:
            self._node = _hivemesh.Node(**self._config)

    @property
    def _native(self) -> _hivemesh.Node:
        if self._node is None:
            raise DHTError("the DHT is not started (start=False): call run_in_background()")
        return self._node

    @property
    def peer_id(self) -> PeerID:
        """This node's peer id."""
        return PeerID(self._native.peer_id)

    @property
    def metrics_addr(self) -> Optional[str]:
        """``HOST:PORT`` of the metrics endpoint (``None`` if not served)."""
        return self._native.metrics_addr

    def metrics_text(self) -> str:
        """The node's metrics in the Prometheus text format (what ``/metrics`` serves)."""
        return self._native.metrics_text()

    def get_visible_maddrs(self, latest: bool = False) -> List[Multiaddr]:
        """Addresses others can join through, each ending with ``/p2p/<peer id>``."""
        return [Multiaddr(a) for a in self._native.visible_maddrs()]

    def reachability(self) -> str:
        """How others reach this node: ``"public"``, ``"punchable"`` (behind a NAT that a
        hole punch gets through), ``"private"`` or ``"unknown"``."""
        return self._native.reachability()[0]

    def store(
        self,
        key: Key,
        value: bytes,
        expiration_time: float,
        subkey: Optional[Key] = None,
        return_future: bool = False,
        **kwargs: Any,
    ) -> bool:
        """Stores ``value`` (bytes) under ``key`` (and ``subkey``) until ``expiration_time``
        (DHT time: :func:`get_dht_time` + seconds). Returns whether the write was stored."""
        if return_future:
            raise ValueError("return_future=True is not supported; call store() in a thread")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"DHT values are bytes, not {type(value).__name__}; serialize them first"
            )
        k = _key_bytes("key", key)
        s = None if subkey is None else _key_bytes("subkey", subkey)
        try:
            self._native.store(k, bytes(value), float(expiration_time), s)
        except DHTError as e:
            warnings.warn(f"DHT store of {key!r} failed: {e}", RuntimeWarning, stacklevel=2)
            return False
        return True

    def get(self, key: Key, latest: bool = True, return_future: bool = False, **kwargs: Any
            ) -> Optional[ValueWithExpiration]:
        """The value under ``key``: a :class:`ValueWithExpiration`, whose ``value`` is bytes,
        or for a key written with subkeys a dict ``{subkey: ValueWithExpiration}``; ``None``
        if there is none (or every write expired)."""
        if return_future:
            raise ValueError("return_future=True is not supported; call get() in a thread")
        got = self._native.get(_key_bytes("key", key))
        if got is None:
            return None
        plain, entries = got
        if plain is not None:
            return ValueWithExpiration(plain[0], plain[1])
        d: Dict[Key, ValueWithExpiration] = {
            _subkey_out(s): ValueWithExpiration(v, e) for s, v, e in entries
        }
        return ValueWithExpiration(d, max(e for _, _, e in entries))

    def is_alive(self) -> bool:
        """Whether the node runs."""
        return self._node is not None and self._node.is_alive

    def shutdown(self) -> None:
        """Stops the node (shut its averagers down first). Idempotent."""
        if self._node is not None:
            self._node.shutdown()

    def __enter__(self) -> "DHT":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        peer = self._node.peer_id if self._node is not None else "-"
        return f"<hivemesh.DHT {peer} {state}>"
