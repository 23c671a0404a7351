// The LoRA term of a step's rows, every adapter in one call (torch.ops.pagedserve.lora_add):
//   out[t, :] += (x[t, :] @ A[s]^T) @ Bt[s]      s = slots[t]; nothing where s < 0
// the CPU's counterpart of Punica's SGMV (Chen et al., "Punica: Multi-Tenant LoRA
// Serving", 2023): rows of different adapters in one pass, grouped by adapter so that
// each A and Bt row is read once per step, no per-adapter products from Python.
//
// Layout (pagedserve/lora/layers.py, LoRAStack): A [S, shards * R, K] and Bt [S, R, N]
// float32 or bfloat16 (--lora-dtype; widened exactly as read), R the slots' width (max_lora_rank); a fused projection (q/k/v, gate/up) has one
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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Eight floats (a ymm register with AVX2, half a zmm with AVX-512), loaded unaligned.
typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
// Eight bfloat16 as floats: each is the top half of its float32, so widening is exact.
inline v8 load8(const c10::BFloat16* p) {
  uint16_t half[8];
  std::memcpy(half, p, sizeof(half));
  uint32_t bits[8];
  for (int l = 0; l < 8; ++l) bits[l] = static_cast<uint32_t>(half[l]) << 16;
  v8 v;
  std::memcpy(&v, bits, sizeof(v));
  return v;
}

constexpr int64_t kCols = 64;  // output columns of one expand work item

// x . a over K in a fixed order: two 8-wide running sums over k, then their lanes in
// order, then the tail; the same instructions for every row of every batch.
template <typename W>
inline float dot(const float* x, const W* a, int64_t K) {
  v8 acc0 = {}, acc1 = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    acc0 += load8(x + k) * load8(a + k);
    acc1 += load8(x + k + 8) * load8(a + k + 8);
  }
  const v8 acc = acc0 + acc1;
  float sum = 0;
  for (int l = 0; l < 8; ++l) sum += acc[l];
  for (; k < K; ++k) sum += x[k] * static_cast<float>(a[k]);
  return sum;
}

// acc[c] = sum over r < rank, in order, of h[r] * b[r * N + c] for c in [0, n), n <= kCols:
// whole groups of eight columns in registers, the rest one by one.
template <typename W>
inline void expand(const float* h, const W* b, int64_t N, int64_t rank, int64_t n,
                   float* acc) {
  const int64_t groups = n / 8;
  v8 sums[kCols / 8] = {};
  float tail[8] = {};
  for (int64_t r = 0; r < rank; ++r) {
    const W* row = b + r * N;
    const v8 hv = {h[r], h[r], h[r], h[r], h[r], h[r], h[r], h[r]};
    for (int64_t g = 0; g < groups; ++g) sums[g] += hv * load8(row + 8 * g);
    for (int64_t c = groups * 8; c < n; ++c)
      tail[c - groups * 8] += h[r] * static_cast<float>(row[c]);
  }
  for (int64_t g = 0; g < groups; ++g) store8(acc + 8 * g, sums[g]);
  for (int64_t c = groups * 8; c < n; ++c) acc[c] = tail[c - groups * 8];
}

template <typename T>
inline void add_to(T* row, const float* acc, int64_t n) {
  for (int64_t c = 0; c < n; ++c) row[c] = static_cast<T>(static_cast<float>(row[c]) + acc[c]);
}

// A run of rows with one adapter slot (rows[begin, end) of the row order).
struct Segment {
  int64_t slot, begin, end;
};

// The work of lora_add (below) for weights of type W (float or bfloat16).
template <typename W>
void add_terms(torch::Tensor& out, const float* xp, const int64_t* s, const int64_t* rk,
               const int64_t* cols, const W* ap, const W* bp, int64_t T, int64_t K, int64_t N,
               int64_t R, int64_t shards) {
  const int64_t width = shards * R;
  // Rows grouped by slot (stable), so that each A and Bt row is read once per adapter.
  std::vector<int64_t> order;
  for (int64_t t = 0; t < T; ++t)
    if (s[t] >= 0 && rk[s[t]] > 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] < s[b]; });
  std::vector<Segment> segments;
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) {
    if (segments.empty() || s[order[i]] != segments.back().slot)
      segments.push_back({s[order[i]], i, i});
    segments.back().end = i + 1;
  }
  const int64_t num_seg = static_cast<int64_t>(segments.size());
  if (num_seg == 0) return;

  // Shrink: h[i, j] = x[order[i]] . A[slot, j] for j's rank index below the slot's rank.
  std::vector<float> h(order.size() * width, 0.0f);
  at::parallel_for(0, num_seg * width, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Segment& seg = segments[item / width];
      const int64_t j = item % width;
      if (j % R >= rk[seg.slot]) continue;
      const W* a = ap + (seg.slot * width + j) * K;  // read once, from L1 after row one
      for (int64_t i = seg.begin; i < seg.end; ++i) h[i * width + j] = dot(xp + order[i] * K, a, K);
    }
  });
  // Expand: out[t, n] += sum over r (in order) of h[t, shard(n) * R + r] * Bt[slot, r, n].
  const int64_t col_blocks = (N + kCols - 1) / kCols;
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  const int64_t stride = out.stride(0);
  at::parallel_for(0, num_seg * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Segment& seg = segments[item / col_blocks];
      const int64_t n0 = (item % col_blocks) * kCols, n1 = std::min(N, n0 + kCols);
      const int64_t rank = rk[seg.slot];
      for (int64_t i = seg.begin; i < seg.end; ++i) {
        const int64_t t = order[i];
        for (int64_t sh = 0; sh < shards; ++sh) {
          const int64_t lo = std::max(n0, cols[sh]), hi = std::min(n1, cols[sh + 1]);
          if (lo >= hi) continue;
          float acc[kCols];
          expand(h.data() + i * width + sh * R, bp + seg.slot * R * N + lo, N, rank, hi - lo,
                 acc);
          if (bf16)
            add_to(out.data_ptr<c10::BFloat16>() + t * stride + lo, acc, hi - lo);
          else
            add_to(out.data_ptr<float>() + t * stride + lo, acc, hi - lo);
        }
      }
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
  TORCH_CHECK((A.scalar_type() == at::kFloat || A.scalar_type() == at::kBFloat16) &&
                  Bt.scalar_type() == A.scalar_type() && A.is_contiguous() &&
                  Bt.is_contiguous() && A.size(2) == K && Bt.size(2) == N &&
                  A.size(0) == Bt.size(0),
              "lora_add: A [S, shards*R, K] and Bt [S, R, N], both float32 or bfloat16, expected");
  TORCH_CHECK(out.stride(1) == 1, "lora_add: out's rows must be contiguous");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "lora_add: out must be float32 or bfloat16");
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
  if (A.scalar_type() == at::kBFloat16)
    add_terms(out, xp, s, rk, cols, A.data_ptr<c10::BFloat16>(), Bt.data_ptr<c10::BFloat16>(),
              T, K, N, R, shards);
  else
    add_terms(out, xp, s, rk, cols, A.data_ptr<float>(), Bt.data_ptr<float>(), T, K, N, R,
              shards);
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("lora_add", &lora_add);
}
