"""All-reduce latency and bandwidth of gloo between 2 processes on this machine, for the
sizes one tensor-parallel step sends ([tokens, hidden] float32, twice per layer), and the
per-step communication volume. Prints a table; see benchmarks/README.md (Tensor parallel).

    .venv/bin/python benchmarks/allreduce_gloo.py [--hidden 576 4096] [--tokens 1 64 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from pagedserve.distributed.group import RankGroup, free_port

REPEATS = 30


def _times(group: RankGroup, tokens: int, hidden: int) -> list[float]:
    x = torch.randn(tokens, hidden)
    for _ in range(3):
        group.all_reduce(x)
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        group.all_reduce(x)
        out.append(time.perf_counter() - t0)
    return out


def _rank(rank: int, world: int, port: int, sizes: list[tuple[int, int]], queue) -> None:
    torch.set_num_threads(1)
    group = RankGroup(rank, world, "127.0.0.1", port, 60.0)
    for tokens, hidden in sizes:
        times = _times(group, tokens, hidden)
        if rank == 0:
            queue.put((tokens, hidden, statistics.median(times)))
    if rank == 0:
        queue.put(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[576, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    sizes = [(t, h) for h in args.hidden for t in args.tokens]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, sizes, queue))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    print(f"gloo all-reduce, {args.world_size} processes on this machine, float32, "
          f"median of {REPEATS}")
    print(f"{'tokens':>7} {'hidden':>7} {'bytes':>10} {'latency us':>11} {'GB/s':>7}")
    while (row := queue.get()) is not None:
        tokens, hidden, seconds = row
        nbytes = tokens * hidden * 4
        print(f"{tokens:>7} {hidden:>7} {nbytes:>10} {seconds * 1e6:>11.1f} "
              f"{nbytes / seconds / 1e9:>7.3f}")
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
