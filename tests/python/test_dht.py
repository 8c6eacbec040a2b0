"""hivemesh.DHT: hivemind's DHT interface, and `python -m hivemesh.dht`."""

import os
import signal
import subprocess
import sys

import pytest

import hivemesh
from hivemesh import get_dht_time


def test_store_and_get(make_dht):
    a, b = make_dht(), make_dht()
    now = get_dht_time()
    assert a.store("plain", b"hello", now + 60)
    got = b.get("plain", latest=True)
    assert got.value == b"hello" and got.expiration_time == pytest.approx(now + 60)
    assert a.store("dict", b"one", now + 60, subkey="x")
    assert b.store("dict", b"two", now + 70, subkey=b"\xff")
    got = a.get("dict")
    assert got.value == {
        "x": hivemesh.ValueWithExpiration(b"one", pytest.approx(now + 60)),
        b"\xff": hivemesh.ValueWithExpiration(b"two", pytest.approx(now + 70)),
    }
    assert a.get("missing") is None
    with pytest.warns(RuntimeWarning, match="expired"):
        assert a.store("expired", b"x", now - 1) is False
    assert a.get("expired") is None


def test_identity_and_addresses(make_dht, tmp_path):
    path = tmp_path / "id.key"
    first = make_dht(identity_path=str(path))
    peer = first.peer_id
    addrs = first.get_visible_maddrs()
    assert addrs and all(str(a).endswith(f"/p2p/{peer}") for a in addrs)
    first.shutdown()
    assert not first.is_alive()
    again = make_dht(identity_path=str(path))
    assert again.peer_id == peer, "the identity file keeps the peer id"


def test_bad_arguments(bootstrap):
    with pytest.raises(ValueError, match="multiaddr"):
        hivemesh.DHT(initial_peers=["not a multiaddr"])
    with pytest.raises(ValueError, match="/p2p/"):
        hivemesh.DHT(initial_peers=["/ip4/127.0.0.1/tcp/1"])
    with pytest.raises(TypeError):
        hivemesh.DHT(initial_peers="/ip4/127.0.0.1/tcp/1")
    with pytest.raises(TypeError):
        hivemesh.DHT(no_such_argument=True)
    with hivemesh.DHT(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as dht:
        with pytest.raises(TypeError, match="msgpack"):
            dht.store("k", {"not msgpack-able": object()}, get_dht_time() + 10)
        with pytest.raises(TypeError):
            dht.get(123)
    assert not dht.is_alive()


def test_start_false_then_run_in_background(bootstrap):
    dht = hivemesh.DHT(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       start=False)
    assert not dht.is_alive()
    with pytest.raises(hivemesh.DHTError):
        dht.peer_id
    dht.run_in_background(await_ready=True)
    try:
        assert dht.is_alive()
        assert dht.store("k", b"v", get_dht_time() + 30)
    finally:
        dht.shutdown()


def test_python_m_hivemesh_dht(make_dht):
    proc = subprocess.Popen(
        [sys.executable, "-m", "hivemesh.dht", "--listen", "/ip4/127.0.0.1/tcp/0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        addr = proc.stdout.readline().strip()
        assert "/p2p/" in addr, proc.stderr.read() if proc.poll() is not None else addr
        with hivemesh.DHT(initial_peers=[addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as a:
            assert a.store("via-bootstrap", b"yes", get_dht_time() + 60)
            with hivemesh.DHT(initial_peers=[addr],
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as b:
                assert b.get("via-bootstrap").value == b"yes"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "as a relay" in err and "shutting down" in err


def test_python_m_hivemesh_dht_bad_flag():
    proc = subprocess.run([sys.executable, "-m", "hivemesh.dht", "--listen", "nonsense"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "multiaddr" in proc.stderr


def _swarm_key(path):
    path.write_text("/key/swarm/psk/1.0.0/\n/base16/\n" + os.urandom(32).hex() + "\n")
    return str(path)


def test_private_swarm(tmp_path):
    """Peers holding the swarm key join and share the DHT; one without it (or with another
    key) cannot join; an unreadable key file is a ValueError."""
    key = _swarm_key(tmp_path / "swarm.key")
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    with hivemesh.DHT(host_maddrs=loopback, swarm_key=key) as first:
        addrs = [str(a) for a in first.get_visible_maddrs()]
        assert all("/quic" not in a for a in addrs), addrs
        with hivemesh.DHT(initial_peers=addrs, host_maddrs=loopback, swarm_key=key) as member:
            now = get_dht_time()
            assert member.store("private", b"v", now + 60)
            assert first.get("private", latest=True).value == b"v"
        for other in [None, _swarm_key(tmp_path / "other.key")]:
            with pytest.raises(hivemesh.DHTError, match="initial peer"):
                hivemesh.DHT(initial_peers=addrs, host_maddrs=loopback, swarm_key=other)
    with pytest.raises(ValueError, match="swarm key"):
        hivemesh.DHT(host_maddrs=loopback, swarm_key=str(tmp_path / "missing.key"))
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(ValueError, match="swarm key"):
        hivemesh.DHT(host_maddrs=loopback, swarm_key=str(tmp_path / "bad.key"))


def test_metrics_endpoint(make_dht):
    import urllib.error
    import urllib.request

    a = make_dht(metrics_addr="127.0.0.1:0")
    b = make_dht()
    assert b.metrics_addr is None
    host, port = a.metrics_addr.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert a.store("metrics-key", b"v", get_dht_time() + 60)
    with urllib.request.urlopen(f"http://{a.metrics_addr}/metrics", timeout=60) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    assert text.rstrip().endswith("# EOF")
    series = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(series["hivemesh_connected_peers"]) >= 1
    assert float(series['hivemesh_rounds_total{result="ok"}']) == 0
    assert "hivemesh_dht_records" in a.metrics_text()
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://{a.metrics_addr}/other", timeout=60)
    assert missing.value.code == 404
    with pytest.raises(ValueError, match="HOST:PORT"):
        make_dht(metrics_addr="not an address")


def test_values_of_any_msgpack_type(make_dht):
    """hivemind stores dicts, floats, lists, None: they come back as they went in, on another
    node too; subkeys stay str/bytes."""
    a, b = make_dht(), make_dht()
    now = get_dht_time()
    values = {
        "dict": {"epoch": 3, "samples": 128, "rate": 12.5, "client": False, "peer": b"\x01\x02"},
        "list": [1, "two", 3.0, None, [b"x"]],
        "float": 0.25,
        "int": -(2 ** 40),
        "str": "hello",
        "bytes": b"\xc1 starts with the tag byte",
        "none": None,
    }
    for name, value in values.items():
        assert a.store(f"typed-{name}", value, now + 60), name
    for name, value in values.items():
        got = b.get(f"typed-{name}", latest=True)
        assert got is not None and got.value == value, name
        assert got.expiration_time == pytest.approx(now + 60)
    assert a.store("progress", {"epoch": 1}, now + 60, subkey=b"peer-a")
    # hivemind's ProgressTracker stores None for its own subkey at shutdown: a value that
    # supersedes the earlier write and reads back as None.
    assert a.store("progress", None, now + 61, subkey=b"peer-a")
    assert b.store("progress", {"epoch": 2}, now + 60, subkey="peer-b")
    got = a.get("progress").value
    assert got["peer-a"].value is None, "subkeys that are UTF-8 come back as str"
    assert got["peer-b"].value == {"epoch": 2}
    with pytest.raises(TypeError, match="msgpack"):
        a.store("bad", object(), now + 60)


def test_raw_bytes_from_rust_peers_stay_bytes():
    """Values not written from Python (a Rust peer's raw bytes) come back as the bytes they
    are, even when they start with the tag byte."""
    from hivemesh.dht import _decode_value, _encode_value

    for raw in [b"", b"\x00\x01", b"\x01" + bytes(8), b"\xc1", b"\xc1\x92\x01",
                b"\xc1\x01\x02", b"\xc1\xa2\xff\xfe"]:
        assert _decode_value(raw) == raw, raw
    for value in [None, b"", b"\xc1", {"a": [1, 2.5]}, "x"]:
        assert _decode_value(_encode_value(value)) == value


def test_futures_ready_and_peer_ids(make_dht):
    import concurrent.futures

    a, b = make_dht(), make_dht()
    a.wait_until_ready()
    a.wait_until_ready(timeout=1)
    stored = a.store("future", {"k": 1}, get_dht_time() + 60, return_future=True)
    assert isinstance(stored, concurrent.futures.Future)
    assert stored.result(timeout=60) is True
    got = b.get("future", return_future=True)
    assert isinstance(got, concurrent.futures.Future)
    assert got.result(timeout=60).value == {"k": 1}
    missing = b.get("no-such-key", return_future=True)
    assert missing.result(timeout=60) is None
    peer = a.peer_id
    raw = peer.to_bytes()
    assert isinstance(raw, bytes) and raw[:2] == b"\x00\x24", "an identity multihash"
    assert hivemesh.PeerID.from_bytes(raw) == peer
    assert hivemesh.PeerID(raw) == peer
    with pytest.raises(ValueError):
        hivemesh.PeerID.from_bytes(b"junk")
    late = hivemesh.DHT(start=False)
    with pytest.raises(TimeoutError):
        late.wait_until_ready(timeout=0.1)


def test_store_reports_whether_a_replica_took_it(bootstrap):
    """A node that knows nobody stores into its own store; a write that nobody takes (an
    expired one) is False."""
    with hivemesh.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as lone:
        assert lone.store("alone", 1.5, get_dht_time() + 60) is True
        assert lone.get("alone").value == 1.5
        with pytest.warns(RuntimeWarning):
            assert lone.store("alone", 2, get_dht_time() - 1) is False


def test_hivemind_keywords_warn_and_announce_maddrs(bootstrap):
    with pytest.warns(RuntimeWarning, match="record_validators"):
        with hivemesh.DHT(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          record_validators=[object()]):
            pass
    with pytest.warns(RuntimeWarning, match="use_relay"):
        with hivemesh.DHT(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          use_relay=False, use_ipfs=False):
            pass
    with pytest.warns(RuntimeWarning, match="IPFS"):
        with hivemesh.DHT(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          use_ipfs=True):
            pass
    announced = "/ip4/10.1.2.3/tcp/4001"
    with hivemesh.DHT(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                      announce_maddrs=[announced]) as dht:
        visible = [str(a) for a in dht.get_visible_maddrs()]
        assert f"{announced}/p2p/{dht.peer_id}" in visible, visible
