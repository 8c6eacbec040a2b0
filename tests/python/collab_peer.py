"""One peer of a collaborative training run with ``hivemesh.Optimizer`` (a process of its
own, started by ``test_optimizer.py``; also what the late joiner and the killed peer run).

The task: an MLP regressing a fixed random teacher (same for every peer), each peer drawing
its own batches; every peer starts from the same initialization. The peer trains until its
``local_epoch`` reaches ``--epochs``, printing ``epoch E`` lines on stdout as it goes, then
prints one ``result {json}`` line (its epoch, the tracker's global epoch, the samples it fed
in before the last epoch ended and those its epoch updates used, its parameters and momentum buffers, the learning rate, how
often it reloaded the state) and keeps serving the swarm until ``--stop-file`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

import hivemesh

FEATURES, HIDDEN = 8, 16


def teacher_batch(gen: torch.Generator, n: int):
    """``n`` samples of the task: ``x ~ N(0, I)``, ``y`` from the fixed teacher."""
    tgen = torch.Generator().manual_seed(12345)
    w1 = torch.randn(FEATURES, HIDDEN, generator=tgen) / FEATURES ** 0.5
    w2 = torch.randn(HIDDEN, 1, generator=tgen) / HIDDEN ** 0.5
    x = torch.randn(n, FEATURES, generator=gen)
    return x, torch.tanh(x @ w1) @ w2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_opt(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.5)


def make_sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def eval_loss(model: nn.Module) -> float:
    x, y = teacher_batch(torch.Generator().manual_seed(999), 2048)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--initial-peer", action="append", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--target-batch-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--client", action="store_true")
    p.add_argument("--late", action="store_true", help="load the state from peers first")
    p.add_argument("--stop-file", required=True)
    p.add_argument("--flags", default="{}", help="Optimizer keyword arguments, JSON")
    p.add_argument("--run-id", default="collab")
    p.add_argument("--step-time", type=float, default=0.2,
                   help="seconds of simulated compute per step (a real model's forward and "
                        "backward take time; without it the swarm would overshoot its target)")
    args = p.parse_args()
    flags = json.loads(args.flags)

    dht = hivemesh.DHT(initial_peers=args.initial_peer, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       client_mode=args.client, start=True)
    model = make_model()
    pre_made = flags.pop("pre_made_optimizer", False)
    if pre_made:
        opt_args = dict(optimizer=make_opt(model.parameters()))
        opt_args["scheduler"] = make_sched(opt_args["optimizer"])
    else:
        opt_args = dict(params=model.parameters(), optimizer=make_opt, scheduler=make_sched)
    opt = hivemesh.Optimizer(
        dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size, matchmaking_time=1.0, averaging_timeout=30.0,
        load_state_timeout=60.0, verbose=True, tracker_opts=dict(min_refresh_period=0.1,
        max_refresh_period=0.5, default_refresh_period=0.2), **opt_args, **flags)

    reloads = 0
    original_load = opt.load_state_from_peers

    def counting_load(**kwargs):
        nonlocal reloads
        reloads += 1
        return original_load(**kwargs)

    opt.load_state_from_peers = counting_load
    if args.late:
        opt.load_state_from_peers()
        print(f"loaded epoch {opt.local_epoch}", flush=True)

    gen = torch.Generator().manual_seed(1000 + args.index)
    samples, counted, last_epoch = 0, 0, opt.local_epoch
    deadline = time.monotonic() + 600
    while opt.local_epoch < args.epochs:
        if time.monotonic() > deadline:
            print("timed out", file=sys.stderr, flush=True)
            return 2
        time.sleep(args.step_time)  # the compute of a real step
        x, y = teacher_batch(gen, args.batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        if not flags.get("reuse_grad_buffers"):
            opt.zero_grad()
        loss.backward()
        epoch_before = opt.local_epoch
        reported = opt.tracker.local_progress.samples_accumulated
        opt.step()
        if epoch_before < args.epochs:
            samples += args.batch_size
        if opt.local_epoch == epoch_before + 1:
            counted += reported + args.batch_size  # the samples this epoch's update used
        if opt.local_epoch != last_epoch:
            last_epoch = opt.local_epoch
            print(f"epoch {last_epoch}", flush=True)

    # Let delayed updates land before reading the parameters.
    opt.state_averager.step(wait_for_delayed_updates=True)
    momentum = [opt.opt.state[q].get("momentum_buffer") for q in opt.opt.param_groups[0]["params"]]
    result = dict(
        index=args.index,
        local_epoch=opt.local_epoch,
        global_epoch=opt.tracker.global_epoch,
        samples=samples,
        counted=counted,
        params=[q.detach().flatten().tolist() for q in model.parameters()],
        momentum=[None if m is None else m.flatten().tolist() for m in momentum],
        lr=opt.opt.param_groups[0]["lr"],
        loss=eval_loss(model),
        reloads=reloads,
    )
    report_and_serve(result, args.stop_file, deadline, opt, dht)
    return 0


def report_and_serve(result: dict, stop_file: str, deadline: float, opt, dht) -> None:
    """Prints the ``result`` line, keeps serving the state and the DHT to the others until
    ``stop_file`` exists (or ``deadline``), then shuts down."""
    print("result " + json.dumps(result), flush=True)
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
