// The int8 W8A8 linear (pagedserve/quantization/int8.py) on CPU: its element-wise halves,
// each one pass over its rows instead of the 4-5 PyTorch ops (and temporaries) of the
// Python code, which they must equal bit for bit (at a decode step those ops cost more in
// dispatch than in arithmetic), and, on CPUs with AVX512-VNNI or AVX2, the product itself.
//
//   quantize_rows_int8(x [R, K]) -> (q int8 [R, K], scale float32 [R, 1])
//       scale = max|x| / 127, q = round_half_even(x * (1 / max(max|x|, FLT_MIN) * 127))
//   int8_scaled_mm_epilogue(acc int32 [M, N], x_scale [M, 1], w_scale [N], bias?, dtype)
//       out = ((float(acc) * x_scale[m]) * w_scale[n] + bias[n]) cast to dtype
//   int8_packed_linear(x, packed, w_scale, bias?, N): the three in one, the int32 product
//       acc = q @ W^T summed by vpdpbusd (AVX2: vpmaddubsw, vpmaddwd) on the weight packed
//       by pack_int8_weight.
//
// The float operations and their order are the Python code's, in float32; fast-math is off
// for those functions (and no fused multiply-add) so the compiler keeps that order. The
// product is an integer sum, exact in any order: the packed product gives torch._int_mm's
// int32 result, hence the same bits, and a row's bits never depend on the other rows.
// On CPUs with AMX the same packed product runs as TDPBUSD tiles (amx_tiles.h) on a copy
// packed by pack_int8_weight_amx: the same integers, so the same bits again.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || defined(__AVX2__)
#include <immintrin.h>
#define PAGEDSERVE_PACKED_INT8  // the packed product below: vpdpbusd, or its AVX2 kernel
#endif

#include "amx_tiles.h"
#include "cpu_vec.h"
#include "gemm_blocking.h"

#define PRECISE __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace {

constexpr int64_t kGrain = 16;  // rows per parallel task: a decode step stays on one thread

// 1.5 * 2^23: for |v| <= 2^22, (v + kRoundMagic) - kRoundMagic is v rounded half to even
// (the FPU's default mode rounds the sum to the unit of its last place), as torch.round.
// Here |v| <= 127. Unlike std::nearbyint, a libm call per element here, it vectorizes.
constexpr float kRoundMagic = 12582912.f;

// A value as float32, and a float32 stored as T, for the PRECISE functions: they cannot
// inline c10's conversions (other optimization options), which then cost a call per
// element. bfloat16 is a float32's upper half (exact); a float32 becomes one rounded to
// nearest even, NaN as 0x7FC0: c10::BFloat16's own rounding, bit for bit.
template <typename T>
PRECISE inline float to_float(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(v);
  }
}

template <typename T>
PRECISE inline void store_float(T* out, float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    out->x = v != v ? uint16_t{0x7FC0}
                    : static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
  } else {
    *out = static_cast<T>(v);
  }
}

// Not inlined, so that no re-association (fast-math) can fold `inv` back into a division.
template <typename scalar_t>
PRECISE __attribute__((noinline)) void round_scaled(const scalar_t* x, int64_t K, float inv,
                                                    int8_t* q) {
  for (int64_t k = 0; k < K; ++k) {
    const float v = to_float(x[k]) * inv;
    q[k] = static_cast<int8_t>(static_cast<int32_t>((v + kRoundMagic) - kRoundMagic));
  }
}

// 1 / a rounded once to float32 (via double: exact for one division); not inlined, so that
// fast-math cannot fold `reciprocal(a) * 127` back into `127 / a`.
PRECISE __attribute__((noinline)) float reciprocal(float a) {
  return static_cast<float>(1.0 / static_cast<double>(a));
}

// max |x[k]| over k < K, NaNs passed over (a NaN never compares greater); max is exact in
// any order, so a register of lanes (cpu_vec.h) at a time, then across them. The selects
// on vector types stay vectorized without fast-math (on scalars GCC kept them a value at a
// time: 3% of a 1B model's int8 decode step).
template <typename scalar_t>
PRECISE float absmax_of(const scalar_t* x, int64_t K) {
  using pagedserve_vec::kLanes, pagedserve_vec::vf;
  vf lanes = vf{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const vf v = pagedserve_vec::loadv(x + k);
    const vf a = v < 0.f ? -v : v;
    lanes = lanes < a ? a : lanes;
  }
  float absmax = 0.f;
  for (int i = 0; i < kLanes; ++i) absmax = absmax < lanes[i] ? lanes[i] : absmax;
  for (; k < K; ++k) {
    const float v = to_float(x[k]);
    const float a = v < 0.f ? -v : v;
    absmax = absmax < a ? a : absmax;
  }
  return absmax;
}

template <typename scalar_t>
PRECISE void quantize_row(const scalar_t* x, int64_t K, int8_t* q, float* scale) {
  const float absmax = absmax_of(x, K);
  *scale = static_cast<float>(static_cast<double>(absmax) / 127.0);  // one rounding, as torch
  // PyTorch evaluates `127 / absmax` as `absmax.reciprocal() * 127` (Tensor.__rtruediv__):
  // two float32 roundings, not one, so the same here.
  const float inv = reciprocal(std::max(absmax, FLT_MIN)) * 127.f;
  round_scaled(x, K, inv, q);
}

// out[r][n] = (float(c[r][n] - corrections[n]) * xs[r]) * ws[n] + bias[n] for the rows
// [0, rows) (c, ldc apart; out, ldo apart) and columns [0, width): int32 sums (less a packed
// product's corrections; none where null) to the output dtype, a register of columns at a
// time (cpu_vec.h) and the rest one by one, the same operations in the same order (the same
// bits). (The packed product's flushes, before: a pass subtracting the corrections, then a
// call per row and panel with a plain loop: 5.4% of an int8 workload run's samples; 4.4%
// this way, Zen 5.)
template <typename out_t, typename bias_t>
PRECISE void epilogue_rows(const int32_t* c, int64_t ldc, const int32_t* corrections,
                           const float* xs, int64_t rows, const float* ws, const bias_t* bias,
                           int64_t width, out_t* out, int64_t ldo) {
  using pagedserve_vec::kLanes, pagedserve_vec::vf, pagedserve_vec::vi;
  constexpr bool kVector = std::is_same_v<out_t, float> || std::is_same_v<out_t, c10::BFloat16>;
  const int64_t whole = kVector ? width / kLanes * kLanes : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* sums = c + r * ldc;
    out_t* o = out + r * ldo;
    if constexpr (kVector) {
      const vf x_scale = vf{} + xs[r];
      for (int64_t n = 0; n < whole; n += kLanes) {
        vi a, k = vi{};
        std::memcpy(&a, sums + n, sizeof(a));
        if (corrections != nullptr) std::memcpy(&k, corrections + n, sizeof(k));
        vf v = __builtin_convertvector(a - k, vf) * x_scale;
        v = v * pagedserve_vec::loadv(ws + n);
        if (bias != nullptr) v = v + pagedserve_vec::loadv(bias + n);
        pagedserve_vec::storev(o + n, v);
      }
    }
    for (int64_t n = whole; n < width; ++n) {
      const int32_t exact = sums[n] - (corrections != nullptr ? corrections[n] : 0);
      float v = static_cast<float>(exact) * xs[r];
      v = v * ws[n];
      if (bias != nullptr) v = v + to_float(bias[n]);
      store_float(o + n, v);
    }
  }
}

#if defined(PAGEDSERVE_PACKED_INT8)
// The packed weight, for both kernels below (AVX512-VNNI, AVX2) is
// [ceil(N / 64)][ceil(K / 4) + 1][64][4] int8: per panel of 64 output columns, k in quads
// (a quad of one column is one 32-bit lane; zero past N and K), then one row of 64 int32
// corrections, kXOffset * sum_k W[n, k]. A kernel reads x's int8 rows plus kXOffset (128:
// as u8 in [1, 255], an exclusive or with 0x80; or 0), so acc - kXOffset * sum_k W[n, k]
// is the sum of x * W exactly (|acc| <= 255 * 127 * K < 2^31 for K <= kMaxPackedK).
constexpr int kQuadVectors = 4;                    // vectors of 16 columns a panel
constexpr int64_t kQuadPanel = 16 * kQuadVectors;  // output columns per panel
constexpr int kQuadRows = 6;                       // rows of x per micro-kernel call
constexpr int64_t kMaxPackedK = 65536;             // int8.py's PACKED_MAX_K
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// vpdpbusd adds four u8 x s8 products to each int32 lane: x must be unsigned.
constexpr int32_t kXOffset = 128;

// c[r, 0:kQuadPanel] (ldc apart) for r < R continued over `depth` k-quads: x (quads, ldx
// apart) against one panel's run w [depth][kQuadPanel]; `first` starts the sums at zero.
template <int R>
inline void quad_kernel(const int32_t* x, int64_t ldx, const int32_t* w, int64_t depth,
                        int32_t* c, int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  // __v16si, not __m512i (64-bit lanes): with __m512i accumulators GCC 12 spills them to
  // the stack inside the loop (3x slower).
  __v16si acc[R][kQuadVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kQuadVectors; ++v)
      acc[r][v] = (__v16si)(first ? _mm512_setzero_si512()
                                  : _mm512_loadu_si512(c + r * ldc + 16 * v));
  for (int64_t k = 0; k < depth; ++k) {
    __m512i wv[kQuadVectors];
    for (int v = 0; v < kQuadVectors; ++v) wv[v] = _mm512_loadu_si512(w + k * kQuadPanel + 16 * v);
    pagedserve_gemm::prefetch_step(pf, k, depth);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(x[r * ldx + k]);
      for (int v = 0; v < kQuadVectors; ++v)
        acc[r][v] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][v], a, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kQuadVectors; ++v)
      _mm512_storeu_si512(c + r * ldc + 16 * v, (__m512i)acc[r][v]);
}

#elif defined(__AVX2__)
// Without VNNI, x's quads signed (kXOffset 0) against the weight's: vpmaddubsw multiplies
// |w| (u8) by x with w's sign and adds the pairs in int16 (at most 2 * 128 * 127: no
// saturation), vpmaddwd adds those pairs into each column's int32 lane, exactly. A run of 8
// columns' quads is one register; a tile walks its panel 16 columns at a time (AVX2 has 16
// registers: R rows x 2 sums, 2 weights and their absolute values, x, ones).
constexpr int32_t kXOffset = 0;
constexpr int64_t kSubPanel = 16;

template <int R>
inline void quad_kernel(const int32_t* x, int64_t ldx, const int32_t* w, int64_t depth,
                        int32_t* c, int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  constexpr int64_t kSteps = kQuadPanel / kSubPanel;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t s = 0; s < kSteps; ++s) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t k = 0; k < depth; ++k) {
      const auto* wk = reinterpret_cast<const __m256i*>(w + k * kQuadPanel + s * kSubPanel);
      const __m256i w0 = _mm256_loadu_si256(wk), w1 = _mm256_loadu_si256(wk + 1);
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      pagedserve_gemm::prefetch_step(pf, s * depth + k, kSteps * depth);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(x[r * ldx + k]);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        auto* out = reinterpret_cast<__m256i*>(c + r * ldc + s * kSubPanel + 8 * h);
        _mm256_storeu_si256(
            out, first ? acc[r][h] : _mm256_add_epi32(acc[r][h], _mm256_loadu_si256(out)));
      }
  }
}
#endif

#if defined(PAGEDSERVE_PACKED_INT8)
template <int R = kQuadRows>
void quad_kernel_rows(int rows, const int32_t* x, int64_t ldx, const int32_t* w, int64_t depth,
                      int32_t* c, int64_t ldc, bool first, const pagedserve_gemm::Prefetch& pf) {
  if constexpr (R > 1) {
    if (rows < R) return quad_kernel_rows<R - 1>(rows, x, ldx, w, depth, c, ldc, first, pf);
  }
  quad_kernel<R>(x, ldx, w, depth, c, ldc, first, pf);
}
#endif

}  // namespace

// x: float32 / bfloat16 / float16 [R, K], rows contiguous. Raises on another dtype or shape.
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows_int8: x must be [R, K]");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  auto q = torch::empty({R, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({R, 1}, x.options().dtype(torch::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, R, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * K, K, qp + r * K, sp + r);
    });
  });
  return {q, scale};
}

// acc: int32 [M, N] (torch._int_mm's result); x_scale: float32 [M, 1]; w_scale: float32
// [N]; bias: [N] in any float dtype, or None. Returns [M, N] in `dtype`.
torch::Tensor int8_scaled_mm_epilogue(torch::Tensor acc, torch::Tensor x_scale,
                                      torch::Tensor w_scale, std::optional<torch::Tensor> bias,
                                      at::ScalarType dtype) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(),
              "int8_scaled_mm_epilogue: acc must be a contiguous int32 [M, N] tensor");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.numel() == M &&
                  w_scale.scalar_type() == at::kFloat && w_scale.numel() == N,
              "int8_scaled_mm_epilogue: float32 scales of M and N elements");
  x_scale = x_scale.contiguous();
  w_scale = w_scale.contiguous();
  auto out = torch::empty({M, N}, acc.options().dtype(dtype));
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "int8_scaled_mm_epilogue: bias of N elements");
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "epilogue", [&] {
    using out_t = scalar_t;
    out_t* op = out.data_ptr<out_t>();
    const at::ScalarType bias_type = b.defined() ? b.scalar_type() : dtype;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bias_type, "bias", [&] {
      const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, M, kGrain, [&](int64_t begin, int64_t end) {
        epilogue_rows(ap + begin * N, N, nullptr, xs + begin, end - begin, ws, bp, N,
                      op + begin * N, N);
      });
    });
  });
  return out;
}

// Whether this build has the packed int8 product (AVX512-VNNI or AVX2).
bool packed_int8_available() {
#if defined(PAGEDSERVE_PACKED_INT8)
  return true;
#else
  return false;
#endif
}

// qweight int8 [N, K] -> int8 [ceil(N / 64), ceil(K / 4) + 1, 64, 4], the layout above.
// Raises (RuntimeError) without AVX512-VNNI or AVX2, or on another dtype or shape.
torch::Tensor pack_int8_weight(torch::Tensor qweight) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2,
              "pack_int8_weight: qweight must be an int8 [N, K]");
#if defined(PAGEDSERVE_PACKED_INT8)
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(K <= kMaxPackedK, "pack_int8_weight: K = ", K, " > ", kMaxPackedK,
              " could overflow the int32 sums");
  const int64_t panels = (N + kQuadPanel - 1) / kQuadPanel, K4 = (K + 3) / 4;
  const auto source = at::constant_pad_nd(qweight, {0, K4 * 4 - K}).contiguous();
  const auto corrections = source.sum(1, /*keepdim=*/false, at::kInt).mul_(kXOffset);
  auto packed = torch::zeros({panels, K4 + 1, kQuadPanel, 4}, qweight.options());
  const auto* src = reinterpret_cast<const int32_t*>(source.data_ptr<int8_t>());
  const int32_t* sums = corrections.data_ptr<int32_t>();
  auto* dst = reinterpret_cast<int32_t*>(packed.data_ptr<int8_t>());
  pagedserve_gemm::gather_panels<kQuadPanel>(src, N, K4, (K4 + 1) * kQuadPanel, dst);
  for (int64_t n = 0; n < N; ++n)  // each panel's last row: its columns' corrections
    dst[(n / kQuadPanel * (K4 + 1) + K4) * kQuadPanel + n % kQuadPanel] = sums[n];
  return packed;
#else
  TORCH_CHECK(false, "pack_int8_weight: this CPU build has neither AVX512-VNNI nor AVX2");
  return qweight;
#endif
}

// qweight int8 [N, K], K a multiple of 64 -> int8 [ceil(N / 64), K / 64 + 1, 16, 64, 4]:
// pack_int8_weight's layout in k-steps of 16 quads (one AMX B tile a step and 16 columns),
// its corrections row followed by 15 zero rows. Raises (RuntimeError) without AMX, on
// another dtype or on another K.
torch::Tensor pack_int8_weight_amx(torch::Tensor qweight) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 &&
                  qweight.size(1) % 64 == 0,
              "pack_int8_weight_amx: qweight must be an int8 [N, K], K a multiple of 64");
#if defined(PAGEDSERVE_AMX)
  TORCH_CHECK(pagedserve_amx::tiles_permitted(), "pack_int8_weight_amx: no AMX tiles here");
  const int64_t N = qweight.size(0), K4 = qweight.size(1) / 4;
  const int64_t panels = (N + kQuadPanel - 1) / kQuadPanel;
  const auto quads = pack_int8_weight(qweight);  // [panels, K4 + 1, 64, 4]
  auto packed = torch::zeros({panels, K4 / 16 + 1, 16, kQuadPanel, 4}, qweight.options());
  packed.view({panels, K4 + 16, kQuadPanel, 4}).narrow(1, 0, K4 + 1).copy_(quads);
  return packed;
#else
  TORCH_CHECK(false, "pack_int8_weight_amx: this CPU build has no AMX tiles");
  return qweight;
#endif
}

// x [M, K] float32 / bfloat16 / float16 @ the int8 weight packed by pack_int8_weight
// (4-D; or by pack_int8_weight_amx, 5-D: AMX tiles) (N rows, float32 scales w_scale [N])
// + bias -> [M, N] in x's dtype: bit for bit
// int8_scaled_mm_epilogue(torch._int_mm(*quantize_rows_int8(x)...)). Raises (RuntimeError)
// on mismatched shapes or without AVX512-VNNI or AVX2.
torch::Tensor int8_packed_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale,
                                 std::optional<torch::Tensor> bias, int64_t N) {
#if defined(PAGEDSERVE_PACKED_INT8)
  const bool tiles = packed.dim() == 5;
  TORCH_CHECK(x.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  (tiles ? packed.size(2) == 16 && packed.size(3) == kQuadPanel &&
                               packed.size(4) == 4
                         : packed.dim() == 4 && packed.size(2) == kQuadPanel &&
                               packed.size(3) == 4),
              "int8_packed_linear: x must be [M, K] and packed [panels, K/4 + 1, 64, 4] or "
              "[panels, K/64 + 1, 16, 64, 4]");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  // quads of K, and rows of a panel (each kQuadPanel quads): the K4 rows, then corrections
  const int64_t K4 = tiles ? (packed.size(1) - 1) * 16 : packed.size(1) - 1;
  const int64_t panel_rows = tiles ? K4 + 16 : K4 + 1;
  TORCH_CHECK((K + 3) / 4 == K4 && N > (panels - 1) * kQuadPanel && N <= panels * kQuadPanel &&
                  w_scale.scalar_type() == at::kFloat && w_scale.numel() == N,
              "int8_packed_linear: x has K = ", K, " and N = ", N, "; packed is ",
              packed.sizes());
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  // x quantized as quantize_rows_int8 does, then read as u8 (x + 128); K padded to whole
  // quads (the padding meets zero weights)
  const auto xc = x.contiguous();
  auto xu = torch::empty({M, K4 * 4}, x.options().dtype(at::kChar));
  auto x_scale = torch::empty({M}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    int8_t* qp = xu.data_ptr<int8_t>();
    at::parallel_for(0, M, kGrain, [&](int64_t begin, int64_t end) {
      // Copies, not the captured references: a store through int8_t* may alias anything,
      // so a loop bound read through a reference is reloaded after every byte stored and
      // the loop runs a byte at a time (13% of a 2,048 x 576 x 576 product).
      const int64_t cols = K, padded = K4 * 4;
      for (int64_t m = begin; m < end; ++m) {
        int8_t* row = qp + m * padded;
        quantize_row(src + m * cols, cols, row, x_scale.data_ptr<float>() + m);
        if (kXOffset != 0)
          for (int64_t k = 0; k < cols; ++k) row[k] = static_cast<int8_t>(row[k] ^ 0x80);
        std::fill(row + cols, row + padded, 0);
      }
    });
  });
  const auto ws = w_scale.contiguous();
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "int8_packed_linear: bias of N elements");
  const auto* xp = reinterpret_cast<const int32_t*>(xu.data_ptr<int8_t>());
  const auto* wp = reinterpret_cast<const int32_t*>(packed.data_ptr<int8_t>());
  const float* xs = x_scale.data_ptr<float>();
  const float* wsp = ws.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_out", [&] {
    using out_t = scalar_t;
    out_t* op = out.data_ptr<out_t>();
    const at::ScalarType bias_type = b.defined() ? b.scalar_type() : x.scalar_type();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bias_type, "bias", [&] {
      const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
      // the chunk's sums less the corrections, then the epilogue (a flush is one panel's
      // columns)
      auto flush = [&](const int32_t* c, int64_t ldc, int64_t m, int64_t rows, int64_t col0,
                       int64_t col1) {
        const int32_t* corrections = wp + (col0 / kQuadPanel * panel_rows + K4) * kQuadPanel;
        epilogue_rows(c, ldc, corrections, xs + m, rows, wsp + col0,
                      bp == nullptr ? nullptr : bp + col0, std::min(N, col1) - col0,
                      op + m * N + col0, N);
      };
#if defined(PAGEDSERVE_AMX)
      if (tiles) {
        namespace amx = pagedserve_amx;
        amx::for_each_tile<amx::Product::kInt8Quads, int32_t>(
            M, K4 / 16, reinterpret_cast<const uint8_t*>(xp), K4 * 4,
            reinterpret_cast<const uint8_t*>(wp), panels, panel_rows * kQuadPanel * 4, flush);
        return;
      }
#endif
      TORCH_CHECK(!tiles, "int8_packed_linear: this CPU build has no AMX tiles");
      pagedserve_gemm::for_each_tile<int32_t, kQuadRows, kQuadPanel>(
          M, K4, K4 * int64_t{sizeof(int32_t)}, wp, panels, panel_rows * kQuadPanel,
          [&](int rows, int64_t m0, int64_t k0, int64_t depth, const int32_t* w, int32_t* c,
              int64_t ldc, const pagedserve_gemm::Prefetch& pf) {
            quad_kernel_rows(rows, xp + m0 * K4 + k0, K4, w, depth, c, ldc, k0 == 0, pf);
          },
          flush);
    });
  });
  return out;
#else
  TORCH_CHECK(false, "int8_packed_linear: this CPU build has neither AVX512-VNNI nor AVX2");
  return x;
#endif
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quantize_rows_int8", &quantize_rows_int8);
  m.def("int8_scaled_mm_epilogue", &int8_scaled_mm_epilogue);
  m.def("packed_int8_available", &packed_int8_available);
  m.def("pack_int8_weight", &pack_int8_weight);
  m.def("pack_int8_weight_amx", &pack_int8_weight_amx);
  m.def("int8_packed_linear", &int8_packed_linear);
}
