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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

// From the bits: the build's -ffast-math lets the compiler assume no NaN.
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// The first index of a NaN in x [V], or -1.
int64_t first_nan(const float* x, int64_t V) {
  for (int64_t v = 0; v < V; ++v)
    if (is_nan(x[v])) return v;
  return -1;
}

int64_t row_argmax_one(const float* x, int64_t V) {
  int64_t v = 0;
  float m = x[0];
#ifdef __AVX512F__
  constexpr int64_t kLanes = 16;
  const int64_t body = V / kLanes * kLanes;
  if (body > 0) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    __m512 mv = _mm512_loadu_ps(x);
    __mmask16 nan = 0;
    for (; v < body; v += kLanes) {
      const __m512 xv = _mm512_loadu_ps(x + v);
      nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(xv), abs_mask), inf);
      mv = _mm512_max_ps(mv, xv);
    }
    if (nan) return first_nan(x, V);
    m = _mm512_reduce_max_ps(mv);
  }
#endif
  for (int64_t t = v; t < V; ++t) {
    if (is_nan(x[t])) return first_nan(x, V);
    if (x[t] > m) m = x[t];
  }
#ifdef __AVX512F__
  const __m512 target = _mm512_set1_ps(m);
  for (v = 0; v < body; v += kLanes) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + v), target, _CMP_EQ_OQ);
    if (hit) return v + __builtin_ctz(hit);
  }
#else
  v = 0;
#endif
  for (; v < V; ++v)
    if (x[v] == m) return v;
  return 0;  // not reached: m is one of the row's values
}

}  // namespace

// x [B, V] float32 (rows contiguous, V > 0) -> [B] int64. Raises (RuntimeError) on another
// dtype or shape.
torch::Tensor row_argmax(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 &&
                  x.stride(1) == 1,
              "row_argmax: x must be float32 [B, V > 0] with contiguous rows");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  auto out = torch::empty({B}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = row_argmax_one(in + b * stride, V);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("row_argmax", &row_argmax);
}
