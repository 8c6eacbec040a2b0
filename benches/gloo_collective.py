"""torch.distributed (gloo backend) beside `hivemesh bench collective`: the same ops, sizes and
output line, for side-by-side figures on one machine.

    python benches/gloo_collective.py --op all-reduce --peers 4 --mib 64 --rounds 3

N processes on loopback (plain TCP, no encryption). Sizes follow nccl-tests as the hivemesh
bench does: --mib is the all-reduce and broadcast buffer, the all-gather output and the
reduce-scatter input. Each round starts after a barrier; a round's time is the slowest
process's; round 0 is a warm-up; the median of the timed rounds is printed as

    gloo_collective op=OP world=N mib=M median_s=S algbw_gbs=A busbw_gbs=B

Every result is checked against the expected values (a failure raises).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def values(rank, n, offset=0):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.rand(n, generator=g) * 2 - 1 + offset


def worker(rank, args, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.peers)
    n = args.peers
    total = args.mib * (1 << 20) // 4
    chunk = total // n
    times = []
    for r in range(args.rounds + 1):
        if args.op == "all-reduce":
            x = values(rank, total)
            want = sum(values(k, total) for k in range(n))
        elif args.op == "broadcast":
            x = values(rank, total)
            want = values(0, total)
        elif args.op == "all-gather":
            x = values(rank, chunk)
            outs = [torch.empty(chunk) for _ in range(n)]
            want = torch.cat([values(k, chunk) for k in range(n)])
        else:
            inputs = list(values(rank, chunk * n).split(chunk))
            y = torch.empty(chunk)
            want = sum(values(k, chunk * n).split(chunk)[rank] for k in range(n))
        dist.barrier()
        t = time.perf_counter()
        if args.op == "all-reduce":
            dist.all_reduce(x)
            got = x
        elif args.op == "broadcast":
            dist.broadcast(x, src=0)
            got = x
        elif args.op == "all-gather":
            dist.all_gather(outs, x)
            got = torch.cat(outs)
        else:
            try:
                dist.reduce_scatter(y, inputs)
            except RuntimeError as e:
                # Older gloo builds lack reduce_scatter: the same traffic as all_to_all,
                # then the sum (said on stderr, so the figure is not mistaken for it).
                if r == 0 and rank == 0:
                    print(f"gloo reduce_scatter unavailable ({e}); all_to_all + sum", file=sys.stderr)
                recv = [torch.empty(chunk) for _ in range(n)]
                dist.all_to_all(recv, inputs)
                y = torch.stack(recv).sum(0)
            got = y
        elapsed = time.perf_counter() - t
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * n * 2, f"rank {rank} round {r}: error {err}"
        times.append(elapsed)
    out[rank] = times
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=sorted(BUS), required=True)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    port = 29500 + os.getpid() % 1000
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(worker, args=(args, port, out), nprocs=args.peers, join=True)
    per_round = [max(out[r][i] for r in range(args.peers)) for i in range(1, args.rounds + 1)]
    median = statistics.median(per_round)
    algbw = args.mib * (1 << 20) / median / 1e9
    busbw = algbw * BUS[args.op](args.peers)
    print(
        f"gloo_collective op={args.op} world={args.peers} mib={args.mib} "
        f"median_s={median:.4f} algbw_gbs={algbw:.3f} busbw_gbs={busbw:.3f}"
    )


if __name__ == "__main__":
    main()
