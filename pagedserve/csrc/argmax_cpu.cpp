// Row-wise argmax for CPU (torch.ops.pagedserve.row_argmax), greedy sampling's pick and the
// exponential race's winner: out[b] = the first v at which x[b, v] is maximal, as
// torch.argmax and torch.max(dim=-1).indices give it (a NaN counts as the maximum: the
// first NaN's index).
//
// Why not torch.max(dim=-1): it carries an index beside every comparison. In a decode step
// of the shared workload (40 rows of 49,152 float32 logits, just written by the LM head)
// it took 1.46 ms, 4% of the step. Two passes over a row that stays in L2 (196 KiB) do the
// same in vectors: the maximum (exact in any order, so the bits do not depend on the
// threads or the row count), then the first index equal to it.
//
// bfloat16 and float16 rows are widened as they are read (exactly), so a greedy batch
// takes the LM head's own logits: the same index as their float32 copy, without writing
// that copy (64 rows of 49,152: 12.6 MB a decode step).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

using pagedserve_vec::kLanes;
using pagedserve_vec::loadv;
using pagedserve_vec::vf;
using pagedserve_vec::vi;

// From the bits: the build's -ffast-math lets the compiler assume no NaN.
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// Bit i set where lane i of `lanes` (all ones or zero) is set.
inline uint32_t lane_bits(vi lanes) {
#if defined(__AVX512F__)
  const __m512i v = reinterpret_cast<__m512i>(lanes);
  return _mm512_test_epi32_mask(v, v);
#elif defined(__AVX__)
  return static_cast<uint32_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(lanes)));
#else
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= static_cast<uint32_t>(lanes[i] != 0) << i;
  return bits;
#endif
}

// The first index of a NaN in x [V], or -1.
template <typename T>
int64_t first_nan(const T* x, int64_t V) {
  for (int64_t v = 0; v < V; ++v)
    if (is_nan(static_cast<float>(x[v]))) return v;
  return -1;
}

template <typename T>
int64_t row_argmax_one(const T* x, int64_t V) {
  const int64_t body = V / kLanes * kLanes;
  float m = static_cast<float>(x[0]);
  if (body > 0) {
    vf mv = loadv(x);
    vi nan = {};
    for (int64_t v = 0; v < body; v += kLanes) {
      const vf xv = loadv(x + v);
      nan |= (reinterpret_cast<vi>(xv) & 0x7FFFFFFF) > 0x7F800000;
      mv = xv > mv ? xv : mv;
    }
    if (lane_bits(nan)) return first_nan(x, V);
    for (int i = 0; i < kLanes; ++i) m = mv[i] > m ? mv[i] : m;
  }
  for (int64_t v = body; v < V; ++v) {
    const float xv = static_cast<float>(x[v]);
    if (is_nan(xv)) return first_nan(x, V);
    if (xv > m) m = xv;
  }
  for (int64_t v = 0; v < body; v += kLanes) {
    const uint32_t hit = lane_bits(loadv(x + v) == m);
    if (hit) return v + __builtin_ctz(hit);
  }
  for (int64_t v = body; v < V; ++v)
    if (static_cast<float>(x[v]) == m) return v;
  return 0;  // not reached: m is one of the row's values
}

template <typename T>
void argmax_rows(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  const T* in = x.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = row_argmax_one(in + b * stride, V);
  });
}

}  // namespace

// x [B, V] float32, bfloat16 or float16 (rows contiguous, V > 0) -> [B] int64. Raises
// (RuntimeError) on another dtype or shape.
torch::Tensor row_argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "row_argmax: x must be [B, V > 0] with contiguous rows");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat: argmax_rows<float>(x, out); break;
    case at::kBFloat16: argmax_rows<c10::BFloat16>(x, out); break;
    case at::kHalf: argmax_rows<c10::Half>(x, out); break;
    default: TORCH_CHECK(false, "row_argmax: x must be float32, bfloat16 or float16");
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("row_argmax", &row_argmax);
}
