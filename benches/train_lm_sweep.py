"""Tuning DiLoCo with error-feedback top-k on ``train_lm.py``'s task, in one process
(issue 30: the sweep).

Usage::

    python benches/train_lm_sweep.py --codec topk --density 0.01 --bits 2 \\
        [--outer-lr 0.7 --outer-momentum 0.9 --inner-steps 25 --steps 300] --out sweep.jsonl
    python benches/train_lm_sweep.py --codec none ... --out sweep.jsonl      # fp32 DiLoCo
    python benches/train_lm_sweep.py --report sweep.jsonl [--at 300,600]

Losses at a fixed step count do not depend on the network or the machine's load, so a setting
can be judged without the network-namespace bed: this script runs ``--peers`` DiLoCo peers one
after another in one process (``train_lm``'s data, model, seeds and batches: peer ``i`` draws
its windows with seed ``1000 + i``; inner Adam ``--lr``), and does the outer round's arithmetic
itself, as hivemesh's averager does it with ``ErrorFeedbackTopK``:

* each peer's pseudo-gradient ``x = outer - params`` plus its residual ``r`` is ``z``; what
  it sends is ``y = topk_roundtrip(z)`` per tensor (:func:`topk_roundtrip`: the Rust codec's
  ``SparseTopK::roundtrip``: per chunk of ``--chunk`` values from the tensor's start, the ``k``
  of largest magnitude, quantized to ``--bits`` against the smallest power-of-two step ``2^e``
  with ``max <= 2^(bits-1) * 2^e``, rounded half away from zero, zeros dropped) and
  ``r <- z - y``;
* every peer gets the reducers' replies of the mean of the ``y`` (all weights are 1): the mean
  itself at ``--reply-bits 32``; else per part its ``topk_roundtrip`` at density 1 with
  ``--reply-bits`` bits in chunks of 2048 (``SparseTopK::encode_reply``), and the part's reducer
  adds ``N`` times the reply's error to its residual (reducer-side error feedback); the outer
  optimizer (SGD, lr
  ``--outer-lr``, Nesterov momentum ``--outer-momentum``; plain SGD at momentum 0) steps the
  outer parameters with it as their gradient, and every model restarts from them
  (``--restart unsent``, a variant: from the outer parameters minus its residual, with no
  residual added to its next pseudo-gradient).

``--codec none`` is fp32 DiLoCo (``y = x``, no residual). There is no network, DHT, or failure:
this is the loss the bed would reach with every round succeeding (the bed's error-feedback runs
gave the same losses at every evaluation; its fp32 runs differ from run to run in the third
digit). Defaults: ``train_lm.py``'s (density 0.1, 2 bits, chunk 2048, 2-bit replies, ...), the outer SGD at
DiLoCo's 0.7 / 0.9, H 25, 300 steps. The payload bytes of a round
are counted from the actual encodings (:func:`part_bits`, the bit layout of
``src/compression/sparse.rs``: headers, counts, the cheaper of Rice code and bitmap for the
positions, exponents, values; the reducer's reply: the applied mean's non-zero values in
chunks of 2048, quantized or raw f32), per peer ``(N - 1) / N`` of its parts plus ``(N - 1) / N`` of the replies
(every reducer answers its span to the ``N - 1`` others); fp32: ``2 (N - 1) / N * 4D`` plus
headers. Frame headers, TCP/IP and the DHT are not in it.

Output: one JSON line per run (``--out``), every outer step's loss and bytes; ``--report``
prints the table (loss at ``--at`` steps, its ratio to the fp32 run with the same ``H`` and
outer settings, payload kB per peer per round).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lm as lm  # noqa: E402

PART_VALUES = 1 << 17  # values per part: 512 KiB of f32 (the partition's default)
REPLY_CHUNK = 2048  # the reducer's reply chunks (REPLY_CHUNK_LOG2 = 11)
HEADER_BYTES = 10


# --- the codec, as src/compression/sparse.rs does it ------------------------------------------

def k_for(density: float, chunk: int, length: int) -> int:
    """Kept values of a chunk of ``length`` values (``SparseTopK::k_for``)."""
    k = min(max(int(math.floor(density * chunk + 0.5)), 1), chunk)
    return k if length == chunk else min(-(-k * length // chunk), length)


@torch.no_grad()
def topk_roundtrip(values: torch.Tensor, density: float, bits: int, chunk: int) -> torch.Tensor:
    """``decode(encode(values))`` of one flat float32 tensor (chunks from its start)."""
    flat = values.reshape(-1).to(torch.float32)
    n = flat.numel()
    out = torch.zeros(n, dtype=torch.float32)
    full = n // chunk * chunk
    pieces = [(0, full // chunk, chunk)] if full else []
    if full < n:
        pieces.append((full, 1, n - full))
    levels = 2 ** (bits - 1)
    for start, rows, length in pieces:
        block = flat[start:start + rows * length].view(rows, length).double()
        k = k_for(density, chunk, length)
        # Ties: the lower position first (stable sort of -|v|).
        order = torch.sort(-block.abs(), dim=1, stable=True).indices[:, :k]
        kept = torch.gather(block, 1, order)
        mx = kept.abs().max(dim=1, keepdim=True).values
        # The smallest e with max <= levels * 2^e (2^e exact in float64).
        e = torch.ceil(torch.log2(mx / levels)).clamp(min=-149, max=127)
        e = torch.where(levels * torch.exp2(e) < mx, e + 1, e)
        e = torch.where(levels * torch.exp2(e - 1) >= mx, e - 1, e)
        step = torch.exp2(e)
        q = kept / step
        q = torch.sign(q) * torch.floor(q.abs() + 0.5)  # f64 round: half away from zero
        q = q.clamp(-levels, levels)
        q = torch.where(mx > 0, q, torch.zeros_like(q))
        dense = torch.zeros(rows, length, dtype=torch.float64)
        dense.scatter_(1, order, q * step)
        out[start:start + rows * length] = dense.view(-1).float()
    return out.view_as(values)


def _bit_width(n: int) -> int:
    return int(n).bit_length()


def part_bits(values: np.ndarray, chunk: int, value_bits: int) -> int:
    """Payload bits of one part (without its header): per chunk the count, and for a chunk
    with entries the mode bit, the positions (the cheaper of a Rice code, 4 + sum of
    ``(g >> m) + 1 + m`` over the gaps, best ``m``, and a bitmap of the chunk's length), a 9-bit
    exponent (quantized values only) and ``value_bits`` per entry."""
    n = len(values)
    if n == 0:
        return 0
    nchunks = -(-n // chunk)
    lengths = np.full(nchunks, chunk, dtype=np.int64)
    lengths[-1] = n - (nchunks - 1) * chunk
    idx = np.flatnonzero(values)
    cid = idx // chunk
    pos = idx - cid * chunk
    counts = np.bincount(cid, minlength=nchunks)
    prev = np.empty_like(pos)
    if len(pos):
        prev[0] = -1
        prev[1:] = np.where(cid[1:] == cid[:-1], pos[:-1], -1)
    gaps = pos - prev - 1
    rice = np.full(nchunks, np.iinfo(np.int64).max, dtype=np.int64)
    for m in range(16):
        cost = np.bincount(cid, weights=(gaps >> m), minlength=nchunks).astype(np.int64)
        rice = np.minimum(rice, cost + counts * (1 + m) + 4)
    positions = np.minimum(rice, lengths)
    count_bits = np.array([_bit_width(x) for x in lengths], dtype=np.int64)
    has = counts > 0
    exp_bits = 9 if value_bits != 32 else 0
    total = count_bits.sum() + (has * (1 + positions + exp_bits + counts * value_bits)).sum()
    return int(total)


def tensor_bytes(values: np.ndarray, chunk: int, value_bits: int) -> int:
    """Payload bytes of one tensor's parts (``PART_VALUES`` values each, a header each)."""
    flat = values.reshape(-1)
    total = 0
    for s in range(0, max(len(flat), 1), PART_VALUES):
        total += HEADER_BYTES + -(-part_bits(flat[s:s + PART_VALUES], chunk, value_bits) // 8)
    return total


# --- the simulation -----------------------------------------------------------------------

class Outer:
    """The outer state and the round's arithmetic (no model, no data: testable alone)."""

    def __init__(self, params: Sequence[torch.Tensor], peers: int, codec: str, density: float,
                 bits: int, chunk: int, lr: float, momentum: float, keep_unsent: bool = False,
                 reply_bits: int = 32):
        self.params = [p.detach().clone().float() for p in params]
        self.reply_bits = reply_bits
        self.keep_unsent = keep_unsent
        self.codec, self.density, self.bits, self.chunk = codec, density, bits, chunk
        self.residuals = [[torch.zeros_like(p) for p in self.params] for _ in range(peers)]
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=momentum,
                                   nesterov=momentum > 0)

    @torch.no_grad()
    def round(self, peer_params: Sequence[Sequence[torch.Tensor]]) -> Dict[str, Any]:
        """One outer step from every peer's parameters; returns the payload bytes per peer
        and how many values the average holds."""
        n = len(peer_params)
        sent: List[List[torch.Tensor]] = []
        part_bytes = []
        for i, ps in enumerate(peer_params):
            ys, b = [], 0
            for j, (outer, p) in enumerate(zip(self.params, ps)):
                x = outer - p.detach().float()
                if self.codec == "topk":
                    # keep_unsent: the peer started from outer - r, so x holds r already.
                    z = x if self.keep_unsent else x + self.residuals[i][j]
                    y = topk_roundtrip(z, self.density, self.bits, self.chunk)
                    self.residuals[i][j] = z - y
                    b += tensor_bytes(y.numpy(), self.chunk, self.bits)
                else:
                    y = x
                    b += HEADER_BYTES * -(-max(y.numel(), 1) // PART_VALUES) + 4 * y.numel()
                ys.append(y)
            sent.append(ys)
            part_bytes.append(b)
        mean = [sum(s[j] for s in sent) / n for j in range(len(self.params))]
        reply_err = 0.0
        if self.codec == "topk":
            exact = mean
            mean = self.replies(mean, n)
            # The replies' error relative to the mean (0 with f32 replies).
            num = sum(float(((e - m) ** 2).sum()) for e, m in zip(exact, mean))
            den = sum(float((e ** 2).sum()) for e in exact)
            reply_err = math.sqrt(num / den) if den > 0 else 0.0
            reply = sum(tensor_bytes(m.numpy(), REPLY_CHUNK, self.reply_bits) for m in mean)
        else:
            reply = float(np.mean(part_bytes))
        for p, g in zip(self.params, mean):
            p.grad = g
        self.opt.step()
        share = (n - 1) / n
        return {"bytes": share * float(np.mean(part_bytes)) + share * reply,
                "parts_bytes": share * float(np.mean(part_bytes)), "reply_bytes": share * reply,
                "nonzero": int(sum(int(torch.count_nonzero(m)) for m in mean)),
                "reply_error": reply_err,
                "residual_norm": float(math.sqrt(sum(float((r ** 2).sum())
                                                     for rs in self.residuals for r in rs) / n))}

    @torch.no_grad()
    def replies(self, mean: Sequence[torch.Tensor], n: int) -> List[torch.Tensor]:
        """What every peer applies: each part's reducer's reply. Raw f32 (``reply_bits`` 32):
        the mean itself. Quantized: per part (``PART_VALUES`` values of a tensor, reducers in
        contiguous equal spans of the parts in order, as the partition assigns them), the
        mean's :func:`topk_roundtrip` at density 1 in chunks of ``REPLY_CHUNK``
        (``SparseTopK::encode_reply``), and the reducer adds ``n`` times the reply's error to
        its residual (all weights 1: the group's next mean carries the error once)."""
        if self.reply_bits == 32:
            return list(mean)
        spans = [(j, s) for j, m in enumerate(mean)
                 for s in range(0, max(m.numel(), 1), PART_VALUES)]
        out = []
        for j, m in enumerate(mean):
            flat = m.reshape(-1)
            q = torch.zeros_like(flat)
            for s in range(0, max(flat.numel(), 1), PART_VALUES):
                piece = flat[s:s + PART_VALUES]
                got = topk_roundtrip(piece, 1.0, self.reply_bits, REPLY_CHUNK)
                q[s:s + PART_VALUES] = got
                reducer = spans.index((j, s)) * n // len(spans)
                res = self.residuals[reducer][j].view(-1)
                res[s:s + PART_VALUES] += n * (piece - got)
            out.append(q.view_as(m))
        return out

    @torch.no_grad()
    def restart(self, peer: int, params: Sequence[torch.Tensor]) -> None:
        """Puts a peer's parameters where its next inner steps start: the outer parameters
        (DiLoCo), or with ``keep_unsent`` the outer parameters minus its residual (the peer
        keeps the progress it has not sent yet)."""
        for p, q, r in zip(params, self.params, self.residuals[peer]):
            p.copy_(q - r if self.keep_unsent else q)


def simulate(args: argparse.Namespace, log=print) -> Dict[str, Any]:
    """One setting: ``args.peers`` peers, ``args.steps`` inner steps each."""
    torch.set_num_threads(args.threads)
    train, val = lm.load_corpus(args.stdlib)
    windows = lm.val_windows(val, args.val_windows, args.ctx)
    models = [lm.make_model(args) for _ in range(args.peers)]
    inner = [torch.optim.Adam(m.parameters(), lr=args.lr) for m in models]
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(args.peers)]
    outer = Outer(list(models[0].parameters()), args.peers, args.codec, args.density, args.bits,
                  args.chunk, args.outer_lr, args.outer_momentum,
                  keep_unsent=args.restart == "unsent", reply_bits=args.reply_bits)

    def evaluate() -> float:
        models[0].eval()
        loss = lm.evaluate(models[0], windows)
        models[0].train()
        return loss

    evals = [{"step": 0, "loss": evaluate()}]
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        for m, opt, gen in zip(models, inner, gens):
            batch = lm.sample_windows(train, args.batch, args.ctx, gen)
            opt.zero_grad()
            lm.lm_loss(m, batch).backward()
            opt.step()
        if step % args.inner_steps == 0 or step == args.steps:
            info = outer.round([list(m.parameters()) for m in models])
            with torch.no_grad():  # the outer parameters are what is evaluated
                for p, q in zip(models[0].parameters(), outer.params):
                    p.copy_(q)
            ev = {"step": step, "loss": evaluate(), **info}
            for i, m in enumerate(models):
                outer.restart(i, list(m.parameters()))
            evals.append(ev)
            log(f"step {step}: loss {ev['loss']:.4f}, {ev['bytes'] / 1e3:.1f} kB/peer, "
                f"{ev['nonzero']} values, {time.perf_counter() - started:.0f} s")
    return {"setting": setting_of(args), "evals": evals, "seconds": time.perf_counter() - started,
            "load": [round(x, 2) for x in os.getloadavg()]}


SETTING_KEYS = ("codec", "density", "bits", "reply_bits", "chunk", "outer_lr", "outer_momentum", "restart",
                "inner_steps", "peers", "steps", "batch", "lr", "ctx", "dim", "layers", "heads",
                "val_windows")


def setting_of(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: getattr(args, k) for k in SETTING_KEYS}


def label(s: Dict[str, Any]) -> str:
    reply = s.get("reply_bits", 32)
    replies = ", f32 replies" if reply == 32 else f", {reply}-bit replies"
    codec = (f"top-k {s['density']:g}, {s['bits']} bits{replies}" if s["codec"] == "topk"
             else "fp32")
    keep = ", keep unsent" if s.get("restart") == "unsent" and s["codec"] == "topk" else ""
    return (f"{codec}, H {s['inner_steps']}, outer lr {s['outer_lr']:g} mom "
            f"{s['outer_momentum']:g}{keep}")


# --- the report ---------------------------------------------------------------------------

#: Bytes per peer per step of per-step fp32 data parallel on the bed (``train_lm.py``'s
#: ``dp``, measured ``tx_bytes``: docs/architecture.md).
DP_BYTES_PER_STEP = 6.46e6


def report(runs: List[Dict[str, Any]], at: Sequence[int]) -> str:
    """Loss at each of ``at`` steps; ratio to fp32 with the same H and outer settings (else
    the fp32 run with the same H and 0.7/0.9); payload kB per peer per round (mean) and dp's
    bytes per step over the payload per step. Rows sorted by H, fp32 first, density."""
    def loss_at(run: Dict[str, Any], step: int) -> Optional[float]:
        return next((e["loss"] for e in run["evals"] if e["step"] == step), None)

    def ref_of(s: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        fp32 = [r for r in runs if r["setting"]["codec"] == "none"
                and r["setting"]["inner_steps"] == s["inner_steps"]]
        same = [r for r in fp32 if (r["setting"]["outer_lr"], r["setting"]["outer_momentum"])
                == (s["outer_lr"], s["outer_momentum"])]
        default = [r for r in fp32 if (r["setting"]["outer_lr"], r["setting"]["outer_momentum"])
                   == (0.7, 0.9)]
        return (same or default or [None])[0]

    def order(run: Dict[str, Any]) -> Tuple[Any, ...]:
        s = run["setting"]
        topk = s["codec"] == "topk"
        return (s["inner_steps"], topk, s.get("restart") == "unsent", s["density"] if topk
                else 0, -s["outer_lr"], -s["outer_momentum"], s["bits"],
                -s.get("reply_bits", 32))

    head = "| setting | " + " | ".join(f"loss at {a} (vs fp32)" for a in at) + \
        " | payload kB/peer/round | of it replies | values in the mean/round | " \
        "dp's bytes per step over this |"
    lines = [head, "|" + "---|" * (5 + len(at))]
    for run in sorted(runs, key=order):
        s = run["setting"]
        ref = ref_of(s)
        cells = []
        for a in at:
            v = loss_at(run, a)
            r = loss_at(ref, a) if ref is not None and ref is not run else None
            cells.append("-" if v is None else f"{v:.4f}" + (f" ({v / r - 1:+.1%})" if r else ""))
        rounds = [e for e in run["evals"][1:] if e["step"] % s["inner_steps"] == 0]
        kb = np.mean([e["bytes"] for e in rounds]) / 1e3 if rounds else float("nan")
        rep = np.mean([e["reply_bytes"] for e in rounds]) / 1e3 if rounds else float("nan")
        nz = np.mean([e["nonzero"] for e in rounds]) if rounds else float("nan")
        vs_dp = DP_BYTES_PER_STEP * s["inner_steps"] / (kb * 1e3) if rounds else float("nan")
        lines.append(f"| {label(s)} | " + " | ".join(cells) +
                     f" | {kb:.1f} | {rep:.1f} | {nz:.0f} | {vs_dp:.0f}x |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base = lm.parser()
    for name in ("peers", "batch", "ctx", "dim", "layers", "heads", "lr", "val_windows",
                 "density", "bits", "chunk", "reply_bits", "stdlib"):
        action = next(a for a in base._actions if a.dest == name)
        p.add_argument(*action.option_strings, type=action.type, default=action.default,
                       help=action.help)
    p.add_argument("--steps", type=int, default=300, help="inner steps per peer")
    p.add_argument("--inner-steps", type=int, default=25, help="H: inner steps per outer step")
    p.add_argument("--codec", choices=("topk", "none"), default="topk")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="Nesterov momentum of the outer SGD (0: plain SGD)")
    p.add_argument("--restart", choices=("outer", "unsent"), default="outer",
                   help="where a peer's inner steps start after an outer step: the outer "
                        "parameters (DiLoCo, hivemesh's DiLoCoOptimizer), or those minus its "
                        "residual (it keeps what it has not sent; no residual is added)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default=None, help="append the run's JSON line here")
    p.add_argument("--report", nargs="+", default=None, help="print the table of these files")
    p.add_argument("--at", default="300,600", help="steps at which --report compares losses")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        runs = []
        for path in args.report:
            with open(path) as fh:
                runs.extend(json.loads(line) for line in fh if line.strip())
        print(report(runs, [int(a) for a in args.at.split(",")]))
        return 0
    print(label(setting_of(args)), flush=True)
    run = simulate(args, log=lambda s: print(s, flush=True))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(run) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
