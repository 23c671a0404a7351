// Paged attention for CPU (torch.ops.pagedserve.paged_attention): reads K/V straight from
// the cache blocks through the block tables (no gathered copy of the context), one work
// item per query row (all heads; per KV head when there are fewer rows than threads),
// spread over threads with at::parallel_for.
//
// Layouts (see pagedserve/attention/backend.py):
//   query       [num_tokens, num_heads, head_dim]
//   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
//   block_tables[num_seqs, max_blocks] int64, seq_lens [num_seqs] int64,
//   query_start_loc [num_seqs + 1] int64
//   out         [num_tokens, num_heads, head_dim]
// Query row i of sequence s sits at position seq_len - q_len + i and sees keys at
// positions p with p <= pos and (window == 0 or p > pos - window).
//
// Softmax is computed online over tiles of 64 keys, across blocks (Milakov & Gimelshein
// 2018, "Online normalizer calculation for softmax"): per tile and query head, the scores
// (eight keys at a time, their horizontal sums sharing shuffles), one rescale of the running
// max and sum, then V. A decode step reads every layer's context from DRAM once, and the
// blocks are scattered over pages the hardware prefetcher does not follow, so the next
// tile's rows are prefetched while this one computes. Head sizes 64 and 128 get
// register-blocked loops; other sizes take plain loops the compiler vectorizes.
// All arithmetic is float32 whatever the storage dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Keys per online-softmax tile (across blocks): the max/exp/rescale work of a tile is
// shared by this many keys.
constexpr int64_t kTileKeys = 64;

// 8 floats: one AVX2 register (the compiler splits or fuses it for other widths).
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline float sum8(v8f x) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += x[i];
  return s;
}

// Offset (elements) of key position `pos`'s row in the cache, through the block table.
inline int64_t key_row(const int64_t* table, int64_t pos, int64_t block_size,
                       int64_t token_stride) {
  return (table[pos / block_size] * block_size + pos % block_size) * token_stride;
}

// Pointers to a tile's K (or V) rows of these KV heads as float32: float storage is read
// in place, other dtypes are converted into `buf` (n rows of `width` floats).
template <typename scalar_t>
void tile_rows(const scalar_t* base, const int64_t* table, int64_t start, int64_t n,
               int64_t block_size, int64_t token_stride, int64_t width, float* buf,
               const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = start + j;
    const scalar_t* src = base + key_row(table, pos, block_size, token_stride);
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[j] = src;
    } else {
      for (int64_t c = 0; c < width; ++c) buf[j * width + c] = static_cast<float>(src[c]);
      rows[j] = buf + j * width;
    }
  }
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

// scores[j] = q . (rows[j] + offset) for a head of D = 8 * kChunks floats, eight keys at a
// time so that their horizontal sums share shuffles.
template <int kChunks>
inline void dot_keys(const float* q, const float* const* rows, int64_t offset, int64_t n,
                     float* scores) {
  v8f qv[kChunks];
  for (int c = 0; c < kChunks; ++c) qv[c] = load8(q + 8 * c);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f acc[8];
    for (int i = 0; i < 8; ++i) {
      const float* k = rows[j + i] + offset;
      acc[i] = qv[0] * load8(k);
      for (int c = 1; c < kChunks; ++c) acc[i] += qv[c] * load8(k + 8 * c);
    }
    const v8f sums = sum8x8(acc);
    std::memcpy(scores + j, &sums, sizeof(sums));
  }
  for (; j < n; ++j) {
    const float* k = rows[j] + offset;
    v8f acc = qv[0] * load8(k);
    for (int c = 1; c < kChunks; ++c) acc += qv[c] * load8(k + 8 * c);
    scores[j] = sum8(acc);
  }
}

// acc[0:D] += sum_j p[j] * (rows[j] + offset)[0:D] for D = 8 * kChunks; the accumulator
// stays in registers across the keys.
template <int kChunks>
inline void accumulate_v(float* acc, const float* p, const float* const* rows, int64_t offset,
                         int64_t n) {
  v8f a[kChunks];
  for (int c = 0; c < kChunks; ++c) a[c] = load8(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = rows[j] + offset;
    const float pj = p[j];
    for (int c = 0; c < kChunks; ++c) a[c] += pj * load8(v + 8 * c);
  }
  for (int c = 0; c < kChunks; ++c) std::memcpy(acc + 8 * c, &a[c], sizeof(v8f));
}

// The same for any D (the compiler vectorizes the loops over it).
inline void dot_keys_any(const float* q, const float* const* rows, int64_t offset, int64_t n,
                         int64_t D, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const float* k = rows[j] + offset;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
    scores[j] = dot;
  }
}

inline void accumulate_v_any(float* acc, const float* p, const float* const* rows,
                             int64_t offset, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j) {
    const float* v = rows[j] + offset;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * v[d];
  }
}

// kD: the head size when it is 64 or 128 (register-blocked loops), else 0 (any size).
template <typename scalar_t, int kD>
void attend_row(const scalar_t* q,  // [kv_heads * group, D] one query row, these heads
                const scalar_t* k_base, const scalar_t* v_base,  // at the first KV head
                const int64_t* table, int64_t lo, int64_t hi,  // keys [lo, hi)
                int64_t block_size, int64_t token_stride, int64_t kv_heads, int64_t group,
                int64_t head_dim, float scale, scalar_t* out) {
  // Per tile and query head: its scores against the tile's keys, the online-softmax
  // rescale, then its V accumulation; the `group` query heads that share a KV head (GQA)
  // read its rows from L1.
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t num_heads = kv_heads * group, width = kv_heads * D;
  std::vector<float> qf(num_heads * D), acc(num_heads * D, 0.f);
  std::vector<float> m(num_heads, -INFINITY), l(num_heads, 0.f);
  std::vector<float> kbuf(std::is_same_v<scalar_t, float> ? 0 : kTileKeys * width);
  std::vector<float> vbuf(kbuf.size());
  float scores[kTileKeys];
  const float* krows[kTileKeys];
  const float* vrows[kTileKeys];
  for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;

  for (int64_t start = lo; start < hi; start += kTileKeys) {
    const int64_t n = std::min(kTileKeys, hi - start);
    tile_rows(k_base, table, start, n, block_size, token_stride, width, kbuf.data(), krows);
    tile_rows(v_base, table, start, n, block_size, token_stride, width, vbuf.data(), vrows);
    // The next tile's rows are on other pages (blocks are scattered), where the hardware
    // prefetcher does not follow: ask for them while this tile computes.
    for (int64_t pos = start + kTileKeys; pos < std::min(start + 2 * kTileKeys, hi); ++pos) {
      const int64_t row = key_row(table, pos, block_size, token_stride);
      for (int64_t c = 0; c < width; c += 64 / static_cast<int64_t>(sizeof(scalar_t))) {
        __builtin_prefetch(k_base + row + c, 0, 1);
        __builtin_prefetch(v_base + row + c, 0, 1);
      }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t offset = h / group * D;
      float* acc_h = acc.data() + h * D;
      if constexpr (kD > 0) dot_keys<kD / 8>(qf.data() + h * D, krows, offset, n, scores);
      else dot_keys_any(qf.data() + h * D, krows, offset, n, D, scores);
      float new_max = m[h];
      for (int64_t j = 0; j < n; ++j) new_max = new_max > scores[j] ? new_max : scores[j];
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = std::exp(scores[j] - new_max);
        sum += scores[j];
      }
      const float correction = std::exp(m[h] - new_max);
      l[h] = l[h] * correction + sum;
      m[h] = new_max;
      if (correction != 1.f)
        for (int64_t d = 0; d < D; ++d) acc_h[d] *= correction;
      if constexpr (kD > 0) accumulate_v<kD / 8>(acc_h, scores, vrows, offset, n);
      else accumulate_v_any(acc_h, scores, vrows, offset, n, D);
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
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

  // token -> its sequence, so work items are flat query rows
  std::vector<int64_t> token_seq(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) token_seq[t] = s;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
    const scalar_t* v_base = k_base + kv_cache.stride(0);
    scalar_t* o = out.data_ptr<scalar_t>();
    // Fewer rows than threads (a lone decode): split each row by KV head so all work.
    const int64_t parts = num_tokens < at::get_num_threads() ? kv_heads : 1;
    const int64_t part_heads = kv_heads / parts;
    at::parallel_for(0, num_tokens * parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / parts, g = item % parts * part_heads, s = token_seq[t];
        const int64_t q_len = starts[s + 1] - starts[s];
        const int64_t pos = lens[s] - q_len + (t - starts[s]);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const int64_t head = t * num_heads + g * group;
        auto attend = D == 64    ? attend_row<scalar_t, 64>
                      : D == 128 ? attend_row<scalar_t, 128>
                                 : attend_row<scalar_t, 0>;
        attend(q + head * D, k_base + g * D, v_base + g * D, tables + s * max_blocks, lo,
               pos + 1, block_size, kv_heads * D, part_heads, group, D,
               static_cast<float>(scale), o + head * D);
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_attention", &paged_attention);
}
