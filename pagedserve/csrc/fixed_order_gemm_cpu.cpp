// Batch-invariant float GEMM for CPU (torch.ops.pagedserve.fixed_order_linear):
//   out[M, N] = x[M, K] @ W^T,  W [N, K] float32 or bfloat16, x float32 or bfloat16.
//
// Every output element out[m, n] is ONE chain of fused multiply-adds in float32,
//   acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], W[n, k], acc)
// whatever M is, wherever row m sits in the step, however many threads run: the order of
// the sum is fixed by construction, so a row computes the same bits alone as in a batch of
// any size (the property vLLM's and SGLang's batch-invariant GPU kernels provide; Thinking
// Machines, "Defeating Nondeterminism in LLM Inference", 2025). Library GEMMs (MKL, oneDNN)
// promise no such thing: they pick kernels, K-splits and summation orders by shape.
//
// How it stays fast (the structure of Goto & van de Geijn, "Anatomy of High-Performance
// Matrix Multiplication", 2008, and BLIS): W is packed once at load into panels of kPanel
// output columns, [ceil(N / kPanel)][K][kPanel] (zero columns pad the last panel), so a
// panel's k-th step is one contiguous kPanel-wide load. A micro-kernel keeps kRows x kPanel
// accumulators in registers and, per k, broadcasts one x value per row against the panel's
// two vectors. K is cut into runs whose share of a panel (depth x kPanel weights) fits in
// L1, and a panel's run is reused by every kRows rows of a chunk of x's rows; between runs
// the accumulators go to a float32 buffer and come back, which continues the same chain (a
// float32 store and load are exact); gemm_blocking.h has the loops. Threads split the
// output (the panels, and a boundary panel's rows): no thread ever shares an output
// element, so there is no split-K and no reduction across threads.
//
// bfloat16 is the top half of a float32: its weights and rows convert exactly (a widen and
// a shift), the sums stay float32, and a bfloat16 result is rounded once at the end.
//
// Pairs (CPUs with AVX512-BF16, bfloat16 rows and weights): vdpbf16ps adds two bfloat16
// products to a float32 lane in one instruction, twice the products of an FMA. The weight
// is packed [ceil(N / 64)][ceil(K / 2)][64][2] (a k-pair of one column is one 32-bit lane)
// and every output is ONE chain over the k-pairs in order,
//   acc = 0;  for j = 0 .. ceil(K/2)-1:  acc = dpbf16(acc, x[m, 2j:2j+2], W[n, 2j:2j+2])
// (Intel SDM, VDPBF16PS: denormal inputs read as zero, each addition rounded to nearest
// even), so the same argument makes it batch-invariant. Its bits differ from the FMA
// chain's; which of the two a weight uses is chosen once per CPU (kernel_choice.py).
//
// Tiles (CPUs with AMX): the pair layout is already AMX's B tiles (amx_tiles.h), and
// TDPBF16PS runs each output as one chain over k-steps of 16 pairs in order (in a tile
// register, and between runs of steps in memory, exactly); its bits differ from vdpbf16ps's (another order of
// the products inside a step), so it is a third layout, chosen as the other two.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "cpu_vec.h"
#include "gemm_blocking.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
struct Vec {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline V broadcast(float a) { return _mm512_set1_ps(a); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline V broadcast(float a) { return _mm256_set1_ps(a); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#else  // portable: the same chains, one lane at a time (std::fma rounds once, like FMA)
struct Vec {
  static constexpr int64_t kLanes = 8;
  struct V {
    float v[kLanes];
  };
  static inline V zero() { return V{}; }
  static inline V load(const float* p) {
    V r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static inline V load(const c10::BFloat16* p) {
    V r;
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static inline V broadcast(float a) {
    V r;
    for (int64_t i = 0; i < kLanes; ++i) r.v[i] = a;
    return r;
  }
  static inline V fma(V a, V b, V c) {
    for (int64_t i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static inline void store(float* p, V v) { std::memcpy(p, v.v, sizeof(v.v)); }
};
#endif

constexpr int64_t kPanel = 2 * Vec::kLanes;  // output columns per panel: two vectors
constexpr int kRows = 6;                     // rows of x per micro-kernel call

// c[r, 0:kPanel] (ldc apart) for r < R continued over `depth` steps of k: x (ldx apart)
// against one panel's run w [depth][kPanel]; `first` starts the chains at zero.
template <int R, typename W>
inline void micro_kernel(const float* x, int64_t ldx, const W* w, int64_t depth, float* c,
                         int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  Vec::V acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = first ? Vec::zero() : Vec::load(c + r * ldc);
    acc[r][1] = first ? Vec::zero() : Vec::load(c + r * ldc + Vec::kLanes);
  }
  for (int64_t k = 0; k < depth; ++k) {
    const Vec::V w0 = Vec::load(w + k * kPanel), w1 = Vec::load(w + k * kPanel + Vec::kLanes);
    pagedserve_gemm::prefetch_step(pf, k, depth);
    for (int r = 0; r < R; ++r) {
      const Vec::V a = Vec::broadcast(x[r * ldx + k]);
      acc[r][0] = Vec::fma(a, w0, acc[r][0]);
      acc[r][1] = Vec::fma(a, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec::store(c + r * ldc, acc[r][0]);
    Vec::store(c + r * ldc + Vec::kLanes, acc[r][1]);
  }
}

template <typename W>
void micro_kernel_rows(int rows, const float* x, int64_t ldx, const W* w, int64_t depth,
                       float* c, int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  switch (rows) {
    case 1: micro_kernel<1>(x, ldx, w, depth, c, ldc, first, pf); break;
    case 2: micro_kernel<2>(x, ldx, w, depth, c, ldc, first, pf); break;
    case 3: micro_kernel<3>(x, ldx, w, depth, c, ldc, first, pf); break;
    case 4: micro_kernel<4>(x, ldx, w, depth, c, ldc, first, pf); break;
    case 5: micro_kernel<5>(x, ldx, w, depth, c, ldc, first, pf); break;
    default: micro_kernel<kRows>(x, ldx, w, depth, c, ldc, first, pf); break;
  }
}


// A flush for for_each_tile: out [M, N] <- the chunk's sums, in out's dtype (float32 as is,
// bfloat16 rounded to nearest even as c10::BFloat16 rounds).
template <typename Out>
auto write_to(Out* out, int64_t N) {
  return [=](const float* c, int64_t ldc, int64_t m, int64_t rows, int64_t col0,
             int64_t col1) {
    using pagedserve_vec::kLanes;
    const int64_t width = std::min(N, col1) - col0;
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = c + r * ldc;
      Out* dst = out + (m + r) * N + col0;
      int64_t j = 0;
      for (; j + kLanes <= width; j += kLanes)
        pagedserve_vec::storev(dst + j, pagedserve_vec::loadv(src + j));
      for (; j < width; ++j) dst[j] = static_cast<Out>(src[j]);
    }
  };
}

// out [M, N] = x [M, K] @ the packed panels (N <= panels * kPanel).
template <typename W, typename Out>
void gemm(const float* x, int64_t M, int64_t K, const W* packed, int64_t panels, Out* out,
          int64_t N) {
  pagedserve_gemm::for_each_tile<float, kRows, kPanel>(
      M, K, K * int64_t{sizeof(float)}, packed, panels, K * kPanel,
      [&](int rows, int64_t m0, int64_t k0, int64_t depth, const W* w, float* c, int64_t ldc,
          const pagedserve_gemm::Prefetch& pf) {
        micro_kernel_rows(rows, x + m0 * K + k0, K, w, depth, c, ldc, k0 == 0, pf);
      },
      write_to(out, N));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHasPairs = true;
// Wider than the FMA kernel's panels: 6 x 4 accumulators hide vdpbf16ps's latency; a
// panel's run (128 pairs x 64 columns, 32 KiB, with a 48 KiB L1) stays in L1 for all rows.
constexpr int kPairVectors = 4;                      // vectors of 16 columns a panel
constexpr int64_t kPairPanel = 16 * kPairVectors;    // output columns per pair panel
constexpr int kPairRows = 6;                         // rows of x per micro-kernel call

// As micro_kernel, over `depth` k-pairs: x holds bfloat16 pairs (ldx pairs apart), w one
// panel's run [depth][kPairPanel] of pairs.
template <int R>
inline void pair_kernel(const int32_t* x, int64_t ldx, const int32_t* w, int64_t depth,
                        float* c, int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  __m512 acc[R][kPairVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPairVectors; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * v);
  for (int64_t k = 0; k < depth; ++k) {
    __m512bh wv[kPairVectors];
    for (int v = 0; v < kPairVectors; ++v)
      wv[v] = (__m512bh)_mm512_loadu_si512(w + k * kPairPanel + 16 * v);
    pagedserve_gemm::prefetch_step(pf, k, depth);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ldx + k]);
      for (int v = 0; v < kPairVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPairVectors; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

template <int R = kPairRows>
void pair_kernel_rows(int rows, const int32_t* x, int64_t ldx, const int32_t* w, int64_t depth,
                      float* c, int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  if constexpr (R > 1) {
    if (rows < R) return pair_kernel_rows<R - 1>(rows, x, ldx, w, depth, c, ldc, first, pf);
  }
  pair_kernel<R>(x, ldx, w, depth, c, ldc, first, pf);
}

// out [M, N] = x [M, K2 pairs] @ the pair-packed panels; as gemm.
void gemm_pairs(const int32_t* x, int64_t M, int64_t K2, const int32_t* packed, int64_t panels,
                c10::BFloat16* out, int64_t N) {
  pagedserve_gemm::for_each_tile<float, kPairRows, kPairPanel>(
      M, K2, K2 * int64_t{sizeof(int32_t)}, packed, panels, K2 * kPairPanel,
      [&](int rows, int64_t m0, int64_t k0, int64_t depth, const int32_t* w, float* c,
          int64_t ldc, const pagedserve_gemm::Prefetch& pf) {
        pair_kernel_rows(rows, x + m0 * K2 + k0, K2, w, depth, c, ldc, k0 == 0, pf);
      },
      write_to(out, N));
}
#else
constexpr bool kHasPairs = false;
#endif

#if defined(PAGEDSERVE_AMX)
// out [M, N] = x [M, 32 * steps] bfloat16 @ the pair-packed panels, by AMX tiles.
void gemm_amx(const c10::BFloat16* x, int64_t M, int64_t steps, const c10::BFloat16* packed,
              int64_t panels, c10::BFloat16* out, int64_t N) {
  namespace amx = pagedserve_amx;  // (not `using`: this file has a kRows of its own)
  amx::for_each_tile<amx::Product::kBf16Pairs, float>(
      M, steps, reinterpret_cast<const uint8_t*>(x), steps * amx::kStepBytes,
      reinterpret_cast<const uint8_t*>(packed), panels, steps * amx::kRows * amx::kUnitRowBytes,
      write_to(out, N));
}
#endif

void check_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "fixed_order_linear: ", what, " must be float32 or bfloat16, got ",
              t.scalar_type());
}

}  // namespace

// weight [N, K] float32 or bfloat16 -> the same dtype [ceil(N / P), K, P], P = the panel
// width of this build (16 with AVX2, 32 with AVX-512): column j of panel p is row
// p * P + j of weight, zero past N. Raises (RuntimeError) on another dtype or shape.
torch::Tensor pack_linear_weight(torch::Tensor weight) {
  check_float(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// Whether this build has the pair kernel (AVX512-BF16).
bool pair_linear_available() { return kHasPairs; }

// weight [N, K] bfloat16 -> [ceil(N / P), ceil(K / 2), P, 2] bfloat16 for the pair kernel
// (zero past N and K). Raises (RuntimeError) without AVX512-BF16 or on another dtype.
torch::Tensor pack_linear_weight_pairs(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "pack_linear_weight_pairs: weight must be a bfloat16 [N, K]");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPairPanel - 1) / kPairPanel, K2 = (K + 1) / 2;
  auto source = weight.contiguous();
  if (K % 2 == 1) source = at::constant_pad_nd(source, {0, 1});
  const auto* src = reinterpret_cast<const int32_t*>(source.data_ptr<c10::BFloat16>());
  auto packed = torch::empty({panels, K2, kPairPanel, 2}, weight.options());
  if (N % kPairPanel != 0) packed.select(0, panels - 1).zero_();  // columns past N
  pagedserve_gemm::gather_panels<kPairPanel>(
      src, N, K2, K2 * kPairPanel, reinterpret_cast<int32_t*>(packed.data_ptr<c10::BFloat16>()));
  return packed;
#else
  TORCH_CHECK(false, "pack_linear_weight_pairs: this CPU build has no AVX512-BF16");
  return weight;
#endif
}

// Whether this build and process run AMX tiles (amx_tiles.h).
bool amx_tiles_available() {
#if defined(PAGEDSERVE_AMX)
  return pagedserve_amx::tiles_permitted();
#else
  return false;
#endif
}

// weight [N, K] bfloat16, K a multiple of 32 -> the pair layout in k-steps of 16 pairs,
// [ceil(N / 64), K / 32, 16, 64, 2] (one B tile a step and 16 columns). Raises
// (RuntimeError) without AMX, on another dtype or on another K.
torch::Tensor pack_linear_weight_amx(torch::Tensor weight) {
  TORCH_CHECK(amx_tiles_available(), "pack_linear_weight_amx: no AMX tiles here");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % 32 == 0,
              "pack_linear_weight_amx: weight must be [N, K] with K a multiple of 32, got ",
              weight.sizes());
  const auto pairs = pack_linear_weight_pairs(weight);
  return pairs.view({pairs.size(0), pairs.size(1) / 16, 16, pairs.size(2), 2});
}

// x [M, K] bfloat16 @ the weight packed by pack_linear_weight_amx, N its rows -> [M, N]
// bfloat16. Raises (RuntimeError) on another dtype or mismatched shapes.
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
#if defined(PAGEDSERVE_AMX)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "fixed_order_linear: AMX-packed weights take bfloat16 rows, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && packed.size(2) == 16 && packed.size(3) == 64 &&
                  packed.size(4) == 2 && packed.is_contiguous(),
              "fixed_order_linear: x must be [M, K] and packed [panels, K/32, 16, 64, 2]");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), steps = packed.size(1);
  TORCH_CHECK(K == 32 * steps && N > (panels - 1) * 64 && N <= panels * 64,
              "fixed_order_linear: x has K = ", K, " and N = ", N, "; packed is ",
              packed.sizes());
  auto out = torch::empty({M, N}, x.options());
  const auto xc = x.contiguous();
  if (M > 0)
    gemm_amx(xc.data_ptr<c10::BFloat16>(), M, steps, packed.data_ptr<c10::BFloat16>(), panels,
             out.data_ptr<c10::BFloat16>(), N);
  return out;
#else
  TORCH_CHECK(false, "fixed_order_linear: this CPU build has no AMX tiles");
  return x;
#endif
}

// x [M, K] bfloat16 @ the weight packed by pack_linear_weight_pairs, N its rows -> [M, N]
// bfloat16. Raises (RuntimeError) on another dtype or mismatched shapes.
torch::Tensor pair_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "fixed_order_linear: pair-packed weights take bfloat16 rows, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && packed.size(2) == kPairPanel && packed.size(3) == 2 &&
                  packed.is_contiguous(),
              "fixed_order_linear: x must be [M, K] and packed [panels, K/2, ", kPairPanel,
              ", 2]");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == K2 && N > (panels - 1) * kPairPanel && N <= panels * kPairPanel,
              "fixed_order_linear: x has K = ", K, " and N = ", N, "; packed is ",
              packed.sizes());
  auto out = torch::empty({M, N}, x.options());
  // An odd K reads a zero as the last pair's second half.
  const auto xp = K % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1}).contiguous();
  if (M > 0)
    gemm_pairs(reinterpret_cast<const int32_t*>(xp.data_ptr<c10::BFloat16>()), M, K2,
               reinterpret_cast<const int32_t*>(packed.data_ptr<c10::BFloat16>()), panels,
               out.data_ptr<c10::BFloat16>(), N);
  return out;
#else
  TORCH_CHECK(false, "fixed_order_linear: this CPU build has no AVX512-BF16 pair kernel");
  return x;
#endif
}

// x [M, K] float32 or bfloat16 @ the weight packed by pack_linear_weight, N its rows ->
// [M, N] in x's dtype (see the top of the file for the order of every sum). Raises
// (RuntimeError) on another dtype or mismatched shapes. A 4-dimensional packed weight is
// pair-packed (pack_linear_weight_pairs): pair_linear; a 5-dimensional one AMX-packed
// (pack_linear_weight_amx): amx_linear.
torch::Tensor fixed_order_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  if (packed.dim() == 4) return pair_linear(x, packed, N);
  if (packed.dim() == 5) return amx_linear(x, packed, N);
  check_float(x, "x");
  check_float(packed, "packed");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous(),
              "fixed_order_linear: x must be [M, K] and packed [panels, K, ", kPanel, "]");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && N > (panels - 1) * kPanel && N <= panels * kPanel,
              "fixed_order_linear: x has K = ", K, " and N = ", N, "; packed is ",
              packed.sizes());
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  auto run = [&](auto* w) {
    if (x.scalar_type() == at::kFloat)
      gemm(xf.data_ptr<float>(), M, K, w, panels, out.data_ptr<float>(), N);
    else
      gemm(xf.data_ptr<float>(), M, K, w, panels, out.data_ptr<c10::BFloat16>(), N);
  };
  if (packed.scalar_type() == at::kFloat)
    run(packed.data_ptr<float>());
  else
    run(packed.data_ptr<c10::BFloat16>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("pack_linear_weight", &pack_linear_weight);
  m.def("fixed_order_linear", &fixed_order_linear);
  m.def("pack_linear_weight_pairs", &pack_linear_weight_pairs);
  m.def("pair_linear_available", &pair_linear_available);
  m.def("pack_linear_weight_amx", &pack_linear_weight_amx);
  m.def("amx_tiles_available", &amx_tiles_available);
}
