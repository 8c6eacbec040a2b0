"""``hivemesh.DHT``: a node of the swarm, with hivemind's ``DHT`` interface.

Keys and subkeys are ``str`` (stored as UTF-8) or ``bytes``. Values are anything msgpack
carries (as hivemind's): ``None``, bools, ints, floats, ``str``, ``bytes``, lists (tuples come
back as lists) and dicts of them. Stored from Python, a value is the byte ``0xC1`` (one that
msgpack never uses) followed by its msgpack encoding; :meth:`DHT.get` decodes a value that
starts with ``0xC1`` and holds exactly one msgpack object, and returns any other value as the
raw ``bytes`` it is (what Rust peers write: their announcements, declarations, ...). Nothing
from the network is ever unpickled. ``None`` is a value like any other (hivemind's
``ProgressTracker`` stores it for its own subkey at shutdown): ``get`` returns it as
``ValueWithExpiration(None, expiration)``, and it supersedes an earlier write of the same key
and subkey until it expires; it deletes nothing.

Forking: a process that forks after creating a DHT (PyTorch ``DataLoader`` workers do) keeps
working in the parent. In the child, a DHT or averager created before the fork cannot be used
(calls raise ``ShutdownError``; the child holds no copy of its threads); the child may create
new ones of its own.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Union

import msgpack

from hivemesh import _hivemesh
from hivemesh._hivemesh import DHTError, get_dht_time

__all__ = ["DHT", "Multiaddr", "PeerID", "ValueWithExpiration", "DHTError", "get_dht_time"]

Key = Union[str, bytes]

# hivemind's DHT arguments about its processes and threads: accepted, nothing to do here.
_IGNORED = {
    "daemon",
    "await_ready",
    "num_workers",
    "max_workers",
    "parallel_rpc",
    "shutdown_timeout",
}

# hivemind's DHT, DHTNode and P2P arguments that mean nothing here: accepted with a warning
# (``record_validators`` and ``use_ipfs`` only when they ask for something). Anything else is a
# TypeError.
_WARNED = {
    "record_validators", "use_ipfs", "use_relay", "use_auto_relay", "use_relay_hop",
    "use_relay_discovery", "auto_nat", "tls", "quic", "nat_port_map", "conn_manager",
    "dht_mode", "force_reachability", "check_if_identity_free", "idle_timeout",
    "startup_timeout", "daemon_listen_maddr", "persistent_conn_max_msg_size", "quiet",
    "ensure_bootstrap_success", "wait_timeout", "bucket_size", "num_replicas", "depth_modulo",
    "cache_locally", "cache_on_store", "cache_size", "cache_refresh_before_expiry",
    "reuse_get_requests", "blacklist_time", "backoff_rate", "refresh_timeout",
    "bootstrap_timeout", "strict", "p2p", "node",
}

# A value stored from Python: this byte (msgpack never uses it), then its msgpack encoding.
_TAG = b"\xc1"


def _encode_value(value: Any) -> bytes:
    try:
        return _TAG + msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(
            f"DHT values must be msgpack-able (None, bool, int, float, str, bytes, lists and "
            f"dicts of them), not {type(value).__name__}: {e}"
        ) from None


def _decode_value(data: bytes) -> Any:
    """The value ``data`` carries: decoded if stored from Python, else the raw bytes."""
    if data[:1] != _TAG:
        return data
    try:
        return msgpack.unpackb(data[1:], raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError):
        # Raw bytes that happen to start with the tag (extra data, truncated, bad UTF-8).
        return data


class Multiaddr(str):
    """A multiaddr; ``str()`` of it is what ``initial_peers`` takes."""

    __slots__ = ()


class PeerID:
    """A peer's id (base58, as libp2p prints it)."""

    __slots__ = ("_b58",)

    def __init__(self, b58: Union[str, bytes]):
        if isinstance(b58, (bytes, bytearray)):
            b58 = _hivemesh.peer_id_to_base58(bytes(b58))
        if not isinstance(b58, str) or not b58:
            raise ValueError(f"not a peer id: {b58!r}")
        self._b58 = b58

    @classmethod
    def from_bytes(cls, data: bytes) -> "PeerID":
        """The peer id whose libp2p binary form (a multihash) is ``data``."""
        return cls(_hivemesh.peer_id_to_base58(bytes(data)))

    def to_bytes(self) -> bytes:
        """libp2p's binary form of the id (a multihash; what base58 spells)."""
        return _hivemesh.peer_id_to_bytes(self._b58)

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
        announce_maddrs: Sequence[Any] = (),
        **hivemind_kwargs: Any,
    ):
        for name, value in hivemind_kwargs.items():
            if name in _IGNORED:
                continue
            if name not in _WARNED:
                raise TypeError(f"DHT() got an unexpected keyword argument {name!r}")
            if name == "use_ipfs" and value:
                warnings.warn("hivemesh does not join IPFS (use_ipfs=True is ignored): pass "
                              "initial_peers", RuntimeWarning, stacklevel=2)
            elif name == "record_validators":
                if value:
                    warnings.warn("record_validators are ignored: hivemesh's DHT validates "
                                  "records itself (signed owner subkeys, size limits)",
                                  RuntimeWarning, stacklevel=2)
            elif name != "use_ipfs":
                warnings.warn(f"DHT(): {name}= means nothing in hivemesh and is ignored",
                              RuntimeWarning, stacklevel=2)
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
            # hivemind's announce_maddrs are addresses others reach this node at.
            external=[str(a) for a in external_maddrs] + [str(a) for a in announce_maddrs],
            start_timeout=float(start_timeout),
            swarm_key=None if swarm_key is None else str(swarm_key),
            metrics_listen=None if metrics_addr is None else str(metrics_addr),
        )
        self._node: Optional[_hivemesh.Node] = None
        self._ready = threading.Event()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._executor_lock = threading.Lock()
        self.client_mode = bool(client_mode)
        if start:
            self.run_in_background()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        """Starts the node (a no-op if it runs). hivemind's signature; hivemesh always waits
        until the node has joined."""
        if self._node is None:
            self._node = _hivemesh.Node(**self._config)
            self._ready.set()

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Returns once the node runs (at once after ``start=True`` or
        :meth:`run_in_background`, which wait until it has joined); raises ``TimeoutError`` if
        it was not started within ``timeout`` seconds."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the DHT was not started within {timeout} s")

    def _in_background(self, call: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        """``call()`` on this DHT's threads (the native calls release the GIL)."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=8, thread_name_prefix="hivemesh-dht")
            return self._executor.submit(call)

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
        value: Any,
        expiration_time: float,
        subkey: Optional[Key] = None,
        return_future: bool = False,
        **kwargs: Any,
    ) -> Union[bool, "concurrent.futures.Future[bool]"]:
        """Stores ``value`` (anything msgpack carries, see the module docs; ``None`` too) under
        ``key`` (and ``subkey``) until ``expiration_time`` (DHT time: :func:`get_dht_time` +
        seconds). Returns whether it was stored: a replica holds it when read back, or for a
        node that knows no other peer, its own store took it. A failed write (expired, too
        large, another peer's owner subkey, the network) warns and returns ``False``. With
        ``return_future=True`` a ``concurrent.futures.Future`` of that at once."""
        k = _key_bytes("key", key)
        s = None if subkey is None else _key_bytes("subkey", subkey)
        data = _encode_value(value)
        expiration = float(expiration_time)
        native = self._native
        if return_future:
            return self._in_background(lambda: self._store(native, key, k, data, expiration, s))
        return self._store(native, key, k, data, expiration, s)

    @staticmethod
    def _store(native: _hivemesh.Node, key: Key, k: bytes, data: bytes, expiration: float,
               s: Optional[bytes]) -> bool:
        try:
            return native.store(k, data, expiration, s) > 0
        except DHTError as e:
            warnings.warn(f"DHT store of {key!r} failed: {e}", RuntimeWarning, stacklevel=3)
            return False

    def get(self, key: Key, latest: bool = True, return_future: bool = False, **kwargs: Any
            ) -> Union[Optional[ValueWithExpiration],
                       "concurrent.futures.Future[Optional[ValueWithExpiration]]"]:
        """The value under ``key``: a :class:`ValueWithExpiration` of the value, or for a key
        written with subkeys of a dict ``{subkey: ValueWithExpiration}``; ``None`` if there is
        none (or every write expired). With ``return_future=True`` a
        ``concurrent.futures.Future`` of that at once."""
        k = _key_bytes("key", key)
        native = self._native
        if return_future:
            return self._in_background(lambda: self._get(native, k))
        return self._get(native, k)

    @staticmethod
    def _get(native: _hivemesh.Node, k: bytes) -> Optional[ValueWithExpiration]:
        got = native.get(k)
        if got is None:
            return None
        plain, entries = got
        if plain is not None:
            return ValueWithExpiration(_decode_value(plain[0]), plain[1])
        d: Dict[Key, ValueWithExpiration] = {
            _subkey_out(s): ValueWithExpiration(_decode_value(v), e) for s, v, e in entries
        }
        return ValueWithExpiration(d, max(e for _, _, e in entries))

    def is_alive(self) -> bool:
        """Whether the node runs."""
        return self._node is not None and self._node.is_alive

    def shutdown(self) -> None:
        """Stops the node (shut its averagers down first). Idempotent."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
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
