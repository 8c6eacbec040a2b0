"""DiLoCo with ``hivemesh.DiLoCoOptimizer``: N peers (threads of this process, each with its
own DHT node) train one model, averaging once every ``--inner-steps`` steps, and the final loss
is printed beside one process's training on the same number of samples with the inner
optimizer, averaging every step (data parallel).

Usage::

    python examples/python/diloco.py [--peers 4] [--epochs 6] [--inner-steps 20]
                                     [--codec none|float16|blockwise8]

The task is ``collaborative.py``'s synthetic 10-class problem. Inner optimizer: Adam (lr
3e-3), every peer drawing its own batches of ``--batch-size``; outer optimizer: SGD with
Nesterov momentum 0.9, lr 0.7 (DiLoCo's). The baseline: Adam on batches of ``peers x
batch_size`` for ``epochs x inner_steps`` steps, the data-parallel run that averages every
step (``inner_steps`` times as many rounds).

Output: ``peer I: epoch E loss L``, then ``final: peers=N epochs=E inner_steps=H codec=C
outer_rounds=R data_parallel_rounds=D loss=L baseline_loss=BL wall_s=W``. Exit status 0 when
every peer reached the final epoch and the peers' mean loss is within 1.5x of the baseline's.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch
from torch.nn import functional as F

import hivemesh
from hivemesh.compression import BlockwiseQuantization, Float16Compression, NoCompression
from collaborative import evaluate, make_data, make_model

CODECS = {"none": NoCompression, "float16": Float16Compression,
          "blockwise8": BlockwiseQuantization}


def peer(index: int, dht: hivemesh.DHT, model: torch.nn.Module, args: argparse.Namespace,
         data: tuple, results: dict) -> None:
    """One peer: trains until its outer epoch reaches ``--epochs``."""
    x_all, y_all = data
    opt = hivemesh.DiLoCoOptimizer(
        dht=dht, run_id="diloco_example", batch_size=args.batch_size,
        num_inner_steps=args.inner_steps, params=model.parameters(),
        inner_optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True),
        grad_compression=CODECS[args.codec](), matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0, timeout_waiting_for_peers=max(10.0, args.matchmaking_time),
        tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5), verbose=args.verbose)
    try:
        gen = torch.Generator().manual_seed(100 + index)
        deadline = time.monotonic() + args.timeout
        while opt.local_epoch < args.epochs and time.monotonic() < deadline:
            batch = torch.randint(0, len(x_all), (args.batch_size,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x_all[batch]), y_all[batch]).backward()
            opt.step()
        results[index] = (opt.local_epoch, evaluate(model)[0])
    finally:
        # Stay until every peer is done: a slower one may still need this one's round.
        results["barrier"].wait(timeout=args.timeout)
        opt.shutdown()


def baseline(args: argparse.Namespace, data: tuple) -> float:
    """Data parallel: Adam on the swarm's batch every step, as many steps as inner steps."""
    x_all, y_all = data
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(args.epochs * args.inner_steps):
        batch = torch.randint(0, len(x_all), (args.peers * args.batch_size,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x_all[batch]), y_all[batch]).backward()
        opt.step()
    return evaluate(model)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6, help="outer steps")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--codec", choices=list(CODECS), default="none")
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--verbose", action="store_true", help="log every outer step")
    args = p.parse_args()
    if args.peers < 1 or args.epochs < 1 or args.inner_steps < 1:
        p.error("--peers, --epochs and --inner-steps must be positive")
    torch.set_num_threads(1)
    data = make_data(1, 20000)

    boot = hivemesh.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial = [str(a) for a in boot.get_visible_maddrs()]
    dhts = [hivemesh.DHT(initial_peers=initial, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            for _ in range(args.peers)]
    results: dict = {"barrier": threading.Barrier(args.peers)}
    started = time.monotonic()
    # Every peer starts from the same parameters (DiLoCo averages updates, not parameters),
    # made here one after the other: make_model() seeds torch's global generator.
    models = [make_model() for _ in dhts]
    threads = [threading.Thread(target=peer, args=(i, dht, models[i], args, data, results),
                                daemon=True) for i, dht in enumerate(dhts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.timeout + 60)
    wall = time.monotonic() - started
    for dht in dhts + [boot]:
        dht.shutdown()

    finished = [results.get(i) for i in range(args.peers)]
    for i, r in enumerate(finished):
        print(f"peer {i}: " + ("no result" if r is None else f"epoch {r[0]} loss {r[1]:.4f}"))
    if any(r is None or r[0] < args.epochs for r in finished):
        print("a peer did not reach the final epoch", file=sys.stderr)
        return 1
    loss = sum(r[1] for r in finished) / len(finished)
    base = baseline(args, data)
    print(f"final: peers={args.peers} epochs={args.epochs} inner_steps={args.inner_steps} "
          f"codec={args.codec} outer_rounds={args.epochs} "
          f"data_parallel_rounds={args.epochs * args.inner_steps} loss={loss:.4f} "
          f"baseline_loss={base:.4f} wall_s={wall:.1f}", flush=True)
    return 0 if loss <= 1.5 * base else 1


if __name__ == "__main__":
    sys.exit(main())
