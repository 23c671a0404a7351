// Row-wise log-sum-exp for CPU (torch.ops.pagedserve.row_logsumexp), the normalizer of
// log-probabilities: out[b] = log(sum_v exp(x[b, v])) for x [B, V] float32.
//
// Why not torch.logsumexp: PyTorch's reduction changes its summation order with the number
// of rows (on two threads, rows of 49,152 logits gave other bits from 36 rows up), so a
// request's logprobs would depend on what else the step held. Here each row is one
// function of its own values and V alone: its maximum (exact in any order), then the sum of
// exp(x - max) in kLanes fixed partial sums (element v into lane v % kLanes; the last
// V % kLanes elements one by one), added up in a fixed tree. Threads only decide which
// thread runs a row.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kLanes = 16;

// From the bits: the build's -ffast-math lets the compiler assume std::isfinite is true.
inline bool finite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7F800000u) != 0x7F800000u;
}

float row_logsumexp_one(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::max(m, x[v]);
  if (!finite(m)) return m;  // every logit -inf, or one +inf: the max says it
  float lanes[kLanes] = {};
  const int64_t body = V / kLanes * kLanes;
  for (int64_t v = 0; v < body; v += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += std::exp(x[v + j] - m);
  float tail = 0.f;
  for (int64_t v = body; v < V; ++v) tail += std::exp(x[v] - m);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return m + std::log(lanes[0] + tail);
}

}  // namespace

// x [B, V] float32 (rows contiguous) -> [B] float32. Raises (RuntimeError) on another dtype
// or shape.
torch::Tensor row_logsumexp(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "row_logsumexp: x must be float32 [B, V] with contiguous rows");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  auto out = torch::empty({B}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = row_logsumexp_one(in + b * stride, V);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("row_logsumexp", &row_logsumexp);
}
