"""hivemind's quickstart, collaborative training with ``Optimizer``, runnable with no download:
N peer processes and a late joiner train one model together, each with a progress bar, and
the final loss is printed beside a single-process baseline's.

Usage::

    python examples/python/collaborative.py [--peers 4] [--epochs 8] [--use-local-updates]
                                            [--backend hivemesh|hivemind]

The script is written as hivemind's quickstart is, against ``hivemind.DHT`` and
``hivemind.Optimizer``; ``--backend hivemind`` runs it on hivemind itself (``pip install
hivemind``) and the default on hivemesh, the only difference being the module imported as
``hm``. The data: a synthetic 10-class problem (32 features, classes from a fixed random
teacher network, 5% label noise), each peer drawing its own shuffled batches of 32 from a
training set of 20,000 samples; the loss is measured on 4,000 held-out samples.

The swarm: the parent process runs the first peer's DHT as the bootstrap node (like the
quickstart's first terminal) and starts ``--peers`` peer processes; after the swarm reaches
epoch ``--late-epoch`` a late joiner starts, calls ``opt.load_state_from_peers()`` as the
quickstart's second terminal does, and trains with the others. Every peer stops once its
``local_epoch`` reaches ``--epochs``.

The baseline: the same model and SGD optimizer trained in one process for as many steps of
``--target-batch-size`` samples as the swarm has epochs (``use_local_updates=False`` is exactly
that algorithm: one optimizer step per epoch on the average gradient of the epoch's samples).
With ``--use-local-updates`` the peers step on every batch and average parameters once per
epoch; the baseline is then one process taking as many steps of 32 samples as the swarm's
epochs hold.

Output: a line each time a peer reaches an epoch (``peer I reached epoch E at T s``), per peer
a line ``peer I: epoch E loss L accuracy A steps S`` (S: its calls to ``opt.step()``), then
``final: backend=B mode=M peers=N epochs=E wall_s=W loss=L baseline_loss=BL``. Exit status 0
when every peer (the late joiner too) reached the final epoch, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import queue
import subprocess
import sys
import threading
from typing import Any
import time

FEATURES, CLASSES, HIDDEN = 32, 10, 64


def make_data(seed: int, n: int):
    """``n`` samples of the synthetic task (the same for every peer and the baseline)."""
    import torch

    g = torch.Generator().manual_seed(4242)
    w1 = torch.randn(FEATURES, 48, generator=g) / FEATURES ** 0.5
    w2 = torch.randn(48, CLASSES, generator=g) / 48 ** 0.5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    noisy = torch.rand(n, generator=g) < 0.05
    y[noisy] = torch.randint(0, CLASSES, (int(noisy.sum()),), generator=g)
    return x, y


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def evaluate(model) -> tuple:
    import torch
    from torch.nn import functional as F

    x, y = make_data(7, 4000)
    with torch.no_grad():
        out = model(x)
        return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


class _Lines:
    """A peer's messages to the parent: JSON lines on stdout."""

    def put(self, msg: tuple) -> None:
        print("@@" + json.dumps(list(msg)), flush=True)


class _Stdin:
    """The parent's go: a line on stdin."""

    def wait(self) -> None:
        sys.stdin.readline()


def peer(index: int, backend: str, initial_peers: list, args: argparse.Namespace, late: bool,
         results: Any, go: Any) -> None:
    """One peer: the quickstart's training script."""
    try:
        import torch
        from torch.nn import functional as F

        hm = importlib.import_module(backend)  # `import hivemind as hm` or `import hivemesh as hm`
        torch.set_num_threads(1)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        dht = hm.DHT(initial_peers=initial_peers, start=True,
                     host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        opt = hm.Optimizer(
            dht=dht,
            run_id="quickstart_run",
            batch_size_per_step=32,
            target_batch_size=args.target_batch_size,
            optimizer=opt,
            use_local_updates=args.use_local_updates,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=30.0,
            verbose=False,
        )
        results.put(("ready", index))
        go.wait()  # the first peers start training together (the late joiner: at once)
        if late:
            opt.load_state_from_peers()
        x_all, y_all = make_data(1, 20000)
        gen = torch.Generator().manual_seed(100 + index)
        bar = None
        if args.progress:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                print("--progress needs tqdm (pip install tqdm): no bar", file=sys.stderr)
            else:
                bar = tqdm(desc=f"peer {index}", position=index, leave=False)
        last_epoch, steps = opt.local_epoch, 0
        deadline = time.monotonic() + args.timeout
        while opt.local_epoch < args.epochs and time.monotonic() < deadline:
            for batch in torch.randperm(len(x_all), generator=gen).split(32):
                time.sleep(args.step_time)  # the compute of a real model's step
                opt.zero_grad()
                loss = F.cross_entropy(model(x_all[batch]), y_all[batch])
                loss.backward()
                opt.step()
                steps += 1
                if hasattr(opt, "report_metrics"):  # hivemesh: the loss for `hivemesh monitor`
                    opt.report_metrics(loss=loss.item(), name=f"peer {index}")
                if bar is not None:
                    bar.desc = f"peer {index} epoch {opt.local_epoch} loss {loss.item():.3f}"
                    bar.update()
                if opt.local_epoch != last_epoch:
                    last_epoch = opt.local_epoch
                    results.put(("epoch", index, last_epoch))
                if opt.local_epoch >= args.epochs or time.monotonic() > deadline:
                    break
        loss, acc = evaluate(model)
        results.put(("done", index, opt.local_epoch, loss, acc, steps))
        # Keep serving the state to whoever is still catching up: the parent ends this
        # process once every peer is done.
        threading.Event().wait()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        results.put(("fatal", index, f"{e!r}\n{traceback.format_exc()}"))


def baseline(args: argparse.Namespace) -> float:
    import torch
    from torch.nn import functional as F

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x_all, y_all = make_data(1, 20000)
    gen = torch.Generator().manual_seed(5)
    if args.use_local_updates:
        steps, batch = args.epochs * args.target_batch_size // 32, 32
    else:
        steps, batch = args.epochs, args.target_batch_size
    for _ in range(steps):
        idx = torch.randint(0, len(x_all), (batch,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
    return evaluate(model)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["hivemesh", "hivemind"], default="hivemesh")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--late-epoch", type=int, default=2)
    p.add_argument("--target-batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=None,
                   help="SGD's learning rate (default 1.0 synchronous, 0.01 with local updates: at 0.1 "
                        "one process's local steps plateau at their noise)")
    p.add_argument("--matchmaking-time", type=float, default=3.0)
    p.add_argument("--use-local-updates", action="store_true")
    p.add_argument("--no-late-joiner", action="store_true")
    p.add_argument("--progress", action="store_true", help="a tqdm progress bar per peer")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--step-time", type=float, default=0.05,
                   help="seconds of simulated compute per batch (this MLP alone takes ~1 ms, "
                        "far less than the CNN of hivemind's quickstart)")
    p.add_argument("--run-peer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", default=None, help=argparse.SUPPRESS)
    p.add_argument("--late", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_peer is not None:  # one peer process (started by the parent)
        if args.lr is None:
            args.lr = 0.01 if args.use_local_updates else 1.0
        peer(args.run_peer, args.backend, json.loads(args.initial_peers), args, args.late,
             _Lines(), _Stdin())
        return 0
    if args.peers < 1 or args.epochs < 1:
        p.error("--peers and --epochs must be positive")
    if args.lr is None:
        args.lr = 0.01 if args.use_local_updates else 1.0

    hm = importlib.import_module(args.backend)
    dht = hm.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial_peers = [str(a) for a in dht.get_visible_maddrs()]
    print("To join the training, use initial_peers =", initial_peers, flush=True)

    # Every peer is a process of its own (this script with --run-peer), as in the quickstart's
    # terminals; its messages come back as JSON lines on its stdout.
    messages: "queue.Queue[tuple]" = queue.Queue()
    procs: list = []

    def launch(index: int, late: bool) -> None:
        cmd = [sys.executable, __file__, "--run-peer", str(index), "--initial-peers",
               json.dumps(initial_peers)] + (["--late"] if late else []) + sys.argv[1:]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)

        def read() -> None:
            for line in proc.stdout:
                if line.startswith("@@"):
                    messages.put(tuple(json.loads(line[2:])))
        threading.Thread(target=read, daemon=True).start()

    started = time.monotonic()
    for i in range(args.peers):
        launch(i, False)
    late_index = None if args.no_late_joiner else args.peers
    done, fatal, ready, late_started = {}, None, set(), False
    deadline = started + args.timeout
    while True:
        try:
            msg = messages.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline:
                fatal = "timed out"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                fatal = "a peer process exited"
                break
            continue
        kind, index = msg[0], msg[1]
        if kind == "ready":
            ready.add(index)
            if len(ready) == args.peers and index < args.peers:
                started = time.monotonic()  # wall time counts from here
                for p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
            elif index == late_index:
                procs[-1].stdin.write("go\n")
                procs[-1].stdin.flush()
            continue
        if kind == "fatal":
            fatal = f"peer {index}: {msg[2]}"
            break
        if kind == "epoch":
            print(f"peer {index} reached epoch {msg[2]} at {time.monotonic() - started:.1f} s",
                  flush=True)
            if late_index is not None and not late_started and msg[2] >= args.late_epoch:
                late_started = True
                launch(late_index, True)
        if kind == "done":
            done[index] = msg[2:]
            if len(done) == len(procs) and (late_index is None or late_index in done):
                break
    wall = time.monotonic() - started
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    dht.shutdown()
    if fatal:
        print(f"failed: {fatal}", file=sys.stderr)
        return 1
    for index in sorted(done):
        epoch, loss, acc, steps = done[index]
        print(f"peer {index}: epoch {epoch} loss {loss:.4f} accuracy {acc:.3f} steps {steps}")
    losses = [done[i][1] for i in done]
    mode = "local_updates" if args.use_local_updates else "synchronous"
    print(f"final: backend={args.backend} mode={mode} peers={len(done)} epochs={args.epochs} "
          f"wall_s={wall:.1f} loss={sum(losses) / len(losses):.4f} "
          f"baseline_loss={baseline(args):.4f}", flush=True)
    reached = all(done[i][0] >= args.epochs for i in done)
    return 0 if reached and len(done) == len(procs) else 1


if __name__ == "__main__":
    sys.exit(main())
