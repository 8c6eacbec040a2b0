"""Shared fixtures: a bootstrap DHT on loopback that every test's peers join through."""

import pytest

import hivemesh

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def bootstrap():
    """A bootstrap node on loopback; yields its join addresses."""
    dht = hivemesh.DHT(host_maddrs=LOOPBACK, start=True)
    try:
        yield [str(a) for a in dht.get_visible_maddrs()]
    finally:
        dht.shutdown()


@pytest.fixture
def make_dht(bootstrap):
    """Starts DHT nodes joined through the bootstrap; shuts them all down afterwards."""
    made = []

    def make(**kwargs):
        dht = hivemesh.DHT(initial_peers=bootstrap, host_maddrs=LOOPBACK, start=True, **kwargs)
        made.append(dht)
        return dht

    yield make
    for dht in made:
        dht.shutdown()
