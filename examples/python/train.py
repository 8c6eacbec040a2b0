"""Decentralized training with hivemesh's Python bindings: a PyTorch MLP trained by P peer
processes that average their parameters every few steps, compared with a single-process
baseline.

Usage::

    python examples/python/train.py [--peers 4 --steps 320 --average-every 10]

This is the Python counterpart of ``examples/training.rs`` (which does logistic regression with
the Rust API); its output follows the same layout.

The swarm: the parent process runs a bootstrap ``hivemesh.DHT`` on loopback and starts
``--peers`` peer processes (multiprocessing, "spawn" start method). Each peer joins through the
bootstrap node with a DHT of its own, creates a ``hivemesh.DecentralizedAverager`` over its
model's parameters (``[p.data for p in model.parameters()]``: the averager reads and writes the
parameters in place) and trains on its own shard. After every ``--average-every`` local steps,
and after the last one, it calls ``averager.step()``: every peer waits for all the others
(``target_group_size = min_group_size = --peers``), and afterwards its parameters hold the
average of all peers' parameters.

The data (fixed ``--seed``): ``--samples`` inputs ``x ~ N(0, I)`` in ``--features``
dimensions, targets from a fixed random teacher network (one tanh hidden layer) plus Gaussian
noise of standard deviation ``--noise``, standardized so that predicting the mean scores a loss
of about 1. The loss is the mean squared error; ``--noise`` squared is the best any model can
do. The shards are equal slices of a fixed shuffle (a remainder is dropped). Every peer and the
baseline start from the same initialization (``--seed``).

The baseline: one model trained on the union of the shards for the same number of steps, with
the same optimizer and learning rate, on mini-batches ``--peers`` times as large (each of its
steps sees as many samples as one step of all peers together, so both pass over the data the
same number of times). With plain SGD and ``--average-every 1`` the two are the same algorithm
(averaging the parameters after a step averages the gradients); averaging less often lets the
peers drift apart between rounds, which costs a little loss.

Output: one line per averaging round with peer 0's loss on the whole dataset right after
averaging and the baseline's loss after the same number of steps, then the final losses, the
largest distance between two peers' final parameters (they should be equal, up to rounding),
the averaging steps' durations, and a summary line
``final: peers_loss=L baseline_loss=B ratio=L/B``.

Exit status: 0 if every averaging step succeeded on every peer, the peers ended with the same
parameters (distance below 1e-4), and the peers' loss is within the tolerance of the
baseline's: ``peers_loss <= --tolerance * baseline_loss`` (default 1.5) or
``peers_loss <= baseline_loss + --abs-tolerance`` (default 0.02; the absolute slack is for runs
where both losses approach the noise floor, where a ratio says little). 1 otherwise, with the
reason on stderr. Every wait is bounded (``--setup-timeout``, ``--step-timeout``); on any
failure the peer processes are terminated.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

import hivemesh

from _harness import Failure, next_message, stop_processes

#: Where every node listens: loopback, TCP, a port of the system's choice.
LISTEN = ["/ip4/127.0.0.1/tcp/0"]
#: Hidden units of the teacher network that generates the targets.
TEACHER_HIDDEN = 32
#: Largest distance allowed between two peers' final parameters.
MAX_SPREAD = 1e-4


# ----------------------------------------------------------------------------------------------
# Data, model, training (shared by the peers and the baseline)


def make_dataset(samples: int, features: int, noise: float, seed: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The synthetic regression dataset: ``(x, y)`` with ``x`` of shape ``(samples,
    features)`` and ``y`` of shape ``(samples, 1)``; the same for the same arguments, in any
    process."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w1 = torch.randn(features, TEACHER_HIDDEN, generator=g) * (2.0 / math.sqrt(features))
    b1 = torch.randn(TEACHER_HIDDEN, generator=g) * 0.5
    w2 = torch.randn(TEACHER_HIDDEN, 1, generator=g) / math.sqrt(TEACHER_HIDDEN)
    clean = torch.tanh(x @ w1 + b1) @ w2
    clean = (clean - clean.mean()) / clean.std()
    y = clean + noise * torch.randn(samples, 1, generator=g)
    return x, y


def shard_rows(samples: int, peers: int, seed: int) -> List[torch.Tensor]:
    """The row indices of each peer's shard: equal slices of a fixed shuffle."""
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + 2))
    size = samples // peers
    return [order[p * size:(p + 1) * size] for p in range(peers)]


def make_model(features: int, hidden: int, seed: int) -> nn.Module:
    """The student MLP, initialized from ``seed`` (the same in every process)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """``--optimizer`` over the model's parameters (its state stays local to each peer)."""
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.lr)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)


class Batches:
    """Mini-batches of rows drawn without replacement, reshuffled after every pass."""

    def __init__(self, rows: torch.Tensor, batch: int, seed: int):
        self.rows = rows
        self.batch = batch
        self.gen = torch.Generator().manual_seed(seed)
        self.order = rows[torch.randperm(len(rows), generator=self.gen)]
        self.next = 0

    def __call__(self) -> torch.Tensor:
        if self.next + self.batch > len(self.order):
            self.order = self.rows[torch.randperm(len(self.rows), generator=self.gen)]
            self.next = 0
        idx = self.order[self.next:self.next + self.batch]
        self.next += self.batch
        return idx


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
             ) -> None:
    """One optimizer step on the batch ``(x, y)``."""
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error of ``model`` on ``(x, y)``."""
    return nn.functional.mse_loss(model(x), y).item()


def flat_parameters(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, concatenated (a copy)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def average_after(step: int, args: argparse.Namespace) -> bool:
    """Whether peers average after local step ``step`` (counted from 0): every
    ``--average-every`` steps, and after the last one (the same on every peer, so that their
    ``step()`` calls pair up)."""
    return (step + 1) % args.average_every == 0 or step + 1 == args.steps


def round_steps(args: argparse.Namespace) -> List[int]:
    """The number of local steps done before each averaging round."""
    return [s + 1 for s in range(args.steps) if average_after(s, args)]


def train_baseline(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor
                   ) -> Tuple[List[float], float]:
    """Trains the single-process baseline on all the data; returns its loss after as many
    steps as the peers did before each round, and its final loss."""
    model = make_model(args.features, args.hidden, args.seed)
    opt = make_optimizer(model, args)
    rows = torch.cat(shard_rows(args.samples, args.peers, args.seed))
    batches = Batches(rows, args.batch * args.peers, args.seed + 1)
    losses = []
    for step in range(args.steps):
        idx = batches()
        sgd_step(model, opt, x[idx], y[idx])
        if average_after(step, args):
            losses.append(evaluate(model, x, y))
    return losses, evaluate(model, x, y)


# ----------------------------------------------------------------------------------------------
# A peer process


def peer_main(p: int, args: argparse.Namespace, initial_peers: List[str], results: Any,
              start: Any, finish: Any) -> None:
    """Peer ``p``: joins the swarm, trains on its shard, averages on schedule, and reports to
    the parent through ``results``: ``("ready", p)``, ``("round", p, round, steps, loss,
    group_size, seconds, error)`` after every averaging step (``error`` is ``None`` if it
    succeeded), ``("final", p, parameters)``, or ``("fatal", p, traceback)``. ``start`` and
    ``finish`` are barriers of all peers: training starts once every peer is ready (so the
    first round does not wait for the slowest start), and nobody leaves the swarm before every
    peer has finished."""
    torch.set_num_threads(1)  # P peers share the machine's cores
    dht: Optional[hivemesh.DHT] = None
    averager: Optional[hivemesh.DecentralizedAverager] = None
    try:
        x, y = make_dataset(args.samples, args.features, args.noise, args.seed)
        rows = shard_rows(args.samples, args.peers, args.seed)[p]
        batches = Batches(rows, args.batch, args.seed + 10 + p)
        model = make_model(args.features, args.hidden, args.seed)
        opt = make_optimizer(model, args)

        dht = hivemesh.DHT(initial_peers=initial_peers, host_maddrs=LISTEN, start=True)
        averager = hivemesh.DecentralizedAverager(
            [param.data for param in model.parameters()],
            dht,
            prefix=args.prefix,
            target_group_size=args.peers,
            min_group_size=args.peers,
            min_matchmaking_time=args.min_matchmaking_time,
            start=True,
        )
        results.put(("ready", p))
        start.wait(timeout=args.setup_timeout)

        rnd = 0
        for step in range(args.steps):
            idx = batches()
            sgd_step(model, opt, x[idx], y[idx])
            if not average_after(step, args):
                continue
            began = time.perf_counter()
            group_size, error = 0, None
            try:
                group = averager.step(gather={"peer": p}, timeout=args.step_timeout)
                if group is None:
                    error = "no group formed in time"
                else:
                    group_size = len(group)
                    members = sorted(g["peer"] for g in group.values())
                    if members != list(range(args.peers)):
                        error = f"averaged with peers {members}, not all {args.peers}"
            except Exception as e:  # a failed round is reported, training goes on
                error = f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - began
            results.put(("round", p, rnd, step + 1, evaluate(model, x, y), group_size,
                         seconds, error))
            rnd += 1

        # The averaged tensors are the model's own parameters: read them under the lock.
        with averager.get_tensors() as tensors:
            final = flat_parameters(tensors)
        results.put(("final", p, final.tolist()))
        finish.wait(timeout=args.setup_timeout + args.step_timeout)
    except BaseException:
        results.put(("fatal", p, traceback.format_exc()))
        sys.exit(1)
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


# ----------------------------------------------------------------------------------------------
# The parent


def run_peers(args: argparse.Namespace, baseline_losses: List[float], n_rounds: int
              ) -> Tuple[Dict[int, torch.Tensor], Dict[int, List[Tuple[float, Optional[str]]]]]:
    """Starts the bootstrap node and the peer processes, prints peer 0's rounds as they come,
    and returns every peer's final parameters and its steps' ``(seconds, error)``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start, finish = ctx.Barrier(args.peers), ctx.Barrier(args.peers)
    bootstrap = hivemesh.DHT(host_maddrs=LISTEN, start=True)
    procs = []
    finals: Dict[int, torch.Tensor] = {}
    steps: Dict[int, List[Tuple[float, Optional[str]]]] = {p: [] for p in range(args.peers)}
    ok = False
    try:
        initial_peers = [str(a) for a in bootstrap.get_visible_maddrs()]
        for p in range(args.peers):
            proc = ctx.Process(target=peer_main, name=f"peer-{p}", daemon=True,
                               args=(p, args, initial_peers, results, start, finish))
            proc.start()
            procs.append(proc)

        ready = 0
        # Nothing may be silent for longer than this (a step, or the setup).
        quiet_limit = args.setup_timeout + args.step_timeout
        while len(finals) < args.peers:
            stage = "starting" if ready < args.peers else "training"
            msg = next_message(results, procs, quiet_limit,
                               f"({stage}; {ready}/{args.peers} ready)", done=finals)
            kind, p = msg[0], msg[1]
            if kind == "ready":
                ready += 1
            elif kind == "round":
                _, _, rnd, step, loss, group_size, seconds, error = msg
                steps[p].append((seconds, error))
                if error is not None:
                    print(f"peer {p}: averaging round {rnd + 1} failed after {seconds:.3f} s: "
                          f"{error}", file=sys.stderr, flush=True)
                if p == 0:
                    status = (f"group of {group_size}" if error is None else "FAILED")
                    rw, sw = len(str(n_rounds)), len(str(args.steps))
                    print(f"round {rnd + 1:>{rw}} (step {step:>{sw}}): "
                          f"peer 0 loss={loss:.4f}   baseline loss={baseline_losses[rnd]:.4f}   "
                          f"({status}, {seconds * 1e3:.1f} ms)", flush=True)
            elif kind == "final":
                finals[p] = torch.tensor(msg[2])
            else:
                raise Failure(f"peer {p}: unexpected message {msg!r}")
        ok = True
    finally:
        # After a success the peers leave on their own (once every peer reported); on any
        # failure they are stopped at once.
        stop_processes(procs, grace=args.step_timeout if ok else 0.0)
        bootstrap.shutdown()
        results.close()
    return finals, steps


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Decentralized training of a PyTorch MLP over hivemesh averagers, compared "
                    "with a single-process baseline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--peers", type=int, default=4, help="peer processes (one shard each)")
    parser.add_argument("--steps", type=int, default=320,
                        help="local optimizer steps per peer (and baseline steps)")
    parser.add_argument("--average-every", type=int, default=10,
                        help="local steps between two averaging rounds")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data, the shards, the batch order and the init")
    parser.add_argument("--tolerance", type=float, default=1.5,
                        help="pass if peers_loss <= TOLERANCE x baseline_loss ...")
    parser.add_argument("--abs-tolerance", type=float, default=0.02,
                        help="... or peers_loss <= baseline_loss + ABS_TOLERANCE")
    parser.add_argument("--samples", type=int, default=4096, help="samples in the dataset")
    parser.add_argument("--features", type=int, default=16, help="input features")
    parser.add_argument("--noise", type=float, default=0.1,
                        help="standard deviation of the target noise")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    parser.add_argument("--batch", type=int, default=32,
                        help="a peer's mini-batch (the baseline's is --peers times larger)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--prefix", default="train", help="the averagers' key prefix")
    parser.add_argument("--min-matchmaking-time", type=float, default=1.0,
                        help="seconds before a smaller group would close (none can: "
                             "min_group_size = --peers; full groups close at once)")
    parser.add_argument("--step-timeout", type=float, default=60.0,
                        help="seconds an averaging step may take")
    parser.add_argument("--setup-timeout", type=float, default=120.0,
                        help="seconds the peers may take to start")
    args = parser.parse_args(argv)
    checks = [
        (args.peers >= 2, "--peers must be at least 2"),
        (args.steps >= 1, "--steps must be at least 1"),
        (args.average_every >= 1, "--average-every must be at least 1"),
        (args.batch >= 1 and args.samples // args.peers >= args.batch,
         "every shard needs at least one batch: --samples / --peers >= --batch >= 1"),
        (args.features >= 1 and args.hidden >= 1, "--features and --hidden must be positive"),
        (args.tolerance >= 1.0 and args.abs_tolerance >= 0.0,
         "--tolerance must be at least 1 and --abs-tolerance non-negative"),
        (args.step_timeout > 0 and args.setup_timeout > 0, "timeouts must be positive"),
    ]
    for good, message in checks:
        if not good:
            parser.error(message)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    torch.set_num_threads(1)
    x, y = make_dataset(args.samples, args.features, args.noise, args.seed)
    baseline_losses, base_loss = train_baseline(args, x, y)
    n_rounds = len(baseline_losses)
    shard = args.samples // args.peers
    epochs = args.steps * args.batch / shard
    print(f"{args.samples} samples x {args.features} features, {args.peers} peers x "
          f"{shard} samples, batch {args.batch} (baseline {args.batch * args.peers}), "
          f"{args.optimizer} lr {args.lr}, {args.steps} steps ({epochs:.1f} epochs), "
          f"averaging every {args.average_every} steps ({n_rounds} rounds)", flush=True)

    try:
        finals, steps = run_peers(args, baseline_losses, n_rounds)
    except Failure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    model = make_model(args.features, args.hidden, args.seed)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(finals[0], model.parameters())
    loss = evaluate(model, x, y)
    spread = max((finals[p] - finals[0]).norm().item() for p in finals)
    times = sorted(s for s, e in steps[0] if e is None)  # peer 0's, as the Rust example
    failed = {p: sum(e is not None for _, e in steps[p]) for p in steps}
    ratio = loss / base_loss if base_loss > 0 else math.inf
    print(f"final: decentralized loss={loss:.4f}")
    print(f"final: baseline      loss={base_loss:.4f}")
    print(f"final: noise floor   loss={args.noise ** 2:.4f}")
    print(f"final: max distance between peers' parameters = {spread:.3e}")
    if times:
        print(f"averaging: {len(times)} steps per peer, median "
              f"{times[len(times) // 2] * 1e3:.1f} ms, slowest {times[-1] * 1e3:.1f} ms")
    print(f"final: peers_loss={loss:.4f} baseline_loss={base_loss:.4f} ratio={ratio:.3f}")
    print(f"done in {time.monotonic() - began:.1f} s", flush=True)

    problems = []
    if any(failed.values()):
        problems.append("averaging steps failed: " + ", ".join(
            f"peer {p}: {n}/{len(steps[p])}" for p, n in failed.items() if n))
    if any(len(steps[p]) != n_rounds for p in steps):
        problems.append(f"not every peer averaged {n_rounds} times")
    if not spread < MAX_SPREAD:
        problems.append(f"peers ended with different parameters (distance {spread:.3e})")
    if not (loss <= args.tolerance * base_loss or loss <= base_loss + args.abs_tolerance):
        problems.append(f"the peers' loss {loss:.4f} is not within {args.tolerance}x or "
                        f"+{args.abs_tolerance} of the baseline's {base_loss:.4f}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
