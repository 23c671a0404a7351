"""Decode attention as the engine runs it: 64 sequences, SmolLM2's heads (9 query, 3 KV,
head size 64), 30 layers whose caches are read once per step (so from DRAM, not from a
cache that a one-layer loop would keep warm), blocks scattered over the pool.

    .venv/bin/python benchmarks/decode_attention.py [--dtype bfloat16]

Prints the best of 3 steps in milliseconds at 1 and 2 threads for contexts of 64 and 256
tokens, and the bytes of K and V read per step. ``--dtype`` is the query's and the
cache's (float32 by default; bfloat16 as the default path runs on a bf16 CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.cpu_ops import load_cpu_ops

SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 64, 9, 3, 64, 16, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    dtype = getattr(torch, parser.parse_args().dtype)
    ops = load_cpu_ops()
    torch.manual_seed(0)
    for context in (64, 256):
        blocks = -(-context // BLOCK_SIZE)
        caches = [torch.randn(2, SEQS * blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
                  for _ in range(LAYERS)]
        tables = torch.randperm(SEQS * blocks).view(SEQS, blocks)
        seq_lens = torch.full((SEQS,), context, dtype=torch.int64)
        query_start_loc = torch.arange(SEQS + 1)
        query = torch.randn(SEQS, HEADS, HEAD_DIM, dtype=dtype)
        out = torch.empty_like(query)
        read = SEQS * context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize * LAYERS
        for threads in (1, 2):
            torch.set_num_threads(threads)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for cache in caches:
                    ops.paged_attention(query, cache, tables, seq_lens, query_start_loc, out,
                                        HEAD_DIM**-0.5, 0)
                best = min(best, time.perf_counter() - t0)
            print(f"context {context}, {threads} thread(s): {best * 1e3:.1f} ms per step "
                  f"({LAYERS} layers, K+V {read / 1e6:.0f} MB, {read / best / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
