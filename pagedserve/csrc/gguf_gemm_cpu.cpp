// GGUF-quantized matrix multiply for CPU (torch.ops.pagedserve.ggml_mul_mat):
//   out[M, N] = x[M, K] @ W^T,  W [N, K] kept as GGUF blocks, dequantized on the fly.
// For few rows of x (decode) the step is bound by reading W: its blocks are 3.2x (Q8_0)
// to 6.4x (Q4_1) smaller than float32.
//
// Block formats (ggml's ggml-common.h block_q4_1 / block_q8_0; gguf-py's quants.py):
//   Q4_1 (ggml_type 3), 20 bytes per 32 weights: fp16 d, fp16 m, 16 bytes qs;
//        weight j < 16 is the low nibble of qs[j], weight j >= 16 the high nibble of
//        qs[j - 16]; w = d * q + m.
//   Q8_0 (ggml_type 8), 34 bytes per 32 weights: fp16 d, int8 qs[32]; w = d * q.
// Each row of W is K / 32 consecutive blocks (a GGUF tensor's rows as stored).
//
// Weights are exactly those of gguf.quants.dequantize: d * q has at most 19 significant
// bits, so it is exact in float32 and fma(d, q, m) rounds once, like (d * q) + m. Only
// the summation order of the dot products differs from F.linear on the dequantized W.
// Work is split over rows of W with at::parallel_for; x and out are float32. Dequantizing
// bounds a lone decode, so where the CPU has AVX-512 a block is two 16-wide vectors (half
// the conversions of the four 8-wide ones): 1.4-1.8x on SmolLM2's gate/up GEMV.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_GGUF_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per block (QK4_1 == QK8_0 == 32)
constexpr int64_t kMaxRowsPerPass = 8;  // rows of x sharing one pass over a weight row

enum GGMLType : int64_t { kQ4_1 = 3, kQ8_0 = 8 };

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#ifdef PAGEDSERVE_GGUF_AVX2
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#ifdef PAGEDSERVE_GGUF_AVX2

// One block as four vectors of 8 weights, in order.
struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline void dequantize(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(fp16_at(b)), m = _mm256_set1_ps(fp16_at(b + 2));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), m);
  }
#ifdef __AVX512F__
  // The same block as two vectors of 16 weights (half the conversions).
  static inline void dequantize(const uint8_t* b, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(fp16_at(b)), m = _mm512_set1_ps(fp16_at(b + 2));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i parts[2] = {_mm_and_si128(qs, mask), _mm_and_si128(_mm_srli_epi16(qs, 4), mask)};
    for (int j = 0; j < 2; ++j)
      w[j] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[j])), m);
  }
#endif
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline void dequantize(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(fp16_at(b));
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
#ifdef __AVX512F__
  static inline void dequantize(const uint8_t* b, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(fp16_at(b));
    for (int j = 0; j < 2; ++j) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j));
      w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
  }
#endif
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[m * ldo] = dot(x[m * K ...], row) for m < MT: each block is dequantized once for
// all MT rows of x. A block's products are summed before joining the accumulator, so the
// loop-carried chain is one add per block (not one FMA per vector); the multiplies use
// the FMA ports and the adds the separate FP add ports (Zen, Intel alike). The same loop
// twice: with 16-wide vectors where the CPU has AVX-512 (a block is two vectors), else
// with 8-wide ones (four, summed pairwise).
#ifdef __AVX512F__
template <typename Format, int MT>
void dot_row(const uint8_t* row, const float* x, int64_t K, float* out, int64_t ldo) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  __m512 w[2];
  for (int64_t k = 0; k < K; k += kBlock, row += Format::kBytes) {
    Format::dequantize(row, w);
    for (int m = 0; m < MT; ++m) {
      const float* xk = x + m * K + k;
      acc[m] = _mm512_add_ps(acc[m], _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xk + 16),
                                                     _mm512_mul_ps(w[0], _mm512_loadu_ps(xk))));
    }
  }
  for (int m = 0; m < MT; ++m) out[m * ldo] = _mm512_reduce_add_ps(acc[m]);
}
#else
template <typename Format, int MT>
void dot_row(const uint8_t* row, const float* x, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t k = 0; k < K; k += kBlock, row += Format::kBytes) {
    Format::dequantize(row, w);
    for (int m = 0; m < MT; ++m) {
      const float* xk = x + m * K + k;
      const __m256 lo = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xk + 8),
                                        _mm256_mul_ps(w[0], _mm256_loadu_ps(xk)));
      const __m256 hi = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xk + 24),
                                        _mm256_mul_ps(w[2], _mm256_loadu_ps(xk + 16)));
      acc[m] = _mm256_add_ps(acc[m], _mm256_add_ps(lo, hi));
    }
  }
  for (int m = 0; m < MT; ++m) out[m * ldo] = hsum(acc[m]);
}
#endif  // __AVX512F__

#else  // portable: dequantize a block to 32 floats, then plain dot products

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline void dequantize(const uint8_t* b, float w[kBlock]) {
    const float d = fp16_at(b), m = fp16_at(b + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * (b[4 + j] & 0x0F) + m;
      w[j + 16] = d * (b[4 + j] >> 4) + m;
    }
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline void dequantize(const uint8_t* b, float w[kBlock]) {
    const float d = fp16_at(b);
    for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<int8_t>(b[2 + j]);
  }
};

template <typename Format, int MT>
void dot_row(const uint8_t* row, const float* x, int64_t K, float* out, int64_t ldo) {
  float acc[MT] = {};
  float w[kBlock];
  for (int64_t k = 0; k < K; k += kBlock, row += Format::kBytes) {
    Format::dequantize(row, w);
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < kBlock; ++j) acc[m] += w[j] * x[m * K + k + j];
  }
  for (int m = 0; m < MT; ++m) out[m * ldo] = acc[m];
}

#endif

// All M rows of x against one weight row, up to kMaxRowsPerPass rows of x at a time.
template <typename Format>
void dot_row_all(const uint8_t* row, const float* x, int64_t M, int64_t K, float* out,
                 int64_t ldo) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerPass) {
    const float* xm = x + m0 * K;
    float* om = out + m0 * ldo;
    switch (std::min(M - m0, kMaxRowsPerPass)) {
      case 1: dot_row<Format, 1>(row, xm, K, om, ldo); break;
      case 2: dot_row<Format, 2>(row, xm, K, om, ldo); break;
      case 3: dot_row<Format, 3>(row, xm, K, om, ldo); break;
      case 4: dot_row<Format, 4>(row, xm, K, om, ldo); break;
      case 5: dot_row<Format, 5>(row, xm, K, om, ldo); break;
      case 6: dot_row<Format, 6>(row, xm, K, om, ldo); break;
      case 7: dot_row<Format, 7>(row, xm, K, om, ldo); break;
      default: dot_row<Format, 8>(row, xm, K, om, ldo); break;
    }
  }
}

template <typename Format>
void mul_mat(const uint8_t* W, const float* x, int64_t M, int64_t N, int64_t K, float* out) {
  const int64_t row_bytes = K / kBlock * Format::kBytes;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      dot_row_all<Format>(W + n * row_bytes, x, M, K, out + n, N);
  });
}

}  // namespace

// qweight: uint8 [N, K / 32 * block bytes] (rows of GGUF blocks); x: float32 [M, K].
// Returns float32 [M, N]. Raises (RuntimeError) on another qweight_type, dtype or shape.
torch::Tensor ggml_mul_mat(torch::Tensor qweight, torch::Tensor x, int64_t qweight_type) {
  TORCH_CHECK(qweight_type == kQ4_1 || qweight_type == kQ8_0,
              "ggml_mul_mat: qweight_type must be 3 (Q4_1) or 8 (Q8_0), got ", qweight_type);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "ggml_mul_mat: qweight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2,
              "ggml_mul_mat: x must be a float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t block_bytes = qweight_type == kQ4_1 ? Q4_1::kBytes : Q8_0::kBytes;
  TORCH_CHECK(K % kBlock == 0 && qweight.size(1) == K / kBlock * block_bytes,
              "ggml_mul_mat: x has K = ", K, " columns, qweight rows have ", qweight.size(1),
              " bytes; expected K a multiple of 32 and K / 32 * ", block_bytes, " bytes");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* W = qweight.data_ptr<uint8_t>();
  if (qweight_type == kQ4_1)
    mul_mat<Q4_1>(W, x.data_ptr<float>(), M, N, K, out.data_ptr<float>());
  else
    mul_mat<Q8_0>(W, x.data_ptr<float>(), M, N, K, out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("ggml_mul_mat", &ggml_mul_mat);
}
