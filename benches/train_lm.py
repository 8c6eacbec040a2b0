"""Training over home links: a character-level transformer LM on the Python standard library's
source, 4 peer processes on a network-namespace bed with ``tbf``-limited links, five ways of
training together (issue 30, item 3).

Usage (root: it makes network namespaces)::

    python benches/train_lm.py [--quick] [--rates 0,20,100] [--configs dp,hivemind,...]
                               [--peers 4] [--steps 600] [--fixed-steps 300] [--out DIR]
                               [--overlap]   # DiLoCo configs with overlap_communication=True
    python benches/train_lm.py --report DIR/results.jsonl [more.jsonl ...]   # the table again

``--quick``: a smoke run (tiny model, 2 peers, 20 steps, every config, unlimited link only;
the ``hivemind`` config needs ``pip install hivemind``, leave it out of ``--configs`` without).
The measured runs (README, docs/architecture.md) used ``--configs dp --steps 300`` for the
reference and ``--steps 600`` for the others, every other setting at its default (the first
``diloco_ef`` rows with the defaults before the sweep: ``--density 0.01 --outer-lr 0.7
--outer-momentum 0.9``).

**Data.** Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (the Python running the
bench), skipping ``site-packages``, ``test``/``tests``/``idle_test`` and ``__pycache__``
directories, sorted by relative path; every ``VAL_EVERY``-th file (index ``% 10 == 7``) is
held out for validation, the rest is the training text (files joined by one ``\\0`` byte).
The vocabulary is the 256 byte values. A peer draws random windows of ``ctx + 1`` bytes from
the training text with its own generator (seed ``1000 + rank``); validation is a fixed set of
``--val-windows`` windows of the held-out text (seed 7), the same for every run.

**Model.** A pre-LayerNorm GPT: byte embedding, learned positions, ``--layers`` blocks of
causal self-attention (``--heads`` heads) and a 4x GELU MLP, width ``--dim``, an untied
output head; defaults 5 x 128, context 128: 1,073,792 parameters. Every peer builds it from
``torch.manual_seed(0)`` (identical starting parameters) and runs with
``torch.set_num_threads(1)``.

**Configurations** (every peer takes ``--steps`` steps of ``--batch`` windows, Adam lr
``--lr`` as the (inner) optimizer; "samples" are windows over the swarm, ``steps x batch x
peers`` at the end):

* ``dp``: per-step data parallel in fp32, the reference: ``torch.distributed`` with the gloo
  backend over the bed; every step all-reduces the flattened fp32 gradients (one buffer) and
  every peer applies Adam to the mean (an effective batch of ``batch x peers``).
* ``hivemind``: hivemind's ``hivemind.Optimizer`` (the installed version, 1.1.12 here) with
  ``use_local_updates=True``: Adam on every local batch, parameters averaged (fp32, hivemind's
  state averager) once per epoch of ``target_batch_size = peers x batch x --inner-steps``
  samples, ``matchmaking_time=--matchmaking-time``, ``averaging_timeout=60``.
* ``hivemesh``: ``hivemesh.Optimizer`` with the same arguments.
* ``diloco``: ``hivemesh.DiLoCoOptimizer``, ``num_inner_steps=--inner-steps``, inner Adam,
  outer SGD (lr ``--outer-lr``, default 0.7, Nesterov momentum ``--outer-momentum``, default
  0.9), fp32 pseudo-gradients.
* ``diloco_ef``: the same with ``grad_compression=ErrorFeedbackTopK(--density, --bits,
  --chunk, reply_bits=--reply-bits)`` (defaults 0.1, 2, 2048, 2) and by default plain outer
  SGD at lr 1.0 (momentum 0): tuned by ``benches/train_lm_sweep.py`` (docs/architecture.md,
  "Training over home links"; the 2-bit replies were tuned there, not run on this bed).

**Bed.** Namespace ``b30<id>-hub`` holds a bridge; peer ``i`` lives in ``b30<id>-p<i>`` with
``eth0`` (10.30.0.<i+1>/24) on it. For a link rate ``R`` Mbit/s (``0``: unlimited) both ends
of each peer's link get ``tbf rate Rmbit burst 256kb latency 100ms`` on egress (the peer's
``eth0``: its uplink; the bridge port: its downlink), as ``tests/netns``'s ``rate_limit`` does.
Every namespace is deleted on exit, Ctrl-C and failure (after killing the processes left in
it, by PID). Each peer is its own process (``ip netns exec NS python train_lm.py --peer``).

**Measures.** Each peer reads its ``eth0``'s ``/sys/class/net/eth0/statistics/tx_bytes``
before it makes anything (DHT, process group) and again after every ``--inner-steps`` steps
and at the end: every byte it sent, DHT and handshakes included. Rank 0 evaluates the
validation loss at step 0 and after every ``--inner-steps`` steps (for DiLoCo: right after the
outer step) on its own model; wall time counts from a common start (after every peer's setup),
evaluation included. Per run: the loss at the fixed sample count (after ``--fixed-steps``
steps per peer), the time at which the validation loss first reaches the target and the mean
bytes per peer up to that evaluation, and the mean bytes per peer over the run. The target is
the reference's (``dp`` on the unlimited link) loss at the fixed sample count times ``1 +
--target-slack`` (1.02). A run stops after ``--steps`` steps or once ``--max-wall`` seconds
have passed (then what it did not reach is reported as not reached).

Output: ``DIR/results.jsonl`` (one JSON object per run, every evaluation) and the markdown
table on stdout (``--report`` prints it again).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

CONFIGS = ("dp", "hivemind", "hivemesh", "diloco", "diloco_ef")
VAL_EVERY, VAL_AT = 10, 7
SKIP_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")


# --- data ------------------------------------------------------------------------------------

def stdlib_files(root: Optional[str] = None) -> Tuple[str, List[str]]:
    """The stdlib's root and its ``.py`` files (relative paths, sorted), test and
    third-party directories skipped."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        files.extend(os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py"))
    return root, sorted(files)


def split_files(files: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(training files, held-out files): every ``VAL_EVERY``-th file is held out."""
    train = [f for i, f in enumerate(files) if i % VAL_EVERY != VAL_AT]
    val = [f for i, f in enumerate(files) if i % VAL_EVERY == VAL_AT]
    return train, val


def load_text(root: str, files: Sequence[str]) -> torch.Tensor:
    """The files' bytes joined by ``\\0``, as a uint8 tensor."""
    parts = []
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            parts.append(fh.read())
    return torch.frombuffer(bytearray(b"\0".join(parts)), dtype=torch.uint8)


def load_corpus(root: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(training text, held-out text) of the stdlib."""
    root, files = stdlib_files(root)
    train, val = split_files(files)
    return load_text(root, train), load_text(root, val)


def sample_windows(text: torch.Tensor, n: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows of ``ctx + 1`` bytes (int64)."""
    starts = torch.randint(0, len(text) - ctx - 1, (n,), generator=gen)
    return torch.stack([text[s:s + ctx + 1] for s in starts.tolist()]).long()


def val_windows(val: torch.Tensor, n: int, ctx: int) -> torch.Tensor:
    """The fixed validation set: ``n`` windows of the held-out text (seed 7)."""
    return sample_windows(val, n, ctx, torch.Generator().manual_seed(7))


# --- model -----------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    """A byte-level GPT."""

    def __init__(self, dim: int = 128, layers: int = 5, heads: int = 4, ctx: int = 128):
        super().__init__()
        if dim % heads:
            raise ValueError("dim must be a multiple of heads")
        self.emb = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(ctx, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


_SEED_LOCK = threading.Lock()


def make_model(args: argparse.Namespace) -> CharLM:
    """The model, from seed 0 (identical on every peer; peers as threads take turns)."""
    with _SEED_LOCK:
        torch.manual_seed(0)
        return CharLM(args.dim, args.layers, args.heads, args.ctx)


def lm_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) over the windows."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, chunk: int = 32) -> float:
    """Validation loss over ``windows`` (in chunks)."""
    total = 0.0
    for part in windows.split(chunk):
        total += float(lm_loss(model, part)) * len(part)
    return total / len(windows)


def params_digest(model: nn.Module) -> str:
    """SHA-256 of the parameters' bytes (peers in lockstep have equal digests)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# --- one peer --------------------------------------------------------------------------------

def read_tx(iface: str) -> Optional[int]:
    """Bytes ``iface`` has sent (this namespace's sysfs), ``None`` without it."""
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as fh:
            return int(fh.read())
    except OSError:
        return None


def wait_file(path: str, timeout: float) -> str:
    """The contents of ``path`` once it exists (written by rename, so never partial)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)
    with open(path) as fh:
        return fh.read()


def write_file(path: str, text: str) -> None:
    """Writes ``path`` atomically."""
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


#: DiLoCo's outer SGD (lr, Nesterov momentum) per configuration when ``--outer-lr`` /
#: ``--outer-momentum`` are not given: DiLoCo's 0.7 / 0.9 in fp32; plain SGD at lr 1 (the
#: peers' mean, applied as is) with error feedback, where momentum overshoots (the sweep in
#: docs/architecture.md, "Training over home links").
OUTER_DEFAULTS = {"diloco": (0.7, 0.9), "diloco_ef": (1.0, 0.0)}


def outer_settings(args: argparse.Namespace, config: str) -> Tuple[float, float]:
    """(outer lr, outer momentum) of ``config``: the flags where given, else its default."""
    lr, momentum = OUTER_DEFAULTS.get(config, (None, None))
    lr = args.outer_lr if args.outer_lr is not None else lr
    momentum = args.outer_momentum if args.outer_momentum is not None else momentum
    return lr, momentum


class Trainer:
    """One config's optimizer and its per-step exchange; ``step()`` after ``backward()``."""

    def __init__(self, args: argparse.Namespace, rank: int, model: nn.Module, rundir: str):
        self.args, self.rank, self.model = args, rank, model
        self.dht = self.opt = None
        self.params = list(model.parameters())
        adam = lambda p: torch.optim.Adam(p, lr=args.lr)  # noqa: E731
        world, cfg = args.peers, args.config
        if cfg == "dp":
            import datetime

            import torch.distributed as dist

            os.environ.setdefault("GLOO_SOCKET_IFNAME", args.iface)
            dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                                    rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=args.max_wall + 120))
            self.dist = dist
            self.opt = adam(self.params)
            self.flat = torch.zeros(sum(p.numel() for p in self.params) + 1)
            return
        backend = __import__("hivemind" if cfg == "hivemind" else "hivemesh")
        maddrs = [f"/ip4/{args.ip}/tcp/0"]
        boot = os.path.join(rundir, "bootstrap.json")
        if rank == 0:
            self.dht = backend.DHT(host_maddrs=maddrs, start=True)
            write_file(boot, json.dumps([str(a) for a in self.dht.get_visible_maddrs()]))
        else:
            initial = json.loads(wait_file(boot, 120))
            self.dht = backend.DHT(host_maddrs=maddrs, initial_peers=initial, start=True)
        common = dict(dht=self.dht, run_id=f"train_lm_{cfg}")
        if cfg in ("hivemind", "hivemesh"):
            self.opt = backend.Optimizer(
                **common, target_batch_size=world * args.batch * args.inner_steps,
                batch_size_per_step=args.batch, optimizer=adam, params=self.params,
                use_local_updates=True, matchmaking_time=args.matchmaking_time,
                averaging_timeout=60.0, verbose=bool(getattr(args, "verbose", False)))
        else:
            from hivemesh.compression import ErrorFeedbackTopK, NoCompression

            codec = ErrorFeedbackTopK(args.density, args.bits, args.chunk,
                                      reply_bits=args.reply_bits) \
                if cfg == "diloco_ef" else NoCompression()
            outer_lr, outer_momentum = outer_settings(args, cfg)
            self.opt = backend.DiLoCoOptimizer(
                **common, batch_size=args.batch, num_inner_steps=args.inner_steps,
                params=self.params, inner_optimizer=adam,
                outer_optimizer=lambda p: torch.optim.SGD(
                    p, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0),
                grad_compression=codec, matchmaking_time=args.matchmaking_time,
                averaging_timeout=60.0, timeout_waiting_for_peers=max(30.0,
                                                                      args.matchmaking_time),
                overlap_communication=bool(getattr(args, "overlap", False)),
                verbose=bool(getattr(args, "verbose", False)))

    def step(self, stop: bool) -> bool:
        """The step on the gradients in ``.grad``; whether the swarm stops (``dp``: any peer
        asking to stop stops all, the flag riding in the all-reduce)."""
        if self.args.config != "dp":
            self.opt.step()
            return stop
        offset = 0
        for p in self.params:
            self.flat[offset:offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
        self.flat[-1] = 1.0 if stop else 0.0
        self.dist.all_reduce(self.flat)
        self.flat /= self.args.peers
        offset = 0
        for p in self.params:
            p.grad.copy_(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.opt.step()
        return bool(self.flat[-1] > 0)

    def zero_grad(self) -> None:
        (self.opt.zero_grad if self.opt is not None else self.model.zero_grad)()

    def shutdown(self) -> None:
        if self.args.config == "dp":
            with contextlib.suppress(Exception):
                self.dist.destroy_process_group()
            return
        with contextlib.suppress(Exception):
            self.opt.shutdown()
        with contextlib.suppress(Exception):
            self.dht.shutdown()


def run_peer(args: argparse.Namespace, rank: int, rundir: str) -> Dict[str, Any]:
    """One peer's run (its result is also written to ``rundir/result<rank>.json``)."""
    torch.set_num_threads(1)
    train, val = load_corpus(args.stdlib)
    windows = val_windows(val, args.val_windows, args.ctx) if rank == 0 else None
    tx0 = read_tx(args.iface)
    model = make_model(args)
    trainer = Trainer(args, rank, model, rundir)
    write_file(os.path.join(rundir, f"ready{rank}"), "1")
    t0 = float(wait_file(os.path.join(rundir, "go"), 300))
    while time.time() < t0:
        time.sleep(0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    per_step = args.batch * args.peers

    def record(step: int) -> None:
        ev = {"step": step, "samples": step * per_step, "t": time.time() - t0,
              "tx": read_tx(args.iface)}
        if rank == 0:
            started = time.perf_counter()
            model.eval()
            ev["loss"] = evaluate(model, windows)
            model.train()
            ev["eval_s"] = time.perf_counter() - started
        evals.append(ev)

    evals: List[Dict[str, Any]] = []
    record(0)
    step, error = 0, None
    try:
        while step < args.steps:
            batch = sample_windows(train, args.batch, args.ctx, gen)
            trainer.zero_grad()
            lm_loss(model, batch).backward()
            over = time.time() - t0 > args.max_wall
            stop = trainer.step(over)
            step += 1
            if step % args.inner_steps == 0 or step == args.steps or stop:
                record(step)
            if stop:
                break
    except Exception as e:  # noqa: BLE001 - reported in the result
        error = repr(e)
    result = {"rank": rank, "config": args.config, "steps": step, "tx0": tx0, "evals": evals,
              "t_end": time.time() - t0, "tx_end": read_tx(args.iface), "error": error,
              "params_sha256": params_digest(model)}
    if args.config != "dp" and hasattr(trainer.opt, "local_epoch"):
        result["epoch"] = int(trainer.opt.local_epoch)
    write_file(os.path.join(rundir, f"result{rank}.json"), json.dumps(result))
    # Serve the others until every peer is done (a slower one may still need this one).
    with contextlib.suppress(TimeoutError):
        for r in range(args.peers):
            wait_file(os.path.join(rundir, f"result{r}.json"), 120)
    trainer.shutdown()
    return result


# --- the bed ---------------------------------------------------------------------------------

def sh(*cmd: str, check: bool = True) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out.stdout


class Bed:
    """The hub namespace with a bridge and one namespace per peer (see the module docs)."""

    def __init__(self, prefix: str, peers: int):
        self.hub = f"{prefix}-hub"
        self.peers = [f"{prefix}-p{i}" for i in range(peers)]
        self.ips = [f"10.30.0.{i + 1}" for i in range(peers)]
        self.made: List[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sh("ip", "netns", "add", self.hub)
        self.made.append(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        for i, (ns, ip) in enumerate(zip(self.peers, self.ips)):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", self.hub, "link", "add", f"port{i}", "type", "veth", "peer", "name",
               "eth0", "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", f"port{i}", "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", f"port{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def set_rate(self, mbit: int) -> None:
        """tbf at ``mbit`` Mbit/s on both ends of every peer's link; 0: no qdisc (unlimited)."""
        for i, ns in enumerate(self.peers):
            for where, dev in ((ns, "eth0"), (self.hub, f"port{i}")):
                if mbit:
                    sh("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                       f"{mbit}mbit", "burst", "256kb", "latency", "100ms")
                else:
                    sh("tc", "-n", where, "qdisc", "del", "dev", dev, "root", check=False)

    def kill_left(self) -> None:
        """SIGKILLs the processes left in the bed's namespaces (by PID: ours, e.g. p2pd)."""
        for ns in self.made:
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        self.kill_left()
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)
        self.made.clear()


def run_peers(bed: Bed, script: str, rundir: str, configs: List[Dict[str, Any]],
              start_timeout: float, run_timeout: float) -> None:
    """Runs ``script --peer RANK`` in peer ``RANK``'s namespace with ``configs[RANK]``, writes
    ``rundir/go`` (the common start, a second ahead) once every peer wrote ``ready<RANK>``,
    and waits for them all (killing what is left on the way out)."""
    procs = []
    try:
        for rank, cfg in enumerate(configs):
            log = open(os.path.join(rundir, f"peer{rank}.log"), "w")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", bed.peers[rank], sys.executable, os.path.abspath(script),
                 "--peer", str(rank), "--rundir", rundir, "--peer-args", json.dumps(cfg)],
                stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.monotonic() + start_timeout
        while not all(os.path.exists(os.path.join(rundir, f"ready{r}"))
                      for r in range(len(configs))):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"a peer failed to start (see {rundir}/peer*.log)")
            time.sleep(0.1)
        write_file(os.path.join(rundir, "go"), repr(time.time() + 1.0))
        for p in procs:
            try:
                p.wait(timeout=run_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        bed.kill_left()


def run_config(bed: Bed, args: argparse.Namespace, config: str, rate: int,
               outdir: str) -> Dict[str, Any]:
    """One run: ``args.peers`` peer processes of ``config`` on the bed at ``rate``."""
    rundir = os.path.join(outdir, f"{config}_{rate}")
    os.makedirs(rundir, exist_ok=True)
    for f in os.listdir(rundir):
        os.remove(os.path.join(rundir, f))
    outer_lr, outer_momentum = outer_settings(args, config)
    peer_args = dict(vars(args), config=config, master=bed.ips[0], port=29530,
                     outer_lr=outer_lr, outer_momentum=outer_momentum)
    load = os.getloadavg()
    run_peers(bed, __file__, rundir, [dict(peer_args, ip=ip) for ip in bed.ips[:args.peers]],
              start_timeout=300, run_timeout=args.max_wall + 300)
    results = []
    for rank in range(args.peers):
        path = os.path.join(rundir, f"result{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    run = {"config": config, "rate": rate, "load": [round(x, 2) for x in load],
           "peers": results, "settings": {k: peer_args[k] for k in SETTINGS}}
    return run


SETTINGS = ("peers", "steps", "fixed_steps", "batch", "ctx", "dim", "layers", "heads", "lr",
            "inner_steps", "outer_lr", "outer_momentum", "density", "bits", "chunk",
            "reply_bits", "overlap", "matchmaking_time", "val_windows", "max_wall")


# --- the table -------------------------------------------------------------------------------

def summarize(run: Dict[str, Any], target: Optional[float]) -> Dict[str, Any]:
    """Loss at the fixed samples, time and bytes to the target, bytes per peer."""
    peers = [p for p in run["peers"] if p is not None]
    rank0 = next((p for p in peers if p["rank"] == 0), None)
    out: Dict[str, Any] = {"config": run["config"], "rate": run["rate"], "load": run["load"],
                           "errors": [p["error"] for p in peers if p["error"]],
                           "complete": len(peers) == len(run["peers"])}
    fixed = run["settings"].get("fixed_steps") or run["settings"]["steps"]
    if rank0 is None:
        return out
    evals = rank0["evals"]
    final = evals[-1]
    out["samples"] = final["samples"]
    at = next((e for e in evals if e["step"] == fixed), None)
    out["loss_fixed"] = at["loss"] if at is not None else None
    out["fixed_samples"] = fixed * run["settings"]["batch"] * run["settings"]["peers"]
    out["loss_last"] = final["loss"]
    out["wall"] = rank0["t_end"]
    if all(p["tx0"] is not None for p in peers):
        out["bytes"] = sum(p["tx_end"] - p["tx0"] for p in peers) / len(peers)
    if target is not None:
        hit = next((e for e in evals if e["loss"] <= target), None)
        if hit is not None:
            out["t_target"] = hit["t"]
            out["samples_target"] = hit["samples"]
            tx = []
            for p in peers:
                e = next((x for x in p["evals"] if x["step"] >= hit["step"]), None)
                tx.append((e["tx"] if e else p["tx_end"]) - p["tx0"]
                          if p["tx0"] is not None else None)
            if None not in tx:
                out["bytes_target"] = sum(tx) / len(tx)
    return out


def table(runs: List[Dict[str, Any]], slack: float, target_steps: Optional[int] = None) -> str:
    """The markdown table of ``runs`` (the reference: ``dp`` on the unlimited link, else the
    ``dp`` run of the fastest link; the target: its loss after ``target_steps`` steps, default
    the fixed steps, times ``1 + slack``)."""
    refs = sorted((r for r in runs if r["config"] == "dp"),
                  key=lambda r: (r["rate"] != 0, -r["rate"]))
    target, ref_bytes, at = None, None, None
    if refs:
        steps = target_steps or refs[0]["settings"].get("fixed_steps") or \
            refs[0]["settings"]["steps"]
        at = next((e for e in refs[0]["peers"][0]["evals"] if e["step"] == steps), None)
    if at is not None:
        target = at["loss"] * (1 + slack)
        ref_bytes = summarize(refs[0], target).get("bytes_target")
    lines = [f"target loss: {target:.4f} (dp at rate {refs[0]['rate'] or 'unlimited'} after "
             f"{at['samples']} samples x {1 + slack:g}); reference bytes/peer to target: "
             f"{_mb(ref_bytes)} MB" if target else "no reference (dp) loss: no target",
             "",
             "| config | link | loss at fixed samples | time to target (s) | samples to target | "
             "MB/peer to target | vs dp | MB/peer (run) | samples (run) | wall (s) | "
             "load (1/5/15 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {c: i for i, c in enumerate(CONFIGS)}
    for run in sorted(runs, key=lambda r: (r["rate"] != 0, -r["rate"], order.get(r["config"]))):
        s = summarize(run, target)
        link = f"{run['rate']} Mbit/s" if run["rate"] else "unlimited"
        fixed = f"{s['loss_fixed']:.4f}" if s.get("loss_fixed") is not None else \
            f"not reached ({s.get('samples', 0)} samples: {s.get('loss_last', float('nan')):.4f})"
        tt = f"{s['t_target']:.1f}" if "t_target" in s else "not reached"
        bt = s.get("bytes_target")
        ratio = f"{ref_bytes / bt:.0f}x less" if bt and ref_bytes else "-"
        note = "" if s["complete"] and not s["errors"] else f" (errors: {s['errors']})"
        name = run["config"] + (" (overlapped)" if run["settings"].get("overlap") else "")
        lines.append(f"| {name}{note} | {link} | {fixed} | {tt} | "
                     f"{s.get('samples_target', '-')} | {_mb(bt)} | {ratio} | "
                     f"{_mb(s.get('bytes'))} | {s.get('samples', '-')} | "
                     f"{s.get('wall', float('nan')):.1f} | "
                     f"{'/'.join(map(str, s['load']))} |")
    return "\n".join(lines)


def _mb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 1e6:.3f}"


# --- the driver ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (tiny, unlimited link only)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rates", default="0,20,100", help="Mbit/s per link, 0 unlimited")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=600, help="steps per peer")
    p.add_argument("--fixed-steps", type=int, default=300,
                   help="steps per peer at which the loss is compared (a multiple of "
                        "--inner-steps, at most --steps)")
    p.add_argument("--batch", type=int, default=8, help="windows per peer per step")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--inner-steps", type=int, default=25,
                   help="DiLoCo's inner steps; the Optimizers' epoch; the evaluation interval")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="DiLoCo's outer SGD lr (default: 0.7 diloco, 1.0 diloco_ef)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="DiLoCo's outer Nesterov momentum, 0: plain SGD (default: 0.9 diloco, "
                        "0 diloco_ef)")
    p.add_argument("--density", type=float, default=0.1, help="diloco_ef's top-k density")
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--reply-bits", type=int, default=2,
                   help="diloco_ef's reducer replies: 2-8 bits (quantized, the reducer keeps "
                        "their error in its residual) or 32 (raw f32)")
    p.add_argument("--overlap", action="store_true",
                   help="diloco and diloco_ef with overlap_communication=True (the outer round "
                        "runs during the next inner steps)")
    p.add_argument("--verbose", action="store_true",
                   help="the optimizers log their rounds (into each run's peer<i>.log)")
    p.add_argument("--matchmaking-time", type=float, default=2.0)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--max-wall", type=float, default=300.0, help="seconds per run at most")
    p.add_argument("--target-slack", type=float, default=0.02)
    p.add_argument("--target-steps", type=int, default=None,
                   help="the target is dp's loss after this many steps per peer (default "
                        "--fixed-steps) times 1 + --target-slack")
    p.add_argument("--stdlib", default=None, help="another stdlib root (default: this Python's)")
    p.add_argument("--out", default=None, help="results folder (default: a new temp folder)")
    p.add_argument("--id", default=str(os.getpid() % 10000), help="namespace id: b30<id>-...")
    p.add_argument("--report", nargs="+", default=None,
                   help="print the table of results.jsonl files (runs of several invocations)")
    add_peer_args(p)
    return p


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """The hidden arguments of a peer process (``run_peers``)."""
    p.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rundir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer-args", default=None, help=argparse.SUPPRESS)


def read_jsonl(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The runs of ``results.jsonl`` files, in order."""
    runs = []
    for path in paths:
        with open(path) as fh:
            runs.extend(json.loads(line) for line in fh if line.strip())
    return runs


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.peer is not None:
        peer_args = argparse.Namespace(**json.loads(args.peer_args))
        result = run_peer(peer_args, args.peer, args.rundir)
        return 0 if result["error"] is None else 1
    if args.report:
        print(table(read_jsonl(args.report), args.target_slack, args.target_steps))
        return 0
    if args.quick:
        args.peers, args.steps, args.inner_steps, args.dim, args.layers = 2, 20, 5, 32, 1
        args.ctx, args.val_windows, args.rates, args.max_wall = 32, 8, "0", 120.0
        args.fixed_steps = 20
        args.matchmaking_time = 1.0
    if not 0 < args.fixed_steps <= args.steps or args.fixed_steps % args.inner_steps:
        raise SystemExit("--fixed-steps must be a multiple of --inner-steps, at most --steps")
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}: one of {', '.join(CONFIGS)}")
    rates = [int(r) for r in args.rates.split(",")]
    args.iface = "eth0"
    outdir = args.out or tempfile.mkdtemp(prefix="train_lm_")
    os.makedirs(outdir, exist_ok=True)
    results_path = os.path.join(outdir, "results.jsonl")
    print(f"results: {results_path}", flush=True)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    runs = []
    bed = Bed(f"b30{args.id}", args.peers)
    try:
        for rate in rates:
            bed.set_rate(rate)
            for config in configs:
                run = run_config(bed, args, config, rate, outdir)
                runs.append(run)
                with open(results_path, "a") as fh:
                    fh.write(json.dumps(run) + "\n")
                s = summarize(run, None)
                print(f"{config} rate={rate or 'unlimited'}: loss {s.get('loss_last')} after "
                      f"{s.get('samples')} samples, {s.get('wall', 0):.1f} s, "
                      f"{_mb(s.get('bytes'))} MB/peer, load {run['load']}, errors {s['errors']}",
                      flush=True)
    finally:
        bed.close()
    print(table(runs, args.target_slack))
    return 0 if all(not summarize(r, None)["errors"] and summarize(r, None)["complete"]
                    for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
