// The LoRA term of a step's rows, every adapter in one call (torch.ops.pagedserve.lora_add):
//   out[t, :] += (x[t, :] @ A[s]^T) @ Bt[s]      s = slots[t]; nothing where s < 0
// the CPU's counterpart of Punica's BGMV (Chen et al., "Punica: Multi-Tenant LoRA
// Serving", 2023): rows of different adapters in one pass, no per-adapter products.
//
// Layout (pagedserve/lora/layers.py, LoRAStack): A [S, shards * R, K] and Bt [S, R, N]
// float32, R the slots' width (max_lora_rank); a fused projection (q/k/v, gate/up) has one
// A per shard, and column n of shard i reads only rows [i * R, i * R + rank) of the
// shrunk row. ranks [S]: the rank in use per slot (the loops stop there, so a rank-8
// adapter in a rank-64 slot costs rank 8). shard_cols [shards + 1]: column boundaries.
//
// Batch invariance: each shrunk value is one dot product over K and each output element one
// chain over r, in an order fixed by the code alone (not by T or the thread count), so a
// row gets the same bits alone as in any step. The term is added in float32 and rounded
// once into out's dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace {

// Dot product of K floats in a fixed order: 16 running partial sums, then their sum.
inline float dot(const float* x, const float* a, int64_t K) {
  float acc[16] = {0};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[k + l] * a[k + l];
  float tail = 0;
  for (; k < K; ++k) tail += x[k] * a[k];
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += acc[l];
  return sum + tail;
}

template <typename T>
void add_rows(torch::Tensor& out, const std::vector<float>& delta, const int64_t* slots,
              int64_t rows, int64_t N) {
  T* o = out.data_ptr<T>();
  const int64_t stride = out.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const float* d = delta.data() + t * N;
      T* row = o + t * stride;
      for (int64_t n = 0; n < N; ++n) row[n] = static_cast<T>(static_cast<float>(row[n]) + d[n]);
    }
  });
}

}  // namespace

// out [T, N] (float32 or bfloat16, rows may be strided), x [T, K] (same dtype), slots [T]
// int64; then A, Bt, ranks, shard_cols as above. Raises (RuntimeError) on mismatched shapes.
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor slots, torch::Tensor A,
              torch::Tensor Bt, torch::Tensor ranks, torch::Tensor shard_cols) {
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == T && slots.numel() == T, "lora_add: rows of out, x, slots differ");
  TORCH_CHECK(A.scalar_type() == at::kFloat && Bt.scalar_type() == at::kFloat &&
                  A.is_contiguous() && Bt.is_contiguous() && A.size(2) == K &&
                  Bt.size(2) == N && A.size(0) == Bt.size(0),
              "lora_add: A [S, shards*R, K] and Bt [S, R, N] float32 expected");
  TORCH_CHECK(out.stride(1) == 1, "lora_add: out's rows must be contiguous");
  const int64_t R = Bt.size(1), shards = shard_cols.numel() - 1, width = shards * R;
  TORCH_CHECK(A.size(1) == width, "lora_add: A has ", A.size(1), " rows, expected ", width);
  const auto xf = x.to(at::kFloat).contiguous();
  const auto slot_idx = slots.to(at::kLong).contiguous();
  const auto rank_of = ranks.to(at::kLong).contiguous();
  const auto cols_t = shard_cols.to(at::kLong).contiguous();
  const int64_t* s = slot_idx.data_ptr<int64_t>();
  const int64_t* rk = rank_of.data_ptr<int64_t>();
  const int64_t* cols = cols_t.data_ptr<int64_t>();
  const float* xp = xf.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* bp = Bt.data_ptr<float>();

  // Shrink: h[t, i * R + r] = x[t] . A[s, i * R + r], for r below the slot's rank.
  std::vector<float> h(T * width, 0.0f);
  at::parallel_for(0, T * width, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t t = j / width, r = (j % width) % R;
      if (s[t] < 0 || r >= rk[s[t]]) continue;
      h[j] = dot(xp + t * K, ap + (s[t] * width + j % width) * K, K);
    }
  });
  // Expand: delta[t, n] = sum over r of h[t, shard(n) * R + r] * Bt[s, r, n], r in order.
  std::vector<float> delta(T * N, 0.0f);
  constexpr int64_t kCols = 64;
  const int64_t col_blocks = (N + kCols - 1) / kCols;
  at::parallel_for(0, T * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t t = j / col_blocks;
      if (s[t] < 0) continue;
      const int64_t n0 = (j % col_blocks) * kCols, n1 = std::min(N, n0 + kCols);
      float* d = delta.data() + t * N;
      for (int64_t i = 0; i < shards; ++i) {
        const int64_t lo = std::max(n0, cols[i]), hi = std::min(n1, cols[i + 1]);
        for (int64_t r = 0; r < rk[s[t]]; ++r) {
          const float hv = h[t * width + i * R + r];
          const float* b = bp + (s[t] * R + r) * N;
          for (int64_t n = lo; n < hi; ++n) d[n] += hv * b[n];
        }
      }
    }
  });
  if (out.scalar_type() == at::kFloat)
    add_rows<float>(out, delta, s, T, N);
  else if (out.scalar_type() == at::kBFloat16)
    add_rows<c10::BFloat16>(out, delta, s, T, N);
  else
    TORCH_CHECK(false, "lora_add: out must be float32 or bfloat16");
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("lora_add", &lora_add);
}
