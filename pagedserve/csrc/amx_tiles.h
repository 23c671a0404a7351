// The loop our batch-invariant GEMMs run on CPUs with AMX (Intel Advanced Matrix Extensions:
// amx_tile with amx_bf16 and amx_int8; Intel SDM vol. 1 ch. 18 and vol. 2, TDPBF16PS and
// TDPBUSD): fixed_order_gemm_cpu.cpp's bfloat16 pairs and int8_ops_cpu.cpp's int8 quads.
//
// A tile register holds up to 16 rows of 64 bytes. One TDPBF16PS / TDPBUSD multiplies an A
// tile (16 rows of x, 16 "units" of K each: bfloat16 pairs or int8 quads, 4 bytes a unit)
// by a B tile (16 units of K x 16 output columns, a unit of one column in 4 bytes) into a C
// tile (16 rows x 16 float32 or int32 sums): 16 x 16 x 16 units, 1,024 bfloat16 products a
// cycle where the vector units do 64. Our weight layouts are already B tiles: a panel of 64
// output columns holds k in units, [units][64 columns][4 bytes], so a k-step of 16 units x
// 16 columns is one tile load 256 bytes a row.
//
// Batch invariance: each C row is computed from its own A row (the tile's rows never meet),
// and its sum runs over the k-steps in order from zero (in a C tile, and between runs of
// steps in memory: a store and a load are exact): a row's bits are the same whatever the
// row count and wherever it sits.
// (TDPBF16PS's bits differ from VDPBF16PS's chain: another layout for kernel_choice.py.
// TDPBUSD sums integers, exact in any order: the same bits as vpdpbusd.)
//
// (cpu_ops.py keys the build on this header too.)

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define PAGEDSERVE_AMX 1

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedserve_amx {

constexpr int64_t kRows = 16;                // rows of x per tile, and units of K per k-step
constexpr int64_t kStepBytes = 64;           // bytes of a row of x per k-step (16 units)
constexpr int64_t kWidth = 64;               // output columns per panel: four C tiles
constexpr int64_t kUnitRowBytes = kWidth * 4;  // bytes of one unit of K across a panel

// Linux gives a thread AMX's tile data (8 KiB of state) only once the process asked for
// it (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA = 18; the kernel's
// Documentation/arch/x86/xstate.rst); without it the first tile instruction faults.
inline bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// LDTILECFG's 64-byte operand, palette 1: tiles 0-3 are C (rows x 16 sums), 4 is A (rows
// x 64 bytes of x), 5-7 are B (16 units x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// LDTILECFG. The barrier first: GCC may see no read of the config in the builtin and drop
// the stores to it (an out-of-line copy once kept only the palette: an invalid config).
inline void load_config(const TileConfig& config) {
  asm volatile("" : : "m"(config) : "memory");
  _tile_loadconfig(&config);
}

inline void configure(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t < 5 ? rows : kRows;
  }
  load_config(config);
}

enum class Product { kBf16Pairs, kInt8Quads };

// C += A (tile 4) x B for the product P. A macro: GCC's tile intrinsics paste their tile
// numbers into the instruction's text, so they must be literals.
#define PAGEDSERVE_TILE_DOT(P, C, B)      \
  do {                                    \
    if constexpr (P == Product::kBf16Pairs) \
      _tile_dpbf16ps(C, 4, B);            \
    else                                  \
      _tile_dpbusd(C, 4, B);              \
  } while (0)

// out[m, n] over a weight packed in panels of kWidth columns, `steps` k-steps each
// (panel p's step s at packed + p * panel_stride + s * kRows * kUnitRowBytes bytes), and x
// [M] rows of steps * kStepBytes bytes (ldx bytes apart; bfloat16 rows for kBf16Pairs, u8
// for kInt8Quads). Threads split the panels (no split-K). Per panel, K in runs of
// kRunSteps, and per run every block of 16 rows: the first block reads the run from
// memory, the others from L1, and the weights stream on without waiting for them (a 1B
// model's 16 layers of GEMMs at 35 rows, 2 GB of weights: 97-98 ms, against 107 ms with a
// whole panel per block, 104-108 ms with runs of 4 or 16-32 steps; AMX Xeon, 2 cores).
// Between runs a block's sums wait in a per-thread buffer (a tile store and load, exact).
//   flush(c, ldc, m, rows, col0, col1): rows [m, m + rows) are final for columns
//       [col0, col1); c [rows][ldc] float32 or int32 sums (Acc), column col0 first.
template <Product P, typename Acc, typename Flush>
void for_each_tile(int64_t M, int64_t steps, const uint8_t* x, int64_t ldx,
                   const uint8_t* packed, int64_t panels, int64_t panel_stride,
                   const Flush& flush) {
  constexpr int64_t kRunSteps = 8;  // a run of a panel: 32 KiB of weights (L1: 48 KiB)
  constexpr int64_t kStride = kWidth * 4;  // bytes between a block's rows of sums
  // One block, or from kWholePanelRows rows on: no runs. There the sums of M rows waiting in
  // memory between runs (M x 256 bytes) cost more than each block's reads of the whole
  // panel from L2: at 2,048 rows of the 1B's shapes bfloat16 1.5-1.8x, int8 1.1-1.4x; runs
  // still win at 64-256 rows (AMX Xeon, 2 cores; benchmarks/README.md).
  constexpr int64_t kWholePanelRows = 512;
  const int64_t run_steps = M > kRows && M < kWholePanelRows ? kRunSteps : steps;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<Acc> buffer;  // [M][kWidth] sums, reused by every call
    buffer.resize(std::max<size_t>(buffer.size(), M * kWidth));
    Acc* c = buffer.data();
    int configured = 0;  // this thread's tile rows (another library may use the tiles too)
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* w = packed + p * panel_stride;
      for (int64_t s0 = 0; s0 < steps; s0 += run_steps) {
        const int64_t s1 = std::min(steps, s0 + run_steps);
        for (int64_t m = 0; m < M; m += kRows) {
          const int rows = static_cast<int>(std::min(kRows, M - m));
          if (rows != configured) configure(rows), configured = rows;
          Acc* sums = c + m * kWidth;
          if (s0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, sums, kStride);
            _tile_loadd(1, sums + 16, kStride);
            _tile_loadd(2, sums + 32, kStride);
            _tile_loadd(3, sums + 48, kStride);
          }
          const uint8_t* a = x + m * ldx;
          for (int64_t s = s0; s < s1; ++s) {
            const uint8_t* b = w + s * kRows * kUnitRowBytes;
            _tile_loadd(4, a + s * kStepBytes, ldx);
            _tile_loadd(5, b, kUnitRowBytes);
            PAGEDSERVE_TILE_DOT(P, 0, 5);
            _tile_loadd(6, b + 64, kUnitRowBytes);
            PAGEDSERVE_TILE_DOT(P, 1, 6);
            _tile_loadd(7, b + 128, kUnitRowBytes);
            PAGEDSERVE_TILE_DOT(P, 2, 7);
            _tile_loadd(5, b + 192, kUnitRowBytes);
            PAGEDSERVE_TILE_DOT(P, 3, 5);
          }
          _tile_stored(0, sums, kStride);
          _tile_stored(1, sums + 16, kStride);
          _tile_stored(2, sums + 32, kStride);
          _tile_stored(3, sums + 48, kStride);
        }
      }
      for (int64_t m = 0; m < M; m += kRows)
        flush(static_cast<const Acc*>(c + m * kWidth), kWidth, m, std::min(kRows, M - m),
              p * kWidth, (p + 1) * kWidth);
    }
    if (configured != 0) _tile_release();
  });
}

#undef PAGEDSERVE_TILE_DOT

}  // namespace pagedserve_amx

#endif
