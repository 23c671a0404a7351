// GGUF-quantized matrix multiply with 8-bit activations, for CPU
// (torch.ops.pagedserve.ggml_mul_mat_a8):  out[M, N] = x[M, K] @ W^T,
// W [N, K] kept as GGUF blocks (Q4_1 or Q8_0) repacked at load, x float32.
// For few rows of x (decode) the step is bound by reading W, whose blocks are 3.2x (Q8_0)
// to 6.4x (Q4_1) smaller than float32.
//
// Block formats (ggml's ggml-common.h block_q4_1 / block_q8_0; gguf-py's quants.py):
//   Q4_1 (ggml_type 3), 32 weights: fp16 d, fp16 m, 16 bytes qs; weight j < 16 is the low
//        nibble of qs[j], weight j >= 16 the high nibble of qs[j - 16]; w = d * q + m.
//   Q8_0 (ggml_type 8), 32 weights: fp16 d, int8 qs[32]; w = d * q.
//
// As llama.cpp's CPU backend and vLLM's GGUF kernels (ggml_mul_mat_vec_a8) do, each row of
// x is first quantized per block of 32 (block_q8_1's idea, with float32 scales):
//   da = max|x| / 127,  a = round_half_even(x * (1 / da)),  sa = da * sum(a),
// and a weight block meets its activation block as one integer dot product:
//   Q4_1: sum_j (d q_j + m)(da a_j) = d da sum_j q_j a_j + m sa;   Q8_0: d da sum_j q_j a_j.
// Integer sums are exact; the error is x's rounding to 8 bits per block.
//
// Repacked layout (repack_blocks in models/quant.py; the same bytes per row as GGUF's): each
// row's blocks in groups of 8 (the last group may hold fewer, an even number), a group as
// its G scales d (fp16), then for Q4_1 its G mins m (fp16), then its G blocks' quants:
// one load then gives 8 scales. Activation quants are stored per pair of blocks (b, b + 1)
// as [a_b[0:16], a_b+1[0:16], a_b[16:32], a_b+1[16:32]]: the order in which one 32-byte
// load of the pair's Q4_1 quants splits into low and high nibbles.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_A8_AVX2 1
#endif

#define PRECISE __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace {

constexpr int64_t kBlock = 32;        // weights per block (QK4_1 == QK8_0 == 32)
constexpr int64_t kGroup = 8;         // blocks per group of scales
constexpr int64_t kMaxRowsPerPass = 8;  // rows of x sharing one pass over a weight row
constexpr int64_t kPrefetchBytes = 1536;  // how far ahead in W (best of 1536, 4096 here)

enum GGMLType : int64_t { kQ4_1 = 3, kQ8_0 = 8 };

// A block's bytes: its scale fields (d, and m for Q4_1), then its quants.
struct Q4_1Layout {
  static constexpr bool kHasMin = true;
  static constexpr int64_t kScaleBytes = 4, kQuantBytes = 16;
};
struct Q8_0Layout {
  static constexpr bool kHasMin = false;
  static constexpr int64_t kScaleBytes = 2, kQuantBytes = 32;
};

template <typename Layout>
constexpr int64_t bytes_of() { return Layout::kScaleBytes + Layout::kQuantBytes; }

inline int64_t block_bytes(int64_t type) {
  return type == kQ4_1 ? bytes_of<Q4_1Layout>() : bytes_of<Q8_0Layout>();
}

// Where quant j of block b sits in its row of activation quants (the pair order above).
inline int64_t activation_at(int64_t b, int64_t j) {
  return (b / 2) * 2 * kBlock + (b % 2) * 16 + (j < 16 ? j : j + 16);
}

inline float fp16_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// x's rows quantized per block of 32. d and s are padded with zeros to whole groups.
struct ActivationBlocks {
  int64_t blocks_per_row, scales_per_row;
  std::vector<int8_t> q;  // [M, K], pairs of blocks interleaved (see the layout above)
  std::vector<float> d;   // [M, scales_per_row]
  std::vector<float> s;   // [M, scales_per_row]: d * sum(q)
};

// 1.5 * 2^23: for |v| <= 2^22, (v + kRoundMagic) - kRoundMagic is v rounded half to even
// (the FPU's default mode). Unlike std::nearbyint (a libm call per element) it
// vectorizes; fast-math is off here so that the compiler keeps it.
constexpr float kRoundMagic = 12582912.f;

// Block b of a row x: its quants into the row's activation quants q, its d and s.
PRECISE void quantize_block(const float* x, int64_t b, int8_t* q, float* d, float* s) {
  x += b * kBlock;
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) {
    const float a = x[j] < 0.f ? -x[j] : x[j];
    amax = amax < a ? a : amax;
  }
  *d = amax / 127.f;
  const float id = *d > 0.f ? 1.f / *d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>((x[j] * id + kRoundMagic) - kRoundMagic);
    q[activation_at(b, j)] = static_cast<int8_t>(v);
    sum += v;
  }
  *s = *d * static_cast<float>(sum);
}

ActivationBlocks quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock, ns = (nb + kGroup - 1) / kGroup * kGroup;
  ActivationBlocks a{nb, ns, std::vector<int8_t>(M * K), std::vector<float>(M * ns, 0.f),
                     std::vector<float>(M * ns, 0.f)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      quantize_block(x + m * K, b, a.q.data() + m * K, &a.d[m * ns + b], &a.s[m * ns + b]);
  return a;
}

#ifdef PAGEDSERVE_A8_AVX2

// The 8 int32 sums of 4 products each of unsigned w and signed a bytes: one VNNI
// instruction where the CPU has it, else pairs to int16 (no saturation: w <= 15 for Q4_1,
// |w| <= 127 for Q8_0, |a| <= 127) and pairs of those.
inline __m256i dot_u8_s8(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, a);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a),
                                                 _mm256_set1_epi16(1)));
#endif
}

// A pair of blocks' quants as (low, high) halves in the activations' pair order.
struct Q4_1 : Q4_1Layout {
  static inline void pair(const uint8_t* qs, __m256i w[2]) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    w[0] = _mm256_and_si256(v, mask);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  static inline __m256i dot(__m256i acc, __m256i w, __m256i a) { return dot_u8_s8(acc, w, a); }
};

struct Q8_0 : Q8_0Layout {
  static inline void pair(const uint8_t* qs, __m256i w[2]) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + kBlock));
    w[0] = _mm256_permute2x128_si256(b0, b1, 0x20);
    w[1] = _mm256_permute2x128_si256(b0, b1, 0x31);
  }
  // signed x signed as |w| x (a with w's sign)
  static inline __m256i dot(__m256i acc, __m256i w, __m256i a) {
    return dot_u8_s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  }
};

// 8 fp16 at p (count of them, the rest zero) as floats.
inline __m256 load_fp16x8(const uint8_t* p, int64_t count) {
  if (count == kGroup) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t buf[kGroup] = {};
  std::memcpy(buf, p, count * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[m * ldo] = dot(x row m0 + m, weight row) for m < MT.
template <typename Format, int MT>
void dot_row(const uint8_t* row, const ActivationBlocks& a, int64_t m0, float* out,
             int64_t ldo) {
  const int64_t nb = a.blocks_per_row, K = nb * kBlock, ns = a.scales_per_row;
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nb; g += kGroup) {
    const int64_t G = std::min(kGroup, nb - g);
    const __m256 d = load_fp16x8(row, G);
    const __m256 mins = Format::kHasMin ? load_fp16x8(row + 2 * G, G) : _mm256_setzero_ps();
    const uint8_t* qs = row + Format::kScaleBytes * G;
    row = qs + Format::kQuantBytes * G;
    __m256i w[kGroup / 2][2];
    for (int64_t p = 0; p < G / 2; ++p) Format::pair(qs + 2 * p * Format::kQuantBytes, w[p]);
    for (int m = 0; m < MT; ++m) {
      const int8_t* aq = a.q.data() + (m0 + m) * K + g * kBlock;
      // pair p's sums: block 2p in the low 4 lanes, block 2p + 1 in the high 4
      __m256i sums[kGroup / 2];
      for (int64_t p = 0; p < kGroup / 2; ++p) {
        sums[p] = _mm256_setzero_si256();
        if (p < G / 2) {
          const __m256i* ap = reinterpret_cast<const __m256i*>(aq + p * 2 * kBlock);
          sums[p] = Format::dot(Format::dot(sums[p], w[p][0], _mm256_loadu_si256(ap)), w[p][1],
                                _mm256_loadu_si256(ap + 1));
        }
      }
      // -> one int32 per block: lanes hold blocks 0 2 4 6 1 3 5 7, then in order
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]),
                                          _mm256_hadd_epi32(sums[2], sums[3]));
      const __m256i dots = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      const float* da = a.d.data() + (m0 + m) * ns + g;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, _mm256_loadu_ps(da)),
                               acc[m]);
      if (Format::kHasMin)
        acc[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a.s.data() + (m0 + m) * ns + g), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m * ldo] = hsum(acc[m]);
}

#else  // portable: the same layout, one product at a time

struct Q4_1 : Q4_1Layout {
  static inline int32_t quant(const uint8_t* qs, int64_t b, int j) {
    return j < 16 ? (qs[kQuantBytes * b + j] & 0x0F) : (qs[kQuantBytes * b + j - 16] >> 4);
  }
};

struct Q8_0 : Q8_0Layout {
  static inline int32_t quant(const uint8_t* qs, int64_t b, int j) {
    return static_cast<int8_t>(qs[kQuantBytes * b + j]);
  }
};

template <typename Format, int MT>
void dot_row(const uint8_t* row, const ActivationBlocks& a, int64_t m0, float* out,
             int64_t ldo) {
  const int64_t nb = a.blocks_per_row, K = nb * kBlock, ns = a.scales_per_row;
  float acc[MT] = {};
  for (int64_t g = 0; g < nb; g += kGroup) {
    const int64_t G = std::min(kGroup, nb - g);
    const uint8_t* qs = row + Format::kScaleBytes * G;
    for (int64_t b = 0; b < G; ++b) {
      uint16_t bits[2];
      std::memcpy(&bits[0], row + 2 * b, 2);
      std::memcpy(&bits[1], row + 2 * (G + b), 2);
      const float d = fp16_to_float(bits[0]), mw = Format::kHasMin ? fp16_to_float(bits[1]) : 0.f;
      for (int m = 0; m < MT; ++m) {
        const int8_t* aq = a.q.data() + (m0 + m) * K;
        int32_t sum = 0;
        for (int j = 0; j < kBlock; ++j) sum += Format::quant(qs, b, j) * aq[activation_at(g + b, j)];
        const int64_t s = (m0 + m) * ns + g + b;
        acc[m] += d * a.d[s] * static_cast<float>(sum) + mw * a.s[s];
      }
    }
    row = qs + Format::kQuantBytes * G;
  }
  for (int m = 0; m < MT; ++m) out[m * ldo] = acc[m];
}

#endif

template <typename Format>
void mul_mat(const uint8_t* W, const ActivationBlocks& a, int64_t M, int64_t N, int64_t row_bytes,
             float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = W + n * row_bytes;
      // A row ahead of the hardware prefetcher, which alone left a single thread at
      // ~6 GB/s on SmolLM2's many small weights (1.2-1.5x faster per token with this).
      for (int64_t off = 0; off < row_bytes; off += 64)
        __builtin_prefetch(row + kPrefetchBytes + off);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerPass) {
        float* o = out + m0 * N + n;
        switch (std::min(M - m0, kMaxRowsPerPass)) {
          case 1: dot_row<Format, 1>(row, a, m0, o, N); break;
          case 2: dot_row<Format, 2>(row, a, m0, o, N); break;
          case 3: dot_row<Format, 3>(row, a, m0, o, N); break;
          case 4: dot_row<Format, 4>(row, a, m0, o, N); break;
          case 5: dot_row<Format, 5>(row, a, m0, o, N); break;
          case 6: dot_row<Format, 6>(row, a, m0, o, N); break;
          case 7: dot_row<Format, 7>(row, a, m0, o, N); break;
          default: dot_row<Format, 8>(row, a, m0, o, N); break;
        }
      }
    }
  });
}

}  // namespace

// qweight: uint8 [N, K / 32 * block bytes], GGUF blocks repacked (see the layout above);
// x: float32 [M, K], K a multiple of 64. Returns float32 [M, N]. Raises (RuntimeError) on
// another qweight_type, dtype or shape.
torch::Tensor ggml_mul_mat_a8(torch::Tensor qweight, torch::Tensor x, int64_t qweight_type) {
  TORCH_CHECK(qweight_type == kQ4_1 || qweight_type == kQ8_0,
              "ggml_mul_mat_a8: qweight_type must be 3 (Q4_1) or 8 (Q8_0), got ", qweight_type);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "ggml_mul_mat_a8: qweight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2,
              "ggml_mul_mat_a8: x must be a float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t row_bytes = K / kBlock * block_bytes(qweight_type);
  TORCH_CHECK(K % (2 * kBlock) == 0 && qweight.size(1) == row_bytes,
              "ggml_mul_mat_a8: x has K = ", K, " columns, qweight rows have ", qweight.size(1),
              " bytes; expected K a multiple of 64 and K / 32 * ", block_bytes(qweight_type),
              " bytes");
  x = x.contiguous();
  const ActivationBlocks a = quantize_rows(x.data_ptr<float>(), M, K);
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* W = qweight.data_ptr<uint8_t>();
  if (qweight_type == kQ4_1)
    mul_mat<Q4_1>(W, a, M, N, row_bytes, out.data_ptr<float>());
  else
    mul_mat<Q8_0>(W, a, M, N, row_bytes, out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("ggml_mul_mat_a8", &ggml_mul_mat_a8);
}
