"""One peer of a DiLoCo run with ``hivemesh.DiLoCoOptimizer`` (a process of its own, started by
``test_diloco.py``; the in-process tests use :func:`make_optimizer` and :func:`train` too).

The task is ``collab_peer.py``'s: an MLP regressing a fixed random teacher, every peer drawing
its own batches from the same initialization. The process prints ``ready`` once its optimizer
is up, waits for ``--go-file`` (so that every peer starts training together), trains until its
``local_epoch`` reaches ``--epochs`` (printing ``epoch E`` lines), prints one ``result {json}``
line (epochs, outer parameters and momentum, loss) and serves the swarm until ``--stop-file``
exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import collab_peer  # noqa: E402  (the task: teacher, model, evaluation)

import hivemesh  # noqa: E402

#: Fast tracker refreshes for short epochs.
TRACKER_OPTS = dict(min_refresh_period=0.05, max_refresh_period=0.3, default_refresh_period=0.1)


def make_outer(params):
    """DiLoCo's outer optimizer: SGD, Nesterov momentum 0.9, lr 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def make_inner(params):
    return torch.optim.Adam(params, lr=0.01)


def make_optimizer(dht, model, run_id, *, num_inner_steps=5, batch_size=8, **kwargs):
    """A ``DiLoCoOptimizer`` with the tests' settings (``kwargs`` override them)."""
    args = dict(matchmaking_time=0.5, next_chunk_timeout=5.0, averaging_timeout=30.0,
                load_state_timeout=60.0, tracker_opts=TRACKER_OPTS, verbose=True)
    args.update(kwargs)
    return hivemesh.DiLoCoOptimizer(
        dht=dht, run_id=run_id, batch_size=batch_size, num_inner_steps=num_inner_steps,
        outer_optimizer=make_outer, inner_optimizer=make_inner, params=list(model.parameters()),
        **args)


def train(opt, model, index, epochs, step_time=0.0, on_epoch=None, deadline=600.0):
    """Trains until ``opt.local_epoch`` reaches ``epochs`` (``on_epoch(epoch)`` at each new
    one); raises ``TimeoutError`` after ``deadline`` seconds."""
    gen = torch.Generator().manual_seed(1000 + index)
    last, give_up = opt.local_epoch, time.monotonic() + deadline
    while opt.local_epoch < epochs:
        if time.monotonic() > give_up:
            raise TimeoutError(f"peer {index} stuck at epoch {opt.local_epoch}")
        if step_time:
            time.sleep(step_time)  # the compute of a real step
        x, y = collab_peer.teacher_batch(gen, opt.batch_size)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if opt.local_epoch != last:
            last = opt.local_epoch
            if on_epoch is not None:
                on_epoch(last)


def outer_state(opt):
    """The outer parameters and momentum buffers, as lists."""
    params = opt.outer_parameters
    return dict(
        params=[p.detach().flatten().tolist() for p in params],
        momentum=[opt.outer_optimizer.state[p]["momentum_buffer"].flatten().tolist()
                  for p in params],
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--initial-peer", action="append", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--num-inner-steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--go-file", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--run-id", default="diloco")
    p.add_argument("--flags", default="{}", help="DiLoCoOptimizer keyword arguments, JSON")
    args = p.parse_args()

    torch.set_num_threads(1)
    dht = hivemesh.DHT(initial_peers=args.initial_peer, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       start=True)
    model = collab_peer.make_model()
    opt = make_optimizer(dht, model, args.run_id, num_inner_steps=args.num_inner_steps,
                         **json.loads(args.flags))
    print("ready", flush=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(args.go_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    train(opt, model, args.index, args.epochs, step_time=args.step_time,
          on_epoch=lambda e: print(f"epoch {e}", flush=True))
    result = dict(index=args.index, local_epoch=opt.local_epoch,
                  global_epoch=opt.tracker.global_epoch, loss=collab_peer.eval_loss(model),
                  **outer_state(opt))
    collab_peer.report_and_serve(result, args.stop_file, deadline, opt, dht)
    return 0


if __name__ == "__main__":
    sys.exit(main())
