// Paged attention for CPU (torch.ops.pagedserve.paged_attention): reads K/V straight from
// the cache blocks through the block tables (no gathered copy of the context), one work
// item per query row (all heads; per KV head when there are fewer rows than threads),
// spread over threads in runs of equal key counts, whose last items they then share out.
//
// Layouts (see pagedserve/attention/backend.py):
//   query       [num_tokens, num_heads, head_dim]
//   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V),
//               the query's dtype or bfloat16 (--kv-cache-dtype bfloat16)
//   block_tables[num_seqs, max_blocks] int64, seq_lens [num_seqs] int64,
//   query_start_loc [num_seqs + 1] int64
//   out         [num_tokens, num_heads, head_dim]
// Query row i of sequence s sits at position seq_len - q_len + i and sees keys at
// positions p with p <= pos and (window == 0 or p > pos - window).
//
// Softmax is computed online over tiles of 64 or 128 keys (tile_keys), across blocks
// (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"): per tile and KV
// head, each query head sharing it gets its scores (a register's worth of keys at a time,
// their horizontal sums sharing shuffles), exponentials a register at a time and one
// rescale of the running max and sum; then all of them accumulate V together, each V row
// loaded once. A decode step reads every layer's context from DRAM once, and the blocks are
// scattered over pages the hardware prefetcher does not follow, so each thread asks for its
// rows a tile ahead of the reads, a few lines per key its loops visit (KeyStream). Head
// sizes 64 and 128 get register-blocked loops (AVX-512 registers where the CPU has them);
// other sizes take plain loops the compiler vectorizes.
// All arithmetic is float32 whatever the storage dtype (bfloat16 converts in registers),
// but for a bfloat16 query against a bfloat16 cache where the CPU has AVX512-BF16: it scores
// on AMX tiles where the CPU has them (all query heads of a KV head at once:
// score_keys_amx), else by vdpbf16ps (dot_keys_bf16), and takes P.V by vdpbf16ps with P
// rounded to bfloat16 (accumulate_v_bf16), as Hugging Face's bfloat16 attention and
// PyTorch's CPU flash attention round P before their P.V; all take exact products and
// float32 sums. There, a prompt's rows score with the keys in lanes, several rows to each
// transposed tile of K (attend_rows, kInLanes), by the same sums in the same order as a
// lone row's horizontal ones: a row's bits do not depend on its batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "cpu_vec.h"
#include "gemm_blocking.h"

namespace {

// Keys per online-softmax tile (across blocks) at most: the max/exp/rescale work of a tile
// is shared by its keys (tile_keys).
constexpr int64_t kMaxTileKeys = 128;

// Keys per tile for rows of `row_bytes` (a KV head's K or V row): 128 where a tile's K and
// V rows of a KV head fit in two thirds of the L1 data cache (sysconf; 48 KiB if it does not
// say), beside the scores, else 64: a bfloat16 head of 64 on a 48 KiB L1d. There, a prompt's
// attention ran 1.09-1.17x faster than in tiles of 64 keys (Zen 5); a float32 head of 64 in
// tiles of 128 (64 KiB) made decodes 4-5% slower.
inline int64_t tile_keys(int64_t row_bytes) {
  static const int64_t l1 = pagedserve_gemm::cache_bytes(_SC_LEVEL1_DCACHE_SIZE, 48 * 1024);
  return 2 * kMaxTileKeys * row_bytes <= 2 * l1 / 3 ? kMaxTileKeys : kMaxTileKeys / 2;
}

// Query rows (of one sequence) that share each tile's transposed keys (attend_rows).
constexpr int64_t kMaxRows = 16;

using pagedserve_vec::kLanes, pagedserve_vec::vf, pagedserve_vec::vi;
using pagedserve_vec::loadv, pagedserve_vec::storev;
typedef float v8f __attribute__((vector_size(32)));

// exp(x) for x <= 0 (softmax exponents: score minus a running max), 0 below -87 (also
// for -inf); Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-7
// polynomial, 2^n through the exponent bits. Within a few ulp, inline over a whole
// register (std::exp is a libm call per element, or per eight when GCC vectorizes it).
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.f;
  const vf xc = x < lo ? lo : x;
  // n = round(x / ln2): truncation of a non-positive value minus 0.5
  const vi n = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi);
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi pow2n = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &pow2n, sizeof(scale));
  return x < lo ? vf{} : p * scale;
}

// A register's two halves added, down to 8 lanes (one AVX2 register).
template <typename V>
inline v8f fold8(V x) {
  if constexpr (sizeof(V) == 64)
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  else
    return x;
}

// The sum of x's lanes by one fixed tree (halves, then pairs, then the last two), each sum
// held by an empty asm: -ffast-math would otherwise order the sums as it likes wherever
// this is inlined (seen: a change elsewhere in the file changed rows' last bits).
inline float sum8(v8f x) {
  typedef float v4f __attribute__((vector_size(16)));
  v4f h = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  asm("" : "+x"(h));
  float a = h[0] + h[2], b = h[1] + h[3];
  asm("" : "+x"(a), "+x"(b));
  return a + b;
}

// Offset (elements) of key position `pos`'s row in the cache, through the block table.
inline int64_t key_row(const int64_t* table, int64_t pos, int64_t block_size,
                       int64_t token_stride) {
  return (table[pos / block_size] * block_size + pos % block_size) * token_stride;
}

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (AVX's vhaddps).
inline v8f hadd(v8f a, v8f b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// [sum(x[0]), ..., sum(x[7])]: eight horizontal sums in seven shuffle-adds, not 8 x 3.
inline v8f sum8x8(const v8f* x) {
  const v8f lo4 = hadd(hadd(x[0], x[1]), hadd(x[2], x[3]));
  const v8f hi4 = hadd(hadd(x[4], x[5]), hadd(x[6], x[7]));
  return __builtin_shufflevector(lo4, hi4, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo4, hi4, 4, 5, 6, 7, 12, 13, 14, 15);
}

// The keys a query row (or part of it) attends to: K and V at its first KV head, its
// sequence's block table, positions [lo, hi). `cold`: its rows are prefetched (a decode
// row, a prompt chunk's first row, a thread's first item); a prompt chunk's later rows
// find the rows the row before read in L1/L2, where prefetching them again only costs
// instructions (prompt attention 1.15x faster without, Zen 5).
template <typename T>
struct Keys {
  const T* k_base;
  const T* v_base;
  const int64_t* table;
  int64_t lo, hi;
  bool cold;
};

// A thread's K and V rows, in the order its items read them (the keys of its cold items),
// asked for ahead of the arithmetic and in step with it: the loops over a tile's keys
// report each key they visit (per KV head, each query head's scores and then V visit it),
// and as many visits as a key gets ask for one key's K and V lines, so the requests run a
// tile's keys (`lead`) ahead of the reads, across tiles and rows (a key's lines at once,
// not a line per visit: a fifth fewer cycles a key when the rows are in cache, Zen 5). The
// rows of a row's later tiles and of the thread's next row are on other pages (blocks are
// scattered) that the hardware prefetcher does not follow. A core has only so many misses
// in flight (two Zen 5 cores read scattered 6 KiB blocks at 33 GB/s, the same bytes in
// order at 59): requests made in a burst stall it until the first arrive, and the
// arithmetic with them; spread over the keys, the arithmetic goes on while they arrive
// (decode 1.07-1.28x against a burst per query head, Zen 5; benchmarks/README.md).
template <typename T>
class KeyStream {
 public:
  // items [0, count): the thread's, in order; lines: a K (and a V) row's cache lines, at
  // an item's first KV head; visits: per key, by the loops; lead: keys asked for ahead.
  KeyStream(const Keys<T>* items, int64_t count, int64_t block_size, int64_t token_stride,
            int64_t lines, int64_t visits, int64_t lead)
      : items_(items), count_(count), block_size_(block_size), token_stride_(token_stride),
        lines_(lines), visits_(visits) {
    next_item();
    // nothing is in flight yet
    for (int64_t i = 0; i < lead && item_ < count_; ++i) ask_key();
  }

  // After `visits` more visits (of any keys).
  inline void next(int64_t visits = 1) {
    credit_ += visits;
    for (; credit_ >= visits_; credit_ -= visits_) ask_key();
  }

 private:
  // The next key's K and V lines, then the key after it.
  void ask_key() {
    constexpr int64_t kLine = 64 / sizeof(T);
    const Keys<T>& keys = items_[item_];
    const T* k = keys.k_base + row_;
    const T* v = keys.v_base + row_;
    for (int64_t l = 0; l < lines_; ++l) {
      __builtin_prefetch(k + l * kLine, 0, 3);
      __builtin_prefetch(v + l * kLine, 0, 3);
    }
    // the next key's row: the one after in its block, or the next block's first (a
    // division per key cost 7% of decode attention with the rows in cache, Zen 5)
    if (++pos_ == keys.hi)
      next_item();
    else if (++in_block_ < block_size_)
      row_ += token_stride_;
    else
      in_block_ = 0, row_ = keys.table[++block_] * block_size_ * token_stride_;
  }

  // The next cold item (a warm one's rows were read by the row before), or the end.
  void next_item() {
    do ++item_;
    while (item_ < count_ && (!items_[item_].cold || items_[item_].lo == items_[item_].hi));
    if (item_ == count_) {
      visits_ = INT64_MAX;  // nothing left: no visits earn a key
      return;
    }
    pos_ = items_[item_].lo;
    block_ = pos_ / block_size_, in_block_ = pos_ % block_size_;
    row_ = key_row(items_[item_].table, pos_, block_size_, token_stride_);
  }

  const Keys<T>* items_;
  int64_t count_, block_size_, token_stride_, lines_, visits_;
  int64_t item_ = -1, pos_ = 0, row_ = 0;  // the next key to ask for
  int64_t block_ = 0, in_block_ = 0;       // pos_'s block-table entry, its place in it
  int64_t credit_ = 0;  // visits made since the last key asked for
};

// [sum of key(0)'s lanes, ..., sum of key(kLanes - 1)'s], each by one fixed tree: fold8
// (lane l + lane l + 8, with AVX-512), then sum8x8's (neighbours, pairs of them, the two
// halves). With AVX-512 two keys' 8-lane trees share one register: a sum takes half the
// shuffles of fold8 and sum8x8 apart, with the same bits (prompt attention 1.07x, bfloat16,
// Zen 5). Keys i and i + 8 are folded together as soon as they are made: with all 16 live
// first, float32 scoring ran 6% slower.
template <typename Key>
inline vf sum_lanes(const Key& key) {
#ifdef __AVX512F__
  auto hadd16 = [](vf a, vf b) {  // hadd on each 256-bit half (vshufps works per 128 bits)
    return __builtin_shufflevector(a, b, 0, 2, 16, 18, 4, 6, 20, 22,  //
                                   8, 10, 24, 26, 12, 14, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 17, 19, 5, 7, 21, 23,  //
                                   9, 11, 25, 27, 13, 15, 29, 31);
  };
  vf z[8];  // z[i]: fold8(key(i)) in the low half, fold8(key(i + 8)) in the high
  for (int i = 0; i < 8; ++i) {
    const vf a = key(i), b = key(i + 8);
    z[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7,  //
                                   16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15,  //
                                   24, 25, 26, 27, 28, 29, 30, 31);
  }
  // lanes of lo4: keys 0-3 (two partial sums each), then 8-11; of hi4: 4-7, then 12-15
  const vf lo4 = hadd16(hadd16(z[0], z[1]), hadd16(z[2], z[3]));
  const vf hi4 = hadd16(hadd16(z[4], z[5]), hadd16(z[6], z[7]));
  return __builtin_shufflevector(lo4, hi4, 0, 1, 2, 3, 16, 17, 18, 19,  //
                                 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(lo4, hi4, 4, 5, 6, 7, 20, 21, 22, 23,  //
                                 12, 13, 14, 15, 28, 29, 30, 31);
#else
  v8f x[8];
  for (int i = 0; i < 8; ++i) x[i] = key(i);
  return sum8x8(x);
#endif
}

// scores[j] = scale * sum of dot(k_j)'s lanes (fold8, then sum8x8's tree), k_j = rows[j] +
// offset, for the tile's n keys: a register's lanes of keys at a time so that their
// horizontal sums share shuffles, the last keys in the same sums with zeros in place of the
// keys past n, so that each key's sum is the same whatever its place in the tile (and
// whatever the compiler makes of a loop's reduction). The visits are reported to `prefetch`
// a register of keys at a time (a report per key slowed prompt attention 1.17x).
template <typename T, typename Dot>
inline void score_keys(const Dot& dot, const T* const* rows, int64_t offset, int64_t n,
                       float scale, float* scores, KeyStream<T>& prefetch) {
  auto sums_of = [&](int64_t j, int64_t count) {
    return sum_lanes([&](int i) { return i < count ? dot(rows[j + i] + offset) : vf{}; }) * scale;
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf sums = sums_of(j, kLanes);
    std::memcpy(scores + j, &sums, sizeof(sums));
    prefetch.next(kLanes);
  }
  if (j < n) {
    const vf sums = sums_of(j, n - j);
    std::memcpy(scores + j, &sums, (n - j) * sizeof(float));
    prefetch.next(n - j);
  }
}

// scores[j] = q . k_j for a head of D = kLanes * kChunks floats (q scaled already).
template <int kChunks, typename T>
inline void dot_keys(const float* q, const T* const* rows, int64_t offset, int64_t n,
                     float* scores, KeyStream<T>& prefetch) {
  vf qv[kChunks];
  for (int c = 0; c < kChunks; ++c) qv[c] = loadv(q + kLanes * c);
  auto dot = [&](const T* k) {
    vf a = qv[0] * loadv(k);
    for (int c = 1; c < kChunks; ++c) a += qv[c] * loadv(k + kLanes * c);
    return a;
  };
  score_keys(dot, rows, offset, n, 1.f, scores, prefetch);
}

#ifdef __AVX512BF16__
// scores[j] = scale * (q . k_j) for a bfloat16 query head and bfloat16 keys, D = 32 * kRegs:
// vdpbf16ps multiplies 32 bfloat16 pairs into 16 float32 lanes (exact products, float32
// sums), so the keys are used as stored, not widened first: a third of the instructions
// of the float32 loop. Summed by score_keys.
template <int kRegs>
inline void dot_keys_bf16(const c10::BFloat16* q, const c10::BFloat16* const* rows,
                          int64_t offset, int64_t n, float scale, float* scores,
                          KeyStream<c10::BFloat16>& prefetch) {
  __m512bh qv[kRegs];
  for (int c = 0; c < kRegs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  auto dot = [&](const c10::BFloat16* k) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
    for (int c = 1; c < kRegs; ++c)
      a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return reinterpret_cast<vf>(a);
  };
  score_keys(dot, rows, offset, n, scale, scores, prefetch);
}
#endif

#if defined(PAGEDSERVE_AMX)
// Scores on AMX tiles (Intel SDM, TDPBF16PS) for all `group` query heads of a KV head at
// once, bfloat16 query and cache, D = 32 * kSteps: C [16 keys x group] = A [16 keys x 32
// d] (the K rows as the cache holds them: one tile load, rows a token apart) x B [32 d x
// group] (the query heads in bfloat16 pairs, built once per row: q_pairs). Each key's
// sum is its own C row: no horizontal sums, and K is read once for all the heads. The
// tiles (configure_score_tiles): 0-1 C, 2-3 A, 4-7 B (one per 32 d: D <= 128).
using pagedserve_amx::kRows;  // keys a C tile scores, and query-head pairs a B tile holds

inline void configure_score_tiles(int64_t group) {
  pagedserve_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kRows;
    config.colsb[t] = t == 2 || t == 3 ? 64 : group * 4;
  }
  pagedserve_amx::load_config(config);
}

// q_pairs [kSteps][16][group] uint32: unit u of step s for head i is q[i][32 s + 2 u],
// q[i][32 s + 2 u + 1] (a B tile's layout: a unit of one column in 4 bytes); a scatter
// per head and step.
template <int kSteps>
inline void build_q_pairs(const c10::BFloat16* q, int64_t group, uint32_t* q_pairs) {
  const __m512i units =  // u * group
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(static_cast<int>(group)));
  for (int64_t s = 0; s < kSteps; ++s)
    for (int64_t i = 0; i < group; ++i)
      _mm512_i32scatter_epi32(q_pairs + s * kRows * group + i, units,
                              _mm512_loadu_si512(q + i * 32 * kSteps + 32 * s), 4);
}

// One sub-tile of 16 keys into C tile C: A rows a, lda bytes apart. A macro: GCC's tile
// intrinsics paste their tile numbers into the instruction's text, so they must be literals.
#define PAGEDSERVE_SCORE_ROWS(C)          \
  do {                                    \
    _tile_zero(C);                        \
    _tile_loadd(2, a, lda);               \
    _tile_dpbf16ps(C, 2, 4);              \
    _tile_loadd(3, a + 32, lda);          \
    _tile_dpbf16ps(C, 3, 5);              \
    if constexpr (kSteps == 4) {          \
      _tile_loadd(2, a + 64, lda);        \
      _tile_dpbf16ps(C, 2, 6);            \
      _tile_loadd(3, a + 96, lda);        \
      _tile_dpbf16ps(C, 3, 7);            \
    }                                     \
    _tile_stored(C, sums + j * group, ldb); \
  } while (0)

// scores[i][j] = scale * (q_i . k_j) for the group's heads i, keys j < n (k_j = rows[j] +
// offset; rows token_stride elements apart within a block). Where every run of 16 keys is
// in one block (in_place: the runs start at multiples of 16, and so do blocks), a whole
// run is loaded as the cache holds it; a shorter run, or any run elsewhere, is copied to
// k_copy [16][D] first.
template <int kSteps>
inline void score_keys_amx(const uint32_t* q_pairs, const c10::BFloat16* const* rows,
                           int64_t offset, int64_t n, int64_t token_stride, bool in_place,
                           int64_t group, float scale, float* scores, c10::BFloat16* k_copy,
                           float* sums, KeyStream<c10::BFloat16>& prefetch) {
  constexpr int64_t D = 32 * kSteps;
  const int64_t ldb = group * 4;
  _tile_loadd(4, q_pairs, ldb);
  _tile_loadd(5, q_pairs + kRows * group, ldb);
  if constexpr (kSteps == 4) {
    _tile_loadd(6, q_pairs + 2 * kRows * group, ldb);
    _tile_loadd(7, q_pairs + 3 * kRows * group, ldb);
  }
  for (int64_t j = 0; j < n; j += kRows) {
    const int64_t count = std::min(kRows, n - j);
    const c10::BFloat16* a = rows[j] + offset;
    int64_t lda = token_stride * 2;
    if (count < kRows || !in_place) {
      for (int64_t r = 0; r < count; ++r) std::memcpy(k_copy + r * D, rows[j + r] + offset, D * 2);
      a = k_copy, lda = D * 2;  // rows past count: stale, their sums unread
    }
    if ((j / kRows) % 2 == 0)
      PAGEDSERVE_SCORE_ROWS(0);
    else
      PAGEDSERVE_SCORE_ROWS(1);
    prefetch.next(count * group);  // as the heads' loops would
  }
  for (int64_t i = 0; i < group; ++i)
    for (int64_t j = 0; j < n; ++j) scores[i * kMaxTileKeys + j] = sums[j * group + i] * scale;
}
#undef PAGEDSERVE_SCORE_ROWS
#endif

// acc[h][0:D] += sum_j p[h][j] * (rows[j] + offset)[0:D] for kH query heads sharing one
// KV head (D = kLanes * kChunks; acc rows D apart, p rows kMaxTileKeys apart): each V row is
// loaded and widened once for all of them, and the accumulators stay in registers across
// the keys. An FMA waits 4 cycles for the previous one into the same register: with fewer
// than 8 chains (heads x chunks), even and odd keys get accumulators of their own.
template <int kChunks, int kH, typename T>
inline void accumulate_v(float* acc, const float* p, const T* const* rows, int64_t offset,
                         int64_t n, KeyStream<T>& prefetch, int64_t visits) {
  constexpr int64_t D = kLanes * kChunks;
  constexpr bool kSplit = kH * kChunks < 8;
  vf a[kH][kChunks], b[kH][kChunks];
  for (int h = 0; h < kH; ++h)
    for (int c = 0; c < kChunks; ++c) a[h][c] = loadv(acc + h * D + kLanes * c), b[h][c] = vf{};
  int64_t j = 0;
  if constexpr (kSplit)
    for (; j + 2 <= n; j += 2) {
      const T* v0 = rows[j] + offset;
      const T* v1 = rows[j + 1] + offset;
      for (int c = 0; c < kChunks; ++c) {
        const vf x0 = loadv(v0 + kLanes * c), x1 = loadv(v1 + kLanes * c);
        for (int h = 0; h < kH; ++h) {
          a[h][c] += p[h * kMaxTileKeys + j] * x0;
          b[h][c] += p[h * kMaxTileKeys + j + 1] * x1;
        }
      }
      prefetch.next(2 * visits);
    }
  for (; j < n; ++j) {
    for (int c = 0; c < kChunks; ++c) {
      const vf x = loadv(rows[j] + offset + kLanes * c);
      for (int h = 0; h < kH; ++h) a[h][c] += p[h * kMaxTileKeys + j] * x;
    }
    prefetch.next(visits);
  }
  for (int h = 0; h < kH; ++h)
    for (int c = 0; c < kChunks; ++c) storev(acc + h * D + kLanes * c, a[h][c] + b[h][c]);
}

// run(h, heads) for a KV head's `group` query heads in passes of up to kMaxH (what the
// registers hold): heads [h, h + heads) with heads a std::integral_constant, so that each
// pass's loops are register-blocked.
template <int kMaxH, typename Run>
inline void for_head_passes(int64_t group, const Run& run) {
  for (int64_t h = 0; h < group; h += kMaxH) {
    const int64_t heads = std::min<int64_t>(kMaxH, group - h);
    if (kMaxH >= 4 && heads == 4)
      run(h, std::integral_constant<int, std::min(kMaxH, 4)>{});
    else if (kMaxH >= 3 && heads == 3)
      run(h, std::integral_constant<int, std::min(kMaxH, 3)>{});
    else if (kMaxH >= 2 && heads == 2)
      run(h, std::integral_constant<int, std::min(kMaxH, 2)>{});
    else
      run(h, std::integral_constant<int, 1>{});
  }
}

// accumulate_v for a KV head's `group` query heads, as many at a time as the registers
// hold (accumulators and one V row: 32 registers with AVX-512, 16 with AVX2).
template <int kChunks, typename T>
inline void accumulate_v_group(float* acc, const float* p, const T* const* rows,
                               int64_t offset, int64_t n, int64_t group,
                               KeyStream<T>& prefetch) {
  constexpr int kRegisters = kLanes == 16 ? 32 : 16;
  constexpr int kMaxH = std::clamp((kRegisters - kChunks) / kChunks, 1, 4);
  constexpr int64_t D = kLanes * kChunks;
  for_head_passes<kMaxH>(group, [&](int64_t h, auto heads) {
    const int64_t visits = h == 0;  // a key's one V visit, whatever the passes
    accumulate_v<kChunks, decltype(heads)::value>(acc + h * D, p + h * kMaxTileKeys, rows,
                                                  offset, n, prefetch, visits);
  });
}

#ifdef __AVX512BF16__
// acc[h] += sum_j p[h][j] * v_j for kH query heads over bfloat16 V rows, with P rounded to
// bfloat16 (p: [kH][kMaxTileKeys] bfloat16 bits): vdpbf16ps on pairs of keys, (p_j, p_j+1)
// broadcast against V rows j and j + 1 interleaved (vpunpck{l,h}wd), exact products and
// float32 sums. The interleave leaves a chunk's 32 dims in the order of vpunpck's 128-bit
// lanes (lo: 0-3, 8-11, 16-19, 24-27; hi: the other four of each eight), so acc holds that
// order until the row's end (stored_dim).
template <int kRegs, int kH>
inline void accumulate_v_bf16(float* acc, const uint16_t* p,
                              const c10::BFloat16* const* rows, int64_t offset, int64_t n,
                              KeyStream<c10::BFloat16>& prefetch, int64_t visits) {
  constexpr int64_t D = 32 * kRegs;
  constexpr int kAcc = 2 * kRegs;
  constexpr bool kSplit = kH * kAcc < 8;
  __m512 a[kH][kAcc], b[kH][kAcc];
  for (int h = 0; h < kH; ++h)
    for (int c = 0; c < kAcc; ++c)
      a[h][c] = _mm512_loadu_ps(acc + h * D + 16 * c), b[h][c] = _mm512_setzero_ps();
  auto pair = [&](__m512 (&s)[kH][kAcc], int64_t j, bool both) {
    __m512i pj[kH];
    for (int h = 0; h < kH; ++h) {
      uint32_t bits;
      std::memcpy(&bits, p + h * kMaxTileKeys + j, 4);
      pj[h] = _mm512_set1_epi32(static_cast<int>(bits));
    }
    const c10::BFloat16* v0 = rows[j] + offset;
    const c10::BFloat16* v1 = both ? rows[j + 1] + offset : nullptr;
    for (int c = 0; c < kRegs; ++c) {
      const __m512i x0 = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i x1 = both ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      for (int h = 0; h < kH; ++h) {
        s[h][2 * c] = _mm512_dpbf16_ps(s[h][2 * c], lo, (__m512bh)pj[h]);
        s[h][2 * c + 1] = _mm512_dpbf16_ps(s[h][2 * c + 1], hi, (__m512bh)pj[h]);
      }
    }
  };
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    if (kSplit && j % 4 == 2)
      pair(b, j, true);
    else
      pair(a, j, true);
    prefetch.next(2 * visits);
  }
  if (j < n) {
    pair(a, j, false);
    prefetch.next(visits);
  }
  for (int h = 0; h < kH; ++h)
    for (int c = 0; c < kAcc; ++c)
      _mm512_storeu_ps(acc + h * D + 16 * c,
                       kSplit ? _mm512_add_ps(a[h][c], b[h][c]) : a[h][c]);
}

// accumulate_v_bf16 for a KV head's `group` query heads, as many at a time as the registers
// hold (per head its accumulators and P's broadcast pair; the V pairs' four). Their
// exponentials (scores [group][kMaxTileKeys], float32, zeros past n to a whole register) are
// rounded to bfloat16 first, into p [group][kMaxTileKeys].
template <int kRegs>
inline void accumulate_v_bf16_group(float* acc, const float* scores,
                                    const c10::BFloat16* const* rows, int64_t offset,
                                    int64_t n, int64_t group, uint16_t* p,
                                    KeyStream<c10::BFloat16>& prefetch) {
  constexpr int kMaxH = std::clamp((32 - 6) / (2 * kRegs + 1), 1, 4);
  constexpr int64_t D = 32 * kRegs;
  for (int64_t i = 0; i < group; ++i)
    for (int64_t j = 0; j < n; j += 16) {
      const __m256bh e = _mm512_cvtneps_pbh(_mm512_loadu_ps(scores + i * kMaxTileKeys + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i * kMaxTileKeys + j), (__m256i)e);
    }
  for_head_passes<kMaxH>(group, [&](int64_t h, auto heads) {
    const int64_t visits = h == 0;  // a key's one V visit, whatever the passes
    accumulate_v_bf16<kRegs, decltype(heads)::value>(acc + h * D, p + h * kMaxTileKeys, rows,
                                                     offset, n, prefetch, visits);
  });
}
#endif

// Where accumulate_v_bf16 keeps dim d of a head (its index in acc): per 32 dims, lo's 16
// lanes then hi's; dim 8 L + w of 128-bit lane L sits in lo for w < 4, in hi for the rest.
inline int64_t stored_dim(int64_t d) {
  const int64_t r = d % 32;
  return d - r + (r % 8 < 4 ? 0 : 16) + 4 * (r / 8) + r % 4;
}

// The same for any D (the compiler vectorizes the loops over it).
template <typename T>
inline void dot_keys_any(const float* q, const T* const* rows, int64_t offset, int64_t n,
                         int64_t D, float* scores, KeyStream<T>& prefetch) {
  for (int64_t j = 0; j < n; ++j) {
    prefetch.next();
    const T* k = rows[j] + offset;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * static_cast<float>(k[d]);
    scores[j] = dot;
  }
}

template <typename T>
inline void accumulate_v_any(float* acc, const float* p, const T* const* rows,
                             int64_t offset, int64_t n, int64_t D, KeyStream<T>& prefetch,
                             int64_t visits) {
  for (int64_t j = 0; j < n; ++j) {
    prefetch.next(visits);
    const T* v = rows[j] + offset;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * static_cast<float>(v[d]);
  }
}

// Online-softmax step for one head over a tile: scores[0:n] (padded with -inf to a whole
// register) become exp(score - new max); returns the factor that rescales the head's
// earlier accumulator and sum, and updates its running max `m` and sum `l`.
inline float softmax_tile(float* scores, int64_t n, float& m, float& l) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = n; j < padded; ++j) scores[j] = -INFINITY;
  vf mx = loadv(scores);
  for (int64_t j = kLanes; j < padded; j += kLanes) {
    const vf s = loadv(scores + j);
    mx = s > mx ? s : mx;
  }
#ifdef __AVX512F__  // a shuffle tree, not a chain of 16 (a maximum is the same in any order)
  const float new_max = std::max(m, _mm512_reduce_max_ps(reinterpret_cast<__m512>(mx)));
#else
  float new_max = m;
  for (int i = 0; i < kLanes; ++i) new_max = std::max(new_max, mx[i]);
#endif
  vf sum = vf{};
  for (int64_t j = 0; j < padded; j += kLanes) {
    const vf e = exp_nonpositive(loadv(scores + j) - new_max);
    storev(scores + j, e);
    sum += e;
#ifdef __AVX__
    asm("" : "+v"(sum));  // in key order (sum8)
#else
    asm("" : "+m"(sum));  // no one register holds a vf of 8 floats without AVX
#endif
  }
  const float correction = exp_nonpositive(vf{} + (m - new_max))[0];
  l = l * correction + sum8(fold8(sum));
  m = new_max;
  return correction;
}

// Pointers to K and V rows of positions [start, start + n) (at the first KV head of this
// item), a block's run of rows at a time: one division per block, not per key.
template <typename T>
void tile_rows(const T* k_base, const T* v_base, const int64_t* table, int64_t start,
               int64_t n, int64_t block_size, int64_t token_stride, const T** krows,
               const T** vrows) {
  for (int64_t j = 0; j < n;) {
    const int64_t row = key_row(table, start + j, block_size, token_stride);
    const int64_t run = std::min(n - j, block_size - (start + j) % block_size);
    for (int64_t i = 0; i < run; ++i, ++j) {
      krows[j] = k_base + row + i * token_stride;
      vrows[j] = v_base + row + i * token_stride;
    }
  }
}

#ifdef __AVX512BF16__
// The transpose of a 16 x 16 matrix of 32-bit elements, r[i] its row i: unpacks within
// 128-bit lanes (pairs of rows, then fours), then 128-bit lanes moved across registers.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4 b + c], lane k: column 4 k + c of rows 4 b .. 4 b + 3
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);  // lanes 0, 1 of each
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);  // lanes 2, 3
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);  // lane 0 of u[c], u[4 + c], u[8 + c], ...
    r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// Keys in lanes: kt [kPairs][16] for keys rows[0 .. count) (count <= 16; zeros after),
// unit u of key i (dims 2 u and 2 u + 1, a bfloat16 pair) at kt[16 u + i].
template <int kPairs>
inline void transpose_keys(const c10::BFloat16* const* rows, int64_t offset, int64_t count,
                           uint32_t* kt) {
  for (int b = 0; b < kPairs / 16; ++b) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < count ? _mm512_loadu_si512(rows[i] + offset + 32 * b) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int u = 0; u < 16; ++u) _mm512_storeu_si512(kt + 16 * (16 * b + u), r[u]);
  }
}

// scale * (q_c . k_i) for the 16 keys of kt (transpose_keys), one in each lane, for kC
// query rows q[c], with the bits of dot_keys_bf16 and score_keys: lane l of that loop's
// register is here a register of its own (units l, l + 16, ... in that order), and the
// horizontal tree (fold8's lane l + lane l + 8, then sum8x8's neighbours, pairs of them,
// the two halves) runs across registers, no shuffles. Each K register loaded serves kC
// rows: one row alone takes a K load and a broadcast per vdpbf16ps, and the loads, not
// vdpbf16ps, bounded it (four rows: prompts 1.11-1.17x, Zen 5).
template <int kPairs, int kC>
inline void score_keys_in_lanes(const c10::BFloat16* const* q, const uint32_t* kt,
                                float scale, vf* out) {
  // Each sum held by an empty asm: -ffast-math would otherwise rebuild the tree in its own
  // order (other bits than the shuffled sums; 1 x 1,536 prompts changed).
  auto add = [](vf a, vf b) {
    vf c = a + b;
    asm("" : "+v"(c));
    return c;
  };
  auto unit = [&](int c, int u) {  // query c's dims 2 u and 2 u + 1, broadcast
    uint32_t bits;
    std::memcpy(&bits, q[c] + 2 * u, 4);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
  };
  // f[c] = lane l's sum + lane l + 8's, for each query
  auto fold = [&](int l, vf* f) {
    __m512 a[kC], b[kC];
    for (int c = 0; c < kC; ++c) a[c] = b[c] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int u = l; u < kPairs; u += 16) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(kt + 16 * u);
      const __m512bh kb = (__m512bh)_mm512_loadu_si512(kt + 16 * (u + 8));
      for (int c = 0; c < kC; ++c) {
        a[c] = _mm512_dpbf16_ps(a[c], unit(c, u), ka);
        b[c] = _mm512_dpbf16_ps(b[c], unit(c, u + 8), kb);
      }
    }
    for (int c = 0; c < kC; ++c)
      f[c] = add(reinterpret_cast<vf>(a[c]), reinterpret_cast<vf>(b[c]));
  };
  vf x[kC], y[kC], lo4[kC];
  fold(0, x), fold(1, y);
  for (int c = 0; c < kC; ++c) x[c] = add(x[c], y[c]);
  fold(2, y), fold(3, lo4);
  for (int c = 0; c < kC; ++c) lo4[c] = add(x[c], add(y[c], lo4[c]));
  fold(4, x), fold(5, y);
  for (int c = 0; c < kC; ++c) x[c] = add(x[c], y[c]);
  fold(6, y), fold(7, out);
  for (int c = 0; c < kC; ++c) out[c] = add(lo4[c], add(x[c], add(y[c], out[c]))) * scale;
}

// scores [rows][group][kMaxTileKeys] of a KV head's query heads (q: the first row's first
// head; rows row_stride apart) over a tile's `tile` keys, kt (transpose_keys); row r has
// n0 + r of them (at most tile; past its count: overwritten by softmax_tile).
template <int kPairs>
inline void score_tile_in_lanes(const c10::BFloat16* q, int64_t rows, int64_t row_stride,
                                int64_t group, int64_t tile, int64_t n0, const uint32_t* kt,
                                float scale, float* scores,
                                KeyStream<c10::BFloat16>& prefetch) {
  constexpr int kC = 4;  // rows sharing each K register
  constexpr int64_t D = 2 * kPairs;
  for (int64_t i = 0; i < group; ++i)
    for (int64_t r = 0; r < rows;) {
      const int64_t count = rows - r >= kC ? kC : 1;
      const int64_t n = std::min(tile, n0 + r + count - 1);  // the chunk's last row's
      const c10::BFloat16* qs[kC];
      for (int64_t c = 0; c < count; ++c) qs[c] = q + (r + c) * row_stride + i * D;
      for (int64_t j = 0; j < n; j += 16) {
        vf s[kC];
        if (count == kC)
          score_keys_in_lanes<kPairs, kC>(qs, kt + j * kPairs, scale, s);
        else
          score_keys_in_lanes<kPairs, 1>(qs, kt + j * kPairs, scale, s);
        for (int64_t c = 0; c < count; ++c)
          std::memcpy(scores + ((r + c) * group + i) * kMaxTileKeys + j, &s[c], sizeof(vf));
        prefetch.next(std::min<int64_t>(16, n - j) * count);
      }
      r += count;
    }
}
#endif

// kD: the head size when it is 64 or 128 (register-blocked loops), else 0 (any size).
// scalar_t: the query's and output's dtype; cache_t: the KV cache's (the same, or
// bfloat16 under --kv-cache-dtype bfloat16). kAmx: scores on AMX tiles (score_keys_amx;
// both bfloat16, kD > 0, group <= 16; the caller has configured the tiles).
// kInLanes (bfloat16 query and cache, kD > 0, vdpbf16ps, not kAmx): `rows` consecutive
// query rows of one sequence, row r seeing keys [lo, hi + r) (no window), score with the
// keys in lanes, each tile's keys transposed once for all of them: a prompt's scores
// without horizontal sums (bfloat16 prompt attention 1.28-1.42x, 1.28-1.56x at Llama 3.2
// 1B's heads, Zen 5). Every row's bits are those it gets alone (score_keys_in_lanes).
// Otherwise rows is 1. An instantiation of its own: with both in one, lone rows (decodes)
// ran 5% slower (Zen 5).
template <typename scalar_t, typename cache_t, int kD, bool kAmx, bool kInLanes = false>
void attend_rows(const scalar_t* q,  // [rows][num_heads, D]: these heads of each row
                 int64_t query_rows, int64_t row_stride,  // q, out: elements between rows
                 const Keys<cache_t>& keys,         // the first row's
                 KeyStream<cache_t>& prefetch,      // the thread's: visits reported
                 int64_t block_size, int64_t token_stride, int64_t kv_heads, int64_t group,
                 int64_t head_dim, float scale, scalar_t* out) {
  // Per tile and KV head: the query heads sharing it (GQA) score the tile's keys, then each
  // rescales its running sums (online softmax), then all of them accumulate V together.
  // All scores before any softmax: the heads' softmax chains (maximum, exponentials, sums)
  // are then next to each other and overlap (bfloat16 prompt attention 1.09x, Zen 5).
  // One KV head's K and V rows of a tile (32 KiB for 128 keys of 64 bfloat16) stay in L1
  // for its query heads.
  const int64_t rows = kInLanes ? query_rows : 1;  // 1 known to the compiler otherwise
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t num_heads = kv_heads * group;
  // Both bfloat16 with kD a multiple of 32: vdpbf16ps over the query as given, where the CPU
  // has it (the query's bits are the model's; scaling the score after is exact for D = 64);
  // else the query widened and scaled, qf.
#ifdef __AVX512BF16__
  constexpr bool kDotBf16 = std::is_same_v<scalar_t, c10::BFloat16> &&
                            std::is_same_v<cache_t, c10::BFloat16> && kD > 0 && kD % 32 == 0;
#else
  constexpr bool kDotBf16 = false;
#endif
  const int64_t row_heads = rows * num_heads;  // state per (row, head), row-major
  std::vector<float> qf(kDotBf16 ? 0 : num_heads * D), acc(row_heads * D, 0.f);
  std::vector<float> m(row_heads, -INFINITY), l(row_heads, 0.f);
  std::vector<float> scores(rows * group * kMaxTileKeys);  // [rows, group, tile], a KV head
  std::vector<uint16_t> p_bf16(kDotBf16 ? group * kMaxTileKeys : 0);  // P for P.V, bfloat16
  const cache_t* krows[kMaxTileKeys];
  const cache_t* vrows[kMaxTileKeys];
  if constexpr (!kDotBf16)
    for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  static_assert(!kInLanes || (kDotBf16 && !kAmx));
#ifdef __AVX512BF16__
  constexpr int kPairs = kD / 2;
  uint32_t kt[kInLanes ? kMaxTileKeys * kPairs : 1];  // [kMaxTileKeys / 16][kPairs][16]
#endif
#if defined(PAGEDSERVE_AMX)
  static_assert(!kAmx || (kDotBf16 && kD > 0));
  constexpr int kSteps = kD / 32;
  const int64_t pairs_per_kv_head = kSteps * kRows * group;
  std::vector<uint32_t> q_pairs(kAmx ? kv_heads * pairs_per_kv_head : 0);
  float sums[kAmx ? kMaxTileKeys * kRows : 1];  // [keys][group] (group <= kRows)
  c10::BFloat16 k_copy[kAmx ? kRows * kD : 1];  // not zeroed: see score_keys_amx
  if constexpr (kAmx)
    for (int64_t g = 0; g < kv_heads; ++g)
      build_q_pairs<kSteps>(q + g * group * D, group, q_pairs.data() + g * pairs_per_kv_head);
#else
  static_assert(!kAmx);
#endif

  const cache_t* k_base = keys.k_base;
  const cache_t* v_base = keys.v_base;
  const int64_t lo = keys.lo, last = keys.hi + rows - 1;  // the last row's end
#if defined(PAGEDSERVE_AMX)
  [[maybe_unused]] const bool in_place = block_size % kRows == 0 && lo % kRows == 0;
#endif
  const int64_t tile = tile_keys(D * int64_t{sizeof(cache_t)});
  for (int64_t start = lo; start < last; start += tile) {
    const int64_t span = std::min(tile, last - start);  // the last row's keys here
    tile_rows(k_base, v_base, keys.table, start, span, block_size, token_stride, krows, vrows);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t offset = g * D;
#ifdef __AVX512BF16__
      if constexpr (kInLanes) {
        for (int64_t j = 0; j < span; j += 16)
          transpose_keys<kPairs>(krows + j, offset, std::min<int64_t>(16, span - j),
                                 kt + j * kPairs);
        score_tile_in_lanes<kPairs>(q + g * group * D, rows, row_stride, group, tile,
                                    keys.hi - start, kt, scale, scores.data(), prefetch);
      }
#endif
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = std::min(tile, keys.hi + r - start);  // row r's keys here
        if (n <= 0) continue;
        const scalar_t* q_r = q + r * row_stride;
#if defined(PAGEDSERVE_AMX)
        if constexpr (kAmx)
          score_keys_amx<kSteps>(q_pairs.data() + g * pairs_per_kv_head, krows, offset, n,
                                 token_stride, in_place, group, scale, scores.data(), k_copy,
                                 sums, prefetch);
#endif
        for (int64_t i = 0; i < group; ++i) {
          const int64_t h = g * group + i;
          float* scores_h = scores.data() + (r * group + i) * kMaxTileKeys;
#ifdef __AVX512BF16__
          if constexpr (kDotBf16 && !kAmx && !kInLanes)
            dot_keys_bf16<kD / 32>(q_r + h * D, krows, offset, n, scale, scores_h, prefetch);
#endif
          if constexpr (!kDotBf16 && kD > 0)
            dot_keys<kD / kLanes>(qf.data() + h * D, krows, offset, n, scores_h, prefetch);
          else if constexpr (!kDotBf16)
            dot_keys_any(qf.data() + h * D, krows, offset, n, D, scores_h, prefetch);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = std::min(tile, keys.hi + r - start);
        if (n <= 0) continue;
        float* scores_r = scores.data() + r * group * kMaxTileKeys;
        float* acc_r = acc.data() + r * num_heads * D;
        for (int64_t i = 0; i < group; ++i) {
          const int64_t h = g * group + i;
          float* scores_h = scores_r + i * kMaxTileKeys;
          const float correction = softmax_tile(scores_h, n, m[r * num_heads + h],
                                                l[r * num_heads + h]);
          if (correction != 1.f)
            for (int64_t d = 0; d < D; ++d) acc_r[h * D + d] *= correction;
          if constexpr (kD == 0)
            accumulate_v_any(acc_r + h * D, scores_h, vrows, offset, n, D, prefetch, i == 0);
        }
#ifdef __AVX512BF16__
        if constexpr (kDotBf16)
          accumulate_v_bf16_group<kD / 32>(acc_r + g * group * D, scores_r, vrows, offset, n,
                                           group, p_bf16.data(), prefetch);
#endif
        if constexpr (kD > 0 && !kDotBf16)
          accumulate_v_group<kD / kLanes>(acc_r + g * group * D, scores_r, vrows, offset, n,
                                          group, prefetch);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < num_heads; ++h) {
      const float inv = 1.f / l[r * num_heads + h];
      const float* acc_h = acc.data() + (r * num_heads + h) * D;
      for (int64_t d = 0; d < D; ++d)
        out[r * row_stride + h * D + d] =
            static_cast<scalar_t>(acc_h[kDotBf16 ? stored_dim(d) : d] * inv);
    }
}

}  // namespace

void paged_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor out,
                     double scale, int64_t window) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous(),
              "paged_attention: query, kv_cache and out must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "paged_attention: index tensors must be int64");
  const int64_t num_heads = query.size(1), D = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / kv_heads;
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t num_tokens = query.size(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();

  // token -> its sequence
  std::vector<int64_t> token_seq(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) token_seq[t] = s;

  // Work items: query rows, or (row, KV heads) parts when there are fewer rows than
  // threads (a lone decode), so that all threads work.
  const int64_t parts = num_tokens < at::get_num_threads() ? kv_heads : 1;
  const int64_t part_heads = kv_heads / parts, items = num_tokens * parts;
  // Keys [lo, hi) of query row t.
  auto key_range = [&](int64_t t) {
    const int64_t s = token_seq[t];
    const int64_t hi = lens[s] - (starts[s + 1] - t) + 1;
    return std::pair<int64_t, int64_t>{window > 0 ? std::max<int64_t>(0, hi - window) : 0, hi};
  };
  // One call per (query, cache) dtype pair: the cache holds the query's dtype, or bfloat16.
  auto run = [&](auto* q, auto* k_base, auto* o) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    using cache_t = std::remove_const_t<std::remove_pointer_t<decltype(k_base)>>;
    const cache_t* v_base = k_base + kv_cache.stride(0);
    auto attend = D == 64    ? attend_rows<scalar_t, cache_t, 64, false>
                  : D == 128 ? attend_rows<scalar_t, cache_t, 128, false>
                             : attend_rows<scalar_t, cache_t, 0, false>;
    bool amx = false;  // scores on AMX tiles: bfloat16 query and cache, D 64 or 128
#if defined(PAGEDSERVE_AMX)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> &&
                  std::is_same_v<cache_t, c10::BFloat16>) {
      amx = (D == 64 || D == 128) && group <= kRows && pagedserve_amx::tiles_permitted();
      if (amx)
        attend = D == 64 ? attend_rows<scalar_t, cache_t, 64, true>
                         : attend_rows<scalar_t, cache_t, 128, true>;
    }
#endif
    // Up to kMaxRows consecutive rows of a sequence in one call, where bfloat16 and
    // vdpbf16ps meet, without a window: their scores with the keys in lanes (attend_rows).
    int64_t max_rows = 1;
    auto attend_many = attend;
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> &&
                  std::is_same_v<cache_t, c10::BFloat16>)
      if ((D == 64 || D == 128) && !amx && parts == 1 && window == 0) {
        max_rows = kMaxRows;
        attend_many = D == 64 ? attend_rows<scalar_t, cache_t, 64, false, true>
                              : attend_rows<scalar_t, cache_t, 128, false, true>;
      }
#endif
    // Calls of attend: up to max_rows consecutive rows of a sequence, else one item each;
    // call c takes items [call_first[c], call_first[c + 1]).
    std::vector<int64_t> call_first{0};
    for (int64_t item = 0; item < items;) {
      int64_t rows = 1;
      while (rows < max_rows && item + rows < items &&
             token_seq[item + rows] == token_seq[item])
        ++rows;
      call_first.push_back(item += rows);
    }
    const int64_t calls = static_cast<int64_t>(call_first.size()) - 1;
    // Threads start with runs of calls of equal cost (keys, plus a fixed cost per item),
    // not equal counts: a decode batch's contexts differ several-fold, and equal counts left
    // one thread waiting for the other ~10% of the time. Then they share out the last calls
    // (work_sharing.h): one core often runs slower than the other for a while on a shared
    // host.
    constexpr int64_t kItemCost = 32;
    std::vector<int64_t> cost(calls + 1, 0);  // cost of calls [0, c)
    for (int64_t c = 0; c < calls; ++c) {
      cost[c + 1] = cost[c];
      for (int64_t item = call_first[c]; item < call_first[c + 1]; ++item) {
        const auto [lo, hi] = key_range(item / parts);
        cost[c + 1] += hi - lo + kItemCost;
      }
    }
    const int64_t threads = pagedserve_sharing::sharing_threads(calls);
    std::vector<int64_t> first(threads + 1, calls);  // thread t's calls: [first[t], first[t + 1])
    for (int64_t t = 0; t < threads; ++t)
      first[t] = std::lower_bound(cost.begin(), cost.end() - 1, cost[calls] * t / threads) -
                 cost.begin();
    const pagedserve_sharing::Shares shares(first);

    // The keys of calls [c0, c1)'s items, the first one's cold.
    auto keys_of = [&](int64_t c0, int64_t c1) {
      std::vector<Keys<cache_t>> keys;
      for (int64_t item = call_first[c0]; item < call_first[c1]; ++item) {
        const int64_t t = item / parts, g = item % parts * part_heads;
        const auto [lo, hi] = key_range(t);
        const bool cold = t == starts[token_seq[t]] || item == call_first[c0];
        keys.push_back({k_base + g * D, v_base + g * D, tables + token_seq[t] * max_blocks, lo,
                        hi, cold});
      }
      return keys;
    };
    const int64_t lines = (part_heads * D * int64_t{sizeof(cache_t)} + 63) / 64;
    auto stream_of = [&](const std::vector<Keys<cache_t>>& keys) {
      return KeyStream<cache_t>(keys.data(), static_cast<int64_t>(keys.size()), block_size,
                                kv_heads * D, lines, part_heads * (group + 1),
                                tile_keys(D * int64_t{sizeof(cache_t)}));
    };
    auto attend_call = [&](int64_t c, const Keys<cache_t>& keys, KeyStream<cache_t>& prefetch) {
      const int64_t item = call_first[c], rows = call_first[c + 1] - item;
      const int64_t head = item / parts * num_heads + item % parts * part_heads * group;
      (rows > 1 ? attend_many : attend)(q + head * D, rows, num_heads * D, keys, prefetch,
                                        block_size, kv_heads * D, part_heads, group, D,
                                        static_cast<float>(scale), o + head * D);
    };
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
#if defined(PAGEDSERVE_AMX)
        if (amx) configure_score_tiles(group);
#endif
        // The thread's own calls read their keys from one stream, in order; a call taken
        // from another thread's share from a stream of its own.
        const auto own = keys_of(first[t], first[t + 1]);
        auto prefetch = stream_of(own);
        shares.take(t, 1, [&](int64_t c, int64_t, int64_t) {
          if (c >= first[t] && c < first[t + 1]) {
            attend_call(c, own[call_first[c] - call_first[first[t]]], prefetch);
            return;
          }
          const auto taken = keys_of(c, c + 1);
          auto stream = stream_of(taken);
          attend_call(c, taken[0], stream);
        });
#if defined(PAGEDSERVE_AMX)
        if (amx) _tile_release();
#endif
      }
    });
  };
  const bool same = kv_cache.scalar_type() == query.scalar_type();
  TORCH_CHECK(same || kv_cache.scalar_type() == at::kBFloat16,
              "paged_attention: the KV cache must have the query's dtype or bfloat16");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    if (same)
      run(q, kv_cache.data_ptr<scalar_t>(), o);
    else
      run(q, kv_cache.data_ptr<c10::BFloat16>(), o);
  });
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_attention", &paged_attention);
}
