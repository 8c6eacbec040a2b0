"""The background traffic of an idle training swarm, component by component (issue 30).

``train_lm.py``'s peers send bytes even when no averaging round runs: the DHT node's upkeep,
the progress tracker's publications and fetches, the averagers' announcements. This script
measures them without the model's compute: ``--peers`` processes on ``train_lm.py``'s
network-namespace bed (unlimited links), each running one *mode* for ``--seconds``, stepping
at ``--rate`` steps per second (``--batch`` samples each) where the mode steps:

* ``dht``: a ``hivemesh.DHT`` and nothing else (the node's upkeep: Kademlia, identify, ping,
  AutoNAT, the relay directory);
* ``tracker``: the DHT and a ``ProgressTracker`` (``max_refresh_period`` 2 s, as
  ``DiLoCoOptimizer`` sets it) to which every step reports its samples;
* ``diloco``: the DHT and a ``DiLoCoOptimizer`` over one small tensor, with so many inner
  steps per outer step that no round runs: the benchmark's idle peer, without the model.

Each peer reads its ``eth0``'s ``tx_bytes`` and ``tx_packets`` after a ``--warmup`` and again
``--seconds`` later, and the node's DHT write counters (``hivemesh_dht_writes_total``, by
whether the key's replicas were looked up first, and ``hivemesh_dht_write_bytes_total``, the
record bytes its writes sent, summed over the replicas) at the same two moments. Printed: per
mode, the mean over the peers of the bytes and packets per second on the wire and the
counters' rates. (The node has no per-protocol byte counters: the wire bytes are everything.)

Needs root (``ip netns``). Example::

    sudo python benches/idle_traffic.py --modes dht,tracker,diloco --seconds 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import (Bed, add_peer_args, read_jsonl, run_peers, wait_file,  # noqa: E402
                      write_file)

MODES = ("dht", "tracker", "diloco")
COUNTER = re.compile(r'^hivemesh_(dht_writes|dht_write_bytes)_total(?:\{([^}]*)\})? (\d+)', re.M)


def read_stat(iface: str, name: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/{name}") as fh:
        return int(fh.read())


def node_counters(text: str) -> Dict[str, int]:
    """``{"dht_writes replicas=known": n, "dht_write_bytes": m, ...}`` from the node's metrics
    text."""
    out = {}
    for name, labels, value in COUNTER.findall(text):
        parts = sorted(p.replace('"', "") for p in labels.split(",") if p)
        out[f"{name} {','.join(parts)}".strip()] = int(value)
    return out


def snapshot(dht: Any) -> Dict[str, Any]:
    text = dht.metrics_text() if hasattr(dht, "metrics_text") else ""
    return {"t": time.time(), "tx_bytes": read_stat("eth0", "tx_bytes"),
            "tx_packets": read_stat("eth0", "tx_packets"),
            "counters": node_counters(text)}


def run_peer(args: argparse.Namespace, rank: int, rundir: str) -> None:
    import hivemesh
    import torch

    maddrs = [f"/ip4/{args.ip}/tcp/0"]
    boot = os.path.join(rundir, "bootstrap.json")
    if rank == 0:
        dht = hivemesh.DHT(host_maddrs=maddrs, start=True)
        write_file(boot, json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    else:
        dht = hivemesh.DHT(host_maddrs=maddrs, initial_peers=json.loads(wait_file(boot, 60)),
                           start=True)
    step: Any = lambda: None  # noqa: E731
    closers: List[Any] = []
    if args.mode == "tracker":
        tracker = hivemesh.ProgressTracker(
            dht, "idle_progress", target_batch_size=10 ** 9, max_refresh_period=2.0, start=True)
        samples = [0]

        def step() -> None:
            samples[0] += args.batch
            tracker.report_local_progress(0, samples[0])

        closers.append(tracker.shutdown)
    elif args.mode == "diloco":
        param = torch.nn.Parameter(torch.zeros(1024))
        opt = hivemesh.DiLoCoOptimizer(
            dht=dht, run_id="idle", batch_size=args.batch, num_inner_steps=10 ** 6,
            params=[param], inner_optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
            outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True),
            matchmaking_time=2.0, averaging_timeout=60.0, timeout_waiting_for_peers=30.0)

        def step() -> None:
            param.grad = torch.zeros_like(param)
            opt.step()

        closers.append(opt.shutdown)
    write_file(os.path.join(rundir, f"ready{rank}"), "1")
    t0 = float(wait_file(os.path.join(rundir, "go"), 120))
    marks = (t0 + args.warmup, t0 + args.warmup + args.seconds)
    snaps = []
    n = 0
    while len(snaps) < 2:
        now = time.time()
        if now >= marks[len(snaps)]:
            snaps.append(dict(snapshot(dht), steps=n))
            continue
        next_step = t0 + n / args.rate
        if now >= next_step:
            step()
            n += 1
            continue
        time.sleep(max(0.0, min(next_step, marks[len(snaps)]) - now))
    write_file(os.path.join(rundir, f"result{rank}.json"),
               json.dumps({"rank": rank, "steps": n, "snaps": snaps}))
    with contextlib.suppress(TimeoutError):
        for r in range(args.peers):
            wait_file(os.path.join(rundir, f"result{r}.json"), 60)
    for close in closers:
        with contextlib.suppress(Exception):
            close()
    dht.shutdown()


def run_mode(bed: Bed, args: argparse.Namespace, mode: str, outdir: str) -> Dict[str, Any]:
    rundir = os.path.join(outdir, mode)
    os.makedirs(rundir, exist_ok=True)
    for f in os.listdir(rundir):
        os.remove(os.path.join(rundir, f))
    run_peers(bed, __file__, rundir,
              [dict(vars(args), mode=mode, ip=ip) for ip in bed.ips[:args.peers]],
              start_timeout=120, run_timeout=args.warmup + args.seconds + 120)
    peers = []
    for rank in range(args.peers):
        path = os.path.join(rundir, f"result{rank}.json")
        if os.path.exists(path):
            peers.append(json.load(open(path)))
    return {"mode": mode, "peers": peers, "load": [round(x, 2) for x in os.getloadavg()]}


def summarize(run: Dict[str, Any]) -> Dict[str, float]:
    """Per-second rates, mean over the peers."""
    sums: Dict[str, float] = {}
    for p in run["peers"]:
        a, b = p["snaps"]
        dt = b["t"] - a["t"]
        rates = {"wire bytes": (b["tx_bytes"] - a["tx_bytes"]) / dt,
                 "wire packets": (b["tx_packets"] - a["tx_packets"]) / dt,
                 "steps": (b["steps"] - a["steps"]) / dt}
        for k, v in b["counters"].items():
            rates[k] = (v - a["counters"].get(k, 0)) / dt
        for k, v in rates.items():
            sums[k] = sums.get(k, 0.0) + v
    n = max(1, len(run["peers"]))
    return {k: v / n for k, v in sums.items()}


def report(runs: List[Dict[str, Any]]) -> str:
    lines = []
    for run in runs:
        s = summarize(run)
        lines.append(f"## {run['mode']} ({len(run['peers'])} peers, load {run['load']})")
        for k in sorted(s, key=lambda k: (not k.startswith("wire"), k)):
            if s[k] >= 0.05 or k.startswith("wire"):
                lines.append(f"  {k:60s} {s[k]:10.1f} /s")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rate", type=float, default=2.5, help="steps per second per peer")
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--out", default=None)
    p.add_argument("--id", default=str(os.getpid() % 10000))
    p.add_argument("--report", nargs="+", default=None, help="print the summary of runs.jsonl")
    add_peer_args(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.peer is not None:
        run_peer(argparse.Namespace(**json.loads(args.peer_args)), args.peer, args.rundir)
        return 0
    if args.report:
        print(report(read_jsonl(args.report)))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}: one of {', '.join(MODES)}")
    outdir = args.out or tempfile.mkdtemp(prefix="idle_traffic_")
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "runs.jsonl")
    print(f"results: {path}", flush=True)
    runs = []
    bed = Bed(f"b3i{args.id}", args.peers)
    try:
        for mode in modes:
            run = run_mode(bed, args, mode, outdir)
            runs.append(run)
            with open(path, "a") as fh:
                fh.write(json.dumps(run) + "\n")
            print(report([run]), flush=True)
    finally:
        bed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
