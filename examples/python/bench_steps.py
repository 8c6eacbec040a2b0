"""Benchmark of ``DecentralizedAverager.step()`` through hivemesh's Python bindings: P peer
processes, each averaging MIB MiB of float32 values R times in groups of G.

Usage::

    python examples/python/bench_steps.py --peers 16 --group-size 4 --rounds 3 --mib 4

Prints exactly one line on stdout::

    hivemesh_py_steps peers=P group=G ok=K total=T median_step_s=S

``K`` is the number of steps that succeeded, ``T = P * R`` the number attempted, ``S`` the
median duration of the successful steps in seconds (the upper median, ``sorted[K // 2]``, as
the Rust harness takes it; ``nan`` if none succeeded). One line per round goes to stderr.

It is the Python counterpart of ``hivemesh bench steps`` (``src/bin/hivemesh/steps.rs``) and
measures the same thing, so that the two lines compare:

* the parent runs the bootstrap DHT node on loopback; each peer is a process of its own
  (multiprocessing, "spawn" start method) with its own ``hivemesh.DHT`` joined through it and a
  ``hivemesh.DecentralizedAverager`` with prefix ``bench-steps``,
  ``target_group_size = --group-size``, ``min_matchmaking_time = 5 s`` and the default request
  timeout (3 s), as the Rust workers;
* rounds start together: before every round all peers wait on a barrier that the parent joins
  only once every peer has reported the previous round (the Rust parent's ``GO <r>``), so the
  first round does not wait for the slowest start and no round overlaps the previous one;
* a step is timed from the call of ``averager.step(timeout=--step-timeout)`` (60 s) to its
  return: matchmaking and all-reduce. A step that returns ``None`` (no group in time) or
  raises counts as failed;
* results are checked outside the timing: every peer gathers its index (so each member knows
  its group), after the first step a sample of elements (every 4099th) must equal the mean of
  its group's initial values (recomputed from the members' seeds) and later steps must leave
  the values finite; a check that fails ends the run with an error;
* after its last step a peer stays in the swarm until every peer has reported (a peer leaving
  early would turn others' join requests away, which would measure the exit, not a step).

One difference from the Rust harness: ``min_group_size`` defaults to the group size (the Rust
workers keep the library's default of 2; pass ``--min-group-size 2`` for that). With full
groups, as when the peer count is a multiple of the group size and every peer is healthy,
groups close as soon as they are full and the setting changes nothing; it matters only for a
peer left over, which here fails its step instead of averaging in a smaller group after the
matchmaking time.

The initial values: uniform in [-1, 1) plus ``0.25 * index`` (so groups' means differ), drawn
with numpy's PCG64 seeded by the peer's index (the Rust workers use their own generator with
the same distribution). ``--tensors N`` splits the values into N tensors (default 1, as the
Rust workers). Exit status: 0 if the harness ran (whatever the number of failed steps), 1 if a
peer crashed, a check failed or a wait timed out (the peer processes are then terminated).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import threading
import time
import traceback
from typing import Any, List, Optional

import numpy as np
import torch

import hivemesh

from _harness import Failure, next_message, stop_processes

#: Where every node listens: loopback, TCP, a port of the system's choice.
LISTEN = ["/ip4/127.0.0.1/tcp/0"]
#: Every how many elements the first step's result is checked.
CHECK_STRIDE = 4099
#: The averagers' key prefix (the Rust workers' too).
PREFIX = "bench-steps"


def initial_values(index: int, n: int) -> np.ndarray:
    """Peer ``index``'s initial values: ``n`` float32 uniform in [-1, 1) plus
    ``0.25 * index``."""
    rng = np.random.Generator(np.random.PCG64(index))
    values = rng.random(n, dtype=np.float32) * np.float32(2.0) - np.float32(1.0)
    values += np.float32(0.25 * index)
    return values


def split(values: np.ndarray, parts: int) -> List[torch.Tensor]:
    """``values`` as ``parts`` contiguous torch tensors (copies, so each owns its memory)."""
    return [torch.from_numpy(chunk.copy()) for chunk in np.array_split(values, parts)]


def worker_main(index: int, args: argparse.Namespace, initial_peers: List[str], results: Any,
                go: Any) -> None:
    """Peer ``index``: joins, reports ``("ready", index)``, then for every round waits on the
    ``go`` barrier, runs one step and reports ``("step", index, round, ok, seconds, detail)``
    (``detail``: the group size, or why the step failed); finally waits on ``go`` once more
    (every peer has reported) and leaves. A failed check or a crash reports
    ``("fatal", index, traceback)``."""
    torch.set_num_threads(1)
    dht: Optional[hivemesh.DHT] = None
    averager: Optional[hivemesh.DecentralizedAverager] = None
    barrier_timeout = args.setup_timeout + args.step_timeout
    try:
        n = args.mib * (1 << 20) // 4
        tensors = split(initial_values(index, n), args.tensors)
        dht = hivemesh.DHT(initial_peers=initial_peers, host_maddrs=LISTEN, start=True)
        averager = hivemesh.DecentralizedAverager(
            tensors,
            dht,
            prefix=PREFIX,
            target_group_size=args.group_size,
            min_group_size=args.min_group_size,
            min_matchmaking_time=args.min_matchmaking_time,
            start=True,
        )
        results.put(("ready", index))
        for rnd in range(args.rounds):
            go.wait(timeout=barrier_timeout)
            began = time.perf_counter()
            try:
                group = averager.step(gather=index, timeout=args.step_timeout)
                failure = None if group is not None else "no group formed in time"
            except Exception as e:  # a failed step is a result, not a crash
                group, failure = None, f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - began
            if failure is not None:
                results.put(("step", index, rnd, False, seconds, failure))
                continue
            members = list(group.values())
            if not all(isinstance(m, int) and 0 <= m < args.peers for m in members):
                raise AssertionError(f"step {rnd}: bad gathered values {members}")
            if index not in members:
                raise AssertionError(f"step {rnd}: this peer is not in its group {members}")
            with averager.get_tensors() as shared:
                after = torch.cat([t.reshape(-1) for t in shared]).numpy().copy()
            if not np.isfinite(after).all():
                raise AssertionError(f"non-finite values after step {rnd}")
            if rnd == 0:
                # Everyone starts from its seed, so the group's mean is known.
                sample = np.arange(0, n, CHECK_STRIDE)
                mean = np.mean([initial_values(m, n)[sample].astype(np.float64)
                                for m in members], axis=0)
                got = after[sample].astype(np.float64)
                bad = np.flatnonzero(np.abs(got - mean) > 1e-5 * np.maximum(1.0, np.abs(mean)))
                if bad.size:
                    k = bad[0]
                    raise AssertionError(
                        f"element {sample[k]}: {got[k]} vs group mean {mean[k]} "
                        f"(group {sorted(members)}, {bad.size} of {sample.size} checked differ)")
            results.put(("step", index, rnd, True, seconds, str(len(members))))
        # Stay in the swarm until every peer is done.
        go.wait(timeout=barrier_timeout)
    except BaseException:
        results.put(("fatal", index, traceback.format_exc()))
        sys.exit(1)
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


def run(args: argparse.Namespace) -> List[float]:
    """Runs the benchmark; returns the successful steps' durations."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Barrier(args.peers + 1)  # the workers and this process
    barrier_timeout = args.setup_timeout + args.step_timeout
    bootstrap = hivemesh.DHT(host_maddrs=LISTEN, start=True)
    procs: List[Any] = []
    times: List[float] = []
    ok = False
    try:
        initial_peers = [str(a) for a in bootstrap.get_visible_maddrs()]
        for i in range(args.peers):
            proc = ctx.Process(target=worker_main, name=f"bench-steps-{i}", daemon=True,
                               args=(i, args, initial_peers, results, go))
            proc.start()
            procs.append(proc)
        ready = set()
        while len(ready) < args.peers:
            msg = next_message(results, procs, args.setup_timeout, "during setup")
            if msg[0] != "ready":
                raise Failure(f"worker {msg[1]}: unexpected message {msg!r}")
            ready.add(msg[1])
        for rnd in range(args.rounds):
            go.wait(timeout=barrier_timeout)  # GO <rnd>
            round_times, failures = [], []
            reported = set()
            while len(reported) < args.peers:
                msg = next_message(results, procs, barrier_timeout, f"in round {rnd}")
                if msg[0] != "step" or msg[2] != rnd or msg[1] in reported:
                    raise Failure(f"worker {msg[1]}: unexpected message {msg!r}")
                _, i, _, success, seconds, detail = msg
                reported.add(i)
                if success:
                    round_times.append(seconds)
                else:
                    failures.append(f"worker {i}: {detail}")
            print(f"round {rnd}: {len(round_times)}/{args.peers} steps ok, slowest "
                  f"{max(round_times, default=0.0):.3f} s"
                  + (f" ({'; '.join(failures)})" if failures else ""), file=sys.stderr,
                  flush=True)
            times.extend(round_times)
        go.wait(timeout=barrier_timeout)  # every worker has reported: they may leave
        ok = True
    except threading.BrokenBarrierError:
        raise Failure("a worker did not reach the round barrier in time") from None
    finally:
        stop_processes(procs, grace=30.0 if ok else 0.0)
        bootstrap.shutdown()
        results.close()
    return times


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time DecentralizedAverager.step() across peer processes (the Python "
                    "counterpart of `hivemesh bench steps`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--peers", type=int, default=16, help="peer processes")
    parser.add_argument("--group-size", type=int, default=4, help="target group size")
    parser.add_argument("--rounds", type=int, default=3, help="steps per peer")
    parser.add_argument("--mib", type=int, default=4, help="MiB of float32 values per peer")
    parser.add_argument("--tensors", type=int, default=1,
                        help="tensors the values are split into")
    parser.add_argument("--min-group-size", type=int, default=None,
                        help="smallest group a step accepts (default: --group-size)")
    parser.add_argument("--min-matchmaking-time", type=float, default=5.0,
                        help="seconds before a group smaller than the target may close")
    parser.add_argument("--step-timeout", type=float, default=60.0,
                        help="seconds a step may take")
    parser.add_argument("--setup-timeout", type=float, default=120.0,
                        help="seconds the peer processes may take to start (the Rust harness "
                             "allows 60; Python processes importing torch start slower)")
    args = parser.parse_args(argv)
    if args.min_group_size is None:
        args.min_group_size = args.group_size
    checks = [
        (2 <= args.peers <= 64, "--peers must be between 2 and 64"),
        (2 <= args.group_size <= args.peers, "--group-size must be between 2 and --peers"),
        (1 <= args.min_group_size <= args.group_size,
         "--min-group-size must be between 1 and --group-size"),
        (1 <= args.rounds <= 100, "--rounds must be between 1 and 100"),
        (1 <= args.mib <= 1024, "--mib must be between 1 and 1024"),
        (1 <= args.tensors <= args.mib * (1 << 18), "--tensors must be between 1 and the "
                                                     "number of values"),
        (0 < args.min_matchmaking_time <= 60, "--min-matchmaking-time must be in (0, 60]"),
        (0 < args.step_timeout <= 3600, "--step-timeout must be in (0, 3600]"),
        (args.setup_timeout > 0, "--setup-timeout must be positive"),
    ]
    for good, message in checks:
        if not good:
            parser.error(message)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        times = run(args)
    except Failure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    times.sort()
    median = times[len(times) // 2] if times else math.nan
    print(f"hivemesh_py_steps peers={args.peers} group={args.group_size} ok={len(times)} "
          f"total={args.peers * args.rounds} median_step_s={median:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
