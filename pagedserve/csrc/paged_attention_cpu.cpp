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
// Softmax is computed online over key tiles of one block (Milakov & Gimelshein 2018,
// "Online normalizer calculation for softmax"): each tile's scores are computed for all
// query heads of the group, the running max and sum are rescaled once per tile, then V is
// accumulated.
// All arithmetic is float32 whatever the storage dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void attend_row(const scalar_t* q,  // [kv_heads * group, D] one query row, these heads
                const scalar_t* k_base, const scalar_t* v_base,  // at the first KV head
                const int64_t* table, int64_t lo, int64_t hi,  // keys [lo, hi)
                int64_t block_size, int64_t token_stride, int64_t kv_heads, int64_t group,
                int64_t D, float scale, scalar_t* out) {
  // A tile's K and V rows (these KV heads of a token, contiguous) are read once, in order,
  // and each KV head serves the `group` query heads that share it (GQA).
  const int64_t num_heads = kv_heads * group, row_size = kv_heads * D;
  std::vector<float> qf(num_heads * D), acc(num_heads * D, 0.f);
  std::vector<float> m(num_heads, -INFINITY), l(num_heads, 0.f);
  std::vector<float> scores(num_heads * block_size), row(row_size);
  for (int64_t i = 0; i < num_heads * D; ++i) qf[i] = to_float(q[i]) * scale;

  for (int64_t tile = lo - lo % block_size; tile < hi; tile += block_size) {
    const int64_t block = table[tile / block_size];
    const int64_t start = std::max(tile, lo), end = std::min(tile + block_size, hi);
    const int64_t n = end - start;
    const scalar_t* k_blk = k_base + (block * block_size + start - tile) * token_stride;
    const scalar_t* v_blk = v_base + (block * block_size + start - tile) * token_stride;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < row_size; ++c) row[c] = to_float(k_blk[j * token_stride + c]);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* qh = qf.data() + h * D;
        const float* kh = row.data() + (h / group) * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
        scores[h * block_size + j] = dot;
      }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* p = scores.data() + h * block_size;
      const float new_max = std::max(m[h], *std::max_element(p, p + n));
      const float correction = std::exp(m[h] - new_max);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - new_max);
        sum += p[j];
      }
      l[h] = l[h] * correction + sum;
      m[h] = new_max;
      if (correction != 1.f) {
        float* acc_h = acc.data() + h * D;
        for (int64_t d = 0; d < D; ++d) acc_h[d] *= correction;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < row_size; ++c) row[c] = to_float(v_blk[j * token_stride + c]);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float p = scores[h * block_size + j];
        const float* vh = row.data() + (h / group) * D;
        float* acc_h = acc.data() + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc_h[d] += p * vh[d];
      }
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
        attend_row<scalar_t>(q + head * D, k_base + g * D, v_base + g * D,
                             tables + s * max_blocks, lo, pos + 1, block_size, kv_heads * D,
                             part_heads, group, D, static_cast<float>(scale), o + head * D);
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_attention", &paged_attention);
}
