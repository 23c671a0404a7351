// Applying a structured-output token bitmask to float32 logits, in place:
//
//   apply_token_bitmask_(logits [B, V], bitmask [Bc, W] int32, rows [Bc] int64)
//     logits[rows[i], t] = -inf for every t < V whose bit (bit t % 32 of word t / 32 of
//     bitmask[i], xgrammar's layout) is 0
//
// xgrammar's own CPU kernel writes the disallowed tokens one at a time: ~15 ms for 64 rows
// of a 49,152-token vocabulary when a grammar allows only a few tokens (most steps of a
// JSON schema outside its strings), against ~0.4 ms when it allows almost all. This one
// is branch-free within a word (the compiler vectorizes it) and spreads rows over threads,
// so it costs the same ~1 pass over the rows whatever the grammar allows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <limits>

namespace {

// A 49,152-token row is ~200 KB of logits: a few rows are worth a thread.
constexpr int64_t kRowsPerTask = 4;

void apply_row(float* logits, const int32_t* words, int64_t V) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = V / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;  // all 32 allowed
    float* out = logits + w * 32;
#pragma omp simd
    for (int b = 0; b < 32; ++b) out[b] = ((word >> b) & 1u) ? out[b] : kNegInf;
  }
  for (int64_t t = full_words * 32; t < V; ++t)  // the last, partial word
    if (!((static_cast<uint32_t>(words[t / 32]) >> (t % 32)) & 1u)) logits[t] = kNegInf;
}

}  // namespace

void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be float32 [B, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask must be contiguous int32 [Bc, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "apply_token_bitmask_: rows must be int64 [Bc], one per bitmask row");
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1);
  TORCH_CHECK(W * 32 >= V, "apply_token_bitmask_: bitmask covers ", W * 32,
              " tokens; logits have ", V);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < B, "apply_token_bitmask_: row ", row_ids[i],
                " outside [0, ", B, ")");
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, rows.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      apply_row(base + row_ids[i] * logits.stride(0), words + i * W, V);
  });
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("apply_token_bitmask_", &apply_token_bitmask_);
}
