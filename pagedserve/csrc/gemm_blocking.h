// The loop nest (and the weight packing) our batch-invariant GEMMs share
// (fixed_order_gemm_cpu.cpp: float32 FMA and bfloat16 pair chains; int8_ops_cpu.cpp: int8
// quad sums), after Goto & van de Geijn,
// "Anatomy of High-Performance Matrix Multiplication" (2008). The weight is packed in
// panels of kWidth output columns; a micro-kernel ("tile") keeps a group of kGroup rows x
// one panel in registers over a run of steps of k. Every output element is one
// chain over k in order whatever M is: the runs of a chain follow each other, and between
// runs its partial sum waits in a per-thread buffer (exact: a store and a load).
// (cpu_ops.py keys the build on this header too.)

#pragma once

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "work_sharing.h"

namespace pagedserve_gemm {

// Rows of x whose partial sums a thread keeps between runs: [kChunkRows, kWidth]
// accumulators, 48 KiB for 64 float32 columns. (Partial sums of all M rows at once, an [M, N]
// float32 result of 128 MiB for 2,048 rows of a 1B model's gate/up, cost page faults on
// every call, and rows N * 4 bytes apart share an L2 set where N * 4 is a multiple of 64 KiB:
// 0.65-0.75 of oneDNN's rate at 512-2,048 rows there, 0.9-1.0 in chunks.)
constexpr int64_t kChunkRows = 192;

// A share of the weights a tile fetches into cache while it computes: `lines` cache lines
// (64 bytes) from `addr`; none when lines == 0.
struct Prefetch {
  const char* addr = nullptr;
  int64_t lines = 0;
};

// Called at step k of a tile's `depth` steps: its share of the prefetch, spread evenly.
inline void prefetch_step(const Prefetch& pf, int64_t k, int64_t depth) {
  for (int64_t j = k; j < pf.lines; j += depth) __builtin_prefetch(pf.addr + 64 * j, 0, 3);
}

// Bytes of the cache sysconf names (_SC_LEVEL1_DCACHE_SIZE, ...), or `fallback` where it
// does not say.
inline int64_t cache_bytes(int name, int64_t fallback) {
  const long bytes = sysconf(name);
  return bytes > 0 ? static_cast<int64_t>(bytes) : fallback;
}

// The longest run of k a tile takes, in steps of `step_bytes` (one k-step of a panel): two
// thirds of the L1 data cache (sysconf; 48 KiB if it does not say), so that a panel's run
// stays in L1 while every group of rows passes over it, beside their rows of x. (A run of
// 64 KiB, or four panels' runs between two groups, left the run in L2 and each group
// reading it from there: on a Zen 5, 48 KiB L1, decode-step products at 16-38 rows ran
// 1.15-1.35x slower; benchmarks/README.md.)
inline int64_t max_run_depth(int64_t step_bytes) {
  static const int64_t l1 = cache_bytes(_SC_LEVEL1_DCACHE_SIZE, 48 * 1024);
  return std::max<int64_t>(1, 2 * l1 / 3 / step_bytes);
}

// The rows of x a thread takes through all its panels before the next ones (a multiple of
// kChunkRows): as many as fill half the L2 cache (sysconf; 1 MiB if it does not say), so
// that every panel after the first finds them there; each panel's weights are read once
// per block. (All M rows through each panel in turn read x from L3 or memory once per
// panel: a 1B model's bfloat16 down product, K = 8,192, at 2,048 rows (32 MiB of x pairs)
// ran 719-844 GFLOP/s against 885-937 in blocks; its 2,048-token prefill 1.04x faster,
// Zen 5; benchmarks/README.md.)
inline int64_t block_rows(int64_t x_row_bytes) {
  static const int64_t l2 = cache_bytes(_SC_LEVEL2_CACHE_SIZE, 1024 * 1024);
  return std::max<int64_t>(1, l2 / 2 / x_row_bytes / kChunkRows) * kChunkRows;
}

// Threads split the output, never K (no split-K): the panels, and where their count does
// not divide evenly, the rows of the panel at a boundary (N = 576 is 9 panels of 64: 5/4 on
// two threads left one waiting ~10% of an o or down product). A thread takes its rows in
// blocks (block_rows of x's rows, `x_row_bytes` each), each block through all its panels;
// per panel and chunk of kChunkRows rows: K in runs of equal depth (at most
// max_run_depth), rows in groups of kGroup, then the chunk is finished. The weights are
// `packed` [panels][panel_stride] (W elements), panel p's run at k0 the depth x kWidth
// elements from packed + p * panel_stride + k0 * kWidth.
//   tile(rows, m, k0, depth, w, c, ldc, pf): rows [m, m + rows) against the run w at k0,
//       into c (accumulators of the group's first row, rows ldc apart; the run at k0 == 0
//       starts the chains), prefetching pf;
//   flush(c, ldc, m, rows, col0, col1): the chunk's rows [m, m + rows) are final for
//       columns [col0, col1) (c holds column col0 first).
// Only the first group of rows reads a run from memory; the others find it in L1. So while
// the groups compute one run, each prefetches its share of the run read next (group g of
// G: lines [g L / G, (g + 1) L / G)), and the first group finds that in cache too: a 1B
// model's decode-step GEMMs at 36 rows ran 1.3x faster. A chunk of one group (a lone
// request's decode) prefetches nothing: it is bound by memory bandwidth alone, and the
// hardware prefetcher streams it faster (0.71x at one row with the prefetch).
// A row's chain is the same whichever thread runs it, whichever rows share its group and
// however K is cut into runs (a partial sum waits in the buffer exactly).
template <typename Acc, int kGroup, int64_t kWidth, typename W, typename Tile, typename Flush>
void for_each_tile(int64_t M, int64_t K, int64_t x_row_bytes, const W* packed, int64_t panels,
                   int64_t panel_stride, const Tile& tile, const Flush& flush) {
  constexpr int64_t ldc = kWidth;
  const int64_t rows_per_block = block_rows(x_row_bytes);
  const int64_t max_depth = max_run_depth(kWidth * int64_t{sizeof(W)});
  const int64_t runs = std::max<int64_t>(1, (K + max_depth - 1) / max_depth);
  const int64_t run_depth = std::max<int64_t>(1, (K + runs - 1) / runs);  // runs of one depth
  const auto run = [&](int64_t p, int64_t k0) { return packed + p * panel_stride + k0 * kWidth; };
  // Panels [begin, end), rows [m_begin, m_end) of each, with accumulators c; after_end: the
  // panel the thread takes next (-1: none), whose first run the last panel's prefetches.
  const auto tiles = [&](int64_t begin, int64_t end, int64_t m_begin, int64_t m_end, Acc* c,
                         int64_t after_end) {
    for (int64_t m_block = m_begin; m_block < m_end; m_block += rows_per_block) {
      const int64_t block_end = std::min(m_end, m_block + rows_per_block);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t m_chunk = m_block; m_chunk < block_end; m_chunk += kChunkRows) {
          const int64_t chunk = std::min(kChunkRows, block_end - m_chunk);
          const int64_t groups = (chunk + kGroup - 1) / kGroup;
          for (int64_t k0 = 0; k0 < K; k0 += run_depth) {
            const int64_t depth = std::min(run_depth, K - k0);
            // The run read next: this panel's next k, else the next panel's first (or this
            // panel's again, for the block's next chunk).
            const bool last = k0 + run_depth >= K;
            const int64_t next_k0 = last ? 0 : k0 + run_depth;
            int64_t next_p = last && m_chunk + kChunkRows >= block_end ? p + 1 : p;
            if (next_p == end) next_p = after_end;
            const int64_t lines =
                (std::min(run_depth, K - next_k0) * kWidth * int64_t{sizeof(W)} + 63) / 64;
            for (int64_t g = 0; g < groups; ++g) {
              const int64_t m0 = g * kGroup;
              const int rows = static_cast<int>(std::min<int64_t>(kGroup, chunk - m0));
              const int64_t l0 = g * lines / groups, share = (g + 1) * lines / groups - l0;
              Prefetch pf;
              if (groups > 1 && next_p >= 0)
                pf = {reinterpret_cast<const char*>(run(next_p, next_k0)) + 64 * l0, share};
              tile(rows, m_chunk + m0, k0, depth, run(p, k0), c + m0 * ldc, ldc, pf);
            }
          }
          flush(static_cast<const Acc*>(c), ldc, m_chunk, chunk, p * kWidth, (p + 1) * kWidth);
        }
      }
    }
  };
  // Work in units of (panel, group of kGroup rows), panel-major; each thread an equal run.
  const int64_t groups = (M + kGroup - 1) / kGroup, units = panels * groups;
  thread_local std::vector<Acc> buffer;  // reused by every call on this thread
  // The calling thread's accumulators, sized for this call.
  const auto thread_buffer = [&] {
    buffer.resize(std::max<int64_t>(buffer.size(), std::min(M, kChunkRows) * ldc));
    return buffer.data();
  };
  if (M <= rows_per_block) {
    // One block of rows (decode steps, short prompts): a thread takes its run a panel's
    // units at a time, then, once out, the others' last units (csrc/work_sharing.h).
    pagedserve_sharing::for_each_run(units, groups, [&](int64_t u0, int64_t u1, int64_t next) {
      tiles(u0 / groups, u0 / groups + 1, u0 % groups * kGroup,
            std::min(M, ((u1 - 1) % groups + 1) * kGroup), thread_buffer(),
            next < 0 ? -1 : next / groups);
    });
    return;
  }
  // Blocks of rows through a thread's panels: shares fixed, so that the block's rows of x
  // stay in L2 from one panel to the next.
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), units);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    Acc* c = thread_buffer();
    const int64_t u0 = units * part_begin / parts, u1 = units * part_end / parts;
    const int64_t first = u0 / groups, last = (u1 - 1) / groups;  // panels touched
    // rows [m_first, M) of the first panel, [0, m_last) of the last
    const int64_t m_first = u0 % groups * kGroup;
    const int64_t m_last = std::min(M, ((u1 - 1) % groups + 1) * kGroup);
    if (first == last) {
      tiles(first, first + 1, m_first, m_last, c, -1);
      return;
    }
    int64_t full_begin = first;
    if (m_first > 0) tiles(first, first + 1, m_first, M, c, -1), ++full_begin;
    const int64_t full_end = m_last < M ? last : last + 1;
    tiles(full_begin, full_end, 0, M, c, -1);
    if (m_last < M) tiles(last, last + 1, 0, m_last, c, -1);
  });
}

// The packing the two 32-bit-group layouts share (bfloat16 pairs, int8 quads): dst[p][g][j]
// = src[p * kWidth + j][g] for the rows n < N of src [N, groups], panels of kWidth columns
// `panel_stride` int32 apart (a layout may keep rows of its own after the groups); what lies
// past N is left as it is. Each panel gathers its rows, panels in parallel (a 1B model's
// 2 GB of pairs: 2.5 s on 2 cores, against 9.9 s as a strided copy of 2-byte elements).
template <int64_t kWidth>
void gather_panels(const int32_t* src, int64_t N, int64_t groups, int64_t panel_stride,
                   int32_t* dst) {
  at::parallel_for(0, (N + kWidth - 1) / kWidth, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(kWidth, N - p * kWidth); ++j) {
        const int32_t* row = src + (p * kWidth + j) * groups;
        int32_t* column = dst + p * panel_stride + j;
        for (int64_t g = 0; g < groups; ++g) column[g * kWidth] = row[g];
      }
  });
}

}  // namespace pagedserve_gemm
