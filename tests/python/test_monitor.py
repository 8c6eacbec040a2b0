"""``python -m hivemesh.monitor`` (the Rust monitor inside the Python process) and the
optimizer's metrics record (``Optimizer.report_metrics``): a lone peer trains and reports its
loss, the monitor, a separate process, shows it through ``/api/state``; bad flags fail
clearly. (The page itself is tested in a browser by tests/integration/monitor.rs.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request
from functools import partial

import pytest
import torch
from torch import nn

import hivemesh
from hivemesh.monitor import Monitor
from polling import wait_for

LIMIT = 120.0


def get_state(url):
    with urllib.request.urlopen(url + "api/state", timeout=LIMIT) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("args, needle", [
    ([], "--initial-peer"),
    (["--initial-peer", "nonsense", "--http", "127.0.0.1:0"], "initial peer 'nonsense'"),
    (["--initial-peer", "/ip4/127.0.0.1/tcp/9", "--http", "localhost"], "http 'localhost'"),
    (["--initial-peer", "/ip4/127.0.0.1/tcp/9", "--refresh", "0"], "--refresh must be between"),
    (["--initial-peer", "/ip4/127.0.0.1/tcp/9", "--run-id", ""], "--run-id must not be empty"),
    (["--initial-peer", "/ip4/127.0.0.1/tcp/9", "--swarm-key", "/nonexistent/swarm.key"],
     "swarm key"),
])
def test_bad_flags_fail_clearly(args, needle):
    r = subprocess.run([sys.executable, "-m", "hivemesh.monitor", *args], capture_output=True,
                       text=True, timeout=LIMIT)
    assert r.returncode == 2, r
    assert needle in r.stderr, r.stderr


def test_the_monitor_shows_an_optimizer_that_reports_its_loss(make_dht, bootstrap):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = hivemesh.Optimizer(
        dht=make_dht(), run_id="monitored", target_batch_size=8, batch_size_per_step=4,
        params=model.parameters(), optimizer=partial(torch.optim.SGD, lr=0.1),
        matchmaking_time=1.0, averaging_timeout=10.0,
        tracker_opts=dict(min_refresh_period=0.05, max_refresh_period=0.2,
                          default_refresh_period=0.1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hivemesh.monitor", "--initial-peer", bootstrap[0],
         "--run-id", "monitored", "--http", "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0",
         "--refresh", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/"), (url, proc.stderr)
        gen = torch.Generator().manual_seed(1)
        me = str(opt.dht.peer_id)

        def trained_and_shown():
            x = torch.randn(4, 4, generator=gen)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.report_metrics(loss=loss, name="<b>lone</b>")
            state = get_state(url)
            rows = [p for p in state["peers"] if p["peer_id"] == me]
            if rows and rows[0]["loss"] is not None and rows[0]["epoch"] >= 2:
                return state, rows[0]
            return None

        state, row = wait_for(trained_and_shown, "the optimizer's metrics on the monitor")
        assert state["run_id"] == "monitored"
        assert state["global"]["num_peers"] == 1
        assert state["global"]["target_batch_size"] == 8
        assert row["name"] == "<b>lone</b>" and row["status"] == "live"
        assert row["mode"] == "node" and math.isfinite(row["loss"])
        assert any(p["loss"] is not None for p in state["history"])
        # A NaN loss is left out, not published (and does not raise).
        opt.report_metrics(loss=float("nan"))
        opt.shutdown()
        wait_for(lambda: [
            p for p in get_state(url)["peers"] if p["peer_id"] == me and p["status"] == "gone"
        ], "the optimizer to be gone")
    finally:
        opt.shutdown()
        proc.send_signal(2)
        try:
            assert proc.wait(timeout=LIMIT) == 0, proc.stderr.read()
        finally:
            proc.kill()


def test_the_monitor_class_in_process(bootstrap):
    with Monitor(bootstrap, "nobody_here", "127.0.0.1:0", refresh_period=0.1,
                 listen=["/ip4/127.0.0.1/tcp/0"]) as monitor:
        state = wait_for(lambda: (s := monitor.state())["fetches"] > 0 and s, "a first fetch")
        assert state["peers"] == [] and state["global"]["num_peers"] == 0
        assert get_state(monitor.url)["run_id"] == "nobody_here"
    with pytest.raises(ValueError, match="max_peers"):
        Monitor(bootstrap, "x", "127.0.0.1:0", max_peers=0)


def test_the_monitor_joins_a_private_swarm_with_its_key(tmp_path):
    """``swarm_key`` (``--swarm-key``): with the swarm's key the monitor joins and fetches;
    without it, it cannot join."""
    import os

    key = tmp_path / "swarm.key"
    key.write_text("/key/swarm/psk/1.0.0/\n/base16/\n" + os.urandom(32).hex() + "\n")
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    with hivemesh.DHT(host_maddrs=loopback, swarm_key=str(key)) as boot:
        addrs = [str(a) for a in boot.get_visible_maddrs()]
        with Monitor(addrs, "private_run", "127.0.0.1:0", refresh_period=0.1,
                     listen=loopback, swarm_key=str(key)) as monitor:
            wait_for(lambda: monitor.state()["fetches"] > 0, "a first fetch")
        with pytest.raises(hivemesh.DHTError, match="initial peer"):
            Monitor(addrs, "private_run", "127.0.0.1:0", listen=loopback)
